//! Newline-delimited JSON-RPC framing between a socket and rmcp, with every check rmcp
//! leaves silent or gets wrong, so that every bad line gets an error and the connection
//! keeps working:
//!
//! - a line over the size limit is discarded as it arrives (never held whole) and answered
//!   with Invalid Request;
//! - invalid UTF-8, JSON nested deeper than [`MAX_DEPTH`] (checked by a flat scan before any
//!   parser recurses) and a line that is not JSON are answered with an error;
//! - a message that is not a JSON-RPC 2.0 object, or that rmcp could not read, is answered
//!   with an error under its id, read by a tolerant scan of the line when the line is not
//!   JSON at all; only a notification gets no reply, as JSON-RPC requires;
//! - request ids: each request is handed to rmcp under an id of the daemon's own ([`Ids`]),
//!   mapped back on the reply. A second request with the id of one still in flight is
//!   rejected (rmcp alone would overwrite the first's bookkeeping and drop a reply), and a
//!   connection has at most `max_requests_per_connection` requests in flight;
//! - clientInfo: its strings are cut to [`MAX_CLIENT_FIELD`] bytes by one function
//!   ([`bound_client_info`]) before rmcp sees them, both in `initialize` (2025 era) and in a
//!   2026-07-28 request's `_meta`; `initialize` params are bounded in size. The first client
//!   name a connection presents is its name for good ([`ClientName`]).
//!
//! Outgoing lines go through an [`OutQueue`] bounded in bytes; [`write_lines`] gives each
//! line a write timeout. Exceeding either drops the connection (the caller's decision).

use std::collections::HashMap;
use std::ops::Range;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use serde_json::{json, Value};
use tokio::io::{AsyncBufReadExt, AsyncRead, AsyncWrite, AsyncWriteExt, BufReader};
use tokio::sync::{mpsc, Notify};
use tokio_util::sync::CancellationToken;

use super::cancel::Calls;
use crate::audit::truncate;

/// The deepest nesting of arrays and objects a message may have.
pub const MAX_DEPTH: usize = 64;
/// The longest string request id the daemon accepts or echoes.
pub const MAX_ID_BYTES: usize = 256;
/// clientInfo strings (name, version, title, ...) are cut to this many bytes.
pub const MAX_CLIENT_FIELD: usize = 256;
/// The `_meta` key under which a 2026-07-28 request carries its clientInfo.
pub const META_CLIENT_INFO: &str = "io.modelcontextprotocol/clientInfo";
/// The largest `initialize` params (after clientInfo truncation), which rmcp keeps for the
/// connection's lifetime.
pub const MAX_INIT_PARAMS: usize = 64 * 1024;
/// How much of an oversized line is kept to find its id.
const OVERSIZED_PREFIX: usize = 4096;
/// The longest error message echoed to a client (parser messages quote the input).
const MAX_ERROR_MESSAGE: usize = 512;

/// What the reader found.
#[derive(Debug, PartialEq)]
pub enum Frame {
    /// One complete line, without its newline.
    Line(Vec<u8>),
    /// A line longer than the limit, discarded; its first bytes, to find its id.
    Oversized(Vec<u8>),
    Eof,
}

pub struct LineReader<R> {
    inner: BufReader<R>,
    limit: usize,
    buf: Vec<u8>,
}

impl<R: AsyncRead + Unpin> LineReader<R> {
    pub fn new(inner: R, limit: usize) -> Self {
        LineReader {
            inner: BufReader::with_capacity(64 * 1024, inner),
            limit,
            buf: Vec::new(),
        }
    }

