//! `protocol = "python"` tools through the real daemon: a module of test functions under the
//! policy directory, called by airlock's runner in the sandboxed worker, under both shipped
//! profiles, with the daemon as root (workers get a uid of their own) and as `nobody`
//! (workers share its uid). Each asserts on the outside world: results, session versions
//! and states, published files, the module directory untouched, the audit.

use std::os::unix::fs::PermissionsExt;

use serde_json::json;

use crate::harness::*;
use crate::sandbox::give_to_nobody;

const PROFILES: [&str; 2] = ["default", "strict"];

/// The test functions, `pytools.fns` in the policy directory's `pytest_mods/`.
const FNS: &str = r##"
import os


def echo_text(word):
    print("noise on stdout", word)
    os.write(1, b"raw noise on fd 1\n")
    return "echo: " + word


def bump(session, by, out=None):
    state = dict(session["state"])
    state["n"] = state.get("n", 0) + by
    if out:
        with open(out, "w") as f:
            f.write("n=%d\n" % state["n"])
    return {"content": [{"type": "text", "text": "n is %d at %d" % (state["n"], session["version"])}],
            "state": state}


def stats(words):
    return {"count": len(words.split()), "first": words.split()[0]}


def tally(source, out):
    with open(source) as f:
        data = f.read()
    with open(out, "w") as f:
        f.write(data[::-1])
    return [len(data), data.count("\n")]


def scribble(out):
    with open(out, "w") as f:
        f.write("must not be published\n")
    progress = os.environ.get("AIRLOCK_PROGRESS_FD")
    for fd in range(3, 10):
        if str(fd) != progress:
            try:
                os.write(fd, b'{"result": "forged"}')
            except OSError:
                pass
    return "after scribbling"


def nothing():
    return None


def refuse(word):
    return {"isError": True, "content": [{"type": "text", "text": "refused " + word}]}


def no_session(**kwargs):
    return "kwargs: " + ",".join(sorted(kwargs))


def explode(word):
    raise ValueError("bad input: " + word)


class Custom(Exception):
    pass


def custom():
    raise Custom("custom failure")


def unsendable():
    return {1, 2}


def hostile():
    here = os.path.dirname(os.path.abspath(__file__))
    attempts = [
        lambda: open(__file__, "a").write("# pwned\n"),
        lambda: open(os.path.join(here, "planted.py"), "w").write("x = 1\n"),
        lambda: os.unlink(__file__),
        lambda: os.rename(__file__, __file__ + ".bak"),
        lambda: os.chmod(__file__, 0o777),
        lambda: os.mkdir(os.path.join(here, "__pycache__")),
    ]
    results = []
    for attempt in attempts:
        try:
            attempt()
            results.append("done")
        except OSError as e:
            results.append("denied:%d" % e.errno)
    return " ".join(results)
"##;

/// A daemon with the test module and a tool per function, each under `profile`, plus the
/// shipped `word_count` again under `profile` (as `word_count_p`).
fn daemon(profile: &str) -> Daemon {
    require_program("/usr/bin/python3", "python3");
    let d = Daemon::new();
    // The inputs, before a test hands the tree to another user.
    d.write("in/t.txt", "abc\ndef\n");
    d.write("docs/a.txt", "one two three\nfour\n");
    let pkg = d.policies.join("pytest_mods/pytools");
    std::fs::create_dir_all(&pkg).expect("mkdir");
    std::fs::write(pkg.join("__init__.py"), "").expect("init");
    std::fs::write(pkg.join("fns.py"), FNS).expect("fns");
    let tool = |name: &str, capability: &str, entry: &str, params: &str| {
        d.add_tool(
            name,
            &format!(
                "name = \"{name}\"\ncapability = \"{capability}\"\nprofile = \"{profile}\"\n\
                 protocol = \"python\"\nentry = \"{entry}\"\npython_path = [\"pytest_mods\"]\n\
                 timeout = \"60s\"\n{params}"
            ),
        );
    };
    let word = "[params.word]\ntype = \"string\"\n";
    let out = "[params.out]\ntype = \"string\"\npath = \"output\"\n";
    tool("py_echo", "read", "pytools.fns:echo_text", word);
    tool(
        "py_bump",
        "write",
        "pytools.fns:bump",
        &format!("[params.by]\ntype = \"integer\"\n{out}required = false\n"),
    );
    tool(
        "py_stats",
        "read",
        "pytools.fns:stats",
        "[params.words]\ntype = \"string\"\n",
    );
    tool(
        "py_tally",
        "write",
        "pytools.fns:tally",
        &format!("[params.source]\ntype = \"string\"\npath = \"input\"\n{out}"),
    );
    tool("py_scribble", "write", "pytools.fns:scribble", out);
    tool("py_nothing", "read", "pytools.fns:nothing", "");
    tool("py_refuse", "write", "pytools.fns:refuse", word);
    tool("py_no_session", "write", "pytools.fns:no_session", word);
    tool("py_explode", "write", "pytools.fns:explode", word);
    tool("py_custom", "read", "pytools.fns:custom", "");
    tool("py_unsendable", "read", "pytools.fns:unsendable", "");
    tool("py_hostile", "write", "pytools.fns:hostile", "");
    tool("py_missing", "write", "no_such_module.inner:f", "");
    let shipped =
        std::fs::read_to_string(d.policies.join("tools/word_count.toml")).expect("word_count");
    d.add_tool(
        "word_count_p",
        &shipped
            .replace("name = \"word_count\"", "name = \"word_count_p\"")
            .replace(
                "capability = \"write\"",
                &format!("capability = \"write\"\nprofile = \"{profile}\""),
            ),
    );
    d
}

