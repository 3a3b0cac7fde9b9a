//! Client identity and the headers levee removes or sets on the way through.

use std::net::IpAddr;

use bytes::{BufMut, Bytes, BytesMut};
use http::header::{self, HeaderMap, HeaderName, HeaderValue};
use ipnet::IpNet;

use super::h1::encode::encode_field;

/// Peers whose `X-Forwarded-For` / `X-Real-IP` / `X-Forwarded-Proto` levee believes.
/// Default: loopback only (the front nginx on the same machine).
#[derive(Debug, Clone, PartialEq)]
pub struct TrustedProxies(pub Vec<IpNet>);

impl Default for TrustedProxies {
    fn default() -> Self {
        TrustedProxies(vec![
            "127.0.0.0/8".parse().expect("static CIDR"),
            "::1/128".parse().expect("static CIDR"),
        ])
    }
}

impl TrustedProxies {
    pub fn contains(&self, ip: IpAddr) -> bool {
        in_networks(ip, &self.0)
    }
}

/// Whether `ip` (an IPv4-mapped IPv6 address as the IPv4 one) is in one of `networks`.
pub fn in_networks(ip: IpAddr, networks: &[IpNet]) -> bool {
    let ip = canonical(ip);
    networks.iter().any(|net| net.contains(&ip))
}

/// IPv4-mapped IPv6 peers (`::ffff:1.2.3.4`) are treated as the IPv4 address they carry.
fn canonical(ip: IpAddr) -> IpAddr {
    match ip {
        IpAddr::V6(v6) => v6.to_ipv4_mapped().map_or(ip, IpAddr::V4),
        v4 => v4,
    }
}

static X_FORWARDED_FOR: HeaderName = HeaderName::from_static("x-forwarded-for");
/// Which modules are off, told to the app with `[degrade] tell_app`.
pub(crate) static X_LEVEE_MODULES_OFF: HeaderName = HeaderName::from_static("x-levee-modules-off");
static X_REAL_IP: HeaderName = HeaderName::from_static("x-real-ip");
static X_FORWARDED_PROTO: HeaderName = HeaderName::from_static("x-forwarded-proto");
static KEEP_ALIVE: HeaderName = HeaderName::from_static("keep-alive");

/// Fields in which a proxy tells how the visitor reached it besides `X-Forwarded-Proto`: the
/// host, port, path prefix and scheme the visitor used. Apps behind a trusted proxy build
/// their links and redirects from them (Symfony's and Laravel's trusted proxies, WordPress
/// plugins), so levee believes them as it believes `X-Forwarded-Proto`: from
/// `trusted_proxies` only. From anyone else they are dropped; kept, a visitor could have the
/// app write links to a host of his choosing into a page that levee keeps as a stale copy
/// and serves to everyone.
pub(crate) static FORWARDED_CLAIMS: [HeaderName; 7] = [
    FORWARDED,
    HeaderName::from_static("x-forwarded-host"),
    HeaderName::from_static("x-forwarded-port"),
    HeaderName::from_static("x-forwarded-prefix"),
    HeaderName::from_static("x-forwarded-ssl"),
    HeaderName::from_static("x-forwarded-scheme"),
    HeaderName::from_static("front-end-https"),
];

/// RFC 7239's field, whose `for` names each visitor (so it does not key a copy, its `host`
/// and `proto` do).
const FORWARDED: HeaderName = HeaderName::from_static("forwarded");

/// Is `name` one of [`FORWARDED_CLAIMS`]? Their lengths tell most fields apart before any
/// comparison: a direct client's every field is asked.
fn is_forwarded_claim(name: &HeaderName) -> bool {
    let text = name.as_str();
    matches!(text.len(), 9 | 15 | 16 | 18)
        && FORWARDED_CLAIMS.iter().any(|claim| claim.as_str() == text)
}

/// Does a copy's key hold what the field `name` says (see [`forwarded_description`])? An
/// answer that varies by it may then be kept.
pub(crate) fn keys_copies(name: &str) -> bool {
    name.eq_ignore_ascii_case(X_FORWARDED_PROTO.as_str())
        || FORWARDED_CLAIMS
            .iter()
            .any(|claim| *claim != FORWARDED && name.eq_ignore_ascii_case(claim.as_str()))
}

/// What a trusted proxy's forwarding fields say the visitor asked for (`X-Forwarded-Proto`
/// and the [`FORWARDED_CLAIMS`], `Forwarded` by its `host` and `proto` only, as its `for`
/// names each visitor): the app's page may differ by it, so a stale copy is keyed by it.
/// `None` when the request has none of them.
///
/// Each claim is written with its length in front (`24:x-forwarded-proto=https`), so that no
/// value can pass for two claims, and the key stays one printable line.
pub(crate) fn forwarded_description(headers: &HeaderMap) -> Option<Vec<u8>> {
    let mut described = Vec::new();
    let mut claim = |parts: &[&[u8]]| {
        let length: usize = parts.iter().map(|part| part.len()).sum();
        described.extend_from_slice(length.to_string().as_bytes());
        described.push(b':');
        parts
            .iter()
            .for_each(|part| described.extend_from_slice(part));
    };
    for name in std::iter::once(&X_FORWARDED_PROTO).chain(&FORWARDED_CLAIMS) {
        for value in headers.get_all(name) {
            if *name == FORWARDED {
                for pair in value.as_bytes().split(|&byte| byte == b';' || byte == b',') {
                    let pair = pair.trim_ascii();
                    let is_named = |wanted: &[u8]| {
                        pair.len() > wanted.len()
                            && pair[..wanted.len()].eq_ignore_ascii_case(wanted)
                    };
                    if is_named(b"host=") || is_named(b"proto=") {
                        claim(&[pair]);
                    }
                }
            } else {
                claim(&[name.as_str().as_bytes(), b"=", value.as_bytes()]);
            }
        }
    }
    (!described.is_empty()).then_some(described)
}
static PROXY_CONNECTION: HeaderName = HeaderName::from_static("proxy-connection");
/// No client has a use for it, and CGI makes it `HTTP_PROXY`, which libraries read as their
/// outgoing proxy ("httpoxy"): the app's own nginx, with Debian's `fastcgi_params`, passes it
/// on (PHP ignores it since 7.0.9; other software behind levee may not).
static PROXY: HeaderName = HeaderName::from_static("proxy");
/// Fields that say which URL the visitor asked for, written by IIS's URL Rewrite module. Zend
/// Framework 1, Symfony before 2.7.49 / 3.4.14 (CVE-2018-14773) and some CMSs route by them
/// rather than by the request line, so a visitor sending one would reach a page under another
/// path than the one levee routed, limited and keyed its copy by. No front in levee's place
/// sets them: like `Proxy`, they are dropped from every request to an upstream.
static X_ORIGINAL_URL: HeaderName = HeaderName::from_static("x-original-url");
static X_REWRITE_URL: HeaderName = HeaderName::from_static("x-rewrite-url");

