//! The daemon <-> spawner protocol, over a `SOCK_SEQPACKET` pair that is the spawner's stdin
//! at start (one message per packet, descriptors as `SCM_RIGHTS`):
//! - once, spawner to daemon: [`READY`] (PDEATHSIG is set and the daemon is its parent);
//! - once per profile (and uid mode), daemon to spawner, before its first worker:
//!   [`TEMPLATE`] + the template's id (u64 LE) + its seccomp programs ([`template_message`]):
//!   the stack its template installs, then the seal each worker installs last; no answer;
//! - per worker, daemon to spawner: [`SPAWN`] + the template's id, with four or five
//!   descriptors ([`SpawnFds`]: the launcher channel, the worker's stdin, stdout and stderr,
//!   then the progress pipe's write end when the caller asked for progress);
//! - its answer, spawner to daemon ([`Reply`]): [`OK`] + the worker's pid (i32 LE) with its
//!   pidfd, or [`ERR`] + an errno (i32 LE);
//! - once a reloaded policy dropped a profile, daemon to spawner: [`FORGET`] + the id: its
//!   template is stopped; no answer.
//!
//! Between the spawner and a template (a `SOCK_SEQPACKET` pair the spawner makes): once,
//! template to spawner, [`READY`] or a [`Reply::Refused`] with the errno of the step that
//! failed; then per worker the same [`SPAWN`] message with its descriptors, and its
//! [`Reply`].

use std::os::fd::{AsFd, BorrowedFd, OwnedFd};

/// The spawner is up.
pub(crate) const READY: u8 = b'r';
/// Fork a worker.
pub(crate) const SPAWN: u8 = b's';
/// The worker is forked: its pid follows, its pidfd rides along.
pub(crate) const OK: u8 = b'k';
/// The fork failed: the errno follows.
pub(crate) const ERR: u8 = b'e';
/// A template's programs.
pub(crate) const TEMPLATE: u8 = b't';
/// Stop a template.
pub(crate) const FORGET: u8 = b'f';

/// The largest request: a template's programs (the kernel takes at most 4096 instructions of
/// 8 bytes per filter).
pub(crate) const MAX_REQUEST: usize = 256 * 1024;
/// Programs per template message part, and instructions per program.
const MAX_PROGRAMS: usize = 8;
const MAX_INSTRUCTIONS: usize = 4096;

/// A classic-BPF program, `(code, jt, jf, k)` per instruction.
pub(crate) type Encoded = Vec<(u16, u8, u8, u32)>;

/// A request the spawner received, decoded.
#[derive(Debug, PartialEq, Eq)]
pub(crate) enum Request {
    /// Fork a worker from template `id`.
    Spawn(u64),
    /// Template `id` installs `stack`; its workers install `seal` last.
    Template {
        id: u64,
        stack: Vec<Encoded>,
        seal: Vec<Encoded>,
    },
    /// Stop template `id`.
    Forget(u64),
}

fn tagged(tag: u8, id: u64) -> [u8; 9] {
    let mut m = [0u8; 9];
    m[0] = tag;
    m[1..].copy_from_slice(&id.to_le_bytes());
    m
}

/// [`Request::Spawn`] on the wire (its descriptors ride along).
pub(crate) fn spawn_message(id: u64) -> [u8; 9] {
    tagged(SPAWN, id)
}

/// [`Request::Forget`] on the wire.
pub(crate) fn forget_message(id: u64) -> [u8; 9] {
    tagged(FORGET, id)
}

/// [`Request::Template`] on the wire: tag, id, then each part (stack, seal) as a count of
/// programs (u8) and each program as its length (u32 LE) and its instructions (code u16 LE,
/// jt, jf, k u32 LE).
pub(crate) fn template_message(id: u64, stack: &[Encoded], seal: &[Encoded]) -> Vec<u8> {
    let mut m = tagged(TEMPLATE, id).to_vec();
    for part in [stack, seal] {
        m.push(part.len() as u8);
        for program in part {
            m.extend_from_slice(&(program.len() as u32).to_le_bytes());
            for &(code, jt, jf, k) in program {
                m.extend_from_slice(&code.to_le_bytes());
                m.push(jt);
                m.push(jf);
                m.extend_from_slice(&k.to_le_bytes());
            }
        }
    }
    m
}

