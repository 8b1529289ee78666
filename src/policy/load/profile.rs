//! `profiles/NAME.toml`: a sandbox profile.

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::time::Duration;

use serde::Deserialize;
use toml::Spanned;

use super::*;

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct RawProfile {
    landlock: Option<RawLandlock>,
    seccomp: Option<RawSeccomp>,
    network: Option<RawNetwork>,
    limits: Option<RawLimits>,
    env: Option<RawEnv>,
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct RawLandlock {
    abi: Option<Spanned<u8>>,
    best_effort: Option<bool>,
    #[serde(default)]
    read: Vec<Spanned<PathBuf>>,
    #[serde(default)]
    exec: Vec<Spanned<PathBuf>>,
    #[serde(default)]
    write: Vec<Spanned<PathBuf>>,
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct RawSeccomp {
    mode: SeccompMode,
    syscalls: Vec<Spanned<String>>,
    errno: Option<Spanned<String>>,
    /// Syscalls added on one architecture only (`x86_64 = [...]`, `aarch64 = [...]`): the
    /// legacy calls x86_64 has and aarch64 does not (`open`, `stat`, `fork`, ...).
    #[serde(default)]
    arch: BTreeMap<String, Spanned<Vec<Spanned<String>>>>,
}

/// The architectures a profile may name in `[seccomp.arch]`.
const ARCHES: &[&str] = &["x86_64", "aarch64"];

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct RawNetwork {
    #[serde(default)]
    allow: bool,
    #[serde(default)]
    unix_sockets: Vec<Spanned<PathBuf>>,
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct RawLimits {
    cpu: Option<Spanned<String>>,
    address_space: Option<Spanned<Size>>,
    file_size: Option<Spanned<Size>>,
    open_files: Option<u64>,
    processes: Option<u64>,
    memory: Option<Spanned<Size>>,
    output: Option<Spanned<Size>>,
    grace: Option<Spanned<String>>,
    staging_size: Option<Spanned<Size>>,
    staging_files: Option<u64>,
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct RawEnv {
    #[serde(default)]
    keep: Vec<String>,
    #[serde(default)]
    set: BTreeMap<String, String>,
}

pub(super) fn load_profile(cx: &mut Cx, path: &Path) -> Option<Profile> {
    let name = path.file_stem()?.to_string_lossy().into_owned();
    let text = cx.read(path)?;
    let raw: RawProfile = cx.parse(path, &text)?;
    let before = cx.diags.len();
    let mut landlock = LandlockProfile {
        abi: 6,
        best_effort: false,
        read: Vec::new(),
        exec: Vec::new(),
        write: Vec::new(),
    };
    if let Some(l) = raw.landlock {
        if let Some(abi) = l.abi {
            if !(6..=7).contains(abi.get_ref()) {
                cx.at(
                    path,
                    &text,
                    abi.span(),
                    format!(
                        "landlock abi {} is not 6 or 7: workers need ABI 6 at least (signal and abstract Unix socket scoping), and this build knows up to 7",
                        abi.get_ref()
                    ),
                );
            }
            landlock.abi = *abi.get_ref();
        }
        landlock.best_effort = l.best_effort.unwrap_or(false);
        for (list, out) in [
            (l.read, &mut landlock.read),
            (l.exec, &mut landlock.exec),
            (l.write, &mut landlock.write),
        ] {
            for p in list {
                if !p.get_ref().is_absolute() {
                    cx.at(
                        path,
                        &text,
                        p.span(),
                        format!("{:?} is not an absolute path", p.get_ref()),
                    );
                }
                out.push(p.into_inner());
            }
        }
    }
    let seccomp = match raw.seccomp {
        Some(s) => {
            let errno = match s.errno {
                None => Errno::EPERM,
                Some(e) => Errno::resolve(e.get_ref()).unwrap_or_else(|| {
                    cx.at(
                        path,
                        &text,
                        e.span(),
                        format!(
                            "errno {:?} is not one of EPERM, EACCES, ENOSYS, EINVAL",
                            e.get_ref()
                        ),
                    );
                    Errno::EPERM
                }),
            };
            let mut names = s.syscalls;
            for (arch, list) in s.arch {
                if !ARCHES.contains(&arch.as_str()) {
                    cx.at(
                        path,
                        &text,
                        list.span(),
                        format!(
                            "unknown architecture {arch:?} (known: {})",
                            ARCHES.join(", ")
                        ),
                    );
                } else if arch == std::env::consts::ARCH {
                    // Only this machine's list can be checked; another's is kept unread.
                    names.extend(list.into_inner());
                }
            }
            let mut syscalls = Vec::with_capacity(names.len());
            for sc in &names {
                if let Some(resolved) = Syscall::resolve(sc.get_ref()) {
                    syscalls.push(resolved);
                } else {
                    cx.at(
                        path,
                        &text,
                        sc.span(),
                        format!(
                            "unknown syscall {:?} on {} (list one architecture's syscalls under [seccomp.arch])",
                            sc.get_ref(),
                            std::env::consts::ARCH
                        ),
                    );
                }
            }
            SeccompProfile {
                mode: s.mode,
                syscalls,
                errno,
            }
        }
        None => SeccompProfile {
            mode: SeccompMode::Deny,
            syscalls: Vec::new(),
            errno: Errno::EPERM,
        },
    };
    let mut limits = Limits::default();
    if let Some(l) = raw.limits {
        let mut size = |v: Option<Spanned<Size>>, out: &mut u64| {
            if let Some(v) = v {
                match v.get_ref().bytes(&text, v.span()) {
                    Ok(n) => *out = n,
                    Err(m) => cx.at(path, &text, v.span(), m),
                }
            }
        };
        size(l.address_space, &mut limits.address_space_bytes);
        size(l.file_size, &mut limits.file_size_bytes);
        size(l.memory, &mut limits.memory_bytes);
        size(l.staging_size, &mut limits.staging_bytes);
        if let Some(v) = l.staging_files {
            limits.staging_files = v;
        }
        let mut out = limits.output_bytes as u64;
        size(l.output, &mut out);
        limits.output_bytes = out as usize;
        if let Some(v) = l.open_files {
            limits.open_files = v;
        }
        if let Some(v) = l.processes {
            limits.processes = v;
        }
        if let Some(v) = l.cpu {
            match parse_duration(v.get_ref()) {
                Ok(d) if d.as_secs() >= 1 => limits.cpu_seconds = d.as_secs(),
                Ok(_) => cx.at(path, &text, v.span(), "cpu limit must be at least 1s"),
                Err(m) => cx.at(path, &text, v.span(), m),
            }
        }
        if let Some(v) = l.grace {
            match parse_duration(v.get_ref()) {
                Ok(d) if d <= Duration::from_secs(60) => limits.grace = d,
                Ok(_) => cx.at(path, &text, v.span(), "grace must be at most 60s"),
                Err(m) => cx.at(path, &text, v.span(), m),
            }
        }
    }
    let (network, unix_sockets) = match raw.network {
        Some(n) => {
            for p in &n.unix_sockets {
                if !p.get_ref().is_absolute() {
                    cx.at(
                        path,
                        &text,
                        p.span(),
                        format!("unix socket {:?} is not an absolute path", p.get_ref()),
                    );
                }
            }
            let sockets = n.unix_sockets.into_iter().map(Spanned::into_inner);
            (n.allow, sockets.collect())
        }
        None => (false, Vec::new()),
    };
    let env = raw
        .env
        .map(|e| EnvProfile {
            keep: e.keep,
            set: e.set,
        })
        .unwrap_or_default();
    if cx.diags.len() != before {
        return None;
    }
    Some(Profile {
        name,
        landlock,
        seccomp,
        network,
        unix_sockets,
        limits,
        env,
    })
}
