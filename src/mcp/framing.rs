//! Newline-delimited JSON-RPC framing between a socket and rmcp, with every check rmcp
//! leaves silent or gets wrong, so that every bad line gets an error and the connection
//! keeps working:
//!
//! - a line over the size limit is discarded as it arrives (never held whole) and answered
//!   with Invalid Request;
//! - invalid UTF-8, JSON nested deeper than [`MAX_DEPTH`](scan::MAX_DEPTH) (checked by a flat scan before any
//!   parser recurses) and a line that is not JSON are answered with an error;
//! - a message that is not a JSON-RPC 2.0 object, or that rmcp could not read, is answered
//!   with an error under its id, read by a tolerant scan of the line when the line is not
//!   JSON at all; only a notification gets no reply, as JSON-RPC requires;
//! - request ids: each request is handed to rmcp under an id of the daemon's own ([`Ids`]),
//!   mapped back on the reply. A second request with the id of one still in flight is
//!   rejected (rmcp alone would overwrite the first's bookkeeping and drop a reply), and a
//!   connection has at most `max_requests_per_connection` requests in flight;
//! - clientInfo: its strings are cut to [`MAX_CLIENT_FIELD`](gate::MAX_CLIENT_FIELD) bytes by one function
//!   ([`bound_client_info`](gate::bound_client_info)) before rmcp sees them, both in `initialize` (2025 era) and in a
//!   2026-07-28 request's `_meta`; `initialize` params are bounded in size. The first client
//!   name a connection presents is its name for good ([`ClientName`]).
//!
//! Outgoing lines go through an [`OutQueue`] bounded in bytes; [`write_lines`] gives each
//! line a write timeout. Exceeding either drops the connection (the caller's decision).
//!
//! Three parts: `scan`, the pure byte scanner (line splitting under the size bound, the flat
//! top-level scan; no I/O); `gate`, the request gate (request table, era gate, cancel
//! router, clientInfo bounds); `pump`, the I/O pumps (the out queue and the three pumps).

mod gate;
mod pump;
mod scan;

pub use gate::{error_line, ClientName, Ids};
pub use pump::{pump_in, pump_out, write_lines, LineReader, OutQueue, WriteEnd};

#[cfg(test)]
mod tests;
