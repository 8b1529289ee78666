//! The worker's Landlock ruleset: built in the template for each worker ([`prepare`]), applied
//! by the worker ([`Prepared::restrict_self`]).
//!
//! Rights, by path:
//! - `writable` (the staging dir): every filesystem right but executing and creating device
//!   nodes. Symlinks, FIFOs and sockets may be created there; publication rejects such
//!   outputs. No exec from a writable dir: a worker cannot run a binary it copied or wrote.
//! - `readable` (the call's inputs) and the profile's `read`: read files, list directories.
//! - the profile's `exec`: the same plus execute.
//! - the profile's `write` (device files such as `/dev/null`): read, write and truncate, but
//!   never create or remove.
//!
//! With `network = false` and ABI >= 4, TCP bind and connect are handled and granted nowhere.
//! Signals and abstract Unix sockets are always scoped to the worker's domain (ABI 6), as a
//! hard requirement even with `best_effort`: without the signal scope a worker sharing the
//! daemon's uid could signal it, and the abstract-socket scope is the only layer for abstract
//! sockets when the profile lists `unix_sockets`.
//!
//! Fail closed: the ruleset asks for the rights of the profile's ABI as a hard requirement,
//! and a kernel below that ABI is refused up front, unless the profile says `best_effort`.

use std::collections::HashMap;
use std::os::fd::{AsFd, OwnedFd};
use std::path::{Path, PathBuf};

use crate::sandbox::sys;
use crate::sandbox::wire::{LandlockSpec, LandlockStatus};
use landlock::{
    make_bitflags, Access, AccessFs, AccessNet, BitFlags, CompatLevel, Compatible, PathBeneath,
    Ruleset, RulesetAttr, RulesetCreated, RulesetCreatedAttr, Scope, ABI,
};

/// A failure, with the errno of the underlying call when there is one.
#[derive(Debug)]
pub(crate) struct LandlockFailure {
    pub errno: i32,
    pub message: String,
}

impl LandlockFailure {
    fn new(errno: i32, message: impl Into<String>) -> Self {
        LandlockFailure {
            errno,
            message: message.into(),
        }
    }

