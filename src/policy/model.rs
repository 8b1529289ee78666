//! The validated policy: what the rest of the daemon reads. Built only by [`super::load`].

use std::collections::BTreeMap;
use std::path::PathBuf;
use std::sync::Arc;
use std::time::Duration;

pub use crate::syscalls::{Errno, Syscall};

/// Everything the policy directory declares, validated.
#[derive(Debug, Clone)]
pub struct Policy {
    pub dir: PathBuf,
    pub daemon: DaemonConfig,
    /// Shared with the tools that use them: a tool holds its profile, not its name.
    pub profiles: BTreeMap<String, Arc<Profile>>,
    pub tools: BTreeMap<String, Tool>,
    /// `[[grant]]` tables: no grant, no access.
    pub grants: Vec<super::grant::Grant>,
}

/// `[daemon]` in `airlock.toml`. Relative paths are relative to the current directory of
/// `airlock serve`, so that a checkout runs with no flags.
#[derive(Debug, Clone)]
pub struct DaemonConfig {
    pub socket: PathBuf,
    /// Octal mode of the socket file (default 0o600).
    pub socket_mode: u32,
    /// Group that owns the socket file, if any.
    pub socket_group: Option<String>,
    pub workspace: PathBuf,
    pub state_dir: PathBuf,
    /// Largest JSON-RPC message accepted, in bytes (default 4 MiB).
    pub max_message_bytes: usize,
    /// Largest number of concurrent connections (default 256).
    pub max_connections: usize,
    /// Largest number of tool calls running at once (default 64).
    pub max_concurrent_calls: usize,
    /// How many audit events the in-memory ring keeps (default 10 000).
    pub audit_ring: usize,
    /// How many bytes (serialized) the in-memory audit ring keeps (default 16 MiB).
    pub audit_ring_bytes: usize,
    /// The durable audit log (`audit_log`, default `audit.jsonl`); relative to `state_dir`.
    pub audit_log: PathBuf,
    /// The size at which the audit log is rotated (`audit_log_size`, default 64 MiB).
    pub audit_log_bytes: u64,
    /// How many rotated audit log files are kept (`audit_log_keep`, default 8).
    pub audit_log_keep: usize,
    /// Published outputs up to this size get their SHA-256 in the `commit` event; larger
    /// ones only their size and identity (`audit_hash_limit`, default 64 MiB).
    pub audit_hash_limit: u64,
    /// Connections one uid may hold at once (default 128, half of `max_connections`).
    pub max_connections_per_uid: usize,
    /// Requests one connection may have in flight (default 32); the connection's next
    /// request is read only once one of them is answered.
    pub max_requests_per_connection: usize,
    /// Outgoing bytes queued for one connection before it is dropped (default 8 MiB).
    pub max_queued_bytes: usize,
    /// A connection that has not sent `initialize` by then is closed (default 10 s).
    pub handshake_timeout: Duration,
    /// A connection with no request in flight and no complete message for this long is
    /// closed (default 300 s).
    pub idle_timeout: Duration,
    /// A reply not written to the socket within this time drops the connection (default 10 s).
    pub write_timeout: Duration,
    /// After SIGTERM, how long the daemon waits for calls and connections to end before it
    /// exits anyway (default 10 s; recovery handles whatever was left mid-way).
    pub shutdown_timeout: Duration,
    /// A delegated cgroup v2 directory; each worker gets a child cgroup in it.
    pub cgroup: Option<PathBuf>,
    /// Which uid workers run as (`worker_user`).
    pub worker_user: WorkerUser,
    /// The uids (and gids, same numbers) reserved for workers, inclusive (`worker_uids`).
    pub worker_uids: (u32, u32),
    /// Where worker uid leases are, one `flock`ed file per uid (`worker_uid_lock_dir`,
    /// absolute; default [`DEFAULT_WORKER_UID_LOCK_DIR`]). Every daemon sharing a range must
    /// share it.
    pub worker_uid_lock_dir: PathBuf,
    /// Live sessions one uid may own (default 64).
    pub max_sessions_per_principal: usize,
    /// The state of one session, as compact JSON (default 1 MiB).
    pub max_session_state_bytes: u64,
    /// The states of one uid's live sessions together (default 16 MiB).
    pub max_state_bytes_per_principal: u64,
    /// Call slots (of `max_concurrent_calls`) one uid may hold at once (default a quarter
    /// of `max_concurrent_calls`, at least 1).
    pub max_calls_per_principal: usize,
    /// Calls of one uid that may wait for a slot; one more is refused at once with `BUSY`
    /// (default 256).
    pub max_queued_per_principal: usize,
    /// How long a job's record (its status, and a keyed call's outcome for replay) is kept
    /// (`idempotency_ttl`, default 24 h).
    pub idempotency_ttl: Duration,
    /// Job records one uid keeps at most; past it the oldest go first (`idempotency_keys`,
    /// default 10,000).
    pub idempotency_keys: usize,
    /// The most bytes of backups a session's latest commit keeps for `job_undo` (`undo_bytes`,
    /// default 256 MiB; 0: no commit is undoable).
    pub undo_bytes: u64,
}

