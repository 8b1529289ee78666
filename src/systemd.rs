//! systemd integration, hand-written (the protocol is two environment variables and a
//! datagram): socket activation (`LISTEN_PID`, `LISTEN_FDS`, `LISTEN_FDNAMES`, the fds from
//! 3 on: one passed fd is the listener whatever its name, several need exactly one named
//! [`FD_NAME`]) and `sd_notify` (`READY=1`, `STATUS=`, `RELOADING=1`, `STOPPING=1`, `WATCHDOG=1`
//! on `NOTIFY_SOCKET`, a path or an abstract name).
//!
//! Without systemd (none of the variables set) every function here is a no-op and the
//! daemon binds its own socket.

use std::os::fd::{BorrowedFd, FromRawFd, RawFd};
use std::os::unix::net::{SocketAddr, UnixDatagram, UnixListener};
use std::time::Duration;

/// The name `airlock.socket` gives its listener (`FileDescriptorName=`); it picks the
/// listener only when several fds are passed.
pub const FD_NAME: &str = "airlock";

/// The first fd systemd passes (`SD_LISTEN_FDS_START`).
const LISTEN_FDS_START: RawFd = 3;

/// More passed fds than this is a broken environment, not a socket unit.
const MAX_LISTEN_FDS: usize = 1024;

#[derive(Debug, thiserror::Error, PartialEq, Eq)]
pub enum ActivationError {
    #[error("socket activation: LISTEN_FDS={0:?} is not a count of file descriptors")]
    BadCount(String),
    #[error("socket activation: LISTEN_PID={0:?} is not a process id")]
    BadPid(String),
    #[error(
        "socket activation: {count} fds passed but LISTEN_FDNAMES is not set; name the \
         listener {FD_NAME:?} (FileDescriptorName={FD_NAME} in airlock.socket, or \
         systemd-socket-activate --fdname={FD_NAME})"
    )]
    NoNames { count: usize },
    #[error(
        "socket activation: none of the {count} passed fds is named {FD_NAME:?} \
         (LISTEN_FDNAMES={names:?}); set FileDescriptorName={FD_NAME} in airlock.socket"
    )]
    NotNamed { count: usize, names: String },
    #[error(
        "socket activation: fds {} are each named {FD_NAME:?} (LISTEN_FDNAMES={names:?}); \
         airlock serves one listener: pass one socket named {FD_NAME:?}",
        fd_list(.fds)
    )]
    NamedTwice { fds: Vec<RawFd>, names: String },
    #[error("socket activation: passed fd {fd} is not a listening AF_UNIX stream socket")]
    NotAListener {
        fd: RawFd,
        #[source]
        why: ListenerFault,
    },
}

