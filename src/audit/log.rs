//! The durable audit log: JSON Lines in the state dir (`audit_log`), mode 0600, rotated by
//! size with a retention count, each line carrying the SHA-256 of the line before it.
//!
//! Files, newest last: `audit.jsonl.N` (oldest kept) ... `audit.jsonl.1`, `audit.jsonl`.
//! The chain runs across them. Every file begins with a **header** line (`"kind":"header"`),
//! itself a link of the chain (it has a `seq` and a `prev` like every line), whose detail
//! names the log (`log`, a random id chosen at genesis), the file's index in the log (`file`,
//! 0 for the first), how the file follows the one before it (`chain`: `genesis` for the very
//! first file, `rotated` after a rotation, `restarted` when the daemon could not continue the
//! chain, with a `reason`), the last line of the file before it (`after`: its seq and
//! SHA-256), and what retention keeps once this file exists (`retained`: the index and the
//! first seq of the oldest file kept). `verify` tells files retention removed (older than
//! `retained`) from files removed by anything else.
//!
//! Rotation creates the next file first (`audit.jsonl.next`: its header written and
//! fsynced), then renames the current file and the older ones up by one and the next file
//! into place, and only then removes the files past `audit_log_keep`, oldest first. A
//! rotation that fails (no inode, no space) leaves every file as it was: the line goes to
//! the current file, and the rotation is tried again at the next write.
//!
//! A line is written with one `write(2)` of the whole line; a write that fails part-way is cut
//! back (`ftruncate`) so the file never keeps half a line. A partial last line found at open
//! (a crash or power loss mid-write of an event that was never reported durable) is cut too,
//! with a warning.

use std::fs::File;
use std::io::{Read, Seek, SeekFrom, Write};
use std::os::unix::fs::{OpenOptionsExt, PermissionsExt};
use std::path::{Path, PathBuf};

use serde::{Deserialize, Serialize};
use serde_json::Value;
use sha2::{Digest, Sha256};

mod verify;
pub use verify::{check, verify, Broken, Removed, Verified};

/// The `prev` of the first line ever written (the genesis header).
pub const GENESIS: &str = "0000000000000000000000000000000000000000000000000000000000000000";

/// The `kind` of a file's first line.
pub const HEADER: &str = "header";

/// The version of the header's detail.
const FORMAT: u64 = 1;

/// How much of a file's end is read to find its last line (an event is at most
/// [`super::MAX_EVENT`] bytes plus its envelope).
const TAIL: u64 = 256 * 1024;

/// How much of a file's start is read to find its header.
const HEAD: u64 = 64 * 1024;

#[derive(Debug, thiserror::Error)]
pub enum LogError {
    #[error("{path}: cannot {op} the audit log")]
    Io {
        op: &'static str,
        path: PathBuf,
        source: std::io::Error,
    },
    #[error("{path}: the audit log is not a regular file")]
    NotRegular { path: PathBuf },
}

fn io<'a>(op: &'static str, path: &'a Path) -> impl FnOnce(std::io::Error) -> LogError + 'a {
    move |source| LogError::Io {
        op,
        path: path.to_path_buf(),
        source,
    }
}

/// Lowercase hex SHA-256 of `bytes`.
pub fn sha256_hex(bytes: &[u8]) -> String {
    hex(&Sha256::digest(bytes))
}

pub fn hex(bytes: &[u8]) -> String {
    use std::fmt::Write as _;
    let mut s = String::with_capacity(bytes.len() * 2);
    for b in bytes {
        let _ = write!(s, "{b:02x}");
    }
    s
}

/// The `n`-th rotated file of `path` (`n` >= 1), or `path` itself for 0.
pub fn rotated(path: &Path, n: usize) -> PathBuf {
    if n == 0 {
        return path.to_path_buf();
    }
    let mut s = path.as_os_str().to_os_string();
    s.push(format!(".{n}"));
    PathBuf::from(s)
}

/// Where the next file is prepared before a rotation puts it in place.
fn next_path(path: &Path) -> PathBuf {
    let mut s = path.as_os_str().to_os_string();
    s.push(".next");
    PathBuf::from(s)
}

