//! The durable audit log: JSON Lines in the state dir (`audit_log`), mode 0600, rotated by
//! size with a retention count, each line carrying the SHA-256 of the line before it.
//!
//! Files, newest last: `audit.jsonl.N` (oldest kept) ... `audit.jsonl.1`, `audit.jsonl`.
//! The chain runs across them: the first line of a file names the hash of the last line of
//! the file rotated before it. Only the first line ever written names [`GENESIS`]; a chain
//! whose oldest retained line names anything else starts where retention cut it.
//!
//! A line is written with one `write(2)` of the whole line; a write that fails part-way is cut
//! back (`ftruncate`) so the file never keeps half a line. A partial last line found at open
//! (a crash or power loss mid-write of an event that was never reported durable) is cut too,
//! with a warning.

use std::fs::File;
use std::io::{Read, Seek, SeekFrom, Write};
use std::os::unix::fs::{OpenOptionsExt, PermissionsExt};
use std::path::{Path, PathBuf};

use serde_json::Value;
use sha2::{Digest, Sha256};

/// The `prev` of the first line ever written.
pub const GENESIS: &str = "0000000000000000000000000000000000000000000000000000000000000000";

/// How much of a file's end is read to find its last line (an event is at most
/// [`super::MAX_EVENT`] bytes plus its envelope).
const TAIL: u64 = 256 * 1024;

