//! Everything that ends a call without a result, as one typed enum with its causes kept
//! ([`CallError`]), and the stable wire codes a client matches on ([`ErrorCode`]). A
//! `CallError` becomes a code and a message only where the reply is built
//! ([`CallError::reply`]); README's table of codes is checked against [`ErrorCode::ALL`].

use serde_json::{json, Value};

use super::args::ArgError;
use super::ToolReply;
use crate::policy::redact::Secrets;
use crate::publish::{PathError, PublishError};
use crate::sandbox::SandboxError;
use crate::session::SessionError;

/// The stable code of a tool fault: the text of a fault starts with it and
/// `structuredContent.error.code` carries it; audit events carry it too.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum ErrorCode {
    InvalidArgument,
    PathRejected,
    OverlappingOutputs,
    Conflict,
    NoSuchSession,
    SessionDestroyed,
    SessionExists,
    SessionForbidden,
    ToolForbidden,
    ToolFailed,
    ToolTimeout,
    SandboxError,
    PublishFailed,
    StateError,
    CommitUndecided,
    AuditFailed,
    QuotaExceeded,
    Busy,
    IdempotencyMismatch,
    NoSuchJob,
    UndoConflict,
    NotUndoable,
    Internal,
}

impl ErrorCode {
    /// Every code, in README's order.
    pub const ALL: [ErrorCode; 23] = [
        ErrorCode::InvalidArgument,
        ErrorCode::PathRejected,
        ErrorCode::OverlappingOutputs,
        ErrorCode::Conflict,
        ErrorCode::NoSuchSession,
        ErrorCode::SessionDestroyed,
        ErrorCode::SessionExists,
        ErrorCode::SessionForbidden,
        ErrorCode::ToolForbidden,
        ErrorCode::ToolFailed,
        ErrorCode::ToolTimeout,
        ErrorCode::SandboxError,
        ErrorCode::PublishFailed,
        ErrorCode::StateError,
        ErrorCode::CommitUndecided,
        ErrorCode::AuditFailed,
        ErrorCode::QuotaExceeded,
        ErrorCode::Busy,
        ErrorCode::IdempotencyMismatch,
        ErrorCode::NoSuchJob,
        ErrorCode::UndoConflict,
        ErrorCode::NotUndoable,
        ErrorCode::Internal,
    ];

    pub fn as_str(self) -> &'static str {
        match self {
            ErrorCode::InvalidArgument => "INVALID_ARGUMENT",
            ErrorCode::PathRejected => "PATH_REJECTED",
            ErrorCode::OverlappingOutputs => "OVERLAPPING_OUTPUTS",
            ErrorCode::Conflict => "CONFLICT",
            ErrorCode::NoSuchSession => "NO_SUCH_SESSION",
            ErrorCode::SessionDestroyed => "SESSION_DESTROYED",
            ErrorCode::SessionExists => "SESSION_EXISTS",
            ErrorCode::SessionForbidden => "SESSION_FORBIDDEN",
            ErrorCode::ToolForbidden => "TOOL_FORBIDDEN",
            ErrorCode::ToolFailed => "TOOL_FAILED",
            ErrorCode::ToolTimeout => "TOOL_TIMEOUT",
            ErrorCode::SandboxError => "SANDBOX_ERROR",
            ErrorCode::PublishFailed => "PUBLISH_FAILED",
            ErrorCode::StateError => "STATE_ERROR",
            ErrorCode::CommitUndecided => "COMMIT_UNDECIDED",
            ErrorCode::AuditFailed => "AUDIT_FAILED",
            ErrorCode::QuotaExceeded => "QUOTA_EXCEEDED",
            ErrorCode::Busy => "BUSY",
            ErrorCode::IdempotencyMismatch => "IDEMPOTENCY_MISMATCH",
            ErrorCode::NoSuchJob => "NO_SUCH_JOB",
            ErrorCode::UndoConflict => "UNDO_CONFLICT",
            ErrorCode::NotUndoable => "NOT_UNDOABLE",
            ErrorCode::Internal => "INTERNAL",
        }
    }
}

impl std::fmt::Display for ErrorCode {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.as_str())
    }
}

