//! Raw policy file types, exactly as operators write them in TOML.
//!
//! Every type here is a `…Spec`: it only describes what the file says. Validation, defaults
//! and cross-references happen in [`super::compile`], which turns specs into a [`super::Policy`].
//! Unknown keys are errors (`deny_unknown_fields`), so a typo never silently does nothing.
//! Scalars are wrapped in [`Spanned`] so that compile errors can point at `file:line:col`.

use std::collections::{BTreeMap, BTreeSet};

use serde::Deserialize;
use toml::Spanned;

/// One `*.toml` file of the policy directory.
#[derive(Debug, Default, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct FileSpec {
    pub server: Option<Spanned<ServerSpec>>,
    pub admin: Option<Spanned<AdminSpec>>,
    pub redis: Option<Spanned<RedisSpec>>,
    pub identity: Option<Spanned<IdentitySpec>>,
    #[serde(default)]
    pub upstream: BTreeMap<String, Spanned<UpstreamSpec>>,
    #[serde(default)]
    pub limit: BTreeMap<String, Spanned<LimitSpec>>,
    pub degrade: Option<Spanned<DegradeSpec>>,
    #[serde(default)]
    pub module: BTreeMap<String, Spanned<ModuleSpec>>,
    pub queue: Option<Spanned<QueueSpec>>,
    #[serde(default)]
    pub route: Vec<Spanned<RouteSpec>>,
}

impl FileSpec {
    /// A file that parses as TOML but not whole as a policy, read table by table: each
    /// section, `[KIND.NAME]`, `[[route]]` and `[[degrade.trigger]]` on its own, so that one
    /// that does not fit hides neither the errors of the others (one per table, not only the
    /// first) nor their values, which are compiled and checked as usual.
    /// `None` when the file's TOML is broken: its first syntax error is the one to fix.
    pub fn read_by_table(text: &str) -> Option<PartialFile> {
        let root = toml::de::DeTable::parse(text).ok()?;
        let mut read = PartialFile::default();
        let mut errors = Vec::new();
        // Errors said in levee's own words, with their hint.
        let mut told = Vec::new();
        let (spec, unread) = (&mut read.spec, &mut read.unread);
        for (key, value) in root.get_ref() {
            match key.get_ref().as_ref() {
                "server" => spec.server = read_section(value, "server", &mut errors, unread),
                "admin" => spec.admin = read_section(value, "admin", &mut errors, unread),
                "redis" => spec.redis = read_section(value, "redis", &mut errors, unread),
                "identity" => spec.identity = read_section(value, "identity", &mut errors, unread),
                "degrade" => spec.degrade = read_degrade(value, &mut errors, unread),
                "queue" => spec.queue = read_section(value, "queue", &mut errors, unread),
                "upstream" => {
                    spec.upstream =
                        read_named(&UPSTREAM, text, key, value, &mut errors, &mut told, unread)
                }
                "limit" => {
                    spec.limit =
                        read_named(&LIMIT, text, key, value, &mut errors, &mut told, unread)
                }
                "module" => {
                    spec.module =
                        read_named(&MODULE, text, key, value, &mut errors, &mut told, unread)
                }
                "route" => match value.get_ref() {
                    toml::de::DeValue::Array(routes) => {
                        for route in routes.iter() {
                            let before = errors.len();
                            let read = read_one::<RouteSpec>(route, &mut errors);
                            // Read without a key that did not (its `hide`), or not at all: the
                            // modules its TOML names are not called undefined elsewhere.
                            if errors.len() > before {
                                unread.note_route(route);
                            }
                            spec.route.extend(read);
                        }
                    }
                    // `[route.home]`: each entry a table under a header of its own (a
                    // `[route]` with `match = { … }` under it is a route without `[[ ]]`).
                    toml::de::DeValue::Table(entries)
                        if !entries.is_empty()
                            && entries.values().all(|entry| {
                                matches!(entry.get_ref(), toml::de::DeValue::Table(_))
                                    && text.get(entry.span()).is_some_and(|at| at.starts_with('['))
                            }) =>
                    {
                        told.extend(routes_named_in_their_header(text, entries));
                        entries.values().for_each(|route| unread.note_route(route));
                    }
                    _ => {
                        try_shape::<Vec<RouteSpec>>(value, &mut errors);
                        unread.note_route(value);
                    }
                },
                other => {
                    told.push(ShapeError {
                        span: Some(key.span()),
                        message: format!(
                            "unknown field `{other}`, expected one of {TOP_LEVEL_KEYS}"
                        ),
                        key: None,
                        hint: None,
                        covers: Vec::new(),
                    });
                    unread.note_misspelt(other, value);
                }
            }
        }
        read.errors = errors
            .into_iter()
            .map(|error| ShapeError {
                span: error.span(),
                message: error.message().to_string(),
                key: key_of(&error),
                hint: None,
                covers: Vec::new(),
            })
            .chain(told)
            .collect();
        Some(read)
    }
}

/// What [`FileSpec::read_by_table`] makes of a file that does not read whole as a policy.
#[derive(Debug, Default)]
pub struct PartialFile {
    /// The tables that read on their own.
    pub spec: FileSpec,
    /// Where the others do not fit a policy's shape: one error per table.
    pub errors: Vec<ShapeError>,
    /// What those others define, as far as their TOML shows.
    pub unread: UnreadTables,
}

