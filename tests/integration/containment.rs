//! The second kernel layer: hostile tools against the seccomp `containment` filter
//! (every profile) and Landlock's exec and scope rules. Each behaviour runs under both
//! shipped profiles (`default`, `strict`) and with the daemon both as root and as `nobody`,
//! and asserts the errno, that nothing outside staging changed (content, mode, owner, mtime,
//! xattrs of sentinel files inside and outside the workspace, the workspace root, the
//! daemon's socket), that no IPC object and no process is left, and that the daemon still
//! serves and restarts.

use std::collections::BTreeMap;
use std::ffi::CString;
use std::os::unix::ffi::OsStrExt;
use std::os::unix::fs::{MetadataExt, PermissionsExt};
use std::path::{Path, PathBuf};

use serde_json::json;

use crate::harness::*;
use crate::sandbox::give_to_nobody;

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum User {
    Root,
    Nobody,
}

const USERS: [User; 2] = [User::Root, User::Nobody];
const PROFILES: [&str; 2] = ["default", "strict"];
const EPERM: i32 = libc::EPERM;

/// Everything of a file the worker must not change.
#[derive(Debug, Clone, PartialEq, Eq)]
struct Meta {
    content: Option<Vec<u8>>,
    mode: u32,
    uid: u32,
    gid: u32,
    /// None for directories (job dirs come and go in the workspace root).
    mtime_ns: Option<(i64, i64)>,
    xattrs: Vec<(String, Vec<u8>)>,
}

fn set_xattr(path: &Path, name: &str, value: &[u8]) {
    let c = CString::new(path.as_os_str().as_bytes()).expect("path");
    let n = CString::new(name).expect("name");
    // SAFETY: plain setxattr(2) on buffers we own.
    let r = unsafe {
        libc::setxattr(
            c.as_ptr(),
            n.as_ptr(),
            value.as_ptr().cast(),
            value.len(),
            0,
        )
    };
    assert_eq!(r, 0, "setxattr {} {name}", path.display());
}

fn meta(path: &Path) -> Meta {
    let m = std::fs::symlink_metadata(path).unwrap_or_else(|e| panic!("{}: {e}", path.display()));
    let ft = m.file_type();
    Meta {
        content: ft.is_file().then(|| std::fs::read(path).expect("read")),
        mode: m.mode(),
        uid: m.uid(),
        gid: m.gid(),
        mtime_ns: (!ft.is_dir()).then(|| (m.mtime(), m.mtime_nsec())),
        xattrs: xattrs(path),
    }
}

/// SysV IPC objects, as `(kind, id)` from /proc/sysvipc.
fn sysv_objects() -> Vec<(String, String)> {
    let mut out = Vec::new();
    for kind in ["shm", "msg", "sem"] {
        let text = std::fs::read_to_string(format!("/proc/sysvipc/{kind}")).unwrap_or_default();
        for line in text.lines().skip(1) {
            let cols: Vec<&str> = line.split_whitespace().collect();
            if cols.len() > 1 {
                out.push((kind.to_string(), format!("key {} id {}", cols[0], cols[1])));
            }
        }
    }
    out.sort();
    out
}

/// A daemon as `user`, with hostile python tools under both profiles and sentinel files.
struct Env {
    d: Daemon,
    c: Client,
    user: User,
    sentinels: Vec<PathBuf>,
    before: Vec<Meta>,
    workspace_before: Vec<(String, Vec<u8>)>,
    ipc_before: Vec<(String, String)>,
}

const TOOL: &str = r#"name = "hostile_PROFILE"
description = "Run hostile python code (test only)"
capability = "write"
profile = "PROFILE"
command = ["/usr/bin/python3", "-I", "-c", "{code}", "{input}", "{out}"]
timeout = "30s"
[params.code]
type = "string"
[params.input]
type = "string"
path = "input"
[params.out]
type = "string"
path = "output"
required = false
"#;

/// The prelude of every hostile script: `sc` makes a raw syscall and `t` a Python call, each
/// printing `name result errno`; `child` runs an exec attempt in a child, which prints nothing
/// if the exec succeeds (the test then finds its line missing).
const PRELUDE: &str = r#"
import ctypes, os, sys, struct, fcntl, socket
libc = ctypes.CDLL(None, use_errno=True)
libc.syscall.restype = ctypes.c_long
def say(name, r, e):
    os.write(1, f"{name} {r} {e}\n".encode())
def sc(name, nr, *args):
    ctypes.set_errno(0)
    conv = [ctypes.c_long(a) if isinstance(a, int) else a for a in args]
    r = libc.syscall(ctypes.c_long(nr), *conv)
    say(name, r, ctypes.get_errno() if r == -1 else 0)
    return r
def t(name, f):
    try:
        r = f()
        say(name, r if isinstance(r, int) and not isinstance(r, bool) else 0, 0)
        return r
    except OSError as ex:
        say(name, -1, ex.errno)
def child(name, f):
    pid = os.fork()
    if pid == 0:
        t(name, f)
        os._exit(0)
    os.waitpid(pid, 0)
INPUT = sys.argv[1]
OUT = sys.argv[2] if len(sys.argv) > 2 else None
"#;

