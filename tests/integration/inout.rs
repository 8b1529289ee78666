//! In-out parameters (`path = "inout"`): the worker edits a private copy of the target; a
//! changed copy is published, an unchanged one publishes nothing, a removed one deletes the
//! target, and anyone else's change to the target meanwhile is a `CONFLICT`. Each scenario
//! runs under both shipped profiles, with the daemon as root (workers under uids of their
//! own) and as `nobody` (workers under the daemon's uid), through the real tools `sh`, `cp`,
//! `mv`, `rm` and `sed`.

use std::os::unix::fs::MetadataExt;
use std::path::Path;

use serde_json::{json, Value};

use crate::harness::*;
use crate::sandbox::give_to_nobody;

#[derive(Clone, Copy, Debug)]
enum As {
    Root,
    Nobody,
}

/// A started daemon serving the test tools under `profile`, as `who`, with session "s".
async fn daemon(
    profile: &str,
    who: As,
) -> (Daemon, rmcp::service::RunningService<rmcp::RoleClient, ()>) {
    require_root_for("runs the daemon as root and as nobody");
    require_program("/usr/bin/sed", "sed");
    let mut d = Daemon::new();
    for tool in ["edit_inout", "sed_inout"] {
        let src = std::fs::read_to_string(repo().join(format!("tests/tools/{tool}.toml"))).unwrap();
        let with_profile = src.replace(
            "capability = \"write\"",
            &format!("capability = \"write\"\nprofile = \"{profile}\""),
        );
        d.add_tool(tool, &with_profile);
    }
    d.write("docs/a.txt", "alpha\nbeta\n");
    std::fs::set_permissions(
        d.workspace.join("docs/a.txt"),
        std::os::unix::fs::PermissionsExt::from_mode(0o640),
    )
    .unwrap();
    if let As::Nobody = who {
        give_to_nobody(&d);
        d.user = Some((65534, 65534));
    }
    d.start();
    let c = d.client().await;
    session(&c, "s").await;
    (d, c)
}

fn ino(d: &Daemon, rel: &str) -> u64 {
    std::fs::metadata(d.workspace.join(rel)).unwrap().ino()
}

fn outputs(r: &Value) -> Value {
    r["structuredContent"]["outputs"].clone()
}

/// The `commit` event of the last call, from the durable log.
async fn last_commit(c: &rmcp::service::RunningService<rmcp::RoleClient, ()>) -> Value {
    audit(c)
        .await
        .into_iter()
        .rev()
        .find(|e| e["kind"] == "commit")
        .expect("a commit event")
}

/// Nothing of the call is left: no job dir, and the log verifies.
fn assert_clean(d: &Daemon) {
    assert!(d.job_dirs().is_empty(), "job dirs left: {:?}", d.job_dirs());
    d.assert_audit_verifies("in-out");
}

