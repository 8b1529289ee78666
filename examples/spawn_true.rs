//! Developer timing of a sandboxed spawn of /bin/true against a bare fork/exec/wait of it
//! (medians and p99 of N runs, printed). Not a benchmark (see bench/) and asserts nothing.
//!
//! `cargo run --release --example spawn_true -- [N]`

use std::path::Path;
use std::time::{Duration, Instant};

use airlock::sandbox::{self, Launch, Worker};
use tokio_util::sync::CancellationToken;

fn stats(name: &str, mut v: Vec<Duration>) -> Duration {
    v.sort();
    let med = v[v.len() / 2];
    let p99 = v[(v.len() * 99 / 100).min(v.len() - 1)];
    println!("{name:<28} median {med:>10.3?}  p99 {p99:>10.3?}");
    med
}

fn main() {
    let n: usize = std::env::args()
        .nth(1)
        .and_then(|a| a.parse().ok())
        .unwrap_or(200);
    let exe = std::env::current_exe().expect("current exe");
    let airlock = exe
        .parent()
        .and_then(Path::parent)
        .map(|d| d.join("airlock"))
        .expect("target dir");
    let rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .expect("runtime");
    let dir = Path::new(env!("CARGO_MANIFEST_DIR")).join("policies");
    let policy = airlock::policy::load(&dir).expect("policy");
    let profile = policy.profiles["default"].clone();
    // Compiled once, as the daemon does at policy load.
    let filters = sandbox::Filters::new();
    filters
        .prepare(policy.profiles.values(), true)
        .expect("seccomp filters");
    let staging = tempfile::tempdir().expect("tempdir");

    let mut bare = Vec::with_capacity(n);
    for _ in 0..n {
        let t = Instant::now();
        let s = std::process::Command::new("/bin/true")
            .status()
            .expect("true");
        assert!(s.success());
        bare.push(t.elapsed());
    }
    let sandboxed = rt.block_on(async {
        let sb = sandbox::Sandbox::start(airlock).expect("sandbox");
        let mut v = Vec::with_capacity(n);
        let mut starts = Vec::with_capacity(n);
        for i in 0..n + 5 {
            let launch = Launch {
                argv: vec!["/bin/true".into()],
                env: Vec::new(),
                cwd: staging.path().to_path_buf(),
                stdin: Vec::new(),
                writable: vec![staging.path().to_path_buf()],
                readable: Vec::new(),
                profile: profile.clone(),
                cgroup_parent: None,
                job_id: format!("t{i}"),
                identity: None,
                registry: None,
                progress: None,
            };
            let t = Instant::now();
            let w = Worker::spawn(&sb, launch, &filters).await.expect("spawn");
            let started = t.elapsed();
            let o = w
                .finish(Duration::from_secs(10), CancellationToken::new())
                .await
                .expect("finish");
            assert_eq!(o.end, sandbox::End::Exited(0));
            if i >= 5 {
                v.push(t.elapsed());
                starts.push(started);
            }
        }
        stats("  of which spawn (to exec)", starts);
        v
    });
    let b = stats("bare fork/exec/wait", bare);
    let s = stats("sandboxed (airlock)", sandboxed);
    println!("ratio {:.2}x", s.as_secs_f64() / b.as_secs_f64());
}
