//! In-out targets: the private copy a worker edits, and the snapshot that tells whether anyone
//! else changed the target meanwhile.
//!
//! The copy is a reflink (`FICLONE`) where the filesystem shares extents (xfs, btrfs), else
//! `copy_file_range` (the kernel copies; ext4 has no reflinks). The target's snapshot (its
//! identity, size, mtime and ctime) is taken *before* the copy: a write during the copy
//! changes mtime and ctime, and since the snapshot's `stat` asked for the timestamps, the
//! kernel's multigrain timestamps give that write a fine-grained, different ctime. Just
//! before publication, under the target's lock, the target is compared with the snapshot;
//! after the rename, the old file (now the backup) is compared again, so a write through a
//! descriptor opened earlier that lands between the check and the rename is a conflict too.
//! What this cannot see: a write through such a descriptor *after* the commit, which lands in
//! the old file (the backup, then removed): rename-based publication cannot reach a writer
//! that holds the old inode open.

use std::ffi::OsStr;
use std::os::fd::{AsFd, BorrowedFd, OwnedFd};
use std::path::Path;

use rustix::fs::{Mode, OFlags, Stat};
use rustix::io::Errno;
use serde::{Deserialize, Serialize};

use super::sys::{io, mutate, FileId};
use super::PublishError;

/// What an in-out target was when its copy was taken.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub struct Origin {
    pub id: FileId,
    pub size: u64,
    /// (seconds, nanoseconds)
    pub mtime: (i64, u32),
    pub ctime: (i64, u32),
}

impl Origin {
    // The field types of `Stat` differ between architectures; the casts are lossless on
    // every 64-bit Linux target.
    #[allow(clippy::unnecessary_cast)]
    pub(super) fn of(st: &Stat) -> Origin {
        Origin {
            id: FileId::of(st),
            size: st.st_size as u64,
            mtime: (st.st_mtime as i64, st.st_mtime_nsec as u32),
            ctime: (st.st_ctime as i64, st.st_ctime_nsec as u32),
        }
    }

    /// How `now` differs from this snapshot, if it does.
    pub(super) fn differs(&self, now: &Origin) -> Option<Conflict> {
        if now.id != self.id {
            Some(Conflict::Replaced)
        } else if now.size != self.size {
            Some(Conflict::Resized {
                was: self.size,
                now: now.size,
            })
        } else if now.mtime != self.mtime {
            Some(Conflict::Modified)
        } else if now.ctime != self.ctime {
            Some(Conflict::Touched)
        } else {
            None
        }
    }
}

/// How someone else changed an in-out target while the tool edited its copy.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum Conflict {
    #[error("it was created")]
    Created,
    #[error("it was removed")]
    Removed,
    #[error("it was replaced by another file")]
    Replaced,
    #[error("its size changed from {was} to {now} bytes")]
    Resized { was: u64, now: u64 },
    #[error("its content was modified")]
    Modified,
    #[error("its metadata or content changed (ctime)")]
    Touched,
}

/// Copies the regular file open as `src` into a new file `name` in `dir` (created exclusive,
/// never through a symlink), with `mode`. A reflink where the filesystem can, else
/// `copy_file_range`. Returns the new file, open for reading and writing.
pub(super) fn copy_file(
    src: BorrowedFd<'_>,
    dir: BorrowedFd<'_>,
    name: &OsStr,
    mode: u32,
    path: &Path,
) -> Result<OwnedFd, PublishError> {
    let dst = mutate("publish.copy_inout", path, || {
        rustix::fs::openat(
            dir,
            name,
            OFlags::RDWR | OFlags::CREATE | OFlags::EXCL | OFlags::NOFOLLOW | OFlags::CLOEXEC,
            Mode::from_raw_mode(mode),
        )
    })?;
    match rustix::fs::ioctl_ficlone(dst.as_fd(), src) {
        Ok(()) => return Ok(dst),
        // No shared extents here (ext4, tmpfs, ...): copy.
        Err(Errno::OPNOTSUPP | Errno::XDEV | Errno::INVAL | Errno::NOTTY | Errno::PERM) => {}
        Err(e) => return Err(io("reflink in-out copy", path, e)),
    }
    let mut off_in = 0u64;
    let mut off_out = 0u64;
    loop {
        match rustix::fs::copy_file_range(
            src,
            Some(&mut off_in),
            dst.as_fd(),
            Some(&mut off_out),
            1 << 30,
        ) {
            Ok(0) => break,
            Ok(_) => {}
            Err(Errno::INTR) => {}
            Err(e) => return Err(io("copy in-out target", path, e)),
        }
    }
    Ok(dst)
}

/// Whether the files open as `a` and `b` hold the same bytes (their sizes are equal).
pub(super) fn same_content(a: BorrowedFd<'_>, b: BorrowedFd<'_>) -> Result<bool, Errno> {
    let mut ba = vec![0u8; 128 * 1024];
    let mut bb = vec![0u8; 128 * 1024];
    let mut off = 0u64;
    loop {
        let n = read_full(a, &mut ba, off)?;
        let m = read_full(b, &mut bb[..n.max(1)], off)?;
        if n != m || ba[..n] != bb[..m] {
            return Ok(false);
        }
        if n == 0 {
            return Ok(true);
        }
        off += n as u64;
    }
}

/// `pread`s until `buf` is full or the end of the file.
fn read_full(fd: BorrowedFd<'_>, buf: &mut [u8], off: u64) -> Result<usize, Errno> {
    let mut got = 0;
    while got < buf.len() {
        match rustix::io::pread(fd, &mut buf[got..], off + got as u64) {
            Ok(0) => break,
            Ok(n) => got += n,
            Err(Errno::INTR) => {}
            Err(e) => return Err(e),
        }
    }
    Ok(got)
}
