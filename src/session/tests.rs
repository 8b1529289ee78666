use super::*;

#[tokio::test]
async fn concurrent_commits_through_the_group_dir_sync_all_persist() {
    let dir = tempfile::tempdir().unwrap();
    let store = Arc::new(SessionStore::open(dir.path()).unwrap());
    for i in 0..16 {
        store.create(&format!("s{i}"), Map::new(), 0).unwrap();
    }
    let mut guards = Vec::new();
    for i in 0..16 {
        guards.push(store.lock(&format!("s{i}")).await.unwrap());
    }
    // 16 threads commit 20 times each, all at once, through the group-committed dir sync.
    std::thread::scope(|scope| {
        for (i, g) in guards.iter().enumerate() {
            let store = &store;
            scope.spawn(move || {
                for n in 1..=20u64 {
                    let mut st = Map::new();
                    st.insert("n".into(), n.into());
                    let snap = store.commit(g, st, &format!("job-{i}-{n}")).unwrap();
                    assert_eq!(snap.version, n);
                }
            });
        }
    });
    let sync = lock(&store.dir_sync.state);
    assert_eq!(sync.renamed, 16 + 16 * 20, "one ticket per write");
    assert_eq!(sync.covered, sync.renamed, "every write made durable");
    assert!(sync.failed.is_empty());
    assert!(!sync.running);
    drop(sync);
    drop(guards);
    let reopened = SessionStore::open(dir.path()).unwrap();
    for i in 0..16 {
        let snap = reopened.snapshot(&format!("s{i}")).unwrap();
        assert_eq!(snap.version, 20);
        assert_eq!(snap.state["n"], 20);
        assert!(reopened
            .committed(&format!("s{i}"), &format!("job-{i}-20"))
            .unwrap());
    }
}

#[tokio::test]
async fn commit_persists_and_destroy_tombstones() {
    let dir = tempfile::tempdir().unwrap();
    let store = SessionStore::open(dir.path()).unwrap();
    store.create("s1", Map::new(), 0).unwrap();
    let g = store.lock("s1").await.unwrap();
    let mut st = Map::new();
    st.insert("n".into(), 1.into());
    let snap = store.commit(&g, st, "job1").unwrap();
    assert_eq!(snap.version, 1);
    assert!(store.committed("s1", "job1").unwrap());
    drop(g);
    let reopened = SessionStore::open(dir.path()).unwrap();
    assert_eq!(reopened.snapshot("s1").unwrap().version, 1);
    let g = reopened.lock("s1").await.unwrap();
    reopened.destroy(g).unwrap();
    assert!(matches!(
        reopened.lock("s1").await,
        Err(SessionError::Destroyed(_))
    ));
    let again = SessionStore::open(dir.path()).unwrap();
    assert!(matches!(
        again.create("s1", Map::new(), 0),
        Err(SessionError::Destroyed(_))
    ));
}

#[tokio::test]
async fn owner_persists_through_commit_destroy_and_restart() {
    let dir = tempfile::tempdir().unwrap();
    let store = SessionStore::open(dir.path()).unwrap();
    store.create("mine", Map::new(), 1234).unwrap();
    let g = store.lock("mine").await.unwrap();
    assert_eq!(store.commit(&g, Map::new(), "j").unwrap().owner, Some(1234));
    drop(g);
    let reopened = SessionStore::open(dir.path()).unwrap();
    assert_eq!(reopened.owner("mine").unwrap(), Some(1234));
    let g = reopened.lock("mine").await.unwrap();
    reopened.destroy(g).unwrap();
    assert_eq!(reopened.owner("mine").unwrap(), Some(1234));
    let again = SessionStore::open(dir.path()).unwrap();
    assert_eq!(
        again.owner("mine").unwrap(),
        Some(1234),
        "the tombstone keeps it"
    );
    assert!(matches!(
        again.owner("never"),
        Err(SessionError::NotFound(_))
    ));
}

#[tokio::test]
async fn queued_mutator_fails_after_destroy() {
    let dir = tempfile::tempdir().unwrap();
    let store = Arc::new(SessionStore::open(dir.path()).unwrap());
    store.create("s", Map::new(), 0).unwrap();
    let destroyer = store.lock("s").await.unwrap();
    let s2 = store.clone();
    let queued = tokio::spawn(async move { s2.lock("s").await.map(|_| ()) });
    tokio::task::yield_now().await;
    store.destroy(destroyer).unwrap();
    assert!(matches!(
        queued.await.unwrap(),
        Err(SessionError::Destroyed(_))
    ));
}

fn limits(sessions: usize, per_session: u64, per_principal: u64) -> SessionLimits {
    SessionLimits {
        sessions_per_principal: sessions,
        session_state_bytes: per_session,
        state_bytes_per_principal: per_principal,
    }
}

fn state_of(len: usize) -> Map<String, Value> {
    let mut st = Map::new();
    // {"s":"xxx..."}: 8 bytes of JSON around the string.
    st.insert("s".into(), "x".repeat(len - 8).into());
    st
}

