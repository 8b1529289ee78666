//! The launcher's steps, in their fixed order, over [`Kernel`]: [`template_steps`] once per
//! template, then [`Plan::run`] in each worker forked from it.
//!
//! Template (inherited by every worker forked from it): parent death, capabilities (lock:
//! securebits, empty bounding set, no ambient; both read back), no_new_privs, seccomp (the
//! profile's stack, the launcher's own calls carved out).
//!
//! Worker: process group, parent death, cgroup, signals, close fds, rlimits, chdir, Landlock,
//! identity (with PDEATHSIG re-armed and the parent re-checked), capabilities (drop),
//! seccomp (the seal: the carved calls as the profile decides them), report, execve.
//!
//! Why this split keeps the worker exactly as strict: what the template does is the same for
//! every call and irreversible in the right direction (a dropped bounding capability, a
//! locked securebit, no_new_privs and a filter are inherited over fork and never come back);
//! the per-call steps need calls the profile may deny (the uid switch, Landlock, capset,
//! setpgid), so the template's stack allows exactly those (`TEMPLATE_CARVED` in the daemon's
//! `seccomp.rs`) and the seal
//! denies them again as the profile does; between the two, only this launcher's code runs
//! (the tool is exec'd after the seal). The equivalence of template stack + seal and the
//! whole stack is tested syscall by syscall over a BPF interpreter (`seccomp.rs`).

use std::os::fd::{AsFd, AsRawFd, IntoRawFd};

use rustix::process::Resource;

use super::kernel::Kernel;
use super::{Failure, Plan};
use crate::sandbox::wire::{Report, Rlimits, Step};

