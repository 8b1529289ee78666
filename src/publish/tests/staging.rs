//! Whatever a worker leaves in staging never stops cleanup or recovery.

use super::*;

// whatever a worker leaves in staging never stops cleanup or recovery

/// Builds a chain of `depth` directories named `name` beneath `dir`, with a file and a
/// symlink at every level, through dirfds (the full path is far beyond PATH_MAX, so no path
/// based call could do it). Every `chmod_every`-th level gets `mode` at the end.
fn deep_chain(dir: &Path, depth: usize, name: &str, mode: u32, chmod_every: usize) {
    use rustix::fs::{mkdirat, openat, symlinkat, Mode as M, OFlags};
    let mut fds = vec![openat(
        rustix::fs::CWD,
        dir,
        OFlags::RDONLY | OFlags::DIRECTORY,
        M::empty(),
    )
    .unwrap()];
    for _ in 0..depth {
        let cur = fds.last().unwrap();
        let f = openat(
            cur,
            "f",
            OFlags::WRONLY | OFlags::CREATE,
            M::from_raw_mode(0o000),
        )
        .unwrap();
        drop(f);
        symlinkat("/etc/passwd", cur, "l").unwrap();
        mkdirat(cur, name, M::from_raw_mode(0o700)).unwrap();
        let next = openat(cur, name, OFlags::RDONLY | OFlags::DIRECTORY, M::empty()).unwrap();
        // Keep at most a few fds: the deep ones are only needed to go on downwards.
        if fds.len() > 4 {
            fds.remove(1);
        }
        fds.push(next);
    }
    drop(fds);
    if chmod_every > 0 {
        // Walk down again and take the permissions away, bottom-most first so that the walk
        // itself still works (as root it would anyway).
        let mut fds = vec![openat(
            rustix::fs::CWD,
            dir,
            OFlags::RDONLY | OFlags::DIRECTORY,
            M::empty(),
        )
        .unwrap()];
        for _ in 0..depth {
            let next = openat(
                fds.last().unwrap(),
                name,
                OFlags::RDONLY | OFlags::DIRECTORY,
                M::empty(),
            )
            .unwrap();
            fds.push(next);
        }
        for (i, fd) in fds.iter().enumerate().skip(1).rev() {
            if i % chmod_every == 0 {
                rustix::fs::fchmod(fd, M::from_raw_mode(mode)).unwrap();
            }
        }
    }
}

#[test]
fn discard_removes_a_chain_deeper_than_path_max_and_the_fd_window() {
    let tmp = tempfile::tempdir().unwrap();
    let ws = open(&tmp);
    let job = Job::create(&ws, spec("deep", &["a.txt"])).unwrap();
    let stage = job.stage_dir();
    // 40 levels of 200-byte names: 8 KB of path, twice PATH_MAX.
    deep_chain(&stage, 40, &"n".repeat(200), 0o000, 3);
    // 2000 levels of short names: far more levels than the walk keeps fds for.
    fs::create_dir(stage.join("short")).unwrap();
    deep_chain(&stage.join("short"), 2000, "d", 0o500, 7);
    job.discard().unwrap();
    assert!(job_dirs(tmp.path()).is_empty());
    assert!(snapshot(tmp.path()).is_empty());
}

#[test]
fn discard_removes_wide_trees_in_rounds() {
    let tmp = tempfile::tempdir().unwrap();
    let ws = open(&tmp);
    let job = Job::create(&ws, spec("wide", &["a.txt"])).unwrap();
    let stage = job.stage_dir();
    // More subdirectories than one scan collects, each with files and a locked subdir.
    for i in 0..700 {
        let d = stage.join(format!("d{i}"));
        fs::create_dir_all(d.join("locked")).unwrap();
        fs::write(d.join("f"), "x").unwrap();
        fs::set_permissions(d.join("locked"), fs::Permissions::from_mode(0o000)).unwrap();
    }
    for i in 0..3000 {
        fs::write(stage.join(format!("file{i}")), "y").unwrap();
    }
    job.discard().unwrap();
    assert!(snapshot(tmp.path()).is_empty());
}

#[test]
fn a_job_dir_the_worker_made_0000_is_still_removed() {
    let tmp = tempfile::tempdir().unwrap();
    let ws = open(&tmp);
    let job = Job::create(&ws, spec("chmod0", &["a.txt"])).unwrap();
    // `chmod 0 ..` from staging, and a read-only staging dir.
    fs::set_permissions(job.stage_dir(), fs::Permissions::from_mode(0o500)).unwrap();
    fs::set_permissions(job.dir(), fs::Permissions::from_mode(0o000)).unwrap();
    job.discard().unwrap();
    assert!(snapshot(tmp.path()).is_empty());
}

