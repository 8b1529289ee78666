//! The daemon's side of the sandbox: [`Sandbox`] (what every worker shares), [`Worker`] (one
//! worker, from spawn to confirmed-gone), the spawner thread, the process-group registry and
//! orphan reaper, cgroups, uid leases, leftovers of a dead daemon, progress reports, and the
//! seccomp programs compiled at policy load.
//!
//! Life of a worker:
//! 1. [`Worker::spawn`] takes the profile's seccomp programs ([`Filters`]: compiled once per
//!    profile, at policy load), builds the spec, creates the worker's cgroup if one is
//!    delegated, and sends the request to the spawner process itself ([`spawner`]: async
//!    I/O on its socket, from the call's task): the launcher channel, the three stream pipes
//!    and the progress pipe (if asked for), the spec written on the channel alongside; the
//!    spawner has the profile's template read the spec, prepare the plan and create the
//!    worker's leader (`CLONE_PARENT`: the daemon's child) in a new process group, and sends
//!    its pidfd back once the leader has exec'd, which the request registers as a live leader.
//! 2. The launcher (the pre-exec child, [`crate::sandbox::child`]) sets itself up step by step
//!    on the prepared plan and reports `ok` (or `{step, errno, message}`, which becomes
//!    [`SandboxError::Setup`]) before `execve`. `spawn` returns once it has read the channel
//!    to EOF.
//! 3. [`Worker::finish`] feeds stdin, drains stdout and stderr under a cap, waits for the
//!    leader's exit (pidfd) or the timeout or the cancellation, terminates and confirms the
//!    group empty, and reaps the leader last.
//!
//! The daemon calls [`Sandbox::start`] once: it becomes a child subreaper, so double-forked
//! descendants come back to it to be killed and reaped, and gets the [`Sandbox`] value that
//! holds what every worker shares (no process-wide statics but the once-per-process guard).

mod accounts;
mod cgroup;
mod explain;
mod filters;
mod group;
mod identity;
mod leftovers;
mod procfs;
mod progress;
mod reaper;
mod seccomp;
mod spawner;
mod spawner_thread;

use std::os::fd::OwnedFd;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::Duration;

use tokio::io::unix::AsyncFd;
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::unix::pipe;
use tokio_util::sync::CancellationToken;

use super::sys;
use super::wire::{self, LandlockStatus, Step};
use crate::policy::Profile;
use group::{Leaders, Pgid};

pub use cgroup::CgroupError;
pub use explain::explain;
pub use filters::Filters;
pub use identity::{Identities, IdentityError, Lease, LeaseDir, LeaseDirFault, Pool, NEEDED_CAPS};
pub use leftovers::{sweep_cgroups, Registry, RegistryError};
pub use progress::{ProgressSender, WorkerProgress, PROGRESS_FD_ENV};
pub use seccomp::SeccompError;

/// Overrides the spawner's executable (default `/proc/self/exe`, the daemon's own binary).
/// The variable's name predates the spawner and stays as documented (SECURITY.md).
pub const SPAWNER_EXE_ENV: &str = "AIRLOCK_LAUNCHER_EXE";

/// What one worker is to run, and with which rights.
#[derive(Debug)]
pub struct Launch {
    /// `argv[0]` is an absolute path.
    pub argv: Vec<String>,
    /// Variables of this call (parameters declaring `env`, a secret's way in: unlike the
    /// command line, `/proc/PID/environ` is readable only by the worker's uid and root), set
    /// after the profile's `[env]`.
    pub env: Vec<(String, String)>,
    /// Working directory: the job's staging dir.
    pub cwd: PathBuf,
    /// Written to the worker's stdin, which is then closed.
    pub stdin: Vec<u8>,
    /// Where the worker may create, write and remove (the staging dir).
    pub writable: Vec<PathBuf>,
    /// Files and directories of this call the worker may read (its `input` parameters).
    pub readable: Vec<PathBuf>,
    pub profile: std::sync::Arc<Profile>,
    /// A delegated cgroup v2 directory; the worker gets its own child cgroup in it.
    pub cgroup_parent: Option<PathBuf>,
    /// Names the worker's cgroup and log lines.
    pub job_id: String,
    /// The worker's own uid and gid, held until its group is confirmed gone, then handed
    /// back in [`Outcome::lease`] (never, if the group is not confirmed gone: the uid is
    /// retired for the run); `None`: it keeps the daemon's.
    pub identity: Option<Lease>,
    /// Where the live worker is recorded, so that a restart can kill what a dead daemon's
    /// workers left.
    pub registry: Option<Registry>,
    /// Where the worker's progress reports go; `Some` gives the worker a pipe to write them
    /// to, named by `$AIRLOCK_PROGRESS_FD` ([`progress`] has the protocol and its bounds).
    pub progress: Option<ProgressSender>,
}

