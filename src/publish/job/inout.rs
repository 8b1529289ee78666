//! In-out targets at the job level: the private copy a worker gets, and the check that the
//! target is still what was copied.

use super::*;

/// Where an in-out target is, and where its copy goes.
pub(super) struct Seed<'a> {
    pub root: BorrowedFd<'a>,
    /// Relative to the workspace root.
    pub target: &'a Path,
    pub target_abs: PathBuf,
    /// The target's staging slot, and the copy's name in it.
    pub slot: BorrowedFd<'a>,
    pub base: &'a OsStr,
    pub staged_abs: PathBuf,
}

/// Gives in-out target `target` (`target_abs` for messages) to the worker: a private copy of
/// it in its staging slot under its own name, owned by the worker (`owner`) or the daemon,
/// mode 0600 plus the original's execute bits. Returns the target's snapshot, taken before
/// the copy, and the copy's, taken once it is the worker's; `(None, None)` when the target
/// does not exist (the worker finds nothing at the staged path).
pub(super) fn seed_copy(
    s: &Seed<'_>,
    spec: &JobSpec,
) -> Result<(Option<Origin>, Option<Origin>), PublishError> {
    let Seed {
        root,
        target,
        slot,
        base,
        ..
    } = *s;
    let (target_abs, staged_abs) = (s.target_abs.as_path(), s.staged_abs.as_path());
    let owner = spec.stage_owner;
    let max_bytes = spec.staging_limits.map(|(_, bytes)| bytes);
    let changed = |reason: Change| PublishError::TargetChanged {
        path: target_abs.to_path_buf(),
        reason,
    };
    // O_PATH first: learn the type without opening a FIFO or a device for reading.
    let pfd = match open_beneath(root, target, OFlags::PATH) {
        Ok(fd) => fd,
        Err(Errno::NOENT) => return Ok((None, None)),
        Err(e) => return Err(changed(Change::parent(target, e))),
    };
    let st = rustix::fs::fstat(pfd.as_fd()).map_err(|e| io("stat in-out target", target_abs, e))?;
    if file_type(&st) != FileType::RegularFile {
        return Err(changed(Change::NowA(describe(file_type(&st)))));
    }
    let origin = Origin::of(&st);
    // The copy counts against staging: refuse one over the limit before making it.
    if let Some(max) = max_bytes.filter(|max| origin.size > *max) {
        return Err(PublishError::InOutCopy {
            path: target_abs.to_path_buf(),
            refusal: copy::CopyRefusal::FileTooLarge {
                size: origin.size,
                max,
            },
        });
    }
    let src = open_beneath(root, target, OFlags::RDONLY | OFlags::NONBLOCK)
        .map_err(|e| io("open in-out target", target_abs, e))?;
    let now =
        rustix::fs::fstat(src.as_fd()).map_err(|e| io("stat in-out target", target_abs, e))?;
    if FileId::of(&now) != origin.id {
        return Err(changed(Change::ReplacedDuringRename));
    }
    let mode = (st.st_mode & 0o111) | 0o600;
    let dst = copy::copy_file(src.as_fd(), slot, base, mode, staged_abs)?;
    if let Some((uid, gid)) = owner {
        mutate("publish.chown_stage", staged_abs, || {
            rustix::fs::fchown(
                dst.as_fd(),
                Some(rustix::process::Uid::from_raw(uid)),
                Some(rustix::process::Gid::from_raw(gid)),
            )
        })?;
    }
    let cst = rustix::fs::fstat(dst.as_fd()).map_err(|e| io("stat in-out copy", staged_abs, e))?;
    Ok((Some(origin), Some(Origin::of(&cst))))
}

/// Gives in-out directory `target` to the worker: a private copy of the tree in its slot
/// ([`copy::copy_tree`]), bounded by the spec's staging limits. `None` when the target does
/// not exist (the worker finds nothing at the staged path). A tree that cannot be copied is
/// [`PublishError::InOutCopy`].
pub(super) fn seed_tree(
    s: &Seed<'_>,
    spec: &JobSpec,
    declared_mode: Option<u32>,
) -> Result<Option<copy::TreeOrigin>, PublishError> {
    let Seed {
        root,
        target,
        slot,
        base,
        ..
    } = *s;
    let (target_abs, staged_abs) = (s.target_abs.as_path(), s.staged_abs.as_path());
    let src = match open_dir_beneath(root, target) {
        Ok(fd) => fd,
        Err(Errno::NOENT) => return Ok(None),
        Err(e) => {
            return Err(PublishError::TargetChanged {
                path: target_abs.to_path_buf(),
                reason: Change::parent(target, e),
            })
        }
    };
    let st =
        rustix::fs::fstat(src.as_fd()).map_err(|e| io("stat in-out directory", target_abs, e))?;
    let (max_entries, max_bytes) = spec.staging_limits.unwrap_or((u64::MAX, u64::MAX));
    let how = copy::TreeCopy {
        owner: spec.stage_owner,
        max_entries,
        max_bytes,
        hash_limit: spec
            .hash_limit
            .unwrap_or(crate::publish::DEFAULT_HASH_LIMIT),
        top_mode: declared_mode
            .unwrap_or(st.st_mode & 0o7777 & !crate::policy::FORBIDDEN_OUTPUT_BITS),
    };
    match copy::copy_tree(src.as_fd(), target_abs, slot, base, staged_abs, &how) {
        Ok(t) => Ok(Some(t)),
        Err(Ok(refusal)) => Err(PublishError::InOutCopy {
            path: target_abs.to_path_buf(),
            refusal,
        }),
        Err(Err(e)) => Err(e),
    }
}

/// The snapshot of what `target` holds now, if anything; a symlink, or a parent that cannot
/// be reached beneath the root, reads as nothing (an in-out target then conflicts).
pub(super) fn current(root: BorrowedFd<'_>, target: &Path) -> Option<Origin> {
    let fd = open_beneath(root, target, OFlags::PATH).ok()?;
    rustix::fs::fstat(fd.as_fd()).ok().map(|st| Origin::of(&st))
}

/// An in-out target must still be what its copy was taken from (nothing, if it had none):
/// anything else is a [`PublishError::Conflict`]. Outputs pass.
/// For an in-out directory (`tree`, its snapshot), every entry beneath the top is compared
/// too, walking the target beneath `root`.
pub(super) fn check_origin(
    rec: &TargetRecord,
    now: Option<&Origin>,
    target_abs: &Path,
    tree: Option<&copy::TreeOrigin>,
    root: BorrowedFd<'_>,
) -> Result<(), PublishError> {
    if !rec.inout {
        return Ok(());
    }
    let what = match (rec.origin, now) {
        (None, None) => return Ok(()),
        (None, Some(_)) => Conflict::Created,
        (Some(_), None) => Conflict::Removed,
        (Some(o), Some(n)) => match o.differs(n) {
            None => {
                let Some(tree) = tree else { return Ok(()) };
                let fd = open_dir_beneath(root, &rec.target)
                    .map_err(|e| io("open in-out directory", target_abs, e))?;
                match copy::tree_differs(fd.as_fd(), target_abs, tree, false)? {
                    None => return Ok(()),
                    Some(c) => c,
                }
            }
            Some(c) => c,
        },
    };
    Err(PublishError::Conflict {
        path: target_abs.to_path_buf(),
        what,
    })
}
