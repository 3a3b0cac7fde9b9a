//! The policy store: the one swappable snapshot, and the reload pipeline that replaces it.
//!
//! Reload is read → parse → compile (all errors) → swap. On any error the running policy
//! stays, and the failure is logged, counted and kept for `/status`.

use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex};
use std::time::{SystemTime, UNIX_EPOCH};

use arc_swap::ArcSwap;

use super::compile::load_dir;
use super::diag::{Diagnostic, Diagnostics};
use super::policy::Policy;
use crate::metrics::Metrics;

/// The longest a reload asked for waits for a policy file being written (see
/// `PolicyStore::wait_for_writers`).
pub const RELOAD_WAITS_FOR_WRITERS: std::time::Duration = std::time::Duration::from_secs(60);

/// What asked for a reload; shown in logs and `/status`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, serde::Serialize)]
#[serde(rename_all = "snake_case")]
pub enum ReloadTrigger {
    Start,
    Watch,
    Sighup,
    Admin,
}

/// As `/status` names it (`watch`), so a log line and the status read alike.
impl std::fmt::Display for ReloadTrigger {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(match self {
            ReloadTrigger::Start => "start",
            ReloadTrigger::Watch => "watch",
            ReloadTrigger::Sighup => "sighup",
            ReloadTrigger::Admin => "admin",
        })
    }
}

/// The last refused reload, for `/status`.
#[derive(Debug, Clone, serde::Serialize)]
pub struct ReloadFailure {
    pub at_unix: u64,
    pub trigger: ReloadTrigger,
    pub errors: Vec<Diagnostic>,
}

/// Result of one reload that did not fail.
#[derive(Debug, Clone, serde::Serialize)]
pub struct ReloadOutcome {
    pub generation: u64,
    pub hash: String,
    /// False when the files were byte-identical to the active policy (nothing swapped).
    pub changed: bool,
    /// The loaded policy's warnings (see [`super::Policy::warnings`]).
    pub warnings: Vec<Diagnostic>,
}

#[derive(Debug, Default)]
struct ReloadRecord {
    last_failure: Option<ReloadFailure>,
    last_success_unix: Option<u64>,
}

pub struct PolicyStore {
    dir: PathBuf,
    current: ArcSwap<Policy>,
    /// Serialises reloads so generations are handed out in order.
    reloading: tokio::sync::Mutex<()>,
    record: Mutex<ReloadRecord>,
    metrics: Arc<Metrics>,
    /// Policy files the directory's watcher saw opened for writing and not closed yet: a
    /// reload asked for by someone waits for them, as the watcher's own does.
    being_written: tokio::sync::watch::Sender<Vec<PathBuf>>,
    /// Why the directory cannot be watched now (it is gone, or not readable): edits are not
    /// read until it can be again.
    watch_problem: Mutex<Option<String>>,
}

fn now_unix() -> u64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map_or(0, |elapsed| elapsed.as_secs())
}

/// The host patterns `previous`'s routes named that none of `policy`'s do.
fn hosts_no_longer_routed(previous: &Policy, policy: &Policy) -> Vec<String> {
    let named = |policy: &Policy| {
        policy
            .routes
            .routes
            .iter()
            .flat_map(|route| route.hosts.iter().map(|host| host.pattern()))
            .collect::<std::collections::BTreeSet<String>>()
    };
    let now = named(policy);
    let still_matched = |host: &str| {
        policy
            .routes
            .routes
            .iter()
            .any(|route| route.hosts.iter().any(|pattern| pattern.matches(host)))
    };
    named(previous)
        .into_iter()
        // `blog.example` moved under a new `*.example` route still has one.
        .filter(|host| !now.contains(host) && !still_matched(host))
        .collect()
}

/// Which policy files a reload changed, added (`+`) or removed (`-`), by name, for its log
/// line: "policy reloaded" alone did not say which of a directory's files an edit or a
/// deploy had touched. Other things that change the hash (a CA file rotated) name none.
fn changed_files(before: &[(PathBuf, String)], after: &[(PathBuf, String)]) -> String {
    let name = |path: &Path| {
        path.file_name().map_or_else(
            || path.display().to_string(),
            |name| name.to_string_lossy().into_owned(),
        )
    };
    let mut said = Vec::new();
    for (path, hash) in after {
        match before.iter().find(|(known, _)| known == path) {
            Some((_, before)) if before == hash => {}
            Some(_) => said.push(name(path)),
            None => said.push(format!("+{}", name(path))),
        }
    }
    for (path, _) in before {
        if !after.iter().any(|(known, _)| known == path) {
            said.push(format!("-{}", name(path)));
        }
    }
    if said.is_empty() {
        "none (files the policy names changed)".to_string()
    } else {
        said.join(" ")
    }
}

