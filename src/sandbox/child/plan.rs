//! The launcher's steps, in their fixed order, over [`Kernel`]: [`template_steps`] once per
//! template, then [`Plan::run`] in each worker it creates.
//!
//! Template (inherited by every worker): parent death, capabilities (lock: securebits, empty
//! bounding set, no ambient; both read back), no_new_privs, seccomp (the profile's stack, the
//! launcher's own calls carved out). Then, per call and before the worker exists, the plan is
//! prepared (`Plan::prepare`: the spec, the C strings, the rlimits, the Landlock ruleset).
//!
//! Worker: process group, parent death, cgroup, signals, close fds, rlimits, chdir, Landlock,
//! identity (made non-dumpable first; PDEATHSIG re-armed and the parent re-checked after),
//! capabilities (drop), seccomp (the seal: the carved calls as the profile decides them),
//! report, execve. The worker shares the template's memory until `execve`: each step is a
//! system call on prepared data, and a failure is a [`Failure`] that allocates nothing.
//!
//! Why this split keeps the worker exactly as strict: what the template does is the same for
//! every call and irreversible in the right direction (a dropped bounding capability, a
//! locked securebit, no_new_privs and a filter are inherited and never come back); the
//! per-call steps need calls the profile may deny (the uid switch, Landlock, capset,
//! setpgid), so the template's stack allows exactly those (`TEMPLATE_CARVED` in the daemon's
//! `seccomp.rs`) and the seal denies them again as the profile does; between the two, only
//! this launcher's code runs (the tool is exec'd after the seal). The equivalence of template
//! stack + seal and the whole stack is tested syscall by syscall over a BPF interpreter
//! (`seccomp.rs`).

use rustix::process::Resource;

use super::kernel::Kernel;
use super::report::{Failure, Line, Message};
use super::Plan;
use crate::sandbox::wire::{LandlockStatus, Rlimits, Step};

impl Plan {
    /// Runs every step; returns only if one failed (or, over the fake, once `execve` is
    /// reached). Allocates nothing.
    pub(super) fn run<K: Kernel>(&self, k: &mut K) -> Result<K::Exec, Failure<'_>> {
        // 1. We must lead our own process group: the daemon signals and confirms the worker
        //    by group, and the template's child made it so before anything else.
        if k.getpgrp() != k.getpid() {
            return Err(Failure::new(
                Step::ProcessGroup,
                libc::EPERM,
                Message::Text("the launcher does not lead its own process group"),
            ));
        }

        // 2. Die with the daemon. PDEATHSIG only covers a parent that exits *after* it is set,
        //    so the parent is checked again right after: if it already changed, the daemon
        //    (or the thread that forked us) is gone and nobody would ever reap or bound us.
        k.set_parent_death_kill()
            .map_err(|e| Failure::call(Step::ParentDeath, "PR_SET_PDEATHSIG", e))?;
        check_parent(k, self.parent)?;

        // 3. Join the worker's cgroup first, so that everything from here on (and every
        //    descendant) is counted and killable there, and while the path is still reachable
        //    (Landlock comes later).
        if let Some(procs) = &self.cgroup_procs {
            k.join_cgroup(procs).map_err(|e| {
                Failure::new(
                    Step::Cgroup,
                    e.raw_os_error(),
                    Message::Path("cannot join", procs),
                )
            })?;
        }

        // 4. Signals: the Rust runtime of the template ignores SIGPIPE, and an ignored signal
        //    survives execve; restore the default and an empty mask for the tool.
        k.default_sigpipe()
            .map_err(|e| Failure::call(Step::Signals, "SIGPIPE", e))?;
        k.unblock_all_signals()
            .map_err(|e| Failure::call(Step::Signals, "sigprocmask", e))?;

