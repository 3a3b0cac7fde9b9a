//! What a rate-limit bucket is keyed by, and how the parts are read from a request.

use std::borrow::Cow;
use std::fmt::Write as _;
use std::net::IpAddr;

use http::{HeaderMap, HeaderName, Method};
use sha2::{Digest, Sha256};
use smallvec::SmallVec;

use crate::proxy::header::{ip_string, write_ipv4};

/// Where an identity (user id, API key) or a key part is read from.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Source {
    Header(HeaderName),
    Cookie(String),
    Query(String),
}

impl Source {
    /// Parses `header:NAME`, `cookie:NAME`, `query:NAME`.
    pub fn parse(text: &str) -> Result<Source, String> {
        let (kind, name) = text.split_once(':').ok_or_else(|| {
            format!("`{text}` is not `header:NAME`, `cookie:NAME` or `query:NAME`")
        })?;
        if name.is_empty() {
            return Err(format!("`{text}` names nothing after `{kind}:`"));
        }
        match kind {
            "header" => HeaderName::from_bytes(name.as_bytes())
                .map(Source::Header)
                .map_err(|_| format!("`{name}` is not a header name")),
            "cookie" => php_field_name(text, kind, name, &[';', '=']).map(Source::Cookie),
            "query" => php_field_name(text, kind, name, &['&', '=', '#']).map(Source::Query),
            other => Err(format!(
                "unknown source `{other}`; use header:, cookie: or query:"
            )),
        }
    }

    /// The value as text; bytes that are not UTF-8 become U+FFFD, so two such values can
    /// read the same. A rate-limit key reads [`Self::read_bytes`] instead.
    pub fn read<'a>(&self, headers: &'a HeaderMap, query: Option<&'a str>) -> Option<Cow<'a, str>> {
        self.read_bytes(headers, query).map(|value| match value {
            Cow::Borrowed(bytes) => String::from_utf8_lossy(bytes),
            Cow::Owned(bytes) => Cow::Owned(String::from_utf8_lossy(&bytes).into_owned()),
        })
    }

    /// The value byte for byte (percent-decoded for a cookie or a query parameter), as the
    /// app receives it. Bytes beyond ASCII are kept, UTF-8 or not (a legacy site's Latin-1 or
    /// GBK names): a value the app reads must not count as missing here, and two values the
    /// app tells apart must not be one bucket.
    pub fn read_bytes<'a>(
        &self,
        headers: &'a HeaderMap,
        query: Option<&'a str>,
    ) -> Option<Cow<'a, [u8]>> {
        let value = match self {
            Source::Header(name) => headers
                .get(name)
                .map(|value| Cow::Borrowed(value.as_bytes().trim_ascii())),
            Source::Cookie(name) => cookie(headers, name),
            Source::Query(name) => query.and_then(|query| query_param(query, name)),
        };
        value.filter(|value| !value.is_empty())
    }
}

/// A cookie's or a query parameter's name, as PHP names it (`api.key` is `$_GET['api_key']`):
/// requests' names are read that way, so a name written otherwise would never be found. A
/// request ends such a name at `ends_a_name` (and a control byte), so a name written with one
/// (`cookie:sid; path=/`, copied from a Set-Cookie) would never be found either: refused; the
/// character itself is written percent-encoded. A space is read as PHP reads it, as `_`.
fn php_field_name(
    text: &str,
    kind: &str,
    name: &str,
    ends_a_name: &[char],
) -> Result<String, String> {
    if let Some(bad) = name
        .chars()
        .find(|c| ends_a_name.contains(c) || c.is_control())
    {
        return Err(format!(
            "`{text}`: a {kind} name cannot hold {bad:?}; write the name alone, like `{kind}:sid`, and a character the name really has percent-encoded"
        ));
    }
    Ok(php_name(&percent_decode(name)).into_owned())
}

/// Where levee finds who the user is and which API key a request uses. Each list is tried in
/// order; the first source present wins. Default: none (rules keyed by `user` or `api_key`
/// then treat every request as missing that part).
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Identity {
    pub user: Vec<Source>,
    pub api_key: Vec<Source>,
}

/// One part of a rule's key.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum KeyPart {
    Ip,
    User,
    ApiKey,
    Route,
    Method,
    Field(Source),
}

/// The key part an nginx variable of a `limit_req_zone` key stands for, as an operator moving
/// a zone over may write it.
fn nginx_variable(text: &str) -> Option<String> {
    let name = text.strip_prefix('$')?;
    let field = |prefix: &str| name.strip_prefix(prefix).filter(|rest| !rest.is_empty());
    if let Some(header) = field("http_") {
        // nginx spells a field in lower case with `_` for `-`.
        return Some(format!("header:{}", header.replace('_', "-")));
    }
    if let Some(cookie) = field("cookie_") {
        return Some(format!("cookie:{cookie}"));
    }
    if let Some(query) = field("arg_") {
        return Some(format!("query:{query}"));
    }
    match name {
        "binary_remote_addr" | "remote_addr" | "realip_remote_addr" => Some("ip".into()),
        "request_method" => Some("method".into()),
        "uri" | "request_uri" => Some("route".into()),
        _ => None,
    }
}

impl KeyPart {
    /// Whether the part's value may be a credential (an API key, a session cookie, whatever
    /// `[identity] user` reads, a token in a header or the query): always written hashed in
    /// the bucket key. Written as they came, they stood in Redis's key names, where anyone
    /// who can list keys (`SCAN`, `MONITOR`, a slow log) could read and replay them. Only
    /// what levee itself derives is written plainly: the client's address, the route, the
    /// method.
    fn is_secret(&self) -> bool {
        matches!(self, KeyPart::User | KeyPart::ApiKey | KeyPart::Field(_))
    }

    /// Parses `ip`, `user`, `api_key`, `route`, `method`, `header:NAME`, `cookie:NAME`, `query:NAME`.
    pub fn parse(text: &str) -> Result<KeyPart, String> {
        match text {
            "ip" => Ok(KeyPart::Ip),
            "user" => Ok(KeyPart::User),
            "api_key" => Ok(KeyPart::ApiKey),
            "route" => Ok(KeyPart::Route),
            "method" => Ok(KeyPart::Method),
            other if other.contains(':') => Source::parse(other).map(KeyPart::Field),
            other => Err(match nginx_variable(other) {
                Some(ours) => format!(
                    "unknown key part `{other}`: nginx's variable is \"{ours}\" here"
                ),
                None => format!(
                    "unknown key part `{other}`; use ip, user, api_key, route, method, header:NAME, cookie:NAME or query:NAME"
                ),
            }),
        }
    }

    /// How specific a part is to one client: the most specific part of a key becomes its
    /// Redis Cluster hash tag, so one client's buckets share a slot and clients spread out.
    fn specificity(&self) -> u8 {
        match self {
            KeyPart::User => 6,
            KeyPart::ApiKey => 5,
            KeyPart::Ip => 4,
            KeyPart::Field(_) => 3,
            KeyPart::Route => 2,
            KeyPart::Method => 1,
        }
    }
}

/// The facts about one request that keys are built from.
pub struct RequestFacts<'a> {
    pub client_ip: IpAddr,
    pub route: &'a str,
    pub method: &'a Method,
    pub headers: &'a HeaderMap,
    pub query: Option<&'a str>,
    pub identity: &'a Identity,
}