#[test]
fn staging_usage_is_counted_and_limited() {
    let tmp = tempfile::tempdir().unwrap();
    let ws = open(&tmp);
    let job = Job::create(&ws, spec("use", &["a.txt", "b.txt"])).unwrap();
    let stage = job.stage_dir();
    fs::write(stage.join("0/a.txt"), vec![b'a'; 1000]).unwrap();
    fs::create_dir_all(stage.join("x/y")).unwrap();
    fs::write(stage.join("x/y/z"), vec![b'z'; 24]).unwrap();
    std::os::unix::fs::symlink("/etc/passwd", stage.join("x/link")).unwrap();
    // A sparse file counts at its apparent size.
    let f = fs::File::create(stage.join("sparse")).unwrap();
    f.set_len(1 << 20).unwrap();
    drop(f);
    // Slots 0 and 1, a.txt, x, x/y, x/y/z, x/link, sparse.
    let u = job.check_staging(100, 10 << 20).unwrap();
    assert_eq!(
        u,
        Usage {
            entries: 8,
            bytes: 1000 + 24 + (1 << 20)
        }
    );
    job.check_staging(8, 1024 + (1 << 20)).unwrap();
    let e = job.check_staging(7, 10 << 20).unwrap_err();
    assert!(
        matches!(
            &e,
            PublishError::StagingLimit {
                limit: StagingLimit::Files { max: 7 }
            }
        ),
        "{e}"
    );
    let e = job.check_staging(100, 1 << 20).unwrap_err();
    assert!(
        matches!(
            &e,
            PublishError::StagingLimit {
                limit: StagingLimit::Bytes { max: 1048576 }
            }
        ),
        "{e}"
    );
    assert!(e.to_string().contains("nothing was published"), "{e}");
    job.discard().unwrap();
}

#[test]
fn recovery_quarantines_a_job_dir_it_cannot_remove_and_goes_on() {
    let tmp = tempfile::tempdir().unwrap();
    write(tmp.path(), "keep.txt", "kept");
    let ws = open(&tmp);
    let j1 = Job::create(&ws, spec("q1", &["a.txt"])).unwrap();
    stage(&j1, 0, "never published");
    std::mem::forget(j1);
    let j2 = Job::create(&ws, spec("q2", &["b.txt"])).unwrap();
    std::mem::forget(j2);
    // Point 0 of recovery is q1's journal unlink: it fails (as an unremovable entry would),
    // so q1 is moved aside; q2 is recovered normally.
    testsim::arm(Mode::Error(0));
    let rec = recover(tmp.path(), &|_, _| Ok(false)).unwrap();
    let names = testsim::disarm();
    assert_eq!(names[0], "publish.cleanup_unlink");
    assert_eq!(names[1], "publish.quarantine");
    assert_eq!(rec.len(), 2, "{rec:?}");
    let q = rec[0].quarantined.clone().expect("q1 quarantined");
    assert_eq!(q, ws.root().join(".airlock-quarantine-q1"));
    assert!(
        rec[0].action.contains("quarantined as"),
        "{}",
        rec[0].action
    );
    assert!(rec[1].quarantined.is_none());
    assert!(job_dirs(tmp.path()).is_empty());
    assert!(q.join("stage/0/a.txt").exists());
    assert!(!tmp.path().join("a.txt").exists());
    // Tools cannot name it, not even through `.` or `..`.
    for raw in [
        ".airlock-quarantine-q1/stage/0/a.txt",
        "./x/../.airlock-quarantine-q1",
        ".airlock-quarantine-other",
    ] {
        for role in [PathRole::Input, PathRole::Output] {
            let e = ws.resolve(raw, role).unwrap_err().to_string();
            assert!(e.contains("quarantined"), "{raw}: {e}");
        }
    }
    // The next recovery reports it and leaves it as it is.
    let before = snapshot(tmp.path());
    let rec = recover(tmp.path(), &|_, _| Ok(false)).unwrap();
    assert_eq!(rec.len(), 1);
    assert!(
        rec[0].action.contains("still quarantined"),
        "{}",
        rec[0].action
    );
    assert_eq!(rec[0].quarantined.as_ref(), Some(&q));
    assert_eq!(snapshot(tmp.path()), before);
}