#[derive(Debug, thiserror::Error)]
pub enum LogError {
    #[error("{path}: cannot {op} the audit log: {source}")]
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

/// The log's files that exist, oldest first.
pub fn files(path: &Path) -> Vec<PathBuf> {
    let mut out = vec![];
    let mut n = 1;
    while rotated(path, n).exists() {
        out.push(rotated(path, n));
        n += 1;
    }
    out.reverse();
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

/// The open current file of the log.
pub struct Log {
    path: PathBuf,
    file: std::sync::Arc<File>,
    /// Bytes in the current file.
    size: u64,
    max_bytes: u64,
    keep: usize,
}

impl std::fmt::Debug for Log {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Log").field("path", &self.path).finish()
    }
}

fn open_file(path: &Path) -> Result<File, LogError> {
    let file = std::fs::OpenOptions::new()
        .append(true)
        .read(true)
        .create(true)
        .mode(0o600)
        .custom_flags(libc::O_NOFOLLOW | libc::O_CLOEXEC)
        .open(path)
        .map_err(io("open", path))?;
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

/// The head after `line`.
fn head_after(line: &[u8]) -> Head {
    let seq = serde_json::from_slice::<Value>(line)
        .ok()
        .and_then(|v| v.get("seq").and_then(Value::as_u64));
    Head {
        next_seq: seq.map_or(0, |s| s + 1),
        prev: sha256_hex(line),
    }
}

impl Log {
    /// Opens (creating, 0600) the log at `path` and finds where its chain stands: after the
    /// last line of the current file, or of the newest rotated file when the current one is
    /// empty.
    pub fn open(path: &Path, max_bytes: u64, keep: usize) -> Result<(Log, Head), LogError> {
        if let Some(parent) = path.parent().filter(|p| !p.as_os_str().is_empty()) {
            std::fs::create_dir_all(parent).map_err(io("create the dir of", path))?;
        }
        let mut file = open_file(path)?;
        let (last, complete) = last_line(&mut file, path)?;
        let len = file.metadata().map_err(io("stat", path))?.len();
        if complete < len {
            tracing::warn!(path = %path.display(), bytes = len - complete,
                "the audit log ends with a partial line (a write cut short by a crash); cut it");
            file.set_len(complete).map_err(io("truncate", path))?;
            file.sync_all().map_err(io("fsync", path))?;
        }
        let head = match last {
            Some(line) => head_after(&line),
            None => {
                let older = rotated(path, 1);
                match File::open(&older) {
                    Ok(mut f) => match last_line(&mut f, &older)?.0 {
                        Some(line) => head_after(&line),
                        None => Head::default(),
                    },
                    Err(_) => Head::default(),
                }
            }
        };
        Ok((
            Log {
                path: path.to_path_buf(),
                file: std::sync::Arc::new(file),
                size: complete,
                max_bytes: max_bytes.max(1),
                keep,
            },
            head,
        ))
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

    /// Appends one line (newline added), rotating first when it would take the current
    /// file past its size. On failure nothing of the line stays in the file.
    pub fn write_line(&mut self, line: &str) -> Result<(), LogError> {
        let len = line.len() as u64 + 1;
        if self.size > 0 && self.size + len > self.max_bytes {
            self.rotate()?;
        }
        let mut buf = Vec::with_capacity(line.len() + 1);
        buf.extend_from_slice(line.as_bytes());
        buf.push(b'\n');
        if let Err(e) = (&*self.file).write_all(&buf) {
            // A short write (ENOSPC part-way) must not leave half a line.
            if let Err(t) = self.file.set_len(self.size) {
                tracing::error!(path = %self.path.display(), error = %t, "cannot cut a failed audit write back");
            }
            return Err(io("write", &self.path)(e));
        }
        self.size += len;
        Ok(())
    }

    /// `audit.jsonl` becomes `audit.jsonl.1` (each older one moves up one, the one past
    /// `keep` is removed), and a new empty file takes its place. The old file is fsynced
    /// first, so every line written before the rotation is durable.
    fn rotate(&mut self) -> Result<(), LogError> {
        self.file.sync_all().map_err(io("fsync", &self.path))?;
        if self.keep == 0 {
            std::fs::remove_file(&self.path).map_err(io("remove", &self.path))?;
        } else {
            let oldest = rotated(&self.path, self.keep);
            match std::fs::remove_file(&oldest) {
                Ok(()) => {}
                Err(e) if e.kind() == std::io::ErrorKind::NotFound => {}
                Err(e) => return Err(io("remove", &oldest)(e)),
            }
            for n in (1..self.keep).rev() {
                let from = rotated(&self.path, n);
                match std::fs::rename(&from, rotated(&self.path, n + 1)) {
                    Ok(()) => {}
                    Err(e) if e.kind() == std::io::ErrorKind::NotFound => {}
                    Err(e) => return Err(io("rotate", &from)(e)),
                }
            }
            std::fs::rename(&self.path, rotated(&self.path, 1))
                .map_err(io("rotate", &self.path))?;
        }
        let file = open_file(&self.path)?;
        fsync_parent(&self.path)?;
        self.file = std::sync::Arc::new(file);
        self.size = 0;
        Ok(())
    }
}

/// What `verify` found.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Verified {
    pub files: usize,
    pub lines: u64,
    /// The seq of the oldest retained line (0 when the log starts at its first line).
    pub first_seq: Option<u64>,
    pub last_seq: Option<u64>,
}

/// A break in the chain: where, and why.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("{file}:{line}: {reason}")]
pub struct Broken {
    pub file: PathBuf,
    pub line: u64,
    pub reason: String,
}

/// Checks the chain across every file of the log at `path`, oldest first: each line is a
/// JSON event whose `prev` is the SHA-256 of the line before it and whose `seq` follows
/// the previous one. The oldest retained line may name a line retention removed, unless
/// its seq is 0 (then it must name [`GENESIS`]).
pub fn verify(path: &Path) -> Result<Verified, Broken> {
    let files = files(path);
    let mut out = Verified {
        files: files.len(),
        lines: 0,
        first_seq: None,
        last_seq: None,
    };
    let mut head: Option<Head> = None;
    for f in &files {
        let broken = |line: u64, reason: String| Broken {
            file: f.clone(),
            line,
            reason,
        };
        let text = std::fs::read(f).map_err(|e| broken(0, format!("cannot read: {e}")))?;
        if !text.is_empty() && text.last() != Some(&b'\n') {
            return Err(broken(
                text.split(|&b| b == b'\n').count() as u64,
                "the file ends with a partial line".into(),
            ));
        }
        for (i, line) in text.split(|&b| b == b'\n').enumerate() {
            let n = i as u64 + 1;
            if line.is_empty() && i == text.split(|&b| b == b'\n').count() - 1 {
                break;
            }
            let v: Value = serde_json::from_slice(line)
                .map_err(|e| broken(n, format!("not a JSON event: {e}")))?;
            let seq = v
                .get("seq")
                .and_then(Value::as_u64)
                .ok_or_else(|| broken(n, "no seq".into()))?;
            let prev = v
                .get("prev")
                .and_then(Value::as_str)
                .ok_or_else(|| broken(n, "no prev".into()))?;
            match &head {
                None => {
                    if seq == 0 && prev != GENESIS {
                        return Err(broken(n, "the first event does not start the chain".into()));
                    }
                    out.first_seq = Some(seq);
                }
                Some(h) => {
                    if prev != h.prev {
                        return Err(broken(
                            n,
                            format!(
                                "prev {prev} is not the SHA-256 of the line before it ({}): a line was edited, removed or inserted",
                                h.prev
                            ),
                        ));
                    }
                    if seq != h.next_seq {
                        return Err(broken(
                            n,
                            format!("seq {seq} follows seq {}", h.next_seq.wrapping_sub(1)),
                        ));
                    }
                }
            }
            head = Some(Head {
                next_seq: seq + 1,
                prev: sha256_hex(line),
            });
            out.lines += 1;
            out.last_seq = Some(seq);
        }
    }
    Ok(out)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn line(seq: u64, prev: &str) -> String {
        serde_json::json!({"seq": seq, "kind": "allow", "prev": prev}).to_string()
    }

    fn write_n(log: &mut Log, head: &mut Head, n: u64) {
        for _ in 0..n {
            let l = line(head.next_seq, &head.prev);
            log.write_line(&l).unwrap();
            *head = Head {
                next_seq: head.next_seq + 1,
                prev: sha256_hex(l.as_bytes()),
            };
        }
    }

    #[test]
    fn the_chain_continues_across_reopen_and_rotation() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("audit.jsonl");
        let (mut log, mut head) = Log::open(&path, 300, 3).unwrap();
        assert_eq!(head, Head::default());
        write_n(&mut log, &mut head, 5);
        drop(log);
        let (mut log, mut h2) = Log::open(&path, 300, 3).unwrap();
        assert_eq!(h2, head);
        write_n(&mut log, &mut h2, 20);
        // Rotated by size, at most 3 kept; the chain verifies from where retention cut it.
        let fs = files(&path);
        assert_eq!(fs.len(), 4, "{fs:?}");
        assert!(!rotated(&path, 4).exists());
        for f in &fs {
            let m = std::fs::metadata(f).unwrap();
            assert_eq!(m.permissions().mode() & 0o7777, 0o600);
            assert!(m.len() <= 300, "{} has {} bytes", f.display(), m.len());
        }
        let v = verify(&path).unwrap();
        assert_eq!(v.last_seq, Some(24));
        assert!(v.first_seq.unwrap() > 0);
        assert_eq!(v.lines, 25 - v.first_seq.unwrap());
    }

    #[test]
    fn an_edited_or_removed_line_breaks_the_chain() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("audit.jsonl");
        let (mut log, mut head) = Log::open(&path, 1 << 20, 3).unwrap();
        write_n(&mut log, &mut head, 5);
        assert_eq!(verify(&path).unwrap().lines, 5);
        let good = std::fs::read_to_string(&path).unwrap();
        let lines: Vec<&str> = good.lines().collect();
        // Edited.
        let edited: String = lines
            .iter()
            .enumerate()
            .map(|(i, l)| match i {
                1 => format!("{}\n", l.replace("\"allow\"", "\"deny\"")),
                _ => format!("{l}\n"),
            })
            .collect();
        std::fs::write(&path, &edited).unwrap();
        let e = verify(&path).unwrap_err();
        assert_eq!(e.line, 3, "{e}");
        assert!(e.reason.contains("edited, removed or inserted"), "{e}");
        // Removed.
        let removed: String = lines
            .iter()
            .enumerate()
            .filter(|(i, _)| *i != 2)
            .map(|(_, l)| format!("{l}\n"))
            .collect();
        std::fs::write(&path, removed).unwrap();
        assert_eq!(verify(&path).unwrap_err().line, 3);
        std::fs::write(&path, good).unwrap();
        assert!(verify(&path).is_ok());
    }

    #[test]
    fn a_failing_sink_leaves_no_partial_line() {
        // /dev/full: every write fails with ENOSPC, a real failing device.
        let f = File::options().append(true).open("/dev/full").unwrap();
        let mut log = Log {
            path: PathBuf::from("/dev/full"),
            file: std::sync::Arc::new(f),
            size: 0,
            max_bytes: 1 << 20,
            keep: 1,
        };
        let e = log.write_line("{}").unwrap_err();
        assert!(e.to_string().contains("No space left"), "{e}");
    }

    #[test]
    fn a_partial_last_line_is_cut_at_open() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("audit.jsonl");
        let (mut log, mut head) = Log::open(&path, 1 << 20, 3).unwrap();
        write_n(&mut log, &mut head, 2);
        drop(log);
        let mut f = File::options().append(true).open(&path).unwrap();
        f.write_all(b"{\"seq\":2,\"ki").unwrap();
        drop(f);
        let (_log, h) = Log::open(&path, 1 << 20, 3).unwrap();
        assert_eq!(h, head);
        assert_eq!(verify(&path).unwrap().lines, 2);
    }
}
