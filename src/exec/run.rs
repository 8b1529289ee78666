//! The external tools' runs: a read tool's (resolve, bound, slot, spawn, wait, reply) and a
//! write tool's (resolve, lock, clone the state, stage, spawn, wait, publish, commit). Each
//! step returns what it learned; the runner returns how far the call got ([`Run`]).

use std::path::PathBuf;

use serde_json::{json, Map, Value};

use super::lifecycle::{Run, Stop, WorkerEnd};
use super::protocol::{self, Response};
use super::{args, progress, slots, worker_paths, CallError, Cx, Executor, ToolReply};
use crate::audit::event::{Commit, Event, Exit, Output, Phase, Ran, Start};
use crate::policy::{ExternalTool, PathRole, Tool};
use crate::publish::{self, Job, JobSpec};
use crate::sandbox::{End, Launch, Lease, Outcome, Worker};
use crate::session::{SessionGuard, Snapshot};

/// Where a worker runs and what it is handed, beyond its tool's profile.
struct Sandboxed {
    cwd: PathBuf,
    writable: Vec<PathBuf>,
    readable: Vec<PathBuf>,
    stdin: Vec<u8>,
    identity: Option<Lease>,
}

/// A worker that ended on its own.
struct Waited {
    outcome: Outcome,
    exit: Exit,
    end: WorkerEnd,
}

/// A write call past its queue: what it holds while its worker runs and it publishes.
struct Queued {
    guard: SessionGuard,
    _targets: Vec<super::locks::TargetGuard>,
    _slot: slots::Slot,
    /// The state cloned under the lock.
    before: Snapshot,
    /// Output parameter name and target, in the job's order.
    outputs: Vec<(String, PathBuf)>,
    job: Job,
    bound: args::Bound,
    identity: Option<Lease>,
}

impl Executor {
    pub(super) async fn run_read(
        &self,
        cx: &Cx<'_>,
        ext: &ExternalTool,
        values: Map<String, Value>,
    ) -> Run<ToolReply> {
        let queued = async {
            let paths = self.resolve_paths(cx.tool, &values)?;
            let root = self.workspace.root().to_path_buf();
            // Read tools have no outputs (the policy loader refuses them), so nothing is
            // staged.
            let mut bound = args::bind(&values, &paths, &root, None, |_| root.clone());
            worker_paths::hand_to_worker(&self.reach, &mut bound, &root, path_names(&paths));
            bound.env = args::bind_env(cx.tool, &values)?;
            protocol::check_bounds(
                cx.policy.daemon.max_message_bytes,
                cx.tool,
                ext,
                &bound,
                None,
            )?;
            let slot = self.slot(cx).await?;
            self.recheck(cx)?;
            let sandboxed = Sandboxed {
                stdin: protocol::stdin(ext, &cx.tool.name, &bound, None),
                cwd: root,
                writable: Vec::new(),
                readable: std::mem::take(&mut bound.readable),
                identity: self.lease()?,
            };
            let worker = self.spawn(cx, ext, &bound, sandboxed, None).await?;
            Ok::<_, Stop>((slot, worker))
        };
        let (_slot, worker) = match queued.await {
            Ok(w) => w,
            Err(stop) => return Run::queued(stop),
        };
        // A read worker owns nothing the call keeps: its lease goes with the call's end.
        let waited = match self.wait(cx, worker, ext.timeout, &mut None).await {
            Ok(w) => w,
            Err((end, stop)) => return Run::started(end, Err(stop)),
        };
        let reply = protocol::interpret(cx.tool, waited.exit, &waited.outcome, &cx.call.secrets)
            .map(|r| r.reply)
            .map_err(Stop::from);
        Run::started(Some(waited.end), reply)
    }