impl RequestFacts<'_> {
    /// A part's value as the request gives it, but for the client IP.
    fn part(&self, part: &KeyPart) -> Option<Cow<'_, [u8]>> {
        match part {
            // `bucket_key` writes the client itself, once per key (see `client_key`).
            KeyPart::Ip => None,
            KeyPart::Route => Some(Cow::Borrowed(self.route.as_bytes())),
            KeyPart::Method => Some(Cow::Borrowed(self.method.as_str().as_bytes())),
            KeyPart::User => {
                first_present(&self.identity.user, self.headers, self.query).and_then(one_spelling)
            }
            KeyPart::ApiKey => first_present(&self.identity.api_key, self.headers, self.query)
                .and_then(one_spelling),
            // The site as routes match it: `SHOP.example:80` and `shop.example.` are
            // `shop.example`, or each spelling would be a bucket of its own.
            KeyPart::Field(source @ Source::Header(name)) if name == http::header::HOST => source
                .read_bytes(self.headers, self.query)
                .map(|host| Cow::Owned(host_as_routed(&host))),
            KeyPart::Field(source) => source.read_bytes(self.headers, self.query),
        }
    }
}

/// A `Host` value as a site's name: lower-cased, without its port and trailing dots.
fn host_as_routed(host: &[u8]) -> Vec<u8> {
    let host = host.trim_ascii();
    let name = if host.starts_with(b"[") {
        // An IPv6 address: its port follows the bracket.
        host.iter()
            .position(|byte| *byte == b']')
            .map_or(host, |end| &host[..=end])
    } else {
        match host.iter().rposition(|byte| *byte == b':') {
            Some(colon) if host[colon + 1..].iter().all(u8::is_ascii_digit) => &host[..colon],
            _ => host,
        }
    };
    let mut name = name.to_ascii_lowercase();
    while name.len() > 1 && name.last() == Some(&b'.') {
        name.pop();
    }
    name
}

/// The IPv6 network one client is for a rule's `ip` unless its `ipv6_prefix` says otherwise:
/// one device's own allocation.
pub const DEFAULT_IPV6_PREFIX: u8 = 64;

/// The client as a limit key: an IPv4 address, or the network of an IPv6 one, `v6_prefix`
/// bits wide (a rule's `ipv6_prefix`, 64 by default). One IPv6 subscriber gets a whole /64 (a
/// home line a /56 or a /48) and may send each request from another address of it; keyed by
/// address, it would get a fresh bucket every time.
fn ip_key(ip: IpAddr, v6_prefix: u8) -> String {
    match (ipv4_client(ip), ip) {
        (Some(v4), _) => ip_string(IpAddr::V4(v4)),
        // Written as it always was for a /64: bucket keys stay those of the instances
        // running an older levee beside this one.
        (None, IpAddr::V6(v6)) if v6_prefix == DEFAULT_IPV6_PREFIX => {
            let [a, b, c, d, ..] = v6.segments();
            format!("{a:x}:{b:x}:{c:x}:{d:x}::/64")
        }
        (None, IpAddr::V6(v6)) => {
            let bits = u32::from(v6_prefix.min(128));
            let mask = u128::MAX.checked_shl(128 - bits).unwrap_or(0);
            let network = std::net::Ipv6Addr::from(u128::from(v6) & mask);
            format!("{network}/{bits}")
        }
        (None, ip) => ip_string(ip),
    }
}

/// The network a client is in, as a number, for the breakers' count of distinct failing
/// clients: an IPv4 /24 (below 2^24), or an IPv6 /48. Wider than a limit's key: one home's
/// IPv6 line holds a /56 or a /48, 256 and more /64s, and one server often several addresses
/// of a /24; counted by address, one visitor was three.
pub fn client_network(ip: IpAddr) -> u64 {
    match (ipv4_client(ip), ip) {
        (Some(v4), _) => u64::from(u32::from(v4) >> 8),
        (None, IpAddr::V6(v6)) => (u128::from(v6) >> 80) as u64 | 1 << 63,
        (None, IpAddr::V4(v4)) => u64::from(u32::from(v4) >> 8),
    }
}

/// The IPv4 client an address is: itself, or the one inside an IPv4-mapped or NAT64 address.
fn ipv4_client(ip: IpAddr) -> Option<std::net::Ipv4Addr> {
    match ip {
        IpAddr::V4(v4) => Some(v4),
        IpAddr::V6(v6) => v6.to_ipv4_mapped().or_else(|| nat64_client(v6)),
    }
}

/// `ip_key` as a key part (`safe_value`). An IPv4 client, keyed on most requests, is
/// written straight into the key digit by digit: dotted digits are a plain value as they
/// are, and the formatting, allocation and check of the general way cost more than the rest
/// of the key.
fn client_key(ip: IpAddr, v6_prefix: u8) -> KeyText<'static> {
    match ipv4_client(ip) {
        Some(v4) => KeyText::Ipv4(v4),
        None => KeyText::Text(safe_value(Cow::Owned(ip_key(ip, v6_prefix).into_bytes()))),
    }
}

/// A key part as it is written into a key: a safe value (`safe_value`), or an IPv4 client.
#[derive(Debug, Clone)]
enum KeyText<'a> {
    Text(Cow<'a, str>),
    Ipv4(std::net::Ipv4Addr),
}

impl KeyText<'_> {
    fn len(&self) -> usize {
        match self {
            KeyText::Text(text) => text.len(),
            KeyText::Ipv4(v4) => {
                let mut len = 0;
                write_ipv4(*v4, |_| len += 1);
                len
            }
        }
    }

    fn write_to(&self, key: &mut String) {
        match self {
            KeyText::Text(text) => key.push_str(text),
            KeyText::Ipv4(v4) => write_ipv4(*v4, |byte| key.push(char::from(byte))),
        }
    }
}

/// The IPv4 client inside an address of the well-known NAT64 prefix `64:ff9b::/96` (RFC
/// 6052), as an IPv6-only site behind a stateless translator (SIIT-DC) sees every IPv4
/// visitor. Keyed by their /64, all of them would be one client.
fn nat64_client(v6: std::net::Ipv6Addr) -> Option<std::net::Ipv4Addr> {
    let [a, b, c, d, e, f, g, h] = v6.segments();
    ([a, b, c, d, e, f] == [0x64, 0xff9b, 0, 0, 0, 0]).then(|| {
        let [g1, g2] = g.to_be_bytes();
        let [h1, h2] = h.to_be_bytes();
        std::net::Ipv4Addr::new(g1, g2, h1, h2)
    })
}

/// A user id or an API key as one bucket holds all its spellings: without the spaces around
/// it, and in lower case. An app that looks keys up in MySQL with a `_ci` collation (trailing
/// spaces and case ignored) accepts `K1`, `k1 ` and `k1` as one key; keyed as sent, each
/// would get a bucket of its own. `None` when nothing is left (keyed as missing).
fn one_spelling(value: Cow<'_, [u8]>) -> Option<Cow<'_, [u8]>> {
    let trimmed = value.trim_ascii();
    if trimmed.is_empty() {
        return None;
    }
    if trimmed.len() == value.len() && !value.iter().any(u8::is_ascii_uppercase) {
        return Some(value);
    }
    Some(Cow::Owned(trimmed.to_ascii_lowercase()))
}

fn first_present<'a>(
    sources: &[Source],
    headers: &'a HeaderMap,
    query: Option<&'a str>,
) -> Option<Cow<'a, [u8]>> {
    sources
        .iter()
        .find_map(|source| source.read_bytes(headers, query))
}

/// [`bucket_key_within`] for a rule keying IPv6 clients by their /64.
pub fn bucket_key(
    prefix: &str,
    rule: &str,
    parts: &[KeyPart],
    facts: &RequestFacts<'_>,
    fallback_ip: bool,
) -> Option<BucketKey> {
    bucket_key_within(prefix, rule, parts, facts, fallback_ip, DEFAULT_IPV6_PREFIX)
}

