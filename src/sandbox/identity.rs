//! Who a worker runs as.
//!
//! Landlock governs file contents and directory entries, not metadata: a worker that keeps
//! the daemon's uid may chmod, chown, touch or set xattrs on every file the daemon owns, the
//! daemon's socket and the workspace root included. The strongest answer is that workers do
//! not share the daemon's uid: each gets a uid and gid of its own from a reserved range
//! (`worker_uids`), like systemd's DynamicUser, held from spawn until its whole process
//! group is confirmed gone. File permissions then protect everything the worker does not
//! own, and concurrent workers cannot touch each other's staging.
//!
//! Switching uids needs privilege: root, or an unprivileged daemon holding
//! [`NEEDED_CAPS`] (the systemd unit's `AmbientCapabilities=`). Without them, workers keep the
//! daemon's uid ([`Identities::Daemon`]) and seccomp forbids every metadata change instead.

use std::collections::BTreeSet;
use std::os::fd::OwnedFd;
use std::sync::{Arc, Mutex};

use caps::{CapSet, Capability};

use crate::policy::WorkerUser;

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
    #[error("cannot read the daemon's capabilities: {0}")]
    Caps(String),
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
    pub fn detect(
        wanted: WorkerUser,
        (first, last): (u32, u32),
        max_concurrent_calls: usize,
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
                 lacks {missing}; seccomp forbids every metadata change instead (SECURITY.md)"
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
        for id in first..=last {
            let taken = |what, name| IdentityError::Taken {
                first,
                last,
                what,
                id,
                name,
            };
            if let Ok(Some(user)) = nix::unistd::User::from_uid(nix::unistd::Uid::from_raw(id)) {
                return Err(taken("uid", user.name));
            }
            if let Ok(Some(group)) = nix::unistd::Group::from_gid(nix::unistd::Gid::from_raw(id)) {
                return Err(taken("gid", group.name));
            }
        }
        Ok(Identities::Separate(Pool::new(first, last)))
    }

    /// A uid of its own for one worker, or `None` when workers keep the daemon's.
    pub fn lease(&self) -> Result<Option<Lease>, IdentityError> {
        match self {
            Identities::Daemon => Ok(None),
            Identities::Separate(pool) => pool.lease().map(Some).ok_or(IdentityError::Exhausted {
                first: pool.first,
                last: pool.last,
            }),
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
            Identities::Separate(p) => format!("a uid of its own from {}-{}", p.first, p.last),
        }
    }
}

/// The capabilities of [`NEEDED_CAPS`] the daemon's effective set lacks.
fn missing_caps() -> Result<Vec<String>, IdentityError> {
    let effective =
        caps::read(None, CapSet::Effective).map_err(|e| IdentityError::Caps(e.to_string()))?;
    Ok(NEEDED_CAPS
        .iter()
        .filter(|c| !effective.contains(c))
        .map(|c| c.to_string())
        .collect())
}

/// The free uids of the reserved range.
#[derive(Debug, Clone)]
pub struct Pool {
    first: u32,
    last: u32,
    free: Arc<Mutex<BTreeSet<u32>>>,
}

impl Pool {
    pub fn new(first: u32, last: u32) -> Pool {
        Pool {
            first,
            last,
            free: Arc::new(Mutex::new((first..=last).collect())),
        }
    }

    /// The lowest free uid that no other process holds. `None` when every uid is leased
    /// (the call slots make that impossible while the range is at least
    /// `max_concurrent_calls` long and no other daemon shares it).
    fn lease(&self) -> Option<Lease> {
        let mut free = self.free.lock().unwrap_or_else(|p| p.into_inner());
        let uid = free
            .iter()
            .copied()
            .find_map(|uid| lock_uid(uid).map(|l| (uid, l)));
        let (uid, lock) = uid?;
        free.remove(&uid);
        Some(Lease {
            uid,
            _lock: lock,
            free: Arc::clone(&self.free),
        })
    }
}

/// The host-wide lock on one worker uid: an abstract Unix socket bound to
/// `airlock-worker-uid-<uid>`, released by the kernel when its last descriptor closes, the
/// daemon's death included. Two daemons configured with overlapping `worker_uids` (in the
/// same network namespace, where abstract names live) thus never run workers, nor sweep
/// leftovers, under the same uid. Close-on-exec, and the launcher closes every descriptor
/// anyway: no worker holds it.
pub(crate) fn lock_uid(uid: u32) -> Option<OwnedFd> {
    use rustix::net::{AddressFamily, SocketAddrUnix, SocketFlags, SocketType};
    let name = format!("airlock-worker-uid-{uid}");
    let addr = SocketAddrUnix::new_abstract_name(name.as_bytes()).ok()?;
    let fd = rustix::net::socket_with(
        AddressFamily::UNIX,
        SocketType::DGRAM,
        SocketFlags::CLOEXEC,
        None,
    )
    .ok()?;
    rustix::net::bind(&fd, &addr).ok()?;
    Some(fd)
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

    #[test]
    fn leases_are_unique_and_come_back() {
        let pool = Pool::new(70000, 70002);
        let a = pool.lease().unwrap();
        let b = pool.lease().unwrap();
        let c = pool.lease().unwrap();
        assert_eq!((a.uid(), b.uid(), c.uid()), (70000, 70001, 70002));
        assert!(pool.lease().is_none());
        drop(b);
        let d = pool.lease().unwrap();
        assert_eq!(d.uid(), 70001);
        assert_eq!(d.gid(), 70001);
    }

    #[test]
    fn a_uid_held_elsewhere_is_skipped() {
        // Another daemon (here: a second pool over the same range) holds 70100.
        let other = Pool::new(70100, 70101);
        let held = other.lease().unwrap();
        assert_eq!(held.uid(), 70100);
        let pool = Pool::new(70100, 70101);
        let a = pool.lease().unwrap();
        assert_eq!(a.uid(), 70101);
        assert!(pool.lease().is_none(), "70100 is held by the other pool");
        drop(held);
        assert_eq!(pool.lease().unwrap().uid(), 70100);
    }

    #[test]
    fn daemon_identity_never_leases() {
        let ids = Identities::detect(WorkerUser::Daemon, (70000, 70100), 4).unwrap();
        assert!(ids.lease().unwrap().is_none());
        assert!(ids.range().is_none());
    }

    #[test]
    fn small_ranges_are_refused_when_separate() {
        assert!(
            rustix::process::geteuid().is_root(),
            "this test needs root (it checks the privileged path)"
        );
        let e = Identities::detect(WorkerUser::Separate, (70000, 70001), 64).unwrap_err();
        assert!(matches!(e, IdentityError::TooSmall { .. }), "{e}");
    }
}
