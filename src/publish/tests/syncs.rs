//! Groups of fsyncs run together: every failpoint passed first, in order, on the calling
//! thread; a failure kept to its own group.

use super::super::sys::{run_together, run_together_with, Syncs};
use super::*;
use std::os::fd::AsFd;
use std::sync::Arc;

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

/// The workspace's group commit: the tests' temp dirs are on a filesystem that has one.
fn fs_sync(ws: &Workspace) -> &Arc<super::super::fs_sync::FsSync> {
    ws.fs_sync().expect(
        "the temp dir's filesystem has no syncfs group commit (ext4, xfs, btrfs or tmpfs needed)",
    )
}

/// A group of one fsync per name, made durable by `ws`'s group commit as a job begun at
/// `epoch` would be.
fn job_group(
    ws: &Workspace,
    root: &Path,
    names: &[&'static str],
    epoch: super::super::fs_sync::Epoch,
) -> Syncs {
    let mut g = Syncs::on(&Some((Arc::clone(fs_sync(ws)), epoch)));
    for (i, name) in names.iter().enumerate() {
        let dir = root.join(format!("{name}-{i}"));
        fs::create_dir_all(&dir).unwrap();
        g.push(name, fs::File::open(&dir).unwrap().into(), &dir);
    }
    g
}

#[test]
fn a_jobs_wave_is_one_syncfs_and_waves_that_wait_share_the_next() {
    let tmp = tempfile::tempdir().unwrap();
    let ws = open(&tmp);
    let fs_sync = Arc::clone(self::fs_sync(&ws));
    // One wave of three items, in two groups: every failpoint in order, one run.
    let (a, b) = (
        job_group(&ws, tmp.path(), &["t.a1", "t.a2"], fs_sync.epoch()),
        job_group(&ws, tmp.path(), &["t.b1"], fs_sync.epoch()),
    );
    testsim::arm(Mode::Off);
    let ([ra, rb], beside) = run_together_with([a, b], || super::super::fp("t.beside"));
    assert_eq!(testsim::disarm(), ["t.a1", "t.a2", "t.b1", "t.beside"]);
    assert!(ra.is_ok() && rb.is_ok() && beside.is_ok());
    assert_eq!(fs_sync.runs(), 1);

    // A run is going on when two more waves ask: they wait for it to end, then share the
    // next one (the running one began before they asked, so it cannot cover them).
    let (entered_tx, entered_rx) = std::sync::mpsc::channel();
    let watched = Arc::clone(&fs_sync);
    *fs_sync.pause.lock().unwrap() = Some(Box::new(move || {
        entered_tx.send(()).unwrap();
        while watched.asked() < 4 {
            std::thread::yield_now();
        }
    }));
    let wave = |fs: Arc<super::super::fs_sync::FsSync>| std::thread::spawn(move || fs.wait(None));
    let first = wave(Arc::clone(&fs_sync));
    entered_rx.recv().unwrap();
    let (second, third) = (wave(Arc::clone(&fs_sync)), wave(Arc::clone(&fs_sync)));
    for w in [first, second, third] {
        w.join().unwrap().unwrap();
    }
    assert_eq!(
        fs_sync.runs(),
        3,
        "one run for the first wave, one for the two that waited"
    );
}

#[test]
fn a_writeback_failure_fails_every_job_begun_before_it_even_after_a_good_run() {
    let tmp = tempfile::tempdir().unwrap();
    let ws = open(&tmp);
    let fs_sync = Arc::clone(self::fs_sync(&ws));
    write(tmp.path(), "a.txt", "old");
    // A job begins (its epoch is taken), then another call's wave meets a writeback error:
    // a page of this job's may have been the one lost, and is clean now.
    let mut job = Job::create(&ws, spec("j1", &["a.txt"])).unwrap();
    stage(&job, 0, "new");
    fs_sync
        .inject
        .lock()
        .unwrap()
        .push_back(rustix::io::Errno::IO);
    let other = job_group(&ws, tmp.path(), &["t.other"], fs_sync.epoch());
    testsim::arm(Mode::Off);
    let [r] = run_together([other]);
    testsim::disarm();
    assert!(
        matches!(&r, Err(PublishError::Io { op, source, .. }) if *op == super::super::sys::SYNC_FILESYSTEM && source.raw_os_error() == Some(libc::EIO)),
        "{r:?}"
    );
    // The job's own wave runs a good syncfs, and still fails: nothing published, the
    // commit never reached, the job dir gone.
    job.record_worker(4242).unwrap();
    let runs = fs_sync.runs();
    let mut committed = false;
    let e = job
        .publish_and_commit(|| {
            committed = true;
            Ok(())
        })
        .unwrap_err();
    assert!(fs_sync.runs() > runs, "the job's wave ran its own syncfs");
    assert!(
        matches!(&e, PublishError::Io { op, source, .. } if *op == super::super::sys::SYNC_FILESYSTEM && source.raw_os_error() == Some(libc::EIO)),
        "{e:?}"
    );
    assert!(!committed);
    assert_eq!(fs::read_to_string(tmp.path().join("a.txt")).unwrap(), "old");
    assert!(job_dirs(tmp.path()).is_empty());
    // A job begun after the failure publishes.
    let job = Job::create(&ws, spec("j2", &["a.txt"])).unwrap();
    stage(&job, 0, "new");
    job.publish_and_commit(|| Ok(())).unwrap();
    assert_eq!(fs::read_to_string(tmp.path().join("a.txt")).unwrap(), "new");
}

#[test]
fn only_a_filesystem_known_to_sync_whole_has_a_group_commit() {
    use super::super::fs_sync::FsSync;
    let open_dir = |p: &Path| -> std::os::fd::OwnedFd { fs::File::open(p).unwrap().into() };
    let tmp = tempfile::tempdir().unwrap();
    assert!(FsSync::open(open_dir(tmp.path()).as_fd())
        .unwrap()
        .is_some());
    // procfs is not one of them: a workspace there would keep an fsync per item.
    assert!(FsSync::open(open_dir(Path::new("/proc")).as_fd())
        .unwrap()
        .is_none());
}
