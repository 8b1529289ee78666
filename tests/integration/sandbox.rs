//! Hostile tools, each run as a write tool through the real daemon. Each must fail
//! to cause harm, the call must end with a clear result, and the workspace must be
//! byte-for-byte unchanged (but for a declared output, where noted).

use std::io::Read;
use std::os::unix::fs::PermissionsExt;
use std::time::Duration;

use serde_json::{json, Value};

use crate::harness::*;

/// A daemon with `run_sh` and `run_py`: write tools whose script is an argument.
pub fn hostile_daemon() -> Daemon {
    let d = Daemon::new();
    d.add_tool(
        "run_sh",
        r#"name = "run_sh"
description = "Run a shell script (test only)"
capability = "write"
command = ["/bin/sh", "-c", "{script}", "run_sh", "{out}"]
timeout = "3s"
[params.script]
type = "string"
[params.out]
type = "string"
path = "output"
required = false
"#,
    );
    d.add_tool(
        "run_py",
        r#"name = "run_py"
description = "Run python code (test only)"
capability = "write"
command = ["/usr/bin/python3", "-I", "-c", "{code}", "{out}"]
timeout = "5s"
[params.code]
type = "string"
[params.out]
type = "string"
path = "output"
required = false
"#,
    );
    d
}

pub(crate) async fn started(d: &mut Daemon) -> Client {
    d.start();
    let c = d.client().await;
    session(&c, "h").await;
    c
}

pub(crate) async fn sh(c: &Client, script: &str) -> Value {
    call(c, "run_sh", json!({"session": "h", "script": script})).await
}

pub(crate) async fn py(c: &Client, code: &str) -> Value {
    call(c, "run_py", json!({"session": "h", "code": code})).await
}

#[tokio::test]
async fn writes_outside_staging_are_denied() {
    let mut d = hostile_daemon();
    let c = started(&mut d).await;
    d.write("existing.txt", "original");
    let before = snapshot(&d.workspace);
    let ws = d.workspace.display().to_string();
    let targets = [
        format!("{ws}/pwned"),
        format!("{ws}/existing.txt"),
        "/tmp/airlock-pwned".to_string(),
        "/root/airlock-pwned".to_string(),
        "/etc/airlock-pwned".to_string(),
        format!("{}/airlock-pwned", d.dir.path().display()),
    ];
    let script = targets
        .iter()
        .map(|t| {
            format!(
                "if echo x > '{t}' 2>/dev/null; then echo WROTE '{t}'; else echo denied '{t}'; fi"
            )
        })
        .collect::<Vec<_>>()
        .join("; ");
    let r = sh(&c, &script).await;
    assert!(!is_error(&r), "{r}");
    let out = text(&r);
    assert_eq!(out.matches("denied").count(), targets.len(), "{out}");
    assert!(!out.contains("WROTE"), "{out}");
    for t in &targets[2..] {
        assert!(!std::path::Path::new(t).exists(), "{t} was written");
    }
    assert_eq!(snapshot(&d.workspace), before);
    // Removing and renaming are writes too.
    let r = sh(
        &c,
        &format!(
            "rm -f '{ws}/existing.txt' 2>&1; mv '{ws}/existing.txt' '{ws}/moved' 2>&1; echo end"
        ),
    )
    .await;
    assert!(
        text(&r).contains("denied") || text(&r).contains("Permission denied"),
        "{r}"
    );
    assert_eq!(snapshot(&d.workspace), before);
}

#[tokio::test]
async fn undeclared_reads_are_denied() {
    let mut d = hostile_daemon();
    let c = started(&mut d).await;
    d.write("secret.txt", "top secret");
    let before = snapshot(&d.workspace);
    let ws = d.workspace.display().to_string();
    let r = sh(
        &c,
        &format!(
            "cat '{ws}/secret.txt' 2>&1; ls '{ws}' 2>&1; cat /root/.bash_history 2>&1; echo end"
        ),
    )
    .await;
    let out = text(&r);
    assert!(!out.contains("top secret"), "{out}");
    assert!(out.matches("Permission denied").count() >= 2, "{out}");
    // Declared as input, the same file is readable.
    let r = call(
        &c,
        "upper",
        json!({"session": "h", "source": "secret.txt", "out": "SECRET.txt"}),
    )
    .await;
    assert!(!is_error(&r), "{r}");
    assert_eq!(d.read("SECRET.txt").as_deref(), Some("TOP SECRET"));
    let _ = before;
}

