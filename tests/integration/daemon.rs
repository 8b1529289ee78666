//! The daemon over a real socket, driven by rmcp's client and raw JSON-RPC.

use std::os::unix::fs::PermissionsExt;
use std::time::Duration;

use serde_json::{json, Value};

use crate::harness::*;

#[tokio::test]
async fn tools_list_has_schemas_and_annotations() {
    let mut d = Daemon::new();
    d.start();
    let c = d.client().await;
    let tools = c.list_all_tools().await.expect("tools/list");
    let find = |n: &str| {
        let t = tools
            .iter()
            .find(|t| t.name == n)
            .unwrap_or_else(|| panic!("no tool {n}"));
        serde_json::to_value(t).expect("json")
    };
    let upper = find("upper");
    let schema = &upper["inputSchema"];
    assert_eq!(schema["type"], "object");
    assert_eq!(schema["properties"]["source"]["type"], "string");
    assert_eq!(schema["properties"]["session"]["type"], "string");
    let mut req: Vec<&str> = schema["required"]
        .as_array()
        .unwrap()
        .iter()
        .map(|v| v.as_str().unwrap())
        .collect();
    req.sort();
    assert_eq!(req, vec!["out", "session", "source"]);
    assert_eq!(upper["annotations"]["readOnlyHint"], false);
    assert_eq!(upper["annotations"]["destructiveHint"], true);
    assert_eq!(upper["annotations"]["idempotentHint"], true);
    let cat = find("cat");
    assert_eq!(cat["annotations"]["readOnlyHint"], true);
    assert!(cat["inputSchema"]["properties"].get("session").is_none());
    let counter = find("counter");
    assert_eq!(counter["inputSchema"]["properties"]["by"]["default"], 1);
    for b in [
        "session_create",
        "session_destroy",
        "session_get",
        "session_list",
        "job_get",
    ] {
        find(b);
    }
}

#[tokio::test]
async fn session_lifecycle() {
    crate::harness::require_program("/usr/bin/python3", "python3");
    let mut d = Daemon::new();
    d.start();
    let c = d.client().await;
    let r = call(
        &c,
        "session_create",
        json!({"id": "alpha", "state": {"k": "v"}}),
    )
    .await;
    assert!(!is_error(&r), "{r}");
    assert_eq!(r["structuredContent"]["version"], 0);
    let r = call(&c, "session_create", json!({"id": "alpha"})).await;
    assert_eq!(code(&r), "SESSION_EXISTS");
    let r = call(&c, "session_create", json!({"id": "bad id!"})).await;
    assert_eq!(code(&r), "INVALID_ARGUMENT");
    let r = call(&c, "session_get", json!({"session": "alpha"})).await;
    assert_eq!(r["structuredContent"]["state"]["k"], "v");
    let r = call(&c, "counter", json!({"session": "alpha", "by": 5})).await;
    assert!(!is_error(&r), "{r}");
    let r = call(&c, "session_get", json!({"session": "alpha"})).await;
    assert_eq!(r["structuredContent"]["version"], 1);
    assert_eq!(r["structuredContent"]["state"]["counter"], 5);
    assert_eq!(r["structuredContent"]["state"]["k"], "v");
    let anon = call(&c, "session_create", json!({})).await;
    let anon_id = anon["structuredContent"]["id"]
        .as_str()
        .expect("generated id")
        .to_string();
    let r = call(&c, "session_list", json!({})).await;
    let ids: Vec<&str> = r["structuredContent"]["sessions"]
        .as_array()
        .unwrap()
        .iter()
        .map(|s| s["id"].as_str().unwrap())
        .collect();
    assert!(
        ids.contains(&"alpha") && ids.contains(&anon_id.as_str()),
        "{ids:?}"
    );
    let r = call(&c, "session_destroy", json!({"session": "alpha"})).await;
    assert!(!is_error(&r), "{r}");
    let r = call(&c, "session_get", json!({"session": "alpha"})).await;
    assert_eq!(code(&r), "SESSION_DESTROYED");
    let r = call(&c, "counter", json!({"session": "alpha"})).await;
    assert_eq!(code(&r), "SESSION_DESTROYED");
    let r = call(&c, "session_create", json!({"id": "alpha"})).await;
    assert_eq!(
        code(&r),
        "SESSION_DESTROYED",
        "a destroyed id is never reused: {r}"
    );
    // Persisted: the session file and the tombstone survive a restart.
    d.stop();
    d.start();
    let c = d.client().await;
    assert_eq!(
        code(&call(&c, "session_get", json!({"session": "alpha"})).await),
        "SESSION_DESTROYED"
    );
    assert_eq!(version(&c, &anon_id).await, 0);
}

