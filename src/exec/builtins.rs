//! The built-in session tools (`session_create`, `session_destroy`, `session_get`,
//! `session_list`): their arguments as types, and how each runs. They run in the daemon, with
//! no worker: their `start` is empty, and a mutating one's `commit` is durable before the
//! session store changes.

use serde_json::{json, Map, Value};

use super::lifecycle::{Run, Stop};
use super::{CallError, Cx, Executor, ToolReply};
use crate::audit::event::{Commit, Start};
use crate::policy::Builtin;
use crate::session::{valid_id, Snapshot};

/// One built-in call, its arguments read (they were validated against the tool's params).
#[derive(Debug, Clone, PartialEq)]
pub(super) enum BuiltinCall {
    /// A new session: the id asked for (else one is made up) and its first state.
    Create {
        id: Option<String>,
        state: Map<String, Value>,
    },
    Destroy {
        session: String,
    },
    Get {
        session: String,
    },
    /// The caller's sessions (every one, for `admin`).
    List,
    /// A job's record, by its id or by the session and idempotency key of its call.
    JobGet {
        job: Option<String>,
        session: Option<String>,
        key: Option<String>,
    },
    /// Undo the session's latest commit, `job`.
    Undo {
        session: String,
        job: String,
    },
}

impl BuiltinCall {
    pub(super) fn parse(b: Builtin, args: &Map<String, Value>) -> BuiltinCall {
        let session = || {
            args.get("session")
                .and_then(Value::as_str)
                .unwrap_or_default()
                .to_string()
        };
        match b {
            Builtin::SessionCreate => BuiltinCall::Create {
                id: args.get("id").and_then(Value::as_str).map(str::to_string),
                state: args
                    .get("state")
                    .and_then(Value::as_object)
                    .cloned()
                    .unwrap_or_default(),
            },
            Builtin::SessionDestroy => BuiltinCall::Destroy { session: session() },
            Builtin::SessionGet => BuiltinCall::Get { session: session() },
            Builtin::SessionList => BuiltinCall::List,
            Builtin::JobUndo => BuiltinCall::Undo {
                session: session(),
                job: args
                    .get("job")
                    .and_then(Value::as_str)
                    .unwrap_or_default()
                    .to_string(),
            },
            Builtin::JobGet => {
                let s = |k: &str| args.get(k).and_then(Value::as_str).map(str::to_string);
                BuiltinCall::JobGet {
                    job: s("job"),
                    session: s("session"),
                    key: s("idempotencyKey"),
                }
            }
        }
    }
}

/// A session as `session_create` and `session_get` return it.
fn view(s: &Snapshot) -> Value {
    json!({"id": s.id, "version": s.version, "state": s.state})
}

