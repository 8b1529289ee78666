//! Developer check of `airlock::sandbox` on the real kernel: workers started through the real
//! launcher (the `airlock` binary), with a hand-built profile.
//!
//! Run with `cargo test --test sandbox_smoke`. Tests that need a kernel feature or root check
//! for it and fail with a message saying what is missing; none passes silently.

use std::path::{Path, PathBuf};
use std::sync::OnceLock;
use std::time::{Duration, Instant};

use airlock::policy::{Limits, Profile};
use airlock::sandbox::{
    self, End, Filters, LandlockStatus, Launch, Outcome, SandboxError, Step, Worker,
};
use airlock_test_support::harness::{repo, require_root_for};
use tokio_util::sync::CancellationToken;

/// One runtime and one sandbox for the whole binary, so that the orphan reaper started by
/// `Sandbox::start` lives as long as the tests.
fn rt_and_sandbox() -> &'static (tokio::runtime::Runtime, sandbox::Sandbox) {
    static RT: OnceLock<(tokio::runtime::Runtime, sandbox::Sandbox)> = OnceLock::new();
    RT.get_or_init(|| {
        let rt = tokio::runtime::Builder::new_multi_thread()
            .worker_threads(2)
            .enable_all()
            .build()
            .unwrap();
        let exe = PathBuf::from(env!("CARGO_BIN_EXE_airlock"));
        let sb = rt.block_on(async { sandbox::Sandbox::start(exe).unwrap() });
        (rt, sb)
    })
}

fn rt() -> &'static tokio::runtime::Runtime {
    &rt_and_sandbox().0
}

fn sb() -> &'static sandbox::Sandbox {
    &rt_and_sandbox().1
}

fn landlock_abi() -> i64 {
    // SAFETY: the VERSION query takes no memory and only returns an integer.
    unsafe {
        libc::syscall(
            libc::SYS_landlock_create_ruleset,
            std::ptr::null::<u8>(),
            0usize,
            1u32,
        )
    }
}

fn require_landlock(abi: i64) {
    let have = landlock_abi();
    assert!(
        have >= abi,
        "this test needs Landlock ABI >= {abi}; the kernel has {have} (negative: none)"
    );
}

/// The shipped `default` profile, with a short grace so the SIGTERM tests are quick.
fn profile() -> Profile {
    let dir = repo().join("policies");
    let policy = airlock::policy::load(&dir).unwrap_or_else(|e| panic!("{e}"));
    let mut p = (*policy.profiles["default"]).clone();
    p.limits.grace = Duration::from_millis(500);
    p
}

fn launch(argv: &[&str], staging: &Path) -> Launch {
    Launch {
        argv: argv.iter().map(|s| s.to_string()).collect(),
        env: Vec::new(),
        cwd: staging.to_path_buf(),
        stdin: Vec::new(),
        writable: vec![staging.to_path_buf()],
        readable: Vec::new(),
        profile: profile().into(),
        cgroup_parent: None,
        job_id: format!("smoke-{}", std::process::id()),
        identity: None,
        registry: None,
        progress: None,
    }
}

fn sh(script: &str, staging: &Path) -> Launch {
    launch(&["/bin/sh", "-c", script], staging)
}

async fn run(l: Launch, timeout: Duration) -> Outcome {
    let worker = Worker::spawn(sb(), l, &Filters::new())
        .await
        .expect("spawn");
    worker
        .finish(timeout, CancellationToken::new())
        .await
        .expect("finish")
}

fn text(b: &[u8]) -> String {
    String::from_utf8_lossy(b).into_owned()
}

