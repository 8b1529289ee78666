//! Undo data at a commit, and an undo as a job: crashes at every point of each, then
//! recovery and the start's sweep.

use super::*;
use crate::publish::undo;

/// A workspace where job `j1` replaced `a.txt` and created `n/b.txt` (in a new dir), keeping
/// undo data; the session marker names the last committed job.
struct Undone {
    tmp: tempfile::TempDir,
    marker: tempfile::TempDir,
}

impl Undone {
    fn new() -> Undone {
        let tmp = tempfile::tempdir().unwrap();
        write(tmp.path(), "a.txt", "old a");
        Undone {
            tmp,
            marker: tempfile::tempdir().unwrap(),
        }
    }

    fn root(&self) -> &Path {
        self.tmp.path()
    }

    fn last(&self) -> Option<String> {
        fs::read_to_string(self.marker.path().join("last")).ok()
    }

    /// Job `j1`, keeping undo data (within `limit`).
    fn commit_j1(&self, limit: u64) -> Result<UndoStatus, PublishError> {
        let ws = Workspace::open(self.root())?;
        let mut job = Job::create(&ws, spec("j1", &["a.txt", "n/b.txt"]))?;
        stage(&job, 0, "new a");
        stage(&job, 1, "new b");
        job.keep_undo(UndoKeep {
            limit,
            version_before: 0,
            state_before: serde_json::Map::new(),
        });
        let marker = self.marker.path().join("last");
        job.publish_and_commit_undoable(|_, _| commit(&marker, "j1"))
    }

    /// The undo of `j1`, as job `u1`.
    fn undo_j1(&self) -> Result<UndoStatus, PublishError> {
        let ws = Workspace::open(self.root())?;
        let rec = undo::load(&ws, "s1", "j1").map_err(|e| PublishError::Io {
            op: "load",
            path: self.root().into(),
            source: std::io::Error::other(e.to_string()),
        })?;
        if let Some(c) = undo::changed(&ws, &rec) {
            return Err(PublishError::Conflict {
                path: c.target,
                what: c.what,
            });
        }
        let job = Job::undo(&ws, "u1", "job_undo", &rec, 1 << 20)?;
        let marker = self.marker.path().join("last");
        job.publish_and_commit_undoable(|_, _| commit(&marker, "u1"))
    }

    fn recover(&self) {
        let marker = self.marker.path().join("last");
        let latest = |_: &str, job: &str| fs::read_to_string(&marker).is_ok_and(|s| s == job);
        recover(self.root(), &|_, job| Ok(latest("", job))).unwrap();
        let ws = Workspace::open(self.root()).unwrap();
        undo::sweep(&ws, &latest).unwrap();
    }

    /// The workspace without its undo data.
    fn files(&self) -> BTreeMap<PathBuf, Entry> {
        snapshot(self.root())
            .into_iter()
            .filter(|(p, _)| !p.starts_with(undo::UNDO_DIR))
            .collect()
    }

    fn generations(&self) -> Vec<String> {
        let d = self.root().join(undo::UNDO_DIR).join("s1");
        fs::read_dir(d)
            .map(|r| {
                r.map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
                    .collect()
            })
            .unwrap_or_default()
    }
}

/// The session commit: a failpoint (as the session file's write is), then the marker.
fn commit(marker: &Path, job: &str) -> std::io::Result<()> {
    crate::publish::fp("session.write")?;
    fs::write(marker, job)
}

fn points(f: impl FnOnce() -> Result<UndoStatus, PublishError>) -> usize {
    testsim::arm(Mode::Off);
    f().unwrap();
    testsim::disarm().len()
}

