//! The worker's cgroup: creation with its limits, kill, emptiness, removal.

use std::io;
use std::path::{Path, PathBuf};
use std::time::Duration;

/// Errors of the worker's cgroup.
#[derive(Debug, thiserror::Error)]
pub enum CgroupError {
    #[error("job id {0:?} cannot name a cgroup")]
    BadJobId(String),
    #[error("cannot create the cgroup {path}")]
    Create { path: PathBuf, source: io::Error },
    #[error("cannot write {value} to {path}")]
    Write {
        path: PathBuf,
        value: u64,
        source: io::Error,
    },
}

/// The worker's cgroup, `<parent>/airlock-<job_id>`, with the limits its controllers allow.
/// Returns the path and the limit files that were written.
pub(crate) fn cgroup_create(
    parent: &Path,
    job_id: &str,
    memory_bytes: u64,
    processes: u64,
) -> Result<(PathBuf, Vec<String>), CgroupError> {
    if job_id.is_empty()
        || job_id.contains('/')
        || job_id == "."
        || job_id == ".."
        || job_id.contains('\0')
    {
        return Err(CgroupError::BadJobId(job_id.to_string()));
    }
    let path = parent.join(format!("airlock-{job_id}"));
    std::fs::create_dir(&path).map_err(|source| CgroupError::Create {
        path: path.clone(),
        source,
    })?;
    let mut applied = Vec::new();
    for (file, value) in [("memory.max", memory_bytes), ("pids.max", processes)] {
        let limit = path.join(file);
        if !limit.exists() {
            tracing::warn!(cgroup = %path.display(), "{file} is absent (controller not enabled there): not applied");
            continue;
        }
        if let Err(source) = std::fs::write(&limit, value.to_string()) {
            let _ = std::fs::remove_dir(&path);
            return Err(CgroupError::Write {
                path: limit,
                value,
                source,
            });
        }
        applied.push(file.to_string());
    }
    Ok((path, applied))
}

pub(crate) fn cgroup_kill(path: &Path) {
    // cgroup.kill exists since Linux 5.14; the process-group kill covers older kernels.
    let _ = std::fs::write(path.join("cgroup.kill"), b"1");
}

pub(crate) fn cgroup_is_empty(path: &Path) -> bool {
    match std::fs::read_to_string(path.join("cgroup.procs")) {
        Ok(procs) => procs.trim().is_empty(),
        Err(e) => e.kind() == io::ErrorKind::NotFound,
    }
}

/// Removes the (empty) cgroup; the kernel may take a moment to release exiting tasks.
pub(crate) async fn cgroup_remove(path: &Path) {
    for attempt in 0..50 {
        match std::fs::remove_dir(path) {
            Ok(()) => return,
            Err(e) if e.kind() == io::ErrorKind::NotFound => return,
            Err(e) if attempt == 49 => {
                tracing::warn!(cgroup = %path.display(), "cannot remove the worker's cgroup: {}", crate::report::chain(&e));
            }
            Err(_) => tokio::time::sleep(Duration::from_millis(10)).await,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn bad_job_ids() {
        for id in ["", "a/b", "..", "."] {
            assert!(matches!(
                cgroup_create(Path::new("/nonexistent"), id, 1, 1),
                Err(CgroupError::BadJobId(_))
            ));
        }
    }
}
