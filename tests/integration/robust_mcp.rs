//! Robustness, the MCP side: hostile and careless clients against the real daemon. Framing
//! (every bad line answered, duplicate ids), bounded strings in the audit, bounded memory
//! under abuse (read from /proc), fair connections (handshake and idle timeouts, a per-uid
//! cap shown with a second uid), and signals (SIGTERM within its bound, SIGHUP survived).

use std::io::{Read, Write};
use std::os::unix::net::UnixStream as StdUnixStream;
use std::time::{Duration, Instant};

use serde_json::{json, Value};

use crate::harness::*;

/// Reads until EOF or `within`; returns the bytes and whether EOF was reached.
fn read_to_eof(s: &mut StdUnixStream, within: Duration) -> (Vec<u8>, bool) {
    let deadline = Instant::now() + within;
    let mut got = Vec::new();
    let mut buf = vec![0u8; 64 * 1024];
    loop {
        let left = deadline.saturating_duration_since(Instant::now());
        if left.is_zero() {
            return (got, false);
        }
        s.set_read_timeout(Some(left)).expect("timeout");
        match s.read(&mut buf) {
            Ok(0) => return (got, true),
            Ok(n) => got.extend_from_slice(&buf[..n]),
            Err(e) if e.kind() == std::io::ErrorKind::ConnectionReset => return (got, true),
            Err(_) => return (got, false),
        }
    }
}

/// Whether the daemon admitted `raw` and answered its `initialize`.
fn initialize_ok(raw: &mut Raw) -> bool {
    let init = json!({"jsonrpc": "2.0", "id": 0, "method": "initialize", "params": {
        "protocolVersion": "2025-11-25", "capabilities": {},
        "clientInfo": {"name": "raw-test", "version": "0"}}});
    if raw
        .stream
        .write_all(format!("{init}\n").as_bytes())
        .is_err()
    {
        return false;
    }
    let ok = raw
        .recv_within(Duration::from_secs(10))
        .is_some_and(|r| r["result"]["serverInfo"].is_object());
    if ok {
        raw.send(&json!({"jsonrpc": "2.0", "method": "notifications/initialized"}));
    }
    ok
}

/// A raw, initialized connection, once the daemon has a slot for it (a closed connection's
/// slot is given back when its task ends).
async fn admitted(d: &Daemon) -> Raw {
    let mut got = None;
    wait_until("a connection slot", || {
        let mut raw = d.raw();
        if initialize_ok(&mut raw) {
            got = Some(raw);
        }
        got.is_some()
    })
    .await;
    got.expect("admitted")
}

pub(crate) fn status_kib(pid: u32, field: &str) -> u64 {
    let status = std::fs::read_to_string(format!("/proc/{pid}/status")).expect("status");
    status
        .lines()
        .find(|l| l.starts_with(field))
        .and_then(|l| l.split_whitespace().nth(1))
        .and_then(|n| n.parse().ok())
        .unwrap_or_else(|| panic!("no {field} in /proc/{pid}/status"))
}

