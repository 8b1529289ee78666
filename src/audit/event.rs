//! The audit events as types: one variant per [`EventKind`], each carrying its own fields.
//! [`Audit::record`](super::Audit::record) takes an [`Event`]; its fields become the log
//! line's `detail` (an object whose keys serde_json keeps sorted, as they always were).
//!
//! A field that is `Option` and skipped when `None` is absent from the line, as it was when
//! the detail was built by hand; one that is `Option` and not skipped is `null`.

use serde::{Deserialize, Serialize};
use serde_json::Value;

use crate::policy::SeccompMode;
use crate::sandbox::LandlockStatus;

/// Every kind of audit event, in the order of the execution model. A mutating call is one
/// of: `allow, start, commit` (success); `allow, start, timeout, worker_terminated, rollback`;
/// `allow, start, cancel, worker_terminated, rollback` (cancelled in flight); `allow, start,
/// error, rollback` (worker or coordinator failure); `allow, cancel` with `phase: "queued"`
/// (cancelled before its worker started); `deny`. A read call is `allow, start, done|error`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum EventKind {
    /// The call is authorized; its job id is from now on its `job`.
    Allow,
    /// The call is refused before anything ran.
    Deny,
    /// Its locks are held and its work begins (the worker is spawned, or a built-in runs).
    Start,
    /// A mutating call's outputs and state are committed (durable before the commit point).
    Commit,
    /// The worker outlived the tool's timeout.
    Timeout,
    /// The call was cancelled: cause, request id, phase, and whether it came too late.
    Cancel,
    /// The worker's whole process group (or cgroup) is confirmed gone after a kill.
    WorkerTerminated,
    /// Nothing the call did stays: every target holds its old file, the state its version.
    Rollback,
    /// The call failed (its error code says why).
    Error,
    /// A read call returned its result.
    Done,
    /// A call with an idempotency key got the outcome recorded for the key (its original
    /// `job`); nothing ran.
    Replay,
}

impl EventKind {
    pub const ALL: [EventKind; 11] = [
        EventKind::Allow,
        EventKind::Deny,
        EventKind::Start,
        EventKind::Commit,
        EventKind::Timeout,
        EventKind::Cancel,
        EventKind::WorkerTerminated,
        EventKind::Rollback,
        EventKind::Error,
        EventKind::Done,
        EventKind::Replay,
    ];

    pub fn as_str(self) -> &'static str {
        match self {
            EventKind::Allow => "allow",
            EventKind::Deny => "deny",
            EventKind::Start => "start",
            EventKind::Commit => "commit",
            EventKind::Timeout => "timeout",
            EventKind::Cancel => "cancel",
            EventKind::WorkerTerminated => "worker_terminated",
            EventKind::Rollback => "rollback",
            EventKind::Error => "error",
            EventKind::Done => "done",
            EventKind::Replay => "replay",
        }
    }
}

impl std::fmt::Display for EventKind {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.as_str())
    }
}

/// One audit event: its kind (the tag) and its fields (the line's `detail`).
#[derive(Debug, Clone, PartialEq, Serialize)]
#[serde(tag = "kind", content = "detail", rename_all = "snake_case")]
pub enum Event {
    Allow(Allow),
    Deny(Deny),
    Start(Start),
    Commit(Commit),
    Timeout {
        after_ms: u64,
    },
    Cancel(Cancel),
    WorkerTerminated {
        pid: u32,
        /// How the kill was confirmed: "cgroup" or "process_group".
        confirmed_by: String,
    },
    Rollback(Rollback),
    Error(Failure),
    Done(Done),
    Replay {
        /// The job whose recorded outcome was returned.
        job: String,
    },
}

impl Event {
    pub fn kind(&self) -> EventKind {
        match self {
            Event::Allow(_) => EventKind::Allow,
            Event::Deny(_) => EventKind::Deny,
            Event::Start(_) => EventKind::Start,
            Event::Commit(_) => EventKind::Commit,
            Event::Timeout { .. } => EventKind::Timeout,
            Event::Cancel(_) => EventKind::Cancel,
            Event::WorkerTerminated { .. } => EventKind::WorkerTerminated,
            Event::Rollback(_) => EventKind::Rollback,
            Event::Error(_) => EventKind::Error,
            Event::Done(_) => EventKind::Done,
            Event::Replay { .. } => EventKind::Replay,
        }
    }

