//! Job dirs, the recovery journal, publication of staged outputs, rollback and startup
//! recovery. Only this module renames into the workspace.
//!
//! Invariants:
//! * Every path is resolved beneath the workspace root fd with openat2 (`RESOLVE_BENEATH |
//!   RESOLVE_NO_SYMLINKS | RESOLVE_NO_MAGICLINKS | RESOLVE_NO_XDEV`); mutations act on
//!   (dirfd, name) pairs. No symlink is ever followed, in the workspace or in a job dir.
//! * Nothing is copied: outputs are published by rename (`RENAME_EXCHANGE` over an existing
//!   target, `RENAME_NOREPLACE` for a new one); EXDEV fails the call.
//! * What a target holds is told by its (device, inode), journaled before any rename.
//! * Every filesystem mutation is preceded by a failpoint named `publish.<what>`, and so is
//!   every fsync of the write path (`fsync_*`: where durability is decided, and where a
//!   failed writeback surfaces as EIO). fsyncs due before the same next step, none of which
//!   orders another, are issued together (`sys::Syncs`): their failpoints are passed first,
//!   in order, on the calling thread, then the fsyncs run at once, so that a journaling
//!   filesystem commits them together. For a call with outputs `a.txt` (exists), `n/m/b.txt`
//!   and `c.txt` (new), in order:
//!   - `Job::create`: `mkdir_job`, `mkdir_stage`, `mkdir_slot` x3 (each followed by
//!     `chown_stage` when the worker has a uid of its own); or, when an idle dir is taken
//!     ([`pool`]), `pool_take` (then `chmod_job` for a worker with its own uid) in place of
//!     the job dir's, the stage's and the first slot's mkdirs (an idle dir may hold the blank
//!     journal of its last job); no journal written, no fsync: a job dir without a journal,
//!     or with a blank one, never published, whether or not it survives a crash;
//!   - `Job::publish_and_commit`: `seal_output` x3 (owner and mode of each staged output),
//!     the job's one journal: `journal_write` (`publishing_outputs`; written over the blank
//!     one of a reused dir, or created), then together `fsync_output` x3 (the outputs'
//!     data), `fsync_journal`, `fsync_job_dir` (for a created journal only), `fsync_root`;
//!     `mkdir_parent` x2 (`n`, `n/m`), `exchange` (a.txt), `rename_noreplace` x2, the undo
//!     record if one is kept (`undo_mkdir` for each undo dir a session's first commit makes,
//!     `undo_clear` per stray entry of the slot, `undo_write`), then together `fsync_renamed`
//!     per changed dir (each parent, each staging slot), `fsync_undo` for the record and per
//!     undo dir whose entries changed,
//!     and the caller's own records due before the commit point (`prepare`), then the
//!     caller's `commit()`, then `journal_blank` (the journal cut and `null` written) and
//!     `fsync_journal_blank` (an fdatasync, under the session's lock); a dir the pool keeps
//!     is emptied but for `stage/0` and the blank journal (`cleanup_unlink` /
//!     `cleanup_rmdir` per entry, without fsync), then `pool_chown` and `pool_chmod`
//!     (staging dirs given back to the daemon, modes 0700) and `pool_keep` (the rename to
//!     its idle name); a dir it does not keep is removed (`cleanup_unlink` /
//!     `cleanup_rmdir`, and `cleanup_chmod` for unreadable dirs a worker left, per entry).
//!   - Rollback (in-process or in recovery): `rollback_exchange` / `rollback_unlink` per
//!     target holding its new file, `rollback_rmdir` per created dir, then the cleanup points.
//!   - A directory output (`OutputKind::Directory`) adds `mkdir_staged_dir` (and
//!     `chown_stage`) after its slot in `Job::create`; its validation passes `seal_output`
//!     per entry whose owner or mode changes and `fsync_output` per file and per directory
//!     (`staged_tree`); it is renamed like a file (`exchange` / `rename_noreplace`), and a
//!     new tree is rolled back by `rollback_rename` into its slot, not unlinked.
//! * A job dir is never a completed export: a dropped `Job` (neither published nor
//!   discarded) stays on disk until [`recover`] runs at the next start. [`recover`] must run
//!   before the daemon serves calls, with the workspace to itself.

