//! Bounds that hold per principal: sessions (count, state bytes per session and per owner,
//! recounted at start; memory that does not grow with them) and fair shares of the call
//! slots. The hostile principal is a real client process running as `nobody` (see
//! `authz.rs`); the other is the test process (root).

use std::collections::BTreeMap;

use serde_json::{json, Value};

use crate::authz::{as_nobody, daemon, events_of, NOBODY};
use crate::harness::*;
use crate::robust_mcp::{memory_bound, status_kib};

/// A state of exactly `n` bytes as compact JSON: `{"pad":"xx..."}`.
fn pad(n: usize) -> Value {
    json!({"pad": "x".repeat(n - 10)})
}

/// A json write tool that sets the state's `pad` to `bytes` bytes and writes `out`.
const GROW: &str = r#"
name = "grow"
description = "Grow the session's state"
capability = "write"
protocol = "json"
timeout = "10s"
command = ["/usr/bin/python3", "-I", "-c", """
import json, sys
req = json.load(sys.stdin)
state = req["session"]["state"]
state["pad"] = "x" * req["arguments"]["bytes"]
with open(req["arguments"]["out"], "w") as f:
    f.write("grown\\n")
json.dump({"content": [{"type": "text", "text": "grown"}], "state": state}, sys.stdout)
"""]

[params.bytes]
type = "integer"
description = "The pad's length"

[params.out]
type = "string"
path = "output"
description = "A file written with the commit"
"#;

/// The audit events of `uid`'s calls of `tool`, by call, in order.
async fn calls_of(root: &Client, uid: u32, tool: &str) -> BTreeMap<String, Vec<Value>> {
    let mut by_call: BTreeMap<String, Vec<Value>> = BTreeMap::new();
    for e in events_of(root, uid, tool).await {
        by_call
            .entry(e["job"].as_str().unwrap_or_default().to_string())
            .or_default()
            .push(e);
    }
    by_call
}

fn kinds(events: &[Value]) -> Vec<&str> {
    events
        .iter()
        .map(|e| e["kind"].as_str().unwrap_or(""))
        .collect()
}

