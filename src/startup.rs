//! The one startup path of `airlock serve` and `airlock recover`: create the dirs, check
//! their layout, lock the workspace and the state dir, open them, decide the worker
//! identities, kill what a dead daemon's workers left, and bring every leftover job dir to
//! all-old or all-new. `serve` hands the result to [`crate::exec::Executor::start`];
//! `recover` prints what recovery did and exits.

use std::path::{Path, PathBuf};

use crate::audit::{Audit, CallRef, Event};
use crate::policy::DaemonConfig;
use crate::publish::{self, Workspace};
use crate::sandbox::{Identities, Registry};
use crate::session::{SessionError, SessionStore};

/// Recovery settled a job but its audit event could not be written durably: recovery stops
/// there, as it does when the session store cannot answer.
#[derive(Debug, thiserror::Error)]
#[error("cannot record what recovery did in the audit log")]
pub struct RecoveryNotRecorded(#[source] pub crate::audit::AuditError);

#[derive(Debug, thiserror::Error)]
pub enum StartupError {
    #[error("cannot create the workspace {path}")]
    Workspace {
        path: PathBuf,
        source: std::io::Error,
    },
    #[error("cannot open the workspace")]
    OpenWorkspace(#[from] publish::PublishError),
    #[error("cannot open the session store")]
    Sessions(#[from] SessionError),
    #[error("cannot open the job records")]
    Jobs(#[source] crate::jobs::JobError),
    #[error("startup recovery failed")]
    Recovery(#[source] crate::publish::PublishError),
    #[error(transparent)]
    AuditLog(#[from] crate::audit::log::LogError),
    #[error("{path}: another airlock process{} holds this {what}; stop it first (one daemon, or `airlock recover`, per workspace and per state dir)", holder.map(|p| format!(" (pid {p})")).unwrap_or_default())]
    Busy {
        what: &'static str,
        path: PathBuf,
        holder: Option<u32>,
    },
    #[error("{path}: cannot lock the {what}")]
    Lock {
        what: &'static str,
        path: PathBuf,
        source: crate::fsutil::LockError,
    },
    #[error("cannot create the state dir {path}")]
    StateDir {
        path: PathBuf,
        source: std::io::Error,
    },
    /// Refused before anything is created: no workspace, state dir or socket is made. Only
    /// the workspace itself counts: an ancestor other users cannot search is passed by
    /// workers starting in their working directory ([`WorkerReach::FromWorkingDir`]).
    #[error(
        "workers run under uids of their own and cannot enter the workspace {workspace}: \
         it is not searchable by other users (mode {mode:04o}), and a worker never runs as \
         uid 0; make it searchable (chmod o+x {workspace}) or give another one (--workspace \
         DIR, or workspace = in {}){shared}",
        config.display()
    )]
    Unreachable {
        workspace: PathBuf,
        mode: u32,
        /// The policy file that holds `workspace` and `worker_user`.
        config: PathBuf,
        /// How workers could share the daemon's uid instead; empty for a root daemon (that
        /// would be uid 0).
        shared: String,
    },
    #[error("worker identities")]
    Identity(#[from] crate::sandbox::IdentityError),
    #[error("cannot open the worker registry")]
    Registry(#[source] crate::sandbox::RegistryError),
    #[error("cannot resolve {path}")]
    Resolve {
        path: PathBuf,
        source: std::io::Error,
    },
    /// The state dir or the socket is inside the workspace, where a tool could publish over
    /// it (a forged session file, say).
    #[error("the {what} {path} is inside {workspace}; keep the workspace, the state dir and the socket apart (workspace, state_dir and socket in airlock.toml, or --workspace / --state-dir / --socket)")]
    InsideWorkspace {
        what: &'static str,
        path: PathBuf,
        workspace: PathBuf,
    },
}

/// What the startup path holds when it is done: the locks (held as long as this lives), the
/// opened workspace and store, who workers run as, the worker registry, the audit log, and
/// what recovery did.
pub struct Opened {
    pub workspace_lock: std::fs::File,
    pub state_lock: std::fs::File,
    pub workspace: Workspace,
    pub sessions: SessionStore,
    pub identities: Identities,
    pub registry: Registry,
    pub audit: Audit,
    pub recovered: Vec<publish::Recovered>,
    /// The job records, every one a crash left pending settled as recovery decided.
    pub jobs: crate::jobs::JobStore,
    /// How workers name the workspace's files.
    pub reach: WorkerReach,
}

/// How a worker reaches the workspace: by absolute path, or, when a directory above it is
/// not searchable by the worker's uid (a checkout under `/root`, mode 0700), relative to its
/// working directory. The launcher enters that directory while it still holds the daemon's
/// privilege, and a lookup relative to the working directory needs no search right on its
/// ancestors, so the worker still reaches what its Landlock rules allow, and nothing else
/// (file permissions below the workspace apply as ever).
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub enum WorkerReach {
    #[default]
    Absolute,
    FromWorkingDir {
        /// The first directory above the workspace other users cannot search.
        unsearchable: PathBuf,
        mode: u32,
    },
}

impl WorkerReach {
    /// Said once at start, after who workers run as.
    pub fn describe(&self) -> String {
        match self {
            WorkerReach::Absolute => "workers are handed absolute paths".to_string(),
            WorkerReach::FromWorkingDir { unsearchable, mode } => format!(
                "workers are handed paths relative to their working directory (the workspace \
                 for a read tool, the staging dir for a write tool), since {} is not \
                 searchable by other users (mode {mode:04o}); a tool that changes directory \
                 must resolve its paths first (make {} searchable, or move the workspace, \
                 for absolute paths)",
                unsearchable.display(),
                unsearchable.display()
            ),
        }
    }
}

/// Who runs the startup path; the steps are the same, these are the differences.
#[derive(Debug, Clone, Copy)]
pub enum Purpose<'a> {
    /// `airlock serve`: creates a missing workspace, keeps `socket` out of it, and fails if
    /// the worker identities cannot be had or workers could not reach the workspace (before
    /// anything is created). `config`: the policy file (`airlock.toml`) the refusal names.
    Serve { socket: &'a Path, config: &'a Path },
    /// `airlock recover`: serves no call, so worker identities only give the uid leases the
    /// sweep takes; if they cannot be had (no privilege), records naming a uid are left.
    Recover,
}

/// Runs the startup path in its fixed order (each step says why it comes where it does).
pub fn open(d: &DaemonConfig, purpose: Purpose<'_>) -> Result<Opened, StartupError> {
    // Layout, identities and reach first: a refusal leaves nothing behind (no workspace,
    // no state dir; the socket is bound only after this returns).
    let socket = match purpose {
        Purpose::Serve { socket, .. } => Some(socket),
        Purpose::Recover => None,
    };
    // Layout before locks: a state dir inside the workspace is refused before it is made.
    check_layout(&d.workspace, &d.state_dir, socket)?;
    let (identities, reach) = match purpose {
        Purpose::Serve { config, .. } => {
            let ids = Identities::detect(
                d.worker_user,
                d.worker_uids,
                d.max_concurrent_calls,
                &d.worker_uid_lock_dir,
            )?;
            let reach = match ids.range() {
                Some(_) => check_reachable_by_workers(&d.workspace, config)?,
                None => WorkerReach::Absolute,
            };
            std::fs::create_dir_all(&d.workspace).map_err(|source| StartupError::Workspace {
                path: d.workspace.clone(),
                source,
            })?;
            (ids, reach)
        }
        Purpose::Recover => {
            match Identities::detect(d.worker_user, d.worker_uids, 1, &d.worker_uid_lock_dir) {
                Ok(ids) => (ids, WorkerReach::Absolute),
                Err(e) => {
                    tracing::warn!(
                        "recover: {}; sweeping the registry's records only",
                        crate::report::chain(&e)
                    );
                    (Identities::Daemon, WorkerReach::Absolute)
                }
            }
        }
    };
    let workspace_lock = lock_workspace(&d.workspace)?;
    let state_lock = lock_state_dir(&d.state_dir)?;
    let workspace = Workspace::open(&d.workspace)?;
    let sessions = SessionStore::open(&d.state_dir)?;
    // Before recovery touches a job dir, nothing a dead daemon's workers left may run.
    let registry = sweep_leftovers(d, identities.pool())?;
    // Recovery records in the audit log what became of each job it settles.
    let audit = open_audit(d)?;
    let recovered = recover(&workspace, &sessions, &audit)?;
    // After recovery (which keeps a committed job's backups in its undo data): only each
    // live session's latest commit keeps undo data, and only if it is complete.
    sweep_undo(&workspace, &sessions);
    // After recovery and before any new commit: a pending record's job committed iff the
    // session file records it.
    let jobs = open_jobs(d, &sessions, &recovered)?;
    Ok(Opened {
        jobs,
        workspace_lock,
        state_lock,
        workspace,
        sessions,
        identities,
        registry,
        audit,
        recovered,
        reach,
    })
}

/// Opens the job records (settling the pending ones by the session files), then gives
/// each job recovery settled without a record (a crash before its record was written) one
/// saying what recovery did, owned by its session's owner.
fn open_jobs(
    d: &DaemonConfig,
    sessions: &SessionStore,
    recovered: &[publish::Recovered],
) -> Result<crate::jobs::JobStore, StartupError> {
    use crate::jobs::{JobRecord, JobState, JobStore};
    // A session that cannot be read settles nothing: the start fails, naming it, rather
    // than marking a committed job rolled back for good.
    let committed = |s: &str, j: &str| {
        sessions
            .committed(s, j)
            .map_err(|e| Box::new(e) as Box<dyn std::error::Error + Send + Sync>)
    };
    let jobs = JobStore::open(
        &d.state_dir,
        d.idempotency_ttl,
        d.idempotency_keys,
        &committed,
    )
    .map_err(StartupError::Jobs)?;
    for r in recovered {
        let state = match r.settled {
            publish::Settled::NeverPublished | publish::Settled::RolledBack => JobState::RolledBack,
            publish::Settled::Completed => JobState::Committed,
            publish::Settled::Quarantine | publish::Settled::Kept => continue,
        };
        let (Some(session), Some(tool)) = (&r.session, &r.tool) else {
            continue;
        };
        let Ok(Some(uid)) = sessions.owner(session) else {
            continue;
        };
        if jobs.get(&r.job).is_some() {
            continue;
        }
        let now = crate::audit::time::now_ms();
        jobs.ended(
            &JobRecord {
                job: r.job.clone(),
                uid,
                session: session.clone(),
                tool: tool.clone(),
                key: None,
                digest: String::new(),
                state,
                created_ms: now,
                ended_ms: Some(now),
                version_before: None,
                version_after: None,
                outputs: Vec::new(),
                error: None,
                reply: None,
                recovered: true,
                undo_of: None,
                undo_reason: None,
            },
            true,
        );
    }
    Ok(jobs)
}

/// Removes the undo data a crash left that no undo may use: a generation that is not its
/// live session's latest commit's, or is incomplete. A failure is logged only (such data is
/// never used; the next start tries again).
fn sweep_undo(workspace: &Workspace, sessions: &SessionStore) {
    let latest = |s: &str, j: &str| sessions.committed(s, j).unwrap_or(false);
    match publish::undo::sweep(workspace, &latest) {
        Ok(swept) => {
            for s in swept {
                match s.removed {
                    Some(why) => {
                        tracing::info!(session = %s.session, job = %s.job, %why, "removed undo data")
                    }
                    None => tracing::debug!(session = %s.session, job = %s.job, "kept undo data"),
                }
            }
        }
        Err(e) => {
            tracing::warn!(error = %crate::report::chain(&e), "cannot sweep the undo data; stale data stays unused")
        }
    }
}

/// Locks the workspace for this process: recovery treats every job dir in it as its own.
fn lock_workspace(path: &Path) -> Result<std::fs::File, StartupError> {
    lock(path, "workspace")
}

/// Creates (0700) and locks the state dir for this process: two daemons sharing one would
/// lose each other's session commits.
fn lock_state_dir(path: &Path) -> Result<std::fs::File, StartupError> {
    crate::fsutil::create_private_dir(path).map_err(|source| StartupError::StateDir {
        path: path.to_path_buf(),
        source,
    })?;
    lock(path, "state dir")
}

fn lock(path: &Path, what: &'static str) -> Result<std::fs::File, StartupError> {
    use crate::fsutil::LockError;
    crate::fsutil::lock_dir(path).map_err(|e| match e {
        LockError::Held { holder } => StartupError::Busy {
            what,
            path: path.to_path_buf(),
            holder,
        },
        source => StartupError::Lock {
            what,
            path: path.to_path_buf(),
            source,
        },
    })
}

/// With worker uids, how workers reach the workspace: by absolute path when every directory
/// from `/` down to it is searchable by other users, else from their working directory. The
/// workspace itself must be searchable either way (a worker enters its job dir and names
/// inputs beneath it). Checked on the directories that exist (symlinks resolved), before the
/// workspace is created: the ones `create_dir_all` would make are the daemon's own, mode
/// 0755 under the usual umask.
fn check_reachable_by_workers(
    workspace: &Path,
    config: &Path,
) -> Result<WorkerReach, StartupError> {
    use std::os::unix::fs::PermissionsExt;
    let abs =
        crate::fsutil::resolve_lenient(workspace).map_err(|source| StartupError::Resolve {
            path: workspace.to_path_buf(),
            source,
        })?;
    let mut reach = WorkerReach::Absolute;
    for dir in abs.ancestors() {
        let mode = match std::fs::metadata(dir) {
            Ok(m) => m.permissions().mode(),
            // Not there yet: created below, by the daemon.
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => continue,
            Err(source) => {
                return Err(StartupError::Workspace {
                    path: dir.to_path_buf(),
                    source,
                })
            }
        };
        if mode & 0o001 != 0 {
            continue;
        }
        if dir == abs {
            return Err(StartupError::Unreachable {
                workspace: abs.clone(),
                mode: mode & 0o7777,
                config: config.to_path_buf(),
                shared: shared_uid_hint(config),
            });
        }
        // The topmost one is named: it is the one an operator would open up.
        reach = WorkerReach::FromWorkingDir {
            unsearchable: dir.to_path_buf(),
            mode: mode & 0o7777,
        };
    }
    Ok(reach)
}

/// The last option of [`StartupError::Unreachable`]: workers under the daemon's own uid,
/// offered only when that uid is not 0.
fn shared_uid_hint(config: &Path) -> String {
    let euid = rustix::process::geteuid();
    if euid.is_root() {
        return String::new();
    }
    format!(
        ", or set worker_user = \"daemon\" in {} (workers share the daemon's uid {}, \
         seccomp denying every metadata change)",
        config.display(),
        euid.as_raw()
    )
}

/// Kills every process the workers of this daemon's previous run left, as its own records
/// name them (the registry in the state dir, each record naming a uid swept only under that
/// uid's lease; leftover worker cgroups), then returns the registry for this run. Nothing
/// is killed for its uid alone: another daemon on the host may share the range.
fn sweep_leftovers(
    d: &DaemonConfig,
    pool: Option<&crate::sandbox::Pool>,
) -> Result<Registry, StartupError> {
    let registry = Registry::open(&d.state_dir.join("workers"))
        .map_err(StartupError::Registry)?
        .with_worker_uids(pool);
    let mut lines = registry.sweep(pool);
    if let Some(cg) = &d.cgroup {
        lines.extend(crate::sandbox::sweep_cgroups(cg));
    }
    for line in &lines {
        tracing::warn!("startup: {line}");
    }
    Ok(registry)
}

/// Refuses a state dir or a socket inside the workspace (symlinks resolved, whether they
/// exist yet or not): a tool could publish over them.
fn check_layout(
    workspace: &Path,
    state_dir: &Path,
    socket: Option<&Path>,
) -> Result<(), StartupError> {
    let resolve = |p: &Path| {
        crate::fsutil::resolve_lenient(p).map_err(|source| StartupError::Resolve {
            path: p.to_path_buf(),
            source,
        })
    };
    let ws = resolve(workspace)?;
    let state = resolve(state_dir)?;
    if ws.starts_with(&state) {
        return Err(StartupError::InsideWorkspace {
            what: "workspace",
            path: ws,
            workspace: state,
        });
    }
    let mut others = vec![("state dir", state_dir)];
    if let Some(s) = socket {
        others.push(("socket", s));
    }
    for (what, p) in others {
        let r = resolve(p)?;
        if r.starts_with(&ws) {
            return Err(StartupError::InsideWorkspace {
                what,
                path: if r.as_path() == p {
                    r
                } else {
                    PathBuf::from(format!("{} (resolved: {})", p.display(), r.display()))
                },
                workspace: ws,
            });
        }
    }
    Ok(())
}

/// Opens the durable audit log (`audit_log`, beneath the state dir) and the ring in front of
/// it, continuing the log's hash chain.
fn open_audit(d: &DaemonConfig) -> Result<Audit, StartupError> {
    let (log, head) =
        crate::audit::log::Log::open(&d.audit_log_path(), d.audit_log_bytes, d.audit_log_keep)?;
    Ok(Audit::with_log(d.audit_ring, d.audit_ring_bytes, log, head))
}

/// Brings every leftover job dir to all-old or all-new before serving, and appends to the
/// audit log the event that tells what became of each job (durably: the log's last word on
/// every job matches the workspace).
fn recover(
    workspace: &Workspace,
    sessions: &SessionStore,
    audit: &Audit,
) -> Result<Vec<publish::Recovered>, StartupError> {
    // Each job's event is durable before its journal is dropped: a crash between the two
    // makes the next recovery settle the job and record it again.
    let record = |r: &publish::Recovered| -> Result<(), RecoveryNotRecorded> {
        use crate::audit::event::{Commit, Failure, Kept, Recovery, Rollback};
        let recovery = Recovery {
            recovery: true,
            phase: r.phase.map(str::to_string),
            action: r.action.clone(),
            kept: match (&r.kept, &r.quarantined) {
                (Some(kept), Some(to)) => Some(Kept {
                    code: "RECOVERY_KEPT",
                    quarantined: to.display().to_string(),
                    reason: crate::report::chain(&**kept).to_string(),
                }),
                _ => None,
            },
        };
        let event = match (r.settled, r.phase) {
            (publish::Settled::Completed, _) => Event::Commit(Commit::Recovered(recovery)),
            (publish::Settled::RolledBack, _) => Event::Rollback(Rollback::Recovered(recovery)),
            // Journaled `worker_running`: nothing was published.
            (publish::Settled::NeverPublished, Some(_)) => {
                Event::Rollback(Rollback::Recovered(recovery))
            }
            // No journal: either the job never got past creation (its last word is not a
            // commit) or a committed job's cleanup was cut short (its last word is its
            // commit); recovery changes no target either way, and the log already says so.
            (publish::Settled::NeverPublished, None) | (publish::Settled::Quarantine, _) => {
                return Ok(())
            }
            // Kept aside as it is (it may hold the only old copy of a target): the call did
            // not commit and is not rolled back; the event says where the dir went and why.
            (publish::Settled::Kept, _) => Event::Error(Failure::Recovered(recovery)),
        };
        let call = CallRef {
            call: r.job.clone(),
            tool: r.tool.clone().unwrap_or_default(),
            session: r.session.clone(),
            principal: None,
            secrets: Default::default(),
            request_id: None,
        };
        audit
            .record_durable(&call, event)
            .map_err(RecoveryNotRecorded)
    };
    let done = publish::recover_with(workspace.root(), &|s, j| sessions.committed(s, j), &record)
        .map_err(StartupError::Recovery)?;
    for r in &done {
        if r.quarantined.is_some() {
            tracing::warn!(job = %r.job, "recovery: {}", r.action);
        } else {
            tracing::info!(job = %r.job, "recovery: {}", r.action);
        }
    }
    Ok(done)
}
