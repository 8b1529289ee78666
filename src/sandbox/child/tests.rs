//! The launcher's plan over a recording fake kernel: step order, the parent re-check after the
//! uid switch, and the report each failing step produces. No root needed: nothing here makes
//! a system call of the plan's.

use std::ffi::{c_char, CStr};
use std::os::fd::{AsRawFd, RawFd};
use std::path::PathBuf;

use rustix::io::Errno;
use rustix::process::Resource;

use super::kernel::Kernel;
use super::landlock::Prepared;
use super::report::{Failure, Line, Message};
use super::Plan;
use crate::sandbox::wire::{
    verdict, LandlockSpec, LandlockStatus, Report, Rlimits, Spec, Step, Verdict,
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
    /// What `landlock_restrict_self` enforces.
    landlock: LandlockStatus,
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
            landlock: LandlockStatus::FullyEnforced,
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
    fn join_cgroup(&mut self, procs: &CStr) -> Result<(), Errno> {
        self.call("join_cgroup", procs.to_string_lossy())
            .map_err(errno)
    }
    fn default_sigpipe(&mut self) -> Result<(), Errno> {
        self.call("default_sigpipe", "").map_err(errno)
    }
    fn unblock_all_signals(&mut self) -> Result<(), Errno> {
        self.call("unblock_all_signals", "").map_err(errno)
    }
    fn make_inheritable(&mut self, fd: RawFd) -> Result<(), Errno> {
        self.call("make_inheritable", fd).map_err(errno)
    }
    fn dup2(&mut self, _from: RawFd, to: RawFd) -> Result<(), Errno> {
        self.call("dup2", format!("pipe, {to}")).map_err(errno)
    }
    fn cloexec_range(&mut self, first: u32, last: u32) -> Result<(), Errno> {
        self.call("cloexec_range", format!("{first}, {last}"))
            .map_err(errno)
    }
    fn setrlimit(&mut self, resource: Resource, value: u64) -> Result<(), Errno> {
        self.call("setrlimit", format!("{resource:?}, {value}"))
            .map_err(errno)
    }
    fn chdir(&mut self, dir: &CStr) -> Result<(), Errno> {
        self.call("chdir", dir.to_string_lossy()).map_err(errno)
    }
    fn landlock(&mut self, ruleset: &Prepared) -> Result<LandlockStatus, Errno> {
        self.call("landlock", ruleset.profile_abi).map_err(errno)?;
        Ok(self.landlock)
    }
    fn capget(&mut self) -> Result<(u64, u64, u64), Errno> {
        self.call("capget", "").map_err(errno)?;
        Ok(self.caps)
    }
    fn set_securebits(&mut self, bits: u32) -> Result<(), Errno> {
        self.call("set_securebits", format!("{bits:#x}"))
            .map_err(errno)
    }
    fn bounding_drop_all(&mut self) -> Result<(), Errno> {
        self.call("bounding_drop_all", "").map_err(errno)?;
        if !self.bounding_drop_is_noop {
            self.bounding = 0;
        }
        Ok(())
    }
    fn bounding_set(&mut self) -> Result<u64, Errno> {
        self.call("bounding_set", "").map_err(errno)?;
        Ok(self.bounding)
    }
    fn ambient_clear(&mut self) -> Result<(), Errno> {
        self.call("ambient_clear", "").map_err(errno)?;
        if !self.ambient_clear_is_noop {
            self.ambient = 0;
        }
        Ok(())
    }
    fn ambient_set(&mut self) -> Result<u64, Errno> {
        self.call("ambient_set", "").map_err(errno)?;
        Ok(self.ambient)
    }
    fn capset_empty(&mut self) -> Result<(), Errno> {
        self.call("capset_empty", "").map_err(errno)?;
        if !self.capset_is_noop {
            self.caps = (0, 0, 0);
        }
        Ok(())
    }
    fn set_undumpable(&mut self) -> Result<(), Errno> {
        self.call("undumpable", "").map_err(errno)
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
    fn seccomp(&mut self, program: &[seccompiler::sock_filter]) -> Result<(), Errno> {
        self.call("seccomp", program.len()).map_err(errno)
    }
    fn report(&mut self, line: &[u8]) -> Result<(), Errno> {
        self.call("report", String::from_utf8_lossy(line).trim_end())
            .map_err(errno)
    }
    fn channel_cloexec(&mut self) -> Result<(), Errno> {
        self.call("channel_cloexec", "").map_err(errno)
    }
    fn execve(
        &mut self,
        exe: &CStr,
        argv: &[*const c_char],
        env: &[*const c_char],
    ) -> Result<(), Errno> {
        assert_eq!(
            argv.last(),
            Some(&std::ptr::null()),
            "argv is null-terminated"
        );
        assert_eq!(
            env.last(),
            Some(&std::ptr::null()),
            "envp is null-terminated"
        );
        self.call("execve", format!("{exe:?}, {} args", argv.len() - 1))
            .map_err(errno)
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
fn template(fake: &mut Fake) -> Result<(), Failure<'static>> {
    super::plan::template_steps(fake, DAEMON, &[allow(), allow()])
}

/// A failure as the daemon gets it: its step, errno and message, and the line the worker
/// rendered on its stack.
#[derive(Debug)]
struct Failed {
    step: Step,
    errno: i32,
    message: String,
    line: Vec<u8>,
}

impl From<Failure<'_>> for Failed {
    fn from(f: Failure<'_>) -> Failed {
        let mut line = Line::new();
        f.write_line(&mut line);
        Failed {
            step: f.step,
            errno: f.errno,
            message: f.to_string(),
            line: line.bytes().to_vec(),
        }
    }
}

/// The template's preparation of `spec` (its Landlock ruleset left to the fake), the way
/// the template makes it: `fake`'s uid and task count.
fn prepare(spec: Spec, channel_fd: RawFd, progress: Option<RawFd>, fake: &mut Fake) -> Plan {
    let tasks = fake.tasks;
    let mut counted = None;
    let landlock = Prepared {
        created: None,
        best_effort: spec.landlock.best_effort,
        kernel_abi: 6,
        profile_abi: spec.landlock.abi,
    };
    // The seal: one program.
    let plan = Plan::check(
        spec,
        channel_fd,
        progress,
        vec![allow()],
        landlock,
        fake.ids.0,
        |uid| {
            counted = Some(uid);
            tasks
        },
    );
    if let Some(uid) = counted {
        fake.calls.push(format!("tasks_of_uid({uid})"));
    }
    match plan {
        Ok(plan) => plan,
        Err(f) => panic!("the spec is refused: {f:?}"),
    }
}

/// The plan of `spec` with the channel at fd 5, run over `fake`.
fn run(spec: Spec, progress: Option<RawFd>, fake: &mut Fake) -> Result<(), Failed> {
    run_at(spec, 5, progress, fake)
}

fn run_at(
    spec: Spec,
    channel_fd: RawFd,
    progress: Option<RawFd>,
    fake: &mut Fake,
) -> Result<(), Failed> {
    template(fake)?;
    // Per call, in the template: the plan, then the worker is created from the template (it
    // inherits its state).
    let plan = prepare(spec, channel_fd, progress, fake);
    fake.calls.push("clone()".into());
    if let Some(parent) = fake.parent_in_worker {
        fake.parent = parent;
    }
    plan.run(fake).map_err(Failed::from)
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
        "clone()",
        "getpgrp()",
        "getpid()",
        "pdeathsig(SIGKILL)",
        "getppid()",
        "join_cgroup(/sys/fs/cgroup/airlock/job/cgroup.procs)",
        "default_sigpipe()",
        "unblock_all_signals()",
        "cloexec_range(3, 4)",
        "cloexec_range(6, 4294967295)",
        // uid 0: RLIMIT_NPROC is the profile's, no count of /proc.
        "setrlimit(Cpu, 10)",
        "setrlimit(As, 1073741824)",
        "setrlimit(Fsize, 1048576)",
        "setrlimit(Nofile, 64)",
        "setrlimit(Nproc, 32)",
        "setrlimit(Core, 0)",
        "chdir(/staging/job)",
        "landlock(6)",
        // Non-dumpable (we share the template's memory), then the switch: groups, gid, uid
        // (last), read back.
        "undumpable()",
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
    let fork = names.iter().position(|n| *n == "clone").expect("created");
    assert_eq!(
        &names[fork..],
        ["clone", "getpgrp", "getpid", "pdeathsig", "getppid"]
    );
}

#[test]
fn a_launcher_that_does_not_lead_its_group_stops_at_once() {
    let mut fake = Fake::root();
    fake.pgrp = 1;
    let failure = run(spec(None, true), None, &mut fake).expect_err("not a group leader");
    assert_eq!(failure.step, Step::ProcessGroup);
    let names = fake.names();
    assert_eq!(names[names.len() - 3..], ["clone", "getpgrp", "getpid"]);
}

/// Each call the plan makes, the step its failure is reported as.
const FAILING: &[(&str, Step)] = &[
    ("pdeathsig", Step::ParentDeath),
    ("join_cgroup", Step::Cgroup),
    ("default_sigpipe", Step::Signals),
    ("unblock_all_signals", Step::Signals),
    ("cloexec_range", Step::CloseFds),
    ("setrlimit", Step::Rlimits),
    ("chdir", Step::Chdir),
    ("landlock", Step::Landlock),
    ("capget", Step::Capabilities),
    ("set_securebits", Step::Capabilities),
    ("bounding_drop_all", Step::Capabilities),
    ("ambient_clear", Step::Capabilities),
    ("undumpable", Step::Identity),
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
        // The line the worker rendered on its stack.
        stream.extend(&failure.line);
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
    let fork = names.iter().position(|n| *n == "clone").expect("created");
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
        let message = failure.to_string();
        assert!(message.contains(expected), "{message}");
        // Stopped before no_new_privs and its stack: no worker is ever forked from it.
        let names = fake.names();
        assert!(!names.contains(&"no_new_privs"), "{names:?}");
        assert!(!names.contains(&"seccomp"), "{names:?}");
    }
}

