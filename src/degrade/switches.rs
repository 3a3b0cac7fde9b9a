//! Saving and sharing runtime switches (the level, modules, breakers pinned by hand): a Redis
//! hash shared by the fleet (followed by every instance within `sync_interval`), or a local
//! state file without Redis. Either way they survive restarts. A switch is in effect only once
//! it is saved.

use std::path::Path;
use std::sync::Arc;
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use tokio::sync::watch;

use super::fleet::report_of;
use super::{Degrade, RuntimeSwitches, Switch, MAX_LEVEL};
use crate::breaker::Force;
use crate::config::Policy;
use crate::log_throttle::LogThrottle;
use crate::metrics::{Metrics, ModuleLabels};
use crate::proxy::Shared;
use crate::redis_store::RedisStore;

/// Bound on operator and background Redis calls for switches.
const SWITCH_TIMEOUT: Duration = Duration::from_secs(1);

/// What an operator asked for.
#[derive(Debug, Clone)]
pub enum Change {
    /// `Some(level)` pins the level; `None` hands it back to the policy.
    Level(Option<u8>),
    /// `Some(off)` pins a module; `None` hands it back to the policy.
    Module(String, Option<bool>),
    /// `Some(force)` pins an upstream's breaker; `None` hands it back to its own counting.
    Breaker(String, Option<Force>),
}

impl std::fmt::Display for Change {
    /// In the words the CLI takes: `level 2`, `level policy`, `module ranking off`.
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Change::Level(Some(level)) => write!(f, "level {level}"),
            Change::Level(None) => write!(f, "level policy"),
            Change::Module(name, Some(true)) => write!(f, "module {name} off"),
            Change::Module(name, Some(false)) => write!(f, "module {name} on"),
            Change::Module(name, None) => write!(f, "module {name} policy"),
            Change::Breaker(name, force) => write!(f, "breaker {name} {}", Force::word(*force)),
        }
    }
}

pub(crate) fn now_unix() -> u64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map_or(0, |d| d.as_secs())
}

fn stamp<T>(value: T, by: &str) -> Switch<T> {
    Switch {
        value,
        by: by.to_string(),
        at_unix: now_unix(),
    }
}

fn hash_key(redis: &RedisStore) -> String {
    format!("{}switches", redis.settings.key_prefix)
}

/// A switch must name something the policy has (`kind`: its word, singular and plural), but
/// one left for something the policy no longer has can still be handed back
/// (`clearing_a_leftover`): otherwise it would stay saved, unseen, and act again the day a
/// policy brings the name back.
fn named_in_policy<V>(
    (kind, kinds): (&str, &str),
    name: &str,
    in_policy: &std::collections::BTreeMap<String, V>,
    clearing_a_leftover: bool,
) -> Result<(), String> {
    if in_policy.contains_key(name) || clearing_a_leftover {
        return Ok(());
    }
    if in_policy.is_empty() {
        return Err(format!(
            "no {kind} named `{name}`: the policy has no {kinds}"
        ));
    }
    let known: Vec<&str> = in_policy.keys().map(String::as_str).collect();
    Err(format!(
        "no {kind} named `{name}`; {kinds}: {}",
        known.join(", ")
    ))
}

/// Applies a change: saves it (Redis or state file), then puts it in effect.
pub async fn apply(
    degrade: &Degrade,
    policy: &Policy,
    change: Change,
    by: &str,
    metrics: &Metrics,
) -> Result<(), String> {
    match &change {
        Change::Level(Some(level)) if *level > MAX_LEVEL => {
            return Err(format!(
                "level {level} does not exist; levels are 0, 1 and 2"
            ))
        }
        Change::Level(_) => {}
        Change::Module(name, off) => named_in_policy(
            ("module", "modules"),
            name,
            &policy.degrade.modules,
            off.is_none() && degrade.runtime().modules.contains_key(name),
        )?,
        Change::Breaker(name, force) => named_in_policy(
            ("upstream", "upstreams"),
            name,
            &policy.upstreams,
            force.is_none() && degrade.runtime().breakers.contains_key(name),
        )?,
    }
    let _changing = degrade.lock_changes().await;
    let mut switches = (*degrade.runtime()).clone();
    match &change {
        Change::Level(level) => switches.level = level.map(|value| stamp(value, by)),
        Change::Module(name, off) => match off {
            Some(off) => {
                switches.modules.insert(name.clone(), stamp(*off, by));
            }
            None => {
                switches.modules.remove(name);
            }
        },
        Change::Breaker(name, force) => match force {
            Some(force) => {
                switches.breakers.insert(name.clone(), stamp(*force, by));
            }
            None => {
                switches.breakers.remove(name);
            }
        },
    }
    let saved = match &policy.redis {
        Some(redis) => save_to_redis(redis, &change, &switches, by).await,
        None => save_to_file(&policy.degrade.state_file, &switches)
            .await
            .map_err(|error| format!("the switch was not saved, so it is not in effect: {error}")),
    };
    if let Err(error) = saved {
        // The operator's client is told (503); the log says it too, for whoever reads it
        // later (a switch an operator thought was set).
        tracing::warn!(change = %change, by, "degrade switch refused: {error}");
        return Err(error);
    }
    if policy.redis.is_some() {
        keep_local_copy(degrade, policy, &switches).await;
    }
    degrade.replace_runtime(switches);
    tracing::warn!(change = %change, by, "degrade switch changed");
    publish(degrade, policy, metrics);
    Ok(())
}

