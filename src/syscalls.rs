//! Kernel names a policy may use and the sandbox compiles: syscall names to numbers for the
//! architectures the seccomp filters are built for, and the errno names a filtered syscall
//! may return. One module that both `policy` (which checks and resolves the names at load)
//! and `sandbox` (which builds the filters) import, so neither depends on the other for it.
//!
//! Most numbers come from `libc::SYS_*`, so the compiler checks each name against the C
//! library's tables; syscalls newer than the `libc` release in use are listed with their
//! number from the kernel's tables (from 424 on, numbers are the same on every architecture).

macro_rules! table {
    ([$($name:ident),* $(,)?], [$(($extra:literal, $nr:literal)),* $(,)?]) => {
        &[$((stringify!($name), libc::$name as i64),)* $((concat!("SYS_", $extra), $nr),)*]
    };
}

/// `("SYS_name", number)` for every syscall of x86_64, in no particular order.
#[cfg(target_arch = "x86_64")]
#[rustfmt::skip]
pub static SYSCALLS: &[(&str, i64)] = table!(
    [
        SYS__sysctl, SYS_accept, SYS_accept4, SYS_access, SYS_acct, SYS_add_key, SYS_adjtimex,
        SYS_afs_syscall, SYS_alarm, SYS_arch_prctl, SYS_bind, SYS_bpf, SYS_brk, SYS_capget,
        SYS_capset, SYS_chdir, SYS_chmod, SYS_chown, SYS_chroot, SYS_clock_adjtime,
        SYS_clock_getres, SYS_clock_gettime, SYS_clock_nanosleep, SYS_clock_settime, SYS_clone,
        SYS_clone3, SYS_close, SYS_close_range, SYS_connect, SYS_copy_file_range, SYS_creat,
        SYS_delete_module, SYS_dup, SYS_dup2, SYS_dup3, SYS_epoll_create, SYS_epoll_create1,
        SYS_epoll_ctl, SYS_epoll_ctl_old, SYS_epoll_pwait, SYS_epoll_pwait2, SYS_epoll_wait,
        SYS_epoll_wait_old, SYS_eventfd, SYS_eventfd2, SYS_execve, SYS_execveat, SYS_exit,
        SYS_exit_group, SYS_faccessat, SYS_faccessat2, SYS_fadvise64, SYS_fallocate,
        SYS_fanotify_init, SYS_fanotify_mark, SYS_fchdir, SYS_fchmod, SYS_fchmodat, SYS_fchmodat2,
        SYS_fchown, SYS_fchownat, SYS_fcntl, SYS_fdatasync, SYS_fgetxattr, SYS_finit_module,
        SYS_flistxattr, SYS_flock, SYS_fork, SYS_fremovexattr, SYS_fsconfig, SYS_fsetxattr,
        SYS_fsmount, SYS_fsopen, SYS_fspick, SYS_fstat, SYS_fstatfs, SYS_fsync, SYS_ftruncate,
        SYS_futex, SYS_futex_waitv, SYS_futimesat, SYS_get_mempolicy, SYS_get_robust_list,
        SYS_get_thread_area, SYS_getcpu, SYS_getcwd, SYS_getdents, SYS_getdents64, SYS_getegid,
        SYS_geteuid, SYS_getgid, SYS_getgroups, SYS_getitimer, SYS_getpeername, SYS_getpgid,
        SYS_getpgrp, SYS_getpid, SYS_getpmsg, SYS_getppid, SYS_getpriority, SYS_getrandom,
        SYS_getresgid, SYS_getresuid, SYS_getrlimit, SYS_getrusage, SYS_getsid, SYS_getsockname,
        SYS_getsockopt, SYS_gettid, SYS_gettimeofday, SYS_getuid, SYS_getxattr, SYS_init_module,
        SYS_inotify_add_watch, SYS_inotify_init, SYS_inotify_init1, SYS_inotify_rm_watch,
        SYS_io_cancel, SYS_io_destroy, SYS_io_getevents, SYS_io_setup, SYS_io_submit,
        SYS_io_uring_enter, SYS_io_uring_register, SYS_io_uring_setup, SYS_ioctl, SYS_ioperm,
        SYS_iopl, SYS_ioprio_get, SYS_ioprio_set, SYS_kcmp, SYS_kexec_file_load, SYS_kexec_load,
        SYS_keyctl, SYS_kill, SYS_landlock_add_rule, SYS_landlock_create_ruleset,
        SYS_landlock_restrict_self, SYS_lchown, SYS_lgetxattr, SYS_link, SYS_linkat, SYS_listen,
        SYS_listxattr, SYS_llistxattr, SYS_lookup_dcookie, SYS_lremovexattr, SYS_lseek,
        SYS_lsetxattr, SYS_lstat, SYS_madvise, SYS_mbind, SYS_membarrier, SYS_memfd_create,
        SYS_memfd_secret, SYS_migrate_pages, SYS_mincore, SYS_mkdir, SYS_mkdirat, SYS_mknod,
        SYS_mknodat, SYS_mlock, SYS_mlock2, SYS_mlockall, SYS_mmap, SYS_modify_ldt, SYS_mount,
        SYS_mount_setattr, SYS_move_mount, SYS_move_pages, SYS_mprotect, SYS_mq_getsetattr,
        SYS_mq_notify, SYS_mq_open, SYS_mq_timedreceive, SYS_mq_timedsend, SYS_mq_unlink,
        SYS_mremap, SYS_mseal, SYS_msgctl, SYS_msgget, SYS_msgrcv, SYS_msgsnd, SYS_msync,
        SYS_munlock, SYS_munlockall, SYS_munmap, SYS_name_to_handle_at, SYS_nanosleep,
        SYS_newfstatat, SYS_nfsservctl, SYS_open, SYS_open_by_handle_at, SYS_open_tree, SYS_openat,
        SYS_openat2, SYS_pause, SYS_perf_event_open, SYS_personality, SYS_pidfd_getfd,
        SYS_pidfd_open, SYS_pidfd_send_signal, SYS_pipe, SYS_pipe2, SYS_pivot_root, SYS_pkey_alloc,
        SYS_pkey_free, SYS_pkey_mprotect, SYS_poll, SYS_ppoll, SYS_prctl, SYS_pread64, SYS_preadv,
        SYS_preadv2, SYS_prlimit64, SYS_process_madvise, SYS_process_mrelease,
        SYS_process_vm_readv, SYS_process_vm_writev, SYS_pselect6, SYS_ptrace, SYS_putpmsg,
        SYS_pwrite64, SYS_pwritev, SYS_pwritev2, SYS_quotactl, SYS_quotactl_fd, SYS_read,
        SYS_readahead, SYS_readlink, SYS_readlinkat, SYS_readv, SYS_reboot, SYS_recvfrom,
        SYS_recvmmsg, SYS_recvmsg, SYS_remap_file_pages, SYS_removexattr, SYS_rename, SYS_renameat,
        SYS_renameat2, SYS_request_key, SYS_restart_syscall, SYS_rmdir, SYS_rseq, SYS_rt_sigaction,
        SYS_rt_sigpending, SYS_rt_sigprocmask, SYS_rt_sigqueueinfo, SYS_rt_sigreturn,
        SYS_rt_sigsuspend, SYS_rt_sigtimedwait, SYS_rt_tgsigqueueinfo, SYS_sched_get_priority_max,
        SYS_sched_get_priority_min, SYS_sched_getaffinity, SYS_sched_getattr, SYS_sched_getparam,
        SYS_sched_getscheduler, SYS_sched_rr_get_interval, SYS_sched_setaffinity,
        SYS_sched_setattr, SYS_sched_setparam, SYS_sched_setscheduler, SYS_sched_yield,
        SYS_seccomp, SYS_security, SYS_select, SYS_semctl, SYS_semget, SYS_semop, SYS_semtimedop,
        SYS_sendfile, SYS_sendmmsg, SYS_sendmsg, SYS_sendto, SYS_set_mempolicy,
        SYS_set_mempolicy_home_node, SYS_set_robust_list, SYS_set_thread_area, SYS_set_tid_address,
        SYS_setdomainname, SYS_setfsgid, SYS_setfsuid, SYS_setgid, SYS_setgroups, SYS_sethostname,
        SYS_setitimer, SYS_setns, SYS_setpgid, SYS_setpriority, SYS_setregid, SYS_setresgid,
        SYS_setresuid, SYS_setreuid, SYS_setrlimit, SYS_setsid, SYS_setsockopt, SYS_settimeofday,
        SYS_setuid, SYS_setxattr, SYS_shmat, SYS_shmctl, SYS_shmdt, SYS_shmget, SYS_shutdown,
        SYS_sigaltstack, SYS_signalfd, SYS_signalfd4, SYS_socket, SYS_socketpair, SYS_splice,
        SYS_stat, SYS_statfs, SYS_statx, SYS_swapoff, SYS_swapon, SYS_symlink, SYS_symlinkat,
        SYS_sync, SYS_sync_file_range, SYS_syncfs, SYS_sysfs, SYS_sysinfo, SYS_syslog, SYS_tee,
        SYS_tgkill, SYS_time, SYS_timer_create, SYS_timer_delete, SYS_timer_getoverrun,
        SYS_timer_gettime, SYS_timer_settime, SYS_timerfd_create, SYS_timerfd_gettime,
        SYS_timerfd_settime, SYS_times, SYS_tkill, SYS_truncate, SYS_tuxcall, SYS_umask,
        SYS_umount2, SYS_uname, SYS_unlink, SYS_unlinkat, SYS_unshare, SYS_uselib, SYS_userfaultfd,
        SYS_ustat, SYS_utime, SYS_utimensat, SYS_utimes, SYS_vfork, SYS_vhangup, SYS_vmsplice,
        SYS_vserver, SYS_wait4, SYS_waitid, SYS_write, SYS_writev,
    ],
    [
        ("create_module", 174), ("get_kernel_syms", 177), ("query_module", 178),
        ("io_pgetevents", 333), ("uretprobe", 335), ("uprobe", 336), ("cachestat", 451),
        ("map_shadow_stack", 453), ("futex_wake", 454), ("futex_wait", 455),
        ("futex_requeue", 456), ("statmount", 457), ("listmount", 458), ("lsm_get_self_attr", 459),
        ("lsm_set_self_attr", 460), ("lsm_list_modules", 461), ("setxattrat", 463),
        ("getxattrat", 464), ("listxattrat", 465), ("removexattrat", 466), ("open_tree_attr", 467),
        ("file_getattr", 468), ("file_setattr", 469),
    ]
);

