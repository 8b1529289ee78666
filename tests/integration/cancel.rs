//! Cancellation never loses a result: a `notifications/cancelled` at any instant of a write
//! call's life either rolls it back with no response, or (past the point of no return,
//! publication) is too late and the call's result is sent. Never "no response and
//! committed", never "response and not committed".

use std::collections::HashMap;
use std::time::{Duration, Instant};

use serde_json::{json, Value};

use crate::harness::*;

/// Sends request `id` and waits for its reply; the framing keeps the id of a cancelled call
/// in flight until that call's reply (or its silence) has gone out, so a ping under the same
/// id is refused until then and, once accepted, is answered after anything of the call.
/// Returns the call's reply, if one came.
fn settle(raw: &mut Raw, id: i64) -> Option<Value> {
    let mut reply = None;
    let deadline = Instant::now() + Duration::from_secs(10);
    loop {
        assert!(
            Instant::now() < deadline,
            "call {id} did not end within 10 s of its cancel"
        );
        raw.send(&json!({"jsonrpc": "2.0", "id": id, "method": "ping"}));
        loop {
            let m = raw.recv();
            if m["id"] != json!(id) {
                continue;
            }
            if m["result"]["content"].is_array() || m["result"]["isError"].is_boolean() {
                assert!(reply.is_none(), "two replies to call {id}: {m}");
                reply = Some(m);
                continue;
            }
            if m["result"] == json!({}) {
                return reply;
            }
            let msg = m["error"]["message"].as_str().unwrap_or("");
            assert!(
                msg.contains("already in flight"),
                "unexpected reply under id {id}: {m}"
            );
            break;
        }
        std::thread::sleep(Duration::from_micros(200));
    }
}

fn session_version(raw: &mut Raw, id: i64) -> u64 {
    raw.call(id, "session_get", json!({"session": "s"}));
    let r = raw.response(id);
    r["result"]["structuredContent"]["version"]
        .as_u64()
        .unwrap_or_else(|| panic!("session_get: {r}"))
}

