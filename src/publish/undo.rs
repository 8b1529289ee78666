//! Undo data: the backups of a session's latest commit, kept past the commit in
//! `<root>/.airlock-undo/<session>/<job>/`, with the record that says what to put back
//! (`undo.json`). One generation per session: a commit that keeps its own drops the
//! previous one, and so does a commit that keeps none (it is no longer the latest).
//!
//! Order, for a job that keeps undo data (`Job::keep_undo`):
//! 1. after its renames and before its commit point: `undo.json` written and made durable in
//!    a new `<job>/` dir ([`write_record`]); the backups are still in the job dir;
//! 2. the commit point (the session file records the job);
//! 3. each backup renamed from the job dir into `<job>/b<i>` ([`keep_backups`]; startup
//!    recovery does the same for a committed job whose dir it finds, so a crash between 2
//!    and 3 loses nothing);
//! 4. every other generation of the session removed ([`drop_generations`]).
//!
//! Undo data is used only while its record is complete (every backup there, with the
//! identity the record names) and the session file's last commit is its job: a crash at any
//! point leaves data that is either that, or dropped at the next start ([`sweep`]). The
//! directory is under the workspace root because its backups must be renamed there and back
//! (one filesystem, never a copy); its name is reserved, so no path parameter reaches it.

use std::ffi::{OsStr, OsString};
use std::io::{Read, Write};
use std::os::fd::{AsFd, BorrowedFd, OwnedFd};
use std::path::{Path, PathBuf};

use rustix::fs::{FileType, Mode, OFlags, RenameFlags};
use rustix::io::Errno;
use serde::{Deserialize, Serialize};
use serde_json::{Map, Value};

use super::copy::{tree_differs, Conflict, Origin, TreeOrigin};
use super::journal::Journal;
use super::sys::{file_type, io, mutate, open_beneath, open_dir_beneath, stat_at, FileId, Syncs};
use super::tree::remove_tree;
use super::workspace::split_target;
use super::{OutputKind, PublishError, Workspace};

/// The undo data's dir in the workspace root; reserved (no path parameter may name it).
pub const UNDO_DIR: &str = ".airlock-undo";
/// A generation's record.
pub const UNDO_RECORD: &str = "undo.json";
const UNDO_VERSION: u32 = 1;
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
    #[error("its undo record is not this job's")]
    OtherJob,
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

/// `.airlock-undo/<session>` and `.airlock-undo/<session>/<job>`, relative to the root.
pub(super) fn generation_dir(session: &str, job: &str) -> PathBuf {
    Path::new(UNDO_DIR).join(session).join(job)
}

/// Makes `name` in `parent` a directory (0700), an existing one kept; whether it made it.
fn mkdir_private(parent: BorrowedFd<'_>, name: &str, abs: &Path) -> Result<bool, PublishError> {
    match mutate("publish.undo_mkdir", abs, || {
        rustix::fs::mkdirat(parent, name, Mode::from_raw_mode(0o700))
    }) {
        Ok(()) => Ok(true),
        Err(PublishError::Io { source, .. }) if source.raw_os_error() == Some(libc::EEXIST) => {
            Ok(false)
        }
        Err(e) => Err(e),
    }
}