fn stamps(r: &Value) -> (f64, f64) {
    let t = text(r);
    let mut it = t.split_whitespace().map(|x| {
        x.parse::<f64>()
            .unwrap_or_else(|_| panic!("stamp in {t:?}"))
    });
    (it.next().expect("start"), it.next().expect("end"))
}

#[tokio::test]
async fn reads_run_in_parallel() {
    let mut d = Daemon::new();
    d.start();
    let c = std::sync::Arc::new(d.client().await);
    let mut tasks = Vec::new();
    for _ in 0..8 {
        let c = c.clone();
        tasks.push(tokio::spawn(async move {
            call(&c, "slow_read", json!({"seconds": 1})).await
        }));
    }
    let mut spans = Vec::new();
    for t in tasks {
        let r = t.await.expect("join");
        assert!(!is_error(&r), "{r}");
        spans.push(stamps(&r));
    }
    // Every call started before any call ended: all eight ran at the same time.
    let last_start = spans.iter().map(|s| s.0).fold(f64::MIN, f64::max);
    let first_end = spans.iter().map(|s| s.1).fold(f64::MAX, f64::min);
    assert!(
        last_start < first_end,
        "reads did not all overlap: {spans:?}"
    );
}

#[tokio::test]
async fn same_session_writes_serialize_without_lost_updates() {
    crate::harness::require_program("/usr/bin/python3", "python3");
    let mut d = Daemon::new();
    d.start();
    let c = std::sync::Arc::new(d.client().await);
    session(&c, "inc").await;
    let mut tasks = Vec::new();
    for _ in 0..100 {
        let c = c.clone();
        tasks.push(tokio::spawn(async move {
            call(&c, "counter", json!({"session": "inc"})).await
        }));
    }
    for t in tasks {
        let r = t.await.expect("join");
        assert!(!is_error(&r), "{r}");
    }
    let r = call(&c, "session_get", json!({"session": "inc"})).await;
    assert_eq!(r["structuredContent"]["version"], 100);
    assert_eq!(r["structuredContent"]["state"]["counter"], 100);
    assert!(d.job_dirs().is_empty());
}

#[tokio::test]
async fn two_sessions_writes_overlap() {
    let mut d = Daemon::new();
    d.start();
    let c = std::sync::Arc::new(d.client().await);
    session(&c, "s1").await;
    session(&c, "s2").await;
    let (a, b) = tokio::join!(
        call(
            &c,
            "stamp_write",
            json!({"session": "s1", "seconds": 1, "out": "one.txt"})
        ),
        call(
            &c,
            "stamp_write",
            json!({"session": "s2", "seconds": 1, "out": "two.txt"})
        ),
    );
    assert!(!is_error(&a) && !is_error(&b), "{a} {b}");
    let (sa, sb) = (stamps(&a), stamps(&b));
    assert!(
        sa.0 < sb.1 && sb.0 < sa.1,
        "writes of two sessions did not overlap: {sa:?} {sb:?}"
    );
    assert_eq!(d.read("one.txt").as_deref(), Some("stamped\n"));
    assert_eq!(d.read("two.txt").as_deref(), Some("stamped\n"));
    // Same target from two sessions: serialized, never interleaved.
    let (a, b) = tokio::join!(
        call(
            &c,
            "stamp_write",
            json!({"session": "s1", "seconds": 0.5, "out": "same.txt"})
        ),
        call(
            &c,
            "stamp_write",
            json!({"session": "s2", "seconds": 0.5, "out": "same.txt"})
        ),
    );
    let (sa, sb) = (stamps(&a), stamps(&b));
    assert!(
        sa.1 <= sb.0 || sb.1 <= sa.0,
        "writes to one target overlapped: {sa:?} {sb:?}"
    );
}

