//! airlock under systemd's protocols, with the test in systemd's place: socket activation
//! (fd 3, LISTEN_PID, LISTEN_FDS, LISTEN_FDNAMES), sd_notify on a datagram socket the test
//! listens on, SIGTERM during a call, SIGHUP reloads.

use std::os::fd::AsRawFd;
use std::os::unix::net::{UnixDatagram, UnixListener};
use std::os::unix::process::CommandExt;
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use serde_json::json;

use crate::harness::*;

/// A socket systemd would bind, passed as fd 3 to `airlock serve` started the way systemd
/// starts it (`sh -c 'LISTEN_PID=$$ exec ...'` keeps the pid, so LISTEN_PID is the daemon's),
/// under the unit's `UMask=0077`.
fn spawn_activated(
    d: &mut Daemon,
    listener: &UnixListener,
    fd_name: &str,
    notify: &std::path::Path,
) {
    spawn_activated_with(d, listener, fd_name, notify, Some("2000000"));
}

/// As [`spawn_activated`], with `WATCHDOG_USEC` set only if `watchdog_usec` is.
fn spawn_activated_with(
    d: &mut Daemon,
    listener: &UnixListener,
    fd_name: &str,
    notify: &std::path::Path,
    watchdog_usec: Option<&str>,
) {
    spawn_activated_fds(d, &[listener], fd_name, notify, watchdog_usec);
}

/// As [`spawn_activated`], with `listeners` passed as fds 3, 4, ... (`LISTEN_FDS` their
/// count) and `fd_names` as `LISTEN_FDNAMES`.
fn spawn_activated_fds(
    d: &mut Daemon,
    listeners: &[&UnixListener],
    fd_names: &str,
    notify: &std::path::Path,
    watchdog_usec: Option<&str>,
) {
    const MAX: usize = 4;
    assert!(listeners.len() <= MAX, "at most {MAX} listeners");
    let log = std::fs::OpenOptions::new()
        .create(true)
        .append(true)
        .open(&d.log)
        .expect("log");
    let mut cmd = Command::new("/bin/sh");
    cmd.arg("-c")
        .arg("umask 077; LISTEN_PID=$$ exec \"$0\" \"$@\"")
        .arg(BIN)
        .arg("serve")
        .arg("--policies")
        .arg(&d.policies)
        .arg("--socket")
        .arg(&d.socket)
        .arg("--workspace")
        .arg(&d.workspace)
        .arg("--state-dir")
        .arg(&d.state)
        .env("LISTEN_FDS", listeners.len().to_string())
        .env("LISTEN_FDNAMES", fd_names)
        .env("NOTIFY_SOCKET", notify)
        .env("AIRLOCK_LOG", "debug")
        .stdin(Stdio::null())
        .stdout(Stdio::null())
        .stderr(Stdio::from(log));
    if let Some(w) = watchdog_usec {
        cmd.env("WATCHDOG_USEC", w);
    }
    let mut fds = [-1; MAX];
    for (slot, l) in fds.iter_mut().zip(listeners) {
        *slot = l.as_raw_fd();
    }
    let count = listeners.len();
    // SAFETY: between fork and exec only fcntl and dup2 run, both async-signal-safe, on the
    // listeners' fds, open in the parent (and so in the child) for the whole spawn. Each is
    // first copied above 100, so that a listener already at fd 3 or 4 is not overwritten
    // before it is moved, and dup2 always makes a new, inheritable fd.
    unsafe {
        cmd.pre_exec(move || {
            let mut high = [-1; MAX];
            for i in 0..count {
                high[i] = libc::fcntl(fds[i], libc::F_DUPFD_CLOEXEC, 100);
                if high[i] < 0 {
                    return Err(std::io::Error::last_os_error());
                }
            }
            for (i, fd) in high.iter().take(count).enumerate() {
                if libc::dup2(*fd, 3 + i as i32) < 0 {
                    return Err(std::io::Error::last_os_error());
                }
            }
            Ok(())
        });
    }
    d.child = Some(cmd.spawn().expect("spawn airlock serve"));
}

/// The test's end of NOTIFY_SOCKET.
fn notify_socket(d: &Daemon) -> (UnixDatagram, std::path::PathBuf) {
    let path = d.dir.path().join("notify.sock");
    let sock = UnixDatagram::bind(&path).expect("bind notify socket");
    (sock, path)
}

