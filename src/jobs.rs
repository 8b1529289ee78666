//! Job records: what became of each write call, for `job_get`, and the outcome a call made
//! under an idempotency key, for its retries. One file per job in `state_dir/jobs/`, an index
//! in memory (no reply, no outputs: those stay in the file).
//!
//! The durable step: a write call writes its record, with the result it will return if it
//! commits, just before its commit point (the session file write), marked *pending*. For a
//! keyed call the record is fsynced first (and the jobs dir, group-committed), so a crash
//! cannot keep the commit and lose the key: after a crash a pending record is committed iff
//! the session file records its job (recovery's own test). Right after the commit the mark
//! becomes *committed* by a one-byte write in place (fsynced for a keyed call, while the
//! session lock is still held, so no later commit of the session can make the pending
//! record ambiguous). An unkeyed call's record is never fsynced: a power loss (not a daemon
//! crash: the page cache survives those) may lose its status, never a keyed outcome.
//!
//! The file: one mark byte (`P` pending, `C` committed, `T` terminal: the JSON's state is
//! final), a newline, then the record as JSON. A record that cannot be parsed was being
//! written when the daemon died, so before its call's commit point: it is dropped.

use std::collections::{HashMap, VecDeque};
use std::io::Write;
use std::os::unix::fs::{FileExt, OpenOptionsExt};
use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use serde::{Deserialize, Serialize};
use serde_json::{json, Map, Value};
use sha2::{Digest, Sha256};

use crate::audit::time::{format_rfc3339, now_ms};

/// The `_meta` field a `tools/call` carries its idempotency key in.
pub const KEY_META: &str = "airlock/idempotencyKey";

/// The longest idempotency key.
pub const MAX_KEY_LEN: usize = 128;

/// Why a job record could not be written or read.
#[derive(Debug, thiserror::Error)]
pub enum JobError {
    #[error("cannot {op} {path}")]
    Io {
        op: &'static str,
        path: PathBuf,
        #[source]
        source: std::io::Error,
    },
    #[error("cannot encode the job record {job}")]
    Encode {
        job: String,
        #[source]
        source: serde_json::Error,
    },
    /// A pending record cannot be settled: its session cannot say whether the job committed.
    #[error("cannot settle the pending record of job {job}: its session {session:?} cannot say whether it committed")]
    Settle {
        job: String,
        session: String,
        #[source]
        source: Box<dyn std::error::Error + Send + Sync>,
    },
}

/// Whether session `.0` records job `.1` as its last commit, or why it cannot say.
pub type CommittedBySession<'a> =
    &'a dyn Fn(&str, &str) -> Result<bool, Box<dyn std::error::Error + Send + Sync>>;

/// Why an idempotency key was refused.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum KeyError {
    #[error("_meta[\"{KEY_META}\"] must be a string, not {0}")]
    NotAString(&'static str),
    #[error(
        "_meta[\"{KEY_META}\"] is empty; a key is 1 to {MAX_KEY_LEN} printable ASCII characters"
    )]
    Empty,
    #[error("_meta[\"{KEY_META}\"] is {0} bytes long; a key is 1 to {MAX_KEY_LEN} printable ASCII characters")]
    TooLong(usize),
    #[error("_meta[\"{KEY_META}\"] holds a character that is not printable ASCII (at byte {0}); a key is 1 to {MAX_KEY_LEN} printable ASCII characters")]
    NotPrintable(usize),
}

/// Checks a key as the client sent it (any JSON value).
pub fn parse_key(v: &Value) -> Result<String, KeyError> {
    let s = match v {
        Value::String(s) => s,
        Value::Null => return Err(KeyError::NotAString("null")),
        Value::Bool(_) => return Err(KeyError::NotAString("a boolean")),
        Value::Number(_) => return Err(KeyError::NotAString("a number")),
        Value::Array(_) => return Err(KeyError::NotAString("an array")),
        Value::Object(_) => return Err(KeyError::NotAString("an object")),
    };
    if s.is_empty() {
        return Err(KeyError::Empty);
    }
    if s.len() > MAX_KEY_LEN {
        return Err(KeyError::TooLong(s.len()));
    }
    if let Some(i) = s.bytes().position(|b| !(0x20..0x7f).contains(&b)) {
        return Err(KeyError::NotPrintable(i));
    }
    Ok(s.clone())
}