/// A request as the protocol says (with `fds` descriptors), or `None`: refused with EINVAL.
pub(crate) fn decode_request(m: &[u8], fds: usize) -> Option<Request> {
    let (&tag, rest) = m.split_first()?;
    let id = u64::from_le_bytes(rest.get(..8)?.try_into().ok()?);
    let rest = &rest[8..];
    match tag {
        SPAWN if rest.is_empty() && (FDS..=MAX_FDS).contains(&fds) => Some(Request::Spawn(id)),
        FORGET if rest.is_empty() && fds == 0 => Some(Request::Forget(id)),
        TEMPLATE if fds == 0 => {
            let mut at = 0usize;
            let mut part = || -> Option<Vec<Encoded>> {
                let count = usize::from(*rest.get(at)?);
                at += 1;
                if count > MAX_PROGRAMS {
                    return None;
                }
                let mut programs = Vec::with_capacity(count);
                for _ in 0..count {
                    let len = u32::from_le_bytes(rest.get(at..at + 4)?.try_into().ok()?) as usize;
                    at += 4;
                    if len == 0 || len > MAX_INSTRUCTIONS {
                        return None;
                    }
                    let bytes = rest.get(at..at.checked_add(len.checked_mul(8)?)?)?;
                    at += len * 8;
                    programs.push(
                        bytes
                            .chunks_exact(8)
                            .map(|i| {
                                (
                                    u16::from_le_bytes([i[0], i[1]]),
                                    i[2],
                                    i[3],
                                    u32::from_le_bytes([i[4], i[5], i[6], i[7]]),
                                )
                            })
                            .collect(),
                    );
                }
                Some(programs)
            };
            let stack = part()?;
            let seal = part()?;
            if at != rest.len() || stack.is_empty() {
                return None;
            }
            Some(Request::Template { id, stack, seal })
        }
        _ => None,
    }
}

/// Descriptors per spawn request: channel, stdin, stdout, stderr, and the progress pipe
/// when there is one.
pub(crate) const FDS: usize = 4;
pub(crate) const MAX_FDS: usize = FDS + 1;

/// Bytes of a [`Reply`].
pub(crate) const REPLY_LEN: usize = 5;

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
        let m = spawn_message(7);
        assert_eq!(decode_request(&m, 3), None);
        assert_eq!(decode_request(&m, 4), Some(Request::Spawn(7)));
        assert_eq!(decode_request(&m, 5), Some(Request::Spawn(7)));
        assert_eq!(decode_request(&m, 6), None);
        assert_eq!(decode_request(&m[..8], 4), None);
        assert_eq!(decode_request(&[READY; 9], 4), None);
        assert_eq!(decode_request(&[OK; 9], 5), None);
        assert_eq!(
            decode_request(&forget_message(9), 0),
            Some(Request::Forget(9))
        );
        assert_eq!(decode_request(&forget_message(9), 1), None);
    }

    #[test]
    fn template_programs_round_trip_and_malformed_ones_are_refused() {
        let stack = vec![
            vec![(1u16, 2u8, 3u8, 4u32), (0x15, 0, 1, u32::MAX)],
            vec![(6, 0, 0, 0)],
        ];
        let seal = vec![vec![(6u16, 0u8, 0u8, 0x7fff_0000u32)]];
        let m = template_message(3, &stack, &seal);
        assert_eq!(
            decode_request(&m, 0),
            Some(Request::Template {
                id: 3,
                stack: stack.clone(),
                seal: seal.clone()
            })
        );
        // An empty seal is fine (a profile whose rules leave the carved calls alone).
        let m2 = template_message(4, &stack, &[]);
        assert!(matches!(
            decode_request(&m2, 0),
            Some(Request::Template { .. })
        ));
        // Descriptors, truncation, a trailing byte, an empty stack, an empty program.
        assert_eq!(decode_request(&m, 1), None);
        for cut in 1..m.len() {
            assert_eq!(decode_request(&m[..cut], 0), None, "cut at {cut}");
        }
        let mut long = m.clone();
        long.push(0);
        assert_eq!(decode_request(&long, 0), None);
        assert_eq!(decode_request(&template_message(5, &[], &seal), 0), None);
        assert_eq!(
            decode_request(&template_message(5, &[vec![]], &seal), 0),
            None
        );
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
