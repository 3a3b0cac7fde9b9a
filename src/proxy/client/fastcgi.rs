//! FastCGI upstreams: php-fpm spoken to directly, without an nginx vhost in between.
//!
//! The request is first encoded as the HTTP/1.1 head an `http://` upstream would get (the
//! same forwarding fields, the same `Host`), then that head becomes the CGI parameters
//! nginx's `fastcgi_params` would give PHP: `$_SERVER` holds what it held behind nginx. The
//! script to run is found from the path as nginx's usual `location ~ \.php$` block finds it.
//!
//! One request at a time per connection (request id 1), kept open for the next one
//! (`FCGI_KEEP_CONN`) and pooled like an HTTP connection. The response's CGI head is read
//! from the first `STDOUT` records; the rest of them are the body, read as the caller polls
//! it, up to the request's `END_REQUEST`. What the script writes to `STDERR` (PHP's warnings,
//! `error_log()`) is logged, as nginx does.

use std::future::Future as _;
use std::io;
use std::sync::Arc;
use std::task::Poll;
use std::time::Duration;

use bytes::{Buf, BufMut, Bytes, BytesMut};
use http::header::{self, HeaderMap, HeaderName, HeaderValue};
use http::{Method, Request, Response, StatusCode, Version};
use http_body::Body as _;
use tokio::io::{AsyncReadExt, AsyncWrite};
use tokio::time::Instant;

use super::{
    encode_request_head, is_idempotent, parse_content_length, Answered, Client, ClientError,
    Connection, Framing, Incoming, HEAD_READ_SIZE, MAX_HEAD_BYTES,
};
use crate::error::BoxError;
use crate::log_throttle::LogThrottle;
use crate::proxy::body::ResendableBody;
use crate::proxy::header::{FromClient, ReceivedHead, HOP_BY_HOP};
use crate::proxy::upstream::UpstreamBody;

const VERSION_1: u8 = 1;
const BEGIN_REQUEST: u8 = 1;
const END_REQUEST: u8 = 3;
const PARAMS: u8 = 4;
const STDIN: u8 = 5;
const STDOUT: u8 = 6;
const STDERR: u8 = 7;
const RESPONDER: u16 = 1;
/// Keep the connection open after the request (for the pool).
const KEEP_CONN: u8 = 1;
/// The one request a connection carries at a time.
const REQUEST_ID: u16 = 1;
/// A record's content is at most this long (its length is 16 bits).
const MAX_CONTENT: usize = 65_535;
/// What the script wrote to `STDERR`, logged at most once a second per process: a page that
/// warns on every request must not drown the log.
static STDERR_LOG: LogThrottle = LogThrottle::new(Duration::from_secs(1));
/// Longest part of one `STDERR` write that is logged.
const STDERR_LOGGED: usize = 1024;
/// Scripts that wrote more than their own `Content-Length`: at most one line a minute.
static OVERRUN_LOG: LogThrottle = LogThrottle::new(Duration::from_secs(60));

/// How an upstream's requests become CGI requests (`fastcgi = { … }` in the policy).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct FastCgiSettings {
    /// `DOCUMENT_ROOT`, without a trailing slash: scripts are looked for under it, on
    /// php-fpm's machine.
    pub root: String,
    /// Run for a path that ends in `/`. Default `index.php`.
    pub index: String,
    /// Run for every path that names no `.php` script, when set (a framework's
    /// `index.php`, as nginx's `try_files $uri /index.php?$args`).
    pub front_controller: Option<String>,
    /// Parameters set in the policy, given after levee's own (so they win in `$_SERVER`).
    pub params: Vec<(String, String)>,
    /// Where a request body over 1 MiB is kept while it is read whole (see `proxy::spool`).
    /// Default the system's temporary directory.
    pub temp_dir: std::path::PathBuf,
}

/// Why a request cannot be put to php-fpm: the client's doing, answered without asking it.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum Unsendable {
    /// A NUL byte would cut `SCRIPT_FILENAME` short (`/a.php%00.jpg`).
    #[error("a NUL byte in the path cannot name a PHP script")]
    NulInPath,
    /// Not a `.php` script, and no front controller to run instead: nginx's usual
    /// `location ~ \.php$` would not have passed it to php-fpm either.
    #[error("`{0}` names no PHP script")]
    NoScript(String),
    /// A file that is no script, under `root` where levee can see it (`/robots.txt`, an
    /// upload): nginx's `try_files $uri` served it from disk, and the front controller would
    /// answer its own page in its place. levee serves no files: the front should have.
    #[error("`{0}` is a file, which levee does not serve")]
    StaticFile(String),
    /// A directory named without its trailing slash (`/forum/admin`, whose `index.php` is
    /// there): nginx answers 301 to the path with the slash (`try_files $uri/`, or its static
    /// module), whose relative links then resolve. The path to move to, query and all.
    #[error("`{0}` is a directory: its page is at the path with a `/`")]
    Directory(String),
    /// One parameter longer than a FastCGI record can carry (64 KiB); nginx refuses these too.
    #[error("the request's {name} is {size} bytes; FastCGI carries at most {limit}")]
    TooLong {
        name: String,
        size: usize,
        limit: usize,
        /// From the request target (a path or query), not a header field.
        in_target: bool,
    },
}

/// The script a path runs: (`SCRIPT_NAME`, `PATH_INFO`).
///
/// The path is percent-decoded and its dot segments resolved, never above the root, as nginx
/// does to `$uri`: `SCRIPT_FILENAME` stays under `root` whatever the client writes.
/// `is_file(script)` says whether `root` + `script` is a file where levee can see it: with a
/// front controller, a directory's own index runs only when it exists (`try_files $uri/`).
fn script_of(
    path: &str,
    settings: &FastCgiSettings,
    is_file: &dyn Fn(&[u8]) -> bool,
) -> Result<(Vec<u8>, Vec<u8>), Unsendable> {
    let decoded = percent_decode(path.as_bytes());
    if decoded.contains(&0) {
        return Err(Unsendable::NulInPath);
    }
    let mut segments: Vec<&[u8]> = Vec::new();
    let last = decoded.rsplit(|byte| *byte == b'/').next().unwrap_or(b"");
    let trailing_slash = matches!(last, b"" | b"." | b"..");
    for segment in decoded.split(|byte| *byte == b'/') {
        match segment {
            b"" | b"." => {}
            b".." => {
                segments.pop();
            }
            other => segments.push(other),
        }
    }
    let join = |segments: &[&[u8]]| {
        let mut out = Vec::with_capacity(decoded.len() + 1);
        for segment in segments {
            out.push(b'/');
            out.extend_from_slice(segment);
        }
        out
    };
    if let Some(script_end) = segments
        .iter()
        .position(|segment| segment.ends_with(b".php"))
    {
        let script = join(&segments[..=script_end]);
        let mut info = join(&segments[script_end + 1..]);
        if trailing_slash {
            info.push(b'/');
        }
        return Ok((script, info));
    }
    let front = settings.front_controller.as_ref();
    if !trailing_slash && !segments.is_empty() {
        // Running the index here instead would also pass it by the routes written for the
        // directory's own path (`/forum/admin/`).
        let mut index = join(&segments);
        index.push(b'/');
        index.extend_from_slice(settings.index.as_bytes());
        if is_file(&index) {
            // To the path as it was resolved, not as it was written: `//evil.example/../dir`
            // or `/\evil.example/../dir` sent back as written is a Location a browser reads
            // as another site (an open redirect on the site's own name).
            let resolved = crate::proxy::path::normalise(path)
                .map(|normal| normal.into_owned())
                .unwrap_or_else(|_| String::from_utf8_lossy(&join(&segments)).into_owned());
            return Err(Unsendable::Directory(format!(
                "{}/",
                resolved.replace('\\', "%5C")
            )));
        }
    }
    if trailing_slash || segments.is_empty() {
        let mut index = join(&segments);
        index.push(b'/');
        index.extend_from_slice(settings.index.as_bytes());
        // (No look at the disk when the index is the front controller itself: `/` with
        // `/index.php`, the most common request of all.)
        if front.is_none_or(|front| front.as_bytes() == index.as_slice()) || is_file(&index) {
            return Ok((index, Vec::new()));
        }
    }
    match front {
        // (Only what a front controller would answer in a file's place is looked for on disk:
        // without one, such a path is refused anyway.)
        Some(_) if !trailing_slash && !segments.is_empty() && is_file(&join(&segments)) => {
            Err(Unsendable::StaticFile(
                crate::printable::printable(&String::from_utf8_lossy(&join(&segments)))
                    .into_owned(),
            ))
        }
        Some(front) => Ok((front.as_bytes().to_vec(), Vec::new())),
        // (Said in the log and the answer: a decoded `%0A` would forge a log line.)
        None => Err(Unsendable::NoScript(
            crate::printable::printable(&String::from_utf8_lossy(&join(&segments))).into_owned(),
        )),
    }
}

/// Every `%XX` decoded (a bad escape is kept as it is: routing refused those already).
fn percent_decode(bytes: &[u8]) -> Vec<u8> {
    let hex = |byte: u8| (byte as char).to_digit(16).map(|digit| digit as u8);
    let mut out = Vec::with_capacity(bytes.len());
    let mut at = 0;
    while at < bytes.len() {
        if bytes[at] == b'%' {
            if let (Some(high), Some(low)) = (
                bytes.get(at + 1).copied().and_then(hex),
                bytes.get(at + 2).copied().and_then(hex),
            ) {
                out.push(high << 4 | low);
                at += 3;
                continue;
            }
        }
        out.push(bytes[at]);
        at += 1;
    }
    out
}

