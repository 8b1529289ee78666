//! A job's undo data at its commit, and an undo as a job of its own.
//!
//! A job asked to keep undo data ([`Job::keep_undo`]) writes its record after its renames and
//! before its commit point, if its backups fit the bound, and moves them into it right after
//! the commit (`super::super::undo`). An undo ([`Job::undo`]) is a job whose staged files are
//! the undone job's backups: its journal records, per target, what the undone job left there
//! as the in-out snapshot the target must still match (`origin`, and a directory's entries),
//! so that publication, rollback and recovery are the ones every job has.

use super::super::undo::{
    backup_name, drop_generation_at, drop_generations_at, find, generation_dir, keep_backups,
    snapshot_tree, write_record, Before, UndoRecord, UndoTarget, Unusable, UNDO_DIR,
};
use super::rollback::{reachable_parent, remove_empty_dir};
use super::*;

/// What a job keeps for its undo, asked before its publication.
#[derive(Debug, Clone)]
pub struct UndoKeep {
    /// `undo_bytes`: the most its backups may hold together (0: keep nothing).
    pub limit: u64,
    pub version_before: u64,
    /// The session state before the job.
    pub state_before: serde_json::Map<String, serde_json::Value>,
}

/// Whether a committed job kept undo data.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum UndoStatus {
    /// Its record is written (before the commit point) and its backups kept.
    Kept,
    /// It kept none, for this reason.
    NotKept(NotKept),
}

impl UndoStatus {
    pub fn kept(&self) -> bool {
        matches!(self, UndoStatus::Kept)
    }
}

/// Why a committed job kept no undo data.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum NotKept {
    /// Nobody asked (a job outside the daemon's calls).
    #[error("no undo data was asked for")]
    NotAsked,
    /// `undo_bytes = 0`.
    #[error("undo is off (undo_bytes = 0)")]
    Disabled,
    /// Its backups hold more than `undo_bytes`.
    #[error("backups exceed undo_bytes ({bytes} bytes > {limit})")]
    TooLarge { bytes: u64, limit: u64 },
    /// A directory output deeper than a snapshot goes.
    #[error("a directory output is too deep to snapshot")]
    TooDeep,
    /// Writing the record, or keeping a backup, failed (the job committed all the same).
    #[error("undo data could not be kept: {0}")]
    Failed(String),
    /// An undo is not undone in turn.
    #[error("an undo is not undoable")]
    IsUndo,
}

/// What an undo job takes from the generation it undoes, to give back if it fails.
#[derive(Debug, Clone)]
pub(in crate::publish) struct Taken {
    /// The generation's dir, relative to the root.
    pub dir: PathBuf,
    /// Per target index: the backup's name in the generation and its identity.
    pub backups: Vec<(usize, String, FileId)>,
}

impl Job {
    /// Asks the job to keep undo data at its commit (see the module doc).
    pub fn keep_undo(&mut self, keep: UndoKeep) {
        self.undo_keep = Some(keep);
    }

    /// After the renames, before the commit point: the undo record, if asked for and within
    /// the bound, written; its fsyncs are returned, for the caller to run with the renames'.
    /// A failure keeps none (the job still commits).
    pub(super) fn prepare_undo(&mut self) -> (UndoStatus, Syncs) {
        let mut syncs = Syncs::default();
        if self.taken.is_some() {
            return (UndoStatus::NotKept(NotKept::IsUndo), syncs);
        }
        let Some(keep) = self.undo_keep.take() else {
            return (UndoStatus::NotKept(NotKept::NotAsked), syncs);
        };
        if keep.limit == 0 {
            return (UndoStatus::NotKept(NotKept::Disabled), syncs);
        }
        let status = match self.undo_record(keep) {
            Ok(Ok(rec)) => match write_record(self.root.as_fd(), &self.root_path, &rec, &mut syncs)
            {
                Ok(slot) => {
                    self.undo_slot = Some(slot);
                    UndoStatus::Kept
                }
                Err(e) => {
                    tracing::warn!(job = %self.spec.id, error = %crate::report::chain(&e), "cannot write the undo record; the job will not be undoable");
                    syncs = Syncs::default();
                    UndoStatus::NotKept(NotKept::Failed(crate::report::chain(&e).to_string()))
                }
            },
            Ok(Err(why)) => UndoStatus::NotKept(why),
            Err(e) => UndoStatus::NotKept(NotKept::Failed(crate::report::chain(&e).to_string())),
        };
        (status, syncs)
    }

