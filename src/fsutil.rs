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

/// What the temp file of `dir/name` may be, for [`write_temp`].
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Temp {
    /// Whatever it holds may be named by `dir/name` on disk (an exchange or rename whose
    /// dir fsync did not succeed, or nothing known): it is unlinked and a new file made.
    Fresh,
    /// A spare: no name that survives a crash points at its inode (the exchange that made it
    /// the temp file is durable), so it is written over in place. No inode is made or freed.
    Spare,
}

/// `bytes` written to the temp file of `dir/name` (mode `mode` if made), the name itself
/// untouched; returns the temp file, for the caller to fsync before [`rename_temp`] or
/// [`exchange_temp`]. Failpoint `point` before it.
pub fn write_temp(
    dir: &Path,
    name: &str,
    bytes: &[u8],
    mode: u32,
    point: &'static str,
    temp: Temp,
) -> std::io::Result<File> {
    failpoint::hit(point)?;
    let path = temp_path(dir, name);
    if temp == Temp::Spare {
        match OpenOptions::new()
            .write(true)
            .custom_flags(libc::O_NOFOLLOW)
            .open(&path)
        {
            Ok(f) => {
                overwrite(&f, bytes)?;
                return Ok(f);
            }
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => {}
            Err(e) => return Err(e),
        }
    }
    match std::fs::remove_file(&path) {
        Err(e) if e.kind() != std::io::ErrorKind::NotFound => return Err(e),
        _ => {}
    }
    let mut f = OpenOptions::new()
        .write(true)
        .create_new(true)
        .mode(mode)
        .custom_flags(libc::O_NOFOLLOW)
        .open(&path)?;
    f.write_all(bytes)?;
    Ok(f)
}

/// Writes `bytes` over the start of `file` and cuts it there, after the write, not before
/// (a file cut to nothing would free its block for the write to allocate again): a shorter
/// content keeps the longer one's block. A short write (a full disk) is `ENOSPC`.
pub fn overwrite(file: &File, bytes: &[u8]) -> Result<(), rustix::io::Errno> {
    let n = rustix::io::pwrite(file, bytes, 0)?;
    if n != bytes.len() {
        return Err(rustix::io::Errno::NOSPC);
    }
    rustix::fs::ftruncate(file, n as u64)
}

/// The temp file [`write_temp`] left renamed over `dir/name`: the temp name is gone, the
/// name's previous inode freed. Failpoint `point` before it.
pub fn rename_temp(dir: &Path, name: &str, point: &'static str) -> std::io::Result<()> {
    failpoint::hit(point)?;
    std::fs::rename(temp_path(dir, name), dir.join(name))
}

/// The temp file [`write_temp`] left exchanged with `dir/name` (`RENAME_EXCHANGE`, atomic
/// like a rename): the name holds the new content, and the temp name the previous one, a
/// spare for the next write once the exchange is durable (the dir fsynced). `dir/name`
/// must exist. Failpoint `point` before it.
pub fn exchange_temp(dir: &Path, name: &str, point: &'static str) -> std::io::Result<()> {
    failpoint::hit(point)?;
    rustix::fs::renameat_with(
        rustix::fs::CWD,
        temp_path(dir, name),
        rustix::fs::CWD,
        dir.join(name),
        rustix::fs::RenameFlags::EXCHANGE,
    )
    .map_err(std::io::Error::from)
}

/// Where [`write_temp`] writes the file that becomes `name` in `dir`.
pub fn temp_path(dir: &Path, name: &str) -> std::path::PathBuf {
    dir.join(format!(".{name}.tmp"))
}

