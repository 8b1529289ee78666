//! The registry of live worker leaders and kill-and-confirm of a worker's process group.
//!
//! Invariants:
//! - A worker's leader is reaped last, by `finish` (or the worker's drop), through its pidfd:
//!   until then its pid, which is also the group id, cannot be recycled, so signalling the
//!   group (`kill(-pgid)`) never reaches a stranger.
//! - Nothing here calls `waitpid(-1)`: children are reaped by pid, and never a registered
//!   leader except by its own worker. A spawn in flight ([`Leaders::begin_spawn`], from the
//!   request to the registration of the leader it forked) holds off the reaping of the
//!   spawner thread's children, where a new leader appears, and every reap by pid is made
//!   under the registry lock, so a reap can never hit a leader that is being registered.
//! - All the daemon's children are workers (it uses no `tokio::process`), so a zombie child
//!   that is not a registered leader is an orphan reparented to us, the subreaper.

use std::collections::BTreeSet;
use std::io;
use std::num::NonZeroI32;
use std::os::fd::{AsFd, OwnedFd};
use std::path::Path;
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::{Duration, Instant};

use rustix::process::{Pid, Signal};

use super::cgroup::{cgroup_is_empty, cgroup_kill};
use super::procfs::{all_processes, read_proc_file, read_stat, ProcStat};
use super::sys::{self, Exit};

/// A worker's process group id, which is its leader's pid (always positive). The leader stays
/// unreaped until its group is confirmed gone, so while a worker holds its `Pgid` the id
/// cannot be recycled.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub(crate) struct Pgid(NonZeroI32);

impl Pgid {
    /// `None` for 0 and negative numbers, which name no single group.
    pub(crate) fn from_raw(raw: i32) -> Option<Pgid> {
        NonZeroI32::new(raw).filter(|n| n.get() > 0).map(Pgid)
    }

    pub(crate) fn raw(self) -> i32 {
        self.0.get()
    }

    /// The leader's pid (the same number).
    pub(crate) fn leader(self) -> Pid {
        Pid::from_raw(self.0.get()).unwrap_or_else(|| unreachable!("a Pgid is positive"))
    }

    /// The same number as the `u32` the worker's callers know it by.
    pub(crate) fn as_u32(self) -> u32 {
        self.0.unsigned_abs().get()
    }
}

impl std::fmt::Display for Pgid {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        self.0.fmt(f)
    }
}

/// The leaders of live workers, and the orphan reaper's wake-up. One per process, made by
/// [`super::Sandbox::start`] once the daemon is the child subreaper, and shared by the
/// workers, the spawner thread and the orphan reaper.
#[derive(Debug, Default)]
pub(crate) struct Leaders {
    /// The registered leaders. Every reap by pid is made under this lock.
    set: Mutex<BTreeSet<Pgid>>,
    /// Wakes the orphan reaper for what no SIGCHLD announces: a leader handed over unreaped.
    reap_now: tokio::sync::Notify,
    /// The spawner thread's tid (0 until it runs): the spawner and the worker templates are
    /// its children, listed under it, not under the main thread.
    spawner_thread: std::sync::atomic::AtomicI32,
    /// Spawns in flight (see [`Leaders::begin_spawn`]); changed and read only under the
    /// registry lock.
    spawning: AtomicUsize,
    /// A reap of a spawner thread's child was put off while spawns were in flight: the last
    /// one to end asks for a pass.
    deferred: AtomicBool,
}

impl Leaders {
    /// Records the spawner thread (see [`Leaders::spawner_thread`]).
    pub(crate) fn set_spawner_thread(&self, tid: i32) {
        self.spawner_thread
            .store(tid, std::sync::atomic::Ordering::Relaxed);
    }

    /// The spawner thread's tid, once it runs.
    pub(crate) fn spawner_thread(&self) -> Option<i32> {
        match self
            .spawner_thread
            .load(std::sync::atomic::Ordering::Relaxed)
        {
            0 => None,
            tid => Some(tid),
        }
    }

    /// Starts a spawn: see [`Spawning`].
    pub(crate) fn begin_spawn(self: &Arc<Self>) -> Spawning {
        let _set = self.lock();
        self.spawning.fetch_add(1, Ordering::Relaxed);
        Spawning {
            leaders: self.clone(),
            ended: false,
        }
    }

    /// Spawns in flight.
    #[cfg(test)]
    pub(crate) fn spawns_in_flight(&self) -> usize {
        let _set = self.lock();
        self.spawning.load(Ordering::Relaxed)
    }

