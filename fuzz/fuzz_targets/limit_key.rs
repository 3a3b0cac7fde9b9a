//! Rate-limit key extraction on any client input: parsing key parts never panics, and a bucket
//! key built from any header, cookie and query values keeps its layout
//! `{prefix}rl:{tag}:{rule}:{values}` with a non-empty hash tag that Redis Cluster reads back
//! as exactly `tag`, and client values free of braces, separators, whitespace and control bytes.

#![no_main]

use std::net::IpAddr;

use http::{HeaderMap, HeaderName, HeaderValue, Method};
use levee::limit::key::{bucket_key, Identity, KeyPart, RequestFacts, Source};
use libfuzzer_sys::arbitrary::{Result, Unstructured};
use libfuzzer_sys::fuzz_target;

const PARTS: [&str; 8] = [
    "ip",
    "user",
    "api_key",
    "route",
    "method",
    "header:x-a",
    "cookie:c",
    "query:q",
];

/// The Redis Cluster hash tag of a key: between the first `{` and the first `}` after it, when
/// that is not empty; otherwise the whole key.
fn redis_hash_tag(key: &str) -> &str {
    key.find('{')
        .and_then(|open| {
            let rest = &key[open + 1..];
            rest.find('}')
                .filter(|close| *close > 0)
                .map(|close| &rest[..close])
        })
        .unwrap_or(key)
}

fn run(input: &mut Unstructured<'_>) -> Result<()> {
    let text: &str = input.arbitrary()?;
    let _ = Source::parse(text);
    let _ = KeyPart::parse(text);

    let mut parts = Vec::new();
    for _ in 0..input.int_in_range(0..=4)? {
        let text = input.choose(&PARTS)?;
        parts.push(KeyPart::parse(text).expect("listed parts parse"));
    }
    let header: &[u8] = input.arbitrary()?;
    let cookie: &str = input.arbitrary()?;
    let query: Option<&str> = input.arbitrary()?;
    let client_ip: IpAddr = if input.arbitrary()? {
        IpAddr::from(input.arbitrary::<[u8; 16]>()?)
    } else {
        IpAddr::from(input.arbitrary::<[u8; 4]>()?)
    };
    let fallback_ip: bool = input.arbitrary()?;
    let method = Method::from_bytes(input.arbitrary::<&[u8]>()?).unwrap_or(Method::GET);

    let mut headers = HeaderMap::new();
    if let Ok(value) = HeaderValue::from_bytes(header) {
        headers.insert(HeaderName::from_static("x-a"), value);
    }
    if let Ok(value) = HeaderValue::from_str(cookie) {
        headers.insert(http::header::COOKIE, value);
    }
    let identity = Identity {
        user: vec![
            Source::parse("header:x-a").expect("source"),
            Source::parse("cookie:c").expect("source"),
        ],
        api_key: vec![Source::parse("query:q").expect("source")],
    };
    let facts = RequestFacts {
        client_ip,
        route: "home",
        method: &method,
        headers: &headers,
        query,
        identity: &identity,
    };
    let Some(key) = bucket_key("levee:", "rule", &parts, &facts, fallback_ip) else {
        assert!(
            !fallback_ip && !parts.is_empty(),
            "only a missing part skips a rule"
        );
        return Ok(());
    };
    let head = format!("levee:rl:{{{}}}:rule:", key.tag());
    assert!(key.key.starts_with(&head), "{key:?}");
    assert!(!key.tag().is_empty(), "{key:?}");
    assert_eq!(redis_hash_tag(&key.key), key.tag(), "{key:?}");
    for text in [key.tag(), &key.key[head.len()..]] {
        assert!(
            text.bytes()
                .all(|b| b.is_ascii_graphic() && !matches!(b, b'{' | b'}' | b':')),
            "{key:?}"
        );
    }
    Ok(())
}

fuzz_target!(|data: &[u8]| {
    let _ = run(&mut Unstructured::new(data));
});
