//! The paths a worker is handed when it cannot reach the workspace by absolute path
//! ([`WorkerReach::FromWorkingDir`]): each path argument rewritten relative to the worker's
//! working directory, which the launcher enters while it still holds the daemon's
//! privilege. Every rewritten path begins with `./` or `../`, so no tool reads one as an
//! option.

use std::path::{Component, Path, PathBuf};

use super::args::Bound;
use crate::startup::WorkerReach;

/// `abs` named from `cwd`: `..` for each component of `cwd` past their common prefix, then
/// the rest of `abs`; `./` first when that begins with neither. Both are absolute and
/// lexically normal (the workspace root joined with checked relative paths).
pub fn relative_to(cwd: &Path, abs: &Path) -> PathBuf {
    let a: Vec<Component<'_>> = abs.components().collect();
    let c: Vec<Component<'_>> = cwd.components().collect();
    let common = a.iter().zip(&c).take_while(|(x, y)| x == y).count();
    let mut out = PathBuf::new();
    if common == c.len() {
        out.push(".");
    }
    for _ in common..c.len() {
        out.push("..");
    }
    for part in &a[common..] {
        out.push(part);
    }
    out
}

/// Rewrites the path arguments `names` of `bound` (placeholders and `json` arguments alike)
/// relative to `cwd`, when `reach` says workers need it; absolute paths stay otherwise.
pub fn hand_to_worker<'a>(
    reach: &WorkerReach,
    bound: &mut Bound,
    cwd: &Path,
    names: impl IntoIterator<Item = &'a str>,
) {
    if *reach == WorkerReach::Absolute {
        return;
    }
    for name in names {
        let Some(abs) = bound.subst.get(name).map(PathBuf::from) else {
            continue;
        };
        let rel = relative_to(cwd, &abs).display().to_string();
        bound.subst.insert(name.to_string(), rel.clone());
        bound.arguments.insert(name.to_string(), rel.into());
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn an_input_is_named_from_the_workspace_or_from_the_staging_dir() {
        let root = Path::new("/root/airlock/workspace");
        let stage = root.join(".airlock-job-c1/stage");
        assert_eq!(
            relative_to(root, &root.join("docs/a.txt")),
            Path::new("./docs/a.txt")
        );
        assert_eq!(
            relative_to(&stage, &root.join("docs/a.txt")),
            Path::new("../../docs/a.txt")
        );
        assert_eq!(
            relative_to(&stage, &stage.join("0/hi.txt")),
            Path::new("./0/hi.txt")
        );
        // A name that looks like an option never comes first.
        assert_eq!(relative_to(root, &root.join("-rf")), Path::new("./-rf"));
    }

    #[test]
    fn only_a_worker_that_needs_it_gets_relative_paths() {
        let mut b = Bound::default();
        b.subst.insert("p".into(), "/w/x.txt".into());
        b.subst.insert("text".into(), "/w/not-a-path".into());
        b.arguments.insert("p".into(), "/w/x.txt".into());
        let before = Bound {
            subst: b.subst.clone(),
            arguments: b.arguments.clone(),
            ..Bound::default()
        };
        hand_to_worker(&WorkerReach::Absolute, &mut b, Path::new("/w"), ["p"]);
        assert_eq!(b, before);
        let reach = WorkerReach::FromWorkingDir {
            unsearchable: "/".into(),
            mode: 0o700,
        };
        hand_to_worker(&reach, &mut b, Path::new("/w"), ["p"]);
        assert_eq!(b.subst["p"], "./x.txt");
        assert_eq!(b.arguments["p"], "./x.txt");
        // Only the path arguments named change.
        assert_eq!(b.subst["text"], "/w/not-a-path");
    }
}
