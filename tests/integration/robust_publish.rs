//! Robustness of publication (cleanup, recovery, paths, state dir, disk): whatever a worker leaves in staging
//! and whatever path a client sends, the daemon keeps serving and starts again.

use std::os::unix::fs::PermissionsExt;
use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::Duration;

use serde_json::{json, Value};

use crate::harness::*;

/// A shell tool (test only): runs `script` in its staging dir with `$1` the output.
const LITTER_SH: &str = r#"name = "litter_sh"
description = "Run a shell script in staging (test only)"
capability = "write"
command = ["/bin/sh", "-c", "{script}", "litter_sh", "{out}"]
timeout = "120s"
[params.script]
type = "string"
[params.out]
type = "string"
path = "output"
"#;

/// Python tool that writes its output and `n` more files beside it in staging.
fn litter_py(name: &str, profile: &str) -> String {
    format!(
        r#"name = "{name}"
description = "Write the output and n files of litter (test only)"
capability = "write"
command = ["/usr/bin/python3", "-I", "-c", "import sys\nopen(sys.argv[1], 'w').write('out')\nfor i in range(int(sys.argv[2])):\n    open('f%d' % i, 'w').close()\n", "{{out}}", "{{n}}"]
timeout = "300s"
profile = "{profile}"
[params.out]
type = "string"
path = "output"
[params.n]
type = "string"
"#
    )
}

/// Adds a copy of the default profile named `name` with extra `[limits]` lines.
fn add_profile(d: &Daemon, name: &str, limits: &[(&str, &str)]) {
    let base = std::fs::read_to_string(d.policies.join("profiles/default.toml")).unwrap();
    let mut out = String::new();
    for line in base.lines() {
        if limits
            .iter()
            .any(|(k, _)| line.starts_with(&format!("{k} =")))
        {
            continue;
        }
        out.push_str(line);
        out.push('\n');
        if line.trim() == "[limits]" {
            for (k, v) in limits {
                out.push_str(&format!("{k} = {v}\n"));
            }
        }
    }
    std::fs::write(d.policies.join(format!("profiles/{name}.toml")), out).unwrap();
}

/// Waits up to `secs` for `done`, failing with `what`.
async fn wait_long(what: &str, secs: u64, done: impl FnMut() -> bool) {
    wait_until_within(what, Duration::from_secs(secs), done).await;
}

fn count_entries(dir: &Path) -> usize {
    std::fs::read_dir(dir).map(|rd| rd.count()).unwrap_or(0)
}

/// Runs `airlock recover` on the daemon's dirs; returns (exit code, stdout, stderr).
fn recover_cmd(d: &Daemon, env: &[(&str, &str)]) -> (i32, String, String) {
    let mut cmd = d.recover(None);
    for (k, v) in env {
        cmd.env(k, v);
    }
    let out = cmd.output().expect("airlock recover");
    (
        out.status.code().unwrap_or(-1),
        String::from_utf8_lossy(&out.stdout).into_owned(),
        String::from_utf8_lossy(&out.stderr).into_owned(),
    )
}

/// A daemon restarted after the abuse starts, serves, and still holds `session`'s state.
async fn restarts_and_serves(d: &mut Daemon, session: &str, expect_version: u64) {
    d.stop();
    d.start();
    let c = d.client().await;
    assert_eq!(version(&c, session).await, expect_version);
    let r = call(
        &c,
        "write_text",
        json!({"session": session, "text": "after", "out": "after-restart.txt"}),
    )
    .await;
    assert!(!is_error(&r), "{r}");
    assert_eq!(d.read("after-restart.txt").as_deref(), Some("after"));
    assert!(d.job_dirs().is_empty(), "{:?}", d.job_dirs());
    assert!(!d.log_text().contains("panicked"));
}