#[tokio::test]
async fn non_regular_outputs_are_rejected_at_publish() {
    let mut d = hostile_daemon();
    let c = started(&mut d).await;
    d.write("target.txt", "old");
    let before = snapshot(&d.workspace);
    // The tool's result is at fault: TOOL_FAILED, naming the output and what was found.
    for (what, script, found) in [
        ("symlink", "ln -s /etc/passwd \"$1\"", "a symlink"),
        (
            "hard link",
            "echo x > \"$1.other\" && ln \"$1.other\" \"$1\"",
            "2 hard links",
        ),
        ("fifo", "mkfifo \"$1\"", "the tool left a FIFO there"),
        (
            "directory",
            "mkdir \"$1\" && echo x > \"$1/f\"",
            "the tool left a directory there",
        ),
        ("missing", "true", "did not write it"),
    ] {
        let r = call(
            &c,
            "run_sh",
            json!({"session": "h", "script": script, "out": "target.txt"}),
        )
        .await;
        assert!(is_error(&r), "{what}: {r}");
        assert_eq!(code(&r), "TOOL_FAILED", "{what}: {r}");
        let t = text(&r);
        assert!(
            t.contains("a file output must be a regular file") && t.contains(found),
            "{what}: {t}"
        );
        assert!(t.contains("nothing was published"), "{what}: {t}");
        assert_eq!(
            snapshot(&d.workspace),
            before,
            "{what} changed the workspace"
        );
        assert!(d.job_dirs().is_empty(), "{what} left a job dir");
    }
    assert_eq!(version(&c, "h").await, 0);
}

#[tokio::test]
async fn network_is_denied() {
    let mut d = hostile_daemon();
    let c = started(&mut d).await;
    let tcp = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    tcp.set_nonblocking(true).unwrap();
    let udp = std::net::UdpSocket::bind("127.0.0.1:0").unwrap();
    udp.set_nonblocking(true).unwrap();
    let code_ = format!(
        r#"
import socket
for name, kind, port in (("tcp", socket.SOCK_STREAM, {tp}), ("udp", socket.SOCK_DGRAM, {up})):
    try:
        s = socket.socket(socket.AF_INET, kind)
        s.settimeout(1)
        s.connect(("127.0.0.1", port))
        s.send(b"x")
        print("CONNECTED", name)
    except OSError as e:
        print("denied", name, e.errno)
try:
    socket.socket(socket.AF_INET6, socket.SOCK_STREAM)
    print("CONNECTED inet6")
except OSError as e:
    print("denied inet6", e.errno)
"#,
        tp = tcp.local_addr().unwrap().port(),
        up = udp.local_addr().unwrap().port()
    );
    let r = py(&c, &code_).await;
    let out = text(&r);
    assert_eq!(out.matches("denied").count(), 3, "{r}");
    assert!(out.contains("denied tcp 1"), "EPERM expected: {out}");
    assert!(tcp.accept().is_err(), "a TCP connection arrived");
    let mut buf = [0u8; 8];
    assert!(udp.recv(&mut buf).is_err(), "a UDP datagram arrived");
}

