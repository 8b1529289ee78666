//! Workers under a uid of their own, and what they can reach. Each test is a hostile
//! tool run through the real daemon, as root (workers get a uid of their own from
//! `worker_uids`) and, where meaningful, as `nobody` (workers keep the daemon's uid), under the
//! shipped `default` and `strict` profiles; each asserts on the outside world: contents,
//! modes, owners, times, xattrs, processes, and the daemon still serving and restarting.

use std::os::unix::fs::MetadataExt;
use std::path::{Path, PathBuf};
use std::time::{SystemTime, UNIX_EPOCH};

use serde_json::json;

use crate::harness::*;
use crate::sandbox::give_to_nobody;

const PROFILES: [&str; 2] = ["default", "strict"];

/// Test tools under `profile`: `hs` (write: a shell script, optional output), `hs755` (the
/// same with `mode = "0755"` on its output), `hp` (write: python code, optional output, optional
/// input) and `hr` (read: a shell script, optional input directory).
fn daemon(profile: &str) -> Daemon {
    let d = Daemon::new();
    let sh_write = |name: &str, mode: &str| {
        format!(
            r#"name = "{name}"
description = "Run a shell script (test only)"
capability = "write"
profile = "{profile}"
command = ["/bin/sh", "-c", "{{script}}", "{name}", "{{out}}"]
timeout = "60s"
[params.script]
type = "string"
[params.out]
type = "string"
path = "output"
required = false
{mode}
"#
        )
    };
    d.add_tool("hs", &sh_write("hs", ""));
    d.add_tool("hs755", &sh_write("hs755", "mode = \"0755\""));
    d.add_tool(
        "hp",
        &format!(
            r#"name = "hp"
description = "Run python code (test only)"
capability = "write"
profile = "{profile}"
command = ["/usr/bin/python3", "-I", "-c", "{{code}}", "{{out}}", "{{input}}"]
timeout = "60s"
[params.code]
type = "string"
[params.out]
type = "string"
path = "output"
required = false
[params.input]
type = "string"
path = "input"
required = false
"#
        ),
    );
    d.add_tool(
        "hr",
        &format!(
            r#"name = "hr"
description = "Run a shell script with read rights (test only)"
capability = "read"
profile = "{profile}"
command = ["/bin/sh", "-c", "{{script}}", "hr", "{{dir}}"]
timeout = "60s"
[params.script]
type = "string"
[params.dir]
type = "string"
path = "input"
required = false
"#
        ),
    );
    d
}

/// Sets `key = value` lines in `[daemon]` of the daemon's airlock.toml, replacing a key
/// that is already set: [`set_daemon`] with the pairs `lines` holds.
pub fn daemon_setting(d: &Daemon, lines: &str) {
    let kv: Vec<(&str, &str)> = lines
        .lines()
        .map(|l| {
            let (k, v) = l
                .split_once('=')
                .unwrap_or_else(|| panic!("not a `key = value` line: {l:?}"));
            (k.trim(), v.trim())
        })
        .collect();
    set_daemon(d, &kv);
}

fn as_nobody(d: &mut Daemon) {
    give_to_nobody(d);
    d.user = Some((65534, 65534));
}

/// A number no other test's process carries on its command line.
fn unique() -> String {
    let n = SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .expect("clock")
        .subsec_nanos();
    format!("{:09}{}", n, std::process::id() % 1000)
}

fn status_field(pid: i32, field: &str) -> Option<String> {
    std::fs::read_to_string(format!("/proc/{pid}/status"))
        .ok()?
        .lines()
        .find(|l| l.starts_with(&format!("{field}:")))
        .map(|l| l[field.len() + 1..].trim().to_string())
}

/// The real uid of `pid`.
fn ruid(pid: i32) -> Option<u32> {
    status_field(pid, "Uid")?
        .split_whitespace()
        .next()?
        .parse()
        .ok()
}

/// The shipped `worker_uid_lock_dir`, which the tests that set none share with every daemon
/// on the host.
const DEFAULT_LEASE_DIR: &str = "/run/airlock/uids";

/// Whether some process holds a `flock` on `path`, from `/proc/locks` (which names the
/// inode of every lock held on the host).
fn lease_locked(path: &Path) -> bool {
    let ino = std::fs::metadata(path)
        .unwrap_or_else(|e| panic!("{}: {e}", path.display()))
        .ino();
    std::fs::read_to_string("/proc/locks")
        .expect("/proc/locks")
        .lines()
        .filter(|l| !l.contains("->"))
        .any(|l| {
            let f: Vec<&str> = l.split_whitespace().collect();
            f.get(1) == Some(&"FLOCK")
                && f.get(5)
                    .and_then(|d| d.rsplit(':').next())
                    .and_then(|i| i.parse::<u64>().ok())
                    == Some(ino)
        })
}

/// Names of the bound abstract Unix sockets (`@name`) in the test's network namespace.
fn abstract_sockets() -> Vec<String> {
    std::fs::read_to_string("/proc/net/unix")
        .unwrap_or_default()
        .lines()
        .filter_map(|l| l.split_whitespace().nth(7))
        .filter(|p| p.starts_with('@'))
        .map(str::to_string)
        .collect()
}

// ---------------------------------------------------------------------------------------
// 1. Other calls' jobs and other filesystems are out of reach of inputs.

#[tokio::test]
async fn inputs_covering_job_dirs_are_refused_while_another_call_stages_output() {
    crate::harness::require_program("tar", "tar");
    require_root();
    for (profile, nobody) in [("default", false), ("strict", false), ("default", true)] {
        let mut d = daemon(profile);
        d.write("sub/f.txt", "plain");
        if nobody {
            // Workers share the daemon's uid: only the input check keeps job dirs out.
            as_nobody(&mut d);
        }
        d.write("nest/.airlock-job-fake/x", "not a job, but a reserved name");
        d.start();
        let c = d.client().await;
        session(&c, "a").await;
        session(&c, "b").await;
        // Session a's call stages a secret and blocks; its client waits on a raw connection.
        let secret = format!("SECRET-{}", unique());
        let blocker = format!("33.{}", unique());
        let mut raw = d.raw();
        raw.initialize();
        raw.call(
            1,
            "hs",
            json!({"session": "a", "out": "a.txt",
                "script": format!("printf {secret} > \"$1\" && exec sleep {blocker}")}),
        );
        // The script's own text names the blocker, so the process shows before printf has
        // run: wait for the staged secret itself.
        let staged_secret = |d: &Daemon| -> Vec<PathBuf> {
            d.job_dirs()
                .iter()
                .flat_map(|j| walk_files(&d.workspace.join(j)))
                .filter(|p| std::fs::read_to_string(p).is_ok_and(|t| t == secret))
                .collect()
        };
        wait_for_process(&blocker).await;
        wait_until(
            "the blocked call to stage its output (the test would prove nothing)",
            || !staged_secret(&d).is_empty(),
        )
        .await;
        // Job dirs aside: the running call's journal moves on its own.
        let outside_jobs = |d: &Daemon| {
            let mut s = snapshot(&d.workspace);
            s.retain(|(p, _)| !p.starts_with(".airlock-job-"));
            s
        };
        let before = outside_jobs(&d);

        for source in [".", "a/..", "sub/..", &d.workspace.display().to_string()] {
            let r = call(
                &c,
                "archive",
                json!({"session": "b", "source": source, "out": "leak.tar"}),
            )
            .await;
            assert_eq!(
                code(&r),
                "PATH_REJECTED",
                "archive {source:?} [{profile}]: {r}"
            );
            let t = text(&r);
            assert!(
                t.contains("workspace root") && t.contains("name a subdirectory"),
                "{t}"
            );
            assert!(!t.contains(&secret), "{t}");
            let r = call(
                &c,
                "hr",
                json!({"dir": source, "script": "cat \"$1\"/.airlock-*/*/* \"$1\"/.airlock-*/*; ls -laR \"$1\""}),
            )
            .await;
            assert_eq!(code(&r), "PATH_REJECTED", "hr {source:?} [{profile}]: {r}");
            assert!(!text(&r).contains(&secret), "{r}");
            let r = call(
                &c,
                "hp",
                json!({"session": "b", "input": source, "code": "import os, sys\nfor r, ds, fs in os.walk(sys.argv[2]):\n    for f in fs:\n        print(open(os.path.join(r, f)).read())"}),
            )
            .await;
            assert_eq!(code(&r), "PATH_REJECTED", "hp {source:?} [{profile}]: {r}");
            assert!(!text(&r).contains(&secret), "{r}");
        }
        // The empty path and a job dir named directly are refused too.
        let r = call(
            &c,
            "archive",
            json!({"session": "b", "source": "", "out": "leak.tar"}),
        )
        .await;
        assert_eq!(code(&r), "PATH_REJECTED", "{r}");
        let job = d.job_dirs().into_iter().next().expect("a job dir");
        let r = call(
            &c,
            "archive",
            json!({"session": "b", "source": job, "out": "leak.tar"}),
        )
        .await;
        assert_eq!(code(&r), "PATH_REJECTED", "{r}");
        // A directory holding a reserved name is refused, saying which name.
        let r = call(
            &c,
            "archive",
            json!({"session": "b", "source": "nest", "out": "leak.tar"}),
        )
        .await;
        assert_eq!(code(&r), "PATH_REJECTED", "{r}");
        assert!(text(&r).contains(".airlock-job-fake"), "{r}");
        assert!(d.read("leak.tar").is_none());
        assert_eq!(
            outside_jobs(&d),
            before,
            "a refused call changed the workspace"
        );
        // An ordinary subdirectory still works, and its tar holds only it.
        let r = call(
            &c,
            "archive",
            json!({"session": "b", "source": "sub", "out": "sub.tar"}),
        )
        .await;
        assert!(!is_error(&r), "{r}");
        let tar = std::fs::read(d.workspace.join("sub.tar")).expect("sub.tar");
        assert!(!String::from_utf8_lossy(&tar).contains(&secret));
        let list = std::process::Command::new("tar")
            .arg("-tf")
            .arg(d.workspace.join("sub.tar"))
            .output()
            .expect("tar");
        assert_eq!(String::from_utf8_lossy(&list.stdout), "sub/\nsub/f.txt\n");
        // Session a's call is cancelled by its client leaving: nothing of it is published.
        drop(raw);
        wait_no_process(&blocker).await;
        wait_until("the cancelled job dir to go", || d.job_dirs().is_empty()).await;
        assert!(d.read("a.txt").is_none());
        assert_eq!(version(&c, "a").await, 0);
    }
}

