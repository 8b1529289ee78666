//! The worker protocol, both ways: what a worker is handed (its command line for `argv`
//! tools, its request on stdin for `json` ones, each bounded before anything is created for
//! the call) and what its exit, stdout and stderr mean (a reply and, for `json` tools, the
//! session's next state).

use serde_json::{json, Map, Value};

use super::{args, response, CallError, ToolReply};
use crate::audit::event::Exit;
use crate::policy::redact::Secrets;
use crate::policy::{Capability, EnvProfile, ExternalTool, PathRole, Protocol, Tool, ToolKind};
use crate::sandbox::{Captured, Outcome};
use crate::session::Snapshot;

/// What a worker that exited 0 answered.
#[derive(Debug)]
pub(super) struct Response {
    pub reply: ToolReply,
    /// A `json` tool's new session state (`None`: unchanged).
    pub state: Option<Map<String, Value>>,
}

/// The bytes a worker reads on stdin: a `json` tool's request line (its arguments and, for a
/// write tool, the session), nothing for an `argv` tool.
pub(super) fn stdin(
    ext: &ExternalTool,
    tool: &str,
    bound: &args::Bound,
    session: Option<&Snapshot>,
) -> Vec<u8> {
    match ext.protocol {
        Protocol::Json | Protocol::Python => json_request(tool, &bound.arguments, session),
        Protocol::Argv => Vec::new(),
    }
}

fn json_request(tool: &str, arguments: &Map<String, Value>, session: Option<&Snapshot>) -> Vec<u8> {
    let mut req = json!({"tool": tool, "arguments": arguments});
    if let Some(s) = session {
        req["session"] = json!({"id": s.id, "version": s.version, "state": s.state});
    }
    let mut bytes = req.to_string().into_bytes();
    bytes.push(b'\n');
    bytes
}

/// Bounds what a call would hand its worker, before anything is created for it: the
/// command line (each element, and the whole with the environment, within what `execve`
/// accepts) and, for a `json` tool, the request (within `max_message_bytes`). A call past
/// a bound is `INVALID_ARGUMENT`, naming the argument and the limit.
pub(super) fn check_bounds(
    max_message_bytes: usize,
    tool: &Tool,
    ext: &ExternalTool,
    bound: &args::Bound,
    session: Option<&Snapshot>,
) -> Result<(), args::ArgError> {
    let env = worker_env_bytes(&ext.profile.env)
        + args::env_bytes(bound.env.iter().map(|(k, v)| (k.as_bytes(), v.as_bytes())));
    let stack = rustix::process::getrlimit(rustix::process::Resource::Stack).current;
    args::check_command(
        &tool.name,
        &ext.command,
        &bound.subst,
        env,
        args::argv_budget(stack),
    )?;
    if matches!(ext.protocol, Protocol::Json | Protocol::Python) {
        let limit = max_message_bytes;
        let len = json_request(&tool.name, &bound.arguments, session).len();
        if len > limit {
            let size = |m: &Map<String, Value>| serde_json::to_vec(m).map_or(0, |v| v.len());
            return Err(args::ArgError::RequestTooLarge {
                tool: tool.name.clone(),
                len,
                arguments: size(&bound.arguments),
                state: session.map_or(0, |s| size(&s.state)),
                limit,
            });
        }
    }
    Ok(())
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

/// Turns a worker that ended on its own (`exit`) into a reply and, for `json` tools, an
/// optional new state. Anything but exit status 0 is `TOOL_FAILED`, quoting its stderr.
pub(super) fn interpret(
    tool: &Tool,
    exit: Exit,
    o: &Outcome,
    secrets: &Secrets,
) -> Result<Response, CallError> {
    let protocol = match &tool.kind {
        ToolKind::External(e) => e.protocol,
        ToolKind::Builtin(_) => Protocol::Argv,
    };
    let stderr_tail = stderr_tail(&o.stderr, secrets, STDERR_TAIL);
    let hint = write_denied_hint(tool, &stderr_tail);
    match exit {
        Exit::Status(0) => {}
        Exit::Status(code) => {
            return Err(CallError::ToolFailed(ToolFailure::Exited {
                tool: tool.name.clone(),
                code,
                stderr: stderr_tail,
                hint,
            }))
        }
        Exit::Signal(sig) => {
            return Err(CallError::ToolFailed(ToolFailure::Killed {
                tool: tool.name.clone(),
                signal: sig,
                stderr: stderr_tail,
                hint,
            }))
        }
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
            Ok(Response {
                reply: ToolReply::ok(text, Value::Null),
                state: None,
            })
        }
        Protocol::Json | Protocol::Python => {
            if o.stdout.truncated {
                return Err(CallError::ToolFailed(ToolFailure::StdoutOverCap {
                    tool: tool.name.clone(),
                    total: o.stdout.total,
                    cap: o.stdout.bytes.len(),
                }));
            }
            if protocol == Protocol::Python {
                super::python::interpret(&tool.name, &stdout, secrets)
            } else {
                parse_json_response(&tool.name, &stdout, secrets)
            }
        }
    }
}

