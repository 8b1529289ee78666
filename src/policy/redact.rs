//! Secret parameters: a parameter declared `secret = true` reaches the worker unchanged, but
//! its value never reaches an audit event, a log line or an error message. [`redact`] is
//! what records a call's arguments; [`Secrets`] scrubs any text the daemon builds for a call
//! (a tool's stderr quoted in a fault, a path error, an audit detail).

use std::sync::Arc;

use serde_json::{Map, Value};

use super::model::Tool;

/// What stands in for a secret value.
pub const REDACTED: &str = "[REDACTED]";

/// The arguments as they may be recorded: every secret parameter's value replaced.
pub fn redact(tool: &Tool, args: &Map<String, Value>) -> Value {
    Value::Object(
        args.iter()
            .map(|(k, v)| {
                let secret = tool.params.get(k).is_some_and(|p| p.secret);
                let v = if secret {
                    Value::String(REDACTED.into())
                } else {
                    v.clone()
                };
                (k.clone(), v)
            })
            .collect(),
    )
}

/// The arguments as the audit's `allow` event records them: [`redact`]ed, and every value
/// whose JSON is longer than `max` bytes replaced by its size, so an event never echoes a
/// client's long (or oversized, soon refused) value.
pub fn summary(tool: &Tool, args: &Map<String, Value>, max: usize) -> Value {
    let mut v = redact(tool, args);
    if let Value::Object(m) = &mut v {
        for x in m.values_mut() {
            let len = x.to_string().len();
            if len > max {
                *x = Value::String(format!("[{len} bytes]"));
            }
        }
    }
    v
}

/// The secret values of one call (empty for most calls), shared by everything that records
/// or reports on it.
#[derive(Debug, Clone, Default)]
pub struct Secrets(Arc<[String]>);

impl Secrets {
    /// The values of `tool`'s secret parameters in `args` (strings only: the loader refuses
    /// `secret` on other types), in every form a message could quote them: as is, escaped as
    /// Rust's `{:?}` does and as JSON does. Longest first, so a secret that contains another
    /// is replaced whole.
    pub fn of(tool: &Tool, args: &Map<String, Value>) -> Secrets {
        let mut out: Vec<String> = Vec::new();
        for (name, p) in &tool.params {
            if !p.secret {
                continue;
            }
            let Some(s) = args.get(name).and_then(Value::as_str) else {
                continue;
            };
            if s.is_empty() {
                continue;
            }
            let debug = format!("{s:?}");
            let json = Value::String(s.to_string()).to_string();
            for form in [
                s.to_string(),
                debug[1..debug.len() - 1].to_string(),
                json[1..json.len() - 1].to_string(),
            ] {
                if !out.contains(&form) {
                    out.push(form);
                }
            }
        }
        out.sort_by_key(|s| std::cmp::Reverse(s.len()));
        Secrets(out.into())
    }

    pub fn is_empty(&self) -> bool {
        self.0.is_empty()
    }

    /// `s` with every secret replaced by [`REDACTED`].
    pub fn scrub_str(&self, s: &str) -> String {
        let mut out = s.to_string();
        for secret in self.0.iter() {
            if out.contains(secret.as_str()) {
                out = out.replace(secret.as_str(), REDACTED);
            }
        }
        out
    }

    /// Scrubs every string in `v` (keys included).
    pub fn scrub(&self, v: &mut Value) {
        if self.is_empty() {
            return;
        }
        match v {
            Value::String(s) if self.0.iter().any(|x| s.contains(x.as_str())) => {
                *s = self.scrub_str(s);
            }
            Value::Array(a) => a.iter_mut().for_each(|x| self.scrub(x)),
            Value::Object(m) => {
                let old = std::mem::take(m);
                for (k, mut x) in old {
                    self.scrub(&mut x);
                    m.insert(self.scrub_str(&k), x);
                }
            }
            _ => {}
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::policy::{builtins, Param, ParamType};
    use serde_json::json;

    fn tool() -> Tool {
        let mut t = builtins()["session_get"].clone();
        for (name, secret) in [("token", true), ("note", false)] {
            t.params.insert(
                name.into(),
                Param {
                    ty: ParamType::String,
                    description: String::new(),
                    required: false,
                    default: None,
                    path: None,
                    mode: None,
                    secret,
                },
            );
        }
        t
    }

    #[test]
    fn redacts_secret_params_only() {
        let args = json!({"token": "hunter2", "note": "hi", "session": "s"});
        let r = redact(&tool(), args.as_object().unwrap());
        assert_eq!(r, json!({"token": REDACTED, "note": "hi", "session": "s"}));
    }

    #[test]
    fn summary_never_echoes_a_long_value() {
        let long = "x".repeat(1000);
        let args = json!({"token": "hunter2", "note": long, "session": "s"});
        let r = summary(&tool(), args.as_object().unwrap(), 128);
        assert_eq!(
            r,
            json!({"token": REDACTED, "note": "[1002 bytes]", "session": "s"})
        );
    }

    #[test]
    fn scrubs_every_quoted_form() {
        let args = json!({"token": "a\"b\nc", "note": "a"});
        let s = Secrets::of(&tool(), args.as_object().unwrap());
        let raw = "x a\"b\nc y";
        assert_eq!(s.scrub_str(raw), "x [REDACTED] y");
        let debug = format!("{:?}", "a\"b\nc");
        assert!(!s.scrub_str(&debug).contains("a\\\"b"), "{debug}");
        let mut v = json!({"message": raw, "list": [raw], raw: 1});
        s.scrub(&mut v);
        assert!(!v.to_string().contains("a\\\"b\\nc"), "{v}");
        assert!(v.to_string().contains(REDACTED));
        // A non-secret value is left alone.
        assert_eq!(s.scrub_str("a note"), "a note");
    }
}
