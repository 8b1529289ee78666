//! The launcher's plan over a recording fake kernel: step order, the parent re-check after the
//! uid switch, and the report each failing step produces. No root needed: nothing here makes
//! a system call of the plan's.

use std::ffi::{CStr, CString};
use std::io;
use std::os::fd::{AsRawFd, BorrowedFd, OwnedFd, RawFd};
use std::path::{Path, PathBuf};

use rustix::io::Errno;
use rustix::process::Resource;

use super::kernel::Kernel;
use super::landlock::LandlockFailure;
use super::{Failure, Plan};
use crate::sandbox::wire::{
    verdict, Applied, LandlockSpec, LandlockStatus, Report, Rlimits, Spec, Step, Verdict,
};

const DAEMON: i32 = 4242;
const ME: i32 = 77;
/// What every failing fake call returns.
const ERRNO: i32 = libc::EIO;

/// Records every call, by name and arguments; `fail` makes the named call fail with
/// [`ERRNO`]. Its state answers as a kernel would: the uid switch changes the ids, capset
/// empties the sets, and `parent_after_switch` is the parent seen once the uid changed (a
/// daemon that died in between).
struct Fake {
    calls: Vec<String>,
    fail: Option<&'static str>,
    pgrp: i32,
    parent: i32,
    parent_after_switch: i32,
    ids: (u32, u32, u32, u32),
    caps: (u64, u64, u64),
    ambient: u64,
    bounding: u64,
    tasks: u64,
    /// capset leaves the sets as they are (a kernel that refused silently).
    capset_is_noop: bool,
    /// setresuid succeeds but changes nothing.
    setresuid_is_noop: bool,
    /// The parent a worker forked from the template sees (the daemon died in between).
    parent_in_worker: Option<i32>,
    /// PR_CAPBSET_DROP succeeds but leaves the bounding set as it is.
    bounding_drop_is_noop: bool,
    /// PR_CAP_AMBIENT_CLEAR_ALL succeeds but leaves the ambient set as it is.
    ambient_clear_is_noop: bool,
}

impl Fake {
    /// A root daemon's launcher: every capability, its own process group, the daemon alive.
    fn root() -> Fake {
        Fake {
            calls: Vec::new(),
            fail: None,
            pgrp: ME,
            parent: DAEMON,
            parent_after_switch: DAEMON,
            ids: (0, 0, 0, 0),
            caps: (u64::MAX >> 23, u64::MAX >> 23, 0),
            ambient: 0,
            bounding: u64::MAX >> 23,
            tasks: 0,
            capset_is_noop: false,
            parent_in_worker: None,
            setresuid_is_noop: false,
            bounding_drop_is_noop: false,
            ambient_clear_is_noop: false,
        }
    }

    /// An unprivileged daemon's launcher (uid 1001, no capabilities).
    fn unprivileged() -> Fake {
        Fake {
            ids: (1001, 1001, 1001, 1001),
            caps: (0, 0, 0),
            tasks: 9,
            ..Fake::root()
        }
    }

    fn call(&mut self, name: &'static str, args: impl std::fmt::Display) -> Result<(), i32> {
        self.calls.push(format!("{name}({args})"));
        if self.fail == Some(name) {
            Err(ERRNO)
        } else {
            Ok(())
        }
    }

    fn names(&self) -> Vec<&str> {
        self.calls
            .iter()
            .map(|c| c.split('(').next().unwrap_or(c))
            .collect()
    }
}

fn io_err(e: i32) -> io::Error {
    io::Error::from_raw_os_error(e)
}

fn errno(e: i32) -> Errno {
    Errno::from_raw_os_error(e)
}

impl Kernel for Fake {
    type Exec = ();

