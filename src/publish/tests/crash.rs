//! Failpoints, crashes and recovery of one typical call.

use super::*;

// failpoints, crashes and recovery

/// One typical call: replaces `a.txt`, creates `n/m/b.txt` in new dirs and `c.txt`.
struct Scenario {
    tmp: tempfile::TempDir,
    /// Stands for the session store: holds the job id once `commit()` ran.
    session: tempfile::TempDir,
}

impl Scenario {
    fn new() -> Scenario {
        let tmp = tempfile::tempdir().unwrap();
        write(tmp.path(), "a.txt", "old a");
        write(tmp.path(), "keep/other.txt", "untouched");
        Scenario {
            tmp,
            session: tempfile::tempdir().unwrap(),
        }
    }

    fn root(&self) -> &Path {
        self.tmp.path()
    }

    fn committed_marker(&self) -> PathBuf {
        self.session.path().join("committed")
    }

    /// Runs the whole call; `commit_ok` picks what the session commit returns.
    fn run(&self, commit_ok: bool) -> Result<(), PublishError> {
        run_call(self.root(), &self.committed_marker(), commit_ok)
    }

    fn recover(&self) -> Result<Vec<Recovered>, PublishError> {
        let marker = self.committed_marker();
        recover(self.root(), &|session, job| {
            assert_eq!(session, "s1");
            Ok(fs::read_to_string(&marker)
                .map(|s| s == job)
                .unwrap_or(false))
        })
    }

    fn is_committed(&self) -> bool {
        self.committed_marker().exists()
    }
}

/// One typical call in `root`; the session commit writes the job id to `marker`.
fn run_call(root: &Path, marker: &Path, commit_ok: bool) -> Result<(), PublishError> {
    let ws = Workspace::open(root)?;
    let mut job = Job::create(&ws, spec("j7", &["a.txt", "n/m/b.txt", "c.txt"]))?;
    if let Err(e) = job.record_worker(99) {
        // What the caller does when the call cannot go on: kill the worker, discard.
        let _ = job.discard();
        return Err(e);
    }
    // The worker writes its outputs (not a failpoint: the worker is another process).
    fs::write(job.staged_path(0), "new a").unwrap();
    fs::write(job.staged_path(1), "new b").unwrap();
    fs::write(job.staged_path(2), "new c").unwrap();
    job.publish_and_commit(|| {
        if !commit_ok {
            return Err("session store refused".into());
        }
        fs::write(marker, "j7").map_err(Into::into)
    })
}

fn old_state() -> BTreeMap<PathBuf, Entry> {
    snapshot(Scenario::new().root())
}

fn new_state() -> BTreeMap<PathBuf, Entry> {
    let s = Scenario::new();
    s.run(true).unwrap();
    snapshot(s.root())
}

/// The names of the failpoints of one successful typical call, in order.
fn points_of_a_call() -> Vec<&'static str> {
    let s = Scenario::new();
    testsim::arm(Mode::Off);
    s.run(true).unwrap();
    testsim::disarm()
}

#[test]
fn failpoints_of_a_typical_call_are_named_and_ordered() {
    let names = points_of_a_call();
    let expected_prefix = [
        "publish.mkdir_job",
        "publish.mkdir_stage",
        "publish.mkdir_slot",
        "publish.mkdir_slot",
        "publish.mkdir_slot",
        // owner and mode of each staged output
        "publish.seal_output",
        "publish.seal_output",
        "publish.seal_output",
        // the one journal (publishing_outputs)
        "publish.journal_write",
        // the outputs' data, the journal and its dir, durable together before any rename
        "publish.fsync_output",
        "publish.fsync_output",
        "publish.fsync_output",
        "publish.fsync_journal",
        "publish.fsync_job_dir",
        "publish.fsync_root",
        "publish.mkdir_parent",
        "publish.mkdir_parent",
        "publish.exchange",
        "publish.rename_noreplace",
        "publish.rename_noreplace",
        // the renamed entries' dirs (root, n, n/m's parent..., staging slots) made durable
        "publish.fsync_renamed",
        "publish.fsync_renamed",
        "publish.fsync_renamed",
        "publish.fsync_renamed",
        "publish.fsync_renamed",
        "publish.fsync_renamed",
        "publish.fsync_renamed",
        "publish.fsync_renamed",
        // after the commit: the journal blanked, durably
        "publish.journal_blank",
        "publish.fsync_journal_blank",
    ];
    assert_eq!(
        &names[..expected_prefix.len()],
        &expected_prefix[..],
        "{names:#?}"
    );
    assert!(names[expected_prefix.len()..]
        .iter()
        .all(|n| *n == "publish.cleanup_unlink" || *n == "publish.cleanup_rmdir"));
    assert!(names.iter().all(|n| n.starts_with("publish.")));
}

