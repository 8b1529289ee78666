//! Why a path is refused: one variant per reason, each carrying what its message shows.
//! [`Rejection`] is a client's path parameter ([`super::Workspace::resolve`],
//! [`super::Workspace::check_input_reach`]); [`TargetError`] a job spec's target, and
//! [`SpecError`] the spec as a whole.

use std::path::PathBuf;

use rustix::io::Errno;

use super::{MAX_ID_LEN, NAME_MAX, PATH_MAX};
use crate::text::{shown, shown_path};

/// Names beginning with this are airlock's own (job dirs, quarantine dirs): no input may name
/// one or be a directory that holds one.
pub const RESERVED_PREFIX: &str = ".airlock-";

/// Why a client's path parameter is refused. `Display` is the reason as messages give it,
/// after the path itself ([`super::PathError::Rejected`]).
#[derive(Debug, thiserror::Error)]
pub enum Rejection {
    #[error("empty path")]
    Empty,
    #[error("contains a NUL byte")]
    Nul,
    #[error("{}", forbidden_message(*at, *found, class))]
    ForbiddenChar {
        at: usize,
        found: char,
        class: &'static str,
    },
    #[error("is {len} bytes long; a path is at most {} bytes", PATH_MAX - 1)]
    TooLong { len: usize },
    /// `head`: the component's first 16 bytes, as text.
    #[error(
        "has a component of {len} bytes ({}...); a file name is at most {NAME_MAX} bytes",
        shown(head)
    )]
    ComponentTooLong { len: usize, head: String },
    #[error("absolute path outside the workspace {}", root.display())]
    OutsideWorkspace { root: PathBuf },
    #[error("'..' leads out of the workspace")]
    LeadsOut,
    #[error("unexpected root component")]
    RootComponent,
    #[error("names an airlock job directory (or a quarantined one)")]
    JobDir,
    #[error(
        "would be {total} bytes long beneath the workspace root ({root} bytes); \
         a path is at most {} bytes",
        PATH_MAX - 1
    )]
    TooLongBeneathRoot { total: usize, root: usize },
    #[error(
        "its staged copy would be {staged} bytes long; a path is at most {} bytes \
         (the workspace root is {root} bytes)",
        PATH_MAX - 1
    )]
    StagedTooLong { staged: usize, root: usize },
    #[error("is the workspace root itself")]
    OutputIsRoot,
    /// Opening or statting `path` (a prefix of the path, beneath the root) failed.
    #[error("{}", walk_message(path, *errno))]
    Walk { path: PathBuf, errno: Errno },
    #[error("{} does not exist", shown_path(path))]
    Missing { path: PathBuf },
    /// `kind` as [`super::sys::describe`] names a file type.
    #[error("{} is {kind}, not a regular file or directory", shown_path(path))]
    InputNotFileOrDir { path: PathBuf, kind: &'static str },
    #[error("{} is {kind}; an output must be a regular file", shown_path(path))]
    OutputNotFile { path: PathBuf, kind: &'static str },
    #[error(
        "is the workspace root, which holds the job dirs of running calls \
         ({RESERVED_PREFIX}*); name a subdirectory of it instead"
    )]
    InputIsRoot,
    #[error(
        "{} is {kind}; this output is declared kind = \"directory\"",
        shown_path(path)
    )]
    OutputNotDirectory { path: PathBuf, kind: &'static str },
    #[error("{} is a name reserved to airlock ({RESERVED_PREFIX}*)", shown(name))]
    ReservedComponent { name: String },
    #[error("cannot list {}: {errno}", shown_path(path))]
    List { path: PathBuf, errno: Errno },
    #[error(
        "holds {}, a name reserved to airlock job and quarantine dirs \
         ({RESERVED_PREFIX}*); name a subdirectory that does not",
        shown(name)
    )]
    HoldsReserved { name: String },
    #[error("cannot read /proc/self/mountinfo to check for mounts beneath it: {cause}")]
    Mountinfo { cause: std::io::Error },
    #[error(
        "crosses into the filesystem mounted at {}; name a directory with no mount \
         point beneath it",
        mount.display()
    )]
    CrossesMount { mount: PathBuf },
}

/// Why a job spec's target is not a normalized relative path as
/// [`super::Workspace::resolve`] returns for an output (the spec may come from elsewhere).
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum TargetError {
    #[error("empty target")]
    Empty,
    #[error("target is not valid UTF-8")]
    NotUtf8,
    #[error("target is longer than PATH_MAX")]
    TooLong,
    #[error("target {}", forbidden_message(*at, *found, class))]
    ForbiddenChar {
        at: usize,
        found: char,
        class: &'static str,
    },
    #[error("target names an airlock job directory (or a quarantined one)")]
    JobDir,
    #[error("target has a component longer than NAME_MAX")]
    ComponentTooLong,
    #[error("target is not a normalized relative path")]
    NotNormalized,
}

