//! The execution model of one call, in one place: authorize, lock, clone, stage, spawn,
//! wait, publish, commit, audit, respond. Every other module is a step this one calls.

pub mod args;
mod error;
mod locks;
pub mod progress;
#[cfg(test)]
mod proptests;
pub mod response;
mod slots;
mod worker_paths;

use std::collections::BTreeMap;
use std::path::PathBuf;
use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::{SystemTime, UNIX_EPOCH};

use serde_json::{json, Map, Value};
use tokio_util::sync::CancellationToken;

pub use error::{CallError, ErrorCode};

use crate::audit::{Audit, CallRef, EventKind, Principal};
use crate::policy::redact::{self, Secrets};
use crate::policy::{
    Builtin, Capability, EnvProfile, ExternalTool, PathRole, Policy, Protocol, Right, Subject,
    Tool, ToolKind,
};
use crate::publish::{self, Job, JobSpec, Workspace};
use crate::sandbox::{End, Filters, Identities, Launch, Outcome, Registry, Sandbox, Worker};
use crate::session::{SessionError, SessionStore, Snapshot};
use crate::startup::Opened;

/// One `tools/call`, as the MCP layer hands it over.
pub struct CallRequest {
    pub tool: String,
    pub args: Map<String, Value>,
    pub principal: Principal,
    /// Cancelled by `notifications/cancelled` or the client's disconnect.
    pub cancel: CancellationToken,
    /// Where the call reports its phases and its worker's progress, if the client asked.
    pub progress: Option<progress::Progress>,
    /// The client's JSON-RPC id of the request, for the audit.
    pub request_id: Option<Value>,
    /// Whether `cancel` fired because the client asked (else its connection ended or the
    /// daemon is shutting down): the cancel's recorded cause.
    pub client_cancelled: Arc<dyn Fn() -> bool + Send + Sync>,
}

/// One call as the executor runs it: what its events share, and what the steps learned that
/// the terminal event reports.
struct Call {
    r: CallRef,
    t0: std::time::Instant,
    /// `start` was recorded: the call is past its queue (locks, slot), its work begins.
    started: std::sync::atomic::AtomicBool,
    /// The wait recorded the `cancel` (with `worker_terminated`).
    cancel_recorded: std::sync::atomic::AtomicBool,
    /// The wait recorded `timeout` and `worker_terminated`.
    timed_out: std::sync::atomic::AtomicBool,
    /// Fields for the terminal event (the worker's exit, its enforcement).
    extra: std::sync::Mutex<Map<String, Value>>,
    client_cancelled: Arc<dyn Fn() -> bool + Send + Sync>,
}

impl std::ops::Deref for Call {
    type Target = CallRef;
    fn deref(&self) -> &CallRef {
        &self.r
    }
}

impl Call {
    fn flag(&self, f: &std::sync::atomic::AtomicBool) -> bool {
        f.load(Ordering::SeqCst)
    }

    fn note(&self, key: &str, v: Value) {
        self.extra
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .insert(key.to_string(), v);
    }

    /// The terminal event's fields so far, with the call's duration.
    fn finish_detail(&self) -> Map<String, Value> {
        let mut m = self.extra.lock().unwrap_or_else(|p| p.into_inner()).clone();
        m.insert(
            "duration_ms".into(),
            json!(self.t0.elapsed().as_millis() as u64),
        );
        m
    }
}

/// The terminal result of a call.
#[derive(Debug)]
pub enum Reply {
    /// A `CallToolResult` to send (`is_error` for tool faults).
    Result(ToolReply),
    /// The call was cancelled: per the MCP spec, nothing is sent for its id.
    Cancelled,
    /// No such tool: a JSON-RPC error (invalid params).
    UnknownTool(String),
}

#[derive(Debug, Clone, PartialEq)]
pub struct ToolReply {
    pub is_error: bool,
    /// MCP content blocks.
    pub content: Vec<Value>,
    pub structured: Option<Value>,
}

impl ToolReply {
    fn ok(text: String, structured: Value) -> ToolReply {
        ToolReply {
            is_error: false,
            content: vec![json!({"type": "text", "text": text})],
            structured: Some(structured),
        }
    }
}

/// Why a call ended without a result to publish; becomes a fault reply or no reply.
enum Stop {
    Fault(CallError),
    /// Refused where a queued call starts: the policy current then no longer serves or
    /// grants its tool ([`Executor::recheck`]). Recorded as `deny`; nothing ran.
    Denied(CallError),
    Cancelled,
}

impl<E: Into<CallError>> From<E> for Stop {
    fn from(e: E) -> Stop {
        Stop::Fault(e.into())
    }
}

fn session_fault(e: SessionError) -> Stop {
    Stop::Fault(e.into())
}

pub struct Executor {
    /// The policy new calls start on; SIGHUP swaps it (`replace_policy`), a call in flight
    /// keeps the `Arc` it started with.
    policy: std::sync::RwLock<Arc<Policy>>,
    /// Counts the reloads (`replace_policy`), for what must re-check its right at each one
    /// (audit subscriptions).
    reloads: tokio::sync::watch::Sender<u64>,
    /// Calls between the start and the end of `call`, for `STATUS=`.
    in_flight: AtomicUsize,
    /// Woken when `in_flight` changes: `STATUS=` is sent on change, not polled.
    in_flight_changed: tokio::sync::Notify,
    pub sessions: SessionStore,
    pub workspace: Workspace,
    pub audit: Audit,
    targets: locks::TargetLocks,
    /// `max_concurrent_calls` slots, each principal's share bounded (`slots.rs`).
    slots: slots::Slots,
    shutdown: CancellationToken,
    counter: AtomicU64,
    /// Who workers run as.
    identities: Identities,
    /// How workers name the workspace's files (absolute, or from their working directory).
    reach: crate::startup::WorkerReach,
    /// Live workers, for the next start to sweep if the daemon dies.
    registry: Registry,
    /// The seccomp programs of the policies' profiles, compiled at load and at each reload.
    filters: Filters,
    /// What the workers share: the live leaders, the spawner.
    sandbox: Sandbox,
    /// The exclusive lock on the workspace, held while the daemon runs.
    _lock: std::fs::File,
    /// The exclusive lock on the state dir, held while the daemon runs.
    _state_lock: std::fs::File,
}

/// Compiles the seccomp programs of every profile of `policy` (workers sharing the daemon's
/// uid or not: `shared_uid`). A profile that does not compile (seccompiler refusing a rule:
/// a bug, not a policy error, since names are checked at load) is logged, and each call of
/// it fails with the same error.
fn prepare_filters(filters: &Filters, policy: &Policy, shared_uid: bool) {
    if let Err(e) = filters.prepare(policy.profiles.values(), shared_uid) {
        tracing::error!("cannot compile the seccomp filters: {e}");
    }
    tracing::debug!(
        profiles = filters.len(),
        compilations = filters.compilations(),
        "seccomp filters ready"
    );
}

