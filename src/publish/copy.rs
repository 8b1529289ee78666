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
    /// An entry of an in-out directory (its path in the tree).
    #[error("its entry {} {change}", crate::text::shown(entry))]
    InTree {
        entry: String,
        change: Box<Conflict>,
    },
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

/// How deep an in-out directory may be: its copy recurses, two descriptors a level.
pub const MAX_TREE_DEPTH: usize = 64;

/// What an in-out directory was when its copy was taken: every entry's snapshot, by its path
/// in the tree (`.` the top), and the manifest (as a directory output's, `MANIFEST_FORMAT`)
/// of the copy the worker got, to tell an untouched copy.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct TreeOrigin {
    pub entries: Vec<(Vec<u8>, Origin)>,
    /// `None` when the files' total size is over the hash limit: the copy then counts as
    /// changed.
    pub manifest: Option<String>,
}

/// Why an in-out target cannot be copied for the worker.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum CopyRefusal {
    #[error("its entry {} is {kind}; an in-out directory holds regular files, directories and symlinks that stay inside it", crate::text::shown(entry))]
    Special { entry: String, kind: &'static str },
    #[error(
        "its entry {} is a symlink to {}, which leads out of the tree",
        crate::text::shown(entry),
        crate::text::shown(target)
    )]
    EscapingSymlink { entry: String, target: String },
    #[error("it is deeper than {MAX_TREE_DEPTH} levels")]
    TooDeep,
    #[error(
        "it holds more than {max} files and directories, over the profile's [limits] staging_files"
    )]
    TooManyEntries { max: u64 },
    #[error("it holds more than {max} bytes of files, over the profile's [limits] staging_size")]
    TooLarge { max: u64 },
    #[error("it is {size} bytes, over the profile's [limits] staging_size ({max} bytes)")]
    FileTooLarge { size: u64, max: u64 },
}

/// Bounds and settings of one tree copy.
pub(super) struct TreeCopy {
    pub owner: Option<(u32, u32)>,
    pub max_entries: u64,
    pub max_bytes: u64,
    pub hash_limit: u64,
    /// The mode the published top directory gets (as publication will seal it).
    pub top_mode: u32,
}

/// Copies the directory open as `src` (the in-out target, `src_abs` for messages) into a new
/// directory `name` in `slot`, for the worker: directories 0700 plus the original's other
/// bits (less group/other write), files 0600 likewise, symlinks as they are, every entry
/// owned by `owner` when the worker has a uid of its own. Returns the snapshot of the original
/// and the manifest of the copy. A FIFO, device or socket, a symlink leading out, a tree
/// deeper than [`MAX_TREE_DEPTH`] or over the limits refuses the copy (`Err(Ok(_))`).
pub(super) fn copy_tree(
    src: BorrowedFd<'_>,
    src_abs: &Path,
    slot: BorrowedFd<'_>,
    name: &OsStr,
    staged_abs: &Path,
    how: &TreeCopy,
) -> Result<TreeOrigin, Result<CopyRefusal, PublishError>> {
    let st = rustix::fs::fstat(src).map_err(|e| Err(io("stat in-out directory", src_abs, e)))?;
    let dir_mode = |m: u32| (m & 0o755) | 0o700;
    mutate("publish.copy_inout", staged_abs, || {
        rustix::fs::mkdirat(slot, name, Mode::from_raw_mode(0o700))
    })
    .map_err(Err)?;
    let dst = super::sys::open_dir_beneath(slot, name)
        .map_err(|e| Err(io("open in-out copy", staged_abs, e)))?;
    let mut cx = CopyCx {
        how,
        entries: vec![(b".".to_vec(), Origin::of(&st))],
        records: vec![(
            b".".to_vec(),
            super::staged_tree::record(b'd', how.top_mode & 0o755, b".", b""),
        )],
        files: 0,
        bytes: 0,
        all_hashed: true,
    };
    copy_level(
        src,
        src_abs,
        dst.as_fd(),
        staged_abs,
        &mut Vec::new(),
        0,
        &mut cx,
    )?;
    give(dst.as_fd(), dir_mode(st.st_mode), how.owner, staged_abs).map_err(Err)?;
    let manifest = cx.all_hashed.then(|| {
        use sha2::Digest;
        cx.records.sort_by(|a, b| a.0.cmp(&b.0));
        let mut h = sha2::Sha256::new();
        for (_, r) in &cx.records {
            h.update(r);
        }
        crate::audit::log::hex(&h.finalize())
    });
    Ok(TreeOrigin {
        entries: cx.entries,
        manifest,
    })
}

