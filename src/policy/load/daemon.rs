//! The `[daemon]` table of `airlock.toml`: the daemon's own settings and bounds.

use std::path::{Path, PathBuf};
use std::time::Duration;

use serde::Deserialize;
use toml::Spanned;

use super::*;

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct RawDaemonFile {
    daemon: Option<RawDaemon>,
    /// Read by [`load_grants`], once the tools are known.
    #[serde(default, rename = "grant")]
    _grant: Option<toml::Value>,
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
    idempotency_ttl: Option<Spanned<String>>,
    idempotency_keys: Option<Spanned<usize>>,
    undo_bytes: Option<Spanned<Size>>,
}

pub(super) fn load_daemon(cx: &mut Cx, path: &Path) -> Option<DaemonConfig> {
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
        ("undo_bytes", r.undo_bytes, 0, &mut d.undo_bytes),
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
    if let Some(v) = r.idempotency_ttl {
        match parse_duration(v.get_ref()) {
            Ok(t) if t >= Duration::from_secs(1) && t <= Duration::from_secs(30 * 86_400) => {
                d.idempotency_ttl = t
            }
            Ok(_) => cx.at(
                path,
                &text,
                v.span(),
                "idempotency_ttl must be between 1s and 720h",
            ),
            Err(m) => cx.at(path, &text, v.span(), m),
        }
    }
    if let Some(v) = r.idempotency_keys {
        match *v.get_ref() {
            0 => cx.at(path, &text, v.span(), "idempotency_keys must be at least 1"),
            n => d.idempotency_keys = n,
        }
    }
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
    d.max_calls_per_principal =
        crate::policy::model::default_calls_per_principal(d.max_concurrent_calls);
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
pub fn parse_uid_range(s: &str) -> Result<(u32, u32), UidRangeError> {
    let bad = || UidRangeError::Malformed {
        text: s.to_string(),
    };
    let (a, b) = s.trim().split_once('-').ok_or_else(bad)?;
    let a: u32 = a.trim().parse().map_err(|_| bad())?;
    let b: u32 = b.trim().parse().map_err(|_| bad())?;
    if a == 0 || a > b {
        return Err(bad());
    }
    // 65534 is nobody and u32::MAX is "no uid": neither may be a worker.
    if (a..=b).contains(&65534) || b == u32::MAX {
        return Err(UidRangeError::Reserved {
            text: s.to_string(),
        });
    }
    Ok((a, b))
}

/// Why `worker_uids` as written is refused; `text` is what was written.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum UidRangeError {
    #[error("worker_uids {text:?} must be a range such as \"60600-61099\"")]
    Malformed { text: String },
    #[error("worker_uids {text:?} must not contain 65534 (nobody) or 4294967295")]
    Reserved { text: String },
}