/// The hop-by-hop fields (RFC 9110 7.6.1) besides `Connection` and the fields it names:
/// never passed on (the upstream client's response heads use the list too).
pub(crate) static HOP_BY_HOP: [&HeaderName; 6] = [
    &KEEP_ALIVE,
    &PROXY_CONNECTION,
    &header::TE,
    &header::TRAILER,
    &header::TRANSFER_ENCODING,
    &header::UPGRADE,
];

/// The IETF rate-limit fields levee sets, in place of any the upstream sent.
pub(crate) static RATELIMIT_POLICY: HeaderName = HeaderName::from_static("ratelimit-policy");
pub(crate) static RATELIMIT: HeaderName = HeaderName::from_static("ratelimit");

/// The client's address as levee resolves it.
///
/// The TCP peer, unless the peer is a trusted proxy: then the right-most address of
/// `X-Forwarded-For` that is not itself trusted (a chain of trusted proxies is walked back),
/// or `X-Real-IP` when there is no `X-Forwarded-For`. An untrusted peer cannot choose its IP.
pub fn client_ip(peer: IpAddr, headers: &HeaderMap, trusted: &TrustedProxies) -> IpAddr {
    let peer = canonical(peer);
    if !trusted.contains(peer) {
        return peer;
    }
    // Split as bytes: a byte that is not text (the client's own entry, on the left of the
    // line the front appended the visitor's address to) spoils that entry only, not the
    // line; skipping the whole line would leave no chain, and `X-Real-IP` (which a front
    // may pass on from the client) or the front's own address believed instead.
    let mut forwarded = headers
        .get_all(&X_FORWARDED_FOR)
        .iter()
        .flat_map(|value| value.as_bytes().split(|byte| *byte == b','))
        .map(<[u8]>::trim_ascii)
        .filter(|part| !part.is_empty())
        .collect::<Vec<_>>();
    if !forwarded.is_empty() {
        let mut leftmost = peer;
        while let Some(part) = forwarded.pop() {
            let parsed = std::str::from_utf8(part).ok().and_then(parse_forwarded_ip);
            let Some(ip) = parsed else {
                // Garbage in the chain: stop believing anything left of it.
                return leftmost;
            };
            if !trusted.contains(ip) {
                return ip;
            }
            leftmost = ip;
        }
        return leftmost;
    }
    headers
        .get(&X_REAL_IP)
        .and_then(|value| value.to_str().ok())
        .and_then(|value| parse_forwarded_ip(value.trim()))
        .unwrap_or(peer)
}

/// Accepts `1.2.3.4`, `1.2.3.4:567`, `::1`, `[::1]:567`.
fn parse_forwarded_ip(text: &str) -> Option<IpAddr> {
    if let Ok(ip) = text.parse::<IpAddr>() {
        return Some(canonical(ip));
    }
    if let Ok(addr) = text.parse::<std::net::SocketAddr>() {
        return Some(canonical(addr.ip()));
    }
    let v4 = text.split_once(':').map(|(host, _)| host)?;
    v4.parse::<std::net::Ipv4Addr>().ok().map(IpAddr::V4)
}

/// Is this an upgrade levee passes on: `Connection: upgrade` with `Upgrade: websocket`
/// (RFC 6455)? Every protocol the request offers must be WebSocket: the app picks one, and
/// a switch to another (`h2c`, anything an app might speak) would carry requests past
/// levee's routes and limits unseen. Other upgrades are dropped as hop-by-hop fields, and
/// the request is served as a plain one.
pub fn is_upgrade(headers: &HeaderMap) -> bool {
    let mut offered = headers
        .get_all(header::UPGRADE)
        .iter()
        .flat_map(|value| value.as_bytes().split(|&byte| byte == b','))
        .map(<[u8]>::trim_ascii)
        .filter(|protocol| !protocol.is_empty())
        .peekable();
    offered.peek().is_some()
        && offered.all(|protocol| protocol.eq_ignore_ascii_case(b"websocket"))
        && connection_has(headers, "upgrade")
}

/// The elements of a comma-separated field (RFC 9110 5.6.1) over all its lines, trimmed,
/// empty ones left out: `Vary: Accept-Encoding` and `Vary: Cookie` are two lines of one list.
pub(crate) fn list_elements<'a>(
    headers: &'a HeaderMap,
    name: &HeaderName,
) -> impl Iterator<Item = &'a [u8]> {
    headers
        .get_all(name)
        .iter()
        .flat_map(|value| value.as_bytes().split(|byte| *byte == b','))
        .map(<[u8]>::trim_ascii)
        .filter(|element| !element.is_empty())
}

/// Is the body content-coded? Every line and every coding counts: `identity` then `gzip`
/// (two lines, or `identity, gzip`) is a gzipped body (RFC 9110 8.4).
pub(crate) fn is_content_coded(headers: &HeaderMap) -> bool {
    list_elements(headers, &header::CONTENT_ENCODING)
        .any(|coding| !coding.eq_ignore_ascii_case(b"identity"))
}

pub(crate) fn connection_has(headers: &HeaderMap, token: &str) -> bool {
    headers
        .get_all(header::CONNECTION)
        .iter()
        .filter_map(|value| value.to_str().ok())
        .flat_map(|value| value.split(','))
        .any(|part| part.trim().eq_ignore_ascii_case(token))
}

/// Fields a `Connection` header may not take away (see [`strip_hop_by_hop`]).
fn is_end_to_end(name: &HeaderName) -> bool {
    *name == header::HOST
        || *name == X_FORWARDED_FOR
        || *name == X_REAL_IP
        || *name == X_FORWARDED_PROTO
}

/// [`strip_hop_by_hop`] for a request on its way to an upstream, which loses `Proxy`,
/// `X-Original-URL` and `X-Rewrite-URL` too (see [`PROXY`], [`X_ORIGINAL_URL`]). (In a
/// response they mean nothing and pass, as on every path.)
pub fn strip_request_hop_by_hop(headers: &mut HeaderMap, keep_upgrade: bool) {
    strip(headers, keep_upgrade, true);
}

