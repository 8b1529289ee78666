//! Crash-point tests. Every filesystem mutation of publication, commit and recovery
//! passes one failpoint (built with `--features failpoints`). For each scenario the harness
//! crashes the real daemon (abort, like kill -9) at point N = 0, 1, 2, ... until a run
//! completes; after each crash it restarts the daemon and checks that the workspace is the
//! before or the after snapshot, that the session agrees with it, and that no staging or
//! backup file remains. Then the same with a second crash during recovery, then injected
//! errors (EIO, ENOSPC, EXDEV, EINVAL) at every point, rolled back in process. After each,
//! the audit log's last word on the call's job (its last `commit` or `rollback`) must match
//! the workspace, and `airlock audit verify` must find the chain intact.

use std::os::unix::fs::PermissionsExt;
use std::path::Path;
use std::process::Command;
use std::time::Duration;

use rmcp::model::CallToolRequestParams;
use serde_json::{json, Value};

use crate::harness::*;

struct Scenario {
    name: &'static str,
    tool: &'static str,
    args: Value,
    /// Files in the workspace before the call.
    pre: &'static [(&'static str, &'static str)],
}

/// A daemon dir prepared once and copied for every run.
struct Template {
    daemon: Daemon,
    before: Vec<String>,
    before_session: Value,
}

fn copy_into(from: &Path, to: &Path) {
    std::fs::create_dir_all(to).unwrap();
    let st = Command::new("cp")
        .arg("-a")
        .arg(format!("{}/.", from.display()))
        .arg(to)
        .status()
        .unwrap();
    assert!(st.success(), "cp -a {} {}", from.display(), to.display());
}

impl Template {
    async fn new(s: &Scenario) -> Template {
        let mut daemon = Daemon::new();
        for (p, c) in s.pre {
            daemon.write(p, c);
        }
        daemon.start();
        let c = daemon.client().await;
        let r = call(
            &c,
            "session_create",
            json!({"id": "s", "state": {"counter": 0}}),
        )
        .await;
        assert!(!is_error(&r), "{r}");
        let before_session = session_of(&c).await;
        drop(c);
        daemon.stop();
        Template {
            before: tree(&daemon.workspace),
            daemon,
            before_session,
        }
    }

    /// A fresh daemon dir holding a copy of the template's workspace and state.
    fn fresh(&self) -> Daemon {
        let d = Daemon::new();
        copy_into(&self.daemon.workspace, &d.workspace);
        copy_into(&self.daemon.state, &d.state);
        d
    }
}

async fn session_of(c: &Client) -> Value {
    let r = call(c, "session_get", json!({"session": "s"})).await;
    r["structuredContent"].clone()
}

async fn try_call(d: &Daemon, s: &Scenario) -> Result<Value, String> {
    try_call_keyed(d, s, None).await
}

/// [`try_call`] with an idempotency key in the request's `_meta`.
async fn try_call_keyed(d: &Daemon, s: &Scenario, key: Option<&str>) -> Result<Value, String> {
    let stream = tokio::net::UnixStream::connect(&d.socket)
        .await
        .map_err(|e| e.to_string())?;
    let c = rmcp::ServiceExt::serve((), stream)
        .await
        .map_err(|e| e.to_string())?;
    let mut a = s.args.as_object().cloned().unwrap();
    a.insert("session".into(), "s".into());
    let mut params = CallToolRequestParams::new(s.tool.to_string()).with_arguments(a);
    if let Some(k) = key {
        let mut meta = rmcp::model::RequestMetaObject::default();
        meta.0 .0.insert("airlock/idempotencyKey".into(), k.into());
        params.meta = Some(meta);
    }
    let r = tokio::time::timeout(Duration::from_secs(30), c.call_tool(params))
        .await
        .map_err(|_| "no answer within 30s".to_string())?
        .map_err(|e| e.to_string())?;
    Ok(serde_json::to_value(r).unwrap())
}

/// The audit log's last word on the jobs of `tool`: for each job, its last `commit` or
/// `rollback` (None: neither, the call never got that far).
fn last_words(d: &Daemon, tool: &str) -> Vec<(String, Option<String>)> {
    let text = std::fs::read_to_string(d.state.join("audit.jsonl")).unwrap_or_default();
    let events: Vec<Value> = text
        .lines()
        .map(|l| serde_json::from_str(l).expect("an audit line"))
        .collect();
    let mut jobs: Vec<String> = vec![];
    for e in &events {
        let job = e["job"].as_str().unwrap_or("").to_string();
        if e["tool"] == tool && !jobs.contains(&job) {
            jobs.push(job);
        }
    }
    jobs.into_iter()
        .map(|j| {
            let last = events
                .iter()
                .rev()
                .filter(|e| e["job"] == j.as_str())
                .find(|e| e["kind"] == "commit" || e["kind"] == "rollback")
                .map(|e| e["kind"].as_str().unwrap().to_string());
            (j, last)
        })
        .collect()
}

/// Whether the state dir's entry `name` (its `tree` line `line`) is a live session's spare:
/// `sessions/.<id>.json.tmp`, a regular 0600 file with one link, beside `sessions/<id>.json`.
fn is_spare(name: &str, line: &str, state: &[String]) -> bool {
    let Some(id) = name
        .strip_prefix("sessions/.")
        .and_then(|n| n.strip_suffix(".json.tmp"))
    else {
        return false;
    };
    let file = format!("sessions/{id}.json ");
    line.starts_with(&format!("{name} file 600 nlink=1 "))
        && state.iter().any(|l| l.starts_with(&file))
}

/// Restarts `d` cleanly (recovery runs) and checks the promise. Returns "before" or "after".
async fn check_consistent(
    d: &mut Daemon,
    t: &Template,
    tool: &str,
    after: &(Vec<String>, Value),
    what: &str,
) -> &'static str {
    d.env.clear();
    d.start();
    let c = d.client().await;
    let ws = tree(&d.workspace);
    let sess = session_of(&c).await;
    let outcome = if ws == t.before {
        assert_eq!(
            sess, t.before_session,
            "{what}: workspace is the old one but the session is not"
        );
        "before"
    } else if ws == after.0 {
        assert_eq!(
            sess, after.1,
            "{what}: workspace is the new one but the session is not"
        );
        "after"
    } else {
        panic!(
            "{what}: INCONSISTENT workspace\nbefore: {:#?}\nafter: {:#?}\nnow: {:#?}\nlog:\n{}",
            t.before,
            after.0,
            ws,
            d.log_text()
        );
    };
    assert!(
        d.job_dirs().is_empty(),
        "{what}: job dirs left: {:?}",
        d.job_dirs()
    );
    let state = tree(&d.state);
    let leftovers: Vec<String> = state
        .iter()
        // The entry's name (what follows it is its type, mode and content).
        .filter(|l| {
            l.split(' ')
                .next()
                .is_some_and(|name| name.contains(".tmp") && !is_spare(name, l, &state))
        })
        .cloned()
        .collect();
    assert!(
        leftovers.is_empty(),
        "{what}: temp files in the state dir: {leftovers:?}"
    );
    drop(c);
    d.stop();
    // The log's last word on the call matches the workspace, and its chain is intact.
    let words = last_words(d, tool);
    assert_eq!(
        words.len(),
        1,
        "{what}: jobs of {tool} in the audit: {words:?}"
    );
    let said = words[0].1.as_deref();
    assert_eq!(
        said == Some("commit"),
        outcome == "after",
        "{what}: the workspace is {outcome} but the audit's last word on job {} is {said:?}\n{}",
        words[0].0,
        std::fs::read_to_string(d.state.join("audit.jsonl")).unwrap_or_default()
    );
    d.assert_audit_verifies(what);
    outcome
}

