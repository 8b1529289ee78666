//! The soak's machinery: many mixed calls (external reads, counter writes, built-ins)
//! across many sessions from several connections, with random cancellations, timeouts and
//! client disconnects, and the checks that afterwards nothing was lost or leaked. The
//! integration test `soak::soak_short` runs it short; `bench/run` runs 10,000 calls and
//! reports the throughput and latencies. The `/proc` readers here serve both.

#![allow(dead_code)]

use std::collections::{BTreeMap, BTreeSet};
use std::path::Path;
use std::sync::Mutex;
use std::time::{Duration, Instant};

use serde_json::{json, Value};

use crate::harness::{processes_with, Daemon};

/// The marker every soak worker carries in its command line (its `$0`).
const MARKER: &str = "airlock-soak-counter";

/// A json-protocol write tool in one `sh` (no further exec unless it sleeps): adds one to the
/// session's `counter`, writes the new value to `out`, sleeps `sleep` seconds first (past
/// its 1 s timeout for the timeout calls).
const COUNTER_TOOL: &str = r#"
name = "soak_counter"
description = "Add one to the session's counter and write it to a file (soak test)"
capability = "write"
protocol = "json"
timeout = "1s"
command = ["/bin/sh", "-c", '''
read -r req || true
[ "$2" = 0 ] || sleep "$2"
c=${req##*\"counter\":}
c=${c%%[!0-9]*}
c=$((c + 1))
echo "$c" > "$1"
printf '{"content":[{"type":"text","text":"counter %s"}],"state":{"counter":%s}}' "$c" "$c"
''', "airlock-soak-counter", "{out}", "{sleep}"]

[params.out]
type = "string"
path = "output"

[params.sleep]
type = "number"
"#;

/// A daemon with the soak tool and the shipped settings (the checks read the durable audit
/// log, not the bounded ring).
pub fn daemon() -> Daemon {
    let d = Daemon::new();
    d.add_tool("soak_counter", COUNTER_TOOL);
    d
}

#[derive(Debug, Clone)]
pub struct Config {
    pub calls: usize,
    pub sessions: usize,
    pub connections: usize,
    pub seed: u64,
}

/// What one call was, for the latency table.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord)]
pub enum Kind {
    Write,
    ExternalRead,
    Builtin,
    Timeout,
}

#[derive(Debug, Default)]
pub struct Report {
    pub elapsed: Duration,
    /// Calls sent (including cancelled and disconnected ones).
    pub sent: usize,
    pub cancels: usize,
    pub disconnects: usize,
    /// Latency of every call answered (not cancelled, not cut off), by kind.
    pub latencies: BTreeMap<Kind, Vec<Duration>>,
    /// Replies to cancelled ids that still came (the cancel was too late).
    pub late_replies: usize,
    pub idle_rss_kib: u64,
    pub after_rss_kib: u64,
    pub peak_rss_kib: u64,
    pub idle_fds: usize,
    pub after_fds: usize,
    /// Everything the checks found wrong; empty when the soak holds.
    pub problems: Vec<String>,
}

/// xorshift64*: reproducible from the seed printed with the report.
pub struct Rng(u64);

impl Rng {
    pub fn new(seed: u64) -> Rng {
        Rng(seed.max(1))
    }
    pub fn next_u64(&mut self) -> u64 {
        self.0 ^= self.0 >> 12;
        self.0 ^= self.0 << 25;
        self.0 ^= self.0 >> 27;
        self.0.wrapping_mul(0x2545_F491_4F6C_DD1D)
    }
    pub fn below(&mut self, n: u64) -> u64 {
        self.next_u64() % n
    }
}

pub fn session_name(i: usize) -> String {
    format!("soak-{i:02}")
}

fn file_of(i: usize) -> String {
    format!("soak-{i:02}.txt")
}

/// `VmRSS` of `pid` in KiB.
pub fn rss_kib(pid: u32) -> u64 {
    std::fs::read_to_string(format!("/proc/{pid}/status"))
        .unwrap_or_default()
        .lines()
        .find_map(|l| l.strip_prefix("VmRSS:"))
        .and_then(|v| v.split_whitespace().next()?.parse().ok())
        .unwrap_or(0)
}

/// Open fds of `pid`.
pub fn fd_count(pid: u32) -> usize {
    std::fs::read_dir(format!("/proc/{pid}/fd")).map_or(0, |d| d.count())
}

/// Children of `pid`, over all its threads (workers are forked by a spawner thread).
pub fn children(pid: u32) -> Vec<i32> {
    let mut out = Vec::new();
    if let Ok(tasks) = std::fs::read_dir(format!("/proc/{pid}/task")) {
        for t in tasks.flatten() {
            let p = t.path().join("children");
            if let Ok(s) = std::fs::read_to_string(p) {
                out.extend(s.split_whitespace().filter_map(|c| c.parse::<i32>().ok()));
            }
        }
    }
    out
}

