//! The daemon's orphan reaper: as the child subreaper, it reaps every zombie child that is in
//! no live worker's group.

use std::io;
use std::sync::OnceLock;
use std::time::Duration;

use super::group::{leaders, reap_if_not_leader, Pgid};
use super::procfs::all_processes;

static REAPER: OnceLock<()> = OnceLock::new();

/// Wakes the orphan reaper for what no SIGCHLD announces: a leader handed over unreaped.
static REAP_NOW: tokio::sync::Notify = tokio::sync::Notify::const_new();

/// Asks the orphan reaper for a pass (see [`REAP_NOW`]).
pub(crate) fn reap_soon() {
    REAP_NOW.notify_one();
}

/// Whether `start_reaper` made the daemon the child subreaper.
pub(crate) fn is_subreaper() -> bool {
    REAPER.get().is_some()
}

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
        .filter(|p| {
            p.ppid == me
                && p.dead()
                && !Pgid::from_raw(p.pgrp).is_some_and(|g| live_groups.contains(&g))
        })
        .filter(|p| reap_if_not_leader(p.pid))
        .count()
}
