//! The installed `airlock.service`, read for what the daemon it starts will be: its `User=`
//! (whom `@daemon` means) and the `--policies`, `--state-dir` and `WorkingDirectory=` of its
//! `ExecStart=` (where the packaged daemon's state, and so its audit log, is).

use std::path::{Path, PathBuf};

/// Where a unit is looked for, in systemd's order of precedence (the first found is used).
/// `AIRLOCK_UNIT_PATH` replaces the list with one path (tests, and a unit installed elsewhere).
pub(super) fn candidates() -> Vec<PathBuf> {
    match std::env::var_os("AIRLOCK_UNIT_PATH") {
        Some(p) => vec![PathBuf::from(p)],
        None => vec![
            PathBuf::from("/etc/systemd/system/airlock.service"),
            PathBuf::from("/usr/lib/systemd/system/airlock.service"),
        ],
    }
}

/// What the unit says, drop-ins (`NAME.d/*.conf`, in name order) applied over it.
#[derive(Debug, Default, PartialEq, Eq)]
pub(super) struct Unit {
    pub path: PathBuf,
    pub user: Option<String>,
    pub working_directory: Option<PathBuf>,
    /// `--policies` of `ExecStart=` for `airlock serve`.
    pub policies: Option<PathBuf>,
    /// `--state-dir` of the same command line.
    pub state_dir: Option<PathBuf>,
}

/// The first installed unit, read; `None` if there is none.
pub(super) fn installed() -> Option<Unit> {
    candidates().into_iter().find_map(|p| read(&p))
}

fn read(path: &Path) -> Option<Unit> {
    let text = std::fs::read_to_string(path).ok()?;
    let mut unit = Unit {
        path: path.to_path_buf(),
        ..Unit::default()
    };
    apply(&mut unit, &text);
    let mut dropins: Vec<PathBuf> = std::fs::read_dir(format!("{}.d", path.display()))
        .into_iter()
        .flatten()
        .flatten()
        .map(|e| e.path())
        .filter(|p| p.extension().is_some_and(|x| x == "conf"))
        .collect();
    dropins.sort();
    for d in dropins {
        if let Ok(t) = std::fs::read_to_string(&d) {
            apply(&mut unit, &t);
        }
    }
    Some(unit)
}

/// The `[Service]` settings of one file over `unit` (a later line wins; an empty `User=`
/// resets it, as systemd does).
pub(super) fn apply(unit: &mut Unit, text: &str) {
    let mut in_service = false;
    for line in text.lines().map(str::trim) {
        if line.starts_with('[') {
            in_service = line == "[Service]";
            continue;
        }
        if !in_service || line.starts_with('#') || line.starts_with(';') {
            continue;
        }
        let Some((key, value)) = line.split_once('=') else {
            continue;
        };
        let value = value.trim();
        match key.trim() {
            "User" => unit.user = (!value.is_empty()).then(|| value.to_string()),
            "WorkingDirectory" => {
                let v = value.trim_start_matches('-');
                unit.working_directory = (!v.is_empty() && v != "~").then(|| PathBuf::from(v));
            }
            "ExecStart" => {
                let words: Vec<&str> = value.split_whitespace().collect();
                if !words.contains(&"serve") {
                    continue;
                }
                let flag = |name: &str| {
                    words.iter().enumerate().find_map(|(i, w)| {
                        if let Some(v) = w.strip_prefix(&format!("{name}=")) {
                            Some(PathBuf::from(v))
                        } else if *w == name {
                            words.get(i + 1).map(PathBuf::from)
                        } else {
                            None
                        }
                    })
                };
                unit.policies = flag("--policies");
                unit.state_dir = flag("--state-dir");
            }
            _ => {}
        }
    }
}

/// Whether `unit` serves the policy directory `dir` (the same directory, however named).
pub(super) fn serves(unit: &Unit, dir: &Path) -> bool {
    let Some(p) = &unit.policies else {
        return false;
    };
    match (std::fs::canonicalize(p), std::fs::canonicalize(dir)) {
        (Ok(a), Ok(b)) => a == b,
        _ => p == dir,
    }
}

/// The state dir the unit's daemon uses: its `--state-dir`, beneath its
/// `WorkingDirectory=` when relative.
pub(super) fn state_dir(unit: &Unit) -> Option<PathBuf> {
    let s = unit.state_dir.as_ref()?;
    Some(match &unit.working_directory {
        Some(w) if s.is_relative() => w.join(s),
        _ => s.clone(),
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_shipped_unit_names_its_user_policies_and_state_dir() {
        let text = std::fs::read_to_string(
            Path::new(env!("CARGO_MANIFEST_DIR")).join("systemd/airlock.service"),
        )
        .expect("systemd/airlock.service");
        let mut u = Unit::default();
        apply(&mut u, &text);
        assert_eq!(u.user.as_deref(), Some("airlock"));
        assert_eq!(u.policies, Some(PathBuf::from("/etc/airlock")));
        assert_eq!(state_dir(&u), Some(PathBuf::from("/var/lib/airlock/state")));
    }

    #[test]
    fn a_later_user_line_wins_and_an_empty_one_resets() {
        let mut u = Unit::default();
        apply(&mut u, "[Unit]\nUser=nobody\n[Service]\nUser=a\nUser=b\n");
        assert_eq!(u.user.as_deref(), Some("b"));
        apply(&mut u, "[Service]\nUser=\n");
        assert_eq!(u.user, None);
    }
}