    fn getpid(&mut self) -> i32 {
        let _ = self.call("getpid", "");
        ME
    }
    fn getpgrp(&mut self) -> i32 {
        let _ = self.call("getpgrp", "");
        self.pgrp
    }
    fn set_parent_death_kill(&mut self) -> Result<(), Errno> {
        self.call("pdeathsig", "SIGKILL").map_err(errno)
    }
    fn getppid(&mut self) -> i32 {
        let _ = self.call("getppid", "");
        if !self.calls.iter().any(|c| c.starts_with("setresuid")) {
            self.parent
        } else {
            self.parent_after_switch
        }
    }
    fn join_cgroup(&mut self, procs: &Path) -> io::Result<()> {
        self.call("join_cgroup", procs.display()).map_err(io_err)
    }
    fn default_sigpipe(&mut self) -> io::Result<()> {
        self.call("default_sigpipe", "").map_err(io_err)
    }
    fn unblock_all_signals(&mut self) -> io::Result<()> {
        self.call("unblock_all_signals", "").map_err(io_err)
    }
    fn make_inheritable(&mut self, fd: BorrowedFd<'_>) -> io::Result<()> {
        self.call("make_inheritable", fd.as_raw_fd())
            .map_err(io_err)
    }
    fn dup2(&mut self, _from: BorrowedFd<'_>, to: RawFd) -> io::Result<()> {
        self.call("dup2", format!("pipe, {to}")).map_err(io_err)
    }
    fn close_range(&mut self, first: u32, last: u32) -> io::Result<()> {
        self.call("close_range", format!("{first}, {last}"))
            .map_err(io_err)
    }
    fn getuid(&mut self) -> u32 {
        let _ = self.call("getuid", "");
        self.ids.0
    }
    fn tasks_of_uid(&mut self, uid: u32) -> u64 {
        let _ = self.call("tasks_of_uid", uid);
        self.tasks
    }
    fn setrlimit(&mut self, resource: Resource, value: u64) -> Result<(), Errno> {
        self.call("setrlimit", format!("{resource:?}, {value}"))
            .map_err(errno)
    }
    fn chdir(&mut self, dir: &Path) -> io::Result<()> {
        self.call("chdir", dir.display()).map_err(io_err)
    }
    fn landlock(&mut self, spec: &LandlockSpec) -> Result<Applied, LandlockFailure> {
        self.call("landlock", spec.abi)
            .map_err(|e| LandlockFailure {
                errno: e,
                message: "refused".into(),
            })?;
        Ok(Applied {
            status: LandlockStatus::FullyEnforced,
            abi: spec.abi,
        })
    }
    fn capget(&mut self) -> io::Result<(u64, u64, u64)> {
        self.call("capget", "").map_err(io_err)?;
        Ok(self.caps)
    }
    fn set_securebits(&mut self, bits: u32) -> io::Result<()> {
        self.call("set_securebits", format!("{bits:#x}"))
            .map_err(io_err)
    }
    fn bounding_drop_all(&mut self) -> io::Result<()> {
        self.call("bounding_drop_all", "").map_err(io_err)?;
        if !self.bounding_drop_is_noop {
            self.bounding = 0;
        }
        Ok(())
    }
    fn bounding_set(&mut self) -> io::Result<u64> {
        self.call("bounding_set", "").map_err(io_err)?;
        Ok(self.bounding)
    }
    fn ambient_clear(&mut self) -> io::Result<()> {
        self.call("ambient_clear", "").map_err(io_err)?;
        if !self.ambient_clear_is_noop {
            self.ambient = 0;
        }
        Ok(())
    }
    fn ambient_set(&mut self) -> io::Result<u64> {
        self.call("ambient_set", "").map_err(io_err)?;
        Ok(self.ambient)
    }
    fn capset_empty(&mut self) -> io::Result<()> {
        self.call("capset_empty", "").map_err(io_err)?;
        if !self.capset_is_noop {
            self.caps = (0, 0, 0);
        }
        Ok(())
    }
    fn setgroups_empty(&mut self) -> Result<(), Errno> {
        self.call("setgroups", "[]").map_err(errno)
    }
    fn setresgid(&mut self, gid: u32) -> Result<(), Errno> {
        self.call("setresgid", gid).map_err(errno)?;
        self.ids.2 = gid;
        self.ids.3 = gid;
        Ok(())
    }
    fn setresuid(&mut self, uid: u32) -> Result<(), Errno> {
        self.call("setresuid", uid).map_err(errno)?;
        if !self.setresuid_is_noop {
            self.ids.0 = uid;
            self.ids.1 = uid;
        }
        Ok(())
    }
    fn ids(&mut self) -> (u32, u32, u32, u32) {
        let _ = self.call("ids", "");
        self.ids
    }
    fn set_no_new_privs(&mut self) -> Result<(), Errno> {
        self.call("no_new_privs", "").map_err(errno)
    }
    fn seccomp(&mut self, program: &seccompiler::BpfProgram) -> Result<(), seccompiler::Error> {
        self.call("seccomp", program.len())
            .map_err(|e| seccompiler::Error::Seccomp(io_err(e)))
    }
    fn report(&mut self, line: &[u8]) -> io::Result<()> {
        self.call("report", String::from_utf8_lossy(line).trim_end())
            .map_err(io_err)
    }
    fn channel_cloexec(&mut self) -> Result<(), Errno> {
        self.call("channel_cloexec", "").map_err(errno)
    }
    fn execve(
        &mut self,
        exe: &CStr,
        argv: &[CString],
        _env: &[CString],
    ) -> Result<(), nix::errno::Errno> {
        self.call("execve", format!("{exe:?}, {} args", argv.len()))
            .map_err(nix::errno::Errno::from_raw)
    }
}

