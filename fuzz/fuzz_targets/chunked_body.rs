//! The chunked body decoder on any bytes, fed in any pieces: it must never panic, and what it
//! makes of a stream must not depend on how the stream was cut into reads (the decoder is a
//! byte-level state machine; its own tests check every single split of one body). Decoding
//! the input whole and in pieces must give the same data, the same outcome (done, waiting for
//! more, or the same error), and, once done, leave the same bytes after the body untouched.
//! Every piece of data handed out is non-empty.
//!
//! The first input byte seeds the piece sizes; the rest is the stream. The same rest is also
//! encoded with levee's own chunk encoder (chunk sizes from the first byte) and must decode
//! back to itself, whatever the split.

#![no_main]

use bytes::BytesMut;
use levee::proxy::h1::chunked::{ChunkedDecoder, ChunkedError};
use levee::proxy::h1::encode::{encode_chunk_start, LAST_CHUNK};
use libfuzzer_sys::fuzz_target;

mod pieces;
use pieces::{feed_next, Pieces};

#[derive(Debug, PartialEq)]
enum Outcome {
    /// The body ended; the bytes after it.
    Done(Vec<u8>),
    /// The input ran out inside the body.
    Waiting,
    Failed(ChunkedError),
}

/// Decodes `input` fed in pieces (`None`: all at once), as the connection does: decode until
/// it asks for more, then append the next read.
fn decode(input: &[u8], pieces: Option<&mut Pieces>) -> (Vec<u8>, Outcome) {
    let mut decoder = ChunkedDecoder::new();
    let mut buffer = BytesMut::new();
    let mut body = Vec::new();
    let mut fed = 0;
    let mut pieces = pieces;
    loop {
        loop {
            let before = buffer.len();
            match decoder.decode(&mut buffer) {
                Ok(Some(data)) => {
                    assert!(!data.is_empty(), "an empty piece of data");
                    // Framing bytes before it are consumed too.
                    assert!(
                        buffer.len() + data.len() <= before,
                        "data not from the buffer"
                    );
                    body.extend_from_slice(&data);
                }
                Ok(None) => break,
                Err(error) => return (body, Outcome::Failed(error)),
            }
        }
        if decoder.is_done() {
            // Done stays done and takes nothing more.
            let left = buffer.len();
            assert_eq!(decoder.decode(&mut buffer), Ok(None));
            assert_eq!(buffer.len(), left, "consumed past the end of the body");
            let mut rest = buffer.to_vec();
            rest.extend_from_slice(&input[fed..]);
            return (body, Outcome::Done(rest));
        }
        assert!(
            buffer.is_empty(),
            "waiting for more with bytes still buffered"
        );
        if fed == input.len() {
            return (body, Outcome::Waiting);
        }
        fed += feed_next(pieces.as_deref_mut(), &input[fed..], &mut buffer);
    }
}

fuzz_target!(|data: &[u8]| {
    let Some((&seed, stream)) = data.split_first() else {
        return;
    };
    let whole = decode(stream, None);
    let split = decode(stream, Some(&mut Pieces::new(seed)));
    assert_eq!(whole, split, "split with seed {seed}");
    let bytewise = decode(stream, Some(&mut Pieces::bytewise()));
    assert_eq!(whole, bytewise, "byte by byte");

    // Round trip: levee's encoder, then the decoder.
    let chunk = 1 + usize::from(seed % 23);
    let mut encoded = BytesMut::new();
    for piece in stream.chunks(chunk) {
        encode_chunk_start(&mut encoded, piece.len());
        encoded.extend_from_slice(piece);
        encoded.extend_from_slice(b"\r\n");
    }
    encoded.extend_from_slice(LAST_CHUNK);
    let after = b"GET / HTTP/1.1\r\n";
    encoded.extend_from_slice(after);
    let (body, outcome) = decode(&encoded, Some(&mut Pieces::new(seed.wrapping_add(1))));
    assert_eq!(body, stream, "round trip");
    assert_eq!(outcome, Outcome::Done(after.to_vec()), "round trip");
});