/// FastCGI name-value pairs, in the order written.
#[derive(Default)]
struct Params {
    bytes: BytesMut,
    /// Where each pair ends in `bytes`: a record carries whole pairs only (php-fpm parses
    /// each `PARAMS` record on its own, and drops the connection on a pair cut in two).
    ends: Vec<usize>,
    /// The first pair too long for any record: its name and size.
    too_long: Option<(String, usize)>,
}

impl Params {
    fn add(&mut self, name: &[u8], value: &[u8]) {
        let start = self.bytes.len();
        for length in [name.len(), value.len()] {
            // Lengths under 128 take one byte; longer ones four, with the top bit set.
            match u8::try_from(length) {
                Ok(short) if short < 0x80 => self.bytes.put_u8(short),
                // (Over 2^31 a pair is far too long for a record: refused below.)
                _ => self
                    .bytes
                    .put_u32(u32::try_from(length).unwrap_or(u32::MAX >> 1) | 0x8000_0000),
            }
        }
        self.bytes.put_slice(name);
        self.bytes.put_slice(value);
        let size = self.bytes.len() - start;
        if size > MAX_CONTENT && self.too_long.is_none() {
            self.too_long = Some((String::from_utf8_lossy(name).into_owned(), size));
        }
        self.ends.push(self.bytes.len());
    }

    /// The pairs as `PARAMS` records, each holding as many whole pairs as fit.
    fn put_records(&self, out: &mut BytesMut) {
        let mut start = 0;
        let mut last_end = 0;
        for &end in &self.ends {
            if end - start > MAX_CONTENT {
                put_stream(out, PARAMS, &self.bytes[start..last_end]);
                start = last_end;
            }
            last_end = end;
        }
        put_stream(out, PARAMS, &self.bytes[start..last_end]);
    }
}

/// `HTTP_` and the field's name in upper case with `_` for `-`; `None` for a name with
/// anything but letters, digits and `-`: PHP reads `_`, `.` and a space alike as `_`, so
/// `X_Real_IP` or `X.Real.IP` would pass for levee's `X-Real-IP` (nginx drops such names
/// too), and for `Proxy` (which PHP would read as `HTTP_PROXY`, its outgoing proxy:
/// "httpoxy").
fn cgi_name(name: &[u8]) -> Option<Vec<u8>> {
    let plain = name
        .iter()
        .all(|byte| byte.is_ascii_alphanumeric() || *byte == b'-');
    if !plain || name.eq_ignore_ascii_case(b"proxy") {
        return None;
    }
    let mut out = Vec::with_capacity(name.len() + 5);
    out.extend_from_slice(b"HTTP_");
    out.extend(name.iter().map(|byte| match byte {
        b'-' => b'_',
        other => other.to_ascii_uppercase(),
    }));
    Some(out)
}

/// Whether `root` + `script` is a file levee can see.
fn is_file_under(root: &str, script: &[u8]) -> bool {
    use std::os::unix::ffi::OsStrExt as _;
    let mut path = Vec::with_capacity(root.len() + script.len());
    path.extend_from_slice(root.as_bytes());
    path.extend_from_slice(script);
    std::fs::metadata(std::ffi::OsStr::from_bytes(&path)).is_ok_and(|found| found.is_file())
}

/// The records that open a request: `BEGIN_REQUEST`, the parameters from the HTTP head
/// `head` (as `encode_request_head` wrote it), and the end of the parameters; with the end of
/// `STDIN` too when the request has no body. `version`: the client's, which the head (always
/// written as HTTP/1.1) does not keep; a script answering `$_SERVER['SERVER_PROTOCOL'] . " 404"`
/// or serving HTTP/1.0 clients otherwise reads it, as it did behind nginx. `client_named_host`:
/// whether the head's `Host` is the request's own (or the upstream's `host`), not the
/// upstream's address written for a client that named none.
fn encode_begin(
    head: &[u8],
    (version, client_named_host): (http::Version, bool),
    settings: &FastCgiSettings,
    (script, info): (&[u8], &[u8]),
    has_body: bool,
    keep_connection: bool,
) -> Result<BytesMut, ClientError> {
    let mut fields = [httparse::EMPTY_HEADER; super::MAX_HEADERS];
    let mut parsed = httparse::Request::new(&mut fields);
    match parsed.parse(head) {
        Ok(httparse::Status::Complete(_)) => {}
        // levee wrote this head itself, from fields it had already checked.
        _ => {
            return Err(ClientError::Protocol(
                "the request head could not be re-read".into(),
            ))
        }
    }
    let method = parsed.method.unwrap_or("GET");
    let target = parsed.path.unwrap_or("/");
    let query = target.split_once('?').map_or("", |(_, query)| query);

    let mut params = Params::default();
    // Fields first, joined by name (PHP keeps only the last of two equal parameters).
    let mut http_fields: Vec<(Vec<u8>, Vec<u8>)> = Vec::with_capacity(parsed.headers.len());
    let (mut host, mut https) = (None, false);
    let (mut length, mut content_type) = (None, None);
    // The client's address as levee resolved it (a replayed job carries the one it had).
    let real_ip = parsed
        .headers
        .iter()
        .find(|field| field.name.eq_ignore_ascii_case("x-real-ip"))
        .map(|field| field.value);
    for field in parsed.headers.iter() {
        let name = field.name.as_bytes();
        let value = field.value;
        // Also passed on as HTTP_CONTENT_LENGTH and HTTP_CONTENT_TYPE below, as nginx does.
        if name.eq_ignore_ascii_case(b"content-length") {
            length = Some(value);
        } else if name.eq_ignore_ascii_case(b"content-type") {
            // The first of two, as nginx passes it: PHP parses the body by this one.
            content_type = content_type.or(Some(value));
        } else if name.eq_ignore_ascii_case(b"transfer-encoding") {
            continue;
        }
        if name.eq_ignore_ascii_case(b"host") {
            host = Some(value);
            // Written by levee for the upstream (its address): the client named none, and
            // PHP is told none, as behind nginx; links built from it would name php-fpm.
            if !client_named_host {
                continue;
            }
        } else if name.eq_ignore_ascii_case(b"x-forwarded-proto") {
            https = value.trim_ascii().eq_ignore_ascii_case(b"https");
        } else if real_ip.is_some() && name.eq_ignore_ascii_case(b"x-forwarded-for") {
            // REMOTE_ADDR is the client already: given the chain too, an app that trusts
            // whoever REMOTE_ADDR is as its proxy (Laravel's and Symfony's `'*'`, common
            // behind a front nginx) strips the client from the chain's end and takes the
            // entry before it, which the client wrote. The client alone instead: the app
            // finds the same address whatever it trusts.
            continue;
        }
        let Some(cgi) = cgi_name(name) else {
            continue;
        };
        match http_fields.iter_mut().find(|(known, _)| *known == cgi) {
            Some((_, joined)) => {
                let separator: &[u8] = if name.eq_ignore_ascii_case(b"cookie") {
                    b"; "
                } else {
                    b", "
                };
                joined.extend_from_slice(separator);
                joined.extend_from_slice(value);
            }
            None => http_fields.push((cgi, value.to_vec())),
        }
    }
    for (name, value) in &http_fields {
        params.add(name, value);
    }
    if let Some(address) = real_ip {
        params.add(b"HTTP_X_FORWARDED_FOR", address);
    }
    // Always set, empty when the request has none, as nginx's fastcgi_params do: a script
    // that reads $_SERVER['CONTENT_TYPE'] unguarded gets no warning.
    params.add(b"CONTENT_LENGTH", length.unwrap_or_default());
    params.add(b"CONTENT_TYPE", content_type.unwrap_or_default());
    params.add(b"GATEWAY_INTERFACE", b"CGI/1.1");
    // "nginx" in it: apps ask it what rewrites the server does, and levee runs PHP as
    // nginx's fastcgi_params and try_files do. WordPress finds no URL rewriting without it
    // ($is_nginx), and offers `/index.php/…` permalinks that would change every post's URL.
    params.add(
        b"SERVER_SOFTWARE",
        concat!("levee/", env!("CARGO_PKG_VERSION"), " (nginx-compatible)").as_bytes(),
    );
    let protocol: &[u8] = if version == http::Version::HTTP_10 {
        b"HTTP/1.0"
    } else {
        b"HTTP/1.1"
    };
    params.add(b"SERVER_PROTOCOL", protocol);
    params.add(b"REQUEST_METHOD", method.as_bytes());
    params.add(b"REQUEST_URI", target.as_bytes());
    params.add(b"QUERY_STRING", query.as_bytes());
    // (`root = "/"` is kept as "" to prefix script names with.)
    let document_root: &[u8] = match settings.root.as_bytes() {
        b"" => b"/",
        root => root,
    };
    params.add(b"DOCUMENT_ROOT", document_root);
    params.add(b"SCRIPT_NAME", script);
    let mut filename = Vec::with_capacity(settings.root.len() + script.len());
    filename.extend_from_slice(settings.root.as_bytes());
    filename.extend_from_slice(script);
    params.add(b"SCRIPT_FILENAME", &filename);
    // The script, as nginx's `try_files $fastcgi_script_name` (Debian's fastcgi-php.conf)
    // leaves `$document_uri`.
    params.add(b"DOCUMENT_URI", script);
    if !info.is_empty() {
        params.add(b"PATH_INFO", info);
    }
    // A PHP built with `cgi.force_redirect` runs nothing without it; nginx's params set it.
    params.add(b"REDIRECT_STATUS", b"200");
    // The name the request came for (the upstream's `host` when the policy sets one); the
    // port is the scheme's, not one a client could write into `Host`.
    if let Some(host) = host {
        params.add(b"SERVER_NAME", split_host(host));
    }
    params.add(b"SERVER_PORT", if https { b"443" } else { b"80" });
    if https {
        params.add(b"HTTPS", b"on");
        params.add(b"REQUEST_SCHEME", b"https");
    } else {
        params.add(b"REQUEST_SCHEME", b"http");
    }
    if let Some(address) = real_ip {
        params.add(b"REMOTE_ADDR", address);
    }
    for (name, value) in &settings.params {
        params.add(name.as_bytes(), value.as_bytes());
    }
    if let Some((name, size)) = params.too_long.take() {
        let in_target = matches!(
            name.as_str(),
            "REQUEST_URI"
                | "QUERY_STRING"
                | "SCRIPT_NAME"
                | "SCRIPT_FILENAME"
                | "DOCUMENT_URI"
                | "PATH_INFO"
        );
        return Err(Unsendable::TooLong {
            name,
            size,
            limit: MAX_CONTENT,
            in_target,
        }
        .into());
    }

    let mut out = BytesMut::with_capacity(params.bytes.len() + 64);
    put_record_header(&mut out, BEGIN_REQUEST, 8);
    out.put_u16(RESPONDER);
    out.put_u8(if keep_connection { KEEP_CONN } else { 0 });
    out.put_slice(&[0; 5]);
    params.put_records(&mut out);
    put_record_header(&mut out, PARAMS, 0);
    if !has_body {
        put_record_header(&mut out, STDIN, 0);
    }
    Ok(out)
}

