//! The system calls the sandbox makes beyond plain `rustix` calls: capabilities and waitid
//! through rustix's safe wrappers (shaped as the launcher and the reaper use them), and the
//! few that no safe crate wraps (`close_range`, the Landlock ABI probe, SIGPIPE's
//! disposition, registering a pidfd with tokio), each one call with a `// SAFETY:` comment
//! saying why it is sound. Callers get `io::Result` and never see a raw return code.

use std::io;
use std::os::fd::BorrowedFd;

fn check(rc: libc::c_long) -> io::Result<libc::c_long> {
    if rc < 0 {
        Err(io::Error::last_os_error())
    } else {
        Ok(rc)
    }
}

/// `close_range(first, last, 0)`: closes every open descriptor in `first..=last`.
pub(crate) fn close_range(first: u32, last: u32) -> io::Result<()> {
    // SAFETY: close_range takes two integers and a flag word and touches no memory of ours.
    // Its callers (the launcher, and the spawner before it opens anything) own every
    // descriptor in the range (nothing else runs in them) and drop no Rust object that refers
    // to one, so no owner sees its descriptor closed under it.
    let rc = unsafe { libc::syscall(libc::SYS_close_range, first, last, 0 as libc::c_uint) };
    check(rc).map(drop)
}

/// `close_range(first, last, CLOSE_RANGE_CLOEXEC)`: every open descriptor in `first..=last`
/// closes at the next `execve` (Linux 5.11; every kernel with the Landlock ABI the launcher
/// requires has it).
pub(crate) fn cloexec_range(first: u32, last: u32) -> io::Result<()> {
    const CLOSE_RANGE_CLOEXEC: libc::c_uint = 1 << 2;
    // SAFETY: close_range takes two integers and a flag word and touches no memory of ours;
    // with CLOSE_RANGE_CLOEXEC it closes nothing now, only sets a flag on each descriptor.
    let rc = unsafe { libc::syscall(libc::SYS_close_range, first, last, CLOSE_RANGE_CLOEXEC) };
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

// Capabilities: rustix's safe wrappers. A capability is a bit of `CapabilitySet`, which
// holds any bit, so capabilities newer than this build (and than `caps`'s enum) are read and
// dropped too: the kernel's EINVAL marks the end of its list.
use rustix::thread::{CapabilitySet, CapabilitySets};

fn cap_bit(cap: u32) -> CapabilitySet {
    CapabilitySet::from_bits_retain(1 << cap)
}

/// `prctl(PR_CAPBSET_READ, cap)`: `Ok(None)` once `cap` is past the kernel's last capability.
fn capbset_read(cap: u32) -> io::Result<Option<bool>> {
    match rustix::thread::capability_is_in_bounding_set(cap_bit(cap)) {
        Ok(set) => Ok(Some(set)),
        Err(rustix::io::Errno::INVAL) => Ok(None),
        Err(e) => Err(e.into()),
    }
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

/// Drops every capability from the bounding set (`PR_CAPBSET_DROP` each).
pub(crate) fn bounding_drop_all() -> io::Result<()> {
    for cap in 0..64 {
        match capbset_read(cap)? {
            Some(true) => rustix::thread::remove_capability_from_bounding_set(cap_bit(cap))?,
            Some(false) => {}
            None => break,
        }
    }
    Ok(())
}

/// `prctl(PR_CAP_AMBIENT, PR_CAP_AMBIENT_CLEAR_ALL)`.
pub(crate) fn ambient_clear() -> io::Result<()> {
    Ok(rustix::thread::clear_ambient_capability_set()?)
}

/// The ambient set as a bit mask.
pub(crate) fn ambient_set() -> io::Result<u64> {
    let mut mask = 0u64;
    for cap in 0..64 {
        match rustix::thread::capability_is_in_ambient_set(cap_bit(cap)) {
            Ok(true) => mask |= 1 << cap,
            Ok(false) => {}
            Err(rustix::io::Errno::INVAL) => break,
            Err(e) => return Err(e.into()),
        }
    }
    Ok(mask)
}

/// Effective, permitted and inheritable sets of the calling thread, as 64-bit masks
/// (`capget`).
pub(crate) fn capget() -> io::Result<(u64, u64, u64)> {
    let sets = rustix::thread::capabilities(None)?;
    Ok((
        sets.effective.bits(),
        sets.permitted.bits(),
        sets.inheritable.bits(),
    ))
}

/// Empties the effective, permitted and inheritable sets of the calling thread (`capset`).
pub(crate) fn capset_empty() -> io::Result<()> {
    let empty = CapabilitySets {
        effective: CapabilitySet::empty(),
        permitted: CapabilitySet::empty(),
        inheritable: CapabilitySet::empty(),
    };
    Ok(rustix::thread::set_capabilities(None, empty)?)
}

/// `prctl(PR_SET_SECUREBITS, bits)`.
pub(crate) fn set_securebits(bits: u32) -> io::Result<()> {
    Ok(rustix::thread::set_capabilities_secure_bits(
        rustix::thread::CapabilitiesSecureBits::from_bits_retain(bits),
    )?)
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
    let pid = rustix::process::Pid::from_raw(pid)
        .ok_or_else(|| io::Error::from_raw_os_error(libc::ECHILD))?;
    reap_nohang(rustix::process::WaitId::Pid(pid))
}

/// `waitid(P_PIDFD, pidfd, WEXITED | WNOHANG)`: reaps the process behind `pidfd`.
pub(crate) fn reap_pidfd_nohang(pidfd: BorrowedFd<'_>) -> io::Result<Option<Exit>> {
    reap_nohang(rustix::process::WaitId::PidFd(pidfd))
}

fn reap_nohang(id: rustix::process::WaitId<'_>) -> io::Result<Option<Exit>> {
    use rustix::process::WaitIdOptions;
    let status = rustix::process::waitid(id, WaitIdOptions::EXITED | WaitIdOptions::NOHANG)?;
    Ok(status.and_then(|s| {
        s.exit_status()
            .map(Exit::Code)
            .or_else(|| s.terminating_signal().map(Exit::Signal))
    }))
}

/// How a reaped child ended.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Exit {
    Code(i32),
    Signal(i32),
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
