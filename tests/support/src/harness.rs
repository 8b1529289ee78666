//! Starts the real `airlock` binary on a temporary socket, with the shipped policies plus the
//! test tools, and drives it with rmcp's client or raw JSON-RPC lines.

#![allow(dead_code)]

use std::io::{BufRead, BufReader, Write};
use std::os::unix::fs::PermissionsExt;
use std::os::unix::net::UnixStream as StdUnixStream;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use rmcp::model::CallToolRequestParams;
use rmcp::service::RunningService;
use rmcp::{RoleClient, ServiceExt};
use serde_json::{json, Map, Value};

/// The `airlock` binary cargo built for this test or bench run. It reads as a path
/// (`Command::new(BIN)`, `.arg(BIN)`, `format!("{BIN}")`); `BIN.as_str()` where a `&str` is
/// needed.
pub const BIN: Bin = Bin;

/// See [`BIN`]: the path is found once, at run time, since this crate is built apart from
/// airlock's own test targets (which alone get `CARGO_BIN_EXE_airlock` at compile time).
#[derive(Debug, Clone, Copy)]
pub struct Bin;

impl Bin {
    /// `CARGO_BIN_EXE_airlock` when cargo sets it for the running test, else `airlock` in
    /// the profile dir above the running test or bench executable (`target/<profile>/deps/`);
    /// fails naming both when neither exists.
    pub fn as_str(self) -> &'static str {
        static PATH: std::sync::OnceLock<String> = std::sync::OnceLock::new();
        PATH.get_or_init(|| {
            if let Ok(p) = std::env::var("CARGO_BIN_EXE_airlock") {
                return p;
            }
            let exe = std::env::current_exe().expect("the running test's executable");
            let beside = exe
                .parent()
                .and_then(Path::parent)
                .map(|dir| dir.join("airlock"))
                .filter(|p| p.is_file());
            match beside {
                Some(p) => p.display().to_string(),
                None => panic!(
                    "the airlock binary: CARGO_BIN_EXE_airlock is unset and there is no \
                     airlock two levels above {}; run the tests through cargo",
                    exe.display()
                ),
            }
        })
    }
}

impl std::ops::Deref for Bin {
    type Target = str;
    fn deref(&self) -> &str {
        self.as_str()
    }
}

impl AsRef<std::ffi::OsStr> for Bin {
    fn as_ref(&self) -> &std::ffi::OsStr {
        self.as_str().as_ref()
    }
}

impl AsRef<Path> for Bin {
    fn as_ref(&self) -> &Path {
        Path::new(self.as_str())
    }
}

impl std::fmt::Display for Bin {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.as_str())
    }
}

/// The checkout: the policies and `tests/tools` the daemon under test loads.
pub fn repo() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR"))
        .ancestors()
        .nth(2)
        .expect("tests/support lies two levels below the checkout")
        .to_path_buf()
}

/// Fails the test, naming `program` and the Debian package that has it, unless `program` (a
/// name looked up on PATH, or an absolute path) is an executable file: the base image may
/// lack what a test runs, and a missing one must fail the test as that, not as a confusing
/// error further on (or a pass). `.ci/install-deps` installs every package named here.
pub fn require_program(program: &str, package: &str) {
    let executable = |p: &Path| {
        std::fs::metadata(p).is_ok_and(|m| m.is_file() && m.permissions().mode() & 0o111 != 0)
    };
    let found = if program.contains('/') {
        executable(Path::new(program))
    } else {
        std::env::var_os("PATH")
            .is_some_and(|path| std::env::split_paths(&path).any(|d| executable(&d.join(program))))
    };
    assert!(
        found,
        "this test needs `{program}` (Debian package {package}; `.ci/install-deps` installs it)"
    );
}

/// Whether every directory above `path` is searchable by other users (uids the daemon or a
/// worker may run under reach it).
pub fn reachable_by_others(path: &std::path::Path) -> bool {
    path.ancestors()
        .skip(1)
        .all(|d| std::fs::metadata(d).is_ok_and(|m| m.permissions().mode() & 0o001 != 0))
}

/// The daemon binary at a path other uids can reach: [`BIN`] itself, or, when the checkout
/// lies under a directory others cannot search (a clone in /root), a hard link (or copy) of
/// it in a 0755 dir of the temp dir, made once per test process. No test depends on where
/// the checkout is.
pub fn reachable_bin() -> &'static str {
    static BIN_FOR_OTHERS: std::sync::OnceLock<String> = std::sync::OnceLock::new();
    BIN_FOR_OTHERS.get_or_init(|| {
        if reachable_by_others(BIN.as_ref()) {
            return BIN.to_string();
        }
        let dir = std::env::temp_dir().join(format!("airlock-test-bin-{}", std::process::id()));
        std::fs::create_dir_all(&dir).expect("bin dir");
        std::fs::set_permissions(&dir, std::fs::Permissions::from_mode(0o755)).expect("chmod");
        let to = dir.join("airlock");
        if !to.exists() && std::fs::hard_link(BIN, &to).is_err() {
            std::fs::copy(BIN, &to).expect("copy the binary where other uids reach it");
        }
        to.display().to_string()
    })
}

