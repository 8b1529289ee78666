//! The worker's seccomp filters, built in the daemon from the profile and installed by the
//! launcher as its last step.
//!
//! seccompiler gives one match action per filter, and the rules need three (the profile's
//! errno, ENOSYS for calls whose arguments live in memory, EPERM for the containment rules),
//! so the worker gets a small stack of filters. The kernel runs every filter of the stack and
//! keeps the most restrictive action; among `ERRNO` results, the most recently installed
//! filter's errno wins. Filters are therefore installed in this order:
//!
//! 1. `x32` (x86_64 only): syscalls with the x32 bit set fail with ENOSYS, since the same
//!    `AUDIT_ARCH_X86_64` tag covers both ABIs and the deny list names x86_64 numbers only.
//! 2. `profile`: [`SeccompMode::Deny`] = the listed syscalls fail with the profile's errno;
//!    [`SeccompMode::Allow`] = every other syscall does.
//! 3. `enosys`: [`ENOSYS_ALWAYS`] (`clone3`, `openat2`) fail with ENOSYS in every profile:
//!    their flags and modes live in memory, where seccomp cannot look, and ENOSYS makes glibc
//!    and other callers fall back to `clone` and `openat`, whose arguments it can check.
//! 4. `containment`: the rules of [`containment_rules`], EPERM, in every profile: no process
//!    group escape, no namespaces, no SysV IPC or POSIX message queue (nothing outlives the
//!    call), no foreign exec (`execveat`, executable memfds), no Unix socket unless the
//!    profile lists some, no non-Unix socket without network, and the metadata rules
//!    (setuid/setgid/sticky modes, owners, xattrs, inode flags; with `shared_uid`, every mode
//!    and time change) that Landlock does not cover.
//!
//! Every seccompiler filter also kills the process on a foreign architecture (e.g. the i386
//! `int 0x80` entry on x86_64).

use std::collections::BTreeMap;

use seccompiler::{
    sock_filter, BpfProgram, SeccompAction, SeccompCmpArgLen, SeccompCmpOp, SeccompCondition,
    SeccompFilter, SeccompRule, TargetArch,
};

use crate::policy::{Profile, SeccompMode};
pub(crate) use crate::syscalls::syscall_number;