/// Why a passed fd cannot be the listener.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum ListenerFault {
    #[error("fstat")]
    Stat(#[source] rustix::io::Errno),
    #[error("not a socket")]
    NotASocket,
    #[error("getsockopt {0}")]
    Option(&'static str, #[source] rustix::io::Errno),
    #[error("address family {0:?}")]
    Family(rustix::net::AddressFamily),
    #[error("socket type {0:?}")]
    Type(rustix::net::SocketType),
    #[error("not listening")]
    NotListening,
    #[error("cannot make it non-blocking")]
    NonBlocking(#[source] rustix::io::Errno),
}

/// Which fd of a socket activation is airlock's listener, from the values of `LISTEN_PID`,
/// `LISTEN_FDS` and `LISTEN_FDNAMES` and this process's pid. `None`: no activation meant for
/// this process (no variables, or another process's `LISTEN_PID`).
///
/// One passed fd is the listener whatever `LISTEN_FDNAMES` says (absent, `unknown`, or a
/// `.socket` unit's own name), as `sd_listen_fds` users take it; only among several do the
/// names decide, and then exactly one must be named [`FD_NAME`].
pub fn listen_fd(
    pid: u32,
    listen_pid: Option<&str>,
    listen_fds: Option<&str>,
    fd_names: Option<&str>,
) -> Result<Option<RawFd>, ActivationError> {
    let (Some(lpid), Some(lfds)) = (listen_pid, listen_fds) else {
        return Ok(None);
    };
    let lpid: u32 = lpid
        .trim()
        .parse()
        .map_err(|_| ActivationError::BadPid(lpid.into()))?;
    if lpid != pid {
        return Ok(None);
    }
    let count: usize = lfds
        .trim()
        .parse()
        .ok()
        .filter(|n| *n <= MAX_LISTEN_FDS)
        .ok_or_else(|| ActivationError::BadCount(lfds.into()))?;
    match count {
        0 => return Ok(None),
        1 => return Ok(Some(LISTEN_FDS_START)),
        _ => {}
    }
    let names = fd_names.ok_or(ActivationError::NoNames { count })?;
    let named: Vec<RawFd> = names
        .split(':')
        .take(count)
        .enumerate()
        .filter(|(_, n)| *n == FD_NAME)
        .map(|(i, _)| LISTEN_FDS_START + i as RawFd)
        .collect();
    match named.as_slice() {
        [] => Err(ActivationError::NotNamed {
            count,
            names: names.into(),
        }),
        [fd] => Ok(Some(*fd)),
        _ => Err(ActivationError::NamedTwice {
            fds: named,
            names: names.into(),
        }),
    }
}

/// "3 and 4", "3, 4 and 5".
fn fd_list(fds: &[RawFd]) -> String {
    match fds.split_last() {
        Some((last, [])) => last.to_string(),
        Some((last, rest)) => {
            let rest: Vec<String> = rest.iter().map(RawFd::to_string).collect();
            format!("{} and {last}", rest.join(", "))
        }
        None => String::new(),
    }
}

/// The variables of socket activation; [`take_listener`] removes them all.
pub const LISTEN_VARS: [&str; 3] = ["LISTEN_PID", "LISTEN_FDS", "LISTEN_FDNAMES"];

/// The listener systemd passed, if this process was socket-activated: checked to be a
/// listening `AF_UNIX` stream socket. The variables are removed (whoever they were meant
/// for), every fd passed to this process is made close-on-exec, and those other than the
/// listener are closed, so nothing the daemon starts (the spawner first) inherits either.
///
/// Must run while the process has one thread: before the async runtime starts, before the
/// spawner does (`std::env::remove_var` races with any other thread reading the environment).
pub fn take_listener() -> Result<Option<UnixListener>, ActivationError> {
    let var = |k| std::env::var(k).ok();
    let (lpid, lfds, names) = (var("LISTEN_PID"), var("LISTEN_FDS"), var("LISTEN_FDNAMES"));
    for k in LISTEN_VARS {
        // Single-threaded here (see above): nothing reads the environment meanwhile.
        std::env::remove_var(k);
    }
    let found = listen_fd(
        std::process::id(),
        lpid.as_deref(),
        lfds.as_deref(),
        names.as_deref(),
    );
    let count: RawFd = match (&found, lfds.as_deref()) {
        // Another process's LISTEN_PID: the fds (if any) are not ours to touch.
        (Ok(None), _) => 0,
        (_, Some(s)) => s.trim().parse().unwrap_or(0),
        (_, None) => 0,
    };
    let count = count.clamp(0, MAX_LISTEN_FDS as RawFd);
    let keep = found.as_ref().ok().copied().flatten();
    for other in LISTEN_FDS_START..LISTEN_FDS_START + count {
        // SAFETY: systemd passed fds 3..3+LISTEN_FDS open to this process; a closed one
        // only makes fcntl fail with EBADF, which is ignored. The borrow ends here.
        let b = unsafe { BorrowedFd::borrow_raw(other) };
        let _ = rustix::io::fcntl_setfd(b, rustix::io::FdFlags::CLOEXEC);
        if Some(other) != keep {
            // SAFETY: systemd passed this fd to the daemon, which has not wrapped it in any
            // owner (nothing else has run yet) and does not use it: closing it here leaves
            // no owner with a dangling fd. Its clients get ECONNREFUSED once systemd closes
            // its own copy, instead of waiting in a backlog nobody accepts from.
            drop(unsafe { std::os::fd::OwnedFd::from_raw_fd(other) });
        }
    }
    let Some(fd) = found? else {
        return Ok(None);
    };
    check_listener(fd)?;
    // SAFETY: `check_listener` showed `fd` is an open listening socket that systemd handed
    // to this process; nothing else in the daemon owns it, so the listener takes ownership.
    let listener = unsafe { UnixListener::from_raw_fd(fd) };
    listener
        .set_nonblocking(true)
        .map_err(|e| ActivationError::NotAListener {
            fd,
            why: ListenerFault::NonBlocking(
                rustix::io::Errno::from_io_error(&e).unwrap_or(rustix::io::Errno::IO),
            ),
        })?;
    Ok(Some(listener))
}

fn check_listener(fd: RawFd) -> Result<(), ActivationError> {
    let bad = |why: ListenerFault| ActivationError::NotAListener { fd, why };
    // SAFETY: the fd is only inspected while borrowed here; a closed fd makes the calls
    // below fail with EBADF, reported as an error.
    let b = unsafe { BorrowedFd::borrow_raw(fd) };
    let st = rustix::fs::fstat(b).map_err(|e| bad(ListenerFault::Stat(e)))?;
    if rustix::fs::FileType::from_raw_mode(st.st_mode) != rustix::fs::FileType::Socket {
        return Err(bad(ListenerFault::NotASocket));
    }
    let domain = rustix::net::sockopt::socket_domain(b)
        .map_err(|e| bad(ListenerFault::Option("SO_DOMAIN", e)))?;
    if domain != rustix::net::AddressFamily::UNIX {
        return Err(bad(ListenerFault::Family(domain)));
    }
    let ty = rustix::net::sockopt::socket_type(b)
        .map_err(|e| bad(ListenerFault::Option("SO_TYPE", e)))?;
    if ty != rustix::net::SocketType::STREAM {
        return Err(bad(ListenerFault::Type(ty)));
    }
    let listening = rustix::net::sockopt::socket_acceptconn(b)
        .map_err(|e| bad(ListenerFault::Option("SO_ACCEPTCONN", e)))?;
    if !listening {
        return Err(bad(ListenerFault::NotListening));
    }
    Ok(())
}

/// Where `sd_notify` messages go, if systemd (or a test) asked for them.
pub struct Notifier {
    target: Option<(UnixDatagram, SocketAddr)>,
    watchdog: Option<Duration>,
}

impl Notifier {
    /// Reads `NOTIFY_SOCKET` (`/path` or `@abstract`) and `WATCHDOG_USEC` (for this process
    /// when `WATCHDOG_PID` is set). Without them, every message is dropped.
    pub fn from_env() -> Notifier {
        let target = std::env::var_os("NOTIFY_SOCKET").and_then(|raw| {
            let addr = notify_addr(raw.as_encoded_bytes());
            let sock = UnixDatagram::unbound();
            match (addr, sock) {
                (Ok(a), Ok(s)) => Some((s, a)),
                (Err(e), _) | (_, Err(e)) => {
                    tracing::warn!("NOTIFY_SOCKET={raw:?} cannot be used: {}; systemd will not hear from airlock", crate::report::chain(&e));
                    None
                }
            }
        });
        let for_me = std::env::var("WATCHDOG_PID")
            .ok()
            .is_none_or(|p| p.trim().parse() == Ok(std::process::id()));
        let watchdog = std::env::var("WATCHDOG_USEC")
            .ok()
            .and_then(|u| u.trim().parse::<u64>().ok())
            .filter(|u| *u > 0 && for_me)
            .map(Duration::from_micros);
        Notifier { target, watchdog }
    }

    /// Whether anyone listens.
    pub fn enabled(&self) -> bool {
        self.target.is_some()
    }

    /// How often to send `WATCHDOG=1` (half of `WatchdogSec`), if the watchdog is on.
    pub fn watchdog_interval(&self) -> Option<Duration> {
        self.watchdog.filter(|_| self.enabled()).map(|d| d / 2)
    }

    /// Sends one message (lines of `KEY=VALUE`); a failure is logged, never fatal.
    pub fn send(&self, msg: &str) {
        if let Some((sock, addr)) = &self.target {
            if let Err(e) = sock.send_to_addr(msg.as_bytes(), addr) {
                tracing::debug!("sd_notify {msg:?}: {}", crate::report::chain(&e));
            }
        }
    }

    pub fn ready(&self, status: &str) {
        self.send(&format!("READY=1\nSTATUS={status}"));
    }

    pub fn status(&self, status: &str) {
        self.send(&format!("STATUS={status}"));
    }

    pub fn reloading(&self) {
        self.send("RELOADING=1\nSTATUS=reloading policies");
    }

    pub fn stopping(&self) {
        self.send("STOPPING=1\nSTATUS=stopping: cancelling calls in flight");
    }

    pub fn watchdog(&self) {
        self.send("WATCHDOG=1");
    }
}

fn notify_addr(raw: &[u8]) -> std::io::Result<SocketAddr> {
    match raw.first() {
        Some(b'@') => {
            use std::os::linux::net::SocketAddrExt;
            SocketAddr::from_abstract_name(&raw[1..])
        }
        Some(b'/') => SocketAddr::from_pathname(
            <std::ffi::OsStr as std::os::unix::ffi::OsStrExt>::from_bytes(raw),
        ),
        _ => Err(std::io::Error::new(
            std::io::ErrorKind::InvalidInput,
            "neither an absolute path nor @ and an abstract name",
        )),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn activation_is_for_this_pid_and_names_the_listener() {
        assert_eq!(listen_fd(7, None, None, None), Ok(None));
        assert_eq!(listen_fd(7, Some("8"), Some("1"), Some(FD_NAME)), Ok(None));
        assert_eq!(listen_fd(7, Some("7"), Some("0"), None), Ok(None));
        assert_eq!(
            listen_fd(7, Some("7"), Some("1"), Some(FD_NAME)),
            Ok(Some(3))
        );
        assert_eq!(
            listen_fd(7, Some("7"), Some("3"), Some("x:y:airlock")),
            Ok(Some(5))
        );
        assert_eq!(
            listen_fd(7, Some("7"), Some("2"), None),
            Err(ActivationError::NoNames { count: 2 })
        );
        assert!(matches!(
            listen_fd(7, Some("7"), Some("2"), Some("x:y")),
            Err(ActivationError::NotNamed { count: 2, .. })
        ));
        // A name past the count does not count.
        assert!(matches!(
            listen_fd(7, Some("7"), Some("2"), Some("x:y:airlock")),
            Err(ActivationError::NotNamed { .. })
        ));
        assert_eq!(
            listen_fd(7, Some("7"), Some("2"), Some("unknown:airlock")),
            Ok(Some(4))
        );
        // Two listeners named airlock: refused, both named, rather than one left unserved.
        let two = listen_fd(7, Some("7"), Some("3"), Some("airlock:x:airlock")).unwrap_err();
        assert_eq!(
            two,
            ActivationError::NamedTwice {
                fds: vec![3, 5],
                names: "airlock:x:airlock".into()
            }
        );
        assert!(
            two.to_string()
                .contains("fds 3 and 5 are each named \"airlock\""),
            "{two}"
        );
        assert!(matches!(
            listen_fd(7, Some("seven"), Some("1"), Some(FD_NAME)),
            Err(ActivationError::BadPid(_))
        ));
        assert!(matches!(
            listen_fd(7, Some("7"), Some("-1"), Some(FD_NAME)),
            Err(ActivationError::BadCount(_))
        ));
        assert!(matches!(
            listen_fd(7, Some("7"), Some("99999"), Some(FD_NAME)),
            Err(ActivationError::BadCount(_))
        ));
    }

    /// What `systemd-socket-activate` without `--fdname` passes (no `LISTEN_FDNAMES`), what
    /// sd-daemon calls an unnamed fd (`unknown`), and what a `.socket` unit without
    /// `FileDescriptorName=` passes (its own name): one fd is the listener whatever its name.
    #[test]
    fn a_single_passed_fd_is_the_listener_whatever_its_name() {
        for names in [
            None,
            Some("unknown"),
            Some(""),
            Some("web.socket"),
            Some(FD_NAME),
            Some("web:airlock"),
        ] {
            assert_eq!(
                listen_fd(7, Some("7"), Some("1"), names),
                Ok(Some(3)),
                "LISTEN_FDNAMES={names:?}"
            );
        }
        // Still only for this process.
        assert_eq!(listen_fd(7, Some("8"), Some("1"), None), Ok(None));
    }

    #[test]
    fn notify_addresses_are_paths_or_abstract_names() {
        assert!(notify_addr(b"/run/systemd/notify").is_ok());
        assert!(notify_addr(b"@sd-notify").is_ok());
        assert!(notify_addr(b"relative").is_err());
        assert!(notify_addr(b"").is_err());
    }

    #[test]
    fn a_datagram_socket_that_is_not_listening_is_refused() {
        let (a, _b) = UnixDatagram::pair().unwrap();
        let fd = std::os::fd::AsRawFd::as_raw_fd(&a);
        let e = check_listener(fd).unwrap_err();
        let e = crate::report::chain(&e).to_string();
        assert!(e.contains("socket type"), "{e}");
        let l = UnixListener::bind(tempfile::tempdir().unwrap().path().join("s")).unwrap();
        assert_eq!(check_listener(std::os::fd::AsRawFd::as_raw_fd(&l)), Ok(()));
        let s = std::os::unix::net::UnixStream::pair().unwrap().0;
        let e = check_listener(std::os::fd::AsRawFd::as_raw_fd(&s)).unwrap_err();
        let e = crate::report::chain(&e).to_string();
        assert!(e.contains("not listening"), "{e}");
    }
}
