//! An upstream response's header fields, relayed to the client as the bytes the upstream sent.
//!
//! A pass-through response goes back with the upstream's own fields, minus the hop-by-hop
//! ones and the framing that levee redoes. Parsing every field into a `HeaderMap` only to
//! encode it again was the largest single cost of such a request (about a sixth of levee's
//! instructions per request). So when nothing on the request path reads the fields (no page
//! rewriting, no stale copy, no upgrade), the client keeps them as ranges of the head it
//! received, and the response encoder copies those ranges.
//!
//! Only heads whose every line ends in CRLF are relayed (`\n` alone is accepted when parsing
//! and must not reach the client), and only when the kept lines form at most [`MOST_RUNS`]
//! ranges; anything else is parsed into a `HeaderMap` as before.

use bytes::{BufMut, Bytes, BytesMut};

/// Most separate ranges of kept lines. A head needs one more range for every run of dropped
/// fields between kept ones; a usual one (`Connection`, `Content-Length` and perhaps
/// `Keep-Alive` among the rest) needs two or three.
pub const MOST_RUNS: usize = 8;

/// Which lines of a response head are kept: byte ranges, built while the head is parsed.
#[derive(Debug, Clone)]
pub struct FieldLines {
    /// Byte ranges of the head, whole lines with their CRLF, in order.
    runs: [(u32, u32); MOST_RUNS],
    run_count: usize,
    has_date: bool,
}

impl FieldLines {
    pub fn new() -> FieldLines {
        FieldLines {
            runs: [(0, 0); MOST_RUNS],
            run_count: 0,
            has_date: false,
        }
    }

    /// Keeps the field line at `start..end` of `head` (the CRLF included). False when the
    /// line does not end in CRLF or there is no room for another range: the head cannot be
    /// relayed.
    pub fn keep_line(&mut self, head: &[u8], start: usize, end: usize, is_date: bool) -> bool {
        let (Ok(start), Ok(end)) = (u32::try_from(start), u32::try_from(end)) else {
            return false;
        };
        let ends_in_crlf =
            end >= start + 2 && head.get(end as usize - 2..end as usize) == Some(b"\r\n");
        if !ends_in_crlf {
            return false;
        }
        self.has_date |= is_date;
        match self.runs[..self.run_count].last_mut() {
            Some(last) if last.1 == start => last.1 = end,
            _ if self.run_count < MOST_RUNS => {
                self.runs[self.run_count] = (start, end);
                self.run_count += 1;
            }
            _ => return false,
        }
        true
    }

    /// These lines of `head` (the bytes they were measured in), with the upstream's length.
    pub fn over(self, head: Bytes, content_length: Option<u64>) -> UpstreamFields {
        UpstreamFields {
            head,
            lines: self,
            content_length,
        }
    }
}

impl Default for FieldLines {
    fn default() -> Self {
        FieldLines::new()
    }
}

/// The kept field lines of an upstream response head, as received.
#[derive(Debug, Clone)]
pub struct UpstreamFields {
    head: Bytes,
    lines: FieldLines,
    /// The `Content-Length` to write. The upstream's own line is never relayed: the response
    /// framing settles the length (see `h1::encode::frame_response`) and the encoder writes it.
    pub content_length: Option<u64>,
}

impl UpstreamFields {
    fn runs(&self) -> &[(u32, u32)] {
        &self.lines.runs[..self.lines.run_count]
    }

    /// Bytes the kept lines take on the wire.
    pub fn len(&self) -> usize {
        self.runs()
            .iter()
            .map(|(start, end)| (end - start) as usize)
            .sum()
    }

    pub fn is_empty(&self) -> bool {
        self.lines.run_count == 0
    }

    /// Whether the upstream sent a `Date`; levee adds one only when it did not.
    pub fn has_date(&self) -> bool {
        self.lines.has_date
    }

    /// Appends the kept lines to `out`.
    pub fn write_to(&self, out: &mut BytesMut) {
        for &(start, end) in self.runs() {
            out.put_slice(&self.head[start as usize..end as usize]);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const HEAD: &[u8] =
        b"HTTP/1.1 200 OK\r\nServer: x\r\nConnection: keep-alive\r\nDate: d\r\nETag: e\r\n\r\n";

    fn line(name: &str) -> (usize, usize) {
        let text = std::str::from_utf8(HEAD).expect("ascii");
        let start = text.find(name).expect("field present");
        let end = start + text[start..].find("\r\n").expect("line end") + 2;
        (start, end)
    }

    #[test]
    fn kept_lines_are_written_as_received_in_merged_runs() {
        let mut lines = FieldLines::new();
        for (name, keep) in [
            ("Server", true),
            ("Connection", false),
            ("Date", true),
            ("ETag", true),
        ] {
            let (start, end) = line(name);
            if keep {
                assert!(lines.keep_line(HEAD, start, end, name == "Date"));
            }
        }
        // Date and ETag are adjacent: one range.
        assert_eq!(lines.run_count, 2);
        let fields = lines.over(Bytes::from_static(HEAD), None);
        let mut out = BytesMut::new();
        fields.write_to(&mut out);
        assert_eq!(&out[..], b"Server: x\r\nDate: d\r\nETag: e\r\n");
        assert_eq!(fields.len(), out.len());
        assert!(fields.has_date());
    }

    #[test]
    fn lines_without_crlf_or_past_the_last_range_are_refused() {
        let bare = b"HTTP/1.1 200 OK\r\nA: 1\nB: 2\r\n\r\n";
        assert!(!FieldLines::new().keep_line(bare, 17, 22, false));

        let many: String = (0..2 * MOST_RUNS)
            .map(|i| format!("F{i:02}: v\r\n"))
            .collect();
        let head = format!("HTTP/1.1 200 OK\r\n{many}\r\n");
        let mut lines = FieldLines::new();
        let mut kept = 0;
        // Every other line: each kept line is its own range.
        for index in (0..2 * MOST_RUNS).step_by(2) {
            let start = 17 + index * 8;
            if lines.keep_line(head.as_bytes(), start, start + 8, false) {
                kept += 1;
            }
        }
        assert_eq!(kept, MOST_RUNS);
        // A line that joins no range (the second one) finds no room.
        assert!(!lines.keep_line(head.as_bytes(), 17 + 8, 17 + 16, false));
    }
}