impl Executor {
    /// Serves from what [`crate::startup::open`] created, locked, swept and recovered.
    pub fn start(
        policy: Arc<Policy>,
        opened: Opened,
        sandbox: Sandbox,
        shutdown: CancellationToken,
    ) -> Executor {
        let d = &policy.daemon;
        let Opened {
            workspace_lock,
            state_lock,
            workspace,
            mut sessions,
            identities,
            registry,
            audit,
            recovered: _,
            reach,
        } = opened;
        tracing::info!(
            "workers run as {}; {}",
            identities.describe(),
            reach.describe()
        );
        sessions.set_limits(crate::session::SessionLimits {
            sessions_per_principal: d.max_sessions_per_principal,
            session_state_bytes: d.max_session_state_bytes,
            state_bytes_per_principal: d.max_state_bytes_per_principal,
        });
        let filters = Filters::new();
        prepare_filters(&filters, &policy, identities.range().is_none());
        Executor {
            filters,
            sandbox,
            identities,
            reach,
            registry,
            _lock: workspace_lock,
            _state_lock: state_lock,
            audit,
            slots: slots::Slots::new(
                d.max_concurrent_calls,
                d.max_calls_per_principal,
                d.max_queued_per_principal,
            ),
            policy: std::sync::RwLock::new(policy),
            reloads: tokio::sync::watch::channel(0).0,
            in_flight: AtomicUsize::new(0),
            in_flight_changed: tokio::sync::Notify::new(),
            sessions,
            workspace,
            targets: locks::TargetLocks::default(),
            shutdown,
            counter: AtomicU64::new(0),
        }
    }

    fn new_call_id(&self) -> String {
        let nanos = SystemTime::now()
            .duration_since(UNIX_EPOCH)
            .map_or(0, |d| d.as_nanos());
        let n = self.counter.fetch_add(1, Ordering::Relaxed);
        format!("{:x}-{}-{n}", nanos, std::process::id())
    }

    /// The policy new calls start on.
    pub fn policy(&self) -> Arc<Policy> {
        self.policy
            .read()
            .unwrap_or_else(|p| p.into_inner())
            .clone()
    }

    /// Makes `new` the policy of every call that starts from now on; calls in flight finish
    /// on theirs. The caller keeps the daemon settings (`new.daemon`) that cannot change.
    pub fn replace_policy(&self, new: Arc<Policy>) {
        prepare_filters(&self.filters, &new, self.identities.range().is_none());
        *self.policy.write().unwrap_or_else(|p| p.into_inner()) = new;
        self.reloads.send_modify(|n| *n += 1);
    }

    /// Changes once `replace_policy` has made a new policy current (not before).
    pub fn reloads(&self) -> tokio::sync::watch::Receiver<u64> {
        self.reloads.subscribe()
    }

    /// The re-check of a call at the point it starts, after its wait (session lock, targets,
    /// a slot) and before anything is created for it: a reload meanwhile may have removed or
    /// changed its tool, or revoked the principal's grant. The call goes on only if the
    /// policy current now serves the very tool it was checked against (`started_on`'s, equal
    /// in every field) and grants it to the principal; it then runs on the `Arc` it started
    /// with, which holds that same tool. Otherwise it is refused (`TOOL_FORBIDDEN`, recorded
    /// as `deny`). Returns the caller as the current policy sees it (`admin` may be gone).
    fn recheck(&self, started_on: &Policy, call: &Call, tool: &Tool) -> Result<Caller, Stop> {
        let current = self.policy();
        let Some(p) = call.principal.as_ref() else {
            return Err(CallError::Internal("a call without a principal".into()).into());
        };
        let gids = p.gids();
        let who = Subject {
            uid: p.uid,
            gids: &gids,
        };
        let caller = Caller {
            uid: who.uid,
            admin: current.holds(who, Right::Admin),
        };
        if std::ptr::eq(&*current, started_on) {
            return Ok(caller);
        }
        let withdrawn = |change| {
            Stop::Denied(CallError::ToolWithdrawn {
                tool: tool.name.clone(),
                change,
            })
        };
        match current.tools.get(&tool.name) {
            None => Err(withdrawn("removed")),
            Some(now) if now != tool => Err(withdrawn("changed")),
            Some(now) if !current.may_call(who, now) => {
                Err(Stop::Denied(CallError::ToolForbidden {
                    tool: tool.name.clone(),
                    uid: who.uid,
                    right: Right::for_capability(tool.capability).as_str(),
                }))
            }
            Some(_) => Ok(caller),
        }
    }

    /// The compiled seccomp programs (for tests and the benchmark: how many compilations).
    pub fn filters(&self) -> &Filters {
        &self.filters
    }

    /// How many calls are running.
    pub fn calls_in_flight(&self) -> usize {
        self.in_flight.load(Ordering::Relaxed)
    }

    /// Resolves once the number of calls in flight has changed since the last time it
    /// resolved (a change while nobody waits is kept for the next waiter).
    pub async fn in_flight_changed(&self) {
        self.in_flight_changed.notified().await
    }