/// Files left in staging (20,000 here, `AIRLOCK_TEST_LITTER=200000` for ten times as many;
/// the count does not change the property) are removed off the async threads: while the removal is
/// stopped half-way (a failpoint waits for the test), another session's calls complete, on a
/// daemon with a single async worker thread (`TOKIO_WORKER_THREADS=1`), so a removal on an
/// async thread would block them. Both the discard path (the staging_files limit fails the
/// call) and the post-commit cleanup are shown.
#[tokio::test]
async fn litter_is_removed_off_the_async_threads_while_other_sessions_are_served() {
    let mut d = Daemon::new();
    let n: usize = std::env::var("AIRLOCK_TEST_LITTER")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(20_000);
    d.add_tool("litter", &litter_py("litter", "tight"));
    d.add_tool("litter_roomy", &litter_py("litter_roomy", "roomy"));
    add_profile(
        &d,
        "tight",
        &[("staging_files", &(n / 2).to_string()), ("cpu", "\"600s\"")],
    );
    add_profile(
        &d,
        "roomy",
        &[("staging_files", "1000000"), ("cpu", "\"600s\"")],
    );
    d.env = vec![("TOKIO_WORKER_THREADS".into(), "1".into())];
    let mark = d.pause_at_failpoint("publish.cleanup_unlink", (n * 3 / 4) as u64);
    d.start();
    let c1 = d.client().await;
    let c2 = d.client().await;
    session(&c1, "a").await;
    session(&c2, "b").await;
    let mut expect_b = 0;

    for (tool, out, fails) in [
        ("litter", "l1.txt", true),
        ("litter_roomy", "l2.txt", false),
    ] {
        let c = d.client().await;
        let args = json!({"session": "a", "out": out, "n": n.to_string()});
        let tool_name = tool.to_string();
        let big = tokio::spawn(async move {
            let r = call(&c, &tool_name, args).await;
            (c, r)
        });
        wait_long("the cleanup of the files to pause half-way", 300, || {
            mark.exists()
        })
        .await;
        let job = d.job_dirs();
        assert_eq!(job.len(), 1, "{job:?}");
        let stage = d.workspace.join(&job[0]).join("stage");
        let left = count_entries(&stage);
        assert!(
            left > 1000 && left < n,
            "the removal is half-way: {left} entries left"
        );
        // Another session's calls complete while the removal is stopped.
        let r = call(
            &c2,
            "write_text",
            json!({"session": "b", "text": tool, "out": format!("b-{tool}.txt")}),
        )
        .await;
        assert!(!is_error(&r), "{r}");
        expect_b += 1;
        assert_eq!(version(&c2, "b").await, expect_b);
        assert_eq!(d.read(&format!("b-{tool}.txt")).as_deref(), Some(tool));
        assert!(
            mark.exists(),
            "the daemon gave up waiting: the other calls did not complete during the removal"
        );
        assert!(
            !big.is_finished(),
            "{tool} returned before its cleanup ended"
        );
        assert_eq!(count_entries(&stage), left, "still paused");
        std::fs::remove_file(&mark).unwrap();
        let (_c, r) = big.await.unwrap();
        if fails {
            assert_eq!(code(&r), "TOOL_FAILED", "{r}");
            assert!(text(&r).contains("staging_files"), "{r}");
            assert!(d.read(out).is_none(), "nothing published");
        } else {
            assert!(!is_error(&r), "{r}");
            assert_eq!(d.read(out).as_deref(), Some("out"));
        }
        assert!(d.job_dirs().is_empty(), "{:?}", d.job_dirs());
    }
    assert_eq!(version(&c1, "a").await, 1);
    d.env.clear();
    restarts_and_serves(&mut d, "b", expect_b).await;
}

/// The script a hostile worker runs: a 200-level chain, 30 levels of 200-byte names (a path
/// of 6 KB, beyond PATH_MAX), directories without permissions or read-only, then
/// `chmod 0 ..` on its own job dir.
const MESS: &str = r#"
set -e
S=$(pwd)
echo out > "$1"
mkdir chain; cd chain
i=0; while [ $i -lt 200 ]; do mkdir d; echo x > d/f; cd d; i=$((i+1)); done
cd "$S"
/usr/bin/python3 -I -c '
import os
n = "0" * 200
os.mkdir("long"); os.chdir("long")
for i in range(30):
    os.mkdir(n); open(n + "/f", "w").write("y"); os.chdir(n)