/// Pids of live (non-zombie) processes in process group `pgid`.
fn group_members(pgid: u32) -> Vec<u32> {
    let mut out = Vec::new();
    for e in std::fs::read_dir("/proc").unwrap().flatten() {
        let Ok(pid) = e.file_name().to_string_lossy().parse::<u32>() else {
            continue;
        };
        let Ok(stat) = std::fs::read_to_string(format!("/proc/{pid}/stat")) else {
            continue;
        };
        let Some((_, rest)) = stat.rsplit_once(')') else {
            continue;
        };
        let f: Vec<&str> = rest.split_whitespace().collect();
        if f.get(2).and_then(|g| g.parse::<u32>().ok()) == Some(pgid) {
            out.push(pid);
        }
    }
    out
}

fn tempdir() -> tempfile::TempDir {
    tempfile::tempdir().unwrap()
}

#[test]
fn echo_hi() {
    require_landlock(6);
    rt().block_on(async {
        let dir = tempdir();
        let o = run(sh("echo hi", dir.path()), Duration::from_secs(10)).await;
        assert_eq!(o.end, End::Exited(0), "stderr: {}", text(&o.stderr.bytes));
        assert_eq!(text(&o.stdout.bytes), "hi\n");
        assert!(!o.stdout.truncated);
        assert_eq!(o.enforcement.landlock, LandlockStatus::FullyEnforced);
        assert!(o.enforcement.landlock_abi >= 6);
        assert_eq!(o.enforcement.containment, "process_group");
        assert!(group_members(o.pid).is_empty());
    });
}

#[test]
fn stdin_is_fed_and_env_is_clean() {
    require_landlock(6);
    rt().block_on(async {
        let dir = tempdir();
        std::env::set_var("AIRLOCK_SMOKE_SECRET", "must not reach the tool");
        std::env::set_var("TZ", "UTC");
        let mut l = sh("cat; /usr/bin/env", dir.path());
        l.stdin = b"hello from stdin\n".to_vec();
        let o = run(l, Duration::from_secs(10)).await;
        assert_eq!(o.end, End::Exited(0), "stderr: {}", text(&o.stderr.bytes));
        let out = text(&o.stdout.bytes);
        let mut lines = out.lines();
        assert_eq!(lines.next(), Some("hello from stdin"));
        for var in lines {
            let name = var.split('=').next().unwrap_or("");
            // The profile keeps LANG, LC_ALL, TZ and sets PATH, HOME, PYTHONDONTWRITEBYTECODE;
            // PWD is set by the shell itself.
            assert!(
                [
                    "PATH",
                    "HOME",
                    "PYTHONDONTWRITEBYTECODE",
                    "LANG",
                    "LC_ALL",
                    "TZ",
                    "PWD"
                ]
                .contains(&name),
                "unexpected variable in the tool's env: {var}"
            );
        }
        assert!(out.contains("PATH=/usr/local/bin:/usr/bin:/bin\n"), "{out}");
        assert!(
            out.contains("TZ=UTC\n") && !out.contains("AIRLOCK_SMOKE_SECRET"),
            "{out}"
        );
    });
}

#[test]
fn status_shows_no_new_privs_seccomp_and_no_capabilities() {
    require_landlock(6);
    rt().block_on(async {
        let dir = tempdir();
        let worker = Worker::spawn(
            sb(),
            launch(&["/bin/sleep", "30"], dir.path()),
            &Filters::new(),
        )
        .await
        .expect("spawn");
        let status = std::fs::read_to_string(format!("/proc/{}/status", worker.pid())).unwrap();
        let field = |k: &str| {
            status
                .lines()
                .find_map(|l| l.strip_prefix(k))
                .map(|v| v.trim().to_string())
                .unwrap_or_else(|| panic!("{k} missing from /proc/PID/status"))
        };
        assert_eq!(field("NoNewPrivs:"), "1");
        assert_eq!(field("Seccomp:"), "2");
        for cap in ["CapInh:", "CapPrm:", "CapEff:", "CapBnd:", "CapAmb:"] {
            assert_eq!(field(cap), "0000000000000000", "{cap}");
        }
        let cancel = CancellationToken::new();
        cancel.cancel();
        let started = Instant::now();
        let o = worker
            .finish(Duration::from_secs(60), cancel)
            .await
            .expect("finish");
        assert_eq!(o.end, End::Cancelled);
        // sleep dies of SIGTERM: no grace needed.
        assert!(
            started.elapsed() < Duration::from_millis(400),
            "{:?}",
            started.elapsed()
        );
        assert!(group_members(o.pid).is_empty());
    });
}