/// The session files on disk and their owners (tombstones included, marked).
fn session_files(d: &Daemon) -> BTreeMap<String, (Value, bool)> {
    let mut out = BTreeMap::new();
    for e in std::fs::read_dir(d.state.join("sessions")).expect("sessions dir") {
        let p = e.expect("entry").path();
        let text = std::fs::read_to_string(&p).expect("session file");
        let v: Value = serde_json::from_str(&text).expect("json");
        out.insert(
            v["id"].as_str().unwrap_or_default().to_string(),
            (v["owner"].clone(), v["destroyed"] == true),
        );
    }
    out
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sessions_past_a_principal_bound_are_refused_with_quota_exceeded_and_recounted_after_restart(
) {
    // `nobody` may only create sessions, as in the abuse this bounds.
    let mut d = daemon(
        "[[grant]]\nuids = [65534]\ncapabilities = [\"write\"]\ntools = [\"session_create\"]\n",
    );
    set_daemon(
        &d,
        &[
            ("max_sessions_per_principal", "4"),
            ("max_session_state_bytes", "\"64KiB\""),
            ("max_state_bytes_per_principal", "\"160KiB\""),
        ],
    );
    d.add_tool("grow", GROW);
    d.start();
    let root = d.client().await;
    let a = as_nobody(&d).await;
    let create = |id: &str, state: Value| json!({"id": id, "state": state});

    assert!(!is_error(
        &call(&a.client, "session_create", create("n1", pad(60 << 10))).await
    ));
    assert!(!is_error(
        &call(&a.client, "session_create", create("n2", pad(60 << 10))).await
    ));
    // Past the owner's state bytes (120 KiB held, 60 more).
    let r = call(&a.client, "session_create", create("n3", pad(60 << 10))).await;
    assert_eq!(code(&r), "QUOTA_EXCEEDED", "{r}");
    assert!(
        text(&r).contains("max_state_bytes_per_principal (163840)")
            && text(&r).contains("uid 65534")
            && text(&r).contains("hold 122880 bytes"),
        "{r}"
    );
    // Past one session's bound.
    let r = call(
        &a.client,
        "session_create",
        create("big", pad((64 << 10) + 1)),
    )
    .await;
    assert_eq!(code(&r), "QUOTA_EXCEEDED", "{r}");
    assert!(
        text(&r).contains("max_session_state_bytes (65536)") && text(&r).contains("65537 bytes"),
        "{r}"
    );
    // Past the count.
    for id in ["n3", "n4"] {
        assert!(!is_error(
            &call(&a.client, "session_create", create(id, json!({}))).await
        ));
    }
    let r = call(&a.client, "session_create", create("n5", json!({}))).await;
    assert_eq!(code(&r), "QUOTA_EXCEEDED", "{r}");
    assert!(
        text(&r).contains("max_sessions_per_principal (4)") && text(&r).contains("holds 4"),
        "{r}"
    );
    // Another principal is not bound by nobody's use.
    session(&root, "r1").await;

    // Nothing was created for a refused call: on disk, nobody owns n1..n4 only.
    let files = session_files(&d);
    let nobodys: Vec<&String> = files
        .iter()
        .filter(|(_, (owner, _))| *owner == json!(NOBODY))
        .map(|(id, _)| id)
        .collect();
    assert_eq!(nobodys, ["n1", "n2", "n3", "n4"], "{files:?}");
    assert!(!files.contains_key("big") && !files.contains_key("n5"));
    // n3's first create was refused; its second (empty) is the one on disk.
    assert!(!std::fs::read_to_string(d.state.join("sessions/n3.json"))
        .expect("n3.json")
        .contains("xxxx"));

    // The audit: each refused create is allow, start, error QUOTA_EXCEEDED, rollback; no
    // commit.
    let calls = calls_of(&root, NOBODY, "session_create").await;
    assert_eq!(calls.len(), 7, "{calls:#?}");
    let refused: Vec<&Vec<Value>> = calls
        .values()
        .filter(|ev| ev.iter().any(|e| e["detail"]["code"] == "QUOTA_EXCEEDED"))
        .collect();
    assert_eq!(refused.len(), 3, "{calls:#?}");
    for ev in &refused {
        assert_eq!(
            kinds(ev),
            ["allow", "start", "error", "rollback"],
            "{ev:#?}"
        );
    }

    // A commit past one session's bound is refused before anything is published.
    let grow = |bytes: u64, out: &str| json!({"session": "r1", "bytes": bytes, "out": out});
    let r = call(&root, "grow", grow(70_000, "refused.txt")).await;
    assert_eq!(code(&r), "QUOTA_EXCEEDED", "{r}");
    assert!(text(&r).contains("max_session_state_bytes (65536)"), "{r}");
    assert_eq!(d.read("refused.txt"), None, "an output was published");
    assert_eq!(version(&root, "r1").await, 0);
    assert!(d.job_dirs().is_empty(), "{:?}", d.job_dirs());
    let r = call(&root, "grow", grow(1000, "grown.txt")).await;
    assert!(!is_error(&r), "{r}");
    assert_eq!(d.read("grown.txt").as_deref(), Some("grown\n"));
    assert_eq!(version(&root, "r1").await, 1);
    let grows = calls_of(&root, 0, "grow").await;
    let refused_grow = grows
        .values()
        .find(|ev| ev.iter().any(|e| e["detail"]["code"] == "QUOTA_EXCEEDED"))
        .expect("the refused grow's events");
    assert_eq!(
        kinds(refused_grow),
        ["allow", "start", "error", "rollback"],
        "{refused_grow:#?}"
    );

    // After a restart the use is counted again from the files.
    drop(a);
    drop(root);
    assert!(d.stop().success());
    d.start();
    let root = d.client().await;
    let a = as_nobody(&d).await;
    let r = call(&a.client, "session_create", create("n5", json!({}))).await;
    assert_eq!(code(&r), "QUOTA_EXCEEDED", "after restart: {r}");
    // A destroyed session counts toward neither bound; its id stays taken.
    let r = call(&root, "session_destroy", json!({"session": "n1"})).await;
    assert!(!is_error(&r), "{r}");
    assert!(!is_error(
        &call(&a.client, "session_create", create("n5", pad(60 << 10))).await
    ));
    let r = call(&a.client, "session_create", create("n1", json!({}))).await;
    assert_eq!(code(&r), "SESSION_DESTROYED", "{r}");
    assert_eq!(session_files(&d)["n1"], (json!(NOBODY), true));
    drop(a);
    drop(root);
    assert!(d.stop().success());
    d.assert_audit_verifies("the audit log");
}

/// `{"a":[1,1,...]}` of about `n` bytes: the state that takes the most memory parsed.
fn dense_state(n: usize) -> Value {
    json!({"a": vec![1; (n - 8) / 2]})
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sessions_at_their_bounds_keep_the_daemon_under_the_documented_memory_bound() {
    const SESSIONS: u64 = 64;
    const STATE: u64 = 256 << 10;
    let mut d = Daemon::new();
    set_daemon(
        &d,
        &[
            ("max_message_size", "\"512KiB\""),
            ("max_connections", "2"),
            ("max_queued_bytes", "\"1MiB\""),
            ("max_concurrent_calls", "2"),
            ("audit_ring_bytes", "\"1MiB\""),
            ("max_sessions_per_principal", "64"),
            ("max_session_state_bytes", "\"256KiB\""),
            ("max_state_bytes_per_principal", "\"16MiB\""),
        ],
    );
    d.env.push(("AIRLOCK_LOG".into(), "info".into()));
    d.start();
    let base = status_kib(d.pid(), "VmRSS:") * 1024;
    // README's formula for this config: P = 1 principal, M = 64 sessions, S = 256 KiB.
    const E: u64 = 32;
    let sessions_term = SESSIONS * 1024;
    let slot_term = 2 * (3 * E + 3) * STATE;
    let bound = base
        + memory_bound(2, 512 << 10, 1 << 20, 2, 1 << 20, 1 << 20, 10_000)
        + slot_term
        + sessions_term;

    let c = d.client().await;
    let state = dense_state(STATE as usize);
    assert!(serde_json::to_vec(&state).unwrap().len() as u64 <= STATE);
    for i in 0..SESSIONS {
        let r = call(
            &c,
            "session_create",
            json!({"id": format!("s{i}"), "state": state.clone()}),
        )
        .await;
        assert!(!is_error(&r), "{}", text(&r));
    }
    let r = call(&c, "session_create", json!({"id": "one-more"})).await;
    assert_eq!(code(&r), "QUOTA_EXCEEDED", "{r}");
    // Every state is still there, read from its file.
    let r = call(&c, "session_get", json!({"session": "s63"})).await;
    assert_eq!(
        r["structuredContent"]["state"]["a"]
            .as_array()
            .map(Vec::len),
        Some((STATE as usize - 8) / 2)
    );
    let rss = status_kib(d.pid(), "VmRSS:") * 1024;
    println!(
        "memory: base {} MiB, VmRSS {} MiB after {SESSIONS} sessions of {} KiB, bound {} MiB",
        base >> 20,
        rss >> 20,
        STATE >> 10,
        bound >> 20
    );
    assert!(
        rss < bound,
        "VmRSS {} MiB exceeds the documented bound {} MiB",
        rss >> 20,
        bound >> 20
    );
    drop(c);

    // A restart with no client: the daemon holds the sessions' ids, not their states. Its
    // bound is the base plus the session term and the reads one slot may make (startup
    // reads one file at a time).
    assert!(d.stop().success());
    d.start();
    let idle = status_kib(d.pid(), "VmRSS:") * 1024;
    let idle_bound = base + sessions_term + (3 * E + 3) * STATE;
    println!(
        "memory after restart: VmRSS {} MiB, bound {} MiB",
        idle >> 20,
        idle_bound >> 20
    );
    assert!(
        idle < idle_bound,
        "after a restart VmRSS {} MiB exceeds {} MiB: the states were loaded",
        idle >> 20,
        idle_bound >> 20
    );
}

/// Calls `slow_read` as `nobody`, `n` times at once; each task ends with its reply.
fn slow_reads(client: &Client, n: usize) -> Vec<tokio::task::JoinHandle<Result<Value, String>>> {
    (0..n)
        .map(|_| {
            let peer = client.peer().clone();
            tokio::spawn(async move {
                peer.call_tool(
                    rmcp::model::CallToolRequestParams::new("slow_read")
                        .with_arguments(args(json!({"seconds": 25}))),
                )
                .await
                .map(|r| serde_json::to_value(r).unwrap_or(Value::Null))
                .map_err(|e| e.to_string())
            })
        })
        .collect()
}

/// The hostile principal A floods `slow_read` past its share; B's `write_text` must be
/// served while all of A's calls are in flight. With the daemon as root, A is `nobody`
/// (granted only `slow_read`) and B root; with the daemon as `nobody`, A is root and B the
/// daemon's own user. Both tools run under `profile`.
async fn a_flood_past_the_share_is_refused_and_another_uid_is_served(
    unprivileged: bool,
    profile: &str,
) {
    let mut d =
        daemon("[[grant]]\nuids = [65534]\ncapabilities = [\"read\"]\ntools = [\"slow_read\"]\n");
    set_daemon(
        &d,
        &[
            ("max_concurrent_calls", "4"),
            ("max_calls_per_principal", "2"),
            ("max_queued_per_principal", "2"),
        ],
    );
    for (tool, from, to) in [
        (
            "slow_read",
            "capability = \"read\"\n",
            format!("capability = \"read\"\nprofile = \"{profile}\"\n"),
        ),
        (
            "write_text",
            "profile = \"default\"",
            format!("profile = \"{profile}\""),
        ),
    ] {
        let path = d.policies.join(format!("tools/{tool}.toml"));
        let text = std::fs::read_to_string(&path).expect("tool");
        assert!(text.contains(from), "{tool}.toml moved");
        std::fs::write(&path, text.replacen(from, &to, 1)).expect("write tool");
    }
    if unprivileged {
        crate::sandbox::give_to_nobody(&d);
        d.user = Some((65534, 65534));
    }
    d.start();
    let root = d.client().await;
    let nobody = as_nobody(&d).await;
    let (a, a_uid, b, b_uid) = if unprivileged {
        (&root, 0, &nobody.client, NOBODY)
    } else {
        (&nobody.client, NOBODY, &root, 0)
    };
    session(b, "b").await;

    // A sends 7 calls of 25 s: 2 run (its share), 2 wait (its queue), 3 are refused at once.
    let mut calls = slow_reads(a, 7);
    let mut busy = 0;
    while busy < 3 {
        let (r, _, rest) = futures_select_ready(calls).await;
        calls = rest;
        let r = r.expect("a reply");
        assert_eq!(
            code(&r),
            "BUSY",
            "only a refusal comes back this early: {r}"
        );
        assert!(
            text(&r).contains("max_calls_per_principal = 2")
                && text(&r).contains("max_queued_per_principal (2)")
                && text(&r).contains(&format!("uid {a_uid} ")),
            "{r}"
        );
        busy += 1;
    }
    // A's share is running: two workers started.
    wait_until_events(&root, a_uid, "slow_read", |ev| {
        ev.iter().filter(|e| e["kind"] == "start").count() == 2
    })
    .await;

    // B's write starts and completes while all of A's calls are still in flight.
    let r = call(
        b,
        "write_text",
        json!({"session": "b", "text": "B", "out": "b.txt"}),
    )
    .await;
    assert!(!is_error(&r), "{r}");
    assert_eq!(d.read("b.txt").as_deref(), Some("B"));
    let a_events = events_of(&root, a_uid, "slow_read").await;
    assert!(
        calls.iter().all(|c| !c.is_finished()),
        "an A call ended before B's write completed"
    );
    assert_eq!(calls.len(), 4);
    let count = |kind: &str| a_events.iter().filter(|e| e["kind"] == kind).count();
    assert_eq!(
        (
            count("allow"),
            count("start"),
            count("error"),
            count("done"),
            count("cancel")
        ),
        (7, 2, 3, 0, 0),
        "A's calls when B's write completed: {a_events:#?}"
    );
    for e in a_events.iter().filter(|e| e["kind"] == "error") {
        assert_eq!(e["detail"]["code"], "BUSY", "{e}");
        assert_eq!(e["detail"]["phase"], "queued", "{e}");
    }
    let b_commit = events_of(&root, b_uid, "write_text")
        .await
        .into_iter()
        .find(|e| e["kind"] == "commit")
        .expect("B's commit");
    let a_starts: Vec<u64> = a_events
        .iter()
        .filter(|e| e["kind"] == "start")
        .map(|e| e["seq"].as_u64().unwrap_or(u64::MAX))
        .collect();
    assert!(
        a_starts
            .iter()
            .all(|s| *s < b_commit["seq"].as_u64().unwrap_or(0)),
        "B committed while A's share ran: {a_starts:?} < {b_commit}"
    );

    // A's calls are cancelled (2 running, 2 queued): its client goes (nobody), or its
    // requests are cancelled (root, whose connection reads the audit).
    drop(calls);
    if unprivileged {
        // Root's calls end when its connection does; read the audit as nobody (the
        // daemon's own user, granted it) afterwards.
        drop(root);
    } else {
        drop(nobody);
    }
    let (reader, _bridge) = if unprivileged {
        let f = as_nobody(&d).await;
        (f.client, Some(f._child))
    } else {
        (d.client().await, None)
    };
    wait_until_events(&reader, a_uid, "slow_read", |ev| {
        ev.iter().filter(|e| e["kind"] == "cancel").count() == 4
    })
    .await;
    let a_events = events_of(&reader, a_uid, "slow_read").await;
    let mut phases: Vec<&str> = a_events
        .iter()
        .filter(|e| e["kind"] == "cancel")
        .map(|e| e["detail"]["phase"].as_str().unwrap_or(""))
        .collect();
    phases.sort();
    assert_eq!(
        phases,
        ["queued", "queued", "running", "running"],
        "{a_events:#?}"
    );
    assert_eq!(
        a_events.iter().filter(|e| e["kind"] == "start").count(),
        2,
        "a queued call started after its client left: {a_events:#?}"
    );
    wait_no_process("slow_read").await;
    drop(reader);
    assert!(d.stop().success());
    d.assert_audit_verifies("the audit log");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn one_principal_past_its_share_of_call_slots_is_refused_and_another_is_served_at_once() {
    a_flood_past_the_share_is_refused_and_another_uid_is_served(false, "default").await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_share_of_call_slots_holds_with_the_daemon_unprivileged_and_the_strict_profile() {
    a_flood_past_the_share_is_refused_and_another_uid_is_served(true, "strict").await;
}

/// Waits (polling the audit, by events) until `done` holds for `uid`'s events of `tool`.
async fn wait_until_events(reader: &Client, uid: u32, tool: &str, done: impl Fn(&[Value]) -> bool) {
    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(20);
    loop {
        let ev = events_of(reader, uid, tool).await;
        if done(&ev) {
            return;
        }
        assert!(
            std::time::Instant::now() < deadline,
            "waited 20 s for uid {uid}'s {tool} events: {ev:#?}"
        );
        tokio::time::sleep(std::time::Duration::from_millis(20)).await;
    }
}

/// The first of `calls` to finish, its index, and the others.
async fn futures_select_ready(
    calls: Vec<tokio::task::JoinHandle<Result<Value, String>>>,
) -> (
    Result<Value, String>,
    usize,
    Vec<tokio::task::JoinHandle<Result<Value, String>>>,
) {
    let mut calls = calls;
    loop {
        if let Some(i) = calls.iter().position(|c| c.is_finished()) {
            let done = calls.remove(i);
            let r = done.await.unwrap_or_else(|e| Err(e.to_string()));
            return (r, i, calls);
        }
        tokio::time::sleep(std::time::Duration::from_millis(10)).await;
    }
}
