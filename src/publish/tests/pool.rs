//! Idle job dirs: reuse, what unfits a dir for reuse, and crashes while one is set aside or
//! taken.

use std::os::fd::AsFd;
use std::os::unix::fs::{symlink, MetadataExt};

use rustix::fs::{Mode as FsMode, OFlags};

use super::*;

/// A workspace whose ended job dirs are kept for reuse.
fn pooled(dir: &tempfile::TempDir) -> Workspace {
    let ws = open(dir);
    ws.keep_idle_job_dirs(4);
    ws
}

/// Runs one call writing `content` to `a.txt` as job `id`; the session commit writes the id
/// to `marker`.
fn call(ws: &Workspace, id: &str, content: &str, marker: &Path) -> Result<(), PublishError> {
    let job = Job::create(ws, spec(id, &["a.txt"]))?;
    fs::write(job.staged_path(0), content).unwrap();
    job.publish_and_commit(|| fs::write(marker, id).map_err(Into::into))
}

/// A pooled workspace whose `a.txt` ("old") one call replaced with "first" (job `j1`,
/// committed to the marker file, returned with the dir holding it).
fn one_call_made() -> (tempfile::TempDir, tempfile::TempDir, PathBuf, Workspace) {
    let tmp = tempfile::tempdir().unwrap();
    let session = tempfile::tempdir().unwrap();
    let marker = session.path().join("committed");
    write(tmp.path(), "a.txt", "old");
    let ws = pooled(&tmp);
    call(&ws, "j1", "first", &marker).unwrap();
    (tmp, session, marker, ws)
}

/// The idle dirs in `root`.
fn idle(root: &Path) -> Vec<String> {
    let mut v: Vec<String> = fs::read_dir(root)
        .unwrap()
        .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
        .filter(|n| n.starts_with(crate::publish::pool::IDLE_PREFIX))
        .collect();
    v.sort();
    v
}

/// Who the dirs of an idle or job dir are (itself, `stage`, `stage/0`, and its journal if it
/// has one): (device, inode, birth time), since a removed file's inode number is soon handed
/// out again.
fn ids(dir: &Path) -> Vec<(u64, u64, std::time::SystemTime)> {
    [
        dir.to_path_buf(),
        dir.join("stage"),
        dir.join("stage/0"),
        dir.join("recovery.json"),
    ]
    .iter()
    .filter_map(|p| {
        let m = fs::symlink_metadata(p).ok()?;
        Some((m.dev(), m.ino(), m.created().unwrap()))
    })
    .collect()
}

/// The one idle dir in `root`, checked clean.
fn the_idle_dir(root: &Path) -> PathBuf {
    let kept = idle(root);
    assert_eq!(kept.len(), 1, "{kept:?}; job dirs {:?}", job_dirs(root));
    let dir = root.join(&kept[0]);
    assert_clean(&dir);
    dir
}

/// A clean idle dir: `stage/0` and nothing else but a blank journal, each dir the daemon's,
/// 0700, without extended attributes; the journal, if any, the daemon's, 0600, `null`.
fn assert_clean(dir: &Path) {
    let me = (
        rustix::process::geteuid().as_raw(),
        rustix::process::getegid().as_raw(),
    );
    let journal = dir.join("recovery.json");
    let mut top = vec!["stage".to_string()];
    if let Ok(m) = fs::symlink_metadata(&journal) {
        assert!(m.is_file(), "{}", journal.display());
        assert_eq!(m.mode() & 0o7777, 0o600, "{}", journal.display());
        assert_eq!((m.uid(), m.gid(), m.nlink()), (me.0, me.1, 1));
        let bytes = fs::read(&journal).unwrap();
        assert!(
            crate::publish::journal::is_blank(&bytes),
            "{}: {:?}",
            journal.display(),
            String::from_utf8_lossy(&bytes)
        );
        top.insert(0, "recovery.json".to_string());
    }
    let levels = [
        (dir.to_path_buf(), top),
        (dir.join("stage"), vec!["0".to_string()]),
        (dir.join("stage/0"), vec![]),
    ];
    for (p, want) in levels {
        let m = fs::symlink_metadata(&p).unwrap();
        assert!(m.is_dir(), "{}", p.display());
        assert_eq!(m.mode() & 0o7777, 0o700, "{}", p.display());
        assert_eq!((m.uid(), m.gid()), me, "{}", p.display());
        let mut names: Vec<String> = fs::read_dir(&p)
            .unwrap()
            .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
            .collect();
        names.sort();
        assert_eq!(names, want, "{}", p.display());
        let fd = rustix::fs::open(&p, OFlags::RDONLY | OFlags::DIRECTORY, FsMode::empty()).unwrap();
        let mut buf = [0u8; 256];
        assert_eq!(
            rustix::fs::flistxattr(&fd, &mut buf[..]).unwrap(),
            0,
            "{}",
            p.display()
        );
    }
}

