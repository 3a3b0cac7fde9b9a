//! The compiled route table: first match wins, in the order the policy lists routes.

use std::collections::HashMap;
use std::fmt;
use std::hash::{BuildHasherDefault, Hasher};
use std::sync::{Arc, Mutex};

use http::Method;
use regex::Regex;

use super::upstream::Upstream;
use crate::degrade::hide::HidePlan;

/// A route's name, cheap to clone into metrics labels and log lines.
#[derive(Clone, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct RouteName(pub Arc<str>);

impl fmt::Display for RouteName {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.0)
    }
}

impl fmt::Debug for RouteName {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        fmt::Debug::fmt(&*self.0, f)
    }
}

impl prometheus_client::encoding::EncodeLabelValue for RouteName {
    fn encode(
        &self,
        encoder: &mut prometheus_client::encoding::LabelValueEncoder,
    ) -> Result<(), fmt::Error> {
        crate::metrics::write_escaped(encoder, &self.0)
    }
}

/// How a route matches the normalised path.
#[derive(Debug)]
pub enum PathMatch {
    Any,
    Exact(String),
    Prefix(String),
    Regex(Regex),
}

impl PathMatch {
    fn matches(&self, path: &str) -> bool {
        match self {
            PathMatch::Any => true,
            PathMatch::Exact(exact) => path == exact || runs_script(path, exact),
            PathMatch::Prefix(prefix) => path.starts_with(prefix.as_str()),
            PathMatch::Regex(regex) => regex.is_match(path),
        }
    }
}

/// Does `path` name the PHP script `exact` with PATH_INFO after it (`/wp-login.php/x`): the
/// common PHP-FPM setup (`location ~ [^/]\.php(/|$)` with `fastcgi_split_path_info`) runs the
/// script for it, so a route written for the script must hold for these spellings too.
fn runs_script(path: &str, exact: &str) -> bool {
    path.len() > exact.len()
        && path.as_bytes()[exact.len()] == b'/'
        && path.starts_with(exact)
        && exact.len() >= 4
        && exact.as_bytes()[exact.len() - 4..].eq_ignore_ascii_case(b".php")
}

/// A host pattern: `example.com` or `*.example.com`, compared without port, ignoring case.
#[derive(Debug)]
pub enum HostMatch {
    Exact(String),
    Suffix(String),
}

impl HostMatch {
    pub fn parse(pattern: &str) -> HostMatch {
        // Requests' hosts are compared without a trailing dot (`example.com.` is the same
        // name), so patterns are too: one written with it would never match.
        let pattern = pattern.strip_suffix('.').unwrap_or(pattern);
        let pattern = pattern.to_ascii_lowercase();
        match pattern.strip_prefix('*') {
            Some(suffix) => HostMatch::Suffix(suffix.to_string()),
            None => HostMatch::Exact(pattern),
        }
    }

    /// The pattern as a policy writes it (`*.example.com`), for `/status`.
    pub fn pattern(&self) -> String {
        match self {
            HostMatch::Exact(exact) => exact.clone(),
            HostMatch::Suffix(suffix) => format!("*{suffix}"),
        }
    }

    pub fn matches(&self, host: &str) -> bool {
        match self {
            HostMatch::Exact(exact) => host.eq_ignore_ascii_case(exact),
            HostMatch::Suffix(suffix) => {
                host.len() > suffix.len()
                    && host
                        .get(host.len() - suffix.len()..)
                        .is_some_and(|tail| tail.eq_ignore_ascii_case(suffix))
            }
        }
    }
}

/// One compiled route. Requests carry an `Arc<Route>` from routing to the access log.
#[derive(Debug)]
pub struct Route {
    pub name: RouteName,
    pub hosts: Vec<HostMatch>,
    pub methods: Vec<Method>,
    pub path: PathMatch,
    /// Where its requests must come from (the client as levee resolved it); empty: anyone.
    pub clients: Vec<ipnet::IpNet>,
    pub upstream: Arc<Upstream>,
    /// Largest request body accepted, in bytes (413 above it).
    pub max_body: u64,
    /// Rate-limit rules, all decided together.
    pub limits: Vec<Arc<crate::limit::LimitRule>>,
    /// Per rule of `limits`, its bucket key when the route alone decides it (a rule keyed by
    /// `route` or by nothing): built with the policy, not for every request.
    pub fixed_keys: Vec<Option<crate::limit::key::BucketKey>>,
    /// Answer while the upstream's breaker is open; `None`: 503 with `Retry-After`.
    pub fallback: Option<Arc<StaticResponse>>,
    /// 1 never degraded (default), 2 may be delayed, 3 may be switched off.
    pub tier: u8,
    /// The feature this route serves; switching it off turns the route off.
    pub module: Option<Arc<str>>,
    /// What the route answers while off. `None`: 503 with `Retry-After`.
    pub degrade: Option<crate::degrade::DegradeAction>,
    /// Module → CSS selector of the page fragments that show it.
    pub hide: Vec<(String, String)>,
    /// What hiding takes for each set of `hide`'s modules switched off, made on first use.
    pub hide_plans: HidePlans,
    /// The 202 answer of a queue route (`degrade.action = "queue"` or `always_queue`).
    pub queue: Option<Arc<crate::queue::QueueAction>>,
    /// Every request is queued, not only while the route is off.
    pub always_queue: bool,
    /// The form of levee's own answers on this route: its own `answer_format`, else the
    /// server's.
    pub answer_format: crate::config::policy::AnswerFormat,
    /// Its request metrics, found once per policy.
    pub series: crate::metrics::RouteSeries,
}

