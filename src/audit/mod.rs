//! Audit evidence: one event per step of each call, kept in an in-memory ring and served as
//! the `airlock://audit/events` resource.
//!
//! Bounded by construction: every string an event carries is truncated (with a marker) to
//! [`MAX_STRING`] bytes before it is stored, an event is at most [`MAX_EVENT`] bytes, the ring
//! keeps at most `audit_ring` events and `audit_ring_bytes` bytes (the oldest go first), and
//! a reader gets the newest events up to a byte budget, never a copy of the whole ring.

use std::borrow::Cow;
use std::collections::VecDeque;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Mutex;
use std::time::{SystemTime, UNIX_EPOCH};

use serde::Serialize;
use serde_json::Value;

/// The longest string an audit event keeps; longer ones are cut and marked.
pub const MAX_STRING: usize = 1024;
/// The largest serialized event; an event whose detail makes it larger keeps a marker instead.
pub const MAX_EVENT: usize = 16 * 1024;

/// `s` cut to at most `max` bytes (on a character boundary) plus a marker saying how many
/// bytes were cut; `s` itself when it fits.
pub fn truncate(s: &str, max: usize) -> Cow<'_, str> {
    if s.len() <= max {
        return Cow::Borrowed(s);
    }
    let mut end = max;
    while !s.is_char_boundary(end) {
        end -= 1;
    }
    Cow::Owned(format!("{}…[truncated {} bytes]", &s[..end], s.len() - end))
}

/// Truncates every string in `v` (keys included) to [`MAX_STRING`] bytes.
fn bound_strings(v: &mut Value, depth: usize) {
    match v {
        Value::String(s) => {
            if let Cow::Owned(t) = truncate(s, MAX_STRING) {
                *s = t;
            }
        }
        Value::Array(a) => {
            for x in a {
                bound_strings(x, depth + 1);
            }
        }
        Value::Object(m) if depth < 32 => {
            if m.keys().any(|k| k.len() > MAX_STRING) {
                let old = std::mem::take(m);
                for (k, x) in old {
                    m.insert(truncate(&k, MAX_STRING).into_owned(), x);
                }
            }
            for x in m.values_mut() {
                bound_strings(x, depth + 1);
            }
        }
        Value::Object(_) => *v = Value::String("…[nested too deep]".into()),
        _ => {}
    }
}

/// Who made a call: the socket peer's credentials (SO_PEERCRED) and its MCP clientInfo.
#[derive(Debug, Clone, Serialize, PartialEq, Eq)]
pub struct Principal {
    pub uid: u32,
    pub gid: u32,
    pub pid: Option<i32>,
    pub client: Option<String>,
    /// The peer's supplementary groups (SO_PEERGROUPS), for group grants; not recorded.
    #[serde(skip)]
    pub groups: Vec<u32>,
}

impl Principal {
    /// Every group id the principal holds: its primary gid and its supplementary groups.
    pub fn gids(&self) -> Vec<u32> {
        let mut g = Vec::with_capacity(self.groups.len() + 1);
        g.push(self.gid);
        g.extend(self.groups.iter().copied().filter(|x| *x != self.gid));
        g
    }
}

/// One step of one call.
#[derive(Debug, Clone, Serialize)]
pub struct Event {
    pub seq: u64,
    /// Milliseconds since the Unix epoch.
    pub time_ms: u64,
    /// The call's id (also its job id for mutating calls).
    pub call: String,
    pub tool: String,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub session: Option<String>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub principal: Option<Principal>,
    /// `allow`, `deny`, `locked`, `spawned`, `sandbox`, `published`, `commit`, `rollback`,
    /// `timeout`, `cancelled`, `failed`, `done`.
    pub kind: &'static str,
    #[serde(skip_serializing_if = "Value::is_null")]
    pub detail: Value,
}

/// What every event of one call shares.
#[derive(Debug, Clone)]
pub struct CallRef {
    pub call: String,
    pub tool: String,
    pub session: Option<String>,
    pub principal: Option<Principal>,
    /// The call's secret argument values: scrubbed from every event's detail.
    pub secrets: crate::policy::redact::Secrets,
}

/// The ring: serialized events, oldest first, and their total size.
struct Ring {
    events: VecDeque<Box<str>>,
    bytes: usize,
}

pub struct Audit {
    ring: Mutex<Ring>,
    capacity: usize,
    max_bytes: usize,
    seq: AtomicU64,
}

impl Audit {
    /// A ring of at most `capacity` events and `max_bytes` bytes of serialized events.
    pub fn new(capacity: usize, max_bytes: usize) -> Audit {
        Audit {
            ring: Mutex::new(Ring {
                events: VecDeque::with_capacity(capacity.min(1024)),
                bytes: 0,
            }),
            capacity: capacity.max(1),
            max_bytes: max_bytes.max(MAX_EVENT),
            seq: AtomicU64::new(0),
        }
    }