#[tokio::test]
async fn abstract_unix_sockets_are_out_of_reach() {
    use std::os::linux::net::SocketAddrExt;
    let mut d = hostile_daemon();
    let c = started(&mut d).await;
    let name = format!("airlock-test-{}", std::process::id());
    let addr = std::os::unix::net::SocketAddr::from_abstract_name(name.as_bytes()).unwrap();
    let listener = std::os::unix::net::UnixListener::bind_addr(&addr).unwrap();
    listener.set_nonblocking(true).unwrap();
    let r = py(
        &c,
        &format!(
            "import socket\ntry:\n    s = socket.socket(socket.AF_UNIX)\n    s.connect('\\0{name}')\n    print('CONNECTED')\nexcept OSError as e:\n    print('denied', e.errno)\n"
        ),
    )
    .await;
    assert!(text(&r).contains("denied 1"), "{r}");
    assert!(
        listener.accept().is_err(),
        "the worker reached an abstract socket"
    );
}

#[tokio::test]
async fn the_daemon_cannot_be_signalled_or_traced() {
    let mut d = hostile_daemon();
    let c = started(&mut d).await;
    let pid = d.pid();
    let r = sh(
        &c,
        &format!("kill -TERM {pid} 2>&1; kill -KILL {pid} 2>&1; echo end"),
    )
    .await;
    assert_eq!(
        text(&r).matches("Operation not permitted").count(),
        2,
        "{r}"
    );
    let r = py(
        &c,
        &format!(
            "import ctypes, os\nlibc = ctypes.CDLL(None, use_errno=True)\nr = libc.ptrace(16, {pid}, 0, 0)\nprint('attach', r, ctypes.get_errno())\nr = libc.ptrace(0, 0, 0, 0)\nprint('traceme', r, ctypes.get_errno())\n"
        ),
    )
    .await;
    let out = text(&r);
    assert!(
        out.contains("attach -1 1") && out.contains("traceme -1 1"),
        "{out}"
    );
    // Still alive and serving.
    assert_eq!(version(&c, "h").await, 2);
    assert!(d.child.as_mut().unwrap().try_wait().unwrap().is_none());
}

#[tokio::test]
async fn namespaces_mounts_and_io_uring_are_denied() {
    let mut d = hostile_daemon();
    let c = started(&mut d).await;
    let r = sh(
        &c,
        "unshare -U true 2>&1; echo unshare=$?; mount -t tmpfs tmpfs /mnt 2>&1; echo mount=$?",
    )
    .await;
    let out = text(&r);
    assert!(
        !out.contains("unshare=0") && !out.contains("mount=0"),
        "{out}"
    );
    let r = py(
        &c,
        "import ctypes\nlibc = ctypes.CDLL(None, use_errno=True)\nbuf = ctypes.create_string_buffer(120)\nr = libc.syscall(425, 4, buf)\nprint('io_uring_setup', r, ctypes.get_errno())\nr = libc.syscall(272, 0x10000000)\nprint('unshare', r, ctypes.get_errno())\n",
    )
    .await;
    let out = text(&r);
    assert!(out.contains("io_uring_setup -1 1"), "{out}");
    #[cfg(target_arch = "x86_64")]
    assert!(out.contains("unshare -1 1"), "{out}");
}

#[tokio::test]
async fn setsid_and_double_fork_cannot_escape_the_group() {
    crate::harness::require_program("/usr/bin/python3", "python3");
    let mut d = hostile_daemon();
    let c = started(&mut d).await;
    let r = sh(&c, "setsid sleep 31.51 & (sleep 31.52 &); python3 -c 'import os; os.setpgid(0, 0)' 2>&1; sleep 30").await;
    assert_eq!(code(&r), "TOOL_TIMEOUT", "{r}");
    assert!(
        processes_with("sleep 31.51").is_empty(),
        "setsid'd sleeper survived"
    );
    assert!(
        processes_with("sleep 31.52").is_empty(),
        "double-forked sleeper survived"
    );
    assert!(d.job_dirs().is_empty());
}

