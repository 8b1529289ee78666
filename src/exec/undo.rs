//! `job_undo`: a session's latest commit undone, as a job of its own. Refused, with nothing
//! changed, unless the job is its session's latest commit (`UNDO_CONFLICT` names the later
//! job), kept its undo data (`NOT_UNDOABLE`), and every target is still what it left
//! (`UNDO_CONFLICT` names the first that is not). Then the undo publishes the kept backups
//! and commits the state before the job, as the next version, through publication's journal,
//! rollback and recovery like any write.

use std::path::PathBuf;

use serde_json::json;

use super::lifecycle::{Run, Stop};
use super::run::{output, CommitFailed};
use super::{CallError, Cx, Executor, ToolReply};
use crate::audit::event::{Commit, Start};
use crate::jobs::{JobRecord, JobState};
use crate::publish::{self, undo::UndoRecord, Job};
use crate::session::SessionGuard;

impl Executor {
    pub(super) async fn run_undo(&self, cx: &Cx<'_>, session: &str, job: &str) -> Run<ToolReply> {
        let queued = async {
            let guard = self.lock_session(session, cx.cancel).await?;
            let caller = self.recheck(cx)?;
            // Checked again under the lock: the id may have been created since step 1.
            caller.check(session, guard.meta().owner)?;
            let rec = tokio::task::block_in_place(|| self.undo_record(&guard, session, job))?;
            let mut targets: Vec<PathBuf> = rec.targets.iter().map(|t| t.target.clone()).collect();
            targets.sort();
            let target_guards = tokio::select! {
                g = self.targets.lock_all(&targets) => g,
                _ = cx.cancel.cancelled() => return Err(Stop::CANCELLED),
            };
            let slot = self.slot(cx).await?;
            // Under every target's lock: nothing of the daemon's changes them now; checked
            // again by publication just before each rename.
            if let Some(c) =
                tokio::task::block_in_place(|| publish::undo::changed(&self.workspace, &rec))
            {
                return Err(CallError::UndoChanged {
                    job: job.to_string(),
                    target: c.target,
                    what: c.what,
                }
                .into());
            }
            Ok::<_, Stop>((guard, target_guards, slot, rec))
        };
        let (guard, _targets, _slot, rec) = match queued.await {
            Ok(q) => q,
            Err(stop) => return Run::queued(stop),
        };
        self.record_start(cx, Start::default());
        let done = tokio::task::block_in_place(|| self.publish_undo(cx, session, &guard, rec));
        Run::started(None, done)
    }

    /// The undo record of `job`, once it is shown to be `session`'s latest commit with its
    /// undo data complete (under the session's lock).
    fn undo_record(
        &self,
        guard: &SessionGuard,
        session: &str,
        job: &str,
    ) -> Result<UndoRecord, Stop> {
        let shown = crate::text::shown(job);
        // A job of another session reads as none: nothing is told of other sessions' jobs.
        let rec = self
            .jobs
            .get(job)
            .filter(|r| r.session == session)
            .ok_or_else(|| {
                CallError::NoSuchJob(format!(
                    "job {shown} in session {}",
                    crate::text::shown(session)
                ))
            })?;
        let not_undoable = |reason: String| CallError::NotUndoable {
            job: job.to_string(),
            reason,
        };
        if rec.state != JobState::Committed {
            return Err(
                not_undoable(format!("it did not commit (it is {})", rec.state.as_str())).into(),
            );
        }
        let (version, last) = self.sessions.latest_commit(session)?;
        let meta = guard.meta();
        if last.as_deref() != Some(job) || rec.version_after != Some(meta.version) {
            return Err(CallError::UndoLater {
                job: job.to_string(),
                session: session.to_string(),
                later: last.unwrap_or_else(|| "(none)".into()),
                version,
            }
            .into());
        }
        if let Some(why) = rec.undo_reason {
            return Err(not_undoable(why).into());
        }
        publish::undo::load(&self.workspace, session, job)
            .map_err(|e| not_undoable(crate::report::chain(&e).to_string()).into())
    }