/// Each warning at the load that brings it: a policy that loads is still worth a look when
/// part of it does nothing. Those the policy in effect had already (the same file and words,
/// wherever the line moved) are counted in one info line instead: repeated at every reload,
/// they made an alert on warnings fire at every deploy.
fn log_warnings(policy: &Policy, previous: Option<&Policy>) {
    let known = |warning: &super::diag::Diagnostic| {
        previous.is_some_and(|previous| {
            let words = without_positions(&warning.message);
            previous.warnings.iter().any(|before| {
                before.file == warning.file && without_positions(&before.message) == words
            })
        })
    };
    let mut as_before = 0;
    for warning in &policy.warnings {
        if known(warning) {
            as_before += 1;
        } else {
            tracing::warn!("policy: {}", warning.one_line());
        }
    }
    if as_before > 0 {
        tracing::info!(
            "policy: {} as before (`levee check` and /status list them)",
            super::units::counted(as_before, "warning")
        );
    }
}

/// Without Redis, switches are saved to `state_file`, written whole through a temporary file
/// beside it: a directory levee cannot write in (the policy directory, the default, often is
/// not: a ConfigMap, a root-owned /etc) made every switch a 503 in the incident it was for.
/// Tried by the running levee, as the service's user, and said as a warning; `levee check`
/// tries it too, which tells as much when run as that user (a unit's `ExecStartPre`).
pub fn check_state_file_writable(policy: &mut Policy) {
    if policy.redis.is_some() {
        return;
    }
    let state_file = policy.degrade.state_file.clone();
    let dir = match state_file.parent() {
        Some(parent) if !parent.as_os_str().is_empty() => parent.to_path_buf(),
        _ => std::path::PathBuf::from("."),
    };
    // A directory that does not exist is warned of by the compiler already.
    if !dir.is_dir() {
        return;
    }
    // Written whole and renamed into place: a directory there takes no file.
    if state_file.is_dir() {
        push_warning(
            policy,
            &state_file,
            format!(
                "switches cannot be saved: the state file {} is a directory; switching a level, module or breaker will answer 503",
                state_file.display()
            ),
            "set [degrade] state_file to a file's path (e.g. /var/lib/levee/state.json), not a directory's",
        );
        return;
    }
    let probe = dir.join(format!(".levee-write-test-{}", std::process::id()));
    match std::fs::OpenOptions::new()
        .write(true)
        .create_new(true)
        .open(&probe)
    {
        Ok(_) => {
            let _ = std::fs::remove_file(&probe);
        }
        // Another levee of the same process id left one (a crash): the directory is
        // writable all the same.
        Err(error) if error.kind() == std::io::ErrorKind::AlreadyExists => {}
        Err(error) => {
            push_warning(
                policy,
                &state_file,
                format!(
                    "switches cannot be saved: levee cannot write in {} ({error}); switching a level, module or breaker will answer 503",
                    dir.display()
                ),
                "set [degrade] state_file to a path in a directory levee can write (e.g. /var/lib/levee/state.json), or use [redis]",
            );
        }
    }
}

/// `message` without the `:line:col` of the places it names (`route `shop` before it
/// (a.toml:5:8)`), which an edit elsewhere in the file moves.
fn without_positions(message: &str) -> String {
    let mut words = String::with_capacity(message.len());
    let mut chars = message.chars().peekable();
    while let Some(c) = chars.next() {
        if c == ':' && chars.peek().is_some_and(char::is_ascii_digit) {
            while chars.peek().is_some_and(char::is_ascii_digit) {
                chars.next();
            }
        } else {
            words.push(c);
        }
    }
    words
}

