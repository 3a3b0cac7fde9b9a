//! Request heads on any bytes, arriving in any pieces, as a client connection reads them:
//! parse_head is called on a growing buffer (more bytes appended while it says `Ok(None)`),
//! the body of each parsed head is read off as its framing says (a length, or chunked), and
//! what follows is parsed as the next, pipelined, request.
//!
//! It must never panic, and:
//! - a parsed head is split off the front of the buffer, leaving exactly what followed it;
//!   `Ok(None)` takes nothing and waits only while the buffer is within the limit;
//! - the head's framing agrees with the fields it kept: Transfer-Encoding → chunked with no
//!   Content-Length left; otherwise at most one Content-Length, a plain decimal number, which
//!   is the body length (0: no body); HTTP/1.0 is never chunked; `close_after` only with
//!   chunked framing; `Connection: close` → not keep-alive; HTTP/1.0 without a keep-alive
//!   option → not keep-alive; 100-continue and upgrades only on HTTP/1.1;
//! - the requests (and their bodies) read from a stream do not depend on how it was cut into
//!   reads: fed whole and fed in pieces give the same requests and the same end, except that a
//!   head over the size limit may be refused for its size on a partial read before a later
//!   error in it is seen (and the size reported is what had arrived).
//!
//! The first input byte picks the head size limit (two top bits) and seeds the piece sizes;
//! the rest is the stream.

#![no_main]

use bytes::BytesMut;
use http::header;
use levee::proxy::h1::chunked::{ChunkedDecoder, ChunkedError};
use levee::proxy::h1::parse::{parse_head, BodyFraming, HeadError, RequestHead};
use libfuzzer_sys::fuzz_target;

const LIMITS: [usize; 4] = [16 * 1024, 64, 256, 1024];

mod pieces;
use pieces::{feed_next, Pieces};

/// What one request came to, for comparing runs.
#[derive(Debug, PartialEq)]
struct Request {
    method: String,
    uri: String,
    version: http::Version,
    fields: Vec<(String, Vec<u8>)>,
    framing: BodyFraming,
    keep_alive: bool,
    expect_continue: bool,
    wants_upgrade: bool,
    close_after: bool,
    body: Vec<u8>,
}

#[derive(Debug, PartialEq)]
enum End {
    /// The input ran out between requests, or inside a head.
    InHead,
    InBody,
    Refused(HeadError),
    BadBody(ChunkedError),
}

enum Phase {
    Head,
    Length(u64),
    Chunked(ChunkedDecoder),
}

/// The non-empty items of a comma-separated value, trimmed, as RFC 9110 5.6.1 lists are read.
fn items(value: &[u8]) -> impl Iterator<Item = &[u8]> {
    value
        .split(|&byte| byte == b',')
        .map(<[u8]>::trim_ascii)
        .filter(|item| !item.is_empty())
}

fn has_option(head: &RequestHead, option: &[u8]) -> bool {
    head.headers
        .get_all(header::CONNECTION)
        .iter()
        .flat_map(|value| items(value.as_bytes()))
        .any(|item| item.eq_ignore_ascii_case(option))
}

/// The invariants of one parsed head.
fn check(head: &RequestHead) {
    use http::Version;
    assert!(
        head.version == Version::HTTP_10 || head.version == Version::HTTP_11,
        "{head:?}"
    );
    let lengths: Vec<_> = head
        .headers
        .get_all(header::CONTENT_LENGTH)
        .iter()
        .collect();
    if head.headers.contains_key(header::TRANSFER_ENCODING) {
        assert_eq!(head.framing, BodyFraming::Chunked, "{head:?}");
        assert!(lengths.is_empty(), "length kept next to chunked: {head:?}");
    } else {
        assert!(lengths.len() <= 1, "more than one Content-Length: {head:?}");
        let expected = match lengths.first() {
            None => BodyFraming::Empty,
            Some(value) => {
                let text = value.as_bytes();
                assert!(
                    !text.is_empty() && text.iter().all(u8::is_ascii_digit),
                    "{head:?}"
                );
                let length: u64 = std::str::from_utf8(text)
                    .expect("digits")
                    .parse()
                    .unwrap_or_else(|_| panic!("Content-Length over u64 accepted: {head:?}"));
                if length == 0 {
                    BodyFraming::Empty
                } else {
                    BodyFraming::Length(length)
                }
            }
        };
        assert_eq!(head.framing, expected, "{head:?}");
    }
    if head.version == Version::HTTP_10 {
        assert_ne!(head.framing, BodyFraming::Chunked, "{head:?}");
        assert!(!head.expect_continue && !head.wants_upgrade, "{head:?}");
        if !has_option(head, b"keep-alive") {
            assert!(!head.keep_alive, "{head:?}");
        }
    }
    if head.close_after {
        assert_eq!(head.framing, BodyFraming::Chunked, "{head:?}");
    }
    if has_option(head, b"close") {
        assert!(!head.keep_alive, "{head:?}");
    }
    if head.expect_continue {
        assert_ne!(head.framing, BodyFraming::Empty, "{head:?}");
    }
    if head.wants_upgrade {
        assert!(head.headers.contains_key(header::UPGRADE), "{head:?}");
    }
}

