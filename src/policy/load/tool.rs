//! `tools/NAME.toml`: a tool's declaration, its parameters and its command template.

use std::collections::BTreeMap;
use std::path::Path;
use std::time::Duration;

use serde::Deserialize;
use toml::Spanned;

use super::*;
use crate::policy::command::{Command, Piece};

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct RawTool {
    name: Spanned<String>,
    title: Option<Spanned<String>>,
    description: Option<String>,
    capability: Capability,
    command: Option<Spanned<Vec<Spanned<String>>>>,
    protocol: Option<Spanned<Protocol>>,
    /// `protocol = "python"`: `package.module:function`.
    entry: Option<Spanned<String>>,
    /// `protocol = "python"`: the interpreter (absolute).
    python: Option<Spanned<String>>,
    /// `protocol = "python"`: directories put first on `sys.path`.
    python_path: Option<Spanned<Vec<Spanned<String>>>>,
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
    kind: Option<Spanned<String>>,
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

pub(super) type LoadedTool = (Tool, std::ops::Range<usize>, String);

pub(super) fn load_tool(
    cx: &mut Cx,
    path: &Path,
    policy_dir: &Path,
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
        if rp.path.is_some_and(PathRole::writes) && raw.capability == Capability::Read {
            cx.at(
                path,
                &text,
                p.span(),
                format!(
                    "{} parameter {pname:?} needs capability = \"write\"",
                    rp.path.map_or("output", PathRole::as_str)
                ),
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
        let kind = match &rp.kind {
            None => OutputKind::File,
            Some(k) => match parse_output_kind(k.get_ref(), rp.path) {
                Ok(v) => v,
                Err(msg) => {
                    cx.at(path, &text, k.span(), format!("parameter {pname:?}: {msg}"));
                    OutputKind::File
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
                kind,
                secret,
                env,
            },
        );
    }
    let protocol = raw
        .protocol
        .as_ref()
        .map_or(Protocol::Argv, |p| *p.get_ref());
    let (template, python) = if protocol == Protocol::Python {
        let python = python_entry(cx, path, &text, &raw, policy_dir);
        let template = python
            .as_ref()
            .map(crate::exec::python_command)
            .unwrap_or_default();
        (template, python)
    } else {
        for (key, span) in [
            ("entry", raw.entry.as_ref().map(|e| e.span())),
            ("python", raw.python.as_ref().map(|e| e.span())),
            ("python_path", raw.python_path.as_ref().map(|e| e.span())),
        ] {
            if let Some(span) = span {
                cx.at(
                    path,
                    &text,
                    span,
                    format!("{key} is only for protocol = \"python\" tools"),
                );
            }
        }
        (command_template(cx, path, &text, &raw, &params), None)
    };
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
            command: template,
            protocol,
            timeout,
            profile: resolved?,
            python,
        }),
        params,
        annotations,
        source: Some(path.to_path_buf()),
    };
    Some((tool, raw.name.span(), text))
}

