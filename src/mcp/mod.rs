//! MCP over a Unix socket: the listener, one rmcp service per connection, framing. Only this
//! module knows JSON-RPC.

mod cancel;
pub mod codes;
mod framing;
mod handler;

pub use cancel::Calls;
pub use handler::{Handler, AUDIT_URI};

use std::collections::HashMap;
use std::os::unix::fs::{FileTypeExt, PermissionsExt};
use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex};

use rmcp::ServiceExt;
use tokio::net::{UnixListener, UnixStream};
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

/// How many connections are open, in total and per uid.
#[derive(Default)]
struct Counts {
    total: usize,
    per_uid: HashMap<u32, usize>,
}

/// One admitted connection's place in [`Counts`], given back when it ends.
struct Slot {
    counts: Arc<Mutex<Counts>>,
    uid: u32,
}

impl Drop for Slot {
    fn drop(&mut self) {
        let mut c = self.counts.lock().unwrap_or_else(|p| p.into_inner());
        c.total -= 1;
        if let Some(n) = c.per_uid.get_mut(&self.uid) {
            *n -= 1;
            if *n == 0 {
                c.per_uid.remove(&self.uid);
            }
        }
    }
}

/// Admits a connection of `uid`, or says which cap it would exceed.
fn admit(
    counts: &Arc<Mutex<Counts>>,
    uid: u32,
    max_total: usize,
    max_per_uid: usize,
) -> Result<Slot, String> {
    let mut c = counts.lock().unwrap_or_else(|p| p.into_inner());
    if c.total >= max_total {
        return Err(format!(
            "the daemon already serves its maximum of {max_total} connections (max_connections); try again later"
        ));
    }
    let mine = c.per_uid.get(&uid).copied().unwrap_or(0);
    if mine >= max_per_uid {
        return Err(format!(
            "uid {uid} already holds its maximum of {max_per_uid} connections (max_connections_per_uid)"
        ));
    }
    c.total += 1;
    *c.per_uid.entry(uid).or_default() += 1;
    Ok(Slot {
        counts: counts.clone(),
        uid,
    })
}

/// Accepts connections until `shutdown`, then waits for every connection task to end, for
/// at most `shutdown_timeout`.
///
/// Every connection is accepted at once, so a refused one learns why (a JSON-RPC error
/// line, then EOF) instead of waiting in the backlog: past `max_connections` in total or
/// `max_connections_per_uid` for its peer's uid.
pub async fn run(listener: UnixListener, exec: Arc<Executor>, shutdown: CancellationToken) {
    let policy = exec.policy();
    let d = &policy.daemon;
    let (max_total, max_per_uid) = (d.max_connections, d.max_connections_per_uid);
    let shutdown_timeout = d.shutdown_timeout;
    let counts = Arc::new(Mutex::new(Counts::default()));
    let tasks = TaskTracker::new();
    loop {
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
        let peer = match stream.peer_cred() {
            Ok(c) => Principal {
                uid: c.uid(),
                gid: c.gid(),
                pid: c.pid(),
                client: None,
                groups: peer_groups(&stream),
            },
            Err(e) => {
                tracing::warn!("SO_PEERCRED failed, dropping the connection: {e}");
                continue;
            }
        };
        // A worker never drives the daemon, whatever socket rights a profile gave it: its
        // peer credentials tell (its uid is a worker uid, or its process group is a live
        // worker's).
        if exec.is_worker_peer(peer.pid, peer.uid) {
            tracing::warn!(
                uid = peer.uid,
                pid = ?peer.pid,
                "refused an MCP connection from a worker process"
            );
            continue;
        }
        let slot = match admit(&counts, peer.uid, max_total, max_per_uid) {
            Ok(s) => s,
            Err(why) => {
                tracing::warn!(
                    uid = peer.uid,
                    pid = peer.pid,
                    "refused a connection: {why}"
                );
                // A fresh socket's buffer takes one short line; if not, the close says it.
                let _ = stream.try_write(&framing::error_line(
                    &serde_json::Value::Null,
                    codes::LIMIT_REACHED,
                    &why,
                ));
                continue;
            }
        };
        let exec = exec.clone();
        let shutdown = shutdown.clone();
        tasks.spawn(async move {
            serve_connection(stream, peer, exec, shutdown).await;
            drop(slot);
        });
    }
    tasks.close();
    if tokio::time::timeout(shutdown_timeout, tasks.wait())
        .await
        .is_err()
    {
        tracing::warn!(
            connections = tasks.len(),
            "connections still open {shutdown_timeout:?} after shutdown began; exiting anyway \
             (startup recovery completes or rolls back any call left mid-way)"
        );
    }
}

