//! MCP over a Unix socket: the listener, one rmcp service per connection, framing. Only this
//! module knows JSON-RPC.

mod cancel;
pub mod codes;
mod connection;
mod framing;
mod handler;

pub use cancel::Calls;
pub use handler::{Handler, AUDIT_URI};

use connection::Connection;

use std::collections::HashMap;
use std::os::unix::fs::{DirBuilderExt, FileTypeExt, PermissionsExt};
use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex};
use std::time::Duration;

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
    #[error("{path}: cannot {op}")]
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
    // The socket is bound in a private dir of its own beside its path, given its group and
    // mode there, and only then renamed into place: no one can connect before it has them.
    // The process's umask is never changed: it is shared by every thread, and a worker's
    // spawner or template forked meanwhile would keep a narrowed one for its whole life.
    let parent = path
        .parent()
        .filter(|p| !p.as_os_str().is_empty())
        .unwrap_or(Path::new("."));
    let name = path
        .file_name()
        .ok_or_else(|| io("bind", std::io::ErrorKind::InvalidInput.into()))?;
    let private = parent.join(format!(".airlock.{}", std::process::id()));
    match std::fs::remove_dir_all(&private) {
        Err(e) if e.kind() != std::io::ErrorKind::NotFound => {
            return Err(io("remove the leftover bind dir", e))
        }
        _ => {}
    }
    std::fs::DirBuilder::new()
        .mode(0o700)
        .create(&private)
        .map_err(|e| io("create the bind dir", e))?;
    let bound = bind_privately(&private.join(name), path, mode, group);
    let removed = std::fs::remove_dir_all(&private);
    let listener = bound?;
    removed.map_err(|e| io("remove the bind dir", e))?;
    Ok(listener)
}

