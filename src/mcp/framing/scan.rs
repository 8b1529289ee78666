//! The pure byte scanner: lines split out of the bytes as they arrive, each held only up to
//! the size limit ([`LineSplitter`], no I/O), and a flat, non-recursive scan of a line's top
//! level ([`scan_top`], [`too_deep`], [`recover_id`]) that works on a prefix, invalid UTF-8
//! or deep nesting, so that every bad line can be answered under its id.

use std::ops::Range;

use serde_json::Value;

/// The deepest nesting of arrays and objects a message may have.
pub const MAX_DEPTH: usize = 64;
/// The longest string request id the daemon accepts or echoes.
pub const MAX_ID_BYTES: usize = 256;
/// How much of an oversized line is kept to find its id.
pub(super) const OVERSIZED_PREFIX: usize = 4096;

/// What the reader found.
#[derive(Debug, PartialEq)]
pub enum Frame {
    /// One complete line, without its newline.
    Line(Vec<u8>),
    /// A line longer than the limit, discarded; its first bytes, to find its id.
    Oversized(Vec<u8>),
    Eof,
}

/// Splits a byte stream into lines, never holding more than `limit` bytes of one line: the
/// rest of a longer line is discarded as it arrives (its first [`OVERSIZED_PREFIX`] bytes
/// kept, to find its id). Blank lines are skipped. The caller feeds it whatever bytes it has
/// and consumes what it says it used; a last line without a newline is never returned.
#[derive(Debug)]
pub struct LineSplitter {
    limit: usize,
    pub(super) buf: Vec<u8>,
    oversized: bool,
}

impl LineSplitter {
    pub fn new(limit: usize) -> Self {
        LineSplitter {
            limit,
            buf: Vec::new(),
            oversized: false,
        }
    }

    /// The size limit of one line.
    pub fn limit(&self) -> usize {
        self.limit
    }

    /// Takes bytes from the front of `chunk`, up to and including the first newline: how
    /// many it took, and the line they complete, if they complete one that is not blank
    /// ([`Frame::Line`] or [`Frame::Oversized`], never [`Frame::Eof`]).
    pub fn feed(&mut self, chunk: &[u8]) -> (usize, Option<Frame>) {
        let newline = chunk.iter().position(|b| *b == b'\n');
        let take = newline.map_or(chunk.len(), |i| i + 1);
        let part = &chunk[..newline.unwrap_or(chunk.len())];
        if self.oversized {
            let room = OVERSIZED_PREFIX.saturating_sub(self.buf.len());
            self.buf.extend_from_slice(&part[..part.len().min(room)]);
        } else if self.buf.len() + part.len() > self.limit {
            self.oversized = true;
            self.buf.truncate(OVERSIZED_PREFIX);
            let room = OVERSIZED_PREFIX.saturating_sub(self.buf.len());
            self.buf.extend_from_slice(&part[..part.len().min(room)]);
        } else {
            self.buf.extend_from_slice(part);
        }
        if newline.is_none() {
            return (take, None);
        }
        let line = std::mem::take(&mut self.buf);
        let frame = if std::mem::replace(&mut self.oversized, false) {
            Some(Frame::Oversized(line))
        } else if trim(&line).is_empty() {
            None
        } else {
            Some(Frame::Line(line))
        };
        (take, frame)
    }
}

/// `b` without leading and trailing ASCII whitespace.
pub fn trim(b: &[u8]) -> &[u8] {
    let end = b
        .iter()
        .rposition(|c| !c.is_ascii_whitespace())
        .map_or(0, |i| i + 1);
    let start = b[..end]
        .iter()
        .position(|c| !c.is_ascii_whitespace())
        .unwrap_or(end);
    &b[start..end]
}

// ---- a tolerant scan of a line's top level ------------------------------------------------

/// Where a line's top-level members are, as far as a flat, non-recursive scan can tell; it
/// stops at the first thing that is not JSON, so it also works on a prefix or a line with
/// invalid UTF-8 or deep nesting elsewhere.
#[derive(Debug, Default, PartialEq)]
pub struct TopLevel {
    /// The byte range of the value of `"id"`.
    pub id: Option<Range<usize>>,
    /// The byte range of the value of `"method"`.
    pub method: Option<Range<usize>>,
    /// Whether a `"result"` or `"error"` member was seen.
    pub reply: bool,
}

fn skip_ws(b: &[u8], mut i: usize) -> usize {
    while b.get(i).is_some_and(|c| c.is_ascii_whitespace()) {
        i += 1;
    }
    i
}

/// `b[i]` is `"`: the index just past the closing quote.
fn string_end(b: &[u8], i: usize) -> Option<usize> {
    let mut j = i + 1;
    while j < b.len() {
        match b[j] {
            b'\\' => j += 2,
            b'"' => return Some(j + 1),
            _ => j += 1,
        }
    }
    None
}

/// The index just past the value starting at `b[i]`.
fn value_end(b: &[u8], i: usize) -> Option<usize> {
    match b.get(i)? {
        b'"' => string_end(b, i),
        b'{' | b'[' => {
            let mut depth = 0usize;
            let mut j = i;
            while j < b.len() {
                match b[j] {
                    b'"' => {
                        j = string_end(b, j)?;
                        continue;
                    }
                    b'{' | b'[' => depth += 1,
                    b'}' | b']' => {
                        depth -= 1;
                        if depth == 0 {
                            return Some(j + 1);
                        }
                    }
                    _ => {}
                }
                j += 1;
            }
            None
        }
        _ => {
            let mut j = i;
            while j < b.len() && !matches!(b[j], b',' | b'}' | b']') && !b[j].is_ascii_whitespace()
            {
                j += 1;
            }
            (j > i).then_some(j)
        }
    }
}

