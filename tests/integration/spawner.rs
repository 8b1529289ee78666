//! The spawner process that forks every worker. Hostile tools against it
//! (signals, ptrace, its socket), a spawner that dies or hangs (the daemon replaces it and
//! keeps serving), and a daemon killed with SIGKILL (the spawner and the workers die with it).

use serde_json::json;

use crate::harness::*;
use crate::sandbox::{hostile_daemon, py, sh, started};

/// `(pid, ppid, state)` from `/proc/PID/stat`, if the process exists.
fn stat(pid: i32) -> Option<(i32, i32, char)> {
    let s = std::fs::read_to_string(format!("/proc/{pid}/stat")).ok()?;
    let (_, rest) = s.rsplit_once(')')?;
    let mut f = rest.split_whitespace();
    let state = f.next()?.chars().next()?;
    let ppid = f.next()?.parse().ok()?;
    Some((pid, ppid, state))
}

/// A process's name (`/proc/PID/comm`).
fn comm(pid: i32) -> String {
    std::fs::read_to_string(format!("/proc/{pid}/comm"))
        .unwrap_or_default()
        .trim_end()
        .to_string()
}

/// The daemon's live children forked from its spawner process (command line of spawner
/// mode): the spawner, and the worker templates (named `airlock-tmpl`).
fn spawner_mode_children(daemon: i32) -> Vec<i32> {
    processes_with("__airlock-spawner")
        .into_iter()
        .filter(|&p| matches!(stat(p), Some((_, ppid, st)) if ppid == daemon && st != 'Z'))
        .collect()
}

/// The live spawner processes of the daemon `daemon` (its children in spawner mode).
fn spawners_of(daemon: i32) -> Vec<i32> {
    spawner_mode_children(daemon)
        .into_iter()
        .filter(|&p| comm(p) != "airlock-tmpl")
        .collect()
}

/// The live worker templates of the daemon `daemon`.
fn templates_of(daemon: i32) -> Vec<i32> {
    spawner_mode_children(daemon)
        .into_iter()
        .filter(|&p| comm(p) == "airlock-tmpl")
        .collect()
}

/// The daemon's one spawner, waiting for it to be started.
async fn the_spawner(daemon: i32) -> i32 {
    wait_until("the daemon's spawner process", || {
        spawners_of(daemon).len() == 1
    })
    .await;
    spawners_of(daemon)[0]
}

/// A call that must succeed (and write `ok` to `out`).
async fn works(c: &Client, out: &str) {
    let r = call(
        c,
        "run_sh",
        json!({"session": "h", "script": "printf ok > \"$1\"", "out": out}),
    )
    .await;
    assert!(!is_error(&r), "{r}");
}

#[tokio::test]
async fn the_spawner_is_out_of_a_workers_reach() {
    let mut d = hostile_daemon();
    let c = started(&mut d).await;
    let daemon = d.pid() as i32;
    let spawner = the_spawner(daemon).await;
    // Signals: the Landlock signal scope, as for the daemon.
    let r = sh(
        &c,
        &format!("kill -STOP {spawner} 2>&1; kill -KILL {spawner} 2>&1; echo end"),
    )
    .await;
    assert_eq!(
        text(&r).matches("Operation not permitted").count(),
        2,
        "{r}"
    );
    // ptrace, and the files ptrace guards (environ, mem, fd).
    let r = py(
        &c,
        &format!(
            "import ctypes, os\nlibc = ctypes.CDLL(None, use_errno=True)\nr = libc.ptrace(16, {spawner}, 0, 0)\nprint('attach', r, ctypes.get_errno())\nfor f in ('environ', 'mem', 'fd/0'):\n    try:\n        open('/proc/{spawner}/' + f, 'rb').read(1)\n        print('read', f)\n    except OSError as e:\n        print('denied', f, e.errno)\n"
        ),
    )
    .await;
    let out = text(&r);
    assert!(out.contains("attach -1 1"), "{out}");
    for f in ["environ", "mem", "fd/0"] {
        assert!(
            out.contains(&format!("denied {f}")) && !out.contains(&format!("read {f}")),
            "{out}"
        );
    }
    // The worker holds no socket at all (the spawner's socket, the daemon's, the launcher
    // channel): only its three pipes.
    let r = py(
        &c,
        "import os\nfor fd in sorted(os.listdir('/proc/self/fd')):\n    try:\n        print(fd, os.readlink('/proc/self/fd/' + fd))\n    except OSError as e:\n        print(fd, 'gone', e.errno)\n",
    )
    .await;
    let out = text(&r);
    assert!(
        !out.contains("socket:"),
        "a socket reached the worker: {out}"
    );
    for fd in 0..3 {
        assert!(out.contains(&format!("{fd} pipe:")), "{out}");
    }
    // The same spawner is alive, still the daemon's child, and still spawning.
    assert_eq!(spawners_of(daemon), vec![spawner]);
    works(&c, "after.txt").await;
    assert_eq!(d.read("after.txt").as_deref(), Some("ok"));
    assert_eq!(spawners_of(daemon), vec![spawner]);
}

