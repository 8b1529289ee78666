//! The check of a directory output's staged tree, after its worker is gone and before
//! anything is journaled: every entry is judged, sealed and made durable, and the tree's
//! canonical manifest is hashed.
//!
//! * Iterative, with the fd window of [`super::tree`]: any depth, at most 32 directory fds.
//!   Every call is `*at(dirfd, name)`; directories are entered with `openat2(RESOLVE_BENEATH |
//!   RESOLVE_NO_SYMLINKS ...)`, entries judged by `fstatat(AT_SYMLINK_NOFOLLOW)`.
//! * Accepted: directories, regular files with one link, symlinks whose text is relative,
//!   has every `..` before any name and no more `..` than the link's depth in the tree (so
//!   that no chain of links can climb out, whatever they point through). Refused, failing
//!   the call and naming the entry: any other symlink, a hard link, a device, a FIFO, a
//!   socket, a setuid or setgid bit, a name over NAME_MAX or a published path over PATH_MAX.
//! * Sealed as single outputs are: the daemon's euid/egid, the mode less setuid, setgid,
//!   sticky and group/other write, plus owner read (and owner rwx for a directory); the top
//!   directory gets the declared or replaced mode.
//! * Made durable with one `syncfs` of the workspace's filesystem once every entry is judged
//!   (`publish.syncfs_tree`), not an fsync per entry: on ext4 each fsync is a journal commit,
//!   so a tree of 10,000 files cost 10,000 commits; `syncfs` writes the dirty data and commits
//!   the journal once, and reports a writeback error of any file (Linux 5.8+).

use std::ffi::OsStr;
use std::os::fd::{AsFd, BorrowedFd};
use std::os::unix::ffi::OsStrExt;
use std::path::{Path, PathBuf};

use rustix::fs::{AtFlags, FileType, Mode, OFlags};
use rustix::io::Errno;

use super::sys::{
    chmod_nofollow, describe, file_type, io, mutate, nlink, open_beneath, stat_at, FileId,
};
use super::tree::{scan, Walk};
use super::{OutputFault, PublishError, NAME_MAX, PATH_MAX};

/// The manifest whose SHA-256 a directory output's `commit` event carries, as the README
/// documents it.
pub const MANIFEST_FORMAT: &str = "for each entry, sorted by the bytes of its path relative \
     to the tree (the tree itself is \".\"): type (d, f or l), NUL, the mode as 4 octal \
     digits, NUL, the path, NUL, the datum (a file's SHA-256 in lowercase hex, a symlink's \
     target, nothing for a directory), NUL";

/// Why an entry of a directory output's tree is refused.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum EntryFault {
    #[error("it is a symlink to the absolute path {}", crate::text::shown(target))]
    AbsoluteSymlink { target: String },
    #[error(
        "it is a symlink to {}, which leads out of the tree (a symlink may only climb with \
         leading '..', no further than its own depth)",
        crate::text::shown(target)
    )]
    EscapingSymlink { target: String },
    #[error("it has {0} hard links (a staged file must have one)")]
    HardLink(u64),
    #[error("it is {0}; a directory output holds regular files, directories and symlinks")]
    Special(&'static str),
    #[error("it is setuid or setgid (mode {0:04o})")]
    SetId(u32),
    #[error("its name is {0} bytes; a name is at most {NAME_MAX} bytes")]
    NameTooLong(usize),
    #[error("its published path would be {len} bytes; a path is at most {max} bytes", max = PATH_MAX - 1)]
    PathTooLong { len: usize },
    #[error("it was replaced while being checked")]
    Replaced,
}

/// What the check of a tree learned.
#[derive(Debug)]
pub(super) struct Tree {
    /// The top directory's identity.
    pub id: FileId,
    pub files: u64,
    pub bytes: u64,
    /// SHA-256 of the manifest; `None` when the files' total size is over the hash limit.
    pub manifest: Option<String>,
}