    /// Reaps `pid`, a zombie child of the spawner thread (the spawner, a template, or a
    /// leader handed to the orphan reaper), unless it is a registered leader or a spawn is
    /// in flight (then the pass is put off until the last one ends).
    pub(crate) fn reap_spawner_child(&self, pid: i32) -> bool {
        let leaders = self.lock();
        if self.spawning.load(Ordering::Relaxed) > 0 {
            self.deferred.store(true, Ordering::Relaxed);
            return false;
        }
        if Pgid::from_raw(pid).is_some_and(|g| leaders.contains(&g)) {
            return false;
        }
        matches!(sys::reap_pid_nohang(pid), Ok(Some(_)))
    }

    pub(crate) fn lock(&self) -> MutexGuard<'_, BTreeSet<Pgid>> {
        // The set stays consistent even if a holder panicked: every update is one
        // insert/remove.
        self.set
            .lock()
            .unwrap_or_else(|poisoned| poisoned.into_inner())
    }

    /// Asks the orphan reaper for a pass.
    pub(crate) fn reap_soon(&self) {
        self.reap_now.notify_one();
    }

    /// Waits until [`Leaders::reap_soon`] is called.
    pub(crate) async fn reap_requested(&self) {
        self.reap_now.notified().await;
    }

    /// Whether `pid` is in the process group of a live worker (its leader registered here).
    pub(crate) fn in_live_worker_group(&self, pid: i32) -> bool {
        read_stat(pid)
            .and_then(|s| Pgid::from_raw(s.pgrp))
            .is_some_and(|g| self.lock().contains(&g))
    }

    /// Reaps `pid` if it is a zombie child of ours and not a registered leader.
    pub(crate) fn reap_if_not_leader(&self, pid: i32) -> bool {
        let leaders = self.lock();
        if Pgid::from_raw(pid).is_some_and(|g| leaders.contains(&g)) {
            return false;
        }
        matches!(sys::reap_pid_nohang(pid), Ok(Some(_)))
    }
}

/// A spawn in flight, from its request to the registration of the leader it forked
/// ([`Spawning::register`]) or its failure (dropped): until then no child of the spawner
/// thread is reaped by pid, since the new leader may be one already (a launcher can exit
/// before it is registered).
#[derive(Debug)]
pub(crate) struct Spawning {
    leaders: Arc<Leaders>,
    ended: bool,
}

impl Spawning {
    /// Registers `leader` as live and ends the spawn, in one hold of the registry lock.
    pub(crate) fn register(mut self, leader: Pgid) {
        let leaders = self.leaders.clone();
        let mut set = leaders.lock();
        set.insert(leader);
        self.end();
    }

    /// Ends the spawn; the caller holds the registry lock.
    fn end(&mut self) {
        self.ended = true;
        if self.leaders.spawning.fetch_sub(1, Ordering::Relaxed) == 1
            && self.leaders.deferred.swap(false, Ordering::Relaxed)
        {
            self.leaders.reap_soon();
        }
    }
}

impl Drop for Spawning {
    fn drop(&mut self) {
        if !self.ended {
            let leaders = self.leaders.clone();
            let _set = leaders.lock();
            self.end();
        }
    }
}

/// One pass over the group: reaps what is ours to reap, and says whether any process of it
/// other than the leader's zombie is still there.
fn group_is_empty(leaders: &Leaders, group: Pgid, pidfd: &OwnedFd, me: i32) -> bool {
    let pgid = group.raw();
    // The leader first: while it runs, the group is not empty, whatever else is in it.
    if !leader_exited(pidfd, pgid) {
        return false;
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
        if p.ppid == me && leaders.reap_if_not_leader(p.pid) {
            continue;
        }
        // A dead process that is someone else's child has released everything it held.
        empty &= p.dead();
    }
    empty
}

/// Whether the leader behind `pidfd` has exited, asked of its pidfd (`waitid` with `WNOWAIT`
/// leaves its zombie unreaped, so its pid, the group's id, stays taken). A leader that has not
/// exited counts as a member of its group even if it left it: `signal_group` reaches it
/// through its pidfd anyway. On an error (not expected for our own unreaped child) `/proc`
/// decides, as it did alone before: exited unless a live leader is still in the group.
fn leader_exited(pidfd: &OwnedFd, pgid: i32) -> bool {
    use rustix::process::{waitid, WaitId, WaitIdOptions};
    let options = WaitIdOptions::EXITED | WaitIdOptions::NOHANG | WaitIdOptions::NOWAIT;
    match waitid(WaitId::PidFd(pidfd.as_fd()), options) {
        Ok(status) => status.is_some(),
        Err(_) => !read_stat(pgid).is_some_and(|l| l.pgrp == pgid && !l.dead()),
    }
}

