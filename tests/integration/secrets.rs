//! Secret parameters against a hostile tool: a secret printed to stderr where the daemon cuts
//! stderr never reaches the fault, the audit or the log, whole or in part; and a secret
//! passed by environment is not readable by another uid in `/proc`, while the command line is.

use std::process::Command;

use serde_json::{json, Value};

use crate::harness::*;
use crate::sandbox::give_to_nobody;

/// The secret of these tests: no four characters of it occur in anything else they read.
const SECRET: &str = "Zq8x-Wv7k-Jm3p-Ty9r";

/// The worker's stderr capture (the shipped profiles' `output_bytes`) and the bytes of it a
/// `TOOL_FAILED` message quotes.
const CAPTURE: u64 = 1 << 20;
const TAIL: u64 = 2000;

/// Fails naming `what` if `text` holds any four consecutive characters of [`SECRET`].
fn assert_no_fragment(what: &str, text: &str) {
    for i in 0..=SECRET.len() - 4 {
        let f = &SECRET[i..i + 4];
        assert!(
            !text.contains(f),
            "{what} holds {f:?}, a fragment of the secret:\n{text}"
        );
    }
}

/// A daemon with the `secret_*` test tools under `profile`, run as `user` when set.
fn daemon(profile: &str, user: Option<(u32, u32)>) -> Daemon {
    require_root_for("to run the daemon as another user and read /proc as a third");
    let mut d = Daemon::new();
    for tool in ["secret_stderr", "secret_env_wait"] {
        let path = repo().join(format!("tests/tools/{tool}.toml"));
        let text = std::fs::read_to_string(&path).expect("tool");
        d.add_tool(
            tool,
            &text
                .replace(
                    "capability = \"read\"",
                    &format!("capability = \"read\"\nprofile = \"{profile}\""),
                )
                .replace("47.1131", wait_marker(user)),
        );
    }
    if let Some(u) = user {
        give_to_nobody(&d);
        d.user = Some(u);
    }
    d.start();
    d
}

/// Calls `secret_stderr` with `before` and `after` bytes of filler around the token and its
/// repeats, expecting `TOOL_FAILED` with a scrubbed tail.
async fn fail_with(c: &Client, before: u64, after: u64) -> Value {
    let r = call(
        c,
        "secret_stderr",
        json!({"token": SECRET, "before": before, "after": after}),
    )
    .await;
    assert_eq!(code(&r), "TOOL_FAILED", "{r}");
    assert_no_fragment(
        "the TOOL_FAILED reply (text and structuredContent)",
        &r.to_string(),
    );
    let message = r["structuredContent"]["error"]["message"]
        .as_str()
        .unwrap_or_else(|| panic!("{r}"));
    assert!(message.contains("[REDACTED]"), "{message}");
    r
}

