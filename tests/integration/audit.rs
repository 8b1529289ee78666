//! Every lifecycle of the execution model, read back both from the `airlock://audit/events`
//! resource and from the durable log; the chain `airlock audit verify` checks; a failing sink
//! rolling the commit back; a full audit disk (space and inodes) losing no file and recovering
//! without a restart; a flood of denials that pushes no commit out; the resource template,
//! its subscriptions, and `airlock audit` reading the files.

use std::collections::BTreeMap;
use std::io::BufRead;
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use serde_json::{json, Value};

use crate::harness::*;

/// Every event of the durable log (all its files, oldest first).
fn log_events(d: &Daemon) -> Vec<Value> {
    let path = d.state.join("audit.jsonl");
    let mut files = vec![];
    let mut n = 1;
    while std::path::Path::new(&format!("{}.{n}", path.display())).exists() {
        files.push(format!("{}.{n}", path.display()));
        n += 1;
    }
    files.reverse();
    files.push(path.display().to_string());
    files
        .iter()
        .flat_map(|f| {
            std::fs::read_to_string(f)
                .unwrap_or_default()
                .lines()
                .map(|l| serde_json::from_str::<Value>(l).expect("a JSON line"))
                .collect::<Vec<_>>()
        })
        .collect()
}

/// Events grouped by job, in log order.
fn by_job(events: &[Value]) -> BTreeMap<String, Vec<Value>> {
    let mut m: BTreeMap<String, Vec<Value>> = BTreeMap::new();
    for e in events {
        m.entry(e["job"].as_str().unwrap_or("").to_string())
            .or_default()
            .push(e.clone());
    }
    m
}

fn kinds(events: &[Value]) -> Vec<String> {
    events
        .iter()
        .map(|e| e["kind"].as_str().unwrap_or("?").to_string())
        .collect()
}

/// The job of the call made with JSON-RPC id `id` on a raw connection.
fn job_of(events: &[Value], tool: &str, id: i64) -> String {
    events
        .iter()
        .find(|e| e["tool"] == tool && e["request_id"] == json!(id))
        .unwrap_or_else(|| panic!("no event of {tool} with request id {id}: {events:#?}"))["job"]
        .as_str()
        .unwrap()
        .to_string()
}

fn raw_read(r: &mut Raw, id: i64, uri: &str) -> Value {
    r.send(
        &json!({"jsonrpc": "2.0", "id": id, "method": "resources/read", "params": {"uri": uri}}),
    );
    r.response(id)
}

fn raw_events(r: &mut Raw, id: i64, uri: &str) -> Vec<Value> {
    let resp = raw_read(r, id, uri);
    let text = resp["result"]["contents"][0]["text"]
        .as_str()
        .unwrap_or_else(|| panic!("resources/read {uri}: {resp}"));
    serde_json::from_str(text).expect("events")
}

fn cancel(r: &mut Raw, id: i64) {
    r.send(
        &json!({"jsonrpc": "2.0", "method": "notifications/cancelled",
        "params": {"requestId": id, "reason": "test"}}),
    );
}

