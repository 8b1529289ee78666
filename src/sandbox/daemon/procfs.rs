//! `/proc` parsing: the fields of `/proc/PID/stat` the sandbox uses, for one process or all.

/// One line of `/proc/PID/stat`, the fields we use.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct ProcStat {
    pub pid: i32,
    pub state: u8,
    pub ppid: i32,
    pub pgrp: i32,
    pub session: i32,
    /// Start time in clock ticks after boot.
    pub start: u64,
}

impl ProcStat {
    pub(crate) fn parse(line: &str) -> Option<ProcStat> {
        let (head, rest) = line.rsplit_once(')')?;
        let pid = head.split_once(' ')?.0.trim().parse().ok()?;
        let mut fields = rest.split_ascii_whitespace();
        let state = *fields.next()?.as_bytes().first()?;
        let ppid = fields.next()?.parse().ok()?;
        let pgrp = fields.next()?.parse().ok()?;
        let session = fields.next()?.parse().ok()?;
        // Field 22 (starttime) is the 19th after `session` (field 6).
        let start = fields.nth(15)?.parse().ok()?;
        Some(ProcStat {
            pid,
            state,
            ppid,
            pgrp,
            session,
            start,
        })
    }

    /// Exited (its resources are released), whether reaped yet or not.
    pub(crate) fn dead(&self) -> bool {
        matches!(self.state, b'Z' | b'X')
    }
}

/// Every process on the system, as far as `/proc` shows them.
pub(crate) fn all_processes() -> Vec<ProcStat> {
    let Ok(dir) = std::fs::read_dir("/proc") else {
        return Vec::new();
    };
    let mut out = Vec::new();
    let mut path = String::with_capacity(32);
    for entry in dir.flatten() {
        let name = entry.file_name();
        let Some(name) = name.to_str() else { continue };
        if !name.bytes().all(|b| b.is_ascii_digit()) {
            continue;
        }
        path.clear();
        path.push_str("/proc/");
        path.push_str(name);
        path.push_str("/stat");
        if let Some(stat) = read_stat_file(&path) {
            out.push(stat);
        }
    }
    out
}

pub(crate) fn read_stat(pid: i32) -> Option<ProcStat> {
    read_stat_file(&format!("/proc/{pid}/stat"))
}

/// The longest `/proc/PID/stat` line: 52 fields of at most 20 digits each, and a command
/// name of at most 64 bytes, with room to spare.
const STAT_MAX: usize = 2048;

/// Reads one `/proc/PID/stat` file (`open`, one `read`, `close`: the kernel makes the whole
/// line at the first read; `read_to_string` would `statx` it and read it in growing pieces,
/// since procfs reports a size of 0) and parses it.
fn read_stat_file(path: &str) -> Option<ProcStat> {
    use std::io::Read;
    let mut file = std::fs::File::open(path).ok()?;
    let mut buf = [0u8; STAT_MAX];
    let mut len = 0;
    // The line ends with a newline: once it is in, the next read would return 0.
    while len < buf.len() && !buf[..len].ends_with(b"\n") {
        match file.read(&mut buf[len..]) {
            Ok(0) => break,
            Ok(n) => len += n,
            Err(e) if e.kind() == std::io::ErrorKind::Interrupted => {}
            Err(_) => return None,
        }
    }
    ProcStat::parse(std::str::from_utf8(&buf[..len]).ok()?)
}

/// Reads a small `/proc` file whole without the `statx` and the growing reads of
/// `read_to_string` (procfs reports a size of 0): `open`, a read into room for `hint`
/// bytes, the read that returns 0, `close`.
pub(crate) fn read_proc_file(path: &str, hint: usize) -> Option<String> {
    use std::io::Read;
    let mut file = std::fs::File::open(path).ok()?;
    // Not `File::read_to_end`: it asks the file's size and position first (`statx`, `lseek`).
    let mut buf = vec![0u8; hint.max(64)];
    let mut len = 0;
    loop {
        if len == buf.len() {
            buf.resize(buf.len() * 2, 0);
        }
        match file.read(&mut buf[len..]) {
            Ok(0) => break,
            Ok(n) => len += n,
            Err(e) if e.kind() == std::io::ErrorKind::Interrupted => {}
            Err(_) => return None,
        }
    }
    buf.truncate(len);
    String::from_utf8(buf).ok()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parses_stat_lines() {
        let tail = "0 -1 4194560 100 0 0 0 1 2 0 0 20 0 1 0 98765 2000 300";
        let s = ProcStat::parse(&format!("1234 (sh) S 1 1234 1200 {tail}")).unwrap();
        assert_eq!(
            s,
            ProcStat {
                pid: 1234,
                state: b'S',
                ppid: 1,
                pgrp: 1234,
                session: 1200,
                start: 98765,
            }
        );
        // A command name with spaces and parentheses.
        let s = ProcStat::parse(&format!("77 (a) b (c)) Z 5 6 7 {tail}")).unwrap();
        assert_eq!(
            s,
            ProcStat {
                pid: 77,
                state: b'Z',
                ppid: 5,
                pgrp: 6,
                session: 7,
                start: 98765,
            }
        );
        assert!(
            ProcStat::parse("77 (a) S 5 6 7 0").is_none(),
            "truncated line"
        );
        assert!(s.dead());
        assert!(ProcStat::parse("garbage").is_none());
    }

    #[test]
    fn sees_ourselves() {
        let me = std::process::id() as i32;
        assert!(all_processes().iter().any(|p| p.pid == me));
        let stat = read_stat(me).expect("our own stat");
        assert_eq!(stat.pid, me);
        assert_eq!(stat.ppid, std::os::unix::process::parent_id() as i32);
        assert!(!stat.dead());
        assert!(read_stat(0).is_none(), "no process 0 in /proc");
    }

    #[test]
    fn reads_a_proc_file_whole_past_its_hint() {
        let status = read_proc_file("/proc/self/status", 8).expect("/proc/self/status");
        assert!(status.starts_with("Name:"), "{status}");
        assert!(status.contains("\nPid:\t"), "{status}");
        assert!(status.ends_with('\n'), "{status}");
        assert!(
            status.len() > 512,
            "whole, not cut at the hint: {}",
            status.len()
        );
    }
}
