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
use lol_html::{doc_comments, doc_text, element, end_tag, OutputSink};
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

/// What to look for before parsing: the page is passed on untouched up to the first tag that
/// could match, so the HTML parser only runs over the part of the page that matters.
#[derive(Debug, Clone)]
struct Plan {
    /// Byte strings whose first occurrence marks where parsing must begin; empty: parse all.
    needles: Vec<Vec<u8>>,
    /// Elements whose end ends the work (all selectors are ids, each found once); 0: never.
    stop_after: usize,
}

/// The literal a simple selector needs to appear in the page: `#id`, `tag#id`, `.class`,
/// `[attr=value]`, `tag`. `None` for anything more complex.
fn needle_of(selector: &str) -> Option<(Vec<u8>, bool)> {
    let selector = selector.trim();
    if selector.contains([' ', '>', '+', '~', ',', ':']) {
        return None;
    }
    if let Some(at) = selector.find('#') {
        let id = &selector[at + 1..];
        let plain = !id.is_empty()
            && id
                .chars()
                .all(|c| c.is_ascii_alphanumeric() || c == '-' || c == '_');
        return plain.then(|| (id.as_bytes().to_vec(), true));
    }
    if let Some(class) = selector.strip_prefix('.') {
        let plain = !class.is_empty()
            && class
                .chars()
                .all(|c| c.is_ascii_alphanumeric() || c == '-' || c == '_');
        return plain.then(|| (class.as_bytes().to_vec(), false));
    }
    if let Some(rest) = selector.find('[').map(|at| &selector[at + 1..]) {
        let value = rest
            .split_once('=')
            .map(|(_, v)| v.trim_end_matches(']').trim_matches(['"', '\'']));
        return value
            .filter(|v| !v.is_empty())
            .map(|v| (v.as_bytes().to_vec(), false));
    }
    let plain = !selector.is_empty() && selector.chars().all(|c| c.is_ascii_alphanumeric());
    plain.then(|| (format!("<{selector}").into_bytes(), false))
}

fn plan(selectors: &[String], markers: &[String]) -> Plan {
    let mut needles = Vec::new();
    let mut all_ids = markers.is_empty();
    for selector in selectors {
        match needle_of(selector) {
            Some((needle, is_id)) => {
                all_ids &= is_id;
                needles.push(needle);
            }
            None => {
                return Plan {
                    needles: Vec::new(),
                    stop_after: 0,
                }
            }
        }
    }
    for marker in markers {
        needles.push(format!("levee:module {marker}").into_bytes());
    }
    Plan {
        stop_after: if all_ids { selectors.len() } else { 0 },
        needles,
    }
}

/// Bytes kept back while scanning, so a tag split across chunks is still found whole.
const CARRY: usize = 4096;

enum Stage {
    /// Passing bytes on while looking for the first needle; `carry` holds the tail.
    Scan {
        carry: BytesMut,
    },
    Rewrite(Box<HtmlRewriter<'static, Sink>>),
    /// Every selected element is gone: the rest passes untouched.
    Pass,
    Done,
}

pin_project! {
    /// A body with the switched-off modules' fragments removed.
    pub struct Hidden<B> {
        #[pin]
        inner: B,
        stage: Stage,
        plan: Plan,
        settings: Option<(Vec<String>, Vec<String>)>,
        ended: Arc<AtomicUsize>,
        output: Arc<Mutex<BytesMut>>,
    }
}

fn rewriter(
    selectors: &[String],
    markers: &[String],
    output: &Arc<Mutex<BytesMut>>,
    ended: &Arc<AtomicUsize>,
) -> HtmlRewriter<'static, Sink> {
    let mut settings = Settings::new_send();
    for selector in selectors {
        let ended = ended.clone();
        settings =
            settings.append_element_content_handler(element!(selector.as_str(), move |el| {
                el.remove();
                let ended = ended.clone();
                // Void elements have no end: count them as ended at once.
                if el
                    .on_end_tag(end_tag!(move |_end| {
                        ended.fetch_add(1, Ordering::Relaxed);
                        Ok(())
                    }))
                    .is_err()
                {
                    return Ok(());
                }
                Ok(())
            }));
    }
    if !markers.is_empty() {
        // Depth of open hidden markers; inside one, every node is removed.
        let depth = Arc::new(AtomicUsize::new(0));
        let (in_elements, in_text, in_comments) = (depth.clone(), depth.clone(), depth);
        let markers = Arc::new(markers.to_vec());
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
                        let _ =
                            in_comments.fetch_update(Ordering::Relaxed, Ordering::Relaxed, |d| {
                                d.checked_sub(1)
                            });
                    }
                    _ if in_comments.load(Ordering::Relaxed) > 0 => comment.remove(),
                    _ => {}
                }
                Ok(())
            }));
    }
    HtmlRewriter::new(settings, Sink(output.clone()))
}

