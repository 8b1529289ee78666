//! One job: its dir, staging, publication into the workspace, the commit and rollback.

use std::collections::HashSet;
use std::ffi::OsStr;
use std::os::fd::{AsFd, BorrowedFd, OwnedFd};
use std::path::{Path, PathBuf};

use rustix::fs::{AtFlags, FileType, Mode, OFlags, RenameFlags};
use rustix::io::Errno;

use super::copy::{self, Conflict, Origin};
use super::journal::{Journal, Phase, TargetRecord, JOURNAL};
use super::staged_tree::{check_tree, Refused};
use super::sys::{
    describe, file_type, fsync_dir, io, mutate, nlink, open_beneath, open_dir_beneath,
    run_together_with, stat_at, FileId, Syncs,
};
use super::tree::{remove_tree, usage, Usage};
use super::workspace::{check_target, split_target};
use super::{
    Change, Edit, JobSpec, OutputFault, OutputKind, PublishError, Published, SpecError, Workspace,
    JOB_DIR_PREFIX, MAX_ID_LEN, STAGE,
};

mod inout;
mod rollback;
mod undo;
mod validate;

use inout::{check_origin, current, seed_copy, seed_tree, Seed};
pub use rollback::Unreached;
pub(super) use rollback::{rollback, unreachable_targets, Rolled};
pub use undo::{NotKept, UndoKeep, UndoStatus};

/// What a committed job's publication returns.
#[derive(Debug)]
pub struct Committed {
    /// Whether the job kept undo data.
    pub undo: UndoStatus,
    /// `false`: neither the journal's blank nor a `committed` journal could be made durable,
    /// so the disk may still hold a `publishing_outputs` journal, which recovery decides by
    /// the session: no later commit of the session may come before the next start.
    pub settled: bool,
}

pub struct Job {
    spec: JobSpec,
    /// Absolute path of `.airlock-job-<id>/`, for messages and for the caller.
    dir: PathBuf,
    /// `.airlock-job-<id>`, the dir's name in the workspace root.
    name: String,
    /// The workspace root (a dup of the workspace's fd, so that `discard` needs no workspace).
    root: OwnedFd,
    root_path: PathBuf,
    /// The job dir.
    fd: OwnedFd,
    /// What is on disk in `recovery.json` (or is about to be).
    journal: Journal,
    /// A reused dir's blank `recovery.json`, open read-write, until the journal is written
    /// over it.
    blank_journal: Option<std::fs::File>,
    /// `recovery.json`, once written ([`Journal::create`]): blanked when the job ends.
    journal_file: Option<std::fs::File>,
    /// Whether the dir's entry in the workspace root is durable, under some name: made so
    /// by the root's fsync before its first job's renames, and kept through the pool. Its
    /// renames to a job's name and back to an idle one are never made durable (recovery
    /// goes by the job its journal names).
    entry_durable: bool,
    /// Outputs up to this size are hashed (SHA-256) while they are validated.
    hash_limit: u64,
    /// What each target receives, once validated (same order as the targets).
    published: Vec<Published>,
    /// For an in-out directory, what it was when its copy was taken (same order); for an
    /// undo, what the undone job left.
    trees: Vec<Option<copy::TreeOrigin>>,
    /// Undo data to keep at the commit, if asked for ([`Job::keep_undo`]).
    undo_keep: Option<UndoKeep>,
    /// The slot of its session's undo data its record went into, once written.
    undo_slot: Option<&'static str>,
    /// An undo's: the backups it took from the undone job's undo data.
    taken: Option<undo::Taken>,
    /// Where the dir goes once the job ended, if it is fit for another job.
    pool: std::sync::Arc<super::pool::Pool>,
}

impl std::fmt::Debug for Job {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Job")
            .field("dir", &self.dir)
            .field("phase", &self.journal.phase)
            .finish_non_exhaustive()
    }
}

/// Checks a spec before anything is created: the id becomes a file name and the targets
/// become renames beneath the root.
fn check_spec(spec: &JobSpec) -> Result<(), PublishError> {
    let bad = |reason: SpecError| PublishError::InvalidSpec { reason };
    if spec.id.is_empty()
        || spec.id.len() > MAX_ID_LEN
        || !spec
            .id
            .bytes()
            .all(|b| b.is_ascii_alphanumeric() || b == b'-' || b == b'_')
    {
        return Err(bad(SpecError::BadId {
            id: spec.id.clone(),
        }));
    }
    let mut seen = HashSet::new();
    for t in &spec.targets {
        check_target(t).map_err(|error| {
            bad(SpecError::Target {
                target: t.clone(),
                error,
            })
        })?;
        if !seen.insert(t.as_path()) {
            return Err(bad(SpecError::Duplicate { target: t.clone() }));
        }
    }
    for a in &spec.targets {
        for b in &spec.targets {
            if a != b && b.starts_with(a) {
                return Err(bad(SpecError::Nested {
                    parent: a.clone(),
                    child: b.clone(),
                }));
            }
        }
    }
    Ok(())
}