/// The host of `host[:port]`; an IPv6 literal keeps its brackets.
fn split_host(host: &[u8]) -> &[u8] {
    let host = host.trim_ascii();
    match host.iter().rposition(|byte| *byte == b':') {
        Some(colon) if !host[colon..].contains(&b']') => &host[..colon],
        _ => host,
    }
}

fn put_record_header(out: &mut BytesMut, kind: u8, length: u16) {
    out.put_u8(VERSION_1);
    out.put_u8(kind);
    out.put_u16(REQUEST_ID);
    out.put_u16(length);
    out.put_u8(0); // no padding
    out.put_u8(0);
}

/// `data` as records of `kind` (not the empty one that ends the stream).
fn put_stream(out: &mut BytesMut, kind: u8, data: &[u8]) {
    for piece in data.chunks(MAX_CONTENT) {
        put_record_header(out, kind, piece.len() as u16);
        out.put_slice(piece);
    }
}

/// What the next record in the buffer holds.
#[derive(Debug)]
enum Step {
    Stdout(Bytes),
    Stderr(Bytes),
    /// The request is over; php-fpm keeps the connection for the next one.
    End,
    /// The buffer holds no more of a record: read more.
    NeedMore,
}

/// Where the reader is in the stream of records: inside a record's content (handed out as it
/// arrives, not when the record is whole) or its padding, or between records.
#[derive(Debug, Default)]
pub(super) struct RecordReader {
    kind: u8,
    content_left: usize,
    padding_left: usize,
}

impl RecordReader {
    fn next(&mut self, buffer: &mut BytesMut) -> Result<Step, ClientError> {
        loop {
            if self.content_left > 0 {
                if buffer.is_empty() {
                    return Ok(Step::NeedMore);
                }
                let take = self.content_left.min(buffer.len());
                self.content_left -= take;
                let piece = buffer.split_to(take).freeze();
                match self.kind {
                    STDOUT => return Ok(Step::Stdout(piece)),
                    STDERR => return Ok(Step::Stderr(piece)),
                    _ => continue, // a record type levee does not use: skipped
                }
            }
            if self.padding_left > 0 {
                let skip = self.padding_left.min(buffer.len());
                buffer.advance(skip);
                self.padding_left -= skip;
                if self.padding_left > 0 {
                    return Ok(Step::NeedMore);
                }
            }
            if buffer.len() < 8 {
                return Ok(Step::NeedMore);
            }
            if buffer[0] != VERSION_1 {
                return Err(ClientError::Protocol(format!(
                    "FastCGI record of version {} (not 1): is this upstream php-fpm?",
                    buffer[0]
                )));
            }
            let kind = buffer[1];
            // 0 is for management records, which php-fpm sends only when asked (and which are
            // skipped); a request's output or end under it is no answer to levee's request.
            let request_id = u16::from_be_bytes([buffer[2], buffer[3]]);
            let management = request_id == 0 && !matches!(kind, STDOUT | STDERR | END_REQUEST);
            if request_id != REQUEST_ID && !management {
                return Err(ClientError::Protocol(format!(
                    "FastCGI record for request {request_id}, not the one sent"
                )));
            }
            let content = usize::from(u16::from_be_bytes([buffer[4], buffer[5]]));
            let padding = usize::from(buffer[6]);
            if kind == END_REQUEST {
                if buffer.len() < 8 + content + padding {
                    return Ok(Step::NeedMore);
                }
                let protocol_status = if content >= 5 { buffer[8 + 4] } else { 0 };
                buffer.advance(8 + content + padding);
                return match protocol_status {
                    0 => Ok(Step::End),
                    1 => Err(ClientError::Protocol(
                        "php-fpm cannot take two requests on one connection".into(),
                    )),
                    2 => Err(ClientError::Protocol(
                        "php-fpm is overloaded and refused the request".into(),
                    )),
                    _ => Err(ClientError::Protocol(
                        "php-fpm does not know the responder role".into(),
                    )),
                };
            }
            buffer.advance(8);
            self.kind = kind;
            self.content_left = content;
            self.padding_left = padding;
        }
    }
}

/// Logs what a script wrote to `STDERR` (throttled; see [`STDERR_LOG`]), on one line: PHP's
/// messages carry visitors' input, whose line breaks must not forge log lines.
fn log_stderr(from: &Script, text: &[u8]) {
    // php-fpm's own word for a script that does not exist, with its 404: a scanner asking
    // for `/wp-login.php` wrote a warning a second, and used up the second's line that a
    // real PHP warning needed. The access log has each 404.
    if text.trim_ascii() == b"Primary script unknown" {
        let (address, script) = (&from.address, &from.name);
        tracing::debug!(%address, %script, "php-fpm found no such script (404)");
        return;
    }
    let Some(held_back) = STDERR_LOG.allow(std::time::Instant::now()) else {
        return;
    };
    let text = String::from_utf8_lossy(&text[..text.len().min(STDERR_LOGGED)]);
    let shown: String = text.trim_end().escape_debug().collect();
    let (address, script) = (&from.address, &from.name);
    if held_back > 0 {
        tracing::warn!(%address, %script, "FastCGI stderr: {shown} ({held_back} more not logged)");
    } else {
        tracing::warn!(%address, %script, "FastCGI stderr: {shown}");
    }
}

/// Which php-fpm ran which script, for the log lines of its stderr.
#[derive(Debug)]
pub(super) struct Script {
    address: String,
    name: String,
}

/// The body of a FastCGI response: the `STDOUT` records after the CGI head, up to
/// `END_REQUEST`.
#[derive(Debug)]
pub(super) struct FastCgiBody {
    reader: RecordReader,
    /// Body bytes that came in the same record as the head.
    first: Option<Bytes>,
    /// A response with no body (HEAD, 204, 304): the records are read and dropped.
    discard: bool,
    /// What is left of the `Content-Length` the script set, if it set one: the client is
    /// told that length (a download's progress), so the body must hold exactly that much.
    remaining: Option<u64>,
    script: Arc<Script>,
    /// The rest of the request's input, when php-fpm began to answer before it took it all
    /// (see [`EARLY_OUTPUT_LIMIT`]): sent as the answer is read.
    input: Option<Box<PendingInput>>,
}

/// Request input still to go out while the answer is read.
#[derive(Debug)]
pub(super) struct PendingInput {
    /// Records encoded and not yet written.
    out: BytesMut,
    body: UpstreamBody,
    /// The body has ended and the empty `STDIN` record that says so is in `out`.
    body_done: bool,
    /// php-fpm left input untaken at the last try (its time, not the client's).
    waits_on_php_fpm: bool,
}

impl PendingInput {
    /// Whether all of the input, the record that ends it too, has been written.
    fn is_sent(&self) -> bool {
        self.body_done && self.out.is_empty()
    }

    /// Encodes what the client's body has ready as `STDIN` records (and the empty one once it
    /// ends), until `out` holds [`super::COPY_LIMIT`] or the body has nothing more yet.
    fn encode_ready(&mut self, cx: &mut std::task::Context<'_>) -> Result<(), BoxError> {
        while !self.body_done && self.out.len() < super::COPY_LIMIT {
            match std::pin::Pin::new(&mut self.body).poll_frame(cx) {
                Poll::Ready(None) => {
                    put_record_header(&mut self.out, STDIN, 0);
                    self.body_done = true;
                }
                Poll::Ready(Some(Err(error))) => return Err(error),
                Poll::Ready(Some(Ok(frame))) => {
                    // Trailers are not forwarded.
                    if let Ok(data) = frame.into_data() {
                        put_stream(&mut self.out, STDIN, &data);
                    }
                }
                Poll::Pending => break,
            }
        }
        Ok(())
    }