/// Why [`lock_dir`] failed.
#[derive(Debug, thiserror::Error)]
pub enum LockError {
    /// Another process holds the lock (`flock` said EWOULDBLOCK); `holder` is the pid that
    /// took it, as `/proc/locks` says (a child that inherited the descriptor holds it too).
    #[error("another process holds its lock")]
    Held { holder: Option<u32> },
    #[error("cannot open it")]
    Open(#[source] std::io::Error),
    #[error("cannot lock it")]
    Lock(#[source] std::io::Error),
}

/// Takes an exclusive, non-blocking `flock` on the directory `dir` itself, held for as long
/// as the returned file lives: one daemon (or `airlock recover`) per workspace and per state
/// dir.
pub fn lock_dir(dir: &Path) -> Result<File, LockError> {
    let f = OpenOptions::new()
        .read(true)
        .custom_flags(libc::O_DIRECTORY)
        .open(dir)
        .map_err(LockError::Open)?;
    match rustix::fs::flock(&f, rustix::fs::FlockOperation::NonBlockingLockExclusive) {
        Ok(()) => Ok(f),
        Err(rustix::io::Errno::WOULDBLOCK) => Err(LockError::Held {
            holder: f.metadata().ok().and_then(|m| flock_holder(&m)),
        }),
        Err(e) => Err(LockError::Lock(e.into())),
    }
}

/// The pid that took the `flock` on the file of `m`, from `/proc/locks`
/// (`N: FLOCK ADVISORY WRITE PID MAJ:MIN:INO 0 EOF`, device numbers in hex).
fn flock_holder(m: &std::fs::Metadata) -> Option<u32> {
    use std::os::unix::fs::MetadataExt;
    let dev = m.dev();
    let want = format!(
        "{:02x}:{:02x}:{}",
        rustix::fs::major(dev),
        rustix::fs::minor(dev),
        m.ino()
    );
    let locks = std::fs::read_to_string("/proc/locks").ok()?;
    locks.lines().find_map(|l| {
        let f: Vec<&str> = l.split_whitespace().collect();
        match f.as_slice() {
            [_, "FLOCK", _, _, pid, id, ..] if *id == want => pid.parse().ok(),
            _ => None,
        }
    })
}

/// `path` with its longest existing ancestor resolved (symlinks followed, as the kernel
/// would) and the rest appended lexically: where `path` is, or would be once created.
pub fn resolve_lenient(path: &Path) -> std::io::Result<std::path::PathBuf> {
    use std::path::Component;
    let abs = if path.is_absolute() {
        path.to_path_buf()
    } else {
        std::env::current_dir()?.join(path)
    };
    let mut existing = abs.as_path();
    let mut rest = Vec::new();
    loop {
        match std::fs::canonicalize(existing) {
            Ok(mut base) => {
                for c in rest.iter().rev() {
                    match c {
                        Component::ParentDir => {
                            base.pop();
                        }
                        Component::Normal(n) => base.push(n),
                        _ => {}
                    }
                }
                return Ok(base);
            }
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => {
                let Some(parent) = existing.parent() else {
                    return Err(e);
                };
                if let Some(c) = existing.components().next_back() {
                    rest.push(c);
                }
                existing = parent;
            }
            Err(e) => return Err(e),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn lock_dir_tells_held_from_other_failures() {
        let tmp = tempfile::tempdir().unwrap();
        let held = lock_dir(tmp.path()).unwrap();
        let me = std::process::id();
        assert!(matches!(
            lock_dir(tmp.path()),
            Err(LockError::Held { holder: Some(p) }) if p == me
        ));
        drop(held);
        lock_dir(tmp.path()).unwrap();
        let missing = tmp.path().join("missing");
        assert!(matches!(lock_dir(&missing), Err(LockError::Open(_))));
        let file = tmp.path().join("file");
        std::fs::write(&file, "x").unwrap();
        assert!(matches!(lock_dir(&file), Err(LockError::Open(_))));
    }

    #[test]
    fn resolve_lenient_follows_existing_symlinks_only() {
        let tmp = tempfile::tempdir().unwrap();
        let root = tmp.path().canonicalize().unwrap();
        std::fs::create_dir(root.join("ws")).unwrap();
        std::os::unix::fs::symlink(root.join("ws"), root.join("link")).unwrap();
        assert_eq!(
            resolve_lenient(&root.join("link/state/x")).unwrap(),
            root.join("ws/state/x")
        );
        assert_eq!(
            resolve_lenient(&root.join("new/../ws")).unwrap(),
            root.join("ws")
        );
    }
}