#[tokio::test]
async fn quotas_refuse_creates_and_commits_per_owner_and_count_again_after_reopen() {
    let dir = tempfile::tempdir().unwrap();
    let mut store = SessionStore::open(dir.path()).unwrap();
    store.set_limits(limits(2, 100, 150));
    assert_eq!(state_bytes(&state_of(100)), 100);
    // Past the per-session bound: refused, nothing on disk.
    let e = store.create("big", state_of(101), 7).unwrap_err();
    assert!(
        matches!(
            e,
            SessionError::Quota(QuotaError::SessionBytes {
                bytes: 101,
                limit: 100,
                ..
            })
        ),
        "{e}"
    );
    assert!(!dir.path().join("sessions/big.json").exists());
    store.create("a", state_of(100), 7).unwrap();
    // Past the owner's bytes: refused; another owner is not affected.
    let e = store.create("b", state_of(60), 7).unwrap_err();
    assert!(
        matches!(
            e,
            SessionError::Quota(QuotaError::PrincipalBytes {
                uid: 7,
                held: 100,
                more: 60,
                limit: 150,
                ..
            })
        ),
        "{e}"
    );
    assert!(
        e.to_string()
            .contains("max_state_bytes_per_principal (150)"),
        "{e}"
    );
    store.create("other", state_of(100), 8).unwrap();
    store.create("b", state_of(50), 7).unwrap();
    // Past the owner's count.
    let e = store.create("c", Map::new(), 7).unwrap_err();
    assert!(
        matches!(
            e,
            SessionError::Quota(QuotaError::Sessions {
                uid: 7,
                held: 2,
                limit: 2
            })
        ),
        "{e}"
    );
    assert!(
        e.to_string().contains("max_sessions_per_principal (2)"),
        "{e}"
    );
    assert_eq!(
        store.usage(7),
        Usage {
            sessions: 2,
            bytes: 150
        }
    );
    // A commit that grows past the owner's bytes is refused and changes nothing.
    let g = store.lock("b").await.unwrap();
    let e = store.commit(&g, state_of(51), "j1").unwrap_err();
    assert!(
        matches!(e, SessionError::Quota(QuotaError::PrincipalBytes { .. })),
        "{e}"
    );
    assert_eq!(store.load_locked(&g).unwrap().version, 0);
    assert_eq!(store.usage(7).bytes, 150);
    // A dropped reservation gives its room back; a shrinking commit frees room.
    let r = store.reserve(&g, &state_of(50)).unwrap();
    drop(r);
    assert_eq!(store.usage(7).bytes, 150);
    store.commit(&g, state_of(10), "j2").unwrap();
    assert_eq!(store.usage(7).bytes, 110);
    drop(g);
    // Recounted from the files.
    let mut again = SessionStore::open(dir.path()).unwrap();
    again.set_limits(limits(2, 100, 150));
    assert_eq!(
        again.usage(7),
        Usage {
            sessions: 2,
            bytes: 110
        }
    );
    assert_eq!(
        again.usage(8),
        Usage {
            sessions: 1,
            bytes: 100
        }
    );
    assert!(matches!(
        again.create("c", Map::new(), 7),
        Err(SessionError::Quota(QuotaError::Sessions { .. }))
    ));
    // A destroyed session counts toward neither bound; its tombstone stays on disk.
    let g = again.lock("a").await.unwrap();
    again.destroy(g).unwrap();
    assert_eq!(
        again.usage(7),
        Usage {
            sessions: 1,
            bytes: 10
        }
    );
    again.create("c", state_of(100), 7).unwrap();
    assert!(matches!(
        again.create("a", Map::new(), 7),
        Err(SessionError::Destroyed(_))
    ));
    assert_eq!(again.owner("a").unwrap(), Some(7));
    let reopened = SessionStore::open(dir.path()).unwrap();
    assert_eq!(
        reopened.usage(7),
        Usage {
            sessions: 2,
            bytes: 110
        }
    );
    assert!(matches!(
        reopened.snapshot("a"),
        Err(SessionError::Destroyed(_))
    ));
}

#[tokio::test]
async fn memory_holds_no_state_and_reads_see_the_committed_file() {
    let dir = tempfile::tempdir().unwrap();
    let store = SessionStore::open(dir.path()).unwrap();
    store.create("s", state_of(1000), 1).unwrap();
    let g = store.lock("s").await.unwrap();
    store.commit(&g, state_of(2000), "j").unwrap();
    let m = g.meta();
    assert_eq!((m.version, m.bytes, m.owner), (1, 2000, Some(1)));
    drop(g);
    let snap = store.snapshot("s").unwrap();
    assert_eq!((snap.version, state_bytes(&snap.state)), (1, 2000));
    let file = std::fs::read(dir.path().join("sessions/s.json")).unwrap();
    assert!(
        file.len() < 2000 + 200,
        "the file is compact: {} bytes",
        file.len()
    );
}

