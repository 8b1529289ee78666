//! The argument rules, each tested directly.

use super::*;
use crate::policy::{Annotations, Capability, Param, ParamType, ToolKind};

fn tool() -> Tool {
    let mut params = std::collections::BTreeMap::new();
    params.insert(
        "out".to_string(),
        Param {
            required: true,
            path: Some(PathRole::Output),
            ..Param::of(ParamType::String)
        },
    );
    params.insert(
        "n".to_string(),
        Param {
            default: Some(3.into()),
            ..Param::of(ParamType::Integer)
        },
    );
    Tool {
        title: None,
        name: "t".into(),
        description: String::new(),
        capability: Capability::Write,
        kind: ToolKind::External(crate::policy::ExternalTool {
            command: crate::policy::Command::parse(["/bin/true"]),
            protocol: crate::policy::Protocol::Argv,
            python: None,
            timeout: std::time::Duration::from_secs(1),
            profile: std::sync::Arc::new(crate::policy::Profile {
                name: "test".into(),
                landlock: crate::policy::LandlockProfile {
                    abi: 6,
                    best_effort: false,
                    read: vec![],
                    exec: vec![],
                    write: vec![],
                },
                seccomp: crate::policy::SeccompProfile {
                    mode: crate::policy::SeccompMode::Deny,
                    syscalls: vec![],
                    errno: crate::policy::Errno::EPERM,
                },
                network: false,
                unix_sockets: vec![],
                limits: Default::default(),
                env: Default::default(),
            }),
        }),
        params,
        annotations: Annotations {
            read_only: false,
            destructive: true,
            idempotent: false,
        },
        source: None,
    }
}

fn obj(v: Value) -> Map<String, Value> {
    v.as_object().cloned().unwrap_or_default()
}

#[test]
fn validation_names_what_is_wrong() {
    let t = tool();
    let ok = validate(
        &t,
        &obj(serde_json::json!({"session": "s", "out": "a.txt"})),
    )
    .unwrap();
    assert_eq!(ok["n"], 3);
    let e = validate(&t, &obj(serde_json::json!({"session": "s", "out": 5}))).unwrap_err();
    assert_eq!(
        e.to_string(),
        "argument \"out\" must be a string, not an integer"
    );
    let e = validate(
        &t,
        &obj(serde_json::json!({"session": "s", "out": "a", "x": 1})),
    )
    .unwrap_err();
    assert!(e.to_string().starts_with("unknown argument \"x\""), "{e}");
    let e = validate(&t, &obj(serde_json::json!({"out": "a"}))).unwrap_err();
    assert!(e.to_string().contains("\"session\""), "{e}");
    let e = validate(&t, &obj(serde_json::json!({"session": "s"}))).unwrap_err();
    assert_eq!(e.to_string(), "missing required argument \"out\"");
}

#[test]
fn integers_beyond_every_integer_type_name_the_range() {
    let t = tool();
    let range = format!("must be an integer between {} and {}", i64::MIN, u64::MAX);
    for n in [
        "18446744073709551616",
        "1e30",
        "-9223372036854775809",
        "-1e300",
    ] {
        let v: Value = serde_json::from_str(n).unwrap();
        let e = validate(
            &t,
            &obj(serde_json::json!({"session": "s", "out": "a", "n": v})),
        )
        .unwrap_err();
        assert!(
            matches!(e, ArgError::IntegerOutOfRange { ref name, .. } if name == "n"),
            "{n}: {e}"
        );
        assert!(
            e.to_string()
                .starts_with(&format!("argument \"n\" {range}, not ")),
            "{e}"
        );
    }
    for n in ["18446744073709551615", "-9223372036854775808", "0"] {
        let v: Value = serde_json::from_str(n).unwrap();
        let ok = validate(
            &t,
            &obj(serde_json::json!({"session": "s", "out": "a", "n": v})),
        );
        assert!(ok.is_ok(), "{n}: {ok:?}");
    }
    let e = validate(
        &t,
        &obj(serde_json::json!({"session": "s", "out": "a", "n": 1.5})),
    )
    .unwrap_err();
    assert_eq!(
        e.to_string(),
        "argument \"n\" must be an integer, not a number"
    );
}