async fn run_scenario(s: Scenario) {
    run_scenario_keyed(s, None).await
}

/// After a crash (or an injected error) of a call with idempotency key `key`, and the
/// restart that settled it: a retry with the key replays the commit the workspace shows
/// (`outcome` "after": a `replay` event, nothing run) or runs afresh when it shows none
/// ("before": a second commit). Either way the workspace and session end as after one call.
async fn retry_keyed(
    d: &mut Daemon,
    s: &Scenario,
    key: &str,
    after: &(Vec<String>, Value),
    outcome: &str,
    what: &str,
) {
    d.env.clear();
    d.start();
    let r = try_call_keyed(d, s, Some(key))
        .await
        .unwrap_or_else(|e| panic!("{what}: retry: {e}"));
    assert!(!is_error(&r), "{what}: retry: {r}");
    let c = d.client().await;
    assert_eq!(tree(&d.workspace), after.0, "{what}: after the retry");
    assert_eq!(session_of(&c).await, after.1, "{what}: after the retry");
    drop(c);
    d.stop();
    let text = std::fs::read_to_string(d.state.join("audit.jsonl")).unwrap_or_default();
    let events: Vec<Value> = text
        .lines()
        .map(|l| serde_json::from_str::<Value>(l).expect("an audit line"))
        .filter(|e| e["tool"] == s.tool)
        .collect();
    let first = events.first().expect("the crashed call's events")["job"].clone();
    let retry = events.last().expect("the retry's events")["job"].clone();
    assert_ne!(first, retry, "{what}: the retry is a job of its own");
    let kinds: Vec<&str> = events
        .iter()
        .filter(|e| e["job"] == retry)
        .map(|e| e["kind"].as_str().unwrap_or(""))
        .collect();
    if outcome == "after" {
        assert_eq!(kinds, ["allow", "replay"], "{what}: the retry replays");
        let replay = events.iter().find(|e| e["kind"] == "replay").unwrap();
        assert_eq!(replay["detail"]["job"], first, "{what}: {replay}");
    } else {
        assert_eq!(
            kinds,
            ["allow", "start", "commit"],
            "{what}: the retry runs"
        );
    }
    d.assert_audit_verifies(what);
}

async fn run_scenario_keyed(s: Scenario, key: Option<&str>) {
    let t = Template::new(&s).await;
    // The reference run: no failpoint fires.
    let mut d = t.fresh();
    let log = d.dir.path().join("points.log");
    d.env = vec![("AIRLOCK_FAILPOINT_LOG".into(), log.display().to_string())];
    d.start();
    let r = try_call(&d, &s).await.expect("reference call");
    assert!(!is_error(&r), "{}: reference call failed: {r}", s.name);
    let c = d.client().await;
    let after = (tree(&d.workspace), session_of(&c).await);
    drop(c);
    d.stop();
    assert_ne!(after.0, t.before, "{}: the call changed nothing", s.name);
    let points: Vec<String> = std::fs::read_to_string(&log)
        .unwrap()
        .lines()
        .map(str::to_string)
        .collect();
    assert!(
        !points.is_empty(),
        "{}: no failpoint was reached: is the binary built with --features failpoints?",
        s.name
    );

    // 1. A crash at every point, then recovery.
    let (mut crashes, mut recovery_crashes, mut outcomes) = (0, 0, [0usize; 2]);
    let mut n = 0u64;
    loop {
        let mut d = t.fresh();
        d.env = vec![("AIRLOCK_FAILPOINT_CRASH_AT".into(), n.to_string())];
        d.start();
        let r = try_call_keyed(&d, &s, key).await;
        let exited = d.wait_exit(Duration::from_secs(10));
        if exited.is_none() {
            // No crash: every point was passed, this run completed.
            let r = r.expect("call without crash");
            assert!(!is_error(&r), "{r}");
            d.kill9();
            break;
        }
        crashes += 1;
        let what = format!("{} crash at {n}", s.name);
        let o = check_consistent(&mut d, &t, s.tool, &after, &what).await;
        outcomes[usize::from(o == "after")] += 1;
        if let Some(key) = key {
            retry_keyed(&mut d, &s, key, &after, o, &what).await;
        }

        // 2. The same crash again (recovery decides by inode identity, so the crashed dir
        // cannot be copied), then a second crash at every point of recovery.
        let mut m = 0u64;
        loop {
            let mut d2 = t.fresh();
            d2.env = vec![("AIRLOCK_FAILPOINT_CRASH_AT".into(), n.to_string())];
            d2.start();
            let r = try_call_keyed(&d2, &s, key).await;
            assert!(
                d2.wait_exit(Duration::from_secs(10)).is_some(),
                "{}: crash at {n} did not repeat (the call: {r:?}):\n{}",
                s.name,
                d2.log_text()
            );
            d2.env = vec![("AIRLOCK_FAILPOINT_CRASH_AT".into(), m.to_string())];
            let serving = d2.try_start().is_ok();
            if serving {
                d2.kill9();
            } else {
                recovery_crashes += 1;
            }
            check_consistent(
                &mut d2,
                &t,
                s.tool,
                &after,
                &format!("{} crash at {n}, recovery crash at {m}", s.name),
            )
            .await;
            if serving {
                break;
            }
            m += 1;
        }
        n += 1;
    }

    // 3. An injected error at every point, rolled back in process.
    let mut injected = 0;
    for (n, point) in points.iter().enumerate() {
        for errno in ["EIO", "ENOSPC", "EXDEV", "EINVAL"] {
            let mut d = t.fresh();
            d.env = vec![
                ("AIRLOCK_FAILPOINT_ERROR_AT".into(), n.to_string()),
                ("AIRLOCK_FAILPOINT_ERRNO".into(), errno.into()),
            ];
            d.start();
            let r = try_call_keyed(&d, &s, key)
                .await
                .unwrap_or_else(|e| panic!("{} {errno} at {n}: {e}\n{}", s.name, d.log_text()));
            // In process, before any restart: the reply tells which version is there.
            let ws = tree(&d.workspace);
            if is_error(&r) {
                assert_eq!(
                    ws, t.before,
                    "{} {errno} at {n} ({}): failed call left changes: {r}",
                    s.name, point
                );
                assert!(
                    d.job_dirs().is_empty(),
                    "{} {errno} at {n}: job dir left after rollback",
                    s.name
                );
            } else {
                // Committed. A failed cleanup may leave the job dir (journal `committed`) for
                // the next startup's recovery to finish; the targets are already the new ones.
                let ws: Vec<String> = ws
                    .into_iter()
                    .filter(|l| !l.starts_with(".airlock-job-"))
                    .collect();
                assert_eq!(
                    ws, after.0,
                    "{} {errno} at {n} ({}): successful call but workspace differs",
                    s.name, point
                );
            }
            d.stop();
            let what = format!("{} {errno} at {n}", s.name);
            let o = check_consistent(&mut d, &t, s.tool, &after, &what).await;
            if let Some(key) = key {
                retry_keyed(&mut d, &s, key, &after, o, &what).await;
            }
            injected += 1;
        }
    }
    println!(
        "crash harness [{}]: {} failpoints per call; {crashes} crash points exercised ({} rolled back, {} completed), \
         {recovery_crashes} second crashes during recovery, {injected} injected errors; 0 inconsistent outcomes",
        s.name,
        points.len(),
        outcomes[0],
        outcomes[1]
    );
}