/// Builds the bucket key of `rule` for a request: `{prefix}rl:{tag}:{rule}:{part|part…}`.
/// Returns `None` when a part is missing; `fallback_ip` then keys by client IP instead.
/// `v6_prefix`: the IPv6 network one client is (the rule's `ipv6_prefix`).
pub fn bucket_key_within(
    prefix: &str,
    rule: &str,
    parts: &[KeyPart],
    facts: &RequestFacts<'_>,
    fallback_ip: bool,
    v6_prefix: u8,
) -> Option<BucketKey> {
    // Values are borrowed from the request where they can be written as they are, and kept
    // off the heap: this runs for every rule of every request. Each value says whether it is
    // the client IP standing in for a missing part. The client's value is made when first
    // needed (an IPv6 client's is a hash).
    let mut client: Option<KeyText<'static>> = None;
    let mut values: KeyValues<'_> = SmallVec::new();
    let mut tag: Option<(u8, usize)> = None;
    for part in parts {
        let (part, value, stands_in) = if *part == KeyPart::Ip {
            let client = client.get_or_insert_with(|| client_key(facts.client_ip, v6_prefix));
            (part, client.clone(), false)
        } else {
            match facts.part(part) {
                Some(value) if part.is_secret() => {
                    (part, KeyText::Text(Cow::Owned(hashed(&value))), false)
                }
                Some(value) => (part, KeyText::Text(safe_value(value)), false),
                None if fallback_ip => {
                    let client =
                        client.get_or_insert_with(|| client_key(facts.client_ip, v6_prefix));
                    (&KeyPart::Ip, client.clone(), true)
                }
                None => return None,
            }
        };
        if tag
            .as_ref()
            .is_none_or(|(specificity, _)| part.specificity() > *specificity)
        {
            tag = Some((part.specificity(), values.len()));
        }
        values.push((value, stands_in));
    }
    Some(assemble_key(
        prefix,
        rule,
        &values,
        tag.map(|(_, index)| index),
    ))
}

/// A key's values in order, each marked when it is the client IP standing in for a missing
/// part. Rules have one or two.
type KeyValues<'a> = SmallVec<[(KeyText<'a>, bool); 3]>;

/// The bucket key of a rule keyed by the route alone (or by nothing), for requests on
/// `route`: the same for all of them, so built once per policy and not per request.
/// `None` for a rule keyed by anything a request brings.
pub fn fixed_bucket_key(
    prefix: &str,
    rule: &str,
    parts: &[KeyPart],
    route: &str,
) -> Option<BucketKey> {
    if !parts.iter().all(|part| *part == KeyPart::Route) {
        return None;
    }
    let value = KeyText::Text(safe_value(Cow::Borrowed(route.as_bytes())));
    let values: KeyValues<'_> = parts.iter().map(|_| (value.clone(), false)).collect();
    Some(assemble_key(
        prefix,
        rule,
        &values,
        (!values.is_empty()).then_some(0),
    ))
}

/// `{prefix}rl:{tag}:{rule}:{value|value…}` of safe values, the hash tag being the value at
/// `tag`.
fn assemble_key(
    prefix: &str,
    rule: &str,
    values: &[(KeyText<'_>, bool)],
    tag_at: Option<usize>,
) -> BucketKey {
    // A rule keyed by nothing (`key = []`, one bucket for everyone) still needs a hash tag: an
    // empty `{}` makes Redis Cluster hash the whole key, so two such rules asked in one script
    // would land in different slots (CROSSSLOT). Its own name keeps it apart from other rules.
    // An IP standing in for a missing part tags the key as the IP itself does, so a request's
    // per-IP buckets stay in one slot.
    let by_name;
    let tag_text: &KeyText<'_> = match tag_at.and_then(|index| values.get(index)) {
        Some((value, _)) => value,
        None => {
            by_name = KeyText::Text(safe_value(Cow::Borrowed(rule.as_bytes())));
            &by_name
        }
    };
    let values_len: usize = values
        .iter()
        .map(|(value, stands_in)| value.len() + 1 + usize::from(*stands_in) * IP_STAND_IN.len())
        .sum();
    let mut key =
        String::with_capacity(prefix.len() + rule.len() + tag_text.len() + values_len + 8);
    key.push_str(prefix);
    key.push_str("rl:{");
    let tag_start = key.len();
    tag_text.write_to(&mut key);
    let tag = tag_start..key.len();
    key.push_str("}:");
    key.push_str(rule);
    key.push(':');
    for (index, (value, stands_in)) in values.iter().enumerate() {
        if index > 0 {
            key.push('|');
        }
        if *stands_in {
            key.push_str(IP_STAND_IN);
        }
        if Some(index) == tag_at {
            // Already written once, as the hash tag (usually the client's address).
            key.extend_from_within(tag.clone());
        } else {
            value.write_to(&mut key);
        }
    }
    BucketKey { key, tag }
}

/// Marks the client IP standing in for a missing part (`missing = "ip"`). A user id or API
/// key is whatever the client or the app says, and may be spelled like an IP: without the
/// mark, `?api_key=203.0.113.9` would spend the bucket of every anonymous request from
/// 203.0.113.9. No value can start so: a plain value has no `#`, a hash is `#` and hex digits.
const IP_STAND_IN: &str = "#ip=";

/// A bucket's Redis key and where its hash tag is in it (keys with the same tag share a
/// cluster slot).
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub struct BucketKey {
    pub key: String,
    tag: std::ops::Range<usize>,
}

impl BucketKey {
    /// The hash tag: what is between the key's braces.
    pub fn tag(&self) -> &str {
        self.key.get(self.tag.clone()).unwrap_or_default()
    }
}

/// Key parts come from clients: long values, braces (which would break hash tags), separators
/// and control bytes are replaced by a hash, so a client cannot forge another key. `#` starts
/// every hash, so a plain value may not contain it (else `#<hash of X>` sent as is would share
/// X's bucket); an empty value is hashed too, so a hash tag is never the empty `{}`.
fn safe_value(value: Cow<'_, [u8]>) -> Cow<'_, str> {
    let plain = !value.is_empty()
        && value.len() <= 64
        && value
            .iter()
            .all(|b| b.is_ascii_graphic() && !matches!(b, b'{' | b'}' | b'|' | b':' | b'#'));
    if plain {
        // Printable ASCII, so UTF-8 as it is: borrowed from the request, and an owned value
        // (the client IP) taken over, without a copy either way.
        match value {
            Cow::Borrowed(bytes) => {
                if let Ok(text) = std::str::from_utf8(bytes) {
                    return Cow::Borrowed(text);
                }
            }
            Cow::Owned(bytes) => {
                return Cow::Owned(
                    String::from_utf8(bytes).unwrap_or_else(|error| hashed(error.as_bytes())),
                )
            }
        }
    }
    // The bytes themselves, not a UTF-8 reading of them: Latin-1 `caf\xe9` and `caf\xe8`
    // are two users.
    Cow::Owned(hashed(&value))
}

/// `#` and the start of the bytes' SHA-256 in hex: what stands in a Redis key for a value
/// that cannot be written there as it is (a key part, a hash tag).
pub(crate) fn hashed(bytes: &[u8]) -> String {
    let digest = Sha256::digest(bytes);
    let mut out = String::with_capacity(25);
    out.push('#');
    out.push_str(&hex(&digest[..12]));
    out
}

/// The bytes as lowercase hex digits.
pub(crate) fn hex(bytes: &[u8]) -> String {
    let mut out = String::with_capacity(2 * bytes.len());
    for byte in bytes {
        let _ = write!(out, "{byte:02x}");
    }
    out
}

fn lossy(bytes: &[u8]) -> Cow<'_, str> {
    String::from_utf8_lossy(bytes)
}

/// The name PHP gives a request variable (PHP 8's `php_register_variable_ex`): cut at a NUL
/// byte, leading spaces dropped, `.` and spaces made `_`; an array's name (`api_key[]`,
/// `ap[i]`) is the name before its first `[`, and a `[` that no `]` closes is a `_`, as is
/// every `.`, space and `[` after it (`api[key` is `api_key`). So `api.key` names
/// `$_GET['api_key']` for the app and for levee alike.
fn php_name(name: &str) -> Cow<'_, str> {
    let name = name.split('\0').next().unwrap_or_default();
    let name = name.trim_start_matches(' ');
    let bracket = name.find('[');
    if let Some(at) = bracket {
        if name[at + 1..].contains(']') {
            return Cow::Owned(name[..at].replace(['.', ' '], "_"));
        }
    }
    if !name.contains(['.', ' ', '[']) {
        return Cow::Borrowed(name);
    }
    let mut named = String::with_capacity(name.len());
    for (at, c) in name.char_indices() {
        let made_underscore = match c {
            '.' | ' ' => true,
            // Only past the unclosed bracket (which is one itself) is a `[` a `_`.
            '[' => bracket.is_some_and(|first| at >= first),
            _ => false,
        };
        named.push(if made_underscore { '_' } else { c });
    }
    Cow::Owned(named)
}

