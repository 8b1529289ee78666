//! The shipped file tools (`write_file`, `edit_file`, `move_file`), each all or nothing,
//! through the real daemon under both shipped profiles: what they change, and that a refused
//! call changes nothing at all (content, inode, session version, job dirs).

use std::os::unix::fs::MetadataExt;

use serde_json::{json, Value};

use crate::harness::*;

type Client = rmcp::service::RunningService<rmcp::RoleClient, ()>;

/// A daemon serving the shipped tools under `profile`, with session "s".
async fn daemon(profile: &str, unprivileged: bool) -> (Daemon, Client) {
    require_program("/usr/bin/python3", "python3");
    let mut d = Daemon::new();
    require_program("/usr/bin/patch", "patch");
    for tool in ["write_file", "edit_file", "move_file", "apply_patch"] {
        let src =
            std::fs::read_to_string(repo().join(format!("policies/tools/{tool}.toml"))).unwrap();
        d.add_tool(
            tool,
            &src.replace("profile = \"default\"", &format!("profile = \"{profile}\"")),
        );
    }
    if unprivileged {
        require_root_for("runs the daemon as nobody");
        crate::sandbox::give_to_nobody(&d);
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

/// A refused call: `TOOL_FAILED` whose text holds `why`, and nothing changed.
async fn refused(d: &Daemon, c: &Client, tool: &str, a: Value, why: &str, files: &[&str]) {
    let before: Vec<_> = files
        .iter()
        .map(|f| (d.read(f), d.workspace.join(f).exists().then(|| ino(d, f))))
        .collect();
    let v = version(c, "s").await;
    let r = call(c, tool, a.clone()).await;
    assert_eq!(code(&r), "TOOL_FAILED", "{tool} {a}: {r}");
    assert!(text(&r).contains(why), "{tool} {a}: wanted {why:?} in {r}");
    let after: Vec<_> = files
        .iter()
        .map(|f| (d.read(f), d.workspace.join(f).exists().then(|| ino(d, f))))
        .collect();
    assert_eq!(before, after, "{tool} {a}: a refused call changed a file");
    assert_eq!(version(c, "s").await, v, "{tool} {a}: the session moved");
    assert!(d.job_dirs().is_empty(), "{:?}", d.job_dirs());
}

async fn file_tools(profile: &str, unprivileged: bool) {
    let (d, c) = daemon(profile, unprivileged).await;

    // write_file creates, then replaces.
    let r = call(&c, "write_file", json!({"session": "s", "path": "src/main.py", "content": "def f():\n    return 1\n\nprint(f())\n"})).await;
    assert!(!is_error(&r), "{profile}: {r}");
    assert_eq!(
        d.read("src/main.py").as_deref(),
        Some("def f():\n    return 1\n\nprint(f())\n")
    );

    // edit_file: two edits in order, a unified diff back, the file replaced as a whole.
    let r = call(
        &c,
        "edit_file",
        json!({"session": "s", "path": "src/main.py", "edits": [
            {"oldText": "return 1", "newText": "return 2"},
            {"oldText": "print(f())", "newText": "print(f() + 1)"}
        ]}),
    )
    .await;
    assert!(!is_error(&r), "{profile}: {r}");
    let diff = text(&r);
    assert!(
        diff.contains("--- a/main.py") && diff.contains("+++ b/main.py"),
        "{diff}"
    );
    assert!(diff.contains("-    return 1\n+    return 2\n"), "{diff}");
    assert!(diff.contains("-print(f())\n+print(f() + 1)\n"), "{diff}");
    assert_eq!(
        d.read("src/main.py").as_deref(),
        Some("def f():\n    return 2\n\nprint(f() + 1)\n")
    );
    assert_eq!(r["structuredContent"]["outputs"][0]["changed"], true, "{r}");

    // dryRun: the same diff, nothing published (the very same file stays).
    let before = ino(&d, "src/main.py");
    let r = call(&c, "edit_file", json!({"session": "s", "path": "src/main.py", "dryRun": true, "edits": [{"oldText": "return 2", "newText": "return 3"}]})).await;
    assert!(!is_error(&r), "{profile}: {r}");
    assert!(text(&r).contains("+    return 3"), "{r}");
    assert_eq!(
        r["structuredContent"]["outputs"][0]["changed"], false,
        "{r}"
    );
    assert_eq!(ino(&d, "src/main.py"), before);
    assert!(d.read("src/main.py").unwrap().contains("return 2"));

    // All or nothing: the first edit applies, the second does not match: nothing changes.
    let files = ["src/main.py"];
    refused(
        &d,
        &c,
        "edit_file",
        json!({"session": "s", "path": "src/main.py", "edits": [
            {"oldText": "return 2", "newText": "return 9"},
            {"oldText": "not there", "newText": "x"}
        ]}),
        "edit 1: oldText occurs 0 times",
        &files,
    )
    .await;
    d.write("src/twice.txt", "a\na\n");
    refused(&d, &c, "edit_file", json!({"session": "s", "path": "src/twice.txt", "edits": [{"oldText": "a", "newText": "b"}]}), "edit 0: oldText occurs 2 times", &["src/twice.txt"]).await;
    refused(&d, &c, "edit_file", json!({"session": "s", "path": "src/none.txt", "edits": [{"oldText": "a", "newText": "b"}]}), "does not exist", &[]).await;
    assert!(!d.workspace.join("src/none.txt").exists());
    refused(
        &d,
        &c,
        "edit_file",
        json!({"session": "s", "path": "src/main.py", "edits": [{"oldText": "return 2"}]}),
        "edit 0: must be an object",
        &files,
    )
    .await;

    // move_file: source gone and destination present in one commit, into a new directory.
    let content = d.read("src/main.py");
    let r = call(
        &c,
        "move_file",
        json!({"session": "s", "source": "src/main.py", "destination": "lib/app/main.py"}),
    )
    .await;
    assert!(!is_error(&r), "{profile}: {r}");
    assert!(!d.workspace.join("src/main.py").exists());
    assert_eq!(d.read("lib/app/main.py"), content);
    let outs = &r["structuredContent"]["outputs"];
    let by_param = |p: &str| {
        outs.as_array()
            .unwrap()
            .iter()
            .find(|o| o["param"] == p)
            .cloned()
            .unwrap()
    };
    assert_eq!(by_param("source")["deleted"], true, "{r}");
    assert_eq!(by_param("destination")["changed"], true, "{r}");
    // An existing destination, a missing source: refused, nothing moved.
    d.write("other.txt", "other");
    refused(
        &d,
        &c,
        "move_file",
        json!({"session": "s", "source": "lib/app/main.py", "destination": "other.txt"}),
        "the destination exists",
        &["lib/app/main.py", "other.txt"],
    )
    .await;
    refused(
        &d,
        &c,
        "move_file",
        json!({"session": "s", "source": "nope.txt", "destination": "new.txt"}),
        "the source does not exist",
        &["new.txt"],
    )
    .await;
    if unprivileged {
        // GNU patch sets each file's mode, and a worker sharing the daemon's uid may change
        // no mode (seccomp): it fails cleanly, nothing changed.
        d.write("proj/src/lib.txt", "one\ntwo\nthree\n");
        let patch =
            "--- a/src/lib.txt\n+++ b/src/lib.txt\n@@ -1,3 +1,3 @@\n one\n-two\n+TWO\n three\n";
        refused(
            &d,
            &c,
            "apply_patch",
            json!({"session": "s", "dir": "proj", "patch": patch}),
            "Failed to set the permissions",
            &["proj/src/lib.txt"],
        )
        .await;
    } else {
        apply_patch_all_or_nothing(&d, &c).await;
    }

    // The same path twice is refused before anything runs.
    let r = call(
        &c,
        "move_file",
        json!({"session": "s", "source": "other.txt", "destination": "./other.txt"}),
    )
    .await;
    assert_eq!(code(&r), "OVERLAPPING_OUTPUTS", "{r}");
    assert_eq!(d.read("other.txt").as_deref(), Some("other"));
}

#[tokio::test]
async fn file_tools_are_all_or_nothing_default_profile() {
    file_tools("default", false).await;
}

#[tokio::test]
async fn file_tools_are_all_or_nothing_strict_profile() {
    file_tools("strict", false).await;
}

#[tokio::test]
async fn file_tools_are_all_or_nothing_default_profile_unprivileged() {
    file_tools("default", true).await;
}

#[tokio::test]
async fn file_tools_are_all_or_nothing_strict_profile_unprivileged() {
    file_tools("strict", true).await;
}

/// apply_patch with a worker uid of its own: a two-file diff in one commit, a half-applying
/// one refused whole, one reaching out of the tree writing nothing outside.
async fn apply_patch_all_or_nothing(d: &Daemon, c: &Client) {
    // apply_patch: a git-style diff changing one file and adding another, in one commit.
    d.write("proj/src/lib.txt", "one\ntwo\nthree\n");
    d.write("proj/README", "readme\n");
    let patch = "diff --git a/src/lib.txt b/src/lib.txt\n--- a/src/lib.txt\n+++ b/src/lib.txt\n@@ -1,3 +1,3 @@\n one\n-two\n+TWO\n three\n--- /dev/null\n+++ b/docs/new.md\n@@ -0,0 +1 @@\n+# new\n";
    let r = call(
        c,
        "apply_patch",
        json!({"session": "s", "dir": "proj", "patch": patch}),
    )
    .await;
    assert!(!is_error(&r), "{r}");
    assert_eq!(
        d.read("proj/src/lib.txt").as_deref(),
        Some("one\nTWO\nthree\n")
    );
    assert_eq!(d.read("proj/docs/new.md").as_deref(), Some("# new\n"));
    assert_eq!(d.read("proj/README").as_deref(), Some("readme\n"));
    assert!(text(&r).contains("patching file"), "{r}");
    // One hunk of two does not apply: nothing at all changes (the first file stays, no
    // .rej or .orig appears), the tree is the very same directory.
    let top = ino(d, "proj");
    let names = tree_names(&d.workspace.join("proj"));
    let half = "--- a/README\n+++ b/README\n@@ -1 +1 @@\n-readme\n+README\n--- a/src/lib.txt\n+++ b/src/lib.txt\n@@ -1,3 +1,3 @@\n one\n-two\n+deux\n three\n";
    refused(
        d,
        c,
        "apply_patch",
        json!({"session": "s", "dir": "proj", "patch": half}),
        "the patch does not apply",
        &["proj/README", "proj/src/lib.txt"],
    )
    .await;
    assert_eq!(ino(d, "proj"), top);
    assert_eq!(tree_names(&d.workspace.join("proj")), names);
    // A patch reaching out of the tree writes nothing outside it.
    let out = "--- a/../../escaped.txt\n+++ b/../../escaped.txt\n@@ -0,0 +1 @@\n+x\n";
    let _ = call(
        c,
        "apply_patch",
        json!({"session": "s", "dir": "proj", "patch": out}),
    )
    .await;
    assert!(!d.workspace.join("escaped.txt").exists());
    assert!(!d.dir.path().join("escaped.txt").exists());
    assert_eq!(tree_names(&d.workspace.join("proj")), names);
}