#[tokio::test(flavor = "multi_thread")]
async fn crash_points_one_new_output() {
    run_scenario(Scenario {
        name: "one new output",
        tool: "write_text",
        args: json!({"text": "new", "out": "a.txt"}),
        pre: &[],
    })
    .await;
}

/// A call with an idempotency key: after a crash at any point (or an error injected at any
/// point) and the restart, a retry with the key replays the commit the workspace shows, or
/// runs afresh when it shows none: never both, never neither.
#[tokio::test(flavor = "multi_thread")]
async fn crash_points_a_keyed_call() {
    crate::harness::require_program("/usr/bin/python3", "python3");
    run_scenario_keyed(
        Scenario {
            name: "keyed json state + output",
            tool: "counter",
            args: json!({"by": 7, "note": "notes/n.txt"}),
            pre: &[],
        },
        Some("retry-key-1"),
    )
    .await;
}

#[tokio::test(flavor = "multi_thread")]
async fn crash_points_outputs_replacing_files() {
    run_scenario(Scenario {
        name: "two outputs replacing files",
        tool: "two_outputs",
        args: json!({"a": "x/a.txt", "b": "y.txt"}),
        pre: &[
            ("x/a.txt", "old a"),
            ("y.txt", "old y"),
            ("keep.txt", "untouched"),
        ],
    })
    .await;
}

#[tokio::test(flavor = "multi_thread")]
async fn crash_points_outputs_in_new_subdirectories() {
    run_scenario(Scenario {
        name: "outputs in new subdirectories",
        tool: "two_outputs",
        args: json!({"a": "new/deep/a.txt", "b": "exists.txt"}),
        pre: &[("exists.txt", "old")],
    })
    .await;
}

#[tokio::test(flavor = "multi_thread")]
async fn crash_points_state_and_output_together() {
    crate::harness::require_program("/usr/bin/python3", "python3");
    run_scenario(Scenario {
        name: "json state + output",
        tool: "counter",
        args: json!({"by": 7, "note": "notes/n.txt"}),
        pre: &[],
    })
    .await;
}

#[tokio::test(flavor = "multi_thread")]
async fn crash_points_a_new_directory_output() {
    run_scenario(Scenario {
        name: "a new directory output",
        tool: "write_tree",
        args: json!({"text": "new", "out": "new/site"}),
        pre: &[("keep.txt", "untouched")],
    })
    .await;
}

#[tokio::test(flavor = "multi_thread")]
async fn crash_points_a_directory_replaced_by_exchange() {
    run_scenario(Scenario {
        name: "a directory replaced by exchange",
        tool: "write_tree",
        args: json!({"text": "new", "out": "site"}),
        pre: &[
            ("site/old.html", "old"),
            ("site/sub/a.txt", "old a"),
            ("site/deeper/x/y", "old y"),
        ],
    })
    .await;
}

#[tokio::test(flavor = "multi_thread")]
async fn crash_points_inout_file_changed() {
    run_scenario(Scenario {
        name: "in-out file changed",
        tool: "edit_inout",
        args: json!({"path": "docs/a.txt", "action": "append:more"}),
        pre: &[("docs/a.txt", "alpha\n"), ("keep.txt", "untouched")],
    })
    .await;
}

#[tokio::test(flavor = "multi_thread")]
async fn crash_points_inout_file_deleted() {
    run_scenario(Scenario {
        name: "in-out file deleted",
        tool: "edit_inout",
        args: json!({"path": "docs/a.txt", "action": "rm"}),
        pre: &[("docs/a.txt", "alpha\n"), ("keep.txt", "untouched")],
    })
    .await;
}

#[tokio::test(flavor = "multi_thread")]
async fn crash_points_inout_directory_changed() {
    run_scenario(Scenario {
        name: "in-out directory changed",
        tool: "edit_tree",
        args: json!({"dir": "docs", "action": "edit"}),
        pre: &[
            ("docs/sub/a.txt", "alpha"),
            ("docs/b.txt", "beta"),
            ("keep.txt", "untouched"),
        ],
    })
    .await;
}

#[tokio::test(flavor = "multi_thread")]
async fn offline_recover_rolls_back_and_is_idempotent() {
    let s = Scenario {
        name: "offline recover",
        tool: "two_outputs",
        args: json!({"a": "r/a.txt", "b": "b.txt"}),
        pre: &[("b.txt", "old b")],
    };
    let t = Template::new(&s).await;
    // Find the first point after both targets are in place (the committing_state journal).
    let mut d = t.fresh();
    let log = d.dir.path().join("points.log");
    d.env = vec![("AIRLOCK_FAILPOINT_LOG".into(), log.display().to_string())];
    d.start();
    assert!(!is_error(&try_call(&d, &s).await.unwrap()));
    d.stop();
    let points = std::fs::read_to_string(&log).unwrap();
    let renames: Vec<usize> = points
        .lines()
        .enumerate()
        .filter(|(_, l)| l.contains("publish.exchange") || l.contains("publish.rename_noreplace"))
        .map(|(i, _)| i)
        .collect();
    let crash_at = renames.last().unwrap() + 1;

    let mut d = t.fresh();
    d.env = vec![("AIRLOCK_FAILPOINT_CRASH_AT".into(), crash_at.to_string())];
    d.start();
    let _ = try_call(&d, &s).await;
    assert!(
        d.wait_exit(Duration::from_secs(10)).is_some(),
        "no crash at {crash_at}"
    );
    assert_eq!(
        d.read("b.txt").as_deref(),
        Some("B\n"),
        "the crash left the new file in place"
    );
    assert_eq!(d.job_dirs().len(), 1);
    let out = d.recover(None).output().expect("airlock recover");
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert!(
        stdout.contains("rolled back") && stdout.contains("recovered 1 job(s)"),
        "{stdout}"
    );
    assert_eq!(tree(&d.workspace), t.before);
    let out = d.recover(None).output().expect("airlock recover");
    assert!(String::from_utf8_lossy(&out.stdout).contains("recovered 0 job(s)"));
    // Never while a daemon holds the workspace.
    d.env.clear();
    d.start();
    let out = d.recover(None).output().expect("airlock recover");
    assert_eq!(out.status.code(), Some(2));
    assert!(String::from_utf8_lossy(&out.stderr).contains("holds this workspace"));
    let c = d.client().await;
    assert_eq!(session_of(&c).await, t.before_session);
}

// ---------------------------------------------------------------------------------------
// A job dir recovery cannot prove disposable is kept, as it is, aside.