#[test]
fn an_ended_jobs_dir_is_set_aside_clean_and_reused_by_the_next_job() {
    let (tmp, _session, marker, ws) = one_call_made();
    assert_eq!(
        fs::read_to_string(tmp.path().join("a.txt")).unwrap(),
        "first"
    );
    // The first job's dir, emptied (its backup of the old a.txt gone), is idle.
    let first = idle(tmp.path());
    assert_eq!(first.len(), 1, "{first:?}");
    assert!(job_dirs(tmp.path())
        .iter()
        .all(|d| d.starts_with(crate::publish::pool::IDLE_PREFIX)));
    let idle_dir = tmp.path().join(&first[0]);
    assert_clean(&idle_dir);
    let before = ids(&idle_dir);
    assert_eq!(before.len(), 4, "three dirs and the blank journal");

    // The next job takes it: the same three dirs and journal, under the job's name; its
    // journal is written over the blank one.
    let job = Job::create(&ws, spec("j2", &["a.txt"])).unwrap();
    assert!(idle(tmp.path()).is_empty());
    assert_eq!(ids(job.dir()), before);
    assert_eq!(job.staged_path(0), job.dir().join("stage/0/a.txt"));
    fs::write(job.staged_path(0), "second").unwrap();
    let journal = job.dir().join("recovery.json");
    job.publish_and_commit(|| {
        let j: serde_json::Value = serde_json::from_slice(&fs::read(&journal).unwrap()).unwrap();
        assert_eq!(
            (&j["job"], &j["phase"]),
            (&"j2".into(), &"publishing_outputs".into())
        );
        fs::write(&marker, "j2").map_err(Into::into)
    })
    .unwrap();
    assert_eq!(
        fs::read_to_string(tmp.path().join("a.txt")).unwrap(),
        "second"
    );
    assert_eq!(ids(&the_idle_dir(tmp.path())), before);

    // A job with more outputs than the kept slot makes the others, and sets aside only the
    // first.
    let job = Job::create(&ws, spec("j3", &["a.txt", "b.txt"])).unwrap();
    assert_eq!(ids(job.dir()), before);
    stage(&job, 0, "third a");
    stage(&job, 1, "third b");
    job.publish_and_commit(|| Ok::<(), CallbackError>(()))
        .unwrap();
    assert_eq!(
        fs::read_to_string(tmp.path().join("b.txt")).unwrap(),
        "third b"
    );
    the_idle_dir(tmp.path());

    // Recovery removes idle dirs without reporting them; the workspace holds the outputs.
    drop(ws);
    let rec = recover(tmp.path(), &|_, _| Ok(true)).unwrap();
    assert!(rec.is_empty(), "{rec:?}");
    assert!(job_dirs(tmp.path()).is_empty());
    let want: BTreeMap<PathBuf, Entry> = [("a.txt", "third a"), ("b.txt", "third b")]
        .iter()
        .map(|(p, c)| (PathBuf::from(p), Entry::File(c.as_bytes().to_vec())))
        .collect();
    assert_eq!(snapshot(tmp.path()), want);
}

