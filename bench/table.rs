//! The benchmark table, in one run: `bench/run` (full) or `bench/run --short`
//! (what CI runs, only to check that it works). It starts the release `airlock` on a
//! temporary socket, measures each row against its baseline side by side, and prints a
//! Markdown table ready for BENCHMARKS.md. Nothing here asserts a time: a missed target is
//! reported as "missed", never as a failure. The soak (`airlock_test_support::soak`, which
//! the integration test `soak::soak_short` runs short) is run last, at full size, and its
//! checks do fail the command. Like the tests, the bench drives the daemon only over its
//! socket and its command line, never through the crate's internals.

use std::ffi::CString;
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use serde_json::{json, Value};

use airlock_test_support::harness::{set_daemon, wait_for, Daemon, Raw};
use airlock_test_support::soak::{self, children, fd_count, percentile, rss_kib};

/// Sizes of one run: `--short` shrinks every count so the whole run takes a few seconds.
struct Plan {
    short: bool,
    iters: usize,
    cancel_iters: usize,
    big_iters: usize,
    big_bytes: u64,
    per_conn: usize,
    idle: Duration,
    sessions: usize,
    soak_calls: usize,
    /// Files in the archive and the in-out tree of the real-tools rows.
    tree_files: usize,
    /// Runs of each real-tools row.
    tool_iters: usize,
}

impl Plan {
    fn new(short: bool) -> Plan {
        if short {
            Plan {
                short,
                iters: 10,
                cancel_iters: 3,
                big_iters: 2,
                big_bytes: 1 << 20,
                per_conn: 2,
                idle: Duration::from_secs(2),
                sessions: 200,
                soak_calls: 200,
                tree_files: 100,
                tool_iters: 2,
            }
        } else {
            Plan {
                short,
                iters: 200,
                cancel_iters: 50,
                big_iters: 5,
                big_bytes: 1 << 30,
                per_conn: 25,
                idle: Duration::from_secs(10),
                sessions: 10_000,
                soak_calls: 10_000,
                tree_files: 10_000,
                tool_iters: 10,
            }
        }
    }
}

/// SIGTERM to SIGKILL for the bench tools' profile.
const GRACE: Duration = Duration::from_millis(200);

/// The bench's tools, on a copy of the default profile with a short grace and room for a
/// 1 GiB output.
fn tools(d: &Daemon) {
    let profiles = d.policies.join("profiles");
    let default = std::fs::read_to_string(profiles.join("default.toml")).expect("default.toml");
    let mut bench = String::new();
    for line in default.lines() {
        let key = line.split('=').next().unwrap_or("").trim();
        match key {
            "grace" => bench.push_str(&format!("grace = \"{}ms\"\n", GRACE.as_millis())),
            "file_size" => bench.push_str("file_size = \"4GiB\"\n"),
            "staging_size" => bench.push_str("staging_size = \"4GiB\"\n"),
            _ => {
                bench.push_str(line);
                bench.push('\n');
            }
        }
    }
    std::fs::write(profiles.join("bench.toml"), bench).expect("bench.toml");
    let tool = |name: &str, body: &str| {
        d.add_tool(
            name,
            &format!("name = \"{name}\"\ndescription = \"bench\"\nprofile = \"bench\"\n{body}"),
        )
    };
    tool(
        "bench_true",
        "capability = \"read\"\ntimeout = \"10s\"\ncommand = [\"/bin/true\"]\n",
    );
    tool(
        "bench_cat",
        "capability = \"read\"\ntimeout = \"10s\"\ncommand = [\"/bin/cat\", \"--\", \"{src}\"]\n\
         [params.src]\ntype = \"string\"\npath = \"input\"\n",
    );
    tool(
        "bench_copy",
        "capability = \"write\"\ntimeout = \"10s\"\ncommand = [\"/bin/cp\", \"--\", \"{src}\", \"{out}\"]\n\
         [params.src]\ntype = \"string\"\npath = \"input\"\n[params.out]\ntype = \"string\"\npath = \"output\"\n",
    );
    tool(
        "bench_fill",
        "capability = \"write\"\ntimeout = \"600s\"\n\
         command = [\"/bin/sh\", \"-c\", \"head -c \\\"$1\\\" /dev/zero > \\\"$2\\\"\", \"bench-fill\", \"{bytes}\", \"{out}\"]\n\
         [params.bytes]\ntype = \"integer\"\n[params.out]\ntype = \"string\"\npath = \"output\"\n",
    );
    tool(
        "bench_untar",
        "capability = \"write\"\ntimeout = \"600s\"\n\
         command = [\"/usr/bin/tar\", \"-x\", \"-f\", \"{archive}\", \"-C\", \"{out}\"]\n\
         [params.archive]\ntype = \"string\"\npath = \"input\"\n\
         [params.out]\ntype = \"string\"\npath = \"output\"\nkind = \"directory\"\n",
    );
    tool(
        "bench_touch_tree",
        "capability = \"write\"\ntimeout = \"600s\"\n\
         command = [\"/bin/sh\", \"-c\", \"printf x >> \\\"$1/d0/f0\\\"\", \"bench-touch\", \"{dir}\"]\n\
         [params.dir]\ntype = \"string\"\npath = \"inout\"\nkind = \"directory\"\n",
    );
    tool(
        "bench_sleep",
        "capability = \"read\"\ntimeout = \"60s\"\ncommand = [\"/bin/sleep\", \"{secs}\"]\n\
         [params.secs]\ntype = \"string\"\n",
    );
    tool(
        "bench_stubborn",
        "capability = \"read\"\ntimeout = \"60s\"\n\
         command = [\"/bin/sh\", \"-c\", \"trap '' TERM; sleep \\\"$1\\\"; :\", \"bench-stubborn\", \"{secs}\"]\n\
         [params.secs]\ntype = \"string\"\n",
    );
}

fn start(extra: impl FnOnce(&Daemon)) -> Daemon {
    start_in(&std::env::temp_dir(), extra)
}

/// [`start`] with the daemon's workspace and state dir on `base`'s filesystem.
fn start_in(base: &Path, extra: impl FnOnce(&Daemon)) -> Daemon {
    let mut d = Daemon::new_in(base);
    tools(&d);
    // One user (root) drives every figure: its sessions and call slots are bounded by the
    // machine-wide limits only (the many-sessions row makes 10,000 of them).
    set_daemon(
        &d,
        &[
            ("max_sessions_per_principal", "20000"),
            ("max_state_bytes_per_principal", "\"1GiB\""),
            ("max_calls_per_principal", "64"),
        ],
    );
    extra(&d);
    // The harness logs at debug for the tests; a benchmark measures the default.
    d.env.push(("AIRLOCK_LOG".into(), "warn".into()));
    d.start();
    d
}

/// A connection that has said `initialize`, with its own id counter.
struct Conn {
    raw: Raw,
    id: i64,
}

impl Conn {
    fn open(d: &Daemon) -> Conn {
        let mut raw = d.raw();
        raw.initialize();
        Conn { raw, id: 1 }
    }

    fn send(&mut self, tool: &str, args: Value) -> i64 {
        self.id += 1;
        self.raw.call(self.id, tool, args);
        self.id
    }

    /// One call, its reply checked to be a success.
    fn call(&mut self, tool: &str, args: Value) -> Value {
        let id = self.send(tool, args);
        let r = self.raw.response(id);
        assert!(
            r["result"]["isError"] != json!(true) && r["error"].is_null(),
            "{tool}: {r}"
        );
        r
    }
}

/// From the daemon's own audit: for the newest `n` commits of `tool`, the time from the
/// worker's end to the `commit` event (its `duration_ms` minus its `worker_ms`), in whole
/// ms: validation, fsync of the outputs, journal, renames and their fsyncs, and the durable
/// commit event itself (the session write follows it).
fn publish_times(c: &mut Conn, tool: &str, n: usize) -> Series {
    c.id += 1;
    let id = c.id;
    c.raw.send(
        &json!({"jsonrpc": "2.0", "id": id, "method": "resources/read",
        "params": {"uri": format!("airlock://audit/events?tool={tool}")}}),
    );
    let r = c.raw.response(id);
    let events: Vec<Value> = r["result"]["contents"][0]["text"]
        .as_str()
        .and_then(|t| serde_json::from_str(t).ok())
        .unwrap_or_default();
    let mut v: Vec<Duration> = events
        .iter()
        .rev()
        .filter(|e| e["kind"] == "commit")
        .filter_map(|e| {
            let d = &e["detail"];
            let after = d["duration_ms"]
                .as_u64()?
                .checked_sub(d["worker_ms"].as_u64()?)?;
            Some(Duration::from_millis(after))
        })
        .take(n)
        .collect();
    v.sort();
    Series(v)
}

