//! The messages between the daemon and the launcher (the pre-exec child), over the launcher's
//! channel (a Unix stream socket whose child end the spawner hands to the worker's leader).
//!
//! The daemon writes one [`Spec`] as JSON and shuts its write side (alongside its spawn
//! request: the worker's template reads it before it creates the worker); the launcher answers with
//! [`Report`] lines: `ok` just before `execve` (the channel is close-on-exec, so EOF after
//! `ok` means the tool is running), or one failure, after which it exits 126.

use std::collections::BTreeMap;
use std::path::PathBuf;

use serde::{Deserialize, Serialize};

/// Exit code of a launcher that could not set up the sandbox.
pub(crate) const SETUP_FAILED: i32 = 126;

/// Everything the launcher needs, validated by the daemon before it is sent.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub(crate) struct Spec {
    /// `argv[0]` is the absolute path of the tool.
    pub argv: Vec<String>,
    pub cwd: PathBuf,
    /// Variables kept from the daemon's environment (those present there at the call), with
    /// their values: the spawner's own environment is the daemon's at the spawner's start.
    pub env_kept: Vec<(String, Vec<u8>)>,
    /// Variables set to fixed values (override `env_kept`).
    pub env_set: BTreeMap<String, String>,
    /// The daemon's pid: the launcher's parent, checked after PR_SET_PDEATHSIG.
    pub parent: i32,
    /// The worker's own cgroup v2 directory, which the launcher joins.
    pub cgroup: Option<PathBuf>,
    pub rlimits: Rlimits,
    /// The worker's own uid and gid; `None`: it keeps the daemon's.
    pub identity: Option<(u32, u32)>,
    pub landlock: LandlockSpec,
    // No seccomp programs: the worker's template installed the profile's stack once, and
    // holds the seal the launcher installs last (see `crate::sandbox::spawner`).
}

#[derive(Debug, Clone, Copy, Serialize, Deserialize, PartialEq, Eq)]
pub(crate) struct Rlimits {
    pub cpu_seconds: u64,
    pub address_space_bytes: u64,
    pub file_size_bytes: u64,
    pub open_files: u64,
    /// Processes beyond those the uid already has (RLIMIT_NPROC counts per uid).
    pub processes: u64,
}

/// A step of the launcher's plan (and the two ways the daemon sees a launcher fail without
/// one), named on the wire and in [`crate::sandbox::SandboxError::Setup`] by its snake_case
/// name ([`Step::as_str`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Step {
    /// Reading and checking the spec, before the first irreversible step.
    Spec,
    /// The spawner's child: its process group and standard streams, before the launcher.
    Spawn,
    ProcessGroup,
    /// PR_SET_PDEATHSIG and the parent check (again after the uid switch).
    ParentDeath,
    Cgroup,
    Signals,
    CloseFds,
    Rlimits,
    Chdir,
    Landlock,
    /// Locking (securebits, bounding set) and dropping the capability sets.
    Capabilities,
    /// The switch to the worker's own uid and gid.
    Identity,
    NoNewPrivs,
    Seccomp,
    /// Writing the `ok` report, or reading it: a report line the daemon cannot parse.
    Report,
    Execve,
    /// The launcher ended, or took too long, without a report.
    Launcher,
}

impl Step {
    /// Every step, in plan order (then the daemon's two).
    pub const ALL: [Step; 17] = [
        Step::Spec,
        Step::Spawn,
        Step::ProcessGroup,
        Step::ParentDeath,
        Step::Cgroup,
        Step::Signals,
        Step::CloseFds,
        Step::Rlimits,
        Step::Chdir,
        Step::Landlock,
        Step::Capabilities,
        Step::Identity,
        Step::NoNewPrivs,
        Step::Seccomp,
        Step::Report,
        Step::Execve,
        Step::Launcher,
    ];

