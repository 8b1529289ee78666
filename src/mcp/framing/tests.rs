use super::gate::*;
use super::pump::*;
use super::scan::*;

use std::sync::atomic::Ordering;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use serde_json::{json, Value};
use tokio::io::{AsyncBufReadExt, AsyncWriteExt, BufReader};
use tokio::sync::Notify;
use tokio_util::sync::CancellationToken;

use proptest::prelude::*;

fn reply_of(i: Inbound) -> Value {
    match i {
        Inbound::Reply(line) => {
            assert!(line.ends_with(b"\n"));
            serde_json::from_slice(&line).expect("a reply is one JSON line")
        }
        other => panic!("expected a reply, got {other:?}"),
    }
}

fn forwarded(i: Inbound) -> Value {
    match i {
        Inbound::Forward(line) => serde_json::from_slice(&line).expect("forwarded JSON"),
        other => panic!("expected a forward, got {other:?}"),
    }
}

fn req(id: Value, method: &str) -> Vec<u8> {
    json!({"jsonrpc": "2.0", "id": id, "method": method})
        .to_string()
        .into_bytes()
}

fn call_req(id: Value) -> Vec<u8> {
    json!({"jsonrpc": "2.0", "id": id, "method": "tools/call", "params": {"name": "cat"}})
        .to_string()
        .into_bytes()
}

#[tokio::test]
async fn frames() {
    let input: &[u8] =
        b"{\"a\":1}\n\n  \n{bad\n{\"id\":9,\"x\":\"0123456789012345678901234567890\"}\n[1]";
    let mut r = LineReader::new(input, 16);
    assert_eq!(r.next().await.unwrap(), Frame::Line(b"{\"a\":1}".to_vec()));
    assert_eq!(r.next().await.unwrap(), Frame::Line(b"{bad".to_vec()));
    // The oversized line is discarded but its beginning is kept, to answer under its id.
    match r.next().await.unwrap() {
        Frame::Oversized(prefix) => assert_eq!(recover_id(&prefix), json!(9)),
        f => panic!("{f:?}"),
    }
    // A last line without a newline is incomplete: the peer went away mid-message.
    assert_eq!(r.next().await.unwrap(), Frame::Eof);
}

#[tokio::test]
async fn an_endless_line_is_held_only_up_to_its_prefix() {
    let big = vec![b'x'; 10 << 20];
    let mut r = LineReader::new(&big[..], 1024);
    assert_eq!(r.next().await.unwrap(), Frame::Eof);
    assert!(
        r.split.buf.capacity() <= 2 * OVERSIZED_PREFIX + 64 * 1024,
        "{}",
        r.split.buf.capacity()
    );
}

#[test]
fn deep_nesting_is_refused_before_parsing_under_the_recovered_id() {
    let mut ids = Ids::new(8, 1 << 30).after_handshake();
    let deep = "[".repeat(100_000);
    let r = reply_of(ids.inbound(deep.as_bytes()));
    assert_eq!(r["error"]["code"], -32600);
    assert!(
        r["error"]["message"]
            .as_str()
            .unwrap()
            .contains("deeper than 64"),
        "{r}"
    );
    assert_eq!(r["id"], Value::Null);
    let line = format!(
        "{{\"jsonrpc\":\"2.0\",\"id\":7,\"method\":\"ping\",\"params\":{}{}}}",
        deep,
        "]".repeat(100_000)
    );
    let r = reply_of(ids.inbound(line.as_bytes()));
    assert_eq!(r["id"], 7, "{r}");
    // 64 levels are fine.
    let ok = format!(
        "{{\"jsonrpc\":\"2.0\",\"id\":8,\"method\":\"ping\",\"params\":{{\"a\":{}{}}}}}",
        "[".repeat(62),
        "]".repeat(62)
    );
    assert!(matches!(ids.inbound(ok.as_bytes()), Inbound::Forward(_)));
}