    /// The next non-blank line; never holds more than `limit` bytes of one line in memory.
    /// A last line without a newline is incomplete (the peer went away mid-message): Eof.
    pub async fn next(&mut self) -> std::io::Result<Frame> {
        loop {
            self.buf.clear();
            let mut oversized = false;
            loop {
                let chunk = self.inner.fill_buf().await?;
                if chunk.is_empty() {
                    return Ok(Frame::Eof);
                }
                let newline = chunk.iter().position(|b| *b == b'\n');
                let take = newline.map_or(chunk.len(), |i| i + 1);
                let part = &chunk[..newline.unwrap_or(chunk.len())];
                if oversized {
                    let room = OVERSIZED_PREFIX.saturating_sub(self.buf.len());
                    self.buf.extend_from_slice(&part[..part.len().min(room)]);
                } else if self.buf.len() + part.len() > self.limit {
                    oversized = true;
                    self.buf.truncate(OVERSIZED_PREFIX);
                    let room = OVERSIZED_PREFIX.saturating_sub(self.buf.len());
                    self.buf.extend_from_slice(&part[..part.len().min(room)]);
                } else {
                    self.buf.extend_from_slice(part);
                }
                self.inner.consume(take);
                if newline.is_some() {
                    break;
                }
            }
            if oversized {
                return Ok(Frame::Oversized(std::mem::take(&mut self.buf)));
            }
            if trim(&self.buf).is_empty() {
                continue;
            }
            return Ok(Frame::Line(std::mem::take(&mut self.buf)));
        }
    }
}

fn trim(b: &[u8]) -> &[u8] {
    let end = b
        .iter()
        .rposition(|c| !c.is_ascii_whitespace())
        .map_or(0, |i| i + 1);
    let start = b[..end]
        .iter()
        .position(|c| !c.is_ascii_whitespace())
        .unwrap_or(end);
    &b[start..end]
}

// ---- a tolerant scan of a line's top level ------------------------------------------------

/// Where a line's top-level members are, as far as a flat, non-recursive scan can tell; it
/// stops at the first thing that is not JSON, so it also works on a prefix or a line with
/// invalid UTF-8 or deep nesting elsewhere.
#[derive(Debug, Default, PartialEq)]
pub struct TopLevel {
    /// The byte range of the value of `"id"`.
    pub id: Option<Range<usize>>,
    /// The byte range of the value of `"method"`.
    pub method: Option<Range<usize>>,
    /// Whether a `"result"` or `"error"` member was seen.
    pub reply: bool,
}

fn skip_ws(b: &[u8], mut i: usize) -> usize {
    while b.get(i).is_some_and(|c| c.is_ascii_whitespace()) {
        i += 1;
    }
    i
}

/// `b[i]` is `"`: the index just past the closing quote.
fn string_end(b: &[u8], i: usize) -> Option<usize> {
    let mut j = i + 1;
    while j < b.len() {
        match b[j] {
            b'\\' => j += 2,
            b'"' => return Some(j + 1),
            _ => j += 1,
        }
    }
    None
}

/// The index just past the value starting at `b[i]`.
fn value_end(b: &[u8], i: usize) -> Option<usize> {
    match b.get(i)? {
        b'"' => string_end(b, i),
        b'{' | b'[' => {
            let mut depth = 0usize;
            let mut j = i;
            while j < b.len() {
                match b[j] {
                    b'"' => {
                        j = string_end(b, j)?;
                        continue;
                    }
                    b'{' | b'[' => depth += 1,
                    b'}' | b']' => {
                        depth -= 1;
                        if depth == 0 {
                            return Some(j + 1);
                        }
                    }
                    _ => {}
                }
                j += 1;
            }
            None
        }
        _ => {
            let mut j = i;
            while j < b.len() && !matches!(b[j], b',' | b'}' | b']') && !b[j].is_ascii_whitespace()
            {
                j += 1;
            }
            (j > i).then_some(j)
        }
    }
}

pub fn scan_top(b: &[u8]) -> TopLevel {
    let mut t = TopLevel::default();
    let mut i = skip_ws(b, 0);
    if b.get(i) != Some(&b'{') {
        return t;
    }
    i += 1;
    loop {
        i = skip_ws(b, i);
        if b.get(i) != Some(&b'"') {
            return t;
        }
        let Some(key_end) = string_end(b, i) else {
            return t;
        };
        let key = &b[i + 1..key_end - 1];
        i = skip_ws(b, key_end);
        if b.get(i) != Some(&b':') {
            return t;
        }
        i = skip_ws(b, i + 1);
        let start = i;
        let Some(end) = value_end(b, i) else {
            return t;
        };
        match key {
            b"id" => t.id = Some(start..end),
            b"method" => t.method = Some(start..end),
            b"result" | b"error" => t.reply = true,
            _ => {}
        }
        i = skip_ws(b, end);
        if b.get(i) != Some(&b',') {
            return t;
        }
        i += 1;
    }
}