/// The rotated files that exist, as (number, path), lowest number (newest) first. The
/// directory is listed, so a hole in the numbers (a rename that failed) hides no file.
fn numbered(path: &Path) -> Vec<(usize, PathBuf)> {
    let (Some(dir), Some(name)) = (path.parent(), path.file_name()) else {
        return vec![];
    };
    let dir = if dir.as_os_str().is_empty() {
        Path::new(".")
    } else {
        dir
    };
    let prefix = format!("{}.", name.to_string_lossy());
    let mut out: Vec<(usize, PathBuf)> = std::fs::read_dir(dir)
        .into_iter()
        .flatten()
        .flatten()
        .filter_map(|e| {
            let n = e.file_name();
            let n = n.to_str()?.strip_prefix(&prefix)?;
            if n.is_empty() || !n.bytes().all(|b| b.is_ascii_digit()) || n.starts_with('0') {
                return None;
            }
            let n: usize = n.parse().ok()?;
            Some((n, rotated(path, n)))
        })
        .collect();
    out.sort();
    out
}

/// The log's files that exist, oldest first.
pub fn files(path: &Path) -> Vec<PathBuf> {
    let mut out: Vec<PathBuf> = numbered(path).into_iter().rev().map(|(_, p)| p).collect();
    if path.exists() {
        out.push(path.to_path_buf());
    }
    out
}

/// Where the chain stands: the next line's seq and `prev`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Head {
    pub next_seq: u64,
    pub prev: String,
}

impl Default for Head {
    fn default() -> Self {
        Head {
            next_seq: 0,
            prev: GENESIS.to_string(),
        }
    }
}

impl Head {
    /// The head after `line` (a line of seq `self.next_seq`).
    fn after(&self, line: &[u8]) -> Head {
        Head {
            next_seq: self.next_seq + 1,
            prev: sha256_hex(line),
        }
    }
}

/// How a file follows the one before it.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Chain {
    /// The first file of the log: seq 0, `prev` [`GENESIS`].
    Genesis,
    /// The successor of the file rotated before it.
    Rotated,
    /// The daemon could not continue the chain (its `reason` says why): `verify` reports it.
    Restarted,
}

/// The last line of the file before: its seq and SHA-256.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct After {
    pub seq: u64,
    pub sha256: String,
}

/// What retention keeps once the file holding this record exists: the oldest file kept
/// (its index in the log) and its first seq. Files older than it were removed by retention.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Retained {
    pub first_file: Option<u64>,
    pub first_seq: Option<u64>,
}

/// The detail of a header line.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Header {
    pub format: u64,
    /// The log's id, chosen at genesis, the same in every file.
    pub log: String,
    /// The file's index in the log: 0 for the genesis file, one more for each next file.
    pub file: u64,
    pub chain: Chain,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub reason: Option<String>,
    #[serde(default)]
    pub after: Option<After>,
    pub retained: Retained,
}

#[derive(Serialize)]
struct HeaderLine<'a> {
    seq: u64,
    time: String,
    time_ms: u64,
    kind: &'static str,
    detail: &'a Header,
    prev: &'a str,
}

fn header_text(head: &Head, h: &Header) -> String {
    let time_ms = super::now_ms();
    serde_json::to_string(&HeaderLine {
        seq: head.next_seq,
        time: super::format_rfc3339(time_ms),
        time_ms,
        kind: HEADER,
        detail: h,
        prev: &head.prev,
    })
    .unwrap_or_default()
}

/// The seq and header of `line`, when it is a header.
fn header_of(line: &[u8]) -> Option<(u64, Header)> {
    let v: Value = serde_json::from_slice(line).ok()?;
    if v.get("kind").and_then(Value::as_str) != Some(HEADER) {
        return None;
    }
    let seq = v.get("seq").and_then(Value::as_u64)?;
    let h = serde_json::from_value(v.get("detail")?.clone()).ok()?;
    Some((seq, h))
}

/// The seq of `line`, when it is a JSON line with one.
fn seq_of(line: &[u8]) -> Option<u64> {
    serde_json::from_slice::<Value>(line)
        .ok()?
        .get("seq")
        .and_then(Value::as_u64)
}

/// A new log id: 16 random bytes, hex.
fn new_log_id() -> String {
    let mut b = [0u8; 16];
    // SAFETY: `b` is a valid, writable buffer of `b.len()` bytes for the whole call.
    let n = unsafe { libc::getrandom(b.as_mut_ptr().cast(), b.len(), 0) };
    if n != b.len() as isize {
        // No entropy source: the time and pid still tell logs apart.
        let t = super::now_ms().to_le_bytes();
        b[..8].copy_from_slice(&t);
        b[8..12].copy_from_slice(&std::process::id().to_le_bytes());
    }
    hex(&b)
}