/// What is done to a crashed job between the crash and the restart.
#[derive(Debug, Clone, Copy)]
enum Harm {
    /// `recovery.json` cut to half its length.
    Truncated,
    /// `recovery.json` cut to nothing (not the blank marker a settled job leaves).
    Emptied,
    /// `recovery.json` replaced by bytes that are not JSON.
    Garbage,
    /// `recovery.json` rewritten with `"version": 99` (another release's journal).
    UnknownVersion,
    /// `recovery.json` replaced by a directory (unreadable as a file, root or not).
    Directory,
    /// `recovery.json` made mode 0000 (unreadable by an unprivileged daemon, its owner).
    Mode000,
    /// The parent directory `x` of target `x/a.txt` moved to `x.real` and replaced by a
    /// symlink to it: the journal is fine, the target cannot be reached safely.
    ParentSwapped,
}

fn chown_nobody(d: &Daemon) {
    let st = Command::new("chown")
        .args(["-R", "65534:65534"])
        .arg(d.dir.path())
        .status()
        .unwrap();
    assert!(st.success());
}

/// A fresh copy of `t` for a daemon as root or as nobody.
fn fresh_as(t: &Template, unprivileged: bool) -> Daemon {
    let mut d = t.fresh();
    if unprivileged {
        chown_nobody(&d);
        d.user = Some((65534, 65534));
    }
    d
}

fn recover_as(d: &Daemon) -> (bool, String, String) {
    let out = d.recover(d.user).output().expect("airlock recover");
    (
        out.status.success(),
        String::from_utf8_lossy(&out.stdout).into_owned(),
        String::from_utf8_lossy(&out.stderr).into_owned(),
    )
}

fn audit_events(d: &Daemon) -> Vec<Value> {
    std::fs::read_to_string(d.state.join("audit.jsonl"))
        .unwrap_or_default()
        .lines()
        .map(|l| serde_json::from_str(l).expect("an audit line"))
        .collect()
}

/// Crashes a call replacing `x/a.txt` and `y.txt` after both renames, before the commit
/// point (each target holds its uncommitted new file, the job dir the only old copies),
/// applies `harm`, then restarts (the daemon, or `airlock recover` first when `offline`) and
/// checks that nothing was lost: the job dir is kept aside byte for byte, no target is
/// touched, the session keeps its old version, the audit log records it and verifies, the
/// daemon serves, and later restarts leave the quarantine dir as it is.
async fn kept_when_not_provably_disposable(harm: Harm, unprivileged: bool, offline: bool) {
    require_root();
    let what = format!("{harm:?} (unprivileged: {unprivileged}, offline first: {offline})");
    let s = Scenario {
        name: "kept job",
        tool: "two_outputs",
        args: json!({"a": "x/a.txt", "b": "y.txt"}),
        pre: &[("x/a.txt", "old a"), ("y.txt", "old y")],
    };
    let t = Template::new(&s).await;
    // The reference run tells the point right after the last rename.
    let mut d = fresh_as(&t, unprivileged);
    let log = d.dir.path().join("points.log");
    d.env = vec![("AIRLOCK_FAILPOINT_LOG".into(), log.display().to_string())];
    d.start();
    assert!(!is_error(&try_call(&d, &s).await.unwrap()), "{what}");
    d.stop();
    let points = std::fs::read_to_string(&log).unwrap();
    let last_rename = points
        .lines()
        .enumerate()
        .filter(|(_, l)| l.contains("publish.exchange"))
        .map(|(i, _)| i)
        .last()
        .expect("an exchange point");
    let crash_at = last_rename + 1;

    let mut d = fresh_as(&t, unprivileged);
    d.env = vec![("AIRLOCK_FAILPOINT_CRASH_AT".into(), crash_at.to_string())];
    d.start();
    let _ = try_call(&d, &s).await;
    assert!(
        d.wait_exit(Duration::from_secs(10)).is_some(),
        "{what}: no crash at {crash_at}"
    );
    d.env.clear();
    // Both targets hold the uncommitted new files; the job dir the old ones.
    assert_eq!(d.read("x/a.txt").as_deref(), Some("A\n"), "{what}");
    assert_eq!(d.read("y.txt").as_deref(), Some("B\n"), "{what}");
    let jobs = d.job_dirs();
    assert_eq!(jobs.len(), 1, "{what}");
    let job = d.workspace.join(&jobs[0]);
    let id = jobs[0].trim_start_matches(".airlock-job-").to_string();
    assert_eq!(
        std::fs::read_to_string(job.join("stage/0/a.txt")).unwrap(),
        "old a"
    );
    assert_eq!(
        std::fs::read_to_string(job.join("stage/1/y.txt")).unwrap(),
        "old y"
    );
    let journal = job.join("recovery.json");
    let bytes = std::fs::read(&journal).unwrap();
    match harm {
        Harm::Truncated => std::fs::write(&journal, &bytes[..bytes.len() / 2]).unwrap(),
        Harm::Emptied => std::fs::write(&journal, b"").unwrap(),
        Harm::Garbage => std::fs::write(&journal, b"\x00\xff{ not a journal \x01").unwrap(),
        Harm::UnknownVersion => {
            let mut v: Value = serde_json::from_slice(&bytes).unwrap();
            v["version"] = json!(99);
            std::fs::write(&journal, serde_json::to_vec(&v).unwrap()).unwrap();
        }
        Harm::Directory => {
            std::fs::remove_file(&journal).unwrap();
            std::fs::create_dir(&journal).unwrap();
            std::fs::write(journal.join("inside"), "kept too").unwrap();
        }
        Harm::Mode000 => {
            std::fs::set_permissions(&journal, std::fs::Permissions::from_mode(0o000)).unwrap()
        }
        Harm::ParentSwapped => {
            std::fs::rename(d.workspace.join("x"), d.workspace.join("x.real")).unwrap();
            std::os::unix::fs::symlink("x.real", d.workspace.join("x")).unwrap();
        }
    }
    if unprivileged {
        chown_nobody(&d);
    }
    // What recovery must keep, byte for byte, and what it must not touch.
    let kept = tree(&job);
    let qname = format!(".airlock-quarantine-{id}");
    let quarantine = d.workspace.join(&qname);
    let outside = |d: &Daemon| -> Vec<String> {
        tree(&d.workspace)
            .into_iter()
            .filter(|l| !l.starts_with(&jobs[0]) && !l.starts_with(&qname))
            .collect()
    };
    let workspace_before = outside(&d);

    // Where the recovery that kept it logs.
    let mut first_log = None;
    if offline {
        let (ok, stdout, stderr) = recover_as(&d);
        assert!(ok, "{what}: {stdout} {stderr}");
        assert!(
            stdout.contains(&format!("{id}: kept as ")),
            "{what}: {stdout}"
        );
        assert!(
            stdout.contains("kept aside with every byte") && stdout.contains(&qname),
            "{what}: {stdout}"
        );
        assert!(stdout.contains("recovered 0 job(s)"), "{what}: {stdout}");
        first_log = Some(stderr);
    }
    d.start();
    let c = d.client().await;
    assert!(d.job_dirs().is_empty(), "{what}: {:?}", d.job_dirs());
    assert_eq!(tree(&quarantine), kept, "{what}: the kept dir differs");
    if !matches!(harm, Harm::Directory) {
        let stage0 = quarantine.join("stage/0/a.txt");
        assert_eq!(std::fs::read_to_string(stage0).unwrap(), "old a");
    }
    assert_eq!(
        outside(&d),
        workspace_before,
        "{what}: recovery touched the workspace"
    );
    assert_eq!(session_of(&c).await, t.before_session, "{what}: session");
    let log = first_log.unwrap_or_else(|| d.log_text());
    assert!(
        log.contains("kept it aside with every byte") && log.contains(&qname),
        "{what}: {log}"
    );
    assert!(
        log.contains("compare") || log.contains("restore"),
        "{what}: {log}"
    );
    // It serves: a new call commits.
    let r = call(
        &c,
        "write_text",
        json!({"session": "s", "text": "served", "out": "after.txt"}),
    )
    .await;
    assert!(!is_error(&r), "{what}: {r}");
    assert_eq!(d.read("after.txt").as_deref(), Some("served"));
    drop(c);
    d.stop();
    // The log records it once (the call did not commit), and its chain is intact.
    let events = audit_events(&d);
    let kept_events: Vec<&Value> = events
        .iter()
        .filter(|e| e["job"] == id.as_str() && e["detail"]["recovery"] == true)
        .collect();
    assert_eq!(kept_events.len(), 1, "{what}: {kept_events:?}");
    let e = kept_events[0];
    assert_eq!(e["kind"], "error", "{what}: {e}");
    assert_eq!(e["detail"]["code"], "RECOVERY_KEPT", "{what}: {e}");
    assert_eq!(
        e["detail"]["quarantined"],
        quarantine.display().to_string(),
        "{what}: {e}"
    );
    assert!(
        !events
            .iter()
            .any(|e| e["job"] == id.as_str() && e["kind"] == "commit"),
        "{what}"
    );
    d.assert_audit_verifies(&what);

    // Later recoveries never touch it: `airlock recover`, then two daemon restarts.
    let (ok, stdout, stderr) = recover_as(&d);
    assert!(ok, "{what}: {stdout} {stderr}");
    assert!(
        stdout.contains("still quarantined") && stdout.contains(&qname),
        "{what}: {stdout}"
    );
    for _ in 0..2 {
        d.start();
        let c = d.client().await;
        assert_eq!(
            tree(&quarantine),
            kept,
            "{what}: a later recovery touched it"
        );
        assert!(d.job_dirs().is_empty(), "{what}");
        let r = call(
            &c,
            "write_text",
            json!({"session": "s", "text": "again", "out": "after.txt"}),
        )
        .await;
        assert!(!is_error(&r), "{what}: {r}");
        drop(c);
        d.stop();
    }
    let later = audit_events(&d)
        .iter()
        .filter(|e| e["job"] == id.as_str())
        .count();
    let first = events.iter().filter(|e| e["job"] == id.as_str()).count();
    assert_eq!(
        later, first,
        "{what}: later recoveries recorded the job again"
    );
    d.assert_audit_verifies(&what);
}