fn walk_files(dir: &Path) -> Vec<PathBuf> {
    let mut out = Vec::new();
    for e in std::fs::read_dir(dir).into_iter().flatten().flatten() {
        let p = e.path();
        match e.file_type() {
            Ok(t) if t.is_dir() => out.extend(walk_files(&p)),
            Ok(t) if t.is_file() => out.push(p),
            _ => {}
        }
    }
    out
}

/// Unmounts on drop, so a failing test leaves no mount behind.
struct Mounted(PathBuf);

impl Mounted {
    fn tmpfs(at: &Path) -> Mounted {
        std::fs::create_dir_all(at).expect("mount point");
        crate::harness::require_program("mount", "mount");
        let st = std::process::Command::new("mount")
            .args(["-t", "tmpfs", "-o", "size=1m", "airlock-test"])
            .arg(at)
            .status()
            .expect("mount");
        assert!(st.success(), "mount -t tmpfs at {}", at.display());
        Mounted(at.to_path_buf())
    }
}

impl Drop for Mounted {
    fn drop(&mut self) {
        let _ = std::process::Command::new("umount")
            .arg("-l")
            .arg(&self.0)
            .status();
    }
}

#[tokio::test]
async fn inputs_crossing_into_another_mount_are_refused() {
    crate::harness::require_program("tar", "tar");
    require_root();
    let mut d = daemon("default");
    d.write("sub/plain.txt", "plain");
    let mnt = d.workspace.join("sub/mnt");
    let _mount = Mounted::tmpfs(&mnt);
    std::fs::write(mnt.join("foreign.txt"), "FOREIGN-FS").expect("write in tmpfs");
    d.start();
    let c = d.client().await;
    session(&c, "b").await;
    let canon = std::fs::canonicalize(&mnt).expect("canonical");
    for (source, why) in [
        (
            "sub",
            format!("crosses into the filesystem mounted at {}", canon.display()),
        ),
        ("sub/mnt", "on another mount".to_string()),
        ("sub/mnt/foreign.txt", "on another mount".to_string()),
    ] {
        let r = call(
            &c,
            "archive",
            json!({"session": "b", "source": source, "out": "x.tar"}),
        )
        .await;
        assert_eq!(code(&r), "PATH_REJECTED", "archive {source}: {r}");
        assert!(text(&r).contains(&why), "archive {source}: {r}");
        let r = call(
            &c,
            "hr",
            json!({"dir": source, "script": "cat \"$1\" \"$1\"/mnt/* \"$1\"/*"}),
        )
        .await;
        assert_eq!(code(&r), "PATH_REJECTED", "hr {source}: {r}");
        assert!(!text(&r).contains("FOREIGN-FS"), "{r}");
    }
    assert!(d.read("x.tar").is_none());
    // The file beside the mount is still an input.
    let r = call(
        &c,
        "hr",
        json!({"dir": "sub/plain.txt", "script": "cat \"$1\""}),
    )
    .await;
    assert_eq!(text(&r).trim(), "plain", "{r}");
}

// ---------------------------------------------------------------------------------------
// 2. Published outputs carry no privilege.

#[tokio::test]
async fn setuid_outputs_are_published_without_privilege() {
    crate::harness::require_program("setpriv", "util-linux");
    require_root();
    for profile in PROFILES {
        for nobody in [false, true] {
            let mut d = daemon(profile);
            if nobody {
                as_nobody(&mut d);
            }
            d.start();
            let c = d.client().await;
            session(&c, "h").await;
            let who = if nobody { 65534 } else { 0 };
            // Creation mode 06755, then fchmod for good measure: the worker tries both. The
            // containment filter refuses both (EPERM); the worker then stages a plain 0755
            // copy, and the publication must still carry no privilege (the daemon's seal is
            // the layer shown here; `publish::tests::published_outputs_are_sealed` stages a
            // real 06755 file).
            let code_ = "import os, sys\ntry:\n    fd = os.open(sys.argv[1], os.O_CREAT | os.O_WRONLY, 0o6755)\nexcept OSError as e:\n    print('create', e.errno)\n    fd = os.open(sys.argv[1], os.O_CREAT | os.O_WRONLY, 0o755)\nos.write(fd, open('/usr/bin/id', 'rb').read())\ntry:\n    os.fchmod(fd, 0o6755)\nexcept OSError as e:\n    print('fchmod', e.errno)\nos.close(fd)\nprint('staged', oct(os.stat(sys.argv[1]).st_mode))";
            for (tool, want) in [("hp", 0o644), ("hs755", 0o755)] {
                let out = format!("{tool}-id");
                let r = if tool == "hp" {
                    call(&c, "hp", json!({"session": "h", "out": out, "code": code_})).await
                } else {
                    // The same code through sh (single quotes: the code holds none).
                    call(
                        &c,
                        "hs755",
                        json!({"session": "h", "out": out, "script": format!(
                            "exec /usr/bin/python3 -I -c '{}' \"$1\"",
                            code_.replace('\'', "\"")
                        )}),
                    )
                    .await
                };
                assert!(!is_error(&r), "{tool} [{profile}, nobody={nobody}]: {r}");
                let p = d.workspace.join(&out);
                let m = std::fs::metadata(&p).expect("published");
                assert_eq!(
                    (m.mode() & 0o7777, m.uid(), m.gid()),
                    (want, who, who),
                    "{tool} [{profile}, nobody={nobody}]: mode/owner of the published copy"
                );
                assert_eq!(
                    std::fs::read(&p).expect("read"),
                    std::fs::read("/usr/bin/id").expect("id"),
                    "the content is published as written"
                );
                // Run as nobody: no euid of anyone else.
                let run = std::process::Command::new("setpriv")
                    .args(["--reuid=65534", "--regid=65534", "--clear-groups", "--"])
                    .arg(&p)
                    .output()
                    .expect("setpriv");
                let stdout = String::from_utf8_lossy(&run.stdout);
                if want & 0o111 == 0 {
                    assert!(!run.status.success(), "a 0644 output ran: {stdout}");
                } else {
                    assert!(
                        run.status.success()
                            && stdout.starts_with("uid=65534")
                            && !stdout.contains("euid")
                            && !stdout.contains("egid"),
                        "{tool} [{profile}, nobody={nobody}]: {stdout} {}",
                        String::from_utf8_lossy(&run.stderr)
                    );
                }
            }
        }
    }
}

#[test]
fn a_setuid_output_mode_is_refused_by_policy_check() {
    let d = daemon("default");
    std::fs::write(
        d.policies.join("tools/suid.toml"),
        "name = \"suid\"\ncapability = \"write\"\ncommand = [\"/bin/true\", \"{out}\"]\n[params.out]\ntype = \"string\"\npath = \"output\"\nmode = \"4755\"\n",
    )
    .expect("tool");
    let out = std::process::Command::new(BIN)
        .args(["policy", "check", "--policies"])
        .arg(&d.policies)
        .output()
        .expect("policy check");
    let err =
        String::from_utf8_lossy(&out.stderr).to_string() + &String::from_utf8_lossy(&out.stdout);
    assert_eq!(out.status.code(), Some(1), "{err}");
    assert!(
        err.contains("suid.toml:7:8:") && err.contains("\"4755\"") && err.contains("setuid"),
        "{err}"
    );
}

// ---------------------------------------------------------------------------------------
// 3. Each worker runs under a leased uid of its own, freed when its call ends.

