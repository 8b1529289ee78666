//! The log's chain, rotation, cuts and verification under damage.

use super::*;

fn line(h: &Head) -> String {
    serde_json::json!({"seq": h.next_seq, "kind": "allow", "job": "j".repeat(40), "prev": h.prev})
        .to_string()
}

fn write_n(log: &mut Log, head: &mut Head, n: u64) {
    for _ in 0..n {
        log.append(head, line).unwrap();
    }
}

fn open(path: &Path, max: u64, keep: usize) -> (Log, Head) {
    Log::open(path, max, keep).unwrap()
}

fn reasons(path: &Path) -> Vec<String> {
    check(path).breaks.iter().map(|b| b.to_string()).collect()
}

#[test]
fn the_chain_continues_across_reopen_and_rotation() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("audit.jsonl");
    let (mut log, mut head) = open(&path, 1000, 3);
    // The genesis header is seq 0.
    assert_eq!(head.next_seq, 1);
    let (_, h) = header_of(&first_line(&path).unwrap()).unwrap();
    assert_eq!((h.file, h.chain), (0, Chain::Genesis));
    write_n(&mut log, &mut head, 5);
    drop(log);
    let (mut log, mut h2) = open(&path, 1000, 3);
    assert_eq!(h2, head);
    write_n(&mut log, &mut h2, 60);
    // Rotated by size, at most 3 kept; the chain verifies from where retention cut it.
    let fs = files(&path);
    assert_eq!(fs.len(), 4, "{fs:?}");
    assert!(!rotated(&path, 4).exists());
    assert!(!next_path(&path).exists());
    for f in &fs {
        let m = std::fs::metadata(f).unwrap();
        assert_eq!(m.permissions().mode() & 0o7777, 0o600);
        assert!(m.len() <= 1000, "{} has {} bytes", f.display(), m.len());
        assert!(
            header_of(&first_line(f).unwrap()).is_some(),
            "{}",
            f.display()
        );
    }
    let v = verify(&path).unwrap();
    assert_eq!(v.last_seq, Some(h2.next_seq - 1));
    let r = v.retention.clone().expect("retention removed files");
    assert!(r.files > 0 && r.first_seq > 0, "{v:?}");
    assert_eq!(v.first_seq, Some(r.first_seq));
    assert_eq!(v.lines, h2.next_seq - r.first_seq);
    // The events: every line but the headers.
    assert_eq!(v.events, v.lines - 4);
}

#[test]
fn an_edited_or_removed_line_breaks_the_chain() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("audit.jsonl");
    let (mut log, mut head) = open(&path, 1 << 20, 3);
    write_n(&mut log, &mut head, 5);
    assert_eq!(verify(&path).unwrap().events, 5);
    let good = std::fs::read_to_string(&path).unwrap();
    let lines: Vec<&str> = good.lines().collect();
    // Edited.
    let edited: String = lines
        .iter()
        .enumerate()
        .map(|(i, l)| match i {
            2 => format!("{}\n", l.replace("\"allow\"", "\"deny\"")),
            _ => format!("{l}\n"),
        })
        .collect();
    std::fs::write(&path, &edited).unwrap();
    let e = verify(&path).unwrap_err();
    assert_eq!(e.line, 4, "{e}");
    assert!(e.reason.contains("edited, removed or inserted"), "{e}");
    // Removed.
    let removed: String = lines
        .iter()
        .enumerate()
        .filter(|(i, _)| *i != 3)
        .map(|(_, l)| format!("{l}\n"))
        .collect();
    std::fs::write(&path, removed).unwrap();
    assert_eq!(verify(&path).unwrap_err().line, 4);
    std::fs::write(&path, good).unwrap();
    assert!(verify(&path).is_ok());
}

#[test]
fn a_failing_sink_leaves_no_partial_line() {
    // /dev/full: every write fails with ENOSPC, a real failing device.
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("audit.jsonl");
    let (log, mut head) = open(&path, 1 << 20, 1);
    let before = std::fs::read(&path).unwrap();
    let f = File::options().append(true).open("/dev/full").unwrap();
    let mut log = log.replace_file_for_test(f);
    let was = head.clone();
    let e = log.append(&mut head, line).unwrap_err();
    let shown = crate::report::chain(&e).to_string();
    assert!(shown.contains("No space left"), "{shown}");
    assert_eq!(head, was);
    assert_eq!(std::fs::read(&path).unwrap(), before);
}