/// `worker_user` in `[daemon]`: whether each worker gets a uid of its own.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum WorkerUser {
    /// `separate` when the daemon holds what it needs (root, or the capabilities listed in
    /// SECURITY.md), `daemon` otherwise (logged at startup).
    Auto,
    /// Every worker runs as a uid and gid of its own from `worker_uids`: file permissions
    /// protect everything the worker does not own. Startup fails if the daemon cannot.
    Separate,
    /// Workers keep the daemon's uid; seccomp forbids every metadata change instead.
    Daemon,
}

impl WorkerUser {
    pub fn as_str(self) -> &'static str {
        match self {
            WorkerUser::Auto => "auto",
            WorkerUser::Separate => "separate",
            WorkerUser::Daemon => "daemon",
        }
    }
}

/// The default `worker_uids`: 500 ids no distribution or systemd allocates by default.
pub const DEFAULT_WORKER_UIDS: (u32, u32) = (60600, 61099);

/// The default `worker_uid_lock_dir`: beneath the socket's `/run/airlock` (root-owned, made by
/// airlock.socket), created root-owned by airlock.tmpfiles.
pub const DEFAULT_WORKER_UID_LOCK_DIR: &str = "/run/airlock/uids";

impl Default for DaemonConfig {
    fn default() -> Self {
        DaemonConfig {
            socket: PathBuf::from("airlock.sock"),
            socket_mode: 0o600,
            socket_group: None,
            workspace: PathBuf::from("workspace"),
            state_dir: PathBuf::from("state"),
            max_message_bytes: 4 * 1024 * 1024,
            max_connections: 256,
            max_concurrent_calls: 64,
            audit_ring: 10_000,
            audit_ring_bytes: 16 << 20,
            audit_log: PathBuf::from("audit.jsonl"),
            audit_log_bytes: 64 << 20,
            audit_log_keep: 8,
            audit_hash_limit: 64 << 20,
            max_connections_per_uid: 128,
            max_requests_per_connection: 32,
            max_queued_bytes: 8 << 20,
            handshake_timeout: Duration::from_secs(10),
            idle_timeout: Duration::from_secs(300),
            write_timeout: Duration::from_secs(10),
            shutdown_timeout: Duration::from_secs(10),
            cgroup: None,
            worker_user: WorkerUser::Auto,
            worker_uids: DEFAULT_WORKER_UIDS,
            worker_uid_lock_dir: PathBuf::from(DEFAULT_WORKER_UID_LOCK_DIR),
            max_sessions_per_principal: 64,
            max_session_state_bytes: 1 << 20,
            max_state_bytes_per_principal: 16 << 20,
            max_calls_per_principal: default_calls_per_principal(64),
            max_queued_per_principal: 256,
            idempotency_ttl: Duration::from_secs(24 * 3600),
            idempotency_keys: 10_000,
            undo_bytes: 256 << 20,
        }
    }
}

