//! `protocol = "python"` tools: the command that runs airlock's runner (`python_runner.py`,
//! embedded), the `sys.path` entries a worker is handed, and the runner's reply turned into
//! the call's response. The request on stdin is the `json` protocol's.

use std::path::{Path, PathBuf};

use serde_json::{json, Value};

use super::protocol::{Response, ToolFailure};
use super::{response, worker_paths, CallError, ToolReply};
use crate::policy::redact::Secrets;
use crate::policy::{Command, PythonEntry};
use crate::startup::WorkerReach;

/// The runner's source, run with `-c`: nothing to read from disk but the tool's module.
pub const RUNNER: &str = include_str!("python_runner.py");

/// The longest exception message a `TOOL_FAILED` message quotes.
const MESSAGE_SHOWN: usize = 2000;

/// The runner's command line up to its `sys.path` entries: `PYTHON -I -B -c RUNNER ENTRY`.
/// `-I` keeps the environment, the user's site-packages and the working directory (the
/// staging dir) off `sys.path`; `-B` writes no bytecode (the module's directory is
/// read-only to the worker anyway).
pub fn python_command(p: &PythonEntry) -> Command {
    Command::literal([
        p.interpreter.display().to_string(),
        "-I".to_string(),
        "-B".to_string(),
        "-c".to_string(),
        RUNNER.to_string(),
        p.entry.clone(),
    ])
}

/// The `sys.path` entries the runner is handed (after `ENTRY` on its command line): each
/// `python_path` directory absolute, or, when workers reach the workspace from their
/// working directory `cwd` and the directory lies beneath the same unsearchable ancestor,
/// relative to `cwd` (as [`worker_paths`] hands path arguments).
pub fn sys_path(reach: &WorkerReach, p: &PythonEntry, cwd: &Path) -> Vec<String> {
    p.path
        .iter()
        .map(|dir| match reach {
            WorkerReach::FromWorkingDir { unsearchable, .. } if dir.starts_with(unsearchable) => {
                worker_paths::relative_to(cwd, dir)
            }
            _ => dir.clone(),
        })
        .map(|d: PathBuf| d.display().to_string())
        .collect()
}

/// Turns the runner's stdout (one JSON object, see `python_runner.py`) into the call's
/// response. A `response` is checked as a `json` tool's whole response is; a `result`
/// becomes the structured result (`{"result": value}`); a `raised` exception or a `fault`
/// is `TOOL_FAILED`. Anything else from the worker is an invalid response.
pub(super) fn interpret(
    tool: &str,
    stdout: &str,
    secrets: &Secrets,
) -> Result<Response, CallError> {
    let invalid = |cause| {
        CallError::ToolFailed(ToolFailure::InvalidRunnerReply {
            tool: tool.to_string(),
            cause,
        })
    };
    let v: Value =
        serde_json::from_str(stdout.trim()).map_err(|e| invalid(ReplyError::NotJson(e)))?;
    let Value::Object(mut obj) = v else {
        return Err(invalid(ReplyError::Shape));
    };
    let key = match obj.keys().next() {
        Some(k) if obj.len() == 1 => k.clone(),
        _ => return Err(invalid(ReplyError::Shape)),
    };
    let value = obj.remove(&key).unwrap_or(Value::Null);
    match (key.as_str(), value) {
        ("response", r) => {
            let r = response::check(r, secrets).map_err(|e| invalid(ReplyError::Response(e)))?;
            if r.is_error {
                return Err(CallError::ToolReported {
                    tool: tool.to_string(),
                    content: r.content,
                });
            }
            Ok(Response {
                reply: ToolReply {
                    is_error: false,
                    content: r.content,
                    structured: None,
                },
                state: r.state,
            })
        }
        ("result", value) => Ok(Response {
            reply: ToolReply {
                is_error: false,
                content: Vec::new(),
                structured: Some(json!({ "result": value })),
            },
            state: None,
        }),
        ("raised", Value::Object(e)) => {
            let text = |k: &str| e.get(k).and_then(Value::as_str).unwrap_or("").to_string();
            let exception_type = secrets.scrub_str(&text("type"));
            if exception_type.is_empty() {
                return Err(invalid(ReplyError::Shape));
            }
            let (message, cut) = secrets.head(&text("message"), MESSAGE_SHOWN, false);
            let message = if cut > 0 {
                format!("{message}... ({cut} more bytes)")
            } else {
                message
            };
            Err(CallError::ToolFailed(ToolFailure::Raised {
                tool: tool.to_string(),
                exception_type,
                message,
            }))
        }
        ("fault", Value::String(fault)) => Err(CallError::ToolFailed(ToolFailure::Unsendable {
            tool: tool.to_string(),
            fault: secrets.head(&fault, MESSAGE_SHOWN, false).0,
        })),
        _ => Err(invalid(ReplyError::Shape)),
    }
}