/// Tables of a file that are written but did not read (their errors are reported): what
/// they define exists, so a reference to it is not also called undefined.
#[derive(Debug, Default)]
pub struct UnreadTables {
    /// Sections written once (`server`, `admin`, `redis`, `identity`, `degrade`, `queue`).
    pub sections: BTreeSet<&'static str>,
    pub upstreams: BTreeSet<String>,
    pub limits: BTreeSet<String>,
    /// Declared with `[module.NAME]`, or named by a route that did not read.
    pub modules: BTreeSet<String>,
    /// Kinds written without their name (`[upstream]` with `url` under it): whichever name a
    /// route gives may be the one meant.
    pub nameless: BTreeSet<&'static str>,
}

impl UnreadTables {
    /// A section whose name is a letter or two from a known one (`[upstreams.app]`, already
    /// reported): what it would define, spelt right.
    fn note_misspelt(&mut self, written: &str, value: &Spanned<toml::de::DeValue<'_>>) {
        use toml::de::DeValue;
        let meant = TOP_LEVEL
            .into_iter()
            .map(|known| (super::compile::edit_distance(written, known), known))
            .filter(|(distance, _)| *distance <= 2)
            .min_by_key(|(distance, _)| *distance)
            .map(|(_, known)| known);
        match (meant, value.get_ref()) {
            (None, _) => {}
            (Some(kind @ ("upstream" | "limit" | "module")), DeValue::Table(entries)) => {
                for (name, entry) in entries {
                    if matches!(entry.get_ref(), DeValue::Table(_)) {
                        self.names(kind).insert(name.get_ref().to_string());
                    } else {
                        self.nameless.insert(kind);
                    }
                }
            }
            (Some(kind @ ("upstream" | "limit" | "module")), _) => {
                self.nameless.insert(kind);
            }
            (Some("route"), DeValue::Array(routes)) => {
                routes.iter().for_each(|route| self.note_route(route));
            }
            (Some("route"), _) => self.note_route(value),
            (Some(section), _) => {
                self.sections.insert(section);
            }
        }
    }

    /// The names of a kind written `[KIND.NAME]`.
    fn names(&mut self, kind: &str) -> &mut BTreeSet<String> {
        match kind {
            "upstream" => &mut self.upstreams,
            "limit" => &mut self.limits,
            _ => &mut self.modules,
        }
    }

    /// The modules a route that did not read belongs to or hides, as its TOML names them.
    fn note_route(&mut self, route: &Spanned<toml::de::DeValue<'_>>) {
        use toml::de::DeValue;
        let DeValue::Table(keys) = route.get_ref() else {
            return;
        };
        for (key, value) in keys {
            match (key.get_ref().as_ref(), value.get_ref()) {
                ("module", DeValue::String(module)) => {
                    self.modules.insert(module.to_string());
                }
                ("hide", DeValue::Table(hidden)) => self
                    .modules
                    .extend(hidden.keys().map(|module| module.get_ref().to_string())),
                _ => {}
            }
        }
    }
}

/// A place where a file's TOML does not fit a policy's shape.
#[derive(Debug, Clone, PartialEq)]
pub struct ShapeError {
    pub span: Option<std::ops::Range<usize>>,
    /// The parser's message (`invalid type: string "50%", expected f64`).
    pub message: String,
    /// The key whose value is wrong (`failure_ratio`), when the parser knows it: a value
    /// inside a list (`failure_statuses = ["5xx"]`) cannot be read back from its line.
    pub key: Option<String>,
    /// What to write instead, when the message is levee's own (not the parser's to explain).
    pub hint: Option<String>,
    /// Byte ranges this error stands for: a parser's error inside them says the same thing
    /// less plainly (`url` under a nameless `[upstream]` is no upstream), and is not reported.
    pub covers: Vec<std::ops::Range<usize>>,
}

/// The last key of the path the parser tracked to an error. The toml crate offers it only in
/// its display (`in `breaker.failure_ratio``, written when the error has no input text), so it
/// is read from there; without it the key is read from the text instead.
fn key_of(error: &toml::de::Error) -> Option<String> {
    let shown = error.to_string();
    let path = shown
        .lines()
        .rev()
        .find_map(|line| line.strip_prefix("in `")?.strip_suffix('`'))?;
    path.rsplit('.').next().map(str::to_string)
}

/// The sections a policy file may have.
const TOP_LEVEL: [&str; 10] = [
    "server", "admin", "redis", "identity", "upstream", "limit", "degrade", "module", "queue",
    "route",
];

/// The sections a policy file may have, as serde names them in its own message.
const TOP_LEVEL_KEYS: &str = "`server`, `admin`, `redis`, `identity`, `upstream`, `limit`, `degrade`, `module`, `queue`, `route`";

fn try_shape<'de, T: Deserialize<'de>>(
    value: &Spanned<toml::de::DeValue<'de>>,
    errors: &mut Vec<toml::de::Error>,
) {
    let deserializer = toml::de::ValueDeserializer::from(value.clone());
    if let Err(error) = T::deserialize(deserializer) {
        errors.push(error);
    }
}