    /// Writes as much as php-fpm takes now, without waiting. Says whether any of it went
    /// out, and whether that was the last of it (all written, or php-fpm takes no more: it
    /// ended the request, or closed its side).
    fn send_some(
        &mut self,
        stream: &mut super::Stream,
        cx: &mut std::task::Context<'_>,
    ) -> Result<InputSent, ClientError> {
        let mut wrote = false;
        self.waits_on_php_fpm = false;
        loop {
            self.encode_ready(cx).map_err(ClientError::RequestBody)?;
            if self.out.is_empty() {
                return Ok(InputSent {
                    wrote,
                    over: self.body_done,
                });
            }
            match std::pin::Pin::new(&mut *stream).poll_write(cx, &self.out) {
                Poll::Ready(Ok(written)) if written > 0 => {
                    self.out.advance(written);
                    wrote = true;
                }
                // php-fpm stopped reading: what it wrote so far is still read.
                Poll::Ready(_) => return Ok(InputSent { wrote, over: true }),
                Poll::Pending => {
                    self.waits_on_php_fpm = true;
                    return Ok(InputSent { wrote, over: false });
                }
            }
        }
    }
}

/// php-fpm's share of the time of an exchange: `limit` (`response_timeout`) for the answer
/// once all of the input is sent, and, while input still goes out as the answer is read, as
/// long for input php-fpm leaves untaken. The pauses of a slow upload are the client's own
/// (`client_body_timeout`), as while a request is sent (`send_records`).
struct PhpFpmClock {
    limit: Duration,
    /// When the answer is due, once the input is all sent.
    due: Option<Instant>,
    /// The timer and the instant it is set for.
    timer: Option<(Instant, std::pin::Pin<Box<tokio::time::Sleep>>)>,
}

/// No input pending (for [`PhpFpmClock::poll_expired`] on a body without any).
const NO_INPUT: Option<Box<PendingInput>> = None;

impl PhpFpmClock {
    /// `sent_at`: when all of the input went out, if it has.
    fn new(limit: Duration, sent_at: Option<Instant>) -> PhpFpmClock {
        PhpFpmClock {
            limit,
            due: sent_at.map(|sent_at| sent_at + limit),
            timer: None,
        }
    }

    /// Whether php-fpm ran out of its time, as `input` stands now; else the timer (if any
    /// runs) will wake the task.
    fn poll_expired(
        &mut self,
        input: &Option<Box<PendingInput>>,
        cx: &mut std::task::Context<'_>,
    ) -> bool {
        let at = match input {
            None => *self.due.get_or_insert_with(|| Instant::now() + self.limit),
            Some(pending) if pending.waits_on_php_fpm => match &self.timer {
                Some((at, _)) => *at,
                None => Instant::now() + self.limit,
            },
            Some(_) => {
                self.timer = None; // waiting on the client
                return false;
            }
        };
        let timer = match &mut self.timer {
            Some((set_for, timer)) if *set_for == at => timer,
            slot => {
                let (_, timer) = slot.insert((at, Box::pin(tokio::time::sleep_until(at))));
                timer
            }
        };
        timer.as_mut().poll(cx).is_ready()
    }
}

/// What one [`PendingInput::send_some`] did.
struct InputSent {
    wrote: bool,
    over: bool,
}

/// Sends what php-fpm takes of `input`, if any is pending, without waiting (see
/// [`PendingInput`]); once no more will go, `input` is emptied, and the connection is kept
/// only if all of it went out. True when some of it was written now.
fn send_pending(
    input: &mut Option<Box<PendingInput>>,
    connection: &mut Connection,
    cx: &mut std::task::Context<'_>,
) -> Result<bool, ClientError> {
    let Some(pending) = input.as_mut() else {
        return Ok(false);
    };
    let sent = pending.send_some(&mut connection.stream, cx)?;
    if sent.over {
        connection.request_unfinished = !pending.is_sent();
        *input = None;
    }
    Ok(sent.wrote)
}

impl FastCgiBody {
    /// Sends what php-fpm takes of the input still pending, if any, without waiting (see
    /// [`send_pending`]). True when some of it was written now: php-fpm is reading, which
    /// counts as the answer's progress while it says nothing.
    pub(super) fn send_input(
        &mut self,
        connection: &mut Connection,
        cx: &mut std::task::Context<'_>,
    ) -> Result<bool, ClientError> {
        send_pending(&mut self.input, connection, cx)
    }

    /// The body's exact size still to come, when the script gave its length.
    pub(super) fn remaining(&self) -> Option<u64> {
        self.remaining.filter(|_| !self.discard)
    }

    /// The next piece of body in `buffer`; `Ok(None)` when more must be read or, with
    /// `*ended` set, at `END_REQUEST`.
    pub(super) fn decode(
        &mut self,
        buffer: &mut BytesMut,
        ended: &mut bool,
    ) -> Result<Option<Bytes>, ClientError> {
        if let Some(first) = self.first.take() {
            if !self.discard {
                return self.counted(first).map(Some);
            }
        }
        loop {
            match self.reader.next(buffer)? {
                Step::Stdout(piece) if self.discard || piece.is_empty() => {}
                Step::Stdout(piece) => return self.counted(piece).map(Some),
                Step::Stderr(text) => log_stderr(&self.script, &text),
                Step::End => {
                    if let Some(short) = self.remaining().filter(|left| *left > 0) {
                        return Err(ClientError::Protocol(format!(
                            "php-fpm ended the answer {short} bytes short of its Content-Length"
                        )));
                    }
                    *ended = true;
                    return Ok(None);
                }
                Step::NeedMore => return Ok(None),
            }
        }
    }

    /// `piece`, counted against the length the script set. Output past that length is
    /// dropped, as nginx does: the client was told the length, and legacy scripts often set it
    /// and then echo one byte more (the newline after a closing `?>`); the answer itself is
    /// whole.
    fn counted(&mut self, mut piece: Bytes) -> Result<Bytes, ClientError> {
        if let Some(left) = self.remaining.as_mut() {
            if piece.len() as u64 > *left {
                // (`left` is below the piece's length, so it fits a usize.)
                piece.truncate(usize::try_from(*left).unwrap_or(piece.len()));
                self.discard = true;
                if let Some(held_back) = OVERRUN_LOG.allow(std::time::Instant::now()) {
                    let (address, script) = (&self.script.address, &self.script.name);
                    tracing::warn!(
                        %address,
                        %script,
                        "the script wrote more than its own Content-Length; the rest was dropped ({held_back} more such answers not logged)"
                    );
                }
            }
            *left -= piece.len() as u64;
        }
        Ok(piece)
    }
}

/// A parsed CGI response head.
struct CgiHead {
    status: StatusCode,
    reason: Option<Bytes>,
    headers: HeaderMap,
    /// The `Content-Length` the script set, when it is one number.
    length: Option<u64>,
    received: Bytes,
}

/// Parses the CGI head off the front of `stdout`; `Ok(None)` while it is incomplete.
fn parse_cgi_head(stdout: &mut BytesMut) -> Result<Option<CgiHead>, ClientError> {
    let mut fields = [httparse::EMPTY_HEADER; super::MAX_HEADERS];
    let parsed = httparse::parse_headers(stdout, &mut fields).map(|status| match status {
        httparse::Status::Complete((length, _)) => Some(length),
        httparse::Status::Partial => None,
    });
    let length = match parsed {
        Ok(Some(length)) => length,
        Ok(None) => return Ok(None),
        // Read again with the control bytes of its values blanked (see
        // `blank_controls_in_values`); only once, as blanking again changes nothing.
        Err(httparse::Error::HeaderValue)
            if crate::proxy::header::blank_response_controls(stdout, true) =>
        {
            return parse_cgi_head(stdout)
        }
        Err(
            error @ (httparse::Error::HeaderName
            | httparse::Error::HeaderValue
            | httparse::Error::TooManyHeaders),
        ) => return Err(ClientError::Unpassable(error.to_string())),
        Err(error) => return Err(ClientError::Protocol(format!("CGI head: {error}"))),
    };
    let head = stdout.split_to(length).freeze();
    let mut fields = [httparse::EMPTY_HEADER; super::MAX_HEADERS];
    // Parsed again from the frozen head, so values are slices of it rather than copies.
    let Ok(httparse::Status::Complete((_, fields))) = httparse::parse_headers(&head, &mut fields)
    else {
        return Err(ClientError::Protocol(
            "CGI head could not be re-read".into(),
        ));
    };
    let mut status = None;
    let mut reason = None;
    let mut headers = HeaderMap::with_capacity(fields.len() + 3);
    for field in fields.iter() {
        let name_bytes = field.name.as_bytes();
        if name_bytes.eq_ignore_ascii_case(b"status") {
            // `Status: 404 Not Found`. A page's own doing when wrong, as a bad field is: not
            // held against php-fpm's breaker. An interim status would leave the client
            // waiting for a final one (or, as a 101, switch protocols with nothing behind).
            let text = field.value.trim_ascii();
            let (code, phrase) = match text.iter().position(|byte| *byte == b' ') {
                Some(space) => (&text[..space], text[space + 1..].trim_ascii()),
                None => (text, &b""[..]),
            };
            let code = StatusCode::from_bytes(code)
                .ok()
                .filter(|code| !code.is_informational())
                .ok_or_else(|| {
                    ClientError::Unpassable(format!(
                        "CGI Status `{}` is not a final HTTP status",
                        String::from_utf8_lossy(text)
                    ))
                })?;
            if !phrase.is_empty() && Some(phrase) != code.canonical_reason().map(str::as_bytes) {
                reason = Some(Bytes::copy_from_slice(phrase));
            }
            status = Some(code);
            continue;
        }
        let name = HeaderName::from_bytes(name_bytes)
            .map_err(|_| ClientError::Unpassable("invalid header name".into()))?;
        if HOP_BY_HOP.contains(&&name)
            || name == header::CONNECTION
            || name == header::TRANSFER_ENCODING
        {
            continue;
        }
        if is_file_handoff(&name) {
            // The vhost's nginx (or Apache) sent the file this names instead of the answer's
            // body, which is empty or a placeholder. levee serves no files, and a front
            // nginx would act on the field in its own location space: passed on, or dropped
            // for a 200, the visitor would save an empty file with no error anywhere.
            return Err(ClientError::Unpassable(format!(
                "the app asks its web server to send a file in the answer's place ({name}), which levee does not do: serve such downloads from an nginx vhost (an http upstream) or have PHP send the file itself"
            )));
        }
        if name.as_str().starts_with("x-accel-") {
            // The vhost's own hints (X-Accel-Buffering, -Limit-Rate, -Expires, -Charset):
            // no one's after levee, which never passes them on for a front to act on.
            continue;
        }
        let value = HeaderValue::from_maybe_shared(shared_slice(&head, field.value))
            .map_err(|_| ClientError::Unpassable(format!("invalid value of {name}")))?;
        headers.append(name, value);
    }
    // A length the body is then held to; anything else is dropped (the answer goes chunked).
    let mut lengths = headers.get_all(header::CONTENT_LENGTH).iter();
    let length = match (lengths.next(), lengths.next()) {
        (Some(value), None) => parse_content_length(value.as_bytes().trim_ascii()),
        _ => None,
    };
    if length.is_none() {
        headers.remove(header::CONTENT_LENGTH);
    }
    // CGI (RFC 3875 6.2.3): a redirect without a status is a 302.
    let status = status.unwrap_or(if headers.contains_key(header::LOCATION) {
        StatusCode::FOUND
    } else {
        StatusCode::OK
    });
    Ok(Some(CgiHead {
        status,
        reason,
        headers,
        length,
        received: head,
    }))
}

