//! Path normalisation before routing.
//!
//! Routes match the path the backend will act on, not the spelling the client chose, so
//! `/ranking`, `/./ranking`, `//ranking` and `/%72anking` all land on the same route. The
//! backend still receives the original request target: normalising is for matching only.

use std::borrow::Cow;

/// Why a path could not be normalised. Answered with 400.
#[derive(Debug, Clone, Copy, PartialEq, Eq, thiserror::Error)]
pub enum PathError {
    #[error("invalid percent-encoding in path")]
    BadPercentEncoding,
    /// `OPTIONS *` (about the server as a whole) and `CONNECT host:port` (a tunnel): a front
    /// nginx refuses both with 400 too, and levee has no path to route them by.
    #[error("the request target names no path (as `*` and `host:port` do): requests are served by path, and no tunnels are opened")]
    NotAbsolute,
}

/// Normalises a request path (without query) for matching:
/// percent-decodes the characters a path segment holds raw (unreserved, sub-delimiters, `:`
/// and `@`; RFC 3986 2.3 and 3.3), upper-cases the hex digits of the
/// escapes it keeps, collapses repeated slashes and resolves `.` and `..` segments
/// (RFC 3986 5.2.4; `..` never climbs above the root).
///
/// Returns the input unchanged (borrowed) in the common case where nothing needs doing.
pub fn normalise(path: &str) -> Result<Cow<'_, str>, PathError> {
    if !path.starts_with('/') {
        return Err(PathError::NotAbsolute);
    }
    if is_already_normal(path) {
        return Ok(Cow::Borrowed(path));
    }
    let decoded = decode_unreserved(path)?;
    let mut segments: Vec<&str> = Vec::new();
    let trailing_slash =
        decoded.ends_with('/') || decoded.ends_with("/.") || decoded.ends_with("/..");
    for segment in decoded.split('/') {
        match segment {
            "" | "." => {}
            ".." => {
                segments.pop();
            }
            other => segments.push(other),
        }
    }
    let mut out = String::with_capacity(decoded.len());
    for segment in &segments {
        out.push('/');
        out.push_str(segment);
    }
    if out.is_empty() || trailing_slash {
        out.push('/');
    }
    Ok(Cow::Owned(out))
}

/// The path as a backend that decodes `%2F` into a slash sees it (nginx does, and so do the
/// PHP routers that `rawurldecode` the path), normalised like [`normalise`]; `None` when the
/// path has no encoded slash. A backend that keeps `%2F` inside a segment sees
/// [`normalise`]'s view instead, so a request whose two views match different routes is
/// ambiguous: levee cannot know which route's policy the app will act under.
pub fn with_encoded_slashes_decoded(path: &str) -> Result<Option<String>, PathError> {
    let bytes = path.as_bytes();
    let has_encoded_slash = bytes
        .windows(3)
        .any(|window| window[0] == b'%' && window[1] == b'2' && matches!(window[2], b'f' | b'F'));
    if !has_encoded_slash {
        return Ok(None);
    }
    let mut slashes = String::with_capacity(path.len());
    let mut rest = path;
    while let Some(at) = rest.find('%') {
        slashes.push_str(&rest[..at]);
        let escape = rest.get(at..at + 3).unwrap_or(&rest[at..]);
        if escape.eq_ignore_ascii_case("%2f") {
            slashes.push('/');
            rest = &rest[at + 3..];
        } else {
            slashes.push('%');
            rest = &rest[at + 1..];
        }
    }
    slashes.push_str(rest);
    normalise(&slashes).map(|view| Some(view.into_owned()))
}