/// One table (or value) as `T`, its error kept.
fn read_one<'de, T: Deserialize<'de>>(
    value: &Spanned<toml::de::DeValue<'de>>,
    errors: &mut Vec<toml::de::Error>,
) -> Option<Spanned<T>> {
    let deserializer = toml::de::ValueDeserializer::from(value.clone());
    match Spanned::<T>::deserialize(deserializer) {
        Ok(read) => Some(read),
        Err(error) => {
            let first_at = error.span();
            errors.push(error);
            read_without_errors::<T>(value, first_at, errors)
        }
    }
}

/// Keys whose absence a table always reads and compiles as it would with them, written or
/// not: an upstream's own `breaker`, a route's `hide` and `fallback`. (A `match` or a `tier`
/// taken out would change what the table means, and so what else is reported of it.)
const LEFT_OUT_SAFELY: [&str; 3] = ["breaker", "hide", "fallback"];

/// The parser stops at a table's first error, so `breaker = { failure_ratio = "50%" }` hid a
/// misspelt `max_inflite` two lines down until it was fixed. The table is read again without
/// the key each error is in, to find the errors after it. When the keys taken out are only
/// those of [`LEFT_OUT_SAFELY`], the rest is returned, to be compiled and checked too (its
/// `response_timeout = "10x"` is reported with the breaker's error); otherwise the table stays
/// unread: a misspelt key was meant as one, whose absence would be reported as an error of
/// its own (`urll` as "upstream has no url"). Either way its errors refuse the policy.
fn read_without_errors<'de, T: Deserialize<'de>>(
    value: &Spanned<toml::de::DeValue<'de>>,
    first_at: Option<std::ops::Range<usize>>,
    errors: &mut Vec<toml::de::Error>,
) -> Option<Spanned<T>> {
    use toml::de::DeValue;
    let DeValue::Table(keys) = value.get_ref() else {
        return None;
    };
    let mut keys = keys.clone();
    let mut removed: Vec<String> = Vec::new();
    let mut error_at = first_at;
    let mut safely = true;
    // A table has a few dozen keys at most; each round removes one.
    for _ in 0..64 {
        let at = error_at?;
        let holding = keys
            .iter()
            .find(|(key, value)| {
                [key.span(), value.span()]
                    .iter()
                    .any(|span| span.start <= at.start && at.end <= span.end)
            })
            .map(|(key, _)| key.clone())?;
        keys.remove(&holding);
        let name = holding.get_ref().to_string();
        safely &= LEFT_OUT_SAFELY.contains(&name.as_str());
        removed.push(name);
        let rest = Spanned::new(value.span(), DeValue::Table(keys.clone()));
        let error = match Spanned::<T>::deserialize(toml::de::ValueDeserializer::from(rest)) {
            Ok(read) => return safely.then_some(read),
            Err(error) => error,
        };
        // Missing because it was taken out: not the operator's error.
        let message = error.message();
        if removed
            .iter()
            .any(|key| message.starts_with(&format!("missing field `{key}`")))
        {
            return None;
        }
        error_at = error.span();
        errors.push(error);
    }
    None
}

/// A section written once (`[server]`), noted as unread when it does not fit.
fn read_section<'de, T: Deserialize<'de>>(
    value: &Spanned<toml::de::DeValue<'de>>,
    section: &'static str,
    errors: &mut Vec<toml::de::Error>,
    unread: &mut UnreadTables,
) -> Option<Spanned<T>> {
    let read = read_one::<T>(value, errors);
    if read.is_none() {
        unread.sections.insert(section);
    }
    read
}

/// `[degrade]` and each of its `[[degrade.trigger]]` entries on their own: a bad trigger hides
/// neither the section's keys nor the other triggers. A trigger key that is no list of tables
/// is read with the section, whose error says what it should be.
fn read_degrade<'de>(
    value: &Spanned<toml::de::DeValue<'de>>,
    errors: &mut Vec<toml::de::Error>,
    unread: &mut UnreadTables,
) -> Option<Spanned<DegradeSpec>> {
    use toml::de::DeValue;
    let DeValue::Table(keys) = value.get_ref() else {
        return read_section(value, "degrade", errors, unread);
    };
    let trigger = keys
        .iter()
        .find(|(key, _)| key.get_ref() == "trigger")
        .map(|(_, trigger)| trigger.get_ref());
    let triggers = match trigger {
        Some(DeValue::Array(items))
            if items
                .iter()
                .all(|item| matches!(item.get_ref(), DeValue::Table(_))) =>
        {
            items
        }
        _ => return read_section(value, "degrade", errors, unread),
    };
    let own: toml::de::DeTable<'de> = keys
        .iter()
        .filter(|(key, _)| key.get_ref() != "trigger")
        .map(|(key, value)| (key.clone(), value.clone()))
        .collect();
    let own = Spanned::new(value.span(), DeValue::Table(own));
    // The section's span either way: a trigger that reads is compiled under it.
    let mut degrade = read_section::<DegradeSpec>(&own, "degrade", errors, unread)
        .unwrap_or_else(|| Spanned::new(value.span(), DegradeSpec::default()));
    for item in triggers.iter() {
        if let Some(trigger) = read_one::<TriggerSpec>(item, errors) {
            degrade.get_mut().trigger.push(trigger);
        }
    }
    Some(degrade)
}

