//! Processes: the spawner thread, the registry of live worker leaders, kill-and-confirm of a
//! worker's process group, the daemon's orphan reaper, and the worker's cgroup.
//!
//! Invariants:
//! - A worker's leader is reaped last, by `finish` (or the worker's drop), through its pidfd:
//!   until then its pid, which is also the group id, cannot be recycled, so signalling the
//!   group (`kill(-pgid)`) never reaches a stranger.
//! - Nothing here calls `waitpid(-1)`: children are reaped by pid, and never a registered
//!   leader except by its own worker. The registry lock is held across `fork` and the
//!   registration, and across every reap by pid, so a reap can never hit a leader that is
//!   being registered.
//! - All the daemon's children are workers (it uses no `tokio::process`), so a zombie child
//!   that is not a registered leader is an orphan reparented to us, the subreaper.

use std::collections::BTreeSet;
use std::io;
use std::os::fd::{AsFd, AsRawFd, OwnedFd};
use std::os::unix::process::CommandExt;
use std::path::{Path, PathBuf};
use std::process::{ChildStderr, ChildStdin, ChildStdout, Command, Stdio};
use std::sync::{mpsc, Mutex, MutexGuard, OnceLock};
use std::time::{Duration, Instant};

use rustix::process::{Pid, PidfdFlags, Signal};

use super::sys::{self, Exit};
use super::LAUNCHER_ARG;

/// The pids of the leaders of live workers. Its lock is also the spawn lock.
static LEADERS: Mutex<BTreeSet<i32>> = Mutex::new(BTreeSet::new());

fn leaders() -> MutexGuard<'static, BTreeSet<i32>> {
    // The set stays consistent even if a holder panicked: every update is one insert/remove.
    LEADERS
        .lock()
        .unwrap_or_else(|poisoned| poisoned.into_inner())
}

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

/// One line of `/proc/PID/stat`, the fields we use.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct ProcStat {
    pub pid: i32,
    pub state: u8,
    pub ppid: i32,
    pub pgrp: i32,
    pub session: i32,
    /// Start time in clock ticks after boot.
    pub start: u64,
}

impl ProcStat {
    pub(crate) fn parse(line: &str) -> Option<ProcStat> {
        let (head, rest) = line.rsplit_once(')')?;
        let pid = head.split_once(' ')?.0.trim().parse().ok()?;
        let mut fields = rest.split_ascii_whitespace();
        let state = *fields.next()?.as_bytes().first()?;
        let ppid = fields.next()?.parse().ok()?;
        let pgrp = fields.next()?.parse().ok()?;
        let session = fields.next()?.parse().ok()?;
        // Field 22 (starttime) is the 19th after `session` (field 6).
        let start = fields.nth(15)?.parse().ok()?;
        Some(ProcStat {
            pid,
            state,
            ppid,
            pgrp,
            session,
            start,
        })
    }

    /// Exited (its resources are released), whether reaped yet or not.
    pub(crate) fn dead(&self) -> bool {
        matches!(self.state, b'Z' | b'X')
    }
}

/// Every process on the system, as far as `/proc` shows them.
pub(crate) fn all_processes() -> Vec<ProcStat> {
    let Ok(dir) = std::fs::read_dir("/proc") else {
        return Vec::new();
    };
    let mut out = Vec::new();
    let mut path = String::with_capacity(32);
    for entry in dir.flatten() {
        let name = entry.file_name();
        let Some(name) = name.to_str() else { continue };
        if !name.bytes().all(|b| b.is_ascii_digit()) {
            continue;
        }
        path.clear();
        path.push_str("/proc/");
        path.push_str(name);
        path.push_str("/stat");
        if let Some(stat) = std::fs::read_to_string(&path)
            .ok()
            .as_deref()
            .and_then(ProcStat::parse)
        {
            out.push(stat);
        }
    }
    out
}

/// Whether `pid` is in the process group of a live worker (its leader registered here).
pub fn in_live_worker_group(pid: i32) -> bool {
    read_stat(pid).is_some_and(|s| leaders().contains(&s.pgrp))
}

