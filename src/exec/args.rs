//! Pure decisions about one call's arguments: validation against the tool's params (types,
//! session ids, sizes), output overlap, placeholder substitution in one pass, and the bounds
//! of the command line and of the `json` request a call would hand its worker. No I/O here,
//! so each rule is tested directly (and by the property tests in `exec::proptests`).

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};

use serde_json::{Map, Value};

use crate::policy::redact::{Secrets, MAX_SECRET_ARG};
use crate::policy::{
    Builtin, ParamType, PathRole, Piece as CommandPiece, Template, Tool, ToolKind,
};
use crate::session::IdError;

/// Largest string argument a client may pass (a path argument has the tighter
/// [`MAX_PATH_ARG`]). Larger data belongs in a workspace file named by a path argument.
pub const MAX_STRING_ARG: usize = 1 << 20;

/// Largest path argument: the kernel's PATH_MAX (4096) less the terminating NUL.
pub const MAX_PATH_ARG: usize = 4095;

/// Largest single command-line element, NUL included: the kernel's MAX_ARG_STRLEN (32 pages,
/// 128 KiB with 4 KiB pages) less one page of margin.
pub const MAX_ARGV_ELEMENT: usize = 32 * 4096 - 4096;

/// Largest command line (argv and environment strings, their NULs and pointers) airlock
/// hands to `execve`: half the 2 MiB ARG_MAX of the usual 8 MiB stack limit. A smaller stack
/// limit lowers it (see [`argv_budget`]).
pub const MAX_ARGV_TOTAL: usize = 1 << 20;

/// Why a call's arguments were refused (`INVALID_ARGUMENT`). Every message names the
/// argument and, for a bound, the size found and the limit.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum ArgError {
    #[error("unknown argument {name} (tool {tool} takes: {known})")]
    Unknown {
        /// The name as shown (quoted, long names cut).
        name: String,
        tool: String,
        known: String,
    },
    #[error("argument {name:?} must be {expected}, not {found}")]
    WrongType {
        name: String,
        expected: String,
        found: &'static str,
    },
    /// An integer argument whose value no integer type airlock passes on can hold (JSON
    /// reads it as a floating-point number).
    #[error(
        "argument {name:?} must be an integer between {} and {}, not {found}",
        i64::MIN,
        u64::MAX
    )]
    IntegerOutOfRange { name: String, found: String },
    #[error(
        "missing required argument \"session\" (every write tool takes the session it mutates)"
    )]
    MissingSession,
    #[error("missing required argument {name:?}")]
    Missing { name: String },
    #[error("argument {name:?}: {source}")]
    SessionId { name: String, source: IdError },
    #[error("argument {name:?} is {len} bytes; {what} may be at most {limit} bytes")]
    TooLong {
        name: String,
        len: usize,
        what: &'static str,
        limit: usize,
    },
    #[error("argument {name:?} contains a NUL byte, which no command line can carry")]
    NulByte { name: String },
    #[error(
        "element {index} of {tool}'s command line would be {len} bytes (from argument {names}); \
         one command-line element may be at most {limit} bytes"
    )]
    ElementTooLong {
        tool: String,
        index: usize,
        names: String,
        len: usize,
        limit: usize,
    },
    #[error(
        "{tool}'s command line would be {len} bytes (arguments, environment and pointers; the \
         largest argument, {largest:?}, is {largest_len} bytes); it may be at most {limit} bytes"
    )]
    CommandLineTooLong {
        tool: String,
        len: usize,
        largest: String,
        largest_len: usize,
        limit: usize,
    },
    #[error(
        "the JSON request to {tool} would be {len} bytes (arguments {arguments} bytes, session \
         state {state} bytes); it may be at most {limit} bytes (max_message_size in airlock.toml)"
    )]
    RequestTooLarge {
        tool: String,
        len: usize,
        arguments: usize,
        state: usize,
        limit: usize,
    },
}

pub use crate::text::shown;

