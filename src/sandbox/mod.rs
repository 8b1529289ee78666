//! Workers, contained: Landlock, seccomp, capabilities, rlimits, a uid of their own, a cgroup
//! or process group that is killed and confirmed gone.
//!
//! Laid out by the process each part runs in:
//! - [`daemon`]: the daemon's side ([`Sandbox`], [`Worker`], the spawner thread, the group
//!   registry and orphan reaper, cgroups, uid leases, leftovers, progress, seccomp compile);
//! - [`spawner`]: the spawner process, the daemon's own binary in spawner mode
//!   ([`SPAWNER_ARG`]), started once and dispatched in `main` before any runtime or thread
//!   exists, so every fork happens in a single-threaded process, and no worker costs an
//!   `execve` of the daemon; it keeps a template per profile, which carries the profile's
//!   seccomp stack, and every worker is forked from its template;
//! - [`child`]: the launcher: its template steps run once in each template, the rest in the
//!   worker's leader just forked from it, which sets up the sandbox step by step and
//!   `execve`s the tool;
//! - [`wire`]: both protocols between them (daemon <-> spawner requests, daemon -> child spec
//!   and child -> daemon reports);
//! - `sys`: the raw system calls the three share.

mod child;
mod daemon;
mod spawner;
mod sys;
mod wire;

pub use daemon::{
    default_spawner_exe, explain, sweep_cgroups, Captured, CgroupError, End, Enforcement, Filters,
    Identities, IdentityError, Launch, Lease, LeaseDir, LeaseDirFault, Outcome, Pool,
    ProgressSender, Registry, RegistryError, Sandbox, SandboxError, SeccompError, Worker,
    WorkerProgress, NEEDED_CAPS, PROGRESS_FD_ENV, SPAWNER_EXE_ENV,
};
pub use spawner::{spawner_main, SPAWNER_ARG};

/// The spawner's executable by default, under its name from before the spawner existed
/// (callers outside the sandbox still use it).
pub use daemon::default_spawner_exe as default_launcher_exe;
/// [`SPAWNER_EXE_ENV`] under its name from before the spawner existed.
pub use daemon::SPAWNER_EXE_ENV as LAUNCHER_EXE_ENV;
pub use wire::{LandlockStatus, Step};
