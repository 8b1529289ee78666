//! The JSON-RPC error codes the daemon sends: the standard ones (JSON-RPC 2.0, section 5.1)
//! and airlock's own, from the range the standard leaves to the server (-32000 to -32099).
//! rmcp sends the standard ones for what reaches it; the framing sends them for what it
//! answers itself.

/// The line is not JSON (or not UTF-8).
pub const PARSE_ERROR: i64 = -32700;
/// The line is JSON but not a JSON-RPC request the daemon takes: not an object, a batch, no
/// `"jsonrpc": "2.0"`, a bad or duplicate id, too deep, too large, before `initialize`.
pub const INVALID_REQUEST: i64 = -32600;
/// No such method (what rmcp answers; the framing keeps it for a malformed `tools/call`
/// from becoming one).
pub const METHOD_NOT_FOUND: i64 = -32601;
/// The method's params are malformed.
pub const INVALID_PARAMS: i64 = -32602;
/// The server failed to handle a well-formed request.
pub const INTERNAL_ERROR: i64 = -32603;
/// airlock's own: a bound of the daemon's refused this request or connection for now
/// (`max_requests_per_connection`, `max_connections`, `max_connections_per_uid`); the same
/// request may succeed later.
pub const LIMIT_REACHED: i64 = -32000;

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn codes_are_the_ones_clients_match_on() {
        assert_eq!(
            [
                PARSE_ERROR,
                INVALID_REQUEST,
                METHOD_NOT_FOUND,
                INVALID_PARAMS,
                INTERNAL_ERROR,
                LIMIT_REACHED
            ],
            [-32700, -32600, -32601, -32602, -32603, -32000]
        );
    }
}