/// PHP's default `max_input_vars`: PHP registers the first this many variables of a query
/// string (or of the cookies) and drops the rest.
const PHP_MAX_INPUT_VARS: usize = 1000;

/// The `name=value` pairs of a cookie header, as PHP counts them (empty pieces are no
/// variable).
fn cookie_pairs(value: &[u8]) -> impl Iterator<Item = &[u8]> {
    value
        .split(|byte| *byte == b';')
        .filter(|pair| !pair.trim_ascii().is_empty())
}

/// A cookie's name and value, when the pair has a `=`.
fn cookie_name_value(pair: &[u8]) -> Option<(&[u8], &[u8])> {
    let at = pair.iter().position(|byte| *byte == b'=')?;
    Some((&pair[..at], pair[at + 1..].trim_ascii()))
}

/// A cookie as PHP reads it into `$_COOKIE`: names and values percent-decoded, names as
/// `php_name` makes them, the first of several with one name wins, and only the first
/// `PHP_MAX_INPUT_VARS` count.
fn cookie<'a>(headers: &'a HeaderMap, name: &str) -> Option<Cow<'a, [u8]>> {
    php_cookies(headers)
        .find(|(key, _)| php_name(&percent_decode(&lossy(key))) == name)
        .map(|(_, value)| decode_percent_bytes(value, true))
}

/// The cookies' raw names and values, as many as PHP registers.
fn php_cookies(headers: &HeaderMap) -> impl Iterator<Item = (&[u8], &[u8])> {
    headers
        .get_all(http::header::COOKIE)
        .iter()
        .flat_map(|value| cookie_pairs(value.as_bytes()))
        .take(PHP_MAX_INPUT_VARS)
        .filter_map(cookie_name_value)
}

/// A cookie name, or a name prefix (written with a trailing `*`), as PHP names cookies.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct CookieName {
    pub name: String,
    pub prefix: bool,
}

impl CookieName {
    /// Parses `NAME` or `PREFIX*` (`*` alone: any cookie).
    pub fn parse(text: &str) -> Result<CookieName, String> {
        let (name, prefix) = match text.strip_suffix('*') {
            Some(name) => (name, true),
            None => (text, false),
        };
        if name.contains('*') {
            return Err(format!("`{text}`: `*` may only end a cookie name"));
        }
        if !prefix && name.is_empty() {
            return Err("an empty cookie name".into());
        }
        let name = if name.is_empty() {
            String::new()
        } else {
            php_field_name(text, "cookie", name, &[';', '='])?
        };
        Ok(CookieName { name, prefix })
    }

    fn matches(&self, name: &str) -> bool {
        if self.prefix {
            name.starts_with(&self.name)
        } else {
            name == self.name
        }
    }
}

impl std::fmt::Display for CookieName {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "{}{}", self.name, if self.prefix { "*" } else { "" })
    }
}

/// Whether the request carries a cookie (with a value: PHP registers `name=` too) that one of
/// `names` names, by the name PHP gives it.
pub fn has_cookie(headers: &HeaderMap, names: &[CookieName]) -> bool {
    has_cookie_but(headers, names, |_| false)
}

/// [`has_cookie`], passing over the cookies whose PHP name `passed_over` picks out.
pub fn has_cookie_but(
    headers: &HeaderMap,
    names: &[CookieName],
    passed_over: impl Fn(&str) -> bool,
) -> bool {
    if names.is_empty() {
        return false;
    }
    php_cookies(headers).any(|(key, _)| {
        let raw = lossy(key);
        let decoded = percent_decode(&raw);
        let name = php_name(&decoded);
        names.iter().any(|pattern| pattern.matches(&name)) && !passed_over(&name)
    })
}

/// The pairs of a query string as PHP counts them (empty pieces between `&`s are none).
fn query_pairs(query: &str) -> impl Iterator<Item = (&str, &str)> {
    query
        .split('&')
        .filter(|pair| !pair.is_empty())
        .map(|pair| pair.split_once('=').unwrap_or((pair, "")))
}

/// A query parameter as PHP reads it into `$_GET`: names as `php_name` makes them, the last
/// of several with one name wins (`?api_key=decoy&api_key=real` is `real` to the app), and
/// only the first `PHP_MAX_INPUT_VARS` count.
fn query_param<'a>(query: &'a str, name: &str) -> Option<Cow<'a, [u8]>> {
    query_pairs(query)
        .take(PHP_MAX_INPUT_VARS)
        .filter(|(key, _)| php_name(&percent_decode(key)) == name)
        .last()
        .map(|(_, value)| decode_percent_bytes(value.as_bytes(), true))
}

impl Identity {
    /// The query parameters it reads a user or an API key from (as PHP names them): their
    /// values are credentials, shown as `***` in log lines.
    pub fn secret_query_names(&self) -> impl Iterator<Item = &str> + Clone {
        self.user
            .iter()
            .chain(&self.api_key)
            .filter_map(|source| match source {
                Source::Query(name) => Some(name.as_str()),
                _ => None,
            })
            .chain(SECRET_QUERY_NAMES)
    }

    /// A request target (path and query, as a request or a queued job has it) with the
    /// values of [`Identity::secret_query_names`] as `***`, as everything levee shows
    /// (log lines, the admin API) writes it; `None` when it holds none of them.
    pub fn redacted_target(&self, target: &str) -> Option<String> {
        let (path, query) = target.split_once('?')?;
        let hidden = redacted_query(query, self.secret_query_names())?;
        Some(format!("{path}?{hidden}"))
    }
}

/// Query parameters whose values are hidden wherever levee shows a target, whatever the
/// policy reads: a legacy login form sent by GET put `?password=` in clear in every log
/// line, and an app with sessions in its URLs (`session.use_trans_sid`, phpBB's `sid`) its
/// visitors' sessions, for whoever reads the log to take over. Matched in any letter case.
const SECRET_QUERY_NAMES: [&str; 12] = [
    "password",
    "passwd",
    "pwd",
    "pass",
    "secret",
    "token",
    "access_token",
    "refresh_token",
    "api_key",
    "apikey",
    "phpsessid",
    "sid",
];

