//! Audit evidence: one event per step of each call, in the order of the execution model
//! (see [`Event`]), written to a durable, hash-chained JSON Lines log ([`log`]) and kept
//! in an in-memory ring served as the `airlock://audit/events` resource.
//!
//! Bounded by construction: every string an event carries is truncated (with a marker) to
//! [`MAX_STRING`] bytes before it is stored, an event is at most [`MAX_EVENT`] bytes, the ring
//! keeps at most `audit_ring` events and `audit_ring_bytes` bytes (the oldest go first), and
//! a reader gets the newest events up to a byte budget, never a copy of the whole ring.
//!
//! Durability: every event is written to the log as it happens (one `write(2)`); the events a
//! decision depends on (the `commit` of a mutating call, before its commit point, and what
//! recovery appends) are also fsynced before [`Audit::record_durable`] returns. Concurrent
//! durable events share one fsync (group commit): a caller whose line an fsync already
//! covered returns without one.

pub mod deny;
pub mod event;
pub mod log;
pub mod time;

use std::borrow::Cow;
use std::collections::VecDeque;
use std::sync::Mutex;

use serde::Serialize;
use serde_json::Value;

use crate::policy::redact::Secrets;

pub use event::{Event, EventKind};
pub use time::{format_rfc3339, now_ms, parse_since, SinceError};
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

/// [`truncate`] for a string of a call with `secrets`: scrubbed whole before the cut, and
/// any fragment of a secret at the cut replaced ([`Secrets::head`]).
fn truncate_scrubbed<'a>(s: &'a str, max: usize, secrets: &Secrets) -> Cow<'a, str> {
    if s.len() <= max {
        return Cow::Borrowed(s);
    }
    let (kept, cut) = secrets.head(s, max, false);
    Cow::Owned(format!("{kept}…[truncated {cut} bytes]"))
}

