//! Undo: `job_undo {session, job}` over the real socket. A session's latest commit keeps its
//! backups (within `undo_bytes`) in the workspace's reserved `.airlock-undo/`; an undo puts
//! them back (the very files: same inode, mode, owner, content), commits the state before the
//! job as a new version, and is a job of its own (`allow`, `start`, `commit` with `undo_of`).
//! Refused, with nothing changed, after a later commit, after an outside change of a target,
//! over `undo_bytes`, for another principal's session, and a second time.

use std::os::unix::fs::MetadataExt;
use std::path::Path;

use serde_json::{json, Value};

use crate::authz::{as_nobody, daemon as shared_daemon, NOBODY};
use crate::harness::*;

fn job_of(r: &Value) -> String {
    r["structuredContent"]["job"]
        .as_str()
        .unwrap_or_else(|| panic!("no job in {r}"))
        .to_string()
}

async fn undo(c: &Client, session: &str, job: &str) -> Value {
    call(c, "job_undo", json!({"session": session, "job": job})).await
}

async fn job_get(c: &Client, job: &str) -> Value {
    let r = call(c, "job_get", json!({"job": job})).await;
    assert!(!is_error(&r), "{r}");
    r["structuredContent"].clone()
}

async fn state(c: &Client, s: &str) -> Value {
    call(c, "session_get", json!({"session": s})).await["structuredContent"].clone()
}

/// (inode, mode, uid, gid, content) of a file.
fn file_facts(p: &Path) -> (u64, u32, u32, u32, Vec<u8>) {
    let m = std::fs::symlink_metadata(p).unwrap_or_else(|e| panic!("{}: {e}", p.display()));
    (
        m.ino(),
        m.mode(),
        m.uid(),
        m.gid(),
        std::fs::read(p).unwrap_or_default(),
    )
}

/// The events of job `job` in the audit, as their kinds.
async fn kinds_of(c: &Client, job: &str) -> Vec<String> {
    audit(c)
        .await
        .iter()
        .filter(|e| e["job"] == job)
        .map(|e| e["kind"].as_str().unwrap_or("").to_string())
        .collect()
}

