//! The workspace root held open as a dirfd, and resolution of path parameters beneath it.

use std::ffi::OsStr;
use std::os::fd::{AsFd, BorrowedFd, OwnedFd};
use std::path::{Component, Path, PathBuf};

use rustix::fs::{FileType, Mode, OFlags};
use rustix::io::Errno;

use super::rejection::{Rejection, TargetError};
use super::sys::{describe, file_type, open_beneath, stat_at};
use super::{PathError, PublishError, NAME_MAX, PATH_MAX, RESERVED_PREFIXES, STAGED_OVERHEAD};
use crate::policy::{OutputKind, PathRole};

/// The workspace root, held open as a directory fd. Every later operation resolves beneath
/// this fd, so renaming or replacing the root's path after `open` steers nothing.
#[derive(Debug)]
pub struct Workspace {
    /// Canonical absolute path of the root (for messages and for absolute parameters).
    root: PathBuf,
    /// The root as the operator spelled it, lexically normalized: absolute parameters under
    /// it are accepted too.
    given: PathBuf,
    fd: OwnedFd,
    /// Job dirs kept for reuse (none unless [`Workspace::keep_idle_job_dirs`] says so).
    pool: std::sync::Arc<super::pool::Pool>,
}

impl Workspace {
    pub fn open(root: &Path) -> Result<Workspace, PublishError> {
        let io = |op, e: std::io::Error| PublishError::Io {
            op,
            path: root.to_path_buf(),
            source: e,
        };
        let canonical = std::fs::canonicalize(root).map_err(|e| io("resolve workspace root", e))?;
        let fd = rustix::fs::open(
            &canonical,
            OFlags::RDONLY | OFlags::DIRECTORY | OFlags::CLOEXEC | OFlags::NOFOLLOW,
            Mode::empty(),
        )
        .map_err(|e| io("open workspace root", e.into()))?;
        let given = if root.is_absolute() {
            lexical(root)
        } else {
            canonical.clone()
        };
        Ok(Workspace {
            root: canonical,
            given,
            fd,
            pool: Default::default(),
        })
    }

    pub fn root(&self) -> &Path {
        &self.root
    }