#[tokio::test]
async fn a_killed_spawner_is_replaced() {
    require_root();
    let mut d = hostile_daemon();
    let c = started(&mut d).await;
    let daemon = d.pid() as i32;
    let first = the_spawner(daemon).await;
    works(&c, "one.txt").await;
    rustix::process::kill_process(
        rustix::process::Pid::from_raw(first).expect("pid"),
        rustix::process::Signal::KILL,
    )
    .expect("kill the spawner");
    // Dead before the next call (kill returns before the process is gone; a request delivered
    // to a spawner that dies before answering fails its call, as the stuck-spawner test shows).
    wait_until("the killed spawner dead", || {
        stat(first).is_none_or(|(_, _, st)| st == 'Z')
    })
    .await;
    // The next call is served by a new spawner, and the dead one is reaped.
    works(&c, "two.txt").await;
    assert_eq!(d.read("two.txt").as_deref(), Some("ok"));
    let second = the_spawner(daemon).await;
    assert_ne!(first, second);
    wait_until(
        "the dead spawner reaped",
        || !matches!(stat(first), Some((_, ppid, _)) if ppid == daemon),
    )
    .await;
    assert!(
        d.log_text().contains("spawner process is gone"),
        "{}",
        d.log_text()
    );
    assert!(d.child.as_mut().unwrap().try_wait().unwrap().is_none());
}

#[tokio::test]
async fn a_stuck_spawner_fails_the_call_and_is_replaced() {
    require_root();
    let mut d = hostile_daemon();
    let c = started(&mut d).await;
    let daemon = d.pid() as i32;
    let first = the_spawner(daemon).await;
    let pid = rustix::process::Pid::from_raw(first).expect("pid");
    rustix::process::kill_process(pid, rustix::process::Signal::STOP).expect("stop");
    // The call's request was delivered to a spawner that never answers: it fails, clearly,
    // as a sandbox error, after the answer timeout; nothing of it is published.
    let r = call(
        &c,
        "run_sh",
        json!({"session": "h", "script": "printf no > \"$1\"", "out": "stuck.txt"}),
    )
    .await;
    assert!(is_error(&r), "{r}");
    assert!(text(&r).contains("spawner"), "{r}");
    assert_eq!(d.read("stuck.txt"), None);
    // The stuck spawner was killed (SIGKILL reaches a stopped process) and reaped; the next
    // call gets a new one.
    wait_until(
        "the stuck spawner gone",
        || !matches!(stat(first), Some((_, ppid, _)) if ppid == daemon),
    )
    .await;
    works(&c, "three.txt").await;
    assert_eq!(d.read("three.txt").as_deref(), Some("ok"));
    assert_ne!(the_spawner(daemon).await, first);
}

