//! Decoding `Transfer-Encoding: chunked` request bodies (RFC 9112 7.1), strictly.
//!
//! The decoder is a byte-level state machine over the connection's read buffer: it consumes
//! framing bytes as it goes and hands out chunk data as zero-copy slices of the buffer, so it
//! never buffers a body itself and never reads past the body's end (a pipelined request that
//! follows stays in the buffer). Anything that is not exactly the chunked syntax is an error,
//! because a proxy and its backend that disagree on where a body ends is how requests are
//! smuggled: bare LF line ends, missing CRLF after data, non-hex sizes and sizes that do not
//! fit 64 bits are refused. Chunk extensions and trailer fields are checked (no control bytes;
//! trailers are field lines) and skipped (levee forwards neither), within bounds.

use bytes::{Buf, Bytes, BytesMut};

use crate::proxy::path::hex;

/// Longest chunk extension accepted on one size line (nobody sends them in practice).
pub const MAX_EXTENSION_BYTES: usize = 4096;
/// Most chunk extension bytes accepted over a whole body: each line's bound alone let a
/// body of one-byte chunks carry thousands of times its size in extensions, through the
/// decoder and past `max_body`, which counts data only.
pub const MAX_EXTENSION_BYTES_IN_ALL: usize = 16 * 1024;
/// Most trailer bytes accepted after the last chunk.
pub const MAX_TRAILER_BYTES: usize = 16 * 1024;
/// A chunk size with more hex digits than this cannot fit in 64 bits.
const MAX_SIZE_DIGITS: u8 = 16;

#[derive(Debug, Clone, Copy, PartialEq, Eq, thiserror::Error)]
pub enum ChunkedError {
    #[error("invalid chunk size line")]
    InvalidSize,
    #[error("chunk size does not fit in 64 bits")]
    SizeTooLarge,
    #[error("chunk extension is over {MAX_EXTENSION_BYTES} bytes")]
    ExtensionTooLong,
    #[error("chunk extensions are over {MAX_EXTENSION_BYTES_IN_ALL} bytes in all")]
    ExtensionsTooLong,
    #[error("chunk data is not followed by CRLF")]
    MissingDataEnd,
    #[error("invalid line end (bare LF or CR)")]
    InvalidLineEnd,
    #[error("trailer fields are over {MAX_TRAILER_BYTES} bytes")]
    TrailersTooLong,
    #[error("control byte in a chunk extension")]
    InvalidExtension,
    #[error("invalid trailer field line")]
    InvalidTrailer,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum State {
    /// Hex digits of a chunk size; `digits` counted to refuse empty and overlong sizes.
    Size {
        size: u64,
        digits: u8,
    },
    /// Whitespace after the size, before `;` or CR.
    SizeSpace {
        size: u64,
    },
    /// Inside `;ext=value` after the size: skipped up to CR.
    Extension {
        size: u64,
        length: usize,
    },
    /// CR of the size line seen, LF expected.
    SizeLf {
        size: u64,
    },
    Data {
        remaining: u64,
    },
    DataCr,
    DataLf,
    /// After the last chunk: either the empty line that ends the body, or a trailer field.
    TrailerStart,
    /// A trailer field's name, up to its colon.
    TrailerName,
    /// A trailer field's value, up to CR.
    TrailerLine,
    TrailerLf,
    EndLf,
    Done,
}

/// Where a chunked body stands; fed from the front of the connection's read buffer.
#[derive(Debug, Clone)]
pub struct ChunkedDecoder {
    state: State,
    extension_bytes: usize,
    trailer_bytes: usize,
}

impl Default for ChunkedDecoder {
    fn default() -> Self {
        ChunkedDecoder::new()
    }
}

impl ChunkedDecoder {
    pub fn new() -> ChunkedDecoder {
        ChunkedDecoder {
            state: State::Size { size: 0, digits: 0 },
            extension_bytes: 0,
            trailer_bytes: 0,
        }
    }

    /// True once the final chunk and the trailer section have been consumed.
    pub fn is_done(&self) -> bool {
        self.state == State::Done
    }

