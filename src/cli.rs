//! The command line: `serve`, `connect`, `call`, `policy check|explain`, `recover`.
//!
//! Exit codes: 0 success; 1 a tool error (`call`) or an invalid policy (`policy check`);
//! 2 a usage, connection, protocol or startup error.

use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::Duration;

use clap::{Args, Parser, Subcommand, ValueEnum};
use serde_json::{Map, Value};
use tokio_util::sync::CancellationToken;

use crate::policy::{self, Policy};

#[derive(Parser)]
#[command(
    name = "airlock",
    version,
    about = "Runs MCP tool calls so that every terminal response is a state boundary"
)]
struct Cli {
    /// Log format on stderr.
    #[arg(long, value_enum, default_value_t = LogFormat::Human, global = true)]
    log_format: LogFormat,
    #[command(subcommand)]
    command: Command,
}

#[derive(Clone, Copy, ValueEnum)]
enum LogFormat {
    Human,
    Json,
}

#[derive(Subcommand)]
enum Command {
    /// Run the daemon: serve MCP on a Unix socket.
    Serve(ServeArgs),
    /// Bridge stdin/stdout to the daemon's socket, for clients that launch stdio servers.
    Connect {
        #[command(flatten)]
        socket: SocketArg,
    },
    /// Call one tool and print its result as JSON; exits 1 on a tool error.
    Call(CallArgs),
    /// Check or explain the policy files.
    #[command(subcommand)]
    Policy(PolicyCommand),
    /// Roll back or complete every job a crashed daemon left, then exit.
    Recover(Dirs),
    /// Read the durable audit log (filters, --follow, --json), or `verify` its hash chain.
    Audit(crate::audit::cli::AuditArgs),
    /// Write the man pages and shell completions into DIR (used to build the package).
    #[command(hide = true)]
    GenerateAssets {
        /// Where `man/` and `completions/` are created.
        out: PathBuf,
    },
}

#[derive(Args)]
struct SocketArg {
    /// The daemon's socket [default: $AIRLOCK_SOCKET, else ./airlock.sock].
    #[arg(long, env = "AIRLOCK_SOCKET", default_value = "airlock.sock")]
    socket: PathBuf,
}

/// Where the policy, the workspace and the sessions are: `serve` and `recover`.
#[derive(Args)]
struct Dirs {
    /// Policy directory.
    #[arg(long, default_value = "policies")]
    policies: PathBuf,
    /// Workspace root [default: the policy's daemon.workspace].
    #[arg(long)]
    workspace: Option<PathBuf>,
    /// Where sessions persist [default: the policy's daemon.state_dir].
    #[arg(long)]
    state_dir: Option<PathBuf>,
}

#[derive(Args)]
struct ServeArgs {
    /// Socket path [default: the policy's daemon.socket].
    #[arg(long)]
    socket: Option<PathBuf>,
    #[command(flatten)]
    dirs: Dirs,
}

#[derive(Args)]
struct CallArgs {
    /// The tool to call.
    tool: String,
    #[command(flatten)]
    socket: SocketArg,
    /// The session a write tool mutates.
    #[arg(long)]
    session: Option<String>,
    /// An argument as NAME=VALUE; VALUE is read as the tool's declared type.
    #[arg(long = "arg", value_name = "NAME=VALUE")]
    args: Vec<String>,
    /// Arguments as one JSON object (merged under --arg).
    #[arg(long)]
    json: Option<String>,
    /// Give up (and cancel the call) after this many seconds.
    #[arg(long)]
    timeout: Option<f64>,
}

#[derive(Subcommand)]
enum PolicyCommand {
    /// Validate the policy directory; print a table of tools or every error.
    Check {
        #[arg(long, default_value = "policies")]
        policies: PathBuf,
    },
    /// Print the effective sandbox of one tool, for a security reviewer.
    Explain {
        tool: String,
        #[arg(long, default_value = "policies")]
        policies: PathBuf,
    },
}