impl Env {
    async fn new(user: User) -> Env {
        require_root();
        let mut d = Daemon::new();
        for p in PROFILES {
            d.add_tool(&format!("hostile_{p}"), &TOOL.replace("PROFILE", p));
        }
        d.write("input.txt", "declared input\n");
        d.write("sentinel.txt", "undeclared file\n");
        let outside = d.dir.path().join("outside.txt");
        std::fs::write(&outside, "outside the workspace\n").expect("outside");
        let root_owned = d.dir.path().join("root-owned.txt");
        std::fs::write(&root_owned, "root's\n").expect("root-owned");
        if user == User::Nobody {
            give_to_nobody(&d);
            d.user = Some((65534, 65534));
            std::os::unix::fs::chown(&root_owned, Some(0), Some(0)).expect("chown root");
        }
        let files = [
            d.workspace.join("input.txt"),
            d.workspace.join("sentinel.txt"),
            outside,
            root_owned,
        ];
        for f in &files {
            set_xattr(f, "user.airlock", b"sentinel");
        }
        let ipc_before = sysv_objects();
        d.start();
        let c = d.client().await;
        session(&c, "h").await;
        let mut sentinels = files.to_vec();
        sentinels.push(d.workspace.clone());
        sentinels.push(d.socket.clone());
        let before = sentinels.iter().map(|p| meta(p)).collect();
        let workspace_before = snapshot(&d.workspace);
        Env {
            d,
            c,
            user,
            sentinels,
            before,
            workspace_before,
            ipc_before,
        }
    }

    /// Runs `code` (after the prelude) under `profile`; the call must succeed. Returns the
    /// `name -> (result, errno)` lines and checks that no process of it is left.
    async fn run(
        &self,
        profile: &str,
        code: &str,
        out: Option<&str>,
    ) -> BTreeMap<String, (i64, i32)> {
        let marker = format!("containment-marker-{}", rand_tag());
        let script = format!("{PRELUDE}\n{code}\n# {marker}\n");
        let mut a = json!({"session": "h", "code": script, "input": "input.txt"});
        if let Some(o) = out {
            a["out"] = json!(o);
        }
        let r = call(&self.c, &format!("hostile_{profile}"), a).await;
        let ctx = format!("{:?} daemon, {profile} profile", self.user);
        assert!(!is_error(&r), "{ctx}: {r}");
        assert!(
            processes_with(&marker).is_empty(),
            "{ctx}: a process of the call outlived it"
        );
        assert!(self.d.job_dirs().is_empty(), "{ctx}: job dir left");
        parse(&text(&r))
    }

    fn ctx(&self, profile: &str) -> String {
        format!("{:?} daemon, {profile} profile", self.user)
    }

    /// Nothing outside staging changed, no IPC object is left, and the daemon serves and
    /// restarts. `outputs`: workspace files the calls declared and published.
    async fn finish(mut self, outputs: &[&str]) {
        let after: Vec<Meta> = self.sentinels.iter().map(|p| meta(p)).collect();
        for ((p, b), a) in self.sentinels.iter().zip(&self.before).zip(&after) {
            assert_eq!(b, a, "{:?} daemon: {} changed", self.user, p.display());
        }
        let keep = |s: &Vec<(String, Vec<u8>)>| {
            s.iter()
                .filter(|(n, _)| !outputs.iter().any(|o| n == o))
                .cloned()
                .collect::<Vec<_>>()
        };
        assert_eq!(
            keep(&snapshot(&self.d.workspace)),
            keep(&self.workspace_before),
            "{:?} daemon: the workspace changed",
            self.user
        );
        let ipc = sysv_objects();
        let new: Vec<_> = ipc
            .iter()
            .filter(|o| !self.ipc_before.contains(o))
            .collect();
        assert!(new.is_empty(), "SysV IPC objects left: {new:?}");
        let name = CString::new("/airlock-containment").expect("name");
        // SAFETY: mq_open(3) with a NUL-terminated name and no O_CREAT.
        let q = unsafe { libc::mq_open(name.as_ptr(), libc::O_RDONLY) };
        let errno = std::io::Error::last_os_error().raw_os_error();
        assert!(
            q == -1 && errno == Some(libc::ENOENT),
            "a POSIX message queue was left"
        );
        assert!(!Path::new("/dev/shm/airlock-containment").exists());

        // Still serving, then restarting on the same workspace.
        assert!(self
            .d
            .child
            .as_mut()
            .expect("running")
            .try_wait()
            .expect("wait")
            .is_none());
        let r = call(
            &self.c,
            "write_text",
            json!({"session": "h", "text": "after", "out": "after.txt"}),
        )
        .await;
        assert!(!is_error(&r), "{:?} daemon: {r}", self.user);
        assert_eq!(self.d.read("after.txt").as_deref(), Some("after"));
        drop(self.c);
        let status = self.d.stop();
        assert!(status.success(), "{status}");
        self.d.start();
        let c = self.d.client().await;
        let r = call(&c, "session_get", json!({"session": "h"})).await;
        assert!(!is_error(&r), "{:?} daemon after restart: {r}", self.user);
    }
}