/// Removes hop-by-hop headers (RFC 9110 7.6.1): `Connection` and every header it names,
/// `Proxy-Connection`, `Keep-Alive`, `TE`, `Trailer`, `Transfer-Encoding`, `Upgrade`.
/// Framing is redone by levee's own HTTP stack on each side.
///
/// For an upgrade that is being passed through, `Connection: upgrade` and `Upgrade` are
/// put back, because they are what asks the next hop to switch protocols.
pub fn strip_hop_by_hop(headers: &mut HeaderMap, keep_upgrade: bool) {
    strip(headers, keep_upgrade, false);
}

fn strip(headers: &mut HeaderMap, keep_upgrade: bool, request: bool) {
    // Runs twice per request. Most requests carry none of these headers, and most responses
    // only `Connection: keep-alive`: one pass over the names tells which are there, and only
    // those are looked up (each lookup hashes the name).
    let present = headers
        .keys()
        .fold(0u8, |present, name| present | hop_by_hop_bit(name));
    if present == 0 {
        return;
    }
    let upgrade = if keep_upgrade && present & hop_by_hop_bit(&header::UPGRADE) != 0 {
        headers.get(header::UPGRADE).cloned()
    } else {
        None
    };
    if present & hop_by_hop_bit(&header::CONNECTION) != 0 {
        let named: Vec<HeaderName> = headers
            .get_all(header::CONNECTION)
            .iter()
            // As bytes: a value with one non-ASCII byte still names the fields it lists.
            .flat_map(|value| value.as_bytes().split(|&byte| byte == b','))
            .map(<[u8]>::trim_ascii)
            // The usual tokens name no header (`close`) or one removed below anyway.
            .filter(|token| {
                ![&b"keep-alive"[..], b"close", b"upgrade"]
                    .iter()
                    .any(|usual| token.eq_ignore_ascii_case(usual))
            })
            .filter_map(|name| HeaderName::from_bytes(name).ok())
            // Fields meant for every recipient that levee routes by or writes itself stay: a
            // client naming `Host` would send the app another host than the one its request
            // was routed (and limited) by, and one naming `X-Forwarded-For` would leave the
            // app a chain that disagrees with `X-Real-IP` (RFC 9110 7.6.1 forbids naming them).
            .filter(|name| !is_end_to_end(name))
            .collect();
        for name in named {
            headers.remove(name);
        }
        headers.remove(header::CONNECTION);
    }
    for name in HOP_BY_HOP {
        if present & hop_by_hop_bit(name) != 0 {
            headers.remove(name);
        }
    }
    if request && present & hop_by_hop_bit(&PROXY) != 0 {
        let dropped: Vec<HeaderName> = headers
            .keys()
            .filter(|name| is_dropped_from_requests(name))
            .cloned()
            .collect();
        for name in dropped {
            headers.remove(name);
        }
    }
    if let Some(upgrade) = upgrade {
        headers.insert(header::CONNECTION, HeaderValue::from_static("upgrade"));
        headers.insert(header::UPGRADE, upgrade);
    }
}

/// `Proxy`, `X-Original-URL` and `X-Rewrite-URL`, the last two also spelt with `_` for a `-`
/// (`X_Original_URL`): a server that reads `_` as `-` (PHP's CGI names, nginx with
/// `underscores_in_headers on`) would take them for the field itself.
fn is_dropped_from_requests(name: &HeaderName) -> bool {
    if *name == PROXY || *name == X_ORIGINAL_URL || *name == X_REWRITE_URL {
        return true;
    }
    let spelt = name.as_str().as_bytes();
    let read_as = |field: &HeaderName| {
        let field = field.as_str().as_bytes();
        field.len() == spelt.len()
            && field
                .iter()
                .zip(spelt)
                .all(|(want, got)| want == got || (*want == b'-' && *got == b'_'))
    };
    matches!(spelt.len(), 13 | 14) && (read_as(&X_ORIGINAL_URL) || read_as(&X_REWRITE_URL))
}

/// One bit per hop-by-hop field name; 0 for any other name.
fn hop_by_hop_bit(name: &HeaderName) -> u8 {
    if *name == header::CONNECTION {
        1
    } else if *name == header::TE {
        2
    } else if *name == header::TRAILER {
        4
    } else if *name == header::TRANSFER_ENCODING {
        8
    } else if *name == header::UPGRADE {
        16
    } else if *name == KEEP_ALIVE {
        32
    } else if *name == PROXY_CONNECTION {
        64
    } else if is_dropped_from_requests(name) {
        // Fields dropped from requests only (a response's pass).
        128
    } else {
        0
    }
}

/// Sets the forwarding headers the app relies on:
/// - `X-Forwarded-For`: from a trusted peer, its chain as it came (levee stands beside the
///   front proxy: appending the front's address, the app's last entry would be the front,
///   and a backend that takes the last entry as the client, as nginx's `real_ip_header`
///   without `real_ip_recursive` or "trust the proxy in front" frameworks do, would see every
///   visitor as the front); from anyone else, or a trusted peer that sent none, just the peer
///   (an untrusted chain is dropped, not passed on to fool the app).
/// - `X-Real-IP`: the resolved client IP.
/// - `X-Forwarded-Proto`: kept from a trusted peer, otherwise levee's listener scheme.
///
/// For requests stored to be sent later (the queue). A request forwarded now gets the same
/// fields from [`ForwardedWriter`] as its head is encoded.
pub fn set_forwarded(headers: &mut HeaderMap, peer: IpAddr, peer_trusted: bool, client: IpAddr) {
    let peer = canonical(peer);
    let existing: Vec<&[u8]> = if peer_trusted {
        headers
            .get_all(&X_FORWARDED_FOR)
            .iter()
            .filter(|value| is_chain_line(value))
            .map(HeaderValue::as_bytes)
            .collect()
    } else {
        Vec::new()
    };
    let forwarded_for = match existing.as_slice() {
        [] => ip_value(peer),
        // One field line: passed as it came.
        [only] => HeaderValue::from_bytes(only).ok(),
        parts => {
            // Values that were valid header values already, joined, are one.
            let chain = parts.join(&b", "[..]);
            HeaderValue::from_maybe_shared(bytes::Bytes::from(chain)).ok()
        }
    };
    let real_ip = ip_value(canonical(client));
    if let Some(value) = forwarded_for {
        headers.insert(X_FORWARDED_FOR.clone(), value);
    }
    if let Some(value) = real_ip {
        headers.insert(X_REAL_IP.clone(), value);
    }
    if !(peer_trusted && headers.contains_key(&X_FORWARDED_PROTO)) {
        headers.insert(X_FORWARDED_PROTO.clone(), HeaderValue::from_static("http"));
    }
    if !peer_trusted {
        for name in &FORWARDED_CLAIMS {
            headers.remove(name);
        }
    }
}

