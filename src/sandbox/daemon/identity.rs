//! Who a worker runs as.
//!
//! Landlock governs file contents and directory entries, not metadata: a worker that keeps
//! the daemon's uid may chmod, chown, touch or set xattrs on every file the daemon owns, the
//! daemon's socket and the workspace root included. The strongest answer is that workers do
//! not share the daemon's uid: each gets a uid and gid of its own from a reserved range
//! (`worker_uids`), like systemd's DynamicUser, held from spawn until its whole process
//! group is confirmed gone (then handed to the caller in `Outcome::lease`: a write call
//! keeps it until its staging dirs are gone or given back to the daemon). File permissions then protect everything the worker does not
//! own, and concurrent workers cannot touch each other's staging.
//!
//! Switching uids needs privilege: root, or an unprivileged daemon holding
//! [`NEEDED_CAPS`] (the systemd unit's `AmbientCapabilities=`). Without them, workers keep the
//! daemon's uid ([`Identities::Daemon`]) and seccomp forbids every metadata change instead.
//!
//! A uid is leased by an exclusive `flock` on `<worker_uid_lock_dir>/<uid>` ([`LeaseDir`]):
//! files, so every daemon on the host sees every lease whatever its network namespace, in a
//! directory that only root or the daemon's own uid can write, and each file mode 0600, so
//! no other unprivileged user can create, open, and so lock one in advance.

use std::collections::BTreeSet;
use std::os::fd::OwnedFd;
use std::path::{Component, Path, PathBuf};
use std::sync::{Arc, Mutex};

use rustix::fs::{FileType, FlockOperation, Mode, OFlags};
use rustix::io::Errno;

use caps::{CapSet, Capability};

use crate::policy::WorkerUser;

use super::accounts::{Accounts, Nss, Owner};

/// What an unprivileged daemon needs to run workers under their own uids: switch to them
/// (SETUID, SETGID), hand them their staging dir and take outputs back (CHOWN, FOWNER), read
/// and remove what they leave whatever its modes (DAC_OVERRIDE), and signal them (KILL).
pub const NEEDED_CAPS: &[Capability] = &[
    Capability::CAP_SETUID,
    Capability::CAP_SETGID,
    Capability::CAP_CHOWN,
    Capability::CAP_FOWNER,
    Capability::CAP_DAC_OVERRIDE,
    Capability::CAP_KILL,
];

#[derive(Debug, thiserror::Error)]
pub enum IdentityError {
    #[error(
        "worker_user = \"separate\" needs root or the capabilities {missing} (see SECURITY.md); \
         grant them or set worker_user = \"daemon\""
    )]
    Unprivileged { missing: String },
    #[error(
        "worker_uids {first}-{last}: {what} {id} is {name:?}; the range must be reserved for \
         airlock workers (no account or group may use it)"
    )]
    Taken {
        first: u32,
        last: u32,
        what: &'static str,
        id: u32,
        name: String,
    },
    #[error(
        "worker_uids {first}-{last} holds {size} ids, fewer than max_concurrent_calls ({needed})"
    )]
    TooSmall {
        first: u32,
        last: u32,
        size: u64,
        needed: usize,
    },
    #[error("worker_uids {first}-{last} contains the daemon's own uid {uid}")]
    OwnUid { first: u32, last: u32, uid: u32 },
    #[error("every worker uid of {first}-{last} is in use")]
    Exhausted { first: u32, last: u32 },
    #[error("cannot read the daemon's capabilities")]
    Caps(#[source] caps::errors::CapsError),
    #[error(
        "worker_uid_lock_dir {dir}: {path} {fault}; the worker uid leases must be in a \
         directory that only root or the daemon's uid {euid} can write, reached through no \
         symlink and no directory anyone else can write (see OPERATIONS.md)"
    )]
    LeaseDirUnsafe {
        dir: PathBuf,
        path: PathBuf,
        fault: LeaseDirFault,
        euid: u32,
    },
    #[error("worker_uid_lock_dir {dir}: cannot {op} {path}")]
    LeaseDirIo {
        dir: PathBuf,
        op: &'static str,
        path: PathBuf,
        source: std::io::Error,
    },
    #[error("cannot lease worker uid {uid}: cannot {op} {path}")]
    LeaseFile {
        uid: u32,
        op: &'static str,
        path: PathBuf,
        source: std::io::Error,
    },
}

