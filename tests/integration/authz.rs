//! Grants, session ownership, the audit resource's guard and secret
//! parameters, over the real socket. The test process is root (granted everything by the
//! shipped airlock.toml); the other principal is a real client process running as `nobody`
//! (`setpriv` + `airlock connect`), so the daemon sees uid 65534 in SO_PEERCRED.

use std::process::Stdio;

use rmcp::model::ReadResourceRequestParams;
use rmcp::ServiceExt;
use serde_json::{json, Value};

use crate::harness::*;

pub(crate) const NOBODY: u32 = 65534;

/// A daemon whose socket any local user may open, with `grants` (TOML `[[grant]]` tables)
/// added to the shipped ones.
pub(crate) fn daemon(grants: &str) -> Daemon {
    require_root_for("the daemon must see a client of another uid");
    let d = Daemon::new();
    let path = d.policies.join("airlock.toml");
    let text = std::fs::read_to_string(&path).expect("airlock.toml");
    assert!(
        text.contains("socket_mode = \"0600\""),
        "shipped socket_mode moved"
    );
    let text = text.replace("socket_mode = \"0600\"", "socket_mode = \"0666\"");
    // `[[grant]]` tables go first: every table before `[daemon]`.
    std::fs::write(&path, format!("{grants}\n{text}")).expect("write airlock.toml");
    d
}

/// An MCP client whose connection belongs to `nobody`: `airlock connect` run under setpriv,
/// spoken to over its stdio.
pub(crate) struct Foreign {
    pub(crate) client: Client,
    pub(crate) _child: tokio::process::Child,
}

pub(crate) async fn as_nobody(d: &Daemon) -> Foreign {
    as_nobody_in(d, &[]).await
}

/// `nobody` with these supplementary groups.
async fn as_nobody_in(d: &Daemon, groups: &[u32]) -> Foreign {
    let groups = if groups.is_empty() {
        "--clear-groups".to_string()
    } else {
        let g: Vec<String> = groups.iter().map(u32::to_string).collect();
        format!("--groups={}", g.join(","))
    };
    let mut child = tokio::process::Command::from(connect_as(d, NOBODY, &groups))
        .stderr(Stdio::inherit())
        .kill_on_drop(true)
        .spawn()
        .expect("setpriv airlock connect (util-linux setpriv is needed)");
    let out = child.stdout.take().expect("stdout");
    let inp = child.stdin.take().expect("stdin");
    let client = ().serve((out, inp)).await.expect("MCP handshake as nobody");
    Foreign {
        client,
        _child: child,
    }
}

/// The audit events of uid `uid` for `tool` (read by root, which holds admin).
pub(crate) async fn events_of(root: &Client, uid: u32, tool: &str) -> Vec<Value> {
    audit(root)
        .await
        .into_iter()
        .filter(|e| e["principal"]["uid"] == json!(uid) && e["tool"] == json!(tool))
        .collect()
}