#[tokio::test]
async fn sigterm_ignorers_are_killed_after_the_grace() {
    let mut d = hostile_daemon();
    let c = started(&mut d).await;
    let r = sh(&c, "trap '' TERM; sleep 31.61 & sleep 31.62; wait").await;
    assert_eq!(code(&r), "TOOL_TIMEOUT", "{r}");
    assert!(processes_with("sleep 31.61").is_empty() && processes_with("sleep 31.62").is_empty());
    let events = audit(&c).await;
    let sb = events
        .iter()
        .rev()
        .find(|e| e["tool"] == "run_sh" && e["kind"] == "worker_terminated")
        .expect("worker_terminated event");
    assert!(sb["detail"]["confirmed_by"].is_string(), "{sb}");
    let job = sb["job"].clone();
    let kinds: Vec<&str> = events
        .iter()
        .filter(|e| e["job"] == job)
        .filter_map(|e| e["kind"].as_str())
        .collect();
    assert_eq!(
        kinds,
        ["allow", "start", "timeout", "worker_terminated", "rollback"],
        "a write call's timeout"
    );
}

#[tokio::test]
async fn huge_output_is_capped_and_marked() {
    let mut d = hostile_daemon();
    let c = started(&mut d).await;
    let r = sh(&c, "head -c 104857600 /dev/zero | tr '\\0' a").await;
    assert!(
        !is_error(&r),
        "{}",
        &r.to_string()[..200.min(r.to_string().len())]
    );
    let out = text(&r);
    assert!(out.len() < 2 * 1024 * 1024, "kept {} bytes", out.len());
    assert!(
        out.contains("stdout truncated") && out.contains("104857600"),
        "{}",
        &out[out.len() - 200..]
    );
    // The daemon did not buffer 100 MiB.
    let status = std::fs::read_to_string(format!("/proc/{}/status", d.pid())).unwrap();
    let hwm: u64 = status
        .lines()
        .find(|l| l.starts_with("VmHWM:"))
        .and_then(|l| l.split_whitespace().nth(1))
        .and_then(|v| v.parse().ok())
        .unwrap();
    assert!(hwm < 64 * 1024, "daemon peak RSS {hwm} KiB");
}

#[tokio::test]
async fn memory_past_the_limit_fails_cleanly() {
    let mut d = hostile_daemon();
    let c = started(&mut d).await;
    let r = py(&c, "x = bytearray(6 << 30)\nprint('ALLOCATED')").await;
    assert_eq!(code(&r), "TOOL_FAILED", "{r}");
    assert!(text(&r).contains("MemoryError"), "{r}");
}

#[tokio::test]
async fn workers_run_with_no_new_privs_seccomp_and_no_capabilities() {
    let mut d = hostile_daemon();
    let c = started(&mut d).await;
    // From inside.
    let r = sh(
        &c,
        "grep -E '^(NoNewPrivs|Seccomp|CapEff|CapPrm|CapBnd|CapAmb|CapInh):' /proc/self/status",
    )
    .await;
    let out = text(&r);
    for want in [
        "NoNewPrivs:\t1",
        "Seccomp:\t2",
        "CapEff:\t0000000000000000",
        "CapPrm:\t0000000000000000",
        "CapBnd:\t0000000000000000",
        "CapAmb:\t0000000000000000",
        "CapInh:\t0000000000000000",
    ] {
        assert!(out.contains(want), "missing {want:?} in {out}");
    }
    // Nothing inherited but stdin, stdout, stderr and the progress pipe (3: rmcp's client
    // sends a progressToken with every request); 4 is ls's own directory fd.
    let r = sh(
        &c,
        "ls /proc/self/fd | tr '\\n' ' '; echo \"|$AIRLOCK_PROGRESS_FD|$(readlink /proc/self/fd/3 | cut -c1-5)\"",
    )
    .await;
    assert_eq!(text(&r).trim(), "0 1 2 3 4 |3|pipe:", "{r}");
    // From outside, on a running worker found through the audit's pid.
    let c = std::sync::Arc::new(c);
    let spawned = |events: &[Value]| {
        events
            .iter()
            .filter(|e| e["tool"] == "run_sh" && e["kind"] == "start")
            .count()
    };
    let earlier = spawned(&audit(&c).await);
    let c2 = c.clone();
    let running = tokio::spawn(async move { sh(&c2, "sleep 2").await });
    let deadline = std::time::Instant::now() + Duration::from_secs(10);
    let pid = loop {
        let events = audit(&c).await;
        if spawned(&events) > earlier {
            let e = events
                .iter()
                .rev()
                .find(|e| e["kind"] == "start" && e["tool"] == "run_sh")
                .unwrap();
            break e["detail"]["pid"].as_u64().unwrap();
        }
        assert!(std::time::Instant::now() < deadline);
        tokio::time::sleep(Duration::from_millis(20)).await;
    };
    let status = std::fs::read_to_string(format!("/proc/{pid}/status")).expect("worker status");
    assert!(
        status.contains("NoNewPrivs:\t1")
            && status.contains("Seccomp:\t2")
            && status.contains("CapEff:\t0000000000000000"),
        "{status}"
    );
    assert!(!is_error(&running.await.unwrap()));
    // The enforcement is recorded with the call.
    let events = audit(&c).await;
    let sb = events
        .iter()
        .rev()
        .find(|e| e["kind"] == "start" && e["tool"] == "run_sh")
        .unwrap();
    assert_eq!(sb["detail"]["landlock"], "fully_enforced", "{sb}");
    assert!(sb["detail"]["landlock_abi"].as_u64().unwrap() >= 6, "{sb}");
}