    /// Runs one `tools/call` to its terminal result, on the policy current when it starts.
    pub async fn call(&self, req: CallRequest) -> Reply {
        self.in_flight.fetch_add(1, Ordering::Relaxed);
        self.in_flight_changed.notify_one();
        let _counted = InFlight(&self.in_flight, &self.in_flight_changed);
        let policy = self.policy();
        let Some(tool) = policy.tools.get(&req.tool) else {
            return Reply::UnknownTool(req.tool);
        };
        // The session a call names (session_create names the one it creates).
        let creates = matches!(tool.kind, ToolKind::Builtin(Builtin::SessionCreate));
        let session = req
            .args
            .get(if creates { "id" } else { "session" })
            .and_then(Value::as_str)
            .filter(|s| crate::session::valid_id(s))
            .map(str::to_string);
        let secrets = Secrets::of(tool, &req.args);
        let call = Call {
            r: CallRef {
                call: self.new_call_id(),
                tool: tool.name.clone(),
                session: session.clone().filter(|_| tool.takes_session() || creates),
                principal: Some(req.principal.clone()),
                secrets: secrets.clone(),
                request_id: req.request_id.clone(),
            },
            t0: std::time::Instant::now(),
            started: Default::default(),
            cancel_recorded: Default::default(),
            timed_out: Default::default(),
            extra: Default::default(),
            client_cancelled: req.client_cancelled.clone(),
        };
        // Cancelled by the client's request or by the daemon's shutdown.
        // The client's cancellation reaches `cancel` synchronously (a child token), so the
        // point of no return in `run_write` sees every cancel that came before it.
        let cancel = req.cancel.child_token();
        let _link = link(&self.shutdown, &cancel);
        let progress = req.progress.as_ref();
        if let Some(p) = progress {
            p.phase(progress::Phase::Queued);
        }

        // 1. Authorize: the principal's grants, then the owner of the session it names.
        let gids = req.principal.gids();
        let who = Subject {
            uid: req.principal.uid,
            gids: &gids,
        };
        let caller = Caller {
            uid: who.uid,
            admin: policy.holds(who, Right::Admin),
        };
        // The session checked is the one the call names: `session`, or the id
        // `session_create` would take (an id another principal holds or held is theirs:
        // SESSION_FORBIDDEN, not a hint of whether it is alive).
        if let Err(e) = self.authorize(&policy, who, caller, tool, session.as_deref()) {
            let code = e.code();
            let reply = e.reply(&secrets);
            self.event(
                &call,
                EventKind::Deny,
                json!({"code": code.as_str(), "message": reply.structured.as_ref().map(|s| s["error"]["message"].clone())}),
            );
            return Reply::Result(reply);
        }
        let mut allow = json!({
            "capability": tool.capability.as_str(),
            "arguments": redact::summary(tool, &req.args, ARGUMENT_SHOWN),
        });
        if let ToolKind::External(ext) = &tool.kind {
            allow["timeout_ms"] = json!(ext.timeout.as_millis() as u64);
        }
        self.event(&call, EventKind::Allow, allow);
        let outcome = match args::validate(tool, &req.args) {
            Err(e) => Err(e.into()),
            Ok(values) => match (&tool.kind, tool.capability) {
                (ToolKind::Builtin(b), _) => {
                    self.builtin(&policy, &call, tool, caller, *b, &req.args, &cancel)
                        .await
                }
                (ToolKind::External(ext), Capability::Read) => {
                    self.run_read(&policy, &call, tool, ext, values, &cancel, progress)
                        .await
                }
                (ToolKind::External(ext), Capability::Write) => {
                    let id = session.unwrap_or_default();
                    self.run_write(
                        &policy, &call, caller, tool, ext, &id, values, &cancel, progress,
                    )
                    .await
                }
            },
        };
        self.finish(
            &call,
            tool.capability == Capability::Write,
            &cancel,
            outcome,
        )
    }

    fn event(&self, call: &Call, kind: EventKind, detail: Value) {
        self.audit.record(&call.r, kind, detail);
    }

    /// `start`: the call is past its queue and its work begins.
    fn record_start(&self, call: &Call, detail: Value) {
        call.started.store(true, Ordering::SeqCst);
        self.event(call, EventKind::Start, detail);
    }

    /// A `cancel` event's detail: its cause (the client's request, with the request's id;
    /// the daemon's shutdown; else the client's disconnect) and the call's phase.
    fn cancel_detail(&self, call: &Call, phase: &str) -> Value {
        let cause = if (call.client_cancelled)() {
            "client"
        } else if self.shutdown.is_cancelled() {
            "shutdown"
        } else {
            "disconnect"
        };
        let mut d = json!({"cause": cause, "phase": phase});
        if cause == "client" {
            d["request_id"] = call.request_id.clone().unwrap_or(Value::Null);
        }
        d
    }

    /// Records how the call ended (see [`EventKind`] for the sequences) and makes its reply.
    fn finish(
        &self,
        call: &Call,
        mutating: bool,
        cancel: &CancellationToken,
        outcome: Result<ToolReply, Stop>,
    ) -> Reply {
        // A cancel the call did not act on (it came past the point of no return, or the
        // call never waits on one): the result is sent, and the audit says so.
        let too_late = cancel.is_cancelled();
        let started = call.flag(&call.started);
        let mut fin = call.finish_detail();
        match outcome {
            Ok(reply) => {
                if mutating {
                    // Its `commit` is recorded (durably, before the commit point).
                    if too_late {
                        let mut d = self.cancel_detail(call, "committed");
                        d["too_late"] = json!(true);
                        self.event(call, EventKind::Cancel, d);
                    }
                } else {
                    if too_late {
                        fin.insert("cancel_too_late".into(), json!(true));
                    }
                    self.event(call, EventKind::Done, Value::Object(fin));
                }
                Reply::Result(reply)
            }
            Err(Stop::Fault(e)) => {
                let reply = e.reply(&call.secrets);
                let err = reply
                    .structured
                    .as_ref()
                    .and_then(|s| s.get("error"))
                    .cloned()
                    .unwrap_or(Value::Null);
                let code = json!(e.code().as_str());
                let timed_out = call.flag(&call.timed_out);
                // A mutating call's timeout reads `timeout, worker_terminated, rollback`.
                if !(mutating && timed_out) {
                    let mut d = fin.clone();
                    d.insert("code".into(), code.clone());
                    d.insert(
                        "message".into(),
                        err.get("message").cloned().unwrap_or(Value::Null),
                    );
                    d.insert(
                        "phase".into(),
                        json!(if started { "running" } else { "queued" }),
                    );
                    if too_late {
                        d.insert("cancel_too_late".into(), json!(true));
                    }
                    self.event(call, EventKind::Error, Value::Object(d));
                }
                if mutating && started {
                    fin.insert("code".into(), code);
                    self.event(call, EventKind::Rollback, Value::Object(fin));
                }
                Reply::Result(reply)
            }
            Err(Stop::Denied(e)) => {
                // Refused where it would have started: nothing ran, nothing to roll back.
                let reply = e.reply(&call.secrets);
                let message = reply
                    .structured
                    .as_ref()
                    .map(|s| s["error"]["message"].clone());
                self.event(
                    call,
                    EventKind::Deny,
                    json!({"code": e.code().as_str(), "message": message, "phase": "queued"}),
                );
                Reply::Result(reply)
            }
            Err(Stop::Cancelled) => {
                if !call.flag(&call.cancel_recorded) {
                    // Cancelled while queued (locks, a slot), or after its worker ended and
                    // before publication began.
                    let phase = if started { "before_publish" } else { "queued" };
                    self.event(call, EventKind::Cancel, self.cancel_detail(call, phase));
                }
                if mutating && started {
                    fin.insert("reason".into(), json!("cancelled"));
                    self.event(call, EventKind::Rollback, Value::Object(fin));
                }
                Reply::Cancelled
            }
        }
    }

