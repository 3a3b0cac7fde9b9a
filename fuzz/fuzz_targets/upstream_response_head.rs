//! Upstream response heads on any bytes: the client's head parser (interim 1xx heads, the
//! final head, its framing and connection fields) must never panic. Heads are parsed off the
//! front one after another, as the client reads an upstream's answers, so:
//! - each head takes at least its status line and the empty line after the fields: no more
//!   heads than half the line feeds in the input;
//! - parsing needs no look-ahead: a prefix of the input never gives more heads than the whole.

#![no_main]

use levee::proxy::client::parse_response_heads_for_fuzzing;
use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    let heads = parse_response_heads_for_fuzzing(data);
    let line_feeds = data.iter().filter(|&&byte| byte == b'\n').count();
    assert!(
        heads * 2 <= line_feeds,
        "{heads} heads from {line_feeds} line feeds"
    );
    if let Some(&first) = data.first() {
        let cut = usize::from(first) * data.len() / 256;
        let prefix = parse_response_heads_for_fuzzing(&data[..cut]);
        assert!(
            prefix <= heads,
            "{prefix} heads from the first {cut} bytes, {heads} from all"
        );
    }
});
