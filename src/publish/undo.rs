//! Undo data: the backups of a session's latest commit, kept past the commit in one of two
//! slots of its session, `<root>/.airlock-undo/<session>/g0|g1/`, with the record that says
//! what to put back (`undo.json`) and the backups `b<i>`. A commit writes into the slot of
//! its new version's parity, so never into the slot of the session's latest commit (each
//! commit is the version after the one before). The slots are reused: a record is rewritten
//! in place, so a call allocates no inode for its undo data and syncs one file.
//!
//! Order, for a job that keeps undo data (`Job::keep_undo`):
//! 1. after its renames and before its commit point: the slot cleared of what an older job
//!    left there and `undo.json` rewritten and made durable ([`write_record`]); the backups
//!    are still in the job dir;
//! 2. the commit point (the session file records the job);
//! 3. each backup renamed from the job dir into `b<i>` of the slot ([`keep_backups`]; startup
//!    recovery does the same for a committed job whose dir it finds, so a crash between 2
//!    and 3 loses nothing);
//! 4. the other slot blanked: its backups removed, the blank marker written over its record
//!    ([`drop_generations`]; a record is always written over in place and cut after, so the
//!    file keeps its block); a commit that keeps no undo data removes the session's slots.
//!
//! Undo data is used only while its record is complete (every backup there, with the
//! identity the record names) and the session file's last commit is its job: a crash at any
//! point leaves data that is either that, or unused and blanked or dropped at the next start
//! ([`sweep`]). The directory is under the workspace root because its backups must be
//! renamed there and back (one filesystem, never a copy); its name is reserved, so no path
//! parameter reaches it.

use std::ffi::OsStr;
use std::io::{Read, Write};
use std::os::fd::{AsFd, BorrowedFd, OwnedFd};
use std::path::{Path, PathBuf};

use rustix::fs::{FileType, Mode, OFlags, RenameFlags};
use rustix::io::Errno;
use serde::{Deserialize, Serialize};
use serde_json::{Map, Value};

use super::copy::{tree_differs, Conflict, Origin, TreeOrigin};
use super::journal::Journal;
use super::sys::{
    file_type, io, mutate, nlink, open_beneath, open_dir_beneath, stat_at, FileId, Syncs,
};
use super::tree::{names, remove_entry, remove_tree};
use super::workspace::split_target;
use super::{OutputKind, PublishError, Workspace};

/// The undo data's dir in the workspace root; reserved (no path parameter may name it).
pub const UNDO_DIR: &str = ".airlock-undo";
/// A generation's record.
pub const UNDO_RECORD: &str = "undo.json";
const UNDO_VERSION: u32 = 1;
/// What a blank slot's record holds: JSON that names no job (an empty record, as earlier
/// versions left, reads as blank too).
pub(super) const BLANK: &[u8] = b"null";
/// A record is a few hundred bytes per target, plus a directory output's entries.
const MAX_RECORD: u64 = 64 << 20;

/// The name of target `i`'s backup in a generation's dir.
pub(super) fn backup_name(i: usize) -> String {
    format!("b{i}")
}

/// What an undo puts back, written before the commit point of the job it undoes.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct UndoRecord {
    pub version: u32,
    pub job: String,
    pub session: String,
    pub tool: String,
    pub version_before: u64,
    pub version_after: u64,
    /// The session state before the job: what an undo commits.
    pub state_before: Map<String, Value>,
    /// The targets the job changed (an in-out target it left as it was is not here).
    pub targets: Vec<UndoTarget>,
    /// The directories the job created for its targets, in creation order: an undo removes
    /// those it leaves empty.
    #[serde(default)]
    pub created_dirs: Vec<PathBuf>,
}

/// One target of a job, as the job left it and as it was before.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct UndoTarget {
    /// Relative to the workspace root.
    pub target: PathBuf,
    #[serde(default)]
    pub kind: OutputKind,
    /// What the job left at the target: identity, size, mtime and ctime, taken after its
    /// rename (`None`: the job deleted the target).
    pub published: Option<Origin>,
    /// A directory the job left: every entry of it, likewise.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub tree: Option<TreeOrigin>,
    /// What the target held before the job.
    pub before: Before,
}

/// What a target held before the job.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case", tag = "held")]
pub enum Before {
    /// Nothing: the job created it (an undo removes it).
    Absent,
    /// A file or tree, kept as `name` in the generation's dir with identity `id`, size and
    /// mtime (the job replaced or deleted it; an undo puts it back). Size and mtime tell a
    /// file that took a freed inode number from the one kept (a rename changes neither).
    Backup {
        name: String,
        id: FileId,
        size: u64,
        mtime: (i64, u32),
    },
}

