//! Policy files: daemon settings, sandbox profiles and tool declarations, validated up front.
//!
//! `load` reads the whole directory and returns every problem with `file:line:col`; the rest
//! of the daemon only ever sees a validated [`Policy`].

pub mod command;
mod grant;
mod load;
mod model;
pub mod redact;

pub use command::{placeholders, Command, Piece, Template};
pub use grant::{Grant, Right, Subject};
pub use load::{
    check_dir, load, load_for, parse_duration, parse_size, DaemonIdentity, Diagnostic,
    DurationError, PolicyErrors, SizeError,
};
pub use model::*;

use std::collections::BTreeMap;

/// The built-in session tools, present in every policy.
pub fn builtins() -> BTreeMap<String, Tool> {
    let string = |description: &str, required: bool| Param {
        description: description.to_string(),
        required,
        ..Param::of(ParamType::String)
    };
    let object = |description: &str| Param {
        description: description.to_string(),
        ..Param::of(ParamType::Object)
    };
    let mk = |name: &str,
              title: &str,
              description: &str,
              builtin,
              capability,
              params: Vec<(&str, Param)>| {
        let read = capability == Capability::Read;
        Tool {
            name: name.to_string(),
            title: Some(title.to_string()),
            description: description.to_string(),
            capability,
            kind: ToolKind::Builtin(builtin),
            params: params
                .into_iter()
                .map(|(k, v)| (k.to_string(), v))
                .collect(),
            annotations: Annotations {
                read_only: read,
                destructive: builtin == Builtin::SessionDestroy,
                idempotent: read,
            },
            source: None,
        }
    };
    let tools = [
        mk(
            "session_create",
            "Create session",
            "Create a session: a JSON state object with a version that increments at each commit",
            Builtin::SessionCreate,
            Capability::Write,
            vec![
                (
                    "id",
                    string(
                        "Session id (letters, digits, '-', '_'); generated when absent",
                        false,
                    ),
                ),
                ("state", object("Initial state (a JSON object; default {})")),
            ],
        ),
        mk(
            "session_destroy",
            "Destroy session",
            "Destroy a session; calls queued behind it fail with SessionDestroyed",
            Builtin::SessionDestroy,
            Capability::Write,
            vec![],
        ),
        mk(
            "session_get",
            "Get session",
            "Read a session's state and version",
            Builtin::SessionGet,
            Capability::Read,
            vec![("session", string("Session id", true))],
        ),
        mk(
            "session_list",
            "List sessions",
            "List the sessions with their versions",
            Builtin::SessionList,
            Capability::Read,
            vec![],
        ),
        mk(
            "job_get",
            "Get job",
            "What became of a write call: its state (queued, running, publishing, committed, rolled_back, cancelled, failed), versions, outputs and error; by {job}, or by {session, idempotencyKey}",
            Builtin::JobGet,
            Capability::Read,
            vec![
                ("job", string("The job id (a write result's structuredContent.job)", false)),
                ("session", string("The session of a keyed call", false)),
                (
                    "idempotencyKey",
                    string("The idempotency key the call carried (with session)", false),
                ),
            ],
        ),
        mk(
            "job_undo",
            "Undo job",
            "Undo a committed write call: its outputs and the session state go back to what they were before it, as a new session version; only the session's latest commit, only while every target is still what it left, and only if its backups fit undo_bytes (else UNDO_CONFLICT or NOT_UNDOABLE, and nothing changes)",
            Builtin::JobUndo,
            Capability::Write,
            vec![("job", string("The job id of the call to undo (a write result's structuredContent.job)", true))],
        ),
    ];
    tools.into_iter().map(|t| (t.name.clone(), t)).collect()
}

impl Tool {
    /// Whether the call takes the implicit `session` argument (every write tool but
    /// `session_create`, which names its new session with `id`).
    pub fn takes_session(&self) -> bool {
        self.capability == Capability::Write
            && !matches!(self.kind, ToolKind::Builtin(Builtin::SessionCreate))
    }

    /// The JSON Schema of the tool's arguments, as `tools/list` shows it.
    pub fn input_schema(&self) -> serde_json::Map<String, serde_json::Value> {
        use serde_json::{json, Value};
        let mut props = serde_json::Map::new();
        let mut required: Vec<Value> = Vec::new();
        if self.takes_session() {
            props.insert(
                "session".into(),
                json!({"type": "string", "description": "The session this call mutates"}),
            );
            required.push("session".into());
        }
        for (name, p) in &self.params {
            let mut s = serde_json::Map::new();
            s.insert("type".into(), p.ty.as_str().into());
            let mut desc = p.description.clone();
            match p.path {
                Some(PathRole::Input) => desc.push_str(" (workspace path, read)"),
                Some(PathRole::Output) => desc.push_str(" (workspace path, written on success)"),
                Some(PathRole::InOut) => desc.push_str(
                    " (workspace path, edited in place: changed, kept or deleted on success)",
                ),
                None => {}
            }
            if !desc.is_empty() {
                s.insert("description".into(), desc.trim().into());
            }
            if let Some(d) = &p.default {
                s.insert("default".into(), d.clone());
            }
            props.insert(name.clone(), Value::Object(s));
            if p.required {
                required.push(name.clone().into());
            }
        }
        let mut schema = serde_json::Map::new();
        schema.insert("type".into(), "object".into());
        schema.insert("properties".into(), Value::Object(props));
        schema.insert("required".into(), Value::Array(required));
        schema.insert("additionalProperties".into(), false.into());
        schema
    }