/// The open current file of the log.
pub struct Log {
    path: PathBuf,
    file: std::sync::Arc<File>,
    /// Bytes in the current file.
    size: u64,
    /// Bytes of the current file's header (a file holding only its header is not rotated).
    header_len: u64,
    max_bytes: u64,
    keep: usize,
    /// The log's id and the current file's index and first seq.
    id: String,
    index: u64,
    first_seq: u64,
    /// Rotations that failed in a row (retried at every write until one succeeds).
    rotation_failures: u64,
}

impl std::fmt::Debug for Log {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Log").field("path", &self.path).finish()
    }
}

fn check_file(file: &File, path: &Path) -> Result<(), LogError> {
    let meta = file.metadata().map_err(io("stat", path))?;
    if !meta.file_type().is_file() {
        return Err(LogError::NotRegular {
            path: path.to_path_buf(),
        });
    }
    // Whatever mode an older file had, the log is the daemon's alone.
    if meta.permissions().mode() & 0o7777 != 0o600 {
        file.set_permissions(std::fs::Permissions::from_mode(0o600))
            .map_err(io("chmod", path))?;
    }
    Ok(())
}

/// Opens an existing file of the log for appending.
fn open_existing(path: &Path) -> Result<File, LogError> {
    let file = std::fs::OpenOptions::new()
        .append(true)
        .read(true)
        .custom_flags(libc::O_NOFOLLOW | libc::O_CLOEXEC)
        .open(path)
        .map_err(io("open", path))?;
    check_file(&file, path)?;
    Ok(file)
}

/// Creates (or empties) a file of the log, mode 0600.
fn create(path: &Path) -> Result<File, LogError> {
    let file = std::fs::OpenOptions::new()
        .write(true)
        .read(true)
        .create(true)
        .truncate(true)
        .mode(0o600)
        .custom_flags(libc::O_APPEND | libc::O_NOFOLLOW | libc::O_CLOEXEC)
        .open(path)
        .map_err(io("create", path))?;
    check_file(&file, path)?;
    Ok(file)
}

fn fsync_parent(path: &Path) -> Result<(), LogError> {
    let parent = match path.parent() {
        Some(p) if !p.as_os_str().is_empty() => p,
        _ => Path::new("."),
    };
    File::open(parent)
        .and_then(|d| d.sync_all())
        .map_err(io("fsync the dir of", path))
}

/// The last complete line of `file` and the length up to its end (a partial line after it
/// is not counted).
fn last_line(file: &mut File, path: &Path) -> Result<(Option<Vec<u8>>, u64), LogError> {
    let len = file.metadata().map_err(io("stat", path))?.len();
    let start = len.saturating_sub(TAIL);
    file.seek(SeekFrom::Start(start))
        .map_err(io("seek", path))?;
    let mut buf = Vec::new();
    file.read_to_end(&mut buf).map_err(io("read", path))?;
    let Some(end) = buf.iter().rposition(|&b| b == b'\n') else {
        return Ok((None, start));
    };
    let complete = start + end as u64 + 1;
    let line_start = buf[..end]
        .iter()
        .rposition(|&b| b == b'\n')
        .map_or(0, |i| i + 1);
    Ok((Some(buf[line_start..end].to_vec()), complete))
}

/// The first complete line of the file at `path` (None when it has none or cannot be read).
fn first_line(path: &Path) -> Option<Vec<u8>> {
    let f = File::open(path).ok()?;
    let mut buf = Vec::new();
    f.take(HEAD).read_to_end(&mut buf).ok()?;
    let end = buf.iter().position(|&b| b == b'\n')?;
    buf.truncate(end);
    Some(buf)
}

/// The last line of a rotated file, when it reads as a line of the chain.
fn tail_of(path: &Path) -> Option<(Vec<u8>, u64)> {
    let mut f = File::open(path).ok()?;
    let line = last_line(&mut f, path).ok()?.0?;
    let seq = seq_of(&line)?;
    Some((line, seq))
}

/// Why the current file cannot be continued, or how it continues.
enum Found {
    /// No file at all: a new log.
    Nothing,
    /// The current file continues: its header and last line.
    Continues {
        file: File,
        size: u64,
        header_len: u64,
        first_seq: u64,
        header: Header,
        head: Head,
    },
    /// A new file follows, whose header says the chain restarted for `reason`.
    NewFile {
        reason: String,
        /// Where the chain stood, when known, and the log's id and last file index.
        head: Head,
        after: Option<After>,
        id: Option<String>,
        index: Option<u64>,
        /// The current file exists and must be rotated out first.
        retire_current: bool,
    },
}