    pub(super) fn fd(&self) -> BorrowedFd<'_> {
        self.fd.as_fd()
    }

    /// Keeps up to `cap` ended jobs' dirs for later jobs to reuse ([`super::pool`]): the
    /// daemon's choice, since only a process that holds the workspace to itself may rename
    /// job dirs around.
    pub fn keep_idle_job_dirs(&self, cap: usize) {
        self.pool.keep_up_to(cap);
    }

    /// Removes every idle job dir (at shutdown).
    pub fn release_idle_job_dirs(&self) {
        self.pool.release(self.fd.as_fd(), &self.root);
    }

    pub(super) fn pool(&self) -> &std::sync::Arc<super::pool::Pool> {
        &self.pool
    }

    /// Resolves a path parameter beneath the workspace and returns it relative to the root,
    /// normalized. `..` escapes, absolute paths elsewhere, symlinks leading out, paths into
    /// job dirs and paths holding a [`forbidden_char`] are rejected.
    ///
    /// `.` and `..` are resolved lexically; the caller must use the returned path (never the
    /// raw one), and every existing component of it is checked to be a real directory beneath
    /// the root (no symlink at all, no mount crossing).
    pub fn resolve(&self, raw: &str, role: PathRole) -> Result<PathBuf, PathError> {
        self.resolve_as(raw, role, OutputKind::File)
    }

    /// As [`Workspace::resolve`], for an output of kind `kind`: an existing target of the
    /// other type (a directory where a file is declared, or the reverse) is rejected.
    pub fn resolve_as(
        &self,
        raw: &str,
        role: PathRole,
        kind: OutputKind,
    ) -> Result<PathBuf, PathError> {
        let reject = |reason: Rejection| PathError::Rejected {
            raw: raw.to_string(),
            reason,
        };
        let rel = self.normalize(raw).map_err(reject)?;
        self.check_length(&rel, role).map_err(reject)?;
        self.check(&rel, role, kind).map_err(reject)?;
        if rel.as_os_str().is_empty() {
            return Ok(PathBuf::from("."));
        }
        Ok(rel)
    }

    /// The lexical half of [`Workspace::resolve`]: a relative, normalized path.
    fn normalize(&self, raw: &str) -> Result<PathBuf, Rejection> {
        if raw.is_empty() {
            return Err(Rejection::Empty);
        }
        if raw.contains('\0') {
            return Err(Rejection::Nul);
        }
        if let Some((at, found, class)) = forbidden_char(raw) {
            return Err(Rejection::ForbiddenChar { at, found, class });
        }
        if raw.len() >= PATH_MAX {
            return Err(Rejection::TooLong { len: raw.len() });
        }
        if let Some(c) = Path::new(raw)
            .iter()
            .find(|c| c.as_encoded_bytes().len() > NAME_MAX)
        {
            return Err(Rejection::ComponentTooLong {
                len: c.len(),
                head: String::from_utf8_lossy(&c.as_encoded_bytes()[..16]).into_owned(),
            });
        }
        let path = Path::new(raw);
        let owned;
        let rel: &Path = if path.is_absolute() {
            owned = lexical(path);
            if let Ok(r) = owned.strip_prefix(&self.root) {
                r
            } else if let Ok(r) = owned.strip_prefix(&self.given) {
                r
            } else {
                return Err(Rejection::OutsideWorkspace {
                    root: self.root.clone(),
                });
            }
        } else {
            path
        };
        let mut out = PathBuf::new();
        for c in rel.components() {
            match c {
                Component::Normal(n) => out.push(n),
                Component::CurDir => {}
                Component::ParentDir => {
                    if !out.pop() {
                        return Err(Rejection::LeadsOut);
                    }
                }
                Component::RootDir | Component::Prefix(_) => return Err(Rejection::RootComponent),
            }
        }
        if let Some(Component::Normal(first)) = out.components().next() {
            if is_reserved(first) {
                return Err(Rejection::JobDir);
            }
        }
        Ok(out)
    }

    /// Bounds what the daemon will build from a resolved path, so that no later syscall
    /// (the worker's open of its argument, publication, rollback, recovery) meets
    /// ENAMETOOLONG: the absolute path beneath the root, and for an output its staged path
    /// inside the job dir (which is also where the old file is kept as the backup).
    fn check_length(&self, rel: &Path, role: PathRole) -> Result<(), Rejection> {
        let root = self.root.as_os_str().len();
        let total = root + 1 + rel.as_os_str().len();
        if total >= PATH_MAX {
            return Err(Rejection::TooLongBeneathRoot { total, root });
        }
        if role.writes() {
            let base = rel.file_name().map_or(0, |n| n.len());
            let staged = root + STAGED_OVERHEAD + base;
            if staged >= PATH_MAX {
                return Err(Rejection::StagedTooLong { staged, root });
            }
        }
        Ok(())
    }

    /// The physical half: walks the existing components beneath the root fd.
    fn check(&self, rel: &Path, role: PathRole, kind: OutputKind) -> Result<(), Rejection> {
        let comps: Vec<&OsStr> = rel.iter().collect();
        let Some((last, parents)) = comps.split_last() else {
            return match role {
                PathRole::Input => Ok(()),
                PathRole::Output | PathRole::InOut => Err(Rejection::OutputIsRoot),
            };
        };
        let mut cur: Option<OwnedFd> = None;
        let mut prefix = PathBuf::new();
        for comp in parents {
            prefix.push(comp);
            let dir = cur.as_ref().map_or(self.fd.as_fd(), |f| f.as_fd());
            match open_beneath(dir, comp, OFlags::PATH | OFlags::DIRECTORY) {
                Ok(fd) => cur = Some(fd),
                Err(Errno::NOENT) if role.writes() => {
                    // The rest does not exist yet: publication creates it beneath the root.
                    return Ok(());
                }
                Err(e) => return Err(walk_error(&prefix, e)),
            }
        }
        prefix.push(last);
        let dir = cur.as_ref().map_or(self.fd.as_fd(), |f| f.as_fd());
        let st = stat_at(dir, last).map_err(|e| walk_error(&prefix, e))?;
        match role {
            PathRole::Input => {
                let Some(st) = st else {
                    return Err(Rejection::Missing { path: prefix });
                };
                let ft = file_type(&st);
                if ft != FileType::RegularFile && ft != FileType::Directory {
                    return Err(Rejection::InputNotFileOrDir {
                        path: prefix,
                        kind: describe(ft),
                    });
                }
                // Prove it is readable (the type is known, so opening has no side effect).
                open_beneath(dir, last, OFlags::RDONLY | OFlags::NONBLOCK)
                    .map(drop)
                    .map_err(|e| walk_error(&prefix, e))
            }
            PathRole::Output | PathRole::InOut => match (kind, st.map(|st| file_type(&st))) {
                (_, None)
                | (OutputKind::File, Some(FileType::RegularFile))
                | (OutputKind::Directory, Some(FileType::Directory)) => Ok(()),
                (OutputKind::File, Some(ft)) => Err(Rejection::OutputNotFile {
                    path: prefix,
                    kind: describe(ft),
                }),
                (OutputKind::Directory, Some(ft)) => Err(Rejection::OutputNotDirectory {
                    path: prefix,
                    kind: describe(ft),
                }),
            },
        }
    }
}