/// What a key's calls must agree on: the SHA-256 of the tool's name and its arguments
/// (serde_json keeps object keys sorted, so equal arguments hash equal).
pub fn digest(tool: &str, args: &Map<String, Value>) -> String {
    let mut h = Sha256::new();
    h.update(tool.as_bytes());
    h.update([0]);
    h.update(serde_json::to_vec(args).unwrap_or_default());
    hex(&h.finalize())
}

fn hex(b: &[u8]) -> String {
    b.iter().map(|x| format!("{x:02x}")).collect()
}

/// A job's state, as `job_get` reports it.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum JobState {
    Queued,
    Running,
    Publishing,
    Committed,
    /// Rolled back by recovery after a crash (its call never answered).
    RolledBack,
    Cancelled,
    Failed,
}

impl JobState {
    pub fn as_str(self) -> &'static str {
        match self {
            JobState::Queued => "queued",
            JobState::Running => "running",
            JobState::Publishing => "publishing",
            JobState::Committed => "committed",
            JobState::RolledBack => "rolled_back",
            JobState::Cancelled => "cancelled",
            JobState::Failed => "failed",
        }
    }
}

/// A recorded result, as the call returned it.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct RecordedReply {
    pub is_error: bool,
    pub content: Vec<Value>,
    pub structured: Option<Value>,
}

/// One job's record.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct JobRecord {
    pub job: String,
    pub uid: u32,
    pub session: String,
    pub tool: String,
    #[serde(default)]
    pub key: Option<String>,
    /// [`digest`] of the call.
    pub digest: String,
    pub state: JobState,
    pub created_ms: u64,
    #[serde(default)]
    pub ended_ms: Option<u64>,
    #[serde(default)]
    pub version_before: Option<u64>,
    #[serde(default)]
    pub version_after: Option<u64>,
    /// The outputs as the audit's `commit` has them (identity, size, SHA-256).
    #[serde(default)]
    pub outputs: Vec<Value>,
    /// The error code and message of a failed call.
    #[serde(default)]
    pub error: Option<Value>,
    /// What a retry with the key gets (a commit's result, a definite failure's error).
    #[serde(default)]
    pub reply: Option<RecordedReply>,
    /// Settled by startup recovery after a crash.
    #[serde(default)]
    pub recovered: bool,
    /// An undo's: the job it undid.
    #[serde(default)]
    pub undo_of: Option<String>,
    /// Why the job kept no undo data at its commit (over `undo_bytes`, an undo, ...).
    #[serde(default)]
    pub undo_reason: Option<String>,
}

impl JobRecord {
    /// Whether a retry with its key gets this record's reply.
    fn replayable(&self) -> bool {
        self.key.is_some()
            && self.reply.is_some()
            && matches!(self.state, JobState::Committed | JobState::Failed)
    }

    /// `job_get`'s view; `undo`: whether it can be undone now, or why not ([`undoable`]).
    pub fn view(&self, undo: Result<(), String>) -> Value {
        let mut v = json!({
            "job": self.job,
            "state": self.state.as_str(),
            "tool": self.tool,
            "session": self.session,
            "versionBefore": self.version_before,
            "versionAfter": self.version_after,
            "outputs": self.outputs,
            "created": format_rfc3339(self.created_ms),
            "ended": self.ended_ms.map(format_rfc3339),
            "error": self.error,
            "undoable": undo.is_ok(),
            "recovered": self.recovered,
        });
        if let Err(reason) = undo {
            v["undoReason"] = reason.into();
        }
        if let Some(k) = &self.key {
            v["idempotencyKey"] = k.clone().into();
        }
        if let Some(j) = &self.undo_of {
            v["undoOf"] = j.clone().into();
        }
        v
    }
}

/// Whether a job can be undone now, or why not: it committed, kept undo data at its commit,
/// is still its session's latest commit (`latest`, from the session file) and its undo data
/// is still complete in the workspace (`kept`): the caller asks those two.
pub fn undoable(record: &JobRecord, latest: bool, kept: bool) -> Result<(), String> {
    if record.state != JobState::Committed {
        return Err(format!(
            "it did not commit (it is {})",
            record.state.as_str()
        ));
    }
    if let Some(why) = &record.undo_reason {
        return Err(why.clone());
    }
    if !latest {
        return Err("it is no longer its session's latest commit".into());
    }
    if !kept {
        return Err("its undo data is gone".into());
    }
    Ok(())
}

/// A keyed call's scope: its principal, its session, its key.
type Scope = (u32, String, String);

