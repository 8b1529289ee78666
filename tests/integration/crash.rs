//! Issue #4: crash-point tests. Every filesystem mutation of publication, commit and recovery
//! passes one failpoint (built with `--features failpoints`). For each scenario the harness
//! crashes the real daemon (abort, like kill -9) at point N = 0, 1, 2, ... until a run
//! completes; after each crash it restarts the daemon and checks that the workspace is the
//! before or the after snapshot, that the session agrees with it, and that no staging or
//! backup file remains. Then the same with a second crash during recovery, then injected
//! errors (EIO, ENOSPC, EXDEV, EINVAL) at every point, rolled back in process. After each,
//! the audit log's last word on the call's job (its last `commit` or `rollback`) must match
//! the workspace, and `airlock audit verify` must find the chain intact (#9).

use std::os::unix::fs::{MetadataExt, PermissionsExt};
use std::path::Path;
use std::process::Command;
use std::time::Duration;

use rmcp::model::CallToolRequestParams;
use serde_json::{json, Value};

use crate::harness::*;

/// Every entry under `root` with its type, mode and content: what "unchanged" means.
fn tree(root: &Path) -> Vec<String> {
    fn walk(root: &Path, dir: &Path, out: &mut Vec<String>) {
        let Ok(rd) = std::fs::read_dir(dir) else {
            return;
        };
        for e in rd.flatten() {
            let p = e.path();
            let rel = p.strip_prefix(root).unwrap_or(&p).display().to_string();
            let Ok(m) = std::fs::symlink_metadata(&p) else {
                continue;
            };
            let mode = m.permissions().mode() & 0o7777;
            if m.is_dir() {
                out.push(format!("{rel} dir {mode:o}"));
                walk(root, &p, out);
            } else if m.file_type().is_symlink() {
                out.push(format!("{rel} symlink {:?}", std::fs::read_link(&p).ok()));
            } else {
                let content = std::fs::read(&p).unwrap_or_default();
                out.push(format!(
                    "{rel} file {mode:o} nlink={} {:?}",
                    m.nlink(),
                    String::from_utf8_lossy(&content)
                ));
            }
        }
    }
    let mut out = Vec::new();
    walk(root, root, &mut out);
    out.sort();
    out
}

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
    let stream = tokio::net::UnixStream::connect(&d.socket)
        .await
        .map_err(|e| e.to_string())?;
    let c = rmcp::ServiceExt::serve((), stream)
        .await
        .map_err(|e| e.to_string())?;
    let mut a = s.args.as_object().cloned().unwrap();
    a.insert("session".into(), "s".into());
    let r = tokio::time::timeout(
        Duration::from_secs(30),
        c.call_tool(CallToolRequestParams::new(s.tool.to_string()).with_arguments(a)),
    )
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
    let leftovers: Vec<String> = tree(&d.state)
        .into_iter()
        // The entry's name (what follows it is its type, mode and content).
        .filter(|l| {
            l.split(' ')
                .next()
                .is_some_and(|name| name.contains(".tmp"))
        })
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
    let v = Command::new(BIN)
        .args(["audit", "verify", "--log"])
        .arg(d.state.join("audit.jsonl"))
        .output()
        .unwrap();
    assert!(
        v.status.success(),
        "{what}: audit verify: {}",
        String::from_utf8_lossy(&v.stderr)
    );
    outcome
}

async fn run_scenario(s: Scenario) {
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
        let r = try_call(&d, &s).await;
        let exited = d.wait_exit(Duration::from_secs(10));
        if exited.is_none() {
            // No crash: every point was passed, this run completed.
            let r = r.expect("call without crash");
            assert!(!is_error(&r), "{r}");
            d.kill9();
            break;
        }
        crashes += 1;
        let o = check_consistent(
            &mut d,
            &t,
            s.tool,
            &after,
            &format!("{} crash at {n}", s.name),
        )
        .await;
        outcomes[usize::from(o == "after")] += 1;

        // 2. The same crash again (recovery decides by inode identity, so the crashed dir
        // cannot be copied), then a second crash at every point of recovery.
        let mut m = 0u64;
        loop {
            let mut d2 = t.fresh();
            d2.env = vec![("AIRLOCK_FAILPOINT_CRASH_AT".into(), n.to_string())];
            d2.start();
            let _ = try_call(&d2, &s).await;
            assert!(
                d2.wait_exit(Duration::from_secs(10)).is_some(),
                "{}: crash at {n} did not repeat:\n{}",
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
            let r = try_call(&d, &s)
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
            check_consistent(
                &mut d,
                &t,
                s.tool,
                &after,
                &format!("{} {errno} at {n}", s.name),
            )
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
    run_scenario(Scenario {
        name: "json state + output",
        tool: "counter",
        args: json!({"by": 7, "note": "notes/n.txt"}),
        pre: &[],
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
    let (policies, workspace, state) = (d.policies.clone(), d.workspace.clone(), d.state.clone());
    let recover = || {
        Command::new(BIN)
            .args(["recover", "--policies"])
            .arg(&policies)
            .arg("--workspace")
            .arg(&workspace)
            .arg("--state-dir")
            .arg(&state)
            .output()
            .unwrap()
    };
    let out = recover();
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
    let out = recover();
    assert!(String::from_utf8_lossy(&out.stdout).contains("recovered 0 job(s)"));
    // Never while a daemon holds the workspace.
    d.env.clear();
    d.start();
    let out = recover();
    assert_eq!(out.status.code(), Some(2));
    assert!(String::from_utf8_lossy(&out.stderr).contains("holds this workspace"));
    let c = d.client().await;
    assert_eq!(session_of(&c).await, t.before_session);
}
