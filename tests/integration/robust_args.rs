//! Arguments reach tools as data, are bounded before anything is created, and a `json`
//! worker's response is checked whole before anything is published.

use serde_json::{json, Value};

use crate::harness::*;

/// The members of a ustar/GNU tar archive: (name, content), regular files only.
fn tar_members(bytes: &[u8]) -> Vec<(String, Vec<u8>)> {
    let mut out = Vec::new();
    let mut at = 0;
    while at + 512 <= bytes.len() {
        let h = &bytes[at..at + 512];
        if h.iter().all(|&b| b == 0) {
            break;
        }
        let name_end = h[..100].iter().position(|&b| b == 0).unwrap_or(100);
        let name = String::from_utf8_lossy(&h[..name_end]).into_owned();
        let size_field = String::from_utf8_lossy(&h[124..136]);
        let size = usize::from_str_radix(size_field.trim_matches(|c| c == '\0' || c == ' '), 8)
            .unwrap_or_else(|e| panic!("tar header of {name:?}: bad size {size_field:?}: {e}"));
        let body = at + 512;
        if h[156] == b'0' || h[156] == 0 {
            out.push((name, bytes[body..body + size].to_vec()));
        }
        at = body + size.div_ceil(512) * 512;
    }
    out
}

/// Files named like options reach the shipped tools as files: `archive` (tar, where such a
/// name once became `-T -` or `--version`), `upper` and `cat`.
#[tokio::test(flavor = "multi_thread")]
async fn files_named_like_options_are_treated_as_files() {
    crate::harness::require_program("tar", "tar");
    let mut d = Daemon::new();
    d.start();
    let c = d.client().await;
    session(&c, "opt").await;
    let names = ["-T-", "--version", "-", "--files-from=x", "-C"];
    for (i, name) in names.iter().enumerate() {
        let content = format!("content of {name}\n");
        d.write(name, &content);
        let out = format!("a{i}.tar");
        let r = call(
            &c,
            "archive",
            json!({"session": "opt", "source": name, "out": out}),
        )
        .await;
        assert!(!is_error(&r), "archive {name:?}: {r}");
        let tar = std::fs::read(d.workspace.join(&out)).expect("the archive is published");
        assert_eq!(
            tar_members(&tar),
            vec![(name.to_string(), content.clone().into_bytes())],
            "archive {name:?} holds exactly that file"
        );

        let upper = format!("-u{i}");
        let r = call(
            &c,
            "upper",
            json!({"session": "opt", "source": name, "out": upper}),
        )
        .await;
        assert!(!is_error(&r), "upper {name:?}: {r}");
        assert_eq!(
            d.read(&upper),
            Some(content.to_uppercase()),
            "upper {name:?}"
        );

        let r = call(&c, "cat", json!({"path": name})).await;
        assert!(!is_error(&r), "cat {name:?}: {r}");
        assert_eq!(text(&r), content, "cat {name:?}");
    }
    assert_eq!(version(&c, "opt").await, 2 * names.len() as u64);
    assert!(d.job_dirs().is_empty(), "{:?}", d.job_dirs());
}

/// A value holding `{out}` or `{session}` is passed as those very characters: substitution
/// is one pass over the template, never over a value.
#[tokio::test(flavor = "multi_thread")]
async fn a_value_holding_a_placeholder_is_not_expanded_again() {
    let mut d = Daemon::new();
    d.add_tool(
        "echo_args",
        r#"
name = "echo_args"
description = "Write one command-line element, built from several placeholders, to a file"
capability = "write"
command = ["/bin/sh", "-c", "printf '%s' \"$1\" > \"$2\"", "echo_args", "text={text} session={session} n={n}", "{out}"]
timeout = "10s"

[params.text]
type = "string"

[params.n]
type = "string"

[params.out]
type = "string"
path = "output"
"#,
    );
    d.start();
    let c = d.client().await;
    session(&c, "s1").await;
    let r = call(
        &c,
        "echo_args",
        json!({"session": "s1", "text": "{out} {session} {n}", "n": "{text}", "out": "o.txt"}),
    )
    .await;
    assert!(!is_error(&r), "{r}");
    assert_eq!(
        d.read("o.txt").as_deref(),
        Some("text={out} {session} {n} session=s1 n={text}")
    );
}