/// What a call with a key does.
pub enum Claim {
    /// Runs: it holds the key until it settles ([`KeyHold`]).
    Run(KeyHold),
    /// Its outcome is recorded: return it, run nothing.
    Replay(Box<JobRecord>),
    /// The key is held or recorded with other arguments (or another tool): `job` has it.
    Mismatch { job: String },
    /// A call with this key runs: wait for it to settle, then claim again.
    Wait(tokio::sync::watch::Receiver<bool>),
}

struct InFlight {
    job: String,
    digest: String,
    settled: tokio::sync::watch::Sender<bool>,
}

/// A running call's hold on its key; dropped, it lets waiters claim again (they then find
/// its recorded outcome, or run afresh if it left none).
pub struct KeyHold {
    store: Arc<Inner>,
    scope: Scope,
}

impl Drop for KeyHold {
    fn drop(&mut self) {
        let gone = lock(&self.store.index).in_flight.remove(&self.scope);
        if let Some(f) = gone {
            f.settled.send_replace(true);
        }
    }
}

/// What memory keeps of a settled record.
#[derive(Debug, Clone)]
struct Entry {
    uid: u32,
    session: String,
    key: Option<String>,
    digest: String,
    created_ms: u64,
    replayable: bool,
}

#[derive(Default)]
struct Index {
    settled: HashMap<String, Entry>,
    by_key: HashMap<Scope, String>,
    /// Each uid's settled jobs, oldest first.
    order: HashMap<u32, VecDeque<String>>,
    /// Jobs not yet settled, as `job_get` shows them.
    live: HashMap<String, JobRecord>,
    in_flight: HashMap<Scope, InFlight>,
}

struct Inner {
    dir: PathBuf,
    ttl: Duration,
    per_uid: usize,
    index: Mutex<Index>,
    /// Group commit of the jobs dir's fsync (keyed records only).
    dir_sync: crate::session::DirSync,
}

/// A job's record written before its commit point, not yet synced
/// ([`JobStore::write_pending`]).
#[derive(Debug)]
pub struct Pending {
    file: std::fs::File,
    path: PathBuf,
    /// A keyed call's: made durable before the commit point.
    durable: bool,
}

/// The job records.
#[derive(Clone)]
pub struct JobStore {
    inner: Arc<Inner>,
}

fn lock<T>(m: &Mutex<T>) -> std::sync::MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|p| p.into_inner())
}

const PENDING: u8 = b'P';
const COMMITTED: u8 = b'C';
const TERMINAL: u8 = b'T';

impl JobStore {
    /// Opens `state_dir/jobs/` (0700), settles every pending record by `committed(session,
    /// job)` (whether the session file records the job: call it after recovery and before
    /// any new commit), drops expired and unreadable records, and indexes the rest.
    pub fn open(
        state_dir: &Path,
        ttl: Duration,
        per_uid: usize,
        committed: CommittedBySession<'_>,
    ) -> Result<JobStore, JobError> {
        let dir = state_dir.join("jobs");
        crate::fsutil::create_private_dir(&dir).map_err(|source| JobError::Io {
            op: "create",
            path: dir.clone(),
            source,
        })?;
        let store = JobStore {
            inner: Arc::new(Inner {
                dir: dir.clone(),
                ttl,
                per_uid: per_uid.max(1),
                index: Mutex::new(Index::default()),
                dir_sync: crate::session::DirSync::default(),
            }),
        };
        let entries = std::fs::read_dir(&dir).map_err(|source| JobError::Io {
            op: "list",
            path: dir.clone(),
            source,
        })?;
        let mut records = Vec::new();
        let mut replaced = false;
        let now = now_ms();
        for entry in entries.flatten() {
            let path = entry.path();
            let name = path.file_name().and_then(|n| n.to_str()).unwrap_or("");
            if name.starts_with('.') && name.ends_with(".json.tmp") {
                // A settle's replacement that a crash cut short: the record it was to
                // replace is still there, pending.
                let _ = std::fs::remove_file(&path);
                continue;
            }
            let Some(job) = name.strip_suffix(".json").map(str::to_string) else {
                continue;
            };
            let mut rec = match read_record(&path) {
                Some((mark, rec)) if rec.job == job => {
                    let mut rec = rec;
                    if mark == PENDING {
                        // A crash between the record and the end of its call: the session
                        // file says whether it committed, as recovery decided.
                        let said = committed(&rec.session, &rec.job).map_err(|source| {
                            JobError::Settle {
                                job: rec.job.clone(),
                                session: rec.session.clone(),
                                source,
                            }
                        })?;
                        if said {
                            rec.state = JobState::Committed;
                        } else {
                            rec.state = JobState::RolledBack;
                            rec.reply = None;
                            rec.version_after = None;
                            rec.outputs.clear();
                        }
                        rec.recovered = true;
                        rec.ended_ms.get_or_insert(now);
                        // Replaced whole (a temp file, fsynced, renamed over it), never
                        // rewritten in place: a crash meanwhile leaves the pending record,
                        // settled again at the next start, not a torn one that would lose a
                        // committed call's key and result.
                        store.replace(&rec, TERMINAL)?;
                        replaced = true;
                    } else if mark == COMMITTED {
                        rec.state = JobState::Committed;
                    }
                    rec
                }
                _ => {
                    // Torn (written when the daemon died, before its commit point) or not
                    // ours: nothing relies on it.
                    let _ = std::fs::remove_file(&path);
                    continue;
                }
            };
            if rec.created_ms.saturating_add(ttl.as_millis() as u64) < now {
                let _ = std::fs::remove_file(&path);
                continue;
            }
            rec.ended_ms.get_or_insert(now);
            records.push(rec);
        }
        // The settled records' renames durable before any new commit: one lost to a power
        // loss would bring a pending record back, to be settled again after later commits
        // of its session no longer name its job.
        if replaced {
            std::fs::File::open(&dir)
                .and_then(|d| d.sync_all())
                .map_err(|source| JobError::Io {
                    op: "fsync",
                    path: dir.clone(),
                    source,
                })?;
        }
        records.sort_by_key(|r| r.created_ms);
        for r in records {
            store.index_settled(&r);
        }
        Ok(store)
    }

