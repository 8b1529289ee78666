//! Sessions: a JSON state object with a version, one async lock each, persisted one file per
//! session in `state_dir/sessions/`, tombstones for destroyed ids.
//!
//! Mutators hold the session's [`SessionGuard`] from before they load the state until after
//! they commit. Readers never take the lock: they read the last committed file.
//!
//! Memory holds only what is bounded per session (its id, version, owner and state size);
//! the state itself is read from its file when a call needs it, and tombstones stay on disk.
//! Each owner's sessions are bounded in count and state bytes ([`SessionLimits`]), counted
//! again from the files at every start.

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
    #[error(transparent)]
    Quota(#[from] QuotaError),
}

/// A bound of [`SessionLimits`] that a create or a commit would pass: nothing was created
/// or committed.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum QuotaError {
    #[error("uid {uid} already holds {held} live sessions, the most max_sessions_per_principal ({limit}) allows; destroy one first")]
    Sessions { uid: u32, held: usize, limit: usize },
    #[error("the state of session {session:?} would be {bytes} bytes (as compact JSON), more than max_session_state_bytes ({limit})")]
    SessionBytes {
        session: String,
        bytes: u64,
        limit: u64,
    },
    #[error("the sessions of uid {uid} hold {held} bytes of state; session {session:?} would add {more}, past max_state_bytes_per_principal ({limit})")]
    PrincipalBytes {
        uid: u32,
        session: String,
        held: u64,
        more: u64,
        limit: u64,
    },
}

/// The bounds of one owner's sessions (`[daemon]` in airlock.toml).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct SessionLimits {
    /// Live sessions one uid may own (`max_sessions_per_principal`).
    pub sessions_per_principal: usize,
    /// The state of one session, as compact JSON (`max_session_state_bytes`).
    pub session_state_bytes: u64,
    /// The states of one uid's live sessions together (`max_state_bytes_per_principal`).
    pub state_bytes_per_principal: u64,
}

impl Default for SessionLimits {
    fn default() -> Self {
        SessionLimits {
            sessions_per_principal: usize::MAX,
            session_state_bytes: u64::MAX,
            state_bytes_per_principal: u64::MAX,
        }
    }
}

/// The size a state is counted at: its compact JSON.
pub fn state_bytes(state: &Map<String, Value>) -> u64 {
    serde_json::to_vec(state).map_or(u64::MAX, |v| v.len() as u64)
}

/// What one owner's live sessions hold.
#[derive(Debug, Default, Clone, Copy, PartialEq, Eq)]
pub struct Usage {
    pub sessions: usize,
    /// Committed state bytes, plus the growth commits have reserved and not yet made.
    pub bytes: u64,
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

/// What memory keeps of a session: everything but its state.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Meta {
    pub id: String,
    pub version: u64,
    pub owner: Option<u32>,
    /// The committed state's size as compact JSON ([`state_bytes`]).
    pub bytes: u64,
}

struct Session {
    /// Serializes mutators and destruction.
    lock: Arc<tokio::sync::Mutex<()>>,
    /// Set under `lock` by destruction; a mutator that gets the lock afterwards fails.
    destroyed: AtomicBool,
    current: RwLock<Meta>,
}

/// Exclusive right to mutate one session, held from load to commit.
pub struct SessionGuard {
    session: Arc<Session>,
    _lock: tokio::sync::OwnedMutexGuard<()>,
}

impl SessionGuard {
    /// The committed version, owner and size (no file read).
    pub fn meta(&self) -> Meta {
        read(&self.session.current).clone()
    }
}

/// Room a commit has taken in its owner's state bytes before publication; given back
/// when dropped uncommitted.
pub struct Reserved<'a> {
    store: &'a SessionStore,
    owner: Option<u32>,
    /// The growth added to the owner's bytes.
    grown: u64,
    /// The new state's size.
    bytes: u64,
    committed: bool,
}

impl Reserved<'_> {
    /// The new state's size.
    pub fn bytes(&self) -> u64 {
        self.bytes
    }
}

impl Drop for Reserved<'_> {
    fn drop(&mut self) {
        if self.committed {
            return;
        }
        if let Some(uid) = self.owner {
            let mut usage = lock(&self.store.usage);
            if let Some(u) = usage.get_mut(&uid) {
                u.bytes = u.bytes.saturating_sub(self.grown);
            }
        }
    }
}

