//! Idle job dirs, kept for the next job: a job dir's tree (the dir, `stage/`, `stage/0`, and
//! its blank journal if it wrote one) is emptied and renamed aside when its job ends, and the
//! next job renames it back under its own name instead of making three new directories and a
//! journal file. On ext4 without a journal, making a directory or a file scans past every
//! inode its group freed in the last half minute; reusing the tree makes and frees none.
//!
//! Invariants:
//! * An idle dir is the daemon's alone: before it is set aside, `stage/` and `stage/0` are
//!   given back to the daemon's uid and gid and the job dir is made 0700, so no worker uid
//!   owns or can reach anything in it (a worker that kept an fd to its staging dir can
//!   neither write through it nor chmod it any more).
//! * Nothing is reused unchecked: when set aside and again when taken, each of the three
//!   dirs must be a directory the daemon owns, mode 0700, with exactly the expected entries
//!   (the job dir `stage` and maybe `recovery.json`, `stage` only `0`, `0` nothing), no
//!   extended attribute but the `security.` ones a fresh directory also gets (no ACL), and no
//!   inode flag a fresh directory here would not have; the journal, a regular file the
//!   daemon owns, mode 0600, one link, holding exactly the blank marker (`null`, padded
//!   with spaces to at most a block: `journal::blank_marker`), with the same rules for attributes and flags. Anything else is removed and a fresh tree made.
//! * An idle dir is named `.airlock-job-.idle-<n>`: a job id holds no dot, so no job dir is
//!   named so, and a path parameter cannot name it (the job dir prefix is reserved).
//!   Recovery removes idle dirs without reporting them while their journal is blank or
//!   absent: they hold nothing of any job (one whose journal reads otherwise, which no path
//!   of the daemon leaves, it keeps aside like a job dir it cannot prove disposable). A
//!   crash while one is set aside or taken leaves a dir without a journal or with a blank
//!   one, under either name, which recovery removes.
//! * Taking and setting aside are renames within the workspace root and `chown`/`chmod`s:
//!   every one passes a failpoint (`publish.pool_chown`, `publish.pool_chmod`,
//!   `publish.pool_keep`, `publish.pool_take`), and none is fsynced: neither an idle dir's
//!   name nor a job's needs to survive a power loss. What must is the dir's entry in the
//!   root under *some* name, so that recovery finds the journal: the root's fsync
//!   (`fsync_root`) makes it durable before the first job that publishes from a fresh dir
//!   renames anything, and the pool remembers that a dir's entry is durable so that later
//!   jobs skip that fsync. Recovery goes by the job a journal names, whatever the dir's
//!   name (an idle one, or an earlier job's).

use std::ffi::OsStr;
use std::os::fd::{AsFd, BorrowedFd, OwnedFd};
use std::path::Path;
use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};
use std::sync::{Mutex, OnceLock};

use rustix::fs::{FileType, Mode, OFlags, RenameFlags};

use super::journal::{is_blank, JOURNAL, PAD_MAX};
use super::sys::{file_type, mutate, nlink, open_beneath, open_dir_beneath};
use super::tree::{names, remove_entry, remove_tree};
use super::{PublishError, STAGE};

/// Idle dirs are `<root>/.airlock-job-.idle-<n>/`.
pub(super) const IDLE_PREFIX: &str = ".airlock-job-.idle-";
/// The slot an idle dir keeps (a job's first output's).
pub(super) const KEPT_SLOT: &str = "0";

/// ext4's flags a directory gets by itself: extents, a hashed index once it grows, inline
/// data.
const NATURAL_FLAGS: u32 = 0x0008_0000 | 0x0000_1000 | 0x1000_0000;

/// A number for each idle dir this process sets aside (names never repeat within a run).
static NEXT_IDLE: AtomicU64 = AtomicU64::new(0);

/// Whether `name` (in the workspace root) is an idle dir's.
pub(super) fn is_idle(name: &[u8]) -> bool {
    name.starts_with(IDLE_PREFIX.as_bytes())
}

/// The idle dirs of one workspace.
#[derive(Debug, Default)]
pub(super) struct Pool {
    /// Names of the idle dirs, most recently set aside last, each with whether its entry in
    /// the root is durable (under some name).
    idle: Mutex<Vec<(String, bool)>>,
    /// How many idle dirs are kept at most; 0: none (the default).
    cap: AtomicUsize,
    /// The inode flags a dir of the pool may have: the workspace root's (read once, when the
    /// first dir is checked) and [`NATURAL_FLAGS`].
    allowed_flags: OnceLock<u32>,
}