#[tokio::test]
async fn every_bad_line_is_answered_under_its_id_and_the_connection_keeps_working() {
    let mut d = Daemon::new();
    set_daemon(&d, &[("max_message_size", "\"1MiB\"")]);
    d.start();
    let mut raw = d.raw();
    raw.initialize();

    // 100,000 nested arrays: refused by a flat scan, answered under the id.
    let deep = format!(
        "{{\"jsonrpc\":\"2.0\",\"id\":1,\"method\":\"tools/list\",\"params\":{}{}}}\n",
        "[".repeat(100_000),
        "]".repeat(100_000)
    );
    raw.send_bytes(deep.as_bytes());
    let r = raw.response(1);
    assert_eq!(r["error"]["code"], -32600, "{r}");
    assert!(
        r["error"]["message"]
            .as_str()
            .unwrap()
            .contains("nested deeper"),
        "{r}"
    );

    // Invalid UTF-8.
    let mut bad = br#"{"jsonrpc":"2.0","id":2,"method":"tools/call","params":{"name":"cat","arguments":{"path":""#.to_vec();
    bad.extend_from_slice(b"\xff\xfe\"}}}\n");
    raw.send_bytes(&bad);
    let r = raw.response(2);
    assert_eq!(r["error"]["code"], -32700, "{r}");
    assert!(
        r["error"]["message"].as_str().unwrap().contains("UTF-8"),
        "{r}"
    );

    // An over-long line: discarded as it arrives, answered under the id at its start.
    let long = format!(
        "{{\"jsonrpc\":\"2.0\",\"id\":3,\"method\":\"tools/call\",\"params\":{{\"name\":\"cat\",\"arguments\":{{\"path\":\"{}\"}}}}}}\n",
        "a".repeat(3 << 20)
    );
    raw.send_bytes(long.as_bytes());
    let r = raw.response(3);
    assert_eq!(r["error"]["code"], -32600, "{r}");
    assert!(
        r["error"]["message"].as_str().unwrap().contains("limit"),
        "{r}"
    );

    // Not JSON at all: a null id, as nothing can be read.
    raw.send_bytes(b"this is not json\n");
    let r = raw.recv();
    assert_eq!(
        (r["id"].clone(), r["error"]["code"].clone()),
        (Value::Null, json!(-32700)),
        "{r}"
    );

    // Two requests in flight with one id: the second is rejected, the first completes.
    raw.call(4, "slow_read", json!({"seconds": 1}));
    raw.call(4, "slow_read", json!({"seconds": 0}));
    let first = raw.response(4);
    assert!(
        first["error"]["message"]
            .as_str()
            .is_some_and(|m| m.contains("already in flight")),
        "the duplicate must be answered first, while the first runs: {first}"
    );
    let second = raw.response(4);
    assert_eq!(second["result"]["isError"], false, "{second}");

    // And the connection still works.
    raw.send(&json!({"jsonrpc": "2.0", "id": 5, "method": "tools/list"}));
    let r = raw.response(5);
    assert!(
        r["result"]["tools"]
            .as_array()
            .is_some_and(|t| !t.is_empty()),
        "{r}"
    );
    assert!(d.job_dirs().is_empty());
}

#[tokio::test]
async fn client_strings_are_bounded_before_they_are_stored_or_audited() {
    let mut d = Daemon::new();
    d.start();
    let mut raw = d.raw();
    raw.send(&json!({"jsonrpc": "2.0", "id": 0, "method": "initialize", "params": {
        "protocolVersion": "2025-11-25", "capabilities": {},
        "clientInfo": {"name": "N".repeat(1 << 20), "version": "V".repeat(1 << 20), "title": "T".repeat(1 << 20)}}}));
    let r = raw.response(0);
    assert!(r["result"]["serverInfo"].is_object(), "{r}");
    raw.send(&json!({"jsonrpc": "2.0", "method": "notifications/initialized"}));
    raw.call(1, "session_get", json!({"session": "S".repeat(3 << 20)}));
    let r = raw.response(1);
    assert_eq!(r["result"]["isError"], true, "{}", &r.to_string()[..200]);
    let c = d.client().await;
    let events = audit(&c).await;
    let mine: Vec<&Value> = events
        .iter()
        .filter(|e| e["tool"] == "session_get")
        .collect();
    assert!(!mine.is_empty(), "no audit event of the call");
    for e in mine {
        let client = e["principal"]["client"].as_str().unwrap_or("");
        assert!(
            client.starts_with("NNN") && client.contains("…[truncated "),
            "client {client:.80}"
        );
        assert!(
            client.len() < 400,
            "client name of {} bytes in the audit",
            client.len()
        );
        let text = e.to_string();
        assert!(text.len() < 4096, "an audit event of {} bytes", text.len());
    }
}

/// The worst case documented in README ("Limits and memory"), in bytes, for this config.
#[allow(clippy::too_many_arguments)]
pub(crate) fn memory_bound(
    connections: u64,
    message: u64,
    queue: u64,
    calls: u64,
    output: u64,
    ring_bytes: u64,
    ring_events: u64,
) -> u64 {
    const E: u64 = 32; // parsed JSON per byte of text, worst case
    let per_connection = (2 * E + 2) * message + queue + (1 << 20) + E * (64 << 10);
    connections * per_connection + calls * 8 * output + ring_bytes + 256 * ring_events
}