#[tokio::test]
async fn concurrent_workers_get_distinct_uids_from_the_range_and_free_them() {
    require_root();
    for profile in PROFILES {
        let mut d = daemon(profile);
        // A range of exactly two ids (and two call slots, both for this one principal) no
        // other test uses: a third call runs only if both were released.
        daemon_setting(
            &d,
            "worker_uids = \"62010-62011\"\nmax_concurrent_calls = 2\nmax_calls_per_principal = 2",
        );
        d.write("gate/.keep", "");
        d.start();
        let c = d.client().await;
        session(&c, "a").await;
        session(&c, "b").await;
        let mut raws = Vec::new();
        let mut markers = Vec::new();
        for (i, s) in ["a", "b"].iter().enumerate() {
            let marker = format!("34.{}{i}", unique());
            let mut raw = d.raw();
            raw.initialize();
            raw.call(
                1,
                "hp",
                json!({"session": s, "input": "gate", "code": format!(
                    "import os, sys, time, subprocess\nprint(open('/proc/self/status').read())\nsubprocess.run(['/bin/sh', '-c', 'until [ -e \"$0/open\" ]; do sleep 0.05; done # {marker}', sys.argv[1]])\n"
                )}),
            );
            raws.push(raw);
            markers.push(marker);
        }
        for m in &markers {
            wait_for_process(m).await;
        }
        let uids: Vec<u32> = markers
            .iter()
            .map(|m| ruid(processes_with(m)[0]).expect("uid"))
            .collect();
        assert!(
            uids.iter().all(|u| (62010..=62011).contains(u)) && uids[0] != uids[1],
            "[{profile}] worker uids {uids:?}"
        );
        let leases = Path::new(DEFAULT_LEASE_DIR);
        for u in &uids {
            assert!(
                lease_locked(&leases.join(u.to_string())),
                "uid {u} is not locked while leased"
            );
        }
        // Neither worker may open the gate: it is the daemon's directory, not theirs. The
        // test opens it.
        std::fs::write(d.workspace.join("gate/open"), "").expect("open the gate");
        for (raw, u) in raws.iter_mut().zip(&uids) {
            let r = raw.response(1);
            let t = r["result"]["content"][0]["text"].as_str().unwrap_or("");
            assert!(
                t.contains(&format!("Uid:\t{u}\t{u}\t{u}\t{u}"))
                    && t.contains(&format!("Gid:\t{u}\t{u}\t{u}\t{u}"))
                    && t.lines().any(|l| l.trim() == "Groups:"),
                "[{profile}] {r}"
            );
        }
        for u in &uids {
            assert!(
                !lease_locked(&leases.join(u.to_string())),
                "uid {u} still locked after its call"
            );
            assert!(
                all_pids().into_iter().all(|p| ruid(p) != Some(*u)),
                "a process of uid {u} outlived its call"
            );
        }
        // A third and a fourth call run: the uids were freed.
        for s in ["a", "b"] {
            let r = call(&c, "hs", json!({"session": s, "script": "id -u"})).await;
            let u: u32 = text(&r).trim().parse().unwrap_or_else(|_| panic!("{r}"));
            assert!(uids.contains(&u), "{u}");
        }
    }
}

fn all_pids() -> Vec<i32> {
    std::fs::read_dir("/proc")
        .expect("/proc")
        .flatten()
        .filter_map(|e| e.file_name().to_string_lossy().parse().ok())
        .collect()
}

// ---------------------------------------------------------------------------------------
// 4. Metadata outside staging, as a root daemon.

/// What a worker could change about a file without writing it.
#[derive(Debug, PartialEq)]
struct Meta {
    mode: u32,
    uid: u32,
    gid: u32,
    mtime: (i64, i64),
    /// Moves with every chmod, chown, utimensat, setxattr and inode-flag change.
    ctime: Option<(i64, i64)>,
    xattrs: Vec<Vec<u8>>,
}

fn meta(p: &Path, with_times: bool) -> Meta {
    let m = std::fs::symlink_metadata(p).unwrap_or_else(|e| panic!("{}: {e}", p.display()));
    Meta {
        mode: m.mode(),
        uid: m.uid(),
        gid: m.gid(),
        mtime: if with_times {
            (m.mtime(), m.mtime_nsec())
        } else {
            (0, 0)
        },
        ctime: with_times.then(|| (m.ctime(), m.ctime_nsec())),
        xattrs: xattr_names(p),
    }
}

#[tokio::test]
async fn workers_change_no_metadata_outside_staging_under_a_root_daemon() {
    crate::harness::require_program("chattr", "e2fsprogs");
    require_root();
    for profile in PROFILES {
        let mut d = daemon(profile);
        let outside = d.dir.path().join("outside.txt");
        std::fs::write(&outside, "root's").expect("outside");
        d.write("undeclared.txt", "undeclared");
        d.write("in/ro.txt", "read-only input");
        d.start();
        let c = d.client().await;
        session(&c, "h").await;
        let ws = d.workspace.clone();
        // The workspace root's times move with every job dir, so only its mode, owner and
        // xattrs are compared (and a successful utime would be seen by the tool's report).
        let targets: Vec<(PathBuf, bool)> = vec![
            (outside.clone(), true),
            (d.socket.clone(), true),
            (ws.join("undeclared.txt"), true),
            (ws.clone(), false),
            (ws.join("in/ro.txt"), true),
        ];
        let before: Vec<Meta> = targets.iter().map(|(p, t)| meta(p, *t)).collect();
        let list = targets
            .iter()
            .map(|(p, _)| format!("{:?}", p.display().to_string()))
            .collect::<Vec<_>>()
            .join(", ");
        let code_ = format!(
            r#"import os, fcntl, struct
res = []
def flags(p):
    fd = os.open(p, os.O_RDONLY | os.O_NONBLOCK)
    try:
        fcntl.ioctl(fd, 0x40086602, struct.pack('i', 0x80))
    finally:
        os.close(fd)
for p in [{list}]:
    for name, f in [
        ('chmod4777', lambda: os.chmod(p, 0o4777)),
        ('chmod000', lambda: os.chmod(p, 0)),
        ('chown-group0', lambda: os.chown(p, -1, 0)),
        ('chown-self', lambda: os.chown(p, os.getuid(), os.getgid())),
        ('utime', lambda: os.utime(p, (0, 0))),
        ('touch-now', lambda: os.utime(p)),
        ('setxattr', lambda: os.setxattr(p, 'user.pwned', b'1')),
        ('setxattr-trusted', lambda: os.setxattr(p, 'trusted.pwned', b'1')),
        ('inode-flags', lambda: flags(p)),
    ]:
        try:
            f()
            res.append('CHANGED %s %s' % (name, p))
        except OSError as e:
            res.append('denied %s %s errno %d' % (name, p, e.errno))
print('\n'.join(res))
"#
        );
        let r = call(
            &c,
            "hp",
            json!({"session": "h", "input": "in/ro.txt", "code": code_}),
        )
        .await;
        let out = text(&r);
        assert!(!is_error(&r), "[{profile}] {r}");
        assert_eq!(
            out.matches("denied ").count(),
            9 * targets.len(),
            "[{profile}] {out}"
        );
        assert!(!out.contains("CHANGED"), "[{profile}] {out}");
        let after: Vec<Meta> = targets.iter().map(|(p, t)| meta(p, *t)).collect();
        for ((p, _), (b, a)) in targets.iter().zip(before.iter().zip(&after)) {
            assert_eq!(b, a, "[{profile}] {} changed", p.display());
        }
        // The same from the shell's own tools.
        let r = call(
            &c,
            "hs",
            json!({"session": "h", "script": format!(
                "for p in {}; do chmod 4777 \"$p\"; chmod 000 \"$p\"; chown :0 \"$p\"; touch -d 2000-01-01 \"$p\"; chattr +A \"$p\"; done 2>&1; echo done",
                targets.iter().map(|(p, _)| format!("'{}'", p.display())).collect::<Vec<_>>().join(" ")
            )}),
        )
        .await;
        assert!(text(&r).contains("done"), "{r}");
        let after: Vec<Meta> = targets.iter().map(|(p, t)| meta(p, *t)).collect();
        for ((p, _), (b, a)) in targets.iter().zip(before.iter().zip(&after)) {
            assert_eq!(b, a, "[{profile}] {} changed by shell tools", p.display());
        }
        // The daemon serves, and restarts.
        write_and_check(&c, &d, "after.txt").await;
        drop(c);
        assert!(d.stop().success());
        d.start();
        let c = d.client().await;
        write_and_check(&c, &d, "after-restart.txt").await;
    }
}

async fn write_and_check(c: &Client, d: &Daemon, out: &str) {
    let r = call(
        c,
        "write_text",
        json!({"session": "h", "text": out, "out": out}),
    )
    .await;
    assert!(!is_error(&r), "{r}");
    assert_eq!(d.read(out).as_deref(), Some(out));
}

// ---------------------------------------------------------------------------------------
// 5. No worker process outlives the daemon.

/// How the daemon goes away in [`outliving`].
#[derive(Clone, Copy, Debug)]
enum Death {
    Kill9,
    Hup,
}

/// A tool (`hs` write, or `hr` read) starts a background `sleep` and blocks in another; the
/// daemon dies; the background process must not survive the daemon's next start.
async fn outliving(profile: &str, nobody: bool, tool: &str, death: Death) {
    require_root();
    let mut d = daemon(profile);
    if nobody {
        as_nobody(&mut d);
    } else {
        // A range of its own: the worker uids say whose leftovers are whose in the failure
        // message, and no other test's worker competes for the leases.
        let first = match (tool, death) {
            ("hs", Death::Kill9) => 62200,
            ("hr", Death::Kill9) => 62300,
            _ => 62400,
        };
        daemon_setting(&d, &format!("worker_uids = \"{first}-{}\"", first + 63));
    }
    d.write("keep.txt", "kept");
    d.start();
    let c = d.client().await;
    session(&c, "h").await;
    let before = snapshot(&d.workspace);
    let marker = format!("31.{}", unique());
    let leader = format!("32.{}", unique());
    let script = format!("sleep {marker} & exec sleep {leader}");
    let args = if tool == "hs" {
        json!({"session": "h", "out": "never.txt", "script": script})
    } else {
        json!({"script": script})
    };
    let mut raw = d.raw();
    raw.initialize();
    raw.call(1, tool, args);
    // The shell's own command line names both: wait for the two sleeps themselves (the
    // background one forked, the leader exec'd), or a kill could come before the fork.
    wait_for_exact(&format!("sleep {marker}")).await;
    wait_for_exact(&format!("sleep {leader}")).await;
    let ctx = format!("[{profile}, nobody={nobody}, {tool}, {death:?}]");
    match death {
        Death::Kill9 => {
            drop(c);
            d.kill9();
            // The leader dies with the daemon (PDEATHSIG); its background child does not.
            wait_no_process(&leader).await;
            assert!(
                !processes_with(&marker).is_empty(),
                "{ctx} the background child died with the daemon: this test would prove nothing"
            );
            d.start();
            assert!(
                processes_with(&marker).is_empty(),
                "{ctx} a worker's background child outlived the daemon's restart:\n{}",
                d.log_text()
            );
            assert!(
                d.job_dirs().is_empty(),
                "{ctx} job dirs left: {:?}",
                d.job_dirs()
            );
            assert_eq!(snapshot(&d.workspace), before, "{ctx} workspace changed");
            let c = d.client().await;
            write_and_check(&c, &d, "after.txt").await;
        }
        Death::Hup => {
            // SAFETY: kill(2) on the daemon, our own child.
            unsafe { libc::kill(d.pid() as i32, libc::SIGHUP) };
            // A full call after the signal, in another session (the running call holds
            // "h"): the daemon still serves...
            session(&c, "hup").await;
            let r = call(
                &c,
                "write_text",
                json!({"session": "hup", "text": "after", "out": "after.txt"}),
            )
            .await;
            assert!(!is_error(&r), "{ctx} {r}");
            assert_eq!(d.read("after.txt").as_deref(), Some("after"));
            assert!(
                d.child
                    .as_mut()
                    .expect("daemon")
                    .try_wait()
                    .expect("wait")
                    .is_none(),
                "{ctx} SIGHUP killed the daemon"
            );
            // ...the worker still runs, and dies with its call.
            assert!(
                !processes_with(&leader).is_empty(),
                "{ctx} SIGHUP killed the worker"
            );
            drop(raw);
            wait_no_process(&marker).await;
            wait_no_process(&leader).await;
        }
    }
}

