//! One client connection ([`Connection`]): the socket's two halves, the in-memory pipe to
//! rmcp, the tasks that pump between them and the tokens that end it. It lives through three
//! steps: [`Connection::open`] starts the pumps, [`Connection::run_session`] serves the MCP
//! session until it ends, and [`Connection::close`] shuts the connection down in one fixed
//! sequence.

use std::future::Future;
use std::pin::Pin;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use rmcp::ServiceExt;
use tokio::io::DuplexStream;
use tokio::net::UnixStream;
use tokio::task::JoinHandle;
use tokio_util::sync::CancellationToken;

use super::framing::{self, Ids, WriteEnd};
use super::Handler;
use crate::audit::Principal;
use crate::exec::Executor;

/// The bytes the in-memory pipe between the framing and rmcp buffers each way.
const RMCP_PIPE_BYTES: usize = 256 * 1024;

/// After SIGTERM, how long replies (the cancelled calls' errors) get to go out.
const LAST_FLUSH: Duration = Duration::from_secs(1);

/// The shortest wait between two checks of the idle timeout.
const IDLE_CHECK_MIN: Duration = Duration::from_millis(50);

/// The two ways a connection ends, shared by its tasks.
#[derive(Clone)]
struct Ending {
    uid: u32,
    /// Ends the client's MCP session and cancels its calls; replies already queued still go
    /// out. A child of the daemon's shutdown token. The end of the client's input cancels
    /// this one only, as closing stdin does for a stdio server.
    session: CancellationToken,
    /// Drops the connection's output at once (and ends the session).
    output: CancellationToken,
}

impl Ending {
    /// Drops the connection, saying why: its output is discarded, its session ends.
    fn drop_connection(&self, why: &str) {
        tracing::warn!(uid = self.uid, "dropping the connection: {why}");
        self.output.cancel();
        self.session.cancel();
    }
}

/// What [`Connection::run_session`] leaves of rmcp's session for [`Connection::close`].
enum Session {
    /// No session was established (the handshake failed, timed out, or the connection was
    /// dropped during it).
    None,
    /// rmcp's session ended by itself.
    Ended(Result<rmcp::service::QuitReason, tokio::task::JoinError>),
    /// The session was cut (idle, or the connection dropped): rmcp still winds it down.
    Cut(Waiting),
}

type Waiting =
    Pin<Box<dyn Future<Output = Result<rmcp::service::QuitReason, tokio::task::JoinError>> + Send>>;

/// One client's connection and everything it holds.
pub(super) struct Connection {
    uid: u32,
    write_timeout: Duration,
    handshake_timeout: Duration,
    idle_timeout: Duration,
    ending: Ending,
    /// The request gate's table, shared with the pumps.
    ids: Arc<Mutex<Ids>>,
    /// The socket to rmcp, through the request gate; its end (the client's input ended, or
    /// the reply queue overflowed) ends the session.
    reader: JoinHandle<()>,
    /// rmcp to the out queue, under the client's ids.
    out: JoinHandle<()>,
    /// The out queue to the socket, each line within `write_timeout`.
    writer: JoinHandle<()>,
    /// After the daemon's shutdown, drops the output [`LAST_FLUSH`] later.
    last_flush: JoinHandle<()>,
}

impl Connection {
    /// Serves one client until it disconnects, is dropped, or the daemon shuts down, then
    /// closes the connection (see [`Connection::close`]).
    pub(super) async fn serve(
        stream: UnixStream,
        peer: Principal,
        exec: Arc<Executor>,
        shutdown: CancellationToken,
    ) {
        let (conn, rmcp_side) = Connection::open(stream, peer.uid, &exec, &shutdown);
        let (calls, client) = {
            let ids = conn.ids.lock().unwrap_or_else(|p| p.into_inner());
            (ids.calls(), ids.client_name())
        };
        let handler = Handler::new(exec, peer, calls, client, conn.ending.session.clone());
        let session = conn.run_session(handler, rmcp_side).await;
        conn.close(session).await;
    }

