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

    /// Job `job` replacing `a.txt` with `text` at version `version_before` + 1, keeping undo
    /// data.
    fn commit_a(
        &self,
        job: &str,
        version_before: u64,
        text: &str,
    ) -> Result<UndoStatus, PublishError> {
        let ws = Workspace::open(self.root())?;
        let mut j = Job::create(&ws, spec(job, &["a.txt"]))?;
        stage(&j, 0, text);
        j.keep_undo(UndoKeep {
            limit: 1 << 20,
            version_before,
            state_before: serde_json::Map::new(),
        });
        let marker = self.marker.path().join("last");
        j.publish_and_commit_undoable(|_, _| commit(&marker, job))
    }

    /// The undo of `job`, as job `u-<job>`.
    fn undo_of(&self, job: &str) -> Result<UndoStatus, PublishError> {
        let ws = Workspace::open(self.root())?;
        let rec = undo::load(&ws, "s1", job).map_err(|e| PublishError::Io {
            op: "load",
            path: self.root().into(),
            source: std::io::Error::other(e.to_string()),
        })?;
        let id = format!("u-{job}");
        let j = Job::undo(&ws, &id, "job_undo", &rec, 1 << 20)?;
        let marker = self.marker.path().join("last");
        j.publish_and_commit_undoable(|_, _| commit(&marker, &id))
    }

    /// The slot dir `slot` of session `s1`.
    fn slot(&self, slot: &str) -> PathBuf {
        self.root().join(undo::UNDO_DIR).join("s1").join(slot)
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

    /// The jobs whose undo data the session's slots hold (a blank slot holds none).
    fn generations(&self) -> Vec<String> {
        let d = self.root().join(undo::UNDO_DIR).join("s1");
        let mut out: Vec<String> = fs::read_dir(d)
            .map(|r| {
                r.filter_map(|e| {
                    let rec = fs::read(e.unwrap().path().join(undo::UNDO_RECORD)).ok()?;
                    let rec: serde_json::Value = serde_json::from_slice(&rec).ok()?;
                    Some(rec["job"].as_str()?.to_string())
                })
                .collect()
            })
            .unwrap_or_default();
        out.sort();
        out
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

/// Three commits in a row: each writes the slot of its version's parity, so the third
/// rewrites the first's record in place (the same file: no inode per call; written over and
/// cut, so that no tail of the longer record before it is left), and the slot it does not use
/// is left blank (the blank marker as its record, nothing else).
#[test]
fn commits_reuse_the_two_slots_in_turn() {
    use std::os::unix::fs::MetadataExt;
    let u = Undone::new();
    assert!(u.commit_a("j1", 0, "1").unwrap().kept());
    let first = fs::metadata(u.slot("g1").join(undo::UNDO_RECORD))
        .unwrap()
        .ino();
    assert!(u.commit_a("j2", 1, "2").unwrap().kept());
    assert_eq!(u.generations(), ["j2"]);
    assert_eq!(
        fs::read(u.slot("g1").join(undo::UNDO_RECORD)).unwrap(),
        undo::BLANK
    );
    assert!(u.commit_a("j3", 2, "3").unwrap().kept());
    assert_eq!(u.generations(), ["j3"]);
    let third = fs::metadata(u.slot("g1").join(undo::UNDO_RECORD))
        .unwrap()
        .ino();
    assert_eq!(first, third, "the record is rewritten in place");
    let mut slots: Vec<_> = fs::read_dir(u.root().join(undo::UNDO_DIR).join("s1"))
        .unwrap()
        .map(|e| e.unwrap().file_name().into_string().unwrap())
        .collect();
    slots.sort();
    assert_eq!(slots, ["g0", "g1"]);
    let blank: Vec<_> = fs::read_dir(u.slot("g0"))
        .unwrap()
        .map(|e| e.unwrap().file_name())
        .collect();
    assert_eq!(blank, [undo::UNDO_RECORD]);
    assert_eq!(
        fs::read(u.slot("g0").join(undo::UNDO_RECORD)).unwrap(),
        undo::BLANK
    );
    // The undo puts back the second commit's file.
    u.undo_of("j3").unwrap();
    assert_eq!(fs::read_to_string(u.root().join("a.txt")).unwrap(), "2");
}

/// A crash at every point of a commit that rewrites a slot in place (the third of a
/// session), then recovery and the sweep: either it committed and is undoable (its undo gives
/// back the second commit's file), or it did not and the second commit's undo data is still
/// complete (its undo gives back the first's, or is refused as a change when the rollback
/// renamed the target back): the record rewritten is never the latest's.
#[test]
fn a_crash_at_every_point_of_a_reusing_commit_keeps_the_latest_undoable() {
    let prelude = || {
        let u = Undone::new();
        u.commit_a("j1", 0, "1").unwrap();
        u.commit_a("j2", 1, "2").unwrap();
        u
    };
    let n = {
        let u = prelude();
        points(|| u.commit_a("j3", 2, "3"))
    };
    assert!(n > 8, "{n} points");
    for k in 0..n {
        let u = prelude();
        testsim::arm(Mode::Crash(k));
        let _ = u.commit_a("j3", 2, "3");
        let names = testsim::disarm();
        let renamed = names.iter().take(k + 1).any(|n| *n == "publish.exchange");
        u.recover();
        assert!(job_dirs(u.root()).is_empty(), "crash at {k}");
        let a = || fs::read_to_string(u.root().join("a.txt")).unwrap();
        if u.last().as_deref() == Some("j3") {
            assert_eq!(a(), "3", "crash at {k}");
            assert_eq!(u.generations(), ["j3"], "crash at {k}");
            u.undo_of("j3").unwrap();
            assert_eq!(a(), "2", "crash at {k}: after the undo");
        } else {
            assert_eq!(a(), "2", "crash at {k}");
            assert_eq!(u.generations(), ["j2"], "crash at {k}");
            let ws = Workspace::open(u.root()).unwrap();
            assert!(
                undo::load(&ws, "s1", "j2").is_ok(),
                "crash at {k}: j2's undo data"
            );
            match u.undo_of("j2") {
                Ok(_) => assert_eq!(a(), "1", "crash at {k}: after the undo"),
                // Rolled back by a rename, which changed the target's ctime: refused as a
                // change, never a wrong undo.
                Err(PublishError::Conflict {
                    what: Conflict::Touched,
                    ..
                }) if renamed => assert_eq!(a(), "2", "crash at {k}"),
                Err(e) => panic!("crash at {k}: the undo of j2: {e}"),
            }
        }
    }
}

/// What a hostile local user with the daemon's uid could plant in a blank slot before it is
/// reused: a symlink, a hard link to a file outside or a FIFO as its record, a record made
/// readable by others, stray backups and a dir. The record is never written through any of
/// them (the files outside keep their content), it ends up 0600, the slot is cleared, and
/// the commit's undo data is complete and works.
#[test]
fn a_planted_record_or_stray_backup_in_a_slot_is_replaced_not_written_through() {
    use std::os::unix::fs::symlink;
    let outside = tempfile::tempdir().unwrap();
    for plant in [
        "symlink",
        "hard link",
        "fifo",
        "readable by others",
        "stray entries",
    ] {
        let u = Undone::new();
        u.commit_a("j1", 0, "1").unwrap();
        u.commit_a("j2", 1, "2").unwrap();
        let target = outside.path().join(plant.replace(' ', "-"));
        fs::write(&target, "outside").unwrap();
        let rec = u.slot("g1").join(undo::UNDO_RECORD);
        match plant {
            "symlink" => {
                fs::remove_file(&rec).unwrap();
                symlink(&target, &rec).unwrap();
            }
            "hard link" => {
                // A file outside the slot on the same filesystem, linked in as the record.
                let inside = u.root().join("kept-elsewhere");
                fs::write(&inside, "outside").unwrap();
                fs::remove_file(&rec).unwrap();
                fs::hard_link(&inside, &rec).unwrap();
            }
            "fifo" => {
                fs::remove_file(&rec).unwrap();
                rustix::fs::mknodat(
                    rustix::fs::CWD,
                    &rec,
                    rustix::fs::FileType::Fifo,
                    rustix::fs::Mode::from_raw_mode(0o600),
                    0,
                )
                .unwrap();
            }
            "readable by others" => {
                use std::os::unix::fs::PermissionsExt;
                fs::set_permissions(&rec, fs::Permissions::from_mode(0o644)).unwrap();
            }
            _ => {
                fs::write(u.slot("g1").join("b0"), "stray").unwrap();
                fs::create_dir_all(u.slot("g1").join("b7/deep")).unwrap();
                symlink(&target, u.slot("g1").join("b3")).unwrap();
            }
        }
        assert!(u.commit_a("j3", 2, "3").unwrap().kept(), "{plant}");
        assert_eq!(fs::read_to_string(&target).unwrap(), "outside", "{plant}");
        if plant == "hard link" {
            let inside = u.root().join("kept-elsewhere");
            assert_eq!(fs::read_to_string(inside).unwrap(), "outside", "{plant}");
        }
        let st = fs::symlink_metadata(&rec).unwrap();
        assert!(st.file_type().is_file(), "{plant}");
        {
            use std::os::unix::fs::PermissionsExt;
            assert_eq!(st.permissions().mode() & 0o777, 0o600, "{plant}");
        }
        let mut left: Vec<_> = fs::read_dir(u.slot("g1"))
            .unwrap()
            .map(|e| e.unwrap().file_name().into_string().unwrap())
            .collect();
        left.sort();
        assert_eq!(left, ["b0", "undo.json"], "{plant}");
        assert_eq!(
            fs::read_to_string(u.slot("g1").join("b0")).unwrap(),
            "2",
            "{plant}"
        );
        assert_eq!(u.generations(), ["j3"], "{plant}");
        u.undo_of("j3").unwrap();
        assert_eq!(
            fs::read_to_string(u.root().join("a.txt")).unwrap(),
            "2",
            "{plant}"
        );
    }
}

/// A record written over a longer one in place is the new record alone (cut after it: no
/// tail of the old one), in the same file; the blank marker likewise.
#[test]
fn a_record_written_over_a_longer_one_leaves_no_tail() {
    use std::os::unix::fs::MetadataExt;
    let tmp = tempfile::tempdir().unwrap();
    let path = tmp.path().join(undo::UNDO_RECORD);
    fs::write(&path, format!("{{\"job\":\"{}\"}}", "x".repeat(5000))).unwrap();
    let ino = fs::metadata(&path).unwrap().ino();
    let f = fs::OpenOptions::new().write(true).open(&path).unwrap();
    undo::overwrite(&f, b"{\"job\":\"short\"}").unwrap();
    assert_eq!(fs::read(&path).unwrap(), b"{\"job\":\"short\"}");
    undo::overwrite(&f, undo::BLANK).unwrap();
    assert_eq!(fs::read(&path).unwrap(), undo::BLANK);
    assert_eq!(fs::metadata(&path).unwrap().ino(), ino);
}