#[test]
fn a_journal_is_blanked_in_place_keeping_its_block_and_one_longer_than_a_block_is_cut() {
    let tmp = tempfile::tempdir().unwrap();
    let session = tempfile::tempdir().unwrap();
    let marker = session.path().join("committed");
    let ws = pooled(&tmp);
    // A job of two outputs: its journal is blanked padded to its own length.
    let job = Job::create(&ws, spec("j1", &["a.txt", "b.txt"])).unwrap();
    stage(&job, 0, "1a");
    stage(&job, 1, "1b");
    job.publish_and_commit(|| fs::write(&marker, "j1").map_err(Into::into))
        .unwrap();
    let journal = the_idle_dir(tmp.path()).join("recovery.json");
    let first = fs::metadata(&journal).unwrap();
    assert!(first.len() > 100, "{}", first.len());
    assert!(first.blocks() > 0);

    // A job of one output writes a shorter journal over that blank: the padding that is
    // left is spaces, so recovery (here, a read from inside the commit) reads the journal.
    let job = Job::create(&ws, spec("j2", &["a.txt"])).unwrap();
    stage(&job, 0, "2a");
    let (dir, path) = (job.dir().to_path_buf(), job.dir().join("recovery.json"));
    job.publish_and_commit(|| {
        let bytes = fs::read(&path).unwrap();
        assert_eq!(bytes.len() as u64, first.len(), "written over, not cut");
        let fd =
            rustix::fs::open(&dir, OFlags::RDONLY | OFlags::DIRECTORY, FsMode::empty()).unwrap();
        let j = crate::publish::journal::Journal::read(fd.as_fd(), &dir).unwrap();
        assert_eq!((j.job.as_str(), j.targets.len()), ("j2", 1));
        fs::write(&marker, "j2").map_err(Into::into)
    })
    .unwrap();
    // Blanked again: the same inode, size and blocks; no block freed, none allocated.
    let journal = the_idle_dir(tmp.path()).join("recovery.json");
    let second = fs::metadata(&journal).unwrap();
    assert_eq!(
        (second.ino(), second.len(), second.blocks()),
        (first.ino(), first.len(), first.blocks())
    );

    // A journal longer than a block is cut to the bare blank, so that no blank costs more
    // than a block to write.
    let names: Vec<String> = (0..40)
        .map(|i| format!("{i:03}-{}.txt", "n".repeat(60)))
        .collect();
    let refs: Vec<&str> = names.iter().map(String::as_str).collect();
    let job = Job::create(&ws, spec("j3", &refs)).unwrap();
    for i in 0..refs.len() {
        stage(&job, i, "3");
    }
    let path = job.dir().join("recovery.json");
    job.publish_and_commit(|| {
        let len = fs::metadata(&path).unwrap().len();
        assert!(len > crate::publish::journal::PAD_MAX, "{len}");
        fs::write(&marker, "j3").map_err(Into::into)
    })
    .unwrap();
    let journal = the_idle_dir(tmp.path()).join("recovery.json");
    assert_eq!(fs::read(&journal).unwrap(), b"null");

    // Recovery reads every blank as settled: it removes the idle dir, reporting nothing.
    drop(ws);
    let rec = recover(tmp.path(), &|_, _| Ok(true)).unwrap();
    assert!(rec.is_empty(), "{rec:?}");
    assert!(job_dirs(tmp.path()).is_empty());
}