async fn save_to_redis(
    redis: &RedisStore,
    change: &Change,
    switches: &RuntimeSwitches,
    by: &str,
) -> Result<(), String> {
    let key = hash_key(redis);
    let (field, value) = match change {
        Change::Level(_) => (
            LEVEL_FIELD.to_string(),
            switches.level.as_ref().map(serde_json::to_string),
        ),
        Change::Module(name, _) => (
            format!("{MODULE_FIELD}{name}"),
            switches.modules.get(name).map(serde_json::to_string),
        ),
        Change::Breaker(name, _) => (
            format!("{BREAKER_FIELD}{name}"),
            switches.breakers.get(name).map(serde_json::to_string),
        ),
    };
    // The stored value; none clears the field (back to the policy's word).
    let value = match value {
        Some(Ok(json)) => Some(json),
        Some(Err(error)) => return Err(format!("cannot encode the switch: {error}")),
        None => None,
    };
    let not_saved =
        |why: String| format!("the switch was not saved, so it is not in effect: {why}");
    let (deadline_us, remaining) = redis
        .write_deadline(&key, SWITCH_TIMEOUT, None)
        .await
        .map_err(|error| not_saved(error.to_string()))?;
    let mut command = redis::cmd("EVAL");
    command
        .arg(SAVE_SWITCH_BEFORE)
        .arg(1)
        .arg(&key)
        .arg(deadline_us)
        .arg(&field)
        .arg(value.as_deref().unwrap_or(""))
        .arg(by);
    let written = redis.command::<i64>(&command, remaining, None).await;
    let error = match written {
        Ok(SAVED) => return Ok(()),
        Ok(_) => return Err(not_saved("redis ran the write after its deadline".into())),
        Err(error) => error,
    };
    // The answer was lost or late. Past its deadline the write can no longer run, so what
    // Redis holds now says whether it did.
    let mut read = redis::cmd("HGET");
    read.arg(&key).arg(&field);
    match redis
        .command::<Option<String>>(&read, SWITCH_TIMEOUT, None)
        .await
    {
        Ok(stored) if stored == value => Ok(()),
        Ok(_) => Err(not_saved(format!(
            "{error}; Redis holds the switch as it was"
        ))),
        Err(checking) => Err(format!(
            "redis did not answer ({error}), nor when asked what it holds ({checking}): the \
             switch is saved only if Redis ran the write before its deadline, a second at most; \
             if it did, every instance follows it (see `levee status`), and if not, it never will"
        )),
    }
}

/// What [`SAVE_SWITCH_BEFORE`] answers when it saved the switch.
const SAVED: i64 = 1;

/// Saves a switch only if Redis runs the write by the deadline (µs, Redis's clock): a write
/// levee gave up on must not land later, for the whole fleet, after the operator was told it
/// was not saved. KEYS: the switches hash. ARGV: deadline, field, value (empty: clear it), who.
/// Clearing the last switch leaves [`HANDED_BACK`] (who) in the hash: the other instances
/// then tell an operator's hand-back from a Redis that lost its data, where the hash is gone.
const SAVE_SWITCH_BEFORE: &str = r#"
local now = redis.call('TIME')
if tonumber(now[1]) * 1000000 + tonumber(now[2]) > tonumber(ARGV[1]) then
  return 0
end
redis.call('HDEL', KEYS[1], 'handed_back_by')
if ARGV[3] == '' then
  redis.call('HDEL', KEYS[1], ARGV[2])
  if redis.call('HLEN', KEYS[1]) == 0 then
    redis.call('HSET', KEYS[1], 'handed_back_by', ARGV[4])
  end
else
  redis.call('HSET', KEYS[1], ARGV[2], ARGV[3])
end
return 1
"#;

async fn save_to_file(path: &Path, switches: &RuntimeSwitches) -> Result<(), String> {
    let json = serde_json::to_vec_pretty(switches).map_err(|error| error.to_string())?;
    let target = path.to_path_buf();
    // fsync can take a disk's whole queue to return: off the runtime's workers, which are
    // serving requests meanwhile.
    let written = tokio::task::spawn_blocking(move || write_state_file(&target, &json))
        .await
        .map_err(|error| format!("the state file writer failed: {error}"))?;
    written.map_err(|error| format!("cannot write {}: {error}", path.display()))
}

/// Tells temporary file names of one process apart.
static TEMP_SEQUENCE: std::sync::atomic::AtomicU64 = std::sync::atomic::AtomicU64::new(0);

