//! Startup recovery: every leftover job dir is rolled back or completed, then removed.

use std::ffi::OsStr;
use std::os::fd::AsFd;
use std::os::unix::ffi::OsStrExt;
use std::path::Path;

use rustix::fs::FileType;

use super::job::rollback;
use super::journal::{Journal, Phase};
use super::sys::{file_type, fsync_dir, io, open_dir_beneath, remove_tree, stat_at};
use super::{PublishError, Recovered, Workspace, JOB_DIR_PREFIX};

/// Rolls back or completes every leftover job dir in `workspace`. `committed(session, job)`
/// tells whether the session state holds that job's commit.
///
/// Decisions, by the journaled phase:
/// * none readable, `worker_running`: nothing was published; the dir is removed.
/// * `publishing_outputs`: rolled back by identity, then removed.
/// * `committing_state`: `committed` decides: completed (backups dropped) or rolled back.
/// * `committed`: completed.
///
/// Every mutation is a failpoint; a crash inside recovery is recovered by running it again.
/// Job dirs are processed in name order; the first error stops recovery (the daemon must not
/// serve a workspace it could not bring to a boundary).
pub fn recover(
    workspace: &Path,
    committed: &dyn Fn(&str, &str) -> Result<bool, String>,
) -> Result<Vec<Recovered>, PublishError> {
    let ws = Workspace::open(workspace)?;
    let mut names = Vec::new();
    {
        let dir = rustix::fs::Dir::read_from(ws.fd())
            .map_err(|e| io("read workspace root", ws.root(), e))?;
        for entry in dir {
            let entry = entry.map_err(|e| io("read workspace root", ws.root(), e))?;
            let name = entry.file_name().to_bytes();
            if name.starts_with(JOB_DIR_PREFIX.as_bytes()) {
                names.push(OsStr::from_bytes(name).to_os_string());
            }
        }
    }
    names.sort();
    let mut out = Vec::new();
    for name in names {
        let path = ws.root().join(&name);
        match stat_at(ws.fd(), &name).map_err(|e| io("stat", &path, e))? {
            Some(st) if file_type(&st) == FileType::Directory => {}
            Some(st) => {
                tracing::warn!(path = %path.display(), kind = ?file_type(&st), "not a job dir; left alone");
                continue;
            }
            None => continue,
        }
        out.push(recover_one(&ws, &name, committed)?);
    }
    Ok(out)
}

fn recover_one(
    ws: &Workspace,
    name: &OsStr,
    committed: &dyn Fn(&str, &str) -> Result<bool, String>,
) -> Result<Recovered, PublishError> {
    let dir = ws.root().join(name);
    let id = name.to_string_lossy()[JOB_DIR_PREFIX.len()..].to_string();
    let fd = open_dir_beneath(ws.fd(), name).map_err(|e| io("open job dir", &dir, e))?;
    let action = match Journal::read(fd.as_fd(), &dir) {
        Err(reason) => {
            tracing::info!(job = %id, %reason, "no readable journal: the job never got past creation");
            "removed (worker never published)".to_string()
        }
        Ok(j) if j.job != id => {
            return Err(PublishError::Recovery {
                job: id,
                reason: format!("its journal names job {:?}; refusing to guess", j.job),
            });
        }
        Ok(j) => {
            let total = j.targets.len();
            let roll_back = |j: &Journal| -> Result<String, PublishError> {
                let n = rollback(ws.fd(), ws.root(), fd.as_fd(), &dir, j)?;
                Ok(format!(
                    "rolled back {n} of {total} targets (phase {})",
                    j.phase.as_str()
                ))
            };
            match j.phase {
                Phase::WorkerRunning => "removed (worker never published)".to_string(),
                Phase::PublishingOutputs => roll_back(&j)?,
                Phase::CommittingState => match committed(&j.session, &j.job) {
                    Ok(true) => format!("completed {total} targets (session holds the commit)"),
                    Ok(false) => roll_back(&j)?,
                    Err(reason) => {
                        return Err(PublishError::Recovery {
                            job: id,
                            reason: format!(
                                "cannot tell whether session {} committed: {reason}",
                                j.session
                            ),
                        })
                    }
                },
                Phase::Committed => format!("completed {total} targets"),
            }
        }
    };
    drop(fd);
    remove_tree(ws.fd(), name, &dir)?;
    fsync_dir(ws.fd(), ws.root())?;
    tracing::info!(job = %id, %action, "recovered job dir");
    Ok(Recovered { job: id, action })
}
