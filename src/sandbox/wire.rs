//! The messages between the daemon and the launcher, over the launcher's channel (a Unix
//! stream socket whose child end the launcher inherits as the descriptor named in `argv[2]`).
//!
//! The daemon writes one [`Spec`] as JSON and shuts its write side; the launcher answers with
//! [`Report`] lines: `ok` just before `execve` (the channel is close-on-exec, so EOF after
//! `ok` means the tool is running), or one failure, after which it exits 126.

use std::collections::BTreeMap;
use std::path::PathBuf;

use serde::{Deserialize, Serialize};

use super::landlock::LandlockSpec;

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
    /// Classic BPF programs `(code, jt, jf, k)`, in installation order.
    pub seccomp: Vec<Vec<(u16, u8, u8, u32)>>,
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

/// One line from the launcher.
#[derive(Debug, Clone, Serialize, Deserialize, PartialEq, Eq)]
#[serde(tag = "report", rename_all = "snake_case")]
pub(crate) enum Report {
    /// Everything is in place; `execve` comes next.
    Ok { landlock: String, landlock_abi: u8 },
    /// Setup failed at `step`.
    Failed {
        step: String,
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
        landlock: String,
        landlock_abi: u8,
    },
    Failed {
        step: String,
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
                    step: "report".into(),
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
            step: "launcher".into(),
            errno: 0,
            message: "the launcher ended without a report".into(),
        },
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn ok_then_eof_is_running() {
        let ok = Report::Ok {
            landlock: "fully_enforced".into(),
            landlock_abi: 7,
        }
        .line();
        assert_eq!(
            verdict(&ok),
            Verdict::Running {
                landlock: "fully_enforced".into(),
                landlock_abi: 7
            }
        );
    }

    #[test]
    fn failed_execve_after_ok_is_failed() {
        let mut s = Report::Ok {
            landlock: "fully_enforced".into(),
            landlock_abi: 7,
        }
        .line();
        s.extend(
            Report::Failed {
                step: "execve".into(),
                errno: 2,
                message: "no such file".into(),
            }
            .line(),
        );
        assert!(matches!(verdict(&s), Verdict::Failed { step, errno: 2, .. } if step == "execve"));
    }

    #[test]
    fn nothing_or_garbage_is_failed() {
        assert!(matches!(verdict(b""), Verdict::Failed { step, .. } if step == "launcher"));
        assert!(matches!(verdict(b"hello\n"), Verdict::Failed { step, .. } if step == "report"));
    }
}
