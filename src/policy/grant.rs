//! Grants: who may do what. `[[grant]]` tables in `airlock.toml` name subjects (users, uids,
//! groups, gids) and the rights they get; a principal with no matching grant may do nothing.
//!
//! The decisions here are pure: `exec` asks them before anything else happens for a call,
//! `mcp` asks them to filter `tools/list` and to guard the audit resource.

use std::collections::BTreeSet;

use super::model::{Capability, Policy, Tool};

/// A right a grant gives.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord)]
pub enum Right {
    /// Call read tools (`session_get`, `session_list`, external read tools).
    Read,
    /// Call write tools (`session_create`, `session_destroy`, external write tools).
    Write,
    /// Act on every session whatever its owner, and read the audit resource.
    Admin,
    /// Read the audit resource.
    Audit,
}

impl Right {
    pub const ALL: [Right; 4] = [Right::Read, Right::Write, Right::Admin, Right::Audit];

    pub fn as_str(self) -> &'static str {
        match self {
            Right::Read => "read",
            Right::Write => "write",
            Right::Admin => "admin",
            Right::Audit => "audit",
        }
    }

    pub fn parse(s: &str) -> Option<Right> {
        Right::ALL.into_iter().find(|r| r.as_str() == s)
    }

    /// The right a call of a tool of this capability needs.
    pub fn for_capability(c: Capability) -> Right {
        match c {
            Capability::Read => Right::Read,
            Capability::Write => Right::Write,
        }
    }
}

/// One `[[grant]]` table, its names resolved to ids at load.
#[derive(Debug, Clone, PartialEq)]
pub struct Grant {
    pub uids: BTreeSet<u32>,
    pub gids: BTreeSet<u32>,
    /// The subjects as written (with the ids they resolved to), for `policy explain`.
    pub subjects: Vec<String>,
    pub rights: BTreeSet<Right>,
    /// `tools = [...]`: the read and write rights hold only for these tools.
    pub tools: Option<BTreeSet<String>>,
    /// Where it was declared (`airlock.toml:LINE`).
    pub origin: String,
}

/// Who asks: a uid and every group id it holds (primary and supplementary).
#[derive(Debug, Clone, Copy)]
pub struct Subject<'a> {
    pub uid: u32,
    pub gids: &'a [u32],
}

impl Grant {
    pub fn matches(&self, who: Subject<'_>) -> bool {
        self.uids.contains(&who.uid) || who.gids.iter().any(|g| self.gids.contains(g))
    }

    /// Whether this grant gives whoever it names the right to call `tool`.
    pub fn allows(&self, tool: &Tool) -> bool {
        self.rights
            .contains(&Right::for_capability(tool.capability))
            && self.tools.as_ref().is_none_or(|t| t.contains(&tool.name))
    }
}

impl Policy {
    fn grants_of<'a>(&'a self, who: Subject<'a>) -> impl Iterator<Item = &'a Grant> + 'a {
        self.grants.iter().filter(move |g| g.matches(who))
    }

    /// Whether `who` may call `tool`: a grant of theirs gives the right its capability needs,
    /// for every tool or with the tool in its list.
    pub fn may_call(&self, who: Subject<'_>, tool: &Tool) -> bool {
        self.grants_of(who).any(|g| g.allows(tool))
    }

    /// Every grant that lets whoever it names call `tool` (`policy explain`).
    pub fn grants_for<'a>(&'a self, tool: &'a Tool) -> impl Iterator<Item = &'a Grant> + 'a {
        self.grants.iter().filter(move |g| g.allows(tool))
    }

    /// Whether `who` holds `right` (`admin` or `audit`; these are never limited to tools).
    pub fn holds(&self, who: Subject<'_>, right: Right) -> bool {
        self.grants_of(who).any(|g| g.rights.contains(&right))
    }

    /// Whether `who` may read the audit resource: `admin` or `audit`.
    pub fn may_read_audit(&self, who: Subject<'_>) -> bool {
        self.holds(who, Right::Admin) || self.holds(who, Right::Audit)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn grant(uids: &[u32], gids: &[u32], rights: &[Right], tools: Option<&[&str]>) -> Grant {
        Grant {
            uids: uids.iter().copied().collect(),
            gids: gids.iter().copied().collect(),
            subjects: Vec::new(),
            rights: rights.iter().copied().collect(),
            tools: tools.map(|t| t.iter().map(|s| s.to_string()).collect()),
            origin: String::new(),
        }
    }

    fn policy(grants: Vec<Grant>) -> Policy {
        Policy {
            dir: Default::default(),
            daemon: Default::default(),
            profiles: Default::default(),
            tools: super::super::builtins(),
            grants,
        }
    }

    #[test]
    fn no_grant_no_access() {
        let p = policy(vec![grant(
            &[1000],
            &[],
            &[Right::Read, Right::Write],
            None,
        )]);
        let stranger = Subject {
            uid: 1001,
            gids: &[1001],
        };
        for t in p.tools.values() {
            assert!(!p.may_call(stranger, t), "{}", t.name);
        }
        assert!(!p.may_read_audit(stranger));
        let owner = Subject {
            uid: 1000,
            gids: &[1000],
        };
        assert!(p.tools.values().all(|t| p.may_call(owner, t)));
        assert!(!p.may_read_audit(owner), "read+write do not give the audit");
    }

    #[test]
    fn rights_tools_and_groups() {
        let p = policy(vec![
            grant(&[], &[50], &[Right::Read], Some(&["session_get"])),
            grant(&[7], &[], &[Right::Audit], None),
            grant(&[8], &[], &[Right::Admin], None),
        ]);
        let member = Subject {
            uid: 1,
            gids: &[3, 50],
        };
        assert!(p.may_call(member, &p.tools["session_get"]));
        assert!(!p.may_call(member, &p.tools["session_list"]), "not listed");
        assert!(!p.may_call(member, &p.tools["session_create"]), "no write");
        assert!(p.may_read_audit(Subject { uid: 7, gids: &[] }));
        assert!(p.may_read_audit(Subject { uid: 8, gids: &[] }));
        assert!(!p.may_call(Subject { uid: 8, gids: &[] }, &p.tools["session_get"]));
    }
}