    pub fn record(&self, call: &CallRef, kind: &'static str, mut detail: Value) {
        call.secrets.scrub(&mut detail);
        bound_strings(&mut detail, 0);
        let bound = |s: &str| truncate(s, MAX_STRING).into_owned();
        let mut event = Event {
            seq: self.seq.fetch_add(1, Ordering::SeqCst),
            time_ms: SystemTime::now()
                .duration_since(UNIX_EPOCH)
                .map_or(0, |d| d.as_millis() as u64),
            call: bound(&call.call),
            tool: bound(&call.tool),
            session: call.session.as_deref().map(bound),
            principal: call.principal.as_ref().map(|p| Principal {
                client: p.client.as_deref().map(bound),
                ..p.clone()
            }),
            kind,
            detail,
        };
        tracing::debug!(call = %event.call, tool = %event.tool, kind, "audit");
        let mut text = serde_json::to_string(&event).unwrap_or_default();
        if text.len() > MAX_EVENT {
            event.detail =
                serde_json::json!({"truncated": format!("detail of {} bytes dropped", text.len())});
            text = serde_json::to_string(&event).unwrap_or_default();
        }
        let mut ring = self.ring.lock().unwrap_or_else(|p| p.into_inner());
        ring.bytes += text.len();
        ring.events.push_back(text.into_boxed_str());
        while ring.events.len() > self.capacity || ring.bytes > self.max_bytes {
            match ring.events.pop_front() {
                Some(old) => ring.bytes -= old.len(),
                None => break,
            }
        }
    }

    /// The newest events whose serialized size fits `budget` bytes, as a JSON array, oldest
    /// first. Only the returned text is built; the ring is not copied.
    pub fn newest_json(&self, budget: usize) -> String {
        let ring = self.ring.lock().unwrap_or_else(|p| p.into_inner());
        let mut size = 2;
        let mut first = ring.events.len();
        for e in ring.events.iter().rev() {
            if size + e.len() + 1 > budget {
                break;
            }
            size += e.len() + 1;
            first -= 1;
        }
        let mut out = String::with_capacity(size);
        out.push('[');
        for (i, e) in ring.events.range(first..).enumerate() {
            if i > 0 {
                out.push(',');
            }
            out.push_str(e);
        }
        out.push(']');
        out
    }

    /// How many events and bytes the ring holds now.
    pub fn usage(&self) -> (usize, usize) {
        let ring = self.ring.lock().unwrap_or_else(|p| p.into_inner());
        (ring.events.len(), ring.bytes)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn call() -> CallRef {
        CallRef {
            call: "c".into(),
            tool: "t".into(),
            session: None,
            principal: None,
            secrets: Default::default(),
        }
    }

    fn seqs(a: &Audit, budget: usize) -> Vec<u64> {
        let v: Vec<Value> = serde_json::from_str(&a.newest_json(budget)).unwrap();
        v.iter().map(|e| e["seq"].as_u64().unwrap()).collect()
    }

    #[test]
    fn ring_keeps_the_newest() {
        let a = Audit::new(2, 1 << 20);
        for _ in 0..3 {
            a.record(&call(), "allow", Value::Null);
        }
        assert_eq!(seqs(&a, usize::MAX), vec![1, 2]);
    }

    #[test]
    fn ring_is_bounded_in_bytes() {
        let a = Audit::new(1_000_000, 64 * 1024);
        for _ in 0..10_000 {
            a.record(&call(), "allow", serde_json::json!({"x": "y".repeat(500)}));
        }
        let (n, bytes) = a.usage();
        assert!(bytes <= 64 * 1024, "ring holds {bytes} bytes");
        assert!(n > 50 && n < 200, "ring holds {n} events");
        // The newest survive.
        assert_eq!(*seqs(&a, usize::MAX).last().unwrap(), 9_999);
    }

    #[test]
    fn a_reader_gets_the_newest_within_its_budget() {
        let a = Audit::new(100, 1 << 20);
        for _ in 0..100 {
            a.record(&call(), "allow", Value::Null);
        }
        let text = a.newest_json(1000);
        assert!(text.len() <= 1000, "{} bytes", text.len());
        let s = seqs(&a, 1000);
        assert!(!s.is_empty() && s.len() < 100);
        assert_eq!(*s.last().unwrap(), 99);
        assert!(s.windows(2).all(|w| w[0] + 1 == w[1]), "{s:?}");
        assert_eq!(seqs(&a, 1), Vec::<u64>::new());
    }

    #[test]
    fn client_strings_are_truncated_with_a_marker() {
        let a = Audit::new(10, 1 << 20);
        let c = CallRef {
            call: "c".into(),
            tool: "t".into(),
            session: Some("s".repeat(3 << 20)),
            principal: Some(Principal {
                uid: 1,
                gid: 1,
                pid: None,
                client: Some("é".repeat(1 << 20)),
                groups: Vec::new(),
            }),
            secrets: Default::default(),
        };
        a.record(
            &c,
            "deny",
            serde_json::json!({"why": "w".repeat(1 << 20), "k".repeat(5000): 1}),
        );
        let text = a.newest_json(usize::MAX);
        assert!(text.len() < MAX_EVENT, "{} bytes", text.len());
        let v: Vec<Value> = serde_json::from_str(&text).unwrap();
        let session = v[0]["session"].as_str().unwrap();
        assert!(
            session.starts_with("sss")
                && session.ends_with(&format!("…[truncated {} bytes]", (3 << 20) - MAX_STRING)),
            "{session}"
        );
        let client = v[0]["principal"]["client"].as_str().unwrap();
        assert!(
            client.starts_with('é') && client.contains("…[truncated"),
            "{client}"
        );
        assert!(v[0]["detail"]["why"].as_str().unwrap().len() < 2 * MAX_STRING);
    }

    #[test]
    fn oversized_details_are_replaced_by_a_marker() {
        let a = Audit::new(10, 1 << 20);
        let many: Vec<String> = (0..100).map(|_| "x".repeat(1000)).collect();
        a.record(&call(), "failed", serde_json::json!({ "list": many }));
        let v: Vec<Value> = serde_json::from_str(&a.newest_json(usize::MAX)).unwrap();
        assert!(v[0]["detail"]["truncated"]
            .as_str()
            .unwrap()
            .contains("dropped"));
    }
}