/// Writes, syncs and renames into place: neither a crash nor a power loss leaves a
/// half-written (or empty) state file. The temporary file is created exclusively under a name
/// made of the process id, the clock and a sequence number, so two levees sharing the
/// directory (two containers can both be PID 1) never write into one file.
fn write_state_file(path: &Path, json: &[u8]) -> std::io::Result<()> {
    use std::io::Write;
    let nanos = SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map_or(0, |d| d.subsec_nanos());
    let sequence = TEMP_SEQUENCE.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
    let temp = path.with_extension(format!(
        "json.{}-{nanos}-{sequence}.tmp",
        std::process::id()
    ));
    let written = (|| {
        let mut file = std::fs::OpenOptions::new()
            .write(true)
            .create_new(true)
            .open(&temp)?;
        file.write_all(json)?;
        file.sync_all()?;
        std::fs::rename(&temp, path)
    })();
    if let Err(error) = written {
        let _ = std::fs::remove_file(&temp);
        return Err(error);
    }
    // The new file is in place and readable by now; syncing the directory only makes the
    // rename itself survive a power loss, so a failure there (some file systems refuse to
    // sync a directory) is worth a warning, not a refused switch.
    if let Some(dir) = path.parent().filter(|dir| !dir.as_os_str().is_empty()) {
        if let Err(error) = std::fs::File::open(dir).and_then(|dir| dir.sync_all()) {
            tracing::warn!(
                "state file {} is written, but its directory could not be synced: {error}",
                path.display()
            );
        }
    }
    Ok(())
}

/// With Redis, the state file keeps a copy of the fleet's last known switches, so a levee that
/// (re)starts while Redis is away still applies them instead of the policy's defaults. The
/// copy is best effort: Redis stays the record, and a failure to write it only warns; the
/// copy is then written again at each sync until it succeeds (a copy left behind by a full
/// disk pinned a breaker the fleet had handed back, after a restart with Redis away, and
/// wrote it back into Redis for every instance).
async fn keep_local_copy(degrade: &Degrade, policy: &Policy, switches: &RuntimeSwitches) {
    match save_to_file(&policy.degrade.state_file, switches).await {
        Ok(()) => {
            if degrade
                .local_copy_behind
                .swap(false, std::sync::atomic::Ordering::Relaxed)
            {
                tracing::info!(
                    state_file = %policy.degrade.state_file.display(),
                    "the local copy of the fleet's switches is written again"
                );
            }
        }
        Err(error) => {
            if !degrade
                .local_copy_behind
                .swap(true, std::sync::atomic::Ordering::Relaxed)
            {
                tracing::warn!("cannot keep a local copy of the fleet's switches (tried again at each sync; the switches in effect are the fleet's, in redis): {error}");
            }
        }
    }
}

/// With Redis, writes the local copy again when its last write failed (see
/// [`keep_local_copy`]), from the switches in effect.
async fn catch_up_local_copy(degrade: &Degrade, policy: &Policy) {
    if !degrade
        .local_copy_behind
        .load(std::sync::atomic::Ordering::Relaxed)
    {
        return;
    }
    // Not beside an operator's change, whose own write would race this one.
    let _changing = degrade.lock_changes().await;
    let switches = degrade.runtime();
    keep_local_copy(degrade, policy, &switches).await;
}

/// Without Redis, a state file gone or overwritten while runtime switches are on (a deploy's
/// `rsync --delete` or `git clean` in the policy directory, its default home; a directory
/// replaced by a release's; a file copied over it) is written again from the switches levee
/// applies: else they would be lost at the next restart without a word.
async fn write_again_if_gone(degrade: &super::Degrade, policy: &Policy) {
    let path = &policy.degrade.state_file;
    // Gone, or holding something else than the switches in effect (overwritten by a deploy,
    // or with garbage): a restart would lose them either way.
    let differs = |switches: &RuntimeSwitches| {
        let switches = switches.clone();
        async move {
            match tokio::fs::read(path).await {
                Ok(bytes) => serde_json::from_slice::<RuntimeSwitches>(&bytes)
                    .map_or(true, |saved| saved != switches),
                Err(error) => error.kind() == std::io::ErrorKind::NotFound,
            }
        }
    };
    if *degrade.runtime() == RuntimeSwitches::default() || !differs(&degrade.runtime()).await {
        return;
    }
    // Not beside an operator's change, whose own write would race this one.
    let _changing = degrade.lock_changes().await;
    let switches = degrade.runtime();
    if *switches == RuntimeSwitches::default() || !differs(&switches).await {
        return;
    }
    match save_to_file(path, &switches).await {
        Ok(()) => tracing::warn!(
            state_file = %path.display(),
            "the state file was gone or overwritten (by a deploy?) while runtime switches are on; written again from the switches in effect"
        ),
        Err(error) => {
            // Tried at every sync: said once a minute.
            static UNWRITABLE: LogThrottle = LogThrottle::new(Duration::from_secs(60));
            if let Some(held_back) = UNWRITABLE.allow(std::time::Instant::now()) {
                tracing::warn!(
                    state_file = %path.display(),
                    held_back,
                    "the state file is gone and cannot be written again ({error}): the runtime switches in effect are lost at the next restart"
                );
            }
        }
    }
}