/// Gives the (O_PATH) file `fd`, whose stat is `st`, to the daemon's euid and egid, then
/// `mode`. chmod goes through `/proc/self/fd`, since fchmod refuses O_PATH descriptors and
/// the file may not be openable as it is (mode 0000 under an unprivileged daemon). A file
/// the daemon already owns (a worker under the daemon's uid) is not chowned: the shipped
/// unit denies chown altogether (`SystemCallFilter=~@privileged`).
fn seal(fd: BorrowedFd<'_>, st: &rustix::fs::Stat, mode: u32) -> Result<(), Errno> {
    use std::os::fd::AsRawFd;
    let (euid, egid) = (rustix::process::geteuid(), rustix::process::getegid());
    if (st.st_uid, st.st_gid) != (euid.as_raw(), egid.as_raw()) {
        rustix::fs::chownat(fd, "", Some(euid), Some(egid), AtFlags::EMPTY_PATH)?;
    }
    rustix::fs::chmod(
        format!("/proc/self/fd/{}", fd.as_raw_fd()),
        Mode::from_raw_mode(mode & 0o755),
    )
}

/// A job dir just made, nothing in it yet: the workspace root (a dup of its fd), the dir's
/// name there and its path. A failure before it becomes a [`Job`] removes it
/// ([`NewJobDir::remove`]).
struct NewJobDir {
    root: OwnedFd,
    name: String,
    dir: PathBuf,
    /// The mode it was made with.
    mode: u32,
}

impl NewJobDir {
    /// Job `id`'s dir with `mode`, named but not yet there.
    fn named(ws: &Workspace, id: &str, mode: u32) -> Result<NewJobDir, PublishError> {
        let name = format!("{JOB_DIR_PREFIX}{id}");
        let root = ws.fd().try_clone_to_owned().map_err(|e| PublishError::Io {
            op: "dup workspace fd",
            path: ws.root().into(),
            source: e,
        })?;
        Ok(NewJobDir {
            root,
            dir: ws.root().join(&name),
            name,
            mode,
        })
    }

    /// Makes `.airlock-job-<id>/` with `mode` in the workspace root.
    fn make(ws: &Workspace, id: &str, mode: u32) -> Result<NewJobDir, PublishError> {
        let made = NewJobDir::named(ws, id, mode)?;
        mutate("publish.mkdir_job", &made.dir, || {
            rustix::fs::mkdirat(
                made.root.as_fd(),
                made.name.as_str(),
                Mode::from_raw_mode(mode),
            )
        })?;
        Ok(made)
    }

    /// Takes an idle job dir ([`super::pool`]) for job `id` and gives it `mode`: the dir, and
    /// its fd, its `stage/` fd (with `stage/0` in it) and its blank journal, if it has one.
    /// `None`: none is idle (or fit).
    fn reuse(
        ws: &Workspace,
        id: &str,
        mode: u32,
    ) -> Result<Option<(NewJobDir, super::pool::Taken)>, PublishError> {
        let made = NewJobDir::named(ws, id, mode)?;
        let Some(taken) = ws.pool().take(ws.fd(), ws.root(), &made.name) else {
            return Ok(None);
        };
        if mode & 0o077 != 0 {
            let set = mutate("publish.chmod_job", &made.dir, || {
                rustix::fs::fchmod(taken.fd.as_fd(), Mode::from_raw_mode(mode))
            });
            if let Err(e) = set {
                made.remove(id, "job");
                return Err(e);
            }
        }
        Ok(Some((made, taken)))
    }

    /// Opens the job dir, makes its `stage/` (0700) and opens that: (job dir, stage dir). A
    /// mode that lets others through (0711: a worker with its own uid) is set again, since
    /// mkdir's passed the umask (systemd's UMask=0077 makes it 0700, which would shut the
    /// worker out of its staging dir).
    fn open_with_stage(&self) -> Result<(OwnedFd, OwnedFd), PublishError> {
        let mode = self.mode;
        let dir = &self.dir;
        let fd = open_dir_beneath(self.root.as_fd(), &self.name)
            .map_err(|e| io("open job dir", dir, e))?;
        if mode & 0o077 != 0 {
            mutate("publish.chmod_job", dir, || {
                rustix::fs::fchmod(fd.as_fd(), Mode::from_raw_mode(mode))
            })?;
        }
        let stage = dir.join(STAGE);
        mutate("publish.mkdir_stage", &stage, || {
            rustix::fs::mkdirat(fd.as_fd(), STAGE, Mode::from_raw_mode(0o700))
        })?;
        let stage_fd =
            open_dir_beneath(fd.as_fd(), STAGE).map_err(|e| io("open stage dir", &stage, e))?;
        Ok((fd, stage_fd))
    }

    /// The job this dir is made for, now that it holds its stage (`fd`: the job dir) and
    /// `journal` is what it will write: nothing published yet, the default hash limit.
    fn into_job(self, ws: &Workspace, spec: JobSpec, fd: OwnedFd, journal: Journal) -> Job {
        Job {
            spec,
            dir: self.dir,
            name: self.name,
            root: self.root,
            root_path: ws.root().to_path_buf(),
            fd,
            journal,
            blank_journal: None,
            journal_file: None,
            entry_durable: false,
            hash_limit: super::DEFAULT_HASH_LIMIT,
            published: Vec::new(),
            trees: Vec::new(),
            undo_keep: None,
            undo_slot: None,
            taken: None,
            pool: ws.pool().clone(),
        }
    }

    /// Removes the half-made dir of job `id` (`what`: "job", "undo job"); what it cannot
    /// remove is logged and left to startup recovery.
    fn remove(&self, id: &str, what: &str) {
        if let Err(c) = remove_tree(self.root.as_fd(), OsStr::new(&self.name), &self.dir) {
            tracing::warn!(job = %id, error = %crate::report::chain(&c), "could not remove a half-made {what} dir; startup recovery will");
        }
    }
}