'
mkdir -p locked/inner readonly; echo z > locked/inner/f; echo z > readonly/f
exec 3> "$S/.mess-done"
# Each chmod may be refused: a worker with its own uid does not own its job dir, and one
# that keeps the daemon's uid may not chmod at all (seccomp). Whatever got through stays.
chmod 0 locked/inner locked || true; chmod 0500 readonly || true
chmod 0 .. || true
echo done >&3
"#;

/// The running worker has made all of its mess (it says so on a file it opened before).
fn mess_done(d: &Daemon) -> bool {
    let jobs = d.job_dirs();
    jobs.len() == 1
        && std::fs::read_to_string(d.workspace.join(&jobs[0]).join("stage/.mess-done"))
            .is_ok_and(|t| t.trim() == "done")
}

async fn mess_then(d: &mut Daemon, exit: &str) -> Value {
    let c = d.client().await;
    call(
        &c,
        "litter_sh",
        json!({"session": "h", "out": "mess.txt", "script": format!("{MESS}\n{exit}")}),
    )
    .await
}

async fn hostile_trees_never_brick(unprivileged: bool) {
    require_root();
    let mut d = Daemon::new();
    d.add_tool("litter_sh", LITTER_SH);
    if unprivileged {
        crate::sandbox::give_to_nobody(&d);
        d.user = Some((65534, 65534));
    }
    d.start();
    let c = d.client().await;
    session(&c, "h").await;
    // Failed call: the job dir is discarded.
    let r = mess_then(&mut d, "exit 3").await;
    assert_eq!(code(&r), "TOOL_FAILED", "{r}");
    assert!(d.job_dirs().is_empty(), "{:?}", d.job_dirs());
    assert!(d.read("mess.txt").is_none());
    // Successful call: the output is published, the rest is cleaned up after the commit.
    let r = mess_then(&mut d, "exit 0").await;
    assert!(!is_error(&r), "{r}");
    assert_eq!(d.read("mess.txt").as_deref(), Some("out\n"));
    assert!(d.job_dirs().is_empty(), "{:?}", d.job_dirs());
    // Crash while the mess is in place: startup recovery removes it.
    let c2 = d.client().await;
    let pending = tokio::spawn(async move {
        let _ = c2
            .call_tool(
                rmcp::model::CallToolRequestParams::new("litter_sh")
                    .with_arguments(args(json!({"session": "h", "out": "mess2.txt",
                           "script": format!("{MESS}\nexec sleep 60")}))),
            )
            .await;
    });
    wait_long("the worker to make its mess", 60, || mess_done(&d)).await;
    d.kill9();
    pending.abort();
    assert_eq!(d.job_dirs().len(), 1);
    d.start();
    let c = d.client().await;
    assert!(d.job_dirs().is_empty(), "{:?}", d.job_dirs());
    assert!(d.read("mess2.txt").is_none());
    assert_eq!(version(&c, "h").await, 1);
    // And `airlock recover` offline after another crash.
    let c3 = d.client().await;
    let pending = tokio::spawn(async move {
        let _ = c3
            .call_tool(
                rmcp::model::CallToolRequestParams::new("litter_sh")
                    .with_arguments(args(json!({"session": "h", "out": "mess3.txt",
                           "script": format!("{MESS}\nexec sleep 60")}))),
            )
            .await;
    });
    wait_long("the worker to make its mess", 60, || mess_done(&d)).await;
    d.kill9();
    pending.abort();
    if unprivileged {
        let out = d.recover(d.user).output().expect("airlock recover");
        let stdout = String::from_utf8_lossy(&out.stdout);
        assert!(
            out.status.success(),
            "{stdout} {}",
            String::from_utf8_lossy(&out.stderr)
        );
        assert!(stdout.contains("recovered 1 job(s)"), "{stdout}");
    } else {
        let (rc, stdout, stderr) = recover_cmd(&d, &[]);
        assert_eq!(rc, 0, "{stdout} {stderr}");
        assert!(stdout.contains("recovered 1 job(s)"), "{stdout}");
    }
    assert!(d.job_dirs().is_empty(), "{:?}", d.job_dirs());
    d.start();
    restarts_and_serves(&mut d, "h", 1).await;
}