impl IdentityError {
    fn taken(first: u32, last: u32, owner: Owner) -> IdentityError {
        IdentityError::Taken {
            first,
            last,
            what: owner.what,
            id: owner.id,
            name: owner.name,
        }
    }
}

/// What makes a lease directory (or a directory on the way to it) unsafe to lease uids in.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum LeaseDirFault {
    /// The configured path is relative.
    Relative,
    /// The path has a `..` component.
    DotDot,
    /// A symlink, or not a directory.
    NotDirectory,
    /// Owned by a uid other than root and the daemon's.
    Owner(u32),
    /// Writable by group or others (and, for a directory on the way, not sticky).
    Writable(u32),
}

impl std::fmt::Display for LeaseDirFault {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            LeaseDirFault::Relative => write!(f, "is not an absolute path"),
            LeaseDirFault::DotDot => write!(f, "has a \"..\" component"),
            LeaseDirFault::NotDirectory => write!(f, "is a symlink or not a directory"),
            LeaseDirFault::Owner(uid) => write!(f, "is owned by uid {uid}"),
            LeaseDirFault::Writable(mode) => {
                write!(f, "is writable by group or others (mode {mode:04o})")
            }
        }
    }
}

/// The daemon's choice of worker identities, made once at startup.
#[derive(Debug, Clone)]
pub enum Identities {
    /// Each worker leases a uid (and the gid of the same number) from the pool.
    Separate(Pool),
    /// Workers keep the daemon's uid and gid.
    Daemon,
}

impl Identities {
    /// Decides from the config and the daemon's privileges. `Auto` falls back to `Daemon`
    /// (with a warning) where `Separate` would fail for lack of privilege.
    /// `lock_dir`: where the uid leases are (`worker_uid_lock_dir`), opened and checked only
    /// when workers get uids of their own.
    pub fn detect(
        wanted: WorkerUser,
        range: (u32, u32),
        max_concurrent_calls: usize,
        lock_dir: &Path,
    ) -> Result<Identities, IdentityError> {
        Identities::detect_with(Arc::new(Nss), wanted, range, max_concurrent_calls, lock_dir)
    }

    /// [`Identities::detect`] against the account database `accounts`.
    pub fn detect_with(
        accounts: Arc<dyn Accounts>,
        wanted: WorkerUser,
        (first, last): (u32, u32),
        max_concurrent_calls: usize,
        lock_dir: &Path,
    ) -> Result<Identities, IdentityError> {
        if wanted == WorkerUser::Daemon {
            return Ok(Identities::Daemon);
        }
        let missing = missing_caps()?;
        if !missing.is_empty() {
            let missing = missing.join(", ");
            if wanted == WorkerUser::Separate {
                return Err(IdentityError::Unprivileged { missing });
            }
            tracing::warn!(
                "workers run under the daemon's own uid: worker_user = \"auto\" and the daemon \
                 lacks {missing}; seccomp forbids every metadata change instead; for a uid \
                 per worker, run it as root or grant those capabilities (SECURITY.md)"
            );
            return Ok(Identities::Daemon);
        }
        let size = u64::from(last - first) + 1;
        if size < max_concurrent_calls as u64 {
            return Err(IdentityError::TooSmall {
                first,
                last,
                size,
                needed: max_concurrent_calls,
            });
        }
        let me = rustix::process::getuid().as_raw();
        if (first..=last).contains(&me) {
            return Err(IdentityError::OwnUid {
                first,
                last,
                uid: me,
            });
        }
        // Every account and group NSS can list; the ids of the others are looked up one by
        // one before their first lease (`Pool::lease`).
        if let Some(owner) = accounts.first_enumerated_in(first, last) {
            return Err(IdentityError::taken(first, last, owner));
        }
        let dir = LeaseDir::open(lock_dir)?;
        Ok(Identities::Separate(Pool::with_accounts(
            first, last, dir, accounts,
        )))
    }