/// A new file (in a new directory) and an overwritten one, with the state: the undo gives
/// back the very old file (inode, mode, owner, content), removes the new one and the
/// directory made for it, and commits the state before as the next version. It is a job of
/// its own in the audit (`commit` with `undo_of`) and in `job_get`; neither it nor the
/// undone job can be undone after it; the undo data is gone.
#[tokio::test(flavor = "multi_thread")]
async fn an_undo_restores_files_and_state_as_a_new_version() {
    require_program("/usr/bin/python3", "python3");
    let mut d = Daemon::new();
    d.write("y.txt", "old y");
    std::fs::set_permissions(
        d.workspace.join("y.txt"),
        std::os::unix::fs::PermissionsExt::from_mode(0o640),
    )
    .unwrap();
    d.start();
    let c = d.client().await;
    session(&c, "s").await;
    let r = call(&c, "counter", json!({"session": "s", "by": 5})).await;
    assert!(!is_error(&r), "{r}");
    let before_files = tree(&d.workspace);
    let y_before = file_facts(&d.workspace.join("y.txt"));
    let before_state = state(&c, "s").await;
    assert_eq!(before_state["version"], 1);

    let r = call(
        &c,
        "two_outputs",
        json!({"session": "s", "a": "n/deep/new.txt", "b": "y.txt"}),
    )
    .await;
    assert!(!is_error(&r), "{r}");
    let j = job_of(&r);
    assert_eq!(r["structuredContent"]["undoable"], true, "{r}");
    assert_eq!(d.read("y.txt").as_deref(), Some("B\n"));
    assert_eq!(d.undo_generations(), vec![format!("s/{j}")]);
    // The undo data is the daemon's: 0700, under the reserved name.
    let m = std::fs::metadata(d.workspace.join(".airlock-undo")).unwrap();
    assert_eq!(m.mode() & 0o777, 0o700);
    assert_eq!(job_get(&c, &j).await["undoable"], true);

    let u = undo(&c, "s", &j).await;
    assert!(!is_error(&u), "{u}");
    let uj = job_of(&u);
    assert_eq!(u["structuredContent"]["undoOf"], j.as_str(), "{u}");
    assert_eq!(u["structuredContent"]["version"], 3, "{u}");
    assert_eq!(u["structuredContent"]["undoable"], false, "{u}");
    // Files: as before, the old file itself back.
    assert_eq!(tree(&d.workspace), before_files);
    assert_eq!(file_facts(&d.workspace.join("y.txt")), y_before);
    assert!(!d.workspace.join("n").exists(), "the dir made for new.txt");
    // State: the one before, as the next version.
    let now = state(&c, "s").await;
    assert_eq!(now["state"], before_state["state"]);
    assert_eq!(now["version"], 3);
    assert!(
        d.undo_generations().is_empty(),
        "{:?}",
        d.undo_generations()
    );
    assert!(d.job_dirs().is_empty());

    // Both jobs as job_get tells them.
    let g = job_get(&c, &uj).await;
    assert_eq!(g["state"], "committed", "{g}");
    assert_eq!(g["undoOf"], j.as_str(), "{g}");
    assert_eq!(g["undoable"], false, "{g}");
    assert_eq!(g["versionAfter"], 3, "{g}");
    let g = job_get(&c, &j).await;
    assert_eq!(g["undoable"], false, "{g}");
    assert!(g["undoReason"].as_str().is_some(), "{g}");

    // Neither can be undone now: the undone job names the undo in its way.
    let again = undo(&c, "s", &j).await;
    assert_eq!(code(&again), "UNDO_CONFLICT", "{again}");
    assert!(text(&again).contains(&uj), "{again}");
    let twice = undo(&c, "s", &uj).await;
    assert_eq!(code(&twice), "NOT_UNDOABLE", "{twice}");
    assert_eq!(tree(&d.workspace), before_files);
    assert_eq!(state(&c, "s").await["version"], 3);

    // The audit: allow, start, commit with undo_of; refusals are allow, error.
    assert_eq!(kinds_of(&c, &uj).await, ["allow", "start", "commit"]);
    let commit = audit(&c)
        .await
        .into_iter()
        .find(|e| e["job"] == uj.as_str() && e["kind"] == "commit")
        .unwrap();
    assert_eq!(commit["detail"]["undo_of"], j.as_str(), "{commit}");
    assert_eq!(commit["detail"]["version"], 3, "{commit}");
    let outs = commit["detail"]["outputs"].as_array().unwrap();
    assert!(
        outs.iter()
            .any(|o| o["path"] == "n/deep/new.txt" && o["deleted"] == true),
        "{commit}"
    );
    drop(c);
    d.stop();
    d.assert_audit_verifies("after undo");
}

/// A directory output, new then replacing a tree: each undo gives back what was there (the
/// old tree itself, every entry), or nothing.
#[tokio::test(flavor = "multi_thread")]
async fn an_undo_restores_directory_outputs() {
    let mut d = Daemon::new();
    d.write("site/old.html", "old");
    d.write("site/sub/a.txt", "old a");
    d.start();
    let c = d.client().await;
    session(&c, "s").await;
    let before = tree(&d.workspace);
    let site_ino = std::fs::metadata(d.workspace.join("site")).unwrap().ino();

    let r = call(
        &c,
        "write_tree",
        json!({"session": "s", "text": "t", "out": "fresh"}),
    )
    .await;
    assert!(!is_error(&r), "{r}");
    let u = undo(&c, "s", &job_of(&r)).await;
    assert!(!is_error(&u), "{u}");
    assert_eq!(tree(&d.workspace), before);

    let r = call(
        &c,
        "write_tree",
        json!({"session": "s", "text": "t", "out": "site"}),
    )
    .await;
    assert!(!is_error(&r), "{r}");
    assert!(d.read("site/old.html").is_none());
    let u = undo(&c, "s", &job_of(&r)).await;
    assert!(!is_error(&u), "{u}");
    assert_eq!(tree(&d.workspace), before);
    assert_eq!(
        std::fs::metadata(d.workspace.join("site")).unwrap().ino(),
        site_ino
    );
    assert_eq!(state(&c, "s").await["version"], 4);
}

