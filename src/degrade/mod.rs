//! Tiered degradation: levels, module switches, and what "off" means for a route.
//!
//! Every route has a tier: 1 is never degraded, 2 may be delayed, 3 may be switched off.
//! Level 0 is normal, level 1 turns tier 3 off, level 2 turns tiers 2 and 3 off. A module
//! (a feature such as `ranking`) can also be switched off on its own at any level. When a
//! route is off, its `degrade` action answers: the last good copy (`stale`), a page from the
//! policy (`reject`), or — with the queue — accept now, apply later.
//!
//! Switch state comes from three places: the policy (files), operators at runtime (admin
//! API; stored in Redis fleet-wide, or in a local state file without Redis), and automatic
//! triggers. Runtime beats policy; automatic can only raise the level.

pub mod app_cookies;
pub mod bulkhead;
pub mod cut;
pub mod fleet;
pub mod hide;
pub mod stale;
pub mod switches;
pub mod trigger;

use std::collections::{BTreeMap, BTreeSet};
use std::path::PathBuf;
use std::sync::atomic::{AtomicU8, Ordering};
use std::sync::Arc;
use std::time::Duration;

use arc_swap::ArcSwap;
use serde::{Deserialize, Serialize};

use crate::config::Policy;
use crate::proxy::route::{Route, StaticResponse};

/// The highest level: tiers 2 and 3 off.
pub const MAX_LEVEL: u8 = 2;

/// `[degrade]`, compiled.
#[derive(Debug, Clone, PartialEq)]
pub struct DegradeSettings {
    /// Level from the policy. Default 0.
    pub level: u8,
    /// Modules switched off by the policy. Default none.
    pub modules_off: BTreeSet<String>,
    /// Every module the policy names, with its tier.
    pub modules: BTreeMap<String, u8>,
    /// Where runtime switches are kept without Redis. Default `.levee-state.json` in the
    /// policy directory.
    pub state_file: PathBuf,
    /// How often switches are re-read from Redis. Default 500ms.
    pub sync_interval: Duration,
    /// Automatic triggers.
    pub triggers: Vec<trigger::Trigger>,
    /// Health needed before an automatic level is lowered. Default 30s.
    pub cool_down: Duration,
    /// Whether requests of a route with modules off tell the app which, in
    /// `X-Levee-Modules-Off` (and their answers are not kept as the route's copy). Default
    /// false.
    pub tell_app: bool,
    /// Most bytes of stale copies kept in levee's memory, every route's together. Default
    /// [`stale::L1_MAX_BYTES`].
    pub stale_memory: usize,
}

/// What an "off" route answers.
#[derive(Debug, Clone, PartialEq)]
pub enum DegradeAction {
    /// A page or JSON from the policy; `None`: 503 with `Retry-After`.
    Reject(Option<Arc<StaticResponse>>),
    /// The last good copy, if younger than `max_age`; else the route's fallback.
    Stale(Arc<StaleSettings>),
    /// Accept now (202), apply later: the request is stored in the route's queue.
    Queue,
}

#[derive(Debug, Clone, PartialEq)]
pub struct StaleSettings {
    /// Oldest copy that may be served. Default 10m.
    pub max_age: Duration,
    /// Request parts that select different copies (e.g. a language cookie).
    pub vary: Vec<crate::limit::key::Source>,
    /// Store responses that set cookies. Default false.
    pub allow_set_cookie: bool,
    /// Largest body stored. Default 1 MiB.
    pub max_body: usize,
    /// Which query parameters select different copies. Default the whole query.
    pub query: CopyQuery,
    /// Most copies the route keeps, in memory and in Redis each; the oldest stored goes first.
    /// Default 1000.
    pub max_copies: usize,
    /// A request carrying one of these cookies is one visitor's own: never answered from a
    /// copy, never kept as one, never sharing another's fetch. Default
    /// [`DEFAULT_PRIVATE_COOKIES`].
    pub private_cookies: Vec<crate::limit::key::CookieName>,
    /// Keep (and share) a page the app marks `no-cache` or `max-age=0` also when its request
    /// carried cookies: for an app that marks every page so. Default false.
    pub keep_no_cache: bool,
    /// Take a request carrying a cookie the app sets in answers it does not mark private
    /// for one visitor's own, as `private_cookies` (see [`app_cookies`]). Default true; not
    /// read with `allow_set_cookie`, which says pages that set cookies are everyone's.
    pub learn_private_cookies: bool,
    /// The app's own error statuses its copy answers in place of (nginx's
    /// `proxy_cache_use_stale http_500`), without counting against the breaker. Default none.
    pub on_status: Vec<u16>,
}