    /// Step 1 of every call: a grant of the principal's lets it call `tool`, and the
    /// session the call names (if it exists or existed) is the principal's own, or the
    /// principal holds `admin`. A session id never created passes: the call then fails with
    /// `NO_SUCH_SESSION`, as it would for its owner.
    fn authorize(
        &self,
        policy: &Policy,
        who: Subject<'_>,
        caller: Caller,
        tool: &Tool,
        session: Option<&str>,
    ) -> Result<(), CallError> {
        if !policy.may_call(who, tool) {
            return Err(CallError::ToolForbidden {
                tool: tool.name.clone(),
                uid: who.uid,
                right: Right::for_capability(tool.capability).as_str(),
            });
        }
        if let Some(id) = session {
            if let Ok(owner) = self.sessions.owner(id) {
                caller.check(id, owner)?;
            }
        }
        Ok(())
    }

    #[allow(clippy::too_many_arguments)]
    async fn builtin(
        &self,
        policy: &Policy,
        call: &Call,
        tool: &Tool,
        caller: Caller,
        b: Builtin,
        raw: &Map<String, Value>,
        cancel: &CancellationToken,
    ) -> Result<ToolReply, Stop> {
        let snap_json = |s: &crate::session::Snapshot| json!({"id": s.id, "version": s.version, "state": s.state});
        match b {
            Builtin::SessionCreate => {
                let id = match raw.get("id").and_then(Value::as_str) {
                    Some(id) => id.to_string(),
                    None => format!("s-{}", self.new_call_id()),
                };
                // Its state is copied and serialized in memory: a call slot bounds how many
                // creates do so at once.
                let _slot = self.slot(call, cancel).await?;
                let state = raw
                    .get("state")
                    .and_then(Value::as_object)
                    .cloned()
                    .unwrap_or_default();
                self.record_start(call, json!({}));
                // The commit event is durable before the session exists; a create that fails
                // anyway (the id is taken) is followed by its error and rollback.
                let fresh = crate::session::valid_id(&id) && !self.sessions.is_live(&id);
                let detail = json!({"version": 0, "created": true});
                if fresh {
                    // Past a bound: refused before its commit is recorded.
                    self.sessions
                        .check_create(&id, &state, caller.uid)
                        .map_err(session_fault)?;
                    self.commit_event(call, detail.clone())?;
                }
                let snap = self
                    .sessions
                    .create(&id, state, caller.uid)
                    .map_err(session_fault)?;
                if !fresh {
                    self.event(call, EventKind::Commit, detail);
                }
                Ok(ToolReply::ok(
                    format!("created session {id}"),
                    snap_json(&snap),
                ))
            }
            Builtin::SessionDestroy => {
                let id = raw
                    .get("session")
                    .and_then(Value::as_str)
                    .unwrap_or_default();
                let guard = self.lock_session(id, cancel).await?;
                let caller = self.recheck(policy, call, tool)?;
                // Checked again under the lock: the id may have been created since step 1.
                caller.check(id, guard.meta().owner)?;
                self.record_start(call, json!({}));
                let version = guard.meta().version;
                self.commit_event(call, json!({"destroyed": true, "version": version}))?;
                self.sessions.destroy(guard).map_err(session_fault)?;
                Ok(ToolReply::ok(
                    format!("destroyed session {id}"),
                    json!({"id": id, "destroyed": true}),
                ))
            }
            Builtin::SessionGet => {
                let id = raw
                    .get("session")
                    .and_then(Value::as_str)
                    .unwrap_or_default();
                // The state is read from its file into memory: a call slot bounds how many
                // such reads run at once.
                let _slot = self.slot(call, cancel).await?;
                self.record_start(call, json!({}));
                let snap = self.sessions.snapshot(id).map_err(session_fault)?;
                caller.check(id, snap.owner)?;
                Ok(ToolReply::ok(
                    serde_json::to_string(&snap_json(&snap)).unwrap_or_default(),
                    snap_json(&snap),
                ))
            }
            Builtin::SessionList => {
                // A principal sees its own sessions; `admin` sees every one.
                self.record_start(call, json!({}));
                let list: Vec<Value> = self
                    .sessions
                    .list()
                    .iter()
                    .filter(|s| caller.admin || s.owner == Some(caller.uid))
                    .map(|s| json!({"id": s.id, "version": s.version, "owner": s.owner}))
                    .collect();
                let v = json!({"sessions": list});
                Ok(ToolReply::ok(v.to_string(), v))
            }
        }
    }

    /// Records the call's `commit` durably (fsynced, possibly with others' events): called
    /// before the commit point. A failure is `AUDIT_FAILED`, and the call does not commit.
    fn commit_event(&self, call: &Call, detail: Value) -> Result<(), Stop> {
        self.record_commit(call, detail)
            .map_err(|e| CallError::AuditFailed(e).into())
    }

    /// [`Executor::commit_event`] inside publication, where the error goes back to the job.
    fn record_commit(&self, call: &Call, detail: Value) -> Result<(), crate::audit::AuditError> {
        let mut d = call.finish_detail();
        if let Value::Object(m) = detail {
            d.extend(m);
        }
        self.audit
            .record_durable(&call.r, EventKind::Commit, Value::Object(d))
    }

    async fn lock_session(
        &self,
        id: &str,
        cancel: &CancellationToken,
    ) -> Result<crate::session::SessionGuard, Stop> {
        tokio::select! {
            g = self.sessions.lock(id) => g.map_err(session_fault),
            _ = cancel.cancelled() => Err(Stop::Cancelled),
        }
    }

    /// Resolves every path parameter beneath the workspace.
    fn resolve_paths(
        &self,
        tool: &Tool,
        values: &Map<String, Value>,
    ) -> Result<Vec<(String, PathRole, PathBuf)>, Stop> {
        // Off the async threads: resolution walks each path, and an input directory is
        // listed and checked against the mount table.
        tokio::task::block_in_place(|| self.resolve_paths_blocking(tool, values))
    }

    fn resolve_paths_blocking(
        &self,
        tool: &Tool,
        values: &Map<String, Value>,
    ) -> Result<Vec<(String, PathRole, PathBuf)>, Stop> {
        let mut out = Vec::new();
        for (name, p) in &tool.params {
            let (Some(role), Some(raw)) = (p.path, values.get(name).and_then(Value::as_str)) else {
                continue;
            };
            let rejected = |source| CallError::Path {
                name: name.clone(),
                source,
            };
            let rel = self.workspace.resolve(raw, role).map_err(rejected)?;
            // Landlock grants an input with everything beneath it: no input may cover other
            // calls' job dirs or another filesystem.
            if role == PathRole::Input {
                self.workspace
                    .check_input_reach(raw, &rel)
                    .map_err(rejected)?;
            }
            out.push((name.clone(), role, rel));
        }
        Ok(out)
    }

