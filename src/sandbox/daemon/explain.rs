//! `airlock policy explain`: the effective sandbox of a profile, in words, for a reviewer.
//! It is derived from the same profile fields (and the same constants) the launcher and the
//! seccomp builder use, so it cannot describe a sandbox other than the one applied.

use std::fmt::Write;
use std::path::Path;

use crate::policy::{Profile, SeccompMode};

use super::seccomp::{
    CHMOD_FAMILY, CLONE_NEW, CONTAINMENT, ENOSYS_ALWAYS, FOREIGN_EXEC, INODE_FLAG_IOCTLS,
    LINGERING_IPC, NAMESPACE_JOIN, OWNER_AND_XATTR, SHARED_UID_DENIED, SPECIAL_MODE_BITS,
};

/// A human-readable description of the sandbox `profile` gives a worker.
pub fn explain(profile: &Profile) -> String {
    let mut s = String::new();
    // Writing to a String cannot fail; `let _` keeps the lines short.
    let _ = writeln!(s, "profile {}", profile.name);

    let ll = &profile.landlock;
    let _ = writeln!(s, "\nfilesystem (Landlock):");
    let _ = writeln!(
        s,
        "  staging dir of the call     create, write, remove (no exec, no device nodes): the only writable workspace location"
    );
    let _ = writeln!(s, "  input files of the call     read");
    // A read path also granted exec or write is listed once, with its wider rights.
    let wider = |p: &&std::path::PathBuf| ll.exec.contains(p) || ll.write.contains(p);
    let read: Vec<_> = ll.read.iter().filter(|p| !wider(p)).collect();
    for (paths, rights) in [
        (read, "read"),
        (ll.exec.iter().collect(), "read+exec"),
        (ll.write.iter().collect(), "read+write (no create/remove)"),
    ] {
        for p in paths {
            let _ = writeln!(s, "  {:<27} {rights}{}", p.display(), absent(p));
        }
    }
    let _ = writeln!(s, "  everything else             denied");
    let _ = writeln!(
        s,
        "  Landlock ABI {} required{}",
        ll.abi,
        if ll.best_effort {
            "; best_effort: runs with whatever the kernel enforces (status recorded per call)"
        } else {
            " fully enforced; the call fails (step landlock) on a kernel below it"
        }
    );
    let _ = writeln!(
        s,
        "  signals and abstract Unix sockets scoped to the worker's own processes (ABI 6, required even with best_effort)"
    );
    let _ = writeln!(
        s,
        "  not covered by Landlock: metadata (modes, owners, times, xattrs, inode flags) and connect() to pathname Unix sockets; see the seccomp rules below"
    );

    let _ = writeln!(s, "\nnetwork:");
    if profile.network {
        let _ = writeln!(
            s,
            "  allowed: sockets of every family but AF_UNIX (no TCP restriction)"
        );
    } else {
        let _ = writeln!(
            s,
            "  denied: socket() with a domain other than AF_UNIX fails with EPERM (seccomp)"
        );
        if ll.abi >= 4 {
            let _ = writeln!(s, "  TCP bind and connect denied (Landlock)");
        }
    }
    if profile.unix_sockets.is_empty() {
        let _ = writeln!(
            s,
            "  Unix sockets: none; socket(AF_UNIX) fails with EPERM; socketpair() works for stream and seqpacket pairs (a datagram pair could sendto() any path, so it fails with EPERM)"
        );
    } else {
        let list = profile
            .unix_sockets
            .iter()
            .map(|p| p.display().to_string())
            .collect::<Vec<_>>()
            .join(", ");
        let _ = writeln!(s, "  Unix sockets listed: {list}");
        let _ = writeln!(
            s,
            "  WARNING: Landlock (ABI <= 7) does not mediate connect() to a pathname socket: socket(AF_UNIX) is allowed, so the worker reaches ANY pathname socket file permissions allow, not only these; abstract sockets stay scoped"
        );
    }

    let sc = &profile.seccomp;
    let _ = writeln!(s, "\nsyscalls (seccomp):");
    let list = if sc.syscalls.is_empty() {
        "(none)".to_string()
    } else {
        sc.syscalls
            .iter()
            .map(|c| c.name())
            .collect::<Vec<_>>()
            .join(", ")
    };
    match sc.mode {
        SeccompMode::Deny => {
            let _ = writeln!(
                s,
                "  allowed by default; denied with {}: {list}",
                sc.errno.name()
            );
        }
        SeccompMode::Allow => {
            let _ = writeln!(
                s,
                "  denied by default with {}; allowed: {list}",
                sc.errno.name()
            );
            let _ = writeln!(
                s,
                "  also allowed: {} (the launcher installs the filters, then execs the tool)",
                super::seccomp::ALLOW_LIST_ALWAYS.join(", ")
            );
        }
    }
    let _ = writeln!(s, "  in every profile, whatever the list above says:");
    let _ = writeln!(
        s,
        "    ENOSYS: {} (arguments in memory, unseen by seccomp; glibc falls back to clone/openat)",
        ENOSYS_ALWAYS.join(", ")
    );
    let _ = writeln!(
        s,
        "    EPERM: {} (the worker cannot leave its process group)",
        CONTAINMENT.join(", ")
    );
    let flags = CLONE_NEW.iter().map(|(n, _)| *n).collect::<Vec<_>>();
    let _ = writeln!(
        s,
        "    EPERM: clone and unshare with any of {}; {} (no namespaces; threads and fork work)",
        flags.join("|"),
        NAMESPACE_JOIN.join(", ")
    );
    let _ = writeln!(
        s,
        "    EPERM: {} (no SysV IPC or POSIX message queue outlives the call)",
        present(LINGERING_IPC)
    );
    let _ = writeln!(
        s,
        "    EPERM: {}; memfd_create without MFD_NOEXEC_SEAL (no exec outside the exec paths)",
        present(FOREIGN_EXEC)
    );
    let bits = SPECIAL_MODE_BITS
        .iter()
        .map(|(n, _)| *n)
        .collect::<Vec<_>>();
    let chmods = CHMOD_FAMILY.iter().map(|(n, _)| *n).collect::<Vec<_>>();
    let _ = writeln!(
        s,
        "    EPERM: {} with {} in the mode; open/openat (O_CREAT, O_TMPFILE), creat, mknod, mknodat with S_ISUID or S_ISGID",
        present(&chmods),
        bits.join("|")
    );
    let _ = writeln!(
        s,
        "    EPERM: {} (owners, extended attributes)",
        present(OWNER_AND_XATTR)
    );
    let ioctls = INODE_FLAG_IOCTLS
        .iter()
        .map(|(n, _)| *n)
        .collect::<Vec<_>>();
    let _ = writeln!(s, "    EPERM: ioctl {} (inode flags)", ioctls.join(", "));
    let _ = writeln!(
        s,
        "  when the worker shares the daemon's uid (an unprivileged daemon without CAP_SETUID), also:"
    );
    let _ = writeln!(
        s,
        "    EPERM: every {} (no mode or time change anywhere, staging included)",
        present(SHARED_UID_DENIED)
    );
    if cfg!(target_arch = "x86_64") {
        let _ = writeln!(
            s,
            "  x32 syscalls fail with ENOSYS; other architectures' syscalls kill the process"
        );
    }

    let _ = writeln!(s, "\nprivileges:");
    let _ = writeln!(s, "  all capabilities dropped (effective, permitted, inheritable, ambient, bounding); no_new_privs");

    let l = &profile.limits;
    let _ = writeln!(s, "\nlimits:");
    let _ = writeln!(s, "  CPU time          {} s (RLIMIT_CPU)", l.cpu_seconds);
    let _ = writeln!(
        s,
        "  address space     {} (RLIMIT_AS)",
        bytes(l.address_space_bytes)
    );
    let _ = writeln!(
        s,
        "  file size         {} (RLIMIT_FSIZE)",
        bytes(l.file_size_bytes)
    );
    let _ = writeln!(
        s,
        "  staging           {} in {} entries at most, checked after the worker exits (write tools)",
        bytes(l.staging_bytes),
        l.staging_files
    );
    let _ = writeln!(s, "  open files        {} (RLIMIT_NOFILE)", l.open_files);
    let _ = writeln!(
        s,
        "  processes         {} beyond those the uid already runs (RLIMIT_NPROC counts per uid, not for uid 0); pids.max where a cgroup is delegated",
        l.processes
    );
    let _ = writeln!(
        s,
        "  memory            {} (memory.max, where a cgroup is delegated)",
        bytes(l.memory_bytes)
    );
    let _ = writeln!(s, "  core dumps        off (RLIMIT_CORE 0)");
    let _ = writeln!(
        s,
        "  output            first {} of stdout and of stderr kept, the rest counted",
        bytes(l.output_bytes as u64)
    );
    let _ = writeln!(
        s,
        "  termination       SIGCONT+SIGTERM to the whole process group, {:?} grace, then SIGKILL; the call ends only when no process of the group remains",
        l.grace
    );

    let _ = writeln!(s, "\nenvironment:");
    let keep = if profile.env.keep.is_empty() {
        "(none)".to_string()
    } else {
        profile.env.keep.join(", ")
    };
    let _ = writeln!(s, "  kept from the daemon: {keep}");
    if profile.env.set.is_empty() {
        let _ = writeln!(s, "  set: (none)");
    }
    for (k, v) in &profile.env.set {
        let _ = writeln!(s, "  set: {k}={v}");
    }
    let _ = writeln!(s, "  nothing else is inherited");
    s
}