    /// Blanks the undo record this job wrote, which will not be used (its fsyncs or the
    /// job's failed). Best effort: a record left behind is not its session's latest
    /// commit's, so nothing uses it, and the slot's next write or the next start clears it.
    pub(super) fn drop_own_undo(&self) {
        let Some(slot) = self.undo_slot else {
            return;
        };
        if let Err(e) =
            drop_generation_at(self.root.as_fd(), &self.root_path, &self.spec.session, slot)
        {
            tracing::warn!(job = %self.spec.id, error = %crate::report::chain(&e), "cannot remove an unused undo record; the next start will");
        }
    }

    /// The undo record of the published job, or why there is none.
    fn undo_record(&self, keep: UndoKeep) -> Result<Result<UndoRecord, NotKept>, PublishError> {
        let root = self.root.as_fd();
        let mut targets = Vec::new();
        let mut bytes = 0u64;
        for (i, rec) in self.journal.targets.iter().enumerate() {
            if rec.new.is_none() && !rec.delete {
                continue;
            }
            let target_abs = self.root_path.join(&rec.target);
            let published = if rec.delete {
                None
            } else {
                let fd = open_beneath(root, &rec.target, OFlags::PATH)
                    .map_err(|e| io("open published target", &target_abs, e))?;
                let st = rustix::fs::fstat(fd.as_fd()).map_err(|e| io("stat", &target_abs, e))?;
                Some(copy::Origin::of(&st))
            };
            let tree = if rec.kind == OutputKind::Directory && !rec.delete {
                match snapshot_tree(root, &self.root_path, &rec.target)? {
                    Some(t) => Some(t),
                    None => return Ok(Err(NotKept::TooDeep)),
                }
            } else {
                None
            };
            let before = match (rec.old, &rec.backup) {
                (Some(id), Some(backup)) => {
                    let (bdir, bname) = split_target(backup)
                        .ok_or_else(|| io("locate backup", &self.dir.join(backup), Errno::INVAL))?;
                    let bfd = open_dir_beneath(self.fd.as_fd(), bdir)
                        .map_err(|e| io("open backup dir", &self.dir.join(bdir), e))?;
                    let babs = self.dir.join(backup);
                    let st = stat_at(bfd.as_fd(), bname)
                        .map_err(|e| io("stat backup", &babs, e))?
                        .ok_or_else(|| io("stat backup", &babs, Errno::NOENT))?;
                    bytes = bytes.saturating_add(if file_type(&st) == FileType::Directory {
                        usage(bfd.as_fd(), bname, &babs, u64::MAX, keep.limit)?.bytes
                    } else {
                        st.st_size as u64
                    });
                    let o = copy::Origin::of(&st);
                    Before::Backup {
                        name: backup_name(i),
                        id,
                        size: o.size,
                        mtime: o.mtime,
                    }
                }
                _ => Before::Absent,
            };
            if bytes > keep.limit {
                return Ok(Err(NotKept::TooLarge {
                    bytes,
                    limit: keep.limit,
                }));
            }
            targets.push(UndoTarget {
                target: rec.target.clone(),
                kind: rec.kind,
                published,
                tree,
                before,
            });
        }
        Ok(Ok(UndoRecord {
            version: 1,
            job: self.spec.id.clone(),
            session: self.spec.session.clone(),
            tool: self.spec.tool.clone(),
            version_before: keep.version_before,
            version_after: keep.version_before + 1,
            state_before: keep.state_before,
            targets,
            created_dirs: self.journal.created_dirs.clone(),
        }))
    }