/// A kind of table written with its name in its header: `[upstream.NAME]`.
struct NamedKind {
    kind: &'static str,
    /// A name to show in examples.
    example: &'static str,
    /// How a route refers to one, with the example name.
    referred: &'static str,
}

const UPSTREAM: NamedKind = NamedKind {
    kind: "upstream",
    example: "php",
    referred: "a route names it with upstream = \"php\"",
};
const LIMIT: NamedKind = NamedKind {
    kind: "limit",
    example: "login_per_ip",
    referred: "a route lists it with limits = [\"login_per_ip\"]",
};
const MODULE: NamedKind = NamedKind {
    kind: "module",
    example: "ranking",
    referred: "a route belongs to it with module = \"ranking\"",
};

/// Every `[KIND.NAME]` on its own, so that one bad upstream does not hide the next; and the
/// kind written without its name, said as that: `[upstream]` with one upstream's keys under
/// it (the parser takes `url` for the name of an upstream and says "`url` must be a table"),
/// `upstream.url = …`, `[[upstream]]` entries. Returns those that read; the others are noted
/// in `unread` by name (or, written without one, by kind).
fn read_named<'de, T: Deserialize<'de>>(
    named: &NamedKind,
    text: &str,
    key: &Spanned<std::borrow::Cow<'de, str>>,
    value: &Spanned<toml::de::DeValue<'de>>,
    errors: &mut Vec<toml::de::Error>,
    told: &mut Vec<ShapeError>,
    unread: &mut UnreadTables,
) -> BTreeMap<String, Spanned<T>> {
    use toml::de::DeValue;
    let NamedKind {
        kind,
        example,
        referred,
    } = named;
    let entries = match value.get_ref() {
        DeValue::Table(entries) => entries,
        DeValue::Array(items)
            if items
                .iter()
                .all(|item| matches!(item.get_ref(), DeValue::Table(_))) =>
        {
            for item in items.iter() {
                let name = match item.get_ref() {
                    DeValue::Table(keys) => keys
                        .iter()
                        .find(|(key, _)| key.get_ref() == "name")
                        .and_then(|(_, name)| match name.get_ref() {
                            DeValue::String(name) => Some(name.to_string()),
                            _ => None,
                        }),
                    _ => None,
                };
                let hint = match name.filter(|name| is_bare_key(name)) {
                    Some(name) => format!(
                        "write `[{kind}.{name}]` where `[[{kind}]]` is, and remove its `name = \"{name}\"` line"
                    ),
                    None => format!(
                        "write `[{kind}.NAME]` on a line of its own with its keys under it; {referred}"
                    ),
                };
                told.push(ShapeError {
                    span: Some(item.span()),
                    message: format!(
                        "`[[{kind}]]` is not a list: each {kind} is a table with its name in its header, `[{kind}.NAME]` (e.g. `[{kind}.{example}]`)"
                    ),
                    key: None,
                    hint: Some(hint),
                    covers: vec![whole(item)],
                });
            }
            unread.nameless.insert(kind);
            return BTreeMap::new();
        }
        _ => {
            try_shape::<BTreeMap<String, T>>(value, errors);
            unread.nameless.insert(kind);
            return BTreeMap::new();
        }
    };
    let is_table = |entry: &Spanned<DeValue<'de>>| matches!(entry.get_ref(), DeValue::Table(_));
    // `[[upstream.php]]`: an entry that is a list of tables.
    let list_of_tables = |entry: &Spanned<DeValue<'de>>| match entry.get_ref() {
        DeValue::Array(items) => !items.is_empty() && items.iter().all(is_table),
        _ => false,
    };
    let keys_of_one = entries
        .values()
        .any(|entry| !is_table(entry) && !list_of_tables(entry));
    // A table that reads as one of its kind and not as named ones (`[upstream]` with only
    // `fastcgi = { … }` under it): its keys are the nameless one's too.
    let reads_as_one = !entries.is_empty()
        && !keys_of_one
        && !entries.values().any(list_of_tables)
        && T::deserialize(toml::de::ValueDeserializer::from(value.clone())).is_ok()
        && BTreeMap::<String, T>::deserialize(toml::de::ValueDeserializer::from(value.clone()))
            .is_err();
    if keys_of_one || reads_as_one {
        unread.nameless.insert(kind);
        told.push(ShapeError {
            // At its header when it has one (`[upstream]`), else at the key (`upstream.url`).
            span: Some(header_or(text, value, key)),
            message: format!(
                "`[{kind}]` needs a name: write `[{kind}.NAME]` (e.g. `[{kind}.{example}]`)"
            ),
            key: None,
            hint: Some(format!(
                "the keys under it belong to one {kind}, whose name goes in the header: `[{kind}.{example}]` on a line of its own, its keys under it; {referred}"
            )),
            covers: entries
                .iter()
                .filter(|(_, entry)| reads_as_one || !is_table(entry))
                .map(|(key, entry)| extent(key, entry))
                .collect(),
        });
        if reads_as_one {
            return BTreeMap::new();
        }
    }
    let mut read_alone = BTreeMap::new();
    for (name, entry) in entries {
        if is_table(entry) {
            match read_one::<T>(entry, errors) {
                // Beside the keys of a nameless one, an inline table (`breaker = { … }`) is
                // most likely its own, not a named one: only a `[KIND.NAME]` header is read.
                Some(_)
                    if keys_of_one
                        && !text.get(entry.span()).is_some_and(|at| at.starts_with('[')) => {}
                Some(read) => {
                    read_alone.insert(name.get_ref().to_string(), read);
                }
                None => {
                    unread.names(kind).insert(name.get_ref().to_string());
                }
            }
            continue;
        }
        let DeValue::Array(items) = entry.get_ref() else {
            continue;
        };
        if !list_of_tables(entry) {
            continue;
        }
        let name = name.get_ref();
        unread.names(kind).insert(name.to_string());
        let header = if is_bare_key(name) {
            format!("[{kind}.{name}]")
        } else {
            format!("[{kind}.{name:?}]")
        };
        for item in items.iter() {
            told.push(ShapeError {
                span: Some(item.span()),
                message: format!("`[{header}]` is written with single brackets: `{header}`"),
                key: None,
                hint: Some(format!(
                    "double brackets make a list of tables; each {kind} is one table, named in its header"
                )),
                covers: vec![whole(item)],
            });
        }
    }
    read_alone
}