/// Parses argv, runs the command, returns the exit code.
pub fn main() -> i32 {
    let cli = Cli::parse();
    // The daemon tells what it does; a one-shot client speaks only of trouble.
    let default_filter = match cli.command {
        Command::Serve(_) | Command::Recover(_) => "info,rmcp=warn",
        _ => "warn",
    };
    init_logging(cli.log_format, default_filter);
    match cli.command {
        Command::Policy(PolicyCommand::Check { policies }) => policy_check(&policies),
        Command::Policy(PolicyCommand::Explain { tool, policies }) => {
            policy_explain(&policies, &tool)
        }
        Command::Recover(a) => recover(a),
        Command::Audit(a) => crate::audit::cli::run(a),
        Command::GenerateAssets { out } => generate_assets(&out),
        Command::Serve(a) => runtime().map_or(2, |rt| {
            let code = rt.block_on(serve(a));
            // A blocking task still running (a cleanup after `shutdown_timeout`) must not
            // hold the exit: recovery at the next start finishes its work.
            rt.shutdown_timeout(Duration::from_secs(1));
            code
        }),
        Command::Connect { socket } => runtime().map_or(2, |rt| {
            let code = rt.block_on(connect(&socket.socket));
            // A read of stdin still blocked in its thread must not hold the exit.
            rt.shutdown_background();
            code
        }),
        Command::Call(a) => runtime().map_or(2, |rt| rt.block_on(call(a))),
    }
}

/// Man pages (from the clap definitions) in `out/man`, completions for bash, zsh and fish
/// in `out/completions`.
fn generate_assets(out: &Path) -> i32 {
    use clap::CommandFactory;
    let run = || -> std::io::Result<()> {
        let (man, comp) = (out.join("man"), out.join("completions"));
        std::fs::create_dir_all(&man)?;
        std::fs::create_dir_all(&comp)?;
        clap_mangen::generate_to(Cli::command(), &man)?;
        for shell in [
            clap_complete::Shell::Bash,
            clap_complete::Shell::Zsh,
            clap_complete::Shell::Fish,
        ] {
            clap_complete::generate_to(shell, &mut Cli::command(), "airlock", &comp)?;
        }
        Ok(())
    };
    match run() {
        Ok(()) => 0,
        Err(e) => {
            eprintln!("airlock: {}: cannot write the assets: {e}", out.display());
            2
        }
    }
}

fn runtime() -> Option<tokio::runtime::Runtime> {
    match tokio::runtime::Builder::new_multi_thread()
        .enable_all()
        .build()
    {
        Ok(rt) => Some(rt),
        Err(e) => {
            eprintln!("airlock: cannot start the async runtime: {e}");
            None
        }
    }
}

/// Logs to stderr; `AIRLOCK_LOG` (a tracing filter such as `debug`) overrides the default.
fn init_logging(format: LogFormat, default_filter: &str) {
    let filter = tracing_subscriber::EnvFilter::try_from_env("AIRLOCK_LOG")
        .unwrap_or_else(|_| tracing_subscriber::EnvFilter::new(default_filter));
    let b = tracing_subscriber::fmt()
        .with_env_filter(filter)
        .with_ansi(std::io::IsTerminal::is_terminal(&std::io::stderr()))
        .with_writer(std::io::stderr);
    let _ = match format {
        LogFormat::Human => b.try_init(),
        LogFormat::Json => b.json().try_init(),
    };
}

fn load_policy(dir: &Path) -> Result<Policy, i32> {
    policy::load(dir).map_err(|e| {
        for d in &e.0 {
            eprintln!("airlock: {d}");
        }
        eprintln!(
            "airlock: {}: {} error(s); nothing was started",
            dir.display(),
            e.0.len()
        );
        2
    })
}