#[tokio::test]
async fn the_spawner_and_the_workers_die_with_the_daemon() {
    let mut d = hostile_daemon();
    let c = started(&mut d).await;
    let daemon = d.pid() as i32;
    let spawner = the_spawner(daemon).await;
    let socket = d.socket.clone();
    let call = tokio::spawn(async move {
        let stream = tokio::net::UnixStream::connect(&socket)
            .await
            .expect("connect");
        let c2 = rmcp::ServiceExt::serve((), stream)
            .await
            .expect("handshake");
        let _ = call(
            &c2,
            "run_sh",
            json!({"session": "h", "script": "exec sleep 29.7531"}),
        )
        .await;
    });
    wait_for_exact("sleep 29.7531").await;
    let workers = processes_with("sleep 29.7531");
    assert!(!workers.is_empty());
    for w in &workers {
        // The worker is the daemon's child (CLONE_PARENT), not the spawner's.
        assert_eq!(stat(*w).map(|s| s.1), Some(daemon), "worker {w}");
    }
    d.kill9();
    wait_no_process("sleep 29.7531").await;
    // Gone, or a zombie waiting for whoever inherited it: not running.
    wait_until("the spawner gone with the daemon", || {
        stat(spawner).is_none_or(|(_, _, st)| st == 'Z')
    })
    .await;
    assert!(
        processes_with("__airlock-spawner")
            .into_iter()
            .all(|p| p != spawner),
        "the spawner survived the daemon"
    );
    call.abort();
    let _ = call.await;
    drop(c);
}

#[tokio::test]
async fn a_spawner_that_cannot_start_fails_each_call_clearly_and_the_daemon_keeps_serving() {
    let mut d = hostile_daemon();
    // The spawner's executable exits at once: it never says it is ready.
    d.env
        .push(("AIRLOCK_LAUNCHER_EXE".into(), "/bin/false".into()));
    let c = started(&mut d).await;
    let daemon = d.pid() as i32;
    for out in ["one.txt", "two.txt"] {
        let r = call(
            &c,
            "run_sh",
            json!({"session": "h", "script": "printf no > \"$1\"", "out": out}),
        )
        .await;
        assert!(is_error(&r), "{r}");
        assert!(text(&r).contains("spawner"), "{r}");
        assert_eq!(d.read(out), None);
    }
    // Nothing left: no job dir, no spawner, and the session unchanged (version 0).
    assert!(d.job_dirs().is_empty(), "{:?}", d.job_dirs());
    assert!(spawners_of(daemon).is_empty());
    let r = call(&c, "session_get", json!({"session": "h"})).await;
    assert!(!is_error(&r), "{r}");
    assert_eq!(r["structuredContent"]["version"], 0, "{r}");
    assert!(d.child.as_mut().unwrap().try_wait().unwrap().is_none());
}

/// The daemon's templates once there is at least one.
async fn some_templates(daemon: i32) -> Vec<i32> {
    wait_until("a worker template", || !templates_of(daemon).is_empty()).await;
    templates_of(daemon)
}

