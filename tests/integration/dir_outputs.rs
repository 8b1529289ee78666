//! Directory outputs (`kind = "directory"`) through the real daemon: a tree published by one
//! rename (new, or replacing an old tree), sealed, described in the `commit` event and the
//! result; hostile trees refused naming the entry with nothing published and a clean next
//! start; a target of the other type refused before anything is created; a reader seeing
//! one tree or the other; a directory and a file inside it serialized.

use std::collections::BTreeMap;
use std::os::unix::fs::MetadataExt;
use std::path::{Path, PathBuf};
use std::time::{SystemTime, UNIX_EPOCH};

use serde_json::{json, Value};

use crate::harness::*;
use crate::sandbox::give_to_nobody;

/// A daemon with `tree_sh` (write: a shell script with `$1` an empty directory output,
/// under `profile`) and `tree_and_file` (a directory output and a file output).
fn daemon(profile: &str) -> Daemon {
    let d = Daemon::new();
    d.add_tool(
        "tree_sh",
        &format!(
            r#"name = "tree_sh"
description = "Fill a directory output with a shell script (test only)"
capability = "write"
profile = "{profile}"
command = ["/bin/sh", "-c", "{{script}}", "tree_sh", "{{out}}", "{{input}}"]
timeout = "300s"
[params.script]
type = "string"
[params.out]
type = "string"
path = "output"
kind = "directory"
[params.input]
type = "string"
path = "input"
required = false
"#
        ),
    );
    d.add_tool(
        "tree_py",
        &format!(
            r#"name = "tree_py"
description = "Fill a directory output with python code (test only)"
capability = "write"
profile = "{profile}"
command = ["/usr/bin/python3", "-I", "-c", "{{code}}", "{{out}}"]
timeout = "300s"
[params.code]
type = "string"
[params.out]
type = "string"
path = "output"
kind = "directory"
"#
        ),
    );
    d.add_tool(
        "tree_and_file",
        r#"name = "tree_and_file"
description = "A directory output and a file output (test only)"
capability = "write"
command = ["/bin/sh", "-c", "echo x > \"$1/x\" && echo f > \"$2\"", "tree_and_file", "{dir}", "{file}"]
timeout = "10s"
[params.dir]
type = "string"
path = "output"
kind = "directory"
[params.file]
type = "string"
path = "output"
"#,
    );
    d
}

fn as_nobody(d: &mut Daemon) {
    give_to_nobody(d);
    d.user = Some((65534, 65534));
}

/// The daemon configurations hostile trees run under: both profiles as root (workers under
/// a uid of their own), and the default profile as `nobody` (workers under the daemon's).
const MATRIX: [(&str, bool); 3] = [("default", false), ("strict", false), ("default", true)];

fn unique() -> String {
    let n = SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .expect("clock")
        .subsec_nanos();
    format!("{:09}{}", n, std::process::id() % 1000)
}

/// The canonical manifest of the tree at `dir` as the README documents it, and its SHA-256.
fn manifest(dir: &Path) -> String {
    use sha2::Digest;
    let mut entries: BTreeMap<Vec<u8>, Vec<u8>> = BTreeMap::new();
    let rec = |kind: &str, mode: u32, rel: &str, datum: &[u8]| {
        let mut r = Vec::new();
        for f in [
            kind.as_bytes(),
            format!("{mode:04o}").as_bytes(),
            rel.as_bytes(),
            datum,
        ] {
            r.extend_from_slice(f);
            r.push(0);
        }
        r
    };
    let top = std::fs::symlink_metadata(dir).unwrap().mode() & 0o7777;
    entries.insert(b".".to_vec(), rec("d", top, ".", b""));
    walk_tree(dir, |rel, p, m| {
        let r = if m.file_type().is_symlink() {
            let t = std::fs::read_link(p).unwrap();
            rec("l", 0o777, rel, t.as_os_str().as_encoded_bytes())
        } else if m.is_dir() {
            rec("d", m.mode() & 0o7777, rel, b"")
        } else {
            let sha = hex(&sha2::Sha256::digest(std::fs::read(p).unwrap()));
            rec("f", m.mode() & 0o7777, rel, sha.as_bytes())
        };
        entries.insert(rel.as_bytes().to_vec(), r);
    });
    let mut h = sha2::Sha256::new();
    for r in entries.values() {
        h.update(r);
    }
    hex(&h.finalize())
}