/// The fields of Redis's switches hash: the level, and each module's and breaker's (the
/// prefix, then the name), as saving one switch, writing all back and reading them spell them.
const LEVEL_FIELD: &str = "level";
const MODULE_FIELD: &str = "module:";
const BREAKER_FIELD: &str = "breaker:";

/// The field Redis's switches hash keeps once its last switch was handed back: who did it.
const HANDED_BACK: &str = "handed_back_by";

/// Reads the saved switches (at start, and on every sync).
pub async fn load(policy: &Policy) -> Result<RuntimeSwitches, String> {
    load_with_word(policy).await.map(|(switches, _)| switches)
}

/// [`load`], with who handed the last switch back when Redis says so (see [`HANDED_BACK`]).
async fn load_with_word(policy: &Policy) -> Result<(RuntimeSwitches, Option<String>), String> {
    match &policy.redis {
        Some(redis) => {
            let mut command = redis::cmd("HGETALL");
            command.arg(hash_key(redis));
            let fields: Vec<(String, String)> = redis
                .command(&command, SWITCH_TIMEOUT, None)
                .await
                .map_err(|error| error.to_string())?;
            let mut switches = RuntimeSwitches::default();
            let mut handed_back_by = None;
            for (field, value) in fields {
                if field == HANDED_BACK {
                    handed_back_by = Some(value);
                } else if field == LEVEL_FIELD {
                    switches.level = match serde_json::from_str(&value) {
                        Ok(level) => Some(level),
                        Err(error) => {
                            ignored_once(&format!(
                                "redis holds a level switch levee cannot read ({error}): {value:?}"
                            ));
                            None
                        }
                    };
                } else if let Some(name) = field.strip_prefix(MODULE_FIELD) {
                    match serde_json::from_str(&value) {
                        Ok(switch) => {
                            switches.modules.insert(name.to_string(), switch);
                        }
                        Err(error) => ignored_once(&format!("redis holds a switch of module `{name}` levee cannot read ({error}): {value:?}")),
                    }
                } else if let Some(name) = field.strip_prefix(BREAKER_FIELD) {
                    match serde_json::from_str(&value) {
                        Ok(switch) => {
                            switches.breakers.insert(name.to_string(), switch);
                        }
                        Err(error) => ignored_once(&format!("redis holds a pin of breaker `{name}` levee cannot read ({error}): {value:?}")),
                    }
                }
            }
            Ok((within_levels(switches, "redis"), handed_back_by))
        }
        None => load_file(&policy.degrade.state_file).map(|switches| (switches, None)),
    }
}

/// A saved level that does not exist (written by hand, or by another program) is not put in
/// effect: levels are 0 to `MAX_LEVEL`, as `apply` holds operators to.
fn within_levels(mut switches: RuntimeSwitches, from: &str) -> RuntimeSwitches {
    if let Some(level) = switches
        .level
        .as_ref()
        .filter(|level| level.value > MAX_LEVEL)
    {
        ignored_once(&format!(
            "{from} holds level {} (by {}), which does not exist; levels are 0 to {MAX_LEVEL}",
            level.value, level.by
        ));
        switches.level = None;
    }
    switches
}

/// Warns that a saved switch is ignored, once for each different one: the sync reads the
/// switches every `sync_interval`, and the same broken one would be told every time.
fn ignored_once(what: &str) {
    static LAST: std::sync::Mutex<String> = std::sync::Mutex::new(String::new());
    let mut last = LAST.lock().unwrap_or_else(|poisoned| poisoned.into_inner());
    if *last != what {
        tracing::warn!("{what}: ignored; the policy's setting holds until an operator switches it");
        *last = what.to_string();
    }
}

/// Reads a state file; a missing one means no switches.
fn load_file(path: &Path) -> Result<RuntimeSwitches, String> {
    match std::fs::read(path) {
        Ok(bytes) => serde_json::from_slice(&bytes)
            .map(|switches| within_levels(switches, &format!("state file {}", path.display())))
            .map_err(|error| format!("state file {} is not valid: {error}", path.display())),
        Err(error) if error.kind() == std::io::ErrorKind::NotFound => {
            Ok(RuntimeSwitches::default())
        }
        Err(error) => Err(format!("cannot read {}: {error}", path.display())),
    }
}

/// Puts the saved breaker pins in effect on the policy's breakers, and updates the level and
/// module gauges: after a change, and on every sync (a pin set elsewhere in the fleet, an
/// upstream a reload added).
pub fn publish(degrade: &Degrade, policy: &Policy, metrics: &Metrics) {
    let runtime = degrade.runtime();
    for (name, upstream) in &policy.upstreams {
        let pin = runtime.breakers.get(name).map(|switch| switch.value);
        upstream.breaker.set_runtime_force(pin, metrics);
    }
    publish_gauges(degrade, policy, metrics, false);
}