/// The names of `names` that exist on this architecture, comma-separated.
fn present(names: &[&str]) -> String {
    names
        .iter()
        .filter(|n| super::seccomp::syscall_number(n).is_some())
        .copied()
        .collect::<Vec<_>>()
        .join(", ")
}

fn absent(p: &Path) -> &'static str {
    if p.exists() {
        ""
    } else {
        "  (absent here: skipped)"
    }
}

fn bytes(n: u64) -> String {
    const UNITS: [(u64, &str); 3] = [(1 << 30, "GiB"), (1 << 20, "MiB"), (1 << 10, "KiB")];
    for (size, unit) in UNITS {
        if n >= size && n % size == 0 {
            return format!("{} {unit}", n / size);
        }
    }
    format!("{n} bytes")
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::policy::{EnvProfile, LandlockProfile, Limits, SeccompProfile};
    use std::path::PathBuf;

    #[test]
    fn names_every_part() {
        let profile = Profile {
            name: "default".into(),
            landlock: LandlockProfile {
                abi: 6,
                best_effort: false,
                read: vec![PathBuf::from("/etc")],
                exec: vec![PathBuf::from("/usr")],
                write: vec![PathBuf::from("/dev/null")],
            },
            seccomp: SeccompProfile {
                mode: SeccompMode::Deny,
                syscalls: ["ptrace", "clone3"]
                    .iter()
                    .map(|n| crate::syscalls::Syscall::resolve(n).unwrap())
                    .collect(),
                errno: crate::syscalls::Errno::EPERM,
            },
            network: false,
            unix_sockets: vec![],
            limits: Limits::default(),
            env: EnvProfile {
                keep: vec!["LANG".into()],
                set: [("PATH".into(), "/usr/bin".into())].into(),
            },
        };
        let text = explain(&profile);
        for needle in [
            "/etc",
            "read+exec",
            "/dev/null",
            "only writable workspace location",
            "ABI 6 required",
            "ptrace, clone3",
            "ENOSYS",
            "AF_UNIX",
            "setsid, setpgid",
            "CLONE_NEWUSER|CLONE_NEWPID",
            "clone3, openat2",
            "shmget",
            "mq_open",
            "execveat",
            "MFD_NOEXEC_SEAL",
            "S_ISUID|S_ISGID|S_ISVTX",
            "fchownat",
            "removexattr",
            "FS_IOC_SETFLAGS",
            "utimensat",
            "socket(AF_UNIX) fails with EPERM",
            "no exec",
            "connect() to pathname Unix sockets",
            "RLIMIT_NPROC",
            "2s grace",
            "1 MiB",
            "kept from the daemon: LANG",
            "PATH=/usr/bin",
        ] {
            assert!(text.contains(needle), "{needle:?} missing from:\n{text}");
        }
        assert!(!text.contains("WARNING"), "{text}");

        // A read path that is also exec is listed once, as read+exec.
        let mut both = profile.clone();
        both.landlock.read.push(PathBuf::from("/usr"));
        let text = explain(&both);
        assert_eq!(text.matches("  /usr ").count(), 1, "{text}");
        assert!(
            text.contains("/usr                        read+exec"),
            "{text}"
        );

        let listed = Profile {
            unix_sockets: vec![PathBuf::from("/run/x.sock")],
            ..profile
        };
        let text = explain(&listed);
        assert!(text.contains("Unix sockets listed: /run/x.sock"), "{text}");
        assert!(
            text.contains("WARNING: Landlock (ABI <= 7) does not mediate connect()"),
            "{text}"
        );
    }
}
