//! Issue #9 points 2-4: every lifecycle of the execution model, read back both from the
//! `airlock://audit/events` resource and from the durable log; the chain `airlock audit
//! verify` checks; a failing sink rolling the commit back; the resource template, its
//! subscriptions, and `airlock audit` reading the files.

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
    let (code, out, err) = airlock_audit(&["verify", "--log", log.to_str().unwrap()]);
    assert_eq!(code, 0, "{out}{err}");
    d.start();
    let c = d.client().await;
    session(&c, "after").await;
    d.stop();
    let (code, out, err) = airlock_audit(&["verify", "--log", log.to_str().unwrap()]);
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
    for i in 0..3 {
        let r = call(
            &c,
            "write_text",
            json!({"session": "s", "text": format!("v{i}"), "out": "a.txt"}),
        )
        .await;
        assert!(!is_error(&r), "{r}");
    }
    drop(c);
    d.stop();
    let log = d.state.join("audit.jsonl");
    let mode = std::fs::metadata(&log).unwrap().permissions().mode() & 0o7777;
    assert_eq!(mode, 0o600, "the audit log's mode");
    let logs = log.to_str().unwrap();
    let (code, out, err) = airlock_audit(&["verify", "--log", logs]);
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
    let (code, _, err) = airlock_audit(&["verify", "--log", logs]);
    assert_eq!(code, 1, "an edited line passed verify");
    assert!(err.contains(&format!(":{}:", i + 2)), "{err}");
    // A rollback-worthy line removed.
    let mut removed = lines.clone();
    removed.remove(i);
    std::fs::write(&log, removed.join("\n") + "\n").unwrap();
    let (code, _, err) = airlock_audit(&["verify", "--log", logs]);
    assert_eq!(code, 1, "a removed line passed verify");
    assert!(err.contains("edited, removed or inserted"), "{err}");
    // Restored, it verifies again.
    std::fs::write(&log, &good).unwrap();
    assert_eq!(airlock_audit(&["verify", "--log", logs]).0, 0);
}

#[tokio::test]
async fn a_failing_audit_sink_rolls_the_commit_back_with_audit_failed() {
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
    let (code, out, err) =
        airlock_audit(&["verify", "--log", fs.join("audit.jsonl").to_str().unwrap()]);
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
    std::thread::sleep(Duration::from_millis(300));
    while r.recv_within(Duration::from_millis(200)).is_some() {}
    r.call(18, "session_create", json!({"id": "u"}));
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
