//! One failpoint for every filesystem mutation of publication, commit and recovery.
//!
//! Built only with `--features failpoints`; otherwise [`hit`] is an inline no-op and release
//! builds carry nothing. Under the feature, every call counts one point, in order, and the
//! environment steers what happens at point N (0-based):
//!
//! * `AIRLOCK_FAILPOINT_CRASH_AT=N`: `abort()` at point N, as a kill -9 would stop the daemon.
//! * `AIRLOCK_FAILPOINT_ERROR_AT=N` with `AIRLOCK_FAILPOINT_ERRNO=EIO|ENOSPC|EXDEV|EINVAL`:
//!   point N fails with that errno instead of mutating anything (`N,M,...`: each of them, for
//!   a failure whose handling meets another).
//! * `AIRLOCK_FAILPOINT_LOG=FILE`: append `N NAME` for every point reached, so that a harness
//!   learns how many points a call has and what each one is.
//! * `AIRLOCK_FAILPOINT_PAUSE_AT=N` with `AIRLOCK_FAILPOINT_PAUSE_MS=MS`: sleep before point N,
//!   after logging it, so a race test can act while publication is stopped there.
//! * `AIRLOCK_FAILPOINT_PAUSE_NAME=NAME` with `AIRLOCK_FAILPOINT_PAUSE_EVERY=K` and
//!   `AIRLOCK_FAILPOINT_PAUSE_MARK=FILE`: before every K-th hit of the point named NAME,
//!   create FILE and wait until the test removes it (or `AIRLOCK_FAILPOINT_PAUSE_MS` pass,
//!   then remove it), so a test can act while, say, a big cleanup is half done.

/// Marks one filesystem mutation named `name` (such as `publish.exchange`).
#[cfg(not(feature = "failpoints"))]
#[inline(always)]
pub fn hit(_name: &'static str) -> std::io::Result<()> {
    Ok(())
}

#[cfg(feature = "failpoints")]
pub fn hit(name: &'static str) -> std::io::Result<()> {
    use std::io::Write;
    use std::sync::atomic::{AtomicU64, Ordering};
    static COUNTER: AtomicU64 = AtomicU64::new(0);
    let n = COUNTER.fetch_add(1, Ordering::SeqCst);
    let var = |k: &str| std::env::var(k).ok();
    if let Some(log) = var("AIRLOCK_FAILPOINT_LOG") {
        if let Ok(mut f) = std::fs::OpenOptions::new()
            .create(true)
            .append(true)
            .open(log)
        {
            let _ = writeln!(f, "{n} {name}");
            let _ = f.sync_all();
        }
    }
    if var("AIRLOCK_FAILPOINT_PAUSE_AT").and_then(|v| v.parse::<u64>().ok()) == Some(n) {
        let ms = var("AIRLOCK_FAILPOINT_PAUSE_MS")
            .and_then(|v| v.parse().ok())
            .unwrap_or(500);
        std::thread::sleep(std::time::Duration::from_millis(ms));
    }
    if var("AIRLOCK_FAILPOINT_PAUSE_NAME").as_deref() == Some(name) {
        static NAMED: AtomicU64 = AtomicU64::new(0);
        let k = NAMED.fetch_add(1, Ordering::SeqCst) + 1;
        let every = var("AIRLOCK_FAILPOINT_PAUSE_EVERY").and_then(|v| v.parse::<u64>().ok());
        if let (Some(every @ 1..), Some(mark)) = (every, var("AIRLOCK_FAILPOINT_PAUSE_MARK")) {
            if k % every == 0 {
                let ms = var("AIRLOCK_FAILPOINT_PAUSE_MS")
                    .and_then(|v| v.parse().ok())
                    .unwrap_or(500);
                let _ = std::fs::write(&mark, name);
                let until = std::time::Instant::now() + std::time::Duration::from_millis(ms);
                while std::path::Path::new(&mark).exists() && std::time::Instant::now() < until {
                    std::thread::sleep(std::time::Duration::from_millis(10));
                }
                let _ = std::fs::remove_file(&mark);
            }
        }
    }
    if var("AIRLOCK_FAILPOINT_CRASH_AT").and_then(|v| v.parse::<u64>().ok()) == Some(n) {
        std::process::abort();
    }
    if var("AIRLOCK_FAILPOINT_ERROR_AT").is_some_and(|v| {
        v.split(',')
            .any(|at| at.trim().parse::<u64>().ok() == Some(n))
    }) {
        let errno = match var("AIRLOCK_FAILPOINT_ERRNO").as_deref() {
            Some("ENOSPC") => libc::ENOSPC,
            Some("EXDEV") => libc::EXDEV,
            Some("EINVAL") => libc::EINVAL,
            _ => libc::EIO,
        };
        return Err(std::io::Error::from_raw_os_error(errno));
    }
    Ok(())
}
