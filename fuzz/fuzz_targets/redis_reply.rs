//! Redis (RESP2) replies on any bytes: the batch worker's reply reader must never panic, nor
//! must splitting a bulk reply into the answers of a batch of 1–4-rule requests. Replies are
//! taken off the front one after another, as the worker reads them, so:
//! - every reply ends with its own CRLF: no more replies than CRLFs in the input;
//! - reading needs no look-ahead: a prefix of the input never gives more replies than the
//!   whole.
//!
//! The first input byte picks the rules per request (1 + byte % 4) and where the prefix is
//! cut; the rest is what Redis sent.

#![no_main]

use levee::redis_batch::read_replies_for_fuzzing;
use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    let Some((&control, sent)) = data.split_first() else {
        return;
    };
    let rules = 1 + usize::from(control % 4);
    let replies = read_replies_for_fuzzing(sent, rules);
    let crlfs = sent.windows(2).filter(|pair| pair == b"\r\n").count();
    assert!(replies <= crlfs, "{replies} replies from {crlfs} CRLFs");
    let cut = usize::from(control) * sent.len() / 256;
    let prefix = read_replies_for_fuzzing(&sent[..cut], rules);
    assert!(
        prefix <= replies,
        "{prefix} replies from the first {cut} bytes, {replies} from all"
    );
});
