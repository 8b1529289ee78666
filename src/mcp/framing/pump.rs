//! The I/O pumps between the socket and rmcp: [`pump_in`] (socket to rmcp, through the
//! [`LineReader`] and the request gate), [`pump_out`] (rmcp to the client's [`OutQueue`],
//! under the client's ids) and [`write_lines`] (the queue to the socket, each line within
//! the write timeout). The queue is bounded in bytes; exceeding it or the write timeout
//! drops the connection (the caller's decision).

use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use tokio::io::{AsyncBufReadExt, AsyncRead, AsyncWrite, AsyncWriteExt, BufReader};
use tokio::sync::{mpsc, Notify};
use tokio_util::sync::CancellationToken;

use super::gate::{error_line, Ids, Inbound};
use super::scan::{recover_id, scan_top, Frame, LineSplitter};
use crate::audit::truncate;
use crate::mcp::codes;

/// A [`LineSplitter`] over a socket's read half.
pub struct LineReader<R> {
    inner: BufReader<R>,
    pub(super) split: LineSplitter,
}

impl<R: AsyncRead + Unpin> LineReader<R> {
    pub fn new(inner: R, limit: usize) -> Self {
        LineReader {
            inner: BufReader::with_capacity(64 * 1024, inner),
            split: LineSplitter::new(limit),
        }
    }

    /// The next non-blank line; never holds more than `limit` bytes of one line in memory.
    /// A last line without a newline is incomplete (the peer went away mid-message): Eof.
    pub async fn next(&mut self) -> std::io::Result<Frame> {
        loop {
            let chunk = self.inner.fill_buf().await?;
            if chunk.is_empty() {
                return Ok(Frame::Eof);
            }
            let (used, frame) = self.split.feed(chunk);
            self.inner.consume(used);
            if let Some(frame) = frame {
                return Ok(frame);
            }
        }
    }
}

/// Why a connection's output was given up.
#[derive(Debug, PartialEq, Eq)]
pub enum PushError {
    /// More than the queue's byte limit would be waiting for the client.
    Full,
    /// The writer is gone.
    Closed,
}

/// The lines waiting for one client, bounded in bytes (a line larger than the limit is
/// accepted only into an empty queue, so one large reply still goes out).
#[derive(Clone)]
pub struct OutQueue {
    tx: mpsc::UnboundedSender<Vec<u8>>,
    bytes: Arc<AtomicUsize>,
    limit: usize,
}

impl OutQueue {
    pub fn new(limit: usize) -> (OutQueue, mpsc::UnboundedReceiver<Vec<u8>>, Arc<AtomicUsize>) {
        let (tx, rx) = mpsc::unbounded_channel();
        let bytes = Arc::new(AtomicUsize::new(0));
        (
            OutQueue {
                tx,
                bytes: bytes.clone(),
                limit,
            },
            rx,
            bytes,
        )
    }

    pub fn push(&self, line: Vec<u8>) -> Result<(), PushError> {
        let n = line.len();
        self.bytes
            .fetch_update(Ordering::SeqCst, Ordering::SeqCst, |cur| {
                (cur == 0 || cur + n <= self.limit).then_some(cur + n)
            })
            .map_err(|_| PushError::Full)?;
        self.tx.send(line).map_err(|_| PushError::Closed)
    }
}

/// The bytes of one line a wire log shows.
const WIRE_LOG_BYTES: usize = 2048;

/// Logs one line as it crossed the socket (`in` from the client, `out` to it), at trace level
/// under the target `airlock::wire` (`AIRLOCK_LOG=airlock::wire=trace`), cut to
/// [`WIRE_LOG_BYTES`]: what the interop tests print when a client fails.
fn wire_log(dir: &'static str, line: &[u8]) {
    if tracing::enabled!(target: "airlock::wire", tracing::Level::TRACE) {
        let text = String::from_utf8_lossy(line);
        let text = truncate(text.trim_end(), WIRE_LOG_BYTES);
        tracing::trace!(target: "airlock::wire", dir, "{text}");
    }
}

