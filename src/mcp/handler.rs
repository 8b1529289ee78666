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
use super::framing::ClientName;
use crate::audit::Principal;
use crate::exec::args::shown;
use crate::exec::progress::{self, ProgressFeed};
use crate::exec::{CallRequest, Executor, Reply};
use crate::policy::Subject;

/// The least time between two notifications that carry a worker's report; what the worker
/// reports meanwhile is coalesced to its latest. Phases are never delayed.
const WORKER_PROGRESS_INTERVAL: std::time::Duration = std::time::Duration::from_millis(100);

/// Sends a call's progress as `notifications/progress` under the client's token until the
/// call ends. `progress` counts the notifications (1, 2, 3...: it increases at each one, as
/// the spec requires, whatever the worker reports); `message` says what happens:
/// `queued`, `running`, `running: <worker's progress>[/<total>] [<message>]`, `publishing`.
async fn forward_progress(
    peer: rmcp::Peer<RoleServer>,
    token: rmcp::model::ProgressToken,
    mut feed: ProgressFeed,
) {
    let (mut phases_open, mut worker_open) = (true, true);
    let mut step = 0u32;
    while phases_open || worker_open {
        let (message, from_worker) = tokio::select! {
            biased;
            p = feed.phases.recv(), if phases_open => match p {
                Some(p) => {
                    // The worker is done once publication starts: no stale report after it.
                    if p == progress::Phase::Publishing {
                        worker_open = false;
                    }
                    (p.as_str().to_string(), false)
                }
                None => {
                    phases_open = false;
                    continue;
                }
            },
            r = feed.worker.changed(), if worker_open => {
                if r.is_err() {
                    worker_open = false;
                    continue;
                }
                let latest = feed.worker.borrow_and_update().clone();
                match latest {
                    Some(w) => (format!("running: {w}"), true),
                    None => continue,
                }
            }
        };
        step += 1;
        let n = rmcp::model::ProgressNotificationParam::new(token.clone(), f64::from(step))
            .with_message(message);
        if peer.notify_progress(n).await.is_err() {
            return;
        }
        if from_worker {
            tokio::time::sleep(WORKER_PROGRESS_INTERVAL).await;
        }
    }
}

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

/// Why a resource URI names no readable view of the audit.
#[derive(Debug, thiserror::Error)]
pub enum FilterError {
    #[error("no resource {}; resources/list names them", shown(.0))]
    NoResource(String),
    #[error("{}: malformed percent-encoding", shown(.0))]
    Encoding(String),
    #[error(transparent)]
    Since(#[from] crate::audit::SinceError),
    #[error("limit {} is not a count of events", shown(.0))]
    Limit(String),
    #[error("unknown filter {}; the template is {AUDIT_TEMPLATE}", shown(.0))]
    Unknown(String),
}

/// The filter a resource URI asks for: [`AUDIT_URI`], optionally with a query of the
/// template's variables. An unknown variable or a bad value is an error naming it.
pub fn audit_filter(uri: &str) -> Result<crate::audit::Filter, FilterError> {
    let no_resource = || FilterError::NoResource(uri.to_string());
    let query = match uri.strip_prefix(AUDIT_URI) {
        Some("") => return Ok(Default::default()),
        Some(rest) => rest.strip_prefix('?').ok_or_else(no_resource)?,
        None => return Err(no_resource()),
    };
    let mut f = crate::audit::Filter::default();
    for pair in query.split('&').filter(|p| !p.is_empty()) {
        let (k, v) = pair.split_once('=').unwrap_or((pair, ""));
        let v = percent_decode(v).ok_or_else(|| FilterError::Encoding(k.to_string()))?;
        match k {
            "job" => f.job = Some(v),
            "session" => f.session = Some(v),
            "tool" => f.tool = Some(v),
            "since" => f.since_ms = Some(crate::audit::parse_since(&v)?),
            "limit" => f.limit = Some(v.parse().map_err(|_| FilterError::Limit(v))?),
            k => return Err(FilterError::Unknown(k.to_string())),
        }
    }
    Ok(f)
}

/// The `data.code` of the JSON-RPC error a principal without `admin` or `audit` gets for a
/// read of the audit resource (a protocol error, not a tool fault, so not an `ErrorCode`).
pub const AUDIT_FORBIDDEN: &str = "AUDIT_FORBIDDEN";

/// The bytes of events one read of the audit resource returns: a quarter of the
/// connection's queue (the reply is the events escaped into a JSON string, at most twice as
/// long), and never more than the ring holds.
pub fn audit_read_budget(ring_bytes: usize, queue_bytes: usize) -> usize {
    ring_bytes.min(queue_bytes / 4)
}

/// An unknown resource is "not found"; a known one with a bad filter is invalid params.
fn uri_error(uri: &str, e: FilterError) -> McpError {
    let message = e.to_string();
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
    /// The client name the connection presented first: the audit's for all its calls.
    client: Arc<ClientName>,
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
        client: Arc<ClientName>,
        conn: tokio_util::sync::CancellationToken,
    ) -> Handler {
        Handler {
            exec,
            peer,
            calls,
            client,
            conn,
            subs: Default::default(),
        }
    }