impl Log {
    /// Opens the log at `path`, creating it (a genesis header, 0600) when there is none,
    /// and finds where its chain stands: after the last line of the current file. A rotation
    /// a crash interrupted is completed or undone; a current file that cannot be continued
    /// (no header, an unreadable last line, missing while older files exist) is followed by
    /// a new file whose header says the chain restarted and why.
    pub fn open(path: &Path, max_bytes: u64, keep: usize) -> Result<(Log, Head), LogError> {
        if let Some(parent) = path.parent().filter(|p| !p.as_os_str().is_empty()) {
            std::fs::create_dir_all(parent).map_err(io("create the dir of", path))?;
        }
        let next = next_path(path);
        if std::fs::symlink_metadata(&next).is_ok() {
            if std::fs::symlink_metadata(path).is_ok() {
                // The rotation stopped before the current file moved: undo it.
                std::fs::remove_file(&next).map_err(io("remove", &next))?;
            } else {
                // It stopped between the two renames: the next file takes its place.
                std::fs::rename(&next, path).map_err(io("rename into place", &next))?;
            }
            fsync_parent(path)?;
        }
        let found = Self::find(path)?;
        let mut log = Log {
            path: path.to_path_buf(),
            file: std::sync::Arc::new(File::open("/dev/null").map_err(io("open", path))?),
            size: 0,
            header_len: 0,
            max_bytes: max_bytes.max(1),
            keep,
            id: String::new(),
            index: 0,
            first_seq: 0,
            rotation_failures: 0,
        };
        match found {
            Found::Continues {
                file,
                size,
                header_len,
                first_seq,
                header,
                head,
            } => {
                log.file = std::sync::Arc::new(file);
                log.size = size;
                log.header_len = header_len;
                log.first_seq = first_seq;
                log.id = header.log;
                log.index = header.file;
                Ok((log, head))
            }
            Found::Nothing => {
                let mut head = Head::default();
                log.id = new_log_id();
                let header = Header {
                    format: FORMAT,
                    log: log.id.clone(),
                    file: 0,
                    chain: Chain::Genesis,
                    reason: None,
                    after: None,
                    retained: Retained {
                        first_file: Some(0),
                        first_seq: Some(0),
                    },
                };
                log.start_file(&mut head, &header, false)?;
                Ok((log, head))
            }
            Found::NewFile {
                reason,
                mut head,
                after,
                id,
                index,
                retire_current,
            } => {
                log.id = id.unwrap_or_else(new_log_id);
                log.index = index.unwrap_or(0);
                tracing::error!(path = %path.display(), %reason,
                    "the audit chain cannot be continued; a new file says it restarted");
                let header = Header {
                    format: FORMAT,
                    log: log.id.clone(),
                    file: index.map_or(0, |i| i + 1),
                    chain: Chain::Restarted,
                    reason: Some(reason),
                    after,
                    retained: log.retained_after(retire_current, head.next_seq),
                };
                log.start_file(&mut head, &header, retire_current)?;
                Ok((log, head))
            }
        }
    }