    fn of(context: String, error: &(dyn std::error::Error + 'static)) -> Self {
        LandlockFailure {
            errno: errno_in(error),
            message: format!("{context}: {error}"),
        }
    }
}

/// The errno of the first `io::Error` in `error`'s source chain, or EPERM.
fn errno_in(error: &(dyn std::error::Error + 'static)) -> i32 {
    let mut cur = Some(error);
    while let Some(e) = cur {
        if let Some(io) = e.downcast_ref::<std::io::Error>() {
            if let Some(n) = io.raw_os_error() {
                return n;
            }
        }
        cur = e.source();
    }
    libc::EPERM
}

/// The rights each kind of path gets, limited to what `abi` knows.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct Rights {
    pub handled: BitFlags<AccessFs>,
    pub staging: BitFlags<AccessFs>,
    pub read: BitFlags<AccessFs>,
    pub exec: BitFlags<AccessFs>,
    pub write: BitFlags<AccessFs>,
}

impl Rights {
    pub(crate) fn for_abi(abi: ABI) -> Rights {
        let handled = AccessFs::from_all(abi);
        let staging = handled & !make_bitflags!(AccessFs::{Execute | MakeChar | MakeBlock});
        let read = handled & make_bitflags!(AccessFs::{ReadFile | ReadDir});
        let exec = handled & make_bitflags!(AccessFs::{ReadFile | ReadDir | Execute});
        let write = handled & make_bitflags!(AccessFs::{ReadFile | ReadDir | WriteFile | Truncate});
        Rights {
            handled,
            staging,
            read,
            exec,
            write,
        }
    }
}

/// A ruleset built in the template, for one worker: the worker restricts itself with it
/// ([`Prepared::restrict_self`]), which is one `landlock_restrict_self` on a copy of its
/// descriptor (close-on-exec, like every ruleset descriptor).
#[derive(Debug)]
pub(crate) struct Prepared {
    /// `None` only in the plan's tests, whose fake kernel never reads it.
    pub created: Option<RulesetCreated>,
    pub best_effort: bool,
    /// The kernel's Landlock ABI (0: none).
    pub kernel_abi: u8,
    /// The profile's.
    pub profile_abi: u8,
}

impl Prepared {
    /// Restricts the calling (single) thread: what the kernel enforces. Allocates nothing
    /// (a duplicate of the descriptor, the restriction, the duplicate closed), so a worker
    /// sharing its template's memory may call it.
    pub(crate) fn restrict_self(&self) -> Result<LandlockStatus, rustix::io::Errno> {
        let Some(created) = &self.created else {
            return Err(rustix::io::Errno::BADF);
        };
        let errno = |e: &(dyn std::error::Error + 'static)| {
            rustix::io::Errno::from_raw_os_error(errno_in(e))
        };
        let copy = created
            .try_clone()
            .map_err(|e| errno(&e))?
            // no_new_privs came from the template.
            .no_new_privs(false);
        let status = copy.restrict_self().map_err(|e| errno(&e))?;
        Ok(LandlockStatus::from(status.ruleset))
    }
}

/// What a template keeps from one worker's ruleset to the next: the kernel's Landlock ABI,
/// and each profile path (`read`, `exec`, `write`) opened `O_PATH` the first time a ruleset
/// names it, or its absence. A profile's paths are the same in every spec its template gets,
/// so each is walked once per template instead of once per worker; a call's own paths
/// (`readable`, `writable`) are walked for each worker, as before.
///
/// What it does not cover: a profile path that appears, or is replaced, after the template
/// first resolved it is not seen until the template is rebuilt (at SIGHUP, or when it dies).
/// A replaced directory then grants nothing beneath the new one, which is narrower, never
/// wider: the rule stays on the inode it was resolved to, as a rule always did for the
/// lifetime of one worker.
#[derive(Debug, Default)]
pub(crate) struct Resolved {
    kernel_abi: Option<i32>,
    paths: HashMap<PathBuf, Option<Opened>>,
    /// How many times a profile path was walked (opened, or found absent).
    #[cfg(test)]
    walked: usize,
}

/// A path opened for a rule: its descriptor and whether it is a directory.
#[derive(Debug)]
struct Opened {
    fd: OwnedFd,
    dir: bool,
}

impl Opened {
    /// `access`, narrowed to file rights when the path is not a directory.
    fn access(&self, access: BitFlags<AccessFs>, abi: ABI) -> BitFlags<AccessFs> {
        if self.dir {
            access
        } else {
            access & AccessFs::from_file(abi)
        }
    }
}

impl Resolved {
    fn kernel_abi(&mut self) -> Result<i32, LandlockFailure> {
        if let Some(abi) = self.kernel_abi {
            return Ok(abi);
        }
        let abi = sys::landlock_abi().map_err(|e| {
            LandlockFailure::new(
                e.raw_os_error().unwrap_or(0),
                format!("cannot query the Landlock ABI: {e}"),
            )
        })?;
        self.kernel_abi = Some(abi);
        Ok(abi)
    }

