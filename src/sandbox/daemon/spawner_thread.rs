//! The daemon's side of spawning: one long-lived thread owns the spawner process
//! ([`crate::sandbox::spawner`]) and asks it for every worker.
//!
//! The spawner is started by that thread (at once, by [`SpawnerThread::start`], and again
//! after one died), because PR_SET_PDEATHSIG fires when the *thread* that forked a process exits, and a runtime's
//! blocking threads come and go: the spawner and, through `CLONE_PARENT`, every worker
//! template and every worker are children of this thread, and die with it only when the
//! daemon dies. A profile's seccomp programs go to the spawner once, before its first
//! worker (the spawner keeps them for its template); templates of profiles a reload made
//! unused are stopped at the next request.
//!
//! The registry lock is held from the request to the registration of the worker's pid, so the
//! orphan reaper (which reaps under that lock) cannot reap a worker that just exited before
//! it is registered. A spawner that is gone (killed, crashed) is noticed at the next request:
//! a request that could not be delivered is retried once on a new spawner; one that was
//! delivered fails the call ("the spawner died while starting the worker") and the next call
//! starts a new spawner. A spawner that does not answer within [`ANSWER_TIMEOUT`] (2 s) is
//! killed and replaced the same way.

use std::collections::HashSet;
use std::io::{self, IoSlice, IoSliceMut};
use std::mem::MaybeUninit;
use std::os::fd::{AsFd, OwnedFd};
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::sync::{mpsc, Arc, Mutex};
use std::time::Duration;

use rustix::net::{
    AddressFamily, RecvAncillaryBuffer, RecvAncillaryMessage, RecvFlags, SendAncillaryBuffer,
    SendAncillaryMessage, SendFlags, SocketFlags, SocketType,
};
use rustix::process::{Pid, PidfdFlags, Signal};

use super::filters::Programs;
use super::group::{signal_group, Leaders, Pgid};
use super::leftovers::Session;
use crate::sandbox::spawner::SPAWNER_ARG;
use crate::sandbox::wire::spawn_request::{self, Reply, MAX_FDS, REPLY_LEN};

/// A launcher just started.
pub(crate) struct Spawned {
    pub leader: Pgid,
    /// The session of the spawner the leader was forked in.
    pub session: Session,
    pub pidfd: OwnedFd,
    pub stdin: OwnedFd,
    pub stdout: OwnedFd,
    pub stderr: OwnedFd,
}

enum Request {
    /// Start the spawner now, if it is not running.
    WarmUp,
    Spawn {
        /// The profile's programs: which template forks the worker.
        programs: Arc<Programs>,
        /// Templates of forgotten profiles, to be stopped first.
        forget: Vec<u64>,
        channel: OwnedFd,
        /// The write end of the progress pipe, when the caller asked for progress.
        progress: Option<OwnedFd>,
        reply: tokio::sync::oneshot::Sender<io::Result<Spawned>>,
    },
}

/// How long the spawner may take to answer one request before it is replaced.
///
/// The answer is a clone and a message, microseconds; while it is awaited the registry lock
/// is held (see the module comment), so a spawner that was stopped must not stall the
/// daemon's process management for long.
const ANSWER_TIMEOUT: Duration = Duration::from_secs(2);

/// How long the spawner may take to start and say it is ready.
const START_TIMEOUT: Duration = Duration::from_secs(30);

/// The daemon's spawner thread, which owns the spawner process. Made once, by
/// [`super::Sandbox::start`].
#[derive(Debug)]
pub(crate) struct SpawnerThread {
    tx: Mutex<mpsc::Sender<Request>>,
    /// The binary started in spawner mode.
    pub exe: PathBuf,
}

impl SpawnerThread {
    /// Starts the spawner thread and asks it to start the spawner process now, so the first
    /// call does not pay for it.
    pub(crate) fn start(exe: PathBuf, leaders: Arc<Leaders>) -> io::Result<SpawnerThread> {
        let (tx, rx) = mpsc::channel::<Request>();
        let thread_exe = exe.clone();
        std::thread::Builder::new()
            .name("airlock-spawner".into())
            .spawn(move || {
                let (exe, leaders) = (thread_exe, leaders);
                leaders.set_spawner_thread(rustix::thread::gettid().as_raw_nonzero().get());
                let mut process: Option<Process> = None;
                for req in rx {
                    match req {
                        Request::WarmUp => {
                            if let Err(e) = running(&mut process, &exe, &leaders) {
                                tracing::warn!(
                                    "cannot start the spawner process: {}",
                                    crate::report::chain(&e)
                                );
                            }
                        }
                        Request::Spawn {
                            programs,
                            forget,
                            channel,
                            progress,
                            reply,
                        } => {
                            if let Some(p) = process.as_mut() {
                                p.forget(&forget);
                            }
                            let result = spawn_now(
                                &mut process,
                                &exe,
                                &leaders,
                                &programs,
                                channel,
                                progress,
                            );
                            if let Err(Ok(orphan)) = reply.send(result) {
                                // The caller went away: the launcher must not outlive the
                                // request.
                                abandon(&leaders, orphan);
                            }
                        }
                    }
                }
            })?;
        tx.send(Request::WarmUp)
            .map_err(|_| io::Error::other("the spawner thread is gone"))?;
        Ok(SpawnerThread {
            tx: Mutex::new(tx),
            exe,
        })
    }

