//! Races against publication. The daemon is paused at a failpoint of publication
//! (`AIRLOCK_FAILPOINT_PAUSE_AT`); while it waits, the test plays the attacker: it swaps a
//! target's parent for a symlink leading out, replaces the target with a symlink, makes it a
//! directory, or hard-links it to a file outside. Nothing outside the workspace may change,
//! and the call either publishes correctly or rolls back with a clear error.

use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use serde_json::{json, Value};

use crate::harness::*;

/// The index of the first failpoint named `name` in a call of `tool` with `args` (its
/// `session` added), from a reference run on a daemon `prepare` set up.
pub(crate) async fn point_index(
    tool: &str,
    args: &Value,
    prepare: impl FnOnce(&Daemon),
    name: &str,
) -> u64 {
    let mut d = Daemon::new();
    prepare(&d);
    let log = d.dir.path().join("points.log");
    d.env = vec![("AIRLOCK_FAILPOINT_LOG".into(), log.display().to_string())];
    d.start();
    let c = d.client().await;
    session(&c, "r").await;
    std::fs::write(&log, "").unwrap();
    let mut a = args.clone();
    a["session"] = "r".into();
    let r = call(&c, tool, a).await;
    assert!(!is_error(&r), "{r}");
    let text = std::fs::read_to_string(&log).unwrap();
    let line = text
        .lines()
        .find(|l| l.ends_with(&format!(" {name}")))
        .unwrap_or_else(|| {
            panic!("no failpoint {name} in:\n{text}\n(built without --features failpoints?)")
        });
    // Counting restarts with each daemon, and the session_create above passed none.
    line.split_whitespace().next().unwrap().parse().unwrap()
}

struct Race {
    d: Daemon,
    outside: PathBuf,
    outside_before: Vec<(String, Vec<u8>)>,
}