/// `part` (a slice of `whole`, as httparse hands them out) as `Bytes` sharing `whole`'s
/// memory; copied should it not lie inside it.
fn shared_slice(whole: &Bytes, part: &[u8]) -> Bytes {
    let start = (part.as_ptr() as usize).checked_sub(whole.as_ptr() as usize);
    match start.and_then(|start| Some(start..start.checked_add(part.len())?)) {
        Some(range) if range.end <= whole.len() => whole.slice(range),
        _ => Bytes::copy_from_slice(part),
    }
}

/// A field that asks the web server in front of PHP to send a file in the answer's place:
/// nginx's `X-Accel-Redirect`, Apache's and lighttpd's `X-Sendfile`.
fn is_file_handoff(name: &HeaderName) -> bool {
    let name = name.as_str();
    name == "x-accel-redirect" || name == "x-sendfile" || name == "x-lighttpd-send-file"
}

impl Client {
    /// Why a request for `path` could not be put to this upstream, when it speaks FastCGI and
    /// the path names no script it could run: asked before a write is stored for a later
    /// replay, which would otherwise be accepted now and fail every time.
    pub fn refusal(&self, path: &str) -> Option<Unsendable> {
        let settings = self.settings.fastcgi.as_ref()?;
        script_of(path, settings, &|script| {
            is_file_under(&settings.root, script)
        })
        .err()
    }

    /// [`Client::send_within`] for a FastCGI upstream.
    pub(super) async fn send_fastcgi(
        &self,
        settings: &FastCgiSettings,
        request: Request<UpstreamBody>,
        from_client: FromClient,
        response_timeout: Option<Duration>,
        now: Instant,
        sent_whole: Option<&std::sync::atomic::AtomicBool>,
    ) -> Result<Answered, ClientError> {
        let (mut parts, body) = request.into_parts();
        // The script first: a path that names none is answered before any body is read.
        let (script, info) = script_of(parts.uri.path(), settings, &|script| {
            is_file_under(&settings.root, script)
        })
        .map_err(|refusal| match (refusal, parts.uri.query()) {
            (Unsendable::Directory(location), Some(query)) => {
                Unsendable::Directory(format!("{location}?{query}"))
            }
            (refusal, _) => refusal,
        })?;
        // Every body is read whole before php-fpm is asked, as nginx does: PHP runs the
        // script on whatever input it got, so a body cut short by its client would be
        // applied as a short one (see `proxy::spool`); and PHP needs CONTENT_LENGTH, which a
        // chunked body tells only at its end. (One of up to 64 KiB was read whole already.)
        let (mut body, resend, now) = if body.is_end_stream() {
            (body, Some(ResendableBody::empty()), now)
        } else if let Some(whole) = parts.extensions.remove::<ResendableBody>() {
            // Sent from the copy, whose length is known: the body read ahead still had its
            // client's size hint, unknown for a chunked one, and a chunked PUT, DELETE or
            // queue route's POST reached PHP with CONTENT_LENGTH empty, read as no body.
            (whole.body(), Some(whole), now)
        } else {
            let (body, resend) = crate::proxy::spool::spool(body, &settings.temp_dir)
                .await
                .map_err(ClientError::RequestBody)?
                .into_body();
            // The body took its client's time: pooled connections are judged from now.
            (body, resend, Instant::now())
        };
        let has_body = !body.is_end_stream();
        let head = encode_request_head(&parts, &body, &self.settings.authority, &from_client);
        drop(from_client);
        // Without room in the pool, php-fpm closes the connection itself after the answer.
        let keep_connection = self.pool.max_idle > 0;
        // (The upstream's `host`, when set, is in the request's fields by now.)
        let client_named_host = parts.headers.contains_key(http::header::HOST);
        let begin = encode_begin(
            &head.bytes,
            (parts.version, client_named_host),
            settings,
            (&script, &info),
            has_body,
            keep_connection,
        )?;
        let script = Arc::new(Script {
            address: self.settings.address(),
            name: crate::printable::printable(&String::from_utf8_lossy(&script)).into_owned(),
        });
        let mut retried = false;
        let mut waited = has_body;
        loop {
            let mut connection = self.connection_for_try(now, retried, &mut waited).await?;
            let sent = send_records(
                &mut connection,
                &begin,
                std::mem::replace(&mut body, crate::proxy::body::empty()),
                has_body,
                response_timeout,
            )
            .await;
            let request_sent_at = if waited { Instant::now() } else { now };
            if let (Ok(None), Some(flag)) = (&sent, sent_whole) {
                flag.store(true, std::sync::atomic::Ordering::Release);
            }
            let outcome = match sent {
                Ok(mut input) => {
                    // Due `response_timeout` after the request went out whole; with input
                    // still going out, php-fpm's share of the time only.
                    let sent_at = input.is_none().then_some(request_sent_at);
                    let mut clock = response_timeout.map(|limit| PhpFpmClock::new(limit, sent_at));
                    read_head(&mut connection, &script, &mut input, clock.as_mut())
                        .await
                        .map(|head| (head, input))
                }
                Err(error) => Err(error),
            };
            match outcome {
                Ok(((head, reader), input)) => {
                    let discard = parts.method == Method::HEAD
                        || head.status == StatusCode::NO_CONTENT
                        || head.status == StatusCode::NOT_MODIFIED;
                    let (reader, rest) = reader;
                    let body = FastCgiBody {
                        reader,
                        first: (!rest.is_empty()).then(|| rest.freeze()),
                        discard,
                        remaining: head.length,
                        script,
                        input,
                    };
                    let input_pending = discard && body.input.is_some();
                    let mut response = self.fastcgi_response(
                        connection,
                        head,
                        body,
                        &parts.method,
                        keep_connection,
                    );
                    if input_pending {
                        // A bodiless answer (HEAD, 204, 304) is not read on, so the input
                        // would never go out: php-fpm gets the rest of it, and the exchange
                        // is read to its end, before the client has its answer.
                        finish_exchange(response.body_mut(), response_timeout).await?;
                    }
                    return Ok(Answered {
                        response,
                        relayed: None,
                        request_sent_at,
                    });
                }
                Err(error) => {
                    // A pooled connection php-fpm had just closed (a worker recycled after
                    // `pm.max_requests`): sent again once on a new one, as for HTTP.
                    let race = connection.reused
                        && !connection.interim_seen
                        && connection.buffer.is_empty()
                        && matches!(&error, ClientError::Closed | ClientError::Io(_));
                    if race && !retried && is_idempotent(&parts.method) {
                        if let Some(copy) = &resend {
                            body = copy.body();
                            retried = true;
                            waited = true;
                            continue;
                        }
                    }
                    return Err(error);
                }
            }
        }
    }