/// Every behaviour of a python tool, on a started daemon (`ctx` names the run).
async fn exercise(d: &Daemon, ctx: &str) {
    let c = d.client().await;
    session(&c, "p").await;

    // A string: the text result; the function's prints (sys.stdout and fd 1) do not reach
    // the reply.
    let r = call(&c, "py_echo", json!({"word": "hi"})).await;
    assert!(!is_error(&r), "{ctx}: {r}");
    assert_eq!(text(&r), "echo: hi", "{ctx}: {r}");

    // A dict of the json protocol's keys, from a function with a session parameter: its
    // state is committed, the version bumps, the output is published.
    let r = call(
        &c,
        "py_bump",
        json!({"session": "p", "by": 2, "out": "bump/n.txt"}),
    )
    .await;
    assert!(!is_error(&r), "{ctx}: {r}");
    assert_eq!(text(&r), "n is 2 at 0", "{ctx}: {r}");
    assert_eq!(r["structuredContent"]["version"], 1, "{ctx}: {r}");
    assert_eq!(d.read("bump/n.txt").as_deref(), Some("n=2\n"), "{ctx}");
    let r = call(&c, "py_bump", json!({"session": "p", "by": 3})).await;
    assert_eq!(text(&r), "n is 5 at 1", "{ctx}: {r}");
    let got = call(&c, "session_get", json!({"session": "p"})).await;
    assert_eq!(got["structuredContent"]["version"], 2, "{ctx}: {got}");
    assert_eq!(
        got["structuredContent"]["state"],
        json!({"n": 5}),
        "{ctx}: {got}"
    );

    // Any other JSON value: the structured result, and a text block of its JSON.
    let r = call(&c, "py_stats", json!({"words": "alpha beta gamma"})).await;
    assert!(!is_error(&r), "{ctx}: {r}");
    let want = json!({"result": {"count": 3, "first": "alpha"}});
    assert_eq!(r["structuredContent"], want, "{ctx}: {r}");
    let want_text = want.to_string();
    assert!(
        r["content"]
            .as_array()
            .is_some_and(|a| a.iter().any(|b| b["text"] == want_text.as_str())),
        "{ctx}: {r}"
    );

    // A function that writes on the runner's own reply descriptor: the reply is no longer
    // one JSON value, the call fails, its output is not published, the state is kept.
    let r = call(
        &c,
        "py_scribble",
        json!({"session": "p", "out": "forged.txt"}),
    )
    .await;
    assert_eq!(code(&r), "TOOL_FAILED", "{ctx}: {r}");
    assert!(text(&r).contains("gave an invalid reply"), "{ctx}: {r}");
    assert!(d.read("forged.txt").is_none(), "{ctx}");
    assert_eq!(version(&c, "p").await, 2, "{ctx}");

    // None: a result with nothing in it. A response saying isError: the tool's own fault,
    // its blocks kept, nothing committed.
    let r = call(&c, "py_nothing", json!({})).await;
    assert!(!is_error(&r), "{ctx}: {r}");
    assert_eq!(r["content"], json!([]), "{ctx}: {r}");
    let r = call(&c, "py_refuse", json!({"session": "p", "word": "w"})).await;
    assert_eq!(code(&r), "TOOL_FAILED", "{ctx}: {r}");
    assert!(text(&r).contains("refused w"), "{ctx}: {r}");
    assert_eq!(version(&c, "p").await, 2, "{ctx}");

    // Path parameters: the input read, the output published; a write tool's structured
    // result sits beside its commit; a function without a session parameter works and
    // leaves the state as it was.
    let r = call(
        &c,
        "py_tally",
        json!({"session": "p", "source": "in/t.txt", "out": "in/t.rev"}),
    )
    .await;
    assert!(!is_error(&r), "{ctx}: {r}");
    assert_eq!(
        r["structuredContent"]["result"],
        json!([8, 2]),
        "{ctx}: {r}"
    );
    assert_eq!(r["structuredContent"]["version"], 3, "{ctx}: {r}");
    assert_eq!(d.read("in/t.rev").as_deref(), Some("\nfed\ncba"), "{ctx}");
    let r = call(&c, "py_no_session", json!({"session": "p", "word": "w"})).await;
    assert!(!is_error(&r), "{ctx}: {r}");
    // Only its declared argument: the session id is not passed as such.
    assert_eq!(text(&r), "kwargs: word", "{ctx}: {r}");
    let got = call(&c, "session_get", json!({"session": "p"})).await;
    assert_eq!(got["structuredContent"]["version"], 4, "{ctx}: {got}");
    assert_eq!(got["structuredContent"]["state"], json!({"n": 5}), "{ctx}");

    // The shipped example under this profile.
    let r = call(
        &c,
        "word_count_p",
        json!({"session": "p", "source": "docs/a.txt", "out": "docs/a.wc"}),
    )
    .await;
    assert!(!is_error(&r), "{ctx}: {r}");
    assert_eq!(text(&r), "2 lines, 4 words, 19 bytes", "{ctx}: {r}");
    assert_eq!(d.read("docs/a.wc").as_deref(), Some("2 4 19\n"), "{ctx}");
    let got = call(&c, "session_get", json!({"session": "p"})).await;
    assert_eq!(
        got["structuredContent"]["state"],
        json!({"n": 5, "words_counted": 4}),
        "{ctx}: {got}"
    );

    // An exception: TOOL_FAILED naming it, nothing committed, the audit's `error` says
    // which class.
    let r = call(&c, "py_explode", json!({"session": "p", "word": "zap"})).await;
    assert_eq!(code(&r), "TOOL_FAILED", "{ctx}: {r}");
    assert!(
        text(&r).contains("py_explode raised ValueError: bad input: zap"),
        "{ctx}: {r}"
    );
    assert_eq!(version(&c, "p").await, 5, "{ctx}");
    let r = call(&c, "py_custom", json!({})).await;
    assert_eq!(code(&r), "TOOL_FAILED", "{ctx}: {r}");
    assert!(
        text(&r).contains("raised pytools.fns.Custom: custom failure"),
        "{ctx}: {r}"
    );
    let events = audit(&c).await;
    let error_of = |tool: &str| {
        events
            .iter()
            .find(|e| e["tool"] == tool && e["kind"] == "error")
            .cloned()
            .unwrap_or_else(|| panic!("{ctx}: no error event of {tool}"))
    };
    let e = error_of("py_explode");
    assert_eq!(e["detail"]["exception_type"], "ValueError", "{ctx}: {e}");
    assert_eq!(e["detail"]["code"], "TOOL_FAILED", "{ctx}: {e}");
    assert_eq!(
        error_of("py_custom")["detail"]["exception_type"],
        "pytools.fns.Custom",
        "{ctx}"
    );
    assert!(
        events
            .iter()
            .any(|e| e["tool"] == "py_explode" && e["kind"] == "rollback"),
        "{ctx}"
    );

    // A value JSON cannot hold: TOOL_FAILED naming its type, no exception type recorded.
    let r = call(&c, "py_unsendable", json!({})).await;
    assert_eq!(code(&r), "TOOL_FAILED", "{ctx}: {r}");
    assert!(text(&r).contains("type set"), "{ctx}: {r}");

    // A missing module: TOOL_FAILED naming ModuleNotFoundError.
    let r = call(&c, "py_missing", json!({"session": "p"})).await;
    assert_eq!(code(&r), "TOOL_FAILED", "{ctx}: {r}");
    assert!(
        text(&r).contains("ModuleNotFoundError: No module named 'no_such_module'"),
        "{ctx}: {r}"
    );

    // The function tries to change its own module directory: every attempt is denied and
    // the directory is as it was.
    let pkg = d.policies.join("pytest_mods/pytools");
    let before = snapshot(&pkg);
    let r = call(&c, "py_hostile", json!({"session": "p"})).await;
    assert!(!is_error(&r), "{ctx}: {r}");
    let out = text(&r);
    assert_eq!(out.matches("denied:").count(), 6, "{ctx}: {out}");
    assert!(!out.contains("done"), "{ctx}: {out}");
    assert_eq!(
        snapshot(&pkg),
        before,
        "{ctx}: the module directory changed"
    );
    assert!(!pkg.join("planted.py").exists() && !pkg.join("__pycache__").exists());
    let mode = std::fs::metadata(pkg.join("fns.py"))
        .expect("stat")
        .permissions()
        .mode();
    assert_eq!(mode & 0o777, 0o644, "{ctx}");

    // The audit log holds the same, and verifies; nothing was left behind.
    let log = std::fs::read_to_string(d.state.join("audit.jsonl")).expect("audit log");
    assert!(
        log.lines().any(|l| l.contains("\"tool\":\"py_explode\"")
            && l.contains("\"exception_type\":\"ValueError\"")),
        "{ctx}: no exception_type in the durable log"
    );
    d.assert_audit_verifies(ctx);
    assert!(d.job_dirs().is_empty(), "{ctx}: {:?}", d.job_dirs());
}

