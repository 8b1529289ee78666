//! Startup recovery: every leftover job dir is rolled back or completed, then removed (or,
//! if it cannot be removed, moved aside to a quarantine name). A job dir recovery cannot prove
//! disposable is never removed: it is moved aside as it is, backups and journal included.

use std::ffi::{OsStr, OsString};
use std::os::fd::AsFd;
use std::os::unix::ffi::OsStrExt;
use std::path::Path;

use rustix::fs::{AtFlags, FileType, RenameFlags};

use super::job::{rollback, unreachable_targets, Unreached};
use super::journal::{Journal, JournalError, Phase, JOURNAL, JOURNAL_TMP};
use super::sys::{file_type, fsync_dir, io, mutate, stat_at};
use super::tree::{open_repairing, remove_tree};
use super::{PublishError, Recovered, Settled, Workspace, JOB_DIR_PREFIX, QUARANTINE_PREFIX};

/// Rolls back or completes every leftover job dir in `workspace`. `committed(session, job)`
/// tells whether the session state holds that job's commit.
///
/// Decisions, by the journal:
/// * none (ENOENT) or a blank one (`null`), and nothing else in the dir but `stage/` (and a
///   journal's temp file): nothing was published, or the targets were settled before the
///   journal was blanked or dropped (backups exist only once the journal is durable, and it
///   is blanked only once they are settled); the dir is removed. An empty journal is not
///   blank: it is damaged.
/// * `worker_running`: nothing was published; the dir is removed.
/// * `publishing_outputs` (or `committing_state`, written by earlier versions): `committed`
///   decides: completed (backups dropped) or rolled back by identity.
/// * `committed`: completed.
/// * The job is the one the journal names, whatever the dir's name: a job dir taken from the
///   pool ([`super::pool`]) is renamed from its idle name to the job's without an fsync, so
///   after a power loss the dir holding a job's durable journal may still bear its idle name
///   or the name of an earlier job that used it.
/// * A journal that is there but damaged (unreadable, unparsable, another version), one
///   naming a job id that is not one or that another dir's journal already named, no
///   journal but other entries than staging, a dir that cannot be
///   opened, or a rollback that cannot reach a target safely (a parent swapped for a symlink):
///   recovery cannot prove the dir disposable. It changes no target (a rollback that meets an
///   unreachable target half-way keeps what it did), records an `error` event in the audit
///   log, renames the dir as it is to `.airlock-quarantine-<id>` and goes on ([`Kept`],
///   [`Settled::Kept`]); the log says what was kept and what to do.
///
/// Once a job's targets are settled its journal is unlinked first, so that whatever remains
/// of the dir reads as "never published". A dir that then cannot be removed (whatever the
/// worker left in it) is renamed to `.airlock-quarantine-<id>` too, logged and reported, and
/// recovery goes on: it holds nothing the workspace needs. Quarantined dirs of earlier runs
/// are never touched again (only reported, at each recovery): the operator removes them.
///
/// Every mutation is a failpoint; a crash inside recovery is recovered by running it again.
/// Job dirs are processed in name order. Recovery stops at the first job it cannot bring to
/// a boundary (its commit state cannot be established, its rollback fails, or it can be
/// neither removed nor moved aside): the daemon must not serve such a workspace.
pub fn recover(
    workspace: &Path,
    committed: &dyn Fn(&str, &str) -> Result<bool, super::CallbackError>,
) -> Result<Vec<Recovered>, PublishError> {
    recover_with(workspace, committed, &|_| {
        Ok::<(), std::convert::Infallible>(())
    })
}