impl<B> Hidden<B> {
    /// `selectors`: CSS selectors to remove; `markers`: module names hidden by comments.
    pub fn new(inner: B, selectors: &[String], markers: Vec<String>) -> Hidden<B> {
        let plan = plan(selectors, &markers);
        let output = Arc::new(Mutex::new(BytesMut::new()));
        let ended = Arc::new(AtomicUsize::new(0));
        let settings = (selectors.to_vec(), markers);
        let stage = if plan.needles.is_empty() {
            Stage::Rewrite(Box::new(rewriter(
                &settings.0,
                &settings.1,
                &output,
                &ended,
            )))
        } else {
            Stage::Scan {
                carry: BytesMut::new(),
            }
        };
        Hidden {
            inner,
            stage,
            plan,
            settings: Some(settings),
            ended,
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

fn emit(output: &Mutex<BytesMut>, bytes: &[u8]) {
    if let Ok(mut out) = output.lock() {
        out.extend_from_slice(bytes);
    }
}

fn find(haystack: &[u8], needle: &[u8]) -> Option<usize> {
    memchr::memmem::find(haystack, needle)
}

impl<B> Hidden<B> {
    /// Feeds one chunk through the current stage; output lands in `output`.
    fn feed(self: Pin<&mut Self>, data: &[u8]) -> Result<(), BoxError> {
        let this = self.project();
        match this.stage {
            Stage::Scan { carry } => {
                carry.extend_from_slice(data);
                let first = this
                    .plan
                    .needles
                    .iter()
                    .filter_map(|needle| find(carry, needle))
                    .min();
                let Some(at) = first else {
                    // Keep a tail back in case a needle or its tag straddles chunks.
                    let keep = carry.len().min(CARRY);
                    let pass = carry.split_to(carry.len() - keep);
                    emit(this.output, &pass);
                    return Ok(());
                };
                let start = carry[..at].iter().rposition(|b| *b == b'<').unwrap_or(0);
                let before = carry.split_to(start);
                emit(this.output, &before);
                let rest = carry.split();
                let (selectors, markers) = this.settings.take().unwrap_or_default();
                let rewriter = rewriter(&selectors, &markers, this.output, this.ended);
                *this.stage = Stage::Rewrite(Box::new(rewriter));
                rewrite(this.stage, this.plan, this.ended, this.output, &rest)
            }
            Stage::Rewrite(_) => rewrite(this.stage, this.plan, this.ended, this.output, data),
            Stage::Pass => {
                emit(this.output, data);
                Ok(())
            }
            Stage::Done => Ok(()),
        }
    }

    fn end(self: Pin<&mut Self>) -> Result<(), BoxError> {
        let this = self.project();
        match std::mem::replace(this.stage, Stage::Done) {
            Stage::Scan { carry } => emit(this.output, &carry),
            Stage::Rewrite(rewriter) => rewriter
                .end()
                .map_err(|error| Box::new(error) as BoxError)?,
            Stage::Pass | Stage::Done => {}
        }
        Ok(())
    }
}

/// Feeds the parser in small slices so that, once every id-selected element has ended, the
/// rest of the chunk passes untouched instead of being parsed for nothing.
fn rewrite(
    stage: &mut Stage,
    plan: &Plan,
    ended: &AtomicUsize,
    output: &Mutex<BytesMut>,
    data: &[u8],
) -> Result<(), BoxError> {
    const SLICE: usize = 1024;
    let mut offset = 0;
    while offset < data.len() {
        let Stage::Rewrite(rewriter) = stage else {
            break;
        };
        let end = (offset + SLICE).min(data.len());
        rewriter
            .write(&data[offset..end])
            .map_err(|error| Box::new(error) as BoxError)?;
        offset = end;
        finish_early(stage, plan, ended)?;
    }
    if offset < data.len() {
        emit(output, &data[offset..]);
    }
    Ok(())
}

/// Once every id-selected element has ended, nothing more can match: stop parsing.
fn finish_early(stage: &mut Stage, plan: &Plan, ended: &AtomicUsize) -> Result<(), BoxError> {
    if plan.stop_after > 0 && ended.load(Ordering::Relaxed) >= plan.stop_after {
        if let Stage::Rewrite(rewriter) = std::mem::replace(stage, Stage::Pass) {
            rewriter
                .end()
                .map_err(|error| Box::new(error) as BoxError)?;
        }
    }
    Ok(())
}

impl<B> Body for Hidden<B>
where
    B: Body<Data = Bytes, Error = BoxError>,
{
    type Data = Bytes;
    type Error = BoxError;

    fn poll_frame(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
    ) -> Poll<Option<Result<Frame<Bytes>, BoxError>>> {
        loop {
            if matches!(self.stage, Stage::Done) {
                let out = take(&self.output);
                return Poll::Ready((!out.is_empty()).then(|| Ok(Frame::data(out))));
            }
            match self.as_mut().project().inner.poll_frame(cx) {
                Poll::Pending => return Poll::Pending,
                Poll::Ready(Some(Err(error))) => return Poll::Ready(Some(Err(error))),
                Poll::Ready(Some(Ok(frame))) => {
                    let Ok(data) = frame.into_data() else {
                        continue;
                    };
                    if let Err(error) = self.as_mut().feed(&data) {
                        return Poll::Ready(Some(Err(error)));
                    }
                    let out = take(&self.output);
                    if !out.is_empty() {
                        return Poll::Ready(Some(Ok(Frame::data(out))));
                    }
                }
                Poll::Ready(None) => {
                    if let Err(error) = self.as_mut().end() {
                        return Poll::Ready(Some(Err(error)));
                    }
                }
            }
        }
    }

    fn is_end_stream(&self) -> bool {
        matches!(self.stage, Stage::Done)
            && self.output.lock().map(|out| out.is_empty()).unwrap_or(true)
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

    #[tokio::test]
    async fn parsing_starts_late_and_stops_early_without_changing_the_result() {
        let mut page = String::from("<html><body>");
        for i in 0..200 {
            page.push_str(&format!("<div class=\"post\"><p>post {i}</p></div>\n"));
        }
        page.push_str("<div id=\"ranking\"><div><ol><li>a</li></ol></div></div>");
        for i in 0..50 {
            page.push_str(&format!("<p>after {i} <b>x</b></p>"));
        }
        page.push_str("</body></html>");
        let page: &'static str = Box::leak(page.into_boxed_str());
        let expected = page.replace(
            "<div id=\"ranking\"><div><ol><li>a</li></ol></div></div>",
            "",
        );
        for chunk in [3, 100, 5000, 1 << 20] {
            assert_eq!(
                rewrite(page, &["#ranking"], &[], chunk).await,
                expected,
                "chunk {chunk}"
            );
        }
        assert_eq!(needle_of("div#ranking"), Some((b"ranking".to_vec(), true)));
        assert_eq!(
            needle_of("[data-module=visitors]"),
            Some((b"visitors".to_vec(), false))
        );
        assert_eq!(needle_of("div > p"), None);
    }
}