/// A job dir taken from the pool, renamed to its job's name: the dir and its `stage/` open,
/// its blank journal, open read-write, if it has one, and whether its entry in the root is
/// durable (under some name).
pub(super) struct Taken {
    pub(super) fd: OwnedFd,
    pub(super) stage: OwnedFd,
    pub(super) journal: Option<std::fs::File>,
    pub(super) entry_durable: bool,
}

/// Why a tree is not fit for reuse.
#[derive(Debug, thiserror::Error)]
enum Unfit {
    #[error("{0}: {1}")]
    Io(&'static str, rustix::io::Errno),
    #[error("{0} is owned by {1}:{2}")]
    Owner(&'static str, u32, u32),
    #[error("{0} has mode {1:o}")]
    Mode(&'static str, u32),
    #[error("{0} holds {1:?}")]
    Entries(&'static str, Vec<std::ffi::OsString>),
    #[error("{0} has the extended attribute {1:?}")]
    Xattr(&'static str, String),
    #[error("{0} has the inode flags {1:#x}")]
    Flags(&'static str, u32),
    #[error("its journal is not blank")]
    NotBlank,
    #[error(
        "{0} is {1} bytes, more than a block: it held many entries once (a dir never shrinks)"
    )]
    Size(&'static str, i64),
}

impl Pool {
    /// Keeps up to `cap` idle dirs from now on.
    pub(super) fn keep_up_to(&self, cap: usize) {
        self.cap.store(cap, Ordering::Relaxed);
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, Vec<(String, bool)>> {
        self.idle.lock().unwrap_or_else(|p| p.into_inner())
    }

    fn allowed_flags(&self, root: BorrowedFd<'_>) -> u32 {
        *self
            .allowed_flags
            .get_or_init(|| flags(root).unwrap_or(0) | NATURAL_FLAGS)
    }

    /// Takes an idle dir for job dir `name` (in `root`, at `root_path`): checked, renamed to
    /// `name`, opened. `None`: none is idle, or the one taken was unfit (it is removed) or
    /// could not be renamed; the caller makes a fresh tree.
    pub(super) fn take(&self, root: BorrowedFd<'_>, root_path: &Path, name: &str) -> Option<Taken> {
        loop {
            let (idle, entry_durable) = self.lock().pop()?;
            let abs = root_path.join(&idle);
            let allowed = self.allowed_flags(root);
            let fit = open_dir_beneath(root, &idle)
                .map_err(|e| Unfit::Io("open", e))
                .and_then(|fd| open_tree(fd.as_fd()).map(|(stage, slot)| (fd, stage, slot)))
                .and_then(|(fd, stage, slot)| {
                    let journal = check_tree(fd.as_fd(), stage.as_fd(), slot.as_fd(), allowed)?;
                    Ok((fd, stage, journal))
                });
            let (fd, stage, journal) = match fit {
                Ok(fds) => fds,
                Err(why) => {
                    tracing::warn!(dir = %abs.display(), %why, "an idle job dir is unfit for reuse; removed");
                    discard(root, &idle, &abs);
                    continue;
                }
            };
            let renamed = mutate("publish.pool_take", &root_path.join(name), || {
                rustix::fs::renameat_with(root, &idle, root, name, RenameFlags::NOREPLACE)
            });
            if let Err(e) = renamed {
                tracing::warn!(dir = %abs.display(), error = %crate::report::chain(&e), "cannot take an idle job dir; removed");
                discard(root, &idle, &abs);
                return None;
            }
            return Some(Taken {
                fd,
                stage,
                journal,
                entry_durable,
            });
        }
    }

    /// Sets job dir `name` (`fd`, at `abs`; its entry in the root durable under some name if
    /// `entry_durable`) aside for a later job, its journal blank or never written:
    /// `stage/` emptied but for an empty `stage/0`, given back to the daemon, checked, and
    /// renamed to an idle name. `Ok(false)`: the pool is full, or the tree does not have the
    /// shape of a reusable one; the caller removes it. An `Err` leaves the dir under one of
    /// its two names, without a journal, for the caller (or recovery) to remove.
    pub(super) fn keep(
        &self,
        root: BorrowedFd<'_>,
        root_path: &Path,
        name: &str,
        fd: BorrowedFd<'_>,
        entry_durable: bool,
    ) -> Result<bool, PublishError> {
        if self.lock().len() >= self.cap.load(Ordering::Relaxed) {
            return Ok(false);
        }
        let abs = root_path.join(name);
        let stage_abs = abs.join(STAGE);
        let slot_abs = stage_abs.join(KEPT_SLOT);
        let Ok((stage, slot)) = open_tree(fd) else {
            return Ok(false);
        };
        for n in names(stage.as_fd(), &stage_abs)? {
            if n != KEPT_SLOT {
                remove_entry(
                    stage.as_fd(),
                    &n,
                    &stage_abs.join(&n),
                    "publish.cleanup_unlink",
                )?;
            }
        }
        for n in names(slot.as_fd(), &slot_abs)? {
            remove_entry(
                slot.as_fd(),
                &n,
                &slot_abs.join(&n),
                "publish.cleanup_unlink",
            )?;
        }
        let (euid, egid) = (rustix::process::geteuid(), rustix::process::getegid());
        for (dir, path) in [(&slot, &slot_abs), (&stage, &stage_abs)] {
            let st = rustix::fs::fstat(dir).map_err(|e| super::sys::io("stat", path, e))?;
            if (st.st_uid, st.st_gid) != (euid.as_raw(), egid.as_raw()) {
                mutate("publish.pool_chown", path, || {
                    rustix::fs::fchown(dir, Some(euid), Some(egid))
                })?;
            }
            if st.st_mode & 0o7777 != 0o700 {
                mutate("publish.pool_chmod", path, || {
                    rustix::fs::fchmod(dir, Mode::from_raw_mode(0o700))
                })?;
            }
        }
        let st = rustix::fs::fstat(fd).map_err(|e| super::sys::io("stat", &abs, e))?;
        if st.st_mode & 0o7777 != 0o700 {
            mutate("publish.pool_chmod", &abs, || {
                rustix::fs::fchmod(fd, Mode::from_raw_mode(0o700))
            })?;
        }
        if let Err(why) = check_tree(fd, stage.as_fd(), slot.as_fd(), self.allowed_flags(root)) {
            tracing::warn!(dir = %abs.display(), %why, "a job dir is unfit for reuse; removed");
            return Ok(false);
        }
        let idle = format!("{IDLE_PREFIX}{}", NEXT_IDLE.fetch_add(1, Ordering::Relaxed));
        mutate("publish.pool_keep", &root_path.join(&idle), || {
            rustix::fs::renameat_with(root, name, root, &idle, RenameFlags::NOREPLACE)
        })?;
        let mut idle_dirs = self.lock();
        if idle_dirs.len() >= self.cap.load(Ordering::Relaxed) {
            // Others were set aside meanwhile: the pool is full after all.
            drop(idle_dirs);
            discard(root, &idle, &root_path.join(&idle));
            return Ok(true);
        }
        idle_dirs.push((idle, entry_durable));
        Ok(true)
    }

    /// Removes every idle dir (at shutdown); what cannot be removed is left to recovery.
    pub(super) fn release(&self, root: BorrowedFd<'_>, root_path: &Path) {
        let idle = std::mem::take(&mut *self.lock());
        for (name, _) in idle {
            discard(root, &name, &root_path.join(&name));
        }
    }
}

/// Removes the tree `name` in `root`; a failure is logged (recovery removes it at the next
/// start).
fn discard(root: BorrowedFd<'_>, name: &str, abs: &Path) {
    if let Err(e) = remove_tree(root, OsStr::new(name), abs) {
        tracing::warn!(dir = %abs.display(), error = %crate::report::chain(&e), "cannot remove an idle job dir; startup recovery will");
    }
}

/// Opens the job dir `fd`'s `stage/` and its kept slot (beneath, no symlink followed).
fn open_tree(fd: BorrowedFd<'_>) -> Result<(OwnedFd, OwnedFd), Unfit> {
    let stage = open_dir_beneath(fd, STAGE).map_err(|e| Unfit::Io("open stage", e))?;
    let slot = open_dir_beneath(stage.as_fd(), KEPT_SLOT).map_err(|e| Unfit::Io("open slot", e))?;
    Ok((stage, slot))
}

/// Checks that the job dir `fd`, its `stage` and its kept `slot` (opened by [`open_tree`])
/// are fit for reuse, and its journal if it has one (see the module's invariants); `allowed`
/// is [`Pool::allowed_flags`]. Returns the journal, open read-write.
fn check_tree(
    fd: BorrowedFd<'_>,
    stage: BorrowedFd<'_>,
    slot: BorrowedFd<'_>,
    allowed: u32,
) -> Result<Option<std::fs::File>, Unfit> {
    let found = check_dir("the job dir", fd, 3, &[STAGE, JOURNAL], allowed)?;
    check_dir("stage", stage, 3, &[KEPT_SLOT], allowed)?;
    check_dir("its slot", slot, 2, &[], allowed)?;
    if found.len() == 1 {
        return Ok(None);
    }
    let journal = open_beneath(fd, JOURNAL, OFlags::RDWR | OFlags::NONBLOCK)
        .map_err(|e| Unfit::Io("open journal", e))?;
    let what = "its journal";
    let st = check_owner(what, journal.as_fd())?;
    if file_type(&st) != FileType::RegularFile || st.st_mode & 0o7777 != 0o600 {
        return Err(Unfit::Mode(what, st.st_mode));
    }
    // The blank, padded to at most a block (`journal::blank_marker`).
    let mut head = [0u8; PAD_MAX as usize + 1];
    let n = rustix::io::pread(&journal, &mut head, 0).map_err(|e| Unfit::Io("read journal", e))?;
    if nlink(&st) != 1 || st.st_size != n as i64 || !is_blank(&head[..n]) {
        return Err(Unfit::NotBlank);
    }
    check_attrs(what, journal.as_fd(), allowed)?;
    Ok(Some(std::fs::File::from(journal)))
}

/// The stat of `fd`, if the daemon owns it.
fn check_owner(what: &'static str, fd: BorrowedFd<'_>) -> Result<rustix::fs::Stat, Unfit> {
    let st = rustix::fs::fstat(fd).map_err(|e| Unfit::Io("stat", e))?;
    let (euid, egid) = (rustix::process::geteuid(), rustix::process::getegid());
    if (st.st_uid, st.st_gid) != (euid.as_raw(), egid.as_raw()) {
        return Err(Unfit::Owner(what, st.st_uid, st.st_gid));
    }
    Ok(st)
}

/// Checks one dir of the tree: owner, mode 0700, `links`, entries among `entries` (the first
/// one required), attributes and flags. Returns the entries found.
fn check_dir(
    what: &'static str,
    fd: BorrowedFd<'_>,
    links: u64,
    entries: &[&str],
    allowed_flags: u32,
) -> Result<Vec<std::ffi::OsString>, Unfit> {
    let st = check_owner(what, fd)?;
    if file_type(&st) != rustix::fs::FileType::Directory || st.st_mode & 0o7777 != 0o700 {
        return Err(Unfit::Mode(what, st.st_mode));
    }
    // A dir a worker filled with entries keeps its size once emptied (ext4 never shrinks
    // one): kept, it would hold that room for as long as it idles, read again at each take,
    // and tell the next call how much its predecessor made.
    // `st_blksize` is an i64 on x86_64, a narrower or unsigned type elsewhere.
    #[allow(clippy::unnecessary_cast)]
    let block = (st.st_blksize as i64).max(4096);
    if st.st_size > block {
        return Err(Unfit::Size(what, st.st_size));
    }
    let found = names(fd, Path::new(what)).map_err(|_| Unfit::Io("read", rustix::io::Errno::IO))?;
    let required = entries
        .first()
        .is_none_or(|e| found.iter().any(|n| n == OsStr::new(e)));
    if nlink(&st) != links
        || !required
        || found
            .iter()
            .any(|n| !entries.iter().any(|e| OsStr::new(e) == n))
    {
        return Err(Unfit::Entries(what, found));
    }
    check_attrs(what, fd, allowed_flags)?;
    Ok(found)
}

/// No extended attribute but `security.*` on `fd`, and no inode flag beyond `allowed_flags`.
fn check_attrs(what: &'static str, fd: BorrowedFd<'_>, allowed_flags: u32) -> Result<(), Unfit> {
    let mut buf = vec![0u8; 1024];
    let n = match rustix::fs::flistxattr(fd, &mut buf[..]) {
        Ok(n) => n,
        Err(rustix::io::Errno::NOTSUP) => 0,
        Err(rustix::io::Errno::RANGE) => {
            return Err(Unfit::Xattr(what, "(a list over 1 KiB)".into()))
        }
        Err(e) => return Err(Unfit::Io("list extended attributes", e)),
    };
    for attr in buf[..n].split(|b| *b == 0).filter(|a| !a.is_empty()) {
        if !attr.starts_with(b"security.") {
            return Err(Unfit::Xattr(
                what,
                String::from_utf8_lossy(attr).into_owned(),
            ));
        }
    }
    if let Some(f) = flags(fd) {
        if f & !allowed_flags != 0 {
            return Err(Unfit::Flags(what, f));
        }
    }
    Ok(())
}

/// The inode flags of `fd` (`FS_IOC_GETFLAGS`); `None` where the filesystem has none.
fn flags(fd: BorrowedFd<'_>) -> Option<u32> {
    rustix::fs::ioctl_getflags(fd).ok().map(|f| f.bits())
}
