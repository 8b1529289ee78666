//! The rmcp `ServerHandler` of one connection: wire types in, [`crate::exec`] calls out.
//! Wire types are built from JSON so the internal types never depend on rmcp's.

use std::sync::Arc;

use rmcp::model::{
    CallToolRequestParams, CallToolResponse, CallToolResult, Implementation, InitializeResult,
    ListResourceTemplatesResult, ListResourcesResult, ListToolsResult, PaginatedRequestParams,
    ReadResourceRequestParams, ReadResourceResponse, ReadResourceResult, ServerCapabilities,
    ServerConfig, SubscribeRequestParams, UnsubscribeRequestParams,
};
use rmcp::service::RequestContext;
use rmcp::{ErrorData as McpError, RoleServer, ServerHandler};
use serde_json::{json, Value};

use super::cancel::Calls;
use crate::audit::Principal;
use crate::exec::{CallRequest, Executor, Reply};

/// The one resource: every call's lifecycle events.
pub const AUDIT_URI: &str = "airlock://audit/events";
/// The same, filtered (RFC 6570 form-style query): `airlock://audit/events?job=J&limit=10`.
pub const AUDIT_TEMPLATE: &str = "airlock://audit/events{?job,session,tool,since,limit}";
/// Resource subscriptions one connection may hold.
const MAX_SUBSCRIPTIONS: usize = 16;
/// A subscriber hears of new events at most this often.
const NOTIFY_EVERY: std::time::Duration = std::time::Duration::from_millis(100);

/// `%XX` escapes and `+` decoded; `None` for a malformed escape or bytes that are not UTF-8.
fn percent_decode(s: &str) -> Option<String> {
    let b = s.as_bytes();
    let mut out = Vec::with_capacity(b.len());
    let mut i = 0;
    while i < b.len() {
        match b[i] {
            b'%' => {
                let h = std::str::from_utf8(b.get(i + 1..i + 3)?).ok()?;
                out.push(u8::from_str_radix(h, 16).ok()?);
                i += 3;
            }
            b'+' => {
                out.push(b' ');
                i += 1;
            }
            c => {
                out.push(c);
                i += 1;
            }
        }
    }
    String::from_utf8(out).ok()
}

/// The filter a resource URI asks for: [`AUDIT_URI`], optionally with a query of the
/// template's variables. An unknown variable or a bad value is an error naming it.
pub fn audit_filter(uri: &str) -> Result<crate::audit::Filter, String> {
    let query = match uri.strip_prefix(AUDIT_URI) {
        Some("") => return Ok(Default::default()),
        Some(rest) => rest
            .strip_prefix('?')
            .ok_or_else(|| format!("no resource {uri:?}; resources/list names them"))?,
        None => return Err(format!("no resource {uri:?}; resources/list names them")),
    };
    let mut f = crate::audit::Filter::default();
    for pair in query.split('&').filter(|p| !p.is_empty()) {
        let (k, v) = pair.split_once('=').unwrap_or((pair, ""));
        let v = percent_decode(v).ok_or_else(|| format!("{k}: malformed percent-encoding"))?;
        match k {
            "job" => f.job = Some(v),
            "session" => f.session = Some(v),
            "tool" => f.tool = Some(v),
            "since" => f.since_ms = Some(crate::audit::parse_since(&v)?),
            "limit" => {
                f.limit = Some(
                    v.parse()
                        .map_err(|_| format!("limit {v:?} is not a count of events"))?,
                )
            }
            k => {
                return Err(format!(
                    "unknown filter {k:?}; the template is {AUDIT_TEMPLATE}"
                ))
            }
        }
    }
    Ok(f)
}

/// The bytes of events one read of the audit resource returns: a quarter of the
/// connection's queue (the reply is the events escaped into a JSON string, at most twice as
/// long), and never more than the ring holds.
pub fn audit_read_budget(ring_bytes: usize, queue_bytes: usize) -> usize {
    ring_bytes.min(queue_bytes / 4)
}

/// An unknown resource is "not found"; a known one with a bad filter is invalid params.
fn uri_error(uri: &str, message: String) -> McpError {
    if uri.starts_with(AUDIT_URI) {
        McpError::invalid_params(message, None)
    } else {
        McpError::resource_not_found(message, None)
    }
}