    pub(super) async fn run_write(
        &self,
        cx: &Cx<'_>,
        ext: &ExternalTool,
        session: &str,
        values: Map<String, Value>,
    ) -> Run<ToolReply> {
        let mut q = match self.queue_write(cx, ext, session, &values).await {
            Ok(q) => q,
            Err(stop) => return Run::queued(stop),
        };
        let stage = q.job.stage_dir();
        let sandboxed = Sandboxed {
            stdin: protocol::stdin(ext, &cx.tool.name, &q.bound, Some(&q.before)),
            cwd: stage.clone(),
            writable: vec![stage],
            readable: std::mem::take(&mut q.bound.readable),
            identity: q.identity.take(),
        };
        // 5-6. Spawn the sandboxed worker and wait, bounded. Whatever stops the call here,
        // nothing was published: the job dir is discarded.
        let worker = match self
            .spawn(cx, ext, &q.bound, sandboxed, Some(&mut q.job))
            .await
        {
            Ok(w) => w,
            Err(stop) => {
                discard(q.job).await;
                return Run::queued(stop);
            }
        };
        // The worker's uid lease is held until its staging dirs are gone or given back to
        // the daemon (discarded, or set aside after publication): a later worker leasing the
        // same uid could otherwise open them up (chmod passes Landlock) to someone else
        // before this call's outputs are taken back.
        let mut lease = None;
        let waited = match self.wait(cx, worker, ext.timeout, &mut lease).await {
            Ok(w) => w,
            Err((end, stop)) => {
                // Not set aside for reuse: a worker that timed out, was cancelled, or whose
                // end could not be confirmed, may have left a process behind for a while.
                discard_unpooled(q.job).await;
                drop(lease);
                return Run::started(end, Err(stop));
            }
        };
        let end = waited.end;
        let reply = self.publish_write(cx, ext, session, q, waited).await;
        drop(lease);
        Run::started(Some(end), reply)
    }