/// Whether argument `name` of `tool` names a session (and must be a valid session id).
fn names_session(tool: &Tool, name: &str) -> bool {
    match tool.kind {
        ToolKind::Builtin(Builtin::SessionCreate) => name == "id",
        ToolKind::Builtin(_) => name == "session",
        ToolKind::External(_) => name == "session" && tool.takes_session(),
    }
}

/// Checks `args` against the tool's declared params: no unknown names, every required one
/// present, every value of its declared type, session ids well-formed, strings within
/// [`MAX_STRING_ARG`] (paths within [`MAX_PATH_ARG`]). Returns the arguments with defaults
/// applied (and without `session`, which the caller handles).
pub fn validate(tool: &Tool, args: &Map<String, Value>) -> Result<Map<String, Value>, ArgError> {
    let mut out = Map::new();
    for (name, value) in args {
        if names_session(tool, name) {
            let Some(id) = value.as_str() else {
                return Err(ArgError::WrongType {
                    name: name.clone(),
                    expected: "a string".into(),
                    found: kind(value),
                });
            };
            crate::session::check_id(id).map_err(|source| ArgError::SessionId {
                name: name.clone(),
                source,
            })?;
            if name == "session" && tool.takes_session() {
                continue;
            }
        }
        let Some(p) = tool.params.get(name) else {
            let mut known: Vec<&str> = tool.params.keys().map(String::as_str).collect();
            if tool.takes_session() {
                known.insert(0, "session");
            }
            return Err(ArgError::Unknown {
                // A client may pass a secret's value as a name too.
                name: Secrets::of(tool, args).shown(name),
                tool: tool.name.clone(),
                known: if known.is_empty() {
                    "no arguments".to_string()
                } else {
                    known.join(", ")
                },
            });
        };
        if p.ty == ParamType::Integer && out_of_integer_range(value) {
            return Err(ArgError::IntegerOutOfRange {
                name: name.clone(),
                found: value.to_string(),
            });
        }
        if !matches_type(p.ty, value) {
            return Err(ArgError::WrongType {
                name: name.clone(),
                expected: format!("{} {}", article(p.ty.as_str()), p.ty.as_str()),
                found: kind(value),
            });
        }
        if let Value::String(s) = value {
            let (limit, what) = match p.path {
                Some(_) => (MAX_PATH_ARG, "a path"),
                None if p.secret => (MAX_SECRET_ARG, "a secret argument"),
                None => (MAX_STRING_ARG, "a string argument"),
            };
            if s.len() > limit {
                return Err(ArgError::TooLong {
                    name: name.clone(),
                    len: s.len(),
                    what,
                    limit,
                });
            }
        }
        out.insert(name.clone(), value.clone());
    }
    if tool.takes_session() && !args.contains_key("session") {
        return Err(ArgError::MissingSession);
    }
    for (name, p) in &tool.params {
        if out.contains_key(name) {
            continue;
        }
        if let Some(d) = &p.default {
            out.insert(name.clone(), d.clone());
        } else if p.required {
            return Err(ArgError::Missing { name: name.clone() });
        }
    }
    Ok(out)
}

fn article(word: &str) -> &'static str {
    if word.starts_with(['a', 'e', 'i', 'o', 'u']) {
        "an"
    } else {
        "a"
    }
}

/// Whether `v` is a whole number beyond both `i64` and `u64` (serde_json reads an integer
/// literal that fits neither, such as `18446744073709551616` or `1e30`, as an `f64`).
fn out_of_integer_range(v: &Value) -> bool {
    const TWO_POW_63: f64 = 9_223_372_036_854_775_808.0;
    const TWO_POW_64: f64 = 18_446_744_073_709_551_616.0;
    match v
        .as_number()
        .filter(|n| n.is_f64())
        .and_then(|n| n.as_f64())
    {
        Some(f) => f.is_finite() && f.fract() == 0.0 && (f >= TWO_POW_64 || f <= -TWO_POW_63),
        None => false,
    }
}

