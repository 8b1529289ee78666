//! Retrying safely: idempotency keys (`_meta["airlock/idempotencyKey"]`) and `job_get`, over
//! the real socket. A keyed write call runs once; a retry gets its recorded outcome (the
//! same result for a commit, the same error for a definite failure) and runs nothing; a
//! duplicate while it runs waits for it; a cancelled call leaves no outcome. Records survive
//! restarts and crashes (settled by the session file), expire after `idempotency_ttl`, are
//! bounded per principal, and are scoped to the caller: another principal neither replays nor
//! reads them.

use std::path::Path;
use std::time::Duration;

use serde_json::{json, Value};

use crate::authz::{as_nobody, daemon as shared_daemon, NOBODY};
use crate::harness::*;

/// A `tools/call` over a raw connection, with `key` in `_meta` when given; its response.
fn kcall(raw: &mut Raw, id: i64, tool: &str, a: Value, key: Option<Value>) -> Value {
    ksend(raw, id, tool, a, key);
    result(raw.response(id))
}

fn ksend(raw: &mut Raw, id: i64, tool: &str, a: Value, key: Option<Value>) {
    let mut params = json!({"name": tool, "arguments": a});
    if let Some(k) = key {
        params["_meta"] = json!({"airlock/idempotencyKey": k});
    }
    raw.send(&json!({"jsonrpc": "2.0", "id": id, "method": "tools/call", "params": params}));
}

fn result(m: Value) -> Value {
    m.get("result")
        .cloned()
        .unwrap_or_else(|| panic!("not a result: {m}"))
}

/// A raw, initialized connection to `d`.
fn raw(d: &Daemon) -> Raw {
    let mut r = d.raw();
    r.initialize();
    r
}

/// The session's counter, read from its state.
async fn counter(c: &Client, s: &str) -> u64 {
    session_state(c, s).await["counter"].as_u64().unwrap_or(0)
}

async fn session_state(c: &Client, s: &str) -> Value {
    let r = call(c, "session_get", json!({"session": s})).await;
    r["structuredContent"]["state"].clone()
}

/// The audit events of `tool` of `kind`.
async fn events(c: &Client, tool: &str, kind: &str) -> Vec<Value> {
    audit(c)
        .await
        .into_iter()
        .filter(|e| e["tool"] == tool && e["kind"] == kind)
        .collect()
}

/// The job records in the state dir.
fn record_files(state: &Path) -> usize {
    std::fs::read_dir(state.join("jobs"))
        .map(|d| d.count())
        .unwrap_or(0)
}