/// Fast path: no escapes, no empty or dot segments. One pass over the bytes: on every
/// request, three substring searches cost more than the rest of routing.
fn is_already_normal(path: &str) -> bool {
    let bytes = path.as_bytes();
    let mut at = 0;
    while at < bytes.len() {
        match bytes[at] {
            // Raw bytes beyond ASCII are matched percent-encoded, as route paths are written.
            b'%' | 0x80.. => return false,
            b'/' => {
                // What follows this slash up to the next one: empty, `.` or `..` need work.
                let rest = &bytes[at + 1..];
                let segment = rest.split(|byte| *byte == b'/').next().unwrap_or(rest);
                let is_last = segment.len() == rest.len();
                if (segment.is_empty() && !is_last) || segment == b"." || segment == b".." {
                    return false;
                }
                at += 1;
            }
            _ => at += 1,
        }
    }
    true
}

fn decode_unreserved(path: &str) -> Result<String, PathError> {
    let bytes = path.as_bytes();
    // Bytes, not chars: pushing each byte of a non-ASCII path as a `char` read it as Latin-1,
    // so `//é` normalised to `/Ã©` and missed the route that `/é` matches.
    let mut out = Vec::with_capacity(path.len());
    let mut i = 0;
    while i < bytes.len() {
        let byte = bytes[i];
        if byte >= 0x80 {
            // `/论坛` and `/%E8%AE%BA%E5%9D%9B` are one path to the backend: one route here.
            push_percent_encoded(&mut out, byte);
            i += 1;
            continue;
        }
        if byte != b'%' {
            out.push(byte);
            i += 1;
            continue;
        }
        let hi = bytes.get(i + 1).and_then(|b| hex(*b));
        let lo = bytes.get(i + 2).and_then(|b| hex(*b));
        let (Some(hi), Some(lo)) = (hi, lo) else {
            return Err(PathError::BadPercentEncoding);
        };
        let decoded = hi * 16 + lo;
        // Unreserved characters, and the sub-delimiters, `:` and `@` that a path segment
        // holds raw as well (RFC 3986 3.3): nginx decodes every escape before it looks for
        // the file, so `/x%28y%29.php` runs `/x(y).php` and must be its route.
        if is_unreserved_or_sub_delim(decoded) || matches!(decoded, b':' | b'@') {
            out.push(decoded);
        } else {
            push_percent_encoded(&mut out, decoded);
        }
        i += 3;
    }
    // Only ASCII escapes were replaced (by ASCII), so the bytes are still the input's UTF-8;
    // the error arm cannot be reached and is there only to avoid an unwrap.
    String::from_utf8(out).map_err(|_| PathError::BadPercentEncoding)
}

/// RFC 3986's unreserved (2.3) and sub-delimiter (2.2) characters.
pub(crate) const fn is_unreserved_or_sub_delim(b: u8) -> bool {
    b.is_ascii_alphanumeric()
        || matches!(
            b,
            b'-' | b'.'
                | b'_'
                | b'~'
                | b'!'
                | b'$'
                | b'&'
                | b'\''
                | b'('
                | b')'
                | b'*'
                | b'+'
                | b','
                | b';'
                | b'='
        )
}

/// Writes `byte` as `%XX` (upper-case hex, as RFC 3986 recommends).
pub(crate) fn push_percent_encoded(out: &mut Vec<u8>, byte: u8) {
    const DIGITS: &[u8; 16] = b"0123456789ABCDEF";
    out.extend_from_slice(&[
        b'%',
        DIGITS[usize::from(byte >> 4)],
        DIGITS[usize::from(byte & 15)],
    ]);
}

