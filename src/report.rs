//! How an error is shown to a human: its message, then each cause once. Every error names
//! the step that failed (with its path, pid, ...) and keeps what made it fail as its
//! `#[source]` instead of quoting it; [`chain`] walks [`std::error::Error::source`] and joins
//! the messages with `": "`. The CLI's `airlock: ...` lines, the daemon's log fields and a
//! call's fault reply all print errors through it.

use std::error::Error;
use std::fmt;

/// An error and its causes as one line: `error: cause: cause`.
pub struct Chain<'a>(&'a (dyn Error + 'a));

/// Shows `e` with every cause it keeps, each once.
pub fn chain<'a, E: Error + 'a>(e: &'a E) -> Chain<'a> {
    Chain(e)
}

/// [`chain`] for an error already behind a `dyn Error`.
pub fn chain_dyn<'a>(e: &'a (dyn Error + 'a)) -> Chain<'a> {
    Chain(e)
}

impl fmt::Display for Chain<'_> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}", self.0)?;
        let mut cause = self.0.source();
        while let Some(c) = cause {
            write!(f, ": {c}")?;
            cause = c.source();
        }
        Ok(())
    }
}

impl fmt::Debug for Chain<'_> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        fmt::Display::fmt(self, f)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[derive(Debug, thiserror::Error)]
    #[error("outer step {n}")]
    struct Outer {
        n: u32,
        #[source]
        source: Middle,
    }

    #[derive(Debug, thiserror::Error)]
    #[error("middle step")]
    struct Middle(#[source] std::io::Error);

    #[test]
    fn prints_every_cause_once_in_order() {
        let e = Outer {
            n: 7,
            source: Middle(std::io::Error::from_raw_os_error(libc::ENOSPC)),
        };
        let errno = std::io::Error::from_raw_os_error(libc::ENOSPC).to_string();
        let shown = chain(&e).to_string();
        assert_eq!(shown, format!("outer step 7: middle step: {errno}"));
        assert_eq!(shown.matches(&errno).count(), 1, "{shown}");
        assert_eq!(chain_dyn(&e as &dyn Error).to_string(), shown);
    }

    /// A publish step's errno is shown once, after the step and its path.
    #[test]
    fn a_publish_io_error_shows_its_errno_once() {
        let e = crate::publish::PublishError::Io {
            op: "rename",
            path: "/ws/out.txt".into(),
            source: std::io::Error::from_raw_os_error(libc::EXDEV),
        };
        let errno = std::io::Error::from_raw_os_error(libc::EXDEV).to_string();
        assert_eq!(
            chain(&e).to_string(),
            format!("rename /ws/out.txt: {errno}")
        );
    }

    /// A call's fault reply carries every cause of its error once: the step, the publish
    /// error, the session store's error and its errno.
    #[test]
    fn a_call_error_reply_shows_each_cause_once() {
        use crate::exec::CallError;
        use crate::publish::PublishError;
        use crate::session::SessionError;
        let e = CallError::Publish {
            source: PublishError::Commit(Box::new(SessionError::Io {
                op: "write",
                path: "/state/sessions/s.json".into(),
                source: std::io::Error::from_raw_os_error(libc::ENOSPC),
            })),
            restored: true,
        };
        let errno = std::io::Error::from_raw_os_error(libc::ENOSPC).to_string();
        let reply = e.reply(&crate::policy::redact::Secrets::default());
        let text = reply.content[0]["text"].as_str().unwrap();
        assert_eq!(
            text,
            format!(
                "PUBLISH_FAILED: publishing the outputs failed (every target was restored and \
                 the state is unchanged): commit failed: cannot write /state/sessions/s.json: \
                 {errno}"
            )
        );
        for part in ["commit failed", "s.json", errno.as_str()] {
            assert_eq!(text.matches(part).count(), 1, "{part} in {text}");
        }
        assert_eq!(
            reply.structured.unwrap()["error"]["message"],
            text["PUBLISH_FAILED: ".len()..]
        );
    }

    /// The CLI's startup errors (`airlock: {}`) name the step, then the cause, once.
    #[test]
    fn a_cli_startup_error_shows_each_cause_once() {
        let e = crate::startup::StartupError::Lock {
            what: "workspace",
            path: "/ws".into(),
            source: crate::fsutil::LockError::Open(std::io::Error::from_raw_os_error(libc::EACCES)),
        };
        let errno = std::io::Error::from_raw_os_error(libc::EACCES).to_string();
        let shown = format!("airlock: {}", chain(&e));
        assert_eq!(
            shown,
            format!("airlock: /ws: cannot lock the workspace: cannot open it: {errno}")
        );
        assert_eq!(shown.matches(&errno).count(), 1, "{shown}");
    }

    /// A recovery that can neither remove nor move a job dir aside shows the removal's errno
    /// and the move's, each once.
    #[test]
    fn a_recovery_fault_shows_both_failures_once() {
        use crate::publish::{MoveAside, PublishError, RecoveryFault};
        let e = PublishError::Recovery {
            job: "j1".into(),
            reason: RecoveryFault::Unremovable {
                dir: "/ws/.airlock-job-j1".into(),
                removal: Box::new(PublishError::Io {
                    op: "unlink",
                    path: "/ws/.airlock-job-j1/stage/x".into(),
                    source: std::io::Error::from_raw_os_error(libc::EROFS),
                }),
                aside: MoveAside::NoFreeName,
            },
        };
        let erofs = std::io::Error::from_raw_os_error(libc::EROFS).to_string();
        assert_eq!(
            chain(&e).to_string(),
            format!(
                "recovery of job j1: cannot remove /ws/.airlock-job-j1 (unlink \
                 /ws/.airlock-job-j1/stage/x: {erofs}) nor move it aside; remove it by hand and \
                 start again: find a free quarantine name (100 taken)"
            )
        );
    }

    #[test]
    fn an_error_without_causes_is_its_message() {
        let e = std::io::Error::from_raw_os_error(libc::ENOENT);
        assert_eq!(chain(&e).to_string(), e.to_string());
    }
}