    /// A uid of its own for one worker, or `None` when workers keep the daemon's.
    pub fn lease(&self) -> Result<Option<Lease>, IdentityError> {
        match self {
            Identities::Daemon => Ok(None),
            Identities::Separate(pool) => pool.lease().map(Some),
        }
    }

    /// The uid leases, when workers get their own uids.
    pub fn pool(&self) -> Option<&Pool> {
        match self {
            Identities::Daemon => None,
            Identities::Separate(pool) => Some(pool),
        }
    }

    /// The reserved range, when workers get their own uids.
    pub fn range(&self) -> Option<(u32, u32)> {
        match self {
            Identities::Daemon => None,
            Identities::Separate(pool) => Some((pool.first, pool.last)),
        }
    }

    pub fn describe(&self) -> String {
        match self {
            Identities::Daemon => "the daemon's uid (metadata changes denied by seccomp)".into(),
            Identities::Separate(p) => format!(
                "separate uids, one per worker, from {}-{} (leases in {})",
                p.first,
                p.last,
                p.dir.path.display()
            ),
        }
    }
}

/// The capabilities of [`NEEDED_CAPS`] the daemon's effective set lacks.
fn missing_caps() -> Result<Vec<String>, IdentityError> {
    let effective = caps::read(None, CapSet::Effective).map_err(IdentityError::Caps)?;
    Ok(NEEDED_CAPS
        .iter()
        .filter(|c| !effective.contains(c))
        .map(|c| c.to_string())
        .collect())
}

/// The free uids of the reserved range, and where their leases are.
#[derive(Debug, Clone)]
pub struct Pool {
    first: u32,
    last: u32,
    dir: Arc<LeaseDir>,
    free: Arc<Mutex<BTreeSet<u32>>>,
    /// The account database, asked about each uid before its first lease.
    accounts: Arc<dyn Accounts>,
    /// The uids it has found free of any account and group.
    checked: Arc<Mutex<BTreeSet<u32>>>,
}

impl Pool {
    pub fn new(first: u32, last: u32, dir: LeaseDir) -> Pool {
        Pool::with_accounts(first, last, dir, Arc::new(Nss))
    }

    pub fn with_accounts(
        first: u32,
        last: u32,
        dir: LeaseDir,
        accounts: Arc<dyn Accounts>,
    ) -> Pool {
        Pool {
            first,
            last,
            dir: Arc::new(dir),
            free: Arc::new(Mutex::new((first..=last).collect())),
            accounts,
            checked: Arc::default(),
        }
    }

    /// The account or group that uses `uid`, looked up the first time only: once a uid is
    /// found free, it is not asked about again in this process.
    fn owner_of(&self, uid: u32) -> Option<Owner> {
        if self.lock_checked().contains(&uid) {
            return None;
        }
        let owner = self.accounts.owner_of(uid);
        if owner.is_none() {
            self.lock_checked().insert(uid);
        }
        owner
    }

    fn lock_checked(&self) -> std::sync::MutexGuard<'_, BTreeSet<u32>> {
        self.checked.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// The lowest free uid whose lease no other process holds. [`IdentityError::Exhausted`]
    /// when every uid is leased (the call slots make that impossible while the range is at
    /// least `max_concurrent_calls` long and no other daemon shares it); a lease file that
    /// cannot be locked is skipped, and its error returned if no uid could be had.
    fn lease(&self) -> Result<Lease, IdentityError> {
        let mut free = self.free.lock().unwrap_or_else(|p| p.into_inner());
        let mut failed = None;
        let mut found = None;
        let mut refused = Vec::new();
        for &uid in free.iter() {
            match self.dir.lock(uid) {
                Ok(Some(lock)) => {
                    if let Some(owner) = self.owner_of(uid) {
                        // Named after startup's pass, or by a source NSS cannot enumerate:
                        // never leased by this process.
                        let e = IdentityError::taken(self.first, self.last, owner);
                        tracing::error!("{}; uid {uid} is skipped", crate::report::chain(&e));
                        refused.push(uid);
                        failed = Some(e);
                        continue;
                    }
                    found = Some((uid, lock));
                    break;
                }
                Ok(None) => {}
                Err(e) => {
                    tracing::warn!("{}", crate::report::chain(&e));
                    failed.get_or_insert(e);
                }
            }
        }
        for uid in refused {
            free.remove(&uid);
        }
        let Some((uid, lock)) = found else {
            return Err(failed.unwrap_or(IdentityError::Exhausted {
                first: self.first,
                last: self.last,
            }));
        };
        free.remove(&uid);
        Ok(Lease {
            uid,
            _lock: lock,
            free: Arc::clone(&self.free),
        })
    }