fn policy_check(dir: &Path) -> i32 {
    let policy = match policy::load(dir) {
        Ok(p) => p,
        Err(e) => {
            for d in &e.0 {
                println!("{d}");
            }
            println!("{} error(s)", e.0.len());
            return 1;
        }
    };
    println!(
        "{:<22} {:<10} {:<8} {:<10} {:>8}  PATH PARAMS",
        "TOOL", "CAPABILITY", "PROTOCOL", "PROFILE", "TIMEOUT"
    );
    for t in policy.tools.values() {
        let (protocol, profile, timeout) = match &t.exec {
            Some(e) => (
                e.protocol.as_str(),
                e.profile.as_str(),
                format!("{:?}", e.timeout),
            ),
            None => ("builtin", "-", "-".to_string()),
        };
        let paths: Vec<String> = t
            .params
            .iter()
            .filter_map(|(n, p)| {
                p.path.map(|r| {
                    format!(
                        "{n}({})",
                        if r == policy::PathRole::Input {
                            "in"
                        } else {
                            "out"
                        }
                    )
                })
            })
            .collect();
        println!(
            "{:<22} {:<10} {:<8} {:<10} {:>8}  {}",
            t.name,
            t.capability.as_str(),
            protocol,
            profile,
            timeout,
            if paths.is_empty() {
                "-".to_string()
            } else {
                paths.join(" ")
            }
        );
    }
    println!(
        "ok: {} tools, {} profiles",
        policy.tools.len(),
        policy.profiles.len()
    );
    0
}

fn policy_explain(dir: &Path, name: &str) -> i32 {
    let policy = match load_policy(dir) {
        Ok(p) => p,
        Err(code) => return code,
    };
    let Some(tool) = policy.tools.get(name) else {
        eprintln!("airlock: no tool {name:?} in {}", dir.display());
        return 2;
    };
    println!(
        "tool {} ({}, {})",
        tool.name,
        tool.capability.as_str(),
        tool.source
            .as_ref()
            .map_or("built-in".into(), |p| p.display().to_string())
    );
    let Some(ext) = &tool.exec else {
        println!("  runs inside the daemon: no worker, no sandbox");
        return 0;
    };
    println!("  command:  {}", ext.command.join(" "));
    println!("  protocol: {}", ext.protocol.as_str());
    println!(
        "  timeout:  {:?} (then SIGTERM to the group, the grace, SIGKILL)",
        ext.timeout
    );
    for (n, p) in &tool.params {
        match p.path {
            Some(policy::PathRole::Input) => println!("  param {n}: workspace path, readable by the worker"),
            Some(policy::PathRole::Output) => println!("  param {n}: workspace path, written to a private staging dir, published on success"),
            None => println!("  param {n}: {} value", p.ty.as_str()),
        }
    }
    match policy.profiles.get(&ext.profile) {
        Some(profile) => {
            print!("{}", crate::sandbox::explain(profile));
        }
        None => println!("profile {}: missing", ext.profile),
    }
    0
}

fn apply_overrides(p: &mut Policy, workspace: Option<PathBuf>, state_dir: Option<PathBuf>) {
    if let Some(w) = workspace {
        p.daemon.workspace = w;
    }
    if let Some(s) = state_dir {
        p.daemon.state_dir = s;
    }
}