fn rand_tag() -> String {
    use std::sync::atomic::{AtomicU32, Ordering};
    static N: AtomicU32 = AtomicU32::new(0);
    format!(
        "{}-{}",
        std::process::id(),
        N.fetch_add(1, Ordering::Relaxed)
    )
}

fn parse(out: &str) -> BTreeMap<String, (i64, i32)> {
    let mut m = BTreeMap::new();
    for line in out.lines() {
        let cols: Vec<&str> = line.split_whitespace().collect();
        if let [name, r, e] = cols[..] {
            if let (Ok(r), Ok(e)) = (r.parse(), e.parse()) {
                m.insert(name.to_string(), (r, e));
            }
        }
    }
    m
}

/// `name` failed with `errno`.
fn failed(m: &BTreeMap<String, (i64, i32)>, name: &str, errno: i32, ctx: &str) {
    match m.get(name) {
        Some(&(r, e)) => assert!(
            r == -1 && e == errno,
            "{ctx}: {name} returned {r} errno {e}, expected -1 errno {errno}; all: {m:?}"
        ),
        None => panic!("{ctx}: no result for {name} (did an exec succeed?); all: {m:?}"),
    }
}

/// `name` succeeded.
fn worked(m: &BTreeMap<String, (i64, i32)>, name: &str, ctx: &str) {
    match m.get(name) {
        Some(&(r, e)) => assert!(r >= 0 && e == 0, "{ctx}: {name} failed: {r} errno {e}"),
        None => panic!("{ctx}: no result for {name}; all: {m:?}"),
    }
}

#[tokio::test]
async fn namespaces_cannot_be_created_by_clone_or_clone3() {
    let flags = [
        ("NEWUSER", libc::CLONE_NEWUSER),
        ("NEWPID", libc::CLONE_NEWPID),
        ("NEWNET", libc::CLONE_NEWNET),
        ("NEWNS", libc::CLONE_NEWNS),
        ("NEWUTS", libc::CLONE_NEWUTS),
        ("NEWIPC", libc::CLONE_NEWIPC),
        ("NEWCGROUP", libc::CLONE_NEWCGROUP),
        ("NEWTIME", 0x80),
        (
            "ALL",
            libc::CLONE_NEWUSER | libc::CLONE_NEWPID | libc::CLONE_NEWNET | libc::CLONE_NEWNS,
        ),
    ];
    let mut code = String::new();
    for (name, flag) in flags {
        // Fork-like raw clone (no CLONE_VM, no new stack): a child that exists exits at once.
        code += &format!(
            "r = sc('clone_{name}', {nr}, {flags}, 0, 0, 0, 0)\nif r == 0: os._exit(0)\nif r > 0: os.waitpid(r, 0)\n",
            nr = libc::SYS_clone,
            flags = flag as u64 | libc::SIGCHLD as u64,
        );
    }
    // clone3(CLONE_NEWUSER): struct clone_args, 88 bytes; flags first, exit_signal fifth.
    code += &format!(
        "args = ctypes.create_string_buffer(struct.pack('11Q', {user}, 0, 0, 0, 17, 0, 0, 0, 0, 0, 0), 88)\nr = sc('clone3_NEWUSER', {nr}, args, 88)\nif r == 0: os._exit(0)\n",
        user = libc::CLONE_NEWUSER,
        nr = libc::SYS_clone3,
    );
    // Threads and fork still work (glibc's pthread_create falls back from clone3 to clone).
    code += &format!(
        "import threading\nbox = []\nth = threading.Thread(target=lambda: box.append(1)); th.start(); th.join()\nsay('thread', len(box) - 1, 0)\npid = os.fork()\nif pid == 0: os._exit(7)\nsay('fork', os.waitstatus_to_exitcode(os.waitpid(pid, 0)[1]) - 7, 0)\nr = sc('clone_plain', {nr}, {sigchld}, 0, 0, 0, 0)\nif r == 0: os._exit(0)\nos.waitpid(r, 0)\n",
        nr = libc::SYS_clone,
        sigchld = libc::SIGCHLD,
    );
    for user in USERS {
        let env = Env::new(user).await;
        for p in PROFILES {
            let m = env.run(p, &code, None).await;
            let ctx = env.ctx(p);
            for (name, _) in flags {
                failed(&m, &format!("clone_{name}"), EPERM, &ctx);
            }
            failed(&m, "clone3_NEWUSER", libc::ENOSYS, &ctx);
            for ok in ["thread", "fork", "clone_plain"] {
                worked(&m, ok, &ctx);
            }
        }
        env.finish(&[]).await;
    }
}

