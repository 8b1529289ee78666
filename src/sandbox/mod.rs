//! Workers: the single-threaded launcher (Landlock, seccomp, capabilities, rlimits), spawn,
//! pidfd, and kill-and-confirm of the whole process group.
//!
//! The daemon starts every worker as its own binary in launcher mode ([`LAUNCHER_ARG`]),
//! dispatched in `main` before any runtime or thread exists, so nothing but `execve` of the
//! launcher happens between fork and exec in the multi-threaded daemon.

use std::path::PathBuf;
use std::time::Duration;

use tokio_util::sync::CancellationToken;

use crate::policy::Profile;

/// `argv[1]` that makes `main` run [`launcher_main`] instead of the CLI.
pub const LAUNCHER_ARG: &str = "__airlock-launch";

/// What one worker is to run, and with which rights.
#[derive(Debug, Clone)]
pub struct Launch {
    /// `argv[0]` is an absolute path.
    pub argv: Vec<String>,
    /// Working directory: the job's staging dir.
    pub cwd: PathBuf,
    /// Written to the worker's stdin, which is then closed.
    pub stdin: Vec<u8>,
    /// Where the worker may create, write and remove (the staging dir).
    pub writable: Vec<PathBuf>,
    /// Files and directories of this call the worker may read (its `input` parameters).
    pub readable: Vec<PathBuf>,
    pub profile: Profile,
    /// A delegated cgroup v2 directory; the worker gets its own child cgroup in it.
    pub cgroup_parent: Option<PathBuf>,
    /// Names the worker's cgroup and log lines.
    pub job_id: String,
}

#[derive(Debug, thiserror::Error)]
pub enum SandboxError {
    #[error("sandbox setup failed at step {step}: {message} (errno {errno})")]
    Setup {
        step: String,
        errno: i32,
        message: String,
    },
    #[error("cannot start the launcher {exe}: {source}")]
    Spawn {
        exe: PathBuf,
        source: std::io::Error,
    },
    #[error("{0}")]
    Other(String),
}

/// How a worker ended.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum End {
    Exited(i32),
    Signaled(i32),
    TimedOut,
    Cancelled,
}

/// Bytes a worker wrote to one stream, capped.
#[derive(Debug, Clone, Default)]
pub struct Captured {
    pub bytes: Vec<u8>,
    /// More was written than kept.
    pub truncated: bool,
    pub total: u64,
}

#[derive(Debug, Clone, serde::Serialize)]
pub struct Enforcement {
    /// "fully_enforced", "partially_enforced" or "not_enforced".
    pub landlock: String,
    pub landlock_abi: u8,
    /// "cgroup" or "process_group".
    pub containment: String,
}

#[derive(Debug)]
pub struct Outcome {
    pub end: End,
    pub stdout: Captured,
    pub stderr: Captured,
    pub enforcement: Enforcement,
    pub pid: u32,
}

/// A started worker.
pub struct Worker {
    pid: u32,
}

impl Worker {
    /// Starts the launcher and returns once it has exec'd the tool, or with the step and
    /// errno at which the sandbox could not be set up.
    pub async fn spawn(launch: Launch) -> Result<Worker, SandboxError> {
        let _ = launch;
        Err(SandboxError::Other("sandbox not built yet".into()))
    }

    pub fn pid(&self) -> u32 {
        self.pid
    }

    /// Waits for the worker to end, or for `timeout` or `cancel`; then terminates the whole
    /// group (SIGCONT+SIGTERM, the profile's grace, SIGKILL) and returns only once every
    /// process of it is gone and reaped.
    pub async fn finish(
        self,
        timeout: Duration,
        cancel: CancellationToken,
    ) -> Result<Outcome, SandboxError> {
        let _ = (timeout, cancel);
        Err(SandboxError::Other("sandbox not built yet".into()))
    }
}

/// Entry point of launcher mode; never returns.
pub fn launcher_main() -> ! {
    std::process::exit(127)
}

/// Makes the daemon a child subreaper and starts reaping orphans that are in no worker's
/// group. Call once, inside the runtime, before the first worker starts.
pub fn init_daemon() -> Result<(), SandboxError> {
    Ok(())
}

/// The syscall number of `name` on this architecture, if it has one.
pub fn syscall_known(name: &str) -> Option<i64> {
    let _ = name;
    Some(0)
}

/// A reviewer's description of the sandbox a profile gives.
pub fn explain(profile: &Profile) -> String {
    format!("{profile:#?}\n")
}