async fn edits_deletions_and_no_ops(profile: &str, who: As) {
    let (mut d, c) = daemon(profile, who).await;
    let ctx = format!("{profile} {who:?}");

    // A real editor, in place: sed -i rewrites the copy; the target gets the new content and
    // keeps its mode (0640), and the result and the audit say it changed.
    let r = call(
        &c,
        "sed_inout",
        json!({"session": "s", "path": "docs/a.txt", "expr": "s/beta/gamma/"}),
    )
    .await;
    assert!(!is_error(&r), "{ctx}: {r}");
    assert_eq!(
        d.read("docs/a.txt").as_deref(),
        Some("alpha\ngamma\n"),
        "{ctx}"
    );
    let meta = std::fs::metadata(d.workspace.join("docs/a.txt")).unwrap();
    assert_eq!(meta.mode() & 0o7777, 0o640, "{ctx}");
    assert_eq!(
        meta.uid(),
        std::fs::metadata(&d.state).unwrap().uid(),
        "{ctx}: owner"
    );
    assert_eq!(outputs(&r)[0]["changed"], true, "{ctx}: {r}");
    assert_eq!(outputs(&r)[0]["deleted"], false, "{ctx}: {r}");
    let commit = last_commit(&c).await;
    assert_eq!(
        commit["detail"]["outputs"][0]["changed"], true,
        "{ctx}: {commit}"
    );
    assert_eq!(version(&c, "s").await, 1, "{ctx}");

    // Untouched: nothing is published; the target is the very same file.
    let before = ino(&d, "docs/a.txt");
    let r = call(
        &c,
        "edit_inout",
        json!({"session": "s", "path": "docs/a.txt", "action": "keep"}),
    )
    .await;
    assert!(!is_error(&r), "{ctx}: {r}");
    assert_eq!(outputs(&r)[0]["changed"], false, "{ctx}: {r}");
    assert_eq!(
        ino(&d, "docs/a.txt"),
        before,
        "{ctx}: an unchanged copy was published"
    );
    // Rewritten with the same bytes (a new file, same content): unchanged too.
    let r = call(
        &c,
        "edit_inout",
        json!({"session": "s", "path": "docs/a.txt", "action": "same"}),
    )
    .await;
    assert!(!is_error(&r), "{ctx}: {r}");
    assert_eq!(outputs(&r)[0]["changed"], false, "{ctx}: {r}");
    assert_eq!(ino(&d, "docs/a.txt"), before, "{ctx}");
    assert_eq!(
        d.read("docs/a.txt").as_deref(),
        Some("alpha\ngamma\n"),
        "{ctx}"
    );

    // Removed by the worker: the target is deleted in the commit.
    let r = call(
        &c,
        "edit_inout",
        json!({"session": "s", "path": "docs/a.txt", "action": "rm"}),
    )
    .await;
    assert!(!is_error(&r), "{ctx}: {r}");
    assert!(
        !d.workspace.join("docs/a.txt").exists(),
        "{ctx}: not deleted"
    );
    assert!(
        d.workspace.join("docs").is_dir(),
        "{ctx}: its directory stays"
    );
    assert_eq!(outputs(&r)[0]["deleted"], true, "{ctx}: {r}");
    let commit = last_commit(&c).await;
    assert_eq!(
        commit["detail"]["outputs"][0]["deleted"], true,
        "{ctx}: {commit}"
    );

    // A target that does not exist: the worker finds nothing; doing nothing leaves nothing,
    // writing creates it.
    let r = call(
        &c,
        "edit_inout",
        json!({"session": "s", "path": "new/b.txt", "action": "keep"}),
    )
    .await;
    assert!(!is_error(&r), "{ctx}: {r}");
    assert_eq!(outputs(&r)[0]["changed"], false, "{ctx}: {r}");
    assert!(
        !d.workspace.join("new").exists(),
        "{ctx}: a parent was created for nothing"
    );
    let r = call(
        &c,
        "edit_inout",
        json!({"session": "s", "path": "new/b.txt", "action": "append:hello"}),
    )
    .await;
    assert!(!is_error(&r), "{ctx}: {r}");
    assert_eq!(d.read("new/b.txt").as_deref(), Some("hello"), "{ctx}");
    assert_eq!(outputs(&r)[0]["changed"], true, "{ctx}: {r}");

    // A hostile worker swaps its copy for a symlink to a file outside: refused, nothing
    // published, the target as it was.
    let r = call(
        &c,
        "edit_inout",
        json!({"session": "s", "path": "new/b.txt", "action": "link"}),
    )
    .await;
    assert_eq!(code(&r), "TOOL_FAILED", "{ctx}: {r}");
    assert_eq!(d.read("new/b.txt").as_deref(), Some("hello"), "{ctx}");
    assert!(!std::fs::symlink_metadata(d.workspace.join("new/b.txt"))
        .unwrap()
        .is_symlink());
    assert_eq!(version(&c, "s").await, 6, "{ctx}");

    // A directory where the in-out file would be: refused before the worker runs.
    std::fs::create_dir_all(d.workspace.join("adir")).unwrap();
    let r = call(
        &c,
        "edit_inout",
        json!({"session": "s", "path": "adir", "action": "keep"}),
    )
    .await;
    assert_eq!(code(&r), "PATH_REJECTED", "{ctx}: {r}");
    assert_eq!(version(&c, "s").await, 6, "{ctx}");
    assert_clean(&d);

    // The next start finds nothing to recover and serves.
    drop(c);
    d.stop();
    d.start();
    let c = d.client().await;
    assert_eq!(version(&c, "s").await, 6, "{ctx}");
    assert!(
        !d.log_text().contains("recovered"),
        "{ctx}: {}",
        d.log_text()
    );
    assert_clean(&d);
}

