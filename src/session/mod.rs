//! Sessions: a JSON state object with a version, one async lock each, persisted one file per
//! session in `state_dir/sessions/`, tombstones for destroyed ids.
//!
//! Mutators hold the session's [`SessionGuard`] from before they clone the state until after
//! they commit. Readers never take the lock: they read the last committed snapshot.

use std::collections::HashMap;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex, RwLock};

use serde::{Deserialize, Serialize};
use serde_json::{Map, Value};

use crate::fsutil;

#[derive(Debug, thiserror::Error)]
pub enum SessionError {
    #[error("no session {0:?}")]
    NotFound(String),
    #[error("session {0:?} was destroyed (SessionDestroyed)")]
    Destroyed(String),
    #[error("session {0:?} already exists")]
    Exists(String),
    #[error(transparent)]
    BadId(#[from] IdError),
    #[error("cannot {op} {path}: {source}")]
    Io {
        op: &'static str,
        path: PathBuf,
        source: std::io::Error,
    },
    #[error("corrupt session file {path}: {reason}")]
    Corrupt { path: PathBuf, reason: String },
}

/// A committed snapshot of one session.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Snapshot {
    pub id: String,
    pub version: u64,
    pub state: Map<String, Value>,
    /// The uid of the principal that created it (None: a session file from before owners
    /// were recorded; only `admin` reaches it).
    #[serde(default)]
    pub owner: Option<u32>,
}

/// The on-disk form of a session (or its tombstone).
#[derive(Debug, Serialize, Deserialize)]
struct SessionFile {
    id: String,
    version: u64,
    #[serde(default)]
    state: Map<String, Value>,
    /// The job whose commit wrote this file: recovery's test of the commit point.
    #[serde(default)]
    last_job: Option<String>,
    #[serde(default)]
    destroyed: bool,
    /// The creator's uid; kept in the tombstone too.
    #[serde(default)]
    owner: Option<u32>,
}

struct Session {
    /// Serializes mutators and destruction.
    lock: Arc<tokio::sync::Mutex<()>>,
    /// Set under `lock` by destruction; a mutator that gets the lock afterwards fails.
    destroyed: AtomicBool,
    current: RwLock<Snapshot>,
}

/// Exclusive right to mutate one session, held from clone to commit.
pub struct SessionGuard {
    session: Arc<Session>,
    _lock: tokio::sync::OwnedMutexGuard<()>,
}

impl SessionGuard {
    pub fn snapshot(&self) -> Snapshot {
        read(&self.session.current).clone()
    }
}

pub struct SessionStore {
    dir: PathBuf,
    sessions: Mutex<HashMap<String, Arc<Session>>>,
    /// Destroyed ids and the owner each had.
    tombstones: Mutex<HashMap<String, Option<u32>>>,
    dir_sync: DirSync,
}

/// Group commit of the sessions dir: every commit renames its own file into place, then
/// needs the dir fsynced. Concurrent commits share one fsync: a commit returns once an fsync
/// of the dir that began after its rename has succeeded, and while one runs, the commits
/// renamed meanwhile wait for the next one, which one of them runs for all.
#[derive(Default)]
struct DirSync {
    state: Mutex<SyncState>,
    synced: std::sync::Condvar,
}

#[derive(Default)]
struct SyncState {
    /// Renames done so far (each commit's ticket).
    renamed: u64,
    /// Every rename up to this ticket is durable.
    durable: u64,
    /// An fsync of the dir is running.
    running: bool,
}

impl DirSync {
    /// Called right after a rename into `dir`; returns once that rename is durable (or the
    /// fsync that was to make it so failed: then this commit fails, as before).
    fn after_rename(&self, dir: &Path) -> std::io::Result<()> {
        let mut s = lock(&self.state);
        s.renamed += 1;
        let mine = s.renamed;
        loop {
            if s.durable >= mine {
                return Ok(());
            }
            if !s.running {
                // Every ticket up to `upto` has finished its rename: this fsync covers them.
                let upto = s.renamed;
                s.running = true;
                drop(s);
                let r = std::fs::File::open(dir).and_then(|f| f.sync_all());
                s = lock(&self.state);
                s.running = false;
                if r.is_ok() {
                    s.durable = s.durable.max(upto);
                }
                self.synced.notify_all();
                // A failed fsync fails its runner; the others try again themselves.
                r?;
                continue;
            }
            s = self.synced.wait(s).unwrap_or_else(|p| p.into_inner());
        }
    }
}

fn read<T>(l: &RwLock<T>) -> std::sync::RwLockReadGuard<'_, T> {
    l.read().unwrap_or_else(|p| p.into_inner())
}