#[derive(Clone)]
pub struct Handler {
    exec: Arc<Executor>,
    peer: Principal,
    /// The connection's calls a client may cancel (the framing's cancellations land here).
    calls: Arc<Calls>,
    /// The connection's end: its subscriptions stop with it.
    conn: tokio_util::sync::CancellationToken,
    /// Subscribed resource URIs, each with the token that stops its notifier.
    subs: Arc<
        std::sync::Mutex<std::collections::HashMap<String, tokio_util::sync::CancellationToken>>,
    >,
}

impl Handler {
    pub fn new(
        exec: Arc<Executor>,
        peer: Principal,
        calls: Arc<Calls>,
        conn: tokio_util::sync::CancellationToken,
    ) -> Handler {
        Handler {
            exec,
            peer,
            calls,
            conn,
            subs: Default::default(),
        }
    }
}

fn wire<T: serde::de::DeserializeOwned>(v: Value) -> Result<T, McpError> {
    serde_json::from_value(v)
        .map_err(|e| McpError::internal_error(format!("cannot build a response: {e}"), None))
}

impl ServerHandler for Handler {
    fn get_info(&self) -> ServerConfig {
        let caps = ServerCapabilities::builder()
            .enable_tools()
            .enable_resources()
            .enable_resources_subscribe()
            .build();
        InitializeResult::new(caps)
            .with_server_info(Implementation::new("airlock", env!("CARGO_PKG_VERSION")))
            .with_instructions(
                "airlock runs tools under policy. Write tools take a `session` argument; create one with \
                 session_create. Each write call's outputs and session state are committed together or not at all.",
            )
    }

    async fn list_tools(
        &self,
        _request: Option<PaginatedRequestParams>,
        _cx: RequestContext<RoleServer>,
    ) -> Result<ListToolsResult, McpError> {
        let policy = self.exec.policy();
        let tools: Vec<Value> = policy
            .tools
            .values()
            .map(|t| {
                json!({
                    "name": t.name,
                    "description": t.description,
                    "inputSchema": t.input_schema(),
                    "annotations": {
                        "readOnlyHint": t.annotations.read_only,
                        "destructiveHint": t.annotations.destructive,
                        "idempotentHint": t.annotations.idempotent,
                        "openWorldHint": false,
                    },
                })
            })
            .collect();
        wire(json!({ "tools": tools }))
    }

    async fn call_tool(
        &self,
        request: CallToolRequestParams,
        cx: RequestContext<RoleServer>,
    ) -> Result<CallToolResponse, McpError> {
        let mut principal = self.peer.clone();
        principal.client = cx.peer.peer_info().map(|i| i.client_info.name.clone());
        // The framing gives every request a numeric id of the daemon's own.
        let id = match &cx.id {
            rmcp::model::NumberOrString::Number(n) => u64::try_from(*n).ok(),
            rmcp::model::NumberOrString::String(_) => None,
        };
        let cancel = match id {
            Some(id) => self.calls.register(id, &cx.ct),
            None => cx.ct.clone(),
        };
        let calls = self.calls.clone();
        let req = CallRequest {
            tool: request.name.to_string(),
            args: request.arguments.unwrap_or_default(),
            principal,
            cancel,
            request_id: id.and_then(|id| self.calls.client_id(id)),
            client_cancelled: Arc::new(move || id.is_some_and(|id| calls.cancelled_by_client(id))),
        };
        match self.exec.call(req).await {
            Reply::Result(r) => {
                let mut v = json!({ "content": r.content, "isError": r.is_error });
                if let Some(s) = r.structured.filter(|s| !s.is_null()) {
                    v["structuredContent"] = s;
                }
                let result: CallToolResult = wire(v)?;
                Ok(CallToolResponse::Complete(result))
            }
            Reply::UnknownTool(name) => Err(McpError::invalid_params(
                format!("unknown tool {name:?}; tools/list names the tools this daemon serves"),
                None,
            )),
            // Cancelled by its client before the point of no return: the framing drops
            // this reply (JSON-RPC answers a cancelled request with nothing).
            Reply::Cancelled if id.is_some_and(|id| self.calls.silence(id)) => Err(
                McpError::internal_error("call cancelled by the client", None),
            ),
            // Cancelled by the daemon's shutdown (or the client went away, and nobody reads).
            Reply::Cancelled => Err(McpError::internal_error(
                "call cancelled: the daemon is shutting down or the client went away",
                None,
            )),
        }
    }

