//! The daemon's requests to the spawner process ([`crate::sandbox::spawner`]), made by the
//! calling task itself over the spawner's socket with async I/O: no thread hand-off per
//! spawn (the spawner thread, [`super::spawner_thread`], only starts and replaces the
//! process).
//!
//! A profile's seccomp programs go to the spawner once, before its first worker (the spawner
//! keeps them for its template); templates of profiles a reload made unused are stopped at
//! the next request. Requests on one spawner are made one at a time (the spawner answers in
//! order). The spec travels on the launcher's channel alongside the request (the template reads
//! it before it creates the worker, and answers once the worker has exec'd the tool). A call
//! that goes away after its request was sent leaves the answer owed on the connection, and a
//! task settles it at once: it reads the answer and kills and reaps the worker's group it
//! names ([`abandon`]). Such a worker rarely runs the tool: its `ok` report to a channel the
//! call closed fails first (SIGPIPE); if the call went away after that, the tool dies with
//! its group as soon as the answer is in.
//!
//! A spawn in flight holds off the reaping of the spawner thread's children
//! ([`Leaders::begin_spawn`]) from its request to the registration of the worker's leader, so
//! the orphan reaper cannot reap a launcher that exited before it was registered. A spawner
//! that is gone (killed, crashed) is noticed at the next request: a request that could not be
//! delivered is retried once on a new spawner; one that was delivered fails the call ("the
//! spawner died while starting the worker") and the next call starts a new spawner. A
//! spawner that does not answer within [`ANSWER_TIMEOUT`] (2 s) is killed and replaced the
//! same way.

use std::collections::HashSet;
use std::io::{self, IoSlice, IoSliceMut};
use std::mem::MaybeUninit;
use std::os::fd::{AsFd, OwnedFd};
use std::sync::Arc;
use std::time::Duration;

use rustix::net::{
    RecvAncillaryBuffer, RecvAncillaryMessage, RecvFlags, SendAncillaryBuffer,
    SendAncillaryMessage, SendFlags,
};
use rustix::process::Signal;
use tokio::io::unix::AsyncFd;

use super::filters::Programs;
use super::group::{signal_group, Leaders, Pgid, Spawning};
use super::leftovers::Session;
use super::spawner_thread::SpawnerThread;
use crate::sandbox::wire::spawn_request::{self, Reply, MAX_FDS, REPLY_LEN};

/// A launcher just started.
pub(crate) struct Spawned {
    pub leader: Pgid,
    pub pidfd: OwnedFd,
    pub stdin: OwnedFd,
    pub stdout: OwnedFd,
    pub stderr: OwnedFd,
}

/// How long the spawner may take to answer one request before it is replaced.
///
/// The answer is a clone and a message, microseconds; a spawner that was stopped must not
/// hold the calls queued behind it for long.
const ANSWER_TIMEOUT: Duration = Duration::from_secs(2);

/// The daemon's end of a running spawner's socket.
#[derive(Debug)]
pub(crate) struct Connection {
    sock: AsyncFd<OwnedFd>,
    /// The spawner's session, which every worker it forks is in.
    pub(crate) session: Session,
    /// Held from a request to its answer (the spawner answers in order).
    exchange: tokio::sync::Mutex<State>,
}

#[derive(Debug, Default)]
struct State {
    /// The templates this spawner has the programs of.
    templates: HashSet<u64>,
    /// Spawn requests sent whose answers were not read (their caller went away while
    /// waiting), oldest first: the next request reads them first, and kills and reaps the
    /// launchers they name.
    owed: Vec<Spawning>,
}

/// A spawn request sent and not yet answered: if the caller goes away before the answer is
/// read, the request stays owed on the connection, its [`Spawning`] with it (the launcher may
/// exist already, unregistered).
struct Awaiting<'a> {
    state: &'a mut State,
    spawning: Option<Spawning>,
    /// The connection and its thread (which replaces a spawner found out of step), for
    /// settling the owed answer at once.
    settle: Option<(Arc<Connection>, Option<Arc<SpawnerThread>>)>,
}