/// The floor under the durable audit event each commit waits for: one audit-sized JSON line
/// appended and fdatasynced (what the audit log does for a `commit` line) to a file in the
/// daemon's state dir, on its filesystem. Measured with std alone: the daemon's own share
/// (its group commit across sessions) shows in the throughput rows, 1 session against 16.
fn durable_line_cost(state: &Path, n: usize) -> Series {
    use std::io::Write;
    let path = state.join("bench-durable-line.jsonl");
    let mut file = std::fs::OpenOptions::new()
        .create(true)
        .append(true)
        .open(&path)
        .expect("bench durable-line file");
    let line = format!(
        "{}\n",
        json!({"seq": 1, "kind": "commit", "call": "bench-audit", "tool": "bench_copy",
            "session": "bench", "detail": {"version": 1, "duration_ms": 1, "outputs": [
            {"path": "out-1k", "size": 1024, "dev": 1, "ino": 1, "sha256": "0".repeat(64)}]},
            "prev": "0".repeat(64)})
    );
    let s = Series::measure(n, || {
        timed(|| {
            file.write_all(line.as_bytes()).expect("append the line");
            file.sync_data().expect("fdatasync the line");
        })
    });
    let _ = std::fs::remove_file(&path);
    s
}

/// Medians and p99 of one measured series.
struct Series(Vec<Duration>);

impl Series {
    fn measure(n: usize, mut f: impl FnMut() -> Duration) -> Series {
        // One unmeasured round first: page cache, lazy binding, the daemon's first call.
        f();
        let mut v: Vec<Duration> = (0..n).map(|_| f()).collect();
        v.sort();
        Series(v)
    }
    fn sorted(mut v: Vec<Duration>) -> Series {
        v.sort();
        Series(v)
    }
    fn p50(&self) -> Duration {
        percentile(&self.0, 0.5)
    }
    fn p99(&self) -> Duration {
        percentile(&self.0, 0.99)
    }
}

fn timed(f: impl FnOnce()) -> Duration {
    let t = Instant::now();
    f();
    t.elapsed()
}

fn ms(d: Duration) -> String {
    format!("{:.3}", d.as_secs_f64() * 1e3)
}

/// The printed table: one row per measurement.
struct Table {
    rows: Vec<[String; 5]>,
    missed: Vec<String>,
}

impl Table {
    fn row(&mut self, what: &str, s: &Series, vs: &str, target: &str) {
        self.rows.push([
            what.to_string(),
            format!("{} / {}", ms(s.p50()), ms(s.p99())),
            s.0.len().to_string(),
            vs.to_string(),
            target.to_string(),
        ]);
    }
    fn text(&mut self, what: &str, value: String, vs: &str, target: &str) {
        self.rows.push([
            what.to_string(),
            value,
            String::new(),
            vs.to_string(),
            target.to_string(),
        ]);
    }
    /// "met" or "**missed**"; a miss is also listed under the table.
    fn verdict(&mut self, what: &str, met: bool) -> &'static str {
        if met {
            "met"
        } else {
            self.missed.push(what.to_string());
            "**missed**"
        }
    }
    fn print(&self) {
        println!("| measurement | p50 / p99 ms (or value) | n | baseline, ratio | target |");
        println!("|---|---|---|---|---|");
        for r in &self.rows {
            println!("| {} | {} | {} | {} | {} |", r[0], r[1], r[2], r[3], r[4]);
        }
        if self.missed.is_empty() {
            println!("\nEvery target met in this run.");
        } else {
            println!("\nTargets missed in this run: {}.", self.missed.join("; "));
        }
    }
}

fn ratio(a: &Series, b: &Series) -> f64 {
    a.p50().as_secs_f64() / b.p50().as_secs_f64().max(1e-9)
}

/// fork, execv, waitpid of `/bin/true`: the floor any sandboxed spawn is compared with.
fn bare_fork_exec() -> Duration {
    let path = CString::new("/bin/true").expect("cstring");
    let argv = [path.as_ptr(), std::ptr::null()];
    let t = Instant::now();
    // SAFETY: the child only calls execv and _exit, both async-signal-safe, on memory
    // prepared before the fork.
    let pid = unsafe { libc::fork() };
    if pid == 0 {
        // SAFETY: see above; argv is NULL-terminated.
        unsafe {
            libc::execv(path.as_ptr(), argv.as_ptr());
            libc::_exit(127);
        }
    }
    assert!(pid > 0, "fork failed");
    let mut status = 0;
    // SAFETY: waits for the child just forked.
    unsafe { libc::waitpid(pid, &mut status, 0) };
    t.elapsed()
}

/// The first argument that makes this binary the durable copy by hand instead of the bench.
const BY_HAND: &str = "--durable-copy-by-hand";

/// The cheapest durable equivalent of a write call a user could run by hand, as one small
/// process (this binary, re-executed with [`BY_HAND`] and run like `cp` in the direct row):
/// copy `src` to `tmp` (`copy_file_range`, as `cp` does), `fdatasync` the copy, `rename` it
/// to `out`, `fsync` the directory. It does nothing else: no parsing beyond its arguments,
/// no output.
///
/// With a fourth argument, a directory of the copier's own, the same copy also makes, syncs
/// and removes the files a durable write call makes besides its output ([`call_files`]):
/// what the daemon's file layout costs the filesystem, with none of the daemon's own work.
fn durable_copy_by_hand(args: &[String]) -> std::io::Result<()> {
    match args {
        [src, tmp, out] => durable_copy(Path::new(src), Path::new(tmp), Path::new(out)),
        [src, _, out, files] => call_files(Path::new(src), Path::new(out), Path::new(files)),
        _ => Err(std::io::Error::new(
            std::io::ErrorKind::InvalidInput,
            "usage: --durable-copy-by-hand SRC TMP OUT [CALL-FILES-DIR]",
        )),
    }
}

/// The durable copy of `src` to `out` laid out in `dir` as a write call lays out its files,
/// each made durable as the call makes it, one after another: a job dir holding `stage/0`
/// (the copy is made there), the journal `recovery.json` (written over the blank one of a
/// reused dir); the undo record `undo.json` rewritten in place in the session's blank slot of
/// two (made, with its dir, the first time only); the session file's new version written over
/// its spare in place and exchanged with it; a job record (kept, and not fsynced: the call is not
/// keyed). The job dir's tree is an idle one another copy set aside, taken by a rename, when
/// there is one. After the copy is renamed into place, the journal is blanked (`null` padded
/// with spaces to its length, written over it; fdatasync), the blank marker written over the other undo slot's record and the job dir
/// set aside, as the call's cleanup does. Once idle dirs and the spare exist, the job record
/// is the one inode made per copy besides the output.
fn call_files(src: &Path, out: &Path, dir: &Path) -> std::io::Result<()> {
    use std::fs;
    use std::io::Write;
    let sync_dir = |d: &Path| fs::File::open(d)?.sync_all();
    let write_synced = |path: &Path, bytes: &[u8]| -> std::io::Result<()> {
        let mut f = fs::File::create(path)?;
        f.write_all(bytes)?;
        f.sync_all()
    };
    let record = [b'x'; 400];
    let id = std::process::id().to_string();
    let (jobs, undo, sessions) = (dir.join("jobs"), dir.join("undo"), dir.join("sessions"));
    let job = dir.join(format!("job-{id}"));
    let slot = job.join("stage").join("0");
    // An idle job dir another copy set aside, renamed to this job's name; else a fresh tree.
    let taken = fs::read_dir(dir)?
        .flatten()
        .filter(|e| e.file_name().to_string_lossy().starts_with("idle-"))
        .any(|e| fs::rename(e.path(), &job).is_ok());
    if !taken {
        fs::create_dir(&job)?;
        fs::create_dir(job.join("stage"))?;
        fs::create_dir(&slot)?;
    }
    let staged = slot.join("out");
    let out_dir = out.parent().unwrap_or(Path::new("."));
    copy_synced(src, &staged)?;
    let journal = job.join("recovery.json");
    if taken && journal.exists() {
        // Written over the blank one the dir keeps, as the daemon does: no file made. The
        // dir's entry is durable since its first copy (below), as a reused job dir's is.
        let f = fs::OpenOptions::new().write(true).open(&journal)?;
        std::os::unix::fs::FileExt::write_all_at(&f, &record, 0)?;
        f.sync_all()?;
    } else {
        write_synced(&journal, &record)?;
        sync_dir(&job)?;
        // The new job dir's entry (the daemon's workspace root, here the output's dir).
        sync_dir(out_dir)?;
    }
    fs::rename(&staged, out)?;
    // The slot whose record is blank (the other one holds the last copy's).
    let blank = |slot: &str| {
        fs::read(undo.join(slot).join("undo.json")).map_or(true, |r| r.is_empty() || r == b"null")
    };
    let (slot_now, slot_other) = if blank("g0") {
        ("g0", "g1")
    } else {
        ("g1", "g0")
    };
    let generation = undo.join(slot_now);
    // A file written over in place and cut after, as the daemon writes its undo record and
    // its session file's spare: the file keeps its block.
    let write_over = |f: fs::File, bytes: &[u8]| -> std::io::Result<()> {
        std::os::unix::fs::FileExt::write_all_at(&f, bytes, 0)?;
        f.set_len(bytes.len() as u64)?;
        f.sync_all()
    };
    if generation.join("undo.json").exists() {
        let f = fs::OpenOptions::new()
            .write(true)
            .open(generation.join("undo.json"))?;
        write_over(f, &record)?;
    } else {
        fs::create_dir_all(&generation)?;
        write_synced(&generation.join("undo.json"), &record)?;
        sync_dir(&generation)?;
        sync_dir(&undo)?;
    }
    sync_dir(out_dir)?;
    sync_dir(&slot)?;
    // The session file: the new version written over the spare in place, then exchanged
    // with the session's file (the first copy makes both).
    let (spare, current) = (sessions.join(".s.json.tmp"), sessions.join("s.json"));
    match fs::OpenOptions::new().write(true).open(&spare) {
        Ok(f) => write_over(f, &record[..100])?,
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => write_synced(&spare, &record[..100])?,
        Err(e) => return Err(e),
    }
    fs::write(jobs.join(format!("{id}.json")), record)?;
    let exchange = rustix::fs::renameat_with(
        rustix::fs::CWD,
        &spare,
        rustix::fs::CWD,
        &current,
        rustix::fs::RenameFlags::EXCHANGE,
    );
    match exchange {
        Err(rustix::io::Errno::NOENT) => fs::rename(&spare, &current)?,
        r => r?,
    }
    sync_dir(&sessions)?;
    // The cleanup: the other undo slot blanked, the journal blanked, the job dir's tree.
    if let Ok(f) = fs::OpenOptions::new()
        .write(true)
        .open(undo.join(slot_other).join("undo.json"))
    {
        std::os::unix::fs::FileExt::write_all_at(&f, b"null", 0)?;
        f.set_len(4)?;
    }
    // The journal blanked in place, padded to its length (it keeps its size and its block),
    // and the blank made durable.
    let f = fs::OpenOptions::new().write(true).open(&journal)?;
    let mut blank = vec![b' '; f.metadata()?.len().max(4) as usize];
    blank[..4].copy_from_slice(b"null");
    std::os::unix::fs::FileExt::write_all_at(&f, &blank, 0)?;
    f.sync_data()?;
    // Set aside for a later copy, as the daemon keeps ended jobs' dirs.
    let nanos = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| d.as_nanos());
    fs::rename(&job, dir.join(format!("idle-{id}-{nanos}")))
}

