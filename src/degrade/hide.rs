//! Hiding modules from pages while they stream: elements matching a switched-off module's
//! CSS selector are removed from `text/html` responses, and so is everything between
//! `<!-- levee:module NAME -->` and `<!-- /levee:module NAME -->` for modules whose selector
//! is `"marker"` (templates that cannot get an id). Everything else passes byte for byte.

use std::pin::Pin;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::task::{Context, Poll};

use bytes::{Bytes, BytesMut};
use http::{header, HeaderMap};
use http_body::{Body, Frame, SizeHint};
use lol_html::send::{HtmlRewriter, Settings};
use lol_html::{doc_comments, doc_text, element, OutputSink};
use pin_project_lite::pin_project;

use crate::error::BoxError;

/// The selector value that means "hide by comment markers".
pub const MARKER: &str = "marker";

/// Collects the rewriter's output for the next body frame.
struct Sink(Arc<Mutex<BytesMut>>);

impl OutputSink for Sink {
    fn handle_chunk(&mut self, chunk: &[u8]) {
        if let Ok(mut out) = self.0.lock() {
            out.extend_from_slice(chunk);
        }
    }
}

/// Should this response be rewritten at all? Only uncompressed HTML.
pub fn rewritable(headers: &HeaderMap) -> bool {
    let html = headers
        .get(header::CONTENT_TYPE)
        .and_then(|value| value.to_str().ok())
        .is_some_and(|value| {
            value
                .trim_start()
                .to_ascii_lowercase()
                .starts_with("text/html")
        });
    let encoded = headers
        .get(header::CONTENT_ENCODING)
        .and_then(|value| value.to_str().ok())
        .is_some_and(|value| !value.trim().eq_ignore_ascii_case("identity"));
    html && !encoded
}

fn marker_of(comment: &str) -> Option<(bool, &str)> {
    let text = comment.trim();
    if let Some(name) = text.strip_prefix("/levee:module ") {
        return Some((false, name.trim()));
    }
    text.strip_prefix("levee:module ")
        .map(|name| (true, name.trim()))
}

pin_project! {
    /// A body with the switched-off modules' fragments removed.
    pub struct Hidden<B> {
        #[pin]
        inner: B,
        rewriter: Option<HtmlRewriter<'static, Sink>>,
        output: Arc<Mutex<BytesMut>>,
    }
}

impl<B> Hidden<B> {
    /// `selectors`: CSS selectors to remove; `markers`: module names hidden by comments.
    pub fn new(inner: B, selectors: &[String], markers: Vec<String>) -> Hidden<B> {
        let output = Arc::new(Mutex::new(BytesMut::new()));
        let mut settings = Settings::new_send();
        for selector in selectors {
            settings = settings.append_element_content_handler(element!(selector.as_str(), |el| {
                el.remove();
                Ok(())
            }));
        }
        if !markers.is_empty() {
            // Depth of open hidden markers; inside one, every node is removed.
            let depth = Arc::new(AtomicUsize::new(0));
            let (in_elements, in_text, in_comments) = (depth.clone(), depth.clone(), depth);
            let markers = Arc::new(markers);
            settings = settings
                .append_element_content_handler(element!("*", move |el| {
                    if in_elements.load(Ordering::Relaxed) > 0 {
                        el.remove();
                    }
                    Ok(())
                }))
                .append_document_content_handler(doc_text!(move |text| {
                    if in_text.load(Ordering::Relaxed) > 0 {
                        text.remove();
                    }
                    Ok(())
                }))
                .append_document_content_handler(doc_comments!(move |comment| {
                    match marker_of(&comment.text()) {
                        Some((true, name)) if markers.iter().any(|m| m == name) => {
                            in_comments.fetch_add(1, Ordering::Relaxed);
                            comment.remove();
                        }
                        Some((false, name)) if markers.iter().any(|m| m == name) => {
                            comment.remove();
                            let _ = in_comments.fetch_update(
                                Ordering::Relaxed,
                                Ordering::Relaxed,
                                |d| d.checked_sub(1),
                            );
                        }
                        _ if in_comments.load(Ordering::Relaxed) > 0 => comment.remove(),
                        _ => {}
                    }
                    Ok(())
                }));
        }
        let rewriter = HtmlRewriter::new(settings, Sink(output.clone()));
        Hidden {
            inner,
            rewriter: Some(rewriter),
            output,
        }
    }
}

fn take(output: &Mutex<BytesMut>) -> Bytes {
    output
        .lock()
        .map(|mut out| out.split().freeze())
        .unwrap_or_default()
}

