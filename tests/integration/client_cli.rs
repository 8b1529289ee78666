//! `airlock call` and `airlock connect` as a client's caller sees them: exit codes, one
//! clear line on stderr, replies never lost at the end of stdin, cancellation on Ctrl-C.

use std::io::{BufRead, BufReader, Read, Write};
use std::process::{Child, Command, ExitStatus, Stdio};
use std::time::{Duration, Instant};

use serde_json::{json, Value};

use crate::harness::*;

/// Waits up to `within` for `child` to exit.
fn exit_within(child: &mut Child, within: Duration) -> ExitStatus {
    let deadline = Instant::now() + within;
    loop {
        if let Some(s) = child.try_wait().expect("try_wait") {
            return s;
        }
        if Instant::now() > deadline {
            let _ = child.kill();
            panic!("still running {within:?} later");
        }
        std::thread::sleep(Duration::from_millis(10));
    }
}

fn stderr_of(child: &mut Child) -> String {
    let mut s = String::new();
    child
        .stderr
        .take()
        .expect("piped stderr")
        .read_to_string(&mut s)
        .expect("stderr");
    s
}

fn sigint(child: &Child) {
    // SAFETY: kill(2) on the pid of a child this test spawned and has not reaped.
    let rc = unsafe { libc::kill(child.id() as i32, libc::SIGINT) };
    assert_eq!(rc, 0, "kill SIGINT");
}

fn airlock_call(d: &Daemon, extra: &[&str]) -> Child {
    Command::new(BIN)
        .arg("call")
        .args(extra)
        .arg("--socket")
        .arg(&d.socket)
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .expect("spawn airlock call")
}

async fn assert_rolled_back(d: &Daemon, c: &Client, sleeper: &str) {
    wait_for_event(c, "slow_write", "rollback").await;
    wait_no_process(sleeper).await;
    assert_eq!(d.read("o.txt"), None, "a cancelled call published");
    assert_eq!(version(c, "k").await, 0);
    wait_until("the job dir to go", || d.job_dirs().is_empty()).await;
}

#[tokio::test]
async fn call_ctrl_c_cancels_over_the_wire_says_cancelled_and_exits_130() {
    let mut d = Daemon::new();
    d.start();
    let c = d.client().await;
    session(&c, "k").await;
    let mut child = airlock_call(
        &d,
        &[
            "slow_write",
            "--session",
            "k",
            "--arg",
            "seconds=30.21",
            "--arg",
            "out=o.txt",
        ],
    );
    wait_for_process("sleep 30.21").await;
    sigint(&child);
    let status = exit_within(&mut child, Duration::from_secs(2));
    let err = stderr_of(&mut child);
    assert_eq!(status.code(), Some(130), "stderr: {err}");
    assert!(err.contains("cancelled"), "stderr: {err}");
    assert_eq!(err.lines().count(), 1, "one line on stderr: {err}");
    assert_rolled_back(&d, &c, "sleep 30.21").await;
    // The daemon still serves.
    assert_eq!(version(&c, "k").await, 0);
}

#[tokio::test]
async fn call_timeout_cancels_says_cancelled_and_exits_124() {
    let mut d = Daemon::new();
    d.start();
    let c = d.client().await;
    session(&c, "k").await;
    let mut child = airlock_call(
        &d,
        &[
            "slow_write",
            "--session",
            "k",
            "--arg",
            "seconds=30.22",
            "--arg",
            "out=o.txt",
            "--timeout",
            "1",
        ],
    );
    wait_for_process("sleep 30.22").await;
    let status = exit_within(&mut child, Duration::from_secs(3));
    let err = stderr_of(&mut child);
    assert_eq!(status.code(), Some(124), "stderr: {err}");
    assert!(
        err.contains("cancelled") && err.contains("no result within 1s"),
        "stderr: {err}"
    );
    assert_rolled_back(&d, &c, "sleep 30.22").await;
}

fn bridge(socket: &std::path::Path) -> Child {
    Command::new(BIN)
        .arg("connect")
        .arg("--socket")
        .arg(socket)
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .expect("spawn airlock connect")
}

const INIT: &str = r#"{"jsonrpc":"2.0","id":0,"method":"initialize","params":{"protocolVersion":"2025-11-25","capabilities":{},"clientInfo":{"name":"pipe","version":"0"}}}
{"jsonrpc":"2.0","method":"notifications/initialized"}
"#;

