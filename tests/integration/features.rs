//! Optional MCP features over the real socket: tool titles and output schemas,
//! the text block that repeats `structuredContent`, and `notifications/progress` (the
//! daemon's phases and a worker's reports, bounded against a hostile worker).

use std::time::Instant;

use serde_json::{json, Value};

use crate::harness::*;

/// Checks `v` against the JSON Schema subset the daemon's output schemas use (`type`,
/// `properties`, `required`, `items`, `minimum`, `const`); every other keyword of a schema
/// fails the check, so a schema that grows past this subset is noticed here.
fn validate(schema: &Value, v: &Value, at: &str) -> Result<(), String> {
    let s = schema
        .as_object()
        .ok_or(format!("{at}: schema not an object"))?;
    for k in s.keys() {
        if !matches!(
            k.as_str(),
            "type" | "properties" | "required" | "items" | "minimum" | "const" | "description"
        ) {
            return Err(format!("{at}: keyword {k} not checked by this test"));
        }
    }
    if let Some(t) = s.get("type").and_then(Value::as_str) {
        let ok = match t {
            "object" => v.is_object(),
            "array" => v.is_array(),
            "string" => v.is_string(),
            "integer" => v.is_u64() || v.is_i64(),
            "number" => v.is_number(),
            "boolean" => v.is_boolean(),
            _ => false,
        };
        if !ok {
            return Err(format!("{at}: {v} is not of type {t}"));
        }
    }
    if let Some(c) = s.get("const") {
        if c != v {
            return Err(format!("{at}: {v} is not {c}"));
        }
    }
    if let Some(m) = s.get("minimum").and_then(Value::as_f64) {
        if v.as_f64().is_some_and(|x| x < m) {
            return Err(format!("{at}: {v} < {m}"));
        }
    }
    for r in s
        .get("required")
        .and_then(Value::as_array)
        .into_iter()
        .flatten()
    {
        let r = r.as_str().unwrap_or("");
        if v.get(r).is_none() {
            return Err(format!("{at}: missing {r}"));
        }
    }
    if let Some(props) = s.get("properties").and_then(Value::as_object) {
        for (k, ps) in props {
            if let Some(x) = v.get(k) {
                validate(ps, x, &format!("{at}.{k}"))?;
            }
        }
    }
    if let (Some(items), Some(a)) = (s.get("items"), v.as_array()) {
        for (i, x) in a.iter().enumerate() {
            validate(items, x, &format!("{at}[{i}]"))?;
        }
    }
    Ok(())
}

/// The text block a result must carry: `structuredContent`, serialized.
fn assert_repeats_structured(r: &Value) {
    let s = &r["structuredContent"];
    assert!(s.is_object(), "no structuredContent: {r}");
    let repeated = r["content"].as_array().into_iter().flatten().any(|b| {
        b["type"] == "text"
            && b["text"]
                .as_str()
                .and_then(|t| serde_json::from_str::<Value>(t).ok())
                .as_ref()
                == Some(s)
    });
    assert!(repeated, "no text block equals structuredContent: {r}");
}

