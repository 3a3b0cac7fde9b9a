//! Cookies the app sets (`Set-Cookie`): taken for one visitor's own on `stale` routes
//! (`learn_private_cookies`), as `private_cookies` are.
//!
//! A shop whose session cookie had a name of its own (`shopsid`), and whose pages said
//! nothing of caching (`session_cache_limiter('')`), gave one customer another's cart and
//! CSRF token through a shared fetch, with the app healthy, and kept that page as everyone's
//! copy. levee cannot know an app's cookie names, but it sees the app set them, on whatever
//! page (a cart marked `no-store` sets the session its unmarked product pages then read), and
//! a cookie the page's scripts set (`_ga`) never comes in `Set-Cookie`. Names are shared by
//! the fleet through Redis (`{key_prefix}app_cookies`), so an instance started later, or
//! restarted, knows them before the app sets them again.

use std::sync::{Arc, Mutex};

use arc_swap::ArcSwap;
use http::{header, HeaderMap, HeaderValue};

use crate::limit::key::{CookieName, Source};
use crate::redis_store::RedisStore;

/// Most names learned: a bound on what an app (or anything answering in its place) can make
/// levee hold and look through on every request of a `stale` route.
pub const MAX_LEARNED: usize = 32;

#[derive(Debug)]
pub struct AppCookies {
    names: ArcSwap<Vec<CookieName>>,
    /// Taken while a name is added: two answers setting one new name add it once.
    adding: Mutex<()>,
}

impl Default for AppCookies {
    fn default() -> Self {
        AppCookies {
            names: ArcSwap::from_pointee(Vec::new()),
            adding: Mutex::new(()),
        }
    }
}

impl AppCookies {
    /// Takes note of the cookies an upstream answer (`route`'s) sets. True when a name was
    /// new (for the fleet to learn it too).
    pub fn learn(&self, headers: &HeaderMap, route: &str) -> bool {
        let mut learned = false;
        for value in headers.get_all(header::SET_COOKIE) {
            let Some(name) = value
                .as_bytes()
                .split(|&byte| byte == b'=')
                .next()
                .and_then(|name| std::str::from_utf8(name).ok())
                .map(str::trim)
                .filter(|name| !name.is_empty())
            else {
                continue;
            };
            if self.add(name, Some(route)) {
                learned = true;
            }
        }
        learned
    }

    /// Adds the names the fleet learned (read from Redis): said once each, as learned here.
    pub fn merge<'a>(&self, names: impl IntoIterator<Item = &'a str>) {
        for name in names {
            self.add(name, None);
        }
    }

    /// Adds `name` (from an answer of `route`, or from the fleet); true when it was new.
    fn add(&self, name: &str, route: Option<&str>) -> bool {
        // A name known as written (PHP's renaming and decoding leave most names as they are),
        // without the parse's allocation: every answer that sets a cookie comes here.
        if self
            .names
            .load()
            .iter()
            .any(|known| !known.prefix && known.name == name)
        {
            return false;
        }
        let Ok(name) = CookieName::parse(name) else {
            return false;
        };
        if name.prefix || self.names.load().contains(&name) {
            return false;
        }
        let _adding = self
            .adding
            .lock()
            .unwrap_or_else(|poisoned| poisoned.into_inner());
        let known = self.names.load();
        if known.contains(&name) {
            return false;
        }
        if known.len() >= MAX_LEARNED {
            static FULL: crate::log_throttle::LogThrottle =
                crate::log_throttle::LogThrottle::new(std::time::Duration::from_secs(3600));
            if let Some(held_back) = FULL.allow(std::time::Instant::now()) {
                tracing::warn!(cookie = %name, held_back, "the app sets more cookie names than levee learns ({MAX_LEARNED}): requests carrying this one are not taken for one visitor's own on stale routes; list it in private_cookies if its pages are that visitor's");
            }
            return false;
        }
        let from = route.map_or_else(
            || "another instance of the fleet saw it".to_string(),
            |route| format!("route `{route}`"),
        );
        tracing::info!(cookie = %name, "the app sets cookie `{name}` ({from}): on stale routes, requests carrying it are taken for one visitor's own from now on (no copy served, none kept, no fetch shared), as private_cookies names are; list it in private_cookies to have this from the start, in the route's vary if its pages differ by its value only, or set learn_private_cookies = false on a route whose pages are the same with it");
        let mut names = Vec::clone(&known);
        names.push(name);
        self.names.store(Arc::new(names));
        true
    }

    /// Whether the request carries a learned cookie, other than one the route's copies vary
    /// by (`vary`: one copy per value is the route's own answer for it).
    pub fn carried_by(&self, headers: &HeaderMap, vary: &[Source]) -> bool {
        let names = self.names.load();
        crate::limit::key::has_cookie_but(headers, &names, |name| {
            vary.iter()
                .any(|source| matches!(source, Source::Cookie(varied) if varied == name))
        })
    }

    /// The names learned, for `/status`.
    pub fn names(&self) -> Vec<String> {
        self.names.load().iter().map(ToString::to_string).collect()
    }
}