    /// Past every check: the undo's job, published and committed (the state before the
    /// undone job, as the next version).
    fn publish_undo(
        &self,
        cx: &Cx<'_>,
        session: &str,
        guard: &SessionGuard,
        rec: UndoRecord,
    ) -> Result<ToolReply, Stop> {
        let call = cx.call;
        let reserved = self.sessions.reserve(guard, &rec.state_before)?;
        // The point of no return, as for a write: nothing between it and publication waits.
        if cx.cancel.is_cancelled() {
            return Err(Stop::CANCELLED);
        }
        let hash_limit = cx.policy.daemon.audit_hash_limit;
        let job = Job::undo(&self.workspace, &call.call, &cx.tool.name, &rec, hash_limit)
            .map_err(CallError::Job)?;
        self.jobs.set_state(&call.call, JobState::Publishing);
        let version = guard.meta().version + 1;
        let keyed = call.key.is_some();
        let undone = rec.job.clone();
        let mut reply = None;
        let mut record: Option<JobRecord> = None;
        let published = job.publish_and_commit_staged(
            |_, _| Ok(()),
            |published, status, ()| {
                let outputs: Vec<_> = published.iter().map(|o| output(o, hash_limit)).collect();
                let reason = match status {
                    publish::UndoStatus::NotKept(why) => why.to_string(),
                    publish::UndoStatus::Kept => String::new(),
                };
                self.record_commit(
                    cx,
                    Commit::Undone {
                        version,
                        undo_of: undone.clone(),
                        outputs: outputs.clone(),
                        ran: call.ran(),
                    },
                )
                .map_err(CommitFailed::Audit)?;
                let structured = json!({
                    "job": call.call,
                    "undoOf": undone,
                    "session": session,
                    "version": version,
                    "outputs": published.iter().map(|o| json!({
                        "path": o.target,
                        "deleted": o.edit == Some(publish::Edit::Deleted),
                    })).collect::<Vec<_>>(),
                    "undoable": false,
                    "undoReason": reason,
                });
                let r = ToolReply::ok(
                    format!("undid job {undone}: session {session} is at version {version}"),
                    structured,
                );
                let mut rec_j = self.job_record(cx, JobState::Committed);
                rec_j.outputs = outputs
                    .iter()
                    .map(|o| serde_json::to_value(o).unwrap_or_default())
                    .collect();
                rec_j.version_before = Some(version - 1);
                rec_j.version_after = Some(version);
                rec_j.ended_ms = Some(crate::audit::time::now_ms());
                rec_j.undo_of = Some(undone.clone());
                rec_j.undo_reason = Some(reason.clone());
                rec_j.reply = Some(crate::jobs::RecordedReply {
                    is_error: r.is_error,
                    content: r.content.clone(),
                    structured: r.structured.clone(),
                });
                self.jobs
                    .prepare_commit(&rec_j, keyed)
                    .map_err(CommitFailed::Job)?;
                record = Some(rec_j);
                reply = Some(r);
                self.sessions
                    .commit_reserved(guard, reserved, rec.state_before.clone(), &call.call)
                    .map_err(CommitFailed::Session)?;
                Ok::<(), CommitFailed>(())
            },
        );
        match published {
            Err(e) => return Err(undo_failed(&self.workspace, &undone, e)),
            // Its journal may still read as unsettled on disk: no later commit first.
            Ok(publish::Committed { settled: false, .. }) => self.sessions.block(guard),
            Ok(_) => {}
        }
        if let Some(r) = &record {
            // Under the session lock still: no later commit of the session comes first.
            if !self.jobs.committed(r, keyed) {
                self.sessions.block(guard);
            }
        }
        reply.ok_or_else(|| CallError::Internal("an undo committed without a reply".into()).into())
    }

    /// Whether a job can be undone now, or why not, as `job_get` reports it: the checks
    /// `job_undo` makes, without its locks.
    pub(super) fn undo_now(&self, rec: &JobRecord) -> Result<(), String> {
        let latest = rec.state == JobState::Committed
            && matches!(
                self.sessions.latest_commit(&rec.session),
                Ok((v, Some(last))) if last == rec.job && Some(v) == rec.version_after
            );
        let data = if latest && rec.undo_reason.is_none() {
            Some(publish::undo::load(&self.workspace, &rec.session, &rec.job))
        } else {
            None
        };
        crate::jobs::undoable(rec, latest, matches!(data, Some(Ok(_))))?;
        if let Some(Ok(u)) = data {
            if let Some(c) = publish::undo::changed(&self.workspace, &u) {
                return Err(format!(
                    "{} changed since it committed ({})",
                    crate::text::shown_path(&c.target),
                    c.what
                ));
            }
        }
        Ok(())
    }
}

/// The call's error for a failed undo: a target that changed under it is `UNDO_CONFLICT`;
/// anything else as for a write.
fn undo_failed(ws: &publish::Workspace, job: &str, e: publish::PublishError) -> Stop {
    if let publish::PublishError::Conflict { path, what } = e {
        let target = path
            .strip_prefix(ws.root())
            .map(|p| p.to_path_buf())
            .unwrap_or(path);
        return CallError::UndoChanged {
            job: job.to_string(),
            target,
            what,
        }
        .into();
    }
    super::run::commit_failed(e)
}
