//! `policy check` and `policy explain`, and the policy load the daemon commands share.

use std::path::Path;

use super::Exit;
use crate::policy::{self, DaemonIdentity, Policy};

/// A path given for `--policies` that is not a policy directory: `airlock: PATH: what is
/// missing`, before anything is read or created.
pub(super) fn require_dir(dir: &Path, code: Exit) -> Result<(), Exit> {
    policy::check_dir(dir).map_err(|d| {
        eprintln!("airlock: {d}");
        code
    })
}

pub(super) fn load_policy(dir: &Path) -> Result<Policy, Exit> {
    require_dir(dir, Exit::Error)?;
    policy::load(dir).map_err(|e| {
        for d in &e.0 {
            eprintln!("airlock: {d}");
        }
        eprintln!(
            "airlock: {}: {} error(s); nothing was started",
            dir.display(),
            e.0.len()
        );
        Exit::Error
    })
}

/// Whom `@daemon` means for `policy check|explain`, and the line that says why.
fn daemon_identity(dir: &Path, as_user: Option<&str>) -> Result<(DaemonIdentity, String), Exit> {
    use nix::unistd::{Uid, User};
    let lookup = |name: &str| -> nix::Result<Option<User>> {
        match name.parse::<u32>() {
            Ok(uid) => User::from_uid(Uid::from_raw(uid)),
            Err(_) => User::from_name(name),
        }
    };
    let (user, why) = if let Some(name) = as_user {
        match lookup(name) {
            Ok(Some(u)) => (u, "given by --as".to_string()),
            Ok(None) => {
                eprintln!("airlock: --as {name}: no such user on this system");
                return Err(Exit::Error);
            }
            Err(e) => {
                eprintln!(
                    "airlock: --as {name}: cannot look the user up: {}",
                    crate::report::chain(&e)
                );
                return Err(Exit::Error);
            }
        }
    } else {
        let unit = super::unit::installed().filter(|u| super::unit::serves(u, dir));
        match unit
            .as_ref()
            .and_then(|u| u.user.as_deref().map(|n| (u, n)))
        {
            Some((u, name)) => match lookup(name) {
                Ok(Some(found)) => (found, format!("the User= of {}", u.path.display())),
                Ok(None) | Err(_) => {
                    eprintln!(
                        "airlock: {}: User={name}: no such user on this system (give --as USER)",
                        u.path.display()
                    );
                    return Err(Exit::Error);
                }
            },
            None => {
                let uid = rustix::process::geteuid().as_raw();
                let why = match &unit {
                    Some(u) => format!("the user running this command ({} sets no User=)", u.path.display()),
                    None => "the user running this command (no installed airlock.service serves this policy directory)".to_string(),
                };
                match User::from_uid(Uid::from_raw(uid)) {
                    Ok(Some(u)) => (u, why),
                    _ => {
                        let gid = rustix::process::getegid().as_raw();
                        let id = DaemonIdentity { uid, gid };
                        return Ok((
                            id,
                            format!(
                                "grants resolved for uid {uid}, {why}; --as USER to choose another"
                            ),
                        ));
                    }
                }
            }
        }
    };
    let id = DaemonIdentity {
        uid: user.uid.as_raw(),
        gid: user.gid.as_raw(),
    };
    Ok((
        id,
        format!(
            "grants resolved for user {} (uid {}), {why}; --as USER to choose another",
            user.name, id.uid
        ),
    ))
}