/// Whether the answer sets a cookie the request carried: the app renewing that visitor's own
/// (a session re-encrypted on every page), so the page is that visitor's, whatever levee has
/// learned yet (the first answer seen to set it is one such).
pub fn sets_a_carried_cookie(answer: &HeaderMap, carried: &HeaderValue) -> bool {
    let carried: Vec<&[u8]> = carried
        .as_bytes()
        .split(|&byte| byte == b';')
        .filter_map(|pair| pair.split(|&byte| byte == b'=').next())
        .map(<[u8]>::trim_ascii)
        .filter(|name| !name.is_empty())
        .collect();
    answer.get_all(header::SET_COOKIE).iter().any(|value| {
        value
            .as_bytes()
            .split(|&byte| byte == b'=')
            .next()
            .is_some_and(|name| carried.contains(&name.trim_ascii()))
    })
}

/// The fleet's names, in Redis: a set under the key prefix.
fn shared_key(redis: &RedisStore) -> String {
    format!("{}app_cookies", redis.settings.key_prefix)
}

/// Adds `names` to the fleet's (in the background: a request learned them). A Redis that
/// does not take them now gets them with the next name learned, or from another instance.
pub fn share(redis: Arc<RedisStore>, names: Vec<String>) {
    tokio::spawn(async move {
        let mut command = redis::cmd("SADD");
        command.arg(shared_key(&redis)).arg(&names);
        if let Err(error) = redis
            .command::<i64>(&command, redis.background_bound(), None)
            .await
        {
            tracing::debug!("cannot share the learned cookie names: {error}");
        }
    });
}

/// Takes on the names the fleet learned (on each switch sync, and at the start), and gives
/// back those it lacks: a Redis that lost its data (restarted without persistence, flushed)
/// had the set only until then, and an instance started after that knew none of them.
pub async fn follow_fleet(redis: &RedisStore, learned: &AppCookies) {
    let mut command = redis::cmd("SMEMBERS");
    command.arg(shared_key(redis));
    let fleet = match redis
        .command::<Vec<String>>(&command, redis.background_bound(), None)
        .await
    {
        Ok(names) => names,
        Err(error) => {
            tracing::debug!("cannot read the fleet's learned cookie names: {error}");
            return;
        }
    };
    learned.merge(fleet.iter().map(String::as_str));
    let lacking: Vec<String> = learned
        .names()
        .into_iter()
        .filter(|name| !fleet.contains(name))
        .collect();
    if lacking.is_empty() {
        return;
    }
    let mut command = redis::cmd("SADD");
    command.arg(shared_key(redis)).arg(&lacking);
    match redis
        .command::<i64>(&command, redis.background_bound(), None)
        .await
    {
        Ok(_) => tracing::info!(
            names = %lacking.join(","),
            "learned private cookie names written back to redis, which did not have them"
        ),
        Err(error) => tracing::debug!("cannot share the learned cookie names: {error}"),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use http::HeaderValue;

    fn answer(set_cookies: &[&'static str], cache_control: Option<&'static str>) -> HeaderMap {
        let mut headers = HeaderMap::new();
        for value in set_cookies {
            headers.append(header::SET_COOKIE, HeaderValue::from_static(value));
        }
        if let Some(value) = cache_control {
            headers.insert(header::CACHE_CONTROL, HeaderValue::from_static(value));
        }
        headers
    }

    fn request(cookie: &'static str) -> HeaderMap {
        let mut headers = HeaderMap::new();
        headers.insert(header::COOKIE, HeaderValue::from_static(cookie));
        headers
    }

    #[test]
    fn the_cookies_the_app_sets_are_learned_and_those_the_fleet_learned_added() {
        let learned = AppCookies::default();
        // Set on a page marked no-store (a cart) too: the unmarked pages read it after.
        assert!(learned.learn(
            &answer(
                &["shopsid=abc; path=/; HttpOnly"],
                Some("no-store, no-cache")
            ),
            "cart",
        ));
        assert!(learned.learn(
            &answer(
                &["shopsid=abc; path=/", "shopsid=def", " theme = dark"],
                None
            ),
            "cart",
        ));
        assert!(!learned.learn(&answer(&["theme=light"], None), "cart"));
        assert_eq!(learned.names(), ["shopsid", "theme"]);
        assert!(learned.carried_by(&request("_ga=1; shopsid=xyz"), &[]));
        assert!(!learned.carried_by(&request("_ga=1; PHPSESSID=xyz"), &[]));
        // What the fleet learned.
        learned.merge(["PHPSESSID", "shopsid", "bad*name"]);
        assert_eq!(learned.names(), ["shopsid", "theme", "PHPSESSID"]);
        // A route whose copies vary by it has one copy per value: not a visitor's own there.
        assert!(!learned.carried_by(&request("theme=light"), &[Source::Cookie("theme".into())]));
    }

    #[test]
    fn learning_stops_at_its_bound() {
        let learned = AppCookies::default();
        for at in 0..MAX_LEARNED + 5 {
            let value = HeaderValue::from_str(&format!("c{at}=1")).expect("value");
            let mut headers = HeaderMap::new();
            headers.insert(header::SET_COOKIE, value);
            learned.learn(&headers, "r");
        }
        assert_eq!(learned.names().len(), MAX_LEARNED);
    }
}
