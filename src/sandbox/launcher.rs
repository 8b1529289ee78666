//! The launcher: runs in a worker's leader just forked by the single-threaded spawner process
//! ([`super::spawner`]), turns it into the sandboxed worker and `execve`s the tool.
//!
//! Like Firecracker's jailer, it first reads and validates everything ([`Plan::new`]), so
//! that every later step is a plain system call, then runs the steps in a fixed order
//! ([`Plan::run`]); each says why it comes where it does. Any failure writes one
//! `{step, errno, message}` report to the channel and exits 126.

use std::convert::Infallible;
use std::ffi::{CString, OsStr, OsString};
use std::io::{Read, Write};
use std::os::fd::{AsRawFd, IntoRawFd, OwnedFd, RawFd};
use std::os::unix::ffi::{OsStrExt, OsStringExt};
use std::os::unix::net::UnixStream;
use std::path::PathBuf;

use rustix::process::{Resource, Rlimit};

use super::landlock::{self, Applied};
use super::seccomp;
use super::sys;
use super::wire::{Report, Rlimits, Spec, SETUP_FAILED};

/// A failed step.
struct Failure {
    step: &'static str,
    errno: i32,
    message: String,
}

impl Failure {
    fn new(step: &'static str, errno: i32, message: impl Into<String>) -> Self {
        Failure {
            step,
            errno,
            message: message.into(),
        }
    }

    fn io(step: &'static str, what: impl std::fmt::Display, e: std::io::Error) -> Self {
        Failure {
            step,
            errno: e.raw_os_error().unwrap_or(0),
            message: format!("{what}: {e}"),
        }
    }
}

/// Runs the launcher in a freshly forked worker leader (see [`super::spawner`]), with the
/// daemon's channel and, when the caller asked for progress, the progress pipe's write end;
/// never returns: it `execve`s the tool or reports the failed step and exits.
pub(crate) fn run(mut channel: UnixStream, progress: Option<OwnedFd>) -> ! {
    let failure = match Plan::new(&mut channel, progress) {
        Ok(plan) => match plan.run(&mut channel) {
            Ok(never) => match never {},
            Err(f) => f,
        },
        Err(f) => f,
    };
    fail(&mut channel, failure.step, failure.errno, failure.message)
}

/// Reports a failed step on the channel and exits.
pub(crate) fn fail(channel: &mut UnixStream, step: &str, errno: i32, message: String) -> ! {
    let report = Report::Failed {
        step: step.into(),
        errno,
        message,
    };
    let _ = channel.write_all(&report.line());
    std::process::exit(SETUP_FAILED);
}

/// Everything, parsed and checked, before the first irreversible step.
struct Plan {
    spec: Spec,
    exe: CString,
    argv: Vec<CString>,
    env: Vec<CString>,
    seccomp: Vec<seccompiler::BpfProgram>,
    channel_fd: RawFd,
    /// The progress pipe's write end, and where the tool finds it (3, or 4 if the channel
    /// is 3).
    progress: Option<(OwnedFd, RawFd)>,
}