/// Whether arrays and objects nest deeper than `limit` (outside strings), by a flat scan.
pub fn too_deep(b: &[u8], limit: usize) -> bool {
    let mut depth = 0usize;
    let mut i = 0;
    while i < b.len() {
        match b[i] {
            b'"' => match string_end(b, i) {
                Some(j) => {
                    i = j;
                    continue;
                }
                None => return false,
            },
            b'{' | b'[' => {
                depth += 1;
                if depth > limit {
                    return true;
                }
            }
            b'}' | b']' => depth = depth.saturating_sub(1),
            _ => {}
        }
        i += 1;
    }
    false
}

/// An id that may be echoed in a reply: a string of at most [`MAX_ID_BYTES`] or an integer;
/// anything else is answered under `null`.
fn echoable(id: &Value) -> Value {
    match id {
        Value::String(s) if s.len() <= MAX_ID_BYTES => id.clone(),
        Value::Number(n) if n.is_i64() || n.is_u64() => id.clone(),
        _ => Value::Null,
    }
}

/// The id of a line that could not be read as a whole, when the scan finds one.
pub fn recover_id(line: &[u8]) -> Value {
    scan_top(line)
        .id
        .and_then(|r| serde_json::from_slice::<Value>(&line[r]).ok())
        .map_or(Value::Null, |id| echoable(&id))
}

/// A JSON-RPC error as one line. An id that cannot be recovered (`null`) is left out, as
/// the MCP schema has it (its error's `id` is a string or a number, or absent), never sent
/// as `"id": null`.
pub fn error_line(id: &Value, code: i64, message: &str) -> Vec<u8> {
    let message = truncate(message, MAX_ERROR_MESSAGE);
    let mut v = json!({"jsonrpc": "2.0", "error": {"code": code, "message": message}});
    if !id.is_null() {
        v["id"] = id.clone();
    }
    let mut line = v.to_string().into_bytes();
    line.push(b'\n');
    line
}

// ---- request ids ---------------------------------------------------------------------------

/// What to do with one incoming line.
#[derive(Debug, PartialEq)]
pub enum Inbound {
    /// Hand this line (newline included) to rmcp.
    Forward(Vec<u8>),
    /// Answer the client with this line; rmcp never sees the message.
    Reply(Vec<u8>),
    /// Nothing: a notification that is not for rmcp (JSON-RPC never answers one).
    Ignore,
}

/// The requests in flight on one connection, under the client's ids and the daemon's.
pub struct Ids {
    by_client: HashMap<String, u64>,
    /// The client's id, the request's size in bytes, and whether it is a `tools/call`.
    by_internal: HashMap<u64, (Value, usize, bool)>,
    /// The connection's cancellable calls, shared with the handler.
    calls: Arc<Calls>,
    /// An `initialize` was passed on.
    initialized: bool,
    /// The connection's client name, shared with the handler.
    client: Arc<ClientName>,
    next: u64,
    max_in_flight: usize,
    /// The size of the requests in flight, and its bound.
    bytes: usize,
    max_bytes: usize,
    last_activity: Instant,
}

impl Ids {
    /// At most `max_in_flight` requests in flight, of at most `max_bytes` together (one
    /// request of any size may always be in flight alone).
    pub fn new(max_in_flight: usize, max_bytes: usize) -> Ids {
        Ids {
            by_client: HashMap::new(),
            by_internal: HashMap::new(),
            next: 1,
            max_in_flight: max_in_flight.max(1),
            bytes: 0,
            max_bytes,
            last_activity: Instant::now(),
            calls: Arc::new(Calls::default()),
            initialized: false,
            client: Arc::new(ClientName::default()),
        }
    }

