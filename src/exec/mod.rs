//! The execution model of one call, in one place: authorize, lock, clone, stage, spawn,
//! wait, publish, commit, audit, respond. Every other module is a step this one calls.

pub mod args;
mod locks;
#[cfg(test)]
mod proptests;
pub mod response;

use std::collections::BTreeMap;
use std::path::PathBuf;
use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::{SystemTime, UNIX_EPOCH};

use serde_json::{json, Map, Value};
use tokio::sync::Semaphore;
use tokio_util::sync::CancellationToken;

use crate::audit::{Audit, CallRef, EventKind, Principal};
use crate::policy::{
    Builtin, Capability, EnvProfile, ExternalTool, PathRole, Policy, Protocol, Tool,
};
use crate::publish::{self, Job, JobSpec, Workspace};
use crate::sandbox::{End, Identities, Launch, Outcome, Registry, Worker};
use crate::session::{SessionError, SessionStore, Snapshot};

#[derive(Debug, thiserror::Error)]
pub enum StartupError {
    #[error("cannot create the workspace {path}: {source}")]
    Workspace {
        path: PathBuf,
        source: std::io::Error,
    },
    #[error("cannot open the workspace: {0}")]
    OpenWorkspace(#[from] publish::PublishError),
    #[error("cannot open the session store: {0}")]
    Sessions(#[from] SessionError),
    #[error("startup recovery failed: {0}")]
    Recovery(String),
    #[error(transparent)]
    AuditLog(#[from] crate::audit::log::LogError),
    #[error("{path}: another airlock process holds this {what}; stop it first (one daemon, or `airlock recover`, per workspace and per state dir)")]
    Busy { what: &'static str, path: PathBuf },
    #[error("{path}: cannot lock the {what}: {source}")]
    Lock {
        what: &'static str,
        path: PathBuf,
        source: crate::fsutil::LockError,
    },
    #[error("cannot create the state dir {path}: {source}")]
    StateDir {
        path: PathBuf,
        source: std::io::Error,
    },
    #[error(
        "workers run under uids of their own and cannot reach the workspace {workspace}: \
         {dir} is not searchable by other users (mode {mode:04o}); make it searchable \
         (chmod o+x), move the workspace, or set worker_user = \"daemon\""
    )]
    Unreachable {
        workspace: PathBuf,
        dir: PathBuf,
        mode: u32,
    },
    #[error("worker identities: {0}")]
    Identity(#[from] crate::sandbox::IdentityError),
    #[error("cannot open the worker registry: {0}")]
    Registry(std::io::Error),
    #[error("cannot resolve {path}: {source}")]
    Resolve {
        path: PathBuf,
        source: std::io::Error,
    },
    /// The state dir or the socket is inside the workspace, where a tool could publish over
    /// it (a forged session file, say).
    #[error("the {what} {path} is inside {workspace}; keep the workspace, the state dir and the socket apart (workspace, state_dir and socket in airlock.toml, or --workspace / --state-dir / --socket)")]
    InsideWorkspace {
        what: &'static str,
        path: PathBuf,
        workspace: PathBuf,
    },
}

/// One `tools/call`, as the MCP layer hands it over.
pub struct CallRequest {
    pub tool: String,
    pub args: Map<String, Value>,
    pub principal: Principal,
    /// Cancelled by `notifications/cancelled` or the client's disconnect.
    pub cancel: CancellationToken,
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

    /// A tool fault: the text starts with the stable code, so callers and models can act.
    pub fn fault(code: &str, message: impl std::fmt::Display) -> ToolReply {
        ToolReply {
            is_error: true,
            content: vec![json!({"type": "text", "text": format!("{code}: {message}")})],
            structured: Some(json!({"error": {"code": code, "message": message.to_string()}})),
        }
    }
}

/// Why a call ended without a result to publish; becomes a fault reply or no reply.
enum Stop {
    Fault(ToolReply),
    Cancelled,
}

impl From<ToolReply> for Stop {
    fn from(r: ToolReply) -> Stop {
        Stop::Fault(r)
    }
}

fn session_fault(e: SessionError) -> Stop {
    let code = match e {
        SessionError::NotFound(_) => "NO_SUCH_SESSION",
        SessionError::Destroyed(_) => "SESSION_DESTROYED",
        SessionError::Exists(_) => "SESSION_EXISTS",
        SessionError::BadId(_) => "INVALID_ARGUMENT",
        SessionError::Io { .. } | SessionError::Corrupt { .. } => "STATE_ERROR",
    };
    Stop::Fault(ToolReply::fault(code, e))
}

pub struct Executor {
    /// The policy new calls start on; SIGHUP swaps it (`replace_policy`), a call in flight
    /// keeps the `Arc` it started with.
    policy: std::sync::RwLock<Arc<Policy>>,
    /// Calls between the start and the end of `call`, for `STATUS=`.
    in_flight: AtomicUsize,
    pub sessions: SessionStore,
    pub workspace: Workspace,
    pub audit: Audit,
    targets: locks::TargetLocks,
    slots: Arc<Semaphore>,
    shutdown: CancellationToken,
    counter: AtomicU64,
    /// Who workers run as.
    identities: Identities,
    /// Live workers, for the next start to sweep if the daemon dies.
    registry: Registry,
    /// The exclusive lock on the workspace, held while the daemon runs.
    _lock: std::fs::File,
    /// The exclusive lock on the state dir, held while the daemon runs.
    _state_lock: std::fs::File,
}

impl Executor {
    /// Opens the workspace and the session store, and recovers every leftover job before
    /// the first call can run.
    pub fn start(
        policy: Arc<Policy>,
        shutdown: CancellationToken,
    ) -> Result<Executor, StartupError> {
        let d = &policy.daemon;
        std::fs::create_dir_all(&d.workspace).map_err(|source| StartupError::Workspace {
            path: d.workspace.clone(),
            source,
        })?;
        check_layout(&d.workspace, &d.state_dir, Some(&d.socket))?;
        let lock = lock_workspace(&d.workspace)?;
        let state_lock = lock_state_dir(&d.state_dir)?;
        let workspace = Workspace::open(&d.workspace)?;
        let sessions = SessionStore::open(&d.state_dir)?;
        let identities = Identities::detect(d.worker_user, d.worker_uids, d.max_concurrent_calls)?;
        tracing::info!("workers run as {}", identities.describe());
        if identities.range().is_some() {
            check_reachable_by_workers(&d.workspace)?;
        }
        // Before recovery touches a job dir, nothing a dead daemon's workers left may run.
        let registry = sweep_leftovers(d, identities.range())?;
        let audit = open_audit(d)?;
        recover(&workspace, &sessions, &audit)?;
        Ok(Executor {
            identities,
            registry,
            _lock: lock,
            _state_lock: state_lock,
            audit,
            slots: Arc::new(Semaphore::new(d.max_concurrent_calls)),
            policy: std::sync::RwLock::new(policy),
            in_flight: AtomicUsize::new(0),
            sessions,
            workspace,
            targets: locks::TargetLocks::default(),
            shutdown,
            counter: AtomicU64::new(0),
        })
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
        *self.policy.write().unwrap_or_else(|p| p.into_inner()) = new;
    }

    /// How many calls are running.
    pub fn calls_in_flight(&self) -> usize {
        self.in_flight.load(Ordering::Relaxed)
    }

    /// Runs one `tools/call` to its terminal result, on the policy current when it starts.
    pub async fn call(&self, req: CallRequest) -> Reply {
        self.in_flight.fetch_add(1, Ordering::Relaxed);
        let _counted = InFlight(&self.in_flight);
        let policy = self.policy();
        let Some(tool) = policy.tools.get(&req.tool) else {
            return Reply::UnknownTool(req.tool);
        };
        // The session a call names (session_create names the one it creates).
        let creates = tool.builtin == Some(Builtin::SessionCreate);
        let session = req
            .args
            .get(if creates { "id" } else { "session" })
            .and_then(Value::as_str)
            .filter(|s| crate::session::valid_id(s))
            .map(str::to_string);
        let call = Call {
            r: CallRef {
                call: self.new_call_id(),
                tool: tool.name.clone(),
                session: session.clone().filter(|_| tool.takes_session() || creates),
                principal: Some(req.principal.clone()),
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

        // 1. Authorize. Every local peer is allowed until grants exist.
        let mut allow = json!({"capability": tool.capability.as_str()});
        if let Some(ext) = &tool.exec {
            allow["timeout_ms"] = json!(ext.timeout.as_millis() as u64);
        }
        self.event(&call, EventKind::Allow, allow);
        let outcome = match args::validate(tool, &req.args) {
            Err(msg) => Err(ToolReply::fault("INVALID_ARGUMENT", msg).into()),
            Ok(values) => match (tool.builtin, &tool.exec, tool.capability) {
                (Some(b), _, _) => self.builtin(&call, b, &req.args, &cancel).await,
                (None, Some(ext), Capability::Read) => {
                    self.run_read(&policy, &call, tool, ext, values, &cancel)
                        .await
                }
                (None, Some(ext), Capability::Write) => {
                    let id = session.unwrap_or_default();
                    self.run_write(&policy, &call, tool, ext, &id, values, &cancel)
                        .await
                }
                (None, None, _) => Err(ToolReply::fault(
                    "INTERNAL",
                    "a tool with neither a command nor a built-in",
                )
                .into()),
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
            Err(Stop::Fault(reply)) => {
                let err = reply
                    .structured
                    .as_ref()
                    .and_then(|s| s.get("error"))
                    .cloned()
                    .unwrap_or(Value::Null);
                let code = err.get("code").cloned().unwrap_or(Value::Null);
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

    async fn builtin(
        &self,
        call: &Call,
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
                let state = raw
                    .get("state")
                    .and_then(Value::as_object)
                    .cloned()
                    .unwrap_or_default();
                self.record_start(call, json!({}));
                // The commit event is durable before the session exists; a create that fails
                // anyway (the id is taken) is followed by its error and rollback.
                let fresh = crate::session::valid_id(&id) && self.sessions.snapshot(&id).is_err();
                let detail = json!({"version": 0, "created": true});
                if fresh {
                    self.commit_event(call, detail.clone())?;
                }
                let snap = self.sessions.create(&id, state).map_err(session_fault)?;
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
                self.record_start(call, json!({}));
                let version = guard.snapshot().version;
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
                self.record_start(call, json!({}));
                let snap = self.sessions.snapshot(id).map_err(session_fault)?;
                Ok(ToolReply::ok(
                    serde_json::to_string(&snap_json(&snap)).unwrap_or_default(),
                    snap_json(&snap),
                ))
            }
            Builtin::SessionList => {
                self.record_start(call, json!({}));
                let list: Vec<Value> = self
                    .sessions
                    .list()
                    .iter()
                    .map(|s| json!({"id": s.id, "version": s.version}))
                    .collect();
                let v = json!({"sessions": list});
                Ok(ToolReply::ok(v.to_string(), v))
            }
        }
    }

    /// Records the call's `commit` durably (fsynced, possibly with others' events): called
    /// before the commit point. A failure is `AUDIT_FAILED`, and the call does not commit.
    fn commit_event(&self, call: &Call, detail: Value) -> Result<(), Stop> {
        let mut d = call.finish_detail();
        if let Value::Object(m) = detail {
            d.extend(m);
        }
        self.audit
            .record_durable(&call.r, EventKind::Commit, Value::Object(d))
            .map_err(|e| {
                ToolReply::fault(
                    "AUDIT_FAILED",
                    format!("the commit could not be recorded durably in the audit log: {e}; nothing was committed"),
                )
                .into()
            })
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
        let mut out = Vec::new();
        for (name, p) in &tool.params {
            let (Some(role), Some(raw)) = (p.path, values.get(name).and_then(Value::as_str)) else {
                continue;
            };
            let rejected = |e| ToolReply::fault("PATH_REJECTED", format!("argument {name:?}: {e}"));
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

    async fn run_read(
        &self,
        policy: &Policy,
        call: &Call,
        tool: &Tool,
        ext: &ExternalTool,
        values: Map<String, Value>,
        cancel: &CancellationToken,
    ) -> Result<ToolReply, Stop> {
        let paths = self.resolve_paths(tool, &values)?;
        let root = self.workspace.root().to_path_buf();
        // Read tools have no outputs (the policy loader refuses them), so nothing is staged.
        let bound = args::bind(&values, &paths, &root, None, |_| root.clone());
        self.check_bounds(policy, tool, ext, &bound, None)?;
        let _slot = self.slot(cancel).await?;
        let stdin = match ext.protocol {
            Protocol::Json => json_request(&tool.name, &bound.arguments, None),
            Protocol::Argv => Vec::new(),
        };
        let launch = self.launch(
            policy,
            ext,
            &bound.subst,
            root,
            Vec::new(),
            bound.readable,
            stdin,
            &call.call,
            self.lease()?,
        )?;
        let outcome = self
            .spawn_and_wait(call, launch, ext.timeout, cancel, None)
            .await?;
        let (reply, _state) = self.interpret(tool, &outcome)?;
        Ok(reply)
    }

    #[allow(clippy::too_many_arguments)]
    async fn run_write(
        &self,
        policy: &Policy,
        call: &Call,
        tool: &Tool,
        ext: &ExternalTool,
        session: &str,
        values: Map<String, Value>,
        cancel: &CancellationToken,
    ) -> Result<ToolReply, Stop> {
        // Everything that can be rejected without touching anything is rejected first.
        let paths = self.resolve_paths(tool, &values)?;
        let outputs: Vec<(String, PathBuf)> = paths
            .iter()
            .filter(|(_, role, _)| *role == PathRole::Output)
            .map(|(n, _, p)| (n.clone(), p.clone()))
            .collect();
        args::check_overlap(&outputs).map_err(|m| ToolReply::fault("OVERLAPPING_OUTPUTS", m))?;

        // 2. Lock: the session, then the output targets in sorted order.
        let guard = self.lock_session(session, cancel).await?;
        let mut targets: Vec<PathBuf> = outputs.iter().map(|(_, p)| p.clone()).collect();
        targets.sort();
        let _target_guards = tokio::select! {
            g = self.targets.lock_all(&targets) => g,
            _ = cancel.cancelled() => return Err(Stop::Cancelled),
        };
        let _slot = self.slot(cancel).await?;

        // 3. Clone the state.
        let before = guard.snapshot();

        // What the worker would be handed is bounded before the job dir exists.
        let predicted = args::bind(&values, &paths, self.workspace.root(), Some(session), |i| {
            let target = outputs.get(i).map_or(std::path::Path::new(""), |(_, t)| t);
            args::predicted_staged_path(self.workspace.root(), &call.call, i, target)
        });
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
                .map(|(n, _)| {
                    tool.params
                        .get(n)
                        .and_then(|p| p.mode)
                        .unwrap_or(crate::policy::DEFAULT_OUTPUT_MODE)
                })
                .collect(),
            stage_owner: identity.as_ref().map(|l| (l.uid(), l.gid())),
        };
        let mut job = Job::create(&self.workspace, spec)
            .map_err(|e| ToolReply::fault("PUBLISH_FAILED", e))?;
        job.hash_up_to(policy.daemon.audit_hash_limit);
        let root = self.workspace.root().to_path_buf();
        let bound = args::bind(&values, &paths, &root, Some(session), |i| {
            job.staged_path(i)
        });
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
                stage.clone(),
                vec![stage],
                bound.readable,
                stdin,
                &call.call,
                identity,
            )?;
            let outcome = self
                .spawn_and_wait(call, launch, ext.timeout, cancel, Some(&mut job))
                .await?;
            self.interpret(tool, &outcome)
        }
        .await;
        let (mut reply, new_state) = match ran {
            Ok(r) => r,
            Err(stop) => {
                discard(job).await;
                return Err(stop);
            }
        };
        if let Err(stop) = self.check_staging(policy, ext, &job) {
            discard(job).await;
            return Err(stop);
        }

        // The point of no return: publication starts. A cancel that came before it rolls
        // the call back (nothing published, no response); one that comes after it is too
        // late: the call completes and its result is sent (`cancel_too_late` in the audit).
        // Nothing between this check and the publication awaits.
        if cancel.is_cancelled() {
            discard(job).await;
            return Err(Stop::Cancelled);
        }

        // 7. Publish the outputs, then commit the state: the commit point. The `commit`
        // event is durable in the audit log before it; if it cannot be, the call rolls back.
        let state = new_state.unwrap_or_else(|| before.state.clone());
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
                if let Err(Stop::Fault(r)) = self.commit_event(call, detail) {
                    let msg = r.content.first().and_then(|c| c["text"].as_str()).unwrap_or("AUDIT_FAILED").to_string();
                    audit_failed = Some(r);
                    return Err(msg);
                }
                self.sessions
                    .commit(&guard, state, &call.call)
                    .map(|snap| committed = Some(snap))
                    .map_err(|e| e.to_string())
            })
        });
        if let Err(e) = published {
            if let Some(reply) = audit_failed {
                return Err(reply.into());
            }
            let what = match e {
                publish::PublishError::RollbackFailed { .. } => {
                    "the targets are restored by recovery at the next start"
                }
                _ => "every target was restored and the state is unchanged",
            };
            return Err(ToolReply::fault("PUBLISH_FAILED", format!("{e}; {what}")).into());
        }
        let version = committed.as_ref().map_or(before.version, |s| s.version);
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
            || pid.is_some_and(crate::sandbox::in_live_worker_group)
    }

    /// A uid of the worker's own, when workers get one.
    fn lease(&self) -> Result<Option<crate::sandbox::Lease>, Stop> {
        self.identities
            .lease()
            .map_err(|e| ToolReply::fault("SANDBOX_ERROR", e).into())
    }

    /// Fails the call if the worker left more in staging than its profile allows.
    fn check_staging(&self, policy: &Policy, ext: &ExternalTool, job: &Job) -> Result<(), Stop> {
        let Some(profile) = policy.profiles.get(&ext.profile) else {
            return Ok(());
        };
        let l = &profile.limits;
        tokio::task::block_in_place(|| job.check_staging(l.staging_files, l.staging_bytes))
            .map(drop)
            .map_err(|e| {
                let code = match e {
                    publish::PublishError::StagingLimit { .. } => "TOOL_FAILED",
                    _ => "PUBLISH_FAILED",
                };
                ToolReply::fault(code, e).into()
            })
    }

    async fn slot(
        &self,
        cancel: &CancellationToken,
    ) -> Result<tokio::sync::OwnedSemaphorePermit, Stop> {
        tokio::select! {
            p = self.slots.clone().acquire_owned() => p.map_err(|_| Stop::Cancelled),
            _ = cancel.cancelled() => Err(Stop::Cancelled),
        }
    }

    #[allow(clippy::too_many_arguments)]
    fn launch(
        &self,
        policy: &Policy,
        ext: &ExternalTool,
        subst: &BTreeMap<String, String>,
        cwd: PathBuf,
        writable: Vec<PathBuf>,
        readable: Vec<PathBuf>,
        stdin: Vec<u8>,
        job_id: &str,
        identity: Option<crate::sandbox::Lease>,
    ) -> Result<Launch, Stop> {
        let profile = policy.profiles.get(&ext.profile).ok_or_else(|| {
            ToolReply::fault("INTERNAL", format!("unknown profile {}", ext.profile))
        })?;
        Ok(Launch {
            argv: args::substitute(&ext.command, subst),
            cwd,
            stdin,
            writable,
            readable,
            profile: profile.clone(),
            cgroup_parent: policy.daemon.cgroup.clone(),
            job_id: job_id.to_string(),
            identity,
            registry: Some(self.registry.clone()),
        })
    }

    async fn spawn_and_wait(
        &self,
        call: &Call,
        launch: Launch,
        timeout: std::time::Duration,
        cancel: &CancellationToken,
        job: Option<&mut Job>,
    ) -> Result<Outcome, Stop> {
        let seccomp = launch.profile.seccomp.mode;
        let worker = Worker::spawn(launch)
            .await
            .map_err(|e| ToolReply::fault("SANDBOX_ERROR", e))?;
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
            .map_err(|e| ToolReply::fault("SANDBOX_ERROR", e))?;
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
                Err(ToolReply::fault(
                    "TOOL_TIMEOUT",
                    format!(
                        "{} did not finish within {:?}; its process group was killed and nothing was published",
                        call.tool, timeout
                    ),
                )
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
        let invalid = |e: args::ArgError| Stop::from(ToolReply::fault("INVALID_ARGUMENT", e));
        let env = policy
            .profiles
            .get(&ext.profile)
            .map_or(0, |p| worker_env_bytes(&p.env));
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
    ) -> Result<(ToolReply, Option<Map<String, Value>>), Stop> {
        let protocol = tool.exec.as_ref().map_or(Protocol::Argv, |e| e.protocol);
        let stderr_tail = tail(&o.stderr.bytes, 2000);
        match o.end {
            End::Exited(0) => {}
            End::Exited(code) => {
                return Err(ToolReply::fault(
                    "TOOL_FAILED",
                    format!(
                    "{} exited with status {code}; nothing was published; stderr: {stderr_tail}",
                    tool.name
                ),
                )
                .into())
            }
            End::Signaled(sig) => {
                return Err(ToolReply::fault(
                    "TOOL_FAILED",
                    format!(
                    "{} was killed by signal {sig}; nothing was published; stderr: {stderr_tail}",
                    tool.name
                ),
                )
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
                    return Err(ToolReply::fault(
                        "TOOL_FAILED",
                        format!(
                            "{} wrote {} bytes to stdout, more than the cap of {}",
                            tool.name,
                            o.stdout.total,
                            o.stdout.bytes.len()
                        ),
                    )
                    .into());
                }
                parse_json_response(&tool.name, &stdout).map_err(Stop::Fault)
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
) -> Result<(ToolReply, Option<Map<String, Value>>), ToolReply> {
    let r = response::parse(stdout).map_err(|e| {
        ToolReply::fault(
            "TOOL_FAILED",
            format!(
                "{tool} returned an invalid JSON response: {e}; nothing was published and the \
                 session is unchanged"
            ),
        )
    })?;
    if r.is_error {
        let mut reply = ToolReply::fault(
            "TOOL_FAILED",
            format!("{tool} reported an error; nothing was published"),
        );
        reply.content.extend(r.content);
        return Err(reply);
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

fn tail(bytes: &[u8], n: usize) -> String {
    let start = bytes.len().saturating_sub(n);
    let s = String::from_utf8_lossy(&bytes[start..]).trim().to_string();
    if s.is_empty() {
        "(empty)".to_string()
    } else {
        s
    }
}

/// Removes the job dir of a call that publishes nothing, off the async threads (a worker
/// may have left any number of files).
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

/// Locks the workspace for this process: recovery treats every job dir in it as its own.
pub fn lock_workspace(path: &std::path::Path) -> Result<std::fs::File, StartupError> {
    lock(path, "workspace")
}

/// Creates (0700) and locks the state dir for this process: two daemons sharing one would
/// lose each other's session commits.
pub fn lock_state_dir(path: &std::path::Path) -> Result<std::fs::File, StartupError> {
    crate::fsutil::create_private_dir(path).map_err(|source| StartupError::StateDir {
        path: path.to_path_buf(),
        source,
    })?;
    lock(path, "state dir")
}

fn lock(path: &std::path::Path, what: &'static str) -> Result<std::fs::File, StartupError> {
    use crate::fsutil::LockError;
    crate::fsutil::lock_dir(path).map_err(|e| match e {
        LockError::Held => StartupError::Busy {
            what,
            path: path.to_path_buf(),
        },
        source => StartupError::Lock {
            what,
            path: path.to_path_buf(),
            source,
        },
    })
}

/// With worker uids, every directory from `/` to the workspace root must be searchable by
/// other users: a worker reaches its staging dir and its inputs by absolute path.
fn check_reachable_by_workers(workspace: &std::path::Path) -> Result<(), StartupError> {
    use std::os::unix::fs::PermissionsExt;
    let abs = std::fs::canonicalize(workspace).map_err(|source| StartupError::Workspace {
        path: workspace.to_path_buf(),
        source,
    })?;
    for dir in abs.ancestors() {
        let mode = std::fs::metadata(dir)
            .map_err(|source| StartupError::Workspace {
                path: dir.to_path_buf(),
                source,
            })?
            .permissions()
            .mode();
        if mode & 0o001 == 0 {
            return Err(StartupError::Unreachable {
                workspace: abs.clone(),
                dir: dir.to_path_buf(),
                mode: mode & 0o7777,
            });
        }
    }
    Ok(())
}

/// Kills every process the workers of a previous run left (registry records, the reserved
/// uid range when workers had their own uids, leftover worker cgroups), then returns the
/// registry for this run.
pub fn sweep_leftovers(
    d: &crate::policy::DaemonConfig,
    uids: Option<(u32, u32)>,
) -> Result<Registry, StartupError> {
    let registry = Registry::open(&d.state_dir.join("workers")).map_err(StartupError::Registry)?;
    let mut lines = registry.sweep(uids);
    if let Some(cg) = &d.cgroup {
        lines.extend(crate::sandbox::sweep_cgroups(cg));
    }
    for line in &lines {
        tracing::warn!("startup: {line}");
    }
    Ok(registry)
}

/// Refuses a state dir or a socket inside the workspace (symlinks resolved, whether they
/// exist yet or not): a tool could publish over them.
pub fn check_layout(
    workspace: &std::path::Path,
    state_dir: &std::path::Path,
    socket: Option<&std::path::Path>,
) -> Result<(), StartupError> {
    let resolve = |p: &std::path::Path| {
        crate::fsutil::resolve_lenient(p).map_err(|source| StartupError::Resolve {
            path: p.to_path_buf(),
            source,
        })
    };
    let ws = resolve(workspace)?;
    let state = resolve(state_dir)?;
    if ws.starts_with(&state) {
        return Err(StartupError::InsideWorkspace {
            what: "workspace",
            path: ws,
            workspace: state,
        });
    }
    let mut others = vec![("state dir", state_dir)];
    if let Some(s) = socket {
        others.push(("socket", s));
    }
    for (what, p) in others {
        let r = resolve(p)?;
        if r.starts_with(&ws) {
            return Err(StartupError::InsideWorkspace {
                what,
                path: if r.as_path() == p {
                    r
                } else {
                    PathBuf::from(format!("{} (resolved: {})", p.display(), r.display()))
                },
                workspace: ws,
            });
        }
    }
    Ok(())
}

/// Opens the durable audit log (`audit_log`, beneath the state dir) and the ring in front of
/// it, continuing the log's hash chain.
pub fn open_audit(d: &crate::policy::DaemonConfig) -> Result<Audit, StartupError> {
    let (log, head) =
        crate::audit::log::Log::open(&d.audit_log_path(), d.audit_log_bytes, d.audit_log_keep)?;
    Ok(Audit::with_log(d.audit_ring, d.audit_ring_bytes, log, head))
}

/// Brings every leftover job dir to all-old or all-new before serving, and appends to the
/// audit log the event that tells what became of each job (durably: the log's last word on
/// every job matches the workspace).
pub fn recover(
    workspace: &Workspace,
    sessions: &SessionStore,
    audit: &Audit,
) -> Result<Vec<publish::Recovered>, StartupError> {
    // Each job's event is durable before its journal is dropped: a crash between the two
    // makes the next recovery settle the job and record it again.
    let record = |r: &publish::Recovered| -> Result<(), String> {
        let kind = match (r.settled, r.phase) {
            (publish::Settled::Completed, _) => EventKind::Commit,
            (publish::Settled::RolledBack, _) => EventKind::Rollback,
            // Journaled `worker_running`: nothing was published.
            (publish::Settled::NeverPublished, Some(_)) => EventKind::Rollback,
            // No journal: either the job never got past creation (its last word is not a
            // commit) or a committed job's cleanup was cut short (its last word is its
            // commit); recovery changes no target either way, and the log already says so.
            (publish::Settled::NeverPublished, None) | (publish::Settled::Quarantine, _) => {
                return Ok(())
            }
        };
        let call = CallRef {
            call: r.job.clone(),
            tool: r.tool.clone().unwrap_or_default(),
            session: r.session.clone(),
            principal: None,
            request_id: None,
        };
        let detail = json!({
            "recovery": true,
            "phase": r.phase,
            "action": r.action,
        });
        audit
            .record_durable(&call, kind, detail)
            .map_err(|e| format!("cannot record what recovery did in the audit log: {e}"))
    };
    let done = publish::recover_with(
        workspace.root(),
        &|s, j| sessions.committed(s, j).map_err(|e| e.to_string()),
        &record,
    )
    .map_err(|e| StartupError::Recovery(e.to_string()))?;
    for r in &done {
        tracing::info!(job = %r.job, "recovery: {}", r.action);
    }
    Ok(done)
}

/// Counts a call out of `in_flight` however it ends (cancellation drops the future).
struct InFlight<'a>(&'a AtomicUsize);

impl Drop for InFlight<'_> {
    fn drop(&mut self) {
        self.0.fetch_sub(1, Ordering::Relaxed);
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
        )
        .unwrap();
        assert!(!r.is_error);
        assert_eq!(s.unwrap()["n"], 1);
        assert!(parse_json_response("t", "not json").is_err());
        assert!(parse_json_response("t", r#"{"state": 3}"#).is_err());
        let e = parse_json_response("t", r#"{"isError": true, "content": []}"#).unwrap_err();
        assert!(e.is_error);
    }
}