/// Datagrams until one has a line containing `want` (every one received is returned), or panics after
/// 20 s naming what arrived.
fn recv_until(sock: &UnixDatagram, want: &str, d: &Daemon) -> Vec<String> {
    let deadline = Instant::now() + Duration::from_secs(20);
    let mut got = Vec::new();
    let mut buf = vec![0u8; 4096];
    loop {
        let left = deadline.saturating_duration_since(Instant::now());
        assert!(
            !left.is_zero(),
            "no sd_notify message with {want:?} within 20 s; got {got:?}\n{}",
            d.log_text()
        );
        sock.set_read_timeout(Some(left)).expect("timeout");
        if let Ok(n) = sock.recv(&mut buf) {
            let m = String::from_utf8_lossy(&buf[..n]).into_owned();
            let done = m.lines().any(|l| l.contains(want));
            got.push(m);
            if done {
                return got;
            }
        }
    }
}

fn sigterm(pid: u32) {
    // SAFETY: kill(2) on the test's own child.
    assert_eq!(unsafe { libc::kill(pid as i32, libc::SIGTERM) }, 0);
}

fn sighup(pid: u32) {
    // SAFETY: kill(2) on the test's own child.
    assert_eq!(unsafe { libc::kill(pid as i32, libc::SIGHUP) }, 0);
}

// Multi-threaded: the test blocks on the notify socket while its client call runs.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn socket_activated_daemon_serves_calls_and_tells_systemd_its_state() {
    let mut d = Daemon::new();
    d.add_tool(
        "activated_hold",
        r#"name = "activated_hold"
description = "sleeps"
capability = "read"
command = ["/bin/sh", "-c", "sleep 3.1416; echo held"]
timeout = "30s"
"#,
    );
    let listener = UnixListener::bind(&d.socket).expect("bind the socket systemd would");
    let (notify, notify_path) = notify_socket(&d);
    spawn_activated(&mut d, &listener, "airlock", &notify_path);
    let ready = recv_until(&notify, "READY=1", &d);
    assert!(
        ready.iter().all(|m| !m.contains("STOPPING")),
        "stopping before ready: {ready:?}"
    );
    assert!(
        d.log_text().contains("socket_activated=true"),
        "the daemon did not say it was socket-activated:\n{}",
        d.log_text()
    );

    // A real call through the passed listener: a write tool publishes its output.
    let c = d.client().await;
    session(&c, "act").await;
    let r = call(
        &c,
        "write_text",
        json!({"session": "act", "out": "activated.txt", "text": "through fd 3"}),
    )
    .await;
    assert!(!is_error(&r), "write_text: {r}");
    assert_eq!(d.read("activated.txt").as_deref(), Some("through fd 3"));

    // STATUS= counts the call in flight.
    let c2 = d.client().await;
    let hold = tokio::spawn(async move { call(&c2, "activated_hold", json!({})).await });
    let status = recv_until(&notify, "1 call(s) in flight", &d);
    assert!(
        status
            .last()
            .is_some_and(|m| m.starts_with("STATUS=serving")),
        "{status:?}"
    );
    let r = hold.await.expect("join");
    assert_eq!(text(&r).trim(), "held", "{r}");

    // WatchdogSec=2s: WATCHDOG=1 at least once a second.
    recv_until(&notify, "WATCHDOG=1", &d);

    // SIGTERM: STOPPING=1, exit 0, and the socket file (systemd's) is left in place.
    sigterm(d.pid());
    recv_until(&notify, "STOPPING=1", &d);
    let st = d
        .wait_exit(Duration::from_secs(30))
        .expect("exit after SIGTERM");
    assert!(st.success(), "exit status {st}\n{}", d.log_text());
    assert!(
        d.socket.exists(),
        "a socket-activated daemon removed systemd's socket file"
    );
}

/// Under systemd without `WatchdogSec`, an idle daemon sends nothing (it has no periodic
/// work); a call in flight and its end are told by `STATUS=`.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_idle_daemon_tells_systemd_nothing_until_its_calls_change() {
    let mut d = Daemon::new();
    d.add_tool(
        "idle_hold",
        r#"name = "idle_hold"
description = "sleeps"
capability = "read"
command = ["/bin/sh", "-c", "sleep 1.5; echo held"]
timeout = "30s"
"#,
    );
    let listener = UnixListener::bind(&d.socket).expect("bind the socket systemd would");
    let (notify, notify_path) = notify_socket(&d);
    spawn_activated_with(&mut d, &listener, "airlock", &notify_path, None);
    recv_until(&notify, "READY=1", &d);
    notify
        .set_read_timeout(Some(Duration::from_secs(3)))
        .expect("timeout");
    let mut buf = [0u8; 4096];
    if let Ok(n) = notify.recv(&mut buf) {
        panic!(
            "an idle daemon sent {:?}",
            String::from_utf8_lossy(&buf[..n])
        );
    }
    let c = d.client().await;
    let hold = tokio::spawn(async move { call(&c, "idle_hold", json!({})).await });
    recv_until(&notify, "1 call(s) in flight", &d);
    recv_until(&notify, "0 call(s) in flight", &d);
    let r = hold.await.expect("join");
    assert_eq!(text(&r).trim(), "held", "{r}");
}

