//! The worker's seccomp filters, built in the daemon from the profile and installed by the
//! launcher as its last step.
//!
//! seccompiler gives one match action per filter, and the rules need three (the profile's
//! errno, ENOSYS for `clone3`, EPERM for non-Unix sockets and the containment syscalls), so the
//! worker gets a small stack of filters. The kernel runs every filter of the stack and keeps
//! the most restrictive action; among `ERRNO` results, the most recently installed filter's
//! errno wins. Filters are therefore installed in this order:
//!
//! 1. `x32` (x86_64 only): syscalls with the x32 bit set fail with ENOSYS, since the same
//!    `AUDIT_ARCH_X86_64` tag covers both ABIs and the deny list names x86_64 numbers only.
//! 2. `profile`: [`SeccompMode::Deny`] = the listed syscalls fail with the profile's errno;
//!    [`SeccompMode::Allow`] = every other syscall does.
//! 3. `clone3`: fails with ENOSYS wherever the profile filters it, so glibc falls back to
//!    `clone` instead of failing thread creation.
//! 4. `containment`: `setsid` and `setpgid` always fail with EPERM (a worker that left its
//!    process group would escape kill-and-confirm), and, when the profile has no network,
//!    `socket()` with a domain other than `AF_UNIX` fails with EPERM.
//!
//! Every seccompiler filter also kills the process on a foreign architecture (e.g. the i386
//! `int 0x80` entry on x86_64).

use std::collections::BTreeMap;

use seccompiler::{
    sock_filter, BpfProgram, SeccompAction, SeccompCmpArgLen, SeccompCmpOp, SeccompCondition,
    SeccompFilter, SeccompRule, TargetArch,
};

use crate::policy::{Profile, SeccompMode, ERRNOS};

use super::syscall_table::SYSCALLS;

/// Why the filters could not be built from a profile.
#[derive(Debug, thiserror::Error)]
pub enum SeccompError {
    #[error("profile {profile}: unknown syscall {name:?} on {arch}")]
    UnknownSyscall {
        profile: String,
        name: String,
        arch: &'static str,
    },
    #[error("profile {profile}: errno {errno:?} is not one of EPERM, EACCES, ENOSYS, EINVAL")]
    UnknownErrno { profile: String, errno: String },
    #[error("seccomp filters are not built for {0}")]
    UnsupportedArch(&'static str),
    #[error("profile {profile}: seccompiler rejected the {filter} filter: {message}")]
    Compile {
        profile: String,
        filter: &'static str,
        message: String,
    },
}

/// The syscall number of `name` on the architecture this binary is built for.
pub fn syscall_number(name: &str) -> Option<i64> {
    SYSCALLS
        .iter()
        .find(|(n, _)| n.strip_prefix("SYS_") == Some(name))
        .map(|&(_, nr)| nr)
}

fn target_arch() -> Result<TargetArch, SeccompError> {
    TargetArch::try_from(std::env::consts::ARCH)
        .map_err(|_| SeccompError::UnsupportedArch(std::env::consts::ARCH))
}

/// The errno number of an `E...` name the policy accepts.
pub(crate) fn errno_number(name: &str) -> Option<i32> {
    ERRNOS.iter().find(|(n, _)| *n == name).map(|&(_, e)| e)
}

/// Syscalls that always fail with EPERM in a worker, whatever the profile says: leaving the
/// process group (or session) would take a process out of reach of kill-and-confirm.
pub(crate) const CONTAINMENT: &[&str] = &["setsid", "setpgid"];

/// Syscalls an allow list always includes: the launcher needs them after installing it.
pub(crate) const ALLOW_LIST_ALWAYS: &[&str] = &["seccomp", "execve"];

/// The filters for `profile`, in installation order.
pub(crate) fn build(profile: &Profile) -> Result<Vec<BpfProgram>, SeccompError> {
    let arch = target_arch()?;
    let errno = errno_number(&profile.seccomp.errno).ok_or_else(|| SeccompError::UnknownErrno {
        profile: profile.name.clone(),
        errno: profile.seccomp.errno.clone(),
    })? as u32;
    let number = |name: &str| {
        syscall_number(name).ok_or_else(|| SeccompError::UnknownSyscall {
            profile: profile.name.clone(),
            name: name.to_string(),
            arch: std::env::consts::ARCH,
        })
    };
    let compile =
        |filter: &'static str, rules, mismatch, matched| -> Result<BpfProgram, SeccompError> {
            SeccompFilter::new(rules, mismatch, matched, arch)
                .and_then(BpfProgram::try_from)
                .map_err(|e| SeccompError::Compile {
                    profile: profile.name.clone(),
                    filter,
                    message: e.to_string(),
                })
        };