    #[allow(clippy::too_many_arguments)]
    async fn run_read(
        &self,
        policy: &Policy,
        call: &Call,
        tool: &Tool,
        ext: &ExternalTool,
        values: Map<String, Value>,
        cancel: &CancellationToken,
        progress: Option<&progress::Progress>,
    ) -> Result<ToolReply, Stop> {
        let paths = self.resolve_paths(tool, &values)?;
        let root = self.workspace.root().to_path_buf();
        // Read tools have no outputs (the policy loader refuses them), so nothing is staged.
        let mut bound = args::bind(&values, &paths, &root, None, |_| root.clone());
        worker_paths::hand_to_worker(&self.reach, &mut bound, &root, path_names(&paths));
        bound.env = args::bind_env(tool, &values).map_err(Stop::from)?;
        self.check_bounds(policy, tool, ext, &bound, None)?;
        let _slot = self.slot(call, cancel).await?;
        self.recheck(policy, call, tool)?;
        let stdin = match ext.protocol {
            Protocol::Json => json_request(&tool.name, &bound.arguments, None),
            Protocol::Argv => Vec::new(),
        };
        let launch = self.launch(
            policy,
            ext,
            &bound.subst,
            std::mem::take(&mut bound.env),
            root,
            Vec::new(),
            bound.readable,
            stdin,
            &call.call,
            self.lease()?,
        )?;
        let outcome = self
            .spawn_and_wait(call, launch, ext.timeout, cancel, None, progress)
            .await?;
        let (reply, _state) = self.interpret(tool, &outcome, &call.secrets)?;
        Ok(reply)
    }

    #[allow(clippy::too_many_arguments)]
    async fn run_write(
        &self,
        policy: &Policy,
        call: &Call,
        caller: Caller,
        tool: &Tool,
        ext: &ExternalTool,
        session: &str,
        values: Map<String, Value>,
        cancel: &CancellationToken,
        progress: Option<&progress::Progress>,
    ) -> Result<ToolReply, Stop> {
        // Everything that can be rejected without touching anything is rejected first.
        let paths = self.resolve_paths(tool, &values)?;
        let outputs: Vec<(String, PathBuf)> = paths
            .iter()
            .filter(|(_, role, _)| *role == PathRole::Output)
            .map(|(n, _, p)| (n.clone(), p.clone()))
            .collect();
        args::check_overlap(&outputs).map_err(CallError::Overlap)?;

        // 2. Lock: the session, then the output targets in sorted order.
        let guard = self.lock_session(session, cancel).await?;
        // Checked again under the lock: the id may have been created since step 1.
        caller.check(session, guard.meta().owner)?;
        let mut targets: Vec<PathBuf> = outputs.iter().map(|(_, p)| p.clone()).collect();
        targets.sort();
        let _target_guards = tokio::select! {
            g = self.targets.lock_all(&targets) => g,
            _ = cancel.cancelled() => return Err(Stop::Cancelled),
        };
        let _slot = self.slot(call, cancel).await?;
        // The call starts here: its tool and grant are checked again against the policy
        // current now, and the session's owner against the caller that policy sees.
        let caller = self.recheck(policy, call, tool)?;
        caller.check(session, guard.meta().owner)?;

        // 3. Clone the state: read from its file, under the lock.
        let before = self.sessions.load_locked(&guard).map_err(session_fault)?;

        // What the worker would be handed is bounded before the job dir exists.
        let env = args::bind_env(tool, &values).map_err(Stop::from)?;
        let mut predicted =
            args::bind(&values, &paths, self.workspace.root(), Some(session), |i| {
                let target = outputs.get(i).map_or(std::path::Path::new(""), |(_, t)| t);
                args::predicted_staged_path(self.workspace.root(), &call.call, i, target)
            });
        let predicted_stage = self
            .workspace
            .root()
            .join(format!("{}{}", publish::JOB_DIR_PREFIX, call.call))
            .join("stage");
        worker_paths::hand_to_worker(
            &self.reach,
            &mut predicted,
            &predicted_stage,
            path_names(&paths),
        );
        predicted.env = env.clone();
        self.check_bounds(policy, tool, ext, &predicted, Some(&before))?;

        // 4. The job dir, its journal, and the staged path of every output.
        // The worker's own uid, if it gets one, owns its staging dirs.
        let identity = self.lease()?;
        let spec = JobSpec {
            id: call.call.clone(),
            session: session.to_string(),
            tool: tool.name.clone(),
            targets: outputs.iter().map(|(_, p)| p.clone()).collect(),
            modes: outputs
                .iter()
                .map(|(n, _)| tool.params.get(n).and_then(|p| p.mode))
                .collect(),
            stage_owner: identity.as_ref().map(|l| (l.uid(), l.gid())),
        };
        let mut job = Job::create(&self.workspace, spec).map_err(CallError::Job)?;
        job.hash_up_to(policy.daemon.audit_hash_limit);
        let root = self.workspace.root().to_path_buf();
        let mut bound = args::bind(&values, &paths, &root, Some(session), |i| {
            job.staged_path(i)
        });
        worker_paths::hand_to_worker(
            &self.reach,
            &mut bound,
            &job.stage_dir(),
            path_names(&paths),
        );
        bound.env = env;
        let stdin = match ext.protocol {
            Protocol::Json => json_request(&tool.name, &bound.arguments, Some(&before)),
            Protocol::Argv => Vec::new(),
        };

        // 5-6. Spawn the sandboxed worker and wait, bounded. Whatever stops the call here,
        // nothing was published: the job dir is discarded.
        let stage = job.stage_dir();
        let ran = async {
            let launch = self.launch(
                policy,
                ext,
                &bound.subst,
                std::mem::take(&mut bound.env),
                stage.clone(),
                vec![stage],
                bound.readable,
                stdin,
                &call.call,
                identity,
            )?;
            let outcome = self
                .spawn_and_wait(call, launch, ext.timeout, cancel, Some(&mut job), progress)
                .await?;
            self.interpret(tool, &outcome, &call.secrets)
        }
        .await;
        let (mut reply, new_state) = match ran {
            Ok(r) => r,
            Err(stop) => {
                discard(job).await;
                return Err(stop);
            }
        };
        if let Err(stop) = self.check_staging(ext, &job) {
            discard(job).await;
            return Err(stop);
        }
        // The new state within the session's and its owner's bounds, its room taken before
        // anything is published (QUOTA_EXCEEDED otherwise: nothing published or committed).
        let state = new_state.unwrap_or_else(|| before.state.clone());
        let reserved = match self.sessions.reserve(&guard, &state) {
            Ok(r) => r,
            Err(e) => {
                discard(job).await;
                return Err(session_fault(e));
            }
        };

        // The point of no return: publication starts. A cancel that came before it rolls
        // the call back (nothing published, no response); one that comes after it is too
        // late: the call completes and its result is sent (`cancel_too_late` in the audit).
        // Nothing between this check and the publication awaits.
        if cancel.is_cancelled() {
            discard(job).await;
            return Err(Stop::Cancelled);
        }
        if let Some(p) = progress {
            p.phase(progress::Phase::Publishing);
        }

        // 7. Publish the outputs, then commit the state: the commit point. The `commit`
        // event is durable in the audit log before it; if it cannot be, the call rolls back.
        let mut committed = None;
        let mut audit_failed = None;
        let hash_limit = policy.daemon.audit_hash_limit;
        // Off the async threads: publication fsyncs, and its cleanup removes whatever the
        // worker left in staging.
        let published = tokio::task::block_in_place(|| {
            job.publish_and_commit_with(|outputs| {
                let version = before.version + 1;
                let detail = json!({
                    "version": version,
                    "outputs": outputs.iter().map(|o| output_detail(o, hash_limit)).collect::<Vec<_>>(),
                });
                if let Err(e) = self.record_commit(call, detail) {
                    audit_failed = Some(e);
                    return Err("the commit event could not be recorded in the audit log".into());
                }
                self.sessions
                    .commit_reserved(&guard, reserved, state, &call.call)
                    .map(|snap| committed = Some(snap))
                    .map_err(Into::into)
            })
        });
        if let Err(e) = published {
            // What the worker left is at fault, not publication: nothing was published.
            if let publish::PublishError::BadOutput { index, reason, .. } = &e {
                let param = outputs.get(*index).map_or("?", |(n, _)| n.as_str());
                return Err(CallError::ToolFailed(format!(
                    "{}: output `{param}` must be a regular file with one link (directory \
                     outputs are not supported): {reason}; nothing was published and the \
                     session is unchanged",
                    tool.name
                ))
                .into());
            }
            let restored = !matches!(e, publish::PublishError::RollbackFailed { .. });
            if let (Some(a), true) = (audit_failed, restored) {
                return Err(CallError::AuditFailed(a).into());
            }
            return Err(CallError::Publish {
                source: e,
                restored,
            }
            .into());
        }
        let version = committed.as_ref().map_or(before.version, |s| s.version);
        // A tool that printed nothing gives no empty text block: the result's content is
        // the structured result's text alone.
        reply
            .content
            .retain(|b| !(b["type"] == "text" && b["text"] == ""));
        reply.structured = Some(json!({
            "session": session,
            "version": version,
            "outputs": outputs.iter().map(|(n, p)| json!({"param": n, "path": p})).collect::<Vec<_>>(),
        }));
        Ok(reply)
    }