/// Whom a forwarded request came from: what the forwarding fields levee sets say.
#[derive(Debug, Clone, Copy)]
pub struct ForwardedFrom {
    /// The connection's peer (the front nginx, or the client itself).
    pub peer: IpAddr,
    /// Whether `peer` is one of `trusted_proxies`.
    pub peer_trusted: bool,
    /// The client's address as levee resolved it.
    pub client: IpAddr,
}

/// What an upstream request keeps of the client's beyond its `HeaderMap`.
#[derive(Debug, Clone, Default)]
pub struct FromClient {
    /// The forwarding fields to set as the head is encoded; `None` for a request that carries
    /// its own (a replayed job) or none.
    pub forwarded: Option<ForwardedFrom>,
    /// The head the fields were read from, whose spelling of their names the upstream request
    /// keeps (see [`upstream_spelling`]); empty when there is none.
    pub received_head: Bytes,
    /// `X-Levee-Modules-Off`, written with the forwarding fields (`[degrade] tell_app`).
    pub modules_off: Option<HeaderValue>,
}

/// The name of a field as it goes upstream: as the client spelled it when `value` is the
/// client's own (a slice of `received_head`, right after `Name:` and its blanks, at a line's
/// start); else the usual capitalisation of a field levee sets itself; else as `HeaderName` keeps it, in lower
/// case. nginx passes names as they came, and an app that reads them by their exact spelling
/// (PHP's `getallheaders()` under Apache's mod_php: `$headers['X-Requested-With']`) must see
/// what it saw without levee.
pub(crate) fn upstream_spelling<'a>(
    received_head: &'a [u8],
    name: &'a HeaderName,
    value: &[u8],
) -> &'a [u8] {
    received_spelling(received_head, name, value)
        .or_else(|| usual_spelling(name).map(str::as_bytes))
        .unwrap_or(name.as_str().as_bytes())
}

/// The spelling of `name` in `received_head` when `value` was read from it (see
/// [`upstream_spelling`]).
fn received_spelling<'a>(
    received_head: &'a [u8],
    name: &HeaderName,
    value: &[u8],
) -> Option<&'a [u8]> {
    let lower = name.as_str().as_bytes();
    if value.is_empty() {
        // An empty value is no slice of the head (an empty `Bytes` points nowhere): the
        // first line of that name with nothing after its colon stands for it (rare).
        return empty_field_spelling(received_head, lower);
    }
    // Addresses compared as numbers: where the value lies says whether it was received. The
    // whole value must lie inside the head: a buffer allocated right after it is not it.
    let start = received_head.as_ptr() as usize;
    let at = (value.as_ptr() as usize).wrapping_sub(start);
    if at
        .checked_add(value.len())
        .is_none_or(|end| end > received_head.len())
    {
        return None;
    }
    let before = received_head[..at].trim_ascii_end();
    before
        .strip_suffix(b":")
        .and_then(|line| {
            line.len()
                .checked_sub(lower.len())
                .map(|from| line.split_at(from))
        })
        .filter(|(line_start, spelled)| {
            (line_start.is_empty() || line_start.ends_with(b"\n"))
                && spelled.eq_ignore_ascii_case(lower)
        })
        .map(|(_, spelled)| spelled)
}

/// The head an upstream response was read from, kept with a response whose fields were parsed
/// into its `HeaderMap` (a stale route's, a page being rewritten, a 101): the map holds names
/// in lower case, and its values are slices of this head, so each name goes back to the client
/// as the app spelled it (see [`upstream_spelling`]), as nginx passes it. A relayed response
/// needs none: its lines go back as received.
#[derive(Debug, Clone)]
pub struct ReceivedHead(pub Bytes);

/// `Name: value` lines of `fields`, with the map whose values are slices of them: how fields
/// kept as names and values (a stale copy, a queued job) are made whole again with their
/// spelling (see [`upstream_spelling`]). A field whose name is not valid is left out.
pub fn field_lines<'a>(
    fields: impl Iterator<Item = (&'a str, &'a [u8])> + Clone,
) -> (HeaderMap, Bytes) {
    let mut lines = BytesMut::with_capacity(
        fields
            .clone()
            .map(|(name, value)| name.len() + value.len() + 4)
            .sum(),
    );
    let mut spans = Vec::new();
    for (name, value) in fields {
        let Ok(parsed) = HeaderName::from_bytes(name.as_bytes()) else {
            continue;
        };
        lines.put_slice(name.as_bytes());
        lines.put_slice(b": ");
        spans.push((parsed, lines.len(), value.len()));
        lines.put_slice(value);
        lines.put_slice(b"\r\n");
    }
    let lines = lines.freeze();
    let mut map = HeaderMap::with_capacity(spans.len() + 2);
    for (name, start, length) in spans {
        if let Ok(value) = HeaderValue::from_maybe_shared(lines.slice(start..start + length)) {
            map.append(name, value);
        }
    }
    (map, lines)
}

/// The name of a response field as it goes to the client: as the upstream spelled it when
/// the value is the upstream's own (see [`ReceivedHead`]) and not framing (`Content-Length`,
/// `Transfer-Encoding`, `Connection`: levee redoes those); else the usual capitalisation of a
/// field levee sets itself; else in lower case.
pub(crate) fn response_spelling<'a>(
    received: Option<&'a ReceivedHead>,
    name: &'a HeaderName,
    value: &[u8],
) -> &'a [u8] {
    // The framing fields are levee's, whatever the app wrote: as on a relayed answer.
    let framing = *name == header::CONTENT_LENGTH
        || *name == header::TRANSFER_ENCODING
        || *name == header::CONNECTION;
    received
        .filter(|_| !framing)
        .and_then(|head| received_spelling(&head.0, name, value))
        .or_else(|| {
            usual_spelling(name)
                .or_else(|| levee_response_spelling(name))
                .map(str::as_bytes)
        })
        .unwrap_or(name.as_str().as_bytes())
}

/// The name of the first field line of `head` named `lower` (case-blind) whose value is empty.
/// (A request line never matches: it holds a space before any colon.)
fn empty_field_spelling<'a>(head: &'a [u8], lower: &[u8]) -> Option<&'a [u8]> {
    head.split(|&byte| byte == b'\n').find_map(|line| {
        let (spelled, value) = line.split_at(line.iter().position(|&byte| byte == b':')?);
        (spelled.eq_ignore_ascii_case(lower) && value[1..].trim_ascii().is_empty())
            .then_some(spelled)
    })
}

