//! `recovery.json`: what recovery needs to finish or undo a job after a crash at any instant,
//! written once per job, just before publication touches the workspace ([`Journal::create`]).
//! A job dir without a journal (ENOENT), or whose journal is blank (`null`, [`BLANK`]), never
//! published, or its targets are settled (the journal is blanked only then); a journal that
//! is there but cannot be read ([`JournalError::Damaged`]: an empty file included) proves
//! nothing, and recovery keeps its dir. A journal in phase `publishing_outputs` is settled
//! by the session: the session file records the job's id only once every target durably
//! holds its new file, so recovery completes the job if it does and rolls it back by
//! identity otherwise. The journal is blanked (and the blank made durable) before the
//! session's lock is released, so no later commit of the session can meet it; only if that
//! fails is the journal replaced by one in phase `committed`.
//!
//! A blank journal stays in the job dir when the dir is set aside for reuse
//! ([`super::pool`]), and the next job writes its journal over it in place: no file is made
//! or removed per call. A journal written over `null` is longer than it, so nothing of the
//! blank is left after it but spaces, which JSON allows after a value; until it is durable,
//! a crash leaves the blank (never published: nothing is renamed before the journal's
//! fsync), the whole journal, or (on a filesystem that does not order data before size) a
//! damaged one, which recovery keeps.
//!
//! Blanking writes `null` padded with spaces to the journal's length, in one write over it
//! ([`blank_marker`]): the file keeps its size and its block, so the blank's fdatasync writes
//! that one block and no inode, no block is freed (on a filesystem mounted with `discard`,
//! each freed block is a discard request the daemon would wait for), and no instant exists
//! at which the file holds neither the journal nor the blank. A journal longer than one
//! block ([`PAD_MAX`]) is cut to nothing and `null` written instead, so a blank never costs
//! more than a block to write; a power loss between those two leaves an empty file, which
//! reads as damaged, so the dir is kept, never removed.

use std::io::{Read, Write};
use std::os::fd::{AsFd, BorrowedFd};
use std::path::{Path, PathBuf};

use rustix::fs::{FileType, Mode, OFlags};
use serde::{Deserialize, Serialize};

use super::copy::Origin;
use super::sys::{self, file_type, mutate, FileId, Syncs};
use super::{OutputKind, PublishError};

pub(super) const JOURNAL: &str = "recovery.json";
pub(super) const JOURNAL_TMP: &str = "recovery.json.tmp";
/// A blank journal's content: the job never published, or its targets are settled. It may
/// be followed by spaces ([`is_blank`]).
pub(super) const BLANK: &[u8] = b"null";
/// The longest journal blanked in place, padded ([`blank_marker`]): one block.
pub(super) const PAD_MAX: u64 = 4096;

/// Whether `bytes` is a blank journal: [`BLANK`], then nothing but spaces.
pub(super) fn is_blank(bytes: &[u8]) -> bool {
    bytes.starts_with(BLANK) && bytes[BLANK.len()..].iter().all(|&b| b == b' ')
}

/// What blanks a journal of `len` bytes in place: [`BLANK`] padded with spaces to `len`, or
/// `None` when the journal is longer than [`PAD_MAX`] (or shorter than the blank) and must
/// be cut instead.
pub(super) fn blank_marker(len: u64) -> Option<Vec<u8>> {
    if len < BLANK.len() as u64 || len > PAD_MAX {
        return None;
    }
    let mut bytes = vec![b' '; len as usize];
    bytes[..BLANK.len()].copy_from_slice(BLANK);
    Some(bytes)
}
/// A journal is a few hundred bytes per target; anything larger is not ours.
const MAX_JOURNAL: u64 = 4 << 20;
/// The version a journal of file outputs only is written with (every release reads it).
pub(super) const VERSION: u32 = 1;
/// The version of a journal with a target of another kind (a directory) or an in-out target
/// (a deletion to undo): a release that reads version 1 only keeps such a job aside rather
/// than roll a tree back as a file or miss a deletion.
pub(super) const VERSION_KINDS: u32 = 2;