/// Crash at every point of the call (nothing after it happens, not even the in-process
/// rollback), then recover: all-old or all-new by the session, no job dir, and a second
/// recovery is a no-op.
/// A call that fails after its journal was written makes the journal's blank durable
/// before its dir is set aside or removed: its rollback by identity must never run again
/// after a power loss, when the inode numbers of its rolled-back files may be a later
/// call's.
#[test]
fn a_failed_call_makes_its_journal_blank_durable_before_its_dir_goes() {
    let s = Scenario::new();
    testsim::arm(Mode::Off);
    let r = s.run(false);
    let names = testsim::disarm();
    assert!(r.is_err(), "the commit was refused");
    assert_eq!(snapshot(s.root()), old_state());
    let blank = names
        .iter()
        .position(|n| *n == "publish.journal_blank")
        .unwrap_or_else(|| panic!("no blank: {names:?}"));
    assert_eq!(
        names.get(blank + 1),
        Some(&"publish.fsync_journal_blank"),
        "{names:?}"
    );
}

#[test]
fn crash_at_every_point_then_recover() {
    let old = old_state();
    let new = new_state();
    let n = points_of_a_call().len();
    for k in 0..n {
        let s = Scenario::new();
        testsim::arm(Mode::Crash(k));
        let r = s.run(true);
        testsim::disarm();
        // Ok is only ever returned past the commit point (a crash after it goes unnoticed).
        assert!(r.is_err() || s.is_committed(), "crash at {k}");
        let rec = s.recover().unwrap();
        let want = if s.is_committed() { &new } else { &old };
        assert_eq!(&snapshot(s.root()), want, "crash at {k}; recovered {rec:?}");
        assert!(s.recover().unwrap().is_empty(), "second recovery at {k}");
    }
}

/// Crash at every point of the call, then crash again at every point of recovery, then
/// recover once more.
#[test]
fn crash_during_recovery_then_recover_again() {
    let old = old_state();
    let new = new_state();
    let n = points_of_a_call().len();
    for k in 0..n {
        // How many points does recovery have after a crash at k?
        let s = Scenario::new();
        testsim::arm(Mode::Crash(k));
        let _ = s.run(true);
        testsim::arm(Mode::Off);
        s.recover().unwrap();
        let m = testsim::disarm().len();
        for j in 0..m {
            let s = Scenario::new();
            testsim::arm(Mode::Crash(k));
            let _ = s.run(true);
            testsim::arm(Mode::Crash(j));
            let r = s.recover();
            testsim::disarm();
            assert!(
                r.is_err(),
                "crash at {k}, recovery crash at {j} went unnoticed"
            );
            let rec = s.recover().unwrap();
            let want = if s.is_committed() { &new } else { &old };
            assert_eq!(
                &snapshot(s.root()),
                want,
                "crash at {k} then {j}; recovered {rec:?}"
            );
            assert!(s.recover().unwrap().is_empty());
        }
    }
}

/// An I/O error at every point of the call: before the commit point the call fails and the
/// workspace is all-old with no job dir; after it the call succeeds (all-new), and any
/// leftover job dir is finished by recovery.
#[test]
fn error_at_every_point_rolls_back_or_completes() {
    let old = old_state();
    let new = new_state();
    let n = points_of_a_call().len();
    for k in 0..n {
        let s = Scenario::new();
        testsim::arm(Mode::Error(k));
        let r = s.run(true);
        let names = testsim::disarm();
        match r {
            Err(e) => {
                assert!(!s.is_committed(), "{k} ({}): {e}", names[k]);
                assert_eq!(snapshot(s.root()), old, "error at {k} ({}): {e}", names[k]);
            }
            Ok(()) => {
                assert!(s.is_committed());
                // Whatever is left reads as committed or never published: recovery will not
                // need to ask the session about it.
                for d in job_dirs(s.root()) {
                    let journal = s.root().join(d).join("recovery.json");
                    // A blank journal (`null`, maybe padded) reads as never published.
                    let bytes = fs::read(&journal)
                        .ok()
                        .filter(|b| !crate::publish::journal::is_blank(b));
                    if let Some(bytes) = bytes {
                        let j: serde_json::Value = serde_json::from_slice(&bytes).unwrap();
                        assert_eq!(j["phase"], "committed", "error at {k} ({})", names[k]);
                    }
                }
                s.recover().unwrap();
                assert_eq!(snapshot(s.root()), new, "error at {k} ({})", names[k]);
            }
        }
    }
}