fn hex(b: &[u8]) -> String {
    b.iter().map(|x| format!("{x:02x}")).collect()
}

/// Every entry's owner and mode beneath `dir` (itself included).
fn owners_and_modes(dir: &Path) -> Vec<(String, u32, u32, u32)> {
    let m = std::fs::symlink_metadata(dir).unwrap();
    let mut out = vec![(".".to_string(), m.uid(), m.gid(), m.mode() & 0o7777)];
    walk_tree(dir, |rel, _, m| {
        out.push((rel.to_string(), m.uid(), m.gid(), m.mode() & 0o7777))
    });
    out
}

fn commits(events: &[Value]) -> Vec<&Value> {
    events
        .iter()
        .filter(|e| e["kind"] == "commit" && e["tool"] == "tree_sh")
        .collect()
}

/// A new tree, then a tree replacing it: the old tree entirely gone, the new one exactly
/// there, every entry the daemon's with no group/other write, no setuid/setgid/sticky; the
/// `commit` event and `structuredContent` give kind, files, bytes and the manifest SHA-256.
#[tokio::test]
async fn a_directory_output_is_published_whole_and_replaces_an_old_tree() {
    require_root();
    for (profile, nobody) in MATRIX {
        let what = format!("{profile}{}", if nobody { " as nobody" } else { "" });
        let mut d = daemon(profile);
        if nobody {
            as_nobody(&mut d);
        }
        d.start();
        let c = d.client().await;
        session(&c, "t").await;
        let uid = if nobody { 65534 } else { 0 };
        let r = call(
            &c,
            "tree_sh",
            json!({"session": "t", "out": "site",
                "script": "mkdir -p \"$1/css/deep\" && echo hi > \"$1/index.html\" && printf 'a{}' > \"$1/css/deep/a.css\" \
                    && (chmod 0777 \"$1/index.html\" \"$1/css\" 2>/dev/null || true) && ln -s css/deep/a.css \"$1/style.css\" \
                    && ln -s ../../index.html \"$1/css/deep/home\""}),
        )
        .await;
        assert!(!is_error(&r), "{what}: {r}");
        let site = d.workspace.join("site");
        assert_eq!(d.read("site/index.html").as_deref(), Some("hi\n"), "{what}");
        assert_eq!(d.read("site/style.css").as_deref(), Some("a{}"), "{what}");
        assert_eq!(
            d.read("site/css/deep/home").as_deref(),
            Some("hi\n"),
            "{what}"
        );
        for (rel, u, g, mode) in owners_and_modes(&site) {
            let link = std::fs::symlink_metadata(site.join(&rel))
                .unwrap()
                .file_type()
                .is_symlink();
            assert_eq!((u, g), (uid, uid), "{what}: owner of {rel}");
            if !link {
                assert_eq!(mode & 0o7022, 0, "{what}: {rel} has mode {mode:o}");
            }
        }
        if !nobody {
            // (A worker sharing an unprivileged daemon's uid may not chmod at all.)
            assert_eq!(
                std::fs::metadata(site.join("index.html")).unwrap().mode() & 0o7777,
                0o755,
                "{what}: x bits kept, group/other write gone"
            );
        }
        let first = manifest(&site);
        let out = &r["structuredContent"]["outputs"][0];
        assert_eq!(out["kind"], "directory", "{what}: {r}");
        assert_eq!(out["files"], 2, "{what}: {r}");
        assert_eq!(out["bytes"], 6, "{what}: {r}");
        assert_eq!(out["manifest_sha256"], first.as_str(), "{what}: {r}");
        let events = audit(&c).await;
        let commit = commits(&events)[0].clone();
        let o = &commit["detail"]["outputs"][0];
        assert_eq!(o["kind"], "directory", "{what}: {commit}");
        assert_eq!(
            (o["files"].clone(), o["size"].clone()),
            (json!(2), json!(6))
        );
        assert_eq!(o["sha256"], first.as_str(), "{what}: {commit}");

        // Replaced: the old tree is entirely gone.
        let r = call(
            &c,
            "tree_sh",
            json!({"session": "t", "out": "site",
                "script": "mkdir \"$1/only\" && echo new > \"$1/only/new.txt\""}),
        )
        .await;
        assert!(!is_error(&r), "{what}: {r}");
        assert_eq!(
            tree_names(&site),
            vec!["only".to_string(), "only/new.txt".to_string()],
            "{what}"
        );
        assert_eq!(
            r["structuredContent"]["outputs"][0]["manifest_sha256"],
            manifest(&site).as_str()
        );
        assert_eq!(version(&c, "t").await, 2);
        assert!(d.job_dirs().is_empty(), "{what}: {:?}", d.job_dirs());
        drop(c);
        d.stop();
        d.assert_audit_verifies(&what);
    }
}