fn walk_error(prefix: &Path, errno: Errno) -> Rejection {
    Rejection::Walk {
        path: prefix.to_path_buf(),
        errno,
    }
}

/// The first character of `s` that no path a client names may hold, with its byte offset and
/// its class: ASCII and C1 control characters (U+0000-U+001F, U+007F, U+0080-U+009F),
/// bidirectional controls (U+061C, U+200E, U+200F, U+202A-U+202E, U+2066-U+2069), and
/// zero-width and invisible formatting characters (U+200B-U+200D, U+2060, U+FEFF). Such a
/// name would be created as is and then shown reordered or invisible by every tool that
/// lists it.
pub fn forbidden_char(s: &str) -> Option<(usize, char, &'static str)> {
    s.char_indices().find_map(|(at, c)| {
        let class = match c {
            '\u{0}'..='\u{1f}' | '\u{7f}'..='\u{9f}' => "a control character",
            '\u{61c}'
            | '\u{200e}'
            | '\u{200f}'
            | '\u{202a}'..='\u{202e}'
            | '\u{2066}'..='\u{2069}' => "a bidirectional control",
            '\u{200b}'..='\u{200d}' | '\u{2060}' | '\u{feff}' => {
                "an invisible formatting character"
            }
            _ => return None,
        };
        Some((at, c, class))
    })
}

/// Lexical normalization of an absolute path (`.` dropped, `..` pops, never above `/`).
fn lexical(path: &Path) -> PathBuf {
    let mut out = PathBuf::new();
    for c in path.components() {
        match c {
            Component::ParentDir => {
                if out.parent().is_some() {
                    out.pop();
                }
            }
            Component::CurDir => {}
            c => out.push(c),
        }
    }
    out
}

/// Splits a normalized relative target into its parent (possibly empty) and file name.
pub(super) fn split_target(target: &Path) -> Option<(&Path, &OsStr)> {
    let name = target.file_name()?;
    let parent = target.parent().unwrap_or(Path::new(""));
    Some((parent, name))
}

/// Checks that `target` is a normalized relative path as [`Workspace::resolve`] returns for an
/// output (the spec may come from elsewhere; never trust it blindly).
pub(super) fn check_target(target: &Path) -> Result<(), TargetError> {
    if target.as_os_str().is_empty() {
        return Err(TargetError::Empty);
    }
    if target.to_str().is_none() {
        return Err(TargetError::NotUtf8);
    }
    if target.as_os_str().len() >= PATH_MAX {
        return Err(TargetError::TooLong);
    }
    if let Some((at, found, class)) = target.to_str().and_then(forbidden_char) {
        return Err(TargetError::ForbiddenChar { at, found, class });
    }
    for (k, c) in target.components().enumerate() {
        match c {
            Component::Normal(n) => {
                if k == 0 && is_reserved(n) {
                    return Err(TargetError::JobDir);
                }
                if n.len() > NAME_MAX {
                    return Err(TargetError::ComponentTooLong);
                }
            }
            _ => return Err(TargetError::NotNormalized),
        }
    }
    Ok(())
}

