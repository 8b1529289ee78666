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

/// The most bytes a secret argument may have: a token or a password, not data. It bounds
/// the work of scrubbing (every message of the call is searched for every form of it) and
/// fits an environment variable.
pub const MAX_SECRET_ARG: usize = 4096;

/// One form of one secret (as is, or escaped). Its occurrences in a text, and its fragments
/// at a cut, are found by KMP in one linear scan, with a prefix table of at most as many
/// entries as the text has bytes (built per scan, so a long secret costs no memory beyond
/// the text being scrubbed).
#[derive(Debug)]
struct Form {
    text: Box<[u8]>,
}

impl Form {
    fn new(text: &str) -> Form {
        Form {
            text: text.as_bytes().into(),
        }
    }

    /// Marks in `mask` every occurrence of the form in `s` (overlapping ones too) and, when
    /// `cut_end`, the longest prefix of it that `s` ends with.
    fn mark(&self, s: &[u8], cut_end: bool, mask: &mut [bool]) {
        let m = self.text.len();
        // A form longer than `s` cannot occur in it whole; a prefix of it can end it.
        let p = &self.text[..m.min(s.len())];
        if p.is_empty() {
            return;
        }
        let pi = prefix_function(p);
        let whole = p.len() == m;
        let mut q = 0usize;
        // Where this form's marks end: overlapping occurrences mark each byte once.
        let mut marked = 0usize;
        for (i, &b) in s.iter().enumerate() {
            // Here q < p.len(): a whole match resets it, and a prefix of `p` as long as `s`
            // is reached only at its last byte.
            while q > 0 && p[q] != b {
                q = pi[q - 1] as usize;
            }
            if p[q] == b {
                q += 1;
            }
            if whole && q == m {
                let from = (i + 1 - m).max(marked);
                mask[from..=i].iter_mut().for_each(|x| *x = true);
                marked = i + 1;
                q = pi[q - 1] as usize;
            }
        }
        if cut_end && q > 0 {
            let n = s.len();
            mask[n - q..].iter_mut().for_each(|x| *x = true);
        }
    }

    /// Marks in `mask` the longest suffix of the form that `s` begins with.
    fn mark_start(&self, s: &[u8], mask: &mut [bool]) {
        // The longest prefix of `s[..k]` that is a suffix of the form is, reversed, the
        // longest suffix of `s[..k]` reversed that is a prefix of the form's last `k` bytes
        // reversed: one KMP scan of `s[..k]` backwards.
        let m = self.text.len();
        let k = s.len().min(m);
        if k == 0 {
            return;
        }
        let r: Vec<u8> = self.text[m - k..].iter().rev().copied().collect();
        let pi = prefix_function(&r);
        let mut q = 0usize;
        for &b in s[..k].iter().rev() {
            while q > 0 && r[q] != b {
                q = pi[q - 1] as usize;
            }
            if r[q] == b {
                q += 1;
            }
        }
        mask[..q].iter_mut().for_each(|x| *x = true);
    }
}

/// The KMP prefix function: `pi[i]`, the length of the longest proper prefix of `p[..=i]`
/// that is also its suffix.
fn prefix_function(p: &[u8]) -> Box<[u32]> {
    let mut pi = vec![0u32; p.len()];
    let mut k = 0usize;
    for i in 1..p.len() {
        while k > 0 && p[i] != p[k] {
            k = pi[k - 1] as usize;
        }
        if p[i] == p[k] {
            k += 1;
        }
        pi[i] = k as u32;
    }
    pi.into()
}

/// The largest char boundary of `s` at or below `at`.
fn floor_boundary(s: &str, at: usize) -> usize {
    let mut at = at.min(s.len());
    while !s.is_char_boundary(at) {
        at -= 1;
    }
    at
}

/// The smallest char boundary of `s` at or above `at`.
fn ceil_boundary(s: &str, at: usize) -> usize {
    let mut at = at.min(s.len());
    while !s.is_char_boundary(at) {
        at += 1;
    }
    at
}

/// The secret values of one call (empty for most calls), shared by everything that records
/// or reports on it.
///
/// The rule every text of the call passes: each occurrence of a secret, in any of its forms
/// (as is, escaped as Rust's `{:?}` does and as JSON does), overlapping and repeated ones
/// included, is replaced by [`REDACTED`] (a run of them, or of overlapping ones, by one
/// marker). A text is scrubbed whole before it is cut ([`Secrets::head`],
/// [`Secrets::tail`], [`Secrets::shown`]), and at each cut any fragment of a secret is
/// replaced too: the longest prefix of a form the kept text ends with at the cut, the
/// longest suffix it begins with at the cut, however short, one character included. So no
/// character of a secret that reached a text survives next to a cut (at the price of the
/// odd character of ordinary text that happens to match a secret's first or last one).
#[derive(Debug, Clone, Default)]
pub struct Secrets(Arc<[Form]>);