/// A tar archive extracted with `tar -x -C` into a directory output.
#[tokio::test]
async fn tar_extracts_into_a_directory_output() {
    require_program("tar", "tar");
    let mut d = daemon("default");
    let src = d.dir.path().join("src");
    std::fs::create_dir_all(src.join("docs/img")).unwrap();
    std::fs::write(src.join("docs/readme.txt"), "read me").unwrap();
    std::fs::write(src.join("docs/img/x.bin"), [0u8, 1, 2]).unwrap();
    let archive = d.workspace.join("in.tar");
    let st = std::process::Command::new("tar")
        .arg("-cf")
        .arg(&archive)
        .arg("-C")
        .arg(&src)
        .arg("docs")
        .status()
        .unwrap();
    assert!(st.success());
    d.start();
    let c = d.client().await;
    session(&c, "t").await;
    let r = call(
        &c,
        "tree_sh",
        json!({"session": "t", "out": "unpacked", "input": "in.tar",
            "script": "tar -x -f \"$2\" -C \"$1\""}),
    )
    .await;
    assert!(!is_error(&r), "{r}");
    assert_eq!(
        d.read("unpacked/docs/readme.txt").as_deref(),
        Some("read me")
    );
    assert_eq!(
        std::fs::read(d.workspace.join("unpacked/docs/img/x.bin")).unwrap(),
        [0u8, 1, 2]
    );
}

