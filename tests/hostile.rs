//! Hostile input: every one is answered with a clear 4xx or a closed connection, and the
//! backend never sees an ambiguous request.

mod common;

use std::time::Duration;

use common::*;

async fn exchange(levee: &Levee, raw: &[u8]) -> String {
    raw_exchange(levee.public, raw, Duration::from_secs(5)).await
}

fn status_of(raw: &str) -> Option<u16> {
    raw.strip_prefix("HTTP/1.1 ")
        .and_then(|rest| rest.get(..3))
        .and_then(|code| code.parse().ok())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn smuggling_attempts_are_refused_never_forwarded_ambiguously() {
    let backend = echo_backend().await;
    let levee = Levee::start(&policy_for(backend.addr, "", "")).await;

    // Content-Length and Transfer-Encoding together: the HTTP parser keeps only the chunked
    // framing (RFC 9112 6.1) and closes the connection after answering, so the request hidden
    // behind the body is never read, and the backend gets one unambiguous chunked request.
    let answer = exchange(
        &levee,
        b"POST / HTTP/1.1\r\nHost: a\r\nContent-Length: 6\r\nTransfer-Encoding: chunked\r\n\r\n0\r\n\r\nGET /smuggled HTTP/1.1\r\nHost: a\r\n\r\n",
    )
    .await;
    assert_eq!(
        answer.matches("HTTP/1.1 ").count(),
        1,
        "exactly one answer: {answer}"
    );
    assert!(
        answer.to_ascii_lowercase().contains("connection: close"),
        "{answer}"
    );
    assert!(
        !answer.contains("\"content-length\""),
        "no Content-Length forwarded next to chunked: {answer}"
    );
    assert!(!answer.contains("/smuggled"), "{answer}");
    assert_eq!(backend.hits(), 1);

    let refused: [&[u8]; 3] = [
        b"POST / HTTP/1.1\r\nHost: a\r\nContent-Length: 5\r\nContent-Length: 40\r\n\r\nhello",
        b"POST / HTTP/1.1\r\nHost: a\r\nTransfer-Encoding: xchunked\r\n\r\n5\r\nhello\r\n0\r\n\r\n",
        b"POST / HTTP/1.1\r\nHost: a\r\nTransfer-Encoding: chunked, identity\r\n\r\n5\r\nhello\r\n0\r\n\r\n",
    ];
    for raw in refused {
        let answer = exchange(&levee, raw).await;
        assert!(
            matches!(status_of(&answer), Some(400..=499) | None),
            "{}\n=> {answer}",
            String::from_utf8_lossy(raw)
        );
    }
    assert_eq!(
        backend.hits(),
        1,
        "no ambiguous request reached the backend"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn malformed_requests_get_400_and_levee_keeps_serving() {
    let backend = echo_backend().await;
    let levee = Levee::start(&policy_for(backend.addr, "", "")).await;
    let garbage: [&[u8]; 5] = [
        b"GARBAGE\r\n\r\n",
        b"GET / HTTP/9.9\r\nHost: a\r\n\r\n",
        b"GET / HTTP/1.1\r\nHost: a\r\nBad Header: x\r\n\r\n",
        b"GET /\x01\x02 HTTP/1.1\r\nHost: a\r\n\r\n",
        b"GET / HTTP/1.1\r\nHost: a\r\nX: \xff\xfe\r\n\r\n",
    ];
    for raw in garbage {
        let answer = exchange(&levee, raw).await;
        let status = status_of(&answer);
        assert!(
            matches!(status, Some(400..=499) | Some(505) | None) || answer.contains("200 OK"),
            "{}\n=> {answer}",
            String::from_utf8_lossy(raw)
        );
    }
    // A flood of headers is refused as a whole.
    let mut flood = b"GET / HTTP/1.1\r\nHost: a\r\n".to_vec();
    for i in 0..500 {
        flood.extend_from_slice(format!("X-Flood-{i}: y\r\n").as_bytes());
    }
    flood.extend_from_slice(b"\r\n");
    let answer = exchange(&levee, &flood).await;
    assert!(
        matches!(status_of(&answer), Some(431) | Some(400) | None),
        "{answer}"
    );
    // Still healthy.
    assert_eq!(get(&levee.url("/ok")).await.status, 200);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn route_dodging_by_spelling_and_case_lands_where_the_backend_would() {
    let backend = echo_backend().await;
    let limited = echo_backend().await;
    let rest = format!(
        "[upstream.guarded]\nurl = \"http://{}\"\n[[route]]\nname = \"ranking\"\nmatch = {{ path_prefix = \"/ranking\" }}\nupstream = \"guarded\"\n",
        limited.addr
    );
    let levee = Levee::start(&policy_for(
        backend.addr,
        "default_upstream = \"app\"",
        &rest,
    ))
    .await;
    for path in [
        "/ranking",
        "/./ranking",
        "//ranking",
        "/%72anking",
        "/x/../ranking",
        "/ranking/../ranking",
    ] {
        assert_eq!(get(&levee.url(path)).await.status, 200, "{path}");
    }
    assert_eq!(
        limited.hits(),
        6,
        "every spelling reached the ranking route"
    );
    // Matching is case-sensitive, like the backend's file system: /Ranking is another path.
    assert_eq!(get(&levee.url("/Ranking")).await.status, 200);
    assert_eq!(limited.hits(), 6);
    assert_eq!(backend.hits(), 1);
}
