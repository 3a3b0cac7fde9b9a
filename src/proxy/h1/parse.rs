//! Request heads: the bytes of a request line and its header fields in, a checked head with
//! its body framing out (RFC 9112 2–6).
//!
//! httparse does the tokenising; this module decides what the head means for the connection:
//! how the body is framed, whether the connection stays open, and which heads are refused.
//! The smuggling rules (RFC 9112 6.1, 6.3) are applied here, before any of the request path
//! sees the request:
//! - `Transfer-Encoding` other than exactly `chunked` → refused (levee forwards bodies
//!   de-chunked, so it could not pass any other coding on faithfully);
//! - `Transfer-Encoding` on HTTP/1.0 → refused;
//! - `Content-Length` next to `Transfer-Encoding` → the length is dropped, the body read as
//!   chunked, and the connection closed after the response;
//! - differing `Content-Length` values, or one that is not a plain decimal number → refused.

use bytes::BytesMut;
use http::header::{self, HeaderName, HeaderValue};
use http::{HeaderMap, Method, Uri, Version};

/// Most header fields in one request head; more is refused with 431. nginx counts none (only
/// bytes): a few hundred leaves room for what a front proxy adds to a client's many.
pub const MAX_HEADERS: usize = 256;

/// How the request body is delimited on the wire.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum BodyFraming {
    Empty,
    Length(u64),
    Chunked,
}

/// A parsed, checked request head.
#[derive(Debug)]
pub struct RequestHead {
    pub method: Method,
    pub uri: Uri,
    pub version: Version,
    pub headers: HeaderMap,
    pub framing: BodyFraming,
    /// The client allows the connection to stay open after this exchange.
    pub keep_alive: bool,
    /// `Expect: 100-continue` on a request with a body.
    pub expect_continue: bool,
    /// HTTP/1.1 with `Upgrade` named in `Connection`.
    pub wants_upgrade: bool,
    /// Framed both ways: answered, then the connection is closed (RFC 9112 6.1).
    pub close_after: bool,
    /// The head's bytes as received: the header values are slices of them, and the upstream
    /// request spells each field's name as the client did (see `header::upstream_spelling`).
    pub received: bytes::Bytes,
}

#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum HeadError {
    #[error("request head is {size} bytes or more, over the limit of {limit}")]
    TooLarge { size: usize, limit: usize },
    #[error("request has more than {limit} header fields")]
    TooManyHeaders { limit: usize },
    /// The request line alone is over the head's limit: its target is too long (RFC 9112 3
    /// asks for 414, and the client for a reason that names the target, not its fields).
    #[error("request line is over the limit of {limit} bytes")]
    TargetTooLong { limit: usize },
    #[error("{0}")]
    Malformed(&'static str),
}

impl HeadError {
    /// The refusal as the client reads it: a head over the parser's own bound (far above
    /// the operator's) is over the operator's `max_header_bytes` too, and that is the limit
    /// the client and the log should see.
    pub fn naming_limit(self, operator_limit: usize) -> HeadError {
        match self {
            HeadError::TooLarge { size, .. } => HeadError::TooLarge {
                size,
                limit: operator_limit,
            },
            HeadError::TargetTooLong { .. } => HeadError::TargetTooLong {
                limit: operator_limit,
            },
            other => other,
        }
    }
}

/// A path target with bytes a URI does not allow raw (`"`, `<`, `>`, a backtick, `{`, `|`,
/// `\`, `^`…), which nginx passes to the app and server-to-server callers send unencoded
/// (`cb.php?d={"a":1}`): those bytes percent-encoded, which the app decodes to the same
/// `$_GET`. `None` for anything else that is not a URI.
fn lenient_target(target: &[u8]) -> Option<Uri> {
    if !target.starts_with(b"/") {
        return None;
    }
    // UTF-8 stays raw where the URI parser takes it (as without the odd bytes), else it is
    // encoded too.
    encode_target(target, true).or_else(|| encode_target(target, false))
}

fn encode_target(target: &[u8], keep_beyond_ascii: bool) -> Option<Uri> {
    let mut encoded = Vec::with_capacity(target.len() + 16);
    for &byte in target {
        let allowed = (keep_beyond_ascii && byte >= 0x80)
            || is_unreserved_or_sub_delim(byte)
            // A `%` stays: the client's own escapes (`%20`, or those of bytes beyond ASCII
            // that `with_raw_target_encoded` wrote) must not become `%2520`. A broken one is
            // refused later, as in any target.
            || matches!(byte, b':' | b'/' | b'?' | b'#' | b'[' | b']' | b'@' | b'%');
        if allowed {
            encoded.push(byte);
        } else {
            crate::proxy::path::push_percent_encoded(&mut encoded, byte);
        }
    }
    Uri::from_maybe_shared(bytes::Bytes::from(encoded)).ok()
}