/// A `.socket` unit without `FileDescriptorName=` names its one fd after itself: one passed
/// fd is the listener whatever its name, so the daemon serves calls through it.
#[tokio::test]
async fn a_single_passed_fd_with_another_name_is_served() {
    let mut d = Daemon::new();
    let listener = UnixListener::bind(&d.socket).expect("bind");
    let (notify, notify_path) = notify_socket(&d);
    spawn_activated(&mut d, &listener, "web.socket", &notify_path);
    recv_until(&notify, "READY=1", &d);
    assert!(
        d.log_text().contains("socket_activated=true"),
        "the daemon did not take the passed fd:\n{}",
        d.log_text()
    );
    let c = d.client().await;
    session(&c, "named").await;
    let r = call(
        &c,
        "write_text",
        json!({"session": "named", "out": "named.txt", "text": "through web.socket"}),
    )
    .await;
    assert!(!is_error(&r), "write_text: {r}");
    assert_eq!(d.read("named.txt").as_deref(), Some("through web.socket"));
}

/// `systemd-socket-activate -l SOCKET` without `--fdname` binds the socket, waits for the first
/// client, then execs the daemon with one fd and no `LISTEN_FDNAMES`: the daemon serves that
/// client and later ones through it, and leaves the socket file (the activator's) in place.
#[tokio::test]
async fn one_unnamed_fd_from_systemd_socket_activate_is_served() {
    let activate = [
        "/usr/bin/systemd-socket-activate",
        "/bin/systemd-socket-activate",
    ]
    .into_iter()
    .find(|p| std::path::Path::new(p).exists())
    .expect("this test needs systemd-socket-activate (the systemd package; .ci/install-deps)");
    let mut d = Daemon::new();
    let log = std::fs::OpenOptions::new()
        .create(true)
        .append(true)
        .open(&d.log)
        .expect("log");
    let child = Command::new(activate)
        .arg("-l")
        .arg(&d.socket)
        .arg(BIN)
        .arg("serve")
        .arg("--policies")
        .arg(&d.policies)
        .arg("--socket")
        .arg(&d.socket)
        .arg("--workspace")
        .arg(&d.workspace)
        .arg("--state-dir")
        .arg(&d.state)
        .env_remove("LISTEN_FDNAMES")
        .env("AIRLOCK_LOG", "debug")
        .stdin(Stdio::null())
        .stdout(Stdio::null())
        .stderr(Stdio::from(log))
        .spawn()
        .expect("spawn systemd-socket-activate");
    d.child = Some(child);
    wait_until("systemd-socket-activate to listen", || {
        d.log_text().contains("Listening on")
    })
    .await;
    // The first connection makes the activator exec the daemon, which then answers it.
    let c = d.client().await;
    session(&c, "unnamed").await;
    let r = call(
        &c,
        "write_text",
        json!({"session": "unnamed", "out": "unnamed.txt", "text": "through fd 3"}),
    )
    .await;
    assert!(!is_error(&r), "write_text: {r}");
    assert_eq!(d.read("unnamed.txt").as_deref(), Some("through fd 3"));
    let log = d.log_text();
    assert!(
        log.contains("socket_activated=true") && !log.contains("LISTEN_FDNAMES"),
        "the daemon did not serve the unnamed passed fd:\n{log}"
    );
    let second = d.client().await;
    session(&second, "again").await;
    sigterm(d.pid());
    let st = d
        .wait_exit(Duration::from_secs(30))
        .expect("exit after SIGTERM");
    assert!(st.success(), "exit status {st}\n{}", d.log_text());
    assert!(
        d.socket.exists(),
        "a socket-activated daemon removed the activator's socket file"
    );
}

/// Among several passed fds the names decide: none named `airlock` refuses the start (exit
/// 2), naming the names, and no client of either socket is left waiting.
#[tokio::test]
async fn several_passed_fds_none_named_airlock_are_refused_and_named() {
    let mut d = Daemon::new();
    let db_path = d.dir.path().join("db.sock");
    let web = UnixListener::bind(&d.socket).expect("bind");
    let db = UnixListener::bind(&db_path).expect("bind");
    let (_notify, notify_path) = notify_socket(&d);
    spawn_activated_fds(&mut d, &[&web, &db], "web:db", &notify_path, None);
    drop((web, db));
    let st = d
        .wait_exit(Duration::from_secs(30))
        .expect("the daemon exits");
    assert_eq!(st.code(), Some(2), "{}", d.log_text());
    let log = d.log_text();
    assert!(
        log.contains("none of the 2 passed fds is named \"airlock\"")
            && log.contains("LISTEN_FDNAMES=\"web:db\""),
        "{log}"
    );
    for p in [d.socket.clone(), db_path] {
        refused_fast(&p);
    }
}