    let mut programs = Vec::with_capacity(4);
    if arch == TargetArch::x86_64 {
        programs.push(x32_guard());
    }

    // The profile's own list. clone3 is left to its dedicated filter below.
    let clone3 = number("clone3")?;
    let mut listed = BTreeMap::new();
    for name in &profile.seccomp.syscalls {
        listed.insert(number(name)?, Vec::<SeccompRule>::new());
    }
    let clone3_listed = listed.contains_key(&clone3);
    if profile.seccomp.mode == SeccompMode::Deny {
        // A denied clone3 gets ENOSYS from its own filter, not the profile's errno.
        listed.remove(&clone3);
    }
    match profile.seccomp.mode {
        SeccompMode::Deny => {
            if !listed.is_empty() {
                programs.push(compile(
                    "profile",
                    listed,
                    SeccompAction::Allow,
                    SeccompAction::Errno(errno),
                )?);
            }
        }
        SeccompMode::Allow => {
            // The launcher still has to install the filters after this one and then execve
            // the tool. Allowing `seccomp` costs nothing: a filter can only narrow rights.
            for name in ALLOW_LIST_ALWAYS {
                listed.insert(number(name)?, Vec::new());
            }
            programs.push(compile(
                "profile",
                listed,
                SeccompAction::Errno(errno),
                SeccompAction::Allow,
            )?);
        }
    }

    // clone3 is filtered when denied by name, or when an allow list does not name it.
    let clone3_filtered = match profile.seccomp.mode {
        SeccompMode::Deny => clone3_listed,
        SeccompMode::Allow => !clone3_listed,
    };
    if clone3_filtered {
        let rules = BTreeMap::from([(clone3, Vec::new())]);
        programs.push(compile(
            "clone3",
            rules,
            SeccompAction::Allow,
            SeccompAction::Errno(libc::ENOSYS as u32),
        )?);
    }

    let mut rules = BTreeMap::new();
    for name in CONTAINMENT {
        rules.insert(number(name)?, Vec::new());
    }
    if !profile.network {
        let not_unix = SeccompCondition::new(
            0,
            SeccompCmpArgLen::Dword,
            SeccompCmpOp::Ne,
            libc::AF_UNIX as u64,
        )
        .map_err(|e| SeccompError::Compile {
            profile: profile.name.clone(),
            filter: "containment",
            message: e.to_string(),
        })?;
        let rule = SeccompRule::new(vec![not_unix]).map_err(|e| SeccompError::Compile {
            profile: profile.name.clone(),
            filter: "containment",
            message: e.to_string(),
        })?;
        rules.insert(number("socket")?, vec![rule]);
    }
    programs.push(compile(
        "containment",
        rules,
        SeccompAction::Allow,
        SeccompAction::Errno(libc::EPERM as u32),
    )?);
    Ok(programs)
}