/// The buffer again with its request target's bytes beyond ASCII percent-encoded, when the
/// target is not UTF-8 (`/caf\xe9?q=\xe9t\xe9`: Latin-1, as old clients of a Latin-1 site send
/// it and nginx passes it to the app, which decodes the escapes to the same `$_GET`). `None`
/// for any other line the parser refused (control bytes, a bad method), which stays a 400.
fn with_raw_target_encoded(buffer: &[u8]) -> Option<BytesMut> {
    // The parser skips empty lines before the request line; so does this.
    let start = buffer
        .iter()
        .position(|&byte| byte != b'\r' && byte != b'\n')?;
    let line = &buffer[start..];
    let target_start = memchr::memchr(b' ', line)? + 1;
    let target_end = target_start + memchr::memchr(b' ', &line[target_start..])?;
    let target = &line[target_start..target_end];
    let plain = |byte: &u8| *byte > b' ' && *byte != 0x7f;
    if std::str::from_utf8(target).is_ok() || !target.iter().all(plain) {
        return None;
    }
    let mut encoded = Vec::with_capacity(buffer.len() + 2 * target.len());
    encoded.extend_from_slice(&buffer[..start + target_start]);
    for &byte in target {
        if byte < 0x80 {
            encoded.push(byte);
        } else {
            crate::proxy::path::push_percent_encoded(&mut encoded, byte);
        }
    }
    encoded.extend_from_slice(&line[target_end..]);
    Some(BytesMut::from(&encoded[..]))
}