/// Writes `rec` as a new generation of its session: `<job>/undo.json`, and adds to `syncs`
/// what makes it durable (the file, its dir and every dir above it up to the root whose
/// entries changed), which the caller runs before the commit point of `rec.job`. A dir of
/// the same job left by a crash is replaced.
pub(super) fn write_record(
    root: BorrowedFd<'_>,
    root_path: &Path,
    rec: &UndoRecord,
    syncs: &mut Syncs,
) -> Result<(), PublishError> {
    let top_abs = root_path.join(UNDO_DIR);
    let new_top = mkdir_private(root, UNDO_DIR, &top_abs)?;
    let top = open_dir_beneath(root, UNDO_DIR).map_err(|e| io("open undo dir", &top_abs, e))?;
    let sess_abs = top_abs.join(&rec.session);
    let new_sess = mkdir_private(top.as_fd(), &rec.session, &sess_abs)?;
    let sess = open_dir_beneath(top.as_fd(), &rec.session)
        .map_err(|e| io("open undo dir", &sess_abs, e))?;
    let gen_abs = sess_abs.join(&rec.job);
    remove_tree(sess.as_fd(), OsStr::new(&rec.job), &gen_abs)?;
    mkdir_private(sess.as_fd(), &rec.job, &gen_abs)?;
    let gen =
        open_dir_beneath(sess.as_fd(), &rec.job).map_err(|e| io("open undo dir", &gen_abs, e))?;
    let path = gen_abs.join(UNDO_RECORD);
    let bytes = serde_json::to_vec(rec).map_err(|e| PublishError::Io {
        op: "serialize undo record",
        path: path.clone(),
        source: std::io::Error::other(e),
    })?;
    let fd = mutate("publish.undo_write", &path, || {
        rustix::fs::openat(
            gen.as_fd(),
            UNDO_RECORD,
            OFlags::WRONLY | OFlags::CREATE | OFlags::EXCL | OFlags::NOFOLLOW | OFlags::CLOEXEC,
            Mode::from_raw_mode(0o600),
        )
    })?;
    let mut file = std::fs::File::from(fd);
    file.write_all(&bytes).map_err(|e| PublishError::Io {
        op: "write undo record",
        path: path.clone(),
        source: e,
    })?;
    syncs.push("publish.fsync_undo", file.into(), &path);
    // Each dir whose entries changed: the record's, the generation's, and above them only
    // what this write created.
    syncs.push("publish.fsync_undo", gen, &gen_abs);
    syncs.push("publish.fsync_undo", sess, &sess_abs);
    if new_sess {
        syncs.push("publish.fsync_undo", top, &top_abs);
    }
    if new_top {
        syncs.push_dup("publish.fsync_undo", root, root_path)?;
    }
    Ok(())
}

/// Removes generation `job` of `session` (a record written for a job that did not commit,
/// or whose record could not be made durable). Not made durable, as [`drop_generations`].
pub(super) fn drop_generation_at(
    root: BorrowedFd<'_>,
    root_path: &Path,
    session: &str,
    job: &str,
) -> Result<(), PublishError> {
    let sess_rel = Path::new(UNDO_DIR).join(session);
    let sess_abs = root_path.join(&sess_rel);
    let sess = match open_dir_beneath(root, &sess_rel) {
        Ok(fd) => fd,
        Err(Errno::NOENT) => return Ok(()),
        Err(e) => return Err(io("open undo dir", &sess_abs, e)),
    };
    remove_tree(sess.as_fd(), OsStr::new(job), &sess_abs.join(job))
}

/// Reads the record of generation `job` of `session` (bounded, never through a symlink).
pub(super) fn read_record(
    root: BorrowedFd<'_>,
    root_path: &Path,
    session: &str,
    job: &str,
) -> Result<UndoRecord, Unusable> {
    let rel = generation_dir(session, job).join(UNDO_RECORD);
    let path = root_path.join(&rel);
    let damaged = |e: PublishError| Unusable::Damaged(Box::new(e));
    let fd = match open_beneath(root, &rel, OFlags::RDONLY | OFlags::NONBLOCK) {
        Ok(fd) => fd,
        Err(Errno::NOENT) => return Err(Unusable::Missing),
        Err(e) => return Err(damaged(io("open undo record", &path, e))),
    };
    let st = rustix::fs::fstat(fd.as_fd()).map_err(|e| damaged(io("stat", &path, e)))?;
    if file_type(&st) != FileType::RegularFile {
        return Err(damaged(io("read undo record", &path, Errno::INVAL)));
    }
    let mut bytes = Vec::new();
    std::fs::File::from(fd)
        .take(MAX_RECORD + 1)
        .read_to_end(&mut bytes)
        .map_err(|e| {
            damaged(PublishError::Io {
                op: "read undo record",
                path: path.clone(),
                source: e,
            })
        })?;
    if bytes.len() as u64 > MAX_RECORD {
        return Err(damaged(io("read undo record", &path, Errno::FBIG)));
    }
    let rec: UndoRecord = serde_json::from_slice(&bytes).map_err(|e| {
        damaged(PublishError::Io {
            op: "parse undo record",
            path: path.clone(),
            source: std::io::Error::other(e),
        })
    })?;
    if rec.version != UNDO_VERSION || rec.job != job || rec.session != session {
        return Err(Unusable::OtherJob);
    }
    Ok(rec)
}