    /// As if `initialize` had been passed on (unit tests of what follows the handshake).
    #[cfg(test)]
    pub fn after_handshake(mut self) -> Ids {
        self.initialized = true;
        self
    }

    /// The connection's cancellable calls, for the handler.
    pub fn calls(&self) -> Arc<Calls> {
        self.calls.clone()
    }

    /// The connection's client name, for the handler.
    pub fn client_name(&self) -> Arc<ClientName> {
        self.client.clone()
    }

    /// Whether a request of `len` bytes would exceed the in-flight caps.
    pub fn full(&self, len: usize) -> bool {
        self.by_client.len() >= self.max_in_flight
            || (self.bytes > 0 && self.bytes + len > self.max_bytes)
    }

    /// How long the connection has had nothing in flight and received no message (zero
    /// while a request is in flight).
    pub fn idle_for(&self) -> Duration {
        if self.by_client.is_empty() {
            self.last_activity.elapsed()
        } else {
            Duration::ZERO
        }
    }

    /// Decides about one complete line from the client.
    pub fn inbound(&mut self, raw: &[u8]) -> Inbound {
        self.last_activity = Instant::now();
        let line = trim(raw);
        if line.is_empty() {
            return Inbound::Ignore;
        }
        let reply = |id: &Value, code, msg: &str| Inbound::Reply(error_line(id, code, msg));
        if let Err(e) = std::str::from_utf8(line) {
            let msg = format!("Parse error: invalid UTF-8 at byte {}", e.valid_up_to());
            return reply(&recover_id(line), -32700, &msg);
        }
        if too_deep(line, MAX_DEPTH) {
            let msg = format!("Invalid Request: JSON nested deeper than {MAX_DEPTH} levels");
            return reply(&recover_id(line), -32600, &msg);
        }
        let v: Value = match serde_json::from_slice(line) {
            Ok(v) => v,
            Err(e) => return reply(&recover_id(line), -32700, &format!("Parse error: {e}")),
        };
        let Some(obj) = v.as_object() else {
            if let Some(batch) = v.as_array() {
                // Each request of the batch is refused under its own id, so that a client
                // waiting on any of them hears why; a batch with none gets one error.
                let msg = "Invalid Request: batches are not supported (MCP removed JSON-RPC batching); send one message per line";
                let mut lines: Vec<u8> = batch
                    .iter()
                    .filter(|m| m.get("method").is_some())
                    .filter_map(|m| m.get("id").map(echoable))
                    .filter(|id| !id.is_null())
                    .flat_map(|id| error_line(&id, -32600, msg))
                    .collect();
                if lines.is_empty() {
                    lines = error_line(&Value::Null, -32600, msg);
                }
                return Inbound::Reply(lines);
            }
            return reply(
                &Value::Null,
                -32600,
                "Invalid Request: a message must be a JSON object",
            );
        };
        let id = obj.get("id").cloned();
        let echo = id.as_ref().map_or(Value::Null, echoable);
        if obj.get("jsonrpc").and_then(Value::as_str) != Some("2.0") {
            return reply(
                &echo,
                -32600,
                "Invalid Request: \"jsonrpc\" must be \"2.0\"",
            );
        }
        match (obj.get("method"), id) {
            (Some(Value::String(m)), Some(id)) => {
                let method = m.clone();
                self.request(v, id, &method)
            }
            (Some(Value::String(m)), None) => {
                let method = m.clone();
                self.notification(v, &method)
            }
            (Some(_), _) => reply(&echo, -32600, "Invalid Request: \"method\" must be a string"),
            (None, Some(_)) if obj.contains_key("result") || obj.contains_key("error") => {
                // A reply to a request of the server's: rmcp matches it or ignores it.
                match checked(&v) {
                    Ok(line) => Inbound::Forward(line),
                    Err(_) => Inbound::Ignore,
                }
            }
            (None, _) => reply(
                &echo,
                -32600,
                "Invalid Request: a message needs a \"method\", or a \"result\" or \"error\" and an \"id\"",
            ),
        }
    }

