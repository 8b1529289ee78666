//! A job's dir and journal, and the publication of its outputs.

use super::*;

// create and the journal

#[test]
fn create_makes_private_job_dir_and_journal() {
    let tmp = tempfile::tempdir().unwrap();
    let ws = open(&tmp);
    let mut job = Job::create(&ws, spec("j1", &["out/report.html", "b.txt"])).unwrap();
    assert_eq!(
        job.dir(),
        tmp.path().canonicalize().unwrap().join(".airlock-job-j1")
    );
    assert_eq!(
        fs::metadata(job.dir()).unwrap().permissions().mode() & 0o777,
        0o700
    );
    // The journal is written once, at publication: none while the worker runs.
    let journal_path = job.dir().join("recovery.json");
    assert!(!journal_path.exists());
    assert_eq!(job.staged_path(0), job.dir().join("stage/0/report.html"));
    assert_eq!(job.staged_path(1), job.dir().join("stage/1/b.txt"));
    assert!(job.staged_path(0).parent().unwrap().is_dir());
    job.record_worker(4242).unwrap();
    assert!(!journal_path.exists());
    stage(&job, 0, "report");
    stage(&job, 1, "b");
    let dir = job.dir().to_path_buf();
    job.publish_and_commit(|| {
        let path = dir.join("recovery.json");
        assert_eq!(
            fs::metadata(&path).unwrap().permissions().mode() & 0o777,
            0o600
        );
        let j: serde_json::Value = serde_json::from_slice(&fs::read(&path).unwrap()).unwrap();
        assert_eq!(j["phase"], "publishing_outputs");
        assert_eq!(j["job"], "j1");
        assert_eq!(j["session"], "s1");
        assert_eq!(j["tool"], "render");
        assert_eq!(j["worker_pid"], 4242);
        assert_eq!(j["targets"][0]["target"], "out/report.html");
        Ok(())
    })
    .unwrap();
    assert!(job_dirs(tmp.path()).is_empty());
}

#[test]
fn create_rejects_bad_specs() {
    let tmp = tempfile::tempdir().unwrap();
    let ws = open(&tmp);
    for (id, targets) in [
        ("../x", vec!["a"]),
        ("", vec!["a"]),
        ("a.b", vec!["a"]),
        ("ok", vec!["../a"]),
        ("ok", vec!["/abs"]),
        ("ok", vec!["a", "a"]),
        ("ok", vec!["a", "a/b"]),
        ("ok", vec![".airlock-job-z/f"]),
        ("ok", vec![""]),
    ] {
        let r = Job::create(&ws, spec(id, &targets));
        assert!(
            matches!(r, Err(PublishError::InvalidSpec { .. })),
            "{id:?} {targets:?}: {r:?}"
        );
    }
    assert!(snapshot(tmp.path()).is_empty());
}

#[test]
fn discard_never_follows_symlinks_planted_in_stage() {
    let tmp = tempfile::tempdir().unwrap();
    let outside = tempfile::tempdir().unwrap();
    write(outside.path(), "keep/me.txt", "precious");
    let ws = open(&tmp);
    let job = Job::create(&ws, spec("j", &["a.txt"])).unwrap();
    let stage = job.stage_dir();
    std::os::unix::fs::symlink(outside.path().join("keep"), stage.join("evil")).unwrap();
    fs::remove_dir(stage.join("0")).unwrap();
    std::os::unix::fs::symlink(outside.path().join("keep"), stage.join("0")).unwrap();
    // A directory without permissions is still removed.
    fs::create_dir_all(stage.join("locked/inner")).unwrap();
    fs::set_permissions(stage.join("locked"), fs::Permissions::from_mode(0o000)).unwrap();
    job.discard().unwrap();
    assert!(job_dirs(tmp.path()).is_empty());
    assert_eq!(
        fs::read_to_string(outside.path().join("keep/me.txt")).unwrap(),
        "precious"
    );
}

