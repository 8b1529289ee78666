//! A worker's failure reports, made without allocating: a [`Failure`] names its step, its
//! errno and a [`Message`] (what it names lives in the template's prepared plan), and is
//! rendered into a [`Line`] on the worker's stack, JSON-escaped and cut to fit.

use std::ffi::CStr;
use std::fmt::{self, Write as _};

use crate::sandbox::wire::{LandlockStatus, Step};

/// A failed step in a worker. It holds no allocation: the worker renders it into a
/// [`Line`] on its stack; what it names lives in the template's prepared [`Plan`].
#[derive(Debug, Clone, Copy)]
pub(super) struct Failure<'a> {
    pub step: Step,
    pub errno: i32,
    pub message: Message<'a>,
}

/// What a [`Failure`] says, rendered by its `Display`.
#[derive(Debug, Clone, Copy)]
pub(super) enum Message<'a> {
    /// A fixed sentence.
    Text(&'static str),
    /// `{call}: {the errno's description}`.
    Call(&'static str),
    /// `{what} {path}: {the errno's description}`.
    Path(&'static str, &'a CStr),
    /// `{limit} = {value}: {the errno's description}`.
    Rlimit(&'static str, u64),
    /// The parent is not the daemon.
    Parent { got: i32, expected: i32 },
    /// Capability sets left after dropping: each name with a non-zero mask.
    Left([(&'static str, u64); 3]),
    /// The uid switch did not give what was asked.
    Ids {
        uid: u32,
        gid: u32,
        now: (u32, u32, u32, u32),
    },
    /// The kernel enforces less of the ruleset than the profile requires.
    Landlock {
        status: LandlockStatus,
        kernel_abi: u8,
        profile_abi: u8,
    },
    /// A seccomp filter (`which`: "seal" or "template") the kernel refused.
    Filter(&'static str, usize),
}

impl<'a> Failure<'a> {
    pub(super) fn new(step: Step, errno: i32, message: Message<'a>) -> Self {
        Failure {
            step,
            errno,
            message,
        }
    }

    /// A failed call: its errno, and the message naming the call.
    pub(super) fn call(step: Step, call: &'static str, e: rustix::io::Errno) -> Self {
        Failure::new(step, e.raw_os_error(), Message::Call(call))
    }

    /// The report line of this failure, written into `line` (a worker's stack).
    pub(super) fn write_line(&self, line: &mut Line) {
        line.clear();
        let _ = write!(
            line,
            r#"{{"report":"failed","step":"{}","errno":{},"message":""#,
            self.step.as_str(),
            self.errno
        );
        line.escaping = true;
        let _ = write!(line, "{self}");
        line.escaping = false;
        line.finish("\"}\n");
    }
}

impl fmt::Display for Failure<'_> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let why = Describe(self.errno);
        match self.message {
            Message::Text(text) => f.write_str(text),
            Message::Call(call) => write!(f, "{call}: {why}"),
            Message::Path(what, path) => {
                write!(f, "{what} ")?;
                for chunk in path.to_bytes().utf8_chunks() {
                    f.write_str(chunk.valid())?;
                    if !chunk.invalid().is_empty() {
                        f.write_char(char::REPLACEMENT_CHARACTER)?;
                    }
                }
                write!(f, ": {why}")
            }
            Message::Rlimit(name, value) => write!(f, "{name} = {value}: {why}"),
            Message::Parent { got, expected } => write!(
                f,
                "the parent is pid {got}, expected the daemon, pid {expected}"
            ),
            Message::Left(sets) => {
                f.write_str("capabilities remain after dropping:")?;
                let mut first = true;
                for (name, mask) in sets {
                    if mask != 0 {
                        let sep = if first { " " } else { ", " };
                        write!(f, "{sep}{name} {mask:#x}")?;
                        first = false;
                    }
                }
                Ok(())
            }
            Message::Ids { uid, gid, now } => write!(
                f,
                "asked for uid {uid} gid {gid}, have (ruid, euid, rgid, egid) {now:?}"
            ),
            Message::Landlock {
                status,
                kernel_abi,
                profile_abi,
            } => write!(
                f,
                "the ruleset is {} on a kernel with Landlock ABI {kernel_abi}; the profile requires ABI {profile_abi} fully enforced",
                status.as_str()
            ),
            Message::Filter(which, index) => {
                write!(f, "cannot install {which} filter {index}: {why}")
            }
        }
    }
}

/// An errno's description, from a fixed table (libc's `strerror` may translate and
/// allocate); others by number.
struct Describe(i32);

impl fmt::Display for Describe {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let text = match self.0 {
            libc::EPERM => "Operation not permitted",
            libc::ENOENT => "No such file or directory",
            libc::ESRCH => "No such process",
            libc::EINTR => "Interrupted system call",
            libc::EIO => "Input/output error",
            libc::E2BIG => "Argument list too long",
            libc::ENOEXEC => "Exec format error",
            libc::EBADF => "Bad file descriptor",
            libc::EAGAIN => "Resource temporarily unavailable",
            libc::ENOMEM => "Cannot allocate memory",
            libc::EACCES => "Permission denied",
            libc::EFAULT => "Bad address",
            libc::EBUSY => "Device or resource busy",
            libc::ENOTDIR => "Not a directory",
            libc::EISDIR => "Is a directory",
            libc::EINVAL => "Invalid argument",
            libc::EMFILE => "Too many open files",
            libc::ETXTBSY => "Text file busy",
            libc::EPIPE => "Broken pipe",
            libc::ENAMETOOLONG => "File name too long",
            libc::ENOSYS => "Function not implemented",
            libc::ELOOP => "Too many levels of symbolic links",
            libc::EOPNOTSUPP => "Operation not supported",
            _ => "",
        };
        if !text.is_empty() {
            f.write_str(text)?;
        }
        let sep = if text.is_empty() { "" } else { " " };
        write!(f, "{sep}(os error {})", self.0)
    }
}

/// One report line, built on the stack: what a worker writes to the daemon. Longer text is
/// cut at a character boundary, and the line still ends as valid JSON.
pub(super) struct Line {
    buf: [u8; Line::CAPACITY],
    len: usize,
    /// Escape what is written as the inside of a JSON string.
    escaping: bool,
}

impl Line {
    const CAPACITY: usize = 1024;
    /// Kept free for the line's end.
    const END: usize = 8;

    pub(super) fn new() -> Line {
        Line {
            buf: [0; Line::CAPACITY],
            len: 0,
            escaping: false,
        }
    }

    fn clear(&mut self) {
        self.len = 0;
        self.escaping = false;
    }

    /// Appends `bytes` whole, if they fit before the space kept for the end.
    fn push(&mut self, bytes: &[u8]) -> bool {
        let end = self.len + bytes.len();
        if end > Line::CAPACITY - Line::END {
            return false;
        }
        match self.buf.get_mut(self.len..end) {
            Some(room) => {
                room.copy_from_slice(bytes);
                self.len = end;
                true
            }
            None => false,
        }
    }

    /// Ends the line with `end` (at most [`Line::END`] bytes), in the space kept for it.
    pub(super) fn finish(&mut self, end: &str) {
        let stop = self.len + end.len();
        if let Some(room) = self.buf.get_mut(self.len..stop) {
            room.copy_from_slice(end.as_bytes());
            self.len = stop;
        }
    }

    pub(super) fn bytes(&self) -> &[u8] {
        self.buf.get(..self.len).unwrap_or_default()
    }
}

impl fmt::Write for Line {
    fn write_str(&mut self, s: &str) -> fmt::Result {
        if !self.escaping {
            self.push(s.as_bytes());
            return Ok(());
        }
        for c in s.chars() {
            let mut utf8 = [0u8; 6];
            let bytes: &[u8] = match c {
                '"' => b"\\\"",
                '\\' => b"\\\\",
                c if (c as u32) < 0x20 => {
                    let hex = b"0123456789abcdef";
                    let n = c as usize;
                    utf8 = [b'\\', b'u', b'0', b'0', hex[n >> 4], hex[n & 0xf]];
                    &utf8
                }
                c => c.encode_utf8(&mut utf8).as_bytes(),
            };
            if !self.push(bytes) {
                break;
            }
        }
        Ok(())
    }
}