fn recover(a: Dirs) -> i32 {
    let mut policy = match policy::load(&a.policies) {
        Ok(p) => p,
        // Recovery needs no tool, only where the workspace and state are: with both given,
        // a broken policy is reported and the [daemon] defaults (worker_uids among them)
        // stand in for the rest.
        Err(e) if a.workspace.is_some() && a.state_dir.is_some() => {
            for d in &e.0 {
                eprintln!("airlock: {d}");
            }
            eprintln!(
                "airlock: {}: {} error(s); recovering with the default [daemon] settings and the given --workspace and --state-dir",
                a.policies.display(),
                e.0.len()
            );
            Policy {
                dir: a.policies.clone(),
                daemon: Default::default(),
                profiles: Default::default(),
                tools: Default::default(),
            }
        }
        Err(e) => {
            eprintln!("airlock: {e}");
            eprintln!(
                "airlock: recover: fix the policy, or give both --workspace and --state-dir to recover without it"
            );
            return 2;
        }
    };
    apply_overrides(&mut policy, a.workspace, a.state_dir);
    let d = &policy.daemon;
    let result = crate::exec::check_layout(&d.workspace, &d.state_dir, None)
        .and_then(|()| crate::exec::lock_workspace(&d.workspace))
        .and_then(|lock| Ok((lock, crate::exec::lock_state_dir(&d.state_dir)?)))
        .map_err(|e| e.to_string())
        .and_then(|locks| {
            Ok((
                locks,
                crate::publish::Workspace::open(&d.workspace).map_err(|e| e.to_string())?,
            ))
        })
        .and_then(|(_locks, ws)| {
            let sessions =
                crate::session::SessionStore::open(&d.state_dir).map_err(|e| e.to_string())?;
            // As at startup: nothing a dead daemon's workers left may run while job dirs are
            // settled (logged at warn, one line per process killed).
            let uids = crate::sandbox::Identities::detect(d.worker_user, d.worker_uids, 1)
                .ok()
                .and_then(|i| i.range());
            crate::exec::sweep_leftovers(d, uids).map_err(|e| e.to_string())?;
            let audit = crate::exec::open_audit(d).map_err(|e| e.to_string())?;
            crate::exec::recover(&ws, &sessions, &audit).map_err(|e| e.to_string())
        });
    match result {
        Ok(done) => {
            for r in &done {
                println!("{}: {}", r.job, r.action);
            }
            let quarantined: Vec<_> = done.iter().filter_map(|r| r.quarantined.as_ref()).collect();
            println!("recovered {} job(s)", done.len() - quarantined.len());
            if !quarantined.is_empty() {
                println!(
                    "{} job dir(s) could not be removed and are quarantined (their targets are settled; tools cannot reach them); remove them by hand:",
                    quarantined.len()
                );
                for q in quarantined {
                    println!("  {}", q.display());
                }
            }
            0
        }
        Err(e) => {
            eprintln!("airlock: recover: {e}");
            2
        }
    }
}

async fn serve(a: ServeArgs) -> i32 {
    let notify = Arc::new(crate::systemd::Notifier::from_env());
    let (workspace, state_dir, socket) = (a.dirs.workspace, a.dirs.state_dir, a.socket);
    let policies = a.dirs.policies;
    let mut policy = match load_policy(&policies) {
        Ok(p) => p,
        Err(code) => return code,
    };
    apply_overrides(&mut policy, workspace.clone(), state_dir.clone());
    if let Some(s) = &socket {
        policy.daemon.socket = s.clone();
    }
    if let Err(e) = crate::sandbox::init_daemon() {
        eprintln!("airlock: {e}");
        return 2;
    }
    let policy = Arc::new(policy);
    let shutdown = CancellationToken::new();
    let exec = match crate::exec::Executor::start(policy.clone(), shutdown.clone()) {
        Ok(e) => Arc::new(e),
        Err(e) => {
            eprintln!("airlock: {e}");
            return 2;
        }
    };
    let d = &policy.daemon;
    // Socket-activated: systemd owns the socket file (mode, group, removal); otherwise the
    // daemon binds it and removes it at exit.
    let (listener, activated) = match crate::systemd::take_listener() {
        Ok(Some(l)) => match tokio::net::UnixListener::from_std(l) {
            Ok(l) => (l, true),
            Err(e) => {
                eprintln!("airlock: socket activation: cannot use the passed listener: {e}");
                return 2;
            }
        },
        Ok(None) => match crate::mcp::bind(&d.socket, d.socket_mode, d.socket_group.as_deref()) {
            Ok(l) => (l, false),
            Err(e) => {
                eprintln!("airlock: {e}");
                return 2;
            }
        },
        Err(e) => {
            eprintln!("airlock: {e}");
            return 2;
        }
    };
    tracing::info!(
        socket = %d.socket.display(),
        socket_activated = activated,
        workspace = %d.workspace.display(),
        tools = policy.tools.len(),
        "airlock serving"
    );
    // Installed before the first client can connect, so no signal finds the default action.
    let signals = match Signals::install() {
        Ok(s) => s,
        Err(e) => {
            eprintln!("airlock: cannot install signal handlers: {e}");
            return 2;
        }
    };
    // Policies loaded, recovery done, the socket listening: ready.
    notify.ready(&status_line(&exec));
    let reload = Reload {
        dir: policies,
        workspace,
        state_dir,
        socket,
        exec: exec.clone(),
        notify: notify.clone(),
    };
    let stop = shutdown.clone();
    let shutdown_timeout = d.shutdown_timeout;
    let stopping = notify.clone();
    tokio::spawn(async move {
        signals.wait_for_stop(&reload).await;
        stopping.stopping();
        tracing::info!(
            "shutting down: cancelling running calls (exit within {shutdown_timeout:?} and a second)"
        );
        stop.cancel();
    });
    if notify.enabled() {
        tokio::spawn(keep_systemd_informed(
            notify.clone(),
            exec.clone(),
            shutdown.clone(),
        ));
    }
    crate::mcp::run(listener, exec, shutdown).await;
    if !activated {
        let _ = std::fs::remove_file(&d.socket);
    }
    tracing::info!("stopped");
    0
}

