use std::time::Duration;

use super::daemon::parse_uid_range;
use super::tool::parse_output_mode;
use super::*;
use crate::policy::placeholders;

#[test]
fn sizes_and_durations() {
    assert_eq!(parse_size("4MiB").unwrap(), 4 << 20);
    assert_eq!(parse_size("512k").unwrap(), 512 << 10);
    assert!(parse_size("4 parsecs").is_err());
    assert_eq!(parse_duration("500ms").unwrap(), Duration::from_millis(500));
    assert_eq!(parse_duration("2m").unwrap(), Duration::from_secs(120));
    assert!(parse_duration("soon").is_err());
}

#[test]
fn output_modes() {
    let out = Some(PathRole::Output);
    assert_eq!(parse_output_mode("0755", out).unwrap(), 0o755);
    assert_eq!(parse_output_mode("0o600", out).unwrap(), 0o600);
    for bad in [
        "4755", "2755", "1755", "0775", "0646", "0777", "0200", "9", "x", "17777",
    ] {
        assert!(parse_output_mode(bad, out).is_err(), "{bad} accepted");
    }
    assert!(parse_output_mode("0644", Some(PathRole::Input)).is_err());
    assert!(parse_output_mode("0644", None).is_err());
}

#[test]
fn uid_ranges() {
    assert_eq!(parse_uid_range("60600-61099").unwrap(), (60600, 61099));
    for bad in ["0-10", "10-5", "65000-66000", "a-b", "5", "1-4294967295"] {
        assert!(parse_uid_range(bad).is_err(), "{bad} accepted");
    }
}

#[test]
fn worker_uid_lock_dirs_are_absolute_paths() {
    let daemon = |extra: &str| with_extra("airlock.toml", &format!("[daemon]\n{extra}"));
    let p = daemon("").expect("valid");
    assert_eq!(
        p.daemon.worker_uid_lock_dir,
        PathBuf::from("/run/airlock/uids")
    );
    let p = daemon("worker_uid_lock_dir = \"/run/x/uids\"\n").expect("valid");
    assert_eq!(p.daemon.worker_uid_lock_dir, PathBuf::from("/run/x/uids"));
    let e = daemon("worker_uid_lock_dir = \"run/uids\"\n").expect_err("relative");
    assert!(
        e.to_string()
            .contains("worker_uid_lock_dir \"run/uids\" must be an absolute path"),
        "{e}"
    );
}

#[test]
fn placeholder_scan() {
    assert_eq!(placeholders("--out={out}.{ext}"), vec!["out", "ext"]);
    assert!(placeholders("{ not one }").is_empty());
}

/// The shipped policies with `profiles/extra.toml` added.
fn with_profile(extra: &str) -> Result<Policy, PolicyErrors> {
    with_extra("profiles/extra.toml", extra)
}

/// The shipped policies with `tools/extra.toml` added.
fn with_tool(extra: &str) -> Result<Policy, PolicyErrors> {
    with_extra("tools/extra.toml", extra)
}

/// A copy of the shipped policies with one more file, `rel`, loaded.
fn with_extra(rel: &str, extra: &str) -> Result<Policy, PolicyErrors> {
    let dir = tempfile::tempdir().expect("tempdir");
    let shipped = Path::new(env!("CARGO_MANIFEST_DIR")).join("policies");
    for sub in ["", "profiles", "tools", "python", "python/airlock_examples"] {
        std::fs::create_dir_all(dir.path().join(sub)).expect("mkdir");
        for e in std::fs::read_dir(shipped.join(sub))
            .expect("read_dir")
            .flatten()
        {
            if e.path().is_file() {
                std::fs::copy(e.path(), dir.path().join(sub).join(e.file_name())).expect("copy");
            }
        }
    }
    std::fs::write(dir.path().join(rel), extra).expect("write");
    load(dir.path())
}

