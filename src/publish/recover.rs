//! Startup recovery: every leftover job dir is rolled back or completed, then removed (or,
//! if it cannot be removed, moved aside to a quarantine name).

use std::ffi::{OsStr, OsString};
use std::os::fd::AsFd;
use std::os::unix::ffi::OsStrExt;
use std::path::Path;

use rustix::fs::{AtFlags, FileType, RenameFlags};

use super::job::rollback;
use super::journal::{Journal, Phase, JOURNAL};
use super::sys::{file_type, fsync_dir, io, mutate, stat_at};
use super::tree::{open_repairing, remove_tree};
use super::{PublishError, Recovered, Settled, Workspace, JOB_DIR_PREFIX, QUARANTINE_PREFIX};

/// Rolls back or completes every leftover job dir in `workspace`. `committed(session, job)`
/// tells whether the session state holds that job's commit.
///
/// Decisions, by the journaled phase:
/// * none readable, `worker_running`: nothing was published; the dir is removed.
/// * `publishing_outputs` (or `committing_state`, written by earlier versions): `committed`
///   decides: completed (backups dropped) or rolled back by identity.
/// * `committed`: completed.
///
/// Once a job's targets are settled its journal is unlinked first, so that whatever remains
/// of the dir reads as "never published". A dir that then cannot be removed (whatever the
/// worker left in it) is renamed to `.airlock-quarantine-<id>`, logged and reported, and
/// recovery goes on: it holds nothing the workspace needs. Quarantined dirs of earlier runs
/// are removed again at each recovery, and reported while they stay.
///
/// Every mutation is a failpoint; a crash inside recovery is recovered by running it again.
/// Job dirs are processed in name order. Recovery stops at the first job it cannot bring to
/// a boundary (its commit state cannot be established, its rollback fails, or it can be
/// neither removed nor moved aside): the daemon must not serve such a workspace.
pub fn recover(
    workspace: &Path,
    committed: &dyn Fn(&str, &str) -> Result<bool, super::CallbackError>,
) -> Result<Vec<Recovered>, PublishError> {
    recover_with(workspace, committed, &|_| Ok(()))
}

