//! SIGHUP reload semantics over the real socket (OPERATIONS.md, "Reloading policies"): a
//! call that waited for its turn across a reload is checked again, where it starts, against
//! the policy current then; an audit subscription the new policy no longer allows is
//! dropped and hears nothing more. The other principal is a real client process of another
//! uid (`setpriv` + `airlock connect`), so the daemon sees it in SO_PEERCRED.

use std::io::{BufRead, BufReader, Write};
use std::process::Stdio;
use std::sync::mpsc;
use std::time::Duration;

use serde_json::{json, Value};

use crate::authz::daemon;
use crate::harness::*;

/// The other principal: neither root nor the daemon's own uid in either run.
const OTHER: u32 = 65533;

/// A raw JSON-RPC connection of uid `uid`: `airlock connect` under setpriv, its stdout read
/// line by line on a thread.
struct Bridge {
    child: std::process::Child,
    stdin: std::process::ChildStdin,
    lines: mpsc::Receiver<Value>,
}

impl Bridge {
    fn connect(d: &Daemon, uid: u32) -> Bridge {
        let mut child = connect_as(d, uid, "--clear-groups")
            .stderr(Stdio::inherit())
            .spawn()
            .expect("setpriv airlock connect (util-linux setpriv is needed)");
        let stdin = child.stdin.take().expect("stdin");
        let stdout = child.stdout.take().expect("stdout");
        let (tx, lines) = mpsc::channel();
        std::thread::spawn(move || {
            for line in BufReader::new(stdout).lines() {
                let Ok(line) = line else { return };
                let v = serde_json::from_str(&line)
                    .unwrap_or_else(|e| panic!("bad line {line:?}: {e}"));
                if tx.send(v).is_err() {
                    return;
                }
            }
        });
        let mut b = Bridge {
            child,
            stdin,
            lines,
        };
        b.send(
            &json!({"jsonrpc": "2.0", "id": 0, "method": "initialize", "params": {
            "protocolVersion": "2025-11-25", "capabilities": {},
            "clientInfo": {"name": "reload-test", "version": "0"}}}),
        );
        let (r, _) = b.response(0);
        assert!(r["result"]["serverInfo"].is_object(), "initialize: {r}");
        b.send(&json!({"jsonrpc": "2.0", "method": "notifications/initialized"}));
        b
    }

    fn send(&mut self, v: &Value) {
        let mut line = v.to_string().into_bytes();
        line.push(b'\n');
        self.stdin.write_all(&line).expect("write to the bridge");
        self.stdin.flush().expect("flush");
    }

    /// The response to request `id`, and every message that came before it.
    fn response(&mut self, id: i64) -> (Value, Vec<Value>) {
        let mut before = Vec::new();
        loop {
            let m = self
                .lines
                .recv_timeout(Duration::from_secs(60))
                .unwrap_or_else(|_| panic!("no response to {id} within 60 s; got {before:?}"));
            if m["id"] == json!(id) && m.get("method").is_none() {
                return (m, before);
            }
            before.push(m);
        }
    }

    fn call(&mut self, id: i64, tool: &str, a: Value) {
        self.send(&json!({"jsonrpc": "2.0", "id": id, "method": "tools/call",
            "params": {"name": tool, "arguments": a}}));
    }
}