// ---------------------------------------------------------------------------------------
// publication

/// Whatever owner and mode the worker left on a staged output (setuid, setgid, sticky, group
/// and other write, another uid), the published file is the daemon's, with the declared mode.
#[test]
fn published_outputs_are_sealed() {
    use std::os::unix::fs::{MetadataExt, PermissionsExt};
    assert!(
        rustix::process::geteuid().is_root(),
        "this test needs root (it stages a file owned by another uid)"
    );
    let tmp = tempfile::tempdir().unwrap();
    let ws = open(&tmp);
    let mut s = spec("j", &["a.bin", "b.sh"]);
    s.modes = vec![Some(crate::policy::DEFAULT_OUTPUT_MODE), Some(0o755)];
    s.stage_owner = Some((60999, 60999));
    let job = Job::create(&ws, s).unwrap();
    // The staging dir is the daemon's, with the worker's group (0770: the worker writes in
    // it, cannot open it up); its slots are the worker's; the job dir lets the worker
    // through, nobody else in.
    let stage_meta = fs::metadata(job.stage_dir()).unwrap();
    let euid = rustix::process::geteuid().as_raw();
    assert_eq!((stage_meta.uid(), stage_meta.gid()), (euid, 60999));
    assert_eq!(stage_meta.mode() & 0o7777, 0o770);
    let slot_meta = fs::metadata(job.staged_path(0).parent().unwrap()).unwrap();
    assert_eq!((slot_meta.uid(), slot_meta.gid()), (60999, 60999));
    assert_eq!(fs::metadata(job.dir()).unwrap().mode() & 0o777, 0o711);
    for i in 0..2 {
        let p = job.staged_path(i);
        stage(&job, i, "#!/bin/sh\n");
        std::os::unix::fs::chown(&p, Some(60999), Some(60999)).unwrap();
        fs::set_permissions(&p, fs::Permissions::from_mode(0o7777)).unwrap();
    }
    job.publish_and_commit(|| Ok(())).unwrap();
    let euid = rustix::process::geteuid().as_raw();
    let egid = rustix::process::getegid().as_raw();
    for (name, mode) in [("a.bin", 0o644), ("b.sh", 0o755)] {
        let m = fs::metadata(tmp.path().join(name)).unwrap();
        assert_eq!(
            (m.mode() & 0o7777, m.uid(), m.gid()),
            (mode, euid, egid),
            "{name}"
        );
    }
}

/// An output without a declared mode keeps the permission bits of the regular file it
/// replaces, less setuid/setgid/sticky and group/other write; a declared mode wins; a new
/// target gets 0644.
#[test]
fn an_output_keeps_the_replaced_files_mode_unless_its_mode_is_declared() {
    use std::os::unix::fs::PermissionsExt;
    let tmp = tempfile::tempdir().unwrap();
    for (name, mode) in [("x.sh", 0o755), ("p.sh", 0o755), ("s.sh", 0o4775)] {
        write(tmp.path(), name, "old");
        fs::set_permissions(tmp.path().join(name), fs::Permissions::from_mode(mode)).unwrap();
    }
    let ws = open(&tmp);
    let mut s = spec("j", &["x.sh", "p.sh", "s.sh", "new.txt"]);
    s.modes = vec![None, Some(0o600), None, None];
    let job = Job::create(&ws, s).unwrap();
    for i in 0..4 {
        stage(&job, i, "new");
        fs::set_permissions(job.staged_path(i), fs::Permissions::from_mode(0o600)).unwrap();
    }
    job.publish_and_commit(|| Ok(())).unwrap();
    for (name, mode) in [
        ("x.sh", 0o755),
        ("p.sh", 0o600),
        ("s.sh", 0o755),
        ("new.txt", 0o644),
    ] {
        let m = fs::metadata(tmp.path().join(name)).unwrap();
        assert_eq!(m.mode() & 0o7777, mode, "{name}");
        assert_eq!(fs::read_to_string(tmp.path().join(name)).unwrap(), "new");
    }
}

