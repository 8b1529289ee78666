//! The pre-exec child (the launcher): runs in a worker's leader just forked from its
//! profile's template (a single-threaded child of the spawner process,
//! [`crate::sandbox::spawner`]), turns it into the sandboxed worker and `execve`s the tool.
//!
//! The work is split in two ([`plan`]): what is the same for every worker of a profile runs
//! once, in the template ([`template`]: parent death, the capability lock and the empty
//! bounding set, no_new_privs, the profile's seccomp stack with the launcher's own calls
//! carved out), and every forked worker inherits it; what differs per call runs in the
//! worker ([`run`]), ending with the seal that puts the carved calls back as the profile
//! decides them, so the tool's filters are exactly the profile's.
//!
//! Like Firecracker's jailer, it first reads and validates everything ([`Plan::new`]), so
//! that every later step is a plain system call, then runs the steps in a fixed order
//! ([`plan`]) over the [`kernel::Kernel`] trait; each says why it comes where it does. Any
//! failure writes one `{step, errno, message}` report ([`Step`]) to the channel and exits 126.
//!
//! Invariants (each checked by the plan's unit tests, over the recording fake):
//! - the steps run in the order of [`plan`], the seal last before the report and `execve`;
//! - a failing step stops the plan, and its report names that step;
//! - after a uid switch, PDEATHSIG is set again and the parent checked again (the switch
//!   cleared it), so a daemon that died in between leaves no unbounded worker.

mod kernel;
mod landlock;
mod plan;
#[cfg(test)]
mod tests;

use std::ffi::{CString, OsStr, OsString};
use std::io::{Read, Write};
use std::os::fd::{AsRawFd, OwnedFd, RawFd};
use std::os::unix::ffi::{OsStrExt, OsStringExt};
use std::os::unix::net::UnixStream;

use super::wire::{Report, Spec, Step, SETUP_FAILED};

/// A failed step.
#[derive(Debug)]
struct Failure {
    step: Step,
    errno: i32,
    message: String,
}

impl Failure {
    fn new(step: Step, errno: i32, message: impl Into<String>) -> Self {
        Failure {
            step,
            errno,
            message: message.into(),
        }
    }

    fn io(step: Step, what: impl std::fmt::Display, e: std::io::Error) -> Self {
        Failure {
            step,
            errno: e.raw_os_error().unwrap_or(0),
            message: format!("{what}: {e}"),
        }
    }

    fn errno(step: Step, what: impl std::fmt::Display, e: rustix::io::Errno) -> Self {
        Failure {
            step,
            errno: e.raw_os_error(),
            message: format!("{what}: {e}"),
        }
    }

    /// The report line that tells the daemon about this failure.
    fn report(self) -> Report {
        Report::Failed {
            step: self.step,
            errno: self.errno,
            message: self.message,
        }
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
        .map_err(|f| (f.step, f.errno, f.message))
}

/// Runs the launcher in a worker leader just forked from its template (see
/// [`crate::sandbox::spawner`]), with the daemon's channel, when the caller asked for
/// progress the progress pipe's write end, and the template's `seal`; never returns: it
/// `execve`s the tool or reports the failed step and exits.
pub(crate) fn run(
    mut channel: UnixStream,
    progress: Option<OwnedFd>,
    seal: &[seccompiler::BpfProgram],
) -> ! {
    let failure = match Plan::new(&mut channel, progress, seal) {
        Ok(plan) => match plan.run(&mut kernel::Linux {
            channel: Some(&mut channel),
        }) {
            Ok(never) => match never {},
            Err(f) => f,
        },
        Err(f) => f,
    };
    fail(&mut channel, failure.step, failure.errno, failure.message)
}

/// Reports a failed step on the channel and exits.
pub(crate) fn fail(channel: &mut UnixStream, step: Step, errno: i32, message: String) -> ! {
    let report = Failure {
        step,
        errno,
        message,
    }
    .report();
    let _ = channel.write_all(&report.line());
    std::process::exit(SETUP_FAILED);
}

/// Everything, parsed and checked, before the first irreversible step.
struct Plan {
    spec: Spec,
    exe: CString,
    argv: Vec<CString>,
    env: Vec<CString>,
    /// The seal (from the template): the profile's rules for the calls the template's stack
    /// leaves to it.
    seccomp: Vec<seccompiler::BpfProgram>,
    channel_fd: RawFd,
    /// The progress pipe's write end, and where the tool finds it (3, or 4 if the channel
    /// is 3).
    progress: Option<(OwnedFd, RawFd)>,
}

impl Plan {
    fn new(
        channel: &mut UnixStream,
        progress: Option<OwnedFd>,
        seal: &[seccompiler::BpfProgram],
    ) -> Result<Plan, Failure> {
        let mut bytes = Vec::with_capacity(64 * 1024);
        channel
            .read_to_end(&mut bytes)
            .map_err(|e| Failure::io(Step::Spec, "cannot read the spec from the daemon", e))?;
        let spec: Spec = serde_json::from_slice(&bytes)
            .map_err(|e| Failure::new(Step::Spec, libc::EINVAL, format!("unreadable spec: {e}")))?;
        Plan::check(spec, channel.as_raw_fd(), progress, seal.to_vec())
    }

    /// The checks of [`Plan::new`], on a spec already read; `channel_fd` is the channel's
    /// descriptor, which the close-fds step keeps.
    fn check(
        spec: Spec,
        channel_fd: RawFd,
        progress: Option<OwnedFd>,
        seccomp: Vec<seccompiler::BpfProgram>,
    ) -> Result<Plan, Failure> {
        let cstring = |what: &str, s: &[u8]| {
            CString::new(s).map_err(|_| {
                Failure::new(
                    Step::Spec,
                    libc::EINVAL,
                    format!("{what} contains a NUL byte"),
                )
            })
        };
        let Some(first) = spec.argv.first() else {
            return Err(Failure::new(Step::Spec, libc::EINVAL, "empty argv"));
        };
        if !first.starts_with('/') {
            return Err(Failure::new(
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
                return Err(Failure::new(
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
            return Err(Failure::new(
                Step::Spec,
                libc::EINVAL,
                "empty or oversized seccomp program",
            ));
        }
        Ok(Plan {
            spec,
            exe,
            argv,
            env,
            seccomp,
            channel_fd,
            progress,
        })
    }
}
