//! Reading and validating the policy directory. Every problem is collected, with the file,
//! line and column it comes from, before the daemon serves anything.

use std::collections::BTreeMap;
use std::fmt;
use std::path::{Path, PathBuf};

use super::model::*;

mod daemon;
mod grant;
mod profile;
#[cfg(test)]
mod tests;
mod tool;
mod units;

use daemon::load_daemon;
use grant::load_grants;
use profile::load_profile;
use tool::load_tool;
use units::Size;
pub use units::{parse_duration, parse_size, DurationError, SizeError};

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
    let mut tools = crate::policy::builtins();
    for path in toml_files(&mut cx, &dir.join("tools")) {
        if let Some((tool, name_span, text)) = load_tool(&mut cx, &path, dir, &profiles) {
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
    fn file(&mut self, file: &Path, message: impl fmt::Display) {
        self.diags.push(Diagnostic {
            file: file.to_path_buf(),
            line: 0,
            col: 0,
            message: message.to_string(),
        });
    }

    fn at(
        &mut self,
        file: &Path,
        text: &str,
        span: std::ops::Range<usize>,
        message: impl fmt::Display,
    ) {
        let (line, col) = line_col(text, span.start);
        self.diags.push(Diagnostic {
            file: file.to_path_buf(),
            line,
            col,
            message: message.to_string(),
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