/// `("SYS_name", number)` for every syscall of aarch64, in no particular order.
#[cfg(target_arch = "aarch64")]
#[rustfmt::skip]
pub static SYSCALLS: &[(&str, i64)] = table!(
    [
        SYS_accept, SYS_accept4, SYS_acct, SYS_add_key, SYS_adjtimex, SYS_bind, SYS_bpf, SYS_brk,
        SYS_capget, SYS_capset, SYS_chdir, SYS_chroot, SYS_clock_adjtime, SYS_clock_getres,
        SYS_clock_gettime, SYS_clock_nanosleep, SYS_clock_settime, SYS_clone, SYS_clone3,
        SYS_close, SYS_close_range, SYS_connect, SYS_copy_file_range, SYS_delete_module, SYS_dup,
        SYS_dup3, SYS_epoll_create1, SYS_epoll_ctl, SYS_epoll_pwait, SYS_epoll_pwait2,
        SYS_eventfd2, SYS_execve, SYS_execveat, SYS_exit, SYS_exit_group, SYS_faccessat,
        SYS_faccessat2, SYS_fadvise64, SYS_fallocate, SYS_fanotify_init, SYS_fanotify_mark,
        SYS_fchdir, SYS_fchmod, SYS_fchmodat, SYS_fchown, SYS_fchownat, SYS_fcntl, SYS_fdatasync,
        SYS_fgetxattr, SYS_finit_module, SYS_flistxattr, SYS_flock, SYS_fremovexattr, SYS_fsconfig,
        SYS_fsetxattr, SYS_fsmount, SYS_fsopen, SYS_fspick, SYS_fstat, SYS_fstatfs, SYS_fsync,
        SYS_ftruncate, SYS_futex, SYS_futex_waitv, SYS_get_mempolicy, SYS_get_robust_list,
        SYS_getcpu, SYS_getcwd, SYS_getdents64, SYS_getegid, SYS_geteuid, SYS_getgid,
        SYS_getgroups, SYS_getitimer, SYS_getpeername, SYS_getpgid, SYS_getpid, SYS_getppid,
        SYS_getpriority, SYS_getrandom, SYS_getresgid, SYS_getresuid, SYS_getrusage, SYS_getsid,
        SYS_getsockname, SYS_getsockopt, SYS_gettid, SYS_gettimeofday, SYS_getuid, SYS_getxattr,
        SYS_init_module, SYS_inotify_add_watch, SYS_inotify_init1, SYS_inotify_rm_watch,
        SYS_io_cancel, SYS_io_destroy, SYS_io_getevents, SYS_io_setup, SYS_io_submit,
        SYS_io_uring_enter, SYS_io_uring_register, SYS_io_uring_setup, SYS_ioctl, SYS_ioprio_get,
        SYS_ioprio_set, SYS_kcmp, SYS_kexec_file_load, SYS_kexec_load, SYS_keyctl, SYS_kill,
        SYS_landlock_add_rule, SYS_landlock_create_ruleset, SYS_landlock_restrict_self,
        SYS_lgetxattr, SYS_linkat, SYS_listen, SYS_listxattr, SYS_llistxattr, SYS_lookup_dcookie,
        SYS_lremovexattr, SYS_lseek, SYS_lsetxattr, SYS_madvise, SYS_mbind, SYS_membarrier,
        SYS_memfd_create, SYS_memfd_secret, SYS_migrate_pages, SYS_mincore, SYS_mkdirat,
        SYS_mknodat, SYS_mlock, SYS_mlock2, SYS_mlockall, SYS_mmap, SYS_mount, SYS_mount_setattr,
        SYS_move_mount, SYS_move_pages, SYS_mprotect, SYS_mq_getsetattr, SYS_mq_notify,
        SYS_mq_open, SYS_mq_timedreceive, SYS_mq_timedsend, SYS_mq_unlink, SYS_mremap, SYS_mseal,
        SYS_msgctl, SYS_msgget, SYS_msgrcv, SYS_msgsnd, SYS_msync, SYS_munlock, SYS_munlockall,
        SYS_munmap, SYS_name_to_handle_at, SYS_nanosleep, SYS_newfstatat, SYS_nfsservctl,
        SYS_open_by_handle_at, SYS_open_tree, SYS_openat, SYS_openat2, SYS_perf_event_open,
        SYS_personality, SYS_pidfd_getfd, SYS_pidfd_open, SYS_pidfd_send_signal, SYS_pipe2,
        SYS_pivot_root, SYS_pkey_alloc, SYS_pkey_free, SYS_pkey_mprotect, SYS_ppoll, SYS_prctl,
        SYS_pread64, SYS_preadv, SYS_preadv2, SYS_prlimit64, SYS_process_madvise,
        SYS_process_mrelease, SYS_process_vm_readv, SYS_process_vm_writev, SYS_pselect6,
        SYS_ptrace, SYS_pwrite64, SYS_pwritev, SYS_pwritev2, SYS_quotactl, SYS_quotactl_fd,
        SYS_read, SYS_readahead, SYS_readlinkat, SYS_readv, SYS_reboot, SYS_recvfrom, SYS_recvmmsg,
        SYS_recvmsg, SYS_remap_file_pages, SYS_removexattr, SYS_renameat2, SYS_request_key,
        SYS_restart_syscall, SYS_rseq, SYS_rt_sigaction, SYS_rt_sigpending, SYS_rt_sigprocmask,
        SYS_rt_sigqueueinfo, SYS_rt_sigreturn, SYS_rt_sigsuspend, SYS_rt_sigtimedwait,
        SYS_rt_tgsigqueueinfo, SYS_sched_get_priority_max, SYS_sched_get_priority_min,
        SYS_sched_getaffinity, SYS_sched_getattr, SYS_sched_getparam, SYS_sched_getscheduler,
        SYS_sched_rr_get_interval, SYS_sched_setaffinity, SYS_sched_setattr, SYS_sched_setparam,
        SYS_sched_setscheduler, SYS_sched_yield, SYS_seccomp, SYS_semctl, SYS_semget, SYS_semop,
        SYS_semtimedop, SYS_sendfile, SYS_sendmmsg, SYS_sendmsg, SYS_sendto, SYS_set_mempolicy,
        SYS_set_mempolicy_home_node, SYS_set_robust_list, SYS_set_tid_address, SYS_setdomainname,
        SYS_setfsgid, SYS_setfsuid, SYS_setgid, SYS_setgroups, SYS_sethostname, SYS_setitimer,
        SYS_setns, SYS_setpgid, SYS_setpriority, SYS_setregid, SYS_setresgid, SYS_setresuid,
        SYS_setreuid, SYS_setsid, SYS_setsockopt, SYS_settimeofday, SYS_setuid, SYS_setxattr,
        SYS_shmat, SYS_shmctl, SYS_shmdt, SYS_shmget, SYS_shutdown, SYS_sigaltstack, SYS_signalfd4,
        SYS_socket, SYS_socketpair, SYS_splice, SYS_statfs, SYS_statx, SYS_swapoff, SYS_swapon,
        SYS_symlinkat, SYS_sync, SYS_syncfs, SYS_sysinfo, SYS_syslog, SYS_tee, SYS_tgkill,
        SYS_timer_create, SYS_timer_delete, SYS_timer_getoverrun, SYS_timer_gettime,
        SYS_timer_settime, SYS_timerfd_create, SYS_timerfd_gettime, SYS_timerfd_settime, SYS_times,
        SYS_tkill, SYS_truncate, SYS_umask, SYS_umount2, SYS_uname, SYS_unlinkat, SYS_unshare,
        SYS_userfaultfd, SYS_utimensat, SYS_vhangup, SYS_vmsplice, SYS_wait4, SYS_waitid,
        SYS_write, SYS_writev,
    ],
    [
        ("renameat", 38), ("sync_file_range", 84), ("getrlimit", 163), ("setrlimit", 164),
        ("io_pgetevents", 292), ("cachestat", 451), ("fchmodat2", 452), ("map_shadow_stack", 453),
        ("futex_wake", 454), ("futex_wait", 455), ("futex_requeue", 456), ("statmount", 457),
        ("listmount", 458), ("lsm_get_self_attr", 459), ("lsm_set_self_attr", 460),
        ("lsm_list_modules", 461), ("setxattrat", 463), ("getxattrat", 464), ("listxattrat", 465),
        ("removexattrat", 466), ("open_tree_attr", 467), ("file_getattr", 468),
        ("file_setattr", 469),
    ]
);