/// `max_calls_per_principal` when airlock.toml does not set it: a quarter of the slots,
/// so that four principals at their share still leave none waiting on another.
pub fn default_calls_per_principal(max_concurrent_calls: usize) -> usize {
    (max_concurrent_calls / 4).max(1)
}

impl DaemonConfig {
    /// Where the audit log is: `audit_log`, beneath `state_dir` when relative.
    pub fn audit_log_path(&self) -> PathBuf {
        self.state_dir.join(&self.audit_log)
    }
}

/// A sandbox profile, `profiles/NAME.toml`.
#[derive(Debug, Clone, PartialEq)]
pub struct Profile {
    pub name: String,
    pub landlock: LandlockProfile,
    pub seccomp: SeccompProfile,
    /// `[network] allow`: sockets of every family (else only `AF_UNIX`, and only when
    /// `unix_sockets` lists some).
    pub network: bool,
    /// `[network] unix_sockets`: the pathname Unix sockets the worker may reach. Empty: no
    /// `socket(AF_UNIX)` at all (socketpair still works). Landlock (ABI <= 7) does not mediate
    /// `connect()` to a pathname socket, so a non-empty list lets the worker reach any socket
    /// file permissions allow, not only these.
    pub unix_sockets: Vec<PathBuf>,
    pub limits: Limits,
    pub env: EnvProfile,
}

#[derive(Debug, Clone, PartialEq)]
pub struct LandlockProfile {
    /// The Landlock ABI the profile needs fully enforced (default 6: signal and abstract
    /// socket scoping).
    pub abi: u8,
    /// Run with whatever the kernel enforces instead of refusing (default false).
    pub best_effort: bool,
    /// Paths the worker may read (files and directories, recursively).
    pub read: Vec<PathBuf>,
    /// Paths the worker may read and execute from.
    pub exec: Vec<PathBuf>,
    /// Paths outside the staging dir the worker may write (device files such as /dev/null).
    pub write: Vec<PathBuf>,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, serde::Deserialize, serde::Serialize)]
#[serde(rename_all = "lowercase")]
pub enum SeccompMode {
    /// Allow every syscall but the listed ones, which fail with `errno`.
    Deny,
    /// Fail every syscall with `errno` but the listed ones.
    Allow,
}

#[derive(Debug, Clone, PartialEq)]
pub struct SeccompProfile {
    pub mode: SeccompMode,
    /// The listed syscalls (named as in the kernel's tables: `io_uring_setup`, `ptrace`,
    /// ...), resolved to this architecture's numbers at load.
    pub syscalls: Vec<Syscall>,
    /// The errno a filtered syscall returns (default EPERM), resolved at load.
    pub errno: Errno,
}

#[derive(Debug, Clone, PartialEq)]
pub struct Limits {
    pub cpu_seconds: u64,
    pub address_space_bytes: u64,
    pub file_size_bytes: u64,
    pub open_files: u64,
    /// How many processes the worker may run at once, beyond those its uid already has.
    pub processes: u64,
    /// memory.max of the worker's cgroup, when a cgroup is delegated.
    pub memory_bytes: u64,
    /// Cap on the stdout and on the stderr kept from one call.
    pub output_bytes: usize,
    /// Time between SIGTERM and SIGKILL.
    pub grace: Duration,
    /// Most bytes (apparent size of regular files) a write call may leave in its staging
    /// dir; checked after the worker exits, the call fails if over (`[limits] staging_size`).
    pub staging_bytes: u64,
    /// Most entries (files, directories, links) a write call may leave in its staging dir
    /// (`[limits] staging_files`).
    pub staging_files: u64,
}