#[test]
fn what_a_worker_left_is_cleared_and_its_permissions_taken_back_before_a_dir_is_set_aside() {
    let tmp = tempfile::tempdir().unwrap();
    let ws = pooled(&tmp);
    let job = Job::create(&ws, spec("j1", &["a.txt"])).unwrap();
    let st = job.dir().join("stage");
    // A worker's leavings: scratch files and trees in staging and in its slot, a symlink,
    // a FIFO, modes opened up and taken away.
    fs::write(st.join("scratch"), "x").unwrap();
    fs::create_dir_all(st.join("tmp/deep/er")).unwrap();
    fs::write(st.join("tmp/deep/er/f"), "y").unwrap();
    fs::write(st.join("0/extra"), "z").unwrap();
    symlink("/etc/passwd", st.join("0/link")).unwrap();
    rustix::fs::mknodat(
        rustix::fs::CWD,
        st.join("0/fifo"),
        rustix::fs::FileType::Fifo,
        FsMode::from_raw_mode(0o600),
        0,
    )
    .unwrap();
    fs::set_permissions(st.join("tmp/deep"), fs::Permissions::from_mode(0o000)).unwrap();
    fs::set_permissions(&st, fs::Permissions::from_mode(0o777)).unwrap();
    fs::set_permissions(st.join("0"), fs::Permissions::from_mode(0o755)).unwrap();
    // A worker with its own uid owns its staging dirs.
    rustix::fs::chown(&st, Some(rustix::process::Uid::from_raw(60999)), None).unwrap();
    rustix::fs::chown(
        st.join("0"),
        Some(rustix::process::Uid::from_raw(60999)),
        None,
    )
    .unwrap();
    stage(&job, 0, "out");
    job.publish_and_commit(|| Ok::<(), CallbackError>(()))
        .unwrap();
    assert_eq!(fs::read_to_string(tmp.path().join("a.txt")).unwrap(), "out");
    the_idle_dir(tmp.path());
    // Discarding a job that did not publish sets its dir aside too.
    let job = Job::create(&ws, spec("j2", &["a.txt"])).unwrap();
    fs::write(job.dir().join("stage/left"), "x").unwrap();
    job.discard().unwrap();
    the_idle_dir(tmp.path());
    assert_eq!(fs::read_to_string(tmp.path().join("a.txt")).unwrap(), "out");
}