fn spec(identity: Option<(u32, u32)>, cgroup: bool) -> Spec {
    Spec {
        argv: vec!["/bin/tool".into(), "--flag".into()],
        cwd: PathBuf::from("/staging/job"),
        env_kept: vec![("PATH".into(), b"/usr/bin".to_vec())],
        env_set: [("LANG".to_string(), "C".to_string())].into(),
        parent: DAEMON,
        cgroup: cgroup.then(|| PathBuf::from("/sys/fs/cgroup/airlock/job")),
        rlimits: Rlimits {
            cpu_seconds: 10,
            address_space_bytes: 1 << 30,
            file_size_bytes: 1 << 20,
            open_files: 64,
            processes: 32,
        },
        identity,
        landlock: LandlockSpec {
            abi: 6,
            best_effort: false,
            network: false,
            read: vec![],
            exec: vec![],
            write: vec![],
            writable: vec![PathBuf::from("/staging/job")],
            readable: vec![],
        },
    }
}

/// One instruction (RET ALLOW).
fn allow() -> seccompiler::BpfProgram {
    vec![seccompiler::sock_filter {
        code: 0x06,
        jt: 0,
        jf: 0,
        k: 0x7fff_0000,
    }]
}

/// The template's steps over `fake`: a stack of two programs.
fn template(fake: &mut Fake) -> Result<(), Failure> {
    super::plan::template_steps(fake, DAEMON, &[allow(), allow()])
}

/// The plan of `spec` with the channel at fd 5, run over `fake`.
fn run(spec: Spec, progress: Option<OwnedFd>, fake: &mut Fake) -> Result<(), Failure> {
    run_at(spec, 5, progress, fake)
}

fn run_at(
    spec: Spec,
    channel_fd: RawFd,
    progress: Option<OwnedFd>,
    fake: &mut Fake,
) -> Result<(), Failure> {
    // The seal: one program.
    let plan = match Plan::check(spec, channel_fd, progress, vec![allow()]) {
        Ok(plan) => plan,
        Err(f) => panic!("the spec is refused: {f:?}"),
    };
    template(fake)?;
    // The worker is forked from the template: it inherits its state.
    fake.calls.push("fork()".into());
    if let Some(parent) = fake.parent_in_worker {
        fake.parent = parent;
    }
    plan.run(fake)
}

const OK_LINE: &str = r#"{"report":"ok","landlock":"fully_enforced","landlock_abi":6}"#;

