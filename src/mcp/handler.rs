//! The rmcp `ServerHandler` of one connection: wire types in, [`crate::exec`] calls out.
//! Wire types are built from JSON so the internal types never depend on rmcp's.

use std::sync::Arc;

use rmcp::model::{
    CallToolRequestParams, CallToolResponse, CallToolResult, Implementation, InitializeResult,
    ListResourcesResult, ListToolsResult, PaginatedRequestParams, ReadResourceRequestParams,
    ReadResourceResponse, ReadResourceResult, ServerCapabilities, ServerConfig,
};
use rmcp::service::RequestContext;
use rmcp::{ErrorData as McpError, RoleServer, ServerHandler};
use serde_json::{json, Value};

use super::cancel::Calls;
use crate::audit::Principal;
use crate::exec::{CallRequest, Executor, Reply};
use crate::policy::Subject;

/// The one resource: every call's lifecycle events.
pub const AUDIT_URI: &str = "airlock://audit/events";

/// The `data.code` of the JSON-RPC error a principal without `admin` or `audit` gets for a
/// read of the audit resource (a protocol error, not a tool fault, so not an `ErrorCode`).
pub const AUDIT_FORBIDDEN: &str = "AUDIT_FORBIDDEN";

/// The bytes of events one read of the audit resource returns: a quarter of the
/// connection's queue (the reply is the events escaped into a JSON string, at most twice as
/// long), and never more than the ring holds.
pub fn audit_read_budget(ring_bytes: usize, queue_bytes: usize) -> usize {
    ring_bytes.min(queue_bytes / 4)
}

#[derive(Clone)]
pub struct Handler {
    exec: Arc<Executor>,
    peer: Principal,
    /// The connection's calls a client may cancel (the framing's cancellations land here).
    calls: Arc<Calls>,
}

impl Handler {
    pub fn new(exec: Arc<Executor>, peer: Principal, calls: Arc<Calls>) -> Handler {
        Handler { exec, peer, calls }
    }

    /// Whether the connection's principal may read the audit (`admin` or `audit`).
    fn may_read_audit(&self, policy: &crate::policy::Policy) -> bool {
        let gids = self.peer.gids();
        policy.may_read_audit(Subject {
            uid: self.peer.uid,
            gids: &gids,
        })
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
        let req = CallRequest {
            tool: request.name.to_string(),
            args: request.arguments.unwrap_or_default(),
            principal,
            cancel,
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
        // The audit is listed only to a principal that may read it.
        let resources = if self.may_read_audit(&self.exec.policy()) {
            json!([{
                "uri": AUDIT_URI,
                "name": "audit-events",
                "description": "Lifecycle events of every call (allow, locked, spawned, commit, rollback, timeout, ...), oldest first; the newest that fit the read budget",
                "mimeType": "application/json",
            }])
        } else {
            json!([])
        };
        wire(json!({ "resources": resources }))
    }

    async fn read_resource(
        &self,
        request: ReadResourceRequestParams,
        _cx: RequestContext<RoleServer>,
    ) -> Result<ReadResourceResponse, McpError> {
        if request.uri != AUDIT_URI {
            return Err(McpError::resource_not_found(
                format!("no resource {:?}; resources/list names them", request.uri),
                None,
            ));
        }
        let policy = self.exec.policy();
        if !self.may_read_audit(&policy) {
            self.exec.audit.record(
                &crate::audit::CallRef {
                    call: "-".into(),
                    tool: "resources/read".into(),
                    session: None,
                    principal: Some(self.peer.clone()),
                    secrets: Default::default(),
                },
                "deny",
                json!({"code": AUDIT_FORBIDDEN, "uri": AUDIT_URI}),
            );
            return Err(McpError::invalid_request(
                format!(
                    "{AUDIT_FORBIDDEN}: uid {} may not read {AUDIT_URI}; it needs the admin or audit capability in a [[grant]] of airlock.toml",
                    self.peer.uid
                ),
                Some(json!({"code": AUDIT_FORBIDDEN})),
            ));
        }
        // The newest events that fit a reply the connection can queue (escaping at most
        // doubles the text), never a copy of the whole ring.
        let d = &policy.daemon;
        let text = self
            .exec
            .audit
            .newest_json(audit_read_budget(d.audit_ring_bytes, d.max_queued_bytes));
        let result: ReadResourceResult = wire(json!({
            "contents": [{ "uri": AUDIT_URI, "mimeType": "application/json", "text": text }]
        }))?;
        Ok(ReadResourceResponse::Complete(result))
    }
}