fn matches_type(ty: ParamType, v: &Value) -> bool {
    match ty {
        ParamType::String => v.is_string(),
        ParamType::Integer => v.is_i64() || v.is_u64(),
        ParamType::Number => v.is_number(),
        ParamType::Boolean => v.is_boolean(),
        ParamType::Object => v.is_object(),
        ParamType::Array => v.is_array(),
    }
}

pub fn kind(v: &Value) -> &'static str {
    match v {
        Value::Null => "null",
        Value::Bool(_) => "a boolean",
        Value::Number(n) if n.is_f64() => "a number",
        Value::Number(_) => "an integer",
        Value::String(_) => "a string",
        Value::Array(_) => "an array",
        Value::Object(_) => "an object",
    }
}

/// Rejects two outputs of one call that name the same path or one inside the other.
pub fn check_overlap(outputs: &[(String, PathBuf)]) -> Result<(), String> {
    for (i, (na, a)) in outputs.iter().enumerate() {
        for (nb, b) in &outputs[i + 1..] {
            if a == b {
                return Err(format!(
                    "outputs {na:?} and {nb:?} both name {}",
                    shown(&a.to_string_lossy())
                ));
            }
            if a.starts_with(b) || b.starts_with(a) {
                let (outer, inner) = if a.starts_with(b) { (b, a) } else { (a, b) };
                return Err(format!(
                    "outputs {na:?} and {nb:?} overlap: {} is inside {}",
                    shown(&inner.to_string_lossy()),
                    shown(&outer.to_string_lossy())
                ));
            }
        }
    }
    Ok(())
}

/// The text a placeholder becomes.
pub fn render(v: &Value) -> String {
    match v {
        Value::String(s) => s.clone(),
        Value::Null => String::new(),
        other => other.to_string(),
    }
}

pub use crate::policy::command::{tokens as pieces, Token as Piece};

/// The argv of `command` with `values` substituted: [`crate::policy::Command::render`].
pub fn substitute<T: Template + ?Sized>(
    command: &T,
    values: &BTreeMap<String, String>,
) -> Vec<String> {
    command.template().render(values)
}

/// The most bytes of command line (argv and environment strings with their NULs, and the
/// pointer arrays) a worker's `execve` may be handed, given the stack limit it runs with
/// (`None`: unlimited). The kernel allows a quarter of the stack limit, at most 6 MiB and at
/// least 128 KiB; airlock keeps a quarter of that as margin and never exceeds
/// [`MAX_ARGV_TOTAL`].
pub fn argv_budget(stack_limit: Option<u64>) -> usize {
    const KERNEL_MAX: u64 = 6 << 20;
    const KERNEL_MIN: u64 = 128 << 10;
    let kernel = stack_limit
        .map_or(KERNEL_MAX, |s| (s / 4).min(KERNEL_MAX))
        .max(KERNEL_MIN);
    let with_margin = usize::try_from(kernel / 4 * 3).unwrap_or(usize::MAX);
    with_margin.min(MAX_ARGV_TOTAL)
}