#[tokio::test]
async fn connect_with_piped_stdin_writes_every_reply_before_closing() {
    let mut d = Daemon::new();
    d.start();
    let c = d.client().await;
    session(&c, "k").await;
    // Like `printf ... | airlock connect`: everything at once, then end of stdin, while a
    // call is still running.
    let mut input = INIT.to_string();
    input.push_str(r#"{"jsonrpc":"2.0","id":1,"method":"tools/call","params":{"name":"slow_write","arguments":{"session":"k","seconds":0.7,"out":"o.txt"}}}"#);
    input.push('\n');
    input.push_str(r#"{"jsonrpc":"2.0","id":"two","method":"tools/list"}"#);
    input.push('\n');
    input.push_str(r#"{"jsonrpc":"2.0","id":3,"method":"ping"}"#);
    input.push('\n');
    let mut child = bridge(&d.socket);
    child
        .stdin
        .take()
        .expect("stdin")
        .write_all(input.as_bytes())
        .expect("write");
    // stdin is closed here (dropped).
    let status = exit_within(&mut child, Duration::from_secs(10));
    let mut out = String::new();
    child
        .stdout
        .take()
        .expect("stdout")
        .read_to_string(&mut out)
        .expect("stdout");
    let err = stderr_of(&mut child);
    assert!(status.success(), "exit {status}; stderr: {err}");
    assert_eq!(err, "", "nothing on stderr");
    let replies: Vec<Value> = out
        .lines()
        .map(|l| serde_json::from_str(l).expect("json line"))
        .collect();
    for id in [json!(0), json!(1), json!("two"), json!(3)] {
        assert!(
            replies
                .iter()
                .any(|r| r["id"] == id && r.get("method").is_none()),
            "no reply to {id}: {out}"
        );
    }
    let call = replies.iter().find(|r| r["id"] == 1).expect("call reply");
    assert_eq!(call["result"]["isError"], false, "{call}");
    assert_eq!(d.read("o.txt").as_deref(), Some("done\n"));
    assert_eq!(version(&c, "k").await, 1);
}

#[tokio::test]
async fn connect_exits_nonzero_with_one_line_when_the_daemon_dies_mid_call() {
    let mut d = Daemon::new();
    d.start();
    let c = d.client().await;
    session(&c, "k").await;
    drop(c);
    let mut child = bridge(&d.socket);
    let mut stdin = child.stdin.take().expect("stdin");
    stdin.write_all(INIT.as_bytes()).expect("write");
    stdin
        .write_all(
            br#"{"jsonrpc":"2.0","id":1,"method":"tools/call","params":{"name":"slow_write","arguments":{"session":"k","seconds":30.23,"out":"o.txt"}}}
"#,
        )
        .expect("write");
    wait_for_process("sleep 30.23").await;
    d.kill9();
    // stdin stays open: the bridge must not wait for it.
    let status = exit_within(&mut child, Duration::from_secs(2));
    let err = stderr_of(&mut child);
    assert_eq!(status.code(), Some(1), "stderr: {err}");
    assert_eq!(err.lines().count(), 1, "one line: {err}");
    assert!(
        err.contains("the daemon closed the connection with 1 request(s) unanswered"),
        "{err}"
    );
    drop(stdin);
}

#[test]
fn connect_names_what_is_wrong_with_the_socket_path() {
    crate::harness::require_program("setpriv", "util-linux");
    let dir = tempfile::tempdir().expect("tempdir");
    let run = |p: &std::path::Path| {
        let out = Command::new(BIN)
            .arg("connect")
            .arg("--socket")
            .arg(p)
            .stdin(Stdio::null())
            .output()
            .expect("run");
        (
            out.status.code(),
            String::from_utf8_lossy(&out.stderr).into_owned(),
        )
    };
    let (code, err) = run(&dir.path().join("missing.sock"));
    assert_eq!(code, Some(2));
    assert!(err.contains("no such file"), "{err}");

    let file = dir.path().join("file.sock");
    std::fs::write(&file, "").expect("file");
    let (code, err) = run(&file);
    assert_eq!(code, Some(2));
    assert!(err.contains("not a socket"), "{err}");

    let stale = dir.path().join("stale.sock");
    drop(std::os::unix::net::UnixListener::bind(&stale).expect("bind"));
    let (code, err) = run(&stale);
    assert_eq!(code, Some(2));
    assert!(err.contains("nobody is listening"), "{err}");

    // Permission: a socket of mode 0 refuses everyone but root.
    let locked = dir.path().join("locked.sock");
    let _listener = std::os::unix::net::UnixListener::bind(&locked).expect("bind");
    std::fs::set_permissions(&locked, std::os::unix::fs::PermissionsExt::from_mode(0o000))
        .expect("chmod");
    // SAFETY: geteuid has no preconditions.
    if unsafe { libc::geteuid() } == 0 {
        // Root passes any mode: drop to nobody for this one.
        let out = Command::new("setpriv")
            .args(["--reuid=65534", "--regid=65534", "--clear-groups"])
            .arg(BIN)
            .arg("connect")
            .arg("--socket")
            .arg(&locked)
            .stdin(Stdio::null())
            .output()
            .expect("setpriv");
        let err = String::from_utf8_lossy(&out.stderr);
        assert_eq!(out.status.code(), Some(2), "{err}");
        assert!(err.contains("permission denied"), "{err}");
    } else {
        let (code, err) = run(&locked);
        assert_eq!(code, Some(2));
        assert!(err.contains("permission denied"), "{err}");
    }
}

/// A server that completes the MCP handshake, then reads only the first bytes of the next
/// request and nothing more (a daemon stuck, or a peer that stopped reading).
/// `started` gets a message once the first bytes of that request came.
fn stuck_server(
    socket: &std::path::Path,
    started: std::sync::mpsc::Sender<()>,
) -> std::thread::JoinHandle<()> {
    let listener = std::os::unix::net::UnixListener::bind(socket).expect("bind");
    std::thread::spawn(move || {
        let (stream, _) = listener.accept().expect("accept");
        let mut w = stream.try_clone().expect("clone");
        let mut r = BufReader::new(stream);
        let mut line = String::new();
        r.read_line(&mut line).expect("initialize");
        let init: Value = serde_json::from_str(&line).expect("json");
        let reply = json!({"jsonrpc": "2.0", "id": init["id"], "result": {
            "protocolVersion": init["params"]["protocolVersion"],
            "capabilities": {"tools": {}},
            "serverInfo": {"name": "stuck", "version": "0"}}});
        writeln!(w, "{reply}").expect("reply");
        line.clear();
        r.read_line(&mut line).expect("initialized");
        line.clear();
        r.read_line(&mut line).expect("tools/list");
        let list: Value = serde_json::from_str(&line).expect("json");
        writeln!(
            w,
            "{}",
            json!({"jsonrpc": "2.0", "id": list["id"], "result": {"tools": []}})
        )
        .expect("reply");
        let mut first = [0u8; 64];
        let _ = r.read(&mut first);
        let _ = started.send(());
        // Hold the connection, reading nothing, until the client is gone (the stuck server
        // is the behaviour under test).
        std::thread::sleep(Duration::from_secs(10));
    })
}

#[test]
fn call_second_ctrl_c_exits_at_once_while_the_cancel_is_still_going_out() {
    let dir = tempfile::tempdir().expect("tempdir");
    let socket = dir.path().join("stuck.sock");
    let (started, writing) = std::sync::mpsc::channel();
    let _server = stuck_server(&socket, started);
    // A call of 1.7 MB: its write fills the socket and waits for a reader that never comes,
    // so the first Ctrl-C's goodbye (the cancel, then the close) waits out its bounds.
    let args: Vec<String> = (0..14)
        .map(|i| format!("a{i}={}", "x".repeat(120 * 1024)))
        .collect();
    let mut child = Command::new(BIN)
        .args(["call", "slow_write", "--socket"])
        .arg(&socket)
        .args(args.iter().flat_map(|a| ["--arg", a.as_str()]))
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .expect("spawn airlock call");
    // The call is being written: its first bytes reached the server, so the client has
    // handed the request to its writer (which soon fills the socket and waits) and waits for
    // the result.
    writing
        .recv_timeout(Duration::from_secs(10))
        .expect("the call never came");
    sigint(&child);
    // The first Ctrl-C is handled (the second's handler is armed) once it says so.
    let mut stderr = BufReader::new(child.stderr.take().expect("piped stderr"));
    let mut first = String::new();
    while !first.contains("cancelled (interrupted);") {
        let before = first.len();
        stderr.read_line(&mut first).expect("stderr");
        assert!(
            first.len() > before,
            "the client ended without reporting the first Ctrl-C: {first}"
        );
    }
    let t = Instant::now();
    sigint(&child);
    let status = exit_within(&mut child, Duration::from_secs(2));
    let after_second = t.elapsed();
    let mut err = first;
    stderr.read_to_string(&mut err).expect("stderr");
    assert_eq!(status.code(), Some(130), "stderr: {err}");
    assert!(
        err.contains("interrupted again; exiting at once"),
        "the second Ctrl-C did not cut the goodbye short ({after_second:?}): {err}"
    );
}

#[tokio::test]
async fn connect_whose_reader_is_gone_disconnects_at_once_and_the_call_rolls_back() {
    // A client killed mid-call: whoever reads the bridge's stdout is gone. The bridge must
    // notice without writing (no reply is due yet) and without end of stdin, and disconnect,
    // so the daemon cancels the call; it must not hold the connection until the reply it
    // can no longer deliver, letting the write publish.
    let mut d = Daemon::new();
    d.start();
    let c = d.client().await;
    session(&c, "k").await;
    let mut child = bridge(&d.socket);
    let mut stdin = child.stdin.take().expect("stdin");
    stdin.write_all(INIT.as_bytes()).expect("write");
    stdin
        .write_all(
            br#"{"jsonrpc":"2.0","id":1,"method":"tools/call","params":{"name":"slow_write","arguments":{"session":"k","seconds":30.24,"out":"o.txt"}}}
"#,
        )
        .expect("write");
    wait_for_process("sleep 30.24").await;
    // Close the only read end of the bridge's stdout pipe; stdin stays open.
    drop(child.stdout.take());
    let status = exit_within(&mut child, Duration::from_secs(2));
    let err = stderr_of(&mut child);
    assert_eq!(status.code(), Some(1), "stderr: {err}");
    assert!(err.contains("stdout is closed"), "{err}");
    assert_rolled_back(&d, &c, "sleep 30.24").await;
    drop(stdin);
}