/// A daemon under test with its own policy dir, workspace, state dir and socket.
pub struct Daemon {
    pub child: Option<Child>,
    pub dir: tempfile::TempDir,
    pub policies: PathBuf,
    pub workspace: PathBuf,
    pub state: PathBuf,
    pub socket: PathBuf,
    pub log: PathBuf,
    /// Extra environment for the daemon (failpoints).
    pub env: Vec<(String, String)>,
    /// Run the daemon as this uid/gid (via setpriv), when set.
    pub user: Option<(u32, u32)>,
    /// With `user`: capabilities (setpriv names, e.g. "setuid,kill") the daemon keeps as
    /// ambient ones, as systemd's `AmbientCapabilities=` would give them.
    pub ambient_caps: Option<String>,
    /// A command the daemon runs under (e.g. `systemd/unit-filter UNIT --`): it comes
    /// right before the binary, after the uid switch when `user` is set.
    pub wrap: Vec<String>,
}

pub type Client = RunningService<RoleClient, ()>;

/// The names `tools/list` gives `c`, sorted.
pub async fn tool_names(c: &Client) -> Vec<String> {
    let mut names: Vec<String> = c
        .list_all_tools()
        .await
        .expect("tools/list")
        .into_iter()
        .map(|t| t.name.to_string())
        .collect();
    names.sort();
    names
}

/// Sets `[daemon]` keys of the daemon's `airlock.toml` (before `start`).
pub fn set_daemon(d: &Daemon, kv: &[(&str, &str)]) {
    let path = d.policies.join("airlock.toml");
    let text = std::fs::read_to_string(&path).expect("airlock.toml");
    let mut out = Vec::new();
    for line in text.lines() {
        let key = line.trim_start_matches('#').trim_start();
        if kv.iter().any(|(k, _)| key.starts_with(&format!("{k} ="))) {
            continue;
        }
        out.push(line.to_string());
        if line.trim() == "[daemon]" {
            for (k, v) in kv {
                out.push(format!("{k} = {v}"));
            }
        }
    }
    std::fs::write(&path, out.join("\n") + "\n").expect("write airlock.toml");
}

/// `airlock connect` to `d`'s socket as `uid` (and the gid of the same number) under
/// setpriv, with `groups` given as setpriv takes them (`--clear-groups`, `--groups=1,2`);
/// stdin and stdout piped, so the caller speaks MCP over them.
pub fn connect_as(d: &Daemon, uid: u32, groups: &str) -> Command {
    require_program("setpriv", "util-linux");
    let mut c = Command::new("setpriv");
    c.arg(format!("--reuid={uid}"))
        .arg(format!("--regid={uid}"))
        .arg(groups)
        .args(["--", reachable_bin(), "connect", "--socket"])
        .arg(&d.socket)
        .stdin(Stdio::piped())
        .stdout(Stdio::piped());
    c
}

impl Daemon {
    /// Shipped policies plus `tests/tools/*.toml`.
    pub fn new() -> Daemon {
        Daemon::new_in(&std::env::temp_dir())
    }

    /// [`Daemon::new`] with its dir (workspace, state, socket) made under `base`, on
    /// `base`'s filesystem.
    pub fn new_in(base: &Path) -> Daemon {
        let dir = tempfile::Builder::new()
            .prefix("airlock-test-")
            .tempdir_in(base)
            .expect("tempdir");
        std::fs::set_permissions(dir.path(), std::fs::Permissions::from_mode(0o755))
            .expect("chmod");
        let policies = dir.path().join("policies");
        copy_dir(&repo().join("policies"), &policies);
        for entry in std::fs::read_dir(repo().join("tests/tools")).expect("tests/tools") {
            let p = entry.expect("entry").path();
            std::fs::copy(
                &p,
                policies.join("tools").join(p.file_name().expect("name")),
            )
            .expect("copy tool");
        }
        let workspace = dir.path().join("workspace");
        std::fs::create_dir_all(&workspace).expect("workspace");
        Daemon {
            child: None,
            policies,
            workspace,
            state: dir.path().join("state"),
            socket: dir.path().join("airlock.sock"),
            log: dir.path().join("daemon.log"),
            dir,
            env: Vec::new(),
            user: None,
            ambient_caps: None,
            wrap: Vec::new(),
        }
    }

    /// Starts the daemon and waits until its socket accepts connections.
    pub fn start(&mut self) -> &mut Self {
        if let Err(status) = self.try_start() {
            let log = self.log_text();
            panic!(
                "airlock serve exited with {status} before listening:\n{log}{}",
                lock_holder(&log)
            );
        }
        self
    }