    /// What the files at `path` say about where the chain stands.
    fn find(path: &Path) -> Result<Found, LogError> {
        let older = numbered(path);
        let newest_older = older.first().map(|(_, p)| p.clone());
        // What the newest rotated file says, for a new file after it.
        let after_older = |reason: String, retire_current: bool| {
            let tail = newest_older.as_deref().and_then(tail_of);
            let header = newest_older
                .as_deref()
                .and_then(first_line)
                .and_then(|l| header_of(&l));
            let (head, after) = match tail {
                Some((line, seq)) => {
                    let sha = sha256_hex(&line);
                    (
                        Head {
                            next_seq: seq + 1,
                            prev: sha.clone(),
                        },
                        Some(After { seq, sha256: sha }),
                    )
                }
                None => (Head::default(), None),
            };
            Found::NewFile {
                reason,
                head,
                after,
                id: header.as_ref().map(|(_, h)| h.log.clone()),
                index: header.map(|(_, h)| h.file),
                retire_current,
            }
        };
        let mut file = match open_existing(path) {
            Ok(f) => f,
            Err(LogError::Io { source, .. }) if source.kind() == std::io::ErrorKind::NotFound => {
                if older.is_empty() {
                    return Ok(Found::Nothing);
                }
                let why = format!(
                    "{} is missing while older files exist (removed outside the daemon)",
                    path.display()
                );
                return Ok(after_older(why, false));
            }
            Err(e) => return Err(e),
        };
        let (last, complete) = last_line(&mut file, path)?;
        let len = file.metadata().map_err(io("stat", path))?.len();
        if complete < len {
            tracing::warn!(path = %path.display(), bytes = len - complete,
                "the audit log ends with a partial line (a write cut short by a crash); cut it");
            file.set_len(complete).map_err(io("truncate", path))?;
            file.sync_all().map_err(io("fsync", path))?;
        }
        let Some(last) = last else {
            if older.is_empty() {
                // An empty file and nothing before it: a new log.
                drop(file);
                std::fs::remove_file(path).map_err(io("remove", path))?;
                return Ok(Found::Nothing);
            }
            return Ok(after_older(
                format!("{} is empty while older files exist", path.display()),
                true,
            ));
        };
        let first = first_line(path).unwrap_or_default();
        let header = header_of(&first);
        let seq = seq_of(&last);
        match (header, seq) {
            (Some((first_seq, header)), Some(seq)) => Ok(Found::Continues {
                file,
                size: complete,
                header_len: first.len() as u64 + 1,
                first_seq,
                header,
                head: Head {
                    next_seq: seq + 1,
                    prev: sha256_hex(&last),
                },
            }),
            (header, seq) => {
                let reason = if header.is_none() {
                    format!("{} does not begin with a header line", path.display())
                } else {
                    format!("the last line of {} is not an audit line", path.display())
                };
                let (index, id) = match &header {
                    Some((_, h)) => (Some(h.file), Some(h.log.clone())),
                    None => (None, None),
                };
                let after = seq.map(|s| After {
                    seq: s,
                    sha256: sha256_hex(&last),
                });
                Ok(Found::NewFile {
                    reason,
                    head: Head {
                        next_seq: seq.map_or(0, |s| s + 1),
                        prev: sha256_hex(&last),
                    },
                    after,
                    id,
                    index,
                    retire_current: true,
                })
            }
        }
    }

    /// The same log writing to `file` instead (a failing device, in tests).
    #[cfg(test)]
    pub fn replace_file_for_test(mut self, file: File) -> Log {
        self.file = std::sync::Arc::new(file);
        self
    }

    pub fn path(&self) -> &Path {
        &self.path
    }

    /// The current file, for an fsync outside the writer's lock.
    pub fn file(&self) -> std::sync::Arc<File> {
        self.file.clone()
    }

    /// Appends the line `make` builds from where the chain stands, rotating first when it
    /// would take the current file past its size (then `make` builds it again, after the new
    /// file's header), and advances `head` past it. A rotation that fails is logged and
    /// retried at the next write; the line goes to the current file. On failure to write,
    /// nothing of the line stays in the file and `head` is unchanged.
    pub fn append(
        &mut self,
        head: &mut Head,
        mut make: impl FnMut(&Head) -> String,
    ) -> Result<String, LogError> {
        let mut text = make(head);
        if self.size > self.header_len && self.size + text.len() as u64 + 1 > self.max_bytes {
            match self.rotate(head) {
                Ok(()) => {
                    if self.rotation_failures > 0 {
                        tracing::warn!(path = %self.path.display(), failed = self.rotation_failures,
                            "the audit log rotated again after failed attempts");
                    }
                    self.rotation_failures = 0;
                    text = make(head);
                }
                Err(e) => {
                    if self.rotation_failures == 0 {
                        tracing::error!(path = %self.path.display(), error = %crate::report::chain(&e),
                            "cannot rotate the audit log; writing on in the current file and retrying at every write");
                    }
                    self.rotation_failures += 1;
                }
            }
        }
        self.write_line(&text)?;
        *head = head.after(text.as_bytes());
        Ok(text)
    }

    /// Appends one line (newline added). On failure nothing of the line stays in the file.
    fn write_line(&mut self, line: &str) -> Result<(), LogError> {
        let mut buf = Vec::with_capacity(line.len() + 1);
        buf.extend_from_slice(line.as_bytes());
        buf.push(b'\n');
        if let Err(e) = (&*self.file).write_all(&buf) {
            // A short write (ENOSPC part-way) must not leave half a line.
            if let Err(t) = self.file.set_len(self.size) {
                tracing::error!(path = %self.path.display(), error = %crate::report::chain(&t), "cannot cut a failed audit write back");
            }
            return Err(io("write", &self.path)(e));
        }
        self.size += buf.len() as u64;
        Ok(())
    }

