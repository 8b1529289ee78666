//! The system calls the launcher's plan makes, as a trait: [`Linux`] makes them for real, and
//! the tests' recording fake answers them without root.
//!
//! A worker runs [`Linux`] in a child that shares its template's memory (`CLONE_VM |
//! CLONE_VFORK`, see [`crate::sandbox::spawner`]): every method here is a plain system call
//! on data the template prepared. None allocates, takes a lock, or touches anything but the
//! child's own stack (and `errno`, the template's, which the suspended template does not
//! read): each is async-signal-safe. The template's own steps use the same methods.

use std::convert::Infallible;
use std::ffi::{c_char, CStr};
use std::os::fd::{BorrowedFd, RawFd};

use rustix::io::Errno;
use rustix::process::{Resource, Rlimit};

use super::landlock::Prepared;
use crate::sandbox::sys;
use crate::sandbox::wire::LandlockStatus;

/// What the launcher asks of the kernel, one method per system call (or per fixed group of
/// calls, such as reading a capability set).
pub(super) trait Kernel {
    /// What a successful `execve` gives back: nothing for the real kernel ([`Infallible`]),
    /// a marker for the fake.
    type Exec;

    fn getpid(&mut self) -> i32;
    fn getpgrp(&mut self) -> i32;
    /// `PR_SET_PDEATHSIG` to SIGKILL.
    fn set_parent_death_kill(&mut self) -> Result<(), Errno>;
    /// The parent's pid (0 if there is none).
    fn getppid(&mut self) -> i32;
    /// Writes "0" to the cgroup's `cgroup.procs`.
    fn join_cgroup(&mut self, procs: &CStr) -> Result<(), Errno>;
    fn default_sigpipe(&mut self) -> Result<(), Errno>;
    fn unblock_all_signals(&mut self) -> Result<(), Errno>;
    /// Clears FD_CLOEXEC on `fd`.
    fn make_inheritable(&mut self, fd: RawFd) -> Result<(), Errno>;
    /// `dup2(from, to)`: the copy at `to` is inheritable.
    fn dup2(&mut self, from: RawFd, to: RawFd) -> Result<(), Errno>;
    /// `close_range(first, last, CLOSE_RANGE_CLOEXEC)`: every descriptor in the range closes
    /// at `execve` (they stay open until then: the template's Landlock ruleset is one).
    fn cloexec_range(&mut self, first: u32, last: u32) -> Result<(), Errno>;
    /// Sets both limits of `resource` to `value`.
    fn setrlimit(&mut self, resource: Resource, value: u64) -> Result<(), Errno>;
    fn chdir(&mut self, dir: &CStr) -> Result<(), Errno>;
    /// `landlock_restrict_self` with the ruleset the template built: what the kernel enforces.
    fn landlock(&mut self, ruleset: &Prepared) -> Result<LandlockStatus, Errno>;
    /// (effective, permitted, inheritable).
    fn capget(&mut self) -> Result<(u64, u64, u64), Errno>;
    fn set_securebits(&mut self, bits: u32) -> Result<(), Errno>;
    fn bounding_drop_all(&mut self) -> Result<(), Errno>;
    fn bounding_set(&mut self) -> Result<u64, Errno>;
    fn ambient_clear(&mut self) -> Result<(), Errno>;
    fn ambient_set(&mut self) -> Result<u64, Errno>;
    fn capset_empty(&mut self) -> Result<(), Errno>;
    /// `PR_SET_DUMPABLE` to 0: no process of the worker's uid may read our memory (the
    /// template's, shared until `execve`) through /proc or ptrace.
    fn set_undumpable(&mut self) -> Result<(), Errno>;
    fn setgroups_empty(&mut self) -> Result<(), Errno>;
    fn setresgid(&mut self, gid: u32) -> Result<(), Errno>;
    fn setresuid(&mut self, uid: u32) -> Result<(), Errno>;
    /// (real uid, effective uid, real gid, effective gid).
    fn ids(&mut self) -> (u32, u32, u32, u32);
    fn set_no_new_privs(&mut self) -> Result<(), Errno>;
    fn seccomp(&mut self, program: &[seccompiler::sock_filter]) -> Result<(), Errno>;
    /// Writes one report line to the daemon's channel.
    fn report(&mut self, line: &[u8]) -> Result<(), Errno>;
    /// Makes the channel close on exec.
    fn channel_cloexec(&mut self) -> Result<(), Errno>;
    /// `argv` and `env` are null-terminated arrays of C strings.
    fn execve(
        &mut self,
        exe: &CStr,
        argv: &[*const c_char],
        env: &[*const c_char],
    ) -> Result<Self::Exec, Errno>;
}