async fn secrets_printed_at_every_cut_leave_no_fragment(profile: &str, user: Option<(u32, u32)>) {
    let mut d = daemon(profile, user);
    let c = d.client().await;
    // The repeats: "\n" T "\n" T T "\n".
    let repeats = 3 * SECRET.len() as u64 + 3;
    // 1. The tail's cut falls 6 bytes before the end of the first token, its repeats (one
    // pair adjacent) inside the tail.
    let r = fail_with(&c, 0, TAIL - 6 - repeats).await;
    let message = r["structuredContent"]["error"]["message"].as_str().unwrap();
    assert!(
        message.contains("[REDACTED]\n[REDACTED]\n[REDACTED]"),
        "the repeats, each replaced: {message}"
    );
    // 2. The capture's cap falls 6 bytes after the start of the token: the capture ends in a
    // prefix of it, which the tail quotes.
    fail_with(&c, CAPTURE - 6, 0).await;
    // 3. The cap and the tail's start both cut a token: a 1-byte prefix at the cap.
    fail_with(&c, CAPTURE - 1, 0).await;

    let events = audit(&c).await;
    let mine: Vec<&Value> = events
        .iter()
        .filter(|e| e["tool"] == "secret_stderr")
        .collect();
    assert_eq!(
        mine.iter().filter(|e| e["kind"] == "error").count(),
        3,
        "{mine:?}"
    );
    assert_no_fragment(
        "the audit ring (airlock://audit/events)",
        &serde_json::to_string(&events).expect("json"),
    );
    drop(c);
    d.stop();
    assert_no_fragment("the daemon's log", &d.log_text());
    let mut durable = String::new();
    let mut logs = Vec::new();
    for e in std::fs::read_dir(&d.state).expect("state dir").flatten() {
        let name = e.file_name().to_string_lossy().into_owned();
        if name.starts_with("audit.jsonl") {
            durable.push_str(&std::fs::read_to_string(e.path()).expect("audit file"));
            logs.push(e.path());
        }
    }
    assert!(durable.contains("secret_stderr"), "{durable}");
    assert_no_fragment("the durable audit files", &durable);
    let (code, said) = d.audit_verify();
    assert!(code == Some(0) && said.starts_with("ok: "), "{said}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn secrets_printed_at_stderr_cuts_leave_no_fragment_default_profile() {
    secrets_printed_at_every_cut_leave_no_fragment("default", None).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn secrets_printed_at_stderr_cuts_leave_no_fragment_strict_profile() {
    secrets_printed_at_every_cut_leave_no_fragment("strict", None).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn secrets_printed_at_stderr_cuts_leave_no_fragment_unprivileged_daemon() {
    secrets_printed_at_every_cut_leave_no_fragment("default", Some((65534, 65534))).await;
}

/// What `secret_env_wait`'s worker sleeps, told apart by the daemon's user, so that tests
/// running at once each find their own worker.
fn wait_marker(user: Option<(u32, u32)>) -> &'static str {
    match user {
        None => "47.1131",
        Some(_) => "47.1132",
    }
}

/// `cat FILE` as `uid`: its output, or `None` if it could not read it.
fn read_as(uid: u32, file: &str) -> Option<Vec<u8>> {
    crate::harness::require_program("setpriv", "util-linux");
    let out = Command::new("setpriv")
        .args([
            &format!("--reuid={uid}"),
            &format!("--regid={uid}"),
            "--clear-groups",
            "cat",
            file,
        ])
        .output()
        .expect("setpriv");
    out.status.success().then_some(out.stdout)
}

/// While a worker holding the secret in its environment runs: root reads it there (so it
/// is what the tool got), `stranger` cannot read `/proc/PID/environ` but can read
/// `/proc/PID/cmdline`, which does not hold it. With `same_uid`, the worker's own uid (the
/// daemon's, when workers share it) reads the environment: not protected from that uid.
async fn env_secrets_are_hidden_from_other_uids(
    user: Option<(u32, u32)>,
    stranger: u32,
    same_uid: Option<u32>,
) {
    let mut d = daemon("default", user);
    let c = d.client().await;
    let caller = d.client().await;
    let running =
        tokio::spawn(
            async move { call(&caller, "secret_env_wait", json!({"token": SECRET})).await },
        );
    let marker = format!("sleep {}", wait_marker(user));
    wait_for_exact(&marker).await;
    let pids = processes_with(&marker);
    assert_eq!(pids.len(), 1, "{pids:?}");
    let pid = pids[0];
    let environ = std::fs::read(format!("/proc/{pid}/environ")).expect("root reads environ");
    assert!(
        String::from_utf8_lossy(&environ).contains(&format!("TOKEN={SECRET}")),
        "the worker got the secret in its environment"
    );
    let cmdline = read_as(stranger, &format!("/proc/{pid}/cmdline"))
        .unwrap_or_else(|| panic!("uid {stranger} cannot read the worker's cmdline"));
    assert_no_fragment("the worker's cmdline", &String::from_utf8_lossy(&cmdline));
    assert!(
        read_as(stranger, &format!("/proc/{pid}/environ")).is_none(),
        "uid {stranger} read the worker's environ"
    );
    if let Some(uid) = same_uid {
        let env = read_as(uid, &format!("/proc/{pid}/environ"))
            .unwrap_or_else(|| panic!("uid {uid}, the worker's, cannot read its environ"));
        assert!(String::from_utf8_lossy(&env).contains(SECRET));
    }
    rustix::process::kill_process(
        rustix::process::Pid::from_raw(pid).expect("pid"),
        rustix::process::Signal::KILL,
    )
    .expect("kill the worker");
    let r = running.await.expect("call");
    assert_eq!(code(&r), "TOOL_FAILED", "{r}");
    assert_no_fragment("the reply", &r.to_string());
    assert_no_fragment(
        "the audit ring",
        &serde_json::to_string(&audit(&c).await).expect("json"),
    );
    drop(c);
    d.stop();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn env_secrets_are_hidden_from_other_uids_unprivileged_daemon() {
    // Workers share the daemon's uid (nobody): that uid reads their environment, a third
    // does not.
    env_secrets_are_hidden_from_other_uids(Some((65534, 65534)), 4242, Some(65534)).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn env_secrets_are_hidden_from_other_uids_root_daemon() {
    // Workers get their own uid: nobody does not read their environment.
    env_secrets_are_hidden_from_other_uids(None, 65534, None).await;
}