/// Checks the command line `command` would become with `values` substituted, before
/// anything is created: no value may hold a NUL byte or exceed [`MAX_ARGV_ELEMENT`], no
/// element may exceed it, and the whole (argv, plus `env_bytes` of environment, pointers
/// included) may not exceed `budget`. Only values whose placeholder the command uses count.
pub fn check_command<T: Template + ?Sized>(
    tool: &str,
    command: &T,
    values: &BTreeMap<String, String>,
    env_bytes: usize,
    budget: usize,
) -> Result<(), ArgError> {
    const POINTER: usize = std::mem::size_of::<usize>();
    let command = command.template();
    let mut largest = (String::new(), 0usize);
    let used: std::collections::BTreeSet<&str> = command.params().collect();
    for name in &used {
        let Some(v) = values.get(*name) else { continue };
        if v.as_bytes().contains(&0) {
            return Err(ArgError::NulByte {
                name: name.to_string(),
            });
        }
        if v.len() + 1 > MAX_ARGV_ELEMENT {
            return Err(ArgError::TooLong {
                name: name.to_string(),
                len: v.len(),
                what: "an argument passed on the command line",
                limit: MAX_ARGV_ELEMENT - 1,
            });
        }
        if v.len() > largest.1 {
            largest = (name.to_string(), v.len());
        }
    }
    let argv = command.render(values);
    let mut total = env_bytes + POINTER;
    for (index, (elem, pieces)) in argv.iter().zip(command.kept(values)).enumerate() {
        if elem.len() + 1 > MAX_ARGV_ELEMENT {
            let names: Vec<String> = pieces
                .iter()
                .filter_map(|p| match p {
                    CommandPiece::Param(n) => Some(format!("{n:?}")),
                    CommandPiece::Lit(_) => None,
                })
                .collect();
            return Err(ArgError::ElementTooLong {
                tool: tool.to_string(),
                index,
                names: names.join(", "),
                len: elem.len(),
                limit: MAX_ARGV_ELEMENT - 1,
            });
        }
        total += elem.len() + 1 + POINTER;
    }
    total += POINTER;
    if total > budget {
        return Err(ArgError::CommandLineTooLong {
            tool: tool.to_string(),
            len: total,
            largest: largest.0,
            largest_len: largest.1,
            limit: budget,
        });
    }
    Ok(())
}

/// The bytes an environment takes on a command line: `NAME=value` and a NUL per variable,
/// and a pointer each.
pub fn env_bytes<'a>(vars: impl IntoIterator<Item = (&'a [u8], &'a [u8])>) -> usize {
    vars.into_iter()
        .map(|(k, v)| k.len() + 1 + v.len() + 1 + std::mem::size_of::<usize>())
        .sum()
}

/// Checks the size of a `json` request (`request`, as sent) against `limit`; `arguments`
/// and `state` are the serialized sizes of its parts, for the message.
pub fn check_request(
    tool: &str,
    request: usize,
    arguments: usize,
    state: usize,
    limit: usize,
) -> Result<(), ArgError> {
    if request > limit {
        return Err(ArgError::RequestTooLarge {
            tool: tool.to_string(),
            len: request,
            arguments,
            state,
            limit,
        });
    }
    Ok(())
}

/// The staged path output `i` (workspace path `target`) of job `job_id` will have: what
/// [`crate::publish::Job::staged_path`] returns once the job dir exists (a test pins the
/// two together). Used to bound a call's command line before its job dir is created.
pub fn predicted_staged_path(root: &Path, job_id: &str, i: usize, target: &Path) -> PathBuf {
    root.join(format!("{}{job_id}", crate::publish::JOB_DIR_PREFIX))
        .join("stage")
        .join(i.to_string())
        .join(target.file_name().unwrap_or(std::ffi::OsStr::new("output")))
}

/// One call's arguments as the worker sees them.
#[derive(Debug, Default, PartialEq)]
pub struct Bound {
    /// Placeholder name to text (`{session}` included).
    pub subst: BTreeMap<String, String>,
    /// The arguments of a `json` request, path arguments rewritten.
    pub arguments: Map<String, Value>,
    /// The input paths the worker may read.
    pub readable: Vec<PathBuf>,
    /// The worker's environment variables from parameters declaring `env` ([`bind_env`]).
    pub env: Vec<(String, String)>,
}

/// The environment variables a call's arguments set: `NAME` to the value of each parameter
/// declaring `env = "NAME"` that the call passes (the loader allows `env` on strings only).
/// A value with a NUL byte, or a `NAME=value` over [`MAX_ARGV_ELEMENT`], is refused.
pub fn bind_env(
    tool: &Tool,
    values: &Map<String, Value>,
) -> Result<Vec<(String, String)>, ArgError> {
    let mut env = Vec::new();
    for (name, p) in &tool.params {
        let (Some(var), Some(v)) = (&p.env, values.get(name)) else {
            continue;
        };
        let v = render(v);
        if v.as_bytes().contains(&0) {
            return Err(ArgError::NulByte { name: name.clone() });
        }
        if var.len() + 1 + v.len() + 1 > MAX_ARGV_ELEMENT {
            return Err(ArgError::TooLong {
                name: name.clone(),
                len: v.len(),
                what: "an argument passed in the environment",
                limit: MAX_ARGV_ELEMENT - var.len() - 2,
            });
        }
        env.push((var.clone(), v));
    }
    Ok(env)
}