/// An in-out edit and an in-out deletion: each undo gives back the file the tool edited or
/// removed, itself (inode, mode, content).
#[tokio::test(flavor = "multi_thread")]
async fn an_undo_restores_an_inout_edit_and_a_deletion() {
    let mut d = Daemon::new();
    d.write("docs/a.txt", "alpha\n");
    d.start();
    let c = d.client().await;
    session(&c, "s").await;
    let before = tree(&d.workspace);
    let facts = file_facts(&d.workspace.join("docs/a.txt"));

    let r = call(
        &c,
        "edit_inout",
        json!({"session": "s", "path": "docs/a.txt", "action": "append:more"}),
    )
    .await;
    assert!(!is_error(&r), "{r}");
    assert_eq!(d.read("docs/a.txt").as_deref(), Some("alpha\nmore"));
    let u = undo(&c, "s", &job_of(&r)).await;
    assert!(!is_error(&u), "{u}");
    assert_eq!(tree(&d.workspace), before);
    assert_eq!(file_facts(&d.workspace.join("docs/a.txt")), facts);

    let r = call(
        &c,
        "edit_inout",
        json!({"session": "s", "path": "docs/a.txt", "action": "rm"}),
    )
    .await;
    assert!(!is_error(&r), "{r}");
    assert!(d.read("docs/a.txt").is_none());
    let u = undo(&c, "s", &job_of(&r)).await;
    assert!(!is_error(&u), "{u}");
    assert_eq!(tree(&d.workspace), before);
    assert_eq!(file_facts(&d.workspace.join("docs/a.txt")), facts);
}

/// Only the latest commit: an undo of an earlier one is UNDO_CONFLICT naming the later job,
/// and changes nothing; the later one is still undoable, and the earlier one's undo data was
/// dropped when the later one kept its own.
#[tokio::test(flavor = "multi_thread")]
async fn an_undo_behind_a_later_commit_names_it_and_changes_nothing() {
    let mut d = Daemon::new();
    d.start();
    let c = d.client().await;
    session(&c, "s").await;
    let j1 = job_of(
        &call(
            &c,
            "write_text",
            json!({"session": "s", "text": "1", "out": "a.txt"}),
        )
        .await,
    );
    let j2 = job_of(
        &call(
            &c,
            "write_text",
            json!({"session": "s", "text": "2", "out": "a.txt"}),
        )
        .await,
    );
    assert_eq!(d.undo_generations(), vec![format!("s/{j2}")]);
    let files = tree(&d.workspace);
    let r = undo(&c, "s", &j1).await;
    assert_eq!(code(&r), "UNDO_CONFLICT", "{r}");
    assert!(text(&r).contains(&j2), "{r}");
    assert_eq!(tree(&d.workspace), files);
    assert_eq!(state(&c, "s").await["version"], 2);
    assert_eq!(job_get(&c, &j1).await["undoable"], false);
    assert_eq!(
        kinds_of(&c, &job_of_last_undo(&c).await).await,
        ["allow", "error"]
    );
    let r = undo(&c, "s", &j2).await;
    assert!(!is_error(&r), "{r}");
    assert_eq!(d.read("a.txt").as_deref(), Some("1"));
}

async fn job_of_last_undo(c: &Client) -> String {
    audit(c)
        .await
        .iter()
        .rev()
        .find(|e| e["tool"] == "job_undo")
        .and_then(|e| e["job"].as_str())
        .unwrap()
        .to_string()
}