/// x86_64 only: refuse the x32 ABI (syscall numbers with bit 30 set) with ENOSYS.
/// Six classic-BPF instructions, written out because seccompiler matches syscall numbers for
/// equality only.
fn x32_guard() -> BpfProgram {
    const AUDIT_ARCH_X86_64: u32 = 62 | 0x8000_0000 | 0x4000_0000;
    const X32_SYSCALL_BIT: u32 = 0x4000_0000;
    // Offsets in struct seccomp_data: int nr; __u32 arch; ...
    const OFFSET_NR: u32 = 0;
    const OFFSET_ARCH: u32 = 4;
    let stmt = |code: u32, k: u32| sock_filter {
        code: code as u16,
        jt: 0,
        jf: 0,
        k,
    };
    let jump = |code: u32, k: u32, jt: u8, jf: u8| sock_filter {
        code: code as u16,
        jt,
        jf,
        k,
    };
    let ld = libc::BPF_LD | libc::BPF_W | libc::BPF_ABS;
    let ret = libc::BPF_RET | libc::BPF_K;
    vec![
        stmt(ld, OFFSET_ARCH),
        jump(
            libc::BPF_JMP | libc::BPF_JEQ | libc::BPF_K,
            AUDIT_ARCH_X86_64,
            1,
            0,
        ),
        stmt(ret, libc::SECCOMP_RET_KILL_PROCESS),
        stmt(ld, OFFSET_NR),
        jump(
            libc::BPF_JMP | libc::BPF_JGE | libc::BPF_K,
            X32_SYSCALL_BIT,
            0,
            1,
        ),
        stmt(ret, libc::SECCOMP_RET_ERRNO | libc::ENOSYS as u32),
        stmt(ret, libc::SECCOMP_RET_ALLOW),
    ]
}

/// A program as plain tuples, for the launcher spec.
pub(crate) fn encode(program: &BpfProgram) -> Vec<(u16, u8, u8, u32)> {
    program.iter().map(|i| (i.code, i.jt, i.jf, i.k)).collect()
}