    /// The name on the wire and in error messages.
    pub fn as_str(self) -> &'static str {
        match self {
            Step::Spec => "spec",
            Step::Spawn => "spawn",
            Step::ProcessGroup => "process_group",
            Step::ParentDeath => "parent_death",
            Step::Cgroup => "cgroup",
            Step::Signals => "signals",
            Step::CloseFds => "close_fds",
            Step::Rlimits => "rlimits",
            Step::Chdir => "chdir",
            Step::Landlock => "landlock",
            Step::Capabilities => "capabilities",
            Step::Identity => "identity",
            Step::NoNewPrivs => "no_new_privs",
            Step::Seccomp => "seccomp",
            Step::Report => "report",
            Step::Execve => "execve",
            Step::Launcher => "launcher",
        }
    }
}

impl std::fmt::Display for Step {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.as_str())
    }
}

/// One line from the launcher.
#[derive(Debug, Clone, Serialize, Deserialize, PartialEq, Eq)]
#[serde(tag = "report", rename_all = "snake_case")]
pub(crate) enum Report {
    /// Everything is in place; `execve` comes next.
    Ok {
        landlock: LandlockStatus,
        landlock_abi: u8,
    },
    /// Setup failed at `step`.
    Failed {
        step: Step,
        errno: i32,
        message: String,
    },
}

impl Report {
    pub(crate) fn line(&self) -> Vec<u8> {
        // A Report is strings and integers only: serializing it cannot fail; keep a fallback
        // line anyway rather than a panic path.
        let mut line = serde_json::to_vec(self).unwrap_or_else(|_| {
            br#"{"report":"failed","step":"report","errno":0,"message":"unencodable"}"#.to_vec()
        });
        line.push(b'\n');
        line
    }
}

/// What the daemon makes of the launcher's report stream, read to EOF.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) enum Verdict {
    Running {
        landlock: LandlockStatus,
        landlock_abi: u8,
    },
    Failed {
        step: Step,
        errno: i32,
        message: String,
    },
}

/// The last report wins (a failed `execve` follows an `ok`); no report at all means the
/// launcher died before it could say anything.
pub(crate) fn verdict(stream: &[u8]) -> Verdict {
    let mut last = None;
    for line in stream.split(|&b| b == b'\n').filter(|l| !l.is_empty()) {
        match serde_json::from_slice::<Report>(line) {
            Ok(r) => last = Some(r),
            Err(e) => {
                return Verdict::Failed {
                    step: Step::Report,
                    errno: 0,
                    message: format!(
                        "unreadable launcher report {:?}: {e}",
                        String::from_utf8_lossy(line)
                    ),
                }
            }
        }
    }
    match last {
        Some(Report::Ok {
            landlock,
            landlock_abi,
        }) => Verdict::Running {
            landlock,
            landlock_abi,
        },
        Some(Report::Failed {
            step,
            errno,
            message,
        }) => Verdict::Failed {
            step,
            errno,
            message,
        },
        None => Verdict::Failed {
            step: Step::Launcher,
            errno: 0,
            message: "the launcher ended without a report".into(),
        },
    }
}

/// What the launcher needs to build the ruleset.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub(crate) struct LandlockSpec {
    pub abi: u8,
    pub best_effort: bool,
    pub network: bool,
    /// Profile paths; skipped when absent.
    pub read: Vec<PathBuf>,
    pub exec: Vec<PathBuf>,
    pub write: Vec<PathBuf>,
    /// Per-call paths; must exist.
    pub writable: Vec<PathBuf>,
    pub readable: Vec<PathBuf>,
}

/// How much of a worker's ruleset the kernel enforces (landlock's `RulesetStatus`, ours so
/// that it crosses the launcher's channel and the audit log by name).
#[derive(Debug, Clone, Copy, Serialize, Deserialize, PartialEq, Eq)]
#[serde(rename_all = "snake_case")]
pub enum LandlockStatus {
    FullyEnforced,
    PartiallyEnforced,
    NotEnforced,
}