/// A route's plans for hiding its modules (see [`HidePlan`]), one per set of modules switched
/// off, made when a page is first served with that set: switches change seldom, pages are
/// served all the time. A reload compiles new routes, and with them new plans.
#[derive(Default)]
pub struct HidePlans(Mutex<Vec<(u64, Arc<HidePlan>)>>);

/// Sets of modules off whose plans a route keeps; the oldest goes first (a switch flapping
/// through many combinations rebuilds plans, it does not grow memory).
const HIDE_PLANS_KEPT: usize = 8;

impl HidePlans {
    /// The plan for the modules whose bits (by their index in `Route::hide`) are set in `off`.
    pub fn get_or_make(&self, off: u64, make: impl FnOnce() -> HidePlan) -> Arc<HidePlan> {
        let Ok(mut plans) = self.0.lock() else {
            return Arc::new(make());
        };
        if let Some((_, plan)) = plans.iter().find(|(set, _)| *set == off) {
            return plan.clone();
        }
        let plan = Arc::new(make());
        if plans.len() >= HIDE_PLANS_KEPT {
            plans.remove(0);
        }
        plans.push((off, plan.clone()));
        plan
    }
}

impl fmt::Debug for HidePlans {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let kept = self.0.lock().map_or(0, |plans| plans.len());
        write!(f, "HidePlans({kept} kept)")
    }
}

/// A response written in the policy.
#[derive(Debug, Clone, PartialEq)]
pub struct StaticResponse {
    pub status: http::StatusCode,
    pub content_type: http::HeaderValue,
    pub body: bytes::Bytes,
}

impl Route {
    fn matches(
        &self,
        host: Option<&str>,
        method: &Method,
        path: &str,
        client: Option<std::net::IpAddr>,
    ) -> bool {
        if !self.clients.is_empty()
            && !client.is_some_and(|client| super::header::in_networks(client, &self.clients))
        {
            return false;
        }
        // HEAD is a GET without the body (the app runs the same script): a route for GET
        // holds for it, as nginx's `limit_except GET` does.
        let method_holds = self.methods.is_empty()
            || self.methods.contains(method)
            || (*method == Method::HEAD && self.methods.contains(&Method::GET));
        if !method_holds {
            return false;
        }
        if !self.hosts.is_empty() {
            let Some(host) = host else { return false };
            if !self.hosts.iter().any(|pattern| pattern.matches(host)) {
                return false;
            }
        }
        self.path.matches(path)
    }

    /// Whether this route matches every request `later` matches, so that `later`, tried after
    /// it, never applies (`levee check` warns of it). Only what is certain from the matches as
    /// written: a set of methods, hosts or clients that holds the other's, and a path that
    /// holds the other's (see [`PathMatch::covers`]). Two regexes are compared as written, a
    /// host pattern by its text: a route this says nothing about may still never apply.
    pub fn matches_every_request_of(&self, later: &Route) -> bool {
        // Each list empty means any; a later route's empty list is more than any list holds.
        let clients = self.clients.is_empty()
            || (!later.clients.is_empty()
                && later
                    .clients
                    .iter()
                    .all(|net| self.clients.iter().any(|ours| ours.contains(net))));
        // HEAD is held by GET, as `matches` has it.
        let methods = self.methods.is_empty()
            || (!later.methods.is_empty()
                && later.methods.iter().all(|method| {
                    self.methods.contains(method)
                        || (*method == Method::HEAD && self.methods.contains(&Method::GET))
                }));
        let hosts = self.hosts.is_empty()
            || (!later.hosts.is_empty()
                && later
                    .hosts
                    .iter()
                    .all(|host| self.hosts.iter().any(|ours| ours.covers(host))));
        clients && methods && hosts && self.path.covers(&later.path)
    }
}