    /// Whether the connection's principal may read the audit (`admin` or `audit`).
    fn may_read_audit(&self, policy: &crate::policy::Policy) -> bool {
        let gids = self.peer.gids();
        policy.may_read_audit(Subject {
            uid: self.peer.uid,
            gids: &gids,
        })
    }

    /// The audit's resource (or template) entry as a list: listed only to a principal that
    /// may read it.
    fn audit_listing(&self, entry: Value) -> Value {
        if self.may_read_audit(&self.exec.policy()) {
            json!([entry])
        } else {
            json!([])
        }
    }

    /// Records a `deny` of an audit read or subscription of this connection's principal.
    fn record_audit_refusal(&self, method: &str, uri: &str, message: Option<&str>) {
        self.exec.audit.record(
            &crate::audit::CallRef {
                call: "-".into(),
                tool: method.into(),
                session: None,
                principal: Some(self.peer.clone()),
                secrets: Default::default(),
                request_id: None,
            },
            crate::audit::Event::Deny(crate::audit::event::Deny::Resource {
                code: AUDIT_FORBIDDEN.into(),
                uri: uri.into(),
                message: message.map(str::to_string),
            }),
        );
    }

    /// Whether the subscription to `uri` may go on under the policy current now. If not
    /// (a reload took the principal's `admin` and `audit`), it is dropped: its notifier stops
    /// (`stop`), it leaves the connection's list, and the audit records a `deny`.
    fn subscription_still_allowed(
        &self,
        uri: &str,
        stop: &tokio_util::sync::CancellationToken,
    ) -> bool {
        if self.may_read_audit(&self.exec.policy()) {
            return true;
        }
        stop.cancel();
        self.subs
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .retain(|_, t| !t.is_cancelled());
        self.record_audit_refusal(
            "resources/subscribe",
            uri,
            Some("subscription dropped: the reloaded policy no longer lets this principal read the audit"),
        );
        false
    }

    /// Refuses (and records a `deny`) a principal that may not read the audit.
    fn check_audit_reader(
        &self,
        policy: &crate::policy::Policy,
        method: &str,
        uri: &str,
    ) -> Result<(), McpError> {
        if self.may_read_audit(policy) {
            return Ok(());
        }
        self.record_audit_refusal(method, uri, None);
        Err(McpError::invalid_request(
            format!(
                "{AUDIT_FORBIDDEN}: uid {} may not read {AUDIT_URI}; it needs the admin or audit capability in a [[grant]] of airlock.toml",
                self.peer.uid
            ),
            Some(json!({"code": AUDIT_FORBIDDEN})),
        ))
    }
}

