//! Worker processes that outlive the daemon, and their end at the next start.
//!
//! PR_SET_PDEATHSIG reaches only the process that set it, the worker's leader: when the
//! daemon dies (SIGKILL included), the leader dies with it, but the leader's background
//! children live on, reparented to init. A process group bounds signals, not lifetimes. Two
//! records let the next start find and kill every one of them before recovery touches
//! their job dirs:
//!
//! * a registry file per spawner process, `<state_dir>/workers/session-<sid>`, written once,
//!   at the first worker that spawner forks (before that worker is sent its spec, so before
//!   the tool can fork), not per worker. The spawner starts a session of its own (`setsid`)
//!   and every worker and template is forked from it, so the session holds exactly the
//!   spawner, its templates and the workers with all their descendants: setsid is denied to
//!   workers, and no process can join a session it did not start. The record holds the
//!   session id (the spawner's pid), the spawner's start time and the uids its workers may
//!   run as (the daemon's, and the worker range): a survivor is a live process of that
//!   session, started no earlier than the spawner, running as one of those uids. A session
//!   id cannot be reused while a process is in the session; once it is empty, a new session
//!   with that id has its leader alive, with another start time: such a record is left
//!   alone. The files need no fsync (a machine crash leaves no process to kill) and are
//!   removed by the next start's sweep.
//! * the older per-worker records, `<state_dir>/workers/<pgid>` (group, session, leader
//!   start, worker uid), still swept as before: a daemon upgraded after a crash finds them.
//!
//! A delegated cgroup is the third record: each leftover worker cgroup is killed through
//! `cgroup.kill` and removed.

use std::collections::BTreeMap;
use std::io;
use std::os::fd::OwnedFd;
use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use rustix::process::{Pid, Signal};
use serde::{Deserialize, Serialize};

use super::identity::Pool;
use super::procfs::{all_processes, read_stat, ProcStat};

/// Why the registry could not be opened or a worker recorded in it.
#[derive(Debug, thiserror::Error)]
pub enum RegistryError {
    #[error("create {path}")]
    Create {
        path: PathBuf,
        #[source]
        source: io::Error,
    },
    #[error("cannot read /proc/{pgid}/stat")]
    NoStat { pgid: i32 },
    #[error("encode the record of worker group {pgid}")]
    Encode {
        pgid: i32,
        #[source]
        source: serde_json::Error,
    },
    #[error("write {path}")]
    Write {
        path: PathBuf,
        #[source]
        source: io::Error,
    },
}

/// The directory of live-worker records.
#[derive(Debug, Clone)]
pub struct Registry {
    dir: PathBuf,
    /// The spawner sessions recorded in this run (a record is written once per session).
    recorded: std::sync::Arc<std::sync::Mutex<Vec<Session>>>,
    /// The range workers lease uids from, if they do (for the session records).
    worker_uids: Option<(u32, u32)>,
}

/// A spawner's session: the session id (the spawner's pid) and the spawner's start time, in
/// clock ticks since boot.
#[derive(Debug, Clone, Copy, Serialize, Deserialize, PartialEq, Eq)]
pub(crate) struct Session {
    pub sid: i32,
    pub start: u64,
}

/// The record of a spawner session (see the module comment).
#[derive(Debug, Clone, Copy, Serialize, Deserialize, PartialEq, Eq)]
struct SessionRecord {
    session: Session,
    /// The daemon's uid: workers sharing it run as it.
    daemon_uid: u32,
    /// The worker uid range, when workers get uids of their own.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    worker_uids: Option<(u32, u32)>,
}

#[derive(Debug, Clone, Copy, Serialize, Deserialize, PartialEq, Eq)]
struct Record {
    pgid: i32,
    sid: i32,
    /// The leader's start time, in clock ticks since boot (`/proc/PID/stat` field 22).
    start: u64,
    /// The worker's own uid, when it has one (absent in records of workers under the
    /// daemon's uid).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    uid: Option<u32>,
}

/// A record file, by kind.
enum Parsed {
    Session(SessionRecord),
    Worker(Record),
}

/// Removes its registry file when the worker's group is confirmed gone (the per-worker
/// records of older versions, which the tests still write to check their sweep).
#[cfg(test)]
#[derive(Debug)]
pub(crate) struct Entry {
    path: PathBuf,
}

#[cfg(test)]
impl Drop for Entry {
    fn drop(&mut self) {
        let _ = std::fs::remove_file(&self.path);
    }
}