impl HostMatch {
    /// Whether every host `other` matches, this matches too.
    fn covers(&self, other: &HostMatch) -> bool {
        match (self, other) {
            (HostMatch::Exact(ours), HostMatch::Exact(theirs)) => ours == theirs,
            (HostMatch::Suffix(_), HostMatch::Exact(theirs)) => self.matches(theirs),
            // `*.example.com` holds `*.shop.example.com`.
            (HostMatch::Suffix(ours), HostMatch::Suffix(theirs)) => theirs.ends_with(ours.as_str()),
            (HostMatch::Exact(_), HostMatch::Suffix(_)) => false,
        }
    }
}

impl PathMatch {
    /// Whether every (normalised) path `other` matches, this matches too: any path, or the
    /// prefix `/`, holds every path; a prefix holds an exact path, a prefix, or an anchored
    /// regex's literal start that begins with it; an exact path holds itself, and a script's
    /// its PATH_INFO spellings (`/a.php` holds the exact `/a.php/b`); a regex holds only the
    /// same regex.
    fn covers(&self, other: &PathMatch) -> bool {
        match (self, other) {
            (PathMatch::Any, _) => true,
            (PathMatch::Prefix(prefix), _) if prefix == "/" => true,
            (PathMatch::Prefix(prefix), PathMatch::Exact(path) | PathMatch::Prefix(path)) => {
                path.starts_with(prefix.as_str())
            }
            (PathMatch::Prefix(prefix), PathMatch::Regex(regex)) => {
                anchored_literal_start(regex.as_str())
                    .is_some_and(|start| start.starts_with(prefix.as_str()))
            }
            // Every path the later exact path matches begins with it (and with a `/` after
            // it when it is more), which is how this one matches it too.
            (PathMatch::Exact(_), PathMatch::Exact(path)) => self.matches(path),
            (PathMatch::Regex(ours), PathMatch::Regex(theirs)) => ours.as_str() == theirs.as_str(),
            _ => false,
        }
    }

    /// The text every path this matches begins with, when the match says: an exact path or
    /// prefix as written, an anchored regex's literal start.
    pub fn literal_start(&self) -> Option<std::borrow::Cow<'_, str>> {
        match self {
            PathMatch::Any => None,
            PathMatch::Exact(text) | PathMatch::Prefix(text) => {
                Some(std::borrow::Cow::Borrowed(text.as_str()))
            }
            PathMatch::Regex(regex) => {
                anchored_literal_start(regex.as_str()).map(std::borrow::Cow::Owned)
            }
        }
    }
}

/// Routes in policy order, plus the route for requests that match none of them.
#[derive(Debug, Default)]
pub struct RouteTable {
    pub routes: Vec<Arc<Route>>,
    /// Catch-all on the default upstream; `None` when the policy has no default upstream,
    /// in which case unmatched requests get 404.
    pub fallback: Option<Arc<Route>>,
    /// Whether any route matches on the host: when none does, requests are routed without
    /// looking for theirs (a lookup, a check of every byte and a search for the port).
    by_host: bool,
    /// The routes a path may match, by its first segment: `None` for short tables.
    index: Option<SegmentIndex>,
    /// Scripts that route what follows them (see `front_controller_reading`): `index.php`,
    /// and every FastCGI upstream's `index` and `front_controller` (Symfony's `app.php`).
    front_controllers: Box<[String]>,
}

/// Tables shorter than this are walked whole: the walk costs less than finding the segment.
const ROUTES_WORTH_AN_INDEX: usize = 12;

impl RouteTable {
    pub fn new(routes: Vec<Arc<Route>>, fallback: Option<Arc<Route>>) -> RouteTable {
        let by_host = routes.iter().any(|route| !route.hosts.is_empty());
        let index = (routes.len() >= ROUTES_WORTH_AN_INDEX).then(|| SegmentIndex::new(&routes));
        let mut front_controllers = vec![DIRECTORY_INDEX.to_string()];
        for route in routes.iter().chain(fallback.as_ref()) {
            if let Some(fastcgi) = &route.upstream.settings.fastcgi {
                let scripts = std::iter::once(fastcgi.index.as_str())
                    .chain(fastcgi.front_controller.as_deref());
                for script in scripts {
                    let name = script.rsplit('/').next().unwrap_or(script);
                    if names_a_script(name) && !front_controllers.iter().any(|known| known == name)
                    {
                        front_controllers.push(name.to_string());
                    }
                }
            }
        }
        RouteTable {
            routes,
            fallback,
            by_host,
            index,
            front_controllers: front_controllers.into_boxed_slice(),
        }
    }

    /// The host a request names, as `find` needs it: `None` when no route matches on hosts.
    pub fn host_of<'a>(&self, uri: &'a http::Uri, headers: &'a http::HeaderMap) -> Option<&'a str> {
        if self.by_host {
            request_host(uri, headers)
        } else {
            None
        }
    }