/// Why a generation cannot be used.
#[derive(Debug, thiserror::Error)]
pub enum Unusable {
    #[error("no undo data is kept for it")]
    Missing,
    #[error("its undo record cannot be read")]
    Damaged(#[source] Box<PublishError>),
    #[error("its backup of {} is gone", .target.display())]
    BackupGone { target: PathBuf },
}

/// How a target changed since the job published it.
#[derive(Debug, Clone, thiserror::Error)]
#[error("{}: {what}", .target.display())]
pub struct Changed {
    pub target: PathBuf,
    pub what: Conflict,
}

/// The two slots of a session's undo data.
pub const SLOTS: [&str; 2] = ["g0", "g1"];

/// The slot a commit to `version_after` writes: never the slot of the commit before it.
pub(super) fn slot_of(version_after: u64) -> &'static str {
    SLOTS[(version_after % 2) as usize]
}

/// `.airlock-undo/<session>/<slot>`, relative to the root.
pub(super) fn generation_dir(session: &str, slot: &str) -> PathBuf {
    Path::new(UNDO_DIR).join(session).join(slot)
}

/// Opens directory `name` in `parent` (never through a symlink), first making it (0700) if
/// it is not there; whether it made it.
fn open_private_dir(
    parent: BorrowedFd<'_>,
    name: &str,
    abs: &Path,
) -> Result<(OwnedFd, bool), PublishError> {
    let made = match open_dir_beneath(parent, name) {
        Ok(fd) => return Ok((fd, false)),
        Err(Errno::NOENT) => match mutate("publish.undo_mkdir", abs, || {
            rustix::fs::mkdirat(parent, name, Mode::from_raw_mode(0o700))
        }) {
            Ok(()) => true,
            Err(PublishError::Io { source, .. }) if source.raw_os_error() == Some(libc::EEXIST) => {
                false
            }
            Err(e) => return Err(e),
        },
        Err(e) => return Err(io("open undo dir", abs, e)),
    };
    let fd = open_dir_beneath(parent, name).map_err(|e| io("open undo dir", abs, e))?;
    Ok((fd, made))
}

/// Opens a slot's record for rewriting in place: only the daemon's own regular file with one
/// link and no permission for anyone else (it holds the session's state), never through a
/// symlink, a FIFO or a hard link planted there (`None`: there is none such, and whatever is
/// there is removed).
fn reusable_record(
    gen: BorrowedFd<'_>,
    path: &Path,
) -> Result<Option<std::fs::File>, PublishError> {
    let flags = OFlags::WRONLY | OFlags::NOFOLLOW | OFlags::NONBLOCK | OFlags::CLOEXEC;
    if let Ok(fd) = rustix::fs::openat(gen, UNDO_RECORD, flags, Mode::empty()) {
        let st = rustix::fs::fstat(fd.as_fd()).map_err(|e| io("stat", path, e))?;
        let own = st.st_uid == rustix::process::geteuid().as_raw();
        let private = st.st_mode & 0o077 == 0;
        if file_type(&st) == FileType::RegularFile && nlink(&st) == 1 && own && private {
            return Ok(Some(std::fs::File::from(fd)));
        }
    }
    remove_entry(gen, OsStr::new(UNDO_RECORD), path, "publish.undo_clear")?;
    Ok(None)
}