pub(crate) fn decode(program: &[(u16, u8, u8, u32)]) -> BpfProgram {
    program
        .iter()
        .map(|&(code, jt, jf, k)| sock_filter { code, jt, jf, k })
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::policy::{EnvProfile, LandlockProfile, Limits, SeccompProfile};

    pub(crate) fn profile(mode: SeccompMode, syscalls: &[&str], network: bool) -> Profile {
        Profile {
            name: "test".into(),
            landlock: LandlockProfile {
                abi: 6,
                best_effort: false,
                read: vec![],
                exec: vec![],
                write: vec![],
            },
            seccomp: SeccompProfile {
                mode,
                syscalls: syscalls.iter().map(|s| s.to_string()).collect(),
                errno: "EPERM".into(),
            },
            network,
            limits: Limits::default(),
            env: EnvProfile::default(),
        }
    }

    const DEFAULT_DENY: &[&str] = &[
        "ptrace",
        "process_vm_readv",
        "process_vm_writev",
        "mount",
        "umount2",
        "pivot_root",
        "chroot",
        "unshare",
        "setns",
        "bpf",
        "perf_event_open",
        "kexec_load",
        "kexec_file_load",
        "init_module",
        "finit_module",
        "delete_module",
        "keyctl",
        "add_key",
        "request_key",
        "userfaultfd",
        "io_uring_setup",
        "io_uring_enter",
        "io_uring_register",
        "personality",
        "setsid",
        "setpgid",
        "clone3",
    ];

    #[test]
    fn known_and_unknown_names() {
        assert!(syscall_number("openat").is_some());
        assert!(syscall_number("clone3").is_some());
        assert!(syscall_number("io_uring_setup").is_some());
        assert!(syscall_number("mseal").is_some());
        assert_eq!(syscall_number("nonsense"), None);
        assert_eq!(syscall_number(""), None);
        assert_eq!(syscall_number("SYS_openat"), None);
    }

    #[cfg(target_arch = "x86_64")]
    #[test]
    fn x86_64_numbers() {
        assert_eq!(syscall_number("read"), Some(0));
        assert_eq!(syscall_number("openat"), Some(257));
        assert_eq!(syscall_number("clone3"), Some(435));
        assert_eq!(syscall_number("io_uring_setup"), Some(425));
        assert_eq!(syscall_number("file_setattr"), Some(469));
    }

    #[cfg(target_arch = "aarch64")]
    #[test]
    fn aarch64_numbers() {
        assert_eq!(syscall_number("read"), Some(63));
        assert_eq!(syscall_number("openat"), Some(56));
        assert_eq!(syscall_number("open"), None);
    }

    #[test]
    fn names_and_numbers_are_unique() {
        let mut names = std::collections::HashSet::new();
        let mut numbers = std::collections::HashSet::new();
        for (name, nr) in SYSCALLS {
            assert!(names.insert(*name), "duplicate name {name}");
            assert!(numbers.insert(*nr), "duplicate number {nr} ({name})");
        }
    }

    /// Every name of our table that seccompiler's own table knows compiles through its JSON
    /// frontend, so both sides agree the name is real.
    #[test]
    fn seccompiler_accepts_our_names() {
        let arch = target_arch().unwrap();
        for (name, _) in SYSCALLS {
            let name = &name[4..];
            let json = format!(
                r#"{{"f": {{"mismatch_action": "allow", "match_action": {{"errno": 1}}, "filter": [{{"syscall": "{name}"}}]}}}}"#
            );
            // seccompiler's table stops at Linux 6.12; newer names are ours alone.
            if seccompiler::compile_from_json(json.as_bytes(), arch).is_err() {
                assert!(
                    syscall_number(name).unwrap() >= 451 || matches!(name, "uprobe" | "uretprobe"),
                    "seccompiler does not know {name}"
                );
            }
        }
    }

    #[test]
    fn default_deny_list_compiles() {
        let programs = build(&profile(SeccompMode::Deny, DEFAULT_DENY, false)).unwrap();
        // x32 guard (x86_64), profile, clone3, containment.
        let expected = if cfg!(target_arch = "x86_64") { 4 } else { 3 };
        assert_eq!(programs.len(), expected);
        assert!(programs.iter().all(|p| !p.is_empty() && p.len() < 4096));
    }

    #[test]
    fn allow_mode_filters_clone3_unless_allowed() {
        let base = if cfg!(target_arch = "x86_64") { 1 } else { 0 };
        let without = build(&profile(
            SeccompMode::Allow,
            &["read", "write", "exit_group"],
            true,
        ))
        .unwrap();
        assert_eq!(without.len(), base + 3);
        let with = build(&profile(SeccompMode::Allow, &["read", "clone3"], true)).unwrap();
        assert_eq!(with.len(), base + 2);
    }

    #[test]
    fn deny_mode_empty_list_keeps_containment() {
        let programs = build(&profile(SeccompMode::Deny, &[], true)).unwrap();
        let base = if cfg!(target_arch = "x86_64") { 1 } else { 0 };
        assert_eq!(programs.len(), base + 1);
    }

    #[test]
    fn unknown_names_and_errnos_are_rejected() {
        assert!(matches!(
            build(&profile(SeccompMode::Deny, &["nonsense"], false)),
            Err(SeccompError::UnknownSyscall { .. })
        ));
        let mut p = profile(SeccompMode::Deny, &[], false);
        p.seccomp.errno = "EWHATEVER".into();
        assert!(matches!(build(&p), Err(SeccompError::UnknownErrno { .. })));
    }

    #[test]
    fn encode_decode_roundtrip() {
        let programs = build(&profile(SeccompMode::Deny, DEFAULT_DENY, false)).unwrap();
        for p in &programs {
            let back = decode(&encode(p));
            assert_eq!(back.len(), p.len());
            assert!(back
                .iter()
                .zip(p)
                .all(|(a, b)| a.code == b.code && a.jt == b.jt && a.jf == b.jf && a.k == b.k));
        }
    }
}