impl<B> Body for Hidden<B>
where
    B: Body<Data = Bytes, Error = BoxError>,
{
    type Data = Bytes;
    type Error = BoxError;

    fn poll_frame(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
    ) -> Poll<Option<Result<Frame<Bytes>, BoxError>>> {
        let mut this = self.project();
        loop {
            let Some(rewriter) = this.rewriter.as_mut() else {
                return Poll::Ready(None);
            };
            match this.inner.as_mut().poll_frame(cx) {
                Poll::Pending => return Poll::Pending,
                Poll::Ready(Some(Err(error))) => return Poll::Ready(Some(Err(error))),
                Poll::Ready(Some(Ok(frame))) => {
                    let Ok(data) = frame.into_data() else {
                        continue;
                    };
                    if let Err(error) = rewriter.write(&data) {
                        return Poll::Ready(Some(Err(Box::new(error))));
                    }
                    let out = take(this.output);
                    if !out.is_empty() {
                        return Poll::Ready(Some(Ok(Frame::data(out))));
                    }
                }
                Poll::Ready(None) => {
                    let finished = this.rewriter.take().map(HtmlRewriter::end);
                    if let Some(Err(error)) = finished {
                        return Poll::Ready(Some(Err(Box::new(error))));
                    }
                    let out = take(this.output);
                    return Poll::Ready((!out.is_empty()).then(|| Ok(Frame::data(out))));
                }
            }
        }
    }

    fn is_end_stream(&self) -> bool {
        self.rewriter.is_none()
    }

    fn size_hint(&self) -> SizeHint {
        // The length changes: never let a stale Content-Length frame the response.
        SizeHint::default()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use http_body_util::{BodyExt, StreamBody};

    async fn rewrite(
        html: &'static str,
        selectors: &[&str],
        markers: &[&str],
        chunk: usize,
    ) -> String {
        let chunks: Vec<Result<Frame<Bytes>, BoxError>> = html
            .as_bytes()
            .chunks(chunk)
            .map(|c| Ok(Frame::data(Bytes::copy_from_slice(c))))
            .collect();
        let body = StreamBody::new(futures_util::stream::iter(chunks));
        let selectors: Vec<String> = selectors.iter().map(|s| s.to_string()).collect();
        let hidden = Hidden::new(
            body,
            &selectors,
            markers.iter().map(|s| s.to_string()).collect(),
        );
        let bytes = hidden.collect().await.expect("rewrites").to_bytes();
        String::from_utf8(bytes.to_vec()).expect("utf-8")
    }

    const PAGE: &str = "<html><body><h1>论坛</h1><div id=\"ranking\"><ol><li>a</li></ol></div><p>keep</p><div data-module=\"visitors\">42 online</div></body></html>";

    #[tokio::test]
    async fn removes_exactly_the_selected_fragments_across_chunk_boundaries() {
        for chunk in [1, 7, 4096] {
            let out = rewrite(PAGE, &["#ranking"], &[], chunk).await;
            assert_eq!(
                out,
                PAGE.replace("<div id=\"ranking\"><ol><li>a</li></ol></div>", ""),
                "chunk {chunk}"
            );
        }
        let out = rewrite(PAGE, &["#ranking", "[data-module=visitors]"], &[], 16).await;
        assert_eq!(out, "<html><body><h1>论坛</h1><p>keep</p></body></html>");
    }

    #[tokio::test]
    async fn marker_comments_hide_what_they_enclose() {
        let page = "<p>a</p><!-- levee:module ads --><div>ad <b>bold</b></div>text<!-- note --><!-- /levee:module ads --><p>b</p><!-- levee:module other --><i>x</i><!-- /levee:module other -->";
        let out = rewrite(page, &[], &["ads"], 5).await;
        assert_eq!(
            out,
            "<p>a</p><p>b</p><!-- levee:module other --><i>x</i><!-- /levee:module other -->"
        );
    }

    #[test]
    fn only_plain_html_is_rewritten() {
        let mut headers = HeaderMap::new();
        headers.insert(
            header::CONTENT_TYPE,
            "text/html; charset=utf-8".parse().expect("value"),
        );
        assert!(rewritable(&headers));
        headers.insert(header::CONTENT_ENCODING, "gzip".parse().expect("value"));
        assert!(!rewritable(&headers));
        let mut json = HeaderMap::new();
        json.insert(
            header::CONTENT_TYPE,
            "application/json".parse().expect("value"),
        );
        assert!(!rewritable(&json));
    }
}