/// Whether `pid` runs in spawner mode (`argv[1]` is `__airlock-spawner`).
pub fn is_spawner(pid: i32) -> bool {
    std::fs::read(format!("/proc/{pid}/cmdline"))
        .is_ok_and(|c| c.split(|&b| b == 0).nth(1) == Some(&b"__airlock-spawner"[..]))
}

/// Creates the sessions (state `{"counter": 0}`) and their files.
pub fn prepare(d: &Daemon, sessions: usize) {
    let mut raw = d.raw();
    raw.initialize();
    for i in 0..sessions {
        d.write(&file_of(i), "0\n");
        raw.call(
            1,
            "session_create",
            json!({"id": session_name(i), "state": {"counter": 0}}),
        );
        let r = raw.response(1);
        assert!(r["result"]["isError"] != json!(true), "session_create: {r}");
    }
}

/// One connection's share of the calls; returns its part of the report.
fn connection(d: &Daemon, cfg: &Config, conn: usize, calls: usize, report: &Mutex<Report>) {
    let mut rng = Rng::new(cfg.seed ^ (conn as u64 + 1).wrapping_mul(0x9E37_79B9_7F4A_7C15));
    let mut raw = d.raw();
    raw.initialize();
    let mut id: i64 = 1;
    let mut cancelled: BTreeSet<i64> = BTreeSet::new();
    let mut lat: BTreeMap<Kind, Vec<Duration>> = BTreeMap::new();
    let (mut cancels, mut disconnects, mut late) = (0, 0, 0);
    for _ in 0..calls {
        id += 1;
        let s = rng.below(cfg.sessions as u64) as usize;
        let roll = rng.below(1000);
        let (kind, tool, args) = match roll {
            0..=399 => (
                Kind::Write,
                "soak_counter",
                json!({"session": session_name(s), "out": file_of(s), "sleep": 0}),
            ),
            400..=404 => (
                Kind::Timeout,
                "soak_counter",
                json!({"session": session_name(s), "out": file_of(s), "sleep": 3}),
            ),
            405..=699 => (Kind::ExternalRead, "cat", json!({"path": file_of(s)})),
            700..=899 => (
                Kind::Builtin,
                "session_get",
                json!({"session": session_name(s)}),
            ),
            _ => (Kind::Builtin, "session_list", json!({})),
        };
        let t0 = Instant::now();
        raw.call(id, tool, args);
        let fate = rng.below(100);
        if kind == Kind::Write && fate < 4 {
            // Cancel at a random instant of the call (before, during or after the worker).
            std::thread::sleep(Duration::from_micros(rng.below(20_000)));
            raw.send(
                &json!({"jsonrpc": "2.0", "method": "notifications/cancelled",
                "params": {"requestId": id, "reason": "soak"}}),
            );
            cancelled.insert(id);
            cancels += 1;
            continue;
        }
        if kind != Kind::Builtin && fate == 99 {
            // The client goes away with the call in flight.
            std::thread::sleep(Duration::from_micros(rng.below(20_000)));
            drop(raw);
            raw = d.raw();
            raw.initialize();
            cancelled.clear();
            disconnects += 1;
            continue;
        }
        loop {
            let m = raw.recv();
            let Some(got) = m["id"].as_i64() else {
                continue;
            };
            if got == id {
                lat.entry(kind).or_default().push(t0.elapsed());
                break;
            }
            if cancelled.remove(&got) {
                late += 1;
            }
        }
    }
    let mut r = report.lock().unwrap_or_else(|p| p.into_inner());
    r.sent += calls;
    r.cancels += cancels;
    r.disconnects += disconnects;
    r.late_replies += late;
    for (k, v) in lat {
        r.latencies.entry(k).or_default().extend(v);
    }
}

/// Every call's audit events, by job id, in order of `seq`.
fn calls_in(events: &[Value]) -> BTreeMap<String, Vec<&Value>> {
    let mut by: BTreeMap<String, Vec<&Value>> = BTreeMap::new();
    for e in events {
        if let Some(c) = e["job"].as_str() {
            by.entry(c.to_string()).or_default().push(e);
        }
    }
    for v in by.values_mut() {
        v.sort_by_key(|e| e["seq"].as_u64());
    }
    by
}