impl Registry {
    /// Opens (creating, 0700) the registry directory.
    pub fn open(dir: &Path) -> Result<Registry, RegistryError> {
        use std::os::unix::fs::DirBuilderExt;
        std::fs::DirBuilder::new()
            .recursive(true)
            .mode(0o700)
            .create(dir)
            .map_err(|source| RegistryError::Create {
                path: dir.to_path_buf(),
                source,
            })?;
        Ok(Registry {
            dir: dir.to_path_buf(),
            recorded: Default::default(),
            worker_uids: None,
        })
    }

    /// The same registry, its session records naming `pool`'s range as the uids workers
    /// may run as.
    pub fn with_worker_uids(self, pool: Option<&Pool>) -> Registry {
        Registry {
            worker_uids: pool.map(Pool::bounds),
            ..self
        }
    }

    /// Records the spawner session a worker was just forked in (before it is sent its
    /// spec): a file the first time this run sees the session, nothing after.
    pub(crate) fn record_session(&self, session: Session) -> Result<(), RegistryError> {
        let mut recorded = self.recorded.lock().unwrap_or_else(|p| p.into_inner());
        if recorded.contains(&session) {
            return Ok(());
        }
        let rec = SessionRecord {
            session,
            daemon_uid: rustix::process::geteuid().as_raw(),
            worker_uids: self.worker_uids,
        };
        let path = self.dir.join(format!("session-{}", session.sid));
        let bytes = serde_json::to_vec(&rec).map_err(|source| RegistryError::Encode {
            pgid: session.sid,
            source,
        })?;
        std::fs::write(&path, bytes).map_err(|source| RegistryError::Write {
            path: path.clone(),
            source,
        })?;
        recorded.push(session);
        Ok(())
    }

    /// Records the worker whose leader is `pgid` (already forked, not yet running the tool),
    /// with the uid it leased if it has one of its own.
    #[cfg(test)]
    pub(crate) fn record(&self, pgid: i32, uid: Option<u32>) -> Result<Entry, RegistryError> {
        let stat = read_stat(pgid).ok_or(RegistryError::NoStat { pgid })?;
        let rec = Record {
            pgid,
            sid: stat.session,
            start: stat.start,
            uid,
        };
        let path = self.dir.join(pgid.to_string());
        let bytes =
            serde_json::to_vec(&rec).map_err(|source| RegistryError::Encode { pgid, source })?;
        std::fs::write(&path, bytes).map_err(|source| RegistryError::Write {
            path: path.clone(),
            source,
        })?;
        Ok(Entry { path })
    }