/// Why the filters could not be built from a profile.
#[derive(Debug, thiserror::Error)]
pub enum SeccompError {
    #[error("profile {profile}: unknown syscall {name:?} on {arch}")]
    UnknownSyscall {
        profile: String,
        name: String,
        arch: &'static str,
    },
    #[error("seccomp filters are not built for {0}")]
    UnsupportedArch(&'static str),
    #[error("profile {profile}: seccompiler rejected the {filter} filter: {message}")]
    Compile {
        profile: String,
        filter: &'static str,
        message: String,
    },
}

fn target_arch() -> Result<TargetArch, SeccompError> {
    TargetArch::try_from(std::env::consts::ARCH)
        .map_err(|_| SeccompError::UnsupportedArch(std::env::consts::ARCH))
}

/// Always EPERM: leaving the process group (or session) would take a process out of reach
/// of kill-and-confirm.
pub(crate) const CONTAINMENT: &[&str] = &["setsid", "setpgid"];

/// Always EPERM: joining another namespace. (`clone` and `unshare` are denied only with a
/// `CLONE_NEW*` flag, see [`CLONE_NEW`].)
pub(crate) const NAMESPACE_JOIN: &[&str] = &["setns"];

/// Every `CLONE_NEW*` flag. `clone` and `unshare` with any of them fail with EPERM, so no
/// worker gets a user namespace (and its full capability set) or any other namespace.
/// `CLONE_NEWTIME` (0x80) lies in `clone`'s exit-signal byte, where the kernel ignores it as
/// a flag; a signal number with that bit is invalid anyway, so denying it costs nothing.
pub(crate) const CLONE_NEW: &[(&str, u64)] = &[
    ("CLONE_NEWUSER", libc::CLONE_NEWUSER as u64),
    ("CLONE_NEWPID", libc::CLONE_NEWPID as u64),
    ("CLONE_NEWNET", libc::CLONE_NEWNET as u64),
    ("CLONE_NEWNS", libc::CLONE_NEWNS as u64),
    ("CLONE_NEWUTS", libc::CLONE_NEWUTS as u64),
    ("CLONE_NEWIPC", libc::CLONE_NEWIPC as u64),
    ("CLONE_NEWCGROUP", libc::CLONE_NEWCGROUP as u64),
    ("CLONE_NEWTIME", 0x80),
];

/// Always EPERM: kernel objects outside the filesystem that would outlive the call (SysV
/// IPC, POSIX message queues). `ipc` is the legacy multiplexer, absent on x86_64 and aarch64.
pub(crate) const LINGERING_IPC: &[&str] = &[
    "shmget",
    "shmat",
    "shmctl",
    "shmdt",
    "msgget",
    "msgsnd",
    "msgrcv",
    "msgctl",
    "semget",
    "semop",
    "semtimedop",
    "semctl",
    "ipc",
    "mq_open",
    "mq_unlink",
    "mq_timedsend",
    "mq_timedreceive",
    "mq_notify",
    "mq_getsetattr",
];

/// Always EPERM: exec routes around the Landlock exec allow-list. `execveat` runs an open
/// descriptor (a memfd is exempt from Landlock's path rules); `memfd_secret` makes anonymous
/// files. `memfd_create` is allowed only with `MFD_NOEXEC_SEAL`, see [`MFD_NOEXEC_SEAL`].
pub(crate) const FOREIGN_EXEC: &[&str] = &["execveat", "memfd_secret"];

/// `memfd_create` without this flag fails with EPERM: a memfd is then never executable
/// (mode without x, and `F_SEAL_EXEC` stops a later chmod).
pub(crate) const MFD_NOEXEC_SEAL: u64 = 0x0008;

/// Always EPERM: owner and extended attribute changes (Landlock does not mediate metadata).
/// `file_setattr` sets inode flags and project ids like `FS_IOC_FSSETXATTR`.
pub(crate) const OWNER_AND_XATTR: &[&str] = &[
    "chown",
    "fchown",
    "lchown",
    "fchownat",
    "setxattr",
    "lsetxattr",
    "fsetxattr",
    "setxattrat",
    "removexattr",
    "lremovexattr",
    "fremovexattr",
    "removexattrat",
    "file_setattr",
];

/// `ioctl` requests that set inode flags (immutable, append-only, ...): always EPERM.
pub(crate) const INODE_FLAG_IOCTLS: &[(&str, u64)] = &[
    // _IOW('f', 2, long)
    ("FS_IOC_SETFLAGS", 0x4008_6602),
    // _IOW('f', 2, int)
    ("FS_IOC32_SETFLAGS", 0x4004_6602),
    // _IOW('X', 32, struct fsxattr), 28 bytes
    ("FS_IOC_FSSETXATTR", 0x401c_5820),
];

/// The mode bits no worker may set: with any of them, a chmod-family call fails with EPERM,
/// and so does creating a file (`open`/`openat` with `O_CREAT` or `O_TMPFILE`, `creat`,
/// `mknod`, `mknodat`) with setuid or setgid.
pub(crate) const SPECIAL_MODE_BITS: &[(&str, u64)] = &[
    ("S_ISUID", libc::S_ISUID as u64),
    ("S_ISGID", libc::S_ISGID as u64),
    ("S_ISVTX", libc::S_ISVTX as u64),
];

/// `(syscall, index of the mode argument)` of the chmod family.
pub(crate) const CHMOD_FAMILY: &[(&str, u8)] = &[
    ("chmod", 1),
    ("fchmod", 1),
    ("fchmodat", 2),
    ("fchmodat2", 2),
];

/// With `shared_uid` (the worker runs as the daemon's own uid, so file permissions protect
/// nothing of the daemon's), every call of these fails with EPERM as well: the chmod family
/// and the utime family. Workers then cannot change any mode or time, even in staging.
pub(crate) const SHARED_UID_DENIED: &[&str] = &[
    "chmod",
    "fchmod",
    "fchmodat",
    "fchmodat2",
    "utime",
    "utimes",
    "futimesat",
    "utimensat",
];

/// Always ENOSYS (the `enosys` filter): calls whose flags or modes live in memory.
pub(crate) const ENOSYS_ALWAYS: &[&str] = &["clone3", "openat2"];

/// Syscalls an allow list always includes: the launcher needs them after installing it.
pub(crate) const ALLOW_LIST_ALWAYS: &[&str] = &["seccomp", "execve"];

/// `__O_TMPFILE`, the flag bit `O_TMPFILE` adds to `O_DIRECTORY` (same on x86_64 and
/// aarch64).
const O_TMPFILE_BIT: u64 = 0o20000000;

/// `SOCK_TYPE_MASK`: the socket type in `socket`'s and `socketpair`'s type argument.
const SOCK_TYPE_MASK: u64 = 0xf;

/// The rules of one filter: syscall number to rules, an empty list matching every call.
#[derive(Default)]
struct Rules {
    map: BTreeMap<i64, Vec<SeccompRule>>,
}

impl Rules {
    /// Every call of `nr` matches.
    fn always(&mut self, nr: i64) {
        self.map.insert(nr, Vec::new());
    }