    /// The error code of a `deny` (what the denial bound counts by); empty for others.
    pub fn deny_code(&self) -> &str {
        match self {
            Event::Deny(Deny::Call { code, .. } | Deny::Resource { code, .. }) => code,
            _ => "",
        }
    }

    /// The line's `detail`: the event's fields as a JSON object.
    pub fn detail(&self) -> Value {
        match serde_json::to_value(self) {
            Ok(Value::Object(mut m)) => m.remove("detail").unwrap_or(Value::Null),
            // Every field is a string, a number or an object with string keys.
            Ok(_) | Err(_) => Value::Null,
        }
    }
}

/// The phase a call was in when it ended or was cancelled.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
#[serde(rename_all = "snake_case")]
pub enum Phase {
    /// Waiting for its locks and slot; nothing was created for it.
    Queued,
    /// Its work began (`start` was recorded).
    Running,
    /// Its worker ended, publication had not begun.
    BeforePublish,
    /// Its commit was recorded.
    Committed,
}

/// Why a call was cancelled.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
#[serde(rename_all = "snake_case")]
pub enum Cause {
    /// The client's `notifications/cancelled`.
    Client,
    /// The daemon's shutdown.
    Shutdown,
    /// The client's connection ended.
    Disconnect,
}

/// `allow`: the call is authorized.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct Allow {
    pub capability: &'static str,
    /// The arguments as shown (long values by their size, secrets redacted).
    pub arguments: Value,
    /// An external tool's timeout.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub timeout_ms: Option<u64>,
    /// The call's idempotency key (`_meta["airlock/idempotencyKey"]`), if it carried one.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub idempotency_key: Option<String>,
}

/// `deny`: a refusal, before anything ran.
#[derive(Debug, Clone, PartialEq, Serialize)]
#[serde(untagged)]
pub enum Deny {
    /// A call refused at its authorization (`phase` absent) or where it would have started
    /// (`phase: "queued"`): its code and the message the client got.
    Call {
        code: String,
        message: Option<String>,
        #[serde(skip_serializing_if = "Option::is_none")]
        phase: Option<Phase>,
    },
    /// A read of (or subscription to) a resource refused.
    Resource {
        code: String,
        uri: String,
        #[serde(skip_serializing_if = "Option::is_none")]
        message: Option<String>,
    },
    /// The denials of one uid over its bound, counted.
    Aggregated { aggregated: super::deny::Aggregate },
}

/// `start`: the call's work begins. A built-in's is empty; a worker's says how it is
/// confined.
#[derive(Debug, Clone, Default, PartialEq, Serialize)]
pub struct Start {
    #[serde(skip_serializing_if = "Option::is_none")]
    pub pid: Option<u32>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub timeout_ms: Option<u64>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub seccomp: Option<SeccompMode>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub landlock: Option<LandlockStatus>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub landlock_abi: Option<u8>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub containment: Option<String>,
}

/// How a worker ended on its own.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
#[serde(rename_all = "snake_case")]
pub enum Exit {
    Status(i32),
    Signal(i32),
}

/// What every terminal event of a call reports about its run: how long the call took,
/// when its worker's group was gone, and how the worker ended.
#[derive(Debug, Clone, Default, PartialEq, Serialize)]
pub struct Ran {
    pub duration_ms: u64,
    /// When the worker's group was gone, in ms since the call began: `duration_ms` minus
    /// this is what came after it (publication, for a commit).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub worker_ms: Option<u64>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub exit: Option<Exit>,
}