/// `query` with the values of the parameters `secret` names (as PHP names them, in any letter
/// case) written as `***`; `None` when it holds none of them.
pub fn redacted_query<'a>(
    query: &str,
    secret: impl Iterator<Item = &'a str> + Clone,
) -> Option<String> {
    let is_secret = |key: &str| {
        let name = query_name(key);
        secret
            .clone()
            .any(|wanted| wanted.eq_ignore_ascii_case(&name))
    };
    if !query_pairs(query).any(|(key, _)| is_secret(key)) {
        return None;
    }
    let pieces: Vec<String> = query
        .split('&')
        .map(|pair| match pair.split_once('=') {
            Some((key, _)) if is_secret(key) => format!("{key}=***"),
            _ => pair.to_string(),
        })
        .collect();
    Some(pieces.join("&"))
}

/// A query parameter's name as PHP reads it (`tag[]=a` and `tag[]=b` are both `tag`): what
/// names a parameter in `degrade.query` of a `stale` route.
pub(crate) fn query_name(raw: &str) -> String {
    php_name(&percent_decode(raw)).into_owned()
}

/// Why levee cannot tell which value the app will read for a key part of a rule, if it
/// cannot: the key would then be one value while the app acts on another, and a client could
/// spend a fresh bucket per decoy. A request so spelled is refused (400) rather than guessed.
/// - Two fields of a header a part is read from: nginx before 1.23 passes the app the last,
///   later versions (and Apache) both joined; levee cannot know which the app gets.
/// - The part's cookie or query parameter past PHP's first `PHP_MAX_INPUT_VARS` variables:
///   a site that raised `max_input_vars` (common for shops) reads it, one on the default
///   does not.
/// - Two different API keys in the sources `[identity] api_key` lists (a decoy `X-Api-Key`
///   beside the real `?api_key=`): an app that takes a key from either place may read
///   another than the first, which levee keys by. (Not so for `user`, whose sources are
///   listed by trust: a header the front sets after login, else the session cookie; both
///   are present, and differ, on every logged-in request.)
///
/// The reason is the client's to read: about its request alone, naming no rule.
pub fn unreadable_part(parts: &[KeyPart], facts: &RequestFacts<'_>) -> Option<String> {
    parts.iter().find_map(|part| {
        let sources: &[Source] = match part {
            KeyPart::User => &facts.identity.user,
            KeyPart::ApiKey => &facts.identity.api_key,
            KeyPart::Field(source) => std::slice::from_ref(source),
            KeyPart::Ip | KeyPart::Route | KeyPart::Method => &[],
        };
        let repeated = sources
            .iter()
            .find_map(|source| source.unreadable(facts.headers, facts.query));
        if repeated.is_some() || !matches!(part, KeyPart::ApiKey) || sources.len() < 2 {
            return repeated;
        }
        // Compared as they are keyed: `Q4` beside `q4` is one key, and spaces alone none.
        let mut present = sources
            .iter()
            .filter_map(|source| source.read_bytes(facts.headers, facts.query))
            .filter_map(one_spelling);
        let first = present.next()?;
        present.any(|other| other != first).then(|| {
            "the request carries two different API keys: which one the app reads cannot be known".to_string()
        })
    })
}

/// Whether one of `names` (sorted, as PHP names them) is among the parameters of `query` past
/// PHP's first `PHP_MAX_INPUT_VARS`: an app on the default does not read it, one that raised
/// `max_input_vars` does (see [`unreadable_part`]).
pub(crate) fn names_past_input_vars(query: &str, names: &[String]) -> bool {
    // A query this short cannot hold that many pairs: no need to read it.
    query.len() >= 2 * PHP_MAX_INPUT_VARS
        && query_pairs(query)
            .skip(PHP_MAX_INPUT_VARS)
            .any(|(key, _)| names.binary_search(&query_name(key)).is_ok())
}

impl Source {
    /// See [`unreadable_part`].
    pub(crate) fn unreadable(&self, headers: &HeaderMap, query: Option<&str>) -> Option<String> {
        let repeated = |name: &HeaderName| {
            (headers.get_all(name).iter().nth(1).is_some()).then(|| {
                format!("the request has two `{name}` fields: which one the app reads depends on its server")
            })
        };
        match self {
            Source::Header(name) => repeated(name),
            Source::Cookie(name) => repeated(&http::header::COOKIE).or_else(|| {
                let cookies = headers.get(http::header::COOKIE)?.as_bytes();
                // A header this short cannot hold that many pairs: no need to read it.
                if cookies.len() < 2 * PHP_MAX_INPUT_VARS {
                    return None;
                }
                cookie_pairs(cookies)
                    .skip(PHP_MAX_INPUT_VARS)
                    .filter_map(cookie_name_value)
                    .any(|(key, _)| php_name(&percent_decode(&lossy(key))) == *name)
                    .then(|| past_input_vars("cookie", name))
            }),
            Source::Query(name) => {
                let query = query?;
                if query.len() < 2 * PHP_MAX_INPUT_VARS {
                    return None;
                }
                query_pairs(query)
                    .skip(PHP_MAX_INPUT_VARS)
                    .any(|(key, _)| php_name(&percent_decode(key)) == *name)
                    .then(|| past_input_vars("query parameter", name))
            }
        }
    }
}

fn past_input_vars(kind: &str, name: &str) -> String {
    format!("the {kind} `{name}` comes after the first {PHP_MAX_INPUT_VARS} variables: whether the app reads it depends on its max_input_vars")
}

/// Decodes `%XX` and `+` the way PHP fills `$_GET`, so `?key=a%62c` and `?key=abc` are one key.
fn percent_decode(text: &str) -> Cow<'_, str> {
    decode_percent(text, true)
}

/// Decodes `%XX` (and `+` as a space when `plus_is_space`, as in a query); a `%` not followed
/// by two hex digits stays as it is, and bytes that are not UTF-8 become U+FFFD.
pub(crate) fn decode_percent(text: &str, plus_is_space: bool) -> Cow<'_, str> {
    match decode_percent_bytes(text.as_bytes(), plus_is_space) {
        Cow::Borrowed(_) => Cow::Borrowed(text),
        Cow::Owned(bytes) => Cow::Owned(String::from_utf8_lossy(&bytes).into_owned()),
    }
}

/// [`decode_percent`] without the reading as UTF-8: the bytes as decoded.
fn decode_percent_bytes(bytes: &[u8], plus_is_space: bool) -> Cow<'_, [u8]> {
    let encoded = bytes.contains(&b'%') || (plus_is_space && bytes.contains(&b'+'));
    if !encoded {
        return Cow::Borrowed(bytes);
    }
    let mut out = Vec::with_capacity(bytes.len());
    let mut i = 0;
    while i < bytes.len() {
        match bytes[i] {
            b'+' if plus_is_space => out.push(b' '),
            // Two hex digits and nothing else, as PHP decodes: `u8::from_str_radix` would
            // also take `+4` in `%+41` for a number.
            b'%' if i + 2 < bytes.len() => match (hex_digit(bytes[i + 1]), hex_digit(bytes[i + 2]))
            {
                (Some(high), Some(low)) => {
                    out.push(high << 4 | low);
                    i += 2;
                }
                _ => out.push(b'%'),
            },
            other => out.push(other),
        }
        i += 1;
    }
    Cow::Owned(out)
}

fn hex_digit(byte: u8) -> Option<u8> {
    char::from(byte)
        .to_digit(16)
        .and_then(|digit| u8::try_from(digit).ok())
}

#[cfg(test)]
mod tests {
    use super::*;
    use http::HeaderValue;