/// An `argv` or `json` tool's `command`: present, its executable absolute, every placeholder
/// naming a parameter (or `session` for a write tool), no secret on the command line.
fn command_template(
    cx: &mut Cx,
    path: &Path,
    text: &str,
    raw: &RawTool,
    params: &BTreeMap<String, Param>,
) -> Command {
    let Some(raw_command) = &raw.command else {
        cx.at(
            path,
            text,
            raw.name.span(),
            "command is missing (an argv or json tool runs a command; a python tool names \
             its entry with protocol = \"python\")",
        );
        return Command::default();
    };
    let command: Vec<String> = raw_command
        .get_ref()
        .iter()
        .map(|s| s.get_ref().clone())
        .collect();
    match command.first() {
        None => cx.at(path, text, raw_command.span(), "command is empty"),
        Some(exe) if !Path::new(exe).is_absolute() => {
            cx.at(
                path,
                text,
                raw_command.get_ref()[0].span(),
                format!("executable {exe:?} must be an absolute path"),
            );
        }
        Some(_) => {}
    }
    // Parsed once, here: the checks below and every call use the same pieces.
    let template = Command::parse(&command);
    for (part, pieces) in raw_command.get_ref().iter().zip(template.elements()) {
        for ph in pieces.iter().filter_map(|p| match p {
            Piece::Param(n) => Some(n.as_str()),
            Piece::Lit(_) => None,
        }) {
            let known =
                params.contains_key(ph) || (ph == "session" && raw.capability == Capability::Write);
            if !known {
                cx.at(
                    path,
                    text,
                    part.span(),
                    format!("placeholder {{{ph}}} names no parameter"),
                );
            }
            if params.get(ph).is_some_and(|p: &Param| p.secret) {
                cx.at(
                    path,
                    text,
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
    template
}

/// A `protocol = "python"` tool's `entry`, `python` and `python_path`, checked: no
/// `command`, an entry of dotted identifiers with one colon, an absolute interpreter, and
/// each `python_path` an existing directory (a relative one is beneath the policy
/// directory). `None` after reporting what is wrong.
fn python_entry(
    cx: &mut Cx,
    path: &Path,
    text: &str,
    raw: &RawTool,
    policy_dir: &Path,
) -> Option<PythonEntry> {
    let before = cx.diags.len();
    if let Some(c) = &raw.command {
        cx.at(
            path,
            text,
            c.span(),
            "a python tool has no command: airlock runs its entry with its own runner \
             (remove command, or use protocol = \"json\")",
        );
    }
    let entry = match &raw.entry {
        None => {
            let span = raw.protocol.as_ref().map_or(raw.name.span(), |p| p.span());
            cx.at(
                path,
                text,
                span,
                "protocol = \"python\" needs entry = \"package.module:function\"",
            );
            String::new()
        }
        Some(e) => {
            if let Err(err) = check_entry(e.get_ref()) {
                cx.at(path, text, e.span(), err);
            }
            e.get_ref().clone()
        }
    };
    let interpreter = match &raw.python {
        None => std::path::PathBuf::from(DEFAULT_PYTHON),
        Some(p) => {
            let v = std::path::PathBuf::from(p.get_ref());
            if !v.is_absolute() {
                cx.at(
                    path,
                    text,
                    p.span(),
                    format!("python {:?} must be an absolute path", p.get_ref()),
                );
            }
            v
        }
    };
    let mut dirs = Vec::new();
    for d in raw.python_path.iter().flat_map(|l| l.get_ref()) {
        let written = std::path::Path::new(d.get_ref());
        let joined = policy_dir.join(written);
        match std::fs::canonicalize(&joined) {
            Ok(abs) if abs.is_dir() => dirs.push(abs),
            Ok(_) => cx.at(
                path,
                text,
                d.span(),
                format!("python_path {:?} is not a directory", d.get_ref()),
            ),
            Err(e) => cx.at(
                path,
                text,
                d.span(),
                format!(
                    "python_path {:?} ({}): {e} (a relative entry is beneath the policy \
                     directory)",
                    d.get_ref(),
                    joined.display()
                ),
            ),
        }
    }
    (cx.diags.len() == before).then_some(PythonEntry {
        entry,
        interpreter,
        path: dirs,
    })
}

/// Why an `entry` is refused.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum EntryError {
    #[error(
        "entry {0:?} must be \"package.module:function\": one colon between a module and a name"
    )]
    NoColon(String),
    #[error(
        "entry {entry:?}: {part:?} is not a Python identifier (letters, digits and '_', not \
         starting with a digit; parts separated by '.')"
    )]
    NotAnIdentifier { entry: String, part: String },
}

/// `package.module:function`: dotted identifiers on each side of exactly one colon.
pub fn check_entry(entry: &str) -> Result<(), EntryError> {
    let Some((module, attr)) = entry.split_once(':') else {
        return Err(EntryError::NoColon(entry.to_string()));
    };
    if attr.contains(':') {
        return Err(EntryError::NoColon(entry.to_string()));
    }
    let identifier = |s: &str| {
        s.starts_with(|c: char| c.is_ascii_alphabetic() || c == '_')
            && s.chars().all(|c| c.is_ascii_alphanumeric() || c == '_')
    };
    for part in module.split('.').chain(attr.split('.')) {
        if !identifier(part) {
            return Err(EntryError::NotAnIdentifier {
                entry: entry.to_string(),
                part: part.to_string(),
            });
        }
    }
    Ok(())
}