/// Makes target `i`'s slot, `stage/<i>` (0700), in the stage dir `stage_fd` (at `stage`):
/// its name and path.
fn mkdir_slot(
    stage_fd: BorrowedFd<'_>,
    stage: &Path,
    i: usize,
) -> Result<(String, PathBuf), PublishError> {
    let slot = i.to_string();
    let slot_path = stage.join(&slot);
    mutate("publish.mkdir_slot", &slot_path, || {
        rustix::fs::mkdirat(stage_fd, slot.as_str(), Mode::from_raw_mode(0o700))
    })?;
    Ok((slot, slot_path))
}

impl Job {
    /// Creates `.airlock-job-<id>/` (0700, or 0711 for a worker with its own uid) with its
    /// staging dir (the worker's, when it has its own uid). No journal and no fsync: until
    /// publication journals the job, recovery reads the dir as "never published" and only
    /// removes it, whether or not it survived a crash.
    pub fn create(ws: &Workspace, spec: JobSpec) -> Result<Job, PublishError> {
        check_spec(&spec)?;
        // No journal is written here any more, so nothing would notice a full filesystem
        // before the worker does (and many tools report ENOSPC vaguely): say it now.
        if rustix::fs::fstatvfs(ws.fd()).is_ok_and(|v| v.f_bavail == 0) {
            return Err(PublishError::Io {
                op: "check free space in the workspace",
                path: ws.root().into(),
                source: std::io::Error::from_raw_os_error(libc::ENOSPC),
            });
        }
        let job_mode = if spec.stage_owner.is_some() {
            0o711
        } else {
            0o700
        };
        // A job without outputs has no slot: an idle dir's would count against its staging
        // limit.
        let reusable = !spec.targets.is_empty();
        let taken = match reusable {
            true => NewJobDir::reuse(ws, &spec.id, job_mode)?,
            false => None,
        };
        let (made_dir, reused, blank_journal, entry_durable) = match taken {
            Some((made, t)) => (made, Some((t.fd, t.stage)), t.journal, t.entry_durable),
            None => (NewJobDir::make(ws, &spec.id, job_mode)?, None, None, false),
        };
        let NewJobDir { root, dir, .. } = &made_dir;
        let made = (|| {
            // A reused tree has its first slot already.
            let first_slot_made = reused.is_some();
            let (fd, stage_fd) = match reused {
                Some(fds) => fds,
                None => made_dir.open_with_stage()?,
            };
            let stage = dir.join(STAGE);
            let give = |dirfd: BorrowedFd<'_>, name: &str, path: &Path| match spec.stage_owner {
                None => Ok(()),
                Some((uid, gid)) => mutate("publish.chown_stage", path, || {
                    rustix::fs::chownat(
                        dirfd,
                        name,
                        Some(rustix::process::Uid::from_raw(uid)),
                        Some(rustix::process::Gid::from_raw(gid)),
                        AtFlags::SYMLINK_NOFOLLOW,
                    )
                }),
            };
            // The job dir (0711) lets the worker through, nobody else in. The staging dir
            // stays the daemon's, with the worker's group and 0770: the worker writes in it
            // (as its group) but cannot loosen its mode (not its owner), so no other uid
            // reaches the slots beneath it by path, whatever the worker does to the slots it
            // owns. A pooled dir serves later calls: nobody outside may ever have opened it.
            if let Some((_, gid)) = spec.stage_owner {
                mutate("publish.chown_stage", &stage, || {
                    rustix::fs::fchown(
                        stage_fd.as_fd(),
                        None,
                        Some(rustix::process::Gid::from_raw(gid)),
                    )?;
                    rustix::fs::fchmod(stage_fd.as_fd(), Mode::from_raw_mode(0o770))
                })?;
            }
            let mut targets = Vec::with_capacity(spec.targets.len());
            let mut trees = Vec::with_capacity(spec.targets.len());
            for (i, target) in spec.targets.iter().enumerate() {
                let (slot, slot_path) = if i == 0 && first_slot_made {
                    (
                        super::pool::KEPT_SLOT.to_string(),
                        stage.join(super::pool::KEPT_SLOT),
                    )
                } else {
                    mkdir_slot(stage_fd.as_fd(), &stage, i)?
                };
                give(stage_fd.as_fd(), slot.as_str(), &slot_path)?;
                let base = target.file_name().unwrap_or(OsStr::new("output"));
                let kind = spec.kinds.get(i).copied().unwrap_or_default();
                let inout = spec.inout.get(i).copied().unwrap_or(false);
                if kind == OutputKind::Directory && !inout {
                    // The worker fills an empty directory the daemon made (and gives it).
                    let slot_fd = open_dir_beneath(stage_fd.as_fd(), slot.as_str())
                        .map_err(|e| io("open staging dir", &slot_path, e))?;
                    let staged = slot_path.join(base);
                    mutate("publish.mkdir_staged_dir", &staged, || {
                        rustix::fs::mkdirat(slot_fd.as_fd(), base, Mode::from_raw_mode(0o700))
                    })?;
                    match spec.stage_owner {
                        None => {}
                        Some((uid, gid)) => mutate("publish.chown_stage", &staged, || {
                            rustix::fs::chownat(
                                slot_fd.as_fd(),
                                base,
                                Some(rustix::process::Uid::from_raw(uid)),
                                Some(rustix::process::Gid::from_raw(gid)),
                                AtFlags::SYMLINK_NOFOLLOW,
                            )
                        })?,
                    }
                }
                let mut tree = None;
                let (origin, copy) = if inout {
                    let slot_fd = open_dir_beneath(stage_fd.as_fd(), slot.as_str())
                        .map_err(|e| io("open staging dir", &slot_path, e))?;
                    let seed = Seed {
                        root: root.as_fd(),
                        target,
                        target_abs: ws.root().join(target),
                        slot: slot_fd.as_fd(),
                        base,
                        staged_abs: slot_path.join(base),
                    };
                    if kind == OutputKind::Directory {
                        let declared = spec.modes.get(i).copied().flatten();
                        tree = seed_tree(&seed, &spec, declared)?;
                        let origin = tree
                            .as_ref()
                            .and_then(|t| t.entries.first())
                            .map(|(_, o)| *o);
                        (origin, None)
                    } else {
                        seed_copy(&seed, &spec)?
                    }
                } else {
                    (None, None)
                };
                targets.push(TargetRecord {
                    kind,
                    target: target.clone(),
                    staged: Path::new(STAGE).join(&slot).join(base),
                    backup: None,
                    old: None,
                    new: None,
                    inout,
                    origin,
                    copy,
                    delete: false,
                    undo: false,
                });
                trees.push(tree);
            }
            let journal = Journal {
                version: Journal::version_for(&targets),
                job: spec.id.clone(),
                session: spec.session.clone(),
                tool: spec.tool.clone(),
                worker_pid: None,
                phase: Phase::WorkerRunning,
                targets,
                created_dirs: Vec::new(),
                removed_dirs: Vec::new(),
            };
            Ok((fd, journal, trees))
        })();
        match made {
            Ok((fd, journal, trees)) => Ok(Job {
                trees,
                entry_durable,
                blank_journal,
                ..made_dir.into_job(ws, spec, fd, journal)
            }),
            Err(e) => {
                made_dir.remove(&spec.id, "job");
                Err(e)
            }
        }
    }

    pub fn dir(&self) -> &Path {
        &self.dir
    }

    /// The directory the worker may write in.
    pub fn stage_dir(&self) -> PathBuf {
        self.dir.join(STAGE)
    }

    /// Absolute staged path of target `i`: `stage/<i>/<target's file name>`, so that tools
    /// which infer a format from the extension see the right one.
    pub fn staged_path(&self, i: usize) -> PathBuf {
        match self.journal.targets.get(i) {
            Some(rec) => self.dir.join(&rec.staged),
            None => self.stage_dir().join(i.to_string()).join("output"),
        }
    }

    /// Outputs up to `bytes` get their SHA-256 in [`Published`]; larger ones only their
    /// size and identity.
    pub fn hash_up_to(&mut self, bytes: u64) {
        self.hash_limit = bytes;
    }

    /// Records the worker's pid in the journal to be written at publication (the registry
    /// of live workers, not the journal, is what startup uses to kill leftovers).
    pub fn record_worker(&mut self, pid: u32) -> Result<(), PublishError> {
        self.journal.worker_pid = Some(pid);
        Ok(())
    }

    /// Validates and publishes every staged output, then runs `commit` (which writes the
    /// session state: the commit point), then cleans up. Any failure before the commit point
    /// restores every target.
    ///
    /// After `commit` returned Ok the call succeeds even if journaling `committed` or the
    /// cleanup fails: the state is the new one, and startup recovery finishes the cleanup.
    ///
    /// On `Err`, every target holds its old file and the job dir is gone, except for
    /// [`PublishError::RollbackFailed`]: then the job dir stays for startup recovery and the
    /// caller should treat the targets as unknown until it runs.
    pub fn publish_and_commit(
        self,
        commit: impl FnOnce() -> Result<(), super::CallbackError>,
    ) -> Result<(), PublishError> {
        self.publish_and_commit_with(|_| commit())
    }

    /// As [`Job::publish_and_commit`], handing `commit` what each target received (size,
    /// identity, SHA-256), read from the validated outputs before anything was renamed.
    /// `commit`'s error is the caller's own type; it comes back in [`PublishError::Commit`].
    pub fn publish_and_commit_with<E: super::CommitError>(
        self,
        commit: impl FnOnce(&[Published]) -> Result<(), E>,
    ) -> Result<(), PublishError> {
        self.publish_and_commit_undoable(|p, _| commit(p)).map(drop)
    }

    /// As [`Job::publish_and_commit_with`], for a job that may keep undo data
    /// ([`Job::keep_undo`]): `commit` is also told whether its record is written (before the
    /// commit point); returns whether the committed job kept it (keeping its backups after
    /// the commit point can still fail: then it did not).
    pub fn publish_and_commit_undoable<E: super::CommitError>(
        self,
        commit: impl FnOnce(&[Published], &UndoStatus) -> Result<(), E>,
    ) -> Result<UndoStatus, PublishError> {
        self.publish_and_commit_staged(|_, _| Ok::<(), E>(()), |p, u, ()| commit(p, u))
            .map(|c| c.undo)
    }

    /// As [`Job::publish_and_commit_undoable`], with the caller's own records that are due
    /// before the commit point written while publication's are made durable: `prepare` runs
    /// on the calling thread while the renames' and the undo record's fsyncs run, and what it
    /// returns goes to `commit` (the commit point), which runs only once both succeeded. A
    /// failure of either rolls the job back, as a failure of `commit` does. `prepare` is told
    /// the undo status as it stands before the undo record's fsyncs ran; `commit`, as it
    /// stands after them (an fsync that failed makes a `Kept` one `NotKept`).
    pub fn publish_and_commit_staged<S, E: super::CommitError>(
        mut self,
        prepare: impl FnOnce(&[Published], &UndoStatus) -> Result<S, E>,
        commit: impl FnOnce(&[Published], &UndoStatus, S) -> Result<(), E>,
    ) -> Result<Committed, PublishError> {
        let renamed = match self.publish() {
            Ok(renamed) => renamed,
            Err(e) => return Err(self.fail(e)),
        };
        // The renames' dirs, the undo record and the caller's records made durable together:
        // all are due before the commit point, and none orders another. A failure of the
        // renames' or the caller's fails the job; of the undo record's, only its undo.
        let (undo, undo_syncs) = self.prepare_undo();
        let (published, tentative) = (&self.published, &undo);
        let ([renamed, kept], prepared) =
            run_together_with([renamed, undo_syncs], || prepare(published, tentative));
        let prepared = match (renamed, prepared) {
            (Ok(()), Ok(staged)) => Ok(staged),
            (Err(e), _) => Err(e),
            (Ok(()), Err(e)) => Err(PublishError::Commit(e.into())),
        };
        let staged = match prepared {
            Ok(staged) => staged,
            Err(e) => {
                if undo.kept() {
                    self.drop_own_undo();
                }
                return Err(self.fail(e));
            }
        };
        let undo = match (undo, kept) {
            (UndoStatus::Kept, Err(e)) => {
                tracing::warn!(job = %self.spec.id, error = %crate::report::chain(&e), "cannot make the undo record durable; the job will not be undoable");
                self.drop_own_undo();
                UndoStatus::NotKept(NotKept::Failed(crate::report::chain(&e).to_string()))
            }
            (undo, _) => undo,
        };
        // The commit point: the caller persists the session state recording this job.
        if let Err(e) = commit(&self.published, &undo, staged) {
            if e.undecided() {
                // Neither rolled back nor finished: the journal stays `publishing_outputs`
                // and recovery asks the session store again at the next start.
                let e = PublishError::CommitUndecided(e.into());
                tracing::error!(job = %self.spec.id, error = %crate::report::chain(&e), "commit undecided; job dir left for recovery at the next start");
                return Err(e);
            }
            return Err(self.fail(PublishError::Commit(e.into())));
        }
        let undo = self.after_commit_undo(undo);
        self.journal.phase = Phase::Committed;
        // The blank of the journal is made durable here, under the session's lock: a
        // `publishing_outputs` journal left behind would make recovery ask the session again,
        // after later commits of it no longer record this job. If it cannot be blanked, it
        // is replaced by a `committed` one, and the dir left for startup recovery.
        let settled = match self.blank_journal() {
            Ok(()) => {
                if let Err(e) = self.retire() {
                    tracing::warn!(job = %self.spec.id, error = %crate::report::chain(&e), "committed, but could not remove the job dir; startup recovery will");
                }
                true
            }
            Err(e) => {
                tracing::warn!(job = %self.spec.id, error = %crate::report::chain(&e), "committed, but could not blank its journal; startup recovery will remove the job dir");
                match self.journal.write(self.fd.as_fd(), &self.dir) {
                    Ok(_) => true,
                    Err(e) => {
                        tracing::error!(job = %self.spec.id, error = %crate::report::chain(&e), "committed, but could not journal it; its session must take no later commit before the next start");
                        false
                    }
                }
            }
        };
        Ok(Committed { undo, settled })
    }

    /// Writes the job's journal ([`Journal::create`]), over the blank one of a reused dir if
    /// it has one; its fsyncs join `syncs`.
    fn write_journal(&mut self, syncs: &mut Syncs) -> Result<(), PublishError> {
        let blank = self.blank_journal.take();
        // The dir's entry in the root, durable before anything is published, unless it is
        // already (under whatever name: see `Journal::create`).
        let root = (!self.entry_durable).then(|| (self.root.as_fd(), self.root_path.as_path()));
        let file = self
            .journal
            .create(self.fd.as_fd(), &self.dir, root, blank, syncs)?;
        self.journal_file = Some(file);
        Ok(())
    }

    /// Blanks the journal, if one was written ([`Journal::blank`], durably): from then on the
    /// job dir reads as "never published".
    fn blank_journal(&self) -> Result<(), PublishError> {
        match &self.journal_file {
            Some(file) => Journal::blank(file, &self.dir.join(JOURNAL)),
            None => Ok(()),
        }
    }

    /// Ends a job whose targets are final (all-old after a rollback): the journal blanked
    /// and made durable first, so that a job dir left half-removed reads as "never
    /// published"; then the dir set aside or removed. The blank must be durable: a journal
    /// that came back after a power loss would be rolled back again by identity, and the
    /// inode numbers of the rolled-back new files are free for the files of later calls
    /// (a later commit of the same target could take the very number its journal names).
    fn remove_dir(&self) -> Result<(), PublishError> {
        self.blank_journal()?;
        self.retire()
    }

    /// Sets the job dir aside for a later job ([`super::pool`]), or removes it: once its
    /// journal is gone.
    fn retire(&self) -> Result<(), PublishError> {
        let kept = self.pool.keep(
            self.root.as_fd(),
            &self.root_path,
            &self.name,
            self.fd.as_fd(),
            self.entry_durable,
        );
        match kept {
            Ok(true) => return Ok(()),
            Ok(false) => {}
            Err(e) => {
                tracing::debug!(job = %self.spec.id, error = %crate::report::chain(&e), "cannot keep the job dir for reuse; removing it");
            }
        }
        remove_tree(self.root.as_fd(), OsStr::new(&self.name), &self.dir)
    }

    /// Measures what the worker left in its staging dir against the profile's
    /// `staging_files` (entries of any kind beneath `stage/`) and `staging_size` (apparent
    /// size of the regular files). Run after the worker is gone, before anything is
    /// published; `Err(StagingLimit)` fails the call.
    ///
    /// A worker running as the daemon's uid can take the permissions of its own job dir
    /// (`chmod 0 ..`); they are given back to the owner here, so that publication can reach
    /// the staged outputs.
    pub fn check_staging(&self, max_entries: u64, max_bytes: u64) -> Result<Usage, PublishError> {
        let st =
            rustix::fs::fstat(self.fd.as_fd()).map_err(|e| io("stat job dir", &self.dir, e))?;
        if st.st_mode & 0o700 != 0o700 {
            mutate("publish.cleanup_chmod", &self.dir, || {
                rustix::fs::fchmod(
                    self.fd.as_fd(),
                    Mode::from_raw_mode((st.st_mode & 0o7777) | 0o700),
                )
            })?;
        }
        let u = usage(
            self.fd.as_fd(),
            OsStr::new(STAGE),
            &self.stage_dir(),
            max_entries,
            max_bytes,
        )?;
        if u.entries > max_entries {
            return Err(PublishError::StagingLimit {
                limit: super::StagingLimit::Files { max: max_entries },
            });
        }
        if u.bytes > max_bytes {
            return Err(PublishError::StagingLimit {
                limit: super::StagingLimit::Bytes { max: max_bytes },
            });
        }
        Ok(u)
    }

    /// Removes the job dir of a call that will not publish (or sets it aside for reuse).
    pub fn discard(self) -> Result<(), PublishError> {
        self.retire()
    }

    /// Removes the job dir of a call that will not publish, never setting it aside: for a
    /// call whose worker's end was not confirmed, one of whose processes could still reach
    /// its staging dir (by its cwd, or its Landlock rule on that inode), which a later call
    /// must not be handed.
    pub fn discard_unpooled(self) -> Result<(), PublishError> {
        remove_tree(self.root.as_fd(), OsStr::new(&self.name), &self.dir)
    }

    /// Everything before the commit point but the fsyncs of the renames, which it returns
    /// for the caller to run with the other records due before the commit point: validate,
    /// journal (the job's one journal), make both durable, create parents, rename.
    fn publish(&mut self) -> Result<Syncs, PublishError> {
        if self.taken.is_some() {
            return self.publish_undo();
        }
        // 1. Validate every staged output before anything is journaled or moved: a bad
        //    output fails the call with the workspace untouched.
        let mut before_renames = Syncs::default();
        let news = self.validate_outputs(&mut before_renames)?;
        // 2. Plan: what each target holds now and which parents are missing. No mutation.
        let created = self.plan(&news)?;
        // 3. Journal the identities and the dirs to create before touching the workspace.
        self.journal.created_dirs = created;
        self.journal.phase = Phase::PublishingOutputs;
        self.write_journal(&mut before_renames)?;
        // 4. The outputs' data and the journal durable, together, before the first rename:
        //    none of them orders another, and a crash before the rename leaves the workspace
        //    untouched whichever of them survived.
        before_renames.run()?;
        self.entry_durable = true;
        // 5. Create missing parents, one component at a time beneath the root.
        let mut renamed = Syncs::default();
        for fd in self.make_parents()? {
            renamed.push("publish.fsync_renamed", fd, &self.root_path);
        }
        // 6. Rename each staged file into place.
        for i in 0..self.journal.targets.len() {
            if let Some((parent_fd, slot_fd)) = self.rename_one(i)? {
                renamed.push("publish.fsync_renamed", parent_fd, &self.root_path);
                renamed.push("publish.fsync_renamed", slot_fd, &self.root_path);
            }
        }
        // 7. The renames (and the mkdirs) must be durable before the commit point: a session
        //    that records this job must imply every target holds its new file. The caller
        //    runs them; from then on, only the session commit decides between all-new and
        //    all-old.
        Ok(renamed)
    }

    /// Records the new identities and what each target holds now; returns the parent dirs
    /// publication must create, in creation order.
    fn plan(&mut self, decisions: &[Decision]) -> Result<Vec<PathBuf>, PublishError> {
        let mut created: Vec<PathBuf> = Vec::new();
        let root = self.root.as_fd();
        for (i, (rec, decision)) in self.journal.targets.iter_mut().zip(decisions).enumerate() {
            let tree = self.trees.get(i).and_then(Option::as_ref);
            let target_abs = self.root_path.join(&rec.target);
            let changed = |reason: Change| PublishError::TargetChanged {
                path: target_abs.clone(),
                reason,
            };
            let new = match decision {
                Decision::Keep => continue,
                Decision::Delete => {
                    // The target must still be the file that was copied; it moves to the
                    // (empty) staged name, which is its backup until the commit.
                    let now = current(root, &rec.target);
                    check_origin(rec, now.as_ref(), &target_abs, tree, root)?;
                    rec.old = rec.origin.map(|o| o.id);
                    rec.backup = Some(rec.staged.clone());
                    rec.delete = true;
                    continue;
                }
                Decision::Publish(id) => id,
            };
            if rec.inout {
                check_origin(
                    rec,
                    current(root, &rec.target).as_ref(),
                    &target_abs,
                    tree,
                    root,
                )?;
            }
            let (parent, name) =
                split_target(&rec.target).ok_or_else(|| changed(Change::TargetHasNoName))?;
            let mut missing = false;
            let mut prefix = PathBuf::new();
            for comp in parent.iter() {
                prefix.push(comp);
                if missing || created.contains(&prefix) {
                    if !created.contains(&prefix) {
                        created.push(prefix.clone());
                    }
                    missing = true;
                    continue;
                }
                match open_beneath(root, &prefix, OFlags::PATH | OFlags::DIRECTORY) {
                    Ok(_) => {}
                    Err(Errno::NOENT) => {
                        created.push(prefix.clone());
                        missing = true;
                    }
                    Err(e) => return Err(changed(Change::parent(&prefix, e))),
                }
            }
            let old = if missing {
                None
            } else {
                let pfd = open_dir_beneath(root, parent)
                    .map_err(|e| changed(Change::parent(parent, e)))?;
                match stat_at(pfd.as_fd(), name).map_err(|e| io("stat target", &target_abs, e))? {
                    None => None,
                    Some(st) if file_type(&st) == kind_type(rec.kind) => Some(FileId::of(&st)),
                    Some(st) => return Err(changed(Change::NowA(describe(file_type(&st))))),
                }
            };
            rec.old = old;
            rec.backup = old.map(|_| rec.staged.clone());
            rec.new = Some(*new);
        }
        Ok(created)
    }

    /// Creates the journaled parent dirs; returns the fds of the dirs whose entries changed.
    fn make_parents(&self) -> Result<Vec<OwnedFd>, PublishError> {
        let root = self.root.as_fd();
        let mut touched = Vec::new();
        for dir in &self.journal.created_dirs {
            let abs = self.root_path.join(dir);
            let changed = |reason: Change| PublishError::TargetChanged {
                path: abs.clone(),
                reason,
            };
            let (parent, name) =
                split_target(dir).ok_or_else(|| changed(Change::NoDirectoryName))?;
            let pfd =
                open_dir_beneath(root, parent).map_err(|e| changed(Change::parent(parent, e)))?;
            match mutate("publish.mkdir_parent", &abs, || {
                rustix::fs::mkdirat(pfd.as_fd(), name, Mode::from_raw_mode(0o777))
            }) {
                Ok(()) => {}
                // Someone made it meanwhile: fine if it is a real directory.
                Err(PublishError::Io { source, .. })
                    if source.raw_os_error() == Some(libc::EEXIST) =>
                {
                    open_dir_beneath(pfd.as_fd(), name)
                        .map_err(|e| changed(Change::parent(dir, e)))?;
                }
                Err(e) => return Err(e),
            }
            touched.push(pfd);
        }
        Ok(touched)
    }

    /// Renames staged output `i` into place: RENAME_EXCHANGE over an existing target (the old
    /// file lands under the staged name: the backup), RENAME_NOREPLACE for a new one. Returns
    /// the target's parent fd and the staging slot fd, both to be fsynced.
    fn rename_one(&self, i: usize) -> Result<Option<(OwnedFd, OwnedFd)>, PublishError> {
        let rec = &self.journal.targets[i];
        if rec.new.is_none() && !rec.delete {
            // An in-out target left as it was: nothing to publish.
            return Ok(None);
        }
        let target_abs = self.root_path.join(&rec.target);
        let changed = |reason: Change| PublishError::TargetChanged {
            path: target_abs.clone(),
            reason,
        };
        let (parent, name) =
            split_target(&rec.target).ok_or_else(|| changed(Change::NoFileName))?;
        let pfd = open_dir_beneath(self.root.as_fd(), parent)
            .map_err(|e| changed(Change::parent(parent, e)))?;
        let slot = Path::new(STAGE).join(i.to_string());
        let slot_fd = open_dir_beneath(self.fd.as_fd(), &slot)
            .map_err(|e| io("open staging dir", &self.dir.join(&slot), e))?;
        let now = stat_at(pfd.as_fd(), name).map_err(|e| io("stat target", &target_abs, e))?;
        // An in-out target must still be what its copy was taken from, just before the
        // rename; and the file the rename took away (the backup) must still be that file
        // after it (a write through a descriptor opened earlier changes its mtime; the
        // rename itself changes only its ctime).
        let tree = self.trees.get(i).and_then(Option::as_ref);
        check_origin(
            rec,
            now.as_ref().map(Origin::of).as_ref(),
            &target_abs,
            tree,
            self.root.as_fd(),
        )?;
        let moved_unchanged = |slot_fd: BorrowedFd<'_>| -> Result<(), PublishError> {
            let (Some(origin), true) = (rec.origin, rec.inout) else {
                return Ok(());
            };
            let backup = self.dir.join(&rec.staged);
            let moved = stat_at(slot_fd, name).map_err(|e| io("stat backup", &backup, e))?;
            if let (Some(tree), Some(_)) = (tree, &moved) {
                let fd =
                    open_dir_beneath(slot_fd, name).map_err(|e| io("open backup", &backup, e))?;
                return match copy::tree_differs(fd.as_fd(), &backup, tree, true)? {
                    None => Ok(()),
                    Some(what) => Err(PublishError::Conflict {
                        path: target_abs.clone(),
                        what,
                    }),
                };
            }
            match moved.as_ref().map(Origin::of) {
                Some(m) if origin.differs(&m).is_none_or(|c| c == Conflict::Touched) => Ok(()),
                Some(m) => Err(PublishError::Conflict {
                    path: target_abs.clone(),
                    what: origin.differs(&m).unwrap_or(Conflict::Replaced),
                }),
                None => Err(PublishError::Conflict {
                    path: target_abs.clone(),
                    what: Conflict::Removed,
                }),
            }
        };
        if rec.delete {
            match mutate("publish.delete_inout", &target_abs, || {
                rustix::fs::renameat_with(
                    pfd.as_fd(),
                    name,
                    slot_fd.as_fd(),
                    name,
                    RenameFlags::NOREPLACE,
                )
            }) {
                Ok(()) => {}
                Err(PublishError::Io { source, .. })
                    if source.raw_os_error() == Some(libc::ENOENT) =>
                {
                    return Err(PublishError::Conflict {
                        path: target_abs.clone(),
                        what: Conflict::Removed,
                    })
                }
                Err(e) => return Err(e),
            }
            moved_unchanged(slot_fd.as_fd())?;
            return Ok(Some((pfd, slot_fd)));
        }
        match rec.old {
            Some(old) => {
                match &now {
                    Some(st) if FileId::of(st) == old => {}
                    Some(st) => return Err(changed(Change::Replaced(describe(file_type(st))))),
                    None => return Err(changed(Change::Removed)),
                }
                mutate("publish.exchange", &target_abs, || {
                    rustix::fs::renameat_with(
                        slot_fd.as_fd(),
                        name,
                        pfd.as_fd(),
                        name,
                        RenameFlags::EXCHANGE,
                    )
                })?;
                // The exchange is atomic on names; confirm it swapped the file we journaled
                // (otherwise rollback swaps back whatever it took).
                let backup = stat_at(slot_fd.as_fd(), name)
                    .map_err(|e| io("stat backup", &self.dir.join(&rec.staged), e))?;
                if backup.as_ref().map(FileId::of) != Some(old) {
                    if rec.inout {
                        return Err(PublishError::Conflict {
                            path: target_abs.clone(),
                            what: Conflict::Replaced,
                        });
                    }
                    return Err(changed(Change::ReplacedDuringRename));
                }
                moved_unchanged(slot_fd.as_fd())?;
            }
            None => {
                if let Some(st) = &now {
                    return Err(changed(Change::Appeared(describe(file_type(st)))));
                }
                match mutate("publish.rename_noreplace", &target_abs, || {
                    rustix::fs::renameat_with(
                        slot_fd.as_fd(),
                        name,
                        pfd.as_fd(),
                        name,
                        RenameFlags::NOREPLACE,
                    )
                }) {
                    Ok(()) => {}
                    Err(PublishError::Io { source, .. })
                        if source.raw_os_error() == Some(libc::EEXIST) =>
                    {
                        return Err(changed(Change::AppearedDuringRename))
                    }
                    Err(e) => return Err(e),
                }
            }
        }
        Ok(Some((pfd, slot_fd)))
    }

    /// Restores every target after a failure before the commit point, then removes the job
    /// dir. When the rollback itself fails, the job dir and its journal stay for startup
    /// recovery and the error says so.
    fn fail(self, error: PublishError) -> PublishError {
        match rollback(
            self.root.as_fd(),
            &self.root_path,
            self.fd.as_fd(),
            &self.dir,
            &self.journal,
        ) {
            // A target it could not reach still holds the new file, and its old one is in the
            // job dir: keep the dir for startup recovery (which keeps it aside if need be).
            Ok(Rolled { unreached, .. }) if !unreached.is_empty() => {
                let u = &unreached[0];
                tracing::error!(job = %self.spec.id, error = %crate::report::chain(&error), target = %u.target.display(), reason = %u.reason, "rollback cannot reach a target; job dir kept for startup recovery");
                PublishError::RollbackFailed {
                    job: self.spec.id.clone(),
                    error: Box::new(error),
                    rollback: Box::new(PublishError::TargetChanged {
                        path: u.target.clone(),
                        reason: Change::Unreachable(Box::new(u.reason.clone())),
                    }),
                }
            }
            Ok(Rolled { restored: n, .. }) => {
                tracing::info!(job = %self.spec.id, restored = n, error = %crate::report::chain(&error), "publication failed; targets restored");
                self.give_back_taken();
                if let Err(e) = self.remove_dir() {
                    tracing::warn!(job = %self.spec.id, error = %crate::report::chain(&e), "could not remove the job dir; startup recovery will");
                }
                error
            }
            Err(rollback) => {
                tracing::error!(job = %self.spec.id, error = %crate::report::chain(&error), rollback = %crate::report::chain(&rollback), "rollback failed; job dir kept for startup recovery");
                PublishError::RollbackFailed {
                    job: self.spec.id.clone(),
                    error: Box::new(error),
                    rollback: Box::new(rollback),
                }
            }
        }
    }
}

/// What publication does with one target, decided from what the worker left.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Decision {
    /// Put this staged file at the target.
    Publish(FileId),
    /// An in-out target whose copy the worker removed: delete the target.
    Delete,
    /// An in-out target whose copy is as it was: leave the target alone.
    Keep,
}

/// The file type a target of kind `kind` is.
fn kind_type(kind: OutputKind) -> FileType {
    match kind {
        OutputKind::File => FileType::RegularFile,
        OutputKind::Directory => FileType::Directory,
    }
}

/// SHA-256 (hex) of what `fd` holds, read from its start (a sealed staged output: the worker
/// can no longer write it).
pub(super) fn hash(fd: BorrowedFd<'_>) -> Result<String, Errno> {
    use sha2::Digest;
    let mut h = sha2::Sha256::new();
    let mut buf = vec![0u8; 256 * 1024];
    let mut off = 0u64;
    loop {
        let n = rustix::io::pread(fd, &mut buf, off)?;
        if n == 0 {
            break;
        }
        h.update(&buf[..n]);
        off += n as u64;
    }
    Ok(crate::audit::log::hex(&h.finalize()))
}