/// Writes `rec` as the generation of its session in the slot of its version
/// ([`slot_of`]): the slot cleared of anything but its record, the record rewritten in place
/// (or made, the first time), and adds to `syncs` what makes it durable (the file, and each
/// dir up to the root whose entries changed), which the caller runs before the commit point
/// of `rec.job`. Returns the slot.
pub(super) fn write_record(
    root: BorrowedFd<'_>,
    root_path: &Path,
    rec: &UndoRecord,
    syncs: &mut Syncs,
) -> Result<&'static str, PublishError> {
    let slot = slot_of(rec.version_after);
    let top_abs = root_path.join(UNDO_DIR);
    let (top, new_top) = open_private_dir(root, UNDO_DIR, &top_abs)?;
    let sess_abs = top_abs.join(&rec.session);
    let (sess, new_sess) = open_private_dir(top.as_fd(), &rec.session, &sess_abs)?;
    let gen_abs = sess_abs.join(slot);
    let (gen, new_gen) = open_private_dir(sess.as_fd(), slot, &gen_abs)?;
    // What an older job left (its backups, if a crash kept them from being removed).
    clear_backups(gen.as_fd(), &gen_abs)?;
    let path = gen_abs.join(UNDO_RECORD);
    let bytes = serde_json::to_vec(rec).map_err(|e| PublishError::Io {
        op: "serialize undo record",
        path: path.clone(),
        source: std::io::Error::other(e),
    })?;
    // A reused record is written over in place and then cut to its new length, so that its
    // block is kept (a truncation to nothing would free it, and the write allocate another).
    // Until the cut, an older record's tail may follow the new one: the file does not parse,
    // so it names no job, and nothing uses it before the fsync that precedes the commit.
    let (mut file, made) = match reusable_record(gen.as_fd(), &path)? {
        Some(f) => (f, false),
        None => {
            let fd = mutate("publish.undo_write", &path, || {
                rustix::fs::openat(
                    gen.as_fd(),
                    UNDO_RECORD,
                    OFlags::WRONLY
                        | OFlags::CREATE
                        | OFlags::EXCL
                        | OFlags::NOFOLLOW
                        | OFlags::CLOEXEC,
                    Mode::from_raw_mode(0o600),
                )
            })?;
            (std::fs::File::from(fd), true)
        }
    };
    if made {
        file.write_all(&bytes).map_err(|e| PublishError::Io {
            op: "write undo record",
            path: path.clone(),
            source: e,
        })?;
    } else {
        mutate("publish.undo_write", &path, || overwrite(&file, &bytes))?;
    }
    syncs.push("publish.fsync_undo", file.into(), &path);
    // Each dir whose entries changed: the slot's if its record is new, and above it only
    // what this write created.
    if made {
        syncs.push("publish.fsync_undo", gen, &gen_abs);
    }
    if new_gen {
        syncs.push("publish.fsync_undo", sess, &sess_abs);
    }
    if new_sess {
        syncs.push("publish.fsync_undo", top, &top_abs);
    }
    if new_top {
        syncs.push_dup("publish.fsync_undo", root, root_path)?;
    }
    Ok(slot)
}

/// A record written over the last one in place: a shorter one keeps its block.
pub(super) use crate::fsutil::overwrite;

/// Removes every entry of slot dir `gen` but its record.
fn clear_backups(gen: BorrowedFd<'_>, abs: &Path) -> Result<(), PublishError> {
    for name in names(gen, abs)? {
        if name != UNDO_RECORD {
            remove_entry(gen, &name, &abs.join(&name), "publish.undo_clear")?;
        }
    }
    Ok(())
}

/// Blanks slot `slot` of `session`: every backup in it removed and the blank marker written
/// over its record (a record written for a job that did not commit, or a generation that is no
/// longer the latest). Not made durable: a record left by a crash is not its session's
/// latest commit's, so nothing uses it, and the next write to the slot or the next start
/// clears it.
fn blank_slot(sess: BorrowedFd<'_>, slot: &str, abs: &Path) -> Result<(), PublishError> {
    let gen = match open_dir_beneath(sess, slot) {
        Ok(fd) => fd,
        Err(Errno::NOENT) => return Ok(()),
        Err(_) => return remove_entry(sess, OsStr::new(slot), abs, "publish.undo_clear"),
    };
    clear_backups(gen.as_fd(), abs)?;
    let path = abs.join(UNDO_RECORD);
    if let Some(f) = reusable_record(gen.as_fd(), &path)? {
        // The blank marker over the record, the rest cut: the file keeps its block for the
        // next record (see `write_record`).
        mutate("publish.undo_clear", &path, || overwrite(&f, BLANK))?;
    }
    Ok(())
}

/// Blanks slot `slot` of `session` (see [`blank_slot`]): the record a job wrote that will not
/// be used.
pub(super) fn drop_generation_at(
    root: BorrowedFd<'_>,
    root_path: &Path,
    session: &str,
    slot: &str,
) -> Result<(), PublishError> {
    let sess_rel = Path::new(UNDO_DIR).join(session);
    let sess_abs = root_path.join(&sess_rel);
    let sess = match open_dir_beneath(root, &sess_rel) {
        Ok(fd) => fd,
        Err(Errno::NOENT) => return Ok(()),
        Err(e) => return Err(io("open undo dir", &sess_abs, e)),
    };
    blank_slot(sess.as_fd(), slot, &sess_abs.join(slot))
}