#[test]
fn session_ids_are_checked_wherever_named() {
    let t = tool();
    let huge = "s".repeat(3 << 20);
    for (id, needle) in [
        ("", "cannot be empty"),
        (
            huge.as_str(),
            "is 3145728 bytes; a session id is at most 64 bytes",
        ),
        ("a/../b", "holds '/' at byte 1"),
        ("caf\u{e9}", "holds '\u{e9}' at byte 3"),
    ] {
        let e = validate(&t, &obj(serde_json::json!({"session": id, "out": "a"}))).unwrap_err();
        let e = crate::report::chain(&e).to_string();
        assert!(e.starts_with("argument \"session\": "), "{e}");
        assert!(e.contains(needle), "{e:?} does not say {needle:?}");
        assert!(
            e.len() < 300,
            "the message echoes the id: {} bytes",
            e.len()
        );
    }
    let builtins = crate::policy::builtins();
    let get = &builtins["session_get"];
    let e = validate(get, &obj(serde_json::json!({"session": "x y"}))).unwrap_err();
    assert!(matches!(e, ArgError::SessionId { .. }), "{e}");
    let destroy = &builtins["session_destroy"];
    let e = validate(destroy, &obj(serde_json::json!({"session": huge}))).unwrap_err();
    assert!(matches!(e, ArgError::SessionId { .. }), "{e}");
    let create = &builtins["session_create"];
    let e = validate(create, &obj(serde_json::json!({"id": "a.b"}))).unwrap_err();
    assert!(
        matches!(e, ArgError::SessionId { ref name, .. } if name == "id"),
        "{e}"
    );
    assert!(validate(create, &obj(serde_json::json!({"id": "a-B_9"}))).is_ok());
}

#[test]
fn strings_and_paths_are_bounded_and_long_names_are_cut() {
    let mut t = tool();
    t.params
        .insert("text".to_string(), Param::of(ParamType::String));
    let at = |n: usize| "x".repeat(n);
    let ok =
        serde_json::json!({"session": "s", "out": at(MAX_PATH_ARG), "text": at(MAX_STRING_ARG)});
    assert!(validate(&t, &obj(ok)).is_ok());
    let e = validate(
        &t,
        &obj(serde_json::json!({"session": "s", "out": at(MAX_PATH_ARG + 1)})),
    )
    .unwrap_err();
    assert_eq!(
        e.to_string(),
        "argument \"out\" is 4096 bytes; a path may be at most 4095 bytes"
    );
    let e = validate(
        &t,
        &obj(serde_json::json!({"session": "s", "out": "a", "text": at(MAX_STRING_ARG + 1)})),
    )
    .unwrap_err();
    assert_eq!(
        e.to_string(),
        "argument \"text\" is 1048577 bytes; a string argument may be at most 1048576 bytes"
    );
    let mut a = obj(serde_json::json!({"session": "s", "out": "a"}));
    a.insert(at(1 << 20), 1.into());
    let e = validate(&t, &a).unwrap_err().to_string();
    assert!(e.contains("(1048576 bytes)") && e.len() < 300, "{e}");
}

#[test]
fn overlap_is_rejected() {
    let p = |n: &str, s: &str| (n.to_string(), PathBuf::from(s));
    assert!(check_overlap(&[p("a", "x/y"), p("b", "x/z")]).is_ok());
    assert!(check_overlap(&[p("a", "x/y"), p("b", "x/y")]).is_err());
    assert!(check_overlap(&[p("a", "x"), p("b", "x/y")]).is_err());
    assert!(check_overlap(&[p("a", "xy"), p("b", "x")]).is_ok());
}

#[test]
fn binding_rewrites_paths() {
    let values = obj(serde_json::json!({"src": "in/a.txt", "out": "b.txt", "n": 2}));
    let paths = vec![
        ("out".to_string(), PathRole::Output, PathBuf::from("b.txt")),
        (
            "src".to_string(),
            PathRole::Input,
            PathBuf::from("in/a.txt"),
        ),
    ];
    let b = bind(&values, &paths, Path::new("/ws"), Some("s1"), |i| {
        PathBuf::from(format!("/ws/.job/stage/{i}/b.txt"))
    });
    assert_eq!(b.subst["out"], "/ws/.job/stage/0/b.txt");
    assert_eq!(b.subst["src"], "/ws/in/a.txt");
    assert_eq!(b.subst["n"], "2");
    assert_eq!(b.subst["session"], "s1");
    assert_eq!(b.arguments["src"], "/ws/in/a.txt");
    assert_eq!(b.arguments["n"], 2);
    assert_eq!(b.readable, vec![PathBuf::from("/ws/in/a.txt")]);
}

#[test]
fn substitution_is_one_pass() {
    let mut v = BTreeMap::new();
    v.insert("text".to_string(), "{out} and {session}".to_string());
    v.insert("out".to_string(), "/s/0/o.txt".to_string());
    v.insert("session".to_string(), "s1".to_string());
    let cmd: Vec<String> = ["/bin/x", "{text}:{out}", "{out}{text}", "{{text}}", "{text"]
        .iter()
        .map(|s| s.to_string())
        .collect();
    assert_eq!(
        substitute(&cmd, &v),
        vec![
            "/bin/x",
            "{out} and {session}:/s/0/o.txt",
            "/s/0/o.txt{out} and {session}",
            // As the policy loader scans it, "{{text}}" holds no placeholder.
            "{{text}}",
            "{text",
        ]
    );
}

