//! `airlock audit`: read the durable log (every rotated file, oldest first) with the
//! resource's filters, as a table or as JSON Lines (events only: each file's header line is
//! left out), optionally following new events; and `airlock audit verify`: check the hash
//! chain, the files' headers and what retention removed.

use std::io::{BufRead, Seek, Write};
use std::path::{Path, PathBuf};
use std::time::Duration;

use clap::{Args, Subcommand};
use serde_json::Value;

use super::exit::Exit;
use crate::audit::{log, parse_since, Filter};

#[derive(Args)]
#[command(args_conflicts_with_subcommands = true)]
pub(super) struct AuditArgs {
    #[command(subcommand)]
    command: Option<AuditCommand>,
    #[command(flatten)]
    read: ReadArgs,
}

#[derive(Subcommand)]
enum AuditCommand {
    /// Check the hash chain across every file of the log, its headers and what retention
    /// removed; print every break and exit 1 if there is one.
    Verify {
        #[command(flatten)]
        log: LogArg,
    },
}

/// Where the log is.
#[derive(Args, Clone)]
struct LogArg {
    /// The audit log [default: the policy's daemon.audit_log, beneath daemon.state_dir].
    #[arg(long)]
    log: Option<PathBuf>,
    /// Policy directory (to find the log).
    #[arg(long, default_value = "policies")]
    policies: PathBuf,
    /// The state dir [default: the policy's daemon.state_dir].
    #[arg(long)]
    state_dir: Option<PathBuf>,
}

#[derive(Args)]
struct ReadArgs {
    #[command(flatten)]
    log: LogArg,
    /// Only this execution job.
    #[arg(long)]
    job: Option<String>,
    /// Only this session.
    #[arg(long)]
    session: Option<String>,
    /// Only this tool.
    #[arg(long)]
    tool: Option<String>,
    /// Only events at or after this time (RFC 3339 UTC, or milliseconds since the epoch).
    #[arg(long)]
    since: Option<String>,
    /// Only the newest N events.
    #[arg(long)]
    limit: Option<usize>,
    /// Print each event as its JSON line, as stored.
    #[arg(long)]
    json: bool,
    /// Keep printing new events as they are written (across rotations), until interrupted.
    #[arg(long)]
    follow: bool,
}

/// Runs `airlock audit ...`: [`Exit::Failed`] for a broken chain, [`Exit::Error`] for trouble.
pub(super) fn run(a: AuditArgs) -> Exit {
    match a.command {
        Some(AuditCommand::Verify { log }) => match locate(&log) {
            Ok(path) => verify(&path),
            Err(code) => code,
        },
        None => match locate(&a.read.log) {
            Ok(path) => read(&path, &a.read),
            Err(code) => code,
        },
    }
}

fn locate(a: &LogArg) -> Result<PathBuf, Exit> {
    if let Some(p) = &a.log {
        return Ok(p.clone());
    }
    super::policy::require_dir(&a.policies, Exit::Error)?;
    match crate::policy::load(&a.policies) {
        Ok(mut p) => {
            match &a.state_dir {
                Some(s) => p.daemon.state_dir = s.clone(),
                None => {
                    if let Some(s) = super::serve::unit_state_dir(&a.policies) {
                        p.daemon.state_dir = s;
                    }
                }
            }
            Ok(p.daemon.audit_log_path())
        }
        Err(e) => {
            for d in &e.0 {
                eprintln!("airlock: {d}");
            }
            eprintln!(
                "airlock: audit: cannot find the log without a valid policy; give --log PATH"
            );
            Err(Exit::Error)
        }
    }
}

fn verify(path: &Path) -> Exit {
    if log::files(path).is_empty() {
        eprintln!("airlock: {}: no audit log there", path.display());
        return Exit::Error;
    }
    let v = log::check(path);
    let range = match (v.first_seq, v.last_seq) {
        (Some(a), Some(b)) => format!("seq {a} to {b}"),
        _ => "no lines".into(),
    };
    let start = match &v.retention {
        None if v.first_seq == Some(0) => "from its genesis header".to_string(),
        None => "from its oldest line".to_string(),
        Some(r) => format!(
            "from seq {}: {} older file(s) were removed by retention, as the newest header records",
            r.first_seq, r.files
        ),
    };
    if v.breaks.is_empty() {
        println!(
            "ok: {} events in {} file(s), {range}; the chain is intact {start}",
            v.events, v.files
        );
        return Exit::Ok;
    }
    for b in &v.breaks {
        eprintln!("airlock: audit verify: chain broken at {b}");
    }
    eprintln!(
        "airlock: audit verify: {} break(s) in {} events in {} file(s), {range}",
        v.breaks.len(),
        v.events,
        v.files
    );
    Exit::Failed
}

fn filter_of(a: &ReadArgs, since_ms: Option<u64>) -> Filter {
    Filter {
        job: a.job.clone(),
        session: a.session.clone(),
        tool: a.tool.clone(),
        since_ms,
        limit: a.limit,
    }
}