/// Where the survivors of a group whose leader is dead can be, when the daemon is the child
/// subreaper: every process of a worker's group descends from its leader (setsid and setpgid
/// are denied), so once the leader has exited, the topmost survivors have been reparented to
/// the daemon, to its main thread (the kernel picks the subreaper's first live thread, and
/// the main thread of a Rust program lives as long as the process). They stay listed there
/// until reaped, and only their worker reaps members of a live worker's group (see
/// [`reap_orphans`]), so one read of that list sees every survivor or its ancestor.
/// `None` when that list cannot be read: then the whole of `/proc` is scanned. (A worker exists
/// only through a started [`super::Sandbox`], which made the daemon the subreaper.)
pub(crate) fn orphan_candidates(me: i32) -> Option<Vec<ProcStat>> {
    thread_children(me, me)
}

/// The children of thread `tid` of the daemon `me`, as [`orphan_candidates`] reads them.
pub(crate) fn thread_children(me: i32, tid: i32) -> Option<Vec<ProcStat>> {
    // Room for 64 children at once; more is read on.
    let children = read_proc_file(&format!("/proc/{me}/task/{tid}/children"), 512)?;
    Some(
        children
            .split_ascii_whitespace()
            .filter_map(|c| c.parse().ok())
            .filter_map(read_stat)
            .collect(),
    )
}

pub(crate) fn signal_group(pgid: Pgid, pidfd: &OwnedFd, sig: Signal) {
    // The leader through its pidfd (it cannot be a recycled pid), then the whole group, which
    // the unreaped leader keeps from being recycled. ESRCH (already exited) is fine.
    let _ = rustix::process::pidfd_send_signal(pidfd, sig);
    let _ = rustix::process::kill_process_group(pgid.leader(), sig);
}

