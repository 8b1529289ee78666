//! The pre-exec child (the launcher): turns a worker's leader, just created by its profile's
//! template (a single-threaded child of the spawner process, [`crate::sandbox::spawner`]),
//! into the sandboxed worker and `execve`s the tool.
//!
//! The work is split in three ([`plan`]):
//! - what is the same for every worker of a profile runs once, in the template
//!   ([`template`]: parent death, the capability lock and the empty bounding set,
//!   no_new_privs, the profile's seccomp stack with the launcher's own calls carved out), and
//!   every worker inherits it;
//! - what only reads and builds, per call, runs in the template too, before the worker exists
//!   ([`Plan::prepare`], after Firecracker's jailer: read and validate everything first): the
//!   spec read and parsed, every path and argument made a C string, argv and envp built, the
//!   rlimits resolved, the worker's Landlock ruleset created with its rules;
//! - what changes the process runs in the worker ([`launch`], [`Plan::run`]), which shares the
//!   template's memory until `execve` (`CLONE_VM | CLONE_VFORK`, posix_spawn's way): only
//!   system calls on the prepared data, nothing allocated, nothing parsed, no lock, no
//!   unwinding, ending with the seal that puts the carved calls back as the profile decides
//!   them, so the tool's filters are exactly the profile's.
//!
//! Any failure writes one `{step, errno, message}` report ([`Step`]) to the channel and exits
//! 126; in the worker the line is rendered into a buffer on its stack ([`Line`]).
//!
//! Invariants (each checked by the plan's unit tests, over the recording fake):
//! - the steps run in the order of [`plan`], the seal last before the report and `execve`;
//! - a failing step stops the plan, and its report names that step;
//! - after a uid switch, PDEATHSIG is set again and the parent checked again (the switch
//!   cleared it), so a daemon that died in between leaves no unbounded worker;
//! - the worker is made non-dumpable before its uid switch, so nothing running as the worker's
//!   uid can read the template's memory it shares until `execve`.

mod kernel;
mod landlock;

pub(crate) use self::landlock::Resolved;
mod plan;
mod report;
#[cfg(test)]
mod tests;

use std::ffi::{c_char, CString, OsStr, OsString};
use std::os::fd::{AsRawFd, BorrowedFd, RawFd};
use std::os::unix::ffi::{OsStrExt, OsStringExt};

use rustix::process::Resource;

use self::report::{Failure, Line};
use super::wire::{Report, Spec, Step, SETUP_FAILED};

/// A failure of the template's preparation (the spec, Landlock's ruleset): rendered in full
/// in the template, which the worker then only writes.
#[derive(Debug)]
pub(super) struct Refusal {
    pub step: Step,
    pub errno: i32,
    pub message: String,
}

impl Refusal {
    fn new(step: Step, errno: i32, message: impl Into<String>) -> Self {
        Refusal {
            step,
            errno,
            message: message.into(),
        }
    }

    pub(super) fn line(&self) -> Vec<u8> {
        Report::Failed {
            step: self.step,
            errno: self.errno,
            message: self.message.clone(),
        }
        .line()
    }
}

/// The template's own steps ([`plan::template_steps`]), in the template just forked by the
/// spawner: `daemon` is the daemon's pid, `stack` the profile's filters with the launcher's
/// calls carved out. A failure names its step.
pub(crate) fn template(
    daemon: i32,
    stack: &[seccompiler::BpfProgram],
) -> Result<(), (Step, i32, String)> {
    plan::template_steps(&mut kernel::Linux { channel: None }, daemon, stack)
        .map_err(|f| (f.step, f.errno, f.to_string()))
}

/// What a worker runs: the plan the template prepared, or the report of why it could not.
pub(crate) enum Prepared {
    Plan(Box<Plan>),
    Refused(Vec<u8>),
}

/// In the template, before the worker exists: reads the spec from `channel` (to EOF: the
/// daemon wrote it and shut its side) and prepares the worker's plan, or the report of why
/// not. `progress` is the progress pipe's write end, `seal` the template's seal, `resolved`
/// what the template keeps of the profile's Landlock paths from one worker to the next.
pub(crate) fn prepare(
    channel: BorrowedFd<'_>,
    progress: Option<RawFd>,
    seal: &[seccompiler::BpfProgram],
    resolved: &mut landlock::Resolved,
) -> Prepared {
    match Plan::prepare(channel, progress, seal, resolved) {
        Ok(plan) => Prepared::Plan(Box::new(plan)),
        Err(refusal) => Prepared::Refused(refusal.line()),
    }
}