#[tokio::test(flavor = "multi_thread")]
async fn a_truncated_journal_keeps_the_job_dir_aside() {
    kept_when_not_provably_disposable(Harm::Truncated, false, false).await;
}

#[tokio::test(flavor = "multi_thread")]
async fn a_journal_cut_to_nothing_keeps_the_job_dir_aside_under_an_unprivileged_daemon() {
    kept_when_not_provably_disposable(Harm::Emptied, true, false).await;
}

#[tokio::test(flavor = "multi_thread")]
async fn a_garbage_journal_keeps_the_job_dir_aside_offline_too() {
    kept_when_not_provably_disposable(Harm::Garbage, false, true).await;
}

#[tokio::test(flavor = "multi_thread")]
async fn a_journal_of_an_unknown_version_keeps_the_job_dir_aside() {
    kept_when_not_provably_disposable(Harm::UnknownVersion, false, false).await;
}

#[tokio::test(flavor = "multi_thread")]
async fn a_journal_replaced_by_a_directory_keeps_the_job_dir_aside() {
    kept_when_not_provably_disposable(Harm::Directory, false, false).await;
}

#[tokio::test(flavor = "multi_thread")]
async fn an_unreadable_journal_keeps_the_job_dir_aside_under_an_unprivileged_daemon() {
    kept_when_not_provably_disposable(Harm::Mode000, true, false).await;
}

#[tokio::test(flavor = "multi_thread")]
async fn a_swapped_parent_keeps_the_job_dir_aside() {
    kept_when_not_provably_disposable(Harm::ParentSwapped, false, false).await;
}

#[tokio::test(flavor = "multi_thread")]
async fn a_swapped_parent_keeps_the_job_dir_aside_under_an_unprivileged_daemon() {
    kept_when_not_provably_disposable(Harm::ParentSwapped, true, true).await;
}

// ---------------------------------------------------------------------------------------
// Undo data: a commit that keeps it (dropping the previous commit's), and an undo.