#[tokio::test]
async fn write_workers_do_not_outlive_a_killed_root_daemon() {
    for profile in PROFILES {
        outliving(profile, false, "hs", Death::Kill9).await;
    }
}

#[tokio::test]
async fn write_workers_do_not_outlive_a_killed_unprivileged_daemon() {
    for profile in PROFILES {
        outliving(profile, true, "hs", Death::Kill9).await;
    }
}

#[tokio::test]
async fn read_workers_do_not_outlive_a_killed_daemon() {
    for profile in PROFILES {
        for nobody in [false, true] {
            outliving(profile, nobody, "hr", Death::Kill9).await;
        }
    }
}

#[tokio::test]
async fn sighup_neither_kills_the_daemon_nor_its_workers() {
    for nobody in [false, true] {
        outliving("default", nobody, "hs", Death::Hup).await;
    }
}

/// A write call's job dir is set aside when the call ends and reused by a later one: whatever
/// a hostile worker leaves in its staging dir or does to it (files, trees, a FIFO, a
/// symlink, modes opened up, extended attributes, a child holding the dir open), the next
/// call, of another session, gets a staging dir holding only its empty slot, mode 0700, and
/// nothing of it reaches the workspace.
#[tokio::test]
async fn a_hostile_workers_staging_dir_reaches_the_next_call_clean() {
    require_root();
    let hostile = "echo x > scratch; mkdir -p junk/deep; echo y > junk/deep/f; echo z > 0/extra; \
                   mkfifo 0/fifo; ln -s /etc/passwd 0/link; chmod 777 . 0 junk 2>/dev/null; \
                   python3 -c 'import os; os.setxattr(\".\", \"user.p\", b\"1\")' 2>/dev/null; \
                   (exec 3<.; sleep 30) & echo out > \"$1\"";
    let look =
        "l=$(ls -A . 0); s=$(stat -c '%a %n' . 0); printf '%s\\n%s\\n' \"$l\" \"$s\" > \"$1\"";
    for profile in PROFILES {
        for nobody in [false, true] {
            let who = if nobody { "nobody" } else { "root" };
            let mut d = daemon(profile);
            if nobody {
                as_nobody(&mut d);
            }
            d.start();
            let c = d.client().await;
            session(&c, "h").await;
            session(&c, "v").await;
            let r = call(
                &c,
                "hs",
                json!({"session": "h", "script": hostile, "out": "h.txt"}),
            )
            .await;
            assert!(!is_error(&r), "[{profile}, {who}] {r}");
            assert_eq!(d.job_dirs(), Vec::<String>::new(), "[{profile}, {who}]");
            let idle = d.idle_job_dirs();
            assert_eq!(idle.len(), 1, "[{profile}, {who}] set aside: {idle:?}");
            // Who the idle staging dir is: a removed dir's inode number is soon reused, its
            // birth time is not.
            let who_is = |dir: &str| {
                let m =
                    std::fs::symlink_metadata(d.workspace.join(dir).join("stage")).expect("stage");
                (m.ino(), m.created().expect("birth time"))
            };
            let before = who_is(&idle[0]);
            let r = call(
                &c,
                "hs",
                json!({"session": "v", "script": look, "out": "v.txt"}),
            )
            .await;
            assert!(!is_error(&r), "[{profile}, {who}] {r}");
            // The staging dir is the daemon's with the worker's group (0770) for a worker
            // under a uid of its own, the daemon's own (0700) for one under its uid.
            let stage_mode = if nobody { 700 } else { 770 };
            assert_eq!(
                d.read("v.txt"),
                Some(format!(".:\n0\n\n0:\n{stage_mode} .\n700 0\n")),
                "[{profile}, {who}]"
            );
            let idle = d.idle_job_dirs();
            assert_eq!(idle.len(), 1, "[{profile}, {who}] set aside: {idle:?}");
            assert_eq!(who_is(&idle[0]), before, "[{profile}, {who}] not reused");
            assert_eq!(
                tree_names(&d.workspace),
                vec!["h.txt".to_string(), "v.txt".to_string()],
                "[{profile}, {who}]"
            );
            assert_eq!(d.read("h.txt").as_deref(), Some("out\n"));
            d.stop();
            assert!(
                d.idle_job_dirs().is_empty(),
                "[{profile}, {who}] idle dirs left after a clean stop"
            );
            d.assert_audit_verifies(&format!("[{profile}, {who}]"));
        }
    }
}

/// A worker under a uid of its own cannot open its staging dirs up to another uid: it may
/// loosen the modes of the slots it owns, but the staging dir above them is the daemon's
/// (with the worker's group, 0770), so no other uid reaches them by path, and none can hold
/// a descriptor of a dir that the pool hands to a later call. Checked while publication is
/// held (a failpoint pause), as `nobody`, with every dir above the job dir searchable.
#[tokio::test(flavor = "multi_thread")]
async fn an_outsider_cannot_reach_a_workers_staging_dir_even_if_the_worker_opens_it_up() {
    require_root();
    require_program("/usr/bin/setpriv", "util-linux");
    let opener = "chmod 0755 0; chmod 0755 . 2>/dev/null; echo \"chmod of .: $?\" > \"$1\"; \
                  stat -c '%a %u %g' . >> \"$1\"";
    for profile in PROFILES {
        let mut d = daemon(profile);
        let mark = d.pause_at_failpoint("publish.journal_write", 1);
        // Every dir above the job dir searchable by others (checked below): only the
        // staging dir's own mode can keep an outsider out.
        let mut m = std::fs::metadata(d.dir.path()).unwrap().permissions();
        std::os::unix::fs::PermissionsExt::set_mode(&mut m, 0o711);
        std::fs::set_permissions(d.dir.path(), m).unwrap();
        d.start();
        let c = d.client().await;
        session(&c, "h").await;
        let pending = {
            let c = d.client().await;
            tokio::spawn(async move {
                call(
                    &c,
                    "hs",
                    json!({"session": "h", "script": opener, "out": "h.txt"}),
                )
                .await
            })
        };
        wait_until("publication to stop before its journal", || mark.exists()).await;
        let jobs = d.job_dirs();
        assert_eq!(jobs.len(), 1, "[{profile}] {jobs:?}");
        let stage = d.workspace.join(&jobs[0]).join("stage");
        assert!(
            reachable_by_others(&stage),
            "[{profile}] the test needs every dir above the staging dir searchable"
        );
        let as_nobody = |args: &[&str]| {
            std::process::Command::new("/usr/bin/setpriv")
                .args(["--reuid=65534", "--regid=65534", "--clear-groups", "--"])
                .args(args)
                .output()
                .unwrap()
        };
        // The outsider reaches the job dir's entries, not what is beneath the staging dir.
        let seen = as_nobody(&["stat", "-c", "%a %u", &stage.display().to_string()]);
        assert!(seen.status.success(), "[{profile}] {seen:?}");
        let slot = stage.join("0");
        for target in [&stage, &slot] {
            let listed = as_nobody(&["ls", "-A", &target.display().to_string()]);
            assert!(
                !listed.status.success(),
                "[{profile}] nobody listed {}: {}",
                target.display(),
                String::from_utf8_lossy(&listed.stdout)
            );
            assert!(
                String::from_utf8_lossy(&listed.stderr).contains("Permission denied"),
                "[{profile}] {listed:?}"
            );
        }
        let st = std::fs::metadata(&stage).unwrap();
        assert_eq!(st.mode() & 0o7777, 0o770, "[{profile}]");
        assert_eq!(st.uid(), 0, "[{profile}] the daemon's");
        assert_ne!(st.gid(), 0, "[{profile}] the worker's group");
        assert_eq!(
            std::fs::metadata(&slot).unwrap().mode() & 0o777,
            0o755,
            "[{profile}] the worker opened its slot up"
        );
        std::fs::remove_file(&mark).unwrap();
        let r = pending.await.unwrap();
        assert!(!is_error(&r), "[{profile}] {r}");
        let said = d.read("h.txt").unwrap_or_default();
        assert!(
            said.starts_with("chmod of .: 1\n770 0 "),
            "[{profile}] the worker could not loosen the staging dir: {said}"
        );
        d.stop();
        d.assert_audit_verifies(&format!("[{profile}] an outsider and a staging dir"));
    }
}