/// Binds validated arguments: an input path becomes its absolute path in the workspace (and
/// readable), output `i` (in `paths` order) becomes `staged(i)`, anything else its text.
pub fn bind(
    values: &Map<String, Value>,
    paths: &[(String, PathRole, PathBuf)],
    root: &Path,
    session: Option<&str>,
    mut staged: impl FnMut(usize) -> PathBuf,
) -> Bound {
    let mut b = Bound {
        arguments: values.clone(),
        ..Bound::default()
    };
    if let Some(s) = session {
        b.subst.insert("session".to_string(), s.to_string());
    }
    for (name, v) in values {
        b.subst.insert(name.clone(), render(v));
    }
    let mut outputs = 0;
    for (name, role, rel) in paths {
        let abs = match role {
            PathRole::Input => {
                let abs = root.join(rel);
                b.readable.push(abs.clone());
                abs
            }
            PathRole::Output => {
                outputs += 1;
                staged(outputs - 1)
            }
        };
        let text = abs.display().to_string();
        b.subst.insert(name.clone(), text.clone());
        b.arguments.insert(name.clone(), text.into());
    }
    b
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::policy::{Annotations, Capability, Param};

    fn tool() -> Tool {
        let mut params = std::collections::BTreeMap::new();
        params.insert(
            "out".to_string(),
            Param {
                required: true,
                path: Some(PathRole::Output),
                ..Param::of(ParamType::String)
            },
        );
        params.insert(
            "n".to_string(),
            Param {
                default: Some(3.into()),
                ..Param::of(ParamType::Integer)
            },
        );
        Tool {
            title: None,
            name: "t".into(),
            description: String::new(),
            capability: Capability::Write,
            kind: ToolKind::External(crate::policy::ExternalTool {
                command: crate::policy::Command::parse(["/bin/true"]),
                protocol: crate::policy::Protocol::Argv,
                timeout: std::time::Duration::from_secs(1),
                profile: std::sync::Arc::new(crate::policy::Profile {
                    name: "test".into(),
                    landlock: crate::policy::LandlockProfile {
                        abi: 6,
                        best_effort: false,
                        read: vec![],
                        exec: vec![],
                        write: vec![],
                    },
                    seccomp: crate::policy::SeccompProfile {
                        mode: crate::policy::SeccompMode::Deny,
                        syscalls: vec![],
                        errno: crate::policy::Errno::EPERM,
                    },
                    network: false,
                    unix_sockets: vec![],
                    limits: Default::default(),
                    env: Default::default(),
                }),
            }),
            params,
            annotations: Annotations {
                read_only: false,
                destructive: true,
                idempotent: false,
            },
            source: None,
        }
    }

    fn obj(v: Value) -> Map<String, Value> {
        v.as_object().cloned().unwrap_or_default()
    }

    #[test]
    fn validation_names_what_is_wrong() {
        let t = tool();
        let ok = validate(
            &t,
            &obj(serde_json::json!({"session": "s", "out": "a.txt"})),
        )
        .unwrap();
        assert_eq!(ok["n"], 3);
        let e = validate(&t, &obj(serde_json::json!({"session": "s", "out": 5}))).unwrap_err();
        assert_eq!(
            e.to_string(),
            "argument \"out\" must be a string, not an integer"
        );
        let e = validate(
            &t,
            &obj(serde_json::json!({"session": "s", "out": "a", "x": 1})),
        )
        .unwrap_err();
        assert!(e.to_string().starts_with("unknown argument \"x\""), "{e}");
        let e = validate(&t, &obj(serde_json::json!({"out": "a"}))).unwrap_err();
        assert!(e.to_string().contains("\"session\""), "{e}");
        let e = validate(&t, &obj(serde_json::json!({"session": "s"}))).unwrap_err();
        assert_eq!(e.to_string(), "missing required argument \"out\"");
    }

    #[test]
    fn integers_beyond_every_integer_type_name_the_range() {
        let t = tool();
        let range = format!("must be an integer between {} and {}", i64::MIN, u64::MAX);
        for n in [
            "18446744073709551616",
            "1e30",
            "-9223372036854775809",
            "-1e300",
        ] {
            let v: Value = serde_json::from_str(n).unwrap();
            let e = validate(
                &t,
                &obj(serde_json::json!({"session": "s", "out": "a", "n": v})),
            )
            .unwrap_err();
            assert!(
                matches!(e, ArgError::IntegerOutOfRange { ref name, .. } if name == "n"),
                "{n}: {e}"
            );
            assert!(
                e.to_string()
                    .starts_with(&format!("argument \"n\" {range}, not ")),
                "{e}"
            );
        }
        for n in ["18446744073709551615", "-9223372036854775808", "0"] {
            let v: Value = serde_json::from_str(n).unwrap();
            let ok = validate(
                &t,
                &obj(serde_json::json!({"session": "s", "out": "a", "n": v})),
            );
            assert!(ok.is_ok(), "{n}: {ok:?}");
        }
        let e = validate(
            &t,
            &obj(serde_json::json!({"session": "s", "out": "a", "n": 1.5})),
        )
        .unwrap_err();
        assert_eq!(
            e.to_string(),
            "argument \"n\" must be an integer, not a number"
        );
    }

    #[test]
    fn session_ids_are_checked_wherever_named() {
        let t = tool();
        let huge = "s".repeat(3 << 20);
        for (id, needle) in [
            ("", "cannot be empty"),
            (
                huge.as_str(),
                "is 3145728 bytes; a session id is at most 64 bytes",
            ),
            ("a/../b", "holds '/' at byte 1"),
            ("caf\u{e9}", "holds '\u{e9}' at byte 3"),
        ] {
            let e = validate(&t, &obj(serde_json::json!({"session": id, "out": "a"})))
                .unwrap_err()
                .to_string();
            assert!(e.starts_with("argument \"session\": "), "{e}");
            assert!(e.contains(needle), "{e:?} does not say {needle:?}");
            assert!(
                e.len() < 300,
                "the message echoes the id: {} bytes",
                e.len()
            );
        }
        let builtins = crate::policy::builtins();
        let get = &builtins["session_get"];
        let e = validate(get, &obj(serde_json::json!({"session": "x y"}))).unwrap_err();
        assert!(matches!(e, ArgError::SessionId { .. }), "{e}");
        let destroy = &builtins["session_destroy"];
        let e = validate(destroy, &obj(serde_json::json!({"session": huge}))).unwrap_err();
        assert!(matches!(e, ArgError::SessionId { .. }), "{e}");
        let create = &builtins["session_create"];
        let e = validate(create, &obj(serde_json::json!({"id": "a.b"}))).unwrap_err();
        assert!(
            matches!(e, ArgError::SessionId { ref name, .. } if name == "id"),
            "{e}"
        );
        assert!(validate(create, &obj(serde_json::json!({"id": "a-B_9"}))).is_ok());
    }

    #[test]
    fn strings_and_paths_are_bounded_and_long_names_are_cut() {
        let mut t = tool();
        t.params
            .insert("text".to_string(), Param::of(ParamType::String));
        let at = |n: usize| "x".repeat(n);
        let ok = serde_json::json!({"session": "s", "out": at(MAX_PATH_ARG), "text": at(MAX_STRING_ARG)});
        assert!(validate(&t, &obj(ok)).is_ok());
        let e = validate(
            &t,
            &obj(serde_json::json!({"session": "s", "out": at(MAX_PATH_ARG + 1)})),
        )
        .unwrap_err();
        assert_eq!(
            e.to_string(),
            "argument \"out\" is 4096 bytes; a path may be at most 4095 bytes"
        );
        let e = validate(
            &t,
            &obj(serde_json::json!({"session": "s", "out": "a", "text": at(MAX_STRING_ARG + 1)})),
        )
        .unwrap_err();
        assert_eq!(
            e.to_string(),
            "argument \"text\" is 1048577 bytes; a string argument may be at most 1048576 bytes"
        );
        let mut a = obj(serde_json::json!({"session": "s", "out": "a"}));
        a.insert(at(1 << 20), 1.into());
        let e = validate(&t, &a).unwrap_err().to_string();
        assert!(e.contains("(1048576 bytes)") && e.len() < 300, "{e}");
    }

    #[test]
    fn overlap_is_rejected() {
        let p = |n: &str, s: &str| (n.to_string(), PathBuf::from(s));
        assert!(check_overlap(&[p("a", "x/y"), p("b", "x/z")]).is_ok());
        assert!(check_overlap(&[p("a", "x/y"), p("b", "x/y")]).is_err());
        assert!(check_overlap(&[p("a", "x"), p("b", "x/y")]).is_err());
        assert!(check_overlap(&[p("a", "xy"), p("b", "x")]).is_ok());
    }

    #[test]
    fn binding_rewrites_paths() {
        let values = obj(serde_json::json!({"src": "in/a.txt", "out": "b.txt", "n": 2}));
        let paths = vec![
            ("out".to_string(), PathRole::Output, PathBuf::from("b.txt")),
            (
                "src".to_string(),
                PathRole::Input,
                PathBuf::from("in/a.txt"),
            ),
        ];
        let b = bind(&values, &paths, Path::new("/ws"), Some("s1"), |i| {
            PathBuf::from(format!("/ws/.job/stage/{i}/b.txt"))
        });
        assert_eq!(b.subst["out"], "/ws/.job/stage/0/b.txt");
        assert_eq!(b.subst["src"], "/ws/in/a.txt");
        assert_eq!(b.subst["n"], "2");
        assert_eq!(b.subst["session"], "s1");
        assert_eq!(b.arguments["src"], "/ws/in/a.txt");
        assert_eq!(b.arguments["n"], 2);
        assert_eq!(b.readable, vec![PathBuf::from("/ws/in/a.txt")]);
    }

    #[test]
    fn substitution_is_one_pass() {
        let mut v = BTreeMap::new();
        v.insert("text".to_string(), "{out} and {session}".to_string());
        v.insert("out".to_string(), "/s/0/o.txt".to_string());
        v.insert("session".to_string(), "s1".to_string());
        let cmd: Vec<String> = ["/bin/x", "{text}:{out}", "{out}{text}", "{{text}}", "{text"]
            .iter()
            .map(|s| s.to_string())
            .collect();
        assert_eq!(
            substitute(&cmd, &v),
            vec![
                "/bin/x",
                "{out} and {session}:/s/0/o.txt",
                "/s/0/o.txt{out} and {session}",
                // As the policy loader scans it, "{{text}}" holds no placeholder.
                "{{text}}",
                "{text",
            ]
        );
    }

    #[test]
    fn pieces_scan_as_the_policy_loader_does() {
        for s in [
            "--out={out}.{ext}",
            "{ not one }",
            "{a{b}c}",
            "{}{x}",
            "}{y}{",
            "plain",
        ] {
            let names: Vec<&str> = pieces(s)
                .into_iter()
                .filter_map(|p| match p {
                    Piece::Placeholder(n) => Some(n),
                    Piece::Text(_) => None,
                })
                .collect();
            assert_eq!(names, crate::policy::placeholders(s), "{s:?}");
        }
        assert_eq!(
            pieces("a{b}c{ d }"),
            vec![
                Piece::Text("a"),
                Piece::Placeholder("b"),
                Piece::Text("c{ d }")
            ]
        );
    }

    #[test]
    fn command_lines_are_bounded_before_exec() {
        let cmd: Vec<String> = ["/bin/sh", "-c", "x", "--text={text}", "{out}"]
            .iter()
            .map(|s| s.to_string())
            .collect();
        let mut v = BTreeMap::new();
        v.insert("out".to_string(), "/ws/o".to_string());
        v.insert("text".to_string(), "t".repeat(MAX_ARGV_ELEMENT - 1));
        // The value fits, but "--text=" around it does not.
        let e = check_command("w", &cmd, &v, 0, MAX_ARGV_TOTAL).unwrap_err();
        assert!(
            matches!(e, ArgError::ElementTooLong { index: 3, ref names, .. } if names == "\"text\""),
            "{e}"
        );
        v.insert("text".to_string(), "t".repeat(3 << 20));
        let e = check_command("w", &cmd, &v, 0, MAX_ARGV_TOTAL).unwrap_err();
        assert_eq!(
            e.to_string(),
            format!(
                "argument \"text\" is 3145728 bytes; an argument passed on the command line may be at most {} bytes",
                MAX_ARGV_ELEMENT - 1
            )
        );
        v.insert("text".to_string(), "a\0b".to_string());
        assert!(matches!(
            check_command("w", &cmd, &v, 0, MAX_ARGV_TOTAL),
            Err(ArgError::NulByte { .. })
        ));
        // A value whose placeholder the command does not use is not its concern.
        v.insert("text".to_string(), "t".into());
        v.insert("unused".to_string(), "u\0".repeat(1 << 20));
        assert_eq!(check_command("w", &cmd, &v, 0, MAX_ARGV_TOTAL), Ok(()));
        // The whole: arguments, environment and pointers.
        let argv_bytes: usize = substitute(&cmd, &v)
            .iter()
            .map(|a| a.len() + 1 + 8)
            .sum::<usize>()
            + 8;
        let env = 1000;
        let exact = argv_bytes + env + 8;
        assert_eq!(check_command("w", &cmd, &v, env, exact), Ok(()));
        let e = check_command("w", &cmd, &v, env, exact - 1).unwrap_err();
        assert!(
            matches!(e, ArgError::CommandLineTooLong { len, .. } if len == exact),
            "{e}"
        );
    }

    #[test]
    fn the_budget_follows_the_stack_limit() {
        assert_eq!(argv_budget(Some(8 << 20)), MAX_ARGV_TOTAL);
        assert_eq!(argv_budget(None), MAX_ARGV_TOTAL);
        // 1 MiB of stack: the kernel allows 256 KiB; airlock keeps three quarters.
        assert_eq!(argv_budget(Some(1 << 20)), 192 << 10);
        // Below 512 KiB of stack the kernel still allows 128 KiB.
        assert_eq!(argv_budget(Some(4096)), 96 << 10);
    }

    #[test]
    fn predicted_staged_paths_are_the_real_ones() {
        let dir = tempfile::tempdir().unwrap();
        let ws = crate::publish::Workspace::open(dir.path()).unwrap();
        let targets = vec![PathBuf::from("a/b.tar"), PathBuf::from("c")];
        let job = crate::publish::Job::create(
            &ws,
            crate::publish::JobSpec {
                id: "j-1".into(),
                session: "s".into(),
                tool: "t".into(),
                targets: targets.clone(),
                modes: Vec::new(),
                stage_owner: None,
            },
        )
        .unwrap();
        for (i, t) in targets.iter().enumerate() {
            assert_eq!(
                predicted_staged_path(ws.root(), "j-1", i, t),
                job.staged_path(i)
            );
        }
        job.discard().unwrap();
    }

    #[test]
    fn substitution() {
        let mut v = BTreeMap::new();
        v.insert("out".to_string(), "/s/0/o.txt".to_string());
        let cmd: Vec<String> = ["/bin/x", "--out={out}", "{missing}", "{out}"]
            .iter()
            .map(|s| s.to_string())
            .collect();
        assert_eq!(
            substitute(&cmd, &v),
            vec!["/bin/x", "--out=/s/0/o.txt", "/s/0/o.txt"]
        );
    }
}
