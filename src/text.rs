//! Client strings as messages quote them. A neutral module: the session, publish, exec and mcp
//! layers all quote what a client sent, and none of them should import another for it.

use std::path::Path;

use crate::policy::redact::Secrets;

/// A client's string as it may appear in a message: quoted, and cut (at a character
/// boundary) when long, with its length, so that no error echoes megabytes back. A string a
/// call's secrets could be in is shown by [`Secrets::shown`] instead.
pub fn shown(s: &str) -> String {
    Secrets::default().shown(s)
}

/// A path as a message shows it: through [`shown`], like every client-supplied string.
pub fn shown_path(p: &Path) -> String {
    shown(&p.to_string_lossy())
}