#[tokio::test]
async fn memory_stays_under_the_documented_bound_under_abuse() {
    let mut d = Daemon::new();
    // The abuse (half-sent and pipelined large messages) needs 4 MiB messages; the other
    // limits are small so that the bound is tight enough to catch the growth once seen
    // without bounds (560 MB, 2 GB, 630 MB/connection).
    set_daemon(
        &d,
        &[
            ("max_message_size", "\"4MiB\""),
            ("max_connections", "2"),
            ("max_queued_bytes", "\"1MiB\""),
            ("max_concurrent_calls", "4"),
            ("audit_ring_bytes", "\"1MiB\""),
            ("write_timeout", "\"2s\""),
        ],
    );
    // At debug level the log would hold every 3 MiB request, twice.
    d.env.push(("AIRLOCK_LOG".into(), "info".into()));
    d.start();
    let pid = d.pid();
    let base = status_kib(pid, "VmRSS:") * 1024;
    let bound = base + memory_bound(2, 4 << 20, 1 << 20, 4, 1 << 20, 1 << 20, 10_000);

    // 1. A 1 MiB clientInfo.name, then 100 calls with 3 MiB bogus session ids, pipelined
    // (the replies are checked by their start: parsing 300 MiB in a debug test is slow).
    let mut raw = d.raw();
    raw.send(
        &json!({"jsonrpc": "2.0", "id": 0, "method": "initialize", "params": {
        "protocolVersion": "2025-11-25", "capabilities": {},
        "clientInfo": {"name": "N".repeat(1 << 20), "version": "0"}}}),
    );
    raw.response(0);
    raw.send(&json!({"jsonrpc": "2.0", "method": "notifications/initialized"}));
    let bogus = "S".repeat(3 << 20);
    let mut w = raw.stream.try_clone().expect("clone");
    let sender = std::thread::spawn(move || {
        for i in 1..=100 {
            let req = json!({"jsonrpc": "2.0", "id": i, "method": "tools/call", "params": {
                "name": "write_text", "arguments": {"session": bogus, "text": "x", "out": "o.txt"}}});
            w.write_all(format!("{req}\n").as_bytes()).expect("send");
        }
    });
    let mut lines = std::io::BufReader::new(raw.stream.try_clone().expect("clone"));
    for _ in 1..=100 {
        let mut line = Vec::new();
        std::io::BufRead::read_until(&mut lines, b'\n', &mut line).expect("a reply");
        let head = String::from_utf8_lossy(&line[..line.len().min(300)]).into_owned();
        assert!(
            head.contains("\"result\"")
                && (head.contains("NO_SUCH_SESSION") || head.contains("INVALID_ARGUMENT")),
            "{head}"
        );
    }
    sender.join().expect("sender");
    drop(lines);
    // 2. Reading the audit resource, many times.
    for i in 200..210 {
        raw.send(
            &json!({"jsonrpc": "2.0", "id": i, "method": "resources/read",
            "params": {"uri": "airlock://audit/events"}}),
        );
        let r = raw.response(i);
        let text = r["result"]["contents"][0]["text"].as_str().expect("text");
        assert!(
            text.len() <= 256 << 10,
            "an audit read of {} bytes",
            text.len()
        );
    }
    drop(raw);
    // 3. Two clients pipelining large results and never reading (the daemon's two
    // connections, once the first has gone).

    d.write("big.txt", &"x".repeat(1 << 20));
    let mut pipers = Vec::new();
    for _ in 0..2 {
        let mut p = admitted(&d).await;
        for i in 1..=200 {
            p.call(i, "cat", json!({"path": "big.txt"}));
        }
        pipers.push(p);
    }
    // Neither reads until the daemon has closed both (past write_timeout, with more than
    // max_queued_bytes of results ready): each must then be dropped. Reading earlier would
    // let a fast daemon deliver everything and prove nothing.
    wait_until_within(
        "the daemon to close both pipelining clients' connections",
        Duration::from_secs(120),
        || pipers.iter().all(|p| peer_closed(&p.stream)),
    )
    .await;
    // Each is dropped (reading what the kernel buffered, then EOF), not grown without end.
    for p in &mut pipers {
        let (_, eof) = read_to_eof(&mut p.stream, Duration::from_secs(60));
        assert!(eof, "a client that never reads was not dropped");
    }
    let hwm = status_kib(pid, "VmHWM:") * 1024;
    assert!(
        hwm < bound,
        "VmHWM {} MiB exceeds the documented bound {} MiB (base {} MiB)",
        hwm >> 20,
        bound >> 20,
        base >> 20
    );
    println!(
        "memory: base {} MiB, VmHWM {} MiB, bound {} MiB",
        base >> 20,
        hwm >> 20,
        bound >> 20
    );
    // The daemon still serves, and restarts.
    drop(pipers);
    let mut again = admitted(&d).await;
    again.call(1, "session_list", json!({}));
    let r = again.response(1);
    assert_eq!(r["result"]["isError"], false, "{r}");
    drop(again);
    assert!(d.stop().success());
    d.start();
    let c = d.client().await;
    assert!(!is_error(&call(&c, "session_list", json!({})).await));
}

