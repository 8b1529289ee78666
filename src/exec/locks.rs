//! Output-target locks: writes to one workspace path from different sessions serialize.

use std::collections::HashMap;
use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex, Weak};

use tokio::sync::OwnedMutexGuard;

#[derive(Default)]
pub struct TargetLocks {
    locks: Mutex<HashMap<PathBuf, Weak<tokio::sync::Mutex<()>>>>,
}

impl TargetLocks {
    fn get(&self, path: &Path) -> Arc<tokio::sync::Mutex<()>> {
        let mut map = self.locks.lock().unwrap_or_else(|p| p.into_inner());
        // Forget the entries no call holds any more, so the map stays small.
        map.retain(|_, w| w.strong_count() > 0);
        if let Some(l) = map.get(path).and_then(Weak::upgrade) {
            return l;
        }
        let l = Arc::new(tokio::sync::Mutex::new(()));
        map.insert(path.to_path_buf(), Arc::downgrade(&l));
        l
    }

    /// Takes the lock of every path, in the order given (the caller sorts, so two calls
    /// can never wait on each other).
    pub async fn lock_all(&self, sorted: &[PathBuf]) -> Vec<OwnedMutexGuard<()>> {
        let mut guards = Vec::with_capacity(sorted.len());
        for p in sorted {
            guards.push(self.get(p).lock_owned().await);
        }
        guards
    }
}