/// No table on other architectures: every name is unknown there.
#[cfg(not(any(target_arch = "x86_64", target_arch = "aarch64")))]
pub static SYSCALLS: &[(&str, i64)] = &[];

/// The syscall number of `name` (without `SYS_`) on this architecture, if it has one.
pub fn syscall_number(name: &str) -> Option<i64> {
    SYSCALLS
        .iter()
        .find(|(n, _)| n.strip_prefix("SYS_") == Some(name))
        .map(|&(_, nr)| nr)
}

/// The errno names a profile may use for filtered syscalls.
pub const ERRNOS: &[(&str, i32)] = &[
    ("EPERM", libc::EPERM),
    ("EACCES", libc::EACCES),
    ("ENOSYS", libc::ENOSYS),
    ("EINVAL", libc::EINVAL),
];

/// A syscall a policy names, resolved to its number on this architecture at load: a
/// validated policy holds only syscalls this machine has (the name is kept for reviewers).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Syscall {
    name: String,
    nr: i64,
}

impl Syscall {
    /// `None` for a name this architecture does not have.
    pub fn resolve(name: &str) -> Option<Syscall> {
        syscall_number(name).map(|nr| Syscall {
            name: name.to_string(),
            nr,
        })
    }

    pub fn name(&self) -> &str {
        &self.name
    }