struct CopyCx<'a> {
    how: &'a TreeCopy,
    entries: Vec<(Vec<u8>, Origin)>,
    records: Vec<(Vec<u8>, Vec<u8>)>,
    files: u64,
    bytes: u64,
    all_hashed: bool,
}

type CopyResult<T> = Result<T, Result<CopyRefusal, PublishError>>;

/// Owner (when the worker has its own uid), then mode, of the open entry `fd`.
fn give(
    fd: BorrowedFd<'_>,
    mode: u32,
    owner: Option<(u32, u32)>,
    abs: &Path,
) -> Result<(), PublishError> {
    if let Some((uid, gid)) = owner {
        mutate("publish.chown_stage", abs, || {
            rustix::fs::fchown(
                fd,
                Some(rustix::process::Uid::from_raw(uid)),
                Some(rustix::process::Gid::from_raw(gid)),
            )
        })?;
    }
    mutate("publish.copy_inout", abs, || {
        rustix::fs::fchmod(fd, Mode::from_raw_mode(mode))
    })
}

fn copy_level(
    src: BorrowedFd<'_>,
    src_abs: &Path,
    dst: BorrowedFd<'_>,
    dst_abs: &Path,
    rel: &mut Vec<u8>,
    depth: usize,
    cx: &mut CopyCx<'_>,
) -> CopyResult<()> {
    use rustix::fs::{FileType, OFlags};
    use std::os::unix::ffi::OsStrExt;
    if depth >= MAX_TREE_DEPTH {
        return Err(Ok(CopyRefusal::TooDeep));
    }
    let mut names = Vec::new();
    let dup = rustix::fs::openat(
        src,
        ".",
        OFlags::RDONLY | OFlags::DIRECTORY | OFlags::CLOEXEC,
        Mode::empty(),
    )
    .map_err(|e| Err(io("open in-out directory", src_abs, e)))?;
    let mut dir =
        rustix::fs::Dir::new(dup).map_err(|e| Err(io("list in-out directory", src_abs, e)))?;
    while let Some(ent) = dir.read() {
        let ent = ent.map_err(|e| Err(io("list in-out directory", src_abs, e)))?;
        let n = ent.file_name().to_bytes();
        if n != b"." && n != b".." {
            names.push(n.to_vec());
        }
    }
    names.sort();
    for n in names {
        let child = OsStr::from_bytes(&n);
        let len = rel.len();
        if !rel.is_empty() {
            rel.push(b'/');
        }
        rel.extend_from_slice(&n);
        let shown = || String::from_utf8_lossy(rel).into_owned();
        let (sabs, dabs) = (src_abs.join(child), dst_abs.join(child));
        let Some(st) = super::sys::stat_at(src, child).map_err(|e| Err(io("stat", &sabs, e)))?
        else {
            rel.truncate(len);
            continue;
        };
        cx.entries.push((rel.clone(), Origin::of(&st)));
        if cx.entries.len() as u64 > cx.how.max_entries + 1 {
            return Err(Ok(CopyRefusal::TooManyEntries {
                max: cx.how.max_entries,
            }));
        }
        let ft = super::sys::file_type(&st);
        match ft {
            FileType::Directory => {
                let mode = (st.st_mode & 0o755) | 0o700;
                mutate("publish.copy_inout", &dabs, || {
                    rustix::fs::mkdirat(dst, child, Mode::from_raw_mode(0o700))
                })
                .map_err(Err)?;
                let s = super::sys::open_dir_beneath(src, child)
                    .map_err(|e| Err(io("open in-out directory", &sabs, e)))?;
                let d = super::sys::open_dir_beneath(dst, child)
                    .map_err(|e| Err(io("open in-out copy", &dabs, e)))?;
                copy_level(s.as_fd(), &sabs, d.as_fd(), &dabs, rel, depth + 1, cx)?;
                give(d.as_fd(), mode, cx.how.owner, &dabs).map_err(Err)?;
                cx.records.push((
                    rel.clone(),
                    super::staged_tree::record(b'd', mode & 0o755, rel, b""),
                ));
            }
            FileType::RegularFile => {
                let mode = (st.st_mode & 0o755) | 0o600;
                let s = super::sys::open_beneath(src, child, OFlags::RDONLY | OFlags::NONBLOCK)
                    .map_err(|e| Err(io("open in-out file", &sabs, e)))?;
                #[allow(clippy::unnecessary_cast)]
                let size = st.st_size.max(0) as u64;
                cx.files += 1;
                cx.bytes = cx.bytes.saturating_add(size);
                if cx.bytes > cx.how.max_bytes {
                    return Err(Ok(CopyRefusal::TooLarge {
                        max: cx.how.max_bytes,
                    }));
                }
                let d = copy_file(s.as_fd(), dst, child, 0o600, &dabs).map_err(Err)?;
                give(d.as_fd(), mode, cx.how.owner, &dabs).map_err(Err)?;
                let datum = if cx.all_hashed && cx.bytes <= cx.how.hash_limit {
                    super::job::hash(d.as_fd())
                        .map_err(|e| Err(io("read in-out copy", &dabs, e)))?
                } else {
                    cx.all_hashed = false;
                    String::new()
                };
                cx.records.push((
                    rel.clone(),
                    super::staged_tree::record(b'f', mode & 0o755, rel, datum.as_bytes()),
                ));
            }
            FileType::Symlink => {
                let target = rustix::fs::readlinkat(src, child, Vec::new())
                    .map_err(|e| Err(io("read symlink", &sabs, e)))?;
                let target = target.as_bytes();
                if !super::staged_tree::link_stays_inside(target, depth) {
                    return Err(Ok(CopyRefusal::EscapingSymlink {
                        entry: shown(),
                        target: String::from_utf8_lossy(target).into_owned(),
                    }));
                }
                mutate("publish.copy_inout", &dabs, || {
                    rustix::fs::symlinkat(target, dst, child)
                })
                .map_err(Err)?;
                if let Some((uid, gid)) = cx.how.owner {
                    mutate("publish.chown_stage", &dabs, || {
                        rustix::fs::chownat(
                            dst,
                            child,
                            Some(rustix::process::Uid::from_raw(uid)),
                            Some(rustix::process::Gid::from_raw(gid)),
                            rustix::fs::AtFlags::SYMLINK_NOFOLLOW,
                        )
                    })
                    .map_err(Err)?;
                }
                cx.records.push((
                    rel.clone(),
                    super::staged_tree::record(b'l', 0o777, rel, target),
                ));
            }
            ft => {
                return Err(Ok(CopyRefusal::Special {
                    entry: shown(),
                    kind: super::sys::describe(ft),
                }))
            }
        }
        rel.truncate(len);
    }
    Ok(())
}