impl Plan {
    /// Runs every step; returns only if one failed (or, over the fake, once `execve` is
    /// reached).
    pub(super) fn run<K: Kernel>(self, k: &mut K) -> Result<K::Exec, Failure> {
        // 1. We must lead our own process group: the daemon signals and confirms the worker
        //    by group, and the spawner's child made it so before anything else.
        if k.getpgrp() != k.getpid() {
            return Err(Failure::new(
                Step::ProcessGroup,
                libc::EPERM,
                "the launcher does not lead its own process group",
            ));
        }

        // 2. Die with the daemon. PDEATHSIG only covers a parent that exits *after* it is set,
        //    so the parent is checked again right after: if it already changed, the daemon
        //    (or the thread that forked us) is gone and nobody would ever reap or bound us.
        k.set_parent_death_kill()
            .map_err(|e| Failure::errno(Step::ParentDeath, "PR_SET_PDEATHSIG", e))?;
        let parent = k.getppid();
        if parent != self.spec.parent {
            return Err(Failure::new(
                Step::ParentDeath,
                libc::ESRCH,
                format!(
                    "the parent is pid {parent}, expected the daemon, pid {}",
                    self.spec.parent
                ),
            ));
        }

        // 3. Join the worker's cgroup first, so that everything from here on (and every
        //    descendant) is counted and killable there, and while the path is still reachable
        //    (Landlock comes later).
        if let Some(cgroup) = &self.spec.cgroup {
            let procs = cgroup.join("cgroup.procs");
            k.join_cgroup(&procs)
                .map_err(|e| Failure::io(Step::Cgroup, procs.display(), e))?;
        }

        // 4. Signals: the Rust runtime of this launcher ignores SIGPIPE, and an ignored signal
        //    survives execve; restore the default and an empty mask for the tool.
        k.default_sigpipe()
            .map_err(|e| Failure::io(Step::Signals, "SIGPIPE", e))?;
        k.unblock_all_signals()
            .map_err(|e| Failure::io(Step::Signals, "sigprocmask", e))?;

        // 5. Close every inherited descriptor but stdio, the channel and the progress pipe
        //    (when the caller asked for progress: the tool's one extra descriptor, named by
        //    `$AIRLOCK_PROGRESS_FD`), before anything else is opened, so that nothing else
        //    of the daemon's leaks into the tool.
        //    The progress pipe moves to the lowest number past stdio the channel does not
        //    hold (3, or 4), so that any shell can name it (dash takes one digit only).
        //    The pipe came over the spawner's socket close-on-exec: its copy at `to` is made
        //    inheritable.
        let mut keep = vec![self.channel_fd as u32];
        if let Some((fd, to)) = self.progress {
            if fd.as_raw_fd() == to {
                k.make_inheritable(fd.as_fd())
                    .map_err(|e| Failure::io(Step::CloseFds, "fcntl of the progress pipe", e))?;
                // Kept open at `to` for the tool.
                let _ = fd.into_raw_fd();
            } else {
                // `to` is not the channel (nor `fd`).
                k.dup2(fd.as_fd(), to)
                    .map_err(|e| Failure::io(Step::CloseFds, "dup2 of the progress pipe", e))?;
                // `fd` itself is closed here, before the close_range below.
                drop(fd);
            }
            keep.push(to as u32);
        }
        keep.sort_unstable();
        let mut first = 3u32;
        for fd in keep.into_iter().filter(|fd| *fd >= 3) {
            if fd > first {
                k.close_range(first, fd - 1)
                    .map_err(|e| Failure::io(Step::CloseFds, "close_range", e))?;
            }
            first = first.max(fd + 1);
        }
        k.close_range(first, u32::MAX)
            .map_err(|e| Failure::io(Step::CloseFds, "close_range", e))?;

        // 6. Resource limits, while /proc is still readable (RLIMIT_NPROC needs a count of
        //    what a shared uid already runs; a uid of the worker's own runs nothing).
        set_rlimits(k, &self.spec.rlimits, self.spec.identity.map(|(u, _)| u))?;

        // 7. The working directory, by path, before Landlock could forbid the lookup.
        k.chdir(&self.spec.cwd)
            .map_err(|e| Failure::io(Step::Chdir, self.spec.cwd.display(), e))?;

        // 8. Landlock, while we still hold the capabilities to open every rule's path (and
        //    CAP_SYS_ADMIN, so a root daemon does not even need no_new_privs for it).
        let applied = k
            .landlock(&self.spec.landlock)
            .map_err(|f| Failure::new(Step::Landlock, f.errno, f.message))?;

        // 9. (The capability lock and the empty bounding set came from the template.)

        // 10. Identity: a worker with a uid of its own switches to it (and to the gid of the
        //     same number, with no supplementary groups). From here, file permissions protect
        //     everything the worker does not own, metadata included, which Landlock does not.
        if let Some((uid, gid)) = self.spec.identity {
            switch_identity(k, uid, gid)?;
            // The kernel clears PDEATHSIG when the credentials change (commit_creds): set it
            // again, and check again that the daemon did not die in between.
            rearm_parent_death(k, self.spec.parent)?;
        }

        // 11. Capabilities: drop what is left of the sets, and read them back (the ambient and
        //     bounding sets were read back in the template).
        drop_capabilities(k)?;

        // 12. (no_new_privs came from the template.)

        // 13. The seal last: it denies, as the profile does, the calls the steps above make
        //     and the template's stack left to it.
        for (i, program) in self.seccomp.iter().enumerate() {
            k.seccomp(program).map_err(|e| {
                let errno = match &e {
                    seccompiler::Error::Seccomp(io) | seccompiler::Error::Prctl(io) => {
                        io.raw_os_error().unwrap_or(0)
                    }
                    _ => libc::EINVAL,
                };
                Failure::new(
                    Step::Seccomp,
                    errno,
                    format!("cannot install seal filter {i}: {e}"),
                )
            })?;
        }

        // 14. Report success, then make the channel close on exec: EOF after `ok` tells the
        //     daemon the tool is running. A failed execve still has the channel to report on.
        let ok = Report::Ok {
            landlock: applied.status,
            landlock_abi: applied.abi,
        };
        k.report(&ok.line())
            .map_err(|e| Failure::io(Step::Report, "cannot write the report", e))?;
        k.channel_cloexec()
            .map_err(|e| Failure::errno(Step::Report, "FD_CLOEXEC on the channel", e))?;

        k.execve(&self.exe, &self.argv, &self.env).map_err(|err| {
            Failure::new(
                Step::Execve,
                err as i32,
                format!("cannot execute {:?}: {}", self.spec.argv[0], err.desc()),
            )
        })
    }
}