fn status_line(exec: &crate::exec::Executor) -> String {
    let p = exec.policy();
    format!(
        "serving {} tools; {} call(s) in flight",
        p.tools.len(),
        exec.calls_in_flight()
    )
}

/// `STATUS=` when it changes (checked every second) and `WATCHDOG=1` at half of
/// `WatchdogSec`, until shutdown.
async fn keep_systemd_informed(
    notify: Arc<crate::systemd::Notifier>,
    exec: Arc<crate::exec::Executor>,
    shutdown: CancellationToken,
) {
    let tick = notify
        .watchdog_interval()
        .map_or(Duration::from_secs(1), |w| w.min(Duration::from_secs(1)));
    let watchdog = notify.watchdog_interval();
    let mut last_status = String::new();
    let mut last_watchdog = tokio::time::Instant::now();
    loop {
        tokio::select! {
            _ = tokio::time::sleep(tick) => {}
            _ = shutdown.cancelled() => return,
        }
        let status = status_line(&exec);
        if status != last_status {
            notify.status(&status);
            last_status = status;
        }
        if let Some(w) = watchdog {
            if last_watchdog.elapsed() >= w {
                notify.watchdog();
                last_watchdog = tokio::time::Instant::now();
            }
        }
    }
}

/// What SIGHUP needs: the policy directory and the command line's overrides.
struct Reload {
    dir: PathBuf,
    workspace: Option<PathBuf>,
    state_dir: Option<PathBuf>,
    socket: Option<PathBuf>,
    exec: Arc<crate::exec::Executor>,
    notify: Arc<crate::systemd::Notifier>,
}

impl Reload {
    /// Re-reads the policy directory. A valid one serves every call that starts from now
    /// on (tools, profiles); the daemon settings keep the values the daemon started with,
    /// and a changed one is logged as needing a restart. An invalid one changes nothing;
    /// each of its errors is logged as `file:line:col: message`, as `policy check` prints.
    fn run(&self) {
        self.notify.reloading();
        let old = self.exec.policy();
        match policy::load(&self.dir) {
            Err(e) => {
                for d in &e.0 {
                    tracing::error!("reload: {d}");
                }
                tracing::error!(
                    "reload: {}: {} error(s); still serving the policy loaded before ({} tools)",
                    self.dir.display(),
                    e.0.len(),
                    old.tools.len()
                );
            }
            Ok(mut new) => {
                apply_overrides(&mut new, self.workspace.clone(), self.state_dir.clone());
                if let Some(s) = &self.socket {
                    new.daemon.socket = s.clone();
                }
                for field in changed_settings(&old.daemon, &new.daemon) {
                    tracing::warn!(
                        "reload: [daemon] {field} changed in airlock.toml; it needs a restart and keeps its old value until then"
                    );
                }
                new.daemon = old.daemon.clone();
                let (tools, profiles) = (new.tools.len(), new.profiles.len());
                self.exec.replace_policy(Arc::new(new));
                tracing::info!(
                    "reload: {}: now serving {tools} tools, {profiles} profiles (calls in flight finish on the policy they started with)",
                    self.dir.display()
                );
            }
        }
        self.notify.ready(&status_line(&self.exec));
    }
}