/// Reaps `pid` if it is a zombie child of ours and not a registered leader.
pub(crate) fn reap_if_not_leader(pid: i32) -> bool {
    let leaders = leaders();
    if leaders.contains(&pid) {
        return false;
    }
    matches!(sys::reap_pid_nohang(pid), Ok(Some(_)))
}

/// One pass over the group: reaps what is ours to reap, and says whether any process of it
/// other than the leader's zombie is still there.
fn group_is_empty(pgid: i32, me: i32) -> bool {
    // The leader first: while it runs, the group is not empty, whatever else is in it.
    match read_stat(pgid) {
        Some(leader) if leader.pgrp == pgid && !leader.dead() => return false,
        _ => {}
    }
    let candidates = match orphan_candidates(me) {
        Some(children) => children,
        None => all_processes(),
    };
    let mut empty = true;
    for p in candidates
        .into_iter()
        .filter(|p| p.pgrp == pgid && p.pid != pgid)
    {
        if p.ppid == me && reap_if_not_leader(p.pid) {
            continue;
        }
        // A dead process that is someone else's child has released everything it held.
        empty &= p.dead();
    }
    empty
}

/// Where the survivors of a group whose leader is dead can be, when the daemon is the child
/// subreaper: every process of a worker's group descends from its leader (setsid and setpgid
/// are denied), so once the leader has exited, the topmost survivors have been reparented to
/// the daemon, to its main thread (the kernel picks the subreaper's first live thread, and
/// the main thread of a Rust program lives as long as the process). They stay listed there
/// until reaped, and only their worker reaps members of a live worker's group (see
/// [`reap_orphans`]), so one read of that list sees every survivor or its ancestor.
/// `None` when that shortcut does not hold: then the whole of `/proc` is scanned.
fn orphan_candidates(me: i32) -> Option<Vec<ProcStat>> {
    // Only once init_daemon made us the subreaper.
    REAPER.get()?;
    let children = std::fs::read_to_string(format!("/proc/{me}/task/{me}/children")).ok()?;
    Some(
        children
            .split_ascii_whitespace()
            .filter_map(|c| c.parse().ok())
            .filter_map(read_stat)
            .collect(),
    )
}

pub(crate) fn read_stat(pid: i32) -> Option<ProcStat> {
    std::fs::read_to_string(format!("/proc/{pid}/stat"))
        .ok()
        .as_deref()
        .and_then(ProcStat::parse)
}

fn signal_group(pgid: i32, pidfd: &OwnedFd, sig: Signal) {
    // The leader through its pidfd (it cannot be a recycled pid), then the whole group, which
    // the unreaped leader keeps from being recycled. ESRCH (already exited) is fine.
    let _ = rustix::process::pidfd_send_signal(pidfd, sig);
    if let Some(p) = Pid::from_raw(pgid) {
        let _ = rustix::process::kill_process_group(p, sig);
    }
}

/// Timeout or cancellation: SIGCONT (stopped processes cannot act on SIGTERM) and SIGTERM to
/// the group, then up to `grace` for it to empty.
pub(crate) async fn terminate(pgid: i32, pidfd: &OwnedFd, grace: Duration) {
    signal_group(pgid, pidfd, Signal::CONT);
    signal_group(pgid, pidfd, Signal::TERM);
    let me = rustix::process::getpid().as_raw_nonzero().get();
    let deadline = Instant::now() + grace;
    let mut delay = Duration::from_millis(2);
    while !group_is_empty(pgid, me) {
        let now = Instant::now();
        if now >= deadline {
            return;
        }
        tokio::time::sleep(delay.min(deadline - now)).await;
        delay = (delay * 2).min(Duration::from_millis(50));
    }
}