/// The session commit fails, and the rollback meets an I/O error at every one of its
/// points: the call reports it, and recovery brings the workspace back to all-old.
#[test]
fn failed_rollback_is_finished_by_recovery() {
    let old = old_state();
    let s = Scenario::new();
    testsim::arm(Mode::Off);
    assert!(matches!(s.run(false), Err(PublishError::Commit(_))));
    let n = testsim::disarm().len();
    assert_eq!(snapshot(s.root()), old);
    let mut rollback_failures = 0;
    for k in 0..n {
        let s = Scenario::new();
        testsim::arm(Mode::Error(k));
        let r = s.run(false);
        testsim::disarm();
        match r {
            Err(PublishError::RollbackFailed { .. }) => {
                rollback_failures += 1;
                assert_eq!(job_dirs(s.root()).len(), 1, "kept for recovery");
                let rec = s.recover().unwrap();
                assert!(rec[0].action.starts_with("rolled back"), "{rec:?}");
            }
            Err(_) => {
                // Rolled back; only the cleanup may have failed, leaving a job dir that
                // recovery removes without touching the targets.
                let mut now = snapshot(s.root());
                now.retain(|p, _| !p.starts_with(".airlock-job-j7"));
                assert_eq!(now, old, "error at {k}");
                s.recover().unwrap();
            }
            Ok(()) => panic!("commit refused yet Ok at {k}"),
        }
        assert_eq!(snapshot(s.root()), old, "error at {k}");
        assert!(job_dirs(s.root()).is_empty());
    }
    assert!(rollback_failures >= 3, "rollback points were exercised");
}

#[test]
fn recovery_reports_one_action_per_job() {
    // A job that never published (corrupt journal), one stopped in publishing_outputs after
    // its renames, and one whose session committed.
    let tmp = tempfile::tempdir().unwrap();
    write(tmp.path(), "a.txt", "old a");
    let ws = open(&tmp);

    let j1 = Job::create(&ws, spec("j1", &["x.txt"])).unwrap();
    fs::write(j1.dir().join("recovery.json"), b"{\"version\": 1, \"jo").unwrap();
    std::mem::forget(j1);

    let j2 = Job::create(&ws, spec("j2", &["a.txt", "new/b.txt"])).unwrap();
    stage(&j2, 0, "new a");
    stage(&j2, 1, "new b");
    // Crash after the renames, before the commit point: after the 2 seals, the journal,
    // the 2 outputs' and the journal's 3 fsyncs, the mkdir and the 2 renames.
    let mut seen = 0;
    testsim::arm(Mode::Crash(11));
    let _ = j2.publish_and_commit(|| {
        seen += 1;
        Ok(())
    });
    let names = testsim::disarm();
    assert_eq!(seen, 0);
    assert_eq!(
        names[..12],
        [
            "publish.seal_output",
            "publish.seal_output",
            "publish.journal_write",
            "publish.fsync_output",
            "publish.fsync_output",
            "publish.fsync_journal",
            "publish.fsync_job_dir",
            "publish.fsync_root",
            "publish.mkdir_parent",
            "publish.exchange",
            "publish.rename_noreplace",
            "publish.fsync_renamed",
        ]
    );
    assert_eq!(
        fs::read_to_string(tmp.path().join("a.txt")).unwrap(),
        "new a"
    );

    let j3 = Job::create(&ws, spec("j3", &["c.txt"])).unwrap();
    stage(&j3, 0, "new c");
    testsim::arm(Mode::Crash(9)); // after the commit, before the journal is blanked
    let _ = j3.publish_and_commit(|| Ok(()));
    let names = testsim::disarm();
    assert_eq!(names[0], "publish.seal_output");
    assert_eq!(names[8], "publish.fsync_renamed");
    assert_eq!(names[9], "publish.journal_blank");

    let rec = recover(tmp.path(), &|_, job| Ok(job == "j3")).unwrap();
    // A damaged journal proves nothing: j1 is kept aside as it is.
    assert_eq!(rec[0].settled, Settled::Kept, "{rec:?}");
    assert!(
        matches!(
            rec[0].kept.as_deref(),
            Some(Kept::Journal(JournalError::Damaged {
                reason: Damage::Unparsable(_),
                ..
            }))
        ),
        "{rec:?}"
    );
    let q = tmp.path().join(".airlock-quarantine-j1");
    assert_eq!(
        rec[0].quarantined.as_deref(),
        Some(ws.root().join(".airlock-quarantine-j1").as_path())
    );
    assert_eq!(
        fs::read(q.join("recovery.json")).unwrap(),
        b"{\"version\": 1, \"jo"
    );
    assert!(rec[0].action.starts_with("kept as"), "{}", rec[0].action);
    let actions: Vec<(String, String)> =
        rec.into_iter().skip(1).map(|r| (r.job, r.action)).collect();
    assert_eq!(
        actions,
        vec![
            (
                "j2".to_string(),
                "rolled back 2 of 2 targets (phase publishing_outputs)".to_string()
            ),
            (
                "j3".to_string(),
                "completed 1 targets (session holds the commit)".to_string()
            ),
        ]
    );
    assert_eq!(
        fs::read_to_string(tmp.path().join("a.txt")).unwrap(),
        "old a"
    );
    assert!(!tmp.path().join("new").exists());
    assert_eq!(
        fs::read_to_string(tmp.path().join("c.txt")).unwrap(),
        "new c"
    );
    assert!(job_dirs(tmp.path()).is_empty());
    let again = recover(tmp.path(), &|_, _| Ok(false)).unwrap();
    assert_eq!(again.len(), 1, "{again:?}");
    assert_eq!(again[0].settled, Settled::Quarantine);
    assert!(q.join("recovery.json").exists(), "untouched");
}

