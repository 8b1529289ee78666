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
/// exits at once.
pub(super) async fn call(a: CallArgs) -> Exit {
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
    let tool = a.tool.clone();
    let timeout = a.timeout;
    // Before the call is sent there is nothing to cancel.
    let (client, params) = tokio::select! {
        r = prepare_call(a) => match r {
            Ok(p) => p,
            Err(code) => return code,
        },
        _ = sigint.recv() => {
            eprintln!("airlock: {tool}: cancelled (interrupted before the call was sent)");
            return Exit::Interrupted;
        }
        _ = &mut expired => {
            eprintln!("airlock: {tool}: cancelled (no result within {}s; the call was not sent)", timeout.unwrap_or(0.0));
            return Exit::Timeout;
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
            return Exit::Interrupted;
        }
        _ = &mut expired => {
            eprintln!("airlock: {tool}: cancelled (no result within {}s, while the call was being sent)", timeout.unwrap_or(0.0));
            let _ = tokio::time::timeout(Duration::from_millis(300), client.cancel()).await;
            return Exit::Timeout;
        }
    };
    let mut handle = match sent {
        Ok(h) => h,
        Err(e) => {
            eprintln!(
                "airlock: {tool}: cannot send the call: {}",
                crate::report::chain(&e)
            );
            return Exit::Error;
        }
    };
    let (why, code) = tokio::select! {
        r = &mut handle.rx => {
            let code = print_result(&tool, r);
            let _ = tokio::time::timeout(Duration::from_secs(1), client.cancel()).await;
            return code;
        }
        _ = sigint.recv() => ("interrupted".to_string(), Exit::Interrupted),
        _ = &mut expired => (format!("no result within {}s", timeout.unwrap_or(0.0)), Exit::Timeout),
    };
    eprintln!(
        "airlock: {tool}: cancelled ({why}); the daemon rolls it back unless it was already publishing"
    );
    // A second Ctrl-C does not wait for the goodbye.
    tokio::spawn(async move {
        sigint.recv().await;
        eprintln!("airlock: {tool}: interrupted again; exiting at once");
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
    code
}

type CallClient = rmcp::service::RunningService<rmcp::RoleClient, ()>;

/// Connects, reads the arguments (typed by the tool's schema): the client and the call's
/// params, or the exit code.
async fn prepare_call(
    a: CallArgs,
) -> Result<(CallClient, rmcp::model::CallToolRequestParams), Exit> {
    use rmcp::model::CallToolRequestParams;
    let stream = match tokio::net::UnixStream::connect(&a.socket.socket).await {
        Ok(s) => s,
        Err(e) => {
            eprintln!("airlock: {}", connect_error(&a.socket.socket, &e));
            return Err(Exit::Error);
        }
    };
    let client = match ().serve(stream).await {
        Ok(c) => c,
        Err(e) => {
            eprintln!(
                "airlock: MCP handshake failed: {}",
                crate::report::chain(&e)
            );
            return Err(Exit::Error);
        }
    };
    let mut args: Map<String, Value> = match &a.json {
        None => Map::new(),
        Some(j) => match serde_json::from_str::<Value>(j) {
            Ok(Value::Object(m)) => m,
            Ok(_) => {
                eprintln!("airlock: --json must be a JSON object");
                return Err(Exit::Error);
            }
            Err(e) => {
                eprintln!("airlock: --json: {}", crate::report::chain(&e));
                return Err(Exit::Error);
            }
        },
    };
    if !a.args.is_empty() {
        let tools = match client.list_all_tools().await {
            Ok(t) => t,
            Err(e) => {
                eprintln!("airlock: tools/list failed: {}", crate::report::chain(&e));
                return Err(Exit::Error);
            }
        };
        let schema = tools
            .iter()
            .find(|t| t.name == a.tool)
            .map(|t| t.input_schema.clone());
        for kv in &a.args {
            let Some((k, v)) = kv.split_once('=') else {
                eprintln!("airlock: --arg {kv:?}: expected NAME=VALUE");
                return Err(Exit::Error);
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
                    return Err(Exit::Error);
                }
            }
        }
    }
    if let Some(s) = a.session {
        args.insert("session".into(), s.into());
    }
    Ok((
        client,
        CallToolRequestParams::new(a.tool.clone()).with_arguments(args),
    ))
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