        // 5. Every inherited descriptor but stdio, the channel and the progress pipe (when the
        //    caller asked for progress: the tool's one extra descriptor, named by
        //    `$AIRLOCK_PROGRESS_FD`) closes at execve, so that nothing else of the daemon's,
        //    the spawner's or the template's reaches the tool. They are marked close-on-exec
        //    rather than closed: the template's Landlock ruleset is one, used in step 8.
        //    The progress pipe moves to the lowest number past stdio the channel does not
        //    hold (3, or 4), so that any shell can name it (dash takes one digit only).
        //    The pipe came over the spawner's socket close-on-exec: its copy at `to` is made
        //    inheritable (the original, elsewhere, is marked with the rest).
        let mut keep = [self.channel_fd as u32, u32::MAX];
        if let Some((fd, to)) = self.progress {
            if fd == to {
                k.make_inheritable(fd)
                    .map_err(|e| Failure::call(Step::CloseFds, "fcntl of the progress pipe", e))?;
            } else {
                // `to` is not the channel (nor `fd`).
                k.dup2(fd, to)
                    .map_err(|e| Failure::call(Step::CloseFds, "dup2 of the progress pipe", e))?;
            }
            keep[1] = to as u32;
        }
        keep.sort_unstable();
        let mut first = 3u32;
        for fd in keep.into_iter().filter(|fd| (3..u32::MAX).contains(fd)) {
            if fd > first {
                k.cloexec_range(first, fd - 1)
                    .map_err(|e| Failure::call(Step::CloseFds, "close_range", e))?;
            }
            first = first.max(fd + 1);
        }
        k.cloexec_range(first, u32::MAX)
            .map_err(|e| Failure::call(Step::CloseFds, "close_range", e))?;

        // 6. Resource limits (RLIMIT_NPROC resolved in the template, see [`rlimits`]).
        for (resource, name, value) in self.rlimits {
            k.setrlimit(resource, value).map_err(|e| {
                Failure::new(
                    Step::Rlimits,
                    e.raw_os_error(),
                    Message::Rlimit(name, value),
                )
            })?;
        }

        // 7. The working directory, by path, before Landlock could forbid the lookup.
        k.chdir(&self.cwd).map_err(|e| {
            Failure::new(
                Step::Chdir,
                e.raw_os_error(),
                Message::Path("cannot chdir to", &self.cwd),
            )
        })?;

        // 8. Landlock: the ruleset the template built (its paths opened with our
        //    capabilities), enforced, fully unless the profile says best effort.
        let status = k
            .landlock(&self.landlock)
            .map_err(|e| Failure::call(Step::Landlock, "landlock_restrict_self", e))?;
        if status != LandlockStatus::FullyEnforced && !self.landlock.best_effort {
            return Err(Failure::new(
                Step::Landlock,
                libc::EOPNOTSUPP,
                Message::Landlock {
                    status,
                    kernel_abi: self.landlock.kernel_abi,
                    profile_abi: self.landlock.profile_abi,
                },
            ));
        }

        // 9. (The capability lock and the empty bounding set came from the template.)

        // 10. Identity: a worker with a uid of its own switches to it (and to the gid of the
        //     same number, with no supplementary groups). From here, file permissions protect
        //     everything the worker does not own, metadata included, which Landlock does not.
        //     We share the template's memory until execve: non-dumpable first, so no process
        //     of the worker's uid can read it through /proc or ptrace whatever the
        //     system's suid_dumpable (execve makes the tool dumpable again, as its own).
        if let Some((uid, gid)) = self.identity {
            k.set_undumpable()
                .map_err(|e| Failure::call(Step::Identity, "PR_SET_DUMPABLE", e))?;
            switch_identity(k, uid, gid)?;
            // The kernel clears PDEATHSIG when the credentials change (commit_creds): set it
            // again, and check again that the daemon did not die in between.
            k.set_parent_death_kill().map_err(|e| {
                Failure::call(
                    Step::ParentDeath,
                    "PR_SET_PDEATHSIG after the uid switch",
                    e,
                )
            })?;
            check_parent(k, self.parent)?;
        }

        // 11. Capabilities: drop what is left of the sets, and read them back (the ambient and
        //     bounding sets were read back in the template).
        drop_capabilities(k)?;

        // 12. (no_new_privs came from the template.)

        // 13. The seal last: it denies, as the profile does, the calls the steps above make
        //     and the template's stack left to it.
        for (i, program) in self.seccomp.iter().enumerate() {
            k.seccomp(program).map_err(|e| {
                Failure::new(Step::Seccomp, e.raw_os_error(), Message::Filter("seal", i))
            })?;
        }