#[test]
fn a_root_daemon_worker_with_its_own_uid_runs_every_step_in_order() {
    let mut fake = Fake::root();
    run(spec(Some((61000, 61000)), true), None, &mut fake).expect("every step succeeds");
    let expected = [
        // The template, once: parent death, the lock (CAP_SETPCAP held, so securebits and
        // the bounding set), no_new_privs, the carved stack.
        "pdeathsig(SIGKILL)",
        "getppid()",
        "capget()",
        "set_securebits(0xef)",
        "bounding_drop_all()",
        "ambient_clear()",
        // Read back once, for every worker.
        "ambient_set()",
        "bounding_set()",
        "no_new_privs()",
        "seccomp(1)",
        "seccomp(1)",
        // Each worker, forked from it.
        "fork()",
        "getpgrp()",
        "getpid()",
        "pdeathsig(SIGKILL)",
        "getppid()",
        "join_cgroup(/sys/fs/cgroup/airlock/job/cgroup.procs)",
        "default_sigpipe()",
        "unblock_all_signals()",
        "close_range(3, 4)",
        "close_range(6, 4294967295)",
        // uid 0: RLIMIT_NPROC is the profile's, no count of /proc.
        "getuid()",
        "setrlimit(Cpu, 10)",
        "setrlimit(As, 1073741824)",
        "setrlimit(Fsize, 1048576)",
        "setrlimit(Nofile, 64)",
        "setrlimit(Nproc, 32)",
        "setrlimit(Core, 0)",
        "chdir(/staging/job)",
        "landlock(6)",
        // The switch: groups, gid, uid (last), read back.
        "setgroups([])",
        "setresgid(61000)",
        "setresuid(61000)",
        "ids()",
        // The switch cleared PDEATHSIG: set again, parent checked again.
        "pdeathsig(SIGKILL)",
        "getppid()",
        // Drop, and read the three sets back (ambient and bounding: in the template).
        "ambient_clear()",
        "capget()",
        "capset_empty()",
        "capget()",
        // The seal.
        "seccomp(1)",
        &format!("report({OK_LINE})"),
        "channel_cloexec()",
        "execve(\"/bin/tool\", 2 args)",
    ];
    assert_eq!(fake.calls, expected);
}

#[test]
fn an_unprivileged_daemon_worker_sharing_its_uid_counts_the_uid_tasks_and_skips_the_switch() {
    let mut fake = Fake::unprivileged();
    run(spec(None, false), None, &mut fake).expect("every step succeeds");
    let names = fake.names();
    // No cgroup, no lock (no CAP_SETPCAP), no switch, one PDEATHSIG.
    for absent in [
        "join_cgroup",
        "set_securebits",
        "bounding_drop_all",
        "setgroups",
        "setresgid",
        "setresuid",
        "capset_empty",
    ] {
        assert!(!names.contains(&absent), "{absent} in {:?}", fake.calls);
    }
    // One PDEATHSIG in the template, one in the worker.
    assert_eq!(names.iter().filter(|n| **n == "pdeathsig").count(), 2);
    // RLIMIT_NPROC: what the shared uid runs (9) plus the profile's 32.
    assert!(fake.calls.contains(&"tasks_of_uid(1001)".to_string()));
    assert!(fake.calls.contains(&"setrlimit(Nproc, 41)".to_string()));
    // The bounding set is left full (it cannot be emptied without CAP_SETPCAP), and that is
    // not an error for a non-root uid.
    assert_eq!(names.last(), Some(&"execve"));
}

#[test]
fn the_parent_is_checked_again_after_the_uid_switch_and_a_dead_daemon_stops_the_plan() {
    let mut fake = Fake::root();
    // The daemon dies between the first check and the switch: we are reparented to init.
    fake.parent_after_switch = 1;
    let failure = run(spec(Some((61000, 61000)), false), None, &mut fake)
        .expect_err("a worker whose daemon is gone must not run");
    assert_eq!(failure.step, Step::ParentDeath);
    assert_eq!(failure.errno, libc::ESRCH);
    assert!(failure.message.contains("pid 1"), "{}", failure.message);
    // Nothing after the re-check: no capability drop, no seccomp, no report, no execve.
    let names = fake.names();
    let switch = names
        .iter()
        .position(|n| *n == "setresuid")
        .expect("switched");
    assert_eq!(
        &names[switch..],
        ["setresuid", "ids", "pdeathsig", "getppid"]
    );
}

#[test]
fn a_daemon_gone_before_the_template_started_stops_it_at_its_first_check() {
    let mut fake = Fake::root();
    fake.parent = 1;
    let failure = run(spec(None, true), None, &mut fake).expect_err("orphaned");
    assert_eq!(failure.step, Step::ParentDeath);
    assert_eq!(failure.errno, libc::ESRCH);
    assert_eq!(fake.names(), ["pdeathsig", "getppid"]);
}

#[test]
fn a_daemon_gone_before_the_worker_was_forked_stops_it_at_the_first_check() {
    let mut fake = Fake::root();
    fake.parent_in_worker = Some(1);
    let failure = run(spec(None, true), None, &mut fake).expect_err("orphaned");
    assert_eq!(failure.step, Step::ParentDeath);
    assert_eq!(failure.errno, libc::ESRCH);
    let names = fake.names();
    let fork = names.iter().position(|n| *n == "fork").expect("forked");
    assert_eq!(
        &names[fork..],
        ["fork", "getpgrp", "getpid", "pdeathsig", "getppid"]
    );
}