#[tokio::test]
async fn inout_edits_deletions_and_no_ops_default_profile_as_root() {
    edits_deletions_and_no_ops("default", As::Root).await;
}

#[tokio::test]
async fn inout_edits_deletions_and_no_ops_strict_profile_as_root() {
    edits_deletions_and_no_ops("strict", As::Root).await;
}

#[tokio::test]
async fn inout_edits_deletions_and_no_ops_default_profile_unprivileged() {
    edits_deletions_and_no_ops("default", As::Nobody).await;
}

#[tokio::test]
async fn inout_edits_deletions_and_no_ops_strict_profile_unprivileged() {
    edits_deletions_and_no_ops("strict", As::Nobody).await;
}

/// Someone else edits the target while the call is paused at `point`: the call fails with
/// CONFLICT, that edit survives, the session keeps its version, nothing is left behind.
async fn outside_edit_is_a_conflict(action: &str, point: &str, edit: impl FnOnce(&Path)) {
    let a = json!({"path": "docs/a.txt", "action": action});
    let d = conflict_at("edit_inout", a, point, |ws| edit(&ws.join("docs/a.txt"))).await;
    d.read("docs/a.txt")
        .map(|s| {
            assert!(
                s.contains("outside"),
                "{action} at {point}: the outside edit was lost: {s:?}"
            )
        })
        .unwrap_or_else(|| panic!("{action} at {point}: the target is gone"));
}

/// The workspace every conflict test starts from: `docs/a.txt`, and the tree `tree/`.
fn prepare(d: &Daemon) {
    d.write("docs/a.txt", "alpha\n");
    d.write("tree/sub/deep/c.txt", "gamma");
    d.write("tree/b.txt", "beta");
}

/// Runs `tool` with `args`, paused at failpoint `point` while `edit` changes the workspace:
/// the call must be a CONFLICT naming `args["path"]` or `args["dir"]`, the session unmoved,
/// nothing left behind.
async fn conflict_at(tool: &str, args: Value, point: &str, edit: impl FnOnce(&Path)) -> Daemon {
    let index = crate::race::point_index(tool, &args, prepare, point).await;
    let mut d = Daemon::new();
    prepare(&d);
    let log = d.dir.path().join("points.log");
    d.env = vec![
        ("AIRLOCK_FAILPOINT_LOG".into(), log.display().to_string()),
        ("AIRLOCK_FAILPOINT_PAUSE_AT".into(), index.to_string()),
        ("AIRLOCK_FAILPOINT_PAUSE_MS".into(), "1500".into()),
    ];
    d.start();
    let c = std::sync::Arc::new(d.client().await);
    session(&c, "s").await;
    let c2 = c.clone();
    let mut a = args.clone();
    a["session"] = "s".into();
    let tool2 = tool.to_string();
    let running = tokio::spawn(async move { call(&c2, &tool2, a).await });
    let want = format!("{index} {point}");
    wait_until("the daemon pauses at the failpoint", || {
        std::fs::read_to_string(&log)
            .unwrap_or_default()
            .lines()
            .any(|l| l == want)
    })
    .await;
    edit(&d.workspace);
    let r = running.await.unwrap();
    let ctx = format!("{tool} {args} at {point}");
    let target = args
        .get("path")
        .or(args.get("dir"))
        .and_then(Value::as_str)
        .unwrap();
    assert_eq!(code(&r), "CONFLICT", "{ctx}: {r}");
    assert!(text(&r).contains(target), "{ctx}: {r}");
    assert_eq!(version(&c, "s").await, 0, "{ctx}: the session moved");
    let events = audit(&c).await;
    assert!(
        events
            .iter()
            .any(|e| e["kind"] == "rollback" || (e["kind"] == "error" && e["code"] == "CONFLICT")),
        "{ctx}: {events:?}"
    );
    assert!(d.job_dirs().is_empty(), "{ctx}: {:?}", d.job_dirs());
    d
}

