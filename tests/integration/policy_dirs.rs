//! The `--policies` argument of every command that loads policies: a path that is not a
//! policy directory is an error naming what is missing (and nothing is created); `@daemon`
//! is resolved for the user the service runs as (`--as`, the installed unit's `User=`);
//! `audit` finds the log of the daemon the installed unit starts on that directory.

use std::path::Path;
use std::process::Command;

use serde_json::json;

use crate::harness::*;

struct Out {
    code: i32,
    stdout: String,
    stderr: String,
}

fn run(cwd: &Path, unit: Option<&Path>, args: &[&str]) -> Out {
    let mut c = Command::new(BIN);
    c.args(args).current_dir(cwd);
    match unit {
        Some(u) => c.env("AIRLOCK_UNIT_PATH", u),
        // A unit installed on the test machine must not decide the tests.
        None => c.env("AIRLOCK_UNIT_PATH", "/nonexistent/airlock.service"),
    };
    let out = c.output().expect("run airlock");
    Out {
        code: out.status.code().unwrap_or(-1),
        stdout: String::from_utf8_lossy(&out.stdout).into_owned(),
        stderr: String::from_utf8_lossy(&out.stderr).into_owned(),
    }
}

#[test]
fn every_command_refuses_a_policy_dir_that_is_missing_or_lacks_airlock_toml() {
    let t = tempfile::tempdir().expect("tempdir");
    let root = t.path();
    let missing = root.join("nonexistent/dir");
    let bare = root.join("bare");
    std::fs::create_dir_all(bare.join("tools")).expect("mkdir");
    let file = root.join("a-file");
    std::fs::write(&file, "").expect("write");
    let (ws, st, sock) = (root.join("ws"), root.join("st"), root.join("s.sock"));
    let cases: [(&Path, &str); 3] = [
        (
            &missing,
            "no policy directory there (expected airlock.toml, profiles/, tools/)",
        ),
        (
            &bare,
            "airlock.toml: missing: a policy directory needs its daemon config",
        ),
        (&file, "not a directory"),
    ];
    for (dir, says) in cases {
        let d = dir.to_str().expect("utf-8");
        let commands: Vec<(Vec<&str>, i32)> = vec![
            (vec!["policy", "check", "--policies", d], 1),
            (vec!["policy", "explain", "upper", "--policies", d], 2),
            (
                vec![
                    "serve",
                    "--policies",
                    d,
                    "--workspace",
                    ws.to_str().expect("utf-8"),
                    "--state-dir",
                    st.to_str().expect("utf-8"),
                    "--socket",
                    sock.to_str().expect("utf-8"),
                ],
                2,
            ),
            (
                vec![
                    "recover",
                    "--policies",
                    d,
                    "--workspace",
                    ws.to_str().expect("utf-8"),
                    "--state-dir",
                    st.to_str().expect("utf-8"),
                ],
                2,
            ),
            (vec!["audit", "--policies", d, "--limit", "3"], 2),
            (vec!["audit", "verify", "--policies", d], 2),
        ];
        for (args, code) in commands {
            let before = tree_names(root);
            let o = run(root, None, &args);
            assert_eq!(o.code, code, "{args:?}: {}{}", o.stdout, o.stderr);
            let want = format!("airlock: {}", dir.display());
            assert!(
                o.stderr.starts_with(&want) && o.stderr.contains(says),
                "{args:?}: stderr {:?}",
                o.stderr
            );
            assert!(!o.stdout.contains("ok:"), "{args:?}: {}", o.stdout);
            assert_eq!(tree_names(root), before, "{args:?} created something");
        }
    }
    // From a directory with no `policies/` the default is refused the same way.
    let o = run(root, None, &["policy", "check"]);
    assert_eq!(o.code, 1, "{}", o.stderr);
    assert!(
        o.stderr
            .contains("airlock: policies: no policy directory there"),
        "{}",
        o.stderr
    );
}

#[test]
fn policy_check_resolves_daemon_for_the_user_given_by_as() {
    let p = repo().join("policies");
    let p = p.to_str().expect("utf-8");
    let o = run(
        Path::new("/"),
        None,
        &["policy", "check", "--policies", p, "--as", "nobody"],
    );
    assert_eq!(o.code, 0, "{}", o.stderr);
    assert!(
        o.stdout.lines().next().is_some_and(|l| l
            == "grants resolved for user nobody (uid 65534), given by --as; --as USER to choose another"),
        "{}",
        o.stdout
    );
    assert!(
        o.stdout.contains("user @daemon (uid 65534)"),
        "{}",
        o.stdout
    );
    assert!(!o.stdout.contains("user @daemon (uid 0)"), "{}", o.stdout);
    // A uid works as well as a name.
    let o = run(
        Path::new("/"),
        None,
        &["policy", "check", "--policies", p, "--as", "65534"],
    );
    assert!(
        o.stdout.contains("user @daemon (uid 65534)"),
        "{}",
        o.stdout
    );
    let o = run(
        Path::new("/"),
        None,
        &[
            "policy",
            "explain",
            "upper",
            "--policies",
            p,
            "--as",
            "nobody",
        ],
    );
    assert_eq!(o.code, 0, "{}", o.stderr);
    assert!(
        o.stdout.contains("user @daemon (uid 65534)"),
        "{}",
        o.stdout
    );
}