/// Every bound on what a client sends is checked before anything is created: the reply is
/// `INVALID_ARGUMENT` naming the argument and the limit, no failpoint of a job dir or a
/// session file is reached, no worker is spawned, and the daemon keeps serving.
#[tokio::test(flavor = "multi_thread")]
async fn oversized_arguments_are_refused_before_anything_is_created() {
    let mut d = Daemon::new();
    let log = d.dir.path().join("failpoints.log");
    d.env = vec![("AIRLOCK_FAILPOINT_LOG".into(), log.display().to_string())];
    d.add_tool(
        "many_args",
        r#"
name = "many_args"
description = "Take ten command-line arguments"
capability = "write"
command = ["/bin/true", "{a}", "{b}", "{c}", "{d}", "{e}", "{f}", "{g}", "{h}", "{i}", "{j}"]
timeout = "10s"
[params.a]
type = "string"
[params.b]
type = "string"
[params.c]
type = "string"
[params.d]
type = "string"
[params.e]
type = "string"
[params.f]
type = "string"
[params.g]
type = "string"
[params.h]
type = "string"
[params.i]
type = "string"
[params.j]
type = "string"
"#,
    );
    d.add_tool(
        "json_echo",
        r#"
name = "json_echo"
description = "A json tool"
capability = "write"
protocol = "json"
command = ["/usr/bin/python3", "-I", "-c", "import sys; sys.stdin.read(); print('{}')"]
timeout = "10s"
[params.blob]
type = "string"
"#,
    );
    // The state bound is raised past the json request's bound, which is the one tested.
    set_daemon(
        &d,
        &[
            ("max_session_state_bytes", "\"4MiB\""),
            ("max_state_bytes_per_principal", "\"16MiB\""),
        ],
    );
    d.start();
    let c = d.client().await;
    // A session whose state is large: a json request carries it.
    let big_state = "s".repeat(3 << 20);
    let r = call(
        &c,
        "session_create",
        json!({"id": "big", "state": {"blob": big_state}}),
    )
    .await;
    assert!(!is_error(&r), "{r}");
    session(&c, "b").await;
    let points_before = std::fs::read_to_string(&log).unwrap_or_default();
    assert!(
        points_before.contains("session.write"),
        "no failpoint was logged: is the binary built with --features failpoints?"
    );

    let mib3 = "x".repeat(3 << 20);
    let kib200 = "x".repeat(200 << 10);
    let kib120 = "x".repeat(120 << 10);
    let huge_id = "i".repeat(3 << 20);
    let ten: Value = ["a", "b", "c", "d", "e", "f", "g", "h", "i", "j"]
        .iter()
        .map(|k| (k.to_string(), Value::String(kib120.clone())))
        .chain([("session".to_string(), json!("b"))])
        .collect::<serde_json::Map<_, _>>()
        .into();
    let cases: Vec<(&str, Value, Vec<String>)> = vec![
        (
            "write_text",
            json!({"session": "b", "text": mib3, "out": "t.txt"}),
            vec![
                "argument \"text\" is 3145728 bytes".into(),
                "at most 1048576 bytes".into(),
            ],
        ),
        (
            "write_text",
            json!({"session": "b", "text": kib200, "out": "t.txt"}),
            vec![
                "argument \"text\" is 204800 bytes".into(),
                "an argument passed on the command line may be at most 126975 bytes".into(),
            ],
        ),
        (
            "many_args",
            ten,
            vec![
                "many_args's command line would be".into(),
                "it may be at most 1048576 bytes".into(),
            ],
        ),
        (
            "write_text",
            json!({"session": "b", "text": "x", "out": "o".repeat(5000)}),
            vec!["argument \"out\" is 5000 bytes; a path may be at most 4095 bytes".into()],
        ),
        (
            "json_echo",
            json!({"session": "big", "blob": "y".repeat(1 << 20)}),
            vec![
                "the JSON request to json_echo would be".into(),
                "session state 3145739 bytes".into(),
                "at most 4194304 bytes (max_message_size".into(),
            ],
        ),
        (
            "write_text",
            json!({"session": huge_id, "text": "x", "out": "t.txt"}),
            vec![
                "argument \"session\": session id".into(),
                "is 3145728 bytes; a session id is at most 64 bytes".into(),
            ],
        ),
        (
            "write_text",
            json!({"session": "../b", "text": "x", "out": "t.txt"}),
            vec!["holds '.' at byte 0".into()],
        ),
        (
            "session_get",
            json!({"session": huge_id}),
            vec!["argument \"session\": session id".into()],
        ),
        (
            "session_destroy",
            json!({"session": "b/../big"}),
            vec!["holds '/' at byte 1".into()],
        ),
        (
            "session_create",
            json!({"id": "a b"}),
            vec!["argument \"id\": session id \"a b\" holds ' ' at byte 1".into()],
        ),
    ];
    let mut raw = d.raw();
    raw.initialize();
    for (i, (tool, a, needles)) in cases.iter().enumerate() {
        let id = 100 + i as i64;
        raw.call(id, tool, a.clone());
        let r = raw.response(id);
        let result = &r["result"];
        assert_eq!(result["isError"], true, "{tool} case {i}: {}", r["error"]);
        assert_eq!(code(result), "INVALID_ARGUMENT", "{tool} case {i}");
        let msg = text(result);
        for n in needles {
            assert!(
                msg.contains(n.as_str()),
                "{tool} case {i}: {msg:?} does not say {n:?}"
            );
        }
        assert!(
            msg.len() < 600,
            "{tool} case {i}: the message echoes the argument ({} bytes)",
            msg.len()
        );
    }

    // Nothing was created: no failpoint reached (no job dir, no journal, no session file),
    // no worker spawned, no commit, the workspace and the sessions as they were.
    let points_after = std::fs::read_to_string(&log).unwrap_or_default();
    assert_eq!(
        points_after, points_before,
        "a rejected call touched the disk"
    );
    let events = audit(&c).await;
    for kind in ["start", "commit"] {
        let found: Vec<&Value> = events
            .iter()
            .filter(|e| e["kind"] == kind && e["tool"] != "session_create")
            .collect();
        assert!(found.is_empty(), "{kind} events: {found:#?}");
    }
    assert!(
        events.iter().all(|e| e.to_string().len() < 4096),
        "an audit event holds a client's megabytes"
    );
    assert_eq!(snapshot(&d.workspace), Vec::new());
    assert_eq!(version(&c, "b").await, 0);
    assert_eq!(version(&c, "big").await, 0);

    // The same calls within their bounds run, and reach the disk.
    let r = call(
        &c,
        "write_text",
        json!({"session": "b", "text": "x".repeat(120 << 10), "out": "t.txt"}),
    )
    .await;
    assert!(!is_error(&r), "{}", text(&r));
    assert_eq!(d.read("t.txt").map(|s| s.len()), Some(120 << 10));
    let r = call(
        &c,
        "json_echo",
        json!({"session": "b", "blob": "y".repeat(1 << 20)}),
    )
    .await;
    assert!(!is_error(&r), "{}", text(&r));
    let points = std::fs::read_to_string(&log).unwrap_or_default();
    assert!(points.contains("publish.mkdir_job"), "{points}");
    assert_eq!(version(&c, "b").await, 2);
}

