//! Rollback by identity, in process and in recovery: every target brought back to what it
//! held before publication.

use super::*;

/// Brings every target of a journaled job back to its old state, deciding by identity what
/// each target holds now: the new file is swapped back with its backup (or unlinked if the
/// target did not exist); anything else (the old file, nothing, someone else's file) is left.
/// Then removes the parents publication created, if empty, in reverse order. Idempotent, and
/// every mutation is a failpoint, so a crash inside it is recovered by running it again.
/// Returns how many targets it restored, and the targets it could not reach safely (a parent
/// now a symlink, not a directory, on another mount): those are left as they are, and their
/// backups (in the job dir) must be kept.
pub(in crate::publish) fn rollback(
    root: BorrowedFd<'_>,
    root_path: &Path,
    job_fd: BorrowedFd<'_>,
    job_dir: &Path,
    journal: &Journal,
) -> Result<Rolled, PublishError> {
    let mut out = Rolled {
        restored: 0,
        unreached: Vec::new(),
    };
    if journal.phase == Phase::WorkerRunning {
        return Ok(out);
    }
    // An undo's: the dirs it removed come back first (shallowest first), so that what it
    // took out of them can go back.
    for dir in journal.removed_dirs.iter().rev() {
        let abs = root_path.join(dir);
        let Some((pfd, name)) = reachable_parent(root, root_path, dir)? else {
            continue;
        };
        match mutate("publish.rollback_mkdir", &abs, || {
            rustix::fs::mkdirat(pfd.as_fd(), name, Mode::from_raw_mode(0o777))
        }) {
            Ok(()) => fsync_dir(pfd.as_fd(), &abs)?,
            Err(PublishError::Io { source, .. }) if source.raw_os_error() == Some(libc::EEXIST) => {
            }
            Err(e) => return Err(e),
        }
    }
    for rec in journal.targets.iter().rev() {
        if rec.delete {
            restore_deleted(root, root_path, job_fd, job_dir, rec, &mut out)?;
            continue;
        }
        let Some(new) = rec.new else { continue };
        let target_abs = root_path.join(&rec.target);
        let Some((parent, name)) = split_target(&rec.target) else {
            continue;
        };
        let pfd = match open_dir_beneath(root, parent) {
            Ok(fd) => fd,
            // No parent: the target cannot hold our file.
            Err(Errno::NOENT) => continue,
            // Never renamed: its staged file is still there; nothing to restore.
            Err(Errno::LOOP | Errno::NOTDIR | Errno::XDEV) if still_staged(job_fd, rec, new) => {
                continue
            }
            Err(e @ (Errno::LOOP | Errno::NOTDIR | Errno::XDEV)) => {
                tracing::warn!(target = %target_abs.display(), reason = %Change::parent(parent, e), "cannot reach target safely; left as is");
                out.unreached.push(Unreached {
                    target: target_abs,
                    reason: Change::parent(parent, e),
                });
                continue;
            }
            Err(e) => return Err(io("open target dir", &root_path.join(parent), e)),
        };
        let now = stat_at(pfd.as_fd(), name).map_err(|e| io("stat target", &target_abs, e))?;
        if now.as_ref().map(FileId::of) != Some(new) {
            continue;
        }
        match rec.old {
            Some(_) => {
                let backup = rec.backup.as_ref().unwrap_or(&rec.staged);
                let backup_abs = job_dir.join(backup);
                let (bdir, bname) = split_target(backup).ok_or_else(|| PublishError::Io {
                    op: "locate backup",
                    path: backup_abs.clone(),
                    source: std::io::Error::other("journal names no backup file"),
                })?;
                let bfd = open_dir_beneath(job_fd, bdir)
                    .map_err(|e| io("open backup dir", &job_dir.join(bdir), e))?;
                mutate("publish.rollback_exchange", &target_abs, || {
                    rustix::fs::renameat_with(
                        bfd.as_fd(),
                        bname,
                        pfd.as_fd(),
                        name,
                        RenameFlags::EXCHANGE,
                    )
                })?;
                fsync_dir(bfd.as_fd(), &backup_abs)?;
            }
            None if rec.kind == OutputKind::Directory || rec.undo => {
                // A new tree goes back where it was staged, whole (its slot is still there:
                // the job dir is removed only once the targets are settled); so does what an
                // undo put back, the only copy of the undone job's backup.
                let staged_abs = job_dir.join(&rec.staged);
                let (sdir, sname) = split_target(&rec.staged).ok_or_else(|| PublishError::Io {
                    op: "locate staged dir",
                    path: staged_abs.clone(),
                    source: std::io::Error::other("journal names no staged dir"),
                })?;
                let sfd = open_dir_beneath(job_fd, sdir)
                    .map_err(|e| io("open staging dir", &job_dir.join(sdir), e))?;
                mutate("publish.rollback_rename", &target_abs, || {
                    rustix::fs::renameat_with(
                        pfd.as_fd(),
                        name,
                        sfd.as_fd(),
                        sname,
                        RenameFlags::NOREPLACE,
                    )
                })?;
                fsync_dir(sfd.as_fd(), &staged_abs)?;
            }
            None => {
                mutate("publish.rollback_unlink", &target_abs, || {
                    rustix::fs::unlinkat(pfd.as_fd(), name, AtFlags::empty())
                })?;
            }
        }
        fsync_dir(pfd.as_fd(), &target_abs)?;
        out.restored += 1;
    }
    for dir in journal.created_dirs.iter().rev() {
        let abs = root_path.join(dir);
        let Some((pfd, name)) = reachable_parent(root, root_path, dir)? else {
            continue;
        };
        if remove_empty_dir("publish.rollback_rmdir", pfd.as_fd(), name, &abs)? {
            fsync_dir(pfd.as_fd(), &abs)?;
        }
    }
    Ok(out)
}