/// How a tool that ran failed: its fault, not the daemon's (`TOOL_FAILED`); nothing was
/// published.
#[derive(Debug, thiserror::Error)]
pub enum ToolFailure {
    #[error("{tool} exited with status {code}; nothing was published; stderr: {stderr}{hint}")]
    Exited {
        tool: String,
        code: i32,
        /// The scrubbed tail of its stderr.
        stderr: String,
        /// What a write tool may write, when its stderr says a write was denied.
        hint: String,
    },
    #[error("{tool} was killed by signal {signal}; nothing was published; stderr: {stderr}{hint}")]
    Killed {
        tool: String,
        signal: i32,
        stderr: String,
        hint: String,
    },
    #[error("{tool} wrote {total} bytes to stdout, more than the cap of {cap}")]
    StdoutOverCap {
        tool: String,
        total: u64,
        cap: usize,
    },
    #[error("{tool} returned an invalid JSON response: {}; nothing was published and the session is unchanged", crate::report::chain(.cause))]
    InvalidResponse {
        tool: String,
        cause: response::ResponseError,
    },
    #[error("{tool}'s python runner gave an invalid reply: {}; nothing was published and the session is unchanged", crate::report::chain(.cause))]
    InvalidRunnerReply {
        tool: String,
        cause: super::python::ReplyError,
    },
    /// A `python` tool's function (or the import of its module) raised.
    #[error("{tool} raised {exception_type}: {message}; nothing was published and the session is unchanged")]
    Raised {
        tool: String,
        /// The exception's class: its name for a builtin, `module.Name` otherwise.
        exception_type: String,
        /// `str()` of the exception, scrubbed and cut.
        message: String,
    },
    /// A `python` tool's function returned what its runner cannot send.
    #[error("{tool}: {fault}; nothing was published and the session is unchanged")]
    Unsendable { tool: String, fault: String },
    #[error("{tool}: output `{param}` is refused ({}): {fault}; nothing was published and the session is unchanged", crate::publish::OutputFault::expected(*kind))]
    BadOutput {
        tool: String,
        param: String,
        kind: crate::policy::OutputKind,
        fault: crate::publish::OutputFault,
    },
}

/// Turns a `json`-protocol worker's stdout into a reply and an optional new state. The whole
/// response is checked here, before anything is published: an invalid one is `TOOL_FAILED`,
/// so nothing is published and the session stays at its version.
fn parse_json_response(tool: &str, stdout: &str, secrets: &Secrets) -> Result<Response, CallError> {
    let r = response::parse(stdout, secrets).map_err(|cause| {
        CallError::ToolFailed(ToolFailure::InvalidResponse {
            tool: tool.to_string(),
            cause,
        })
    })?;
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

/// The sentence a failed write tool's `TOOL_FAILED` message ends with when its stderr says
/// a write was refused (or it declares no output, so every write is): the sandbox, not the
/// file, refused it. Empty otherwise.
fn write_denied_hint(tool: &Tool, stderr_tail: &str) -> String {
    if tool.capability != Capability::Write {
        return String::new();
    }
    let outputs: Vec<&str> = tool
        .params
        .iter()
        .filter(|(_, p)| p.path.is_some_and(PathRole::writes))
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
fn stderr_tail(captured: &Captured, secrets: &Secrets, n: usize) -> String {
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

#[cfg(test)]
mod tests {
    use super::*;
    use crate::exec::ErrorCode;

    #[test]
    fn json_response_shapes() {
        let r = parse_json_response(
            "t",
            r#"{"content":[{"type":"text","text":"hi"}],"state":{"n":1}}"#,
            &Secrets::default(),
        )
        .unwrap();
        assert!(!r.reply.is_error);
        assert_eq!(r.state.unwrap()["n"], 1);
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

    #[test]
    fn the_json_request_is_one_line_with_the_session() {
        let args: Map<String, Value> = serde_json::from_str(r#"{"a": 1}"#).unwrap();
        let bytes = json_request("t", &args, None);
        assert_eq!(bytes, b"{\"arguments\":{\"a\":1},\"tool\":\"t\"}\n");
    }
}