/// Where a table is written: its `[header]` when it has one, else its key (a dotted key,
/// `upstream.url = …`, or an inline table).
fn header_or<'de>(
    text: &str,
    value: &Spanned<toml::de::DeValue<'de>>,
    key: &Spanned<std::borrow::Cow<'de, str>>,
) -> std::ops::Range<usize> {
    let written = value.span();
    if text
        .get(written.clone())
        .is_some_and(|at| at.starts_with('['))
    {
        written
    } else {
        key.span()
    }
}

/// From a key to the end of what its value holds, nested tables' keys and values included.
fn extent<'de>(
    key: &Spanned<std::borrow::Cow<'de, str>>,
    value: &Spanned<toml::de::DeValue<'de>>,
) -> std::ops::Range<usize> {
    key.span().start.min(value.span().start)..end_of(value).max(key.span().end)
}

/// A value and all it holds (a `[[upstream]]` entry and its keys).
fn whole(value: &Spanned<toml::de::DeValue<'_>>) -> std::ops::Range<usize> {
    value.span().start..end_of(value)
}

fn end_of(value: &Spanned<toml::de::DeValue<'_>>) -> usize {
    match value.get_ref() {
        toml::de::DeValue::Table(entries) => entries
            .iter()
            .map(|(key, entry)| key.span().end.max(end_of(entry)))
            .fold(value.span().end, usize::max),
        toml::de::DeValue::Array(items) => {
            items.iter().map(end_of).fold(value.span().end, usize::max)
        }
        _ => value.span().end,
    }
}

/// A name that TOML takes unquoted in a header (`[upstream.php]`).
fn is_bare_key(name: &str) -> bool {
    !name.is_empty()
        && name
            .chars()
            .all(|c| c.is_ascii_alphanumeric() || c == '-' || c == '_')
}

/// `[route.home]`: a route written as a named table, where routes are a list whose entries
/// carry their name.
fn routes_named_in_their_header<'de>(
    text: &str,
    entries: &toml::de::DeTable<'de>,
) -> Vec<ShapeError> {
    entries
        .iter()
        .map(|(key, entry)| {
            let name = key.get_ref();
            ShapeError {
                span: Some(header_or(text, entry, key)),
                message: format!(
                    "`[route.{name}]`: routes are a list, each entry written `[[route]]` with its name under it"
                ),
                key: None,
                hint: Some(format!(
                    "write `[[route]]` and, on the line under it, name = {name:?}; routes are tried in the order written"
                )),
                covers: vec![extent(key, entry)],
            }
        })
        .collect()
}

/// `[redis]`: shared state. Without it levee runs on its embedded default.
#[derive(Debug, Default, Deserialize)]
#[serde(
    deny_unknown_fields,
    expecting = "a table: [redis] on a line of its own, its keys on the lines under it"
)]
pub struct RedisSpec {
    pub url: Option<Spanned<String>>,
    pub cluster: Option<Spanned<Vec<String>>>,
    pub timeout: Option<Spanned<String>>,
    pub failures_to_open: Option<Spanned<u32>>,
    pub cooldown: Option<Spanned<String>>,
    pub key_prefix: Option<Spanned<String>>,
    pub instances: Option<Spanned<u32>>,
    pub admit_ahead_above: Option<Spanned<f64>>,
    pub ca_file: Option<Spanned<String>>,
    pub cert_file: Option<Spanned<String>>,
    pub key_file: Option<Spanned<String>>,
    pub sentinel: Option<Spanned<SentinelSpec>>,
}

/// `[redis.sentinel]`: the master of a group that Redis Sentinel watches.
#[derive(Debug, Default, Deserialize)]
#[serde(
    deny_unknown_fields,
    expecting = "a table: [redis.sentinel] on a line of its own, with nodes and master under it"
)]
pub struct SentinelSpec {
    pub nodes: Option<Spanned<Vec<String>>>,
    pub master: Option<Spanned<String>>,
    pub username: Option<Spanned<String>>,
    pub password: Option<Spanned<String>>,
    pub db: Option<Spanned<i64>>,
}