/// A commit with a key, its retry after it (same result, nothing run, `replay` naming the
/// first job), `job_get` by job and by key, then the same after a restart.
#[tokio::test(flavor = "multi_thread")]
async fn a_retry_after_the_commit_replays_it_and_runs_nothing() {
    require_program("/usr/bin/python3", "python3");
    let mut d = Daemon::new();
    d.start();
    let c = d.client().await;
    session(&c, "s").await;
    let mut r = raw(&d);
    let args = json!({"session": "s", "by": 1, "note": "n.txt"});
    let first = kcall(&mut r, 1, "counter", args.clone(), Some(json!("k-1")));
    assert!(!is_error(&first), "{first}");
    let job = first["structuredContent"]["job"]
        .as_str()
        .expect("a write result carries its job")
        .to_string();
    assert_eq!(first["structuredContent"]["version"], 1);
    let again = kcall(&mut r, 2, "counter", args.clone(), Some(json!("k-1")));
    assert_eq!(again, first, "the retry gets the same result");
    assert_eq!(counter(&c, "s").await, 1, "counter ran once");
    assert_eq!(version(&c, "s").await, 1);
    assert_eq!(d.read("n.txt").as_deref(), Some("counter=1\n"));
    assert_eq!(events(&c, "counter", "start").await.len(), 1, "one run");
    assert_eq!(events(&c, "counter", "commit").await.len(), 1, "one commit");
    let replays = events(&c, "counter", "replay").await;
    assert_eq!(replays.len(), 1);
    assert_eq!(replays[0]["detail"]["job"], job.as_str(), "{replays:?}");
    assert_ne!(
        replays[0]["job"],
        job.as_str(),
        "the retry is a call of its own"
    );
    let allows = events(&c, "counter", "allow").await;
    assert!(
        allows
            .iter()
            .all(|e| e["detail"]["idempotency_key"] == "k-1"),
        "{allows:?}"
    );

    // job_get, by job and by key: committed, versions, outputs with identity and SHA-256.
    let g = call(&c, "job_get", json!({"job": job})).await;
    assert!(!is_error(&g), "{g}");
    let v = &g["structuredContent"];
    assert_eq!(v["state"], "committed", "{v}");
    assert_eq!(v["tool"], "counter");
    assert_eq!(v["session"], "s");
    assert_eq!(v["versionBefore"], 0);
    assert_eq!(v["versionAfter"], 1);
    assert_eq!(v["undoable"], true, "the latest commit is undoable: {v}");
    assert_eq!(v["idempotencyKey"], "k-1");
    let out = &v["outputs"][0];
    assert!(out["path"].as_str().unwrap().ends_with("n.txt"), "{out}");
    assert!(out["ino"].as_u64().is_some(), "{out}");
    assert_eq!(out["sha256"].as_str().map(str::len), Some(64), "{out}");
    let commit = &events(&c, "counter", "commit").await[0];
    assert_eq!(out["sha256"], commit["detail"]["outputs"][0]["sha256"]);
    let by_key = call(
        &c,
        "job_get",
        json!({"session": "s", "idempotencyKey": "k-1"}),
    )
    .await;
    assert_eq!(by_key["structuredContent"], g["structuredContent"]);

    // An unkeyed write has a job too.
    let plain = call(&c, "counter", json!({"session": "s"})).await;
    let plain_job = plain["structuredContent"]["job"]
        .as_str()
        .unwrap()
        .to_string();
    let g2 = call(&c, "job_get", json!({"job": plain_job})).await;
    assert_eq!(g2["structuredContent"]["state"], "committed", "{g2}");
    assert_eq!(g2["structuredContent"]["versionAfter"], 2);

    // After a restart: the same replay, the same record.
    drop((c, r));
    d.stop();
    d.start();
    let c = d.client().await;
    let mut r = raw(&d);
    let after = kcall(&mut r, 3, "counter", args, Some(json!("k-1")));
    assert_eq!(after, first, "replayed after a restart");
    assert_eq!(counter(&c, "s").await, 2, "nothing ran");
    let g3 = call(&c, "job_get", json!({"job": job})).await;
    // The same record; only whether it can be undone moved on: a later commit came since.
    let mut was = g["structuredContent"].clone();
    was["undoable"] = false.into();
    was["undoReason"] = "it is no longer its session's latest commit".into();
    assert_eq!(g3["structuredContent"], was);
    assert_eq!(
        call(&c, "job_get", json!({"job": plain_job})).await["structuredContent"]["state"],
        "committed"
    );
    d.assert_audit_verifies("after replays");
}

