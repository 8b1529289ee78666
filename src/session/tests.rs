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
    assert_eq!(sync.durable, sync.renamed, "every write made durable");
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
