//! The request gate: what one complete line from the client becomes ([`Ids::inbound`]) and
//! what a line from rmcp becomes on its way back ([`Ids::outbound`]). It holds the request
//! table (each request reaches rmcp under an id of the daemon's, mapped back on the reply;
//! duplicates and more than the in-flight caps are refused), the era gate (a request before
//! `initialize` that is not a 2026-07-28 request is refused), the cancel router (a client's
//! cancellation of a `tools/call` goes to [`Calls`], never to rmcp) and the bounds of
//! clientInfo.

use std::collections::HashMap;
use std::sync::atomic::Ordering;
use std::sync::Arc;
use std::time::{Duration, Instant};

use serde_json::{json, Value};

use super::scan::{echoable, recover_id, scan_top, too_deep, trim, MAX_DEPTH, MAX_ID_BYTES};
use crate::audit::truncate;
use crate::mcp::cancel::Calls;
use crate::mcp::codes;

/// clientInfo strings (name, version, title, ...) are cut to this many bytes.
pub const MAX_CLIENT_FIELD: usize = 256;
/// The `_meta` key under which a 2026-07-28 request carries its clientInfo.
pub const META_CLIENT_INFO: &str = "io.modelcontextprotocol/clientInfo";
/// The largest `initialize` params (after clientInfo truncation), which rmcp keeps for the
/// connection's lifetime.
pub const MAX_INIT_PARAMS: usize = 64 * 1024;
/// The longest error message echoed to a client (parser messages quote the input).
const MAX_ERROR_MESSAGE: usize = 512;

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
            return reply(&recover_id(line), codes::PARSE_ERROR, &msg);
        }
        if too_deep(line, MAX_DEPTH) {
            let msg = format!("Invalid Request: JSON nested deeper than {MAX_DEPTH} levels");
            return reply(&recover_id(line), codes::INVALID_REQUEST, &msg);
        }
        let v: Value = match serde_json::from_slice(line) {
            Ok(v) => v,
            Err(e) => {
                return reply(
                    &recover_id(line),
                    codes::PARSE_ERROR,
                    &format!("Parse error: {e}"),
                )
            }
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
                    .flat_map(|id| error_line(&id, codes::INVALID_REQUEST, msg))
                    .collect();
                if lines.is_empty() {
                    lines = error_line(&Value::Null, codes::INVALID_REQUEST, msg);
                }
                return Inbound::Reply(lines);
            }
            return reply(
                &Value::Null,
                codes::INVALID_REQUEST,
                "Invalid Request: a message must be a JSON object",
            );
        };
        let id = obj.get("id").cloned();
        let echo = id.as_ref().map_or(Value::Null, echoable);
        if obj.get("jsonrpc").and_then(Value::as_str) != Some("2.0") {
            return reply(
                &echo,
                codes::INVALID_REQUEST,
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
            (Some(_), _) => reply(&echo, codes::INVALID_REQUEST, "Invalid Request: \"method\" must be a string"),
            (None, Some(_)) if obj.contains_key("result") || obj.contains_key("error") => {
                // A reply to a request of the server's: rmcp matches it or ignores it.
                match checked(&v) {
                    Ok(line) => Inbound::Forward(line),
                    Err(_) => Inbound::Ignore,
                }
            }
            (None, _) => reply(
                &echo,
                codes::INVALID_REQUEST,
                "Invalid Request: a message needs a \"method\", or a \"result\" or \"error\" and an \"id\"",
            ),
        }
    }

    fn request(&mut self, mut v: Value, id: Value, method: &str) -> Inbound {
        let reply = |id: &Value, code, msg: &str| Inbound::Reply(error_line(id, code, msg));
        if echoable(&id).is_null() {
            return reply(
                &Value::Null,
                codes::INVALID_REQUEST,
                &format!("Invalid Request: \"id\" must be an integer or a string of at most {MAX_ID_BYTES} bytes"),
            );
        }
        let key = id.to_string();
        if self.by_client.contains_key(&key) {
            return reply(
                &id,
                codes::INVALID_REQUEST,
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
                codes::LIMIT_REACHED,
                &format!(
                    "too many requests in flight on this connection (max_requests_per_connection = {}); wait for a reply",
                    self.max_in_flight
                ),
            );
        }
        if method == "initialize" {
            if let Err(e) = bound_initialize(&mut v) {
                return reply(&id, codes::INVALID_REQUEST, &e.to_string());
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
                codes::INVALID_REQUEST,
                &format!(
                    "Invalid Request: {} before initialize; send initialize first (then notifications/initialized)",
                    crate::exec::args::shown(method)
                ),
            );
        }
        if method == "tools/call" {
            if let Err(e) = check_call_params(&v["params"]) {
                return reply(&id, codes::INVALID_PARAMS, &e.to_string());
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
            Err(e) => return reply(&id, codes::INVALID_PARAMS, &format!("Invalid params: {e}")),
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
                tracing::debug!(
                    method,
                    "ignored a notification rmcp cannot read: {}",
                    crate::report::chain(&e)
                );
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

/// What is wrong with a `tools/call`'s params, answered [`codes::INVALID_PARAMS`].
#[derive(Debug, PartialEq, Eq, thiserror::Error)]
enum CallParamsError {
    #[error("Invalid params: tools/call needs params {{\"name\": ..., \"arguments\": {{...}}}}")]
    NotAnObject,
    #[error("Invalid params: tools/call \"name\" must be a string")]
    NameNotAString,
    #[error("Invalid params: tools/call needs a \"name\" (tools/list names the tools)")]
    NoName,
    #[error("Invalid params: tools/call \"arguments\" must be an object")]
    ArgumentsNotAnObject,
}

/// `tools/call` params rmcp would take for some other method (and answer [`codes::METHOD_NOT_FOUND`]): a
/// `name` string and, if present, an `arguments` object.
fn check_call_params(params: &Value) -> Result<(), CallParamsError> {
    let Some(p) = params.as_object() else {
        return Err(CallParamsError::NotAnObject);
    };
    match p.get("name") {
        Some(Value::String(_)) => {}
        Some(_) => return Err(CallParamsError::NameNotAString),
        None => return Err(CallParamsError::NoName),
    }
    match p.get("arguments") {
        None | Some(Value::Object(_)) => Ok(()),
        Some(_) => Err(CallParamsError::ArgumentsNotAnObject),
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

/// `initialize` params over [`MAX_INIT_PARAMS`] bytes (after clientInfo's cut).
#[derive(Debug, PartialEq, Eq, thiserror::Error)]
#[error("Invalid Request: initialize params are {size} bytes, more than the {MAX_INIT_PARAMS}-byte limit")]
struct InitParamsTooLarge {
    size: usize,
}

/// Truncates clientInfo's strings and bounds the params rmcp keeps for the connection.
fn bound_initialize(v: &mut Value) -> Result<(), InitParamsTooLarge> {
    if let Some(info) = v
        .get_mut("params")
        .and_then(|p| p.get_mut("clientInfo"))
        .and_then(Value::as_object_mut)
    {
        bound_client_info(info);
    }
    let size = serde_json::to_vec(&v["params"]).map_or(usize::MAX, |p| p.len());
    if size > MAX_INIT_PARAMS {
        return Err(InitParamsTooLarge { size });
    }
    Ok(())
}