/// What is wrong with the runner's reply (something in the worker wrote to the runner's
/// reply descriptor, or the function's response dict is invalid).
#[derive(Debug, thiserror::Error)]
pub enum ReplyError {
    #[error("not one JSON value")]
    NotJson(#[source] serde_json::Error),
    #[error(
        "not one object with exactly one of \"response\" (an object), \"result\", \"raised\" \
         (an object with a \"type\") or \"fault\" (a string)"
    )]
    Shape,
    #[error("the function's response is invalid")]
    Response(#[source] response::ResponseError),
}

/// The exception type a `TOOL_FAILED` of a python tool names, for the audit's `error`.
pub fn exception_type(e: &CallError) -> Option<&str> {
    match e {
        CallError::ToolFailed(ToolFailure::Raised { exception_type, .. }) => {
            Some(exception_type.as_str())
        }
        _ => None,
    }
}

/// The value a python function returned as its structured result (`{"result": value}`),
/// which a write call keeps beside its commit's fields.
pub(super) fn structured_result(reply: &ToolReply) -> Option<Value> {
    reply.structured.as_ref()?.get("result").cloned()
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::exec::ErrorCode;

    fn run(stdout: &str) -> Result<Response, CallError> {
        interpret("t", stdout, &Secrets::default())
    }

    #[test]
    fn each_reply_of_the_runner_becomes_its_response() {
        let r = run(
            r#"{"response": {"content": [{"type": "text", "text": "hi"}], "state": {"n": 1}}}"#,
        )
        .unwrap();
        assert_eq!(r.reply.content[0]["text"], "hi");
        assert_eq!(r.state.unwrap()["n"], 1);
        let r = run(r#"{"result": [1, 2]}"#).unwrap();
        assert_eq!(r.reply.structured, Some(json!({"result": [1, 2]})));
        assert!(r.state.is_none());
        let e = run(r#"{"raised": {"type": "ValueError", "message": "bad word"}}"#).unwrap_err();
        assert_eq!(e.code(), ErrorCode::ToolFailed);
        assert!(e.to_string().contains("ValueError: bad word"), "{e}");
        assert_eq!(exception_type(&e), Some("ValueError"));
        let e = run(r#"{"fault": "the function returned a value of type set"}"#).unwrap_err();
        assert!(e.to_string().contains("type set"), "{e}");
        assert_eq!(exception_type(&e), None);
    }

    #[test]
    fn anything_else_on_stdout_is_an_invalid_response() {
        for bad in [
            "",
            "hello",
            "[]",
            r#"{"result": 1, "response": {}}"#,
            r#"{"response": {"content": "x"}}"#,
            r#"{"response": {"extra": 1}}"#,
            r#"{"raised": "ValueError"}"#,
            r#"{"other": 1}"#,
        ] {
            let e = run(bad).unwrap_err();
            assert_eq!(e.code(), ErrorCode::ToolFailed, "{bad}");
            assert!(
                e.to_string().contains("gave an invalid reply"),
                "{bad}: {e}"
            );
        }
    }

    #[test]
    fn a_python_path_is_relative_only_beneath_the_unsearchable_dir() {
        let p = PythonEntry {
            entry: "m:f".into(),
            interpreter: "/usr/bin/python3".into(),
            path: vec!["/root/co/policies/python".into(), "/opt/lib".into()],
        };
        let stage = Path::new("/root/co/workspace/.airlock-job-c/stage");
        assert_eq!(
            sys_path(&WorkerReach::Absolute, &p, stage),
            ["/root/co/policies/python", "/opt/lib"]
        );
        let reach = WorkerReach::FromWorkingDir {
            unsearchable: "/root".into(),
            mode: 0o700,
        };
        assert_eq!(
            sys_path(&reach, &p, stage),
            ["../../../policies/python", "/opt/lib"]
        );
    }
}