        // 14. Report success, then make the channel close on exec: EOF after `ok` tells the
        //     daemon the tool is running. A failed execve still has the channel to report on.
        //     A daemon that went away (its end closed) makes the write fail (SIGPIPE, whose
        //     default is back since step 4): the tool is never run for nobody.
        let mut ok = Line::new();
        {
            use std::fmt::Write as _;
            let _ = write!(
                ok,
                r#"{{"report":"ok","landlock":"{}","landlock_abi":{}}}"#,
                status.as_str(),
                self.landlock.kernel_abi
            );
            ok.finish("\n");
        }
        k.report(ok.bytes())
            .map_err(|e| Failure::call(Step::Report, "cannot write the report", e))?;
        k.channel_cloexec()
            .map_err(|e| Failure::call(Step::Report, "FD_CLOEXEC on the channel", e))?;

        k.execve(&self.exe, &self.argv_ptrs, &self.env_ptrs)
            .map_err(|e| {
                Failure::new(
                    Step::Execve,
                    e.raw_os_error(),
                    Message::Path("cannot execute", &self.exe),
                )
            })
    }
}

/// The parent must be the daemon.
fn check_parent<K: Kernel>(k: &mut K, expected: i32) -> Result<(), Failure<'static>> {
    let got = k.getppid();
    if got != expected {
        return Err(Failure::new(
            Step::ParentDeath,
            libc::ESRCH,
            Message::Parent { got, expected },
        ));
    }
    Ok(())
}

/// The template's steps, once: what every worker of a profile starts with. `stack` is the
/// profile's seccomp stack with the launcher's calls carved out.
pub(super) fn template_steps<K: Kernel>(
    k: &mut K,
    daemon: i32,
    stack: &[seccompiler::BpfProgram],
) -> Result<(), Failure<'static>> {
    // T1. Die with the daemon (our parent, through CLONE_PARENT), and check it is still it.
    k.set_parent_death_kill()
        .map_err(|e| Failure::call(Step::ParentDeath, "PR_SET_PDEATHSIG", e))?;
    check_parent(k, daemon)?;
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
        .map_err(|e| Failure::call(Step::NoNewPrivs, "PR_SET_NO_NEW_PRIVS", e))?;
    // T4. The profile's stack, the launcher's calls carved out: converted and JIT-compiled
    //     once here, shared by every worker created from us.
    for (i, program) in stack.iter().enumerate() {
        k.seccomp(program).map_err(|e| {
            Failure::new(
                Step::Seccomp,
                e.raw_os_error(),
                Message::Filter("template", i),
            )
        })?;
    }
    Ok(())
}

/// Step 6's limits, resolved in the template. RLIMIT_NPROC counts the tasks of the whole real
/// uid, not the worker's. A worker with a uid of its own (`own_uid`) gets the profile's
/// `processes`: its leased uid runs nothing else (an earlier worker's group is confirmed gone
/// before its uid is leased again), and if something did, it would only lower the worker's
/// budget, never raise it. A worker sharing the daemon's uid (`uid`, ours) gets what that uid
/// already runs plus `processes`, counted by `tasks_of_uid` (one pass over /proc per spawn:
/// the price of sharing). The kernel does not apply the limit to uid 0 at all; there the
/// cgroup's pids.max is the only process bound.
pub(super) fn rlimits(
    limits: &Rlimits,
    own_uid: Option<u32>,
    uid: u32,
    tasks_of_uid: impl FnOnce(u32) -> u64,
) -> [(Resource, &'static str, u64); 6] {
    let nproc = if own_uid.is_some() || uid == 0 {
        limits.processes
    } else {
        tasks_of_uid(uid).saturating_add(limits.processes)
    };
    [
        (Resource::Cpu, "RLIMIT_CPU", limits.cpu_seconds),
        (Resource::As, "RLIMIT_AS", limits.address_space_bytes),
        (Resource::Fsize, "RLIMIT_FSIZE", limits.file_size_bytes),
        (Resource::Nofile, "RLIMIT_NOFILE", limits.open_files),
        (Resource::Nproc, "RLIMIT_NPROC", nproc),
        (Resource::Core, "RLIMIT_CORE", 0),
    ]
}

/// Template step T2. With CAP_SETPCAP (a root daemon): securebits that stop uid 0 from regaining
/// capabilities on execve and keep the uid switch from touching them, then an empty
/// bounding set. Without it (an unprivileged daemon) neither is possible nor needed: its
/// permitted set is emptied in step 11 and no_new_privs follows. Ambient goes either way.
/// Returns whether CAP_SETPCAP was held (the bounding set was emptied).
fn lock_capabilities<K: Kernel>(k: &mut K) -> Result<bool, Failure<'static>> {
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
        .map_err(|e| Failure::call(step, "PR_SET_SECUREBITS", e))?;
        k.bounding_drop_all()
            .map_err(|e| Failure::call(step, "PR_CAPBSET_DROP", e))?;
    }
    k.ambient_clear()
        .map_err(|e| Failure::call(step, "PR_CAP_AMBIENT_CLEAR_ALL", e))?;
    Ok(setpcap)
}

