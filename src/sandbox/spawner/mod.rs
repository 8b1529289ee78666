//! The spawner process: a single-threaded copy of the daemon's binary, started once (argv
//! `[exe, SPAWNER_ARG, DAEMON_PID]`), that keeps one worker template per profile (and uid
//! mode) and has every worker forked from its template, so no worker costs an `execve` of
//! the daemon, nor the conversion and JIT compilation of its seccomp stack.
//!
//! It speaks the protocol of [`crate::sandbox::wire::spawn_request`] over a `SOCK_SEQPACKET`
//! pair that is its stdin at start.
//!
//! A template is forked from the spawner with `clone(CLONE_PARENT | CLONE_PIDFD)`: its parent
//! is the daemon (the thread that started the spawner). It keeps only its socket to the
//! spawner, runs the template steps ([`child::template`]: PDEATHSIG + parent check, the
//! capability lock and empty bounding set, no_new_privs, the profile's seccomp stack with the
//! launcher's calls carved out), says it is ready, and creates each worker posix_spawn's way:
//! it first reads the worker's spec from its channel and prepares everything that is not
//! per-process state ([`child::prepare`]: C strings, argv and envp, rlimits, the Landlock
//! ruleset, whose profile paths it opened once, at its first worker: [`child::Resolved`]),
//! then clones the worker with `CLONE_VM | CLONE_VFORK | CLONE_PARENT |
//! CLONE_PIDFD` on a stack of its own (the worker is the daemon's child too, covered by its
//! subreaper and kill-and-confirm, its PDEATHSIG following the daemon). The worker shares the
//! template's memory and runs only system calls on the prepared data until `execve`; the
//! template is suspended until then (or until the worker exits), frees what it prepared, and
//! passes the pidfd back with the pid. No page table is copied, and the worker faults in
//! none of the template's pages. The spawner forwards the daemon's request and the
//! template's answer.
//!
//! Sharing memory, and how each end can fail: the worker writes only its own stack (the
//! template's worker stack, one worker at a time) and `errno` (the suspended template's,
//! which it does not read); it allocates nothing, takes no lock and never unwinds, and a
//! failing step is reported from a buffer on that stack before `_exit`. A worker killed
//! before its `execve` releases the template (CLONE_VFORK's wait ends at the exit too); a
//! template killed while suspended dies at once (the wait is killable) and the worker goes
//! on with the memory it holds, answered for by nobody: the daemon's call fails ("the
//! spawner died") and closes its channel, so the worker's `ok` report dies of SIGPIPE
//! before any `execve`, or, past it, the group is killed with the others the orphan reaper
//! finds. Before its uid switch the worker makes itself non-dumpable, so no process of the
//! worker's uid can read the template's memory through /proc or ptrace.
//!
//! A template is created at the first worker of its profile, stopped (SIGKILL through its
//! pidfd; the daemon's orphan reaper reaps it) when the daemon forgets its profile after a
//! reload, and replaced when it is found dead: a request it could not take is retried once
//! on a new template; one it took but never answered fails that call only. A template exits
//! when the spawner's end of its socket closes (the spawner died) and, by PDEATHSIG, when the
//! daemon dies.
//!
//! The worker's leader closes the template's socket, takes the three streams as 0, 1 and 2,
//! leads a new process group, and runs [`child::launch`], whose first step re-checks all of
//! that, and whose close-range step leaves the tool nothing else (but the progress pipe,
//! moved to fd 3 or 4 and named by `$AIRLOCK_PROGRESS_FD`).

use std::collections::HashMap;
use std::io::{IoSlice, IoSliceMut, Write};
use std::mem::MaybeUninit;
use std::os::fd::{AsFd, AsRawFd, BorrowedFd, FromRawFd, OwnedFd, RawFd};
use std::time::Duration;

use rustix::io::Errno;
use rustix::net::{
    AddressFamily, RecvAncillaryBuffer, RecvAncillaryMessage, RecvFlags, SendAncillaryBuffer,
    SendAncillaryMessage, SendFlags, SocketFlags, SocketType,
};
use rustix::process::Signal;
use seccompiler::BpfProgram;