#[test]
fn writes_only_inside_staging() {
    require_landlock(6);
    rt().block_on(async {
        let staging = tempdir();
        let outside = tempdir();
        let script = format!(
            "echo a > {}/escaped; echo \"outside=$?\"; echo b > inside && cat inside; \
             ln -s /etc/passwd link && mkfifo fifo && mkdir sub && echo made",
            outside.path().display()
        );
        let o = run(sh(&script, staging.path()), Duration::from_secs(10)).await;
        let out = text(&o.stdout.bytes);
        assert!(out.contains("outside=2"), "{out}");
        assert!(
            text(&o.stderr.bytes).contains("Permission denied"),
            "{}",
            text(&o.stderr.bytes)
        );
        assert!(!outside.path().join("escaped").exists());
        assert!(out.contains("b\n"), "{out}");
        assert!(
            out.contains("made"),
            "symlink/fifo/dir in staging: {out} {}",
            text(&o.stderr.bytes)
        );
        assert_eq!(
            std::fs::read_to_string(staging.path().join("inside")).unwrap(),
            "b\n"
        );
        assert_eq!(o.end, End::Exited(0));
    });
}

#[test]
fn reads_declared_inputs_only() {
    require_landlock(6);
    rt().block_on(async {
        let staging = tempdir();
        let inputs = tempdir();
        let allowed = inputs.path().join("allowed.txt");
        let other = inputs.path().join("other.txt");
        std::fs::write(&allowed, "visible\n").unwrap();
        std::fs::write(&other, "secret\n").unwrap();
        let script = format!(
            "cat {}; cat {}; echo rc=$?",
            allowed.display(),
            other.display()
        );
        let mut l = sh(&script, staging.path());
        l.readable = vec![allowed.clone()];
        let o = run(l, Duration::from_secs(10)).await;
        let out = text(&o.stdout.bytes);
        assert!(out.starts_with("visible\n"), "{out}");
        assert!(!out.contains("secret"), "{out}");
        assert!(out.contains("rc=1"), "{out}");
        assert!(text(&o.stderr.bytes).contains("Permission denied"));
    });
}

#[test]
fn tcp_socket_is_refused_without_network() {
    require_landlock(6);
    assert!(
        Path::new("/bin/bash").exists(),
        "this test needs /bin/bash (/dev/tcp)"
    );
    rt().block_on(async {
        let dir = tempdir();
        let script = "exec 3<>/dev/tcp/127.0.0.1/9; echo rc=$?";
        let o = run(
            launch(&["/bin/bash", "-c", script], dir.path()),
            Duration::from_secs(10),
        )
        .await;
        let err = text(&o.stderr.bytes);
        assert!(err.contains("Operation not permitted"), "stderr: {err}");
        assert!(!text(&o.stdout.bytes).contains("rc=0"));
    });
}

#[test]
fn setsid_is_refused() {
    require_landlock(6);
    assert!(
        Path::new("/usr/bin/setsid").exists(),
        "this test needs /usr/bin/setsid (util-linux)"
    );
    rt().block_on(async {
        let dir = tempdir();
        let o = run(
            sh("/usr/bin/setsid -w /bin/true; echo rc=$?", dir.path()),
            Duration::from_secs(10),
        )
        .await;
        let out = text(&o.stdout.bytes);
        assert!(!out.contains("rc=0"), "setsid succeeded: {out}");
        assert!(
            text(&o.stderr.bytes).contains("Operation not permitted"),
            "{}",
            text(&o.stderr.bytes)
        );
    });
}