    /// The JSON Schema of the `structuredContent` of the tool's successful results, where
    /// the daemon knows it: the built-ins' and every external write tool's (the daemon builds
    /// those results itself). External read tools return only content blocks: `None`.
    pub fn output_schema(&self) -> Option<serde_json::Map<String, serde_json::Value>> {
        use serde_json::json;
        let object = |props: serde_json::Value, required: &[&str]| json!({"type": "object", "properties": props, "required": required});
        let snapshot = object(
            json!({
                "id": {"type": "string", "description": "Session id"},
                "version": {"type": "integer", "minimum": 0, "description": "Incremented at each commit"},
                "state": {"type": "object", "description": "The session's JSON state"},
            }),
            &["id", "version", "state"],
        );
        let builtin = match &self.kind {
            ToolKind::Builtin(b) => Some(*b),
            ToolKind::External(_) => None,
        };
        let schema = match (builtin, self.capability) {
            (Some(Builtin::SessionCreate | Builtin::SessionGet), _) => snapshot,
            (Some(Builtin::SessionDestroy), _) => object(
                json!({"id": {"type": "string"}, "destroyed": {"type": "boolean", "const": true}}),
                &["id", "destroyed"],
            ),
            (Some(Builtin::SessionList), _) => object(
                json!({"sessions": {"type": "array", "items": object(
                    json!({"id": {"type": "string"}, "version": {"type": "integer", "minimum": 0}}),
                    &["id", "version"],
                )}}),
                &["sessions"],
            ),
            (Some(Builtin::JobGet), _) => object(
                json!({
                    "job": {"type": "string"},
                    "state": {"type": "string", "enum": ["queued", "running", "publishing", "committed", "rolled_back", "cancelled", "failed"]},
                    "tool": {"type": "string"},
                    "session": {"type": "string"},
                    "versionBefore": {"type": ["integer", "null"]},
                    "versionAfter": {"type": ["integer", "null"]},
                    "outputs": {"type": "array", "description": "Each published output as the audit's commit event has it (path, kind, size, dev, ino, sha256)"},
                    "created": {"type": "string"},
                    "ended": {"type": ["string", "null"]},
                    "error": {"description": "The error code and message of a failed call"},
                    "undoable": {"type": "boolean", "description": "Whether job_undo can undo it now: it is its session's latest commit and its undo data is kept"},
                    "undoReason": {"type": "string", "description": "Why it cannot be undone, when it cannot"},
                    "undoOf": {"type": "string", "description": "For an undo: the job it undid"},
                    "recovered": {"type": "boolean", "description": "Settled by startup recovery after a crash"},
                    "idempotencyKey": {"type": "string"},
                }),
                &[
                    "job", "state", "tool", "session", "outputs", "created", "undoable",
                ],
            ),
            (Some(Builtin::JobUndo), _) => object(
                json!({
                    "job": {"type": "string", "description": "The undo's own job id"},
                    "undoOf": {"type": "string", "description": "The job it undid"},
                    "session": {"type": "string"},
                    "version": {"type": "integer", "minimum": 0, "description": "The session's version after the undo (its state is the one before the undone job)"},
                    "outputs": {"type": "array", "description": "Each target and what it holds again"},
                    "undoable": {"type": "boolean", "const": false},
                    "undoReason": {"type": "string"},
                }),
                &["job", "undoOf", "session", "version", "outputs", "undoable"],
            ),
            (None, Capability::Write) => object(
                json!({
                    "job": {"type": "string", "description": "The call's job id (job_get tells what became of it)"},
                    "session": {"type": "string", "description": "The session the call committed to"},
                    "version": {"type": "integer", "minimum": 0, "description": "The session's version after the commit"},
                    "undoable": {"type": "boolean", "description": "Whether job_undo can undo this call (at its commit: job_get says whether it still can)"},
                    "undoReason": {"type": "string", "description": "Why it cannot be undone, when it cannot"},
                    "outputs": {
                        "type": "array",
                        "description": "Each output parameter and the workspace path it was published to",
                        "items": object(
                            json!({"param": {"type": "string"}, "path": {"type": "string"}}),
                            &["param", "path"],
                        ),
                    },
                }),
                &["job", "session", "version", "outputs"],
            ),
            (None, Capability::Read) => return None,
        };
        let mut schema = schema;
        // A python function's structured result sits beside the commit's fields.
        if matches!(&self.kind, ToolKind::External(e) if e.python.is_some()) {
            schema["properties"]["result"] = json!({
                "description": "What the tool's Python function returned, when that was neither a string nor a response"
            });
        }
        schema.as_object().cloned()
    }

    /// Parameters whose value is an output or in-out path, in name order.
    pub fn output_params(&self) -> impl Iterator<Item = &str> {
        self.params
            .iter()
            .filter(|(_, p)| p.path.is_some_and(PathRole::writes))
            .map(|(n, _)| n.as_str())
    }
}