/// `[identity]`: where the user id and API key of a request are read from.
#[derive(Debug, Default, Deserialize)]
#[serde(
    deny_unknown_fields,
    expecting = "a table: [identity] on a line of its own, its keys on the lines under it"
)]
pub struct IdentitySpec {
    pub user: Option<Spanned<OneOrMany>>,
    pub api_key: Option<Spanned<OneOrMany>>,
}

/// `[limit.NAME]`: a rate-limit rule that routes refer to.
#[derive(Debug, Default, Deserialize)]
#[serde(
    deny_unknown_fields,
    expecting = "a table: [limit.NAME] on a line of its own, its keys on the lines under it"
)]
pub struct LimitSpec {
    pub key: Option<Spanned<OneOrMany>>,
    pub rate: Option<Spanned<String>>,
    pub burst: Option<Spanned<u32>>,
    pub missing: Option<Spanned<String>>,
    pub ipv6_prefix: Option<Spanned<u32>>,
    pub dry_run: Option<bool>,
    pub on_redis_error: Option<Spanned<String>>,
    pub headers: Option<bool>,
    pub headers_on_allow: Option<bool>,
    pub status: Option<Spanned<u16>>,
    pub body_html: Option<String>,
    pub body_json: Option<String>,
}

/// `[server]`: the public listener and what it accepts.
#[derive(Debug, Default, Deserialize)]
#[serde(
    deny_unknown_fields,
    expecting = "a table: [server] on a line of its own, its keys on the lines under it"
)]
pub struct ServerSpec {
    pub listen: Option<Spanned<String>>,
    pub trusted_proxies: Option<Vec<Spanned<String>>>,
    pub default_upstream: Option<Spanned<String>>,
    pub header_read_timeout: Option<Spanned<String>>,
    pub max_header_bytes: Option<Spanned<SizeSpec>>,
    pub max_body: Option<Spanned<SizeSpec>>,
    pub client_body_timeout: Option<Spanned<String>>,
    pub send_timeout: Option<Spanned<String>>,
    pub tunnel_idle_timeout: Option<Spanned<String>>,
    pub max_connections: Option<Spanned<u32>>,
    pub drain: Option<Spanned<String>>,
    pub shutdown_timeout: Option<Spanned<String>>,
    pub livez_path: Option<Spanned<String>>,
    pub readyz_path: Option<Spanned<String>>,
    pub access_log: Option<bool>,
    pub cors_origins: Option<Spanned<Vec<String>>>,
    pub answer_format: Option<Spanned<String>>,
}

/// `[admin]`: the operator listener, never the public one.
#[derive(Debug, Default, Deserialize)]
#[serde(
    deny_unknown_fields,
    expecting = "a table: [admin] on a line of its own, its keys on the lines under it"
)]
pub struct AdminSpec {
    pub listen: Option<Spanned<String>>,
    pub tokens: Option<Spanned<BTreeMap<String, String>>>,
    pub origins: Option<Spanned<Vec<String>>>,
}

/// `[upstream.NAME]`: a dependency levee forwards to.
#[derive(Debug, Default, Deserialize)]
#[serde(
    deny_unknown_fields,
    expecting = "a table: [upstream.NAME] on a line of its own, its keys on the lines under it"
)]
pub struct UpstreamSpec {
    pub url: Option<Spanned<String>>,
    pub host: Option<Spanned<String>>,
    pub connect_timeout: Option<Spanned<String>>,
    pub response_timeout: Option<Spanned<String>>,
    pub idle_body_timeout: Option<Spanned<String>>,
    pub pool_idle_timeout: Option<Spanned<String>>,
    pub pool_max_idle: Option<Spanned<u32>>,
    pub ca_files: Option<Spanned<Vec<Spanned<String>>>>,
    pub max_inflight: Option<Spanned<u32>>,
    pub shed_reserve: Option<Spanned<f64>>,
    pub queue_wait: Option<Spanned<String>>,
    pub breaker: Option<Spanned<BreakerSpec>>,
    pub fastcgi: Option<Spanned<FastCgiSpec>>,
    pub socket: Option<Spanned<String>>,
}

/// `fastcgi = { … }` of a `fastcgi://` upstream (php-fpm).
#[derive(Debug, Default, Deserialize)]
#[serde(
    deny_unknown_fields,
    expecting = "a table, like fastcgi = { root = \"/var/www/site\" }"
)]
pub struct FastCgiSpec {
    pub root: Option<Spanned<String>>,
    pub index: Option<Spanned<String>>,
    pub front_controller: Option<Spanned<String>>,
    pub params: Option<Spanned<BTreeMap<String, String>>>,
    pub temp_dir: Option<Spanned<String>>,
}

/// `breaker = { … }` of an upstream.
#[derive(Debug, Default, Deserialize)]
#[serde(
    deny_unknown_fields,
    expecting = "a table, like breaker = { consecutive_failures = 5, open_for = \"30s\" }"
)]
pub struct BreakerSpec {
    pub consecutive_failures: Option<u32>,
    pub failure_ratio: Option<Spanned<f64>>,
    pub window: Option<Spanned<String>>,
    pub min_requests: Option<u32>,
    pub slow_call: Option<Spanned<String>>,
    pub slow_ratio: Option<Spanned<f64>>,
    pub open_for: Option<Spanned<String>>,
    pub max_open_for: Option<Spanned<String>>,
    pub half_open_probes: Option<Spanned<u32>>,
    pub failure_statuses: Option<Spanned<Vec<u16>>>,
    pub failing_clients: Option<Spanned<u32>>,
    pub force: Option<Spanned<String>>,
}