    /// Starts the daemon; `Err` with its exit status if it exits before serving (a crash
    /// during startup recovery, say).
    pub fn try_start(&mut self) -> Result<(), std::process::ExitStatus> {
        let log = std::fs::OpenOptions::new()
            .create(true)
            .append(true)
            .open(&self.log)
            .expect("log");
        let mut cmd = match self.user {
            Some((uid, gid)) => {
                require_program("setpriv", "util-linux");
                let mut c = Command::new("setpriv");
                let caps = match &self.ambient_caps {
                    Some(list) => {
                        let plus: Vec<String> =
                            list.split(',').map(|c| format!("+{}", c.trim())).collect();
                        let plus = plus.join(",");
                        [
                            format!("--inh-caps=-all,{plus}"),
                            format!("--ambient-caps={plus}"),
                        ]
                    }
                    None => [
                        "--inh-caps=-all".to_string(),
                        "--bounding-set=-all".to_string(),
                    ],
                };
                c.args([
                    format!("--reuid={uid}"),
                    format!("--regid={gid}"),
                    "--clear-groups".to_string(),
                    caps[0].clone(),
                    caps[1].clone(),
                    "--".to_string(),
                ]);
                c.args(&self.wrap).arg(reachable_bin());
                c
            }
            None => match self.wrap.split_first() {
                Some((first, rest)) => {
                    let mut c = Command::new(first);
                    c.args(rest).arg(BIN);
                    c
                }
                None => Command::new(BIN),
            },
        };
        cmd.arg("serve")
            .arg("--policies")
            .arg(&self.policies)
            .arg("--socket")
            .arg(&self.socket)
            .arg("--workspace")
            .arg(&self.workspace)
            .arg("--state-dir")
            .arg(&self.state)
            .env("AIRLOCK_LOG", "debug")
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .stderr(Stdio::from(log));
        for (k, v) in &self.env {
            cmd.env(k, v);
        }
        let mut child = cmd.spawn().expect("spawn airlock serve");
        let deadline = Instant::now() + Duration::from_secs(20);
        loop {
            if StdUnixStream::connect(&self.socket).is_ok() {
                self.child = Some(child);
                return Ok(());
            }
            if let Ok(Some(status)) = child.try_wait() {
                return Err(status);
            }
            assert!(
                Instant::now() < deadline,
                "airlock serve neither served nor exited within 20s:\n{}",
                self.log_text()
            );
            std::thread::sleep(Duration::from_millis(5));
        }
    }

    pub fn pid(&self) -> u32 {
        self.child.as_ref().expect("running").id()
    }

    pub fn log_text(&self) -> String {
        std::fs::read_to_string(&self.log).unwrap_or_default()
    }

    /// SIGTERM, then wait for the exit status.
    pub fn stop(&mut self) -> std::process::ExitStatus {
        let mut child = self.child.take().expect("running");
        // SAFETY: kill(2) on our own child's pid.
        unsafe { libc::kill(child.id() as i32, libc::SIGTERM) };
        child.wait().expect("wait")
    }

    /// SIGKILL, like a crash.
    pub fn kill9(&mut self) {
        if let Some(mut child) = self.child.take() {
            let _ = child.kill();
            let _ = child.wait();
        }
    }

    /// Waits for a daemon that is expected to exit by itself (a crash at a failpoint).
    pub fn wait_exit(&mut self, timeout: Duration) -> Option<std::process::ExitStatus> {
        let child = self.child.as_mut()?;
        let deadline = Instant::now() + timeout;
        loop {
            if let Ok(Some(st)) = child.try_wait() {
                self.child = None;
                return Some(st);
            }
            if Instant::now() > deadline {
                return None;
            }
            std::thread::sleep(Duration::from_millis(10));
        }
    }

    pub async fn client(&self) -> Client {
        let stream = tokio::net::UnixStream::connect(&self.socket)
            .await
            .expect("connect");
        ().serve(stream).await.expect("MCP handshake")
    }

    pub fn raw(&self) -> Raw {
        Raw::connect(&self.socket)
    }

    /// Names of the `.airlock-job-*` dirs left in the workspace root, but the idle ones the
    /// daemon keeps for reuse, each of which must be clean (see [`idle_dir_faults`]).
    pub fn job_dirs(&self) -> Vec<String> {
        let names: Vec<String> = std::fs::read_dir(&self.workspace)
            .map(|rd| {
                rd.filter_map(|e| e.ok())
                    .map(|e| e.file_name().to_string_lossy().into_owned())
                    .filter(|n| n.starts_with(".airlock-job-"))
                    .collect()
            })
            .unwrap_or_default();
        let mut jobs = Vec::new();
        for n in names {
            if n.starts_with(IDLE_JOB_DIR_PREFIX) {
                let faults = idle_dir_faults(&self.workspace.join(&n));
                assert!(
                    faults.is_empty(),
                    "idle job dir {n} is not clean: {faults:?}"
                );
            } else {
                jobs.push(n);
            }
        }
        jobs
    }

    /// Names of the idle job dirs the daemon keeps for reuse, each checked clean, sorted.
    pub fn idle_job_dirs(&self) -> Vec<String> {
        let mut idle: Vec<String> = std::fs::read_dir(&self.workspace)
            .into_iter()
            .flatten()
            .flatten()
            .map(|e| e.file_name().to_string_lossy().into_owned())
            .filter(|n| n.starts_with(IDLE_JOB_DIR_PREFIX))
            .collect();
        idle.sort();
        for n in &idle {
            let faults = idle_dir_faults(&self.workspace.join(n));
            assert!(
                faults.is_empty(),
                "idle job dir {n} is not clean: {faults:?}"
            );
        }
        idle
    }

