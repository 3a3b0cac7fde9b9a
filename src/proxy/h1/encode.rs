//! Response heads and body framing on the wire.

use std::cell::Cell;
use std::time::{SystemTime, UNIX_EPOCH};

use bytes::{BufMut, BytesMut};
use http::header::{self, HeaderValue};
use http::{HeaderMap, Method, StatusCode, Version};

use crate::proxy::header::{response_spelling, ReceivedHead};
use crate::proxy::upstream_fields::UpstreamFields;

/// How a response body is delimited on the wire.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ResponseFraming {
    /// No body is sent at all (HEAD, 1xx, 204, 304).
    None,
    /// The body's exact size is known up front.
    Length(u64),
    /// HTTP/1.1 with an unknown size.
    Chunked,
    /// HTTP/1.0 with an unknown size: the end of the body is the end of the connection.
    UntilClose,
}

/// Chooses the framing of a response and sets the framing and connection fields to match.
///
/// `exact_size` is the body's exact size hint: a body that knows its size keeps it as
/// `Content-Length` (the upstream's length travels through levee unchanged), anything else is
/// chunked for HTTP/1.1 clients and close-delimited for HTTP/1.0 ones. `keep_alive` comes in
/// as what the connection would like and goes out as what this response allows.
///
/// With `relayed` fields, the length lives there instead of in `headers` (see
/// [`UpstreamFields::content_length`]); everything else is the same.
pub fn frame_response(
    request_method: &Method,
    request_version: Version,
    status: StatusCode,
    headers: &mut HeaderMap,
    relayed: Option<&mut UpstreamFields>,
    exact_size: Option<u64>,
    keep_alive: &mut bool,
) -> ResponseFraming {
    // levee redoes the framing itself; whatever the handler left must not contradict it.
    headers.remove(header::TRANSFER_ENCODING);
    if connection_says_close(headers) {
        *keep_alive = false;
    }
    let mut length = LengthField { headers, relayed };
    let framing = if status.is_informational() || status == StatusCode::NO_CONTENT {
        length.remove();
        ResponseFraming::None
    } else if *request_method == Method::HEAD || status == StatusCode::NOT_MODIFIED {
        // The length of the body a GET would get may be given; none is sent.
        if let (false, Some(size), true) = (
            length.is_given(),
            exact_size,
            *request_method == Method::HEAD,
        ) {
            length.set(size);
        }
        ResponseFraming::None
    } else if let Some(size) = exact_size {
        // Usually the upstream's own field, already right: kept rather than rebuilt.
        if length.given() != Some(size) {
            length.set(size);
        }
        ResponseFraming::Length(size)
    } else if request_version == Version::HTTP_11 {
        length.remove();
        length.headers.insert(
            header::TRANSFER_ENCODING,
            HeaderValue::from_static("chunked"),
        );
        ResponseFraming::Chunked
    } else {
        length.remove();
        *keep_alive = false;
        ResponseFraming::UntilClose
    };
    let headers = &mut *length.headers;
    if status != StatusCode::SWITCHING_PROTOCOLS {
        if !*keep_alive && request_version == Version::HTTP_11 && !connection_says_close(headers) {
            headers.insert(header::CONNECTION, HeaderValue::from_static("close"));
        } else if *keep_alive && request_version == Version::HTTP_10 {
            // HTTP/1.0 closes by default; say that this connection stays.
            headers.insert(header::CONNECTION, HeaderValue::from_static("keep-alive"));
        }
    }
    framing
}

fn connection_says_close(headers: &HeaderMap) -> bool {
    super::super::header::connection_has(headers, "close")
}

/// A response's `Content-Length`: a field of its header map, or the length its relayed
/// upstream fields carry.
struct LengthField<'a> {
    headers: &'a mut HeaderMap,
    relayed: Option<&'a mut UpstreamFields>,
}

impl LengthField<'_> {
    fn given(&self) -> Option<u64> {
        match &self.relayed {
            Some(relayed) => relayed.content_length,
            None => self
                .headers
                .get(header::CONTENT_LENGTH)
                .and_then(|value| value.to_str().ok())
                .and_then(|text| text.parse::<u64>().ok()),
        }
    }

    fn is_given(&self) -> bool {
        match &self.relayed {
            Some(relayed) => relayed.content_length.is_some(),
            None => self.headers.contains_key(header::CONTENT_LENGTH),
        }
    }

    fn set(&mut self, size: u64) {
        match &mut self.relayed {
            Some(relayed) => relayed.content_length = Some(size),
            None => {
                self.headers
                    .insert(header::CONTENT_LENGTH, HeaderValue::from(size));
            }
        }
    }

    fn remove(&mut self) {
        match &mut self.relayed {
            Some(relayed) => relayed.content_length = None,
            None => {
                self.headers.remove(header::CONTENT_LENGTH);
            }
        }
    }
}