    fn path(&self, job: &str) -> PathBuf {
        self.inner.dir.join(format!("{job}.json"))
    }

    /// Claims `key` in `session` for `uid`'s call `job` of `digest`.
    pub fn claim(&self, uid: u32, session: &str, key: &str, digest: &str, job: &str) -> Claim {
        let scope: Scope = (uid, session.to_string(), key.to_string());
        let mut ix = lock(&self.inner.index);
        if let Some(f) = ix.in_flight.get(&scope) {
            if f.digest != digest {
                return Claim::Mismatch { job: f.job.clone() };
            }
            return Claim::Wait(f.settled.subscribe());
        }
        if let Some(prior) = ix.by_key.get(&scope).cloned() {
            let fresh = ix
                .settled
                .get(&prior)
                .is_some_and(|e| !self.expired(e.created_ms));
            if fresh {
                let e = &ix.settled[&prior];
                if e.digest != digest {
                    return Claim::Mismatch { job: prior };
                }
                drop(ix);
                if let Some(rec) = self.load(&prior).filter(JobRecord::replayable) {
                    return Claim::Replay(Box::new(rec));
                }
                ix = lock(&self.inner.index);
            }
            ix.by_key.remove(&scope);
        }
        let (tx, _) = tokio::sync::watch::channel(false);
        ix.in_flight.insert(
            scope.clone(),
            InFlight {
                job: job.to_string(),
                digest: digest.to_string(),
                settled: tx,
            },
        );
        Claim::Run(KeyHold {
            store: self.inner.clone(),
            scope,
        })
    }

    fn expired(&self, created_ms: u64) -> bool {
        created_ms.saturating_add(self.inner.ttl.as_millis() as u64) < now_ms()
    }

    /// A write call begins: `job_get` sees it `queued`.
    pub fn begin(&self, rec: JobRecord) {
        lock(&self.inner.index).live.insert(rec.job.clone(), rec);
    }

    /// A live job's state changes (`running`, `publishing`).
    pub fn set_state(&self, job: &str, state: JobState) {
        if let Some(r) = lock(&self.inner.index).live.get_mut(job) {
            r.state = state;
        }
    }

    /// The record of a call about to commit, with the result it returns if it does: written
    /// before the commit point, durably if `durable` (a keyed call).
    pub fn prepare_commit(&self, rec: &JobRecord, durable: bool) -> Result<(), JobError> {
        let pending = self.write_pending(rec, durable)?;
        self.sync_beside(&pending, || ()).0
    }