pub struct SessionStore {
    dir: PathBuf,
    sessions: Mutex<HashMap<String, Arc<Session>>>,
    /// Each owner's live sessions and state bytes (recounted from the files at open).
    usage: Mutex<HashMap<u32, Usage>>,
    limits: SessionLimits,
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
    let shown = || crate::text::shown(id);
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
        let mut usage: HashMap<u32, Usage> = HashMap::new();
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
                // A tombstone stays on disk only: `get` reads it when its id is named.
                continue;
            }
            let meta = Meta {
                id: file.id.clone(),
                version: file.version,
                owner: file.owner,
                bytes: state_bytes(&file.state),
            };
            if let Some(uid) = meta.owner {
                let u = usage.entry(uid).or_default();
                u.sessions += 1;
                u.bytes = u.bytes.saturating_add(meta.bytes);
            }
            sessions.insert(file.id, Arc::new(Session::new(meta)));
        }
        Ok(SessionStore {
            dir,
            sessions: Mutex::new(sessions),
            usage: Mutex::new(usage),
            limits: SessionLimits::default(),
            dir_sync: DirSync::default(),
        })
    }

    /// Applies the bounds of `[daemon]` to every create and commit from now on. Sessions
    /// that were already past them stay; their owner's creates and growing commits are
    /// refused until back under.
    pub fn set_limits(&mut self, limits: SessionLimits) {
        self.limits = limits;
    }

    /// What `uid`'s live sessions hold.
    pub fn usage(&self, uid: u32) -> Usage {
        lock(&self.usage).get(&uid).copied().unwrap_or_default()
    }

    /// The owner recorded in the tombstone of `id`, if `id` was destroyed (`Ok(None)` if
    /// there is no tombstone; `Ok(Some(None))` a tombstone from before owners were recorded).
    fn tombstone(&self, id: &str) -> Result<Option<Option<u32>>, SessionError> {
        let path = self.path(id);
        match std::fs::symlink_metadata(&path) {
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(None),
            Err(source) => {
                return Err(SessionError::Io {
                    op: "stat",
                    path,
                    source,
                })
            }
            Ok(_) => {}
        }
        let file = read_file(&path)?;
        Ok(file.destroyed.then_some(file.owner))
    }

    fn path(&self, id: &str) -> PathBuf {
        self.dir.join(format!("{id}.json"))
    }

    fn get(&self, id: &str) -> Result<Arc<Session>, SessionError> {
        check_id(id)?;
        if let Some(s) = lock(&self.sessions).get(id) {
            return Ok(s.clone());
        }
        if self.tombstone(id)?.is_some() {
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
        if let Some(owner) = self.tombstone(id)? {
            return Ok(owner);
        }
        Err(SessionError::NotFound(id.to_string()))
    }

    /// Whether `id` names a live session (no file is read).
    pub fn is_live(&self, id: &str) -> bool {
        lock(&self.sessions).contains_key(id)
    }

    /// The last committed snapshot, read from its file without taking the session's lock.
    pub fn snapshot(&self, id: &str) -> Result<Snapshot, SessionError> {
        let session = self.get(id)?;
        let meta = read(&session.current).clone();
        self.load(&meta)
    }

    /// Reads the committed state of the session `meta` describes from its file.
    fn load(&self, meta: &Meta) -> Result<Snapshot, SessionError> {
        let path = self.path(&meta.id);
        let file = match read_file(&path) {
            Err(SessionError::Io { source, .. })
                if source.kind() == std::io::ErrorKind::NotFound =>
            {
                return Err(SessionError::NotFound(meta.id.clone()))
            }
            r => r?,
        };
        if file.destroyed {
            return Err(SessionError::Destroyed(meta.id.clone()));
        }
        Ok(Snapshot {
            id: file.id,
            version: file.version,
            state: file.state,
            owner: file.owner,
        })
    }

    /// The state of the session `guard` holds, read from its file under the lock: the
    /// version the next commit follows.
    pub fn load_locked(&self, guard: &SessionGuard) -> Result<Snapshot, SessionError> {
        self.load(&guard.meta())
    }

    /// Every live session, without its state, sorted by id.
    pub fn list(&self) -> Vec<Meta> {
        let sessions = lock(&self.sessions);
        let mut out: Vec<Meta> = sessions
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
        // Holding the map lock across the write keeps two creators of one id apart, and
        // two creates of one owner from both taking its last room.
        let mut sessions = lock(&self.sessions);
        if sessions.contains_key(id) {
            return Err(SessionError::Exists(id.to_string()));
        }
        if self.tombstone(id)?.is_some() {
            return Err(SessionError::Destroyed(id.to_string()));
        }
        let bytes = state_bytes(&state);
        {
            let mut usage = lock(&self.usage);
            let u = usage.entry(owner).or_default();
            self.quota_for_create(id, bytes, owner, *u)?;
            // Counted before the write (under the map lock, so no other create of this
            // owner runs), given back if it fails.
            u.sessions += 1;
            u.bytes = u.bytes.saturating_add(bytes);
        }
        let snap = Snapshot {
            id: id.to_string(),
            version: 0,
            state,
            owner: Some(owner),
        };
        if let Err(e) = self.persist(&snap, None, false) {
            let mut usage = lock(&self.usage);
            if let Some(u) = usage.get_mut(&owner) {
                u.sessions = u.sessions.saturating_sub(1);
                u.bytes = u.bytes.saturating_sub(bytes);
            }
            return Err(e);
        }
        let meta = Meta {
            id: snap.id.clone(),
            version: 0,
            owner: snap.owner,
            bytes,
        };
        sessions.insert(id.to_string(), Arc::new(Session::new(meta)));
        Ok(snap)
    }

    /// Whether `owner` may create session `id` with `state` now: the id is not destroyed
    /// and the bounds hold (the checks `create` repeats; a create may still fail if others
    /// of the owner's run meanwhile).
    pub fn check_create(
        &self,
        id: &str,
        state: &Map<String, Value>,
        owner: u32,
    ) -> Result<(), SessionError> {
        check_id(id)?;
        if self.tombstone(id)?.is_some() {
            return Err(SessionError::Destroyed(id.to_string()));
        }
        let u = self.usage(owner);
        Ok(self.quota_for_create(id, state_bytes(state), owner, u)?)
    }

    fn quota_for_create(
        &self,
        id: &str,
        bytes: u64,
        owner: u32,
        u: Usage,
    ) -> Result<(), QuotaError> {
        let l = self.limits;
        if bytes > l.session_state_bytes {
            return Err(QuotaError::SessionBytes {
                session: id.to_string(),
                bytes,
                limit: l.session_state_bytes,
            });
        }
        if u.sessions >= l.sessions_per_principal {
            return Err(QuotaError::Sessions {
                uid: owner,
                held: u.sessions,
                limit: l.sessions_per_principal,
            });
        }
        if u.bytes.saturating_add(bytes) > l.state_bytes_per_principal {
            return Err(QuotaError::PrincipalBytes {
                uid: owner,
                session: id.to_string(),
                held: u.bytes,
                more: bytes,
                limit: l.state_bytes_per_principal,
            });
        }
        Ok(())
    }

    /// Takes room for the session `guard` holds to commit `state`: refused with
    /// [`QuotaError`] if the state is past `max_session_state_bytes` or its owner's
    /// sessions would pass `max_state_bytes_per_principal`. Called before publication, so
    /// a refused commit publishes nothing; the room is held until the commit or the drop.
    pub fn reserve(
        &self,
        guard: &SessionGuard,
        state: &Map<String, Value>,
    ) -> Result<Reserved<'_>, SessionError> {
        let meta = guard.meta();
        let bytes = state_bytes(state);
        let l = self.limits;
        if bytes > l.session_state_bytes {
            return Err(QuotaError::SessionBytes {
                session: meta.id,
                bytes,
                limit: l.session_state_bytes,
            }
            .into());
        }
        let grown = bytes.saturating_sub(meta.bytes);
        if let (Some(uid), true) = (meta.owner, grown > 0) {
            let mut usage = lock(&self.usage);
            let u = usage.entry(uid).or_default();
            if u.bytes.saturating_add(grown) > l.state_bytes_per_principal {
                return Err(QuotaError::PrincipalBytes {
                    uid,
                    session: meta.id,
                    held: u.bytes,
                    more: grown,
                    limit: l.state_bytes_per_principal,
                }
                .into());
            }
            u.bytes = u.bytes.saturating_add(grown);
        }
        Ok(Reserved {
            store: self,
            owner: meta.owner,
            grown,
            bytes,
            committed: false,
        })
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

    /// [`SessionStore::reserve`], then [`SessionStore::commit_reserved`].
    pub fn commit(
        &self,
        guard: &SessionGuard,
        state: Map<String, Value>,
        job: &str,
    ) -> Result<Snapshot, SessionError> {
        let reserved = self.reserve(guard, &state)?;
        self.commit_reserved(guard, reserved, state, job)
    }

    /// The commit point of a mutating call: persists `state` (the one `reserved` was taken
    /// for) at the next version, recording `job`, then makes it visible to readers.
    pub fn commit_reserved(
        &self,
        guard: &SessionGuard,
        mut reserved: Reserved<'_>,
        state: Map<String, Value>,
        job: &str,
    ) -> Result<Snapshot, SessionError> {
        let cur = guard.meta();
        let next = Snapshot {
            id: cur.id,
            version: cur.version + 1,
            state,
            owner: cur.owner,
        };
        self.persist(&next, Some(job), false)?;
        reserved.committed = true;
        let shrunk = cur.bytes.saturating_sub(reserved.bytes);
        if let (Some(uid), true) = (cur.owner, shrunk > 0) {
            if let Some(u) = lock(&self.usage).get_mut(&uid) {
                u.bytes = u.bytes.saturating_sub(shrunk);
            }
        }
        *write(&guard.session.current) = Meta {
            id: next.id.clone(),
            version: next.version,
            owner: next.owner,
            bytes: reserved.bytes,
        };
        Ok(next)
    }

    /// Destroys a session under its lock: marks it destroyed, writes the tombstone, then
    /// forgets it (its count and bytes leave its owner's usage; the tombstone stays on disk).
    pub fn destroy(&self, guard: SessionGuard) -> Result<Meta, SessionError> {
        let meta = guard.meta();
        let tomb = Snapshot {
            id: meta.id.clone(),
            version: meta.version,
            state: Map::new(),
            owner: meta.owner,
        };
        self.persist(&tomb, None, true)?;
        guard.session.destroyed.store(true, Ordering::SeqCst);
        lock(&self.sessions).remove(&meta.id);
        if let Some(uid) = meta.owner {
            if let Some(u) = lock(&self.usage).get_mut(&uid) {
                u.sessions = u.sessions.saturating_sub(1);
                u.bytes = u.bytes.saturating_sub(meta.bytes);
            }
        }
        Ok(meta)
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
        // Compact: the file is the state's counted size plus a few fields.
        let bytes = serde_json::to_vec(&file).map_err(|e| SessionError::Corrupt {
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
    fn new(meta: Meta) -> Session {
        Session {
            lock: Arc::new(tokio::sync::Mutex::new(())),
            destroyed: AtomicBool::new(false),
            current: RwLock::new(meta),
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

    fn limits(sessions: usize, per_session: u64, per_principal: u64) -> SessionLimits {
        SessionLimits {
            sessions_per_principal: sessions,
            session_state_bytes: per_session,
            state_bytes_per_principal: per_principal,
        }
    }

    fn state_of(len: usize) -> Map<String, Value> {
        let mut st = Map::new();
        // {"s":"xxx..."}: 8 bytes of JSON around the string.
        st.insert("s".into(), "x".repeat(len - 8).into());
        st
    }

    #[tokio::test]
    async fn quotas_refuse_creates_and_commits_per_owner_and_count_again_after_reopen() {
        let dir = tempfile::tempdir().unwrap();
        let mut store = SessionStore::open(dir.path()).unwrap();
        store.set_limits(limits(2, 100, 150));
        assert_eq!(state_bytes(&state_of(100)), 100);
        // Past the per-session bound: refused, nothing on disk.
        let e = store.create("big", state_of(101), 7).unwrap_err();
        assert!(
            matches!(
                e,
                SessionError::Quota(QuotaError::SessionBytes {
                    bytes: 101,
                    limit: 100,
                    ..
                })
            ),
            "{e}"
        );
        assert!(!dir.path().join("sessions/big.json").exists());
        store.create("a", state_of(100), 7).unwrap();
        // Past the owner's bytes: refused; another owner is not affected.
        let e = store.create("b", state_of(60), 7).unwrap_err();
        assert!(
            matches!(
                e,
                SessionError::Quota(QuotaError::PrincipalBytes {
                    uid: 7,
                    held: 100,
                    more: 60,
                    limit: 150,
                    ..
                })
            ),
            "{e}"
        );
        assert!(
            e.to_string()
                .contains("max_state_bytes_per_principal (150)"),
            "{e}"
        );
        store.create("other", state_of(100), 8).unwrap();
        store.create("b", state_of(50), 7).unwrap();
        // Past the owner's count.
        let e = store.create("c", Map::new(), 7).unwrap_err();
        assert!(
            matches!(
                e,
                SessionError::Quota(QuotaError::Sessions {
                    uid: 7,
                    held: 2,
                    limit: 2
                })
            ),
            "{e}"
        );
        assert!(
            e.to_string().contains("max_sessions_per_principal (2)"),
            "{e}"
        );
        assert_eq!(
            store.usage(7),
            Usage {
                sessions: 2,
                bytes: 150
            }
        );
        // A commit that grows past the owner's bytes is refused and changes nothing.
        let g = store.lock("b").await.unwrap();
        let e = store.commit(&g, state_of(51), "j1").unwrap_err();
        assert!(
            matches!(e, SessionError::Quota(QuotaError::PrincipalBytes { .. })),
            "{e}"
        );
        assert_eq!(store.load_locked(&g).unwrap().version, 0);
        assert_eq!(store.usage(7).bytes, 150);
        // A dropped reservation gives its room back; a shrinking commit frees room.
        let r = store.reserve(&g, &state_of(50)).unwrap();
        drop(r);
        assert_eq!(store.usage(7).bytes, 150);
        store.commit(&g, state_of(10), "j2").unwrap();
        assert_eq!(store.usage(7).bytes, 110);
        drop(g);
        // Recounted from the files.
        let mut again = SessionStore::open(dir.path()).unwrap();
        again.set_limits(limits(2, 100, 150));
        assert_eq!(
            again.usage(7),
            Usage {
                sessions: 2,
                bytes: 110
            }
        );
        assert_eq!(
            again.usage(8),
            Usage {
                sessions: 1,
                bytes: 100
            }
        );
        assert!(matches!(
            again.create("c", Map::new(), 7),
            Err(SessionError::Quota(QuotaError::Sessions { .. }))
        ));
        // A destroyed session counts toward neither bound; its tombstone stays on disk.
        let g = again.lock("a").await.unwrap();
        again.destroy(g).unwrap();
        assert_eq!(
            again.usage(7),
            Usage {
                sessions: 1,
                bytes: 10
            }
        );
        again.create("c", state_of(100), 7).unwrap();
        assert!(matches!(
            again.create("a", Map::new(), 7),
            Err(SessionError::Destroyed(_))
        ));
        assert_eq!(again.owner("a").unwrap(), Some(7));
        let reopened = SessionStore::open(dir.path()).unwrap();
        assert_eq!(
            reopened.usage(7),
            Usage {
                sessions: 2,
                bytes: 110
            }
        );
        assert!(matches!(
            reopened.snapshot("a"),
            Err(SessionError::Destroyed(_))
        ));
    }

    #[tokio::test]
    async fn memory_holds_no_state_and_reads_see_the_committed_file() {
        let dir = tempfile::tempdir().unwrap();
        let store = SessionStore::open(dir.path()).unwrap();
        store.create("s", state_of(1000), 1).unwrap();
        let g = store.lock("s").await.unwrap();
        store.commit(&g, state_of(2000), "j").unwrap();
        let m = g.meta();
        assert_eq!((m.version, m.bytes, m.owner), (1, 2000, Some(1)));
        drop(g);
        let snap = store.snapshot("s").unwrap();
        assert_eq!((snap.version, state_bytes(&snap.state)), (1, 2000));
        let file = std::fs::read(dir.path().join("sessions/s.json")).unwrap();
        assert!(
            file.len() < 2000 + 200,
            "the file is compact: {} bytes",
            file.len()
        );
    }
}
