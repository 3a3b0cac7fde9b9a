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

/// The kept field lines of an upstream response head, as received.
#[derive(Debug, Clone)]
pub struct UpstreamFields {
    head: Bytes,
    /// Byte ranges of `head`, whole lines with their CRLF, in order.
    runs: [(u32, u32); MOST_RUNS],
    run_count: usize,
    /// The `Content-Length` to write. The upstream's own line is never relayed: the response
    /// framing settles the length (see `h1::encode::frame_response`) and the encoder writes it.
    pub content_length: Option<u64>,
    has_date: bool,
}

impl UpstreamFields {
    /// Starts with no lines kept, over a whole response head.
    pub fn new(head: Bytes) -> UpstreamFields {
        UpstreamFields {
            head,
            runs: [(0, 0); MOST_RUNS],
            run_count: 0,
            content_length: None,
            has_date: false,
        }
    }

    /// Keeps the field line at `start..end` of the head (the CRLF included). False when the
    /// line does not end in CRLF or there is no room for another range: the head cannot be
    /// relayed.
    pub fn keep_line(&mut self, start: usize, end: usize, is_date: bool) -> bool {
        let (Ok(start), Ok(end)) = (u32::try_from(start), u32::try_from(end)) else {
            return false;
        };
        if end < start + 2 || self.head.get(end as usize - 2..end as usize) != Some(b"\r\n") {
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

    /// Bytes the kept lines take on the wire.
    pub fn len(&self) -> usize {
        self.runs[..self.run_count]
            .iter()
            .map(|(start, end)| (end - start) as usize)
            .sum()
    }

    pub fn is_empty(&self) -> bool {
        self.run_count == 0
    }

    /// Whether the upstream sent a `Date`; levee adds one only when it did not.
    pub fn has_date(&self) -> bool {
        self.has_date
    }

    /// Appends the kept lines to `out`.
    pub fn write_to(&self, out: &mut BytesMut) {
        for &(start, end) in &self.runs[..self.run_count] {
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
        let mut fields = UpstreamFields::new(Bytes::from_static(HEAD));
        for (name, keep) in [
            ("Server", true),
            ("Connection", false),
            ("Date", true),
            ("ETag", true),
        ] {
            let (start, end) = line(name);
            if keep {
                assert!(fields.keep_line(start, end, name == "Date"));
            }
        }
        // Date and ETag are adjacent: one range.
        assert_eq!(fields.run_count, 2);
        let mut out = BytesMut::new();
        fields.write_to(&mut out);
        assert_eq!(&out[..], b"Server: x\r\nDate: d\r\nETag: e\r\n");
        assert_eq!(fields.len(), out.len());
        assert!(fields.has_date());
    }

    #[test]
    fn lines_without_crlf_or_past_the_last_range_are_refused() {
        let bare = b"HTTP/1.1 200 OK\r\nA: 1\nB: 2\r\n\r\n";
        let mut fields = UpstreamFields::new(Bytes::from_static(bare));
        assert!(!fields.keep_line(17, 22, false));

        let many: String = (0..2 * MOST_RUNS)
            .map(|i| format!("F{i:02}: v\r\n"))
            .collect();
        let head = format!("HTTP/1.1 200 OK\r\n{many}\r\n");
        let mut fields = UpstreamFields::new(Bytes::from(head));
        let mut kept = 0;
        // Every other line: each kept line is its own range.
        for index in (0..2 * MOST_RUNS).step_by(2) {
            let start = 17 + index * 8;
            if fields.keep_line(start, start + 8, false) {
                kept += 1;
            }
        }
        assert_eq!(kept, MOST_RUNS);
        // A line that joins no range (the second one) finds no room.
        assert!(!fields.keep_line(17 + 8, 17 + 16, false));
    }
}