#[tokio::test]
async fn an_outside_edit_during_the_call_is_a_conflict_not_a_lost_write() {
    // Before publication looks (while the staged copy is sealed), and between the check and
    // the rename (at the rename's own failpoint): an append, a replacement by rename.
    for point in ["publish.seal_output", "publish.exchange"] {
        outside_edit_is_a_conflict("append:mine", point, |p| {
            use std::io::Write;
            let mut f = std::fs::OpenOptions::new().append(true).open(p).unwrap();
            f.write_all(b"outside\n").unwrap();
        })
        .await;
        outside_edit_is_a_conflict("append:mine", point, |p| {
            let tmp = p.with_extension("new");
            std::fs::write(&tmp, "outside\n").unwrap();
            std::fs::rename(&tmp, p).unwrap();
        })
        .await;
    }
    // A deletion must not delete what someone else just wrote.
    for point in ["publish.journal_write", "publish.delete_inout"] {
        outside_edit_is_a_conflict("rm", point, |p| {
            use std::io::Write;
            let mut f = std::fs::OpenOptions::new().append(true).open(p).unwrap();
            f.write_all(b"outside\n").unwrap();
        })
        .await;
    }
}

/// A daemon with the tree `docs/` (`sub/a.txt`, `b.txt`, a relative symlink `l -> b.txt`).
async fn tree_daemon(
    profile: &str,
    who: As,
) -> (Daemon, rmcp::service::RunningService<rmcp::RoleClient, ()>) {
    require_root_for("runs the daemon as root and as nobody");
    let mut d = Daemon::new();
    let src = std::fs::read_to_string(repo().join("tests/tools/edit_tree.toml")).unwrap();
    d.add_tool(
        "edit_tree",
        &src.replace(
            "capability = \"write\"",
            &format!("capability = \"write\"\nprofile = \"{profile}\""),
        ),
    );
    d.write("docs/sub/a.txt", "alpha");
    d.write("docs/b.txt", "beta");
    std::os::unix::fs::symlink("b.txt", d.workspace.join("docs/l")).unwrap();
    if let As::Nobody = who {
        give_to_nobody(&d);
        d.user = Some((65534, 65534));
    }
    d.start();
    let c = d.client().await;
    session(&c, "s").await;
    (d, c)
}

