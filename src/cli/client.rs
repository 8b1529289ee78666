//! The client's commands: `connect` (the stdio bridge to the daemon's socket) and `call`.

use std::path::Path;
use std::time::Duration;

use rmcp::ServiceExt;
use serde_json::{Map, Value};

use super::args::CallArgs;
use super::Exit;

/// Why `connect` could not reach the daemon, in words that say what to do.
fn connect_error(socket: &Path, e: &std::io::Error) -> String {
    use std::os::unix::fs::FileTypeExt;
    let shown = socket.display();
    match std::fs::metadata(socket) {
        Err(m) if m.kind() == std::io::ErrorKind::NotFound => {
            return format!(
                "{shown}: no such file (is `airlock serve` running, and is this its socket? pass --socket)"
            )
        }
        Ok(m) if !m.file_type().is_socket() => {
            return format!("{shown}: not a socket (pass the daemon's socket with --socket)")
        }
        _ => {}
    }
    match e.kind() {
        std::io::ErrorKind::PermissionDenied => format!(
            "{shown}: permission denied (the socket's mode or group, or a directory above it, \
             does not let this user in; see the policy's daemon.socket_mode and socket_group)"
        ),
        std::io::ErrorKind::ConnectionRefused => format!(
            "{shown}: nobody is listening (a socket left by a daemon that is gone; start `airlock serve`)"
        ),
        std::io::ErrorKind::NotFound => format!("{shown}: no such file (a directory on the way is missing)"),
        _ => format!("{shown}: cannot connect: {}", crate::report::chain(e)),
    }
}

/// The requests the client sent through the bridge that still wait for a reply.
#[derive(Default)]
struct Pending {
    ids: std::collections::HashSet<String>,
    stdin_done: bool,
}

/// How the bridge's copy from the socket to stdout ended.
enum DownEnd {
    /// The daemon closed the connection (or it broke).
    Closed,
    /// Writing to stdout failed: whoever reads the replies is gone.
    StdoutGone(std::io::Error),
}

/// `airlock connect`: bridges stdin/stdout to the daemon's socket, line by line.
///
/// The end of stdin is not a disconnect: the bridge keeps the socket until every request it
/// passed on has its reply on stdout (a request the client cancelled counts as answered),
/// then closes, exit 0. If stdout goes away, that is a disconnect: the socket is closed at
/// once (the daemon cancels the calls in flight), exit 1. If the daemon closes the
/// connection or dies, one line on stderr and exit 1, whatever stdin is doing.
pub(super) async fn connect(socket: &Path) -> Exit {
    use tokio::io::{AsyncBufReadExt, AsyncWriteExt};
    let stream = match tokio::net::UnixStream::connect(socket).await {
        Ok(s) => s,
        Err(e) => {
            eprintln!("airlock: {}", connect_error(socket, &e));
            return Exit::Error;
        }
    };
    let (r, mut w) = stream.into_split();
    let pending = std::sync::Arc::new(std::sync::Mutex::new(Pending::default()));
    let answered = std::sync::Arc::new(tokio::sync::Notify::new());
    let up = {
        let (pending, answered) = (pending.clone(), answered.clone());
        async move {
            let mut stdin = tokio::io::BufReader::new(tokio::io::stdin());
            loop {
                let mut line = Vec::new();
                match stdin.read_until(b'\n', &mut line).await {
                    Ok(0) | Err(_) => break,
                    Ok(_) => {}
                }
                track_request(
                    &mut pending.lock().unwrap_or_else(|p| p.into_inner()),
                    &line,
                );
                if let Err(e) = w.write_all(&line).await {
                    return e;
                }
            }
            pending.lock().unwrap_or_else(|p| p.into_inner()).stdin_done = true;
            loop {
                let notified = answered.notified();
                if pending
                    .lock()
                    .unwrap_or_else(|p| p.into_inner())
                    .ids
                    .is_empty()
                {
                    break;
                }
                notified.await;
            }
            // Every reply is out: the client is done, so is the connection.
            let _ = w.shutdown().await;
            std::future::pending::<std::io::Error>().await
        }
    };
    let down = {
        let (pending, answered) = (pending.clone(), answered.clone());
        async move {
            let mut r = tokio::io::BufReader::new(r);
            let mut stdout = tokio::io::stdout();
            loop {
                let mut line = Vec::new();
                match r.read_until(b'\n', &mut line).await {
                    Ok(0) | Err(_) => return DownEnd::Closed,
                    Ok(_) => {}
                }
                let wrote = async {
                    stdout.write_all(&line).await?;
                    stdout.flush().await
                };
                if let Err(e) = wrote.await {
                    return DownEnd::StdoutGone(e);
                }
                track_reply(
                    &mut pending.lock().unwrap_or_else(|p| p.into_inner()),
                    &line,
                );
                answered.notify_one();
            }
        }
    };
    let end = tokio::select! {
        e = up => Err(e),
        d = down => Ok(d),
        e = stdout_hangup() => Ok(DownEnd::StdoutGone(e)),
    };
    let p = pending.lock().unwrap_or_else(|p| p.into_inner());
    match end {
        Ok(DownEnd::Closed) if p.stdin_done && p.ids.is_empty() => Exit::Ok,
        Ok(DownEnd::Closed) | Err(_) => {
            let unanswered = match p.ids.len() {
                0 => String::new(),
                n => format!(" with {n} request(s) unanswered"),
            };
            eprintln!(
                "airlock: the daemon closed the connection{unanswered} (did it stop or crash?)"
            );
            Exit::Failed
        }
        Ok(DownEnd::StdoutGone(e)) => {
            eprintln!(
                "airlock: stdout is closed ({}): disconnecting; the daemon cancels the calls in flight",
                crate::report::chain(&e)
            );
            Exit::Failed
        }
    }
}