    /// [`JobStore::prepare_commit`] in two halves, for a caller that makes the record durable
    /// beside other work due before the commit point: the record written (its failpoint
    /// passed), not yet synced.
    pub fn write_pending(&self, rec: &JobRecord, durable: bool) -> Result<Pending, JobError> {
        Ok(Pending {
            file: self.write(rec, PENDING)?,
            path: self.path(&rec.job),
            durable,
        })
    }

    /// The second half: a durable record's data and its new entry in the jobs dir (the dir's
    /// fsync group-committed) made durable, together (the record was created before either
    /// fsync begins, and neither orders the other), while `beside` runs on the calling
    /// thread. A record that need not be durable is left as written.
    pub fn sync_beside<R>(
        &self,
        pending: &Pending,
        beside: impl FnOnce() -> R,
    ) -> (Result<(), JobError>, R) {
        if !pending.durable {
            return (Ok(()), beside());
        }
        let data = crate::sync_pool::sync_file(&pending.file, std::fs::File::sync_data);
        let inner = Arc::clone(&self.inner);
        let dir = crate::sync_pool::run(move || inner.dir_sync.after_rename(&inner.dir));
        let r = beside();
        let data = data.and_then(crate::sync_pool::Pending::wait_io);
        let dir = dir.wait_io();
        let synced = data
            .map_err(|source| JobError::Io {
                op: "fsync",
                path: pending.path.clone(),
                source,
            })
            .and_then(|()| {
                dir.map_err(|source| JobError::Io {
                    op: "fsync",
                    path: self.inner.dir.clone(),
                    source,
                })
            });
        (synced, r)
    }

    /// The call committed (after the commit point, under its session lock): its record is
    /// marked so, durably if `durable`, and indexed. Returns whether it is marked: if not,
    /// the record stays pending, which the next start settles by the session file, so the
    /// caller keeps any later commit of the session from coming first (a later one would
    /// make the session no longer record this job, and the call read as rolled back).
    #[must_use]
    pub fn committed(&self, rec: &JobRecord, durable: bool) -> bool {
        let path = self.path(&rec.job);
        let marked = crate::failpoint::hit("jobs.mark_committed")
            .and_then(|()| std::fs::OpenOptions::new().write(true).open(&path))
            .and_then(|f| {
                f.write_all_at(&[COMMITTED], 0)?;
                if durable {
                    f.sync_data()?;
                }
                Ok(())
            });
        if let Err(e) = &marked {
            tracing::error!(job = %rec.job, path = %path.display(), error = %e, "cannot mark the job record committed; its session is blocked until the next start settles it by the session file");
        }
        self.settle(rec);
        marked.is_ok()
    }

    /// A call ended without committing (failed, cancelled): its record is written (never
    /// fsynced: a crash may lose it, and then a retry runs afresh, which is safe since
    /// nothing was committed) and indexed; unless not `persist`: then it is forgotten.
    pub fn ended(&self, rec: &JobRecord, persist: bool) {
        if !persist {
            lock(&self.inner.index).live.remove(&rec.job);
            return;
        }
        if let Err(e) = self.write(rec, TERMINAL) {
            tracing::warn!(job = %rec.job, error = %crate::report::chain(&e), "cannot write the job record");
        }
        self.settle(rec);
    }

    fn settle(&self, rec: &JobRecord) {
        lock(&self.inner.index).live.remove(&rec.job);
        self.index_settled(rec);
    }

    fn index_settled(&self, rec: &JobRecord) {
        let mut evicted = Vec::new();
        {
            let mut ix = lock(&self.inner.index);
            let replayable = rec.replayable();
            if let (Some(k), true) = (&rec.key, replayable) {
                ix.by_key
                    .insert((rec.uid, rec.session.clone(), k.clone()), rec.job.clone());
            }
            ix.settled.insert(
                rec.job.clone(),
                Entry {
                    uid: rec.uid,
                    session: rec.session.clone(),
                    key: rec.key.clone(),
                    digest: rec.digest.clone(),
                    created_ms: rec.created_ms,
                    replayable,
                },
            );
            let ttl = self.inner.ttl.as_millis() as u64;
            let now = now_ms();
            let Index {
                settled,
                by_key,
                order,
                ..
            } = &mut *ix;
            let q = order.entry(rec.uid).or_default();
            q.push_back(rec.job.clone());
            // The oldest go first: past the bound, or past their time.
            while let Some(front) = q.front() {
                let old = settled
                    .get(front)
                    .is_none_or(|e| e.created_ms.saturating_add(ttl) < now);
                if q.len() <= self.inner.per_uid && !old {
                    break;
                }
                let Some(job) = q.pop_front() else { break };
                if let Some(e) = settled.remove(&job) {
                    if let Some(k) = e.key {
                        let scope = (e.uid, e.session, k);
                        if by_key.get(&scope) == Some(&job) {
                            by_key.remove(&scope);
                        }
                    }
                    let _ = e.replayable;
                }
                evicted.push(job);
            }
        }
        for job in evicted {
            let _ = std::fs::remove_file(self.path(&job));
        }
    }