    async fn list_resources(
        &self,
        _request: Option<PaginatedRequestParams>,
        _cx: RequestContext<RoleServer>,
    ) -> Result<ListResourcesResult, McpError> {
        wire(json!({
            "resources": [{
                "uri": AUDIT_URI,
                "name": "audit-events",
                "description": "Lifecycle events of every call (allow, start, commit, rollback, timeout, cancel, ...), oldest first; the newest that fit the read budget. Filter with the template airlock://audit/events{?job,session,tool,since,limit}",
                "mimeType": "application/json",
            }]
        }))
    }

    async fn list_resource_templates(
        &self,
        _request: Option<PaginatedRequestParams>,
        _cx: RequestContext<RoleServer>,
    ) -> Result<ListResourceTemplatesResult, McpError> {
        wire(json!({
            "resourceTemplates": [{
                "uriTemplate": AUDIT_TEMPLATE,
                "name": "audit-events-filtered",
                "description": "Audit events of one job, session or tool, at or after `since` (RFC 3339 UTC or milliseconds since the epoch), at most `limit` (the newest), oldest first",
                "mimeType": "application/json",
            }]
        }))
    }

    async fn subscribe(
        &self,
        request: SubscribeRequestParams,
        cx: RequestContext<RoleServer>,
    ) -> Result<(), McpError> {
        audit_filter(&request.uri).map_err(|m| uri_error(&request.uri, m))?;
        let stop = self.conn.child_token();
        {
            let mut subs = self.subs.lock().unwrap_or_else(|p| p.into_inner());
            if subs.contains_key(&request.uri) {
                return Ok(());
            }
            if subs.len() >= MAX_SUBSCRIPTIONS {
                return Err(McpError::invalid_params(
                    format!("this connection already holds {MAX_SUBSCRIPTIONS} subscriptions; unsubscribe one first"),
                    None,
                ));
            }
            subs.insert(request.uri.clone(), stop.clone());
        }
        // Every new event updates every view of the ring (the newest events change); a
        // subscriber hears of it at most every NOTIFY_EVERY.
        let mut rx = self.exec.audit.subscribe();
        rx.mark_unchanged();
        let peer = cx.peer.clone();
        let uri = request.uri;
        tokio::spawn(async move {
            loop {
                tokio::select! {
                    r = rx.changed() => if r.is_err() { return },
                    _ = stop.cancelled() => return,
                }
                let param = rmcp::model::ResourceUpdatedNotificationParam::new(uri.clone());
                if peer.notify_resource_updated(param).await.is_err() {
                    return;
                }
                tokio::select! {
                    _ = tokio::time::sleep(NOTIFY_EVERY) => {}
                    _ = stop.cancelled() => return,
                }
            }
        });
        Ok(())
    }

    async fn unsubscribe(
        &self,
        request: UnsubscribeRequestParams,
        _cx: RequestContext<RoleServer>,
    ) -> Result<(), McpError> {
        if let Some(stop) = self
            .subs
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .remove(&request.uri)
        {
            stop.cancel();
        }
        Ok(())
    }

    async fn read_resource(
        &self,
        request: ReadResourceRequestParams,
        _cx: RequestContext<RoleServer>,
    ) -> Result<ReadResourceResponse, McpError> {
        let filter = audit_filter(&request.uri).map_err(|m| uri_error(&request.uri, m))?;
        // The newest events that fit a reply the connection can queue (escaping at most
        // doubles the text), never a copy of the whole ring.
        let policy = self.exec.policy();
        let d = &policy.daemon;
        let text = self.exec.audit.newest_json(
            audit_read_budget(d.audit_ring_bytes, d.max_queued_bytes),
            &filter,
        );
        let result: ReadResourceResult = wire(json!({
            "contents": [{ "uri": request.uri, "mimeType": "application/json", "text": text }]
        }))?;
        Ok(ReadResourceResponse::Complete(result))
    }
}