/// Rollback of a deleted in-out target: if its backup holds the old file (identity `old`)
/// and the target is free, the file goes back with `RENAME_NOREPLACE`. A backup that does not
/// hold it was never moved (nothing to do); a target someone created meanwhile, or one that
/// cannot be reached safely, is left as it is and reported, so the backup is kept.
fn restore_deleted(
    root: BorrowedFd<'_>,
    root_path: &Path,
    job_fd: BorrowedFd<'_>,
    job_dir: &Path,
    rec: &TargetRecord,
    out: &mut Rolled,
) -> Result<(), PublishError> {
    let Some(old) = rec.old else { return Ok(()) };
    let target_abs = root_path.join(&rec.target);
    let backup = rec.backup.as_ref().unwrap_or(&rec.staged);
    let (Some((parent, name)), Some((bdir, bname))) =
        (split_target(&rec.target), split_target(backup))
    else {
        return Ok(());
    };
    let bfd = match open_dir_beneath(job_fd, bdir) {
        Ok(fd) => fd,
        Err(Errno::NOENT) => return Ok(()),
        Err(e) => return Err(io("open backup dir", &job_dir.join(bdir), e)),
    };
    let moved =
        stat_at(bfd.as_fd(), bname).map_err(|e| io("stat backup", &job_dir.join(backup), e))?;
    if moved.as_ref().map(FileId::of) != Some(old) {
        return Ok(());
    }
    let pfd = match open_dir_beneath(root, parent) {
        Ok(fd) => fd,
        Err(e @ (Errno::NOENT | Errno::LOOP | Errno::NOTDIR | Errno::XDEV)) => {
            out.unreached.push(Unreached {
                target: target_abs,
                reason: Change::parent(parent, e),
            });
            return Ok(());
        }
        Err(e) => return Err(io("open target dir", &root_path.join(parent), e)),
    };
    match mutate("publish.rollback_restore", &target_abs, || {
        rustix::fs::renameat_with(
            bfd.as_fd(),
            bname,
            pfd.as_fd(),
            name,
            RenameFlags::NOREPLACE,
        )
    }) {
        Ok(()) => {}
        Err(PublishError::Io { source, .. }) if source.raw_os_error() == Some(libc::EEXIST) => {
            let now = stat_at(pfd.as_fd(), name)
                .ok()
                .flatten()
                .map_or("a file", |st| describe(file_type(&st)));
            out.unreached.push(Unreached {
                target: target_abs,
                reason: Change::Appeared(now),
            });
            return Ok(());
        }
        Err(e) => return Err(e),
    }
    fsync_dir(pfd.as_fd(), &target_abs)?;
    fsync_dir(bfd.as_fd(), &job_dir.join(backup))?;
    out.restored += 1;
    Ok(())
}