impl Executor {
    pub(super) async fn builtin(&self, cx: &Cx<'_>, b: BuiltinCall) -> Run<ToolReply> {
        match b {
            BuiltinCall::Create { id, state } => {
                let id = id.unwrap_or_else(|| format!("s-{}", self.new_call_id()));
                // Its state is copied and serialized in memory: a call slot bounds how many
                // creates do so at once.
                let _slot = match self.slot(cx).await {
                    Ok(s) => s,
                    Err(stop) => return Run::queued(stop),
                };
                self.record_start(cx, Start::default());
                let created = || -> Result<ToolReply, Stop> {
                    // The commit event is durable before the session exists; a create that
                    // fails anyway (the id is taken) is followed by its error and rollback.
                    let fresh = valid_id(&id) && !self.sessions.is_live(&id);
                    let commit = || Commit::Created {
                        version: 0,
                        created: true,
                        ran: cx.call.ran(),
                    };
                    if fresh {
                        // Past a bound: refused before its commit is recorded.
                        self.sessions.check_create(&id, &state, cx.caller.uid)?;
                        self.commit_event(cx, commit())?;
                    }
                    let snap = self.sessions.create(&id, state, cx.caller.uid)?;
                    if !fresh {
                        self.record(cx, crate::audit::Event::Commit(commit()));
                    }
                    Ok(ToolReply::ok(format!("created session {id}"), view(&snap)))
                };
                // Off the async threads: its commit event and its file are fsynced.
                Run::started(None, tokio::task::block_in_place(created))
            }
            BuiltinCall::Destroy { session: id } => {
                let queued = async {
                    let guard = self.lock_session(&id, cx.cancel).await?;
                    let caller = self.recheck(cx)?;
                    // Checked again under the lock: the id may have been created since step 1.
                    caller.check(&id, guard.meta().owner)?;
                    Ok::<_, Stop>(guard)
                };
                let guard = match queued.await {
                    Ok(g) => g,
                    Err(stop) => return Run::queued(stop),
                };
                self.record_start(cx, Start::default());
                let destroyed = || -> Result<ToolReply, Stop> {
                    let version = guard.meta().version;
                    self.commit_event(
                        cx,
                        Commit::Destroyed {
                            destroyed: true,
                            version,
                            ran: cx.call.ran(),
                        },
                    )?;
                    self.sessions.destroy(guard)?;
                    // Its undo data goes with it (a crash first leaves it for the next start,
                    // which removes every session's but the live ones' latest commits').
                    if let Err(e) =
                        crate::publish::undo::drop_generations(&self.workspace, &id, None)
                    {
                        tracing::warn!(session = %id, error = %crate::report::chain(&e), "cannot remove the destroyed session's undo data; the next start will");
                    }
                    Ok(ToolReply::ok(
                        format!("destroyed session {id}"),
                        json!({"id": id, "destroyed": true}),
                    ))
                };
                // Off the async threads: its commit event and its tombstone are fsynced,
                // its undo data removed.
                Run::started(None, tokio::task::block_in_place(destroyed))
            }
            BuiltinCall::Get { session: id } => {
                // The state is read from its file into memory: a call slot bounds how many
                // such reads run at once.
                let _slot = match self.slot(cx).await {
                    Ok(s) => s,
                    Err(stop) => return Run::queued(stop),
                };
                self.record_start(cx, Start::default());
                let got = || -> Result<ToolReply, Stop> {
                    let snap = self.sessions.snapshot(&id)?;
                    cx.caller.check(&id, snap.owner)?;
                    Ok(ToolReply::ok(
                        serde_json::to_string(&view(&snap)).unwrap_or_default(),
                        view(&snap),
                    ))
                };
                Run::started(None, got())
            }
            BuiltinCall::JobGet { job, session, key } => {
                // The record is read from its file: a call slot bounds how many at once.
                let _slot = match self.slot(cx).await {
                    Ok(s) => s,
                    Err(stop) => return Run::queued(stop),
                };
                self.record_start(cx, Start::default());
                let got = || -> Result<ToolReply, Stop> {
                    let caller = cx.caller;
                    // By key: the caller's own calls only (the session's ownership was
                    // checked at authorization, as for every call naming a session).
                    let id = match (job, session, key) {
                        (Some(j), None, None) => j,
                        (None, Some(s), Some(k)) => {
                            self.jobs.by_key(caller.uid, &s, &k).ok_or_else(|| {
                                CallError::NoSuchJob(format!(
                                    "no job with idempotency key {} in session {}",
                                    crate::text::shown(&k),
                                    crate::text::shown(&s)
                                ))
                            })?
                        }
                        _ => return Err(CallError::JobQuery.into()),
                    };
                    let missing =
                        || CallError::NoSuchJob(format!("job {}", crate::text::shown(&id)));
                    let rec = self.jobs.get(&id).ok_or_else(missing)?;
                    if !(caller.admin || rec.uid == caller.uid) {
                        return Err(CallError::JobForbidden { job: id }.into());
                    }
                    let v = rec.view(self.undo_now(&rec));
                    Ok(ToolReply::ok(v.to_string(), v))
                };
                Run::started(None, got())
            }
            BuiltinCall::Undo { session, job } => self.run_undo(cx, &session, &job).await,
            BuiltinCall::List => {
                // A principal sees its own sessions; `admin` sees every one.
                self.record_start(cx, Start::default());
                let caller = cx.caller;
                let list: Vec<Value> = self
                    .sessions
                    .list()
                    .iter()
                    .filter(|s| caller.admin || s.owner == Some(caller.uid))
                    .map(|s| json!({"id": s.id, "version": s.version, "owner": s.owner}))
                    .collect();
                let v = json!({"sessions": list});
                Run::started(None, Ok(ToolReply::ok(v.to_string(), v)))
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn builtin_arguments_become_their_call() {
        let args: Map<String, Value> =
            serde_json::from_value(json!({"id": "s1", "state": {"n": 1}})).unwrap();
        assert_eq!(
            BuiltinCall::parse(Builtin::SessionCreate, &args),
            BuiltinCall::Create {
                id: Some("s1".into()),
                state: serde_json::from_value(json!({"n": 1})).unwrap(),
            }
        );
        assert_eq!(
            BuiltinCall::parse(Builtin::SessionCreate, &Map::new()),
            BuiltinCall::Create {
                id: None,
                state: Map::new()
            }
        );
        let args: Map<String, Value> = serde_json::from_value(json!({"session": "s2"})).unwrap();
        assert_eq!(
            BuiltinCall::parse(Builtin::SessionDestroy, &args),
            BuiltinCall::Destroy {
                session: "s2".into()
            }
        );
        assert_eq!(
            BuiltinCall::parse(Builtin::SessionGet, &args),
            BuiltinCall::Get {
                session: "s2".into()
            }
        );
        assert_eq!(
            BuiltinCall::parse(Builtin::SessionList, &args),
            BuiltinCall::List
        );
    }
}