    /// Calls of `nr` matching `rule` match, unless every call already does.
    fn when(&mut self, nr: i64, rule: SeccompRule) {
        match self.map.get_mut(&nr) {
            Some(rules) if rules.is_empty() => {}
            Some(rules) => rules.push(rule),
            None => {
                self.map.insert(nr, vec![rule]);
            }
        }
    }
}

/// The syscalls a worker's template and the launcher's per-call steps make after the
/// template installed the profile's stack (the template's loop: receive, fork, answer; the
/// launcher: process group, parent check, cgroup, signals, descriptors, rlimits, chdir,
/// Landlock, capabilities, uid switch, the seal, report, execve). They are carved out of
/// the stack the template installs and put back, exactly as the profile decides them, by the
/// seal the launcher installs last ([`build_split`]). Names absent on this architecture are
/// skipped. None of them is in [`ENOSYS_ALWAYS`].
pub(crate) const TEMPLATE_CARVED: &[&str] = &[
    // the template's loop
    "recvmsg",
    "sendmsg",
    "clone",
    "close",
    "exit",
    "exit_group",
    "read",
    "write",
    // the per-call steps
    "setpgid",
    "getpgrp",
    "getpgid",
    "getpid",
    "getppid",
    "prctl",
    "dup2",
    "dup3",
    "fcntl",
    "close_range",
    "openat",
    "rt_sigaction",
    "rt_sigprocmask",
    "rt_sigreturn",
    "sigaltstack",
    "getuid",
    "geteuid",
    "getgid",
    "getegid",
    "prlimit64",
    "setrlimit",
    "getdents64",
    "newfstatat",
    "fstat",
    "statx",
    "lseek",
    "chdir",
    "landlock_create_ruleset",
    "landlock_add_rule",
    "landlock_restrict_self",
    "capget",
    "capset",
    "setgroups",
    "setresgid",
    "setresuid",
    "seccomp",
    "execve",
    "mmap",
    "munmap",
    "brk",
    "mremap",
    "madvise",
    "futex",
];

/// Which part of a profile's stack [`build_with`] compiles. (The whole stack is no worker's
/// any more: it is what the split is tested against.)
#[derive(Clone, Copy, PartialEq, Eq)]
#[cfg_attr(not(test), allow(dead_code))]
enum Part {
    /// The whole stack, as one process installs it.
    Whole,
    /// What a template installs once: the whole stack, but every syscall of
    /// [`TEMPLATE_CARVED`] allowed.
    Template,
    /// What the launcher installs last in a worker forked from a template: the profile's and
    /// the containment rules for the carved syscalls only, every other syscall allowed.
    Seal,
}

/// The filters for `profile`, in installation order. `shared_uid`: the worker runs with the
/// daemon's own uid (an unprivileged daemon without CAP_SETUID), so every mode and time
/// change is denied too.
#[cfg_attr(not(test), allow(dead_code))]
pub(crate) fn build(profile: &Profile, shared_uid: bool) -> Result<Vec<BpfProgram>, SeccompError> {
    build_with(profile, shared_uid, Part::Whole)
}

/// The stack of [`build`] split in two: what a template installs once (`.0`), and the seal
/// a worker forked from it installs as its last step (`.1`). Installed one after the other,
/// they decide every syscall exactly as [`build`]'s stack does (the kernel keeps the most
/// restrictive action, and among errnos the most recent filter's; the seal's filters come
/// in the whole stack's order and decide the carved syscalls alone, the template's decide
/// the rest alone). Tested on every syscall by `a_template_and_its_seal_decide_as_the_whole_stack`.
pub(crate) fn build_split(
    profile: &Profile,
    shared_uid: bool,
) -> Result<(Vec<BpfProgram>, Vec<BpfProgram>), SeccompError> {
    Ok((
        build_with(profile, shared_uid, Part::Template)?,
        build_with(profile, shared_uid, Part::Seal)?,
    ))
}

fn carved() -> std::collections::BTreeSet<i64> {
    TEMPLATE_CARVED
        .iter()
        .filter_map(|name| syscall_number(name))
        .collect()
}

fn build_with(
    profile: &Profile,
    shared_uid: bool,
    part: Part,
) -> Result<Vec<BpfProgram>, SeccompError> {
    let arch = target_arch()?;
    // Resolved at load: the policy holds numbers.
    let errno = profile.seccomp.errno.number() as u32;
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
    let carved = carved();
    let seal = part == Part::Seal;
    // The seal's part of the profile filter: carved calls the profile denies (every call of
    // them: a profile's rules have no conditions).
    let mut seal_denied: BTreeMap<i64, Vec<SeccompRule>> = BTreeMap::new();

    let mut programs = Vec::with_capacity(4);
    if arch == TargetArch::x86_64 && !seal {
        programs.push(x32_guard());
    }

    // The profile's own list. The ENOSYS calls are left to their dedicated filter below.
    let mut listed = BTreeMap::new();
    for syscall in &profile.seccomp.syscalls {
        listed.insert(syscall.nr(), Vec::<SeccompRule>::new());
    }
    match profile.seccomp.mode {
        SeccompMode::Deny => {
            for name in ENOSYS_ALWAYS {
                if let Some(nr) = syscall_number(name) {
                    listed.remove(&nr);
                }
            }
            match part {
                Part::Whole => {}
                Part::Template => listed.retain(|nr, _| !carved.contains(nr)),
                Part::Seal => {
                    listed.retain(|nr, _| carved.contains(nr));
                    seal_denied = std::mem::take(&mut listed);
                }
            }
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
            match part {
                Part::Whole => {}
                Part::Template => {
                    for nr in &carved {
                        listed.insert(*nr, Vec::new());
                    }
                }
                Part::Seal => {
                    // The carved calls the list leaves out, denied; everything else allowed.
                    seal_denied = carved
                        .iter()
                        .filter(|nr| !listed.contains_key(*nr))
                        .map(|nr| (*nr, Vec::new()))
                        .collect();
                    listed.clear();
                }
            }
            if !seal {
                programs.push(compile(
                    "profile",
                    listed,
                    SeccompAction::Errno(errno),
                    SeccompAction::Allow,
                )?);
            }
        }
    }

    if !seal {
        let mut enosys = Rules::default();
        for name in ENOSYS_ALWAYS {
            enosys.always(number(name)?);
        }
        programs.push(compile(
            "enosys",
            enosys.map,
            SeccompAction::Allow,
            SeccompAction::Errno(libc::ENOSYS as u32),
        )?);
    }

    let mut rules = containment_rules(profile, shared_uid).map_err(|e| SeccompError::Compile {
        profile: profile.name.clone(),
        filter: "containment",
        message: e.to_string(),
    })?;
    match part {
        Part::Whole => {}
        Part::Template => rules.map.retain(|nr, _| !carved.contains(nr)),
        Part::Seal => rules.map.retain(|nr, _| carved.contains(nr)),
    }
    if seal && !seal_denied.is_empty() {
        if errno == libc::EPERM as u32 {
            // Same action as the containment rules (both shipped profiles): one filter, every
            // call of a denied syscall matching. Each filter costs the kernel a conversion
            // and a JIT compilation with a fixed part, paid per worker for the seal.
            for nr in seal_denied.into_keys() {
                rules.always(nr);
            }
        } else {
            programs.push(compile(
                "profile",
                seal_denied,
                SeccompAction::Allow,
                SeccompAction::Errno(errno),
            )?);
        }
    }
    if !rules.map.is_empty() {
        programs.push(compile(
            "containment",
            rules.map,
            SeccompAction::Allow,
            SeccompAction::Errno(libc::EPERM as u32),
        )?);
    }
    Ok(programs)
}

/// A rule of one or more conditions `(arg, mask, value)`: `(arg & mask) == value`, all of
/// them, on the low 32 bits of the argument (every argument checked here is an `int`,
/// `unsigned int` or `mode_t`, or, for `clone`, flags the kernel truncates to 32 bits).
fn rule(conditions: &[(u8, u64, u64)]) -> Result<SeccompRule, seccompiler::BackendError> {
    let conditions = conditions
        .iter()
        .map(|&(arg, mask, value)| {
            SeccompCondition::new(
                arg,
                SeccompCmpArgLen::Dword,
                SeccompCmpOp::MaskedEq(mask),
                value,
            )
        })
        .collect::<Result<Vec<_>, _>>()?;
    SeccompRule::new(conditions)
}

/// The containment filter's rules (EPERM), for every profile. Names absent on this
/// architecture (`ipc`, `open`, `utime`, ...) are skipped: there is nothing to call.
fn containment_rules(
    profile: &Profile,
    shared_uid: bool,
) -> Result<Rules, seccompiler::BackendError> {
    let mut rules = Rules::default();
    let always = |rules: &mut Rules, names: &[&str]| {
        for name in names {
            if let Some(nr) = syscall_number(name) {
                rules.always(nr);
            }
        }
    };
    always(&mut rules, CONTAINMENT);
    always(&mut rules, NAMESPACE_JOIN);
    always(&mut rules, LINGERING_IPC);
    always(&mut rules, FOREIGN_EXEC);
    always(&mut rules, OWNER_AND_XATTR);
    if shared_uid {
        always(&mut rules, SHARED_UID_DENIED);
    }

    // Namespaces: clone's and unshare's flags are argument 0 on x86_64 and aarch64.
    for name in ["clone", "unshare"] {
        if let Some(nr) = syscall_number(name) {
            for &(_, flag) in CLONE_NEW {
                rules.when(nr, rule(&[(0, flag, flag)])?);
            }
        }
    }

    // Executable memfds: memfd_create(name, flags) without MFD_NOEXEC_SEAL.
    if let Some(nr) = syscall_number("memfd_create") {
        rules.when(nr, rule(&[(1, MFD_NOEXEC_SEAL, 0)])?);
    }

    // Sockets. socket(domain, type, protocol): without network, every domain but AF_UNIX;
    // without listed Unix sockets, AF_UNIX too. socketpair makes only connected AF_UNIX
    // pairs, but a datagram one can still sendto()/connect() any pathname socket, so without
    // listed sockets only stream and seqpacket pairs are made.
    if let Some(nr) = syscall_number("socket") {
        let unix = libc::AF_UNIX as u64;
        match (profile.network, profile.unix_sockets.is_empty()) {
            (false, true) => rules.always(nr),
            (true, true) => rules.when(nr, rule(&[(0, u64::from(u32::MAX), unix)])?),
            (false, false) => {
                // domain != AF_UNIX: seccompiler has Ne only unmasked, which is what we need.
                let not_unix =
                    SeccompCondition::new(0, SeccompCmpArgLen::Dword, SeccompCmpOp::Ne, unix)?;
                rules.when(nr, SeccompRule::new(vec![not_unix])?);
            }
            (true, false) => {}
        }
    }
    if profile.unix_sockets.is_empty() {
        if let Some(nr) = syscall_number("socketpair") {
            let dgram = libc::SOCK_DGRAM as u64;
            rules.when(nr, rule(&[(1, SOCK_TYPE_MASK, dgram)])?);
        }
    }

    // Inode flags.
    if let Some(nr) = syscall_number("ioctl") {
        for &(_, request) in INODE_FLAG_IOCTLS {
            rules.when(nr, rule(&[(1, u64::from(u32::MAX), request)])?);
        }
    }

    // Special mode bits, by chmod (without shared_uid, where the whole family is denied).
    for &(name, arg) in CHMOD_FAMILY {
        if let Some(nr) = syscall_number(name) {
            for &(_, bit) in SPECIAL_MODE_BITS {
                rules.when(nr, rule(&[(arg, bit, bit)])?);
            }
        }
    }
    // ... and at creation: setuid and setgid (sticky on a new file means nothing).
    let setid = [libc::S_ISUID as u64, libc::S_ISGID as u64];
    for (name, mode_arg) in [("creat", 1), ("mknod", 1), ("mknodat", 2)] {
        if let Some(nr) = syscall_number(name) {
            for bit in setid {
                rules.when(nr, rule(&[(mode_arg, bit, bit)])?);
            }
        }
    }
    for (name, flags_arg) in [("open", 1u8), ("openat", 2u8)] {
        if let Some(nr) = syscall_number(name) {
            for creating in [libc::O_CREAT as u64, O_TMPFILE_BIT] {
                for bit in setid {
                    rules.when(
                        nr,
                        rule(&[(flags_arg, creating, creating), (flags_arg + 1, bit, bit)])?,
                    );
                }
            }
        }
    }
    Ok(rules)
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

// A program's form on the launcher channel lives with the rest of that protocol.
#[cfg(test)]
use crate::sandbox::wire::launch::decode_program as decode;
pub(crate) use crate::sandbox::wire::launch::encode_program as encode;

#[cfg(test)]
pub(crate) mod tests {
    use super::*;
    use crate::policy::{EnvProfile, LandlockProfile, Limits, SeccompProfile};
    use crate::syscalls::SYSCALLS;

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
                syscalls: syscalls
                    .iter()
                    .map(|s| crate::syscalls::Syscall::resolve(s).unwrap())
                    .collect(),
                errno: crate::syscalls::Errno::EPERM,
            },
            network,
            unix_sockets: vec![],
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
        let programs = build(&profile(SeccompMode::Deny, DEFAULT_DENY, false), true).unwrap();
        // x32 guard (x86_64), profile, enosys, containment.
        let expected = if cfg!(target_arch = "x86_64") { 4 } else { 3 };
        assert_eq!(programs.len(), expected);
        assert!(programs.iter().all(|p| !p.is_empty() && p.len() < 4096));
    }