/// A crash-point scenario with a commit before it (`prelude`, run in each fresh daemon and
/// restarted from, since undo data is told by inode identity and cannot be copied).
struct UndoScenario {
    name: &'static str,
    pre: &'static [(&'static str, &'static str)],
    /// The commit made before the crashed call: `(tool, arguments)`.
    prelude: (&'static str, Value),
    /// The crashed call: a write (which keeps undo data of its own and drops the prelude's),
    /// or `None`: `job_undo` of the prelude's job.
    call: Option<(&'static str, Value)>,
}

impl UndoScenario {
    fn tool(&self) -> &'static str {
        self.call.as_ref().map_or("job_undo", |(t, _)| t)
    }

    fn args(&self, prelude_job: &str) -> Value {
        match &self.call {
            Some((_, a)) => a.clone(),
            None => json!({"job": prelude_job}),
        }
    }
}

/// A fresh copy of the template with the prelude committed in it (daemon stopped); the
/// prelude's job.
async fn with_prelude(t: &Template, s: &UndoScenario) -> (Daemon, String) {
    let mut d = t.fresh();
    d.start();
    let c = d.client().await;
    let mut a = s.prelude.1.clone();
    a["session"] = "s".into();
    let r = call(&c, s.prelude.0, a).await;
    assert!(!is_error(&r), "{}: prelude: {r}", s.name);
    assert_eq!(r["structuredContent"]["undoable"], true, "{}: {r}", s.name);
    let job = r["structuredContent"]["job"].as_str().unwrap().to_string();
    drop(c);
    d.stop();
    (d, job)
}

/// The first job of `tool` in the audit log, with its last `commit` or `rollback`.
fn first_word(d: &Daemon, tool: &str) -> Option<(String, Option<String>)> {
    last_words(d, tool).into_iter().next()
}

/// Restarts `d` cleanly and checks the promise with undo data: the workspace and session are
/// the before or the after of the crashed call, its audit's last word agrees, and the undo
/// data is exactly what that outcome implies, proven by undoing with it: before a crashed
/// write, the prelude is still undoable and its undo gives back the template; after it, the
/// write is undoable and its undo gives back the before. Before a crashed undo, the prelude
/// is undoable iff `job_get` says so (and then its undo works); after it, nothing is left.
/// `injected`: an error, not a crash, was injected: a write may then commit without undo data
/// (it failed to keep it), which `job_get` must say.
#[allow(clippy::too_many_arguments)]
async fn check_undo_consistent(
    d: &mut Daemon,
    injected: bool,
    s: &UndoScenario,
    origin: &[String],
    before: &(Vec<String>, Value),
    after: &(Vec<String>, Value),
    prelude: &str,
    what: &str,
) -> &'static str {
    d.env.clear();
    d.start();
    let c = d.client().await;
    let ws = tree(&d.workspace);
    let sess = session_of(&c).await;
    let outcome = if ws == before.0 {
        assert_eq!(sess, before.1, "{what}: workspace before, session not");
        "before"
    } else if ws == after.0 {
        assert_eq!(sess, after.1, "{what}: workspace after, session not");
        "after"
    } else {
        panic!(
            "{what}: INCONSISTENT workspace\nbefore: {:#?}\nafter: {:#?}\nnow: {:#?}\nlog:\n{}",
            before.0,
            after.0,
            ws,
            d.log_text()
        );
    };
    assert!(d.job_dirs().is_empty(), "{what}: {:?}", d.job_dirs());
    let (job, said) = first_word(d, s.tool()).unwrap_or_else(|| ("".into(), None));
    assert_eq!(
        said.as_deref() == Some("commit"),
        outcome == "after",
        "{what}: workspace {outcome}, audit's last word on {job}: {said:?}"
    );
    let gens = d.undo_generations();
    let undoable = |j: &str| {
        let c = &c;
        let j = j.to_string();
        async move {
            let r = call(c, "job_get", json!({"job": j})).await;
            r["structuredContent"]["undoable"] == true
        }
    };
    // Which job's undo data must be there, and what its undo gives back.
    let expect: Option<(String, &[String])> = match (s.call.is_some(), outcome) {
        (true, "before") => Some((prelude.to_string(), origin)),
        (true, _) if injected && gens.is_empty() => {
            assert!(
                !undoable(&job).await,
                "{what}: {job} undoable without undo data"
            );
            None
        }
        (true, _) => Some((job.clone(), &before.0)),
        (false, "before") => undoable(prelude)
            .await
            .then(|| (prelude.to_string(), origin)),
        (false, _) => None,
    };
    match &expect {
        Some((j, back)) => {
            assert_eq!(gens, vec![format!("s/{j}")], "{what}: undo data");
            assert!(undoable(j).await, "{what}: {j} not undoable");
            let r = call(&c, "job_undo", json!({"session": "s", "job": j})).await;
            assert!(!is_error(&r), "{what}: the undo with it: {r}");
            assert_eq!(&tree(&d.workspace), back, "{what}: after the undo with it");
        }
        None => {
            // An undo that failed in process after renaming a target gave the backups back,
            // but the renames back changed that target's ctime: its data stays, refused.
            let touched = injected && s.call.is_none() && outcome == "before";
            if !(touched && gens == vec![format!("s/{prelude}")]) {
                assert!(gens.is_empty(), "{what}: undo data left: {gens:?}");
            }
            assert!(!undoable(prelude).await, "{what}: {prelude} undoable");
            let ws = tree(&d.workspace);
            let r = call(&c, "job_undo", json!({"session": "s", "job": prelude})).await;
            assert!(is_error(&r), "{what}: {r}");
            assert_eq!(
                tree(&d.workspace),
                ws,
                "{what}: a refused undo changed files"
            );
        }
    }
    drop(c);
    d.stop();
    d.assert_audit_verifies(what);
    outcome
}

async fn run_undo_scenario(s: UndoScenario) {
    let t = Template::new(&Scenario {
        name: s.name,
        tool: "",
        args: json!({}),
        pre: s.pre,
    })
    .await;
    let origin = t.before.clone();
    // The reference run: the prelude, then the call, no failpoint firing.
    let (mut d, prelude) = with_prelude(&t, &s).await;
    d.start();
    let c = d.client().await;
    let before = (tree(&d.workspace), session_of(&c).await);
    drop(c);
    let log = d.dir.path().join("points.log");
    d.stop();
    d.env = vec![("AIRLOCK_FAILPOINT_LOG".into(), log.display().to_string())];
    d.start();
    // The crashed call, naming the prelude's job of its run.
    let run = |_: &Daemon, prelude: &str| Scenario {
        name: s.name,
        tool: s.tool(),
        args: s.args(prelude),
        pre: &[],
    };
    let sc = run(&d, &prelude);
    let r = try_call(&d, &sc).await.expect("reference call");
    assert!(!is_error(&r), "{}: reference call: {r}", s.name);
    let c = d.client().await;
    let after = (tree(&d.workspace), session_of(&c).await);
    drop(c);
    d.stop();
    assert_ne!(after.0, before.0, "{}: the call changed nothing", s.name);
    let points: Vec<String> = std::fs::read_to_string(&log)
        .unwrap()
        .lines()
        .map(str::to_string)
        .collect();
    assert!(!points.is_empty(), "{}: no failpoint reached", s.name);

    let (mut crashes, mut recovery_crashes, mut outcomes) = (0, 0, [0usize; 2]);
    let mut n = 0u64;
    loop {
        let (mut d, prelude) = with_prelude(&t, &s).await;
        let sc = run(&d, &prelude);
        d.env = vec![("AIRLOCK_FAILPOINT_CRASH_AT".into(), n.to_string())];
        d.start();
        let r = try_call(&d, &sc).await;
        if d.wait_exit(Duration::from_secs(10)).is_none() {
            let r = r.expect("call without crash");
            assert!(!is_error(&r), "{r}");
            d.kill9();
            break;
        }
        crashes += 1;
        let what = format!("{} crash at {n}", s.name);
        let o = check_undo_consistent(&mut d, false, &s, &origin, &before, &after, &prelude, &what)
            .await;
        outcomes[usize::from(o == "after")] += 1;
        // A second crash at every point of the recovery.
        let mut m = 0u64;
        loop {
            let (mut d2, prelude) = with_prelude(&t, &s).await;
            let sc = run(&d2, &prelude);
            d2.env = vec![("AIRLOCK_FAILPOINT_CRASH_AT".into(), n.to_string())];
            d2.start();
            let _ = try_call(&d2, &sc).await;
            assert!(
                d2.wait_exit(Duration::from_secs(10)).is_some(),
                "{}: crash at {n} did not repeat",
                s.name
            );
            d2.env = vec![("AIRLOCK_FAILPOINT_CRASH_AT".into(), m.to_string())];
            let serving = d2.try_start().is_ok();
            if serving {
                d2.kill9();
            } else {
                recovery_crashes += 1;
            }
            let what = format!("{} crash at {n}, recovery crash at {m}", s.name);
            check_undo_consistent(
                &mut d2, false, &s, &origin, &before, &after, &prelude, &what,
            )
            .await;
            if serving {
                break;
            }
            m += 1;
        }
        n += 1;
    }

    let mut injected = 0;
    for (n, point) in points.iter().enumerate() {
        for errno in ["EIO", "ENOSPC"] {
            let (mut d, prelude) = with_prelude(&t, &s).await;
            let sc = run(&d, &prelude);
            d.env = vec![
                ("AIRLOCK_FAILPOINT_ERROR_AT".into(), n.to_string()),
                ("AIRLOCK_FAILPOINT_ERRNO".into(), errno.into()),
            ];
            d.start();
            let r = try_call(&d, &sc)
                .await
                .unwrap_or_else(|e| panic!("{} {errno} at {n}: {e}", s.name));
            let ws: Vec<String> = tree(&d.workspace)
                .into_iter()
                .filter(|l| !l.starts_with(".airlock-job-"))
                .collect();
            let want = if is_error(&r) { &before.0 } else { &after.0 };
            assert_eq!(&ws, want, "{} {errno} at {n} ({point}): {r}", s.name);
            d.stop();
            let what = format!("{} {errno} at {n} ({point})", s.name);
            check_undo_consistent(&mut d, true, &s, &origin, &before, &after, &prelude, &what)
                .await;
            injected += 1;
        }
    }
    println!(
        "crash harness [{}]: {} failpoints per call; {crashes} crash points exercised ({} rolled back, {} completed), \
         {recovery_crashes} second crashes during recovery, {injected} injected errors; 0 inconsistent outcomes",
        s.name,
        points.len(),
        outcomes[0],
        outcomes[1]
    );
}