/// Resolves when whoever reads the bridge's stdout is gone (a pipe with no reader left, a
/// socket whose peer closed), noticed without writing: a client killed mid-call then
/// disconnects at once, and the daemon cancels its calls, instead of the bridge holding the
/// connection until the reply it can no longer deliver. Never resolves for stdout that
/// cannot hang up (a file, /dev/null).
async fn stdout_hangup() -> std::io::Error {
    let (tx, rx) = tokio::sync::oneshot::channel();
    // A plain thread, not spawn_blocking: the runtime does not wait for it at exit.
    std::thread::spawn(move || {
        let mut fds = [libc::pollfd {
            fd: libc::STDOUT_FILENO,
            events: 0,
            revents: 0,
        }];
        loop {
            // SAFETY: `fds` is one valid pollfd for the duration of the call; events 0
            // asks for nothing but the hangup and error conditions poll always reports.
            let n = unsafe { libc::poll(fds.as_mut_ptr(), 1, -1) };
            if n > 0 && fds[0].revents & (libc::POLLERR | libc::POLLHUP) != 0 {
                let _ = tx.send(());
                return;
            }
            if n < 0 && std::io::Error::last_os_error().kind() != std::io::ErrorKind::Interrupted {
                return;
            }
            if n > 0 && fds[0].revents & libc::POLLNVAL != 0 {
                return;
            }
        }
    });
    match rx.await {
        Ok(()) => std::io::Error::new(std::io::ErrorKind::BrokenPipe, "its reader hung up"),
        Err(_) => std::future::pending().await,
    }
}

/// Notes a request the client sends (one line) as waiting for its reply; a client's
/// `notifications/cancelled` means it waits no more (a call rolled back gets no reply).
fn track_request(p: &mut Pending, line: &[u8]) {
    let Ok(v) = serde_json::from_slice::<Value>(line) else {
        return;
    };
    match (v.get("method").and_then(Value::as_str), v.get("id")) {
        (Some(_), Some(id)) => {
            p.ids.insert(id.to_string());
        }
        (Some("notifications/cancelled"), None) => {
            p.ids.remove(&v["params"]["requestId"].to_string());
        }
        _ => {}
    }
}

/// A reply from the daemon (one line) answers the request of its id.
fn track_reply(p: &mut Pending, line: &[u8]) {
    let Ok(v) = serde_json::from_slice::<Value>(line) else {
        return;
    };
    if v.get("method").is_none() {
        if let Some(id) = v.get("id") {
            p.ids.remove(&id.to_string());
        }
    }
}