mod copy;
mod job;
mod journal;
mod pool;
mod recover;
mod rejection;
mod staged_tree;
mod sys;
mod tree;
pub mod undo;
mod workspace;

#[cfg(test)]
mod tests;
#[cfg(test)]
mod testsim;

use std::path::PathBuf;

pub use crate::policy::OutputKind;
pub use copy::{Conflict, CopyRefusal};
pub use job::Unreached;
pub use job::{Committed, Job};
pub use job::{NotKept, UndoKeep, UndoStatus};
pub use journal::Phase;
pub use journal::{Damage, JournalError};
pub use recover::{recover, recover_with, Kept, MoveAside, RecoveryFault};
pub use rejection::{Change, OutputFault, Rejection, SpecError, TargetError};
pub use staged_tree::{EntryFault, MANIFEST_FORMAT};
pub use sys::FileId;
pub use tree::Usage;
pub use workspace::Workspace;

/// Job dirs are `<root>/.airlock-job-<id>/`; no path parameter may name one.
pub const JOB_DIR_PREFIX: &str = ".airlock-job-";
/// Job dirs recovery could not remove are moved to `<root>/.airlock-quarantine-<id>/`; no
/// path parameter may name one either.
pub const QUARANTINE_PREFIX: &str = ".airlock-quarantine-";
/// The undo data of each session's latest commit is in `<root>/.airlock-undo/` ([`undo`]); no
/// path parameter may name it.
pub const UNDO_PREFIX: &str = undo::UNDO_DIR;
/// Names in the workspace root that belong to airlock: a path whose first component starts
/// with one of these is rejected.
pub const RESERVED_PREFIXES: [&str; 3] = [JOB_DIR_PREFIX, QUARANTINE_PREFIX, UNDO_PREFIX];

/// The job dir's staging subdirectory.
const STAGE: &str = "stage";
/// Job ids become file names: keep them short and free of separators and dots.
const MAX_ID_LEN: usize = 128;
/// How much longer than the workspace root's path a staged output's path is, at most,
/// without its file name: `/.airlock-job-<id>/stage/<slot>/`.
const STAGED_OVERHEAD: usize = 1 + JOB_DIR_PREFIX.len() + MAX_ID_LEN + 1 + STAGE.len() + 1 + 20 + 1;

/// The longest path the kernel takes, terminating NUL included (`PATH_MAX`).
pub const PATH_MAX: usize = libc::PATH_MAX as usize;
/// The longest file name (`NAME_MAX`).
pub const NAME_MAX: usize = 255;

#[derive(Debug, thiserror::Error)]
pub enum PathError {
    /// `raw` is the path as the client sent it, shown escaped and cut (as every
    /// client-supplied string in a message is).
    #[error("{}: {reason}", crate::text::shown(raw))]
    Rejected { raw: String, reason: Rejection },
}

/// The error of a caller's callback (the commit, recovery's question), kept with its causes.
pub type CallbackError = Box<dyn std::error::Error + Send + Sync + 'static>;

/// The error of a commit callback: whether it may have reached its commit point.
pub trait CommitError: Into<CallbackError> {
    /// True when the callback cannot tell whether its commit point is durable (a disk error
    /// after it began making it so, and undoing it failed too): the job is then left as it
    /// is, for recovery at the next start to decide by what is on disk, not rolled back.
    fn undecided(&self) -> bool {
        false
    }
}

impl CommitError for std::io::Error {}
impl CommitError for CallbackError {}