#[derive(Debug, thiserror::Error)]
pub enum SandboxError {
    /// The launcher could not set up the sandbox (or `execve` the tool): not a tool failure.
    #[error("sandbox setup failed at step {step}: {message} (errno {errno})")]
    Setup {
        step: Step,
        errno: i32,
        message: String,
    },
    #[error("cannot start the launcher {exe}")]
    Spawn {
        exe: PathBuf,
        source: std::io::Error,
    },
    /// The launch request itself is unusable (checked before any fork).
    #[error("invalid launch")]
    Invalid(#[source] InvalidLaunch),
    #[error(transparent)]
    Seccomp(#[from] SeccompError),
    #[error(transparent)]
    Cgroup(#[from] CgroupError),
    /// Talking to the launcher, or waiting for the worker, failed.
    #[error("worker {pid}: cannot {what}")]
    Io {
        pid: u32,
        what: &'static str,
        source: std::io::Error,
    },
    /// `Sandbox::start` outside a tokio runtime.
    #[error("the sandbox must be started inside a tokio runtime")]
    NoRuntime,
    /// `Sandbox::start` a second time in this process.
    #[error("the sandbox is started once per process")]
    StartedTwice,
    #[error("cannot start the orphan reaper: PR_SET_CHILD_SUBREAPER")]
    Subreaper(#[source] rustix::io::Errno),
    #[error("cannot start the orphan reaper")]
    Reaper(#[source] std::io::Error),
    #[error("cannot start the spawner")]
    Spawner(#[source] std::io::Error),
    /// `finish` called on a worker already finished.
    #[error("worker {pid} is already finished")]
    AlreadyFinished { pid: u32 },
    /// The wait for a worker ended with neither an exit nor an error.
    #[error("worker {pid}: wait ended without a result")]
    NoResult { pid: u32 },
}

/// Why a launch request is unusable, before any fork.
#[derive(Debug, thiserror::Error)]
pub enum InvalidLaunch {
    #[error("empty argv")]
    EmptyArgv,
    #[error("argv[0] {0:?} is not an absolute path")]
    RelativeProgram(String),
    #[error("unencodable spec")]
    Unencodable(#[source] serde_json::Error),
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
    pub landlock: LandlockStatus,
    /// The kernel's Landlock ABI (0: none).
    pub landlock_abi: u8,
    /// "cgroup" or "process_group".
    pub containment: String,
    /// The cgroup limit files written (`memory.max`, `pids.max`); a file the delegated
    /// cgroup lacks (controller not enabled) is absent here.
    pub cgroup_limits: Vec<String>,
}

#[derive(Debug)]
pub struct Outcome {
    pub end: End,
    pub stdout: Captured,
    pub stderr: Captured,
    pub enforcement: Enforcement,
    pub pid: u32,
    /// The worker's uid lease, now that its group is confirmed gone: the caller holds it
    /// until nothing the worker owned is left (a write worker's staging dirs), then drops
    /// it, and the uid may serve another worker.
    pub lease: Option<Lease>,
}

/// A started worker. Dropping it without [`Worker::finish`] kills its whole group (confirmed
/// in the background when a runtime is available).
pub struct Worker {
    leader: Pgid,
    /// The registry the leader is in, until it is reaped.
    leaders: Arc<Leaders>,
    live: Option<Live>,
}

struct Live {
    pidfd: AsyncFd<OwnedFd>,
    stdin: Option<pipe::Sender>,
    stdin_data: Vec<u8>,
    stdout: pipe::Receiver,
    stderr: pipe::Receiver,
    output_cap: usize,
    grace: Duration,
    cgroup: Option<PathBuf>,
    /// The progress pipe's read end and where its reports go.
    progress: Option<(pipe::Receiver, ProgressSender)>,
    enforcement: Enforcement,
    /// Released (dropped) only once the group is confirmed gone.
    held: Held,
}

/// What a worker holds until its group is confirmed gone: its uid lease, then handed to the
/// caller. (Its registry record is its spawner's session's, kept until the next start.)
#[derive(Debug, Default)]
struct Held {
    lease: Option<Lease>,
}

/// How long `finish` keeps draining stdout/stderr once the group is confirmed gone (a write
/// end can only outlive it if it was passed to a process outside the group).
const DRAIN: Duration = Duration::from_secs(1);

/// How long the launcher may take to set up before `spawn` gives up on it.
const SETUP_TIMEOUT: Duration = Duration::from_secs(30);

/// The spawner's executable by default: [`SPAWNER_EXE_ENV`] if set, else the daemon's own
/// binary (`/proc/self/exe`).
pub fn default_spawner_exe() -> PathBuf {
    std::env::var_os(SPAWNER_EXE_ENV)
        .map(PathBuf::from)
        .unwrap_or_else(|| PathBuf::from("/proc/self/exe"))
}

/// Set by the first [`Sandbox::start`]: the subreaper and its orphan reaping are the
/// process's, so there is one sandbox per process.
static STARTED: AtomicBool = AtomicBool::new(false);

/// What every worker of the daemon shares, made once at start by [`Sandbox::start`] and
/// passed to [`Worker::spawn`]: the registry of live leaders (which the orphan reaper spares)
/// and the spawner thread with its spawner process. Cheap to clone.
#[derive(Debug, Clone)]
pub struct Sandbox {
    leaders: Arc<Leaders>,
    spawner: Arc<spawner_thread::SpawnerThread>,
}

impl Sandbox {
    /// Makes the daemon a child subreaper, starts the orphan reaper on the current tokio
    /// runtime, and starts the spawner (its thread now, its process from `exe` right after,
    /// so the first call does not pay for it). Call once per process, inside the runtime,
    /// before the first worker; a second call fails.
    pub fn start(exe: PathBuf) -> Result<Sandbox, SandboxError> {
        let handle = tokio::runtime::Handle::try_current().map_err(|_| SandboxError::NoRuntime)?;
        if STARTED.swap(true, Ordering::SeqCst) {
            return Err(SandboxError::StartedTwice);
        }
        rustix::process::set_child_subreaper(Some(rustix::process::getpid()))
            .map_err(SandboxError::Subreaper)?;
        let leaders = Arc::new(Leaders::default());
        reaper::start_reaper(&handle, leaders.clone()).map_err(SandboxError::Reaper)?;
        let spawner = spawner_thread::SpawnerThread::start(exe, leaders.clone(), handle)
            .map_err(SandboxError::Spawner)?;
        Ok(Sandbox {
            leaders,
            spawner: Arc::new(spawner),
        })
    }

    /// Whether `pid` is in the process group of a live worker.
    pub fn in_live_worker_group(&self, pid: i32) -> bool {
        self.leaders.in_live_worker_group(pid)
    }
}

impl Worker {
    /// Starts the launcher and returns once it has exec'd the tool, or with the step and
    /// errno at which the sandbox could not be set up. The seccomp programs come from
    /// `filters`, compiled when the policy was loaded.
    pub async fn spawn(
        sandbox: &Sandbox,
        launch: Launch,
        filters: &Filters,
    ) -> Result<Worker, SandboxError> {
        let Launch {
            argv,
            env,
            cwd,
            stdin,
            writable,
            readable,
            profile,
            cgroup_parent,
            job_id,
            identity,
            registry,
            progress,
        } = launch;
        match argv.first() {
            None => return Err(SandboxError::Invalid(InvalidLaunch::EmptyArgv)),
            Some(a) if !a.starts_with('/') => {
                return Err(SandboxError::Invalid(InvalidLaunch::RelativeProgram(
                    a.clone(),
                )))
            }
            Some(_) => {}
        }
        // A worker that keeps the daemon's uid owns what the daemon owns: seccomp then denies
        // every mode and time change too, since file permissions cannot.
        let programs = filters.get(&profile, identity.is_none())?;
        let limits = &profile.limits;
        let spec = wire::Spec {
            argv,
            cwd,
            env_kept: profile
                .env
                .keep
                .iter()
                .filter_map(|name| {
                    std::env::var_os(name).map(|v| (name.clone(), v.into_encoded_bytes()))
                })
                .collect(),
            env_set: {
                let mut set = profile.env.set.clone();
                set.extend(env);
                set
            },
            parent: rustix::process::getpid().as_raw_nonzero().get(),
            cgroup: None,
            identity: identity.as_ref().map(|l| (l.uid(), l.gid())),
            rlimits: wire::Rlimits {
                cpu_seconds: limits.cpu_seconds,
                address_space_bytes: limits.address_space_bytes,
                file_size_bytes: limits.file_size_bytes,
                open_files: limits.open_files,
                processes: limits.processes,
            },
            landlock: wire::LandlockSpec {
                abi: profile.landlock.abi,
                best_effort: profile.landlock.best_effort,
                network: profile.network,
                read: profile.landlock.read.clone(),
                exec: profile.landlock.exec.clone(),
                write: profile.landlock.write.clone(),
                writable,
                readable,
            },
        };
        // Serialized before anything is created that would need cleaning up; again with its
        // cgroup once that exists.
        let unencodable = |e| SandboxError::Invalid(InvalidLaunch::Unencodable(e));
        let mut bytes = serde_json::to_vec(&spec).map_err(unencodable)?;

        let (cgroup, cgroup_limits) = match &cgroup_parent {
            Some(parent) => {
                let (path, applied) =
                    cgroup::cgroup_create(parent, &job_id, limits.memory_bytes, limits.processes)?;
                (Some(path), applied)
            }
            None => (None, Vec::new()),
        };
        if cgroup.is_some() {
            let spec = wire::Spec {
                cgroup: cgroup.clone(),
                ..spec
            };
            bytes = match serde_json::to_vec(&spec) {
                Ok(b) => b,
                Err(e) => {
                    if let Some(path) = &cgroup {
                        cgroup::cgroup_remove(path).await;
                    }
                    return Err(unencodable(e));
                }
            };
        }
        let started = Self::start(
            sandbox,
            bytes,
            stdin,
            limits.output_bytes,
            limits.grace,
            cgroup.clone(),
            cgroup_limits,
            (identity, registry, progress),
            (programs, filters.take_forgotten()),
        )
        .await;
        if started.is_err() {
            if let Some(path) = &cgroup {
                cgroup::cgroup_remove(path).await;
            }
        }
        started
    }

    #[allow(clippy::too_many_arguments)]
    async fn start(
        sandbox: &Sandbox,
        bytes: Vec<u8>,
        stdin_data: Vec<u8>,
        output_cap: usize,
        grace: Duration,
        cgroup: Option<PathBuf>,
        cgroup_limits: Vec<String>,
        (lease, registry, progress): (Option<Lease>, Option<Registry>, Option<ProgressSender>),
        (programs, forget): (Arc<filters::Programs>, Vec<u64>),
    ) -> Result<Worker, SandboxError> {
        let exe = sandbox.spawner.exe.clone();
        let spawn_error = |source| SandboxError::Spawn {
            exe: exe.clone(),
            source,
        };
        // The progress pipe: its write end goes to the spawner with the worker's other
        // descriptors, and from there to the worker's leader only.
        let (progress_rx, progress_fd) = match &progress {
            Some(_) => {
                let (r, w) = rustix::pipe::pipe_with(rustix::pipe::PipeFlags::CLOEXEC)
                    .map_err(|e| spawn_error(e.into()))?;
                (Some(r), Some(w))
            }
            None => (None, None),
        };
        let (ours, theirs) = std::os::unix::net::UnixStream::pair().map_err(spawn_error)?;
        ours.set_nonblocking(true).map_err(spawn_error)?;
        let mut channel = tokio::net::UnixStream::from_std(ours).map_err(spawn_error)?;
        // The spawner's session is recorded before the request is sent, so before the tool
        // can fork anything a restart would have to find: a file at the first worker of a
        // spawner, nothing after.
        let record = |session| {
            if let Some(Err(e)) = registry.as_ref().map(|r| r.record_session(session)) {
                tracing::warn!(
                    "cannot record the spawner's session for the next start: {}",
                    crate::report::chain(&e)
                );
            }
        };
        // The spec goes out with the request: the template reads it (to EOF) before it
        // creates the worker. Written alongside the request, since a spec larger than the
        // socket's buffer is only drained by the template; and no longer than the request,
        // since an answer means the template read it all (or never will). A launcher that
        // died early makes the write fail; the report (or its absence) says why.
        let spawned = {
            let mut send_spec = std::pin::pin!(async {
                let _ = channel.write_all(&bytes).await;
                let _ = channel.shutdown().await;
            });
            let mut spawn = std::pin::pin!(spawner::spawn_launcher(
                &sandbox.spawner,
                &sandbox.leaders,
                programs,
                forget,
                OwnedFd::from(theirs),
                progress_fd,
                &record,
            ));
            let mut sent = false;
            loop {
                tokio::select! {
                    spawned = &mut spawn => break spawned,
                    () = &mut send_spec, if !sent => sent = true,
                }
            }
        };
        let spawned = spawned.map_err(|source| SandboxError::Spawn {
            exe: exe.clone(),
            source,
        })?;
        let leader = spawned.leader;
        let pid = leader.as_u32();
        let io = |what: &'static str| move |source| SandboxError::Io { pid, what, source };

        // From here on the worker exists: on any error, dropping it kills the group.
        let pidfd = match sys::watch_pidfd(spawned.pidfd) {
            Ok(fd) => fd,
            Err(e) => {
                // Nothing to wait with: kill the group now and leave the leader to the reaper.
                let (fd, source) = e.into_parts();
                group::kill_and_forget(&sandbox.leaders, leader, &fd);
                return Err(SandboxError::Io {
                    pid,
                    what: "watch the pidfd",
                    source,
                });
            }
        };
        let containment = if cgroup.is_some() {
            "cgroup"
        } else {
            "process_group"
        };
        let mut worker = Worker {
            leader,
            leaders: sandbox.leaders.clone(),
            live: Some(Live {
                pidfd,
                stdin: None,
                stdin_data,
                stdout: pipe_receiver(spawned.stdout).map_err(io("watch stdout"))?,
                stderr: pipe_receiver(spawned.stderr).map_err(io("watch stderr"))?,
                output_cap,
                grace,
                cgroup,
                progress: match (progress_rx, progress) {
                    (Some(r), Some(tx)) => {
                        Some((pipe_receiver(r).map_err(io("watch the progress pipe"))?, tx))
                    }
                    _ => None,
                },
                enforcement: Enforcement {
                    // Replaced by the launcher's report before the worker is returned.
                    landlock: LandlockStatus::NotEnforced,
                    landlock_abi: 0,
                    containment: containment.into(),
                    cgroup_limits,
                },
                held: Held { lease },
            }),
        };
        // Nothing to feed: the write end is closed here (the worker reads EOF), never
        // watched by the reactor.
        if let Some(live) = worker.live.as_mut().filter(|l| !l.stdin_data.is_empty()) {
            live.stdin = Some(pipe_sender(spawned.stdin).map_err(io("feed stdin"))?);
        }

        // The report back (the spec went out with the request).
        let exchange = async {
            // Room for the report at once (`ok` and the Landlock status: ~60 bytes).
            let mut report = Vec::with_capacity(REPORT_ROOM);
            channel.read_to_end(&mut report).await.map(|_| report)
        };
        let report = match tokio::time::timeout(SETUP_TIMEOUT, exchange).await {
            Ok(r) => r.map_err(io("read the launcher report"))?,
            Err(_) => {
                worker.abort().await;
                return Err(SandboxError::Setup {
                    step: Step::Launcher,
                    errno: libc::ETIMEDOUT,
                    message: format!("no report from the launcher within {SETUP_TIMEOUT:?}"),
                });
            }
        };
        match wire::verdict(&report) {
            wire::Verdict::Running {
                landlock,
                landlock_abi,
            } => {
                if let Some(live) = worker.live.as_mut() {
                    live.enforcement.landlock = landlock;
                    live.enforcement.landlock_abi = landlock_abi;
                }
                Ok(worker)
            }
            wire::Verdict::Failed {
                step,
                errno,
                message,
            } => {
                worker.abort().await;
                Err(SandboxError::Setup {
                    step,
                    errno,
                    message,
                })
            }
        }
    }

    pub fn pid(&self) -> u32 {
        self.leader.as_u32()
    }

    /// What the launcher reported enforcing (Landlock status and ABI, containment), while
    /// the worker runs.
    pub fn enforcement(&self) -> Option<&Enforcement> {
        self.live.as_ref().map(|l| &l.enforcement)
    }

    /// For a worker that failed to start.
    async fn abort(&mut self) {
        if let Some(live) = self.live.take() {
            let _ = teardown(
                &self.leaders,
                self.leader,
                &live.pidfd,
                live.cgroup.as_deref(),
            )
            .await;
        }
    }

    /// Waits for the worker to end, or for `timeout` or `cancel`; then terminates the whole
    /// group (SIGCONT+SIGTERM, the profile's grace, SIGKILL) and returns only once every
    /// process of it is gone and reaped.
    pub async fn finish(
        mut self,
        timeout: Duration,
        cancel: CancellationToken,
    ) -> Result<Outcome, SandboxError> {
        let leader = self.leader;
        let pid = leader.as_u32();
        let Some(live) = self.live.take() else {
            return Err(SandboxError::AlreadyFinished { pid });
        };
        let Live {
            pidfd,
            stdin,
            stdin_data,
            mut stdout,
            mut stderr,
            output_cap,
            grace,
            cgroup,
            progress,
            enforcement,
            held,
        } = live;
        let mut out = Captured::default();
        let mut err = Captured::default();

        let end = {
            let feed = feed(stdin, stdin_data);
            let read_out = capture(&mut stdout, output_cap, &mut out);
            let read_err = capture(&mut stderr, output_cap, &mut err);
            let control = control(
                &self.leaders,
                leader,
                &pidfd,
                timeout,
                cancel,
                grace,
                cgroup.as_deref(),
            );
            // Read while the worker runs, never waited for: dropped with this block.
            let reports = async {
                match progress {
                    Some((rx, tx)) => progress::pump(rx, tx).await,
                    None => std::future::pending().await,
                }
            };
            tokio::pin!(feed, read_out, read_err, control, reports);
            let (mut fed, mut out_done, mut err_done) = (false, false, false);
            let mut reports_done = false;
            let mut end = None;
            let far = tokio::time::Instant::now() + Duration::from_secs(86_400 * 365);
            let mut drain_until = far;
            loop {
                tokio::select! {
                    r = &mut control, if end.is_none() => {
                        end = Some(r);
                        drain_until = tokio::time::Instant::now() + DRAIN;
                    }
                    _ = &mut read_out, if !out_done => out_done = true,
                    _ = &mut read_err, if !err_done => err_done = true,
                    _ = &mut feed, if !fed => fed = true,
                    _ = &mut reports, if !reports_done => reports_done = true,
                    _ = tokio::time::sleep_until(drain_until), if end.is_some() => {
                        tracing::warn!(pid, "worker output still open after its group is gone; output may be cut");
                        break;
                    }
                }
                if end.is_some() && out_done && err_done {
                    break;
                }
            }
            end
        };
        let lease = match &end {
            // The group is confirmed gone: the uid may serve another worker once the caller
            // is done with what the worker owned.
            Some(Ok(_)) => held.lease,
            // Not confirmed: the uid is never leased again in this run, and the record stays
            // for the next start to sweep.
            _ => {
                tracing::warn!(pid, "worker group not confirmed gone; its uid is retired");
                std::mem::forget(held);
                None
            }
        };
        let end = match end {
            Some(end) => end?,
            None => return Err(SandboxError::NoResult { pid }),
        };
        Ok(Outcome {
            end,
            stdout: out,
            stderr: err,
            enforcement,
            pid,
            lease,
        })
    }
}

impl Drop for Worker {
    fn drop(&mut self) {
        let Some(live) = self.live.take() else { return };
        let (leader, leaders) = (self.leader, self.leaders.clone());
        match tokio::runtime::Handle::try_current() {
            Ok(handle) => {
                handle.spawn(async move {
                    let _ = teardown(&leaders, leader, &live.pidfd, live.cgroup.as_deref()).await;
                });
            }
            Err(_) => group::kill_and_forget(&leaders, leader, live.pidfd.get_ref()),
        }
    }
}

/// Waits for the leader's exit, the timeout or the cancellation; terminates the group, then
/// tears it down.
async fn control(
    leaders: &Leaders,
    pgid: Pgid,
    pidfd: &AsyncFd<OwnedFd>,
    timeout: Duration,
    cancel: CancellationToken,
    grace: Duration,
    cgroup: Option<&Path>,
) -> Result<End, SandboxError> {
    let pid = pgid.as_u32();
    let stopped = tokio::select! {
        biased;
        r = pidfd.readable() => {
            // Exit is final: the readiness is never cleared.
            let _ready = r.map_err(|source| SandboxError::Io { pid, what: "wait for the leader", source })?;
            None
        }
        _ = tokio::time::sleep(timeout) => Some(End::TimedOut),
        _ = cancel.cancelled() => Some(End::Cancelled),
    };
    if stopped.is_some() {
        group::terminate(leaders, pgid, pidfd.get_ref(), grace).await;
    }
    // Also after a plain exit: background children of the tool must not outlive the call.
    let exit = teardown(leaders, pgid, pidfd, cgroup).await?;
    Ok(stopped.unwrap_or(match exit {
        sys::Exit::Code(c) => End::Exited(c),
        sys::Exit::Signal(s) => End::Signaled(s),
    }))
}

/// The one teardown of every worker, whether it finished, failed to start or was dropped:
/// SIGKILL to the group until it is confirmed empty, the leader reaped last, the cgroup
/// removed.
async fn teardown(
    leaders: &Leaders,
    pgid: Pgid,
    pidfd: &AsyncFd<OwnedFd>,
    cgroup: Option<&Path>,
) -> Result<sys::Exit, SandboxError> {
    group::kill_and_confirm(leaders, pgid, pidfd.get_ref(), cgroup).await;
    let exit = reap_leader(leaders, pgid, pidfd).await;
    if let Some(path) = cgroup {
        cgroup::cgroup_remove(path).await;
    }
    exit
}

async fn reap_leader(
    leaders: &Leaders,
    pgid: Pgid,
    pidfd: &AsyncFd<OwnedFd>,
) -> Result<sys::Exit, SandboxError> {
    let pid = pgid.as_u32();
    loop {
        let mut guard = pidfd.readable().await.map_err(|source| SandboxError::Io {
            pid,
            what: "wait for the leader",
            source,
        })?;
        match group::reap_leader(leaders, pgid, pidfd.get_ref()) {
            Ok(Some(exit)) => return Ok(exit),
            Ok(None) => guard.clear_ready(),
            Err(source) => {
                return Err(SandboxError::Io {
                    pid,
                    what: "reap the leader",
                    source,
                })
            }
        }
    }
}

/// Writes `data` to the worker's stdin, then closes it. A worker that does not read its
/// input (EPIPE) is not an error of ours.
async fn feed(stdin: Option<pipe::Sender>, data: Vec<u8>) {
    if let Some(mut tx) = stdin {
        if !data.is_empty() {
            let _ = tx.write_all(&data).await;
        }
    }
}

/// Room for the launcher's report, read at once.
const REPORT_ROOM: usize = 256;

/// The read end of a pipe the daemon made for a worker (`spawner::spawn_launcher`), watched
/// by the reactor: made non-blocking with one `ioctl`, where `from_owned_fd` would `fstat` it
/// and read and set its flags (it is known to be a pipe's read end).
fn pipe_receiver(fd: OwnedFd) -> std::io::Result<pipe::Receiver> {
    rustix::io::ioctl_fionbio(&fd, true)?;
    pipe::Receiver::from_owned_fd_unchecked(fd)
}

/// The write end of a pipe the daemon made for a worker, as [`pipe_receiver`].
fn pipe_sender(fd: OwnedFd) -> std::io::Result<pipe::Sender> {
    rustix::io::ioctl_fionbio(&fd, true)?;
    pipe::Sender::from_owned_fd_unchecked(fd)
}

/// How much the first read of a worker's stream takes at most: most tools write little.
const CAPTURE_FIRST: usize = 4 * 1024;

/// How much one read takes at most once a read filled the first chunk (a pipe's default
/// capacity).
const CAPTURE_CHUNK: usize = 64 * 1024;

/// Reads `rx` to EOF, keeping the first `cap` bytes and counting the rest. Each chunk is read
/// into spare capacity, never zeroed first, and the chunk grows only for a tool that writes
/// more than the first one holds.
async fn capture(rx: &mut pipe::Receiver, cap: usize, into: &mut Captured) {
    let mut buf: Vec<u8> = Vec::with_capacity(CAPTURE_FIRST);
    loop {
        if buf.len() == buf.capacity() && buf.capacity() < CAPTURE_CHUNK {
            buf.reserve_exact(CAPTURE_CHUNK - buf.len());
        }
        buf.clear();
        match rx.read_buf(&mut buf).await {
            Ok(0) => return,
            Ok(n) => {
                into.total += n as u64;
                let room = cap.saturating_sub(into.bytes.len());
                into.bytes.extend_from_slice(&buf[..n.min(room)]);
                if n > room {
                    into.truncated = true;
                }
            }
            Err(e) if e.kind() == std::io::ErrorKind::Interrupted => {}
            Err(_) => return,
        }
    }
}