/// The real kernel, with the daemon's channel (none in a template, whose steps report
/// nothing on it).
pub(super) struct Linux {
    pub channel: Option<RawFd>,
}

fn errno_of(e: std::io::Error) -> Errno {
    Errno::from_io_error(&e).unwrap_or(Errno::INVAL)
}

fn last_errno() -> Errno {
    errno_of(std::io::Error::last_os_error())
}

impl Kernel for Linux {
    type Exec = Infallible;

    fn getpid(&mut self) -> i32 {
        rustix::process::getpid().as_raw_nonzero().get()
    }

    fn getpgrp(&mut self) -> i32 {
        rustix::process::getpgrp().as_raw_nonzero().get()
    }

    fn set_parent_death_kill(&mut self) -> Result<(), Errno> {
        rustix::process::set_parent_process_death_signal(Some(rustix::process::Signal::KILL))
    }

    fn getppid(&mut self) -> i32 {
        rustix::process::getppid()
            .map(|p| p.as_raw_nonzero().get())
            .unwrap_or(0)
    }

    fn join_cgroup(&mut self, procs: &CStr) -> Result<(), Errno> {
        use rustix::fs::{Mode, OFlags};
        let fd = rustix::fs::open(procs, OFlags::WRONLY | OFlags::CLOEXEC, Mode::empty())?;
        match rustix::io::write(&fd, b"0")? {
            1 => Ok(()),
            _ => Err(Errno::IO),
        }
    }

    fn default_sigpipe(&mut self) -> Result<(), Errno> {
        sys::default_sigpipe().map_err(errno_of)
    }

    fn unblock_all_signals(&mut self) -> Result<(), Errno> {
        sys::unblock_all_signals().map_err(errno_of)
    }

    fn make_inheritable(&mut self, fd: RawFd) -> Result<(), Errno> {
        // SAFETY: `fd` is open in this process (the plan's progress pipe) for the duration
        // of the call; fcntl only changes its flag.
        let fd = unsafe { BorrowedFd::borrow_raw(fd) };
        rustix::io::fcntl_setfd(fd, rustix::io::FdFlags::empty())
    }

    fn dup2(&mut self, from: RawFd, to: RawFd) -> Result<(), Errno> {
        // SAFETY: dup2 takes two integers and touches no memory of ours; the plan passes a
        // `to` that is neither the channel nor `from`, and whatever it held is closed like
        // every other inherited descriptor; nothing in this process owns it. The copy at
        // `to` is not close-on-exec.
        let rc = unsafe { libc::dup2(from, to) };
        if rc < 0 {
            return Err(last_errno());
        }
        Ok(())
    }

    fn cloexec_range(&mut self, first: u32, last: u32) -> Result<(), Errno> {
        sys::cloexec_range(first, last).map_err(errno_of)
    }

    fn setrlimit(&mut self, resource: Resource, value: u64) -> Result<(), Errno> {
        rustix::process::setrlimit(
            resource,
            Rlimit {
                current: Some(value),
                maximum: Some(value),
            },
        )
    }

    fn chdir(&mut self, dir: &CStr) -> Result<(), Errno> {
        rustix::process::chdir(dir)
    }

    fn landlock(&mut self, ruleset: &Prepared) -> Result<LandlockStatus, Errno> {
        ruleset.restrict_self()
    }

    fn capget(&mut self) -> Result<(u64, u64, u64), Errno> {
        sys::capget().map_err(errno_of)
    }

    fn set_securebits(&mut self, bits: u32) -> Result<(), Errno> {
        sys::set_securebits(bits).map_err(errno_of)
    }

