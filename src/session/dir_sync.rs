//! Group commit of the sessions dir's fsync.

use std::path::Path;
use std::sync::Mutex;

use super::lock;

/// Group commit of the sessions dir: every commit renames its own file into place, then
/// needs the dir fsynced. Concurrent commits share one fsync: a commit returns once an fsync
/// of the dir that began after its rename has succeeded, and while one runs, the commits
/// renamed meanwhile wait for the next one, which one of them runs for all.
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
}

impl DirSync {
    /// Called right after a rename into `dir`; returns once that rename is durable (or the
    /// fsync that was to make it so failed: then this commit fails, as before).
    pub fn after_rename(&self, dir: &Path) -> std::io::Result<()> {
        let mut s = lock(&self.state);
        s.renamed += 1;
        let mine = s.renamed;
        loop {
            if s.durable >= mine {
                return Ok(());
            }
            if !s.running {
                // Every ticket up to `upto` has finished its rename: this fsync covers them.
                let upto = s.renamed;
                s.running = true;
                drop(s);
                let r = std::fs::File::open(dir).and_then(|f| f.sync_all());
                s = lock(&self.state);
                s.running = false;
                if r.is_ok() {
                    s.durable = s.durable.max(upto);
                }
                self.synced.notify_all();
                // A failed fsync fails its runner; the others try again themselves.
                r?;
                continue;
            }
            s = self.synced.wait(s).unwrap_or_else(|p| p.into_inner());
        }
    }
}