/// Reads requests off `input` fed in pieces (`None`: all at once) until it runs out or
/// something is refused.
fn read(input: &[u8], limit: usize, mut pieces: Option<&mut Pieces>) -> (Vec<Request>, End) {
    let mut buffer = BytesMut::new();
    let mut requests: Vec<Request> = Vec::new();
    let mut phase = Phase::Head;
    let mut fed = 0;
    loop {
        // Work through what is buffered; `break` when more input is needed.
        loop {
            match &mut phase {
                Phase::Head => {
                    if buffer.is_empty() {
                        break;
                    }
                    let before = buffer.clone();
                    match parse_head(&mut buffer, limit) {
                        Ok(Some(head)) => {
                            assert!(buffer.len() < before.len(), "a head of no bytes");
                            assert!(
                                before.ends_with(&buffer),
                                "the bytes after the head were changed"
                            );
                            check(&head);
                            phase = match head.framing {
                                BodyFraming::Empty => Phase::Head,
                                BodyFraming::Length(length) => Phase::Length(length),
                                BodyFraming::Chunked => Phase::Chunked(ChunkedDecoder::new()),
                            };
                            requests.push(Request {
                                method: head.method.to_string(),
                                uri: head.uri.to_string(),
                                version: head.version,
                                fields: head
                                    .headers
                                    .iter()
                                    .map(|(name, value)| {
                                        (name.to_string(), value.as_bytes().to_vec())
                                    })
                                    .collect(),
                                framing: head.framing,
                                keep_alive: head.keep_alive,
                                expect_continue: head.expect_continue,
                                wants_upgrade: head.wants_upgrade,
                                close_after: head.close_after,
                                body: Vec::new(),
                            });
                        }
                        Ok(None) => {
                            assert_eq!(buffer, before, "Ok(None) took bytes");
                            assert!(buffer.len() <= limit, "over the limit and still waiting");
                            break;
                        }
                        // The connection answers 400 or 431 and closes: what is left of the
                        // buffer then does not matter.
                        Err(error) => return (requests, End::Refused(error)),
                    }
                }
                Phase::Length(remaining) => {
                    if buffer.is_empty() {
                        break;
                    }
                    let take = usize::try_from(*remaining)
                        .unwrap_or(usize::MAX)
                        .min(buffer.len());
                    *remaining -= take as u64;
                    let data = buffer.split_to(take);
                    requests
                        .last_mut()
                        .expect("a head")
                        .body
                        .extend_from_slice(&data);
                    if *remaining == 0 {
                        phase = Phase::Head;
                    }
                }
                Phase::Chunked(decoder) => match decoder.decode(&mut buffer) {
                    Ok(Some(data)) => requests
                        .last_mut()
                        .expect("a head")
                        .body
                        .extend_from_slice(&data),
                    Ok(None) if decoder.is_done() => phase = Phase::Head,
                    Ok(None) => break,
                    Err(error) => return (requests, End::BadBody(error)),
                },
            }
        }
        if fed == input.len() {
            let end = match phase {
                Phase::Head => End::InHead,
                Phase::Length(_) | Phase::Chunked(_) => End::InBody,
            };
            return (requests, end);
        }
        fed += feed_next(pieces.as_deref_mut(), &input[fed..], &mut buffer);
    }
}

fuzz_target!(|data: &[u8]| {
    let Some((&control, stream)) = data.split_first() else {
        return;
    };
    let limit = LIMITS[usize::from(control >> 6)];
    let (whole, whole_end) = read(stream, limit, None);
    let (split, split_end) = read(stream, limit, Some(&mut Pieces::new(control)));
    // The requests before the end are the same however the stream was cut.
    assert_eq!(whole, split, "limit {limit}, seed {control}");
    let too_large = |end: &End| {
        matches!(
            end,
            End::Refused(HeadError::TooLarge { .. } | HeadError::TargetTooLong { .. })
        )
    };
    if too_large(&split_end) && !too_large(&whole_end) {
        // An incomplete head already over the limit is refused at once; seen whole, the same
        // head may show a malformed part, or too many fields, first.
        assert!(
            matches!(whole_end, End::Refused(_)),
            "limit {limit}, seed {control}: {whole_end:?} / {split_end:?}"
        );
    } else if too_large(&whole_end) {
        // Sizes differ: a partial read reports the bytes it had.
        assert!(
            too_large(&split_end),
            "limit {limit}, seed {control}: {whole_end:?} / {split_end:?}"
        );
    } else {
        assert_eq!(whole_end, split_end, "limit {limit}, seed {control}");
    }
});
