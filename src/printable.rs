//! Text a client (or anyone who can write to Redis) chose, made safe to print on one line of
//! a log or a terminal.
//!
//! tracing's text format escapes terminal escape sequences but not line breaks: a decoded
//! path holding `%0A` and a forged timestamp would print as a log line of its own (a fake
//! admin action, a line that misleads fail2ban). Control characters are written escaped
//! (`\n`, `\u{1b}`), and so are the characters that break lines or turn text around in a
//! viewer without being control characters (U+2028, U+2029, the bidirectional overrides).

use std::borrow::Cow;
use std::fmt;

/// Whether `c` must not be printed as it is.
fn unprintable(c: char) -> bool {
    c.is_control()
        || matches!(
            c,
            '\u{2028}' | '\u{2029}' | '\u{200e}' | '\u{200f}' | '\u{202a}'..='\u{202e}' | '\u{2066}'..='\u{2069}'
        )
}

/// Whether `text` is printable ASCII alone: checked byte by byte, the usual case.
fn plain_ascii(text: &str) -> bool {
    text.bytes().all(|byte| (b' '..=b'~').contains(&byte))
}

/// `text` with its unprintable characters escaped; borrowed when there are none.
pub fn printable(text: &str) -> Cow<'_, str> {
    if plain_ascii(text) || !text.chars().any(unprintable) {
        return Cow::Borrowed(text);
    }
    Cow::Owned(
        text.chars()
            .map(|c| {
                if unprintable(c) {
                    c.escape_unicode().to_string()
                } else {
                    c.to_string()
                }
            })
            .collect(),
    )
}

/// A request target for a log line, printed as [`printable`] makes it (without a copy when
/// it is printable already, as nearly every one is).
pub struct PrintableUri<'a>(pub &'a http::Uri);

impl fmt::Display for PrintableUri<'_> {
    fn fmt(&self, formatter: &mut fmt::Formatter<'_>) -> fmt::Result {
        let plain = self
            .0
            .path_and_query()
            .is_none_or(|target| plain_ascii(target.as_str()));
        if plain {
            return fmt::Display::fmt(self.0, formatter);
        }
        formatter.write_str(&printable(&self.0.to_string()))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn line_breaks_controls_and_reversals_are_escaped_and_the_rest_kept() {
        assert!(matches!(printable("/forum/view.php"), Cow::Borrowed(_)));
        assert!(matches!(printable("/论坛"), Cow::Borrowed(_)));
        assert_eq!(
            printable("/x\n2026-12-06T09:00:00Z  INFO forged"),
            "/x\\u{a}2026-12-06T09:00:00Z  INFO forged"
        );
        assert_eq!(printable("a\r\u{1b}[31m"), "a\\u{d}\\u{1b}[31m");
        assert_eq!(printable("a\u{2028}b\u{202e}c"), "a\\u{2028}b\\u{202e}c");
        let uri: http::Uri = "/caf%C3%A9?q=1".parse().expect("uri");
        assert_eq!(PrintableUri(&uri).to_string(), "/caf%C3%A9?q=1");
    }
}
