//! The thread that owns the spawner process ([`crate::sandbox::spawner`]).
//!
//! The spawner is started by that thread (at once, by [`SpawnerThread::start`], and again
//! after one died or hung), because PR_SET_PDEATHSIG fires when the *thread* that forked a
//! process exits, and a runtime's blocking threads come and go: the spawner and, through
//! `CLONE_PARENT`, every worker template and every worker are children of this thread, and
//! die with it only when the daemon dies.
//!
//! The thread serves no worker: a call's task asks the spawner itself, over the spawner's
//! socket with async I/O ([`super::spawner`]), so a spawn costs no hand-off between threads.
//! The thread answers only [`SpawnerThread::connect`] (the running spawner's connection,
//! started first if there is none) and [`SpawnerThread::replace`] (a spawner found gone or
//! stuck is killed and reaped; the next `connect` starts a new one).

use std::io;
use std::os::fd::{AsFd, OwnedFd};
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::sync::{mpsc, Arc, Mutex};
use std::time::Duration;

use rustix::net::{AddressFamily, RecvFlags, SocketFlags, SocketType};
use rustix::process::{Pid, PidfdFlags, Signal};

use super::group::Leaders;
use super::leftovers::Session;
use super::spawner::Connection;
use crate::sandbox::spawner::SPAWNER_ARG;
use crate::sandbox::wire::spawn_request;

type Answer = tokio::sync::oneshot::Sender<io::Result<Arc<Connection>>>;

enum Request {
    /// Start the spawner now if none runs; answer with its connection, if asked.
    Connect(Option<Answer>),
    /// This connection's spawner is gone or stuck: stop it, if it is still the running one.
    Replace(Arc<Connection>),
}

/// How long the spawner may take to start and say it is ready.
const START_TIMEOUT: Duration = Duration::from_secs(30);

/// The daemon's spawner thread, which owns the spawner process. Made once, by
/// [`super::Sandbox::start`].
#[derive(Debug)]
pub(crate) struct SpawnerThread {
    tx: Mutex<mpsc::Sender<Request>>,
    /// The running spawner's connection, once a call asked for it: the calls' tasks use it
    /// without asking the thread.
    current: Mutex<Option<Arc<Connection>>>,
    /// The binary started in spawner mode.
    pub exe: PathBuf,
}