    /// The undo data kept in the workspace, sorted: `session/job` for each slot of
    /// `.airlock-undo/<session>/` whose record names a job; a blank slot (an empty or `null` record
    /// and nothing else) is not listed, and anything else is, by its name (`session/g0:
    /// blank with entries`, `session/g1: damaged`, `session/other`, `session/` for an
    /// empty session dir).
    pub fn undo_generations(&self) -> Vec<String> {
        let mut out = Vec::new();
        let top = self.workspace.join(UNDO_DIR);
        for s in std::fs::read_dir(&top).into_iter().flatten().flatten() {
            let session = s.file_name().to_string_lossy().into_owned();
            let mut any = false;
            for e in std::fs::read_dir(s.path()).into_iter().flatten().flatten() {
                any = true;
                let name = e.file_name().to_string_lossy().into_owned();
                if !UNDO_SLOTS.contains(&name.as_str()) {
                    out.push(format!("{session}/{name}"));
                    continue;
                }
                let record = std::fs::read(e.path().join("undo.json")).unwrap_or_default();
                // An empty record or the blank marker (the daemon's `publish::undo::BLANK`).
                if record.is_empty() || record == b"null" {
                    let entries = std::fs::read_dir(e.path()).map_or(0, |r| r.count());
                    if entries > 1 {
                        out.push(format!("{session}/{name}: blank with entries"));
                    }
                    continue;
                }
                let job = serde_json::from_slice::<serde_json::Value>(&record)
                    .ok()
                    .and_then(|v| v["job"].as_str().map(str::to_string));
                match job {
                    Some(job) => out.push(format!("{session}/{job}")),
                    None => out.push(format!("{session}/{name}: damaged")),
                }
            }
            if !any {
                out.push(format!("{session}/"));
            }
        }
        out.sort();
        out
    }

    /// The slot dir of `session` whose undo record names `job`.
    pub fn undo_generation_dir(&self, session: &str, job: &str) -> Option<PathBuf> {
        UNDO_SLOTS.iter().find_map(|slot| {
            let dir = self.workspace.join(UNDO_DIR).join(session).join(slot);
            let record = std::fs::read(dir.join("undo.json")).ok()?;
            let v: serde_json::Value = serde_json::from_slice(&record).ok()?;
            (v["job"] == job).then_some(dir)
        })
    }

    pub fn write(&self, rel: &str, content: &str) {
        let p = self.workspace.join(rel);
        if let Some(parent) = p.parent() {
            std::fs::create_dir_all(parent).expect("mkdir");
        }
        std::fs::write(p, content).expect("write");
    }

    pub fn read(&self, rel: &str) -> Option<String> {
        std::fs::read_to_string(self.workspace.join(rel)).ok()
    }

    /// `airlock audit verify` on this daemon's log (`<state>/audit.jsonl`): its exit code and
    /// what it printed (stdout, then stderr).
    pub fn audit_verify(&self) -> (Option<i32>, String) {
        let out = Command::new(BIN)
            .args(["audit", "verify", "--log"])
            .arg(self.state.join("audit.jsonl"))
            .output()
            .expect("airlock audit verify");
        let said = String::from_utf8_lossy(&out.stdout).into_owned()
            + &String::from_utf8_lossy(&out.stderr);
        (out.status.code(), said)
    }

    /// Fails the test, naming `what`, unless `airlock audit verify` passes on this daemon's
    /// log.
    pub fn assert_audit_verifies(&self, what: &str) {
        let (code, said) = self.audit_verify();
        assert_eq!(code, Some(0), "{what}: airlock audit verify: {said}");
    }

    /// Makes the daemon (started after this) pause for two minutes at every `every`-th pass
    /// of failpoint `name`, creating the returned mark file when it does: a test waits for the
    /// mark, acts while the daemon holds still, then kills or lets it go. Adds to `env`.
    pub fn pause_at_failpoint(&mut self, name: &str, every: u64) -> PathBuf {
        let mark = self.dir.path().join("paused");
        self.env.extend([
            ("AIRLOCK_FAILPOINT_PAUSE_NAME".into(), name.into()),
            ("AIRLOCK_FAILPOINT_PAUSE_EVERY".into(), every.to_string()),
            (
                "AIRLOCK_FAILPOINT_PAUSE_MARK".into(),
                mark.display().to_string(),
            ),
            ("AIRLOCK_FAILPOINT_PAUSE_MS".into(), "120000".into()),
        ]);
        mark
    }

    /// `airlock recover` on this daemon's policy dir, workspace and state dir, as `user`
    /// when set (see [`Daemon::recover_in`]).
    pub fn recover(&self, user: Option<(u32, u32)>) -> Command {
        self.recover_in(user, &self.workspace, &self.state)
    }