    /// `find` without the index: every route in order.
    #[cfg(test)]
    pub fn find_by_walking(
        &self,
        host: Option<&str>,
        method: &Method,
        path: &str,
    ) -> Option<&Arc<Route>> {
        let walk = |path: &str, before: usize| {
            self.routes
                .iter()
                .take(before)
                .enumerate()
                .find(|(_, route)| route.matches(host, method, path, None))
        };
        self.as_php_reads(path, walk).ok().flatten()
    }

    /// Whether `find` looks paths up by their first segment.
    #[cfg(test)]
    pub fn is_indexed(&self) -> bool {
        self.index.is_some()
    }

    /// How many route positions the index holds in all.
    #[cfg(test)]
    pub fn index_entries(&self) -> usize {
        self.index.as_ref().map_or(0, |index| {
            index.unnamed.len()
                + index.by_segment.values().map(|at| at.len()).sum::<usize>()
                + index.by_host.values().map(|at| at.len()).sum::<usize>()
        })
    }

    /// `find_from` for a client levee does not know: routes limited to some clients are
    /// not found.
    /// A path whose spellings disagree finds none.
    pub fn find(&self, host: Option<&str>, method: &Method, path: &str) -> Option<&Arc<Route>> {
        self.find_from(host, method, path, None).ok().flatten()
    }

    /// `host` is without port (see `host_of`); `path` is normalised; `client` is the client's
    /// address as levee resolved it. The path is also read as a front controller reads it
    /// (see `as_php_reads`).
    pub fn find_from(
        &self,
        host: Option<&str>,
        method: &Method,
        path: &str,
        client: Option<std::net::IpAddr>,
    ) -> Result<Option<&Arc<Route>>, SpellingsDisagree> {
        // The first route of those before position `before` that matches `path`.
        let first = |path: &str, before: usize| match &self.index {
            Some(index) => index
                .candidates(host, path)
                .take_while(|at| (*at as usize) < before)
                .filter_map(|at| Some((at as usize, self.routes.get(at as usize)?)))
                .find(|(_, route)| route.matches(host, method, path, client)),
            None => self
                .routes
                .iter()
                .take(before)
                .enumerate()
                .find(|(_, route)| route.matches(host, method, path, client)),
        };
        self.as_php_reads(path, first)
    }

    /// The route of `path` as the PHP app behind reads it: a front controller runs
    /// `/index.php/admin/users` as `/admin/users` (see `front_controller_reading`), so the
    /// first route in policy order that matches either spelling applies, since a client picks
    /// the spelling. The route of the path as written stays when it is the first of all, or
    /// its exact `path` names the script (a legacy `/index.php` that is a page of its own).
    /// When the two spellings fall on routes of different upstreams, neither can be trusted
    /// to be where the app runs the request; when the reading names a script
    /// (`/admin/index.php/ajax.php` as `/admin/ajax.php`), its route is written for a script
    /// that does not run, and the written one for a page the front controller does not
    /// serve: either way, `SpellingsDisagree`.
    fn as_php_reads<'t>(
        &'t self,
        path: &str,
        first: impl Fn(&str, usize) -> Option<(usize, &'t Arc<Route>)>,
    ) -> Result<Option<&'t Arc<Route>>, SpellingsDisagree> {
        let written = first(path, usize::MAX);
        // Only a route before the written spelling's can change what applies.
        let before = match written {
            Some((at, route)) if at == 0 || matches!(route.path, PathMatch::Exact(_)) => {
                return Ok(Some(route))
            }
            Some((at, _)) => at,
            None => usize::MAX,
        };
        let written = written.map(|(_, route)| route).or(self.fallback.as_ref());
        let Some((reading, names_a_script)) =
            front_controller_reading(path, &self.front_controllers)
        else {
            return Ok(written);
        };
        match (written, first(&reading, before)) {
            (Some(written), Some((_, read)))
                if names_a_script || !Arc::ptr_eq(&written.upstream, &read.upstream) =>
            {
                Err(SpellingsDisagree {
                    written: written.name.clone(),
                    read: read.name.clone(),
                    reading,
                    why: if names_a_script {
                        "which names another script"
                    } else {
                        "of another upstream"
                    },
                })
            }
            (_, Some((_, read))) => Ok(Some(read)),
            (written, None) => Ok(written),
        }
    }
}

/// A path whose two spellings (see `RouteTable::as_php_reads`) fall on routes of different
/// upstreams.
#[derive(Debug)]
pub struct SpellingsDisagree {
    pub written: RouteName,
    pub read: RouteName,
    /// The path as a front controller reads it.
    pub reading: String,
    /// Why the reading's route cannot simply apply.
    pub why: &'static str,
}