/// Runs `script` with the `hs` tool in `session`, writing `out`, on a connection of its own
/// in the background: for a call that will pause.
async fn hs_in_background(
    d: &Daemon,
    session: &'static str,
    script: &'static str,
    out: &'static str,
) -> tokio::task::JoinHandle<serde_json::Value> {
    let c = d.client().await;
    tokio::spawn(async move {
        call(
            &c,
            "hs",
            json!({"session": session, "script": script, "out": out}),
        )
        .await
    })
}

/// A write worker's uid is leased to no other worker until its call is done with its
/// staging dirs (its outputs taken back, the dirs given back to the daemon): a later worker
/// under the same uid could otherwise open them up to someone else (chmod passes Landlock)
/// while the outputs are taken back. Publication is held before its seal (a failpoint pause)
/// while another session's call runs: that call gets another uid; once the held call is
/// done, its uid is free again.
#[tokio::test(flavor = "multi_thread")]
async fn a_write_workers_uid_is_not_leased_again_while_its_call_publishes() {
    require_root();
    let uid_of = |d: &Daemon, rel: &str| -> u32 {
        let text = d.read(rel).unwrap_or_else(|| panic!("{rel} missing"));
        text.trim()
            .parse()
            .unwrap_or_else(|_| panic!("{rel}: {text:?}"))
    };
    for profile in PROFILES {
        let mut d = daemon(profile);
        // A range and lease dir of its own: no other test's daemon holds one of its uids.
        let (_tmp, leases) = lease_dir();
        daemon_setting(
            &d,
            &format!(
                "worker_uids = \"63000-63063\"\nworker_uid_lock_dir = \"{}\"",
                leases.display()
            ),
        );
        // The second seal of the run: the held call's.
        let mark = d.pause_at_failpoint("publish.seal_output", 2);
        d.start();
        let c = d.client().await;
        session(&c, "a").await;
        session(&c, "b").await;
        let script = "id -u > \"$1\"";
        let r = call(
            &c,
            "hs",
            json!({"session": "a", "script": script, "out": "first.txt"}),
        )
        .await;
        assert!(!is_error(&r), "[{profile}] {r}");
        let first = uid_of(&d, "first.txt");
        let held = hs_in_background(&d, "a", script, "held.txt").await;
        wait_until("publication to pause before its seal", || mark.exists()).await;
        let jobs = d.job_dirs();
        assert_eq!(jobs.len(), 1, "[{profile}] {jobs:?}");
        let staged = format!("{}/stage/0/held.txt", jobs[0]);
        let held_uid = uid_of(&d, &staged);
        assert_eq!(
            held_uid, first,
            "[{profile}] the lowest free uid is leased first"
        );
        let r = call(
            &c,
            "hs",
            json!({"session": "b", "script": script, "out": "other.txt"}),
        )
        .await;
        assert!(!is_error(&r), "[{profile}] {r}");
        assert_ne!(
            uid_of(&d, "other.txt"),
            held_uid,
            "[{profile}] a worker got the uid of a call still taking its outputs back"
        );
        std::fs::remove_file(&mark).expect("resume");
        let r = held.await.expect("held call");
        assert!(!is_error(&r), "[{profile}] {r}");
        assert_eq!(uid_of(&d, "held.txt"), held_uid);
        // The fourth seal pauses too: let it go.
        let after = hs_in_background(&d, "b", script, "after.txt").await;
        wait_until("the next seal to pause", || mark.exists()).await;
        std::fs::remove_file(&mark).expect("resume");
        let r = after.await.expect("call after");
        assert!(!is_error(&r), "[{profile}] {r}");
        assert_eq!(
            uid_of(&d, "after.txt"),
            held_uid,
            "[{profile}] the uid is free again"
        );
        d.assert_audit_verifies(profile);
    }
}

// ---------------------------------------------------------------------------------------
// 6. Startup refuses a worker identity it cannot honour.

#[tokio::test]
async fn separate_workers_without_privilege_refuse_to_start() {
    require_root();
    let mut d = daemon("default");
    daemon_setting(&d, "worker_user = \"separate\"");
    as_nobody(&mut d);
    let status = d.try_start().expect_err("started without the capabilities");
    assert!(!status.success());
    let log = d.log_text();
    for cap in [
        "CAP_SETUID",
        "CAP_SETGID",
        "CAP_CHOWN",
        "CAP_FOWNER",
        "CAP_DAC_OVERRIDE",
        "CAP_KILL",
    ] {
        assert!(log.contains(cap), "{cap} not named:\n{log}");
    }
    assert!(log.contains("worker_user = \"separate\""), "{log}");
    assert!(!d.socket.exists(), "a socket was left");
}

/// Removes a user created by a test, on drop.
struct TempUser(String);

impl Drop for TempUser {
    fn drop(&mut self) {
        let _ = std::process::Command::new("userdel").arg(&self.0).status();
    }
}

#[tokio::test]
async fn a_worker_range_holding_an_account_refuses_to_start() {
    crate::harness::require_program("useradd", "passwd");
    require_root();
    let name = "airlock-h5-taken".to_string();
    let _ = std::process::Command::new("userdel").arg(&name).status();
    let st = std::process::Command::new("useradd")
        .args([
            "--system",
            "--no-create-home",
            "--uid",
            "62150",
            "--user-group",
            "--shell",
            "/usr/sbin/nologin",
        ])
        .arg(&name)
        .status()
        .expect("useradd");
    assert!(st.success(), "useradd {name} (uid 62150)");
    let _user = TempUser(name.clone());
    let mut d = daemon("default");
    daemon_setting(&d, "worker_uids = \"62100-62199\"");
    let status = d
        .try_start()
        .expect_err("started with an account in the range");
    assert!(!status.success());
    let log = d.log_text();
    assert!(
        log.contains("62100-62199") && log.contains("62150") && log.contains(&name),
        "{log}"
    );
    // The same range without the account is accepted.
    drop(_user);
    d.start();
    let c = d.client().await;
    session(&c, "h").await;
    let r = call(&c, "hs", json!({"session": "h", "script": "id -u"})).await;
    let u: u32 = text(&r).trim().parse().unwrap_or_else(|_| panic!("{r}"));
    assert!((62100..=62199).contains(&u), "{u}");
}

/// The third deployment: an unprivileged daemon holding the capabilities SECURITY.md lists
/// (as systemd's `AmbientCapabilities=` gives them) runs each worker under a uid of its own,
/// with no capability left to it; the published output belongs to the daemon's user; the
/// worker changes no metadata of the daemon's files; the daemon restarts and serves.
#[tokio::test]
async fn a_capable_unprivileged_daemon_gives_workers_their_own_uid() {
    use std::os::unix::fs::{MetadataExt, PermissionsExt};
    use std::time::Duration;
    require_root();
    for profile in ["default", "strict"] {
        let mut d = daemon(profile);
        as_nobody(&mut d);
        d.ambient_caps = Some("setuid,setgid,chown,fowner,dac_override,kill".into());
        daemon_setting(
            &d,
            "worker_user = \"separate\"\nworker_uids = \"62600-62663\"",
        );
        d.write("mine.txt", "daemon's");
        let root_mode = std::fs::metadata(&d.workspace)
            .expect("ws")
            .permissions()
            .mode();
        let mine_mode = std::fs::metadata(d.workspace.join("mine.txt"))
            .expect("mine")
            .permissions()
            .mode();
        d.start();
        let c = d.client().await;
        session(&c, "cap").await;
        let ws = d.workspace.display().to_string();
        let script = format!(
            "grep -E '^(Uid|Gid|CapEff|CapPrm|CapAmb):' /proc/self/status > \"$1\"; \
             chmod 000 {ws} 2>/dev/null; chmod 666 {ws}/mine.txt 2>/dev/null; \
             touch -d 2000-01-01 {ws}/mine.txt 2>/dev/null; true"
        );
        let r = call(
            &c,
            "hs",
            json!({"session": "cap", "out": "who.txt", "script": script}),
        )
        .await;
        assert!(!is_error(&r), "[{profile}] {r}");
        let who = d.read("who.txt").expect("who.txt");
        let uid_line = who.lines().find(|l| l.starts_with("Uid:")).expect("Uid");
        let uids: Vec<u32> = uid_line[4..]
            .split_whitespace()
            .map(|u| u.parse().expect("uid"))
            .collect();
        assert!(
            uids.iter().all(|u| (62600..=62663).contains(u)),
            "[{profile}] the worker ran as {uids:?}: {who}"
        );
        for cap in ["CapEff:", "CapPrm:", "CapAmb:"] {
            let line = who.lines().find(|l| l.starts_with(cap)).expect(cap);
            assert!(line.ends_with("0000000000000000"), "[{profile}] {line}");
        }
        let meta = std::fs::metadata(d.workspace.join("who.txt")).expect("who.txt");
        assert_eq!(
            (meta.uid(), meta.gid()),
            (65534, 65534),
            "[{profile}] owner"
        );
        assert_eq!(
            meta.permissions().mode() & 0o7777,
            0o644,
            "[{profile}] mode"
        );
        assert_eq!(
            std::fs::metadata(&d.workspace)
                .expect("ws")
                .permissions()
                .mode(),
            root_mode,
            "[{profile}] the workspace root's mode changed"
        );
        let mine = std::fs::metadata(d.workspace.join("mine.txt")).expect("mine");
        assert_eq!(
            mine.permissions().mode(),
            mine_mode,
            "[{profile}] mine.txt's mode"
        );
        assert!(
            mine.modified().expect("mtime") > UNIX_EPOCH + Duration::from_secs(1_000_000_000),
            "[{profile}] mine.txt's mtime was set back"
        );
        assert!(
            d.log_text()
                .contains("workers run as separate uids, one per worker"),
            "{}",
            d.log_text()
        );
        drop(c);
        assert!(d.stop().success());
        d.start();
        let c = d.client().await;
        let r = call(
            &c,
            "hs",
            json!({"session": "cap", "out": "after.txt", "script": "echo after > \"$1\""}),
        )
        .await;
        assert!(!is_error(&r), "[{profile}] after restart: {r}");
        assert_eq!(d.read("after.txt").as_deref(), Some("after\n"));
    }
}