/// Runs in the worker (sharing the template's memory until `execve`): the plan over the real
/// kernel, on the channel `channel`. Never returns: it `execve`s the tool, or reports the
/// failed step and exits. Allocates nothing.
pub(crate) fn launch(prepared: &Prepared, channel: RawFd) -> ! {
    let mut k = kernel::Linux {
        channel: Some(channel),
    };
    match prepared {
        Prepared::Refused(line) => {
            let _ = kernel::Kernel::report(&mut k, line);
        }
        Prepared::Plan(plan) => {
            let failure = match plan.run(&mut k) {
                Ok(never) => match never {},
                Err(f) => f,
            };
            let mut line = Line::new();
            failure.write_line(&mut line);
            let _ = kernel::Kernel::report(&mut k, line.bytes());
        }
    }
    exit_now(SETUP_FAILED)
}

/// Reports a failure that came before the plan (the worker's process group and streams),
/// and exits. Allocates nothing.
pub(crate) fn fail_early(
    channel: RawFd,
    step: Step,
    call: &'static str,
    e: rustix::io::Errno,
) -> ! {
    let mut line = Line::new();
    Failure::call(step, call, e).write_line(&mut line);
    let _ = kernel::Kernel::report(
        &mut kernel::Linux {
            channel: Some(channel),
        },
        line.bytes(),
    );
    exit_now(SETUP_FAILED)
}

/// `_exit`: no atexit handlers, no flush of the template's stdio buffers.
fn exit_now(code: i32) -> ! {
    // SAFETY: _exit ends the process at once and touches no memory of ours.
    unsafe { libc::_exit(code) }
}