#[test]
fn titles_are_one_short_line() {
    let tool = |title: &str| {
        format!(
            "name = \"extra\"\ntitle = {title}\ncapability = \"read\"\ncommand = [\"/bin/true\"]\n"
        )
    };
    let p = with_tool(&tool("\"Extra tool\"")).expect("valid");
    assert_eq!(p.tools["extra"].title.as_deref(), Some("Extra tool"));
    assert_eq!(p.tools["session_get"].title.as_deref(), Some("Get session"));
    for bad in [
        "\"\"",
        "\"two\\nlines\"",
        &format!("\"{}\"", "x".repeat(101)),
    ] {
        let e = with_tool(&tool(bad)).expect_err(bad).to_string();
        assert!(
            e.contains("extra.toml:2:") && e.contains("title must be"),
            "{bad}: {e}"
        );
    }
}

#[test]
fn profiles_need_landlock_abi_6_for_the_scopes() {
    let e = with_profile("[landlock]\nabi = 5\n").expect_err("abi 5 accepted");
    let text = e.to_string();
    assert!(text.contains("extra.toml:2:"), "{text}");
    assert!(text.contains("workers need ABI 6 at least"), "{text}");
    assert!(with_profile("[landlock]\nabi = 7\n").is_ok());
}

#[test]
fn unix_sockets_are_absolute_paths() {
    let p = with_profile("[network]\nunix_sockets = [\"/run/a.sock\"]\n").expect("valid");
    assert_eq!(
        p.profiles["extra"].unix_sockets,
        vec![PathBuf::from("/run/a.sock")]
    );
    assert!(!p.profiles["extra"].network);
    assert!(p.profiles["default"].unix_sockets.is_empty());
    let e = with_profile("[network]\nunix_sockets = [\"run/a.sock\"]\n").expect_err("relative");
    assert!(e.to_string().contains("is not an absolute path"), "{e}");
}

#[test]
fn seccomp_names_are_resolved_to_numbers_at_load() {
    let p = with_profile(
        "[seccomp]\nmode = \"deny\"\nsyscalls = [\"ptrace\", \"mount\"]\nerrno = \"EACCES\"\n",
    )
    .expect("valid");
    let sc = &p.profiles["extra"].seccomp;
    let got: Vec<(&str, i64)> = sc.syscalls.iter().map(|c| (c.name(), c.nr())).collect();
    assert_eq!(
        got,
        vec![("ptrace", libc::SYS_ptrace), ("mount", libc::SYS_mount)]
    );
    assert_eq!(
        (sc.errno.name(), sc.errno.number()),
        ("EACCES", libc::EACCES)
    );
    // No errno given: EPERM.
    let p = with_profile("[seccomp]\nmode = \"deny\"\nsyscalls = []\n").expect("valid");
    assert_eq!(p.profiles["extra"].seccomp.errno, Errno::EPERM);
}

#[test]
fn bad_seccomp_names_are_refused_at_load_with_file_and_line() {
    let e = with_profile(
        "[seccomp]\nmode = \"deny\"\nsyscalls = [\"ptrace\"]\nerrno = \"EWHATEVER\"\n",
    )
    .expect_err("a bad errno accepted")
    .to_string();
    assert!(e.contains("extra.toml:4:"), "{e}");
    assert!(
        e.contains("errno \"EWHATEVER\" is not one of EPERM, EACCES, ENOSYS, EINVAL"),
        "{e}"
    );
    let e = with_profile("[seccomp]\nmode = \"deny\"\nsyscalls = [\"ptrace\", \"nonsense\"]\n")
        .expect_err("an unknown syscall accepted")
        .to_string();
    assert!(e.contains("extra.toml:3:"), "{e}");
    assert!(e.contains("unknown syscall \"nonsense\""), "{e}");
}