fn session_file(d: &Daemon, id: &str) -> Option<Value> {
    let text = std::fs::read_to_string(d.state.join("sessions").join(format!("{id}.json"))).ok()?;
    serde_json::from_str(&text).ok()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_ungranted_uid_sees_no_tool_and_every_call_is_denied() {
    let mut d = daemon("");
    d.start();
    let root = d.client().await;
    let nobody = as_nobody(&d).await;
    let c = &nobody.client;

    assert_eq!(tool_names(c).await, Vec::<String>::new(), "tools/list");
    assert!(
        tool_names(&root)
            .await
            .contains(&"session_create".to_string()),
        "root (granted by the shipped airlock.toml) lists the tools"
    );
    let r = call(c, "session_create", json!({"id": "intruder"})).await;
    assert!(is_error(&r), "{r}");
    assert_eq!(code(&r), "TOOL_FORBIDDEN", "{r}");
    assert!(text(&r).contains("uid 65534"), "{r}");
    assert!(
        session_file(&d, "intruder").is_none(),
        "nothing was created"
    );
    let r = call(
        c,
        "write_text",
        json!({"session": "x", "text": "t", "out": "o.txt"}),
    )
    .await;
    assert_eq!(code(&r), "TOOL_FORBIDDEN", "{r}");
    assert!(d.read("o.txt").is_none());
    assert!(d.job_dirs().is_empty());

    // Each denial is one `deny` event with the code, and nothing else for that call.
    let ev = events_of(&root, NOBODY, "session_create").await;
    let kinds: Vec<&str> = ev.iter().filter_map(|e| e["kind"].as_str()).collect();
    assert_eq!(kinds, ["deny"], "{ev:?}");
    assert_eq!(ev[0]["detail"]["code"], "TOOL_FORBIDDEN", "{ev:?}");

    // The audit resource: not listed, and a read is refused (and audited).
    let listed = c.list_all_resources().await.expect("resources/list");
    assert!(listed.is_empty(), "{listed:?}");
    let err = c
        .read_resource(ReadResourceRequestParams::new("airlock://audit/events"))
        .await
        .expect_err("nobody read the audit");
    assert!(err.to_string().contains("AUDIT_FORBIDDEN"), "{err}");
    let ev = events_of(&root, NOBODY, "resources/read").await;
    assert_eq!(ev.len(), 1, "{ev:?}");
    assert_eq!(ev[0]["kind"], "deny");
    // Nor its template, a filtered read, or a subscription (which would tell the timing of
    // every call).
    let templates = c
        .list_all_resource_templates()
        .await
        .expect("resources/templates/list");
    assert!(templates.is_empty(), "{templates:?}");
    let err = c
        .read_resource(ReadResourceRequestParams::new(
            "airlock://audit/events?tool=session_create",
        ))
        .await
        .expect_err("nobody read the filtered audit");
    assert!(err.to_string().contains("AUDIT_FORBIDDEN"), "{err}");
    // The client negotiates the 2025 era here, where `resources/subscribe` is the way.
    #[allow(deprecated)]
    let err = c
        .subscribe(rmcp::model::SubscribeRequestParams::new(
            "airlock://audit/events",
        ))
        .await
        .expect_err("nobody subscribed to the audit");
    assert!(err.to_string().contains("AUDIT_FORBIDDEN"), "{err}");
    assert_eq!(
        events_of(&root, NOBODY, "resources/subscribe").await.len(),
        1
    );
    // The denials are in the durable log too, as the resource shows them.
    let log = std::fs::read_to_string(d.state.join("audit.jsonl")).expect("audit log");
    let denied: Vec<Value> = log
        .lines()
        .filter_map(|l| serde_json::from_str::<Value>(l).ok())
        .filter(|e| e["principal"]["uid"] == json!(NOBODY) && e["kind"] == "deny")
        .collect();
    assert_eq!(denied.len(), 5, "{denied:?}");
    // The connection keeps serving.
    assert_eq!(tool_names(c).await, Vec::<String>::new());
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn tools_list_and_calls_follow_the_grant() {
    let mut d = daemon(&format!(
        "[[grant]]\nuids = [{NOBODY}]\ncapabilities = [\"read\"]\ntools = [\"session_get\", \"session_list\"]\n"
    ));
    d.start();
    let root = d.client().await;
    session(&root, "r1").await;
    let nobody = as_nobody(&d).await;
    let c = &nobody.client;
    assert_eq!(tool_names(c).await, ["session_get", "session_list"]);
    // Write tools (the grant gives only read): denied.
    for (tool, a) in [
        ("upper", json!({"source": "x"})),
        ("session_create", json!({"id": "n1"})),
    ] {
        let r = call(c, tool, a).await;
        assert_eq!(code(&r), "TOOL_FORBIDDEN", "{tool}: {r}");
    }
    assert!(session_file(&d, "n1").is_none());
    // A granted tool runs, but root's session is not nobody's.
    let r = call(c, "session_list", json!({})).await;
    assert!(!is_error(&r), "{r}");
    assert_eq!(r["structuredContent"]["sessions"], json!([]), "{r}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sessions_belong_to_their_creator_unless_admin() {
    let mut d = daemon(&format!(
        "[[grant]]\nuids = [{NOBODY}]\ncapabilities = [\"read\", \"write\"]\n"
    ));
    d.start();
    let root = d.client().await;
    session(&root, "rootsess").await;
    let nobody = as_nobody(&d).await;
    let c = &nobody.client;

    // Every call naming root's session is SESSION_FORBIDDEN, and changes nothing.
    let forbidden = [
        ("session_get", json!({"session": "rootsess"})),
        (
            "write_text",
            json!({"session": "rootsess", "text": "pwned", "out": "p.txt"}),
        ),
        ("session_destroy", json!({"session": "rootsess"})),
        ("session_create", json!({"id": "rootsess"})),
    ];
    for (tool, a) in &forbidden {
        let r = call(c, tool, a.clone()).await;
        assert_eq!(code(&r), "SESSION_FORBIDDEN", "{tool}: {r}");
        assert!(!text(&r).contains("\"version\""), "no state leaks: {r}");
    }
    assert!(d.read("p.txt").is_none(), "nothing published");
    assert!(d.job_dirs().is_empty());
    assert_eq!(
        version(&root, "rootsess").await,
        0,
        "root's session untouched"
    );
    let file = session_file(&d, "rootsess").expect("root's session file");
    assert_eq!(file["owner"], json!(0), "{file}");
    assert_eq!(file["destroyed"], json!(false));
    let r = call(c, "session_list", json!({})).await;
    assert_eq!(r["structuredContent"]["sessions"], json!([]), "{r}");
    let denies: Vec<Value> = audit(&root)
        .await
        .into_iter()
        .filter(|e| e["principal"]["uid"] == json!(NOBODY) && e["kind"] == "deny")
        .collect();
    assert_eq!(denies.len(), 4, "{denies:?}");
    assert!(denies
        .iter()
        .all(|e| e["detail"]["code"] == "SESSION_FORBIDDEN"));

    // nobody's own session works for nobody; root, holding admin, may use it too.
    session(c, "mine").await;
    let r = call(
        c,
        "write_text",
        json!({"session": "mine", "text": "hello", "out": "mine.txt"}),
    )
    .await;
    assert!(!is_error(&r), "{r}");
    assert_eq!(d.read("mine.txt").as_deref(), Some("hello"));
    assert_eq!(version(c, "mine").await, 1);
    let r = call(c, "session_list", json!({})).await;
    assert_eq!(
        r["structuredContent"]["sessions"],
        json!([{"id": "mine", "version": 1, "owner": NOBODY}]),
        "{r}"
    );
    assert_eq!(version(&root, "mine").await, 1, "admin override");
    let all = call(&root, "session_list", json!({})).await;
    assert_eq!(
        all["structuredContent"]["sessions"]
            .as_array()
            .map(Vec::len),
        Some(2),
        "admin lists every session: {all}"
    );

    // Root destroys its session: nobody still gets SESSION_FORBIDDEN (not SESSION_DESTROYED,
    // which would tell it more); an id never created is NO_SUCH_SESSION for everyone.
    let r = call(&root, "session_destroy", json!({"session": "rootsess"})).await;
    assert!(!is_error(&r), "{r}");
    let r = call(c, "session_get", json!({"session": "rootsess"})).await;
    assert_eq!(code(&r), "SESSION_FORBIDDEN", "{r}");
    let r = call(&root, "session_get", json!({"session": "rootsess"})).await;
    assert_eq!(code(&r), "SESSION_DESTROYED", "{r}");
    let r = call(c, "session_create", json!({"id": "rootsess"})).await;
    assert_eq!(
        code(&r),
        "SESSION_FORBIDDEN",
        "alive or not, it is root's: {r}"
    );
    let r = call(c, "session_get", json!({"session": "never-made"})).await;
    assert_eq!(code(&r), "NO_SUCH_SESSION", "{r}");

    // Ownership survives a restart (it is in the session file and the tombstone).
    drop(nobody);
    d.stop();
    d.start();
    let nobody = as_nobody(&d).await;
    let c = &nobody.client;
    assert_eq!(version(c, "mine").await, 1);
    let r = call(c, "session_get", json!({"session": "rootsess"})).await;
    assert_eq!(code(&r), "SESSION_FORBIDDEN", "after restart: {r}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn admin_and_audit_capabilities() {
    let mut d = daemon(&format!(
        "[[grant]]\nuids = [{NOBODY}]\ncapabilities = [\"read\", \"admin\"]\n"
    ));
    d.start();
    let root = d.client().await;
    session(&root, "rs").await;
    let nobody = as_nobody(&d).await;
    let c = &nobody.client;
    // admin: root's session is readable, the audit too; write is still not granted.
    assert_eq!(version(c, "rs").await, 0);
    assert!(!audit(c).await.is_empty());
    let r = call(c, "session_destroy", json!({"session": "rs"})).await;
    assert_eq!(code(&r), "TOOL_FORBIDDEN", "{r}");
    drop(nobody);
    drop(root);
    d.stop();

    // `audit` alone: the audit resource, and no tool.
    let mut d = daemon(&format!(
        "[[grant]]\nuids = [{NOBODY}]\ncapabilities = [\"audit\"]\n"
    ));
    d.start();
    let root = d.client().await;
    session(&root, "rs").await;
    let nobody = as_nobody(&d).await;
    let c = &nobody.client;
    assert!(tool_names(c).await.is_empty());
    let listed = c.list_all_resources().await.expect("resources/list");
    assert_eq!(listed.len(), 1, "{listed:?}");
    let ev = audit(c).await;
    assert!(
        ev.iter()
            .any(|e| e["tool"] == "session_create" && e["kind"] == "commit"),
        "{ev:?}"
    );
    let r = call(c, "session_get", json!({"session": "rs"})).await;
    assert_eq!(code(&r), "TOOL_FORBIDDEN", "{r}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn group_grants_follow_the_peers_groups() {
    // A primary group (nobody's own) and a supplementary one (SO_PEERGROUPS), each granted
    // something different.
    const EXTRA: u32 = 47_311;
    let mut d = daemon(&format!(
        "[[grant]]\ngids = [{NOBODY}]\ncapabilities = [\"read\"]\ntools = [\"session_list\"]\n\n\
         [[grant]]\ngids = [{EXTRA}]\ncapabilities = [\"write\"]\ntools = [\"session_create\"]\n"
    ));
    d.start();
    let plain = as_nobody(&d).await;
    assert_eq!(tool_names(&plain.client).await, ["session_list"]);
    let member = as_nobody_in(&d, &[EXTRA]).await;
    assert_eq!(
        tool_names(&member.client).await,
        ["session_create", "session_list"]
    );
    session(&member.client, "by-group").await;
    let file = session_file(&d, "by-group").expect("session file");
    assert_eq!(
        file["owner"],
        json!(NOBODY),
        "owned by the uid, not the group: {file}"
    );
    let r = call(&plain.client, "session_create", json!({"id": "nope"})).await;
    assert_eq!(code(&r), "TOOL_FORBIDDEN", "{r}");
}

/// A write tool with a secret parameter: it writes the secret into its output (so the test
/// sees the worker got it, from its environment) and, with `fail`, also to stderr before
/// exiting 1.
const SECRET_TOOL: &str = r#"
name = "secret_write"
description = "Write a token to a file; fail loudly if asked"
capability = "write"
command = ["/bin/sh", "-c", "printf '%s' \"$TOKEN\" > \"$1\"; if [ \"$2\" = yes ]; then echo \"bad token $TOKEN\" >&2; exit 1; fi", "secret_write", "{out}", "{fail}"]
timeout = "10s"

[params.token]
type = "string"
secret = true
env = "TOKEN"
description = "An API token"

[params.out]
type = "string"
path = "output"

[params.fail]
type = "string"
default = "no"
"#;

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn secret_params_reach_the_worker_and_nothing_else() {
    require_root_for("the daemon must see a client of another uid");
    let mut d = Daemon::new();
    d.add_tool("secret_write", SECRET_TOOL);
    d.start();
    let c = d.client().await;
    session(&c, "s").await;
    let secret = "tok-5f2c9e-SECRET";
    let r = call(
        &c,
        "secret_write",
        json!({"session": "s", "token": secret, "out": "t.txt"}),
    )
    .await;
    assert!(!is_error(&r), "{r}");
    assert_eq!(
        d.read("t.txt").as_deref(),
        Some(secret),
        "the worker got it"
    );

    let r = call(
        &c,
        "secret_write",
        json!({"session": "s", "token": secret, "out": "u.txt", "fail": "yes"}),
    )
    .await;
    assert_eq!(code(&r), "TOOL_FAILED", "{r}");
    let reply = r.to_string();
    assert!(
        !reply.contains(secret),
        "the fault quotes the secret: {reply}"
    );
    assert!(reply.contains("bad token [REDACTED]"), "{reply}");
    assert!(d.read("u.txt").is_none());

    let events = audit(&c).await;
    let mine: Vec<&Value> = events
        .iter()
        .filter(|e| e["tool"] == "secret_write")
        .collect();
    assert!(!mine.is_empty());
    let all = serde_json::to_string(&events).expect("json");
    assert!(
        !all.contains(secret),
        "an audit event holds the secret: {all}"
    );
    let allow = mine
        .iter()
        .find(|e| e["kind"] == "allow")
        .expect("allow event");
    assert_eq!(
        allow["detail"]["arguments"]["token"], "[REDACTED]",
        "{allow}"
    );
    assert_eq!(allow["detail"]["arguments"]["out"], "t.txt", "{allow}");
    let failed = mine
        .iter()
        .find(|e| e["kind"] == "error")
        .expect("error event");
    assert!(
        failed.to_string().contains("[REDACTED]"),
        "the failure is recorded, scrubbed: {failed}"
    );
    // The daemon ran with AIRLOCK_LOG=debug: not one log line holds it either.
    drop(c);
    d.stop();
    let log = d.log_text();
    assert!(!log.is_empty());
    assert!(
        !log.contains(secret),
        "the daemon log holds the secret:\n{log}"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn bad_grants_are_refused_at_load_with_their_place() {
    let d = daemon(
        "[[grant]]\nusers = [\"no-such-user-h9\"]\ncapabilities = [\"read\", \"fly\"]\n\n[[grant]]\ngroups = [\"no-such-group-h9\"]\ncapabilities = [\"admin\"]\ntools = [\"nope\"]\n",
    );
    let out = std::process::Command::new(BIN)
        .args(["policy", "check", "--policies"])
        .arg(&d.policies)
        .output()
        .expect("airlock policy check");
    let err =
        String::from_utf8_lossy(&out.stderr).into_owned() + &String::from_utf8_lossy(&out.stdout);
    assert_eq!(out.status.code(), Some(1), "{err}");
    for want in [
        "airlock.toml:2:10: no user named \"no-such-user-h9\"",
        "airlock.toml:3:",
        "unknown capability \"fly\"",
        "airlock.toml:6:11: no group named \"no-such-group-h9\"",
        "no tool named \"nope\"",
        "\"admin\" is not limited to tools",
    ] {
        assert!(err.contains(want), "missing {want:?} in:\n{err}");
    }
}

/// `airlock policy explain` shows who may call a tool.
#[test]
fn policy_explain_shows_the_grants() {
    let d = daemon(&format!(
        "[[grant]]\nuids = [{NOBODY}]\ncapabilities = [\"write\"]\ntools = [\"upper\"]\n"
    ));
    let out = std::process::Command::new(BIN)
        .args(["policy", "explain", "upper", "--policies"])
        .arg(&d.policies)
        .output()
        .expect("airlock policy explain");
    let text = String::from_utf8_lossy(&out.stdout);
    assert!(out.status.success(), "{text}");
    assert!(text.contains("uid 65534"), "{text}");
    assert!(text.contains("user @daemon (uid 0)"), "{text}");
    assert!(text.contains("group @daemon (gid 0)"), "{text}");
    let out = std::process::Command::new(BIN)
        .args(["policy", "explain", "session_create", "--policies"])
        .arg(&d.policies)
        .output()
        .expect("airlock policy explain");
    let text = String::from_utf8_lossy(&out.stdout);
    assert!(!text.contains("uid 65534"), "{text}");
}