/// Whether a first path component names one of airlock's own dirs in the workspace root.
pub(super) fn is_reserved(first: &OsStr) -> bool {
    RESERVED_PREFIXES
        .iter()
        .any(|p| first.as_encoded_bytes().starts_with(p.as_bytes()))
}

pub use super::rejection::RESERVED_PREFIX;

impl Workspace {
    /// The reach of an input, checked after [`Workspace::resolve`] (`rel` is what it
    /// returned). Landlock grants a worker an input directory with everything beneath it, so
    /// an input is refused when that would include other calls' jobs or another filesystem:
    ///
    /// * the workspace root itself (it holds every running call's job dir);
    /// * a path with a component reserved to airlock (`.airlock-*`);
    /// * a directory holding an entry with a reserved name (the root of another workspace,
    ///   say, nested in this one);
    /// * a directory beneath which another filesystem is mounted (the daemon's mountinfo,
    ///   compared against the resolved absolute path). A mount *at* the input itself is
    ///   refused by `resolve` already (`RESOLVE_NO_XDEV`).
    ///
    /// Mounts and entries created after this check are not seen: the check is for mistakes
    /// and for the layout the workspace has, not a race-free guard against its own operator.
    pub fn check_input_reach(&self, raw: &str, rel: &Path) -> Result<(), PathError> {
        let reject = |reason: Rejection| PathError::Rejected {
            raw: raw.to_string(),
            reason,
        };
        if rel.as_os_str().is_empty() || rel == Path::new(".") {
            return Err(reject(Rejection::InputIsRoot));
        }
        if let Some(c) = rel
            .iter()
            .find(|c| c.as_encoded_bytes().starts_with(RESERVED_PREFIX.as_bytes()))
        {
            return Err(reject(Rejection::ReservedComponent {
                name: c.to_string_lossy().into_owned(),
            }));
        }
        let dir = match open_beneath(self.fd(), rel, OFlags::RDONLY | OFlags::DIRECTORY) {
            Ok(fd) => fd,
            // A file: nothing lies beneath it.
            Err(Errno::NOTDIR) => return Ok(()),
            Err(e) => return Err(reject(walk_error(rel, e))),
        };
        let list = |errno| {
            reject(Rejection::List {
                path: rel.to_path_buf(),
                errno,
            })
        };
        let entries = rustix::fs::Dir::read_from(&dir).map_err(list)?;
        for entry in entries {
            let entry = entry.map_err(list)?;
            let name = entry.file_name().to_bytes();
            if name.starts_with(RESERVED_PREFIX.as_bytes()) {
                return Err(reject(Rejection::HoldsReserved {
                    name: String::from_utf8_lossy(name).into_owned(),
                }));
            }
        }
        let abs = self.root.join(rel);
        let info = std::fs::read_to_string("/proc/self/mountinfo")
            .map_err(|cause| reject(Rejection::Mountinfo { cause }))?;
        if let Some(m) = mounts_beneath(&info, &abs).into_iter().next() {
            return Err(reject(Rejection::CrossesMount { mount: m }));
        }
        Ok(())
    }
}

/// The mount points of `mountinfo` (proc(5)) strictly beneath `dir`, in order.
fn mounts_beneath(mountinfo: &str, dir: &Path) -> Vec<PathBuf> {
    use std::os::unix::ffi::OsStrExt;
    mountinfo
        .lines()
        .filter_map(|line| line.split(' ').nth(4))
        .map(|field| PathBuf::from(OsStr::from_bytes(&unescape_mountinfo(field))))
        .filter(|m| m != dir && m.starts_with(dir))
        .collect()
}

