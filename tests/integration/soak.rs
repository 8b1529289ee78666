//! Load and soak: many mixed calls (external reads, counter writes, built-ins)
//! across many sessions from several connections, with random cancellations, timeouts and
//! client disconnects; afterwards nothing may be lost or leaked. `.ci/run` runs the short
//! version (`AIRLOCK_SOAK_CALLS`, 2,000 by default); `bench/run` runs 10,000 and reports the
//! throughput and latencies (the machinery is `airlock_test_support::soak`, which the bench
//! shares).

use airlock_test_support::soak::{daemon, run, Config};

#[test]
fn soak_short() {
    let calls = std::env::var("AIRLOCK_SOAK_CALLS")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(2000);
    let seed = std::env::var("AIRLOCK_SOAK_SEED")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(0x5eed_1234);
    let mut d = daemon();
    d.start();
    let cfg = Config {
        calls,
        sessions: 32,
        connections: 8,
        seed,
    };
    let r = run(&d, &cfg);
    println!(
        "soak: {} calls in {:.1?} ({:.0} calls/s), {} cancels ({} replied anyway), {} disconnects; \
         fds {} idle / {} after; RSS {} KiB idle / {} peak / {} after; seed {seed:#x}",
        r.sent,
        r.elapsed,
        r.sent as f64 / r.elapsed.as_secs_f64(),
        r.cancels,
        r.late_replies,
        r.disconnects,
        r.idle_fds,
        r.after_fds,
        r.idle_rss_kib,
        r.peak_rss_kib,
        r.after_rss_kib
    );
    assert!(
        r.problems.is_empty(),
        "the soak found {} problem(s):\n{}",
        r.problems.len(),
        r.problems.join("\n")
    );
}
