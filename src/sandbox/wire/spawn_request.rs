//! The daemon <-> spawner protocol, over a `SOCK_SEQPACKET` pair that is the spawner's stdin
//! at start (one message per packet, descriptors as `SCM_RIGHTS`):
//! - once, spawner to daemon: [`READY`] (PDEATHSIG is set and the daemon is its parent);
//! - per worker, daemon to spawner: [`SPAWN`] with four or five descriptors ([`SpawnFds`]:
//!   the launcher channel, the worker's stdin, stdout and stderr, then the progress pipe's
//!   write end when the caller asked for progress);
//! - its answer, spawner to daemon ([`Reply`]): [`OK`] + the worker's pid (i32 LE) with its
//!   pidfd, or [`ERR`] + an errno (i32 LE).

use std::os::fd::{AsFd, BorrowedFd, OwnedFd};

/// The spawner is up.
pub(crate) const READY: u8 = b'r';
/// Fork a worker.
pub(crate) const SPAWN: u8 = b's';
/// The worker is forked: its pid follows, its pidfd rides along.
pub(crate) const OK: u8 = b'k';
/// The fork failed: the errno follows.
pub(crate) const ERR: u8 = b'e';

/// Descriptors per spawn request: channel, stdin, stdout, stderr, and the progress pipe
/// when there is one.
pub(crate) const FDS: usize = 4;
pub(crate) const MAX_FDS: usize = FDS + 1;

/// Bytes of a [`Reply`].
pub(crate) const REPLY_LEN: usize = 5;

/// Whether a request (its one tag byte, and the number of descriptors that came with it)
/// asks for a worker as the protocol says; anything else is refused with EINVAL.
pub(crate) fn is_spawn_request(tag: u8, fds: usize) -> bool {
    tag == SPAWN && (FDS..=MAX_FDS).contains(&fds)
}

/// The descriptors of one spawn request, by role.
#[derive(Debug)]
pub(crate) struct SpawnFds {
    pub channel: OwnedFd,
    pub stdin: OwnedFd,
    pub stdout: OwnedFd,
    pub stderr: OwnedFd,
    pub progress: Option<OwnedFd>,
}

impl SpawnFds {
    /// The received descriptors, in protocol order; `None` for too few or too many.
    pub(crate) fn from_received(fds: Vec<OwnedFd>) -> Option<SpawnFds> {
        if !(FDS..=MAX_FDS).contains(&fds.len()) {
            return None;
        }
        let mut fds = fds.into_iter();
        Some(SpawnFds {
            channel: fds.next()?,
            stdin: fds.next()?,
            stdout: fds.next()?,
            stderr: fds.next()?,
            progress: fds.next(),
        })
    }
}

/// For the daemon's side: the descriptors of one spawn request, in protocol order.
pub(crate) fn request_fds<'a>(
    channel: &'a OwnedFd,
    stdin: &'a OwnedFd,
    stdout: &'a OwnedFd,
    stderr: &'a OwnedFd,
    progress: Option<&'a OwnedFd>,
) -> Vec<BorrowedFd<'a>> {
    let mut fds = vec![
        channel.as_fd(),
        stdin.as_fd(),
        stdout.as_fd(),
        stderr.as_fd(),
    ];
    fds.extend(progress.map(|p| p.as_fd()));
    fds
}

/// The spawner's answer to one request.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Reply {
    /// Forked: the worker's pid (its pidfd comes with the message).
    Spawned(i32),
    /// Not forked: the errno.
    Refused(i32),
}

impl Reply {
    pub(crate) fn encode(self) -> [u8; REPLY_LEN] {
        let (tag, number) = match self {
            Reply::Spawned(pid) => (OK, pid),
            Reply::Refused(errno) => (ERR, errno),
        };
        let mut message = [0u8; REPLY_LEN];
        message[0] = tag;
        message[1..].copy_from_slice(&number.to_le_bytes());
        message
    }

    /// `None` for anything but exactly one well-formed reply.
    pub(crate) fn decode(message: &[u8]) -> Option<Reply> {
        let [tag, a, b, c, d] = *message else {
            return None;
        };
        let number = i32::from_le_bytes([a, b, c, d]);
        match tag {
            OK => Some(Reply::Spawned(number)),
            ERR => Some(Reply::Refused(number)),
            _ => None,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn replies_round_trip() {
        for reply in [
            Reply::Spawned(1),
            Reply::Spawned(i32::MAX),
            Reply::Refused(libc::EAGAIN),
            Reply::Refused(0),
        ] {
            assert_eq!(Reply::decode(&reply.encode()), Some(reply));
        }
        assert_eq!(Reply::Spawned(0x0102_0304).encode(), [OK, 4, 3, 2, 1]);
    }

    #[test]
    fn malformed_replies_are_refused() {
        assert_eq!(Reply::decode(&[]), None);
        assert_eq!(Reply::decode(&[OK, 1, 0, 0]), None);
        assert_eq!(Reply::decode(&[OK, 1, 0, 0, 0, 0]), None);
        assert_eq!(Reply::decode(&[READY, 1, 0, 0, 0]), None);
        assert_eq!(Reply::decode(&[SPAWN, 1, 0, 0, 0]), None);
    }

    #[test]
    fn a_spawn_request_has_four_or_five_descriptors() {
        assert!(!is_spawn_request(SPAWN, 3));
        assert!(is_spawn_request(SPAWN, 4));
        assert!(is_spawn_request(SPAWN, 5));
        assert!(!is_spawn_request(SPAWN, 6));
        assert!(!is_spawn_request(READY, 4));
        assert!(!is_spawn_request(OK, 5));
    }

    fn pipe_ends(n: usize) -> Vec<OwnedFd> {
        let mut fds = Vec::new();
        while fds.len() < n {
            let (r, w) = rustix::pipe::pipe().expect("pipe");
            fds.push(r);
            fds.push(w);
        }
        fds.truncate(n);
        fds
    }

    #[test]
    fn request_descriptors_keep_their_roles_across_the_wire() {
        use std::os::fd::AsRawFd;
        for with_progress in [false, true] {
            let fds = pipe_ends(if with_progress { 5 } else { 4 });
            let raw: Vec<i32> = fds.iter().map(|f| f.as_raw_fd()).collect();
            let sent: Vec<i32> = request_fds(&fds[0], &fds[1], &fds[2], &fds[3], fds.get(4))
                .iter()
                .map(|f| f.as_raw_fd())
                .collect();
            assert_eq!(sent, raw);
            let got = SpawnFds::from_received(fds).expect("a well-formed request");
            assert_eq!(got.channel.as_raw_fd(), raw[0]);
            assert_eq!(got.stdin.as_raw_fd(), raw[1]);
            assert_eq!(got.stdout.as_raw_fd(), raw[2]);
            assert_eq!(got.stderr.as_raw_fd(), raw[3]);
            assert_eq!(got.progress.map(|p| p.as_raw_fd()), raw.get(4).copied());
        }
        assert!(SpawnFds::from_received(pipe_ends(3)).is_none());
        assert!(SpawnFds::from_received(pipe_ends(6)).is_none());
    }
}