/// The level and module gauges, from the switches and the policy of now. `rebuild`: the
/// module family is emptied first, so a module a reload took out (or renamed) no longer says
/// 1 (an alert on it fired until a restart); only inside a scrape, which no other scrape or
/// encoding runs beside, so none sees the family half rebuilt.
pub fn publish_gauges(degrade: &Degrade, policy: &Policy, metrics: &Metrics, rebuild: bool) {
    let view = degrade.view(policy);
    metrics.degrade_level.set(i64::from(view.level));
    if rebuild {
        metrics.module_off.clear();
    }
    for module in policy.degrade.modules.keys() {
        metrics
            .module_off
            .get_or_create(&ModuleLabels {
                module: module.clone().into(),
            })
            .set(i64::from(view.module_off(module)));
    }
}

/// Loads the saved switches now, then keeps following them (Redis) until `stop`, writing
/// this instance's line of the fleet view (see `fleet`) at each sync.
pub async fn spawn_sync(
    shared: Arc<Shared>,
    mut stop: watch::Receiver<bool>,
) -> tokio::task::JoinHandle<()> {
    let (degrade, store, metrics) = (
        shared.degrade.clone(),
        shared.store.clone(),
        shared.metrics.clone(),
    );
    let policy = store.load();
    shared.stale.set_max_bytes(policy.degrade.stale_memory);
    match load_with_word(&policy).await {
        Ok((mut switches, handed_back_by)) => {
            if let Some(redis) = &policy.redis {
                // A place that holds no switches at all, not even who handed the last one
                // back, never had the fleet's (the first start since `[redis]` was added) or
                // lost them: the local copy's are carried into it, not overwritten by none.
                let copy = load_file(&policy.degrade.state_file).ok();
                let absent = switches == RuntimeSwitches::default() && handed_back_by.is_none();
                match copy {
                    Some(copy)
                        if absent
                            && copy != RuntimeSwitches::default()
                            && carry_into(redis, &copy, Carried::LocalCopy(&policy)).await =>
                    {
                        switches = copy;
                    }
                    // The fleet's word wins over this instance's last copy; said, as a reload
                    // says what it follows, so a switch of its own that is dropped is seen.
                    Some(copy) if copy != switches && policy.degrade.state_file.exists() => {
                        tracing::info!(
                            changes = %crate::printable::printable(&describe_changes(&copy, &switches)),
                            state_file = %policy.degrade.state_file.display(),
                            "started with the fleet's degrade switches from redis, not those of the local copy"
                        );
                    }
                    _ => {}
                }
                keep_local_copy(&degrade, &policy, &switches).await;
                // The cookie names the fleet learned, known before the first request here
                // (Redis answered just now; while it does not, the syncs read them later).
                if policy.learns_app_cookies {
                    super::app_cookies::follow_fleet(redis, &shared.app_cookies).await;
                }
            }
            degrade.replace_runtime(switches);
        }
        Err(error) if policy.redis.is_some() => {
            match load_file(&policy.degrade.state_file) {
                // No copy was ever written here (a first start, or one that never reached
                // Redis): nothing to apply, and no file to name as if it held something.
                Ok(_) if !policy.degrade.state_file.exists() => tracing::warn!(
                    "cannot read the fleet's switches from redis ({error}), and no local copy has been written yet ({}); starting from the policy",
                    policy.degrade.state_file.display()
                ),
                Ok(copy) => {
                    tracing::warn!(
                        "cannot read the fleet's switches from redis ({error}); applying the last known copy from {} until redis answers",
                        policy.degrade.state_file.display()
                    );
                    degrade.replace_runtime(copy);
                }
                Err(copy_error) => tracing::warn!(
                    "cannot read the fleet's switches from redis ({error}) nor a local copy ({copy_error}); starting from the policy"
                ),
            }
        }
        Err(error) => {
            tracing::warn!("cannot read saved degrade switches, starting from the policy: {error}")
        }
    }
    publish(&degrade, &policy, &metrics);
    tokio::spawn(async move {
        // Written in the task, not before the listeners serve: only the switches must be
        // loaded first, and a Redis that does not answer would hold the start up. (The
        // policy read anew: the task must not keep the first one, and its Redis connection,
        // alive past a reload.)
        let first = store.load();
        if let Some(redis) = &first.redis {
            super::fleet::write(redis, &shared.instance, &report_of(&shared, &first)).await;
        }
        // Where this instance's line was last written. A reload that moves levee to another
        // Redis or key prefix, or drops `[redis]`, takes the line out of the old place at the
        // next sync; left there, it would be shown silent for an hour. (Held from one sync to
        // the next only: the old Redis connection closes soon after a reload.)
        let mut written_to = first.redis.clone();
        // The Redis (and key prefix) last read holding switches: one found empty later lost
        // them; one a reload points at anew has none to lose, and its word is followed.
        let mut held_switches: Option<Arc<RedisStore>> = None;
        drop(first);
        let mut fleet_size = super::fleet::FleetSize::default();
        loop {
            let interval = store.load().degrade.sync_interval;
            // (The current view's line is removed when levee has stopped: see `app`; a line
            // left in an old one by a reload is removed here.)
            let stopping = tokio::select! {
                _ = tokio::time::sleep(interval) => false,
                _ = stop.wait_for(|stopped| *stopped) => true,
            };
            let policy = store.load();
            // (A reload's `stale_memory` is put in effect here, within a sync_interval.)
            shared.stale.set_max_bytes(policy.degrade.stale_memory);
            if let Some(old) = written_to.take() {
                if !policy
                    .redis
                    .as_ref()
                    .is_some_and(|now| super::fleet::same_view(&old, now))
                {
                    super::fleet::leave(&old, &shared.instance).await;
                }
            }
            if stopping {
                return;
            }
            if policy.redis.is_none() {
                write_again_if_gone(&degrade, &policy).await;
                publish(&degrade, &policy, &metrics);
                continue;
            }
            let seen = degrade.runtime();
            let loaded = load_with_word(&policy).await;
            let held_here_before = held_switches.as_ref().is_some_and(|held| {
                policy
                    .redis
                    .as_ref()
                    .is_some_and(|now| super::fleet::same_view(held, now))
            });
            if let Ok((switches, _)) = &loaded {
                held_switches = (*switches != RuntimeSwitches::default())
                    .then(|| policy.redis.clone())
                    .flatten()
                    .or(held_switches.filter(|_| held_here_before));
            }
            match loaded {
                // Redis holds no switches at all, not even who handed the last one back: it
                // lost its data (restarted without persistence, flushed), or a reload pointed
                // levee at a place that never held any (`[redis]` added, another key prefix).
                // The switches in effect here are written there rather than given up: an
                // operator's pin ("keep traffic off the app while the database is repaired")
                // ended by itself.
                Ok((switches, None))
                    if switches == RuntimeSwitches::default() && *seen != switches =>
                {
                    if let Some(redis) = &policy.redis {
                        let why = if held_here_before {
                            Carried::Lost
                        } else {
                            Carried::Moved
                        };
                        carry_into(redis, &seen, why).await;
                    }
                }
                Ok((switches, handed_back_by)) if switches != *seen => {
                    let key = policy.redis.as_deref().map(hash_key).unwrap_or_default();
                    log_fleet_change(&seen, &switches, handed_back_by.as_deref(), &key);
                    // Not in the middle of an operator's change here, whose state file write
                    // this one's would race.
                    let _changing = degrade.lock_changes().await;
                    let copy = switches.clone();
                    if degrade.replace_runtime_if(&seen, switches) {
                        keep_local_copy(&degrade, &policy, &copy).await;
                    }
                }
                Ok(_) => {}
                // Keep the last known switches; Redis being away changes nothing here.
                Err(error) => tracing::debug!("cannot read degrade switches from redis: {error}"),
            }
            publish(&degrade, &policy, &metrics);
            catch_up_local_copy(&degrade, &policy).await;
            if let Some(redis) = &policy.redis {
                if policy.learns_app_cookies {
                    super::app_cookies::follow_fleet(redis, &shared.app_cookies).await;
                }
                redis.follow_cluster(&metrics);
                // Whatever the policy uses Redis for (queued jobs, switches and learned
                // cookie names have no expiry): once a minute at the default sync_interval,
                // and at each sync while Redis answers but the read did not.
                redis
                    .read_eviction_policy(policy.degrade.sync_interval * 120)
                    .await;
                super::fleet::write(redis, &shared.instance, &report_of(&shared, &policy)).await;
                super::fleet::check_size(redis, &shared.instance, &policy, &mut fleet_size).await;
            }
            written_to = policy.redis.clone();
        }
    })
}