#[test]
fn a_launcher_that_does_not_lead_its_group_stops_at_once() {
    let mut fake = Fake::root();
    fake.pgrp = 1;
    let failure = run(spec(None, true), None, &mut fake).expect_err("not a group leader");
    assert_eq!(failure.step, Step::ProcessGroup);
    let names = fake.names();
    assert_eq!(names[names.len() - 3..], ["fork", "getpgrp", "getpid"]);
}

/// Each call the plan makes, the step its failure is reported as.
const FAILING: &[(&str, Step)] = &[
    ("pdeathsig", Step::ParentDeath),
    ("join_cgroup", Step::Cgroup),
    ("default_sigpipe", Step::Signals),
    ("unblock_all_signals", Step::Signals),
    ("close_range", Step::CloseFds),
    ("setrlimit", Step::Rlimits),
    ("chdir", Step::Chdir),
    ("landlock", Step::Landlock),
    ("capget", Step::Capabilities),
    ("set_securebits", Step::Capabilities),
    ("bounding_drop_all", Step::Capabilities),
    ("ambient_clear", Step::Capabilities),
    ("setgroups", Step::Identity),
    ("setresgid", Step::Identity),
    ("setresuid", Step::Identity),
    ("capset_empty", Step::Capabilities),
    ("ambient_set", Step::Capabilities),
    ("bounding_set", Step::Capabilities),
    ("no_new_privs", Step::NoNewPrivs),
    ("seccomp", Step::Seccomp),
    ("report", Step::Report),
    ("channel_cloexec", Step::Report),
    ("execve", Step::Execve),
];

#[test]
fn each_failing_call_stops_the_plan_and_its_report_names_its_step() {
    for &(call, step) in FAILING {
        let mut fake = Fake::root();
        fake.fail = Some(call);
        let failure = run(spec(Some((61000, 61000)), true), None, &mut fake)
            .expect_err("the failing call fails the plan");
        assert_eq!(failure.step, step, "{call}");
        assert_eq!(failure.errno, ERRNO, "{call}: {}", failure.message);
        // The failing call is the plan's last.
        assert_eq!(fake.names().last(), Some(&call), "{call}: {:?}", fake.calls);
        // What the daemon reads: the `ok` line if it was written before, then the failure.
        let mut stream = Vec::new();
        if fake
            .calls
            .iter()
            .any(|c| c.starts_with("report(") && call != "report")
        {
            stream.extend(format!("{OK_LINE}\n").into_bytes());
        }
        stream.extend(failure.report().line());
        match verdict(&stream) {
            Verdict::Failed {
                step: got,
                errno: ERRNO,
                ..
            } => assert_eq!(got, step, "{call}"),
            other => panic!("{call}: the daemon reads {other:?}"),
        }
    }
}

#[test]
fn a_uid_switch_the_kernel_did_not_make_fails_the_identity_step() {
    let mut fake = Fake::root();
    fake.setresuid_is_noop = true;
    let failure = run(spec(Some((61000, 61000)), false), None, &mut fake).expect_err("no switch");
    assert_eq!(failure.step, Step::Identity);
    assert_eq!(failure.errno, libc::EPERM);
    assert_eq!(fake.names().last(), Some(&"ids"));
}

#[test]
fn capabilities_left_after_the_drop_fail_the_capabilities_step() {
    let mut fake = Fake::root();
    fake.capset_is_noop = true;
    let failure = run(spec(None, false), None, &mut fake).expect_err("capabilities remain");
    assert_eq!(failure.step, Step::Capabilities);
    assert!(
        failure
            .message
            .contains("capabilities remain after dropping: effective"),
        "{}",
        failure.message
    );
    // The worker stops there: no seal, no report, no execve.
    let names = fake.names();
    let fork = names.iter().position(|n| *n == "fork").expect("forked");
    assert_eq!(
        names.iter().skip(fork).filter(|n| **n == "seccomp").count(),
        0
    );
    assert!(!names.contains(&"report") && !names.contains(&"execve"));
}