/// Parses the request head at the front of `buffer`.
///
/// `Ok(None)`: the head is not complete yet (and still within `max_head_bytes`). On success
/// the head's bytes are split off `buffer` (header values keep pointing into them, no copy);
/// whatever follows — body bytes, a pipelined request — stays in `buffer`.
pub fn parse_head(
    buffer: &mut BytesMut,
    max_head_bytes: usize,
) -> Result<Option<RequestHead>, HeadError> {
    // Uninitialised slots: zeroing a hundred of them for every request cost more than
    // parsing the few a request has.
    let mut slots =
        [const { std::mem::MaybeUninit::<httparse::Header<'_>>::uninit() }; MAX_HEADERS];
    let mut request = httparse::Request::new(&mut []);
    let head_length = match request.parse_with_uninit_headers(buffer, &mut slots) {
        Ok(httparse::Status::Complete(length)) => length,
        Ok(httparse::Status::Partial) => {
            if buffer.len() > max_head_bytes {
                return Err(too_large(buffer, buffer.len(), max_head_bytes));
            }
            return Ok(None);
        }
        Err(httparse::Error::TooManyHeaders) => {
            return Err(HeadError::TooManyHeaders { limit: MAX_HEADERS })
        }
        // Read again with the control bytes of its values blanked, as nginx in front of the
        // app would have passed them; only once, as blanking again changes nothing. A head
        // not complete yet leaves the buffer as it came, as the target's encoding does.
        Err(httparse::Error::HeaderValue) => {
            let received = buffer.clone();
            if !crate::proxy::header::blank_controls_in_values(buffer, false) {
                return Err(HeadError::Malformed(describe(httparse::Error::HeaderValue)));
            }
            let parsed = parse_head(buffer, max_head_bytes);
            if matches!(parsed, Ok(None)) {
                *buffer = received;
            }
            return parsed;
        }
        Err(httparse::Error::Token) => match with_raw_target_encoded(buffer) {
            // Parsed again: the target is ASCII now, so this comes back here no more. A head
            // not complete yet leaves the buffer as it came (the next read appends to it, and
            // the encoding is done again then).
            Some(encoded) => {
                let received = std::mem::replace(buffer, encoded);
                let parsed = parse_head(buffer, max_head_bytes);
                if matches!(parsed, Ok(None)) {
                    *buffer = received;
                }
                return parsed;
            }
            None => return Err(HeadError::Malformed(describe(httparse::Error::Token))),
        },
        Err(error) => return Err(HeadError::Malformed(describe(error))),
    };
    if head_length > max_head_bytes {
        return Err(too_large(buffer, head_length, max_head_bytes));
    }
    let method = request
        .method
        .ok_or(HeadError::Malformed("missing method"))?;
    // As nginx in front of the app reads a method: capital letters, `_` and `-`. A `post`
    // would pass the routes and limits written for POST, and reach php-fpm as `post`.
    if !method
        .bytes()
        .all(|byte| byte.is_ascii_uppercase() || byte == b'_' || byte == b'-')
    {
        return Err(HeadError::Malformed(
            "the method is not in capital letters (`_` and `-` allowed)",
        ));
    }
    let method = Method::from_bytes(method.as_bytes())
        .map_err(|_| HeadError::Malformed("invalid method"))?;
    let version = match request.version {
        Some(0) => Version::HTTP_10,
        Some(1) => Version::HTTP_11,
        _ => return Err(HeadError::Malformed("unsupported HTTP version")),
    };
    // Header values are kept as slices of the head's own bytes: remember where each part
    // lies, then freeze the head once httparse no longer borrows the buffer.
    let base = buffer.as_ptr() as usize;
    let offset = |part: &[u8]| part.as_ptr() as usize - base;
    let target = request.path.ok_or(HeadError::Malformed("missing target"))?;
    let target_range = offset(target.as_bytes())..offset(target.as_bytes()) + target.len();
    let field_count = request.headers.len();
    let fields: Vec<(usize, usize, usize, usize)> = request
        .headers
        .iter()
        .map(|header| {
            let name = offset(header.name.as_bytes());
            let value = offset(header.value);
            (
                name,
                name + header.name.len(),
                value,
                value + header.value.len(),
            )
        })
        .collect();
    let head = buffer.split_to(head_length).freeze();

    let uri = match Uri::from_maybe_shared(head.slice(target_range.clone())) {
        Ok(uri) => uri,
        // A URI holds at most 65,534 bytes: a longer target is too long, not malformed
        // (the operator's `max_header_bytes` is the limit the client is told).
        Err(_) if target_range.len() >= usize::from(u16::MAX) => {
            return Err(HeadError::TargetTooLong {
                limit: max_head_bytes,
            })
        }
        Err(_) => lenient_target(&head[target_range])
            .ok_or(HeadError::Malformed("invalid request target"))?,
    };
    // Room for the fields levee adds on the way (forwarded-for, real IP, proto) without growing.
    let mut headers = HeaderMap::with_capacity(field_count + 4);
    let mut meaning = FieldMeaning::new();
    for &(name_start, name_end, value_start, value_end) in &fields {
        let name = HeaderName::from_bytes(&head[name_start..name_end])
            .map_err(|_| HeadError::Malformed("invalid header name"))?;
        let value = HeaderValue::from_maybe_shared(head.slice(value_start..value_end))
            .map_err(|_| HeadError::Malformed("invalid header value"))?;
        if meaning.read(&name, &value)? {
            headers.append(name, value);
        }
    }
    meaning
        .finish(method, uri, version, headers, head)
        .map(Some)
}

/// The refusal of a head of `size` bytes, over `limit`: the target's when the request line
/// alone is over it (the same whether the line is whole in `buffer` or still arriving).
fn too_large(buffer: &[u8], size: usize, limit: usize) -> HeadError {
    let line = buffer
        .iter()
        .position(|&byte| byte == b'\n')
        .unwrap_or(buffer.len());
    if line > limit {
        HeadError::TargetTooLong { limit }
    } else {
        HeadError::TooLarge { size, limit }
    }
}

/// What the framing- and connection-related fields of one head add up to.
struct FieldMeaning {
    content_length: Option<u64>,
    transfer_encoding: bool,
    /// Every `Transfer-Encoding` coding seen is `chunked`, and there is exactly one.
    chunked_codings: usize,
    other_codings: bool,
    close: bool,
    keep_alive: bool,
    expect_continue: bool,
    /// Routing reads one Host and the app may read another: two are refused (RFC 9112 3.2).
    host_seen: bool,
}

impl FieldMeaning {
    fn new() -> FieldMeaning {
        FieldMeaning {
            content_length: None,
            transfer_encoding: false,
            chunked_codings: 0,
            other_codings: false,
            close: false,
            keep_alive: false,
            expect_continue: false,
            host_seen: false,
        }
    }

    /// Takes note of one field; false when the field is a repeat to leave out.
    fn read(&mut self, name: &HeaderName, value: &HeaderValue) -> Result<bool, HeadError> {
        if *name == header::CONTENT_LENGTH {
            let length = parse_content_length(value.as_bytes())
                .ok_or(HeadError::Malformed("invalid Content-Length"))?;
            match self.content_length {
                Some(previous) if previous != length => {
                    return Err(HeadError::Malformed("conflicting Content-Length values"))
                }
                // The same length twice says nothing new; forward it once.
                Some(_) => return Ok(false),
                None => self.content_length = Some(length),
            }
        } else if *name == header::TRANSFER_ENCODING {
            self.transfer_encoding = true;
            for coding in list_items(value.as_bytes()) {
                if coding.eq_ignore_ascii_case(b"chunked") {
                    self.chunked_codings += 1;
                } else {
                    self.other_codings = true;
                }
            }
        } else if *name == header::CONNECTION {
            for option in list_items(value.as_bytes()) {
                if option.eq_ignore_ascii_case(b"close") {
                    self.close = true;
                } else if option.eq_ignore_ascii_case(b"keep-alive") {
                    self.keep_alive = true;
                }
            }
        } else if *name == header::EXPECT {
            // Any of its fields, as `proxy::expects_continue` reads them.
            self.expect_continue |= value.as_bytes().eq_ignore_ascii_case(b"100-continue");
        } else if *name == header::HOST {
            if self.host_seen {
                return Err(HeadError::Malformed("more than one Host field"));
            }
            // RFC 9112 3.2: an invalid Host is refused, not passed on. An app that builds its
            // links from the Host it is given would otherwise write `a@evil.example` or
            // `evil.example/x` into them.
            if !is_host(value.as_bytes()) {
                return Err(HeadError::Malformed("invalid Host field"));
            }
            self.host_seen = true;
        }
        Ok(true)
    }

    fn finish(
        self,
        method: Method,
        uri: Uri,
        version: Version,
        mut headers: HeaderMap,
        received: bytes::Bytes,
    ) -> Result<RequestHead, HeadError> {
        if version == Version::HTTP_11 && !self.host_seen {
            // RFC 9112 3.2: routes match on the host, and the app reads it; nginx refuses the
            // same request.
            return Err(HeadError::Malformed(
                "HTTP/1.1 request without a Host field",
            ));
        }
        if let Some(authority) = uri.authority() {
            // RFC 9112 3.2.2: with an absolute-form target, the host is the target's and the
            // Host field is ignored; a proxy passes the target's on as Host. Routes and the app
            // read Host, so both see the host the request is for.
            let host = authority.as_str();
            if host.contains('@') || !is_host(host.as_bytes()) {
                return Err(HeadError::Malformed(
                    "invalid authority in the request target",
                ));
            }
            let host = HeaderValue::from_str(host)
                .map_err(|_| HeadError::Malformed("invalid authority in the request target"))?;
            headers.insert(header::HOST, host);
        }
        let mut close_after = false;
        let framing = if self.transfer_encoding {
            if version == Version::HTTP_10 {
                return Err(HeadError::Malformed(
                    "Transfer-Encoding in an HTTP/1.0 request",
                ));
            }
            if self.other_codings || self.chunked_codings != 1 {
                return Err(HeadError::Malformed(
                    "unsupported Transfer-Encoding (only `chunked` is accepted)",
                ));
            }
            if self.content_length.is_some() {
                // RFC 9112 6.1: chunked wins, the length must not travel on, and the
                // connection is not reused after such a message.
                headers.remove(header::CONTENT_LENGTH);
                close_after = true;
            }
            BodyFraming::Chunked
        } else {
            match self.content_length {
                None | Some(0) => BodyFraming::Empty,
                Some(length) => BodyFraming::Length(length),
            }
        };
        let keep_alive = !self.close && (version == Version::HTTP_11 || self.keep_alive);
        let wants_upgrade =
            version == Version::HTTP_11 && super::super::header::is_upgrade(&headers);
        Ok(RequestHead {
            method,
            uri,
            version,
            headers,
            framing,
            keep_alive,
            expect_continue: self.expect_continue
                && version == Version::HTTP_11
                && framing != BodyFraming::Empty,
            wants_upgrade,
            close_after,
            received,
        })
    }
}

/// A Content-Length value: decimal digits only (no sign, no list), at most 19 of them.
pub(crate) fn parse_content_length(value: &[u8]) -> Option<u64> {
    if value.is_empty() || value.len() > 19 || !value.iter().all(u8::is_ascii_digit) {
        return None;
    }
    value.iter().try_fold(0u64, |length, digit| {
        length.checked_mul(10)?.checked_add(u64::from(digit - b'0'))
    })
}

/// Is `value` a Host field: `uri-host [ ":" port ]` (RFC 3986 3.2.2), that is a registered
/// name (or IPv4 address) of unreserved, percent-encoded and sub-delimiter bytes, or an IP
/// literal in brackets; then at most one `:` and the port's digits. Empty is valid (RFC 9112
/// 3.2). The shape matters, not only the bytes: nginx ends the host at the first colon
/// (`admin.example:1:2` is its `admin.example`), so a second colon would let a client reach a
/// host's site while levee matched none of that host's routes.
fn is_host(value: &[u8]) -> bool {
    let (name, port) = match value.first() {
        Some(b'[') => match value.iter().position(|&byte| byte == b']') {
            Some(end) => {
                let literal = &value[1..end];
                let literal_ok = !literal.is_empty()
                    && literal
                        .iter()
                        .all(|&byte| byte.is_ascii_hexdigit() || matches!(byte, b':' | b'.'));
                if !literal_ok {
                    return false;
                }
                (&value[..0], &value[end + 1..])
            }
            None => return false,
        },
        _ => match value.iter().position(|&byte| byte == b':') {
            Some(colon) => (&value[..colon], &value[colon..]),
            None => (value, &value[value.len()..]),
        },
    };
    let port_ok = match port.split_first() {
        None => true,
        Some((b':', digits)) => digits.iter().all(u8::is_ascii_digit),
        Some(_) => false,
    };
    port_ok && name.iter().all(|&byte| HOST_BYTES[usize::from(byte)])
}

/// RFC 3986's unreserved and sub-delimiter bytes, and the `%` of an escape: what a URI's
/// parts all allow.
const fn is_unreserved_or_sub_delim(b: u8) -> bool {
    crate::proxy::path::is_unreserved_or_sub_delim(b) || b == b'%'
}

/// The bytes [`is_host`] allows in a registered name, as a table: every request is checked,
/// byte by byte.
const HOST_BYTES: [bool; 256] = {
    let mut table = [false; 256];
    let mut byte = 0;
    while byte < 256 {
        let b = byte as u8;
        table[byte] = is_unreserved_or_sub_delim(b);
        byte += 1;
    }
    table
};

/// The non-empty items of a comma-separated field value, whitespace trimmed.
pub(crate) fn list_items(value: &[u8]) -> impl Iterator<Item = &[u8]> {
    value
        .split(|&byte| byte == b',')
        .map(|item| item.trim_ascii())
        .filter(|item| !item.is_empty())
}

fn describe(error: httparse::Error) -> &'static str {
    match error {
        httparse::Error::HeaderName => "invalid header name",
        httparse::Error::HeaderValue => "invalid header value",
        httparse::Error::NewLine => "invalid line end",
        httparse::Error::Status => "invalid status",
        httparse::Error::Token => "invalid method or request target",
        httparse::Error::TooManyHeaders => "too many header fields",
        httparse::Error::Version => "unsupported HTTP version",
    }
}

#[cfg(test)]
fn parse_all(raw: &[u8]) -> Result<Option<RequestHead>, HeadError> {
    let mut buffer = BytesMut::from(raw);
    parse_head(&mut buffer, 64 * 1024)
}

#[cfg(test)]
mod tests {
    use super::*;

    /// `raw`, with `Host: a` added after the request line of an HTTP/1.1 request without one.
    fn with_host(raw: &str) -> String {
        match raw.split_once("\r\n") {
            Some((line, rest))
                if line.ends_with("HTTP/1.1") && !rest.to_ascii_lowercase().contains("host:") =>
            {
                format!("{line}\r\nHost: a\r\n{rest}")
            }
            _ => raw.to_string(),
        }
    }

    fn head(raw: &str) -> RequestHead {
        let raw = with_host(raw);
        match parse_all(raw.as_bytes()) {
            Ok(Some(head)) => head,
            other => panic!("{raw:?} => {other:?}"),
        }
    }

    fn refused(raw: &str) -> HeadError {
        let raw = with_host(raw);
        match parse_all(raw.as_bytes()) {
            Err(error) => error,
            other => panic!("{raw:?} was accepted: {other:?}"),
        }
    }

    #[test]
    fn targets_with_bytes_a_uri_does_not_allow_raw_reach_the_app_encoded() {
        for (target, sent) in [
            ("/cb.php?d={\"a\":1}", "/cb.php?d=%7B%22a%22:1%7D"),
            ("/s.php?q=<b>&x=`y`", "/s.php?q=%3Cb%3E&x=%60y%60"),
            // What the URI parser takes stays as it came.
            ("/a|b^c\\d", "/a|b^c\\d"),
            ("/论坛/<x>", "/论坛/%3Cx%3E"),
            ("/a%20b?c=d+e&f[]=1", "/a%20b?c=d+e&f[]=1"),
        ] {
            assert_eq!(
                head(&format!("GET {target} HTTP/1.1\r\n\r\n")).uri,
                sent,
                "{target}"
            );
        }
        // Not a path: refused as before.
        assert!(matches!(
            refused("GET http://a/<b> HTTP/1.1\r\n\r\n"),
            HeadError::Malformed(_)
        ));
    }

    #[test]
    fn parses_a_head_at_every_split_and_leaves_what_follows() {
        let raw = b"POST /a?b=c HTTP/1.1\r\nHost: x\r\nContent-Length: 5\r\nX-Two: 1\r\nX-Two: 2\r\n\r\nhelloGET / HTTP/1.1\r\n";
        let head_length = raw.len() - b"helloGET / HTTP/1.1\r\n".len();
        for split in 0..raw.len() {
            let mut buffer = BytesMut::from(&raw[..split]);
            let first = parse_head(&mut buffer, 1024).expect("no error on a prefix");
            if split < head_length {
                assert!(first.is_none(), "complete at {split}");
                buffer.extend_from_slice(&raw[split..]);
                let head = parse_head(&mut buffer, 1024)
                    .expect("parses")
                    .expect("complete");
                assert_eq!(head.method, Method::POST);
                assert_eq!(head.uri, "/a?b=c");
                assert_eq!(head.framing, BodyFraming::Length(5));
                let twos: Vec<_> = head.headers.get_all("x-two").iter().collect();
                assert_eq!(twos, ["1", "2"]);
                assert_eq!(&buffer[..], b"helloGET / HTTP/1.1\r\n");
            } else {
                assert!(first.is_some(), "incomplete at {split}");
            }
        }
    }

    #[test]
    fn keep_alive_follows_the_version_and_connection_options() {
        assert!(head("GET / HTTP/1.1\r\n\r\n").keep_alive);
        assert!(!head("GET / HTTP/1.1\r\nConnection: close\r\n\r\n").keep_alive);
        assert!(!head("GET / HTTP/1.1\r\nConnection: x, Close\r\n\r\n").keep_alive);
        assert!(!head("GET / HTTP/1.0\r\n\r\n").keep_alive);
        assert!(head("GET / HTTP/1.0\r\nConnection: keep-alive\r\n\r\n").keep_alive);
        assert!(
            !head("GET / HTTP/1.0\r\nConnection: keep-alive\r\nConnection: close\r\n\r\n")
                .keep_alive
        );
    }

    #[test]
    fn framing_follows_rfc_9112() {
        assert_eq!(head("GET / HTTP/1.1\r\n\r\n").framing, BodyFraming::Empty);
        assert_eq!(
            head("POST / HTTP/1.1\r\nContent-Length: 0\r\n\r\n").framing,
            BodyFraming::Empty
        );
        let chunked = head("POST / HTTP/1.1\r\nTransfer-Encoding: Chunked\r\n\r\n");
        assert_eq!(chunked.framing, BodyFraming::Chunked);
        assert!(!chunked.close_after);
        // Both: chunked wins, the length is dropped, the connection closes afterwards.
        let both =
            head("POST / HTTP/1.1\r\nContent-Length: 6\r\nTransfer-Encoding: chunked\r\n\r\n");
        assert_eq!(both.framing, BodyFraming::Chunked);
        assert!(both.close_after);
        assert!(!both.headers.contains_key(header::CONTENT_LENGTH));
        // The same length twice is one length.
        let twice = head("POST / HTTP/1.1\r\nContent-Length: 3\r\nContent-Length: 3\r\n\r\n");
        assert_eq!(twice.framing, BodyFraming::Length(3));
        assert_eq!(
            twice.headers.get_all(header::CONTENT_LENGTH).iter().count(),
            1
        );
    }

    #[test]
    fn ambiguous_framing_is_refused() {
        for raw in [
            "POST / HTTP/1.1\r\nContent-Length: 5\r\nContent-Length: 40\r\n\r\n",
            "POST / HTTP/1.1\r\nContent-Length: +5\r\n\r\n",
            "POST / HTTP/1.1\r\nContent-Length: 5, 5\r\n\r\n",
            "POST / HTTP/1.1\r\nContent-Length: 99999999999999999999\r\n\r\n",
            "POST / HTTP/1.1\r\nTransfer-Encoding: xchunked\r\n\r\n",
            "POST / HTTP/1.1\r\nTransfer-Encoding: chunked, identity\r\n\r\n",
            "POST / HTTP/1.1\r\nTransfer-Encoding: gzip, chunked\r\n\r\n",
            "POST / HTTP/1.1\r\nTransfer-Encoding: chunked\r\nTransfer-Encoding: chunked\r\n\r\n",
            "POST / HTTP/1.1\r\nTransfer-Encoding: \r\n\r\n",
            "GET / HTTP/1.1\r\nHost: a\r\nHost: b\r\n\r\n",
            "POST / HTTP/1.0\r\nTransfer-Encoding: chunked\r\n\r\n",
        ] {
            assert!(matches!(refused(raw), HeadError::Malformed(_)), "{raw:?}");
        }
    }

    #[test]
    fn garbage_is_refused() {
        for raw in [
            "GARBAGE\r\n\r\n",
            "GET / HTTP/9.9\r\nHost: a\r\n\r\n",
            "GET / HTTP/1.1\r\nHost: a\r\nBad Header: x\r\n\r\n",
            "GET /\x01\x02 HTTP/1.1\r\nHost: a\r\n\r\n",
            "GET / HTTP/1.1\r\nX-User: a\rSet-Cookie: evil=1\r\n\r\n",
            "GET / HTTP/1.1\r\nX-User: a\x00b\r\n\r\n",
            "GET / HTTP/1.1\r\nX-User: a\x0bb\r\nX-Other: a\x00b\r\n\r\n",
            "GET / HTTP/1.1\r\nX-\x01User: ab\r\n\r\n",
            // Not as nginx reads a method: `post` would pass routes written for POST.
            "post / HTTP/1.1\r\nHost: a\r\nContent-Length: 0\r\n\r\n",
            "Get / HTTP/1.1\r\nHost: a\r\n\r\n",
            "GET1 / HTTP/1.1\r\nHost: a\r\n\r\n",
        ] {
            assert!(matches!(refused(raw), HeadError::Malformed(_)), "{raw:?}");
        }
        // Extension methods in capitals pass.
        assert_eq!(
            head("VERSION-CONTROL / HTTP/1.1\r\nHost: a\r\n\r\n")
                .method
                .as_str(),
            "VERSION-CONTROL"
        );
    }

    #[test]
    fn other_control_bytes_in_values_are_read_as_spaces() {
        let parsed = head("GET /p HTTP/1.1\r\nHost: a\r\nUser-Agent: bot\x01\x1f/1\x7f\r\nX-Tab: a\tb\x0c\r\n\r\n");
        assert_eq!(parsed.headers["user-agent"], "bot  /1");
        assert_eq!(parsed.headers["x-tab"], "a\tb");
        assert_eq!(parsed.headers["host"], "a");
        // The body after the head is not touched, and a head that arrives in pieces is read
        // the same.
        let raw = b"POST /p HTTP/1.1\r\nHost: a\r\nX-A: \x01\r\nContent-Length: 2\r\n\r\n\x01\x02";
        for split in 1..raw.len() {
            let mut buffer = BytesMut::from(&raw[..split]);
            let mut parsed = parse_head(&mut buffer, 8192).expect("readable");
            buffer.extend_from_slice(&raw[split..]);
            if parsed.is_none() {
                parsed = parse_head(&mut buffer, 8192).expect("readable");
            }
            let parsed = parsed.expect("whole");
            assert_eq!(parsed.headers["x-a"], "", "split at {split}");
            assert_eq!(&buffer[..], b"\x01\x02", "split at {split}");
        }
    }

    #[test]
    fn host_values_are_checked() {
        for host in [
            "example.com",
            "example.com:8080",
            "[::1]:8080",
            "127.0.0.1",
            "my_host.example",
            "xn--caf-dma.example",
            "",
            "example.com:",
            "[::1]",
            "[::ffff:127.0.0.1]:80",
        ] {
            let raw = format!("GET / HTTP/1.1\r\nHost: {host}\r\n\r\n");
            assert_eq!(head(&raw).headers["host"], host, "{host:?}");
        }
        for host in [
            "a@evil.example",
            "evil.example/x",
            "a b",
            "a\tb",
            "evil.example?x",
            "evil.example#x",
            "a\\b",
            "caf\u{e9}.example",
            // nginx serves `admin.example`'s site for these (the host ends at the first colon):
            // levee must not see another host.
            "admin.example:1:2",
            "admin.example:80:",
            "admin.example:8x",
            "[::1]x",
            "[::1]:80:1",
            "[::1",
            "[]",
            "[evil.example]",
            "a]b",
            "a[b",
        ] {
            let raw = format!("GET / HTTP/1.1\r\nHost: {host}\r\n\r\n");
            assert_eq!(
                refused(&raw),
                HeadError::Malformed("invalid Host field"),
                "{host:?}"
            );
        }
    }

    #[test]
    fn an_absolute_form_target_names_the_host() {
        let absolute = head("GET http://b.example:8080/x?y HTTP/1.1\r\nHost: a\r\n\r\n");
        assert_eq!(absolute.headers["host"], "b.example:8080");
        assert_eq!(absolute.headers.get_all("host").iter().count(), 1);
        assert_eq!(absolute.uri.path(), "/x");
        assert_eq!(
            refused("GET http://a@b.example/ HTTP/1.1\r\nHost: b.example\r\n\r\n"),
            HeadError::Malformed("invalid authority in the request target")
        );
        // An HTTP/1.1 request still needs its Host field (RFC 9112 3.2).
        assert!(matches!(
            parse_all(b"GET http://b/ HTTP/1.1\r\n\r\n"),
            Err(HeadError::Malformed(_))
        ));
        // HTTP/1.0 may send none: the target's host is the request's.
        let old = parse_all(b"GET http://b/ HTTP/1.0\r\n\r\n")
            .expect("accepted")
            .expect("complete");
        assert_eq!(old.headers["host"], "b");
    }

    #[test]
    fn limits_head_size_and_field_count() {
        let mut buffer =
            BytesMut::from(&b"GET / HTTP/1.1\r\nX-Long: aaaaaaaaaaaaaaaaaaaaaaaaaaaaaa"[..]);
        assert!(matches!(
            parse_head(&mut buffer, 32),
            Err(HeadError::TooLarge { limit: 32, .. })
        ));
        let mut buffer =
            BytesMut::from(&b"GET / HTTP/1.1\r\nX-Long: aaaaaaaaaaaaaaaaaaaa\r\n\r\n"[..]);
        assert!(matches!(
            parse_head(&mut buffer, 32),
            Err(HeadError::TooLarge { limit: 32, .. })
        ));
        // A target over the 65,534 bytes a URI holds, within the head's bound: too long too
        // (it was a 400 "invalid request target").
        let huge = format!("GET /{} HTTP/1.1\r\nHost: a\r\n\r\n", "a".repeat(66_000));
        let mut buffer = BytesMut::from(huge.as_bytes());
        assert_eq!(
            parse_head(&mut buffer, 1 << 20).map(|_| ()),
            Err(HeadError::TargetTooLong { limit: 1 << 20 }),
        );
        // A request line over the limit is the target's fault, whole or still arriving.
        let long_line = format!("GET /{} HTTP/1.1\r\nHost: a\r\n\r\n", "a".repeat(40));
        for end in [long_line.len(), 36] {
            let mut buffer = BytesMut::from(&long_line.as_bytes()[..end]);
            assert_eq!(
                parse_head(&mut buffer, 32).map(|_| ()),
                Err(HeadError::TargetTooLong { limit: 32 }),
                "{end} bytes"
            );
        }
        let mut flood = String::from("GET / HTTP/1.1\r\n");
        for i in 0..=MAX_HEADERS {
            flood.push_str(&format!("X-{i}: y\r\n"));
        }
        flood.push_str("\r\n");
        assert_eq!(
            refused(&flood),
            HeadError::TooManyHeaders { limit: MAX_HEADERS }
        );
    }

    #[test]
    fn expect_and_upgrade_are_recognised() {
        let expecting =
            head("POST / HTTP/1.1\r\nExpect: 100-Continue\r\nContent-Length: 3\r\n\r\n");
        assert!(expecting.expect_continue);
        // In any of its fields, whatever comes after it.
        let two = head(
            "POST / HTTP/1.1\r\nExpect: 100-continue\r\nExpect: x\r\nContent-Length: 3\r\n\r\n",
        );
        assert!(two.expect_continue);
        // Nothing to continue with when there is no body.
        assert!(!head("GET / HTTP/1.1\r\nExpect: 100-continue\r\n\r\n").expect_continue);
        assert!(
            head("GET / HTTP/1.1\r\nConnection: Upgrade\r\nUpgrade: websocket\r\n\r\n")
                .wants_upgrade
        );
        assert!(!head("GET / HTTP/1.1\r\nUpgrade: websocket\r\n\r\n").wants_upgrade);
        // Only WebSocket: a tunnel of another protocol would carry requests past the routes.
        for offered in [
            "h2c",
            "websocket, h2c",
            "h2c\r\nUpgrade: websocket",
            "",
            "tls/1.2",
        ] {
            let raw =
                format!("GET / HTTP/1.1\r\nConnection: Upgrade\r\nUpgrade: {offered}\r\n\r\n");
            assert!(!head(&raw).wants_upgrade, "{offered}");
        }
        assert!(
            head("GET / HTTP/1.1\r\nConnection: keep-alive, Upgrade\r\nUpgrade: WebSocket\r\n\r\n")
                .wants_upgrade
        );
        assert!(
            !head("GET / HTTP/1.0\r\nConnection: Upgrade\r\nUpgrade: websocket\r\n\r\n")
                .wants_upgrade
        );
    }

    #[test]
    fn an_http_1_1_request_needs_its_host() {
        for raw in [
            "GET / HTTP/1.1\r\n\r\n",
            "GET http://a/ HTTP/1.1\r\nX: y\r\n\r\n",
        ] {
            assert!(
                matches!(
                    parse_all(raw.as_bytes()),
                    Err(HeadError::Malformed(
                        "HTTP/1.1 request without a Host field"
                    ))
                ),
                "{raw:?}"
            );
        }
        // HTTP/1.0 had no Host.
        assert!(matches!(parse_all(b"GET / HTTP/1.0\r\n\r\n"), Ok(Some(_))));
    }

    #[test]
    fn raw_utf8_targets_pass_and_other_bytes_are_percent_encoded() {
        // Raw UTF-8 in a target is passed on as sent, as nginx and PHP take it (see
        // tests/hostile.rs); bytes that are not UTF-8 (Latin-1) are percent-encoded, which the
        // app decodes to the same bytes.
        let head = parse_all(b"GET /caf\xc3\xa9 HTTP/1.1\r\nHost: a\r\n\r\n")
            .expect("accepted")
            .expect("complete");
        assert_eq!(head.uri.path().as_bytes(), b"/caf\xc3\xa9");
        let mut buffer = BytesMut::from(
            &b"\r\nGET /caf\xe9?q=\xe9t\xe9&r={} HTTP/1.1\r\nHost: a\r\n\r\nnext"[..],
        );
        let head = parse_head(&mut buffer, 1024)
            .expect("accepted")
            .expect("complete");
        assert_eq!(head.uri.path(), "/caf%E9");
        assert_eq!(head.uri.query(), Some("q=%E9t%E9&r={}"));
        assert_eq!(&buffer[..], b"next", "what follows the head stays");
        // A head not complete yet is waited for with its bytes as they came.
        let partial = &b"GET /caf\xe9 HTTP/1.1\r\nHo"[..];
        let mut buffer = BytesMut::from(partial);
        assert!(matches!(parse_head(&mut buffer, 1024), Ok(None)));
        assert_eq!(&buffer[..], partial);
        buffer.extend_from_slice(b"st: a\r\n\r\n");
        let head = parse_head(&mut buffer, 1024)
            .expect("accepted")
            .expect("complete");
        assert_eq!(head.uri.path(), "/caf%E9");
        assert!(buffer.is_empty());
        // With bytes a URI does not allow raw too, each is escaped once.
        let head = parse_all(b"GET /s.php?q=caf\xe9&d=\"<%20> HTTP/1.1\r\nHost: a\r\n\r\n")
            .expect("accepted")
            .expect("complete");
        assert_eq!(head.uri.query(), Some("q=caf%E9&d=%22%3C%20%3E"));
        // Control bytes and a method that is not one stay refused.
        for refused in [
            &b"GET /\xe9\x01 HTTP/1.1\r\nHost: a\r\n\r\n"[..],
            b"G\xe9T /\xe9 HTTP/1.1\r\nHost: a\r\n\r\n",
        ] {
            assert!(
                matches!(parse_all(refused), Err(HeadError::Malformed(_))),
                "{refused:?}"
            );
        }
    }
}