/// A duplicate sent while the first call is stopped just before its commit point waits,
/// then gets the first call's result: one commit, one replay.
#[tokio::test(flavor = "multi_thread")]
async fn a_duplicate_while_the_first_runs_waits_for_its_outcome() {
    require_program("/usr/bin/python3", "python3");
    let mut d = Daemon::new();
    let mark = d.pause_at_failpoint("jobs.write", 1);
    d.start();
    let c = d.client().await;
    session(&c, "s").await;
    let args = json!({"session": "s", "by": 5});
    let mut r1 = raw(&d);
    ksend(&mut r1, 1, "counter", args.clone(), Some(json!("dup")));
    wait_until("the first call to stop before its commit point", || {
        mark.exists()
    })
    .await;
    let g = call(
        &c,
        "job_get",
        json!({"session": "s", "idempotencyKey": "dup"}),
    )
    .await;
    assert_eq!(g["structuredContent"]["state"], "publishing", "{g}");
    let mut r2 = raw(&d);
    ksend(&mut r2, 1, "counter", args.clone(), Some(json!("dup")));
    // The duplicate is authorized (its `allow` is in the audit) and now waits.
    let deadline = std::time::Instant::now() + Duration::from_secs(10);
    while events(&c, "counter", "allow").await.len() < 2 {
        assert!(std::time::Instant::now() < deadline, "no second allow");
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    assert!(
        r2.recv_within(Duration::from_millis(200)).is_none(),
        "the duplicate must wait for the first"
    );
    std::fs::remove_file(&mark).unwrap();
    let first = result(r1.response(1));
    let second = result(r2.response(1));
    assert!(!is_error(&first), "{first}");
    assert_eq!(second, first);
    assert_eq!(counter(&c, "s").await, 5, "ran once");
    assert_eq!(events(&c, "counter", "commit").await.len(), 1);
    assert_eq!(events(&c, "counter", "start").await.len(), 1);
    let replays = events(&c, "counter", "replay").await;
    assert_eq!(replays.len(), 1);
    assert_eq!(
        replays[0]["detail"]["job"],
        first["structuredContent"]["job"]
    );
}

/// The same key with other arguments, or for another tool, is IDEMPOTENCY_MISMATCH and runs
/// nothing; a bad key or a key on a read tool is INVALID_ARGUMENT naming the key.
#[tokio::test(flavor = "multi_thread")]
async fn the_same_key_with_other_arguments_is_a_mismatch_and_runs_nothing() {
    require_program("/usr/bin/python3", "python3");
    let mut d = Daemon::new();
    d.start();
    let c = d.client().await;
    session(&c, "s").await;
    let mut r = raw(&d);
    let ok = kcall(
        &mut r,
        1,
        "counter",
        json!({"session": "s", "by": 1}),
        Some(json!("m")),
    );
    assert!(!is_error(&ok), "{ok}");
    let job = ok["structuredContent"]["job"].as_str().unwrap().to_string();
    let other = kcall(
        &mut r,
        2,
        "counter",
        json!({"session": "s", "by": 2}),
        Some(json!("m")),
    );
    assert_eq!(code(&other), "IDEMPOTENCY_MISMATCH", "{other}");
    assert!(text(&other).contains(&job), "names the job: {other}");
    let tool = kcall(
        &mut r,
        3,
        "write_text",
        json!({"session": "s", "text": "x", "out": "x.txt"}),
        Some(json!("m")),
    );
    assert_eq!(code(&tool), "IDEMPOTENCY_MISMATCH", "{tool}");
    assert!(d.read("x.txt").is_none());
    assert_eq!(counter(&c, "s").await, 1);
    assert_eq!(version(&c, "s").await, 1);

    for (bad, says) in [
        (json!(""), "empty"),
        (json!("x".repeat(129)), "129 bytes"),
        (json!("a\u{7}b"), "printable ASCII"),
        (json!(42), "not a number"),
    ] {
        let e = kcall(
            &mut r,
            4,
            "counter",
            json!({"session": "s"}),
            Some(bad.clone()),
        );
        assert_eq!(code(&e), "INVALID_ARGUMENT", "{bad}: {e}");
        let t = text(&e);
        assert!(t.contains("airlock/idempotencyKey"), "{t}");
        assert!(t.contains(says) || says == "not a number", "{bad}: {t}");
    }
    let read = kcall(
        &mut r,
        5,
        "session_get",
        json!({"session": "s"}),
        Some(json!("r")),
    );
    assert_eq!(code(&read), "INVALID_ARGUMENT", "{read}");
    assert_eq!(counter(&c, "s").await, 1, "nothing ran");
    // The daemon keeps serving.
    assert!(!is_error(&kcall(
        &mut r,
        6,
        "counter",
        json!({"session": "s"}),
        None
    )));
    assert_eq!(counter(&c, "s").await, 2);
}

/// A definite failure (the tool failed) is replayed with the same error; a cancelled call
/// leaves no outcome, so its retry runs afresh and commits.
#[tokio::test(flavor = "multi_thread")]
async fn a_definite_failure_is_replayed_and_a_cancelled_call_is_not() {
    let mut d = Daemon::new();
    d.start();
    let c = d.client().await;
    session(&c, "s").await;
    let mut r = raw(&d);
    let a = json!({"session": "s", "out": "f.txt"});
    let failed = kcall(&mut r, 1, "fail_tool", a.clone(), Some(json!("f")));
    assert_eq!(code(&failed), "TOOL_FAILED", "{failed}");
    let again = kcall(&mut r, 2, "fail_tool", a, Some(json!("f")));
    assert_eq!(again, failed, "the same error");
    assert_eq!(events(&c, "fail_tool", "start").await.len(), 1, "ran once");
    assert_eq!(events(&c, "fail_tool", "replay").await.len(), 1);
    let g = call(
        &c,
        "job_get",
        json!({"session": "s", "idempotencyKey": "f"}),
    )
    .await;
    assert_eq!(g["structuredContent"]["state"], "failed", "{g}");
    assert_eq!(
        g["structuredContent"]["error"]["code"], "TOOL_FAILED",
        "{g}"
    );

    // Cancelled while its worker runs: no outcome.
    let a = json!({"session": "s", "seconds": 30, "out": "w.txt"});
    ksend(&mut r, 3, "slow_write", a.clone(), Some(json!("c")));
    wait_for_event(&c, "slow_write", "start").await;
    r.send(
        &json!({"jsonrpc": "2.0", "method": "notifications/cancelled",
        "params": {"requestId": 3, "reason": "test"}}),
    );
    wait_for_event(&c, "slow_write", "rollback").await;
    let g = call(
        &c,
        "job_get",
        json!({"session": "s", "idempotencyKey": "c"}),
    )
    .await;
    assert_eq!(g["structuredContent"]["state"], "cancelled", "{g}");
    let a = json!({"session": "s", "seconds": 0, "out": "w.txt"});
    // Other arguments are no mismatch: the cancelled call holds no outcome.
    let ran = kcall(&mut r, 4, "slow_write", a, Some(json!("c")));
    assert!(!is_error(&ran), "the retry runs afresh: {ran}");
    assert_eq!(d.read("w.txt").as_deref(), Some("done\n"));
    assert_eq!(events(&c, "slow_write", "start").await.len(), 2);
    assert!(events(&c, "slow_write", "replay").await.is_empty());
}

/// Records expire after `idempotency_ttl` (a retry then runs afresh), and past
/// `idempotency_keys` per principal the oldest go first.
#[tokio::test(flavor = "multi_thread")]
async fn records_expire_after_the_ttl_and_the_oldest_go_past_the_bound() {
    require_program("/usr/bin/python3", "python3");
    let mut d = Daemon::new();
    set_daemon(
        &d,
        &[("idempotency_ttl", "\"1s\""), ("idempotency_keys", "2")],
    );
    d.start();
    let c = d.client().await;
    session(&c, "s").await;
    let mut r = raw(&d);
    let a = json!({"session": "s"});
    let mut id = 0;
    let mut kc = |r: &mut Raw, key: &str| {
        id += 1;
        kcall(r, id, "counter", a.clone(), Some(json!(key)))
    };
    // Bound: k1, k2, k3: k1's record is gone, k3's replays.
    for k in ["k1", "k2", "k3"] {
        assert!(!is_error(&kc(&mut r, k)));
    }
    assert_eq!(counter(&c, "s").await, 3);
    assert!(
        record_files(&d.state) <= 2,
        "{} records",
        record_files(&d.state)
    );
    let g = call(
        &c,
        "job_get",
        json!({"session": "s", "idempotencyKey": "k1"}),
    )
    .await;
    assert_eq!(code(&g), "NO_SUCH_JOB", "{g}");
    kc(&mut r, "k3");
    assert_eq!(counter(&c, "s").await, 3, "k3 replayed");
    kc(&mut r, "k1");
    assert_eq!(counter(&c, "s").await, 4, "k1 ran afresh");

    // Expiry: once the record is past its ttl, job_get no longer knows it and a retry runs.
    let job = kc(&mut r, "t")["structuredContent"]["job"]
        .as_str()
        .unwrap()
        .to_string();
    assert_eq!(counter(&c, "s").await, 5);
    let deadline = std::time::Instant::now() + Duration::from_secs(10);
    loop {
        let g = call(&c, "job_get", json!({"job": job})).await;
        if code(&g) == "NO_SUCH_JOB" {
            break;
        }
        assert_eq!(g["structuredContent"]["state"], "committed", "{g}");
        assert!(std::time::Instant::now() < deadline, "never expired");
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    kc(&mut r, "t");
    assert_eq!(counter(&c, "s").await, 6, "an expired key runs afresh");
}

/// Keys and jobs are the caller's: another principal (even `admin`, in the same session)
/// runs afresh under the same key, finds no record by it, and `job_get` of another's job or
/// session is SESSION_FORBIDDEN and shows nothing of it.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn keys_and_jobs_belong_to_their_principal() {
    require_program("/usr/bin/python3", "python3");
    let mut d = shared_daemon(&format!(
        "[[grant]]\nuids = [{NOBODY}]\ncapabilities = [\"read\", \"write\"]\n"
    ));
    d.start();
    let root = d.client().await;
    session(&root, "rootsess").await;
    let nobody = as_nobody(&d).await;
    let c = &nobody.client;
    session(c, "ns").await;
    let mut keyed = rmcp::model::CallToolRequestParams::new("counter")
        .with_arguments(args(json!({"session": "ns", "by": 1})));
    let mut meta = rmcp::model::RequestMetaObject::default();
    meta.0
         .0
        .insert("airlock/idempotencyKey".into(), json!("shared"));
    keyed.meta = Some(meta);
    let mine = serde_json::to_value(c.call_tool(keyed.clone()).await.unwrap()).unwrap();
    assert!(!is_error(&mine), "{mine}");
    let nobody_job = mine["structuredContent"]["job"]
        .as_str()
        .unwrap()
        .to_string();
    assert_eq!(counter(&root, "ns").await, 1);

    // root (admin) in nobody's session with nobody's key: runs afresh, no replay.
    let mut r = raw(&d);
    let rooted = kcall(
        &mut r,
        1,
        "counter",
        json!({"session": "ns", "by": 1}),
        Some(json!("shared")),
    );
    assert!(!is_error(&rooted), "{rooted}");
    assert_ne!(rooted["structuredContent"]["job"], nobody_job.as_str());
    assert_eq!(counter(&root, "ns").await, 2, "ran afresh");
    assert!(events(&root, "counter", "replay").await.is_empty());
    // nobody's retry still replays its own.
    let again = serde_json::to_value(c.call_tool(keyed).await.unwrap()).unwrap();
    assert_eq!(again, mine);
    assert_eq!(counter(&root, "ns").await, 2);

    // root's own job and session, asked by nobody: SESSION_FORBIDDEN, nothing shown.
    let root_write = call(
        &root,
        "write_text",
        json!({"session": "rootsess", "text": "t", "out": "r.txt"}),
    )
    .await;
    let root_job = root_write["structuredContent"]["job"].as_str().unwrap();
    for a in [
        json!({"job": root_job}),
        json!({"session": "rootsess", "idempotencyKey": "shared"}),
    ] {
        let g = call(c, "job_get", a.clone()).await;
        assert_eq!(code(&g), "SESSION_FORBIDDEN", "{a}: {g}");
        let t = g.to_string();
        assert!(!t.contains("write_text") && !t.contains("r.txt"), "{t}");
    }
    // nobody reads its own job; root (admin) reads it too.
    let g = call(c, "job_get", json!({"job": nobody_job})).await;
    assert_eq!(g["structuredContent"]["state"], "committed", "{g}");
    let g = call(&root, "job_get", json!({"job": nobody_job})).await;
    assert_eq!(g["structuredContent"]["state"], "committed", "{g}");
    // root's lookup by nobody's key finds root's own call only.
    let g = call(
        &root,
        "job_get",
        json!({"session": "ns", "idempotencyKey": "shared"}),
    )
    .await;
    assert_eq!(
        g["structuredContent"]["job"],
        rooted["structuredContent"]["job"]
    );
}

/// A keyed call crashed just before and just after its commit point: after the restart
/// `job_get` reports what recovery did, and a retry runs afresh (rolled back) or replays
/// (committed); `counter` ends up incremented once either way.
#[tokio::test(flavor = "multi_thread")]
async fn a_crashed_keyed_call_is_settled_by_recovery_and_its_retry_runs_once() {
    require_program("/usr/bin/python3", "python3");
    // Where the points are: a reference run of the same sequence logs them (a daemon counts
    // its points from its start).
    let mut d = Daemon::new();
    let log = d.dir.path().join("points.log");
    d.env = vec![("AIRLOCK_FAILPOINT_LOG".into(), log.display().to_string())];
    d.start();
    let c = d.client().await;
    session(&c, "s").await;
    let mut r = raw(&d);
    assert!(!is_error(&kcall(
        &mut r,
        1,
        "counter",
        json!({"session": "s"}),
        Some(json!("x"))
    )));
    drop((c, r));
    d.stop();
    let points: Vec<(u64, String)> = std::fs::read_to_string(&log)
        .unwrap()
        .lines()
        .map(|l| {
            let (n, name) = l.split_once(' ').unwrap();
            (n.parse().unwrap(), name.to_string())
        })
        .collect();
    let record = points
        .iter()
        .find(|(_, n)| n == "jobs.write")
        .expect("the record is written")
        .0;
    let commit_point = points
        .iter()
        .find(|(i, n)| *i > record && n == "session.write")
        .expect("the session is written after the record")
        .0;
    let marked = points
        .iter()
        .find(|(_, n)| n == "jobs.mark_committed")
        .expect("the record is marked")
        .0;
    for (n, settled) in [
        (record, "none"),
        (commit_point, "rolled_back"),
        (marked, "committed"),
    ] {
        let mut d = Daemon::new();
        d.env = vec![("AIRLOCK_FAILPOINT_CRASH_AT".into(), n.to_string())];
        d.start();
        let c = d.client().await;
        session(&c, "s").await;
        let mut r = raw(&d);
        ksend(
            &mut r,
            1,
            "counter",
            json!({"session": "s"}),
            Some(json!("x")),
        );
        assert!(
            d.wait_exit(Duration::from_secs(10)).is_some(),
            "no crash at {n}"
        );
        drop((c, r));
        d.env.clear();
        d.start();
        let c = d.client().await;
        let g = call(
            &c,
            "job_get",
            json!({"session": "s", "idempotencyKey": "x"}),
        )
        .await;
        let before = counter(&c, "s").await;
        match settled {
            // Crashed before its record: recovery rolled the job back; its record says so.
            "none" => {
                assert_eq!(before, 0);
                assert_eq!(code(&g), "NO_SUCH_JOB", "{g}");
                // By its id (from the audit): what recovery did.
                let log = std::fs::read_to_string(d.state.join("audit.jsonl")).unwrap();
                let crashed = log
                    .lines()
                    .map(|l| serde_json::from_str::<Value>(l).unwrap())
                    .find(|e| e["tool"] == "counter" && e["kind"] == "allow")
                    .expect("the crashed call's allow")["job"]
                    .clone();
                let g = call(&c, "job_get", json!({"job": crashed})).await;
                assert_eq!(g["structuredContent"]["state"], "rolled_back", "{g}");
                assert_eq!(g["structuredContent"]["recovered"], true, "{g}");
            }
            s => {
                assert_eq!(g["structuredContent"]["state"], s, "crash at {n}: {g}");
                assert_eq!(g["structuredContent"]["recovered"], true, "{g}");
                assert_eq!(before, u64::from(s == "committed"), "crash at {n}");
            }
        }
        let mut r = raw(&d);
        let retry = kcall(
            &mut r,
            2,
            "counter",
            json!({"session": "s"}),
            Some(json!("x")),
        );
        assert!(!is_error(&retry), "crash at {n}: {retry}");
        assert_eq!(
            counter(&c, "s").await,
            1,
            "crash at {n}: exactly one increment"
        );
        let replays = events(&c, "counter", "replay").await.len();
        assert_eq!(replays, usize::from(settled == "committed"), "crash at {n}");
        drop((c, r));
        d.stop();
        d.assert_audit_verifies(&format!("crash at {n}"));
    }
}

/// `airlock call ARGS... --socket S`: its exit status, stdout and stderr.
fn cli(d: &Daemon, args: &[&str]) -> (Option<i32>, String, String) {
    let out = std::process::Command::new(BIN)
        .args(args)
        .arg("--socket")
        .arg(&d.socket)
        .output()
        .expect("run airlock");
    (
        out.status.code(),
        String::from_utf8_lossy(&out.stdout).into_owned(),
        String::from_utf8_lossy(&out.stderr).into_owned(),
    )
}

/// `airlock call --idempotency-key` runs once and replays; `airlock job get` by id and by
/// session and key prints the record.
#[tokio::test(flavor = "multi_thread")]
async fn the_cli_sends_a_key_and_reads_a_job() {
    require_program("/usr/bin/python3", "python3");
    let mut d = Daemon::new();
    d.start();
    let c = d.client().await;
    session(&c, "s").await;
    let argv = [
        "call",
        "counter",
        "--session",
        "s",
        "--idempotency-key",
        "cli-1",
    ];
    let (code1, out1, err1) = cli(&d, &argv);
    assert_eq!(code1, Some(0), "{err1}");
    let (code2, out2, err2) = cli(&d, &argv);
    assert_eq!(code2, Some(0), "{err2}");
    assert_eq!(out1, out2, "the same result");
    assert_eq!(counter(&c, "s").await, 1, "ran once");
    let first: Value = serde_json::from_str(&out1).unwrap();
    let job = first["structuredContent"]["job"].as_str().unwrap();
    let (code, out, err) = cli(&d, &["job", "get", job]);
    assert_eq!(code, Some(0), "{err}");
    let got: Value = serde_json::from_str(&out).unwrap();
    assert_eq!(got["structuredContent"]["state"], "committed", "{got}");
    let (code, out, err) = cli(&d, &["job", "get", "--session", "s", "--key", "cli-1"]);
    assert_eq!(code, Some(0), "{err}");
    let by_key: Value = serde_json::from_str(&out).unwrap();
    assert_eq!(by_key["structuredContent"]["job"], job);
    let (code, _, err) = cli(&d, &["job", "get", "no-such-job"]);
    assert_eq!(code, Some(1), "a tool error: {err}");
}

/// `airlock call --retry N`: the daemon dies right after the commit point, before the
/// reply; the client reconnects to the restarted daemon and resends with the same
/// (generated) key: the recorded result is replayed, `counter` ran once.
#[tokio::test(flavor = "multi_thread")]
async fn the_cli_retry_resends_after_a_lost_connection_and_the_call_commits_once() {
    require_program("/usr/bin/python3", "python3");
    // The daemon's point just after the commit point, from a reference run of the same
    // sequence (session_create, then one keyed counter call).
    let mut d = Daemon::new();
    let log = d.dir.path().join("points.log");
    d.env = vec![("AIRLOCK_FAILPOINT_LOG".into(), log.display().to_string())];
    d.start();
    let c = d.client().await;
    session(&c, "s").await;
    let (code, _, err) = cli(
        &d,
        &[
            "call",
            "counter",
            "--session",
            "s",
            "--idempotency-key",
            "k",
        ],
    );
    assert_eq!(code, Some(0), "{err}");
    drop(c);
    d.stop();
    let after_commit = std::fs::read_to_string(&log)
        .unwrap()
        .lines()
        .find(|l| l.ends_with(" jobs.mark_committed"))
        .expect("the record is marked committed")
        .split(' ')
        .next()
        .unwrap()
        .to_string();

    let mut d = Daemon::new();
    d.env = vec![("AIRLOCK_FAILPOINT_CRASH_AT".into(), after_commit)];
    d.start();
    let c = d.client().await;
    session(&c, "s").await;
    drop(c);
    let child = std::process::Command::new(BIN)
        .args([
            "call",
            "counter",
            "--session",
            "s",
            "--retry",
            "50",
            "--socket",
        ])
        .arg(&d.socket)
        .stdout(std::process::Stdio::piped())
        .stderr(std::process::Stdio::piped())
        .spawn()
        .expect("spawn airlock call");
    assert!(
        d.wait_exit(Duration::from_secs(10)).is_some(),
        "the daemon did not crash after the commit point"
    );
    d.env.clear();
    d.start();
    let out = child.wait_with_output().unwrap();
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(0), "{stderr}");
    assert!(
        stderr.contains("resending with idempotency key airlock-call-"),
        "{stderr}"
    );
    let r: Value = serde_json::from_slice(&out.stdout).unwrap();
    assert_eq!(r["structuredContent"]["version"], 1, "{r}");
    let c = d.client().await;
    assert_eq!(counter(&c, "s").await, 1, "committed once");
    let replays = events(&c, "counter", "replay").await;
    assert_eq!(replays.len(), 1, "the resend was replayed");
    assert_eq!(replays[0]["detail"]["job"], r["structuredContent"]["job"]);
}