/// Builds an rmcp result from JSON. Every result says `"resultType": "complete"`, which the
/// 2026-07-28 revision requires; rmcp strips it for a peer that negotiated an older one (and
/// adds the caching hints `ttlMs`/`cacheScope` for a 2026-07-28 peer). Without it the
/// deserialized result has no `resultType` at all, whatever the era.
fn wire<T: serde::de::DeserializeOwned>(v: Value) -> Result<T, McpError> {
    serde_json::from_value(v)
        .map_err(|e| McpError::internal_error(format!("cannot build a response: {e}"), None))
}

/// The result's content blocks, ending with a text block that holds the serialized
/// structured result (the MCP spec's SHOULD, for clients that read only `content`), unless
/// a text block already holds exactly that.
pub fn with_structured_text(mut content: Vec<Value>, structured: Option<&Value>) -> Vec<Value> {
    let Some(s) = structured else {
        return content;
    };
    let text = s.to_string();
    let present = content
        .iter()
        .any(|b| b["type"] == "text" && b["text"].as_str() == Some(text.as_str()));
    if !present {
        content.push(json!({"type": "text", "text": text}));
    }
    content
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
        // Only what the principal may call: no grant, no tool.
        let gids = self.peer.gids();
        let who = Subject {
            uid: self.peer.uid,
            gids: &gids,
        };
        let tools: Vec<Value> = policy
            .tools
            .values()
            .filter(|t| policy.may_call(who, t))
            .map(|t| {
                let mut v = json!({
                    "name": t.name,
                    "description": t.description,
                    "inputSchema": t.input_schema(),
                    "annotations": {
                        "readOnlyHint": t.annotations.read_only,
                        "destructiveHint": t.annotations.destructive,
                        "idempotentHint": t.annotations.idempotent,
                        "openWorldHint": false,
                    },
                });
                if let Some(title) = &t.title {
                    v["title"] = json!(title);
                    v["annotations"]["title"] = json!(title);
                }
                if let Some(schema) = t.output_schema() {
                    v["outputSchema"] = Value::Object(schema);
                }
                v
            })
            .collect();
        wire(json!({ "resultType": "complete", "tools": tools }))
    }

    async fn call_tool(
        &self,
        request: CallToolRequestParams,
        cx: RequestContext<RoleServer>,
    ) -> Result<CallToolResponse, McpError> {
        let mut principal = self.peer.clone();
        // The first the connection presented, in the handshake (2025 era) or a request's
        // `_meta` (2026-07-28), cut by the framing; never a later request's other name.
        principal.client = self.client.get();
        // The framing gives every request a numeric id of the daemon's own.
        let id = match &cx.id {
            rmcp::model::NumberOrString::Number(n) => u64::try_from(*n).ok(),
            rmcp::model::NumberOrString::String(_) => None,
        };
        let cancel = match id {
            Some(id) => self.calls.register(id, &cx.ct),
            None => cx.ct.clone(),
        };
        // Progress only for a client that asked for it, under its token.
        let (progress, forwarder) = match cx.meta.get_progress_token() {
            Some(token) => {
                let (tx, feed) = progress::channel();
                (
                    Some(tx),
                    Some(forward_progress(cx.peer.clone(), token, feed)),
                )
            }
            None => (None, None),
        };
        let calls = self.calls.clone();
        let req = CallRequest {
            tool: request.name.to_string(),
            args: request.arguments.unwrap_or_default(),
            principal,
            cancel,
            progress,
            request_id: id.and_then(|id| self.calls.client_id(id)),
            client_cancelled: Arc::new(move || id.is_some_and(|id| calls.cancelled_by_client(id))),
            idempotency_key: cx.meta.0 .0.get(crate::jobs::KEY_META).cloned(),
        };
        // The call drops its end of the progress channels when it ends; the forwarder then
        // sends what is left and ends, so every notification goes out before the result.
        let forwarding = async {
            if let Some(f) = forwarder {
                f.await;
            }
        };
        let (reply, ()) = tokio::join!(self.exec.call(req), forwarding);
        match reply {
            Reply::Result(r) => {
                let structured = r.structured.filter(|s| !s.is_null());
                let content = with_structured_text(r.content, structured.as_ref());
                let mut v = json!({
                    "resultType": "complete",
                    "content": content,
                    "isError": r.is_error,
                });
                if let Some(s) = structured {
                    v["structuredContent"] = s;
                }
                let result: CallToolResult = wire(v)?;
                Ok(CallToolResponse::Complete(result))
            }
            Reply::UnknownTool(name) => Err(McpError::invalid_params(
                format!(
                    "unknown tool {}; tools/list names the tools this daemon serves",
                    shown(&name)
                ),
                None,
            )),
            // Cancelled by its client before the point of no return: the framing drops
            // this reply (JSON-RPC answers a cancelled request with nothing). It is an
            // empty result, not an error: rmcp logs every error reply as a WARN, and a
            // client's cancel is no fault.
            Reply::Cancelled if id.is_some_and(|id| self.calls.silence(id)) => {
                let dropped: CallToolResult =
                    wire(json!({"resultType": "complete", "content": [], "isError": true}))?;
                Ok(CallToolResponse::Complete(dropped))
            }
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
        let resources = self.audit_listing(json!({
            "uri": AUDIT_URI,
            "name": "audit-events",
            "description": "Lifecycle events of every call (allow, start, commit, rollback, timeout, cancel, ...), oldest first; the newest that fit the read budget. Filter with the template airlock://audit/events{?job,session,tool,since,limit}",
            "mimeType": "application/json",
        }));
        wire(json!({ "resultType": "complete", "resources": resources }))
    }

    async fn list_resource_templates(
        &self,
        _request: Option<PaginatedRequestParams>,
        _cx: RequestContext<RoleServer>,
    ) -> Result<ListResourceTemplatesResult, McpError> {
        let templates = self.audit_listing(json!({
            "uriTemplate": AUDIT_TEMPLATE,
            "name": "audit-events-filtered",
            "description": "Audit events of one job, session or tool, at or after `since` (RFC 3339 UTC or milliseconds since the epoch), at most `limit` (the newest), oldest first",
            "mimeType": "application/json",
        }));
        wire(json!({ "resultType": "complete", "resourceTemplates": templates }))
    }

    async fn subscribe(
        &self,
        request: SubscribeRequestParams,
        cx: RequestContext<RoleServer>,
    ) -> Result<(), McpError> {
        audit_filter(&request.uri).map_err(|m| uri_error(&request.uri, m))?;
        self.check_audit_reader(&self.exec.policy(), "resources/subscribe", &request.uri)?;
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
        // subscriber hears of it at most every NOTIFY_EVERY. At each reload, and before each
        // notification, the policy current then must still let the principal read the audit;
        // else the subscription is dropped and nothing more is sent.
        let mut rx = self.exec.audit.subscribe();
        rx.mark_unchanged();
        let mut reloads = self.exec.reloads();
        let peer = cx.peer.clone();
        let uri = request.uri;
        let this = self.clone();
        tokio::spawn(async move {
            loop {
                tokio::select! {
                    r = rx.changed() => if r.is_err() { return },
                    r = reloads.changed() => {
                        if r.is_err() || !this.subscription_still_allowed(&uri, &stop) {
                            return;
                        }
                        continue;
                    }
                    _ = stop.cancelled() => return,
                }
                if !this.subscription_still_allowed(&uri, &stop) {
                    return;
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
        let policy = self.exec.policy();
        self.check_audit_reader(&policy, "resources/read", &request.uri)?;
        // The newest events that fit a reply the connection can queue (escaping at most
        // doubles the text), never a copy of the whole ring.
        let d = &policy.daemon;
        let text = self.exec.audit.newest_json(
            audit_read_budget(d.audit_ring_bytes, d.max_queued_bytes),
            &filter,
        );
        let result: ReadResourceResult = wire(json!({
            "resultType": "complete",
            "contents": [{ "uri": request.uri, "mimeType": "application/json", "text": text }]
        }))?;
        Ok(ReadResourceResponse::Complete(result))
    }
}