impl Plan {
    fn new(channel: &mut UnixStream, progress: Option<OwnedFd>) -> Result<Plan, Failure> {
        let mut bytes = Vec::with_capacity(64 * 1024);
        channel
            .read_to_end(&mut bytes)
            .map_err(|e| Failure::io("spec", "cannot read the spec from the daemon", e))?;
        let spec: Spec = serde_json::from_slice(&bytes)
            .map_err(|e| Failure::new("spec", libc::EINVAL, format!("unreadable spec: {e}")))?;

        let cstring = |what: &str, s: &[u8]| {
            CString::new(s).map_err(|_| {
                Failure::new("spec", libc::EINVAL, format!("{what} contains a NUL byte"))
            })
        };
        let Some(first) = spec.argv.first() else {
            return Err(Failure::new("spec", libc::EINVAL, "empty argv"));
        };
        if !first.starts_with('/') {
            return Err(Failure::new(
                "spec",
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
        let progress = progress.map(|fd| (fd, if channel.as_raw_fd() == 3 { 4 } else { 3 }));
        if let Some((_, to)) = &progress {
            vars.retain(|(n, _)| n != OsStr::new(super::PROGRESS_FD_ENV));
            vars.push((super::PROGRESS_FD_ENV.into(), to.to_string().into()));
        }
        let mut env = Vec::with_capacity(vars.len());
        for (name, value) in vars {
            if name.is_empty() || name.as_bytes().contains(&b'=') {
                return Err(Failure::new(
                    "spec",
                    libc::EINVAL,
                    format!("bad variable name {name:?}"),
                ));
            }
            let mut kv = name.into_vec();
            kv.push(b'=');
            kv.extend(value.into_vec());
            env.push(cstring("an environment variable", &kv)?);
        }

        let seccomp = spec
            .seccomp
            .iter()
            .map(|p| seccomp::decode(p))
            .collect::<Vec<_>>();
        if seccomp.iter().any(|p| p.is_empty() || p.len() > 4096) {
            return Err(Failure::new(
                "spec",
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
            channel_fd: channel.as_raw_fd(),
            progress,
        })
    }

    fn run(self, channel: &mut UnixStream) -> Result<Infallible, Failure> {
        // 1. We must lead our own process group: the daemon signals and confirms the worker
        //    by group, and the spawner's child made it so before anything else.
        let pid = rustix::process::getpid();
        if rustix::process::getpgrp() != pid {
            return Err(Failure::new(
                "process_group",
                libc::EPERM,
                "the launcher does not lead its own process group",
            ));
        }

        // 2. Die with the daemon. PDEATHSIG only covers a parent that exits *after* it is set,
        //    so the parent is checked again right after: if it already changed, the daemon
        //    (or the thread that forked us) is gone and nobody would ever reap or bound us.
        rustix::process::set_parent_process_death_signal(Some(rustix::process::Signal::KILL))
            .map_err(|e| {
                Failure::new(
                    "parent_death",
                    e.raw_os_error(),
                    format!("PR_SET_PDEATHSIG: {e}"),
                )
            })?;
        let parent = rustix::process::getppid()
            .map(|p| p.as_raw_nonzero().get())
            .unwrap_or(0);
        if parent != self.spec.parent {
            return Err(Failure::new(
                "parent_death",
                libc::ESRCH,
                format!(
                    "the parent is pid {parent}, expected the daemon, pid {}",
                    self.spec.parent
                ),
            ));
        }

        // 3. Join the worker's cgroup first, so that everything from here on (and every
        //    descendant) is counted and killable there, and while the path is still reachable
        //    (Landlock comes later).
        if let Some(cgroup) = &self.spec.cgroup {
            let procs = cgroup.join("cgroup.procs");
            std::fs::write(&procs, b"0").map_err(|e| Failure::io("cgroup", procs.display(), e))?;
        }

        // 4. Signals: the Rust runtime of this launcher ignores SIGPIPE, and an ignored signal
        //    survives execve; restore the default and an empty mask for the tool.
        sys::default_sigpipe().map_err(|e| Failure::io("signals", "SIGPIPE", e))?;
        sys::unblock_all_signals().map_err(|e| Failure::io("signals", "sigprocmask", e))?;

        // 5. Close every inherited descriptor but stdio, the channel and the progress pipe
        //    (when the caller asked for progress: the tool's one extra descriptor, named by
        //    `$AIRLOCK_PROGRESS_FD`), before anything else is opened, so that nothing else
        //    of the daemon's leaks into the tool.
        //    The progress pipe moves to the lowest number past stdio the channel does not
        //    hold (3, or 4), so that any shell can name it (dash takes one digit only).
        //    The pipe came over the spawner's socket close-on-exec: its copy at `to` is made
        //    inheritable.
        let mut keep = vec![self.channel_fd as u32];
        if let Some((fd, to)) = self.progress {
            if fd.as_raw_fd() == to {
                rustix::io::fcntl_setfd(&fd, rustix::io::FdFlags::empty()).map_err(|e| {
                    Failure::io("close_fds", "fcntl of the progress pipe", e.into())
                })?;
                // Kept open at `to` for the tool.
                let _ = fd.into_raw_fd();
            } else {
                // SAFETY: dup2 takes two integers and touches no memory of ours; `to` is
                // not the channel (nor `fd`), and whatever it held is closed like every
                // other inherited descriptor; nothing in this process owns it. The copy at
                // `to` is not close-on-exec.
                let rc = unsafe { libc::dup2(fd.as_raw_fd(), to) };
                if rc < 0 {
                    return Err(Failure::io(
                        "close_fds",
                        "dup2 of the progress pipe",
                        std::io::Error::last_os_error(),
                    ));
                }
                // `fd` itself is closed here, before the close_range below.
                drop(fd);
            }
            keep.push(to as u32);
        }
        keep.sort_unstable();
        let mut first = 3u32;
        for fd in keep.into_iter().filter(|fd| *fd >= 3) {
            if fd > first {
                sys::close_range(first, fd - 1)
                    .map_err(|e| Failure::io("close_fds", "close_range", e))?;
            }
            first = first.max(fd + 1);
        }
        sys::close_range(first, u32::MAX)
            .map_err(|e| Failure::io("close_fds", "close_range", e))?;

        // 6. Resource limits, while /proc is still readable (RLIMIT_NPROC needs a count of
        //    what a shared uid already runs; a uid of the worker's own runs nothing).
        set_rlimits(&self.spec.rlimits, self.spec.identity.map(|(u, _)| u))?;

        // 7. The working directory, by path, before Landlock could forbid the lookup.
        std::env::set_current_dir(&self.spec.cwd)
            .map_err(|e| Failure::io("chdir", self.spec.cwd.display(), e))?;

        // 8. Landlock, while we still hold the capabilities to open every rule's path (and
        //    CAP_SYS_ADMIN, so a root daemon does not even need no_new_privs for it).
        let applied: Applied = landlock::apply(&self.spec.landlock)
            .map_err(|f| Failure::new("landlock", f.errno, f.message))?;

        // 9. Capabilities, the part that needs CAP_SETPCAP: lock the securebits (uid 0 can
        //    never regain capabilities, and the uid switch below does not drop them behind
        //    our back) and empty the bounding set. CAP_SETUID/CAP_SETGID stay for step 10.
        lock_capabilities()?;

        // 10. Identity: a worker with a uid of its own switches to it (and to the gid of the
        //     same number, with no supplementary groups). From here, file permissions protect
        //     everything the worker does not own, metadata included, which Landlock does not.
        if let Some((uid, gid)) = self.spec.identity {
            switch_identity(uid, gid)?;
            // The kernel clears PDEATHSIG when the credentials change (commit_creds): set it
            // again, and check again that the daemon did not die in between.
            rearm_parent_death(self.spec.parent)?;
        }

        // 11. Capabilities: drop what is left of the five sets, and read them all back.
        drop_capabilities()?;

        // 12. no_new_privs: no setuid bit or file capability can give anything back; seccomp
        //     requires it as well.
        rustix::thread::set_no_new_privs(true).map_err(|e| {
            Failure::new(
                "no_new_privs",
                e.raw_os_error(),
                format!("PR_SET_NO_NEW_PRIVS: {e}"),
            )
        })?;

        // 13. seccomp last: the filters may forbid calls the steps above make.
        for (i, program) in self.seccomp.iter().enumerate() {
            seccompiler::apply_filter(program).map_err(|e| {
                let errno = match &e {
                    seccompiler::Error::Seccomp(io) | seccompiler::Error::Prctl(io) => {
                        io.raw_os_error().unwrap_or(0)
                    }
                    _ => libc::EINVAL,
                };
                Failure::new("seccomp", errno, format!("cannot install filter {i}: {e}"))
            })?;
        }

        // 14. Report success, then make the channel close on exec: EOF after `ok` tells the
        //     daemon the tool is running. A failed execve still has the channel to report on.
        let ok = Report::Ok {
            landlock: applied.status,
            landlock_abi: applied.abi,
        };
        channel
            .write_all(&ok.line())
            .map_err(|e| Failure::io("report", "cannot write the report", e))?;
        rustix::io::fcntl_setfd(&*channel, rustix::io::FdFlags::CLOEXEC).map_err(|e| {
            Failure::new(
                "report",
                e.raw_os_error(),
                format!("FD_CLOEXEC on the channel: {e}"),
            )
        })?;

        let Err(err) = nix::unistd::execve(&self.exe, &self.argv, &self.env);
        Err(Failure::new(
            "execve",
            err as i32,
            format!("cannot execute {:?}: {}", self.spec.argv[0], err.desc()),
        ))
    }
}

/// Step 6. RLIMIT_NPROC counts the tasks of the whole real uid, not the worker's. A worker
/// with a uid of its own (`own_uid`) gets the profile's `processes`: its leased uid runs
/// nothing else (an earlier worker's group is confirmed gone before its uid is leased
/// again), and if something did, it would only lower the worker's budget, never raise it.
/// A worker sharing the daemon's uid gets what that uid already runs plus `processes`,
/// counted in /proc (one pass over the host's processes per spawn: the price of sharing).
/// The kernel does not apply the limit to uid 0 at all; there the cgroup's pids.max is the
/// only process bound.
fn set_rlimits(limits: &Rlimits, own_uid: Option<u32>) -> Result<(), Failure> {
    let shared = rustix::process::getuid().as_raw();
    let nproc = if own_uid.is_some() || shared == 0 {
        limits.processes
    } else {
        tasks_of_uid(shared).saturating_add(limits.processes)
    };
    let all = [
        (Resource::Cpu, "RLIMIT_CPU", limits.cpu_seconds),
        (Resource::As, "RLIMIT_AS", limits.address_space_bytes),
        (Resource::Fsize, "RLIMIT_FSIZE", limits.file_size_bytes),
        (Resource::Nofile, "RLIMIT_NOFILE", limits.open_files),
        (Resource::Nproc, "RLIMIT_NPROC", nproc),
        (Resource::Core, "RLIMIT_CORE", 0),
    ];
    for (resource, name, value) in all {
        let limit = Rlimit {
            current: Some(value),
            maximum: Some(value),
        };
        rustix::process::setrlimit(resource, limit).map_err(|e| {
            Failure::new(
                "rlimits",
                e.raw_os_error(),
                format!("{name} = {value}: {e}"),
            )
        })?;
    }
    Ok(())
}

/// How many tasks (threads included, as the kernel counts them) run under real uid `uid`.
fn tasks_of_uid(uid: u32) -> u64 {
    let Ok(dir) = std::fs::read_dir("/proc") else {
        return 0;
    };
    let mut count = 0u64;
    for entry in dir.flatten() {
        let name = entry.file_name();
        if !name.as_bytes().iter().all(u8::is_ascii_digit) {
            continue;
        }
        let mut path = PathBuf::from("/proc");
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

/// Step 9. With CAP_SETPCAP (a root daemon): securebits that stop uid 0 from regaining
/// capabilities on execve and keep the uid switch from touching them, then an empty
/// bounding set. Without it (an unprivileged daemon) neither is possible nor needed: its
/// permitted set is emptied in step 11 and no_new_privs follows. Ambient goes either way.
fn lock_capabilities() -> Result<(), Failure> {
    const SECBIT_NOROOT: u32 = 1 << 0;
    const SECBIT_NOROOT_LOCKED: u32 = 1 << 1;
    const SECBIT_NO_SETUID_FIXUP: u32 = 1 << 2;
    const SECBIT_NO_SETUID_FIXUP_LOCKED: u32 = 1 << 3;
    const SECBIT_KEEP_CAPS_LOCKED: u32 = 1 << 5;
    const SECBIT_NO_CAP_AMBIENT_RAISE: u32 = 1 << 6;
    const SECBIT_NO_CAP_AMBIENT_RAISE_LOCKED: u32 = 1 << 7;
    let step = "capabilities";
    if has_setpcap()? {
        sys::set_securebits(
            SECBIT_NOROOT
                | SECBIT_NOROOT_LOCKED
                | SECBIT_NO_SETUID_FIXUP
                | SECBIT_NO_SETUID_FIXUP_LOCKED
                | SECBIT_KEEP_CAPS_LOCKED
                | SECBIT_NO_CAP_AMBIENT_RAISE
                | SECBIT_NO_CAP_AMBIENT_RAISE_LOCKED,
        )
        .map_err(|e| Failure::io(step, "PR_SET_SECUREBITS", e))?;
        sys::bounding_drop_all().map_err(|e| Failure::io(step, "PR_CAPBSET_DROP", e))?;
    }
    sys::ambient_clear().map_err(|e| Failure::io(step, "PR_CAP_AMBIENT_CLEAR_ALL", e))
}

fn has_setpcap() -> Result<bool, Failure> {
    const CAP_SETPCAP: u32 = 8;
    let (effective, _, _) = sys::capget().map_err(|e| Failure::io("capabilities", "capget", e))?;
    Ok(effective & (1 << CAP_SETPCAP) != 0)
}

/// Step 10. No supplementary groups, then the gid, then the uid (last: it takes away the
/// right to change the others). Each is set for real, effective and saved ids and read back.
fn switch_identity(uid: u32, gid: u32) -> Result<(), Failure> {
    use rustix::process::{Gid, Uid};
    let step = "identity";
    let fail = |what: &str, e: rustix::io::Errno| {
        Failure::new(step, e.raw_os_error(), format!("{what}: {e}"))
    };
    // The launcher is single-threaded: the per-thread syscalls change the whole process.
    rustix::thread::set_thread_groups(&[]).map_err(|e| fail("setgroups([])", e))?;
    let (g, u) = (Gid::from_raw(gid), Uid::from_raw(uid));
    rustix::thread::set_thread_res_gid(g, g, g).map_err(|e| fail("setresgid", e))?;
    rustix::thread::set_thread_res_uid(u, u, u).map_err(|e| fail("setresuid", e))?;
    let now = (
        rustix::process::getuid().as_raw(),
        rustix::process::geteuid().as_raw(),
        rustix::process::getgid().as_raw(),
        rustix::process::getegid().as_raw(),
    );
    if now != (uid, uid, gid, gid) {
        return Err(Failure::new(
            step,
            libc::EPERM,
            format!("asked for uid {uid} gid {gid}, have (ruid, euid, rgid, egid) {now:?}"),
        ));
    }
    Ok(())
}

/// Step 10, after the uid switch: PDEATHSIG again (the switch cleared it), then the parent
/// check of step 2 again, since a daemon that died before this point sent us nothing.
fn rearm_parent_death(expected: i32) -> Result<(), Failure> {
    rustix::process::set_parent_process_death_signal(Some(rustix::process::Signal::KILL)).map_err(
        |e| {
            Failure::new(
                "parent_death",
                e.raw_os_error(),
                format!("PR_SET_PDEATHSIG after the uid switch: {e}"),
            )
        },
    )?;
    let parent = rustix::process::getppid()
        .map(|p| p.as_raw_nonzero().get())
        .unwrap_or(0);
    if parent != expected {
        return Err(Failure::new(
            "parent_death",
            libc::ESRCH,
            format!("the parent is pid {parent}, expected the daemon, pid {expected}"),
        ));
    }
    Ok(())
}

/// Step 11. Empties the permitted, effective and inheritable sets (ambient went in step 9),
/// then reads all five back: every one must be empty (the bounding set only where step 9
/// could empty it).
fn drop_capabilities() -> Result<(), Failure> {
    let step = "capabilities";
    let setpcap = has_setpcap()?;
    sys::ambient_clear().map_err(|e| Failure::io(step, "PR_CAP_AMBIENT_CLEAR_ALL", e))?;
    // A daemon that holds no capabilities (the shipped unit: none, and capset denied by its
    // SystemCallFilter=~@privileged) has nothing to drop: capset is skipped, and the sets
    // are still read back below.
    let (effective, permitted, inheritable) =
        sys::capget().map_err(|e| Failure::io(step, "capget", e))?;
    if effective | permitted | inheritable != 0 {
        sys::capset_empty().map_err(|e| Failure::io(step, "capset", e))?;
    }

    let (effective, permitted, inheritable) =
        sys::capget().map_err(|e| Failure::io(step, "capget", e))?;
    let ambient = sys::ambient_set().map_err(|e| Failure::io(step, "PR_CAP_AMBIENT_IS_SET", e))?;
    let bounding = sys::bounding_set().map_err(|e| Failure::io(step, "PR_CAPBSET_READ", e))?;
    let mut left = Vec::new();
    for (name, mask) in [
        ("effective", effective),
        ("permitted", permitted),
        ("inheritable", inheritable),
        ("ambient", ambient),
    ] {
        if mask != 0 {
            left.push(format!("{name} {mask:#x}"));
        }
    }
    // Without CAP_SETPCAP (a non-root daemon) the bounding set cannot be emptied; it then
    // bounds nothing, since permitted is empty, uid is not 0, and no_new_privs follows.
    if bounding != 0 && (setpcap || rustix::process::geteuid().is_root()) {
        left.push(format!("bounding {bounding:#x}"));
    }
    if !left.is_empty() {
        return Err(Failure::new(
            step,
            libc::EPERM,
            format!("capabilities remain after dropping: {}", left.join(", ")),
        ));
    }
    Ok(())
}