#[derive(Debug, thiserror::Error)]
pub enum PublishError {
    #[error("{op} {path}")]
    Io {
        op: &'static str,
        path: PathBuf,
        source: std::io::Error,
    },
    /// The worker left something other than one regular file with one link as output
    /// `index` (the tool's result is at fault): nothing was published.
    #[error("staged output {path} rejected: output {index}: {reason}")]
    BadOutput {
        path: PathBuf,
        index: usize,
        reason: OutputFault,
    },
    /// The caller's commit (the session store's write) failed; its error is kept.
    #[error("commit failed")]
    Commit(#[source] CallbackError),
    /// The caller's commit cannot tell whether its commit point is durable
    /// ([`CommitError::undecided`]): nothing was rolled back; the job dir is left for
    /// recovery at the next start.
    #[error("the commit may or may not be durable; the job dir is left for recovery at the next start, which completes or rolls back the job by what is on disk")]
    CommitUndecided(#[source] CallbackError),
    /// The job spec cannot become a job dir (bad id, targets not normalized or overlapping).
    #[error("invalid job: {reason}")]
    InvalidSpec { reason: SpecError },
    /// A target (or one of its parents) changed between resolution and publication.
    #[error("target {path} changed: {reason}")]
    TargetChanged { path: PathBuf, reason: Change },
    /// An in-out target was changed by someone else between the copy the worker edited and
    /// its publication: publishing would lose that change, so nothing is published.
    #[error("{path} was changed by someone else while the tool edited its copy ({what}); nothing was published")]
    Conflict { path: PathBuf, what: Conflict },
    /// An in-out target cannot be given to the worker as a copy: nothing ran.
    #[error("in-out target {path} cannot be copied for the tool: {refusal}")]
    InOutCopy {
        path: PathBuf,
        refusal: copy::CopyRefusal,
    },
    /// Publication failed and so did the rollback: the targets may be mixed until startup
    /// recovery runs; the job dir and its journal are kept for it.
    #[error(
        "job {job}: {}; rollback failed too ({}); the job dir is kept for recovery",
        crate::report::chain(&**.error),
        crate::report::chain(&**.rollback)
    )]
    RollbackFailed {
        job: String,
        error: Box<PublishError>,
        rollback: Box<PublishError>,
    },
    /// The worker left more in its staging dir than its profile allows.
    #[error("the worker left {limit} in its staging dir, over the profile's [limits] {}; nothing was published", .limit.key())]
    StagingLimit { limit: StagingLimit },
    /// Startup recovery cannot bring a job dir to a boundary.
    #[error("recovery of job {job}")]
    Recovery {
        job: String,
        #[source]
        reason: RecoveryFault,
    },
    /// Startup recovery cannot tell whether a job committed: the session store's error.
    #[error(
        "recovery of job {job}: nothing was changed: cannot tell whether session {session} \
         committed (repair or restore that session's file in the state dir and start again; \
         recovery then completes or rolls back this job by itself)"
    )]
    Undecided {
        job: String,
        session: String,
        #[source]
        source: CallbackError,
    },
}

/// The limit of the profile's a worker's staging dir went over.
#[derive(Debug, Clone, Copy, PartialEq, Eq, thiserror::Error)]
pub enum StagingLimit {
    /// `staging_files`: entries of any kind beneath `stage/`.
    #[error("more than {max} files and directories")]
    Files { max: u64 },
    /// `staging_size`: apparent size of the regular files.
    #[error("more than {max} bytes of files")]
    Bytes { max: u64 },
}

impl StagingLimit {
    /// The `[limits]` key of the profile that sets it.
    pub fn key(&self) -> &'static str {
        match self {
            StagingLimit::Files { .. } => "staging_files",
            StagingLimit::Bytes { .. } => "staging_size",
        }
    }
}

