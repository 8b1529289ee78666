//! Every exit code of the command line, in one place.

/// How the process exits. (clap exits 2 itself on a usage error, like [`Exit::Error`].)
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Exit {
    /// 0: done.
    Ok,
    /// 1: the tool reported an error (`call`), the policy is invalid or its directory is not
    /// one (`policy check`), or
    /// the connection was lost or stdout closed (`connect`).
    Failed,
    /// 2: a usage, connection, protocol or startup error.
    Error,
    /// 124: `call --timeout` expired; the call was cancelled over the wire.
    Timeout,
    /// 130: `call` was interrupted (Ctrl-C); the call was cancelled over the wire.
    Interrupted,
}

impl Exit {
    pub fn code(self) -> i32 {
        match self {
            Exit::Ok => 0,
            Exit::Failed => 1,
            Exit::Error => 2,
            Exit::Timeout => 124,
            Exit::Interrupted => 130,
        }
    }
}