/// Why a job spec cannot become a job dir.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum SpecError {
    #[error("job id {id:?} must be 1 to {MAX_ID_LEN} ASCII letters, digits, '-' or '_'")]
    BadId { id: String },
    #[error("{}: {error}", shown_path(target))]
    Target { target: PathBuf, error: TargetError },
    #[error("{} is named by two outputs", shown_path(target))]
    Duplicate { target: PathBuf },
    #[error(
        "output {} is a parent directory of output {}",
        shown_path(parent),
        shown_path(child)
    )]
    Nested { parent: PathBuf, child: PathBuf },
}

/// How a target (or one of its parents) changed between resolution and publication.
/// `kind`s are as [`super::sys::describe`] names a file type.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum Change {
    #[error("target has no file name")]
    TargetHasNoName,
    #[error("no directory name")]
    NoDirectoryName,
    #[error("no file name")]
    NoFileName,
    /// A parent of the target (`path`, beneath the root) cannot be opened as a directory.
    #[error("{}", parent_message(path, *errno))]
    Parent { path: PathBuf, errno: Errno },
    #[error("it is now {0}")]
    NowA(&'static str),
    #[error("it was replaced (now {0}) since publication began")]
    Replaced(&'static str),
    #[error("it was removed since publication began")]
    Removed,
    #[error("it was replaced during publication")]
    ReplacedDuringRename,
    #[error("{0} appeared there since publication began")]
    Appeared(&'static str),
    #[error("a file appeared there during publication")]
    AppearedDuringRename,
    /// Rollback cannot reach the target to restore it, for this reason.
    #[error("cannot reach it safely to restore it: {0}")]
    Unreachable(Box<Change>),
}

impl Change {
    pub(super) fn parent(path: &std::path::Path, errno: Errno) -> Change {
        Change::Parent {
            path: path.to_path_buf(),
            errno,
        }
    }
}

fn parent_message(prefix: &std::path::Path, e: Errno) -> String {
    let p = shown_path(prefix);
    match e {
        Errno::NOENT => format!("{p} no longer exists"),
        Errno::LOOP => format!("{p} is now a symlink"),
        Errno::NOTDIR => format!("{p} is no longer a directory"),
        Errno::XDEV => format!("{p} is now on another mount"),
        e => format!("{p}: {}", std::io::Error::from(e)),
    }
}

/// What is wrong with what the worker left as an output (the tool's result is at fault).
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum OutputFault {
    /// `slot`: the staging slot, relative to the job dir.
    #[error("the staging dir {} was removed or replaced", slot.display())]
    SlotGone { slot: PathBuf },
    #[error("the tool did not write it (missing)")]
    Missing,
    #[error("it is a symlink")]
    Symlink,
    /// What the tool left, as [`super::sys::describe`] names a file type.
    #[error("the tool left {0} there, not a regular file")]
    NotAFile(&'static str),
    #[error("it has {0} hard links (a staged output must have one)")]
    Links(u64),
    #[error("it was replaced while being validated")]
    Replaced,
    /// A directory output: what the tool left is not a directory.
    #[error("the tool left {0} there, not a directory")]
    NotADirectory(&'static str),
    /// A directory output: an entry of its tree is refused. `entry` is relative to the tree.
    #[error("entry {}: {fault}", shown_path(entry))]
    Entry {
        entry: PathBuf,
        fault: super::EntryFault,
    },
}

impl OutputFault {
    /// What an output of `kind` had to be, for messages.
    pub fn expected(kind: crate::policy::OutputKind) -> &'static str {
        match kind {
            crate::policy::OutputKind::Directory => {
                "a directory output holds regular files with one link, directories and \
                 symlinks staying inside it"
            }
            crate::policy::OutputKind::File => "a file output must be a regular file with one link",
        }
    }
}

/// The reason a path holding a [`super::workspace::forbidden_char`] is refused.
fn forbidden_message(at: usize, c: char, class: &str) -> String {
    format!(
        "holds U+{:04X} ({class}) at byte {at}; a path may not hold control characters, \
         bidirectional controls or invisible formatting characters",
        c as u32
    )
}

fn walk_message(prefix: &std::path::Path, e: Errno) -> String {
    let p = shown_path(prefix);
    match e {
        Errno::NOENT => format!("{p} does not exist"),
        Errno::LOOP => format!("{p} is a symlink (symlinks are never followed)"),
        Errno::NOTDIR => format!("{p} is not a directory"),
        Errno::XDEV => format!("{p} is on another mount than the workspace"),
        Errno::ACCESS => format!("{p}: permission denied"),
        e => format!("{p}: {}", std::io::Error::from(e)),
    }
}