    fn request(&mut self, mut v: Value, id: Value, method: &str) -> Inbound {
        let reply = |id: &Value, code, msg: &str| Inbound::Reply(error_line(id, code, msg));
        if echoable(&id).is_null() {
            return reply(
                &Value::Null,
                -32600,
                &format!("Invalid Request: \"id\" must be an integer or a string of at most {MAX_ID_BYTES} bytes"),
            );
        }
        let key = id.to_string();
        if self.by_client.contains_key(&key) {
            return reply(
                &id,
                -32600,
                &format!(
                    "Invalid Request: id {} is already in flight on this connection; use a new id",
                    match &id {
                        Value::String(s) => crate::exec::args::shown(s),
                        other => other.to_string(),
                    }
                ),
            );
        }
        if self.by_client.len() >= self.max_in_flight {
            return reply(
                &id,
                -32000,
                &format!(
                    "too many requests in flight on this connection (max_requests_per_connection = {}); wait for a reply",
                    self.max_in_flight
                ),
            );
        }
        if method == "initialize" {
            if let Err(msg) = bound_initialize(&mut v) {
                return reply(&id, -32600, &msg);
            }
            self.initialized = true;
        } else if !self.initialized
            && !matches!(method, "ping" | "server/discover")
            && v["params"].get("_meta").is_none()
        {
            // rmcp would answer with a complaint about `_meta` keys a 2025-era client never
            // sent; a request that carries no `_meta` is a client that skipped the handshake.
            return reply(
                &id,
                -32600,
                &format!(
                    "Invalid Request: {} before initialize; send initialize first (then notifications/initialized)",
                    crate::exec::args::shown(method)
                ),
            );
        }
        if method == "tools/call" {
            if let Err(msg) = check_call_params(&v["params"]) {
                return reply(&id, -32602, &msg);
            }
        }
        // A 2026-07-28 request names its client in every request's `_meta`: cut like the
        // handshake's.
        if let Some(info) = v
            .get_mut("params")
            .and_then(|p| p.get_mut("_meta"))
            .and_then(|m| m.get_mut(META_CLIENT_INFO))
            .and_then(Value::as_object_mut)
        {
            bound_client_info(info);
        }
        let internal = self.next;
        v["id"] = json!(internal);
        let line = match checked(&v) {
            Ok(line) => line,
            Err(e) => return reply(&id, -32602, &format!("Invalid params: {e}")),
        };
        self.next += 1;
        self.bytes += line.len();
        let info = if method == "initialize" {
            &v["params"]["clientInfo"]
        } else {
            &v["params"]["_meta"][META_CLIENT_INFO]
        };
        if let Some(name) = info.get("name").and_then(Value::as_str) {
            self.client.present(name);
        }
        if method == "tools/call" {
            self.calls.note_client_id(internal, id.clone());
        }
        self.by_client.insert(key, internal);
        self.by_internal
            .insert(internal, (id, line.len(), method == "tools/call"));
        Inbound::Forward(line)
    }

    fn notification(&mut self, mut v: Value, method: &str) -> Inbound {
        if method == "notifications/cancelled" {
            let key = v["params"]["requestId"].to_string();
            let Some(&internal) = self.by_client.get(&key) else {
                return Inbound::Ignore;
            };
            if self.by_internal.get(&internal).is_some_and(|e| e.2) {
                // A tools/call: the executor decides (see `cancel`), and its reply, or its
                // silence, frees the id. rmcp never hears of it: it would drop the result of
                // a call that is already past its point of no return.
                self.calls.cancel(internal);
                return Inbound::Ignore;
            }
            // Any other request: rmcp sends nothing for it, so the client may use the id
            // again.
            self.by_client.remove(&key);
            if let Some((_, len, _)) = self.by_internal.remove(&internal) {
                self.bytes -= len;
            }
            v["params"]["requestId"] = json!(internal);
        }
        match checked(&v) {
            Ok(line) => Inbound::Forward(line),
            Err(e) => {
                tracing::debug!(method, "ignored a notification rmcp cannot read: {e}");
                Inbound::Ignore
            }
        }
    }