/// Undoes mountinfo's octal escapes (`\040` for a space, `\012`, `\011`, `\134`).
fn unescape_mountinfo(field: &str) -> Vec<u8> {
    let b = field.as_bytes();
    let mut out = Vec::with_capacity(b.len());
    let mut i = 0;
    while i < b.len() {
        if b[i] == b'\\'
            && i + 3 < b.len()
            && b[i + 1..i + 4].iter().all(|c| (b'0'..=b'7').contains(c))
        {
            out.push((b[i + 1] - b'0') * 64 + (b[i + 2] - b'0') * 8 + (b[i + 3] - b'0'));
            i += 4;
        } else {
            out.push(b[i]);
            i += 1;
        }
    }
    out
}

#[cfg(test)]
mod reach_tests {
    use super::*;

    /// Every character of the forbidden classes, one of each, and neighbours that pass.
    #[test]
    fn control_bidi_and_invisible_characters_are_forbidden() {
        let forbidden = [
            '\u{1}', '\u{1b}', '\n', '\u{1f}', '\u{7f}', '\u{80}', '\u{85}', '\u{9f}', '\u{61c}',
            '\u{200e}', '\u{200f}', '\u{202a}', '\u{202e}', '\u{2066}', '\u{2069}', '\u{200b}',
            '\u{200c}', '\u{200d}', '\u{2060}', '\u{feff}',
        ];
        for c in forbidden {
            let raw = format!("d\u{e9}/a{c}b");
            let Some((at, found, _)) = forbidden_char(&raw) else {
                panic!("U+{:04X} passes", c as u32);
            };
            assert_eq!((at, found), (5, c));
        }
        for ok in [
            "caf\u{e9}/\u{5d0}\u{5d1}",
            "a b",
            "\u{a0}x",
            "\u{2010}",
            "\u{206a}",
        ] {
            assert_eq!(forbidden_char(ok), None, "{ok:?}");
        }
        let dir = tempfile::tempdir().unwrap();
        let ws = Workspace::open(dir.path()).unwrap();
        for role in [PathRole::Input, PathRole::Output] {
            let e = ws
                .resolve("x\u{1b}[31m/\u{202e}txt.exe", role)
                .unwrap_err()
                .to_string();
            assert!(
                e.contains("holds U+001B (a control character) at byte 1"),
                "{e}"
            );
            assert!(e.starts_with("\"x\\u{1b}[31m/\\u{202e}txt.exe\": "), "{e}");
        }
        assert!(check_target(Path::new("a\u{2066}b")).is_err());
    }

