//! The daemon's commands: `serve` (socket, signals, SIGHUP reload, systemd notifications)
//! and `recover`.

use std::path::PathBuf;
use std::sync::Arc;
use std::time::Duration;

use tokio_util::sync::CancellationToken;

use super::args::{Dirs, ServeArgs};
use super::policy::load_policy;
use super::Exit;
use crate::policy::{self, Policy};

fn apply_overrides(p: &mut Policy, workspace: Option<PathBuf>, state_dir: Option<PathBuf>) {
    if let Some(w) = workspace {
        p.daemon.workspace = w;
    }
    if let Some(s) = state_dir {
        p.daemon.state_dir = s;
    }
}

/// The state dir of the daemon the installed `airlock.service` starts on `policies` (its
/// `--state-dir`, beneath its `WorkingDirectory=` when relative): what `audit` and
/// `recover` use without `--state-dir`, so that they find what that daemon wrote.
pub(super) fn unit_state_dir(policies: &std::path::Path) -> Option<PathBuf> {
    super::unit::installed()
        .filter(|u| super::unit::serves(u, policies))
        .and_then(|u| super::unit::state_dir(&u))
}

pub(super) fn recover(a: Dirs) -> Exit {
    // Not a policy directory at all is an error even with both dirs given: a typo must not
    // recover with the defaults.
    if let Err(code) = super::policy::require_dir(&a.policies, Exit::Error) {
        return code;
    }
    let mut policy = match policy::load(&a.policies) {
        Ok(p) => p,
        // Recovery needs no tool, only where the workspace and state are: with both given,
        // a broken policy is reported and the [daemon] defaults (worker_uids among them)
        // stand in for the rest.
        Err(e) if a.workspace.is_some() && a.state_dir.is_some() => {
            for d in &e.0 {
                eprintln!("airlock: {d}");
            }
            eprintln!(
                "airlock: {}: {} error(s); recovering with the default [daemon] settings and the given --workspace and --state-dir",
                a.policies.display(),
                e.0.len()
            );
            Policy {
                dir: a.policies.clone(),
                daemon: Default::default(),
                profiles: Default::default(),
                tools: Default::default(),
                grants: Vec::new(),
            }
        }
        Err(e) => {
            eprintln!("airlock: {}", crate::report::chain(&e));
            eprintln!(
                "airlock: recover: fix the policy, or give both --workspace and --state-dir to recover without it"
            );
            return Exit::Error;
        }
    };
    let state_dir = a.state_dir.or_else(|| unit_state_dir(&a.policies));
    apply_overrides(&mut policy, a.workspace, state_dir);
    let result = crate::startup::open(&policy.daemon, crate::startup::Purpose::Recover)
        .map(|opened| opened.recovered);
    match result {
        Ok(done) => {
            for r in &done {
                println!("{}: {}", r.job, r.action);
            }
            use crate::publish::Settled;
            let aside = |kept: bool| -> Vec<_> {
                done.iter()
                    .filter(|r| (r.settled == Settled::Kept) == kept)
                    .filter_map(|r| r.quarantined.as_ref())
                    .collect()
            };
            let (kept, quarantined) = (aside(true), aside(false));
            println!(
                "recovered {} job(s)",
                done.len() - kept.len() - quarantined.len()
            );
            if !kept.is_empty() {
                println!(
                    "{} job dir(s) are kept aside with every byte: recovery could not prove them disposable (see each line above); no target was changed for them and their sessions keep the old version. Compare each backup with its target, restore by hand, then remove the dir:",
                    kept.len()
                );
                for q in kept {
                    println!("  {}", q.display());
                }
            }
            if !quarantined.is_empty() {
                println!(
                    "{} job dir(s) are quarantined and never touched by recovery (tools cannot reach them); remove them by hand once dealt with:",
                    quarantined.len()
                );
                for q in quarantined {
                    println!("  {}", q.display());
                }
            }
            Exit::Ok
        }
        Err(e) => {
            eprintln!("airlock: recover: {}", crate::report::chain(&e));
            Exit::Error
        }
    }
}