#[tokio::test]
async fn sysv_ipc_and_posix_message_queues_are_denied() {
    const KEY: i64 = 0x4149_4c4b;
    let creat = libc::IPC_CREAT as i64 | 0o600;
    let calls: Vec<(&str, i64, String)> = vec![
        ("shmget", libc::SYS_shmget, format!("{KEY}, 4096, {creat}")),
        ("shmat", libc::SYS_shmat, "0, 0, 0".into()),
        (
            "shmctl",
            libc::SYS_shmctl,
            format!("0, {}, 0", libc::IPC_RMID),
        ),
        ("shmdt", libc::SYS_shmdt, "0".into()),
        ("msgget", libc::SYS_msgget, format!("{KEY}, {creat}")),
        ("msgsnd", libc::SYS_msgsnd, "0, 0, 0, 0".into()),
        ("msgrcv", libc::SYS_msgrcv, "0, 0, 0, 0, 0".into()),
        (
            "msgctl",
            libc::SYS_msgctl,
            format!("0, {}, 0", libc::IPC_RMID),
        ),
        ("semget", libc::SYS_semget, format!("{KEY}, 1, {creat}")),
        ("semop", libc::SYS_semop, "0, 0, 0".into()),
        ("semtimedop", libc::SYS_semtimedop, "0, 0, 0, 0".into()),
        (
            "semctl",
            libc::SYS_semctl,
            format!("0, 0, {}", libc::IPC_RMID),
        ),
        (
            "mq_open",
            libc::SYS_mq_open,
            format!(
                "b'airlock-containment', {}, 0o600, 0",
                libc::O_CREAT | libc::O_RDWR
            ),
        ),
        (
            "mq_unlink",
            libc::SYS_mq_unlink,
            "b'airlock-containment'".into(),
        ),
        (
            "mq_timedsend",
            libc::SYS_mq_timedsend,
            "0, 0, 0, 0, 0".into(),
        ),
        (
            "mq_timedreceive",
            libc::SYS_mq_timedreceive,
            "0, 0, 0, 0, 0".into(),
        ),
        ("mq_notify", libc::SYS_mq_notify, "0, 0".into()),
        ("mq_getsetattr", libc::SYS_mq_getsetattr, "0, 0, 0".into()),
    ];
    let mut code = String::new();
    for (name, nr, args) in &calls {
        code += &format!("sc('{name}', {nr}, {args})\n");
    }
    // POSIX shared memory is a file in /dev/shm, out of Landlock's reach.
    code += "t('shm_open', lambda: os.open('/dev/shm/airlock-containment', os.O_CREAT | os.O_RDWR, 0o600))\n";
    for user in USERS {
        let env = Env::new(user).await;
        for p in PROFILES {
            let m = env.run(p, &code, None).await;
            let ctx = env.ctx(p);
            for (name, _, _) in &calls {
                failed(&m, name, EPERM, &ctx);
            }
            failed(&m, "shm_open", libc::EACCES, &ctx);
        }
        env.finish(&[]).await;
    }
}

#[tokio::test]
async fn memfd_and_execveat_cannot_run_foreign_code() {
    const MFD_CLOEXEC: u32 = 1;
    const MFD_NOEXEC_SEAL: u32 = 8;
    const MFD_EXEC: u32 = 0x10;
    let nr = libc::SYS_memfd_create;
    let execveat = libc::SYS_execveat;
    let code = format!(
        r#"
sc('memfd_plain', {nr}, b'x', 0)
sc('memfd_cloexec', {nr}, b'x', {MFD_CLOEXEC})
sc('memfd_exec', {nr}, b'x', {MFD_EXEC})
fd = sc('memfd_noexec_seal', {nr}, b'x', {sealed})
truebin = open('/bin/true', 'rb').read()
if fd >= 0:
    os.write(fd, truebin)
    t('memfd_fchmod_755', lambda: os.fchmod(fd, 0o755))
    child('memfd_execv_proc', lambda: os.execv(f'/proc/self/fd/{{fd}}', ['x']))
    argv = (ctypes.c_char_p * 2)(b'x', None)
    child('memfd_execveat', lambda: sc('memfd_execveat_raw', {execveat}, fd, b'', argv, argv, 0x1000) and None)
binfd = os.open('/bin/true', os.O_RDONLY)
argv = (ctypes.c_char_p * 2)(b'true', None)
child('bin_execveat', lambda: sc('bin_execveat_raw', {execveat}, binfd, b'', argv, argv, 0x1000) and None)
child('bin_fexecve', lambda: os.execve(binfd, ['true'], {{}}))
"#,
        sealed = MFD_NOEXEC_SEAL | MFD_CLOEXEC,
    );
    for user in USERS {
        let env = Env::new(user).await;
        for p in PROFILES {
            let m = env.run(p, &code, None).await;
            let ctx = env.ctx(p);
            for name in ["memfd_plain", "memfd_cloexec", "memfd_exec"] {
                failed(&m, name, EPERM, &ctx);
            }
            // Allowed only sealed non-executable: it can neither gain x nor be executed.
            worked(&m, "memfd_noexec_seal", &ctx);
            failed(&m, "memfd_fchmod_755", EPERM, &ctx);
            failed(&m, "memfd_execv_proc", libc::EACCES, &ctx);
            failed(&m, "memfd_execveat_raw", EPERM, &ctx);
            failed(&m, "bin_execveat_raw", EPERM, &ctx);
            // glibc's fexecve is execveat; with EPERM (not ENOSYS) there is no /proc fallback.
            failed(&m, "bin_fexecve", EPERM, &ctx);
        }
        env.finish(&[]).await;
    }
}

