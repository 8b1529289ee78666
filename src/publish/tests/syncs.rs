//! Groups of fsyncs run together: every failpoint passed first, in order, on the calling
//! thread; a failure kept to its own group.

use super::super::sys::{run_together, run_together_with, Syncs};
use super::*;

/// A group of one fsync per name, each of a new dir in `root`.
fn group(root: &Path, names: &[&'static str]) -> Syncs {
    let mut g = Syncs::default();
    for (i, name) in names.iter().enumerate() {
        let dir = root.join(format!("{name}-{i}"));
        fs::create_dir_all(&dir).unwrap();
        g.push(name, fs::File::open(&dir).unwrap().into(), &dir);
    }
    g
}

#[test]
fn failpoints_come_in_order_before_what_runs_alongside() {
    let tmp = tempfile::tempdir().unwrap();
    let (a, b) = (
        group(tmp.path(), &["t.a1", "t.a2"]),
        group(tmp.path(), &["t.b1"]),
    );
    testsim::arm(Mode::Off);
    let ([ra, rb], alongside) = run_together_with([a, b], || super::super::fp("t.beside"));
    let names = testsim::disarm();
    assert_eq!(names, ["t.a1", "t.a2", "t.b1", "t.beside"]);
    assert!(ra.is_ok() && rb.is_ok() && alongside.is_ok());
}

#[test]
fn an_injected_error_fails_its_own_group_only() {
    let tmp = tempfile::tempdir().unwrap();
    let groups = [
        group(tmp.path(), &["t.a1", "t.a2"]),
        group(tmp.path(), &["t.b1", "t.b2"]),
    ];
    // The second point of the first group fails: that group issues nothing (its later
    // points are not reached), the other runs.
    testsim::arm(Mode::Error(1));
    let [ra, rb] = run_together(groups);
    let names = testsim::disarm();
    assert_eq!(names, ["t.a1", "t.a2", "t.b1", "t.b2"]);
    assert!(
        matches!(&ra, Err(PublishError::Io { op: "t.a2", source, .. }) if source.raw_os_error() == Some(libc::EIO)),
        "{ra:?}"
    );
    assert!(rb.is_ok(), "{rb:?}");

    // A crash (every point from the first on fails): nothing is issued, in either group.
    let groups = [group(tmp.path(), &["t.c1"]), group(tmp.path(), &["t.d1"])];
    testsim::arm(Mode::Crash(0));
    let [rc, rd] = run_together(groups);
    testsim::disarm();
    assert!(rc.is_err() && rd.is_err());
}

#[test]
fn a_failed_fsync_is_reported_as_its_own() {
    let tmp = tempfile::tempdir().unwrap();
    let mut g = group(tmp.path(), &["t.ok"]);
    // fsync of a pipe fails with EINVAL: a real failure, not a failpoint's.
    let (r, _w) = rustix::pipe::pipe().unwrap();
    g.push("t.pipe", r, &tmp.path().join("pipe"));
    testsim::arm(Mode::Off);
    let [res] = run_together([g]);
    testsim::disarm();
    assert!(
        matches!(&res, Err(PublishError::Io { op: "t.pipe", source, .. }) if source.raw_os_error() == Some(libc::EINVAL)),
        "{res:?}"
    );
}