    /// Right after the commit point, under the session's lock: the backups go into the
    /// generation (if one was written), and every other generation of the session goes.
    pub(super) fn after_commit_undo(&self, status: UndoStatus) -> UndoStatus {
        let (root, root_path) = (self.root.as_fd(), self.root_path.as_path());
        let session = &self.spec.session;
        let status = match status {
            UndoStatus::Kept => {
                match keep_backups(root, root_path, self.fd.as_fd(), &self.dir, &self.journal) {
                    Ok(true) => UndoStatus::Kept,
                    Ok(false) => UndoStatus::NotKept(NotKept::Failed("its record is gone".into())),
                    Err(e) => {
                        tracing::warn!(job = %self.spec.id, error = %crate::report::chain(&e), "committed, but cannot keep its backups; the job is not undoable");
                        UndoStatus::NotKept(NotKept::Failed(crate::report::chain(&e).to_string()))
                    }
                }
            }
            other => other,
        };
        let keep = self.undo_slot.filter(|_| status.kept());
        if let Err(e) = drop_generations_at(root, root_path, session, keep) {
            tracing::warn!(%session, error = %crate::report::chain(&e), "cannot remove older undo data; the next start will");
        }
        status
    }

    /// An undo of the job `rec` records, as job `id` of tool `tool`: its dir, each backup of
    /// the generation moved into its staging slot, its journal (not yet written). The caller
    /// holds the session's lock and the targets', and has checked that `rec`'s job is the
    /// session's latest commit, that its generation is complete ([`super::super::undo::load`])
    /// and that no target changed since ([`super::super::undo::changed`]); publication checks
    /// each target again just before its rename.
    pub fn undo(
        ws: &Workspace,
        id: &str,
        tool: &str,
        rec: &UndoRecord,
        hash_limit: u64,
    ) -> Result<Job, PublishError> {
        let n = rec.targets.len();
        let spec = JobSpec {
            id: id.to_string(),
            session: rec.session.clone(),
            tool: tool.to_string(),
            targets: rec.targets.iter().map(|t| t.target.clone()).collect(),
            modes: vec![None; n],
            kinds: rec.targets.iter().map(|t| t.kind).collect(),
            stage_owner: None,
            staging_limits: None,
            hash_limit: Some(hash_limit),
            inout: vec![true; n],
        };
        check_spec(&spec)?;
        let made_dir = NewJobDir::make(ws, id, 0o700)?;
        let NewJobDir { root, dir, .. } = &made_dir;
        let (slot, _) = find(ws.fd(), ws.root(), &rec.session, &rec.job).map_err(|e| {
            io(
                "find undo data",
                &ws.root().join(UNDO_DIR).join(&rec.session),
                match e {
                    Unusable::Missing => Errno::NOENT,
                    Unusable::Damaged(_) | Unusable::BackupGone { .. } => Errno::INVAL,
                },
            )
        })?;
        let gen_rel = generation_dir(&rec.session, slot);
        let gen_abs = ws.root().join(&gen_rel);
        let mut taken = Taken {
            dir: gen_rel.clone(),
            backups: Vec::new(),
        };
        let made = (|| {
            let (fd, stage_fd) = made_dir.open_with_stage()?;
            let stage = dir.join(STAGE);
            let gen = open_dir_beneath(root.as_fd(), &gen_rel)
                .map_err(|e| io("open undo dir", &gen_abs, e))?;
            let mut targets = Vec::with_capacity(n);
            let mut published = Vec::with_capacity(n);
            let mut taken_syncs = Syncs::default();
            for (i, t) in rec.targets.iter().enumerate() {
                let (slot, slot_path) = mkdir_slot(stage_fd.as_fd(), &stage, i)?;
                let slot_fd = open_dir_beneath(stage_fd.as_fd(), slot.as_str())
                    .map_err(|e| io("open staging dir", &slot_path, e))?;
                let base = t.target.file_name().unwrap_or(OsStr::new("output"));
                let staged = Path::new(STAGE).join(&slot).join(base);
                let staged_abs = dir.join(&staged);
                let (old, new, backup, delete) = match &t.before {
                    Before::Backup {
                        name: bname,
                        id: bid,
                        ..
                    } => {
                        mutate("publish.undo_take", &staged_abs, || {
                            rustix::fs::renameat_with(
                                gen.as_fd(),
                                bname.as_str(),
                                slot_fd.as_fd(),
                                base,
                                RenameFlags::NOREPLACE,
                            )
                        })?;
                        taken.backups.push((i, bname.clone(), *bid));
                        let st = stat_at(slot_fd.as_fd(), base)
                            .map_err(|e| io("stat backup", &staged_abs, e))?;
                        if st.as_ref().map(FileId::of) != Some(*bid) {
                            return Err(PublishError::TargetChanged {
                                path: staged_abs.clone(),
                                reason: Change::ReplacedDuringRename,
                            });
                        }
                        taken_syncs.push_dup("publish.fsync_taken", slot_fd.as_fd(), &slot_path)?;
                        published.push(restored(
                            slot_fd.as_fd(),
                            base,
                            &staged_abs,
                            t,
                            *bid,
                            hash_limit,
                        )?);
                        match t.published {
                            // Replaced by the job: exchanged back.
                            Some(p) => (Some(p.id), Some(*bid), Some(staged.clone()), false),
                            // Deleted by the job: renamed back.
                            None => (None, Some(*bid), None, false),
                        }
                    }
                    Before::Absent => {
                        // Created by the job: moved out, into the slot.
                        let p = t
                            .published
                            .ok_or_else(|| io("read undo record", &gen_abs, Errno::INVAL))?;
                        published.push(Published {
                            target: t.target.clone(),
                            kind: t.kind,
                            size: 0,
                            files: None,
                            sha256: None,
                            id: p.id,
                            edit: Some(Edit::Deleted),
                        });
                        (Some(p.id), None, Some(staged.clone()), true)
                    }
                };
                targets.push(TargetRecord {
                    target: t.target.clone(),
                    kind: t.kind,
                    staged,
                    backup,
                    old,
                    new,
                    inout: true,
                    origin: t.published,
                    copy: None,
                    delete,
                    undo: true,
                });
            }
            // The moves out of the generation durable, every dir they changed at once.
            if !taken.backups.is_empty() {
                taken_syncs.push("publish.fsync_taken", gen, &gen_abs);
            }
            taken_syncs.run()?;
            let journal = Journal {
                version: super::super::journal::VERSION_KINDS,
                job: id.to_string(),
                session: rec.session.clone(),
                tool: tool.to_string(),
                worker_pid: None,
                phase: Phase::WorkerRunning,
                targets,
                created_dirs: Vec::new(),
                removed_dirs: rec.created_dirs.iter().rev().cloned().collect(),
            };
            Ok((fd, journal, published))
        })();
        match made {
            Ok((fd, journal, published)) => Ok(Job {
                trees: rec.targets.iter().map(|t| t.tree.clone()).collect(),
                hash_limit,
                published,
                taken: Some(taken),
                ..made_dir.into_job(ws, spec, fd, journal)
            }),
            Err(e) => {
                give_back(root.as_fd(), ws.root(), dir, &taken, &rec.targets);
                made_dir.remove(id, "undo job");
                Err(e)
            }
        }
    }