impl SpellingsDisagree {
    /// What the client is told: about its path alone, without the routes' names (the log has
    /// them, from `Display`).
    pub fn reason(&self) -> String {
        format!(
            "a front controller reads this path as {}, which is another part of the site: ask for that path itself",
            self.reading
        )
    }
}

impl fmt::Display for SpellingsDisagree {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(
            f,
            "the path falls on route `{}`, and as a front controller reads it ({}) on route `{}` {}",
            self.written, self.reading, self.read, self.why
        )
    }
}

/// The methods other than POST that a POST's overrides name, each with what named it: the
/// `X-HTTP-Method-Override` header (read by Symfony, Laravel, CakePHP, CodeIgniter, Yii,
/// Slim) and a `_method` query parameter (Laravel's and Symfony's parameter override; a
/// `_method` in a form body is not seen before the body is read). A value that is not a
/// method name (letters) names none: no framework runs it.
pub fn method_overrides(
    headers: &http::HeaderMap,
    query: Option<&str>,
) -> Vec<(Method, &'static str)> {
    let header = headers
        .get_all("x-http-method-override")
        .iter()
        .map(|value| {
            (
                value.as_bytes().trim_ascii().to_vec(),
                "X-HTTP-Method-Override",
            )
        });
    let parameter = query
        // PHP reads `%5Fmethod` and `.method` as `_method` too.
        .filter(|query| query.contains("method") || query.contains('%'))
        .and_then(|query| {
            let source = crate::limit::key::Source::Query("_method".into());
            let value = source.read_bytes(headers, Some(query))?;
            Some((value.into_owned(), "the _method parameter"))
        });
    header
        .chain(parameter)
        .filter_map(|(mut name, named_by)| {
            if name.is_empty() || !name.iter().all(u8::is_ascii_alphabetic) {
                return None;
            }
            name.make_ascii_uppercase();
            let method = Method::from_bytes(&name).ok()?;
            (method != Method::POST).then_some((method, named_by))
        })
        .collect()
}

/// The path a front controller routes by when the request names it with PATH_INFO:
/// `/index.php/admin/users` is `/admin/users` to Symfony and Laravel (their path info),
/// WordPress (`index.php` permalinks), Joomla and CodeIgniter, as `/shop/index.php/cart` is
/// `/shop/cart` to a shop's own; and whether that reading names a script itself
/// (`/wp-admin/index.php/admin-ajax.php` runs the dashboard, not `admin-ajax.php`). `None`
/// unless the script run (the first segment ending in `.php`, as levee's FastCGI client and
/// `fastcgi_split_path_info` find it) is one of `front_controllers` with more after it.
fn front_controller_reading(path: &str, front_controllers: &[String]) -> Option<(String, bool)> {
    // Most paths name no front controller: a search or two, and no walk over their segments.
    if !front_controllers
        .iter()
        .any(|name| path.contains(name.as_str()))
    {
        return None;
    }
    let mut start = 0;
    while start < path.len() {
        let end = path
            .get(start + 1..)?
            .find('/')
            .map_or(path.len(), |at| start + 1 + at);
        let segment = path.get(start + 1..end)?;
        if names_a_script(segment) {
            let rest = path.get(end..)?;
            if rest.is_empty() || !front_controllers.iter().any(|name| name == segment) {
                return None;
            }
            let reading = format!("{}{rest}", path.get(..start)?);
            return Some((reading, rest.split('/').any(names_a_script)));
        }
        start = end;
    }
    None
}

/// Whether a path segment names a PHP script (`x.php`, `X.PHP`).
fn names_a_script(segment: &str) -> bool {
    segment.len() > 4 && segment.as_bytes()[segment.len() - 4..].eq_ignore_ascii_case(b".php")
}

/// The script name PHP sites run for a directory (`index` in nginx and in levee's FastCGI
/// settings, by default) and the front controller of nearly every framework (Laravel,
/// Symfony, WordPress, Drupal, CodeIgniter).
const DIRECTORY_INDEX: &str = "index.php";

/// Which routes a request can match, by its path's first segment (`module-7` of
/// `/module-7/list.php`) and by its host. Most routes of a large table name their first
/// segment: a `path`, a `path_prefix` that goes past it (`/module-7/`), a `path_regex` that
/// starts with it (`^/archive/7/`). Of those that name none, most that name a host name
/// exact hosts (`host = "static.example.com"` with `path_prefix = "/"`). A request is tried
/// against the routes of its segment, those of its host and those that name neither, in
/// policy order: first match still wins, and walking fifty routes (a few thousand
/// instructions, most of a full policy's routing) becomes walking a handful.
#[derive(Debug)]
struct SegmentIndex {
    /// Segment → positions in the table of the routes that name it, in order.
    by_segment: HashMap<Box<str>, Box<[u32]>, BuildHasherDefault<SegmentHasher>>,
    /// Host (lower case) → positions of the routes that name no segment and match only
    /// exact hosts, this one among them.
    by_host: HashMap<Box<str>, Box<[u32]>, BuildHasherDefault<SegmentHasher>>,
    /// Positions of the other routes: a request of any segment and host may match them.
    unnamed: Box<[u32]>,
}