    fn send(&self, req: Request) -> io::Result<()> {
        self.tx
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .send(req)
            .map_err(|_| io::Error::other("the spawner thread is gone"))
    }

    /// Starts a worker's leader, running the launcher with `channel` as its channel to us,
    /// and `progress` (the write end of the progress pipe) as the one extra descriptor the
    /// tool keeps.
    pub(crate) async fn spawn_launcher(
        &self,
        programs: Arc<Programs>,
        forget: Vec<u64>,
        channel: OwnedFd,
        progress: Option<OwnedFd>,
    ) -> io::Result<Spawned> {
        let (reply, answer) = tokio::sync::oneshot::channel();
        self.send(Request::Spawn {
            programs,
            forget,
            channel,
            progress,
            reply,
        })?;
        answer
            .await
            .map_err(|_| io::Error::other("the spawner thread dropped the request"))?
    }
}

/// The running spawner process.
struct Process {
    sock: OwnedFd,
    pidfd: OwnedFd,
    pid: i32,
    /// Its session (it starts one), which every worker and template it forks is in.
    session: Session,
    /// The templates this spawner has the programs of.
    templates: HashSet<u64>,
}

impl Process {
    fn start(exe: &Path, leaders: &Leaders) -> io::Result<Process> {
        let (ours, theirs) = rustix::net::socketpair(
            AddressFamily::UNIX,
            SocketType::SEQPACKET,
            SocketFlags::CLOEXEC,
            None,
        )?;
        let me = rustix::process::getpid().as_raw_nonzero().get();
        // Held until the pidfd is open: the orphan reaper reaps only under this lock, so the
        // spawner's pid cannot be reaped and recycled in between.
        let registry = leaders.lock();
        // The socket is the spawner's stdin: std dup2s it there in the child, so it is never
        // inheritable in the daemon.
        let mut command = Command::new(exe);
        // Socket activation is the daemon's alone (`systemd::take_listener` removed these
        // already; an embedder may not have called it).
        for k in crate::systemd::LISTEN_VARS {
            command.env_remove(k);
        }
        let child = command
            .arg(SPAWNER_ARG)
            .arg(me.to_string())
            .stdin(Stdio::from(theirs))
            .stdout(Stdio::null())
            .stderr(Stdio::inherit())
            .spawn()
            .map_err(|e| io::Error::new(e.kind(), format!("{}: {e}", exe.display())))?;
        // The command holds our copy of the spawner's end of the socket: closed now, so that
        // a spawner that exits at start is seen at once (EOF), not after START_TIMEOUT.
        drop(command);
        let pid = child.id() as i32;
        let pidfd = Pid::from_raw(pid)
            .ok_or_else(|| io::Error::other("the spawner has pid 0"))
            .and_then(|p| Ok(rustix::process::pidfd_open(p, PidfdFlags::empty())?));
        drop(registry);
        // `child` is dropped without waiting: std never reaps on drop; the orphan reaper (or
        // `stop`) reaps the spawner once it exits.
        drop(child);
        // Its start time, read once: with its pid, its session's record for the next start's
        // sweep (the pid cannot be recycled while we hold the unreaped child).
        let start = super::procfs::read_stat(pid).map_or(0, |s| s.start);
        let process = Process {
            sock: ours,
            pidfd: pidfd?,
            pid,
            session: Session { sid: pid, start },
            templates: HashSet::new(),
        };
        let timeout = |t| {
            rustix::net::sockopt::set_socket_timeout(
                &process.sock,
                rustix::net::sockopt::Timeout::Recv,
                Some(t),
            )
        };
        // The start is an execve of the daemon's binary: a loaded host may take a while.
        timeout(START_TIMEOUT)?;
        let mut ready = [0u8; 1];
        let n = rustix::net::recv(&process.sock, &mut ready, RecvFlags::empty())
            .map_err(io::Error::from)
            .and_then(|n| Ok((n, timeout(ANSWER_TIMEOUT)?)));
        match n {
            Ok(((1, _), ())) if ready[0] == spawn_request::READY => Ok(process),
            Ok(_) => {
                process.stop();
                Err(io::Error::other(
                    "the spawner process exited at start (see its message on stderr)",
                ))
            }
            Err(e) => {
                process.stop();
                Err(io::Error::new(
                    e.kind(),
                    format!("the spawner did not start: {e}"),
                ))
            }
        }
    }