#[tokio::test]
async fn tools_list_shows_titles_and_output_schemas_and_results_validate_against_them() {
    let mut d = Daemon::new();
    d.add_tool(
        "titled",
        r#"name = "titled"
title = "A titled read tool"
description = "Echo"
capability = "read"
command = ["/bin/echo", "hi"]
"#,
    );
    d.start();
    let mut raw = d.raw();
    raw.initialize();
    raw.send(&json!({"jsonrpc": "2.0", "id": 1, "method": "tools/list"}));
    let list = raw.response(1);
    let tools = list["result"]["tools"].as_array().expect("tools").clone();
    let tool = |n: &str| -> Value {
        tools
            .iter()
            .find(|t| t["name"] == n)
            .cloned()
            .unwrap_or_else(|| panic!("no tool {n}: {list}"))
    };
    assert_eq!(tool("titled")["title"], "A titled read tool");
    assert_eq!(tool("titled")["annotations"]["title"], "A titled read tool");
    // An external read tool returns only content: no schema is claimed for it.
    assert!(
        tool("titled").get("outputSchema").is_none(),
        "{}",
        tool("titled")
    );
    assert_eq!(tool("session_create")["title"], "Create session");
    for n in [
        "session_create",
        "session_destroy",
        "session_get",
        "session_list",
        "write_text",
    ] {
        assert_eq!(
            tool(n)["outputSchema"]["type"],
            "object",
            "{n}: {}",
            tool(n)
        );
    }

    let calls = [
        ("session_create", json!({"id": "f"})),
        (
            "write_text",
            json!({"session": "f", "text": "hello", "out": "a/b.txt"}),
        ),
        ("session_get", json!({"session": "f"})),
        ("session_list", json!({})),
        ("session_destroy", json!({"session": "f"})),
    ];
    for (i, (name, a)) in calls.into_iter().enumerate() {
        let id = 10 + i as i64;
        raw.call(id, name, a);
        let r = raw.response(id)["result"].clone();
        assert_eq!(r["isError"], false, "{name}: {r}");
        validate(&tool(name)["outputSchema"], &r["structuredContent"], name)
            .unwrap_or_else(|e| panic!("{name}: {e}: {r}"));
        assert_repeats_structured(&r);
    }
    assert_eq!(d.read("a/b.txt").as_deref(), Some("hello"));

    // A tool fault carries its structured error, repeated as text too.
    raw.call(20, "session_get", json!({"session": "nope"}));
    let r = raw.response(20)["result"].clone();
    assert_eq!(r["isError"], true, "{r}");
    assert_repeats_structured(&r);

    // An external read tool's text is its stdout, and nothing else.
    raw.call(21, "titled", json!({}));
    let r = raw.response(21)["result"].clone();
    assert_eq!(
        r["content"],
        json!([{"type": "text", "text": "hi\n"}]),
        "{r}"
    );
    assert!(r.get("structuredContent").is_none(), "{r}");
}

/// A write tool that reports twice on its progress descriptor, or says it has none.
const REPORTER: &str = r#"name = "reporter"
description = "Reports progress, then writes where its progress fd was"
capability = "write"
command = ["/bin/sh", "-c", '''
fd="${AIRLOCK_PROGRESS_FD:-none}"
if [ "$fd" != none ]; then
  printf '{"progress": 1, "total": 2, "message": "half"}\n' >&"$fd"
  sleep 0.3
  printf '{"progress": 2, "total": 2, "message": "done"}\n' >&"$fd"
  sleep 0.3
fi
printf 'fd=%s' "$fd" > "$1"
''', "reporter", "{out}"]
timeout = "20s"

[params.out]
type = "string"
path = "output"
"#;

/// Sends a `tools/call` (with `_meta` when given) and returns the messages up to and
/// including its response.
fn call_collect(raw: &mut Raw, id: i64, tool: &str, a: Value, meta: Option<Value>) -> Vec<Value> {
    let mut params = json!({"name": tool, "arguments": a});
    if let Some(m) = meta {
        params["_meta"] = m;
    }
    raw.send(&json!({"jsonrpc": "2.0", "id": id, "method": "tools/call", "params": params}));
    let mut got = Vec::new();
    loop {
        let m = raw.recv();
        let done = m["id"] == json!(id);
        got.push(m);
        if done {
            return got;
        }
    }
}

#[tokio::test]
async fn progress_notifications_follow_the_phases_under_the_clients_token_and_only_then() {
    let mut d = Daemon::new();
    d.add_tool("reporter", REPORTER);
    d.start();
    let mut raw = d.raw();
    raw.initialize();
    raw.call(1, "session_create", json!({"id": "p"}));
    raw.response(1);

    let got = call_collect(
        &mut raw,
        2,
        "reporter",
        json!({"session": "p", "out": "with.txt"}),
        Some(json!({"progressToken": "tok-7"})),
    );
    let (notes, reply) = got.split_at(got.len() - 1);
    assert_eq!(reply[0]["result"]["isError"], false, "{got:?}");
    let mut last = 0.0;
    let mut messages = Vec::new();
    for n in notes {
        assert_eq!(n["method"], "notifications/progress", "{n}");
        assert_eq!(n["params"]["progressToken"], "tok-7", "{n}");
        let p = n["params"]["progress"].as_f64().expect("progress");
        assert!(p > last, "progress must increase: {got:?}");
        last = p;
        messages.push(
            n["params"]["message"]
                .as_str()
                .expect("message")
                .to_string(),
        );
    }
    assert_eq!(
        messages,
        [
            "queued",
            "running",
            "running: 1/2 half",
            "running: 2/2 done",
            "publishing"
        ],
        "{got:?}"
    );
    assert_eq!(
        d.read("with.txt").as_deref().map(|s| s.starts_with("fd=")),
        Some(true)
    );

    // Without a token: no notification, and the worker gets no progress descriptor.
    let got = call_collect(
        &mut raw,
        3,
        "reporter",
        json!({"session": "p", "out": "without.txt"}),
        None,
    );
    assert_eq!(
        got.len(),
        1,
        "notifications without a progressToken: {got:?}"
    );
    assert_eq!(d.read("without.txt").as_deref(), Some("fd=none"));

    // A built-in reports that it was queued, nothing more.
    let got = call_collect(
        &mut raw,
        4,
        "session_list",
        json!({}),
        Some(json!({"progressToken": 99})),
    );
    assert_eq!(got.len(), 2, "{got:?}");
    assert_eq!(got[0]["params"]["progressToken"], 99);
    assert_eq!(got[0]["params"]["message"], "queued");
}