    #[test]
    fn enosys_and_containment_are_in_every_stack() {
        let base = if cfg!(target_arch = "x86_64") { 1 } else { 0 };
        for p in [
            profile(SeccompMode::Allow, &["read", "write", "exit_group"], true),
            profile(SeccompMode::Allow, &["read", "clone3"], true),
            profile(SeccompMode::Deny, &["ptrace"], false),
        ] {
            assert_eq!(build(&p, false).unwrap().len(), base + 3);
        }
        // An empty deny list has no profile filter, but keeps the other two.
        let programs = build(&profile(SeccompMode::Deny, &[], true), false).unwrap();
        assert_eq!(programs.len(), base + 2);
    }

    /// A classic-BPF interpreter for the instructions seccompiler emits, to run the stack on
    /// a `seccomp_data` the way the kernel does: every filter, most restrictive action wins,
    /// the most recent filter's data among equal actions.
    fn run(programs: &[BpfProgram], nr: i64, args: [u64; 6]) -> u32 {
        let arch: u32 = if cfg!(target_arch = "x86_64") {
            62 | 0x8000_0000 | 0x4000_0000
        } else {
            183 | 0x8000_0000 | 0x4000_0000
        };
        let mut data = Vec::with_capacity(64);
        data.extend_from_slice(&(nr as i32).to_ne_bytes());
        data.extend_from_slice(&arch.to_ne_bytes());
        data.extend_from_slice(&0u64.to_ne_bytes());
        for a in args {
            data.extend_from_slice(&a.to_ne_bytes());
        }
        let word = |off: u32| {
            let o = off as usize;
            u32::from_ne_bytes(data[o..o + 4].try_into().unwrap())
        };
        let eval = |prog: &BpfProgram| -> u32 {
            let (mut acc, mut pc) = (0u32, 0usize);
            loop {
                let i = &prog[pc];
                let code = u32::from(i.code);
                pc += 1;
                match code {
                    c if c == libc::BPF_LD | libc::BPF_W | libc::BPF_ABS => acc = word(i.k),
                    c if c == libc::BPF_ALU | libc::BPF_AND | libc::BPF_K => acc &= i.k,
                    c if c == libc::BPF_RET | libc::BPF_K => return i.k,
                    c if c == libc::BPF_JMP | libc::BPF_JA => pc += i.k as usize,
                    c if c & 0x07 == libc::BPF_JMP => {
                        let taken = match c & 0xf0 {
                            op if op == libc::BPF_JEQ => acc == i.k,
                            op if op == libc::BPF_JGT => acc > i.k,
                            op if op == libc::BPF_JGE => acc >= i.k,
                            op if op == libc::BPF_JSET => acc & i.k != 0,
                            op => panic!("jump op {op:#x}"),
                        };
                        pc += usize::from(if taken { i.jt } else { i.jf });
                    }
                    c => panic!("instruction {c:#x}"),
                }
            }
        };
        // The kernel compares actions as signed 32-bit values: lower is more restrictive
        // (KILL_PROCESS, 0x80000000, is the lowest).
        let rank = |r: u32| (r & 0xffff_0000) as i32;
        let mut verdict = libc::SECCOMP_RET_ALLOW;
        for p in programs.iter().rev() {
            let r = eval(p);
            if rank(r) < rank(verdict) {
                verdict = r;
            }
        }
        verdict
    }