/// Through an official SDK (the pinned ones of tests/interop/, installed by
/// tests/interop/install into target/interop/): the script sends a keyed `counter` call;
/// once the daemon holds it just before its commit point, the test kills the script's
/// connection (its `airlock connect` bridge); the script reconnects and resends with the same
/// key. The call committed once, and the resend got its result.
async fn sdk_retry(program: &str, script: &Path) {
    assert!(
        Path::new(program).exists(),
        "{program} is missing: run tests/interop/install (it installs the pinned SDKs into target/interop/)"
    );
    require_program("/usr/bin/python3", "python3");
    let mut d = Daemon::new();
    let mark = d.pause_at_failpoint("jobs.write", 1);
    d.start();
    let c = d.client().await;
    session(&c, "sdk").await;
    let child = std::process::Command::new(program)
        .arg(script)
        .current_dir(script.parent().unwrap())
        .env("AIRLOCK_BIN", reachable_bin())
        .env("AIRLOCK_SOCKET", &d.socket)
        .env("IDEMPOTENCY_KEY", "sdk-retry-1")
        .env("SESSION", "sdk")
        .stdout(std::process::Stdio::piped())
        .stderr(std::process::Stdio::piped())
        .spawn()
        .unwrap_or_else(|e| panic!("{program} {}: {e}", script.display()));
    wait_until("the call to reach its commit point", || mark.exists()).await;
    // The request is written and the daemon runs it: the connection dies now.
    let needle = format!("connect --socket {}", d.socket.display());
    let bridges = processes_with(&needle);
    assert_eq!(bridges.len(), 1, "one bridge: {bridges:?}");
    // SAFETY: kill(2) takes no pointer; the pid is the bridge this test found running.
    assert_eq!(unsafe { libc::kill(bridges[0], libc::SIGKILL) }, 0);
    wait_until("the bridge to be gone", || {
        !processes_with(&needle).contains(&bridges[0])
    })
    .await;
    std::fs::remove_file(&mark).unwrap();
    let out = child.wait_with_output().unwrap();
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(out.status.success(), "{}: {stderr}", script.display());
    let line = String::from_utf8_lossy(&out.stdout);
    let got: Value = serde_json::from_str(line.trim().lines().last().unwrap_or(""))
        .unwrap_or_else(|e| panic!("{line}: {e}\n{stderr}"));
    assert!(
        got["tries"].as_u64().unwrap() >= 2,
        "the connection was lost once: {got} {stderr}"
    );
    assert_eq!(got["is_error"], false, "{got}");
    assert_eq!(got["structured"]["version"], 1, "{got}");
    assert_eq!(counter(&c, "sdk").await, 1, "exactly one commit");
    assert_eq!(events(&c, "counter", "commit").await.len(), 1);
    assert_eq!(events(&c, "counter", "start").await.len(), 1);
    let replays = events(&c, "counter", "replay").await;
    assert_eq!(replays.len(), 1, "the resend got the recorded result");
    assert_eq!(replays[0]["detail"]["job"], got["structured"]["job"]);
}