#[tokio::test]
async fn setuid_binaries_grant_nothing() {
    require_root();
    let mut d = hostile_daemon();
    // A setuid-root copy of cat, in a directory the profile lets workers execute from.
    let bin = d.dir.path().join("bin");
    std::fs::create_dir_all(&bin).unwrap();
    let suid = bin.join("suidcat");
    std::fs::copy("/bin/cat", &suid).unwrap();
    std::fs::set_permissions(&suid, std::fs::Permissions::from_mode(0o4755)).unwrap();
    let profile = d.policies.join("profiles/default.toml");
    let text_ = std::fs::read_to_string(&profile).unwrap();
    let text_ = text_.replace(
        "exec = [\"/usr\"",
        &format!("exec = [\"{}\", \"/usr\"", bin.display()),
    );
    std::fs::write(&profile, text_).unwrap();
    let c = started(&mut d).await;
    let r = sh(
        &c,
        &format!(
            "'{}' /proc/self/status | grep -E '^(Uid|CapEff|NoNewPrivs):'",
            suid.display()
        ),
    )
    .await;
    let out = text(&r);
    assert!(
        out.contains("CapEff:\t0000000000000000") && out.contains("NoNewPrivs:\t1"),
        "{out}"
    );
    // Also /usr/bin/su, a real setuid program.
    let r = sh(&c, "/usr/bin/su -c id nobody 2>&1; echo su=$?").await;
    assert!(!text(&r).contains("su=0"), "{r}");
}

/// A root daemon gives each worker a uid of its own: RLIMIT_NPROC is then the profile's
/// `processes` exactly (that uid runs nothing else), set without counting the host's
/// processes at each spawn.
#[tokio::test]
async fn a_worker_with_its_own_uid_forks_at_most_its_profiles_processes() {
    require_root();
    let mut d = hostile_daemon();
    let c = started(&mut d).await;
    let r = py(
        &c,
        "import os, time\nprint('uid', os.getuid())\nn = 0\ntry:\n    while n < 1000:\n        if os.fork() == 0:\n            time.sleep(3)\n            os._exit(0)\n        n += 1\nexcept OSError as e:\n    print('forks', n, 'then errno', e.errno)\n",
    )
    .await;
    let out = text(&r);
    let word = |k: &str| -> u32 {
        let mut w = out.split_whitespace();
        w.position(|x| x == k)
            .and_then(|_| w.next())
            .and_then(|n| n.parse().ok())
            .unwrap_or_else(|| panic!("no {k} in {out}"))
    };
    assert_ne!(word("uid"), 0, "the worker runs as a uid of its own: {out}");
    // The worker itself is one of the uid's tasks: 63 children at most.
    let forks = word("forks");
    assert!(
        (32..64).contains(&forks) && out.contains("errno 11"),
        "{out}"
    );
}