use super::child;
use super::wire::launch::decode_program;
use super::wire::spawn_request::{
    self, Reply, Request, SpawnFds, MAX_FDS, MAX_REQUEST, READY, REPLY_LEN,
};
use super::wire::Step;

/// How long a template may take to start, or to answer one request, before it is replaced
/// (the daemon gives the spawner 2 s for the whole request).
const TEMPLATE_TIMEOUT: Duration = Duration::from_millis(1500);

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
    // A session of our own: it holds exactly us, our templates and every worker with its
    // descendants (workers cannot setsid, and nobody can join a session), which is what the
    // daemon's record of it tells the next start to sweep after a crash. It also takes us out
    // of the daemon's process group and terminal.
    rustix::process::setsid()?;
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

    let mut templates: HashMap<u64, Template> = HashMap::new();
    let mut message = vec![0u8; MAX_REQUEST];
    loop {
        let mut space = [MaybeUninit::uninit(); rustix::cmsg_space!(ScmRights(MAX_FDS))];
        let mut control = RecvAncillaryBuffer::new(&mut space);
        let got = rustix::net::recvmsg(
            &sock,
            &mut [IoSliceMut::new(&mut message)],
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
        let request = if got.flags.contains(rustix::net::ReturnFlags::TRUNC) {
            None
        } else {
            spawn_request::decode_request(&message[..got.bytes], fds.len())
        };
        let reply = match request {
            Some(Request::Template { id, stack, seal }) => {
                let programs = |p: Vec<spawn_request::Encoded>| -> Vec<BpfProgram> {
                    p.iter().map(|p| decode_program(p)).collect()
                };
                let new = Template {
                    stack: programs(stack),
                    seal: programs(seal),
                    running: None,
                };
                if let Some(old) = templates.insert(id, new) {
                    old.stop();
                }
                continue;
            }
            Some(Request::Forget(id)) => {
                if let Some(old) = templates.remove(&id) {
                    old.stop();
                }
                continue;
            }
            Some(Request::Spawn(id)) => match templates.get_mut(&id) {
                Some(template) => template.spawn(daemon, &fds),
                // The daemon sends a template before its first worker: this one is unknown.
                None => Err(Errno::NOENT),
            },
            None => Err(Errno::INVAL),
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

/// One profile's template, as the spawner knows it.
struct Template {
    /// The profile's stack with the launcher's calls carved out, which the template installs.
    stack: Vec<BpfProgram>,
    /// What each worker installs last.
    seal: Vec<BpfProgram>,
    running: Option<Running>,
}

/// A live template process.
struct Running {
    sock: OwnedFd,
    pidfd: OwnedFd,
}

/// How forwarding a request to a template failed.
enum Forward {
    /// The template forked nothing and said why: it stays.
    Refused(Errno),
    /// Not delivered (the template is gone): safe to retry on a new one.
    Undelivered(Errno),
    /// Delivered, but no answer: the call fails.
    Lost(Errno),
}

impl Template {
    /// Has the template fork a worker with `fds`: its pid and pidfd. A template found dead
    /// before it took the request is replaced and the request retried once.
    fn spawn(&mut self, daemon: i32, fds: &[OwnedFd]) -> Result<(i32, OwnedFd), Errno> {
        let mut retried = false;
        loop {
            let running = match &self.running {
                Some(r) => r,
                None => self
                    .running
                    .insert(start_template(daemon, &self.stack, &self.seal)?),
            };
            match forward(running, fds) {
                Ok(spawned) => return Ok(spawned),
                Err(Forward::Refused(e)) => return Err(e),
                Err(Forward::Undelivered(_)) if !retried => {
                    self.stop_running();
                    retried = true;
                }
                Err(Forward::Undelivered(e) | Forward::Lost(e)) => {
                    self.stop_running();
                    return Err(e);
                }
            }
        }
    }

    fn stop_running(&mut self) {
        if let Some(r) = self.running.take() {
            r.stop();
        }
    }

    fn stop(mut self) {
        self.stop_running();
    }
}

impl Running {
    /// SIGKILL through the pidfd (never a recycled pid). The template is the daemon's child:
    /// the daemon's orphan reaper reaps it.
    fn stop(self) {
        let _ = rustix::process::pidfd_send_signal(&self.pidfd, Signal::KILL);
    }
}

/// Forks a template (the daemon's child, through CLONE_PARENT) and waits for its word.
fn start_template(
    daemon: i32,
    stack: &[BpfProgram],
    seal: &[BpfProgram],
) -> Result<Running, Errno> {
    let (ours, theirs) = rustix::net::socketpair(
        AddressFamily::UNIX,
        SocketType::SEQPACKET,
        SocketFlags::CLOEXEC,
        None,
    )?;
    let (_, pidfd) = match clone_parent()? {
        Forked::Child => template_main(theirs, daemon, stack, seal),
        Forked::Parent(pid, pidfd) => (pid, pidfd),
    };
    drop(theirs);
    let running = Running { sock: ours, pidfd };
    let ready = rustix::net::sockopt::set_socket_timeout(
        &running.sock,
        rustix::net::sockopt::Timeout::Recv,
        Some(TEMPLATE_TIMEOUT),
    )
    .and_then(|()| {
        let mut answer = [0u8; REPLY_LEN];
        let n = recv_retrying(&running.sock, &mut answer)?;
        match (n, Reply::decode(&answer[..n])) {
            (1, _) if answer[0] == READY => Ok(()),
            (_, Some(Reply::Refused(errno))) => Err(Errno::from_raw_os_error(errno)),
            // Exited (EOF) or said something else.
            _ => Err(Errno::PIPE),
        }
    });
    match ready {
        Ok(()) => Ok(running),
        Err(e) => {
            running.stop();
            Err(e)
        }
    }
}

fn recv_retrying(sock: &OwnedFd, buf: &mut [u8]) -> Result<usize, Errno> {
    loop {
        match rustix::net::recv(sock, &mut *buf, RecvFlags::empty()) {
            Err(Errno::INTR) => continue,
            other => return other.map(|(n, _)| n),
        }
    }
}

/// One worker request to a running template, and its answer.
fn forward(t: &Running, fds: &[OwnedFd]) -> Result<(i32, OwnedFd), Forward> {
    let borrowed: Vec<_> = fds.iter().map(|f| f.as_fd()).collect();
    let mut space = [MaybeUninit::uninit(); rustix::cmsg_space!(ScmRights(MAX_FDS))];
    let mut control = SendAncillaryBuffer::new(&mut space);
    control.push(SendAncillaryMessage::ScmRights(&borrowed));
    rustix::net::sendmsg(
        &t.sock,
        &[IoSlice::new(&spawn_request::spawn_message(0))],
        &mut control,
        SendFlags::NOSIGNAL,
    )
    .map_err(Forward::Undelivered)?;
    let mut answer = [0u8; REPLY_LEN];
    let mut space = [MaybeUninit::uninit(); rustix::cmsg_space!(ScmRights(1))];
    let mut control = RecvAncillaryBuffer::new(&mut space);
    let got = loop {
        match rustix::net::recvmsg(
            &t.sock,
            &mut [IoSliceMut::new(&mut answer)],
            &mut control,
            RecvFlags::CMSG_CLOEXEC,
        ) {
            Err(Errno::INTR) => continue,
            other => break other,
        }
    }
    .map_err(Forward::Lost)?;
    let mut pidfd = None;
    for message in control.drain() {
        if let RecvAncillaryMessage::ScmRights(received) = message {
            for fd in received {
                pidfd.get_or_insert(fd);
            }
        }
    }
    match (Reply::decode(&answer[..got.bytes.min(REPLY_LEN)]), pidfd) {
        (Some(Reply::Spawned(pid)), Some(pidfd)) => Ok((pid, pidfd)),
        (Some(Reply::Refused(errno)), _) => Err(Forward::Refused(Errno::from_raw_os_error(errno))),
        // EOF (it died with the request) or garbage.
        _ => Err(Forward::Lost(Errno::PIPE)),
    }
}

/// The template process, just forked from the spawner: never returns.
fn template_main(sock: OwnedFd, daemon: i32, stack: &[BpfProgram], seal: &[BpfProgram]) -> ! {
    // Only our socket is ours: the daemon's socket, the other templates' sockets and pidfds
    // and the descriptors of the request in flight are the spawner's. The socket moves to 3
    // (close-on-exec) and everything above is closed, so a worker's descriptors arrive at 4
    // and up, and its channel is never 3 (the progress pipe gets 3). (The owners of what is
    // closed, in the spawner's frames, are never dropped here: this function never returns.)
    let fd = sock.as_raw_fd();
    let moved = if fd == 3 {
        0
    } else {
        // SAFETY: dup3 takes two integers and touches no memory of ours. Whatever 3 held is
        // the spawner's (see above) and is replaced here; nothing in this process uses it.
        unsafe { libc::dup3(fd, 3, libc::O_CLOEXEC) }
    };
    if moved < 0 {
        // Nothing to answer on: the spawner sees our end close.
        std::process::exit(super::wire::SETUP_FAILED);
    }
    let closed = super::sys::close_range(4, u32::MAX);
    let sock = if fd == 3 {
        sock
    } else {
        // The old number is closed (it was above 3): its owner must not close it again.
        std::mem::forget(sock);
        // SAFETY: 3 is the copy dup3 just made, owned by nobody else.
        unsafe { OwnedFd::from_raw_fd(3) }
    };
    let say = |reply: Reply| {
        let _ = rustix::net::send(&sock, &reply.encode(), SendFlags::NOSIGNAL);
    };
    if let Err(e) = closed {
        say(Reply::Refused(e.raw_os_error().unwrap_or(libc::EBADF)));
        std::process::exit(super::wire::SETUP_FAILED);
    }
    // Its name in /proc/PID/comm: its command line is the spawner's.
    let _ = rustix::thread::set_name(c"airlock-tmpl");
    // The workers' stack, mapped before our filters (which need not allow mprotect).
    let worker_stack = match WorkerStack::new() {
        Ok(stack) => stack,
        Err(e) => {
            say(Reply::Refused(e.raw_os_error()));
            std::process::exit(super::wire::SETUP_FAILED);
        }
    };
    if let Err((step, errno, message)) = child::template(daemon, stack) {
        let _ = writeln!(
            std::io::stderr(),
            "airlock template: {}: {message}",
            step.as_str()
        );
        say(Reply::Refused(errno));
        std::process::exit(super::wire::SETUP_FAILED);
    }
    if rustix::net::send(&sock, &[READY], SendFlags::NOSIGNAL).is_err() {
        std::process::exit(0);
    }
    // The profile's Landlock paths, resolved once for all our workers.
    let mut resolved = child::Resolved::default();
    let mut tag = [0u8; 9];
    loop {
        let mut space = [MaybeUninit::uninit(); rustix::cmsg_space!(ScmRights(MAX_FDS))];
        let mut control = RecvAncillaryBuffer::new(&mut space);
        let got = match rustix::net::recvmsg(
            &sock,
            &mut [IoSliceMut::new(&mut tag)],
            &mut control,
            RecvFlags::CMSG_CLOEXEC,
        ) {
            Ok(got) => got,
            Err(Errno::INTR) => continue,
            Err(_) => std::process::exit(0),
        };
        if got.bytes == 0 {
            // The spawner is gone, or forgot us.
            std::process::exit(0);
        }
        let mut fds: Vec<OwnedFd> = Vec::with_capacity(MAX_FDS);
        for message in control.drain() {
            if let RecvAncillaryMessage::ScmRights(received) = message {
                fds.extend(received);
            }
        }
        let reply = match spawn_request::decode_request(&tag[..got.bytes], fds.len()) {
            Some(Request::Spawn(_)) => match SpawnFds::from_received(fds) {
                Some(fds) => spawn_worker(&worker_stack, &fds, seal, &mut resolved),
                None => Err(Errno::INVAL),
            },
            _ => Err(Errno::INVAL),
        };
        let sent = match reply {
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
                )
                .map(drop)
            }
            Err(errno) => rustix::net::send(
                &sock,
                &Reply::Refused(errno.raw_os_error()).encode(),
                SendFlags::NOSIGNAL,
            )
            .map(drop),
        };
        if sent.is_err() {
            std::process::exit(0);
        }
    }
}

/// In the template: prepares the worker's plan (the spec read from its channel, see
/// [`child::prepare`]), then creates the worker with `clone(CLONE_VM | CLONE_VFORK |
/// CLONE_PARENT | CLONE_PIDFD)` on `stack`: the daemon's child, sharing our memory, while we
/// are suspended until it `execve`s or exits. Then what was prepared is freed, and our
/// copies of the request's descriptors closed. Returns the worker's pid and pidfd.
fn spawn_worker(
    stack: &WorkerStack,
    fds: &SpawnFds,
    seal: &[BpfProgram],
    resolved: &mut child::Resolved,
) -> Result<(i32, OwnedFd), Errno> {
    let prepared = child::prepare(
        fds.channel.as_fd(),
        fds.progress.as_ref().map(|p| p.as_raw_fd()),
        seal,
        resolved,
    );
    let args = WorkerArgs {
        prepared: &prepared,
        channel: fds.channel.as_raw_fd(),
        stdin: fds.stdin.as_raw_fd(),
        stdout: fds.stdout.as_raw_fd(),
        stderr: fds.stderr.as_raw_fd(),
    };
    let mut pidfd: libc::c_int = -1;
    // The exit signal stays 0: with CLONE_PARENT the worker gets ours (SIGCHLD, to the
    // daemon). The legacy clone: our filters make clone3 fail (see `clone_parent`).
    let flags = libc::CLONE_VM | libc::CLONE_VFORK | libc::CLONE_PARENT | libc::CLONE_PIDFD;
    // SAFETY: the worker runs `worker_entry` on `stack` (ours, unused by anyone else: the
    // template is single-threaded and suspended by CLONE_VFORK until the worker execs or
    // exits, so one worker at a time runs on it), with `args`, which outlives it for the same
    // reason. It shares our memory but writes only its stack: it reads `prepared` and the
    // descriptor numbers, makes system calls on them, and never returns into our frames
    // (`worker_entry` execs or _exits). The kernel writes the pidfd into `pidfd` before
    // clone returns.
    let rc = unsafe {
        libc::clone(
            worker_entry,
            stack.top(),
            flags,
            std::ptr::addr_of!(args) as *mut libc::c_void,
            std::ptr::addr_of_mut!(pidfd),
        )
    };
    if rc < 0 {
        return Err(Errno::from_io_error(&std::io::Error::last_os_error()).unwrap_or(Errno::INVAL));
    }
    drop(prepared);
    // SAFETY: CLONE_PIDFD made the kernel open this descriptor for us; nothing else owns it.
    let pidfd = unsafe { OwnedFd::from_raw_fd(pidfd) };
    Ok((rc, pidfd))
}

/// What a worker gets from its template: the prepared plan and the request's descriptors
/// (ours, open in the worker's copy of our descriptor table).
struct WorkerArgs<'a> {
    prepared: &'a child::Prepared,
    channel: RawFd,
    stdin: RawFd,
    stdout: RawFd,
    stderr: RawFd,
}