    /// Stops the templates of `ids` (forgotten profiles); nothing to answer. A spawner that
    /// is gone took them with it.
    fn forget(&mut self, ids: &[u64]) {
        for id in ids {
            if self.templates.remove(id) {
                let _ = rustix::net::send(
                    &self.sock,
                    &spawn_request::forget_message(*id),
                    SendFlags::NOSIGNAL,
                );
            }
        }
    }

    /// One request: the worker's pid and pidfd, forked from the template of `programs`
    /// (whose programs go to the spawner first, once).
    fn spawn(
        &mut self,
        programs: &Programs,
        channel: &OwnedFd,
        stdin: &OwnedFd,
        stdout: &OwnedFd,
        stderr: &OwnedFd,
        progress: Option<&OwnedFd>,
    ) -> Result<(Pgid, OwnedFd), Failed> {
        if !self.templates.contains(&programs.id) {
            let message =
                spawn_request::template_message(programs.id, &programs.template, &programs.seal);
            rustix::net::send(&self.sock, &message, SendFlags::NOSIGNAL)
                .map_err(|e| Failed::Undelivered(e.into()))?;
            self.templates.insert(programs.id);
        }
        let fds = spawn_request::request_fds(channel, stdin, stdout, stderr, progress);
        let mut space = [MaybeUninit::uninit(); rustix::cmsg_space!(ScmRights(MAX_FDS))];
        let mut control = SendAncillaryBuffer::new(&mut space);
        control.push(SendAncillaryMessage::ScmRights(&fds));
        rustix::net::sendmsg(
            &self.sock,
            &[IoSlice::new(&spawn_request::spawn_message(programs.id))],
            &mut control,
            SendFlags::NOSIGNAL,
        )
        .map_err(|e| Failed::Undelivered(e.into()))?;

        let mut answer = [0u8; REPLY_LEN];
        let mut space = [MaybeUninit::uninit(); rustix::cmsg_space!(ScmRights(1))];
        let mut control = RecvAncillaryBuffer::new(&mut space);
        let got = loop {
            match rustix::net::recvmsg(
                &self.sock,
                &mut [IoSliceMut::new(&mut answer)],
                &mut control,
                RecvFlags::CMSG_CLOEXEC,
            ) {
                Err(rustix::io::Errno::INTR) => continue,
                other => break other,
            }
        };
        let got = got.map_err(|e| {
            let e = io::Error::from(e);
            let what = if e.kind() == io::ErrorKind::WouldBlock {
                format!("the spawner did not answer within {ANSWER_TIMEOUT:?}")
            } else {
                format!("cannot read the spawner's answer: {e}")
            };
            Failed::Lost(io::Error::new(e.kind(), what))
        })?;
        let mut pidfd = None;
        for message in control.drain() {
            if let RecvAncillaryMessage::ScmRights(received) = message {
                for fd in received {
                    pidfd.get_or_insert(fd);
                }
            }
        }
        match (
            got.bytes,
            Reply::decode(&answer[..got.bytes.min(REPLY_LEN)]),
            pidfd,
        ) {
            (0, _, _) => Err(Failed::Lost(io::Error::other(
                "the spawner process died while starting the worker",
            ))),
            (_, Some(Reply::Spawned(number)), Some(pidfd)) => match Pgid::from_raw(number) {
                Some(leader) => Ok((leader, pidfd)),
                None => Err(Failed::Lost(io::Error::other(format!(
                    "the spawner answered pid {number}"
                )))),
            },
            (_, Some(Reply::Refused(number)), _) => {
                Err(Failed::Refused(io::Error::from_raw_os_error(number)))
            }
            _ => Err(Failed::Lost(io::Error::other(
                "the spawner's answer is malformed",
            ))),
        }
    }

    /// Kills the spawner (through its pidfd: never a recycled pid) and reaps it if the orphan
    /// reaper has not already.
    fn stop(self) {
        let _ = rustix::process::pidfd_send_signal(&self.pidfd, Signal::KILL);
        let _ = rustix::process::waitid(
            rustix::process::WaitId::PidFd(self.pidfd.as_fd()),
            rustix::process::WaitIdOptions::EXITED,
        );
        tracing::debug!(pid = self.pid, "spawner process stopped");
    }
}

/// How a request failed.
enum Failed {
    /// The spawner is alive and said no (its clone failed): it stays.
    Refused(io::Error),
    /// Not delivered (the spawner is gone): safe to retry on a new one.
    Undelivered(io::Error),
    /// Delivered, but no answer (the spawner died or hangs): the call fails.
    Lost(io::Error),
}