/// The durable copy by hand's work: copy `src` to `tmp`, `fdatasync` it, `rename` it to
/// `out`, `fsync` the directory.
fn durable_copy(src: &Path, tmp: &Path, out: &Path) -> std::io::Result<()> {
    copy_synced(src, tmp)?;
    std::fs::rename(tmp, out)?;
    let dir = out.parent().unwrap_or(Path::new("."));
    std::fs::File::open(dir)?.sync_all()
}

/// `src` copied to a new file `to`, whose data is then made durable (`fdatasync`).
fn copy_synced(src: &Path, to: &Path) -> std::io::Result<()> {
    let mut from = std::fs::File::open(src)?;
    let mut to = std::fs::File::create(to)?;
    std::io::copy(&mut from, &mut to)?;
    to.sync_data()
}

/// `statfs`'s f_type of tmpfs.
const TMPFS_MAGIC: i64 = 0x0102_1994;

/// The filesystem type (`statfs` f_type) of `path`.
#[allow(clippy::unnecessary_cast)] // f_type is not an i64 on every architecture.
fn fs_type(path: &Path) -> Option<i64> {
    rustix::fs::statfs(path).ok().map(|st| st.f_type as i64)
}

fn dev_of(path: &Path) -> u64 {
    use std::os::unix::fs::MetadataExt;
    std::fs::metadata(path).expect("stat").dev()
}

fn fdatasync_path(path: &Path) {
    std::fs::File::open(path)
        .and_then(|f| f.sync_data())
        .expect("fdatasync");
}

fn run_direct(cmd: &mut Command) -> Duration {
    timed(|| {
        let st = cmd
            .stdin(Stdio::null())
            .stdout(Stdio::piped())
            .stderr(Stdio::null())
            .output()
            .expect("run directly");
        assert!(st.status.success(), "{cmd:?}: {:?}", st.status);
    })
}

/// The CPU time of the daemon's live threads (the first field of each
/// `/proc/PID/task/*/schedstat`, in ns): with no thread ending in between, the difference of
/// two readings is what the daemon itself ran (its workers, spawner and templates are other
/// processes and not counted).
fn daemon_cpu(pid: u32) -> Duration {
    let mut ns = 0u64;
    if let Ok(tasks) = std::fs::read_dir(format!("/proc/{pid}/task")) {
        for t in tasks.flatten() {
            ns += std::fs::read_to_string(t.path().join("schedstat"))
                .ok()
                .and_then(|s| s.split_whitespace().next()?.parse::<u64>().ok())
                .unwrap_or(0);
        }
    }
    Duration::from_nanos(ns)
}

/// `n` timed runs of `call` (a call to the daemon `pid`) after a warm-up, as
/// [`Series::measure`] makes them, and the daemon's CPU time per call over all of them, as a
/// note for the row.
fn measure_call(pid: u32, n: usize, mut call: impl FnMut()) -> (Series, String) {
    let before = daemon_cpu(pid);
    let series = Series::measure(n, || timed(&mut call));
    let per_call = daemon_cpu(pid).saturating_sub(before) / (n + 1) as u32;
    (series, format!("daemon CPU {} ms/call", ms(per_call)))
}

/// Per thread of the daemon: (times scheduled, context switches).
fn wakeups(pid: u32) -> std::collections::BTreeMap<String, (u64, u64)> {
    let mut out = std::collections::BTreeMap::new();
    if let Ok(tasks) = std::fs::read_dir(format!("/proc/{pid}/task")) {
        for t in tasks.flatten() {
            let p = t.path();
            let runs = std::fs::read_to_string(p.join("schedstat"))
                .ok()
                .and_then(|s| s.split_whitespace().nth(2)?.parse::<u64>().ok())
                .unwrap_or(0);
            let switches = std::fs::read_to_string(p.join("status"))
                .unwrap_or_default()
                .lines()
                .filter(|l| l.contains("ctxt_switches:"))
                .filter_map(|l| l.split_whitespace().nth(1)?.parse::<u64>().ok())
                .sum();
            out.insert(
                t.file_name().to_string_lossy().into_owned(),
                (runs, switches),
            );
        }
    }
    out
}

/// The daemon's default `handshake_timeout`: the longest timer a connection that never
/// says `initialize` arms.
const HANDSHAKE_TIMEOUT: Duration = Duration::from_secs(10);

/// Over `over`, with nothing running: (times scheduled, context switches) of the daemon's
/// threads, and how many threads ended meanwhile (a thread pool's idle timeout is a wake-up
/// too).
fn idle_wakeups(pid: u32, over: Duration) -> (u64, u64, usize) {
    // A quiet half second first, then the quiet `over` that is measured: idleness is the
    // thing measured here, not an ordering.
    std::thread::sleep(Duration::from_millis(500));
    let a = wakeups(pid);
    std::thread::sleep(over);
    let b = wakeups(pid);
    let (mut runs, mut switches) = (0, 0);
    for (tid, (r, s)) in &b {
        let (r0, s0) = a.get(tid).copied().unwrap_or((0, 0));
        runs += r.saturating_sub(r0);
        switches += s.saturating_sub(s0);
    }
    let ended = a.keys().filter(|t| !b.contains_key(*t)).count();
    (runs, switches, ended)
}

/// With `AIRLOCK_BENCH_STRACE=FILE`: `strace -c -f` attached to the daemon while `f` runs
/// (50 more calls after the measured ones: strace slows what it traces), its syscall
/// summary written to `FILE.<what>` (the profile of a missed target).
fn traced(pid: u32, what: &str, f: impl FnOnce()) {
    let Ok(file) = std::env::var("AIRLOCK_BENCH_STRACE") else {
        return;
    };
    let out = format!("{file}.{what}");
    let child = Command::new("strace")
        .args(["-c", "-f", "-o", &out, "-p", &pid.to_string()])
        .stderr(Stdio::null())
        .spawn();
    if child.is_ok() {
        // strace has attached once the daemon has a tracer.
        let tracer = || {
            std::fs::read_to_string(format!("/proc/{pid}/status"))
                .unwrap_or_default()
                .lines()
                .find_map(|l| l.strip_prefix("TracerPid:"))
                .is_some_and(|v| v.trim() != "0")
        };
        wait_for(
            "strace attached to the daemon",
            Duration::from_secs(60),
            tracer,
        );
    }
    f();
    if let Ok(mut c) = child {
        // SAFETY: SIGINT to the strace we started: it detaches and writes its summary.
        unsafe { libc::kill(c.id() as i32, libc::SIGINT) };
        let _ = c.wait();
        println!("strace -c -f of the daemon during {what}: {out}");
    }
}