/// The template's steps, once: what every worker of a profile starts with. `stack` is the
/// profile's seccomp stack with the launcher's calls carved out.
pub(super) fn template_steps<K: Kernel>(
    k: &mut K,
    daemon: i32,
    stack: &[seccompiler::BpfProgram],
) -> Result<(), Failure> {
    // T1. Die with the daemon (our parent, through CLONE_PARENT), and check it is still it.
    k.set_parent_death_kill()
        .map_err(|e| Failure::errno(Step::ParentDeath, "PR_SET_PDEATHSIG", e))?;
    let parent = k.getppid();
    if parent != daemon {
        return Err(Failure::new(
            Step::ParentDeath,
            libc::ESRCH,
            format!("the parent is pid {parent}, expected the daemon, pid {daemon}"),
        ));
    }
    // T2. Capabilities, the part that needs CAP_SETPCAP: lock the securebits (uid 0 can
    //     never regain capabilities, and a worker's uid switch does not drop them behind its
    //     back) and empty the bounding set. The permitted set stays (CAP_SETUID/CAP_SETGID
    //     for the workers' uid switch); each worker empties it. Then the ambient and bounding
    //     sets are read back, here once for every worker: nothing a worker's steps do can
    //     raise either (the bounding set only shrinks, and the ambient set is raised only by
    //     PR_CAP_AMBIENT_RAISE, which the launcher never makes and the locked securebits
    //     forbid).
    let setpcap = lock_capabilities(k)?;
    check_inherited_capabilities(k, setpcap)?;
    // T3. no_new_privs: no setuid bit or file capability can give anything back; seccomp
    //     requires it as well.
    k.set_no_new_privs()
        .map_err(|e| Failure::errno(Step::NoNewPrivs, "PR_SET_NO_NEW_PRIVS", e))?;
    // T4. The profile's stack, the launcher's calls carved out: converted and JIT-compiled
    //     once here, shared by every worker forked from us.
    for (i, program) in stack.iter().enumerate() {
        k.seccomp(program).map_err(|e| {
            let errno = match &e {
                seccompiler::Error::Seccomp(io) | seccompiler::Error::Prctl(io) => {
                    io.raw_os_error().unwrap_or(0)
                }
                _ => libc::EINVAL,
            };
            Failure::new(
                Step::Seccomp,
                errno,
                format!("cannot install template filter {i}: {e}"),
            )
        })?;
    }
    Ok(())
}

/// Step 6. RLIMIT_NPROC counts the tasks of the whole real uid, not the worker's. A worker
/// with a uid of its own (`own_uid`) gets the profile's `processes`: its leased uid runs
/// nothing else (an earlier worker's group is confirmed gone before its uid is leased
/// again), and if something did, it would only lower the worker's budget, never raise it.
/// A worker sharing the daemon's uid gets what that uid already runs plus `processes`,
/// counted in /proc (one pass over the host's processes per spawn: the price of sharing).
/// The kernel does not apply the limit to uid 0 at all; there the cgroup's pids.max is the
/// only process bound.
fn set_rlimits<K: Kernel>(
    k: &mut K,
    limits: &Rlimits,
    own_uid: Option<u32>,
) -> Result<(), Failure> {
    let shared = k.getuid();
    let nproc = if own_uid.is_some() || shared == 0 {
        limits.processes
    } else {
        k.tasks_of_uid(shared).saturating_add(limits.processes)
    };
    let all = [
        (Resource::Cpu, "RLIMIT_CPU", limits.cpu_seconds),
        (Resource::As, "RLIMIT_AS", limits.address_space_bytes),
        (Resource::Fsize, "RLIMIT_FSIZE", limits.file_size_bytes),
        (Resource::Nofile, "RLIMIT_NOFILE", limits.open_files),
        (Resource::Nproc, "RLIMIT_NPROC", nproc),
        (Resource::Core, "RLIMIT_CORE", 0),
    ];
    for (resource, name, value) in all {
        k.setrlimit(resource, value)
            .map_err(|e| Failure::errno(Step::Rlimits, format!("{name} = {value}"), e))?;
    }
    Ok(())
}

