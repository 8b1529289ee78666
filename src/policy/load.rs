//! Reading and validating the policy directory. Every problem is collected, with the file,
//! line and column it comes from, before the daemon serves anything.

use std::collections::BTreeMap;
use std::fmt;
use std::path::{Path, PathBuf};
use std::time::Duration;

use serde::Deserialize;
use toml::Spanned;

use super::model::*;

/// One problem in one policy file.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Diagnostic {
    pub file: PathBuf,
    /// 1-based; 0 when the problem is about the file as a whole.
    pub line: usize,
    pub col: usize,
    pub message: String,
}

impl fmt::Display for Diagnostic {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        if self.line == 0 {
            write!(f, "{}: {}", self.file.display(), self.message)
        } else {
            write!(
                f,
                "{}:{}:{}: {}",
                self.file.display(),
                self.line,
                self.col,
                self.message
            )
        }
    }
}

/// Every problem found in a policy directory.
#[derive(Debug, thiserror::Error)]
#[error("{} error(s) in the policy:\n{}", .0.len(), render(.0))]
pub struct PolicyErrors(pub Vec<Diagnostic>);

fn render(d: &[Diagnostic]) -> String {
    d.iter()
        .map(|d| format!("  {d}"))
        .collect::<Vec<_>>()
        .join("\n")
}

/// Reads `dir/airlock.toml`, `dir/profiles/*.toml` and `dir/tools/*.toml`; `@daemon` in a
/// grant is the process's own effective uid and gid.
pub fn load(dir: &Path) -> Result<Policy, PolicyErrors> {
    let own = DaemonIdentity {
        uid: rustix::process::geteuid().as_raw(),
        gid: rustix::process::getegid().as_raw(),
    };
    load_for(dir, own)
}

/// The uid and gid `@daemon` stands for in a grant: the daemon's own when it serves, the
/// user the service runs as when `policy check --as USER` asks.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct DaemonIdentity {
    pub uid: u32,
    pub gid: u32,
}

/// A policy directory is a directory holding `airlock.toml`: a path that is not one (a
/// typo, a missing package, the wrong current directory) is an error naming what is
/// missing, never an empty policy of built-ins.
pub fn check_dir(dir: &Path) -> Result<(), Diagnostic> {
    let whole = |file: &Path, message: String| Diagnostic {
        file: file.to_path_buf(),
        line: 0,
        col: 0,
        message,
    };
    match std::fs::metadata(dir) {
        Ok(m) if m.is_dir() => {}
        Ok(_) => {
            return Err(whole(
                dir,
                "not a directory: a policy directory holds airlock.toml, profiles/, tools/".into(),
            ))
        }
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => {
            return Err(whole(
                dir,
                "no policy directory there (expected airlock.toml, profiles/, tools/)".into(),
            ))
        }
        Err(e) => return Err(whole(dir, format!("cannot read the policy directory: {e}"))),
    }
    let toml = dir.join("airlock.toml");
    match std::fs::metadata(&toml) {
        Ok(m) if m.is_file() => Ok(()),
        Ok(_) => Err(whole(
            &toml,
            "not a regular file: a policy directory needs its daemon config".into(),
        )),
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => Err(whole(
            &toml,
            "missing: a policy directory needs its daemon config".into(),
        )),
        Err(e) => Err(whole(&toml, format!("cannot read it: {e}"))),
    }
}

/// [`load`], with `@daemon` resolved to `daemon`.
pub fn load_for(dir: &Path, identity: DaemonIdentity) -> Result<Policy, PolicyErrors> {
    check_dir(dir).map_err(|d| PolicyErrors(vec![d]))?;
    let mut cx = Cx::default();
    let daemon = load_daemon(&mut cx, &dir.join("airlock.toml"));
    let daemon_ok = daemon.is_some();
    let mut profiles = BTreeMap::new();
    for path in toml_files(&mut cx, &dir.join("profiles")) {
        if let Some(p) = load_profile(&mut cx, &path) {
            profiles.insert(p.name.clone(), std::sync::Arc::new(p));
        }
    }
    let mut tools = super::builtins();
    for path in toml_files(&mut cx, &dir.join("tools")) {
        if let Some((tool, name_span, text)) = load_tool(&mut cx, &path, &profiles) {
            if let Some(prev) = tools.get(&tool.name) {
                let what = match &prev.source {
                    Some(p) => format!("already declared in {}", p.display()),
                    None => "the name of a built-in tool".to_string(),
                };
                cx.at(
                    &path,
                    &text,
                    name_span,
                    format!("duplicate tool name {:?}: {what}", tool.name),
                );
            } else {
                tools.insert(tool.name.clone(), tool);
            }
        }
    }
    // Only once the file parsed: its syntax errors are reported once, by `load_daemon`.
    let grants = if daemon_ok {
        load_grants(&mut cx, &dir.join("airlock.toml"), &tools, identity)
    } else {
        Vec::new()
    };
    if cx.diags.is_empty() {
        Ok(Policy {
            dir: dir.to_path_buf(),
            daemon: daemon.unwrap_or_default(),
            profiles,
            tools,
            grants,
        })
    } else {
        Err(PolicyErrors(cx.diags))
    }
}

#[derive(Default)]
struct Cx {
    diags: Vec<Diagnostic>,
}

impl Cx {
    fn file(&mut self, file: &Path, message: impl Into<String>) {
        self.diags.push(Diagnostic {
            file: file.to_path_buf(),
            line: 0,
            col: 0,
            message: message.into(),
        });
    }

    fn at(
        &mut self,
        file: &Path,
        text: &str,
        span: std::ops::Range<usize>,
        message: impl Into<String>,
    ) {
        let (line, col) = line_col(text, span.start);
        self.diags.push(Diagnostic {
            file: file.to_path_buf(),
            line,
            col,
            message: message.into(),
        });
    }

    fn read(&mut self, path: &Path) -> Option<String> {
        match std::fs::read_to_string(path) {
            Ok(t) => Some(t),
            Err(e) => {
                self.file(path, format!("cannot read: {e}"));
                None
            }
        }
    }

    fn parse<T: serde::de::DeserializeOwned>(&mut self, path: &Path, text: &str) -> Option<T> {
        match toml::from_str::<T>(text) {
            Ok(v) => Some(v),
            Err(e) => {
                let message = e.message().trim().to_string();
                match e.span() {
                    Some(span) => self.at(path, text, span, message),
                    None => self.file(path, message),
                }
                None
            }
        }
    }
}

fn line_col(text: &str, offset: usize) -> (usize, usize) {
    let before = &text[..offset.min(text.len())];
    let line = before.matches('\n').count() + 1;
    let col = before.rsplit('\n').next().map_or(0, |l| l.chars().count()) + 1;
    (line, col)
}

fn toml_files(cx: &mut Cx, dir: &Path) -> Vec<PathBuf> {
    let entries = match std::fs::read_dir(dir) {
        Ok(e) => e,
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Vec::new(),
        Err(e) => {
            cx.file(dir, format!("cannot list: {e}"));
            return Vec::new();
        }
    };
    let mut files: Vec<PathBuf> = entries
        .filter_map(|e| e.ok().map(|e| e.path()))
        .filter(|p| p.extension().is_some_and(|x| x == "toml"))
        .collect();
    files.sort();
    files
}

