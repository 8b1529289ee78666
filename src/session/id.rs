//! Session ids: what a client may name.

/// The longest session id.
pub const MAX_ID_LEN: usize = 64;

/// What is wrong with a session id a client named. Messages show at most a prefix of it.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum IdError {
    #[error("a session id cannot be empty; use 1 to {MAX_ID_LEN} letters, digits, '-' or '_'")]
    Empty,
    #[error("session id {shown} is {len} bytes; a session id is at most {MAX_ID_LEN} bytes")]
    TooLong { shown: String, len: usize },
    #[error(
        "session id {shown} holds {found:?} at byte {at}; use only letters, digits, '-' or '_'"
    )]
    BadChar {
        shown: String,
        found: char,
        at: usize,
    },
}

/// Checks a session id: 1 to [`MAX_ID_LEN`] ASCII letters, digits, '-' or '_'. Every id a
/// client names (to create, read, mutate or destroy a session) passes here first, so no
/// lookup, message, audit event or file name ever holds anything else.
pub fn check_id(id: &str) -> Result<(), IdError> {
    let shown = || crate::text::shown(id);
    if id.is_empty() {
        return Err(IdError::Empty);
    }
    if id.len() > MAX_ID_LEN {
        return Err(IdError::TooLong {
            shown: shown(),
            len: id.len(),
        });
    }
    if let Some((at, found)) = id
        .char_indices()
        .find(|(_, c)| !(c.is_ascii_alphanumeric() || *c == '-' || *c == '_'))
    {
        return Err(IdError::BadChar {
            shown: shown(),
            found,
            at,
        });
    }
    Ok(())
}

pub fn valid_id(id: &str) -> bool {
    check_id(id).is_ok()
}