    pub fn nr(&self) -> i64 {
        self.nr
    }
}

/// The errno a filtered syscall returns, one of [`ERRNOS`], resolved at load.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Errno {
    name: &'static str,
    number: i32,
}

impl Errno {
    /// The default errno of a profile.
    pub const EPERM: Errno = Errno {
        name: "EPERM",
        number: libc::EPERM,
    };

    /// `None` for a name not in [`ERRNOS`].
    pub fn resolve(name: &str) -> Option<Errno> {
        ERRNOS
            .iter()
            .find(|(n, _)| *n == name)
            .map(|&(name, number)| Errno { name, number })
    }

    pub fn name(&self) -> &'static str {
        self.name
    }

    pub fn number(&self) -> i32 {
        self.number
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn names_resolve_to_numbers_or_not_at_all() {
        let e = Errno::resolve("EACCES").unwrap();
        assert_eq!((e.name(), e.number()), ("EACCES", libc::EACCES));
        assert_eq!(Errno::resolve("EPERM"), Some(Errno::EPERM));
        assert_eq!(Errno::resolve("EWHATEVER"), None);
        assert_eq!(Errno::resolve("eperm"), None);
        let s = Syscall::resolve("ptrace").unwrap();
        assert_eq!((s.name(), s.nr()), ("ptrace", libc::SYS_ptrace));
        assert_eq!(Syscall::resolve("nonsense"), None);
        assert_eq!(Syscall::resolve("SYS_ptrace"), None);
    }
}