/// Each way an idle dir can be unfit (were it changed while idle): the next job gets a fresh
/// tree, the unfit one is gone, and nothing planted reaches the job's staging or the
/// workspace.
#[test]
fn an_idle_dir_changed_while_idle_is_removed_not_reused() {
    type Tamper = fn(&Path);
    let tampers: &[(&str, Tamper)] = &[
        ("stage opened up", |d| {
            fs::set_permissions(d.join("stage"), fs::Permissions::from_mode(0o777)).unwrap()
        }),
        ("job dir opened up", |d| {
            fs::set_permissions(d, fs::Permissions::from_mode(0o711)).unwrap()
        }),
        ("slot given away", |d| {
            rustix::fs::chown(
                d.join("stage/0"),
                Some(rustix::process::Uid::from_raw(60999)),
                None,
            )
            .unwrap()
        }),
        ("file planted in the slot", |d| {
            fs::write(d.join("stage/0/a.txt"), "planted").unwrap()
        }),
        ("file planted in staging", |d| {
            fs::write(d.join("stage/planted"), "planted").unwrap()
        }),
        ("file planted in the job dir", |d| {
            fs::write(d.join("recovery.json.tmp"), "planted").unwrap()
        }),
        ("journal not blank", |d| {
            fs::write(d.join("recovery.json"), "{}").unwrap()
        }),
        ("journal cut to nothing", |d| {
            fs::write(d.join("recovery.json"), "").unwrap()
        }),
        ("journal opened up", |d| {
            fs::set_permissions(d.join("recovery.json"), fs::Permissions::from_mode(0o644)).unwrap()
        }),
        ("journal given away", |d| {
            rustix::fs::chown(
                d.join("recovery.json"),
                Some(rustix::process::Uid::from_raw(60999)),
                None,
            )
            .unwrap()
        }),
        ("journal linked elsewhere", |d| {
            fs::hard_link(d.join("recovery.json"), d.join("../linked")).unwrap()
        }),
        ("journal replaced by a symlink", |d| {
            fs::remove_file(d.join("recovery.json")).unwrap();
            symlink("/etc/passwd", d.join("recovery.json")).unwrap();
        }),
        ("journal replaced by a FIFO", |d| {
            fs::remove_file(d.join("recovery.json")).unwrap();
            rustix::fs::mknodat(
                rustix::fs::CWD,
                d.join("recovery.json"),
                rustix::fs::FileType::Fifo,
                FsMode::from_raw_mode(0o600),
                0,
            )
            .unwrap();
        }),
        ("an xattr on the journal", |d| {
            set_xattr(&d.join("recovery.json"), "user.planted")
        }),
        ("slot replaced by a symlink", |d| {
            fs::remove_dir(d.join("stage/0")).unwrap();
            symlink("/tmp", d.join("stage/0")).unwrap();
        }),
        ("slot missing", |d| {
            fs::remove_dir(d.join("stage/0")).unwrap()
        }),
        ("an xattr on the slot", |d| {
            set_xattr(&d.join("stage/0"), "user.planted")
        }),
        ("a default ACL on staging", |d| {
            // The kernel's binary form of `default:user::rwx,group::---,other::---`: a
            // version, then (tag, permissions, id) per entry.
            let mut acl = 2u32.to_le_bytes().to_vec();
            for (tag, perm) in [(0x01u16, 7u16), (0x04, 0), (0x20, 0)] {
                acl.extend(tag.to_le_bytes());
                acl.extend(perm.to_le_bytes());
                acl.extend(u32::MAX.to_le_bytes());
            }
            rustix::fs::setxattr(
                d.join("stage"),
                "system.posix_acl_default",
                &acl,
                rustix::fs::XattrFlags::empty(),
            )
            .unwrap()
        }),
        ("an inode flag on staging", |d| {
            let fd = rustix::fs::open(
                d.join("stage"),
                OFlags::RDONLY | OFlags::DIRECTORY,
                FsMode::empty(),
            )
            .unwrap();
            let f = rustix::fs::ioctl_getflags(&fd).unwrap();
            rustix::fs::ioctl_setflags(&fd, f | rustix::fs::IFlags::NODUMP).unwrap();
        }),
    ];
    for (what, tamper) in tampers {
        // An idle dir with its blank journal, from a committed call.
        let (tmp, _session, _marker, ws) = one_call_made();
        let dir = the_idle_dir(tmp.path());
        let before = ids(&dir);
        tamper(&dir);
        let job = Job::create(&ws, spec("j2", &["a.txt"])).unwrap();
        assert_ne!(ids(job.dir())[0], before[0], "{what}: reused");
        assert!(idle(tmp.path()).is_empty(), "{what}: the unfit dir is left");
        let staged: Vec<_> = fs::read_dir(job.dir().join("stage/0")).unwrap().collect();
        assert!(staged.is_empty(), "{what}");
        assert_eq!(
            fs::symlink_metadata(job.dir().join("stage"))
                .unwrap()
                .mode()
                & 0o7777,
            0o700,
            "{what}"
        );
        stage(&job, 0, "new");
        job.publish_and_commit(|| Ok::<(), CallbackError>(()))
            .unwrap();
        assert_eq!(
            fs::read_to_string(tmp.path().join("a.txt")).unwrap(),
            "new",
            "{what}"
        );
        the_idle_dir(tmp.path());
        drop(ws);
        recover(tmp.path(), &|_, _| Ok(true)).unwrap();
        let _ = fs::remove_file(tmp.path().join("linked"));
        let want: BTreeMap<PathBuf, Entry> =
            [(PathBuf::from("a.txt"), Entry::File(b"new".to_vec()))]
                .into_iter()
                .collect();
        assert_eq!(snapshot(tmp.path()), want, "{what}");
    }
}

fn set_xattr(p: &Path, name: &str) {
    rustix::fs::setxattr(p, name, b"v", rustix::fs::XattrFlags::empty()).unwrap();
}