impl LandlockStatus {
    pub fn as_str(self) -> &'static str {
        match self {
            LandlockStatus::FullyEnforced => "fully_enforced",
            LandlockStatus::PartiallyEnforced => "partially_enforced",
            LandlockStatus::NotEnforced => "not_enforced",
        }
    }
}

impl From<landlock::RulesetStatus> for LandlockStatus {
    fn from(s: landlock::RulesetStatus) -> Self {
        match s {
            landlock::RulesetStatus::FullyEnforced => LandlockStatus::FullyEnforced,
            landlock::RulesetStatus::PartiallyEnforced => LandlockStatus::PartiallyEnforced,
            landlock::RulesetStatus::NotEnforced => LandlockStatus::NotEnforced,
        }
    }
}

/// A classic BPF program as plain tuples `(code, jt, jf, k)`, for the spec.
pub(crate) fn encode_program(program: &seccompiler::BpfProgram) -> Vec<(u16, u8, u8, u32)> {
    program.iter().map(|i| (i.code, i.jt, i.jf, i.k)).collect()
}

/// The program of [`encode_program`]'s tuples, as the launcher installs it.
pub(crate) fn decode_program(program: &[(u16, u8, u8, u32)]) -> seccompiler::BpfProgram {
    program
        .iter()
        .map(|&(code, jt, jf, k)| seccompiler::sock_filter { code, jt, jf, k })
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn ok_then_eof_is_running() {
        let ok = Report::Ok {
            landlock: LandlockStatus::FullyEnforced,
            landlock_abi: 7,
        }
        .line();
        assert_eq!(
            verdict(&ok),
            Verdict::Running {
                landlock: LandlockStatus::FullyEnforced,
                landlock_abi: 7
            }
        );
    }

    #[test]
    fn failed_execve_after_ok_is_failed() {
        let mut s = Report::Ok {
            landlock: LandlockStatus::FullyEnforced,
            landlock_abi: 7,
        }
        .line();
        s.extend(
            Report::Failed {
                step: Step::Execve,
                errno: 2,
                message: "no such file".into(),
            }
            .line(),
        );
        assert!(matches!(
            verdict(&s),
            Verdict::Failed {
                step: Step::Execve,
                errno: 2,
                ..
            }
        ));
    }

    #[test]
    fn nothing_or_garbage_is_failed() {
        assert!(matches!(
            verdict(b""),
            Verdict::Failed {
                step: Step::Launcher,
                ..
            }
        ));
        assert!(matches!(
            verdict(b"hello\n"),
            Verdict::Failed {
                step: Step::Report,
                ..
            }
        ));
        // A step this daemon does not know is an unreadable report, not a guess.
        let unknown = br#"{"report":"failed","step":"reboot","errno":1,"message":"x"}"#;
        assert!(matches!(
            verdict(unknown),
            Verdict::Failed {
                step: Step::Report,
                ..
            }
        ));
    }

    #[test]
    fn every_step_is_named_on_the_wire_as_in_messages() {
        for step in Step::ALL {
            let line = Report::Failed {
                step,
                errno: 1,
                message: "m".into(),
            }
            .line();
            let text = String::from_utf8(line.clone()).expect("utf-8");
            assert!(
                text.contains(&format!(r#""step":"{}""#, step.as_str())),
                "{text}"
            );
            assert_eq!(step.to_string(), step.as_str());
            assert!(matches!(
                verdict(&line),
                Verdict::Failed { step: s, errno: 1, .. } if s == step
            ));
        }
        // The fallback line of `Report::line` names the report step as the enum does.
        let fallback: Report = serde_json::from_slice(
            br#"{"report":"failed","step":"report","errno":0,"message":"unencodable"}"#,
        )
        .expect("the fallback line parses");
        assert!(matches!(
            fallback,
            Report::Failed {
                step: Step::Report,
                ..
            }
        ));
    }
}