#[test]
fn publishes_one_new_file() {
    let tmp = tempfile::tempdir().unwrap();
    let ws = open(&tmp);
    let job = Job::create(&ws, spec("j", &["new.txt"])).unwrap();
    stage(&job, 0, "hello");
    let staged_ino = fs::metadata(job.staged_path(0)).unwrap().ino();
    let mut called = false;
    job.publish_and_commit(|| {
        called = true;
        Ok(())
    })
    .unwrap();
    assert!(called);
    assert_eq!(
        fs::read_to_string(tmp.path().join("new.txt")).unwrap(),
        "hello"
    );
    assert_eq!(
        fs::metadata(tmp.path().join("new.txt")).unwrap().ino(),
        staged_ino
    );
    assert!(job_dirs(tmp.path()).is_empty());
}

#[test]
fn replaces_an_existing_file_by_exchange() {
    let tmp = tempfile::tempdir().unwrap();
    write(tmp.path(), "doc.html", "old");
    let old_ino = fs::metadata(tmp.path().join("doc.html")).unwrap().ino();
    let ws = open(&tmp);
    let job = Job::create(&ws, spec("j", &["doc.html"])).unwrap();
    stage(&job, 0, "new");
    let staged = job.staged_path(0);
    let staged_ino = fs::metadata(&staged).unwrap().ino();
    let job_dir = job.dir().to_path_buf();
    job.publish_and_commit(|| {
        // At the commit point the old file sits under the staged name: the backup.
        assert_eq!(fs::read_to_string(&staged).unwrap(), "old");
        assert_eq!(fs::metadata(&staged).unwrap().ino(), old_ino);
        let j: serde_json::Value =
            serde_json::from_slice(&fs::read(job_dir.join("recovery.json")).unwrap()).unwrap();
        assert_eq!(j["phase"], "publishing_outputs");
        assert_eq!(j["targets"][0]["old"]["ino"], old_ino);
        assert_eq!(j["targets"][0]["new"]["ino"], staged_ino);
        Ok(())
    })
    .unwrap();
    assert_eq!(
        fs::read_to_string(tmp.path().join("doc.html")).unwrap(),
        "new"
    );
    assert_eq!(
        fs::metadata(tmp.path().join("doc.html")).unwrap().ino(),
        staged_ino
    );
    assert!(
        job_dirs(tmp.path()).is_empty(),
        "backup and job dir are gone"
    );
}

#[test]
fn publishes_several_outputs_with_new_subdirectories() {
    let tmp = tempfile::tempdir().unwrap();
    write(tmp.path(), "a.txt", "old a");
    let ws = open(&tmp);
    let job = Job::create(&ws, spec("j", &["a.txt", "n1/n2/b.txt", "n1/c.txt"])).unwrap();
    stage(&job, 0, "new a");
    stage(&job, 1, "new b");
    stage(&job, 2, "new c");
    job.publish_and_commit(|| Ok(())).unwrap();
    let snap = snapshot(tmp.path());
    let expect: BTreeMap<PathBuf, Entry> = [
        ("a.txt", Entry::File(b"new a".to_vec())),
        ("n1", Entry::Dir),
        ("n1/n2", Entry::Dir),
        ("n1/n2/b.txt", Entry::File(b"new b".to_vec())),
        ("n1/c.txt", Entry::File(b"new c".to_vec())),
    ]
    .into_iter()
    .map(|(p, e)| (PathBuf::from(p), e))
    .collect();
    assert_eq!(snap, expect);
}