    /// An undo's publication: its journal, then each target's rename (the in-out checks of
    /// [`Job::rename_one`] prove, just before it, that the target is still what the undone
    /// job left), then the undone job's created dirs removed if empty; returns the fsyncs
    /// that make them durable, as [`Job::publish`] does.
    pub(super) fn publish_undo(&mut self) -> Result<Syncs, PublishError> {
        self.journal.phase = Phase::PublishingOutputs;
        let mut journal = Syncs::default();
        self.write_journal(&mut journal)?;
        journal.run()?;
        let mut renamed = Syncs::default();
        for i in 0..self.journal.targets.len() {
            if let Some((parent_fd, slot_fd)) = self.rename_one(i)? {
                renamed.push("publish.fsync_renamed", parent_fd, &self.root_path);
                renamed.push("publish.fsync_renamed", slot_fd, &self.root_path);
            }
        }
        let root = self.root.as_fd();
        for d in &self.journal.removed_dirs {
            let abs = self.root_path.join(d);
            let Some((pfd, name)) = reachable_parent(root, &self.root_path, d)? else {
                continue;
            };
            if remove_empty_dir("publish.undo_rmdir", pfd.as_fd(), name, &abs)? {
                renamed.push("publish.fsync_renamed", pfd, &self.root_path);
            }
        }
        Ok(renamed)
    }