/// As [`recover`], calling `settled` for each job once its targets are final and before its
/// journal is dropped (the audit records it there: a crash after `settled` makes the next
/// recovery settle the job, and call `settled`, again). An `Err` from `settled` stops
/// recovery like any other failure to bring a job to a boundary.
pub fn recover_with(
    workspace: &Path,
    committed: &dyn Fn(&str, &str) -> Result<bool, super::CallbackError>,
    settled: &dyn Fn(&Recovered) -> Result<(), super::CallbackError>,
) -> Result<Vec<Recovered>, PublishError> {
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
    for name in quarantined {
        if !is_dir(&ws, &name)? {
            continue;
        }
        out.push(retry_quarantined(&ws, &name));
    }
    for name in jobs {
        if !is_dir(&ws, &name)? {
            continue;
        }
        out.push(recover_one(&ws, &name, committed, settled)?);
    }
    Ok(out)
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

/// A dir an earlier recovery moved aside: try once more to remove it.
fn retry_quarantined(ws: &Workspace, name: &OsStr) -> Recovered {
    let path = ws.root().join(name);
    let job = name.to_string_lossy().into_owned();
    match remove_tree(ws.fd(), name, &path).and_then(|()| fsync_dir(ws.fd(), ws.root())) {
        Ok(()) => {
            tracing::info!(dir = %path.display(), "removed a quarantined job dir");
            Recovered {
                action: "removed (quarantined by an earlier recovery)".into(),
                ..Recovered::bare(job, Settled::Quarantine)
            }
        }
        Err(e) => {
            tracing::warn!(dir = %path.display(), error = %e, "a quarantined job dir still cannot be removed; remove it by hand");
            Recovered {
                action: format!("still quarantined, cannot be removed: {e}"),
                quarantined: Some(path),
                ..Recovered::bare(job, Settled::Quarantine)
            }
        }
    }
}

fn recover_one(
    ws: &Workspace,
    name: &OsStr,
    committed: &dyn Fn(&str, &str) -> Result<bool, super::CallbackError>,
    settled_hook: &dyn Fn(&Recovered) -> Result<(), super::CallbackError>,
) -> Result<Recovered, PublishError> {
    let dir = ws.root().join(name);
    let id = name.to_string_lossy()[JOB_DIR_PREFIX.len()..].to_string();
    // The worker may have taken every permission from its job dir (`chmod 0 ..`).
    let fd = match open_repairing(ws.fd(), name, &dir) {
        Ok(Some(fd)) => fd,
        Ok(None) => {
            return Ok(Recovered {
                action: "gone already".into(),
                ..Recovered::bare(id, Settled::NeverPublished)
            })
        }
        Err(e) => return quarantine(ws, name, &id, "never published", e),
    };
    let mut settled = "never published";
    let mut info = Recovered::bare(id.clone(), Settled::NeverPublished);
    let action = match Journal::read(fd.as_fd(), &dir) {
        Err(reason) => {
            tracing::info!(job = %id, %reason, "no readable journal: the job never got past creation");
            "removed (worker never published)".to_string()
        }
        Ok(j) if j.job != id => {
            return Err(PublishError::Recovery {
                job: id,
                reason: format!(
                    "its journal names job {:?}; refusing to guess. Check the targets it lists \
                     in {}, then remove the dir by hand and start again",
                    j.job,
                    dir.join(JOURNAL).display()
                ),
            });
        }
        Ok(j) => {
            info.session = Some(j.session.clone());
            info.tool = Some(j.tool.clone());
            info.phase = Some(j.phase.as_str());
            info.settled = match j.phase {
                Phase::WorkerRunning => Settled::NeverPublished,
                Phase::PublishingOutputs => Settled::RolledBack,
                Phase::CommittingState | Phase::Committed => Settled::Completed,
            };
            let total = j.targets.len();
            let roll_back = |j: &Journal| -> Result<String, PublishError> {
                let n = rollback(ws.fd(), ws.root(), fd.as_fd(), &dir, j)?;
                Ok(format!(
                    "rolled back {n} of {total} targets (phase {})",
                    j.phase.as_str()
                ))
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
                            format!("completed {total} targets (session holds the commit)")
                        }
                        Ok(false) => {
                            info.settled = Settled::RolledBack;
                            roll_back(&j)?
                        }
                        Err(source) => {
                            return Err(PublishError::Undecided {
                                job: id,
                                session: j.session.clone(),
                                source,
                            })
                        }
                    }
                }
                Phase::Committed => format!("completed {total} targets"),
            }
        }
    };
    // The targets are final: say so (the audit), then drop the journal, so that what remains
    // of the dir reads as "never published" whatever happens next.
    settled_hook(&Recovered {
        action: action.clone(),
        ..info.clone()
    })
    .map_err(|reason| PublishError::Recovery {
        job: id.clone(),
        reason: format!("{reason}; nothing more was changed, start again once it is fixed"),
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
    let mut last = None;
    for n in 0..100u32 {
        let mut to = OsString::from(QUARANTINE_PREFIX);
        to.push(id);
        if n > 0 {
            to.push(format!("-{n}"));
        }
        let to_path = ws.root().join(&to);
        match mutate("publish.quarantine", &to_path, || {
            rustix::fs::renameat_with(ws.fd(), name, ws.fd(), &to, RenameFlags::NOREPLACE)
        }) {
            Ok(()) => {
                fsync_dir(ws.fd(), ws.root())?;
                tracing::warn!(job = %id, from = %dir.display(), to = %to_path.display(), %error,
                    "cannot remove the job dir ({settled}); moved it aside: remove it by hand");
                return Ok(Recovered {
                    quarantined: Some(to_path.clone()),
                    action: format!(
                        "quarantined as {} ({settled}; cannot remove it: {error}); remove it by hand",
                        to_path.display()
                    ),
                    ..Recovered::bare(id.to_string(), Settled::NeverPublished)
                });
            }
            Err(PublishError::Io { source, .. })
                if matches!(source.raw_os_error(), Some(libc::EEXIST | libc::ENOTEMPTY)) =>
            {
                last = Some(source);
            }
            Err(e) => {
                return Err(PublishError::Recovery {
                    job: id.to_string(),
                    reason: format!(
                        "cannot remove {} ({error}) nor move it aside ({e}); remove it by hand \
                         and start again",
                        dir.display()
                    ),
                })
            }
        }
    }
    Err(PublishError::Recovery {
        job: id.to_string(),
        reason: format!(
            "cannot remove {} ({error}) nor find a free quarantine name ({last:?}); remove it by \
             hand and start again",
            dir.display()
        ),
    })
}