fn write<T>(l: &RwLock<T>) -> std::sync::RwLockWriteGuard<'_, T> {
    l.write().unwrap_or_else(|p| p.into_inner())
}

fn lock<T>(m: &Mutex<T>) -> std::sync::MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|p| p.into_inner())
}

/// The longest session id.
pub const MAX_ID_LEN: usize = 64;

/// What is wrong with a session id a client named. Messages show at most a prefix of it.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum IdError {
    #[error("a session id cannot be empty; use 1 to {MAX_ID_LEN} letters, digits, '-' or '_'")]
    Empty,
    #[error("session id {shown} is {len} bytes; a session id is at most {MAX_ID_LEN} bytes")]
    TooLong { shown: String, len: usize },
    #[error(
        "session id {shown} holds {found:?} at byte {at}; use only letters, digits, '-' or '_'"
    )]
    BadChar {
        shown: String,
        found: char,
        at: usize,
    },
}

/// Checks a session id: 1 to [`MAX_ID_LEN`] ASCII letters, digits, '-' or '_'. Every id a
/// client names (to create, read, mutate or destroy a session) passes here first, so no
/// lookup, message, audit event or file name ever holds anything else.
pub fn check_id(id: &str) -> Result<(), IdError> {
    let shown = || crate::exec::args::shown(id);
    if id.is_empty() {
        return Err(IdError::Empty);
    }
    if id.len() > MAX_ID_LEN {
        return Err(IdError::TooLong {
            shown: shown(),
            len: id.len(),
        });
    }
    if let Some((at, found)) = id
        .char_indices()
        .find(|(_, c)| !(c.is_ascii_alphanumeric() || *c == '-' || *c == '_'))
    {
        return Err(IdError::BadChar {
            shown: shown(),
            found,
            at,
        });
    }
    Ok(())
}

pub fn valid_id(id: &str) -> bool {
    check_id(id).is_ok()
}

impl SessionStore {
    /// Opens `state_dir/sessions/`, creating it (0700) if needed, and loads every session.
    pub fn open(state_dir: &Path) -> Result<SessionStore, SessionError> {
        let dir = state_dir.join("sessions");
        fsutil::create_private_dir(&dir).map_err(|source| SessionError::Io {
            op: "create",
            path: dir.clone(),
            source,
        })?;
        let mut sessions = HashMap::new();
        let mut tombstones = HashMap::new();
        let entries = std::fs::read_dir(&dir).map_err(|source| SessionError::Io {
            op: "list",
            path: dir.clone(),
            source,
        })?;
        for entry in entries.flatten() {
            let path = entry.path();
            let name = entry.file_name();
            if name.to_string_lossy().starts_with('.') && name.to_string_lossy().ends_with(".tmp") {
                // A write that crashed before its rename never committed: drop its temp file.
                crate::failpoint::hit("session.remove_tmp")
                    .and_then(|()| std::fs::remove_file(&path))
                    .map_err(|source| SessionError::Io {
                        op: "remove stale temp file",
                        path: path.clone(),
                        source,
                    })?;
                continue;
            }
            if path.extension().is_none_or(|x| x != "json") {
                continue;
            }
            let file = read_file(&path)?;
            if file.destroyed {
                tombstones.insert(file.id, file.owner);
                continue;
            }
            let snap = Snapshot {
                id: file.id.clone(),
                version: file.version,
                state: file.state,
                owner: file.owner,
            };
            sessions.insert(file.id, Arc::new(Session::new(snap)));
        }
        Ok(SessionStore {
            dir,
            sessions: Mutex::new(sessions),
            tombstones: Mutex::new(tombstones),
            dir_sync: DirSync::default(),
        })
    }

    fn path(&self, id: &str) -> PathBuf {
        self.dir.join(format!("{id}.json"))
    }

    fn get(&self, id: &str) -> Result<Arc<Session>, SessionError> {
        check_id(id)?;
        if let Some(s) = lock(&self.sessions).get(id) {
            return Ok(s.clone());
        }
        if lock(&self.tombstones).contains_key(id) {
            return Err(SessionError::Destroyed(id.to_string()));
        }
        Err(SessionError::NotFound(id.to_string()))
    }

    /// The owner of a live or destroyed session (`Ok(None)`: one from before owners were
    /// recorded); `NotFound` for an id never created.
    pub fn owner(&self, id: &str) -> Result<Option<u32>, SessionError> {
        check_id(id)?;
        if let Some(s) = lock(&self.sessions).get(id) {
            return Ok(read(&s.current).owner);
        }
        if let Some(owner) = lock(&self.tombstones).get(id) {
            return Ok(*owner);
        }
        Err(SessionError::NotFound(id.to_string()))
    }