/// Each hostile tree fails the call with TOOL_FAILED naming the entry: nothing published,
/// no job dir, the session unchanged, and the next start clean.
#[tokio::test]
async fn hostile_trees_fail_cleanly_and_the_next_start_is_clean() {
    require_root();
    let deep_escape = "cd \"$1\" && for i in $(seq 200); do mkdir d && cd d || exit 1; done \
                       && ln -s $(for i in $(seq 201); do printf '../'; done)etc up";
    let cases: Vec<(&str, String, &str)> = vec![
        (
            "absolute symlink",
            "ln -s /etc/passwd \"$1/p\"".into(),
            "entry \"p\": it is a symlink to the absolute path",
        ),
        (
            "escaping symlink at depth",
            "mkdir -p \"$1/a/b\" && ln -s ../../../.. \"$1/a/b/c\"".into(),
            "entry \"a/b/c\": it is a symlink to",
        ),
        (
            "fifo",
            "mkdir \"$1/d\" && mkfifo \"$1/d/fifo\"".into(),
            "entry \"d/fifo\": it is a FIFO",
        ),
        (
            "hard links",
            // To a readable file outside staging if the sandbox lets it, and within the tree.
            "ln \"$2\" \"$1/outside\" 2>/dev/null; echo x > \"$1/f\" && ln \"$1/f\" \"$1/g\""
                .into(),
            "hard links",
        ),
        (
            "escaping symlink 200 levels deep",
            deep_escape.into(),
            "it is a symlink to",
        ),
        (
            "the directory replaced by a file",
            "rmdir \"$1\" && echo x > \"$1\"".into(),
            "(a directory output holds regular files with one link, directories and symlinks staying inside it): the tool left a regular file there, not a directory",
        ),
    ];
    for (profile, nobody) in MATRIX {
        let mut d = daemon(profile);
        d.write("readable.txt", "the workspace's own");
        if nobody {
            as_nobody(&mut d);
        }
        d.start();
        let c = d.client().await;
        session(&c, "h").await;
        let before = snapshot(&d.workspace);
        for (what, script, message) in &cases {
            let what = format!("{what} ({profile}{})", if nobody { ", nobody" } else { "" });
            let r = call(
                &c,
                "tree_sh",
                json!({"session": "h", "out": "out", "input": "readable.txt", "script": script}),
            )
            .await;
            assert_eq!(code(&r), "TOOL_FAILED", "{what}: {r}");
            let t = text(&r);
            assert!(t.contains(message), "{what}: {t}");
            assert!(t.contains("output `out` is refused"), "{what}: {t}");
            assert_eq!(
                snapshot(&d.workspace),
                before,
                "{what} changed the workspace"
            );
            assert!(d.job_dirs().is_empty(), "{what} left a job dir");
        }
        // 16 nested names of 255 bytes (made one relative step at a time): any workspace root
        // makes the published path of the deepest more than PATH_MAX.
        let r = call(
            &c,
            "tree_py",
            json!({"session": "h", "out": "out", "code":
                "import os, sys\nos.chdir(sys.argv[1])\nfor i in range(16):\n    os.mkdir('n' * 255)\n    os.chdir('n' * 255)\nopen('f', 'w').write('x')\n"}),
        )
        .await;
        assert_eq!(code(&r), "TOOL_FAILED", "{profile}: {r}");
        assert!(text(&r).contains("its published path would be"), "{r}");
        assert_eq!(snapshot(&d.workspace), before);
        assert!(d.job_dirs().is_empty());
        // A setuid bit: the sandbox's seccomp filter refuses it (then the file is published
        // without it), or the tree check refuses the tree naming the entry.
        let r = call(
            &c,
            "tree_sh",
            json!({"session": "h", "out": "su", "script":
                "echo x > \"$1/su\"; chmod 4755 \"$1/su\" 2>/dev/null; chmod 2755 \"$1\" 2>/dev/null; exit 0"}),
        )
        .await;
        let mut v = 0;
        if is_error(&r) {
            assert_eq!(code(&r), "TOOL_FAILED", "{r}");
            assert!(text(&r).contains("it is setuid or setgid"), "{r}");
            assert!(!d.workspace.join("su").exists());
        } else {
            v = 1;
            for (rel, _, _, mode) in owners_and_modes(&d.workspace.join("su")) {
                assert_eq!(mode & 0o7000, 0, "{rel}: {mode:o}");
            }
            std::fs::remove_dir_all(d.workspace.join("su")).unwrap();
        }
        let before = snapshot(&d.workspace);
        // A 200-level chain staying inside is accepted, and replaced by a small tree.
        let r = call(
            &c,
            "tree_sh",
            json!({"session": "h", "out": "deep", "script":
                "cd \"$1\" && for i in $(seq 200); do mkdir d && cd d || exit 1; done && echo bottom > f \
                 && ln -s ../../f up"}),
        )
        .await;
        assert!(!is_error(&r), "{profile}: {r}");
        assert_eq!(r["structuredContent"]["outputs"][0]["files"], 1);
        assert_ne!(snapshot(&d.workspace), before);
        assert_eq!(version(&c, "h").await, v + 1);
        drop(c);
        d.stop();
        d.start();
        let c = d.client().await;
        assert_eq!(version(&c, "h").await, v + 1);
        assert!(d.job_dirs().is_empty());
        let quarantined: Vec<String> = tree_names(&d.workspace)
            .into_iter()
            .filter(|n| n.starts_with(".airlock-"))
            .collect();
        assert!(quarantined.is_empty(), "{quarantined:?}");
        assert!(!d.log_text().contains("panicked"));
    }
}

/// Over `staging_files` (a profile with a small limit): refused by the limit, nothing
/// published, no job dir.
#[tokio::test]
async fn a_tree_over_staging_files_is_refused_by_the_limit() {
    let mut d = daemon("small");
    add_small_profile(&d, "small", 100);
    d.start();
    let c = d.client().await;
    session(&c, "h").await;
    let r = call(
        &c,
        "tree_sh",
        json!({"session": "h", "out": "many",
            "script": "cd \"$1\" && mkdir a && for i in $(seq 150); do : > a/f$i; done"}),
    )
    .await;
    assert_eq!(code(&r), "TOOL_FAILED", "{r}");
    assert!(text(&r).contains("staging_files"), "{r}");
    assert!(!d.workspace.join("many").exists());
    assert!(d.job_dirs().is_empty());
}

