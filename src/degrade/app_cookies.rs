//! Cookies the app sets in answers it does not mark `private` or `no-store`: taken for one
//! visitor's own on `stale` routes (`learn_private_cookies`), as `private_cookies` are.
//!
//! A shop whose session cookie had a name of its own (`shopsid`), and whose pages said
//! nothing of caching (`session_cache_limiter('')`), gave one customer another's cart and
//! CSRF token through a shared fetch, with the app healthy, and kept that page as everyone's
//! copy. levee cannot know an app's cookie names, but it sees the app set them. An answer
//! that sets a cookie and says `private` or `no-store` (PHP's sessions by default) comes from
//! an app that marks its visitors' pages, so its cookies are not learned: their pages say so
//! themselves, and visitors carrying them keep getting copies.

use std::sync::Mutex;

use arc_swap::ArcSwap;
use http::{header, HeaderMap};

use crate::limit::key::{CookieName, Source};

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
    /// Takes note of the cookies an upstream answer (`route`'s) sets, unless it is marked
    /// `private` or `no-store`.
    pub fn learn(&self, headers: &HeaderMap, route: &str) {
        let mut set = headers.get_all(header::SET_COOKIE).iter().peekable();
        if set.peek().is_none() || marked_private(headers) {
            return;
        }
        for value in set {
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
            let Ok(name) = CookieName::parse(name) else {
                continue;
            };
            if name.prefix || self.names.load().contains(&name) {
                continue;
            }
            let _adding = self
                .adding
                .lock()
                .unwrap_or_else(|poisoned| poisoned.into_inner());
            let known = self.names.load();
            if known.contains(&name) {
                continue;
            }
            if known.len() >= MAX_LEARNED {
                static FULL: crate::log_throttle::LogThrottle =
                    crate::log_throttle::LogThrottle::new(std::time::Duration::from_secs(3600));
                if let Some(held_back) = FULL.allow(std::time::Instant::now()) {
                    tracing::warn!(cookie = %name, route, held_back, "the app sets more cookie names than levee learns ({MAX_LEARNED}): requests carrying this one are not taken for one visitor's own on stale routes; list it in private_cookies if its pages are that visitor's");
                }
                return;
            }
            tracing::info!(cookie = %name, route, "the app sets cookie `{name}` in an answer it does not mark private or no-store: on stale routes, requests carrying it are taken for one visitor's own from now on (no copy served, none kept, no fetch shared), as private_cookies names are; list it in private_cookies to have this from the start, or set learn_private_cookies = false on a route whose pages are the same with it");
            let mut names = Vec::clone(&known);
            names.push(name);
            self.names.store(std::sync::Arc::new(names));
        }
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

/// Whether the answer says it is one visitor's (`private`) or not to be kept (`no-store`).
fn marked_private(headers: &HeaderMap) -> bool {
    crate::proxy::header::list_elements(headers, &header::CACHE_CONTROL).any(|directive| {
        let name = directive
            .split(|&byte| byte == b'=')
            .next()
            .unwrap_or_default();
        name.eq_ignore_ascii_case(b"private") || name.eq_ignore_ascii_case(b"no-store")
    })
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
    fn cookies_set_in_unmarked_answers_are_learned_those_of_marked_ones_not() {
        let learned = AppCookies::default();
        learned.learn(
            &answer(
                &["PHPSESSID=abc; path=/; HttpOnly"],
                Some("no-store, no-cache"),
            ),
            "cart",
        );
        learned.learn(&answer(&["lang=de"], Some("private, max-age=0")), "cart");
        assert!(learned.names().is_empty());
        learned.learn(
            &answer(
                &["shopsid=abc; path=/", "shopsid=def", " theme = dark"],
                None,
            ),
            "cart",
        );
        assert_eq!(learned.names(), ["shopsid", "theme"]);
        assert!(learned.carried_by(&request("_ga=1; shopsid=xyz"), &[]));
        assert!(!learned.carried_by(&request("_ga=1; PHPSESSID=xyz"), &[]));
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