/// One published output: its path, size and SHA-256, or, above the hash limit, its size and
/// identity only (and a note saying so).
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct Output {
    pub path: std::path::PathBuf,
    /// `"directory"` for a directory output (absent for a file).
    #[serde(skip_serializing_if = "crate::policy::OutputKind::is_file")]
    pub kind: crate::policy::OutputKind,
    /// A file's size; a directory's total bytes of regular files.
    pub size: u64,
    /// A directory's number of regular files.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub files: Option<u64>,
    pub dev: u64,
    pub ino: u64,
    /// A file's SHA-256; a directory's: the SHA-256 of its canonical manifest (README,
    /// "Directory outputs").
    pub sha256: Option<String>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub not_hashed: Option<String>,
    /// An in-out target: whether publication changed it (a new file at the target) ...
    #[serde(skip_serializing_if = "Option::is_none")]
    pub changed: Option<bool>,
    /// ... or deleted it.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub deleted: Option<bool>,
}

/// What startup recovery did with one job.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct Recovery {
    /// Always `true`: the event is recovery's.
    pub recovery: bool,
    /// The job's journaled phase (`null`: no journal).
    pub phase: Option<String>,
    pub action: String,
    #[serde(flatten, skip_serializing_if = "Option::is_none")]
    pub kept: Option<Kept>,
}

/// A job dir recovery kept aside as it is.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct Kept {
    /// `RECOVERY_KEPT`.
    pub code: &'static str,
    pub quarantined: String,
    pub reason: String,
}

/// `commit`: a mutating call's outputs and state are committed.
#[derive(Debug, Clone, PartialEq, Serialize)]
#[serde(untagged)]
pub enum Commit {
    /// A write tool's: the new version and what each target received.
    Published {
        version: u64,
        outputs: Vec<Output>,
        #[serde(flatten)]
        ran: Ran,
    },
    /// `session_create`'s (version 0).
    Created {
        version: u64,
        created: bool,
        #[serde(flatten)]
        ran: Ran,
    },
    /// `session_destroy`'s: the version destroyed.
    Destroyed {
        destroyed: bool,
        version: u64,
        #[serde(flatten)]
        ran: Ran,
    },
    /// `job_undo`'s: the new version (its state the one before `undo_of`), the job it undid,
    /// and what each target holds again (`deleted` for one the undone job created).
    Undone {
        version: u64,
        undo_of: String,
        outputs: Vec<Output>,
        #[serde(flatten)]
        ran: Ran,
    },
    /// Recovery completed a job.
    Recovered(Recovery),
}

/// `cancel`: the cause (with the request's id when the client asked), the phase, and
/// whether it came too late to stop the call.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct Cancel {
    pub cause: Cause,
    /// Present for a client's cancel (`null` if its request had no id).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub request_id: Option<Value>,
    pub phase: Phase,
    #[serde(skip_serializing_if = "std::ops::Not::not")]
    pub too_late: bool,
}

/// `rollback`: nothing the call did stays.
#[derive(Debug, Clone, PartialEq, Serialize)]
#[serde(untagged)]
pub enum Rollback {
    /// A call that failed: its error code.
    Failed {
        #[serde(flatten)]
        ran: Ran,
        code: String,
    },
    /// A call that was cancelled (`reason: "cancelled"`).
    Cancelled {
        #[serde(flatten)]
        ran: Ran,
        reason: &'static str,
    },
    /// Recovery rolled a job back.
    Recovered(Recovery),
}

/// `error`: the call failed.
#[derive(Debug, Clone, PartialEq, Serialize)]
#[serde(untagged)]
pub enum Failure {
    Call {
        #[serde(flatten)]
        ran: Ran,
        code: String,
        message: Option<String>,
        phase: Phase,
        #[serde(skip_serializing_if = "std::ops::Not::not")]
        cancel_too_late: bool,
        /// A `python` tool's exception class (`ValueError`, `mypkg.BadInput`), when its
        /// function or the import of its module raised.
        #[serde(skip_serializing_if = "Option::is_none")]
        exception_type: Option<String>,
    },
    /// Recovery kept a job dir aside: the call neither committed nor rolled back.
    Recovered(Recovery),
}