    /// Kills every process this daemon's previous run's workers left, as its records name
    /// them, and waits until they are gone. `pool`: the uid leases, when workers run under
    /// their own uids. Returns one line per process killed or spared, for the log.
    pub fn sweep(&self, pool: Option<&Pool>) -> Vec<String> {
        let mut records = Vec::new();
        let mut sessions = Vec::new();
        let mut paths = Vec::new();
        if let Ok(dir) = std::fs::read_dir(&self.dir) {
            for entry in dir.flatten() {
                let path = entry.path();
                let bytes = std::fs::read(&path).ok();
                let parsed = bytes.as_ref().and_then(|b| {
                    if let Ok(rec) = serde_json::from_slice::<SessionRecord>(b) {
                        Some(Parsed::Session(rec))
                    } else {
                        serde_json::from_slice::<Record>(b).ok().map(Parsed::Worker)
                    }
                });
                match parsed {
                    Some(Parsed::Session(rec)) => {
                        sessions.push(rec);
                        paths.push(path);
                    }
                    Some(Parsed::Worker(rec)) => records.push((path, rec)),
                    None => {
                        tracing::warn!(file = %path.display(), "unreadable worker record; removed");
                        let _ = std::fs::remove_file(&path);
                    }
                }
            }
        }
        let mut lines = Vec::new();
        // A session whose id now belongs to a live leader that is not the recorded spawner
        // is another session (the number was reused once the old one emptied): left alone.
        let sessions: Vec<SessionRecord> = sessions
            .into_iter()
            .filter(|r| match read_stat(r.session.sid) {
                Some(leader) if !leader.dead() && leader.start != r.session.start => {
                    lines.push(format!(
                        "left alone session {}: its id is another live process's now",
                        r.session.sid
                    ));
                    false
                }
                _ => true,
            })
            .collect();
        // A record naming a uid is swept only under that uid's lease, held until its
        // survivors are gone: if another daemon holds it, that daemon runs a worker under it
        // right now, and whatever matches the record may be that worker.
        let mut uid_locks: BTreeMap<u32, OwnedFd> = BTreeMap::new();
        let mut sweepable = Vec::new();
        for (_, rec) in &records {
            let Some(uid) = rec.uid else {
                sweepable.push(*rec);
                continue;
            };
            let spared = |why: String| {
                format!(
                    "left alone the processes of worker group {} (uid {uid}): {why}",
                    rec.pgid
                )
            };
            match pool {
                None => lines.push(spared(
                    "workers no longer get uids of their own, so its lease cannot be taken".into(),
                )),
                Some(p) if !p.contains(uid) => lines.push(spared(format!(
                    "uid {uid} is no longer in worker_uids, so its lease cannot be taken"
                ))),
                Some(_) if uid_locks.contains_key(&uid) => sweepable.push(*rec),
                Some(p) => match p.hold(uid) {
                    Ok(Some(lock)) => {
                        uid_locks.insert(uid, lock);
                        sweepable.push(*rec);
                    }
                    Ok(None) => lines.push(spared(format!(
                        "another process holds the lease of uid {uid} (another daemon's worker \
                         may run under it)"
                    ))),
                    Err(e) => lines.push(spared(crate::report::chain(&e).to_string())),
                },
            }
        }
        let me = rustix::process::getpid().as_raw_nonzero().get();
        let is_leftover = |p: &ProcStat| {
            p.pid != me
                && !p.dead()
                && (sweepable
                    .iter()
                    .any(|r| survivor_of(r, p) && r.uid.is_none_or(|u| real_uid(p.pid) == Some(u)))
                    || sessions.iter().any(|r| {
                        in_session(r, p) && real_uid(p.pid).is_some_and(|u| runs_as_worker(r, u))
                    }))
        };
        let mut killed = Vec::new();
        let deadline = Instant::now() + Duration::from_secs(10);
        loop {
            let left: Vec<ProcStat> = all_processes()
                .into_iter()
                .filter(|p| is_leftover(p))
                .collect();
            if left.is_empty() {
                break;
            }
            for p in &left {
                if let Some(pid) = Pid::from_raw(p.pid) {
                    if rustix::process::kill_process(pid, Signal::KILL).is_ok()
                        && !killed.iter().any(|(k, _)| *k == p.pid)
                    {
                        killed.push((p.pid, p.pgrp));
                    }
                }
            }
            if Instant::now() > deadline {
                tracing::warn!(
                    left = left.len(),
                    "leftover worker processes survive SIGKILL for 10 s; serving anyway"
                );
                break;
            }
            std::thread::sleep(Duration::from_millis(5));
        }
        drop(uid_locks);
        for path in records.iter().map(|(p, _)| p).chain(&paths) {
            let _ = std::fs::remove_file(path);
        }
        lines.extend(killed.into_iter().map(|(pid, pgid)| {
            format!("killed process {pid} (group {pgid}) left by a worker of a previous run")
        }));
        lines
    }
}

/// Whether `p` is a process of the recorded spawner session, started since its spawner.
fn in_session(r: &SessionRecord, p: &ProcStat) -> bool {
    p.session == r.session.sid && p.start >= r.session.start
}

/// Whether `uid` is one the recorded session's workers could run as.
fn runs_as_worker(r: &SessionRecord, uid: u32) -> bool {
    uid == r.daemon_uid || r.worker_uids.is_some_and(|(a, b)| (a..=b).contains(&uid))
}

/// Whether `p` is a process of the recorded worker's group.
fn survivor_of(r: &Record, p: &ProcStat) -> bool {
    p.pgrp == r.pgid && p.session == r.sid && p.start >= r.start
}

/// The real uid of `pid`, from `/proc/PID/status`.
fn real_uid(pid: i32) -> Option<u32> {
    let status = std::fs::read_to_string(format!("/proc/{pid}/status")).ok()?;
    status
        .lines()
        .find_map(|l| l.strip_prefix("Uid:"))?
        .split_ascii_whitespace()
        .next()?
        .parse()
        .ok()
}

