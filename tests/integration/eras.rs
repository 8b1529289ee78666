//! Both protocol eras over the real socket (#10 point 1): a 2025-era client negotiates with
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
