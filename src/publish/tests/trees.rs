//! Directory outputs: the tree check, publication by one rename, rollback and recovery.

use std::os::unix::fs::symlink;

use super::*;

fn dir_spec(id: &str, targets: &[&str]) -> JobSpec {
    JobSpec {
        kinds: vec![OutputKind::Directory; targets.len()],
        ..spec(id, targets)
    }
}

fn mode(p: &Path) -> u32 {
    fs::symlink_metadata(p).unwrap().permissions().mode() & 0o7777
}

/// Everything beneath `root/rel`, with the modes (symlinks: their target).
fn tree(root: &Path) -> BTreeMap<PathBuf, (Entry, u32)> {
    snapshot(root)
        .into_iter()
        .map(|(p, e)| {
            let m = mode(&root.join(&p));
            (p, (e, m))
        })
        .collect()
}

#[test]
fn a_new_directory_is_created_empty_for_the_worker_and_published_whole() {
    let tmp = tempfile::tempdir().unwrap();
    let ws = open(&tmp);
    let job = Job::create(&ws, dir_spec("t1", &["out/site"])).unwrap();
    let staged = job.staged_path(0);
    assert!(staged.is_dir());
    assert_eq!(fs::read_dir(&staged).unwrap().count(), 0);
    fs::create_dir_all(staged.join("css/deep")).unwrap();
    fs::write(staged.join("index.html"), "<p>hi</p>").unwrap();
    fs::write(staged.join("css/deep/a.css"), "a{}").unwrap();
    fs::set_permissions(staged.join("index.html"), fs::Permissions::from_mode(0o777)).unwrap();
    fs::set_permissions(staged.join("css"), fs::Permissions::from_mode(0o1777)).unwrap();
    symlink("css/deep/a.css", staged.join("style.css")).unwrap();
    symlink("../../index.html", staged.join("css/deep/home")).unwrap();
    let mut got = Vec::new();
    job.publish_and_commit_with(|p: &[Published]| {
        got = p.to_vec();
        Ok::<(), CallbackError>(())
    })
    .unwrap();
    let site = tmp.path().join("out/site");
    assert_eq!(
        fs::read_to_string(site.join("index.html")).unwrap(),
        "<p>hi</p>"
    );
    assert_eq!(fs::read_to_string(site.join("style.css")).unwrap(), "a{}");
    assert_eq!(
        fs::read_to_string(site.join("css/deep/home")).unwrap(),
        "<p>hi</p>"
    );
    // Sealed: no group/other write, no sticky; x bits kept; the top dir 0755.
    assert_eq!(mode(&site), 0o755);
    assert_eq!(mode(&site.join("index.html")), 0o755);
    assert_eq!(mode(&site.join("css")), 0o755);
    assert_eq!(got.len(), 1);
    assert_eq!(got[0].kind, OutputKind::Directory);
    assert_eq!(got[0].files, Some(2));
    assert_eq!(got[0].size, 9 + 3);
    // The manifest, as the README documents it, rebuilt by hand.
    let sha = |b: &[u8]| {
        use sha2::Digest;
        crate::audit::log::hex(&sha2::Sha256::digest(b))
    };
    let mut m = Vec::new();
    for (k, mode, p, d) in [
        ("d", "0755", ".", String::new()),
        ("d", "0755", "css", String::new()),
        ("d", "0755", "css/deep", String::new()),
        ("f", "0644", "css/deep/a.css", sha(b"a{}")),
        ("l", "0777", "css/deep/home", "../../index.html".into()),
        ("f", "0755", "index.html", sha(b"<p>hi</p>")),
        ("l", "0777", "style.css", "css/deep/a.css".into()),
    ] {
        for f in [k, mode, p, d.as_str()] {
            m.extend_from_slice(f.as_bytes());
            m.push(0);
        }
    }
    assert_eq!(got[0].sha256.as_deref(), Some(sha(&m).as_str()));
    assert!(job_dirs(tmp.path()).is_empty());
}