/// SIGKILL to the group (and `cgroup.kill`), until no process of it is left but the leader's
/// zombie; children of ours in the group are reaped on the way.
pub(crate) async fn kill_and_confirm(pgid: i32, pidfd: &OwnedFd, cgroup: Option<&Path>) {
    let me = rustix::process::getpid().as_raw_nonzero().get();
    let started = Instant::now();
    let mut warned = false;
    let mut delay = Duration::from_millis(1);
    loop {
        signal_group(pgid, pidfd, Signal::KILL);
        if let Some(cg) = cgroup {
            cgroup_kill(cg);
        }
        if group_is_empty(pgid, me) && cgroup.is_none_or(cgroup_is_empty) {
            return;
        }
        if !warned && started.elapsed() > Duration::from_secs(10) {
            warned = true;
            tracing::warn!(
                pgid,
                "worker processes survive SIGKILL for 10 s (uninterruptible sleep?); still waiting"
            );
        }
        tokio::time::sleep(delay).await;
        delay = (delay * 2).min(Duration::from_millis(50));
    }
}

/// Reaps the leader through its pidfd and unregisters it, under the registry lock.
/// `Ok(None)` if it has not exited yet.
pub(crate) fn reap_leader(pid: i32, pidfd: &OwnedFd) -> io::Result<Option<Exit>> {
    let mut leaders = leaders();
    let exit = sys::reap_pidfd_nohang(pidfd.as_raw_fd())?;
    if exit.is_some() {
        leaders.remove(&pid);
    }
    Ok(exit)
}

/// A worker dropped without `finish` and no runtime to confirm in: kill its group and hand
/// the leader to the orphan reaper.
pub(crate) fn kill_and_forget(pid: i32, pidfd: &OwnedFd) {
    signal_group(pid, pidfd, Signal::KILL);
    leaders().remove(&pid);
    // Its group's zombies were skipped while it was live, and may send no further SIGCHLD.
    REAP_NOW.notify_one();
}

static REAPER: OnceLock<()> = OnceLock::new();

/// Wakes the orphan reaper for what no SIGCHLD announces: a leader handed over unreaped.
static REAP_NOW: tokio::sync::Notify = tokio::sync::Notify::const_new();

