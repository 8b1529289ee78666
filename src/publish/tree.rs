//! Walking and removing whatever a worker left in a job dir: trees of any depth, any modes,
//! any number of entries, names whose full path is far beyond PATH_MAX.
//!
//! * No recursion: an explicit stack of levels, so depth costs heap, not stack.
//! * No path longer than one name is ever handed to the kernel: every call is
//!   `*at(dirfd, name)`, with `openat2(RESOLVE_BENEATH | RESOLVE_NO_SYMLINKS ...)` to descend.
//! * At most [`OPEN_DIRS`] directory fds are held at once. Climbing back to a level whose fd
//!   was dropped reopens it as `..` of the level below, checked by (device, inode) against
//!   what was recorded on the way down; a mismatch (someone moved a directory meanwhile)
//!   fails the walk instead of acting on another directory.
//! * Permissions are repaired on the way: a directory that cannot be opened is made 0700
//!   (through its parent, never following a symlink), one whose entries cannot be unlinked is
//!   made 0700 through its fd. As root (or with CAP_FOWNER/CAP_DAC_OVERRIDE) this also covers
//!   entries owned by another uid.
//! * Every mutation passes a failpoint (`publish.cleanup_chmod`, `publish.cleanup_unlink`,
//!   `publish.cleanup_rmdir`).

use std::ffi::{OsStr, OsString};
use std::os::fd::{AsFd, BorrowedFd, OwnedFd};
use std::os::unix::ffi::OsStrExt;
use std::path::{Path, PathBuf};

use rustix::fs::{AtFlags, FileType, Mode, OFlags};
use rustix::io::Errno;

use super::sys::{chmod_nofollow, file_type, io, mutate, open_dir_beneath, stat_at};
use super::PublishError;

/// How many directory fds one walk keeps open at most.
const OPEN_DIRS: usize = 32;
/// How many subdirectory names one scan of a directory collects before descending.
const PENDING: usize = 256;

/// What a staging dir holds: every entry beneath it and the apparent size of its regular
/// files. A walk that exceeded a limit stops early, so the figures are then lower bounds.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct Usage {
    pub entries: u64,
    pub bytes: u64,
}

pub(super) struct Level {
    /// Name in the parent level (for the first level: in the walk's parent fd).
    pub(super) name: OsString,
    /// (device, inode) of this directory, to check a reopened `..`.
    id: (u64, u64),
    /// `None` once the walk went more than [`OPEN_DIRS`] levels deeper.
    pub(super) fd: Option<OwnedFd>,
    /// Subdirectories still to visit.
    pub(super) pending: Vec<OsString>,
}

pub(super) struct Walk<'a> {
    parent: BorrowedFd<'a>,
    abs: &'a Path,
    pub(super) stack: Vec<Level>,
}

#[allow(clippy::unnecessary_cast)]
fn dir_id(fd: BorrowedFd<'_>) -> Result<(u64, u64), Errno> {
    let st = rustix::fs::fstat(fd)?;
    Ok((st.st_dev as u64, st.st_ino as u64))
}