#[test]
fn a_partial_last_line_is_cut_at_open() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("audit.jsonl");
    let (mut log, mut head) = open(&path, 1 << 20, 3);
    write_n(&mut log, &mut head, 2);
    drop(log);
    let mut f = File::options().append(true).open(&path).unwrap();
    f.write_all(b"{\"seq\":3,\"ki").unwrap();
    drop(f);
    let (_log, h) = open(&path, 1 << 20, 3);
    assert_eq!(h, head);
    assert_eq!(verify(&path).unwrap().events, 2);
}

/// A rotation whose next file cannot be created (here a directory in its place; on a
/// full disk, ENOSPC or no inode) removes nothing, writes on in the current file, and
/// succeeds at the next write once the obstacle is gone.
#[test]
fn a_rotation_that_cannot_create_the_next_file_loses_nothing_and_recovers() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("audit.jsonl");
    let (mut log, mut head) = open(&path, 1000, 1);
    write_n(&mut log, &mut head, 30);
    let kept: Vec<(PathBuf, Vec<u8>)> = files(&path)
        .into_iter()
        .map(|f| {
            let b = std::fs::read(&f).unwrap();
            (f, b)
        })
        .collect();
    assert_eq!(kept.len(), 2);
    std::fs::create_dir(next_path(&path)).unwrap();
    write_n(&mut log, &mut head, 30);
    assert!(
        log.rotation_failures >= 20,
        "every write past the size retried: {}",
        log.rotation_failures
    );
    // Nothing removed, the old file untouched, the current one grown past its size.
    assert_eq!(files(&path).len(), 2);
    assert_eq!(std::fs::read(&kept[0].0).unwrap(), kept[0].1);
    let now = std::fs::read(&path).unwrap();
    assert!(now.starts_with(&kept[1].1) && now.len() > 1000);
    assert!(verify(&path).is_ok());
    // The obstacle gone, the next write rotates; retention removes the file it replaced.
    std::fs::remove_dir(next_path(&path)).unwrap();
    write_n(&mut log, &mut head, 1);
    assert_eq!(log.rotation_failures, 0);
    assert_eq!(std::fs::read(rotated(&path, 1)).unwrap().len(), now.len());
    assert!(!rotated(&path, 2).exists());
    let v = verify(&path).unwrap();
    assert_eq!(v.last_seq, Some(head.next_seq - 1));
    assert!(v.retention.is_some(), "{v:?}");
}

#[test]
fn verify_tells_retention_from_lines_or_files_removed() {
    let dir = tempfile::tempdir().unwrap();
    // A log never rotated whose first lines were removed.
    let path = dir.path().join("one.jsonl");
    let (mut log, mut head) = open(&path, 1 << 20, 3);
    write_n(&mut log, &mut head, 6);
    drop(log);
    let text = std::fs::read_to_string(&path).unwrap();
    let rest: String = text.lines().skip(3).map(|l| format!("{l}\n")).collect();
    std::fs::write(&path, rest).unwrap();
    let r = reasons(&path);
    assert_eq!(r.len(), 1, "{r:?}");
    assert!(
        r[0].contains(":1: the file does not begin with a header line"),
        "{r:?}"
    );

    // Rotated files, none removed by retention (keep 10).
    let path = dir.path().join("many.jsonl");
    let (mut log, mut head) = open(&path, 1000, 10);
    write_n(&mut log, &mut head, 40);
    drop(log);
    let v = verify(&path).unwrap();
    assert!(
        v.files >= 4 && v.retention.is_none() && v.first_seq == Some(0),
        "{v:?}"
    );
    // A file missing in the middle.
    let middle = rotated(&path, 2);
    let saved = std::fs::read(&middle).unwrap();
    std::fs::remove_file(&middle).unwrap();
    let r = reasons(&path);
    assert_eq!(r.len(), 1, "{r:?}");
    assert!(r[0].contains("1 file(s) missing in the middle"), "{r:?}");
    std::fs::write(&middle, saved).unwrap();
    // The oldest file removed, which retention (keep 10) did not do.
    let n = files(&path).len() - 1;
    std::fs::remove_file(rotated(&path, n)).unwrap();
    let r = reasons(&path);
    assert_eq!(r.len(), 1, "{r:?}");
    assert!(r[0].contains("removed outside retention"), "{r:?}");

    // Retention (keep 1) removes the oldest: reported as such, not as a break.
    let path = dir.path().join("kept.jsonl");
    let (mut log, mut head) = open(&path, 1000, 1);
    write_n(&mut log, &mut head, 40);
    drop(log);
    let v = verify(&path).unwrap();
    assert_eq!(v.files, 2);
    let removed = v.retention.expect("retention recorded");
    assert!(removed.files >= 2, "{removed:?}");
    assert_eq!(Some(removed.first_seq), v.first_seq);
    // And the file retention kept, removed: a break.
    std::fs::remove_file(rotated(&path, 1)).unwrap();
    let r = reasons(&path);
    assert!(
        r.iter().any(|r| r.contains("removed outside retention")),
        "{r:?}"
    );
}