#[test]
fn the_progress_pipe_goes_to_the_lowest_number_the_channel_leaves_and_is_kept() {
    for (channel, to, closes) in [
        (3, 4, vec!["cloexec_range(5, 4294967295)"]),
        (
            7,
            3,
            vec!["cloexec_range(4, 6)", "cloexec_range(8, 4294967295)"],
        ),
    ] {
        let (_read, write) = rustix::pipe::pipe().expect("pipe");
        let at = write.as_raw_fd();
        let mut fake = Fake::root();
        run_at(spec(None, false), channel, Some(at), &mut fake).expect("succeeds");
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
    let plan = prepare(
        spec(None, false),
        3,
        Some(write.as_raw_fd()),
        &mut Fake::root(),
    );
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
    let check = |spec: Spec, seal| {
        let landlock = Prepared {
            created: None,
            best_effort: false,
            kernel_abi: 6,
            profile_abi: 6,
        };
        Plan::check(spec, 5, None, seal, landlock, 0, |_| 0)
    };
    match check(spec(None, false), vec![vec![]]) {
        Ok(_) => panic!("accepted an empty seal program"),
        Err(f) => assert!(f.message.contains("empty or oversized seccomp program")),
    }
    for (spec, says) in cases {
        match check(spec, vec![allow()]) {
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
    let failed = Failed::from(Failure::new(
        Step::Chdir,
        libc::ENOENT,
        Message::Path("cannot chdir to", c"/x"),
    ));
    assert_eq!(failed.line.iter().filter(|b| **b == b'\n').count(), 1);
    match serde_json::from_slice::<Report>(&failed.line) {
        Ok(Report::Failed {
            step: Step::Chdir,
            errno: libc::ENOENT,
            message,
        }) => assert_eq!(
            message,
            "cannot chdir to /x: No such file or directory (os error 2)"
        ),
        other => panic!("{other:?}"),
    }
}

#[test]
fn a_report_line_escapes_what_it_names_and_is_cut_to_valid_json() {
    // Quotes, backslashes, control characters and bytes that are not UTF-8 in a path.
    let path = std::ffi::CString::new(b"/a\"b\\c\nd\x01\xffe".to_vec()).expect("no NUL");
    let failed = Failed::from(Failure::new(
        Step::Execve,
        libc::EACCES,
        Message::Path("cannot execute", &path),
    ));
    match serde_json::from_slice::<Report>(&failed.line) {
        Ok(Report::Failed { message, .. }) => assert_eq!(
            message,
            "cannot execute /a\"b\\c\nd\u{1}\u{fffd}e: Permission denied (os error 13)"
        ),
        other => panic!("{other:?}"),
    }
    // A path longer than the line: cut, still one line of JSON naming the step.
    let long = std::ffi::CString::new(vec![b'"'; 4000]).expect("no NUL");
    let failed = Failed::from(Failure::new(
        Step::Cgroup,
        libc::EIO,
        Message::Path("cannot join", &long),
    ));
    assert!(failed.line.len() <= 1024 && failed.line.ends_with(b"\n"));
    assert!(matches!(
        verdict(&failed.line),
        Verdict::Failed {
            step: Step::Cgroup,
            errno: libc::EIO,
            ..
        }
    ));
}

#[test]
fn a_ruleset_enforced_less_than_the_profile_requires_stops_the_worker_unless_best_effort() {
    for (best_effort, runs) in [(false, false), (true, true)] {
        let mut fake = Fake::root();
        fake.landlock = LandlockStatus::PartiallyEnforced;
        let mut s = spec(None, false);
        s.landlock.best_effort = best_effort;
        match run(s, None, &mut fake) {
            Ok(()) => {
                assert!(
                    runs,
                    "ran with a partial ruleset the profile does not allow"
                );
                let ok =
                    r#"report({"report":"ok","landlock":"partially_enforced","landlock_abi":6})"#;
                assert!(fake.calls.iter().any(|c| c == ok), "{:?}", fake.calls);
            }
            Err(f) => {
                assert!(!runs, "best effort refused: {f:?}");
                assert_eq!(f.step, Step::Landlock);
                assert_eq!(f.errno, libc::EOPNOTSUPP);
                assert!(f.message.contains("partially_enforced"), "{}", f.message);
                assert_eq!(fake.names().last(), Some(&"landlock"));
            }
        }
    }
}