/// One `json` tool that writes its output and then answers with the response chosen by
/// `variant`.
const JSON_REPLIER: &str = r#"
name = "json_replier"
description = "Write the note, then answer with a chosen response"
capability = "write"
protocol = "json"
timeout = "10s"
command = ["/usr/bin/python3", "-I", "-c", """
import json, sys
req = json.load(sys.stdin)
with open(req["arguments"]["note"], "w") as f:
    f.write("written\\n")
ok = {"type": "text", "text": "ok"}
state = {"n": req["session"]["version"] + 1}
responses = [
    {"content": [ok, {"type": "bogus"}], "state": state},
    {"content": [{"type": "image", "data": "not base64!", "mimeType": "image/png"}], "state": state},
    {"content": [{"type": "text"}], "state": state},
    {"content": [{"type": "resource", "resource": {"text": "no uri"}}]},
    {"content": [ok], "state": state, "isError": "no"},
    {"content": [ok], "state": state, "structuredContent": {"k": 1}},
    {"content": [ok], "state": [1, 2]},
    {"content": {"type": "text", "text": "not an array"}},
    {"content": [{"type": "text", "text": "x", "annotations": {"priority": 9}}]},
    {"isError": True, "content": [{"type": "audio"}]},
    {"content": [
        ok,
        {"type": "image", "data": "aGk=", "mimeType": "image/png"},
        {"type": "resource_link", "uri": "file:///w/note", "name": "note"},
        {"type": "resource", "resource": {"uri": "file:///w/note", "blob": "AAEC"}},
    ], "state": state},
]
json.dump(responses[req["arguments"]["variant"]], sys.stdout)
"""]