#[test]
fn bad_outputs_are_rejected_and_the_workspace_is_unchanged() {
    type Plant = fn(&Path, &Path);
    let cases: Vec<(&str, Plant)> = vec![
        ("symlink", |staged, root| {
            std::os::unix::fs::symlink(root.join("a.txt"), staged).unwrap()
        }),
        ("hard links", |staged, _| {
            fs::write(staged, "x").unwrap();
            fs::hard_link(staged, staged.with_extension("second")).unwrap();
        }),
        ("FIFO", |staged, _| {
            nix::unistd::mkfifo(staged, nix::sys::stat::Mode::from_bits_truncate(0o600)).unwrap()
        }),
        ("directory", |staged, _| fs::create_dir(staged).unwrap()),
        ("missing", |_, _| {}),
    ];
    for (why, plant) in cases {
        let tmp = tempfile::tempdir().unwrap();
        write(tmp.path(), "a.txt", "old a");
        write(tmp.path(), "b.txt", "old b");
        let before = snapshot(tmp.path());
        let ws = open(&tmp);
        let job = Job::create(&ws, spec("j", &["a.txt", "new/b.txt", "b.txt"])).unwrap();
        stage(&job, 0, "new a");
        stage(&job, 2, "new b");
        plant(&job.staged_path(1), ws.root());
        let mut called = false;
        let err = job
            .publish_and_commit(|| {
                called = true;
                Ok(())
            })
            .unwrap_err();
        assert!(!called, "{why}");
        match &err {
            PublishError::BadOutput { path, reason, .. } => {
                assert_eq!(path, Path::new("new/b.txt"), "{why}");
                assert!(reason.to_string().contains(why), "{why}: {reason}");
            }
            e => panic!("{why}: {e:?}"),
        }
        assert_eq!(snapshot(tmp.path()), before, "{why}");
    }
}

#[test]
fn commit_failure_restores_every_target_and_removes_created_dirs() {
    let tmp = tempfile::tempdir().unwrap();
    write(tmp.path(), "a.txt", "old a");
    write(tmp.path(), "d/b.txt", "old b");
    let before = snapshot(tmp.path());
    let a_ino = fs::metadata(tmp.path().join("a.txt")).unwrap().ino();
    let ws = open(&tmp);
    let job = Job::create(&ws, spec("j", &["a.txt", "d/b.txt", "x/y/z.txt"])).unwrap();
    for i in 0..3 {
        stage(&job, i, "new");
    }
    let err = job
        .publish_and_commit(|| Err("disk full".into()))
        .unwrap_err();
    assert!(
        matches!(err, PublishError::Commit(ref m) if m.to_string() == "disk full"),
        "{err:?}"
    );
    assert_eq!(snapshot(tmp.path()), before);
    assert_eq!(fs::metadata(tmp.path().join("a.txt")).unwrap().ino(), a_ino);
}

#[test]
fn target_changed_after_resolution_fails_closed() {
    // Target became a directory.
    let tmp = tempfile::tempdir().unwrap();
    write(tmp.path(), "keep.txt", "old");
    let ws = open(&tmp);
    let job = Job::create(&ws, spec("j", &["keep.txt", "t.txt"])).unwrap();
    stage(&job, 0, "new");
    stage(&job, 1, "new");
    fs::create_dir(tmp.path().join("t.txt")).unwrap();
    let before = snapshot(tmp.path());
    let err = job.publish_and_commit(|| Ok(())).unwrap_err();
    assert!(matches!(err, PublishError::TargetChanged { .. }), "{err:?}");
    let mut after_expected = before.clone();
    after_expected.retain(|p, _| !p.starts_with(".airlock-job-j"));
    assert_eq!(snapshot(tmp.path()), after_expected);

    // A parent became a symlink leading out.
    let tmp = tempfile::tempdir().unwrap();
    let outside = tempfile::tempdir().unwrap();
    write(tmp.path(), "a.txt", "old");
    let ws = open(&tmp);
    let job = Job::create(&ws, spec("j", &["a.txt", "sub/b.txt"])).unwrap();
    stage(&job, 0, "new");
    stage(&job, 1, "new");
    std::os::unix::fs::symlink(outside.path(), tmp.path().join("sub")).unwrap();
    let err = job.publish_and_commit(|| Ok(())).unwrap_err();
    assert!(matches!(err, PublishError::TargetChanged { .. }), "{err:?}");
    assert_eq!(fs::read_to_string(tmp.path().join("a.txt")).unwrap(), "old");
    assert!(fs::read_dir(outside.path()).unwrap().next().is_none());
    assert!(job_dirs(tmp.path()).is_empty());
}