/// A copy of the default profile named `name` with `staging_files = files` (and the CPU
/// time making many files takes on a loaded machine).
fn add_small_profile(d: &Daemon, name: &str, files: u64) {
    let base = std::fs::read_to_string(d.policies.join("profiles/default.toml")).unwrap();
    let mut out = String::new();
    for line in base.lines() {
        if line.starts_with("staging_files =") {
            out.push_str(&format!("staging_files = {files}\n"));
        } else if line.starts_with("cpu =") {
            out.push_str("cpu = \"600s\"\n");
        } else if line.starts_with("name =") {
            out.push_str(&format!("name = \"{name}\"\n"));
        } else {
            out.push_str(line);
            out.push('\n');
        }
    }
    std::fs::write(d.policies.join(format!("profiles/{name}.toml")), out).unwrap();
}

/// 200,000 files in one tree under the shipped limit (100,000, in a copy of the default
/// profile given more CPU time): the call fails by the limit and the tree is removed; the
/// next start is clean and serves.
#[tokio::test]
async fn two_hundred_thousand_files_fail_by_the_limit_and_never_brick_the_next_start() {
    require_program("/usr/bin/python3", "python3");
    let mut d = Daemon::new();
    d.add_tool(
        "tree_py",
        r#"name = "tree_py"
description = "Write n empty files into a directory output (test only)"
capability = "write"
command = ["/usr/bin/python3", "-I", "-c", "import os, sys\nfor i in range(int(sys.argv[2])):\n    d = os.path.join(sys.argv[1], 'd%d' % (i // 1000))\n    if i % 1000 == 0: os.mkdir(d)\n    open(os.path.join(d, 'f%d' % i), 'w').close()\n", "{out}", "{n}"]
timeout = "600s"
profile = "many"
[params.out]
type = "string"
path = "output"
kind = "directory"
[params.n]
type = "string"
"#,
    );
    add_small_profile(&d, "many", 100_000);
    d.start();
    let c = d.client().await;
    session(&c, "h").await;
    let r = call(
        &c,
        "tree_py",
        json!({"session": "h", "out": "huge", "n": "200000"}),
    )
    .await;
    assert_eq!(code(&r), "TOOL_FAILED", "{r}");
    assert!(text(&r).contains("staging_files"), "{r}");
    assert!(!d.workspace.join("huge").exists());
    assert!(d.job_dirs().is_empty(), "{:?}", d.job_dirs());
    drop(c);
    d.stop();
    d.start();
    let c = d.client().await;
    let r = call(
        &c,
        "write_tree",
        json!({"session": "h", "out": "after", "text": "a"}),
    )
    .await;
    assert!(!is_error(&r), "{r}");
    assert_eq!(d.read("after/sub/a.txt").as_deref(), Some("a"));
}

/// An existing file where a directory is declared (and a directory where a file is):
/// PATH_REJECTED before anything is created.
#[tokio::test]
async fn a_target_of_the_other_type_is_rejected_before_anything_is_created() {
    let mut d = daemon("default");
    d.write("f.txt", "a file");
    d.write("d/inner.txt", "in a dir");
    d.start();
    let c = d.client().await;
    session(&c, "h").await;
    let before = snapshot(&d.workspace);
    let r = call(
        &c,
        "tree_sh",
        json!({"session": "h", "out": "f.txt", "script": "echo x > \"$1/x\""}),
    )
    .await;
    assert_eq!(code(&r), "PATH_REJECTED", "{r}");
    assert!(
        text(&r).contains("declared kind = \\\"directory\\\"")
            || text(&r).contains("declared kind = \"directory\""),
        "{r}"
    );
    let r = call(
        &c,
        "write_text",
        json!({"session": "h", "out": "d", "text": "x"}),
    )
    .await;
    assert_eq!(code(&r), "PATH_REJECTED", "{r}");
    assert_eq!(snapshot(&d.workspace), before);
    let events = audit(&c).await;
    assert!(
        !events
            .iter()
            .any(|e| e["kind"] == "start" && (e["tool"] == "tree_sh" || e["tool"] == "write_text")),
        "a worker started"
    );
    assert_eq!(version(&c, "h").await, 0);
}