    fn fastcgi_response(
        &self,
        mut connection: Connection,
        head: CgiHead,
        mut body: FastCgiBody,
        method: &Method,
        mut reusable: bool,
    ) -> Response<Incoming> {
        let mut response = Response::new(Incoming::empty());
        *response.status_mut() = head.status;
        *response.version_mut() = Version::HTTP_11;
        *response.headers_mut() = head.headers;
        if let Some(reason) = head.reason {
            response.extensions_mut().insert(super::UpstreamReason {
                status: head.status,
                reason,
            });
        }
        response
            .extensions_mut()
            .insert(ReceivedHead(head.received));
        // Marked as the HTTP client marks it, for `proxy::forward`.
        if crate::degrade::stale::is_event_stream(response.headers()) {
            response.extensions_mut().insert(super::EventStream);
        }
        let framing = if body.discard && body.input.is_none() {
            // Nothing of an answer without a body (HEAD, 204, 304) reaches the client after
            // its head, so its body is over now, as an HTTP upstream's is: the client writer
            // drops such a body unread, which the access log took for an answer cut short
            // (`complete=false`). php-fpm's records that came with the head are read off, no
            // more: its END_REQUEST is most often among them (the script has ended), and the
            // connection can be kept; when it has not come, the script still runs, and its
            // records would answer the next request, so the connection is not kept.
            let mut ended = false;
            let read_off = body.decode(&mut connection.buffer, &mut ended);
            if !(matches!(read_off, Ok(None)) && ended) {
                reusable = false;
            }
            Framing::Done
        } else {
            Framing::FastCgi(Box::new(body))
        };
        let mut incoming = Incoming {
            connection: Some(connection),
            framing,
            reusable,
            pool: Some(self.pool.clone()),
            answers_head: *method == Method::HEAD,
        };
        incoming.finish_if_done();
        *response.body_mut() = incoming;
        response
    }
}

/// What php-fpm may write while the request is still going out that is read and held, so
/// that a script that answers before it reads its input (or without reading it) never waits
/// on levee while levee waits on it. Past it, the answer goes to the client with the rest of
/// the input sent alongside (`PendingInput`).
const EARLY_OUTPUT_LIMIT: usize = 1024 * 1024;

/// Writes the opening records, then the body as `STDIN` records and the empty one that ends
/// it, reading what php-fpm sends meanwhile. php-fpm may end the request before it has read
/// all of it (a script that ignores its input): the rest is not sent, and the connection is
/// not kept. A write php-fpm does not take for `stall_limit` is a timeout. Returns the input
/// not yet sent when php-fpm has written [`EARLY_OUTPUT_LIMIT`] first.
async fn send_records(
    connection: &mut Connection,
    begin: &BytesMut,
    body: UpstreamBody,
    has_body: bool,
    stall_limit: Option<Duration>,
) -> Result<Option<Box<PendingInput>>, ClientError> {
    connection.interim_seen = false;
    let mut input = Some(PendingInput {
        out: BytesMut::from(&begin[..]),
        body,
        body_done: !has_body,
        waits_on_php_fpm: false,
    });
    let mut scanned = 0;
    // Armed while php-fpm does not take what is ready for it (boxed: it is rare).
    let mut stalled: Option<std::pin::Pin<Box<tokio::time::Sleep>>> = None;
    std::future::poll_fn(|cx| loop {
        let Some(pending) = input.as_mut() else {
            return Poll::Ready(Ok(None)); // not polled again once ready
        };
        if connection.buffer.len() >= EARLY_OUTPUT_LIMIT {
            if pending.is_sent() {
                return Poll::Ready(Ok(None));
            }
            // php-fpm has a lot to say before it takes the rest: the answer streams to the
            // client now, and the rest of the input goes out as php-fpm reads it.
            connection.request_unfinished = true;
            return Poll::Ready(Ok(input.take().map(Box::new)));
        }
        let buffer = &mut connection.buffer;
        if buffer.capacity() - buffer.len() < 1024 {
            buffer.reserve(HEAD_READ_SIZE);
        }
        let reading = std::pin::pin!(connection.stream.read_buf(buffer)).poll(cx);
        if let Poll::Ready(read) = reading {
            let answered = !connection.buffer.is_empty();
            match read {
                Ok(0) | Err(_) if answered => {
                    // php-fpm answered and went: the answer is read from the buffer.
                    connection.request_unfinished = true;
                    return Poll::Ready(Ok(None));
                }
                Ok(0) => return Poll::Ready(Err(ClientError::Closed)),
                Err(error) => return Poll::Ready(Err(ClientError::Io(error))),
                Ok(_) => {
                    connection.interim_seen = true;
                    if holds_end_request(&connection.buffer, &mut scanned) {
                        connection.request_unfinished = !pending.is_sent();
                        return Poll::Ready(Ok(None));
                    }
                    continue;
                }
            }
        }
        if let Err(error) = pending.encode_ready(cx) {
            connection.request_unfinished = true;
            return Poll::Ready(Err(ClientError::RequestBody(error)));
        }
        if pending.out.is_empty() {
            return if pending.body_done {
                Poll::Ready(Ok(None))
            } else {
                Poll::Pending // waiting for the client's body
            };
        }
        match std::pin::Pin::new(&mut connection.stream).poll_write(cx, &pending.out) {
            Poll::Ready(Ok(0)) => {
                connection.request_unfinished = true;
                return Poll::Ready(Err(ClientError::Io(io::ErrorKind::WriteZero.into())));
            }
            Poll::Ready(Ok(written)) => {
                stalled = None;
                pending.out.advance(written);
            }
            Poll::Ready(Err(error)) => {
                connection.request_unfinished = true;
                if connection.buffer.is_empty() {
                    return Poll::Ready(Err(ClientError::Io(error)));
                }
                // php-fpm stopped reading because it has answered: that answer is read.
                return Poll::Ready(Ok(None));
            }
            Poll::Pending => {
                return super::write_stalled(&mut stalled, stall_limit, connection, cx)
                    .map_ok(|()| None)
            }
        }
    })
    .await
}

/// Reads a bodiless answer's records to `END_REQUEST`, sending the input still pending
/// meanwhile (see [`PendingInput`]), php-fpm's share of the time bounded by `limit` (see
/// [`PhpFpmClock`]).
async fn finish_exchange(body: &mut Incoming, limit: Option<Duration>) -> Result<(), ClientError> {
    let mut clock = limit.map(|limit| PhpFpmClock::new(limit, None));
    std::future::poll_fn(|cx| loop {
        match std::pin::Pin::new(&mut *body).poll_frame(cx) {
            Poll::Ready(None) => return Poll::Ready(Ok(())),
            Poll::Ready(Some(Err(error))) => return Poll::Ready(Err(error)),
            Poll::Ready(Some(Ok(_))) => continue,
            Poll::Pending => {
                if let Some(clock) = clock.as_mut() {
                    let input = match &body.framing {
                        Framing::FastCgi(answer) => &answer.input,
                        _ => &NO_INPUT,
                    };
                    if clock.poll_expired(input, cx) {
                        return Poll::Ready(Err(ClientError::ResponseTimeout(clock.limit)));
                    }
                }
                return Poll::Pending;
            }
        }
    })
    .await
}

/// Whether the records in `buffer` (from a record's start) reach an `END_REQUEST`. `*from`:
/// where the next record header starts, kept between calls as the buffer grows, so that
/// each header is looked at once.
fn holds_end_request(buffer: &[u8], from: &mut usize) -> bool {
    while let Some(header) = buffer.get(*from..*from + 8) {
        if header[1] == END_REQUEST {
            return true;
        }
        let content = usize::from(u16::from_be_bytes([header[4], header[5]]));
        *from += 8 + content + usize::from(header[6]);
    }
    false
}