impl SegmentIndex {
    /// Built in one pass, each route listed once per key it names: a table of thousands of
    /// segments and thousands of routes that name none stays as small as the table itself
    /// (the candidates of a request are merged from the lists as it is looked up).
    fn new(routes: &[Arc<Route>]) -> SegmentIndex {
        type Lists = HashMap<Box<str>, Vec<u32>, BuildHasherDefault<SegmentHasher>>;
        let mut by_segment = Lists::default();
        let mut by_host = Lists::default();
        let mut unnamed = Vec::new();
        for (at, route) in routes.iter().enumerate() {
            let Ok(at) = u32::try_from(at) else { break };
            if let Some(segment) = route.path.first_segment() {
                by_segment
                    .entry(segment.into_boxed_str())
                    .or_default()
                    .push(at);
                continue;
            }
            let only_exact_hosts = !route.hosts.is_empty()
                && route
                    .hosts
                    .iter()
                    .all(|host| matches!(host, HostMatch::Exact(_)));
            if !only_exact_hosts {
                unnamed.push(at);
                continue;
            }
            for host in &route.hosts {
                if let HostMatch::Exact(exact) = host {
                    let positions = by_host.entry(exact.as_str().into()).or_default();
                    // A host listed twice lists the route once.
                    if positions.last() != Some(&at) {
                        positions.push(at);
                    }
                }
            }
        }
        let frozen = |lists: Lists| {
            lists
                .into_iter()
                .map(|(key, positions)| (key, positions.into_boxed_slice()))
                .collect()
        };
        SegmentIndex {
            by_segment: frozen(by_segment),
            by_host: frozen(by_host),
            unnamed: unnamed.into_boxed_slice(),
        }
    }

    /// The positions of the routes a request for `path` on `host` may match, in table order.
    fn candidates(&self, host: Option<&str>, path: &str) -> InOrder<'_> {
        let named = self
            .by_segment
            .get(first_segment(path))
            .map_or(&[][..], |positions| &positions[..]);
        let hosted = match host {
            Some(host) if !self.by_host.is_empty() => self.of_host(host),
            _ => &[][..],
        };
        InOrder {
            lists: [named, hosted, &self.unnamed],
        }
    }

    /// The routes listed under `host`, whatever its case: looked up in lower case, which
    /// most hosts already are.
    fn of_host(&self, host: &str) -> &[u32] {
        let found = if host.bytes().any(|byte| byte.is_ascii_uppercase()) {
            self.by_host.get(host.to_ascii_lowercase().as_str())
        } else {
            self.by_host.get(host)
        };
        found.map_or(&[][..], |positions| &positions[..])
    }
}

/// Ascending lists of positions, merged.
struct InOrder<'a> {
    lists: [&'a [u32]; 3],
}

impl Iterator for InOrder<'_> {
    type Item = u32;

    fn next(&mut self) -> Option<u32> {
        let list = self
            .lists
            .iter_mut()
            .filter(|list| !list.is_empty())
            .min_by_key(|list| list.first().copied())?;
        let (first, rest) = list.split_first()?;
        *list = rest;
        Some(*first)
    }
}

/// FNV-1a, for the index's few short keys. The keys come from the policy and the map never
/// changes after it is built, so a client's chosen paths cannot crowd it (what SipHash, the
/// default, guards against, at several times the cost: more than walking the routes saved).
#[derive(Default)]
struct SegmentHasher(u64);

impl Hasher for SegmentHasher {
    fn write(&mut self, bytes: &[u8]) {
        let mut hash = if self.0 == 0 {
            0xcbf2_9ce4_8422_2325
        } else {
            self.0
        };
        for byte in bytes {
            hash ^= u64::from(*byte);
            hash = hash.wrapping_mul(0x0100_0000_01b3);
        }
        self.0 = hash;
    }

    fn finish(&self) -> u64 {
        self.0
    }
}

/// The first segment of a path: between its leading `/` and the next (or the end).
fn first_segment(path: &str) -> &str {
    let rest = path.strip_prefix('/').unwrap_or(path);
    // A byte loop: `split` sets up a searcher that costs more than these few bytes.
    match rest.bytes().position(|byte| byte == b'/') {
        Some(end) => rest.get(..end).unwrap_or(rest),
        None => rest,
    }
}