/// How `/proc/PID/fd` shows the socket behind `l`: `socket:[INODE]`.
fn socket_link(l: &UnixListener) -> String {
    std::fs::read_link(format!("/proc/self/fd/{}", l.as_raw_fd()))
        .expect("readlink")
        .display()
        .to_string()
}

/// What each of `pid`'s open fds points at.
fn fd_links(pid: i32) -> Vec<String> {
    std::fs::read_dir(format!("/proc/{pid}/fd"))
        .expect("/proc/PID/fd")
        .flatten()
        .filter_map(|e| std::fs::read_link(e.path()).ok())
        .map(|l| l.display().to_string())
        .collect()
}

/// The environment `pid` was started with.
fn environ(pid: i32) -> Vec<String> {
    let raw = std::fs::read(format!("/proc/{pid}/environ")).expect("/proc/PID/environ");
    raw.split(|b| *b == 0)
        .filter(|v| !v.is_empty())
        .map(|v| String::from_utf8_lossy(v).into_owned())
        .collect()
}

/// The spawner process of the daemon `daemon` (its child running the spawner argument).
fn spawner_of(daemon: u32) -> Option<i32> {
    processes_with("__airlock-spawner").into_iter().find(|p| {
        std::fs::read_to_string(format!("/proc/{p}/status")).is_ok_and(|s| {
            s.lines()
                .find_map(|l| l.strip_prefix("PPid:"))
                .is_some_and(|v| v.trim() == daemon.to_string())
        })
    })
}

/// A client of the socket at `path` is turned away at once: its connect is refused, or the
/// connection it got ends (EOF or reset). The 20 s read deadline only detects the failure:
/// a client left waiting in a backlog nobody accepts from.
fn refused_fast(path: &std::path::Path) {
    use std::io::Read;
    match std::os::unix::net::UnixStream::connect(path) {
        Err(e) => assert_eq!(
            e.kind(),
            std::io::ErrorKind::ConnectionRefused,
            "{}: {e}",
            path.display()
        ),
        Ok(mut s) => {
            s.set_read_timeout(Some(Duration::from_secs(20)))
                .expect("timeout");
            let mut b = [0u8; 1];
            match s.read(&mut b) {
                Ok(0) => {}
                Ok(_) => panic!("{}: a client was answered", path.display()),
                Err(e)
                    if matches!(
                        e.kind(),
                        std::io::ErrorKind::WouldBlock | std::io::ErrorKind::TimedOut
                    ) =>
                {
                    panic!(
                        "{}: a client is left waiting in the backlog",
                        path.display()
                    )
                }
                Err(_) => {}
            }
        }
    }
}

/// The passed fds and the LISTEN_* variables are the daemon's alone: the spawner (started
/// before the first call) holds neither socket and has no LISTEN_* in its environment, nor
/// does a worker; a passed fd with another name is closed, so its clients are refused at
/// once instead of waiting in a backlog. The test keeps no copy of the sockets, as
/// systemd-socket-activate (which execs the daemon) does not.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn neither_the_spawner_nor_a_worker_inherits_the_passed_fds_or_listen_variables() {
    let mut d = Daemon::new();
    d.add_tool(
        "activated_env",
        r#"name = "activated_env"
description = "prints its environment and open fds"
capability = "read"
command = ["/bin/sh", "-c", "env; ls -l /proc/self/fd/"]
timeout = "30s"
"#,
    );
    let web_path = d.dir.path().join("web.sock");
    let web = UnixListener::bind(&web_path).expect("bind");
    let listener = UnixListener::bind(&d.socket).expect("bind the socket systemd would");
    let (ours, theirs) = (socket_link(&listener), socket_link(&web));
    let (notify, notify_path) = notify_socket(&d);
    // The other socket first: it is fd 3, the listener fd 4.
    spawn_activated_fds(
        &mut d,
        &[&web, &listener],
        "web:airlock",
        &notify_path,
        None,
    );
    drop((web, listener));
    recv_until(&notify, "READY=1", &d);
    let daemon = d.pid();
    wait_until("the spawner to start", || spawner_of(daemon).is_some()).await;
    let spawner = spawner_of(daemon).expect("the spawner");
    let links = fd_links(spawner);
    assert!(
        !links.contains(&ours) && !links.contains(&theirs),
        "the spawner holds a passed socket ({ours}, {theirs}): {links:?}"
    );
    let env = environ(spawner);
    assert!(
        env.iter().all(|v| !v.starts_with("LISTEN_")),
        "the spawner's environment: {env:?}"
    );
    let links = fd_links(daemon as i32);
    assert!(links.contains(&ours), "the daemon's fds: {links:?}");
    assert!(
        !links.contains(&theirs),
        "the daemon kept the fd named \"web\": {links:?}"
    );

    let c = d.client().await;
    let r = call(&c, "activated_env", json!({})).await;
    assert!(!is_error(&r), "{r}");
    let t = text(&r);
    assert!(t.contains("PATH="), "no environment listed: {t}");
    assert!(!t.contains("LISTEN_"), "a worker's environment: {t}");
    assert!(
        !t.contains(&ours) && !t.contains(&theirs),
        "a worker holds a passed socket: {t}"
    );
    refused_fast(&web_path);
}