/// The record of generation `job` of `session`, if it is complete: every backup it names is
/// there with the identity it names.
pub fn load(ws: &Workspace, session: &str, job: &str) -> Result<UndoRecord, Unusable> {
    load_at(ws.fd(), ws.root(), session, job)
}

fn load_at(
    root: BorrowedFd<'_>,
    root_path: &Path,
    session: &str,
    job: &str,
) -> Result<UndoRecord, Unusable> {
    let rec = read_record(root, root_path, session, job)?;
    let dir = generation_dir(session, job);
    let gen = open_dir_beneath(root, &dir).map_err(|_| Unusable::Missing)?;
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
    Ok(rec)
}

/// Moves the backups of committed job `journal` from its job dir into its generation, if
/// that generation's record is there and names the job (the job kept undo data). Idempotent:
/// a backup already moved is skipped. Called right after the commit, and by recovery for a
/// committed job whose dir a crash left.
pub(super) fn keep_backups(
    root: BorrowedFd<'_>,
    root_path: &Path,
    job_fd: BorrowedFd<'_>,
    job_dir: &Path,
    journal: &Journal,
) -> Result<bool, PublishError> {
    let rec = match read_record(root, root_path, &journal.session, &journal.job) {
        Ok(r) => r,
        Err(_) => return Ok(false),
    };
    let dir_rel = generation_dir(&journal.session, &journal.job);
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

/// Removes every generation of `session` but `keep` (all of them for `None`, and then the
/// session's dir). Not made durable: a generation left by a crash is not its session's latest
/// commit's, so nothing uses it, and the next start removes it.
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
    if keep.is_none() {
        return remove_tree(top.as_fd(), OsStr::new(session), &sess_abs);
    }
    let sess = match open_dir_beneath(top.as_fd(), session) {
        Ok(fd) => fd,
        Err(Errno::NOENT) => return Ok(()),
        Err(e) => return Err(io("open undo dir", &sess_abs, e)),
    };
    for name in names(sess.as_fd(), &sess_abs)? {
        if Some(name.as_os_str()) != keep.map(OsStr::new) {
            remove_tree(sess.as_fd(), &name, &sess_abs.join(&name))?;
        }
    }
    Ok(())
}

/// The names in a directory.
fn names(fd: BorrowedFd<'_>, abs: &Path) -> Result<Vec<OsString>, PublishError> {
    use std::os::unix::ffi::OsStrExt;
    let dup: OwnedFd = rustix::fs::openat(
        fd,
        ".",
        OFlags::RDONLY | OFlags::DIRECTORY | OFlags::CLOEXEC,
        Mode::empty(),
    )
    .map_err(|e| io("open", abs, e))?;
    let mut out = Vec::new();
    let mut d = rustix::fs::Dir::read_from(&dup).map_err(|e| io("read directory", abs, e))?;
    while let Some(ent) = d.read() {
        let ent = ent.map_err(|e| io("read directory", abs, e))?;
        let n = ent.file_name().to_bytes();
        if n != b"." && n != b".." {
            out.push(OsStr::from_bytes(n).to_os_string());
        }
    }
    Ok(out)
}

/// What the startup sweep did with one generation.
#[derive(Debug, Clone)]
pub struct Swept {
    pub session: String,
    pub job: String,
    /// Why it was removed (`None`: kept, its session's latest commit's).
    pub removed: Option<String>,
}

/// At startup, after recovery: keeps each session's generation only if it is complete and
/// `latest(session, job)` (the session file's last commit is its job); removes every other
/// entry of `.airlock-undo/`.
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
                remove_tree(top.as_fd(), &sname, &sess_abs)?;
                continue;
            }
        };
        let mut kept = 0;
        for jname in names(sess.as_fd(), &sess_abs)? {
            let job = jname.to_string_lossy().into_owned();
            let why = if !crate::session::valid_id(&session) {
                Some("not a session's".to_string())
            } else if !latest(&session, &job) {
                Some("not its session's latest commit".to_string())
            } else {
                load_at(root, root_path, &session, &job)
                    .err()
                    .map(|e| crate::report::chain(&e).to_string())
            };
            if why.is_some() {
                remove_tree(sess.as_fd(), &jname, &sess_abs.join(&jname))?;
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
