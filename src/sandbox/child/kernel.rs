//! The system calls the launcher's plan makes, as a trait: [`Linux`] makes them for real (the
//! same calls, in the same process, as before the trait existed), and the tests' recording
//! fake answers them without root.
//!
//! The launcher runs in a child forked from the single-threaded spawner, so ordinary Rust
//! (allocation included) is fine on both sides of the trait, exactly as in the plan itself.

use std::convert::Infallible;
use std::ffi::{CStr, CString};
use std::io::{self, Write};
use std::os::fd::{BorrowedFd, RawFd};
use std::os::unix::ffi::OsStrExt;
use std::os::unix::net::UnixStream;
use std::path::{Path, PathBuf};

use rustix::io::Errno;
use rustix::process::{Resource, Rlimit};

use super::landlock::{self, LandlockFailure};
use crate::sandbox::sys;
use crate::sandbox::wire::{Applied, LandlockSpec};

/// What the launcher asks of the kernel, one method per system call (or per fixed group of
/// calls, such as Landlock's ruleset).
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
    fn join_cgroup(&mut self, procs: &Path) -> io::Result<()>;
    fn default_sigpipe(&mut self) -> io::Result<()>;
    fn unblock_all_signals(&mut self) -> io::Result<()>;
    /// Clears FD_CLOEXEC on `fd`.
    fn make_inheritable(&mut self, fd: BorrowedFd<'_>) -> io::Result<()>;
    /// `dup2(from, to)`: the copy at `to` is inheritable.
    fn dup2(&mut self, from: BorrowedFd<'_>, to: RawFd) -> io::Result<()>;
    fn close_range(&mut self, first: u32, last: u32) -> io::Result<()>;
    /// The real uid.
    fn getuid(&mut self) -> u32;
    /// How many tasks run under real uid `uid`.
    fn tasks_of_uid(&mut self, uid: u32) -> u64;
    /// Sets both limits of `resource` to `value`.
    fn setrlimit(&mut self, resource: Resource, value: u64) -> Result<(), Errno>;
    fn chdir(&mut self, dir: &Path) -> io::Result<()>;
    fn landlock(&mut self, spec: &LandlockSpec) -> Result<Applied, LandlockFailure>;
    /// (effective, permitted, inheritable).
    fn capget(&mut self) -> io::Result<(u64, u64, u64)>;
    fn set_securebits(&mut self, bits: u32) -> io::Result<()>;
    fn bounding_drop_all(&mut self) -> io::Result<()>;
    fn bounding_set(&mut self) -> io::Result<u64>;
    fn ambient_clear(&mut self) -> io::Result<()>;
    fn ambient_set(&mut self) -> io::Result<u64>;
    fn capset_empty(&mut self) -> io::Result<()>;
    fn setgroups_empty(&mut self) -> Result<(), Errno>;
    fn setresgid(&mut self, gid: u32) -> Result<(), Errno>;
    fn setresuid(&mut self, uid: u32) -> Result<(), Errno>;
    /// (real uid, effective uid, real gid, effective gid).
    fn ids(&mut self) -> (u32, u32, u32, u32);
    fn set_no_new_privs(&mut self) -> Result<(), Errno>;
    fn seccomp(&mut self, program: &seccompiler::BpfProgram) -> Result<(), seccompiler::Error>;
    /// Writes one report line to the daemon's channel.
    fn report(&mut self, line: &[u8]) -> io::Result<()>;
    /// Makes the channel close on exec.
    fn channel_cloexec(&mut self) -> Result<(), Errno>;
    fn execve(
        &mut self,
        exe: &CStr,
        argv: &[CString],
        env: &[CString],
    ) -> Result<Self::Exec, nix::errno::Errno>;
}

/// The real kernel, with the daemon's channel (none in a template, whose steps report
/// nothing on it).
pub(super) struct Linux<'a> {
    pub channel: Option<&'a mut UnixStream>,
}

impl Kernel for Linux<'_> {
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

    fn join_cgroup(&mut self, procs: &Path) -> io::Result<()> {
        std::fs::write(procs, b"0")
    }

    fn default_sigpipe(&mut self) -> io::Result<()> {
        sys::default_sigpipe()
    }

    fn unblock_all_signals(&mut self) -> io::Result<()> {
        sys::unblock_all_signals()
    }

    fn make_inheritable(&mut self, fd: BorrowedFd<'_>) -> io::Result<()> {
        Ok(rustix::io::fcntl_setfd(fd, rustix::io::FdFlags::empty())?)
    }

    fn dup2(&mut self, from: BorrowedFd<'_>, to: RawFd) -> io::Result<()> {
        use std::os::fd::AsRawFd;
        // SAFETY: dup2 takes two integers and touches no memory of ours; the plan passes a
        // `to` that is neither the channel nor `from`, and whatever it held is closed like
        // every other inherited descriptor; nothing in this process owns it. The copy at
        // `to` is not close-on-exec.
        let rc = unsafe { libc::dup2(from.as_raw_fd(), to) };
        if rc < 0 {
            return Err(io::Error::last_os_error());
        }
        Ok(())
    }

    fn close_range(&mut self, first: u32, last: u32) -> io::Result<()> {
        sys::close_range(first, last)
    }

    fn getuid(&mut self) -> u32 {
        rustix::process::getuid().as_raw()
    }

    fn tasks_of_uid(&mut self, uid: u32) -> u64 {
        tasks_of_uid(uid)
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

    fn chdir(&mut self, dir: &Path) -> io::Result<()> {
        std::env::set_current_dir(dir)
    }

    fn landlock(&mut self, spec: &LandlockSpec) -> Result<Applied, LandlockFailure> {
        landlock::apply(spec)
    }

    fn capget(&mut self) -> io::Result<(u64, u64, u64)> {
        sys::capget()
    }

    fn set_securebits(&mut self, bits: u32) -> io::Result<()> {
        sys::set_securebits(bits)
    }

    fn bounding_drop_all(&mut self) -> io::Result<()> {
        sys::bounding_drop_all()
    }

    fn bounding_set(&mut self) -> io::Result<u64> {
        sys::bounding_set()
    }

    fn ambient_clear(&mut self) -> io::Result<()> {
        sys::ambient_clear()
    }

    fn ambient_set(&mut self) -> io::Result<u64> {
        sys::ambient_set()
    }

    fn capset_empty(&mut self) -> io::Result<()> {
        sys::capset_empty()
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

    fn seccomp(&mut self, program: &seccompiler::BpfProgram) -> Result<(), seccompiler::Error> {
        seccompiler::apply_filter(program)
    }

    fn report(&mut self, line: &[u8]) -> io::Result<()> {
        match self.channel.as_mut() {
            Some(channel) => channel.write_all(line),
            None => Err(io::Error::from_raw_os_error(libc::EBADF)),
        }
    }

    fn channel_cloexec(&mut self) -> Result<(), Errno> {
        match self.channel.as_ref() {
            Some(channel) => rustix::io::fcntl_setfd(&**channel, rustix::io::FdFlags::CLOEXEC),
            None => Err(Errno::BADF),
        }
    }

    fn execve(
        &mut self,
        exe: &CStr,
        argv: &[CString],
        env: &[CString],
    ) -> Result<Infallible, nix::errno::Errno> {
        nix::unistd::execve(exe, argv, env)
    }
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