/// Two passed fds both named `airlock`: the start is refused naming both, rather than one
/// served and the other's clients left waiting; once the daemon is gone, a client of either
/// socket is refused at once.
#[tokio::test]
async fn two_passed_fds_named_airlock_refuse_the_start_and_leave_no_client_waiting() {
    let mut d = Daemon::new();
    let second_path = d.dir.path().join("second.sock");
    let first = UnixListener::bind(&d.socket).expect("bind");
    let second = UnixListener::bind(&second_path).expect("bind");
    let (_notify, notify_path) = notify_socket(&d);
    spawn_activated_fds(
        &mut d,
        &[&first, &second],
        "airlock:airlock",
        &notify_path,
        None,
    );
    drop((first, second));
    let st = d
        .wait_exit(Duration::from_secs(30))
        .expect("the daemon exits");
    assert_eq!(st.code(), Some(2), "{}", d.log_text());
    let log = d.log_text();
    assert!(
        log.contains("fds 3 and 4 are each named \"airlock\"")
            && log.contains("LISTEN_FDNAMES=\"airlock:airlock\""),
        "{log}"
    );
    for p in [d.socket.clone(), second_path] {
        refused_fast(&p);
    }
}

#[tokio::test]
async fn a_passed_fd_that_is_not_a_listener_is_refused() {
    let mut d = Daemon::new();
    // A bound but not listening stream socket stands where the listener should be.
    let dgram = UnixDatagram::bind(d.dir.path().join("dgram.sock")).expect("bind");
    let (_notify, notify_path) = notify_socket(&d);
    // SAFETY: the fd is the test's open datagram socket; the listener wrapper is forgotten
    // below so it is never closed twice.
    let fake = unsafe { <UnixListener as std::os::fd::FromRawFd>::from_raw_fd(dgram.as_raw_fd()) };
    spawn_activated(&mut d, &fake, "airlock", &notify_path);
    std::mem::forget(fake);
    let st = d
        .wait_exit(Duration::from_secs(30))
        .expect("the daemon exits");
    assert_eq!(st.code(), Some(2), "{}", d.log_text());
    assert!(
        d.log_text()
            .contains("is not a listening AF_UNIX stream socket"),
        "{}",
        d.log_text()
    );
    assert!(
        std::os::unix::net::UnixStream::connect(&d.socket).is_err(),
        "the daemon bound a socket of its own instead"
    );
}

#[tokio::test]
async fn sigterm_during_a_slow_write_leaves_the_workspace_unchanged_and_no_worker() {
    let mut d = Daemon::new();
    d.add_tool(
        "term_slow",
        r#"name = "term_slow"
description = "writes after a long sleep"
capability = "write"
command = ["/bin/sh", "-c", "echo partial > \"$1\"; sleep 27.1828; echo done > \"$1\"", "term_slow", "{out}"]
timeout = "60s"

[params.out]
type = "string"
path = "output"
description = "the output"
"#,
    );
    d.write("out.txt", "before");
    d.start();
    let c = d.client().await;
    session(&c, "t").await;
    let before = snapshot(&d.workspace);
    let c2 = d.client().await;
    let pending = tokio::spawn(async move {
        c2.call_tool(
            rmcp::model::CallToolRequestParams::new("term_slow")
                .with_arguments(args(json!({"session": "t", "out": "out.txt"}))),
        )
        .await
    });
    wait_for_process("27.1828").await;
    sigterm(d.pid());
    let st = d
        .wait_exit(Duration::from_secs(30))
        .expect("exit after SIGTERM");
    assert!(st.success(), "exit status {st}\n{}", d.log_text());
    let _ = pending.await;
    assert!(
        processes_with("27.1828").is_empty(),
        "a worker outlived the daemon: {:?}",
        processes_with("27.1828")
    );
    assert_eq!(snapshot(&d.workspace), before, "the workspace changed");
    assert_eq!(d.read("out.txt").as_deref(), Some("before"));
    assert!(d.job_dirs().is_empty(), "job dirs left: {:?}", d.job_dirs());
    // The next start finds nothing to recover and the session is where it was.
    d.start();
    let c = d.client().await;
    assert_eq!(version(&c, "t").await, 0);
    assert!(
        !d.log_text().contains("recovered job dir"),
        "the next start had a job to roll back:\n{}",
        d.log_text()
    );
}