    const ALLOW: u32 = libc::SECCOMP_RET_ALLOW;
    const EPERM: u32 = libc::SECCOMP_RET_ERRNO | libc::EPERM as u32;
    const ENOSYS: u32 = libc::SECCOMP_RET_ERRNO | libc::ENOSYS as u32;

    fn nr(name: &str) -> i64 {
        syscall_number(name).unwrap()
    }

    fn both_profiles() -> [Profile; 2] {
        [
            profile(SeccompMode::Deny, DEFAULT_DENY, false),
            // A permissive allow list, so that only the containment rules decide.
            profile(
                SeccompMode::Allow,
                &SYSCALLS.iter().map(|(n, _)| &n[4..]).collect::<Vec<_>>(),
                false,
            ),
        ]
    }

    #[test]
    fn clone_with_namespace_flags_is_denied_threads_and_fork_are_not() {
        const SIGCHLD: u64 = 17;
        // What glibc's pthread_create passes, and fork.
        let thread = (libc::CLONE_VM
            | libc::CLONE_FS
            | libc::CLONE_FILES
            | libc::CLONE_SIGHAND
            | libc::CLONE_THREAD
            | libc::CLONE_SYSVSEM
            | libc::CLONE_SETTLS
            | libc::CLONE_PARENT_SETTID
            | libc::CLONE_CHILD_CLEARTID) as u64;
        let fork = (libc::CLONE_CHILD_SETTID | libc::CLONE_CHILD_CLEARTID) as u64 | SIGCHLD;
        for p in both_profiles() {
            let progs = build(&p, false).unwrap();
            assert_eq!(run(&progs, nr("clone"), [thread, 0, 0, 0, 0, 0]), ALLOW);
            assert_eq!(run(&progs, nr("clone"), [fork, 0, 0, 0, 0, 0]), ALLOW);
            for &(name, flag) in CLONE_NEW {
                let r = run(&progs, nr("clone"), [flag | SIGCHLD, 0, 0, 0, 0, 0]);
                assert_eq!(r, EPERM, "clone {name}");
                let r = run(&progs, nr("unshare"), [flag, 0, 0, 0, 0, 0]);
                assert_eq!(r, EPERM, "unshare {name}");
                // High bits of the register do not hide the flag.
                let r = run(
                    &progs,
                    nr("clone"),
                    [flag | 0xffff_0000_0000_0000, 0, 0, 0, 0, 0],
                );
                assert_eq!(r, EPERM, "clone {name} with high bits");
            }
            // clone3 always gets ENOSYS, even where an allow list names it.
            assert_eq!(run(&progs, nr("clone3"), [0; 6]), ENOSYS);
            assert_eq!(run(&progs, nr("openat2"), [0; 6]), ENOSYS);
        }
    }

