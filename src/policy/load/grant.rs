//! The `[[grant]]` tables of `airlock.toml`: who may call what.

use std::collections::BTreeMap;
use std::path::Path;

use serde::Deserialize;
use toml::Spanned;

use super::*;

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
fn resolve_subject(name: &str, group: bool, daemon: DaemonIdentity) -> Result<u32, SubjectError> {
    if name == DAEMON_USER {
        return Ok(if group { daemon.gid } else { daemon.uid });
    }
    let found = if group {
        nix::unistd::Group::from_name(name).map(|g| g.map(|g| g.gid.as_raw()))
    } else {
        nix::unistd::User::from_name(name).map(|u| u.map(|u| u.uid.as_raw()))
    };
    let name = name.to_string();
    match found {
        Ok(Some(id)) => Ok(id),
        Ok(None) => Err(SubjectError::Unknown { name, group }),
        Err(errno) => Err(SubjectError::Lookup { name, group, errno }),
    }
}

/// Why a grant's user or group name (`group`: a `groups` entry) resolves to no id.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
enum SubjectError {
    #[error(
        "no {what} named {name:?} on this system ({list} = [...] takes {names}, or \
         \"{DAEMON_USER}\" for the daemon's own {what}; {numbers} = [...] takes numbers)",
        what = subject_words(*group).0,
        list = subject_words(*group).1,
        numbers = subject_words(*group).2,
        names = subject_words(*group).3
    )]
    Unknown { name: String, group: bool },
    #[error("cannot look up {} {name:?}: {errno}", subject_words(*group).0)]
    Lookup {
        name: String,
        group: bool,
        errno: nix::Error,
    },
}

/// How messages name a subject: (what, its list, its numeric list, what the list takes).
fn subject_words(group: bool) -> (&'static str, &'static str, &'static str, &'static str) {
    if group {
        ("group", "groups", "gids", "group names")
    } else {
        ("user", "users", "uids", "account names")
    }
}

pub(super) fn load_grants(
    cx: &mut Cx,
    path: &Path,
    tools: &BTreeMap<String, Tool>,
    daemon: DaemonIdentity,
) -> Vec<crate::policy::Grant> {
    use crate::policy::Right;
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
        let mut grant = crate::policy::Grant {
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