/// Everything a worker needs, parsed, checked and built in the template before the worker
/// exists: the worker only reads it.
pub(crate) struct Plan {
    /// The daemon's pid: our parent, checked after PR_SET_PDEATHSIG.
    parent: i32,
    /// The worker's cgroup's `cgroup.procs`.
    cgroup_procs: Option<CString>,
    /// Each limit, RLIMIT_NPROC resolved ([`plan::rlimits`]).
    rlimits: [(Resource, &'static str, u64); 6],
    cwd: CString,
    landlock: landlock::Prepared,
    /// The worker's own uid and gid; `None`: it keeps the daemon's.
    identity: Option<(u32, u32)>,
    /// The seal (from the template): the profile's rules for the calls the template's stack
    /// leaves to it.
    seccomp: Vec<seccompiler::BpfProgram>,
    exe: CString,
    /// The strings `argv_ptrs` and `env_ptrs` point into (kept alive with them).
    _argv: Vec<CString>,
    #[cfg_attr(not(test), allow(dead_code))]
    env: Vec<CString>,
    /// Null-terminated.
    argv_ptrs: Vec<*const c_char>,
    env_ptrs: Vec<*const c_char>,
    channel_fd: RawFd,
    /// The progress pipe's write end, and where the tool finds it (3, or 4 if the channel
    /// is 3).
    progress: Option<(RawFd, RawFd)>,
}

impl Plan {
    /// In the template: the spec read from the channel, checked and built.
    fn prepare(
        channel: BorrowedFd<'_>,
        progress: Option<RawFd>,
        seal: &[seccompiler::BpfProgram],
        resolved: &mut landlock::Resolved,
    ) -> Result<Plan, Refusal> {
        let mut bytes = Vec::with_capacity(16 * 1024);
        let mut chunk = [0u8; 16 * 1024];
        loop {
            match rustix::io::read(channel, &mut chunk) {
                Ok(0) => break,
                Ok(n) => bytes.extend_from_slice(chunk.get(..n).unwrap_or_default()),
                Err(rustix::io::Errno::INTR) => {}
                Err(e) => {
                    return Err(Refusal::new(
                        Step::Spec,
                        e.raw_os_error(),
                        format!("cannot read the spec from the daemon: {e}"),
                    ))
                }
            }
        }
        let spec: Spec = serde_json::from_slice(&bytes)
            .map_err(|e| Refusal::new(Step::Spec, libc::EINVAL, format!("unreadable spec: {e}")))?;
        let ruleset = landlock::prepare(&spec.landlock, resolved)
            .map_err(|f| Refusal::new(Step::Landlock, f.errno, f.message))?;
        let uid = rustix::process::getuid().as_raw();
        Plan::check(
            spec,
            channel.as_raw_fd(),
            progress,
            seal.to_vec(),
            ruleset,
            uid,
            kernel_tasks_of_uid,
        )
    }

    /// The checks and building of [`Plan::prepare`], on a spec already read; `channel_fd` is
    /// the channel's descriptor, which the close-fds step keeps; `uid` our real uid, and
    /// `tasks_of_uid` how many tasks a uid runs (for RLIMIT_NPROC when the worker shares it).
    fn check(
        spec: Spec,
        channel_fd: RawFd,
        progress: Option<RawFd>,
        seccomp: Vec<seccompiler::BpfProgram>,
        landlock: landlock::Prepared,
        uid: u32,
        tasks_of_uid: impl FnOnce(u32) -> u64,
    ) -> Result<Plan, Refusal> {
        let cstring = |what: &str, s: &[u8]| {
            CString::new(s).map_err(|_| {
                Refusal::new(
                    Step::Spec,
                    libc::EINVAL,
                    format!("{what} contains a NUL byte"),
                )
            })
        };
        let Some(first) = spec.argv.first() else {
            return Err(Refusal::new(Step::Spec, libc::EINVAL, "empty argv"));
        };
        if !first.starts_with('/') {
            return Err(Refusal::new(
                Step::Spec,
                libc::EINVAL,
                format!("argv[0] {first:?} is not an absolute path"),
            ));
        }
        let exe = cstring("argv[0]", first.as_bytes())?;
        let argv = spec
            .argv
            .iter()
            .map(|a| cstring("an argument", a.as_bytes()))
            .collect::<Result<Vec<_>, _>>()?;

        // The tool's environment: only `keep` (from ours) and `set`, nothing else inherited.
        let mut vars: Vec<(OsString, OsString)> = Vec::new();
        for (name, value) in &spec.env_kept {
            vars.push((OsString::from(name), OsString::from_vec(value.clone())));
        }
        for (name, value) in &spec.env_set {
            vars.retain(|(n, _)| n != OsStr::new(name));
            vars.push((OsString::from(name), OsString::from(value)));
        }
        let progress = progress.map(|fd| (fd, if channel_fd == 3 { 4 } else { 3 }));
        if let Some((_, to)) = &progress {
            vars.retain(|(n, _)| n != OsStr::new(crate::sandbox::PROGRESS_FD_ENV));
            vars.push((
                crate::sandbox::PROGRESS_FD_ENV.into(),
                to.to_string().into(),
            ));
        }
        let mut env = Vec::with_capacity(vars.len());
        for (name, value) in vars {
            if name.is_empty() || name.as_bytes().contains(&b'=') {
                return Err(Refusal::new(
                    Step::Spec,
                    libc::EINVAL,
                    format!("bad variable name {name:?}"),
                ));
            }
            let mut kv = name.into_vec();
            kv.push(b'=');
            kv.extend(value.into_vec());
            env.push(cstring("an environment variable", &kv)?);
        }

        if seccomp.iter().any(|p| p.is_empty() || p.len() > 4096) {
            return Err(Refusal::new(
                Step::Spec,
                libc::EINVAL,
                "empty or oversized seccomp program",
            ));
        }
        let cgroup_procs = match &spec.cgroup {
            Some(cgroup) => Some(cstring(
                "the cgroup path",
                cgroup.join("cgroup.procs").as_os_str().as_bytes(),
            )?),
            None => None,
        };
        let cwd = cstring("the working directory", spec.cwd.as_os_str().as_bytes())?;
        let rlimits = plan::rlimits(
            &spec.rlimits,
            spec.identity.map(|(u, _)| u),
            uid,
            tasks_of_uid,
        );
        let pointers = |strings: &[CString]| {
            let mut p: Vec<*const c_char> = strings.iter().map(|s| s.as_ptr()).collect();
            p.push(std::ptr::null());
            p
        };
        Ok(Plan {
            parent: spec.parent,
            cgroup_procs,
            rlimits,
            cwd,
            landlock,
            identity: spec.identity,
            seccomp,
            exe,
            argv_ptrs: pointers(&argv),
            env_ptrs: pointers(&env),
            _argv: argv,
            env,
            channel_fd,
            progress,
        })
    }
}

/// How many tasks (threads included, as the kernel counts them) run under real uid `uid`.
fn kernel_tasks_of_uid(uid: u32) -> u64 {
    let Ok(dir) = std::fs::read_dir("/proc") else {
        return 0;
    };
    let mut count = 0u64;
    for entry in dir.flatten() {
        let name = entry.file_name();
        if !name.as_bytes().iter().all(u8::is_ascii_digit) {
            continue;
        }
        let mut path = std::path::PathBuf::from("/proc");
        path.push(&name);
        path.push("status");
        let Ok(status) = std::fs::read_to_string(&path) else {
            continue;
        };
        let field = |key: &str| {
            status
                .lines()
                .find_map(|l| l.strip_prefix(key))
                .and_then(|v| v.split_whitespace().next().map(str::to_owned))
        };
        if field("Uid:").and_then(|v| v.parse::<u32>().ok()) == Some(uid) {
            count += field("Threads:")
                .and_then(|v| v.parse::<u64>().ok())
                .unwrap_or(1);
        }
    }
    count
}