#[tokio::test]
async fn a_client_that_does_not_read_is_dropped_after_the_write_timeout() {
    let mut d = Daemon::new();
    set_daemon(
        &d,
        &[
            ("write_timeout", "\"1s\""),
            ("max_queued_bytes", "\"8MiB\""),
        ],
    );
    d.start();
    d.write("big.txt", &"y".repeat(1 << 20));
    let mut raw = d.raw();
    raw.initialize();
    raw.call(1, "cat", json!({"path": "big.txt"}));
    // The reply (over 1 MiB) is more than the socket buffers; nobody reads it until the
    // daemon says it gave up on the client.
    wait_until_within(
        "the daemon's log saying the client did not read within write_timeout",
        Duration::from_secs(60),
        || d.log_text().contains("did not read a reply within 1s"),
    )
    .await;
    let (got, eof) = read_to_eof(&mut raw.stream, Duration::from_secs(30));
    assert!(eof, "the connection was not closed");
    assert!(
        got.len() < 1 << 20,
        "the whole reply ({} bytes) went out",
        got.len()
    );
    assert!(
        d.log_text().contains("did not read a reply within 1s"),
        "{}",
        d.log_text()
    );
    let c = d.client().await;
    assert!(!is_error(&call(&c, "session_list", json!({})).await));
}