/// The daemon's children that run `argv0` (workers are the daemon's children).
fn worker_running(daemon: u32, argv: &str) -> Option<i32> {
    children(daemon).into_iter().find(|c| {
        std::fs::read(format!("/proc/{c}/cmdline"))
            .map(|b| String::from_utf8_lossy(&b).replace('\0', " ").trim() == argv)
            .unwrap_or(false)
    })
}

/// From the cancel being sent to the worker's pid gone (reaped: kill(pid, 0) says ESRCH).
fn cancel_to_exit(
    d: &Daemon,
    c: &mut Conn,
    tool: &str,
    argv_prefix: &str,
    wants_child: bool,
    i: usize,
) -> Duration {
    let secs = format!("30.{i:04}");
    let id = c.send(tool, json!({"secs": secs}));
    let argv = format!("{argv_prefix} {secs}");
    let deadline = Instant::now() + Duration::from_secs(20);
    // For the shell that traps SIGTERM: only once it has forked `sleep` is the trap set.
    let ready = |p: i32| !wants_child || !children(p as u32).is_empty();
    let pid = loop {
        if let Some(p) = worker_running(d.pid(), &argv).filter(|p| ready(*p)) {
            break p;
        }
        assert!(Instant::now() < deadline, "no worker running {argv:?}");
        std::thread::sleep(Duration::from_micros(200));
    };
    let t = Instant::now();
    c.raw.send(
        &json!({"jsonrpc": "2.0", "method": "notifications/cancelled",
        "params": {"requestId": id, "reason": "bench"}}),
    );
    loop {
        // SAFETY: kill with signal 0 only checks for existence.
        if unsafe { libc::kill(pid, 0) } != 0 {
            break;
        }
        std::thread::sleep(Duration::from_micros(100));
    }
    let took = t.elapsed();
    // The id stays in flight until the call's silence has passed: ping until it is free.
    loop {
        c.raw
            .send(&json!({"jsonrpc": "2.0", "id": id, "method": "ping"}));
        let m = c.raw.response(id);
        if m["result"] == json!({}) {
            break;
        }
        std::thread::sleep(Duration::from_millis(2));
    }
    took
}

/// CPU time in clock ticks, from /proc: the daemon's threads (`utime + stime`), the children
/// it has reaped (`cutime + cstime`: the workers, which are its children), its live
/// children per pid (the spawner and the worker templates), and the machine's busy and total
/// time over all CPUs (`/proc/stat`).
struct CpuTicks {
    daemon: u64,
    reaped: u64,
    live: std::collections::BTreeMap<i32, u64>,
    machine_busy: u64,
    machine_total: u64,
}

/// Fields 14 to 17 of `/proc/PID/stat`: utime, stime, cutime, cstime.
fn stat_ticks(pid: i32) -> Option<[u64; 4]> {
    let s = std::fs::read_to_string(format!("/proc/{pid}/stat")).ok()?;
    // The command name, in parentheses, may hold spaces: count fields after its end.
    let rest = &s[s.rfind(')')? + 1..];
    let f: Vec<u64> = rest
        .split_whitespace()
        .skip(11)
        .take(4)
        .filter_map(|x| x.parse().ok())
        .collect();
    f.try_into().ok()
}

impl CpuTicks {
    fn read(pid: u32) -> CpuTicks {
        let [u, s, cu, cs] = stat_ticks(pid as i32).unwrap_or_default();
        let live = children(pid)
            .into_iter()
            .filter_map(|c| Some((c, stat_ticks(c).map(|[u, s, ..]| u + s)?)))
            .collect();
        // cpu user nice system idle iowait irq softirq steal: busy is all but idle and iowait.
        let stat = std::fs::read_to_string("/proc/stat").unwrap_or_default();
        let t: Vec<u64> = stat
            .lines()
            .next()
            .unwrap_or_default()
            .split_whitespace()
            .skip(1)
            .take(8)
            .filter_map(|x| x.parse().ok())
            .collect();
        let total: u64 = t.iter().sum();
        let idle = t.get(3).copied().unwrap_or(0) + t.get(4).copied().unwrap_or(0);
        CpuTicks {
            daemon: u + s,
            reaped: cu + cs,
            live,
            machine_busy: total.saturating_sub(idle),
            machine_total: total,
        }
    }
}

/// CPU use over one throughput run, in cores busy (CPU time over wall time).
struct CpuUse {
    daemon: f64,
    workers: f64,
    spawner_and_templates: f64,
    machine: f64,
    cores: usize,
}

impl CpuUse {
    fn between(a: &CpuTicks, b: &CpuTicks, wall: Duration) -> CpuUse {
        // SAFETY: sysconf has no memory effects.
        let hz = unsafe { libc::sysconf(libc::_SC_CLK_TCK) }.max(1) as f64;
        let cores = std::fs::read_to_string("/proc/stat")
            .unwrap_or_default()
            .lines()
            .filter(|l| l.starts_with("cpu") && l.as_bytes().get(3).is_some_and(u8::is_ascii_digit))
            .count()
            .max(1);
        let busy = |ticks: u64| ticks as f64 / hz / wall.as_secs_f64().max(1e-9);
        // A child alive at both ends counts its difference; one started during the run
        // (a replaced template), all of its time.
        let spawner_and_templates = b
            .live
            .iter()
            .map(|(pid, t)| t.saturating_sub(a.live.get(pid).copied().unwrap_or(0)))
            .sum();
        let total = b.machine_total.saturating_sub(a.machine_total).max(1);
        CpuUse {
            daemon: busy(b.daemon.saturating_sub(a.daemon)),
            workers: busy(b.reaped.saturating_sub(a.reaped)),
            spawner_and_templates: busy(spawner_and_templates),
            machine: b.machine_busy.saturating_sub(a.machine_busy) as f64 / total as f64
                * cores as f64,
            cores,
        }
    }

    fn describe(&self) -> String {
        let others =
            (self.machine - self.daemon - self.workers - self.spawner_and_templates).max(0.0);
        format!(
            "cores busy: daemon {:.2}, workers {:.2}, spawner and templates {:.2}, the rest (the bench's client, anything else) {:.2}; machine {:.2} of {}",
            self.daemon, self.workers, self.spawner_and_templates, others, self.machine, self.cores
        )
    }
}

/// Where the throughput curve stops rising: the first session count whose doubling adds
/// no more than 10%, or None if every step rises by more.
fn saturation(rates: &[(usize, f64, CpuUse)]) -> Option<usize> {
    rates.windows(2).position(|w| w[1].1 <= w[0].1 * 1.1)
}

/// Write calls of `bench_copy` from 16 connections, connection `i` on session `i % sessions`:
/// calls per second, and the CPU the daemon, its workers, its spawner and templates, and the
/// machine used meanwhile.
fn throughput(d: &Daemon, sessions: usize, per_conn: usize, peak_rss: &mut u64) -> (f64, CpuUse) {
    let prefix = format!("tp{sessions}");
    let mut setup = Conn::open(d);
    for s in 0..sessions {
        setup.call("session_create", json!({"id": format!("{prefix}-{s}")}));
    }
    let conns: Vec<Conn> = (0..16).map(|_| Conn::open(d)).collect();
    let done = std::sync::atomic::AtomicBool::new(false);
    let cpu_before = CpuTicks::read(d.pid());
    let t = Instant::now();
    std::thread::scope(|scope| {
        let sampler = scope.spawn(|| {
            let mut peak = 0;
            while !done.load(std::sync::atomic::Ordering::Relaxed) {
                peak = peak.max(rss_kib(d.pid()));
                std::thread::sleep(Duration::from_millis(20));
            }
            peak
        });
        let hs: Vec<_> = conns
            .into_iter()
            .enumerate()
            .map(|(i, mut c)| {
                let session = format!("{prefix}-{}", i % sessions);
                scope.spawn(move || {
                    for _ in 0..per_conn {
                        c.call(
                            "bench_copy",
                            json!({"session": session, "src": "in-1k", "out": format!("tp-{i}")}),
                        );
                    }
                })
            })
            .collect();
        for h in hs {
            h.join().expect("throughput connection");
        }
        done.store(true, std::sync::atomic::Ordering::Relaxed);
        *peak_rss = (*peak_rss).max(sampler.join().unwrap_or(0));
    });
    let wall = t.elapsed();
    let cpu = CpuUse::between(&cpu_before, &CpuTicks::read(d.pid()), wall);
    ((16 * per_conn) as f64 / wall.as_secs_f64(), cpu)
}

