//! Group commit of the workspace filesystem: one `syncfs` in place of an fsync per file or
//! dir of a wave ([`super::sys::Syncs`]), shared by every call whose wave is waiting.
//!
//! Why: on ext4 every fsync writes its inode's block and issues its own cache flush, and on
//! a VM each I/O request is an exit to the host. A write call made ten of them. One `syncfs`
//! writes every dirty page and inode of the filesystem, inode table blocks shared between
//! them once, and flushes once; while it runs, the waves that arrive wait for the next one,
//! which covers them all.
//!
//! Invariants:
//! * A wave returns `Ok` only once a `syncfs` that *began after the wave asked* has succeeded,
//!   followed by an fsync of the root (below): everything the wave's files held when it
//!   asked is on stable storage.
//! * What `syncfs` does not cover, and what does:
//!   - its cache flush comes before its last wait on the block device's buffers (Linux runs
//!     `sync_fs(wait)`, which flushes, then `sync_blockdev`), so on a filesystem without a
//!     journal (ext2, ext4 `^has_journal`) a directory block written last may still sit in
//!     the disk's volatile cache: an fsync of the root follows every `syncfs`, and its flush
//!     covers every write completed before it;
//!   - it reports a writeback error once per open file (`f_sb_err`), and errors found by
//!     background writeback or by another wave's `syncfs` are reported to that wave only: a
//!     page whose writeback failed is clean afterwards, so a later `syncfs` succeeds without
//!     it. So every reported failure is counted ([`FsSync::epoch`]), and a job's wave also
//!     fails if any failure was counted since the job began (before its worker wrote
//!     anything): a failing disk fails every call it may have touched, never commits one
//!     whose data it lost.
//! * The cost: a wave waits for every dirty page of the filesystem, not only its own. A
//!   workspace on a filesystem where others write a lot makes each call wait for their
//!   writeback (as a journal commit on ext4 `data=ordered` already did for an fsync).

use std::os::fd::{AsFd, BorrowedFd, OwnedFd};
use std::sync::{Condvar, Mutex, MutexGuard};

use rustix::io::Errno;

/// The filesystems whose `syncfs` writes and waits for every dirty page and inode and then
/// commits their journal or flushes the disk's cache (by `statfs` magic): ext4 (and ext2/3,
/// which share its magic), xfs, btrfs, tmpfs (nothing to write). On others (FUSE, whose
/// server may not be asked to sync; NFS; anything unknown) a wave keeps an fsync per item.
pub(super) const SYNCFS_FILESYSTEMS: [(&str, i64); 4] = [
    ("ext4", 0xEF53),
    ("xfs", 0x5846_5342),
    ("btrfs", 0x9123_683E),
    ("tmpfs", 0x0102_1994),
];

/// The failures counted when a job began: [`FsSync::wait`] fails the job's waves if the
/// count moved since.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) struct Epoch(u64);

pub(super) struct FsSync {
    /// The workspace root, opened for this alone: its own cursor of the filesystem's
    /// writeback errors.
    fd: OwnedFd,
    state: Mutex<State>,
    synced: Condvar,
    /// Errors a test makes the next runs report, in place of running.
    #[cfg(test)]
    pub(super) inject: Mutex<std::collections::VecDeque<Errno>>,
    /// A test's pause inside the next run, before it syncs.
    #[cfg(test)]
    pub(super) pause: Mutex<Option<Box<dyn FnOnce() + Send>>>,
}

#[derive(Default)]
struct State {
    /// Waves that asked so far (each wave's ticket).
    asked: u64,
    /// Every wave up to this ticket is durable.
    durable: u64,
    /// A `syncfs` is running.
    running: bool,
    /// Runs that failed, ever.
    failures: u64,
    /// Runs done, ever (for tests and the bench's accounting).
    runs: u64,
}

impl std::fmt::Debug for FsSync {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("FsSync").finish_non_exhaustive()
    }
}

impl FsSync {
    /// Opens the root `dir` again for the filesystem's group commit, if its filesystem is
    /// one whose `syncfs` is known to make every file durable ([`SYNCFS_FILESYSTEMS`]);
    /// `Ok(None)` for any other, whose waves keep an fsync per item.
    pub(super) fn open(dir: BorrowedFd<'_>) -> Result<Option<FsSync>, Errno> {
        let kind = rustix::fs::fstatfs(dir)?.f_type;
        #[allow(clippy::unnecessary_cast, clippy::useless_conversion)]
        let kind = kind as i64;
        if !SYNCFS_FILESYSTEMS.iter().any(|(_, magic)| *magic == kind) {
            return Ok(None);
        }
        let fd = super::sys::open_dir_beneath(dir, ".")?;
        Ok(Some(FsSync {
            fd,
            state: Mutex::new(State::default()),
            synced: Condvar::new(),
            #[cfg(test)]
            inject: Default::default(),
            #[cfg(test)]
            pause: Mutex::new(None),
        }))
    }

    fn lock(&self) -> MutexGuard<'_, State> {
        self.state.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// The failures counted so far: taken when a job begins.
    pub(super) fn epoch(&self) -> Epoch {
        Epoch(self.lock().failures)
    }

    /// Runs done so far.
    #[cfg(test)]
    pub(super) fn runs(&self) -> u64 {
        self.lock().runs
    }

    /// Waves that asked so far.
    #[cfg(test)]
    pub(super) fn asked(&self) -> u64 {
        self.lock().asked
    }

    /// Returns once everything written before the call is durable: a run that began after
    /// it succeeded (this caller's, or another's that covered it). Fails if the run that was
    /// to cover it failed, or, with `since`, if any run failed since that epoch.
    pub(super) fn wait(&self, since: Option<Epoch>) -> Result<(), Errno> {
        let mut s = self.lock();
        s.asked += 1;
        let mine = s.asked;
        loop {
            if s.durable >= mine {
                break;
            }
            if !s.running {
                // Every wave up to `upto` has asked already: this run covers them.
                let upto = s.asked;
                s.running = true;
                drop(s);
                let r = self.run();
                s = self.lock();
                s.running = false;
                s.runs += 1;
                match r {
                    Ok(()) => s.durable = s.durable.max(upto),
                    Err(_) => s.failures += 1,
                }
                self.synced.notify_all();
                // A failed run fails its runner; the others run again, and fail by the
                // epoch if they began before it.
                r?;
                continue;
            }
            s = self.synced.wait(s).unwrap_or_else(|p| p.into_inner());
        }
        match since {
            Some(Epoch(seen)) if s.failures != seen => Err(Errno::IO),
            _ => Ok(()),
        }
    }

    /// One `syncfs` of the filesystem, then an fsync of the root for its cache flush.
    fn run(&self) -> Result<(), Errno> {
        #[cfg(test)]
        {
            let pause = self.pause.lock().unwrap_or_else(|p| p.into_inner()).take();
            if let Some(pause) = pause {
                pause();
            }
            let injected = self
                .inject
                .lock()
                .unwrap_or_else(|p| p.into_inner())
                .pop_front();
            if let Some(e) = injected {
                return Err(e);
            }
        }
        rustix::fs::syncfs(self.fd.as_fd())?;
        rustix::fs::fsync(self.fd.as_fd())
    }
}