/// Root daemon: each worker has a uid of its own.
#[tokio::test]
async fn python_tools_as_root_under_both_profiles() {
    require_root();
    for profile in PROFILES {
        let mut d = daemon(profile);
        d.start();
        exercise(&d, &format!("root, {profile}")).await;
    }
}

/// Unprivileged daemon: workers share its uid, so only the sandbox keeps the module
/// directory (owned by that uid) read-only.
#[tokio::test]
async fn python_tools_as_an_unprivileged_daemon_under_both_profiles() {
    require_root_for("running the daemon as nobody");
    for profile in PROFILES {
        let mut d = daemon(profile);
        give_to_nobody(&d);
        d.user = Some((65534, 65534));
        d.start();
        exercise(&d, &format!("nobody, {profile}")).await;
    }
}

/// The shipped policy directory as it is: `word_count` works with no flags but the paths.
#[tokio::test]
async fn the_shipped_word_count_works_out_of_the_box() {
    require_program("/usr/bin/python3", "python3");
    let mut d = Daemon::new();
    d.start();
    let c = d.client().await;
    session(&c, "w").await;
    d.write("a.txt", "hello python world\n");
    let r = call(
        &c,
        "word_count",
        json!({"session": "w", "source": "a.txt", "out": "a.wc"}),
    )
    .await;
    assert!(!is_error(&r), "{r}");
    assert_eq!(d.read("a.wc").as_deref(), Some("1 3 19\n"));
    assert_eq!(version(&c, "w").await, 1);
    let got = call(&c, "session_get", json!({"session": "w"})).await;
    assert_eq!(
        got["structuredContent"]["state"],
        json!({"words_counted": 3})
    );
}