#[test]
fn an_existing_directory_is_replaced_by_exchange_and_the_old_tree_is_gone() {
    let tmp = tempfile::tempdir().unwrap();
    write(tmp.path(), "site/old.html", "old");
    write(tmp.path(), "site/sub/deeper/x", "x");
    fs::set_permissions(tmp.path().join("site"), fs::Permissions::from_mode(0o750)).unwrap();
    let before = fs::symlink_metadata(tmp.path().join("site")).unwrap().ino();
    let ws = open(&tmp);
    let job = Job::create(&ws, dir_spec("t2", &["site"])).unwrap();
    fs::write(job.staged_path(0).join("new.html"), "new").unwrap();
    job.publish_and_commit(|| Ok(())).unwrap();
    let site = tmp.path().join("site");
    let t = tree(&site);
    assert_eq!(
        t.keys().cloned().collect::<Vec<_>>(),
        vec![PathBuf::from("new.html")]
    );
    assert_ne!(fs::symlink_metadata(&site).unwrap().ino(), before);
    // The replaced dir's mode is kept, as a file's is.
    assert_eq!(mode(&site), 0o750);
    assert!(job_dirs(tmp.path()).is_empty());
}

#[test]
fn a_failed_commit_brings_back_the_old_tree_and_removes_a_new_one() {
    let tmp = tempfile::tempdir().unwrap();
    write(tmp.path(), "site/old.html", "old");
    let old = snapshot(tmp.path());
    let ws = open(&tmp);
    let job = Job::create(&ws, dir_spec("t3", &["site", "n/m/fresh"])).unwrap();
    fs::write(job.staged_path(0).join("new.html"), "new").unwrap();
    fs::write(job.staged_path(1).join("f"), "f").unwrap();
    let e = job
        .publish_and_commit(|| Err("session store refused".into()))
        .unwrap_err();
    assert!(matches!(e, PublishError::Commit(_)), "{e}");
    assert_eq!(snapshot(tmp.path()), old);
}

/// Each hostile tree fails the call naming the entry; nothing is published and the job dir
/// is gone.
#[test]
fn hostile_trees_are_refused_naming_the_entry() {
    type Plant = fn(&Path, &Path);
    let cases: Vec<(&str, Plant, &str)> = vec![
        (
            "absolute symlink",
            |s, _| symlink("/etc/passwd", s.join("p")).unwrap(),
            "entry \"p\": it is a symlink to the absolute path",
        ),
        (
            "escaping symlink at depth",
            |s, _| {
                fs::create_dir_all(s.join("a/b")).unwrap();
                symlink("../../../..", s.join("a/b/c")).unwrap();
            },
            "entry \"a/b/c\": it is a symlink to",
        ),
        (
            "a name through a symlink",
            |s, _| {
                symlink(".", s.join("here")).unwrap();
                symlink("here/../x", s.join("y")).unwrap();
            },
            "entry \"y\": it is a symlink to",
        ),
        (
            "setuid file",
            |s, _| {
                fs::write(s.join("su"), "x").unwrap();
                fs::set_permissions(s.join("su"), fs::Permissions::from_mode(0o4755)).unwrap();
            },
            "entry \"su\": it is setuid or setgid (mode 4755)",
        ),
        (
            "setgid dir",
            |s, _| {
                fs::create_dir(s.join("g")).unwrap();
                fs::set_permissions(s.join("g"), fs::Permissions::from_mode(0o2755)).unwrap();
            },
            "entry \"g\": it is setuid or setgid",
        ),
        (
            "fifo",
            |s, _| {
                fs::create_dir(s.join("d")).unwrap();
                rustix::fs::mknodat(
                    rustix::fs::CWD,
                    s.join("d/fifo"),
                    rustix::fs::FileType::Fifo,
                    rustix::fs::Mode::from_raw_mode(0o644),
                    0,
                )
                .unwrap();
            },
            "entry \"d/fifo\": it is a FIFO",
        ),
        (
            "hard link to a file outside",
            |s, root| {
                fs::write(root.join("secret.txt"), "s").unwrap();
                fs::hard_link(root.join("secret.txt"), s.join("h")).unwrap();
            },
            "entry \"h\": it has 2 hard links",
        ),
    ];
    for (what, plant, message) in cases {
        let tmp = tempfile::tempdir().unwrap();
        write(tmp.path(), "keep.txt", "k");
        let ws = open(&tmp);
        let job = Job::create(&ws, dir_spec("bad", &["out"])).unwrap();
        plant(&job.staged_path(0), tmp.path());
        let before = snapshot(tmp.path());
        let e = job.publish_and_commit(|| Ok(())).unwrap_err();
        let PublishError::BadOutput { reason, .. } = &e else {
            panic!("{what}: {e}");
        };
        assert!(reason.to_string().contains(message), "{what}: {reason}");
        assert!(!tmp.path().join("out").exists(), "{what}");
        let mut after = snapshot(tmp.path());
        // The hard-linked file outside is the workspace's own (its link count went down).
        after.retain(|p, _| !p.starts_with(".airlock-job-bad"));
        let mut before = before;
        before.retain(|p, _| !p.starts_with(".airlock-job-bad"));
        assert_eq!(after, before, "{what}");
        assert!(job_dirs(tmp.path()).is_empty(), "{what}");
    }
}

