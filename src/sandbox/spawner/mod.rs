//! The spawner process: a single-threaded copy of the daemon's binary, started once (argv
//! `[exe, SPAWNER_ARG, DAEMON_PID]`), that forks every worker and runs the launcher in the
//! child, so no worker costs an `execve` of the daemon.
//!
//! It speaks the protocol of [`crate::sandbox::wire::spawn_request`] over a `SOCK_SEQPACKET`
//! pair that is its stdin at start.
//!
//! The worker is created with `clone3(CLONE_PARENT | CLONE_PIDFD)`: its parent is the daemon
//! (the thread that started the spawner), not the spawner, so the daemon reaps it by pidfd,
//! it is covered by the daemon's subreaper and kill-and-confirm exactly as before, and its
//! PDEATHSIG follows the daemon. The child closes the spawner's socket, takes the three
//! streams as 0, 1 and 2, leads a new process group, and runs [`child::run`], whose first
//! step re-checks all of that, and whose close-range step leaves the tool nothing else (but
//! the progress pipe, moved to fd 3 or 4 and named by `$AIRLOCK_PROGRESS_FD`).

use std::io::{IoSlice, IoSliceMut, Write};
use std::mem::MaybeUninit;
use std::os::fd::{AsFd, FromRawFd, OwnedFd};
use std::os::unix::net::UnixStream;

use rustix::net::{
    RecvAncillaryBuffer, RecvAncillaryMessage, RecvFlags, SendAncillaryBuffer,
    SendAncillaryMessage, SendFlags,
};

use super::child;
use super::wire::spawn_request::{self, Reply, SpawnFds, MAX_FDS, READY};
use super::wire::Step;

/// `argv[1]` that makes `main` run [`spawner_main`].
pub const SPAWNER_ARG: &str = "__airlock-spawner";

/// Entry point of spawner mode; never returns.
pub fn spawner_main() -> ! {
    match serve() {
        Ok(()) => std::process::exit(0),
        Err(e) => {
            let _ = writeln!(std::io::stderr(), "airlock spawner: {e}");
            std::process::exit(1);
        }
    }
}

fn serve() -> std::io::Result<()> {
    // Nothing but the standard streams is meant for us (the socket is stdin): a descriptor
    // the daemon let through (a listener passed by systemd, say) is closed before any work.
    super::sys::close_range(3, u32::MAX)?;
    let daemon: i32 = std::env::args()
        .nth(2)
        .and_then(|a| a.parse().ok())
        .ok_or_else(|| std::io::Error::other("no daemon pid in argv[2]"))?;
    // Die with the daemon (the thread that started us lives as long as the daemon), and make
    // sure it had not died already.
    rustix::process::set_parent_process_death_signal(Some(rustix::process::Signal::KILL))?;
    let parent = rustix::process::getppid().map_or(0, |p| p.as_raw_nonzero().get());
    if parent != daemon {
        return Err(std::io::Error::other(format!(
            "the parent is pid {parent}, expected the daemon, pid {daemon}"
        )));
    }
    // The socket is our stdin: move it above the standard streams (close-on-exec), and put
    // /dev/null in its place.
    let sock = rustix::io::fcntl_dupfd_cloexec(rustix::stdio::stdin(), 3)?;
    let null = std::fs::File::open("/dev/null")?;
    rustix::stdio::dup2_stdin(&null)?;
    drop(null);
    rustix::net::send(&sock, &[READY], SendFlags::NOSIGNAL)?;

    loop {
        let mut tag = [0u8; 1];
        let mut space = [MaybeUninit::uninit(); rustix::cmsg_space!(ScmRights(MAX_FDS))];
        let mut control = RecvAncillaryBuffer::new(&mut space);
        let got = rustix::net::recvmsg(
            &sock,
            &mut [IoSliceMut::new(&mut tag)],
            &mut control,
            RecvFlags::CMSG_CLOEXEC,
        );
        let got = match got {
            Ok(got) => got,
            Err(rustix::io::Errno::INTR) => continue,
            Err(e) => return Err(e.into()),
        };
        if got.bytes == 0 {
            // The daemon closed its end: it is gone or shutting down.
            return Ok(());
        }
        let mut fds: Vec<OwnedFd> = Vec::with_capacity(MAX_FDS);
        for message in control.drain() {
            if let RecvAncillaryMessage::ScmRights(received) = message {
                fds.extend(received);
            }
        }
        let reply = if !spawn_request::is_spawn_request(tag[0], fds.len()) {
            Err(rustix::io::Errno::INVAL)
        } else {
            match clone_parent() {
                Ok(Forked::Child) => child(sock, fds),
                Ok(Forked::Parent(pid, pidfd)) => Ok((pid, pidfd)),
                Err(errno) => Err(errno),
            }
        };
        match reply {
            Ok((pid, pidfd)) => {
                let message = Reply::Spawned(pid).encode();
                let fds = [pidfd.as_fd()];
                let mut space = [MaybeUninit::uninit(); rustix::cmsg_space!(ScmRights(1))];
                let mut control = SendAncillaryBuffer::new(&mut space);
                control.push(SendAncillaryMessage::ScmRights(&fds));
                rustix::net::sendmsg(
                    &sock,
                    &[IoSlice::new(&message)],
                    &mut control,
                    SendFlags::NOSIGNAL,
                )?;
            }
            Err(errno) => {
                let message = Reply::Refused(errno.raw_os_error()).encode();
                rustix::net::send(&sock, &message, SendFlags::NOSIGNAL)?;
            }
        }
        // Our copies of the worker's descriptors (and its pidfd) close here.
    }
}