fn hold_tool(version: &str) -> String {
    format!(
        r#"name = "reload_hold"
description = "sleeps, then says which policy it ran on"
capability = "read"
command = ["/bin/sh", "-c", "sleep 2.7183; echo {version}"]
timeout = "30s"
"#
    )
}

#[tokio::test]
async fn sighup_reloads_a_good_policy_and_keeps_the_old_one_when_broken() {
    let mut d = Daemon::new();
    d.add_tool("reload_hold", &hold_tool("policy-v1"));
    d.start();
    let c = d.client().await;
    session(&c, "s").await;
    let original = tool_names(&c).await;
    assert!(original.contains(&"upper".to_string()), "{original:?}");
    assert!(!original.contains(&"reload_new".to_string()));

    // A broken policy: a tool with a syntax error. The old policy keeps serving; the error
    // is logged with its file, line and column, as `policy check` prints it.
    let broken = d.policies.join("tools/broken.toml");
    std::fs::write(&broken, "name = \"broken\"\ncapability = \n").expect("write");
    let check = Command::new(BIN)
        .args(["policy", "check", "--policies"])
        .arg(&d.policies)
        .output()
        .expect("policy check");
    assert_eq!(check.status.code(), Some(1));
    let verdict = String::from_utf8_lossy(&check.stdout).into_owned();
    let first = verdict.lines().next().expect("an error line").to_string();
    assert!(first.contains("broken.toml:2:"), "{verdict}");
    sighup(d.pid());
    wait_until("the reload to be refused", || {
        d.log_text()
            .contains("still serving the policy loaded before")
    })
    .await;
    assert!(
        d.log_text().contains(&first),
        "the daemon's log lacks policy check's error {first:?}:\n{}",
        d.log_text()
    );
    assert_eq!(
        tool_names(&c).await,
        original,
        "a broken policy changed the tools"
    );
    d.write("in.txt", "still");
    let r = call(
        &c,
        "upper",
        json!({"session": "s", "source": "in.txt", "out": "up.txt"}),
    )
    .await;
    assert!(!is_error(&r), "{r}");
    assert_eq!(d.read("up.txt").as_deref(), Some("STILL"));

    // A good policy: `upper` removed, `reload_new` added, `reload_hold` changed, and a daemon
    // setting changed (needs a restart). A call in flight finishes on the old tool.
    std::fs::remove_file(&broken).expect("rm");
    let c2 = d.client().await;
    let in_flight = tokio::spawn(async move { call(&c2, "reload_hold", json!({})).await });
    wait_for_process("2.7183").await;
    std::fs::remove_file(d.policies.join("tools/upper.toml")).expect("rm upper");
    d.add_tool("reload_hold", &hold_tool("policy-v2"));
    d.add_tool(
        "reload_new",
        r#"name = "reload_new"
description = "new after the reload"
capability = "read"
command = ["/bin/echo", "new tool"]
timeout = "5s"
"#,
    );
    let conf = d.policies.join("airlock.toml");
    let text_conf = std::fs::read_to_string(&conf).expect("read airlock.toml");
    let changed = text_conf.replace("shutdown_timeout = \"10s\"", "shutdown_timeout = \"3s\"");
    assert_ne!(
        changed, text_conf,
        "airlock.toml has no shutdown_timeout = \"10s\""
    );
    std::fs::write(&conf, changed).expect("write airlock.toml");
    sighup(d.pid());
    wait_until("the reload", || d.log_text().contains("now serving")).await;
    let after = tool_names(&c).await;
    assert!(after.contains(&"reload_new".to_string()), "{after:?}");
    assert!(!after.contains(&"upper".to_string()), "{after:?}");
    let r = in_flight.await.expect("join");
    assert_eq!(text(&r).trim(), "policy-v1", "the call in flight: {r}");
    let r = call(&c, "reload_hold", json!({})).await;
    assert_eq!(text(&r).trim(), "policy-v2", "a call after the reload: {r}");
    let r = call(&c, "reload_new", json!({})).await;
    assert_eq!(text(&r).trim(), "new tool", "{r}");
    let gone = c
        .call_tool(
            rmcp::model::CallToolRequestParams::new("upper").with_arguments(args(
                json!({"session": "s", "source": "in.txt", "out": "gone.txt"}),
            )),
        )
        .await;
    assert!(
        gone.as_ref().map_or(true, |r| r.is_error == Some(true)),
        "a removed tool ran: {gone:?}"
    );
    assert_eq!(d.read("gone.txt"), None);
    assert!(
        d.log_text()
            .contains("shutdown_timeout changed in airlock.toml; it needs a restart"),
        "{}",
        d.log_text()
    );
}