    /// Splits the socket and starts the pumps between it and rmcp's end of an in-memory
    /// pipe, which is returned for rmcp to serve on.
    fn open(
        stream: UnixStream,
        uid: u32,
        exec: &Executor,
        shutdown: &CancellationToken,
    ) -> (Connection, DuplexStream) {
        let policy = exec.policy();
        let d = &policy.daemon;
        let write_timeout = d.write_timeout;
        let (sock_r, sock_w) = stream.into_split();
        let (rmcp_side, ours) = tokio::io::duplex(RMCP_PIPE_BYTES);
        let (from_rmcp, to_rmcp) = tokio::io::split(ours);
        let (queue, rx, queued) = framing::OutQueue::new(d.max_queued_bytes);
        let ids = Arc::new(Mutex::new(Ids::new(
            d.max_requests_per_connection,
            d.max_message_bytes,
        )));
        let freed = Arc::new(tokio::sync::Notify::new());
        let ending = Ending {
            uid,
            session: shutdown.child_token(),
            output: CancellationToken::new(),
        };
        let writer = tokio::spawn({
            let ending = ending.clone();
            async move {
                let stop = ending.output.clone();
                match framing::write_lines(sock_w, rx, queued, write_timeout, stop).await {
                    WriteEnd::TimedOut => ending.drop_connection(&format!(
                        "the client did not read a reply within {write_timeout:?} (write_timeout)"
                    )),
                    WriteEnd::Failed => ending.drop_connection("the socket write failed"),
                    WriteEnd::Done | WriteEnd::Stopped => {}
                }
            }
        });
        let overflow = format!(
            "more than {} bytes of replies wait for the client to read (max_queued_bytes)",
            d.max_queued_bytes
        );
        let reader = tokio::spawn({
            let (ending, overflow) = (ending.clone(), overflow.clone());
            let lines = framing::LineReader::new(sock_r, d.max_message_bytes);
            let pump = framing::pump_in(lines, to_rmcp, queue.clone(), ids.clone(), freed.clone());
            async move {
                if pump.await.is_err() {
                    ending.drop_connection(&overflow);
                }
                ending.session.cancel();
            }
        });
        let out = tokio::spawn({
            let ending = ending.clone();
            framing::pump_out(from_rmcp, queue, ids.clone(), freed, move || {
                ending.drop_connection(&overflow)
            })
        });
        let last_flush = tokio::spawn({
            let (shutdown, output) = (shutdown.clone(), ending.output.clone());
            async move {
                shutdown.cancelled().await;
                tokio::time::sleep(LAST_FLUSH).await;
                output.cancel();
            }
        });
        let conn = Connection {
            uid,
            write_timeout,
            handshake_timeout: d.handshake_timeout,
            idle_timeout: d.idle_timeout,
            ending,
            ids,
            reader,
            out,
            writer,
            last_flush,
        };
        (conn, rmcp_side)
    }

    /// The MCP session: the handshake within `handshake_timeout`, then rmcp serves until
    /// the session ends by itself (the client's input ended, rmcp quit, the daemon shuts
    /// down), the connection has nothing in flight and hears nothing for `idle_timeout`,
    /// or it is dropped.
    async fn run_session(&self, handler: Handler, rmcp_side: DuplexStream) -> Session {
        let (uid, ending) = (self.uid, &self.ending);
        let handshake = handler.serve_with_ct(rmcp_side, ending.session.clone());
        let service = tokio::select! {
            r = tokio::time::timeout(self.handshake_timeout, handshake) => match r {
                Ok(Ok(service)) => service,
                Ok(Err(e)) => {
                    tracing::info!(uid, "MCP handshake failed: {}", crate::report::chain(&e));
                    return Session::None;
                }
                Err(_) => {
                    ending.drop_connection(&format!(
                        "no initialize within {:?} (handshake_timeout)",
                        self.handshake_timeout
                    ));
                    return Session::None;
                }
            },
            _ = ending.output.cancelled() => return Session::None,
        };
        let mut waiting: Waiting = Box::pin(service.waiting());
        tokio::select! {
            r = &mut waiting => Session::Ended(r),
            _ = self.idle() => {
                ending.drop_connection(&format!("idle for {:?} (idle_timeout)", self.idle_timeout));
                Session::Cut(waiting)
            }
            _ = ending.output.cancelled() => Session::Cut(waiting),
        }
    }

    /// Returns once the connection has had nothing in flight and received no message for
    /// `idle_timeout`.
    async fn idle(&self) {
        loop {
            let idle = self
                .ids
                .lock()
                .unwrap_or_else(|p| p.into_inner())
                .idle_for();
            if idle >= self.idle_timeout {
                return;
            }
            tokio::time::sleep((self.idle_timeout - idle).max(IDLE_CHECK_MIN)).await;
        }
    }

    /// Shuts the connection down, in this order:
    ///
    /// 1. stop reading: the session ends (its calls are cancelled: workers killed, nothing
    ///    published) and no further line of the client's is read;
    /// 2. finish or cancel what is in flight: rmcp winds the session down, its replies (the
    ///    cancelled calls' errors among them) going to the out queue;
    /// 3. flush: what is queued goes out, each line within `write_timeout`, all of it within
    ///    `write_timeout` (after SIGTERM, within a second), then the output is dropped;
    /// 4. close: what rmcp still had in the pipe is discarded, the timers stop, and the
    ///    socket closes with the last task holding it.
    async fn close(self, session: Session) {
        let Connection {
            uid,
            write_timeout,
            ending,
            reader,
            out,
            mut writer,
            last_flush,
            ..
        } = self;
        // 1. Stop reading. (A cut session's output is already dropped: nothing the reader
        // could still answer would reach the client.)
        ending.session.cancel();
        reader.abort();
        // 2. Finish or cancel what is in flight.
        let ended = match session {
            Session::None => None,
            Session::Ended(r) => Some(r),
            Session::Cut(waiting) => Some(waiting.await),
        };
        if let Some(Err(e)) = ended {
            tracing::debug!(uid, "connection ended: {}", crate::report::chain(&e));
        }
        // 3. Flush within the write timeout.
        tokio::select! {
            _ = &mut writer => {}
            _ = tokio::time::sleep(write_timeout) => {
                ending.output.cancel();
                let _ = writer.await;
            }
        }
        // 4. Close.
        out.abort();
        last_flush.abort();
        tracing::debug!(uid, "connection closed");
    }
}
