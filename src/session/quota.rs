//! The bounds of one owner's sessions, what they hold, and the room a commit reserves.

use serde_json::{Map, Value};

use super::{lock, SessionStore};

/// A bound of [`SessionLimits`] that a create or a commit would pass: nothing was created
/// or committed.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum QuotaError {
    #[error("uid {uid} already holds {held} live sessions, the most max_sessions_per_principal ({limit}) allows; destroy one first")]
    Sessions { uid: u32, held: usize, limit: usize },
    #[error("the state of session {session:?} would be {bytes} bytes (as compact JSON), more than max_session_state_bytes ({limit})")]
    SessionBytes {
        session: String,
        bytes: u64,
        limit: u64,
    },
    #[error("the sessions of uid {uid} hold {held} bytes of state; session {session:?} would add {more}, past max_state_bytes_per_principal ({limit})")]
    PrincipalBytes {
        uid: u32,
        session: String,
        held: u64,
        more: u64,
        limit: u64,
    },
}

/// The bounds of one owner's sessions (`[daemon]` in airlock.toml).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct SessionLimits {
    /// Live sessions one uid may own (`max_sessions_per_principal`).
    pub sessions_per_principal: usize,
    /// The state of one session, as compact JSON (`max_session_state_bytes`).
    pub session_state_bytes: u64,
    /// The states of one uid's live sessions together (`max_state_bytes_per_principal`).
    pub state_bytes_per_principal: u64,
}

impl Default for SessionLimits {
    fn default() -> Self {
        SessionLimits {
            sessions_per_principal: usize::MAX,
            session_state_bytes: u64::MAX,
            state_bytes_per_principal: u64::MAX,
        }
    }
}

/// The size a state is counted at: its compact JSON.
pub fn state_bytes(state: &Map<String, Value>) -> u64 {
    serde_json::to_vec(state).map_or(u64::MAX, |v| v.len() as u64)
}

/// What one owner's live sessions hold.
#[derive(Debug, Default, Clone, Copy, PartialEq, Eq)]
pub struct Usage {
    pub sessions: usize,
    /// Committed state bytes, plus the growth commits have reserved and not yet made.
    pub bytes: u64,
}

/// Room a commit has taken in its owner's state bytes before publication; given back
/// when dropped uncommitted.
pub struct Reserved<'a> {
    pub(super) store: &'a SessionStore,
    pub(super) owner: Option<u32>,
    /// The growth added to the owner's bytes.
    pub(super) grown: u64,
    /// The new state's size.
    pub(super) bytes: u64,
    pub(super) committed: bool,
}

impl Reserved<'_> {
    /// The new state's size.
    pub fn bytes(&self) -> u64 {
        self.bytes
    }
}

impl Drop for Reserved<'_> {
    fn drop(&mut self) {
        if self.committed {
            return;
        }
        if let Some(uid) = self.owner {
            let mut usage = lock(&self.store.usage);
            if let Some(u) = usage.get_mut(&uid) {
                u.bytes = u.bytes.saturating_sub(self.grown);
            }
        }
    }
}