    #[test]
    fn ipc_foreign_exec_owner_and_xattr_calls_are_denied() {
        for p in both_profiles() {
            let progs = build(&p, false).unwrap();
            for name in LINGERING_IPC
                .iter()
                .chain(FOREIGN_EXEC)
                .chain(OWNER_AND_XATTR)
                .chain(NAMESPACE_JOIN)
                .chain(CONTAINMENT)
            {
                if let Some(n) = syscall_number(name) {
                    assert_eq!(run(&progs, n, [0; 6]), EPERM, "{name}");
                }
            }
            let memfd = nr("memfd_create");
            assert_eq!(run(&progs, memfd, [0, 0, 0, 0, 0, 0]), EPERM);
            assert_eq!(run(&progs, memfd, [0, 1, 0, 0, 0, 0]), EPERM, "MFD_CLOEXEC");
            assert_eq!(run(&progs, memfd, [0, 0x10, 0, 0, 0, 0]), EPERM, "MFD_EXEC");
            assert_eq!(
                run(&progs, memfd, [0, 0x9, 0, 0, 0, 0]),
                ALLOW,
                "NOEXEC_SEAL"
            );
            for &(name, request) in INODE_FLAG_IOCTLS {
                assert_eq!(
                    run(&progs, nr("ioctl"), [3, request, 0, 0, 0, 0]),
                    EPERM,
                    "{name}"
                );
            }
            // FS_IOC_GETFLAGS, TCGETS: allowed.
            assert_eq!(
                run(&progs, nr("ioctl"), [3, 0x8008_6601, 0, 0, 0, 0]),
                ALLOW
            );
            assert_eq!(run(&progs, nr("ioctl"), [0, 0x5401, 0, 0, 0, 0]), ALLOW);
        }
    }