/// Template step T2. With CAP_SETPCAP (a root daemon): securebits that stop uid 0 from regaining
/// capabilities on execve and keep the uid switch from touching them, then an empty
/// bounding set. Without it (an unprivileged daemon) neither is possible nor needed: its
/// permitted set is emptied in step 11 and no_new_privs follows. Ambient goes either way.
/// Returns whether CAP_SETPCAP was held (the bounding set was emptied).
fn lock_capabilities<K: Kernel>(k: &mut K) -> Result<bool, Failure> {
    const SECBIT_NOROOT: u32 = 1 << 0;
    const SECBIT_NOROOT_LOCKED: u32 = 1 << 1;
    const SECBIT_NO_SETUID_FIXUP: u32 = 1 << 2;
    const SECBIT_NO_SETUID_FIXUP_LOCKED: u32 = 1 << 3;
    const SECBIT_KEEP_CAPS_LOCKED: u32 = 1 << 5;
    const SECBIT_NO_CAP_AMBIENT_RAISE: u32 = 1 << 6;
    const SECBIT_NO_CAP_AMBIENT_RAISE_LOCKED: u32 = 1 << 7;
    let step = Step::Capabilities;
    let setpcap = has_setpcap(k)?;
    if setpcap {
        k.set_securebits(
            SECBIT_NOROOT
                | SECBIT_NOROOT_LOCKED
                | SECBIT_NO_SETUID_FIXUP
                | SECBIT_NO_SETUID_FIXUP_LOCKED
                | SECBIT_KEEP_CAPS_LOCKED
                | SECBIT_NO_CAP_AMBIENT_RAISE
                | SECBIT_NO_CAP_AMBIENT_RAISE_LOCKED,
        )
        .map_err(|e| Failure::io(step, "PR_SET_SECUREBITS", e))?;
        k.bounding_drop_all()
            .map_err(|e| Failure::io(step, "PR_CAPBSET_DROP", e))?;
    }
    k.ambient_clear()
        .map_err(|e| Failure::io(step, "PR_CAP_AMBIENT_CLEAR_ALL", e))?;
    Ok(setpcap)
}

/// Template step T2, read back: the ambient set must be empty, and so must the bounding set
/// where T2 could empty it (`setpcap`) or where it would matter (uid 0). Every worker forked
/// from the template inherits both as read here.
fn check_inherited_capabilities<K: Kernel>(k: &mut K, setpcap: bool) -> Result<(), Failure> {
    let step = Step::Capabilities;
    let ambient = k
        .ambient_set()
        .map_err(|e| Failure::io(step, "PR_CAP_AMBIENT_IS_SET", e))?;
    let bounding = k
        .bounding_set()
        .map_err(|e| Failure::io(step, "PR_CAPBSET_READ", e))?;
    let mut left = Vec::new();
    if ambient != 0 {
        left.push(format!("ambient {ambient:#x}"));
    }
    // Without CAP_SETPCAP (a non-root daemon) the bounding set cannot be emptied; it then
    // bounds nothing, since each worker's permitted set is emptied, its uid is not 0, and
    // no_new_privs follows.
    if bounding != 0 && (setpcap || k.ids().1 == 0) {
        left.push(format!("bounding {bounding:#x}"));
    }
    if !left.is_empty() {
        return Err(Failure::new(
            step,
            libc::EPERM,
            format!("capabilities remain after dropping: {}", left.join(", ")),
        ));
    }
    Ok(())
}

