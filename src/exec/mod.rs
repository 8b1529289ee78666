//! The execution model of one call, in one place: authorize, lock, clone, stage, spawn,
//! wait, publish, commit, audit, respond. This file is the orchestration; each step is a
//! module: the external tools' runs (`run.rs`), the built-ins (`builtins.rs`), the worker
//! protocol (`protocol.rs`), and the audit lifecycle that decides a call's terminal events
//! from what the steps returned (`lifecycle.rs`).

pub mod args;
mod builtins;
mod error;
mod lifecycle;
mod locks;
pub mod progress;
#[cfg(test)]
mod proptests;
mod protocol;
mod python;
pub mod response;
mod run;
mod slots;
mod undo;
mod worker_paths;

use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::{SystemTime, UNIX_EPOCH};

use serde_json::{json, Map, Value};
use tokio_util::sync::CancellationToken;

pub use error::{CallError, ErrorCode};
pub use python::{python_command, RUNNER as PYTHON_RUNNER};

use crate::audit::event::{self, Allow, Commit, Ran, Start};
use crate::audit::{Audit, CallRef, Event, Principal};
use crate::policy::redact::{self, Secrets};
use crate::policy::{Builtin, Capability, Policy, Right, Subject, Tool, ToolKind};
use crate::publish::Workspace;
use crate::sandbox::{Filters, Identities, Registry, Sandbox};
use crate::session::SessionStore;
use crate::startup::Opened;
use lifecycle::{Canceller, Ending, Outcome, Reached, Run, Stop};

/// One `tools/call`, as the MCP layer hands it over.
pub struct CallRequest {
    pub tool: String,
    pub args: Map<String, Value>,
    pub principal: Principal,
    /// Cancelled by `notifications/cancelled`, the client's disconnect or the daemon's
    /// shutdown: a descendant of the token the executor was started with (the MCP layer's
    /// tokens are: connection, rmcp's request, the call), so the shutdown reaches the call
    /// synchronously, with no task of its own per call.
    pub cancel: CancellationToken,
    /// Where the call reports its phases and its worker's progress, if the client asked.
    pub progress: Option<progress::Progress>,
    /// The client's JSON-RPC id of the request, for the audit.
    pub request_id: Option<Value>,
    /// Whether `cancel` fired because the client asked (else its connection ended or the
    /// daemon is shutting down): the cancel's recorded cause.
    pub client_cancelled: Arc<dyn Fn() -> bool + Send + Sync>,
    /// `_meta["airlock/idempotencyKey"]` as the client sent it (checked by the executor).
    pub idempotency_key: Option<Value>,
}

/// One call as the executor runs it: what its events share.
struct Call {
    r: CallRef,
    t0: std::time::Instant,
    client_cancelled: Arc<dyn Fn() -> bool + Send + Sync>,
    /// When the call began (ms since the epoch), for its job record.
    created_ms: u64,
    /// Its idempotency key, checked.
    key: Option<String>,
    /// What calls with its key must agree on ([`crate::jobs::digest`]).
    digest: String,
    /// An external write tool's call naming a session: it has a job record.
    tracked: bool,
}

impl std::ops::Deref for Call {
    type Target = CallRef;
    fn deref(&self) -> &CallRef {
        &self.r
    }
}

impl Call {
    /// Milliseconds since the call began.
    fn elapsed_ms(&self) -> u64 {
        self.t0.elapsed().as_millis() as u64
    }

    /// A run that had no worker, as its terminal events report it.
    fn ran(&self) -> Ran {
        Ran {
            duration_ms: self.elapsed_ms(),
            ..Ran::default()
        }
    }
}

