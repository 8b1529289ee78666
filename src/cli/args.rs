//! The clap definitions of every command (man pages and completions are generated from
//! them: `generate-assets`).

use std::path::PathBuf;

use clap::{Args, Parser, Subcommand, ValueEnum};

#[derive(Parser)]
#[command(
    name = "airlock",
    version,
    about = "Runs MCP tool calls so that every terminal response is a state boundary"
)]
pub(super) struct Cli {
    /// Log format on stderr.
    #[arg(long, value_enum, default_value_t = LogFormat::Human, global = true)]
    pub(super) log_format: LogFormat,
    #[command(subcommand)]
    pub(super) command: Command,
}

#[derive(Clone, Copy, ValueEnum)]
pub(super) enum LogFormat {
    Human,
    Json,
}

#[derive(Subcommand)]
pub(super) enum Command {
    /// Run the daemon: serve MCP on a Unix socket.
    Serve(ServeArgs),
    /// Bridge stdin/stdout to the daemon's socket, for clients that launch stdio servers.
    Connect {
        #[command(flatten)]
        socket: SocketArg,
    },
    /// Call one tool and print its result as JSON; exits 1 on a tool error.
    Call(CallArgs),
    /// Ask the daemon about a job: `job get ID`, or `job get --session S --key K`.
    #[command(subcommand)]
    Job(JobCommand),
    /// Check or explain the policy files.
    #[command(subcommand)]
    Policy(PolicyCommand),
    /// Roll back or complete every job a crashed daemon left, then exit.
    Recover(Dirs),
    /// Read the durable audit log (filters, --follow, --json), or `verify` its hash chain.
    Audit(super::audit::AuditArgs),
    /// Write the man pages and shell completions into DIR (used to build the package).
    #[command(hide = true)]
    GenerateAssets {
        /// Where `man/` and `completions/` are created.
        out: PathBuf,
    },
}

#[derive(Args, Clone)]
pub(super) struct SocketArg {
    /// The daemon's socket [default: $AIRLOCK_SOCKET, else ./airlock.sock].
    #[arg(long, env = "AIRLOCK_SOCKET", default_value = "airlock.sock")]
    pub(super) socket: PathBuf,
}

/// Where the policy, the workspace and the sessions are: `serve` and `recover`.
#[derive(Args)]
pub(super) struct Dirs {
    /// Policy directory.
    #[arg(long, default_value = "policies")]
    pub(super) policies: PathBuf,
    /// Workspace root [default: the policy's daemon.workspace].
    #[arg(long)]
    pub(super) workspace: Option<PathBuf>,
    /// Where sessions persist [default: the policy's daemon.state_dir].
    #[arg(long)]
    pub(super) state_dir: Option<PathBuf>,
}

#[derive(Args)]
pub(super) struct ServeArgs {
    /// Socket path [default: the policy's daemon.socket].
    #[arg(long)]
    pub(super) socket: Option<PathBuf>,
    #[command(flatten)]
    pub(super) dirs: Dirs,
}

#[derive(Args, Clone)]
pub(super) struct CallArgs {
    /// The tool to call.
    pub(super) tool: String,
    #[command(flatten)]
    pub(super) socket: SocketArg,
    /// The session a write tool mutates.
    #[arg(long)]
    pub(super) session: Option<String>,
    /// An argument as NAME=VALUE; VALUE is read as the tool's declared type.
    #[arg(long = "arg", value_name = "NAME=VALUE")]
    pub(super) args: Vec<String>,
    /// Arguments as one JSON object (merged under --arg).
    #[arg(long)]
    pub(super) json: Option<String>,
    /// Give up (and cancel the call) after this many seconds.
    #[arg(long)]
    pub(super) timeout: Option<f64>,
    /// Send the call with this idempotency key (1 to 128 printable ASCII characters): the
    /// daemon runs a write call with a given key once per session and returns its recorded
    /// outcome to every call with the same key.
    #[arg(long, value_name = "KEY")]
    pub(super) idempotency_key: Option<String>,
    /// After a lost connection, reconnect and resend with the same idempotency key (the
    /// --idempotency-key, else a generated one) until there is an outcome, at most N times.
    #[arg(long, value_name = "N")]
    pub(super) retry: Option<u32>,
}

#[derive(Subcommand)]
pub(super) enum JobCommand {
    /// What became of a write call: its state, versions, outputs and error (`job_get`).
    Get(JobGetArgs),
    /// Undo a session's latest commit: its outputs and state back to what they were before
    /// it, as a new version (`job_undo`).
    Undo(JobUndoArgs),
}

#[derive(Args)]
pub(super) struct JobUndoArgs {
    /// The job id of the call to undo (a write result's structuredContent.job).
    pub(super) id: String,
    /// The session it committed to.
    #[arg(long)]
    pub(super) session: String,
    /// Send the undo with this idempotency key (as `airlock call --idempotency-key`).
    #[arg(long, value_name = "KEY")]
    pub(super) idempotency_key: Option<String>,
    #[command(flatten)]
    pub(super) socket: SocketArg,
}

#[derive(Args)]
pub(super) struct JobGetArgs {
    /// The job id (a write result's structuredContent.job).
    #[arg(required_unless_present = "key", conflicts_with_all = ["session", "key"])]
    pub(super) id: Option<String>,
    /// The session of the keyed call (with --key).
    #[arg(long, requires = "key")]
    pub(super) session: Option<String>,
    /// The idempotency key the call carried (with --session).
    #[arg(long, requires = "session")]
    pub(super) key: Option<String>,
    #[command(flatten)]
    pub(super) socket: SocketArg,
}

#[derive(Subcommand)]
pub(super) enum PolicyCommand {
    /// Validate the policy directory; print a table of tools or every error.
    Check {
        #[arg(long, default_value = "policies")]
        policies: PathBuf,
        /// Resolve `@daemon` for this user (name or uid) [default: the User= of the installed
        /// airlock.service that serves this policy directory, else the invoking user].
        #[arg(long = "as", value_name = "USER")]
        as_user: Option<String>,
    },
    /// Print the effective sandbox of one tool, for a security reviewer.
    Explain {
        tool: String,
        #[arg(long, default_value = "policies")]
        policies: PathBuf,
        /// Resolve `@daemon` for this user (name or uid), as `policy check --as`.
        #[arg(long = "as", value_name = "USER")]
        as_user: Option<String>,
    },
}