/// (device, inode) of `p`.
fn inode(p: &Path) -> (u64, u64) {
    use std::os::unix::fs::MetadataExt;
    let m = std::fs::symlink_metadata(p).unwrap();
    (m.dev(), m.ino())
}

fn numbered(n: u64) -> Map<String, Value> {
    let mut st = Map::new();
    st.insert("n".into(), n.into());
    st
}

fn file_at(p: &Path) -> SessionFile {
    read_file(p).unwrap()
}

#[tokio::test]
async fn commits_exchange_the_file_with_a_spare_and_make_no_inode() {
    use std::os::unix::fs::PermissionsExt;
    let dir = tempfile::tempdir().unwrap();
    let store = SessionStore::open(dir.path()).unwrap();
    store.create("s", Map::new(), 0).unwrap();
    let (cur, spare) = (
        dir.path().join("sessions/s.json"),
        dir.path().join("sessions/.s.json.tmp"),
    );
    assert!(!spare.exists(), "a create leaves no temp file");
    let g = store.lock("s").await.unwrap();
    let made = inode(&cur);
    store.commit(&g, numbered(1), "j1").unwrap();
    // The first commit makes its temp file; the file it replaced becomes the spare.
    assert_eq!(inode(&spare), made);
    assert_eq!(file_at(&spare).version, 0);
    let pair = [inode(&cur), inode(&spare)];
    for n in 2..=9u64 {
        store.commit(&g, numbered(n), &format!("j{n}")).unwrap();
        let now = [inode(&cur), inode(&spare)];
        assert_eq!(
            now,
            [pair[(n as usize + 1) % 2], pair[n as usize % 2]],
            "commit {n} exchanged the same two inodes"
        );
        let (f, s) = (file_at(&cur), file_at(&spare));
        assert_eq!((f.version, f.state["n"].as_u64()), (n, Some(n)));
        assert_eq!(f.last_job.as_deref(), Some(format!("j{n}").as_str()));
        assert_eq!(s.version, n - 1, "the spare holds the previous version");
        for p in [&cur, &spare] {
            let m = std::fs::symlink_metadata(p).unwrap();
            assert_eq!(m.permissions().mode() & 0o7777, 0o600);
            assert!(m.file_type().is_file());
        }
        assert!(store.committed("s", &format!("j{n}")).unwrap());
    }
    drop(g);
    // A start keeps a live session's spare (after an fsync of the dir), and the next commit
    // writes over it: still the same two inodes. A temp file of no live session goes.
    let orphan = dir.path().join("sessions/.gone.json.tmp");
    std::fs::write(&orphan, "{}").unwrap();
    let reopened = SessionStore::open(dir.path()).unwrap();
    assert!(
        !orphan.exists(),
        "a start removes a temp file no live session has"
    );
    assert_eq!(reopened.snapshot("s").unwrap().state["n"], 9);
    let g = reopened.lock("s").await.unwrap();
    let kept = [inode(&cur), inode(&spare)];
    reopened.commit(&g, numbered(10), "j10").unwrap();
    assert_eq!([inode(&cur), inode(&spare)], [kept[1], kept[0]]);
    assert_eq!(file_at(&cur).version, 10);
    assert_eq!(file_at(&spare).version, 9);
}

#[tokio::test]
async fn a_commit_that_fails_leaves_its_temp_file_to_be_replaced_not_written_over() {
    use std::io::Read;
    use std::os::unix::fs::MetadataExt;
    let dir = tempfile::tempdir().unwrap();
    let store = SessionStore::open(dir.path()).unwrap();
    store.create("s", Map::new(), 0).unwrap();
    let (cur, spare, aside) = (
        dir.path().join("sessions/s.json"),
        dir.path().join("sessions/.s.json.tmp"),
        dir.path().join("s.json.aside"),
    );
    let g = store.lock("s").await.unwrap();
    store.commit(&g, numbered(1), "j1").unwrap();
    store.commit(&g, numbered(2), "j2").unwrap();
    let staged = store.stage_commit(&g, numbered(3), "failed").unwrap();
    let mut held = std::fs::File::open(&spare).unwrap();
    // The exchange fails: the session's file is not where the commit expects it.
    std::fs::rename(&cur, &aside).unwrap();
    let reserved = store.reserve(&g, &numbered(3)).unwrap();
    assert!(matches!(
        store.commit_staged(&g, reserved, staged),
        Err(SessionError::Io { .. })
    ));
    std::fs::rename(&aside, &cur).unwrap();
    assert_eq!(g.meta().version, 2);
    assert_eq!(file_at(&cur).version, 2);
    store.commit(&g, numbered(3), "j3").unwrap();
    // The next commit made a fresh temp file: the failed one was unlinked, not written over.
    assert_eq!(held.metadata().unwrap().nlink(), 0);
    let mut bytes = Vec::new();
    held.read_to_end(&mut bytes).unwrap();
    let failed: SessionFile = serde_json::from_slice(&bytes).unwrap();
    assert_eq!(failed.last_job.as_deref(), Some("failed"));
    let f = file_at(&cur);
    assert_eq!((f.version, f.last_job.as_deref()), (3, Some("j3")));
    assert!(store.committed("s", "j3").unwrap());
}