/// Anything that changed a target since the job refuses the undo, naming the target, and
/// changes nothing: a write, a chmod alone, a replacement by another file, a new entry in
/// a directory output, a deleted target created again. The undo data stays (the job is still
/// the latest commit), so an undo after the outside change is put right still fails.
#[tokio::test(flavor = "multi_thread")]
async fn an_outside_change_of_a_target_refuses_the_undo() {
    let mut d = Daemon::new();
    d.write("docs/gone.txt", "x");
    d.start();
    let c = d.client().await;
    session(&c, "s").await;
    type Harm = fn(&Path);
    let harms: [(&str, Value, &str, Harm); 5] = [
        (
            "write_text",
            json!({"text": "new", "out": "a.txt"}),
            "a.txt",
            |ws| std::fs::write(ws.join("a.txt"), "new").unwrap(),
        ),
        (
            "write_text",
            json!({"text": "new", "out": "b.txt"}),
            "b.txt",
            |ws| {
                std::fs::set_permissions(
                    ws.join("b.txt"),
                    std::os::unix::fs::PermissionsExt::from_mode(0o600),
                )
                .unwrap()
            },
        ),
        (
            "write_text",
            json!({"text": "new", "out": "c.txt"}),
            "c.txt",
            |ws| {
                std::fs::write(ws.join("c2"), "new").unwrap();
                std::fs::rename(ws.join("c2"), ws.join("c.txt")).unwrap();
            },
        ),
        (
            "write_tree",
            json!({"text": "t", "out": "site"}),
            "site",
            |ws| std::fs::write(ws.join("site/sub/a.txt"), "T").unwrap(),
        ),
        (
            "edit_inout",
            json!({"path": "docs/gone.txt", "action": "rm"}),
            "docs/gone.txt",
            |ws| std::fs::write(ws.join("docs/gone.txt"), "back").unwrap(),
        ),
    ];
    for (tool, a, target, harm) in harms {
        let mut a = a.clone();
        a["session"] = "s".into();
        let r = call(&c, tool, a).await;
        assert!(!is_error(&r), "{r}");
        let j = job_of(&r);
        harm(&d.workspace);
        let files = tree(&d.workspace);
        let version = state(&c, "s").await["version"].clone();
        let u = undo(&c, "s", &j).await;
        assert_eq!(code(&u), "UNDO_CONFLICT", "{target}: {u}");
        assert!(text(&u).contains(target), "{target}: {u}");
        assert_eq!(tree(&d.workspace), files, "{target}");
        assert_eq!(state(&c, "s").await["version"], version, "{target}");
        assert_eq!(d.undo_generations(), vec![format!("s/{j}")], "{target}");
        assert!(d.job_dirs().is_empty(), "{target}");
    }
}

/// A commit whose backups exceed `undo_bytes` is not undoable, says so in its result and in
/// `job_get`, and drops the earlier commit's undo data (no longer the latest); its undo is
/// NOT_UNDOABLE and changes nothing. A new file (no backup) still fits.
#[tokio::test(flavor = "multi_thread")]
async fn backups_over_undo_bytes_are_not_kept() {
    let mut d = Daemon::new();
    set_daemon(&d, &[("undo_bytes", "100")]);
    d.write("big.txt", &"x".repeat(200));
    d.start();
    let c = d.client().await;
    session(&c, "s").await;
    let small = call(
        &c,
        "write_text",
        json!({"session": "s", "text": "s", "out": "small.txt"}),
    )
    .await;
    assert_eq!(small["structuredContent"]["undoable"], true, "{small}");
    let r = call(
        &c,
        "write_text",
        json!({"session": "s", "text": "b", "out": "big.txt"}),
    )
    .await;
    assert!(!is_error(&r), "{r}");
    assert_eq!(r["structuredContent"]["undoable"], false, "{r}");
    let reason = r["structuredContent"]["undoReason"].as_str().unwrap_or("");
    assert!(reason.contains("undo_bytes"), "{r}");
    let j = job_of(&r);
    let g = job_get(&c, &j).await;
    assert_eq!(g["undoable"], false, "{g}");
    assert!(
        g["undoReason"]
            .as_str()
            .unwrap_or("")
            .contains("undo_bytes"),
        "{g}"
    );
    assert!(
        d.undo_generations().is_empty(),
        "{:?}",
        d.undo_generations()
    );
    let files = tree(&d.workspace);
    let u = undo(&c, "s", &j).await;
    assert_eq!(code(&u), "NOT_UNDOABLE", "{u}");
    assert!(text(&u).contains("undo_bytes"), "{u}");
    let u = undo(&c, "s", &job_of(&small)).await;
    assert_eq!(code(&u), "UNDO_CONFLICT", "{u}");
    assert_eq!(tree(&d.workspace), files);
    assert_eq!(state(&c, "s").await["version"], 2);
}

