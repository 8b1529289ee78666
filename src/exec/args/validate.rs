//! Validation of one call's arguments against its tool's params: names, types, session
//! ids and sizes.

use serde_json::{Map, Value};

use super::{ArgError, MAX_PATH_ARG, MAX_STRING_ARG};
use crate::policy::redact::{Secrets, MAX_SECRET_ARG};
use crate::policy::{Builtin, ParamType, Tool, ToolKind};

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