/// The segment a literal path start fixes: `/module-7/` and `/module-7/list` fix `module-7`;
/// `/module-7` does not (`/module-70` starts with it too).
fn fixed_segment(start: &str) -> Option<String> {
    let rest = start.strip_prefix('/')?;
    let (segment, _) = rest.split_once('/')?;
    Some(segment.to_string())
}

impl PathMatch {
    /// The first segment of every path this matches, when it is one and the same.
    fn first_segment(&self) -> Option<String> {
        match self {
            PathMatch::Any => None,
            PathMatch::Exact(exact) => exact
                .starts_with('/')
                .then(|| first_segment(exact).to_string()),
            PathMatch::Prefix(prefix) => fixed_segment(prefix),
            PathMatch::Regex(regex) => fixed_segment(&anchored_literal_start(regex.as_str())?),
        }
    }
}

/// The literal text every match of `pattern` begins with when the pattern is anchored at the
/// start (`^/archive/7/[0-9]+` → `/archive/7/`); `None` when it is not anchored, or starts
/// with anything but a literal (a class, a group, an alternation, a flag).
fn anchored_literal_start(pattern: &str) -> Option<String> {
    use regex_syntax::hir::{HirKind, Look};
    let hir = regex_syntax::Parser::new().parse(pattern).ok()?;
    let HirKind::Concat(parts) = hir.kind() else {
        return None;
    };
    let mut parts = parts.iter();
    if !matches!(parts.next()?.kind(), HirKind::Look(Look::Start)) {
        return None;
    }
    let mut start = Vec::new();
    for part in parts {
        match part.kind() {
            HirKind::Literal(literal) => start.extend_from_slice(&literal.0),
            _ => break,
        }
    }
    String::from_utf8(start).ok()
}

/// The host a request names, without port and without the trailing dot of a fully qualified
/// name (`admin.example.` is `admin.example`, as DNS and nginx's `server_name` have it: a
/// host route must not be dodged by a dot): the `Host` header, or the authority of an
/// absolute-form target.
pub(crate) fn request_host<'a>(
    uri: &'a http::Uri,
    headers: &'a http::HeaderMap,
) -> Option<&'a str> {
    let raw = match headers.get(http::header::HOST) {
        Some(value) => value.to_str().ok()?,
        None => uri.host()?,
    };
    let host = strip_port(raw);
    Some(host.strip_suffix('.').unwrap_or(host))
}