#[tokio::test]
async fn destroy_leaves_no_spare_holding_an_earlier_state() {
    let dir = tempfile::tempdir().unwrap();
    let store = SessionStore::open(dir.path()).unwrap();
    store.create("s", Map::new(), 0).unwrap();
    let g = store.lock("s").await.unwrap();
    store.commit(&g, numbered(1), "j1").unwrap();
    store.commit(&g, numbered(2), "j2").unwrap();
    assert!(dir.path().join("sessions/.s.json.tmp").exists());
    store.destroy(g).unwrap();
    let names: Vec<String> = std::fs::read_dir(dir.path().join("sessions"))
        .unwrap()
        .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
        .collect();
    assert_eq!(names, ["s.json"]);
    let tomb = file_at(&dir.path().join("sessions/s.json"));
    assert!(tomb.destroyed && tomb.state.is_empty());
}

#[tokio::test]
async fn a_reader_without_the_session_lock_never_reads_a_spare_being_written() {
    use std::sync::mpsc;
    let dir = tempfile::tempdir().unwrap();
    let store = SessionStore::open(dir.path()).unwrap();
    store.create("s", numbered(0), 0).unwrap();
    let g = store.lock("s").await.unwrap();
    store.commit(&g, numbered(1), "j1").unwrap();
    // A reader stops between opening the session's file (version 1) and reading it.
    let (opened_tx, opened) = mpsc::channel();
    let (go, go_rx) = mpsc::channel::<()>();
    let go_rx = Mutex::new(go_rx);
    *lock(&AFTER_OPEN) = Some((
        dir.path().join("sessions/s.json"),
        Box::new(move || {
            let _ = opened_tx.send(());
            let _ = lock(&go_rx).recv();
        }),
    ));
    let (store, g) = (&store, &g);
    std::thread::scope(|scope| {
        let reader = scope.spawn(move || store.snapshot("s"));
        opened.recv().unwrap();
        // Meanwhile the next commit makes the reader's inode the spare, and the one after
        // writes it over in place (staged, never committed).
        let (written_tx, written) = mpsc::channel();
        let writer = scope.spawn(move || {
            store.commit(g, numbered(2), "j2").unwrap();
            let staged = store.stage_commit(g, numbered(3), "j3").unwrap();
            let _ = written_tx.send(());
            staged
        });
        // The writer waits for the reader: it cannot write the spare while a read is under
        // way, so it has written nothing by the time the reader goes on.
        let early = written.recv_timeout(std::time::Duration::from_millis(500));
        go.send(()).unwrap();
        assert!(
            early.is_err(),
            "a spare was written while a reader held the file"
        );
        let snap = reader.join().unwrap().unwrap();
        assert_eq!(
            (snap.version, snap.state["n"].as_u64()),
            (1, Some(1)),
            "the reader read the version it opened"
        );
        writer.join().unwrap();
    });
    assert_eq!(store.snapshot("s").unwrap().version, 2);
}

/// A store in `dir` holding session `s1` of `owner`, committed once (v1, `{"n": 1}`, job
/// `j1`), and the guard of its lock.
async fn s1_at_v1(dir: &std::path::Path, owner: u32) -> (SessionStore, SessionGuard) {
    let store = SessionStore::open(dir).unwrap();
    store.create("s1", Map::new(), owner).unwrap();
    let g = store.lock("s1").await.unwrap();
    store.commit(&g, n_state(1), "j1").unwrap();
    (store, g)
}

/// The state `{"n": n}`.
fn n_state(n: u64) -> Map<String, Value> {
    let mut st = Map::new();
    st.insert("n".into(), n.into());
    st
}

#[tokio::test]
async fn a_failed_fsync_after_the_exchange_puts_the_previous_version_back() {
    let dir = tempfile::tempdir().unwrap();
    let (store, g) = s1_at_v1(dir.path(), 0).await;
    // The fsync of the dir after the exchange fails; the one after putting v1 back runs.
    lock(&store.dir_sync.state).fail_next = 1;
    let e = store.commit(&g, n_state(2), "j2").unwrap_err();
    assert!(
        matches!(&e, SessionError::Io { source, .. } if source.raw_os_error() == Some(libc::EIO)),
        "{e:?}"
    );
    // Nothing committed: memory, the file by name and recovery's question all say v1, j1.
    assert_eq!(g.meta().version, 1);
    let snap = store.snapshot("s1").unwrap();
    assert_eq!((snap.version, &snap.state), (1, &n_state(1)));
    assert!(store.committed("s1", "j1").unwrap());
    assert!(!store.committed("s1", "j2").unwrap());
    // The session serves on: the next commit is v2, and survives a restart.
    assert_eq!(store.commit(&g, n_state(3), "j3").unwrap().version, 2);
    drop(g);
    let reopened = SessionStore::open(dir.path()).unwrap();
    let snap = reopened.snapshot("s1").unwrap();
    assert_eq!((snap.version, &snap.state), (2, &n_state(3)));
    assert!(reopened.committed("s1", "j3").unwrap());
}