/// `activation` is what [`crate::systemd::take_listener`] found, taken before the runtime
/// started.
pub(super) async fn serve(
    a: ServeArgs,
    activation: Result<Option<std::os::unix::net::UnixListener>, crate::systemd::ActivationError>,
) -> Exit {
    let notify = Arc::new(crate::systemd::Notifier::from_env());
    let (workspace, state_dir, socket) = (a.dirs.workspace, a.dirs.state_dir, a.socket);
    let policies = a.dirs.policies;
    let mut policy = match load_policy(&policies) {
        Ok(p) => p,
        Err(code) => return code,
    };
    apply_overrides(&mut policy, workspace.clone(), state_dir.clone());
    if let Some(s) = &socket {
        policy.daemon.socket = s.clone();
    }
    let sandbox = match crate::sandbox::Sandbox::start(crate::sandbox::default_launcher_exe()) {
        Ok(s) => s,
        Err(e) => {
            eprintln!("airlock: {}", crate::report::chain(&e));
            return Exit::Error;
        }
    };
    let policy = Arc::new(policy);
    let shutdown = CancellationToken::new();
    let config = policies.join("airlock.toml");
    let purpose = crate::startup::Purpose::Serve {
        socket: &policy.daemon.socket,
        config: &config,
    };
    let exec = match crate::startup::open(&policy.daemon, purpose) {
        Ok(opened) => Arc::new(crate::exec::Executor::start(
            policy.clone(),
            opened,
            sandbox,
            shutdown.clone(),
        )),
        Err(e) => {
            eprintln!("airlock: {}", crate::report::chain(&e));
            return Exit::Error;
        }
    };
    // Installed before the socket is bound: a client can connect as soon as it listens
    // (before any accept), and a SIGTERM sent then must not find the default action, which
    // would kill the daemon and leave its socket file.
    let signals = match Signals::install() {
        Ok(s) => s,
        Err(e) => {
            eprintln!(
                "airlock: cannot install signal handlers: {}",
                crate::report::chain(&e)
            );
            return Exit::Error;
        }
    };
    let d = &policy.daemon;
    // Socket-activated: systemd owns the socket file (mode, group, removal); otherwise the
    // daemon binds it and removes it at exit.
    let (listener, activated) = match activation {
        Ok(Some(l)) => match tokio::net::UnixListener::from_std(l) {
            Ok(l) => (l, true),
            Err(e) => {
                eprintln!(
                    "airlock: socket activation: cannot use the passed listener: {}",
                    crate::report::chain(&e)
                );
                return Exit::Error;
            }
        },
        Ok(None) => match crate::mcp::bind(&d.socket, d.socket_mode, d.socket_group.as_deref()) {
            Ok(l) => (l, false),
            Err(e) => {
                eprintln!("airlock: {}", crate::report::chain(&e));
                return Exit::Error;
            }
        },
        Err(e) => {
            eprintln!("airlock: {}", crate::report::chain(&e));
            return Exit::Error;
        }
    };
    tracing::info!(
        socket = %d.socket.display(),
        socket_activated = activated,
        workspace = %d.workspace.display(),
        tools = policy.tools.len(),
        "airlock serving"
    );
    // What the rest needs of the start's policy, so that it is not held for the daemon's
    // life: a reload's old profiles (and their worker templates) go once nothing holds them.
    let socket_path = d.socket.clone();
    let shutdown_timeout = d.shutdown_timeout;
    drop(policy);
    // Policies loaded, recovery done, the socket listening: ready.
    notify.ready(&status_line(&exec));
    let reload = Reload {
        dir: policies,
        workspace,
        state_dir,
        socket,
        exec: exec.clone(),
        notify: notify.clone(),
    };
    let stop = shutdown.clone();
    let stopping = notify.clone();
    tokio::spawn(async move {
        signals.wait_for_stop(&reload).await;
        stopping.stopping();
        tracing::info!(
            "shutting down: cancelling running calls (exit within {shutdown_timeout:?} and a second)"
        );
        stop.cancel();
    });
    if notify.enabled() {
        tokio::spawn(keep_systemd_informed(
            notify.clone(),
            exec.clone(),
            shutdown.clone(),
        ));
    }
    let workspace_of = exec.clone();
    crate::mcp::run(listener, exec, shutdown).await;
    workspace_of.workspace.release_idle_job_dirs();
    if !activated {
        let _ = std::fs::remove_file(&socket_path);
    }
    tracing::info!("stopped");
    Exit::Ok
}

fn status_line(exec: &crate::exec::Executor) -> String {
    let p = exec.policy();
    format!(
        "serving {} tools; {} call(s) in flight",
        p.tools.len(),
        exec.calls_in_flight()
    )
}

/// `STATUS=` when the calls in flight change (at most once a second) and `WATCHDOG=1` at
/// half of `WatchdogSec`, until shutdown; nothing else wakes it.
async fn keep_systemd_informed(
    notify: Arc<crate::systemd::Notifier>,
    exec: Arc<crate::exec::Executor>,
    shutdown: CancellationToken,
) {
    let watchdog = notify.watchdog_interval();
    // READY=1 said the status already.
    let mut last_status = status_line(&exec);
    let mut next_watchdog = tokio::time::Instant::now();
    loop {
        if let Some(w) = watchdog {
            if tokio::time::Instant::now() >= next_watchdog {
                notify.watchdog();
                next_watchdog = tokio::time::Instant::now() + w;
            }
        }
        let status = status_line(&exec);
        if status != last_status {
            notify.status(&status);
            last_status = status;
        }
        // Asleep until the calls in flight change or the watchdog is due: an idle daemon
        // without `WatchdogSec` never wakes.
        tokio::select! {
            _ = exec.in_flight_changed() => {}
            _ = tokio::time::sleep_until(next_watchdog), if watchdog.is_some() => {}
            _ = shutdown.cancelled() => return,
        }
        // At most one `STATUS=` a second while calls come and go (each change is seen at
        // the next pass: a change during the pause is kept by the notification).
        tokio::select! {
            _ = tokio::time::sleep(STATUS_EVERY.min(watchdog.unwrap_or(STATUS_EVERY))) => {}
            _ = shutdown.cancelled() => return,
        }
    }
}