/// The `[daemon]` settings that differ, by name (one `name: value` line each in the
/// pretty debug form, so a new setting is covered without a list to keep).
fn changed_settings(
    old: &crate::policy::DaemonConfig,
    new: &crate::policy::DaemonConfig,
) -> Vec<String> {
    let (a, b) = (format!("{old:#?}"), format!("{new:#?}"));
    let top = |s: &str| -> Vec<(String, String)> {
        let mut out: Vec<(String, String)> = Vec::new();
        for line in s.lines().skip(1) {
            match line.strip_prefix("    ").filter(|l| !l.starts_with(' ')) {
                Some(l) => out.push((l.split(':').next().unwrap_or(l).to_string(), l.to_string())),
                None => {
                    if let Some(last) = out.last_mut() {
                        last.1.push_str(line);
                    }
                }
            }
        }
        out
    };
    let (a, b) = (top(&a), top(&b));
    b.iter()
        .filter(|(k, v)| {
            a.iter()
                .find(|(k2, _)| k2 == k)
                .is_none_or(|(_, v2)| v2 != v)
        })
        .map(|(k, _)| k.clone())
        .collect()
}

/// The daemon's signals: SIGTERM and SIGINT stop it; SIGHUP reloads the policies.
struct Signals {
    term: tokio::signal::unix::Signal,
    int: tokio::signal::unix::Signal,
    hup: tokio::signal::unix::Signal,
}

impl Signals {
    fn install() -> std::io::Result<Signals> {
        use tokio::signal::unix::{signal, SignalKind};
        Ok(Signals {
            term: signal(SignalKind::terminate())?,
            int: signal(SignalKind::interrupt())?,
            hup: signal(SignalKind::hangup())?,
        })
    }