/// With worker uids, a workspace under a directory other users cannot search (a checkout
/// under `/root`, mode 0700) is served: workers, under uids of their own and never 0, start
/// in their working directory and are handed paths relative to it. The daemon says so once.
/// A workspace that is itself unsearchable is refused before anything is created, naming
/// the flag and the file that hold the fix.
async fn a_workspace_under_an_unsearchable_directory(profile: &str) {
    use std::os::unix::fs::PermissionsExt;
    require_root();
    let mut d = daemon(profile);
    d.add_tool(
        "hr",
        &format!(
            r#"name = "hr"
description = "Run a shell script reading a file (test only)"
capability = "read"
profile = "{profile}"
command = ["/bin/sh", "-c", "{{script}}", "hr", "{{input}}"]
timeout = "60s"
[params.script]
type = "string"
[params.input]
type = "string"
path = "input"
"#
        ),
    );
    let hidden = d.dir.path().join("hidden");
    std::fs::create_dir(&hidden).expect("mkdir");
    std::fs::set_permissions(&hidden, std::fs::Permissions::from_mode(0o700)).expect("chmod");
    d.workspace = hidden.join("ws");
    d.state = hidden.join("state");

    // The workspace itself unsearchable: refused, nothing created.
    std::fs::create_dir(&d.workspace).expect("mkdir ws");
    std::fs::set_permissions(&d.workspace, std::fs::Permissions::from_mode(0o700)).expect("chmod");
    let status = d
        .try_start()
        .expect_err("started with a workspace workers cannot enter");
    assert!(!status.success());
    let log = d.log_text();
    assert!(
        log.contains("is not searchable by other users (mode 0700)"),
        "{log}"
    );
    assert!(log.contains(&d.workspace.display().to_string()), "{log}");
    assert!(log.contains("--workspace"), "{log}");
    assert!(
        log.contains(&d.policies.join("airlock.toml").display().to_string()),
        "{log}"
    );
    // A root daemon never offers its own uid to workers: that would be uid 0.
    assert!(!log.contains("worker_user = \"daemon\""), "{log}");
    assert!(log.contains("a worker never runs as uid 0"), "{log}");
    assert!(!d.state.exists(), "the refusal created the state dir");
    assert!(!d.socket.exists(), "the refusal bound the socket");
    assert_eq!(std::fs::read_dir(&d.workspace).expect("ls").count(), 0);
    std::fs::remove_dir(&d.workspace).expect("rmdir ws");

    // Only the parent unsearchable: served, from the workers' working directories.
    d.start();
    let log = d.log_text();
    assert!(
        log.contains("workers run as separate uids, one per worker, from"),
        "{log}"
    );
    assert!(
        log.contains(&format!(
            "workers are handed paths relative to their working directory (the workspace for \
             a read tool, the staging dir for a write tool), since {} is not searchable by \
             other users (mode 0700)",
            hidden.display()
        )),
        "{log}"
    );
    assert_eq!(
        std::fs::metadata(&hidden)
            .expect("stat")
            .permissions()
            .mode()
            & 0o7777,
        0o700,
        "the daemon opened up the directory above the workspace"
    );
    let c = d.client().await;
    session(&c, "r").await;
    let r = call(
        &c,
        "write_text",
        json!({"session": "r", "text": "reached", "out": "w.txt"}),
    )
    .await;
    assert!(!is_error(&r), "{r}");
    assert_eq!(d.read("w.txt").as_deref(), Some("reached"));
    // A write tool reads an input and writes an output, both by relative path.
    std::fs::create_dir(d.workspace.join("docs")).expect("mkdir docs");
    d.write("docs/in.txt", "shout");
    let r = call(
        &c,
        "upper",
        json!({"session": "r", "source": "docs/in.txt", "out": "docs/up.txt"}),
    )
    .await;
    assert!(!is_error(&r), "{r}");
    assert_eq!(d.read("docs/up.txt").as_deref(), Some("SHOUT"));
    // The shipped archive tool, which names its output and its input from two directories.
    let r = call(
        &c,
        "archive",
        json!({"session": "r", "source": "docs", "out": "docs.tar"}),
    )
    .await;
    assert!(!is_error(&r), "{r}");
    let listed = std::process::Command::new("tar")
        .arg("-tf")
        .arg(d.workspace.join("docs.tar"))
        .output()
        .expect("tar -t");
    let mut names: Vec<String> = String::from_utf8_lossy(&listed.stdout)
        .lines()
        .map(str::to_string)
        .collect();
    names.sort();
    assert_eq!(names, ["docs/", "docs/in.txt", "docs/up.txt"]);
    // What the worker was handed and where it stood, under its own uid.
    let r = call(
        &c,
        "hp",
        json!({"session": "r", "out": "o.txt", "input": "docs/in.txt", "code":
            "import os, sys; open(sys.argv[1], 'w').write(' '.join([str(os.getuid()), \
             sys.argv[1], sys.argv[2], os.path.basename(os.getcwd()), open(sys.argv[2]).read()]))"}),
    )
    .await;
    assert!(!is_error(&r), "{r}");
    let seen = d.read("o.txt").expect("o.txt");
    let parts: Vec<&str> = seen.split(' ').collect();
    let uid: u32 = parts[0].parse().expect("a uid");
    assert_ne!(uid, 0, "a worker ran as uid 0");
    assert!((60600..=61099).contains(&uid), "worker uid {uid}");
    assert_eq!(
        &parts[1..],
        ["./0/o.txt", "../../docs/in.txt", "stage", "shout"]
    );
    // A read tool stands in the workspace.
    let r = call(
        &c,
        "hr",
        json!({"input": "docs/in.txt", "script": "printf '%s %s ' \"$1\" \"$(id -u)\"; cat -- \"$1\""}),
    )
    .await;
    assert!(!is_error(&r), "{r}");
    let out = text(&r);
    assert!(out.starts_with("./docs/in.txt "), "{out}");
    assert!(out.ends_with(" shout"), "{out}");
    assert!(!out.contains(" 0 "), "a read worker ran as uid 0: {out}");
    // What the worker may not reach, it still may not: outside the workspace, by `..`.
    std::fs::write(hidden.join("secret"), "no").expect("write secret");
    let r = call(
        &c,
        "hs",
        json!({"session": "r", "out": "x.txt", "script": "cat ../../../secret > \"$1\""}),
    )
    .await;
    assert!(is_error(&r), "a worker read above the workspace: {r}");
    assert_eq!(d.read("x.txt"), None);
    // Nothing left behind: no job dir, and the audit chain verifies.
    assert!(d.job_dirs().is_empty(), "{:?}", d.job_dirs());
    d.stop();
    d.assert_audit_verifies("uid separation");
}

#[tokio::test]
async fn a_workspace_under_an_unsearchable_directory_is_served_default_profile() {
    a_workspace_under_an_unsearchable_directory("default").await;
}

#[tokio::test]
async fn a_workspace_under_an_unsearchable_directory_is_served_strict_profile() {
    a_workspace_under_an_unsearchable_directory("strict").await;
}

// ---------------------------------------------------------------------------------------
// 7. Worker uid leases are host-wide, and only privilege can take them.

/// A uid no account, no test daemon and no worker range uses: the hostile local user.
const HOSTILE_UID: u32 = 62990;

/// A lease dir of the test's own, `<root-owned 0755 tmp dir>/uids`, not yet made (the daemon
/// makes it), outside the daemon's dir so that `give_to_nobody` leaves it root's.
fn lease_dir() -> (tempfile::TempDir, PathBuf) {
    use std::os::unix::fs::PermissionsExt;
    let tmp = tempfile::tempdir().expect("tempdir");
    std::fs::set_permissions(tmp.path(), std::fs::Permissions::from_mode(0o755)).expect("chmod");
    let dir = tmp.path().join("uids");
    (tmp, dir)
}

/// `argv` run as [`HOSTILE_UID`] (no groups, no capabilities).
fn as_hostile(argv: &[&str]) -> std::process::Command {
    crate::harness::require_program("setpriv", "util-linux");
    let mut c = std::process::Command::new("setpriv");
    c.args([
        format!("--reuid={HOSTILE_UID}"),
        format!("--regid={HOSTILE_UID}"),
        "--clear-groups".into(),
        "--inh-caps=-all".into(),
        "--bounding-set=-all".into(),
        "--".into(),
    ])
    .args(argv);
    c
}

/// Every entry of the lease dir: name, owner, mode (with the file type bits), regular file.
fn lease_entries(dir: &Path) -> Vec<(String, u32, u32, bool)> {
    let mut v: Vec<_> = std::fs::read_dir(dir)
        .unwrap_or_else(|e| panic!("{}: {e}", dir.display()))
        .flatten()
        .map(|e| {
            let m = std::fs::symlink_metadata(e.path()).expect("lstat");
            (
                e.file_name().to_string_lossy().into_owned(),
                m.uid(),
                m.mode(),
                m.file_type().is_file(),
            )
        })
        .collect();
    v.sort();
    v
}