#[test]
fn policy_check_refuses_an_unknown_as_user_naming_it() {
    let p = repo().join("policies");
    let p = p.to_str().expect("utf-8");
    let o = run(
        Path::new("/"),
        None,
        &[
            "policy",
            "check",
            "--policies",
            p,
            "--as",
            "no-such-user-here",
        ],
    );
    assert_eq!(o.code, 2, "{}", o.stdout);
    assert_eq!(
        o.stderr.trim(),
        "airlock: --as no-such-user-here: no such user on this system"
    );
    assert!(!o.stdout.contains("ok:"), "{}", o.stdout);
}

#[test]
fn policy_check_says_the_user_it_resolved_daemon_for_without_as() {
    let t = tempfile::tempdir().expect("tempdir");
    let p = repo().join("policies");
    let ps = p.to_str().expect("utf-8");
    // No unit: the invoking user (root here), and the line says so.
    let o = run(t.path(), None, &["policy", "check", "--policies", ps]);
    assert_eq!(o.code, 0, "{}", o.stderr);
    let uid = rustix::process::geteuid().as_raw();
    assert!(
        o.stdout
            .lines()
            .next()
            .is_some_and(|l| l.starts_with("grants resolved for user ")
                && l.contains(&format!("(uid {uid}), the user running this command"))),
        "{}",
        o.stdout
    );
    // A unit that serves this directory as User=nobody: its user, and its path in the line.
    let unit = t.path().join("airlock.service");
    std::fs::write(
        &unit,
        format!("[Service]\nExecStart={BIN} serve --policies {ps}\nUser=nobody\n"),
    )
    .expect("write unit");
    let o = run(
        t.path(),
        Some(&unit),
        &["policy", "check", "--policies", ps],
    );
    assert_eq!(o.code, 0, "{}", o.stderr);
    assert_eq!(
        o.stdout.lines().next(),
        Some(
            format!(
                "grants resolved for user nobody (uid 65534), the User= of {}; --as USER to choose another",
                unit.display()
            )
            .as_str()
        ),
        "{}",
        o.stdout
    );
    assert!(
        o.stdout.contains("user @daemon (uid 65534)"),
        "{}",
        o.stdout
    );
    // A unit naming a user the host lacks is an error naming it.
    std::fs::write(
        &unit,
        format!("[Service]\nExecStart={BIN} serve --policies {ps}\nUser=no-such-user-here\n"),
    )
    .expect("write unit");
    let o = run(
        t.path(),
        Some(&unit),
        &["policy", "check", "--policies", ps],
    );
    assert_eq!(o.code, 2, "{}", o.stdout);
    assert!(
        o.stderr.contains("User=no-such-user-here: no such user"),
        "{}",
        o.stderr
    );
}

#[tokio::test]
async fn audit_finds_the_log_of_the_daemon_the_unit_starts_from_any_cwd() {
    let mut d = Daemon::new();
    d.start();
    let c = d.client().await;
    call(&c, "session_create", json!({"id": "s"})).await;
    call(
        &c,
        "write_text",
        json!({"session": "s", "text": "x", "out": "a.txt"}),
    )
    .await;
    drop(c);
    d.stop();
    // The unit runs the daemon in d.dir with a relative --state-dir, as the packaged unit
    // does (WorkingDirectory=/var/lib/airlock, --state-dir /var/lib/airlock/state).
    let unit = d.dir.path().join("airlock.service");
    std::fs::write(
        &unit,
        format!(
            "[Service]\nWorkingDirectory={}\nExecStart={BIN} serve --policies {} --state-dir {}\n",
            d.dir.path().display(),
            d.policies.display(),
            d.state.file_name().expect("name").to_string_lossy()
        ),
    )
    .expect("write unit");
    let ps = d.policies.to_str().expect("utf-8");
    let elsewhere = tempfile::tempdir().expect("tempdir");
    let o = run(
        elsewhere.path(),
        Some(&unit),
        &["audit", "--policies", ps, "--limit", "3"],
    );
    assert_eq!(o.code, 0, "{}", o.stderr);
    assert!(o.stdout.contains("write_text"), "{}", o.stdout);
    let o = run(
        elsewhere.path(),
        Some(&unit),
        &["audit", "verify", "--policies", ps],
    );
    assert_eq!(o.code, 0, "{}{}", o.stdout, o.stderr);
    // Without the unit the same command looks beneath the cwd, and says where.
    let o = run(
        elsewhere.path(),
        None,
        &["audit", "verify", "--policies", ps],
    );
    assert_eq!(o.code, 2, "{}", o.stdout);
    assert!(
        o.stderr.contains("state/audit.jsonl: no audit log there"),
        "{}",
        o.stderr
    );
}