#[tokio::test(flavor = "multi_thread")]
async fn the_python_sdk_resends_with_its_key_after_a_lost_connection_and_commits_once() {
    let repo = repo();
    let venv = repo.join("target/interop/venv/bin/python");
    sdk_retry(
        venv.to_str().unwrap(),
        &repo.join("tests/interop/retry_client.py"),
    )
    .await;
}

#[tokio::test(flavor = "multi_thread")]
async fn the_typescript_sdk_resends_with_its_key_after_a_lost_connection_and_commits_once() {
    require_program("node", "nodejs");
    let repo = repo();
    let node_dir = repo.join("target/interop/node");
    assert!(
        node_dir
            .join("node_modules/@modelcontextprotocol/sdk")
            .exists(),
        "the TypeScript SDK is missing: run tests/interop/install"
    );
    // Next to the SDK's node_modules, where its imports resolve.
    let script = node_dir.join("retry_client.mjs");
    std::fs::copy(repo.join("tests/interop/retry_client.mjs"), &script).unwrap();
    let node = which("node");
    sdk_retry(&node, &script).await;
}

fn which(program: &str) -> String {
    std::env::var_os("PATH")
        .into_iter()
        .flat_map(|p| std::env::split_paths(&p).collect::<Vec<_>>())
        .map(|d| d.join(program))
        .find(|p| p.exists())
        .map(|p| p.display().to_string())
        .unwrap_or_else(|| panic!("{program} not on PATH"))
}