/// A refused tree (the tool is at fault) or a failure of the check itself.
#[derive(Debug)]
pub(super) enum Refused {
    Fault(OutputFault),
    Failed(PublishError),
}

impl From<PublishError> for Refused {
    fn from(e: PublishError) -> Refused {
        Refused::Failed(e)
    }
}

fn entry(rel: &[u8], fault: EntryFault) -> Refused {
    Refused::Fault(OutputFault::Entry {
        entry: PathBuf::from(OsStr::from_bytes(rel)),
        fault,
    })
}

/// Whether a symlink at depth `depth` (the number of directories between it and the tree's
/// top) with text `target` stays inside the tree, whatever it is resolved through.
pub(super) fn link_stays_inside(target: &[u8], depth: usize) -> bool {
    if target.is_empty() || target[0] == b'/' {
        return false;
    }
    let mut up = 0usize;
    let mut named = false;
    for comp in target.split(|b| *b == b'/') {
        match comp {
            b"" | b"." => {}
            b".." if named => return false,
            b".." => up += 1,
            _ => named = true,
        }
    }
    up <= depth
}

/// Checks and seals the tree `name` in `slot` (`abs` for messages), then makes it durable.
/// `published_len`: the length of the published path of the tree (workspace root, `/`,
/// target). `top_mode`: the top directory's mode. Files are hashed while their total size
/// stays within `hash_limit`.
pub(super) fn check_tree(
    slot: BorrowedFd<'_>,
    name: &OsStr,
    abs: &Path,
    published_len: usize,
    top_mode: u32,
    hash_limit: u64,
) -> Result<Tree, Refused> {
    let top = open_beneath(slot, name, OFlags::PATH).map_err(|e| match e {
        Errno::NOENT => Refused::Fault(OutputFault::Missing),
        Errno::LOOP => Refused::Fault(OutputFault::Symlink),
        e => Refused::Failed(io("open staged output", abs, e)),
    })?;
    let st = rustix::fs::fstat(top.as_fd()).map_err(|e| io("stat staged output", abs, e))?;
    if file_type(&st) != FileType::Directory {
        return Err(Refused::Fault(OutputFault::NotADirectory(describe(
            file_type(&st),
        ))));
    }
    let id = FileId::of(&st);
    let top_mode = (top_mode & 0o755) | 0o700;
    seal_entry(slot, name, &st, top_mode, abs)?;
    let mut walk = Walk::open(slot, name, abs)?.ok_or(Refused::Fault(OutputFault::Missing))?;
    let opened = rustix::fs::fstat(walk.top()?).map_err(|e| io("stat staged output", abs, e))?;
    if FileId::of(&opened) != id {
        return Err(Refused::Fault(OutputFault::Replaced));
    }
    let mut sum = Sums {
        files: 0,
        bytes: 0,
        hashed: 0,
        hash_limit,
        all_hashed: true,
        records: vec![(b".".to_vec(), record(b'd', top_mode, b".", b""))],
    };
    let mut fresh = true;
    loop {
        if fresh {
            let fd = walk.top()?;
            let here = walk.path(None);
            let depth = walk.stack.len() - 1;
            let mut rel_here: Vec<u8> = Vec::new();
            for l in walk.stack.iter().skip(1) {
                if !rel_here.is_empty() {
                    rel_here.push(b'/');
                }
                rel_here.extend_from_slice(l.name.as_bytes());
            }
            let mut subdirs = Vec::new();
            let mut fault = None;
            scan(fd, &here, |child, _| {
                let mut rel = rel_here.clone();
                if !rel.is_empty() {
                    rel.push(b'/');
                }
                rel.extend_from_slice(child.as_bytes());
                match check_entry(fd, child, &rel, depth, published_len, &mut sum, &walk) {
                    Ok(Some(dir)) => {
                        subdirs.push(dir);
                        Ok(true)
                    }
                    Ok(None) => Ok(true),
                    Err(Refused::Failed(e)) => Err(e),
                    Err(f) => {
                        fault = Some(f);
                        Ok(false)
                    }
                }
            })?;
            if let Some(f) = fault {
                return Err(f);
            }
            if let Some(l) = walk.stack.last_mut() {
                l.pending = subdirs;
            }
        }
        match walk.stack.last_mut().and_then(|l| l.pending.pop()) {
            Some(child) => fresh = walk.push(child)?,
            None => {
                if walk.stack.len() == 1 {
                    break;
                }
                walk.pop()?;
                fresh = false;
            }
        }
    }
    // Every file's data and every directory of the tree durable, with one writeback of the
    // filesystem (the tree is sealed: nothing writes to it any more).
    mutate("publish.syncfs_tree", abs, || rustix::fs::syncfs(slot))?;
    let manifest = sum.all_hashed.then(|| {
        use sha2::Digest;
        sum.records.sort_by(|a, b| a.0.cmp(&b.0));
        let mut h = sha2::Sha256::new();
        for (_, r) in &sum.records {
            h.update(r);
        }
        crate::audit::log::hex(&h.finalize())
    });
    Ok(Tree {
        id,
        files: sum.files,
        bytes: sum.bytes,
        manifest,
    })
}