    fn facts<'a>(
        headers: &'a HeaderMap,
        query: Option<&'a str>,
        identity: &'a Identity,
    ) -> RequestFacts<'a> {
        RequestFacts {
            client_ip: "203.0.113.9".parse().expect("ip"),
            route: "post",
            method: &Method::POST,
            headers,
            query,
            identity,
        }
    }

    #[test]
    fn keys_use_the_most_specific_part_as_hash_tag() {
        let mut headers = HeaderMap::new();
        headers.insert("cookie", HeaderValue::from_static("a=1; uid=42"));
        let identity = Identity {
            user: vec![Source::parse("cookie:uid").expect("source")],
            api_key: vec![],
        };
        let facts = facts(&headers, None, &identity);
        let key = bucket_key(
            "levee:",
            "post_per_user",
            &[KeyPart::Route, KeyPart::User],
            &facts,
            false,
        )
        .expect("key");
        // The user's value (here a cookie: a session id, a credential) is hashed.
        let user = hashed(b"42");
        assert_eq!(
            key.key,
            format!("levee:rl:{{{user}}}:post_per_user:post|{user}")
        );
        let key = bucket_key("levee:", "login", &[KeyPart::Ip], &facts, false).expect("key");
        assert_eq!(key.key, "levee:rl:{203.0.113.9}:login:203.0.113.9");
    }

    #[test]
    fn two_different_api_keys_are_unreadable_but_a_user_header_beside_its_cookie_is_not() {
        let identity = Identity {
            user: vec![
                Source::parse("header:X-User-Id").expect("source"),
                Source::parse("cookie:PHPSESSID").expect("source"),
            ],
            api_key: vec![
                Source::parse("header:X-Api-Key").expect("source"),
                Source::parse("query:api_key").expect("source"),
            ],
        };
        let mut headers = HeaderMap::new();
        headers.insert("x-api-key", HeaderValue::from_static("decoy-1"));
        headers.insert("x-user-id", HeaderValue::from_static("42"));
        headers.insert("cookie", HeaderValue::from_static("PHPSESSID=abc"));
        let decoy = facts(&headers, Some("api_key=REAL"), &identity);
        let reason = unreadable_part(&[KeyPart::ApiKey], &decoy).expect("refused");
        assert!(reason.contains("two different API keys"), "{reason}");
        // The same key in both places, or one of them: read as ever.
        let same = facts(&headers, Some("api_key=decoy-1"), &identity);
        assert_eq!(unreadable_part(&[KeyPart::ApiKey], &same), None);
        // Spelt otherwise, or spaces alone beside it: one key, as keyed.
        for query in ["api_key=DECOY-1%20", "api_key=%20"] {
            let spelt = facts(&headers, Some(query), &identity);
            assert_eq!(unreadable_part(&[KeyPart::ApiKey], &spelt), None, "{query}");
        }
        let one = facts(&headers, None, &identity);
        assert_eq!(unreadable_part(&[KeyPart::ApiKey], &one), None);
        // The front's user header and the session cookie differ on every logged-in request.
        assert_eq!(unreadable_part(&[KeyPart::User], &decoy), None);
    }

    #[test]
    fn a_host_key_part_is_the_site_whatever_its_spelling() {
        for spelling in [
            "shop.example",
            "SHOP.example",
            "shop.example.",
            "shop.example:80",
            "shop.example:0080",
            "shop.example:",
            " Shop.Example.:443 ",
        ] {
            assert_eq!(
                host_as_routed(spelling.as_bytes()),
                b"shop.example",
                "{spelling}"
            );
        }
        assert_eq!(host_as_routed(b"[::1]:8080"), b"[::1]");
        assert_eq!(host_as_routed(b"[::1]"), b"[::1]");
    }

    #[test]
    fn private_cookies_match_by_the_name_php_gives_or_its_prefix() {
        let names: Vec<CookieName> = ["wordpress_logged_in_*", "sid"]
            .iter()
            .map(|name| CookieName::parse(name).expect("name"))
            .collect();
        let carries = |cookie: &str| {
            let mut headers = HeaderMap::new();
            headers.insert(http::header::COOKIE, cookie.parse().expect("value"));
            has_cookie(&headers, &names)
        };
        assert!(carries("_ga=1; wordpress_logged_in_1e20ea=admin%7C1"));
        assert!(carries("wordpress.logged.in_x=1"), "PHP reads `.` as `_`");
        assert!(carries("sid=abc"));
        assert!(!carries("sidx=abc; wordpress_logged_out=1; _ga=1"));
        assert!(!has_cookie(&HeaderMap::new(), &names));
        assert!(CookieName::parse("*").expect("any").matches("anything"));
    }

    #[test]
    fn cookies_and_query_parameters_are_read_as_php_reads_them() {
        let read = |source: &str, cookie: &'static [u8], query: Option<&str>| {
            let mut headers = HeaderMap::new();
            headers.insert(
                "cookie",
                HeaderValue::from_bytes(cookie).expect("cookie value"),
            );
            Source::parse(source)
                .expect("source")
                .read(&headers, query)
                .map(|value| value.into_owned())
        };
        // Percent-encoded names and values are the same cookie to PHP; the first one wins.
        assert_eq!(
            read("cookie:uid", b"uid=al%69ce", None).as_deref(),
            Some("alice")
        );
        assert_eq!(
            read("cookie:uid", b"%75id=alice; uid=decoy", None).as_deref(),
            Some("alice")
        );
        // A byte beyond ASCII elsewhere in the header does not hide the cookie.
        assert_eq!(
            read("cookie:uid", b"uid=alice; x=\xc3\xa9", None).as_deref(),
            Some("alice")
        );
        // The last of repeated query parameters wins; `.` and spaces in names are `_`.
        for query in [
            "api_key=decoy&api_key=real",
            "api.key=real",
            "api%20key=real",
        ] {
            assert_eq!(
                read("query:api_key", b"", Some(query)).as_deref(),
                Some("real"),
                "{query}"
            );
            // A policy may name it as the request spells it: it is the same name to PHP.
            assert_eq!(
                read("query:api.key", b"", Some(query)).as_deref(),
                Some("real"),
                "{query}"
            );
        }
        assert_eq!(
            read("cookie:site.lang", b"site.lang=zh", None).as_deref(),
            Some("zh")
        );
        // A `%` not followed by two hex digits stays, and the `+` after it is a space: PHP
        // reads `%+41` as `% 41`, not as the byte 4 and `1`.
        for (query, value) in [("q=%+41", "% 41"), ("q=%4+1", "%4 1"), ("q=%41", "A")] {
            assert_eq!(
                read("query:q", b"", Some(query)).as_deref(),
                Some(value),
                "{query}"
            );
        }
    }

    #[test]
    fn names_are_made_as_php_8_makes_them() {
        // Each checked against PHP 8.2's parse_str, which fills $_GET the same way.
        for (raw, php) in [
            ("api[key", "api_key"),
            ("a[b.c", "a_b_c"),
            ("a[b[c", "a_b_c"),
            ("api_key[x", "api_key_x"),
            ("api_key[", "api_key_"),
            ("api_key[]", "api_key"),
            ("ap[i]_key", "ap"),
            ("api_key]", "api_key]"),
            ("api_key\0x", "api_key"),
            ("  api.key", "api_key"),
            ("api key", "api_key"),
        ] {
            assert_eq!(php_name(raw), php, "{raw:?}");
        }
        assert_eq!(query_name("tag%5B%5D"), "tag");
    }

    #[test]
    fn a_query_key_is_the_value_php_reads() {
        let value = |query: &str| {
            query_param(query, "api_key").map(|value| String::from_utf8_lossy(&value).into_owned())
        };
        for query in [
            "api[key=V",
            "api_key=fk1&api[key=V",
            "api_key%00x=V",
            "api_key=fk1&api_key%00=V",
            "api_key=fk1&api_key[]=V",
        ] {
            assert_eq!(value(query).as_deref(), Some("V"), "{query}");
        }
        // PHP registers the first 1000 variables; empty pieces are none.
        let mut query = String::from("&&api_key=V");
        for i in 0..998 {
            query.push_str(&format!("&p{i}=1&"));
        }
        assert_eq!(value(&format!("{query}&api_key=B")).as_deref(), Some("B"));
        assert_eq!(
            value(&format!("{query}&p=1&api_key=B")).as_deref(),
            Some("V")
        );
    }

    #[test]
    fn a_key_the_app_may_read_otherwise_is_named_unreadable() {
        let identity = Identity {
            user: vec![Source::parse("cookie:PHPSESSID").expect("source")],
            api_key: vec![
                Source::parse("header:X-Api-Key").expect("source"),
                Source::parse("query:api_key").expect("source"),
            ],
        };
        let check = |headers: &[(&str, &str)], query: Option<&str>, part: KeyPart| {
            let mut map = HeaderMap::new();
            for (name, value) in headers {
                map.append(
                    HeaderName::from_bytes(name.as_bytes()).expect("name"),
                    HeaderValue::from_str(value).expect("value"),
                );
            }
            unreadable_part(&[KeyPart::Ip, part], &facts(&map, query, &identity))
        };
        let two_keys = [("x-api-key", "fk1"), ("x-api-key", "V")];
        assert!(check(&two_keys, None, KeyPart::ApiKey)
            .is_some_and(|why| why.contains("two `x-api-key` fields")));
        assert_eq!(
            check(&two_keys, None, KeyPart::User),
            None,
            "not a key here"
        );
        let two_cookies = [("cookie", "PHPSESSID=fk1"), ("cookie", "PHPSESSID=V")];
        assert!(check(&two_cookies, None, KeyPart::User).is_some());
        assert_eq!(
            check(&[("cookie", "a=1; PHPSESSID=V")], None, KeyPart::User),
            None
        );
        let mut crowded = String::from("api_key=fk1");
        for i in 0..1000 {
            crowded.push_str(&format!("&p{i}=1"));
        }
        assert_eq!(check(&[], Some(&crowded), KeyPart::ApiKey), None);
        crowded.push_str("&api_key=V");
        assert!(check(&[], Some(&crowded), KeyPart::ApiKey)
            .is_some_and(|why| why.contains("max_input_vars")));
        assert!(check(
            &[],
            Some(&crowded),
            KeyPart::Field(Source::parse("query:api.key").expect("source"))
        )
        .is_some());
    }

    #[test]
    fn ipv6_clients_are_keyed_by_the_network_the_rule_says() {
        let key = |ip: &str, bits| ip_key(ip.parse().expect("ip"), bits);
        // A home line's /56: every /64 of it one client.
        assert_eq!(key("2001:db8:1:2aa::1", 56), "2001:db8:1:200::/56");
        assert_eq!(key("2001:db8:1:2ff:ffff::9", 56), "2001:db8:1:200::/56");
        assert_ne!(key("2001:db8:1:300::1", 56), key("2001:db8:1:200::1", 56));
        assert_eq!(key("2001:db8:1:2::5", 128), "2001:db8:1:2::5/128");
        assert_eq!(key("2001:db8:ffff::1", 32), "2001:db8::/32");
        // IPv4 clients are themselves whatever the rule says of IPv6.
        assert_eq!(key("203.0.113.9", 48), "203.0.113.9");
        assert_eq!(key("::ffff:203.0.113.9", 48), "203.0.113.9");
    }

    #[test]
    fn ipv6_clients_are_keyed_by_their_slash_64() {
        let key = |ip: &str| ip_key(ip.parse().expect("ip"), DEFAULT_IPV6_PREFIX);
        assert_eq!(key("2001:db8:1:2:aaaa::1"), "2001:db8:1:2::/64");
        assert_eq!(key("2001:db8:1:2:bbbb:cccc:dddd:eeee"), "2001:db8:1:2::/64");
        assert_ne!(key("2001:db8:1:3::1"), key("2001:db8:1:2::1"));
        assert_eq!(key("::ffff:203.0.113.9"), "203.0.113.9");
        // IPv4 visitors of an IPv6-only site behind a NAT64 translator are each themselves,
        // not one /64 between them.
        assert_eq!(key("64:ff9b::203.0.113.9"), "203.0.113.9");
        assert_eq!(key("64:ff9b::c000:201"), "192.0.2.1");
        assert_eq!(key("64:ff9b:1::c000:201"), "64:ff9b:1:0::/64");
        assert_eq!(key("203.0.113.9"), "203.0.113.9");
    }

    #[test]
    fn a_client_is_the_same_key_part_written_directly_or_formatted() {
        for ip in [
            "203.0.113.9",
            "10.0.0.1",
            "255.255.255.255",
            "0.0.0.0",
            "::ffff:192.0.2.1",
            "64:ff9b::c000:201",
            "2001:db8:1:2::1",
        ] {
            let ip: IpAddr = ip.parse().expect("ip");
            let client = client_key(ip, DEFAULT_IPV6_PREFIX);
            let mut written = String::new();
            client.write_to(&mut written);
            assert_eq!(
                written,
                safe_value(Cow::Owned(ip_key(ip, DEFAULT_IPV6_PREFIX).into_bytes())),
                "{ip}"
            );
            assert_eq!(client.len(), written.len(), "{ip}");
        }
    }

    #[test]
    fn a_key_the_route_alone_decides_is_built_once_and_alike() {
        let headers = HeaderMap::new();
        let identity = Identity::default();
        let facts = facts(&headers, None, &identity);
        for parts in [
            vec![KeyPart::Route],
            vec![],
            vec![KeyPart::Route, KeyPart::Route],
        ] {
            assert_eq!(
                fixed_bucket_key("levee:", "per_route", &parts, facts.route),
                bucket_key("levee:", "per_route", &parts, &facts, false),
                "{parts:?}"
            );
        }
        assert_eq!(
            fixed_bucket_key("levee:", "per_route", &[KeyPart::Route], "post")
                .expect("fixed")
                .key,
            "levee:rl:{post}:per_route:post"
        );
        for parts in [
            vec![KeyPart::Ip],
            vec![KeyPart::Route, KeyPart::Method],
            vec![KeyPart::User],
        ] {
            assert!(fixed_bucket_key("levee:", "r", &parts, "post").is_none());
        }
    }

    #[test]
    fn an_api_key_or_user_spelt_otherwise_is_the_same_bucket() {
        let identity = Identity {
            user: vec![Source::parse("header:X-User").expect("source")],
            api_key: vec![Source::parse("query:api_key").expect("source")],
        };
        let key = |query: &str, user: &str| {
            let mut headers = HeaderMap::new();
            headers.insert("x-user", HeaderValue::from_str(user).expect("value"));
            let facts = facts(&headers, Some(query), &identity);
            let parts = [KeyPart::ApiKey, KeyPart::User];
            bucket_key("", "api", &parts, &facts, false).map(|key| key.key)
        };
        let plain = key("api_key=k1", "alice");
        assert!(plain.is_some());
        for (query, user) in [
            ("api_key=K1", "Alice"),
            ("api_key=k1%20", "ALICE"),
            ("api_key=%20%20k1%09", "alice"),
            ("api_key=k1+", "alice"),
        ] {
            assert_eq!(key(query, user), plain, "{query} {user}");
        }
        assert_ne!(key("api_key=k2", "alice"), plain);
        // Spaces alone are no key: keyed as missing.
        assert_eq!(key("api_key=%20", "alice"), None);
    }

    #[test]
    fn the_identitys_query_values_are_hidden_in_log_lines() {
        let identity = Identity {
            user: vec![Source::parse("query:uid").expect("source")],
            api_key: vec![
                Source::parse("header:X-Api-Key").expect("source"),
                Source::parse("query:api_key").expect("source"),
            ],
        };
        let hidden = |query: &str| redacted_query(query, identity.secret_query_names());
        assert_eq!(
            hidden("q=php&api_key=SECRET&uid=42"),
            Some("q=php&api_key=***&uid=***".to_string())
        );
        // As PHP names them: `api.key` and `api%5Fkey` are `api_key` to the app.
        assert_eq!(
            hidden("api.key=S1&api%5Fkey=S2&x"),
            Some("api.key=***&api%5Fkey=***&x".to_string())
        );
        assert_eq!(hidden("q=php&page=2"), None);
        // A whole target, as a queued job keeps it: the path as it was.
        assert_eq!(
            identity.redacted_target("/api/v1/items?api_key=SECRET&page=2"),
            Some("/api/v1/items?api_key=***&page=2".to_string())
        );
        assert_eq!(identity.redacted_target("/api/v1/items?page=2"), None);
        assert_eq!(identity.redacted_target("/api/v1/items"), None);
        // Whatever the policy reads: a login form sent by GET, a session in the URL.
        let none = Identity::default();
        assert_eq!(
            none.redacted_target("/login.php?user=al&Password=hunter2&PHPSESSID=abc"),
            Some("/login.php?user=al&Password=***&PHPSESSID=***".to_string())
        );
        assert_eq!(
            none.redacted_target("/viewtopic.php?t=5&sid=0f3a"),
            Some("/viewtopic.php?t=5&sid=***".to_string())
        );
    }

    #[test]
    fn missing_parts_skip_or_fall_back_to_ip() {
        let headers = HeaderMap::new();
        let identity = Identity::default();
        let facts = facts(&headers, None, &identity);
        assert!(bucket_key("", "r", &[KeyPart::User], &facts, false).is_none());
        let key = bucket_key("", "r", &[KeyPart::User], &facts, true).expect("key");
        assert_eq!(key.tag(), "203.0.113.9");
    }

    #[test]
    fn values_that_are_not_utf8_are_keyed_by_their_bytes() {
        // Latin-1 user names from a legacy app's header, a GBK name in a query, a Latin-1
        // cookie: each pair is two users to the app, and must be two buckets.
        let key = |header: &[u8], cookie: &[u8], query: &str| {
            let mut headers = HeaderMap::new();
            headers.insert("x-user", HeaderValue::from_bytes(header).expect("header"));
            headers.insert("cookie", HeaderValue::from_bytes(cookie).expect("cookie"));
            let identity = Identity::default();
            let facts = facts(&headers, Some(query), &identity);
            let parts = ["header:x-user", "cookie:uid", "query:name"]
                .map(|source| KeyPart::Field(Source::parse(source).expect("source")));
            parts.map(|part| {
                bucket_key("", "r", std::slice::from_ref(&part), &facts, false)
                    .expect("key")
                    .key
            })
        };
        let a = key(b"caf\xe9", b"uid=caf%E9", "name=%C0%EE%CB%C4");
        let b = key(b"caf\xe8", b"uid=caf%E8", "name=%D5%C5%C8%FD");
        for (a, b) in a.iter().zip(&b) {
            assert_ne!(a, b);
        }
        // A value that is UTF-8 keeps the key it always had.
        let utf8 = key("café".as_bytes(), b"uid=caf%C3%A9", "name=caf%C3%A9");
        let digest = Sha256::digest("café".as_bytes());
        let hashed: String = digest.iter().take(12).map(|b| format!("{b:02x}")).collect();
        for key in utf8 {
            assert!(key.ends_with(&format!(":r:#{hashed}")), "{key}");
        }
    }

    #[test]
    fn an_ip_standing_in_for_a_missing_part_is_never_a_value_spelled_like_it() {
        let identity = Identity {
            user: vec![],
            api_key: vec![Source::parse("query:api_key").expect("source")],
        };
        let headers = HeaderMap::new();
        let anonymous = facts(&headers, None, &identity);
        let spelled_like_the_ip = facts(&headers, Some("api_key=203.0.113.9"), &identity);
        let key = |facts: &RequestFacts<'_>| {
            bucket_key("", "api", &[KeyPart::ApiKey], facts, true).expect("key")
        };
        let stand_in = key(&anonymous);
        let api_key = key(&spelled_like_the_ip);
        assert_ne!(stand_in.key, api_key.key);
        // Both still share the IP's slot with the client's per-IP buckets.
        let per_ip = bucket_key("", "ip", &[KeyPart::Ip], &anonymous, false).expect("key");
        assert_eq!(stand_in.tag(), per_ip.tag());
        assert_eq!(stand_in.key, "rl:{203.0.113.9}:api:#ip=203.0.113.9");
    }

    #[test]
    fn client_values_cannot_break_the_key() {
        let mut headers = HeaderMap::new();
        headers.insert("x-api-key", HeaderValue::from_static("abc}|{evil"));
        let identity = Identity::default();
        let facts = facts(&headers, Some("key=a%62c&x"), &identity);
        let key = bucket_key(
            "",
            "r",
            &[KeyPart::Field(
                Source::parse("header:x-api-key").expect("s"),
            )],
            &facts,
            false,
        )
        .expect("key");
        assert!(
            key.tag().starts_with('#') && !key.key.contains("evil"),
            "{key:?}"
        );
        let key = bucket_key(
            "",
            "r",
            &[KeyPart::Field(Source::parse("query:key").expect("s"))],
            &facts,
            false,
        )
        .expect("key");
        // Read as PHP reads it (`a%62c` is `abc`), and hashed as every header and query
        // value is (a token there is a credential).
        assert_eq!(key.tag(), hashed(b"abc"));
    }

    #[test]
    fn parts_parse_with_clear_errors() {
        assert_eq!(KeyPart::parse("ip"), Ok(KeyPart::Ip));
        assert!(KeyPart::parse("header:X-Api-Key").is_ok());
        assert!(KeyPart::parse("usr")
            .unwrap_err()
            .contains("unknown key part"));
        // A zone's key moved over from nginx.
        for (nginx, ours) in [
            ("$binary_remote_addr", "\"ip\""),
            ("$http_x_api_key", "\"header:x-api-key\""),
            ("$cookie_PHPSESSID", "\"cookie:PHPSESSID\""),
            ("$arg_token", "\"query:token\""),
        ] {
            let error = KeyPart::parse(nginx).unwrap_err();
            assert!(
                error.ends_with(&format!("nginx's variable is {ours} here")),
                "{error}"
            );
        }
        assert!(KeyPart::parse("cookie:").is_err());
        // Copied from a Set-Cookie: no request's Cookie field can hold that name.
        assert!(KeyPart::parse("cookie:sid; path=/")
            .unwrap_err()
            .contains("cannot hold"));
        assert!(KeyPart::parse("query:page=1").is_err());
        assert!(KeyPart::parse("query:a\tb").is_err());
        // A comma or a space does not end a cookie's name; a header name gets its own answer.
        assert!(KeyPart::parse("cookie:a,b").is_ok());
        assert!(KeyPart::parse("cookie:my sid").is_ok());
        assert!(KeyPart::parse("header:X Api")
            .unwrap_err()
            .contains("is not a header name"));
        // Percent-encoded, the same characters are names PHP can read.
        assert!(KeyPart::parse("cookie:a%3Bb").is_ok());
        assert!(KeyPart::parse("query:api.key").is_ok());
        assert!(KeyPart::parse("body:x").is_err());
    }
}