#[test]
fn invalid_utf8_and_broken_json_are_answered_under_their_id() {
    let mut ids = Ids::new(8, 1 << 30).after_handshake();
    let mut line = br#"{"jsonrpc":"2.0","id":"abc","method":"ping","params":{"x":""#.to_vec();
    line.extend_from_slice(&[0xff, 0xfe]);
    line.extend_from_slice(br#""}}"#);
    let r = reply_of(ids.inbound(&line));
    assert_eq!(r["error"]["code"], -32700);
    assert!(
        r["error"]["message"].as_str().unwrap().contains("UTF-8"),
        "{r}"
    );
    assert_eq!(r["id"], "abc");
    let r = reply_of(ids.inbound(br#"{"jsonrpc":"2.0","id":12,"method":"ping","params":{"#));
    assert_eq!(
        (r["id"].clone(), r["error"]["code"].clone()),
        (json!(12), json!(-32700))
    );
    let r = reply_of(ids.inbound(b"\xff\xff"));
    assert_eq!(r["id"], Value::Null);
}

#[test]
fn messages_that_are_not_json_rpc_get_an_error() {
    let mut ids = Ids::new(8, 1 << 30).after_handshake();
    for (line, id) in [
        (
            &br#"[{"jsonrpc":"2.0","id":1,"method":"ping"}]"#[..],
            json!(1),
        ),
        (br#""text""#, Value::Null),
        (br#"{"jsonrpc":"1.0","id":3,"method":"ping"}"#, json!(3)),
        (br#"{"jsonrpc":"2.0","id":4,"method":5}"#, json!(4)),
        (br#"{"jsonrpc":"2.0","id":5}"#, json!(5)),
        (
            br#"{"jsonrpc":"2.0","id":1.5,"method":"ping"}"#,
            Value::Null,
        ),
        (
            br#"{"jsonrpc":"2.0","id":{"a":1},"method":"ping"}"#,
            Value::Null,
        ),
    ] {
        let r = reply_of(ids.inbound(line));
        assert_eq!(r["id"], id, "{}: {r}", String::from_utf8_lossy(line));
        assert_eq!(r["error"]["code"], -32600, "{r}");
    }
    // Params rmcp cannot read are answered here, under the id (rmcp would say null).
    let r = reply_of(ids.inbound(br#"{"jsonrpc":"2.0","id":6,"method":"tools/call","params":5}"#));
    assert_eq!(
        (r["id"].clone(), r["error"]["code"].clone()),
        (json!(6), json!(-32602))
    );
    // A string id over the bound is refused without being echoed.
    let r = reply_of(ids.inbound(&req(json!("i".repeat(MAX_ID_BYTES + 1)), "ping")));
    assert_eq!(r["id"], Value::Null);
    // A notification is never answered, even a bad one.
    assert_eq!(
        ids.inbound(br#"{"jsonrpc":"2.0","method":"notifications/initialized","params":7}"#),
        Inbound::Ignore
    );
}

#[test]
fn a_duplicate_in_flight_id_is_rejected_and_ids_map_back() {
    let mut ids = Ids::new(8, 1 << 30).after_handshake();
    let first = forwarded(ids.inbound(&req(json!(1), "ping")));
    let internal = first["id"].as_u64().expect("a numeric internal id");
    let r = reply_of(ids.inbound(&req(json!(1), "ping")));
    assert_eq!(r["id"], 1);
    assert!(
        r["error"]["message"]
            .as_str()
            .unwrap()
            .contains("already in flight"),
        "{r}"
    );
    // "1" and 1 are different ids.
    let second = forwarded(ids.inbound(&req(json!("1"), "ping")));
    assert_ne!(second["id"], first["id"]);
    // The reply goes out under the client's id, and frees it.
    let out = ids
        .outbound(
            format!("{{\"jsonrpc\":\"2.0\",\"id\":{internal},\"result\":{{}}}}\n").into_bytes(),
        )
        .expect("a reply");
    let out: Value = serde_json::from_slice(&out).unwrap();
    assert_eq!(out["id"], 1);
    assert!(matches!(
        ids.inbound(&req(json!(1), "ping")),
        Inbound::Forward(_)
    ));
    // Lines that are not replies to a client request pass unchanged.
    let note =
        b"{\"jsonrpc\":\"2.0\",\"method\":\"notifications/message\",\"params\":{}}\n".to_vec();
    assert_eq!(ids.outbound(note.clone()), Some(note));
    let null = b"{\"jsonrpc\":\"2.0\",\"id\":null,\"error\":{\"code\":-32600,\"message\":\"x\"}}\n"
        .to_vec();
    assert_eq!(ids.outbound(null.clone()), Some(null));
}

#[test]
fn a_cancelled_request_frees_its_id_and_its_late_reply_is_dropped() {
    // Not a tools/call: rmcp handles the cancellation and sends nothing.
    let mut ids = Ids::new(8, 1 << 30).after_handshake();
    let internal = forwarded(ids.inbound(&req(json!("x"), "resources/read")))["id"].clone();
    let cancel = json!({"jsonrpc": "2.0", "method": "notifications/cancelled",
        "params": {"requestId": "x", "reason": "test"}});
    let fwd = forwarded(ids.inbound(cancel.to_string().as_bytes()));
    assert_eq!(fwd["params"]["requestId"], internal);
    let late = format!("{{\"jsonrpc\":\"2.0\",\"id\":{internal},\"result\":{{}}}}\n");
    assert_eq!(ids.outbound(late.into_bytes()), None);
    // Cancelling an id not in flight is not passed on.
    assert_eq!(ids.inbound(cancel.to_string().as_bytes()), Inbound::Ignore);
    assert!(matches!(
        ids.inbound(&req(json!("x"), "ping")),
        Inbound::Forward(_)
    ));
}

#[test]
fn a_cancelled_call_is_decided_by_the_executor_not_rmcp() {
    let mut ids = Ids::new(8, 1 << 30).after_handshake();
    let calls = ids.calls();
    let internal = forwarded(ids.inbound(&call_req(json!("c"))))["id"]
        .as_u64()
        .expect("numeric id");
    let token = calls.register(internal, &tokio_util::sync::CancellationToken::new());
    let cancel = json!({"jsonrpc": "2.0", "method": "notifications/cancelled",
        "params": {"requestId": "c"}});
    // rmcp never hears of it; the executor's token is cancelled.
    assert_eq!(ids.inbound(cancel.to_string().as_bytes()), Inbound::Ignore);
    assert!(token.is_cancelled());
    // The id stays in flight until the call's reply (or silence) goes out.
    let again = ids.inbound(&req(json!("c"), "ping"));
    assert!(
        matches!(&again, Inbound::Reply(l) if String::from_utf8_lossy(l).contains("already in flight")),
        "{again:?}"
    );
    // Too late: the executor returned a result; it is sent under the client's id.
    let result = format!("{{\"jsonrpc\":\"2.0\",\"id\":{internal},\"result\":{{}}}}\n");
    let out = ids
        .outbound(result.into_bytes())
        .expect("a too-late result is sent");
    let v: Value = serde_json::from_slice(&out).expect("json");
    assert_eq!(v["id"], "c");

    // Rolled back: the handler silenced it; its error is dropped and the id is free.
    let internal = forwarded(ids.inbound(&call_req(json!("d"))))["id"]
        .as_u64()
        .expect("numeric id");
    let cancel = json!({"jsonrpc": "2.0", "method": "notifications/cancelled",
        "params": {"requestId": "d"}});
    assert_eq!(ids.inbound(cancel.to_string().as_bytes()), Inbound::Ignore);
    let token = calls.register(internal, &tokio_util::sync::CancellationToken::new());
    assert!(
        token.is_cancelled(),
        "a cancel before the handler started still counts"
    );
    assert!(calls.silence(internal));
    let err = format!("{{\"jsonrpc\":\"2.0\",\"id\":{internal},\"error\":{{\"code\":-32603,\"message\":\"x\"}}}}\n");
    assert_eq!(ids.outbound(err.into_bytes()), None);
    assert!(matches!(
        ids.inbound(&req(json!("d"), "ping")),
        Inbound::Forward(_)
    ));
}

#[test]
fn requests_in_flight_are_capped() {
    let mut ids = Ids::new(3, 1 << 30).after_handshake();
    for i in 0..3 {
        assert!(matches!(
            ids.inbound(&req(json!(i), "ping")),
            Inbound::Forward(_)
        ));
    }
    let r = reply_of(ids.inbound(&req(json!(3), "ping")));
    assert_eq!(
        (r["id"].clone(), r["error"]["code"].clone()),
        (json!(3), json!(-32000))
    );
    assert!(r["error"]["message"]
        .as_str()
        .unwrap()
        .contains("max_requests_per_connection"));
    assert_eq!(ids.idle_for(), Duration::ZERO);
    // In bytes: a second request waits while the first holds the budget; alone, any size goes.
    let mut ids = Ids::new(10, 100).after_handshake();
    assert!(!ids.full(1000));
    assert!(matches!(
        ids.inbound(&req(json!(1), "ping")),
        Inbound::Forward(_)
    ));
    assert!(!ids.full(50));
    assert!(ids.full(90));
}

#[test]
fn client_info_is_truncated_before_rmcp_sees_it() {
    let mut ids = Ids::new(8, 1 << 30).after_handshake();
    let init = json!({"jsonrpc": "2.0", "id": 0, "method": "initialize", "params": {
        "protocolVersion": "2025-11-25", "capabilities": {},
        "clientInfo": {"name": "n".repeat(1 << 20), "version": "v".repeat(100_000), "title": "é".repeat(1000)}}});
    let fwd = forwarded(ids.inbound(init.to_string().as_bytes()));
    let info = &fwd["params"]["clientInfo"];
    for field in ["name", "version", "title"] {
        let s = info[field].as_str().unwrap();
        assert!(
            s.len() < MAX_CLIENT_FIELD + 40,
            "{field}: {} bytes",
            s.len()
        );
        assert!(s.contains("…[truncated "), "{field}: {s}");
    }
    // Params too large to keep are refused.
    let mut ids = Ids::new(8, 1 << 30).after_handshake();
    let init = json!({"jsonrpc": "2.0", "id": 0, "method": "initialize", "params": {
        "protocolVersion": "2025-11-25", "capabilities": {"experimental": {"x": {"y": "z".repeat(100_000)}}},
        "clientInfo": {"name": "n", "version": "1"}}});
    let r = reply_of(ids.inbound(init.to_string().as_bytes()));
    assert_eq!(r["id"], 0);
}

#[test]
fn a_modern_requests_client_info_is_cut_alike_and_the_first_name_stays() {
    let mut ids = Ids::new(8, 1 << 30);
    let names = ids.client_name();
    let modern = |id: u64, name: String| {
        json!({"jsonrpc": "2.0", "id": id, "method": "tools/list", "params": {"_meta": {
            "io.modelcontextprotocol/protocolVersion": "2026-07-28",
            "io.modelcontextprotocol/clientCapabilities": {},
            META_CLIENT_INFO: {"name": name, "version": "v".repeat(5000), "title": "é".repeat(3000)}}}})
    };
    let fwd = forwarded(ids.inbound(modern(1, "n".repeat(5000)).to_string().as_bytes()));
    let info = &fwd["params"]["_meta"][META_CLIENT_INFO];
    for field in ["name", "version", "title"] {
        let s = info[field].as_str().unwrap();
        let kept = s.split("…[truncated ").next().unwrap();
        assert!(
            kept.len() <= MAX_CLIENT_FIELD,
            "{field}: {} bytes",
            kept.len()
        );
        assert!(s.contains("…[truncated "), "{field}: {s}");
    }
    let first = names.get().expect("the first name");
    assert!(first.starts_with("nnn") && first.contains("…[truncated 4744 bytes]"));
    forwarded(ids.inbound(modern(2, "other".into()).to_string().as_bytes()));
    assert_eq!(names.get(), Some(first), "a later name replaced the first");
}

#[test]
fn the_out_queue_is_bounded_in_bytes() {
    let (q, mut rx, bytes) = OutQueue::new(100);
    q.push(vec![b'a'; 500])
        .expect("one large line into an empty queue");
    assert_eq!(q.push(vec![b'b'; 1]), Err(PushError::Full));
    assert_eq!(rx.try_recv().unwrap().len(), 500);
    bytes.fetch_sub(500, Ordering::SeqCst);
    q.push(vec![b'c'; 60]).unwrap();
    q.push(vec![b'd'; 40]).unwrap();
    assert_eq!(q.push(vec![b'e'; 1]), Err(PushError::Full));
    drop(rx);
    bytes.store(0, Ordering::SeqCst);
    assert_eq!(q.push(vec![b'f'; 1]), Err(PushError::Closed));
}

#[tokio::test]
async fn a_client_that_does_not_read_times_the_writer_out() {
    let (w, _unread) = tokio::io::duplex(1024);
    let (q, rx, bytes) = OutQueue::new(1 << 20);
    q.push(vec![b'x'; 64 * 1024]).unwrap();
    let end = write_lines(
        w,
        rx,
        bytes,
        Duration::from_millis(200),
        CancellationToken::new(),
    )
    .await;
    assert_eq!(end, WriteEnd::TimedOut);
    // And `stop` ends it at once, whatever the client does.
    let (w, _unread) = tokio::io::duplex(1024);
    let (q, rx, bytes) = OutQueue::new(1 << 20);
    q.push(vec![b'x'; 64 * 1024]).unwrap();
    let stop = CancellationToken::new();
    stop.cancel();
    let end = write_lines(w, rx, bytes, Duration::from_secs(3600), stop).await;
    assert_eq!(end, WriteEnd::Stopped);
}

// ---- property-based: random bytes and random JSON -----------------------------------------

/// Whether a line is a JSON-RPC notification (the one thing never answered).
fn is_notification(line: &[u8]) -> bool {
    serde_json::from_slice::<Value>(line).is_ok_and(|v| {
        v.get("method").is_some_and(Value::is_string)
            && v.get("id").is_none()
            && v.get("jsonrpc") == Some(&json!("2.0"))
            && !too_deep(line, MAX_DEPTH)
    })
}

/// Whether a line is a reply to a request of the server's (forwarded, or ignored if bad).
fn is_client_reply(line: &[u8]) -> bool {
    serde_json::from_slice::<Value>(line).is_ok_and(|v| {
        v.get("method").is_none()
            && v.get("id").is_some()
            && (v.get("result").is_some() || v.get("error").is_some())
    })
}

fn arb_json() -> impl Strategy<Value = Value> {
    let leaf = prop_oneof![
        Just(Value::Null),
        any::<bool>().prop_map(Value::Bool),
        any::<i64>().prop_map(|n| json!(n)),
        any::<f64>()
            .prop_filter("finite", |f| f.is_finite())
            .prop_map(|f| json!(f)),
        ".{0,20}".prop_map(Value::String),
    ];
    leaf.prop_recursive(6, 64, 8, |inner| {
        prop_oneof![
            prop::collection::vec(inner.clone(), 0..8).prop_map(Value::Array),
            prop::collection::btree_map(".{0,8}", inner, 0..8)
                .prop_map(|m| Value::Object(m.into_iter().collect())),
        ]
    })
}

fn arb_method() -> impl Strategy<Value = String> {
    prop_oneof![
        Just("ping".to_string()),
        Just("tools/list".to_string()),
        Just("tools/call".to_string()),
        Just("resources/read".to_string()),
        Just("resources/list".to_string()),
        Just("prompts/list".to_string()),
        Just("initialize".to_string()),
        Just("notifications/cancelled".to_string()),
        "[a-z/]{1,16}",
    ]
}

fn arb_id() -> impl Strategy<Value = Value> {
    prop_oneof![
        any::<i64>().prop_map(|n| json!(n)),
        "[a-zA-Z0-9_-]{0,40}".prop_map(Value::String),
    ]
}

fn arb_request() -> impl Strategy<Value = Value> {
    (arb_method(), arb_id(), prop::option::of(arb_json())).prop_map(|(m, id, params)| {
        let mut v = json!({"jsonrpc": "2.0", "id": id, "method": m});
        if let Some(p) = params {
            v["params"] = p;
        }
        v
    })
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 512, ..ProptestConfig::default() })]

    /// Random bytes: no panic, and every line that is not a notification or a reply to
    /// the server is answered with one JSON-RPC error line or handed to rmcp.
    #[test]
    fn random_bytes_never_panic_and_get_a_verdict(line in prop::collection::vec(any::<u8>(), 0..512)) {
        let line: Vec<u8> = line.into_iter().filter(|b| *b != b'\n').collect();
        let mut ids = Ids::new(4, 1 << 30).after_handshake();
        let _ = scan_top(&line);
        let _ = recover_id(&line);
        match ids.inbound(&line) {
            Inbound::Reply(r) => {
                let v: Value = serde_json::from_slice(&r).expect("reply is JSON");
                prop_assert!(v["error"]["code"].is_i64());
                prop_assert!(r.len() < 2048);
            }
            Inbound::Forward(f) => {
                prop_assert!(serde_json::from_slice::<rmcp::model::ClientJsonRpcMessage>(&f).is_ok());
            }
            Inbound::Ignore => prop_assert!(
                trim(&line).is_empty() || is_notification(trim(&line)) || is_client_reply(trim(&line)),
                "ignored {:?}", String::from_utf8_lossy(&line)
            ),
        }
    }

    /// Random JSON: every request is forwarded under a fresh internal id (rmcp can read
    /// it) or answered under its own id; nothing else is answered with a request's id.
    #[test]
    fn random_json_requests_are_forwarded_or_answered_under_their_id(
        msgs in prop::collection::vec(prop_oneof![arb_request(), arb_json()], 1..16)
    ) {
        let mut ids = Ids::new(64, 1 << 30).after_handshake();
        let mut seen = std::collections::HashSet::new();
        for v in msgs {
            let line = v.to_string().into_bytes();
            let is_request = v.get("method").is_some_and(Value::is_string) && v.get("id").is_some()
                && v.get("jsonrpc") == Some(&json!("2.0"));
            match ids.inbound(&line) {
                Inbound::Forward(f) => {
                    prop_assert!(serde_json::from_slice::<rmcp::model::ClientJsonRpcMessage>(&f).is_ok());
                    if is_request {
                        prop_assert!(seen.insert(v["id"].to_string()), "a duplicate id was forwarded");
                        let fwd: Value = serde_json::from_slice(&f).unwrap();
                        prop_assert!(fwd["id"].is_u64());
                    }
                }
                Inbound::Reply(r) => {
                    let r: Value = serde_json::from_slice(&r).unwrap();
                    if is_request && !echoable(&v["id"]).is_null() {
                        prop_assert_eq!(&r["id"], &v["id"]);
                    }
                }
                Inbound::Ignore => prop_assert!(!is_request, "a request was ignored: {}", v),
            }
        }
    }

    /// The id scan agrees with a real parser on whole messages.
    #[test]
    fn the_scan_finds_the_id_a_parser_finds(v in arb_request()) {
        let line = v.to_string().into_bytes();
        prop_assert_eq!(recover_id(&line), echoable(&v["id"]));
    }
}

// ---- the whole pipe, with rmcp on the other side --------------------------------------------

#[derive(Clone)]
struct Nop;
impl rmcp::ServerHandler for Nop {}

/// Feeds `lines` through the framing pumps to a real rmcp server over in-memory pipes, and
/// returns every line the client receives until each id in `expect` has had its reply.
async fn through_rmcp(lines: Vec<Vec<u8>>, expect: Vec<Value>) -> Vec<Value> {
    let (client, sock) = tokio::io::duplex(1 << 20);
    let (sock_r, sock_w) = tokio::io::split(sock);
    let (rmcp_side, ours) = tokio::io::duplex(256 * 1024);
    let (from_rmcp, to_rmcp) = tokio::io::split(ours);
    let (queue, rx, queued) = OutQueue::new(8 << 20);
    let ids = Arc::new(Mutex::new(Ids::new(4, 1 << 30).after_handshake()));
    tokio::spawn(write_lines(
        sock_w,
        rx,
        queued,
        Duration::from_secs(30),
        CancellationToken::new(),
    ));
    let freed = Arc::new(Notify::new());
    tokio::spawn(pump_in(
        LineReader::new(sock_r, 1 << 20),
        to_rmcp,
        queue.clone(),
        ids.clone(),
        freed.clone(),
    ));
    tokio::spawn(pump_out(from_rmcp, queue, ids, freed, || {
        panic!("overflow")
    }));
    tokio::spawn(async move {
        use rmcp::ServiceExt;
        if let Ok(s) = Nop.serve(rmcp_side).await {
            let _ = s.waiting().await;
        }
    });
    let (client_r, mut client_w) = tokio::io::split(client);
    let init = json!({"jsonrpc": "2.0", "id": "init", "method": "initialize", "params": {
        "protocolVersion": "2025-11-25", "capabilities": {}, "clientInfo": {"name": "t", "version": "0"}}});
    client_w
        .write_all(format!("{init}\n").as_bytes())
        .await
        .unwrap();
    let mut reader = BufReader::new(client_r);
    let mut got = Vec::new();
    let mut line = String::new();
    reader.read_line(&mut line).await.unwrap();
    let v: Value = serde_json::from_str(&line).unwrap();
    assert_eq!(v["id"], "init", "{v}");
    client_w
        .write_all(b"{\"jsonrpc\":\"2.0\",\"method\":\"notifications/initialized\"}\n")
        .await
        .unwrap();
    for l in lines {
        client_w.write_all(&l).await.unwrap();
        client_w.write_all(b"\n").await.unwrap();
    }
    let mut waiting: std::collections::HashSet<String> =
        expect.iter().map(Value::to_string).collect();
    while !waiting.is_empty() {
        line.clear();
        let n = tokio::time::timeout(Duration::from_secs(10), reader.read_line(&mut line))
            .await
            .unwrap_or_else(|_| panic!("no reply within 10 s for {waiting:?}; got {got:?}"))
            .unwrap();
        assert!(n > 0, "EOF while waiting for {waiting:?}");
        let v: Value = serde_json::from_str(&line).unwrap();
        waiting.remove(&v["id"].to_string());
        got.push(v);
    }
    got
}

#[tokio::test]
async fn every_bad_line_gets_an_error_through_rmcp_and_the_connection_keeps_working() {
    let mut bad_utf8 = br#"{"jsonrpc":"2.0","id":3,"method":"ping","x":""#.to_vec();
    bad_utf8.extend_from_slice(b"\xc3\x28\"}");
    let lines = vec![
        format!(
            "{{\"jsonrpc\":\"2.0\",\"id\":1,\"method\":\"ping\",\"params\":{}",
            "[".repeat(100_000)
        )
        .into_bytes(),
        b"{not json".to_vec(),
        bad_utf8,
        req(json!(4), "tools/list"),
        req(json!(4), "ping"),
        req(json!(5), "no/such/method"),
        br#"{"jsonrpc":"2.0","id":6,"method":"tools/call","params":[1]}"#.to_vec(),
        req(json!("last"), "ping"),
    ];
    let got = through_rmcp(
        lines,
        vec![
            json!(1),
            json!(3),
            json!(4),
            json!(5),
            json!(6),
            json!("last"),
        ],
    )
    .await;
    let by_id = |id: Value| {
        got.iter()
            .filter(|v| v["id"] == id)
            .cloned()
            .collect::<Vec<_>>()
    };
    assert_eq!(by_id(json!(1))[0]["error"]["code"], -32600);
    assert_eq!(by_id(json!(3))[0]["error"]["code"], -32700);
    // id 4: one result (tools/list) and one duplicate error; order is not fixed.
    let four = by_id(json!(4));
    assert!(
        four.iter().any(|v| v["error"]["message"]
            .as_str()
            .is_some_and(|m| m.contains("already in flight")))
            || four.len() == 1,
        "{four:?}"
    );
    assert_eq!(by_id(json!(5))[0]["error"]["code"], -32601);
    assert!(by_id(json!(6))[0]["error"].is_object());
    assert!(by_id(json!("last"))[0]["result"].is_object());
    // The malformed line without an id got a null-id error.
    assert!(
        got.iter()
            .any(|v| v["id"].is_null() && v["error"]["code"] == -32700),
        "{got:?}"
    );
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 32, ..ProptestConfig::default() })]

    /// Random requests through rmcp: every request line gets exactly one reply, under its
    /// own id.
    #[test]
    fn every_random_request_gets_one_reply_through_rmcp(
        reqs in prop::collection::vec((arb_method(), prop::option::of(arb_json())), 1..12)
    ) {
        let rt = tokio::runtime::Builder::new_current_thread().enable_all().build().unwrap();
        let mut lines = Vec::new();
        let mut expect = Vec::new();
        for (i, (m, params)) in reqs.into_iter().enumerate() {
            let id = if i % 2 == 0 { json!(i) } else { json!(format!("r{i}")) };
            let mut v = json!({"jsonrpc": "2.0", "id": id, "method": m});
            if let Some(p) = params { v["params"] = p; }
            lines.push(v.to_string().into_bytes());
            expect.push(id);
        }
        let got = rt.block_on(through_rmcp(lines, expect.clone()));
        for id in expect {
            let n = got.iter().filter(|v| v["id"] == id).count();
            prop_assert_eq!(n, 1, "id {} got {} replies: {:?}", id, n, got);
        }
    }
}

#[test]
fn jsonrpc_errors_a_client_can_match() {
    let mut ids = Ids::new(8, 1 << 30);
    // Before initialize: a clear error under the request's id, not rmcp's `_meta` complaint.
    let r = reply_of(ids.inbound(&req(json!(1), "tools/list")));
    assert_eq!(r["id"], 1);
    assert_eq!(r["error"]["code"], -32600);
    let msg = r["error"]["message"].as_str().expect("message");
    assert!(
        msg.contains("before initialize") && !msg.contains("_meta"),
        "{msg}"
    );
    assert!(matches!(
        ids.inbound(&req(json!(2), "ping")),
        Inbound::Forward(_)
    ));
    let init = json!({"jsonrpc": "2.0", "id": 3, "method": "initialize", "params": {
        "protocolVersion": "2025-11-25", "capabilities": {},
        "clientInfo": {"name": "t", "version": "0"}}});
    assert!(matches!(
        ids.inbound(init.to_string().as_bytes()),
        Inbound::Forward(_)
    ));
    // tools/call without a name, with a non-string name, with non-object arguments: -32602.
    for (n, params) in [
        json!({"arguments": {}}),
        json!({"name": 5}),
        json!({"name": "cat", "arguments": [1]}),
        json!({"name": "cat", "arguments": "x"}),
        json!("cat"),
    ]
    .into_iter()
    .enumerate()
    {
        let line =
            json!({"jsonrpc": "2.0", "id": 10 + n, "method": "tools/call", "params": params});
        let r = reply_of(ids.inbound(line.to_string().as_bytes()));
        assert_eq!(r["id"], 10 + n, "{r}");
        assert_eq!(r["error"]["code"], -32602, "{params}: {r}");
    }
    // A batch: each request refused under its own id; one with no request id: no id at all.
    let Inbound::Reply(lines) = ids.inbound(
        br#"[{"jsonrpc":"2.0","id":"a","method":"ping"},{"jsonrpc":"2.0","method":"notifications/x"},{"jsonrpc":"2.0","id":7,"method":"tools/list"}]"#,
    ) else {
        panic!("a batch is answered")
    };
    let replies: Vec<Value> = String::from_utf8(lines)
        .expect("utf8")
        .lines()
        .map(|l| serde_json::from_str(l).expect("json"))
        .collect();
    assert_eq!(replies.len(), 2, "{replies:?}");
    assert_eq!(replies[0]["id"], "a");
    assert_eq!(replies[1]["id"], 7);
    assert!(replies.iter().all(|r| r["error"]["code"] == -32600));
    let r = reply_of(ids.inbound(br#"[{"jsonrpc":"2.0","method":"notifications/x"}]"#));
    assert!(
        r.as_object().expect("object").get("id").is_none(),
        "never \"id\": null: {r}"
    );
    // Nothing recoverable: the id is left out, never null.
    let r = reply_of(ids.inbound(b"{not json"));
    assert!(r.as_object().expect("object").get("id").is_none(), "{r}");
}

/// A client's method or id quoted in an error is shown escaped: no control, bidirectional or
/// invisible formatting character of the client's reaches the message raw.
#[test]
fn client_strings_in_jsonrpc_errors_are_escaped() {
    let raw = |m: &str| {
        m.chars().any(|c| {
            c.is_control() || matches!(c, '\u{200b}'..='\u{200f}' | '\u{202a}'..='\u{202e}')
        })
    };
    let mut ids = Ids::new(8, 1 << 30);
    let r = reply_of(ids.inbound(&req(json!(1), "tools/\u{202e}list\u{1b}[31m")));
    let msg = r["error"]["message"].as_str().expect("message");
    assert!(
        msg.contains("\"tools/\\u{202e}list\\u{1b}[31m\" before initialize"),
        "{msg}"
    );
    assert!(!raw(msg), "{msg:?}");
    let mut ids = Ids::new(8, 1 << 30).after_handshake();
    let id = json!("a\u{202e}b\n");
    assert!(matches!(
        ids.inbound(&call_req(id.clone())),
        Inbound::Forward(_)
    ));
    let r = reply_of(ids.inbound(&req(id, "ping")));
    let msg = r["error"]["message"].as_str().expect("message");
    assert!(
        msg.contains("id \"a\\u{202e}b\\n\" is already in flight"),
        "{msg}"
    );
    assert!(!raw(msg), "{msg:?}");
}