#[test]
fn a_damaged_or_missing_current_file_restarts_the_chain_and_verify_says_so() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("audit.jsonl");
    let (mut log, mut head) = open(&path, 1 << 20, 3);
    write_n(&mut log, &mut head, 3);
    drop(log);
    // Garbage after the last line.
    let mut f = File::options().append(true).open(&path).unwrap();
    f.write_all(b"not json\n").unwrap();
    drop(f);
    let (mut log, mut h) = open(&path, 1 << 20, 3);
    write_n(&mut log, &mut h, 1);
    drop(log);
    let (_, hd) = header_of(&first_line(&path).unwrap()).unwrap();
    assert_eq!(hd.chain, Chain::Restarted);
    assert!(hd.reason.unwrap().contains("not an audit line"));
    assert_eq!(files(&path).len(), 2);
    let r = reasons(&path);
    assert!(r.iter().any(|r| r.contains("not a JSON line")), "{r:?}");
    assert!(
        r.iter().any(|r| r.contains("the chain restarted here")),
        "{r:?}"
    );

    // The current file removed: the next start says so.
    let path = dir.path().join("b.jsonl");
    let (mut log, mut head) = open(&path, 1000, 3);
    write_n(&mut log, &mut head, 20);
    drop(log);
    std::fs::remove_file(&path).unwrap();
    let (_log, h) = open(&path, 1000, 3);
    let (seq, hd) = header_of(&first_line(&path).unwrap()).unwrap();
    assert_eq!(hd.chain, Chain::Restarted);
    assert!(hd.reason.unwrap().contains("is missing"));
    // The seq goes on from the newest file kept.
    assert_eq!(h.next_seq, seq + 1);
    assert!(seq > 1);
    assert!(reasons(&path).iter().any(|r| r.contains("restarted")));
}

#[test]
fn a_rotation_cut_by_a_crash_is_completed_or_undone_at_open() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("audit.jsonl");
    let (mut log, mut head) = open(&path, 1000, 3);
    write_n(&mut log, &mut head, 12);
    let before = check(&path);
    // Stopped between the renames: the current file moved, the next one not in place.
    let mut hd = head.clone();
    let header = Header {
        format: FORMAT,
        log: log.id.clone(),
        file: log.index + 1,
        chain: Chain::Rotated,
        reason: None,
        after: Some(After {
            seq: head.next_seq - 1,
            sha256: head.prev.clone(),
        }),
        retained: log.retained_after(true, head.next_seq),
    };
    std::fs::write(next_path(&path), header_text(&hd, &header) + "\n").unwrap();
    hd = hd.after(header_text(&hd, &header).as_bytes());
    let _ = hd;
    for (n, p) in numbered(&path).into_iter().rev() {
        std::fs::rename(p, rotated(&path, n + 1)).unwrap();
    }
    std::fs::rename(&path, rotated(&path, 1)).unwrap();
    drop(log);
    let (_log, h) = open(&path, 1000, 3);
    assert_eq!(h.next_seq, head.next_seq + 1);
    let v = verify(&path).unwrap();
    assert_eq!(v.files, before.files + 1);
    // Stopped before the current file moved: the next file is removed.
    std::fs::write(next_path(&path), b"{}\n").unwrap();
    let (_log, h2) = open(&path, 1000, 3);
    assert_eq!(h2, h);
    assert!(!next_path(&path).exists());
    assert!(verify(&path).is_ok());
}