/// A response written in the policy (breaker fallback, degrade `reject`).
#[derive(Debug, Default, Deserialize)]
#[serde(
    deny_unknown_fields,
    expecting = "a table, like fallback = { status = 503, body = \"<p>Back soon.</p>\" }"
)]
pub struct StaticResponseSpec {
    pub status: Option<Spanned<u16>>,
    pub content_type: Option<Spanned<String>>,
    pub body: Option<String>,
}

/// `[[route]]`: which requests go where, first match wins.
#[derive(Debug, Default, Deserialize)]
#[serde(
    deny_unknown_fields,
    expecting = "a table: each route is written under its own [[route]] line"
)]
pub struct RouteSpec {
    pub name: Option<Spanned<String>>,
    #[serde(rename = "match", default)]
    pub matcher: Option<Spanned<MatchSpec>>,
    pub upstream: Option<Spanned<String>>,
    pub max_body: Option<Spanned<SizeSpec>>,
    pub limits: Option<Vec<Spanned<String>>>,
    pub fallback: Option<Spanned<StaticResponseSpec>>,
    pub tier: Option<Spanned<u8>>,
    pub module: Option<Spanned<String>>,
    pub degrade: Option<Spanned<RouteDegradeSpec>>,
    pub hide: Option<Spanned<BTreeMap<String, String>>>,
    pub always_queue: Option<Spanned<bool>>,
    pub answer_format: Option<Spanned<String>>,
}

/// `[queue]`: how queued work is stored and replayed (needs `[redis]`).
#[derive(Debug, Default, Deserialize)]
#[serde(
    deny_unknown_fields,
    expecting = "a table: [queue] on a line of its own, its keys on the lines under it"
)]
pub struct QueueSpec {
    pub group: Option<Spanned<String>>,
    pub claim_after: Option<Spanned<String>>,
    pub max_attempts: Option<Spanned<u32>>,
    pub backoff_base: Option<Spanned<String>>,
    pub backoff_max: Option<Spanned<String>>,
    pub max_body: Option<Spanned<SizeSpec>>,
    pub replay_rate: Option<Spanned<f64>>,
    pub poll_interval: Option<Spanned<String>>,
    pub max_dead_letters: Option<Spanned<u32>>,
    pub wait_replicas: Option<Spanned<u32>>,
    pub wait_timeout: Option<Spanned<String>>,
    pub when_unconfirmed: Option<Spanned<String>>,
}

/// `[degrade]`: the policy's level and module switches.
#[derive(Debug, Default, Deserialize)]
#[serde(
    deny_unknown_fields,
    expecting = "a table: [degrade] on a line of its own, its keys on the lines under it"
)]
pub struct DegradeSpec {
    pub level: Option<Spanned<u8>>,
    pub modules_off: Option<Spanned<Vec<String>>>,
    pub state_file: Option<Spanned<String>>,
    pub sync_interval: Option<Spanned<String>>,
    pub cool_down: Option<Spanned<String>>,
    pub tell_app: Option<Spanned<bool>>,
    pub stale_memory: Option<Spanned<SizeSpec>>,
    #[serde(default)]
    pub trigger: Vec<Spanned<TriggerSpec>>,
}

/// `[[degrade.trigger]]`: raise the level when an upstream shows distress.
#[derive(Debug, Default, Deserialize)]
#[serde(
    deny_unknown_fields,
    expecting = "a table: each trigger is written under its own [[degrade.trigger]] line"
)]
pub struct TriggerSpec {
    pub upstream: Option<Spanned<String>>,
    pub when: Option<Spanned<String>>,
    pub above: Option<Spanned<AboveSpec>>,
    #[serde(rename = "for")]
    pub hold: Option<Spanned<String>>,
    pub level: Option<Spanned<u8>>,
    pub min_calls: Option<Spanned<u32>>,
}

/// A trigger threshold: a duration (`"800ms"`) or a share (`0.8`).
#[derive(Debug, Clone)]
pub enum AboveSpec {
    Share(f64),
    Duration(String),
}

impl<'de> Deserialize<'de> for AboveSpec {
    fn deserialize<D: serde::Deserializer<'de>>(deserializer: D) -> Result<Self, D::Error> {
        struct AboveVisitor;
        impl serde::de::Visitor<'_> for AboveVisitor {
            type Value = AboveSpec;
            fn expecting(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
                f.write_str("a duration in quotes, like \"800ms\", or a share, like 0.8")
            }
            fn visit_f64<E: serde::de::Error>(self, share: f64) -> Result<AboveSpec, E> {
                Ok(AboveSpec::Share(share))
            }
            fn visit_i64<E: serde::de::Error>(self, share: i64) -> Result<AboveSpec, E> {
                Ok(AboveSpec::Share(share as f64))
            }
            fn visit_u64<E: serde::de::Error>(self, share: u64) -> Result<AboveSpec, E> {
                Ok(AboveSpec::Share(share as f64))
            }
            fn visit_str<E: serde::de::Error>(self, duration: &str) -> Result<AboveSpec, E> {
                Ok(AboveSpec::Duration(duration.to_string()))
            }
        }
        deserializer.deserialize_any(AboveVisitor)
    }
}