#[tokio::test]
async fn handshake_and_idle_timeouts_close_connections_but_not_running_calls() {
    let mut d = Daemon::new();
    set_daemon(
        &d,
        &[("handshake_timeout", "\"1s\""), ("idle_timeout", "\"2s\"")],
    );
    d.start();
    // Silent, and a half line: both closed for want of `initialize`.
    let mut silent = StdUnixStream::connect(&d.socket).expect("connect");
    let mut half = StdUnixStream::connect(&d.socket).expect("connect");
    half.write_all(br#"{"jsonrpc":"2.0","id":0,"method":"initi"#)
        .expect("write");
    assert!(
        read_to_eof(&mut silent, Duration::from_secs(20)).1,
        "a silent client stayed"
    );
    assert!(
        read_to_eof(&mut half, Duration::from_secs(20)).1,
        "a half line stayed"
    );
    // Initialized, then idle: closed.
    let mut idle = d.raw();
    idle.initialize();
    assert!(
        read_to_eof(&mut idle.stream, Duration::from_secs(20)).1,
        "an idle client stayed"
    );
    // A call in flight longer than the idle timeout is not cut off.
    let mut busy = d.raw();
    busy.initialize();
    busy.call(1, "slow_read", json!({"seconds": 3}));
    let r = busy.response(1);
    assert_eq!(r["result"]["isError"], false, "{r}");
    let log = d.log_text();
    assert!(
        log.contains("handshake_timeout") && log.contains("idle_timeout"),
        "{log}"
    );
}

#[tokio::test]
async fn one_uid_at_its_cap_does_not_lock_out_another() {
    crate::harness::require_program("setpriv", "util-linux");
    require_root();
    let mut d = Daemon::new();
    set_daemon(
        &d,
        &[
            ("max_connections_per_uid", "2"),
            ("socket_mode", "\"0666\""),
        ],
    );
    // nobody may list sessions (no grant, no access).
    let conf = d.policies.join("airlock.toml");
    let text = std::fs::read_to_string(&conf).expect("airlock.toml");
    std::fs::write(
        &conf,
        format!("[[grant]]\nuids = [65534]\ncapabilities = [\"read\"]\n{text}"),
    )
    .expect("airlock.toml");
    d.start();
    // Root holds its two connections, one idle and one with an unfinished line.
    let mut a = d.raw();
    a.initialize();
    let mut b = StdUnixStream::connect(&d.socket).expect("connect");
    b.write_all(b"{\"jsonrpc\":").expect("write");
    let mut c = d.raw();
    let r = c.recv();
    assert!(
        r["error"]["message"]
            .as_str()
            .is_some_and(|m| m.contains("uid 0 already holds its maximum of 2")),
        "{r}"
    );
    assert!(read_to_eof(&mut c.stream, Duration::from_secs(10)).1);
    // Another uid still gets in.
    let out = std::process::Command::new("setpriv")
        .args(["--reuid=65534", "--regid=65534", "--clear-groups", "--"])
        .arg(BIN)
        .args(["call", "session_list", "--socket"])
        .arg(&d.socket)
        .output()
        .expect("setpriv airlock call");
    assert!(
        out.status.success(),
        "nobody was locked out: {}\n{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    assert!(String::from_utf8_lossy(&out.stdout).contains("sessions"));
    // Root gets a slot back when one of its connections closes.
    drop(a);
    drop(admitted(&d).await);
    drop(b);
}

#[tokio::test]
async fn sigterm_stops_the_daemon_within_its_bound_whatever_the_clients_do() {
    let mut d = Daemon::new();
    set_daemon(
        &d,
        &[("shutdown_timeout", "\"3s\""), ("write_timeout", "\"60s\"")],
    );
    d.start();
    d.write("big.txt", &"z".repeat(1 << 20));
    // A client that pipelines large results and never reads.
    let mut piper = d.raw();
    piper.initialize();
    for i in 1..=20 {
        piper.call(i, "cat", json!({"path": "big.txt"}));
    }
    // A half line, many idle connections, and a write call in flight.
    let mut half = StdUnixStream::connect(&d.socket).expect("connect");
    half.write_all(b"{\"jsonrpc\":\"2.0\",").expect("write");
    let idle: Vec<Raw> = (0..50).map(|_| d.raw()).collect();
    let mut busy = d.raw();
    busy.initialize();
    busy.call(1, "session_create", json!({"id": "s"}));
    busy.response(1);
    busy.call(
        2,
        "slow_write",
        json!({"session": "s", "seconds": 30, "out": "slow.txt"}),
    );
    wait_for_process("sleep").await;
    let files = |d: &Daemon| -> Vec<(String, Vec<u8>)> {
        snapshot(&d.workspace)
            .into_iter()
            .filter(|(name, _)| !name.starts_with(".airlock-job-"))
            .collect()
    };
    let before = files(&d);

    let mut child = d.child.take().expect("running");
    let start = Instant::now();
    // SAFETY: kill(2) on our own child's pid.
    unsafe { libc::kill(child.id() as i32, libc::SIGTERM) };
    // Documented: the daemon exits within shutdown_timeout plus two seconds.
    let bound = Duration::from_secs(3 + 2);
    let status = loop {
        if let Some(st) = child.try_wait().expect("wait") {
            break st;
        }
        if start.elapsed() > bound {
            let _ = child.kill();
            let _ = child.wait();
            panic!("still running {bound:?} after SIGTERM:\n{}", d.log_text());
        }
        std::thread::sleep(Duration::from_millis(20));
    };
    assert!(status.success(), "exit status {status}");
    let after = files(&d);
    let names = |v: &[(String, Vec<u8>)]| v.iter().map(|(n, _)| n.clone()).collect::<Vec<_>>();
    assert_eq!(names(&after), names(&before), "the workspace changed");
    assert!(after == before, "a file's content changed");
    assert!(!d.socket.exists(), "the socket was left behind");
    drop((idle, half));
    // It restarts and serves; nothing of the cancelled call was published.
    d.start();
    assert!(d.read("slow.txt").is_none());
    let c = d.client().await;
    assert_eq!(version(&c, "s").await, 0);
    assert!(d.job_dirs().is_empty());
}

#[tokio::test]
async fn sighup_is_logged_and_the_daemon_keeps_serving() {
    let mut d = Daemon::new();
    d.start();
    let c = d.client().await;
    session(&c, "h").await;
    for _ in 0..3 {
        // SAFETY: kill(2) on our own child's pid.
        unsafe { libc::kill(d.pid() as i32, libc::SIGHUP) };
    }
    wait_until("the SIGHUP log line", || d.log_text().contains("SIGHUP")).await;
    assert!(
        d.child
            .as_mut()
            .expect("running")
            .try_wait()
            .expect("wait")
            .is_none(),
        "SIGHUP killed the daemon"
    );
    let r = call(
        &c,
        "write_text",
        json!({"session": "h", "text": "after", "out": "h.txt"}),
    )
    .await;
    assert!(!is_error(&r), "{r}");
    assert_eq!(d.read("h.txt").as_deref(), Some("after"));
    // SIGHUP reloads the (unchanged) policies: systemd::sighup_reloads_* covers the rest.
    assert!(d.log_text().contains("SIGHUP: reloading the policies"));
    assert!(d.stop().success());
}