/// Why switches are carried into a Redis that holds none (see [`carry_into`]).
enum Carried<'a> {
    /// Where this instance read switches before: it lost its data.
    Lost,
    /// A place a reload pointed levee at: `[redis]` added, another key prefix or server.
    Moved,
    /// At the start, the local copy's (in the policy's `state_file`).
    LocalCopy(&'a Policy),
}

/// Writes `switches` into a Redis that holds none, not even who handed the last one back
/// (see [`HANDED_BACK`]). Only while the hash is still absent: the first instance of the
/// fleet to find it so writes it, and the others then follow it as usual. True if written.
async fn carry_into(redis: &RedisStore, switches: &RuntimeSwitches, why: Carried<'_>) -> bool {
    let key = hash_key(redis);
    let mut command = redis::cmd("EVAL");
    command.arg(WRITE_IF_ABSENT).arg(1).arg(&key);
    for (field, value) in fields_of(switches) {
        command.arg(field).arg(value);
    }
    let kept = describe_changes(&RuntimeSwitches::default(), switches);
    match redis.command::<i64>(&command, SWITCH_TIMEOUT, None).await {
        Ok(1) => {
            let what = match why {
                Carried::Lost => "redis holds no degrade switches, not even who handed the last one back: it lost its data (restarted without persistence, flushed, its keys evicted under an allkeys-* maxmemory-policy, or a replica's full resync from an empty master); this instance wrote back the switches in effect here, and the fleet follows them (hand them back with levee level/module/breaker … auto, not by deleting the key)".to_string(),
                Carried::Moved => "[redis] names a place that holds no degrade switches yet (a reload added [redis] or moved it): this instance carried the switches in effect here into it, and the fleet follows them (hand them back with levee level/module/breaker … auto)".to_string(),
                Carried::LocalCopy(policy) => format!(
                    "redis holds no degrade switches yet (the first start with [redis], or a Redis that lost its data): this instance carried those of its local copy ({}) into it, and the fleet follows them (hand them back with levee level/module/breaker … auto)",
                    policy.degrade.state_file.display()
                ),
            };
            tracing::warn!(key = %key, kept = %crate::printable::printable(&kept), "{what}");
            true
        }
        Ok(_) => {
            tracing::debug!(
                "degrade switches written to redis meanwhile; following them at the next sync"
            );
            false
        }
        Err(error) => {
            tracing::debug!("cannot write the degrade switches back to redis yet: {error}");
            false
        }
    }
}

