//! Resolution of client paths beneath the workspace, and their bounds.

use super::*;

// resolve

#[test]
fn resolve_rejects_escapes_and_accepts_nested_new_paths() {
    let tmp = tempfile::tempdir().unwrap();
    let outside = tempfile::tempdir().unwrap();
    write(tmp.path(), "docs/a.md", "a");
    write(outside.path(), "secret.txt", "s");
    std::os::unix::fs::symlink(outside.path(), tmp.path().join("out")).unwrap();
    std::os::unix::fs::symlink("docs", tmp.path().join("inlink")).unwrap();
    fs::create_dir(tmp.path().join(".airlock-job-x")).unwrap();
    let ws = open(&tmp);
    let rejected = |raw: &str, role| match ws.resolve(raw, role) {
        Err(PathError::Rejected { reason, .. }) => reason.to_string(),
        Ok(p) => panic!("{raw:?} accepted as {p:?}"),
    };

    assert!(rejected("../x", PathRole::Output).contains(".."));
    assert!(rejected("docs/../../x", PathRole::Output).contains(".."));
    assert!(rejected("/etc/passwd", PathRole::Input).contains("outside"));
    let outside_abs = outside.path().join("secret.txt");
    assert!(rejected(outside_abs.to_str().unwrap(), PathRole::Input).contains("outside"));
    let r = rejected("out/secret.txt", PathRole::Input);
    assert!(r.contains("symlink"), "{r}");
    assert!(rejected("out/new.txt", PathRole::Output).contains("symlink"));
    assert!(rejected("out", PathRole::Output).contains("symlink"));
    // Even a symlink that stays inside is refused: nothing is ever followed.
    assert!(rejected("inlink/a.md", PathRole::Input).contains("symlink"));
    assert!(rejected(".airlock-job-x/stage/0/f", PathRole::Output).contains("job directory"));
    assert!(rejected(".airlock-job-y", PathRole::Output).contains("job directory"));
    assert!(rejected("./.airlock-job-x", PathRole::Input).contains("job directory"));
    assert!(rejected("", PathRole::Input).contains("empty"));
    assert!(rejected("a\0b", PathRole::Input).contains("NUL"));
    assert!(rejected(".", PathRole::Output).contains("root"));
    assert!(rejected("docs", PathRole::Output).contains("directory"));
    assert!(rejected("docs/a.md/x", PathRole::Output).contains("not a directory"));
    assert!(rejected("missing.md", PathRole::Input).contains("does not exist"));

    assert_eq!(
        ws.resolve("docs/a.md", PathRole::Input).unwrap(),
        PathBuf::from("docs/a.md")
    );
    assert_eq!(
        ws.resolve("docs", PathRole::Input).unwrap(),
        PathBuf::from("docs")
    );
    assert_eq!(
        ws.resolve("./docs/./x/../a.md", PathRole::Input).unwrap(),
        PathBuf::from("docs/a.md")
    );
    assert_eq!(
        ws.resolve("new/deeper/out.html", PathRole::Output).unwrap(),
        PathBuf::from("new/deeper/out.html")
    );
    assert_eq!(
        ws.resolve("docs/a.md", PathRole::Output).unwrap(),
        PathBuf::from("docs/a.md")
    );
    let inside_abs = tmp.path().join("docs/new.html");
    assert_eq!(
        ws.resolve(inside_abs.to_str().unwrap(), PathRole::Output)
            .unwrap(),
        PathBuf::from("docs/new.html")
    );
}

#[test]
fn resolve_rejects_fifo_input_and_output() {
    let tmp = tempfile::tempdir().unwrap();
    nix::unistd::mkfifo(
        &tmp.path().join("p"),
        nix::sys::stat::Mode::from_bits_truncate(0o600),
    )
    .unwrap();
    let ws = open(&tmp);
    assert!(ws.resolve("p", PathRole::Input).is_err());
    assert!(ws.resolve("p", PathRole::Output).is_err());
}

// ---------------------------------------------------------------------------------------
// bounds on client paths

