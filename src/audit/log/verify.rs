//! Reading the log back: the chain checked across every file, oldest first, each break
//! reported with its file, line and reason, and retention told from removal.

use std::path::{Path, PathBuf};

use serde_json::Value;

use super::*;

/// What `verify` found.
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub struct Verified {
    pub files: usize,
    /// Lines, headers included.
    pub lines: u64,
    /// Event lines (not headers).
    pub events: u64,
    /// The seq of the oldest retained line (0 when the log starts at its genesis header).
    pub first_seq: Option<u64>,
    pub last_seq: Option<u64>,
    /// The log's id (its genesis header's, carried by every header).
    pub log: Option<String>,
    /// What retention removed, as the newest header records it: how many files (all files
    /// of the log before the oldest kept) and the first seq still present. None when the log
    /// is whole from its genesis header.
    pub retention: Option<Removed>,
    /// Every break found, in order (none: the chain is intact).
    pub breaks: Vec<Broken>,
}

/// Files retention removed: the count, and the first seq kept.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Removed {
    pub files: u64,
    pub first_seq: u64,
}

/// A break in the chain: where, and why.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("{file}:{line}: {reason}")]
pub struct Broken {
    pub file: PathBuf,
    pub line: u64,
    pub reason: String,
}

/// Checks the chain across every file of the log at `path`, oldest first, and returns the
/// first break.
pub fn verify(path: &Path) -> Result<Verified, Broken> {
    let v = check(path);
    match v.breaks.first() {
        Some(b) => Err(b.clone()),
        None => Ok(v),
    }
}