#[test]
fn per_principal_bounds_load_with_defaults_and_are_checked_with_file_and_line() {
    let daemon = |lines: &str| with_extra("airlock.toml", &format!("[daemon]\n{lines}"));
    let d = daemon("").expect("valid").daemon;
    assert_eq!(
        (
            d.max_sessions_per_principal,
            d.max_session_state_bytes,
            d.max_state_bytes_per_principal
        ),
        (64, 1 << 20, 16 << 20)
    );
    assert_eq!(
        (d.max_calls_per_principal, d.max_queued_per_principal),
        (16, 256)
    );
    // The share follows max_concurrent_calls when not set.
    let d = daemon("max_concurrent_calls = 6\n").expect("valid").daemon;
    assert_eq!(d.max_calls_per_principal, 1);
    let d = daemon(
        "max_concurrent_calls = 8\nmax_calls_per_principal = 3\nmax_queued_per_principal = 0\n\
         max_sessions_per_principal = 5\nmax_session_state_bytes = \"64KiB\"\n\
         max_state_bytes_per_principal = \"1MiB\"\n",
    )
    .expect("valid")
    .daemon;
    assert_eq!(
        (d.max_calls_per_principal, d.max_queued_per_principal),
        (3, 0)
    );
    assert_eq!(
        (
            d.max_sessions_per_principal,
            d.max_session_state_bytes,
            d.max_state_bytes_per_principal
        ),
        (5, 64 << 10, 1 << 20)
    );
    for (lines, at, says) in [
        ("max_sessions_per_principal = 0\n", 2, "max_sessions_per_principal must be at least 1"),
        ("max_session_state_bytes = \"10\"\n", 2, "max_session_state_bytes must be at least 1KiB"),
        (
            "max_session_state_bytes = \"2MiB\"\nmax_state_bytes_per_principal = \"1MiB\"\n",
            3,
            "max_state_bytes_per_principal (1048576) must be at least max_session_state_bytes (2097152)",
        ),
        (
            "max_concurrent_calls = 4\nmax_calls_per_principal = 5\n",
            3,
            "max_calls_per_principal (5) must be between 1 and max_concurrent_calls (4)",
        ),
        ("max_calls_per_principal = 0\n", 2, "max_calls_per_principal (0) must be between 1"),
    ] {
        let e = daemon(lines).expect_err(lines).to_string();
        assert!(e.contains(&format!("airlock.toml:{at}:")) && e.contains(says), "{lines}: {e}");
    }
}

#[test]
fn line_and_column() {
    assert_eq!(line_col("a\nbc\nd", 3), (2, 2));
    assert_eq!(line_col("abc", 0), (1, 1));
}