/// A commit that keeps undo data of its own (an overwritten file), after a commit that kept
/// some: whatever the crash point, either the earlier commit stays undoable or the new one
/// is, and the undo with what is kept gives back what was.
#[tokio::test(flavor = "multi_thread")]
async fn crash_points_a_commit_that_keeps_undo_data() {
    run_undo_scenario(UndoScenario {
        name: "a commit keeping undo data",
        pre: &[("y.txt", "old y"), ("keep.txt", "untouched")],
        prelude: ("write_text", json!({"text": "p", "out": "p.txt"})),
        call: Some(("write_file", json!({"path": "y.txt", "content": "new y"}))),
    })
    .await;
}

/// An undo of an overwritten file and a new one in a new directory.
#[tokio::test(flavor = "multi_thread")]
async fn crash_points_an_undo() {
    run_undo_scenario(UndoScenario {
        name: "an undo",
        pre: &[("y.txt", "old y"), ("keep.txt", "untouched")],
        prelude: ("two_outputs", json!({"a": "x/a.txt", "b": "y.txt"})),
        call: None,
    })
    .await;
}

/// An undo of an in-out deletion (the file renamed back).
#[tokio::test(flavor = "multi_thread")]
async fn crash_points_an_undo_of_a_deletion() {
    run_undo_scenario(UndoScenario {
        name: "an undo of a deletion",
        pre: &[("docs/a.txt", "alpha\n"), ("keep.txt", "untouched")],
        prelude: ("edit_inout", json!({"path": "docs/a.txt", "action": "rm"})),
        call: None,
    })
    .await;
}

/// The failpoint log of a reference run: daemon `d` started, session `s` created, then
/// each of `calls` (a tool and its arguments) made and succeeding, the daemon stopped.
async fn reference_points(mut d: Daemon, calls: &[(&str, Value)]) -> String {
    let log = d.dir.path().join("points.log");
    d.env = vec![("AIRLOCK_FAILPOINT_LOG".into(), log.display().to_string())];
    d.start();
    let c = d.client().await;
    session(&c, "s").await;
    for (tool, args) in calls {
        let r = call(&c, tool, args.clone()).await;
        assert!(!is_error(&r), "{tool}: {r}");
    }
    drop(c);
    d.stop();
    std::fs::read_to_string(&log).expect("failpoint log")
}

/// Daemon `d` with an EIO injected at each failpoint of `points` (`N` or `N,M,...`).
fn failing_at(mut d: Daemon, points: &str) -> Daemon {
    d.env = vec![
        ("AIRLOCK_FAILPOINT_ERROR_AT".into(), points.into()),
        ("AIRLOCK_FAILPOINT_ERRNO".into(), "EIO".into()),
    ];
    d
}

/// The index of the `nth` (0-based) point named `name` in a failpoint log's `text`.
fn nth_point(text: &str, name: &str, nth: usize) -> u64 {
    text.lines()
        .filter_map(|l| l.split_once(' '))
        .filter(|(_, n)| *n == name)
        .nth(nth)
        .unwrap_or_else(|| panic!("no {name} #{nth} in the failpoint log:\n{text}"))
        .0
        .parse()
        .expect("point index")
}

/// `session_create` and `session_destroy` with a disk error at their durable point (the
/// sessions dir's fsync after their rename): the client is told STATE_ERROR, and the
/// session is as it was, in the daemon that answered and at its next start.
#[tokio::test(flavor = "multi_thread")]
async fn a_disk_error_at_a_session_create_or_destroy_leaves_the_session_as_it_was() {
    session_change_with_a_disk_error(false).await;
}

/// The same with the daemon as an unprivileged user (nobody).
#[tokio::test(flavor = "multi_thread")]
async fn a_disk_error_at_a_session_create_or_destroy_leaves_the_session_as_it_was_unprivileged() {
    require_root_for("a daemon run as nobody");
    session_change_with_a_disk_error(true).await;
}

/// The kinds of the audit events after `allow` and `start` of the last call of `tool`.
fn last_word(d: &Daemon, tool: &str) -> Vec<String> {
    let events = audit_events(d);
    let job = events
        .iter()
        .rev()
        .find(|e| e["tool"] == tool)
        .map(|e| e["job"].clone())
        .unwrap_or_else(|| panic!("no {tool} call in the audit log"));
    events
        .iter()
        .filter(|e| e["job"] == job)
        .map(|e| e["kind"].as_str().unwrap_or("").to_string())
        .filter(|k| k != "allow" && k != "start")
        .collect()
}

/// A new daemon dir, owned by nobody and the daemon run as nobody if `unprivileged`.
fn daemon_as(unprivileged: bool) -> Daemon {
    let mut d = Daemon::new();
    if unprivileged {
        chown_nobody(&d);
        d.user = Some((65534, 65534));
    }
    d
}

async fn session_change_with_a_disk_error(unprivileged: bool) {
    // Where the points are: one reference run, create then destroy.
    let log = reference_points(
        daemon_as(unprivileged),
        &[("session_destroy", json!({"session": "s"}))],
    )
    .await;
    let (create_point, destroy_point) = (
        nth_point(&log, "session.fsync_dir", 0),
        nth_point(&log, "session.fsync_dir", 1),
    );

    // The create's fsync fails: no session, now or after a restart; the id is free.
    let mut d = failing_at(daemon_as(unprivileged), &create_point.to_string());
    d.start();
    let c = d.client().await;
    let r = call(&c, "session_create", json!({"id": "s"})).await;
    assert_eq!(code(&r), "STATE_ERROR", "{r}");
    let r = call(&c, "session_get", json!({"session": "s"})).await;
    assert_eq!(code(&r), "NO_SUCH_SESSION", "{r}");
    drop(c);
    d.stop();
    let names = tree_names(&d.state.join("sessions"));
    assert!(names.is_empty(), "a failed create left {names:?}");
    assert_eq!(
        last_word(&d, "session_create"),
        ["commit", "error", "rollback"]
    );
    d.env.clear();
    d.start();
    let c = d.client().await;
    let r = call(&c, "session_get", json!({"session": "s"})).await;
    assert_eq!(code(&r), "NO_SUCH_SESSION", "{r}");
    session(&c, "s").await;
    drop(c);
    d.stop();

    // The destroy's fsync fails: the session stays live with its state, then and after a
    // restart, and no tombstone is left.
    let mut d = failing_at(daemon_as(unprivileged), &destroy_point.to_string());
    d.start();
    let c = d.client().await;
    let r = call(&c, "session_create", json!({"id": "s", "state": {"k": 1}})).await;
    assert!(!is_error(&r), "{r}");
    let r = call(&c, "session_destroy", json!({"session": "s"})).await;
    assert_eq!(code(&r), "STATE_ERROR", "{r}");
    assert_eq!(
        last_word(&d, "session_destroy"),
        ["commit", "error", "rollback"]
    );
    let r = call(&c, "session_get", json!({"session": "s"})).await;
    assert_eq!(r["structuredContent"]["state"], json!({"k": 1}), "{r}");
    drop(c);
    d.stop();
    d.env.clear();
    d.start();
    let c = d.client().await;
    let r = call(&c, "session_get", json!({"session": "s"})).await;
    assert_eq!(r["structuredContent"]["state"], json!({"k": 1}), "{r}");
    let r = call(&c, "session_destroy", json!({"session": "s"})).await;
    assert!(!is_error(&r), "{r}");
    drop(c);
    d.stop();
    assert_eq!(
        tree_names(&d.state.join("sessions")),
        vec!["s.json".to_string()]
    );
    d.assert_audit_verifies(&format!(
        "a session create and destroy with a disk error (unprivileged: {unprivileged})"
    ));
}