    /// Whether a connecting peer is a worker (its uid is a worker uid, or it is in the
    /// process group of a live worker): such connections are refused.
    pub fn is_worker_peer(&self, pid: Option<i32>, uid: u32) -> bool {
        self.identities
            .range()
            .is_some_and(|(a, b)| (a..=b).contains(&uid))
            || pid.is_some_and(|p| self.sandbox.in_live_worker_group(p))
    }

    /// A uid of the worker's own, when workers get one.
    fn lease(&self) -> Result<Option<crate::sandbox::Lease>, Stop> {
        self.identities
            .lease()
            .map_err(|e| CallError::from(e).into())
    }

    /// Fails the call if the worker left more in staging than its profile allows.
    fn check_staging(&self, ext: &ExternalTool, job: &Job) -> Result<(), Stop> {
        let l = &ext.profile.limits;
        tokio::task::block_in_place(|| job.check_staging(l.staging_files, l.staging_bytes))
            .map(drop)
            .map_err(|e| CallError::Staging(e).into())
    }

    /// A call slot for the call's principal, within its share; `BUSY` at once if its
    /// share is running and its queue full.
    async fn slot(&self, call: &Call, cancel: &CancellationToken) -> Result<slots::Slot, Stop> {
        let uid = call.principal.as_ref().map_or(u32::MAX, |p| p.uid);
        self.slots.acquire(uid, cancel).await.map_err(|e| match e {
            slots::NoSlot::Busy(b) => CallError::Busy(b).into(),
            slots::NoSlot::Cancelled => Stop::Cancelled,
        })
    }

    #[allow(clippy::too_many_arguments)]
    fn launch(
        &self,
        policy: &Policy,
        ext: &ExternalTool,
        subst: &BTreeMap<String, String>,
        env: Vec<(String, String)>,
        cwd: PathBuf,
        writable: Vec<PathBuf>,
        readable: Vec<PathBuf>,
        stdin: Vec<u8>,
        job_id: &str,
        identity: Option<crate::sandbox::Lease>,
    ) -> Result<Launch, Stop> {
        Ok(Launch {
            argv: args::substitute(&ext.command, subst),
            env,
            cwd,
            stdin,
            writable,
            readable,
            profile: ext.profile.clone(),
            cgroup_parent: policy.daemon.cgroup.clone(),
            job_id: job_id.to_string(),
            identity,
            registry: Some(self.registry.clone()),
            progress: None,
        })
    }