#[tokio::test]
async fn binaries_copied_into_staging_cannot_be_executed() {
    // The worker's cwd is its staging dir: a copy of /bin/true and a script, both mode 0755
    // from creation (no chmod needed), then exec attempts.
    let code = r#"
for name, data in (('copied-true', open('/bin/true', 'rb').read()), ('script.sh', b'#!/bin/sh\necho RAN\n')):
    fd = os.open(name, os.O_CREAT | os.O_WRONLY, 0o755)
    os.write(fd, data)
    os.close(fd)
    say('mode_' + name, os.stat(name).st_mode & 0o777, 0)
    child('exec_' + name, lambda: os.execv(os.path.abspath(name), [name]))
import subprocess
say('sh_runs_copy', subprocess.run(['/bin/sh', '-c', './copied-true'], stderr=subprocess.DEVNULL).returncode, 0)
"#;
    for user in USERS {
        let env = Env::new(user).await;
        for p in PROFILES {
            let m = env.run(p, code, None).await;
            let ctx = env.ctx(p);
            assert_eq!(m.get("mode_copied-true"), Some(&(0o755, 0)), "{ctx}: {m:?}");
            failed(&m, "exec_copied-true", libc::EACCES, &ctx);
            failed(&m, "exec_script.sh", libc::EACCES, &ctx);
            // The shell's "permission denied" exit status.
            assert_eq!(m.get("sh_runs_copy"), Some(&(126, 0)), "{ctx}: {m:?}");
        }
        env.finish(&[]).await;
    }
}

#[tokio::test]
async fn unix_sockets_are_unreachable_but_socketpair_works() {
    use std::os::linux::net::SocketAddrExt;
    use std::os::unix::net::{SocketAddr, UnixDatagram, UnixListener};
    for user in USERS {
        let env = Env::new(user).await;
        // Host sockets any user may connect to: only the sandbox stands in the way.
        let stream_path = env.d.dir.path().join("host-stream.sock");
        let dgram_path = env.d.dir.path().join("host-dgram.sock");
        let stream = UnixListener::bind(&stream_path).expect("bind stream");
        let dgram = UnixDatagram::bind(&dgram_path).expect("bind dgram");
        for p in [&stream_path, &dgram_path] {
            std::fs::set_permissions(p, std::fs::Permissions::from_mode(0o777)).expect("chmod");
        }
        stream.set_nonblocking(true).expect("nonblocking");
        dgram.set_nonblocking(true).expect("nonblocking");
        let abstract_name = format!("airlock-containment-{}", rand_tag());
        let addr = SocketAddr::from_abstract_name(abstract_name.as_bytes()).expect("abstract");
        let abstract_ = UnixListener::bind_addr(&addr).expect("bind abstract");
        abstract_.set_nonblocking(true).expect("nonblocking");
        let code = format!(
            r#"
A = socket.AF_UNIX
args = open('/proc/{pid}/cmdline', 'rb').read().split(b'\0')
daemon = args[args.index(b'--socket') + 1].decode()
say('found_daemon_socket', int(daemon == {daemon:?}), 0)
def connect(path, kind):
    s = socket.socket(A, kind)
    s.connect(path)
    s.send(b'{{"jsonrpc":"2.0","id":1,"method":"initialize"}}\n')
for kname, kind in (('stream', socket.SOCK_STREAM), ('dgram', socket.SOCK_DGRAM), ('seqpacket', socket.SOCK_SEQPACKET)):
    t('daemon_' + kname, lambda: connect(daemon, kind))
t('host_stream', lambda: connect({stream:?}, socket.SOCK_STREAM))
t('host_dgram', lambda: socket.socket(A, socket.SOCK_DGRAM).sendto(b'x', {dgram:?}))
t('abstract', lambda: connect('\0{abstract_name}', socket.SOCK_STREAM))
t('pair_dgram', lambda: socket.socketpair(A, socket.SOCK_DGRAM) and 0)
def pair(kind):
    a, b = socket.socketpair(A, kind)
    a.send(b'ping')
    assert b.recv(4) == b'ping'
    try:
        a.sendto(b'x', {dgram:?})
        say('pair_sendto_' + str(int(kind)), 0, 0)
    except OSError as e:
        say('pair_sendto_' + str(int(kind)), -1, e.errno)
    try:
        a.connect({dgram:?})
        say('pair_connect_' + str(int(kind)), 0, 0)
    except OSError as e:
        say('pair_connect_' + str(int(kind)), -1, e.errno)
t('pair_stream', lambda: pair(socket.SOCK_STREAM))
t('pair_seqpacket', lambda: pair(socket.SOCK_SEQPACKET))
"#,
            pid = env.d.pid(),
            daemon = env.d.socket.display().to_string(),
            stream = stream_path.display().to_string(),
            dgram = dgram_path.display().to_string(),
        );
        for p in PROFILES {
            let m = env.run(p, &code, None).await;
            let ctx = env.ctx(p);
            assert_eq!(m.get("found_daemon_socket"), Some(&(1, 0)), "{ctx}: {m:?}");
            for name in [
                "daemon_stream",
                "daemon_dgram",
                "daemon_seqpacket",
                "host_stream",
                "host_dgram",
                "abstract",
                "pair_dgram",
            ] {
                failed(&m, name, EPERM, &ctx);
            }
            worked(&m, "pair_stream", &ctx);
            worked(&m, "pair_seqpacket", &ctx);
            // Connected pairs cannot be pointed elsewhere (sendto/connect to the host datagram
            // socket, tried above): nothing arrives there.
            assert!(
                stream.accept().is_err(),
                "{ctx}: the host stream socket was reached"
            );
            assert!(
                dgram.recv(&mut [0u8; 64]).is_err(),
                "{ctx}: a datagram arrived"
            );
            assert!(
                abstract_.accept().is_err(),
                "{ctx}: the abstract socket was reached"
            );
        }
        drop((stream, dgram, abstract_));
        env.finish(&[]).await;
    }
}