[params.variant]
type = "integer"

[params.note]
type = "string"
path = "output"
"#;

/// An invalid response, content blocks included, is `TOOL_FAILED`: a tool result (never a
/// JSON-RPC error), nothing published, the session's version and state unchanged; a valid
/// one with every kind of block commits and reaches the client as sent.
#[tokio::test(flavor = "multi_thread")]
async fn an_invalid_json_response_publishes_nothing_and_keeps_the_version() {
    let mut d = Daemon::new();
    d.add_tool("json_replier", JSON_REPLIER);
    d.start();
    let c = d.client().await;
    session(&c, "j").await;
    let reasons = [
        "content[1] is not a valid MCP content block: unknown type \"bogus\"",
        "content[0] is not a valid MCP content block: image.data: is not base64",
        "content[0] is not a valid MCP content block: text has no \"text\"",
        "resource has no \"uri\"",
        "\"isError\" must be a boolean, not a string",
        "unknown key \"structuredContent\"",
        "\"state\" must be an object, not an array",
        "\"content\" must be an array of content blocks, not an object",
        "priority must be a number from 0 to 1",
        "content[0] is not a valid MCP content block: audio has no \"data\"",
    ];
    let mut raw = d.raw();
    raw.initialize();
    for (variant, reason) in reasons.iter().enumerate() {
        let id = 10 + variant as i64;
        raw.call(
            id,
            "json_replier",
            json!({"session": "j", "variant": variant, "note": "note.txt"}),
        );
        let r = raw.response(id);
        assert!(
            r.get("error").is_none(),
            "variant {variant}: a JSON-RPC error: {r}"
        );
        let result = &r["result"];
        assert_eq!(result["isError"], true, "variant {variant}: {r}");
        assert_eq!(code(result), "TOOL_FAILED", "variant {variant}: {r}");
        let msg = text(result);
        assert!(
            msg.contains(reason),
            "variant {variant}: {msg:?} does not say {reason:?}"
        );
        assert!(msg.contains("nothing was published"), "{msg}");
        assert_eq!(
            d.read("note.txt"),
            None,
            "variant {variant} published its output"
        );
        assert!(
            d.job_dirs().is_empty(),
            "variant {variant}: {:?}",
            d.job_dirs()
        );
        assert_eq!(version(&c, "j").await, 0, "variant {variant} committed");
    }
    let r = call(&c, "session_get", json!({"session": "j"})).await;
    assert_eq!(r["structuredContent"]["state"], json!({}), "{r}");
    let events = audit(&c).await;
    assert!(
        !events
            .iter()
            .any(|e| e["tool"] == "json_replier" && e["kind"] == "commit"),
        "an invalid response was committed"
    );

    // Every kind of valid block commits, and reaches the client as the tool wrote it.
    let r = call(
        &c,
        "json_replier",
        json!({"session": "j", "variant": reasons.len(), "note": "note.txt"}),
    )
    .await;
    assert!(!is_error(&r), "{r}");
    let kinds: Vec<&str> = r["content"]
        .as_array()
        .map(|a| a.iter().filter_map(|b| b["type"].as_str()).collect())
        .unwrap_or_default();
    // The tool's blocks, then the daemon's text block repeating `structuredContent`.
    assert_eq!(
        kinds,
        ["text", "image", "resource_link", "resource", "text"]
    );
    assert_eq!(
        r["content"][4]["text"].as_str(),
        Some(r["structuredContent"].to_string().as_str()),
        "{r}"
    );
    assert_eq!(r["content"][3]["resource"]["blob"], "AAEC");
    assert_eq!(d.read("note.txt").as_deref(), Some("written\n"));
    assert_eq!(version(&c, "j").await, 1);

    // The daemon still serves and restarts with the session as committed.
    d.stop();
    d.start();
    let c = d.client().await;
    let r = call(&c, "session_get", json!({"session": "j"})).await;
    assert_eq!(r["structuredContent"]["version"], 1, "{r}");
    assert_eq!(r["structuredContent"]["state"]["n"], 1, "{r}");
}