    #[test]
    fn special_mode_bits_are_denied_and_shared_uid_denies_every_mode_and_time_change() {
        for p in both_profiles() {
            let own = build(&p, false).unwrap();
            let shared = build(&p, true).unwrap();
            for &(name, arg) in CHMOD_FAMILY {
                let Some(n) = syscall_number(name) else {
                    continue;
                };
                let with = |mode: u64| {
                    let mut a = [0u64; 6];
                    a[usize::from(arg)] = mode;
                    a
                };
                for mode in [0o4777, 0o6755, 0o2755, 0o1777, 0o104755] {
                    assert_eq!(run(&own, n, with(mode)), EPERM, "{name} {mode:o}");
                }
                assert_eq!(run(&own, n, with(0o755)), ALLOW, "{name} 755");
                assert_eq!(run(&shared, n, with(0o755)), EPERM, "{name} 755 shared");
                assert_eq!(run(&shared, n, with(0)), EPERM, "{name} 000 shared");
            }
            for name in ["utimensat", "utime", "utimes", "futimesat"] {
                if let Some(n) = syscall_number(name) {
                    assert_eq!(run(&own, n, [0; 6]), ALLOW, "{name}");
                    assert_eq!(run(&shared, n, [0; 6]), EPERM, "{name} shared");
                }
            }
            // Creating a setuid or setgid file.
            let creat = libc::O_CREAT as u64 | libc::O_WRONLY as u64;
            let openat = nr("openat");
            assert_eq!(run(&own, openat, [0, 0, creat, 0o4755, 0, 0]), EPERM);
            assert_eq!(run(&own, openat, [0, 0, creat, 0o2755, 0, 0]), EPERM);
            let tmpfile = libc::O_TMPFILE as u64 | libc::O_RDWR as u64;
            assert_eq!(run(&own, openat, [0, 0, tmpfile, 0o6755, 0, 0]), EPERM);
            assert_eq!(run(&own, openat, [0, 0, creat, 0o755, 0, 0]), ALLOW);
            // Without O_CREAT the mode is ignored by the kernel, and so by the filter.
            assert_eq!(run(&own, openat, [0, 0, 0, 0o4755, 0, 0]), ALLOW);
            let mknodat = nr("mknodat");
            let reg = libc::S_IFREG as u64;
            assert_eq!(run(&own, mknodat, [0, 0, reg | 0o4755, 0, 0, 0]), EPERM);
            assert_eq!(run(&own, mknodat, [0, 0, reg | 0o644, 0, 0, 0]), ALLOW);
        }
    }