/// Makes the daemon a child subreaper and starts the orphan reaper task. The task wakes only
/// on SIGCHLD (every orphan reparented to the subreaper sends one when it exits, and so does
/// one reparented already dead) or on [`REAP_NOW`]: an idle daemon has no periodic work.
pub(crate) fn start_reaper() -> io::Result<()> {
    let handle = tokio::runtime::Handle::try_current()
        .map_err(|_| io::Error::other("init_daemon must be called inside a tokio runtime"))?;
    if REAPER.get().is_some() {
        return Ok(());
    }
    rustix::process::set_child_subreaper(Some(rustix::process::getpid()))
        .map_err(|e| io::Error::new(e.kind(), format!("PR_SET_CHILD_SUBREAPER: {e}")))?;
    let mut sigchld = {
        let _guard = handle.enter();
        tokio::signal::unix::signal(tokio::signal::unix::SignalKind::child())?
    };
    if REAPER.set(()).is_err() {
        return Ok(());
    }
    handle.spawn(async move {
        loop {
            tokio::select! {
                _ = sigchld.recv() => {}
                _ = REAP_NOW.notified() => {}
            }
            reap_orphans();
            // A burst of SIGCHLD needs one pass, not one each.
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
    });
    Ok(())
}

/// Reaps every zombie child of the daemon that is neither the leader of a live worker nor a
/// member of its group (its worker's kill-and-confirm reaps those, and counts on seeing them
/// until it does).
pub(crate) fn reap_orphans() -> usize {
    let me = rustix::process::getpid().as_raw_nonzero().get();
    let live_groups = leaders().clone();
    all_processes()
        .into_iter()
        .filter(|p| p.ppid == me && p.dead() && !live_groups.contains(&p.pgrp))
        .filter(|p| reap_if_not_leader(p.pid))
        .count()
}

/// Errors of the worker's cgroup.
#[derive(Debug, thiserror::Error)]
pub enum CgroupError {
    #[error("job id {0:?} cannot name a cgroup")]
    BadJobId(String),
    #[error("cannot create the cgroup {path}: {source}")]
    Create { path: PathBuf, source: io::Error },
    #[error("cannot write {value} to {path}: {source}")]
    Write {
        path: PathBuf,
        value: u64,
        source: io::Error,
    },
}

/// The worker's cgroup, `<parent>/airlock-<job_id>`, with the limits its controllers allow.
/// Returns the path and the limit files that were written.
pub(crate) fn cgroup_create(
    parent: &Path,
    job_id: &str,
    memory_bytes: u64,
    processes: u64,
) -> Result<(PathBuf, Vec<String>), CgroupError> {
    if job_id.is_empty()
        || job_id.contains('/')
        || job_id == "."
        || job_id == ".."
        || job_id.contains('\0')
    {
        return Err(CgroupError::BadJobId(job_id.to_string()));
    }
    let path = parent.join(format!("airlock-{job_id}"));
    std::fs::create_dir(&path).map_err(|source| CgroupError::Create {
        path: path.clone(),
        source,
    })?;
    let mut applied = Vec::new();
    for (file, value) in [("memory.max", memory_bytes), ("pids.max", processes)] {
        let limit = path.join(file);
        if !limit.exists() {
            tracing::warn!(cgroup = %path.display(), "{file} is absent (controller not enabled there): not applied");
            continue;
        }
        if let Err(source) = std::fs::write(&limit, value.to_string()) {
            let _ = std::fs::remove_dir(&path);
            return Err(CgroupError::Write {
                path: limit,
                value,
                source,
            });
        }
        applied.push(file.to_string());
    }
    Ok((path, applied))
}

fn cgroup_kill(path: &Path) {
    // cgroup.kill exists since Linux 5.14; the process-group kill covers older kernels.
    let _ = std::fs::write(path.join("cgroup.kill"), b"1");
}

fn cgroup_is_empty(path: &Path) -> bool {
    match std::fs::read_to_string(path.join("cgroup.procs")) {
        Ok(procs) => procs.trim().is_empty(),
        Err(e) => e.kind() == io::ErrorKind::NotFound,
    }
}

/// Removes the (empty) cgroup; the kernel may take a moment to release exiting tasks.
pub(crate) async fn cgroup_remove(path: &Path) {
    for attempt in 0..50 {
        match std::fs::remove_dir(path) {
            Ok(()) => return,
            Err(e) if e.kind() == io::ErrorKind::NotFound => return,
            Err(e) if attempt == 49 => {
                tracing::warn!(cgroup = %path.display(), "cannot remove the worker's cgroup: {e}");
            }
            Err(_) => tokio::time::sleep(Duration::from_millis(10)).await,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parses_stat_lines() {
        let tail = "0 -1 4194560 100 0 0 0 1 2 0 0 20 0 1 0 98765 2000 300";
        let s = ProcStat::parse(&format!("1234 (sh) S 1 1234 1200 {tail}")).unwrap();
        assert_eq!(
            s,
            ProcStat {
                pid: 1234,
                state: b'S',
                ppid: 1,
                pgrp: 1234,
                session: 1200,
                start: 98765,
            }
        );
        // A command name with spaces and parentheses.
        let s = ProcStat::parse(&format!("77 (a) b (c)) Z 5 6 7 {tail}")).unwrap();
        assert_eq!(
            s,
            ProcStat {
                pid: 77,
                state: b'Z',
                ppid: 5,
                pgrp: 6,
                session: 7,
                start: 98765,
            }
        );
        assert!(
            ProcStat::parse("77 (a) S 5 6 7 0").is_none(),
            "truncated line"
        );
        assert!(s.dead());
        assert!(ProcStat::parse("garbage").is_none());
    }

    #[test]
    fn sees_ourselves() {
        let me = std::process::id() as i32;
        assert!(all_processes().iter().any(|p| p.pid == me));
    }

    #[test]
    fn bad_job_ids() {
        for id in ["", "a/b", "..", "."] {
            assert!(matches!(
                cgroup_create(Path::new("/nonexistent"), id, 1, 1),
                Err(CgroupError::BadJobId(_))
            ));
        }
    }
}