/// Kills and removes every worker cgroup (`airlock-*`) a previous run left under `parent`.
pub fn sweep_cgroups(parent: &Path) -> Vec<String> {
    let mut done = Vec::new();
    let Ok(dir) = std::fs::read_dir(parent) else {
        return done;
    };
    for entry in dir.flatten() {
        let name = entry.file_name();
        if !name.to_string_lossy().starts_with("airlock-") || !entry.path().is_dir() {
            continue;
        }
        let path = entry.path();
        let _ = std::fs::write(path.join("cgroup.kill"), b"1");
        let deadline = Instant::now() + Duration::from_secs(10);
        loop {
            match std::fs::remove_dir(&path) {
                Ok(()) => {
                    done.push(format!(
                        "killed and removed leftover cgroup {}",
                        path.display()
                    ));
                    break;
                }
                Err(e) if e.kind() == io::ErrorKind::NotFound => break,
                Err(e) if Instant::now() > deadline => {
                    tracing::warn!(cgroup = %path.display(), "cannot remove a leftover worker cgroup: {}", crate::report::chain(&e));
                    break;
                }
                Err(_) => std::thread::sleep(Duration::from_millis(10)),
            }
        }
    }
    done
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn survivors_match_group_session_and_age() {
        let r = Record {
            pgid: 100,
            sid: 7,
            start: 5000,
            uid: None,
        };
        let p = |pgrp, session, start| ProcStat {
            pid: 101,
            state: b'S',
            ppid: 1,
            pgrp,
            session,
            start,
        };
        assert!(survivor_of(&r, &p(100, 7, 5000)));
        assert!(survivor_of(&r, &p(100, 7, 9000)));
        assert!(!survivor_of(&r, &p(100, 7, 4999)), "older than the leader");
        assert!(!survivor_of(&r, &p(100, 8, 9000)), "another session");
        assert!(!survivor_of(&r, &p(101, 7, 9000)), "another group");
    }

    /// A process of its own group (the test's session), running as `uid`.
    fn child_as(uid: u32) -> std::process::Child {
        use std::os::unix::process::CommandExt;
        std::process::Command::new("sleep")
            .arg("600")
            .uid(uid)
            .gid(uid)
            .process_group(0)
            .spawn()
            .expect("spawn sleep")
    }

    fn alive(c: &mut std::process::Child) -> bool {
        c.try_wait().expect("try_wait").is_none()
    }

    #[test]
    fn a_recorded_worker_is_killed_only_under_its_uids_lease_and_as_its_uid() {
        use super::super::identity::{LeaseDir, Pool};
        assert!(
            rustix::process::geteuid().is_root(),
            "this test needs root (its processes run as other uids)"
        );
        let tmp = tempfile::tempdir().unwrap();
        let reg = Registry::open(&tmp.path().join("workers")).unwrap();
        let leases = tmp.path().join("uids");
        let pool = Pool::new(70500, 70501, LeaseDir::open(&leases).unwrap());
        // Another daemon sharing the lease dir holds 70500's lease.
        let other = Pool::new(70500, 70500, LeaseDir::open(&leases).unwrap());
        let held = other.hold(70500).unwrap().expect("70500 free");
        let mut a = child_as(70500);
        let mut b = child_as(70501);
        let pid = |c: &std::process::Child| i32::try_from(c.id()).unwrap();
        // A record naming 70500, and one naming 70500 for a process running as 70501.
        std::mem::forget(reg.record(pid(&a), Some(70500)).unwrap());
        std::mem::forget(reg.record(pid(&b), Some(70500)).unwrap());
        let lines = reg.sweep(Some(&pool));
        assert!(
            alive(&mut a),
            "killed under a lease another daemon holds: {lines:?}"
        );
        assert!(alive(&mut b), "killed a process of another uid: {lines:?}");
        assert!(
            lines.iter().any(
                |l| l.contains(&format!("worker group {} (uid 70500)", pid(&a)))
                    && l.contains("another process holds the lease")
            ),
            "{lines:?}"
        );
        // Without a pool (workers under the daemon's uid now), a uid's record is left too.
        std::mem::forget(reg.record(pid(&a), Some(70500)).unwrap());
        drop(held);
        let lines = reg.sweep(None);
        assert!(alive(&mut a), "{lines:?}");
        // Its lease free, the recorded process of the recorded uid is killed, nothing else.
        std::mem::forget(reg.record(pid(&a), Some(70500)).unwrap());
        let lines = reg.sweep(Some(&pool));
        assert!(
            lines
                .iter()
                .any(|l| l.starts_with(&format!("killed process {} ", pid(&a)))),
            "{lines:?}"
        );
        a.wait().unwrap();
        assert!(alive(&mut b), "{lines:?}");
        assert!(
            pool.hold(70500).unwrap().is_some(),
            "the sweep kept the lease"
        );
        b.kill().unwrap();
        b.wait().unwrap();
        assert_eq!(
            std::fs::read_dir(tmp.path().join("workers"))
                .unwrap()
                .count(),
            0
        );
    }

    /// A process in a session of its own (`setsid`), as a spawner is, running as `uid`.
    fn session_leader_as(uid: u32) -> std::process::Child {
        use std::os::unix::process::CommandExt;
        std::process::Command::new("setsid")
            .args(["sleep", "600"])
            .uid(uid)
            .gid(uid)
            .spawn()
            .expect("spawn setsid sleep")
    }

    #[test]
    fn a_recorded_spawner_session_is_swept_once_and_written_once() {
        assert!(
            rustix::process::geteuid().is_root(),
            "this test needs root (its processes run as other uids)"
        );
        let tmp = tempfile::tempdir().unwrap();
        let workers = tmp.path().join("workers");
        let leases = tmp.path().join("uids");
        let pool = super::super::identity::Pool::new(
            70600,
            70601,
            super::super::identity::LeaseDir::open(&leases).unwrap(),
        );
        let reg = Registry::open(&workers)
            .unwrap()
            .with_worker_uids(Some(&pool));
        // `setsid` execs sleep in place when it is not a group leader: the child is the
        // session leader, pid == sid.
        let mut worker = session_leader_as(70600);
        let mut stranger = session_leader_as(70700);
        let pid = |c: &std::process::Child| i32::try_from(c.id()).unwrap();
        let stat = |c: &std::process::Child| {
            let mut tries = 0;
            loop {
                let s = read_stat(pid(c)).unwrap();
                if s.session == pid(c) || tries > 1000 {
                    break s;
                }
                tries += 1;
                std::thread::sleep(Duration::from_millis(1));
            }
        };
        let (w, x) = (stat(&worker), stat(&stranger));
        assert_eq!(w.session, pid(&worker));
        // Recorded once, whatever the number of workers forked in the session.
        let session = Session {
            sid: w.session,
            start: w.start,
        };
        for _ in 0..3 {
            reg.record_session(session).unwrap();
        }
        assert_eq!(std::fs::read_dir(&workers).unwrap().count(), 1);
        // A record whose session id is a live process with another start time is not ours.
        reg.record_session(Session {
            sid: x.session,
            start: x.start.saturating_sub(1),
        })
        .unwrap();
        let lines = reg.sweep(Some(&pool));
        assert!(
            lines
                .iter()
                .any(|l| l.starts_with(&format!("killed process {} ", pid(&worker)))),
            "{lines:?}"
        );
        worker.wait().unwrap();
        assert!(alive(&mut stranger), "{lines:?}");
        assert!(
            lines
                .iter()
                .any(|l| l.contains(&format!("left alone session {}", x.session))),
            "{lines:?}"
        );
        // The records are gone; the stranger, recorded with its own start now, is still
        // spared: it runs as no uid of the record's.
        assert_eq!(std::fs::read_dir(&workers).unwrap().count(), 0);
        let fresh = Registry::open(&workers)
            .unwrap()
            .with_worker_uids(Some(&pool));
        fresh
            .record_session(Session {
                sid: x.session,
                start: x.start,
            })
            .unwrap();
        let lines = fresh.sweep(Some(&pool));
        assert!(alive(&mut stranger), "{lines:?}");
        stranger.kill().unwrap();
        stranger.wait().unwrap();
    }

    #[test]
    fn records_and_removes() {
        let dir = tempfile::tempdir().unwrap();
        let reg = Registry::open(&dir.path().join("workers")).unwrap();
        let me = rustix::process::getpid().as_raw_nonzero().get();
        let entry = reg.record(me, Some(70400)).unwrap();
        let file = dir.path().join("workers").join(me.to_string());
        let rec: Record = serde_json::from_slice(&std::fs::read(&file).unwrap()).unwrap();
        assert_eq!(rec.pgid, me);
        assert_eq!(rec.uid, Some(70400));
        assert!(rec.start > 0);
        drop(entry);
        assert!(!file.exists());
    }
}