fn read(path: &Path, a: &ReadArgs) -> Exit {
    let filter = match a.since.as_deref().map(parse_since).transpose() {
        Ok(since_ms) => filter_of(a, since_ms),
        Err(e) => {
            eprintln!("airlock: audit: {}", crate::report::chain(&e));
            return Exit::Error;
        }
    };
    let files = log::files(path);
    if files.is_empty() && !a.follow {
        eprintln!("airlock: {}: no audit log there", path.display());
        return Exit::Error;
    }
    // Every file, oldest first; with a limit, only the newest N matches are kept.
    let mut picked: std::collections::VecDeque<(String, Value)> = Default::default();
    let limit = filter.limit.unwrap_or(usize::MAX);
    // Where `--follow` goes on: the current file (its inode) and how far it was read.
    let mut resume: Option<(u64, u64)> = None;
    for f in &files {
        let file = match std::fs::File::open(f) {
            Ok(f) => f,
            Err(e) => {
                eprintln!("airlock: {}: {}", f.display(), crate::report::chain(&e));
                return Exit::Error;
            }
        };
        let ino = {
            use std::os::unix::fs::MetadataExt;
            file.metadata().map(|m| m.ino()).unwrap_or(0)
        };
        let mut offset = 0u64;
        let mut reader = std::io::BufReader::new(file);
        loop {
            let mut line = String::new();
            match reader.read_line(&mut line) {
                Ok(0) | Err(_) => break,
                // A line still being written: `--follow` reads it whole later.
                Ok(_) if !line.ends_with('\n') => break,
                Ok(n) => offset += n as u64,
            }
            let line = line.trim_end().to_string();
            let Ok(v) = serde_json::from_str::<Value>(&line) else {
                continue;
            };
            if v["kind"] != log::HEADER && filter.matches(&v) {
                picked.push_back((line, v));
                if picked.len() > limit {
                    picked.pop_front();
                }
            }
        }
        if f.as_path() == path {
            resume = Some((ino, offset));
        }
    }
    let out = std::io::stdout();
    let mut out = out.lock();
    if !a.json {
        let _ = writeln!(out, "{}", header());
    }
    for (line, v) in &picked {
        if emit(&mut out, a.json, line, v).is_err() {
            return Exit::Ok;
        }
    }
    let _ = out.flush();
    drop(out);
    if a.follow {
        follow(path, a.json, &filter, resume);
    }
    Exit::Ok
}

fn emit(out: &mut impl Write, json: bool, line: &str, v: &Value) -> std::io::Result<()> {
    if json {
        writeln!(out, "{line}")
    } else {
        writeln!(out, "{}", row(v))
    }
}

fn header() -> String {
    format!(
        "{:<24} {:>6} {:<18} {:<28} {:<16} {:<12} DETAIL",
        "TIME", "SEQ", "KIND", "JOB", "TOOL", "SESSION"
    )
}

/// One event as a table row: the fixed columns, then the detail's keys in a short form.
fn row(v: &Value) -> String {
    let s = |k: &str| v.get(k).and_then(Value::as_str).unwrap_or("-").to_string();
    let detail = match v.get("detail") {
        Some(Value::Object(m)) => m
            .iter()
            .map(|(k, x)| match x {
                Value::String(t) => format!("{k}={t}"),
                x => format!("{k}={x}"),
            })
            .collect::<Vec<_>>()
            .join(" "),
        _ => String::new(),
    };
    format!(
        "{:<24} {:>6} {:<18} {:<28} {:<16} {:<12} {}",
        s("time"),
        v.get("seq").and_then(Value::as_u64).unwrap_or(0),
        s("kind"),
        s("job"),
        s("tool"),
        s("session"),
        detail
    )
}

/// Prints the events appended to the current file after `resume` (its inode, and the offset
/// read so far), then follows it, reading each new file from its start after a rotation
/// (the inode at `path` changes).
fn follow(path: &Path, json: bool, filter: &Filter, mut resume: Option<(u64, u64)>) {
    use std::os::unix::fs::MetadataExt;
    let filter = Filter {
        limit: None,
        ..filter.clone()
    };
    let mut file: Option<(std::io::BufReader<std::fs::File>, u64)> = None;
    let mut pending = String::new();
    loop {
        if file.is_none() {
            if let Ok(f) = std::fs::File::open(path) {
                let ino = f.metadata().map(|m| m.ino()).unwrap_or(0);
                let mut r = std::io::BufReader::new(f);
                // The file already read goes on where that stopped; a new one (rotated
                // since) from its start.
                if let Some((was, offset)) = resume.take() {
                    if was == ino {
                        let _ = r.seek(std::io::SeekFrom::Start(offset));
                    }
                }
                file = Some((r, ino));
            }
        }
        let mut progressed = false;
        if let Some((r, ino)) = &mut file {
            loop {
                match r.read_line(&mut pending) {
                    Ok(0) | Err(_) => break,
                    Ok(_) if !pending.ends_with('\n') => break,
                    Ok(_) => {
                        progressed = true;
                        let line = pending.trim_end().to_string();
                        pending.clear();
                        if let Ok(v) = serde_json::from_str::<Value>(&line) {
                            if v["kind"] != log::HEADER && filter.matches(&v) {
                                let mut out = std::io::stdout().lock();
                                if emit(&mut out, json, &line, &v)
                                    .and_then(|()| out.flush())
                                    .is_err()
                                {
                                    return;
                                }
                            }
                        }
                    }
                }
            }
            let rotated = std::fs::metadata(path)
                .map(|m| m.ino() != *ino)
                .unwrap_or(true);
            if rotated && pending.is_empty() {
                // The old file was read to its end above: switch to the new one.
                file = None;
            }
        }
        if !progressed {
            std::thread::sleep(Duration::from_millis(200));
        }
    }
}