/// Reads the record in `slot` of `session` (bounded, never through a symlink); `None` when
/// the slot has none, or a blank one.
fn read_slot(
    root: BorrowedFd<'_>,
    root_path: &Path,
    session: &str,
    slot: &str,
) -> Result<Option<UndoRecord>, PublishError> {
    let rel = generation_dir(session, slot).join(UNDO_RECORD);
    let path = root_path.join(&rel);
    let fd = match open_beneath(root, &rel, OFlags::RDONLY | OFlags::NONBLOCK) {
        Ok(fd) => fd,
        Err(Errno::NOENT) => return Ok(None),
        Err(e) => return Err(io("open undo record", &path, e)),
    };
    let st = rustix::fs::fstat(fd.as_fd()).map_err(|e| io("stat", &path, e))?;
    if file_type(&st) != FileType::RegularFile {
        return Err(io("read undo record", &path, Errno::INVAL));
    }
    let mut bytes = Vec::new();
    std::fs::File::from(fd)
        .take(MAX_RECORD + 1)
        .read_to_end(&mut bytes)
        .map_err(|e| PublishError::Io {
            op: "read undo record",
            path: path.clone(),
            source: e,
        })?;
    if bytes.is_empty() || bytes == BLANK {
        return Ok(None);
    }
    if bytes.len() as u64 > MAX_RECORD {
        return Err(io("read undo record", &path, Errno::FBIG));
    }
    let rec: UndoRecord = serde_json::from_slice(&bytes).map_err(|e| PublishError::Io {
        op: "parse undo record",
        path: path.clone(),
        source: std::io::Error::other(e),
    })?;
    Ok(Some(rec))
}

/// Whether `rec`, read from a slot of `session`, is job `job`'s record.
fn names_job(rec: &UndoRecord, session: &str, job: &str) -> bool {
    rec.version == UNDO_VERSION && rec.job == job && rec.session == session
}

/// The slot of `session` whose record is job `job`'s, and the record.
pub(super) fn find(
    root: BorrowedFd<'_>,
    root_path: &Path,
    session: &str,
    job: &str,
) -> Result<(&'static str, UndoRecord), Unusable> {
    let mut damaged = None;
    for slot in SLOTS {
        match read_slot(root, root_path, session, slot) {
            Ok(Some(rec)) if names_job(&rec, session, job) => return Ok((slot, rec)),
            Ok(_) => {}
            Err(e) => damaged = Some(e),
        }
    }
    Err(damaged.map_or(Unusable::Missing, |e| Unusable::Damaged(Box::new(e))))
}

/// The record of job `job` of `session`, if its generation is complete: every backup it
/// names is there with the identity it names.
pub fn load(ws: &Workspace, session: &str, job: &str) -> Result<UndoRecord, Unusable> {
    let (slot, rec) = find(ws.fd(), ws.root(), session, job)?;
    complete(ws.fd(), &generation_dir(session, slot), &rec)?;
    Ok(rec)
}

/// Whether every backup `rec` names is in `dir` (relative to the root) with the identity,
/// size and mtime it names.
fn complete(root: BorrowedFd<'_>, dir: &Path, rec: &UndoRecord) -> Result<(), Unusable> {
    let gen = open_dir_beneath(root, dir).map_err(|_| Unusable::Missing)?;
    for t in &rec.targets {
        if let Before::Backup {
            name,
            id,
            size,
            mtime,
        } = &t.before
        {
            let there = stat_at(gen.as_fd(), OsStr::new(name))
                .ok()
                .flatten()
                .map(|st| Origin::of(&st));
            if there.is_none_or(|o| o.id != *id || o.size != *size || o.mtime != *mtime) {
                return Err(Unusable::BackupGone {
                    target: t.target.clone(),
                });
            }
        }
    }
    Ok(())
}