/// The snapshot of every entry of the directory open as `dir` (read-only, the same walk as
/// the copy's), compared with `origin`: the first difference, naming the entry, if any.
/// `moved`: the tree was just renamed to another parent, which changes the ctime of what
/// moved and, on some filesystems, the top directory's mtime and size (its `..` entry is
/// rewritten): those are left out; every entry is still compared by identity, and the
/// entries beneath the top by size and mtime.
pub(super) fn tree_differs(
    dir: BorrowedFd<'_>,
    abs: &Path,
    origin: &TreeOrigin,
    moved: bool,
) -> Result<Option<Conflict>, PublishError> {
    let st = rustix::fs::fstat(dir).map_err(|e| io("stat in-out directory", abs, e))?;
    let mut now = vec![(b".".to_vec(), Origin::of(&st))];
    if snapshot_level(dir, abs, &mut Vec::new(), 0, &mut now)?.is_none() {
        return Ok(Some(Conflict::InTree {
            entry: ".".into(),
            change: Box::new(Conflict::Modified),
        }));
    }
    let strip = |p: &[u8], o: &Origin| {
        let top = moved && p == b".";
        Origin {
            ctime: if moved { (0, 0) } else { o.ctime },
            mtime: if top { (0, 0) } else { o.mtime },
            size: if top { 0 } else { o.size },
            ..*o
        }
    };
    let mut want: std::collections::BTreeMap<&[u8], Origin> = origin
        .entries
        .iter()
        .map(|(p, o)| (p.as_slice(), strip(p, o)))
        .collect();
    for (p, o) in &now {
        let shown = || String::from_utf8_lossy(p).into_owned();
        match want.remove(p.as_slice()) {
            None => {
                return Ok(Some(Conflict::InTree {
                    entry: shown(),
                    change: Box::new(Conflict::Created),
                }))
            }
            Some(w) => {
                if let Some(c) = w.differs(&strip(p, o)) {
                    return Ok(Some(if p.as_slice() == b"." {
                        c
                    } else {
                        Conflict::InTree {
                            entry: shown(),
                            change: Box::new(c),
                        }
                    }));
                }
            }
        }
    }
    Ok(want.into_keys().next().map(|p| Conflict::InTree {
        entry: String::from_utf8_lossy(p).into_owned(),
        change: Box::new(Conflict::Removed),
    }))
}