/// `done`: a read call returned its result.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct Done {
    #[serde(flatten)]
    pub ran: Ran,
    #[serde(skip_serializing_if = "std::ops::Not::not")]
    pub cancel_too_late: bool,
}

#[cfg(test)]
pub(crate) mod tests {
    use super::*;
    use serde_json::json;

    /// One event of each variant (and sub-variant), with `text` in a string field; no two
    /// `deny` next to each other (one written, the next aggregated, each writes a line).
    pub(crate) fn samples(text: &str) -> Vec<Event> {
        let ran = Ran {
            duration_ms: 5,
            worker_ms: Some(4),
            exit: Some(Exit::Status(0)),
        };
        let recovery = Recovery {
            recovery: true,
            phase: None,
            action: text.into(),
            kept: None,
        };
        vec![
            Event::Allow(Allow {
                capability: "read",
                arguments: json!({"text": text}),
                timeout_ms: Some(1000),
                idempotency_key: None,
            }),
            Event::Deny(Deny::Call {
                code: "TOOL_FORBIDDEN".into(),
                message: Some(text.into()),
                phase: None,
            }),
            Event::Start(Start::default()),
            Event::Commit(Commit::Published {
                version: 1,
                outputs: vec![],
                ran: ran.clone(),
            }),
            Event::Commit(Commit::Recovered(recovery.clone())),
            Event::Commit(Commit::Undone {
                version: 2,
                undo_of: text.into(),
                outputs: vec![],
                ran: ran.clone(),
            }),
            Event::Timeout { after_ms: 10 },
            Event::Deny(Deny::Resource {
                code: "AUDIT_FORBIDDEN".into(),
                uri: text.into(),
                message: None,
            }),
            Event::Cancel(Cancel {
                cause: Cause::Client,
                request_id: Some(json!(text)),
                phase: Phase::Running,
                too_late: false,
            }),
            Event::WorkerTerminated {
                pid: 1,
                confirmed_by: text.into(),
            },
            Event::Rollback(Rollback::Cancelled {
                ran: ran.clone(),
                reason: "cancelled",
            }),
            Event::Error(Failure::Call {
                ran: ran.clone(),
                code: "TOOL_FAILED".into(),
                message: Some(text.into()),
                phase: Phase::Running,
                cancel_too_late: false,
                exception_type: Some(text.into()),
            }),
            Event::Done(Done {
                ran,
                cancel_too_late: false,
            }),
            Event::Replay { job: text.into() },
        ]
    }

    /// README's lifecycle table names every event kind and no other, and every variant's
    /// tag is its kind's name.
    #[test]
    fn readme_lifecycle_table_matches_the_enum() {
        let readme = std::fs::read_to_string(concat!(env!("CARGO_MANIFEST_DIR"), "/README.md"))
            .expect("README.md");
        let start = readme
            .find("| call | events |")
            .expect("README has a `| call | events |` table");
        let mut named = std::collections::BTreeSet::new();
        for line in readme[start..].lines().skip(2) {
            if !line.starts_with('|') {
                break;
            }
            let events = line.split('|').nth(2).unwrap_or("");
            // The backticked single words are kinds (`phase: "queued"` is a field).
            for (i, part) in events.split('`').enumerate() {
                if i % 2 == 1 && part.chars().all(|c| c.is_ascii_lowercase() || c == '_') {
                    named.insert(part.to_string());
                }
            }
        }
        let all: std::collections::BTreeSet<String> = EventKind::ALL
            .iter()
            .map(|k| k.as_str().to_string())
            .collect();
        assert_eq!(named, all, "README's lifecycle table and EventKind differ");
        let variants: std::collections::BTreeSet<String> = samples("x")
            .iter()
            .map(|e| {
                let tag = serde_json::to_value(e).unwrap()["kind"].clone();
                assert_eq!(tag, e.kind().as_str(), "{e:?}");
                tag.as_str().unwrap().to_string()
            })
            .collect();
        assert_eq!(named, variants, "README's lifecycle table and Event differ");
    }