fn strip_port(host: &str) -> &str {
    if host.starts_with('[') {
        // IPv6 literal: keep the brackets, drop the port.
        return host.find(']').map_or(host, |end| &host[..=end]);
    }
    // A byte loop: `rsplit_once` sets up a searcher that costs more than a host's bytes.
    match host.bytes().rposition(|byte| byte == b':') {
        Some(colon) => host.get(..colon).unwrap_or(host),
        None => host,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn hide_plans_are_made_once_per_set_of_modules_off_and_the_oldest_go_first() {
        let plans = HidePlans::default();
        let made = std::cell::Cell::new(0);
        let plan_for = |off: u64| {
            plans.get_or_make(off, || {
                made.set(made.get() + 1);
                HidePlan::new(vec![format!("#m{off}")], Vec::new())
            })
        };
        let first = plan_for(0b01);
        assert!(Arc::ptr_eq(&first, &plan_for(0b01)));
        assert!(!Arc::ptr_eq(&first, &plan_for(0b11)));
        assert_eq!(made.get(), 2);
        // Eight sets are kept: a ninth pushes out the oldest, which is made again.
        for off in 2..=8u64 {
            plan_for(off << 8);
        }
        assert_eq!(made.get(), 9);
        plan_for(0b11);
        assert_eq!(made.get(), 9, "kept");
        plan_for(0b01);
        assert_eq!(made.get(), 10, "pushed out, made again");
    }

    #[test]
    fn host_patterns() {
        assert!(HostMatch::parse("Example.com").matches("example.COM"));
        assert!(!HostMatch::parse("example.com").matches("www.example.com"));
        assert!(HostMatch::parse("*.example.com").matches("www.example.com"));
        assert!(!HostMatch::parse("*.example.com").matches(".example.com"));
        assert!(!HostMatch::parse("*.example.com").matches("example.com"));
    }

    #[test]
    fn a_fully_qualified_host_is_the_same_host() {
        let uri: http::Uri = "/".parse().unwrap();
        for (raw, host) in [
            ("admin.example.", "admin.example"),
            ("admin.example.:8080", "admin.example"),
            ("admin.example", "admin.example"),
            ("[::1]:80", "[::1]"),
        ] {
            let mut headers = http::HeaderMap::new();
            headers.insert(http::header::HOST, http::HeaderValue::from_static(raw));
            assert_eq!(request_host(&uri, &headers), Some(host), "{raw}");
        }
        assert!(HostMatch::parse("*.example").matches("admin.example"));
        // A pattern written with the dot is the same host: it matched nothing.
        assert!(HostMatch::parse("admin.example.").matches("admin.example"));
        assert!(HostMatch::parse("*.example.").matches("admin.example"));
    }

    #[test]
    fn routes_name_a_first_segment_only_when_every_path_they_match_has_it() {
        let regex = |pattern: &str| PathMatch::Regex(Regex::new(pattern).expect("regex"));
        let cases = [
            (PathMatch::Exact("/legacy/page.php".into()), Some("legacy")),
            (PathMatch::Exact("/".into()), Some("")),
            (PathMatch::Prefix("/module-7/".into()), Some("module-7")),
            (PathMatch::Prefix("/module-7/list".into()), Some("module-7")),
            (PathMatch::Prefix("/module-7".into()), None),
            (PathMatch::Prefix("/".into()), None),
            (PathMatch::Any, None),
            (regex(r"^/archive/7/[0-9]+\.php$"), Some("archive")),
            (regex(r"^/archive/?x"), None),
            (regex(r"^/ab+/"), None),
            (regex(r"(?i)^/admin/"), None),
            (regex(r"(?m)^/admin/"), None),
            (regex(r"^/a/|^/b/"), None),
            (regex(r"/shop/"), None),
            (regex(r"^/shop"), None),
            (regex(r"^/(shop|store)/"), None),
        ];
        for (path, segment) in cases {
            assert_eq!(path.first_segment().as_deref(), segment, "{path:?}");
        }
        assert_eq!(first_segment("/module-7/list.php"), "module-7");
        assert_eq!(first_segment("/module-7"), "module-7");
        assert_eq!(first_segment("/"), "");
    }

    #[test]
    fn a_php_scripts_path_also_matches_it_with_path_info() {
        let login = PathMatch::Exact("/wp-login.php".into());
        for path in ["/wp-login.php", "/wp-login.php/", "/wp-login.php/x/y"] {
            assert!(login.matches(path), "{path}");
        }
        for path in [
            "/wp-login.phpx",
            "/wp-login.ph",
            "/wp-login.php.bak",
            "/x/wp-login.php",
        ] {
            assert!(!login.matches(path), "{path}");
        }
        // Only scripts: a page's exact path stays exact.
        let page = PathMatch::Exact("/about".into());
        assert!(!page.matches("/about/x"));
        assert!(PathMatch::Exact("/Index.PHP".into()).matches("/Index.PHP/x"));
        assert!(!PathMatch::Exact("/".into()).matches("//"));
    }

    #[test]
    fn a_posts_method_overrides_are_read_as_frameworks_read_them() {
        let overrides = |header: Option<&str>, query: Option<&str>| {
            let mut headers = http::HeaderMap::new();
            if let Some(value) = header {
                headers.insert(
                    "x-http-method-override",
                    http::HeaderValue::from_str(value).expect("value"),
                );
            }
            method_overrides(&headers, query)
                .into_iter()
                .map(|(method, named_by)| format!("{method} by {named_by}"))
                .collect::<Vec<_>>()
        };
        assert_eq!(
            overrides(Some("delete"), None),
            ["DELETE by X-HTTP-Method-Override"]
        );
        assert_eq!(
            overrides(None, Some("a=1&_method=PUT")),
            ["PUT by the _method parameter"]
        );
        // PHP's names: `%5Fmethod` and `.method` are `_method`; the last of several wins.
        for query in [
            "%5Fmethod=PATCH",
            ".method=PATCH",
            "_method=GET&_method=PATCH",
        ] {
            assert_eq!(
                overrides(None, Some(query)),
                ["PATCH by the _method parameter"],
                "{query}"
            );
        }
        assert_eq!(overrides(Some("PUT"), Some("_method=DELETE")).len(), 2);
        // POST itself, nothing, or what is no method name: no override.
        for (header, query) in [
            (Some("POST"), None),
            (Some(""), Some("_method=")),
            (Some("DEL ETE"), Some("_method=DE%00LETE")),
            (None, Some("method=DELETE")),
            (None, None),
        ] {
            assert!(overrides(header, query).is_empty(), "{header:?} {query:?}");
        }
    }

    #[test]
    fn ports_are_stripped() {
        assert_eq!(strip_port("example.com:8080"), "example.com");
        assert_eq!(strip_port("example.com"), "example.com");
        assert_eq!(strip_port("[::1]:8080"), "[::1]");
    }
}