/// Reads records until the CGI head is whole; returns it with the reader's state and the
/// body bytes that came after the head.
async fn read_head(
    connection: &mut Connection,
    script: &Script,
    input: &mut Option<Box<PendingInput>>,
    mut clock: Option<&mut PhpFpmClock>,
) -> Result<(CgiHead, (RecordReader, BytesMut)), ClientError> {
    let mut reader = RecordReader::default();
    let mut stdout = BytesMut::new();
    loop {
        match reader.next(&mut connection.buffer)? {
            Step::Stdout(piece) => {
                stdout.extend_from_slice(&piece);
                if let Some(head) = parse_cgi_head(&mut stdout)? {
                    return Ok((head, (reader, stdout)));
                }
                if stdout.len() >= MAX_HEAD_BYTES {
                    return Err(ClientError::Protocol(format!(
                        "CGI response head over {MAX_HEAD_BYTES} bytes"
                    )));
                }
            }
            Step::Stderr(text) => log_stderr(script, &text),
            Step::End => {
                return Err(ClientError::Protocol(if stdout.is_empty() {
                    "php-fpm ended the request without any output".into()
                } else {
                    "php-fpm ended the request inside the CGI head".into()
                }))
            }
            Step::NeedMore => {
                if connection.buffer.capacity() - connection.buffer.len() < 1024 {
                    connection.buffer.reserve(HEAD_READ_SIZE);
                }
                // Input still pending (php-fpm wrote much, its stderr say, before its head)
                // goes out meanwhile: the script may want it before it says more.
                let read = std::future::poll_fn(|cx| {
                    send_pending(input, connection, cx)?;
                    if let Some(clock) = clock.as_deref_mut() {
                        if clock.poll_expired(input, cx) {
                            return Poll::Ready(Err(ClientError::ResponseTimeout(clock.limit)));
                        }
                    }
                    std::pin::pin!(connection.stream.read_buf(&mut connection.buffer))
                        .poll(cx)
                        .map_err(ClientError::Io)
                })
                .await?;
                if read == 0 {
                    return Err(if connection.interim_seen {
                        ClientError::Protocol(
                            "php-fpm closed the connection before the end of the CGI head".into(),
                        )
                    } else {
                        ClientError::Closed
                    });
                }
                // php-fpm has the request: a close from now on is no pool race.
                connection.interim_seen = true;
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn settings(front: Option<&str>) -> FastCgiSettings {
        FastCgiSettings {
            root: "/srv/www".into(),
            index: "index.php".into(),
            front_controller: front.map(str::to_string),
            params: Vec::new(),
            temp_dir: std::env::temp_dir(),
        }
    }

    /// Only `/wp-admin/index.php` and `/robots.txt` exist where levee can see.
    fn existing(script: &[u8]) -> bool {
        script == b"/wp-admin/index.php" || script == b"/robots.txt"
    }

    fn script(path: &str, front: Option<&str>) -> (String, String) {
        let (script, info) = script_of(path, &settings(front), &existing).expect("mappable");
        (
            String::from_utf8(script).expect("utf-8"),
            String::from_utf8(info).expect("utf-8"),
        )
    }

    #[test]
    fn a_path_runs_its_php_script_with_the_rest_as_path_info() {
        assert_eq!(script("/echo.php", None), ("/echo.php".into(), "".into()));
        assert_eq!(
            script("/forum/view.php/topic/7", None),
            ("/forum/view.php".into(), "/topic/7".into())
        );
        assert_eq!(script("/", None), ("/index.php".into(), "".into()));
        assert_eq!(
            script("/forum/", None),
            ("/forum/index.php".into(), "".into())
        );
        assert_eq!(script("/echo.php/", None), ("/echo.php".into(), "/".into()));
        for not_php in ["/about", "/uploads/avatar.jpg", "/.env"] {
            assert_eq!(
                script_of(not_php, &settings(None), &existing),
                Err(Unsendable::NoScript(not_php.into()))
            );
        }
        // With a front controller: any path that names no script, and a directory whose
        // index is not there (WordPress's `try_files $uri $uri/ /index.php?$args`).
        let front = Some("/index.php");
        for path in ["/about", "/2026/12/hello/", "/", "/uploads/avatar.jpg"] {
            assert_eq!(
                script(path, front),
                ("/index.php".into(), "".into()),
                "{path}"
            );
        }
        assert_eq!(
            script("/wp-admin/", front),
            ("/wp-admin/index.php".into(), "".into())
        );
        // A file that is there: nginx's `try_files $uri` served it; the front controller would
        // answer its own page in its place.
        for spelled in ["/robots.txt", "/%72obots.txt", "/x/../robots.txt"] {
            assert_eq!(
                script_of(spelled, &settings(front), &existing),
                Err(Unsendable::StaticFile("/robots.txt".into())),
                "{spelled}"
            );
        }
        assert_eq!(
            script_of("/robots.txt", &settings(None), &existing),
            Err(Unsendable::NoScript("/robots.txt".into()))
        );
        assert_eq!(
            script("/admin.php", Some("/index.php")),
            ("/admin.php".into(), "".into())
        );
        // A directory with its index, named without the slash: moved to the path with it, as
        // nginx answers, with or without a front controller. Dot segments at the end name
        // the directory itself: its index runs.
        for front in [None, Some("/index.php")] {
            assert_eq!(
                script_of("/wp-admin", &settings(front), &existing),
                Err(Unsendable::Directory("/wp-admin/".into())),
                "{front:?}"
            );
            assert_eq!(
                script("/wp-admin/.", front),
                ("/wp-admin/index.php".into(), "".into())
            );
            // Moved to the path as resolved: written as sent, these were Locations a browser
            // reads as another site.
            for spelled in [
                "//evil.example/../wp-admin",
                "//evil.example/%2e%2e/wp-admin",
                "/\\evil.example/../wp-admin",
                "/./wp-admin",
            ] {
                assert_eq!(
                    script_of(spelled, &settings(front), &existing),
                    Err(Unsendable::Directory("/wp-admin/".into())),
                    "{spelled}"
                );
            }
        }
    }

    #[test]
    fn no_spelling_of_a_path_leaves_the_root() {
        for path in [
            "/../../etc/passwd.php",
            "/a/..%2F..%2F..%2Fetc/passwd.php",
            "/%2e%2e/%2e%2e/etc/passwd.php",
            "//..//../etc/passwd.php",
        ] {
            let (name, _) = script(path, None);
            assert_eq!(name, "/etc/passwd.php", "{path}");
        }
        assert_eq!(
            script_of("/a%00.php", &settings(None), &existing),
            Err(Unsendable::NulInPath)
        );
    }

    #[test]
    fn each_params_record_holds_whole_pairs() {
        let mut params = Params::default();
        let value = vec![b'v'; 30_000];
        for name in [&b"A"[..], b"B", b"C", b"D"] {
            params.add(name, &value);
        }
        let mut out = BytesMut::new();
        params.put_records(&mut out);
        // Two pairs (2 × 30,006 bytes) fit a record, three do not.
        let mut at = 0;
        let mut records = Vec::new();
        while at < out.len() {
            let length = usize::from(u16::from_be_bytes([out[at + 4], out[at + 5]]));
            records.push(length);
            at += 8 + length;
        }
        assert_eq!(records, [60_012, 60_012]);
        assert!(params.too_long.is_none());
        params.add(b"LONG", &vec![b'x'; 70_000]);
        assert_eq!(params.too_long, Some(("LONG".into(), 70_009)));
    }

    #[test]
    fn params_are_encoded_with_short_and_long_lengths() {
        let mut params = Params::default();
        params.add(b"A", b"1");
        let long = vec![b'x'; 200];
        params.add(b"B", &long);
        assert_eq!(&params.bytes[..4], b"\x01\x01A1");
        assert_eq!(&params.bytes[4..9], b"\x01\x80\x00\x00\xc8");
        assert_eq!(params.bytes.len(), 4 + 5 + 1 + 200);
    }

    #[test]
    fn records_are_read_across_reads_with_padding_and_stderr() {
        let mut wire = BytesMut::new();
        let mut record = |kind: u8, content: &[u8], padding: u8| {
            wire.put_u8(1);
            wire.put_u8(kind);
            wire.put_u16(1);
            wire.put_u16(content.len() as u16);
            wire.put_u8(padding);
            wire.put_u8(0);
            wire.put_slice(content);
            wire.put_slice(&vec![0; padding as usize]);
        };
        record(STDOUT, b"Status: 404 Not Found\r\nX-A: b\r\n\r\nbo", 3);
        record(STDERR, b"PHP Warning: x", 0);
        record(STDOUT, b"dy", 6);
        record(STDOUT, b"", 0);
        record(END_REQUEST, &[0, 0, 0, 0, 0, 0, 0, 0], 0);
        // Fed one byte at a time: every split point must work.
        let mut reader = RecordReader::default();
        let mut buffer = BytesMut::new();
        let (mut stdout, mut stderr, mut ended) = (Vec::new(), Vec::new(), false);
        for byte in wire.iter() {
            buffer.put_u8(*byte);
            loop {
                match reader.next(&mut buffer).expect("valid records") {
                    Step::Stdout(piece) => stdout.extend_from_slice(&piece),
                    Step::Stderr(piece) => stderr.extend_from_slice(&piece),
                    Step::End => ended = true,
                    Step::NeedMore => break,
                }
            }
        }
        assert!(ended);
        assert_eq!(stderr, b"PHP Warning: x");
        let mut stdout = BytesMut::from(&stdout[..]);
        let head = parse_cgi_head(&mut stdout).expect("valid").expect("whole");
        assert_eq!(head.status, StatusCode::NOT_FOUND);
        assert_eq!(head.headers["x-a"], "b");
        assert_eq!(&stdout[..], b"body");
    }

    /// Request id 0 is for management records: skipped, but a request's output or end under
    /// it is refused, not taken for this request's.
    #[test]
    fn records_of_request_id_0_are_skipped_or_refused() {
        let record = |kind: u8, id: u16, content: &[u8]| {
            let mut wire = BytesMut::new();
            wire.put_u8(1);
            wire.put_u8(kind);
            wire.put_u16(id);
            wire.put_u16(content.len() as u16);
            wire.put_u8(0);
            wire.put_u8(0);
            wire.put_slice(content);
            wire
        };
        let mut buffer = record(10, 0, b"\x0e\x01FCGI_MPXS_CONNS0");
        buffer.extend_from_slice(&record(STDOUT, 1, b"X: y\r\n\r\n"));
        let mut reader = RecordReader::default();
        match reader.next(&mut buffer) {
            Ok(Step::Stdout(piece)) => assert_eq!(&piece[..], b"X: y\r\n\r\n"),
            other => panic!("the management record is skipped: {other:?}"),
        }
        for kind in [STDOUT, STDERR, END_REQUEST] {
            let mut buffer = record(kind, 0, &[0; 8]);
            let refused = RecordReader::default().next(&mut buffer);
            assert!(
                matches!(refused, Err(ClientError::Protocol(_))),
                "kind {kind}: {refused:?}"
            );
        }
    }

    #[test]
    fn a_body_is_held_to_the_length_the_script_gave() {
        let body = |remaining| FastCgiBody {
            reader: RecordReader::default(),
            first: None,
            discard: false,
            remaining,
            script: Arc::new(Script {
                address: "test".into(),
                name: "/test.php".into(),
            }),
            input: None,
        };
        let stdout = |content: &[u8]| {
            let mut wire = BytesMut::new();
            put_stream(&mut wire, STDOUT, content);
            wire
        };
        let end = || {
            let mut wire = BytesMut::new();
            put_record_header(&mut wire, END_REQUEST, 8);
            wire.put_slice(&[0; 8]);
            wire
        };
        let mut ended = false;

        let mut exact = body(Some(4));
        let mut wire = stdout(b"abcd");
        wire.extend_from_slice(&end());
        assert_eq!(exact.remaining(), Some(4));
        let piece = exact
            .decode(&mut wire, &mut ended)
            .expect("within the length");
        assert_eq!(piece.as_deref(), Some(&b"abcd"[..]));
        assert_eq!(exact.remaining(), Some(0));
        assert_eq!(exact.decode(&mut wire, &mut ended).expect("ends"), None);
        assert!(ended);

        let mut short = body(Some(10));
        let mut wire = stdout(b"abcd");
        wire.extend_from_slice(&end());
        short.decode(&mut wire, &mut ended).expect("a piece");
        let error = short.decode(&mut wire, &mut ended).expect_err("short");
        assert!(error.to_string().contains("6 bytes short"), "{error}");

        // Past its length: the length is sent, the rest of the script's output read and
        // dropped to its end (nginx's way).
        let mut long = body(Some(2));
        let mut wire = stdout(b"abcd");
        wire.extend_from_slice(&stdout(b"more"));
        wire.extend_from_slice(&end());
        let mut ended = false;
        let piece = long.decode(&mut wire, &mut ended).expect("cut to length");
        assert_eq!(piece.as_deref(), Some(&b"ab"[..]));
        assert_eq!(long.decode(&mut wire, &mut ended).expect("ends"), None);
        assert!(ended);
    }

    #[test]
    fn a_cgi_head_sets_the_status_and_keeps_cookies_apart() {
        let mut stdout = BytesMut::from(
            &b"Location: /home.php\r\nSet-Cookie: a=1\r\nSet-Cookie: b=2\r\nConnection: close\r\n\r\n"[..],
        );
        let head = parse_cgi_head(&mut stdout).expect("valid").expect("whole");
        assert_eq!(head.status, StatusCode::FOUND);
        assert_eq!(head.headers.get_all(header::SET_COOKIE).iter().count(), 2);
        assert!(!head.headers.contains_key(header::CONNECTION));
        assert_eq!(head.length, None);
        let mut stdout = BytesMut::from(&b"Content-Length: 12\r\n\r\n"[..]);
        let head = parse_cgi_head(&mut stdout).expect("valid").expect("whole");
        assert_eq!(head.length, Some(12));
        let mut stdout = BytesMut::from(&b"Content-Length: 1\r\nContent-Length: 2\r\n\r\n"[..]);
        let head = parse_cgi_head(&mut stdout).expect("valid").expect("whole");
        assert_eq!(head.length, None);
        assert!(!head.headers.contains_key(header::CONTENT_LENGTH));
        let mut stdout = BytesMut::from(&b"Status: 418 Short And Stout\r\n\r\n"[..]);
        let head = parse_cgi_head(&mut stdout).expect("valid").expect("whole");
        assert_eq!(head.status.as_u16(), 418);
        assert_eq!(head.reason.as_deref(), Some(&b"Short And Stout"[..]));
        let mut partial = BytesMut::from(&b"Content-Type: text/html\r\n"[..]);
        assert!(parse_cgi_head(&mut partial).expect("valid").is_none());
    }

    /// `header("Content-Disposition: attachment; filename=\"a\x01b\"")` passes under nginx:
    /// here with a space in the control byte's place, the output after the head untouched.
    /// The first line is a field too.
    #[test]
    fn control_bytes_in_a_cgi_value_are_passed_as_spaces() {
        let mut stdout =
            BytesMut::from(&b"X-First: \x1b[1m\r\nContent-Disposition: attachment; filename=\"a\x01b\"\r\n\r\n\x01"[..]);
        let head = parse_cgi_head(&mut stdout).expect("valid").expect("whole");
        assert_eq!(head.headers["x-first"], "[1m");
        assert_eq!(
            head.headers["content-disposition"],
            "attachment; filename=\"a b\""
        );
        assert_eq!(&stdout[..], b"\x01");
        let mut stdout = BytesMut::from(&b"X-A: a\x00\x01\r\n\r\n"[..]);
        assert!(matches!(
            parse_cgi_head(&mut stdout),
            Err(ClientError::Unpassable(_))
        ));
    }

    /// The parameters `begin` (from `encode_begin`) gives PHP, by name.
    fn cgi_params(begin: &[u8]) -> std::collections::HashMap<String, String> {
        // BEGIN_REQUEST (8 + 8), then the parameters' records (and an empty STDIN when the
        // request has no body).
        let mut params = BytesMut::new();
        let mut at = 16;
        while at + 8 <= begin.len() && begin[at + 1] != STDIN {
            let length = usize::from(u16::from_be_bytes([begin[at + 4], begin[at + 5]]));
            assert_eq!(begin[at + 1], PARAMS);
            params.extend_from_slice(&begin[at + 8..at + 8 + length]);
            at += 8 + length;
        }
        let mut pairs = std::collections::HashMap::new();
        let mut rest = &params[..];
        let length = |rest: &mut &[u8]| {
            if rest[0] & 0x80 == 0 {
                let length = usize::from(rest[0]);
                *rest = &rest[1..];
                length
            } else {
                let length = u32::from_be_bytes([rest[0] & 0x7f, rest[1], rest[2], rest[3]]);
                *rest = &rest[4..];
                length as usize
            }
        };
        while !rest.is_empty() {
            let name_length = length(&mut rest);
            let value_length = length(&mut rest);
            let name = String::from_utf8(rest[..name_length].to_vec()).expect("utf-8");
            let value = String::from_utf8(rest[name_length..name_length + value_length].to_vec())
                .expect("utf-8");
            rest = &rest[name_length + value_length..];
            pairs.insert(name, value);
        }
        pairs
    }

    #[test]
    fn fields_become_cgi_parameters_and_spoofable_names_are_dropped() {
        let head = b"POST /shop/cart.php/add?id=3 HTTP/1.1\r\nHost: shop.example:8443\r\nContent-Type: application/x-www-form-urlencoded\r\nContent-Type: text/plain\r\nContent-Length: 4\r\nCookie: a=1\r\nCookie: b=2\r\nX_Real_IP: 6.6.6.6\r\nX.Real.IP: 6.6.6.6\r\nProxy: http://evil\r\nX-Forwarded-For: 6.6.6.6, 203.0.113.7\r\nX-Real-IP: 203.0.113.7\r\nX-Forwarded-Proto: https\r\n\r\n";
        let begin = encode_begin(
            head,
            (http::Version::HTTP_10, true),
            &settings(None),
            (b"/shop/cart.php", b"/add"),
            true,
            true,
        )
        .expect("encodes");
        let pairs = cgi_params(&begin);
        let get = |name: &str| pairs.get(name).map(String::as_str);
        assert_eq!(get("SCRIPT_FILENAME"), Some("/srv/www/shop/cart.php"));
        assert_eq!(get("PATH_INFO"), Some("/add"));
        assert_eq!(get("QUERY_STRING"), Some("id=3"));
        assert_eq!(get("REQUEST_URI"), Some("/shop/cart.php/add?id=3"));
        assert_eq!(get("CONTENT_LENGTH"), Some("4"));
        assert_eq!(get("HTTP_CONTENT_LENGTH"), Some("4"));
        // PHP parses the body by the first of two, as behind nginx.
        assert_eq!(
            get("CONTENT_TYPE"),
            Some("application/x-www-form-urlencoded")
        );
        assert_eq!(
            get("HTTP_CONTENT_TYPE"),
            Some("application/x-www-form-urlencoded, text/plain")
        );
        // The client's version: the head levee wrote says HTTP/1.1 whatever the client spoke.
        assert_eq!(get("SERVER_PROTOCOL"), Some("HTTP/1.0"));
        assert_eq!(get("HTTP_COOKIE"), Some("a=1; b=2"));
        assert_eq!(get("HTTP_X_REAL_IP"), Some("203.0.113.7"));
        assert_eq!(get("REMOTE_ADDR"), Some("203.0.113.7"));
        assert_eq!(get("HTTP_PROXY"), None);
        assert_eq!(get("SERVER_NAME"), Some("shop.example"));
        // The scheme's port: the one in `Host` is the client's to write.
        assert_eq!(get("SERVER_PORT"), Some("443"));
        assert!(
            pairs.keys().all(|name| !name.contains('.')),
            "a dotted name reads as an underscored one in PHP: {pairs:?}"
        );
        assert_eq!(get("HTTPS"), Some("on"));
        // The client alone, as REMOTE_ADDR: an app trusting whoever REMOTE_ADDR is as its
        // proxy would otherwise take the `6.6.6.6` the client wrote.
        assert_eq!(get("HTTP_X_FORWARDED_FOR"), Some("203.0.113.7"));
        assert_eq!(get("DOCUMENT_URI"), Some("/shop/cart.php"));
        assert_eq!(get("HTTP_HOST"), Some("shop.example:8443"));
    }

    #[test]
    fn a_request_without_host_gives_php_none() {
        // An HTTP/1.0 client that named no host: the head levee wrote has the upstream's.
        let head =
            b"GET /index.php HTTP/1.1\r\nHost: 127.0.0.1:9000\r\nX-Real-IP: 192.0.2.1\r\n\r\n";
        let begin = encode_begin(
            head,
            (http::Version::HTTP_10, false),
            &settings(None),
            (b"/index.php", b""),
            false,
            false,
        )
        .expect("encodes");
        let pairs = cgi_params(&begin);
        assert_eq!(pairs.get("HTTP_HOST"), None, "{pairs:?}");
        assert_eq!(
            pairs.get("HTTP_X_FORWARDED_FOR").map(String::as_str),
            Some("192.0.2.1")
        );
    }
}