#[test]
fn double_forked_child_is_killed_before_finish_returns() {
    require_landlock(6);
    rt().block_on(async {
        let dir = tempdir();
        let started = Instant::now();
        let o = run(
            sh(
                "(/bin/sleep 1000 & echo $! > bg.pid); echo started",
                dir.path(),
            ),
            Duration::from_secs(10),
        )
        .await;
        assert_eq!(o.end, End::Exited(0), "stderr: {}", text(&o.stderr.bytes));
        assert_eq!(text(&o.stdout.bytes), "started\n");
        // The background sleep kept stdout open: finish returned only once it was gone.
        assert!(started.elapsed() < Duration::from_secs(5));
        let bg: u32 = std::fs::read_to_string(dir.path().join("bg.pid"))
            .unwrap()
            .trim()
            .parse()
            .unwrap();
        assert!(
            group_members(o.pid).is_empty(),
            "group {} still has {:?}",
            o.pid,
            group_members(o.pid)
        );
        let alive = std::fs::read_to_string(format!("/proc/{bg}/cmdline")).unwrap_or_default();
        assert!(
            !alive.starts_with("/bin/sleep"),
            "the double-forked sleep {bg} survived"
        );
    });
}

#[test]
fn sigterm_ignoring_tool_is_killed_after_grace() {
    require_landlock(6);
    rt().block_on(async {
        let dir = tempdir();
        let started = Instant::now();
        let o = run(
            sh("trap '' TERM; /bin/sleep 1000; echo woke", dir.path()),
            Duration::from_millis(300),
        )
        .await;
        let took = started.elapsed();
        assert_eq!(o.end, End::TimedOut);
        // timeout 300 ms + grace 500 ms, then SIGKILL.
        assert!(took >= Duration::from_millis(800), "{took:?}");
        assert!(took < Duration::from_secs(3), "{took:?}");
        assert!(!text(&o.stdout.bytes).contains("woke"));
        assert!(group_members(o.pid).is_empty());
    });
}

#[test]
fn sigterm_heeding_tool_ends_without_waiting_the_grace() {
    require_landlock(6);
    rt().block_on(async {
        let dir = tempdir();
        let mut l = sh("/bin/sleep 1000", dir.path());
        std::sync::Arc::make_mut(&mut l.profile).limits.grace = Duration::from_secs(5);
        let started = Instant::now();
        let o = run(l, Duration::from_millis(200)).await;
        assert_eq!(o.end, End::TimedOut);
        assert!(
            started.elapsed() < Duration::from_secs(2),
            "{:?}",
            started.elapsed()
        );
    });
}

#[test]
fn large_output_is_capped_and_counted() {
    require_landlock(6);
    rt().block_on(async {
        let dir = tempdir();
        let o = run(
            launch(
                &["/usr/bin/head", "-c", "104857600", "/dev/zero"],
                dir.path(),
            ),
            Duration::from_secs(60),
        )
        .await;
        assert_eq!(o.end, End::Exited(0), "stderr: {}", text(&o.stderr.bytes));
        assert_eq!(o.stdout.total, 104_857_600);
        assert!(o.stdout.truncated);
        assert_eq!(o.stdout.bytes.len(), Limits::default().output_bytes);
    });
}

#[test]
fn missing_command_is_a_setup_error_at_execve() {
    require_landlock(6);
    rt().block_on(async {
        let dir = tempdir();
        match Worker::spawn(
            sb(),
            launch(&["/nonexistent/tool"], dir.path()),
            &Filters::new(),
        )
        .await
        {
            Err(SandboxError::Setup { step, errno, .. }) => {
                assert_eq!(step, Step::Execve);
                assert_eq!(errno, libc::ENOENT);
            }
            Err(e) => panic!("expected a setup error, got {e}"),
            Ok(w) => panic!("spawned {}", w.pid()),
        }
    });
}