/// Copies lines from the socket to rmcp's input, answering bad ones on `replies`.
pub async fn pump_in<R, W>(
    mut reader: LineReader<R>,
    mut to_rmcp: W,
    replies: OutQueue,
    ids: Arc<Mutex<Ids>>,
    freed: Arc<Notify>,
) -> Result<(), PushError>
where
    R: AsyncRead + Unpin,
    W: AsyncWrite + Unpin,
{
    let limit = reader.split.limit();
    let result = loop {
        let frame = match reader.next().await {
            Ok(f) => f,
            Err(e) => {
                tracing::debug!("connection read failed: {}", crate::report::chain(&e));
                break Ok(());
            }
        };
        let action = match frame {
            Frame::Line(line) => {
                wire_log("in", &line);
                // At an in-flight cap (count or bytes), a request waits here, unread further,
                // until a reply frees room: the client's pipeline stalls instead of the daemon's memory
                // growing. (A cancellation behind it waits too.)
                let top = scan_top(&line);
                if top.method.is_some() && top.id.is_some() {
                    while ids
                        .lock()
                        .unwrap_or_else(|p| p.into_inner())
                        .full(line.len())
                    {
                        freed.notified().await;
                    }
                }
                ids.lock().unwrap_or_else(|p| p.into_inner()).inbound(&line)
            }
            Frame::Oversized(prefix) => {
                tracing::warn!(limit, "discarded a message over the size limit");
                let msg = format!(
                    "Invalid Request: message larger than the {limit}-byte limit was discarded"
                );
                Inbound::Reply(error_line(
                    &recover_id(&prefix),
                    codes::INVALID_REQUEST,
                    &msg,
                ))
            }
            Frame::Eof => break Ok(()),
        };
        match action {
            Inbound::Forward(m) => {
                if to_rmcp.write_all(&m).await.is_err() {
                    break Ok(());
                }
            }
            Inbound::Reply(line) => {
                if let Err(e) = replies.push(line) {
                    break Err(e);
                }
            }
            Inbound::Ignore => {}
        }
    };
    let _ = to_rmcp.shutdown().await;
    result
}

/// Copies rmcp's output lines to `replies`, one whole line at a time, under the client's ids;
/// each reply wakes `pump_in` if it waits for a free slot. Runs until rmcp's output ends:
/// once the queue is full (`overflow` is called, once) or the writer is gone, it reads on and
/// discards, so that rmcp, never blocked on a write, can wind the connection down.
pub async fn pump_out<R: AsyncRead + Unpin>(
    from_rmcp: R,
    replies: OutQueue,
    ids: Arc<Mutex<Ids>>,
    freed: Arc<Notify>,
    overflow: impl FnOnce(),
) {
    let mut r = BufReader::new(from_rmcp);
    let mut overflow = Some(overflow);
    let mut discarding = false;
    loop {
        let mut line = Vec::new();
        match r.read_until(b'\n', &mut line).await {
            Ok(0) | Err(_) => return,
            Ok(_) => {
                let mapped = ids.lock().unwrap_or_else(|p| p.into_inner()).outbound(line);
                freed.notify_one();
                let Some(line) = mapped.filter(|_| !discarding) else {
                    continue;
                };
                if let Err(e) = replies.push(line) {
                    discarding = true;
                    if e == PushError::Full {
                        if let Some(f) = overflow.take() {
                            f();
                        }
                    }
                }
            }
        }
    }
}

/// How the writer ended.
#[derive(Debug, PartialEq, Eq)]
pub enum WriteEnd {
    /// Every sender is gone and every line was written.
    Done,
    /// `stop` was cancelled.
    Stopped,
    /// A line was not taken by the client within the write timeout.
    TimedOut,
    /// The socket failed.
    Failed,
}

/// Writes every queued line to the socket until all senders are gone, each within
/// `write_timeout`, releasing its bytes from the queue's count once written.
pub async fn write_lines<W: AsyncWrite + Unpin>(
    mut w: W,
    mut lines: mpsc::UnboundedReceiver<Vec<u8>>,
    queued: Arc<AtomicUsize>,
    write_timeout: Duration,
    stop: CancellationToken,
) -> WriteEnd {
    loop {
        let line = tokio::select! {
            biased;
            _ = stop.cancelled() => return WriteEnd::Stopped,
            l = lines.recv() => match l {
                Some(l) => l,
                None => break,
            },
        };
        wire_log("out", &line);
        let write = async {
            w.write_all(&line).await?;
            w.flush().await
        };
        let r = tokio::select! {
            biased;
            _ = stop.cancelled() => return WriteEnd::Stopped,
            r = tokio::time::timeout(write_timeout, write) => r,
        };
        match r {
            Ok(Ok(())) => {}
            Ok(Err(_)) => return WriteEnd::Failed,
            Err(_) => return WriteEnd::TimedOut,
        }
        queued.fetch_sub(line.len(), Ordering::SeqCst);
    }
    let _ = tokio::time::timeout(write_timeout, w.shutdown()).await;
    WriteEnd::Done
}
