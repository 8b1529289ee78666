//! Thin wrappers over the `*at` syscalls publication uses: every path is resolved beneath a
//! directory fd, never through a symlink, a magic link or a mount crossing.

use std::ffi::OsStr;
use std::os::fd::{AsFd, BorrowedFd, OwnedFd};
use std::path::Path;

use rustix::fs::{AtFlags, FileType, Mode, OFlags, ResolveFlags, Stat};
use rustix::io::Errno;
use serde::{Deserialize, Serialize};

use super::{fp, PublishError};

/// How every path below a dirfd is resolved: no escape, no symlink, no magic link, no mount
/// crossing (a rename across mounts would fail with EXDEV anyway; refuse it up front).
pub(super) fn resolve_flags() -> ResolveFlags {
    ResolveFlags::BENEATH
        | ResolveFlags::NO_SYMLINKS
        | ResolveFlags::NO_MAGICLINKS
        | ResolveFlags::NO_XDEV
}

/// openat2 beneath `dir`, retried while the kernel reports EAGAIN (a concurrent rename or
/// mount raced the lookup).
pub(super) fn open_beneath<P: AsRef<Path>>(
    dir: BorrowedFd<'_>,
    path: P,
    oflags: OFlags,
) -> Result<OwnedFd, Errno> {
    let path = path.as_ref();
    let path = if path.as_os_str().is_empty() {
        Path::new(".")
    } else {
        path
    };
    let mut last = Errno::AGAIN;
    for _ in 0..64 {
        match rustix::fs::openat2(
            dir,
            path,
            // No O_NOFOLLOW: RESOLVE_NO_SYMLINKS already refuses a trailing symlink, and
            // reports it as ELOOP (O_NOFOLLOW | O_DIRECTORY would say ENOTDIR instead).
            oflags | OFlags::CLOEXEC,
            Mode::empty(),
            resolve_flags(),
        ) {
            Err(Errno::AGAIN) => last = Errno::AGAIN,
            other => return other,
        }
    }
    Err(last)
}

/// Opens a directory beneath `dir` for reading and fsync (not O_PATH: fsync needs a real fd).
pub(super) fn open_dir_beneath<P: AsRef<Path>>(
    dir: BorrowedFd<'_>,
    path: P,
) -> Result<OwnedFd, Errno> {
    open_beneath(dir, path, OFlags::RDONLY | OFlags::DIRECTORY)
}

/// lstat of `name` in `dir`; `None` when it does not exist.
pub(super) fn stat_at(dir: BorrowedFd<'_>, name: &OsStr) -> Result<Option<Stat>, Errno> {
    match rustix::fs::statat(dir, name, AtFlags::SYMLINK_NOFOLLOW) {
        Ok(st) => Ok(Some(st)),
        Err(Errno::NOENT) => Ok(None),
        Err(e) => Err(e),
    }
}

pub(super) fn file_type(st: &Stat) -> FileType {
    FileType::from_raw_mode(st.st_mode)
}

pub(super) fn describe(ft: FileType) -> &'static str {
    match ft {
        FileType::RegularFile => "a regular file",
        FileType::Directory => "a directory",
        FileType::Symlink => "a symlink",
        FileType::Fifo => "a FIFO",
        FileType::Socket => "a socket",
        FileType::CharacterDevice => "a character device",
        FileType::BlockDevice => "a block device",
        FileType::Unknown => "an unknown kind of file",
    }
}

/// The identity of a file: what a target holds is told by (device, inode, type), never by
/// name. The type matters because a filesystem may hand a freed inode number straight to a
/// new file: a directory planted where a file was removed can carry the old file's number.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub struct FileId {
    pub dev: u64,
    pub ino: u64,
    /// `st_mode & S_IFMT`.
    #[serde(default)]
    pub kind: u32,
}

impl FileId {
    // The field types of `Stat` differ between architectures (u64 on x86_64, c_ulong
    // elsewhere); the casts are lossless on every 64-bit Linux target.
    #[allow(clippy::unnecessary_cast)]
    pub(super) fn of(st: &Stat) -> FileId {
        FileId {
            dev: st.st_dev as u64,
            ino: st.st_ino as u64,
            kind: st.st_mode as u32 & libc::S_IFMT,
        }
    }
}

#[allow(clippy::unnecessary_cast)]
pub(super) fn nlink(st: &Stat) -> u64 {
    st.st_nlink as u64
}