/// Starts a daemon that pauses 1.5 s at failpoint `point`, runs `two_outputs` with `args` in
/// the background, waits for the pause, runs `attack`, and returns the call's result.
async fn run_race(
    args: Value,
    pre: &[(&str, &str)],
    point_name: &str,
    attack: impl FnOnce(&Path, &Path),
) -> (Race, Value) {
    let index = point_index(
        "two_outputs",
        &args,
        |d| {
            for (p, c) in pre {
                d.write(p, c);
            }
        },
        point_name,
    )
    .await;
    let mut d = Daemon::new();
    for (p, c) in pre {
        d.write(p, c);
    }
    let outside = d.dir.path().join("outside");
    std::fs::create_dir_all(&outside).unwrap();
    std::fs::write(outside.join("victim.txt"), "victim").unwrap();
    let outside_before = snapshot(&outside);
    let log = d.dir.path().join("points.log");
    d.env = vec![
        ("AIRLOCK_FAILPOINT_LOG".into(), log.display().to_string()),
        ("AIRLOCK_FAILPOINT_PAUSE_AT".into(), index.to_string()),
        ("AIRLOCK_FAILPOINT_PAUSE_MS".into(), "1500".into()),
    ];
    d.start();
    let c = std::sync::Arc::new(d.client().await);
    session(&c, "r").await;
    let mut a = args.clone();
    a["session"] = "r".into();
    let c2 = c.clone();
    let running = tokio::spawn(async move { call(&c2, "two_outputs", a).await });
    let deadline = Instant::now() + Duration::from_secs(20);
    let want = format!("{index} {point_name}");
    while !std::fs::read_to_string(&log)
        .unwrap_or_default()
        .lines()
        .any(|l| l == want)
    {
        assert!(Instant::now() < deadline, "the daemon never reached {want}");
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
    attack(&d.workspace, &outside);
    let r = running.await.unwrap();
    (
        Race {
            d,
            outside,
            outside_before,
        },
        r,
    )
}

impl Race {
    fn assert_outside_untouched(&self) {
        assert_eq!(
            snapshot(&self.outside),
            self.outside_before,
            "something outside the workspace changed"
        );
    }
}

fn clear_error(r: &Value) {
    assert_eq!(code(r), "PUBLISH_FAILED", "{r}");
    assert!(text(r).contains("restored"), "{r}");
}

#[tokio::test]
async fn parent_swapped_for_a_symlink_leading_out() {
    let args = json!({"a": "sub/a.txt", "b": "b.txt"});
    let pre = [("sub/a.txt", "old a"), ("b.txt", "old b")];
    for point in ["publish.journal_write", "publish.exchange"] {
        let (race, r) = run_race(args.clone(), &pre, point, |ws, outside| {
            std::fs::rename(ws.join("sub"), ws.join("sub.moved")).unwrap();
            std::os::unix::fs::symlink(outside, ws.join("sub")).unwrap();
        })
        .await;
        race.assert_outside_untouched();
        assert!(
            !race.outside.join("a.txt").exists(),
            "published through the symlink ({point})"
        );
        if is_error(&r) {
            clear_error(&r);
            assert_eq!(
                race.d.read("sub.moved/a.txt").as_deref(),
                Some("old a"),
                "{point}"
            );
            assert_eq!(race.d.read("b.txt").as_deref(), Some("old b"), "{point}");
        } else {
            // Published into the directory it resolved, wherever it now is.
            assert_eq!(
                race.d.read("sub.moved/a.txt").as_deref(),
                Some("A\n"),
                "{point}: {r}"
            );
            assert_eq!(race.d.read("b.txt").as_deref(), Some("B\n"), "{point}");
        }
        assert!(race.d.job_dirs().is_empty());
    }
}

#[tokio::test]
async fn target_replaced_by_a_symlink() {
    let pre = [("a.txt", "old a"), ("b.txt", "old b")];
    let (race, r) = run_race(
        json!({"a": "a.txt", "b": "b.txt"}),
        &pre,
        "publish.exchange",
        |ws, outside| {
            std::fs::remove_file(ws.join("a.txt")).unwrap();
            std::os::unix::fs::symlink(outside.join("victim.txt"), ws.join("a.txt")).unwrap();
        },
    )
    .await;
    race.assert_outside_untouched();
    clear_error(&r);
    // The attacker's symlink is back where it put it, b.txt is the old one.
    assert!(std::fs::symlink_metadata(race.d.workspace.join("a.txt"))
        .unwrap()
        .file_type()
        .is_symlink());
    assert_eq!(race.d.read("b.txt").as_deref(), Some("old b"));
    assert!(race.d.job_dirs().is_empty());
}

#[tokio::test]
async fn target_made_a_directory() {
    let pre = [("a.txt", "old a"), ("b.txt", "old b")];
    let (race, r) = run_race(
        json!({"a": "a.txt", "b": "b.txt"}),
        &pre,
        "publish.exchange",
        |ws, _| {
            std::fs::remove_file(ws.join("a.txt")).unwrap();
            std::fs::create_dir(ws.join("a.txt")).unwrap();
            std::fs::write(ws.join("a.txt/inside"), "attacker").unwrap();
        },
    )
    .await;
    race.assert_outside_untouched();
    clear_error(&r);
    assert_eq!(race.d.read("a.txt/inside").as_deref(), Some("attacker"));
    assert_eq!(race.d.read("b.txt").as_deref(), Some("old b"));
    assert!(race.d.job_dirs().is_empty());
}

#[tokio::test]
async fn target_hard_linked() {
    // A hard link inside the workspace: the old inode keeps its other name; publication is
    // correct. A hard link to a file outside: the victim must not be written or moved.
    let pre = [("a.txt", "old a"), ("b.txt", "old b")];
    let (race, r) = run_race(
        json!({"a": "a.txt", "b": "b.txt"}),
        &pre,
        "publish.exchange",
        |ws, _| {
            std::fs::hard_link(ws.join("a.txt"), ws.join("a-link.txt")).unwrap();
        },
    )
    .await;
    race.assert_outside_untouched();
    assert!(!is_error(&r), "{r}");
    assert_eq!(race.d.read("a.txt").as_deref(), Some("A\n"));
    assert_eq!(race.d.read("a-link.txt").as_deref(), Some("old a"));

    let (race, r) = run_race(
        json!({"a": "a.txt", "b": "b.txt"}),
        &pre,
        "publish.exchange",
        |ws, outside| {
            std::fs::remove_file(ws.join("a.txt")).unwrap();
            std::fs::hard_link(outside.join("victim.txt"), ws.join("a.txt")).unwrap();
        },
    )
    .await;
    race.assert_outside_untouched();
    clear_error(&r);
    assert_eq!(
        race.d.read("a.txt").as_deref(),
        Some("victim"),
        "the attacker's link is left as it was"
    );
    assert_eq!(race.d.read("b.txt").as_deref(), Some("old b"));
    assert!(race.d.job_dirs().is_empty());
}