    /// Maps a line from rmcp back to the client's id; `None` for the reply to a request the
    /// client cancelled and that ended cancelled (a call past its point of no return is
    /// answered: see `cancel`).
    pub fn outbound(&mut self, line: Vec<u8>) -> Option<Vec<u8>> {
        let top = scan_top(&line);
        let (Some(r), None, true) = (top.id, top.method, top.reply) else {
            return Some(line);
        };
        let Some(internal) = std::str::from_utf8(&line[r.clone()])
            .ok()
            .and_then(|s| s.parse::<u64>().ok())
        else {
            return Some(line);
        };
        let (client, len, _) = self.by_internal.remove(&internal)?;
        self.bytes -= len;
        let client = client.to_string();
        self.by_client.remove(&client);
        self.last_activity = Instant::now();
        if self.calls.take_silent(internal) {
            // A call its client cancelled, rolled back: JSON-RPC answers it with nothing.
            return None;
        }
        let mut out = Vec::with_capacity(line.len() + client.len());
        out.extend_from_slice(&line[..r.start]);
        out.extend_from_slice(client.as_bytes());
        out.extend_from_slice(&line[r.end..]);
        Some(out)
    }
}

/// The message as one line, if rmcp can read it as a client message (what rmcp itself
/// would answer with a `null` id is answered here under the request's id instead).
fn checked(v: &Value) -> Result<Vec<u8>, serde_json::Error> {
    let mut line = serde_json::to_vec(v)?;
    serde_json::from_slice::<rmcp::model::ClientJsonRpcMessage>(&line)?;
    line.push(b'\n');
    Ok(line)
}

/// `tools/call` params rmcp would take for some other method (and answer -32601): a
/// `name` string and, if present, an `arguments` object.
fn check_call_params(params: &Value) -> Result<(), String> {
    let Some(p) = params.as_object() else {
        return Err(
            "Invalid params: tools/call needs params {\"name\": ..., \"arguments\": {...}}".into(),
        );
    };
    match p.get("name") {
        Some(Value::String(_)) => {}
        Some(_) => return Err("Invalid params: tools/call \"name\" must be a string".into()),
        None => {
            return Err(
                "Invalid params: tools/call needs a \"name\" (tools/list names the tools)".into(),
            )
        }
    }
    match p.get("arguments") {
        None | Some(Value::Object(_)) => Ok(()),
        Some(_) => Err("Invalid params: tools/call \"arguments\" must be an object".into()),
    }
}

/// Cuts every string of a clientInfo object (name, version, title, description,
/// websiteUrl, and any other) to [`MAX_CLIENT_FIELD`] bytes plus the truncation marker: the
/// one bound of both eras' clientInfo (`initialize`'s and a 2026-07-28 request's `_meta`).
pub fn bound_client_info(info: &mut serde_json::Map<String, Value>) {
    for value in info.values_mut() {
        if let Value::String(s) = value {
            if let std::borrow::Cow::Owned(t) = truncate(s, MAX_CLIENT_FIELD) {
                *s = t;
            }
        }
    }
}

/// The client name of one connection: the first a request presents (`initialize`'s
/// clientInfo in the 2025 era, the first `_meta` clientInfo in the 2026-07-28 era), already
/// cut by [`bound_client_info`]. Later requests naming another client do not change it; the
/// first such mismatch is logged once.
#[derive(Debug, Default)]
pub struct ClientName {
    first: std::sync::OnceLock<String>,
    mismatch_logged: std::sync::atomic::AtomicBool,
}

impl ClientName {
    /// Notes a name a request presents: the first becomes the connection's.
    pub fn present(&self, name: &str) {
        let first = self.first.get_or_init(|| name.to_string());
        if first != name && !self.mismatch_logged.swap(true, Ordering::Relaxed) {
            tracing::warn!(
                connection_client = %first,
                presented = %name,
                "a request names another client than this connection's first; the audit keeps the first"
            );
        }
    }