pub(super) fn io(op: &'static str, path: &Path, e: Errno) -> PublishError {
    PublishError::Io {
        op,
        path: path.to_path_buf(),
        source: e.into(),
    }
}

pub(super) fn fp_err(op: &'static str, path: &Path, e: std::io::Error) -> PublishError {
    PublishError::Io {
        op,
        path: path.to_path_buf(),
        source: e,
    }
}

/// Calls the failpoint `op`, then the mutation, mapping either failure to `Io { op, path }`.
pub(super) fn mutate<T>(
    op: &'static str,
    path: &Path,
    f: impl FnOnce() -> Result<T, Errno>,
) -> Result<T, PublishError> {
    fp(op).map_err(|e| fp_err(op, path, e))?;
    f().map_err(|e| io(op, path, e))
}

pub(super) fn fsync_dir(fd: BorrowedFd<'_>, path: &Path) -> Result<(), PublishError> {
    rustix::fs::fsync(fd).map_err(|e| io("fsync", path, e))
}

/// The deepest directory tree [`remove_tree`] descends; deeper trees are refused rather than
/// risking the stack of a runtime thread.
const MAX_DEPTH: usize = 128;

/// Removes the directory `name` in `parent` and everything beneath it, without following any
/// symlink (symlinks are unlinked, never traversed). A missing `name` is not an error.
/// `abs` is the absolute path of `name`, for messages.
pub(super) fn remove_tree(
    parent: BorrowedFd<'_>,
    name: &OsStr,
    abs: &Path,
) -> Result<(), PublishError> {
    remove_tree_depth(parent, name, abs, 0)
}

fn remove_tree_depth(
    parent: BorrowedFd<'_>,
    name: &OsStr,
    abs: &Path,
    depth: usize,
) -> Result<(), PublishError> {
    if depth > MAX_DEPTH {
        return Err(PublishError::Io {
            op: "remove directory tree",
            path: abs.to_path_buf(),
            source: std::io::Error::other(format!("nested deeper than {MAX_DEPTH} levels")),
        });
    }
    let fd = match open_dir_beneath(parent, name) {
        Ok(fd) => fd,
        Err(Errno::NOENT) => return Ok(()),
        Err(Errno::ACCESS) => {
            // The worker may have left a directory without read or search permission; it is
            // ours (same owner), so make it traversable and try again.
            mutate("publish.cleanup_chmod", abs, || {
                rustix::fs::chmodat(parent, name, Mode::from_raw_mode(0o700), AtFlags::empty())
            })?;
            open_dir_beneath(parent, name).map_err(|e| io("open directory", abs, e))?
        }
        Err(e) => return Err(io("open directory", abs, e)),
    };
    let mut entries = Vec::new();
    {
        let dir =
            rustix::fs::Dir::read_from(fd.as_fd()).map_err(|e| io("read directory", abs, e))?;
        for entry in dir {
            let entry = entry.map_err(|e| io("read directory", abs, e))?;
            let bytes = entry.file_name().to_bytes();
            if bytes == b"." || bytes == b".." {
                continue;
            }
            let child = <OsStr as std::os::unix::ffi::OsStrExt>::from_bytes(bytes).to_os_string();
            entries.push((child, entry.file_type()));
        }
    }
    for (child, ft) in entries {
        let child_abs = abs.join(&child);
        let ft = match ft {
            FileType::Unknown => match stat_at(fd.as_fd(), &child) {
                Ok(Some(st)) => file_type(&st),
                Ok(None) => continue,
                Err(e) => return Err(io("stat", &child_abs, e)),
            },
            ft => ft,
        };
        if ft == FileType::Directory {
            remove_tree_depth(fd.as_fd(), &child, &child_abs, depth + 1)?;
        } else {
            match mutate("publish.cleanup_unlink", &child_abs, || {
                rustix::fs::unlinkat(fd.as_fd(), child.as_os_str(), AtFlags::empty())
            }) {
                Ok(()) => {}
                Err(PublishError::Io { source, .. })
                    if source.raw_os_error() == Some(libc::ENOENT) => {}
                Err(e) => return Err(e),
            }
        }
    }
    drop(fd);
    match mutate("publish.cleanup_rmdir", abs, || {
        rustix::fs::unlinkat(parent, name, AtFlags::REMOVEDIR)
    }) {
        Ok(()) => Ok(()),
        Err(PublishError::Io { source, .. }) if source.raw_os_error() == Some(libc::ENOENT) => {
            Ok(())
        }
        Err(e) => Err(e),
    }
}