/// Serves one client until it disconnects, is dropped, or the daemon shuts down. Its calls
/// are cancelled (workers killed, nothing published) when it goes away.
///
/// A connection is closed when: it sends no `initialize` within `handshake_timeout`; it has
/// nothing in flight and sends no message for `idle_timeout`; a reply waits longer than
/// `write_timeout` for it to read, or more than `max_queued_bytes` wait at once (a client
/// that does not read); or, after SIGTERM, within a second of the last reply.
pub async fn serve_connection(
    stream: UnixStream,
    peer: Principal,
    exec: Arc<Executor>,
    shutdown: CancellationToken,
) {
    let policy = exec.policy();
    let d = &policy.daemon;
    let (limit, write_timeout) = (d.max_message_bytes, d.write_timeout);
    let (handshake_timeout, idle_timeout) = (d.handshake_timeout, d.idle_timeout);
    let uid = peer.uid;
    let (sock_r, sock_w) = stream.into_split();
    let (rmcp_side, ours) = tokio::io::duplex(256 * 1024);
    let (from_rmcp, to_rmcp) = tokio::io::split(ours);
    let (queue, rx, queued) = framing::OutQueue::new(d.max_queued_bytes);
    let ids = Arc::new(Mutex::new(framing::Ids::new(
        d.max_requests_per_connection,
        d.max_message_bytes,
    )));
    let (calls, client) = {
        let ids = ids.lock().unwrap_or_else(|p| p.into_inner());
        (ids.calls(), ids.client_name())
    };
    let freed = Arc::new(tokio::sync::Notify::new());
    // `ct` ends the client's MCP session and cancels its calls; `kill` also drops its
    // output at once. The end of the client's input cancels `ct` only (as closing stdin
    // does for a stdio server), so replies already queued still go out.
    let ct = shutdown.child_token();
    let kill = CancellationToken::new();
    let drop_conn = {
        let (ct, kill) = (ct.clone(), kill.clone());
        move |why: &str| {
            tracing::warn!(uid, "dropping the connection: {why}");
            kill.cancel();
            ct.cancel();
        }
    };
    let writer = tokio::spawn({
        let (kill, drop_conn) = (kill.clone(), drop_conn.clone());
        async move {
            match framing::write_lines(sock_w, rx, queued, write_timeout, kill).await {
                framing::WriteEnd::TimedOut => drop_conn(&format!(
                    "the client did not read a reply within {write_timeout:?} (write_timeout)"
                )),
                framing::WriteEnd::Failed => drop_conn("the socket write failed"),
                framing::WriteEnd::Done | framing::WriteEnd::Stopped => {}
            }
        }
    });
    let overflow = format!(
        "more than {} bytes of replies wait for the client to read (max_queued_bytes)",
        d.max_queued_bytes
    );
    let reader = tokio::spawn({
        let (ct, ids, queue, freed) = (ct.clone(), ids.clone(), queue.clone(), freed.clone());
        let (drop_conn, overflow) = (drop_conn.clone(), overflow.clone());
        let lines = framing::LineReader::new(sock_r, limit);
        let pump = framing::pump_in(lines, to_rmcp, queue, ids, freed);
        async move {
            if pump.await.is_err() {
                drop_conn(&overflow);
            }
            ct.cancel();
        }
    });
    let out = tokio::spawn({
        let (ids, drop_conn) = (ids.clone(), drop_conn.clone());
        framing::pump_out(from_rmcp, queue, ids, freed, move || drop_conn(&overflow))
    });
    // After SIGTERM, replies (the cancelled calls' errors) get a second to go out.
    let last_flush = tokio::spawn({
        let (shutdown, kill) = (shutdown.clone(), kill.clone());
        async move {
            shutdown.cancelled().await;
            tokio::time::sleep(std::time::Duration::from_secs(1)).await;
            kill.cancel();
        }
    });

    let handshake =
        Handler::new(exec, peer, calls, client, ct.clone()).serve_with_ct(rmcp_side, ct.clone());
    let service = tokio::select! {
        r = tokio::time::timeout(handshake_timeout, handshake) => match r {
            Ok(Ok(service)) => Some(service),
            Ok(Err(e)) => {
                tracing::info!(uid, "MCP handshake failed: {e}");
                None
            }
            Err(_) => {
                drop_conn(&format!("no initialize within {handshake_timeout:?} (handshake_timeout)"));
                None
            }
        },
        _ = kill.cancelled() => None,
    };
    if let Some(service) = service {
        let mut waiting = std::pin::pin!(service.waiting());
        let idle = async {
            loop {
                let idle = ids.lock().unwrap_or_else(|p| p.into_inner()).idle_for();
                if idle >= idle_timeout {
                    return;
                }
                tokio::time::sleep((idle_timeout - idle).max(std::time::Duration::from_millis(50)))
                    .await;
            }
        };
        let ended = tokio::select! {
            r = &mut waiting => Some(r),
            _ = idle => {
                drop_conn(&format!("idle for {idle_timeout:?} (idle_timeout)"));
                None
            }
            _ = kill.cancelled() => None,
        };
        let r = match ended {
            Some(r) => r,
            None => {
                ct.cancel();
                waiting.await
            }
        };
        if let Err(e) = r {
            tracing::debug!(uid, "connection ended: {e}");
        }
    }
    ct.cancel();
    reader.abort();
    // What is queued goes out within the write timeout, then everything goes.
    let flush = tokio::spawn({
        let kill = kill.clone();
        async move {
            tokio::time::sleep(write_timeout).await;
            kill.cancel();
        }
    });
    let _ = writer.await;
    // rmcp is done with its side; what it still had in the pipe is discarded.
    out.abort();
    flush.abort();
    last_flush.abort();
    tracing::debug!(uid, "connection closed");
}

/// The supplementary groups of the socket's peer as they were when it connected
/// (SO_PEERGROUPS): grants to a group hold for its members. Empty if the kernel cannot say.
fn peer_groups(stream: &tokio::net::UnixStream) -> Vec<u32> {
    use std::os::fd::AsRawFd;
    let mut groups = vec![0u32; 256];
    loop {
        let mut len = (groups.len() * std::mem::size_of::<u32>()) as libc::socklen_t;
        // SAFETY: getsockopt writes at most `len` bytes into `groups`, which holds that many,
        // and updates `len`; the fd is the open stream's.
        let rc = unsafe {
            libc::getsockopt(
                stream.as_raw_fd(),
                libc::SOL_SOCKET,
                libc::SO_PEERGROUPS,
                groups.as_mut_ptr().cast(),
                &mut len,
            )
        };
        let n = len as usize / std::mem::size_of::<u32>();
        if rc == 0 {
            groups.truncate(n);
            return groups;
        }
        // ERANGE: the buffer was too small; `len` says how large it must be.
        if std::io::Error::last_os_error().raw_os_error() == Some(libc::ERANGE)
            && n > groups.len()
            && n <= 65_536
        {
            groups.resize(n, 0);
            continue;
        }
        return Vec::new();
    }
}