async fn directory_edits(profile: &str, who: As) {
    let (mut d, c) = tree_daemon(profile, who).await;
    let ctx = format!("{profile} {who:?}");
    let call_tree = |action: &'static str, dir: &'static str| {
        let c = &c;
        async move {
            call(
                c,
                "edit_tree",
                json!({"session": "s", "dir": dir, "action": action}),
            )
            .await
        }
    };

    // Untouched, or a file rewritten with its own bytes: nothing published.
    let top = ino(&d, "docs");
    for action in ["keep", "same"] {
        let r = call_tree(action, "docs").await;
        assert!(!is_error(&r), "{ctx} {action}: {r}");
        assert_eq!(outputs(&r)[0]["changed"], false, "{ctx} {action}: {r}");
        assert_eq!(
            ino(&d, "docs"),
            top,
            "{ctx} {action}: the tree was republished"
        );
    }

    // Changed: the whole tree is replaced by one rename; the old tree is gone.
    let r = call_tree("edit", "docs").await;
    assert!(!is_error(&r), "{ctx}: {r}");
    assert_eq!(outputs(&r)[0]["changed"], true, "{ctx}: {r}");
    assert_eq!(outputs(&r)[0]["kind"], "directory", "{ctx}: {r}");
    assert_ne!(ino(&d, "docs"), top, "{ctx}");
    let names = tree_names(&d.workspace.join("docs"));
    assert_eq!(
        names,
        ["l", "new.txt", "sub", "sub/a.txt"],
        "{ctx}: {names:?}"
    );
    assert_eq!(d.read("docs/sub/a.txt").as_deref(), Some("changed"));
    assert_eq!(d.read("docs/new.txt").as_deref(), Some("added"));
    assert_eq!(
        std::fs::read_link(d.workspace.join("docs/l")).unwrap(),
        Path::new("b.txt")
    );
    let owner = std::fs::metadata(&d.state).unwrap().uid();
    walk_tree(&d.workspace.join("docs"), |rel, _, m| {
        assert_eq!(m.uid(), owner, "{ctx}: {rel} not sealed");
        if !m.file_type().is_symlink() {
            assert_eq!(m.mode() & 0o7022, 0, "{ctx}: {rel} mode {:o}", m.mode());
        }
    });

    // Removed: the target is deleted; a new one is created from nothing.
    let r = call_tree("rm", "docs").await;
    assert!(!is_error(&r), "{ctx}: {r}");
    assert_eq!(outputs(&r)[0]["deleted"], true, "{ctx}: {r}");
    assert!(!d.workspace.join("docs").exists(), "{ctx}");
    let r = call_tree("create", "fresh/tree").await;
    assert!(!is_error(&r), "{ctx}: {r}");
    assert_eq!(
        d.read("fresh/tree/x/y.txt").as_deref(),
        Some("made"),
        "{ctx}"
    );

    // A tree that cannot be copied for the tool: refused before it runs, nothing created.
    std::fs::create_dir_all(d.workspace.join("odd")).unwrap();
    std::os::unix::fs::symlink("../../etc", d.workspace.join("odd/out")).unwrap();
    let v = version(&c, "s").await;
    let r = call_tree("keep", "odd").await;
    assert_eq!(code(&r), "PATH_REJECTED", "{ctx}: {r}");
    assert!(text(&r).contains("leads out"), "{ctx}: {r}");
    let fifo = d.workspace.join("fifo-tree");
    std::fs::create_dir_all(&fifo).unwrap();
    assert!(std::process::Command::new("mkfifo")
        .arg(fifo.join("p"))
        .status()
        .unwrap()
        .success());
    let r = call_tree("keep", "fifo-tree").await;
    assert_eq!(code(&r), "PATH_REJECTED", "{ctx}: {r}");
    assert!(text(&r).contains("FIFO"), "{ctx}: {r}");
    assert_eq!(version(&c, "s").await, v, "{ctx}");
    assert_clean(&d);

    drop(c);
    d.stop();
    d.start();
    let c = d.client().await;
    assert_eq!(version(&c, "s").await, v, "{ctx}");
    assert_clean(&d);
}

#[tokio::test]
async fn inout_directories_default_profile_as_root() {
    directory_edits("default", As::Root).await;
}

#[tokio::test]
async fn inout_directories_strict_profile_as_root() {
    directory_edits("strict", As::Root).await;
}

#[tokio::test]
async fn inout_directories_default_profile_unprivileged() {
    directory_edits("default", As::Nobody).await;
}

#[tokio::test]
async fn inout_directories_strict_profile_unprivileged() {
    directory_edits("strict", As::Nobody).await;
}