#[tokio::test]
async fn fork_bombs_are_bounded_for_an_unprivileged_daemon() {
    // RLIMIT_NPROC binds every uid but 0 (the kernel exempts root); the daemon is meant to run
    // as its own user, so the bomb is shown bounded there.
    require_root();
    let mut d = hostile_daemon();
    give_to_nobody(&d);
    d.user = Some((65534, 65534));
    let c = started(&mut d).await;
    let r = sh(&c, "b() { b | b & }; b; sleep 5 # fork-bomb-marker").await;
    assert!(is_error(&r), "{r}");
    assert!(
        processes_with("fork-bomb-marker").is_empty(),
        "fork bomb processes survived"
    );
    // The bound itself: forking stops at the profile's `processes` (64) more than the uid had.
    let r = py(
        &c,
        "import os, time\nn = 0\ntry:\n    while n < 1000:\n        if os.fork() == 0:\n            time.sleep(3)\n            os._exit(0)\n        n += 1\nexcept OSError as e:\n    print('forks', n, 'then errno', e.errno)\n",
    )
    .await;
    let out = text(&r);
    let forks: u32 = out
        .split_whitespace()
        .nth(1)
        .and_then(|n| n.parse().ok())
        .unwrap_or_else(|| panic!("{r}"));
    assert!(forks <= 64 && out.contains("errno 11"), "{out}");
    // The daemon is unaffected: the next call works.
    let r = call(
        &c,
        "write_text",
        json!({"session": "h", "text": "after", "out": "after.txt"}),
    )
    .await;
    assert!(!is_error(&r), "{r}");
    assert_eq!(d.read("after.txt").as_deref(), Some("after"));
}

/// Hands the daemon's test dir to `nobody`, so the daemon can run as that user.
pub fn give_to_nobody(d: &Daemon) {
    let status = std::process::Command::new("chown")
        .args(["-R", "65534:65534"])
        .arg(d.dir.path())
        .status()
        .unwrap();
    assert!(status.success());
}

#[tokio::test]
async fn the_daemon_and_its_sandbox_work_unprivileged() {
    crate::harness::require_program("/usr/bin/python3", "python3");
    require_root();
    let mut d = hostile_daemon();
    give_to_nobody(&d);
    d.user = Some((65534, 65534));
    let c = started(&mut d).await;
    let uid_line = std::fs::read_to_string(format!("/proc/{}/status", d.pid()))
        .unwrap()
        .lines()
        .find(|l| l.starts_with("Uid:"))
        .unwrap()
        .to_string();
    assert!(uid_line.contains("65534"), "{uid_line}");
    let r = call(
        &c,
        "write_text",
        json!({"session": "h", "text": "as nobody", "out": "n/nobody.txt"}),
    )
    .await;
    assert!(!is_error(&r), "{r}");
    assert_eq!(d.read("n/nobody.txt").as_deref(), Some("as nobody"));
    let r = call(&c, "counter", json!({"session": "h", "by": 3})).await;
    assert!(!is_error(&r), "{r}");
    let ws = d.workspace.display().to_string();
    let r = sh(
        &c,
        &format!(
            "{{ echo x > '{ws}/pwned'; }} 2>&1; grep -E '^(NoNewPrivs|Seccomp):' /proc/self/status"
        ),
    )
    .await;
    let out = text(&r);
    assert!(
        out.contains("Permission denied") && out.contains("Seccomp:\t2"),
        "{out}"
    );
    assert!(d.read("pwned").is_none());
    let r = sh(&c, "sleep 30").await;
    assert_eq!(code(&r), "TOOL_TIMEOUT");
    assert_eq!(version(&c, "h").await, 3);
    let mut log = String::new();
    std::fs::File::open(&d.log)
        .unwrap()
        .read_to_string(&mut log)
        .unwrap();
    assert!(!log.contains("panicked"), "{log}");
}