/// As [`recover`], calling `settled` for each job once its targets are final and before its
/// journal is dropped (the audit records it there: a crash after `settled` makes the next
/// recovery settle the job, and call `settled`, again). An `Err` from `settled` stops
/// recovery like any other failure to bring a job to a boundary. The callbacks' errors are
/// the caller's own types; they come back as the `#[source]` of [`PublishError::Undecided`]
/// and [`RecoveryFault::NotRecorded`].
pub fn recover_with<C, S>(
    workspace: &Path,
    committed: &dyn Fn(&str, &str) -> Result<bool, C>,
    settled: &dyn Fn(&Recovered) -> Result<(), S>,
) -> Result<Vec<Recovered>, PublishError>
where
    C: Into<super::CallbackError>,
    S: Into<super::CallbackError>,
{
    let committed = |s: &str, j: &str| committed(s, j).map_err(Into::into);
    let settled = |r: &Recovered| settled(r).map_err(Into::into);
    let (committed, settled) = (&committed, &settled);
    let ws = Workspace::open(workspace)?;
    let mut jobs = Vec::new();
    let mut quarantined = Vec::new();
    {
        let dir = rustix::fs::Dir::read_from(ws.fd())
            .map_err(|e| io("read workspace root", ws.root(), e))?;
        for entry in dir {
            let entry = entry.map_err(|e| io("read workspace root", ws.root(), e))?;
            let name = entry.file_name().to_bytes();
            if name.starts_with(JOB_DIR_PREFIX.as_bytes()) {
                jobs.push(OsStr::from_bytes(name).to_os_string());
            } else if name.starts_with(QUARANTINE_PREFIX.as_bytes()) {
                quarantined.push(OsStr::from_bytes(name).to_os_string());
            }
        }
    }
    jobs.sort();
    quarantined.sort();
    let mut out = Vec::new();
    // The jobs whose journal a dir held so far: a second dir naming one is not that job's.
    let mut journaled = std::collections::HashSet::new();
    for name in quarantined {
        if !is_dir(&ws, &name)? {
            continue;
        }
        out.push(report_quarantined(&ws, &name));
    }
    for name in jobs {
        if !is_dir(&ws, &name)? {
            continue;
        }
        // An idle dir holds nothing of any job: removed unreported. One that cannot be
        // removed, or whose journal is not blank, goes the way of a job dir that cannot be
        // proved disposable, and is reported.
        if super::pool::is_idle(name.as_bytes())
            && journal_settled(&ws, &name)
            && remove_tree(ws.fd(), &name, &ws.root().join(&name)).is_ok()
        {
            continue;
        }
        out.push(recover_one(&ws, &name, &mut journaled, committed, settled)?);
    }
    Ok(out)
}

/// Whether the dir `name` has no journal or a blank one.
fn journal_settled(ws: &Workspace, name: &OsStr) -> bool {
    let dir = ws.root().join(name);
    match open_repairing(ws.fd(), name, &dir) {
        Ok(Some(fd)) => matches!(
            Journal::read(fd.as_fd(), &dir),
            Err(JournalError::Missing { .. } | JournalError::Blank { .. })
        ),
        Ok(None) | Err(_) => false,
    }
}

fn is_dir(ws: &Workspace, name: &OsStr) -> Result<bool, PublishError> {
    let path = ws.root().join(name);
    match stat_at(ws.fd(), name).map_err(|e| io("stat", &path, e))? {
        Some(st) if file_type(&st) == FileType::Directory => Ok(true),
        Some(st) => {
            tracing::warn!(path = %path.display(), kind = ?file_type(&st), "not a directory; left alone");
            Ok(false)
        }
        None => Ok(false),
    }
}

/// A dir an earlier recovery moved aside: reported, never touched (it may hold the only old
/// copy of a target).
fn report_quarantined(ws: &Workspace, name: &OsStr) -> Recovered {
    let path = ws.root().join(name);
    let job = name.to_string_lossy().into_owned();
    tracing::warn!(dir = %path.display(), "a quarantined job dir of an earlier recovery is still there, untouched; see that recovery's log line (or its audit `error` event), then remove it by hand");
    Recovered {
        action: "still quarantined by an earlier recovery, left untouched; remove it by hand once \
                 its content is dealt with"
            .into(),
        quarantined: Some(path),
        ..Recovered::bare(job, Settled::Quarantine)
    }
}