#[test]
fn pieces_scan_as_the_policy_loader_does() {
    for s in [
        "--out={out}.{ext}",
        "{ not one }",
        "{a{b}c}",
        "{}{x}",
        "}{y}{",
        "plain",
    ] {
        let names: Vec<&str> = pieces(s)
            .into_iter()
            .filter_map(|p| match p {
                Piece::Placeholder(n) => Some(n),
                Piece::Text(_) => None,
            })
            .collect();
        assert_eq!(names, crate::policy::placeholders(s), "{s:?}");
    }
    assert_eq!(
        pieces("a{b}c{ d }"),
        vec![
            Piece::Text("a"),
            Piece::Placeholder("b"),
            Piece::Text("c{ d }")
        ]
    );
}

#[test]
fn command_lines_are_bounded_before_exec() {
    let cmd: Vec<String> = ["/bin/sh", "-c", "x", "--text={text}", "{out}"]
        .iter()
        .map(|s| s.to_string())
        .collect();
    let mut v = BTreeMap::new();
    v.insert("out".to_string(), "/ws/o".to_string());
    v.insert("text".to_string(), "t".repeat(MAX_ARGV_ELEMENT - 1));
    // The value fits, but "--text=" around it does not.
    let e = check_command("w", &cmd, &v, 0, MAX_ARGV_TOTAL).unwrap_err();
    assert!(
        matches!(e, ArgError::ElementTooLong { index: 3, ref names, .. } if names == "\"text\""),
        "{e}"
    );
    v.insert("text".to_string(), "t".repeat(3 << 20));
    let e = check_command("w", &cmd, &v, 0, MAX_ARGV_TOTAL).unwrap_err();
    assert_eq!(
        e.to_string(),
        format!(
            "argument \"text\" is 3145728 bytes; an argument passed on the command line may be at most {} bytes",
            MAX_ARGV_ELEMENT - 1
        )
    );
    v.insert("text".to_string(), "a\0b".to_string());
    assert!(matches!(
        check_command("w", &cmd, &v, 0, MAX_ARGV_TOTAL),
        Err(ArgError::NulByte { .. })
    ));
    // A value whose placeholder the command does not use is not its concern.
    v.insert("text".to_string(), "t".into());
    v.insert("unused".to_string(), "u\0".repeat(1 << 20));
    assert_eq!(check_command("w", &cmd, &v, 0, MAX_ARGV_TOTAL), Ok(()));
    // The whole: arguments, environment and pointers.
    let argv_bytes: usize = substitute(&cmd, &v)
        .iter()
        .map(|a| a.len() + 1 + 8)
        .sum::<usize>()
        + 8;
    let env = 1000;
    let exact = argv_bytes + env + 8;
    assert_eq!(check_command("w", &cmd, &v, env, exact), Ok(()));
    let e = check_command("w", &cmd, &v, env, exact - 1).unwrap_err();
    assert!(
        matches!(e, ArgError::CommandLineTooLong { len, .. } if len == exact),
        "{e}"
    );
}

#[test]
fn the_budget_follows_the_stack_limit() {
    assert_eq!(argv_budget(Some(8 << 20)), MAX_ARGV_TOTAL);
    assert_eq!(argv_budget(None), MAX_ARGV_TOTAL);
    // 1 MiB of stack: the kernel allows 256 KiB; airlock keeps three quarters.
    assert_eq!(argv_budget(Some(1 << 20)), 192 << 10);
    // Below 512 KiB of stack the kernel still allows 128 KiB.
    assert_eq!(argv_budget(Some(4096)), 96 << 10);
}

#[test]
fn predicted_staged_paths_are_the_real_ones() {
    let dir = tempfile::tempdir().unwrap();
    let ws = crate::publish::Workspace::open(dir.path()).unwrap();
    let targets = vec![PathBuf::from("a/b.tar"), PathBuf::from("c")];
    let job = crate::publish::Job::create(
        &ws,
        crate::publish::JobSpec {
            id: "j-1".into(),
            session: "s".into(),
            tool: "t".into(),
            targets: targets.clone(),
            modes: Vec::new(),
            kinds: Vec::new(),
            stage_owner: None,
            staging_limits: None,
            hash_limit: None,
            inout: Vec::new(),
        },
    )
    .unwrap();
    for (i, t) in targets.iter().enumerate() {
        assert_eq!(
            predicted_staged_path(ws.root(), "j-1", i, t),
            job.staged_path(i)
        );
    }
    job.discard().unwrap();
}

#[test]
fn substitution() {
    let mut v = BTreeMap::new();
    v.insert("out".to_string(), "/s/0/o.txt".to_string());
    let cmd: Vec<String> = ["/bin/x", "--out={out}", "{missing}", "{out}"]
        .iter()
        .map(|s| s.to_string())
        .collect();
    assert_eq!(
        substitute(&cmd, &v),
        vec!["/bin/x", "--out=/s/0/o.txt", "/s/0/o.txt"]
    );
}