/// Whether target `rec`'s staged path still holds its new file (identity `new`): then it was
/// never renamed to the target, which cannot hold it.
fn still_staged(job_fd: BorrowedFd<'_>, rec: &TargetRecord, new: FileId) -> bool {
    let Some((dir, name)) = split_target(&rec.staged) else {
        return false;
    };
    let Ok(fd) = open_dir_beneath(job_fd, dir) else {
        return false;
    };
    matches!(stat_at(fd.as_fd(), name), Ok(Some(st)) if FileId::of(&st) == new)
}

/// What [`rollback`] did.
#[derive(Debug)]
pub(in crate::publish) struct Rolled {
    pub restored: usize,
    /// Targets it could not reach safely, left as they are (their backups are still in the
    /// job dir).
    pub unreached: Vec<Unreached>,
}

/// A target whose parent can no longer be reached beneath the root without following a
/// symlink or leaving the mount.
#[derive(Debug, Clone)]
pub struct Unreached {
    /// Absolute path of the target.
    pub target: PathBuf,
    /// Which parent and why (`x is now a symlink`).
    pub reason: Change,
}

/// The journaled targets a rollback could not reach safely, found without changing
/// anything: recovery keeps the whole job as it is when there is any.
pub(in crate::publish) fn unreachable_targets(
    root: BorrowedFd<'_>,
    root_path: &Path,
    job_fd: BorrowedFd<'_>,
    journal: &Journal,
) -> Vec<Unreached> {
    let mut out = Vec::new();
    for rec in &journal.targets {
        // A deleted target's parent is checked when its rollback runs (`restore_deleted`).
        let Some(new) = rec.new else { continue };
        let Some((parent, _)) = split_target(&rec.target) else {
            continue;
        };
        if let Err(e @ (Errno::LOOP | Errno::NOTDIR | Errno::XDEV)) = open_dir_beneath(root, parent)
        {
            if still_staged(job_fd, rec, new) {
                continue;
            }
            out.push(Unreached {
                target: root_path.join(&rec.target),
                reason: Change::parent(parent, e),
            });
        }
    }
    out
}

/// The open parent of a journaled dir and the dir's name, or `None` when the parent is not
/// reachable beneath the root any more (gone, a symlink, not a dir, another mount): such a
/// dir is not ours to touch.
pub(super) fn reachable_parent<'d>(
    root: BorrowedFd<'_>,
    root_path: &Path,
    dir: &'d Path,
) -> Result<Option<(OwnedFd, &'d OsStr)>, PublishError> {
    let Some((parent, name)) = split_target(dir) else {
        return Ok(None);
    };
    match open_dir_beneath(root, parent) {
        Ok(fd) => Ok(Some((fd, name))),
        Err(Errno::NOENT | Errno::LOOP | Errno::NOTDIR | Errno::XDEV) => Ok(None),
        Err(e) => Err(io("open parent dir", &root_path.join(parent), e)),
    }
}

/// Removes the journaled dir `name` in `parent` (at `abs`) if it is empty, through the
/// failpoint `op`: whether it went. One gone already, or no longer ours to remove (not empty,
/// not a directory: someone put something there since), stays.
pub(super) fn remove_empty_dir(
    op: &'static str,
    parent: BorrowedFd<'_>,
    name: &OsStr,
    abs: &Path,
) -> Result<bool, PublishError> {
    match mutate(op, abs, || {
        rustix::fs::unlinkat(parent, name, AtFlags::REMOVEDIR)
    }) {
        Ok(()) => Ok(true),
        Err(PublishError::Io { source, .. })
            if matches!(
                source.raw_os_error(),
                Some(libc::ENOENT | libc::ENOTEMPTY | libc::EEXIST | libc::ENOTDIR)
            ) =>
        {
            Ok(false)
        }
        Err(e) => Err(e),
    }
}