/// The rows of real tools: `edit_file` on a 1 MiB file against `sed -i` run directly, a
/// 10,000-file archive extracted as a directory output against `tar -x` run directly, and an
/// in-out directory of 10,000 files with one file changed against copying the tree (`cp -a`,
/// the copy the worker is given; on ext4 a byte copy, where xfs or btrfs would reflink).
fn real_tools(t: &mut Table, plan: &Plan, d: &Daemon, c: &mut Conn) {
    let n = plan.tool_iters;
    // edit_file: one replacement on a 1 MiB text file, alternating so every call changes it.
    let line = "the quick brown fox jumps over the lazy dog 0123456789\n";
    let mut text = line.repeat((1 << 20) / line.len());
    text.push_str("MARKER-A\n");
    d.write("edit-1m.txt", &text);
    let direct_path = d.dir.path().join("edit-1m-direct.txt");
    std::fs::write(&direct_path, &text).expect("direct copy");
    let mut flip = false;
    let direct = Series::measure(n, || {
        flip = !flip;
        let (a, b) = if flip { ("A", "B") } else { ("B", "A") };
        run_direct(
            Command::new("/usr/bin/sed")
                .arg("-i")
                .arg(format!("s/MARKER-{a}/MARKER-{b}/"))
                .arg("--")
                .arg(&direct_path),
        )
    });
    t.row(
        "direct run: `sed -i` one replacement in 1 MiB",
        &direct,
        "",
        "",
    );
    let mut flip = false;
    let edit = Series::measure(n, || {
        flip = !flip;
        let (a, b) = if flip { ("A", "B") } else { ("B", "A") };
        timed(|| {
            c.call(
                "edit_file",
                json!({"session": "bench", "path": "edit-1m.txt",
                    "edits": [{"oldText": format!("MARKER-{a}"), "newText": format!("MARKER-{b}")}]}),
            );
        })
    });
    t.row(
        "`edit_file` on a 1 MiB file (in-out copy, python3 edit and diff, published, committed)",
        &edit,
        &format!("{:.1}x `sed -i`", ratio(&edit, &direct)),
        "reported",
    );

    // A tree of `tree_files` small files in 100 directories, as a tar archive and in place.
    let files = plan.tree_files;
    let src = d.dir.path().join("tree-src");
    for i in 0..files {
        let dir = src.join(format!("d{}", i % 100));
        std::fs::create_dir_all(&dir).expect("tree dir");
        std::fs::write(dir.join(format!("f{i}")), format!("file {i}\n")).expect("tree file");
    }
    let archive = d.workspace.join("tree.tar");
    let ok = Command::new("/usr/bin/tar")
        .arg("-cf")
        .arg(&archive)
        .arg("-C")
        .arg(&src)
        .arg(".")
        .status()
        .expect("tar");
    assert!(ok.success(), "tar -c");
    let mut k = 0;
    let direct_x = Series::measure(n, || {
        k += 1;
        let out = d.dir.path().join(format!("untar-{k}"));
        std::fs::create_dir_all(&out).expect("untar dir");
        run_direct(
            Command::new("/usr/bin/tar")
                .arg("-x")
                .arg("-f")
                .arg(&archive)
                .arg("-C")
                .arg(&out),
        )
    });
    t.row(
        &format!("direct run: `tar -x` of {files} files"),
        &direct_x,
        "",
        "",
    );
    let mut k = 0;
    let untar = Series::measure(n, || {
        k += 1;
        timed(|| {
            c.call(
                "bench_untar",
                json!({"session": "bench", "archive": "tree.tar", "out": format!("x/{k}")}),
            );
        })
    });
    t.row(
        &format!("`tar -x` of {files} files as a directory output (tree checked, sealed, fsynced, one rename)"),
        &untar,
        &format!("{:.1}x direct", ratio(&untar, &direct_x)),
        "reported",
    );

    // The same tree in the workspace, edited in place: one file changed per call.
    let ok = Command::new("/bin/cp")
        .arg("-a")
        .arg(&src)
        .arg(d.workspace.join("tree"))
        .status()
        .expect("cp -a");
    assert!(ok.success(), "cp -a");
    let mut k = 0;
    let copy = Series::measure(n, || {
        k += 1;
        run_direct(
            Command::new("/bin/cp")
                .arg("-a")
                .arg(&src)
                .arg(d.dir.path().join(format!("copy-{k}"))),
        )
    });
    t.row(
        &format!("direct run: `cp -a` of the {files}-file tree"),
        &copy,
        "",
        "",
    );
    let inout = Series::measure(n, || {
        timed(|| {
            c.call(
                "bench_touch_tree",
                json!({"session": "bench", "dir": "tree"}),
            );
        })
    });
    t.row(
        &format!(
            "in-out directory of {files} files, one file changed (copied, checked, exchanged)"
        ),
        &inout,
        &format!("{:.1}x `cp -a`", ratio(&inout, &copy)),
        "reported",
    );
}

fn machine() {
    let cpu = std::fs::read_to_string("/proc/cpuinfo")
        .unwrap_or_default()
        .lines()
        .find_map(|l| l.strip_prefix("model name"))
        .map(|s| s.trim_start_matches([' ', '\t', ':']).to_string())
        .unwrap_or_default();
    let kernel = std::fs::read_to_string("/proc/sys/kernel/osrelease").unwrap_or_default();
    let load = std::fs::read_to_string("/proc/loadavg").unwrap_or_default();
    let cores = std::thread::available_parallelism().map_or(0, |n| n.get());
    println!(
        "machine: {cores} cores, {cpu}, Linux {}; load average at start: {}",
        kernel.trim(),
        load.split_whitespace()
            .take(3)
            .collect::<Vec<_>>()
            .join(" ")
    );
}

fn which(cmd: &str) -> Option<String> {
    std::env::var("PATH").ok()?.split(':').find_map(|dir| {
        let p = Path::new(dir).join(cmd);
        p.is_file().then(|| p.display().to_string())
    })
}

/// What every call running a command as a sandboxed worker pays at least, from medians of
/// this run: the external read call of /bin/true (the MCP round trip and the sandboxed
/// spawn), against bare fork/exec/wait of /bin/true.
#[derive(Clone, Copy)]
struct SpawnFloor {
    ext_true: Duration,
    bare: Duration,
}

impl SpawnFloor {
    /// The floor of a call running the command whose direct runs are `direct`: the call of
    /// /bin/true plus what the command adds to /bin/true run directly.
    fn running(&self, direct: &Series) -> Duration {
        self.ext_true + direct.p50().saturating_sub(self.bare)
    }
}

impl Table {
    /// A floor row: `floor` against the `baseline`'s median (named `baseline_name`), and
    /// how far the median of `call` (named `call_name`) is above it.
    fn floor(
        &mut self,
        what: &str,
        floor: Duration,
        baseline: &Series,
        baseline_name: &str,
        call: &Series,
        call_name: &str,
    ) {
        let r_floor = floor.as_secs_f64() / baseline.p50().as_secs_f64();
        let target = if r_floor > 1.5 {
            format!("reported: 1.5x {baseline_name} is below this floor")
        } else {
            "reported".to_string()
        };
        self.text(
            what,
            format!("{} ms", ms(floor)),
            &format!(
                "{r_floor:.1}x {baseline_name}; {call_name} is {:.1}x this floor",
                call.p50().as_secs_f64() / floor.as_secs_f64()
            ),
            &target,
        );
    }
}

/// The external read rows: `cat` of 1 KiB run directly and as an external read call, the
/// daemon's CPU per call, and the floor of such a call (`trace`: the call's syscalls traced
/// into the bench output as well).
fn read_rows(
    t: &mut Table,
    plan: &Plan,
    c: &mut Conn,
    src: &std::path::Path,
    pid: u32,
    trace: bool,
    floor: SpawnFloor,
) {
    let direct_cat = Series::measure(plan.iters, || {
        run_direct(Command::new("/bin/cat").arg("--").arg(src))
    });
    t.row("direct run: `cat` of 1 KiB", &direct_cat, "", "");
    let (read, read_cpu) = measure_call(pid, plan.iters, || {
        c.call("bench_cat", json!({"src": "in-1k"}));
    });
    if trace {
        traced(pid, "external-read", || {
            for _ in 0..50 {
                c.call("bench_cat", json!({"src": "in-1k"}));
            }
        });
    }
    let r = ratio(&read, &direct_cat);
    let v = t.verdict("external read call within 1.5x of direct", r <= 1.5);
    t.row(
        "external read call: `cat` of 1 KiB",
        &read,
        &format!("{r:.1}x direct; {read_cpu}"),
        &format!("<= 1.5x: {v}"),
    );
    // The floor of any external read call that runs `cat` as a sandboxed worker. No
    // argument checked, no output captured: a lower bound.
    t.floor(
        "floor of an external read call: external read call of /bin/true + (direct `cat` - bare) (medians above)",
        floor.running(&direct_cat),
        &direct_cat,
        "direct `cat`",
        &read,
        "the read call",
    );
}