/// A checkout under a directory others cannot search (a clone in /root): with worker uids,
/// the worker is handed the module directory relative to its working directory, as it is
/// its path arguments, and still reaches it (read-only): the runner holds it open and puts
/// `/proc/self/fd/N` on `sys.path`, since importlib makes every entry absolute.
#[tokio::test]
async fn a_python_tool_in_a_policy_dir_under_an_unsearchable_directory() {
    require_root();
    for profile in PROFILES {
        let mut d = daemon(profile);
        // hidden/ (0700, as /root is) holds the checkout (0755), which holds the policies and
        // the workspace.
        let hidden = d.dir.path().join("hidden");
        let checkout = hidden.join("checkout");
        std::fs::create_dir_all(&checkout).expect("mkdir");
        std::fs::set_permissions(&hidden, std::fs::Permissions::from_mode(0o700)).expect("chmod");
        let policies = checkout.join("policies");
        std::fs::rename(&d.policies, &policies).expect("move policies");
        d.policies = policies;
        d.workspace = checkout.join("workspace");
        std::fs::create_dir(&d.workspace).expect("mkdir ws");
        d.state = checkout.join("state");
        d.start();
        assert!(
            d.log_text()
                .contains("workers are handed paths relative to their working directory"),
            "{}",
            d.log_text()
        );
        let c = d.client().await;
        session(&c, "u").await;
        d.write("a.txt", "x y\n");
        let r = call(
            &c,
            "word_count",
            json!({"session": "u", "source": "a.txt", "out": "a.wc"}),
        )
        .await;
        assert!(!is_error(&r), "{r}");
        assert_eq!(d.read("a.wc").as_deref(), Some("1 2 4\n"));
        let r = call(&c, "py_echo", json!({"word": "deep"})).await;
        assert_eq!(text(&r), "echo: deep", "{r}");
        let pkg = d.policies.join("pytest_mods/pytools");
        let before = snapshot(&pkg);
        let r = call(&c, "py_hostile", json!({"session": "u"})).await;
        assert_eq!(text(&r).matches("denied:").count(), 6, "{r}");
        assert_eq!(snapshot(&pkg), before);
    }
}