    /// The connection's client name, once one was presented.
    pub fn get(&self) -> Option<String> {
        self.first.get().cloned()
    }
}

/// Truncates clientInfo's strings and bounds the params rmcp keeps for the connection.
fn bound_initialize(v: &mut Value) -> Result<(), String> {
    if let Some(info) = v
        .get_mut("params")
        .and_then(|p| p.get_mut("clientInfo"))
        .and_then(Value::as_object_mut)
    {
        bound_client_info(info);
    }
    let size = serde_json::to_vec(&v["params"]).map_or(usize::MAX, |p| p.len());
    if size > MAX_INIT_PARAMS {
        return Err(format!(
            "Invalid Request: initialize params are {size} bytes, more than the {MAX_INIT_PARAMS}-byte limit"
        ));
    }
    Ok(())
}

// ---- pumps ---------------------------------------------------------------------------------

/// Why a connection's output was given up.
#[derive(Debug, PartialEq, Eq)]
pub enum PushError {
    /// More than the queue's byte limit would be waiting for the client.
    Full,
    /// The writer is gone.
    Closed,
}

/// The lines waiting for one client, bounded in bytes (a line larger than the limit is
/// accepted only into an empty queue, so one large reply still goes out).
#[derive(Clone)]
pub struct OutQueue {
    tx: mpsc::UnboundedSender<Vec<u8>>,
    bytes: Arc<AtomicUsize>,
    limit: usize,
}

impl OutQueue {
    pub fn new(limit: usize) -> (OutQueue, mpsc::UnboundedReceiver<Vec<u8>>, Arc<AtomicUsize>) {
        let (tx, rx) = mpsc::unbounded_channel();
        let bytes = Arc::new(AtomicUsize::new(0));
        (
            OutQueue {
                tx,
                bytes: bytes.clone(),
                limit,
            },
            rx,
            bytes,
        )
    }

    pub fn push(&self, line: Vec<u8>) -> Result<(), PushError> {
        let n = line.len();
        self.bytes
            .fetch_update(Ordering::SeqCst, Ordering::SeqCst, |cur| {
                (cur == 0 || cur + n <= self.limit).then_some(cur + n)
            })
            .map_err(|_| PushError::Full)?;
        self.tx.send(line).map_err(|_| PushError::Closed)
    }
}

/// The bytes of one line a wire log shows.
const WIRE_LOG_BYTES: usize = 2048;

/// Logs one line as it crossed the socket (`in` from the client, `out` to it), at trace level
/// under the target `airlock::wire` (`AIRLOCK_LOG=airlock::wire=trace`), cut to
/// [`WIRE_LOG_BYTES`]: what the interop tests print when a client fails.
fn wire_log(dir: &'static str, line: &[u8]) {
    if tracing::enabled!(target: "airlock::wire", tracing::Level::TRACE) {
        let text = String::from_utf8_lossy(line);
        let text = truncate(text.trim_end(), WIRE_LOG_BYTES);
        tracing::trace!(target: "airlock::wire", dir, "{text}");
    }
}

