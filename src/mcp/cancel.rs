//! Client cancellation of `tools/call`, decided by the executor, never by rmcp.
//!
//! rmcp, told of a `notifications/cancelled`, drops whatever reply the handler later
//! produces, even the result of a call that had already committed: the caller would get no
//! response while the workspace changed. So the framing keeps a client's cancellation of a
//! `tools/call` from rmcp and hands it here instead: it cancels the token the executor
//! watches, and the executor decides. Before its point of no return (publication starts) the
//! call rolls back and ends as [`crate::exec::Reply::Cancelled`], whose reply the framing
//! drops; after it, the call completes and its result is sent like any other.
//!
//! One [`Calls`] per connection, keyed by the daemon's own request ids (see
//! [`super::framing::Ids`]). An entry lives from the first of (the handler registers, the
//! client cancels) until the framing sees the reply go out.

use std::collections::HashMap;
use std::sync::Mutex;

use tokio_util::sync::CancellationToken;

#[derive(Default)]
struct Entry {
    /// The token the executor watches, once the handler registered the call.
    token: Option<CancellationToken>,
    /// The client cancelled the call.
    cancelled: bool,
    /// The call ended cancelled by its client: its reply is not sent.
    silent: bool,
    /// The client's own id of the request (for the audit).
    client_id: Option<serde_json::Value>,
}

/// The `tools/call` requests of one connection that a client may cancel.
#[derive(Default)]
pub struct Calls {
    entries: Mutex<HashMap<u64, Entry>>,
}

impl Calls {
    fn lock(&self) -> std::sync::MutexGuard<'_, HashMap<u64, Entry>> {
        self.entries.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// The handler starts call `id`: the token to hand the executor, cancelled with
    /// `parent` (the connection) or by the client; already cancelled if the client's
    /// cancellation came first.
    pub fn register(&self, id: u64, parent: &CancellationToken) -> CancellationToken {
        let token = parent.child_token();
        let mut m = self.lock();
        let e = m.entry(id).or_default();
        if e.cancelled {
            token.cancel();
        }
        e.token = Some(token.clone());
        token
    }

    /// The framing passed on `tools/call` `id`, which the client sent as `client_id`.
    pub fn note_client_id(&self, id: u64, client_id: serde_json::Value) {
        self.lock().entry(id).or_default().client_id = Some(client_id);
    }

    /// The client's id of call `id`.
    pub fn client_id(&self, id: u64) -> Option<serde_json::Value> {
        self.lock().get(&id).and_then(|e| e.client_id.clone())
    }

    /// Whether the client cancelled call `id` (as opposed to its connection's end or the
    /// daemon's shutdown).
    pub fn cancelled_by_client(&self, id: u64) -> bool {
        self.lock().get(&id).is_some_and(|e| e.cancelled)
    }

    /// The client cancelled call `id` (a request still in flight).
    pub fn cancel(&self, id: u64) {
        let mut m = self.lock();
        let e = m.entry(id).or_default();
        e.cancelled = true;
        if let Some(t) = &e.token {
            t.cancel();
        }
    }

    /// The executor ended call `id` as cancelled: whether that was the client's doing, in
    /// which case its reply will not be sent (JSON-RPC's answer to a cancelled request is
    /// none). A call cancelled by the connection's end or the daemon's shutdown is answered.
    pub fn silence(&self, id: u64) -> bool {
        let mut m = self.lock();
        match m.get_mut(&id) {
            Some(e) if e.cancelled => {
                e.silent = true;
                true
            }
            _ => false,
        }
    }

    /// The reply to `id` is on its way out: whether to drop it. Forgets `id`.
    pub fn take_silent(&self, id: u64) -> bool {
        self.lock().remove(&id).is_some_and(|e| e.silent)
    }

    /// How many calls are tracked (for tests).
    #[cfg(test)]
    pub fn tracked(&self) -> usize {
        self.lock().len()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_cancel_before_registration_cancels_the_token_at_registration() {
        let calls = Calls::default();
        let conn = CancellationToken::new();
        calls.cancel(3);
        let t = calls.register(3, &conn);
        assert!(t.is_cancelled());
        assert!(calls.silence(3));
        assert!(calls.take_silent(3));
        assert_eq!(calls.tracked(), 0);
    }

    #[test]
    fn a_cancel_after_registration_cancels_the_token() {
        let calls = Calls::default();
        let conn = CancellationToken::new();
        let t = calls.register(4, &conn);
        assert!(!t.is_cancelled());
        calls.cancel(4);
        assert!(t.is_cancelled());
        assert!(!conn.is_cancelled());
    }

    #[test]
    fn a_result_after_a_cancel_is_sent() {
        // The executor returned a result (past its point of no return): no silence asked.
        let calls = Calls::default();
        let _t = calls.register(5, &CancellationToken::new());
        calls.cancel(5);
        assert!(!calls.take_silent(5));
        assert_eq!(calls.tracked(), 0);
    }

    #[test]
    fn a_connection_end_is_answered_not_silenced() {
        let calls = Calls::default();
        let conn = CancellationToken::new();
        let t = calls.register(6, &conn);
        conn.cancel();
        assert!(t.is_cancelled());
        assert!(!calls.silence(6));
        assert!(!calls.take_silent(6));
    }
}
