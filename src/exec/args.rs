//! Pure decisions about one call's arguments: validation against the tool's params, output
//! overlap, placeholder substitution. No I/O here, so each rule is tested directly.

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};

use serde_json::{Map, Value};

use crate::policy::{ParamType, PathRole, Tool};

/// Checks `args` against the tool's declared params: no unknown names, every required one
/// present, every value of its declared type. Returns the arguments with defaults applied
/// (and without `session`, which the caller handles).
pub fn validate(tool: &Tool, args: &Map<String, Value>) -> Result<Map<String, Value>, String> {
    let mut out = Map::new();
    for (name, value) in args {
        if name == "session" && tool.takes_session() {
            if !value.is_string() {
                return Err(format!(
                    "argument \"session\" must be a string, not {}",
                    kind(value)
                ));
            }
            continue;
        }
        let Some(p) = tool.params.get(name) else {
            let mut known: Vec<&str> = tool.params.keys().map(String::as_str).collect();
            if tool.takes_session() {
                known.insert(0, "session");
            }
            return Err(format!(
                "unknown argument {name:?} (tool {} takes: {})",
                tool.name,
                if known.is_empty() {
                    "no arguments".to_string()
                } else {
                    known.join(", ")
                }
            ));
        };
        if !matches_type(p.ty, value) {
            return Err(format!(
                "argument {name:?} must be {} {}, not {}",
                article(p.ty.as_str()),
                p.ty.as_str(),
                kind(value)
            ));
        }
        out.insert(name.clone(), value.clone());
    }
    if tool.takes_session() && !args.contains_key("session") {
        return Err(
            "missing required argument \"session\" (every write tool takes the session it mutates)"
                .to_string(),
        );
    }
    for (name, p) in &tool.params {
        if out.contains_key(name) {
            continue;
        }
        if let Some(d) = &p.default {
            out.insert(name.clone(), d.clone());
        } else if p.required {
            return Err(format!("missing required argument {name:?}"));
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
                    a.display()
                ));
            }
            if a.starts_with(b) || b.starts_with(a) {
                let (outer, inner) = if a.starts_with(b) { (b, a) } else { (a, b) };
                return Err(format!(
                    "outputs {na:?} and {nb:?} overlap: {} is inside {}",
                    inner.display(),
                    outer.display()
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

/// Substitutes `{name}` placeholders in each element of `command`. An element that is only
/// a placeholder of an absent optional argument is dropped.
pub fn substitute(command: &[String], values: &BTreeMap<String, String>) -> Vec<String> {
    let mut argv = Vec::with_capacity(command.len());
    for part in command {
        let names = crate::policy::placeholders(part);
        if names.len() == 1
            && part == &format!("{{{}}}", names[0])
            && !values.contains_key(names[0])
        {
            continue;
        }
        let mut s = part.clone();
        for name in names {
            let with = values.get(name).map(String::as_str).unwrap_or("");
            s = s.replace(&format!("{{{name}}}"), with);
        }
        argv.push(s);
    }
    argv
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
                ty: ParamType::String,
                description: String::new(),
                required: true,
                default: None,
                path: Some(PathRole::Output),
                mode: None,
            },
        );
        params.insert(
            "n".to_string(),
            Param {
                ty: ParamType::Integer,
                description: String::new(),
                required: false,
                default: Some(3.into()),
                path: None,
                mode: None,
            },
        );
        Tool {
            name: "t".into(),
            description: String::new(),
            capability: Capability::Write,
            exec: None,
            builtin: None,
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
        assert_eq!(e, "argument \"out\" must be a string, not an integer");
        let e = validate(
            &t,
            &obj(serde_json::json!({"session": "s", "out": "a", "x": 1})),
        )
        .unwrap_err();
        assert!(e.starts_with("unknown argument \"x\""), "{e}");
        let e = validate(&t, &obj(serde_json::json!({"out": "a"}))).unwrap_err();
        assert!(e.contains("\"session\""), "{e}");
        let e = validate(&t, &obj(serde_json::json!({"session": "s"}))).unwrap_err();
        assert_eq!(e, "missing required argument \"out\"");
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