    /// The last committed snapshot, without taking the session's lock.
    pub fn snapshot(&self, id: &str) -> Result<Snapshot, SessionError> {
        Ok(read(&self.get(id)?.current).clone())
    }

    pub fn list(&self) -> Vec<Snapshot> {
        let sessions = lock(&self.sessions);
        let mut out: Vec<Snapshot> = sessions
            .values()
            .map(|s| read(&s.current).clone())
            .collect();
        out.sort_by(|a, b| a.id.cmp(&b.id));
        out
    }

    /// Creates a session at version 0, owned by `owner` (a uid), and persists it.
    pub fn create(
        &self,
        id: &str,
        state: Map<String, Value>,
        owner: u32,
    ) -> Result<Snapshot, SessionError> {
        check_id(id)?;
        // Holding the map lock across the write keeps two creators of one id apart.
        let mut sessions = lock(&self.sessions);
        if sessions.contains_key(id) {
            return Err(SessionError::Exists(id.to_string()));
        }
        if lock(&self.tombstones).contains_key(id) {
            return Err(SessionError::Destroyed(id.to_string()));
        }
        let snap = Snapshot {
            id: id.to_string(),
            version: 0,
            state,
            owner: Some(owner),
        };
        self.persist(&snap, None, false)?;
        sessions.insert(id.to_string(), Arc::new(Session::new(snap.clone())));
        Ok(snap)
    }

    /// Waits for the session's lock. Fails with `Destroyed` if the session was destroyed
    /// while this caller was queued, so a queued mutator can never commit to it.
    pub async fn lock(&self, id: &str) -> Result<SessionGuard, SessionError> {
        let session = self.get(id)?;
        let guard = session.lock.clone().lock_owned().await;
        if session.destroyed.load(Ordering::SeqCst) {
            return Err(SessionError::Destroyed(id.to_string()));
        }
        Ok(SessionGuard {
            session,
            _lock: guard,
        })
    }

    /// The commit point of a mutating call: persists `state` at the next version, recording
    /// `job`, then makes it visible to readers.
    pub fn commit(
        &self,
        guard: &SessionGuard,
        state: Map<String, Value>,
        job: &str,
    ) -> Result<Snapshot, SessionError> {
        let cur = guard.snapshot();
        let next = Snapshot {
            id: cur.id,
            version: cur.version + 1,
            state,
            owner: cur.owner,
        };
        self.persist(&next, Some(job), false)?;
        *write(&guard.session.current) = next.clone();
        Ok(next)
    }

    /// Destroys a session under its lock: marks it destroyed, writes the tombstone, then
    /// forgets the state.
    pub fn destroy(&self, guard: SessionGuard) -> Result<Snapshot, SessionError> {
        let snap = guard.snapshot();
        self.persist(&snap, None, true)?;
        guard.session.destroyed.store(true, Ordering::SeqCst);
        lock(&self.tombstones).insert(snap.id.clone(), snap.owner);
        lock(&self.sessions).remove(&snap.id);
        Ok(snap)
    }

    /// Whether the session file records `job` as its last commit (recovery's question).
    pub fn committed(&self, id: &str, job: &str) -> Result<bool, SessionError> {
        let path = self.path(id);
        if !path.exists() {
            return Ok(false);
        }
        let file = read_file(&path)?;
        Ok(!file.destroyed && file.last_job.as_deref() == Some(job))
    }

    fn persist(
        &self,
        snap: &Snapshot,
        job: Option<&str>,
        destroyed: bool,
    ) -> Result<(), SessionError> {
        let file = SessionFile {
            id: snap.id.clone(),
            version: snap.version,
            state: if destroyed {
                Map::new()
            } else {
                snap.state.clone()
            },
            last_job: job.map(str::to_string),
            destroyed,
            owner: snap.owner,
        };
        let bytes = serde_json::to_vec_pretty(&file).map_err(|e| SessionError::Corrupt {
            path: self.path(&snap.id),
            reason: e.to_string(),
        })?;
        let name = format!("{}.json", snap.id);
        fsutil::atomic_write_no_dir_sync(&self.dir, &name, &bytes, 0o600, "session.write")
            .and_then(|()| self.dir_sync.after_rename(&self.dir))
            .map_err(|source| SessionError::Io {
                op: "write",
                path: self.path(&snap.id),
                source,
            })
    }
}

impl Session {
    fn new(snap: Snapshot) -> Session {
        Session {
            lock: Arc::new(tokio::sync::Mutex::new(())),
            destroyed: AtomicBool::new(false),
            current: RwLock::new(snap),
        }
    }
}