impl Secrets {
    /// The values of `tool`'s secret parameters in `args` (strings only: the loader refuses
    /// `secret` on other types), in every form a message could quote them: as is, escaped as
    /// Rust's `{:?}` does and as JSON does. A value over [`MAX_SECRET_ARG`] bytes is taken
    /// too (the call is refused, and its refusal is scrubbed of it); it costs no more than
    /// its forms, since no table is kept.
    pub fn of(tool: &Tool, args: &Map<String, Value>) -> Secrets {
        let mut texts: Vec<String> = Vec::new();
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
                if !texts.contains(&form) {
                    texts.push(form);
                }
            }
        }
        Secrets(texts.iter().map(|t| Form::new(t)).collect())
    }

    pub fn is_empty(&self) -> bool {
        self.0.is_empty()
    }

    /// `s` with every occurrence of a secret replaced by [`REDACTED`] and, where `s` begins
    /// (`cut_start`) or ends (`cut_end`) at a cut, any fragment of one at that edge.
    pub fn redact_cut(&self, s: &str, cut_start: bool, cut_end: bool) -> String {
        if self.is_empty() {
            return s.to_string();
        }
        let bytes = s.as_bytes();
        let mut mask = vec![false; bytes.len()];
        for f in self.0.iter() {
            f.mark(bytes, cut_end, &mut mask);
            if cut_start {
                f.mark_start(bytes, &mut mask);
            }
        }
        let mut out = String::with_capacity(s.len());
        let mut at = 0;
        while at < bytes.len() {
            let Some(from) = mask[at..].iter().position(|&x| x).map(|i| at + i) else {
                out.push_str(&s[at..]);
                break;
            };
            // A marked byte marks its whole character.
            let from = floor_boundary(s, from);
            out.push_str(&s[at..from]);
            let mut to = from;
            while to < bytes.len() && (mask[to] || !s.is_char_boundary(to)) {
                to += 1;
            }
            let to = ceil_boundary(s, to);
            out.push_str(REDACTED);
            at = to;
        }
        out
    }

    /// `s` with every secret replaced by [`REDACTED`].
    pub fn scrub_str(&self, s: &str) -> String {
        self.redact_cut(s, false, false)
    }

    /// `s` scrubbed whole, then cut to its first `max` bytes (on a char boundary) with any
    /// fragment of a secret at the cut replaced; with the bytes of the scrubbed text cut off
    /// (0: nothing was cut). `cut_end`: `s` itself already ends at a cut (a capped capture).
    pub fn head(&self, s: &str, max: usize, cut_end: bool) -> (String, usize) {
        let clean = self.redact_cut(s, false, cut_end);
        if clean.len() <= max {
            return (clean, 0);
        }
        let end = floor_boundary(&clean, max);
        (
            self.redact_cut(&clean[..end], false, true),
            clean.len() - end,
        )
    }

    /// `s` scrubbed whole, then cut to its last `max` bytes (on a char boundary) with any
    /// fragment of a secret at the cut replaced; with the bytes of the scrubbed text cut off.
    /// `cut_end`: `s` itself already ends at a cut (a capped capture).
    pub fn tail(&self, s: &str, max: usize, cut_end: bool) -> (String, usize) {
        let clean = self.redact_cut(s, false, cut_end);
        if clean.len() <= max {
            return (clean, 0);
        }
        let start = ceil_boundary(&clean, clean.len() - max);
        (self.redact_cut(&clean[start..], true, false), start)
    }

    /// A client's or a tool's string as an error message may quote it: scrubbed, quoted, and
    /// cut (with its length) when long, so that no error echoes megabytes back. The cut is
    /// made on the scrubbed text and cleaned of fragments before it is escaped.
    pub fn shown(&self, s: &str) -> String {
        const KEEP: usize = 48;
        let clean = self.scrub_str(s);
        if clean.len() <= 2 * KEEP {
            return self.scrub_str(&format!("{clean:?}"));
        }
        let (kept, _) = self.head(&clean, KEEP, false);
        self.scrub_str(&format!("{kept:?}... ({} bytes)", s.len()))
    }

    /// Scrubs every string in `v` (keys included).
    pub fn scrub(&self, v: &mut Value) {
        if self.is_empty() {
            return;
        }
        match v {
            Value::String(s) => *s = self.scrub_str(s),
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
                    secret,
                    ..Param::of(ParamType::String)
                },
            );
        }
        t
    }

    /// A `Secrets` of these values (each a secret parameter of its own).
    fn secrets(values: &[&str]) -> Secrets {
        let mut t = builtins()["session_get"].clone();
        let mut args = Map::new();
        for (i, v) in values.iter().enumerate() {
            let name = format!("s{i}");
            t.params.insert(
                name.clone(),
                Param {
                    secret: true,
                    ..Param::of(ParamType::String)
                },
            );
            args.insert(name, json!(v));
        }
        Secrets::of(&t, &args)
    }

    #[test]
    fn overlapping_and_repeated_secrets_are_replaced_whole() {
        let s = secrets(&["abcd", "cdef"]);
        // One overlaps the other: neither leaves a piece ("ef" of the second).
        assert_eq!(s.scrub_str("x abcdef y"), "x [REDACTED] y");
        // Repeated, adjacent and overlapping occurrences of one secret.
        assert_eq!(s.scrub_str("abcdabcd-abcd"), "[REDACTED]-[REDACTED]");
        let p = secrets(&["aa"]);
        assert_eq!(p.scrub_str("baaab"), "b[REDACTED]b");
        // Multi-byte characters are replaced whole.
        assert_eq!(secrets(&["é"]).scrub_str("aéb"), "a[REDACTED]b");
    }

    #[test]
    fn a_fragment_at_a_cut_is_replaced_however_short() {
        let s = secrets(&["hunter2"]);
        // Scrubbed whole before the cut: the cut falls in the marker, not the secret.
        let (head, cut) = s.head("token hunter2 rest", 9, false);
        assert_eq!((head.as_str(), cut), ("token [RE", 12));
        // A text that already ends at a cut (a capped capture) ending in a prefix of it.
        assert_eq!(s.head("token hunt", 100, true).0, "token [REDACTED]");
        assert_eq!(s.head("token h", 100, true).0, "token [REDACTED]");
        // A tail that begins with a suffix of it (in a text that holds only the suffix).
        assert_eq!(s.tail("xxxter2 rest", 9, false).0, "[REDACTED] rest");
        assert_eq!(s.tail("x2 rest", 6, false).0, "[REDACTED] rest");
        // A secret longer than the text: the whole text is a fragment at either cut.
        let long = secrets(&["abcdefgh"]);
        assert_eq!(long.head("abc", 100, true).0, "[REDACTED]");
        assert_eq!(long.redact_cut("fgh xyz", true, false), "[REDACTED] xyz");
        assert_eq!(long.redact_cut("xyz", true, true), "xyz");
        // No cut: a prefix at the end is ordinary text.
        assert_eq!(s.head("token hunt", 100, false).0, "token hunt");
        // The escaped forms too: a prefix of the JSON form at the cut.
        let q = secrets(&["a\"b"]);
        assert_eq!(q.head("say a\\", 100, true).0, "say [REDACTED]");
    }

    #[test]
    fn shown_cuts_the_scrubbed_text_and_cleans_the_cut() {
        let secret = "S".repeat(80);
        let s = secrets(&[&secret]);
        // A key holding the secret past the excerpt's cut.
        let key = format!("{}{secret}", "k".repeat(30));
        let shown = s.shown(&key);
        assert!(!shown.contains("SS"), "{shown}");
        assert!(
            shown.starts_with(&format!("\"{}[REDACTED]", "k".repeat(30))),
            "{shown}"
        );
        // A text that holds only a long prefix of the secret (40 bytes) at the cut.
        let partial = format!("{}{}", "k".repeat(8), &secret[..70]);
        let shown = s.shown(&format!("{partial}{}", "z".repeat(60)));
        assert!(!shown.contains("SS"), "{shown}");
        // Without secrets it is the plain excerpt.
        assert_eq!(Secrets::default().shown("ab"), "\"ab\"");
    }

    /// A secret's characters (and those of its escaped forms), none of which ordinary text,
    /// the filler, or the marker holds.
    const SECRET_CHARS: &[char] = &['a', 'b', 'é', '"', '\n', '\\', 'n'];

    fn secret_value() -> impl proptest::strategy::Strategy<Value = String> {
        proptest::string::string_regex("[abé\"\n\\\\]{1,6}").expect("regex")
    }

    proptest::proptest! {
        /// For random secrets (overlapping each other, repeated), texts holding them in every
        /// form between filler, a cut before scrubbing (a capped capture) and a cut after:
        /// no character of a secret survives in a head or a tail.
        #[test]
        fn no_fragment_survives_a_cut(
            values in proptest::collection::vec(secret_value(), 1..3),
            chunks in proptest::collection::vec(
                (0usize..3, 0usize..3, "[0-9 ]{0,5}"), 0..12),
            pre_cut in 0usize..400,
            max in 0usize..64,
        ) {
            let refs: Vec<&str> = values.iter().map(String::as_str).collect();
            let s = secrets(&refs);
            let mut text = String::new();
            for (which, form, filler) in &chunks {
                text.push_str(filler);
                let v = &values[which % values.len()];
                let debug = format!("{v:?}");
                let json = Value::String(v.clone()).to_string();
                text.push_str(match form {
                    0 => v.as_str(),
                    1 => &debug[1..debug.len() - 1],
                    _ => &json[1..json.len() - 1],
                });
            }
            let whole = s.scrub_str(&text);
            proptest::prop_assert!(!whole.contains(SECRET_CHARS), "{text:?} -> {whole:?}");
            let pre = floor_boundary(&text, pre_cut);
            let capped = &text[..pre];
            let cut_end = pre < text.len();
            for (out, _) in [s.head(capped, max, cut_end), s.tail(capped, max, cut_end)] {
                proptest::prop_assert!(
                    !out.contains(SECRET_CHARS),
                    "{capped:?} (cut at {max}) -> {out:?}"
                );
            }
        }
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