impl Default for Limits {
    fn default() -> Self {
        Limits {
            cpu_seconds: 60,
            address_space_bytes: 4 << 30,
            file_size_bytes: 1 << 30,
            open_files: 256,
            processes: 64,
            memory_bytes: 1 << 30,
            output_bytes: 1 << 20,
            grace: Duration::from_secs(2),
            staging_bytes: 2 << 30,
            staging_files: 100_000,
        }
    }
}

#[derive(Debug, Clone, PartialEq, Default)]
pub struct EnvProfile {
    /// Variables copied from the daemon's environment when present.
    pub keep: Vec<String>,
    /// Variables set to fixed values (override `keep`).
    pub set: BTreeMap<String, String>,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, serde::Deserialize, serde::Serialize)]
#[serde(rename_all = "lowercase")]
pub enum Capability {
    Read,
    Write,
}

impl Capability {
    pub fn as_str(self) -> &'static str {
        match self {
            Capability::Read => "read",
            Capability::Write => "write",
        }
    }
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, serde::Deserialize, serde::Serialize)]
#[serde(rename_all = "lowercase")]
pub enum Protocol {
    /// Placeholders substituted into argv; stdout is the text result; exit 0 is success.
    Argv,
    /// One JSON request on stdin, one JSON response on stdout.
    Json,
    /// A Python callable (`entry`), run by airlock's runner: the `json` protocol's request
    /// on stdin, the function's return value turned into its response.
    Python,
}

impl Protocol {
    pub fn as_str(self) -> &'static str {
        match self {
            Protocol::Argv => "argv",
            Protocol::Json => "json",
            Protocol::Python => "python",
        }
    }
}

/// Where a built-in tool's work happens: in the daemon, not in a worker.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Builtin {
    SessionCreate,
    SessionDestroy,
    SessionGet,
    SessionList,
    /// A write call's job record (`job_get`).
    JobGet,
    /// Undo a session's latest commit (`job_undo`).
    JobUndo,
}

#[derive(Debug, Clone, PartialEq)]
pub struct Tool {
    pub name: String,
    /// A short human-readable name for `tools/list` (`title` in the tool file).
    pub title: Option<String>,
    pub description: String,
    pub capability: Capability,
    /// Where the work happens: in the daemon or in a sandboxed worker.
    pub kind: ToolKind,
    pub params: BTreeMap<String, Param>,
    pub annotations: Annotations,
    /// The file it was declared in (None for built-ins).
    pub source: Option<PathBuf>,
}

/// A tool is exactly one of these: a built-in has no command, an external tool no built-in.
#[derive(Debug, Clone, PartialEq)]
pub enum ToolKind {
    Builtin(Builtin),
    External(ExternalTool),
}

#[derive(Debug, Clone, PartialEq)]
pub struct ExternalTool {
    /// The `command` template, parsed at load.
    pub command: super::Command,
    pub protocol: Protocol,
    pub timeout: Duration,
    /// The profile, resolved at load: a tool cannot name a profile the policy lacks, and a
    /// call needs no lookup by name.
    pub profile: Arc<Profile>,
    /// A `protocol = "python"` tool's callable; `command` is then airlock's runner.
    pub python: Option<PythonEntry>,
}

/// What a `protocol = "python"` tool runs: `entry` imported and called by airlock's runner
/// under `interpreter`, with `path` put first on `sys.path`.
#[derive(Debug, Clone, PartialEq)]
pub struct PythonEntry {
    /// `package.module:function`, checked at load (dotted identifiers, one colon).
    pub entry: String,
    /// The interpreter (`python`, absolute; default [`DEFAULT_PYTHON`]).
    pub interpreter: PathBuf,
    /// `python_path`, absolute (a relative entry is resolved against the policy directory
    /// at load): where the module is found. The worker may read these, never write them.
    pub path: Vec<PathBuf>,
}

/// The interpreter of a `protocol = "python"` tool that names none.
pub const DEFAULT_PYTHON: &str = "/usr/bin/python3";

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Annotations {
    pub read_only: bool,
    pub destructive: bool,
    pub idempotent: bool,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, serde::Deserialize, serde::Serialize)]
