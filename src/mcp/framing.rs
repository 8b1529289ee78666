//! Newline-delimited JSON-RPC framing between a socket and rmcp, with the checks rmcp leaves
//! silent: a line over the size limit is discarded and answered with an Invalid Request
//! error, and a line that is not JSON is answered with a Parse error. Everything else is
//! handed to rmcp unchanged.

use tokio::io::{AsyncBufReadExt, AsyncRead, AsyncWrite, AsyncWriteExt, BufReader};
use tokio::sync::mpsc;

/// What the reader found on one line.
#[derive(Debug, PartialEq)]
pub enum Frame {
    /// A JSON message to hand on.
    Message(Vec<u8>),
    /// A line longer than the limit, discarded.
    Oversized,
    /// A line that is not JSON.
    Malformed(String),
    Eof,
}

pub struct LineReader<R> {
    inner: BufReader<R>,
    limit: usize,
    buf: Vec<u8>,
}

impl<R: AsyncRead + Unpin> LineReader<R> {
    pub fn new(inner: R, limit: usize) -> Self {
        LineReader {
            inner: BufReader::with_capacity(64 * 1024, inner),
            limit,
            buf: Vec::new(),
        }
    }

    /// The next frame; never holds more than `limit` bytes of one line in memory.
    pub async fn next(&mut self) -> std::io::Result<Frame> {
        loop {
            self.buf.clear();
            let mut oversized = false;
            loop {
                let chunk = self.inner.fill_buf().await?;
                if chunk.is_empty() {
                    return Ok(Frame::Eof);
                }
                let newline = chunk.iter().position(|b| *b == b'\n');
                let take = newline.map_or(chunk.len(), |i| i + 1);
                if !oversized {
                    if self.buf.len() + take > self.limit + 1 {
                        oversized = true;
                        self.buf.clear();
                    } else {
                        self.buf.extend_from_slice(&chunk[..take]);
                    }
                }
                self.inner.consume(take);
                if newline.is_some() {
                    break;
                }
            }
            if oversized {
                return Ok(Frame::Oversized);
            }
            let line = trim(&self.buf);
            if line.is_empty() {
                continue;
            }
            return Ok(
                match serde_json::from_slice::<serde::de::IgnoredAny>(line) {
                    Ok(_) => {
                        let mut m = line.to_vec();
                        m.push(b'\n');
                        Frame::Message(m)
                    }
                    Err(e) => Frame::Malformed(e.to_string()),
                },
            );
        }
    }
}

fn trim(b: &[u8]) -> &[u8] {
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

/// A JSON-RPC error with a null id, as one line.
pub fn error_line(code: i64, message: &str) -> Vec<u8> {
    let v = serde_json::json!({"jsonrpc": "2.0", "id": null, "error": {"code": code, "message": message}});
    let mut line = v.to_string().into_bytes();
    line.push(b'\n');
    line
}

/// Copies frames from the socket to rmcp's input, answering bad ones on `replies`.
pub async fn pump_in<R, W>(
    mut reader: LineReader<R>,
    mut to_rmcp: W,
    replies: mpsc::Sender<Vec<u8>>,
) where
    R: AsyncRead + Unpin,
    W: AsyncWrite + Unpin,
{
    let limit = reader.limit;
    loop {
        let frame = match reader.next().await {
            Ok(f) => f,
            Err(e) => {
                tracing::debug!("connection read failed: {e}");
                break;
            }
        };
        match frame {
            Frame::Message(m) => {
                if to_rmcp.write_all(&m).await.is_err() {
                    break;
                }
            }
            Frame::Oversized => {
                tracing::warn!(limit, "discarded a message over the size limit");
                let msg = format!(
                    "Invalid Request: message larger than the {limit}-byte limit was discarded"
                );
                if replies.send(error_line(-32600, &msg)).await.is_err() {
                    break;
                }
            }
            Frame::Malformed(why) => {
                let msg = format!("Parse error: {why}");
                if replies.send(error_line(-32700, &msg)).await.is_err() {
                    break;
                }
            }
            Frame::Eof => break,
        }
    }
    let _ = to_rmcp.shutdown().await;
}

/// Copies rmcp's output lines to `replies`, one whole line at a time.
pub async fn pump_out<R: AsyncRead + Unpin>(from_rmcp: R, replies: mpsc::Sender<Vec<u8>>) {
    let mut r = BufReader::new(from_rmcp);
    loop {
        let mut line = Vec::new();
        match r.read_until(b'\n', &mut line).await {
            Ok(0) | Err(_) => break,
            Ok(_) => {
                if replies.send(line).await.is_err() {
                    break;
                }
            }
        }
    }
}

/// Writes every line from `lines` to the socket until all senders are gone.
pub async fn write_lines<W: AsyncWrite + Unpin>(mut w: W, mut lines: mpsc::Receiver<Vec<u8>>) {
    while let Some(line) = lines.recv().await {
        if w.write_all(&line).await.is_err() || w.flush().await.is_err() {
            break;
        }
    }
    let _ = w.shutdown().await;
}

#[cfg(test)]
mod tests {
    use super::*;

    #[tokio::test]
    async fn frames() {
        let input: &[u8] = b"{\"a\":1}\n\n{bad\n0123456789012345678901234567890\n[1]";
        let mut r = LineReader::new(input, 16);
        assert_eq!(
            r.next().await.unwrap(),
            Frame::Message(b"{\"a\":1}\n".to_vec())
        );
        assert!(matches!(r.next().await.unwrap(), Frame::Malformed(_)));
        assert_eq!(r.next().await.unwrap(), Frame::Oversized);
        // A last line without a newline is incomplete: the peer went away mid-message.
        assert_eq!(r.next().await.unwrap(), Frame::Eof);
    }
}