/// Within one call, a directory output containing another declared output is refused.
#[tokio::test]
async fn a_directory_output_containing_another_output_is_overlapping() {
    let mut d = daemon("default");
    d.start();
    let c = d.client().await;
    session(&c, "h").await;
    let r = call(
        &c,
        "tree_and_file",
        json!({"session": "h", "dir": "d", "file": "d/a.txt"}),
    )
    .await;
    assert_eq!(code(&r), "OVERLAPPING_OUTPUTS", "{r}");
    assert!(tree_names(&d.workspace).is_empty());
    let r = call(
        &c,
        "tree_and_file",
        json!({"session": "h", "dir": "d", "file": "e.txt"}),
    )
    .await;
    assert!(!is_error(&r), "{r}");
    assert_eq!(d.read("d/x").as_deref(), Some("x\n"));
}

/// The manifest of the tree at `dir`, read through one directory fd (the view one reader
/// has of the name at the instant it opens it); `None` if the tree vanished meanwhile (an
/// old tree removed after the commit).
fn fd_manifest(dir: &Path) -> Option<Vec<String>> {
    let f = std::fs::File::open(dir).ok()?;
    use std::os::fd::AsRawFd;
    let base = PathBuf::from(format!("/proc/self/fd/{}", f.as_raw_fd()));
    let mut out = Vec::new();
    let mut stack = vec![base.clone()];
    while let Some(p) = stack.pop() {
        for e in std::fs::read_dir(&p).ok()? {
            let e = e.ok()?;
            let rel = e.path().strip_prefix(&base).ok()?.display().to_string();
            if e.file_type().ok()?.is_dir() {
                stack.push(e.path());
                out.push(format!("{rel}/"));
            } else {
                out.push(format!("{rel}={}", std::fs::read_to_string(e.path()).ok()?));
            }
        }
    }
    out.sort();
    Some(out)
}

/// A reader looping over the target while a tree replaces it sees the old tree or the new
/// one, never a mix; publication is held before its exchange (a failpoint pause) so the
/// reader sees the old one there first.
#[tokio::test(flavor = "multi_thread")]
async fn a_reader_sees_the_old_tree_or_the_new_one_never_a_mix() {
    let mut d = daemon("default");
    for i in 0..50 {
        d.write(&format!("site/s{}/f{i}", i % 5), "old");
    }
    let mark = d.pause_at_failpoint("publish.exchange", 1);
    d.start();
    let site = d.workspace.join("site");
    let old = fd_manifest(&site).unwrap();
    let c = d.client().await;
    session(&c, "h").await;
    let stop = std::sync::Arc::new(std::sync::atomic::AtomicBool::new(false));
    let reader = {
        let (site, stop) = (site.clone(), stop.clone());
        std::thread::spawn(move || {
            let mut seen = Vec::new();
            while !stop.load(std::sync::atomic::Ordering::SeqCst) {
                if let Some(m) = fd_manifest(&site) {
                    seen.push(m);
                }
            }
            seen
        })
    };
    let call_c = d.client().await;
    let pending = tokio::spawn(async move {
        call(
            &call_c,
            "tree_sh",
            json!({"session": "h", "out": "site", "script":
                "for i in $(seq 0 49); do mkdir -p \"$1/n$((i % 5))\" && echo new > \"$1/n$((i % 5))/g$i\"; done"}),
        )
        .await
    });
    wait_until("publication to pause before its exchange", || mark.exists()).await;
    assert_eq!(fd_manifest(&site).unwrap(), old, "still the old tree");
    std::fs::remove_file(&mark).unwrap();
    let r = pending.await.unwrap();
    assert!(!is_error(&r), "{r}");
    let new = fd_manifest(&site).unwrap();
    stop.store(true, std::sync::atomic::Ordering::SeqCst);
    let seen = reader.join().unwrap();
    assert_ne!(old, new);
    assert!(seen.contains(&old), "the reader never saw the old tree");
    for m in &seen {
        assert!(*m == old || *m == new, "a mixed tree: {m:?}");
    }
    let _ = c;
}