#[tokio::test]
async fn destroy_fails_queued_mutators() {
    crate::harness::require_program("/usr/bin/python3", "python3");
    let mut d = Daemon::new();
    d.start();
    let c = std::sync::Arc::new(d.client().await);
    session(&c, "doomed").await;
    // Holds the session's lock for a second.
    let c1 = c.clone();
    let first = tokio::spawn(async move {
        call(
            &c1,
            "stamp_write",
            json!({"session": "doomed", "seconds": 1, "out": "first.txt"}),
        )
        .await
    });
    // Its `start` event is written once it holds the session's lock.
    wait_for_event(&c, "stamp_write", "start").await;
    let c2 = c.clone();
    let destroy =
        tokio::spawn(
            async move { call(&c2, "session_destroy", json!({"session": "doomed"})).await },
        );
    // Destroy's `allow` event is written just before it waits on the session's lock (no
    // await between them), so the mutators below queue behind it.
    wait_for_event(&c, "session_destroy", "allow").await;
    let mut queued = Vec::new();
    for i in 0..5 {
        let c = c.clone();
        queued.push(tokio::spawn(async move {
            call(
                &c,
                "counter",
                json!({"session": "doomed", "note": format!("note{i}.txt")}),
            )
            .await
        }));
    }
    let first = first.await.expect("join");
    assert!(
        !is_error(&first),
        "the call ahead of destroy commits: {first}"
    );
    assert!(!is_error(&destroy.await.expect("join")));
    for q in queued {
        let r = q.await.expect("join");
        assert_eq!(code(&r), "SESSION_DESTROYED", "{r}");
    }
    for i in 0..5 {
        assert!(
            d.read(&format!("note{i}.txt")).is_none(),
            "a queued mutator published after destroy"
        );
    }
    assert_eq!(
        code(&call(&c, "session_get", json!({"session": "doomed"})).await),
        "SESSION_DESTROYED"
    );
    assert!(d.job_dirs().is_empty());
}

#[tokio::test]
async fn overlapping_targets_are_rejected_before_running() {
    let mut d = Daemon::new();
    d.start();
    let c = d.client().await;
    session(&c, "o").await;
    for (a, b) in [("x/y", "x/y"), ("x", "x/y"), ("./x/y", "x/y")] {
        let r = call(&c, "two_outputs", json!({"session": "o", "a": a, "b": b})).await;
        assert_eq!(code(&r), "OVERLAPPING_OUTPUTS", "{a} {b}: {r}");
    }
    assert!(
        snapshot(&d.workspace).is_empty(),
        "{:?}",
        snapshot(&d.workspace)
    );
    let events = audit(&c).await;
    assert!(
        !events
            .iter()
            .any(|e| e["tool"] == "two_outputs" && e["kind"] == "start"),
        "a rejected call ran"
    );
    let r = call(
        &c,
        "two_outputs",
        json!({"session": "o", "a": "x/a", "b": "x/b"}),
    )
    .await;
    assert!(!is_error(&r), "{r}");
    assert_eq!(d.read("x/a").as_deref(), Some("A\n"));
    assert_eq!(version(&c, "o").await, 1);
}

#[tokio::test]
async fn timeout_leaves_state_workspace_and_process_table_unchanged() {
    let mut d = Daemon::new();
    d.start();
    let c = d.client().await;
    session(&c, "t").await;
    d.write("out.txt", "old");
    let before = snapshot(&d.workspace);
    let r = call(&c, "sleepy", json!({"session": "t", "out": "out.txt"})).await;
    assert_eq!(code(&r), "TOOL_TIMEOUT", "{r}");
    assert_eq!(snapshot(&d.workspace), before);
    assert_eq!(version(&c, "t").await, 0);
    assert!(d.job_dirs().is_empty());
    assert!(
        d.idle_job_dirs().is_empty(),
        "a timed-out call's dir is removed, never set aside for reuse: {:?}",
        d.idle_job_dirs()
    );
    assert!(
        processes_with("sleep 31.4159").is_empty(),
        "the worker outlived its call"
    );
    let events = audit(&c).await;
    assert!(events
        .iter()
        .any(|e| e["tool"] == "sleepy" && e["kind"] == "timeout"));
}

#[tokio::test]
async fn double_forked_descendants_die_with_the_group() {
    let mut d = Daemon::new();
    d.start();
    let c = d.client().await;
    session(&c, "f").await;
    let r = call(&c, "forker", json!({"session": "f", "out": "f.txt"})).await;
    assert_eq!(code(&r), "TOOL_TIMEOUT", "{r}");
    assert!(
        processes_with("sleep 31.77").is_empty(),
        "a double-forked descendant survived the timeout"
    );
    assert!(d.read("f.txt").is_none());
    // A successful tool's leftover descendants are killed before the result, too.
    let r = call(&c, "forker_ok", json!({"session": "f", "out": "ok.txt"})).await;
    assert!(!is_error(&r), "{r}");
    assert!(
        processes_with("sleep 31.88").is_empty(),
        "a descendant outlived a successful call"
    );
    assert_eq!(d.read("ok.txt").as_deref(), Some("ok\n"));
}

#[tokio::test]
async fn failed_tool_publishes_nothing() {
    let mut d = Daemon::new();
    d.start();
    let c = d.client().await;
    session(&c, "e").await;
    d.write("keep.txt", "keep");
    let before = snapshot(&d.workspace);
    let r = call(&c, "fail_tool", json!({"session": "e", "out": "keep.txt"})).await;
    assert_eq!(code(&r), "TOOL_FAILED");
    let t = text(&r);
    assert!(t.contains("status 3") && t.contains("disk on fire"), "{t}");
    assert_eq!(snapshot(&d.workspace), before);
    assert_eq!(version(&c, "e").await, 0);
}