/// `[module.NAME]`: a feature that can be switched off.
#[derive(Debug, Default, Deserialize)]
#[serde(
    deny_unknown_fields,
    expecting = "a table: [module.NAME] on a line of its own, its keys on the lines under it"
)]
pub struct ModuleSpec {
    pub tier: Option<Spanned<u8>>,
    pub description: Option<String>,
}

/// `degrade = { … }` of a route: what it answers while it is off.
#[derive(Debug, Default, Deserialize)]
#[serde(
    deny_unknown_fields,
    expecting = "a table, like degrade = { action = \"stale\", max_age = \"10m\" }"
)]
pub struct RouteDegradeSpec {
    pub action: Option<Spanned<String>>,
    pub max_age: Option<Spanned<String>>,
    pub vary: Option<Spanned<OneOrMany>>,
    pub allow_set_cookie: Option<bool>,
    pub max_body: Option<Spanned<SizeSpec>>,
    pub query: Option<Spanned<OneOrMany>>,
    pub max_copies: Option<Spanned<u32>>,
    pub private_cookies: Option<Spanned<OneOrMany>>,
    pub private_cookies_builtin: Option<bool>,
    pub keep_no_cache: Option<bool>,
    pub learn_private_cookies: Option<bool>,
    pub on_status: Option<Spanned<Vec<u16>>>,
    pub status: Option<Spanned<u16>>,
    pub content_type: Option<Spanned<String>>,
    pub body: Option<String>,
    pub body_html: Option<String>,
    pub body_json: Option<String>,
}

/// `match = { … }` of a route. All given conditions must hold.
#[derive(Debug, Default, Deserialize)]
#[serde(
    deny_unknown_fields,
    expecting = "a table, like match = { path_prefix = \"/shop\" }"
)]
pub struct MatchSpec {
    pub host: Option<Spanned<OneOrMany>>,
    pub client: Option<Spanned<OneOrMany>>,
    pub method: Option<Spanned<OneOrMany>>,
    pub path: Option<Spanned<String>>,
    pub path_prefix: Option<Spanned<String>>,
    pub path_regex: Option<Spanned<String>>,
}

/// A value that may be written as one string or a list of strings.
#[derive(Debug, Clone)]
pub enum OneOrMany {
    One(String),
    Many(Vec<String>),
}

// Written by hand rather than `#[serde(untagged)]`: an untagged enum's error names the Rust
// type ("did not match any variant of untagged enum …"), and a list with one wrong item could
// not point at that item.
impl<'de> Deserialize<'de> for OneOrMany {
    fn deserialize<D: serde::Deserializer<'de>>(deserializer: D) -> Result<Self, D::Error> {
        struct OneOrManyVisitor;
        impl<'de> serde::de::Visitor<'de> for OneOrManyVisitor {
            type Value = OneOrMany;
            fn expecting(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
                f.write_str("a string or a list of strings, like \"a\" or [\"a\", \"b\"]")
            }
            fn visit_str<E: serde::de::Error>(self, one: &str) -> Result<OneOrMany, E> {
                Ok(OneOrMany::One(one.to_string()))
            }
            fn visit_seq<A: serde::de::SeqAccess<'de>>(
                self,
                mut items: A,
            ) -> Result<OneOrMany, A::Error> {
                let mut many = Vec::with_capacity(items.size_hint().unwrap_or(0));
                while let Some(item) = items.next_element::<String>()? {
                    many.push(item);
                }
                Ok(OneOrMany::Many(many))
            }
        }
        deserializer.deserialize_any(OneOrManyVisitor)
    }
}

impl OneOrMany {
    pub fn into_vec(self) -> Vec<String> {
        match self {
            OneOrMany::One(one) => vec![one],
            OneOrMany::Many(many) => many,
        }
    }
}

/// A byte size: a plain integer, or a string such as `"16KiB"`, `"10MB"`, `"1GiB"`.
#[derive(Debug, Clone)]
pub enum SizeSpec {
    Bytes(u64),
    Text(String),
}

/// What a size key takes, as its errors say it.
pub const SIZE_TAKES: &str = "a size: a whole number of bytes or a string like \"10MiB\"";

impl<'de> Deserialize<'de> for SizeSpec {
    fn deserialize<D: serde::Deserializer<'de>>(deserializer: D) -> Result<Self, D::Error> {
        struct SizeVisitor;
        impl serde::de::Visitor<'_> for SizeVisitor {
            type Value = SizeSpec;
            fn expecting(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
                f.write_str(SIZE_TAKES)
            }
            fn visit_u64<E: serde::de::Error>(self, bytes: u64) -> Result<SizeSpec, E> {
                Ok(SizeSpec::Bytes(bytes))
            }
            fn visit_i64<E: serde::de::Error>(self, bytes: i64) -> Result<SizeSpec, E> {
                u64::try_from(bytes)
                    .map(SizeSpec::Bytes)
                    .map_err(|_| E::invalid_value(serde::de::Unexpected::Signed(bytes), &self))
            }
            fn visit_str<E: serde::de::Error>(self, text: &str) -> Result<SizeSpec, E> {
                Ok(SizeSpec::Text(text.to_string()))
            }
        }
        deserializer.deserialize_any(SizeVisitor)
    }
}