    /// After a failed undo was rolled back: the backups it took go back to their generation,
    /// so that the job stays undoable. Best effort: a backup that cannot go back leaves the
    /// generation incomplete, and the job not undoable.
    pub(super) fn give_back_taken(&self) {
        if let Some(taken) = &self.taken {
            let targets: Vec<PathBuf> = self.spec.targets.clone();
            give_back_into(
                self.root.as_fd(),
                &self.root_path,
                self.fd.as_fd(),
                &self.dir,
                taken,
                &targets,
            );
        }
    }
}

/// What an undo puts back at target `t`, as its `commit` event reports it.
fn restored(
    slot: BorrowedFd<'_>,
    base: &OsStr,
    abs: &Path,
    t: &UndoTarget,
    id: FileId,
    hash_limit: u64,
) -> Result<Published, PublishError> {
    let st = stat_at(slot, base)
        .map_err(|e| io("stat backup", abs, e))?
        .ok_or_else(|| io("stat backup", abs, Errno::NOENT))?;
    let (size, files, sha256) = if file_type(&st) == FileType::Directory {
        let u = usage(slot, base, abs, u64::MAX, u64::MAX)?;
        (u.bytes, Some(u.entries), None)
    } else {
        let size = st.st_size as u64;
        let sha = if size <= hash_limit {
            let fd = open_beneath(slot, base, OFlags::RDONLY | OFlags::NONBLOCK)
                .map_err(|e| io("open backup", abs, e))?;
            Some(hash(fd.as_fd()).map_err(|e| io("read backup", abs, e))?)
        } else {
            None
        };
        (size, None, sha)
    };
    Ok(Published {
        target: t.target.clone(),
        kind: t.kind,
        size,
        files,
        sha256,
        id,
        edit: None,
    })
}

/// Moves each backup an undo took from its slot back into its generation (if the slot still
/// holds it), then makes that durable. Best effort, logged.
fn give_back(
    root: BorrowedFd<'_>,
    root_path: &Path,
    job_dir: &Path,
    taken: &Taken,
    targets: &[UndoTarget],
) {
    let Ok(fd) = open_dir_beneath(root, job_dir.file_name().unwrap_or_default()) else {
        return;
    };
    let paths: Vec<PathBuf> = targets.iter().map(|t| t.target.clone()).collect();
    give_back_into(root, root_path, fd.as_fd(), job_dir, taken, &paths);
}

fn give_back_into(
    root: BorrowedFd<'_>,
    root_path: &Path,
    job_fd: BorrowedFd<'_>,
    job_dir: &Path,
    taken: &Taken,
    targets: &[PathBuf],
) {
    let gen_abs = root_path.join(&taken.dir);
    let Ok(gen) = open_dir_beneath(root, &taken.dir) else {
        return;
    };
    for (i, name, id) in &taken.backups {
        let Some(base) = targets.get(*i).and_then(|t| t.file_name()) else {
            continue;
        };
        let slot = Path::new(STAGE).join(i.to_string());
        let Ok(slot_fd) = open_dir_beneath(job_fd, &slot) else {
            continue;
        };
        let here = stat_at(slot_fd.as_fd(), base).ok().flatten();
        if here.as_ref().map(FileId::of) != Some(*id) {
            continue;
        }
        let moved = mutate("publish.undo_give_back", &gen_abs.join(name), || {
            rustix::fs::renameat_with(
                slot_fd.as_fd(),
                base,
                gen.as_fd(),
                name.as_str(),
                RenameFlags::NOREPLACE,
            )
        })
        .and_then(|()| fsync_dir(slot_fd.as_fd(), &job_dir.join(&slot)));
        if let Err(e) = moved {
            tracing::warn!(error = %crate::report::chain(&e), "cannot give a backup back to its undo data; the job is no longer undoable");
        }
    }
    if let Err(e) = fsync_dir(gen.as_fd(), &gen_abs) {
        tracing::warn!(error = %crate::report::chain(&e), "cannot make the undo data durable again");
    }
}