impl Drop for Awaiting<'_> {
    fn drop(&mut self) {
        if let Some(spawning) = self.spawning.take() {
            self.state.owed.push(spawning);
            // The worker may be running the tool already (its template answers once it has
            // exec'd): settle it now, in a task of its own, rather than at the next request.
            // The task waits for this caller's hold on the connection to end.
            if let (Some((connection, thread)), Ok(runtime)) =
                (self.settle.take(), tokio::runtime::Handle::try_current())
            {
                runtime.spawn(async move {
                    let mut state = connection.exchange.lock().await;
                    if let Err(Failed::Lost(e) | Failed::Undelivered(e) | Failed::Refused(e)) =
                        connection.settle(&mut state).await
                    {
                        // The answers are out of step: nothing on this connection can be
                        // trusted, as when a request finds it so.
                        tracing::warn!(
                            "the spawner process is gone or stuck ({}); replacing it",
                            crate::report::chain(&e)
                        );
                        drop(state);
                        if let Some(thread) = thread {
                            thread.replace(connection);
                        }
                    }
                });
            }
        }
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

impl Connection {
    /// Watches `sock` (the daemon's end, the spawner having said it is ready) on the current
    /// runtime.
    pub(crate) fn new(sock: OwnedFd, session: Session) -> io::Result<Connection> {
        // SAFETY: an OwnedFd is open, returns the same descriptor from every `as_raw_fd`, and
        // is owned by the AsyncFd from here on, so it stays open for the AsyncFd's whole life.
        let sock = unsafe { AsyncFd::register(sock) }.map_err(|e| e.into_parts().1)?;
        Ok(Connection {
            sock,
            session,
            exchange: tokio::sync::Mutex::new(State::default()),
        })
    }

    /// Sends one packet (with `fds`), waiting for room if the socket is full.
    async fn send(&self, message: &[u8], fds: &[std::os::fd::BorrowedFd<'_>]) -> io::Result<()> {
        loop {
            let mut ready = self.sock.writable().await?;
            let sent = ready.try_io(|sock| {
                let mut space = [MaybeUninit::uninit(); rustix::cmsg_space!(ScmRights(MAX_FDS))];
                let mut control = SendAncillaryBuffer::new(&mut space);
                if !fds.is_empty() && !control.push(SendAncillaryMessage::ScmRights(fds)) {
                    return Err(io::Error::other("too many descriptors for one request"));
                }
                rustix::net::sendmsg(
                    sock.get_ref(),
                    &[IoSlice::new(message)],
                    &mut control,
                    SendFlags::NOSIGNAL | SendFlags::DONTWAIT,
                )
                .map_err(io::Error::from)
            });
            match sent {
                Ok(result) => return result.map(drop),
                Err(_would_block) => continue,
            }
        }
    }

    /// Receives one answer: its bytes (0: the spawner closed its end) and the descriptor
    /// that came with it.
    async fn receive(&self, answer: &mut [u8]) -> io::Result<(usize, Option<OwnedFd>)> {
        loop {
            let mut ready = self.sock.readable().await?;
            let got = ready.try_io(|sock| {
                let mut space = [MaybeUninit::uninit(); rustix::cmsg_space!(ScmRights(1))];
                let mut control = RecvAncillaryBuffer::new(&mut space);
                let got = rustix::net::recvmsg(
                    sock.get_ref(),
                    &mut [IoSliceMut::new(&mut *answer)],
                    &mut control,
                    RecvFlags::CMSG_CLOEXEC | RecvFlags::DONTWAIT,
                )
                .map_err(io::Error::from)?;
                let mut fd = None;
                for message in control.drain() {
                    if let RecvAncillaryMessage::ScmRights(received) = message {
                        for received in received {
                            fd.get_or_insert(received);
                        }
                    }
                }
                Ok((got.bytes, fd))
            });
            match got {
                Ok(result) => return result,
                Err(_would_block) => continue,
            }
        }
    }

    /// Receives one answer within [`ANSWER_TIMEOUT`]: the pid it names and the pidfd that
    /// came with it, or why there is none.
    async fn answer(&self) -> Result<(i32, OwnedFd), Failed> {
        let mut answer = [0u8; REPLY_LEN];
        let (bytes, pidfd) =
            match tokio::time::timeout(ANSWER_TIMEOUT, self.receive(&mut answer)).await {
                Ok(Ok(got)) => got,
                Ok(Err(e)) => {
                    return Err(Failed::Lost(io::Error::new(
                        e.kind(),
                        format!("cannot read the spawner's answer: {e}"),
                    )))
                }
                Err(_) => {
                    return Err(Failed::Lost(io::Error::new(
                        io::ErrorKind::TimedOut,
                        format!("the spawner did not answer within {ANSWER_TIMEOUT:?}"),
                    )))
                }
            };
        match (bytes, Reply::decode(&answer[..bytes.min(REPLY_LEN)]), pidfd) {
            (0, _, _) => Err(Failed::Lost(io::Error::other(
                "the spawner process died while starting the worker",
            ))),
            (_, Some(Reply::Spawned(number)), Some(pidfd)) => Ok((number, pidfd)),
            (_, Some(Reply::Refused(number)), _) => {
                Err(Failed::Refused(io::Error::from_raw_os_error(number)))
            }
            _ => Err(Failed::Lost(io::Error::other(
                "the spawner's answer is malformed",
            ))),
        }
    }

    /// Reads the answers owed to callers that went away, oldest first, and kills and reaps
    /// the group of each worker they name (it may have run the tool already). Each owed
    /// request keeps the reaping of the spawner thread's children off until its launcher is
    /// reaped, so its pid is never recycled under the kill.
    async fn settle(&self, state: &mut State) -> Result<(), Failed> {
        while !state.owed.is_empty() {
            let answered = self.answer().await;
            let spawning = state.owed.remove(0);
            match answered {
                Ok((number, pidfd)) => {
                    if let Some(leader) = Pgid::from_raw(number) {
                        tokio::task::spawn_blocking(move || {
                            abandon(leader, &pidfd);
                            drop(spawning);
                        });
                    }
                }
                Err(Failed::Refused(_)) => {}
                Err(e) => return Err(e),
            }
        }
        Ok(())
    }

    /// One request: the worker's leader, registered, and its pidfd, forked from the template
    /// of `programs` (whose programs go to the spawner first, once). `forget`: templates to
    /// stop first.
    async fn spawn(
        self: &Arc<Self>,
        thread: Option<&Arc<SpawnerThread>>,
        leaders: &Arc<Leaders>,
        programs: &Programs,
        forget: &[u64],
        fds: &[std::os::fd::BorrowedFd<'_>],
    ) -> Result<(Pgid, OwnedFd), Failed> {
        let mut state = self.exchange.lock().await;
        self.settle(&mut state).await?;
        for id in forget {
            if state.templates.remove(id) {
                // Nothing to answer; a spawner that is gone took them with it.
                let _ = self.send(&spawn_request::forget_message(*id), &[]).await;
            }
        }
        if !state.templates.contains(&programs.id) {
            let message =
                spawn_request::template_message(programs.id, &programs.template, &programs.seal);
            self.send(&message, &[])
                .await
                .map_err(Failed::Undelivered)?;
            state.templates.insert(programs.id);
        }
        let spawning = leaders.begin_spawn();
        self.send(&spawn_request::spawn_message(programs.id), fds)
            .await
            .map_err(Failed::Undelivered)?;
        // Sent: from here, a caller that goes away leaves the answer owed.
        let mut awaiting = Awaiting {
            state: &mut state,
            spawning: Some(spawning),
            settle: Some((self.clone(), thread.cloned())),
        };
        let answered = self.answer().await;
        let Some(spawning) = awaiting.spawning.take() else {
            return Err(Failed::Lost(io::Error::other(
                "the spawn was settled twice",
            )));
        };
        drop(awaiting);
        let (number, pidfd) = answered?;
        match Pgid::from_raw(number) {
            Some(leader) => {
                spawning.register(leader);
                Ok((leader, pidfd))
            }
            None => Err(Failed::Lost(io::Error::other(format!(
                "the spawner answered pid {number}"
            )))),
        }
    }
}

/// Starts a worker's leader, running the launcher with `channel` as its channel to us, and
/// `progress` (the write end of the progress pipe) as the one extra descriptor the tool
/// keeps. Made in the caller's task: if the caller goes away after the request was sent, its
/// answer stays owed on the connection and the next request settles it.
pub(crate) async fn spawn_launcher(
    thread: &Arc<SpawnerThread>,
    leaders: &Arc<Leaders>,
    programs: Arc<Programs>,
    forget: Vec<u64>,
    channel: OwnedFd,
    progress: Option<OwnedFd>,
    on_session: &(dyn Fn(Session) + Sync),
) -> io::Result<Spawned> {
    spawn_now(
        thread, leaders, &programs, &forget, channel, progress, on_session,
    )
    .await
}

async fn spawn_now(
    thread: &Arc<SpawnerThread>,
    leaders: &Arc<Leaders>,
    programs: &Programs,
    forget: &[u64],
    channel: OwnedFd,
    progress: Option<OwnedFd>,
    on_session: &(dyn Fn(Session) + Sync),
) -> io::Result<Spawned> {
    let (stdin_r, stdin_w) = rustix::pipe::pipe_with(rustix::pipe::PipeFlags::CLOEXEC)?;
    let (stdout_r, stdout_w) = rustix::pipe::pipe_with(rustix::pipe::PipeFlags::CLOEXEC)?;
    let (stderr_r, stderr_w) = rustix::pipe::pipe_with(rustix::pipe::PipeFlags::CLOEXEC)?;
    let fds =
        spawn_request::request_fds(&channel, &stdin_r, &stdout_w, &stderr_w, progress.as_ref());
    let mut retried = false;
    loop {
        let spawner = thread.connect().await?;
        // Before the request: its worker may run the tool before the answer comes back.
        on_session(spawner.session);
        let error = match spawner
            .spawn(Some(thread), leaders, programs, forget, &fds)
            .await
        {
            Ok((leader, pidfd)) => {
                return Ok(Spawned {
                    leader,
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
                tracing::warn!(
                    "the spawner process is gone or stuck ({}); replacing it",
                    crate::report::chain(&e)
                );
                thread.replace(spawner);
                return Err(e);
            }
        };
        tracing::warn!("the spawner process is gone ({error}); replacing it");
        thread.replace(spawner);
        retried = true;
    }
}

/// For a worker nobody will use (its caller went away; it may be running the tool): SIGKILL
/// to its group and a blocking reap of its leader. It was never registered, and the reaping of the spawner thread's
/// children is held off until it is reaped.
fn abandon(leader: Pgid, pidfd: &OwnedFd) {
    signal_group(leader, pidfd, Signal::KILL);
    let _ = rustix::process::waitid(
        rustix::process::WaitId::PidFd(pidfd.as_fd()),
        rustix::process::WaitIdOptions::EXITED,
    );
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::sandbox::wire::spawn_request::{decode_request, Request, MAX_REQUEST};
    use rustix::net::{AddressFamily, SocketFlags, SocketType};
    use std::os::unix::process::CommandExt;

    /// The test's side of the socket: receives one request, returns its descriptors.
    fn receive_request(sock: &OwnedFd) -> (Request, Vec<OwnedFd>) {
        let mut message = vec![0u8; MAX_REQUEST];
        let mut space = [MaybeUninit::uninit(); rustix::cmsg_space!(ScmRights(MAX_FDS))];
        let mut control = RecvAncillaryBuffer::new(&mut space);
        let got = rustix::net::recvmsg(
            sock,
            &mut [IoSliceMut::new(&mut message)],
            &mut control,
            RecvFlags::CMSG_CLOEXEC,
        )
        .expect("recvmsg");
        let mut fds = Vec::new();
        for m in control.drain() {
            if let RecvAncillaryMessage::ScmRights(received) = m {
                fds.extend(received);
            }
        }
        let request = decode_request(&message[..got.bytes], fds.len()).expect("a request");
        (request, fds)
    }

    fn answer(sock: &OwnedFd, reply: Reply, pidfd: Option<&OwnedFd>) {
        let fds: Vec<_> = pidfd.iter().map(|f| f.as_fd()).collect();
        let mut space = [MaybeUninit::uninit(); rustix::cmsg_space!(ScmRights(1))];
        let mut control = SendAncillaryBuffer::new(&mut space);
        if !fds.is_empty() {
            assert!(control.push(SendAncillaryMessage::ScmRights(&fds)));
        }
        rustix::net::sendmsg(
            sock,
            &[IoSlice::new(&reply.encode())],
            &mut control,
            SendFlags::NOSIGNAL,
        )
        .expect("sendmsg");
    }

    fn pipe_fds() -> Vec<OwnedFd> {
        let mut fds = Vec::new();
        for _ in 0..2 {
            let (r, w) = rustix::pipe::pipe().expect("pipe");
            fds.extend([r, w]);
        }
        fds
    }

    #[tokio::test]
    async fn an_answer_whose_caller_went_away_is_settled_and_its_worker_killed() {
        let (ours, theirs) = rustix::net::socketpair(
            AddressFamily::UNIX,
            SocketType::SEQPACKET,
            SocketFlags::CLOEXEC,
            None,
        )
        .expect("socketpair");
        let connection =
            Arc::new(Connection::new(ours, Session { sid: 1, start: 0 }).expect("watch"));
        let leaders = Arc::new(Leaders::default());
        let programs = Programs {
            id: 7,
            template: vec![vec![(6, 0, 0, 0x7fff_0000)]],
            seal: Vec::new(),
        };
        let fds = pipe_fds();
        let borrowed: Vec<_> = fds.iter().map(|f| f.as_fd()).collect();

        // The first request is sent, and its caller goes away before the answer.
        let (received, got) = tokio::sync::oneshot::channel();
        let fake = std::thread::spawn(move || {
            let template = receive_request(&theirs).0;
            let spawn = receive_request(&theirs).0;
            let _ = received.send(());
            (template, spawn, theirs)
        });
        tokio::select! {
            _ = connection.spawn(None, &leaders, &programs, &[], &borrowed) => {
                panic!("a spawn finished with no answer sent")
            }
            _ = got => {}
        }
        let (template, spawn, theirs) = fake.join().expect("the fake spawner");
        assert!(matches!(template, Request::Template { .. }));
        assert_eq!(spawn, Request::Spawn(7));
        assert_eq!(
            leaders.spawns_in_flight(),
            1,
            "the owed request still holds off the reaping of the spawner's children"
        );

        // Its launcher exists (a child of ours, leading a group), and is answered for now.
        let launcher = std::process::Command::new("/bin/sleep")
            .arg("1000")
            .process_group(0)
            .spawn()
            .expect("spawn sleep");
        let pid = launcher.id() as i32;
        drop(launcher);
        let pidfd = rustix::process::pidfd_open(
            rustix::process::Pid::from_raw(pid).expect("pid"),
            rustix::process::PidfdFlags::empty(),
        )
        .expect("pidfd_open");
        answer(&theirs, Reply::Spawned(pid), Some(&pidfd));

        // With no further request, the answer is settled at once (the worker may be running
        // the tool already): the abandoned worker is killed and reaped, no spawn is left in
        // flight, and it was never registered.
        let deadline = std::time::Instant::now() + Duration::from_secs(10);
        while leaders.spawns_in_flight() != 0 {
            assert!(
                std::time::Instant::now() < deadline,
                "the owed launcher was never settled"
            );
            tokio::time::sleep(Duration::from_millis(5)).await;
        }
        assert_eq!(
            rustix::process::waitid(
                rustix::process::WaitId::PidFd(pidfd.as_fd()),
                rustix::process::WaitIdOptions::EXITED | rustix::process::WaitIdOptions::NOHANG,
            )
            .map(|_| ())
            .expect_err("already reaped"),
            rustix::io::Errno::CHILD
        );
        assert!(leaders.lock().is_empty());

        // The next request finds nothing owed, and is refused on its own.
        let spawner = std::thread::spawn(move || {
            let (request, _fds) = receive_request(&theirs);
            answer(&theirs, Reply::Refused(libc::EAGAIN), None);
            (request, theirs)
        });
        match connection
            .spawn(None, &leaders, &programs, &[], &borrowed)
            .await
        {
            Err(Failed::Refused(e)) => assert_eq!(e.raw_os_error(), Some(libc::EAGAIN)),
            Err(Failed::Lost(e) | Failed::Undelivered(e)) => panic!("{e}"),
            Ok((leader, _)) => panic!("spawned {leader}"),
        }
        let (second, _theirs) = spawner.join().expect("the fake spawner");
        assert_eq!(second, Request::Spawn(7), "the template was sent once");
    }
}