    #[test]
    fn every_event_kind_has_one_name() {
        for k in EventKind::ALL {
            assert_eq!(serde_json::to_value(k).unwrap(), k.as_str());
            let back: EventKind = serde_json::from_value(Value::from(k.as_str())).unwrap();
            assert_eq!(back, k);
        }
    }

    /// The details are the objects the log has always held: optional fields absent when
    /// unset, `null` where a value is unknown.
    #[test]
    fn details_have_the_logged_shapes() {
        let ran = Ran {
            duration_ms: 7,
            worker_ms: None,
            exit: None,
        };
        assert_eq!(Event::Start(Start::default()).detail(), json!({}));
        assert_eq!(
            Event::Start(Start {
                pid: Some(9),
                timeout_ms: Some(100),
                seccomp: Some(SeccompMode::Deny),
                ..Start::default()
            })
            .detail(),
            json!({"pid": 9, "timeout_ms": 100, "seccomp": "deny"})
        );
        assert_eq!(
            Event::Commit(Commit::Published {
                version: 2,
                outputs: vec![Output {
                    path: "a".into(),
                    kind: crate::policy::OutputKind::File,
                    files: None,
                    size: 1,
                    dev: 2,
                    ino: 3,
                    sha256: None,
                    not_hashed: Some("big".into()),
                    changed: None,
                    deleted: None,
                }],
                ran: Ran {
                    duration_ms: 9,
                    worker_ms: Some(8),
                    exit: Some(Exit::Signal(9)),
                },
            })
            .detail(),
            json!({"version": 2, "duration_ms": 9, "worker_ms": 8, "exit": {"signal": 9},
                   "outputs": [{"path": "a", "size": 1, "dev": 2, "ino": 3, "sha256": null,
                                "not_hashed": "big"}]})
        );
        assert_eq!(
            Event::Cancel(Cancel {
                cause: Cause::Shutdown,
                request_id: None,
                phase: Phase::Queued,
                too_late: false,
            })
            .detail(),
            json!({"cause": "shutdown", "phase": "queued"})
        );
        assert_eq!(
            Event::Cancel(Cancel {
                cause: Cause::Client,
                request_id: Some(Value::Null),
                phase: Phase::Committed,
                too_late: true,
            })
            .detail(),
            json!({"cause": "client", "request_id": null, "phase": "committed", "too_late": true})
        );
        assert_eq!(
            Event::Error(Failure::Call {
                ran: ran.clone(),
                code: "TIMEOUT".into(),
                message: None,
                phase: Phase::Queued,
                cancel_too_late: true,
                exception_type: None,
            })
            .detail(),
            json!({"duration_ms": 7, "code": "TIMEOUT", "message": null, "phase": "queued",
                   "cancel_too_late": true})
        );
        assert_eq!(
            Event::Rollback(Rollback::Cancelled {
                ran,
                reason: "cancelled"
            })
            .detail(),
            json!({"duration_ms": 7, "reason": "cancelled"})
        );
        assert_eq!(
            Event::Deny(Deny::Call {
                code: "X".into(),
                message: None,
                phase: Some(Phase::Queued),
            })
            .detail(),
            json!({"code": "X", "message": null, "phase": "queued"})
        );
        assert_eq!(
            Event::Commit(Commit::Recovered(Recovery {
                recovery: true,
                phase: Some("publishing_outputs".into()),
                action: "a".into(),
                kept: Some(Kept {
                    code: "RECOVERY_KEPT",
                    quarantined: "q".into(),
                    reason: "r".into(),
                }),
            }))
            .detail(),
            json!({"recovery": true, "phase": "publishing_outputs", "action": "a",
                   "code": "RECOVERY_KEPT", "quarantined": "q", "reason": "r"})
        );
        assert_eq!(
            Event::Allow(Allow {
                capability: "write",
                arguments: json!({}),
                timeout_ms: None,
                idempotency_key: None,
            })
            .detail(),
            json!({"capability": "write", "arguments": {}})
        );
    }
}
