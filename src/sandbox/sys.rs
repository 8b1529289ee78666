//! The raw system calls the sandbox makes that neither `rustix` nor `nix` wrap safely.
//!
//! Each wrapper is one call with a `// SAFETY:` comment saying why it is sound; callers get
//! `io::Result` and never see a raw return code.

use std::io;
use std::os::fd::RawFd;

fn check(rc: libc::c_long) -> io::Result<libc::c_long> {
    if rc < 0 {
        Err(io::Error::last_os_error())
    } else {
        Ok(rc)
    }
}

fn check_int(rc: libc::c_int) -> io::Result<libc::c_int> {
    if rc < 0 {
        Err(io::Error::last_os_error())
    } else {
        Ok(rc)
    }
}

/// `close_range(first, last, 0)`: closes every open descriptor in `first..=last`.
pub(crate) fn close_range(first: u32, last: u32) -> io::Result<()> {
    // SAFETY: close_range takes two integers and a flag word and touches no memory of ours.
    // The launcher owns every descriptor in the range (nothing else runs in it) and drops no
    // Rust object that refers to one, so no owner sees its descriptor closed under it.
    let rc = unsafe { libc::syscall(libc::SYS_close_range, first, last, 0 as libc::c_uint) };
    check(rc).map(drop)
}

/// The kernel's Landlock ABI version: `landlock_create_ruleset(NULL, 0, VERSION)`.
/// `Ok(0)` when Landlock is not built in or not enabled.
pub(crate) fn landlock_abi() -> io::Result<i32> {
    const LANDLOCK_CREATE_RULESET_VERSION: libc::c_uint = 1;
    // SAFETY: with the VERSION flag the kernel ignores the (null) attribute pointer and size
    // and only returns an integer.
    let rc = unsafe {
        libc::syscall(
            libc::SYS_landlock_create_ruleset,
            std::ptr::null::<libc::c_void>(),
            0 as libc::size_t,
            LANDLOCK_CREATE_RULESET_VERSION,
        )
    };
    match check(rc) {
        Ok(v) => Ok(v as i32),
        Err(e)
            if matches!(
                e.raw_os_error(),
                Some(libc::ENOSYS) | Some(libc::EOPNOTSUPP)
            ) =>
        {
            Ok(0)
        }
        Err(e) => Err(e),
    }
}

/// `prctl(PR_CAPBSET_READ, cap)`: `Ok(None)` once `cap` is past the kernel's last capability.
fn capbset_read(cap: u32) -> io::Result<Option<bool>> {
    // SAFETY: PR_CAPBSET_READ takes an integer and returns 0 or 1; no memory is passed.
    let rc = unsafe { libc::prctl(libc::PR_CAPBSET_READ, cap as libc::c_ulong, 0, 0, 0) };
    match check_int(rc) {
        Ok(v) => Ok(Some(v == 1)),
        Err(e) if e.raw_os_error() == Some(libc::EINVAL) => Ok(None),
        Err(e) => Err(e),
    }
}

/// `prctl(PR_CAPBSET_DROP, cap)`.
fn capbset_drop(cap: u32) -> io::Result<()> {
    // SAFETY: PR_CAPBSET_DROP takes an integer; no memory is passed.
    let rc = unsafe { libc::prctl(libc::PR_CAPBSET_DROP, cap as libc::c_ulong, 0, 0, 0) };
    check_int(rc).map(drop)
}

/// The bounding set as a bit mask, read capability by capability up to the kernel's last one
/// (so capabilities newer than this build are seen too).
pub(crate) fn bounding_set() -> io::Result<u64> {
    let mut mask = 0u64;
    for cap in 0..64 {
        match capbset_read(cap)? {
            Some(true) => mask |= 1 << cap,
            Some(false) => {}
            None => break,
        }
    }
    Ok(mask)
}

/// Drops every capability from the bounding set.
pub(crate) fn bounding_drop_all() -> io::Result<()> {
    for cap in 0..64 {
        match capbset_read(cap)? {
            Some(true) => capbset_drop(cap)?,
            Some(false) => {}
            None => break,
        }
    }
    Ok(())
}

/// `prctl(PR_CAP_AMBIENT, PR_CAP_AMBIENT_CLEAR_ALL)`.
pub(crate) fn ambient_clear() -> io::Result<()> {
    // SAFETY: integer arguments only.
    let rc = unsafe {
        libc::prctl(
            libc::PR_CAP_AMBIENT,
            libc::PR_CAP_AMBIENT_CLEAR_ALL as libc::c_ulong,
            0,
            0,
            0,
        )
    };
    check_int(rc).map(drop)
}

/// The ambient set as a bit mask.
pub(crate) fn ambient_set() -> io::Result<u64> {
    let mut mask = 0u64;
    for cap in 0..64u64 {
        // SAFETY: integer arguments only.
        let rc = unsafe {
            libc::prctl(
                libc::PR_CAP_AMBIENT,
                libc::PR_CAP_AMBIENT_IS_SET as libc::c_ulong,
                cap as libc::c_ulong,
                0,
                0,
            )
        };
        match check_int(rc) {
            Ok(1) => mask |= 1 << cap,
            Ok(_) => {}
            Err(e) if e.raw_os_error() == Some(libc::EINVAL) => break,
            Err(e) => return Err(e),
        }
    }
    Ok(mask)
}

const LINUX_CAPABILITY_VERSION_3: u32 = 0x2008_0522;

#[repr(C)]
struct CapHeader {
    version: u32,
    pid: libc::c_int,
}

#[repr(C)]
#[derive(Clone, Copy, Default)]
struct CapData {
    effective: u32,
    permitted: u32,
    inheritable: u32,
}