/// A committed call whose job record cannot be marked committed (a disk error) is
/// answered as committed, and its session is blocked until the next start: a later commit
/// of it would make the session no longer name the job, and the next start would settle
/// the record as rolled back. Another session serves on; after a restart the record says
/// committed and the session serves again.
#[tokio::test(flavor = "multi_thread")]
async fn a_committed_call_whose_record_cannot_be_marked_blocks_its_session_until_restart() {
    let write = |text: &str| json!({"session": "s", "text": text, "out": "a.txt"});
    let log = reference_points(Daemon::new(), &[("write_text", write("one"))]).await;
    let mark = nth_point(&log, "jobs.mark_committed", 0);

    let mut d = failing_at(Daemon::new(), &mark.to_string());
    d.start();
    let c = d.client().await;
    session(&c, "s").await;
    let r = call(&c, "write_text", write("one")).await;
    assert!(!is_error(&r), "committed, and answered so: {r}");
    let job = r["structuredContent"]["job"].as_str().unwrap().to_string();
    assert_eq!(d.read("a.txt").as_deref(), Some("one"));
    let r = call(&c, "write_text", write("two")).await;
    assert_eq!(code(&r), "STATE_ERROR", "{r}");
    assert_eq!(d.read("a.txt").as_deref(), Some("one"));
    session(&c, "t").await;
    let r = call(
        &c,
        "write_text",
        json!({"session": "t", "text": "t", "out": "t.txt"}),
    )
    .await;
    assert!(!is_error(&r), "another session serves on: {r}");
    drop(c);
    d.stop();
    d.env.clear();
    d.start();
    let c = d.client().await;
    let g = call(&c, "job_get", json!({"job": job})).await;
    assert_eq!(g["structuredContent"]["state"], "committed", "{g}");
    let r = call(&c, "write_text", write("two")).await;
    assert!(!is_error(&r), "{r}");
    assert_eq!(d.read("a.txt").as_deref(), Some("two"));
    drop(c);
    d.stop();
    d.assert_audit_verifies("a record that could not be marked committed");
}

/// A call that fails after its `commit` event was made durable (here the fsync of
/// `sessions/` after its exchange fails, and the previous version is put back) records its
/// `rollback` durably too: after a power loss, the log's last word on the job is still the
/// rollback, never the commit.
#[tokio::test(flavor = "multi_thread")]
async fn a_rollback_after_a_recorded_commit_is_durable_in_the_audit_log() {
    let write = json!({"session": "s", "text": "one", "out": "a.txt"});
    let log = reference_points(Daemon::new(), &[("write_text", write.clone())]).await;
    // The second exchange-and-fsync of the run: the call's commit (the first is the
    // session's create).
    let at = nth_point(&log, "session.fsync_dir", 1);

    let mut d = failing_at(Daemon::new(), &at.to_string());
    let log = d.dir.path().join("points.log");
    d.env
        .push(("AIRLOCK_FAILPOINT_LOG".into(), log.display().to_string()));
    d.start();
    let c = d.client().await;
    session(&c, "s").await;
    let r = call(&c, "write_text", write).await;
    assert_eq!(code(&r), "PUBLISH_FAILED", "{r}");
    assert_eq!(d.read("a.txt"), None, "rolled back");
    assert_eq!(last_word(&d, "write_text"), ["commit", "error", "rollback"]);
    drop(c);
    d.stop();
    // Made durable after the error: an audit write with its fsync follows the failed
    // point (the commit's own came before it).
    let text = std::fs::read_to_string(&log).unwrap();
    let after: Vec<&str> = text
        .lines()
        .filter_map(|l| l.split_once(' '))
        .filter(|(n, _)| n.parse::<u64>().is_ok_and(|n| n > at))
        .map(|(_, name)| name)
        .collect();
    assert!(
        after.contains(&"audit.durable_write"),
        "no durable audit write after the failure: {after:?}"
    );
    d.assert_audit_verifies("a rollback after a recorded commit");
}

/// A committed call whose journal can be neither blanked nor rewritten as `committed`
/// afterwards (two disk errors) is answered as committed and blocks its session until the
/// next start: a later commit of the session first would make the next start's recovery
/// read the job's journal as uncommitted and roll it back. After a restart the output and
/// the session are the call's, and the session serves again.
#[tokio::test(flavor = "multi_thread")]
async fn a_commit_whose_journal_cannot_be_settled_blocks_its_session_until_restart() {
    let write = |text: &str| json!({"session": "s", "text": text, "out": "a.txt"});
    let log = reference_points(Daemon::new(), &[("write_text", write("one"))]).await;
    // The blank after the commit fails, and so does the `committed` journal written in its
    // place (the next point then).
    let blank = nth_point(&log, "publish.journal_blank", 0);

    let mut d = failing_at(Daemon::new(), &format!("{blank},{}", blank + 1));
    d.start();
    let c = d.client().await;
    session(&c, "s").await;
    let r = call(&c, "write_text", write("one")).await;
    assert!(!is_error(&r), "committed, and answered so: {r}");
    assert_eq!(d.read("a.txt").as_deref(), Some("one"));
    let r = call(&c, "write_text", write("two")).await;
    assert_eq!(code(&r), "STATE_ERROR", "{r}");
    assert_eq!(d.read("a.txt").as_deref(), Some("one"));
    drop(c);
    d.stop();
    d.env.clear();
    d.start();
    let c = d.client().await;
    assert_eq!(version(&c, "s").await, 1);
    assert_eq!(d.read("a.txt").as_deref(), Some("one"));
    let r = call(&c, "write_text", write("two")).await;
    assert!(!is_error(&r), "{r}");
    assert_eq!(d.read("a.txt").as_deref(), Some("two"));
    drop(c);
    d.stop();
    d.assert_audit_verifies("a commit whose journal could not be settled");
}