#[tokio::test]
async fn a_template_is_out_of_a_workers_reach() {
    let mut d = hostile_daemon();
    let c = started(&mut d).await;
    let daemon = d.pid() as i32;
    // The first call of each tool's profile makes its template.
    works(&c, "first.txt").await;
    let _ = py(&c, "print('warm')").await;
    let templates = some_templates(daemon).await;
    for t in &templates {
        // The template is the daemon's child (CLONE_PARENT), like the workers it forks.
        assert_eq!(stat(*t).map(|s| s.1), Some(daemon), "template {t}");
        // Signals: refused (Landlock's signal scope; another uid when the worker has one).
        let r = sh(
            &c,
            &format!("kill -STOP {t} 2>&1; kill -KILL {t} 2>&1; kill -TERM {t} 2>&1; echo end"),
        )
        .await;
        assert_eq!(
            text(&r).matches("Operation not permitted").count(),
            3,
            "{r}"
        );
        // ptrace, and the files ptrace guards (environ, mem, fd).
        let r = py(
            &c,
            &format!(
                "import ctypes, os\nlibc = ctypes.CDLL(None, use_errno=True)\nr = libc.ptrace(16, {t}, 0, 0)\nprint('attach', r, ctypes.get_errno())\nfor f in ('environ', 'mem', 'fd/0', 'fd/3'):\n    try:\n        open('/proc/{t}/' + f, 'rb').read(1)\n        print('read', f)\n    except OSError as e:\n        print('denied', f, e.errno)\n"
            ),
        )
        .await;
        let out = text(&r);
        assert!(out.contains("attach -1 1"), "{out}");
        for f in ["environ", "mem", "fd/0", "fd/3"] {
            assert!(
                out.contains(&format!("denied {f}")) && !out.contains(&format!("read {f}")),
                "{out}"
            );
        }
    }
    // The same templates are alive, still the daemon's children, and still forking.
    works(&c, "after.txt").await;
    assert_eq!(d.read("after.txt").as_deref(), Some("ok"));
    for t in &templates {
        assert!(
            matches!(stat(*t), Some((_, ppid, st)) if ppid == daemon && st != 'Z'),
            "template {t} did not survive its workers"
        );
    }
}

#[tokio::test]
async fn a_killed_template_is_replaced_and_the_next_call_works() {
    require_root();
    let mut d = hostile_daemon();
    let c = started(&mut d).await;
    let daemon = d.pid() as i32;
    works(&c, "one.txt").await;
    let first = some_templates(daemon).await;
    assert_eq!(first.len(), 1, "one profile used, one template: {first:?}");
    let spawner = the_spawner(daemon).await;
    rustix::process::kill_process(
        rustix::process::Pid::from_raw(first[0]).expect("pid"),
        rustix::process::Signal::KILL,
    )
    .expect("kill the template");
    wait_until("the killed template dead", || {
        stat(first[0]).is_none_or(|(_, _, st)| st == 'Z')
    })
    .await;
    // The next call is served by a new template of the same spawner; the dead one is
    // reaped by the daemon.
    works(&c, "two.txt").await;
    assert_eq!(d.read("two.txt").as_deref(), Some("ok"));
    let second = some_templates(daemon).await;
    assert_eq!(second.len(), 1, "{second:?}");
    assert_ne!(second, first);
    assert_eq!(spawners_of(daemon), vec![spawner]);
    wait_until(
        "the dead template reaped",
        || !matches!(stat(first[0]), Some((_, ppid, _)) if ppid == daemon),
    )
    .await;
    // A template stopped (not dead) fails no more than the call it holds: that call fails
    // after the template's timeout, the stopped template is killed, and the next call works.
    let pid = rustix::process::Pid::from_raw(second[0]).expect("pid");
    rustix::process::kill_process(pid, rustix::process::Signal::STOP).expect("stop");
    let r = call(
        &c,
        "run_sh",
        json!({"session": "h", "script": "printf no > \"$1\"", "out": "stuck.txt"}),
    )
    .await;
    assert!(is_error(&r), "{r}");
    assert_eq!(d.read("stuck.txt"), None);
    works(&c, "three.txt").await;
    assert_eq!(d.read("three.txt").as_deref(), Some("ok"));
    wait_until(
        "the stopped template killed and reaped",
        || !matches!(stat(second[0]), Some((_, ppid, _)) if ppid == daemon),
    )
    .await;
    assert_eq!(spawners_of(daemon), vec![spawner]);
    assert!(d.child.as_mut().unwrap().try_wait().unwrap().is_none());
}