/// The hostile user's attempt at every lease of `first..=last` in `dir`: binds the abstract
/// names the leases once were, then tries to create, open (read-only too) and flock each
/// lease file, and to make a directory, a symlink and a FIFO in the dir; prints what it got
/// as one JSON line and holds all of it until its stdin closes.
const TAKE_EVERY_LEASE: &str = r#"
import errno, fcntl, json, os, socket, sys
d, first, last = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
got = {"bound": [], "created": [], "opened": [], "locked": [], "made": [],
       "errors": {"created": [], "opened": [], "made": []}}
held = []
for u in range(first, last + 1):
    s = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
    try:
        s.bind("\0airlock-worker-uid-%d" % u)
        got["bound"].append(u)
        held.append(s)
    except OSError:
        pass
    p = os.path.join(d, str(u))
    for flags, key in ((os.O_RDWR | os.O_CREAT, "created"), (os.O_RDONLY, "opened")):
        try:
            fd = os.open(p, flags, 0o666)
        except OSError as e:
            got["errors"][key].append(errno.errorcode[e.errno])
            continue
        got[key].append(u)
        held.append(fd)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            got["locked"].append(u)
        except OSError:
            pass
for name, make in (("dir", os.mkdir), ("link", lambda p: os.symlink("/tmp", p)), ("fifo", os.mkfifo)):
    try:
        make(os.path.join(d, "x-" + name))
        got["made"].append(name)
    except OSError as e:
        got["errors"]["made"].append(errno.errorcode[e.errno])
print(json.dumps(got), flush=True)
sys.stdin.read()
"#;

/// An unprivileged local user with no grant and no access to the socket tries to take every
/// worker uid lease: it can still bind every abstract socket name the leases once were, but
/// it can neither create, nor open (even read-only), nor so lock a lease file, nor make
/// anything in the lease dir; while it holds all it got, an external tool call of the daemon
/// runs under a uid of the range, whose lease file is the daemon's, 0600. As root and as a
/// capable `nobody` daemon.
#[tokio::test]
async fn an_unprivileged_user_cannot_take_the_worker_uid_leases() {
    use std::io::{BufRead, BufReader};
    use std::process::Stdio;
    require_root();
    for (profile, nobody) in [("default", false), ("strict", false), ("default", true)] {
        let ctx = format!("[{profile}, nobody={nobody}]");
        let mut d = daemon(profile);
        let (_tmp, leases) = lease_dir();
        daemon_setting(
            &d,
            &format!(
                "worker_user = \"separate\"\nworker_uids = \"62900-62903\"\n\
                 max_concurrent_calls = 4\nworker_uid_lock_dir = \"{}\"",
                leases.display()
            ),
        );
        let owner = if nobody {
            as_nobody(&mut d);
            d.ambient_caps = Some("setuid,setgid,chown,fowner,dac_override,kill".into());
            65534
        } else {
            0
        };
        d.start();
        let c = d.client().await;
        session(&c, "h").await;
        // One lease file exists before the attempt (the first call's), the others do not.
        let r = call(&c, "hs", json!({"session": "h", "script": "id -u"})).await;
        assert_eq!(text(&r).trim(), "62900", "{ctx} {r}");
        let mut hostile = as_hostile(&[
            "/usr/bin/python3",
            "-c",
            TAKE_EVERY_LEASE,
            &leases.display().to_string(),
            "62900",
            "62903",
        ])
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .spawn()
        .expect("setpriv");
        let mut line = String::new();
        BufReader::new(hostile.stdout.take().expect("stdout"))
            .read_line(&mut line)
            .expect("hostile report");
        let got: serde_json::Value =
            serde_json::from_str(&line).unwrap_or_else(|e| panic!("{ctx} {line:?}: {e}"));
        assert_eq!(
            got["bound"],
            json!([62900, 62901, 62902, 62903]),
            "{ctx} the old abstract names are anyone's to bind: {got}"
        );
        for key in ["created", "opened", "locked", "made"] {
            assert_eq!(got[key], json!([]), "{ctx} the hostile user {key}: {got}");
        }
        // Denied by permissions, not by chance: the lease file that exists (62900) cannot
        // be opened even read-only; the others cannot be created.
        assert_eq!(
            got["errors"],
            json!({
                "created": ["EACCES", "EACCES", "EACCES", "EACCES"],
                "opened": ["EACCES", "ENOENT", "ENOENT", "ENOENT"],
                "made": ["EACCES", "EACCES", "EACCES"],
            }),
            "{ctx} {got}"
        );
        assert!(
            abstract_sockets().contains(&"@airlock-worker-uid-62901".to_string()),
            "{ctx} the hostile user does not hold the names"
        );
        // While the hostile user holds everything it got, calls run under worker uids.
        let mut ran = Vec::new();
        for _ in 0..2 {
            let r = call(&c, "hs", json!({"session": "h", "script": "id -u"})).await;
            assert!(!is_error(&r), "{ctx} {r}\n{}", d.log_text());
            let u: u32 = text(&r)
                .trim()
                .parse()
                .unwrap_or_else(|_| panic!("{ctx} {r}"));
            assert!((62900..=62903).contains(&u), "{ctx} {u}");
            ran.push(u);
        }
        drop(hostile.stdin.take());
        assert!(hostile.wait().expect("wait").success(), "{ctx}");
        // The lease dir holds lease files only, each the daemon's, 0600, none locked now.
        let m = std::fs::symlink_metadata(&leases).expect("lease dir");
        assert!(m.is_dir(), "{ctx}");
        assert_eq!(
            (m.uid(), m.mode() & 0o7777),
            (0, 0o755),
            "{ctx} the lease dir"
        );
        let entries = lease_entries(&leases);
        assert!(!entries.is_empty(), "{ctx}");
        for (name, uid, mode, file) in &entries {
            let n: u32 = name
                .parse()
                .unwrap_or_else(|_| panic!("{ctx} {name} in {entries:?}"));
            assert!((62900..=62903).contains(&n), "{ctx} {entries:?}");
            assert!(
                *file && *uid == owner && mode & 0o7777 == 0o600,
                "{ctx} {entries:?}"
            );
            assert!(
                !lease_locked(&leases.join(name)),
                "{ctx} {name} still locked"
            );
        }
        for u in &ran {
            assert!(
                entries.iter().any(|(n, ..)| n == &u.to_string()),
                "{ctx} no lease file for {u}"
            );
        }
        assert!(
            all_pids()
                .into_iter()
                .all(|p| !ruid(p).is_some_and(|u| (62900..=62903).contains(&u))),
            "{ctx} a worker outlived its call"
        );
        assert!(!d.log_text().contains("panicked"), "{ctx}");
    }
}

/// The net namespace of `pid`, as `/proc/PID/ns/net` names it.
fn net_ns(pid: u32) -> String {
    std::fs::read_link(format!("/proc/{pid}/ns/net"))
        .expect("ns/net")
        .display()
        .to_string()
}

/// Two daemons on one host, with different workspaces and state dirs, the same worker range
/// and lease dir, one of them in a network namespace of its own (where the abstract socket
/// names the leases once were are not shared): each runs a worker at once, under a
/// different uid. The namespaced daemon is killed, leaving its worker's background child,
/// and restarted: its startup sweep kills that child (its own record) and not the other
/// daemon's live worker, whose call then completes; both daemons serve after.
#[tokio::test]
async fn two_daemons_in_different_network_namespaces_lease_different_uids_and_spare_each_others_workers(
) {
    require_root();
    let (_tmp, leases) = lease_dir();
    let setting = format!(
        "worker_user = \"separate\"\nworker_uids = \"62920-62921\"\n\
         max_concurrent_calls = 2\nworker_uid_lock_dir = \"{}\"",
        leases.display()
    );
    let mut b = daemon("default");
    daemon_setting(&b, &setting);
    b.write("gate/.keep", "");
    b.start();
    let mut a = daemon("default");
    daemon_setting(&a, &setting);
    a.wrap = vec!["unshare".into(), "--net".into(), "--".into()];
    a.start();
    assert_ne!(
        net_ns(a.pid()),
        net_ns(b.pid()),
        "the daemons share a network namespace: this test would prove nothing"
    );
    let cb = b.client().await;
    session(&cb, "b").await;
    let ca = a.client().await;
    session(&ca, "a").await;
    // B's worker waits for a gate only the test opens.
    let marker_b = format!("35.{}", unique());
    let mut raw_b = b.raw();
    raw_b.initialize();
    raw_b.call(
        1,
        "hp",
        json!({"session": "b", "input": "gate", "code": format!(
            "import sys, subprocess\nprint(open('/proc/self/status').read())\nsubprocess.run(['/bin/sh', '-c', 'until [ -e \"$0/open\" ]; do sleep 0.05; done # {marker_b}', sys.argv[1]])\n"
        )}),
    );
    // Its leader (python) and the shell it runs, both naming the marker.
    wait_until("B's worker and its shell", || {
        processes_with(&marker_b).len() == 2
    })
    .await;
    let pids_b = processes_with(&marker_b);
    let uid_b = ruid(pids_b[0]).expect("uid of B's worker");
    // A's worker leaves a background child and blocks in its leader.
    let marker_a = format!("36.{}", unique());
    let leader_a = format!("37.{}", unique());
    let mut raw_a = a.raw();
    raw_a.initialize();
    raw_a.call(
        1,
        "hs",
        json!({"session": "a", "script": format!("sleep {marker_a} & exec sleep {leader_a}")}),
    );
    wait_for_exact(&format!("sleep {marker_a}")).await;
    wait_for_exact(&format!("sleep {leader_a}")).await;
    let uid_a = ruid(processes_with(&format!("sleep {marker_a}"))[0]).expect("uid of A's worker");
    assert!(
        (62920..=62921).contains(&uid_a) && (62920..=62921).contains(&uid_b) && uid_a != uid_b,
        "worker uids: A {uid_a}, B {uid_b}"
    );
    for u in [uid_a, uid_b] {
        assert!(
            lease_locked(&leases.join(u.to_string())),
            "uid {u} unlocked"
        );
    }
    // A dies; its leader dies with it, its background child does not.
    // (Its connection stays open: a closed one would cancel the call and end the worker.)
    drop(ca);
    a.kill9();
    drop(raw_a);
    wait_no_process(&leader_a).await;
    assert!(
        !processes_with(&marker_a).is_empty(),
        "A's background child died with A: this test would prove nothing"
    );
    a.start();
    let log_a = a.log_text();
    assert!(
        processes_with(&marker_a).is_empty(),
        "A's restart left its own leftover:\n{log_a}"
    );
    assert_eq!(
        processes_with(&marker_b),
        pids_b,
        "A's restart touched B's live worker:\n{log_a}"
    );
    for p in &pids_b {
        assert!(
            !log_a.contains(&format!("killed process {p} ")),
            "A claims B's worker:\n{log_a}"
        );
    }
    assert!(
        lease_locked(&leases.join(uid_b.to_string())),
        "B's lease was lost"
    );
    // B's call completes, under its uid; B's worker is then gone.
    std::fs::write(b.workspace.join("gate/open"), "").expect("open the gate");
    let r = raw_b.response(1);
    assert!(
        r["result"]["isError"] != json!(true),
        "{r}\n{}",
        b.log_text()
    );
    let t = r["result"]["content"][0]["text"].as_str().unwrap_or("");
    assert!(
        t.contains(&format!("Uid:\t{uid_b}\t{uid_b}\t{uid_b}\t{uid_b}")),
        "{r}"
    );
    wait_no_process(&marker_b).await;
    // Both serve on, under uids of the range.
    for d in [&a, &b] {
        let c = d.client().await;
        session(&c, "after").await;
        let r = call(&c, "hs", json!({"session": "after", "script": "id -u"})).await;
        let u: u32 = text(&r).trim().parse().unwrap_or_else(|_| panic!("{r}"));
        assert!((62920..=62921).contains(&u), "{u}");
    }
    assert!(a.job_dirs().is_empty() && b.job_dirs().is_empty());
    assert!(
        !a.log_text().contains("panicked") && !b.log_text().contains("panicked"),
        "{}\n{}",
        a.log_text(),
        b.log_text()
    );
}