#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Phase {
    /// The worker may be writing into `stage/`; nothing is published.
    WorkerRunning,
    /// Targets are being renamed, or renamed and the session commit decides; identities
    /// below tell what each target holds.
    PublishingOutputs,
    /// Every target holds its new file durably; the session commit decides. Written by
    /// earlier versions; recovery treats it as `publishing_outputs`.
    CommittingState,
    /// The session holds the commit; only cleanup remains.
    Committed,
}

impl Phase {
    pub fn as_str(self) -> &'static str {
        match self {
            Phase::WorkerRunning => "worker_running",
            Phase::PublishingOutputs => "publishing_outputs",
            Phase::CommittingState => "committing_state",
            Phase::Committed => "committed",
        }
    }
}

#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct TargetRecord {
    /// Final path, relative to the workspace root.
    pub target: PathBuf,
    /// What the target is; absent in version 1 (always a file).
    #[serde(default, skip_serializing_if = "OutputKind::is_file")]
    pub kind: OutputKind,
    /// Staged path, relative to the job dir (`stage/<i>/<basename>`).
    pub staged: PathBuf,
    /// Where the old file lands after the exchange (the staged name), relative to the job dir;
    /// `None` when the target did not exist.
    pub backup: Option<PathBuf>,
    /// Identity of the file the target held before publication (`None`: no file).
    pub old: Option<FileId>,
    /// Identity of the staged file that publication puts at the target.
    pub new: Option<FileId>,
    /// An in-out target: the worker edited a copy of it.
    #[serde(default, skip_serializing_if = "std::ops::Not::not")]
    pub inout: bool,
    /// In-out: what the target was when its copy was taken (`None`: there was none).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub origin: Option<Origin>,
    /// In-out: the copy as the worker got it (to tell an untouched copy).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub copy: Option<Origin>,
    /// In-out whose copy the worker removed: publication moves the target (identity `old`)
    /// to `backup`, deleting it; rollback moves it back.
    #[serde(default, skip_serializing_if = "std::ops::Not::not")]
    pub delete: bool,
    /// An undo's target: what it puts at the target is a backup of the job it undoes, so a
    /// rollback moves it back to its staged name rather than unlinking it.
    #[serde(default, skip_serializing_if = "std::ops::Not::not")]
    pub undo: bool,
}

#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Journal {
    pub version: u32,
    pub job: String,
    pub session: String,
    pub tool: String,
    pub worker_pid: Option<u32>,
    pub phase: Phase,
    pub targets: Vec<TargetRecord>,
    /// Directories publication creates, relative to the workspace root, in creation order
    /// (rollback removes them in reverse order if they are empty). Recorded before creating.
    pub created_dirs: Vec<PathBuf>,
    /// An undo's: the directories the undone job created, deepest first; publication removes
    /// those it leaves empty, rollback makes again those that are missing (before it puts
    /// back any target).
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub removed_dirs: Vec<PathBuf>,
}

impl Journal {
    /// The version this journal is written with: 1 unless a target is not a file output.
    pub fn version_for(targets: &[TargetRecord]) -> u32 {
        if targets.iter().all(|t| t.kind.is_file() && !t.inout) {
            VERSION
        } else {
            VERSION_KINDS
        }
    }