/// Checks the chain across every file of the log at `path`, oldest first, and reports every
/// break: each line is JSON whose `prev` is the SHA-256 of the line before it and whose `seq`
/// follows the previous one; each file begins with a header of the same log whose index
/// follows the file before it (a header that says `restarted` is a break); the oldest file
/// is the genesis one, or one retention kept (the newest header's `retained` record): a file
/// missing at the start that retention did not remove is a break. After a break the check
/// goes on from the next line.
pub fn check(path: &Path) -> Verified {
    let files = files(path);
    let mut out = Verified {
        files: files.len(),
        ..Verified::default()
    };
    // The chain's head, None at the start or after a break (the next line resyncs).
    let mut head: Option<Head> = None;
    let mut at_start = true;
    // The previous file's header index, and the oldest file's (index, first seq, chain).
    let mut last_index: Option<u64> = None;
    let mut oldest: Option<(u64, u64, Chain)> = None;
    let mut newest_retained: Option<(PathBuf, Retained)> = None;
    let mut breaks: Vec<Broken> = Vec::new();
    for f in &files {
        let mut broken = |line: u64, reason: String| {
            breaks.push(Broken {
                file: f.clone(),
                line,
                reason,
            })
        };
        let text = match std::fs::read(f) {
            Ok(t) => t,
            Err(e) => {
                broken(0, format!("cannot read: {e}"));
                head = None;
                continue;
            }
        };
        let mut body: &[u8] = &text;
        if !text.is_empty() && text.last() != Some(&b'\n') {
            let n = text.split(|&b| b == b'\n').count() as u64;
            broken(n, "the file ends with a partial line".into());
            let end = text.iter().rposition(|&b| b == b'\n').map_or(0, |i| i + 1);
            body = &text[..end];
        }
        if body.is_empty() {
            broken(1, "the file is empty: it has no header line".into());
            head = None;
            continue;
        }
        let body = &body[..body.len() - 1];
        for (i, line) in body.split(|&b| b == b'\n').enumerate() {
            let n = i as u64 + 1;
            let v: Value = match serde_json::from_slice(line) {
                Ok(v) => v,
                Err(e) => {
                    broken(n, format!("not a JSON line: {e}"));
                    head = None;
                    continue;
                }
            };
            let (Some(seq), Some(prev)) = (
                v.get("seq").and_then(Value::as_u64),
                v.get("prev").and_then(Value::as_str),
            ) else {
                broken(n, "no seq or no prev".into());
                head = None;
                continue;
            };
            let header = if v.get("kind").and_then(Value::as_str) == Some(HEADER) {
                match v
                    .get("detail")
                    .cloned()
                    .map(serde_json::from_value::<Header>)
                {
                    Some(Ok(h)) => Some(h),
                    _ => {
                        broken(n, "a header line without a valid header detail".into());
                        None
                    }
                }
            } else {
                None
            };
            let mut resync = false;
            match (&header, n) {
                (None, 1) => broken(
                    1,
                    "the file does not begin with a header line: its first lines were removed (or it was written before the log had headers)"
                        .into(),
                ),
                (Some(_), n) if n > 1 => broken(n, "a header line inside a file".into()),
                _ => {}
            }
            if let Some(h) = &header {
                match &out.log {
                    None => out.log = Some(h.log.clone()),
                    Some(id) if *id != h.log => broken(
                        n,
                        format!(
                            "the header names log {} but the files before name log {id}",
                            h.log
                        ),
                    ),
                    _ => {}
                }
                match h.chain {
                    Chain::Restarted => {
                        broken(
                            n,
                            format!(
                                "the chain restarted here: {}",
                                h.reason.as_deref().unwrap_or("no reason given")
                            ),
                        );
                        resync = true;
                    }
                    Chain::Genesis => {
                        if seq != 0 || prev != GENESIS {
                            broken(
                                n,
                                "a genesis header that is not seq 0 with the genesis prev".into(),
                            );
                        }
                        if !at_start {
                            broken(n, "a new log (genesis) begins after older files".into());
                            resync = true;
                        }
                    }
                    Chain::Rotated => {
                        if let Some(last) = last_index {
                            if h.file > last + 1 {
                                broken(
                                    n,
                                    format!(
                                        "file {} follows file {last}: {} file(s) missing in the middle",
                                        h.file,
                                        h.file - last - 1
                                    ),
                                );
                                resync = true;
                            } else if h.file != last + 1 {
                                broken(n, format!("file {} follows file {last}", h.file));
                                resync = true;
                            }
                        }
                        match (&h.after, &head) {
                            (None, _) => broken(
                                n,
                                "a rotated file's header does not name the last line of the file before it"
                                    .into(),
                            ),
                            (Some(a), Some(hd))
                                if !resync && (a.seq + 1 != hd.next_seq || a.sha256 != hd.prev) =>
                            {
                                broken(
                                    n,
                                    format!(
                                        "the header names seq {} ({}) as the last line before it, but the line before it is seq {} ({})",
                                        a.seq,
                                        a.sha256,
                                        hd.next_seq.wrapping_sub(1),
                                        hd.prev
                                    ),
                                );
                                resync = true;
                            }
                            _ => {}
                        }
                    }
                }
                if at_start {
                    oldest = Some((h.file, seq, h.chain));
                }
                last_index = Some(h.file);
                newest_retained = Some((f.clone(), h.retained.clone()));
            } else if n == 1 {
                last_index = None;
            }
            match &head {
                Some(h) if !resync => {
                    if prev != h.prev {
                        broken(
                            n,
                            format!(
                                "prev {prev} is not the SHA-256 of the line before it ({}): a line was edited, removed or inserted",
                                h.prev
                            ),
                        );
                    } else if seq != h.next_seq {
                        broken(
                            n,
                            format!("seq {seq} follows seq {}", h.next_seq.wrapping_sub(1)),
                        );
                    }
                }
                _ => {
                    if at_start {
                        out.first_seq = Some(seq);
                        if seq == 0 && prev != GENESIS {
                            broken(n, "the first line does not start the chain".into());
                        }
                    }
                }
            }
            at_start = false;
            head = Some(Head {
                next_seq: seq + 1,
                prev: sha256_hex(line),
            });
            out.lines += 1;
            if header.is_none() {
                out.events += 1;
            }
            out.last_seq = Some(seq);
        }
    }
    out.breaks = breaks;
    // The start of the log: the genesis file, or the files retention kept.
    match (oldest, newest_retained) {
        (Some((0, 0, Chain::Genesis)), _) => {}
        (Some((file, first_seq, _)), Some((by, r))) => match r.first_file {
            Some(kept) if file <= kept => {
                out.retention = Some(Removed {
                    files: file,
                    first_seq,
                })
            }
            Some(kept) => out.breaks.push(Broken {
                file: files[0].clone(),
                line: 1,
                reason: format!(
                    "the oldest file is file {file} (seq {first_seq}), but the header of {} says retention kept every file from file {kept} (seq {}): {} file(s) were removed outside retention",
                    by.display(),
                    r.first_seq.map_or("?".into(), |s| s.to_string()),
                    file - kept
                ),
            }),
            None => {}
        },
        _ => {}
    }
    out
}