/// The throughput rows: durable write calls/s over 1, 2, 4, 8 and 16 sessions on 16
/// connections, and where they saturate. Returns the daemon's peak RSS (KiB) under that load.
/// 16 copiers at once, copier `i` running `per_conn` durable copies by hand one after
/// another, each this binary re-executed with [`BY_HAND`] and `args(i)`: the copies per
/// second over all of them.
fn copiers_at_once(per_conn: usize, args: impl Fn(usize) -> Vec<PathBuf>) -> f64 {
    let me = std::env::current_exe().expect("the bench's own executable");
    let args: Vec<Vec<PathBuf>> = (0..16).map(args).collect();
    let t0 = Instant::now();
    std::thread::scope(|scope| {
        for args in &args {
            let me = &me;
            scope.spawn(move || {
                for _ in 0..per_conn {
                    let status = Command::new(me)
                        .arg(BY_HAND)
                        .args(args)
                        .status()
                        .expect("the durable copy by hand runs");
                    assert!(
                        status.success(),
                        "the durable copy by hand {args:?}: {status}"
                    );
                }
            });
        }
    });
    (16 * per_conn) as f64 / t0.elapsed().as_secs_f64()
}

fn throughput_rows(t: &mut Table, plan: &Plan, d: &Daemon) -> u64 {
    let mut peak_rss = 0;
    let mut rates = Vec::new();
    for sessions in [1, 2, 4, 8, 16] {
        let (rate, cpu) = throughput(d, sessions, plan.per_conn, &mut peak_rss);
        rates.push((sessions, rate, cpu));
    }
    for (s, r, cpu) in &rates {
        let target = if *s == 16 {
            let v = t.verdict("600 durable write calls/s with 16 sessions", *r >= 600.0);
            format!(">= 600/s: {v}")
        } else {
            String::new()
        };
        t.text(
            &format!("durable write calls/s, {s} session(s) on 16 connections"),
            format!("{r:.0}/s"),
            &format!("{} calls; {}", 16 * plan.per_conn, cpu.describe()),
            &target,
        );
    }
    // Rising with sessions until both cores are busy: where it stops rising, the machine's
    // cores are (nearly) all busy, or it is bound on something else (the disk, a lock).
    let (value, cpu, met) = match saturation(&rates) {
        Some(i) => {
            let ((s, r, cpu), (s2, r2, _)) = (&rates[i], &rates[i + 1]);
            (
                format!(
                    "at {s} session(s): {r:.0}/s, then {r2:.0}/s at {s2} ({:+.0}%)",
                    (r2 / r - 1.0) * 100.0
                ),
                cpu,
                cpu.machine >= 0.9 * cpu.cores as f64,
            )
        }
        None => {
            let (_, _, cpu) = &rates[rates.len() - 1];
            (
                "not by 16 sessions: each doubling of sessions adds more than 10%".to_string(),
                cpu,
                true,
            )
        }
    };
    let v = t.verdict(
        "durable write calls/s rising with sessions until both cores are busy",
        met,
    );
    t.text(
        "throughput saturates (stops rising by more than 10% per doubling of sessions)",
        value,
        &format!("there, {}", cpu.describe()),
        &format!("rises until the cores are busy (>= 90%): {v}"),
    );
    // The floor under the target on this machine: the durable copy by hand, 16 processes
    // at once (one per connection above), as many copies as the calls of one run.
    let src = d.workspace.join("in-1k");
    let dir = d.dir.path().join("by-hand-16");
    std::fs::create_dir_all(&dir).expect("by-hand-16 dir");
    let by_hand = copiers_at_once(plan.per_conn, |i| {
        vec![
            src.clone(),
            dir.join(format!("{i}.tmp")),
            dir.join(i.to_string()),
        ]
    });
    let (_, at16, _) = &rates[rates.len() - 1];
    t.text(
        "durable copies by hand/s, 16 processes at once (the floor under the throughput target)",
        format!("{by_hand:.0}/s"),
        &format!(
            "{} copies; the write calls at 16 sessions reach {:.0}%",
            16 * plan.per_conn,
            at16 / by_hand * 100.0
        ),
        "reported",
    );
    // The same 16 copiers, each copy also laid out in a write call's files: what today's
    // file layout costs this filesystem, with no daemon, no worker sandbox, no MCP.
    let laid_out_at = |i: usize| dir.join(format!("laid-out-{i}"));
    let laid_out = copiers_at_once(plan.per_conn, |i| {
        let files = dir.join(format!("call-files-{i}"));
        for sub in ["jobs", "undo", "sessions"] {
            std::fs::create_dir_all(files.join(sub)).expect("call files dir");
        }
        // No temp name: the copy is staged in the job dir's slot.
        vec![src.clone(), PathBuf::from("-"), laid_out_at(i), files]
    });
    for i in 0..16 {
        assert_eq!(
            std::fs::read(laid_out_at(i)).expect("the copy laid out in a write call's files"),
            std::fs::read(&src).expect("in-1k"),
            "the copy laid out in a write call's files copied the file"
        );
    }
    t.text(
        "durable copies by hand/s, 16 processes at once, each also making, syncing and removing a write call's own files (job dir, `stage`, slot, journal, undo record rewritten in its slot, session file; an unkeyed job record kept)",
        format!("{laid_out:.0}/s"),
        &format!(
            "{} copies; {:.0}% of the plain copies' rate: what the file layout costs this filesystem; the write calls at 16 sessions reach {:.0}% of it",
            16 * plan.per_conn,
            laid_out / by_hand * 100.0,
            at16 / laid_out * 100.0
        ),
        "reported",
    );
    // The same load with the workspace and the state dir on tmpfs: the daemon's and its
    // workers' own ceiling, with the filesystem's work (inode allocation, writeback, flushes)
    // taken away. Not durable, so no target: what separates it from the row of 16 sessions
    // above is what the disk's filesystem costs per call.
    let shm = Path::new("/dev/shm");
    if fs_type(shm) == Some(TMPFS_MAGIC) {
        let tmpfs = start_in(shm, |_| {});
        tmpfs.write("in-1k", &"x".repeat(1024));
        let (rate, cpu) = throughput(&tmpfs, 16, plan.per_conn, &mut 0);
        let (_, ext, ext_cpu) = &rates[rates.len() - 1];
        t.text(
            "durable write calls/s, 16 session(s) on 16 connections, workspace and state dir on tmpfs (no disk: the daemon's own ceiling)",
            format!("{rate:.0}/s"),
            &format!(
                "{} calls; {}; daemon CPU per call {:.2} ms here, {:.2} ms on the disk ({ext:.0}/s)",
                16 * plan.per_conn,
                cpu.describe(),
                cpu.daemon / rate * 1e3,
                ext_cpu.daemon / ext * 1e3,
            ),
            "reported",
        );
    } else {
        t.text(
            "durable write calls/s on tmpfs",
            "not measured: /dev/shm is not a tmpfs".into(),
            "",
            "reported",
        );
    }
    peak_rss
}