    /// What retention keeps once a new file exists (the current one rotated out when
    /// `current_moves`): the oldest of the newest `keep` old files, or the new file itself
    /// (whose first seq is `new_seq`) when `keep` is 0.
    fn retained_after(&self, current_moves: bool, new_seq: u64) -> Retained {
        let mut olds: Vec<PathBuf> = vec![];
        if current_moves {
            olds.push(self.path.clone());
        }
        olds.extend(numbered(&self.path).into_iter().map(|(_, p)| p));
        if self.keep == 0 || olds.is_empty() {
            return Retained {
                first_file: Some(self.index + u64::from(current_moves)),
                first_seq: Some(new_seq),
            };
        }
        let oldest = &olds[self.keep.min(olds.len()) - 1];
        match first_line(oldest) {
            Some(l) => match header_of(&l) {
                Some((seq, h)) => Retained {
                    first_file: Some(h.file),
                    first_seq: Some(seq),
                },
                None => Retained {
                    first_file: None,
                    first_seq: seq_of(&l),
                },
            },
            None => Retained {
                first_file: None,
                first_seq: None,
            },
        }
    }

    /// The current file becomes `audit.jsonl.1` after a new one (its header written and
    /// fsynced) is ready; see [`Log::start_file`].
    fn rotate(&mut self, head: &mut Head) -> Result<(), LogError> {
        // Every line written before the rotation is durable before the file is retired.
        self.file.sync_all().map_err(io("fsync", &self.path))?;
        let after = match head.next_seq.checked_sub(1) {
            Some(seq) => Some(After {
                seq,
                sha256: head.prev.clone(),
            }),
            None => None,
        };
        let header = Header {
            format: FORMAT,
            log: self.id.clone(),
            file: self.index + 1,
            chain: Chain::Rotated,
            reason: None,
            after,
            retained: self.retained_after(true, head.next_seq),
        };
        self.start_file(head, &header, true)
    }

    /// Makes the file that begins with `header` the current one: written (header, fsync) as
    /// `audit.jsonl.next`; then, when `retire_current`, every rotated file moves up one
    /// number and the current file becomes `.1`; then the next file is renamed into place.
    /// Only after that are the old files past `keep` removed, oldest first. On failure no
    /// file is removed and `head` is unchanged.
    fn start_file(
        &mut self,
        head: &mut Head,
        header: &Header,
        retire_current: bool,
    ) -> Result<(), LogError> {
        let text = header_text(head, header);
        let next = next_path(&self.path);
        let file = create(&next)?;
        let mut line = text.clone().into_bytes();
        line.push(b'\n');
        let written = (&file)
            .write_all(&line)
            .map_err(io("write", &next))
            .and_then(|()| file.sync_all().map_err(io("fsync", &next)));
        if let Err(e) = written {
            drop(file);
            let _ = std::fs::remove_file(&next);
            return Err(e);
        }
        if retire_current {
            // Highest number first, so that no rename lands on a file not yet moved.
            for (n, p) in numbered(&self.path).into_iter().rev() {
                std::fs::rename(&p, rotated(&self.path, n + 1)).map_err(io("rotate", &p))?;
            }
            match std::fs::rename(&self.path, rotated(&self.path, 1)) {
                Ok(()) => {}
                // An earlier attempt moved it and stopped before the next file was in place.
                Err(e) if e.kind() == std::io::ErrorKind::NotFound => {}
                Err(e) => return Err(io("rotate", &self.path)(e)),
            }
        }
        std::fs::rename(&next, &self.path).map_err(io("rename into place", &next))?;
        fsync_parent(&self.path)?;
        self.file = std::sync::Arc::new(file);
        self.size = line.len() as u64;
        self.header_len = self.size;
        self.index = header.file;
        self.first_seq = head.next_seq;
        *head = head.after(text.as_bytes());
        self.retire();
        Ok(())
    }

    /// Retention: removes the rotated files past the newest `keep`, oldest first (a crash
    /// part-way leaves the newest ones). A file that cannot be removed stays (and is logged).
    fn retire(&self) {
        let old = numbered(&self.path);
        if old.len() <= self.keep {
            return;
        }
        for (_, p) in old[self.keep..].iter().rev() {
            if let Err(e) = std::fs::remove_file(p) {
                tracing::error!(path = %p.display(), error = %crate::report::chain(&e), "cannot remove an audit file past audit_log_keep");
                return;
            }
        }
        if let Err(e) = fsync_parent(&self.path) {
            tracing::warn!(error = %crate::report::chain(&e), "after removing old audit files");
        }
    }
}

#[cfg(test)]
mod tests;