/// A commit callback's error that cannot tell whether its commit point is durable.
#[derive(Debug)]
struct UndecidedCommit;

impl std::fmt::Display for UndecidedCommit {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("the session's commit may or may not be durable")
    }
}

impl std::error::Error for UndecidedCommit {}

impl crate::publish::CommitError for UndecidedCommit {
    fn undecided(&self) -> bool {
        true
    }
}

#[test]
fn an_undecided_commit_is_left_for_recovery_which_decides_by_the_session() {
    for committed in [false, true] {
        let tmp = tempfile::tempdir().unwrap();
        write(tmp.path(), "a.txt", "old a");
        let before = snapshot(tmp.path());
        let ws = open(&tmp);
        let job = Job::create(&ws, spec("j", &["a.txt", "n/b.txt"])).unwrap();
        stage(&job, 0, "new a");
        stage(&job, 1, "new b");
        let dir = job.dir().to_path_buf();
        let err = job
            .publish_and_commit_with(|_| Err(UndecidedCommit))
            .unwrap_err();
        assert!(matches!(err, PublishError::CommitUndecided(_)), "{err:?}");
        let holds_the_new_outputs = || {
            let read = |p: &str| fs::read_to_string(tmp.path().join(p)).unwrap();
            assert_eq!(
                (read("a.txt"), read("n/b.txt")),
                ("new a".into(), "new b".into())
            );
        };
        // Nothing rolled back, nothing finished: the outputs in place, the journal still
        // `publishing_outputs`, the job dir where recovery finds it.
        holds_the_new_outputs();
        let j: serde_json::Value =
            serde_json::from_slice(&fs::read(dir.join("recovery.json")).unwrap()).unwrap();
        assert_eq!(j["phase"], "publishing_outputs");
        // The next start asks the session store, and goes by its answer.
        let rec = recover(tmp.path(), &|_, _| Ok(committed)).unwrap();
        assert_eq!(rec.len(), 1, "{rec:?}");
        assert!(job_dirs(tmp.path()).is_empty());
        if committed {
            holds_the_new_outputs();
        } else {
            assert_eq!(snapshot(tmp.path()), before);
        }
    }
}

/// A committed job whose journal can be neither blanked nor rewritten as `committed` (the
/// disk fails from the blank on) says so: the caller must keep its session from a later
/// commit before the next start. Its outputs stay published; with a working disk it is
/// settled.
#[test]
fn a_commit_whose_journal_can_be_neither_blanked_nor_rewritten_is_not_settled() {
    use crate::publish::testsim::{self, Mode};
    let run = |mode: Mode| {
        let tmp = tempfile::tempdir().unwrap();
        let ws = open(&tmp);
        testsim::arm(mode);
        let job = Job::create(&ws, spec("j", &["a.txt"])).unwrap();
        stage(&job, 0, "new");
        let r =
            job.publish_and_commit_staged(|_, _| Ok::<(), CallbackError>(()), |_, _, ()| Ok(()));
        let names = testsim::disarm();
        let a = fs::read_to_string(tmp.path().join("a.txt")).ok();
        (r, names, a)
    };
    let (r, names, a) = run(Mode::Off);
    assert!(r.unwrap().settled);
    assert_eq!(a.as_deref(), Some("new"));
    let blank = names
        .iter()
        .position(|n| *n == "publish.journal_blank")
        .unwrap_or_else(|| panic!("no blank: {names:?}"));
    let (r, _, a) = run(Mode::Crash(blank));
    let c = r.expect("committed");
    assert!(!c.settled, "{c:?}");
    assert_eq!(a.as_deref(), Some("new"));
}