    /// A profile path, opened the first time (`None`: absent). Only an absence is kept;
    /// another failure is returned, and tried again for the next worker.
    fn profile_path(&mut self, path: &Path) -> Result<Option<&Opened>, LandlockFailure> {
        if !self.paths.contains_key(path) {
            let opened = open_path(path, false)?;
            #[cfg(test)]
            {
                self.walked += 1;
            }
            self.paths.insert(path.to_path_buf(), opened);
        }
        Ok(self.paths.get(path).and_then(Option::as_ref))
    }
}

/// Builds the worker's ruleset (in the template: every rule added, a profile path opened
/// once per template, see [`Resolved`]), for the worker to restrict itself with. Refuses up
/// front a kernel below the profile's ABI, unless the profile says `best_effort`.
pub(crate) fn prepare(
    spec: &LandlockSpec,
    resolved: &mut Resolved,
) -> Result<Prepared, LandlockFailure> {
    let kernel = resolved.kernel_abi()?;
    let kernel_abi = kernel.clamp(0, 255) as u8;
    if kernel_abi < spec.abi && !spec.best_effort {
        let what = if kernel_abi == 0 {
            "no Landlock".to_string()
        } else {
            format!("Landlock ABI {kernel_abi}")
        };
        return Err(LandlockFailure::new(
            libc::EOPNOTSUPP,
            format!(
                "the kernel has {what}; the profile requires ABI {} fully enforced (set best_effort to run anyway)",
                spec.abi
            ),
        ));
    }

    let abi = ABI::from(i32::from(spec.abi));
    let level = if spec.best_effort {
        CompatLevel::BestEffort
    } else {
        CompatLevel::HardRequirement
    };
    let rights = Rights::for_abi(abi);
    let ctx = |what: &str| {
        format!(
            "cannot {what} (kernel ABI {kernel_abi}, profile ABI {})",
            spec.abi
        )
    };

    let mut ruleset = Ruleset::default()
        .set_compatibility(level)
        .handle_access(rights.handled)
        .map_err(|e| LandlockFailure::of(ctx("handle filesystem access"), &e))?;
    if !spec.network && abi >= ABI::V4 {
        ruleset = ruleset
            .handle_access(AccessNet::from_all(abi))
            .map_err(|e| LandlockFailure::of(ctx("handle network access"), &e))?;
    }
    // Scopes: always, and never best effort (see the module comment).
    ruleset = ruleset
        .set_compatibility(CompatLevel::HardRequirement)
        .scope(make_bitflags!(Scope::{AbstractUnixSocket | Signal}))
        .map_err(|e| {
            LandlockFailure::of(
                format!("cannot scope signals and abstract Unix sockets, which needs Landlock ABI 6 (kernel ABI {kernel_abi})"),
                &e,
            )
        })?
        .set_compatibility(level);
    let mut created = ruleset
        .create()
        .map_err(|e| LandlockFailure::of(ctx("create the ruleset"), &e))?;

    // The call's own paths: each must exist, walked for this worker.
    for (paths, access) in [
        (&spec.writable, rights.staging),
        (&spec.readable, rights.read),
    ] {
        for path in paths {
            let Some(opened) = open_path(path, true)? else {
                continue;
            };
            let access = opened.access(access, abi);
            created = add_rule(created, PathBeneath::new(opened.fd, access), path)?;
        }
    }
    // The profile's: skipped when absent, resolved once per template.
    for (paths, access) in [
        (&spec.read, rights.read),
        (&spec.exec, rights.exec),
        (&spec.write, rights.write),
    ] {
        for path in paths {
            let Some(opened) = resolved.profile_path(path)? else {
                continue;
            };
            let access = opened.access(access, abi);
            created = add_rule(created, PathBeneath::new(opened.fd.as_fd(), access), path)?;
        }
    }
    Ok(Prepared {
        created: Some(created),
        best_effort: spec.best_effort,
        kernel_abi,
        profile_abi: spec.abi,
    })
}

fn add_rule<F: AsFd>(
    created: RulesetCreated,
    rule: PathBeneath<F>,
    path: &Path,
) -> Result<RulesetCreated, LandlockFailure> {
    created
        .add_rule(rule)
        .map_err(|e| LandlockFailure::of(format!("cannot add a rule for {}", path.display()), &e))
}

/// One path opened for a rule (`O_PATH`, walked once), its type read from the descriptor.
/// `Ok(None)` for an absent path that is not `required`.
fn open_path(path: &Path, required: bool) -> Result<Option<Opened>, LandlockFailure> {
    use rustix::fs::{FileType, Mode, OFlags};
    let fd = match rustix::fs::open(path, OFlags::PATH | OFlags::CLOEXEC, Mode::empty()) {
        Ok(fd) => fd,
        Err(rustix::io::Errno::NOENT) if !required => return Ok(None),
        Err(e) => {
            return Err(LandlockFailure::new(
                e.raw_os_error(),
                format!("cannot open {}: {e}", path.display()),
            ))
        }
    };
    let st = rustix::fs::fstat(&fd).map_err(|e| {
        LandlockFailure::new(
            e.raw_os_error(),
            format!("cannot stat {}: {e}", path.display()),
        )
    })?;
    let dir = FileType::from_raw_mode(st.st_mode) == FileType::Directory;
    Ok(Some(Opened { fd, dir }))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn staging_may_not_make_devices_or_execute() {
        let r = Rights::for_abi(ABI::V6);
        assert!(!r.staging.contains(AccessFs::MakeChar));
        assert!(!r.staging.contains(AccessFs::MakeBlock));
        assert!(!r.staging.contains(AccessFs::Execute));
        assert!(r.handled.contains(AccessFs::Execute));
        for a in [
            AccessFs::MakeSym,
            AccessFs::MakeFifo,
            AccessFs::MakeDir,
            AccessFs::MakeReg,
            AccessFs::RemoveFile,
        ] {
            assert!(r.staging.contains(a), "{a:?}");
        }
    }

    #[test]
    fn read_write_exec_rights() {
        let r = Rights::for_abi(ABI::V6);
        assert_eq!(r.read, make_bitflags!(AccessFs::{ReadFile | ReadDir}));
        assert_eq!(r.exec, r.read | AccessFs::Execute);
        assert!(r.write.contains(AccessFs::WriteFile) && r.write.contains(AccessFs::Truncate));
        assert!(!r
            .write
            .intersects(make_bitflags!(AccessFs::{MakeReg | RemoveFile | MakeDir})));
        // ABI 1 has no Truncate: the write rights shrink instead of failing.
        assert!(!Rights::for_abi(ABI::V1).write.contains(AccessFs::Truncate));
        assert!(Rights::for_abi(ABI::V1).write.contains(AccessFs::WriteFile));
    }

    fn spec(read: Vec<PathBuf>, readable: Vec<PathBuf>) -> LandlockSpec {
        LandlockSpec {
            abi: 1,
            best_effort: false,
            network: true,
            read,
            exec: vec!["/usr".into()],
            write: vec![],
            writable: vec![],
            readable,
        }
    }

    #[test]
    fn profile_paths_are_opened_once_per_template_and_a_calls_paths_every_time() {
        let dir = tempfile::tempdir().unwrap();
        let input = dir.path().join("input.txt");
        std::fs::write(&input, "x").unwrap();
        let absent = dir.path().join("absent");
        let spec = spec(
            vec!["/etc".into(), absent.clone(), "/usr".into()],
            vec![input.clone()],
        );
        let mut resolved = Resolved::default();
        prepare(&spec, &mut resolved).unwrap();
        // /etc, the absent path (kept as absent) and /usr, walked once although named twice.
        assert_eq!((resolved.walked, resolved.paths.len()), (3, 3));
        assert!(resolved.paths[&absent].is_none());
        assert!(resolved.paths[Path::new("/etc")]
            .as_ref()
            .is_some_and(|o| o.dir));
        // A second worker's ruleset walks no profile path again.
        let second = prepare(&spec, &mut resolved).unwrap();
        assert!(second.created.is_some());
        assert_eq!(resolved.walked, 3);
        // The absent path stays absent for this template, even once it exists.
        std::fs::create_dir(&absent).unwrap();
        prepare(&spec, &mut resolved).unwrap();
        assert!(resolved.paths[&absent].is_none());
        // A call's own path must exist, every time.
        std::fs::remove_file(&input).unwrap();
        let err = prepare(&spec, &mut resolved).unwrap_err();
        assert_eq!(err.errno, libc::ENOENT, "{}", err.message);
    }

    #[test]
    fn errno_is_found_in_the_chain() {
        let e = std::io::Error::from_raw_os_error(libc::EACCES);
        assert_eq!(errno_in(&e), libc::EACCES);
    }
}