/// The value of one hex digit, either case.
pub(crate) fn hex(byte: u8) -> Option<u8> {
    match byte {
        b'0'..=b'9' => Some(byte - b'0'),
        b'a'..=b'f' => Some(byte - b'a' + 10),
        b'A'..=b'F' => Some(byte - b'A' + 10),
        _ => None,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn norm(path: &str) -> String {
        normalise(path).expect("valid path").into_owned()
    }

    #[test]
    fn encoded_slashes_decoded_view() {
        let view = |path: &str| with_encoded_slashes_decoded(path).expect("valid path");
        assert_eq!(view("/ranking/a"), None);
        assert_eq!(view("/%2Fpost.php").as_deref(), Some("/post.php"));
        assert_eq!(view("/ranking%2f..%2fadmin").as_deref(), Some("/admin"));
        assert_eq!(view("/x/..%2Franking").as_deref(), Some("/ranking"));
        assert_eq!(view("/a%2F%41%2fb").as_deref(), Some("/a/A/b"));
        // Only one level of decoding, as the backend does: `%252F` is `%2F` to it.
        assert_eq!(view("/a%252Fb"), None);
        assert_eq!(
            with_encoded_slashes_decoded("/a%2F%zz"),
            Err(PathError::BadPercentEncoding)
        );
    }

    #[test]
    fn raw_bytes_beyond_ascii_match_as_route_paths_are_written() {
        // Routes are compiled percent-encoded; a browser may send the same path raw.
        assert_eq!(
            normalise("/论坛//x").expect("valid").as_ref(),
            "/%E8%AE%BA%E5%9D%9B/x"
        );
        assert_eq!(
            normalise("/论坛/x").expect("valid"),
            normalise("/%e8%ae%ba%e5%9d%9b/x").expect("valid")
        );
    }

    #[test]
    fn common_paths_are_borrowed_unchanged() {
        assert!(matches!(
            normalise("/index.php"),
            Ok(Cow::Borrowed("/index.php"))
        ));
        assert!(matches!(normalise("/"), Ok(Cow::Borrowed("/"))));
    }

    #[test]
    fn the_fast_path_takes_exactly_the_paths_that_need_nothing() {
        // Every path of up to six bytes from the characters that matter.
        let mut paths = vec![String::new()];
        for _ in 0..6 {
            paths = paths
                .iter()
                .flat_map(|path| ["/", ".", "a", "%"].map(|piece| format!("{path}{piece}")))
                .chain(paths.iter().cloned())
                .collect();
            paths.sort();
            paths.dedup();
        }
        for path in paths.iter().filter(|path| path.starts_with('/')) {
            let needs_nothing = !path.contains('%')
                && !path.contains("//")
                && !path.contains("/./")
                && !path.contains("/../")
                && !path.ends_with("/.")
                && !path.ends_with("/..");
            assert_eq!(is_already_normal(path), needs_nothing, "{path}");
        }
    }

    #[test]
    fn dodges_land_on_the_same_path() {
        for dodge in [
            "/ranking",
            "/./ranking",
            "//ranking",
            "/%72anking",
            "/a/../ranking",
            "/%2E/ranking",
        ] {
            assert_eq!(norm(dodge), "/ranking", "{dodge}");
        }
    }

    #[test]
    fn reserved_escapes_stay_encoded() {
        assert_eq!(norm("/a%2fb"), "/a%2Fb");
        assert_eq!(norm("/a%20b"), "/a%20b");
        assert_eq!(norm("/a%3fb%23c%25d"), "/a%3Fb%23c%25d");
        // What a segment holds raw is the same character escaped: nginx runs the same file.
        assert_eq!(norm("/x%28y%29.php"), "/x(y).php");
        assert_eq!(
            norm("/%40admin/a%3Ab%2C%3B%3D%21%24%26%27%2A%2B"),
            "/@admin/a:b,;=!$&'*+"
        );
    }

    #[test]
    fn dot_dot_never_climbs_above_root() {
        assert_eq!(norm("/../../etc/passwd"), "/etc/passwd");
        assert_eq!(norm("/a/b/.."), "/a/");
        assert_eq!(norm("/a/."), "/a/");
        assert_eq!(norm("/.."), "/");
    }

    #[test]
    fn bad_escapes_are_errors() {
        assert_eq!(normalise("/a%zz"), Err(PathError::BadPercentEncoding));
        assert_eq!(normalise("/a%2"), Err(PathError::BadPercentEncoding));
        assert_eq!(normalise("*"), Err(PathError::NotAbsolute));
    }
}
