//! Both protocol eras over the real socket: a 2025-era client negotiates with
//! `initialize`; a 2026-07-28 client sends `server/discover` and then self-contained
//! requests whose `_meta` carries its protocol version and capabilities. Each gets the
//! result shapes and error codes of its own revision.

use serde_json::{json, Value};

use crate::harness::*;

/// The `_meta` every 2026-07-28 request carries (no `initialize` in that revision).
fn modern_meta() -> Value {
    json!({
        "io.modelcontextprotocol/protocolVersion": "2026-07-28",
        "io.modelcontextprotocol/clientCapabilities": {},
        "io.modelcontextprotocol/clientInfo": {"name": "eras-test", "version": "0"},
    })
}

fn modern(id: i64, method: &str, mut params: Value) -> Value {
    params["_meta"] = modern_meta();
    json!({"jsonrpc": "2.0", "id": id, "method": method, "params": params})
}

/// Every result of the 2026-07-28 revision says `resultType`; the cacheable ones carry
/// `ttlMs` and `cacheScope`.
fn assert_modern_result(r: &Value, cacheable: bool) {
    let res = &r["result"];
    assert_eq!(res["resultType"], json!("complete"), "no resultType: {r}");
    if cacheable {
        assert!(res["ttlMs"].is_u64(), "no ttlMs: {r}");
        assert!(res["cacheScope"].is_string(), "no cacheScope: {r}");
    }
}

#[tokio::test]
async fn a_2026_07_28_client_gets_that_revisions_result_shapes_and_error_codes() {
    let mut d = Daemon::new();
    d.start();
    let mut raw = d.raw();
    raw.send(&modern(1, "server/discover", json!({})));
    let r = raw.response(1);
    let versions = r["result"]["supportedVersions"].clone();
    assert!(
        versions
            .as_array()
            .is_some_and(|v| v.contains(&json!("2026-07-28")) && v.contains(&json!("2025-11-25"))),
        "server/discover: {r}"
    );
    assert_modern_result(&r, true);

    raw.send(&modern(2, "tools/list", json!({})));
    let r = raw.response(2);
    assert_modern_result(&r, true);
    assert!(
        r["result"]["tools"]
            .as_array()
            .is_some_and(|t| t.iter().any(|t| t["name"] == "write_text")),
        "{r}"
    );

    // A write call that publishes, answered in the new shape.
    raw.send(&modern(
        3,
        "tools/call",
        json!({"name": "session_create", "arguments": {"id": "m1"}}),
    ));
    assert_modern_result(&raw.response(3), false);
    raw.send(&modern(
        4,
        "tools/call",
        json!({"name": "write_text",
               "arguments": {"session": "m1", "text": "modern", "out": "m.txt"}}),
    ));
    let r = raw.response(4);
    assert_modern_result(&r, false);
    assert_eq!(r["result"]["isError"], json!(false), "{r}");
    assert_eq!(d.read("m.txt").as_deref(), Some("modern"));

    raw.send(&modern(5, "resources/list", json!({})));
    assert_modern_result(&raw.response(5), true);
    raw.send(&modern(
        6,
        "resources/read",
        json!({"uri": "airlock://audit/events"}),
    ));
    let r = raw.response(6);
    assert_modern_result(&r, true);
    let text = r["result"]["contents"][0]["text"].as_str().unwrap_or("");
    assert!(
        text.contains("\"client\":\"eras-test\""),
        "the audit names the client from the request's _meta: {text}"
    );

    // The 2026-07-28 revision has no `ping` (the official SDKs send it only on a
    // 2025-era connection), and a missing resource is -32602 there.
    raw.send(&modern(7, "ping", json!({})));
    let r = raw.response(7);
    assert_eq!(r["error"]["code"], json!(-32601), "{r}");
    raw.send(&modern(
        8,
        "resources/read",
        json!({"uri": "airlock://nope"}),
    ));
    let r = raw.response(8);
    assert_eq!(r["error"]["code"], json!(-32602), "{r}");
    // A request of this era without its _meta is a clear -32602, and the connection serves on.
    raw.send(&json!({"jsonrpc": "2.0", "id": 9, "method": "tools/list",
                     "params": {"_meta": {"io.modelcontextprotocol/protocolVersion": "2026-07-28"}}}));
    let r = raw.response(9);
    assert_eq!(r["error"]["code"], json!(-32602), "{r}");
    assert!(
        r["error"]["message"]
            .as_str()
            .unwrap_or("")
            .contains("clientCapabilities"),
        "{r}"
    );
    raw.send(&modern(10, "tools/list", json!({})));
    assert_modern_result(&raw.response(10), true);
}

#[tokio::test]
async fn a_2025_era_client_gets_the_old_shapes_and_ping() {
    let mut d = Daemon::new();
    d.start();
    let mut raw = d.raw();
    raw.initialize();
    raw.send(&json!({"jsonrpc": "2.0", "id": 1, "method": "tools/list"}));
    let r = raw.response(1);
    assert!(r["result"]["tools"].is_array(), "{r}");
    for key in ["resultType", "ttlMs", "cacheScope"] {
        assert!(
            r["result"].get(key).is_none(),
            "{key} in a 2025-era result: {r}"
        );
    }
    raw.call(2, "session_list", json!({}));
    let r = raw.response(2);
    assert!(r["result"]["content"].is_array(), "{r}");
    assert!(r["result"].get("resultType").is_none(), "{r}");
    raw.send(&json!({"jsonrpc": "2.0", "id": 3, "method": "ping"}));
    let r = raw.response(3);
    assert_eq!(r["result"], json!({}), "{r}");
    raw.send(
        &json!({"jsonrpc": "2.0", "id": 4, "method": "resources/read",
                     "params": {"uri": "airlock://nope"}}),
    );
    let r = raw.response(4);
    assert_eq!(r["error"]["code"], json!(-32002), "{r}");
}