    /// The lease of `uid` for the startup sweep, if no other process holds it: `Ok(None)`
    /// when one does (another daemon runs a worker under it right now).
    pub(crate) fn hold(&self, uid: u32) -> Result<Option<OwnedFd>, IdentityError> {
        self.dir.lock(uid)
    }

    /// Whether `uid` is in the reserved range.
    /// `(first, last)` of the range.
    pub(crate) fn bounds(&self) -> (u32, u32) {
        (self.first, self.last)
    }

    pub(crate) fn contains(&self, uid: u32) -> bool {
        (self.first..=self.last).contains(&uid)
    }
}

/// The directory of uid leases (`worker_uid_lock_dir`, `/run/airlock/uids` by default): one
/// file per uid, `<dir>/<uid>`, mode 0600, exclusively `flock`ed by the daemon that leases
/// it, released by the kernel when the descriptor closes, the daemon's death included.
/// `flock` works on files, so daemons in different network or mount-propagated namespaces
/// of one host see each other's leases (abstract socket names would be per network
/// namespace, and bindable by any user). Every directory from `/` to it is checked once, at
/// open: owned by root or the daemon's euid, no symlink, and writable by no one else (a
/// sticky directory on the way, such as `/tmp`, is allowed; the lease dir itself is not).
/// So no other unprivileged user can create a lease file, nor open one to lock it.
#[derive(Debug)]
pub struct LeaseDir {
    path: PathBuf,
    fd: OwnedFd,
}

impl LeaseDir {
    /// Opens `path`, creating what is missing of it (mode 0755 before the umask), checking
    /// every directory on the way.
    pub fn open(path: &Path) -> Result<LeaseDir, IdentityError> {
        let euid = rustix::process::geteuid().as_raw();
        let unsafe_at = |at: &Path, fault| IdentityError::LeaseDirUnsafe {
            dir: path.to_path_buf(),
            path: at.to_path_buf(),
            fault,
            euid,
        };
        let io = |op, at: &Path, e: Errno| IdentityError::LeaseDirIo {
            dir: path.to_path_buf(),
            op,
            path: at.to_path_buf(),
            source: e.into(),
        };
        if !path.is_absolute() {
            return Err(unsafe_at(path, LeaseDirFault::Relative));
        }
        let flags = OFlags::PATH | OFlags::DIRECTORY | OFlags::NOFOLLOW | OFlags::CLOEXEC;
        let root = Path::new("/");
        let mut fd =
            rustix::fs::open(root, flags, Mode::empty()).map_err(|e| io("open", root, e))?;
        check_dir(&fd, false).map_err(|(op, e)| match e {
            Ok(fault) => unsafe_at(root, fault),
            Err(errno) => io(op, root, errno),
        })?;
        let mut at = PathBuf::from("/");
        let names: Vec<_> = path.components().skip(1).collect();
        for (i, c) in names.iter().enumerate() {
            let name = match c {
                Component::Normal(n) => *n,
                Component::CurDir => continue,
                _ => return Err(unsafe_at(path, LeaseDirFault::DotDot)),
            };
            at.push(name);
            let next = match rustix::fs::openat(&fd, name, flags, Mode::empty()) {
                Err(Errno::NOENT) => {
                    match rustix::fs::mkdirat(&fd, name, Mode::from_raw_mode(0o755)) {
                        Ok(()) => give_to_root(&fd, name),
                        Err(Errno::EXIST) => {}
                        Err(e) => return Err(io("create", &at, e)),
                    }
                    rustix::fs::openat(&fd, name, flags, Mode::empty())
                }
                r => r,
            };
            let next = match next {
                Ok(next) => next,
                Err(Errno::NOTDIR | Errno::LOOP) => {
                    return Err(unsafe_at(&at, LeaseDirFault::NotDirectory))
                }
                Err(e) => return Err(io("open", &at, e)),
            };
            let last = i + 1 == names.len();
            check_dir(&next, last).map_err(|(op, e)| match e {
                Ok(fault) => unsafe_at(&at, fault),
                Err(errno) => io(op, &at, errno),
            })?;
            fd = next;
        }
        Ok(LeaseDir {
            path: path.to_path_buf(),
            fd,
        })
    }