pub fn scan_top(b: &[u8]) -> TopLevel {
    let mut t = TopLevel::default();
    let mut i = skip_ws(b, 0);
    if b.get(i) != Some(&b'{') {
        return t;
    }
    i += 1;
    loop {
        i = skip_ws(b, i);
        if b.get(i) != Some(&b'"') {
            return t;
        }
        let Some(key_end) = string_end(b, i) else {
            return t;
        };
        let key = &b[i + 1..key_end - 1];
        i = skip_ws(b, key_end);
        if b.get(i) != Some(&b':') {
            return t;
        }
        i = skip_ws(b, i + 1);
        let start = i;
        let Some(end) = value_end(b, i) else {
            return t;
        };
        match key {
            b"id" => t.id = Some(start..end),
            b"method" => t.method = Some(start..end),
            b"result" | b"error" => t.reply = true,
            _ => {}
        }
        i = skip_ws(b, end);
        if b.get(i) != Some(&b',') {
            return t;
        }
        i += 1;
    }
}

/// Whether arrays and objects nest deeper than `limit` (outside strings), by a flat scan.
pub fn too_deep(b: &[u8], limit: usize) -> bool {
    let mut depth = 0usize;
    let mut i = 0;
    while i < b.len() {
        match b[i] {
            b'"' => match string_end(b, i) {
                Some(j) => {
                    i = j;
                    continue;
                }
                None => return false,
            },
            b'{' | b'[' => {
                depth += 1;
                if depth > limit {
                    return true;
                }
            }
            b'}' | b']' => depth = depth.saturating_sub(1),
            _ => {}
        }
        i += 1;
    }
    false
}

/// An id that may be echoed in a reply: a string of at most [`MAX_ID_BYTES`] or an integer;
/// anything else is answered under `null`.
pub(super) fn echoable(id: &Value) -> Value {
    match id {
        Value::String(s) if s.len() <= MAX_ID_BYTES => id.clone(),
        Value::Number(n) if n.is_i64() || n.is_u64() => id.clone(),
        _ => Value::Null,
    }
}

/// The id of a line that could not be read as a whole, when the scan finds one.
pub fn recover_id(line: &[u8]) -> Value {
    scan_top(line)
        .id
        .and_then(|r| serde_json::from_slice::<Value>(&line[r]).ok())
        .map_or(Value::Null, |id| echoable(&id))
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Feeds `chunks` in order (each wholly, as a reader would), collecting the frames.
    fn split(limit: usize, chunks: &[&[u8]]) -> Vec<Frame> {
        let mut s = LineSplitter::new(limit);
        let mut out = Vec::new();
        for chunk in chunks {
            let mut rest: &[u8] = chunk;
            while !rest.is_empty() {
                let (used, frame) = s.feed(rest);
                assert!(
                    used > 0 && used <= rest.len(),
                    "used {used} of {}",
                    rest.len()
                );
                rest = &rest[used..];
                out.extend(frame);
            }
        }
        out
    }

    #[test]
    fn lines_split_across_chunks_and_blank_lines_are_skipped() {
        let frames = split(16, &[b"{\"a\"", b":1}\n\n  \r\n{}", b"\nnot ended"]);
        assert_eq!(
            frames,
            vec![
                Frame::Line(b"{\"a\":1}".to_vec()),
                Frame::Line(b"{}".to_vec())
            ]
        );
    }

    #[test]
    fn a_line_over_the_limit_is_cut_to_its_prefix_and_the_next_line_is_whole() {
        let long = vec![b'x'; OVERSIZED_PREFIX * 3];
        let mut chunks: Vec<&[u8]> = long.chunks(1000).collect();
        chunks.push(b"\n{\"id\":1}\n");
        let frames = split(OVERSIZED_PREFIX, &chunks);
        assert_eq!(frames.len(), 2, "{frames:?}");
        match &frames[0] {
            Frame::Oversized(prefix) => assert_eq!(prefix.len(), OVERSIZED_PREFIX),
            other => panic!("expected an oversized frame, got {other:?}"),
        }
        assert_eq!(frames[1], Frame::Line(b"{\"id\":1}".to_vec()));
        // Exactly at the limit is still a line.
        assert_eq!(split(4, &[b"abcd\n"]), vec![Frame::Line(b"abcd".to_vec())]);
        assert!(matches!(split(4, &[b"abcde\n"])[0], Frame::Oversized(_)));
    }

    #[test]
    fn the_top_level_scan_finds_the_id_of_a_line_it_cannot_parse() {
        assert_eq!(recover_id(br#"{"jsonrpc":"2.0","id":7,"params":[[[["#), 7);
        assert_eq!(recover_id(b"{\"id\":\"a\",\xff"), "a");
        assert_eq!(recover_id(b"[1,2]"), Value::Null);
        assert!(too_deep(&[b'['; MAX_DEPTH + 1], MAX_DEPTH));
        assert!(!too_deep(b"{\"s\":\"[[[[[[\"}", 2));
    }
}