/// A 300-level chain of directories (more than the fd window, more than any recursion
/// budget) is checked, published and removed again.
#[test]
fn a_deep_chain_is_checked_iteratively_and_published() {
    let tmp = tempfile::tempdir().unwrap();
    let ws = open(&tmp);
    let job = Job::create(&ws, dir_spec("deep", &["deep"])).unwrap();
    let mut fd = rustix::fs::open(
        job.staged_path(0),
        rustix::fs::OFlags::DIRECTORY | rustix::fs::OFlags::RDONLY,
        rustix::fs::Mode::empty(),
    )
    .unwrap();
    for _ in 0..300 {
        rustix::fs::mkdirat(&fd, "d", rustix::fs::Mode::from_raw_mode(0o755)).unwrap();
        fd = rustix::fs::openat(
            &fd,
            "d",
            rustix::fs::OFlags::DIRECTORY | rustix::fs::OFlags::RDONLY,
            rustix::fs::Mode::empty(),
        )
        .unwrap();
    }
    // A link at the bottom climbing back to the top is inside.
    let up = vec![".."; 300].join("/");
    rustix::fs::symlinkat(format!("{up}/top.txt"), &fd, "to-top").unwrap();
    fs::write(job.staged_path(0).join("top.txt"), "t").unwrap();
    let mut got = Vec::new();
    job.publish_and_commit_with(|p: &[Published]| {
        got = p.to_vec();
        Ok::<(), CallbackError>(())
    })
    .unwrap();
    assert_eq!(got[0].files, Some(1));
    assert!(tmp.path().join("deep/d/d/d").is_dir());
    assert!(job_dirs(tmp.path()).is_empty());
}

/// A name at NAME_MAX whose published path would pass PATH_MAX is refused, naming it.
#[test]
fn an_entry_whose_published_path_passes_path_max_is_refused() {
    let tmp = tempfile::tempdir().unwrap();
    let ws = open(&tmp);
    let job = Job::create(&ws, dir_spec("long", &["out"])).unwrap();
    let mut fd = rustix::fs::open(
        job.staged_path(0),
        rustix::fs::OFlags::DIRECTORY | rustix::fs::OFlags::RDONLY,
        rustix::fs::Mode::empty(),
    )
    .unwrap();
    let name = "n".repeat(255);
    for _ in 0..16 {
        rustix::fs::mkdirat(&fd, name.as_str(), rustix::fs::Mode::from_raw_mode(0o755)).unwrap();
        fd = rustix::fs::openat(
            &fd,
            name.as_str(),
            rustix::fs::OFlags::DIRECTORY | rustix::fs::OFlags::RDONLY,
            rustix::fs::Mode::empty(),
        )
        .unwrap();
    }
    let e = job.publish_and_commit(|| Ok(())).unwrap_err();
    let msg = e.to_string();
    assert!(msg.contains("its published path would be"), "{msg}");
    assert!(!tmp.path().join("out").exists());
    assert!(job_dirs(tmp.path()).is_empty());
}