/// A write result has no empty text block: a tool that printed nothing gives the
/// structured result's text alone. An output that replaces a regular file keeps its mode,
/// less setuid/setgid/sticky and group/other write; a new file gets 0644.
#[tokio::test]
async fn write_results_carry_no_empty_block_and_replaced_files_keep_their_mode() {
    use std::os::unix::fs::MetadataExt;
    let mut d = Daemon::new();
    d.start();
    let c = d.client().await;
    session(&c, "m").await;
    for (name, mode) in [("run.sh", 0o755), ("suid.sh", 0o4775)] {
        d.write(name, "old");
        std::fs::set_permissions(
            d.workspace.join(name),
            std::fs::Permissions::from_mode(mode),
        )
        .unwrap();
    }
    for (i, (out, want)) in [("run.sh", 0o755), ("suid.sh", 0o755), ("new.txt", 0o644)]
        .into_iter()
        .enumerate()
    {
        let r = call(
            &c,
            "write_text",
            json!({"session": "m", "text": "new", "out": out}),
        )
        .await;
        assert!(!is_error(&r), "{r}");
        let blocks = r["content"].as_array().unwrap();
        assert_eq!(blocks.len(), 1, "{r}");
        assert_eq!(
            blocks[0]["text"].as_str().unwrap(),
            r["structuredContent"].to_string(),
            "{r}"
        );
        let m = std::fs::metadata(d.workspace.join(out)).unwrap();
        assert_eq!(m.mode() & 0o7777, want, "{out}");
        assert_eq!(d.read(out).as_deref(), Some("new"));
        assert_eq!(version(&c, "m").await, i as u64 + 1);
    }
}

#[tokio::test]
async fn cancellation_kills_the_worker_and_sends_no_response() {
    let mut d = Daemon::new();
    d.start();
    let c = d.client().await;
    session(&c, "c").await;
    d.write("out.txt", "old");
    let before = snapshot(&d.workspace);
    let mut raw = d.raw();
    raw.initialize();
    raw.call(
        7,
        "slow_write",
        json!({"session": "c", "seconds": 30.01, "out": "out.txt"}),
    );
    // Wait until the worker runs.
    wait_for_process("sleep 30.01").await;
    raw.send(&json!({"jsonrpc": "2.0", "method": "notifications/cancelled", "params": {"requestId": 7, "reason": "test"}}));
    // The cancelled call leaves no trace once its audit event is out.
    wait_for_event(&c, "slow_write", "rollback").await;
    raw.send(&json!({"jsonrpc": "2.0", "id": 8, "method": "ping"}));
    let next = raw.recv();
    assert_eq!(
        next["id"], 8,
        "got {next} before the ping's response: a cancelled id was answered"
    );
    assert!(raw.recv_within(Duration::from_millis(500)).is_none());
    assert!(processes_with("sleep 30.01").is_empty());
    assert_eq!(snapshot(&d.workspace), before);
    assert_eq!(version(&c, "c").await, 0);
    assert!(d.job_dirs().is_empty());
}