struct Sums {
    files: u64,
    bytes: u64,
    hashed: u64,
    hash_limit: u64,
    all_hashed: bool,
    /// (relative path, manifest record) of every entry.
    records: Vec<(Vec<u8>, Vec<u8>)>,
}

pub(super) fn record(kind: u8, mode: u32, rel: &[u8], datum: &[u8]) -> Vec<u8> {
    let mut r = Vec::with_capacity(rel.len() + datum.len() + 12);
    r.push(kind);
    r.push(0);
    r.extend_from_slice(format!("{mode:04o}").as_bytes());
    r.push(0);
    r.extend_from_slice(rel);
    r.push(0);
    r.extend_from_slice(datum);
    r.push(0);
    r
}

/// Judges, seals and records entry `child` of `dir` (path `rel` in the tree; `depth`
/// directories below the top). Returns its name when it is a directory to visit.
fn check_entry(
    dir: BorrowedFd<'_>,
    child: &OsStr,
    rel: &[u8],
    depth: usize,
    published_len: usize,
    sum: &mut Sums,
    walk: &Walk<'_>,
) -> Result<Option<std::ffi::OsString>, Refused> {
    let abs = || walk.path(Some(child));
    if child.len() > NAME_MAX {
        return Err(entry(rel, EntryFault::NameTooLong(child.len())));
    }
    let published = published_len + 1 + rel.len();
    if published >= PATH_MAX {
        return Err(entry(rel, EntryFault::PathTooLong { len: published }));
    }
    let Some(st) = stat_at(dir, child).map_err(|e| io("stat", &abs(), e))? else {
        return Ok(None);
    };
    let mode = st.st_mode & 0o7777;
    // The owner (the daemon, once sealed) can always read a file and list a directory: the
    // check reads every file, and the tree is removed when it is replaced.
    let sealed = match file_type(&st) {
        FileType::Directory => (mode & 0o755) | 0o700,
        _ => (mode & 0o755) | 0o400,
    };
    match file_type(&st) {
        FileType::Directory => {
            if mode & 0o6000 != 0 {
                return Err(entry(rel, EntryFault::SetId(mode)));
            }
            seal_entry(dir, child, &st, sealed, &abs())?;
            sum.records
                .push((rel.to_vec(), record(b'd', sealed, rel, b"")));
            Ok(Some(child.to_os_string()))
        }
        FileType::RegularFile => {
            if nlink(&st) != 1 {
                return Err(entry(rel, EntryFault::HardLink(nlink(&st))));
            }
            if mode & 0o6000 != 0 {
                return Err(entry(rel, EntryFault::SetId(mode)));
            }
            seal_entry(dir, child, &st, sealed, &abs())?;
            let fd = open_beneath(dir, child, OFlags::RDONLY | OFlags::NONBLOCK)
                .map_err(|e| io("open staged file", &abs(), e))?;
            let now = rustix::fs::fstat(fd.as_fd()).map_err(|e| io("stat", &abs(), e))?;
            if FileId::of(&now) != FileId::of(&st) {
                return Err(entry(rel, EntryFault::Replaced));
            }
            #[allow(clippy::unnecessary_cast)]
            let size = now.st_size.max(0) as u64;
            sum.files += 1;
            sum.bytes = sum.bytes.saturating_add(size);
            let datum = if sum.all_hashed && sum.hashed.saturating_add(size) <= sum.hash_limit {
                sum.hashed += size;
                super::job::hash(fd.as_fd()).map_err(|e| io("read staged file", &abs(), e))?
            } else {
                sum.all_hashed = false;
                String::new()
            };
            sum.records
                .push((rel.to_vec(), record(b'f', sealed, rel, datum.as_bytes())));
            Ok(None)
        }
        FileType::Symlink => {
            let target = rustix::fs::readlinkat(dir, child, Vec::new())
                .map_err(|e| io("read symlink", &abs(), e))?;
            let target = target.as_bytes();
            let shown = String::from_utf8_lossy(target).into_owned();
            if target.first() == Some(&b'/') {
                return Err(entry(rel, EntryFault::AbsoluteSymlink { target: shown }));
            }
            if !link_stays_inside(target, depth) {
                return Err(entry(rel, EntryFault::EscapingSymlink { target: shown }));
            }
            seal_owner(dir, child, &st, &abs())?;
            sum.records
                .push((rel.to_vec(), record(b'l', 0o777, rel, target)));
            Ok(None)
        }
        ft => Err(entry(rel, EntryFault::Special(describe(ft)))),
    }
}