/// Copies lines from the socket to rmcp's input, answering bad ones on `replies`.
pub async fn pump_in<R, W>(
    mut reader: LineReader<R>,
    mut to_rmcp: W,
    replies: OutQueue,
    ids: Arc<Mutex<Ids>>,
    freed: Arc<Notify>,
) -> Result<(), PushError>
where
    R: AsyncRead + Unpin,
    W: AsyncWrite + Unpin,
{
    let limit = reader.limit;
    let result = loop {
        let frame = match reader.next().await {
            Ok(f) => f,
            Err(e) => {
                tracing::debug!("connection read failed: {e}");
                break Ok(());
            }
        };
        let action = match frame {
            Frame::Line(line) => {
                wire_log("in", &line);
                // At an in-flight cap (count or bytes), a request waits here, unread further,
                // until a reply frees room: the client's pipeline stalls instead of the daemon's memory
                // growing. (A cancellation behind it waits too.)
                let top = scan_top(&line);
                if top.method.is_some() && top.id.is_some() {
                    while ids
                        .lock()
                        .unwrap_or_else(|p| p.into_inner())
                        .full(line.len())
                    {
                        freed.notified().await;
                    }
                }
                ids.lock().unwrap_or_else(|p| p.into_inner()).inbound(&line)
            }
            Frame::Oversized(prefix) => {
                tracing::warn!(limit, "discarded a message over the size limit");
                let msg = format!(
                    "Invalid Request: message larger than the {limit}-byte limit was discarded"
                );
                Inbound::Reply(error_line(&recover_id(&prefix), -32600, &msg))
            }
            Frame::Eof => break Ok(()),
        };
        match action {
            Inbound::Forward(m) => {
                if to_rmcp.write_all(&m).await.is_err() {
                    break Ok(());
                }
            }
            Inbound::Reply(line) => {
                if let Err(e) = replies.push(line) {
                    break Err(e);
                }
            }
            Inbound::Ignore => {}
        }
    };
    let _ = to_rmcp.shutdown().await;
    result
}

/// Copies rmcp's output lines to `replies`, one whole line at a time, under the client's ids;
/// each reply wakes `pump_in` if it waits for a free slot. Runs until rmcp's output ends:
/// once the queue is full (`overflow` is called, once) or the writer is gone, it reads on and
/// discards, so that rmcp, never blocked on a write, can wind the connection down.
pub async fn pump_out<R: AsyncRead + Unpin>(
    from_rmcp: R,
    replies: OutQueue,
    ids: Arc<Mutex<Ids>>,
    freed: Arc<Notify>,
    overflow: impl FnOnce(),
) {
    let mut r = BufReader::new(from_rmcp);
    let mut overflow = Some(overflow);
    let mut discarding = false;
    loop {
        let mut line = Vec::new();
        match r.read_until(b'\n', &mut line).await {
            Ok(0) | Err(_) => return,
            Ok(_) => {
                let mapped = ids.lock().unwrap_or_else(|p| p.into_inner()).outbound(line);
                freed.notify_one();
                let Some(line) = mapped.filter(|_| !discarding) else {
                    continue;
                };
                if let Err(e) = replies.push(line) {
                    discarding = true;
                    if e == PushError::Full {
                        if let Some(f) = overflow.take() {
                            f();
                        }
                    }
                }
            }
        }
    }
}

/// How the writer ended.
#[derive(Debug, PartialEq, Eq)]
pub enum WriteEnd {
    /// Every sender is gone and every line was written.
    Done,
    /// `stop` was cancelled.
    Stopped,
    /// A line was not taken by the client within the write timeout.
    TimedOut,
    /// The socket failed.
    Failed,
}

/// Writes every queued line to the socket until all senders are gone, each within
/// `write_timeout`, releasing its bytes from the queue's count once written.
pub async fn write_lines<W: AsyncWrite + Unpin>(
    mut w: W,
    mut lines: mpsc::UnboundedReceiver<Vec<u8>>,
    queued: Arc<AtomicUsize>,
    write_timeout: Duration,
    stop: CancellationToken,
) -> WriteEnd {
    loop {
        let line = tokio::select! {
            biased;
            _ = stop.cancelled() => return WriteEnd::Stopped,
            l = lines.recv() => match l {
                Some(l) => l,
                None => break,
            },
        };
        wire_log("out", &line);
        let write = async {
            w.write_all(&line).await?;
            w.flush().await
        };
        let r = tokio::select! {
            biased;
            _ = stop.cancelled() => return WriteEnd::Stopped,
            r = tokio::time::timeout(write_timeout, write) => r,
        };
        match r {
            Ok(Ok(())) => {}
            Ok(Err(_)) => return WriteEnd::Failed,
            Err(_) => return WriteEnd::TimedOut,
        }
        queued.fetch_sub(line.len(), Ordering::SeqCst);
    }
    let _ = tokio::time::timeout(write_timeout, w.shutdown()).await;
    WriteEnd::Done
}

#[cfg(test)]
mod tests;