#[tokio::test]
async fn hostile_trees_never_brick_a_root_daemon() {
    hostile_trees_never_brick(false).await;
}

#[tokio::test]
async fn hostile_trees_never_brick_an_unprivileged_daemon() {
    hostile_trees_never_brick(true).await;
}

/// A job dir recovery cannot remove is quarantined, reported by `airlock recover`, out of
/// reach of tool paths, and never touched by a later recovery (only reported); the daemon
/// serves meanwhile.
#[tokio::test]
async fn unremovable_job_dirs_are_quarantined_and_the_daemon_serves() {
    let mut d = Daemon::new();
    d.start();
    let c = d.client().await;
    session(&c, "q").await;
    let c2 = d.client().await;
    let pending = tokio::spawn(async move {
        let _ = c2
            .call_tool(
                rmcp::model::CallToolRequestParams::new("slow_write")
                    .with_arguments(args(json!({"session": "q", "out": "q.txt", "seconds": 30}))),
            )
            .await;
    });
    wait_long("a job dir", 20, || d.job_dirs().len() == 1).await;
    let job = d.job_dirs()[0].clone();
    let id = job.trim_start_matches(".airlock-job-").to_string();
    d.kill9();
    pending.abort();
    // Point 1 of recovery (dropping the job's journal, after point 0, the audit's durable
    // `rollback` event) fails: the dir is moved aside.
    let (rc, stdout, stderr) = recover_cmd(&d, &[("AIRLOCK_FAILPOINT_ERROR_AT", "1")]);
    assert_eq!(rc, 0, "{stdout} {stderr}");
    let qname = format!(".airlock-quarantine-{id}");
    assert!(stdout.contains(&format!("{id}: ")), "{stdout}");
    assert!(stdout.contains("quarantined as"), "{stdout}");
    assert!(stdout.contains("remove them by hand"), "{stdout}");
    assert!(stdout.contains(&qname), "{stdout}");
    assert!(d.job_dirs().is_empty());
    assert!(d.workspace.join(&qname).is_dir());
    // The daemon starts while it stays quarantined (untouched, reported) and serves.
    let kept = snapshot(&d.workspace.join(&qname));
    d.start();
    assert_eq!(snapshot(&d.workspace.join(&qname)), kept);
    assert!(
        d.log_text().contains("still there, untouched"),
        "{}",
        d.log_text()
    );
    let c = d.client().await;
    for (tool, a) in [
        (
            "write_text",
            json!({"session": "q", "text": "x", "out": format!("{qname}/stage/x")}),
        ),
        ("cat", json!({"path": format!("{qname}/recovery.json")})),
        (
            "write_text",
            json!({"session": "q", "text": "x", "out": format!("./a/../{qname}")}),
        ),
    ] {
        let r = call(&c, tool, a).await;
        assert_eq!(code(&r), "PATH_REJECTED", "{r}");
    }
    assert!(d.read("q.txt").is_none());
    d.stop();
    d.env.clear();
    // A later recovery leaves it as it is, and says so; the operator removes it.
    let (rc, stdout, stderr) = recover_cmd(&d, &[]);
    assert_eq!(rc, 0, "{stdout} {stderr}");
    assert!(stdout.contains("still quarantined"), "{stdout}");
    assert!(stdout.contains(&qname), "{stdout}");
    assert_eq!(snapshot(&d.workspace.join(&qname)), kept);
    std::fs::remove_dir_all(d.workspace.join(&qname)).unwrap();
    d.start();
    restarts_and_serves(&mut d, "q", 0).await;
}