pub(super) fn check(dir: &Path, as_user: Option<&str>) -> Exit {
    if let Err(code) = require_dir(dir, Exit::Failed) {
        return code;
    }
    let (daemon, said) = match daemon_identity(dir, as_user) {
        Ok(d) => d,
        Err(code) => return code,
    };
    // The errors first, where a reader (and a test, or a script) looks for them; the user
    // the grants were resolved for first on success.
    let policy = match policy::load_for(dir, daemon) {
        Ok(p) => p,
        Err(e) => {
            for d in &e.0 {
                println!("{d}");
            }
            println!("{said}");
            println!("{} error(s)", e.0.len());
            return Exit::Failed;
        }
    };
    println!("{said}");
    println!(
        "{:<22} {:<10} {:<8} {:<10} {:>8}  PATH PARAMS",
        "TOOL", "CAPABILITY", "PROTOCOL", "PROFILE", "TIMEOUT"
    );
    for t in policy.tools.values() {
        let (protocol, profile, timeout) = match &t.kind {
            policy::ToolKind::External(e) => (
                e.protocol.as_str(),
                e.profile.name.as_str(),
                format!("{:?}", e.timeout),
            ),
            policy::ToolKind::Builtin(_) => ("builtin", "-", "-".to_string()),
        };
        let paths: Vec<String> = t
            .params
            .iter()
            .filter_map(|(n, p)| {
                p.path.map(|r| {
                    format!(
                        "{n}({})",
                        match r {
                            policy::PathRole::Input => "in",
                            policy::PathRole::Output => "out",
                            policy::PathRole::InOut => "inout",
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
    println!("GRANT{:<17} CAPABILITIES{:<10} SUBJECTS", "", "");
    for g in &policy.grants {
        println!(
            "{:<22} {:<22} {}{}",
            g.origin,
            g.rights
                .iter()
                .map(|r| r.as_str())
                .collect::<Vec<_>>()
                .join(","),
            g.subjects.join(", "),
            g.tools.as_ref().map_or(String::new(), |t| format!(
                " (tools: {})",
                t.iter().cloned().collect::<Vec<_>>().join(", ")
            ))
        );
    }
    if policy.grants.is_empty() {
        println!("(no [[grant]]: no principal may call anything)");
    }
    for t in policy.tools.values() {
        if let Some(note) = no_output_note(t) {
            println!("{note}");
        }
    }
    println!(
        "ok: {} tools, {} profiles, {} grants",
        policy.tools.len(),
        policy.profiles.len(),
        policy.grants.len()
    );
    Exit::Ok
}

pub(super) fn explain(dir: &Path, name: &str, as_user: Option<&str>) -> Exit {
    if let Err(code) = require_dir(dir, Exit::Error) {
        return code;
    }
    let (daemon, said) = match daemon_identity(dir, as_user) {
        Ok(d) => d,
        Err(code) => return code,
    };
    let policy = match policy::load_for(dir, daemon) {
        Ok(p) => p,
        Err(e) => {
            for d in &e.0 {
                eprintln!("airlock: {d}");
            }
            eprintln!("airlock: {}: {} error(s)", dir.display(), e.0.len());
            return Exit::Error;
        }
    };
    println!("{said}");
    let Some(tool) = policy.tools.get(name) else {
        eprintln!("airlock: no tool {name:?} in {}", dir.display());
        return Exit::Error;
    };
    println!(
        "tool {} ({}, {})",
        tool.name,
        tool.capability.as_str(),
        tool.source
            .as_ref()
            .map_or("built-in".into(), |p| p.display().to_string())
    );
    let need = policy::Right::for_capability(tool.capability);
    let who: Vec<&policy::Grant> = policy.grants_for(tool).collect();
    if who.is_empty() {
        println!(
            "  who may call it: nobody (no [[grant]] gives {:?} for it)",
            need.as_str()
        );
    } else {
        println!("  who may call it ({:?} capability):", need.as_str());
        for g in who {
            println!("    {} ({})", g.subjects.join(", "), g.origin);
        }
    }
    if tool.takes_session()
        || matches!(
            tool.kind,
            policy::ToolKind::Builtin(policy::Builtin::SessionGet)
        )
    {
        println!("  sessions: only the session's creator, or a principal with \"admin\"");
    }
    let policy::ToolKind::External(ext) = &tool.kind else {
        println!("  runs inside the daemon: no worker, no sandbox");
        return Exit::Ok;
    };
    match &ext.python {
        Some(p) => {
            println!("  entry:    {}", p.entry);
            println!(
                "  python:   {} -I -B, running airlock's runner (src/exec/python_runner.py)",
                p.interpreter.display()
            );
            if p.path.is_empty() {
                println!("  python_path: (none)");
            }
            for d in &p.path {
                println!(
                    "  python_path: {} (first on sys.path; read-only to the worker)",
                    d.display()
                );
            }
        }
        None => println!(
            "  command:  {}",
            ext.command
                .written()
                .iter()
                .map(|a| shell_quoted(a))
                .collect::<Vec<_>>()
                .join(" ")
        ),
    }
    println!("  protocol: {}", ext.protocol.as_str());
    println!(
        "  timeout:  {:?} (then SIGTERM to the group, the grace, SIGKILL)",
        ext.timeout
    );
    for (n, p) in &tool.params {
        match p.path {
            Some(policy::PathRole::Input) => println!("  param {n}: workspace path, readable by the worker"),
            Some(policy::PathRole::Output) if p.kind == policy::OutputKind::Directory => println!("  param {n}: workspace path, a directory output: an empty directory in a private staging dir, its whole tree checked (regular files, directories, symlinks staying inside it) and published by one rename on success"),
            Some(policy::PathRole::Output) => println!("  param {n}: workspace path, written to a private staging dir, published on success"),
            Some(policy::PathRole::InOut) => println!("  param {n}: workspace path, a private copy edited in staging: published if changed, the target deleted if removed, CONFLICT if changed meanwhile"),
            None if p.secret => println!(
                "  param {n}: {} value, secret (redacted in audit events, logs and errors)",
                p.ty.as_str()
            ),
            None => println!("  param {n}: {} value", p.ty.as_str()),
        }
    }
    print!("{}", crate::sandbox::explain(&ext.profile));
    Exit::Ok
}

/// The warning `policy check` prints for an external write tool that declares no output
/// parameter: the sandbox gives it nothing to write, so it can change nothing.
fn no_output_note(t: &policy::Tool) -> Option<String> {
    let policy::ToolKind::External(ext) = &t.kind else {
        return None;
    };
    let writes = t.capability == policy::Capability::Write;
    let outputs = t
        .params
        .values()
        .any(|p| p.path.is_some_and(policy::PathRole::writes));
    (writes && !outputs).then(|| {
        format!(
            "warning: tool {}: declares no output: its inputs are read-only to the worker; \
             it can change nothing in the workspace{} (declare a parameter with \
             path = \"output\" for each file it writes)",
            t.name,
            if matches!(
                ext.protocol,
                policy::Protocol::Json | policy::Protocol::Python
            ) {
                ", only its session's state"
            } else {
                ""
            }
        )
    })
}

/// `arg` as a POSIX shell would need it written to stay one word: as it is when it holds
/// only characters no shell treats specially, else in single quotes (a `'` as `'\''`).
fn shell_quoted(arg: &str) -> String {
    let plain = !arg.is_empty()
        && arg
            .bytes()
            .all(|b| b.is_ascii_alphanumeric() || b"@%+=:./_-{}".contains(&b));
    if plain {
        arg.to_string()
    } else {
        format!("'{}'", arg.replace('\'', "'\\''"))
    }
}

#[cfg(test)]
mod tests {
    use super::shell_quoted;

    #[test]
    fn argv_elements_are_quoted_as_a_shell_would_need() {
        assert_eq!(shell_quoted("/bin/sh"), "/bin/sh");
        assert_eq!(shell_quoted("{out}"), "{out}");
        assert_eq!(shell_quoted("-c"), "-c");
        assert_eq!(shell_quoted("echo hi > \"$2\""), "'echo hi > \"$2\"'");
        assert_eq!(shell_quoted("it's"), "'it'\\''s'");
        assert_eq!(shell_quoted(""), "''");
        assert_eq!(shell_quoted("a b"), "'a b'");
        assert_eq!(shell_quoted("*"), "'*'");
    }
}