#[tokio::test]
async fn the_strict_profile_runs_shell_coreutils_and_python_tools() {
    crate::harness::require_program("tar", "tar");
    let mut d = hostile_daemon();
    // Every shipped tool, again under the strict (allow-list) profile.
    for name in ["write_text", "upper", "archive", "counter"] {
        let src = std::fs::read_to_string(d.policies.join(format!("tools/{name}.toml"))).unwrap();
        let mut strict = src.replace(
            &format!("name = \"{name}\""),
            &format!("name = \"{name}_strict\""),
        );
        strict = if strict.contains("profile = \"default\"") {
            strict.replace("profile = \"default\"", "profile = \"strict\"")
        } else {
            strict.replacen(
                "capability = \"write\"",
                "capability = \"write\"\nprofile = \"strict\"",
                1,
            )
        };
        d.add_tool(&format!("{name}_strict"), &strict);
    }
    d.add_tool(
        "probe_strict",
        r#"name = "probe_strict"
capability = "write"
profile = "strict"
command = ["/usr/bin/python3", "-I", "-c", "{code}"]
[params.code]
type = "string"
"#,
    );
    let c = started(&mut d).await;
    let ok = |r: &Value| assert!(!is_error(r), "{r}");
    ok(&call(
        &c,
        "write_text_strict",
        json!({"session": "h", "text": "strict text", "out": "s/a.txt"}),
    )
    .await);
    assert_eq!(d.read("s/a.txt").as_deref(), Some("strict text"));
    ok(&call(
        &c,
        "upper_strict",
        json!({"session": "h", "source": "s/a.txt", "out": "s/b.txt"}),
    )
    .await);
    assert_eq!(d.read("s/b.txt").as_deref(), Some("STRICT TEXT"));
    ok(&call(
        &c,
        "archive_strict",
        json!({"session": "h", "source": "s", "out": "s.tar"}),
    )
    .await);
    let listing = std::process::Command::new("tar")
        .arg("-tf")
        .arg(d.workspace.join("s.tar"))
        .output()
        .unwrap();
    let listing = String::from_utf8_lossy(&listing.stdout);
    assert!(
        listing.contains("s/a.txt") && listing.contains("s/b.txt"),
        "{listing}"
    );
    ok(&call(
        &c,
        "counter_strict",
        json!({"session": "h", "by": 2, "note": "s/n.txt"}),
    )
    .await);
    assert_eq!(d.read("s/n.txt").as_deref(), Some("counter=2\n"));
    // Outside the list: EPERM; clone3: ENOSYS, so glibc falls back to clone.
    let r = call(
        &c,
        "probe_strict",
        json!({"session": "h", "code": "import ctypes, os\nlibc = ctypes.CDLL(None, use_errno=True)\nr = libc.syscall(162)\nprint('sync', r, ctypes.get_errno())\nr = libc.syscall(435, 0, 0)\nprint('clone3', r, ctypes.get_errno())\nprint('fork', os.fork() > 0 or os._exit(0))\n"}),
    )
    .await;
    let out = text(&r);
    #[cfg(target_arch = "x86_64")]
    assert!(out.contains("sync -1 1"), "{out}");
    assert!(
        out.contains("clone3 -1 38") && out.contains("fork True"),
        "{out}"
    );
}

#[tokio::test]
async fn setup_failures_are_sandbox_errors_not_tool_failures() {
    let mut d = hostile_daemon();
    d.add_tool(
        "missing_exe",
        r#"name = "missing_exe"
capability = "write"
command = ["/nonexistent/tool", "{out}"]
[params.out]
type = "string"
path = "output"
"#,
    );
    let c = started(&mut d).await;
    let r = call(&c, "missing_exe", json!({"session": "h", "out": "x.txt"})).await;
    assert_eq!(code(&r), "SANDBOX_ERROR", "{r}");
    let t = text(&r);
    assert!(t.contains("execve") && t.contains("errno 2"), "{t}");
    assert!(d.read("x.txt").is_none() && d.job_dirs().is_empty());
}