/// A second call, whose job takes the first's idle dir and sets it aside again: crash at
/// every one of its points (the pool's included), then recover: the workspace holds the
/// first or the second call's output as the session says, no job or idle dir is left, and
/// a second recovery finds nothing. An error at every point instead: the call fails
/// all-old or succeeds all-new, and whatever idle dir is left is clean.
#[test]
fn a_crash_or_an_error_at_every_point_of_a_reusing_call_is_recovered() {
    let points = {
        let (_tmp, _s, marker, ws) = one_call_made();
        testsim::arm(Mode::Off);
        call(&ws, "j2", "second", &marker).unwrap();
        testsim::disarm()
    };
    for p in ["publish.pool_take", "publish.pool_keep"] {
        assert!(points.contains(&p), "{p} not reached: {points:?}");
    }
    for (k, point) in points.iter().enumerate() {
        for crash in [true, false] {
            let (tmp, _s, marker, ws) = one_call_made();
            testsim::arm(if crash {
                Mode::Crash(k)
            } else {
                Mode::Error(k)
            });
            let r = call(&ws, "j2", "second", &marker);
            testsim::disarm();
            let committed = fs::read_to_string(&marker).unwrap() == "j2";
            let what = format!(
                "{} at {k} ({})",
                if crash { "crash" } else { "error" },
                point
            );
            assert!(r.is_err() || committed, "{what}");
            if !crash {
                assert_eq!(r.is_ok(), committed, "{what}: {r:?}");
                for d in idle(tmp.path()) {
                    assert_clean(&tmp.path().join(d));
                }
            }
            drop(ws);
            let m = marker.clone();
            let asked = move |_: &str, job: &str| -> Result<bool, CallbackError> {
                Ok(fs::read_to_string(&m).map(|s| s == job).unwrap_or(false))
            };
            recover(tmp.path(), &asked).unwrap();
            let content = if committed { "second" } else { "first" };
            let want: BTreeMap<PathBuf, Entry> = [(
                PathBuf::from("a.txt"),
                Entry::File(content.as_bytes().to_vec()),
            )]
            .into_iter()
            .collect();
            assert_eq!(snapshot(tmp.path()), want, "{what}");
            assert!(recover(tmp.path(), &asked).unwrap().is_empty(), "{what}");
        }
    }
}

