//! Small filesystem helpers shared by the modules that persist things.

use std::fs::{DirBuilder, File, OpenOptions};
use std::io::Write;
use std::os::unix::fs::{DirBuilderExt, OpenOptionsExt};
use std::path::Path;

use crate::failpoint;

/// Creates `dir` and its missing parents; a newly created leaf gets mode 0700.
pub fn create_private_dir(dir: &Path) -> std::io::Result<()> {
    DirBuilder::new().recursive(true).mode(0o700).create(dir)
}

/// Replaces `dir/name` with `bytes` atomically and durably: a temp file in the same dir,
/// fsync, rename over the name, fsync of the dir. Both mutations pass failpoint `point`.
pub fn atomic_write(
    dir: &Path,
    name: &str,
    bytes: &[u8],
    mode: u32,
    point: &'static str,
) -> std::io::Result<()> {
    let tmp = dir.join(format!(".{name}.tmp"));
    failpoint::hit(point)?;
    let mut f = OpenOptions::new()
        .write(true)
        .create(true)
        .truncate(true)
        .mode(mode)
        .custom_flags(libc::O_NOFOLLOW)
        .open(&tmp)?;
    f.write_all(bytes)?;
    f.sync_all()?;
    drop(f);
    failpoint::hit(point)?;
    std::fs::rename(&tmp, dir.join(name))?;
    File::open(dir)?.sync_all()
}

/// Takes an exclusive, non-blocking `flock` on the directory `dir` itself, held for as long
/// as the returned file lives: one daemon (or `airlock recover`) per workspace.
pub fn lock_dir(dir: &Path) -> std::io::Result<File> {
    let f = File::open(dir)?;
    rustix::fs::flock(&f, rustix::fs::FlockOperation::NonBlockingLockExclusive)
        .map_err(std::io::Error::from)?;
    Ok(f)
}
