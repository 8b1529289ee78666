//! A worker's progress reports: the read end of the pipe whose write end the worker finds at
//! `$AIRLOCK_PROGRESS_FD` (only when its caller asked for progress).
//!
//! The protocol, for tool authors: write one JSON object per line,
//! `{"progress": 3, "total": 10, "message": "linking"}` (`progress` a finite number >= 0,
//! `total` and `message` optional), and flush. Nothing is ever read back.
//!
//! Nothing a worker writes here is trusted or can hurt the daemon:
//! - a line longer than [`MAX_LINE`] bytes is skipped whole, without being buffered;
//! - a line that is not valid UTF-8, not JSON or not of that shape is skipped;
//! - the message is cut to [`MAX_MESSAGE`] characters, control characters replaced;
//! - only the latest report is kept (a `watch` channel): whoever forwards them takes them at
//!   its own pace, so a flood coalesces instead of queueing;
//! - the daemon reads at most [`READ_BUDGET`] bytes per [`WINDOW`]; past that it stops
//!   reading until the window ends, so a flooding worker blocks on its own full pipe instead
//!   of spinning the daemon;
//! - the pipe is read only while the worker runs: a write end held open forever (even past
//!   the group's end) never delays the call.

use std::time::Duration;

use tokio::io::AsyncReadExt;
use tokio::net::unix::pipe;
use tokio::sync::watch;

/// The variable that names the progress descriptor in a worker's environment.
pub const PROGRESS_FD_ENV: &str = "AIRLOCK_PROGRESS_FD";

/// The longest report line kept; a longer one is skipped.
pub const MAX_LINE: usize = 1024;

/// The longest message forwarded, in characters.
pub const MAX_MESSAGE: usize = 200;

/// Bytes read per [`WINDOW`], at most.
pub const READ_BUDGET: usize = 16 * 1024;

/// The window of [`READ_BUDGET`].
pub const WINDOW: Duration = Duration::from_millis(100);

/// One report of a worker, checked.
#[derive(Debug, Clone, PartialEq)]
pub struct WorkerProgress {
    pub progress: f64,
    pub total: Option<f64>,
    pub message: Option<String>,
}

impl std::fmt::Display for WorkerProgress {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self.total {
            Some(t) => write!(f, "{}/{}", self.progress, t)?,
            None => write!(f, "{}", self.progress)?,
        }
        if let Some(m) = &self.message {
            write!(f, " {m}")?;
        }
        Ok(())
    }
}

/// Where the latest report goes.
pub type ProgressSender = watch::Sender<Option<WorkerProgress>>;

/// Parses one line (without its newline); `None` for anything but a well-formed report.
pub fn parse_line(line: &[u8]) -> Option<WorkerProgress> {
    if line.len() > MAX_LINE {
        return None;
    }
    let text = std::str::from_utf8(line).ok()?;
    let v: serde_json::Value = serde_json::from_str(text).ok()?;
    let o = v.as_object()?;
    if o.keys()
        .any(|k| !matches!(k.as_str(), "progress" | "total" | "message"))
    {
        return None;
    }
    let progress = o
        .get("progress")?
        .as_f64()
        .filter(|p| p.is_finite() && *p >= 0.0)?;
    let total = match o.get("total") {
        None | Some(serde_json::Value::Null) => None,
        Some(t) => Some(t.as_f64().filter(|t| t.is_finite() && *t > 0.0)?),
    };
    let message = match o.get("message") {
        None | Some(serde_json::Value::Null) => None,
        Some(m) => Some(
            m.as_str()?
                .chars()
                .take(MAX_MESSAGE)
                .map(|c| if c.is_control() { ' ' } else { c })
                .collect(),
        ),
    };
    Some(WorkerProgress {
        progress,
        total,
        message,
    })
}

/// Splits a byte stream into lines, each at most [`MAX_LINE`] bytes; longer lines are
/// dropped whole while their bytes stream past.
#[derive(Default)]
pub struct Lines {
    buf: Vec<u8>,
    skipping: bool,
}

