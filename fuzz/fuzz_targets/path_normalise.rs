//! The path normaliser on any text: it must never panic, and what it returns must be in normal
//! form (absolute, no empty or dot segments, escapes only where needed, upper-case hex), stable
//! under a second pass, and the same with an extra leading slash.

#![no_main]

use levee::proxy::path::normalise;
use libfuzzer_sys::fuzz_target;

fn is_unreserved(byte: u8) -> bool {
    byte.is_ascii_alphanumeric() || matches!(byte, b'-' | b'.' | b'_' | b'~')
}

fn upper_hex(byte: u8) -> Option<u8> {
    match byte {
        b'0'..=b'9' => Some(byte - b'0'),
        b'A'..=b'F' => Some(byte - b'A' + 10),
        _ => None,
    }
}

fuzz_target!(|data: &[u8]| {
    let Ok(path) = std::str::from_utf8(data) else {
        return;
    };
    let result = normalise(path);
    let doubled = format!("/{path}");
    if path.starts_with('/') {
        assert_eq!(normalise(&doubled), result, "{path:?}");
    }
    let Ok(normal) = result else {
        return;
    };
    assert!(normal.starts_with('/'), "{path:?} -> {normal:?}");
    for dodge in ["//", "/./", "/../"] {
        assert!(!normal.contains(dodge), "{path:?} -> {normal:?}");
    }
    assert!(
        !normal.ends_with("/.") && !normal.ends_with("/.."),
        "{path:?} -> {normal:?}"
    );
    let bytes = normal.as_bytes();
    for (at, _) in normal.match_indices('%') {
        let hi = bytes.get(at + 1).copied().and_then(upper_hex);
        let lo = bytes.get(at + 2).copied().and_then(upper_hex);
        match (hi, lo) {
            (Some(hi), Some(lo)) => assert!(!is_unreserved(hi * 16 + lo), "{path:?} -> {normal:?}"),
            _ => panic!("{path:?} -> {normal:?}: escape at {at} is not %XX in upper case"),
        }
    }
    assert_eq!(
        normalise(&normal).as_deref(),
        Ok(&*normal),
        "not idempotent: {path:?}"
    );
});