/// A lease dir a daemon cannot trust is refused at startup with a message naming the path
/// and what is wrong, and nothing is made in it: made by a hostile user (who could then
/// create, open and lock every lease file), writable by others, a symlink, or beneath a
/// directory others can write. As root and as a capable `nobody` daemon.
#[tokio::test]
async fn an_unsafe_worker_uid_lock_dir_refuses_to_start() {
    use std::os::unix::fs::PermissionsExt;
    require_root();
    let chmod = |p: &Path, mode| {
        std::fs::set_permissions(p, std::fs::Permissions::from_mode(mode)).expect("chmod")
    };
    for nobody in [false, true] {
        // Made by the hostile user, in a sticky world-writable dir such as /tmp.
        let (tmp_hostile, hostile_dir) = lease_dir();
        chmod(tmp_hostile.path(), 0o1777);
        let st = as_hostile(&[
            "/bin/sh",
            "-c",
            "mkdir -m 0755 \"$0\" && : > \"$0/62940\"",
            &hostile_dir.display().to_string(),
        ])
        .status()
        .expect("setpriv");
        assert!(st.success(), "the hostile user could not make its dir");
        // Root's, writable by others.
        let (_tmp_open, open_dir) = lease_dir();
        std::fs::create_dir(&open_dir).expect("mkdir");
        chmod(&open_dir, 0o777);
        // A symlink to a good dir.
        let (tmp_link, good) = lease_dir();
        std::fs::create_dir(&good).expect("mkdir");
        let link = tmp_link.path().join("link");
        std::os::unix::fs::symlink(&good, &link).expect("symlink");
        // Beneath a group-writable, not sticky, dir.
        let (tmp_group, grouped) = lease_dir();
        chmod(tmp_group.path(), 0o775);
        let cases = [
            (
                &hostile_dir,
                hostile_dir.clone(),
                format!("is owned by uid {HOSTILE_UID}"),
            ),
            (
                &open_dir,
                open_dir.clone(),
                "is writable by group or others (mode 0777)".to_string(),
            ),
            (
                &link,
                link.clone(),
                "is a symlink or not a directory".to_string(),
            ),
            (
                &grouped,
                tmp_group.path().to_path_buf(),
                "is writable by group or others (mode 0775)".to_string(),
            ),
        ];
        for (dir, culprit, what) in cases {
            let ctx = format!("[nobody={nobody}, {}]", dir.display());
            let mut d = daemon("default");
            daemon_setting(
                &d,
                &format!(
                    "worker_user = \"separate\"\nworker_uids = \"62940-62943\"\n\
                     max_concurrent_calls = 4\nworker_uid_lock_dir = \"{}\"",
                    dir.display()
                ),
            );
            if nobody {
                as_nobody(&mut d);
                d.ambient_caps = Some("setuid,setgid,chown,fowner,dac_override,kill".into());
            }
            let before: Vec<_> = [&hostile_dir, &open_dir, &good]
                .iter()
                .map(|p| lease_entries(p))
                .collect();
            let status = d.try_start().expect_err("started with an unsafe lease dir");
            assert!(!status.success(), "{ctx}");
            let log = d.log_text();
            let want = format!(
                "worker_uid_lock_dir {}: {} {what}",
                dir.display(),
                culprit.display()
            );
            assert!(log.contains(&want), "{ctx} {want:?} not in:\n{log}");
            assert!(!d.socket.exists(), "{ctx} a socket was left");
            let after: Vec<_> = [&hostile_dir, &open_dir, &good]
                .iter()
                .map(|p| lease_entries(p))
                .collect();
            assert_eq!(after, before, "{ctx} something was made in a lease dir");
            assert!(!grouped.exists(), "{ctx} made beneath a group-writable dir");
            assert_eq!(
                std::fs::metadata(&hostile_dir).expect("hostile dir").uid(),
                HOSTILE_UID,
                "{ctx}"
            );
        }
        // The hostile user's file is still its, and the same settings with a safe dir serve.
        let (_tmp, safe) = lease_dir();
        let mut d = daemon("default");
        daemon_setting(
            &d,
            &format!(
                "worker_user = \"separate\"\nworker_uids = \"62940-62943\"\n\
                 max_concurrent_calls = 4\nworker_uid_lock_dir = \"{}\"",
                safe.display()
            ),
        );
        if nobody {
            as_nobody(&mut d);
            d.ambient_caps = Some("setuid,setgid,chown,fowner,dac_override,kill".into());
        }
        d.start();
        let c = d.client().await;
        session(&c, "h").await;
        let r = call(&c, "hs", json!({"session": "h", "script": "id -u"})).await;
        assert_eq!(text(&r).trim(), "62940", "[nobody={nobody}] {r}");
    }
}

/// The daemon's live worker templates (its children named `airlock-tmpl`).
fn templates_of(daemon: i32) -> Vec<i32> {
    processes_with("__airlock-spawner")
        .into_iter()
        .filter(|&p| {
            std::fs::read_to_string(format!("/proc/{p}/comm"))
                .is_ok_and(|c| c.trim() == "airlock-tmpl")
                && std::fs::read_to_string(format!("/proc/{p}/stat")).is_ok_and(|s| {
                    s.rsplit_once(')').is_some_and(|(_, rest)| {
                        let f: Vec<&str> = rest.split_whitespace().collect();
                        f.first() != Some(&"Z") && f.get(1) == Some(&daemon.to_string().as_str())
                    })
                })
        })
        .collect()
}

/// A worker sharing an unprivileged daemon's uid (no uid of its own to keep it off its
/// template) still cannot stop, kill or read its template (its environment, where its socket
/// leads): Landlock's scopes, under both shipped profiles. The template survives and forks the next worker.
#[tokio::test]
async fn a_template_is_out_of_reach_of_a_worker_sharing_its_uid() {
    require_root();
    for profile in ["default", "strict"] {
        let mut d = daemon(profile);
        as_nobody(&mut d);
        d.start();
        let c = d.client().await;
        session(&c, "h").await;
        write_and_check(&c, &d, "first.txt").await;
        // The attacking tool's profile has its template too.
        let r = call(&c, "hs", json!({"session": "h", "script": "true"})).await;
        assert!(!is_error(&r), "[{profile}] {r}");
        let daemon_pid = d.pid() as i32;
        wait_until("a worker template", || !templates_of(daemon_pid).is_empty()).await;
        let templates = templates_of(daemon_pid);
        for t in &templates {
            assert_eq!(
                ruid(*t),
                Some(65534),
                "[{profile}] the template runs as the daemon"
            );
            let r = call(
                &c,
                "hs",
                json!({"session": "h", "script": format!(
                    "kill -STOP {t} 2>&1; kill -KILL {t} 2>&1; cat /proc/{t}/environ >/dev/null 2>&1 || echo environ-denied; readlink /proc/{t}/fd/3 >/dev/null 2>&1 || echo fd-denied; echo end"
                )}),
            )
            .await;
            let out = text(&r);
            assert_eq!(
                out.matches("Operation not permitted").count(),
                2,
                "[{profile}] {r}"
            );
            assert!(
                out.contains("environ-denied") && out.contains("fd-denied"),
                "[{profile}] {r}"
            );
        }
        write_and_check(&c, &d, "after.txt").await;
        let after = templates_of(daemon_pid);
        assert!(
            templates.iter().all(|t| after.contains(t)),
            "[{profile}] a template was replaced: {templates:?} then {after:?}"
        );
    }
}