/// A file where a directory is declared (or the reverse), appearing after resolution,
/// fails publication as a changed target; nothing is published.
#[test]
fn a_target_of_the_other_type_fails_as_changed() {
    let tmp = tempfile::tempdir().unwrap();
    let ws = open(&tmp);
    let job = Job::create(&ws, dir_spec("ty", &["out"])).unwrap();
    fs::write(job.staged_path(0).join("x"), "x").unwrap();
    write(tmp.path(), "out", "a file");
    let e = job.publish_and_commit(|| Ok(())).unwrap_err();
    assert!(
        matches!(
            &e,
            PublishError::TargetChanged {
                reason: Change::NowA("a regular file"),
                ..
            }
        ),
        "{e}"
    );
    assert_eq!(
        fs::read_to_string(tmp.path().join("out")).unwrap(),
        "a file"
    );
    let job = Job::create(&ws, spec("ty2", &["d"])).unwrap();
    stage(&job, 0, "f");
    fs::create_dir(tmp.path().join("d")).unwrap();
    let e = job.publish_and_commit(|| Ok(())).unwrap_err();
    assert!(matches!(&e, PublishError::TargetChanged { .. }), "{e}");
    assert!(tmp.path().join("d").is_dir());
    assert!(job_dirs(tmp.path()).is_empty());
}

/// Resolution refuses an existing target of the other type before anything is created.
#[test]
fn resolution_refuses_a_target_of_the_other_type() {
    let tmp = tempfile::tempdir().unwrap();
    write(tmp.path(), "f.txt", "f");
    fs::create_dir(tmp.path().join("d")).unwrap();
    let ws = open(&tmp);
    let e = ws
        .resolve_as("f.txt", PathRole::Output, OutputKind::Directory)
        .unwrap_err();
    assert!(
        e.to_string().contains("declared kind = \"directory\""),
        "{e}"
    );
    assert!(ws
        .resolve_as("d", PathRole::Output, OutputKind::File)
        .is_err());
    assert!(ws
        .resolve_as("d", PathRole::Output, OutputKind::Directory)
        .is_ok());
    assert!(ws
        .resolve_as("new", PathRole::Output, OutputKind::Directory)
        .is_ok());
}

/// A journal of file targets only is written as version 1 (every release reads it); one
/// with a directory target as version 2, with the kind.
#[test]
fn the_journal_version_says_whether_a_target_is_a_directory() {
    let tmp = tempfile::tempdir().unwrap();
    let ws = open(&tmp);
    for (id, kinds, version) in [
        ("v1", vec![OutputKind::File], 1),
        ("v2", vec![OutputKind::Directory], 2),
    ] {
        let spec = JobSpec {
            kinds: kinds.clone(),
            ..spec(id, &[id])
        };
        let job = Job::create(&ws, spec).unwrap();
        if kinds[0] == OutputKind::File {
            stage(&job, 0, "x");
        }
        let dir = job.dir().to_path_buf();
        job.publish_and_commit(|| {
            let j: serde_json::Value =
                serde_json::from_slice(&fs::read(dir.join("recovery.json")).unwrap()).unwrap();
            assert_eq!(j["version"], version);
            if version == 2 {
                assert_eq!(j["targets"][0]["kind"], "directory");
            } else {
                assert!(j["targets"][0].get("kind").is_none());
            }
            Ok(())
        })
        .unwrap();
    }
}

// crashes and recovery of a call with a replaced and a new directory

/// Replaces `site/` (two files) and creates `n/fresh/` in a new parent.
fn tree_call(root: &Path, marker: &Path) -> Result<(), PublishError> {
    let ws = Workspace::open(root)?;
    let job = Job::create(&ws, dir_spec("t7", &["n/fresh", "site"]))?;
    let s0 = job.staged_path(0);
    fs::write(s0.join("f"), "fresh").unwrap();
    let s1 = job.staged_path(1);
    fs::create_dir(s1.join("sub")).unwrap();
    fs::write(s1.join("sub/new.html"), "new").unwrap();
    symlink("sub/new.html", s1.join("index.html")).unwrap();
    job.publish_and_commit(|| fs::write(marker, "t7").map_err(Into::into))
}