#[tokio::test]
async fn setuid_setgid_and_sticky_modes_cannot_be_set() {
    let mknod = libc::SYS_mknodat;
    let code = format!(
        r#"
fd = os.open(OUT, os.O_CREAT | os.O_WRONLY, 0o755)
os.write(fd, open('/bin/true', 'rb').read())
for mode in (0o4777, 0o6755, 0o2755, 0o1755):
    t('chmod_%o' % mode, lambda: os.chmod(OUT, mode))
t('fchmod_4755', lambda: os.fchmod(fd, 0o4755))
sc('fchmodat2_4755', 452, -100, OUT.encode(), 0o4755, 0)
os.close(fd)
t('create_4755', lambda: os.open('created-suid', os.O_CREAT | os.O_WRONLY, 0o4755))
t('create_2755', lambda: os.open('created-sgid', os.O_CREAT | os.O_WRONLY, 0o2755))
t('tmpfile_6755', lambda: os.open('.', os.O_TMPFILE | os.O_WRONLY, 0o6755))
sc('mknod_4755', {mknod}, -100, b'mknod-suid', 0o100000 | 0o4755, 0)
for name in ('created-suid', 'created-sgid', 'mknod-suid'):
    say('exists_' + name, int(os.path.exists(name)), 0)
say('out_mode', os.stat(OUT).st_mode & 0o7777, 0)
"#
    );
    for user in USERS {
        let env = Env::new(user).await;
        for p in PROFILES {
            let out = format!("suid-{p}");
            let m = env.run(p, &code, Some(&out)).await;
            let ctx = env.ctx(p);
            for name in [
                "chmod_4777",
                "chmod_6755",
                "chmod_2755",
                "chmod_1755",
                "fchmod_4755",
                "fchmodat2_4755",
                "create_4755",
                "create_2755",
                "tmpfile_6755",
                "mknod_4755",
            ] {
                failed(&m, name, EPERM, &ctx);
            }
            for name in ["created-suid", "created-sgid", "mknod-suid"] {
                assert_eq!(
                    m.get(&format!("exists_{name}")),
                    Some(&(0, 0)),
                    "{ctx}: {m:?}"
                );
            }
            let mode = m
                .get("out_mode")
                .unwrap_or_else(|| panic!("{ctx}: {m:?}"))
                .0;
            assert_eq!(mode & 0o7000, 0, "{ctx}: staged mode {mode:o}");
            // What was published carries no special bit.
            let published = std::fs::metadata(env.d.workspace.join(&out)).expect("published");
            assert_eq!(
                published.mode() & 0o7000,
                0,
                "{ctx}: mode {:o}",
                published.mode()
            );
        }
        env.finish(&["suid-default", "suid-strict"]).await;
    }
}

/// Outside staging, nothing's mode or time changes: chmod of the daemon's socket, of the
/// workspace root (chmod 000 would stop every later call and the restart), of a file outside
/// the workspace; utimensat of an undeclared workspace file. With the daemon as `nobody` the
/// worker shares its uid, so seccomp denies every chmod and utime-family call; as root, the
/// same calls are denied today by the same rule (Worker::spawn passes shared_uid = true) and,
/// once workers get their own uid, by file permissions (EPERM: not the owner).
#[tokio::test]
async fn modes_and_times_outside_staging_cannot_change() {
    for user in USERS {
        let env = Env::new(user).await;
        let code = format!(
            r#"
t('chmod_socket_666', lambda: os.chmod({socket:?}, 0o666))
t('chmod_workspace_000', lambda: os.chmod({ws:?}, 0))
t('chmod_outside_777', lambda: os.chmod({outside:?}, 0o777))
t('chmod_root_owned_4777', lambda: os.chmod({root_owned:?}, 0o4777))
t('chmod_input_000', lambda: os.chmod(INPUT, 0))
t('utime_sentinel', lambda: os.utime({sentinel:?}, (0, 0)))
t('utime_input', lambda: os.utime(INPUT, (0, 0)))
t('utime_outside', lambda: os.utime({outside:?}, (0, 0)))
"#,
            socket = env.d.socket.display().to_string(),
            ws = env.d.workspace.display().to_string(),
            outside = env.d.dir.path().join("outside.txt").display().to_string(),
            root_owned = env
                .d
                .dir
                .path()
                .join("root-owned.txt")
                .display()
                .to_string(),
            sentinel = env.d.workspace.join("sentinel.txt").display().to_string(),
        );
        for p in PROFILES {
            let m = env.run(p, &code, None).await;
            let ctx = env.ctx(p);
            for name in [
                "chmod_socket_666",
                "chmod_workspace_000",
                "chmod_outside_777",
                "chmod_root_owned_4777",
                "chmod_input_000",
                "utime_sentinel",
                "utime_input",
                "utime_outside",
            ] {
                failed(&m, name, EPERM, &ctx);
            }
        }
        env.finish(&[]).await;
    }
}