    fn bounding_drop_all(&mut self) -> Result<(), Errno> {
        sys::bounding_drop_all().map_err(errno_of)
    }

    fn bounding_set(&mut self) -> Result<u64, Errno> {
        sys::bounding_set().map_err(errno_of)
    }

    fn ambient_clear(&mut self) -> Result<(), Errno> {
        sys::ambient_clear().map_err(errno_of)
    }

    fn ambient_set(&mut self) -> Result<u64, Errno> {
        sys::ambient_set().map_err(errno_of)
    }

    fn capset_empty(&mut self) -> Result<(), Errno> {
        sys::capset_empty().map_err(errno_of)
    }

    fn set_undumpable(&mut self) -> Result<(), Errno> {
        rustix::process::set_dumpable_behavior(rustix::process::DumpableBehavior::NotDumpable)
    }

    // The launcher is single-threaded: the per-thread calls below change the whole process.
    fn setgroups_empty(&mut self) -> Result<(), Errno> {
        rustix::thread::set_thread_groups(&[])
    }

    fn setresgid(&mut self, gid: u32) -> Result<(), Errno> {
        let g = rustix::process::Gid::from_raw(gid);
        rustix::thread::set_thread_res_gid(g, g, g)
    }

    fn setresuid(&mut self, uid: u32) -> Result<(), Errno> {
        let u = rustix::process::Uid::from_raw(uid);
        rustix::thread::set_thread_res_uid(u, u, u)
    }

    fn ids(&mut self) -> (u32, u32, u32, u32) {
        (
            rustix::process::getuid().as_raw(),
            rustix::process::geteuid().as_raw(),
            rustix::process::getgid().as_raw(),
            rustix::process::getegid().as_raw(),
        )
    }

    fn set_no_new_privs(&mut self) -> Result<(), Errno> {
        rustix::thread::set_no_new_privs(true)
    }

    fn seccomp(&mut self, program: &[seccompiler::sock_filter]) -> Result<(), Errno> {
        // seccompiler: PR_SET_NO_NEW_PRIVS (already set), then seccomp(SET_MODE_FILTER) with a
        // program header on the stack. Neither allocates.
        seccompiler::apply_filter(program).map_err(|e| match e {
            seccompiler::Error::Seccomp(io) | seccompiler::Error::Prctl(io) => errno_of(io),
            _ => Errno::INVAL,
        })
    }

    fn report(&mut self, line: &[u8]) -> Result<(), Errno> {
        let Some(channel) = self.channel else {
            return Err(Errno::BADF);
        };
        // SAFETY: the channel is open in this process until the plan ends (it is kept by the
        // close-fds step and only made close-on-exec).
        let channel = unsafe { BorrowedFd::borrow_raw(channel) };
        let mut rest = line;
        while !rest.is_empty() {
            match rustix::io::write(channel, rest) {
                Ok(0) => return Err(Errno::PIPE),
                Ok(n) => rest = rest.get(n..).unwrap_or_default(),
                Err(Errno::INTR) => {}
                Err(e) => return Err(e),
            }
        }
        Ok(())
    }

    fn channel_cloexec(&mut self) -> Result<(), Errno> {
        let Some(channel) = self.channel else {
            return Err(Errno::BADF);
        };
        // SAFETY: as in `report`.
        let channel = unsafe { BorrowedFd::borrow_raw(channel) };
        rustix::io::fcntl_setfd(channel, rustix::io::FdFlags::CLOEXEC)
    }

    fn execve(
        &mut self,
        exe: &CStr,
        argv: &[*const c_char],
        env: &[*const c_char],
    ) -> Result<Infallible, Errno> {
        if argv.last() != Some(&std::ptr::null()) || env.last() != Some(&std::ptr::null()) {
            return Err(Errno::INVAL);
        }
        // SAFETY: `exe` is a C string, `argv` and `env` null-terminated arrays (checked above)
        // of pointers to C strings the template prepared, all alive until the exec replaces
        // this process image (or returns, when it failed).
        unsafe { libc::execve(exe.as_ptr(), argv.as_ptr(), env.as_ptr()) };
        Err(last_errno())
    }
}