#[test]
fn capabilities_the_template_could_not_drop_stop_it_before_any_worker() {
    for (bounding_left, ambient_left, expected) in [
        (true, false, "capabilities remain after dropping: bounding"),
        (
            false,
            true,
            "capabilities remain after dropping: ambient 0x4",
        ),
    ] {
        let mut fake = Fake::root();
        fake.bounding_drop_is_noop = bounding_left;
        if ambient_left {
            fake.ambient = 0x4;
            fake.ambient_clear_is_noop = true;
        }
        let failure = super::plan::template_steps(&mut fake, DAEMON, &[allow()])
            .expect_err("the template must not serve workers");
        assert_eq!(failure.step, Step::Capabilities);
        assert!(failure.message.contains(expected), "{}", failure.message);
        // Stopped before no_new_privs and its stack: no worker is ever forked from it.
        let names = fake.names();
        assert!(!names.contains(&"no_new_privs"), "{names:?}");
        assert!(!names.contains(&"seccomp"), "{names:?}");
    }
}

#[test]
fn the_progress_pipe_goes_to_the_lowest_number_the_channel_leaves_and_is_kept() {
    for (channel, to, closes) in [
        (3, 4, vec!["close_range(5, 4294967295)"]),
        (
            7,
            3,
            vec!["close_range(4, 6)", "close_range(8, 4294967295)"],
        ),
    ] {
        let (_read, write) = rustix::pipe::pipe().expect("pipe");
        let at = write.as_raw_fd();
        let mut fake = Fake::root();
        run_at(spec(None, false), channel, Some(write), &mut fake).expect("succeeds");
        let moved = if at == to {
            format!("make_inheritable({to})")
        } else {
            format!("dup2(pipe, {to})")
        };
        let start = fake
            .calls
            .iter()
            .position(|c| *c == "unblock_all_signals()")
            .expect("signals step");
        let mut expected = vec![moved];
        expected.extend(closes.iter().map(|c| c.to_string()));
        assert_eq!(
            fake.calls[start + 1..start + 1 + expected.len()],
            expected[..]
        );
    }
}

#[test]
fn the_progress_variable_names_where_the_pipe_goes() {
    let (_read, write) = rustix::pipe::pipe().expect("pipe");
    let plan = Plan::check(spec(None, false), 3, Some(write), vec![allow()]).expect("valid");
    let var = format!("{}=4", crate::sandbox::PROGRESS_FD_ENV);
    assert!(plan.env.iter().any(|e| e.to_bytes() == var.as_bytes()));
}

#[test]
fn bad_specs_are_refused_before_any_step() {
    let cases: Vec<(Spec, &str)> = vec![
        (
            Spec {
                argv: vec![],
                ..spec(None, false)
            },
            "empty argv",
        ),
        (
            Spec {
                argv: vec!["tool".into()],
                ..spec(None, false)
            },
            "not an absolute path",
        ),
        (
            Spec {
                argv: vec!["/bin/tool".into(), "a\0b".into()],
                ..spec(None, false)
            },
            "NUL byte",
        ),
        (
            Spec {
                env_set: [("A=B".to_string(), "x".to_string())].into(),
                ..spec(None, false)
            },
            "bad variable name",
        ),
    ];
    // A seal the template holds is checked too.
    match Plan::check(spec(None, false), 5, None, vec![vec![]]) {
        Ok(_) => panic!("accepted an empty seal program"),
        Err(f) => assert!(f.message.contains("empty or oversized seccomp program")),
    }
    for (spec, says) in cases {
        match Plan::check(spec, 5, None, vec![allow()]) {
            Ok(_) => panic!("accepted a spec that is {says}"),
            Err(f) => {
                assert_eq!(f.step, Step::Spec);
                assert_eq!(f.errno, libc::EINVAL);
                assert!(f.message.contains(says), "{}", f.message);
            }
        }
    }
}

#[test]
fn a_failure_report_is_one_line_the_daemon_reads_back() {
    let line = Failure::new(Step::Chdir, libc::ENOENT, "/x: gone")
        .report()
        .line();
    assert_eq!(line.iter().filter(|b| **b == b'\n').count(), 1);
    assert!(matches!(
        serde_json::from_slice::<Report>(&line),
        Ok(Report::Failed {
            step: Step::Chdir,
            errno: libc::ENOENT,
            ..
        })
    ));
}
