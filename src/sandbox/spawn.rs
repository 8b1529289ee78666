//! The spawner thread: every fork of a worker's launcher happens on one long-lived thread.

use std::io;
use std::os::fd::{AsFd, AsRawFd, OwnedFd};
use std::os::unix::process::CommandExt;
use std::path::{Path, PathBuf};
use std::process::{ChildStderr, ChildStdin, ChildStdout, Command, Stdio};
use std::sync::{mpsc, Mutex, OnceLock};

use rustix::process::{Pid, PidfdFlags, Signal};

use super::group::leaders;
use super::LAUNCHER_ARG;

/// A launcher just started.
pub(crate) struct Spawned {
    pub pid: i32,
    pub pidfd: OwnedFd,
    pub stdin: ChildStdin,
    pub stdout: ChildStdout,
    pub stderr: ChildStderr,
}

struct SpawnRequest {
    exe: PathBuf,
    channel: OwnedFd,
    reply: tokio::sync::oneshot::Sender<io::Result<Spawned>>,
}

/// All forks happen on one long-lived thread: PR_SET_PDEATHSIG fires when the *thread* that
/// forked the launcher exits, and a runtime's blocking threads come and go. One thread also
/// serializes the window in which the launcher's channel is inheritable.
static SPAWNER: OnceLock<Mutex<mpsc::Sender<SpawnRequest>>> = OnceLock::new();

fn spawner() -> io::Result<mpsc::Sender<SpawnRequest>> {
    if let Some(tx) = SPAWNER.get() {
        return Ok(tx.lock().unwrap_or_else(|p| p.into_inner()).clone());
    }
    let (tx, rx) = mpsc::channel::<SpawnRequest>();
    std::thread::Builder::new()
        .name("airlock-spawner".into())
        .spawn(move || {
            for req in rx {
                let result = spawn_now(&req.exe, req.channel);
                if let Err(Ok(orphan)) = req.reply.send(result) {
                    // The caller went away: the launcher must not outlive the request.
                    abandon(orphan);
                }
            }
        })?;
    let stored = SPAWNER.get_or_init(|| Mutex::new(tx));
    Ok(stored.lock().unwrap_or_else(|p| p.into_inner()).clone())
}

/// Starts `exe` in launcher mode with `channel` as its inherited channel descriptor.
pub(crate) async fn spawn_launcher(exe: PathBuf, channel: OwnedFd) -> io::Result<Spawned> {
    let (reply, answer) = tokio::sync::oneshot::channel();
    spawner()?
        .send(SpawnRequest {
            exe,
            channel,
            reply,
        })
        .map_err(|_| io::Error::other("the spawner thread is gone"))?;
    answer
        .await
        .map_err(|_| io::Error::other("the spawner thread dropped the request"))?
}

fn spawn_now(exe: &Path, channel: OwnedFd) -> io::Result<Spawned> {
    let mut leaders = leaders();
    // The channel becomes inheritable only now, under the spawn lock, on the only thread of
    // ours that forks; our copy is closed right after the fork.
    rustix::io::fcntl_setfd(&channel, rustix::io::FdFlags::empty())?;
    let spawned = Command::new(exe)
        .arg(LAUNCHER_ARG)
        .arg(channel.as_raw_fd().to_string())
        .process_group(0)
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn();
    drop(channel);
    let mut child = spawned?;
    let pid = child.id() as i32;
    let (Some(stdin), Some(stdout), Some(stderr)) =
        (child.stdin.take(), child.stdout.take(), child.stderr.take())
    else {
        kill_and_reap_now(pid);
        return Err(io::Error::other(
            "the launcher's standard streams were not piped",
        ));
    };
    let pidfd =
        match Pid::from_raw(pid).map(|p| rustix::process::pidfd_open(p, PidfdFlags::empty())) {
            Some(Ok(fd)) => fd,
            Some(Err(e)) => {
                kill_and_reap_now(pid);
                return Err(io::Error::new(e.kind(), format!("pidfd_open({pid}): {e}")));
            }
            None => return Err(io::Error::other("the launcher has pid 0")),
        };
    leaders.insert(pid);
    // `child` is dropped without waiting: std never reaps on drop, and we reap by pidfd.
    drop(child);
    Ok(Spawned {
        pid,
        pidfd,
        stdin,
        stdout,
        stderr,
    })
}

/// For a launcher nobody will use: SIGKILL and a blocking reap (it has no children yet).
fn kill_and_reap_now(pid: i32) {
    if let Some(p) = Pid::from_raw(pid) {
        let _ = rustix::process::kill_process_group(p, Signal::KILL);
        let _ = rustix::process::waitpid(Some(p), rustix::process::WaitOptions::empty());
    }
}

fn abandon(s: Spawned) {
    let _ = rustix::process::pidfd_send_signal(&s.pidfd, Signal::KILL);
    if let Some(p) = Pid::from_raw(s.pid) {
        let _ = rustix::process::kill_process_group(p, Signal::KILL);
    }
    let mut leaders = leaders();
    let _ = rustix::process::waitid(
        rustix::process::WaitId::PidFd(s.pidfd.as_fd()),
        rustix::process::WaitIdOptions::EXITED,
    );
    leaders.remove(&s.pid);
}
