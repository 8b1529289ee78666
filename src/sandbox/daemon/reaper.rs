//! The daemon's orphan reaper: as the child subreaper, it reaps every zombie child that is in
//! no live worker's group.

use std::io;
use std::sync::Arc;
use std::time::Duration;

use super::group::{orphan_candidates, Leaders, Pgid};
use super::procfs::all_processes;

/// Starts the orphan reaper task on `handle`'s runtime (the daemon is already the child
/// subreaper). The task wakes only on SIGCHLD (every orphan reparented to the subreaper sends
/// one when it exits, and so does one reparented already dead) or on
/// [`Leaders::reap_soon`]: an idle daemon has no periodic work.
pub(crate) fn start_reaper(
    handle: &tokio::runtime::Handle,
    leaders: Arc<Leaders>,
) -> io::Result<()> {
    let mut sigchld = {
        let _guard = handle.enter();
        tokio::signal::unix::signal(tokio::signal::unix::SignalKind::child())?
    };
    handle.spawn(async move {
        loop {
            tokio::select! {
                _ = sigchld.recv() => {}
                _ = leaders.reap_requested() => {}
            }
            reap_orphans(&leaders);
            // A burst of SIGCHLD needs one pass, not one each.
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
    });
    Ok(())
}

/// Reaps every zombie child of the daemon that is neither the leader of a live worker nor a
/// member of its group (its worker's kill-and-confirm reaps those, and counts on seeing them
/// until it does). Orphans are reparented to the daemon's main thread, so its list of
/// children is read, not the whole of `/proc` (one pass over the host's processes per
/// SIGCHLD was most of a call's daemon-side cost); the whole of `/proc` only when that list
/// cannot be read.
pub(crate) fn reap_orphans(leaders: &Leaders) -> usize {
    let me = rustix::process::getpid().as_raw_nonzero().get();
    let live_groups = leaders.lock().clone();
    orphan_candidates(me)
        .unwrap_or_else(all_processes)
        .into_iter()
        .filter(|p| {
            p.ppid == me
                && p.dead()
                && !Pgid::from_raw(p.pgrp).is_some_and(|g| live_groups.contains(&g))
        })
        .filter(|p| leaders.reap_if_not_leader(p.pid))
        .count()
}