#[tokio::test]
async fn a_commit_that_can_be_neither_made_durable_nor_undone_blocks_its_session() {
    let dir = tempfile::tempdir().unwrap();
    let store = SessionStore::open(dir.path()).unwrap();
    store.create("s1", Map::new(), 0).unwrap();
    store.create("s2", Map::new(), 0).unwrap();
    let g = store.lock("s1").await.unwrap();
    store.commit(&g, n_state(1), "j1").unwrap();
    // Both the fsync after the exchange and the one after putting v1 back fail.
    lock(&store.dir_sync.state).fail_next = 2;
    let e = store.commit(&g, n_state(2), "j2").unwrap_err();
    assert!(
        matches!(&e, SessionError::Undecided { id, what: "commit", source } if id == "s1" && source.raw_os_error() == Some(libc::EIO)),
        "{e:?}"
    );
    assert_eq!(
        g.meta().version,
        1,
        "memory never took the undecided version"
    );
    drop(g);
    // Every later lock and read of it fails, saying why; another session serves on.
    assert!(matches!(store.lock("s1").await, Err(SessionError::Blocked(id)) if id == "s1"));
    assert!(matches!(store.snapshot("s1"), Err(SessionError::Blocked(id)) if id == "s1"));
    let g2 = store.lock("s2").await.unwrap();
    assert_eq!(store.commit(&g2, n_state(7), "k1").unwrap().version, 1);
    drop(g2);
    // A restart reads what is there (here: v1 back under the name) and serves it again.
    drop(store);
    let reopened = SessionStore::open(dir.path()).unwrap();
    assert!(reopened.committed("s1", "j1").unwrap());
    let g = reopened.lock("s1").await.unwrap();
    assert_eq!(reopened.commit(&g, n_state(3), "j3").unwrap().version, 2);
}

/// The names in the sessions dir, sorted.
fn names_in(dir: &std::path::Path) -> Vec<String> {
    let mut names: Vec<String> = std::fs::read_dir(dir)
        .unwrap()
        .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
        .collect();
    names.sort();
    names
}

#[tokio::test]
async fn a_create_whose_dir_fsync_fails_leaves_no_session_now_or_at_the_next_start() {
    let dir = tempfile::tempdir().unwrap();
    let store = SessionStore::open(dir.path()).unwrap();
    lock(&store.dir_sync.state).fail_next = 1;
    let e = store.create("s1", n_state(1), 7).unwrap_err();
    assert!(
        matches!(&e, SessionError::Io { source, .. } if source.raw_os_error() == Some(libc::EIO)),
        "{e:?}"
    );
    // Not live, not counted, not on disk: the name was removed again.
    assert!(!store.is_live("s1"));
    assert_eq!(store.usage(7).sessions, 0);
    assert_eq!(store.usage(7).bytes, 0);
    assert!(
        names_in(&dir.path().join("sessions")).is_empty(),
        "{:?}",
        names_in(&dir.path().join("sessions"))
    );
    assert!(matches!(
        store.lock("s1").await,
        Err(SessionError::NotFound(_))
    ));
    let reopened = SessionStore::open(dir.path()).unwrap();
    assert!(!reopened.is_live("s1"));
    // The id is free: a create now succeeds and survives a restart.
    drop(reopened);
    store.create("s1", n_state(2), 7).unwrap();
    drop(store);
    let reopened = SessionStore::open(dir.path()).unwrap();
    let snap = reopened.snapshot("s1").unwrap();
    assert_eq!((snap.version, &snap.state), (0, &n_state(2)));
}

#[tokio::test]
async fn a_create_that_can_be_neither_made_durable_nor_removed_blocks_its_id() {
    let dir = tempfile::tempdir().unwrap();
    let store = SessionStore::open(dir.path()).unwrap();
    // The fsync after the rename and the one after removing the name both fail.
    lock(&store.dir_sync.state).fail_next = 2;
    let e = store.create("s1", n_state(1), 7).unwrap_err();
    assert!(
        matches!(&e, SessionError::Undecided { id, what: "creation", source } if id == "s1" && source.raw_os_error() == Some(libc::EIO)),
        "{e:?}"
    );
    // It may be on disk: the id stays taken and counted, and every use of it says why.
    assert_eq!(store.usage(7).sessions, 1);
    assert!(matches!(store.lock("s1").await, Err(SessionError::Blocked(id)) if id == "s1"));
    assert!(matches!(
        store.snapshot("s1"),
        Err(SessionError::Blocked(_))
    ));
    assert!(matches!(
        store.create("s1", n_state(1), 7),
        Err(SessionError::Blocked(_))
    ));
    // Another session serves on.
    store.create("s2", n_state(2), 7).unwrap();
    let g2 = store.lock("s2").await.unwrap();
    assert_eq!(store.commit(&g2, n_state(3), "k1").unwrap().version, 1);
    drop(g2);
    // The next start reads what is on disk (here the removal was made, only its fsync
    // failed): no s1, and the id is free again.
    drop(store);
    let reopened = SessionStore::open(dir.path()).unwrap();
    assert!(!reopened.is_live("s1"));
    assert_eq!(reopened.usage(7).sessions, 1);
    reopened.create("s1", n_state(4), 7).unwrap();
}