#[test]
fn recovery_refuses_to_guess_when_the_session_cannot_tell() {
    let s = Scenario::new();
    testsim::arm(Mode::Off);
    // Run once to count, then crash right after the commit point, before the journal's
    // unlink: the journal says publishing_outputs and only the session can tell.
    let _ = s.run(true);
    let names = testsim::disarm();
    let commit_at = names
        .iter()
        .position(|n| *n == "publish.cleanup_unlink")
        .unwrap();
    let s = Scenario::new();
    testsim::arm(Mode::Crash(commit_at));
    let _ = s.run(false);
    testsim::disarm();
    let r = recover(s.root(), &|_, _| Err("store unreadable".into()));
    assert!(matches!(r, Err(PublishError::Undecided { .. })), "{r:?}");
    assert_eq!(job_dirs(s.root()).len(), 1, "left in place");
}

#[test]
fn recovery_leaves_non_directories_named_like_job_dirs() {
    let tmp = tempfile::tempdir().unwrap();
    let outside = tempfile::tempdir().unwrap();
    write(outside.path(), "x", "precious");
    std::os::unix::fs::symlink(outside.path(), tmp.path().join(".airlock-job-evil")).unwrap();
    assert!(recover(tmp.path(), &|_, _| Ok(false)).unwrap().is_empty());
    assert_eq!(
        fs::read_to_string(outside.path().join("x")).unwrap(),
        "precious"
    );
}

#[test]
fn types_are_send_and_sync() {
    fn is<T: Send + Sync>() {}
    is::<Job>();
    is::<Workspace>();
    is::<PublishError>();
}

// ---------------------------------------------------------------------------------------
// The real failpoints (`--features failpoints`): a child process (this test binary, running
// only `child_runs_a_typical_call`) aborts or fails at point N as the environment says.

const CHILD_ROOT: &str = "AIRLOCK_TEST_CHILD_ROOT";
const CHILD_MARKER: &str = "AIRLOCK_TEST_CHILD_MARKER";

