//! What the worker left, judged: each staged output checked and sealed, its fsync added to
//! the group that runs before the first rename, and what publication will do with each
//! target decided.

use super::*;

impl Job {
    /// Each staged file output's fsync joins `syncs` (a directory output is made durable
    /// here, by its `syncfs`).
    pub(super) fn validate_outputs(
        &mut self,
        syncs: &mut Syncs,
    ) -> Result<Vec<Decision>, PublishError> {
        let mut ids = Vec::with_capacity(self.journal.targets.len());
        let mut published = Vec::with_capacity(self.journal.targets.len());
        for (i, rec) in self.journal.targets.iter().enumerate() {
            let bad = |reason: OutputFault| PublishError::BadOutput {
                path: rec.target.clone(),
                index: i,
                reason,
            };
            let staged = self.dir.join(&rec.staged);
            let slot = Path::new(STAGE).join(i.to_string());
            let slot_fd = open_dir_beneath(self.fd.as_fd(), &slot).map_err(|e| match e {
                Errno::NOENT | Errno::LOOP | Errno::NOTDIR => {
                    bad(OutputFault::SlotGone { slot: slot.clone() })
                }
                e => io("open staging dir", &self.dir.join(&slot), e),
            })?;
            let name = rec.staged.file_name().unwrap_or(OsStr::new("output"));
            // An in-out copy the worker removed: the target is deleted (or, if there was
            // none, stays absent).
            if rec.inout
                && stat_at(slot_fd.as_fd(), name)
                    .map_err(|e| io("stat staged output", &staged, e))?
                    .is_none()
            {
                let (decision, edit) = match rec.origin {
                    Some(_) => (Decision::Delete, Edit::Deleted),
                    None => (Decision::Keep, Edit::Unchanged),
                };
                published.push(Published {
                    target: rec.target.clone(),
                    kind: rec.kind,
                    size: 0,
                    files: None,
                    sha256: None,
                    id: rec.origin.map_or(FileId::NONE, |o| o.id),
                    edit: Some(edit),
                });
                ids.push(decision);
                continue;
            }
            if rec.kind == OutputKind::Directory {
                let mode = match self.spec.modes.get(i).copied().flatten() {
                    Some(m) => m,
                    None => self.replaced_mode(&rec.target, rec.kind),
                };
                let published_len =
                    self.root_path.as_os_str().len() + 1 + rec.target.as_os_str().len();
                let tree = check_tree(
                    slot_fd.as_fd(),
                    name,
                    &staged,
                    published_len,
                    mode,
                    self.hash_limit,
                )
                .map_err(|r| match r {
                    Refused::Fault(reason) => bad(reason),
                    Refused::Failed(e) => e,
                })?;
                // An in-out copy whose manifest is the one it was given with is unchanged.
                let seeded = self.trees.get(i).and_then(Option::as_ref);
                let unchanged = rec.inout
                    && tree.manifest.is_some()
                    && seeded.is_some_and(|t| t.manifest == tree.manifest);
                let (id, edit, decision) = match (unchanged, rec.origin) {
                    (true, Some(o)) => (o.id, Some(Edit::Unchanged), Decision::Keep),
                    _ => (
                        tree.id,
                        rec.inout.then_some(Edit::Changed),
                        Decision::Publish(tree.id),
                    ),
                };
                published.push(Published {
                    target: rec.target.clone(),
                    kind: rec.kind,
                    size: tree.bytes,
                    files: Some(tree.files),
                    sha256: tree.manifest,
                    id,
                    edit,
                });
                ids.push(decision);
                continue;
            }
            // O_PATH first: learn the type without opening a FIFO or a device for reading.
            let pfd = open_beneath(slot_fd.as_fd(), name, OFlags::PATH).map_err(|e| match e {
                Errno::NOENT => bad(OutputFault::Missing),
                Errno::LOOP => bad(OutputFault::Symlink),
                e => io("open staged output", &staged, e),
            })?;
            let st =
                rustix::fs::fstat(pfd.as_fd()).map_err(|e| io("stat staged output", &staged, e))?;
            let ft = file_type(&st);
            if ft != FileType::RegularFile {
                return Err(bad(OutputFault::NotAFile(describe(ft))));
            }
            if nlink(&st) != 1 {
                return Err(bad(OutputFault::Links(nlink(&st))));
            }
            // An in-out copy the worker never touched (same file, same ctime: nothing can
            // set a ctime back). Read before sealing, which changes it.
            let untouched = rec.inout && rec.copy == Some(Origin::of(&st));
            // Owner and mode are the daemon's to set, before the file can be read or moved:
            // no setuid/setgid/sticky bit, no group or other write, the worker's uid gone.
            let mode = match self.spec.modes.get(i).copied().flatten() {
                Some(m) => m,
                None => self.replaced_mode(&rec.target, rec.kind),
            };
            mutate("publish.seal_output", &staged, || {
                seal(pfd.as_fd(), &st, mode)
            })?;
            let fd = open_beneath(slot_fd.as_fd(), name, OFlags::RDONLY | OFlags::NONBLOCK)
                .map_err(|e| io("open staged output", &staged, e))?;
            let st2 =
                rustix::fs::fstat(fd.as_fd()).map_err(|e| io("stat staged output", &staged, e))?;
            if FileId::of(&st2) != FileId::of(&st) {
                return Err(bad(OutputFault::Replaced));
            }
            let size = st2.st_size as u64;
            // A copy rewritten with the same bytes is unchanged too, if the target still is
            // what was copied (otherwise publication finds the conflict).
            let unchanged = rec.inout
                && (untouched
                    || rec.origin.is_some_and(|o| {
                        o.size == size && self.holds_same(&rec.target, o, fd.as_fd())
                    }));
            let sha256 = if size <= self.hash_limit {
                Some(hash(fd.as_fd()).map_err(|e| io("read staged output", &staged, e))?)
            } else {
                None
            };
            if !unchanged {
                syncs.push("publish.fsync_output", fd, &staged);
            }
            let (id, edit, decision) = match (unchanged, rec.origin) {
                (true, Some(o)) => (o.id, Some(Edit::Unchanged), Decision::Keep),
                _ => (
                    FileId::of(&st),
                    rec.inout.then_some(Edit::Changed),
                    Decision::Publish(FileId::of(&st)),
                ),
            };
            published.push(Published {
                target: rec.target.clone(),
                kind: rec.kind,
                size,
                files: None,
                sha256,
                id,
                edit,
            });
            ids.push(decision);
        }
        self.published = published;
        Ok(ids)
    }