/// Moves the backups of committed job `journal` from its job dir into its generation, if
/// one of its session's slots holds its record (the job kept undo data). Idempotent: a
/// backup already moved is skipped. Called right after the commit, and by recovery for a
/// committed job whose dir it finds.
pub(super) fn keep_backups(
    root: BorrowedFd<'_>,
    root_path: &Path,
    job_fd: BorrowedFd<'_>,
    job_dir: &Path,
    journal: &Journal,
) -> Result<bool, PublishError> {
    let (slot, rec) = match find(root, root_path, &journal.session, &journal.job) {
        Ok(found) => found,
        Err(_) => return Ok(false),
    };
    let dir_rel = generation_dir(&journal.session, slot);
    let dir_abs = root_path.join(&dir_rel);
    let gen = open_dir_beneath(root, &dir_rel).map_err(|e| io("open undo dir", &dir_abs, e))?;
    let mut syncs = Syncs::default();
    for (i, t) in journal.targets.iter().enumerate() {
        let Some(old) = t.old else { continue };
        let Some(backup) = t.backup.as_ref() else {
            continue;
        };
        let name = backup_name(i);
        // Only a backup the record names (it was written from this journal).
        let named = rec.targets.iter().any(
            |u| matches!(&u.before, Before::Backup { name: n, id, .. } if *n == name && *id == old),
        );
        if !named {
            continue;
        }
        let Some((bdir, bname)) = split_target(backup) else {
            continue;
        };
        let bfd = match open_dir_beneath(job_fd, bdir) {
            Ok(fd) => fd,
            Err(Errno::NOENT) => continue,
            Err(e) => return Err(io("open backup dir", &job_dir.join(bdir), e)),
        };
        let here =
            stat_at(bfd.as_fd(), bname).map_err(|e| io("stat backup", &job_dir.join(backup), e))?;
        if here.as_ref().map(FileId::of) != Some(old) {
            continue;
        }
        mutate("publish.undo_keep", &dir_abs.join(&name), || {
            rustix::fs::renameat_with(
                bfd.as_fd(),
                bname,
                gen.as_fd(),
                name.as_str(),
                RenameFlags::NOREPLACE,
            )
        })?;
        // The dir it left and the generation, durable together below.
        syncs.push_unmarked("fsync", bfd, &job_dir.join(bdir));
    }
    if !syncs.is_empty() {
        syncs.push("publish.fsync_undo", gen, &dir_abs);
        syncs.run()?;
    }
    Ok(true)
}

/// Drops every generation of `session` but the one in slot `keep`: the other slot blanked
/// ([`blank_slot`]) and anything else in the session's dir removed; for `None`, the session's
/// dir is removed. Not made durable: a generation left by a crash is not its session's latest
/// commit's, so nothing uses it, and the next start drops it.
pub fn drop_generations(
    ws: &Workspace,
    session: &str,
    keep: Option<&str>,
) -> Result<(), PublishError> {
    drop_generations_at(ws.fd(), ws.root(), session, keep)
}

pub(super) fn drop_generations_at(
    root: BorrowedFd<'_>,
    root_path: &Path,
    session: &str,
    keep: Option<&str>,
) -> Result<(), PublishError> {
    let top_abs = root_path.join(UNDO_DIR);
    let top = match open_dir_beneath(root, UNDO_DIR) {
        Ok(fd) => fd,
        Err(Errno::NOENT) => return Ok(()),
        Err(e) => return Err(io("open undo dir", &top_abs, e)),
    };
    let sess_abs = top_abs.join(session);
    let Some(keep) = keep else {
        return remove_tree(top.as_fd(), OsStr::new(session), &sess_abs);
    };
    let sess = match open_dir_beneath(top.as_fd(), session) {
        Ok(fd) => fd,
        Err(Errno::NOENT) => return Ok(()),
        Err(e) => return Err(io("open undo dir", &sess_abs, e)),
    };
    for name in names(sess.as_fd(), &sess_abs)? {
        let abs = sess_abs.join(&name);
        match name.to_str() {
            Some(n) if n == keep => {}
            Some(n) if SLOTS.contains(&n) => blank_slot(sess.as_fd(), n, &abs)?,
            _ => remove_entry(sess.as_fd(), &name, &abs, "publish.undo_clear")?,
        }
    }
    Ok(())
}

/// What the startup sweep did with one generation.
#[derive(Debug, Clone)]
pub struct Swept {
    pub session: String,
    /// The job its record names, or the entry's name when it names none.
    pub job: String,
    /// Why it was removed (`None`: kept, its session's latest commit's).
    pub removed: Option<String>,
}