/// The usual capitalisation (as browsers, PHP and nginx write them) of the fields levee sets
/// itself, both ways; `None` for any other.
pub(crate) fn usual_spelling(name: &HeaderName) -> Option<&'static str> {
    // The framing fields first: every response has some of them.
    let spelled = if *name == header::CONTENT_LENGTH {
        "Content-Length"
    } else if *name == header::CONNECTION {
        "Connection"
    } else if *name == header::TRANSFER_ENCODING {
        "Transfer-Encoding"
    } else if *name == header::DATE {
        "Date"
    } else if *name == header::HOST {
        "Host"
    } else if *name == X_FORWARDED_FOR {
        "X-Forwarded-For"
    } else if *name == X_REAL_IP {
        "X-Real-IP"
    } else if *name == X_FORWARDED_PROTO {
        "X-Forwarded-Proto"
    } else if name.as_str() == "idempotency-key" {
        // Set on a replayed job that the client sent none for.
        "Idempotency-Key"
    } else {
        return None;
    };
    Some(spelled)
}

/// The usual capitalisation of the fields levee sets on its own answers (refusals, fallbacks,
/// stale copies, the admin API), as nginx writes its own.
fn levee_response_spelling(name: &HeaderName) -> Option<&'static str> {
    let spelled = if *name == header::CONTENT_TYPE {
        "Content-Type"
    } else if *name == header::CACHE_CONTROL {
        "Cache-Control"
    } else if *name == header::RETRY_AFTER {
        "Retry-After"
    } else if *name == RATELIMIT_POLICY {
        "RateLimit-Policy"
    } else if *name == RATELIMIT {
        "RateLimit"
    } else if *name == header::AGE {
        "Age"
    } else if *name == header::UPGRADE {
        "Upgrade"
    } else if *name == header::X_FRAME_OPTIONS {
        "X-Frame-Options"
    } else if *name == header::X_CONTENT_TYPE_OPTIONS {
        "X-Content-Type-Options"
    } else if *name == header::CONTENT_SECURITY_POLICY {
        "Content-Security-Policy"
    } else if *name == header::LOCATION {
        "Location"
    } else if *name == header::VARY {
        "Vary"
    } else if name.as_str() == "x-levee-stale" {
        "X-Levee-Stale"
    } else if name.as_str() == "x-levee-job" {
        "X-Levee-Job"
    } else if let Some(cors) = name.as_str().strip_prefix("access-control-") {
        match cors {
            "allow-origin" => "Access-Control-Allow-Origin",
            "allow-credentials" => "Access-Control-Allow-Credentials",
            "expose-headers" => "Access-Control-Expose-Headers",
            "allow-methods" => "Access-Control-Allow-Methods",
            "allow-headers" => "Access-Control-Allow-Headers",
            "max-age" => "Access-Control-Max-Age",
            _ => return None,
        }
    } else {
        return None;
    };
    Some(spelled)
}

/// [`set_forwarded`] as the upstream request head is encoded: the client's fields that it
/// replaces are skipped as they come, and levee's are written. Inserting three fields into the
/// `HeaderMap` (hashing each, growing the map) and looking the chain up cost more than any
/// other header work of a pass-through request; this costs three name comparisons per field.
/// What goes upstream is the same (a test holds the two to it).
pub(crate) struct ForwardedWriter<'a> {
    from: ForwardedFrom,
    wrote_for: bool,
    kept_proto: bool,
    modules_off: Option<&'a HeaderValue>,
}

impl<'a> ForwardedWriter<'a> {
    pub(crate) fn new(from: ForwardedFrom, modules_off: Option<&'a HeaderValue>) -> Self {
        ForwardedWriter {
            from: ForwardedFrom {
                peer: canonical(from.peer),
                client: canonical(from.client),
                ..from
            },
            wrote_for: false,
            kept_proto: false,
            modules_off,
        }
    }

    /// Whether the client's field `name` (one of `headers`) is passed on as it is. A field
    /// that levee sets is not; its `X-Forwarded-For` is written in place of the first one.
    pub(crate) fn passes(
        &mut self,
        out: &mut BytesMut,
        headers: &HeaderMap,
        name: &HeaderName,
    ) -> bool {
        if *name == X_FORWARDED_FOR {
            if !self.wrote_for {
                self.write_for(out, Some(headers));
            }
            false
        } else if *name == X_REAL_IP {
            false
        } else if *name == X_FORWARDED_PROTO {
            self.kept_proto = self.from.peer_trusted;
            self.kept_proto
        } else if *name == X_LEVEE_MODULES_OFF {
            // levee's word alone: a client's would have the app leave modules out of a page
            // that others are then served from the route's copy.
            false
        } else {
            // Most requests come through a trusted front: one test of a flag for them.
            self.from.peer_trusted || !is_forwarded_claim(name)
        }
    }

    /// Writes the fields the client's did not stand in for.
    pub(crate) fn finish(mut self, out: &mut BytesMut) {
        if !self.wrote_for {
            // The client sent none: no chain to look up.
            self.write_for(out, None);
        }
        let mut text = [0u8; 64];
        encode_field(out, "X-Real-IP", format_ip(self.from.client, &mut text));
        if !self.kept_proto {
            encode_field(out, "X-Forwarded-Proto", b"http");
        }
        if let Some(modules) = self.modules_off {
            encode_field(out, "X-Levee-Modules-Off", modules.as_bytes());
        }
    }

    /// `X-Forwarded-For`: a trusted peer's chain as it came (its values in `headers` that are
    /// text), or else the peer alone (see [`set_forwarded`]).
    fn write_for(&mut self, out: &mut BytesMut, headers: Option<&HeaderMap>) {
        self.wrote_for = true;
        out.put_slice(b"X-Forwarded-For: ");
        let mut chained = false;
        if let (true, Some(headers)) = (self.from.peer_trusted, headers) {
            for value in headers.get_all(&X_FORWARDED_FOR) {
                if is_chain_line(value) {
                    if chained {
                        out.put_slice(b", ");
                    }
                    out.put_slice(value.as_bytes());
                    chained = true;
                }
            }
        }
        if !chained {
            let mut text = [0u8; 64];
            out.put_slice(format_ip(self.from.peer, &mut text));
        }
        out.put_slice(b"\r\n");
    }
}

/// An `X-Forwarded-For` line of a trusted chain that is passed on: not blank. A line with
/// bytes that are not text is passed as it came too: it ends with the visitor's address the
/// front appended (the client's own part on its left is what holds such bytes), and without
/// it the app's last entry would be the front's own address.
fn is_chain_line(value: &HeaderValue) -> bool {
    !value.as_bytes().trim_ascii().is_empty()
}

/// Bytes the fields written by [`ForwardedWriter`] may add to a head, besides the client's
/// chain: three names, two addresses and `http`.
pub(crate) const FORWARDED_BYTES: usize = 200;