/// Writes the status line, the header fields (the relayed upstream ones first; the others
/// named as in `received`, see [`response_spelling`]), a `Date` unless one is set, and the
/// blank line. `body_room`: bytes of body that will follow in
/// `out`, reserved with the head's.
pub fn encode_head(
    out: &mut BytesMut,
    (status, reason): (StatusCode, Option<&[u8]>),
    (headers, received): (&HeaderMap, Option<&ReceivedHead>),
    relayed: Option<&UpstreamFields>,
    body_room: usize,
) {
    let relayed_bytes = relayed.map_or(0, |relayed| relayed.len() + 40);
    let reason = reason.unwrap_or(status.canonical_reason().unwrap_or("").as_bytes());
    out.reserve(
        64 + reason.len()
            + crate::proxy::header::header_bytes(headers)
            + relayed_bytes
            + 40
            + body_room,
    );
    out.put_slice(b"HTTP/1.1 ");
    out.put_slice(status.as_str().as_bytes());
    out.put_u8(b' ');
    out.put_slice(reason);
    out.put_slice(b"\r\n");
    let mut has_date = false;
    if let Some(relayed) = relayed {
        relayed.write_to(out);
        if let Some(length) = relayed.content_length {
            let mut digits = itoa::Buffer::new();
            encode_field(out, "Content-Length", digits.format(length).as_bytes());
        }
        has_date = relayed.has_date();
    }
    for (name, value) in headers {
        // The app's fields as it spelled them, levee's own in their usual capitalisation, as
        // the app and nginx write them.
        let spelled = response_spelling(received, name, value.as_bytes());
        encode_field_named(out, spelled, value.as_bytes());
    }
    if !has_date && !headers.contains_key(header::DATE) {
        encode_field(out, "Date", &http_date_now());
    }
    out.put_slice(b"\r\n");
}

/// One `name: value` line of a head.
pub fn encode_field(out: &mut BytesMut, name: &str, value: &[u8]) {
    encode_field_named(out, name.as_bytes(), value);
}

/// [`encode_field`] with the name as bytes (a name spelled as a client sent it).
pub fn encode_field_named(out: &mut BytesMut, name: &[u8], value: &[u8]) {
    out.put_slice(name);
    out.put_slice(b": ");
    out.put_slice(value);
    out.put_slice(b"\r\n");
}

/// The line that opens one chunk of `length` bytes.
pub fn encode_chunk_start(out: &mut BytesMut, length: usize) {
    // By hand rather than `write!`: formatting machinery costs more than the size line.
    const DIGITS: usize = 2 * std::mem::size_of::<usize>();
    let mut line = [0u8; DIGITS + 2];
    line[DIGITS..].copy_from_slice(b"\r\n");
    let (mut rest, mut start) = (length, DIGITS);
    loop {
        start -= 1;
        line[start] = b"0123456789abcdef"[rest & 0xf];
        rest >>= 4;
        if rest == 0 {
            break;
        }
    }
    out.put_slice(&line[start..]);
}

/// The last chunk, no trailers.
pub const LAST_CHUNK: &[u8] = b"0\r\n\r\n";

/// An IMF-fixdate is always this long: `Sun, 06 Nov 1994 08:49:37 GMT`.
const HTTP_DATE_LENGTH: usize = 29;

thread_local! {
    /// The formatted date of the current second, per worker thread: formatting it for every
    /// response would cost more than the rest of the head.
    static DATE: Cell<(u64, [u8; HTTP_DATE_LENGTH])> = const { Cell::new((u64::MAX, [b' '; HTTP_DATE_LENGTH])) };
}