    /// `airlock recover` on this daemon's policy dir and the given workspace and state dir;
    /// as `user` (uid, gid, no supplementary groups, via setpriv) when set, else as the
    /// test. The caller adds environment and runs it.
    pub fn recover_in(&self, user: Option<(u32, u32)>, workspace: &Path, state: &Path) -> Command {
        let mut cmd = match user {
            Some((uid, gid)) => {
                require_program("setpriv", "util-linux");
                let mut c = Command::new("setpriv");
                c.arg(format!("--reuid={uid}"))
                    .arg(format!("--regid={gid}"))
                    .args(["--clear-groups", "--", reachable_bin()]);
                c
            }
            None => Command::new(BIN),
        };
        cmd.arg("recover")
            .arg("--policies")
            .arg(&self.policies)
            .arg("--workspace")
            .arg(workspace)
            .arg("--state-dir")
            .arg(state);
        cmd
    }

    /// Adds a tool file to this daemon's policy (before `start`).
    pub fn add_tool(&self, name: &str, toml: &str) {
        if toml.contains("/usr/bin/python3") {
            require_program("/usr/bin/python3", "python3");
        }
        std::fs::write(
            self.policies.join("tools").join(format!("{name}.toml")),
            toml,
        )
        .expect("tool");
    }
}

impl Default for Daemon {
    fn default() -> Daemon {
        Daemon::new()
    }
}

impl Drop for Daemon {
    fn drop(&mut self) {
        self.kill9();
    }
}

fn copy_dir(from: &Path, to: &Path) {
    std::fs::create_dir_all(to).expect("mkdir");
    for entry in std::fs::read_dir(from).expect("read_dir") {
        let entry = entry.expect("entry");
        let target = to.join(entry.file_name());
        if entry.file_type().expect("type").is_dir() {
            copy_dir(&entry.path(), &target);
        } else {
            std::fs::copy(entry.path(), &target).expect("copy");
        }
    }
}

pub fn args(v: Value) -> Map<String, Value> {
    v.as_object().cloned().expect("object")
}

/// Calls a tool and returns the result as JSON (`isError`, `content`, `structuredContent`).
pub async fn call(client: &Client, tool: &str, a: Value) -> Value {
    let r = client
        .call_tool(CallToolRequestParams::new(tool.to_string()).with_arguments(args(a)))
        .await
        .unwrap_or_else(|e| panic!("{tool}: call failed: {e}"));
    serde_json::to_value(r).expect("json")
}

pub fn is_error(r: &Value) -> bool {
    r["isError"].as_bool().unwrap_or(false)
}

/// The text of a result's content blocks, without the block that repeats the serialized
/// `structuredContent` (the tool's own words only).
pub fn text(r: &Value) -> String {
    let structured = r.get("structuredContent").map(Value::to_string);
    r["content"]
        .as_array()
        .map(|a| {
            a.iter()
                .filter_map(|c| c["text"].as_str())
                .filter(|t| Some(*t) != structured.as_deref())
                .collect::<Vec<_>>()
                .join("\n")
        })
        .unwrap_or_default()
}

/// The stable error code of a tool fault.
pub fn code(r: &Value) -> String {
    r["structuredContent"]["error"]["code"]
        .as_str()
        .unwrap_or("")
        .to_string()
}

pub async fn session(client: &Client, id: &str) -> Value {
    let r = call(client, "session_create", json!({"id": id})).await;
    assert!(!is_error(&r), "session_create: {r}");
    r
}

pub async fn version(client: &Client, id: &str) -> u64 {
    let r = call(client, "session_get", json!({"session": id})).await;
    r["structuredContent"]["version"]
        .as_u64()
        .unwrap_or_else(|| panic!("session_get {id}: {r}"))
}

pub async fn audit(client: &Client) -> Vec<Value> {
    let r = client
        .read_resource(rmcp::model::ReadResourceRequestParams::new(
            "airlock://audit/events",
        ))
        .await
        .expect("read audit");
    let v = serde_json::to_value(r).expect("json");
    let text = v["contents"][0]["text"].as_str().expect("text").to_string();
    serde_json::from_str(&text).expect("events")
}

/// Pids of processes whose command line contains `needle`.
pub fn processes_with(needle: &str) -> Vec<i32> {
    command_lines()
        .filter(|(_, cmd)| cmd.contains(needle))
        .map(|(pid, _)| pid)
        .collect()
}

/// Every process's pid and command line, its arguments joined by spaces.
fn command_lines() -> impl Iterator<Item = (i32, String)> {
    std::fs::read_dir("/proc")
        .expect("/proc")
        .flatten()
        .filter_map(|e| {
            let pid = e.file_name().to_string_lossy().parse::<i32>().ok()?;
            let cmd = std::fs::read(format!("/proc/{pid}/cmdline")).ok()?;
            let cmd = String::from_utf8_lossy(&cmd);
            Some((pid, cmd.trim_end_matches('\0').replace('\0', " ")))
        })
}