#[tokio::test]
async fn owners_xattrs_and_inode_flags_of_the_input_cannot_change() {
    let code = r#"
fd = os.open(INPUT, os.O_RDONLY)
t('chown_root', lambda: os.chown(INPUT, 0, 0))
t('chown_group0', lambda: os.chown(INPUT, -1, 0))
t('chown_noop', lambda: os.chown(INPUT, -1, -1))
t('lchown', lambda: os.lchown(INPUT, -1, 0))
t('fchown', lambda: os.fchown(fd, -1, 0))
t('setxattr', lambda: os.setxattr(INPUT, 'user.pwned', b'1'))
t('fsetxattr', lambda: os.setxattr(fd, 'user.pwned', b'1'))
t('removexattr', lambda: os.removexattr(INPUT, 'user.airlock'))
t('fremovexattr', lambda: os.removexattr(fd, 'user.airlock'))
sc('setxattrat', 463, -100, INPUT.encode(), 0, b'user.pwned', 0, 0)
sc('removexattrat', 466, -100, INPUT.encode(), 0, b'user.airlock')
sc('file_setattr', 469, -100, INPUT.encode(), 0, 0, 0)
FS_IMMUTABLE = 0x10
t('ioctl_setflags', lambda: fcntl.ioctl(fd, 0x40086602, struct.pack('l', FS_IMMUTABLE)))
t('ioctl32_setflags', lambda: fcntl.ioctl(fd, 0x40046602, struct.pack('i', FS_IMMUTABLE)))
t('ioctl_fssetxattr', lambda: fcntl.ioctl(fd, 0x401c5820, struct.pack('IIIII8x', 0x8, 0, 0, 0, 0)))
"#;
    for user in USERS {
        let env = Env::new(user).await;
        for p in PROFILES {
            let m = env.run(p, code, None).await;
            let ctx = env.ctx(p);
            for name in [
                "chown_root",
                "chown_group0",
                "chown_noop",
                "lchown",
                "fchown",
                "setxattr",
                "fsetxattr",
                "removexattr",
                "fremovexattr",
                "setxattrat",
                "removexattrat",
                "file_setattr",
                "ioctl_setflags",
                "ioctl32_setflags",
                "ioctl_fssetxattr",
            ] {
                failed(&m, name, EPERM, &ctx);
            }
        }
        // finish() compares the input's owner, mode, mtime and xattrs (user.airlock kept,
        // no user.pwned), and lsattr-visible flags would show in a failed later write.
        let input = env.d.workspace.join("input.txt");
        assert!(
            std::fs::OpenOptions::new()
                .append(true)
                .open(&input)
                .is_ok(),
            "input became immutable"
        );
        env.finish(&[]).await;
    }
}

/// With its own uid (the lead's worker uid separation), a root daemon's worker may set plain
/// modes and times on its staged files; special bits stay denied. Fails while Worker::spawn
/// passes shared_uid = true for every daemon.
#[tokio::test]
async fn workers_with_their_own_uid_may_chmod_and_touch_staged_files() {
    let code = r#"
fd = os.open(OUT, os.O_CREAT | os.O_WRONLY, 0o644)
os.close(fd)
t('chmod_755', lambda: os.chmod(OUT, 0o755))
t('utime', lambda: os.utime(OUT, (1, 1)))
t('chmod_4755', lambda: os.chmod(OUT, 0o4755))
"#;
    let env = Env::new(User::Root).await;
    for p in PROFILES {
        let m = env.run(p, code, Some(&format!("own-{p}"))).await;
        let ctx = env.ctx(p);
        worked(&m, "chmod_755", &ctx);
        worked(&m, "utime", &ctx);
        failed(&m, "chmod_4755", EPERM, &ctx);
    }
    env.finish(&["own-default", "own-strict"]).await;
}

