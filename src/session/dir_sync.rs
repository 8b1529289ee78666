//! Group commit of the sessions dir's fsync.

use std::path::Path;
use std::sync::Mutex;

use super::lock;

/// Group commit of the sessions dir: every commit renames its own file into place, then
/// needs the dir fsynced. Concurrent commits share one fsync: a commit returns once an fsync
/// of the dir that began after its rename has succeeded, and while one runs, the commits
/// renamed meanwhile wait for the next one, which one of them runs for all.
///
/// A failed fsync fails every commit it was to cover, not only its runner's: an fsync after
/// it could succeed without having written anything (a failed writeback leaves its blocks
/// clean, and a fresh descriptor is not told of an error another one was), so none of those
/// renames may be taken as durable.
#[derive(Default)]
pub struct DirSync {
    pub(super) state: Mutex<SyncState>,
    synced: std::sync::Condvar,
}

#[derive(Default)]
pub(super) struct SyncState {
    /// Renames done so far (each commit's ticket).
    pub(super) renamed: u64,
    /// Every rename up to this ticket is durable.
    pub(super) durable: u64,
    /// An fsync of the dir is running.
    pub(super) running: bool,
    /// Every rename up to this ticket, and after `durable`, was covered by an fsync that
    /// failed.
    pub(super) failed: u64,
    /// The errno of that fsync (EIO if it had none).
    pub(super) errno: i32,
    /// Runs a test makes fail (EIO), in place of running them.
    #[cfg(test)]
    pub(super) fail_next: u32,
    /// A test's pause inside the next run, before its fsync (the state unlocked).
    #[cfg(test)]
    pub(super) pause: Option<Box<dyn FnOnce() + Send>>,
}

impl DirSync {
    /// Called right after a rename into `dir`; returns once that rename is durable, or fails
    /// if the fsync that was to make it so failed (whoever ran it).
    pub fn after_rename(&self, dir: &Path) -> std::io::Result<()> {
        let mut s = lock(&self.state);
        s.renamed += 1;
        let mine = s.renamed;
        loop {
            if s.durable >= mine {
                return Ok(());
            }
            if s.failed >= mine {
                // The fsync that was to cover this rename failed (another commit ran it).
                return Err(std::io::Error::from_raw_os_error(s.errno));
            }
            if !s.running {
                // Every ticket up to `upto` has finished its rename: this fsync covers them.
                let upto = s.renamed;
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
                match &r {
                    Ok(()) => s.durable = s.durable.max(upto),
                    Err(e) => {
                        s.failed = s.failed.max(upto);
                        s.errno = e.raw_os_error().unwrap_or(libc::EIO);
                    }
                }
                self.synced.notify_all();
                r?;
                continue;
            }
            s = self.synced.wait(s).unwrap_or_else(|p| p.into_inner());
        }
    }
}