/// Visits every entry under `root` without following symlinks, a directory before what it
/// holds: its path relative to `root`, its full path and its `lstat`. Entries that vanish
/// or cannot be read are passed over. The one tree walker of [`snapshot`], [`tree`] and
/// [`tree_names`].
/// For a daemon that found its workspace or state dir locked ("... (pid N) holds ..."): what
/// process N is, to tell a daemon left running from one of its children.
fn lock_holder(log: &str) -> String {
    let Some(pid) = log
        .rsplit_once("(pid ")
        .and_then(|(_, rest)| rest.split_once(')'))
        .and_then(|(pid, _)| pid.parse::<u32>().ok())
    else {
        return String::new();
    };
    let read = |f: &str| std::fs::read(format!("/proc/{pid}/{f}")).unwrap_or_default();
    let cmdline: Vec<String> = read("cmdline")
        .split(|b| *b == 0)
        .map(|a| String::from_utf8_lossy(a).into_owned())
        .collect();
    let status = String::from_utf8_lossy(&read("status")).into_owned();
    let brief: Vec<&str> = status
        .lines()
        .filter(|l| {
            ["State:", "PPid:", "Uid:", "Threads:"]
                .iter()
                .any(|k| l.starts_with(k))
        })
        .collect();
    format!("\nthe lock's holder, pid {pid}: {cmdline:?} {brief:?}")
}

/// The workspace's undo data dir (the daemon's `publish::undo::UNDO_DIR`).
pub const UNDO_DIR: &str = ".airlock-undo";
/// The two slots of a session's undo data (the daemon's `publish::undo::SLOTS`).
pub const UNDO_SLOTS: [&str; 2] = ["g0", "g1"];

/// The idle job dirs a daemon keeps for reuse (the daemon's `publish::pool::IDLE_PREFIX`).
pub const IDLE_JOB_DIR_PREFIX: &str = ".airlock-job-.idle-";

/// What is wrong with the idle job dir `dir`: it must hold `stage/0` and nothing else but a
/// blank journal (`null`, 0600), the three dirs mode 0700, all owned by the idle dir's owner
/// (the daemon), with no extended attribute. Empty: clean.
pub fn idle_dir_faults(dir: &Path) -> Vec<String> {
    use std::os::unix::fs::MetadataExt;
    let mut faults = Vec::new();
    let want = [dir.to_path_buf(), dir.join("stage"), dir.join("stage/0")];
    let owner = std::fs::symlink_metadata(dir)
        .map(|m| (m.uid(), m.gid()))
        .ok();
    for (i, p) in want.iter().enumerate() {
        let Ok(m) = std::fs::symlink_metadata(p) else {
            faults.push(format!("{} is missing", p.display()));
            continue;
        };
        if !m.is_dir() || m.mode() & 0o7777 != 0o700 {
            faults.push(format!("{} has mode {:o}", p.display(), m.mode()));
        }
        if Some((m.uid(), m.gid())) != owner {
            faults.push(format!(
                "{} is owned by {}:{}",
                p.display(),
                m.uid(),
                m.gid()
            ));
        }
        let mut names: Vec<String> = std::fs::read_dir(p)
            .into_iter()
            .flatten()
            .flatten()
            .map(|e| e.file_name().to_string_lossy().into_owned())
            .collect();
        names.sort();
        let expected: &[&str] = match i {
            0 if names.len() == 2 => &["recovery.json", "stage"],
            0 => &["stage"],
            1 => &["0"],
            _ => &[],
        };
        if names != expected {
            faults.push(format!("{} holds {names:?}", p.display()));
        }
        if !xattr_names(p).is_empty() {
            faults.push(format!("{} has xattrs {:?}", p.display(), xattr_names(p)));
        }
    }
    // The blank journal a job that wrote one leaves: the daemon's, 0600, `null` (padded).
    let journal = dir.join("recovery.json");
    if let Ok(m) = std::fs::symlink_metadata(&journal) {
        if !m.is_file() || m.mode() & 0o7777 != 0o600 || m.nlink() != 1 {
            faults.push(format!(
                "{} has mode {:o}, {} links",
                journal.display(),
                m.mode(),
                m.nlink()
            ));
        }
        if Some((m.uid(), m.gid())) != owner {
            faults.push(format!(
                "{} is owned by {}:{}",
                journal.display(),
                m.uid(),
                m.gid()
            ));
        }
        // The blank marker, padded with spaces to the journal it blanked (the daemon's
        // `publish::journal::is_blank`).
        let bytes = std::fs::read(&journal).unwrap_or_default();
        let blank = bytes.starts_with(b"null") && bytes[4..].iter().all(|&b| b == b' ');
        if !blank || bytes.len() > 4096 {
            faults.push(format!(
                "{} holds {:?}",
                journal.display(),
                String::from_utf8_lossy(&bytes)
            ));
        }
        if !xattr_names(&journal).is_empty() {
            faults.push(format!(
                "{} has xattrs {:?}",
                journal.display(),
                xattr_names(&journal)
            ));
        }
    }
    faults
}

pub fn walk_tree(root: &Path, mut visit: impl FnMut(&str, &Path, &std::fs::Metadata)) {
    fn walk(root: &Path, dir: &Path, visit: &mut dyn FnMut(&str, &Path, &std::fs::Metadata)) {
        let Ok(rd) = std::fs::read_dir(dir) else {
            return;
        };
        for e in rd.flatten() {
            let p = e.path();
            // The workspace's undo data is the daemon's bookkeeping, named by job ids that
            // differ at each run: `Daemon::undo_generations` shows it.
            if dir == root && e.file_name() == UNDO_DIR {
                continue;
            }
            // Idle job dirs are the daemon's, kept for reuse: `Daemon::job_dirs` checks them.
            if dir == root
                && e.file_name()
                    .to_string_lossy()
                    .starts_with(IDLE_JOB_DIR_PREFIX)
            {
                continue;
            }
            let rel = p.strip_prefix(root).unwrap_or(&p).display().to_string();
            let Ok(m) = std::fs::symlink_metadata(&p) else {
                continue;
            };
            visit(&rel, &p, &m);
            if m.is_dir() {
                walk(root, &p, visit);
            }
        }
    }
    walk(root, root, &mut visit);
}

