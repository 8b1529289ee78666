//! Unit tests: resolution, publication, bad outputs, commit failure, and recovery after a
//! simulated crash or an injected error at every failpoint.

use std::collections::BTreeMap;
use std::fs;
use std::os::unix::fs::{MetadataExt, PermissionsExt};
use std::path::{Path, PathBuf};

use super::testsim::{self, Mode};
use super::*;
use crate::policy::PathRole;

#[derive(Debug, Clone, PartialEq, Eq)]
enum Entry {
    Dir,
    File(Vec<u8>),
    Link(PathBuf),
    Other,
}

/// Every entry beneath `root`, job dirs included (a leftover one must show up).
fn snapshot(root: &Path) -> BTreeMap<PathBuf, Entry> {
    fn walk(root: &Path, dir: &Path, out: &mut BTreeMap<PathBuf, Entry>) {
        for e in fs::read_dir(dir).unwrap() {
            let e = e.unwrap();
            let p = e.path();
            let rel = p.strip_prefix(root).unwrap().to_path_buf();
            let ft = e.file_type().unwrap();
            if ft.is_dir() {
                out.insert(rel, Entry::Dir);
                walk(root, &p, out);
            } else if ft.is_symlink() {
                out.insert(rel, Entry::Link(fs::read_link(&p).unwrap()));
            } else if ft.is_file() {
                out.insert(rel, Entry::File(fs::read(&p).unwrap()));
            } else {
                out.insert(rel, Entry::Other);
            }
        }
    }
    let mut out = BTreeMap::new();
    walk(root, root, &mut out);
    out
}

fn job_dirs(root: &Path) -> Vec<String> {
    fs::read_dir(root)
        .unwrap()
        .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
        .filter(|n| n.starts_with(JOB_DIR_PREFIX))
        .collect()
}

fn write(root: &Path, rel: &str, content: &str) {
    let p = root.join(rel);
    fs::create_dir_all(p.parent().unwrap()).unwrap();
    fs::write(p, content).unwrap();
}

fn spec(id: &str, targets: &[&str]) -> JobSpec {
    JobSpec {
        id: id.into(),
        session: "s1".into(),
        tool: "render".into(),
        targets: targets.iter().map(PathBuf::from).collect(),
        modes: Vec::new(),
        kinds: Vec::new(),
        stage_owner: None,
        staging_limits: None,
        hash_limit: None,
        inout: Vec::new(),
    }
}

fn open(dir: &tempfile::TempDir) -> Workspace {
    Workspace::open(dir.path()).unwrap()
}

fn stage(job: &Job, i: usize, content: &str) {
    fs::write(job.staged_path(i), content).unwrap();
}

mod crash;
mod job;
mod paths;
mod pool;
mod staging;
mod syncs;
mod trees;
mod undo;