/// What a job publishes.
#[derive(Debug, Clone)]
pub struct JobSpec {
    pub id: String,
    pub session: String,
    pub tool: String,
    /// Normalized paths relative to the workspace root, one per output parameter.
    pub targets: Vec<PathBuf>,
    /// The mode each published target gets (same order), as its parameter declares it;
    /// `None` (or missing): the mode of the regular file it replaces, else 0644. The daemon
    /// sets owner and mode itself: whatever the worker did, or the replaced file had, no
    /// published file carries setuid/setgid/sticky or group/other write.
    pub modes: Vec<Option<u32>>,
    /// What each target is (same order; missing: a file). A directory output's staged path
    /// is an empty directory the worker fills; its whole tree is checked, sealed and
    /// published by one rename.
    pub kinds: Vec<OutputKind>,
    /// The worker's own uid and gid, when it has one: the staging dirs become its, and the job
    /// dir lets it through (0711) to reach them.
    pub stage_owner: Option<(u32, u32)>,
    /// The profile's staging limits (entries, bytes), which bound the copy of an in-out
    /// directory before the worker runs; `None`: unbounded.
    pub staging_limits: Option<(u64, u64)>,
    /// Outputs up to this size are hashed (`None`: [`DEFAULT_HASH_LIMIT`]); an in-out
    /// directory's copy is hashed with the same bound.
    pub hash_limit: Option<u64>,
    /// Which targets are in-out (same order; missing: an output): the worker gets a private
    /// copy of the current target at the staged path (nothing when there is none), and the
    /// target changes only if the copy did, or is deleted if the copy was removed.
    pub inout: Vec<bool>,
}

/// What publication did to an in-out target.
#[derive(Debug, Clone, Copy, PartialEq, Eq, serde::Serialize)]
#[serde(rename_all = "snake_case")]
pub enum Edit {
    /// The worker changed its copy: the copy replaced the target (or created it).
    Changed,
    /// The copy is as it was (or there was none and still is none): nothing was published.
    Unchanged,
    /// The worker removed its copy: the target was deleted.
    Deleted,
}

/// Outputs up to this size are hashed unless the caller says otherwise.
pub const DEFAULT_HASH_LIMIT: u64 = 64 << 20;

/// What one target receives from a publication: for the `commit` audit event.
#[derive(Debug, Clone, PartialEq, Eq, serde::Serialize)]
pub struct Published {
    /// Relative to the workspace root.
    pub target: PathBuf,
    pub kind: OutputKind,
    /// A file's size; a directory's total bytes of regular files.
    pub size: u64,
    /// A directory's number of regular files (`None` for a file).
    pub files: Option<u64>,
    /// SHA-256 (hex) of the content (a directory: of its canonical manifest,
    /// [`MANIFEST_FORMAT`]); `None` above the hash limit (size and identity only).
    pub sha256: Option<String>,
    /// The file's identity (device, inode): the file the target now names (for a deleted
    /// in-out target, the file it named).
    pub id: FileId,
    /// For an in-out target, what publication did to it; `None` for an output.
    pub edit: Option<Edit>,
}

/// How startup recovery settled a job's targets.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Settled {
    /// Nothing was ever published (no journal, or `worker_running`).
    NeverPublished,
    /// Every target was brought back to its old file.
    RolledBack,
    /// The session holds the commit: every target keeps its new file.
    Completed,
    /// A quarantined dir of an earlier recovery (no job to settle; never touched again).
    Quarantine,
    /// Recovery could not prove the job dir disposable (its journal damaged, a target it
    /// cannot reach safely, ...): the dir is moved aside as it is, every backup in it, and
    /// no target is changed. The session keeps its version; the operator decides.
    Kept,
}

/// What startup recovery did with one leftover job dir.
#[derive(Debug, Clone)]
pub struct Recovered {
    pub job: String,
    /// The journal's session and tool, when it had one.
    pub session: Option<String>,
    pub tool: Option<String>,
    /// The journaled phase recovery found, when there was a journal.
    pub phase: Option<&'static str>,
    pub settled: Settled,
    pub action: String,
    /// Where the job dir was moved aside, when it could not be removed (or was kept).
    pub quarantined: Option<PathBuf>,
    /// Why the job dir was kept as it is ([`Settled::Kept`]).
    pub kept: Option<std::sync::Arc<Kept>>,
}

impl Recovered {
    /// A record with no journal information and no quarantine.
    pub fn bare(job: String, settled: Settled) -> Recovered {
        Recovered {
            job,
            session: None,
            tool: None,
            phase: None,
            settled,
            action: String::new(),
            quarantined: None,
            kept: None,
        }
    }
}

/// The failpoint before every mutation of this module (plus the in-process crash simulator
/// in unit tests).
fn fp(name: &'static str) -> std::io::Result<()> {
    #[cfg(test)]
    testsim::hit(name)?;
    crate::failpoint::hit(name)
}