/// An overlong path (25 components of 200 bytes, 5,024 bytes) is refused before anything is created.
#[tokio::test]
async fn overlong_paths_are_refused_with_nothing_created() {
    let mut d = Daemon::new();
    d.start();
    let c = d.client().await;
    session(&c, "p").await;
    let before = snapshot(&d.workspace);
    let long = vec!["c".repeat(200); 25].join("/");
    let r = call(
        &c,
        "write_text",
        json!({"session": "p", "text": "x", "out": long}),
    )
    .await;
    // The argument bound (exec::args) catches it before path resolution does.
    assert_eq!(code(&r), "INVALID_ARGUMENT", "{r}");
    assert!(text(&r).contains("at most 4095 bytes"), "{r}");
    let r = call(
        &c,
        "write_text",
        json!({"session": "p", "text": "x", "out": format!("a/{}", "n".repeat(256))}),
    )
    .await;
    assert_eq!(code(&r), "PATH_REJECTED", "{r}");
    assert!(text(&r).contains("file name is at most 255 bytes"), "{r}");
    assert_eq!(snapshot(&d.workspace), before, "nothing created");
    assert!(d.job_dirs().is_empty());
    assert_eq!(version(&c, "p").await, 0);
    restarts_and_serves(&mut d, "p", 0).await;
}

fn serve_status(d: &Daemon, workspace: &Path, state: &Path, socket: &Path) -> (i32, String) {
    let out = Command::new(BIN)
        .arg("serve")
        .arg("--policies")
        .arg(&d.policies)
        .arg("--workspace")
        .arg(workspace)
        .arg("--state-dir")
        .arg(state)
        .arg("--socket")
        .arg(socket)
        .output()
        .unwrap();
    (
        out.status.code().unwrap_or(-1),
        String::from_utf8_lossy(&out.stderr).into_owned(),
    )
}

/// One daemon per state dir; no state dir or socket inside the workspace (symlinks
/// resolved); a workspace that cannot be locked says why.
#[tokio::test]
async fn state_dir_is_exclusive_and_kept_out_of_the_workspace() {
    crate::harness::require_program("setpriv", "util-linux");
    require_root();
    let mut d = Daemon::new();
    d.start();
    let c = d.client().await;
    session(&c, "s").await;
    let other_ws = d.dir.path().join("other-ws");
    let sock2 = d.dir.path().join("second.sock");
    let (rc, err) = serve_status(&d, &other_ws, &d.state, &sock2);
    assert_eq!(rc, 2, "{err}");
    assert!(
        err.contains(&format!(
            "another airlock process (pid {}) holds this state dir",
            d.pid()
        )),
        "{err}"
    );
    assert!(!sock2.exists());
    // Same workspace: the workspace lock says so.
    let (rc, err) = serve_status(&d, &d.workspace, &d.dir.path().join("st2"), &sock2);
    assert_eq!(rc, 2, "{err}");
    assert!(err.contains("holds this workspace"), "{err}");
    d.stop();

    // State dir inside the workspace, directly and through a symlink.
    let ws = d.workspace.clone();
    let link = d.dir.path().join("ws-link");
    std::os::unix::fs::symlink(&ws, &link).unwrap();
    for state in [ws.join("state"), link.join("nested/state")] {
        let (rc, err) = serve_status(&d, &ws, &state, &sock2);
        assert_eq!(rc, 2, "{err}");
        assert!(
            err.contains("state dir") && err.contains("is inside"),
            "{err}"
        );
        assert!(!state.exists(), "nothing created");
    }
    // Socket inside the workspace.
    let (rc, err) = serve_status(&d, &ws, &d.state, &link.join("airlock.sock"));
    assert_eq!(rc, 2, "{err}");
    assert!(err.contains("socket") && err.contains("is inside"), "{err}");
    assert!(!ws.join("airlock.sock").exists());
    // Workspace inside the state dir.
    let (rc, err) = serve_status(&d, &d.state.join("sessions"), &d.state, &sock2);
    assert_eq!(rc, 2, "{err}");
    assert!(
        err.contains("workspace") && err.contains("is inside"),
        "{err}"
    );

    // A workspace an unprivileged daemon cannot open is not "held by another process".
    std::fs::set_permissions(d.dir.path(), std::fs::Permissions::from_mode(0o755)).unwrap();
    let locked = d.dir.path().join("root-only");
    std::fs::create_dir(&locked).unwrap();
    std::fs::set_permissions(&locked, std::fs::Permissions::from_mode(0o711)).unwrap();
    let st = d.dir.path().join("nobody-state");
    std::fs::create_dir(&st).unwrap();
    let _ = Command::new("chown").arg("65534:65534").arg(&st).status();
    let out = d
        .recover_in(Some((65534, 65534)), &locked, &st)
        .output()
        .expect("airlock recover");
    let err = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(2), "{err}");
    assert!(
        err.contains("cannot lock the workspace: cannot open it: Permission denied"),
        "{err}"
    );
    assert!(!err.contains("another airlock process"), "{err}");
    d.start();
    restarts_and_serves(&mut d, "s", 0).await;
}