/// Every file under `root` with its content, for byte-for-byte comparisons (directories end
/// in `/`, symlinks in `@` with their target as content), sorted.
pub fn snapshot(root: &Path) -> Vec<(String, Vec<u8>)> {
    let mut out = Vec::new();
    walk_tree(root, |rel, p, m| {
        if m.is_dir() {
            out.push((format!("{rel}/"), Vec::new()));
        } else if m.file_type().is_symlink() {
            let t = std::fs::read_link(p)
                .map(|t| t.display().to_string())
                .unwrap_or_default();
            out.push((format!("{rel}@"), t.into_bytes()));
        } else {
            out.push((rel.to_string(), std::fs::read(p).unwrap_or_default()));
        }
    });
    out.sort();
    out
}

/// Every entry under `root` with its type, mode and content (and a file's link count):
/// what "unchanged" means for recovery, sorted.
pub fn tree(root: &Path) -> Vec<String> {
    use std::os::unix::fs::MetadataExt;
    let mut out = Vec::new();
    walk_tree(root, |rel, p, m| {
        let mode = m.permissions().mode() & 0o7777;
        if m.is_dir() {
            out.push(format!("{rel} dir {mode:o}"));
        } else if m.file_type().is_symlink() {
            out.push(format!("{rel} symlink {:?}", std::fs::read_link(p).ok()));
        } else {
            let content = std::fs::read(p).unwrap_or_default();
            out.push(format!(
                "{rel} file {mode:o} nlink={} {:?}",
                m.nlink(),
                String::from_utf8_lossy(&content)
            ));
        }
    });
    out.sort();
    out
}

/// The path of every entry under `root`, relative to it, sorted.
pub fn tree_names(root: &Path) -> Vec<String> {
    let mut out = Vec::new();
    walk_tree(root, |rel, _, _| out.push(rel.to_string()));
    out.sort();
    out
}

/// The names of `path`'s extended attributes (`llistxattr`: a symlink's own), in the
/// kernel's order.
pub fn xattr_names(path: &Path) -> Vec<Vec<u8>> {
    use std::os::unix::ffi::OsStrExt;
    let c = std::ffi::CString::new(path.as_os_str().as_bytes()).expect("path");
    let mut names = vec![0u8; 4096];
    // SAFETY: `c` is a NUL-terminated path; llistxattr writes at most names.len() bytes
    // into the buffer we own.
    let n = unsafe { libc::llistxattr(c.as_ptr(), names.as_mut_ptr().cast(), names.len()) };
    assert!(n >= 0, "llistxattr {}", path.display());
    names[..n as usize]
        .split(|&b| b == 0)
        .filter(|n| !n.is_empty())
        .map(<[u8]>::to_vec)
        .collect()
}

/// `path`'s extended attributes (a symlink's own), name and value, sorted by name.
pub fn xattrs(path: &Path) -> Vec<(String, Vec<u8>)> {
    use std::os::unix::ffi::OsStrExt;
    let c = std::ffi::CString::new(path.as_os_str().as_bytes()).expect("path");
    let mut out = Vec::new();
    for name in xattr_names(path) {
        let cname = std::ffi::CString::new(name.clone()).expect("name");
        let mut value = vec![0u8; 4096];
        // SAFETY: lgetxattr writes at most value.len() bytes into the buffer we own.
        let len = unsafe {
            libc::lgetxattr(
                c.as_ptr(),
                cname.as_ptr(),
                value.as_mut_ptr().cast(),
                value.len(),
            )
        };
        assert!(len >= 0, "lgetxattr {}", path.display());
        value.truncate(len as usize);
        out.push((String::from_utf8_lossy(&name).into_owned(), value));
    }
    out.sort();
    out
}

/// Whether the other end of `s` has closed the connection (`POLLHUP`/`POLLRDHUP`), without
/// reading what it left unread.
pub fn peer_closed(s: &StdUnixStream) -> bool {
    use std::os::fd::AsRawFd;
    let mut p = libc::pollfd {
        fd: s.as_raw_fd(),
        events: libc::POLLRDHUP,
        revents: 0,
    };
    // SAFETY: one valid pollfd, for a socket `s` keeps open; a zero timeout.
    let n = unsafe { libc::poll(&mut p, 1, 0) };
    assert!(n >= 0, "poll: {}", std::io::Error::last_os_error());
    p.revents & (libc::POLLHUP | libc::POLLRDHUP) != 0
}

/// A raw newline-delimited JSON-RPC connection, for what rmcp's client will not send.
pub struct Raw {
    pub stream: StdUnixStream,
    reader: BufReader<StdUnixStream>,
}