#[tokio::test]
async fn a_profile_that_allows_network_gets_it() {
    let mut d = hostile_daemon();
    let default = std::fs::read_to_string(d.policies.join("profiles/default.toml")).unwrap();
    std::fs::write(
        d.policies.join("profiles/net.toml"),
        default.replace("allow = false", "allow = true"),
    )
    .unwrap();
    d.add_tool(
        "net_py",
        r#"name = "net_py"
capability = "write"
profile = "net"
command = ["/usr/bin/python3", "-I", "-c", "{code}"]
[params.code]
type = "string"
"#,
    );
    let c = started(&mut d).await;
    let tcp = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    let port = tcp.local_addr().unwrap().port();
    let code_ = format!("import socket\ns = socket.create_connection(('127.0.0.1', {port}), timeout=5)\ns.sendall(b'hello')\nprint('sent')\n");
    let r = call(&c, "net_py", json!({"session": "h", "code": code_})).await;
    assert!(!is_error(&r) && text(&r).contains("sent"), "{r}");
    let (mut conn, _) = tcp.accept().unwrap();
    let mut got = String::new();
    conn.read_to_string(&mut got).unwrap();
    assert_eq!(got, "hello");
    // The same code under the default profile is refused.
    let r = py(&c, &code_).await;
    assert_eq!(code(&r), "TOOL_FAILED", "{r}");
    assert!(text(&r).contains("Operation not permitted"), "{r}");
}

/// A write tool that declares no output and edits an input in place: `policy check` warns
/// (and still passes), and the call's `TOOL_FAILED` says that writes outside staging are
/// denied; the input is unchanged.
#[tokio::test]
async fn a_write_tool_without_outputs_is_warned_about_and_its_denied_write_explained() {
    let mut d = hostile_daemon();
    d.add_tool(
        "sed_in_place",
        r#"name = "sed_in_place"
description = "Edit a file in place (test only)"
capability = "write"
command = ["/bin/sed", "-i", "s/old/new/", "{file}"]
timeout = "5s"
[params.file]
type = "string"
path = "input"
"#,
    );
    let out = std::process::Command::new(BIN)
        .args(["policy", "check", "--policies"])
        .arg(&d.policies)
        .output()
        .unwrap();
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert_eq!(out.status.code(), Some(0), "{stdout}");
    assert!(
        stdout.contains(
            "warning: tool sed_in_place: declares no output: its inputs are read-only to the \
             worker; it can change nothing in the workspace"
        ),
        "{stdout}"
    );
    assert!(
        !stdout.contains("tool write_text: declares no output"),
        "{stdout}"
    );
    let c = started(&mut d).await;
    d.write("f.txt", "old");
    let before = snapshot(&d.workspace);
    let r = call(&c, "sed_in_place", json!({"session": "h", "file": "f.txt"})).await;
    assert_eq!(code(&r), "TOOL_FAILED", "{r}");
    let t = text(&r);
    assert!(
        t.contains("the tool declares no output") && t.contains("writes elsewhere are denied"),
        "{t}"
    );
    // A tool with an output that writes elsewhere: the message names what it may write.
    let r = call(
        &c,
        "run_sh",
        json!({"session": "h", "script": "echo x > /etc/airlock-denied", "out": "o.txt"}),
    )
    .await;
    assert_eq!(code(&r), "TOOL_FAILED", "{r}");
    let t = text(&r);
    assert!(
        t.contains("Permission denied")
            && t.contains("the worker may write only its staged outputs (out)"),
        "{t}"
    );
    assert!(!std::path::Path::new("/etc/airlock-denied").exists());
    assert_eq!(snapshot(&d.workspace), before);
    assert_eq!(version(&c, "h").await, 0);
}
