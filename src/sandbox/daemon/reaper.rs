//! The daemon's orphan reaper: as the child subreaper, it reaps every zombie child that is in
//! no live worker's group.

use std::collections::BTreeSet;
use std::io;
use std::sync::Arc;
use std::time::Duration;

use super::group::{orphan_candidates, thread_children, Leaders, Pgid};
use super::procfs::{all_processes, ProcStat};

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

/// Reaps every zombie child of the daemon (of its main thread, where orphans go, and of the
/// spawner thread, whose children the spawner and the worker templates are) that is neither
/// the leader of a live worker nor a member of its group (its worker's kill-and-confirm reaps those, and counts on seeing them
/// until it does). Orphans are reparented to the daemon's main thread, so its list of
/// children is read, not the whole of `/proc` (one pass over the host's processes per
/// SIGCHLD was most of a call's daemon-side cost); the whole of `/proc` only when that list
/// cannot be read.
pub(crate) fn reap_orphans(leaders: &Leaders) -> usize {
    let me = rustix::process::getpid().as_raw_nonzero().get();
    let live_groups = leaders.lock().clone();
    let (main, everything) = match orphan_candidates(me) {
        Some(children) => (children, Vec::new()),
        None => (Vec::new(), all_processes()),
    };
    // The spawner thread's children: a worker template that died (killed, or stopped after
    // its profile was forgotten) is a zombie there, in no worker's group. So is a launcher
    // that exited before it was registered: those are reaped only while no spawn is in
    // flight (`Leaders::reap_spawner_child`), and so is everything when the main thread's
    // list could not be read.
    let mut spawner_children = leaders
        .spawner_thread()
        .and_then(|t| thread_children(me, t))
        .unwrap_or_default();
    spawner_children.extend(everything);
    let from_main = orphans(me, &main, &live_groups)
        .filter(|pid| leaders.reap_if_not_leader(*pid))
        .count();
    from_main
        + orphans(me, &spawner_children, &live_groups)
            .filter(|pid| leaders.reap_spawner_child(*pid))
            .count()
}

/// Of `candidates`, the pids the orphan reaper may reap: zombie children of `me` in no live
/// worker's group (a live worker's members, zombies included, are its own to reap).
fn orphans<'a>(
    me: i32,
    candidates: &'a [ProcStat],
    live_groups: &'a BTreeSet<Pgid>,
) -> impl Iterator<Item = i32> + 'a {
    candidates
        .iter()
        .filter(move |p| {
            p.ppid == me
                && p.dead()
                && !Pgid::from_raw(p.pgrp).is_some_and(|g| live_groups.contains(&g))
        })
        .map(|p| p.pid)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn process(pid: i32, ppid: i32, pgrp: i32, state: u8) -> ProcStat {
        ProcStat {
            pid,
            state,
            ppid,
            pgrp,
            session: 1,
            start: 0,
        }
    }

    #[test]
    fn only_dead_children_outside_live_groups_are_orphans() {
        let me = 100;
        let live: BTreeSet<Pgid> = [Pgid::from_raw(500).expect("positive")].into();
        let candidates = [
            // A zombie child of ours in a group of no live worker: reaped.
            process(201, me, 201, b'Z'),
            // Also dead (X): reaped.
            process(202, me, 300, b'X'),
            // Still running: not yet.
            process(203, me, 203, b'S'),
            // A zombie of a live worker's group (its leader or a member): the worker's.
            process(500, me, 500, b'Z'),
            process(501, me, 500, b'Z'),
            // Someone else's zombie: not ours to reap.
            process(600, 1, 600, b'Z'),
            // A zombie in group 0 (no group): ours, reaped.
            process(700, me, 0, b'Z'),
        ];
        let got: Vec<i32> = orphans(me, &candidates, &live).collect();
        assert_eq!(got, [201, 202, 700]);
    }
}