fn read_file(path: &Path) -> Result<SessionFile, SessionError> {
    let bytes = std::fs::read(path).map_err(|source| SessionError::Io {
        op: "read",
        path: path.to_path_buf(),
        source,
    })?;
    serde_json::from_slice(&bytes).map_err(|e| SessionError::Corrupt {
        path: path.to_path_buf(),
        reason: e.to_string(),
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[tokio::test]
    async fn concurrent_commits_through_the_group_dir_sync_all_persist() {
        let dir = tempfile::tempdir().unwrap();
        let store = Arc::new(SessionStore::open(dir.path()).unwrap());
        for i in 0..16 {
            store.create(&format!("s{i}"), Map::new(), 0).unwrap();
        }
        let mut guards = Vec::new();
        for i in 0..16 {
            guards.push(store.lock(&format!("s{i}")).await.unwrap());
        }
        // 16 threads commit 20 times each, all at once, through the group-committed dir sync.
        std::thread::scope(|scope| {
            for (i, g) in guards.iter().enumerate() {
                let store = &store;
                scope.spawn(move || {
                    for n in 1..=20u64 {
                        let mut st = Map::new();
                        st.insert("n".into(), n.into());
                        let snap = store.commit(g, st, &format!("job-{i}-{n}")).unwrap();
                        assert_eq!(snap.version, n);
                    }
                });
            }
        });
        let sync = lock(&store.dir_sync.state);
        assert_eq!(sync.renamed, 16 + 16 * 20, "one ticket per write");
        assert_eq!(sync.durable, sync.renamed, "every write made durable");
        assert!(!sync.running);
        drop(sync);
        drop(guards);
        let reopened = SessionStore::open(dir.path()).unwrap();
        for i in 0..16 {
            let snap = reopened.snapshot(&format!("s{i}")).unwrap();
            assert_eq!(snap.version, 20);
            assert_eq!(snap.state["n"], 20);
            assert!(reopened
                .committed(&format!("s{i}"), &format!("job-{i}-20"))
                .unwrap());
        }
    }

    #[tokio::test]
    async fn commit_persists_and_destroy_tombstones() {
        let dir = tempfile::tempdir().unwrap();
        let store = SessionStore::open(dir.path()).unwrap();
        store.create("s1", Map::new(), 0).unwrap();
        let g = store.lock("s1").await.unwrap();
        let mut st = Map::new();
        st.insert("n".into(), 1.into());
        let snap = store.commit(&g, st, "job1").unwrap();
        assert_eq!(snap.version, 1);
        assert!(store.committed("s1", "job1").unwrap());
        drop(g);
        let reopened = SessionStore::open(dir.path()).unwrap();
        assert_eq!(reopened.snapshot("s1").unwrap().version, 1);
        let g = reopened.lock("s1").await.unwrap();
        reopened.destroy(g).unwrap();
        assert!(matches!(
            reopened.lock("s1").await,
            Err(SessionError::Destroyed(_))
        ));
        let again = SessionStore::open(dir.path()).unwrap();
        assert!(matches!(
            again.create("s1", Map::new(), 0),
            Err(SessionError::Destroyed(_))
        ));
    }

    #[tokio::test]
    async fn owner_persists_through_commit_destroy_and_restart() {
        let dir = tempfile::tempdir().unwrap();
        let store = SessionStore::open(dir.path()).unwrap();
        store.create("mine", Map::new(), 1234).unwrap();
        let g = store.lock("mine").await.unwrap();
        assert_eq!(store.commit(&g, Map::new(), "j").unwrap().owner, Some(1234));
        drop(g);
        let reopened = SessionStore::open(dir.path()).unwrap();
        assert_eq!(reopened.owner("mine").unwrap(), Some(1234));
        let g = reopened.lock("mine").await.unwrap();
        reopened.destroy(g).unwrap();
        assert_eq!(reopened.owner("mine").unwrap(), Some(1234));
        let again = SessionStore::open(dir.path()).unwrap();
        assert_eq!(
            again.owner("mine").unwrap(),
            Some(1234),
            "the tombstone keeps it"
        );
        assert!(matches!(
            again.owner("never"),
            Err(SessionError::NotFound(_))
        ));
    }

    #[tokio::test]
    async fn queued_mutator_fails_after_destroy() {
        let dir = tempfile::tempdir().unwrap();
        let store = Arc::new(SessionStore::open(dir.path()).unwrap());
        store.create("s", Map::new(), 0).unwrap();
        let destroyer = store.lock("s").await.unwrap();
        let s2 = store.clone();
        let queued = tokio::spawn(async move { s2.lock("s").await.map(|_| ()) });
        tokio::task::yield_now().await;
        store.destroy(destroyer).unwrap();
        assert!(matches!(
            queued.await.unwrap(),
            Err(SessionError::Destroyed(_))
        ));
    }
}