    /// A write call up to its worker's spawn: everything that can be rejected without
    /// touching anything, its locks and slot, the state cloned, its job dir created.
    async fn queue_write(
        &self,
        cx: &Cx<'_>,
        ext: &ExternalTool,
        session: &str,
        values: &Map<String, Value>,
    ) -> Result<Queued, Stop> {
        let (tool, call) = (cx.tool, cx.call);
        // Everything that can be rejected without touching anything is rejected first.
        let paths = self.resolve_paths(tool, values)?;
        let outputs: Vec<(String, PathBuf)> = paths
            .iter()
            .filter(|(_, role, _)| role.writes())
            .map(|(n, _, p)| (n.clone(), p.clone()))
            .collect();
        args::check_overlap(&outputs).map_err(CallError::Overlap)?;

        // 2. Lock: the session, then the output targets (and their ancestors, shared) in one
        // sorted order.
        let guard = self.lock_session(session, cx.cancel).await?;
        // Checked again under the lock: the id may have been created since step 1.
        cx.caller.check(session, guard.meta().owner)?;
        let mut targets: Vec<PathBuf> = outputs.iter().map(|(_, p)| p.clone()).collect();
        targets.sort();
        let target_guards = tokio::select! {
            g = self.targets.lock_all(&targets) => g,
            _ = cx.cancel.cancelled() => return Err(Stop::CANCELLED),
        };
        let slot = self.slot(cx).await?;
        // The call starts here: its tool and grant are checked again against the policy
        // current now, and the session's owner against the caller that policy sees.
        let caller = self.recheck(cx)?;
        caller.check(session, guard.meta().owner)?;

        // 3. Clone the state: read from its file, under the lock.
        let before = self.sessions.load_locked(&guard)?;

        // What the worker would be handed is bounded before the job dir exists.
        let env = args::bind_env(tool, values)?;
        let mut predicted = args::bind(values, &paths, self.workspace.root(), Some(session), |i| {
            let target = outputs.get(i).map_or(std::path::Path::new(""), |(_, t)| t);
            args::predicted_staged_path(self.workspace.root(), &call.call, i, target)
        });
        let predicted_stage = args::predicted_stage_dir(self.workspace.root(), &call.call);
        worker_paths::hand_to_worker(
            &self.reach,
            &mut predicted,
            &predicted_stage,
            path_names(&paths),
        );
        predicted.env = env.clone();
        protocol::check_bounds(
            cx.policy.daemon.max_message_bytes,
            tool,
            ext,
            &predicted,
            Some(&before),
        )?;

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
            kinds: outputs
                .iter()
                .map(|(n, _)| tool.params.get(n).map(|p| p.kind).unwrap_or_default())
                .collect(),
            stage_owner: identity.as_ref().map(|l| (l.uid(), l.gid())),
            staging_limits: Some((
                ext.profile.limits.staging_files,
                ext.profile.limits.staging_bytes,
            )),
            hash_limit: Some(cx.policy.daemon.audit_hash_limit),
            inout: outputs
                .iter()
                .map(|(n, _)| tool.params.get(n).and_then(|p| p.path) == Some(PathRole::InOut))
                .collect(),
        };
        // Off the async threads: an in-out target is copied into staging here.
        let mut job = tokio::task::block_in_place(|| Job::create(&self.workspace, spec))
            .map_err(CallError::Job)?;
        job.hash_up_to(cx.policy.daemon.audit_hash_limit);
        let root = self.workspace.root().to_path_buf();
        let mut bound = args::bind(values, &paths, &root, Some(session), |i| job.staged_path(i));
        worker_paths::hand_to_worker(
            &self.reach,
            &mut bound,
            &job.stage_dir(),
            path_names(&paths),
        );
        bound.env = env;
        Ok(Queued {
            guard,
            _targets: target_guards,
            _slot: slot,
            before,
            outputs,
            job,
            bound,
            identity,
        })
    }

    /// A write call after its worker ended on its own: its reply, staging and state checked,
    /// then (past the point of no return) its outputs published and its state committed.
    async fn publish_write(
        &self,
        cx: &Cx<'_>,
        ext: &ExternalTool,
        session: &str,
        q: Queued,
        waited: Waited,
    ) -> Result<ToolReply, Stop> {
        let (tool, call) = (cx.tool, cx.call);
        // Its locks and slot are held until the call returns.
        let Queued {
            guard,
            _targets,
            _slot,
            before,
            outputs,
            mut job,
            ..
        } = q;
        let checked = protocol::interpret(tool, waited.exit, &waited.outcome, &call.secrets)
            .map_err(Stop::from)
            .and_then(|r| self.check_staging(ext, &job).map(|()| r));
        let Response {
            mut reply,
            state: new_state,
        } = match checked {
            Ok(r) => r,
            Err(stop) => {
                discard(job).await;
                return Err(stop);
            }
        };
        // The new state within the session's and its owner's bounds, its room taken before
        // anything is published (QUOTA_EXCEEDED otherwise: nothing published or committed).
        let state = new_state.unwrap_or_else(|| before.state.clone());
        let reserved = match self.sessions.reserve(&guard, &state) {
            Ok(r) => r,
            Err(e) => {
                discard(job).await;
                return Err(e.into());
            }
        };

        // The point of no return: publication starts. A cancel that came before it rolls
        // the call back (nothing published, no response); one that comes after it is too
        // late: the call completes and its result is sent (`cancel_too_late` in the audit).
        // Nothing between this check and the publication awaits.
        if cx.cancel.is_cancelled() {
            discard(job).await;
            return Err(Stop::CANCELLED);
        }
        if let Some(p) = cx.progress {
            p.phase(progress::Phase::Publishing);
        }
        self.jobs
            .set_state(&call.call, crate::jobs::JobState::Publishing);
        // The result as the call returns it if it commits: it is recorded with the job just
        // before the commit point. A tool that printed nothing gives no empty text block:
        // the result's content is the structured result's text alone.
        reply
            .content
            .retain(|b| !(b["type"] == "text" && b["text"] == ""));
        let result = super::python::structured_result(&reply);
        let version = before.version + 1;
        let keyed = call.key.is_some();

        // 7. Publish the outputs, then commit the state: the commit point. The `commit`
        // event is durable in the audit log before it; if it cannot be, the call rolls back.
        let hash_limit = cx.policy.daemon.audit_hash_limit;
        // Off the async threads: publication fsyncs, and its cleanup removes whatever the
        // worker left in staging.
        // Its backups are kept for `job_undo` if they fit `undo_bytes`.
        job.keep_undo(publish::UndoKeep {
            limit: cx.policy.daemon.undo_bytes,
            version_before: before.version,
            state_before: before.state.clone(),
        });
        // The reply and the job's record as the call returns them if it commits, for an undo
        // status (whether `job_undo` can undo it, as of its commit).
        let (content, is_error) = (reply.content.clone(), reply.is_error);
        let build = |published: &[publish::Published],
                     undo: &publish::UndoStatus,
                     commit_outputs: &[Output]| {
            let mut rec = self.job_record(cx, crate::jobs::JobState::Committed);
            rec.outputs = commit_outputs
                .iter()
                .map(|o| serde_json::to_value(o).unwrap_or_default())
                .collect();
            let mut structured = json!({
                "job": call.call,
                "session": session,
                "version": version,
                "outputs": outputs.iter().zip(published).map(|((n, p), o)| structured_output(n, p, o)).collect::<Vec<_>>(),
            });
            structured["undoable"] = undo.kept().into();
            if let publish::UndoStatus::NotKept(why) = undo {
                structured["undoReason"] = why.to_string().into();
                rec.undo_reason = Some(why.to_string());
            }
            // A python function's structured result stays beside the commit's fields.
            if let Some(result) = &result {
                structured["result"] = result.clone();
            }
            rec.version_before = Some(before.version);
            rec.version_after = Some(version);
            rec.ended_ms = Some(crate::audit::time::now_ms());
            rec.reply = Some(crate::jobs::RecordedReply {
                is_error,
                content: content.clone(),
                structured: Some(structured.clone()),
            });
            (structured, rec)
        };
        let mut record = None;
        let published = tokio::task::block_in_place(|| {
            job.publish_and_commit_staged(
                // Beside the fsyncs of the renames and of the undo record, every other record
                // due before the commit point, each written here and made durable together:
                // the new session file under its temp name, the job's record (with the key
                // and the result: durable for a keyed call, so that a crash cannot keep one
                // without the other), and the `commit` event.
                |published, undo| {
                    let commit_outputs: Vec<Output> =
                        published.iter().map(|o| output(o, hash_limit)).collect();
                    let commit = Commit::Published {
                        version,
                        outputs: commit_outputs.clone(),
                        ran: Ran {
                            duration_ms: call.elapsed_ms(),
                            worker_ms: Some(waited.end.worker_ms),
                            exit: waited.end.exit,
                        },
                    };
                    let (structured, rec) = build(published, undo, &commit_outputs);
                    let staged = self
                        .sessions
                        .stage_commit(&guard, state, &call.call)
                        .map_err(CommitFailed::Session)?;
                    let pending = self
                        .jobs
                        .write_pending(&rec, keyed)
                        .map_err(CommitFailed::Job)?;
                    let (synced, (recorded_job, recorded)) = staged.sync_beside(|| {
                        self.jobs
                            .sync_beside(&pending, || self.record_commit(cx, commit))
                    });
                    recorded.map_err(CommitFailed::Audit)?;
                    recorded_job.map_err(CommitFailed::Job)?;
                    synced.map_err(CommitFailed::Session)?;
                    Ok::<_, CommitFailed>((commit_outputs, staged, undo.clone(), structured, rec))
                },
                |published, undo, (commit_outputs, staged, tentative, structured, rec)| {
                    // The undo record's fsync failed: the job's record says so, durably (for
                    // a keyed call), before the commit point.
                    let (structured, rec) = if *undo == tentative {
                        (structured, rec)
                    } else {
                        let (structured, rec) = build(published, undo, &commit_outputs);
                        self.jobs
                            .prepare_commit(&rec, keyed)
                            .map_err(CommitFailed::Job)?;
                        (structured, rec)
                    };
                    reply.structured = Some(structured);
                    record = Some(rec);
                    self.sessions
                        .commit_staged(&guard, reserved, staged)
                        .map_err(CommitFailed::Session)?;
                    Ok::<(), CommitFailed>(())
                },
            )
        });
        let undo = match published {
            Ok(publish::Committed { undo, settled }) => {
                if !settled {
                    // Its journal may still read as unsettled on disk: a later commit of the
                    // session first would make recovery roll it back.
                    self.sessions.block(&guard);
                }
                undo
            }
            Err(e) => return Err(publish_failed(tool, &outputs, e)),
        };
        // Its backups could not be kept after the commit point: it is not undoable after all.
        if let (publish::UndoStatus::NotKept(why), Some(s)) = (&undo, reply.structured.as_mut()) {
            if s["undoable"] == true {
                s["undoable"] = false.into();
                s["undoReason"] = why.to_string().into();
            }
        }
        if let Some(rec) = record {
            // Under the session lock still: no later commit of the session comes first.
            if !tokio::task::block_in_place(|| self.jobs.committed(&rec, keyed)) {
                self.sessions.block(&guard);
            }
        }
        Ok(reply)
    }

    /// Spawns the worker and records its `start`: from here the call runs.
    async fn spawn(
        &self,
        cx: &Cx<'_>,
        ext: &ExternalTool,
        bound: &args::Bound,
        s: Sandboxed,
        job: Option<&mut Job>,
    ) -> Result<Worker, Stop> {
        let mut argv = args::substitute(&ext.command, &bound.subst);
        let mut readable = s.readable;
        // A python tool's module directories: on the runner's command line, and readable
        // (never writable) by the worker.
        if let Some(p) = &ext.python {
            argv.extend(super::python::sys_path(&self.reach, p, &s.cwd));
            readable.extend(p.path.iter().cloned());
        }
        let launch = Launch {
            argv,
            env: bound.env.clone(),
            cwd: s.cwd,
            stdin: s.stdin,
            writable: s.writable,
            readable,
            profile: ext.profile.clone(),
            cgroup_parent: cx.policy.daemon.cgroup.clone(),
            job_id: cx.call.call.clone(),
            identity: s.identity,
            registry: Some(self.registry.clone()),
            progress: cx.progress.map(progress::Progress::worker),
        };
        let seccomp = launch.profile.seccomp.mode;
        let worker = Worker::spawn(&self.sandbox, launch, &self.filters)
            .await
            .map_err(CallError::from)?;
        if let Some(p) = cx.progress {
            p.phase(progress::Phase::Running);
        }
        if let Some(job) = job {
            if let Err(e) = job.record_worker(worker.pid()) {
                tracing::warn!(call = %cx.call.call, "cannot journal the worker pid: {}", crate::report::chain(&e));
            }
        }
        let enforcement = worker.enforcement();
        self.record_start(
            cx,
            Start {
                pid: Some(worker.pid()),
                timeout_ms: Some(ext.timeout.as_millis() as u64),
                seccomp: Some(seccomp),
                landlock: enforcement.map(|e| e.landlock),
                landlock_abi: enforcement.map(|e| e.landlock_abi),
                containment: enforcement.map(|e| e.containment.clone()),
            },
        );
        Ok(worker)
    }

    /// Waits for the worker, bounded by `timeout` and the call's cancellation. A worker
    /// killed at either is recorded here (`timeout` or `cancel`, then `worker_terminated`);
    /// the error carries what is known of its end.
    async fn wait(
        &self,
        cx: &Cx<'_>,
        worker: Worker,
        timeout: std::time::Duration,
        lease: &mut Option<crate::sandbox::Lease>,
    ) -> Result<Waited, (Option<WorkerEnd>, Stop)> {
        let mut outcome = worker
            .finish(timeout, cx.cancel.clone())
            .await
            .map_err(|e| (None, CallError::from(e).into()))?;
        // The worker's uid lease, for the caller to release when it is done with what the
        // worker owned.
        *lease = outcome.lease.take();
        // When the worker's group was gone, in ms since the call began.
        let worker_ms = cx.call.elapsed_ms();
        let killed = WorkerEnd {
            worker_ms,
            exit: None,
        };
        // The kill is confirmed when `finish` returns: every process of the group (or the
        // cgroup) is gone.
        let terminated = Event::WorkerTerminated {
            pid: outcome.pid,
            confirmed_by: outcome.enforcement.containment.clone(),
        };
        let exit = match outcome.end {
            End::TimedOut => {
                self.record(
                    cx,
                    Event::Timeout {
                        after_ms: timeout.as_millis() as u64,
                    },
                );
                self.record(cx, terminated);
                let e = CallError::Timeout {
                    tool: cx.call.tool.clone(),
                    after: timeout,
                };
                return Err((Some(killed), Stop::TimedOut(e)));
            }
            End::Cancelled => {
                self.record(cx, self.canceller(cx.call).event(Phase::Running, false));
                self.record(cx, terminated);
                return Err((Some(killed), Stop::Cancelled { recorded: true }));
            }
            End::Exited(status) => Exit::Status(status),
            End::Signaled(signal) => Exit::Signal(signal),
        };
        Ok(Waited {
            outcome,
            exit,
            end: WorkerEnd {
                worker_ms,
                exit: Some(exit),
            },
        })
    }

    /// Resolves every path parameter beneath the workspace.
    fn resolve_paths(
        &self,
        tool: &Tool,
        values: &Map<String, Value>,
    ) -> Result<Vec<(String, PathRole, PathBuf)>, Stop> {
        // Off the async threads when it may list a directory: an input directory is listed
        // and checked against the mount table. Otherwise (each path argument an input naming
        // no directory, as a read tool's file arguments do) a few syscalls on (dirfd, name)
        // pairs, beneath the workspace and on its filesystem, cheaper on the call's own
        // thread than handing that thread's runtime core to another.
        if self.may_list_a_directory(tool, values) {
            tokio::task::block_in_place(|| self.resolve_paths_blocking(tool, values))
        } else {
            self.resolve_paths_blocking(tool, values)
        }
    }

    /// Whether resolving `values` may list a directory (or do more than look up a path):
    /// a path argument that is not an input, or an input that names a directory or could
    /// not be looked at. A look only: it chooses the thread, the resolution decides (an input
    /// made a directory in between is listed all the same, on the call's thread).
    fn may_list_a_directory(&self, tool: &Tool, values: &Map<String, Value>) -> bool {
        use rustix::fs::{Mode, OFlags, ResolveFlags};
        let Some(dir) = &self.workspace_dir else {
            return true;
        };
        tool.params.iter().any(|(name, p)| {
            let (Some(role), Some(raw)) = (p.path, values.get(name).and_then(Value::as_str)) else {
                return false;
            };
            if role != PathRole::Input {
                return true;
            }
            // Beneath the workspace, on its filesystem, no symlink: the look cannot wait on
            // another mount. An absolute or escaping path is refused by the resolution.
            let looked = rustix::fs::openat2(
                dir,
                raw,
                OFlags::PATH | OFlags::NOFOLLOW | OFlags::CLOEXEC,
                Mode::empty(),
                ResolveFlags::BENEATH
                    | ResolveFlags::NO_SYMLINKS
                    | ResolveFlags::NO_XDEV
                    | ResolveFlags::NO_MAGICLINKS,
            )
            .and_then(|fd| rustix::fs::fstat(&fd));
            match looked {
                Ok(st) => rustix::fs::FileType::from_raw_mode(st.st_mode).is_dir(),
                // Nothing to list: the resolution refuses it.
                Err(rustix::io::Errno::NOENT | rustix::io::Errno::NOTDIR) => false,
                Err(_) => true,
            }
        })
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
            let rel = self
                .workspace
                .resolve_as(raw, role, p.kind)
                .map_err(rejected)?;
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

    /// A uid of the worker's own, when workers get one.
    fn lease(&self) -> Result<Option<Lease>, Stop> {
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
}

/// Why the commit step inside publication failed: the call does not commit, and
/// publication rolls back.
#[derive(Debug, thiserror::Error)]
pub(super) enum CommitFailed {
    /// The `commit` event could not be made durable.
    #[error("the commit event could not be recorded in the audit log")]
    Audit(crate::audit::AuditError),
    /// The session store's write of the new state failed.
    #[error(transparent)]
    Session(crate::session::SessionError),
    /// The job's record could not be written before the commit point.
    #[error("cannot record the job before its commit")]
    Job(#[source] crate::jobs::JobError),
}

impl publish::CommitError for CommitFailed {
    /// Only the session store can leave its commit point undecided (its exchange made, its
    /// fsync and its undoing failed).
    fn undecided(&self) -> bool {
        matches!(
            self,
            CommitFailed::Session(crate::session::SessionError::Undecided { .. })
        )
    }
}

/// The call's error for a failed publication.
fn publish_failed(tool: &Tool, outputs: &[(String, PathBuf)], e: publish::PublishError) -> Stop {
    // What the worker left is at fault, not publication: nothing was published.
    if let publish::PublishError::BadOutput { index, reason, .. } = &e {
        let param = outputs.get(*index).map_or("?", |(n, _)| n.as_str());
        return CallError::ToolFailed(super::protocol::ToolFailure::BadOutput {
            tool: tool.name.clone(),
            param: param.to_string(),
            kind: tool.params.get(param).map(|p| p.kind).unwrap_or_default(),
            fault: reason.clone(),
        })
        .into();
    }
    // Someone else changed an in-out target: every target was restored.
    if let publish::PublishError::Conflict { .. } = &e {
        return CallError::Conflict(e).into();
    }
    commit_failed(e)
}

/// The call's error for a publication that failed otherwise (at its commit, or renaming).
pub(super) fn commit_failed(e: publish::PublishError) -> Stop {
    // The commit event could not be recorded and every target was restored: AUDIT_FAILED.
    let e = match e {
        publish::PublishError::Commit(source) => match source.downcast::<CommitFailed>() {
            Ok(failed) => match *failed {
                CommitFailed::Audit(a) => return CallError::AuditFailed(a).into(),
                other => publish::PublishError::Commit(Box::new(other)),
            },
            Err(source) => publish::PublishError::Commit(source),
        },
        e => e,
    };
    if let publish::PublishError::CommitUndecided(_) = e {
        return CallError::Undecided(e).into();
    }
    let restored = !matches!(e, publish::PublishError::RollbackFailed { .. });
    CallError::Publish {
        source: e,
        restored,
    }
    .into()
}

/// One output in the result's `structuredContent`: its parameter and path; for a directory
/// also its kind, files, total bytes and manifest SHA-256, as the `commit` event has them.
fn structured_output(param: &str, path: &std::path::Path, o: &publish::Published) -> Value {
    let mut out = match o.kind {
        publish::OutputKind::File => json!({"param": param, "path": path}),
        kind => json!({
            "param": param,
            "path": path,
            "kind": kind.as_str(),
            "files": o.files,
            "bytes": o.size,
            "manifest_sha256": o.sha256,
        }),
    };
    if let Some(e) = o.edit {
        out["changed"] = (e == publish::Edit::Changed).into();
        out["deleted"] = (e == publish::Edit::Deleted).into();
    }
    out
}

/// One published output in the `commit` event: its path, size and SHA-256, or, above the
/// hash limit, its size and identity only (and a note saying so).
pub(super) fn output(o: &publish::Published, hash_limit: u64) -> Output {
    Output {
        path: o.target.clone(),
        kind: o.kind,
        files: o.files,
        size: o.size,
        dev: o.id.dev,
        ino: o.id.ino,
        sha256: o.sha256.clone(),
        not_hashed: (o.sha256.is_none() && o.edit != Some(publish::Edit::Deleted)).then(|| {
            format!("larger than audit_hash_limit ({hash_limit} bytes): size and identity only")
        }),
        changed: o.edit.map(|e| e == publish::Edit::Changed),
        deleted: o.edit.map(|e| e == publish::Edit::Deleted),
    }
}

/// Removes the job dir of a call that publishes nothing, off the async threads (a worker
/// may have left any number of files).
/// The names of a call's path arguments.
fn path_names(paths: &[(String, PathRole, PathBuf)]) -> impl Iterator<Item = &str> {
    paths.iter().map(|(n, _, _)| n.as_str())
}

async fn discard(job: Job) {
    remove_job_dir(job, Job::discard).await
}

/// [`discard`], never setting the dir aside for reuse ([`Job::discard_unpooled`]).
async fn discard_unpooled(job: Job) {
    remove_job_dir(job, Job::discard_unpooled).await
}

async fn remove_job_dir(job: Job, remove: fn(Job) -> Result<(), publish::PublishError>) {
    let dir = job.dir().to_path_buf();
    let done = tokio::task::spawn_blocking(move || remove(job)).await;
    match done {
        Ok(Ok(())) => {}
        Ok(Err(e)) => tracing::error!(
            "cannot remove job dir {}: {}; startup recovery will (or quarantine it)",
            dir.display(),
            crate::report::chain(&e)
        ),
        Err(e) => tracing::error!(
            "removing job dir {} failed: {}",
            dir.display(),
            crate::report::chain(&e)
        ),
    }
}
