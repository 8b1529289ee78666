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

mod dir_sync;
mod id;
mod quota;
#[cfg(test)]
mod tests;

pub use dir_sync::DirSync;
pub use id::{check_id, valid_id, IdError, MAX_ID_LEN};
pub use quota::{state_bytes, QuotaError, Reserved, SessionLimits, Usage};

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
    #[error("cannot {op} {path}")]
    Io {
        op: &'static str,
        path: PathBuf,
        source: std::io::Error,
    },
    #[error("corrupt session file {path}")]
    Corrupt {
        path: PathBuf,
        #[source]
        cause: serde_json::Error,
    },
    #[error(transparent)]
    Quota(#[from] QuotaError),
    /// The fsync of the sessions dir failed after a change put the session's new file in
    /// place, and putting the previous one back failed too: the change (`what`: a commit, a
    /// creation, a destruction) may or may not be durable.
    #[error("the {what} of session {id:?} may or may not be durable (the fsync of the sessions dir failed after its file was put in place, and putting the previous one back failed too); every call on it fails until the daemon restarts and reads what is on disk")]
    Undecided {
        id: String,
        what: &'static str,
        #[source]
        source: std::io::Error,
    },
    /// An earlier change of the session is undecided ([`SessionError::Undecided`]).
    #[error("session {0:?} is blocked: an earlier change's durability is unknown after a disk error; restart the daemon so that it reads what is on disk (and recovery decides a job)")]
    Blocked(String),
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
    /// Set under `lock` by a commit whose durability is unknown: every later lock and read
    /// fails ([`SessionError::Blocked`]) until the next start.
    undecided: AtomicBool,
    /// Set under `lock` once an exchange of the session's file with its temp file is durable:
    /// the temp file is then a spare (the previous version, which no name on disk points at)
    /// that the next write goes over in place. Cleared when a write starts, so that a write
    /// that fails leaves the next one to make a fresh temp file.
    spare: AtomicBool,
    /// Held to read the session's file without `lock`, and to write the spare in place: a
    /// reader that opened the file before two exchanges may still hold the spare's inode,
    /// and must not read it while it is written over.
    file: RwLock<()>,
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

pub struct SessionStore {
    dir: PathBuf,
    sessions: Mutex<HashMap<String, Arc<Session>>>,
    /// Ids whose create is writing their file (not yet live); taken after `sessions`.
    creating: Mutex<std::collections::HashSet<String>>,
    /// Each owner's live sessions and state bytes (recounted from the files at open).
    usage: Mutex<HashMap<u32, Usage>>,
    limits: SessionLimits,
    dir_sync: DirSync,
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
        let mut temps = Vec::new();
        for entry in entries.flatten() {
            let path = entry.path();
            let name = entry.file_name();
            if let Some(id) = name
                .to_str()
                .and_then(|n| n.strip_prefix('.'))
                .and_then(|n| n.strip_suffix(".json.tmp"))
            {
                temps.push((id.to_string(), path));
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
        // A temp file holds the spare (an earlier version) or a write never exchanged into
        // place (it never committed): never the session's state. A live session's is kept as
        // its spare, once the fsync of the dir below has made every name durable as it is
        // now (a daemon that died before its exchange was durable leaves the exchange in the
        // page cache only: until then the temp name could still point at the session's file
        // on disk). Any other is removed.
        let mut spares = Vec::new();
        for (id, path) in temps {
            match sessions.get(&id) {
                Some(s) => spares.push(Arc::clone(s)),
                None => crate::failpoint::hit("session.remove_tmp")
                    .and_then(|()| std::fs::remove_file(&path))
                    .map_err(|source| SessionError::Io {
                        op: "remove stale temp file",
                        path: path.clone(),
                        source,
                    })?,
            }
        }
        if !spares.is_empty() {
            std::fs::File::open(&dir)
                .and_then(|d| d.sync_all())
                .map_err(|source| SessionError::Io {
                    op: "fsync",
                    path: dir.clone(),
                    source,
                })?;
            for s in spares {
                s.spare.store(true, Ordering::SeqCst);
            }
        }
        Ok(SessionStore {
            dir,
            sessions: Mutex::new(sessions),
            creating: Mutex::default(),
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
        // One read, no stat first: a file a failed create removes again between the two
        // would read as an I/O error, not as no tombstone.
        let file = existing(read_file(&self.path(id)))?;
        Ok(file.and_then(|f| f.destroyed.then_some(f.owner)))
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
        if session.undecided.load(Ordering::SeqCst) {
            return Err(SessionError::Blocked(id.to_string()));
        }
        let meta = read(&session.current).clone();
        self.load(&meta)
    }

    /// Reads the committed state of the session `meta` describes from its file: the
    /// version `meta` names. A file a commit has exchanged in but not yet made durable (its
    /// version past `meta`'s) is not that: the committed version is then the spare's, read
    /// under the same hold of the `file` lock (the spare is only written under it).
    fn load(&self, meta: &Meta) -> Result<Snapshot, SessionError> {
        let file = self.read_committed(meta)?;
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

    /// The file of the version `meta` names ([`SessionStore::load`]).
    fn read_committed(&self, meta: &Meta) -> Result<SessionFile, SessionError> {
        let live = lock(&self.sessions).get(&meta.id).cloned();
        let _reading = live.as_ref().map(|s| read(&s.file));
        let spare = fsutil::temp_path(&self.dir, &format!("{}.json", meta.id));
        let mut want = meta.version;
        let mut tries = 0;
        let file = loop {
            let Some(file) = existing(read_file(&self.path(&meta.id)))? else {
                return Err(SessionError::NotFound(meta.id.clone()));
            };
            // A tombstone a destroy has exchanged in is not committed until the destroy has
            // made it durable and marked the session destroyed: until then the committed
            // version is the spare's, as for a commit under way.
            let pending_tombstone = file.destroyed
                && live
                    .as_ref()
                    .is_some_and(|s| !s.destroyed.load(Ordering::SeqCst));
            if !pending_tombstone && (file.destroyed || file.version <= want) {
                break file;
            }
            match read_file(&spare) {
                Ok(prev) if prev.version == want && !prev.destroyed => break prev,
                // The commit ended (or was undone) between the reads: look again.
                _ if tries < 3 => {
                    tries += 1;
                    if let Some(s) = &live {
                        want = read(&s.current).version;
                    }
                }
                _ => {
                    return Err(SessionError::Io {
                        op: "read the committed version (commits kept moving) of",
                        path: spare,
                        source: std::io::Error::from_raw_os_error(libc::EAGAIN),
                    })
                }
            }
        };
        Ok(file)
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
        let bytes = state_bytes(&state);
        {
            // The id is claimed and its owner's room taken under the map lock, which is not
            // held across the file's write and fsyncs: a slow disk holds up this create,
            // not every call on other sessions.
            let sessions = lock(&self.sessions);
            if let Some(s) = sessions.get(id) {
                if s.undecided.load(Ordering::SeqCst) {
                    return Err(SessionError::Blocked(id.to_string()));
                }
                return Err(SessionError::Exists(id.to_string()));
            }
            let mut creating = lock(&self.creating);
            if creating.contains(id) {
                return Err(SessionError::Exists(id.to_string()));
            }
            // Not live: any destroy of it is over, its tombstone on disk.
            if self.tombstone(id)?.is_some() {
                return Err(SessionError::Destroyed(id.to_string()));
            }
            let mut usage = lock(&self.usage);
            let u = usage.entry(owner).or_default();
            self.quota_for_create(id, bytes, owner, *u)?;
            // Counted before the write (so that two creates of one owner cannot both take
            // its last room), given back if it fails.
            u.sessions += 1;
            u.bytes = u.bytes.saturating_add(bytes);
            creating.insert(id.to_string());
        }
        let snap = Snapshot {
            id: id.to_string(),
            version: 0,
            state,
            owner: Some(owner),
        };
        let meta = Meta {
            id: snap.id.clone(),
            version: 0,
            owner: snap.owner,
            bytes,
        };
        let made = self.persist_created(&snap);
        let mut sessions = lock(&self.sessions);
        lock(&self.creating).remove(id);
        match made {
            Ok(()) => {
                sessions.insert(id.to_string(), Arc::new(Session::new(meta)));
                Ok(snap)
            }
            Err(e @ SessionError::Undecided { .. }) => {
                // It may be on disk: its id stays taken, and counted, but blocked until the
                // next start reads what is there.
                let session = Session::new(meta);
                session.undecided.store(true, Ordering::SeqCst);
                sessions.insert(id.to_string(), Arc::new(session));
                Err(e)
            }
            Err(e) => {
                let mut usage = lock(&self.usage);
                if let Some(u) = usage.get_mut(&owner) {
                    u.sessions = u.sessions.saturating_sub(1);
                    u.bytes = u.bytes.saturating_sub(bytes);
                }
                Err(e)
            }
        }
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
        if session.undecided.load(Ordering::SeqCst) {
            return Err(SessionError::Blocked(id.to_string()));
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
        reserved: Reserved<'_>,
        state: Map<String, Value>,
        job: &str,
    ) -> Result<Snapshot, SessionError> {
        let staged = self.stage_commit(guard, state, job)?;
        staged.sync_beside(|| ()).0?;
        self.commit_staged(guard, reserved, staged)
    }

    /// The first half of [`SessionStore::commit_reserved`], for a caller that makes it
    /// durable beside other work due before the commit point: the session file that records
    /// `job` with `state`, written under its temp name, to be fsynced
    /// ([`Staged::sync_beside`]): over the spare in place if the session has one, else in a
    /// file made for it. Nothing changes until [`SessionStore::commit_staged`] exchanges it
    /// with the session's file; a staged file never committed is replaced by the session's
    /// next write.
    pub fn stage_commit(
        &self,
        guard: &SessionGuard,
        state: Map<String, Value>,
        job: &str,
    ) -> Result<Staged, SessionError> {
        let next = next_version(guard, state);
        let (name, bytes) = self.file_bytes(&next, Some(job), false)?;
        let temp = if guard.session.spare.swap(false, Ordering::SeqCst) {
            fsutil::Temp::Spare
        } else {
            fsutil::Temp::Fresh
        };
        let file = {
            let _writing = (temp == fsutil::Temp::Spare).then(|| write(&guard.session.file));
            fsutil::write_temp(&self.dir, &name, &bytes, 0o600, "session.write", temp)
        }
        .map_err(|source| self.io_error(&next.id, source))?;
        let path = self.path(&next.id);
        Ok(Staged {
            next,
            name,
            file,
            path,
        })
    }

    /// The commit point of a [`SessionStore::stage_commit`] (its file fsynced by
    /// [`Staged::sync_beside`]): exchanged with the session's file and made durable (the
    /// dir's fsync, group-committed), then the store's memory. The temp name keeps the
    /// previous version's inode, the spare of the next commit: a commit makes and frees no
    /// inode.
    pub fn commit_staged(
        &self,
        guard: &SessionGuard,
        reserved: Reserved<'_>,
        staged: Staged,
    ) -> Result<Snapshot, SessionError> {
        let id = &staged.next.id;
        fsutil::exchange_temp(&self.dir, &staged.name, "session.write")
            .map_err(|source| self.io_error(id, source))?;
        // The session's name holds the new version now, in the page cache at least. Whether
        // the exchange is on disk is unknown until the dir's fsync succeeds: if it fails, the
        // commit fails only once the previous version is back under the name and that is
        // durable; if that cannot be done either, the commit is undecided: the session is
        // blocked, and recovery at the next start decides by what is on disk.
        let durable = self.durable_or_put_back(id, "commit", || {
            fsutil::exchange_temp(&self.dir, &staged.name, "session.unexchange")
        });
        if let Err(e) = durable {
            if let SessionError::Undecided { .. } = e {
                self.block(guard);
            }
            return Err(e);
        }
        guard.session.spare.store(true, Ordering::SeqCst);
        Ok(self.took(guard, reserved, staged.next))
    }

    /// Blocks the session `guard` holds until the next start (every later lock and read
    /// fails with [`SessionError::Blocked`]): a change of it is undecided, or what a later
    /// commit would decide cannot be decided now (a committed job's record or journal that
    /// could not be settled).
    pub fn block(&self, guard: &SessionGuard) {
        guard.session.undecided.store(true, Ordering::SeqCst);
    }

    /// The store's memory after a commit of `next`, whose file is durable.
    fn took(&self, guard: &SessionGuard, mut reserved: Reserved<'_>, next: Snapshot) -> Snapshot {
        let cur = guard.meta();
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
        next
    }

    /// Destroys a session under its lock: writes the tombstone and makes it durable, marks
    /// the session destroyed, then forgets it (its count and bytes leave its owner's usage;
    /// the tombstone stays on disk).
    pub fn destroy(&self, guard: SessionGuard) -> Result<Meta, SessionError> {
        let meta = guard.meta();
        let tomb = Snapshot {
            id: meta.id.clone(),
            version: meta.version,
            state: Map::new(),
            owner: meta.owner,
        };
        // A reader meanwhile reads the previous version until the session is marked
        // destroyed ([`SessionStore::read_committed`]).
        if let Err(e) = self.persist_tombstone(&guard, &tomb) {
            if let SessionError::Undecided { .. } = e {
                self.block(&guard);
            }
            return Err(e);
        }
        guard.session.spare.store(false, Ordering::SeqCst);
        guard.session.destroyed.store(true, Ordering::SeqCst);
        lock(&self.sessions).remove(&meta.id);
        // No file holding the destroyed state is left: its previous version, exchanged out
        // to the temp name, goes (a removal a crash undoes is done again at the next start,
        // which removes a destroyed session's temp file).
        let previous = fsutil::temp_path(&self.dir, &format!("{}.json", meta.id));
        if let Err(e) = std::fs::remove_file(&previous) {
            tracing::warn!(session = %meta.id, path = %previous.display(), error = %e, "destroyed, but cannot remove its previous version; the next start will");
        }
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
        let Some(file) = self.read_existing(id)? else {
            return Ok(false);
        };
        Ok(!file.destroyed && file.last_job.as_deref() == Some(job))
    }

    /// The version of the session file and the job whose commit wrote it (`None` for a
    /// session never committed to by a job), read from the file: which commit is the latest
    /// (for a live session, the one memory has taken, as [`SessionStore::snapshot`] reads).
    pub fn latest_commit(&self, id: &str) -> Result<(u64, Option<String>), SessionError> {
        check_id(id)?;
        let live = lock(&self.sessions).get(id).cloned();
        let file = match live {
            // A live one's committed version (not a file exchanged in by a commit under way).
            Some(session) => {
                let meta = read(&session.current).clone();
                self.read_committed(&meta)?
            }
            None => self.read_current(id)?,
        };
        if file.destroyed {
            return Err(SessionError::Destroyed(id.to_string()));
        }
        Ok((file.version, file.last_job))
    }

    /// Writes the file of a session made (`create`): a fresh temp file renamed into place,
    /// then the dir's fsync. If that fsync fails, the name is removed again and that made
    /// durable, so that a failed create leaves no session for the next start to find; if
    /// that fails too, the creation is undecided.
    fn persist_created(&self, snap: &Snapshot) -> Result<(), SessionError> {
        let (name, bytes) = self.file_bytes(snap, None, false)?;
        self.write_fresh(&name, &bytes)
            .and_then(|f| f.sync_all())
            .and_then(|()| fsutil::rename_temp(&self.dir, &name, "session.write"))
            .map_err(|source| self.io_error(&snap.id, source))?;
        self.durable_or_put_back(&snap.id, "creation", || {
            crate::failpoint::hit("session.unlink_created")
                .and_then(|()| std::fs::remove_file(self.path(&snap.id)))
        })
    }

    /// `bytes` in a fresh temp file of `name` (whatever the temp name held is unlinked).
    fn write_fresh(&self, name: &str, bytes: &[u8]) -> std::io::Result<std::fs::File> {
        fsutil::write_temp(
            &self.dir,
            name,
            bytes,
            0o600,
            "session.write",
            fsutil::Temp::Fresh,
        )
    }

    /// Writes the tombstone of a session (`destroy`): a fresh temp file exchanged with the
    /// session's file, then the dir's fsync; if it fails, exchanged back (or the destruction
    /// is undecided). The previous version is then under the temp name, for readers until
    /// the session is marked destroyed, and for [`SessionStore::destroy`] to remove.
    fn persist_tombstone(&self, guard: &SessionGuard, tomb: &Snapshot) -> Result<(), SessionError> {
        let (name, bytes) = self.file_bytes(tomb, None, true)?;
        let file = {
            // Not while a reader that opened the spare reads it.
            let _writing = write(&guard.session.file);
            self.write_fresh(&name, &bytes)
        };
        file.and_then(|f| f.sync_all())
            .and_then(|()| fsutil::exchange_temp(&self.dir, &name, "session.write"))
            .map_err(|source| self.io_error(&tomb.id, source))?;
        self.durable_or_put_back(&tomb.id, "destruction", || {
            fsutil::exchange_temp(&self.dir, &name, "session.unexchange")
        })
    }

    /// After a rename that put session `id`'s new file in place: the fsync of the dir that
    /// makes it durable. If it fails, `put_back` restores the previous name and that is made
    /// durable, and the change fails (`Io`); if that fails too, the change (`what`) is
    /// undecided.
    fn durable_or_put_back(
        &self,
        id: &str,
        what: &'static str,
        put_back: impl FnOnce() -> std::io::Result<()>,
    ) -> Result<(), SessionError> {
        let durable = crate::failpoint::hit("session.fsync_dir")
            .and_then(|()| self.dir_sync.after_rename(&self.dir));
        let Err(source) = durable else {
            return Ok(());
        };
        match put_back().and_then(|()| self.dir_sync.after_rename(&self.dir)) {
            Ok(()) => Err(SessionError::Io {
                op: "fsync (after its file was put in place, now undone)",
                path: self.path(id),
                source,
            }),
            Err(again) => {
                tracing::error!(session = %id, %what, error = %source, undo = %again, "a change's durability is unknown; the session is blocked until the next start");
                Err(SessionError::Undecided {
                    id: id.to_string(),
                    what,
                    source,
                })
            }
        }
    }

    /// The session file of `snap` (its name and bytes).
    fn file_bytes(
        &self,
        snap: &Snapshot,
        job: Option<&str>,
        destroyed: bool,
    ) -> Result<(String, Vec<u8>), SessionError> {
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
        let bytes = serde_json::to_vec(&file).map_err(|cause| SessionError::Corrupt {
            path: self.path(&snap.id),
            cause,
        })?;
        Ok((format!("{}.json", snap.id), bytes))
    }

    /// The file of session `id`, read under its `file` lock if it is live (no session lock is
    /// needed: the file is only ever exchanged whole, and the spare never written while read).
    fn read_current(&self, id: &str) -> Result<SessionFile, SessionError> {
        let live = lock(&self.sessions).get(id).cloned();
        let _reading = live.as_ref().map(|s| read(&s.file));
        read_file(&self.path(id))
    }

    /// [`SessionStore::read_current`], `None` when the session has no file.
    fn read_existing(&self, id: &str) -> Result<Option<SessionFile>, SessionError> {
        existing(self.read_current(id))
    }

    fn io_error(&self, id: &str, source: std::io::Error) -> SessionError {
        SessionError::Io {
            op: "write",
            path: self.path(id),
            source,
        }
    }
}

/// A session write staged by [`SessionStore::stage_commit`], for
/// [`SessionStore::commit_staged`].
#[derive(Debug)]
pub struct Staged {
    next: Snapshot,
    name: String,
    /// The temp file, written.
    file: std::fs::File,
    path: PathBuf,
}

impl Staged {
    /// Makes the staged file's content durable (no failpoint: its write passed one) on a
    /// thread of [`crate::sync_pool`], while `beside` runs on the calling thread.
    pub fn sync_beside<R>(&self, beside: impl FnOnce() -> R) -> (Result<(), SessionError>, R) {
        let synced = crate::sync_pool::sync_file(&self.file, std::fs::File::sync_all);
        let r = beside();
        let synced = synced
            .and_then(crate::sync_pool::Pending::wait_io)
            .map_err(|source| SessionError::Io {
                op: "fsync",
                path: self.path.clone(),
                source,
            });
        (synced, r)
    }
}

impl Session {
    fn new(meta: Meta) -> Session {
        Session {
            lock: Arc::new(tokio::sync::Mutex::new(())),
            destroyed: AtomicBool::new(false),
            undecided: AtomicBool::new(false),
            spare: AtomicBool::new(false),
            file: RwLock::new(()),
            current: RwLock::new(meta),
        }
    }
}

/// A test's pause between opening the session file at its path and reading it (taken by
/// the first read of that path).
#[cfg(test)]
type Pause = (PathBuf, Box<dyn FnOnce() + Send>);
#[cfg(test)]
static AFTER_OPEN: Mutex<Option<Pause>> = Mutex::new(None);

/// A read of a session file, `None` when the file does not exist.
fn existing(read: Result<SessionFile, SessionError>) -> Result<Option<SessionFile>, SessionError> {
    match read {
        Err(SessionError::Io { source, .. }) if source.kind() == std::io::ErrorKind::NotFound => {
            Ok(None)
        }
        r => r.map(Some),
    }
}

fn read_file(path: &Path) -> Result<SessionFile, SessionError> {
    let io = |source| SessionError::Io {
        op: "read",
        path: path.to_path_buf(),
        source,
    };
    let mut file = std::fs::File::open(path).map_err(io)?;
    #[cfg(test)]
    {
        let mut hook = lock(&AFTER_OPEN);
        let pause = match hook.take() {
            Some((at, pause)) if at == path => Some(pause),
            other => {
                *hook = other;
                None
            }
        };
        drop(hook);
        if let Some(pause) = pause {
            pause();
        }
    }
    let mut bytes = Vec::new();
    std::io::Read::read_to_end(&mut file, &mut bytes).map_err(io)?;
    serde_json::from_slice(&bytes).map_err(|cause| SessionError::Corrupt {
        path: path.to_path_buf(),
        cause,
    })
}

/// The session's next version holding `state`, as a commit writes it.
fn next_version(guard: &SessionGuard, state: Map<String, Value>) -> Snapshot {
    let cur = guard.meta();
    Snapshot {
        id: cur.id,
        version: cur.version + 1,
        state,
        owner: cur.owner,
    }
}