impl<'a> Walk<'a> {
    /// Opens `name` in `parent` as the first level; `None` if it does not exist.
    pub(super) fn open(
        parent: BorrowedFd<'a>,
        name: &OsStr,
        abs: &'a Path,
    ) -> Result<Option<Walk<'a>>, PublishError> {
        let Some(fd) = open_repairing(parent, name, abs)? else {
            return Ok(None);
        };
        let id = dir_id(fd.as_fd()).map_err(|e| io("stat directory", abs, e))?;
        Ok(Some(Walk {
            parent,
            abs,
            stack: vec![Level {
                name: name.to_os_string(),
                id,
                fd: Some(fd),
                pending: Vec::new(),
            }],
        }))
    }

    /// The absolute path of the current level (plus `child`), for messages only: shortened
    /// in the middle when the tree is deep.
    pub(super) fn path(&self, child: Option<&OsStr>) -> PathBuf {
        let names: Vec<&OsStr> = self
            .stack
            .iter()
            .skip(1)
            .map(|l| l.name.as_os_str())
            .chain(child)
            .collect();
        let mut p = self.abs.to_path_buf();
        if names.len() <= 8 {
            p.extend(names);
        } else {
            p.extend(&names[..2]);
            p.push(format!("<{} more levels>", names.len() - 5));
            p.extend(&names[names.len() - 3..]);
        }
        p
    }

    pub(super) fn top(&self) -> Result<BorrowedFd<'_>, PublishError> {
        self.stack
            .last()
            .and_then(|l| l.fd.as_ref())
            .map(|fd| fd.as_fd())
            .ok_or_else(|| PublishError::Io {
                op: "walk directory tree",
                path: self.abs.to_path_buf(),
                source: std::io::Error::other("lost the current directory"),
            })
    }

    /// Descends into `name`, a subdirectory of the current level. `Ok(false)` if it vanished.
    pub(super) fn push(&mut self, name: OsString) -> Result<bool, PublishError> {
        let abs = self.path(Some(&name));
        let Some(fd) = open_repairing(self.top()?, &name, &abs)? else {
            return Ok(false);
        };
        let id = dir_id(fd.as_fd()).map_err(|e| io("stat directory", &abs, e))?;
        self.stack.push(Level {
            name,
            id,
            fd: Some(fd),
            pending: Vec::new(),
        });
        // Keep the fds of the first level and of the last OPEN_DIRS levels only.
        let n = self.stack.len();
        if n > OPEN_DIRS + 1 {
            self.stack[n - OPEN_DIRS - 1].fd = None;
        }
        Ok(true)
    }

    /// Leaves the current level; the level above becomes current (reopened as `..` if its fd
    /// was dropped). Returns the level left.
    pub(super) fn pop(&mut self) -> Result<Level, PublishError> {
        let left = self.stack.pop().ok_or_else(|| PublishError::Io {
            op: "walk directory tree",
            path: self.abs.to_path_buf(),
            source: std::io::Error::other("climbed above the tree"),
        })?;
        if let Some(up) = self.stack.last() {
            if up.fd.is_none() {
                let abs = self.path(None);
                let from = left.fd.as_ref().ok_or_else(|| PublishError::Io {
                    op: "reopen directory",
                    path: abs.clone(),
                    source: std::io::Error::other("no fd below it"),
                })?;
                // ".." is never a symlink; the identity check below tells whether it is still
                // the directory recorded on the way down.
                let fd = rustix::fs::openat(
                    from.as_fd(),
                    "..",
                    OFlags::RDONLY | OFlags::DIRECTORY | OFlags::NOFOLLOW | OFlags::CLOEXEC,
                    Mode::empty(),
                )
                .map_err(|e| io("reopen directory", &abs, e))?;
                let id = dir_id(fd.as_fd()).map_err(|e| io("stat directory", &abs, e))?;
                if id != up.id {
                    return Err(PublishError::Io {
                        op: "reopen directory",
                        path: abs,
                        source: std::io::Error::other(
                            "it was moved while the tree was being walked",
                        ),
                    });
                }
                if let Some(up) = self.stack.last_mut() {
                    up.fd = Some(fd);
                }
            }
        }
        Ok(left)
    }
}

/// Opens directory `name` in `parent`, making it 0700 first if it is not readable and
/// searchable; `None` if it does not exist.
pub(super) fn open_repairing(
    parent: BorrowedFd<'_>,
    name: &OsStr,
    abs: &Path,
) -> Result<Option<OwnedFd>, PublishError> {
    match open_dir_beneath(parent, name) {
        Ok(fd) => Ok(Some(fd)),
        Err(Errno::NOENT) => Ok(None),
        Err(Errno::ACCESS | Errno::PERM) => {
            mutate("publish.cleanup_chmod", abs, || {
                chmod_nofollow(parent, name, Mode::from_raw_mode(0o700))
            })?;
            match open_dir_beneath(parent, name) {
                Ok(fd) => Ok(Some(fd)),
                Err(Errno::NOENT) => Ok(None),
                Err(e) => Err(io("open directory", abs, e)),
            }
        }
        Err(e) => Err(io("open directory", abs, e)),
    }
}

/// The type of entry `name` in `dir`, from the dirent or, when it does not say, an lstat.
fn entry_type(
    dir: BorrowedFd<'_>,
    name: &OsStr,
    ft: FileType,
    abs: impl Fn() -> PathBuf,
) -> Result<Option<FileType>, PublishError> {
    match ft {
        FileType::Unknown => match stat_at(dir, name) {
            Ok(st) => Ok(st.map(|st| file_type(&st))),
            Err(e) => Err(io("stat", &abs(), e)),
        },
        ft => Ok(Some(ft)),
    }
}