/// Reads `--arg` values as the declared type of the parameter (from the tool's schema).
fn coerce(raw: &str, schema_type: Option<&str>) -> Result<Value, CoerceError> {
    match schema_type {
        Some("string") | None => Ok(Value::String(raw.to_string())),
        Some(t) => serde_json::from_str(raw).map_err(|cause| CoerceError {
            raw: raw.to_string(),
            ty: t.to_string(),
            cause,
        }),
    }
}

/// An `--arg` value that does not parse as its parameter's declared JSON type.
#[derive(Debug, thiserror::Error)]
#[error("{raw:?} is not a valid {ty}")]
struct CoerceError {
    raw: String,
    ty: String,
    #[source]
    cause: serde_json::Error,
}

/// `airlock call`: Ctrl-C (SIGINT) or `--timeout` cancels the call over the wire
/// (`notifications/cancelled`; the daemon rolls it back unless it is already publishing),
/// says `cancelled` on stderr and exits 130 (timeout: 124) within a second; a second Ctrl-C
/// exits at once. With `--retry N` the call carries an idempotency key (`--idempotency-key`,
/// else a generated one) and a lost connection (the daemon closed it, died or restarts) is
/// retried: reconnect, resend with the same key, at most N times; the daemon runs the call
/// once and replays its outcome to a resend.
pub(super) async fn call(mut a: CallArgs) -> Exit {
    use tokio::signal::unix::{signal, SignalKind};
    let mut sigint = match signal(SignalKind::interrupt()) {
        Ok(s) => s,
        Err(e) => {
            eprintln!(
                "airlock: cannot watch for Ctrl-C: {}",
                crate::report::chain(&e)
            );
            return Exit::Error;
        }
    };
    let deadline = a
        .timeout
        .map(|secs| tokio::time::Instant::now() + Duration::from_secs_f64(secs.max(0.0)));
    let expired = async {
        match deadline {
            Some(d) => tokio::time::sleep_until(d).await,
            None => std::future::pending().await,
        }
    };
    let mut expired = std::pin::pin!(expired);
    let retries = a.retry.unwrap_or(0);
    if a.retry.is_some() && a.idempotency_key.is_none() {
        a.idempotency_key = Some(generated_key());
    }
    let tool = a.tool.clone();
    let mut attempt = 0;
    let mut backoff = Duration::from_millis(100);
    loop {
        match call_once(a.clone(), sigint, expired.as_mut()).await {
            Attempt::Done(code) => return code,
            Attempt::Lost(why, back) if attempt < retries => {
                sigint = back;
                attempt += 1;
                eprintln!(
                    "airlock: {tool}: {why}; resending with idempotency key {} (retry {attempt} of {retries})",
                    a.idempotency_key.as_deref().unwrap_or("")
                );
                tokio::select! {
                    _ = tokio::time::sleep(backoff) => {}
                    _ = sigint.recv() => {
                        eprintln!("airlock: {tool}: interrupted between retries");
                        return Exit::Interrupted;
                    }
                    _ = expired.as_mut() => {
                        eprintln!("airlock: {tool}: no result within {}s", a.timeout.unwrap_or(0.0));
                        return Exit::Timeout;
                    }
                }
                backoff = (backoff * 2).min(Duration::from_secs(2));
            }
            Attempt::Lost(why, _) => {
                eprintln!("airlock: {tool}: {why}");
                return Exit::Error;
            }
        }
    }
}

/// 128 random bits as hex, for `--retry` without `--idempotency-key`.
fn generated_key() -> String {
    use std::io::Read;
    let mut b = [0u8; 16];
    let random = std::fs::File::open("/dev/urandom").and_then(|mut f| f.read_exact(&mut b));
    if random.is_err() {
        let nanos = std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map_or(0, |d| d.as_nanos());
        b = (nanos ^ (u128::from(std::process::id()) << 96)).to_le_bytes();
    }
    let hex: String = b.iter().map(|x| format!("{x:02x}")).collect();
    format!("airlock-call-{hex}")
}