    /// Writes the job's one journal: written over the blank one of a reused job dir
    /// (`blank`, open read-write), or else `recovery.json` created (it must not exist) and
    /// written. Its fsync, the job dir's (for a new journal: its entry) and, for a job dir
    /// made for this job, the workspace root's (`root`: the job dir's entry) join `syncs`,
    /// which the caller runs before the first rename, so that the journal and the job dir
    /// holding it (and every backup to come) are durable by then. A dir taken from the pool
    /// already has a durable entry in the root, under an idle name or an earlier job's: its
    /// rename to this job's name is not made durable, and recovery goes by the job the
    /// journal names, whatever the dir's name. A crash before they ran leaves no journal, a
    /// blank one or an unreadable one, and nothing renamed yet (recovery still keeps a dir
    /// whose journal it cannot read: it cannot tell). Returns the journal, open, for
    /// [`Journal::blank`].
    pub fn create(
        &self,
        job_fd: BorrowedFd<'_>,
        job_dir: &Path,
        root: Option<(BorrowedFd<'_>, &Path)>,
        blank: Option<std::fs::File>,
        syncs: &mut Syncs,
    ) -> Result<std::fs::File, PublishError> {
        let path = job_dir.join(JOURNAL);
        let new = blank.is_none();
        let file = match blank {
            Some(file) => {
                let bytes = self.serialize(&path)?;
                mutate("publish.journal_write", &path, || pwrite_all(&file, &bytes))?;
                file
            }
            None => self.write_to(job_fd, JOURNAL, &path, OFlags::EXCL)?,
        };
        syncs.push_dup("publish.fsync_journal", file.as_fd(), &path)?;
        if new {
            syncs.push_dup("publish.fsync_job_dir", job_fd, job_dir)?;
        }
        if let Some((root_fd, root)) = root {
            syncs.push_dup("publish.fsync_root", root_fd, root)?;
        }
        Ok(file)
    }

    /// Blanks the job's journal `file` (at `path`) once its targets are settled: `null`
    /// written over it, padded to its length (cut to nothing first if it is longer than a
    /// block: see the module doc), so that what remains of the dir reads as "never
    /// published" and the file can carry the next job's journal. Made durable, after a
    /// commit (under the session's lock: a `publishing_outputs` journal left behind would
    /// make recovery ask the session again after later commits no longer record the job) as
    /// after a rollback (a journal that came back after a power loss would be rolled back
    /// again by identity, when the inode numbers it names may be later calls' files).
    pub fn blank(file: &std::fs::File, path: &Path) -> Result<(), PublishError> {
        mutate("publish.journal_blank", path, || {
            let len = rustix::fs::fstat(file)?.st_size.max(0) as u64;
            match blank_marker(len) {
                Some(padded) => pwrite_all(file, &padded),
                None => {
                    rustix::fs::ftruncate(file, 0)?;
                    pwrite_all(file, BLANK)
                }
            }
        })?;
        mutate("publish.fsync_journal_blank", path, || {
            rustix::fs::fdatasync(file)
        })?;
        Ok(())
    }

    /// Serializes the journal into `name` of the job dir (`path` for messages), opened with
    /// `flags` added to a private, no-follow create; written, not yet synced.
    fn write_to(
        &self,
        job_fd: BorrowedFd<'_>,
        name: &str,
        path: &Path,
        flags: OFlags,
    ) -> Result<std::fs::File, PublishError> {
        let bytes = self.serialize(path)?;
        let fd = mutate("publish.journal_write", path, || {
            rustix::fs::openat(
                job_fd,
                name,
                OFlags::WRONLY | OFlags::CREATE | OFlags::NOFOLLOW | OFlags::CLOEXEC | flags,
                Mode::from_raw_mode(0o600),
            )
        })?;
        let mut file = std::fs::File::from(fd);
        file.write_all(&bytes).map_err(|e| PublishError::Io {
            op: "write journal",
            path: path.to_path_buf(),
            source: e,
        })?;
        Ok(file)
    }

    fn serialize(&self, path: &Path) -> Result<Vec<u8>, PublishError> {
        serde_json::to_vec_pretty(self).map_err(|e| PublishError::Io {
            op: "serialize journal",
            path: path.to_path_buf(),
            source: std::io::Error::other(e),
        })
    }

    /// Replaces the journal atomically: temp file, fsync, rename over `recovery.json`, fsync
    /// of the job dir. A crash leaves either the previous journal or this one.
    pub fn write(&self, job_fd: BorrowedFd<'_>, job_dir: &Path) -> Result<(), PublishError> {
        let tmp_path = job_dir.join(JOURNAL_TMP);
        let path = job_dir.join(JOURNAL);
        let file = self.write_to(job_fd, JOURNAL_TMP, &tmp_path, OFlags::TRUNC)?;
        file.sync_all().map_err(|e| PublishError::Io {
            op: "fsync journal",
            path: tmp_path.clone(),
            source: e,
        })?;
        drop(file);
        mutate("publish.journal_rename", &path, || {
            rustix::fs::renameat(job_fd, JOURNAL_TMP, job_fd, JOURNAL)
        })?;
        sys::fsync_dir(job_fd, job_dir)
    }

    /// Reads the journal of a job dir. [`JournalError::Missing`] (no `recovery.json`) and
    /// [`JournalError::Blank`] mean nothing of the job was ever renamed into the workspace,
    /// or its targets were settled and its journal dropped or blanked (see the module doc). [`JournalError::Damaged`] means a file is
    /// there that this airlock cannot use: the job may have published, and its backups are
    /// the only old copies, so the caller must keep the dir.
    pub fn read(job_fd: BorrowedFd<'_>, job_dir: &Path) -> Result<Journal, JournalError> {
        let path = job_dir.join(JOURNAL);
        let damaged = |reason: Damage| JournalError::Damaged {
            path: path.clone(),
            reason,
        };
        let fd = match sys::open_beneath(job_fd, JOURNAL, OFlags::RDONLY | OFlags::NONBLOCK) {
            Ok(fd) => fd,
            Err(rustix::io::Errno::NOENT) => return Err(JournalError::Missing { path }),
            Err(e) => return Err(damaged(Damage::Unreadable(e.into()))),
        };
        let st =
            rustix::fs::fstat(fd.as_fd()).map_err(|e| damaged(Damage::Unreadable(e.into())))?;
        let kind = file_type(&st);
        if kind != FileType::RegularFile {
            return Err(damaged(Damage::NotAFile {
                kind: sys::describe(kind),
            }));
        }
        let mut bytes = Vec::new();
        std::fs::File::from(fd)
            .take(MAX_JOURNAL + 1)
            .read_to_end(&mut bytes)
            .map_err(|e| damaged(Damage::Unreadable(e)))?;
        if bytes.len() as u64 > MAX_JOURNAL {
            return Err(damaged(Damage::TooLarge { max: MAX_JOURNAL }));
        }
        if is_blank(&bytes) {
            return Err(JournalError::Blank { path });
        }
        // The version first: a journal of another version need not parse as this one.
        #[derive(Deserialize)]
        struct Versioned {
            version: serde_json::Value,
        }
        let v: Versioned =
            serde_json::from_slice(&bytes).map_err(|e| damaged(Damage::Unparsable(e)))?;
        if v.version != VERSION && v.version != VERSION_KINDS {
            return Err(damaged(Damage::UnknownVersion {
                found: v.version.to_string(),
            }));
        }
        serde_json::from_slice(&bytes).map_err(|e| damaged(Damage::Unparsable(e)))
    }
}

/// Writes all of `bytes` at the start of `file`.
fn pwrite_all(file: &std::fs::File, bytes: &[u8]) -> Result<(), rustix::io::Errno> {
    let mut at = 0;
    while at < bytes.len() {
        match rustix::io::pwrite(file, &bytes[at..], at as u64)? {
            0 => return Err(rustix::io::Errno::NOSPC),
            n => at += n,
        }
    }
    Ok(())
}

/// Why [`Journal::read`] returned no journal.
#[derive(Debug, thiserror::Error)]
pub enum JournalError {
    /// No `recovery.json` in the job dir (ENOENT).
    #[error("{path}: no journal")]
    Missing { path: PathBuf },
    /// A blank `recovery.json` ([`is_blank`]): as [`JournalError::Missing`].
    #[error("{path}: a blank journal")]
    Blank { path: PathBuf },
    /// A `recovery.json` is there but cannot be used.
    #[error("{path}: {reason}")]
    Damaged { path: PathBuf, reason: Damage },
}

/// What is wrong with a journal that is there.
#[derive(Debug, thiserror::Error)]
pub enum Damage {
    /// Opening, stating or reading it failed (EACCES, ELOOP for a symlink, EIO, ...).
    #[error("cannot read it")]
    Unreadable(#[source] std::io::Error),
    /// It is a directory, a symlink's target kind, a fifo, ...
    #[error("it is {kind}, not a regular file")]
    NotAFile { kind: &'static str },
    /// Larger than any journal airlock writes.
    #[error("it is larger than {max} bytes, more than any journal")]
    TooLarge { max: u64 },
    /// Not JSON, truncated (to nothing included), or missing fields of this version.
    #[error("it is not a journal (truncated or garbled)")]
    Unparsable(#[source] serde_json::Error),
    /// A version this airlock does not read (written by another release).
    #[error(
        "its version is {found}; this airlock reads versions {VERSION} and {VERSION_KINDS} only"
    )]
    UnknownVersion { found: String },
}