/// `private_cookies` of a `stale` route when the policy does not set it: the cookies of a
/// logged-in user, a commenter or a cart in the PHP applications most often run behind
/// levee (WordPress and WooCommerce, Drupal), whose pages for them carry no
/// `Cache-Control: private`.
pub const DEFAULT_PRIVATE_COOKIES: [&str; 7] = [
    "wordpress_logged_in_*",
    "wp-postpass_*",
    "comment_author_*",
    "wp_woocommerce_session_*",
    "woocommerce_items_in_cart",
    "SESS*",
    "SSESS*",
];

/// Default `max_copies` of a `stale` route.
pub const DEFAULT_MAX_COPIES: usize = 1000;

/// Which part of a request's query selects its copy (`degrade.query` of a `stale` route).
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum CopyQuery {
    /// The whole query as sent (`"all"`, the default): `?x=1` and `?x=2` are two copies.
    All,
    /// None of it (`"none"`): one copy per path.
    Ignored,
    /// Only these parameters (named as PHP names them, sorted); the others, such as a
    /// cache-busting `?_=123` or `utm_source`, are left out of the key.
    Only(Vec<String>),
}

/// A runtime switch and who set it when.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Switch<T> {
    pub value: T,
    pub by: String,
    pub at_unix: u64,
}

/// Switches set at runtime. Saved = in effect: this is exactly what is stored.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct RuntimeSwitches {
    pub level: Option<Switch<u8>>,
    /// Module name → off.
    pub modules: BTreeMap<String, Switch<bool>>,
    /// Upstream name → its breaker pinned open or closed. Absent from state files written
    /// before breakers were pinned fleet-wide.
    #[serde(default)]
    pub breakers: BTreeMap<String, Switch<crate::breaker::Force>>,
}

/// Process-wide degrade state; survives policy reloads.
pub struct Degrade {
    runtime: ArcSwap<RuntimeSwitches>,
    /// Held by a change from reading the switches until the changed ones are saved and in
    /// effect (see [`Degrade::lock_changes`]).
    changes: tokio::sync::Mutex<()>,
    /// With Redis: the last write of the local copy of the switches (`state_file`) failed,
    /// so the copy may be older than the switches in effect; written again at each sync
    /// until it succeeds (see `switches::keep_local_copy`).
    pub(crate) local_copy_behind: std::sync::atomic::AtomicBool,
    /// Raised by triggers; 0 when healthy.
    auto_level: AtomicU8,
    /// Why the automatic level is what it is, for `/status` (see [`AutoLevelReport`]).
    auto_report: std::sync::Mutex<AutoLevelReport>,
}

/// What the triggers say of the automatic level: the operator of a degraded site reads here
/// which trigger raised it, since when, what holds now, and when it comes down.
#[derive(Debug, Clone, Default, PartialEq, Serialize)]
pub struct AutoLevelReport {
    /// When the automatic level last changed (unix seconds); `None` before it ever did.
    pub changed_at_unix: Option<u64>,
    /// The triggers that held when it was last raised, as the log names them
    /// (`app inflight above 0.8`).
    pub raised_by: Vec<String>,
    /// The triggers that hold now, each with how long it has.
    pub holding: Vec<HoldingTrigger>,
    /// While the level is up and no trigger wants it any more: how long until the cool-down
    /// ends and it comes down, unless a trigger holds again (ms).
    pub lowers_in_ms: Option<u64>,
}

#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct HoldingTrigger {
    pub trigger: String,
    pub level: u8,
    /// How long it has held.
    pub for_ms: u64,
    /// How long it must hold to raise the level (its `for`).
    pub needs_ms: u64,
}

impl Default for Degrade {
    fn default() -> Self {
        Degrade::new()
    }
}

impl Degrade {
    pub fn new() -> Degrade {
        Degrade {
            runtime: ArcSwap::from_pointee(RuntimeSwitches::default()),
            changes: tokio::sync::Mutex::new(()),
            local_copy_behind: std::sync::atomic::AtomicBool::new(false),
            auto_level: AtomicU8::new(0),
            auto_report: std::sync::Mutex::new(AutoLevelReport::default()),
        }
    }

    pub fn runtime(&self) -> Arc<RuntimeSwitches> {
        self.runtime.load_full()
    }