/// How one attempt of `airlock call` ended.
enum Attempt {
    /// With an outcome (printed) or a final error: the exit code.
    Done(Exit),
    /// The connection was lost (or could not be made) before an outcome came: why, and the
    /// Ctrl-C watch, handed back for the next attempt.
    Lost(String, tokio::signal::unix::Signal),
}

/// One attempt: connect, send, wait for the result.
async fn call_once(
    a: CallArgs,
    mut sigint: tokio::signal::unix::Signal,
    mut expired: std::pin::Pin<&mut impl std::future::Future<Output = ()>>,
) -> Attempt {
    let tool = a.tool.clone();
    let timeout = a.timeout;
    // Before the call is sent there is nothing to cancel.
    let (client, params) = tokio::select! {
        r = prepare_call(a) => match r {
            Ok(p) => p,
            Err(Prepared::Lost(why)) => return Attempt::Lost(why, sigint),
            Err(Prepared::Failed(code)) => return Attempt::Done(code),
        },
        _ = sigint.recv() => {
            eprintln!("airlock: {tool}: cancelled (interrupted before the call was sent)");
            return Attempt::Done(Exit::Interrupted);
        }
        _ = expired.as_mut() => {
            eprintln!("airlock: {tool}: cancelled (no result within {}s; the call was not sent)", timeout.unwrap_or(0.0));
            return Attempt::Done(Exit::Timeout);
        }
    };
    let request =
        rmcp::model::ClientRequest::CallToolRequest(rmcp::model::CallToolRequest::new(params));
    // Sending may wait on a daemon that does not read: Ctrl-C and the deadline still work
    // (the connection closes, which cancels whatever of the call reached the daemon).
    let sent = tokio::select! {
        r = client.send_cancellable_request(request, rmcp::service::PeerRequestOptions::no_options()) => r,
        _ = sigint.recv() => {
            eprintln!("airlock: {tool}: cancelled (interrupted while the call was being sent)");
            let _ = tokio::time::timeout(Duration::from_millis(300), client.cancel()).await;
            return Attempt::Done(Exit::Interrupted);
        }
        _ = expired.as_mut() => {
            eprintln!("airlock: {tool}: cancelled (no result within {}s, while the call was being sent)", timeout.unwrap_or(0.0));
            let _ = tokio::time::timeout(Duration::from_millis(300), client.cancel()).await;
            return Attempt::Done(Exit::Timeout);
        }
    };
    let mut handle = match sent {
        Ok(h) => h,
        Err(e) => {
            return Attempt::Lost(
                format!("cannot send the call: {}", crate::report::chain(&e)),
                sigint,
            )
        }
    };
    let (why, code) = tokio::select! {
        r = &mut handle.rx => {
            let attempt = match r {
                Err(_) | Ok(Err(rmcp::ServiceError::TransportClosed)) => Attempt::Lost("the daemon closed the connection before replying".into(), sigint),
                r => Attempt::Done(print_result(&tool, r)),
            };
            let _ = tokio::time::timeout(Duration::from_secs(1), client.cancel()).await;
            return attempt;
        }
        _ = sigint.recv() => ("interrupted".to_string(), Exit::Interrupted),
        _ = expired.as_mut() => (format!("no result within {}s", timeout.unwrap_or(0.0)), Exit::Timeout),
    };
    eprintln!(
        "airlock: {tool}: cancelled ({why}); the daemon rolls it back unless it was already publishing"
    );
    // A second Ctrl-C does not wait for the goodbye.
    let tool2 = tool.clone();
    tokio::spawn(async move {
        sigint.recv().await;
        eprintln!("airlock: {tool2}: interrupted again; exiting at once");
        std::process::exit(Exit::Interrupted.code());
    });
    // The cancellation goes out, then the connection closes (which cancels too); both
    // bounded so that the whole takes well under a second.
    let _ = tokio::time::timeout(
        Duration::from_millis(500),
        handle.cancel(Some(format!("airlock call: {why}"))),
    )
    .await;
    let _ = tokio::time::timeout(Duration::from_millis(300), client.cancel()).await;
    Attempt::Done(code)
}

