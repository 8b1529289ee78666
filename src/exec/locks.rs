//! Output-target locks: writes to one workspace path from different sessions serialize, and
//! so do writes to a path and to anything beneath it (a directory output and a file in it).
//!
//! A call locks each of its targets exclusively and every ancestor of each target shared:
//! two targets one inside the other meet at the outer one (exclusive against shared), and
//! siblings share their common ancestors. Every call takes its locks in one global order
//! (sorted by path, an ancestor before what is beneath it), so two calls never wait on each
//! other in a cycle.

use std::collections::{BTreeMap, HashMap};
use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex, Weak};

use tokio::sync::{OwnedRwLockReadGuard, OwnedRwLockWriteGuard, RwLock};

/// One held lock of a call, kept until the call returns.
pub enum TargetGuard {
    /// An ancestor of a target.
    Shared(#[allow(dead_code)] OwnedRwLockReadGuard<()>),
    /// A target.
    Exclusive(#[allow(dead_code)] OwnedRwLockWriteGuard<()>),
}

#[derive(Default)]
pub struct TargetLocks {
    locks: Mutex<HashMap<PathBuf, Weak<RwLock<()>>>>,
}

/// The locks a call with these targets takes, in the order it takes them: each target
/// exclusive (`true`), each proper ancestor of a target shared, sorted by path.
pub fn plan(targets: &[PathBuf]) -> Vec<(PathBuf, bool)> {
    let mut want: BTreeMap<PathBuf, bool> = BTreeMap::new();
    for t in targets {
        for a in t.ancestors().skip(1) {
            if a.as_os_str().is_empty() {
                continue;
            }
            want.entry(a.to_path_buf()).or_insert(false);
        }
        want.insert(t.clone(), true);
    }
    want.into_iter().collect()
}

impl TargetLocks {
    fn get(&self, path: &Path) -> Arc<RwLock<()>> {
        let mut map = self.locks.lock().unwrap_or_else(|p| p.into_inner());
        // Forget the entries no call holds any more, so the map stays small.
        map.retain(|_, w| w.strong_count() > 0);
        if let Some(l) = map.get(path).and_then(Weak::upgrade) {
            return l;
        }
        let l = Arc::new(RwLock::new(()));
        map.insert(path.to_path_buf(), Arc::downgrade(&l));
        l
    }

    /// Locks `targets` exclusively and their ancestors shared, in [`plan`]'s order.
    pub async fn lock_all(&self, targets: &[PathBuf]) -> Vec<TargetGuard> {
        let plan = plan(targets);
        let mut guards = Vec::with_capacity(plan.len());
        for (p, exclusive) in plan {
            let l = self.get(&p);
            guards.push(if exclusive {
                TargetGuard::Exclusive(l.write_owned().await)
            } else {
                TargetGuard::Shared(l.read_owned().await)
            });
        }
        guards
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn p(s: &str) -> PathBuf {
        PathBuf::from(s)
    }

    #[test]
    fn a_target_is_exclusive_and_its_ancestors_shared_in_path_order() {
        assert_eq!(
            plan(&[p("d/a.txt"), p("b")]),
            vec![(p("b"), true), (p("d"), false), (p("d/a.txt"), true)]
        );
        assert_eq!(plan(&[p("d")]), vec![(p("d"), true)]);
        assert_eq!(
            plan(&[p("x/y/z")]),
            vec![(p("x"), false), (p("x/y"), false), (p("x/y/z"), true)]
        );
    }

    /// A directory target and a file inside it exclude each other; siblings do not.
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn a_directory_and_a_file_beneath_it_serialize_and_siblings_do_not() {
        let locks = Arc::new(TargetLocks::default());
        let held = locks.lock_all(&[p("d")]).await;
        let l2 = locks.clone();
        let inner = tokio::spawn(async move { l2.lock_all(&[p("d/a.txt")]).await.len() });
        tokio::task::yield_now().await;
        assert!(!inner.is_finished());
        drop(held);
        assert_eq!(inner.await.unwrap(), 2);
        let a = locks.lock_all(&[p("d/a.txt")]).await;
        let b = tokio::time::timeout(
            std::time::Duration::from_secs(10),
            locks.lock_all(&[p("d/b.txt")]),
        )
        .await
        .expect("siblings share their parent");
        drop((a, b));
    }

    /// Many calls taking overlapping sets (a directory, files in it, deeper trees) in every
    /// order of their arguments all finish: one global order, no cycle.
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn overlapping_trees_locked_in_any_argument_order_never_deadlock() {
        let locks = Arc::new(TargetLocks::default());
        let sets: Vec<Vec<PathBuf>> = vec![
            vec![p("d"), p("e/x")],
            vec![p("e/x/y"), p("d/a.txt")],
            vec![p("d/a.txt"), p("e")],
            vec![p("e"), p("d")],
            vec![p("d/a.txt/deeper"), p("e/x")],
        ];
        let mut tasks = Vec::new();
        for round in 0..50 {
            for (i, set) in sets.iter().enumerate() {
                let mut set = set.clone();
                if (round + i) % 2 == 0 {
                    set.reverse();
                }
                let l = locks.clone();
                tasks.push(tokio::spawn(async move {
                    let g = l.lock_all(&set).await;
                    tokio::task::yield_now().await;
                    drop(g);
                }));
            }
        }
        let all = futures_join(tasks);
        tokio::time::timeout(std::time::Duration::from_secs(60), all)
            .await
            .expect("a deadlock: some calls never got their locks");
    }

    async fn futures_join(tasks: Vec<tokio::task::JoinHandle<()>>) {
        for t in tasks {
            t.await.unwrap();
        }
    }
}