/// `Journal::read` tells a missing or blank journal from each way one can be damaged (an
/// empty one, `null` with anything after it, or `null` spelled otherwise included).
#[test]
fn journal_read_tells_missing_from_damaged() {
    use super::journal::Journal;
    let tmp = tempfile::tempdir().unwrap();
    let ws = open(&tmp);
    let j = Job::create(&ws, spec("jr", &["a.txt"])).unwrap();
    let dir = j.dir().to_path_buf();
    let path = dir.join("recovery.json");
    let read = || {
        let fd = fs::File::open(&dir).unwrap();
        Journal::read(std::os::fd::AsFd::as_fd(&fd), &dir)
    };
    assert!(
        matches!(read(), Err(JournalError::Missing { path: p }) if p == path),
        "{:?}",
        read()
    );
    let damage = |bytes: &[u8]| {
        fs::write(&path, bytes).unwrap();
        match read() {
            Err(JournalError::Damaged { path: p, reason }) => {
                assert_eq!(p, path);
                reason
            }
            other => panic!("{:?}: {other:?}", String::from_utf8_lossy(bytes)),
        }
    };
    fs::write(&path, b"null").unwrap();
    assert!(
        matches!(read(), Err(JournalError::Blank { path: p }) if p == path),
        "{:?}",
        read()
    );
    for not_blank in [
        &b""[..],
        b"null\n",
        b" null",
        b"nul",
        b"nullnull",
        b"NULL",
        b"null{\"version\": 1",
    ] {
        assert!(
            matches!(damage(not_blank), Damage::Unparsable(_)),
            "{:?}",
            String::from_utf8_lossy(not_blank)
        );
    }
    assert!(matches!(
        damage(b"{\"version\": 1, \"jo"),
        Damage::Unparsable(_)
    ));
    assert!(matches!(damage(b"\x00\xffgarbage"), Damage::Unparsable(_)));
    assert!(matches!(
        damage(b"{\"job\": \"jr\"}"),
        Damage::Unparsable(_)
    ));
    let r = damage(b"{\"version\": 3, \"from\": \"a later release\"}");
    assert!(
        matches!(&r, Damage::UnknownVersion { found } if found == "3"),
        "{r:?}"
    );
    assert!(r.to_string().contains("version is 3"), "{r}");
    let r = damage(b"{\"version\": \"1\"}");
    assert!(
        matches!(&r, Damage::UnknownVersion { found } if found == "\"1\""),
        "{r:?}"
    );
    fs::remove_file(&path).unwrap();
    fs::create_dir(&path).unwrap();
    let r = read().unwrap_err();
    assert!(
        matches!(
            &r,
            JournalError::Damaged {
                reason: Damage::NotAFile { .. },
                ..
            }
        ),
        "{r:?}"
    );
    fs::remove_dir(&path).unwrap();
    std::os::unix::fs::symlink("/etc/passwd", &path).unwrap();
    let r = read().unwrap_err();
    assert!(
        matches!(&r, JournalError::Damaged { reason: Damage::Unreadable(e), .. } if e.raw_os_error() == Some(libc::ELOOP)),
        "{r:?}"
    );
    fs::remove_file(&path).unwrap();
    j.discard().unwrap();
}

/// A job dir without a journal is removed only when it holds nothing but its staging; with
/// anything else in it, it is kept aside as it is.
#[test]
fn recovery_keeps_a_journalless_job_dir_holding_more_than_staging() {
    let tmp = tempfile::tempdir().unwrap();
    let ws = open(&tmp);
    let j = Job::create(&ws, spec("stray", &["a.txt"])).unwrap();
    stage(&j, 0, "staged");
    write(j.dir(), "old-copy", "only copy");
    std::mem::forget(j);
    let plain = Job::create(&ws, spec("plain", &["b.txt"])).unwrap();
    stage(&plain, 0, "staged");
    std::mem::forget(plain);
    let rec = recover(tmp.path(), &|_, _| Ok(false)).unwrap();
    let kept: Vec<_> = rec.iter().filter(|r| r.settled == Settled::Kept).collect();
    assert_eq!(kept.len(), 1, "{rec:?}");
    assert_eq!(kept[0].job, "stray");
    assert!(
        matches!(kept[0].kept.as_deref(), Some(Kept::Unexpected { entries }) if entries == &["old-copy".to_string()]),
        "{rec:?}"
    );
    let q = tmp.path().join(".airlock-quarantine-stray");
    assert_eq!(fs::read_to_string(q.join("old-copy")).unwrap(), "only copy");
    assert_eq!(
        fs::read_to_string(q.join("stage/0/a.txt")).unwrap(),
        "staged"
    );
    assert!(job_dirs(tmp.path()).is_empty());
    assert!(!tmp.path().join(".airlock-quarantine-plain").exists());
}

#[test]
fn recovery_repairs_a_job_dir_without_permissions() {
    let tmp = tempfile::tempdir().unwrap();
    let ws = open(&tmp);
    let j = Job::create(&ws, spec("perm", &["a.txt"])).unwrap();
    deep_chain(&j.stage_dir(), 30, &"p".repeat(250), 0, 2);
    fs::set_permissions(j.dir(), fs::Permissions::from_mode(0o000)).unwrap();
    std::mem::forget(j);
    let rec = recover(tmp.path(), &|_, _| Ok(false)).unwrap();
    assert_eq!(rec.len(), 1);
    assert!(rec[0].quarantined.is_none(), "{rec:?}");
    assert!(snapshot(tmp.path()).is_empty());
}
