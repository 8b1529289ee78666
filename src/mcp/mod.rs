//! MCP over a Unix socket: the listener, one rmcp service per connection, framing. Only this
//! module knows JSON-RPC.

mod framing;
mod handler;

pub use handler::{Handler, AUDIT_URI};

use std::os::unix::fs::{FileTypeExt, PermissionsExt};
use std::path::{Path, PathBuf};
use std::sync::Arc;

use rmcp::ServiceExt;
use tokio::net::{UnixListener, UnixStream};
use tokio::sync::{mpsc, Semaphore};
use tokio_util::sync::CancellationToken;
use tokio_util::task::TaskTracker;

use crate::audit::Principal;
use crate::exec::Executor;

#[derive(Debug, thiserror::Error)]
pub enum ListenError {
    #[error("{path}: another daemon is already listening on this socket")]
    InUse { path: PathBuf },
    #[error("{path}: exists and is not a socket; refusing to replace it")]
    NotASocket { path: PathBuf },
    #[error("{path}: cannot {op}: {source}")]
    Io {
        op: &'static str,
        path: PathBuf,
        source: std::io::Error,
    },
    #[error("{path}: no group named {group:?}")]
    NoGroup { path: PathBuf, group: String },
}

/// Binds the daemon's socket: a stale socket of a dead daemon is replaced, a live one is
/// never stolen; the file gets `mode` (and `group`) before anyone can connect.
pub fn bind(path: &Path, mode: u32, group: Option<&str>) -> Result<UnixListener, ListenError> {
    let io = |op, source| ListenError::Io {
        op,
        path: path.to_path_buf(),
        source,
    };
    match std::fs::symlink_metadata(path) {
        Ok(m) if !m.file_type().is_socket() => {
            return Err(ListenError::NotASocket { path: path.into() })
        }
        Ok(_) => match std::os::unix::net::UnixStream::connect(path) {
            Ok(_) => return Err(ListenError::InUse { path: path.into() }),
            Err(e) if e.kind() == std::io::ErrorKind::ConnectionRefused => {
                tracing::info!(path = %path.display(), "replacing the stale socket of a dead daemon");
                std::fs::remove_file(path).map_err(|e| io("remove stale socket", e))?;
            }
            Err(e) => return Err(io("probe existing socket", e)),
        },
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => {}
        Err(e) => return Err(io("stat", e)),
    }
    if let Some(parent) = path.parent().filter(|p| !p.as_os_str().is_empty()) {
        std::fs::create_dir_all(parent).map_err(|e| io("create parent dir", e))?;
    }
    // The umask makes the socket private from the instant it exists; the mode is then
    // widened (never narrowed) to what the policy asks.
    // SAFETY: umask only swaps the process's file mode mask; it cannot fail.
    let old = unsafe { libc::umask(0o177) };
    let bound = UnixListener::bind(path);
    // SAFETY: as above, restoring the previous mask.
    unsafe { libc::umask(old) };
    let listener = bound.map_err(|e| io("bind", e))?;
    if let Some(g) = group {
        let gid = nix::unistd::Group::from_name(g)
            .ok()
            .flatten()
            .ok_or_else(|| ListenError::NoGroup {
                path: path.into(),
                group: g.to_string(),
            })?
            .gid;
        std::os::unix::fs::chown(path, None, Some(gid.as_raw())).map_err(|e| io("chown", e))?;
    }
    std::fs::set_permissions(path, std::fs::Permissions::from_mode(mode))
        .map_err(|e| io("chmod", e))?;
    Ok(listener)
}

/// Accepts connections until `shutdown`, then waits for every connection task to end.
pub async fn run(listener: UnixListener, exec: Arc<Executor>, shutdown: CancellationToken) {
    let limit = Arc::new(Semaphore::new(exec.policy.daemon.max_connections));
    let tasks = TaskTracker::new();
    loop {
        let permit = tokio::select! {
            p = limit.clone().acquire_owned() => match p { Ok(p) => p, Err(_) => break },
            _ = shutdown.cancelled() => break,
        };
        let stream = tokio::select! {
            r = listener.accept() => match r {
                Ok((s, _)) => s,
                Err(e) => {
                    // Out of fds and the like: one failed accept never stops the listener.
                    tracing::warn!("accept failed: {e}");
                    tokio::time::sleep(std::time::Duration::from_millis(50)).await;
                    continue;
                }
            },
            _ = shutdown.cancelled() => break,
        };
        let exec = exec.clone();
        let shutdown = shutdown.clone();
        tasks.spawn(async move {
            serve_connection(stream, exec, shutdown).await;
            drop(permit);
        });
    }
    tasks.close();
    tasks.wait().await;
}

/// Serves one client until it disconnects or the daemon shuts down. Its calls are
/// cancelled (workers killed, nothing published) when it goes away.
pub async fn serve_connection(
    stream: UnixStream,
    exec: Arc<Executor>,
    shutdown: CancellationToken,
) {
    let peer = match stream.peer_cred() {
        Ok(c) => Principal {
            uid: c.uid(),
            gid: c.gid(),
            pid: c.pid(),
            client: None,
        },
        Err(e) => {
            tracing::warn!("SO_PEERCRED failed, dropping the connection: {e}");
            return;
        }
    };
    // A worker never drives the daemon, whatever socket rights a profile gave it: its peer
    // credentials tell (its uid is a worker uid, or its process group is a live worker's).
    if exec.is_worker_peer(peer.pid, peer.uid) {
        tracing::warn!(
            uid = peer.uid,
            pid = ?peer.pid,
            "refused an MCP connection from a worker process"
        );
        return;
    }
    let limit = exec.policy.daemon.max_message_bytes;
    let (sock_r, sock_w) = stream.into_split();
    let (rmcp_side, ours) = tokio::io::duplex(256 * 1024);
    let (from_rmcp, to_rmcp) = tokio::io::split(ours);
    let (tx, rx) = mpsc::channel::<Vec<u8>>(64);
    let writer = tokio::spawn(framing::write_lines(sock_w, rx));
    // The end of the client's input ends its session (as closing stdin does for a stdio
    // server): its running calls are cancelled at once, so a client that went away never
    // has a call commit behind its back. rmcp alone would let them run on for a while.
    let ct = shutdown.child_token();
    let input_ended = ct.clone();
    let pump = framing::pump_in(framing::LineReader::new(sock_r, limit), to_rmcp, tx.clone());
    let reader = tokio::spawn(async move {
        pump.await;
        input_ended.cancel();
    });
    let out = tokio::spawn(framing::pump_out(from_rmcp, tx));
    match Handler::new(exec, peer.clone())
        .serve_with_ct(rmcp_side, ct)
        .await
    {
        Ok(service) => {
            if let Err(e) = service.waiting().await {
                tracing::debug!(uid = peer.uid, "connection ended: {e}");
            }
        }
        Err(e) => tracing::info!(uid = peer.uid, "MCP handshake failed: {e}"),
    }
    reader.abort();
    let _ = out.await;
    let _ = writer.await;
}