/// Waits until the log holds an event `kind` of the call with request id `id`.
async fn wait_kind(d: &Daemon, tool: &str, id: i64, kind: &str) {
    let deadline = Instant::now() + Duration::from_secs(20);
    loop {
        let evs = log_events(d);
        if evs
            .iter()
            .any(|e| e["tool"] == tool && e["request_id"] == json!(id) && e["kind"] == kind)
        {
            return;
        }
        assert!(
            Instant::now() < deadline,
            "no {kind} of {tool} (request {id}) within 20s: {evs:#?}"
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

fn sha256_hex(b: &[u8]) -> String {
    let out = Command::new("sha256sum")
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .spawn()
        .and_then(|mut c| {
            use std::io::Write;
            c.stdin.take().unwrap().write_all(b)?;
            c.wait_with_output()
        })
        .expect("sha256sum");
    String::from_utf8_lossy(&out.stdout)
        .split_whitespace()
        .next()
        .unwrap()
        .to_string()
}

/// `n` write_text calls in `session`, writing `{prefix}{i}` to a.txt; each must commit.
async fn commit_writes(c: &Client, session: &str, prefix: &str, n: usize) {
    for i in 0..n {
        let text = format!("{prefix}{i}");
        let r = call(
            c,
            "write_text",
            json!({"session": session, "text": text, "out": "a.txt"}),
        )
        .await;
        assert!(!is_error(&r), "{r}");
    }
}

fn airlock_audit(args: &[&str]) -> (i32, String, String) {
    let out = Command::new(BIN)
        .arg("audit")
        .args(args)
        .output()
        .expect("airlock audit");
    (
        out.status.code().unwrap_or(-1),
        String::from_utf8_lossy(&out.stdout).into_owned(),
        String::from_utf8_lossy(&out.stderr).into_owned(),
    )
}

#[tokio::test]
async fn every_lifecycle_reads_the_same_from_the_resource_and_the_log() {
    let mut d = Daemon::new();
    d.start();
    let mut r = Raw::connect(&d.socket);
    r.initialize();

    r.call(1, "session_create", json!({"id": "s"}));
    assert!(r.response(1)["result"]["isError"] != true);
    r.call(2, "session_create", json!({"id": "q"}));
    assert!(r.response(2)["result"]["isError"] != true);

    // Success: allow, start, commit (with the output's size and SHA-256).
    r.call(
        10,
        "write_text",
        json!({"session": "s", "text": "hello", "out": "a.txt"}),
    );
    assert!(r.response(10)["result"]["isError"] != true);
    // Timeout: allow, start, timeout, worker_terminated, rollback.
    r.call(11, "sleepy", json!({"session": "s", "out": "t.txt"}));
    assert_eq!(r.response(11)["result"]["isError"], true);
    // Worker failure: allow, start, error, rollback.
    r.call(12, "fail_tool", json!({"session": "s", "out": "f.txt"}));
    assert_eq!(r.response(12)["result"]["isError"], true);
    // Cancelled in flight by the client: allow, start, cancel, worker_terminated, rollback.
    r.call(
        13,
        "slow_write",
        json!({"session": "s", "seconds": 3, "out": "c.txt"}),
    );
    wait_kind(&d, "slow_write", 13, "start").await;
    cancel(&mut r, 13);
    wait_kind(&d, "slow_write", 13, "rollback").await;
    // Cancelled while queued behind another call's session lock: allow, cancel (queued).
    r.call(
        14,
        "slow_write",
        json!({"session": "q", "seconds": 3, "out": "q1.txt"}),
    );
    wait_kind(&d, "slow_write", 14, "start").await;
    r.call(
        15,
        "write_text",
        json!({"session": "q", "text": "never", "out": "q2.txt"}),
    );
    wait_kind(&d, "write_text", 15, "allow").await;
    cancel(&mut r, 15);
    wait_kind(&d, "write_text", 15, "cancel").await;
    assert!(r.response(14)["result"]["isError"] != true);
    // Read calls: allow, start, done | error.
    r.call(16, "cat", json!({"path": "a.txt"}));
    assert!(r.response(16)["result"]["isError"] != true);
    r.call(17, "session_get", json!({"session": "nope"}));
    assert_eq!(r.response(17)["result"]["isError"], true);
    // Cancelled by the client's disconnect: cause "disconnect".
    let mut gone = Raw::connect(&d.socket);
    gone.initialize();
    gone.call(
        18,
        "slow_write",
        json!({"session": "q", "seconds": 3, "out": "d.txt"}),
    );
    wait_kind(&d, "slow_write", 18, "start").await;
    drop(gone);
    wait_kind(&d, "slow_write", 18, "rollback").await;

    let from_resource = raw_events(&mut r, 100, "airlock://audit/events");
    let from_log = log_events(&d);
    // The same events, byte for byte the same JSON, in the same order.
    assert!(!from_resource.is_empty());
    let tail = &from_log[from_log.len() - from_resource.len()..];
    assert_eq!(from_resource, tail, "the resource and the log disagree");

    for events in [&from_resource, &from_log] {
        let jobs = by_job(events);
        let seq = |tool: &str, id: i64| kinds(&jobs[&job_of(events, tool, id)]);
        assert_eq!(seq("write_text", 10), ["allow", "start", "commit"]);
        assert_eq!(
            seq("sleepy", 11),
            ["allow", "start", "timeout", "worker_terminated", "rollback"]
        );
        assert_eq!(
            seq("fail_tool", 12),
            ["allow", "start", "error", "rollback"]
        );
        assert_eq!(
            seq("slow_write", 13),
            ["allow", "start", "cancel", "worker_terminated", "rollback"]
        );
        assert_eq!(seq("slow_write", 14), ["allow", "start", "commit"]);
        assert_eq!(seq("write_text", 15), ["allow", "cancel"]);
        assert_eq!(seq("cat", 16), ["allow", "start", "done"]);
        assert_eq!(seq("session_get", 17), ["allow", "start", "error"]);
        assert_eq!(
            seq("slow_write", 18),
            ["allow", "start", "cancel", "worker_terminated", "rollback"]
        );
        assert_eq!(seq("session_create", 1), ["allow", "start", "commit"]);

        let ev = |tool: &str, id: i64, kind: &str| -> Value {
            jobs[&job_of(events, tool, id)]
                .iter()
                .find(|e| e["kind"] == kind)
                .unwrap()
                .clone()
        };
        // The fields: time, principal, request id, session, tool, timeout, duration, exit
        // status, the enforcement, and what was published.
        let allow = ev("write_text", 10, "allow");
        assert!(allow["time"].as_str().unwrap().ends_with('Z'), "{allow}");
        assert_eq!(
            allow["principal"]["uid"],
            unsafe { libc::geteuid() },
            "{allow}"
        );
        assert_eq!(allow["principal"]["client"], "raw-test", "{allow}");
        assert_eq!(allow["session"], "s");
        assert_eq!(allow["detail"]["timeout_ms"], 10_000);
        let start = ev("write_text", 10, "start");
        assert_eq!(start["detail"]["landlock"], "fully_enforced", "{start}");
        assert!(
            start["detail"]["landlock_abi"].as_u64().unwrap() >= 6,
            "{start}"
        );
        assert_eq!(start["detail"]["seccomp"], "deny", "{start}");
        assert!(start["detail"]["containment"].is_string(), "{start}");
        assert!(start["detail"]["pid"].as_u64().is_some(), "{start}");
        let commit = ev("write_text", 10, "commit");
        assert_eq!(commit["detail"]["version"], 1, "{commit}");
        assert_eq!(commit["detail"]["exit"]["status"], 0, "{commit}");
        assert!(
            commit["detail"]["duration_ms"].as_u64().is_some(),
            "{commit}"
        );
        let out = &commit["detail"]["outputs"][0];
        assert_eq!(out["path"], "a.txt", "{commit}");
        assert_eq!(out["size"], 5, "{commit}");
        assert_eq!(out["sha256"], sha256_hex(b"hello"), "{commit}");
        let fail = ev("fail_tool", 12, "error");
        assert_eq!(fail["detail"]["code"], "TOOL_FAILED", "{fail}");
        assert_eq!(
            ev("fail_tool", 12, "rollback")["detail"]["code"],
            "TOOL_FAILED"
        );
        let term = ev("sleepy", 11, "worker_terminated");
        assert!(term["detail"]["confirmed_by"].is_string(), "{term}");
        assert_eq!(
            ev("sleepy", 11, "rollback")["detail"]["code"],
            "TOOL_TIMEOUT"
        );
        let c = ev("slow_write", 13, "cancel");
        assert_eq!(c["detail"]["cause"], "client", "{c}");
        assert_eq!(c["detail"]["request_id"], 13, "{c}");
        assert_eq!(c["detail"]["phase"], "running", "{c}");
        let q = ev("write_text", 15, "cancel");
        assert_eq!(q["detail"]["phase"], "queued", "{q}");
        assert_eq!(q["detail"]["cause"], "client", "{q}");
        assert_eq!(
            ev("slow_write", 18, "cancel")["detail"]["cause"],
            "disconnect"
        );
    }
    // What the log says matches the workspace.
    assert_eq!(d.read("a.txt").as_deref(), Some("hello"));
    for f in ["t.txt", "f.txt", "c.txt", "q2.txt", "d.txt"] {
        assert_eq!(d.read(f), None, "{f} was published");
    }

    // A shutdown's cancel says so.
    r.call(
        19,
        "slow_write",
        json!({"session": "s", "seconds": 3, "out": "z.txt"}),
    );
    wait_kind(&d, "slow_write", 19, "start").await;
    d.stop();
    let evs = log_events(&d);
    let jobs = by_job(&evs);
    let z = &jobs[&job_of(&evs, "slow_write", 19)];
    assert_eq!(
        kinds(z),
        ["allow", "start", "cancel", "worker_terminated", "rollback"]
    );
    assert_eq!(z[2]["detail"]["cause"], "shutdown", "{z:#?}");
    assert_eq!(d.read("z.txt"), None);

    // The chain holds, across the restart too.
    let log = d.state.join("audit.jsonl");
    let (code, out, err) = verify_log(&log);
    assert_eq!(code, 0, "{out}{err}");
    d.start();
    let c = d.client().await;
    session(&c, "after").await;
    d.stop();
    let (code, out, err) = verify_log(&log);
    assert_eq!(code, 0, "{out}{err}");
    let evs = log_events(&d);
    assert!(
        evs.windows(2)
            .all(|w| w[1]["seq"].as_u64() == w[0]["seq"].as_u64().map(|s| s + 1)),
        "seq runs on across restarts"
    );
}

#[tokio::test]
async fn verify_rejects_a_log_whose_line_was_edited_or_removed() {
    use std::os::unix::fs::PermissionsExt;
    let mut d = Daemon::new();
    d.start();
    let c = d.client().await;
    session(&c, "s").await;
    commit_writes(&c, "s", "v", 3).await;
    drop(c);
    d.stop();
    let log = d.state.join("audit.jsonl");
    let mode = std::fs::metadata(&log).unwrap().permissions().mode() & 0o7777;
    assert_eq!(mode, 0o600, "the audit log's mode");
    let (code, out, err) = verify_log(&log);
    assert_eq!(code, 0, "{out}{err}");
    assert!(out.starts_with("ok: "), "{out}");

    let good = std::fs::read_to_string(&log).unwrap();
    let lines: Vec<&str> = good.lines().collect();
    assert!(lines.len() > 8);
    // A commit's published size edited in place.
    let i = lines
        .iter()
        .position(|l| l.contains("\"kind\":\"commit\"") && l.contains("a.txt"))
        .unwrap();
    let mut edited = lines.clone();
    let changed = lines[i].replace("\"size\":2", "\"size\":3");
    assert_ne!(changed, lines[i]);
    edited[i] = &changed;
    std::fs::write(&log, edited.join("\n") + "\n").unwrap();
    let (code, _, err) = verify_log(&log);
    assert_eq!(code, 1, "an edited line passed verify");
    assert!(err.contains(&format!(":{}:", i + 2)), "{err}");
    // A rollback-worthy line removed.
    let mut removed = lines.clone();
    removed.remove(i);
    std::fs::write(&log, removed.join("\n") + "\n").unwrap();
    let (code, _, err) = verify_log(&log);
    assert_eq!(code, 1, "a removed line passed verify");
    assert!(err.contains("edited, removed or inserted"), "{err}");
    // Restored, it verifies again.
    std::fs::write(&log, &good).unwrap();
    assert_eq!(verify_log(&log).0, 0);
}

#[tokio::test]
async fn a_failing_audit_sink_rolls_the_commit_back_with_audit_failed() {
    crate::harness::require_program("mount", "mount");
    require_root();
    // The log on a small tmpfs that the test fills: writes fail with ENOSPC, as on a full
    // disk.
    let mut d = Daemon::new();
    let fs = d.dir.path().join("auditfs");
    std::fs::create_dir(&fs).unwrap();
    let st = Command::new("mount")
        .args(["-t", "tmpfs", "-o", "size=64k,mode=0700", "tmpfs"])
        .arg(&fs)
        .status()
        .expect("mount");
    assert!(
        st.success(),
        "mount tmpfs (needs root and a kernel with tmpfs)"
    );
    struct Unmount(std::path::PathBuf);
    impl Drop for Unmount {
        fn drop(&mut self) {
            let _ = Command::new("umount").arg("-l").arg(&self.0).status();
        }
    }
    let _unmount = Unmount(fs.clone());
    let toml = d.policies.join("airlock.toml");
    let text = std::fs::read_to_string(&toml).unwrap().replace(
        "audit_log = \"audit.jsonl\"",
        &format!("audit_log = \"{}\"", fs.join("audit.jsonl").display()),
    );
    std::fs::write(&toml, text).unwrap();
    d.start();
    let c = d.client().await;
    session(&c, "s").await;
    let r = call(
        &c,
        "write_text",
        json!({"session": "s", "text": "v0", "out": "a.txt"}),
    )
    .await;
    assert!(!is_error(&r), "{r}");
    // Fill the filesystem.
    let mut fill = std::fs::File::create(fs.join("fill")).unwrap();
    loop {
        use std::io::Write;
        if fill.write_all(&[0u8; 4096]).is_err() {
            break;
        }
    }
    let mut failed = 0;
    let mut committed = 1u64;
    let mut content = "v0".to_string();
    for i in 1..=30 {
        let text = format!("v{i}");
        let r = call(
            &c,
            "write_text",
            json!({"session": "s", "text": text, "out": "a.txt"}),
        )
        .await;
        if is_error(&r) {
            assert_eq!(code(&r), "AUDIT_FAILED", "{r}");
            failed += 1;
        } else {
            committed += 1;
            content = text;
        }
        // Whatever happened, the workspace and the state agree with each other.
        assert_eq!(d.read("a.txt").as_deref(), Some(content.as_str()));
        assert_eq!(version(&c, "s").await, committed);
        assert!(d.job_dirs().is_empty(), "{:?}", d.job_dirs());
    }
    assert!(failed > 0, "the full sink never failed a commit");
    // Space again: calls commit again, and the chain is intact (no partial line).
    drop(fill);
    std::fs::remove_file(fs.join("fill")).unwrap();
    let r = call(
        &c,
        "write_text",
        json!({"session": "s", "text": "back", "out": "a.txt"}),
    )
    .await;
    assert!(!is_error(&r), "{r}");
    assert_eq!(d.read("a.txt").as_deref(), Some("back"));
    drop(c);
    d.stop();
    let (code, out, err) = verify_log(&fs.join("audit.jsonl"));
    assert_eq!(code, 0, "{out}{err}");
}

#[tokio::test]
async fn the_template_filters_and_subscribers_hear_of_new_events() {
    let mut d = Daemon::new();
    d.start();
    let mut r = Raw::connect(&d.socket);
    r.initialize();
    r.send(&json!({"jsonrpc": "2.0", "id": 1, "method": "resources/templates/list"}));
    let t = r.response(1);
    assert_eq!(
        t["result"]["resourceTemplates"][0]["uriTemplate"],
        "airlock://audit/events{?job,session,tool,since,limit}",
        "{t}"
    );
    r.send(
        &json!({"jsonrpc": "2.0", "id": 2, "method": "resources/subscribe",
        "params": {"uri": "airlock://audit/events"}}),
    );
    assert!(r.response(2)["result"].is_object());
    r.call(3, "session_create", json!({"id": "s"}));
    r.call(4, "session_create", json!({"id": "t"}));
    // The notification arrives (among the replies).
    let deadline = Instant::now() + Duration::from_secs(10);
    let mut heard = false;
    let mut replies = 0;
    while Instant::now() < deadline && !(heard && replies == 2) {
        let Some(m) = r.recv_within(Duration::from_secs(5)) else {
            break;
        };
        if m["method"] == "notifications/resources/updated" {
            assert_eq!(m["params"]["uri"], "airlock://audit/events", "{m}");
            heard = true;
        } else if m["id"] == 3 || m["id"] == 4 {
            replies += 1;
        }
    }
    assert!(heard, "no notifications/resources/updated");
    r.call(
        5,
        "write_text",
        json!({"session": "s", "text": "x", "out": "x.txt"}),
    );
    r.response(5);
    r.call(
        6,
        "write_text",
        json!({"session": "t", "text": "y", "out": "y.txt"}),
    );
    r.response(6);

    let all = raw_events(&mut r, 10, "airlock://audit/events");
    let job = job_of(&all, "write_text", 5);
    let one = raw_events(&mut r, 11, &format!("airlock://audit/events?job={job}"));
    assert_eq!(kinds(&one), ["allow", "start", "commit"]);
    assert!(one.iter().all(|e| e["job"] == job.as_str()));
    let t = raw_events(
        &mut r,
        12,
        "airlock://audit/events?session=t&tool=write_text",
    );
    assert_eq!(kinds(&t), ["allow", "start", "commit"]);
    assert!(t.iter().all(|e| e["session"] == "t"));
    let last2 = raw_events(&mut r, 13, "airlock://audit/events?limit=2");
    assert_eq!(last2, all[all.len() - 2..].to_vec());
    let late = raw_events(
        &mut r,
        14,
        "airlock://audit/events?since=2999-01-01T00:00:00Z",
    );
    assert!(late.is_empty());
    let since = all[all.len() - 3]["time_ms"].as_u64().unwrap();
    let recent = raw_events(&mut r, 15, &format!("airlock://audit/events?since={since}"));
    assert!(recent.len() >= 3 && recent.iter().all(|e| e["time_ms"].as_u64() >= Some(since)));
    // A bad filter is an error naming it.
    let bad = raw_read(&mut r, 16, "airlock://audit/events?colour=red");
    assert!(
        bad["error"]["message"]
            .as_str()
            .unwrap_or("")
            .contains("colour"),
        "{bad}"
    );
    // Unsubscribed: no more notifications.
    r.send(
        &json!({"jsonrpc": "2.0", "id": 17, "method": "resources/unsubscribe",
        "params": {"uri": "airlock://audit/events"}}),
    );
    r.response(17);
    // Whatever the notifier sent before the unsubscribe is out before this ping's response
    // (which skips it), and then whatever still trickles in is drained.
    r.send(&json!({"jsonrpc": "2.0", "id": 170, "method": "ping"}));
    r.response(170);
    while r.recv_within(Duration::from_millis(200)).is_some() {}
    r.call(18, "session_create", json!({"id": "u"}));
    // No notification may come: watching for 800 ms is the check itself, not an ordering.
    let deadline = Instant::now() + Duration::from_millis(800);
    while Instant::now() < deadline {
        if let Some(m) = r.recv_within(Duration::from_millis(200)) {
            assert_ne!(m["method"], "notifications/resources/updated", "{m}");
        }
    }
    drop(r);
    d.stop();
}

#[tokio::test]
async fn airlock_audit_reads_the_log_with_filters_and_follows_it() {
    let mut d = Daemon::new();
    d.start();
    let c = d.client().await;
    session(&c, "s").await;
    session(&c, "t").await;
    let r = call(
        &c,
        "write_text",
        json!({"session": "s", "text": "x", "out": "x.txt"}),
    )
    .await;
    assert!(!is_error(&r), "{r}");
    let log = d.state.join("audit.jsonl");
    let logs = log.to_str().unwrap().to_string();

    // --json: the stored lines, filtered.
    let (code, out, err) = airlock_audit(&["--log", &logs, "--json", "--tool", "write_text"]);
    assert_eq!(code, 0, "{err}");
    let lines: Vec<Value> = out
        .lines()
        .map(|l| serde_json::from_str(l).unwrap())
        .collect();
    assert_eq!(kinds(&lines), ["allow", "start", "commit"]);
    let stored: Vec<String> = std::fs::read_to_string(&log)
        .unwrap()
        .lines()
        .filter(|l| l.contains("\"tool\":\"write_text\""))
        .map(String::from)
        .collect();
    assert_eq!(out.lines().collect::<Vec<_>>(), stored);
    let (_, out, _) = airlock_audit(&["--log", &logs, "--json", "--session", "t"]);
    assert!(out.lines().all(|l| l.contains("\"session\":\"t\"")) && !out.is_empty());
    let (_, out, _) = airlock_audit(&["--log", &logs, "--json", "--limit", "1"]);
    assert_eq!(out.lines().count(), 1);
    assert!(out.contains("\"kind\":\"commit\""), "{out}");
    let (code, _, err) = airlock_audit(&["--log", &logs, "--since", "yesterday"]);
    assert_eq!(code, 2);
    assert!(err.contains("since"), "{err}");
    // The table: a header and one row per event.
    let (_, table, _) = airlock_audit(&["--log", &logs, "--tool", "write_text"]);
    let rows: Vec<&str> = table.lines().collect();
    assert!(
        rows[0].starts_with("TIME") && rows[0].contains("KIND"),
        "{table}"
    );
    assert_eq!(rows.len(), 4, "{table}");
    assert!(
        rows[3].contains("commit") && rows[3].contains("x.txt"),
        "{table}"
    );

    // --follow: new events appear as they are written.
    let mut follow = Command::new(BIN)
        .args([
            "audit",
            "--log",
            &logs,
            "--json",
            "--follow",
            "--tool",
            "write_text",
        ])
        .stdout(Stdio::piped())
        .spawn()
        .expect("airlock audit --follow");
    let stdout = follow.stdout.take().unwrap();
    let (tx, rx) = std::sync::mpsc::channel();
    std::thread::spawn(move || {
        for line in std::io::BufReader::new(stdout)
            .lines()
            .map_while(Result::ok)
        {
            if tx.send(line).is_err() {
                return;
            }
        }
    });
    // The existing three, then the new call's three.
    let mut got = vec![];
    let deadline = Instant::now() + Duration::from_secs(15);
    while got.len() < 3 && Instant::now() < deadline {
        if let Ok(l) = rx.recv_timeout(Duration::from_millis(100)) {
            got.push(l);
        }
    }
    let r = call(
        &c,
        "write_text",
        json!({"session": "t", "text": "y", "out": "y.txt"}),
    )
    .await;
    assert!(!is_error(&r), "{r}");
    while got.len() < 6 && Instant::now() < deadline {
        if let Ok(l) = rx.recv_timeout(Duration::from_millis(100)) {
            got.push(l);
        }
    }
    let _ = follow.kill();
    let _ = follow.wait();
    let evs: Vec<Value> = got
        .iter()
        .map(|l| serde_json::from_str(l).unwrap())
        .collect();
    assert_eq!(
        kinds(&evs),
        ["allow", "start", "commit", "allow", "start", "commit"],
        "{got:#?}"
    );
    assert_eq!(evs[5]["session"], "t");
    drop(c);
    d.stop();
}

/// Every file of the log at `path` (oldest first) and its bytes.
fn log_files(path: &std::path::Path) -> Vec<(String, Vec<u8>)> {
    let dir = path.parent().unwrap();
    let name = path.file_name().unwrap().to_str().unwrap().to_string();
    let mut numbered: Vec<(usize, String)> = std::fs::read_dir(dir)
        .unwrap()
        .filter_map(|e| {
            let n = e.unwrap().file_name().into_string().unwrap();
            let k = n.strip_prefix(&format!("{name}."))?.parse().ok()?;
            Some((k, n))
        })
        .collect();
    numbered.sort();
    let mut names: Vec<String> = numbered.into_iter().rev().map(|(_, n)| n).collect();
    if path.exists() {
        names.push(name);
    }
    names
        .into_iter()
        .map(|n| {
            let b = std::fs::read(dir.join(&n)).unwrap();
            (n, b)
        })
        .collect()
}

/// Every line of the log at `path`, oldest first, headers included.
fn lines_of(path: &std::path::Path) -> Vec<Value> {
    log_files(path)
        .iter()
        .flat_map(|(_, b)| {
            String::from_utf8_lossy(b)
                .lines()
                .map(|l| serde_json::from_str::<Value>(l).expect("a JSON line"))
                .collect::<Vec<_>>()
        })
        .collect()
}

/// Sets the audit log's path, size and retention in the daemon's airlock.toml.
fn audit_settings(d: &Daemon, log: &std::path::Path, size: &str, keep: usize) {
    let toml = d.policies.join("airlock.toml");
    let text = std::fs::read_to_string(&toml).unwrap();
    let text = text
        .replace(
            "audit_log = \"audit.jsonl\"",
            &format!("audit_log = \"{}\"", log.display()),
        )
        .replace(
            "audit_log_size = \"64MiB\"",
            &format!("audit_log_size = \"{size}\""),
        )
        .replace("audit_log_keep = 8", &format!("audit_log_keep = {keep}"));
    assert!(
        text.contains(&format!("audit_log_keep = {keep}")),
        "shipped audit settings moved"
    );
    std::fs::write(&toml, text).unwrap();
}

/// `airlock audit verify --log LOG`: (exit code, stdout, stderr).
fn verify_log(log: &std::path::Path) -> (i32, String, String) {
    airlock_audit(&["verify", "--log", log.to_str().unwrap()])
}

struct Unmount(std::path::PathBuf);
impl Drop for Unmount {
    fn drop(&mut self) {
        let _ = Command::new("umount").arg("-l").arg(&self.0).status();
    }
}

/// The audit log on a tmpfs of 512 KiB and 16 inodes, rotated every 4 KiB, 2 old files
/// kept. Out of inodes, rotation cannot create the next file: calls commit on in the current
/// file and no file is removed. Out of space too, commits fail with `AUDIT_FAILED`, nothing is
/// published, and every file stays as it was. With space again, calls commit and the log
/// rotates without a restart; the chain verifies, and a restart continues its seq.
async fn full_audit_disk(unprivileged: bool) {
    require_root();
    let mut d = Daemon::new();
    let fs = d.dir.path().join("auditfs");
    std::fs::create_dir(&fs).unwrap();
    let owner = if unprivileged { 65534 } else { 0 };
    crate::harness::require_program("mount", "mount");
    let st = Command::new("mount")
        .args(["-t", "tmpfs", "-o"])
        .arg(format!(
            "size=512k,nr_inodes=16,mode=0700,uid={owner},gid={owner}"
        ))
        .arg("tmpfs")
        .arg(&fs)
        .status()
        .expect("mount");
    assert!(
        st.success(),
        "mount tmpfs (needs root and a kernel with tmpfs)"
    );
    let _unmount = Unmount(fs.clone());
    let log = fs.join("audit.jsonl");
    audit_settings(&d, &log, "4KiB", 2);
    if unprivileged {
        crate::sandbox::give_to_nobody(&d);
        d.user = Some((65534, 65534));
    }
    d.start();
    let c = d.client().await;
    session(&c, "s").await;
    let mut committed = 0u64;
    let write = |i: usize| json!({"session": "s", "text": format!("v{i}"), "out": "a.txt"});
    for i in 0..10 {
        let r = call(&c, "write_text", write(i)).await;
        assert!(!is_error(&r), "{r}");
        committed += 1;
    }
    let rotated = log_files(&log);
    assert_eq!(
        rotated.len(),
        3,
        "rotated with 2 kept: {:?}",
        rotated.iter().map(|f| &f.0).collect::<Vec<_>>()
    );

    // Out of inodes: one file that takes the space later, then empty files until none is left.
    let mut space = std::fs::File::create(fs.join("space")).unwrap();
    let mut n = 0;
    while std::fs::File::create(fs.join(format!("inode{n}"))).is_ok() {
        n += 1;
    }
    assert!(n > 0, "no inode was left to take");
    let before = log_files(&log);
    for i in 10..20 {
        let r = call(&c, "write_text", write(i)).await;
        assert!(
            !is_error(&r),
            "out of inodes, the current file still takes the commit: {r}"
        );
        committed += 1;
    }
    let grown = log_files(&log);
    assert_eq!(
        grown.iter().map(|f| &f.0).collect::<Vec<_>>(),
        before.iter().map(|f| &f.0).collect::<Vec<_>>(),
        "no file was removed or added while rotation could not create the next"
    );
    for ((_, old), (_, new)) in before.iter().zip(&grown) {
        assert!(new.starts_with(old), "a kept file lost lines");
    }
    assert!(
        grown.last().unwrap().1.len() > 4096,
        "the current file grew past its size"
    );

    // Out of space too: commits fail, nothing is published, every file stays.
    loop {
        use std::io::Write;
        if space.write_all(&[0u8; 4096]).is_err() {
            break;
        }
    }
    // The last page tmpfs gave the current file may still take a line or two.
    let mut content = "v19".to_string();
    let mut i = 20;
    loop {
        assert!(i < 50, "the full disk never failed a commit");
        let r = call(&c, "write_text", write(i)).await;
        i += 1;
        if is_error(&r) {
            assert_eq!(code(&r), "AUDIT_FAILED", "{r}");
            break;
        }
        committed += 1;
        content = format!("v{}", i - 1);
    }
    let full = log_files(&log);
    for _ in 0..3 {
        let r = call(&c, "write_text", write(i)).await;
        i += 1;
        assert!(is_error(&r), "a commit succeeded on a full audit disk: {r}");
        assert_eq!(code(&r), "AUDIT_FAILED", "{r}");
        assert_eq!(d.read("a.txt").as_deref(), Some(content.as_str()));
        assert_eq!(version(&c, "s").await, committed);
        assert!(d.job_dirs().is_empty(), "{:?}", d.job_dirs());
    }
    let now = log_files(&log);
    assert_eq!(
        now.iter().map(|f| &f.0).collect::<Vec<_>>(),
        grown.iter().map(|f| &f.0).collect::<Vec<_>>(),
        "a full disk removed or added a file"
    );
    for ((_, old), (_, new)) in grown.iter().chain(&full).zip(now.iter().chain(&now)) {
        assert!(
            new.starts_with(old),
            "a kept file lost lines on a full disk"
        );
    }

    // Space and inodes again: no restart, the next calls commit and the log rotates.
    drop(space);
    for e in std::fs::read_dir(&fs).unwrap() {
        let p = e.unwrap().path();
        let name = p.file_name().unwrap().to_str().unwrap().to_string();
        if name == "space" || name.starts_with("inode") {
            std::fs::remove_file(p).unwrap();
        }
    }
    for i in 25..35 {
        let r = call(&c, "write_text", write(i)).await;
        assert!(
            !is_error(&r),
            "with space again, calls commit without a restart: {r}"
        );
        committed += 1;
    }
    assert_eq!(d.read("a.txt").as_deref(), Some("v34"));
    assert_eq!(version(&c, "s").await, committed);
    let after = log_files(&log);
    assert_eq!(
        after.len(),
        3,
        "{:?}",
        after.iter().map(|f| &f.0).collect::<Vec<_>>()
    );
    assert!(!fs.join("audit.jsonl.next").exists());
    let (code_, out, err) = verify_log(&log);
    assert_eq!(code_, 0, "{out}{err}");
    assert!(out.contains("removed by retention"), "{out}");
    // Every commit that succeeded is in the log once, or in a file retention removed.
    let lines = lines_of(&log);
    assert!(
        lines
            .iter()
            .any(|e| e["kind"] == "commit" && e["detail"]["version"] == committed),
        "the last commit is in the log"
    );

    // A restart continues the chain: its seq goes on, no new genesis.
    drop(c);
    d.stop();
    let last = lines.last().unwrap()["seq"].as_u64().unwrap();
    d.start();
    let c = d.client().await;
    let r = call(&c, "write_text", write(99)).await;
    assert!(!is_error(&r), "{r}");
    drop(c);
    d.stop();
    let lines = lines_of(&log);
    let at = lines
        .iter()
        .position(|e| e["seq"].as_u64() == Some(last))
        .expect("the last line before the restart is kept");
    assert_eq!(
        lines[at + 1]["seq"].as_u64(),
        Some(last + 1),
        "{}",
        lines[at + 1]
    );
    assert!(lines
        .windows(2)
        .all(|w| w[1]["seq"].as_u64() == w[0]["seq"].as_u64().map(|s| s + 1)));
    assert!(lines
        .iter()
        .all(|e| e["detail"]["chain"] != "restarted" && e["detail"]["chain"] != "genesis"));
    let (code_, out, err) = verify_log(&log);
    assert_eq!(code_, 0, "{out}{err}");
}

#[tokio::test]
async fn a_full_audit_disk_loses_no_file_and_recovers_without_a_restart() {
    full_audit_disk(false).await;
}

#[tokio::test]
async fn a_full_audit_disk_loses_no_file_and_recovers_without_a_restart_unprivileged() {
    full_audit_disk(true).await;
}

/// A uid no grant names.
const INTRUDER: u32 = 54321;

/// Pipelines `n` `tools/call` lines as `uid` on one connection (`airlock connect` under
/// setpriv) and counts the replies' error codes. Fails after 60 s without a reply.
fn flood_as(d: &Daemon, uid: u32, n: usize) -> BTreeMap<String, usize> {
    let mut child = connect_as(d, uid, "--clear-groups")
        .spawn()
        .expect("setpriv airlock connect (util-linux setpriv is needed)");
    let mut stdin = child.stdin.take().unwrap();
    let stdout = child.stdout.take().unwrap();
    let (tx, rx) = std::sync::mpsc::channel();
    std::thread::spawn(move || {
        for line in std::io::BufReader::new(stdout)
            .lines()
            .map_while(Result::ok)
        {
            if tx.send(line).is_err() {
                return;
            }
        }
    });
    let next = |what: &str| -> Value {
        let l = rx
            .recv_timeout(Duration::from_secs(60))
            .unwrap_or_else(|_| panic!("no {what} within 60 s"));
        serde_json::from_str(&l).expect("a JSON-RPC line")
    };
    use std::io::Write;
    writeln!(
        stdin,
        "{}",
        json!({"jsonrpc": "2.0", "id": 0, "method": "initialize", "params": {
            "protocolVersion": "2025-11-25", "capabilities": {},
            "clientInfo": {"name": "flood", "version": "0"}}})
    )
    .unwrap();
    assert!(next("initialize reply")["result"].is_object());
    let writer = std::thread::spawn(move || {
        let mut buf = String::new();
        buf.push_str(&json!({"jsonrpc": "2.0", "method": "notifications/initialized"}).to_string());
        buf.push('\n');
        for i in 1..=n {
            let tool = if i % 2 == 0 {
                "session_create"
            } else {
                "write_text"
            };
            buf.push_str(
                &json!({"jsonrpc": "2.0", "id": i, "method": "tools/call",
                    "params": {"name": tool, "arguments": {"id": format!("x{i}"), "session": "s", "text": "t", "out": "o.txt"}}})
                .to_string(),
            );
            buf.push('\n');
            if buf.len() > 1 << 16 {
                stdin.write_all(buf.as_bytes()).unwrap();
                buf.clear();
            }
        }
        stdin.write_all(buf.as_bytes()).unwrap();
        stdin
    });
    let mut codes = BTreeMap::new();
    let mut replies = 0;
    while replies < n {
        let m = next("reply to a flooded call");
        if m.get("id").is_none() {
            continue;
        }
        replies += 1;
        let c = m["result"]["structuredContent"]["error"]["code"]
            .as_str()
            .unwrap_or("none")
            .to_string();
        *codes.entry(c).or_insert(0) += 1;
    }
    drop(writer.join().unwrap());
    let _ = child.kill();
    let _ = child.wait();
    codes
}

/// 20,000 denied calls of a uid no grant names, pipelined on one connection, with the log
/// rotated every 64 KiB and 2 old files kept (the flood would fill them 40 times over if every
/// denial were a line): the commit made before the flood is still in the kept files and in
/// the ring, `verify` passes, and every denial is accounted for (the ones written one by one
/// plus the aggregates' counts).
async fn deny_flood(unprivileged: bool) {
    require_root();
    let mut d = Daemon::new();
    let toml = d.policies.join("airlock.toml");
    let text = std::fs::read_to_string(&toml).unwrap();
    assert!(
        text.contains("socket_mode = \"0600\""),
        "shipped socket_mode moved"
    );
    std::fs::write(
        &toml,
        text.replace("socket_mode = \"0600\"", "socket_mode = \"0666\""),
    )
    .unwrap();
    let log = d.state.join("audit.jsonl");
    audit_settings(&d, std::path::Path::new("audit.jsonl"), "64KiB", 2);
    if unprivileged {
        crate::sandbox::give_to_nobody(&d);
        d.user = Some((65534, 65534));
    }
    d.start();
    let c = d.client().await;
    session(&c, "s").await;
    let r = call(
        &c,
        "write_text",
        json!({"session": "s", "text": "before the flood", "out": "a.txt"}),
    )
    .await;
    assert!(!is_error(&r), "{r}");
    let lines = lines_of(&log);
    let commit = lines
        .iter()
        .find(|e| e["kind"] == "commit" && e["tool"] == "write_text")
        .expect("the commit")
        .clone();

    const N: usize = 20_000;
    let codes = flood_as(&d, INTRUDER, N);
    assert_eq!(codes.get("TOOL_FORBIDDEN"), Some(&N), "{codes:?}");
    // An event of another kind writes the aggregates pending.
    let r = call(
        &c,
        "write_text",
        json!({"session": "s", "text": "after the flood", "out": "b.txt"}),
    )
    .await;
    assert!(!is_error(&r), "{r}");

    let lines = lines_of(&log);
    assert!(
        lines.contains(&commit),
        "the commit made before the flood was pushed out of the kept files"
    );
    let denials: Vec<&Value> = lines
        .iter()
        .filter(|e| e["kind"] == "deny" && e["principal"]["uid"] == json!(INTRUDER))
        .collect();
    let one_by_one = denials
        .iter()
        .filter(|e| e["detail"]["aggregated"].is_null())
        .count();
    let aggregated: u64 = denials
        .iter()
        .filter_map(|e| e["detail"]["aggregated"]["count"].as_u64())
        .sum();
    assert_eq!(
        one_by_one as u64 + aggregated,
        N as u64,
        "{one_by_one} + {aggregated}"
    );
    assert!(one_by_one <= 64, "{one_by_one} denials written one by one");
    assert!(aggregated > 0);
    let agg = denials
        .iter()
        .find(|e| !e["detail"]["aggregated"].is_null())
        .unwrap();
    let tools = &agg["detail"]["aggregated"]["tools"];
    assert!(
        tools["session_create"].as_u64() > Some(0) && tools["write_text"].as_u64() > Some(0),
        "{agg}"
    );
    assert!(
        agg["detail"]["aggregated"]["codes"]["TOOL_FORBIDDEN"].as_u64() > Some(0),
        "{agg}"
    );
    let (code_, out, err) = verify_log(&log);
    assert_eq!(code_, 0, "{out}{err}");
    // The ring was not flooded empty of the commit either.
    let ring = audit(&c).await;
    assert!(ring.contains(&commit), "the ring lost the commit");
    // Denials still counted when the daemon stops are written on its way out.
    let codes = flood_as(&d, INTRUDER, 100);
    assert_eq!(codes.get("TOOL_FORBIDDEN"), Some(&100), "{codes:?}");
    drop(c);
    d.stop();
    let counted: u64 = lines_of(&log)
        .iter()
        .filter(|e| e["kind"] == "deny" && e["principal"]["uid"] == json!(INTRUDER))
        .map(|e| e["detail"]["aggregated"]["count"].as_u64().unwrap_or(1))
        .sum();
    assert_eq!(counted, N as u64 + 100);
    let (code_, out, err) = verify_log(&log);
    assert_eq!(code_, 0, "{out}{err}");
}

#[tokio::test]
async fn a_flood_of_denials_pushes_no_commit_out_and_every_denial_is_counted() {
    deny_flood(false).await;
}

#[tokio::test]
async fn a_flood_of_denials_pushes_no_commit_out_and_every_denial_is_counted_unprivileged() {
    deny_flood(true).await;
}

/// `airlock audit verify` on a daemon's log: first lines removed from a file never rotated,
/// a rotated file removed in the middle, and the oldest removed without a retention record
/// are breaks (exit 1, each named); files retention removed are reported as such (exit 0).
#[tokio::test]
async fn verify_tells_retention_from_removed_lines_and_files() {
    let mut d = Daemon::new();
    audit_settings(&d, std::path::Path::new("audit.jsonl"), "4KiB", 20);
    d.start();
    let c = d.client().await;
    session(&c, "s").await;
    // Never rotated yet: its first lines removed.
    let log = d.state.join("audit.jsonl");
    let whole = std::fs::read_to_string(&log).unwrap();
    let cut: String = whole.lines().skip(2).map(|l| format!("{l}\n")).collect();
    std::fs::write(&log, &cut).unwrap();
    let (code_, out, err) = verify_log(&log);
    assert_eq!(code_, 1, "first lines removed passed verify: {out}");
    assert!(err.contains("does not begin with a header line"), "{err}");
    std::fs::write(&log, &whole).unwrap();
    assert_eq!(verify_log(&log).0, 0);
    commit_writes(&c, "s", "v", 12).await;
    drop(c);
    d.stop();
    let files = log_files(&log);
    assert!(
        files.len() >= 4,
        "{:?}",
        files.iter().map(|f| &f.0).collect::<Vec<_>>()
    );
    let (code_, out, err) = verify_log(&log);
    assert_eq!(code_, 0, "{out}{err}");
    assert!(out.contains("from its genesis header"), "{out}");
    // A rotated file missing in the middle.
    let middle = d.state.join("audit.jsonl.2");
    let saved = std::fs::read(&middle).unwrap();
    std::fs::remove_file(&middle).unwrap();
    let (code_, _, err) = verify_log(&log);
    assert_eq!(code_, 1, "a missing middle file passed verify");
    assert!(err.contains("1 file(s) missing in the middle"), "{err}");
    std::fs::write(&middle, saved).unwrap();
    // The oldest file removed, which retention (20 kept) did not do.
    let oldest = d.state.join(&files[0].0);
    std::fs::remove_file(&oldest).unwrap();
    let (code_, _, err) = verify_log(&log);
    assert_eq!(code_, 1, "the genesis file removed passed verify");
    assert!(err.contains("removed outside retention"), "{err}");
    // Retention removes the oldest (keep 1): reported as retention, exit 0.
    std::fs::write(&oldest, &files[0].1).unwrap();
    let toml = d.policies.join("airlock.toml");
    let t = std::fs::read_to_string(&toml)
        .unwrap()
        .replace("audit_log_keep = 20", "audit_log_keep = 1");
    std::fs::write(&toml, t).unwrap();
    d.start();
    let c = d.client().await;
    commit_writes(&c, "s", "w", 6).await;
    drop(c);
    d.stop();
    assert_eq!(log_files(&log).len(), 2);
    let (code_, out, err) = verify_log(&log);
    assert_eq!(code_, 0, "{out}{err}");
    assert!(
        out.contains("older file(s) were removed by retention"),
        "{out}"
    );
}