/// Adds a warning about the policy as a whole (a path, not a line of it) to `policy`.
fn push_warning(policy: &mut Policy, at: &Path, message: String, hint: &str) {
    let mut warning = super::diag::Diagnostic::whole(at, message).hint(hint);
    warning.severity = super::diag::Severity::Warning;
    policy.warnings.push(warning);
}

/// Fits `max_connections` to the open files this process may have. The default comes down to
/// what the limit allows (logged); a value the policy sets is kept, with a warning where the
/// operator reads the policy's warnings (the log, `levee reload`, `/status`). Here rather than
/// in the compiler: `levee check` runs in a shell whose limit is not the service's.
/// `before`: the bound the policy in effect has (a reload), logged again only when it changes:
/// not on every save of a file.
fn fit_connections_to_open_files(dir: &Path, policy: &mut Policy, before: Option<u32>) {
    let soft_limit = crate::open_files::soft_limit();
    let max_connections = policy.server.max_connections;
    let Some(message) = crate::open_files::shortfall(max_connections, soft_limit) else {
        return;
    };
    if !policy.server.max_connections_given {
        let allowed = soft_limit.map_or(max_connections, crate::open_files::connections_allowed);
        if allowed < crate::open_files::FEW_CONNECTIONS {
            push_warning(
                policy,
                dir,
                format!(
                    "the open-file limit ({}) lets levee hold only {allowed} client connections at once: a few slow clients take them all, and the load balancer's /readyz waits behind them",
                    soft_limit.unwrap_or_default()
                ),
                "raise the service's open-file limit (LimitNOFILE= in its systemd unit, 4096 or more); each connection takes two",
            );
        } else if before != Some(allowed) {
            tracing::info!(
                max_connections = allowed,
                open_file_limit = soft_limit,
                "[server] max_connections defaults to what the open-file limit allows"
            );
        }
        policy.server.max_connections = allowed;
        return;
    }
    push_warning(
        policy,
        dir,
        message,
        "raise the service's open-file limit (LimitNOFILE= in its systemd unit; levee raises its soft limit to the hard one itself) or lower [server] max_connections",
    );
}

impl PolicyStore {
    /// Loads the policy directory for the first time (generation 1).
    pub fn open(dir: &Path, metrics: Arc<Metrics>) -> Result<PolicyStore, Diagnostics> {
        let mut policy = load_dir(dir, None)?;
        policy.generation = 1;
        policy.loaded_at_unix = now_unix();
        fit_connections_to_open_files(dir, &mut policy, None);
        check_state_file_writable(&mut policy);
        log_warnings(&policy, None);
        metrics.policy_generation.set(1);
        metrics.prime(&policy);
        Ok(PolicyStore {
            dir: dir.to_path_buf(),
            current: ArcSwap::from_pointee(policy),
            reloading: tokio::sync::Mutex::new(()),
            record: Mutex::new(ReloadRecord {
                last_failure: None,
                last_success_unix: Some(now_unix()),
            }),
            metrics,
            being_written: tokio::sync::watch::Sender::new(Vec::new()),
            watch_problem: Mutex::new(None),
        })
    }

    pub fn dir(&self) -> &Path {
        &self.dir
    }

    /// The active snapshot. Load it once per request and keep it.
    pub fn load(&self) -> Arc<Policy> {
        self.current.load_full()
    }

    pub fn last_failure(&self) -> Option<ReloadFailure> {
        self.record
            .lock()
            .ok()
            .and_then(|record| record.last_failure.clone())
    }

    pub fn last_success_unix(&self) -> Option<u64> {
        self.record
            .lock()
            .ok()
            .and_then(|record| record.last_success_unix)
    }

    /// The watcher's word on why it cannot watch the directory (`None`: it watches it). Says
    /// whether the problem is new.
    pub fn note_watch_problem(&self, problem: Option<String>) -> bool {
        let mut noted = self
            .watch_problem
            .lock()
            .unwrap_or_else(|poisoned| poisoned.into_inner());
        let new = *noted != problem;
        *noted = problem;
        new
    }

    pub fn watch_problem(&self) -> Option<String> {
        self.watch_problem
            .lock()
            .unwrap_or_else(|poisoned| poisoned.into_inner())
            .clone()
    }

    /// The watcher's word on which policy files are open for writing now.
    pub fn note_being_written(&self, files: Vec<PathBuf>) {
        self.being_written.send_if_modified(|open| {
            let changed = *open != files;
            *open = files;
            changed
        });
    }