#[tokio::test]
async fn recover_with_a_broken_policy_says_so_instead_of_going_on_silently() {
    let d = Daemon::new();
    std::fs::write(
        d.policies.join("tools/broken.toml"),
        "name = \"broken\"\ncapability = \n",
    )
    .expect("write");
    std::fs::create_dir_all(&d.state).expect("state");
    let out = d.recover(None).output().expect("recover");
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(out.status.success(), "{err}");
    assert!(err.contains("broken.toml:2:"), "{err}");
    assert!(
        err.contains("recovering with the default [daemon] settings"),
        "{err}"
    );
    // Without the dirs, it refuses and says how to go on.
    let out = Command::new(BIN)
        .arg("recover")
        .arg("--policies")
        .arg(&d.policies)
        .output()
        .expect("recover");
    assert_eq!(out.status.code(), Some(2));
    assert!(
        String::from_utf8_lossy(&out.stderr).contains("give both --workspace and --state-dir"),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
}

/// The fields of `/proc/<pid>/status` named `keys`, e.g. `Uid:` or `CapEff:`.
fn status_fields(pid: u32, keys: &[&str]) -> Vec<String> {
    let status = std::fs::read_to_string(format!("/proc/{pid}/status")).expect("status");
    keys.iter()
        .map(|k| {
            status
                .lines()
                .find_map(|l| l.strip_prefix(k))
                .unwrap_or_else(|| panic!("no {k} in /proc/{pid}/status"))
                .trim()
                .to_string()
        })
        .collect()
}

/// What `airlock.service` imposes that can be reproduced without systemd as PID 1: a user of
/// its own with no capabilities at all, and the unit's SystemCallFilter= (with
/// `~@privileged`: no capset, setuid, chown) and RestrictAddressFamilies=AF_UNIX, installed by
/// `systemd/unit-filter` with libseccomp from the unit file itself. Under them the daemon
/// picks the shared-uid tier, a write call publishes its file, and a hostile worker under the
/// daemon's uid can neither signal the daemon, nor reach an abstract socket, nor change the
/// metadata of what the daemon owns. (PrivateUsers= is not reproduced: no newuidmap here.)
#[tokio::test]
async fn the_shipped_units_restrictions_keep_the_sandbox_working() {
    use std::os::linux::net::SocketAddrExt;
    use std::os::unix::fs::PermissionsExt;
    crate::harness::require_program("/usr/bin/python3", "python3");
    crate::harness::require_program("systemd-analyze", "systemd");
    require_root();
    let mut d = crate::sandbox::hostile_daemon();
    crate::sandbox::give_to_nobody(&d);
    d.user = Some((65534, 65534));
    // The daemon's uid reads the filter script and the unit: copied where it can reach them
    // (the checkout may lie under a directory only root can search).
    let systemd = d.dir.path().join("systemd");
    std::fs::create_dir(&systemd).expect("mkdir systemd");
    for f in ["unit-filter", "airlock.service"] {
        std::fs::copy(repo().join("systemd").join(f), systemd.join(f)).expect("copy");
    }
    d.wrap = vec![
        systemd.join("unit-filter").display().to_string(),
        systemd.join("airlock.service").display().to_string(),
        "--".to_string(),
    ];
    d.start();
    let pid = d.pid();
    let f = status_fields(
        pid,
        &[
            "Uid:",
            "CapEff:",
            "CapPrm:",
            "CapAmb:",
            "Seccomp:",
            "NoNewPrivs:",
        ],
    );
    assert!(f[0].starts_with("65534"), "{f:?}");
    assert_eq!(
        &f[1..],
        [
            "0000000000000000",
            "0000000000000000",
            "0000000000000000",
            "2",
            "1"
        ],
        "the daemon runs without capabilities, under the unit's filter"
    );
    assert!(
        d.log_text()
            .contains("workers run under the daemon's own uid"),
        "{}",
        d.log_text()
    );
    let c = d.client().await;
    session(&c, "h").await;
    let r = call(
        &c,
        "write_text",
        json!({"session": "h", "text": "under the unit", "out": "u/unit.txt"}),
    )
    .await;
    assert!(!is_error(&r), "{r}\n{}", d.log_text());
    assert_eq!(d.read("u/unit.txt").as_deref(), Some("under the unit"));
    assert_eq!(version(&c, "h").await, 1);

    // Hostile worker, same uid as the daemon: Landlock's signal scope stops kill.
    let sh = |script: String| {
        let c = &c;
        async move { call(c, "run_sh", json!({"session": "h", "script": script})).await }
    };
    let r = sh(format!(
        "kill -TERM {pid} 2>&1; kill -KILL {pid} 2>&1; kill -0 {pid} 2>&1; echo end"
    ))
    .await;
    assert_eq!(
        text(&r).matches("Operation not permitted").count(),
        3,
        "{r}"
    );
    // Landlock's abstract-socket scope: a listener outside the worker's domain is unreachable.
    let name = format!("airlock-unit-test-{}", std::process::id());
    let addr = std::os::unix::net::SocketAddr::from_abstract_name(name.as_bytes()).expect("name");
    let listener = UnixListener::bind_addr(&addr).expect("bind abstract");
    listener.set_nonblocking(true).expect("nonblocking");
    let r = call(
        &c,
        "run_py",
        json!({"session": "h", "code": format!(
            "import socket\ntry:\n    socket.socket(socket.AF_UNIX).connect('\\0{name}')\n    print('CONNECTED')\nexcept OSError as e:\n    print('denied', e.errno)\n"
        )}),
    )
    .await;
    assert!(text(&r).contains("denied 1"), "{r}");
    assert!(
        listener.accept().is_err(),
        "the worker reached the abstract socket"
    );
    // Metadata of what the daemon owns: the shared-uid seccomp tier denies it.
    let sock_mode = std::fs::metadata(&d.socket)
        .expect("socket")
        .permissions()
        .mode();
    let published = d.workspace.join("u/unit.txt");
    let r = sh(format!(
        "chmod 777 '{}' 2>&1; chmod 666 '{}' 2>&1; echo end",
        d.socket.display(),
        published.display()
    ))
    .await;
    assert_eq!(
        text(&r).matches("Operation not permitted").count(),
        2,
        "{r}"
    );
    assert_eq!(
        std::fs::metadata(&d.socket)
            .expect("socket")
            .permissions()
            .mode(),
        sock_mode
    );
    assert_eq!(
        std::fs::metadata(&published)
            .expect("published")
            .permissions()
            .mode()
            & 0o7777,
        0o644
    );
    assert!(d
        .child
        .as_mut()
        .expect("child")
        .try_wait()
        .expect("wait")
        .is_none());
    assert_eq!(d.read("u/unit.txt").as_deref(), Some("under the unit"));
    assert!(!d.log_text().contains("panicked"), "{}", d.log_text());
}

/// The opt-in drop-in `airlock.service.d/uid-separation.conf` on top of the unit: the six
/// ambient capabilities it grants and the filter it sets again (capset, setresuid, chown
/// allowed) let the daemon run each worker under a uid of its own; the worker keeps no
/// capability and its output is published as the daemon's.
#[tokio::test]
async fn the_uid_separation_drop_in_gives_workers_their_own_uid() {
    use std::os::unix::fs::MetadataExt;
    crate::harness::require_program("/usr/bin/python3", "python3");
    crate::harness::require_program("systemd-analyze", "systemd");
    require_root();
    let mut d = crate::sandbox::hostile_daemon();
    crate::sandbox::give_to_nobody(&d);
    d.user = Some((65534, 65534));
    d.ambient_caps = Some("setuid,setgid,chown,fowner,dac_override,kill".into());
    crate::uid_separation::daemon_setting(
        &d,
        "worker_user = \"separate\"\nworker_uids = \"62700-62763\"",
    );
    let systemd = repo().join("systemd");
    d.wrap = vec![
        systemd.join("unit-filter").display().to_string(),
        systemd.join("airlock.service").display().to_string(),
        systemd
            .join("airlock.service.d/uid-separation.conf")
            .display()
            .to_string(),
        "--".to_string(),
    ];
    d.start();
    let f = status_fields(d.pid(), &["Seccomp:", "CapEff:"]);
    assert_eq!(f[0], "2", "the daemon runs under the unit's filter");
    assert_ne!(f[1], "0000000000000000", "the drop-in's capabilities");
    let c = d.client().await;
    session(&c, "h").await;
    let r = call(
        &c,
        "run_sh",
        json!({"session": "h", "out": "who.txt",
               "script": "grep -E '^(Uid|CapEff):' /proc/self/status > \"$1\""}),
    )
    .await;
    assert!(!is_error(&r), "{r}\n{}", d.log_text());
    let who = d.read("who.txt").expect("who.txt");
    let uid: u32 = who
        .lines()
        .find_map(|l| l.strip_prefix("Uid:"))
        .and_then(|v| v.split_whitespace().next())
        .and_then(|v| v.parse().ok())
        .unwrap_or_else(|| panic!("{who}"));
    assert!((62700..=62763).contains(&uid), "the worker ran as {uid}");
    assert!(who.contains("CapEff:\t0000000000000000"), "{who}");
    let meta = std::fs::metadata(d.workspace.join("who.txt")).expect("who.txt");
    assert_eq!(
        (meta.uid(), meta.gid()),
        (65534, 65534),
        "published as the daemon's"
    );
}