    /// Consumes framing bytes from the front of `buffer` and returns the next piece of chunk
    /// data, if any is buffered. `Ok(None)` means more input is needed, or the body is done
    /// (see [`ChunkedDecoder::is_done`]). Bytes after the body's end are left in `buffer`.
    pub fn decode(&mut self, buffer: &mut BytesMut) -> Result<Option<Bytes>, ChunkedError> {
        loop {
            if let State::Data { remaining } = self.state {
                if buffer.is_empty() {
                    return Ok(None);
                }
                let take = usize::try_from(remaining)
                    .unwrap_or(usize::MAX)
                    .min(buffer.len());
                let left = remaining - take as u64;
                self.state = if left == 0 {
                    State::DataCr
                } else {
                    State::Data { remaining: left }
                };
                return Ok(Some(buffer.split_to(take).freeze()));
            }
            if self.state == State::Done {
                return Ok(None);
            }
            let Some(&byte) = buffer.first() else {
                return Ok(None);
            };
            buffer.advance(1);
            self.state = self.next_state(byte)?;
        }
    }

    /// One framing byte (anything but chunk data) moves the state machine by one step.
    fn next_state(&mut self, byte: u8) -> Result<State, ChunkedError> {
        let state = match self.state {
            State::Size { size, digits } => match hex(byte) {
                Some(value) => {
                    if digits >= MAX_SIZE_DIGITS {
                        return Err(ChunkedError::SizeTooLarge);
                    }
                    State::Size {
                        size: (size << 4) | u64::from(value),
                        digits: digits + 1,
                    }
                }
                None if digits == 0 => return Err(ChunkedError::InvalidSize),
                None => match byte {
                    b' ' | b'\t' => State::SizeSpace { size },
                    b';' => State::Extension { size, length: 0 },
                    b'\r' => State::SizeLf { size },
                    _ => return Err(ChunkedError::InvalidSize),
                },
            },
            State::SizeSpace { size } => match byte {
                b' ' | b'\t' => State::SizeSpace { size },
                b';' => State::Extension { size, length: 0 },
                b'\r' => State::SizeLf { size },
                _ => return Err(ChunkedError::InvalidSize),
            },
            State::Extension { size, length } => match byte {
                b'\r' => State::SizeLf { size },
                b'\n' => return Err(ChunkedError::InvalidLineEnd),
                _ if is_control(byte) => return Err(ChunkedError::InvalidExtension),
                _ if length >= MAX_EXTENSION_BYTES => return Err(ChunkedError::ExtensionTooLong),
                _ => {
                    self.extension_bytes += 1;
                    if self.extension_bytes > MAX_EXTENSION_BYTES_IN_ALL {
                        return Err(ChunkedError::ExtensionsTooLong);
                    }
                    State::Extension {
                        size,
                        length: length + 1,
                    }
                }
            },
            State::SizeLf { size } => match byte {
                b'\n' if size == 0 => State::TrailerStart,
                b'\n' => State::Data { remaining: size },
                _ => return Err(ChunkedError::InvalidLineEnd),
            },
            State::DataCr => match byte {
                b'\r' => State::DataLf,
                _ => return Err(ChunkedError::MissingDataEnd),
            },
            State::DataLf => match byte {
                b'\n' => State::Size { size: 0, digits: 0 },
                _ => return Err(ChunkedError::MissingDataEnd),
            },
            // Trailer lines are field lines (RFC 9112 7.1.2): a token, a colon, a value without
            // control bytes. Dropped all the same, but a line that is none (a request line, a
            // folded line, a NUL) is a client out of step with the syntax, and refused.
            State::TrailerStart => match byte {
                b'\r' => State::EndLf,
                b'\n' => return Err(ChunkedError::InvalidLineEnd),
                _ if is_token_byte(byte) => self.count_trailer_byte(State::TrailerName)?,
                _ => return Err(ChunkedError::InvalidTrailer),
            },
            State::TrailerName => match byte {
                b':' => self.count_trailer_byte(State::TrailerLine)?,
                _ if is_token_byte(byte) => self.count_trailer_byte(State::TrailerName)?,
                _ => return Err(ChunkedError::InvalidTrailer),
            },
            State::TrailerLine => match byte {
                b'\r' => State::TrailerLf,
                b'\n' => return Err(ChunkedError::InvalidLineEnd),
                _ if is_control(byte) => return Err(ChunkedError::InvalidTrailer),
                _ => self.count_trailer_byte(State::TrailerLine)?,
            },
            State::TrailerLf => match byte {
                b'\n' => State::TrailerStart,
                _ => return Err(ChunkedError::InvalidLineEnd),
            },
            State::EndLf => match byte {
                b'\n' => State::Done,
                _ => return Err(ChunkedError::InvalidLineEnd),
            },
            // `decode` handles these two without calling here.
            State::Data { .. } | State::Done => self.state,
        };
        Ok(state)
    }