fn spin(d: Duration) {
    let until = Instant::now() + d;
    while Instant::now() < until {
        std::hint::spin_loop();
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_cancel_at_any_instant_rolls_back_silently_or_is_too_late_and_answered() {
    let mut d = Daemon::new();
    d.start();
    let c = d.client().await;
    session(&c, "s").await;
    let mut raw = d.raw();
    raw.initialize();

    // How long one call takes, end to end.
    let mut took = Duration::ZERO;
    for i in 0..5 {
        let t = Instant::now();
        raw.call(
            9_000 + i,
            "write_text",
            json!({"session": "s", "text": "warm", "out": "f.txt"}),
        );
        let r = raw.response(9_000 + i);
        assert_eq!(r["result"]["isError"], false, "{r}");
        took += t.elapsed();
    }
    let call_time = took / 5;
    let mut version = session_version(&mut raw, 9_100);
    assert_eq!(version, 5);
    let mut content = d.read("f.txt").expect("f.txt");
    let events_before = audit(&c).await.len();

    // Delays: half spread from 0 to 1.3 call times, half packed around the end of the
    // call, where the worker exits and the outputs are published.
    let tries = 300usize;
    let delays: Vec<Duration> = (0..tries)
        .map(|i| {
            let f = if i % 2 == 0 {
                1.3 * i as f64 / tries as f64
            } else {
                0.55 + 0.55 * i as f64 / tries as f64
            };
            call_time.mul_f64(f)
        })
        .collect();
    let started = Instant::now();
    let mut answered = Vec::new();
    for (i, delay) in delays.iter().enumerate() {
        let id = i as i64 + 1;
        let text = format!("try-{id}");
        raw.call(
            id,
            "write_text",
            json!({"session": "s", "text": text, "out": "f.txt"}),
        );
        spin(*delay);
        raw.send(
            &json!({"jsonrpc": "2.0", "method": "notifications/cancelled",
            "params": {"requestId": id, "reason": "sweep"}}),
        );
        let reply = settle(&mut raw, id);
        let now = session_version(&mut raw, 100_000 + id);
        let file = d.read("f.txt").expect("f.txt is never removed");
        match &reply {
            None => {
                assert_eq!(
                    now, version,
                    "try {id} (cancel after {delay:?}): no response, yet the version moved"
                );
                assert_eq!(
                    file, content,
                    "try {id} (cancel after {delay:?}): no response, yet f.txt changed"
                );
            }
            Some(r) => {
                assert_eq!(
                    r["result"]["isError"], false,
                    "try {id} (cancel after {delay:?}): {r}"
                );
                assert_eq!(r["result"]["structuredContent"]["version"], version + 1);
                assert_eq!(
                    now,
                    version + 1,
                    "try {id} (cancel after {delay:?}): answered, yet not committed"
                );
                assert_eq!(
                    file, text,
                    "try {id} (cancel after {delay:?}): answered, yet not published"
                );
                version += 1;
                content = file;
            }
        }
        answered.push(reply.is_some());
    }
    let elapsed = started.elapsed();

    // The audit, call by call: the sweep's write_text calls in order of their `allow`.
    let events = audit(&c).await;
    assert!(
        events.len() > events_before,
        "the audit ring lost the sweep's events"
    );
    let mut order: Vec<String> = Vec::new();
    let mut by_call: HashMap<String, Vec<&Value>> = HashMap::new();
    for e in &events {
        if e["tool"] != "write_text" {
            continue;
        }
        let call = e["job"].as_str().expect("job id").to_string();
        if e["kind"] == "allow" {
            order.push(call.clone());
        }
        by_call.entry(call).or_default().push(e);
    }
    let sweep = &order[order.len() - tries..];
    let mut too_late = 0;
    for (i, call) in sweep.iter().enumerate() {
        let evs = &by_call[call];
        let kinds: Vec<&str> = evs.iter().filter_map(|e| e["kind"].as_str()).collect();
        let committed = kinds.contains(&"commit");
        if answered[i] {
            assert!(
                committed && !kinds.contains(&"rollback"),
                "try {}: answered, audit {kinds:?}",
                i + 1
            );
            if evs
                .iter()
                .any(|e| e["kind"] == "cancel" && e["detail"]["too_late"] == true)
            {
                too_late += 1;
            }
        } else {
            assert!(
                // Cancelled while queued (`allow, cancel`) or once started (`..., rollback`).
                !committed
                    && kinds.contains(&"cancel")
                    && matches!(kinds.last(), Some(&"rollback") | Some(&"cancel")),
                "try {}: not answered, audit {kinds:?}",
                i + 1
            );
        }
    }
    let n_answered = answered.iter().filter(|a| **a).count();
    eprintln!(
        "sweep: {tries} tries in {elapsed:?}, call time {call_time:?}: {} rolled back silently, \
         {n_answered} answered ({too_late} of them with cancel_too_late in the audit)",
        tries - n_answered
    );
    // The sweep covered the call's whole life: some cancels came in time, some too late.
    assert!(
        n_answered > 0 && n_answered < tries,
        "every try ended the same way ({n_answered} answered of {tries}): the sweep missed part of the call's life"
    );
    assert!(d.job_dirs().is_empty(), "job dirs left: {:?}", d.job_dirs());
    assert_eq!(version, session_version(&mut raw, 200_000));
    // A client's cancel is no fault: the daemon's log holds no WARN for it.
    let log = d.log_text();
    assert!(
        !log.contains("WARN") && !log.contains("cancelled by the client"),
        "a cancel logged a warning:\n{log}"
    );
}

/// JSON-RPC errors over the real socket carry what a client can match: a request before
/// `initialize`, `tools/call` without `name` or with non-object `arguments`, and a batch are
/// each answered under the request's own id, never `"id": null`; the connection keeps
/// serving.
#[tokio::test]
async fn jsonrpc_errors_over_the_socket_carry_the_request_id() {
    let mut d = Daemon::new();
    d.start();
    let mut raw = d.raw();
    let error_of = |m: &Value| m["error"]["code"].as_i64();
    // Before initialize.
    raw.send(&json!({"jsonrpc": "2.0", "id": 7, "method": "tools/list"}));
    let r = raw.response(7);
    assert_eq!(error_of(&r), Some(-32600), "{r}");
    assert!(
        r["error"]["message"]
            .as_str()
            .unwrap_or("")
            .contains("initialize"),
        "{r}"
    );
    raw.initialize();
    // tools/call without a name, and with arguments that are not an object.
    raw.send(&json!({"jsonrpc": "2.0", "id": 8, "method": "tools/call", "params": {}}));
    let r = raw.response(8);
    assert_eq!(error_of(&r), Some(-32602), "{r}");
    raw.send(&json!({"jsonrpc": "2.0", "id": 9, "method": "tools/call",
        "params": {"name": "session_list", "arguments": [1, 2]}}));
    let r = raw.response(9);
    assert_eq!(error_of(&r), Some(-32602), "{r}");
    // A batch: one error per request in it, each under its own id.
    raw.send(&json!([
        {"jsonrpc": "2.0", "id": 10, "method": "ping"},
        {"jsonrpc": "2.0", "id": 11, "method": "tools/list"}
    ]));
    let mut ids = Vec::new();
    for _ in 0..2 {
        let m = raw.recv();
        assert!(m["error"].is_object(), "{m}");
        assert!(!m["id"].is_null(), "an error under id null: {m}");
        ids.push(m["id"].as_i64().expect("numeric id"));
    }
    ids.sort();
    assert_eq!(ids, vec![10, 11]);
    // Still serving on the same connection.
    raw.send(&json!({"jsonrpc": "2.0", "id": 12, "method": "ping"}));
    let r = raw.response(12);
    assert!(r["result"].is_object(), "{r}");
}