/// What every step of one call is handed: the policy it started on, the call, its tool,
/// its caller, its cancellation and where it reports progress.
struct Cx<'a> {
    policy: &'a Policy,
    call: &'a Call,
    tool: &'a Tool,
    caller: Caller,
    cancel: &'a CancellationToken,
    progress: Option<&'a progress::Progress>,
    /// A `commit` event of the call was written (or tried): its `rollback`, if one
    /// follows, must be durable too.
    commit_recorded: std::sync::atomic::AtomicBool,
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
    /// Each write call's record, and the outcomes of keyed calls.
    pub jobs: crate::jobs::JobStore,
    targets: locks::TargetLocks,
    /// `max_concurrent_calls` slots, each principal's share bounded (`slots.rs`).
    slots: slots::Slots,
    shutdown: CancellationToken,
    counter: AtomicU64,
    /// The daemon's pid, in every call id (read once, not per call).
    pid: u32,
    /// The workspace root opened at start (`O_PATH`), for a look at a path argument that
    /// only chooses the thread its resolution runs on (`run::may_list_a_directory`); the
    /// resolution itself goes through `workspace`. `None` if it could not be opened: every
    /// resolution then runs off the async threads.
    workspace_dir: Option<std::os::fd::OwnedFd>,
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
        tracing::error!(
            "cannot compile the seccomp filters: {}",
            crate::report::chain(&e)
        );
    }
    tracing::debug!(
        profiles = filters.len(),
        compilations = filters.compilations(),
        "seccomp filters ready"
    );
}