/// Truncates every string in `v` (keys included) to [`MAX_STRING`] bytes, each cut clean of
/// `secrets`.
fn bound_strings(v: &mut Value, depth: usize, secrets: &Secrets) {
    match v {
        Value::String(s) => {
            if let Cow::Owned(t) = truncate_scrubbed(s, MAX_STRING, secrets) {
                *s = t;
            }
        }
        Value::Array(a) => {
            for x in a {
                bound_strings(x, depth + 1, secrets);
            }
        }
        Value::Object(m) if depth < 32 => {
            if m.keys().any(|k| k.len() > MAX_STRING) {
                let old = std::mem::take(m);
                for (k, x) in old {
                    m.insert(truncate_scrubbed(&k, MAX_STRING, secrets).into_owned(), x);
                }
            }
            for x in m.values_mut() {
                bound_strings(x, depth + 1, secrets);
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

/// One step of one call: one line of the log.
#[derive(Debug, Clone, Serialize)]
pub struct Line {
    /// Position in the log: one per line, headers included (the genesis header is 0), never
    /// reused across restarts.
    pub seq: u64,
    /// RFC 3339, UTC, milliseconds.
    pub time: String,
    /// Milliseconds since the Unix epoch (what `since` compares).
    pub time_ms: u64,
    /// The execution job id: one per call (the job dir's name for a mutating call).
    pub job: String,
    /// The MCP request id the client gave the call.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub request_id: Option<Value>,
    pub tool: String,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub session: Option<String>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub principal: Option<Principal>,
    pub kind: EventKind,
    #[serde(skip_serializing_if = "Value::is_null")]
    pub detail: Value,
    /// SHA-256 (hex) of the previous line of the log.
    pub prev: String,
}

/// What every event of one call shares.
#[derive(Debug, Clone)]
pub struct CallRef {
    /// The execution job id.
    pub call: String,
    pub tool: String,
    pub session: Option<String>,
    pub principal: Option<Principal>,
    /// The call's secret argument values: scrubbed from every event's detail.
    pub secrets: crate::policy::redact::Secrets,
    /// The client's JSON-RPC id of the `tools/call`.
    pub request_id: Option<Value>,
}

#[derive(Debug, thiserror::Error)]
pub enum AuditError {
    #[error(transparent)]
    Log(#[from] log::LogError),
    #[error("audit write refused by a failpoint")]
    Failpoint(#[source] std::io::Error),
}

/// Which events a reader wants: the resource's template variables and `airlock audit`'s
/// flags.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Filter {
    pub job: Option<String>,
    pub session: Option<String>,
    pub tool: Option<String>,
    /// Events at or after this time (milliseconds since the epoch).
    pub since_ms: Option<u64>,
    /// At most this many (the newest).
    pub limit: Option<usize>,
}

impl Filter {
    fn accepts(&self, job: &str, tool: &str, session: Option<&str>, time_ms: u64) -> bool {
        self.job.as_deref().is_none_or(|j| j == job)
            && self.tool.as_deref().is_none_or(|t| t == tool)
            && self.session.as_deref().is_none_or(|s| Some(s) == session)
            && self.since_ms.is_none_or(|t| time_ms >= t)
    }

    /// Whether a parsed event (a line of the log) passes.
    pub fn matches(&self, v: &Value) -> bool {
        let s = |k: &str| v.get(k).and_then(Value::as_str);
        self.accepts(
            s("job").unwrap_or(""),
            s("tool").unwrap_or(""),
            s("session"),
            v.get("time_ms").and_then(Value::as_u64).unwrap_or(0),
        )
    }
}

/// One event in the ring, with what filters compare.
struct Entry {
    text: Box<str>,
    job: Box<str>,
    tool: Box<str>,
    session: Option<Box<str>>,
    time_ms: u64,
}

impl Entry {
    /// What the entry costs the ring's byte budget: its text and its keys.
    fn bytes(&self) -> usize {
        self.text.len()
            + self.job.len()
            + self.tool.len()
            + self.session.as_ref().map_or(0, |s| s.len())
            + std::mem::size_of::<Entry>()
    }
}

/// The ring: serialized events, oldest first, and their total size.
struct Ring {
    events: VecDeque<Entry>,
    bytes: usize,
}

/// The writer: the chain's head and the log file, behind one lock so that seq, `prev` and
/// the order of lines agree.
struct Writer {
    head: log::Head,
    log: Option<log::Log>,
    /// Lines written to the log so far (this run), for group commit.
    written: u64,
}

pub struct Audit {
    ring: Mutex<Ring>,
    writer: Mutex<Writer>,
    /// Lines known durable (group commit): one fsync covers every line written before it.
    synced: Mutex<u64>,
    capacity: usize,
    max_bytes: usize,
    /// The newest seq, for `notifications/resources/updated`.
    updates: tokio::sync::watch::Sender<u64>,
    /// The bound on `deny` events per uid ([`deny`]).
    denials: Mutex<deny::Limiter>,
}

impl Audit {
    /// A ring of at most `capacity` events and `max_bytes` bytes of serialized events, with
    /// no log (unit tests, and tools that only read).
    pub fn new(capacity: usize, max_bytes: usize) -> Audit {
        Audit::build(capacity, max_bytes, None, log::Head::default())
    }

    /// As [`Audit::new`], writing every event to `log` from where its chain stands.
    pub fn with_log(capacity: usize, max_bytes: usize, log: log::Log, head: log::Head) -> Audit {
        Audit::build(capacity, max_bytes, Some(log), head)
    }

    fn build(capacity: usize, max_bytes: usize, log: Option<log::Log>, head: log::Head) -> Audit {
        Audit {
            ring: Mutex::new(Ring {
                events: VecDeque::with_capacity(capacity.min(1024)),
                bytes: 0,
            }),
            writer: Mutex::new(Writer {
                head,
                log,
                written: 0,
            }),
            synced: Mutex::new(0),
            capacity: capacity.max(1),
            max_bytes: max_bytes.max(MAX_EVENT),
            updates: tokio::sync::watch::channel(0).0,
            denials: Mutex::new(deny::Limiter::default()),
        }
    }

    /// Watches the newest seq (changes with every event).
    pub fn subscribe(&self) -> tokio::sync::watch::Receiver<u64> {
        self.updates.subscribe()
    }

    /// Records one event. A log write failure is logged (the event is then in neither the
    /// log nor the ring): only [`Audit::record_durable`] events decide anything.
    ///
    /// A `deny` goes through its uid's bound ([`deny`]): over it, the denial is counted and
    /// written later in an aggregated `deny`. Every event of another kind first writes the
    /// aggregates pending.
    pub fn record(&self, call: &CallRef, event: Event) {
        let kind = event.kind();
        if kind == EventKind::Deny {
            let d = self.denials.lock().unwrap_or_else(|p| p.into_inner()).deny(
                call.principal.as_ref(),
                &call.tool,
                event.deny_code(),
                now_ms(),
            );
            if let Some(a) = d.aggregate {
                self.record_aggregate(a);
            }
            if !d.write {
                return;
            }
        } else {
            self.flush_denials();
        }
        if let Err(e) = self.append(call, kind, event.detail(), false) {
            tracing::error!(call = %call.call, %kind, error = %crate::report::chain(&e), "cannot write an audit event to the log");
        }
    }

    /// Writes every pending aggregate of denials.
    pub fn flush_denials(&self) {
        let pending = self
            .denials
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .flush(now_ms());
        for a in pending {
            self.record_aggregate(a);
        }
    }

    fn record_aggregate(&self, a: deny::Pending) {
        let call = CallRef {
            call: "-".into(),
            tool: "-".into(),
            session: None,
            principal: a.principal.clone(),
            secrets: Default::default(),
            request_id: None,
        };
        if let Err(e) = self.append(&call, EventKind::Deny, a.event().detail(), false) {
            tracing::error!(count = a.count, error = %crate::report::chain(&e), "cannot write an aggregated deny to the audit log");
        }
    }

    /// Records one event and returns once it is durable in the log (fsynced, possibly by
    /// another caller's fsync). On `Err` the caller must not act on the event (a `commit`
    /// rolls back, and its `rollback` follows): when the write failed, the event is in neither
    /// the log nor the ring; when the fsync failed, it may be in both, not durable.
    pub fn record_durable(&self, call: &CallRef, event: Event) -> Result<(), AuditError> {
        self.flush_denials();
        self.append(call, event.kind(), event.detail(), true)
    }

    fn append(
        &self,
        call: &CallRef,
        kind: EventKind,
        mut detail: Value,
        durable: bool,
    ) -> Result<(), AuditError> {
        call.secrets.scrub(&mut detail);
        bound_strings(&mut detail, 0, &call.secrets);
        let bound = |s: &str| truncate(s, MAX_STRING).into_owned();
        let mut request_id = call.request_id.clone();
        if let Some(r) = &mut request_id {
            bound_strings(r, 0, &call.secrets);
        }
        let time_ms = now_ms();
        let mut guard = self.writer.lock().unwrap_or_else(|p| p.into_inner());
        let w = &mut *guard;
        let mut event = Line {
            seq: w.head.next_seq,
            time: format_rfc3339(time_ms),
            time_ms,
            job: bound(&call.call),
            request_id,
            tool: bound(&call.tool),
            session: call.session.as_deref().map(bound),
            principal: call.principal.as_ref().map(|p| Principal {
                client: p.client.as_deref().map(bound),
                ..p.clone()
            }),
            kind,
            detail,
            prev: w.head.prev.clone(),
        };
        tracing::debug!(job = %event.job, tool = %event.tool, %kind, "audit");
        // The text of the event at the chain's head `h` (a rotation moves the head past the
        // new file's header, so the text is built again).
        let mut make = |h: &log::Head| {
            event.seq = h.next_seq;
            event.prev = h.prev.clone();
            let text = visible_json(serde_json::to_string(&event).unwrap_or_default());
            if text.len() <= MAX_EVENT {
                return text;
            }
            let mut cut = event.clone();
            cut.detail =
                serde_json::json!({"truncated": format!("detail of {} bytes dropped", text.len())});
            visible_json(serde_json::to_string(&cut).unwrap_or_default())
        };
        let text = match &mut w.log {
            Some(log) => {
                if durable {
                    crate::failpoint::hit("audit.durable_write").map_err(AuditError::Failpoint)?;
                }
                let text = log.append(&mut w.head, &mut make)?;
                w.written += 1;
                text
            }
            None => {
                let text = make(&w.head);
                w.head = log::Head {
                    next_seq: w.head.next_seq + 1,
                    prev: log::sha256_hex(text.as_bytes()),
                };
                text
            }
        };
        let entry = Entry {
            text: text.into_boxed_str(),
            job: event.job.into_boxed_str(),
            tool: event.tool.into_boxed_str(),
            session: event.session.map(String::into_boxed_str),
            time_ms,
        };
        {
            // Under the writer's lock: the ring's order is the log's.
            let mut ring = self.ring.lock().unwrap_or_else(|p| p.into_inner());
            ring.bytes += entry.bytes();
            ring.events.push_back(entry);
            while ring.events.len() > self.capacity || ring.bytes > self.max_bytes {
                match ring.events.pop_front() {
                    Some(old) => ring.bytes -= old.bytes(),
                    None => break,
                }
            }
        }
        let mine = w.written;
        drop(guard);
        self.updates.send_replace(event.seq);
        if durable {
            self.sync(mine)?;
        }
        Ok(())
    }

    /// Makes every line up to the `upto`-th durable: one fsync covers every line written
    /// before it, so concurrent callers share it.
    fn sync(&self, upto: u64) -> Result<(), AuditError> {
        let mut synced = self.synced.lock().unwrap_or_else(|p| p.into_inner());
        if *synced >= upto {
            return Ok(());
        }
        let (file, path, written) = {
            let w = self.writer.lock().unwrap_or_else(|p| p.into_inner());
            match &w.log {
                Some(l) => (l.file(), l.path().to_path_buf(), w.written),
                None => return Ok(()),
            }
        };
        // Rotation fsyncs the file it retires, so this file's fsync covers every line up to
        // `written`.
        file.sync_data().map_err(|source| log::LogError::Io {
            op: "fsync",
            path,
            source,
        })?;
        *synced = written;
        Ok(())
    }

    /// The newest events that pass `filter` and whose serialized size fits `budget` bytes,
    /// as a JSON array, oldest first. Only the returned text is built; the ring is not copied.
    pub fn newest_json(&self, budget: usize, filter: &Filter) -> String {
        let ring = self.ring.lock().unwrap_or_else(|p| p.into_inner());
        let mut size = 2;
        let mut picked: Vec<&Entry> = Vec::new();
        let limit = filter.limit.unwrap_or(usize::MAX);
        for e in ring.events.iter().rev() {
            if picked.len() >= limit {
                break;
            }
            if !filter.accepts(&e.job, &e.tool, e.session.as_deref(), e.time_ms) {
                continue;
            }
            if size + e.text.len() + 1 > budget {
                break;
            }
            size += e.text.len() + 1;
            picked.push(e);
        }
        let mut out = String::with_capacity(size);
        out.push('[');
        for (i, e) in picked.iter().rev().enumerate() {
            if i > 0 {
                out.push(',');
            }
            out.push_str(&e.text);
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

impl Drop for Audit {
    /// The denials still counted are written before the log closes.
    fn drop(&mut self) {
        self.flush_denials();
    }
}

/// JSON text with every character that would not show as itself (DEL, C1 controls,
/// bidirectional controls, zero-width and other invisible characters: those Rust's `{:?}`
/// escapes) written as a `\uXXXX` escape. serde_json escapes only U+0000-U+001F, so a
/// client's U+202E would otherwise sit raw in the log and in `airlock audit`'s output; the
/// escape is the same JSON value, so readers and `verify` see no difference. Such characters
/// can only stand inside JSON strings, where the escape is valid.
fn visible_json(text: String) -> String {
    let hidden =
        |c: char| c == '\u{7f}' || (!c.is_ascii() && c.escape_debug().next() == Some('\\'));
    if !text.chars().any(hidden) {
        return text;
    }
    let mut out = String::with_capacity(text.len() + 16);
    for c in text.chars() {
        if hidden(c) {
            let mut units = [0u16; 2];
            for u in c.encode_utf16(&mut units) {
                // Writing to a String cannot fail.
                let _ = std::fmt::Write::write_fmt(&mut out, format_args!("\\u{u:04x}"));
            }
        } else {
            out.push(c);
        }
    }
    out
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
            request_id: None,
        }
    }

    /// An event with no fields of its own (its detail is `{}`).
    fn start() -> Event {
        Event::Start(event::Start::default())
    }

    /// A commit as recovery records it.
    fn commit() -> Event {
        Event::Commit(event::Commit::Recovered(event::Recovery {
            recovery: true,
            phase: None,
            action: "test".into(),
            kept: None,
        }))
    }

    /// A `deny` of a call with `code` and `message`.
    fn deny(code: &str, message: String) -> Event {
        Event::Deny(event::Deny::Call {
            code: code.into(),
            message: Some(message),
            phase: None,
        })
    }

    fn seqs(a: &Audit, budget: usize) -> Vec<u64> {
        let v: Vec<Value> =
            serde_json::from_str(&a.newest_json(budget, &Filter::default())).unwrap();
        v.iter().map(|e| e["seq"].as_u64().unwrap()).collect()
    }

    #[test]
    fn ring_keeps_the_newest() {
        let a = Audit::new(2, 1 << 20);
        for _ in 0..3 {
            a.record(&call(), start());
        }
        assert_eq!(seqs(&a, usize::MAX), vec![1, 2]);
    }

    #[test]
    fn the_ring_stays_within_its_byte_bound_over_100000_events() {
        // 100,000 events of 100,000 jobs, details of varying size; the bound is checked
        // after every one.
        let bound = 256 * 1024;
        let a = Audit::new(usize::MAX, bound);
        let mut peak = 0;
        for i in 0..100_000u64 {
            let c = CallRef {
                call: format!("job-{i}"),
                ..call()
            };
            let mut every = event::tests::samples(&"x".repeat((i % 700) as usize));
            let n = every.len();
            a.record(&c, every.swap_remove(i as usize % n));
            peak = peak.max(a.usage().1);
        }
        assert!(peak <= bound, "the ring held {peak} bytes, over {bound}");
        let (n, _) = a.usage();
        assert!(n > 100, "only {n} events kept");
        let newest: Vec<Value> =
            serde_json::from_str(&a.newest_json(usize::MAX, &Filter::default())).unwrap();
        assert_eq!(newest.last().unwrap()["job"], "job-99999");
        assert_eq!(newest.last().unwrap()["seq"], 99_999);
    }

    #[test]
    fn filters_pick_job_tool_session_since_and_limit() {
        let a = Audit::new(1000, 1 << 20);
        for i in 0..10 {
            let c = CallRef {
                call: format!("j{}", i % 3),
                tool: if i % 2 == 0 {
                    "even".into()
                } else {
                    "odd".into()
                },
                session: Some(format!("s{}", i % 2)),
                ..call()
            };
            a.record(&c, start());
        }
        let get = |f: Filter| -> Vec<u64> {
            let v: Vec<Value> = serde_json::from_str(&a.newest_json(usize::MAX, &f)).unwrap();
            v.iter().map(|e| e["seq"].as_u64().unwrap()).collect()
        };
        let f = |job: Option<&str>, tool: Option<&str>, session: Option<&str>| Filter {
            job: job.map(Into::into),
            tool: tool.map(Into::into),
            session: session.map(Into::into),
            ..Filter::default()
        };
        assert_eq!(get(f(Some("j1"), None, None)), vec![1, 4, 7]);
        assert_eq!(get(f(None, Some("odd"), None)), vec![1, 3, 5, 7, 9]);
        assert_eq!(get(f(None, None, Some("s0"))), vec![0, 2, 4, 6, 8]);
        assert_eq!(get(f(Some("j1"), Some("odd"), None)), vec![1, 7]);
        assert_eq!(
            get(Filter {
                limit: Some(2),
                ..Filter::default()
            }),
            vec![8, 9]
        );
        assert_eq!(
            get(Filter {
                since_ms: Some(now_ms() + 60_000),
                ..Filter::default()
            }),
            Vec::<u64>::new()
        );
    }

    #[test]
    fn the_log_gets_every_event_chained_and_durable_ones_fail_loudly() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("audit.jsonl");
        let (l, head) = log::Log::open(&path, 1 << 20, 2).unwrap();
        let a = Audit::with_log(100, 1 << 20, l, head);
        a.record(&call(), start());
        a.record_durable(&call(), commit()).unwrap();
        let v = log::verify(&path).unwrap();
        // The genesis header is seq 0, the events 1 and 2.
        assert_eq!(
            (v.lines, v.events, v.first_seq, v.last_seq),
            (3, 2, Some(0), Some(2))
        );
        let ring: Vec<Value> =
            serde_json::from_str(&a.newest_json(usize::MAX, &Filter::default())).unwrap();
        let file: Vec<Value> = std::fs::read_to_string(&path)
            .unwrap()
            .lines()
            .skip(1)
            .map(|l| serde_json::from_str(l).unwrap())
            .collect();
        assert_eq!(ring, file);
        // A sink that fails (a real device that refuses every write): the durable event
        // is refused, and it is in neither the log nor the ring.
        let full = std::fs::File::options()
            .append(true)
            .open("/dev/full")
            .unwrap();
        let (l2, head2) = log::Log::open(&dir.path().join("b.jsonl"), 1 << 20, 2).unwrap();
        let b = Audit::with_log(100, 1 << 20, l2.replace_file_for_test(full), head2);
        assert!(b.record_durable(&call(), commit()).is_err());
        assert_eq!(b.usage().0, 0);
    }

    /// 20,000 denials of one uid do not push a commit out of the ring or the log, and every
    /// denial is counted: the ones written one by one plus the aggregates' counts.
    #[test]
    fn a_flood_of_denials_is_bounded_and_counted() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("audit.jsonl");
        let (l, head) = log::Log::open(&path, 1 << 20, 1).unwrap();
        let a = Audit::with_log(1000, 1 << 20, l, head);
        a.record_durable(&call(), commit()).unwrap();
        let nobody = CallRef {
            principal: Some(Principal {
                uid: 65534,
                gid: 65534,
                pid: None,
                client: None,
                groups: vec![],
            }),
            ..call()
        };
        for _ in 0..20_000 {
            a.record(&nobody, deny("TOOL_FORBIDDEN", String::new()));
        }
        // The next event of another kind writes the aggregate first.
        a.record(&call(), start());
        let lines: Vec<Value> = std::fs::read_to_string(&path)
            .unwrap()
            .lines()
            .map(|l| serde_json::from_str(l).unwrap())
            .collect();
        assert!(lines.len() < 100, "{} lines", lines.len());
        let denied: u64 = lines
            .iter()
            .filter(|e| e["kind"] == "deny")
            .map(|e| e["detail"]["aggregated"]["count"].as_u64().unwrap_or(1))
            .sum();
        assert_eq!(denied, 20_000);
        assert!(lines.iter().any(|e| e["kind"] == "commit"));
        let ring: Vec<Value> =
            serde_json::from_str(&a.newest_json(usize::MAX, &Filter::default())).unwrap();
        assert!(ring.iter().any(|e| e["kind"] == "commit"));
        assert_eq!(log::verify(&path).unwrap().events, lines.len() as u64 - 1);
    }

    #[test]
    fn ring_is_bounded_in_bytes() {
        let a = Audit::new(1_000_000, 64 * 1024);
        for _ in 0..10_000 {
            a.record(
                &call(),
                Event::Allow(event::Allow {
                    capability: "read",
                    arguments: serde_json::json!({"x": "y".repeat(500)}),
                    timeout_ms: None,
                    idempotency_key: None,
                }),
            );
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
            a.record(&call(), start());
        }
        let text = a.newest_json(1000, &Filter::default());
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
            request_id: Some(Value::String("r".repeat(1 << 20))),
        };
        a.record(
            &c,
            Event::Allow(event::Allow {
                capability: "read",
                arguments: serde_json::json!({"why": "w".repeat(1 << 20), "k".repeat(5000): 1}),
                timeout_ms: None,
                idempotency_key: None,
            }),
        );
        let text = a.newest_json(usize::MAX, &Filter::default());
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
        assert!(v[0]["detail"]["arguments"]["why"].as_str().unwrap().len() < 2 * MAX_STRING);
    }

    #[test]
    fn oversized_details_are_replaced_by_a_marker() {
        let a = Audit::new(10, 1 << 20);
        let many: Vec<String> = (0..100).map(|_| "x".repeat(1000)).collect();
        a.record(
            &call(),
            Event::Allow(event::Allow {
                capability: "read",
                arguments: serde_json::json!({ "list": many }),
                timeout_ms: None,
                idempotency_key: None,
            }),
        );
        let v: Vec<Value> =
            serde_json::from_str(&a.newest_json(usize::MAX, &Filter::default())).unwrap();
        assert!(v[0]["detail"]["truncated"]
            .as_str()
            .unwrap()
            .contains("dropped"));
    }

    #[test]
    fn invisible_characters_are_escaped_in_the_log_and_read_back_the_same() {
        let value = "a\u{202e}b\u{200b}c\u{7f}d\u{85}e\u{e0001}f é \\ \"";
        let text = visible_json(serde_json::to_string(&serde_json::json!({"v": value})).unwrap());
        assert!(text.chars().all(|c| c == 'é' || c.is_ascii()), "{text}");
        assert!(
            text.contains("\\u202e") && text.contains("\\udb40\\udc01"),
            "{text}"
        );
        assert!(
            text.contains('é'),
            "printable characters stay as they are: {text}"
        );
        let back: serde_json::Value = serde_json::from_str(&text).unwrap();
        assert_eq!(back["v"], value);
    }
}