/// [`bind`]'s socket bound at `at` (in a dir only the daemon can enter), given `group` and
/// `mode`, then renamed to `path` (never over an entry that appeared there meanwhile).
fn bind_privately(
    at: &Path,
    path: &Path,
    mode: u32,
    group: Option<&str>,
) -> Result<UnixListener, ListenError> {
    let io = |op, source| ListenError::Io {
        op,
        path: path.to_path_buf(),
        source,
    };
    let listener = UnixListener::bind(at).map_err(|e| io("bind", e))?;
    if let Some(g) = group {
        let gid = nix::unistd::Group::from_name(g)
            .ok()
            .flatten()
            .ok_or_else(|| ListenError::NoGroup {
                path: path.into(),
                group: g.to_string(),
            })?
            .gid;
        std::os::unix::fs::chown(at, None, Some(gid.as_raw())).map_err(|e| io("chown", e))?;
    }
    std::fs::set_permissions(at, std::fs::Permissions::from_mode(mode))
        .map_err(|e| io("chmod", e))?;
    rustix::fs::renameat_with(
        rustix::fs::CWD,
        at,
        rustix::fs::CWD,
        path,
        rustix::fs::RenameFlags::NOREPLACE,
    )
    .map_err(|e| match e {
        rustix::io::Errno::EXIST => ListenError::InUse { path: path.into() },
        e => io("rename into place", e.into()),
    })?;
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

/// The connection cap a new connection would exceed.
#[derive(Debug, PartialEq, Eq, thiserror::Error)]
enum Refused {
    #[error("the daemon already serves its maximum of {0} connections (max_connections); try again later")]
    Total(usize),
    #[error("uid {uid} already holds its maximum of {max} connections (max_connections_per_uid)")]
    PerUid { uid: u32, max: usize },
}

/// Admits a connection of `uid`, or says which cap it would exceed.
fn admit(
    counts: &Arc<Mutex<Counts>>,
    uid: u32,
    max_total: usize,
    max_per_uid: usize,
) -> Result<Slot, Refused> {
    let mut c = counts.lock().unwrap_or_else(|p| p.into_inner());
    if c.total >= max_total {
        return Err(Refused::Total(max_total));
    }
    let mine = c.per_uid.get(&uid).copied().unwrap_or(0);
    if mine >= max_per_uid {
        return Err(Refused::PerUid {
            uid,
            max: max_per_uid,
        });
    }
    c.total += 1;
    *c.per_uid.entry(uid).or_default() += 1;
    Ok(Slot {
        counts: counts.clone(),
        uid,
    })
}

/// How long the accept loop waits after a failed accept: [`AcceptBackoff::MIN`], doubling
/// up to [`AcceptBackoff::MAX`] while accepts keep failing; a successful accept starts over.
#[derive(Debug)]
struct AcceptBackoff {
    next: Duration,
}

impl AcceptBackoff {
    const MIN: Duration = Duration::from_millis(10);
    const MAX: Duration = Duration::from_secs(1);

    /// An accept failed: how long to wait before the next.
    fn failed(&mut self) -> Duration {
        let wait = self.next;
        self.next = (wait * 2).min(Self::MAX);
        wait
    }

    /// An accept succeeded: the next failure waits the least again.
    fn succeeded(&mut self) {
        self.next = Self::MIN;
    }
}

impl Default for AcceptBackoff {
    fn default() -> Self {
        AcceptBackoff { next: Self::MIN }
    }
}

/// Accepts connections until `shutdown`, then waits for every connection task to end, for
/// at most `shutdown_timeout`.
///
/// Every connection is accepted at once, so a refused one learns why (a JSON-RPC error
/// line, then EOF) instead of waiting in the backlog: past `max_connections` in total or
/// `max_connections_per_uid` for its peer's uid.
pub async fn run(listener: UnixListener, exec: Arc<Executor>, shutdown: CancellationToken) {
    // Settings that need a restart: read once, without holding on to the start's policy (a
    // reload's old profiles, and their worker templates, go once nothing holds them).
    let (max_total, max_per_uid, shutdown_timeout) = {
        let policy = exec.policy();
        let d = &policy.daemon;
        (
            d.max_connections,
            d.max_connections_per_uid,
            d.shutdown_timeout,
        )
    };
    let counts = Arc::new(Mutex::new(Counts::default()));
    let tasks = TaskTracker::new();
    let mut backoff = AcceptBackoff::default();
    loop {
        let stream = tokio::select! {
            r = listener.accept() => match r {
                Ok((s, _)) => {
                    backoff.succeeded();
                    s
                }
                Err(e) => {
                    // Out of fds and the like: one failed accept never stops the listener;
                    // while accepts keep failing, it retries less and less often.
                    let wait = backoff.failed();
                    tracing::warn!("accept failed: {}; retrying in {wait:?}", crate::report::chain(&e));
                    tokio::select! {
                        _ = tokio::time::sleep(wait) => {}
                        _ = shutdown.cancelled() => break,
                    }
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
                tracing::warn!(
                    "SO_PEERCRED failed, dropping the connection: {}",
                    crate::report::chain(&e)
                );
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
                    &why.to_string(),
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
/// that does not read); or, after SIGTERM, within a second of the last reply. See
/// `connection::Connection` for its tasks and its shutdown sequence.
pub async fn serve_connection(
    stream: UnixStream,
    peer: Principal,
    exec: Arc<Executor>,
    shutdown: CancellationToken,
) {
    Connection::serve(stream, peer, exec, shutdown).await;
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

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn accept_failures_back_off_from_10_ms_doubling_to_1_s_and_a_success_resets() {
        let ms = Duration::from_millis;
        let mut b = AcceptBackoff::default();
        let waits: Vec<Duration> = (0..10).map(|_| b.failed()).collect();
        assert_eq!(
            waits,
            [10, 20, 40, 80, 160, 320, 640, 1000, 1000, 1000].map(ms)
        );
        b.succeeded();
        assert_eq!([b.failed(), b.failed()], [ms(10), ms(20)]);
    }

    /// The process's umask, read without changing it.
    fn umask_now() -> String {
        std::fs::read_to_string("/proc/self/status")
            .unwrap()
            .lines()
            .find_map(|l| l.strip_prefix("Umask:").map(|v| v.trim().to_string()))
            .expect("/proc/self/status has no Umask line")
    }

    /// A spawner or template forked by another thread while the socket is bound inherits the
    /// umask of that instant for its whole life, and every worker with it: binding must never
    /// change it, not even for a moment. Another thread samples it all along 200 binds.
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn binding_the_socket_never_changes_the_process_umask() {
        let dir = tempfile::tempdir().unwrap();
        let before = umask_now();
        let done = Arc::new(std::sync::atomic::AtomicBool::new(false));
        let sampler = {
            let done = done.clone();
            std::thread::spawn(move || {
                let mut seen = std::collections::BTreeSet::new();
                while !done.load(std::sync::atomic::Ordering::SeqCst) {
                    seen.insert(umask_now());
                }
                seen
            })
        };
        for i in 0..200 {
            let path = dir.path().join(format!("s{i}.sock"));
            let l = bind(&path, 0o660, None).unwrap();
            let m = std::fs::symlink_metadata(&path).unwrap();
            assert!(m.file_type().is_socket());
            assert_eq!(m.permissions().mode() & 0o7777, 0o660);
            drop(l);
        }
        done.store(true, std::sync::atomic::Ordering::SeqCst);
        let seen = sampler.join().unwrap();
        assert_eq!(seen, [before].into(), "the umask changed while binding");
        // Only the sockets are left: the private bind dirs are gone.
        let mut names: Vec<_> = std::fs::read_dir(dir.path())
            .unwrap()
            .map(|e| e.unwrap().file_name().into_string().unwrap())
            .filter(|n| !n.ends_with(".sock"))
            .collect();
        names.sort();
        assert!(names.is_empty(), "{names:?}");
    }

    #[tokio::test]
    async fn a_live_socket_is_never_stolen_and_a_stale_one_is_replaced() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("d.sock");
        let live = bind(&path, 0o600, None).unwrap();
        assert!(matches!(
            bind(&path, 0o600, None),
            Err(ListenError::InUse { .. })
        ));
        drop(live);
        // The file of a listener gone (a dead daemon's) is replaced.
        let again = bind(&path, 0o640, None).unwrap();
        let m = std::fs::symlink_metadata(&path).unwrap();
        assert_eq!(m.permissions().mode() & 0o7777, 0o640);
        drop(again);
    }
}