    async fn spawn_and_wait(
        &self,
        call: &Call,
        launch: Launch,
        timeout: std::time::Duration,
        cancel: &CancellationToken,
        job: Option<&mut Job>,
        progress: Option<&progress::Progress>,
    ) -> Result<Outcome, Stop> {
        let seccomp = launch.profile.seccomp.mode;
        let launch = Launch {
            progress: progress.map(progress::Progress::worker),
            ..launch
        };
        let worker = Worker::spawn(&self.sandbox, launch, &self.filters)
            .await
            .map_err(CallError::from)?;
        if let Some(p) = progress {
            p.phase(progress::Phase::Running);
        }
        if let Some(job) = job {
            if let Err(e) = job.record_worker(worker.pid()) {
                tracing::warn!(call = %call.call, "cannot journal the worker pid: {e}");
            }
        }
        let mut start = json!({
            "pid": worker.pid(),
            "timeout_ms": timeout.as_millis() as u64,
            "seccomp": seccomp,
        });
        if let Some(e) = worker.enforcement() {
            start["landlock"] = json!(e.landlock);
            start["landlock_abi"] = json!(e.landlock_abi);
            start["containment"] = json!(e.containment);
        }
        self.record_start(call, start);
        let outcome = worker
            .finish(timeout, cancel.clone())
            .await
            .map_err(CallError::from)?;
        // When the worker's group was gone, in ms since the call began: the terminal event's
        // `duration_ms` minus this is what came after it (publication, for a commit).
        call.note("worker_ms", json!(call.t0.elapsed().as_millis() as u64));
        // The kill is confirmed when `finish` returns: every process of the group (or the
        // cgroup) is gone.
        let terminated = json!({
            "pid": outcome.pid,
            "confirmed_by": outcome.enforcement.containment,
        });
        match outcome.end {
            End::TimedOut => {
                call.timed_out.store(true, Ordering::SeqCst);
                self.event(
                    call,
                    EventKind::Timeout,
                    json!({"after_ms": timeout.as_millis() as u64}),
                );
                self.event(call, EventKind::WorkerTerminated, terminated);
                Err(CallError::Timeout {
                    tool: call.tool.clone(),
                    after: timeout,
                }
                .into())
            }
            End::Cancelled => {
                call.cancel_recorded.store(true, Ordering::SeqCst);
                self.event(call, EventKind::Cancel, self.cancel_detail(call, "running"));
                self.event(call, EventKind::WorkerTerminated, terminated);
                Err(Stop::Cancelled)
            }
            End::Exited(status) => {
                call.note("exit", json!({"status": status}));
                Ok(outcome)
            }
            End::Signaled(signal) => {
                call.note("exit", json!({"signal": signal}));
                Ok(outcome)
            }
        }
    }

    /// Bounds what a call would hand its worker, before anything is created for it: the
    /// command line (each element, and the whole with the environment, within what `execve`
    /// accepts) and, for a `json` tool, the request (within `max_message_size`). A call past
    /// a bound is `INVALID_ARGUMENT`, naming the argument and the limit.
    fn check_bounds(
        &self,
        policy: &Policy,
        tool: &Tool,
        ext: &ExternalTool,
        bound: &args::Bound,
        session: Option<&Snapshot>,
    ) -> Result<(), Stop> {
        let invalid = Stop::from;
        let env = worker_env_bytes(&ext.profile.env)
            + args::env_bytes(bound.env.iter().map(|(k, v)| (k.as_bytes(), v.as_bytes())));
        let stack = rustix::process::getrlimit(rustix::process::Resource::Stack).current;
        args::check_command(
            &tool.name,
            &ext.command,
            &bound.subst,
            env,
            args::argv_budget(stack),
        )
        .map_err(invalid)?;
        if ext.protocol == Protocol::Json {
            let limit = policy.daemon.max_message_bytes;
            let len = json_request(&tool.name, &bound.arguments, session).len();
            if len > limit {
                let size = |m: &Map<String, Value>| serde_json::to_vec(m).map_or(0, |v| v.len());
                return Err(invalid(args::ArgError::RequestTooLarge {
                    tool: tool.name.clone(),
                    len,
                    arguments: size(&bound.arguments),
                    state: session.map_or(0, |s| size(&s.state)),
                    limit,
                }));
            }
        }
        Ok(())
    }

    /// Turns a finished worker into a reply and, for `json` tools, an optional new state.
    fn interpret(
        &self,
        tool: &Tool,
        o: &Outcome,
        secrets: &Secrets,
    ) -> Result<(ToolReply, Option<Map<String, Value>>), Stop> {
        let protocol = match &tool.kind {
            ToolKind::External(e) => e.protocol,
            ToolKind::Builtin(_) => Protocol::Argv,
        };
        let stderr_tail = stderr_tail(&o.stderr, secrets, STDERR_TAIL);
        let hint = write_denied_hint(tool, &stderr_tail);
        match o.end {
            End::Exited(0) => {}
            End::Exited(code) => {
                return Err(CallError::ToolFailed(format!(
                    "{} exited with status {code}; nothing was published; \
                     stderr: {stderr_tail}{hint}",
                    tool.name
                ))
                .into())
            }
            End::Signaled(sig) => {
                return Err(CallError::ToolFailed(format!(
                    "{} was killed by signal {sig}; nothing was published; \
                     stderr: {stderr_tail}{hint}",
                    tool.name
                ))
                .into())
            }
            End::TimedOut | End::Cancelled => return Err(Stop::Cancelled),
        }
        let stdout = String::from_utf8_lossy(&o.stdout.bytes).into_owned();
        match protocol {
            Protocol::Argv => {
                let mut text = stdout;
                if o.stdout.truncated {
                    text.push_str(&format!(
                        "\n[airlock: stdout truncated: {} of {} bytes kept]",
                        o.stdout.bytes.len(),
                        o.stdout.total
                    ));
                }
                Ok((ToolReply::ok(text, Value::Null), None))
            }
            Protocol::Json => {
                if o.stdout.truncated {
                    return Err(CallError::ToolFailed(format!(
                        "{} wrote {} bytes to stdout, more than the cap of {}",
                        tool.name,
                        o.stdout.total,
                        o.stdout.bytes.len()
                    ))
                    .into());
                }
                parse_json_response(&tool.name, &stdout, secrets).map_err(Stop::Fault)
            }
        }
    }
}

/// One published output in the `commit` event: its path, size and SHA-256, or, above the
/// hash limit, its size and identity only (and a note saying so).
fn output_detail(o: &publish::Published, hash_limit: u64) -> Value {
    let mut v = json!({
        "path": o.target,
        "size": o.size,
        "dev": o.id.dev,
        "ino": o.id.ino,
    });
    match &o.sha256 {
        Some(h) => v["sha256"] = json!(h),
        None => {
            v["sha256"] = Value::Null;
            v["not_hashed"] = json!(format!(
                "larger than audit_hash_limit ({hash_limit} bytes): size and identity only"
            ));
        }
    }
    v
}

/// Turns a `json`-protocol worker's stdout into a reply and an optional new state. The whole
/// response is checked here, before anything is published: an invalid one is `TOOL_FAILED`,
/// so nothing is published and the session stays at its version.
fn parse_json_response(
    tool: &str,
    stdout: &str,
    secrets: &Secrets,
) -> Result<(ToolReply, Option<Map<String, Value>>), CallError> {
    let r = response::parse(stdout, secrets).map_err(|e| {
        CallError::ToolFailed(format!(
            "{tool} returned an invalid JSON response: {e}; nothing was published and the \
             session is unchanged"
        ))
    })?;
    if r.is_error {
        return Err(CallError::ToolReported {
            tool: tool.to_string(),
            content: r.content,
        });
    }
    Ok((
        ToolReply {
            is_error: false,
            content: r.content,
            structured: None,
        },
        r.state,
    ))
}