#[tokio::test]
async fn bad_input_gets_clear_errors_and_the_daemon_keeps_serving() {
    let mut d = Daemon::new();
    d.start();
    let other = d.client().await;
    session(&other, "b").await;

    let mut raw = d.raw();
    raw.initialize();
    raw.send_bytes(b"{this is not json\n");
    let r = raw.recv();
    assert_eq!(r["error"]["code"], -32700, "{r}");
    assert!(r["error"]["message"]
        .as_str()
        .unwrap()
        .starts_with("Parse error"));
    let mut big = vec![b'x'; 5 * 1024 * 1024];
    big.push(b'\n');
    raw.send_bytes(&big);
    let r = raw.recv();
    assert_eq!(r["error"]["code"], -32600, "{r}");
    assert!(
        r["error"]["message"].as_str().unwrap().contains("4194304"),
        "{r}"
    );
    raw.call(3, "no_such_tool", json!({}));
    let r = raw.response(3);
    assert_eq!(r["error"]["code"], -32602, "{r}");
    assert!(r["error"]["message"]
        .as_str()
        .unwrap()
        .contains("no_such_tool"));
    raw.send(&json!({"jsonrpc": "2.0", "id": 4, "method": "ping"}));
    assert!(
        raw.response(4)["result"].is_object(),
        "the connection survives bad input"
    );

    let cases = [
        (
            json!({"session": "b", "text": 5, "out": "a.txt"}),
            "INVALID_ARGUMENT",
            "must be a string",
        ),
        (
            json!({"session": "b", "text": "x"}),
            "INVALID_ARGUMENT",
            "missing required argument \"out\"",
        ),
        (
            json!({"text": "x", "out": "a.txt"}),
            "INVALID_ARGUMENT",
            "session",
        ),
        (
            json!({"session": "nope", "text": "x", "out": "a.txt"}),
            "NO_SUCH_SESSION",
            "nope",
        ),
        (
            json!({"session": "b", "text": "x", "out": "../escape.txt"}),
            "PATH_REJECTED",
            "escape",
        ),
        (
            json!({"session": "b", "text": "x", "out": "/etc/airlock-escape"}),
            "PATH_REJECTED",
            "/etc",
        ),
        (
            json!({"session": "b", "text": "x", "out": "link/escape.txt"}),
            "PATH_REJECTED",
            "link",
        ),
    ];
    std::os::unix::fs::symlink("/tmp", d.workspace.join("link")).expect("symlink");
    for (i, (a, want, needle)) in cases.iter().enumerate() {
        raw.call(10 + i as i64, "write_text", a.clone());
        let r = raw.response(10 + i as i64);
        let result = &r["result"];
        assert_eq!(result["isError"], true, "{a}: {r}");
        assert_eq!(
            result["structuredContent"]["error"]["code"], *want,
            "{a}: {r}"
        );
        let msg = result["content"][0]["text"].as_str().unwrap_or("");
        assert!(
            msg.contains(needle),
            "{a}: {msg:?} does not mention {needle:?}"
        );
    }
    assert!(!std::path::Path::new("/etc/airlock-escape").exists());
    assert!(!std::path::Path::new("/tmp/escape.txt").exists());
    // Another connection was never disturbed.
    assert_eq!(version(&other, "b").await, 0);
    let r = call(
        &other,
        "write_text",
        json!({"session": "b", "text": "fine", "out": "fine.txt"}),
    )
    .await;
    assert!(!is_error(&r), "{r}");
    assert_eq!(d.read("fine.txt").as_deref(), Some("fine"));
}