/// The shortest interval between two `STATUS=` updates.
const STATUS_EVERY: Duration = Duration::from_secs(1);

/// What SIGHUP needs: the policy directory and the command line's overrides.
struct Reload {
    dir: PathBuf,
    workspace: Option<PathBuf>,
    state_dir: Option<PathBuf>,
    socket: Option<PathBuf>,
    exec: Arc<crate::exec::Executor>,
    notify: Arc<crate::systemd::Notifier>,
}

impl Reload {
    /// Re-reads the policy directory. A valid one serves every call that starts from now
    /// on (tools, profiles); the daemon settings keep the values the daemon started with,
    /// and a changed one is logged as needing a restart. An invalid one changes nothing;
    /// each of its errors is logged as `file:line:col: message`, as `policy check` prints.
    fn run(&self) {
        self.notify.reloading();
        let old = self.exec.policy();
        match policy::load(&self.dir) {
            Err(e) => {
                for d in &e.0 {
                    tracing::error!("reload: {d}");
                }
                tracing::error!(
                    "reload: {}: {} error(s); still serving the policy loaded before ({} tools)",
                    self.dir.display(),
                    e.0.len(),
                    old.tools.len()
                );
            }
            Ok(mut new) => {
                apply_overrides(&mut new, self.workspace.clone(), self.state_dir.clone());
                if let Some(s) = &self.socket {
                    new.daemon.socket = s.clone();
                }
                for field in changed_settings(&old.daemon, &new.daemon) {
                    tracing::warn!(
                        "reload: [daemon] {field} changed in airlock.toml; it needs a restart and keeps its old value until then"
                    );
                }
                new.daemon = old.daemon.clone();
                let (tools, profiles) = (new.tools.len(), new.profiles.len());
                self.exec.replace_policy(Arc::new(new));
                tracing::info!(
                    "reload: {}: now serving {tools} tools, {profiles} profiles (calls in flight finish on the policy they started with)",
                    self.dir.display()
                );
            }
        }
        self.notify.ready(&status_line(&self.exec));
    }
}

/// The `[daemon]` settings that differ, by name (one `name: value` line each in the
/// pretty debug form, so a new setting is covered without a list to keep).
fn changed_settings(
    old: &crate::policy::DaemonConfig,
    new: &crate::policy::DaemonConfig,
) -> Vec<String> {
    let (a, b) = (format!("{old:#?}"), format!("{new:#?}"));
    let top = |s: &str| -> Vec<(String, String)> {
        let mut out: Vec<(String, String)> = Vec::new();
        for line in s.lines().skip(1) {
            match line.strip_prefix("    ").filter(|l| !l.starts_with(' ')) {
                Some(l) => out.push((l.split(':').next().unwrap_or(l).to_string(), l.to_string())),
                None => {
                    if let Some(last) = out.last_mut() {
                        last.1.push_str(line);
                    }
                }
            }
        }
        out
    };
    let (a, b) = (top(&a), top(&b));
    b.iter()
        .filter(|(k, v)| {
            a.iter()
                .find(|(k2, _)| k2 == k)
                .is_none_or(|(_, v2)| v2 != v)
        })
        .map(|(k, _)| k.clone())
        .collect()
}

/// The daemon's signals: SIGTERM and SIGINT stop it; SIGHUP reloads the policies.
struct Signals {
    term: tokio::signal::unix::Signal,
    int: tokio::signal::unix::Signal,
    hup: tokio::signal::unix::Signal,
}

impl Signals {
    fn install() -> std::io::Result<Signals> {
        use tokio::signal::unix::{signal, SignalKind};
        Ok(Signals {
            term: signal(SignalKind::terminate())?,
            int: signal(SignalKind::interrupt())?,
            hup: signal(SignalKind::hangup())?,
        })
    }

    /// Returns at SIGTERM or SIGINT; reloads the policies at each SIGHUP (the load runs off
    /// the async threads).
    async fn wait_for_stop(mut self, reload: &Reload) {
        loop {
            tokio::select! {
                _ = self.term.recv() => return,
                _ = self.int.recv() => return,
                _ = self.hup.recv() => {
                    tracing::info!("SIGHUP: reloading the policies from {}", reload.dir.display());
                    tokio::task::block_in_place(|| reload.run());
                }
            }
        }
    }
}