/// A call writing `d` (a directory) and a call writing `d/a.txt` (another session) are
/// serialized in either order: the second starts only after the first committed.
#[tokio::test(flavor = "multi_thread")]
async fn a_directory_and_a_file_inside_it_are_serialized() {
    let mut d = daemon("default");
    d.add_tool(
        "file_sh",
        r#"name = "file_sh"
description = "Write a file output with a shell script (test only)"
capability = "write"
command = ["/bin/sh", "-c", "{script}", "file_sh", "{out}"]
timeout = "300s"
[params.script]
type = "string"
[params.out]
type = "string"
path = "output"
"#,
    );
    d.start();
    let c = d.client().await;
    session(&c, "a").await;
    session(&c, "b").await;
    for first_is_dir in [true, false] {
        let blocker = format!("41.{}", unique());
        let hold = format!("sleep {blocker}; echo held");
        let (first, second) = if first_is_dir {
            (
                (
                    "tree_sh",
                    json!({"session": "a", "out": "d", "script": format!("echo x > \"$1/x\"; {hold}")}),
                ),
                (
                    "file_sh",
                    json!({"session": "b", "out": "d/a.txt", "script": "echo a > \"$1\""}),
                ),
            )
        } else {
            (
                (
                    "file_sh",
                    json!({"session": "b", "out": "d/a.txt", "script": format!("echo a > \"$1\"; {hold}")}),
                ),
                (
                    "tree_sh",
                    json!({"session": "a", "out": "d", "script": "echo y > \"$1/y\""}),
                ),
            )
        };
        let (first_tool, second_tool) = (first.0, second.0);
        let c1 = d.client().await;
        let t1 = tokio::spawn(async move { call(&c1, first.0, first.1).await });
        wait_for_exact(&format!("sleep {blocker}")).await;
        let c2 = d.client().await;
        let t2 = tokio::spawn(async move { call(&c2, second.0, second.1).await });
        // The second call is authorized, then waits for the first's locks.
        wait_for_event(&c, second_tool, "allow").await;
        // The `sleep` itself (not the shell whose script names it): the shell goes on.
        for pid in processes_with(&format!("sleep {blocker}")) {
            let argv = std::fs::read(format!("/proc/{pid}/cmdline")).unwrap_or_default();
            if argv == format!("sleep\0{blocker}\0").as_bytes() {
                let _ = std::process::Command::new("kill")
                    .arg(pid.to_string())
                    .status();
            }
        }
        let (r1, r2) = (t1.await.unwrap(), t2.await.unwrap());
        assert!(!is_error(&r1), "{r1}");
        assert!(!is_error(&r2), "{r2}");
        let events = audit(&c).await;
        let at = |tool: &str, kind: &str| {
            events
                .iter()
                .rposition(|e| e["tool"] == tool && e["kind"] == kind)
                .unwrap_or_else(|| panic!("no {kind} of {tool}"))
        };
        assert!(
            at(first_tool, "commit") < at(second_tool, "start"),
            "the second call started before the first committed"
        );
    }
    // The last call (a tree) replaced whatever was at d.
    assert_eq!(tree_names(&d.workspace.join("d")), vec!["y".to_string()]);
}

/// Runs `tar` with `args` in `dir` (building the test's archives outside the sandbox).
fn tar_in(dir: &Path, args: &[&str]) {
    let st = std::process::Command::new("tar")
        .current_dir(dir)
        .args(args)
        .status()
        .unwrap();
    assert!(st.success(), "tar {args:?}");
}