/// The worker's first frame, on the template's worker stack: never returns.
extern "C" fn worker_entry(arg: *mut libc::c_void) -> libc::c_int {
    // SAFETY: `arg` is the `WorkerArgs` of `spawn_worker`, alive (in the template's memory,
    // which we share) until we exec or exit, and only read here.
    let args = unsafe { &*(arg as *const WorkerArgs<'_>) };
    worker(args)
}

/// In the worker's leader, sharing the template's memory: nothing here allocates.
fn worker(args: &WorkerArgs<'_>) -> ! {
    // The template's socket (at 3) is the one descriptor of ours that must never reach the
    // tool: closed first (everything else of ours is close-on-exec, and marked so again by
    // the close-fds step).
    //
    // SAFETY: close takes an integer; 3 is the template's socket in our own copy of its
    // descriptor table, which nothing in this process uses.
    unsafe { libc::close(TEMPLATE_SOCKET) };
    let streams = (|| {
        rustix::process::setpgid(None, None)?;
        // SAFETY: the three are the request's stream descriptors, open in our table until
        // exec (close-on-exec), borrowed only for the calls.
        let (stdin, stdout, stderr) = unsafe {
            (
                BorrowedFd::borrow_raw(args.stdin),
                BorrowedFd::borrow_raw(args.stdout),
                BorrowedFd::borrow_raw(args.stderr),
            )
        };
        rustix::stdio::dup2_stdin(stdin)?;
        rustix::stdio::dup2_stdout(stdout)?;
        rustix::stdio::dup2_stderr(stderr)?;
        Ok::<(), Errno>(())
    })();
    if let Err(e) = streams {
        child::fail_early(
            args.channel,
            Step::Spawn,
            "cannot set up the process group and standard streams",
            e,
        );
    }
    child::launch(args.prepared, args.channel)
}

/// Where a template keeps its socket to the spawner.
const TEMPLATE_SOCKET: RawFd = 3;

/// The stack each worker runs on until its `execve`, mapped once per template (before its
/// filters), with a guard page below it.
struct WorkerStack {
    base: *mut libc::c_void,
    len: usize,
}

impl WorkerStack {
    /// The launcher's deepest path (Landlock, the seal, a report line of 1 KiB) needs a few
    /// KiB; this leaves ample room.
    const SIZE: usize = 256 * 1024;

    fn new() -> Result<WorkerStack, Errno> {
        // SAFETY: sysconf reads a constant of the system.
        let page = match unsafe { libc::sysconf(libc::_SC_PAGESIZE) } {
            n if n > 0 => n as usize,
            _ => 4096,
        };
        let len = Self::SIZE + page;
        // SAFETY: a fresh anonymous private mapping at an address the kernel picks: it
        // aliases nothing of ours.
        let base = unsafe {
            libc::mmap(
                std::ptr::null_mut(),
                len,
                libc::PROT_READ | libc::PROT_WRITE,
                libc::MAP_PRIVATE | libc::MAP_ANONYMOUS | libc::MAP_STACK,
                -1,
                0,
            )
        };
        if base == libc::MAP_FAILED {
            return Err(Errno::NOMEM);
        }
        // The lowest page is the guard: a worker that overflowed its stack faults there
        // instead of writing into our memory.
        //
        // SAFETY: the first page of the mapping just made, which nothing uses.
        if unsafe { libc::mprotect(base, page, libc::PROT_NONE) } != 0 {
            return Err(Errno::NOMEM);
        }
        Ok(WorkerStack { base, len })
    }

    /// The top of the stack (it grows down), 16-byte aligned.
    fn top(&self) -> *mut libc::c_void {
        let top = (self.base as usize + self.len) & !15;
        top as *mut libc::c_void
    }
}

enum Forked {
    Child,
    Parent(i32, OwnedFd),
}

/// `clone3(CLONE_PARENT | CLONE_PIDFD)`, fork-like (no new stack), or the legacy `clone`
/// with the same flags where clone3 is filtered out (systemd's `RestrictNamespaces=` makes it
/// fail with ENOSYS, since a filter cannot read clone3's flags; so does the seccomp stack of
/// a template, which forks its workers here too). A failure goes back to the
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
    // fresh exec, no runtime, no thread started; a template is a fork of it and starts none), so no lock of the allocator or of std is
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
