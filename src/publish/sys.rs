//! Thin wrappers over the `*at` syscalls publication uses: every path is resolved beneath a
//! directory fd, never through a symlink, a magic link or a mount crossing.

use std::ffi::OsStr;
use std::os::fd::{AsFd, AsRawFd, BorrowedFd, OwnedFd};
use std::path::{Path, PathBuf};

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
    /// No file: what an in-out target that neither existed nor was created holds.
    pub const NONE: FileId = FileId {
        dev: 0,
        ino: 0,
        kind: 0,
    };

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

/// fsyncs of the write path that must all be durable before the next step, none of which
/// orders another: each keeps its own failpoint, and they are issued together, each on a
/// thread of [`crate::sync_pool`], so that on a journaling filesystem they wait for one
/// commit together rather than one each (ext4 and xfs commit every concurrent fsync's
/// metadata in one transaction).
///
/// [`Syncs::run`] passes every item's failpoint first, in the order the items were added and
/// on the calling thread (so a crash or an injected error lands where a real one would, and
/// the points of a call keep one order), then issues the fsyncs.
#[derive(Default)]
pub(super) struct Syncs {
    /// (failpoint or, unmarked, the operation's name; the fd; its path; whether a failpoint).
    items: Vec<(&'static str, OwnedFd, PathBuf, bool)>,
}

impl Syncs {
    /// Adds the fsync of `fd` (kept open until the group runs), failpoint `op`.
    pub(super) fn push(&mut self, op: &'static str, fd: OwnedFd, path: &Path) {
        self.items.push((op, fd, path.to_path_buf(), true));
    }

    /// Adds an fsync that passes no failpoint (one that only follows a failpoint of its
    /// own step, as after moving a backup, where a crash is already simulated).
    pub(super) fn push_unmarked(&mut self, op: &'static str, fd: OwnedFd, path: &Path) {
        self.items.push((op, fd, path.to_path_buf(), false));
    }

    /// [`Syncs::push`] of a duplicate of a descriptor the caller keeps.
    pub(super) fn push_dup(
        &mut self,
        op: &'static str,
        fd: BorrowedFd<'_>,
        path: &Path,
    ) -> Result<(), PublishError> {
        let dup = fd
            .try_clone_to_owned()
            .map_err(|e| fp_err("dup for fsync", path, e))?;
        self.push(op, dup, path);
        Ok(())
    }

    pub(super) fn is_empty(&self) -> bool {
        self.items.is_empty()
    }

    /// Passes each failpoint, then fsyncs every item at once; the first failure in the
    /// order of the items.
    pub(super) fn run(self) -> Result<(), PublishError> {
        let [r] = run_together([self]);
        r
    }
}

/// Runs several groups of [`Syncs`] at once: every failpoint first (group by group, in
/// order; a group whose failpoint fails issues none of its fsyncs), then every remaining
/// fsync together. Each group gets its own result (its first failure), so that a caller can
/// tell a failure that stops it from one that only costs it something optional.
pub(super) fn run_together<const N: usize>(groups: [Syncs; N]) -> [Result<(), PublishError>; N] {
    together(groups, || (), true).0
}

/// [`run_together`], running `alongside` on the calling thread (after every failpoint of
/// the groups, so that its own failpoints come after theirs, in one order) while the fsyncs
/// run, each on a thread of [`crate::sync_pool`].
pub(super) fn run_together_with<const N: usize, R>(
    groups: [Syncs; N],
    alongside: impl FnOnce() -> R,
) -> ([Result<(), PublishError>; N], R) {
    together(groups, alongside, false)
}

/// The two above: with `last_here`, the last fsync runs on the calling thread (after
/// `alongside`, which is then nothing), the others on pool threads.
fn together<const N: usize, R>(
    groups: [Syncs; N],
    alongside: impl FnOnce() -> R,
    last_here: bool,
) -> ([Result<(), PublishError>; N], R) {
    let mut results: [Result<(), PublishError>; N] = std::array::from_fn(|_| Ok(()));
    let mut issued = Vec::new();
    for (g, group) in groups.into_iter().enumerate() {
        let mut passed = Vec::with_capacity(group.items.len());
        for (op, fd, path, marked) in group.items {
            if let Err(e) = if marked { fp(op) } else { Ok(()) } {
                results[g] = Err(fp_err(op, &path, e));
                passed.clear();
                break;
            }
            passed.push((g, op, fd, path));
        }
        issued.extend(passed);
    }
    let here = if last_here { issued.pop() } else { None };
    let pending: Vec<_> = issued
        .into_iter()
        .map(|(g, op, fd, path)| {
            let sync = crate::sync_pool::run(move || rustix::fs::fsync(fd.as_fd()));
            (g, op, path, sync)
        })
        .collect();
    let ran = alongside();
    let here = here.map(|(g, op, fd, path)| (g, op, path, rustix::fs::fsync(fd.as_fd())));
    let waited = pending.into_iter().map(|(g, op, path, sync)| {
        // A task that never reported panicked in fsync: that fsync failed, never succeeded.
        (g, op, path, sync.wait().unwrap_or(Err(Errno::IO)))
    });
    for (g, op, path, r) in waited.chain(here) {
        if let (Err(e), Ok(())) = (r, &results[g]) {
            results[g] = Err(io(op, &path, e));
        }
    }
    (results, ran)
}

pub(super) fn fsync_dir(fd: BorrowedFd<'_>, path: &Path) -> Result<(), PublishError> {
    rustix::fs::fsync(fd).map_err(|e| io("fsync", path, e))
}

/// `fchmodat2(dir, name, mode, AT_SYMLINK_NOFOLLOW)`: changes the mode of `name` itself,
/// never of what a symlink planted there points to (the kernel refuses to chmod a symlink
/// with EOPNOTSUPP). Linux 6.6 or newer, which the Landlock ABI the profiles need implies.
pub(super) fn chmod_nofollow(dir: BorrowedFd<'_>, name: &OsStr, mode: Mode) -> Result<(), Errno> {
    // The syscall number is the same on every architecture (added after the tables merged).
    const SYS_FCHMODAT2: libc::c_long = 452;
    let name = std::ffi::CString::new(name.as_encoded_bytes()).map_err(|_| Errno::INVAL)?;
    // SAFETY: `dir` is a live fd borrowed for the call, `name` a NUL-terminated string that
    // outlives it; the kernel reads the string and touches no other memory of ours.
    let rc = unsafe {
        libc::syscall(
            SYS_FCHMODAT2,
            dir.as_raw_fd(),
            name.as_ptr(),
            mode.bits() as libc::c_uint,
            libc::AT_SYMLINK_NOFOLLOW as libc::c_uint,
        )
    };
    if rc < 0 {
        Err(Errno::from_io_error(&std::io::Error::last_os_error()).unwrap_or(Errno::IO))
    } else {
        Ok(())
    }
}