/// Spawned by `real_failpoints_*` with the child variables set, runs one typical call in the
/// parent's scenario and prints its result for the parent to check. Run on its own (neither
/// variable set), runs the same call in a fresh scenario and checks that it commits and
/// leaves exactly the new state: it never passes without running the call.
#[test]
fn child_runs_a_typical_call() {
    use std::env::{var_os, VarError};
    match (std::env::var(CHILD_ROOT), std::env::var(CHILD_MARKER)) {
        (Ok(root), Ok(marker)) => match run_call(Path::new(&root), Path::new(&marker), true) {
            Ok(()) => println!("CHILD-RESULT ok"),
            Err(e) => println!("CHILD-RESULT err {}", crate::report::chain(&e)),
        },
        (Err(VarError::NotPresent), Err(VarError::NotPresent)) => {
            let s = Scenario::new();
            run_call(s.root(), &s.committed_marker(), true).unwrap();
            assert!(s.is_committed(), "the call did not commit");
            assert_eq!(snapshot(s.root()), new_state());
            assert!(
                s.recover().unwrap().is_empty(),
                "a committed call left work"
            );
        }
        (root, marker) => panic!(
            "{CHILD_ROOT} ({:?}) and {CHILD_MARKER} ({:?}) must both be set (as by \
             real_failpoints_*) or both unset: {root:?} {marker:?}",
            var_os(CHILD_ROOT),
            var_os(CHILD_MARKER)
        ),
    }
}

#[cfg(feature = "failpoints")]
fn spawn_child(s: &Scenario, env: &[(&str, String)]) -> std::process::Output {
    let mut cmd = std::process::Command::new(std::env::current_exe().unwrap());
    cmd.args([
        "--exact",
        "publish::tests::crash::child_runs_a_typical_call",
        "--nocapture",
    ])
    .args(["--test-threads", "1"])
    .env(CHILD_ROOT, s.root())
    .env(CHILD_MARKER, s.committed_marker())
    .env_remove("AIRLOCK_FAILPOINT_CRASH_AT")
    .env_remove("AIRLOCK_FAILPOINT_ERROR_AT")
    .env_remove("AIRLOCK_FAILPOINT_LOG");
    for (k, v) in env {
        cmd.env(k, v);
    }
    cmd.output().unwrap()
}

#[cfg(feature = "failpoints")]
#[test]
fn real_failpoints_abort_and_errno_at_every_point() {
    use std::os::unix::process::ExitStatusExt;
    // No core dumps from the aborting children.
    nix::sys::resource::setrlimit(nix::sys::resource::Resource::RLIMIT_CORE, 0, 0).unwrap();
    let old = old_state();
    let new = new_state();

    let s = Scenario::new();
    let log = s.session.path().join("points.log");
    let out = spawn_child(&s, &[("AIRLOCK_FAILPOINT_LOG", log.display().to_string())]);
    assert!(out.status.success(), "{out:?}");
    assert!(
        String::from_utf8_lossy(&out.stdout).contains("CHILD-RESULT ok"),
        "{out:?}"
    );
    let points = fs::read_to_string(&log).unwrap();
    let n = points.lines().count();
    assert_eq!(n, points_of_a_call().len(), "{points}");
    assert_eq!(snapshot(s.root()), new);

    for k in 0..n {
        // kill -9 at point k: the child aborts, then recovery runs here.
        let s = Scenario::new();
        let out = spawn_child(&s, &[("AIRLOCK_FAILPOINT_CRASH_AT", k.to_string())]);
        assert_eq!(
            out.status.signal(),
            Some(libc::SIGABRT),
            "crash at {k}: {out:?}"
        );
        s.recover().unwrap();
        let want = if s.is_committed() { &new } else { &old };
        assert_eq!(&snapshot(s.root()), want, "crash at {k}");
        assert!(s.recover().unwrap().is_empty());

        // ENOSPC at point k: the call rolls back (or, past the commit point, succeeds).
        let s = Scenario::new();
        let out = spawn_child(
            &s,
            &[
                ("AIRLOCK_FAILPOINT_ERROR_AT", k.to_string()),
                ("AIRLOCK_FAILPOINT_ERRNO", "ENOSPC".to_string()),
            ],
        );
        assert!(out.status.success(), "error at {k}: {out:?}");
        let stdout = String::from_utf8_lossy(&out.stdout);
        if stdout.contains("CHILD-RESULT err") {
            assert!(stdout.contains("No space left"), "{stdout}");
            assert!(!s.is_committed());
            assert_eq!(snapshot(s.root()), old, "error at {k}");
        } else {
            assert!(stdout.contains("CHILD-RESULT ok"), "{stdout}");
            s.recover().unwrap();
            assert_eq!(snapshot(s.root()), new, "error at {k}");
        }
    }
}