// ---- airlock.toml -------------------------------------------------------------------------

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct RawDaemonFile {
    daemon: Option<RawDaemon>,
    /// Read by [`load_grants`], once the tools are known.
    #[serde(default, rename = "grant")]
    _grant: Option<toml::Value>,
}

#[derive(Deserialize)]
struct RawGrantsFile {
    #[serde(default)]
    grant: Vec<Spanned<RawGrant>>,
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct RawGrant {
    #[serde(default)]
    users: Vec<Spanned<String>>,
    #[serde(default)]
    uids: Vec<Spanned<u32>>,
    #[serde(default)]
    groups: Vec<Spanned<String>>,
    #[serde(default)]
    gids: Vec<Spanned<u32>>,
    capabilities: Spanned<Vec<Spanned<String>>>,
    tools: Option<Vec<Spanned<String>>>,
}

/// The user (and group) name that stands for the daemon's own effective uid (gid) in a grant.
pub const DAEMON_USER: &str = "@daemon";

/// Reads the `[[grant]]` tables of `airlock.toml`: every user and group name resolved (an
/// unknown one is an error), every capability and tool known.
/// A `users` (or, with `group`, `groups`) entry of a grant as its id: `@daemon` is the
/// daemon's own; any other name is looked up.
fn resolve_subject(name: &str, group: bool, daemon: DaemonIdentity) -> Result<u32, String> {
    let (what, list, numbers, names) = if group {
        ("group", "groups", "gids", "group names")
    } else {
        ("user", "users", "uids", "account names")
    };
    if name == DAEMON_USER {
        return Ok(if group { daemon.gid } else { daemon.uid });
    }
    let found = if group {
        nix::unistd::Group::from_name(name).map(|g| g.map(|g| g.gid.as_raw()))
    } else {
        nix::unistd::User::from_name(name).map(|u| u.map(|u| u.uid.as_raw()))
    };
    match found {
        Ok(Some(id)) => Ok(id),
        Ok(None) => Err(format!("no {what} named {name:?} on this system ({list} = [...] takes {names}, or \"{DAEMON_USER}\" for the daemon's own {what}; {numbers} = [...] takes numbers)")),
        Err(e) => Err(format!("cannot look up {what} {name:?}: {e}")),
    }
}

fn load_grants(
    cx: &mut Cx,
    path: &Path,
    tools: &BTreeMap<String, Tool>,
    daemon: DaemonIdentity,
) -> Vec<super::Grant> {
    use super::Right;
    if !path.exists() {
        return Vec::new();
    }
    let Some(text) = cx.read(path) else {
        return Vec::new();
    };
    let Some(raw) = cx.parse::<RawGrantsFile>(path, &text) else {
        return Vec::new();
    };
    let file = path
        .file_name()
        .map_or_else(String::new, |f| f.to_string_lossy().into_owned());
    let mut out = Vec::new();
    for g in raw.grant {
        let (line, _) = line_col(&text, g.span().start);
        let span = g.span();
        let g = g.into_inner();
        let mut grant = super::Grant {
            uids: Default::default(),
            gids: Default::default(),
            subjects: Vec::new(),
            rights: Default::default(),
            tools: None,
            origin: format!("{file}:{line}"),
        };
        for (names, group) in [(&g.users, false), (&g.groups, true)] {
            for n in names {
                let name = n.get_ref();
                match resolve_subject(name, group, daemon) {
                    Ok(id) if group => {
                        grant.gids.insert(id);
                        grant.subjects.push(format!("group {name} (gid {id})"));
                    }
                    Ok(id) => {
                        grant.uids.insert(id);
                        grant.subjects.push(format!("user {name} (uid {id})"));
                    }
                    Err(m) => cx.at(path, &text, n.span(), m),
                }
            }
        }
        for u in &g.uids {
            grant.uids.insert(*u.get_ref());
            grant.subjects.push(format!("uid {}", u.get_ref()));
        }
        for gid in &g.gids {
            grant.gids.insert(*gid.get_ref());
            grant.subjects.push(format!("gid {}", gid.get_ref()));
        }
        if g.users.is_empty() && g.uids.is_empty() && g.groups.is_empty() && g.gids.is_empty() {
            cx.at(
                path,
                &text,
                span.clone(),
                "a [[grant]] names nobody: give it users, uids, groups or gids",
            );
        }
        for c in g.capabilities.get_ref() {
            match Right::parse(c.get_ref()) {
                Some(r) => {
                    grant.rights.insert(r);
                }
                None => cx.at(
                    path,
                    &text,
                    c.span(),
                    format!(
                        "unknown capability {:?}: use \"read\", \"write\", \"admin\" or \"audit\"",
                        c.get_ref()
                    ),
                ),
            }
        }
        if g.capabilities.get_ref().is_empty() {
            cx.at(path, &text, g.capabilities.span(), "a [[grant]] with no capabilities gives nothing; name \"read\", \"write\", \"admin\" or \"audit\"");
        }
        if let Some(list) = &g.tools {
            let mut set = std::collections::BTreeSet::new();
            for t in list {
                if tools.contains_key(t.get_ref()) {
                    set.insert(t.get_ref().clone());
                } else {
                    cx.at(
                        path,
                        &text,
                        t.span(),
                        format!(
                            "no tool named {:?} (tools/*.toml and the built-in session tools)",
                            t.get_ref()
                        ),
                    );
                }
            }
            for r in [Right::Admin, Right::Audit] {
                if grant.rights.contains(&r) {
                    cx.at(path, &text, g.capabilities.span(), format!("{:?} is not limited to tools: put it in a [[grant]] without tools = [...]", r.as_str()));
                }
            }
            grant.tools = Some(set);
        }
        out.push(grant);
    }
    out
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct RawDaemon {
    socket: Option<PathBuf>,
    socket_mode: Option<Spanned<String>>,
    socket_group: Option<String>,
    workspace: Option<PathBuf>,
    state_dir: Option<PathBuf>,
    max_message_size: Option<Spanned<Size>>,
    max_connections: Option<usize>,
    max_concurrent_calls: Option<usize>,
    audit_ring: Option<usize>,
    audit_ring_bytes: Option<Spanned<Size>>,
    audit_log: Option<PathBuf>,
    audit_log_size: Option<Spanned<Size>>,
    audit_log_keep: Option<usize>,
    audit_hash_limit: Option<Spanned<Size>>,
    max_connections_per_uid: Option<usize>,
    max_requests_per_connection: Option<usize>,
    max_queued_bytes: Option<Spanned<Size>>,
    handshake_timeout: Option<Spanned<String>>,
    idle_timeout: Option<Spanned<String>>,
    write_timeout: Option<Spanned<String>>,
    shutdown_timeout: Option<Spanned<String>>,
    cgroup: Option<PathBuf>,
    worker_user: Option<Spanned<String>>,
    worker_uids: Option<Spanned<String>>,
    worker_uid_lock_dir: Option<Spanned<PathBuf>>,
    max_sessions_per_principal: Option<Spanned<usize>>,
    max_session_state_bytes: Option<Spanned<Size>>,
    max_state_bytes_per_principal: Option<Spanned<Size>>,
    max_calls_per_principal: Option<Spanned<usize>>,
    max_queued_per_principal: Option<usize>,
}

fn load_daemon(cx: &mut Cx, path: &Path) -> Option<DaemonConfig> {
    if !path.exists() {
        return Some(DaemonConfig::default());
    }
    let text = cx.read(path)?;
    let raw: RawDaemonFile = cx.parse(path, &text)?;
    let mut d = DaemonConfig::default();
    let Some(r) = raw.daemon else { return Some(d) };
    if let Some(v) = r.socket {
        d.socket = v;
    }
    if let Some(mode) = r.socket_mode {
        match u32::from_str_radix(mode.get_ref().trim_start_matches("0o"), 8) {
            Ok(m) if m <= 0o777 => d.socket_mode = m,
            _ => cx.at(
                path,
                &text,
                mode.span(),
                format!(
                    "socket_mode {:?} is not an octal mode such as \"0660\"",
                    mode.get_ref()
                ),
            ),
        }
    }
    d.socket_group = r.socket_group;
    if let Some(v) = r.workspace {
        d.workspace = v;
    }
    if let Some(v) = r.state_dir {
        d.state_dir = v;
    }
    if let Some(v) = r.max_message_size {
        match v.get_ref().bytes(&text, v.span()) {
            Ok(n) if n >= 1024 => d.max_message_bytes = n as usize,
            Ok(_) => cx.at(
                path,
                &text,
                v.span(),
                "max_message_size must be at least 1KiB",
            ),
            Err(m) => cx.at(path, &text, v.span(), m),
        }
    }
    if let Some(v) = r.max_connections {
        d.max_connections = v.max(1);
    }
    if let Some(v) = r.max_concurrent_calls {
        d.max_concurrent_calls = v.max(1);
    }
    if let Some(v) = r.audit_ring {
        d.audit_ring = v.max(1);
    }
    if let Some(v) = r.audit_log {
        d.audit_log = v;
    }
    if let Some(v) = r.audit_log_keep {
        d.audit_log_keep = v;
    }
    // Sizes: each at least a floor that keeps the daemon usable.
    let (mut ring_bytes, mut queued_bytes) = (d.audit_ring_bytes as u64, d.max_queued_bytes as u64);
    let sizes = [
        (
            "audit_log_size",
            r.audit_log_size,
            4 << 10,
            &mut d.audit_log_bytes,
        ),
        (
            "audit_hash_limit",
            r.audit_hash_limit,
            0,
            &mut d.audit_hash_limit,
        ),
        (
            "audit_ring_bytes",
            r.audit_ring_bytes,
            64 << 10,
            &mut ring_bytes,
        ),
        (
            "max_queued_bytes",
            r.max_queued_bytes,
            64 << 10,
            &mut queued_bytes,
        ),
    ];
    for (name, v, floor, slot) in sizes {
        let Some(v) = v else { continue };
        match v.get_ref().bytes(&text, v.span()) {
            Ok(n) if n >= floor => *slot = n,
            Ok(_) => cx.at(
                path,
                &text,
                v.span(),
                format!("{name} must be at least {}KiB", floor >> 10),
            ),
            Err(m) => cx.at(path, &text, v.span(), m),
        }
    }
    d.audit_ring_bytes = usize::try_from(ring_bytes).unwrap_or(usize::MAX);
    d.max_queued_bytes = usize::try_from(queued_bytes).unwrap_or(usize::MAX);
    if let Some(v) = r.max_connections_per_uid {
        d.max_connections_per_uid = v.max(1);
    }
    if let Some(v) = r.max_requests_per_connection {
        d.max_requests_per_connection = v.max(1);
    }
    let durations = [
        (
            "handshake_timeout",
            r.handshake_timeout,
            &mut d.handshake_timeout,
        ),
        ("idle_timeout", r.idle_timeout, &mut d.idle_timeout),
        ("write_timeout", r.write_timeout, &mut d.write_timeout),
        (
            "shutdown_timeout",
            r.shutdown_timeout,
            &mut d.shutdown_timeout,
        ),
    ];
    for (name, v, slot) in durations {
        let Some(v) = v else { continue };
        match parse_duration(v.get_ref()) {
            Ok(t) if t >= Duration::from_millis(100) && t <= Duration::from_secs(86_400) => {
                *slot = t
            }
            Ok(_) => cx.at(
                path,
                &text,
                v.span(),
                format!("{name} must be between 100ms and 24h"),
            ),
            Err(m) => cx.at(path, &text, v.span(), m),
        }
    }
    d.cgroup = r.cgroup;
    if let Some(v) = r.worker_user {
        match v.get_ref().as_str() {
            "auto" => d.worker_user = WorkerUser::Auto,
            "separate" => d.worker_user = WorkerUser::Separate,
            "daemon" => d.worker_user = WorkerUser::Daemon,
            other => cx.at(
                path,
                &text,
                v.span(),
                format!("worker_user {other:?} must be \"auto\", \"separate\" or \"daemon\""),
            ),
        }
    }
    if let Some(v) = r.worker_uids {
        match parse_uid_range(v.get_ref()) {
            Ok(range) => d.worker_uids = range,
            Err(m) => cx.at(path, &text, v.span(), m),
        }
    }
    if let Some(v) = r.worker_uid_lock_dir {
        if v.get_ref().is_absolute() {
            d.worker_uid_lock_dir = v.into_inner();
        } else {
            let m = format!(
                "worker_uid_lock_dir {:?} must be an absolute path",
                v.get_ref().display().to_string()
            );
            cx.at(path, &text, v.span(), m);
        }
    }
    let bounds = RawPrincipalBounds {
        max_sessions_per_principal: r.max_sessions_per_principal,
        max_session_state_bytes: r.max_session_state_bytes,
        max_state_bytes_per_principal: r.max_state_bytes_per_principal,
        max_calls_per_principal: r.max_calls_per_principal,
        max_queued_per_principal: r.max_queued_per_principal,
    };
    load_principal_bounds(cx, path, &text, &bounds, &mut d);
    Some(d)
}

/// The per-principal bounds of `[daemon]`, as written.
struct RawPrincipalBounds {
    max_sessions_per_principal: Option<Spanned<usize>>,
    max_session_state_bytes: Option<Spanned<Size>>,
    max_state_bytes_per_principal: Option<Spanned<Size>>,
    max_calls_per_principal: Option<Spanned<usize>>,
    max_queued_per_principal: Option<usize>,
}

/// The per-principal bounds of `[daemon]`: sessions (count, state bytes) and call slots.
fn load_principal_bounds(
    cx: &mut Cx,
    path: &Path,
    text: &str,
    r: &RawPrincipalBounds,
    d: &mut DaemonConfig,
) {
    if let Some(v) = &r.max_sessions_per_principal {
        match *v.get_ref() {
            0 => cx.at(
                path,
                text,
                v.span(),
                "max_sessions_per_principal must be at least 1",
            ),
            n => d.max_sessions_per_principal = n,
        }
    }
    let sizes = [
        (
            "max_session_state_bytes",
            &r.max_session_state_bytes,
            &mut d.max_session_state_bytes,
        ),
        (
            "max_state_bytes_per_principal",
            &r.max_state_bytes_per_principal,
            &mut d.max_state_bytes_per_principal,
        ),
    ];
    for (name, v, slot) in sizes {
        let Some(v) = v else { continue };
        match v.get_ref().bytes(text, v.span()) {
            Ok(n) if n >= 1024 => *slot = n,
            Ok(_) => cx.at(
                path,
                text,
                v.span(),
                format!("{name} must be at least 1KiB"),
            ),
            Err(m) => cx.at(path, text, v.span(), m),
        }
    }
    if d.max_state_bytes_per_principal < d.max_session_state_bytes {
        let span = r
            .max_state_bytes_per_principal
            .as_ref()
            .or(r.max_session_state_bytes.as_ref())
            .map(|v| v.span());
        let m = format!(
            "max_state_bytes_per_principal ({}) must be at least max_session_state_bytes ({})",
            d.max_state_bytes_per_principal, d.max_session_state_bytes
        );
        match span {
            Some(s) => cx.at(path, text, s, m),
            None => cx.at(path, text, 0..0, m),
        }
    }
    d.max_calls_per_principal = super::model::default_calls_per_principal(d.max_concurrent_calls);
    if let Some(v) = &r.max_calls_per_principal {
        match *v.get_ref() {
            n if n >= 1 && n <= d.max_concurrent_calls => d.max_calls_per_principal = n,
            n => cx.at(
                path,
                text,
                v.span(),
                format!(
                    "max_calls_per_principal ({n}) must be between 1 and max_concurrent_calls ({})",
                    d.max_concurrent_calls
                ),
            ),
        }
    }
    if let Some(v) = r.max_queued_per_principal {
        d.max_queued_per_principal = v;
    }
}

/// `"FIRST-LAST"`: an inclusive range of unprivileged ids, at least 2 long.
pub fn parse_uid_range(s: &str) -> Result<(u32, u32), String> {
    let bad = || format!("worker_uids {s:?} must be a range such as \"60600-61099\"");
    let (a, b) = s.trim().split_once('-').ok_or_else(bad)?;
    let a: u32 = a.trim().parse().map_err(|_| bad())?;
    let b: u32 = b.trim().parse().map_err(|_| bad())?;
    if a == 0 || a > b {
        return Err(bad());
    }
    // 65534 is nobody and u32::MAX is "no uid": neither may be a worker.
    if (a..=b).contains(&65534) || b == u32::MAX {
        return Err(format!(
            "worker_uids {s:?} must not contain 65534 (nobody) or 4294967295"
        ));
    }
    Ok((a, b))
}

/// A byte size: an integer, or a string such as "4MiB", "512k", "1G".
#[derive(Deserialize, Clone)]
#[serde(untagged)]
enum Size {
    Int(u64),
    Text(String),
}

impl Size {
    fn bytes(&self, _text: &str, _span: std::ops::Range<usize>) -> Result<u64, String> {
        match self {
            Size::Int(n) => Ok(*n),
            Size::Text(s) => parse_size(s),
        }
    }
}

pub fn parse_size(s: &str) -> Result<u64, String> {
    let t = s.trim();
    let split = t.find(|c: char| !c.is_ascii_digit()).unwrap_or(t.len());
    let (num, unit) = t.split_at(split);
    let n: u64 = num
        .parse()
        .map_err(|_| format!("{s:?} is not a size such as \"4MiB\""))?;
    let mult: u64 = match unit.trim().to_ascii_lowercase().as_str() {
        "" | "b" => 1,
        "k" | "kb" | "kib" => 1 << 10,
        "m" | "mb" | "mib" => 1 << 20,
        "g" | "gb" | "gib" => 1 << 30,
        "t" | "tb" | "tib" => 1 << 40,
        _ => return Err(format!("{s:?} has an unknown unit (use B, KiB, MiB, GiB)")),
    };
    n.checked_mul(mult)
        .ok_or_else(|| format!("{s:?} is too large"))
}

/// A duration such as "20s", "500ms", "2m", "1h".
pub fn parse_duration(s: &str) -> Result<Duration, String> {
    let t = s.trim();
    let split = t.find(|c: char| !c.is_ascii_digit()).unwrap_or(t.len());
    let (num, unit) = t.split_at(split);
    let n: u64 = num
        .parse()
        .map_err(|_| format!("{s:?} is not a duration such as \"20s\" or \"500ms\""))?;
    let d = match unit.trim() {
        "ms" => Duration::from_millis(n),
        "s" | "" => Duration::from_secs(n),
        "m" | "min" => Duration::from_secs(n.saturating_mul(60)),
        "h" => Duration::from_secs(n.saturating_mul(3600)),
        _ => return Err(format!("{s:?} has an unknown unit (use ms, s, m or h)")),
    };
    Ok(d)
}

// ---- profiles/NAME.toml -------------------------------------------------------------------

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct RawProfile {
    landlock: Option<RawLandlock>,
    seccomp: Option<RawSeccomp>,
    network: Option<RawNetwork>,
    limits: Option<RawLimits>,
    env: Option<RawEnv>,
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct RawLandlock {
    abi: Option<Spanned<u8>>,
    best_effort: Option<bool>,
    #[serde(default)]
    read: Vec<Spanned<PathBuf>>,
    #[serde(default)]
    exec: Vec<Spanned<PathBuf>>,
    #[serde(default)]
    write: Vec<Spanned<PathBuf>>,
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct RawSeccomp {
    mode: SeccompMode,
    syscalls: Vec<Spanned<String>>,
    errno: Option<Spanned<String>>,
    /// Syscalls added on one architecture only (`x86_64 = [...]`, `aarch64 = [...]`): the
    /// legacy calls x86_64 has and aarch64 does not (`open`, `stat`, `fork`, ...).
    #[serde(default)]
    arch: BTreeMap<String, Spanned<Vec<Spanned<String>>>>,
}

/// The architectures a profile may name in `[seccomp.arch]`.
const ARCHES: &[&str] = &["x86_64", "aarch64"];

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct RawNetwork {
    #[serde(default)]
    allow: bool,
    #[serde(default)]
    unix_sockets: Vec<Spanned<PathBuf>>,
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct RawLimits {
    cpu: Option<Spanned<String>>,
    address_space: Option<Spanned<Size>>,
    file_size: Option<Spanned<Size>>,
    open_files: Option<u64>,
    processes: Option<u64>,
    memory: Option<Spanned<Size>>,
    output: Option<Spanned<Size>>,
    grace: Option<Spanned<String>>,
    staging_size: Option<Spanned<Size>>,
    staging_files: Option<u64>,
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct RawEnv {
    #[serde(default)]
    keep: Vec<String>,
    #[serde(default)]
    set: BTreeMap<String, String>,
}

fn load_profile(cx: &mut Cx, path: &Path) -> Option<Profile> {
    let name = path.file_stem()?.to_string_lossy().into_owned();
    let text = cx.read(path)?;
    let raw: RawProfile = cx.parse(path, &text)?;
    let before = cx.diags.len();
    let mut landlock = LandlockProfile {
        abi: 6,
        best_effort: false,
        read: Vec::new(),
        exec: Vec::new(),
        write: Vec::new(),
    };
    if let Some(l) = raw.landlock {
        if let Some(abi) = l.abi {
            if !(6..=7).contains(abi.get_ref()) {
                cx.at(
                    path,
                    &text,
                    abi.span(),
                    format!(
                        "landlock abi {} is not 6 or 7: workers need ABI 6 at least (signal and abstract Unix socket scoping), and this build knows up to 7",
                        abi.get_ref()
                    ),
                );
            }
            landlock.abi = *abi.get_ref();
        }
        landlock.best_effort = l.best_effort.unwrap_or(false);
        for (list, out) in [
            (l.read, &mut landlock.read),
            (l.exec, &mut landlock.exec),
            (l.write, &mut landlock.write),
        ] {
            for p in list {
                if !p.get_ref().is_absolute() {
                    cx.at(
                        path,
                        &text,
                        p.span(),
                        format!("{:?} is not an absolute path", p.get_ref()),
                    );
                }
                out.push(p.into_inner());
            }
        }
    }
    let seccomp = match raw.seccomp {
        Some(s) => {
            let errno = match s.errno {
                None => Errno::EPERM,
                Some(e) => Errno::resolve(e.get_ref()).unwrap_or_else(|| {
                    cx.at(
                        path,
                        &text,
                        e.span(),
                        format!(
                            "errno {:?} is not one of EPERM, EACCES, ENOSYS, EINVAL",
                            e.get_ref()
                        ),
                    );
                    Errno::EPERM
                }),
            };
            let mut names = s.syscalls;
            for (arch, list) in s.arch {
                if !ARCHES.contains(&arch.as_str()) {
                    cx.at(
                        path,
                        &text,
                        list.span(),
                        format!(
                            "unknown architecture {arch:?} (known: {})",
                            ARCHES.join(", ")
                        ),
                    );
                } else if arch == std::env::consts::ARCH {
                    // Only this machine's list can be checked; another's is kept unread.
                    names.extend(list.into_inner());
                }
            }
            let mut syscalls = Vec::with_capacity(names.len());
            for sc in &names {
                if let Some(resolved) = Syscall::resolve(sc.get_ref()) {
                    syscalls.push(resolved);
                } else {
                    cx.at(
                        path,
                        &text,
                        sc.span(),
                        format!(
                            "unknown syscall {:?} on {} (list one architecture's syscalls under [seccomp.arch])",
                            sc.get_ref(),
                            std::env::consts::ARCH
                        ),
                    );
                }
            }
            SeccompProfile {
                mode: s.mode,
                syscalls,
                errno,
            }
        }
        None => SeccompProfile {
            mode: SeccompMode::Deny,
            syscalls: Vec::new(),
            errno: Errno::EPERM,
        },
    };
    let mut limits = Limits::default();
    if let Some(l) = raw.limits {
        let mut size = |v: Option<Spanned<Size>>, out: &mut u64| {
            if let Some(v) = v {
                match v.get_ref().bytes(&text, v.span()) {
                    Ok(n) => *out = n,
                    Err(m) => cx.at(path, &text, v.span(), m),
                }
            }
        };
        size(l.address_space, &mut limits.address_space_bytes);
        size(l.file_size, &mut limits.file_size_bytes);
        size(l.memory, &mut limits.memory_bytes);
        size(l.staging_size, &mut limits.staging_bytes);
        if let Some(v) = l.staging_files {
            limits.staging_files = v;
        }
        let mut out = limits.output_bytes as u64;
        size(l.output, &mut out);
        limits.output_bytes = out as usize;
        if let Some(v) = l.open_files {
            limits.open_files = v;
        }
        if let Some(v) = l.processes {
            limits.processes = v;
        }
        if let Some(v) = l.cpu {
            match parse_duration(v.get_ref()) {
                Ok(d) if d.as_secs() >= 1 => limits.cpu_seconds = d.as_secs(),
                Ok(_) => cx.at(path, &text, v.span(), "cpu limit must be at least 1s"),
                Err(m) => cx.at(path, &text, v.span(), m),
            }
        }
        if let Some(v) = l.grace {
            match parse_duration(v.get_ref()) {
                Ok(d) if d <= Duration::from_secs(60) => limits.grace = d,
                Ok(_) => cx.at(path, &text, v.span(), "grace must be at most 60s"),
                Err(m) => cx.at(path, &text, v.span(), m),
            }
        }
    }
    let (network, unix_sockets) = match raw.network {
        Some(n) => {
            for p in &n.unix_sockets {
                if !p.get_ref().is_absolute() {
                    cx.at(
                        path,
                        &text,
                        p.span(),
                        format!("unix socket {:?} is not an absolute path", p.get_ref()),
                    );
                }
            }
            let sockets = n.unix_sockets.into_iter().map(Spanned::into_inner);
            (n.allow, sockets.collect())
        }
        None => (false, Vec::new()),
    };
    let env = raw
        .env
        .map(|e| EnvProfile {
            keep: e.keep,
            set: e.set,
        })
        .unwrap_or_default();
    if cx.diags.len() != before {
        return None;
    }
    Some(Profile {
        name,
        landlock,
        seccomp,
        network,
        unix_sockets,
        limits,
        env,
    })
}

// ---- tools/NAME.toml ----------------------------------------------------------------------

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct RawTool {
    name: Spanned<String>,
    title: Option<Spanned<String>>,
    description: Option<String>,
    capability: Capability,
    command: Spanned<Vec<Spanned<String>>>,
    protocol: Option<Protocol>,
    timeout: Option<Spanned<String>>,
    profile: Option<Spanned<String>>,
    #[serde(default)]
    params: BTreeMap<String, Spanned<RawParam>>,
    annotations: Option<RawAnnotations>,
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct RawParam {
    #[serde(rename = "type")]
    ty: ParamType,
    description: Option<String>,
    required: Option<bool>,
    default: Option<toml::Value>,
    path: Option<PathRole>,
    mode: Option<Spanned<String>>,
    secret: Option<Spanned<bool>>,
    env: Option<Spanned<String>>,
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct RawAnnotations {
    destructive: Option<bool>,
    idempotent: Option<bool>,
}

/// The longest `title` a tool may declare.
pub const MAX_TITLE_CHARS: usize = 100;

/// The longest timeout a tool may declare.
pub const MAX_TIMEOUT: Duration = Duration::from_secs(24 * 3600);

type LoadedTool = (Tool, std::ops::Range<usize>, String);

fn load_tool(
    cx: &mut Cx,
    path: &Path,
    profiles: &BTreeMap<String, std::sync::Arc<Profile>>,
) -> Option<LoadedTool> {
    let text = cx.read(path)?;
    let raw: RawTool = cx.parse(path, &text)?;
    let before = cx.diags.len();
    let name = raw.name.get_ref().clone();
    if name.is_empty()
        || !name
            .chars()
            .all(|c| c.is_ascii_alphanumeric() || c == '_' || c == '-')
    {
        cx.at(
            path,
            &text,
            raw.name.span(),
            format!("tool name {name:?} must be letters, digits, '_' or '-'"),
        );
    }
    let mut params = BTreeMap::new();
    // Environment variable to the parameter that sets it.
    let mut envs: BTreeMap<String, String> = BTreeMap::new();
    for (pname, p) in &raw.params {
        if pname == "session" {
            cx.at(path, &text, p.span(), "\"session\" is reserved: every write tool takes it, and {session} names it in command");
            continue;
        }
        let rp = p.get_ref();
        if rp.path.is_some() && rp.ty != ParamType::String {
            cx.at(
                path,
                &text,
                p.span(),
                format!(
                    "path parameter {pname:?} must have type \"string\", not {:?}",
                    rp.ty.as_str()
                ),
            );
        }
        if rp.path == Some(PathRole::Output) && raw.capability == Capability::Read {
            cx.at(
                path,
                &text,
                p.span(),
                format!("output parameter {pname:?} needs capability = \"write\""),
            );
        }
        let default = match &rp.default {
            None => None,
            Some(v) => match serde_json::to_value(v) {
                Ok(v) => Some(v),
                Err(e) => {
                    cx.at(path, &text, p.span(), format!("default of {pname:?}: {e}"));
                    None
                }
            },
        };
        let mode = match &rp.mode {
            None => None,
            Some(m) => match parse_output_mode(m.get_ref(), rp.path) {
                Ok(v) => Some(v),
                Err(msg) => {
                    cx.at(path, &text, m.span(), format!("parameter {pname:?}: {msg}"));
                    None
                }
            },
        };
        let secret = rp.secret.as_ref().is_some_and(|s| *s.get_ref());
        if let (true, Some(s)) = (secret, &rp.secret) {
            // Only a string's value can be found and scrubbed in a message; a path is
            // published and shown by name, so it cannot be a secret.
            if rp.ty != ParamType::String || rp.path.is_some() {
                cx.at(
                    path,
                    &text,
                    s.span(),
                    format!(
                        "secret parameter {pname:?} must be a string that is not a path                          (type = \"string\", no path)"
                    ),
                );
            }
            if default.is_some() {
                cx.at(
                    path,
                    &text,
                    s.span(),
                    format!("secret parameter {pname:?} cannot have a default: tools/list would show it"),
                );
            }
        }
        let env = rp.env.as_ref().map(|e| {
            if let Err(msg) = check_param_env(pname, e.get_ref(), rp.ty, rp.path) {
                cx.at(path, &text, e.span(), msg);
            }
            if let Some(other) = envs.insert(e.get_ref().clone(), pname.clone()) {
                cx.at(
                    path,
                    &text,
                    e.span(),
                    format!(
                        "parameters {other:?} and {pname:?} both set environment variable {:?}",
                        e.get_ref()
                    ),
                );
            }
            e.get_ref().clone()
        });
        params.insert(
            pname.clone(),
            Param {
                ty: rp.ty,
                description: rp.description.clone().unwrap_or_default(),
                required: rp.required.unwrap_or(default.is_none()),
                default,
                path: rp.path,
                mode,
                secret,
                env,
            },
        );
    }
    let command: Vec<String> = raw
        .command
        .get_ref()
        .iter()
        .map(|s| s.get_ref().clone())
        .collect();
    match command.first() {
        None => cx.at(path, &text, raw.command.span(), "command is empty"),
        Some(exe) if !Path::new(exe).is_absolute() => {
            cx.at(
                path,
                &text,
                raw.command.get_ref()[0].span(),
                format!("executable {exe:?} must be an absolute path"),
            );
        }
        Some(_) => {}
    }
    for part in raw.command.get_ref() {
        for ph in placeholders(part.get_ref()) {
            let known =
                params.contains_key(ph) || (ph == "session" && raw.capability == Capability::Write);
            if !known {
                cx.at(
                    path,
                    &text,
                    part.span(),
                    format!("placeholder {{{ph}}} names no parameter"),
                );
            }
            if params.get(ph).is_some_and(|p: &Param| p.secret) {
                cx.at(
                    path,
                    &text,
                    part.span(),
                    format!(
                        "placeholder {{{ph}}} puts secret parameter {ph:?} on the command line, \
                         which every local user can read in /proc/PID/cmdline while the worker \
                         runs; pass it in the worker's environment instead (env = \"NAME\" under \
                         [params.{ph}]), or use protocol = \"json\" (the request on stdin holds it)"
                    ),
                );
            }
        }
    }
    let timeout = match &raw.timeout {
        None => Duration::from_secs(30),
        Some(t) => match parse_duration(t.get_ref()) {
            Ok(d) if d.is_zero() => {
                cx.at(path, &text, t.span(), "timeout must be more than zero");
                Duration::ZERO
            }
            Ok(d) if d > MAX_TIMEOUT => {
                cx.at(path, &text, t.span(), "timeout must be at most 24h");
                d
            }
            Ok(d) => d,
            Err(m) => {
                cx.at(path, &text, t.span(), m);
                Duration::ZERO
            }
        },
    };
    // A title is one short line for a UI: no control characters, at most 100 characters.
    let title = match &raw.title {
        None => None,
        Some(t) => {
            let v = t.get_ref();
            if v.trim().is_empty()
                || v.chars().count() > MAX_TITLE_CHARS
                || v.chars().any(char::is_control)
            {
                cx.at(
                    path,
                    &text,
                    t.span(),
                    format!(
                        "title must be one non-empty line of at most {MAX_TITLE_CHARS} characters"
                    ),
                );
            }
            Some(v.clone())
        }
    };
    let profile = match &raw.profile {
        None => "default".to_string(),
        Some(p) => p.get_ref().clone(),
    };
    let resolved = profiles.get(&profile).cloned();
    if resolved.is_none() {
        let span = raw.profile.as_ref().map_or(raw.name.span(), |p| p.span());
        let known: Vec<&str> = profiles.keys().map(String::as_str).collect();
        cx.at(
            path,
            &text,
            span,
            format!("unknown profile {profile:?} (known: {})", known.join(", ")),
        );
    }
    if let Some(p) = &resolved {
        // The profile's own variables would override, or be overridden by, a parameter's.
        for (pname, rp) in &raw.params {
            let Some(e) = &rp.get_ref().env else { continue };
            let name = e.get_ref();
            if p.env.keep.contains(name) || p.env.set.contains_key(name) {
                cx.at(
                    path,
                    &text,
                    e.span(),
                    format!(
                        "parameter {pname:?}: environment variable {name:?} is also in profile \
                         {profile:?}'s [env]; choose another name"
                    ),
                );
            }
        }
    }
    if cx.diags.len() != before {
        return None;
    }
    let ann = raw.annotations.as_ref();
    let annotations = Annotations {
        read_only: raw.capability == Capability::Read,
        destructive: ann
            .and_then(|a| a.destructive)
            .unwrap_or(raw.capability == Capability::Write),
        idempotent: ann.and_then(|a| a.idempotent).unwrap_or(false),
    };
    let tool = Tool {
        name,
        title,
        description: raw.description.unwrap_or_default(),
        capability: raw.capability,
        kind: ToolKind::External(ExternalTool {
            command,
            protocol: raw.protocol.unwrap_or(Protocol::Argv),
            timeout,
            profile: resolved?,
        }),
        params,
        annotations,
        source: Some(path.to_path_buf()),
    };
    Some((tool, raw.name.span(), text))
}

/// An output's `mode = "0755"`: octal, on an output parameter only, carrying no privilege.
pub fn parse_output_mode(s: &str, role: Option<PathRole>) -> Result<u32, String> {
    if role != Some(PathRole::Output) {
        return Err("mode is only for path = \"output\" parameters".into());
    }
    let m = u32::from_str_radix(s.trim().trim_start_matches("0o"), 8)
        .ok()
        .filter(|m| *m <= 0o7777)
        .ok_or_else(|| format!("mode {s:?} is not an octal mode such as \"0644\""))?;
    if m & FORBIDDEN_OUTPUT_BITS != 0 {
        return Err(format!(
            "mode {s:?} is refused: a published output may not be setuid, setgid, sticky, or group- or other-writable"
        ));
    }
    if m & 0o400 == 0 {
        return Err(format!(
            "mode {s:?} must leave the file readable by its owner"
        ));
    }
    Ok(m)
}

/// Variables a parameter's `env` may not name: the ones the launcher or the dynamic loader
/// give a meaning (`AIRLOCK_*` and `LD_*` by prefix).
const RESERVED_ENV: &[&str] = &["PATH", "HOME", "IFS", "BASH_ENV", "ENV", "SHELL"];

/// A parameter's `env = "NAME"`: `[A-Z_][A-Z0-9_]*`, not reserved, on a string that is not
/// a path (a value the worker's environment can carry as is).
fn check_param_env(
    param: &str,
    name: &str,
    ty: ParamType,
    role: Option<PathRole>,
) -> Result<(), String> {
    let well_formed = name.starts_with(|c: char| c.is_ascii_uppercase() || c == '_')
        && name
            .chars()
            .all(|c| c.is_ascii_uppercase() || c.is_ascii_digit() || c == '_');
    if !well_formed {
        return Err(format!(
            "parameter {param:?}: env {name:?} must be an environment variable name \
             ([A-Z_][A-Z0-9_]*)"
        ));
    }
    if RESERVED_ENV.contains(&name) || name.starts_with("AIRLOCK_") || name.starts_with("LD_") {
        return Err(format!(
            "parameter {param:?}: env {name:?} is reserved (PATH, HOME, IFS, BASH_ENV, ENV, \
             SHELL, AIRLOCK_* and LD_* mean something to the launcher, the shell or the \
             dynamic loader)"
        ));
    }
    if ty != ParamType::String || role.is_some() {
        return Err(format!(
            "parameter {param:?}: env needs a string that is not a path (type = \"string\", \
             no path)"
        ));
    }
    Ok(())
}

/// The `{name}` placeholders in one argv element.
pub fn placeholders(s: &str) -> Vec<&str> {
    let mut out = Vec::new();
    let mut rest = s;
    while let Some(start) = rest.find('{') {
        let after = &rest[start + 1..];
        match after.find('}') {
            Some(end) => {
                let name = &after[..end];
                if !name.is_empty() && name.chars().all(|c| c.is_ascii_alphanumeric() || c == '_') {
                    out.push(name);
                }
                rest = &after[end + 1..];
            }
            None => break,
        }
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn sizes_and_durations() {
        assert_eq!(parse_size("4MiB").unwrap(), 4 << 20);
        assert_eq!(parse_size("512k").unwrap(), 512 << 10);
        assert!(parse_size("4 parsecs").is_err());
        assert_eq!(parse_duration("500ms").unwrap(), Duration::from_millis(500));
        assert_eq!(parse_duration("2m").unwrap(), Duration::from_secs(120));
        assert!(parse_duration("soon").is_err());
    }

    #[test]
    fn output_modes() {
        let out = Some(PathRole::Output);
        assert_eq!(parse_output_mode("0755", out).unwrap(), 0o755);
        assert_eq!(parse_output_mode("0o600", out).unwrap(), 0o600);
        for bad in [
            "4755", "2755", "1755", "0775", "0646", "0777", "0200", "9", "x", "17777",
        ] {
            assert!(parse_output_mode(bad, out).is_err(), "{bad} accepted");
        }
        assert!(parse_output_mode("0644", Some(PathRole::Input)).is_err());
        assert!(parse_output_mode("0644", None).is_err());
    }

    #[test]
    fn uid_ranges() {
        assert_eq!(parse_uid_range("60600-61099").unwrap(), (60600, 61099));
        for bad in ["0-10", "10-5", "65000-66000", "a-b", "5", "1-4294967295"] {
            assert!(parse_uid_range(bad).is_err(), "{bad} accepted");
        }
    }

    #[test]
    fn worker_uid_lock_dirs_are_absolute_paths() {
        let daemon = |extra: &str| with_extra("airlock.toml", &format!("[daemon]\n{extra}"));
        let p = daemon("").expect("valid");
        assert_eq!(
            p.daemon.worker_uid_lock_dir,
            PathBuf::from("/run/airlock/uids")
        );
        let p = daemon("worker_uid_lock_dir = \"/run/x/uids\"\n").expect("valid");
        assert_eq!(p.daemon.worker_uid_lock_dir, PathBuf::from("/run/x/uids"));
        let e = daemon("worker_uid_lock_dir = \"run/uids\"\n").expect_err("relative");
        assert!(
            e.to_string()
                .contains("worker_uid_lock_dir \"run/uids\" must be an absolute path"),
            "{e}"
        );
    }

    #[test]
    fn placeholder_scan() {
        assert_eq!(placeholders("--out={out}.{ext}"), vec!["out", "ext"]);
        assert!(placeholders("{ not one }").is_empty());
    }

    /// The shipped policies with `profiles/extra.toml` added.
    fn with_profile(extra: &str) -> Result<Policy, PolicyErrors> {
        with_extra("profiles/extra.toml", extra)
    }

    /// The shipped policies with `tools/extra.toml` added.
    fn with_tool(extra: &str) -> Result<Policy, PolicyErrors> {
        with_extra("tools/extra.toml", extra)
    }

    /// A copy of the shipped policies with one more file, `rel`, loaded.
    fn with_extra(rel: &str, extra: &str) -> Result<Policy, PolicyErrors> {
        let dir = tempfile::tempdir().expect("tempdir");
        let shipped = Path::new(env!("CARGO_MANIFEST_DIR")).join("policies");
        for sub in ["", "profiles", "tools"] {
            std::fs::create_dir_all(dir.path().join(sub)).expect("mkdir");
            for e in std::fs::read_dir(shipped.join(sub))
                .expect("read_dir")
                .flatten()
            {
                if e.path().is_file() {
                    std::fs::copy(e.path(), dir.path().join(sub).join(e.file_name()))
                        .expect("copy");
                }
            }
        }
        std::fs::write(dir.path().join(rel), extra).expect("write");
        load(dir.path())
    }

    #[test]
    fn titles_are_one_short_line() {
        let tool = |title: &str| {
            format!(
                "name = \"extra\"\ntitle = {title}\ncapability = \"read\"\ncommand = [\"/bin/true\"]\n"
            )
        };
        let p = with_tool(&tool("\"Extra tool\"")).expect("valid");
        assert_eq!(p.tools["extra"].title.as_deref(), Some("Extra tool"));
        assert_eq!(p.tools["session_get"].title.as_deref(), Some("Get session"));
        for bad in [
            "\"\"",
            "\"two\\nlines\"",
            &format!("\"{}\"", "x".repeat(101)),
        ] {
            let e = with_tool(&tool(bad)).expect_err(bad).to_string();
            assert!(
                e.contains("extra.toml:2:") && e.contains("title must be"),
                "{bad}: {e}"
            );
        }
    }

    #[test]
    fn profiles_need_landlock_abi_6_for_the_scopes() {
        let e = with_profile("[landlock]\nabi = 5\n").expect_err("abi 5 accepted");
        let text = e.to_string();
        assert!(text.contains("extra.toml:2:"), "{text}");
        assert!(text.contains("workers need ABI 6 at least"), "{text}");
        assert!(with_profile("[landlock]\nabi = 7\n").is_ok());
    }

    #[test]
    fn unix_sockets_are_absolute_paths() {
        let p = with_profile("[network]\nunix_sockets = [\"/run/a.sock\"]\n").expect("valid");
        assert_eq!(
            p.profiles["extra"].unix_sockets,
            vec![PathBuf::from("/run/a.sock")]
        );
        assert!(!p.profiles["extra"].network);
        assert!(p.profiles["default"].unix_sockets.is_empty());
        let e = with_profile("[network]\nunix_sockets = [\"run/a.sock\"]\n").expect_err("relative");
        assert!(e.to_string().contains("is not an absolute path"), "{e}");
    }

    #[test]
    fn seccomp_names_are_resolved_to_numbers_at_load() {
        let p = with_profile(
            "[seccomp]\nmode = \"deny\"\nsyscalls = [\"ptrace\", \"mount\"]\nerrno = \"EACCES\"\n",
        )
        .expect("valid");
        let sc = &p.profiles["extra"].seccomp;
        let got: Vec<(&str, i64)> = sc.syscalls.iter().map(|c| (c.name(), c.nr())).collect();
        assert_eq!(
            got,
            vec![("ptrace", libc::SYS_ptrace), ("mount", libc::SYS_mount)]
        );
        assert_eq!(
            (sc.errno.name(), sc.errno.number()),
            ("EACCES", libc::EACCES)
        );
        // No errno given: EPERM.
        let p = with_profile("[seccomp]\nmode = \"deny\"\nsyscalls = []\n").expect("valid");
        assert_eq!(p.profiles["extra"].seccomp.errno, Errno::EPERM);
    }

    #[test]
    fn bad_seccomp_names_are_refused_at_load_with_file_and_line() {
        let e = with_profile(
            "[seccomp]\nmode = \"deny\"\nsyscalls = [\"ptrace\"]\nerrno = \"EWHATEVER\"\n",
        )
        .expect_err("a bad errno accepted")
        .to_string();
        assert!(e.contains("extra.toml:4:"), "{e}");
        assert!(
            e.contains("errno \"EWHATEVER\" is not one of EPERM, EACCES, ENOSYS, EINVAL"),
            "{e}"
        );
        let e = with_profile("[seccomp]\nmode = \"deny\"\nsyscalls = [\"ptrace\", \"nonsense\"]\n")
            .expect_err("an unknown syscall accepted")
            .to_string();
        assert!(e.contains("extra.toml:3:"), "{e}");
        assert!(e.contains("unknown syscall \"nonsense\""), "{e}");
    }

    #[test]
    fn per_principal_bounds_load_with_defaults_and_are_checked_with_file_and_line() {
        let daemon = |lines: &str| with_extra("airlock.toml", &format!("[daemon]\n{lines}"));
        let d = daemon("").expect("valid").daemon;
        assert_eq!(
            (
                d.max_sessions_per_principal,
                d.max_session_state_bytes,
                d.max_state_bytes_per_principal
            ),
            (64, 1 << 20, 16 << 20)
        );
        assert_eq!(
            (d.max_calls_per_principal, d.max_queued_per_principal),
            (16, 256)
        );
        // The share follows max_concurrent_calls when not set.
        let d = daemon("max_concurrent_calls = 6\n").expect("valid").daemon;
        assert_eq!(d.max_calls_per_principal, 1);
        let d = daemon(
            "max_concurrent_calls = 8\nmax_calls_per_principal = 3\nmax_queued_per_principal = 0\n\
             max_sessions_per_principal = 5\nmax_session_state_bytes = \"64KiB\"\n\
             max_state_bytes_per_principal = \"1MiB\"\n",
        )
        .expect("valid")
        .daemon;
        assert_eq!(
            (d.max_calls_per_principal, d.max_queued_per_principal),
            (3, 0)
        );
        assert_eq!(
            (
                d.max_sessions_per_principal,
                d.max_session_state_bytes,
                d.max_state_bytes_per_principal
            ),
            (5, 64 << 10, 1 << 20)
        );
        for (lines, at, says) in [
            ("max_sessions_per_principal = 0\n", 2, "max_sessions_per_principal must be at least 1"),
            ("max_session_state_bytes = \"10\"\n", 2, "max_session_state_bytes must be at least 1KiB"),
            (
                "max_session_state_bytes = \"2MiB\"\nmax_state_bytes_per_principal = \"1MiB\"\n",
                3,
                "max_state_bytes_per_principal (1048576) must be at least max_session_state_bytes (2097152)",
            ),
            (
                "max_concurrent_calls = 4\nmax_calls_per_principal = 5\n",
                3,
                "max_calls_per_principal (5) must be between 1 and max_concurrent_calls (4)",
            ),
            ("max_calls_per_principal = 0\n", 2, "max_calls_per_principal (0) must be between 1"),
        ] {
            let e = daemon(lines).expect_err(lines).to_string();
            assert!(e.contains(&format!("airlock.toml:{at}:")) && e.contains(says), "{lines}: {e}");
        }
    }

    #[test]
    fn line_and_column() {
        assert_eq!(line_col("a\nbc\nd", 3), (2, 2));
        assert_eq!(line_col("abc", 0), (1, 1));
    }

    /// A secret's placeholder in `command` is refused at its place, naming the parameter
    /// and the ways in that are not the command line; `env` is the one for `argv` tools, and
    /// its name is checked.
    #[test]
    fn secret_params_never_reach_the_command_line() {
        let tool = |command: &str, token: &str| {
            format!(
                "name = \"extra\"\ncapability = \"read\"\ncommand = {command}\n\n[params.token]\ntype = \"string\"\nsecret = true\n{token}"
            )
        };
        let e = with_tool(&tool(r#"["/bin/sh", "-c", "use {token}"]"#, ""))
            .expect_err("a secret on the command line accepted")
            .to_string();
        assert!(e.contains("extra.toml:3:29: placeholder {token}"), "{e}");
        for want in [
            "secret parameter \"token\"",
            "/proc/PID/cmdline",
            "env = \"NAME\"",
            "protocol = \"json\"",
        ] {
            assert!(e.contains(want), "{want}: {e}");
        }
        // Also for a json tool, whose request already holds it.
        let json = tool(r#"["/bin/t", "{token}"]"#, "")
            .replace("capability", "protocol = \"json\"\ncapability");
        assert!(with_tool(&json).is_err());
        let p = with_tool(&tool(r#"["/bin/t"]"#, "env = \"API_TOKEN\"\n")).expect("valid");
        assert_eq!(
            p.tools["extra"].params["token"].env.as_deref(),
            Some("API_TOKEN")
        );
        for (bad, why) in [
            ("api_token", "must be an environment variable name"),
            ("1TOKEN", "must be an environment variable name"),
            ("PATH", "is reserved"),
            ("LD_PRELOAD", "is reserved"),
            ("AIRLOCK_PROGRESS_FD", "is reserved"),
            ("TZ", "also in profile \"default\"'s [env]"),
        ] {
            let e = with_tool(&tool(r#"["/bin/t"]"#, &format!("env = \"{bad}\"\n")))
                .expect_err(bad)
                .to_string();
            assert!(
                e.contains("extra.toml:8:7: ") && e.contains(why),
                "{bad}: {e}"
            );
        }
        let two = tool(r#"["/bin/t"]"#, "env = \"T\"\n")
            + "\n[params.other]\ntype = \"string\"\nenv = \"T\"\n";
        let e = with_tool(&two).expect_err("one variable twice").to_string();
        assert!(e.contains("both set environment variable \"T\""), "{e}");
        let path = "name = \"extra\"\ncapability = \"read\"\ncommand = [\"/bin/t\"]\n\n[params.p]\ntype = \"string\"\npath = \"input\"\nenv = \"P\"\n";
        let e = with_tool(path).expect_err("a path in env").to_string();
        assert!(e.contains("env needs a string that is not a path"), "{e}");
    }
}