#[tokio::test]
async fn a_destroy_whose_dir_fsync_fails_leaves_the_session_live_with_its_state() {
    let dir = tempfile::tempdir().unwrap();
    let (store, g) = s1_at_v1(dir.path(), 7).await;
    lock(&store.dir_sync.state).fail_next = 1;
    let e = store.destroy(g).unwrap_err();
    assert!(
        matches!(&e, SessionError::Io { source, .. } if source.raw_os_error() == Some(libc::EIO)),
        "{e:?}"
    );
    // Live, counted, its state read by name and by a lock, no tombstone.
    assert!(store.is_live("s1"));
    assert_eq!(store.usage(7).sessions, 1);
    let snap = store.snapshot("s1").unwrap();
    assert_eq!((snap.version, &snap.state), (1, &n_state(1)));
    assert_eq!(store.tombstone("s1").unwrap(), None);
    assert!(store.committed("s1", "j1").unwrap());
    // It serves on: a commit, then a destroy that succeeds.
    let g = store.lock("s1").await.unwrap();
    assert_eq!(store.commit(&g, n_state(2), "j2").unwrap().version, 2);
    store.destroy(g).unwrap();
    // A destroyed session leaves its tombstone only: no file holding its state.
    assert_eq!(
        names_in(&dir.path().join("sessions")),
        vec!["s1.json".to_string()]
    );
    let tomb = std::fs::read_to_string(dir.path().join("sessions/s1.json")).unwrap();
    assert!(!tomb.contains("\"n\""), "{tomb}");
    let reopened = SessionStore::open(dir.path()).unwrap();
    assert!(matches!(
        reopened.snapshot("s1"),
        Err(SessionError::Destroyed(_))
    ));
}

#[tokio::test]
async fn a_destroy_that_can_be_neither_made_durable_nor_undone_blocks_its_session() {
    let dir = tempfile::tempdir().unwrap();
    let (store, g) = s1_at_v1(dir.path(), 7).await;
    lock(&store.dir_sync.state).fail_next = 2;
    let e = store.destroy(g).unwrap_err();
    assert!(
        matches!(&e, SessionError::Undecided { id, what: "destruction", source } if id == "s1" && source.raw_os_error() == Some(libc::EIO)),
        "{e:?}"
    );
    assert!(matches!(
        store.lock("s1").await,
        Err(SessionError::Blocked(_))
    ));
    assert!(matches!(
        store.snapshot("s1"),
        Err(SessionError::Blocked(_))
    ));
    assert_eq!(store.usage(7).sessions, 1, "still counted: it may be live");
    // The next start reads what is on disk: here the exchange back was made, only its
    // fsync failed, so the session is live at v1 and serves again.
    drop(store);
    let reopened = SessionStore::open(dir.path()).unwrap();
    let snap = reopened.snapshot("s1").unwrap();
    assert_eq!((snap.version, &snap.state), (1, &n_state(1)));
    let g = reopened.lock("s1").await.unwrap();
    assert_eq!(reopened.commit(&g, n_state(2), "j2").unwrap().version, 2);
}

#[test]
fn a_failed_dir_fsync_fails_every_rename_it_was_to_cover() {
    let dir = tempfile::tempdir().unwrap();
    let sync = Arc::new(DirSync::default());
    // The first run pauses until two more renames wait behind it, then the run that covers
    // them both fails: neither may run an fsync of its own and take it as durable (the
    // failed writeback left the dir's block clean).
    let (entered_tx, entered_rx) = std::sync::mpsc::channel();
    let watched = Arc::clone(&sync);
    lock(&sync.state).pause = Some(Box::new(move || {
        entered_tx.send(()).unwrap();
        while lock(&watched.state).renamed < 3 {
            std::thread::yield_now();
        }
        lock(&watched.state).fail_next = 1;
    }));
    let path = dir.path().to_path_buf();
    let rename = |sync: &Arc<DirSync>| {
        let (sync, path) = (Arc::clone(sync), path.clone());
        std::thread::spawn(move || sync.after_rename(&path))
    };
    let first = rename(&sync);
    entered_rx.recv().unwrap();
    let (second, third) = (rename(&sync), rename(&sync));
    first.join().unwrap().unwrap();
    for r in [second.join().unwrap(), third.join().unwrap()] {
        let e = r.unwrap_err();
        assert_eq!(e.raw_os_error(), Some(libc::EIO), "{e:?}");
    }
    let s = lock(&sync.state);
    assert_eq!((s.renamed, s.covered), (3, 3));
    assert!(s.failed.is_empty(), "forgotten once no ticket in it waits");
    drop(s);
    // A rename after the failure is covered by a run of its own.
    sync.after_rename(dir.path()).unwrap();
    assert_eq!(lock(&sync.state).covered, 4);
}