/// A worker that leaves more bytes in staging than `staging_size` fails the call with
/// TOOL_FAILED, nothing published.
#[tokio::test]
async fn staging_size_limit_fails_the_call_and_publishes_nothing() {
    let mut d = Daemon::new();
    d.add_tool(
        "fat",
        r#"name = "fat"
description = "Write 3 MiB beside a small output (test only)"
capability = "write"
command = ["/bin/sh", "-c", "echo small > \"$1\"; head -c 3145728 /dev/zero > fat.bin", "fat", "{out}"]
timeout = "20s"
profile = "tight"
[params.out]
type = "string"
path = "output"
"#,
    );
    add_profile(&d, "tight", &[("staging_size", "\"2MiB\"")]);
    d.start();
    let c = d.client().await;
    session(&c, "z").await;
    d.write("fat.txt", "old");
    let r = call(&c, "fat", json!({"session": "z", "out": "fat.txt"})).await;
    assert_eq!(code(&r), "TOOL_FAILED", "{r}");
    assert!(text(&r).contains("staging_size"), "{r}");
    assert_eq!(d.read("fat.txt").as_deref(), Some("old"));
    assert!(d.job_dirs().is_empty());
    assert_eq!(version(&c, "z").await, 0);
    let out = Command::new(BIN)
        .args(["policy", "explain", "fat", "--policies"])
        .arg(&d.policies)
        .output()
        .unwrap();
    let explain = String::from_utf8_lossy(&out.stdout);
    assert!(
        explain.contains("staging           2 MiB in 100000 entries"),
        "{explain}"
    );
    restarts_and_serves(&mut d, "z", 0).await;
}

struct Mount(PathBuf);

impl Drop for Mount {
    fn drop(&mut self) {
        let _ = Command::new("umount").arg("-l").arg(&self.0).status();
    }
}