    /// Policy files open for writing, as far as the watcher knows (none without it).
    pub fn being_written(&self) -> Vec<PathBuf> {
        self.being_written.borrow().clone()
    }

    /// Waits until no policy file is open for writing: a `kill -HUP` sent while an editor's
    /// save or a slow `scp` is writing a file in place read it half written, and what was left
    /// of it could compile (a route without its `match` took every request after it). As long
    /// as the watcher holds the file for written (until it is closed, or has been left quiet
    /// for `CLOSE_WAIT`), at most [`RELOAD_WAITS_FOR_WRITERS`]: a writer still writing after
    /// 10 s was read half written by a fixed 10 s wait.
    async fn wait_for_writers(&self, trigger: ReloadTrigger) {
        let mut open = self.being_written.subscribe();
        let files = open.borrow_and_update().clone();
        if files.is_empty() {
            return;
        }
        tracing::info!(%trigger, ?files, "a policy file is being written: the reload waits until it is closed");
        let closed = tokio::time::timeout(
            RELOAD_WAITS_FOR_WRITERS,
            open.wait_for(|files| files.is_empty()),
        )
        .await;
        if closed.is_err() {
            tracing::warn!(%trigger, ?files, "a policy file has been written in place for {:?}; reading it as it is", RELOAD_WAITS_FOR_WRITERS);
        }
    }