/// The snapshot of every entry of the directory open as `dir` (the top as `.`), as
/// [`tree_differs`] compares it later; `None` when it is deeper than [`MAX_TREE_DEPTH`].
pub(super) fn snapshot_tree(
    dir: BorrowedFd<'_>,
    abs: &Path,
) -> Result<Option<TreeOrigin>, PublishError> {
    let st = rustix::fs::fstat(dir).map_err(|e| io("stat directory", abs, e))?;
    let mut entries = vec![(b".".to_vec(), Origin::of(&st))];
    if snapshot_level(dir, abs, &mut Vec::new(), 0, &mut entries)?.is_none() {
        return Ok(None);
    }
    Ok(Some(TreeOrigin {
        entries,
        manifest: None,
    }))
}

/// Adds every entry beneath `dir` to `out`; `None` when the tree is deeper than the copy
/// would have gone (then it changed).
fn snapshot_level(
    dir: BorrowedFd<'_>,
    abs: &Path,
    rel: &mut Vec<u8>,
    depth: usize,
    out: &mut Vec<(Vec<u8>, Origin)>,
) -> Result<Option<()>, PublishError> {
    use rustix::fs::{FileType, OFlags};
    use std::os::unix::ffi::OsStrExt;
    if depth >= MAX_TREE_DEPTH {
        return Ok(None);
    }
    let dup = rustix::fs::openat(
        dir,
        ".",
        OFlags::RDONLY | OFlags::DIRECTORY | OFlags::CLOEXEC,
        Mode::empty(),
    )
    .map_err(|e| io("open in-out directory", abs, e))?;
    let mut d = rustix::fs::Dir::new(dup).map_err(|e| io("list in-out directory", abs, e))?;
    let mut names = Vec::new();
    while let Some(ent) = d.read() {
        let ent = ent.map_err(|e| io("list in-out directory", abs, e))?;
        let n = ent.file_name().to_bytes();
        if n != b"." && n != b".." {
            names.push(n.to_vec());
        }
    }
    for n in names {
        let child = OsStr::from_bytes(&n);
        let len = rel.len();
        if !rel.is_empty() {
            rel.push(b'/');
        }
        rel.extend_from_slice(&n);
        if let Some(st) =
            super::sys::stat_at(dir, child).map_err(|e| io("stat", &abs.join(child), e))?
        {
            out.push((rel.clone(), Origin::of(&st)));
            if super::sys::file_type(&st) == FileType::Directory {
                let sub = super::sys::open_dir_beneath(dir, child)
                    .map_err(|e| io("open in-out directory", &abs.join(child), e))?;
                if snapshot_level(sub.as_fd(), &abs.join(child), rel, depth + 1, out)?.is_none() {
                    return Ok(None);
                }
            }
        }
        rel.truncate(len);
    }
    Ok(Some(()))
}