    /// Serialises changes to the runtime switches. Each change copies the switches, saves the
    /// copy with its change, then puts it in effect; two at once (two operators switching two
    /// modules) would both copy the same switches, and the one saved last would undo the
    /// other, in memory and in the state file.
    pub async fn lock_changes(&self) -> tokio::sync::MutexGuard<'_, ()> {
        self.changes.lock().await
    }

    pub fn replace_runtime(&self, switches: RuntimeSwitches) {
        self.runtime.store(Arc::new(switches));
    }

    /// Replaces the switches only if they are still `seen` (what was in effect when a sync
    /// read from Redis began). An operator's change saved while that read was in flight is
    /// newer than what the read returned, and must not be undone by it for a sync interval.
    /// Says whether it replaced them.
    pub fn replace_runtime_if(
        &self,
        seen: &Arc<RuntimeSwitches>,
        switches: RuntimeSwitches,
    ) -> bool {
        let previous = self.runtime.compare_and_swap(seen, Arc::new(switches));
        Arc::ptr_eq(&previous, seen)
    }

    pub fn auto_level(&self) -> u8 {
        self.auto_level.load(Ordering::Relaxed)
    }

    pub fn auto_report(&self) -> AutoLevelReport {
        self.auto_report
            .lock()
            .unwrap_or_else(|poisoned| poisoned.into_inner())
            .clone()
    }

    /// Updates the triggers' word (see [`AutoLevelReport`]) in place.
    pub fn note_auto_report(&self, report: impl FnOnce(&mut AutoLevelReport)) {
        report(
            &mut self
                .auto_report
                .lock()
                .unwrap_or_else(|poisoned| poisoned.into_inner()),
        );
    }

    pub fn set_auto_level(&self, level: u8) {
        self.auto_level
            .store(level.min(MAX_LEVEL), Ordering::Relaxed);
    }

    /// The effective switches for one request, under one policy snapshot.
    pub fn view<'a>(&self, policy: &'a Policy) -> DegradeView<'a> {
        let runtime = self.runtime();
        let base = runtime
            .level
            .as_ref()
            .map_or(policy.degrade.level, |switch| switch.value);
        DegradeView {
            level: base.max(self.auto_level()),
            runtime,
            settings: &policy.degrade,
        }
    }
}

/// Is a tier switched off at a level? Tier 1 never is.
pub fn tier_off(tier: u8, level: u8) -> bool {
    match tier {
        0 | 1 => false,
        2 => level >= 2,
        _ => level >= 1,
    }
}

/// The switches in effect for one request.
pub struct DegradeView<'a> {
    pub level: u8,
    runtime: Arc<RuntimeSwitches>,
    settings: &'a DegradeSettings,
}

impl DegradeView<'_> {
    /// A module is off when switched off (runtime first, then policy) or when its tier is off.
    pub fn module_off(&self, module: &str) -> bool {
        let switched = match self.runtime.modules.get(module) {
            Some(switch) => switch.value,
            None => self.settings.modules_off.contains(module),
        };
        switched || self.level_turns_off(module)
    }

    /// Does the level turn off the tier of `module` (3 when the policy does not name it)?
    fn level_turns_off(&self, module: &str) -> bool {
        tier_off(
            self.settings.modules.get(module).copied().unwrap_or(3),
            self.level,
        )
    }

    /// Where a module's state comes from, for `/status`.
    /// What decided it: a switch that turns it off wins, then the level; a runtime `on`
    /// decides only when the level leaves the module's tier on.
    pub fn module_origin(&self, module: &str) -> &'static str {
        let runtime = self.runtime.modules.get(module).map(|switch| switch.value);
        let level_off = self.level_turns_off(module);
        match runtime {
            Some(true) => "runtime",
            None if self.settings.modules_off.contains(module) => "policy",
            _ if level_off => "level",
            Some(false) => "runtime",
            None => "default",
        }
    }

    pub fn route_off(&self, route: &Route) -> bool {
        if tier_off(route.tier, self.level) {
            return true;
        }
        route
            .module
            .as_deref()
            .is_some_and(|module| self.module_off(module))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_module_s_origin_names_what_switched_it_off() {
        let settings = DegradeSettings {
            level: 0,
            modules_off: BTreeSet::new(),
            modules: BTreeMap::from([("ranking".to_string(), 3)]),
            state_file: PathBuf::new(),
            sync_interval: Duration::from_millis(500),
            triggers: Vec::new(),
            cool_down: Duration::from_secs(30),
            tell_app: false,
            stale_memory: stale::L1_MAX_BYTES,
        };
        let switched_on = RuntimeSwitches {
            level: None,
            modules: BTreeMap::from([(
                "ranking".to_string(),
                Switch {
                    value: false,
                    by: "ops".to_string(),
                    at_unix: 0,
                },
            )]),
            breakers: BTreeMap::new(),
        };
        let view = |level| DegradeView {
            level,
            runtime: Arc::new(switched_on.clone()),
            settings: &settings,
        };
        // Switched on at runtime, and level 1 turns tier 3 off: the level decided.
        assert!(view(1).module_off("ranking"));
        assert_eq!(view(1).module_origin("ranking"), "level");
        // At level 0 the runtime `on` is what holds.
        assert!(!view(0).module_off("ranking"));
        assert_eq!(view(0).module_origin("ranking"), "runtime");
    }
}