#[test]
fn a_rename_whose_covering_fsync_failed_is_not_vouched_for_by_a_later_one() {
    let dir = tempfile::tempdir().unwrap();
    let sync = Arc::new(DirSync::default());
    let path = dir.path().to_path_buf();
    let rename = |sync: &Arc<DirSync>| {
        let (sync, path) = (Arc::clone(sync), path.clone());
        std::thread::spawn(move || sync.after_rename(&path))
    };
    // Run 1 (ticket 1) waits until ticket 2 has renamed and waits behind it; it succeeds.
    // Ticket 2, woken, is slow to run (the scheduler): meanwhile run 2 covers tickets 2 and
    // 3 and fails, then run 3 covers ticket 4 and succeeds. Ticket 2's fate is run 2's.
    let watched = Arc::clone(&sync);
    let (slow_tx, slow_rx) = std::sync::mpsc::channel();
    let (go_tx, go_rx) = std::sync::mpsc::channel::<()>();
    {
        let mut s = lock(&sync.state);
        s.pause = Some(Box::new(move || {
            while lock(&watched.state).renamed < 2 {
                std::thread::yield_now();
            }
        }));
        s.slow_waiter = Some((
            2,
            Box::new(move || {
                slow_tx.send(()).unwrap();
                go_rx.recv().unwrap();
            }),
        ));
    }
    let first = rename(&sync);
    while lock(&sync.state).renamed < 1 {
        std::thread::yield_now();
    }
    let second = rename(&sync);
    slow_rx.recv().unwrap();
    first.join().unwrap().unwrap();
    lock(&sync.state).fail_next = 1;
    let third = rename(&sync).join().unwrap();
    assert_eq!(third.unwrap_err().raw_os_error(), Some(libc::EIO));
    rename(&sync).join().unwrap().unwrap();
    assert_eq!(lock(&sync.state).covered, 4);
    go_tx.send(()).unwrap();
    let e = second.join().unwrap().unwrap_err();
    assert_eq!(e.raw_os_error(), Some(libc::EIO), "{e:?}");
    assert!(lock(&sync.state).failed.is_empty());
}

#[tokio::test]
async fn a_reader_sees_no_version_before_its_commit_point_nor_one_that_is_undone() {
    let dir = tempfile::tempdir().unwrap();
    let store = Arc::new(SessionStore::open(dir.path()).unwrap());
    store.create("s1", Map::new(), 0).unwrap();
    let g = store.lock("s1").await.unwrap();
    store.commit(&g, n_state(1), "j1").unwrap();
    // Two commits stopped inside the fsync of the dir, the new file already exchanged in:
    // one that then succeeds, one whose fsync fails and is undone. A reader in either window
    // sees the version committed before, and after it what committed.
    for (fails, job) in [(false, "j2"), (true, "j3")] {
        let before = store.snapshot("s1").unwrap();
        let before_latest = store.latest_commit("s1").unwrap();
        let (entered_tx, entered_rx) = std::sync::mpsc::channel();
        let (go_tx, go_rx) = std::sync::mpsc::channel::<()>();
        {
            let mut s = lock(&store.dir_sync.state);
            s.pause = Some(Box::new(move || {
                entered_tx.send(()).unwrap();
                go_rx.recv().unwrap();
            }));
            s.fail_next = u32::from(fails);
        }
        let next = n_state(before.version + 10);
        std::thread::scope(|scope| {
            let committer = scope.spawn(|| store.commit(&g, next.clone(), job));
            entered_rx.recv().unwrap();
            let name = std::fs::read(dir.path().join("sessions/s1.json")).unwrap();
            assert!(
                String::from_utf8_lossy(&name).contains(&format!("\"{job}\"")),
                "the exchange is made"
            );
            let (seen, latest) = (store.snapshot("s1"), store.latest_commit("s1"));
            go_tx.send(()).unwrap();
            let r = committer.join().unwrap();
            let seen = seen.unwrap();
            assert_eq!(
                latest.unwrap(),
                before_latest,
                "the latest commit, as `job_get` asks"
            );
            assert_eq!((seen.version, &seen.state), (before.version, &before.state));
            assert_eq!(r.is_err(), fails, "{r:?}");
        });
        let seen = store.snapshot("s1").unwrap();
        if fails {
            assert_eq!((seen.version, &seen.state), (before.version, &before.state));
        } else {
            assert_eq!((seen.version, &seen.state), (before.version + 1, &next));
        }
    }
}