#[tokio::test]
async fn an_outside_edit_deep_in_an_inout_directory_is_a_conflict() {
    // A file changed three levels down, before the check and between the check and the
    // rename; a file added; and, for a removal of the tree, a file changed.
    for (action, point) in [
        ("edit", "publish.journal_write"),
        ("edit", "publish.exchange"),
        ("rm", "publish.delete_inout"),
    ] {
        let d = conflict_at(
            "edit_tree",
            json!({"dir": "tree", "action": action}),
            point,
            |ws| {
                use std::io::Write;
                let mut f = std::fs::OpenOptions::new()
                    .append(true)
                    .open(ws.join("tree/sub/deep/c.txt"))
                    .unwrap();
                f.write_all(b" outside").unwrap();
            },
        )
        .await;
        assert_eq!(
            d.read("tree/sub/deep/c.txt").as_deref(),
            Some("gamma outside"),
            "{action} {point}"
        );
        assert_eq!(
            d.read("tree/b.txt").as_deref(),
            Some("beta"),
            "{action} {point}"
        );
    }
    let d = conflict_at(
        "edit_tree",
        json!({"dir": "tree", "action": "edit"}),
        "publish.journal_write",
        |ws| std::fs::write(ws.join("tree/sub/theirs.txt"), "theirs").unwrap(),
    )
    .await;
    assert_eq!(d.read("tree/sub/theirs.txt").as_deref(), Some("theirs"));
}

/// An in-out file over the profile's `staging_size`, or a tree over its `staging_files`, is
/// refused before it is copied: nothing is created, the worker never runs, the daemon serves.
#[tokio::test]
async fn an_inout_target_over_the_staging_limits_is_refused_before_the_copy() {
    let mut d = Daemon::new();
    let default = std::fs::read_to_string(d.policies.join("profiles/default.toml")).unwrap();
    let tiny: String = default
        .lines()
        .map(|l| match l.split('=').next().unwrap_or("").trim() {
            "staging_size" => "staging_size = \"4KiB\"".to_string(),
            "staging_files" => "staging_files = 5".to_string(),
            _ => l.to_string(),
        })
        .collect::<Vec<_>>()
        .join("\n");
    assert!(tiny.contains("staging_size = \"4KiB\""), "{tiny}");
    std::fs::write(d.policies.join("profiles/tiny.toml"), tiny).unwrap();
    for tool in ["edit_inout", "edit_tree"] {
        let src = std::fs::read_to_string(repo().join(format!("tests/tools/{tool}.toml"))).unwrap();
        d.add_tool(
            tool,
            &src.replace(
                "capability = \"write\"",
                "capability = \"write\"\nprofile = \"tiny\"",
            ),
        );
    }
    d.write("big.txt", &"x".repeat(8192));
    for i in 0..10 {
        d.write(&format!("many/f{i}"), "f");
    }
    d.start();
    let c = d.client().await;
    session(&c, "s").await;
    let r = call(
        &c,
        "edit_inout",
        json!({"session": "s", "path": "big.txt", "action": "keep"}),
    )
    .await;
    assert_eq!(code(&r), "PATH_REJECTED", "{r}");
    assert!(
        text(&r).contains("8192 bytes") && text(&r).contains("staging_size"),
        "{r}"
    );
    let r = call(
        &c,
        "edit_tree",
        json!({"session": "s", "dir": "many", "action": "keep"}),
    )
    .await;
    assert_eq!(code(&r), "PATH_REJECTED", "{r}");
    assert!(text(&r).contains("staging_files"), "{r}");
    let events = audit(&c).await;
    let worker_ran = |e: &Value| {
        e["kind"] == "start" && e["tool"].as_str().is_some_and(|t| t.starts_with("edit_"))
    };
    assert!(!events.iter().any(worker_ran), "a worker ran: {events:?}");
    assert_eq!(version(&c, "s").await, 0);
    assert_clean(&d);
    // Within the limits, the same tools run.
    let r = call(
        &c,
        "edit_inout",
        json!({"session": "s", "path": "many/f0", "action": "append:g"}),
    )
    .await;
    assert!(!is_error(&r), "{r}");
    assert_eq!(d.read("many/f0").as_deref(), Some("fg"));
}
