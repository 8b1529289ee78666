//! The command line: `serve`, `recover` (the daemon's side, [`serve`]), `connect`, `call`
//! (the client's side, [`client`]), `policy check|explain` ([`policy`]), `audit [verify]`
//! ([`audit`]). Exit codes are one enum, [`Exit`].

mod args;
mod audit;
mod client;
mod exit;
mod policy;
mod serve;
mod unit;

use std::path::Path;
use std::time::Duration;

use clap::Parser;

use args::{Cli, Command, LogFormat, PolicyCommand};
pub use exit::Exit;

/// Parses argv, runs the command, returns the exit code.
pub fn main() -> Exit {
    let cli = Cli::parse();
    // The daemon tells what it does; a one-shot client speaks only of trouble.
    let default_filter = match cli.command {
        Command::Serve(_) | Command::Recover(_) => "info,rmcp=warn",
        _ => "warn",
    };
    init_logging(cli.log_format, default_filter);
    match cli.command {
        Command::Policy(PolicyCommand::Check { policies, as_user }) => {
            policy::check(&policies, as_user.as_deref())
        }
        Command::Policy(PolicyCommand::Explain {
            tool,
            policies,
            as_user,
        }) => policy::explain(&policies, &tool, as_user.as_deref()),
        Command::Recover(a) => serve::recover(a),
        Command::Audit(a) => audit::run(a),
        Command::GenerateAssets { out } => generate_assets(&out),
        Command::Serve(a) => {
            // Taken while the process has one thread, before the runtime and the spawner
            // exist: the passed fds become close-on-exec and the LISTEN_* variables go away
            // before anything the daemon starts could inherit them.
            let activation = crate::systemd::take_listener();
            runtime().map_or(Exit::Error, |rt| {
                let code = rt.block_on(serve::serve(a, activation));
                // A blocking task still running (a cleanup after `shutdown_timeout`) must not
                // hold the exit: recovery at the next start finishes its work.
                rt.shutdown_timeout(Duration::from_secs(1));
                code
            })
        }
        Command::Connect { socket } => runtime().map_or(Exit::Error, |rt| {
            let code = rt.block_on(client::connect(&socket.socket));
            // A read of stdin still blocked in its thread must not hold the exit.
            rt.shutdown_background();
            code
        }),
        Command::Call(a) => runtime().map_or(Exit::Error, |rt| rt.block_on(client::call(a))),
        Command::Job(args::JobCommand::Get(j)) => {
            let query = match (j.id, j.session, j.key) {
                (Some(id), _, _) => serde_json::json!({"job": id}),
                (None, Some(s), Some(k)) => serde_json::json!({"session": s, "idempotencyKey": k}),
                _ => {
                    eprintln!("airlock: job get takes a job id, or --session and --key");
                    return Exit::Error;
                }
            };
            let a = args::CallArgs {
                tool: "job_get".into(),
                socket: j.socket,
                session: None,
                args: Vec::new(),
                json: Some(query.to_string()),
                timeout: None,
                idempotency_key: None,
                retry: None,
            };
            runtime().map_or(Exit::Error, |rt| rt.block_on(client::call(a)))
        }
        Command::Job(args::JobCommand::Undo(u)) => {
            let a = args::CallArgs {
                tool: "job_undo".into(),
                socket: u.socket,
                session: Some(u.session),
                args: Vec::new(),
                json: Some(serde_json::json!({"job": u.id}).to_string()),
                timeout: None,
                idempotency_key: u.idempotency_key,
                retry: None,
            };
            runtime().map_or(Exit::Error, |rt| rt.block_on(client::call(a)))
        }
    }
}

/// Man pages (from the clap definitions) in `out/man`, completions for bash, zsh and fish
/// in `out/completions`.
fn generate_assets(out: &Path) -> Exit {
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
        Ok(()) => Exit::Ok,
        Err(e) => {
            eprintln!(
                "airlock: {}: cannot write the assets: {}",
                out.display(),
                crate::report::chain(&e)
            );
            Exit::Error
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
            eprintln!(
                "airlock: cannot start the async runtime: {}",
                crate::report::chain(&e)
            );
            None
        }
    }
}

/// Logs to stderr; `AIRLOCK_LOG` (a tracing filter such as `debug`) overrides the default.
fn init_logging(format: LogFormat, default_filter: &str) {
    let mut filter = tracing_subscriber::EnvFilter::try_from_env("AIRLOCK_LOG")
        .unwrap_or_else(|_| tracing_subscriber::EnvFilter::new(default_filter));
    // rmcp logs every request and response whole at debug level: a `secret = true`
    // argument would reach the log unredacted. It is capped at info whatever AIRLOCK_LOG
    // says (the daemon's own events say what happened, secrets scrubbed); a filter that
    // logs nothing above info needs no cap, and gets none (a cap would raise rmcp to info).
    let verbose = filter
        .max_level_hint()
        .is_none_or(|l| l > tracing_subscriber::filter::LevelFilter::INFO);
    if verbose {
        if let Ok(cap) = "rmcp=info".parse() {
            filter = filter.add_directive(cap);
        }
    }
    let b = tracing_subscriber::fmt()
        .with_env_filter(filter)
        .with_ansi(std::io::IsTerminal::is_terminal(&std::io::stderr()))
        .with_writer(std::io::stderr);
    let _ = match format {
        LogFormat::Human => b.try_init(),
        LogFormat::Json => b.json().try_init(),
    };
}