/// The honest limit of `unix_sockets`: listing one socket allows socket(AF_UNIX), and
/// Landlock (ABI <= 7) does not mediate connect() to a pathname, so an unlisted socket is
/// reachable too; abstract sockets stay out of reach (Landlock scope).
#[tokio::test]
async fn listing_a_unix_socket_allows_pathname_sockets_but_not_abstract_ones() {
    use std::os::linux::net::SocketAddrExt;
    use std::os::unix::fs::PermissionsExt;
    use std::os::unix::net::{SocketAddr, UnixListener};
    require_root();
    let mut d = Daemon::new();
    let listed = d.dir.path().join("listed.sock");
    let unlisted = d.dir.path().join("unlisted.sock");
    let default =
        std::fs::read_to_string(d.policies.join("profiles/default.toml")).expect("default");
    let with = default.replace(
        "unix_sockets = []",
        &format!("unix_sockets = [{:?}]", listed.display().to_string()),
    );
    assert_ne!(
        with, default,
        "default.toml has no `unix_sockets = []` line"
    );
    std::fs::write(d.policies.join("profiles/sockets.toml"), with).expect("profile");
    d.add_tool("hostile_sockets", &TOOL.replace("PROFILE", "sockets"));
    d.write("input.txt", "x");
    let a = UnixListener::bind(&listed).expect("bind");
    let b = UnixListener::bind(&unlisted).expect("bind");
    // World-writable, so that this test shows the seccomp/Landlock layer alone: a worker with
    // its own uid is kept from a socket it may not write by file permissions as well (the
    // daemon's own socket, 0600, below).
    for p in [&listed, &unlisted] {
        std::fs::set_permissions(p, std::fs::Permissions::from_mode(0o666)).expect("chmod");
    }
    let name = format!("airlock-containment-{}", rand_tag());
    let addr = SocketAddr::from_abstract_name(name.as_bytes()).expect("abstract");
    let abs = UnixListener::bind_addr(&addr).expect("bind abstract");
    abs.set_nonblocking(true).expect("nonblocking");
    d.start();
    let c = d.client().await;
    session(&c, "h").await;
    let code = format!(
        "{PRELUDE}\nfor n, p in (('listed', {l:?}), ('unlisted', {u:?}), ('daemon', {s:?}), ('abstract', '\\0{name}')):\n    t(n, lambda: socket.socket(socket.AF_UNIX).connect(p))\n",
        l = listed.display().to_string(),
        u = unlisted.display().to_string(),
        s = d.socket.display().to_string(),
    );
    let r = call(
        &c,
        "hostile_sockets",
        json!({"session": "h", "code": code, "input": "input.txt"}),
    )
    .await;
    assert!(!is_error(&r), "{r}");
    let m = parse(&text(&r));
    worked(&m, "listed", "sockets profile");
    worked(&m, "unlisted", "sockets profile");
    failed(&m, "abstract", EPERM, "sockets profile");
    // The daemon runs as root: the worker has a uid of its own, and the daemon's socket
    // (0600) is not its to connect to.
    failed(&m, "daemon", libc::EACCES, "sockets profile");
    assert!(a.accept().is_ok() && b.accept().is_ok());
    assert!(abs.accept().is_err());
}

/// Even where a profile lists the daemon's own socket and file permissions let the worker
/// connect (an unprivileged daemon whose workers keep its uid), the daemon refuses the
/// connection: the peer is in a live worker's process group. Nothing the worker sends is
/// served: no session is created.
#[tokio::test]
async fn the_daemon_refuses_mcp_connections_from_its_workers() {
    require_root();
    let mut d = Daemon::new();
    crate::sandbox::give_to_nobody(&d);
    d.user = Some((65534, 65534));
    let default =
        std::fs::read_to_string(d.policies.join("profiles/default.toml")).expect("default");
    let with = default.replace(
        "unix_sockets = []",
        &format!("unix_sockets = [{:?}]", d.socket.display().to_string()),
    );
    assert_ne!(
        with, default,
        "default.toml has no `unix_sockets = []` line"
    );
    std::fs::write(d.policies.join("profiles/sockets.toml"), with).expect("profile");
    d.add_tool("hostile_sockets", &TOOL.replace("PROFILE", "sockets"));
    d.write("input.txt", "x");
    d.start();
    let c = d.client().await;
    session(&c, "h").await;
    let code = format!(
        r#"import socket, json
s = socket.socket(socket.AF_UNIX)
s.connect({sock:?})
print("connected")
init = {{"jsonrpc": "2.0", "id": 1, "method": "initialize", "params": {{"protocolVersion": "2025-06-18", "capabilities": {{}}, "clientInfo": {{"name": "worker", "version": "0"}}}}}}
call = {{"jsonrpc": "2.0", "id": 2, "method": "tools/call", "params": {{"name": "session_create", "arguments": {{"id": "from-worker"}}}}}}
try:
    s.sendall((json.dumps(init) + "\n" + json.dumps({{"jsonrpc": "2.0", "method": "notifications/initialized"}}) + "\n" + json.dumps(call) + "\n").encode())
except OSError as e:
    print("send", e.errno)
s.settimeout(5)
try:
    print("reply", len(s.recv(65536)))
except OSError as e:
    print("recv", e.errno)
"#,
        sock = d.socket.display().to_string()
    );
    let r = call(
        &c,
        "hostile_sockets",
        json!({"session": "h", "code": code, "input": "input.txt"}),
    )
    .await;
    let out = text(&r);
    assert!(
        out.contains("connected"),
        "the worker could not even connect: {r}"
    );
    assert!(
        out.contains("reply 0") || out.contains("send ") || out.contains("recv "),
        "the daemon answered its worker: {r}"
    );
    let got = call(&c, "session_get", json!({"session": "from-worker"})).await;
    assert!(is_error(&got), "the worker created a session: {got}");
    assert!(
        d.log_text()
            .contains("refused an MCP connection from a worker process"),
        "{}",
        d.log_text()
    );
}