/// Whether one call's audit events form a complete lifecycle; `Err` says what is wrong.
/// The one place that knows the lifecycle (README, "The audit log"): `allow` first; a write
/// (`soak_counter`, `session_create`, `session_destroy`) ends with its `commit` (a too-late `cancel` may follow it) or its
/// `rollback`, or, if it never started, with its `error` or queued `cancel`; a read ends
/// with `done`, `error` or its `cancel` (and the kill's `worker_terminated`). Never a
/// `commit` and a `rollback`, never two commits, a commit only after `start`, and a worker
/// killed for a timeout or an in-flight cancel is confirmed gone (`worker_terminated`).
pub fn lifecycle_complete(events: &[&Value]) -> Result<(), String> {
    let kinds: Vec<&str> = events.iter().filter_map(|e| e["kind"].as_str()).collect();
    let tool = events
        .first()
        .and_then(|e| e["tool"].as_str())
        .unwrap_or("");
    let pos = |k: &str| kinds.iter().position(|x| *x == k);
    let count = |k: &str| kinds.iter().filter(|x| **x == k).count();
    if kinds == ["deny"] {
        return Ok(());
    }
    if kinds.first() != Some(&"allow") {
        return Err(format!("does not start with allow: {kinds:?}"));
    }
    if count("commit") > 1 || (count("commit") == 1 && count("rollback") > 0) {
        return Err(format!("commit and rollback, or two commits: {kinds:?}"));
    }
    let killed = count("timeout") > 0
        || events
            .iter()
            .any(|e| e["kind"] == "cancel" && e["detail"]["phase"] == "running");
    if killed && count("worker_terminated") == 0 {
        return Err(format!("a killed worker not confirmed gone: {kinds:?}"));
    }
    let started = pos("start").is_some();
    let last = kinds.last().copied().unwrap_or("");
    // The soak's mutating tools: its counter and the built-ins that create or destroy.
    let mutating = matches!(tool, "soak_counter" | "session_create" | "session_destroy");
    let ended = match pos("commit") {
        Some(c) => {
            if pos("start").is_none_or(|s| s > c) {
                return Err(format!("commit before start: {kinds:?}"));
            }
            // Nothing after the commit but a cancel that came too late.
            kinds[c + 1..].iter().all(|k| *k == "cancel")
        }
        None if mutating => last == "rollback" || (!started && matches!(last, "error" | "cancel")),
        None => {
            matches!(last, "done" | "error" | "cancel")
                || (last == "worker_terminated" && count("cancel") > 0)
        }
    };
    if ended {
        Ok(())
    } else {
        Err(format!("no end: {kinds:?}"))
    }
}

/// Every event of the durable audit log (its rotated files first), and whether its hash
/// chain verifies (`airlock audit verify`).
fn audit_events(d: &Daemon) -> (Vec<Value>, Result<(), String>) {
    let path = d.state.join("audit.jsonl");
    let mut files = Vec::new();
    let mut n = 1;
    while Path::new(&format!("{}.{n}", path.display())).exists() {
        files.push(format!("{}.{n}", path.display()));
        n += 1;
    }
    files.reverse();
    files.push(path.display().to_string());
    let events = files
        .iter()
        .flat_map(|f| {
            std::fs::read_to_string(f)
                .unwrap_or_default()
                .lines()
                .filter_map(|l| serde_json::from_str::<Value>(l).ok())
                .collect::<Vec<_>>()
        })
        .collect();
    let verify = std::process::Command::new(crate::harness::BIN)
        .args(["audit", "verify", "--log"])
        .arg(&path)
        .output();
    let verified = match verify {
        Ok(o) if o.status.success() => Ok(()),
        Ok(o) => Err(String::from_utf8_lossy(&o.stderr).into_owned()),
        Err(e) => Err(format!("cannot run airlock audit verify: {e}")),
    };
    (events, verified)
}

fn session_state(d: &Daemon, s: usize) -> (u64, u64) {
    let mut raw = d.raw();
    raw.initialize();
    raw.call(1, "session_get", json!({"session": session_name(s)}));
    let r = raw.response(1);
    let sc = &r["result"]["structuredContent"];
    (
        sc["version"].as_u64().unwrap_or(u64::MAX),
        sc["state"]["counter"].as_u64().unwrap_or(u64::MAX),
    )
}