/// The bytes of environment the launcher will hand a worker of this profile (an upper
/// bound: a kept variable that `set` overrides is counted twice).
fn worker_env_bytes(env: &EnvProfile) -> usize {
    use std::os::unix::ffi::OsStrExt;
    let kept: Vec<(&str, std::ffi::OsString)> = env
        .keep
        .iter()
        .filter_map(|k| std::env::var_os(k).map(|v| (k.as_str(), v)))
        .collect();
    args::env_bytes(
        kept.iter()
            .map(|(k, v)| (k.as_bytes(), v.as_bytes()))
            .chain(env.set.iter().map(|(k, v)| (k.as_bytes(), v.as_bytes()))),
    )
}

fn json_request(
    tool: &str,
    arguments: &Map<String, Value>,
    session: Option<&crate::session::Snapshot>,
) -> Vec<u8> {
    let mut req = json!({"tool": tool, "arguments": arguments});
    if let Some(s) = session {
        req["session"] = json!({"id": s.id, "version": s.version, "state": s.state});
    }
    let mut bytes = req.to_string().into_bytes();
    bytes.push(b'\n');
    bytes
}

/// The sentence a failed write tool's `TOOL_FAILED` message ends with when its stderr says
/// a write was refused (or it declares no output, so every write is): the sandbox, not the
/// file, refused it. Empty otherwise.
fn write_denied_hint(tool: &Tool, stderr_tail: &str) -> String {
    if tool.capability != crate::policy::Capability::Write {
        return String::new();
    }
    let outputs: Vec<&str> = tool
        .params
        .iter()
        .filter(|(_, p)| p.path == Some(PathRole::Output))
        .map(|(n, _)| n.as_str())
        .collect();
    let denied = [
        "Permission denied",
        "Read-only file system",
        "EACCES",
        "EROFS",
    ]
    .iter()
    .any(|m| stderr_tail.contains(m));
    if outputs.is_empty() {
        " (the tool declares no output: the worker may write nothing in the workspace, its \
         inputs are read-only; writes elsewhere are denied)"
            .into()
    } else if denied {
        format!(
            " (the worker may write only its staged outputs ({}); writes elsewhere, its inputs \
             included, are denied)",
            outputs.join(", ")
        )
    } else {
        String::new()
    }
}

/// The bytes of a failed worker's stderr its `TOOL_FAILED` message quotes (its end).
const STDERR_TAIL: usize = 2000;

/// The end of a worker's stderr as a fault message quotes it: the whole capture scrubbed of
/// the call's secrets, then its last `n` bytes, with any fragment of a secret at either cut
/// (the capture's cap, if it was reached, and the tail's start) replaced. A character the
/// cap split is dropped first, so that a secret's prefix before it ends at the cut.
fn stderr_tail(captured: &crate::sandbox::Captured, secrets: &Secrets, n: usize) -> String {
    let mut bytes = captured.bytes.as_slice();
    if captured.truncated {
        if let Err(e) = std::str::from_utf8(bytes) {
            if e.error_len().is_none() {
                bytes = &bytes[..e.valid_up_to()];
            }
        }
    }
    let text = String::from_utf8_lossy(bytes);
    let (tail, _) = secrets.tail(&text, n, captured.truncated);
    let s = tail.trim();
    if s.is_empty() {
        "(empty)".to_string()
    } else {
        s.to_string()
    }
}

/// Removes the job dir of a call that publishes nothing, off the async threads (a worker
/// may have left any number of files).
/// The names of a call's path arguments.
fn path_names(paths: &[(String, PathRole, PathBuf)]) -> impl Iterator<Item = &str> {
    paths.iter().map(|(n, _, _)| n.as_str())
}

async fn discard(job: Job) {
    let dir = job.dir().to_path_buf();
    let done = tokio::task::spawn_blocking(move || job.discard()).await;
    match done {
        Ok(Ok(())) => {}
        Ok(Err(e)) => tracing::error!(
            "cannot remove job dir {}: {e}; startup recovery will (or quarantine it)",
            dir.display()
        ),
        Err(e) => tracing::error!("removing job dir {} failed: {e}", dir.display()),
    }
}

/// Cancels `to` when `from` is cancelled, for as long as the returned guard lives.
fn link(from: &CancellationToken, to: &CancellationToken) -> tokio_util::sync::DropGuard {
    let (from, to2) = (from.clone(), to.clone());
    let stop = CancellationToken::new();
    let stop2 = stop.clone();
    tokio::spawn(async move {
        tokio::select! {
            _ = from.cancelled() => to2.cancel(),
            _ = stop2.cancelled() => {}
        }
    });
    stop.drop_guard()
}

/// The longest argument value (as JSON) the audit's `allow` event shows; a longer one is
/// recorded by its size only.
const ARGUMENT_SHOWN: usize = 128;

/// Who makes a call, as far as sessions are concerned.
#[derive(Debug, Clone, Copy)]
struct Caller {
    uid: u32,
    /// Holds `admin`: every session is its own.
    admin: bool,
}

impl Caller {
    /// Whether the caller may use session `id` of `owner` (`None`: recorded before owners
    /// were, which only `admin` reaches).
    fn check(self, id: &str, owner: Option<u32>) -> Result<(), CallError> {
        if self.admin || owner == Some(self.uid) {
            Ok(())
        } else {
            Err(CallError::SessionForbidden {
                session: id.to_string(),
            })
        }
    }
}

/// Counts a call out of `in_flight` however it ends (cancellation drops the future).
struct InFlight<'a>(&'a AtomicUsize, &'a tokio::sync::Notify);

impl Drop for InFlight<'_> {
    fn drop(&mut self) {
        self.0.fetch_sub(1, Ordering::Relaxed);
        self.1.notify_one();
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn json_response_shapes() {
        let (r, s) = parse_json_response(
            "t",
            r#"{"content":[{"type":"text","text":"hi"}],"state":{"n":1}}"#,
            &Secrets::default(),
        )
        .unwrap();
        assert!(!r.is_error);
        assert_eq!(s.unwrap()["n"], 1);
        assert!(parse_json_response("t", "not json", &Secrets::default()).is_err());
        assert!(parse_json_response("t", r#"{"state": 3}"#, &Secrets::default()).is_err());
        let e = parse_json_response(
            "t",
            r#"{"isError": true, "content": []}"#,
            &Secrets::default(),
        )
        .unwrap_err();
        assert_eq!(e.code(), ErrorCode::ToolFailed);
    }
}