#[tokio::test]
async fn socket_is_private_and_never_stolen() {
    let mut d = Daemon::new();
    d.start();
    let mode = std::fs::metadata(&d.socket).unwrap().permissions().mode() & 0o777;
    assert_eq!(mode, 0o600);
    // A second daemon on the same socket refuses to start, and so does one on the same
    // workspace.
    let second = |socket: &std::path::Path, workspace: &std::path::Path| {
        std::process::Command::new(BIN)
            .args(["serve", "--policies"])
            .arg(&d.policies)
            .arg("--socket")
            .arg(socket)
            .arg("--workspace")
            .arg(workspace)
            .arg("--state-dir")
            .arg(d.dir.path().join("state2"))
            .output()
            .unwrap()
    };
    let out = second(&d.socket, &d.dir.path().join("workspace2"));
    assert_eq!(out.status.code(), Some(2));
    assert!(
        String::from_utf8_lossy(&out.stderr).contains("already listening"),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let out = second(&d.dir.path().join("other.sock"), &d.workspace);
    assert_eq!(out.status.code(), Some(2));
    // The message names the holder: the running daemon.
    assert!(
        String::from_utf8_lossy(&out.stderr).contains(&format!(
            "another airlock process (pid {}) holds this workspace",
            d.pid()
        )),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let c = d.client().await;
    assert!(
        c.list_all_tools().await.is_ok(),
        "the first daemon still serves"
    );
    // A stale socket of a killed daemon is replaced.
    d.kill9();
    assert!(d.socket.exists());
    d.start();
    let c = d.client().await;
    assert!(c.list_all_tools().await.is_ok());
}

#[tokio::test]
async fn many_concurrent_connections() {
    let mut d = Daemon::new();
    d.start();
    let mut tasks = Vec::new();
    for i in 0..64 {
        let socket = d.socket.clone();
        tasks.push(tokio::spawn(async move {
            let stream = tokio::net::UnixStream::connect(&socket)
                .await
                .expect("connect");
            let c = rmcp::ServiceExt::serve((), stream)
                .await
                .expect("handshake");
            let r = call(&c, "session_create", json!({"id": format!("conn{i}")})).await;
            assert!(!is_error(&r), "{r}");
            c.list_all_tools().await.expect("list").len()
        }));
    }
    for t in tasks {
        assert!(t.await.expect("join") > 4);
    }
    let c = d.client().await;
    let r = call(&c, "session_list", json!({})).await;
    assert_eq!(
        r["structuredContent"]["sessions"].as_array().unwrap().len(),
        64
    );
}

#[tokio::test]
async fn cli_call_and_connect() {
    crate::harness::require_program("/usr/bin/python3", "python3");
    let mut d = Daemon::new();
    d.start();
    let run = |args: &[&str]| {
        std::process::Command::new(BIN)
            .args(args)
            .arg("--socket")
            .arg(&d.socket)
            .output()
            .expect("run airlock")
    };
    let out = run(&["call", "session_create", "--arg", "id=cli"]);
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let out = run(&[
        "call",
        "write_text",
        "--session",
        "cli",
        "--arg",
        "text=42",
        "--arg",
        "out=cli.txt",
    ]);
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let v: Value = serde_json::from_slice(&out.stdout).expect("call prints JSON");
    assert_eq!(v["structuredContent"]["version"], 1);
    assert_eq!(
        d.read("cli.txt").as_deref(),
        Some("42"),
        "--arg text=42 stays a string"
    );
    let out = run(&[
        "call",
        "counter",
        "--session",
        "cli",
        "--json",
        r#"{"by": 2}"#,
    ]);
    assert!(out.status.success());
    let out = run(&[
        "call",
        "fail_tool",
        "--session",
        "cli",
        "--arg",
        "out=x.txt",
    ]);
    assert_eq!(out.status.code(), Some(1), "a tool error exits 1");
    let v: Value = serde_json::from_slice(&out.stdout).expect("JSON even on error");
    assert_eq!(v["isError"], true);

    // `airlock connect` bridges a stdio client to the socket.
    use std::io::Write;
    let mut child = std::process::Command::new(BIN)
        .arg("connect")
        .arg("--socket")
        .arg(&d.socket)
        .stdin(std::process::Stdio::piped())
        .stdout(std::process::Stdio::piped())
        .spawn()
        .unwrap();
    let mut stdin = child.stdin.take().unwrap();
    let lines = [
        json!({"jsonrpc":"2.0","id":1,"method":"initialize","params":{"protocolVersion":"2025-11-25","capabilities":{},"clientInfo":{"name":"bridge-test","version":"0"}}}),
        json!({"jsonrpc":"2.0","method":"notifications/initialized"}),
        json!({"jsonrpc":"2.0","id":2,"method":"tools/call","params":{"name":"session_get","arguments":{"session":"cli"}}}),
    ];
    for l in &lines {
        writeln!(stdin, "{l}").unwrap();
    }
    let stdout = child.stdout.take().unwrap();
    let mut reader = std::io::BufReader::new(stdout);
    let mut got = Vec::new();
    for _ in 0..2 {
        let mut line = String::new();
        std::io::BufRead::read_line(&mut reader, &mut line).unwrap();
        got.push(serde_json::from_str::<Value>(&line).unwrap());
    }
    drop(stdin);
    let status = child.wait().unwrap();
    assert!(status.success());
    assert_eq!(got[1]["id"], 2);
    assert_eq!(got[1]["result"]["structuredContent"]["version"], 2);
}

#[test]
fn policy_check_reports_every_error_with_its_place() {
    let dir = tempfile::tempdir().unwrap();
    let p = dir.path();
    std::fs::create_dir_all(p.join("tools")).unwrap();
    std::fs::create_dir_all(p.join("profiles")).unwrap();
    std::fs::copy(
        repo().join("policies/profiles/default.toml"),
        p.join("profiles/default.toml"),
    )
    .unwrap();
    std::fs::write(
        p.join("tools/a.toml"),
        "name = \"a\"\ncapability = \"write\"\ncommand = [\"sh\", \"{nope}\"]\ntimeout = \"0s\"\nprofile = \"missing\"\n\n[params.n]\ntype = \"integer\"\npath = \"input\"\n",
    )
    .unwrap();
    std::fs::write(p.join("airlock.toml"), "").unwrap();
    std::fs::write(
        p.join("tools/b.toml"),
        "name = \"a\"\ncapability = \"read\"\ncommand = [\"/bin/true\"]\ncolour = 1\n",
    )
    .unwrap();
    std::fs::write(
        p.join("tools/c.toml"),
        "name = \"session_get\"\ncapability = \"read\"\ncommand = [\"/bin/true\"]\n",
    )
    .unwrap();
    std::fs::write(
        p.join("tools/d.toml"),
        "name = \"d\"\ncapability = \"read\"\ncommand = [\"/bin/true\"]\ntimeout = \"soon\"\n",
    )
    .unwrap();
    let out = std::process::Command::new(BIN)
        .args(["policy", "check", "--policies"])
        .arg(p)
        .output()
        .unwrap();
    assert_eq!(out.status.code(), Some(1));
    let s = String::from_utf8_lossy(&out.stdout);
    let a = p.join("tools/a.toml").display().to_string();
    for want in [
        format!("{a}:3:12: executable \"sh\" must be an absolute path"),
        format!("{a}:3:18: placeholder {{nope}} names no parameter"),
        format!("{a}:4:11: timeout must be more than zero"),
        format!("{a}:5:11: unknown profile \"missing\""),
        "path parameter \"n\" must have type \"string\"".to_string(),
        "b.toml:4:1: unknown field `colour`".to_string(),
        "c.toml:1:8: duplicate tool name \"session_get\": the name of a built-in tool".to_string(),
        "d.toml:4:11: \"soon\" is not a duration".to_string(),
    ] {
        assert!(s.contains(&want), "missing {want:?} in:\n{s}");
    }
    let ok = std::process::Command::new(BIN)
        .args(["policy", "check", "--policies"])
        .arg(repo().join("policies"))
        .output()
        .unwrap();
    assert!(
        ok.status.success(),
        "{}",
        String::from_utf8_lossy(&ok.stdout)
    );
    assert!(String::from_utf8_lossy(&ok.stdout).contains("write_text"));
}

#[tokio::test]
async fn shutdown_cancels_running_calls_and_publishes_nothing() {
    let mut d = Daemon::new();
    d.start();
    let c = d.client().await;
    session(&c, "sd").await;
    d.write("out.txt", "old");
    let before = snapshot(&d.workspace);
    let c = std::sync::Arc::new(c);
    let c2 = c.clone();
    let running = tokio::spawn(async move {
        let a = args(json!({"session": "sd", "seconds": 30.02, "out": "out.txt"}));
        c2.call_tool(rmcp::model::CallToolRequestParams::new("slow_write").with_arguments(a))
            .await
    });
    wait_for_process("sleep 30.02").await;
    let status = d.stop();
    assert!(status.success(), "daemon exit: {status}\n{}", d.log_text());
    assert!(
        running.await.unwrap().is_err(),
        "a call cut by shutdown has no successful result"
    );
    assert!(
        processes_with("sleep 30.02").is_empty(),
        "the worker outlived the daemon's shutdown"
    );
    assert_eq!(snapshot(&d.workspace), before);
    assert!(d.job_dirs().is_empty());
    assert!(!d.socket.exists(), "the socket file is removed at shutdown");
    d.start();
    let c = d.client().await;
    assert_eq!(version(&c, "sd").await, 0);
}

#[tokio::test]
async fn delegated_cgroup_contains_each_worker() {
    require_root();
    let root = std::path::Path::new("/sys/fs/cgroup/unified");
    assert!(
        root.join("cgroup.procs").exists(),
        "this test needs cgroup v2 at {}",
        root.display()
    );
    let parent = root.join(format!("airlock-test-{}", std::process::id()));
    std::fs::create_dir_all(&parent).expect("create the delegated cgroup");
    let mut d = Daemon::new();
    let conf = d.policies.join("airlock.toml");
    let text_ = std::fs::read_to_string(&conf).unwrap();
    std::fs::write(
        &conf,
        format!("{text_}\n").replace(
            "# cgroup = ",
            &format!("cgroup = \"{}\"\n# ", parent.display()),
        ),
    )
    .unwrap();
    d.start();
    let c = d.client().await;
    session(&c, "cg").await;
    let r = call(&c, "forker_ok", json!({"session": "cg", "out": "cg.txt"})).await;
    assert!(!is_error(&r), "{r}");
    let events = audit(&c).await;
    let sb = events.iter().rev().find(|e| e["kind"] == "start").unwrap();
    assert_eq!(sb["detail"]["containment"], "cgroup", "{sb}");
    assert!(processes_with("sleep 31.88").is_empty());
    let left: Vec<_> = std::fs::read_dir(&parent)
        .unwrap()
        .flatten()
        .filter(|e| e.path().is_dir())
        .collect();
    assert!(left.is_empty(), "worker cgroups left behind: {left:?}");
    d.stop();
    let _ = std::fs::remove_dir(&parent);
}

#[test]
fn policy_explain_shows_the_effective_sandbox() {
    let out = std::process::Command::new(BIN)
        .args(["policy", "explain", "upper", "--policies"])
        .arg(repo().join("policies"))
        .output()
        .unwrap();
    assert!(out.status.success());
    let s = String::from_utf8_lossy(&out.stdout);
    for want in [
        "timeout:  20s",
        "param source: workspace path, readable by the worker",
        "staging dir of the call",
        "/usr                        read+exec",
        "/etc                        read",
        "/dev/null                   read+write",
        "denied with EPERM: ptrace",
        "io_uring_setup",
        "socket() with a domain other than AF_UNIX fails with EPERM",
        "RLIMIT_AS",
        "kept from the daemon: LANG, LC_ALL, TZ",
        "2s grace",
    ] {
        assert!(s.contains(want), "missing {want:?} in:\n{s}");
    }
    let out = std::process::Command::new(BIN)
        .args(["policy", "explain", "nope", "--policies"])
        .arg(repo().join("policies"))
        .output()
        .unwrap();
    assert_eq!(out.status.code(), Some(2));
    assert!(String::from_utf8_lossy(&out.stderr).contains("no tool \"nope\""));
}

#[tokio::test]
async fn serve_with_no_flags_uses_the_checkout_layout() {
    // From a directory holding `policies/`: ./workspace is created, ./airlock.sock listens.
    // Searchable by others: a root daemon's workers run under uids of their own.
    let dir = tempfile::tempdir().unwrap();
    std::fs::set_permissions(
        dir.path(),
        std::os::unix::fs::PermissionsExt::from_mode(0o755),
    )
    .unwrap();
    let d = Daemon::new();
    let status = std::process::Command::new("cp")
        .arg("-a")
        .arg(&d.policies)
        .arg(dir.path())
        .status()
        .unwrap();
    assert!(status.success());
    let conf = dir.path().join("policies/airlock.toml");
    let text_ = std::fs::read_to_string(&conf).unwrap();
    std::fs::write(
        &conf,
        text_.replace(
            "socket_mode = \"0600\"",
            "socket_mode = \"0660\"\nsocket_group = \"nogroup\"",
        ),
    )
    .unwrap();
    let child = std::process::Command::new(BIN)
        .args(["--log-format", "json", "serve"])
        .current_dir(dir.path())
        .stderr(std::process::Stdio::piped())
        .spawn()
        .unwrap();
    let socket = dir.path().join("airlock.sock");
    wait_until("a socket at ./airlock.sock", || {
        std::os::unix::net::UnixStream::connect(&socket).is_ok()
    })
    .await;
    assert!(dir.path().join("workspace").is_dir());
    use std::os::unix::fs::MetadataExt;
    let meta = std::fs::metadata(&socket).unwrap();
    assert_eq!(meta.permissions().mode() & 0o777, 0o660);
    let nogroup = nix::unistd::Group::from_name("nogroup")
        .unwrap()
        .expect("group nogroup")
        .gid
        .as_raw();
    assert_eq!(meta.gid(), nogroup);
    // SAFETY: kill(2) on our own child.
    unsafe { libc::kill(child.id() as i32, libc::SIGTERM) };
    let out = child.wait_with_output().unwrap();
    assert!(out.status.success());
    // Every line is one JSON event; the startup line says what it serves.
    let stderr = String::from_utf8_lossy(&out.stderr);
    let events: Vec<Value> = stderr
        .lines()
        .map(|line| {
            serde_json::from_str(line)
                .unwrap_or_else(|e| panic!("--log-format json printed {line:?}: {e}\n{stderr}"))
        })
        .collect();
    assert!(
        events
            .iter()
            .all(|v| v["level"].is_string() && v["fields"].is_object()),
        "{stderr}"
    );
    assert!(
        events
            .iter()
            .any(|v| v["fields"]["message"] == "airlock serving" && v["fields"]["tools"].is_u64()),
        "no 'airlock serving' event:\n{stderr}"
    );
}

#[tokio::test]
async fn a_client_that_disconnects_cancels_its_calls() {
    let mut d = Daemon::new();
    d.start();
    let c = d.client().await;
    session(&c, "dc").await;
    let mut raw = d.raw();
    raw.initialize();
    raw.call(
        5,
        "slow_write",
        json!({"session": "dc", "seconds": 30.03, "out": "dc.txt"}),
    );
    wait_for_process("sleep 30.03").await;
    drop(raw);
    wait_no_process("sleep 30.03").await;
    wait_for_event(&c, "slow_write", "rollback").await;
    assert!(d.read("dc.txt").is_none());
    assert!(d.job_dirs().is_empty());
    assert_eq!(version(&c, "dc").await, 0);
}

/// The shared test support names what a test lacks (its unit tests would not run in the
/// support crate: `cargo test` runs the root package's).
#[test]
#[should_panic(
    expected = "this test needs `airlock-no-such-program` (Debian package airlock-no-such-package; `.ci/install-deps` installs it)"
)]
fn a_missing_program_fails_the_test_naming_it_and_its_package() {
    require_program("airlock-no-such-program", "airlock-no-such-package");
}

#[test]
fn a_program_on_path_or_at_its_absolute_path_is_found() {
    require_program("sh", "dash");
    require_program("/bin/sh", "dash");
}