/// Why recovery could not prove a job dir disposable and kept it, as it is, aside.
#[derive(Debug, thiserror::Error)]
pub enum Kept {
    /// Its `recovery.json` is there but cannot be used.
    #[error("its journal is damaged")]
    Journal(#[source] JournalError),
    /// Its journal names something that is not a job id, or a job another dir's journal
    /// named first.
    #[error("its journal names job {found:?}, which is not a job id or is another dir's job")]
    OtherJob { found: String },
    /// No journal, but entries no job dir without one holds.
    #[error("it has no journal but holds {entries:?} besides its staging dir")]
    Unexpected { entries: Vec<String> },
    /// The dir itself cannot be opened or listed.
    #[error("it cannot be read")]
    Unopenable(#[source] PublishError),
    /// Rolling back would need to reach targets it cannot reach safely. `restored`: how
    /// many other targets it had restored when it met one (0 unless a parent was swapped
    /// during recovery itself, after its check).
    #[error("rollback cannot reach {}", describe_unreached(.targets))]
    Unreachable {
        targets: Vec<Unreached>,
        restored: usize,
    },
}

fn describe_unreached(targets: &[Unreached]) -> String {
    let v: Vec<String> = targets
        .iter()
        .map(|u| format!("{} ({})", u.target.display(), u.reason))
        .collect();
    v.join(", ")
}

impl Kept {
    /// What the operator should do with the dir kept at `to`.
    pub fn advice(&self, to: &Path) -> String {
        let q = to.display();
        match self {
            Kept::Unreachable { restored, .. } => format!(
                "recovery restored {restored} other target(s) and changed nothing else; the \
                 session keeps its old version (the call did not commit); \
                 {q}/recovery.json lists each target and its backup ({q}/<backup>, the old \
                 content): put the parent directory back, or restore the backup over the \
                 target by hand, then remove {q}"
            ),
            _ => format!(
                "recovery changed no target and no session for it (whether the call \
                 committed is unknown: see its events in the audit log); any file under \
                 {q}/stage/ may be the old content of the target of the same name (the \
                 journal, if readable, lists them): compare each with its target, restore by \
                 hand what should be, then remove {q}"
            ),
        }
    }
}

/// Whether `job` can be a job id: what the daemon makes them of (letters, digits, `-`, `_`),
/// so that the names recovery derives from it stay within the workspace root.
fn is_job_id(job: &str) -> bool {
    !job.is_empty()
        && job.len() <= 128
        && job
            .bytes()
            .all(|b| b.is_ascii_alphanumeric() || b == b'-' || b == b'_')
}

fn recover_one(
    ws: &Workspace,
    name: &OsStr,
    journaled: &mut std::collections::HashSet<String>,
    committed: &dyn Fn(&str, &str) -> Result<bool, super::CallbackError>,
    settled_hook: &dyn Fn(&Recovered) -> Result<(), super::CallbackError>,
) -> Result<Recovered, PublishError> {
    let dir = ws.root().join(name);
    let mut id = name.to_string_lossy()[JOB_DIR_PREFIX.len()..].to_string();
    // The worker may have taken every permission from its job dir (`chmod 0 ..`).
    let fd = match open_repairing(ws.fd(), name, &dir) {
        Ok(Some(fd)) => fd,
        Ok(None) => {
            return Ok(Recovered {
                action: "gone already".into(),
                ..Recovered::bare(id, Settled::NeverPublished)
            })
        }
        Err(e) => {
            let info = Recovered::bare(id.clone(), Settled::Kept);
            return keep(ws, name, Kept::Unopenable(e), info, settled_hook);
        }
    };
    let mut settled = "never published";
    let mut info = Recovered::bare(id.clone(), Settled::NeverPublished);
    let action = match Journal::read(fd.as_fd(), &dir) {
        Err(JournalError::Missing { .. } | JournalError::Blank { .. }) => {
            let others = match entries_besides_staging(fd.as_fd(), &dir) {
                Ok(o) => o,
                Err(e) => {
                    drop(fd);
                    info.settled = Settled::Kept;
                    return keep(ws, name, Kept::Unopenable(e), info, settled_hook);
                }
            };
            if !others.is_empty() {
                drop(fd);
                info.settled = Settled::Kept;
                let why = Kept::Unexpected { entries: others };
                return keep(ws, name, why, info, settled_hook);
            }
            tracing::info!(job = %id, "no journal: the job never published, or its targets were settled");
            "removed (worker never published)".to_string()
        }
        Err(e @ JournalError::Damaged { .. }) => {
            drop(fd);
            info.settled = Settled::Kept;
            return keep(ws, name, Kept::Journal(e), info, settled_hook);
        }
        Ok(j) if !is_job_id(&j.job) || journaled.contains(&j.job) => {
            drop(fd);
            info.settled = Settled::Kept;
            info.phase = Some(j.phase.as_str());
            return keep(
                ws,
                name,
                Kept::OtherJob { found: j.job },
                info,
                settled_hook,
            );
        }
        Ok(j) => {
            journaled.insert(j.job.clone());
            if j.job != id {
                // A dir taken from the pool whose new name did not survive a power loss.
                tracing::info!(dir = %dir.display(), job = %j.job, "the job dir still bears an earlier name; recovered as its journal's job");
                id = j.job.clone();
                info.job = id.clone();
            }
            info.session = Some(j.session.clone());
            info.tool = Some(j.tool.clone());
            info.phase = Some(j.phase.as_str());
            info.settled = match j.phase {
                Phase::WorkerRunning => Settled::NeverPublished,
                Phase::PublishingOutputs => Settled::RolledBack,
                Phase::CommittingState | Phase::Committed => Settled::Completed,
            };
            let total = j.targets.len();
            // `Err(kept)`: some target cannot be reached safely; the dir must be kept. Checked
            // before any change, so that all targets stay as the crash left them.
            let roll_back = |j: &Journal| -> Result<Result<String, Kept>, PublishError> {
                let targets = unreachable_targets(ws.fd(), ws.root(), fd.as_fd(), j);
                if !targets.is_empty() {
                    return Ok(Err(Kept::Unreachable {
                        targets,
                        restored: 0,
                    }));
                }
                let r = rollback(ws.fd(), ws.root(), fd.as_fd(), &dir, j)?;
                if !r.unreached.is_empty() {
                    return Ok(Err(Kept::Unreachable {
                        targets: r.unreached,
                        restored: r.restored,
                    }));
                }
                Ok(Ok(format!(
                    "rolled back {} of {total} targets (phase {})",
                    r.restored,
                    j.phase.as_str()
                )))
            };
            settled = "settled";
            match j.phase {
                Phase::WorkerRunning => {
                    settled = "never published";
                    "removed (worker never published)".to_string()
                }
                // Renames may all be done and the session may hold the commit: it decides.
                Phase::PublishingOutputs | Phase::CommittingState => {
                    match committed(&j.session, &j.job) {
                        Ok(true) => {
                            info.settled = Settled::Completed;
                            keep_undo_backups(ws, fd.as_fd(), &dir, &j);
                            format!("completed {total} targets (session holds the commit)")
                        }
                        Ok(false) => match roll_back(&j)? {
                            Ok(action) => {
                                info.settled = Settled::RolledBack;
                                action
                            }
                            Err(why) => {
                                drop(fd);
                                info.settled = Settled::Kept;
                                return keep(ws, name, why, info, settled_hook);
                            }
                        },
                        Err(source) => {
                            return Err(PublishError::Undecided {
                                job: id,
                                session: j.session.clone(),
                                source,
                            })
                        }
                    }
                }
                Phase::Committed => {
                    keep_undo_backups(ws, fd.as_fd(), &dir, &j);
                    format!("completed {total} targets")
                }
            }
        }
    };
    // The targets are final: say so (the audit), then drop the journal, so that what remains
    // of the dir reads as "never published" whatever happens next.
    settled_hook(&Recovered {
        action: action.clone(),
        ..info.clone()
    })
    .map_err(|e| PublishError::Recovery {
        job: id.clone(),
        reason: RecoveryFault::NotRecorded(e),
    })?;
    let journal = dir.join(JOURNAL);
    let dropped = match mutate("publish.cleanup_unlink", &journal, || {
        rustix::fs::unlinkat(fd.as_fd(), JOURNAL, AtFlags::empty())
    }) {
        Ok(()) => fsync_dir(fd.as_fd(), &dir),
        Err(PublishError::Io { source, .. }) if source.raw_os_error() == Some(libc::ENOENT) => {
            Ok(())
        }
        Err(e) => Err(e),
    };
    drop(fd);
    let removed = dropped
        .and_then(|()| remove_tree(ws.fd(), name, &dir))
        .and_then(|()| fsync_dir(ws.fd(), ws.root()));
    if let Err(e) = removed {
        return quarantine(ws, name, &id, settled, e).map(|r| Recovered {
            action: format!("{action}; {}", r.action),
            quarantined: r.quarantined,
            ..info
        });
    }
    tracing::info!(job = %id, %action, "recovered job dir");
    Ok(Recovered { action, ..info })
}

/// A committed job whose undo record was written before its commit point: its backups go
/// into that undo data, as the commit would have done after it. A failure is logged only:
/// the undo data is then incomplete, and the startup sweep drops it.
fn keep_undo_backups(ws: &Workspace, fd: std::os::fd::BorrowedFd<'_>, dir: &Path, j: &Journal) {
    if let Err(e) = super::undo::keep_backups(ws.fd(), ws.root(), fd, dir, j) {
        tracing::warn!(job = %j.job, error = %crate::report::chain(&e), "recovery cannot keep the job's backups as its undo data; it will not be undoable");
    }
}

/// Moves a job dir that cannot be removed aside, under a name no tool path can reach and no
/// later recovery reads as a job. Only for jobs whose targets are settled (or never touched).
fn quarantine(
    ws: &Workspace,
    name: &OsStr,
    id: &str,
    settled: &str,
    error: PublishError,
) -> Result<Recovered, PublishError> {
    let dir = ws.root().join(name);
    let moved = free_quarantine_name(ws, id).and_then(|to| move_aside(ws, name, &to).map(|()| to));
    let to = match moved {
        Ok(to) => to,
        Err(aside) => {
            return Err(PublishError::Recovery {
                job: id.to_string(),
                reason: RecoveryFault::Unremovable {
                    dir,
                    removal: Box::new(error),
                    aside,
                },
            })
        }
    };
    let error = crate::report::chain(&error);
    tracing::warn!(job = %id, from = %dir.display(), to = %to.display(), %error,
        "cannot remove the job dir ({settled}); moved it aside: remove it by hand");
    Ok(Recovered {
        quarantined: Some(to.clone()),
        action: format!(
            "quarantined as {} ({settled}; cannot remove it: {error}); remove it by hand",
            to.display()
        ),
        ..Recovered::bare(id.to_string(), Settled::NeverPublished)
    })
}

/// Keeps a job dir recovery could not prove disposable: records it in the audit log
/// (`settled_hook`, durable), then renames it as it is, every byte kept, to a free
/// `.airlock-quarantine-<id>[-n]`, and says what to do. A crash before the rename makes the
/// next recovery decide, and record, again; once renamed, no recovery touches it.
fn keep(
    ws: &Workspace,
    name: &OsStr,
    why: Kept,
    mut info: Recovered,
    settled_hook: &dyn Fn(&Recovered) -> Result<(), super::CallbackError>,
) -> Result<Recovered, PublishError> {
    let dir = ws.root().join(name);
    let id = info.job.clone();
    let why = std::sync::Arc::new(why);
    let unmovable = |aside: MoveAside| PublishError::Recovery {
        job: id.clone(),
        reason: RecoveryFault::Unmovable {
            dir: dir.clone(),
            why: why.clone(),
            aside,
        },
    };
    let to = free_quarantine_name(ws, &id).map_err(unmovable)?;
    let advice = why.advice(&to);
    info.settled = Settled::Kept;
    info.quarantined = Some(to.clone());
    let shown = crate::report::chain(&*why);
    info.action = format!(
        "kept as {} with every byte: {shown}; {advice}",
        to.display()
    );
    info.kept = Some(why.clone());
    settled_hook(&info).map_err(|e| PublishError::Recovery {
        job: id.clone(),
        reason: RecoveryFault::NotRecorded(e),
    })?;
    move_aside(ws, name, &to).map_err(unmovable)?;
    tracing::error!(job = %id, from = %dir.display(), to = %to.display(), reason = %shown,
        "recovery cannot prove this job dir disposable: kept it aside with every byte; {advice}");
    Ok(info)
}

/// Why startup recovery could not bring a job dir to a boundary (it stops there).
#[derive(Debug, thiserror::Error)]
pub enum RecoveryFault {
    /// The caller could not record what recovery did with the job (`settled` failed).
    #[error("stopped before changing anything more (start again once the cause is fixed)")]
    NotRecorded(#[source] super::CallbackError),
    /// A settled job dir can be neither removed nor moved aside.
    #[error(
        "cannot remove {} ({}) nor move it aside; remove it by hand and start again",
        .dir.display(),
        crate::report::chain(&**.removal)
    )]
    Unremovable {
        dir: std::path::PathBuf,
        removal: Box<PublishError>,
        #[source]
        aside: MoveAside,
    },
    /// A job dir recovery must keep, as it is, cannot be moved aside.
    #[error(
        "{} must be kept ({}) but cannot be moved aside; nothing was removed: move it out of \
         the workspace by hand (keep it: it may hold the only old copy of a target) and start \
         again",
        .dir.display(),
        crate::report::chain(&**.why)
    )]
    Unmovable {
        dir: std::path::PathBuf,
        why: std::sync::Arc<Kept>,
        #[source]
        aside: MoveAside,
    },
}