/// Bytes the process has read with read(2) and the like, pipes included.
fn rchar(pid: u32) -> u64 {
    let io = std::fs::read_to_string(format!("/proc/{pid}/io")).expect("/proc/PID/io");
    io.lines()
        .find_map(|l| l.strip_prefix("rchar: "))
        .and_then(|v| v.trim().parse().ok())
        .expect("rchar")
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_hostile_progress_writer_cannot_flood_stall_or_confuse_the_daemon() {
    let mut d = Daemon::new();
    // Invalid UTF-8, a 300 KB line, a line that is JSON but not a report, then a flood of
    // valid reports from a child that keeps the descriptor open and never stops; the leader
    // exits after 2 s with its output written.
    d.add_tool(
        "flooder",
        r#"name = "flooder"
description = "Hostile progress writer"
capability = "write"
command = ["/bin/sh", "-c", '''
fd="$AIRLOCK_PROGRESS_FD"
printf '\377\376 not utf-8\n' >&"$fd"
head -c 300000 /dev/zero | tr '\0' x >&"$fd"
printf '\n{"progress": "NaN"}\n' >&"$fd"
yes '{"progress": 5, "message": "flood-marker-41"}' >&"$fd" &
sleep 2
printf done > "$1"
''', "flooder", "{out}"]
timeout = "30s"

[params.out]
type = "string"
path = "output"
"#,
    );
    d.start();
    let mut raw = d.raw();
    raw.initialize();
    raw.call(1, "session_create", json!({"id": "h"}));
    raw.response(1);

    let before = rchar(d.pid());
    let started = Instant::now();
    let got = call_collect(
        &mut raw,
        2,
        "flooder",
        json!({"session": "h", "out": "o.txt"}),
        Some(json!({"progressToken": "t"})),
    );
    let took = started.elapsed();
    let read = rchar(d.pid()) - before;

    let (notes, reply) = got.split_at(got.len() - 1);
    assert_eq!(reply[0]["result"]["isError"], false, "{:?}", reply[0]);
    assert_eq!(d.read("o.txt").as_deref(), Some("done"));
    // The reports were coalesced: at most one worker report per 100 ms of the call, plus
    // the three phases.
    let bound = 3 + (took.as_millis() / 100) as usize + 1;
    assert!(
        notes.len() <= bound,
        "{} notifications in {took:?} (bound {bound})",
        notes.len()
    );
    let worker: Vec<&str> = notes
        .iter()
        .filter_map(|n| n["params"]["message"].as_str())
        .filter(|m| m.starts_with("running: "))
        .collect();
    assert!(!worker.is_empty(), "no flood report forwarded: {notes:?}");
    for m in &worker {
        assert_eq!(
            *m, "running: 5 flood-marker-41",
            "only well-formed reports pass: {notes:?}"
        );
    }
    // The daemon read about its budget (16 KiB per 100 ms) of the worker's unbounded output,
    // not the flood (`yes` writes hundreds of MB a second to a pipe that is read): the
    // flooder blocked on its own full pipe. (`rchar` also counts the daemon's /proc scans.)
    let budget = 16 * 1024 * (took.as_millis() as u64 / 100 + 2);
    assert!(
        read < budget + 3 * 1024 * 1024,
        "the daemon read {read} bytes in {took:?} (budget {budget})"
    );
    // The flooding child is gone with its group, and the daemon still serves.
    wait_no_process("flood-marker-41").await;
    raw.call(3, "session_get", json!({"session": "h"}));
    assert_eq!(raw.response(3)["result"]["structuredContent"]["version"], 1);
}