/// A 2026-07-28 request's `_meta` naming `name` as its client.
fn modern_as(id: i64, method: &str, mut params: Value, name: &str) -> Value {
    let mut meta = modern_meta();
    meta["io.modelcontextprotocol/clientInfo"] =
        json!({"name": name, "version": "V".repeat(5 * 1024), "title": "T".repeat(5 * 1024)});
    params["_meta"] = meta;
    json!({"jsonrpc": "2.0", "id": id, "method": method, "params": params})
}

/// The audit's client names of the connection's `session_list` calls, read by root.
fn clients_of_session_list(raw: &mut Raw, id: i64) -> Vec<String> {
    raw.send(&modern(
        id,
        "resources/read",
        json!({"uri": "airlock://audit/events?tool=session_list"}),
    ));
    let r = raw.response(id);
    let text = r["result"]["contents"][0]["text"].as_str().unwrap_or("[]");
    let events: Vec<Value> = serde_json::from_str(text).expect("audit events");
    events
        .iter()
        .map(|e| e["principal"]["client"].as_str().unwrap_or("").to_string())
        .collect()
}

#[tokio::test]
async fn a_2026_07_28_client_name_is_cut_like_the_handshakes_and_fixed_by_the_first_request() {
    let mut d = Daemon::new();
    d.start();
    let mut raw = d.raw();
    // 5 KiB names: the audit keeps 256 bytes and the marker, as for `initialize`.
    let first = "N".repeat(5 * 1024);
    raw.send(&modern_as(
        1,
        "tools/call",
        json!({"name": "session_list", "arguments": {}}),
        &first,
    ));
    assert_modern_result(&raw.response(1), false);
    let clients = clients_of_session_list(&mut raw, 2);
    assert_eq!(clients.len(), 3, "allow, start, done: {clients:?}");
    let cut = format!("{}…[truncated {} bytes]", "N".repeat(256), 5 * 1024 - 256);
    for c in &clients {
        assert_eq!(c, &cut, "the audit's client of a 5 KiB _meta name");
    }

    // Another client name on the same connection does not change what the audit records.
    raw.send(&modern_as(
        3,
        "tools/call",
        json!({"name": "session_list", "arguments": {}}),
        "impostor",
    ));
    assert_modern_result(&raw.response(3), false);
    let clients = clients_of_session_list(&mut raw, 4);
    assert_eq!(clients.len(), 6, "{clients:?}");
    assert!(
        clients.iter().all(|c| c == &cut),
        "a later request's client name reached the audit: {clients:?}"
    );
    assert!(
        !clients.iter().any(|c| c.contains("impostor")),
        "{clients:?}"
    );
    assert!(
        d.log_text()
            .contains("names another client than this connection's first"),
        "the mismatch is logged:\n{}",
        d.log_text()
    );

    // A fresh connection whose first request names a short client is recorded as such.
    let mut other = d.raw();
    other.send(&modern_as(
        1,
        "tools/call",
        json!({"name": "session_list", "arguments": {}}),
        "second-conn",
    ));
    assert_modern_result(&other.response(1), false);
    let clients = clients_of_session_list(&mut other, 2);
    assert_eq!(
        clients.iter().filter(|c| *c == "second-conn").count(),
        3,
        "{clients:?}"
    );
}

#[tokio::test]
async fn a_2025_era_client_name_is_cut_and_later_meta_names_do_not_replace_it() {
    let mut d = Daemon::new();
    d.start();
    let mut raw = d.raw();
    raw.send(
        &json!({"jsonrpc": "2.0", "id": 0, "method": "initialize", "params": {
        "protocolVersion": "2025-11-25", "capabilities": {},
        "clientInfo": {"name": "H".repeat(5 * 1024), "version": "0"}}}),
    );
    assert!(raw.response(0)["result"]["serverInfo"].is_object());
    raw.send(&json!({"jsonrpc": "2.0", "method": "notifications/initialized"}));
    // A request of this connection whose `_meta` names another client.
    raw.send(
        &json!({"jsonrpc": "2.0", "id": 1, "method": "tools/call", "params": {
        "name": "session_list", "arguments": {},
        "_meta": {"io.modelcontextprotocol/clientInfo": {"name": "impostor", "version": "0"}}}}),
    );
    let r = raw.response(1);
    assert_eq!(r["result"]["isError"], json!(false), "{r}");
    raw.send(
        &json!({"jsonrpc": "2.0", "id": 2, "method": "resources/read",
                     "params": {"uri": "airlock://audit/events?tool=session_list"}}),
    );
    let r = raw.response(2);
    let text = r["result"]["contents"][0]["text"].as_str().unwrap_or("[]");
    let events: Vec<Value> = serde_json::from_str(text).expect("audit events");
    assert!(!events.is_empty(), "{r}");
    let cut = format!("{}…[truncated {} bytes]", "H".repeat(256), 5 * 1024 - 256);
    for e in &events {
        assert_eq!(e["principal"]["client"], json!(cut), "{e}");
    }
}