fn main() {
    let args: Vec<String> = std::env::args().skip(1).collect();
    if args.first().map(String::as_str) == Some(BY_HAND) {
        if let Err(e) = durable_copy_by_hand(&args[1..]) {
            eprintln!("durable copy by hand: {e}");
            std::process::exit(1);
        }
        return;
    }
    let short = args.iter().any(|a| a == "--short");
    // `--real-tools`: only the real tools' rows (edit_file, a tree extracted, an in-out tree).
    let only_tools = args.iter().any(|a| a == "--real-tools");
    // `--spawn`: only the spawn rows (bare fork/exec, bwrap, sandboxed spawn) and the
    // external read of `cat` against the direct run.
    let only_spawn = args.iter().any(|a| a == "--spawn");
    // `--throughput`: only the durable write calls/s over 1 to 16 sessions.
    let only_throughput = args.iter().any(|a| a == "--throughput");
    let plan = Plan::new(short);
    machine();
    println!(
        "mode: {} (p50 / p99 in ms over n runs after one warm-up; ratios of medians)\n",
        if short {
            "--short (a check that the command works: figures meaningless)"
        } else {
            "full"
        }
    );
    let mut t = Table {
        rows: Vec::new(),
        missed: Vec::new(),
    };

    // --- Spawn: bare fork/exec, bwrap, sandboxed.
    let started = Instant::now();
    let d = start(|_| {});
    let pid = d.pid();
    let idle_rss = rss_kib(pid);
    // The harness's readiness probe (a connection that ends without `initialize`) armed the
    // daemon's handshake timer (10 s by default). A runtime thread that parked while that
    // timer was armed keeps its epoll timeout after the connection ended (tokio does not
    // re-arm a parked thread when another cancels a timer) and wakes once, at the timer's
    // wheel slot: a consequence of that one connection, not periodic work. The fresh
    // window starts once it is past.
    std::thread::sleep(HANDSHAKE_TIMEOUT.saturating_sub(started.elapsed()));
    let (idle_runs, idle_switches, _) = idle_wakeups(pid, plan.idle);
    d.write("in-1k", &"x".repeat(1024));
    let src = d.workspace.join("in-1k");
    let mut c = Conn::open(&d);
    c.call("session_create", json!({"id": "bench"}));

    if only_tools {
        real_tools(&mut t, &plan, &d, &mut c);
        t.print();
        return;
    }
    if only_throughput {
        throughput_rows(&mut t, &plan, &d);
        t.print();
        return;
    }
    let bare = Series::measure(plan.iters, bare_fork_exec);
    t.row("bare fork/exec/wait of /bin/true", &bare, "", "");
    let bwrap = which("bwrap").map(|bw| {
        Series::measure(plan.iters, || {
            run_direct(Command::new(&bw).args([
                "--unshare-all",
                "--ro-bind",
                "/",
                "/",
                "/bin/true",
            ]))
        })
    });
    match &bwrap {
        Some(b) => t.row(
            "`bwrap --unshare-all --ro-bind / / /bin/true`",
            b,
            &format!("{:.1}x bare", ratio(b, &bare)),
            "",
        ),
        None => {
            // A target that could not be measured is not met.
            let v = t.verdict(
                "sandboxed spawn 3x cheaper than bwrap (not measured: bwrap not installed)",
                false,
            );
            t.text(
                "`bwrap --unshare-all`",
                "not installed (apt-get install bubblewrap)".into(),
                "",
                &format!(">= 3x cheaper: {v}"),
            )
        }
    }
    let (builtin, builtin_cpu) = measure_call(pid, plan.iters, || {
        c.call("session_get", json!({"session": "bench"}));
    });
    let (ext_true, ext_true_cpu) = measure_call(pid, plan.iters, || {
        c.call("bench_true", json!({}));
    });
    t.row(
        "built-in read call (`session_get`), the MCP round trip",
        &builtin,
        &builtin_cpu,
        "reported",
    );
    t.row(
        "external read call of /bin/true (spawn + MCP + audit)",
        &ext_true,
        &ext_true_cpu,
        "",
    );
    let spawn = Series(
        ext_true
            .0
            .iter()
            .map(|x| x.saturating_sub(builtin.p50()))
            .collect(),
    );
    let r_bare = ratio(&spawn, &bare);
    let v = t.verdict(
        "sandboxed spawn within 1.5x of bare fork/exec",
        r_bare <= 1.5,
    );
    t.row(
        "sandboxed spawn of /bin/true (the call above minus the built-in median)",
        &spawn,
        &format!("{r_bare:.1}x bare"),
        &format!("<= 1.5x bare: {v}"),
    );
    if let Some(b) = &bwrap {
        let r = ratio(b, &spawn);
        let v = t.verdict("sandboxed spawn 3x cheaper than bwrap", r >= 3.0);
        t.text(
            "bwrap / sandboxed spawn",
            format!("{r:.1}x"),
            "",
            &format!(">= 3x: {v}"),
        );
    }
    let spawn_floor = SpawnFloor {
        ext_true: ext_true.p50(),
        bare: bare.p50(),
    };
    if only_spawn {
        read_rows(&mut t, &plan, &mut c, &src, pid, false, spawn_floor);
        t.print();
        return;
    }

    // --- Durable write vs direct; external read vs direct.
    let direct_out = d.dir.path().join("direct-out");
    let direct_cp = Series::measure(plan.iters, || {
        run_direct(Command::new("/bin/cp").arg("--").arg(&src).arg(&direct_out))
    });
    t.row("direct run: `cp` of 1 KiB", &direct_cp, "", "");
    // The cheapest durable equivalent a user could run by hand: one process that copies,
    // syncs the copy's data, renames it into place and syncs the directory, in a directory
    // of its own on the workspace's filesystem.
    let by_hand_dir = d.dir.path().join("by-hand");
    std::fs::create_dir_all(&by_hand_dir).expect("by-hand dir");
    assert_eq!(
        dev_of(&by_hand_dir),
        dev_of(&d.workspace),
        "the durable copy by hand runs on the workspace's filesystem"
    );
    let by_hand_tmp = by_hand_dir.join("out-1k.tmp");
    let by_hand_out = by_hand_dir.join("out-1k");
    let me = std::env::current_exe().expect("the bench's own executable");
    let by_hand = Series::measure(plan.iters, || {
        run_direct(
            Command::new(&me)
                .arg(BY_HAND)
                .arg(&src)
                .arg(&by_hand_tmp)
                .arg(&by_hand_out),
        )
    });
    assert_eq!(
        std::fs::read(&by_hand_out).expect("the durable copy by hand"),
        std::fs::read(&src).expect("in-1k"),
        "the durable copy by hand copied the file"
    );
    t.row(
        "durable copy by hand: one process: copy of 1 KiB, `fdatasync` of the copy, `rename` into place, `fsync` of the dir",
        &by_hand,
        &format!("{:.1}x direct `cp`", ratio(&by_hand, &direct_cp)),
        "",
    );
    // The same durable work in this process, with no process started: what the syncs and
    // the rename cost on this filesystem.
    let in_process = Series::measure(plan.iters, || {
        timed(|| durable_copy(&src, &by_hand_tmp, &by_hand_out).expect("durable copy"))
    });
    t.row(
        "durable copy in this process (the same copy, syncs and rename; no process started)",
        &in_process,
        "",
        "",
    );
    let (write, write_cpu) = measure_call(pid, plan.iters, || {
        c.call(
            "bench_copy",
            json!({"session": "bench", "src": "in-1k", "out": "out-1k"}),
        );
    });
    traced(pid, "durable-write", || {
        for _ in 0..50 {
            c.call(
                "bench_copy",
                json!({"session": "bench", "src": "in-1k", "out": "out-1k"}),
            );
        }
    });
    let r = ratio(&write, &direct_cp);
    let v = t.verdict(
        "durable write call within 3x of `cp` run directly",
        r <= 3.0,
    );
    let r_hand = ratio(&write, &by_hand);
    let v_hand = t.verdict(
        "durable write call within 1.5x of the durable copy by hand",
        r_hand <= 1.5,
    );
    t.row(
        "durable write call: `cp` 1 KiB published, state committed, audited",
        &write,
        &format!("{r:.1}x direct `cp`; {r_hand:.1}x the durable copy by hand; {write_cpu}"),
        &format!("<= 3x direct `cp`: {v}; <= 1.5x by hand: {v_hand}"),
    );
    // The floor of any durable write call that runs `cp` as a sandboxed worker: the MCP
    // round trip, the sandboxed spawn, what `cp` adds to /bin/true (direct `cp` minus bare
    // fork/exec), and the durable work the copy by hand does (in this process, above),
    // each measured here. No commit record, no journal, no audit: a lower bound.
    t.floor(
        "floor of a durable write call: MCP round trip + sandboxed spawn + (direct `cp` - bare) + durable copy in process (medians above)",
        spawn_floor.running(&direct_cp) + in_process.p50(),
        &by_hand,
        "the durable copy by hand",
        &write,
        "the write call",
    );
    read_rows(&mut t, &plan, &mut c, &src, pid, true, spawn_floor);

    // --- Publication cost, 1 KiB vs big: the call minus the same command run directly. For
    // the big file, each direct run is followed by an `fdatasync` of what it wrote, timed
    // apart: the writeback of the same file, the floor under a durable publication of it.
    // Each direct run writes a new file, as the tool does (its output is a new file in its
    // staging dir): truncating the previous run's 1 GiB inside the timed write would wait
    // for that file's writeback and leave the `fdatasync` after it almost nothing to do.
    let fill = |bytes: u64, iters: usize, sync: bool, c: &mut Conn| {
        let mut syncs = Vec::new();
        let direct = Series::measure(iters, || {
            match std::fs::remove_file(&direct_out) {
                Err(e) if e.kind() != std::io::ErrorKind::NotFound => {
                    panic!("remove the previous direct run's output: {e}")
                }
                _ => {}
            }
            let write = run_direct(
                Command::new("/bin/sh")
                    .arg("-c")
                    .arg("head -c \"$1\" /dev/zero > \"$2\"")
                    .arg("bench-fill")
                    .arg(bytes.to_string())
                    .arg(&direct_out),
            );
            if sync {
                syncs.push(timed(|| fdatasync_path(&direct_out)));
            }
            write
        });
        // The first is the warm-up round's, which `measure` leaves out too.
        let floor = (!syncs.is_empty()).then(|| Series::sorted(syncs.split_off(1)));
        let call = Series::measure(iters, || {
            timed(|| {
                c.call(
                    "bench_fill",
                    json!({"session": "bench", "bytes": bytes, "out": "out-fill"}),
                );
            })
        });
        let cost = Series(
            call.0
                .iter()
                .map(|x| x.saturating_sub(direct.p50()))
                .collect(),
        );
        (direct, floor, call, cost)
    };
    let (_, _, small_call, small) = fill(1024, plan.iters, false, &mut c);
    let small_audit = publish_times(&mut c, "bench_fill", plan.iters);
    let (big_direct, floor, big_call, big) = fill(plan.big_bytes, plan.big_iters, true, &mut c);
    let floor = floor.expect("the big file's fdatasync was measured");
    let big_audit = publish_times(&mut c, "bench_fill", plan.big_iters);
    let _ = std::fs::remove_file(&direct_out);
    let big_name = if plan.big_bytes >= 1 << 30 {
        format!("{} GiB", plan.big_bytes >> 30)
    } else {
        format!("{} MiB", plan.big_bytes >> 20)
    };
    t.row(
        "publication of 1 KiB (write call minus direct run)",
        &small,
        &format!("call {} ms", ms(small_call.p50())),
        "",
    );
    t.row(
        "publication of 1 KiB, worker end to commit (daemon's audit, ms resolution)",
        &small_audit,
        "",
        "",
    );
    t.row(
        &format!(
            "direct run: {big_name} written as the tool writes it (`head -c N /dev/zero > file`, a new file each run)"
        ),
        &big_direct,
        "",
        "",
    );
    t.row(
        &format!("direct run: `fdatasync` of that {big_name} file just written (its writeback)"),
        &floor,
        &format!(
            "the floor of a durable publication; write + `fdatasync` {} ms",
            ms(big_direct.p50() + floor.p50())
        ),
        "",
    );
    let r_audit = big_audit.p50().as_secs_f64() / small_audit.p50().as_secs_f64().max(1e-3);
    let r_floor = ratio(&big_audit, &floor);
    let v = t.verdict(
        &format!("publication of {big_name} within 1.5x of its `fdatasync` run directly"),
        r_floor <= 1.5,
    );
    t.row(
        &format!("publication of {big_name}, worker end to commit (daemon's audit)"),
        &big_audit,
        &format!(
            "{r_floor:.1}x its `fdatasync` ({} ms); {r_audit:.1}x the 1 KiB cost",
            ms(floor.p50())
        ),
        &format!("<= 1.5x `fdatasync`: {v}"),
    );
    let r = ratio(&big, &small);
    t.row(
        &format!("publication of {big_name} (write call minus direct run)"),
        &big,
        &format!(
            "call {} ms, direct {} ms; {r:.1}x the 1 KiB cost",
            ms(big_call.p50()),
            ms(big_direct.p50())
        ),
        "",
    );

    // --- The fsync floor under the durable audit event every commit waits for.
    let line = durable_line_cost(&d.state, plan.iters);
    t.row(
        "durable line (audit-sized, appended and fdatasynced on the state dir's filesystem)",
        &line,
        "the floor of a `commit` audit event",
        "reported",
    );

    // --- Cancellation to confirmed worker exit.
    let honours = Series::measure(plan.cancel_iters, || {
        cancel_to_exit(&d, &mut c, "bench_sleep", "/bin/sleep", false, 0)
    });
    let v = t.verdict(
        "cancel p99 under 20 ms (worker honours SIGTERM)",
        honours.p99() < Duration::from_millis(20),
    );
    t.row(
        "cancel to confirmed worker exit, worker honours SIGTERM",
        &honours,
        "",
        &format!("p99 < 20 ms: {v}"),
    );
    let mut i = 0;
    let stubborn = Series::measure(plan.cancel_iters, || {
        i += 1;
        cancel_to_exit(
            &d,
            &mut c,
            "bench_stubborn",
            "/bin/sh -c trap '' TERM; sleep \"$1\"; : bench-stubborn",
            true,
            i,
        )
    });
    let v = t.verdict(
        "cancel p99 under grace + 20 ms (worker ignores SIGTERM)",
        stubborn.p99() < GRACE + Duration::from_millis(20),
    );
    t.row(
        &format!(
            "cancel to confirmed worker exit, worker ignores SIGTERM (grace {} ms)",
            GRACE.as_millis()
        ),
        &stubborn,
        "",
        &format!("p99 < grace + 20 ms: {v}"),
    );

    real_tools(&mut t, &plan, &d, &mut c);

    // --- Throughput across sessions, 16 connections.
    let peak_rss = throughput_rows(&mut t, &plan, &d);

    // --- Idle after load, then memory with many sessions.
    // Twice: the first period after the load may see a thread pool wind down.
    let (after_runs, after_switches, ended) = idle_wakeups(pid, plan.idle);
    let (quiet_runs, quiet_switches, quiet_ended) = idle_wakeups(pid, plan.idle);
    let v = t.verdict(
        "idle daemon does no periodic work",
        idle_runs == 0 && quiet_runs == 0 && quiet_ended == 0,
    );
    t.text(
        &format!(
            "idle daemon: times scheduled (context switches) over {} s",
            plan.idle.as_secs()
        ),
        format!(
            "{idle_runs} ({idle_switches}) fresh; {after_runs} ({after_switches}), {ended} threads ended, right after the load; {quiet_runs} ({quiet_switches}) in the next period"
        ),
        "/proc/PID/task/*/schedstat",
        &format!("0: {v}"),
    );
    let mut setup = Conn::open(&d);
    let t_sessions = Instant::now();
    for s in 0..plan.sessions {
        setup.call("session_create", json!({"id": format!("many-{s}")}));
    }
    let took = t_sessions.elapsed();
    // A quiet moment before the idle RSS: the resting daemon is what is measured.
    std::thread::sleep(Duration::from_millis(300));
    t.text(
        "daemon RSS: idle / under load (peak) / with many sessions",
        format!(
            "{} / {} / {} MiB",
            idle_rss / 1024,
            peak_rss / 1024,
            rss_kib(pid) / 1024
        ),
        &format!(
            "{} sessions created in {:.1} s; {} fds",
            plan.sessions,
            took.as_secs_f64(),
            fd_count(pid)
        ),
        "reported",
    );
    drop(setup);
    drop(c);
    drop(d);

    // --- The soak at full size, on its own daemon.
    let mut sd = soak::daemon();
    sd.env.push(("AIRLOCK_LOG".into(), "warn".into()));
    sd.start();
    let cfg = soak::Config {
        calls: plan.soak_calls,
        sessions: 32,
        connections: 8,
        seed: 0x5eed_1234,
    };
    let r = soak::run(&sd, &cfg);
    t.text(
        &format!(
            "soak: {} mixed calls, 32 sessions, 8 connections ({} cancels, {} disconnects)",
            r.sent, r.cancels, r.disconnects
        ),
        format!("{:.0} calls/s", r.sent as f64 / r.elapsed.as_secs_f64()),
        &format!(
            "RSS {} idle / {} peak / {} after MiB; fds {} / {}",
            r.idle_rss_kib / 1024,
            r.peak_rss_kib / 1024,
            r.after_rss_kib / 1024,
            r.idle_fds,
            r.after_fds
        ),
        if r.problems.is_empty() {
            "nothing lost or leaked"
        } else {
            "**PROBLEMS** (below)"
        },
    );
    for (kind, v) in r.latencies {
        let mut v = v;
        v.sort();
        let s = Series(v);
        t.row(&format!("soak latency under load: {kind:?}"), &s, "", "");
    }
    drop(sd);

    let load = std::fs::read_to_string("/proc/loadavg").unwrap_or_default();
    t.print();
    println!(
        "\nload average at the end: {}",
        load.split_whitespace()
            .take(3)
            .collect::<Vec<_>>()
            .join(" ")
    );
    if !r.problems.is_empty() {
        eprintln!("soak problems:\n{}", r.problems.join("\n"));
        std::process::exit(1);
    }
    if plan.short {
        println!("(--short: the command works; run bench/run for figures)");
    }
}