    fn count_trailer_byte(&mut self, next: State) -> Result<State, ChunkedError> {
        self.trailer_bytes += 1;
        if self.trailer_bytes > MAX_TRAILER_BYTES {
            return Err(ChunkedError::TrailersTooLong);
        }
        Ok(next)
    }
}

/// A control byte other than tab (RFC 9110 5.5: never in a field value; RFC 9112 7.1.1: never
/// in a chunk extension, whose tokens and quoted strings exclude them).
fn is_control(byte: u8) -> bool {
    (byte < b' ' && byte != b'\t') || byte == 0x7f
}

/// A `tchar` of RFC 9110 5.6.2, what field names are made of.
fn is_token_byte(byte: u8) -> bool {
    byte.is_ascii_alphanumeric() || b"!#$%&'*+-.^_`|~".contains(&byte)
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Feeds `input` in pieces split at `splits`, collecting data until done or an error.
    fn decode_split(input: &[u8], splits: &[usize]) -> (Result<Vec<u8>, ChunkedError>, Vec<u8>) {
        let mut decoder = ChunkedDecoder::new();
        let mut buffer = BytesMut::new();
        let mut body = Vec::new();
        let mut start = 0;
        let mut ends: Vec<usize> = splits.to_vec();
        ends.push(input.len());
        for end in ends {
            buffer.extend_from_slice(&input[start..end]);
            start = end;
            loop {
                match decoder.decode(&mut buffer) {
                    Ok(Some(data)) => body.extend_from_slice(&data),
                    Ok(None) => break,
                    Err(error) => return (Err(error), buffer.to_vec()),
                }
            }
            if decoder.is_done() {
                // The rest of the input belongs to the next request.
                buffer.extend_from_slice(&input[start..]);
                return (Ok(body), buffer.to_vec());
            }
        }
        (Ok(body), buffer.to_vec())
    }

    #[test]
    fn decodes_chunks_extensions_and_trailers_split_at_every_byte() {
        let input: &[u8] = b"5\r\nhello\r\n6;name=\"v\"\r\n world\r\nA \r\n0123456789\r\n0\r\nX-Trailer: 1\r\n\r\nGET /next";
        let (whole, rest) = decode_split(input, &[]);
        assert_eq!(whole, Ok(b"hello world0123456789".to_vec()));
        assert_eq!(rest, b"GET /next");
        for split in 0..input.len() {
            let (body, rest) = decode_split(input, &[split]);
            assert_eq!(
                body,
                Ok(b"hello world0123456789".to_vec()),
                "split at {split}"
            );
            assert_eq!(rest, b"GET /next", "split at {split}");
        }
        // Byte by byte.
        let every: Vec<usize> = (1..input.len()).collect();
        let (body, rest) = decode_split(input, &every);
        assert_eq!(body, Ok(b"hello world0123456789".to_vec()));
        assert_eq!(rest, b"GET /next");
    }

    #[test]
    fn stops_exactly_at_the_end_of_the_body() {
        let mut decoder = ChunkedDecoder::new();
        let mut buffer = BytesMut::from(&b"0\r\n\r\n0\r\n\r\n"[..]);
        assert_eq!(decoder.decode(&mut buffer), Ok(None));
        assert!(decoder.is_done());
        assert_eq!(&buffer[..], b"0\r\n\r\n");
        // Done stays done and consumes nothing.
        assert_eq!(decoder.decode(&mut buffer), Ok(None));
        assert_eq!(&buffer[..], b"0\r\n\r\n");
    }

    #[test]
    fn refuses_what_is_not_exactly_chunked() {
        let cases: [(&[u8], ChunkedError); 16] = [
            (b"\r\n", ChunkedError::InvalidSize),
            (b"x\r\n", ChunkedError::InvalidSize),
            (b"-5\r\n", ChunkedError::InvalidSize),
            (b"5\nhello\r\n", ChunkedError::InvalidSize),
            (b"5\r\nhelloX\r\n", ChunkedError::MissingDataEnd),
            (b"5\r\nhello\rX", ChunkedError::MissingDataEnd),
            (b"5 x\r\n", ChunkedError::InvalidSize),
            (b"0\r\n\n", ChunkedError::InvalidLineEnd),
            (b"0\r\nX: 1\n\r\n", ChunkedError::InvalidLineEnd),
            (b"5\rX", ChunkedError::InvalidLineEnd),
            (b"3;a\x00b\r\n", ChunkedError::InvalidExtension),
            (
                b"0\r\nGET /smuggled HTTP/1.1\r\n",
                ChunkedError::InvalidTrailer,
            ),
            (b"0\r\n X: folded\r\n", ChunkedError::InvalidTrailer),
            (b"0\r\n: no name\r\n", ChunkedError::InvalidTrailer),
            (b"0\r\nX: \x00\r\n", ChunkedError::InvalidTrailer),
            (b"0\r\nX : 1\r\n", ChunkedError::InvalidTrailer),
        ];
        for (input, expected) in cases {
            let (result, _) = decode_split(input, &[]);
            assert_eq!(
                result,
                Err(expected),
                "{:?}",
                String::from_utf8_lossy(input)
            );
        }
    }

    #[test]
    fn bounds_sizes_extensions_and_trailers() {
        // 16 hex digits fit, 17 do not.
        let mut decoder = ChunkedDecoder::new();
        let mut buffer = BytesMut::from(&b"ffffffffffffffff\r\nab"[..]);
        assert_eq!(
            decoder
                .decode(&mut buffer)
                .map(|data| data.map(|d| d.to_vec())),
            Ok(Some(b"ab".to_vec()))
        );
        let (result, _) = decode_split(b"10000000000000000\r\n", &[]);
        assert_eq!(result, Err(ChunkedError::SizeTooLarge));

        let mut long_extension = b"1;".to_vec();
        long_extension.extend(std::iter::repeat_n(b'e', MAX_EXTENSION_BYTES + 1));
        let (result, _) = decode_split(&long_extension, &[]);
        assert_eq!(result, Err(ChunkedError::ExtensionTooLong));

        // Each line within its bound, but too many of them: one-byte chunks with long
        // extensions would carry thousands of times the body's size.
        let mut many_extensions = Vec::new();
        let line_extension = "e".repeat(MAX_EXTENSION_BYTES - 1);
        for _ in 0..=MAX_EXTENSION_BYTES_IN_ALL / MAX_EXTENSION_BYTES {
            many_extensions.extend_from_slice(format!("1;{line_extension}\r\nx\r\n").as_bytes());
        }
        let (result, _) = decode_split(&many_extensions, &[]);
        assert_eq!(result, Err(ChunkedError::ExtensionsTooLong));
        // A few short ones, as some clients send, are fine.
        let (result, _) = decode_split(b"1;a=1\r\nx\r\n1;b=2\r\ny\r\n0;c\r\n\r\n", &[]);
        assert_eq!(result, Ok(b"xy".to_vec()));

        let mut long_trailers = b"0\r\n".to_vec();
        for _ in 0..=MAX_TRAILER_BYTES / 9 {
            long_trailers.extend_from_slice(b"X-T: 1234\r\n");
        }
        let (result, _) = decode_split(&long_trailers, &[]);
        assert_eq!(result, Err(ChunkedError::TrailersTooLong));
    }

    #[test]
    fn hands_out_data_as_it_arrives_without_waiting_for_the_whole_chunk() {
        let mut decoder = ChunkedDecoder::new();
        let mut buffer = BytesMut::from(&b"a\r\nfirst"[..]);
        assert_eq!(
            decoder
                .decode(&mut buffer)
                .map(|data| data.map(|d| d.to_vec())),
            Ok(Some(b"first".to_vec()))
        );
        assert_eq!(decoder.decode(&mut buffer), Ok(None));
        assert!(!decoder.is_done());
        buffer.extend_from_slice(b" ten.\r\n0\r\n\r\n");
        assert_eq!(
            decoder
                .decode(&mut buffer)
                .map(|data| data.map(|d| d.to_vec())),
            Ok(Some(b" ten.".to_vec()))
        );
        assert_eq!(decoder.decode(&mut buffer), Ok(None));
        assert!(decoder.is_done());
    }
}