enum Forked {
    Child,
    Parent(i32, OwnedFd),
}

/// `clone3(CLONE_PARENT | CLONE_PIDFD)`, fork-like (no new stack), or the legacy `clone`
/// with the same flags where clone3 is filtered out (systemd's `RestrictNamespaces=` makes it
/// fail with ENOSYS, since a filter cannot read clone3's flags). A failure goes back to the
/// daemon as the reply; the spawner goes on.
fn clone_parent() -> Result<Forked, rustix::io::Errno> {
    let flags = (libc::CLONE_PARENT | libc::CLONE_PIDFD) as u64;
    let mut pidfd: libc::c_int = -1;
    // SAFETY: clone_args is plain integers, for which all-zero is valid (and the kernel's
    // default for every field we do not set).
    let mut args: libc::clone_args = unsafe { std::mem::zeroed() };
    args.flags = flags;
    args.pidfd = std::ptr::addr_of_mut!(pidfd) as u64;
    // exit_signal stays 0: clone3 refuses one with CLONE_PARENT, and the child gets ours
    // (SIGCHLD, to the daemon).
    //
    // SAFETY: with no stack given, clone3 duplicates this process like fork: the child runs
    // on a copy of our memory and returns here with 0. The spawner is single-threaded (a
    // fresh exec, no runtime, no thread started), so no lock of the allocator or of std is
    // held by another thread at the copy, and the child only runs the launcher, then execs
    // or exits. The kernel reads `args` and writes the pidfd into `pidfd`, both outliving
    // the call.
    let mut rc = unsafe {
        libc::syscall(
            libc::SYS_clone3,
            std::ptr::addr_of_mut!(args),
            std::mem::size_of::<libc::clone_args>(),
        )
    };
    #[cfg(any(target_arch = "x86_64", target_arch = "aarch64"))]
    if rc < 0 && std::io::Error::last_os_error().raw_os_error() == Some(libc::ENOSYS) {
        // clone(flags, stack, parent_tid, ...): on these architectures the third argument is
        // where CLONE_PIDFD stores the pidfd; the others stay 0 (no stack, no tids, no tls).
        // SAFETY: as for clone3 above: fork-like, from a single-threaded process, and the
        // kernel writes only `pidfd`, which outlives the call.
        rc = unsafe {
            libc::syscall(
                libc::SYS_clone,
                flags as libc::c_ulong,
                0 as libc::c_ulong,
                std::ptr::addr_of_mut!(pidfd),
                0 as libc::c_ulong,
                0 as libc::c_ulong,
            )
        };
    }
    if rc < 0 {
        return Err(
            rustix::io::Errno::from_io_error(&std::io::Error::last_os_error())
                .unwrap_or(rustix::io::Errno::INVAL),
        );
    }
    if rc == 0 {
        return Ok(Forked::Child);
    }
    // SAFETY: CLONE_PIDFD made the kernel open this descriptor for us; nothing else owns it.
    let pidfd = unsafe { OwnedFd::from_raw_fd(pidfd) };
    Ok(Forked::Parent(rc as i32, pidfd))
}

/// In the worker's leader, right after the clone: never returns.
fn child(sock: OwnedFd, fds: Vec<OwnedFd>) -> ! {
    // The spawner's socket is the one descriptor of ours that must never reach the tool.
    drop(sock);
    let Some(SpawnFds {
        channel,
        stdin,
        stdout,
        stderr,
        progress,
    }) = SpawnFds::from_received(fds)
    else {
        std::process::exit(super::wire::SETUP_FAILED);
    };
    let streams = (|| {
        rustix::process::setpgid(None, None)?;
        rustix::stdio::dup2_stdin(&stdin)?;
        rustix::stdio::dup2_stdout(&stdout)?;
        rustix::stdio::dup2_stderr(&stderr)?;
        Ok::<(), rustix::io::Errno>(())
    })();
    drop((stdin, stdout, stderr));
    let mut channel = UnixStream::from(channel);
    if let Err(e) = streams {
        child::fail(
            &mut channel,
            Step::Spawn,
            e.raw_os_error(),
            format!("cannot set up the process group and standard streams: {e}"),
        );
    }
    child::run(channel, progress)
}