    #[test]
    fn unix_sockets_only_when_listed_and_socketpair_streams_always() {
        let unix = libc::AF_UNIX as u64;
        let inet = libc::AF_INET as u64;
        let stream = libc::SOCK_STREAM as u64 | libc::SOCK_CLOEXEC as u64;
        let dgram = libc::SOCK_DGRAM as u64 | libc::SOCK_CLOEXEC as u64;
        let seqpacket = libc::SOCK_SEQPACKET as u64;
        let (socket, pair) = (nr("socket"), nr("socketpair"));
        for network in [false, true] {
            let mut p = profile(SeccompMode::Deny, DEFAULT_DENY, network);
            let progs = build(&p, false).unwrap();
            assert_eq!(run(&progs, socket, [unix, stream, 0, 0, 0, 0]), EPERM);
            assert_eq!(run(&progs, socket, [unix, dgram, 0, 0, 0, 0]), EPERM);
            let inet_verdict = if network { ALLOW } else { EPERM };
            assert_eq!(
                run(&progs, socket, [inet, stream, 0, 0, 0, 0]),
                inet_verdict
            );
            assert_eq!(run(&progs, pair, [unix, stream, 0, 0, 0, 0]), ALLOW);
            assert_eq!(run(&progs, pair, [unix, seqpacket, 0, 0, 0, 0]), ALLOW);
            assert_eq!(run(&progs, pair, [unix, dgram, 0, 0, 0, 0]), EPERM);

            p.unix_sockets = vec!["/run/x.sock".into()];
            let progs = build(&p, false).unwrap();
            assert_eq!(run(&progs, socket, [unix, stream, 0, 0, 0, 0]), ALLOW);
            assert_eq!(
                run(&progs, socket, [inet, stream, 0, 0, 0, 0]),
                inet_verdict
            );
            assert_eq!(run(&progs, pair, [unix, dgram, 0, 0, 0, 0]), ALLOW);
        }
    }

    #[test]
    fn the_profiles_errno_is_the_filters() {
        let mut p = profile(SeccompMode::Deny, &["ptrace"], false);
        p.seccomp.errno = crate::syscalls::Errno::resolve("EACCES").unwrap();
        let progs = build(&p, false).unwrap();
        let verdict = run(&progs, libc::SYS_ptrace, [0; 6]);
        assert_eq!(verdict, libc::SECCOMP_RET_ERRNO | libc::EACCES as u32);
    }

    #[test]
    fn a_template_and_its_seal_decide_as_the_whole_stack() {
        for name in ENOSYS_ALWAYS {
            assert!(!TEMPLATE_CARVED.contains(name), "{name} is carved");
        }
        // Argument patterns that reach every conditional rule: namespace flags, modes with
        // setuid bits, O_CREAT, socket domains and types, inode-flag ioctls.
        let mut patterns = vec![[0u64; 6], [u64::MAX; 6]];
        for v in [
            libc::CLONE_NEWUSER as u64,
            0x80,
            libc::S_ISUID as u64,
            libc::S_ISGID as u64,
            libc::S_ISVTX as u64,
            libc::O_CREAT as u64 | libc::S_ISUID as u64,
            libc::AF_INET as u64,
            libc::AF_UNIX as u64,
            libc::SOCK_DGRAM as u64,
            0x4008_6602,
            MFD_NOEXEC_SEAL,
        ] {
            for arg in 0..4 {
                let mut a = [0u64; 6];
                a[arg] = v;
                patterns.push(a);
                let mut b = [v; 6];
                b[arg] = 0;
                patterns.push(b);
            }
        }
        let mut strict = profile(
            SeccompMode::Allow,
            &[
                "read",
                "write",
                "openat",
                "exit_group",
                "clone",
                "prctl",
                "chdir",
            ],
            false,
        );
        strict.seccomp.errno = crate::syscalls::Errno::resolve("EACCES").unwrap();
        let mut profiles = both_profiles().to_vec();
        profiles.push(strict);
        profiles.push(profile(
            SeccompMode::Deny,
            &["setresuid", "landlock_create_ruleset", "ptrace"],
            true,
        ));
        for p in &profiles {
            for shared_uid in [false, true] {
                let whole = build(p, shared_uid).unwrap();
                let (template, seal) = build_split(p, shared_uid).unwrap();
                let stacked: Vec<BpfProgram> = template.iter().chain(&seal).cloned().collect();
                for (name, nr) in SYSCALLS {
                    for args in &patterns {
                        assert_eq!(
                            run(&stacked, *nr, *args),
                            run(&whole, *nr, *args),
                            "{name} {args:?} (mode {:?}, shared_uid {shared_uid})",
                            p.seccomp.mode
                        );
                    }
                }
                // The carved calls are allowed in the template, whatever the profile says.
                for name in TEMPLATE_CARVED {
                    if let Some(nr) = syscall_number(name) {
                        assert_eq!(run(&template, nr, [0; 6]), ALLOW, "{name}");
                    }
                }
                // And the seal is small, one filter where the profile's errno is EPERM: that
                // is its point.
                assert!(seal.iter().map(Vec::len).sum::<usize>() < 400);
                if p.seccomp.errno.number() == libc::EPERM {
                    assert!(seal.len() <= 1, "{} seal filters", seal.len());
                }
            }
        }
    }

    #[test]
    fn encode_decode_roundtrip() {
        let programs = build(&profile(SeccompMode::Deny, DEFAULT_DENY, false), true).unwrap();
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