/// The running spawner, started if there is none.
fn running<'a>(
    process: &'a mut Option<Process>,
    exe: &Path,
    leaders: &Leaders,
) -> io::Result<&'a mut Process> {
    if process.is_none() {
        *process = Some(Process::start(exe, leaders)?);
    }
    process
        .as_mut()
        .ok_or_else(|| io::Error::other("no spawner process"))
}

fn spawn_now(
    process: &mut Option<Process>,
    exe: &Path,
    registry: &Leaders,
    programs: &Programs,
    channel: OwnedFd,
    progress: Option<OwnedFd>,
) -> io::Result<Spawned> {
    let (stdin_r, stdin_w) = rustix::pipe::pipe_with(rustix::pipe::PipeFlags::CLOEXEC)?;
    let (stdout_r, stdout_w) = rustix::pipe::pipe_with(rustix::pipe::PipeFlags::CLOEXEC)?;
    let (stderr_r, stderr_w) = rustix::pipe::pipe_with(rustix::pipe::PipeFlags::CLOEXEC)?;
    let mut retried = false;
    loop {
        let spawner = running(process, exe, registry)?;
        let mut leaders = registry.lock();
        let error = match spawner.spawn(
            programs,
            &channel,
            &stdin_r,
            &stdout_w,
            &stderr_w,
            progress.as_ref(),
        ) {
            Ok((leader, pidfd)) => {
                leaders.insert(leader);
                return Ok(Spawned {
                    leader,
                    session: spawner.session,
                    pidfd,
                    stdin: stdin_w,
                    stdout: stdout_r,
                    stderr: stderr_r,
                });
            }
            Err(Failed::Refused(e)) => {
                return Err(io::Error::new(
                    e.kind(),
                    format!("the spawner cannot fork the worker: {e}"),
                ));
            }
            Err(Failed::Undelivered(e)) if !retried => e,
            Err(Failed::Undelivered(e) | Failed::Lost(e)) => {
                drop(leaders);
                tracing::warn!(
                    "the spawner process is gone or stuck ({}); replacing it",
                    crate::report::chain(&e)
                );
                if let Some(old) = process.take() {
                    old.stop();
                }
                return Err(e);
            }
        };
        drop(leaders);
        tracing::warn!("the spawner process is gone ({error}); replacing it");
        if let Some(old) = process.take() {
            old.stop();
        }
        retried = true;
    }
}

/// For a launcher nobody will use (it has no children yet: it waits for its spec): SIGKILL
/// and a blocking reap.
fn abandon(registry: &Leaders, s: Spawned) {
    signal_group(s.leader, &s.pidfd, Signal::KILL);
    let mut leaders = registry.lock();
    let _ = rustix::process::waitid(
        rustix::process::WaitId::PidFd(s.pidfd.as_fd()),
        rustix::process::WaitIdOptions::EXITED,
    );
    leaders.remove(&s.leader);
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_spawner_that_exits_at_start_is_an_error_and_is_reaped() {
        let leaders = Leaders::default();
        let e = match Process::start(Path::new("/bin/false"), &leaders) {
            Ok(p) => {
                p.stop();
                panic!("/bin/false was taken for a spawner")
            }
            Err(e) => e,
        };
        assert!(
            e.to_string()
                .contains("the spawner process exited at start"),
            "{e}"
        );
        // Nothing was left registered, nor a zombie to reap: `stop` reaped it.
        assert!(leaders.lock().is_empty());
    }

    #[test]
    fn a_missing_spawner_executable_is_an_error_naming_it() {
        let leaders = Leaders::default();
        let e = match Process::start(Path::new("/nonexistent/airlock"), &leaders) {
            Ok(p) => {
                p.stop();
                panic!("a missing executable started")
            }
            Err(e) => e,
        };
        assert_eq!(e.kind(), io::ErrorKind::NotFound);
        assert!(e.to_string().contains("/nonexistent/airlock"), "{e}");
    }

    #[test]
    fn a_spawner_that_never_says_ready_is_not_taken_for_one() {
        // Exits with something other than the ready byte on the socket (its stdout is
        // /dev/null; its stdin is the socket): a wrong first message.
        let leaders = Leaders::default();
        let script =
            std::env::temp_dir().join(format!("airlock-not-a-spawner-{}", std::process::id()));
        std::fs::write(&script, "#!/bin/sh\nprintf x >&0\n").expect("write the script");
        std::fs::set_permissions(&script, std::os::unix::fs::PermissionsExt::from_mode(0o755))
            .expect("chmod");
        let started = Process::start(&script, &leaders);
        let _ = std::fs::remove_file(&script);
        match started {
            Ok(p) => {
                p.stop();
                panic!("a process that answered 'x' was taken for a spawner")
            }
            Err(e) => assert!(e.to_string().contains("exited at start"), "{e}"),
        }
    }
}