    /// A job's record: live, or settled and not expired.
    pub fn get(&self, job: &str) -> Option<JobRecord> {
        {
            let ix = lock(&self.inner.index);
            if let Some(r) = ix.live.get(job) {
                return Some(r.clone());
            }
            match ix.settled.get(job) {
                Some(e) if !self.expired(e.created_ms) => {}
                _ => return None,
            }
        }
        self.load(job)
    }

    /// The job of `uid`'s last call with `key` in `session`: the running one, else the
    /// recorded one.
    pub fn by_key(&self, uid: u32, session: &str, key: &str) -> Option<String> {
        let scope: Scope = (uid, session.to_string(), key.to_string());
        let ix = lock(&self.inner.index);
        if let Some(f) = ix.in_flight.get(&scope) {
            return Some(f.job.clone());
        }
        if let Some(j) = ix.by_key.get(&scope) {
            return Some(j.clone());
        }
        // A key whose last call left no replayable outcome (cancelled, rolled back): its
        // newest record.
        ix.settled
            .iter()
            .filter(|(_, e)| e.uid == uid && e.session == session && e.key.as_deref() == Some(key))
            .max_by_key(|(_, e)| e.created_ms)
            .map(|(j, _)| j.clone())
    }

    fn load(&self, job: &str) -> Option<JobRecord> {
        let (mark, mut rec) = read_record(&self.path(job))?;
        if mark == COMMITTED {
            rec.state = JobState::Committed;
        }
        Some(rec)
    }

    /// Replaces the record of `rec` whole with `mark`: written to a temp file, fsynced,
    /// renamed over it.
    fn replace(&self, rec: &JobRecord, mark: u8) -> Result<(), JobError> {
        let path = self.path(&rec.job);
        let temp = crate::fsutil::temp_path(&self.inner.dir, &format!("{}.json", rec.job));
        let f = create(&temp, &encode(rec, mark)?)?;
        f.sync_data().map_err(|source| JobError::Io {
            op: "fsync",
            path: temp.clone(),
            source,
        })?;
        std::fs::rename(&temp, &path).map_err(|source| JobError::Io {
            op: "rename",
            path: temp.clone(),
            source,
        })
    }

    /// Writes the record (`mark`, then its JSON); returns the file, not synced.
    fn write(&self, rec: &JobRecord, mark: u8) -> Result<std::fs::File, JobError> {
        create(&self.path(&rec.job), &encode(rec, mark)?)
    }
}

/// A record file at `path` (0600, made or cut) holding `bytes`, not yet synced.
fn create(path: &Path, bytes: &[u8]) -> Result<std::fs::File, JobError> {
    let io = |op, source| JobError::Io {
        op,
        path: path.to_path_buf(),
        source,
    };
    crate::failpoint::hit("jobs.write").map_err(|e| io("write", e))?;
    let mut f = std::fs::OpenOptions::new()
        .write(true)
        .create(true)
        .truncate(true)
        .mode(0o600)
        .custom_flags(libc::O_NOFOLLOW)
        .open(path)
        .map_err(|e| io("create", e))?;
    f.write_all(bytes).map_err(|e| io("write", e))?;
    Ok(f)
}

/// A record's bytes: its mark, a newline, its JSON.
fn encode(rec: &JobRecord, mark: u8) -> Result<Vec<u8>, JobError> {
    let mut bytes = vec![mark, b'\n'];
    serde_json::to_writer(&mut bytes, rec).map_err(|source| JobError::Encode {
        job: rec.job.clone(),
        source,
    })?;
    Ok(bytes)
}