/// Gives entry `name` of `dir` (a directory or a regular file, never a symlink) to the
/// daemon's euid/egid, then `mode`.
fn seal_entry(
    dir: BorrowedFd<'_>,
    name: &OsStr,
    st: &rustix::fs::Stat,
    mode: u32,
    abs: &Path,
) -> Result<(), PublishError> {
    seal_owner(dir, name, st, abs)?;
    if st.st_mode & 0o7777 != mode {
        mutate("publish.seal_output", abs, || {
            chmod_nofollow(dir, name, Mode::from_raw_mode(mode))
        })?;
    }
    Ok(())
}

/// Gives entry `name` of `dir` itself (a symlink is not followed) to the daemon's
/// euid/egid, unless it has them already (the shipped unit denies chown to a daemon
/// whose workers share its uid).
fn seal_owner(
    dir: BorrowedFd<'_>,
    name: &OsStr,
    st: &rustix::fs::Stat,
    abs: &Path,
) -> Result<(), PublishError> {
    let (euid, egid) = (rustix::process::geteuid(), rustix::process::getegid());
    if (st.st_uid, st.st_gid) == (euid.as_raw(), egid.as_raw()) {
        return Ok(());
    }
    mutate("publish.seal_output", abs, || {
        rustix::fs::chownat(dir, name, Some(euid), Some(egid), AtFlags::SYMLINK_NOFOLLOW)
    })
}

#[cfg(test)]
mod tests {
    use super::link_stays_inside;

    #[test]
    fn a_symlink_climbs_only_with_leading_dots_and_no_further_than_its_depth() {
        assert!(link_stays_inside(b"a/b", 0));
        assert!(link_stays_inside(b"./a", 0));
        assert!(link_stays_inside(b"../x", 1));
        assert!(link_stays_inside(b"../../x/y", 2));
        assert!(!link_stays_inside(b"..", 0));
        assert!(!link_stays_inside(b"../../..", 2));
        assert!(!link_stays_inside(b"/etc/passwd", 5));
        assert!(!link_stays_inside(b"", 3));
        // Through a symlink `s` the lexical `s/..` is not the tree: refused.
        assert!(!link_stays_inside(b"s/../x", 3));
        assert!(!link_stays_inside(b"a/./../b", 3));
    }
}