/// Timeout or cancellation: SIGCONT (stopped processes cannot act on SIGTERM) and SIGTERM to
/// the group, then up to `grace` for it to empty.
pub(crate) async fn terminate(leaders: &Leaders, pgid: Pgid, pidfd: &OwnedFd, grace: Duration) {
    signal_group(pgid, pidfd, Signal::CONT);
    signal_group(pgid, pidfd, Signal::TERM);
    let me = rustix::process::getpid().as_raw_nonzero().get();
    let deadline = Instant::now() + grace;
    let mut delay = Duration::from_millis(2);
    while !group_is_empty(leaders, pgid, pidfd, me) {
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
pub(crate) async fn kill_and_confirm(
    leaders: &Leaders,
    pgid: Pgid,
    pidfd: &OwnedFd,
    cgroup: Option<&Path>,
) {
    let me = rustix::process::getpid().as_raw_nonzero().get();
    let started = Instant::now();
    let mut warned = false;
    let mut delay = Duration::from_millis(1);
    loop {
        signal_group(pgid, pidfd, Signal::KILL);
        if let Some(cg) = cgroup {
            cgroup_kill(cg);
        }
        if group_is_empty(leaders, pgid, pidfd, me) && cgroup.is_none_or(cgroup_is_empty) {
            return;
        }
        if !warned && started.elapsed() > Duration::from_secs(10) {
            warned = true;
            tracing::warn!(
                pgid = pgid.raw(),
                "worker processes survive SIGKILL for 10 s (uninterruptible sleep?); still waiting"
            );
        }
        tokio::time::sleep(delay).await;
        delay = (delay * 2).min(Duration::from_millis(50));
    }
}

/// Reaps the leader through its pidfd and unregisters it, under the registry lock.
/// `Ok(None)` if it has not exited yet.
pub(crate) fn reap_leader(
    leaders: &Leaders,
    pgid: Pgid,
    pidfd: &OwnedFd,
) -> io::Result<Option<Exit>> {
    let mut leaders = leaders.lock();
    let exit = sys::reap_pidfd_nohang(pidfd.as_fd())?;
    if exit.is_some() {
        leaders.remove(&pgid);
    }
    Ok(exit)
}

/// A worker dropped without `finish` and no runtime to confirm in: kill its group and hand
/// the leader to the orphan reaper.
pub(crate) fn kill_and_forget(leaders: &Leaders, pgid: Pgid, pidfd: &OwnedFd) {
    signal_group(pgid, pidfd, Signal::KILL);
    leaders.lock().remove(&pgid);
    // Its group's zombies were skipped while it was live, and may send no further SIGCHLD.
    leaders.reap_soon();
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::os::unix::process::CommandExt;

    #[test]
    fn a_pgid_names_one_positive_group() {
        assert!(Pgid::from_raw(0).is_none());
        assert!(Pgid::from_raw(-5).is_none());
        let g = Pgid::from_raw(4321).expect("positive");
        assert_eq!(g.raw(), 4321);
        assert_eq!(g.as_u32(), 4321);
        assert_eq!(g.leader().as_raw_nonzero().get(), 4321);
        assert_eq!(g.to_string(), "4321");
    }

    /// A child of ours in a group of its own, exited but not reaped (waited for with
    /// WNOWAIT, so no sleep stands in for its exit).
    fn zombie_child() -> Pgid {
        let child = std::process::Command::new("/bin/true")
            .process_group(0)
            .spawn()
            .expect("spawn /bin/true");
        let pid = Pid::from_raw(child.id() as i32).expect("a pid");
        // `child` is dropped unreaped: std never waits on drop.
        drop(child);
        rustix::process::waitid(
            rustix::process::WaitId::Pid(pid),
            rustix::process::WaitIdOptions::EXITED | rustix::process::WaitIdOptions::NOWAIT,
        )
        .expect("waitid");
        Pgid::from_raw(pid.as_raw_nonzero().get()).expect("positive")
    }

    #[test]
    fn a_registered_leader_is_never_reaped_by_the_orphan_path() {
        let leaders = Leaders::default();
        let leader = zombie_child();
        leaders.lock().insert(leader);
        assert!(!leaders.reap_if_not_leader(leader.raw()));
        assert!(
            read_stat(leader.raw()).is_some_and(|s| s.dead()),
            "the leader's zombie must stay until its worker reaps it"
        );
        // Unregistered, it is an orphan like any other.
        leaders.lock().remove(&leader);
        assert!(leaders.reap_if_not_leader(leader.raw()));
        assert!(read_stat(leader.raw()).is_none(), "reaped");
        // And a second reap finds nothing.
        assert!(!leaders.reap_if_not_leader(leader.raw()));
    }

    #[test]
    fn reap_leader_reaps_through_the_pidfd_and_unregisters() {
        let leaders = Leaders::default();
        let leader = zombie_child();
        let pidfd =
            rustix::process::pidfd_open(leader.leader(), rustix::process::PidfdFlags::empty())
                .expect("pidfd_open");
        leaders.lock().insert(leader);
        match reap_leader(&leaders, leader, &pidfd) {
            Ok(Some(Exit::Code(0))) => {}
            other => panic!("reap_leader: {other:?}"),
        }
        assert!(!leaders.lock().contains(&leader));
        assert!(read_stat(leader.raw()).is_none(), "reaped");
    }

    #[test]
    fn a_live_leader_is_not_reaped_and_stays_registered_until_confirmed_dead() {
        let leaders = Leaders::default();
        let child = std::process::Command::new("/bin/sleep")
            .arg("1000")
            .process_group(0)
            .spawn()
            .expect("spawn /bin/sleep");
        let leader = Pgid::from_raw(child.id() as i32).expect("positive");
        drop(child);
        let pidfd =
            rustix::process::pidfd_open(leader.leader(), rustix::process::PidfdFlags::empty())
                .expect("pidfd_open");
        leaders.lock().insert(leader);
        assert!(leaders.in_live_worker_group(leader.raw()));
        assert!(matches!(reap_leader(&leaders, leader, &pidfd), Ok(None)));
        assert!(
            leaders.lock().contains(&leader),
            "still running: still registered"
        );
        // kill_and_forget: the group is killed, the leader handed to the orphan reaper.
        kill_and_forget(&leaders, leader, &pidfd);
        assert!(!leaders.lock().contains(&leader));
        rustix::process::waitid(
            rustix::process::WaitId::PidFd(pidfd.as_fd()),
            rustix::process::WaitIdOptions::EXITED | rustix::process::WaitIdOptions::NOWAIT,
        )
        .expect("waitid");
        assert!(!leaders.in_live_worker_group(leader.raw()));
        assert!(
            leaders.reap_if_not_leader(leader.raw()),
            "the orphan path reaps it"
        );
    }
}