    /// Locks `<dir>/<uid>` (creating it, 0600): `Ok(None)` if another descriptor holds it.
    fn lock(&self, uid: u32) -> Result<Option<OwnedFd>, IdentityError> {
        let name = uid.to_string();
        let err = |op, e: Errno| IdentityError::LeaseFile {
            uid,
            op,
            path: self.path.join(&name),
            source: e.into(),
        };
        // Close-on-exec, and the launcher closes every descriptor anyway: no worker holds it.
        let fd = rustix::fs::openat(
            &self.fd,
            name.as_str(),
            OFlags::RDWR | OFlags::CREATE | OFlags::NOFOLLOW | OFlags::CLOEXEC | OFlags::NONBLOCK,
            Mode::from_raw_mode(0o600),
        )
        .map_err(|e| err("open", e))?;
        let st = rustix::fs::fstat(&fd).map_err(|e| err("stat", e))?;
        if FileType::from_raw_mode(st.st_mode) != FileType::RegularFile {
            return Err(err("lock (not a regular file)", Errno::INVAL));
        }
        // Only a privileged process can have made it; still, no one else may open it.
        if st.st_mode & 0o077 != 0 {
            rustix::fs::fchmod(&fd, Mode::from_raw_mode(0o600)).map_err(|e| err("chmod", e))?;
        }
        match rustix::fs::flock(&fd, FlockOperation::NonBlockingLockExclusive) {
            Ok(()) => Ok(Some(fd)),
            Err(Errno::WOULDBLOCK) => Ok(None),
            Err(e) => Err(err("flock", e)),
        }
    }
}

/// Makes a directory [`LeaseDir::open`] just created root's, mode 0755 whatever the umask:
/// the same whichever daemon made it, so that every daemon (root, or another user holding
/// the capabilities) accepts it, and writable by privilege alone (CAP_DAC_OVERRIDE, which an
/// unprivileged daemon leasing uids holds). Best effort: without CAP_CHOWN it stays the
/// daemon's, which the checks accept too.
fn give_to_root(parent: &OwnedFd, name: &std::ffi::OsStr) {
    use rustix::fs::{AtFlags, Gid, Uid};
    let _ = rustix::fs::chownat(
        parent,
        name,
        Some(Uid::ROOT),
        Some(Gid::ROOT),
        AtFlags::SYMLINK_NOFOLLOW,
    );
    let _ = rustix::fs::chmodat(parent, name, Mode::from_raw_mode(0o755), AtFlags::empty());
}

/// Checks an opened directory: a directory, owned by root or the euid, writable by no one
/// else (`last`: the lease dir itself) or, on the way to it, unless sticky.
fn check_dir(fd: &OwnedFd, last: bool) -> Result<(), (&'static str, Result<LeaseDirFault, Errno>)> {
    let st = rustix::fs::fstat(fd).map_err(|e| ("stat", Err(e)))?;
    if FileType::from_raw_mode(st.st_mode) != FileType::Directory {
        return Err(("stat", Ok(LeaseDirFault::NotDirectory)));
    }
    let euid = rustix::process::geteuid().as_raw();
    if st.st_uid != 0 && st.st_uid != euid {
        return Err(("stat", Ok(LeaseDirFault::Owner(st.st_uid))));
    }
    let mode = st.st_mode & 0o7777;
    let sticky = mode & 0o1000 != 0;
    if mode & 0o022 != 0 && (last || !sticky) {
        return Err(("stat", Ok(LeaseDirFault::Writable(mode))));
    }
    Ok(())
}

/// One worker's uid and gid (the same number), returned to the pool when dropped, which the
/// worker does only once every process of its group is confirmed gone.
#[derive(Debug)]
pub struct Lease {
    uid: u32,
    _lock: OwnedFd,
    free: Arc<Mutex<BTreeSet<u32>>>,
}