/// A worker fills the workspace filesystem (a 4 MiB tmpfs): other sessions' calls fail
/// cleanly with a clear error and nothing half-published, session commits (the state dir is
/// on another filesystem) still work, and once the space is freed everything works and the
/// daemon restarts.
#[tokio::test]
async fn a_full_workspace_fails_calls_cleanly_and_recovers() {
    crate::harness::require_program("mount", "mount");
    require_root();
    let mut d = Daemon::new();
    d.add_tool(
        "filler",
        r#"name = "filler"
description = "Fill the filesystem, then wait (test only)"
capability = "write"
command = ["/bin/sh", "-c", "head -c 64M /dev/zero > \"$1\"; exec sleep 120", "filler", "{out}"]
timeout = "300s"
[params.out]
type = "string"
path = "output"
"#,
    );
    let st = Command::new("mount")
        .args(["-t", "tmpfs", "-o", "size=4m,mode=0755", "tmpfs"])
        .arg(&d.workspace)
        .status()
        .unwrap();
    assert!(st.success(), "mount tmpfs");
    let _m = Mount(d.workspace.clone());
    d.start();
    let c = d.client().await;
    session(&c, "fill").await;
    session(&c, "other").await;
    let r = call(
        &c,
        "write_text",
        json!({"session": "other", "text": "before", "out": "kept.txt"}),
    )
    .await;
    assert!(!is_error(&r), "{r}");
    let before = snapshot(&d.workspace);

    let cf = d.client().await;
    let filler = tokio::spawn(async move {
        let r = cf
            .call_tool(
                rmcp::model::CallToolRequestParams::new("filler")
                    .with_arguments(args(json!({"session": "fill", "out": "big.bin"}))),
            )
            .await;
        (cf, r)
    });
    let ws = d.workspace.clone();
    wait_long("the worker to fill the filesystem", 60, || {
        nix::sys::statvfs::statvfs(&ws).is_ok_and(|s| s.blocks_available() == 0)
            && processes_with("sleep 120").len() == 1
    })
    .await;
    // Other sessions' calls fail cleanly, saying why.
    for (i, out) in ["kept.txt", "new.txt", "dir/new.txt"].iter().enumerate() {
        let r = call(
            &c,
            "write_text",
            json!({"session": "other", "text": "x".repeat(10_000), "out": out}),
        )
        .await;
        assert!(is_error(&r), "call {i}: {r}");
        assert!(
            ["PUBLISH_FAILED", "TOOL_FAILED"].contains(&code(&r).as_str()),
            "{r}"
        );
        assert!(text(&r).contains("No space left on device"), "{r}");
    }
    let mut now = snapshot(&d.workspace);
    now.retain(|(p, _)| !p.starts_with(".airlock-job-"));
    assert_eq!(now, before, "nothing half-published");
    assert_eq!(d.job_dirs().len(), 1, "only the filler's job dir");
    assert_eq!(version(&c, "other").await, 1);
    // The state dir is on another filesystem: sessions are still created.
    session(&c, "fresh").await;
    // Free the space: the filler's client goes away, its call is cancelled, its job dir
    // discarded.
    filler.abort();
    let _ = filler.await;
    wait_no_process("sleep 120").await;
    wait_long("the filler's job dir to go", 30, || d.job_dirs().is_empty()).await;
    assert!(d.read("big.bin").is_none());
    let r = call(
        &c,
        "write_text",
        json!({"session": "other", "text": "after", "out": "dir/new.txt"}),
    )
    .await;
    assert!(!is_error(&r), "{r}");
    assert_eq!(d.read("dir/new.txt").as_deref(), Some("after"));
    assert_eq!(d.read("kept.txt").as_deref(), Some("before"));
    assert!(!d.log_text().contains("panicked"));
    restarts_and_serves(&mut d, "other", 2).await;
}

/// Whether `c` is one of the characters no path may hold, nor any message show raw: ASCII
/// and C1 controls, bidirectional controls, zero-width and invisible formatting characters.
fn unsafe_to_show(c: char) -> bool {
    c.is_control()
        || matches!(
            c,
            '\u{61c}'
                | '\u{200b}'..='\u{200f}'
                | '\u{202a}'..='\u{202e}'
                | '\u{2060}'
                | '\u{2066}'..='\u{2069}'
                | '\u{feff}'
        )
}

/// A path holding a control character, a bidirectional control or an invisible formatting
/// character is refused (`PATH_REJECTED` naming the code point and its byte), as an input and
/// as an output, before anything is created: the workspace, the job dirs and the session stay
/// as they were, the audit records each refusal, and neither the reply nor the audit's message
/// shows any such character raw. The log's chain still verifies and the daemon starts again.
#[tokio::test(flavor = "multi_thread")]
async fn paths_with_control_bidi_or_invisible_characters_are_refused_and_shown_escaped() {
    forbidden_path_characters(false).await;
}

/// As [`paths_with_control_bidi_or_invisible_characters_are_refused_and_shown_escaped`],
/// the daemon running as nobody.
#[tokio::test(flavor = "multi_thread")]
async fn paths_with_forbidden_characters_are_refused_by_an_unprivileged_daemon() {
    forbidden_path_characters(true).await;
}