    /// Whether `target` still is the file snapshot `origin` describes and holds the same
    /// bytes as `staged` (of the same size). Any doubt is "no".
    pub(super) fn holds_same(&self, target: &Path, origin: Origin, staged: BorrowedFd<'_>) -> bool {
        let Ok(fd) = open_beneath(self.root.as_fd(), target, OFlags::RDONLY | OFlags::NONBLOCK)
        else {
            return false;
        };
        match rustix::fs::fstat(fd.as_fd()) {
            Ok(st) if Origin::of(&st) == origin => {
                copy::same_content(fd.as_fd(), staged).unwrap_or(false)
            }
            _ => false,
        }
    }

    /// The permission bits a published output keeps from the regular file (or directory, for
    /// a directory output) at `target` it replaces, less setuid/setgid/sticky and group/other
    /// write; 0644 (a directory: 0755) for a new target (or one of another type, which
    /// publication then refuses as changed).
    pub(super) fn replaced_mode(&self, target: &Path, kind: OutputKind) -> u32 {
        let default = match kind {
            OutputKind::File => crate::policy::DEFAULT_OUTPUT_MODE,
            OutputKind::Directory => 0o755,
        };
        open_beneath(self.root.as_fd(), target, OFlags::PATH)
            .and_then(|fd| rustix::fs::fstat(fd.as_fd()))
            .ok()
            .filter(|st| file_type(st) == kind_type(kind))
            .map_or(default, |st| {
                st.st_mode & 0o7777 & !crate::policy::FORBIDDEN_OUTPUT_BITS
            })
    }
}