/// Why `prepare_call` gave no call.
enum Prepared {
    /// The daemon could not be reached (a retry may).
    Lost(String),
    /// Anything else: said, with its exit code.
    Failed(Exit),
}

type CallClient = rmcp::service::RunningService<rmcp::RoleClient, ()>;

/// Connects, reads the arguments (typed by the tool's schema): the client and the call's
/// params, or the exit code.
async fn prepare_call(
    a: CallArgs,
) -> Result<(CallClient, rmcp::model::CallToolRequestParams), Prepared> {
    let failed = |()| Prepared::Failed(Exit::Error);
    use rmcp::model::CallToolRequestParams;
    let stream = match tokio::net::UnixStream::connect(&a.socket.socket).await {
        Ok(s) => s,
        Err(e) => return Err(Prepared::Lost(connect_error(&a.socket.socket, &e))),
    };
    let client = match ().serve(stream).await {
        Ok(c) => c,
        Err(e) => {
            return Err(Prepared::Lost(format!(
                "MCP handshake failed: {}",
                crate::report::chain(&e)
            )))
        }
    };
    let mut args: Map<String, Value> = match &a.json {
        None => Map::new(),
        Some(j) => match serde_json::from_str::<Value>(j) {
            Ok(Value::Object(m)) => m,
            Ok(_) => {
                eprintln!("airlock: --json must be a JSON object");
                return Err(failed(()));
            }
            Err(e) => {
                eprintln!("airlock: --json: {}", crate::report::chain(&e));
                return Err(failed(()));
            }
        },
    };
    if !a.args.is_empty() {
        let tools = match client.list_all_tools().await {
            Ok(t) => t,
            Err(e) => {
                eprintln!("airlock: tools/list failed: {}", crate::report::chain(&e));
                return Err(failed(()));
            }
        };
        let schema = tools
            .iter()
            .find(|t| t.name == a.tool)
            .map(|t| t.input_schema.clone());
        for kv in &a.args {
            let Some((k, v)) = kv.split_once('=') else {
                eprintln!("airlock: --arg {kv:?}: expected NAME=VALUE");
                return Err(failed(()));
            };
            let ty = schema
                .as_ref()
                .and_then(|s| s.get("properties"))
                .and_then(|p| p.get(k))
                .and_then(|p| p.get("type"))
                .and_then(Value::as_str);
            match coerce(v, ty) {
                Ok(v) => {
                    args.insert(k.to_string(), v);
                }
                Err(e) => {
                    eprintln!("airlock: --arg {k}: {}", crate::report::chain(&e));
                    return Err(failed(()));
                }
            }
        }
    }
    if let Some(s) = a.session {
        args.insert("session".into(), s.into());
    }
    let mut params = CallToolRequestParams::new(a.tool.clone()).with_arguments(args);
    if let Some(k) = a.idempotency_key {
        let mut meta = rmcp::model::RequestMetaObject::default();
        meta.0 .0.insert(crate::jobs::KEY_META.into(), k.into());
        params.meta = Some(meta);
    }
    Ok((client, params))
}

/// Prints a call's result; its exit code.
fn print_result(
    tool: &str,
    r: Result<
        Result<rmcp::model::ServerResult, rmcp::ServiceError>,
        tokio::sync::oneshot::error::RecvError,
    >,
) -> Exit {
    let r = match r {
        Ok(Ok(rmcp::model::ServerResult::CallToolResult(r))) => r,
        Ok(Ok(other)) => {
            eprintln!("airlock: {tool}: unexpected reply: {other:?}");
            return Exit::Error;
        }
        Ok(Err(e)) => {
            eprintln!("airlock: {tool}: {}", crate::report::chain(&e));
            return Exit::Error;
        }
        Err(_) => {
            eprintln!("airlock: {tool}: the daemon closed the connection before replying");
            return Exit::Error;
        }
    };
    let is_error = r.is_error.unwrap_or(false);
    match serde_json::to_string_pretty(&r) {
        Ok(s) => println!("{s}"),
        Err(e) => eprintln!(
            "airlock: cannot print the result: {}",
            crate::report::chain(&e)
        ),
    }
    if is_error {
        Exit::Failed
    } else {
        Exit::Ok
    }
}