impl Raw {
    pub fn connect(socket: &Path) -> Raw {
        let stream = StdUnixStream::connect(socket).expect("connect");
        stream
            .set_read_timeout(Some(Duration::from_secs(30)))
            .expect("timeout");
        let reader = BufReader::new(stream.try_clone().expect("clone"));
        Raw { stream, reader }
    }

    pub fn send_bytes(&mut self, b: &[u8]) {
        self.stream.write_all(b).expect("write");
    }

    pub fn send(&mut self, v: &Value) {
        let mut line = v.to_string().into_bytes();
        line.push(b'\n');
        self.send_bytes(&line);
    }

    /// The next message, or None if nothing arrives within `timeout`.
    pub fn recv_within(&mut self, timeout: Duration) -> Option<Value> {
        self.stream
            .set_read_timeout(Some(timeout))
            .expect("timeout");
        let mut line = String::new();
        match self.reader.read_line(&mut line) {
            Ok(0) => None,
            Ok(_) => Some(
                serde_json::from_str(&line).unwrap_or_else(|e| panic!("bad line {line:?}: {e}")),
            ),
            Err(_) => None,
        }
    }

    pub fn recv(&mut self) -> Value {
        self.recv_within(Duration::from_secs(30))
            .expect("a message within 30s")
    }

    /// The response to request `id`, skipping notifications.
    pub fn response(&mut self, id: i64) -> Value {
        loop {
            let m = self.recv();
            if m["id"] == json!(id) {
                return m;
            }
        }
    }

    pub fn initialize(&mut self) {
        self.send(
            &json!({"jsonrpc": "2.0", "id": 0, "method": "initialize", "params": {
            "protocolVersion": "2025-11-25", "capabilities": {},
            "clientInfo": {"name": "raw-test", "version": "0"}}}),
        );
        let r = self.response(0);
        assert!(r["result"]["serverInfo"].is_object(), "initialize: {r}");
        self.send(&json!({"jsonrpc": "2.0", "method": "notifications/initialized"}));
    }

    pub fn call(&mut self, id: i64, tool: &str, a: Value) {
        self.send(&json!({"jsonrpc": "2.0", "id": id, "method": "tools/call",
            "params": {"name": tool, "arguments": a}}));
    }
}

/// Fails the test with a clear message unless running as root.
pub fn require_root() {
    require_root_for("it runs the daemon as another user");
}

/// Fails the test unless running as root, saying `why` the test needs it.
pub fn require_root_for(why: &str) {
    // SAFETY: geteuid has no preconditions.
    let euid = unsafe { libc::geteuid() };
    assert_eq!(
        euid, 0,
        "this test needs root ({why}); run the suite as root"
    );
}

/// Polls `done` until it holds, for at most 10 s; fails naming `what` otherwise.
pub async fn wait_until(what: &str, done: impl FnMut() -> bool) {
    wait_until_within(what, Duration::from_secs(10), done).await;
}

/// Polls `done` until it holds, for at most `within` (a generous deadline, not a timing
/// assertion); fails naming `what` otherwise.
pub async fn wait_until_within(what: &str, within: Duration, mut done: impl FnMut() -> bool) {
    let deadline = Instant::now() + within;
    while !done() {
        assert!(Instant::now() < deadline, "waited {within:?} for {what}");
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

/// [`wait_until_within`] for a thread outside the async runtime.
pub fn wait_for(what: &str, within: Duration, mut done: impl FnMut() -> bool) {
    let deadline = Instant::now() + within;
    while !done() {
        assert!(Instant::now() < deadline, "waited {within:?} for {what}");
        std::thread::sleep(Duration::from_millis(20));
    }
}

/// Waits until some process's command line contains `needle`.
pub async fn wait_for_process(needle: &str) {
    wait_until(&format!("a process running {needle:?}"), || {
        !processes_with(needle).is_empty()
    })
    .await;
}

/// Waits until a process whose whole command line is `cmd` (arguments joined by spaces)
/// runs: unlike `wait_for_process`, a shell whose script merely mentions `cmd` does not count.
pub async fn wait_for_exact(cmd: &str) {
    wait_until(&format!("a process running exactly {cmd:?}"), || {
        command_lines().any(|(_, c)| c == cmd)
    })
    .await;
}

/// Waits until no process's command line contains `needle`.
pub async fn wait_no_process(needle: &str) {
    wait_until(&format!("every process running {needle:?} to end"), || {
        processes_with(needle).is_empty()
    })
    .await;
}

/// Waits until the audit holds an event `kind` of `tool`.
pub async fn wait_for_event(c: &Client, tool: &str, kind: &str) {
    let deadline = Instant::now() + Duration::from_secs(10);
    loop {
        let events = audit(c).await;
        if events
            .iter()
            .any(|e| e["tool"] == tool && e["kind"] == kind)
        {
            return;
        }
        let mine: Vec<&Value> = events.iter().filter(|e| e["tool"] == tool).collect();
        assert!(
            Instant::now() < deadline,
            "no {kind} event of {tool} within 10 s: {mine:#?}"
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}