/// A crash at every point of a commit keeping undo data, then recovery and the sweep: the
/// workspace is all-old with no undo data, or all-new with the complete undo data of `j1`
/// (whose undo then gives the old back).
#[test]
fn a_crash_at_every_point_of_a_commit_keeps_consistent_undo_data() {
    let old = Undone::new().files();
    let n = {
        let u = Undone::new();
        points(|| u.commit_j1(1 << 20))
    };
    for k in 0..n {
        let u = Undone::new();
        testsim::arm(Mode::Crash(k));
        let _ = u.commit_j1(1 << 20);
        testsim::disarm();
        u.recover();
        assert!(job_dirs(u.root()).is_empty(), "crash at {k}");
        if u.last().as_deref() == Some("j1") {
            assert_eq!(u.generations(), ["j1"], "crash at {k}");
            assert_eq!(u.undo_j1().unwrap(), UndoStatus::NotKept(NotKept::IsUndo));
            assert_eq!(u.files(), old, "crash at {k}: after the undo");
        } else {
            assert_eq!(u.files(), old, "crash at {k}");
            assert!(u.generations().is_empty(), "crash at {k}");
        }
        assert!(u.generations().is_empty(), "crash at {k}: after");
    }
}

/// A crash at every point of an undo, then recovery: all-new (the undo rolled back) or
/// all-old (committed); no job dir, and after a committed undo no undo data.
#[test]
fn a_crash_at_every_point_of_an_undo_rolls_back_or_completes() {
    let old = Undone::new().files();
    let new = {
        let u = Undone::new();
        u.commit_j1(1 << 20).unwrap();
        u.files()
    };
    let n = {
        let u = Undone::new();
        u.commit_j1(1 << 20).unwrap();
        points(|| u.undo_j1())
    };
    assert!(n > 8, "{n} points");
    for k in 0..n {
        let u = Undone::new();
        u.commit_j1(1 << 20).unwrap();
        testsim::arm(Mode::Crash(k));
        let _ = u.undo_j1();
        testsim::disarm();
        u.recover();
        assert!(job_dirs(u.root()).is_empty(), "crash at {k}");
        match u.last().as_deref() {
            Some("u1") => {
                assert_eq!(u.files(), old, "crash at {k}");
                assert!(u.generations().is_empty(), "crash at {k}");
            }
            _ => assert_eq!(u.files(), new, "crash at {k}"),
        }
    }
}

/// An error at every point of an undo: before its commit point it fails, every target is
/// back as the job left it (the very file), and the backups are back in the undo data. Its
/// undo then works, unless the failed one had renamed a target already: the rename back
/// changed that target's ctime, and the undo is refused as a change (never a wrong undo).
#[test]
fn an_error_at_every_point_of_an_undo_leaves_the_job_as_it_was() {
    let old = Undone::new().files();
    let new = {
        let u = Undone::new();
        u.commit_j1(1 << 20).unwrap();
        u.files()
    };
    let n = {
        let u = Undone::new();
        u.commit_j1(1 << 20).unwrap();
        points(|| u.undo_j1())
    };
    for k in 0..n {
        let u = Undone::new();
        u.commit_j1(1 << 20).unwrap();
        testsim::arm(Mode::Error(k));
        let r = u.undo_j1();
        let names = testsim::disarm();
        if r.is_ok() {
            assert_eq!(u.last().as_deref(), Some("u1"));
            continue;
        }
        assert_eq!(u.files(), new, "error at {k} ({})", names[k]);
        assert!(job_dirs(u.root()).is_empty(), "error at {k} ({})", names[k]);
        let renamed = names[..=k]
            .iter()
            .any(|n| *n == "publish.exchange" || *n == "publish.delete_inout");
        match u.undo_j1() {
            Ok(_) => assert_eq!(u.files(), old, "error at {k} ({})", names[k]),
            Err(PublishError::Conflict {
                what: Conflict::Touched,
                ..
            }) if renamed => assert_eq!(u.files(), new, "error at {k} ({})", names[k]),
            Err(e) => panic!("error at {k} ({}): the undo after: {e}", names[k]),
        }
    }
}

/// Backups over the limit keep no undo data; a later commit that keeps some drops an earlier
/// generation.
#[test]
fn backups_over_the_limit_keep_nothing() {
    let u = Undone::new();
    let s = u.commit_j1(3).unwrap();
    assert!(
        matches!(
            s,
            UndoStatus::NotKept(NotKept::TooLarge { bytes: 5, limit: 3 })
        ),
        "{s:?}"
    );
    assert!(u.generations().is_empty());
    let u = Undone::new();
    assert_eq!(
        u.commit_j1(0).unwrap(),
        UndoStatus::NotKept(NotKept::Disabled)
    );
}
