//! Group commit of the sessions dir's fsync.

use std::path::Path;
use std::sync::Mutex;

use super::lock;

/// Group commit of the sessions dir: every commit renames its own file into place, then
/// needs the dir fsynced. Concurrent commits share one fsync: a commit returns once an fsync
/// of the dir that began after its rename has ended, and while one runs, the commits
/// renamed meanwhile wait for the next one, which one of them runs for all.
///
/// Runs are one at a time, so each covers a range of tickets (the renames since the run
/// before it began), and a rename's fate is its covering run's, whatever ran later: a failed
/// fsync fails every commit it was to cover, not only its runner's, and a later fsync that
/// succeeds does not vouch for them (a failed writeback leaves its blocks clean, and a fresh
/// descriptor is not told of an error another one was, so that fsync may have written
/// nothing of those renames).
#[derive(Default)]
pub struct DirSync {
    pub(super) state: Mutex<SyncState>,
    synced: std::sync::Condvar,
}

#[derive(Default)]
pub(super) struct SyncState {
    /// Renames done so far (each commit's ticket).
    pub(super) renamed: u64,
    /// Every rename up to this ticket was covered by a run that has ended.
    pub(super) covered: u64,
    /// An fsync of the dir is running.
    pub(super) running: bool,
    /// The ranges of tickets (after `.0`, up to `.1`) whose covering run failed, with its
    /// errno (EIO if it had none); a range goes once no ticket in it is waiting.
    pub(super) failed: Vec<(u64, u64, i32)>,
    /// Tickets not yet returned.
    waiting: std::collections::BTreeSet<u64>,
    /// Runs a test makes fail (EIO), in place of running them.
    #[cfg(test)]
    pub(super) fail_next: u32,
    /// A test's pause inside the next run, before its fsync (the state unlocked).
    #[cfg(test)]
    pub(super) pause: Option<Box<dyn FnOnce() + Send>>,
    /// A test's pause of the ticket it names, once woken, before it looks at the state
    /// (the state unlocked): a waiter the scheduler is slow to run.
    #[cfg(test)]
    pub(super) slow_waiter: Option<(u64, Box<dyn FnOnce() + Send>)>,
}

impl SyncState {
    /// The fate of ticket `mine` once a run covering it has ended: the errno of its
    /// covering run if that failed.
    fn fate(&self, mine: u64) -> Result<(), i32> {
        match self
            .failed
            .iter()
            .find(|(after, upto, _)| *after < mine && mine <= *upto)
        {
            Some((_, _, errno)) => Err(*errno),
            None => Ok(()),
        }
    }

    /// Ticket `mine` returns: failed ranges no waiting ticket is in are forgotten.
    fn leave(&mut self, mine: u64) {
        self.waiting.remove(&mine);
        let lowest = self.waiting.first().copied().unwrap_or(u64::MAX);
        self.failed.retain(|(_, upto, _)| *upto >= lowest);
    }
}

impl DirSync {
    /// Called right after a rename into `dir`; returns once that rename is durable, or fails
    /// if the fsync that was to make it so failed (whoever ran it).
    pub fn after_rename(&self, dir: &Path) -> std::io::Result<()> {
        let mut s = lock(&self.state);
        s.renamed += 1;
        let mine = s.renamed;
        s.waiting.insert(mine);
        loop {
            if s.covered >= mine {
                let fate = s.fate(mine);
                s.leave(mine);
                return fate.map_err(std::io::Error::from_raw_os_error);
            }
            if !s.running {
                // Every ticket up to `upto` has finished its rename: this fsync covers them.
                let (after, upto) = (s.covered, s.renamed);
                s.running = true;
                #[cfg(test)]
                let fail = s.fail_next > 0;
                #[cfg(test)]
                {
                    s.fail_next = s.fail_next.saturating_sub(1);
                }
                #[cfg(test)]
                let pause = s.pause.take();
                drop(s);
                #[cfg(test)]
                if let Some(pause) = pause {
                    pause();
                }
                let r = {
                    #[cfg(test)]
                    if fail {
                        Err(std::io::Error::from_raw_os_error(libc::EIO))
                    } else {
                        std::fs::File::open(dir).and_then(|f| f.sync_all())
                    }
                    #[cfg(not(test))]
                    std::fs::File::open(dir).and_then(|f| f.sync_all())
                };
                s = lock(&self.state);
                s.running = false;
                s.covered = upto;
                if let Err(e) = &r {
                    let errno = e.raw_os_error().unwrap_or(libc::EIO);
                    s.failed.push((after, upto, errno));
                }
                self.synced.notify_all();
                continue;
            }
            s = self.synced.wait(s).unwrap_or_else(|p| p.into_inner());
            #[cfg(test)]
            if let Some(slow) = s.slow_waiter.take() {
                if slow.0 == mine {
                    drop(s);
                    (slow.1)();
                    s = lock(&self.state);
                } else {
                    s.slow_waiter = Some(slow);
                }
            }
        }
    }
}