/// Effective, permitted and inheritable sets of the calling thread, as 64-bit masks.
pub(crate) fn capget() -> io::Result<(u64, u64, u64)> {
    let mut header = CapHeader {
        version: LINUX_CAPABILITY_VERSION_3,
        pid: 0,
    };
    let mut data = [CapData::default(); 2];
    // SAFETY: version 3 of the interface reads one header and writes exactly two CapData
    // structs, which `header` and `data` provide and outlive the call.
    let rc = unsafe {
        libc::syscall(
            libc::SYS_capget,
            &mut header as *mut CapHeader,
            data.as_mut_ptr(),
        )
    };
    check(rc)?;
    let join = |lo: u32, hi: u32| (u64::from(hi) << 32) | u64::from(lo);
    Ok((
        join(data[0].effective, data[1].effective),
        join(data[0].permitted, data[1].permitted),
        join(data[0].inheritable, data[1].inheritable),
    ))
}

/// Empties the effective, permitted and inheritable sets of the calling thread.
pub(crate) fn capset_empty() -> io::Result<()> {
    let header = CapHeader {
        version: LINUX_CAPABILITY_VERSION_3,
        pid: 0,
    };
    let data = [CapData::default(); 2];
    // SAFETY: version 3 of the interface reads one header and two CapData structs, which
    // `header` and `data` provide and outlive the call; nothing is written.
    let rc = unsafe { libc::syscall(libc::SYS_capset, &header as *const CapHeader, data.as_ptr()) };
    check(rc).map(drop)
}

/// `prctl(PR_SET_SECUREBITS, bits)`.
pub(crate) fn set_securebits(bits: u32) -> io::Result<()> {
    // SAFETY: integer arguments only.
    let rc = unsafe { libc::prctl(libc::PR_SET_SECUREBITS, bits as libc::c_ulong, 0, 0, 0) };
    check_int(rc).map(drop)
}

/// Restores the default disposition of `SIGPIPE`, which the Rust runtime of the launcher set to
/// "ignore" and which `execve` would otherwise pass on to the tool.
pub(crate) fn default_sigpipe() -> io::Result<()> {
    // SAFETY: installs SIG_DFL (no handler code runs in this process); the launcher is single
    // threaded, so no other thread observes the change.
    let prev = unsafe { libc::signal(libc::SIGPIPE, libc::SIG_DFL) };
    if prev == libc::SIG_ERR {
        return Err(io::Error::last_os_error());
    }
    Ok(())
}

/// Unblocks every signal of the calling thread.
pub(crate) fn unblock_all_signals() -> io::Result<()> {
    let empty = nix::sys::signal::SigSet::empty();
    nix::sys::signal::sigprocmask(
        nix::sys::signal::SigmaskHow::SIG_SETMASK,
        Some(&empty),
        None,
    )
    .map_err(io::Error::from)
}

/// `waitid(P_PID, pid, WEXITED | WNOHANG)`: reaps `pid` if it is a zombie child of ours.
/// `Ok(None)` when it has not exited yet; `Err(ECHILD)` when it is not (or no longer) our child.
pub(crate) fn reap_pid_nohang(pid: i32) -> io::Result<Option<Exit>> {
    // SAFETY: siginfo_t is plain data for which all-zero is a valid value.
    let mut info: libc::siginfo_t = unsafe { std::mem::zeroed() };
    // SAFETY: waitid writes one siginfo_t into `info`, which outlives the call.
    let rc = unsafe {
        libc::waitid(
            libc::P_PID,
            pid as libc::id_t,
            &mut info,
            libc::WEXITED | libc::WNOHANG,
        )
    };
    check_int(rc)?;
    Ok(exit_of(&info))
}

/// `waitid(P_PIDFD, pidfd, WEXITED | WNOHANG)`: reaps the process behind `pidfd`.
pub(crate) fn reap_pidfd_nohang(pidfd: RawFd) -> io::Result<Option<Exit>> {
    // SAFETY: siginfo_t is plain data for which all-zero is a valid value.
    let mut info: libc::siginfo_t = unsafe { std::mem::zeroed() };
    // SAFETY: waitid writes one siginfo_t into `info`, which outlives the call; `pidfd` is
    // only read as an identifier.
    let rc = unsafe {
        libc::waitid(
            libc::P_PIDFD,
            pidfd as libc::id_t,
            &mut info,
            libc::WEXITED | libc::WNOHANG,
        )
    };
    check_int(rc)?;
    Ok(exit_of(&info))
}

/// How a reaped child ended.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Exit {
    Code(i32),
    Signal(i32),
}

fn exit_of(info: &libc::siginfo_t) -> Option<Exit> {
    // SAFETY: after a successful waitid, si_pid and si_status are the fields the kernel
    // filled in (si_pid stays 0 when WNOHANG found nothing, since we zeroed the struct).
    let (pid, status) = unsafe { (info.si_pid(), info.si_status()) };
    if pid == 0 {
        return None;
    }
    Some(match info.si_code {
        libc::CLD_EXITED => Exit::Code(status),
        _ => Exit::Signal(status),
    })
}

/// Registers a pidfd with the tokio reactor, for readability (the process exited).
pub(crate) fn watch_pidfd(
    pidfd: std::os::fd::OwnedFd,
) -> Result<
    tokio::io::unix::AsyncFd<std::os::fd::OwnedFd>,
    tokio::io::unix::AsyncFdRegisterError<std::os::fd::OwnedFd>,
> {
    // SAFETY: an OwnedFd is open, returns the same descriptor from every `as_raw_fd`, and is
    // owned by the AsyncFd from here on, so it stays open for the AsyncFd's whole life.
    unsafe {
        tokio::io::unix::AsyncFd::register_with_interest(pidfd, tokio::io::Interest::READABLE)
    }
}