/// An address (canonical already) as a header value.
fn ip_value(ip: IpAddr) -> Option<HeaderValue> {
    let mut text = [0u8; 64];
    HeaderValue::from_bytes(format_ip(ip, &mut text)).ok()
}

/// Writes an address as text into `buffer` and returns it. IPv4, on every request, is written
/// digit by digit: the formatting machinery behind `to_string` cost more per request than any
/// other header work levee does.
pub(crate) fn format_ip(ip: IpAddr, buffer: &mut [u8; 64]) -> &[u8] {
    match ip {
        IpAddr::V4(v4) => {
            let mut len = 0;
            write_ipv4(v4, |byte| {
                buffer[len] = byte;
                len += 1;
            });
            &buffer[..len]
        }
        IpAddr::V6(v6) => {
            use std::io::Write;
            let mut cursor = std::io::Cursor::new(&mut buffer[..]);
            // 64 bytes hold any IPv6 text form (at most 45), so this cannot fail.
            let _ = write!(cursor, "{v6}");
            let len = usize::try_from(cursor.position()).unwrap_or(0);
            &buffer[..len]
        }
    }
}

/// Gives the dotted digits of `v4` one byte at a time.
pub(crate) fn write_ipv4(v4: std::net::Ipv4Addr, mut put: impl FnMut(u8)) {
    for (index, octet) in v4.octets().into_iter().enumerate() {
        if index > 0 {
            put(b'.');
        }
        if octet >= 100 {
            put(b'0' + octet / 100);
        }
        if octet >= 10 {
            put(b'0' + octet / 10 % 10);
        }
        put(b'0' + octet % 10);
    }
}

/// An address as an owned string, through `format_ip`.
pub(crate) fn ip_string(ip: IpAddr) -> String {
    let mut buffer = [0u8; 64];
    std::str::from_utf8(format_ip(ip, &mut buffer))
        .map(str::to_owned)
        .unwrap_or_else(|_| ip.to_string())
}

/// Bytes of all request header names and values, as counted against `max_header_bytes`.
pub fn header_bytes(headers: &HeaderMap) -> usize {
    headers
        .iter()
        .map(|(name, value)| name.as_str().len() + value.len() + 4)
        .sum()
}

/// Control bytes in field values that a head is read with as spaces: all but tab, CR, LF and
/// NUL. RFC 9110 5.5 calls them invalid but lets a recipient keep them, and nginx does: a PHP
/// page whose `header()` carries one (a file name, a debug dump) reached its visitors before
/// levee, and a request header with one (a bot's `User-Agent`) reached the app. The parsers
/// levee reads heads with refuse them, so the head is read again with each one blanked, as
/// the RFC has a recipient do with CR, LF and NUL; those three, which split or end lines for
/// some reader, still make the head invalid, as under nginx.
fn is_blankable_control(byte: u8) -> bool {
    matches!(byte, 0x01..=0x08 | 0x0b | 0x0c | 0x0e..=0x1f | 0x7f)
}

/// Response heads whose control bytes were blanked: at most one line a minute.
static BLANKED_LOG: crate::log_throttle::LogThrottle =
    crate::log_throttle::LogThrottle::new(std::time::Duration::from_secs(60));

/// [`blank_controls_in_values`] for an upstream's response head, saying so in the log (the
/// app's doing, which its operator may want to know of) at most once a minute.
pub(crate) fn blank_response_controls(head: &mut [u8], first_line_is_field: bool) -> bool {
    let changed = blank_controls_in_values(head, first_line_is_field);
    if changed {
        if let Some(held_back) = BLANKED_LOG.allow(std::time::Instant::now()) {
            tracing::warn!(
                "an upstream's answer has control bytes in a header field's value: passed on with spaces in their place ({held_back} more such answers not logged)"
            );
        }
    }
    changed
}