impl Lines {
    /// Feeds bytes; calls `each` with every complete line that fits.
    pub fn feed(&mut self, mut bytes: &[u8], mut each: impl FnMut(&[u8])) {
        while !bytes.is_empty() {
            let (chunk, ends) = match bytes.iter().position(|b| *b == b'\n') {
                Some(i) => (&bytes[..i], Some(i + 1)),
                None => (bytes, None),
            };
            if !self.skipping {
                if self.buf.len() + chunk.len() > MAX_LINE {
                    self.buf.clear();
                    self.skipping = true;
                } else {
                    self.buf.extend_from_slice(chunk);
                }
            }
            match ends {
                Some(n) => {
                    if !self.skipping {
                        each(&self.buf);
                    }
                    self.buf.clear();
                    self.skipping = false;
                    bytes = &bytes[n..];
                }
                None => bytes = &[],
            }
        }
    }
}

/// Reads reports until the pipe's end (or forever: the caller drops this future when the
/// worker is done), keeping the latest well-formed one in `tx`.
pub async fn pump(mut rx: pipe::Receiver, tx: ProgressSender) {
    let mut lines = Lines::default();
    let mut chunk = vec![0u8; 4096];
    let mut window_start = tokio::time::Instant::now();
    let mut window_bytes = 0usize;
    loop {
        if window_bytes >= READ_BUDGET {
            tokio::time::sleep_until(window_start + WINDOW).await;
        }
        let now = tokio::time::Instant::now();
        if now >= window_start + WINDOW {
            window_start = now;
            window_bytes = 0;
        }
        let want = chunk.len().min(READ_BUDGET - window_bytes);
        let n = match rx.read(&mut chunk[..want]).await {
            Ok(0) | Err(_) => return,
            Ok(n) => n,
        };
        window_bytes += n;
        lines.feed(&chunk[..n], |line| {
            if let Some(p) = parse_line(line) {
                tx.send_replace(Some(p));
            }
        });
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn reports_are_checked() {
        let p = parse_line(br#"{"progress": 3, "total": 10, "message": "a\nb"}"#).unwrap();
        assert_eq!(p.progress, 3.0);
        assert_eq!(p.total, Some(10.0));
        assert_eq!(p.message.as_deref(), Some("a b"));
        assert_eq!(p.to_string(), "3/10 a b");
        assert!(parse_line(br#"{"progress": 1}"#).is_some());
        for bad in [
            &br#"{"progress": -1}"#[..],
            br#"{"progress": "1"}"#,
            br#"{"total": 3}"#,
            br#"{"progress": 1, "total": 0}"#,
            br#"{"progress": 1, "extra": 0}"#,
            br#"{"progress": 1, "message": 7}"#,
            br#"[1]"#,
            b"\xff\xfe",
            b"",
        ] {
            assert_eq!(parse_line(bad), None, "{:?}", String::from_utf8_lossy(bad));
        }
        let long = format!(r#"{{"progress": 1, "message": "{}"}}"#, "x".repeat(900));
        assert_eq!(
            parse_line(long.as_bytes()).unwrap().message.unwrap().len(),
            MAX_MESSAGE
        );
    }

    #[test]
    fn long_lines_are_skipped_whole_across_chunks() {
        let mut lines = Lines::default();
        let mut got = Vec::new();
        let huge = vec![b'a'; MAX_LINE * 3];
        lines.feed(b"one\ntw", |l| got.push(l.to_vec()));
        lines.feed(b"o\n", |l| got.push(l.to_vec()));
        for piece in huge.chunks(100) {
            lines.feed(piece, |l| got.push(l.to_vec()));
        }
        lines.feed(b"\nthree\n", |l| got.push(l.to_vec()));
        assert_eq!(
            got,
            vec![b"one".to_vec(), b"two".to_vec(), b"three".to_vec()]
        );
        assert!(lines.buf.is_empty());
    }
}