/// An output's `kind = "directory"` (or `"file"`, the default): on an output parameter only.
pub fn parse_output_kind(s: &str, role: Option<PathRole>) -> Result<OutputKind, KindError> {
    if !role.is_some_and(PathRole::writes) {
        return Err(KindError::NotAnOutput);
    }
    match s {
        "file" => Ok(OutputKind::File),
        "directory" => Ok(OutputKind::Directory),
        _ => Err(KindError::Unknown {
            text: s.to_string(),
        }),
    }
}

/// Why an output's `kind` is refused; `text` is what was written.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum KindError {
    #[error("kind is only for path = \"output\" and path = \"inout\" parameters")]
    NotAnOutput,
    #[error("kind {text:?} is not \"file\" or \"directory\"")]
    Unknown { text: String },
}

/// An output's `mode = "0755"`: octal, on an output parameter only, carrying no privilege.
pub fn parse_output_mode(s: &str, role: Option<PathRole>) -> Result<u32, ModeError> {
    if !role.is_some_and(PathRole::writes) {
        return Err(ModeError::NotAnOutput);
    }
    let text = || s.to_string();
    let m = u32::from_str_radix(s.trim().trim_start_matches("0o"), 8)
        .ok()
        .filter(|m| *m <= 0o7777)
        .ok_or_else(|| ModeError::NotOctal { text: text() })?;
    if m & FORBIDDEN_OUTPUT_BITS != 0 {
        return Err(ModeError::Privileged { text: text() });
    }
    if m & 0o400 == 0 {
        return Err(ModeError::OwnerCannotRead { text: text() });
    }
    Ok(m)
}

/// Why an output's `mode` is refused; `text` is what was written.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum ModeError {
    #[error("mode is only for path = \"output\" and path = \"inout\" parameters")]
    NotAnOutput,
    #[error("mode {text:?} is not an octal mode such as \"0644\"")]
    NotOctal { text: String },
    #[error("mode {text:?} is refused: a published output may not be setuid, setgid, sticky, or group- or other-writable")]
    Privileged { text: String },
    #[error("mode {text:?} must leave the file readable by its owner")]
    OwnerCannotRead { text: String },
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
) -> Result<(), EnvNameError> {
    let well_formed = name.starts_with(|c: char| c.is_ascii_uppercase() || c == '_')
        && name
            .chars()
            .all(|c| c.is_ascii_uppercase() || c.is_ascii_digit() || c == '_');
    let (param, name) = (param.to_string(), name.to_string());
    if !well_formed {
        return Err(EnvNameError::Malformed { param, name });
    }
    if RESERVED_ENV.contains(&name.as_str())
        || name.starts_with("AIRLOCK_")
        || name.starts_with("LD_")
    {
        return Err(EnvNameError::Reserved { param, name });
    }
    if ty != ParamType::String || role.is_some() {
        return Err(EnvNameError::NotAPlainString { param });
    }
    Ok(())
}

/// Why a parameter's `env = "NAME"` is refused.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
enum EnvNameError {
    #[error(
        "parameter {param:?}: env {name:?} must be an environment variable name \
         ([A-Z_][A-Z0-9_]*)"
    )]
    Malformed { param: String, name: String },
    #[error(
        "parameter {param:?}: env {name:?} is reserved (PATH, HOME, IFS, BASH_ENV, ENV, \
         SHELL, AIRLOCK_* and LD_* mean something to the launcher, the shell or the \
         dynamic loader)"
    )]
    Reserved { param: String, name: String },
    #[error(
        "parameter {param:?}: env needs a string that is not a path (type = \"string\", \
         no path)"
    )]
    NotAPlainString { param: String },
}