/// The shipped `extract_archive`: plain, gzip and xz archives extracted into a directory
/// output (new, then replaced whole); a member named with `..` (refused by tar) and members
/// that are absolute or escaping symlinks (refused by the tree check) fail the call with
/// nothing published; an absolute member name lands inside (tar strips the `/`).
#[tokio::test]
async fn the_shipped_extract_archive_tool_extracts_and_refuses_escaping_members() {
    require_program("tar", "tar");
    require_program("/usr/bin/xz", "xz-utils");
    require_program("/usr/bin/gzip", "gzip");
    let mut d = Daemon::new();
    let src = d.dir.path().join("src");
    std::fs::create_dir_all(src.join("docs/sub")).unwrap();
    std::fs::write(src.join("docs/a.txt"), "a").unwrap();
    std::fs::write(src.join("docs/sub/b.txt"), "b").unwrap();
    std::os::unix::fs::symlink("sub/b.txt", src.join("docs/link")).unwrap();
    let ws = d.workspace.display().to_string();
    tar_in(&src, &["-cf", &format!("{ws}/plain.tar"), "docs"]);
    tar_in(&src, &["-czf", &format!("{ws}/gz.tar.gz"), "docs"]);
    tar_in(&src, &["-cJf", &format!("{ws}/xz.tar.xz"), "docs"]);
    // Hostile archives.
    let evil = d.dir.path().join("evil");
    std::fs::create_dir_all(evil.join("x")).unwrap();
    std::fs::write(evil.join("x/f"), "f").unwrap();
    std::os::unix::fs::symlink("/etc/passwd", evil.join("abs-link")).unwrap();
    tar_in(&evil, &["-cf", &format!("{ws}/abs-link.tar"), "abs-link"]);
    std::fs::remove_file(evil.join("abs-link")).unwrap();
    std::os::unix::fs::symlink("../..", evil.join("x/up")).unwrap();
    tar_in(&evil, &["-cf", &format!("{ws}/up-link.tar"), "x/up"]);
    tar_in(
        &evil.join("x"),
        &["-cPf", &format!("{ws}/dotdot.tar"), "../x/f"],
    );
    tar_in(
        &evil,
        &[
            "-cPf",
            &format!("{ws}/abs-name.tar"),
            &format!("{}/x/f", evil.display()),
        ],
    );
    d.start();
    let c = d.client().await;
    session(&c, "x").await;
    let mut v = 0;
    for archive in ["plain.tar", "gz.tar.gz", "xz.tar.xz"] {
        let r = call(
            &c,
            "extract_archive",
            json!({"session": "x", "archive": archive, "out": "unpacked"}),
        )
        .await;
        assert!(!is_error(&r), "{archive}: {r}");
        v += 1;
        assert_eq!(
            tree_names(&d.workspace.join("unpacked")),
            [
                "docs",
                "docs/a.txt",
                "docs/link",
                "docs/sub",
                "docs/sub/b.txt"
            ],
            "{archive}"
        );
        assert_eq!(d.read("unpacked/docs/link").as_deref(), Some("b"));
        assert_eq!(r["structuredContent"]["outputs"][0]["files"], 2);
    }
    let before = snapshot(&d.workspace);
    for (archive, says) in [
        (
            "abs-link.tar",
            "entry \"abs-link\": it is a symlink to the absolute path",
        ),
        ("up-link.tar", "entry \"x/up\": it is a symlink to"),
        ("dotdot.tar", "exited with status"),
    ] {
        let r = call(
            &c,
            "extract_archive",
            json!({"session": "x", "archive": archive, "out": "unpacked"}),
        )
        .await;
        assert_eq!(code(&r), "TOOL_FAILED", "{archive}: {r}");
        assert!(text(&r).contains(says), "{archive}: {r}");
        assert_eq!(snapshot(&d.workspace), before, "{archive}");
        assert!(d.job_dirs().is_empty());
    }
    let r = call(
        &c,
        "extract_archive",
        json!({"session": "x", "archive": "abs-name.tar", "out": "abs"}),
    )
    .await;
    assert!(!is_error(&r), "{r}");
    let inside = format!("abs{}/x/f", evil.display());
    assert_eq!(d.read(&inside).as_deref(), Some("f"));
    assert_eq!(version(&c, "x").await, v + 1);
}

/// `airlock policy explain` says which output is a directory and how it is published.
#[test]
fn policy_explain_shows_a_directory_output() {
    let out = std::process::Command::new(BIN)
        .args(["policy", "explain", "extract_archive", "--policies"])
        .arg(repo().join("policies"))
        .output()
        .unwrap();
    assert!(out.status.success());
    let s = String::from_utf8_lossy(&out.stdout);
    assert!(
        s.contains("param out: workspace path, a directory output")
            && s.contains("published by one rename"),
        "{s}"
    );
    assert!(
        s.contains("param archive: workspace path, readable by the worker"),
        "{s}"
    );
}