/// Why a call ended without a result.
#[derive(Debug, thiserror::Error)]
pub enum CallError {
    #[error(transparent)]
    Argument(#[from] ArgError),
    #[error("argument {name:?}")]
    Path {
        name: String,
        #[source]
        source: PathError,
    },
    #[error(transparent)]
    Overlap(super::args::OverlapError),
    #[error(transparent)]
    Session(#[from] SessionError),
    /// A session another principal owns (or owned, if destroyed).
    #[error("session {session:?} belongs to another principal; only its owner or a principal with the admin capability may use it")]
    SessionForbidden { session: String },
    /// No grant of the principal's lets it call the tool.
    #[error("uid {uid} may not call {tool} (it needs the {right:?} capability for this tool in a [[grant]] of airlock.toml)")]
    ToolForbidden {
        tool: String,
        uid: u32,
        right: &'static str,
    },
    /// A SIGHUP reload removed or changed the tool while the call waited for its turn (its
    /// session lock, its targets, a slot): it was checked against a definition the daemon no
    /// longer serves, so nothing ran.
    #[error("{tool} was {change} by a policy reload while the call waited for its turn; nothing ran (tools/list names the tools served now)")]
    ToolWithdrawn { tool: String, change: &'static str },
    #[error(transparent)]
    Sandbox(#[from] SandboxError),
    /// No worker uid could be leased.
    #[error(transparent)]
    Identity(#[from] crate::sandbox::IdentityError),
    #[error("{tool} did not finish within {after:?}; its process group was killed and nothing was published")]
    Timeout {
        tool: String,
        after: std::time::Duration,
    },
    /// The tool ran and failed (exit status, signal, invalid response, over a limit).
    #[error(transparent)]
    ToolFailed(super::protocol::ToolFailure),
    /// A `json` tool answered `isError: true`; its content is passed on.
    #[error("{tool} reported an error; nothing was published")]
    ToolReported { tool: String, content: Vec<Value> },
    /// The job dir could not be created: nothing was touched.
    #[error("cannot create the job dir")]
    Job(#[source] PublishError),
    /// The worker left more in staging than its profile allows, or staging could not be
    /// measured.
    #[error(transparent)]
    Staging(PublishError),
    /// Publication or the commit failed; `restored` says whether every target is back.
    #[error("publishing the outputs failed ({})", if *.restored { "every target was restored and the state is unchanged" } else { "the targets are restored by recovery at the next start" })]
    Publish {
        #[source]
        source: PublishError,
        restored: bool,
    },
    /// An in-out target was changed by someone else while the tool edited its copy: nothing
    /// was published (every target restored) and the state is unchanged.
    #[error("{0}; the state is unchanged")]
    Conflict(PublishError),
    /// The commit point may or may not be durable (a disk error, and undoing it failed too):
    /// nothing was rolled back, the session is blocked, and recovery at the next start
    /// completes or rolls back the call by what is on disk.
    #[error("the commit may or may not be durable after a disk error; the session is blocked until the daemon restarts, and recovery then completes or rolls back this call by what is on disk")]
    Undecided(#[source] PublishError),
    /// The `commit` event could not be made durable in the audit log: the call rolled back.
    #[error("the commit could not be recorded durably in the audit log; nothing was committed")]
    AuditFailed(#[source] crate::audit::AuditError),
    /// The principal's share of call slots is running and its queue full.
    #[error(transparent)]
    Busy(#[from] super::slots::Busy),
    /// The call's idempotency key is not one.
    #[error("bad idempotency key")]
    IdempotencyKey(#[source] crate::jobs::KeyError),
    /// An idempotency key on a tool that does not take one.
    #[error("{tool} takes no idempotency key (_meta[\"airlock/idempotencyKey\"]): keys apply to write tools; a read is safe to retry as it is")]
    KeyNotApplicable { tool: String },
    /// The key is held or recorded for a call with other arguments (or another tool).
    #[error("idempotency key {key:?} was used in this session for job {job} with other arguments or another tool; nothing ran (use a new key for a new call)")]
    IdempotencyMismatch { key: String, job: String },
    /// `job_get`'s arguments name no job.
    #[error("job_get takes {{\"job\"}} or {{\"session\", \"idempotencyKey\"}}")]
    JobQuery,
    /// No record of the job (never made, or past `idempotency_ttl` or `idempotency_keys`).
    #[error(
        "{0}: no record (never made, or dropped after idempotency_ttl or past idempotency_keys)"
    )]
    NoSuchJob(String),
    /// A job of another principal's.
    #[error("job {job:?} belongs to another principal; only its caller or a principal with the admin capability may read it")]
    JobForbidden { job: String },
    /// The job to undo is not its session's latest commit: `later` committed since.
    #[error("job {job} is not the latest commit of session {session}: job {later} (version {version}) committed since; only the latest commit can be undone; nothing was changed")]
    UndoLater {
        job: String,
        session: String,
        later: String,
        version: u64,
    },
    /// A target of the job to undo is no longer what the job left.
    #[error(
        "cannot undo job {job}: {} changed since it committed ({what}); nothing was changed",
        crate::text::shown_path(target)
    )]
    UndoChanged {
        job: String,
        target: std::path::PathBuf,
        what: crate::publish::Conflict,
    },
    /// The job cannot be undone at all (it did not commit, kept no undo data, ...).
    #[error("job {job} cannot be undone: {reason}")]
    NotUndoable { job: String, reason: String },
    #[error("{0}")]
    Internal(String),
}

impl CallError {
    /// Whether the call's change may or may not be durable (a disk error, and undoing it
    /// failed too): nothing was rolled back, and the next start decides by what is on disk,
    /// so the call's end records no `rollback`.
    pub fn undecided(&self) -> bool {
        matches!(
            self,
            CallError::Undecided(_) | CallError::Session(SessionError::Undecided { .. })
        )
    }

    pub fn code(&self) -> ErrorCode {
        match self {
            CallError::Argument(_) => ErrorCode::InvalidArgument,
            CallError::Path { .. } => ErrorCode::PathRejected,
            CallError::Overlap(_) => ErrorCode::OverlappingOutputs,
            CallError::Session(e) => match e {
                SessionError::NotFound(_) => ErrorCode::NoSuchSession,
                SessionError::Destroyed(_) => ErrorCode::SessionDestroyed,
                SessionError::Exists(_) => ErrorCode::SessionExists,
                SessionError::BadId(_) => ErrorCode::InvalidArgument,
                SessionError::Io { .. }
                | SessionError::Corrupt { .. }
                | SessionError::Undecided { .. }
                | SessionError::Blocked(_) => ErrorCode::StateError,
                SessionError::Quota(_) => ErrorCode::QuotaExceeded,
            },
            CallError::SessionForbidden { .. } => ErrorCode::SessionForbidden,
            CallError::ToolForbidden { .. } | CallError::ToolWithdrawn { .. } => {
                ErrorCode::ToolForbidden
            }
            CallError::Sandbox(_) | CallError::Identity(_) => ErrorCode::SandboxError,
            CallError::Timeout { .. } => ErrorCode::ToolTimeout,
            CallError::ToolFailed(_) | CallError::ToolReported { .. } => ErrorCode::ToolFailed,
            CallError::Staging(PublishError::StagingLimit { .. }) => ErrorCode::ToolFailed,
            CallError::Job(PublishError::InOutCopy { .. }) => ErrorCode::PathRejected,
            CallError::Job(_) | CallError::Staging(_) | CallError::Publish { .. } => {
                ErrorCode::PublishFailed
            }
            CallError::Conflict(_) => ErrorCode::Conflict,
            CallError::Undecided(_) => ErrorCode::CommitUndecided,
            CallError::AuditFailed(_) => ErrorCode::AuditFailed,
            CallError::Busy(_) => ErrorCode::Busy,
            CallError::IdempotencyKey(_)
            | CallError::KeyNotApplicable { .. }
            | CallError::JobQuery => ErrorCode::InvalidArgument,
            CallError::IdempotencyMismatch { .. } => ErrorCode::IdempotencyMismatch,
            CallError::NoSuchJob(_) => ErrorCode::NoSuchJob,
            CallError::JobForbidden { .. } => ErrorCode::SessionForbidden,
            CallError::UndoLater { .. } | CallError::UndoChanged { .. } => ErrorCode::UndoConflict,
            CallError::NotUndoable { .. } => ErrorCode::NotUndoable,
            CallError::Internal(_) => ErrorCode::Internal,
        }
    }

    /// The fault reply: the code, then the message with each of its causes once
    /// ([`crate::report::chain`]), every secret of the call scrubbed.
    pub fn reply(&self, secrets: &Secrets) -> ToolReply {
        let code = self.code().as_str();
        let message = secrets.scrub_str(&crate::report::chain(self).to_string());
        let mut reply = ToolReply {
            is_error: true,
            content: vec![json!({"type": "text", "text": format!("{code}: {message}")})],
            structured: Some(json!({"error": {"code": code, "message": message}})),
        };
        if let CallError::ToolReported { content, .. } = self {
            let mut extra = Value::Array(content.clone());
            secrets.scrub(&mut extra);
            if let Value::Array(a) = extra {
                reply.content.extend(a);
            }
        }
        reply
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A write's undecided commit and an undecided session create or destroy record no
    /// rollback; a session change that was put back does.
    #[test]
    fn only_a_change_that_may_be_durable_is_undecided() {
        let io = || std::io::Error::from_raw_os_error(libc::EIO);
        for what in ["commit", "creation", "destruction"] {
            let e = CallError::Session(SessionError::Undecided {
                id: "s".into(),
                what,
                source: io(),
            });
            assert!(e.undecided(), "{what}");
            assert_eq!(e.code(), ErrorCode::StateError);
        }
        let put_back = CallError::Session(SessionError::Io {
            op: "fsync",
            path: "sessions/s.json".into(),
            source: io(),
        });
        assert!(!put_back.undecided());
        assert!(!CallError::Session(SessionError::Blocked("s".into())).undecided());
    }

    /// README's table of tool fault codes names every code and no other.
    #[test]
    fn readme_table_matches_the_enum() {
        let readme = std::fs::read_to_string(concat!(env!("CARGO_MANIFEST_DIR"), "/README.md"))
            .expect("README.md");
        let start = readme
            .find("| code | meaning |")
            .expect("README has a `| code | meaning |` table");
        let mut in_table = Vec::new();
        for line in readme[start..].lines().skip(2) {
            if !line.starts_with('|') {
                break;
            }
            let first = line.split('|').nth(1).unwrap_or("");
            for part in first.split(',') {
                let code = part.trim().trim_matches('`').to_string();
                assert!(!code.is_empty(), "an empty code cell in {line:?}");
                in_table.push(code);
            }
        }
        let all: Vec<String> = ErrorCode::ALL
            .iter()
            .map(|c| c.as_str().to_string())
            .collect();
        for c in &all {
            assert!(in_table.contains(c), "README's code table lacks {c}");
        }
        for c in &in_table {
            assert!(
                all.contains(c),
                "README's code table names {c}, which ErrorCode lacks"
            );
        }
        assert_eq!(
            in_table.len(),
            all.len(),
            "a code is listed twice: {in_table:?}"
        );
    }

    #[test]
    fn codes_are_distinct_screaming_snake() {
        let mut seen = std::collections::HashSet::new();
        for c in ErrorCode::ALL {
            let s = c.as_str();
            assert!(seen.insert(s), "{s} twice");
            assert!(
                s.chars().all(|ch| ch.is_ascii_uppercase() || ch == '_'),
                "{s}"
            );
        }
    }

    #[test]
    fn causes_are_kept_and_reach_the_message() {
        let io = std::io::Error::from_raw_os_error(libc::ENOSPC);
        let e = CallError::Publish {
            source: PublishError::Commit(Box::new(SessionError::Io {
                op: "write",
                path: "/state/sessions/s.json".into(),
                source: io,
            })),
            restored: true,
        };
        assert_eq!(e.code(), ErrorCode::PublishFailed);
        // The chain is walkable down to the errno.
        let mut depth = 0;
        let mut c: Option<&dyn std::error::Error> = Some(&e);
        while let Some(x) = c {
            depth += 1;
            c = x.source();
        }
        assert!(depth >= 3, "causes dropped: {depth}");
        let r = e.reply(&Secrets::default());
        let text = r.content[0]["text"].as_str().unwrap();
        assert!(text.starts_with("PUBLISH_FAILED: "), "{text}");
        assert!(text.contains("s.json"), "{text}");
        assert!(text.contains("every target was restored"), "{text}");
    }
}