#[serde(rename_all = "lowercase")]
pub enum ParamType {
    String,
    Integer,
    Number,
    Boolean,
    Object,
    Array,
}

impl ParamType {
    pub fn as_str(self) -> &'static str {
        match self {
            ParamType::String => "string",
            ParamType::Integer => "integer",
            ParamType::Number => "number",
            ParamType::Boolean => "boolean",
            ParamType::Object => "object",
            ParamType::Array => "array",
        }
    }
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, serde::Deserialize, serde::Serialize)]
#[serde(rename_all = "lowercase")]
pub enum PathRole {
    /// Resolved beneath the workspace; the worker may read it.
    Input,
    /// Rewritten to a staged file; published into the workspace on success.
    Output,
    /// Rewritten to a staged private copy of the current target (nothing there when the
    /// target does not exist): a changed copy is published, an unchanged one publishes
    /// nothing, a copy the worker removed deletes the target. Anyone else's change to the
    /// target meanwhile is a conflict.
    #[serde(rename = "inout")]
    InOut,
}

impl PathRole {
    /// Whether the worker writes this path (through staging): an output or an in-out.
    pub fn writes(self) -> bool {
        matches!(self, PathRole::Output | PathRole::InOut)
    }

    pub fn as_str(self) -> &'static str {
        match self {
            PathRole::Input => "input",
            PathRole::Output => "output",
            PathRole::InOut => "inout",
        }
    }
}

/// What an output parameter publishes: `kind = "file"` (the default) or `kind =
/// "directory"`. An enum, not a flag: in-place edits and deletions are further kinds.
#[derive(
    Debug, Clone, Copy, Default, PartialEq, Eq, Hash, serde::Deserialize, serde::Serialize,
)]
#[serde(rename_all = "lowercase")]
pub enum OutputKind {
    /// One regular file with one link.
    #[default]
    File,
    /// A directory tree of regular files, directories and symlinks staying inside it,
    /// published by one rename.
    Directory,
}

impl OutputKind {
    pub fn as_str(self) -> &'static str {
        match self {
            OutputKind::File => "file",
            OutputKind::Directory => "directory",
        }
    }

    pub fn is_file(&self) -> bool {
        *self == OutputKind::File
    }
}

#[derive(Debug, Clone, PartialEq)]
pub struct Param {
    pub ty: ParamType,
    pub description: String,
    pub required: bool,
    pub default: Option<serde_json::Value>,
    pub path: Option<PathRole>,
    /// For an output: the mode the daemon gives the published file (default 0o644). Never
    /// setuid, setgid, sticky, group- or other-writable: the loader refuses those.
    pub mode: Option<u32>,
    /// For an output: what it publishes (`kind = "directory"`; default a file).
    pub kind: OutputKind,
    /// `secret = true`: the value is redacted in audit events, log lines and error messages
    /// (the worker still receives it). The loader refuses its placeholder in `command`.
    pub secret: bool,
    /// `env = "NAME"`: the value also reaches the worker as environment variable `NAME` (the
    /// way in for a secret: `/proc/PID/environ` is readable only by the worker's uid and
    /// root, its command line by everyone). An absent optional argument leaves it unset.
    pub env: Option<String>,
}

impl Param {
    /// An optional parameter of type `ty` with nothing else declared: the base that the
    /// built-in tools and tests fill in with struct-update syntax.
    pub fn of(ty: ParamType) -> Param {
        Param {
            ty,
            description: String::new(),
            required: false,
            default: None,
            path: None,
            mode: None,
            kind: OutputKind::File,
            secret: false,
            env: None,
        }
    }
}

/// The mode of a published output whose parameter declares none.
pub const DEFAULT_OUTPUT_MODE: u32 = 0o644;
/// Bits a declared output mode may not have: setuid, setgid, sticky, group and other write.
pub const FORBIDDEN_OUTPUT_BITS: u32 = 0o7022;
