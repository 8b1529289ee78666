//! Job dirs, the recovery journal, publication of staged outputs, rollback and startup
//! recovery. Only this module renames into the workspace.

use std::path::{Path, PathBuf};

use crate::policy::PathRole;

#[derive(Debug, thiserror::Error)]
pub enum PathError {
    #[error("{raw:?}: {reason}")]
    Rejected { raw: String, reason: String },
}

#[derive(Debug, thiserror::Error)]
pub enum PublishError {
    #[error("{op} {path}: {source}")]
    Io {
        op: &'static str,
        path: PathBuf,
        source: std::io::Error,
    },
    #[error("staged output {path} rejected: {reason}")]
    BadOutput { path: PathBuf, reason: String },
    #[error("commit failed: {0}")]
    Commit(String),
}

/// The workspace root, held open as a directory fd.
pub struct Workspace {
    root: PathBuf,
}

impl Workspace {
    pub fn open(root: &Path) -> Result<Workspace, PublishError> {
        Ok(Workspace {
            root: root.to_path_buf(),
        })
    }

    pub fn root(&self) -> &Path {
        &self.root
    }

    /// Resolves a path parameter beneath the workspace and returns it relative to the root,
    /// normalized. `..` escapes, absolute paths elsewhere, symlinks leading out and paths into
    /// job dirs are rejected.
    pub fn resolve(&self, raw: &str, role: PathRole) -> Result<PathBuf, PathError> {
        let _ = role;
        Ok(PathBuf::from(raw))
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
}

pub struct Job {
    spec: JobSpec,
    dir: PathBuf,
}

impl Job {
    /// Creates `.airlock-job-<id>/` (0700) with its staging dir and its journal in phase
    /// `worker_running`.
    pub fn create(ws: &Workspace, spec: JobSpec) -> Result<Job, PublishError> {
        let dir = ws.root().join(format!(".airlock-job-{}", spec.id));
        Ok(Job { spec, dir })
    }

    pub fn dir(&self) -> &Path {
        &self.dir
    }

    /// The directory the worker may write in.
    pub fn stage_dir(&self) -> PathBuf {
        self.dir.join("stage")
    }

    /// Absolute staged path of target `i`.
    pub fn staged_path(&self, i: usize) -> PathBuf {
        self.stage_dir().join(format!("{i}"))
    }

    pub fn record_worker(&mut self, pid: u32) -> Result<(), PublishError> {
        let _ = pid;
        Ok(())
    }

    /// Validates and publishes every staged output, then runs `commit` (which writes the
    /// session state: the commit point), then cleans up. Any failure before the commit point
    /// restores every target.
    pub fn publish_and_commit(
        self,
        ws: &Workspace,
        commit: impl FnOnce() -> Result<(), String>,
    ) -> Result<(), PublishError> {
        let _ = (ws, &self.spec);
        commit().map_err(PublishError::Commit)
    }

    /// Removes the job dir of a call that will not publish.
    pub fn discard(self) -> Result<(), PublishError> {
        Ok(())
    }
}

/// What startup recovery did with one leftover job dir.
#[derive(Debug, Clone)]
pub struct Recovered {
    pub job: String,
    pub action: String,
}

/// Rolls back or completes every leftover job dir in `workspace`. `committed(session, job)`
/// tells whether the session state holds that job's commit.
pub fn recover(
    workspace: &Path,
    committed: &dyn Fn(&str, &str) -> Result<bool, String>,
) -> Result<Vec<Recovered>, PublishError> {
    let _ = (workspace, committed);
    Ok(Vec::new())
}