/// Template step T2, read back: the ambient set must be empty, and so must the bounding set
/// where T2 could empty it (`setpcap`) or where it would matter (uid 0). Every worker created
/// from the template inherits both as read here.
fn check_inherited_capabilities<K: Kernel>(
    k: &mut K,
    setpcap: bool,
) -> Result<(), Failure<'static>> {
    let step = Step::Capabilities;
    let ambient = k
        .ambient_set()
        .map_err(|e| Failure::call(step, "PR_CAP_AMBIENT_IS_SET", e))?;
    let mut bounding = k
        .bounding_set()
        .map_err(|e| Failure::call(step, "PR_CAPBSET_READ", e))?;
    // Without CAP_SETPCAP (a non-root daemon) the bounding set cannot be emptied; it then
    // bounds nothing, since each worker's permitted set is emptied, its uid is not 0, and
    // no_new_privs follows.
    if bounding != 0 && !setpcap && k.ids().1 != 0 {
        bounding = 0;
    }
    if ambient != 0 || bounding != 0 {
        return Err(Failure::new(
            step,
            libc::EPERM,
            Message::Left([("ambient", ambient), ("bounding", bounding), ("", 0)]),
        ));
    }
    Ok(())
}

fn has_setpcap<K: Kernel>(k: &mut K) -> Result<bool, Failure<'static>> {
    const CAP_SETPCAP: u32 = 8;
    let (effective, _, _) = k
        .capget()
        .map_err(|e| Failure::call(Step::Capabilities, "capget", e))?;
    Ok(effective & (1 << CAP_SETPCAP) != 0)
}

/// Step 10. No supplementary groups, then the gid, then the uid (last: it takes away the
/// right to change the others). Each is set for real, effective and saved ids and read back.
fn switch_identity<K: Kernel>(k: &mut K, uid: u32, gid: u32) -> Result<(), Failure<'static>> {
    let step = Step::Identity;
    k.setgroups_empty()
        .map_err(|e| Failure::call(step, "setgroups([])", e))?;
    k.setresgid(gid)
        .map_err(|e| Failure::call(step, "setresgid", e))?;
    k.setresuid(uid)
        .map_err(|e| Failure::call(step, "setresuid", e))?;
    let now = k.ids();
    if now != (uid, uid, gid, gid) {
        return Err(Failure::new(
            step,
            libc::EPERM,
            Message::Ids { uid, gid, now },
        ));
    }
    Ok(())
}

/// Step 11. Empties the permitted, effective and inheritable sets (ambient went in T2, and
/// is cleared again), then reads them back: each must be empty. The ambient set needs no
/// read here: the kernel keeps it inside permitted and inheritable, so it is empty once they
/// are; the bounding set was read back in the template (T2) and nothing since can raise it.
fn drop_capabilities<K: Kernel>(k: &mut K) -> Result<(), Failure<'static>> {
    let step = Step::Capabilities;
    k.ambient_clear()
        .map_err(|e| Failure::call(step, "PR_CAP_AMBIENT_CLEAR_ALL", e))?;
    // A daemon that holds no capabilities (the shipped unit: none, and capset denied by its
    // SystemCallFilter=~@privileged) has nothing to drop: capset is skipped, and the sets
    // are still read back below.
    let (effective, permitted, inheritable) =
        k.capget().map_err(|e| Failure::call(step, "capget", e))?;
    if effective | permitted | inheritable != 0 {
        k.capset_empty()
            .map_err(|e| Failure::call(step, "capset", e))?;
    }

    let (effective, permitted, inheritable) =
        k.capget().map_err(|e| Failure::call(step, "capget", e))?;
    if effective | permitted | inheritable != 0 {
        return Err(Failure::new(
            step,
            libc::EPERM,
            Message::Left([
                ("effective", effective),
                ("permitted", permitted),
                ("inheritable", inheritable),
            ]),
        ));
    }
    Ok(())
}
