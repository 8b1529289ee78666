//! Pure decisions about one call's arguments: validation against the tool's params (types,
//! session ids, sizes; `args/validate.rs`), output overlap, placeholder substitution in one pass, and the bounds
//! of the command line and of the `json` request a call would hand its worker. No I/O here,
//! so each rule is tested directly (and by the property tests in `exec::proptests`).

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};

use serde_json::{Map, Value};

use crate::policy::{PathRole, Piece as CommandPiece, Template, Tool};
use crate::session::IdError;

mod validate;
pub use validate::{kind, shown, validate};

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
    #[error("argument {name:?}")]
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

/// Two outputs of one call that cannot both be published.
#[derive(Debug, thiserror::Error, PartialEq)]
pub enum OverlapError {
    #[error("outputs {a:?} and {b:?} both name {}", shown(&path.to_string_lossy()))]
    Same { a: String, b: String, path: PathBuf },
    #[error(
        "outputs {a:?} and {b:?} overlap: {} is inside {}",
        shown(&inner.to_string_lossy()),
        shown(&outer.to_string_lossy())
    )]
    Nested {
        a: String,
        b: String,
        inner: PathBuf,
        outer: PathBuf,
    },
}

/// Rejects two outputs of one call that name the same path or one inside the other.
pub fn check_overlap(outputs: &[(String, PathBuf)]) -> Result<(), OverlapError> {
    for (i, (na, a)) in outputs.iter().enumerate() {
        for (nb, b) in &outputs[i + 1..] {
            if a == b {
                return Err(OverlapError::Same {
                    a: na.clone(),
                    b: nb.clone(),
                    path: a.clone(),
                });
            }
            if a.starts_with(b) || b.starts_with(a) {
                let (outer, inner) = if a.starts_with(b) { (b, a) } else { (a, b) };
                return Err(OverlapError::Nested {
                    a: na.clone(),
                    b: nb.clone(),
                    inner: inner.clone(),
                    outer: outer.clone(),
                });
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
    predicted_stage_dir(root, job_id)
        .join(i.to_string())
        .join(target.file_name().unwrap_or(std::ffi::OsStr::new("output")))
}

/// The staging dir job `job_id` will have (`Job::stage_dir`), before the job dir exists.
pub fn predicted_stage_dir(root: &Path, job_id: &str) -> PathBuf {
    root.join(format!("{}{job_id}", crate::publish::JOB_DIR_PREFIX))
        .join("stage")
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
            PathRole::Output | PathRole::InOut => {
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
mod tests;