impl SpawnerThread {
    /// Starts the spawner thread and asks it to start the spawner process now, so the first
    /// call does not pay for it. `runtime` is where the spawner's socket is watched.
    pub(crate) fn start(
        exe: PathBuf,
        leaders: Arc<Leaders>,
        runtime: tokio::runtime::Handle,
    ) -> io::Result<SpawnerThread> {
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
                        Request::Connect(answer) => {
                            let result = running(&mut process, &exe, &leaders, &runtime)
                                .map(|p| p.connection.clone());
                            match answer {
                                Some(answer) => {
                                    let _ = answer.send(result);
                                }
                                None => {
                                    if let Err(e) = result {
                                        tracing::warn!(
                                            "cannot start the spawner process: {}",
                                            crate::report::chain(&e)
                                        );
                                    }
                                }
                            }
                        }
                        Request::Replace(gone) => {
                            if process
                                .as_ref()
                                .is_some_and(|p| Arc::ptr_eq(&p.connection, &gone))
                            {
                                if let Some(old) = process.take() {
                                    old.stop();
                                }
                            }
                        }
                    }
                }
            })?;
        tx.send(Request::Connect(None))
            .map_err(|_| io::Error::other("the spawner thread is gone"))?;
        Ok(SpawnerThread {
            tx: Mutex::new(tx),
            current: Mutex::new(None),
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

    fn current(&self) -> std::sync::MutexGuard<'_, Option<Arc<Connection>>> {
        self.current.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// The running spawner's connection, the spawner started first (by the thread) if none
    /// runs.
    pub(crate) async fn connect(&self) -> io::Result<Arc<Connection>> {
        if let Some(connection) = self.current().as_ref() {
            return Ok(connection.clone());
        }
        let (answer, connection) = tokio::sync::oneshot::channel();
        self.send(Request::Connect(Some(answer)))?;
        let connection = connection
            .await
            .map_err(|_| io::Error::other("the spawner thread dropped the request"))??;
        *self.current() = Some(connection.clone());
        Ok(connection)
    }

    /// `gone`'s spawner is gone or stuck: the thread kills and reaps it (if it still runs
    /// it), and the next [`SpawnerThread::connect`] starts a new one.
    pub(crate) fn replace(&self, gone: Arc<Connection>) {
        {
            let mut current = self.current();
            if current.as_ref().is_some_and(|c| Arc::ptr_eq(c, &gone)) {
                *current = None;
            }
        }
        let _ = self.send(Request::Replace(gone));
    }
}

/// The running spawner process.
struct Process {
    pidfd: OwnedFd,
    pid: i32,
    /// Its socket, as the calls' tasks use it.
    connection: Arc<Connection>,
}

impl Process {
    fn start(
        exe: &Path,
        leaders: &Leaders,
        runtime: &tokio::runtime::Handle,
    ) -> io::Result<Process> {
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
        let pidfd = pidfd?;
        // Its start time, read once: with its pid, its session's record for the next start's
        // sweep (the pid cannot be recycled while we hold the unreaped child).
        let start = super::procfs::read_stat(pid).map_or(0, |s| s.start);
        // The start is an execve of the daemon's binary: a loaded host may take a while.
        let ready = rustix::net::sockopt::set_socket_timeout(
            &ours,
            rustix::net::sockopt::Timeout::Recv,
            Some(START_TIMEOUT),
        )
        .map_err(io::Error::from)
        .and_then(|()| {
            let mut ready = [0u8; 1];
            let n = rustix::net::recv(&ours, &mut ready, RecvFlags::empty())?;
            Ok((n, ready[0]))
        });
        let stop = |pidfd: OwnedFd| {
            Process::stop_pidfd(&pidfd, pid);
        };
        match ready {
            Ok(((1, _), spawn_request::READY)) => {}
            Ok(_) => {
                stop(pidfd);
                return Err(io::Error::other(
                    "the spawner process exited at start (see its message on stderr)",
                ));
            }
            Err(e) => {
                stop(pidfd);
                return Err(io::Error::new(
                    e.kind(),
                    format!("the spawner did not start: {e}"),
                ));
            }
        }
        let connection = {
            let _runtime = runtime.enter();
            Connection::new(ours, Session { sid: pid, start })
        };
        match connection {
            Ok(connection) => Ok(Process {
                pidfd,
                pid,
                connection: Arc::new(connection),
            }),
            Err(e) => {
                stop(pidfd);
                Err(e)
            }
        }
    }

    /// Kills the spawner (through its pidfd: never a recycled pid) and reaps it if the orphan
    /// reaper has not already.
    fn stop(self) {
        Process::stop_pidfd(&self.pidfd, self.pid);
    }

    fn stop_pidfd(pidfd: &OwnedFd, pid: i32) {
        let _ = rustix::process::pidfd_send_signal(pidfd, Signal::KILL);
        let _ = rustix::process::waitid(
            rustix::process::WaitId::PidFd(pidfd.as_fd()),
            rustix::process::WaitIdOptions::EXITED,
        );
        tracing::debug!(pid, "spawner process stopped");
    }
}

/// The running spawner, started if there is none.
fn running<'a>(
    process: &'a mut Option<Process>,
    exe: &Path,
    leaders: &Leaders,
    runtime: &tokio::runtime::Handle,
) -> io::Result<&'a mut Process> {
    if process.is_none() {
        *process = Some(Process::start(exe, leaders, runtime)?);
    }
    process
        .as_mut()
        .ok_or_else(|| io::Error::other("no spawner process"))
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A runtime for the spawner's socket (these tests start no spawner that gets that far,
    /// but `start` needs one to hand to).
    fn runtime() -> tokio::runtime::Runtime {
        tokio::runtime::Builder::new_current_thread()
            .enable_io()
            .build()
            .expect("a runtime")
    }

    #[test]
    fn a_spawner_that_exits_at_start_is_an_error_and_is_reaped() {
        let leaders = Leaders::default();
        let e = match Process::start(Path::new("/bin/false"), &leaders, runtime().handle()) {
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
        let e = match Process::start(
            Path::new("/nonexistent/airlock"),
            &leaders,
            runtime().handle(),
        ) {
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
        let started = Process::start(&script, &leaders, runtime().handle());
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