/// Reads directory `fd`, calling `each(name, type)` for every entry but `.` and `..`, until
/// `each` returns `false`.
pub(super) fn scan(
    fd: BorrowedFd<'_>,
    abs: &Path,
    mut each: impl FnMut(&OsStr, FileType) -> Result<bool, PublishError>,
) -> Result<(), PublishError> {
    let dir = rustix::fs::Dir::read_from(fd).map_err(|e| io("read directory", abs, e))?;
    for entry in dir {
        let entry = entry.map_err(|e| io("read directory", abs, e))?;
        let bytes = entry.file_name().to_bytes();
        if bytes == b"." || bytes == b".." {
            continue;
        }
        if !each(OsStr::from_bytes(bytes), entry.file_type())? {
            break;
        }
    }
    Ok(())
}

/// Removes the directory `name` in `parent` and everything beneath it, without following any
/// symlink (symlinks are unlinked, never traversed). A missing `name` is not an error. `abs`
/// is the absolute path of `name`, for messages.
pub(super) fn remove_tree(
    parent: BorrowedFd<'_>,
    name: &OsStr,
    abs: &Path,
) -> Result<(), PublishError> {
    let Some(mut walk) = Walk::open(parent, name, abs)? else {
        return Ok(());
    };
    loop {
        let next = match walk.stack.last_mut().and_then(|l| l.pending.pop()) {
            Some(n) => Some(n),
            None => {
                // Unlink every non-directory of the current level and collect up to PENDING
                // subdirectories. A level is rescanned after its pending list is done, so a
                // directory with more subdirectories than that is finished in rounds.
                let found = clear_level(&walk)?;
                if let Some(l) = walk.stack.last_mut() {
                    l.pending = found;
                }
                walk.stack.last_mut().and_then(|l| l.pending.pop())
            }
        };
        match next {
            Some(child) => {
                walk.push(child)?;
            }
            None => {
                // The current level is empty: remove it from the level above.
                let depth = walk.stack.len();
                let left = walk.pop()?;
                drop(left.fd);
                let (pfd, path) = if depth == 1 {
                    (walk.parent, abs.to_path_buf())
                } else {
                    (walk.top()?, walk.path(Some(&left.name)))
                };
                rmdir_repairing(pfd, &left.name, &path)?;
                if depth == 1 {
                    return Ok(());
                }
            }
        }
    }
}

/// Removes entry `name` of `dir`, whatever it is (a tree without following a symlink); a
/// non-directory's unlink passes failpoint `op`.
pub(super) fn remove_entry(
    dir: BorrowedFd<'_>,
    name: &OsStr,
    abs: &Path,
    op: &'static str,
) -> Result<(), PublishError> {
    match stat_at(dir, name).map_err(|e| io("stat", abs, e))? {
        None => Ok(()),
        Some(st) if file_type(&st) == FileType::Directory => remove_tree(dir, name, abs),
        Some(_) => mutate(op, abs, || {
            match rustix::fs::unlinkat(dir, name, AtFlags::empty()) {
                Err(Errno::NOENT) => Ok(()),
                r => r,
            }
        }),
    }
}

/// The names in a directory (`.` and `..` left out), read through a description of its own
/// (one `openat`), so `fd`'s position is left as it was.
pub(super) fn names(fd: BorrowedFd<'_>, abs: &Path) -> Result<Vec<OsString>, PublishError> {
    let dup: OwnedFd = rustix::fs::openat(
        fd,
        ".",
        OFlags::RDONLY | OFlags::DIRECTORY | OFlags::CLOEXEC,
        Mode::empty(),
    )
    .map_err(|e| io("open", abs, e))?;
    let mut out = Vec::new();
    let mut d = rustix::fs::Dir::new(dup).map_err(|e| io("read directory", abs, e))?;
    while let Some(ent) = d.read() {
        let ent = ent.map_err(|e| io("read directory", abs, e))?;
        let n = ent.file_name().to_bytes();
        if n != b"." && n != b".." {
            out.push(OsStr::from_bytes(n).to_os_string());
        }
    }
    Ok(out)
}