/// The undo data outlives the daemon: after a clean restart and after a kill -9, the latest
/// commit is still undoable (job_get says so), and its undo works.
#[tokio::test(flavor = "multi_thread")]
async fn an_undo_works_across_a_restart_and_a_crash() {
    let mut d = Daemon::new();
    d.write("a.txt", "old");
    d.start();
    let c = d.client().await;
    session(&c, "s").await;
    let before = tree(&d.workspace);
    for stop in ["clean", "kill -9"] {
        let j = job_of(
            &call(
                &c_of(&d).await,
                "write_text",
                json!({"session": "s", "text": "new", "out": "a.txt"}),
            )
            .await,
        );
        if stop == "clean" {
            d.stop();
        } else {
            d.kill9();
        }
        d.start();
        let c = d.client().await;
        assert_eq!(job_get(&c, &j).await["undoable"], true, "{stop}");
        let u = undo(&c, "s", &j).await;
        assert!(!is_error(&u), "{stop}: {u}");
        assert_eq!(tree(&d.workspace), before, "{stop}");
    }
    drop(c);
}

async fn c_of(d: &Daemon) -> Client {
    d.client().await
}

/// Another principal's session: `job_undo` naming it is SESSION_FORBIDDEN and tells nothing
/// of the job; naming the other's job in one's own session is NO_SUCH_JOB, likewise. The
/// owner's undo still works afterwards.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn another_principals_job_cannot_be_undone_or_learnt() {
    let mut d = shared_daemon(&format!(
        "[[grant]]\nuids = [{NOBODY}]\ncapabilities = [\"read\", \"write\"]\n"
    ));
    d.start();
    let root = d.client().await;
    session(&root, "rootsess").await;
    let r = call(
        &root,
        "write_text",
        json!({"session": "rootsess", "text": "secret-text", "out": "r.txt"}),
    )
    .await;
    let j = job_of(&r);
    let nobody = as_nobody(&d).await;
    let c = &nobody.client;
    session(c, "ns").await;
    let files = tree(&d.workspace);
    let u = undo(c, "rootsess", &j).await;
    assert_eq!(code(&u), "SESSION_FORBIDDEN", "{u}");
    let u2 = undo(c, "ns", &j).await;
    assert_eq!(code(&u2), "NO_SUCH_JOB", "{u2}");
    for t in [u.to_string(), u2.to_string()] {
        assert!(!t.contains("write_text") && !t.contains("r.txt"), "{t}");
    }
    assert_eq!(tree(&d.workspace), files);
    assert_eq!(version(&root, "rootsess").await, 1);
    let u = undo(&root, "rootsess", &j).await;
    assert!(!is_error(&u), "{u}");
    assert!(d.read("r.txt").is_none());
}

/// `session_destroy` drops the session's undo data, and a restart keeps it dropped.
#[tokio::test(flavor = "multi_thread")]
async fn destroying_a_session_drops_its_undo_data() {
    let mut d = Daemon::new();
    d.start();
    let c = d.client().await;
    session(&c, "s").await;
    session(&c, "t").await;
    call(
        &c,
        "write_text",
        json!({"session": "s", "text": "1", "out": "a.txt"}),
    )
    .await;
    let jt = job_of(
        &call(
            &c,
            "write_text",
            json!({"session": "t", "text": "1", "out": "b.txt"}),
        )
        .await,
    );
    assert_eq!(d.undo_generations().len(), 2);
    let r = call(&c, "session_destroy", json!({"session": "s"})).await;
    assert!(!is_error(&r), "{r}");
    assert_eq!(d.undo_generations(), vec![format!("t/{jt}")]);
    drop(c);
    d.stop();
    d.start();
    assert_eq!(d.undo_generations(), vec![format!("t/{jt}")]);
}