struct TreeScenario {
    tmp: tempfile::TempDir,
    session: tempfile::TempDir,
}

impl TreeScenario {
    fn new() -> TreeScenario {
        let tmp = tempfile::tempdir().unwrap();
        write(tmp.path(), "site/old.html", "old");
        write(tmp.path(), "site/sub/x", "x");
        TreeScenario {
            tmp,
            session: tempfile::tempdir().unwrap(),
        }
    }
    fn marker(&self) -> PathBuf {
        self.session.path().join("committed")
    }
    fn run(&self) -> Result<(), PublishError> {
        tree_call(self.tmp.path(), &self.marker())
    }
    fn recover(&self) -> Result<Vec<Recovered>, PublishError> {
        let marker = self.marker();
        recover(self.tmp.path(), &|_, job| {
            Ok(fs::read_to_string(&marker)
                .map(|s| s == job)
                .unwrap_or(false))
        })
    }
    fn committed(&self) -> bool {
        self.marker().exists()
    }
}

fn tree_states() -> (BTreeMap<PathBuf, Entry>, BTreeMap<PathBuf, Entry>, usize) {
    let old = snapshot(TreeScenario::new().tmp.path());
    let s = TreeScenario::new();
    testsim::arm(Mode::Off);
    s.run().unwrap();
    let n = testsim::disarm().len();
    (old, snapshot(s.tmp.path()), n)
}

#[test]
fn tree_outputs_crash_at_every_point_then_recover() {
    let (old, new, n) = tree_states();
    assert!(n > 20, "{n}");
    for k in 0..n {
        let s = TreeScenario::new();
        testsim::arm(Mode::Crash(k));
        let r = s.run();
        testsim::disarm();
        assert!(r.is_err() || s.committed(), "crash at {k}");
        let rec = s.recover().unwrap();
        let want = if s.committed() { &new } else { &old };
        assert_eq!(&snapshot(s.tmp.path()), want, "crash at {k}; {rec:?}");
        assert!(s.recover().unwrap().is_empty(), "second recovery at {k}");
    }
}

#[test]
fn tree_outputs_crash_during_recovery_then_recover_again() {
    let (old, new, n) = tree_states();
    for k in 0..n {
        let s = TreeScenario::new();
        testsim::arm(Mode::Crash(k));
        let _ = s.run();
        testsim::arm(Mode::Off);
        s.recover().unwrap();
        let m = testsim::disarm().len();
        for j in 0..m {
            let s = TreeScenario::new();
            testsim::arm(Mode::Crash(k));
            let _ = s.run();
            testsim::arm(Mode::Crash(j));
            let r = s.recover();
            testsim::disarm();
            assert!(
                r.is_err(),
                "crash at {k}, recovery crash at {j} went unnoticed"
            );
            s.recover().unwrap();
            let want = if s.committed() { &new } else { &old };
            assert_eq!(&snapshot(s.tmp.path()), want, "crash at {k} then {j}");
            assert!(s.recover().unwrap().is_empty());
        }
    }
}

#[test]
fn tree_outputs_error_at_every_point_roll_back_or_complete() {
    let (old, new, n) = tree_states();
    for k in 0..n {
        let s = TreeScenario::new();
        testsim::arm(Mode::Error(k));
        let r = s.run();
        let names = testsim::disarm();
        match r {
            Err(e) => {
                assert!(!s.committed(), "{k} ({}): {e}", names[k]);
                assert_eq!(
                    snapshot(s.tmp.path()),
                    old,
                    "error at {k} ({}): {e}",
                    names[k]
                );
            }
            Ok(()) => {
                assert!(s.committed());
                s.recover().unwrap();
                assert_eq!(snapshot(s.tmp.path()), new, "error at {k} ({})", names[k]);
            }
        }
    }
}