/// An idle dir is removed unreported only while its journal is blank or absent: one whose
/// journal reads otherwise (a blank lost to a power cut, or a journal planted) proves
/// nothing, and recovery keeps it aside as it is, the files in it included.
#[test]
fn an_idle_dir_whose_journal_is_not_blank_is_kept_aside_by_recovery() {
    for (what, bytes) in [
        ("cut to nothing", &b""[..]),
        ("a journal", br#"{"version": 1, "job": "j9"}"#),
    ] {
        let (tmp, _session, _marker, ws) = one_call_made();
        let dir = the_idle_dir(tmp.path());
        fs::write(dir.join("recovery.json"), bytes).unwrap();
        fs::write(dir.join("stage/0/a.txt"), "maybe the only old copy").unwrap();
        drop(ws);
        let rec = recover(tmp.path(), &|_, _| Ok(true)).unwrap();
        assert_eq!(rec.len(), 1, "{what}: {rec:?}");
        assert_eq!(rec[0].settled, Settled::Kept, "{what}: {rec:?}");
        let q = rec[0].quarantined.clone().expect("quarantined");
        assert_eq!(
            fs::read_to_string(q.join("stage/0/a.txt")).unwrap(),
            "maybe the only old copy",
            "{what}"
        );
        assert!(idle(tmp.path()).is_empty(), "{what}");
        assert_eq!(
            fs::read_to_string(tmp.path().join("a.txt")).unwrap(),
            "first",
            "{what}"
        );
    }
}

/// The jobs after a dir's first are spared the root's fsync: the dir's entry is durable
/// already, under the name its first job gave it. After a power loss the dir holding a
/// job's durable journal may so bear an idle name or an earlier job's; recovery goes by the
/// job the journal names, rolls it back or completes it as the session says, and reports it
/// as that job. A second dir whose journal names the same job is kept aside, untouched.
#[test]
fn a_reused_dir_that_lost_its_new_name_is_recovered_as_its_journals_job() {
    // The first call's dir is made fresh: its journal's fsyncs include the root's.
    let first = {
        let tmp = tempfile::tempdir().unwrap();
        let session = tempfile::tempdir().unwrap();
        let ws = pooled(&tmp);
        write(tmp.path(), "a.txt", "old");
        testsim::arm(Mode::Off);
        call(&ws, "j1", "first", &session.path().join("committed")).unwrap();
        testsim::disarm()
    };
    assert!(first.contains(&"publish.fsync_root"), "{first:?}");
    let second = {
        let (_tmp, _s, marker, ws) = one_call_made();
        testsim::arm(Mode::Off);
        call(&ws, "j2", "second", &marker).unwrap();
        testsim::disarm()
    };
    assert!(second.contains(&"publish.pool_take"), "{second:?}");
    assert!(!second.contains(&"publish.fsync_root"), "{second:?}");
    // Crash once the outputs are renamed, before the commit.
    let renamed = second
        .iter()
        .position(|p| *p == "publish.fsync_renamed")
        .expect("a rename's fsync");

    for earlier in [".airlock-job-.idle-777", ".airlock-job-j1"] {
        for committed in [false, true] {
            let what = format!("under {earlier}, committed {committed}");
            let (tmp, _s, _marker, ws) = one_call_made();
            testsim::arm(Mode::Crash(renamed));
            call(&ws, "j2", "second", &tmp.path().join("unused")).unwrap_err();
            testsim::disarm();
            drop(ws);
            assert_eq!(job_dirs(tmp.path()), vec![".airlock-job-j2".to_string()]);
            // The power loss: the rename to the job's name never reached the disk.
            fs::rename(tmp.path().join(".airlock-job-j2"), tmp.path().join(earlier)).unwrap();
            // And a second dir whose journal names the same job: not that job's.
            let other = tmp.path().join(".airlock-job-zzz");
            fs::create_dir_all(other.join("stage/0")).unwrap();
            fs::copy(
                tmp.path().join(earlier).join("recovery.json"),
                other.join("recovery.json"),
            )
            .unwrap();
            fs::write(other.join("stage/0/a.txt"), "kept as it is").unwrap();

            let asked = move |_: &str, job: &str| -> Result<bool, CallbackError> {
                Ok(committed && job == "j2")
            };
            let rec = recover(tmp.path(), &asked).unwrap();
            assert_eq!(rec.len(), 2, "{what}: {rec:?}");
            assert_eq!(rec[0].job, "j2", "{what}: {rec:?}");
            let settled = if committed {
                Settled::Completed
            } else {
                Settled::RolledBack
            };
            assert_eq!(rec[0].settled, settled, "{what}: {rec:?}");
            assert_eq!(rec[1].settled, Settled::Kept, "{what}: {rec:?}");
            let q = rec[1].quarantined.clone().expect("quarantined");
            assert_eq!(
                fs::read_to_string(q.join("stage/0/a.txt")).unwrap(),
                "kept as it is",
                "{what}"
            );
            let content = if committed { "second" } else { "first" };
            assert_eq!(
                fs::read_to_string(tmp.path().join("a.txt")).unwrap(),
                content,
                "{what}"
            );
            assert!(job_dirs(tmp.path()).is_empty(), "{what}");
        }
    }
}

/// A dir a worker filled with many entries keeps its size once emptied (ext4 never shrinks
/// a dir): it is removed, not set aside, so it neither holds that room while idle nor tells
/// the next call how much its predecessor made. A dir of ordinary use is kept.
#[test]
fn a_staging_dir_grown_by_many_entries_is_removed_not_set_aside() {
    let tmp = tempfile::tempdir().unwrap();
    let ws = pooled(&tmp);
    let job = Job::create(&ws, spec("j1", &["a.txt"])).unwrap();
    let slot = job.staged_path(0).parent().unwrap().to_path_buf();
    for i in 0..400 {
        fs::write(slot.join(format!("{i:0>200}")), "x").unwrap();
    }
    let grown = fs::metadata(&slot).unwrap().len();
    assert!(grown > 4096, "the slot grew: {grown} bytes");
    job.discard().unwrap();
    assert!(idle(tmp.path()).is_empty(), "{:?}", idle(tmp.path()));
    assert!(job_dirs(tmp.path()).is_empty());
    // An ordinary job's dir is set aside.
    let job = Job::create(&ws, spec("j2", &["a.txt"])).unwrap();
    fs::write(job.staged_path(0), "x").unwrap();
    job.discard().unwrap();
    assert_eq!(idle(tmp.path()).len(), 1);
}