/// Writes the field-value pairs in ARGV into the hash KEYS[1] only if it does not exist;
/// 1 if written.
const WRITE_IF_ABSENT: &str = r#"
if redis.call('EXISTS', KEYS[1]) == 1 then
  return 0
end
for i = 1, #ARGV, 2 do
  redis.call('HSET', KEYS[1], ARGV[i], ARGV[i + 1])
end
return 1
"#;

/// The hash fields `switches` is kept in, as [`load_with_word`] reads them.
/// (A switch that cannot be encoded, which the types make impossible, is left out.)
fn fields_of(switches: &RuntimeSwitches) -> Vec<(String, String)> {
    let mut fields = Vec::new();
    if let Some(Ok(level)) = switches.level.as_ref().map(serde_json::to_string) {
        fields.push((LEVEL_FIELD.to_string(), level));
    }
    for (name, switch) in &switches.modules {
        if let Ok(json) = serde_json::to_string(switch) {
            fields.push((format!("{MODULE_FIELD}{name}"), json));
        }
    }
    for (name, switch) in &switches.breakers {
        if let Ok(json) = serde_json::to_string(switch) {
            fields.push((format!("{BREAKER_FIELD}{name}"), json));
        }
    }
    fields
}

/// Says what another instance (or an operator through it) changed. Redis holding no
/// switches at all where there were some is told apart: a Redis restarted without its data
/// looks exactly like that (see [`carry_into`]); unless Redis says who handed the last
/// one back (`handed_back_by`), a routine hand-back.
fn log_fleet_change(
    seen: &RuntimeSwitches,
    now: &RuntimeSwitches,
    handed_back_by: Option<&str>,
    key: &str,
) {
    let changes = describe_changes(seen, now);
    if *now == RuntimeSwitches::default() {
        // Made printable, as below: the text comes from Redis. (Redis holding nothing at all,
        // not even who, is a loss or a new place, written to by `carry_into` instead.)
        match handed_back_by {
            Some(by) => tracing::info!(
                changes = %crate::printable::printable(&changes),
                by = ?by,
                key = %key,
                "every runtime switch was handed back to the policy elsewhere in the fleet; following"
            ),
            // (Redis holding nothing at all is never followed: see `carry_into`.)
            None => tracing::info!(
                changes = %crate::printable::printable(&changes),
                key = %key,
                "every runtime switch was handed back to the policy elsewhere in the fleet; following"
            ),
        }
    } else {
        // Made printable (not Debug-quoted, which JSON logs then quoted twice): the names and
        // `by` texts come from Redis, where a newline or an escape sequence would forge a
        // log line or act on a terminal showing the log.
        tracing::info!(changes = %crate::printable::printable(&changes), "degrade switches changed elsewhere in the fleet; following");
    }
}