/// At startup, after recovery: keeps one generation per session, only if it is complete and
/// `latest(session, job)` (the session file's last commit is its job); removes every other
/// entry of `.airlock-undo/` (a blank slot is kept beside a kept generation, for reuse).
pub fn sweep(
    ws: &Workspace,
    latest: &dyn Fn(&str, &str) -> bool,
) -> Result<Vec<Swept>, PublishError> {
    let (root, root_path) = (ws.fd(), ws.root());
    let top_abs = root_path.join(UNDO_DIR);
    let top = match open_dir_beneath(root, UNDO_DIR) {
        Ok(fd) => fd,
        Err(Errno::NOENT) => return Ok(Vec::new()),
        Err(e) => return Err(io("open undo dir", &top_abs, e)),
    };
    let mut out = Vec::new();
    for sname in names(top.as_fd(), &top_abs)? {
        let sess_abs = top_abs.join(&sname);
        let session = sname.to_string_lossy().into_owned();
        let sess = match open_dir_beneath(top.as_fd(), &sname) {
            Ok(fd) => fd,
            Err(_) => {
                remove_entry(top.as_fd(), &sname, &sess_abs, "publish.undo_clear")?;
                continue;
            }
        };
        let mut kept = 0;
        for ename in names(sess.as_fd(), &sess_abs)? {
            let abs = sess_abs.join(&ename);
            let slot = ename.to_str().filter(|n| SLOTS.contains(n));
            let rec = match slot {
                Some(slot) => read_slot(root, root_path, &session, slot),
                None => Ok(None),
            };
            let job = match &rec {
                Ok(Some(r)) => r.job.clone(),
                _ => ename.to_string_lossy().into_owned(),
            };
            let why = match (slot, rec) {
                (None, _) => Some("not an undo slot".to_string()),
                (Some(_), Ok(None)) => {
                    // Blank: nothing to report, nothing to use.
                    continue;
                }
                (Some(_), Err(e)) => Some(crate::report::chain(&e).to_string()),
                (Some(slot), Ok(Some(r))) => {
                    if !crate::session::valid_id(&session) {
                        Some("not a session's".to_string())
                    } else if !names_job(&r, &session, &r.job) {
                        Some("not this session's record".to_string())
                    } else if !latest(&session, &r.job) {
                        Some("not its session's latest commit".to_string())
                    } else if kept > 0 {
                        Some("a second generation of its session".to_string())
                    } else {
                        complete(root, &generation_dir(&session, slot), &r)
                            .err()
                            .map(|e| crate::report::chain(&e).to_string())
                    }
                }
            };
            if why.is_some() {
                remove_entry(sess.as_fd(), &ename, &abs, "publish.undo_clear")?;
            } else {
                kept += 1;
            }
            out.push(Swept {
                session: session.clone(),
                job,
                removed: why,
            });
        }
        if kept == 0 {
            drop(sess);
            remove_tree(top.as_fd(), &sname, &sess_abs)?;
        }
    }
    Ok(out)
}

/// The first target of `rec` that is no longer what its job left: another identity, size,
/// mtime or ctime (any write, chmod, chown, rename or link changes one of them), an entry of
/// a directory output changed likewise, a deleted target that exists again, or a deleted
/// target whose parent directory is gone.
pub fn changed(ws: &Workspace, rec: &UndoRecord) -> Option<Changed> {
    let (root, root_path) = (ws.fd(), ws.root());
    for t in &rec.targets {
        let abs = root_path.join(&t.target);
        let now = open_beneath(root, &t.target, OFlags::PATH)
            .ok()
            .and_then(|fd| rustix::fs::fstat(fd.as_fd()).ok())
            .map(|st| Origin::of(&st));
        let differs = match (&t.published, &now) {
            (None, None) => {
                // Deleted: it goes back beneath its parent, which must still be there.
                let parent = split_target(&t.target).map(|(p, _)| p.to_path_buf());
                match parent.map(|p| open_dir_beneath(root, &p)) {
                    Some(Ok(_)) => None,
                    _ => Some(Conflict::Removed),
                }
            }
            (None, Some(_)) => Some(Conflict::Created),
            (Some(_), None) => Some(Conflict::Removed),
            (Some(p), Some(n)) => match p.differs(n) {
                Some(c) => Some(c),
                None => match &t.tree {
                    Some(tree) => match open_dir_beneath(root, &t.target) {
                        Ok(fd) => tree_differs(fd.as_fd(), &abs, tree, false)
                            .unwrap_or(Some(Conflict::Modified)),
                        Err(_) => Some(Conflict::Replaced),
                    },
                    None => None,
                },
            },
        };
        if let Some(what) = differs {
            return Some(Changed {
                target: t.target.clone(),
                what,
            });
        }
    }
    None
}

/// What a directory output holds (every entry's snapshot), for its undo record.
pub(super) fn snapshot_tree(
    root: BorrowedFd<'_>,
    root_path: &Path,
    target: &Path,
) -> Result<Option<TreeOrigin>, PublishError> {
    let abs = root_path.join(target);
    let fd = open_dir_beneath(root, target).map_err(|e| io("open directory output", &abs, e))?;
    super::copy::snapshot_tree(fd.as_fd(), &abs)
}