/// Unlinks every non-directory entry of the walk's current level; returns up to [`PENDING`]
/// names of subdirectories.
fn clear_level(walk: &Walk<'_>) -> Result<Vec<OsString>, PublishError> {
    let fd = walk.top()?;
    let here = walk.path(None);
    let mut subdirs = Vec::new();
    let mut repaired = false;
    scan(fd, &here, |name, ft| {
        let Some(ft) = entry_type(fd, name, ft, || walk.path(Some(name)))? else {
            return Ok(true);
        };
        if ft == FileType::Directory {
            subdirs.push(name.to_os_string());
            return Ok(subdirs.len() < PENDING);
        }
        let unlink = || {
            mutate("publish.cleanup_unlink", &walk.path(Some(name)), || {
                rustix::fs::unlinkat(fd, name, AtFlags::empty())
            })
        };
        match unlink() {
            Ok(()) => Ok(true),
            Err(e) if errno_of(&e) == Some(libc::ENOENT) => Ok(true),
            Err(e) if !repaired && matches!(errno_of(&e), Some(libc::EACCES | libc::EPERM)) => {
                // The worker took write permission (or set the sticky bit) on this directory.
                repaired = true;
                mutate("publish.cleanup_chmod", &here, || {
                    rustix::fs::fchmod(fd, Mode::from_raw_mode(0o700))
                })?;
                match unlink() {
                    Ok(()) => Ok(true),
                    Err(e) if errno_of(&e) == Some(libc::ENOENT) => Ok(true),
                    Err(e) => Err(e),
                }
            }
            Err(e) => Err(e),
        }
    })?;
    Ok(subdirs)
}

/// Removes the empty directory `name` in `parent`, making `parent` writable if needed.
fn rmdir_repairing(parent: BorrowedFd<'_>, name: &OsStr, abs: &Path) -> Result<(), PublishError> {
    let rmdir = || {
        mutate("publish.cleanup_rmdir", abs, || {
            rustix::fs::unlinkat(parent, name, AtFlags::REMOVEDIR)
        })
    };
    match rmdir() {
        Ok(()) => Ok(()),
        Err(e) if errno_of(&e) == Some(libc::ENOENT) => Ok(()),
        Err(e) if matches!(errno_of(&e), Some(libc::EACCES | libc::EPERM)) => {
            let parent_path = abs.parent().unwrap_or(abs);
            mutate("publish.cleanup_chmod", parent_path, || {
                rustix::fs::fchmod(parent, Mode::from_raw_mode(0o700))
            })?;
            match rmdir() {
                Ok(()) => Ok(()),
                Err(e) if errno_of(&e) == Some(libc::ENOENT) => Ok(()),
                Err(e) => Err(e),
            }
        }
        Err(e) => Err(e),
    }
}

fn errno_of(e: &PublishError) -> Option<i32> {
    match e {
        PublishError::Io { source, .. } => source.raw_os_error(),
        _ => None,
    }
}

/// Counts the entries beneath directory `name` in `parent` and the apparent size of its
/// regular files, without following symlinks and repairing unreadable directories as
/// [`remove_tree`] does. Stops as soon as `entries > max_entries` or `bytes > max_bytes`.
pub(super) fn usage(
    parent: BorrowedFd<'_>,
    name: &OsStr,
    abs: &Path,
    max_entries: u64,
    max_bytes: u64,
) -> Result<Usage, PublishError> {
    let mut u = Usage::default();
    let Some(mut walk) = Walk::open(parent, name, abs)? else {
        return Ok(u);
    };
    // The first visit of a level lists it whole; then its pending subdirectories are visited.
    let mut fresh = true;
    loop {
        if fresh {
            let fd = walk.top()?;
            let here = walk.path(None);
            let mut subdirs = Vec::new();
            scan(fd, &here, |child, _| {
                let st = match stat_at(fd, child) {
                    Ok(Some(st)) => st,
                    Ok(None) => return Ok(true),
                    Err(e) => return Err(io("stat", &walk.path(Some(child)), e)),
                };
                u.entries += 1;
                match file_type(&st) {
                    FileType::Directory => subdirs.push(child.to_os_string()),
                    FileType::RegularFile => {
                        #[allow(clippy::unnecessary_cast)]
                        let size = st.st_size.max(0) as u64;
                        u.bytes = u.bytes.saturating_add(size);
                    }
                    _ => {}
                }
                Ok(u.entries <= max_entries && u.bytes <= max_bytes)
            })?;
            if u.entries > max_entries || u.bytes > max_bytes {
                return Ok(u);
            }
            if let Some(l) = walk.stack.last_mut() {
                l.pending = subdirs;
            }
        }
        match walk.stack.last_mut().and_then(|l| l.pending.pop()) {
            Some(child) => fresh = walk.push(child)?,
            None => {
                if walk.stack.len() == 1 {
                    return Ok(u);
                }
                walk.pop()?;
                fresh = false;
            }
        }
    }
}