fn has_setpcap<K: Kernel>(k: &mut K) -> Result<bool, Failure> {
    const CAP_SETPCAP: u32 = 8;
    let (effective, _, _) = k
        .capget()
        .map_err(|e| Failure::io(Step::Capabilities, "capget", e))?;
    Ok(effective & (1 << CAP_SETPCAP) != 0)
}

/// Step 10. No supplementary groups, then the gid, then the uid (last: it takes away the
/// right to change the others). Each is set for real, effective and saved ids and read back.
fn switch_identity<K: Kernel>(k: &mut K, uid: u32, gid: u32) -> Result<(), Failure> {
    let step = Step::Identity;
    k.setgroups_empty()
        .map_err(|e| Failure::errno(step, "setgroups([])", e))?;
    k.setresgid(gid)
        .map_err(|e| Failure::errno(step, "setresgid", e))?;
    k.setresuid(uid)
        .map_err(|e| Failure::errno(step, "setresuid", e))?;
    let now = k.ids();
    if now != (uid, uid, gid, gid) {
        return Err(Failure::new(
            step,
            libc::EPERM,
            format!("asked for uid {uid} gid {gid}, have (ruid, euid, rgid, egid) {now:?}"),
        ));
    }
    Ok(())
}

/// Step 10, after the uid switch: PDEATHSIG again (the switch cleared it), then the parent
/// check of step 2 again, since a daemon that died before this point sent us nothing.
fn rearm_parent_death<K: Kernel>(k: &mut K, expected: i32) -> Result<(), Failure> {
    k.set_parent_death_kill().map_err(|e| {
        Failure::errno(
            Step::ParentDeath,
            "PR_SET_PDEATHSIG after the uid switch",
            e,
        )
    })?;
    let parent = k.getppid();
    if parent != expected {
        return Err(Failure::new(
            Step::ParentDeath,
            libc::ESRCH,
            format!("the parent is pid {parent}, expected the daemon, pid {expected}"),
        ));
    }
    Ok(())
}

/// Step 11. Empties the permitted, effective and inheritable sets (ambient went in T2, and
/// is cleared again), then reads them back: each must be empty. The ambient set needs no
/// read here: the kernel keeps it inside permitted and inheritable, so it is empty once they
/// are; the bounding set was read back in the template (T2) and nothing since can raise it.
fn drop_capabilities<K: Kernel>(k: &mut K) -> Result<(), Failure> {
    let step = Step::Capabilities;
    k.ambient_clear()
        .map_err(|e| Failure::io(step, "PR_CAP_AMBIENT_CLEAR_ALL", e))?;
    // A daemon that holds no capabilities (the shipped unit: none, and capset denied by its
    // SystemCallFilter=~@privileged) has nothing to drop: capset is skipped, and the sets
    // are still read back below.
    let (effective, permitted, inheritable) =
        k.capget().map_err(|e| Failure::io(step, "capget", e))?;
    if effective | permitted | inheritable != 0 {
        k.capset_empty()
            .map_err(|e| Failure::io(step, "capset", e))?;
    }

    let (effective, permitted, inheritable) =
        k.capget().map_err(|e| Failure::io(step, "capget", e))?;
    let mut left = Vec::new();
    for (name, mask) in [
        ("effective", effective),
        ("permitted", permitted),
        ("inheritable", inheritable),
    ] {
        if mask != 0 {
            left.push(format!("{name} {mask:#x}"));
        }
    }
    if !left.is_empty() {
        return Err(Failure::new(
            step,
            libc::EPERM,
            format!("capabilities remain after dropping: {}", left.join(", ")),
        ));
    }
    Ok(())
}