/// A secret's placeholder in `command` is refused at its place, naming the parameter
/// and the ways in that are not the command line; `env` is the one for `argv` tools, and
/// its name is checked.
#[test]
fn secret_params_never_reach_the_command_line() {
    let tool = |command: &str, token: &str| {
        format!(
            "name = \"extra\"\ncapability = \"read\"\ncommand = {command}\n\n[params.token]\ntype = \"string\"\nsecret = true\n{token}"
        )
    };
    let e = with_tool(&tool(r#"["/bin/sh", "-c", "use {token}"]"#, ""))
        .expect_err("a secret on the command line accepted")
        .to_string();
    assert!(e.contains("extra.toml:3:29: placeholder {token}"), "{e}");
    for want in [
        "secret parameter \"token\"",
        "/proc/PID/cmdline",
        "env = \"NAME\"",
        "protocol = \"json\"",
    ] {
        assert!(e.contains(want), "{want}: {e}");
    }
    // Also for a json tool, whose request already holds it.
    let json = tool(r#"["/bin/t", "{token}"]"#, "")
        .replace("capability", "protocol = \"json\"\ncapability");
    assert!(with_tool(&json).is_err());
    let p = with_tool(&tool(r#"["/bin/t"]"#, "env = \"API_TOKEN\"\n")).expect("valid");
    assert_eq!(
        p.tools["extra"].params["token"].env.as_deref(),
        Some("API_TOKEN")
    );
    for (bad, why) in [
        ("api_token", "must be an environment variable name"),
        ("1TOKEN", "must be an environment variable name"),
        ("PATH", "is reserved"),
        ("LD_PRELOAD", "is reserved"),
        ("AIRLOCK_PROGRESS_FD", "is reserved"),
        ("TZ", "also in profile \"default\"'s [env]"),
    ] {
        let e = with_tool(&tool(r#"["/bin/t"]"#, &format!("env = \"{bad}\"\n")))
            .expect_err(bad)
            .to_string();
        assert!(
            e.contains("extra.toml:8:7: ") && e.contains(why),
            "{bad}: {e}"
        );
    }
    let two = tool(r#"["/bin/t"]"#, "env = \"T\"\n")
        + "\n[params.other]\ntype = \"string\"\nenv = \"T\"\n";
    let e = with_tool(&two).expect_err("one variable twice").to_string();
    assert!(e.contains("both set environment variable \"T\""), "{e}");
    let path = "name = \"extra\"\ncapability = \"read\"\ncommand = [\"/bin/t\"]\n\n[params.p]\ntype = \"string\"\npath = \"input\"\nenv = \"P\"\n";
    let e = with_tool(path).expect_err("a path in env").to_string();
    assert!(e.contains("env needs a string that is not a path"), "{e}");
}

#[test]
fn value_errors_read_as_the_loader_reports_them() {
    use super::units::parse_size;
    assert_eq!(
        parse_size("4 parsecs").unwrap_err().to_string(),
        "\"4 parsecs\" has an unknown unit (use B, KiB, MiB, GiB)"
    );
    assert_eq!(
        parse_size("x").unwrap_err().to_string(),
        "\"x\" is not a size such as \"4MiB\""
    );
    assert_eq!(
        parse_size("99999999999T").unwrap_err().to_string(),
        "\"99999999999T\" is too large"
    );
    assert_eq!(
        parse_duration("soon").unwrap_err().to_string(),
        "\"soon\" is not a duration such as \"20s\" or \"500ms\""
    );
    assert_eq!(
        parse_duration("5y").unwrap_err().to_string(),
        "\"5y\" has an unknown unit (use ms, s, m or h)"
    );
    assert_eq!(
        parse_uid_range("5").unwrap_err().to_string(),
        "worker_uids \"5\" must be a range such as \"60600-61099\""
    );
    assert_eq!(
        parse_uid_range("60000-70000").unwrap_err().to_string(),
        "worker_uids \"60000-70000\" must not contain 65534 (nobody) or 4294967295"
    );
    let out = Some(PathRole::Output);
    assert_eq!(
        parse_output_mode("0644", None).unwrap_err().to_string(),
        "mode is only for path = \"output\" and path = \"inout\" parameters"
    );
    assert_eq!(
        parse_output_mode("x", out).unwrap_err().to_string(),
        "mode \"x\" is not an octal mode such as \"0644\""
    );
    assert_eq!(
        parse_output_mode("4755", out).unwrap_err().to_string(),
        "mode \"4755\" is refused: a published output may not be setuid, setgid, sticky, or group- or other-writable"
    );
    assert_eq!(
        parse_output_mode("0200", out).unwrap_err().to_string(),
        "mode \"0200\" must leave the file readable by its owner"
    );
}

#[test]
fn unknown_grant_subjects_are_named_with_what_the_list_takes() {
    let e = with_extra(
        "airlock.toml",
        "[[grant]]\nusers = [\"no-such-user-here\"]\ngroups = [\"no-such-group-here\"]\ncapabilities = [\"read\"]\n",
    )
    .expect_err("unknown names")
    .to_string();
    assert!(e.contains("no user named \"no-such-user-here\" on this system (users = [...] takes account names, or \"@daemon\" for the daemon's own user; uids = [...] takes numbers)"), "{e}");
    assert!(e.contains("no group named \"no-such-group-here\" on this system (groups = [...] takes group names, or \"@daemon\" for the daemon's own group; gids = [...] takes numbers)"), "{e}");
}

#[test]
fn python_tools_name_an_entry_and_no_command() {
    let tool = |body: &str| {
        format!("name = \"extra\"\ncapability = \"read\"\nprotocol = \"python\"\n{body}")
    };
    let p = with_tool(&tool(
        "entry = \"airlock_examples.wordcount:word_count\"\npython_path = [\"python\"]\n",
    ))
    .expect("valid");
    let ToolKind::External(ext) = &p.tools["extra"].kind else {
        panic!("external")
    };
    let py = ext.python.as_ref().expect("a python entry");
    assert_eq!(py.interpreter, PathBuf::from(DEFAULT_PYTHON));
    // Relative to the policy directory, made absolute.
    assert!(
        py.path[0].is_absolute() && py.path[0].ends_with("python"),
        "{py:?}"
    );
    assert_eq!(ext.command.written()[0], DEFAULT_PYTHON);
    for (body, want) in [
        (
            "entry = \"pkg.mod\"\n",
            "extra.toml:4:9: entry \"pkg.mod\" must be",
        ),
        (
            "entry = \"pkg:a:b\"\n",
            "extra.toml:4:9: entry \"pkg:a:b\" must be",
        ),
        (
            "entry = \"pkg.9x:f\"\n",
            "extra.toml:4:9: entry \"pkg.9x:f\": \"9x\" is not",
        ),
        ("entry = \"pkg:\"\n", "is not a Python identifier"),
        (
            "entry = \"m:f\"\ncommand = [\"/bin/true\"]\n",
            "extra.toml:5:11: a python tool has no command",
        ),
        (
            "entry = \"m:f\"\npython = \"python3\"\n",
            "extra.toml:5:10: python \"python3\" must be an absolute path",
        ),
        (
            "entry = \"m:f\"\npython_path = [\"no/such/dir\"]\n",
            "extra.toml:5:16: python_path \"no/such/dir\"",
        ),
        ("", "extra.toml:3:12: protocol = \"python\" needs entry"),
    ] {
        let e = with_tool(&tool(body)).expect_err(body).to_string();
        assert!(e.contains(want), "{body}: {e}");
    }
    // The python keys on another protocol, and a command-less argv tool.
    let e = with_tool(
        "name = \"extra\"\ncapability = \"read\"\ncommand = [\"/bin/true\"]\nentry = \"m:f\"\n",
    )
    .expect_err("entry on an argv tool")
    .to_string();
    assert!(
        e.contains("extra.toml:4:9: entry is only for protocol = \"python\" tools"),
        "{e}"
    );
    let e = with_tool("name = \"extra\"\ncapability = \"read\"\n")
        .expect_err("no command")
        .to_string();
    assert!(e.contains("extra.toml:1:8: command is missing"), "{e}");
}

#[test]
fn output_kinds_load_and_anything_else_is_refused_with_file_and_line() {
    let tool = |path: &str, kind: &str| {
        format!(
            "name = \"extra\"\ncapability = \"write\"\ncommand = [\"/bin/t\", \"{{out}}\"]\n\n[params.out]\ntype = \"string\"\n{path}\n{kind}\n"
        )
    };
    let p = with_tool(&tool("path = \"output\"", "kind = \"directory\"")).expect("valid");
    assert_eq!(
        p.tools["extra"].params["out"].kind,
        crate::policy::OutputKind::Directory
    );
    let p = with_tool(&tool("path = \"output\"", "")).expect("valid");
    assert_eq!(
        p.tools["extra"].params["out"].kind,
        crate::policy::OutputKind::File
    );
    let e = with_tool(&tool("path = \"output\"", "kind = \"tree\""))
        .expect_err("an unknown kind")
        .to_string();
    assert!(
        e.contains(
            "extra.toml:8:8: parameter \"out\": kind \"tree\" is not \"file\" or \"directory\""
        ),
        "{e}"
    );
    let e = with_tool(&tool("path = \"input\"", "kind = \"directory\""))
        .expect_err("kind on an input")
        .to_string();
    assert!(
        e.contains(
            "extra.toml:8:8: parameter \"out\": kind is only for path = \"output\" and path = \"inout\" parameters"
        ),
        "{e}"
    );
    let e = with_tool(&tool("", "kind = \"directory\""))
        .expect_err("kind on a value")
        .to_string();
    assert!(e.contains("kind is only for path = \"output\""), "{e}");
}