    /// README's `PATH_REJECTED` row names each case resolution refuses: every case below is
    /// refused, and the row holds the phrase that describes it. (The mount cases need a
    /// mount and are shown by `uid_separation::inputs_crossing_into_another_mount_are_refused`.)
    #[test]
    fn readme_path_rejected_row_names_every_case() {
        let readme = std::fs::read_to_string(concat!(env!("CARGO_MANIFEST_DIR"), "/README.md"))
            .expect("README.md");
        let row = readme
            .lines()
            .find(|l| l.starts_with("| `PATH_REJECTED` |"))
            .expect("README has a PATH_REJECTED row");
        let dir = tempfile::tempdir().unwrap();
        let root = dir.path();
        std::fs::write(root.join("f"), "").unwrap();
        std::fs::create_dir_all(root.join("nest/.airlock-job-fake")).unwrap();
        std::fs::create_dir(root.join("d")).unwrap();
        std::os::unix::fs::symlink("d", root.join("link")).unwrap();
        rustix::fs::mknodat(
            rustix::fs::CWD,
            root.join("fifo"),
            FileType::Fifo,
            Mode::from_raw_mode(0o600),
            0,
        )
        .unwrap();
        let ws = Workspace::open(root).unwrap();
        let long_name = format!("a/{}", "n".repeat(NAME_MAX + 1));
        // 4090 bytes: under the argument's bound, over PATH_MAX beneath any root.
        let deep = format!("{}/{}", vec!["c".repeat(250); 16].join("/"), "e".repeat(74));
        assert_eq!(deep.len(), 4090);
        let (i, o) = (PathRole::Input, PathRole::Output);
        // (path, role, what the reason says, README's phrase for the case)
        let cases: &[(&str, PathRole, &str, &str)] = &[
            ("", i, "empty path", "it is empty"),
            ("a\0b", i, "NUL byte", "holds a NUL byte"),
            (
                "a\u{1b}b",
                o,
                "U+001B (a control character)",
                "a control character",
            ),
            (
                "a\u{202e}b",
                o,
                "U+202E (a bidirectional control)",
                "a bidirectional control",
            ),
            (
                "a\u{200b}b",
                i,
                "U+200B (an invisible formatting",
                "invisible formatting character",
            ),
            ("../x", o, "'..' leads out", "`..` above the root"),
            (
                "/etc/passwd",
                i,
                "absolute path outside",
                "an absolute path outside it",
            ),
            (
                ".airlock-job-x/f",
                o,
                "job directory",
                "names an airlock job or quarantine dir",
            ),
            (
                &long_name,
                o,
                "a file name is at most 255",
                "a component over 255 bytes",
            ),
            (
                &deep,
                o,
                "beneath the workspace root",
                "4096 bytes or more as resolved beneath the root",
            ),
            ("link/x", o, "is a symlink", "is a symlink"),
            ("f/x", i, "is not a directory", "not a directory"),
            ("missing", i, "does not exist", "an input does not exist"),
            (
                "fifo",
                i,
                "not a regular file or directory",
                "is not a regular file or directory",
            ),
            (
                ".",
                o,
                "is the workspace root itself",
                "an output is the workspace root",
            ),
            (
                "d",
                o,
                "an output must be a regular file",
                "exists as something other than a regular file",
            ),
            (
                ".",
                i,
                "is the workspace root",
                "an input is the workspace root",
            ),
            (
                "nest",
                i,
                "holds \".airlock-job-fake\"",
                "is a directory holding a `.airlock-*` entry",
            ),
        ];
        for (raw, role, reason, phrase) in cases {
            let refused = ws.resolve(raw, *role).and_then(|rel| match role {
                PathRole::Input => ws.check_input_reach(raw, &rel),
                PathRole::Output | PathRole::InOut => Ok(()),
            });
            let Err(e) = refused else {
                panic!("{raw:?} ({role:?}) is accepted");
            };
            assert!(e.to_string().contains(reason), "{raw:?}: {e}");
            assert!(
                row.contains(phrase),
                "README's PATH_REJECTED row lacks {phrase:?}"
            );
        }
    }

    /// A reason quotes the client's path as `shown` does: escaped, never raw.
    #[test]
    fn reasons_show_the_path_escaped() {
        let dir = tempfile::tempdir().unwrap();
        std::fs::write(dir.path().join("f"), "").unwrap();
        let ws = Workspace::open(dir.path()).unwrap();
        let e = ws.resolve("f/x", PathRole::Input).unwrap_err().to_string();
        assert_eq!(e, "\"f/x\": \"f\" is not a directory");
        let e = ws
            .resolve("missing", PathRole::Input)
            .unwrap_err()
            .to_string();
        assert_eq!(e, "\"missing\": \"missing\" does not exist");
    }

    #[test]
    fn mounts_beneath_a_directory_are_found_escapes_undone() {
        let info = "22 1 8:1 / / rw - ext4 /dev/sda1 rw\n\
                    40 22 0:50 / /w/sub/mnt rw - tmpfs tmpfs rw\n\
                    41 22 0:51 / /w/a\\040b/m rw - tmpfs tmpfs rw\n\
                    42 22 0:52 / /w/subway rw - tmpfs tmpfs rw\n\
                    43 22 0:53 / /w/sub rw - tmpfs tmpfs rw\n";
        assert_eq!(
            mounts_beneath(info, Path::new("/w/sub")),
            vec![PathBuf::from("/w/sub/mnt")]
        );
        assert_eq!(
            mounts_beneath(info, Path::new("/w/a b")),
            vec![PathBuf::from("/w/a b/m")]
        );
        assert!(mounts_beneath(info, Path::new("/w/sub/mnt")).is_empty());
        assert_eq!(mounts_beneath(info, Path::new("/w")).len(), 4);
    }
}
