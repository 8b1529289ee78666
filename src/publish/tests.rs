//! Unit tests: resolution, publication, bad outputs, commit failure, and recovery after a
//! simulated crash or an injected error at every failpoint.

use std::collections::BTreeMap;
use std::fs;
use std::os::unix::fs::{MetadataExt, PermissionsExt};
use std::path::{Path, PathBuf};

use super::testsim::{self, Mode};
use super::*;
use crate::policy::PathRole;

#[derive(Debug, Clone, PartialEq, Eq)]
enum Entry {
    Dir,
    File(Vec<u8>),
    Link(PathBuf),
    Other,
}

/// Every entry beneath `root`, job dirs included (a leftover one must show up).
fn snapshot(root: &Path) -> BTreeMap<PathBuf, Entry> {
    fn walk(root: &Path, dir: &Path, out: &mut BTreeMap<PathBuf, Entry>) {
        for e in fs::read_dir(dir).unwrap() {
            let e = e.unwrap();
            let p = e.path();
            let rel = p.strip_prefix(root).unwrap().to_path_buf();
            let ft = e.file_type().unwrap();
            if ft.is_dir() {
                out.insert(rel, Entry::Dir);
                walk(root, &p, out);
            } else if ft.is_symlink() {
                out.insert(rel, Entry::Link(fs::read_link(&p).unwrap()));
            } else if ft.is_file() {
                out.insert(rel, Entry::File(fs::read(&p).unwrap()));
            } else {
                out.insert(rel, Entry::Other);
            }
        }
    }
    let mut out = BTreeMap::new();
    walk(root, root, &mut out);
    out
}

fn job_dirs(root: &Path) -> Vec<String> {
    fs::read_dir(root)
        .unwrap()
        .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
        .filter(|n| n.starts_with(JOB_DIR_PREFIX))
        .collect()
}

fn write(root: &Path, rel: &str, content: &str) {
    let p = root.join(rel);
    fs::create_dir_all(p.parent().unwrap()).unwrap();
    fs::write(p, content).unwrap();
}

fn spec(id: &str, targets: &[&str]) -> JobSpec {
    JobSpec {
        id: id.into(),
        session: "s1".into(),
        tool: "render".into(),
        targets: targets.iter().map(PathBuf::from).collect(),
        modes: Vec::new(),
        stage_owner: None,
    }
}

fn open(dir: &tempfile::TempDir) -> Workspace {
    Workspace::open(dir.path()).unwrap()
}

// ---------------------------------------------------------------------------------------
// resolve

#[test]
fn resolve_rejects_escapes_and_accepts_nested_new_paths() {
    let tmp = tempfile::tempdir().unwrap();
    let outside = tempfile::tempdir().unwrap();
    write(tmp.path(), "docs/a.md", "a");
    write(outside.path(), "secret.txt", "s");
    std::os::unix::fs::symlink(outside.path(), tmp.path().join("out")).unwrap();
    std::os::unix::fs::symlink("docs", tmp.path().join("inlink")).unwrap();
    fs::create_dir(tmp.path().join(".airlock-job-x")).unwrap();
    let ws = open(&tmp);
    let rejected = |raw: &str, role| match ws.resolve(raw, role) {
        Err(PathError::Rejected { reason, .. }) => reason,
        Ok(p) => panic!("{raw:?} accepted as {p:?}"),
    };

    assert!(rejected("../x", PathRole::Output).contains(".."));
    assert!(rejected("docs/../../x", PathRole::Output).contains(".."));
    assert!(rejected("/etc/passwd", PathRole::Input).contains("outside"));
    let outside_abs = outside.path().join("secret.txt");
    assert!(rejected(outside_abs.to_str().unwrap(), PathRole::Input).contains("outside"));
    let r = rejected("out/secret.txt", PathRole::Input);
    assert!(r.contains("symlink"), "{r}");
    assert!(rejected("out/new.txt", PathRole::Output).contains("symlink"));
    assert!(rejected("out", PathRole::Output).contains("symlink"));
    // Even a symlink that stays inside is refused: nothing is ever followed.
    assert!(rejected("inlink/a.md", PathRole::Input).contains("symlink"));
    assert!(rejected(".airlock-job-x/stage/0/f", PathRole::Output).contains("job directory"));
    assert!(rejected(".airlock-job-y", PathRole::Output).contains("job directory"));
    assert!(rejected("./.airlock-job-x", PathRole::Input).contains("job directory"));
    assert!(rejected("", PathRole::Input).contains("empty"));
    assert!(rejected("a\0b", PathRole::Input).contains("NUL"));
    assert!(rejected(".", PathRole::Output).contains("root"));
    assert!(rejected("docs", PathRole::Output).contains("directory"));
    assert!(rejected("docs/a.md/x", PathRole::Output).contains("not a directory"));
    assert!(rejected("missing.md", PathRole::Input).contains("does not exist"));

    assert_eq!(
        ws.resolve("docs/a.md", PathRole::Input).unwrap(),
        PathBuf::from("docs/a.md")
    );
    assert_eq!(
        ws.resolve("docs", PathRole::Input).unwrap(),
        PathBuf::from("docs")
    );
    assert_eq!(
        ws.resolve("./docs/./x/../a.md", PathRole::Input).unwrap(),
        PathBuf::from("docs/a.md")
    );
    assert_eq!(
        ws.resolve("new/deeper/out.html", PathRole::Output).unwrap(),
        PathBuf::from("new/deeper/out.html")
    );
    assert_eq!(
        ws.resolve("docs/a.md", PathRole::Output).unwrap(),
        PathBuf::from("docs/a.md")
    );
    let inside_abs = tmp.path().join("docs/new.html");
    assert_eq!(
        ws.resolve(inside_abs.to_str().unwrap(), PathRole::Output)
            .unwrap(),
        PathBuf::from("docs/new.html")
    );
}