/// What a hostile local user or tool can do with the undo data's place: no path parameter
/// reaches it (PATH_REJECTED); a generation planted for a job that is not the session's
/// latest commit, or one whose backup was swapped, is removed at the next start and never
/// used; a symlink planted as `.airlock-undo` is never followed (the commit keeps no undo
/// data and says so; the symlink's target is untouched).
#[tokio::test(flavor = "multi_thread")]
async fn planted_undo_data_is_never_used() {
    let mut d = Daemon::new();
    d.write("a.txt", "old");
    d.start();
    let c = d.client().await;
    session(&c, "s").await;
    for out in [".airlock-undo/s/x", ".airlock-undo"] {
        let r = call(
            &c,
            "write_text",
            json!({"session": "s", "text": "p", "out": out}),
        )
        .await;
        assert_eq!(code(&r), "PATH_REJECTED", "{out}: {r}");
    }
    let j = job_of(
        &call(
            &c,
            "write_text",
            json!({"session": "s", "text": "new", "out": "a.txt"}),
        )
        .await,
    );
    drop(c);
    d.stop();
    // A planted generation for another job, and the real one's backup swapped for another
    // file of the same size (which may well take the freed inode number).
    let sess = d.workspace.join(".airlock-undo/s");
    std::fs::create_dir_all(sess.join("planted")).unwrap();
    std::fs::write(sess.join("planted/undo.json"), "{}").unwrap();
    let gen = d.undo_generation_dir("s", &j).expect("the job's undo data");
    std::fs::remove_file(gen.join("b0")).unwrap();
    std::fs::write(gen.join("b0"), "bad").unwrap();
    d.start();
    let c = d.client().await;
    assert!(
        d.undo_generations().is_empty(),
        "{:?}",
        d.undo_generations()
    );
    let g = job_get(&c, &j).await;
    assert_eq!(g["undoable"], false, "{g}");
    let u = undo(&c, "s", &j).await;
    assert_eq!(code(&u), "NOT_UNDOABLE", "{u}");
    assert_eq!(d.read("a.txt").as_deref(), Some("new"));

    // A symlink in its place, to a directory outside the workspace.
    drop(c);
    d.stop();
    let outside = d.dir.path().join("outside");
    std::fs::create_dir(&outside).unwrap();
    let _ = std::fs::remove_dir_all(d.workspace.join(".airlock-undo"));
    std::os::unix::fs::symlink(&outside, d.workspace.join(".airlock-undo")).unwrap();
    d.start();
    let c = d.client().await;
    let r = call(
        &c,
        "write_text",
        json!({"session": "s", "text": "newer", "out": "a.txt"}),
    )
    .await;
    assert!(!is_error(&r), "{r}");
    assert_eq!(r["structuredContent"]["undoable"], false, "{r}");
    assert!(
        tree_names(&outside).is_empty(),
        "{:?}",
        tree_names(&outside)
    );
    assert_eq!(code(&undo(&c, "s", &job_of(&r)).await), "NOT_UNDOABLE");
}

/// `airlock job undo --session S ID`: exit 0 and the undo's result; a refusal exits 1 (a
/// tool error, as `airlock call`) with its code.
#[tokio::test(flavor = "multi_thread")]
async fn the_cli_undoes_a_job() {
    let mut d = Daemon::new();
    d.write("a.txt", "old");
    d.start();
    let c = d.client().await;
    session(&c, "s").await;
    let j = job_of(
        &call(
            &c,
            "write_text",
            json!({"session": "s", "text": "new", "out": "a.txt"}),
        )
        .await,
    );
    let cli = |args: &[&str]| {
        let out = std::process::Command::new(BIN)
            .args(args)
            .arg("--socket")
            .arg(&d.socket)
            .output()
            .expect("run airlock");
        (
            out.status.code(),
            String::from_utf8_lossy(&out.stdout).into_owned(),
            String::from_utf8_lossy(&out.stderr).into_owned(),
        )
    };
    let (code1, out, err) = cli(&["job", "undo", "--session", "s", &j]);
    assert_eq!(code1, Some(0), "{err}");
    let r: Value = serde_json::from_str(&out).unwrap();
    assert_eq!(r["structuredContent"]["undoOf"], j.as_str(), "{r}");
    assert_eq!(d.read("a.txt").as_deref(), Some("old"));
    let (code2, out, err) = cli(&["job", "undo", "--session", "s", &j]);
    assert_eq!(code2, Some(1), "{out} {err}");
    assert!(
        out.contains("UNDO_CONFLICT") || err.contains("UNDO_CONFLICT"),
        "{out} {err}"
    );
}