impl Lease {
    pub fn uid(&self) -> u32 {
        self.uid
    }

    pub fn gid(&self) -> u32 {
        self.uid
    }
}

impl Drop for Lease {
    fn drop(&mut self) {
        let mut free = self.free.lock().unwrap_or_else(|p| p.into_inner());
        free.insert(self.uid);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A lease dir of the test's own, beneath a private temporary directory.
    fn lease_dir() -> (tempfile::TempDir, PathBuf) {
        let tmp = tempfile::tempdir().unwrap();
        let dir = tmp.path().join("uids");
        (tmp, dir)
    }

    /// Whether some open file description holds a `flock` on `path` (another one of this
    /// process counts: `flock` locks belong to open file descriptions).
    fn locked(path: &Path) -> bool {
        let f = std::fs::File::open(path).unwrap();
        match rustix::fs::flock(&f, FlockOperation::NonBlockingLockShared) {
            Ok(()) => false,
            Err(Errno::WOULDBLOCK) => true,
            Err(e) => panic!("flock {}: {e}", path.display()),
        }
    }

    #[test]
    fn leases_are_unique_and_come_back() {
        let (_tmp, dir) = lease_dir();
        let pool = Pool::new(70000, 70002, LeaseDir::open(&dir).unwrap());
        let a = pool.lease().unwrap();
        let b = pool.lease().unwrap();
        let c = pool.lease().unwrap();
        assert_eq!((a.uid(), b.uid(), c.uid()), (70000, 70001, 70002));
        assert!(matches!(
            pool.lease(),
            Err(IdentityError::Exhausted {
                first: 70000,
                last: 70002
            })
        ));
        assert!(locked(&dir.join("70001")));
        drop(b);
        assert!(!locked(&dir.join("70001")), "a dropped lease is unlocked");
        let d = pool.lease().unwrap();
        assert_eq!(d.uid(), 70001);
        assert_eq!(d.gid(), 70001);
    }

    #[test]
    fn a_uid_held_elsewhere_is_skipped() {
        // Another daemon (here: a second pool over the same lease dir) holds 70100.
        let (_tmp, dir) = lease_dir();
        let other = Pool::new(70100, 70101, LeaseDir::open(&dir).unwrap());
        let held = other.lease().unwrap();
        assert_eq!(held.uid(), 70100);
        let pool = Pool::new(70100, 70101, LeaseDir::open(&dir).unwrap());
        let a = pool.lease().unwrap();
        assert_eq!(a.uid(), 70101);
        assert!(pool.lease().is_err(), "70100 is held by the other pool");
        assert!(
            pool.hold(70100).unwrap().is_none(),
            "nor can the sweep take it"
        );
        drop(held);
        assert_eq!(pool.lease().unwrap().uid(), 70100);
    }

    #[test]
    fn lease_files_are_private_to_the_daemon() {
        use std::os::unix::fs::{MetadataExt, PermissionsExt};
        let (_tmp, dir) = lease_dir();
        let pool = Pool::new(70200, 70201, LeaseDir::open(&dir).unwrap());
        // A file some privileged tool left readable by others is made 0600 when leased.
        std::fs::write(dir.join("70201"), "").unwrap();
        std::fs::set_permissions(dir.join("70201"), std::fs::Permissions::from_mode(0o644))
            .unwrap();
        let a = pool.lease().unwrap();
        let b = pool.lease().unwrap();
        let euid = rustix::process::geteuid().as_raw();
        for l in [&a, &b] {
            let m = std::fs::metadata(dir.join(l.uid().to_string())).unwrap();
            assert_eq!(m.mode() & 0o7777, 0o600, "lease file of {}", l.uid());
            assert_eq!(m.uid(), euid);
        }
        let m = std::fs::metadata(&dir).unwrap();
        assert_eq!(m.uid(), euid);
        assert_eq!(m.mode() & 0o022, 0, "the lease dir is writable by others");
    }

    #[test]
    fn a_symlinked_lease_file_is_not_followed() {
        let (tmp, dir) = lease_dir();
        let pool = Pool::new(70300, 70300, LeaseDir::open(&dir).unwrap());
        let target = tmp.path().join("elsewhere");
        std::os::unix::fs::symlink(&target, dir.join("70300")).unwrap();
        let e = pool.lease().unwrap_err();
        assert!(
            matches!(e, IdentityError::LeaseFile { uid: 70300, .. }),
            "{e}"
        );
        assert!(!target.exists(), "the symlink was followed");
    }

    #[test]
    fn unsafe_lease_dirs_are_refused() {
        use std::os::unix::fs::PermissionsExt;
        let fault = |p: &Path| match LeaseDir::open(p) {
            Err(IdentityError::LeaseDirUnsafe { path, fault, .. }) => (path, fault),
            other => panic!("{}: {other:?}", p.display()),
        };
        assert_eq!(
            fault(Path::new("run/uids")),
            (PathBuf::from("run/uids"), LeaseDirFault::Relative)
        );
        let (tmp, dir) = lease_dir();
        std::fs::create_dir(&dir).unwrap();
        std::fs::set_permissions(&dir, std::fs::Permissions::from_mode(0o777)).unwrap();
        assert_eq!(fault(&dir), (dir.clone(), LeaseDirFault::Writable(0o777)));
        // Sticky does not make the lease dir itself acceptable...
        std::fs::set_permissions(&dir, std::fs::Permissions::from_mode(0o1777)).unwrap();
        assert_eq!(fault(&dir), (dir.clone(), LeaseDirFault::Writable(0o1777)));
        // ...but does a directory on the way (as /tmp is).
        std::fs::set_permissions(&dir, std::fs::Permissions::from_mode(0o755)).unwrap();
        std::fs::set_permissions(tmp.path(), std::fs::Permissions::from_mode(0o1777)).unwrap();
        assert!(LeaseDir::open(&dir).is_ok());
        // A group-writable directory on the way is refused.
        std::fs::set_permissions(tmp.path(), std::fs::Permissions::from_mode(0o775)).unwrap();
        assert_eq!(
            fault(&dir),
            (tmp.path().to_path_buf(), LeaseDirFault::Writable(0o775))
        );
        std::fs::set_permissions(tmp.path(), std::fs::Permissions::from_mode(0o700)).unwrap();
        let link = tmp.path().join("link");
        std::os::unix::fs::symlink(&dir, &link).unwrap();
        assert_eq!(fault(&link), (link.clone(), LeaseDirFault::NotDirectory));
        assert_eq!(
            fault(&link.join("uids")),
            (link.clone(), LeaseDirFault::NotDirectory)
        );
    }

    #[test]
    fn a_lease_dir_owned_by_another_user_is_refused() {
        use std::os::unix::fs::MetadataExt;
        assert!(
            rustix::process::geteuid().is_root(),
            "this test needs root (it chowns the lease dir to nobody)"
        );
        let (_tmp, dir) = lease_dir();
        std::fs::create_dir(&dir).unwrap();
        std::os::unix::fs::chown(&dir, Some(65534), Some(65534)).unwrap();
        let e = LeaseDir::open(&dir).unwrap_err();
        assert!(
            matches!(
                &e,
                IdentityError::LeaseDirUnsafe { path, fault: LeaseDirFault::Owner(65534), .. }
                    if path == &dir
            ),
            "{e}"
        );
        assert!(e.to_string().contains(&dir.display().to_string()), "{e}");
        assert_eq!(std::fs::metadata(&dir).unwrap().uid(), 65534);
        assert_eq!(
            std::fs::read_dir(&dir).unwrap().count(),
            0,
            "nothing made in it"
        );
    }

    #[test]
    fn daemon_identity_never_leases() {
        let ids = Identities::detect(
            WorkerUser::Daemon,
            (70000, 70100),
            4,
            Path::new("/nonexistent/uids"),
        )
        .unwrap();
        assert!(ids.lease().unwrap().is_none());
        assert!(ids.range().is_none());
    }

    #[test]
    fn small_ranges_are_refused_when_separate() {
        assert!(
            rustix::process::geteuid().is_root(),
            "this test needs root (it checks the privileged path)"
        );
        let (_tmp, dir) = lease_dir();
        let e = Identities::detect(WorkerUser::Separate, (70000, 70001), 64, &dir).unwrap_err();
        assert!(matches!(e, IdentityError::TooSmall { .. }), "{e}");
    }

    /// An account database of two ids: one every pass lists, one only a lookup finds (a
    /// directory service without enumeration); it records the ids it is asked about.
    #[derive(Debug, Default)]
    struct FakeAccounts {
        listed: Option<u32>,
        unlisted: Option<u32>,
        asked: Mutex<Vec<u32>>,
    }

    impl Accounts for FakeAccounts {
        fn first_enumerated_in(&self, first: u32, last: u32) -> Option<Owner> {
            let id = self.listed.filter(|id| (first..=last).contains(id))?;
            Some(Owner {
                what: "uid",
                id,
                name: "listed".into(),
            })
        }

        fn owner_of(&self, id: u32) -> Option<Owner> {
            self.asked.lock().unwrap().push(id);
            [self.listed, self.unlisted]
                .contains(&Some(id))
                .then(|| Owner {
                    what: "gid",
                    id,
                    name: "unlisted".into(),
                })
        }
    }

    #[test]
    fn a_range_an_enumerated_account_uses_is_refused_at_startup() {
        assert!(
            rustix::process::geteuid().is_root(),
            "this test needs root (it checks the privileged path)"
        );
        let (_tmp, dir) = lease_dir();
        let accounts = Arc::new(FakeAccounts {
            listed: Some(70003),
            ..FakeAccounts::default()
        });
        let e = Identities::detect_with(
            accounts.clone(),
            WorkerUser::Separate,
            (70000, 70007),
            4,
            &dir,
        )
        .unwrap_err();
        assert!(
            matches!(&e, IdentityError::Taken { what: "uid", id: 70003, name, .. } if name == "listed"),
            "{e}"
        );
        assert!(
            e.to_string()
                .contains("worker_uids 70000-70007: uid 70003 is \"listed\""),
            "{e}"
        );
        assert!(!dir.exists(), "no lease dir made for a refused range");
        // `auto` refuses it too: a taken range is a configuration fault, not a lack of
        // privilege to fall back from.
        assert!(Identities::detect_with(
            accounts.clone(),
            WorkerUser::Auto,
            (70000, 70007),
            4,
            &dir
        )
        .is_err());
        // Startup asked no id one by one.
        assert!(accounts.asked.lock().unwrap().is_empty());
    }

    #[test]
    fn a_uid_only_a_lookup_names_is_never_leased_and_each_uid_is_asked_about_once() {
        let (_tmp, dir) = lease_dir();
        let accounts = Arc::new(FakeAccounts {
            unlisted: Some(70401),
            ..FakeAccounts::default()
        });
        let pool = Pool::with_accounts(
            70400,
            70402,
            LeaseDir::open(&dir).unwrap(),
            accounts.clone(),
        );
        let a = pool.lease().unwrap();
        let b = pool.lease().unwrap();
        assert_eq!((a.uid, b.uid), (70400, 70402), "70401 skipped");
        assert!(matches!(pool.lease(), Err(IdentityError::Exhausted { .. })));
        drop((a, b));
        // Leased again, without asking again; the named uid stays out.
        let again = [pool.lease().unwrap(), pool.lease().unwrap()];
        assert_eq!(again.each_ref().map(|l| l.uid), [70400, 70402]);
        assert!(matches!(pool.lease(), Err(IdentityError::Exhausted { .. })));
        assert_eq!(*accounts.asked.lock().unwrap(), [70400, 70401, 70402]);
        // Where the named uid was the only one left, the error names it.
        let (_tmp, dir) = lease_dir();
        let pool = Pool::with_accounts(70401, 70401, LeaseDir::open(&dir).unwrap(), accounts);
        match pool.lease() {
            Err(
                e @ IdentityError::Taken {
                    id: 70401,
                    what: "gid",
                    ..
                },
            ) => {
                assert!(e.to_string().contains("gid 70401 is \"unlisted\""), "{e}")
            }
            Err(e) => panic!("{e}"),
            Ok(l) => panic!("leased {}", l.uid),
        }
    }
}