/// How many ended jobs' dirs the daemon keeps for reuse at most ([`crate::publish`]'s pool):
/// more than the write calls that run at once on a busy daemon.
const IDLE_JOB_DIRS: usize = 64;

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
            jobs,
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
        // Ended jobs' dirs are reused: up to this many wait for the next job.
        workspace.keep_idle_job_dirs(IDLE_JOB_DIRS);
        let filters = Filters::new();
        prepare_filters(&filters, &policy, identities.range().is_none());
        let workspace_dir = rustix::fs::open(
            workspace.root(),
            rustix::fs::OFlags::PATH | rustix::fs::OFlags::DIRECTORY | rustix::fs::OFlags::CLOEXEC,
            rustix::fs::Mode::empty(),
        )
        .ok();
        Executor {
            workspace_dir,
            filters,
            sandbox,
            identities,
            reach,
            registry,
            _lock: workspace_lock,
            _state_lock: state_lock,
            audit,
            jobs,
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
            pid: std::process::id(),
        }
    }

    fn new_call_id(&self) -> String {
        let nanos = SystemTime::now()
            .duration_since(UNIX_EPOCH)
            .map_or(0, |d| d.as_nanos());
        let n = self.counter.fetch_add(1, Ordering::Relaxed);
        format!("{:x}-{}-{n}", nanos, self.pid)
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
    fn recheck(&self, cx: &Cx<'_>) -> Result<Caller, Stop> {
        let (started_on, tool) = (cx.policy, cx.tool);
        let current = self.policy();
        let Some(p) = cx.call.principal.as_ref() else {
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
        let key = req.idempotency_key.as_ref().map(crate::jobs::parse_key);
        // A write tool's call, or an undo: it has a job, and may carry a key.
        let writes = tool.capability == Capability::Write
            && matches!(
                tool.kind,
                ToolKind::External(_) | ToolKind::Builtin(Builtin::JobUndo)
            );
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
            client_cancelled: req.client_cancelled.clone(),
            created_ms: crate::audit::time::now_ms(),
            key: key.clone().and_then(Result::ok),
            digest: crate::jobs::digest(&tool.name, &req.args),
            tracked: writes && session.is_some(),
        };
        // Cancelled by the client's request or by the daemon's shutdown (`req.cancel`
        // descends from the shutdown token). Either reaches `cancel` synchronously (a child
        // token), so the point of no return in `run_write` sees every cancel that came
        // before it.
        let cancel = req.cancel.child_token();
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
        let cx = Cx {
            policy: &policy,
            call: &call,
            tool,
            caller,
            cancel: &cancel,
            progress,
            commit_recorded: std::sync::atomic::AtomicBool::new(false),
        };
        // The session checked is the one the call names: `session`, or the id
        // `session_create` would take (an id another principal holds or held is theirs:
        // SESSION_FORBIDDEN, not a hint of whether it is alive).
        if let Err(e) = self.authorize(&policy, who, caller, tool, session.as_deref()) {
            let reply = e.reply(&secrets);
            self.record(
                &cx,
                Event::Deny(event::Deny::Call {
                    code: e.code().as_str().into(),
                    message: error_message(&reply),
                    phase: None,
                }),
            );
            return Reply::Result(reply);
        }
        self.record(
            &cx,
            Event::Allow(Allow {
                capability: tool.capability.as_str(),
                arguments: redact::summary(tool, &req.args, ARGUMENT_SHOWN),
                timeout_ms: match &tool.kind {
                    ToolKind::External(ext) => Some(ext.timeout.as_millis() as u64),
                    ToolKind::Builtin(_) => None,
                },
                idempotency_key: call.key.clone(),
            }),
        );
        // The idempotency key: checked, then claimed (a recorded outcome is returned here,
        // a call running with it is waited for).
        let _hold = match key {
            None => None,
            Some(Err(e)) => {
                return self.finish(&cx, Run::queued(CallError::IdempotencyKey(e).into()))
            }
            Some(Ok(_)) if !writes => {
                let e = CallError::KeyNotApplicable {
                    tool: tool.name.clone(),
                };
                return self.finish(&cx, Run::queued(e.into()));
            }
            Some(Ok(key)) => match self.claim_key(&cx, session.as_deref(), &key).await {
                Ok(hold) => hold,
                Err(Claimed::Replay(reply)) => return reply,
                Err(Claimed::Stop(stop)) => return self.finish(&cx, Run::queued(stop)),
            },
        };
        if call.tracked {
            self.jobs
                .begin(self.job_record(&cx, crate::jobs::JobState::Queued));
        }
        let run = match args::validate(tool, &req.args) {
            Err(e) => Run::queued(e.into()),
            Ok(values) => match (&tool.kind, tool.capability) {
                (ToolKind::Builtin(b), _) => {
                    self.builtin(&cx, builtins::BuiltinCall::parse(*b, &req.args))
                        .await
                }
                (ToolKind::External(ext), Capability::Read) => {
                    self.run_read(&cx, ext, values).await
                }
                (ToolKind::External(ext), Capability::Write) => {
                    let id = session.unwrap_or_default();
                    self.run_write(&cx, ext, &id, values).await
                }
            },
        };
        self.finish(&cx, run)
    }

    /// Records how the call ended (its terminal events, as [`Ending::events`] decides them
    /// from what the steps returned) and makes its reply.
    fn finish(&self, cx: &Cx<'_>, run: Run<ToolReply>) -> Reply {
        let ending = Ending {
            mutating: cx.tool.capability == Capability::Write,
            reached: run.reached,
            too_late: cx.cancel.is_cancelled(),
            duration_ms: cx.call.elapsed_ms(),
            canceller: self.canceller(cx.call),
        };
        let (outcome, reply) = match run.result {
            Ok(reply) => (Outcome::Done, Reply::Result(reply)),
            Err(Stop::Fault(e)) => fault(cx, e, false),
            Err(Stop::TimedOut(e)) => fault(cx, e, true),
            Err(Stop::Denied(e)) => {
                let reply = e.reply(&cx.call.secrets);
                let outcome = Outcome::Denied {
                    code: e.code().as_str(),
                    message: error_message(&reply),
                };
                (outcome, Reply::Result(reply))
            }
            Err(Stop::Cancelled { recorded }) => {
                (Outcome::Cancelled { recorded }, Reply::Cancelled)
            }
        };
        if cx.call.tracked {
            self.settle_job(cx, &outcome, &reply, run.reached != Reached::Queued);
        }
        for e in ending.events(outcome) {
            self.record(cx, e);
        }
        reply
    }

    /// Claims the call's idempotency key in `session`: `Ok` to run (holding the key, or with
    /// no session to scope it by: the call then fails its validation), a replay of the
    /// recorded outcome, or a stop (a mismatch, a cancel while waiting).
    async fn claim_key(
        &self,
        cx: &Cx<'_>,
        session: Option<&str>,
        key: &str,
    ) -> Result<Option<crate::jobs::KeyHold>, Claimed> {
        use crate::jobs::Claim;
        let Some(session) = session else {
            return Ok(None);
        };
        loop {
            match self
                .jobs
                .claim(cx.caller.uid, session, key, &cx.call.digest, &cx.call.call)
            {
                Claim::Run(hold) => return Ok(Some(hold)),
                Claim::Replay(rec) => {
                    self.record(
                        cx,
                        Event::Replay {
                            job: rec.job.clone(),
                        },
                    );
                    let r = rec.reply.unwrap_or_else(|| crate::jobs::RecordedReply {
                        is_error: true,
                        content: Vec::new(),
                        structured: None,
                    });
                    return Err(Claimed::Replay(Reply::Result(ToolReply {
                        is_error: r.is_error,
                        content: r.content,
                        structured: r.structured,
                    })));
                }
                Claim::Mismatch { job } => {
                    return Err(Claimed::Stop(
                        CallError::IdempotencyMismatch {
                            key: key.to_string(),
                            job,
                        }
                        .into(),
                    ))
                }
                Claim::Wait(mut settled) => {
                    tokio::select! {
                        _ = settled.wait_for(|done| *done) => {}
                        _ = cx.cancel.cancelled() => return Err(Claimed::Stop(Stop::CANCELLED)),
                    }
                }
            }
        }
    }

    /// The job record of the call as it stands (`state`), before its run fills it in.
    fn job_record(&self, cx: &Cx<'_>, state: crate::jobs::JobState) -> crate::jobs::JobRecord {
        let call = cx.call;
        crate::jobs::JobRecord {
            job: call.call.clone(),
            uid: cx.caller.uid,
            session: call.session.clone().unwrap_or_default(),
            tool: call.tool.clone(),
            key: call.key.clone(),
            digest: call.digest.clone(),
            state,
            created_ms: call.created_ms,
            ended_ms: None,
            version_before: None,
            version_after: None,
            outputs: Vec::new(),
            error: None,
            reply: None,
            recovered: false,
            undo_of: None,
            undo_reason: None,
        }
    }

    /// Records how a tracked call ended without committing (a commit recorded its own, at
    /// its commit point). A definite failure keeps its reply for the key's retries; a
    /// cancelled call, or one that failed for a reason a retry may not meet (busy, a
    /// failing disk), leaves no outcome: a retry runs afresh.
    ///
    /// An unkeyed call refused before it started (its arguments, its session, a busy
    /// principal) leaves no record: nothing reaches the disk for it.
    fn settle_job(&self, cx: &Cx<'_>, outcome: &Outcome, reply: &Reply, started: bool) {
        use crate::jobs::{JobState, RecordedReply};
        let (state, code, message) = match outcome {
            Outcome::Done => return,
            // Its record stays `publishing`: the next start settles it by the session file.
            Outcome::Fault {
                undecided: true, ..
            } => return,
            Outcome::Fault { code, message, .. } | Outcome::Denied { code, message } => {
                (JobState::Failed, *code, message.clone())
            }
            Outcome::Cancelled { .. } => (JobState::Cancelled, "", None),
        };
        let mut rec = self.job_record(cx, state);
        rec.ended_ms = Some(crate::audit::time::now_ms());
        if state == JobState::Failed {
            rec.error = Some(json!({"code": code, "message": message}));
            let definite = [
                ErrorCode::ToolFailed,
                ErrorCode::ToolTimeout,
                ErrorCode::InvalidArgument,
                ErrorCode::PathRejected,
                ErrorCode::OverlappingOutputs,
            ]
            .iter()
            .any(|c| c.as_str() == code);
            if let (true, true, Reply::Result(r)) = (definite, rec.key.is_some(), reply) {
                rec.reply = Some(RecordedReply {
                    is_error: r.is_error,
                    content: r.content.clone(),
                    structured: r.structured.clone(),
                });
            }
        }
        self.jobs.ended(&rec, started || rec.key.is_some());
    }

    fn record(&self, cx: &Cx<'_>, event: Event) {
        let after_commit = cx.commit_recorded.load(std::sync::atomic::Ordering::SeqCst);
        if let (Event::Rollback(_), true) = (&event, after_commit) {
            // Durable, like the `commit` it follows: after a power loss the log's last word
            // on a job that recorded its commit and then rolled back must still be the
            // rollback (its undoing of the targets may reach the disk first). Off the async
            // threads: the fsync may be slow on a failing disk.
            let durable =
                tokio::task::block_in_place(|| self.audit.record_durable(&cx.call.r, event));
            if let Err(e) = durable {
                tracing::error!(call = %cx.call.call, error = %crate::report::chain(&e), "cannot make a rollback event durable in the audit log");
            }
            return;
        }
        self.audit.record(&cx.call.r, event);
    }

    /// `start`: the call is past its queue and its work begins.
    fn record_start(&self, cx: &Cx<'_>, start: Start) {
        if cx.call.tracked {
            self.jobs
                .set_state(&cx.call.call, crate::jobs::JobState::Running);
        }
        self.record(cx, Event::Start(start));
    }

    /// Who cancelled the call: the client (with its request's id), the daemon's shutdown,
    /// else the client's disconnect.
    fn canceller(&self, call: &Call) -> Canceller {
        Canceller::new(
            (call.client_cancelled)(),
            self.shutdown.is_cancelled(),
            call.request_id.clone(),
        )
    }

    /// Records the call's `commit` durably (fsynced, possibly with others' events): called
    /// before the commit point. A failure is `AUDIT_FAILED`, and the call does not commit.
    fn commit_event(&self, cx: &Cx<'_>, commit: Commit) -> Result<(), Stop> {
        self.record_commit(cx, commit)
            .map_err(|e| CallError::AuditFailed(e).into())
    }

    /// [`Executor::commit_event`] inside publication, where the error goes back to the job.
    fn record_commit(&self, cx: &Cx<'_>, commit: Commit) -> Result<(), crate::audit::AuditError> {
        cx.commit_recorded
            .store(true, std::sync::atomic::Ordering::SeqCst);
        self.audit.record_durable(&cx.call.r, Event::Commit(commit))
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

    async fn lock_session(
        &self,
        id: &str,
        cancel: &CancellationToken,
    ) -> Result<crate::session::SessionGuard, Stop> {
        tokio::select! {
            g = self.sessions.lock(id) => g.map_err(Stop::from),
            _ = cancel.cancelled() => Err(Stop::CANCELLED),
        }
    }

    /// Whether a connecting peer is a worker (its uid is a worker uid, or it is in the
    /// process group of a live worker): such connections are refused.
    pub fn is_worker_peer(&self, pid: Option<i32>, uid: u32) -> bool {
        self.identities
            .range()
            .is_some_and(|(a, b)| (a..=b).contains(&uid))
            || pid.is_some_and(|p| self.sandbox.in_live_worker_group(p))
    }

    /// A call slot for the call's principal, within its share; `BUSY` at once if its
    /// share is running and its queue full.
    async fn slot(&self, cx: &Cx<'_>) -> Result<slots::Slot, Stop> {
        let uid = cx.call.principal.as_ref().map_or(u32::MAX, |p| p.uid);
        self.slots
            .acquire(uid, cx.cancel)
            .await
            .map_err(|e| match e {
                slots::NoSlot::Busy(b) => CallError::Busy(b).into(),
                slots::NoSlot::Cancelled => Stop::CANCELLED,
            })
    }
}

/// Why a keyed call does not run.
enum Claimed {
    /// The key's recorded outcome, to return as it is.
    Replay(Reply),
    Stop(Stop),
}

/// A fault's outcome and reply.
fn fault(cx: &Cx<'_>, e: CallError, timed_out: bool) -> (Outcome, Reply) {
    let reply = e.reply(&cx.call.secrets);
    let outcome = Outcome::Fault {
        code: e.code().as_str(),
        message: error_message(&reply),
        timed_out,
        undecided: e.undecided(),
        exception_type: python::exception_type(&e).map(str::to_string),
    };
    (outcome, Reply::Result(reply))
}

/// The message of a fault reply (its `structuredContent.error.message`).
fn error_message(reply: &ToolReply) -> Option<String> {
    reply
        .structured
        .as_ref()
        .and_then(|s| s["error"]["message"].as_str())
        .map(str::to_string)
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