/// Blanks the control bytes of the field values of the head at the front of `head` (see
/// [`is_blankable_control`]): every line up to the first empty one, from its first `:` on;
/// the first line too when `first_line_is_field` (a CGI head has no status line), otherwise
/// it is left as it is, as are the empty lines a request may start with. Whether any byte
/// changed: when none did, reading the head again would fail the same way.
pub(crate) fn blank_controls_in_values(head: &mut [u8], first_line_is_field: bool) -> bool {
    let mut start = if first_line_is_field {
        0
    } else {
        head.iter()
            .position(|&byte| byte != b'\r' && byte != b'\n')
            .unwrap_or(head.len())
    };
    let mut is_first = !first_line_is_field;
    let mut changed = false;
    while start < head.len() {
        let end = memchr::memchr(b'\n', &head[start..]).map_or(head.len(), |at| start + at);
        let stop = if end > start && head[end - 1] == b'\r' {
            end - 1
        } else {
            end
        };
        let line = &mut head[start..stop];
        if line.is_empty() {
            break;
        }
        if !is_first {
            if let Some(colon) = memchr::memchr(b':', line) {
                for byte in &mut line[colon + 1..] {
                    if is_blankable_control(*byte) {
                        *byte = b' ';
                        changed = true;
                    }
                }
            }
        }
        is_first = false;
        start = end + 1;
    }
    changed
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn names_are_spelled_as_received_when_their_value_is_the_received_one() {
        let head = Bytes::from_static(
            b"GET http://a.example/ HTTP/1.1\r\nX-API-Key:\t k1\r\nhost: a.example\r\nA-X-Api-Key: k2\r\n\r\n",
        );
        let text = std::str::from_utf8(&head).expect("text");
        let value_at = |value: &str| {
            let start = text.find(value).expect("in the head");
            head.slice(start..start + value.len())
        };
        let key = HeaderName::from_static("x-api-key");
        let spelled = |name: &HeaderName, value: &[u8]| {
            String::from_utf8_lossy(upstream_spelling(&head, name, value)).into_owned()
        };
        assert_eq!(spelled(&key, &value_at("k1")), "X-API-Key");
        // The name before the value is another one's tail: not this field's line.
        assert_eq!(spelled(&key, &value_at("k2")), "x-api-key");
        // A value levee made, or one from elsewhere in the head (the target's authority).
        assert_eq!(spelled(&key, b"k1"), "x-api-key");
        assert_eq!(spelled(&header::HOST, &value_at("a.example/")[..9]), "Host");
        assert_eq!(
            spelled(&header::HOST, &value_at("a.example\r")[..9]),
            "host"
        );
        assert_eq!(spelled(&X_REAL_IP, b"10.0.0.1"), "X-Real-IP");
        assert_eq!(spelled(&header::CONNECTION, b"upgrade"), "Connection");
        // An empty value: the first line of that name with nothing after its colon.
        let head = Bytes::from_static(
            b"GET / HTTP/1.1\r\nX-Emptyish: a\r\nX-Empty:\t \r\nx-empty:\r\n\r\n",
        );
        let empty = HeaderName::from_static("x-empty");
        assert_eq!(upstream_spelling(&head, &empty, b""), b"X-Empty");
        let none = HeaderName::from_static("x-none");
        assert_eq!(upstream_spelling(&head, &none, b""), b"x-none");
    }

    /// A response levee answers itself, or whose fields it made: its own fields in their
    /// usual capitalisation; one it read from the app: the app's spelling for the app's values.
    #[test]
    fn response_fields_are_named_as_the_app_or_nginx_would() {
        for (name, usual) in [
            (header::CONTENT_TYPE, "Content-Type"),
            (header::RETRY_AFTER, "Retry-After"),
            (header::CACHE_CONTROL, "Cache-Control"),
            (RATELIMIT.clone(), "RateLimit"),
            (RATELIMIT_POLICY.clone(), "RateLimit-Policy"),
            (HeaderName::from_static("x-levee-stale"), "X-Levee-Stale"),
            (HeaderName::from_static("x-levee-job"), "X-Levee-Job"),
            (
                header::ACCESS_CONTROL_ALLOW_ORIGIN,
                "Access-Control-Allow-Origin",
            ),
            (
                HeaderName::from_static("access-control-x"),
                "access-control-x",
            ),
            (HeaderName::from_static("x-other"), "x-other"),
        ] {
            assert_eq!(response_spelling(None, &name, b"1"), usual.as_bytes());
        }
        let (map, lines) =
            field_lines([("content-TYPE", &b"text/html"[..]), ("X-Cache", b"HIT")].into_iter());
        let received = ReceivedHead(lines);
        let named: Vec<&[u8]> = map
            .iter()
            .map(|(name, value)| response_spelling(Some(&received), name, value.as_bytes()))
            .collect();
        assert_eq!(named, [&b"content-TYPE"[..], b"X-Cache"]);
        // A value levee set is not the app's: the usual name.
        let set = HeaderValue::from_static("text/plain");
        assert_eq!(
            response_spelling(Some(&received), &header::CONTENT_TYPE, set.as_bytes()),
            b"Content-Type"
        );
        // The framing fields are levee's, as on a relayed answer, however the app wrote them.
        let (map, lines) = field_lines([("content-length", &b"5"[..])].into_iter());
        let (name, value) = map.iter().next().expect("a field");
        assert_eq!(
            response_spelling(Some(&ReceivedHead(lines)), name, value.as_bytes()),
            b"Content-Length"
        );
        // A value that starts where the head ends (another buffer right after it) is not
        // the head's, even behind a line of its name.
        let both = Bytes::from_static(b"X-Tail:valueX");
        let head = both.slice(..7);
        let tail = both.slice(7..);
        let name = HeaderName::from_static("x-tail");
        assert_eq!(upstream_spelling(&head, &name, &tail), b"x-tail");
        assert_eq!(upstream_spelling(&both, &name, &tail), b"X-Tail");
    }

    fn headers(pairs: &[(&str, &str)]) -> HeaderMap {
        let mut map = HeaderMap::new();
        for (name, value) in pairs {
            map.append(
                HeaderName::from_bytes(name.as_bytes()).expect("name"),
                HeaderValue::from_str(value).expect("value"),
            );
        }
        map
    }

    fn ip(text: &str) -> IpAddr {
        text.parse().expect("ip")
    }

    #[test]
    fn untrusted_peer_cannot_choose_its_ip() {
        let trusted = TrustedProxies::default();
        let spoof = headers(&[("x-forwarded-for", "1.1.1.1"), ("x-real-ip", "2.2.2.2")]);
        assert_eq!(
            client_ip(ip("203.0.113.9"), &spoof, &trusted),
            ip("203.0.113.9")
        );
    }

    #[test]
    fn trusted_peer_gives_rightmost_untrusted() {
        let trusted = TrustedProxies::default();
        let chain = headers(&[("x-forwarded-for", "6.6.6.6, 203.0.113.9, 127.0.0.2")]);
        assert_eq!(
            client_ip(ip("127.0.0.1"), &chain, &trusted),
            ip("203.0.113.9")
        );
        let real = headers(&[("x-real-ip", "203.0.113.10")]);
        assert_eq!(
            client_ip(ip("127.0.0.1"), &real, &trusted),
            ip("203.0.113.10")
        );
        let mapped = ip("::ffff:127.0.0.1");
        assert_eq!(client_ip(mapped, &real, &trusted), ip("203.0.113.10"));
        let garbage = headers(&[("x-forwarded-for", "nonsense")]);
        assert_eq!(
            client_ip(ip("127.0.0.1"), &garbage, &trusted),
            ip("127.0.0.1")
        );
        // A byte that is not text in the client's part of the line the front appended to
        // spoils that part only: the visitor's address, on its right, still counts, and
        // `X-Real-IP` (passed on from the client) is not believed instead.
        let mut spoiled = headers(&[("x-real-ip", "127.0.0.5")]);
        spoiled.insert(
            "x-forwarded-for",
            HeaderValue::from_bytes(b"\x80, 203.0.113.9").expect("obs-text"),
        );
        assert_eq!(
            client_ip(ip("127.0.0.1"), &spoiled, &trusted),
            ip("203.0.113.9")
        );
        // And the line reaches the app as it came: its last entry is the visitor.
        let mut passed = spoiled.clone();
        set_forwarded(&mut passed, ip("127.0.0.1"), true, ip("203.0.113.9"));
        assert_eq!(passed["x-forwarded-for"].as_bytes(), b"\x80, 203.0.113.9");
        spoiled.insert(
            "x-forwarded-for",
            HeaderValue::from_bytes(b"\x80").expect("obs-text"),
        );
        assert_eq!(
            client_ip(ip("127.0.0.1"), &spoiled, &trusted),
            ip("127.0.0.1"),
            "nothing believable: the peer"
        );
    }

    #[test]
    fn hop_by_hop_and_connection_named_headers_go() {
        let mut map = headers(&[
            ("connection", "keep-alive, x-secret"),
            ("x-secret", "1"),
            ("keep-alive", "timeout=5"),
            ("te", "trailers"),
            ("transfer-encoding", "chunked"),
            ("upgrade", "websocket"),
            ("proxy", "http://evil.example:3128"),
            ("x-original-url", "/admin/"),
            ("x-rewrite-url", "/admin/"),
            ("x_original_url", "/admin/"),
            ("x-rewrite_url", "/admin/"),
            ("cookie", "a=1"),
        ]);
        let mut response = map.clone();
        strip_request_hop_by_hop(&mut map, false);
        assert_eq!(map.len(), 1, "{map:?}");
        // A response keeps them: the two ways a response head is read agree (a fuzz target
        // checks they do).
        strip_hop_by_hop(&mut response, false);
        assert_eq!(response.len(), 6, "{response:?}");
        assert_eq!(map["cookie"], "a=1");

        // A byte that is not ASCII elsewhere in the value does not hide the names it lists.
        let mut map = HeaderMap::new();
        map.insert(
            header::CONNECTION,
            HeaderValue::from_bytes(b"x-secret, \xe9t\xe9").unwrap(),
        );
        map.insert("x-secret", HeaderValue::from_static("1"));
        map.insert("cookie", HeaderValue::from_static("a=1"));
        strip_hop_by_hop(&mut map, false);
        assert_eq!(map.len(), 1, "{map:?}");

        // Naming the host or the forwarding fields takes none of them away.
        let mut map = headers(&[
            (
                "connection",
                "Host, X-Forwarded-For, x-real-ip, X-Forwarded-Proto, x-secret",
            ),
            ("host", "site.example"),
            ("x-forwarded-for", "203.0.113.9"),
            ("x-real-ip", "203.0.113.9"),
            ("x-forwarded-proto", "https"),
            ("x-secret", "1"),
        ]);
        strip_hop_by_hop(&mut map, false);
        assert_eq!(map.len(), 4, "{map:?}");
        assert_eq!(map["host"], "site.example");
    }

    #[test]
    fn addresses_are_formatted_like_display() {
        let mut buffer = [0u8; 64];
        for text in [
            "0.0.0.0",
            "1.2.3.4",
            "9.10.99.100",
            "255.255.255.255",
            "10.0.100.7",
            "::1",
            "2001:db8::8a2e:370:7334",
            "ffff:ffff:ffff:ffff:ffff:ffff:ffff:ffff",
        ] {
            let address = ip(text);
            assert_eq!(
                format_ip(address, &mut buffer),
                address.to_string().as_bytes()
            );
        }
        for n in (0..=u32::MAX).step_by(16_777_259) {
            let address = IpAddr::V4(std::net::Ipv4Addr::from(n));
            assert_eq!(
                format_ip(address, &mut buffer),
                address.to_string().as_bytes()
            );
        }
    }

    #[test]
    fn forwarded_headers_from_untrusted_peer_are_replaced() {
        let mut map = headers(&[
            ("x-forwarded-for", "1.1.1.1"),
            ("x-forwarded-proto", "https"),
        ]);
        set_forwarded(&mut map, ip("203.0.113.9"), false, ip("203.0.113.9"));
        assert_eq!(map["x-forwarded-for"], "203.0.113.9");
        assert_eq!(map["x-real-ip"], "203.0.113.9");
        assert_eq!(map["x-forwarded-proto"], "http");

        let mut map = headers(&[
            ("x-forwarded-for", "1.1.1.1"),
            ("x-forwarded-proto", "https"),
        ]);
        set_forwarded(&mut map, ip("127.0.0.1"), true, ip("1.1.1.1"));
        // A trusted front's chain goes on as it came: the app's last entry stays the client
        // the front saw, as it was without levee.
        assert_eq!(map["x-forwarded-for"], "1.1.1.1");
        assert_eq!(map["x-real-ip"], "1.1.1.1");
        assert_eq!(map["x-forwarded-proto"], "https");

        for (lines, chain) in [
            (&["10.0.0.1, 1.1.1.1"][..], "10.0.0.1, 1.1.1.1"),
            (&["10.0.0.1", "1.1.1.1"][..], "10.0.0.1, 1.1.1.1"),
            (&["", " "][..], "127.0.0.1"),
            (&["", "1.1.1.1"][..], "1.1.1.1"),
        ] {
            let mut map = HeaderMap::new();
            for line in lines {
                map.append("x-forwarded-for", line.parse().expect("value"));
            }
            set_forwarded(&mut map, ip("127.0.0.1"), true, ip("1.1.1.1"));
            assert_eq!(map["x-forwarded-for"], chain, "{lines:?}");
        }
    }

    #[test]
    fn what_a_proxy_says_of_the_visitor_s_host_and_scheme_is_believed_from_trusted_peers_only() {
        let claims = [
            ("forwarded", "for=6.6.6.6;host=evil.example;proto=https"),
            ("x-forwarded-host", "evil.example"),
            ("x-forwarded-port", "8443"),
            ("x-forwarded-prefix", "/evil"),
            ("x-forwarded-ssl", "on"),
            ("x-forwarded-scheme", "https"),
            ("front-end-https", "on"),
            ("x-other", "kept"),
        ];
        let mut map = headers(&claims);
        set_forwarded(&mut map, ip("203.0.113.9"), false, ip("203.0.113.9"));
        let left: Vec<&str> = map.keys().map(HeaderName::as_str).collect();
        assert!(
            claims[..7].iter().all(|(name, _)| !left.contains(name)) && left.contains(&"x-other"),
            "{left:?}"
        );
        let mut map = headers(&claims);
        set_forwarded(&mut map, ip("127.0.0.1"), true, ip("203.0.113.9"));
        assert!(claims.iter().all(|(name, _)| map.contains_key(*name)));

        // A stale copy is keyed by what they say, `Forwarded` by its host and scheme alone.
        assert_eq!(
            forwarded_description(&headers(&claims[..2])).as_deref(),
            Some(&b"17:host=evil.example11:proto=https29:x-forwarded-host=evil.example"[..])
        );
        assert_eq!(
            forwarded_description(&headers(&[("forwarded", "for=6.6.6.6")])),
            None
        );
        assert_eq!(forwarded_description(&headers(&claims[7..])), None);
    }

    #[test]
    fn peers_in_turn_each_get_their_own_address() {
        // The thread's cached peer value changes hands: each request still names its own.
        for peer in [
            "203.0.113.9",
            "203.0.113.9",
            "::ffff:198.51.100.7",
            "2001:db8::1",
            "203.0.113.9",
        ] {
            let mut map = HeaderMap::new();
            set_forwarded(&mut map, ip(peer), false, ip(peer));
            let expected = ip_string(canonical(ip(peer)));
            assert_eq!(map["x-forwarded-for"], expected.as_str(), "{peer}");
            assert_eq!(map["x-real-ip"], expected.as_str(), "{peer}");
        }
    }
}