/// `level 1 -> policy, ranking off -> on (by alice)`: what differs between two sets of
/// switches, in words.
fn describe_changes(seen: &RuntimeSwitches, now: &RuntimeSwitches) -> String {
    let level = |switch: &Option<Switch<u8>>| {
        switch
            .as_ref()
            .map_or_else(|| "policy".to_string(), |switch| switch.value.to_string())
    };
    let module = |switch: Option<&Switch<bool>>| match switch {
        Some(switch) if switch.value => "off",
        Some(_) => "on",
        None => "policy",
    };
    let by = |by: Option<&str>| by.map(|by| format!(" (by {by})")).unwrap_or_default();
    let mut changes = Vec::new();
    if seen.level != now.level {
        changes.push(format!(
            "level {} -> {}{}",
            level(&seen.level),
            level(&now.level),
            by(now.level.as_ref().map(|switch| switch.by.as_str()))
        ));
    }
    let names: std::collections::BTreeSet<&String> =
        seen.modules.keys().chain(now.modules.keys()).collect();
    for name in names {
        let (before, after) = (seen.modules.get(name), now.modules.get(name));
        if before != after {
            changes.push(format!(
                "{name} {} -> {}{}",
                module(before),
                module(after),
                by(after.map(|switch| switch.by.as_str()))
            ));
        }
    }
    let names: std::collections::BTreeSet<&String> =
        seen.breakers.keys().chain(now.breakers.keys()).collect();
    for name in names {
        let (before, after) = (seen.breakers.get(name), now.breakers.get(name));
        if before != after {
            let pin = |switch: Option<&Switch<Force>>| Force::word(switch.map(|s| s.value));
            changes.push(format!(
                "breaker {name} {} -> {}{}",
                pin(before),
                pin(after),
                by(after.map(|switch| switch.by.as_str()))
            ));
        }
    }
    changes.join(", ")
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The state file is compared with the switches in effect at each sync (see
    /// `write_again_if_gone`): what is written must read back as equal, or it would be
    /// written again, with a warning, every `sync_interval`.
    #[test]
    fn switches_read_back_from_their_file_as_written() {
        let mut switches = RuntimeSwitches {
            level: Some(stamp(1, "alice (127.0.0.1)")),
            ..RuntimeSwitches::default()
        };
        switches
            .modules
            .insert("ranking".into(), stamp(true, "bob"));
        switches
            .breakers
            .insert("app".into(), stamp(crate::breaker::Force::Open, "ops"));
        let written = serde_json::to_vec_pretty(&switches).expect("json");
        let read: RuntimeSwitches = serde_json::from_slice(&written).expect("read");
        assert_eq!(read, switches);
    }

    #[test]
    fn a_saved_level_that_does_not_exist_is_not_put_in_effect() {
        let dir = tempfile::tempdir().expect("dir");
        let file = dir.path().join("state.json");
        for (level, kept) in [(2, true), (7, false)] {
            let saved = format!(
                "{{\"level\":{{\"value\":{level},\"by\":\"x\",\"at_unix\":1}},\"modules\":{{}}}}"
            );
            std::fs::write(&file, saved).expect("write");
            let loaded = load_file(&file).expect("loads");
            assert_eq!(loaded.level.is_some(), kept, "level {level}");
        }
    }

    #[test]
    fn a_state_file_from_before_breaker_pins_loads_and_pins_round_trip() {
        let dir = tempfile::tempdir().expect("dir");
        let file = dir.path().join("state.json");
        std::fs::write(&file, "{\"level\":null,\"modules\":{}}").expect("write");
        assert_eq!(load_file(&file).expect("loads"), RuntimeSwitches::default());
        let mut pinned = RuntimeSwitches::default();
        pinned
            .breakers
            .insert("ai".into(), stamp(Force::Closed, "alice"));
        let json = serde_json::to_string(&pinned).expect("encodes");
        assert!(json.contains("\"value\":\"closed\""), "{json}");
        std::fs::write(&file, json).expect("write");
        assert_eq!(load_file(&file).expect("loads"), pinned);
    }

    #[test]
    fn a_fleet_change_is_told_in_words() {
        let switch = |value, by: &str| Switch {
            value,
            by: by.to_string(),
            at_unix: 1,
        };
        let seen = RuntimeSwitches {
            level: Some(Switch {
                value: 1,
                by: "alice".into(),
                at_unix: 1,
            }),
            modules: [("ranking".to_string(), switch(true, "alice"))].into(),
            breakers: Default::default(),
        };
        let now = RuntimeSwitches {
            level: None,
            modules: [
                ("ranking".to_string(), switch(false, "bob")),
                ("ads".to_string(), switch(true, "bob")),
            ]
            .into(),
            breakers: [(
                "ai".to_string(),
                Switch {
                    value: Force::Open,
                    by: "carol".into(),
                    at_unix: 1,
                },
            )]
            .into(),
        };
        assert_eq!(
            describe_changes(&seen, &now),
            "level 1 -> policy, ads policy -> off (by bob), ranking off -> on (by bob), breaker ai auto -> open (by carol)"
        );
        assert_eq!(
            describe_changes(&seen, &RuntimeSwitches::default()),
            "level 1 -> policy, ranking off -> policy"
        );
    }

    #[test]
    fn state_file_is_replaced_whole_and_leaves_no_temporary_files() {
        let dir = tempfile::tempdir().expect("temp dir");
        let path = dir.path().join("levee-state.json");
        write_state_file(&path, b"{\"first\":1}").expect("first write");
        write_state_file(&path, b"{\"second\":2}").expect("second write");
        assert_eq!(
            std::fs::read(&path).expect("read back"),
            b"{\"second\":2}".to_vec()
        );
        let names: Vec<_> = std::fs::read_dir(dir.path())
            .expect("list")
            .map(|entry| entry.expect("entry").file_name())
            .collect();
        assert_eq!(names, vec![std::ffi::OsString::from("levee-state.json")]);
    }

    #[test]
    fn a_state_file_that_cannot_be_written_is_an_error_and_leaves_nothing() {
        let dir = tempfile::tempdir().expect("temp dir");
        let path = dir.path().join("missing").join("levee-state.json");
        assert!(write_state_file(&path, b"{}").is_err());
        assert!(!path.exists());
    }
}