#[test]
fn overlong_paths_are_rejected_before_anything_is_created() {
    let tmp = tempfile::tempdir().unwrap();
    let ws = open(&tmp);
    let root_len = ws.root().as_os_str().len();
    // An overlong path: 25 components of 200 bytes.
    let overlong = vec!["c".repeat(200); 25].join("/");
    for role in [PathRole::Input, PathRole::Output] {
        let e = ws.resolve(&overlong, role).unwrap_err().to_string();
        assert!(e.contains("at most 4095 bytes"), "{e}");
    }
    // One component over NAME_MAX.
    let e = ws
        .resolve(&format!("a/{}/b", "x".repeat(256)), PathRole::Output)
        .unwrap_err()
        .to_string();
    assert!(e.contains("256 bytes") && e.contains("255"), "{e}");
    assert!(ws.resolve(&"x".repeat(255), PathRole::Output).is_ok());
    // Every component fits and so does the raw path, but not the path beneath the root.
    let rel_len = 4095 - root_len;
    let mut long = String::new();
    while long.len() + 251 < rel_len {
        long.push_str(&"y".repeat(250));
        long.push('/');
    }
    long.push_str(&"y".repeat(rel_len - long.len()));
    assert!(long.len() < 4096);
    let e = ws.resolve(&long, PathRole::Output).unwrap_err().to_string();
    assert!(e.contains("beneath the workspace root"), "{e}");
    // A workspace root so long that an output's staged copy would not fit, though the
    // target itself would.
    let mut deep_root = tmp.path().to_path_buf();
    while deep_root.as_os_str().len() < 4096 - super::STAGED_OVERHEAD - 100 {
        deep_root.push("r".repeat(200));
    }
    fs::create_dir_all(&deep_root).unwrap();
    let deep = Workspace::open(&deep_root).unwrap();
    let name = "w".repeat(200);
    assert!(deep.resolve(&name, PathRole::Output).is_err());
    let e = deep
        .resolve(&name, PathRole::Output)
        .unwrap_err()
        .to_string();
    assert!(e.contains("staged copy"), "{e}");
    assert!(deep.resolve("w", PathRole::Output).is_ok());
    fs::remove_dir_all(tmp.path().join("r".repeat(200))).unwrap();
    assert!(snapshot(tmp.path()).is_empty(), "nothing was created");
    // A spec built elsewhere is held to the same bounds.
    let r = Job::create(&ws, spec("long", &[overlong.as_str()]));
    assert!(matches!(r, Err(PublishError::InvalidSpec { .. })), "{r:?}");
    assert!(snapshot(tmp.path()).is_empty());
}

mod path_props {
    use super::*;
    use proptest::prelude::*;

    fn token() -> impl Strategy<Value = String> {
        prop_oneof![
            Just("..".to_string()),
            Just(".".to_string()),
            Just("".to_string()),
            Just("a".to_string()),
            Just("dir".to_string()),
            Just("out".to_string()),
            Just("link".to_string()),
            Just(".airlock-job-x".to_string()),
            Just(".airlock-quarantine-y".to_string()),
            Just(".airlock-jobx".to_string()),
            Just("\0".to_string()),
            "[a-z.]{1,8}",
            "\\PC{1,6}",
            (250usize..260).prop_map(|n| "n".repeat(n)),
        ]
    }

    fn raw_path() -> impl Strategy<Value = String> {
        (
            any::<bool>(),
            proptest::collection::vec(token(), 0..40),
            any::<bool>(),
        )
            .prop_map(|(abs, parts, trailing)| {
                let mut s = parts.join("/");
                if abs {
                    s.insert(0, '/');
                }
                if trailing {
                    s.push('/');
                }
                s
            })
    }

    /// What every accepted path must satisfy.
    fn check_accepted(ws: &Workspace, raw: &str, rel: &Path) {
        assert!(rel.is_relative(), "{raw:?} -> {rel:?}");
        let mut total = ws.root().as_os_str().len() + 1;
        for (k, c) in rel.components().enumerate() {
            let std::path::Component::Normal(n) = c else {
                assert!(rel == Path::new("."), "{raw:?} -> {rel:?}: {c:?}");
                continue;
            };
            assert!(n.len() <= NAME_MAX, "{raw:?}");
            if k == 0 {
                for p in RESERVED_PREFIXES {
                    assert!(
                        !n.as_encoded_bytes().starts_with(p.as_bytes()),
                        "{raw:?} reaches a reserved name"
                    );
                }
            }
            total += n.len() + 1;
        }
        assert!(total <= PATH_MAX, "{raw:?} is too long");
        // Whatever of it exists resolves (symlinks followed) inside the workspace.
        let mut p = ws.root().to_path_buf();
        for c in rel.components() {
            p.push(c);
            match fs::canonicalize(&p) {
                Ok(real) => assert!(real.starts_with(ws.root()), "{raw:?} -> {real:?}"),
                Err(_) => break,
            }
        }
    }