/// The current time as an HTTP date, formatted at most once per second and thread.
pub fn http_date_now() -> [u8; HTTP_DATE_LENGTH] {
    let now = SystemTime::now();
    let second = now
        .duration_since(UNIX_EPOCH)
        .map_or(0, |since| since.as_secs());
    DATE.with(|cached| {
        let (cached_second, formatted) = cached.get();
        if cached_second == second {
            return formatted;
        }
        let mut fresh = [b' '; HTTP_DATE_LENGTH];
        let text = httpdate::fmt_http_date(now);
        let length = text.len().min(HTTP_DATE_LENGTH);
        fresh[..length].copy_from_slice(&text.as_bytes()[..length]);
        cached.set((second, fresh));
        fresh
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::proxy::upstream_fields::FieldLines;

    #[test]
    fn chunk_size_lines_are_lower_case_hex() {
        for length in [0, 1, 9, 10, 15, 16, 255, 4096, 0xdead_beef, usize::MAX] {
            let mut out = BytesMut::new();
            encode_chunk_start(&mut out, length);
            assert_eq!(&out[..], format!("{length:x}\r\n").as_bytes());
        }
    }

    fn framed(
        method: Method,
        version: Version,
        status: u16,
        exact: Option<u64>,
        headers: &[(&str, &str)],
    ) -> (ResponseFraming, HeaderMap, bool) {
        let mut map = HeaderMap::new();
        for (name, value) in headers {
            map.append(
                http::header::HeaderName::from_bytes(name.as_bytes()).expect("name"),
                HeaderValue::from_str(value).expect("value"),
            );
        }
        let mut keep_alive = true;
        let framing = frame_response(
            &method,
            version,
            StatusCode::from_u16(status).expect("status"),
            &mut map,
            None,
            exact,
            &mut keep_alive,
        );
        (framing, map, keep_alive)
    }

    #[test]
    fn exact_sizes_become_content_length_and_the_rest_is_chunked() {
        let (framing, headers, keep) = framed(Method::GET, Version::HTTP_11, 200, Some(5), &[]);
        assert_eq!(framing, ResponseFraming::Length(5));
        assert_eq!(headers[header::CONTENT_LENGTH], "5");
        assert!(keep);
        let (framing, headers, keep) = framed(
            Method::GET,
            Version::HTTP_11,
            200,
            None,
            &[("content-length", "7")],
        );
        assert_eq!(framing, ResponseFraming::Chunked);
        assert!(!headers.contains_key(header::CONTENT_LENGTH));
        assert_eq!(headers[header::TRANSFER_ENCODING], "chunked");
        assert!(keep);
        // HTTP/1.0 has no chunked: the body ends with the connection.
        let (framing, headers, keep) = framed(Method::GET, Version::HTTP_10, 200, None, &[]);
        assert_eq!(framing, ResponseFraming::UntilClose);
        assert!(!keep);
        assert!(!headers.contains_key(header::CONNECTION));
    }

    #[test]
    fn bodiless_responses_send_no_body() {
        for status in [101, 204] {
            let (framing, headers, _) = framed(
                Method::GET,
                Version::HTTP_11,
                status,
                Some(0),
                &[("content-length", "0")],
            );
            assert_eq!(framing, ResponseFraming::None, "{status}");
            assert!(!headers.contains_key(header::CONTENT_LENGTH), "{status}");
        }
        let (framing, headers, _) = framed(
            Method::GET,
            Version::HTTP_11,
            304,
            None,
            &[("content-length", "12")],
        );
        assert_eq!(framing, ResponseFraming::None);
        assert_eq!(headers[header::CONTENT_LENGTH], "12");
        let (framing, headers, _) = framed(Method::HEAD, Version::HTTP_11, 200, Some(9), &[]);
        assert_eq!(framing, ResponseFraming::None);
        assert_eq!(headers[header::CONTENT_LENGTH], "9");
    }

    #[test]
    fn connection_fields_match_what_the_connection_does() {
        let (_, headers, keep) = framed(
            Method::GET,
            Version::HTTP_11,
            400,
            Some(3),
            &[("connection", "close")],
        );
        assert!(!keep);
        assert_eq!(headers.get_all(header::CONNECTION).iter().count(), 1);
        let (_, headers, keep) = framed(Method::GET, Version::HTTP_10, 200, Some(3), &[]);
        assert!(keep);
        assert_eq!(headers[header::CONNECTION], "keep-alive");
    }

    /// Upstream fields as a pass-through relays them: `lines` as received, and the length.
    fn relayed(lines: &str, content_length: Option<u64>) -> UpstreamFields {
        let head = format!("HTTP/1.1 200 OK\r\n{lines}\r\n");
        let mut kept = FieldLines::new();
        let end = 17 + lines.len();
        let has_date = lines.to_ascii_lowercase().contains("date:");
        assert!(kept.keep_line(head.as_bytes(), 17, end, has_date));
        kept.over(bytes::Bytes::from(head), content_length)
    }

    #[test]
    fn relayed_fields_carry_the_length_the_framing_settles_on() {
        let frame = |method: Method, status: u16, exact: Option<u64>, given: Option<u64>| {
            let mut fields = relayed("Server: a\r\n", given);
            let mut headers = HeaderMap::new();
            let mut keep_alive = true;
            let framing = frame_response(
                &method,
                Version::HTTP_11,
                StatusCode::from_u16(status).expect("status"),
                &mut headers,
                Some(&mut fields),
                exact,
                &mut keep_alive,
            );
            // The length never goes into the map when the fields are relayed.
            assert!(!headers.contains_key(header::CONTENT_LENGTH));
            (framing, fields.content_length, headers)
        };
        assert_eq!(
            frame(Method::GET, 200, Some(5), Some(5)),
            (ResponseFraming::Length(5), Some(5), HeaderMap::new())
        );
        // HEAD: the length a GET would get stays; none is made up from the empty body.
        let (framing, length, _) = frame(Method::HEAD, 200, Some(0), Some(1234));
        assert_eq!((framing, length), (ResponseFraming::None, Some(1234)));
        let (framing, length, _) = frame(Method::HEAD, 200, Some(0), None);
        assert_eq!((framing, length), (ResponseFraming::None, Some(0)));
        // A relayed 304 keeps the length it gave; a 204 has none.
        let (framing, length, _) = frame(Method::GET, 304, Some(0), Some(1234));
        assert_eq!((framing, length), (ResponseFraming::None, Some(1234)));
        let (framing, length, _) = frame(Method::GET, 204, Some(0), Some(0));
        assert_eq!((framing, length), (ResponseFraming::None, None));
        let (framing, length, headers) = frame(Method::GET, 200, None, None);
        assert_eq!((framing, length), (ResponseFraming::Chunked, None));
        assert_eq!(headers[header::TRANSFER_ENCODING], "chunked");
    }

    #[test]
    fn relayed_fields_go_first_with_the_length_and_their_own_date() {
        let mut headers = HeaderMap::new();
        headers.insert("ratelimit", HeaderValue::from_static("limit=1"));
        let fields = relayed(
            "Server: a\r\nDate: Tue, 01 Dec 2026 10:00:00 GMT\r\n",
            Some(2),
        );
        let mut out = BytesMut::new();
        encode_head(
            &mut out,
            (StatusCode::OK, None),
            (&headers, None),
            Some(&fields),
            0,
        );
        assert_eq!(
            &out[..],
            b"HTTP/1.1 200 OK\r\nServer: a\r\nDate: Tue, 01 Dec 2026 10:00:00 GMT\r\n\
              Content-Length: 2\r\nRateLimit: limit=1\r\n\r\n"
        );
        // Without the upstream's Date, levee adds its own.
        let fields = relayed("Server: a\r\n", None);
        let mut out = BytesMut::new();
        encode_head(
            &mut out,
            (StatusCode::OK, None),
            (&HeaderMap::new(), None),
            Some(&fields),
            0,
        );
        let text = String::from_utf8(out.to_vec()).expect("ascii");
        assert!(
            text.starts_with("HTTP/1.1 200 OK\r\nServer: a\r\nDate: "),
            "{text}"
        );
    }

    #[test]
    fn heads_are_encoded_with_a_date() {
        let mut headers = HeaderMap::new();
        headers.insert(header::CONTENT_LENGTH, HeaderValue::from(2u64));
        let mut out = BytesMut::new();
        encode_head(
            &mut out,
            (StatusCode::NOT_FOUND, None),
            (&headers, None),
            None,
            0,
        );
        let text = String::from_utf8(out.to_vec()).expect("ascii");
        assert!(
            text.starts_with("HTTP/1.1 404 Not Found\r\nContent-Length: 2\r\nDate: "),
            "{text}"
        );
        assert!(text.ends_with(" GMT\r\n\r\n"), "{text}");
        let date = &text[text.find("Date: ").expect("date") + 6..text.len() - 4];
        assert!(httpdate::parse_http_date(date).is_ok(), "{date}");
        let mut out = BytesMut::new();
        encode_chunk_start(&mut out, 255);
        assert_eq!(&out[..], b"ff\r\n");
    }
}