fn read_record(path: &Path) -> Option<(u8, JobRecord)> {
    let bytes = std::fs::read(path).ok()?;
    let (&mark, rest) = bytes.split_first()?;
    if ![PENDING, COMMITTED, TERMINAL].contains(&mark) {
        return None;
    }
    let rest = rest.strip_prefix(b"\n")?;
    serde_json::from_slice(rest).ok().map(|r| (mark, r))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn keys_are_one_to_128_printable_ascii_characters() {
        assert_eq!(parse_key(&json!("k-1 ~!")), Ok("k-1 ~!".into()));
        assert_eq!(parse_key(&json!("")), Err(KeyError::Empty));
        assert_eq!(
            parse_key(&json!("x".repeat(129))),
            Err(KeyError::TooLong(129))
        );
        assert!(parse_key(&json!("x".repeat(128))).is_ok());
        assert_eq!(parse_key(&json!("a\nb")), Err(KeyError::NotPrintable(1)));
        assert_eq!(parse_key(&json!("é")), Err(KeyError::NotPrintable(0)));
        assert_eq!(parse_key(&json!(7)), Err(KeyError::NotAString("a number")));
        let m = parse_key(&json!(7)).unwrap_err().to_string();
        assert!(m.contains(KEY_META), "{m}");
    }

    #[test]
    fn the_digest_covers_the_tool_and_every_argument() {
        let a: Map<String, Value> = serde_json::from_value(json!({"a": 1, "b": 2})).unwrap();
        let b: Map<String, Value> = serde_json::from_value(json!({"b": 2, "a": 1})).unwrap();
        let c: Map<String, Value> = serde_json::from_value(json!({"a": 1, "b": 3})).unwrap();
        assert_eq!(digest("t", &a), digest("t", &b));
        assert_ne!(digest("t", &a), digest("t", &c));
        assert_ne!(digest("t", &a), digest("u", &a));
    }

    fn rec(job: &str, key: Option<&str>, state: JobState) -> JobRecord {
        JobRecord {
            job: job.into(),
            uid: 5,
            session: "s".into(),
            tool: "t".into(),
            key: key.map(str::to_string),
            digest: "d".into(),
            state,
            created_ms: now_ms(),
            ended_ms: None,
            version_before: Some(0),
            version_after: Some(1),
            outputs: vec![],
            error: None,
            reply: Some(RecordedReply {
                is_error: false,
                content: vec![],
                structured: Some(json!({"job": job})),
            }),
            recovered: false,
            undo_of: None,
            undo_reason: None,
        }
    }

    /// A pending record is settled at open by the session file: committed, or rolled back
    /// with no reply (a retry runs afresh).
    #[test]
    fn pending_records_are_settled_by_the_commit_point() {
        let dir = tempfile::tempdir().unwrap();
        let open = |committed: bool| {
            JobStore::open(dir.path(), Duration::from_secs(60), 10, &|_, _| {
                Ok(committed)
            })
            .unwrap()
        };
        let s = open(false);
        s.prepare_commit(&rec("j1", Some("k"), JobState::Committed), true)
            .unwrap();
        drop(s);
        let s = open(true);
        let r = s.get("j1").unwrap();
        assert_eq!(r.state, JobState::Committed);
        assert!(r.recovered);
        assert!(matches!(s.claim(5, "s", "k", "d", "j2"), Claim::Replay(_)));
        // Settled: a later open keeps it committed whatever the session says now.
        drop(s);
        let s = open(false);
        assert_eq!(s.get("j1").unwrap().state, JobState::Committed);

        s.prepare_commit(&rec("j3", Some("k3"), JobState::Committed), true)
            .unwrap();
        drop(s);
        let s = open(false);
        let r = s.get("j3").unwrap();
        assert_eq!(r.state, JobState::RolledBack);
        assert!(r.reply.is_none());
        assert!(matches!(s.claim(5, "s", "k3", "d", "j4"), Claim::Run(_)));
    }

    /// A pending record whose session cannot be read is not settled: the start fails,
    /// naming the job and the session, and the record stays pending on disk (not marked
    /// rolled back for good); once the session answers, it is settled.
    #[test]
    fn a_pending_record_is_not_settled_when_its_session_cannot_say() {
        let dir = tempfile::tempdir().unwrap();
        let s = JobStore::open(dir.path(), Duration::from_secs(60), 10, &|_, _| Ok(false)).unwrap();
        s.prepare_commit(&rec("j1", Some("k"), JobState::Committed), true)
            .unwrap();
        drop(s);
        let unreadable =
            |_: &str, _: &str| -> Result<bool, Box<dyn std::error::Error + Send + Sync>> {
                Err(Box::new(std::io::Error::from_raw_os_error(libc::EIO)))
            };
        let e = JobStore::open(dir.path(), Duration::from_secs(60), 10, &unreadable)
            .err()
            .expect("the start fails");
        assert!(
            matches!(&e, JobError::Settle { job, session, .. } if job == "j1" && session == "s"),
            "{e:?}"
        );
        let on_disk = std::fs::read(dir.path().join("jobs/j1.json")).unwrap();
        assert_eq!(on_disk[0], PENDING);
        let s = JobStore::open(dir.path(), Duration::from_secs(60), 10, &|_, _| Ok(true)).unwrap();
        assert_eq!(s.get("j1").unwrap().state, JobState::Committed);
    }

    /// Settling replaces a record whole (a new file renamed over it), never rewrites it in
    /// place, and a replacement a crash cut short is removed at the next open.
    #[test]
    fn a_settled_record_replaces_the_pending_one_whole() {
        use std::os::unix::fs::MetadataExt;
        let dir = tempfile::tempdir().unwrap();
        let s = JobStore::open(dir.path(), Duration::from_secs(60), 10, &|_, _| Ok(false)).unwrap();
        s.prepare_commit(&rec("j1", Some("k"), JobState::Committed), true)
            .unwrap();
        drop(s);
        let path = dir.path().join("jobs/j1.json");
        let pending = std::fs::metadata(&path).unwrap().ino();
        let cut_short = dir.path().join("jobs/.j0.json.tmp");
        std::fs::write(&cut_short, b"T\n{").unwrap();
        let s = JobStore::open(dir.path(), Duration::from_secs(60), 10, &|_, _| Ok(true)).unwrap();
        assert_eq!(s.get("j1").unwrap().state, JobState::Committed);
        assert_ne!(std::fs::metadata(&path).unwrap().ino(), pending);
        assert_eq!(std::fs::read(&path).unwrap()[0], TERMINAL);
        assert!(!cut_short.exists());
        assert!(!dir.path().join("jobs/.j1.json.tmp").exists());
    }

    /// A committed record that cannot be marked says so to its caller (which blocks the
    /// session).
    #[test]
    fn a_record_that_cannot_be_marked_committed_says_so() {
        let dir = tempfile::tempdir().unwrap();
        let s = JobStore::open(dir.path(), Duration::from_secs(60), 10, &|_, _| Ok(false)).unwrap();
        let r = rec("j1", Some("k"), JobState::Committed);
        s.prepare_commit(&r, true).unwrap();
        assert!(s.committed(&r, true));
        let r2 = rec("j2", Some("k2"), JobState::Committed);
        s.prepare_commit(&r2, true).unwrap();
        // Its file replaced by a directory: the mark cannot be written.
        let path = dir.path().join("jobs/j2.json");
        std::fs::remove_file(&path).unwrap();
        std::fs::create_dir(&path).unwrap();
        assert!(!s.committed(&r2, true));
    }

    /// The bound per uid drops the oldest records first, their keys with them.
    #[test]
    fn the_oldest_records_go_first() {
        let dir = tempfile::tempdir().unwrap();
        let s = JobStore::open(dir.path(), Duration::from_secs(60), 2, &|_, _| Ok(false)).unwrap();
        for (j, k) in [("a", "ka"), ("b", "kb"), ("c", "kc")] {
            s.ended(&rec(j, Some(k), JobState::Failed), true);
        }
        assert!(s.get("a").is_none());
        assert!(!dir.path().join("jobs/a.json").exists());
        assert!(s.get("b").is_some() && s.get("c").is_some());
        assert!(matches!(s.claim(5, "s", "ka", "d", "x"), Claim::Run(_)));
        assert!(matches!(s.claim(5, "s", "kb", "d", "y"), Claim::Replay(_)));
        assert!(matches!(
            s.claim(5, "s", "kc", "other", "z"),
            Claim::Mismatch { .. }
        ));
    }

    /// A torn record (the daemon died writing it) is dropped at open.
    #[test]
    fn a_torn_record_is_dropped() {
        let dir = tempfile::tempdir().unwrap();
        std::fs::create_dir_all(dir.path().join("jobs")).unwrap();
        std::fs::write(dir.path().join("jobs/j.json"), b"P\n{\"job\": \"j\", \"ui").unwrap();
        let s = JobStore::open(dir.path(), Duration::from_secs(60), 2, &|_, _| Ok(true)).unwrap();
        assert!(s.get("j").is_none());
        assert!(!dir.path().join("jobs/j.json").exists());
    }
}