    proptest! {
        #![proptest_config(ProptestConfig::with_cases(500))]

        #[test]
        fn resolve_never_accepts_an_escape_a_reserved_name_or_an_overlong_path(
            raw in raw_path(),
            output in any::<bool>(),
        ) {
            let (tmp, outside) = fixture();
            let ws = open(&tmp);
            let role = if output { PathRole::Output } else { PathRole::Input };
            // Relative and absolute under the root both.
            for raw in [raw.clone(), format!("{}/{raw}", ws.root().display())] {
                if let Ok(rel) = ws.resolve(&raw, role) {
                    check_accepted(&ws, &raw, &rel);
                }
            }
            drop(outside);
        }

        #[test]
        fn resolve_survives_arbitrary_strings(raw in any::<String>(), output in any::<bool>()) {
            let (tmp, _outside) = fixture();
            let ws = open(&tmp);
            let role = if output { PathRole::Output } else { PathRole::Input };
            if let Ok(rel) = ws.resolve(&raw, role) {
                check_accepted(&ws, &raw, &rel);
            }
        }
    }

    /// A workspace with a directory, a file, a symlink leading out and a job dir.
    fn fixture() -> (tempfile::TempDir, tempfile::TempDir) {
        let tmp = tempfile::tempdir().unwrap();
        let outside = tempfile::tempdir().unwrap();
        write(tmp.path(), "dir/a", "x");
        write(tmp.path(), "a", "x");
        write(tmp.path(), ".airlock-job-x/stage/0/out", "x");
        write(tmp.path(), ".airlock-quarantine-y/f", "x");
        write(outside.path(), "secret", "x");
        std::os::unix::fs::symlink(outside.path(), tmp.path().join("link")).unwrap();
        std::os::unix::fs::symlink(outside.path(), tmp.path().join("dir/link")).unwrap();
        (tmp, outside)
    }
}

/// The commit fails after both renames and, meanwhile, the parent of one target was swapped
/// for a symlink: the in-process rollback cannot reach it, so the job dir (the only old copy)
/// is kept for recovery, which keeps it aside as it is, the other target untouched too.
#[test]
fn an_unreachable_target_keeps_its_backup_in_process_and_in_recovery() {
    let tmp = tempfile::tempdir().unwrap();
    write(tmp.path(), "x/a.txt", "old a");
    write(tmp.path(), "b.txt", "old b");
    let ws = open(&tmp);
    let job = Job::create(&ws, spec("swap", &["x/a.txt", "b.txt"])).unwrap();
    stage(&job, 0, "new a");
    stage(&job, 1, "new b");
    let root = tmp.path().to_path_buf();
    let e = job
        .publish_and_commit(|| {
            fs::rename(root.join("x"), root.join("x.real")).unwrap();
            std::os::unix::fs::symlink("x.real", root.join("x")).unwrap();
            Err("session store unavailable".into())
        })
        .unwrap_err();
    assert!(matches!(e, PublishError::RollbackFailed { .. }), "{e}");
    assert!(e.to_string().contains("cannot reach it safely"), "{e}");
    let dir = tmp.path().join(".airlock-job-swap");
    assert_eq!(
        fs::read_to_string(dir.join("stage/0/a.txt")).unwrap(),
        "old a"
    );
    assert_eq!(
        fs::read_to_string(root.join("x.real/a.txt")).unwrap(),
        "new a"
    );
    // b.txt was reachable: the in-process rollback restored it.
    assert_eq!(fs::read_to_string(root.join("b.txt")).unwrap(), "old b");
    let before = snapshot(&dir);
    let rec = recover(tmp.path(), &|_, _| Ok(false)).unwrap();
    assert_eq!(rec.len(), 1);
    assert_eq!(rec[0].settled, Settled::Kept, "{rec:?}");
    assert!(
        matches!(rec[0].kept.as_deref(), Some(Kept::Unreachable { targets, restored: 0 }) if targets.len() == 1),
        "{rec:?}"
    );
    let q = tmp.path().join(".airlock-quarantine-swap");
    assert_eq!(snapshot(&q), before);
    assert_eq!(
        fs::read_to_string(root.join("x.real/a.txt")).unwrap(),
        "new a"
    );
    assert_eq!(fs::read_to_string(root.join("b.txt")).unwrap(), "old b");
}