#[test]
fn resolve_rejects_fifo_input_and_output() {
    let tmp = tempfile::tempdir().unwrap();
    nix::unistd::mkfifo(
        &tmp.path().join("p"),
        nix::sys::stat::Mode::from_bits_truncate(0o600),
    )
    .unwrap();
    let ws = open(&tmp);
    assert!(ws.resolve("p", PathRole::Input).is_err());
    assert!(ws.resolve("p", PathRole::Output).is_err());
}

// ---------------------------------------------------------------------------------------
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

fn stage(job: &Job, i: usize, content: &str) {
    fs::write(job.staged_path(i), content).unwrap();
}

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
    // The staging dirs are the worker's; the job dir lets it through, nobody else in.
    let stage_meta = fs::metadata(job.stage_dir()).unwrap();
    assert_eq!((stage_meta.uid(), stage_meta.gid()), (60999, 60999));
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
        ("hard links", |staged, root| {
            fs::write(root.join("../elsewhere-link"), "x").ok();
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
                assert!(reason.contains(why), "{why}: {reason}");
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

// ---------------------------------------------------------------------------------------
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
        // owner and mode of each staged output, and its fsync
        "publish.seal_output",
        "publish.fsync_output",
        "publish.seal_output",
        "publish.fsync_output",
        "publish.seal_output",
        "publish.fsync_output",
        // the one journal (publishing_outputs), durable with its dir before any rename
        "publish.journal_write",
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
        // after the commit: the journal's unlink, made durable
        "publish.cleanup_unlink",
        "publish.fsync_unlink",
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
                    if let Ok(bytes) = fs::read(&journal) {
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
    // Crash after the renames, before the commit point: after the 2 seals and fsyncs, the
    // journal with its 3 fsyncs, the mkdir and the 2 renames.
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
            "publish.fsync_output",
            "publish.seal_output",
            "publish.fsync_output",
            "publish.journal_write",
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
    testsim::arm(Mode::Crash(9)); // after the commit, before the journal's unlink
    let _ = j3.publish_and_commit(|| Ok(()));
    let names = testsim::disarm();
    assert_eq!(names[0], "publish.seal_output");
    assert_eq!(names[8], "publish.fsync_renamed");
    assert_eq!(names[9], "publish.cleanup_unlink");

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
            Err(e) => println!("CHILD-RESULT err {e}"),
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
        "publish::tests::child_runs_a_typical_call",
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

// ---------------------------------------------------------------------------------------
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
                key: "staging_files",
                ..
            }
        ),
        "{e}"
    );
    let e = job.check_staging(100, 1 << 20).unwrap_err();
    assert!(
        matches!(
            &e,
            PublishError::StagingLimit {
                key: "staging_size",
                ..
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

/// `Journal::read` tells a missing journal from each way one can be damaged.
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
    assert!(matches!(
        damage(b"{\"version\": 1, \"jo"),
        Damage::Unparsable(_)
    ));
    assert!(matches!(damage(b"\x00\xffgarbage"), Damage::Unparsable(_)));
    assert!(matches!(
        damage(b"{\"job\": \"jr\"}"),
        Damage::Unparsable(_)
    ));
    let r = damage(b"{\"version\": 2, \"from\": \"a later release\"}");
    assert!(
        matches!(&r, Damage::UnknownVersion { found } if found == "2"),
        "{r:?}"
    );
    assert!(r.to_string().contains("version is 2"), "{r}");
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

// ---------------------------------------------------------------------------------------
// bounds on client paths

#[test]
fn overlong_paths_are_rejected_before_anything_is_created() {
    let tmp = tempfile::tempdir().unwrap();
    let ws = open(&tmp);
    let root_len = ws.root().as_os_str().len();
    // The issue's path: 25 components of 200 bytes.
    let issue = vec!["c".repeat(200); 25].join("/");
    for role in [PathRole::Input, PathRole::Output] {
        let e = ws.resolve(&issue, role).unwrap_err().to_string();
        assert!(e.contains("at most 4095 bytes"), "{e}");
    }
    // One component over NAME_MAX.
    let e = ws
        .resolve(&format!("a/{}/b", "x".repeat(256)), PathRole::Output)
        .unwrap_err()
        .to_string();
    assert!(e.contains("256 bytes") && e.contains("255"), "{e}");
    assert!(ws.resolve(&"x".repeat(255), PathRole::Output).is_ok());
    // Every component fits and so does the raw path, but not the path beneath the root.
    let rel_len = 4095 - root_len;
    let mut long = String::new();
    while long.len() + 251 < rel_len {
        long.push_str(&"y".repeat(250));
        long.push('/');
    }
    long.push_str(&"y".repeat(rel_len - long.len()));
    assert!(long.len() < 4096);
    let e = ws.resolve(&long, PathRole::Output).unwrap_err().to_string();
    assert!(e.contains("beneath the workspace root"), "{e}");
    // A workspace root so long that an output's staged copy would not fit, though the
    // target itself would.
    let mut deep_root = tmp.path().to_path_buf();
    while deep_root.as_os_str().len() < 4096 - super::STAGED_OVERHEAD - 100 {
        deep_root.push("r".repeat(200));
    }
    fs::create_dir_all(&deep_root).unwrap();
    let deep = Workspace::open(&deep_root).unwrap();
    let name = "w".repeat(200);
    assert!(deep.resolve(&name, PathRole::Output).is_err());
    let e = deep
        .resolve(&name, PathRole::Output)
        .unwrap_err()
        .to_string();
    assert!(e.contains("staged copy"), "{e}");
    assert!(deep.resolve("w", PathRole::Output).is_ok());
    fs::remove_dir_all(tmp.path().join("r".repeat(200))).unwrap();
    assert!(snapshot(tmp.path()).is_empty(), "nothing was created");
    // A spec built elsewhere is held to the same bounds.
    let r = Job::create(&ws, spec("long", &[issue.as_str()]));
    assert!(matches!(r, Err(PublishError::InvalidSpec { .. })), "{r:?}");
    assert!(snapshot(tmp.path()).is_empty());
}

mod path_props {
    use super::*;
    use proptest::prelude::*;

    fn token() -> impl Strategy<Value = String> {
        prop_oneof![
            Just("..".to_string()),
            Just(".".to_string()),
            Just("".to_string()),
            Just("a".to_string()),
            Just("dir".to_string()),
            Just("out".to_string()),
            Just("link".to_string()),
            Just(".airlock-job-x".to_string()),
            Just(".airlock-quarantine-y".to_string()),
            Just(".airlock-jobx".to_string()),
            Just("\0".to_string()),
            "[a-z.]{1,8}",
            "\\PC{1,6}",
            (250usize..260).prop_map(|n| "n".repeat(n)),
        ]
    }

    fn raw_path() -> impl Strategy<Value = String> {
        (
            any::<bool>(),
            proptest::collection::vec(token(), 0..40),
            any::<bool>(),
        )
            .prop_map(|(abs, parts, trailing)| {
                let mut s = parts.join("/");
                if abs {
                    s.insert(0, '/');
                }
                if trailing {
                    s.push('/');
                }
                s
            })
    }

    /// What every accepted path must satisfy.
    fn check_accepted(ws: &Workspace, raw: &str, rel: &Path) {
        assert!(rel.is_relative(), "{raw:?} -> {rel:?}");
        let mut total = ws.root().as_os_str().len() + 1;
        for (k, c) in rel.components().enumerate() {
            let std::path::Component::Normal(n) = c else {
                assert!(rel == Path::new("."), "{raw:?} -> {rel:?}: {c:?}");
                continue;
            };
            assert!(n.len() <= NAME_MAX, "{raw:?}");
            if k == 0 {
                for p in RESERVED_PREFIXES {
                    assert!(
                        !n.as_encoded_bytes().starts_with(p.as_bytes()),
                        "{raw:?} reaches a reserved name"
                    );
                }
            }
            total += n.len() + 1;
        }
        assert!(total <= PATH_MAX, "{raw:?} is too long");
        // Whatever of it exists resolves (symlinks followed) inside the workspace.
        let mut p = ws.root().to_path_buf();
        for c in rel.components() {
            p.push(c);
            match fs::canonicalize(&p) {
                Ok(real) => assert!(real.starts_with(ws.root()), "{raw:?} -> {real:?}"),
                Err(_) => break,
            }
        }
    }

    proptest! {
        #![proptest_config(ProptestConfig::with_cases(500))]

        #[test]
        fn resolve_never_accepts_an_escape_a_reserved_name_or_an_overlong_path(
            raw in raw_path(),
            output in any::<bool>(),
        ) {
            let (tmp, outside) = fixture();
            let ws = open(&tmp);
            let role = if output { PathRole::Output } else { PathRole::Input };
            // Relative and absolute under the root both.
            for raw in [raw.clone(), format!("{}/{raw}", ws.root().display())] {
                if let Ok(rel) = ws.resolve(&raw, role) {
                    check_accepted(&ws, &raw, &rel);
                }
            }
            drop(outside);
        }

        #[test]
        fn resolve_survives_arbitrary_strings(raw in any::<String>(), output in any::<bool>()) {
            let (tmp, _outside) = fixture();
            let ws = open(&tmp);
            let role = if output { PathRole::Output } else { PathRole::Input };
            if let Ok(rel) = ws.resolve(&raw, role) {
                check_accepted(&ws, &raw, &rel);
            }
        }
    }

    /// A workspace with a directory, a file, a symlink leading out and a job dir.
    fn fixture() -> (tempfile::TempDir, tempfile::TempDir) {
        let tmp = tempfile::tempdir().unwrap();
        let outside = tempfile::tempdir().unwrap();
        write(tmp.path(), "dir/a", "x");
        write(tmp.path(), "a", "x");
        write(tmp.path(), ".airlock-job-x/stage/0/out", "x");
        write(tmp.path(), ".airlock-quarantine-y/f", "x");
        write(outside.path(), "secret", "x");
        std::os::unix::fs::symlink(outside.path(), tmp.path().join("link")).unwrap();
        std::os::unix::fs::symlink(outside.path(), tmp.path().join("dir/link")).unwrap();
        (tmp, outside)
    }
}

/// The commit fails after both renames and, meanwhile, the parent of one target was swapped
/// for a symlink: the in-process rollback cannot reach it, so the job dir (the only old copy)
/// is kept for recovery, which keeps it aside as it is, the other target untouched too.
#[test]
fn an_unreachable_target_keeps_its_backup_in_process_and_in_recovery() {
    let tmp = tempfile::tempdir().unwrap();
    write(tmp.path(), "x/a.txt", "old a");
    write(tmp.path(), "b.txt", "old b");
    let ws = open(&tmp);
    let job = Job::create(&ws, spec("swap", &["x/a.txt", "b.txt"])).unwrap();
    stage(&job, 0, "new a");
    stage(&job, 1, "new b");
    let root = tmp.path().to_path_buf();
    let e = job
        .publish_and_commit(|| {
            fs::rename(root.join("x"), root.join("x.real")).unwrap();
            std::os::unix::fs::symlink("x.real", root.join("x")).unwrap();
            Err("session store unavailable".into())
        })
        .unwrap_err();
    assert!(matches!(e, PublishError::RollbackFailed { .. }), "{e}");
    assert!(e.to_string().contains("cannot reach it safely"), "{e}");
    let dir = tmp.path().join(".airlock-job-swap");
    assert_eq!(
        fs::read_to_string(dir.join("stage/0/a.txt")).unwrap(),
        "old a"
    );
    assert_eq!(
        fs::read_to_string(root.join("x.real/a.txt")).unwrap(),
        "new a"
    );
    // b.txt was reachable: the in-process rollback restored it.
    assert_eq!(fs::read_to_string(root.join("b.txt")).unwrap(), "old b");
    let before = snapshot(&dir);
    let rec = recover(tmp.path(), &|_, _| Ok(false)).unwrap();
    assert_eq!(rec.len(), 1);
    assert_eq!(rec[0].settled, Settled::Kept, "{rec:?}");
    assert!(
        matches!(rec[0].kept.as_deref(), Some(Kept::Unreachable { targets, restored: 0 }) if targets.len() == 1),
        "{rec:?}"
    );
    let q = tmp.path().join(".airlock-quarantine-swap");
    assert_eq!(snapshot(&q), before);
    assert_eq!(
        fs::read_to_string(root.join("x.real/a.txt")).unwrap(),
        "new a"
    );
    assert_eq!(fs::read_to_string(root.join("b.txt")).unwrap(), "old b");
}