impl Drop for Bridge {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

fn is_audit_update(m: &Value) -> bool {
    m["method"] == "notifications/resources/updated"
}

fn sighup(d: &Daemon) {
    // SAFETY: kill(2) on the test's own child.
    assert_eq!(unsafe { libc::kill(d.pid() as i32, libc::SIGHUP) }, 0);
}

/// Sends SIGHUP and waits until the daemon logs its `n`-th successful reload.
async fn reload(d: &Daemon, n: usize) {
    sighup(d);
    wait_until(&format!("reload number {n}"), || {
        d.log_text().matches("now serving").count() >= n
    })
    .await;
}

/// Rewrites airlock.toml without `grant`.
fn revoke(d: &Daemon, grant: &str) {
    let path = d.policies.join("airlock.toml");
    let text = std::fs::read_to_string(&path).expect("airlock.toml");
    assert!(
        text.contains(grant),
        "the grant to revoke is not in airlock.toml"
    );
    std::fs::write(&path, text.replace(grant, "")).expect("write airlock.toml");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_audit_subscription_the_reload_revokes_hears_nothing_more() {
    let grant = format!("[[grant]]\nuids = [{OTHER}]\ncapabilities = [\"audit\"]\n");
    let mut d = daemon(&grant);
    d.start();
    let root = d.client().await;
    let subscribe = |id: i64| {
        json!({"jsonrpc": "2.0", "id": id, "method": "resources/subscribe",
               "params": {"uri": "airlock://audit/events"}})
    };
    // The other uid subscribes, and so does root (the sentinel: still allowed after).
    let mut other = Bridge::connect(&d, OTHER);
    other.send(&subscribe(1));
    let (r, _) = other.response(1);
    assert!(r["result"].is_object(), "subscribe: {r}");
    let mut sentinel = d.raw();
    sentinel.initialize();
    sentinel.send(&subscribe(1));
    assert!(sentinel.response(1)["result"].is_object());

    // Before the reload, the subscription works: a call of root's is heard of.
    call(&root, "session_list", json!({})).await;
    loop {
        let m = other
            .lines
            .recv_timeout(Duration::from_secs(30))
            .expect("a notification of root's call before the reload");
        if is_audit_update(&m) {
            break;
        }
    }

    // The grant is revoked: the reload drops the subscription, and the audit says so.
    revoke(&d, &grant);
    reload(&d, 1).await;
    let dropped = |events: &[Value]| {
        events.iter().any(|e| {
            e["kind"] == "deny"
                && e["tool"] == "resources/subscribe"
                && e["principal"]["uid"] == json!(OTHER)
                && e["detail"]["message"]
                    .as_str()
                    .is_some_and(|m| m.contains("subscription dropped"))
        })
    };
    let deadline = std::time::Instant::now() + Duration::from_secs(10);
    while !dropped(&audit(&root).await) {
        assert!(
            std::time::Instant::now() < deadline,
            "no deny of the dropped subscription within 10 s: {:#?}",
            audit(&root).await
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    // Whatever the notifier sent before it stopped is out before this ping's response.
    other.send(&json!({"jsonrpc": "2.0", "id": 2, "method": "ping"}));
    other.response(2);

    // Calls after the reload: the sentinel hears of them, the dropped subscriber does not.
    call(&root, "session_list", json!({})).await;
    session(&root, "after-reload").await;
    loop {
        if is_audit_update(&sentinel.recv()) {
            break;
        }
    }
    other.send(&json!({"jsonrpc": "2.0", "id": 3, "method": "ping"}));
    let (_, heard) = other.response(3);
    assert!(
        !heard.iter().any(is_audit_update),
        "a dropped subscription was notified after the reload: {heard:?}"
    );
    // Subscribing again and reading are refused under the new policy.
    other.send(&subscribe(4));
    let (r, _) = other.response(4);
    assert_eq!(r["error"]["data"]["code"], json!("AUDIT_FORBIDDEN"), "{r}");
    other.send(
        &json!({"jsonrpc": "2.0", "id": 5, "method": "resources/read",
                       "params": {"uri": "airlock://audit/events"}}),
    );
    let (r, heard) = other.response(5);
    assert_eq!(r["error"]["data"]["code"], json!("AUDIT_FORBIDDEN"), "{r}");
    assert!(!heard.iter().any(is_audit_update), "{heard:?}");
    let (code, out) = d.audit_verify();
    assert_eq!(code, Some(0), "airlock audit verify: {out}");
}

/// A read tool that holds the daemon's only call slot until the test kills its worker,
/// found by its `seconds` (unique per test: the tests run in parallel).
fn slot_holder(seconds: &str) -> String {
    format!(
        r#"name = "reload_slot_holder"
description = "holds a call slot"
capability = "read"
command = ["/bin/sleep", "{seconds}"]
timeout = "300s"
"#
    )
}

/// A write tool whose definition the reload changes.
fn changed_tool(text: &str) -> String {
    format!(
        r#"name = "reload_changed"
description = "writes a fixed text"
capability = "write"
command = ["/bin/sh", "-c", "printf {text} > \"$1\"", "reload_changed", "{{out}}"]
timeout = "10s"

[params.out]
type = "string"
path = "output"
"#
    )
}

/// The kinds of the audit events of `tool` by `uid`, in order.
async fn kinds(root: &Client, tool: &str, uid: u32) -> (Vec<String>, Vec<Value>) {
    let ev: Vec<Value> = audit(root)
        .await
        .into_iter()
        .filter(|e| e["tool"] == tool && e["principal"]["uid"] == json!(uid))
        .collect();
    let k = ev
        .iter()
        .map(|e| e["kind"].as_str().unwrap_or("").to_string())
        .collect();
    (k, ev)
}

/// Sends a call on a connection of its own; it runs in the background.
async fn queue(d: &Daemon, tool: &'static str, a: Value) -> tokio::task::JoinHandle<Value> {
    let c = d.client().await;
    tokio::spawn(async move { call(&c, tool, a).await })
}

async fn queued_calls_are_checked_again_where_they_start(unprivileged: bool) {
    let grant = format!("[[grant]]\nuids = [{OTHER}]\ncapabilities = [\"read\", \"write\"]\n");
    let mut d = daemon(&grant);
    let conf = d.policies.join("airlock.toml");
    let conf_text = std::fs::read_to_string(&conf).expect("airlock.toml");
    assert!(
        conf_text.contains("max_concurrent_calls = 64"),
        "shipped max_concurrent_calls moved"
    );
    std::fs::write(
        &conf,
        conf_text.replace("max_concurrent_calls = 64", "max_concurrent_calls = 1"),
    )
    .expect("write airlock.toml");
    let seconds = if unprivileged { "3141.592" } else { "3141.591" };
    d.add_tool("reload_slot_holder", &slot_holder(seconds));
    d.add_tool("reload_changed", &changed_tool("v1"));
    if unprivileged {
        crate::sandbox::give_to_nobody(&d);
        d.user = Some((65534, 65534));
    }
    d.start();
    let root = d.client().await;
    for s in ["s1", "s2", "s3"] {
        session(&root, s).await;
    }
    let mut other = Bridge::connect(&d, OTHER);
    other.call(1, "session_create", json!({"id": "o1"}));
    let (r, _) = other.response(1);
    assert_eq!(r["result"]["isError"], json!(false), "{r}");

    // The only slot is taken; every external call now waits for it.
    let holder = {
        let c = d.client().await;
        tokio::spawn(async move { call(&c, "reload_slot_holder", json!({})).await })
    };
    wait_for_exact(&format!("/bin/sleep {seconds}")).await;
    let queued = |tool: &'static str, a: Value| queue(&d, tool, a);
    let removed = queued(
        "write_text",
        json!({"session": "s1", "text": "t", "out": "removed.txt"}),
    )
    .await;
    let changed = queued(
        "reload_changed",
        json!({"session": "s2", "out": "changed.txt"}),
    )
    .await;
    let control = queued(
        "stamp_write",
        json!({"session": "s3", "seconds": 0, "out": "control.txt"}),
    )
    .await;
    other.call(
        2,
        "stamp_write",
        json!({"session": "o1", "seconds": 0, "out": "revoked.txt"}),
    );
    // Each is authorized and waits (no `start` yet).
    for (tool, uid) in [
        ("write_text", 0),
        ("reload_changed", 0),
        ("stamp_write", 0),
        ("stamp_write", OTHER),
    ] {
        let deadline = std::time::Instant::now() + Duration::from_secs(10);
        loop {
            let (k, ev) = kinds(&root, tool, uid).await;
            if k == ["allow"] {
                break;
            }
            assert!(
                std::time::Instant::now() < deadline,
                "{tool} of uid {uid} is not queued: {ev:#?}"
            );
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
    }

    // The reload removes write_text, changes reload_changed and revokes the other uid's
    // grant; then the slot is freed.
    std::fs::remove_file(d.policies.join("tools/write_text.toml")).expect("rm write_text");
    d.add_tool("reload_changed", &changed_tool("v2"));
    revoke(&d, &grant);
    reload(&d, 1).await;
    for pid in processes_with(&format!("/bin/sleep {seconds}")) {
        // SAFETY: kill(2) of the holder's worker, a process the test identified by its
        // command line.
        unsafe { libc::kill(pid, libc::SIGKILL) };
    }
    let r = holder.await.expect("join");
    assert!(is_error(&r), "the killed holder: {r}");

    let r = removed.await.expect("join");
    assert_eq!(code(&r), "TOOL_FORBIDDEN", "{r}");
    assert!(text(&r).contains("removed by a policy reload"), "{r}");
    let r = changed.await.expect("join");
    assert_eq!(code(&r), "TOOL_FORBIDDEN", "{r}");
    assert!(text(&r).contains("changed by a policy reload"), "{r}");
    let (r, _) = other.response(2);
    let msg = r["result"]["content"][0]["text"].as_str().unwrap_or("");
    assert_eq!(r["result"]["isError"], json!(true), "{r}");
    assert!(
        msg.starts_with("TOOL_FORBIDDEN") && msg.contains(&format!("uid {OTHER} may not call")),
        "{r}"
    );
    // The control call, whose tool and grant the reload kept, runs.
    let r = control.await.expect("join");
    assert!(!is_error(&r), "{r}");

    // Nothing of the refused calls exists: no output, no state change, no job dir; the audit
    // reads allow then deny (nothing started), and verifies.
    assert_eq!(d.read("control.txt").as_deref(), Some("stamped\n"));
    for f in ["removed.txt", "changed.txt", "revoked.txt"] {
        assert_eq!(d.read(f), None, "{f} was published");
    }
    assert!(d.job_dirs().is_empty(), "{:?}", d.job_dirs());
    for (s, v) in [("s1", 0), ("s2", 0), ("s3", 1)] {
        assert_eq!(version(&root, s).await, v, "session {s}");
    }
    other.call(3, "session_get", json!({"session": "o1"}));
    let (r, _) = other.response(3);
    assert_eq!(
        r["result"]["isError"],
        json!(true),
        "the grant is gone: {r}"
    );
    let o1: Value = serde_json::from_str(
        &std::fs::read_to_string(d.state.join("sessions/o1.json")).expect("o1.json"),
    )
    .expect("o1.json");
    assert_eq!(o1["version"], json!(0), "{o1}");
    for (tool, uid) in [
        ("write_text", 0),
        ("reload_changed", 0),
        ("stamp_write", OTHER),
    ] {
        let (k, ev) = kinds(&root, tool, uid).await;
        assert_eq!(k, ["allow", "deny"], "{tool} of uid {uid}: {ev:#?}");
        assert_eq!(ev[1]["detail"]["code"], json!("TOOL_FORBIDDEN"), "{ev:#?}");
        assert_eq!(ev[1]["detail"]["phase"], json!("queued"), "{ev:#?}");
    }
    let (k, ev) = kinds(&root, "stamp_write", 0).await;
    assert!(
        k.contains(&"commit".to_string()),
        "the control call: {ev:#?}"
    );
    let (code, out) = d.audit_verify();
    assert_eq!(code, Some(0), "airlock audit verify: {out}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn queued_calls_are_checked_again_where_they_start_root_daemon() {
    queued_calls_are_checked_again_where_they_start(false).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn queued_calls_are_checked_again_where_they_start_unprivileged_daemon() {
    queued_calls_are_checked_again_where_they_start(true).await;
}