/// Runs the soak against a started daemon made by [`daemon`] and checks the outside world
/// afterwards. The report's `problems` lists every check that failed.
pub fn run(d: &Daemon, cfg: &Config) -> Report {
    let pid = d.pid();
    prepare(d, cfg.sessions);
    // A quiet moment before the idle figures: the resting daemon is what is measured.
    std::thread::sleep(Duration::from_millis(300));
    let idle_rss = rss_kib(pid);
    let idle_fds = fd_count(pid);

    let report = Mutex::new(Report::default());
    let peak = std::sync::atomic::AtomicU64::new(idle_rss);
    let running = std::sync::atomic::AtomicBool::new(true);
    let t0 = Instant::now();
    std::thread::scope(|scope| {
        scope.spawn(|| {
            while running.load(std::sync::atomic::Ordering::Relaxed) {
                peak.fetch_max(rss_kib(pid), std::sync::atomic::Ordering::Relaxed);
                std::thread::sleep(Duration::from_millis(50));
            }
        });
        let per = cfg.calls / cfg.connections;
        let handles: Vec<_> = (0..cfg.connections)
            .map(|c| {
                let n = if c == 0 {
                    cfg.calls - per * (cfg.connections - 1)
                } else {
                    per
                };
                let report = &report;
                scope.spawn(move || connection(d, cfg, c, n, report))
            })
            .collect();
        for h in handles {
            if h.join().is_err() {
                report
                    .lock()
                    .unwrap_or_else(|p| p.into_inner())
                    .problems
                    .push("a connection thread panicked (see above)".into());
            }
        }
        running.store(false, std::sync::atomic::Ordering::Relaxed);
    });
    let mut report = report.into_inner().unwrap_or_else(|p| p.into_inner());
    report.elapsed = t0.elapsed();
    report.idle_rss_kib = idle_rss;
    report.idle_fds = idle_fds;
    report.peak_rss_kib = peak.into_inner();

    // Quiescence: every call the audit knows has ended (cancelled and cut-off calls end on
    // their own, within their timeout and grace).
    let deadline = Instant::now() + Duration::from_secs(60);
    let (events, verified) = loop {
        let (events, verified) = audit_events(d);
        let open = calls_in(&events)
            .values()
            .filter(|ev| lifecycle_complete(ev).is_err())
            .count();
        if open == 0 || Instant::now() > deadline {
            break (events, verified);
        }
        std::thread::sleep(Duration::from_millis(200));
    };
    let by_call = calls_in(&events);
    let p = &mut report.problems;
    if let Err(e) = verified {
        p.push(format!("the audit log's chain does not verify: {e}"));
    }
    for (call, ev) in &by_call {
        if let Err(e) = lifecycle_complete(ev) {
            p.push(format!("call {call}: audit sequence incomplete: {e}"));
        }
    }
    // Every call sent reached the executor, but those a cancel or a disconnect may have
    // stopped in the framing first (the sessions' creation counted too).
    let allowed = by_call.len();
    let most = report.sent + cfg.sessions;
    let least = most - report.cancels - report.disconnects;
    if allowed < least || allowed > most {
        p.push(format!(
            "the audit knows {allowed} calls, {least}..={most} expected"
        ));
    }

    // No lost update: the counter the workers computed equals the commits of the session.
    let mut commits: BTreeMap<String, u64> = BTreeMap::new();
    for ev in by_call.values() {
        for e in ev {
            if e["kind"] == "commit" && e["tool"] == "soak_counter" {
                *commits
                    .entry(e["session"].as_str().unwrap_or("").to_string())
                    .or_default() += 1;
            }
        }
    }
    for s in 0..cfg.sessions {
        let n = commits.get(&session_name(s)).copied().unwrap_or(0);
        let (version, counter) = session_state(d, s);
        if counter != n || version != n {
            p.push(format!(
                "{}: counter {counter}, version {version}, {n} commits",
                session_name(s)
            ));
        }
        let file = d.read(&file_of(s)).unwrap_or_default();
        if file.trim() != counter.to_string() {
            p.push(format!(
                "{}: file says {:?}, counter {counter}",
                file_of(s),
                file.trim()
            ));
        }
    }

    if !d.job_dirs().is_empty() {
        p.push(format!("job dirs left: {:?}", d.job_dirs()));
    }
    let left = processes_with(MARKER);
    if !left.is_empty() {
        p.push(format!("worker processes left: {left:?}"));
    }
    // The spawner process is the daemon's one lasting child; nothing else may be left.
    let kids: Vec<i32> = children(pid)
        .into_iter()
        .filter(|&k| !is_spawner(k))
        .collect();
    if !kids.is_empty() {
        p.push(format!("the daemon still has children: {kids:?}"));
    }
    report.after_fds = fd_count(pid);
    report.after_rss_kib = rss_kib(pid);
    // Near idle: a few fds of slack (connections being torn down), and memory within what
    // the allocator may keep and the audit ring (bounded by its shipped 16 MiB).
    if report.after_fds > idle_fds + 4 {
        p.push(format!("fds: {} after, {idle_fds} idle", report.after_fds));
    }
    let ring_allowance = ((events.len() as u64 * 600) / 1024).min(16 * 1024);
    if report.after_rss_kib > idle_rss + ring_allowance + 64 * 1024 {
        p.push(format!(
            "RSS: {} KiB after, {idle_rss} KiB idle (allowance {ring_allowance} KiB for the audit ring)",
            report.after_rss_kib
        ));
    }
    report
}

pub fn percentile(sorted: &[Duration], q: f64) -> Duration {
    if sorted.is_empty() {
        return Duration::ZERO;
    }
    let i = ((sorted.len() as f64 - 1.0) * q).round() as usize;
    sorted[i.min(sorted.len() - 1)]
}