#[test]
fn bad_cwd_is_a_setup_error_at_chdir() {
    require_landlock(6);
    rt().block_on(async {
        let dir = tempdir();
        let mut l = sh("true", dir.path());
        l.cwd = dir.path().join("missing");
        match Worker::spawn(sb(), l, &Filters::new()).await {
            Err(SandboxError::Setup {
                step,
                errno,
                message,
            }) => {
                assert_eq!(step, Step::Chdir, "{message}");
                assert_eq!(errno, libc::ENOENT);
            }
            Err(e) => panic!("expected a setup error, got {e}"),
            Ok(w) => panic!("spawned {}", w.pid()),
        }
    });
}

#[test]
fn landlock_fails_closed_above_the_kernel_abi() {
    require_landlock(1);
    rt().block_on(async {
        let dir = tempdir();
        let mut l = sh("true", dir.path());
        std::sync::Arc::make_mut(&mut l.profile).landlock.abi = 99;
        match Worker::spawn(sb(), l, &Filters::new()).await {
            Err(SandboxError::Setup { step, message, .. }) => {
                assert_eq!(step, Step::Landlock);
                assert!(
                    message.contains(&format!("Landlock ABI {}", landlock_abi())),
                    "{message}"
                );
            }
            Err(e) => panic!("expected a setup error, got {e}"),
            Ok(w) => panic!("spawned {}", w.pid()),
        }
    });
}

#[test]
fn cgroup_contains_and_is_removed() {
    require_landlock(6);
    require_root_for("it creates a cgroup");
    let parent = PathBuf::from("/sys/fs/cgroup/unified");
    assert!(
        parent.join("cgroup.procs").exists(),
        "this test needs a cgroup v2 hierarchy at {}",
        parent.display()
    );
    rt().block_on(async {
        let dir = tempdir();
        let job_id = format!("smoke-{}", std::process::id());
        let cgroup = parent.join(format!("airlock-{job_id}"));
        let mut l = sh("(/bin/sleep 1000 &); exec /bin/sleep 1000", dir.path());
        l.cgroup_parent = Some(parent.clone());
        l.job_id = job_id.clone();
        let worker = Worker::spawn(sb(), l, &Filters::new())
            .await
            .expect("spawn");
        // The leader and its double-forked child are both in the worker's cgroup.
        let membership = std::fs::read_to_string(format!("/proc/{}/cgroup", worker.pid())).unwrap();
        assert!(
            membership.contains(&format!("0::/airlock-{job_id}\n")),
            "{membership}"
        );
        let deadline = Instant::now() + Duration::from_secs(5);
        while std::fs::read_to_string(cgroup.join("cgroup.procs"))
            .unwrap()
            .lines()
            .count()
            < 2
        {
            assert!(
                Instant::now() < deadline,
                "the background sleep never showed up in the cgroup"
            );
            tokio::time::sleep(Duration::from_millis(10)).await;
        }
        let o = worker
            .finish(Duration::from_millis(200), CancellationToken::new())
            .await
            .expect("finish");
        assert_eq!(o.end, End::TimedOut);
        assert_eq!(o.enforcement.containment, "cgroup");
        // This machine's v2 hierarchy may lack the memory and pids controllers: recorded in
        // cgroup_limits, not fatal.
        for limit in ["memory.max", "pids.max"] {
            let applied = o.enforcement.cgroup_limits.iter().any(|l| l == limit);
            let available = parent.join(limit).exists()
                || parent.join("cgroup.subtree_control").exists()
                    && std::fs::read_to_string(parent.join("cgroup.subtree_control"))
                        .unwrap()
                        .contains(limit.split('.').next().unwrap());
            assert_eq!(
                applied, available,
                "{limit}: applied {applied}, controller available {available}"
            );
        }
        assert!(group_members(o.pid).is_empty());
        assert!(!cgroup.exists(), "the worker's cgroup was not removed");
    });
}