    /// Re-reads the directory and swaps in the new policy if it compiles.
    pub async fn reload(&self, trigger: ReloadTrigger) -> Result<ReloadOutcome, Diagnostics> {
        if matches!(trigger, ReloadTrigger::Sighup | ReloadTrigger::Admin) {
            self.wait_for_writers(trigger).await;
        }
        let _serialised = self.reloading.lock().await;
        let previous = self.load();
        let dir = self.dir.clone();
        let previous_for_compile = previous.clone();
        // Reading files and compiling regexes is blocking work; keep it off the request workers.
        let compiled =
            tokio::task::spawn_blocking(move || load_dir(&dir, Some(&previous_for_compile)))
                .await
                .unwrap_or_else(|join_error| {
                    Err(Diagnostics(vec![Diagnostic::whole(
                        &self.dir,
                        format!("policy compile task failed: {join_error}"),
                    )]))
                });
        match compiled {
            Ok(mut policy) => {
                // The files on disk load (a change or not): nothing is refused any more.
                self.metrics.policy_refused.set(0);
                let failed_before = self.record.lock().ok().and_then(|mut record| {
                    record.last_success_unix = Some(now_unix());
                    record.last_failure.take()
                });
                if policy.hash == previous.hash {
                    if failed_before.is_some() {
                        // The files are back as they were (a refused edit undone): said at
                        // the level of the error it ends, or the error stays the last word.
                        tracing::info!(
                            %trigger,
                            generation = previous.generation,
                            "policy files are valid again, as the running policy: nothing to reload"
                        );
                    } else if matches!(trigger, ReloadTrigger::Sighup | ReloadTrigger::Admin) {
                        // Asked for by someone, who should see that the ask arrived.
                        tracing::info!(
                            %trigger,
                            generation = previous.generation,
                            "policy files unchanged: nothing to reload"
                        );
                    } else {
                        tracing::debug!(
                            %trigger,
                            generation = previous.generation,
                            "policy files unchanged"
                        );
                    }
                    return Ok(ReloadOutcome {
                        generation: previous.generation,
                        hash: previous.hash.clone(),
                        changed: false,
                        warnings: previous.warnings.clone(),
                    });
                }
                if policy.server.listen != previous.server.listen
                    || policy.admin.listen != previous.admin.listen
                {
                    tracing::warn!(
                        "listen addresses changed in the policy; they take effect after a restart"
                    );
                    // Also among the policy's warnings, so `levee reload` and `/status` say so
                    // where the operator who made the change looks.
                    let message = format!(
                        "the policy's listen addresses (public {}, admin {}) take effect only after a restart; levee still listens on {} and {}",
                        policy.server.listen,
                        policy.admin.listen,
                        previous.server.listen,
                        previous.admin.listen
                    );
                    push_warning(
                        &mut policy,
                        &self.dir,
                        message,
                        "restart levee to move its listeners; until then the levee CLI reaches the admin listener with --admin and the address it listens on",
                    );
                    // The listeners stay where they are bound: the policy says so, and later
                    // reloads are checked against them (see the admin token check).
                    policy.server.listen = previous.server.listen;
                    policy.admin.listen = previous.admin.listen;
                }
                policy.generation = previous.generation + 1;
                policy.loaded_at_unix = now_unix();
                let changed = changed_files(&previous.file_hashes, &policy.file_hashes);
                // Loaded once it stayed empty (see `load_dir`); what it held is gone, which a
                // truncation by a full disk looks like too: said above info.
                for emptied in policy.empty_files.iter().filter(|file| {
                    previous.files.contains(file) && !previous.empty_files.contains(file)
                }) {
                    tracing::warn!(file = %emptied.display(), "a policy file that held settings is empty now, and was not written in the last 10 s (by its modification time): the routes, limits and other settings it held are dropped");
                }
                // A site whose file was moved away (`.disabled`, deleted) took its routes with
                // it: its visitors now reach whatever route is left for them (the default
                // site's PHP), which nothing said.
                let gone = hosts_no_longer_routed(&previous, &policy);
                if !gone.is_empty() {
                    // Among the policy's warnings: logged below, and shown by `levee reload`
                    // and `/status`.
                    push_warning(
                        &mut policy,
                        &self.dir,
                        format!(
                            "no route names these hosts any more: {} (their requests now go to the routes without a host: the catch-all, or default_upstream; files changed: {changed})",
                            gone.join(", ")
                        ),
                        "a site's file renamed or removed takes its routes with it; to let a site bypass levee, change the front, not levee's files",
                    );
                }
                fit_connections_to_open_files(
                    &self.dir,
                    &mut policy,
                    Some(previous.server.max_connections),
                );
                check_state_file_writable(&mut policy);
                let outcome = ReloadOutcome {
                    generation: policy.generation,
                    hash: policy.hash.clone(),
                    changed: true,
                    warnings: policy.warnings.clone(),
                };
                log_warnings(&policy, Some(&previous));
                self.metrics.forget_removed(&previous, &policy);
                self.metrics.prime(&policy);
                self.current.store(Arc::new(policy));
                self.metrics.policy_reloads.inc();
                self.metrics
                    .policy_generation
                    .set(outcome.generation as i64);
                tracing::info!(%trigger, generation = outcome.generation, hash = %outcome.hash, changed = %changed, "policy reloaded");
                Ok(outcome)
            }
            Err(diagnostics) => {
                self.metrics.policy_reload_failures.inc();
                self.metrics.policy_refused.set(1);
                // One line per error, each whole (where, what, what to write): `grep ERROR`
                // showed none of the detail of the old multi-line entry.
                for error in &diagnostics.0 {
                    if error.severity == super::diag::Severity::Warning {
                        tracing::warn!(%trigger, "{}", error.one_line());
                        continue;
                    }
                    tracing::error!(
                        %trigger,
                        active_generation = previous.generation,
                        "policy reload refused, keeping the active policy: {}",
                        error.one_line()
                    );
                }
                if let Ok(mut record) = self.record.lock() {
                    record.last_failure = Some(ReloadFailure {
                        at_unix: now_unix(),
                        trigger,
                        errors: diagnostics.0.clone(),
                    });
                }
                Err(diagnostics)
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_reload_names_the_files_it_changed_added_and_removed() {
        let files = |list: &[(&str, &str)]| -> Vec<(PathBuf, String)> {
            list.iter()
                .map(|(name, hash)| (Path::new("/etc/levee").join(name), hash.to_string()))
                .collect()
        };
        let before = files(&[
            ("10-routes.toml", "a1"),
            ("20-limits.toml", "b1"),
            ("old.toml", "c1"),
        ]);
        let after = files(&[
            ("10-routes.toml", "a2"),
            ("20-limits.toml", "b1"),
            ("new.toml", "d1"),
        ]);
        assert_eq!(
            changed_files(&before, &after),
            "10-routes.toml +new.toml -old.toml"
        );
        assert_eq!(
            changed_files(&before, &before),
            "none (files the policy names changed)"
        );
    }
}