/// Why a dir could not be moved aside.
#[derive(Debug, thiserror::Error)]
pub enum MoveAside {
    #[error("find a free quarantine name (100 taken)")]
    NoFreeName,
    #[error("stat {path}")]
    Stat {
        path: std::path::PathBuf,
        source: rustix::io::Errno,
    },
    #[error("move it aside")]
    Rename(#[source] Box<PublishError>),
}

/// The first of `.airlock-quarantine-<id>`, `-1`, ... `-99` that does not exist.
fn free_quarantine_name(ws: &Workspace, id: &str) -> Result<std::path::PathBuf, MoveAside> {
    for n in 0..100u32 {
        let mut to = OsString::from(QUARANTINE_PREFIX);
        to.push(id);
        if n > 0 {
            to.push(format!("-{n}"));
        }
        let path = ws.root().join(&to);
        match stat_at(ws.fd(), &to) {
            Ok(None) => return Ok(path),
            Ok(Some(_)) => {}
            Err(source) => return Err(MoveAside::Stat { path, source }),
        }
    }
    Err(MoveAside::NoFreeName)
}

/// Renames `name` of the workspace root to `to` (a free quarantine name beneath it), never
/// over anything, and makes it durable.
fn move_aside(ws: &Workspace, name: &OsStr, to: &Path) -> Result<(), MoveAside> {
    let to_name = to.file_name().unwrap_or_default();
    mutate("publish.quarantine", to, || {
        rustix::fs::renameat_with(ws.fd(), name, ws.fd(), to_name, RenameFlags::NOREPLACE)
    })
    .and_then(|()| fsync_dir(ws.fd(), ws.root()))
    .map_err(|e| MoveAside::Rename(Box::new(e)))
}

/// The names in a job dir with no journal (or a blank one) other than its staging dir, the
/// blank journal and the temp file of a journal rewrite (written only after the commit):
/// such a dir holds nothing else.
fn entries_besides_staging(
    fd: std::os::fd::BorrowedFd<'_>,
    dir: &Path,
) -> Result<Vec<String>, PublishError> {
    let mut others = Vec::new();
    let d = rustix::fs::Dir::read_from(fd).map_err(|e| io("read job dir", dir, e))?;
    for entry in d {
        let entry = entry.map_err(|e| io("read job dir", dir, e))?;
        let n = entry.file_name().to_bytes();
        let mut kind = entry.file_type();
        if kind == FileType::Unknown {
            let name = OsStr::from_bytes(n);
            kind = match stat_at(fd, name).map_err(|e| io("stat", &dir.join(name), e))? {
                Some(st) => file_type(&st),
                None => continue,
            };
        }
        let expected = match n {
            b"." | b".." => true,
            b"stage" => kind == FileType::Directory,
            n if n == JOURNAL_TMP.as_bytes() || n == JOURNAL.as_bytes() => {
                kind == FileType::RegularFile
            }
            _ => false,
        };
        if !expected {
            others.push(String::from_utf8_lossy(n).into_owned());
        }
    }
    others.sort();
    Ok(others)
}