#[tokio::test]
async fn templates_die_with_their_spawner_and_with_the_daemon() {
    require_root();
    let mut d = hostile_daemon();
    let c = started(&mut d).await;
    let daemon = d.pid() as i32;
    works(&c, "one.txt").await;
    let first = some_templates(daemon).await;
    // A killed spawner takes its templates with it (they see its end of their socket close).
    let spawner = the_spawner(daemon).await;
    rustix::process::kill_process(
        rustix::process::Pid::from_raw(spawner).expect("pid"),
        rustix::process::Signal::KILL,
    )
    .expect("kill the spawner");
    wait_until("the spawner's templates gone", || {
        first
            .iter()
            .all(|t| !matches!(stat(*t), Some((_, ppid, st)) if ppid == daemon && st != 'Z'))
    })
    .await;
    works(&c, "two.txt").await;
    let second = some_templates(daemon).await;
    assert!(second.iter().all(|t| !first.contains(t)));
    // A daemon killed with SIGKILL takes them too (PDEATHSIG).
    d.kill9();
    wait_until("the templates gone with the daemon", || {
        second
            .iter()
            .all(|t| stat(*t).is_none_or(|(_, _, st)| st == 'Z'))
    })
    .await;
    drop(c);
}

#[tokio::test]
async fn a_reloaded_profile_gets_a_new_template_and_its_rules_take_effect() {
    let mut d = hostile_daemon();
    let c = started(&mut d).await;
    let daemon = d.pid() as i32;
    let r = sh(&c, "uname -s 2>&1; echo rc=$?").await;
    assert!(
        text(&r).contains("Linux") && text(&r).contains("rc=0"),
        "{r}"
    );
    let before = some_templates(daemon).await;
    // The default profile now denies uname: SIGHUP.
    let path = d.policies.join("profiles/default.toml");
    let profile = std::fs::read_to_string(&path).expect("default.toml");
    assert!(profile.contains("\"setsid\", \"setpgid\","));
    std::fs::write(
        &path,
        profile.replace(
            "\"setsid\", \"setpgid\",",
            "\"setsid\", \"setpgid\", \"uname\",",
        ),
    )
    .expect("write default.toml");
    // SAFETY: kill(2) on the test's own child.
    assert_eq!(unsafe { libc::kill(daemon, libc::SIGHUP) }, 0);
    wait_until("the reload", || d.log_text().contains("now serving")).await;
    let r = sh(&c, "uname -s 2>&1; echo rc=$?").await;
    let out = text(&r);
    assert!(
        out.contains("Operation not permitted") && !out.contains("rc=0"),
        "uname still works after the reload: {r}"
    );
    // The old profile's template is stopped once the old policy is gone; a new one forks.
    wait_until("the old template stopped", || {
        before
            .iter()
            .all(|t| !matches!(stat(*t), Some((_, ppid, st)) if ppid == daemon && st != 'Z'))
    })
    .await;
    let after = some_templates(daemon).await;
    assert!(after.iter().all(|t| !before.contains(t)), "{after:?}");
    works(&c, "after.txt").await;
    assert_eq!(d.read("after.txt").as_deref(), Some("ok"));
}

#[tokio::test]
async fn the_worker_registry_is_one_record_per_spawner_not_one_file_per_worker() {
    let mut d = hostile_daemon();
    let c = started(&mut d).await;
    let daemon = d.pid() as i32;
    for i in 0..5 {
        works(&c, &format!("w{i}.txt")).await;
    }
    let spawner = the_spawner(daemon).await;
    let records = || {
        let mut names: Vec<String> = std::fs::read_dir(d.state.join("workers"))
            .expect("the registry dir")
            .map(|e| e.expect("entry").file_name().to_string_lossy().into_owned())
            .collect();
        names.sort();
        names
    };
    // Five workers, one record: the spawner's session, which holds them all.
    assert_eq!(records(), vec![format!("session-{spawner}")]);
    let sid = std::fs::read_to_string(format!("/proc/{spawner}/stat"))
        .expect("the spawner's stat")
        .rsplit_once(')')
        .and_then(|(_, rest)| rest.split_whitespace().nth(3).map(str::to_string));
    assert_eq!(
        sid,
        Some(spawner.to_string()),
        "the spawner leads its session"
    );
}