/// An integer argument beyond every integer type (JSON reads `18446744073709551616` or `1e30`
/// as a floating-point number) is `INVALID_ARGUMENT` naming the range, not "must be an
/// integer, not a number"; a fraction still says that; nothing runs and the version stays.
#[tokio::test(flavor = "multi_thread")]
async fn an_integer_too_large_for_any_integer_type_names_the_range() {
    crate::harness::require_program("/usr/bin/python3", "python3");
    let mut d = Daemon::new();
    d.start();
    let c = d.client().await;
    session(&c, "n").await;
    let mut raw = d.raw();
    raw.initialize();
    let range = format!(
        "INVALID_ARGUMENT: argument \"by\" must be an integer between {} and {}, not ",
        i64::MIN,
        u64::MAX
    );
    // Sent as the client wrote them: a serde_json::Value would already be a float.
    let cases = [
        ("18446744073709551616", range.as_str()),
        ("1e30", range.as_str()),
        ("-9223372036854775809", range.as_str()),
        (
            "2.5",
            "INVALID_ARGUMENT: argument \"by\" must be an integer, not a number",
        ),
    ];
    for (id, (literal, want)) in (1..).zip(cases) {
        raw.send_bytes(
            format!(
                "{{\"jsonrpc\":\"2.0\",\"id\":{id},\"method\":\"tools/call\",\"params\":\
                 {{\"name\":\"counter\",\"arguments\":{{\"session\":\"n\",\"by\":{literal}}}}}}}\n"
            )
            .as_bytes(),
        );
        let r = raw.response(id);
        let result = &r["result"];
        assert_eq!(result["isError"], true, "{literal}: {r}");
        let t = result["content"][0]["text"].as_str().unwrap_or_default();
        assert!(t.starts_with(want), "{literal}: {t}");
    }
    assert_eq!(version(&c, "n").await, 0);
    let r = call(&c, "counter", json!({"session": "n", "by": 2})).await;
    assert_eq!(text(&r), "counter is 2", "{r}");
    assert!(d.job_dirs().is_empty(), "{:?}", d.job_dirs());
}