async fn forbidden_path_characters(unprivileged: bool) {
    require_root();
    let mut d = Daemon::new();
    d.write("in.txt", "input");
    if unprivileged {
        crate::sandbox::give_to_nobody(&d);
        d.user = Some((65534, 65534));
    }
    d.start();
    let c = d.client().await;
    session(&c, "p").await;
    let before = snapshot(&d.workspace);
    // (character, the code point as the message names it)
    let chars = [
        ('\u{1}', "U+0001"),
        ('\u{1b}', "U+001B"),
        ('\n', "U+000A"),
        ('\u{7f}', "U+007F"),
        ('\u{85}', "U+0085"),
        ('\u{9f}', "U+009F"),
        ('\u{61c}', "U+061C"),
        ('\u{200e}', "U+200E"),
        ('\u{200f}', "U+200F"),
        ('\u{202a}', "U+202A"),
        ('\u{202e}', "U+202E"),
        ('\u{2066}', "U+2066"),
        ('\u{2069}', "U+2069"),
        ('\u{200b}', "U+200B"),
        ('\u{200c}', "U+200C"),
        ('\u{200d}', "U+200D"),
        ('\u{2060}', "U+2060"),
        ('\u{feff}', "U+FEFF"),
    ];
    let mut refused = 0;
    for (ch, point) in chars {
        // The character at byte 4, after "sub/"; the output also colours a terminal and
        // reverses what follows.
        let out = format!("sub/{ch}x\u{1b}[31m\n\u{202e}txt.exe");
        let input = format!("sub/{ch}in.txt");
        for (tool, a) in [
            (
                "write_text",
                json!({"session": "p", "text": "x", "out": out}),
            ),
            (
                "upper",
                json!({"session": "p", "source": "in.txt", "out": out}),
            ),
            (
                "upper",
                json!({"session": "p", "source": input, "out": "ok.txt"}),
            ),
            ("cat", json!({"path": input})),
        ] {
            let r = call(&c, tool, a.clone()).await;
            assert_eq!(code(&r), "PATH_REJECTED", "{tool} {a}: {r}");
            let t = text(&r);
            assert!(t.contains(&format!("holds {point} (")), "{t}");
            assert!(t.contains("at byte 4;"), "{t}");
            assert!(
                !t.chars().any(unsafe_to_show),
                "the reply shows a character raw: {t:?}"
            );
            let message = r["structuredContent"]["error"]["message"]
                .as_str()
                .unwrap_or_else(|| panic!("{r}"));
            assert!(!message.chars().any(unsafe_to_show), "{message:?}");
            refused += 1;
        }
    }
    assert_eq!(snapshot(&d.workspace), before, "something was created");
    assert!(d.job_dirs().is_empty(), "{:?}", d.job_dirs());
    assert_eq!(version(&c, "p").await, 0);

    // Each refusal is in the audit, its message escaped too.
    let errors: Vec<Value> = audit(&c)
        .await
        .into_iter()
        .filter(|e| e["kind"] == "error" && e["detail"]["code"] == "PATH_REJECTED")
        .collect();
    assert_eq!(errors.len(), refused, "{errors:#?}");
    for e in &errors {
        let m = e["detail"]["message"]
            .as_str()
            .unwrap_or_else(|| panic!("{e}"));
        assert!(m.contains("holds U+"), "{e}");
        // The whole event as the log stores it, not only its message.
        assert!(
            !e.to_string().chars().any(unsafe_to_show),
            "the audit shows it raw: {e}"
        );
    }
    restarts_and_serves(&mut d, "p", 0).await;
    d.stop();
    let log = d.state.join("audit.jsonl");
    // The log's bytes hold none of them raw either, not even in the `allow` events that keep
    // the client's arguments as data: they are `\uXXXX` escapes there.
    let text = std::fs::read_to_string(&log).expect("audit.jsonl");
    let allows = text
        .lines()
        .filter(|l| l.contains(r#""kind":"allow""#))
        .count();
    assert!(
        allows >= refused,
        "{allows} allow events for {refused} calls"
    );
    for line in text.lines() {
        assert!(
            !line.chars().any(unsafe_to_show),
            "the log holds it raw: {line}"
        );
    }
    let v = Command::new(BIN)
        .args(["audit", "verify", "--log"])
        .arg(&log)
        .output()
        .expect("airlock audit verify");
    assert!(
        v.status.success(),
        "{}{}",
        String::from_utf8_lossy(&v.stdout),
        String::from_utf8_lossy(&v.stderr)
    );
}