    /// Returns at SIGTERM or SIGINT; reloads the policies at each SIGHUP (the load runs off
    /// the async threads).
    async fn wait_for_stop(mut self, reload: &Reload) {
        loop {
            tokio::select! {
                _ = self.term.recv() => return,
                _ = self.int.recv() => return,
                _ = self.hup.recv() => {
                    tracing::info!("SIGHUP: reloading the policies from {}", reload.dir.display());
                    tokio::task::block_in_place(|| reload.run());
                }
            }
        }
    }
}

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
        _ => format!("{shown}: cannot connect: {e}"),
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
async fn connect(socket: &Path) -> i32 {
    use tokio::io::{AsyncBufReadExt, AsyncWriteExt};
    let stream = match tokio::net::UnixStream::connect(socket).await {
        Ok(s) => s,
        Err(e) => {
            eprintln!("airlock: {}", connect_error(socket, &e));
            return 2;
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
    };
    let p = pending.lock().unwrap_or_else(|p| p.into_inner());
    match end {
        Ok(DownEnd::Closed) if p.stdin_done && p.ids.is_empty() => 0,
        Ok(DownEnd::Closed) | Err(_) => {
            let unanswered = match p.ids.len() {
                0 => String::new(),
                n => format!(" with {n} request(s) unanswered"),
            };
            eprintln!(
                "airlock: the daemon closed the connection{unanswered} (did it stop or crash?)"
            );
            1
        }
        Ok(DownEnd::StdoutGone(e)) => {
            eprintln!(
                "airlock: stdout is closed ({e}): disconnecting; the daemon cancels the calls in flight"
            );
            1
        }
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
fn coerce(raw: &str, schema_type: Option<&str>) -> Result<Value, String> {
    match schema_type {
        Some("string") | None => Ok(Value::String(raw.to_string())),
        Some(t) => {
            serde_json::from_str(raw).map_err(|e| format!("{raw:?} is not a valid {t}: {e}"))
        }
    }
}

/// Exit codes of `airlock call` besides 0 (result), 1 (tool error) and 2 (other failure).
const EXIT_INTERRUPTED: i32 = 130;
const EXIT_TIMEOUT: i32 = 124;

/// `airlock call`: Ctrl-C (SIGINT) or `--timeout` cancels the call over the wire
/// (`notifications/cancelled`; the daemon rolls it back unless it is already publishing),
/// says `cancelled` on stderr and exits 130 (timeout: 124) within a second; a second Ctrl-C
/// exits at once.
async fn call(a: CallArgs) -> i32 {
    use tokio::signal::unix::{signal, SignalKind};
    let mut sigint = match signal(SignalKind::interrupt()) {
        Ok(s) => s,
        Err(e) => {
            eprintln!("airlock: cannot watch for Ctrl-C: {e}");
            return 2;
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
            return EXIT_INTERRUPTED;
        }
        _ = &mut expired => {
            eprintln!("airlock: {tool}: cancelled (no result within {}s; the call was not sent)", timeout.unwrap_or(0.0));
            return EXIT_TIMEOUT;
        }
    };
    let request =
        rmcp::model::ClientRequest::CallToolRequest(rmcp::model::CallToolRequest::new(params));
    let mut handle = match client
        .send_cancellable_request(request, rmcp::service::PeerRequestOptions::no_options())
        .await
    {
        Ok(h) => h,
        Err(e) => {
            eprintln!("airlock: {tool}: cannot send the call: {e}");
            return 2;
        }
    };
    let (why, code) = tokio::select! {
        r = &mut handle.rx => {
            let code = print_result(&tool, r);
            let _ = tokio::time::timeout(Duration::from_secs(1), client.cancel()).await;
            return code;
        }
        _ = sigint.recv() => ("interrupted".to_string(), EXIT_INTERRUPTED),
        _ = &mut expired => (format!("no result within {}s", timeout.unwrap_or(0.0)), EXIT_TIMEOUT),
    };
    eprintln!(
        "airlock: {tool}: cancelled ({why}); the daemon rolls it back unless it was already publishing"
    );
    // A second Ctrl-C does not wait for the goodbye.
    tokio::spawn(async move {
        sigint.recv().await;
        eprintln!("airlock: {tool}: interrupted again; exiting at once");
        std::process::exit(EXIT_INTERRUPTED);
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
) -> Result<(CallClient, rmcp::model::CallToolRequestParams), i32> {
    use rmcp::model::CallToolRequestParams;
    let stream = match tokio::net::UnixStream::connect(&a.socket.socket).await {
        Ok(s) => s,
        Err(e) => {
            eprintln!("airlock: {}", connect_error(&a.socket.socket, &e));
            return Err(2);
        }
    };
    let client = match ().serve(stream).await {
        Ok(c) => c,
        Err(e) => {
            eprintln!("airlock: MCP handshake failed: {e}");
            return Err(2);
        }
    };
    let mut args: Map<String, Value> = match &a.json {
        None => Map::new(),
        Some(j) => match serde_json::from_str::<Value>(j) {
            Ok(Value::Object(m)) => m,
            Ok(_) => {
                eprintln!("airlock: --json must be a JSON object");
                return Err(2);
            }
            Err(e) => {
                eprintln!("airlock: --json: {e}");
                return Err(2);
            }
        },
    };
    if !a.args.is_empty() {
        let tools = match client.list_all_tools().await {
            Ok(t) => t,
            Err(e) => {
                eprintln!("airlock: tools/list failed: {e}");
                return Err(2);
            }
        };
        let schema = tools
            .iter()
            .find(|t| t.name == a.tool)
            .map(|t| t.input_schema.clone());
        for kv in &a.args {
            let Some((k, v)) = kv.split_once('=') else {
                eprintln!("airlock: --arg {kv:?}: expected NAME=VALUE");
                return Err(2);
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
                    eprintln!("airlock: --arg {k}: {e}");
                    return Err(2);
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
) -> i32 {
    let r = match r {
        Ok(Ok(rmcp::model::ServerResult::CallToolResult(r))) => r,
        Ok(Ok(other)) => {
            eprintln!("airlock: {tool}: unexpected reply: {other:?}");
            return 2;
        }
        Ok(Err(e)) => {
            eprintln!("airlock: {tool}: {e}");
            return 2;
        }
        Err(_) => {
            eprintln!("airlock: {tool}: the daemon closed the connection before replying");
            return 2;
        }
    };
    let is_error = r.is_error.unwrap_or(false);
    match serde_json::to_string_pretty(&r) {
        Ok(s) => println!("{s}"),
        Err(e) => eprintln!("airlock: cannot print the result: {e}"),
    }
    i32::from(is_error)
}

use rmcp::ServiceExt;