#[tokio::test(flavor = "multi_thread")]
async fn a_reader_sees_no_tombstone_before_the_destroy_is_durable_nor_one_that_is_undone() {
    let dir = tempfile::tempdir().unwrap();
    let store = Arc::new(SessionStore::open(dir.path()).unwrap());
    store.create("s1", Map::new(), 0).unwrap();
    let g = store.lock("s1").await.unwrap();
    store.commit(&g, n_state(1), "j1").unwrap();
    drop(g);
    // Two destroys stopped inside the fsync of the dir, the tombstone already exchanged in:
    // one whose fsync fails and is undone, then one that succeeds. A reader in either
    // window sees the state committed before; after it, what the destroy decided.
    for fails in [true, false] {
        let g = store.lock("s1").await.unwrap();
        let (entered_tx, entered_rx) = std::sync::mpsc::channel();
        let (go_tx, go_rx) = std::sync::mpsc::channel::<()>();
        {
            let mut s = lock(&store.dir_sync.state);
            s.pause = Some(Box::new(move || {
                entered_tx.send(()).unwrap();
                go_rx.recv().unwrap();
            }));
            s.fail_next = u32::from(fails);
        }
        std::thread::scope(|scope| {
            let destroyer = scope.spawn(|| store.destroy(g));
            entered_rx.recv().unwrap();
            let name = std::fs::read(dir.path().join("sessions/s1.json")).unwrap();
            assert!(
                String::from_utf8_lossy(&name).contains("\"destroyed\":true"),
                "the tombstone is exchanged in"
            );
            let (seen, latest) = (store.snapshot("s1"), store.latest_commit("s1"));
            go_tx.send(()).unwrap();
            let r = destroyer.join().unwrap();
            let seen = seen.unwrap();
            assert_eq!((seen.version, &seen.state), (1, &n_state(1)));
            assert_eq!(latest.unwrap(), (1, Some("j1".to_string())));
            assert_eq!(r.is_err(), fails, "{r:?}");
        });
        if fails {
            let seen = store.snapshot("s1").unwrap();
            assert_eq!((seen.version, &seen.state), (1, &n_state(1)));
        } else {
            assert!(matches!(
                store.snapshot("s1"),
                Err(SessionError::Destroyed(_))
            ));
        }
    }
    assert_eq!(
        names_in(&dir.path().join("sessions")),
        vec!["s1.json".to_string()]
    );
}

#[test]
fn a_create_waiting_on_its_fsync_holds_up_no_other_session() {
    let dir = tempfile::tempdir().unwrap();
    let store = Arc::new(SessionStore::open(dir.path()).unwrap());
    store.create("s2", n_state(2), 7).unwrap();
    // The create of s1 stops inside the fsync of the dir (a slow disk), its file renamed.
    let (entered_tx, entered_rx) = std::sync::mpsc::channel();
    let (go_tx, go_rx) = std::sync::mpsc::channel::<()>();
    lock(&store.dir_sync.state).pause = Some(Box::new(move || {
        entered_tx.send(()).unwrap();
        go_rx.recv().unwrap();
    }));
    let creator = {
        let store = Arc::clone(&store);
        std::thread::spawn(move || store.create("s1", n_state(1), 7))
    };
    entered_rx.recv().unwrap();
    // Meanwhile, on another thread: s2 is read, listed and its usage counted; s1 is not
    // live yet, and a second create of it is refused (not queued behind the first).
    let (seen_tx, seen_rx) = std::sync::mpsc::channel();
    let reader = {
        let store = Arc::clone(&store);
        std::thread::spawn(move || {
            let snap = store.snapshot("s2").map(|s| (s.version, s.state));
            let listed: Vec<String> = store.list().into_iter().map(|m| m.id).collect();
            let again = store.create("s1", n_state(9), 7);
            seen_tx
                .send((snap, listed, store.is_live("s1"), again, store.usage(7)))
                .unwrap();
        })
    };
    let seen = seen_rx.recv_timeout(std::time::Duration::from_secs(20));
    go_tx.send(()).unwrap();
    let (snap, listed, live, again, usage) =
        seen.expect("a read of another session waited for a create's fsync");
    reader.join().unwrap();
    assert_eq!(snap.unwrap(), (0, n_state(2)));
    assert_eq!(listed, ["s2"]);
    assert!(!live);
    assert!(matches!(again, Err(SessionError::Exists(_))), "{again:?}");
    assert_eq!(
        usage.sessions, 2,
        "the create's room is taken before its write"
    );
    creator.join().unwrap().unwrap();
    let snap = store.snapshot("s1").unwrap();
    assert_eq!((snap.version, snap.state), (0, n_state(1)));
    assert_eq!(store.usage(7).sessions, 2);
}