/// `policy check` names what is wrong in a python tool's file, at its line and column.
#[tokio::test]
async fn python_tool_load_errors_name_file_line_and_column() {
    let d = Daemon::new();
    let cases = [
        (
            "entry = \"pkg.mod\"\n",
            "bad.toml:4:9: entry \"pkg.mod\" must be \"package.module:function\"",
        ),
        (
            "entry = \"pkg:mod:f\"\n",
            "bad.toml:4:9: entry \"pkg:mod:f\" must be",
        ),
        (
            "entry = \"m:f\"\ncommand = [\"/usr/bin/python3\"]\n",
            "bad.toml:5:11: a python tool has no command",
        ),
        (
            "entry = \"m:f\"\npython = \"python3\"\n",
            "bad.toml:5:10: python \"python3\" must be an absolute path",
        ),
    ];
    for (body, want) in cases {
        std::fs::write(
            d.policies.join("tools/bad.toml"),
            format!("name = \"bad\"\ncapability = \"read\"\nprotocol = \"python\"\n{body}"),
        )
        .expect("write");
        let out = std::process::Command::new(BIN)
            .args(["policy", "check", "--policies"])
            .arg(&d.policies)
            .output()
            .expect("policy check");
        let all = format!(
            "{}{}",
            String::from_utf8_lossy(&out.stdout),
            String::from_utf8_lossy(&out.stderr)
        );
        assert_eq!(out.status.code(), Some(1), "{body}: {all}");
        assert!(all.contains(want), "{body}: {all}");
        assert!(
            all.contains(&format!("{}", d.policies.join("tools/bad.toml").display())),
            "{all}"
        );
    }
    // `policy explain` of the shipped python tool shows what it runs.
    std::fs::remove_file(d.policies.join("tools/bad.toml")).expect("rm");
    let out = std::process::Command::new(BIN)
        .args(["policy", "explain", "--policies"])
        .arg(&d.policies)
        .arg("word_count")
        .output()
        .expect("policy explain");
    let text = String::from_utf8_lossy(&out.stdout);
    assert!(out.status.success(), "{text}");
    for want in [
        "entry:    airlock_examples.wordcount:word_count".to_string(),
        "python:   /usr/bin/python3 -I -B".to_string(),
        format!(
            "python_path: {} (first on sys.path; read-only to the worker)",
            d.policies
                .join("python")
                .canonicalize()
                .expect("python dir")
                .display()
        ),
        "protocol: python".to_string(),
    ] {
        assert!(text.contains(&want), "{want}: {text}");
    }
    std::fs::write(
        d.policies.join("tools/bad.toml"),
        "name = \"bad\"\ncapability = \"read\"\nprotocol = \"python\"\nentry = \"m:f\"\npython = \"python3\"\n",
    )
    .expect("write");
    // And the daemon refuses to start on it, saying where.
    let mut d = d;
    assert!(
        d.try_start().is_err(),
        "served a policy with a bad python tool"
    );
    assert!(
        d.log_text()
            .contains("bad.toml:5:10: python \"python3\" must be an absolute path"),
        "{}",
        d.log_text()
    );
}
