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
use lol_html::{doc_comments, element, end_tag, AsciiCompatibleEncoding, OutputSink};
use memchr::memmem::Finder;
use pin_project_lite::pin_project;

use super::cut::{self, Cut, Found, Holder, IdSelector, Step};

use crate::error::BoxError;

/// The selector value that means "hide by comment markers".
pub const MARKER: &str = "marker";

/// What the hider has produced and not handed on yet, in order: pieces of the page passed on
/// as they are (held bytes split off, not copied) and the rewriter's output.
#[derive(Default)]
struct Output {
    ready: std::collections::VecDeque<Bytes>,
    tail: BytesMut,
    /// The element the rewriter is inside of and removing, if any.
    removal: Option<Removal>,
    /// A hidden marker region open (see `rewriter`): what the rewriter writes inside it,
    /// held until its end marker drops it; `None` outside one, or once given up.
    region: Option<BytesMut>,
}

/// An element the rewriter removes, from its start tag to where lol_html ends it: its own end
/// tag, or the end tag of an element around it that the rewriter saw open. lol_html ends an
/// element nowhere else (not at the page's end, nor at an end tag of an element opened before
/// the rewriter took over, which it never saw), so removing as it streamed took the rest of
/// the page with a module missing its end tag. What the rewriter writes meanwhile is held
/// instead, and dropped once the element ends; if the page ends first, or the element grows
/// past `MAX_HELD_REMOVING`, it goes on as it came: the module is left in place, the page
/// after it follows.
struct Removal {
    /// Matched elements open, the first included (a module nested in a module counts).
    open: usize,
    /// The first's tag name: its own end tag goes with it; one of an element around it stays.
    name: String,
    /// The selector that matched it, for the log.
    selector: Arc<str>,
    /// The rewriter's output from its start tag on; `None` once given up (left in place).
    held: Option<BytesMut>,
    /// The matched elements open inside the first, innermost last: where each starts in
    /// `held` (`None` when it was not held) and its name. One that ends is cut out of the
    /// hold, so a module whose end is never found, and is left in place, does not bring a
    /// whole module after it back with it.
    nested: Vec<(Option<usize>, String)>,
}

/// Most bytes of an element held while it is removed (see [`Removal`]). Larger than
/// `MAX_HELD`, so a module the fast path handed over for its length is still removed.
const MAX_HELD_REMOVING: usize = 4 * MAX_HELD;

/// Modules left in place because nothing ended them: at most one line a minute.
static LEFT_IN_PLACE_LOG: crate::log_throttle::LogThrottle =
    crate::log_throttle::LogThrottle::new(std::time::Duration::from_secs(60));

fn warn_of_a_region_left_in_place(why: &str) {
    if let Some(held_back) = LEFT_IN_PLACE_LOG.allow(std::time::Instant::now()) {
        tracing::warn!(
            "hide left a marker region in place: its end marker could not be found ({why}); write the <!-- /levee:module NAME --> that ends it ({held_back} more such modules not logged)"
        );
    }
}

fn warn_of_a_module_left_in_place(removal: &Removal, why: &str) {
    if let Some(held_back) = LEFT_IN_PLACE_LOG.allow(std::time::Instant::now()) {
        tracing::warn!(
            selector = &*removal.selector,
            element = removal.name,
            "hide left a <{}> in place: its end could not be found ({why}); give it its end tag ({held_back} more such modules not logged)",
            removal.name
        );
    }
}

impl Output {
    /// Copies `bytes` in (a borrowed chunk passed on as it is).
    fn push_slice(&mut self, bytes: &[u8]) {
        self.tail.extend_from_slice(bytes);
    }

    /// Copies in the rewriter's output: held while a marker region is open or an element is
    /// being removed.
    fn push_rewritten(&mut self, bytes: &[u8], in_region: bool) {
        if in_region {
            match &mut self.region {
                Some(held) if held.len() + bytes.len() <= MAX_HELD_REMOVING => {
                    held.extend_from_slice(bytes);
                    return;
                }
                Some(_) => {
                    if let Some(held) = self.region.take() {
                        self.push_removal_or_out(&held);
                    }
                    warn_of_a_region_left_in_place("longer than 1 MiB");
                }
                None => {}
            }
        }
        self.push_removal_or_out(bytes);
    }

    /// Opens a hidden marker region: what follows is held.
    fn open_region(&mut self) {
        self.region = Some(BytesMut::new());
    }

    /// The region's end marker came: what it held is dropped.
    fn close_region(&mut self) {
        self.region = None;
    }

    /// The page ended inside a region (its end marker missing): it stays.
    fn leave_region_in_place(&mut self) {
        if let Some(held) = self.region.take() {
            warn_of_a_region_left_in_place("the page ended first");
            self.push_removal_or_out(&held);
        }
    }

    /// Copies in output outside any region: held while an element is being removed.
    fn push_removal_or_out(&mut self, bytes: &[u8]) {
        if let Some(removal) = &mut self.removal {
            if let Some(held) = &mut removal.held {
                if held.len() + bytes.len() <= MAX_HELD_REMOVING {
                    held.extend_from_slice(bytes);
                    return;
                }
                self.tail.extend_from_slice(held);
                removal.held = None;
                warn_of_a_module_left_in_place(removal, "longer than 1 MiB");
            }
        }
        self.tail.extend_from_slice(bytes);
    }

    /// A matched element starts (its start tag is the rewriter's next output).
    fn open_removal(&mut self, name: String, selector: &Arc<str>) {
        match &mut self.removal {
            Some(removal) => {
                removal.open += 1;
                let start = removal.held.as_ref().map(BytesMut::len);
                removal.nested.push((start, name));
            }
            None => {
                self.removal = Some(Removal {
                    open: 1,
                    name,
                    selector: selector.clone(),
                    held: Some(BytesMut::new()),
                    nested: Vec::new(),
                })
            }
        }
    }

    /// A matched element ended at the end tag `end` (its own or an element's around it):
    /// once the first has, what was held is dropped. Whether `end` goes with it.
    fn close_removal(&mut self, end: &str) -> bool {
        let Some(removal) = &mut self.removal else {
            return false;
        };
        removal.open = removal.open.saturating_sub(1);
        if removal.open > 0 {
            // A module inside the first ended: it goes from the hold (all of it is dropped
            // anyway if the first ends too).
            let Some((start, name)) = removal.nested.pop() else {
                return false;
            };
            return match (start, &mut removal.held) {
                (Some(start), Some(held)) => {
                    held.truncate(start);
                    name.eq_ignore_ascii_case(end)
                }
                _ => false,
            };
        }
        let removed = removal.held.is_some() && removal.name.eq_ignore_ascii_case(end);
        self.removal = None;
        removed
    }

    fn is_removing(&self) -> bool {
        self.removal.is_some()
    }

    /// The page ended inside a removed element: what was held goes on.
    fn leave_removal_in_place(&mut self) {
        if let Some(removal) = self.removal.take() {
            if let Some(held) = &removal.held {
                warn_of_a_module_left_in_place(&removal, "the page ended first");
                self.tail.extend_from_slice(held);
            }
        }
    }

    /// Queues `bytes` without copying them.
    fn push_shared(&mut self, bytes: Bytes) {
        if bytes.is_empty() {
            return;
        }
        if !self.tail.is_empty() {
            let tail = self.tail.split().freeze();
            self.ready.push_back(tail);
        }
        self.ready.push_back(bytes);
    }

    /// The next piece to send, if any.
    fn take(&mut self) -> Option<Bytes> {
        match self.ready.pop_front() {
            Some(piece) => Some(piece),
            None if !self.tail.is_empty() => Some(self.tail.split().freeze()),
            None => None,
        }
    }

    fn is_empty(&self) -> bool {
        self.ready.is_empty() && self.tail.is_empty()
    }
}

/// Bytes of the page held back: one of the upstream's chunks (or a piece of it), shared and not
/// copied, until more must be joined to it; then a buffer of its own, which grows. Most pages
/// are held this way for their first chunk, where the module is, and for each chunk's tail.
/// (A shared tail keeps its whole chunk in memory until the next one comes, as the pieces of
/// it waiting in the output do.)
enum Held {
    Shared(Bytes),
    Owned(BytesMut),
}

impl Default for Held {
    fn default() -> Held {
        Held::Shared(Bytes::new())
    }
}

impl std::ops::Deref for Held {
    type Target = [u8];

    fn deref(&self) -> &[u8] {
        match self {
            Held::Shared(bytes) => bytes,
            Held::Owned(buf) => buf,
        }
    }
}

impl Held {
    /// Joins `data` to what is held: kept as it is when nothing is held, copied otherwise.
    fn append(&mut self, data: Bytes) {
        match self {
            Held::Shared(bytes) if bytes.is_empty() => *bytes = data,
            Held::Shared(bytes) => {
                let mut buf = BytesMut::with_capacity(bytes.len() + data.len());
                buf.extend_from_slice(bytes);
                buf.extend_from_slice(&data);
                *self = Held::Owned(buf);
            }
            Held::Owned(buf) => buf.extend_from_slice(&data),
        }
    }

    /// The first `n` bytes, taken off.
    fn split_to(&mut self, n: usize) -> Bytes {
        match self {
            Held::Shared(bytes) => bytes.split_to(n),
            Held::Owned(buf) => buf.split_to(n).freeze(),
        }
    }

    fn into_bytes(self) -> Bytes {
        match self {
            Held::Shared(bytes) => bytes,
            Held::Owned(buf) => buf.freeze(),
        }
    }
}

/// Collects the rewriter's output for the next body frame.
struct Sink {
    output: Arc<Mutex<Output>>,
    /// Hidden marker regions open (see `rewriter`): while one is, what the rewriter writes is
    /// dropped.
    regions: Arc<AtomicUsize>,
}

impl OutputSink for Sink {
    fn handle_chunk(&mut self, chunk: &[u8]) {
        let in_region = self.regions.load(Ordering::Relaxed) > 0;
        if let Ok(mut out) = self.output.lock() {
            out.push_rewritten(chunk, in_region);
        }
    }
}

/// Should this response be rewritten at all? Only uncompressed HTML in an encoding the
/// rewriter can read.
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
    html && !crate::proxy::header::is_content_coded(headers) && page_encoding(headers).is_some()
}

/// The encoding the rewriter reads the page in and writes it back: the `charset` its
/// `Content-Type` names, else windows-1252. The rewriter writes back the text it keeps as it
/// decoded it, so reading a page in another encoding than its own broke every byte that is
/// not valid in the one read (a Latin-1 `é` became U+FFFD). Windows-1252 gives each of the
/// 256 byte values a character of its own and back, so a page of undeclared encoding (UTF-8,
/// Latin-1, Shift_JIS with a `<meta charset>`…) comes out byte for byte; selectors match on
/// ASCII names either way. `None`: a charset the rewriter cannot read (UTF-16, ISO-2022-JP),
/// whose page is passed on untouched.
pub fn page_encoding(headers: &HeaderMap) -> Option<AsciiCompatibleEncoding> {
    let charset = headers
        .get(header::CONTENT_TYPE)
        .and_then(|value| value.to_str().ok())
        .and_then(|value| {
            value.split(';').skip(1).find_map(|parameter| {
                let (name, value) = parameter.split_once('=')?;
                name.trim()
                    .eq_ignore_ascii_case("charset")
                    .then(|| value.trim().trim_matches('"'))
            })
        });
    match charset {
        Some(label) => AsciiCompatibleEncoding::new(
            encoding_rs::Encoding::for_label_no_replacement(label.as_bytes())?,
        ),
        None => AsciiCompatibleEncoding::new(encoding_rs::WINDOWS_1252),
    }
}

fn marker_of(comment: &str) -> Option<(bool, &str)> {
    let text = comment.trim();
    if let Some(name) = text.strip_prefix("/levee:module ") {
        return Some((false, name.trim()));
    }
    text.strip_prefix("levee:module ")
        .map(|name| (true, name.trim()))
}

/// What hiding one set of switched-off modules removes, and how the page is searched for it:
/// the page is passed on untouched up to the first tag that could match, so the HTML parser
/// only runs over the part of the page that matters. Built once per route and set of modules
/// off (see `proxy::route::HidePlans`), not for every page: the searchers, id selectors and
/// copies of the selectors cost more than a thousand instructions and several allocations.
#[derive(Debug, Clone)]
pub struct HidePlan {
    /// CSS selectors of the elements removed.
    selectors: Vec<String>,
    /// Modules whose marker comments enclose what is removed.
    markers: Vec<String>,
    /// Searchers for the byte strings whose first occurrence marks where parsing must begin;
    /// empty: parse all.
    needles: Vec<Finder<'static>>,
    /// Elements whose end ends the work (all selectors are ids, each found once); 0: never.
    stop_after: usize,
    /// The modules off, for `X-Levee-Modules-Off` with `[degrade] tell_app` (see
    /// [`HidePlan::telling`]).
    pub told: Option<http::HeaderValue>,
    /// When every selector is a plain id selector and no markers are hidden: the selectors,
    /// for the tag-scanner fast path (`cut`). Empty: the rewriter does all the work.
    ids: Vec<IdSelector>,
}

/// The literal a simple selector needs to appear in the page: `#id`, `tag#id`, `.class`,
/// `[attr=value]`. `None` for anything else, a bare tag name included.
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
    // A bare tag name (`iframe`) has no literal to look for: tag names match in any case
    // (`<IFRAME>`), and a search for `<iframe` would pass such a page untouched. The parser
    // reads the whole page instead.
    None
}

impl HidePlan {
    /// The plan with the names of the modules it hides, told to the app in
    /// `X-Levee-Modules-Off` (`ranking, visitors`). Module names are policy names (letters,
    /// digits, `-`, `_`), always a valid field value.
    pub fn telling(mut self, modules: &[&str]) -> HidePlan {
        self.told = http::HeaderValue::from_str(&modules.join(", ")).ok();
        self
    }

    pub fn new(selectors: Vec<String>, markers: Vec<String>) -> HidePlan {
        // A selector with no literal to look for: the parser reads the whole page.
        let Some(selector_needles) = selectors
            .iter()
            .map(|selector| needle_of(selector))
            .collect::<Option<Vec<_>>>()
        else {
            return HidePlan {
                selectors,
                markers,
                needles: Vec::new(),
                stop_after: 0,
                ids: Vec::new(),
                told: None,
            };
        };
        let all_ids = markers.is_empty() && selector_needles.iter().all(|(_, is_id)| *is_id);
        let mut needles: Vec<Finder<'static>> = selector_needles
            .iter()
            .map(|(needle, _)| Finder::new(needle).into_owned())
            .collect();
        for marker in &markers {
            needles.push(Finder::new(format!("levee:module {marker}").as_bytes()).into_owned());
        }
        let ids: Vec<IdSelector> = all_ids
            .then(|| {
                selectors
                    .iter()
                    .map(|selector| IdSelector::parse(selector))
                    .collect::<Option<_>>()
            })
            .flatten()
            .unwrap_or_default();
        // With the fast path, finding the next candidate is a memmem over the rest of the
        // page, so levee keeps looking after each removal: a page that repeats an id (it
        // happens in legacy templates) loses every copy, and if the rewriter has to take over,
        // it runs to the end of the page for the same reason. Without it, parsing stops once
        // every id has ended.
        let stop_after = if all_ids && ids.is_empty() {
            selectors.len()
        } else {
            0
        };
        HidePlan {
            selectors,
            markers,
            needles,
            stop_after,
            ids,
            told: None,
        }
    }
}

/// Bytes kept back while scanning, so a tag split across chunks is still found whole.
const CARRY: usize = 4096;

/// Most bytes the fast path holds back while it looks for the end of a removed element (or the
/// end of a start tag); past this, the rewriter takes over and streams.
const MAX_HELD: usize = 256 * 1024;

enum Stage {
    /// Passing bytes on while looking for the first needle.
    Scan(Scan),
    /// Removing an element found by the fast path: `held` starts with its start tag and is
    /// dropped up to its end tag once that is found.
    Cut {
        held: Held,
        cut: Cut,
        /// While the scanner waits for the end of a tag or comment: look again once `held`
        /// is this long (see `Scan::look_again_at`).
        look_again_at: usize,
    },
    Rewrite(Box<HtmlRewriter<'static, Sink>>),
    /// Every selected element is gone: the rest passes untouched.
    Pass,
    Done,
}

/// The scan stage's bytes not passed on yet, and what is known of them.
struct Scan {
    carry: Held,
    /// Where the bytes passed on so far leave the tokenizer: a needle inside a comment or a
    /// script is text, not a module.
    passed: Passed,
    /// Per needle (as in `HidePlan::needles`): where it next occurs in `carry`, once found.
    sought: Vec<Sought>,
    /// While a start tag that has not ended is held: look again once `carry` is this long.
    /// Reading such a tag costs its length, so looking again only when as many new bytes have
    /// come as are held keeps a long tag arriving in small pieces linear, not quadratic.
    look_again_at: usize,
}

/// What the scan knows of one needle.
#[derive(Clone, Copy)]
enum Sought {
    /// It occurs at this offset of `carry`.
    At(usize),
    /// It does not begin before this offset of `carry`.
    NotBefore(usize),
}

impl Scan {
    fn new(carry: Held, needles: usize) -> Scan {
        Scan {
            carry,
            passed: Passed::default(),
            sought: vec![Sought::NotBefore(0); needles],
            look_again_at: 0,
        }
    }

    /// The first needle occurrence (offset, length), searching each needle only in bytes it
    /// was not searched in yet: a page where one needle occurs often and another never costs
    /// one pass per needle, not one per occurrence.
    fn first(&mut self, needles: &[Finder<'static>]) -> Option<(usize, usize)> {
        let mut first: Option<(usize, usize)> = None;
        for (finder, sought) in needles.iter().zip(self.sought.iter_mut()) {
            let needle = finder.needle();
            if let Sought::NotBefore(from) = *sought {
                let from = from.min(self.carry.len());
                *sought = match finder.find(&self.carry[from..]) {
                    Some(at) => Sought::At(from + at),
                    // A needle may still begin in its last `len - 1` bytes.
                    None => Sought::NotBefore(
                        (self.carry.len() + 1)
                            .saturating_sub(needle.len())
                            .max(from),
                    ),
                };
            }
            if let Sought::At(at) = *sought {
                if first.is_none_or(|best| (at, needle.len()) < best) {
                    first = Some((at, needle.len()));
                }
            }
        }
        first
    }

    /// Takes the first `n` bytes off `carry` (to pass them on), keeping what is known of the
    /// rest.
    fn take(&mut self, n: usize) -> Bytes {
        for sought in &mut self.sought {
            *sought = match *sought {
                Sought::At(at) if at >= n => Sought::At(at - n),
                Sought::At(_) => Sought::NotBefore(0),
                Sought::NotBefore(from) => Sought::NotBefore(from.saturating_sub(n)),
            };
        }
        self.look_again_at = self.look_again_at.saturating_sub(n);
        let taken = self.carry.split_to(n);
        self.passed.note(taken.clone());
        taken
    }

    /// Whether a tag starting at `start` of `carry` is in markup (not in a comment or in an
    /// element whose text is not markup).
    fn in_markup_at(&mut self, start: usize) -> bool {
        self.passed.state().in_markup_after(&self.carry[..start])
    }

    /// Holds the bytes from `start` (an unfinished tag) until about as many more have come,
    /// and at most until the hold passes `MAX_HELD`.
    fn hold_from(&mut self, start: usize) {
        let held = self.carry.len() - start;
        self.look_again_at = (self.carry.len() + held.max(1)).min(start + MAX_HELD + 1);
    }
}

/// The bytes the scan has passed on, as far as the tokenizer's state goes. They are read
/// only when a needle asks where it stands (or when many have gathered): a page whose module
/// is found early and once, the usual case, is never read past it.
#[derive(Default)]
struct Passed {
    read: cut::TokenizerState,
    /// Passed on, not read yet (shared with the output, not copied).
    unread: Vec<Bytes>,
    unread_len: usize,
}

/// Unread bytes kept at most: past this they are read, so a long page holds no more.
const MOST_UNREAD: usize = 64 * 1024;

impl Passed {
    fn note(&mut self, bytes: Bytes) {
        if bytes.is_empty() {
            return;
        }
        self.unread_len += bytes.len();
        self.unread.push(bytes);
        if self.unread_len > MOST_UNREAD {
            self.read_all();
        }
    }

    fn read_all(&mut self) {
        for bytes in self.unread.drain(..) {
            self.read.feed(&bytes);
        }
        self.unread_len = 0;
    }

    /// The state after every byte passed on.
    fn state(&mut self) -> &cut::TokenizerState {
        self.read_all();
        &self.read
    }
}

/// The rewriting state of one response body, apart from the body itself.
struct Hider {
    stage: Stage,
    plan: Arc<HidePlan>,
    encoding: AsciiCompatibleEncoding,
    ended: Arc<AtomicUsize>,
    output: Arc<Mutex<Output>>,
    /// Bytes kept back at the end of each chunk while scanning: `CARRY` (tests use less, so
    /// that small pages take every path).
    carry: usize,
}

/// The most of a body's opening white space read to tell a page from JSON.
const MOST_OPENING: usize = 1024;

/// What an answer to be hidden turned out to be once its first bytes were read.
pub enum Opened {
    /// JSON labelled as a page (see [`is_json`]): it goes untouched, its fields with it.
    Json(crate::proxy::body::ResponseBody),
    /// A page: its switched-off modules are removed as it streams.
    Page(crate::proxy::body::ResponseBody),
}

/// Reads the start of an answer to be hidden until a byte other than white space shows
/// whether it is a page at all, then gives it back: JSON untouched, a page to be hidden.
/// Known before the head goes out, so that JSON keeps its validators and lifetimes (see
/// `CUT_PAGE_DROPS`); the head waits for the body's first byte, which a PHP script sends
/// with its head anyway. At most [`MOST_OPENING`] bytes of white space are read: past them,
/// a page.
pub async fn open_page(
    body: crate::proxy::body::ResponseBody,
    plan: Arc<HidePlan>,
    encoding: AsciiCompatibleEncoding,
) -> Opened {
    let mut opening = Vec::new();
    let mut json = None;
    let body = crate::proxy::body::read_answer_ahead(body, |piece| {
        let room = (MOST_OPENING + 1).saturating_sub(opening.len());
        opening.extend_from_slice(&piece[..piece.len().min(room)]);
        json = is_json(&opening).or((opening.len() > MOST_OPENING).then_some(false));
        json.is_some()
    })
    .await;
    match json {
        Some(true) => Opened::Json(body),
        _ => Opened::Page(http_body_util::BodyExt::boxed_unsync(Hidden::new(
            body, plan, encoding,
        ))),
    }
}

/// Whether a body that starts with `start` is JSON rather than a page: its first byte other
/// than white space (after a UTF-8 byte order mark) opens an object or an array. A PHP AJAX
/// endpoint that never calls `header()` sends its JSON as `text/html`, and `json_encode`
/// writes `</` as `<\/`: a module's start tag in a string found no end tag, and the rest of
/// the body was removed. No browser reads such a body as a page. `None`: only white space (or
/// part of the mark) so far.
fn is_json(start: &[u8]) -> Option<bool> {
    const BOM: &[u8] = b"\xef\xbb\xbf";
    if start.len() < BOM.len() && BOM.starts_with(start) {
        return None;
    }
    start
        .strip_prefix(BOM)
        .unwrap_or(start)
        .iter()
        .find(|byte| !matches!(byte, b' ' | b'\t' | b'\n' | b'\r' | b'\x0c'))
        .map(|&first| first == b'{' || first == b'[')
}

pin_project! {
    /// A body with the switched-off modules' fragments removed.
    pub struct Hidden<B> {
        #[pin]
        inner: B,
        hider: Hider,
    }
}

fn rewriter(
    selectors: &[String],
    markers: &[String],
    encoding: AsciiCompatibleEncoding,
    output: &Arc<Mutex<Output>>,
    ended: &Arc<AtomicUsize>,
) -> HtmlRewriter<'static, Sink> {
    // Not strict: in strict mode a `<noscript>`, `<style>` or `<title>` inside a `<select>`
    // (or anything after a `<frameset>`) stops the parser with an error, and the page was cut
    // off there for every visitor while its module was off. Old templates have such markup;
    // read as plain HTML it is what browsers read in all but contrived pages.
    let mut settings = Settings::new_send()
        .with_encoding(encoding)
        .with_strict(false);
    for selector in selectors {
        let ended = ended.clone();
        let output = output.clone();
        let selector_text: Arc<str> = Arc::from(selector.as_str());
        settings =
            settings.append_element_content_handler(element!(selector.as_str(), move |el| {
                let name = el.tag_name();
                if end_tag_may_be_left_out(&name) {
                    warn_once_of_an_element_left_in(&selector_text, &name);
                    return Ok(());
                }
                // Not `el.remove()`, which drops the element's content as it streams and took
                // the rest of the page when its end never came: its output is held until it
                // ends (see `Removal`).
                let (ended, ending) = (ended.clone(), output.clone());
                let has_end = el.on_end_tag(end_tag!(move |end| {
                    ended.fetch_add(1, Ordering::Relaxed);
                    let removed = ending
                        .lock()
                        .is_ok_and(|mut out| out.close_removal(&end.name()));
                    if removed {
                        end.remove();
                    }
                    Ok(())
                }));
                if has_end.is_err() {
                    // A void element has no end and no content: removed at once.
                    el.remove();
                    return Ok(());
                }
                if let Ok(mut out) = output.lock() {
                    out.open_removal(name, &selector_text);
                }
                Ok(())
            }));
    }
    // Hidden marker regions open. Inside one, whatever the rewriter writes is dropped in the
    // sink, so no text handler is needed: one made lol_html decode every text after the first
    // match and encode it again, which is not byte for byte (invalid UTF-8 became U+FFFD, an
    // unmapped Shift_JIS pair `&#65533;`, an NEC-selected IBM extension its IBM twin); text no
    // handler asks for passes as the page's own bytes. Each element the region opens loses
    // its start and end tag, not the element with what it holds, which ran past the end
    // marker when that came inside an element the region opened (to the end of the page when
    // the element's end tag was left out, `<p>ad<!-- /levee:module ads --><p>…`): its end tag
    // after the end marker goes too.
    let regions = Arc::new(AtomicUsize::new(0));
    if !markers.is_empty() {
        let (in_elements, in_comments) = (regions.clone(), regions.clone());
        let region_output = output.clone();
        let markers = Arc::new(markers.to_vec());
        settings = settings
            .append_element_content_handler(element!("*", move |el| {
                // Its start tag is held with the region; its end tag, when it comes after the
                // region's end marker, goes too. (Held as written, a region whose end marker
                // never comes is left in place byte for byte.)
                if in_elements.load(Ordering::Relaxed) > 0 {
                    let regions = in_elements.clone();
                    let _ = el.on_end_tag(end_tag!(move |end| {
                        if regions.load(Ordering::Relaxed) == 0 {
                            end.remove();
                        }
                        Ok(())
                    }));
                }
                Ok(())
            }))
            .append_document_content_handler(doc_comments!(move |comment| {
                match marker_of(&comment.text()) {
                    // The region starts before its start marker is written: the marker is
                    // held with what follows.
                    Some((true, name)) if markers.iter().any(|m| m == name) => {
                        let outermost = in_comments.fetch_add(1, Ordering::Relaxed) == 0;
                        if let (true, Ok(mut out)) = (outermost, region_output.lock()) {
                            out.open_region();
                        }
                    }
                    // The region ends before its end marker is written: the marker goes, and
                    // what the region held.
                    Some((false, name)) if markers.iter().any(|m| m == name) => {
                        comment.remove();
                        let closed =
                            in_comments.fetch_update(Ordering::Relaxed, Ordering::Relaxed, |d| {
                                d.checked_sub(1)
                            });
                        if let (Ok(1), Ok(mut out)) = (closed, region_output.lock()) {
                            out.close_region();
                        }
                    }
                    _ => {}
                }
                Ok(())
            }));
    }
    HtmlRewriter::new(
        settings,
        Sink {
            output: output.clone(),
            regions,
        },
    )
}

/// Elements whose end tag HTML lets a page leave out (`<li>a<li>b`, `<p>a<div>`): the parser
/// closes them where the next one starts, but the rewriter removes up to an end tag written
/// out (its own or its list's, its table's), so removing one whose end tag is left out took
/// the rest of its list or page with it (now the rest of its list: see `Removal`). Such an
/// element is left in place; the operator is told to hide the element around it.
fn end_tag_may_be_left_out(name: &str) -> bool {
    matches!(
        name.to_ascii_lowercase().as_str(),
        "p" | "li"
            | "dt"
            | "dd"
            | "option"
            | "optgroup"
            | "tr"
            | "td"
            | "th"
            | "thead"
            | "tbody"
            | "tfoot"
            | "colgroup"
            | "caption"
            | "rb"
            | "rt"
            | "rtc"
            | "rp"
            | "html"
            | "head"
            | "body"
    )
}

/// The element a selector names by type, when `hide` would leave such elements in place
/// (`li.ad`, `p#promo`, `td`): for `levee check` to warn of. `scanned`: every selector of the
/// route is a plain id (no marker), so pages are cut by the scanner, which ends an `li`, `p`,
/// table row… chosen by id where HTML does; otherwise the rewriter reads the page, and it
/// leaves them all in place.
pub fn element_left_in_place(selector: &str, scanned: bool) -> Option<String> {
    if let Some(id) = IdSelector::parse(selector).filter(|_| scanned) {
        if id.tag.as_deref().is_none_or(cut::is_cut_whole) {
            return None;
        }
    }
    let selector = selector.trim();
    // The element the selector picks is named last (`ul > li.ad` picks an `li`).
    let last = selector
        .rsplit([' ', '>', '+', '~'])
        .next()
        .unwrap_or(selector);
    let name: String = last
        .chars()
        .take_while(|c| c.is_ascii_alphanumeric() || *c == '-')
        .collect();
    (!name.is_empty() && end_tag_may_be_left_out(&name)).then(|| name.to_ascii_lowercase())
}

/// Says once per process (a page is served thousands of times) that a selector matched an
/// element `hide` leaves in place (see [`end_tag_may_be_left_out`]).
fn warn_once_of_an_element_left_in(selector: &str, name: &str) {
    static WARNED: std::sync::atomic::AtomicBool = std::sync::atomic::AtomicBool::new(false);
    if !WARNED.swap(true, Ordering::Relaxed) {
        tracing::warn!(
            selector,
            element = name,
            "hide left a <{name}> in place: its end tag may be left out of a page, and removing it could remove what follows it; select the element around it (a div or section) instead (said once)"
        );
    }
}

impl<B> Hidden<B> {
    /// `plan`: what to remove; `encoding`: the page's (see [`page_encoding`]).
    pub fn new(inner: B, plan: Arc<HidePlan>, encoding: AsciiCompatibleEncoding) -> Hidden<B> {
        Hidden {
            inner,
            hider: Hider::with_plan(plan, encoding),
        }
    }
}

fn take(output: &Mutex<Output>) -> Option<Bytes> {
    output.lock().ok().and_then(|mut out| out.take())
}

/// Copies borrowed bytes into the output.
fn emit(output: &Mutex<Output>, bytes: &[u8]) {
    if let Ok(mut out) = output.lock() {
        out.push_slice(bytes);
    }
}

/// Hands bytes the hider held, or a piece of the upstream's chunk, on without copying them.
fn emit_shared(output: &Mutex<Output>, bytes: impl Into<Bytes>) {
    if let Ok(mut out) = output.lock() {
        out.push_shared(bytes.into());
    }
}

impl Hider {
    /// `fast`: scan for the needles and use the tag-scanner fast path when the selectors
    /// allow it (tests turn it off to compare against the rewriter over the whole page).
    #[cfg(test)]
    fn new(
        selectors: &[String],
        markers: Vec<String>,
        encoding: AsciiCompatibleEncoding,
        fast: bool,
    ) -> Hider {
        let mut plan = HidePlan::new(selectors.to_vec(), markers);
        if !fast {
            plan.ids.clear();
            plan.needles.clear();
        }
        Hider::with_plan(Arc::new(plan), encoding)
    }

    fn with_plan(plan: Arc<HidePlan>, encoding: AsciiCompatibleEncoding) -> Hider {
        let output = Arc::new(Mutex::new(Output::default()));
        let ended = Arc::new(AtomicUsize::new(0));
        let stage = if plan.needles.is_empty() {
            Stage::Rewrite(Box::new(rewriter(
                &plan.selectors,
                &plan.markers,
                encoding,
                &output,
                &ended,
            )))
        } else {
            Stage::Scan(Scan::new(Held::default(), plan.needles.len()))
        };
        Hider {
            stage,
            plan,
            encoding,
            ended,
            output,
            carry: CARRY,
        }
    }

    /// Feeds one chunk of the upstream's body. While scanning, a chunk in which no needle
    /// occurs is searched where it lies and passed on without being copied; only its last
    /// `carry` bytes (or a tag that has not ended) are kept back. Otherwise it goes to `feed`.
    fn feed_shared(&mut self, data: Bytes) -> Result<(), BoxError> {
        if self.scan_in_place(&data) {
            return Ok(());
        }
        self.feed(data)
    }

    /// The scan stage's work for `data` when it can be done without joining `data` to the
    /// bytes held before it: the answer is the one `scan` gives on the joined bytes, or
    /// `false` (nothing done) when that would need the held bytes.
    fn scan_in_place(&mut self, data: &Bytes) -> bool {
        let Stage::Scan(scan) = &mut self.stage else {
            return false;
        };
        // The kept tail must lie within `data`, and a tag being held must have had its bytes.
        if data.len() <= self.carry || scan.carry.len() + data.len() < scan.look_again_at {
            return false;
        }
        for (finder, sought) in self.plan.needles.iter().zip(&scan.sought) {
            let needle = finder.needle();
            // A needle already found in the held bytes: `scan` judges it.
            let Sought::NotBefore(from) = *sought else {
                return false;
            };
            // The held bytes where the needle may still begin, then run on into `data`.
            let begun = &scan.carry[from.min(scan.carry.len())..];
            if begun.len() >= needle.len() {
                return false;
            }
            if !begun.is_empty() {
                let mut across = Vec::with_capacity(2 * needle.len());
                across.extend_from_slice(begun);
                across.extend_from_slice(&data[..(needle.len() - 1).min(data.len())]);
                if finder.find(&across).is_some() {
                    return false;
                }
            }
            if finder.find(data).is_some() {
                return false;
            }
        }
        // No needle: pass on all but the tail, as `scan` does. Reading tags back from the end
        // stops within `data` on any real page (after a few tags); if it reaches the start of
        // `data`, the held bytes could change what it finds.
        let (holder, settled) = cut::holder_walk(data, data.len());
        if !settled {
            return false;
        }
        let unfinished = match holder {
            Holder::Incomplete { start } if data.len() - start <= MAX_HELD => Some(start),
            _ => None,
        };
        let tail_from = data.len() - self.carry;
        let keep_from = unfinished.map_or(tail_from, |start| start.min(tail_from));
        let held = std::mem::take(&mut scan.carry).into_bytes();
        let passed = data.slice(..keep_from);
        scan.passed.note(held.clone());
        scan.passed.note(passed.clone());
        emit_shared(&self.output, held);
        emit_shared(&self.output, passed);
        scan.carry = Held::Shared(data.slice(keep_from..));
        let kept = scan.carry.len();
        for (finder, sought) in self.plan.needles.iter().zip(scan.sought.iter_mut()) {
            *sought = Sought::NotBefore((kept + 1).saturating_sub(finder.needle().len()));
        }
        scan.look_again_at = 0;
        if let Some(start) = unfinished {
            scan.hold_from(start - keep_from);
        }
        true
    }

    /// Feeds one chunk through the current stage; output lands in `output`.
    fn feed(&mut self, data: Bytes) -> Result<(), BoxError> {
        match &mut self.stage {
            Stage::Scan(scan) => {
                scan.carry.append(data);
                if scan.carry.len() < scan.look_again_at {
                    return Ok(());
                }
                self.advance()
            }
            Stage::Cut {
                held,
                look_again_at,
                ..
            } => {
                held.append(data);
                if held.len() < *look_again_at {
                    return Ok(());
                }
                self.advance()
            }
            Stage::Rewrite(_) => self.rewrite(&data),
            Stage::Pass => {
                emit_shared(&self.output, data);
                Ok(())
            }
            Stage::Done => Ok(()),
        }
    }

    /// Runs the scan and cut stages in turn for as long as what is held lets them go on: a
    /// module found is cut, what follows it scanned, the next module cut… In a loop: a page
    /// that repeats a module's id a thousand times in one read (a sloppy template, or a
    /// visitor's post that copies the markup) recursed once per copy and overflowed the
    /// stack, which aborts the process.
    fn advance(&mut self) -> Result<(), BoxError> {
        loop {
            match &self.stage {
                Stage::Scan(_) => {
                    self.scan()?;
                    if !matches!(self.stage, Stage::Cut { .. }) {
                        return Ok(());
                    }
                }
                Stage::Cut { .. } => {
                    self.cut()?;
                    if !matches!(self.stage, Stage::Scan(_)) {
                        return Ok(());
                    }
                }
                _ => return Ok(()),
            }
        }
    }

    /// Scan stage: pass bytes on up to the next needle, then decide what it is. Finding a
    /// module's start tag, it leaves the cut stage to `advance` (a void element, which has
    /// nothing to cut past its tag, is dropped here and the scan goes on).
    fn scan(&mut self) -> Result<(), BoxError> {
        loop {
            let Stage::Scan(scan) = &mut self.stage else {
                return Ok(());
            };
            scan.look_again_at = 0;
            let Some((at, len)) = scan.first(&self.plan.needles) else {
                // Keep a tail back in case a needle or its tag straddles chunks: at least
                // `CARRY` bytes, and a tag that has not ended yet whole (up to `MAX_HELD`), so
                // an id late in a long start tag still finds the tag's start.
                let carry_len = scan.carry.len();
                let unfinished = match cut::holder(&scan.carry, carry_len) {
                    Holder::Incomplete { start } if carry_len - start <= MAX_HELD => Some(start),
                    _ => None,
                };
                let keep_from = match unfinished {
                    Some(start) => start.min(carry_len.saturating_sub(self.carry)),
                    None => carry_len.saturating_sub(self.carry),
                };
                let pass = scan.take(keep_from);
                emit_shared(&self.output, pass);
                if let Some(start) = unfinished {
                    scan.hold_from(start - keep_from);
                }
                return Ok(());
            };
            if !self.plan.ids.is_empty() {
                match cut::judge(&scan.carry, at, len, &self.plan.ids) {
                    Found::Incomplete { start } if scan.carry.len() - start <= MAX_HELD => {
                        let before = scan.take(start);
                        emit_shared(&self.output, before);
                        scan.hold_from(0);
                        return Ok(());
                    }
                    Found::NotHere { resume } => {
                        let before = scan.take(resume);
                        emit_shared(&self.output, before);
                        continue;
                    }
                    // (An unsure one is looked at where the rewriter would take over, below.)
                    Found::Element { start, .. } if !scan.in_markup_at(start) => {
                        let before = scan.take(at + len);
                        emit_shared(&self.output, before);
                        continue;
                    }
                    Found::Element { start, tag } => {
                        let before = scan.take(start);
                        emit_shared(&self.output, before);
                        let held = std::mem::take(&mut scan.carry);
                        // Offsets in `held`, which begins at the start tag.
                        let tag_end = tag.end - start;
                        let void = cut::is_void(&tag.name);
                        self.stage = Stage::Cut {
                            held,
                            cut: Cut::new(tag.name, tag_end),
                            look_again_at: 0,
                        };
                        if void {
                            self.finish_cut(tag_end);
                            continue;
                        }
                        return Ok(());
                    }
                    Found::Incomplete { .. } | Found::Unsure { .. } => {}
                }
            }
            // The rewriter takes over from the tag that holds the needle, or else from the
            // last `<` before it (a marker's comment).
            let start = match cut::holder(&scan.carry, at) {
                Holder::Tag { start, .. } | Holder::Incomplete { start } => start,
                Holder::None => memchr::memrchr(b'<', &scan.carry[..at]).unwrap_or(0),
            };
            if !scan.in_markup_at(start) {
                // A marker (or an id) in a script's string or a comment: text, passed on.
                let before = scan.take(at + len);
                emit_shared(&self.output, before);
                continue;
            }
            let before = scan.take(start);
            emit_shared(&self.output, before);
            let rest = std::mem::take(&mut scan.carry);
            self.start_rewriter();
            return self.rewrite(&rest);
        }
    }

    /// The upstream has nothing more for now: a PHP page that flushed (its head, say, before a
    /// slow query) is passed on up to what the next bytes could still change, instead of
    /// waiting behind the `carry` bytes the scan keeps back for a needle or a tag across chunks.
    /// Kept: the last `<` on (a tag, or a marker's comment, that a needle may still join), a
    /// tag that has not ended, and the end's bytes that begin a needle. Only after a complete scan: while
    /// a long unfinished tag is held (`look_again_at`), or a needle found waits for its tag,
    /// nothing is passed.
    fn pass_on_pause(&mut self) {
        let Stage::Scan(scan) = &mut self.stage else {
            return;
        };
        if scan.look_again_at > 0
            || scan.carry.is_empty()
            || scan
                .sought
                .iter()
                .any(|sought| matches!(sought, Sought::At(_)))
        {
            return;
        }
        let held = scan.carry.len();
        // Where a needle may still begin: bytes at the end that start it.
        let mut keep_from = held;
        for finder in &self.plan.needles {
            let needle = finder.needle();
            let begins = (held + 1).saturating_sub(needle.len())..held;
            if let Some(at) = begins
                .into_iter()
                .find(|&at| needle.starts_with(&scan.carry[at..]))
            {
                keep_from = keep_from.min(at);
            }
        }
        if let Some(last) = memchr::memrchr(b'<', &scan.carry) {
            keep_from = keep_from.min(last);
        }
        if let Holder::Incomplete { start } = cut::holder(&scan.carry, held) {
            keep_from = keep_from.min(start);
        }
        if keep_from > 0 {
            let pass = scan.take(keep_from);
            emit_shared(&self.output, pass);
        }
    }

    /// Cut stage: look for the removed element's end; give up to the rewriter when unsure.
    fn cut(&mut self) -> Result<(), BoxError> {
        let Stage::Cut {
            held,
            cut,
            look_again_at,
        } = &mut self.stage
        else {
            return Ok(());
        };
        match cut.advance(held) {
            Step::Ended(end) => {
                self.finish_cut(end);
                Ok(())
            }
            Step::More if held.len() <= MAX_HELD => {
                // A tag or comment not ended yet is read again from its start: wait for as
                // many new bytes as it holds (and no longer than the hold's bound).
                let pending = held.len() - cut.cursor;
                *look_again_at = if pending > 0 {
                    (held.len() + pending).min(MAX_HELD + 1)
                } else {
                    0
                };
                Ok(())
            }
            // Past the hold's bound with a place the element may have ended at: it ends there
            // (handed to the rewriter, it ran to the end of the page).
            Step::More => match cut.first_stray() {
                Some(at) => {
                    self.finish_cut(at);
                    Ok(())
                }
                None => {
                    let held = std::mem::take(held);
                    self.start_rewriter();
                    self.rewrite(&held)
                }
            },
            Step::GiveUp => {
                let held = std::mem::take(held);
                self.start_rewriter();
                self.rewrite(&held)
            }
        }
    }

    /// Drops the removed element (the first `end` bytes held); the rest is to be scanned.
    fn finish_cut(&mut self, end: usize) {
        let Stage::Cut { held, .. } = &mut self.stage else {
            return;
        };
        let mut rest = std::mem::take(held);
        let _removed = rest.split_to(end);
        let ended = self.ended.fetch_add(1, Ordering::Relaxed) + 1;
        if self.plan.stop_after > 0 && ended >= self.plan.stop_after {
            self.stage = Stage::Pass;
            emit_shared(&self.output, rest.into_bytes());
            return;
        }
        self.stage = Stage::Scan(Scan::new(rest, self.plan.needles.len()));
    }

    fn start_rewriter(&mut self) {
        let rewriter = rewriter(
            &self.plan.selectors,
            &self.plan.markers,
            self.encoding,
            &self.output,
            &self.ended,
        );
        self.stage = Stage::Rewrite(Box::new(rewriter));
    }

    fn end(&mut self) -> Result<(), BoxError> {
        // What was held back waiting for more bytes is looked at now: no more will come.
        self.advance()?;
        // The page ended inside a removed element that an end tag may have ended: it ends
        // there, and what follows is scanned for the other modules.
        while let Stage::Cut { cut, .. } = &self.stage {
            let Some(at) = cut.first_stray() else {
                break;
            };
            self.finish_cut(at);
            self.advance()?;
        }
        match std::mem::replace(&mut self.stage, Stage::Done) {
            Stage::Scan(scan) => emit_shared(&self.output, scan.carry.into_bytes()),
            // The page ended inside a removed element: nothing the scanner reads as its end
            // came. HTML would end it with the page, but a misread end (a template's stray tag)
            // would then cost the visitor the rest of the page: it is left in place instead.
            Stage::Cut { held, .. } => emit_shared(&self.output, held.into_bytes()),
            Stage::Rewrite(rewriter) => {
                rewriter
                    .end()
                    .map_err(|error| Box::new(error) as BoxError)?;
                // The page ended inside a removed element or a region: nothing ended it, so it
                // stays.
                if let Ok(mut out) = self.output.lock() {
                    out.leave_region_in_place();
                    out.leave_removal_in_place();
                }
            }
            Stage::Pass | Stage::Done => {}
        }
        Ok(())
    }

    /// Feeds the parser in small slices so that, once every id-selected element has ended, the
    /// rest of the chunk passes untouched instead of being parsed for nothing.
    fn rewrite(&mut self, data: &[u8]) -> Result<(), BoxError> {
        // Slices only matter when parsing may stop early; otherwise the chunk goes in whole.
        let slice = if self.plan.stop_after > 0 {
            1024
        } else {
            data.len().max(1)
        };
        let mut offset = 0;
        while offset < data.len() {
            let Stage::Rewrite(rewriter) = &mut self.stage else {
                break;
            };
            let end = (offset + slice).min(data.len());
            rewriter
                .write(&data[offset..end])
                .map_err(|error| Box::new(error) as BoxError)?;
            offset = end;
            self.finish_early()?;
        }
        if offset < data.len() {
            emit(&self.output, &data[offset..]);
        }
        Ok(())
    }

    /// Once every id-selected element has ended, nothing more can match: stop parsing (not
    /// inside an element being removed, which a repeated id can leave open).
    fn finish_early(&mut self) -> Result<(), BoxError> {
        let stop_after = self.plan.stop_after;
        if stop_after > 0
            && self.ended.load(Ordering::Relaxed) >= stop_after
            && !self.output.lock().is_ok_and(|out| out.is_removing())
        {
            if let Stage::Rewrite(rewriter) = std::mem::replace(&mut self.stage, Stage::Pass) {
                rewriter
                    .end()
                    .map_err(|error| Box::new(error) as BoxError)?;
            }
        }
        Ok(())
    }

    fn is_done(&self) -> bool {
        matches!(self.stage, Stage::Done)
    }

    fn is_passing(&self) -> bool {
        matches!(self.stage, Stage::Pass)
    }

    fn output_is_empty(&self) -> bool {
        self.output.lock().map(|out| out.is_empty()).unwrap_or(true)
    }
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
            if let Some(out) = take(&this.hider.output) {
                return Poll::Ready(Some(Ok(Frame::data(out))));
            }
            if this.hider.is_done() {
                return Poll::Ready(None);
            }
            match this.inner.as_mut().poll_frame(cx) {
                Poll::Pending => {
                    this.hider.pass_on_pause();
                    if let Some(out) = take(&this.hider.output) {
                        return Poll::Ready(Some(Ok(Frame::data(out))));
                    }
                    return Poll::Pending;
                }
                Poll::Ready(Some(Err(error))) => return Poll::Ready(Some(Err(error))),
                Poll::Ready(Some(Ok(frame))) => {
                    let Ok(data) = frame.into_data() else {
                        continue;
                    };
                    // Once nothing more can be removed, the upstream's chunks go on as they
                    // came (shared, not copied): on most pages that is everything after the
                    // module. (The output is empty here: it was drained above.)
                    if this.hider.is_passing() {
                        if data.is_empty() {
                            continue;
                        }
                        return Poll::Ready(Some(Ok(Frame::data(data))));
                    }
                    if let Err(error) = this.hider.feed_shared(data) {
                        return Poll::Ready(Some(Err(error)));
                    }
                }
                Poll::Ready(None) => {
                    if let Err(error) = this.hider.end() {
                        return Poll::Ready(Some(Err(error)));
                    }
                }
            }
        }
    }

    fn is_end_stream(&self) -> bool {
        self.hider.is_done() && self.hider.output_is_empty()
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
        let bytes = rewrite_bytes(
            html.as_bytes(),
            selectors,
            markers,
            chunk,
            AsciiCompatibleEncoding::utf_8(),
        )
        .await;
        String::from_utf8(bytes).expect("utf-8")
    }

    async fn rewrite_bytes(
        page: &[u8],
        selectors: &[&str],
        markers: &[&str],
        chunk: usize,
        encoding: AsciiCompatibleEncoding,
    ) -> Vec<u8> {
        let chunks: Vec<Result<Frame<Bytes>, BoxError>> = page
            .chunks(chunk)
            .map(|c| Ok(Frame::data(Bytes::copy_from_slice(c))))
            .collect();
        let body = StreamBody::new(futures_util::stream::iter(chunks)).boxed_unsync();
        let selectors: Vec<String> = selectors.iter().map(|s| s.to_string()).collect();
        let plan = HidePlan::new(selectors, markers.iter().map(|s| s.to_string()).collect());
        let out = match open_page(body, Arc::new(plan), encoding).await {
            Opened::Json(body) => body.collect().await,
            Opened::Page(hidden) => hidden.collect().await,
        };
        out.expect("rewrites").to_bytes().to_vec()
    }

    fn content_type(value: &str) -> HeaderMap {
        let mut headers = HeaderMap::new();
        headers.insert(header::CONTENT_TYPE, value.parse().expect("value"));
        headers
    }

    #[tokio::test]
    async fn pages_in_other_encodings_come_out_byte_for_byte() {
        // Latin-1 without a declared charset, and Shift_JIS declared: every byte the rewriter
        // keeps comes out as it came in (it had become U+FFFD, read as UTF-8).
        let latin1: &[u8] = b"<p>caf\xe9 cr\xe8me</p><!-- levee:module ads --><div>pub \xe0 gauche</div><!-- /levee:module ads --><div class=\"box x\">\xa9 2024</div><p>fin \xe9t\xe9</p>";
        let undeclared = page_encoding(&content_type("text/html")).expect("readable");
        for chunk in [1, 5, 4096] {
            let out = rewrite_bytes(latin1, &["div.box"], &["ads"], chunk, undeclared).await;
            assert_eq!(
                out,
                b"<p>caf\xe9 cr\xe8me</p><p>fin \xe9t\xe9</p>".to_vec(),
                "chunk {chunk}"
            );
        }
        let shift_jis: &[u8] = b"<p>\x83\x89\x83\x93\x83L\x83\x93\x83O</p><!-- levee:module ads --><i>ad</i><!-- /levee:module ads --><p>\x88\xea</p>";
        let declared =
            page_encoding(&content_type("text/html; charset=Shift_JIS")).expect("readable");
        let out = rewrite_bytes(shift_jis, &[], &["ads"], 3, declared).await;
        assert_eq!(
            out,
            b"<p>\x83\x89\x83\x93\x83L\x83\x93\x83O</p><p>\x88\xea</p>".to_vec()
        );
        // A UTF-16 page cannot be read by the rewriter: passed on untouched.
        assert!(!rewritable(&content_type("text/html; charset=utf-16le")));
    }

    /// On a route that hides a marker, the text after the first match came out decoded and
    /// encoded again: invalid UTF-8 became U+FFFD, an unmapped Shift_JIS or EUC-JP pair the
    /// text `&#65533;`, and an NEC-selected IBM extension (`ED 40`) its IBM twin (`FA 5C`).
    #[tokio::test]
    async fn text_after_a_marker_comes_out_byte_for_byte() {
        let region = b"<!-- levee:module ads --><div>ad \xff</div>AD<!-- /levee:module ads -->";
        for (charset, text) in [
            ("utf-8", &b"caf\xe9 \xff\xfe \xe2\x82 \xc3\xa9t\xc3\xa9"[..]),
            (
                "Shift_JIS",
                &b"\xed\x40 \x85\x40 \x83\x89 \xfa\x5c \x88"[..],
            ),
            (
                "EUC-JP",
                &b"\xa1\x20 \xb0\xa1 \x8f\xa2\xaf \xad\xa1 \xa4"[..],
            ),
        ] {
            let encoding = page_encoding(&content_type(&format!("text/html; charset={charset}")))
                .expect("readable");
            // The text in an element, in an attribute value, and at the page's end.
            let after = |module: &[u8]| {
                let mut bytes = b"<p>".to_vec();
                for piece in [text, b"</p>", module, b"<i title=\"", text, b"\">", text] {
                    bytes.extend_from_slice(piece);
                }
                bytes.extend_from_slice(b"</i>");
                bytes.extend_from_slice(text);
                bytes
            };
            let page = [
                &b"<p>a</p>"[..],
                region,
                &after(b"<div class=\"box\">x</div>"),
            ]
            .concat();
            let expected = [&b"<p>a</p>"[..], &after(b"")].concat();
            for chunk in [1, 2, 5, 1 << 20] {
                let out = rewrite_bytes(&page, &[".box"], &["ads"], chunk, encoding).await;
                assert!(
                    out == expected,
                    "{charset}, chunk {chunk}: {:?}",
                    String::from_utf8_lossy(&out)
                );
            }
        }
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
    async fn elements_whose_end_tag_may_be_left_out_are_left_in_place() {
        // Removed up to an end tag that never comes, each took the rest of its list or page.
        for page in [
            "<p class=\"ads\">ad<div>block</div><p>after</p>",
            "<ul><li class=\"ads\">ad<li>item2<li>item3</ul><p>after</p>",
            "<table><tr><td class=\"ads\">ad<td>cell</table>",
            // Chosen by id, but with a script inside, which only the rewriter reads.
            "<ul><li id=\"ads\"><script>ad()</script><li>item2</ul>",
        ] {
            for selector in [".ads", "#ads", "li#ads"] {
                assert_eq!(rewrite(page, &[selector], &[], 7).await, page, "{selector}");
            }
        }
        // The element around it is removed as always.
        let page = "<div id=\"box\"><p>ad<p>more</div><p>after";
        assert_eq!(rewrite(page, &["#box"], &[], 3).await, "<p>after");
    }

    #[tokio::test]
    async fn elements_chosen_by_id_end_where_html_ends_them() {
        for (page, cut) in [
            (
                "<ul><li id=\"ads\">ad<li>item2<li>item3</ul><p>after</p>",
                "<ul><li>item2<li>item3</ul><p>after</p>",
            ),
            (
                "<ul><li>one<li id=\"ads\">ad</ul><p>after</p>",
                "<ul><li>one</ul><p>after</p>",
            ),
            (
                "<p id=\"ads\">ad<div>block</div><p>after</p>",
                "<div>block</div><p>after</p>",
            ),
            (
                "<table><tr id=\"ads\"><td>ad<td>ad<tr><td>cell</table>",
                "<table><tr><td>cell</table>",
            ),
        ] {
            for selector in ["#ads", "li#ads", "p#ads", "tr#ads"] {
                let tag = selector.split('#').next().unwrap_or_default();
                let picks = tag.is_empty() || page.contains(&format!("<{tag} id=\"ads\""));
                let expected = if picks { cut } else { page };
                for chunk in [1, 3, 7, 64] {
                    assert_eq!(
                        rewrite(page, &[selector], &[], chunk).await,
                        expected,
                        "{selector} in {page}, chunks of {chunk}"
                    );
                }
            }
        }
    }

    /// The module ends where the browser ends it when its own end tag is missing: at the end
    /// tag of an element around it, or at a start tag of its own kind; the rest of the page
    /// stays. It was removed to the end of the page.
    #[test]
    fn a_module_missing_its_end_tag_ends_where_the_browser_ends_it() {
        let head =
            "<!doctype html><html><head><meta charset=\"utf-8\"><title>t</title></head><body>";
        let tail = "<p id=\"after\">AFTER</p></body></html>";
        for (line, module) in [
            (
                "<table><tr><td><div id=\"ranking\">R</td></tr></table><p>x</p>",
                "<div id=\"ranking\">R",
            ),
            (
                "<ul><li><div id=\"ranking\">R</li><li>next</li></ul><p>x</p>",
                "<div id=\"ranking\">R",
            ),
            (
                "<section><div id=\"ranking\">R</section><p>x</p>",
                "<div id=\"ranking\">R",
            ),
            (
                "<main><div id=\"ranking\">R</main><footer>F</footer>",
                "<div id=\"ranking\">R",
            ),
            (
                "<div><span id=\"ranking\">R</div><p>x</p>",
                "<span id=\"ranking\">R",
            ),
            (
                "<a href=/1 id=\"ranking\">R<a href=/2>two</a> tail",
                "<a href=/1 id=\"ranking\">R",
            ),
            (
                "<button id=\"ranking\">B<button>C</button>",
                "<button id=\"ranking\">B",
            ),
            // Inside a wrapper of the page, whose `</div>` is not the module's own.
            (
                "<div class=\"wrap\"><table><tr><td><div id=\"ranking\">R</td><td>keep</td></tr></table><p>x</p></div><p>after wrap</p>",
                "<div id=\"ranking\">R",
            ),
            (
                "<div class=\"wrap\"><ul><li><div id=\"ranking\">R</li><li>next</li></ul></div><p>after wrap</p>",
                "<div id=\"ranking\">R",
            ),
            (
                "<div class=\"wrap\"><section><div id=\"ranking\">R<p>para</section><p>x</p></div><p>after wrap</p>",
                "<div id=\"ranking\">R<p>para",
            ),
        ] {
            let page = format!("{head}{line}{tail}");
            let expected = page.replace(module, "");
            for chunk in [1, 7, 64, 1 << 20] {
                for pauses in [Pauses::Never, Pauses::AfterEachChunk] {
                    let out =
                        hide_keeping(page.as_bytes(), &["#ranking"], chunk, true, CARRY, pauses);
                    assert_eq!(
                        String::from_utf8_lossy(&out),
                        expected,
                        "chunk {chunk}, {pauses:?}"
                    );
                }
            }
        }
        // A stray end tag inside a module whose own end tag comes: removed whole, as the
        // browser ignores the tag (it was ended there, and the module's text and its own
        // `</div>`, which closed the column around it, went out).
        for stray in ["</li>", "</section>", "</td>"] {
            let page = format!(
                "{head}<div class=\"col\"><div id=\"ranking\"><span>A{stray}B</span></div><p id=\"after\">after</p></div>{tail}"
            );
            let expected =
                format!("{head}<div class=\"col\"><p id=\"after\">after</p></div>{tail}");
            for chunk in [1, 7, 64, 1 << 20] {
                let out = hide_keeping(
                    page.as_bytes(),
                    &["#ranking"],
                    chunk,
                    true,
                    CARRY,
                    Pauses::Never,
                );
                assert_eq!(
                    String::from_utf8_lossy(&out),
                    expected,
                    "{stray}, chunk {chunk}"
                );
            }
        }
        // A page that ends inside the module: nothing told where it ends, so it stays.
        let page = format!("{head}<div id=\"ranking\">R</body></html>");
        assert_eq!(
            String::from_utf8_lossy(&hide_with(page.as_bytes(), &["#ranking"], 5, true)),
            page
        );
    }

    /// On the rewriter's path (a class selector; a marker besides), a module missing its own
    /// end tag took the rest of the page with it: lol_html removed it as it streamed and ends
    /// an element only at an end tag. Now it is removed where lol_html ends it (an element
    /// around it that the rewriter saw open ends, which stays), and left in place where
    /// nothing ends it (the rewriter took over at the module, and never saw what is around
    /// it); either way the rest of the page follows.
    #[test]
    fn the_rewriter_never_removes_the_rest_of_the_page() {
        let head =
            "<!doctype html><html><head><meta charset=\"utf-8\"><title>t</title></head><body>";
        let tail = "<p id=\"after\">AFTER</p></body></html>";
        let lines = [
            (
                "<table><tr><td><div class=\"ranking\">R</td></tr></table><p>x</p>",
                "<div class=\"ranking\">R",
            ),
            (
                "<ul><li><div class=\"ranking\">R</li><li>next</li></ul><p>x</p>",
                "<div class=\"ranking\">R",
            ),
            (
                "<section><div class=\"ranking\">R</section><p>x</p>",
                "<div class=\"ranking\">R",
            ),
            (
                "<div><span class=\"ranking\">R</div><p>x</p>",
                "<span class=\"ranking\">R",
            ),
            // Nested: the inner one's end is the outer's content, the outer ends at the
            // section's end tag (or nowhere).
            (
                "<section><div class=\"ranking\">R<b class=\"ranking\">b</b> r</section><p>x</p>",
                "<div class=\"ranking\">R<b class=\"ranking\">b</b> r",
            ),
        ];
        for (line, module) in lines {
            let page = format!("{head}{line}{tail}");
            // Left in place, but for a whole module inside it (which would otherwise come back
            // with the one whose end is not found).
            let left = page.replace("<b class=\"ranking\">b</b>", "");
            // `body .ranking` has no literal to look for: the rewriter reads the whole page and
            // sees the element around the module open.
            for (selectors, markers, expected) in [
                (&[".ranking"][..], &[][..], left.clone()),
                (&[".ranking"][..], &["ads"][..], left.clone()),
                (&[".ranking", "[data-module=x]"][..], &[][..], left.clone()),
                (&["body .ranking"][..], &[][..], page.replace(module, "")),
                (
                    &["body .ranking"][..],
                    &["ads"][..],
                    page.replace(module, ""),
                ),
            ] {
                assert_hides_in_pieces(selectors, markers, &page, &expected, &[1, 7, 64, 1 << 20]);
            }
        }
        // A whole module after one whose end is not found goes; the first stays. (It came
        // back with the first, being held inside it.)
        let page = format!(
            "{head}<table><tr><td><div class=\"box ranking\">R</td><td>keep</td></tr></table><p>x</p><div class=\"box ranking\">second</div><p>y</p>{tail}"
        );
        let expected = page.replace("<div class=\"box ranking\">second</div>", "");
        for markers in [&[][..], &["ads"][..]] {
            assert_hides_in_pieces(
                &[".ranking"],
                markers,
                &page,
                &expected,
                &[1, 7, 64, 1 << 20],
            );
        }
        // A marker region whose end marker never comes stays as it was written, and one that
        // ends goes; before, the first took the rest of the page.
        let page = format!(
            "{head}<p>a</p><!-- levee:module ads --><div>A1</div><p>rest of page</p>{tail}"
        );
        assert_hides_in_pieces(&[], &["ads"], &page, &page, &[1, 7, 64, 1 << 20]);
        let page = format!(
            "{head}<!-- levee:module ads --><aside>x<p>y<!-- /levee:module ads -->z</p></aside><p>a</p><!-- levee:module ads --><div>A1</div><p>rest</p>{tail}"
        );
        let expected =
            format!("{head}z<p>a</p><!-- levee:module ads --><div>A1</div><p>rest</p>{tail}");
        assert_hides_in_pieces(&[], &["ads"], &page, &expected, &[1, 7, 64, 1 << 20]);
        // A module with its end tag is removed as before, also one holding a module.
        let page = format!(
            "{head}<div class=\"ranking\">R<div class=\"ranking\">S</div><p>in</div>{tail}"
        );
        for selectors in [&[".ranking"][..], &["body .ranking"][..]] {
            for chunk in [1, 7, 1 << 20] {
                let cuts: Vec<usize> = (chunk..page.len()).step_by(chunk).collect();
                let out = hide_in_pieces(selectors, &[], page.as_bytes(), &cuts, CARRY, true);
                assert_eq!(
                    String::from_utf8_lossy(&out),
                    format!("{head}{tail}"),
                    "{selectors:?}, chunk {chunk}"
                );
            }
        }
    }

    /// A module missing its end tag is held only up to `MAX_HELD_REMOVING`: past that it is
    /// left in place and the page streams on, before the upstream ends.
    #[test]
    fn a_module_never_ended_is_held_only_so_far() {
        let selectors = [".ranking".to_string()];
        let mut hider = Hider::new(
            &selectors,
            Vec::new(),
            AsciiCompatibleEncoding::utf_8(),
            true,
        );
        let start = "<p>before</p><div class=\"ranking\">";
        let filler = "<p>text of a post</p>\n".repeat(8 * 1024);
        let mut page = start.to_string();
        let mut out = Vec::new();
        hider
            .feed_shared(Bytes::copy_from_slice(start.as_bytes()))
            .expect("feeds");
        while page.len() < 2 * MAX_HELD_REMOVING {
            page.push_str(&filler);
            hider
                .feed_shared(Bytes::copy_from_slice(filler.as_bytes()))
                .expect("feeds");
            hider.pass_on_pause();
            while let Some(piece) = take(&hider.output) {
                out.extend_from_slice(&piece);
            }
        }
        assert!(
            out.len() > MAX_HELD_REMOVING,
            "{} bytes out before the end",
            out.len()
        );
        hider.end().expect("ends");
        while let Some(piece) = take(&hider.output) {
            out.extend_from_slice(&piece);
        }
        assert!(out == page.as_bytes(), "left in place whole");
    }

    /// A page that repeats the module's id thousands of times in one read (a visitor's post
    /// that copies the markup): each copy is removed, in a loop. Each was one more level of
    /// recursion, and some 1,500 overflowed a worker's stack, aborting levee.
    #[tokio::test]
    async fn a_page_repeating_the_module_thousands_of_times_has_every_copy_removed() {
        for copy in [
            "<div id=ranking></div>",
            "<div id=\"ranking\">12345</div>",
            "<img id=ranking>",
        ] {
            let page = format!("<p>a</p>{}<p>b</p>", copy.repeat(20_000));
            for chunk in [page.len(), 32 * 1024] {
                let out = rewrite_bytes(
                    page.as_bytes(),
                    &["#ranking"],
                    &[],
                    chunk,
                    AsciiCompatibleEncoding::utf_8(),
                )
                .await;
                assert_eq!(
                    String::from_utf8_lossy(&out),
                    "<p>a</p><p>b</p>",
                    "{copy}, chunk {chunk}"
                );
            }
        }
    }

    /// A PHP AJAX endpoint without a `header()` call: JSON labelled `text/html`, whose `</`
    /// `json_encode` wrote as `<\/`. It was cut from the module's start tag to its end.
    #[tokio::test]
    async fn json_labelled_html_passes_untouched() {
        let json = r#"{"html":"<div id='ranking'><b>Top</b><\/div>","posts":[1,2,3]}"#;
        for start in ["", "\u{feff}", " \r\n", "\u{feff}\n\t"] {
            for body in [format!("{start}{json}"), format!("{start}[{json}]")] {
                for chunk in [1, 2, 3, 4096] {
                    for (selectors, markers) in [
                        (&["#ranking"][..], &[][..]),
                        (&["#ranking", "div.x"][..], &["ads"][..]),
                        (&["div"][..], &[][..]),
                    ] {
                        let out = rewrite_bytes(
                            body.as_bytes(),
                            selectors,
                            markers,
                            chunk,
                            AsciiCompatibleEncoding::utf_8(),
                        )
                        .await;
                        assert_eq!(
                            String::from_utf8_lossy(&out),
                            body,
                            "chunk {chunk}, {selectors:?}"
                        );
                    }
                }
            }
        }
        // A page after a mark and white space is still a page.
        for start in ["\u{feff}", " \n", "\u{feff}\r\n"] {
            let page = format!("{start}<p>a</p><div id=\"ranking\">R</div><p>b</p>");
            for chunk in [1, 2, 4096] {
                for selectors in [&["#ranking"][..], &["div#ranking", ".x"][..]] {
                    let out = rewrite_bytes(
                        page.as_bytes(),
                        selectors,
                        &[],
                        chunk,
                        AsciiCompatibleEncoding::utf_8(),
                    )
                    .await;
                    assert_eq!(
                        String::from_utf8_lossy(&out),
                        format!("{start}<p>a</p><p>b</p>"),
                        "chunk {chunk}, {selectors:?}"
                    );
                }
            }
        }
        // White space past the bound: a page, held no longer (it was held whole).
        let page = format!(
            "{}<div id=\"ranking\">R</div><p>b</p>",
            " ".repeat(64 * 1024)
        );
        let out = rewrite_bytes(
            page.as_bytes(),
            &["#ranking"],
            &[],
            4096,
            AsciiCompatibleEncoding::utf_8(),
        )
        .await;
        assert_eq!(
            String::from_utf8_lossy(&out),
            format!("{}<p>b</p>", " ".repeat(64 * 1024))
        );
        let json = format!("{}{{\"a\":\"<div id='ranking'>\"}}", " ".repeat(64 * 1024));
        let out = rewrite_bytes(
            json.as_bytes(),
            &["#ranking"],
            &[],
            4096,
            AsciiCompatibleEncoding::utf_8(),
        )
        .await;
        // Read as a page past the bound: the module's end never comes, so it stays.
        assert!(
            out == json.as_bytes(),
            "JSON past the bound comes out whole"
        );
        // White space only, and nothing at all.
        for body in ["", " \n ", "\u{feff}"] {
            let out = rewrite_bytes(
                body.as_bytes(),
                &["#ranking"],
                &[],
                1,
                AsciiCompatibleEncoding::utf_8(),
            )
            .await;
            assert_eq!(String::from_utf8_lossy(&out), body);
        }
    }

    #[test]
    fn selectors_of_elements_left_in_place_are_named() {
        for (selector, element) in [
            ("li.ad", Some("li")),
            ("ul > LI#x", Some("li")),
            ("p", Some("p")),
            ("td[data-x=1]", Some("td")),
            ("#ads", None),
            (".ads", None),
            ("div.box", None),
            ("picture", None),
        ] {
            assert_eq!(
                element_left_in_place(selector, false).as_deref(),
                element,
                "{selector}"
            );
        }
        // Plain id selectors on a route the scanner cuts: ended where HTML ends the element,
        // but for elements it never cuts. On a route the rewriter reads, left in place.
        for (selector, scanned, element) in [
            ("li#x", true, None),
            ("TD#x", true, None),
            ("#x", true, None),
            ("optgroup#x", true, Some("optgroup")),
            ("li#x", false, Some("li")),
        ] {
            assert_eq!(
                element_left_in_place(selector, scanned).as_deref(),
                element,
                "{selector} {scanned}"
            );
        }
    }

    #[tokio::test]
    async fn markup_the_strict_parser_gives_up_on_is_rewritten_to_its_end() {
        // A `<noscript>` in a `<select>` (an old template's note for browsers without script).
        let page = "<div class=\"ad\">ad</div><form><select name=\"c\"><option>fr</option><noscript><option>en</option></noscript></select></form><div class=\"ad\">ad</div><p>end</p>";
        for chunk in [3, 4096] {
            let out = rewrite(page, &["div.ad"], &[], chunk).await;
            assert_eq!(
                out,
                page.replace("<div class=\"ad\">ad</div>", ""),
                "chunk {chunk}"
            );
        }
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

    /// A region ends at its end marker, also when that comes inside an element the region
    /// opened: what follows the marker in that element stays (it went with the element, and
    /// the rest of the page with an element whose end tag was left out).
    #[tokio::test]
    async fn a_region_ends_at_its_end_marker_inside_an_element_it_opened() {
        for (page, expected) in [
            (
                "<div class=\"wrap\"><!-- levee:module ads --><aside>Buy</aside><div class=\"inner\">in<!-- /levee:module ads -->still</div></div><p>after</p>",
                "<div class=\"wrap\">still</div><p>after</p>",
            ),
            (
                "<!-- levee:module ads --><p>ad<!-- /levee:module ads --><p>next</p><p>after</p>",
                "<p>next</p><p>after</p>",
            ),
            (
                "<p>a</p><!-- levee:module ads --><script>ad('</div>')</script><style>b{}</style><img src=x><b>x<br/></b><!-- /levee:module ads --><p>after</p>",
                "<p>a</p><p>after</p>",
            ),
        ] {
            for chunk in [1, 5, 4096] {
                assert_eq!(
                    rewrite(page, &[], &["ads"], chunk).await,
                    expected,
                    "chunk {chunk}"
                );
            }
        }
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
        // Every Content-Encoding line counts, not the first alone.
        headers.insert(header::CONTENT_ENCODING, "identity".parse().expect("value"));
        headers.append(header::CONTENT_ENCODING, "gzip".parse().expect("value"));
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
        assert_eq!(needle_of("iframe"), None);
    }

    #[tokio::test]
    async fn tag_selectors_match_tags_in_any_case() {
        let page = "<p>a</p><IFRAME src=\"x\"><b>in</b></IFRAME><p>b</p><iframe></iframe>";
        for chunk in [2, 4096] {
            assert_eq!(
                rewrite(page, &["iframe"], &[], chunk).await,
                "<p>a</p><p>b</p>",
                "chunk {chunk}"
            );
        }
    }

    /// Runs the body state machine directly, fed in `chunk`-byte pieces.
    fn hide_with(page: &[u8], selectors: &[&str], chunk: usize, fast: bool) -> Vec<u8> {
        hide_keeping(page, selectors, chunk, fast, CARRY, Pauses::Never)
    }

    /// Whether the upstream pauses (has nothing more for now) after each chunk.
    #[derive(Clone, Copy, Debug, PartialEq)]
    enum Pauses {
        Never,
        AfterEachChunk,
    }

    /// `hide_with`, keeping `carry` bytes back while scanning.
    fn hide_keeping(
        page: &[u8],
        selectors: &[&str],
        chunk: usize,
        fast: bool,
        carry: usize,
        pauses: Pauses,
    ) -> Vec<u8> {
        let selectors: Vec<String> = selectors.iter().map(|s| s.to_string()).collect();
        let mut hider = Hider::new(
            &selectors,
            Vec::new(),
            AsciiCompatibleEncoding::utf_8(),
            fast,
        );
        hider.carry = carry;
        run_hider(hider, page, chunk, pauses)
    }

    /// `page` through `hider` in pieces of `chunk` bytes, to the end. The rewriter runs to the
    /// end of the page too (the reference), as the fast path scans it.
    fn run_hider(mut hider: Hider, page: &[u8], chunk: usize, pauses: Pauses) -> Vec<u8> {
        Arc::make_mut(&mut hider.plan).stop_after = 0;
        let mut out = Vec::new();
        for piece in page.chunks(chunk) {
            hider
                .feed_shared(Bytes::copy_from_slice(piece))
                .expect("feeds");
            if pauses == Pauses::AfterEachChunk {
                hider.pass_on_pause();
            }
            while let Some(piece) = take(&hider.output) {
                out.extend_from_slice(&piece);
            }
        }
        hider.end().expect("ends");
        while let Some(piece) = take(&hider.output) {
            out.extend_from_slice(&piece);
        }
        out
    }

    /// A small deterministic generator (xorshift), so the differential test needs no crate.
    struct Dice(u64);
    impl Dice {
        fn roll(&mut self, sides: usize) -> usize {
            self.0 ^= self.0 << 13;
            self.0 ^= self.0 >> 7;
            self.0 ^= self.0 << 17;
            (self.0 % sides as u64) as usize
        }
    }

    /// A page of markup pieces a legacy template produces, stray end tags included, with the
    /// `ranking` module somewhere (maybe twice, maybe as a void or self-closed element, maybe
    /// with a `<` in a quoted value before its id) and the word in text and other attributes,
    /// a whole decoy tag in a quoted value among them. The module's own content may leave elements of
    /// other names unclosed, but it never closes one it did not open nor leaves one of its
    /// own name open, and the id never appears inside comments or scripts: in those cases
    /// where the module ends depends on the page before it, which neither path parses.
    fn page(dice: &mut Dice) -> String {
        const OUTSIDE: &[&str] = &[
            "<div>",
            "</div>",
            "<p>",
            "</p>",
            "text ranking text",
            "a < b",
            "<br>",
            "<span class=\"ranking\">",
            "</span>",
            "<!-- </div> <div> -->",
            "<!-->",
            "<?php ?>",
            "</ >",
            "<div title=\"</div> > <div>\">",
            "<script>if (a </div> b) {}</script>",
            "<a href='#ranking'>top</a>",
            "<DIV>",
            "</DIV>",
            "<ul><li>x</ul>",
            "<div/>",
            "<table><tr><td>1</td></tr></table>",
            "<img src=x>",
            "<i title=\"<div id=ranking>\">decoy</i>",
            "<span title='a <b> c' class=x>",
            "<!-- <div title=\"old -->",
            "<script>var t = '<i title=\"';</script>",
            "<STYLE>a[title=\"<b title='\"] {}</STYLE>",
            "\n",
        ];
        const INSIDE: &[&str] = &[
            "<div>x</div>",
            "<DIV>y</Div>",
            "<p>para",
            "<ul><li>a<li>b</ul>",
            "text ranking",
            "a < b",
            "<br>",
            "<img src=x>",
            "<!-- </div> -->",
            "<!-->",
            "<span>s</span>",
            "<div title=\"</div> >\">t</div>",
            "<b>bold",
            "<? x ?>",
            "</>",
            "<script>document.write('</div>')</script>",
            "<style>div{}</style>",
            "\n",
        ];
        const MODULES: &[(&str, &str)] = &[
            ("<div id=\"ranking\">", "</div>"),
            ("<div class=x id=ranking data-y='>'>", "</div>"),
            ("<DIV ID='ranking'>", "</div>"),
            ("<section id=\"ranking\">", "</section>"),
            ("<div id=\"ranking\"/>", "</div>"),
            ("<img id=\"ranking\">", ""),
            ("<div data-tip=\"<b>x</b>\" id=\"ranking\">", "</div>"),
            ("<div title='1 < 2' ID=ranking>", "</div>"),
        ];
        let mut html = String::new();
        let modules = 1 + dice.roll(2);
        let mut placed = 0;
        for _ in 0..(10 + dice.roll(60)) {
            if placed < modules && dice.roll(8) == 0 {
                let (open, close) = MODULES[dice.roll(MODULES.len())];
                html.push_str(open);
                if !close.is_empty() {
                    for _ in 0..dice.roll(6) {
                        html.push_str(INSIDE[dice.roll(INSIDE.len())]);
                    }
                    html.push_str(close);
                }
                placed += 1;
            } else {
                html.push_str(OUTSIDE[dice.roll(OUTSIDE.len())]);
            }
        }
        html
    }

    #[test]
    fn a_module_spelled_inside_a_script_comment_title_or_textarea_is_text() {
        let pages = [
            "<script>$('body').append('<div id=\"ranking\">');</script><p>content</p><div id=\"ranking\">r</div><p>after</p>",
            "<!-- <div id=\"ranking\"> --><p>content</p><div id=\"ranking\">r</div><p>after</p>",
            "<!--> <div id=\"ranking\">r</div><p>after</p>",
            "<title>About <div id=\"ranking\"></title><p>content</p><div id=\"ranking\">r</div><p>after</p>",
            "<TEXTAREA name=t><div id=\"ranking\"></textarea ><p>content</p><div id=\"ranking\">r</div><p>after</p>",
            "<style>/* <div id=\"ranking\"> */</style><script>if (a</scripts) x='<div id=\"ranking\">'</script><div id=\"ranking\">r</div><p>after</p>",
            "<script>var s='<!-- levee:module ads -->';</script><p>content</p><!-- levee:module ads -->AD<!-- /levee:module ads --><p>after</p>",
        ];
        for page in pages {
            let expected = page
                .replace("<div id=\"ranking\">r</div>", "")
                .replace("<!-- levee:module ads -->AD<!-- /levee:module ads -->", "");
            assert!(expected.contains("<p>after</p>"), "{page}");
            for chunk in [1, 3, 7, 64, 1 << 20] {
                let selectors = ["#ranking".to_string()];
                for pauses in [Pauses::Never, Pauses::AfterEachChunk] {
                    let hider = Hider::new(
                        &selectors,
                        vec!["ads".to_string()],
                        AsciiCompatibleEncoding::utf_8(),
                        true,
                    );
                    let out = run_hider(hider, page.as_bytes(), chunk, pauses);
                    assert_eq!(
                        String::from_utf8_lossy(&out),
                        expected,
                        "chunk {chunk}, {pauses:?}"
                    );
                }
            }
        }
    }

    /// A script that writes `<!--` and then `<script></script>` in a string is still open
    /// after that `</script>` (HTML's script data double escaped state): the module spelled
    /// in its next string is text. Taken for the module, it was cut out of the middle of the
    /// script (a blank page and a script error), or the rest of the page with it.
    #[test]
    fn a_module_spelled_in_a_double_escaped_script_is_text() {
        let pages = [
            "<script><!-- var a = \"<script></script>\"; var b = '<div id=\"ranking\" class=\"rk\">'; //--></script><div id=\"ranking\" class=\"rk\">R</div><p>x</p>",
            "<SCRIPT><!-- document.write('<script src=a.js></SCRIPT >'); x = '<div id=\"ranking\" class=\"rk\">' --></script ><div id=\"ranking\" class=\"rk\">R</div><p>x</p>",
            // Unescaped at `-->`, a `</script>` ends it as usual.
            "<script><!-- a --> b = 1;</script><div id=\"ranking\" class=\"rk\">R</div><p>x</p>",
            "<script><!--> x</script><div id=\"ranking\" class=\"rk\">R</div><p>x</p>",
        ];
        for page in pages {
            let expected = page.replace("<div id=\"ranking\" class=\"rk\">R</div>", "");
            // The rewriter reading the whole page agrees.
            let whole = hide_with(page.as_bytes(), &["#ranking"], 1 << 20, false);
            assert_eq!(String::from_utf8_lossy(&whole), expected);
            for (selectors, markers) in [
                (&["#ranking"][..], &[][..]),
                (&[".rk"][..], &[][..]),
                (&["#ranking"][..], &["ads"][..]),
            ] {
                assert_hides_in_pieces(
                    selectors,
                    markers,
                    page,
                    &expected,
                    &[1, 2, 3, 7, 64, 1 << 20],
                );
            }
        }
    }

    /// A PHP page that flushes its head before a slow query: while a module is off, the head
    /// goes on at the pause instead of waiting behind the bytes the scan keeps back.
    #[test]
    fn what_the_upstream_flushed_goes_on_when_it_pauses() {
        let selectors = ["#ranking".to_string()];
        let mut hider = Hider::new(
            &selectors,
            vec!["ads".to_string()],
            AsciiCompatibleEncoding::utf_8(),
            true,
        );
        let head = "<html><head><link rel=\"stylesheet\" href=\"/a.css\"></head>\n";
        hider
            .feed_shared(Bytes::from_static(head.as_bytes()))
            .expect("feeds");
        assert!(take(&hider.output).is_none(), "kept back until more comes");
        hider.pass_on_pause();
        let mut out = Vec::new();
        while let Some(piece) = take(&hider.output) {
            out.extend_from_slice(&piece);
        }
        // The last tag is kept: what comes next could be part of it.
        assert_eq!(
            out,
            b"<html><head><link rel=\"stylesheet\" href=\"/a.css\">"
        );
        // A marker's comment that has not ended is kept from its `<`.
        let rest = "<body><!-- levee:module ads -->AD<!-- /levee:module ads --><div id=\"ranking\">r</div><p>after</p></body></html>";
        let (first, second) = rest.split_at(rest.find("levee").expect("marker"));
        hider
            .feed_shared(Bytes::copy_from_slice(first.as_bytes()))
            .expect("feeds");
        hider.pass_on_pause();
        hider
            .feed_shared(Bytes::copy_from_slice(second.as_bytes()))
            .expect("feeds");
        hider.end().expect("ends");
        while let Some(piece) = take(&hider.output) {
            out.extend_from_slice(&piece);
        }
        assert_eq!(
            String::from_utf8_lossy(&out),
            format!("{}<body><p>after</p></body></html>", head)
        );
    }

    /// `page` through a fresh hider in the pieces `cuts` make, each followed by a pause of
    /// the upstream when `pause`.
    /// [`hide_in_pieces`] of `page` cut every `chunk` bytes, for each of `chunks`, with and
    /// without a pause after each piece, comes out as `expected`.
    fn assert_hides_in_pieces(
        selectors: &[&str],
        markers: &[&str],
        page: &str,
        expected: &str,
        chunks: &[usize],
    ) {
        for &chunk in chunks {
            for pause in [false, true] {
                let cuts: Vec<usize> = (chunk..page.len()).step_by(chunk).collect();
                let out = hide_in_pieces(selectors, markers, page.as_bytes(), &cuts, CARRY, pause);
                assert_eq!(
                    String::from_utf8_lossy(&out),
                    expected,
                    "{selectors:?} {markers:?}, chunk {chunk}, pause {pause}"
                );
            }
        }
    }

    fn hide_in_pieces(
        selectors: &[&str],
        markers: &[&str],
        page: &[u8],
        cuts: &[usize],
        carry: usize,
        pause: bool,
    ) -> Vec<u8> {
        let selectors: Vec<String> = selectors.iter().map(|s| s.to_string()).collect();
        let markers = markers.iter().map(|m| m.to_string()).collect();
        let mut hider = Hider::new(&selectors, markers, AsciiCompatibleEncoding::utf_8(), true);
        hider.carry = carry;
        let mut out = Vec::new();
        let mut from = 0;
        for to in cuts.iter().copied().chain([page.len()]) {
            hider
                .feed_shared(Bytes::copy_from_slice(&page[from..to]))
                .expect("feeds");
            if pause {
                hider.pass_on_pause();
            }
            while let Some(piece) = take(&hider.output) {
                out.extend_from_slice(&piece);
            }
            from = to;
        }
        hider.end().expect("ends");
        while let Some(piece) = take(&hider.output) {
            out.extend_from_slice(&piece);
        }
        out
    }

    /// Pauses of the upstream at any two places of a page change nothing in what comes out,
    /// for every kind of selector and for markers, next to scripts, comments, quoted `<`,
    /// tags in values and raw text.
    #[test]
    fn pauses_at_any_two_places_change_nothing_that_is_removed() {
        let cases: &[(&[&str], &[&str], &str)] = &[
            (&["#ranking"], &[], "<html><head><title>t</title></head><body><p>a</p><div id=\"ranking\">top<b>x</b></div><p>after</p></body></html>"),
            (&["#ranking"], &[], "<script>var s = \"<div id='ranking'>x</div>\"; if (a <b) {}</script><div id=\"ranking\">r</div><p>z</p>"),
            (&["#ranking"], &[], "<!-- <div id=\"ranking\"> a < b --><div id=\"ranking\">r</div><p>z</p>"),
            (&["#ranking"], &[], "<div title=\"<b>x</b>\" id=\"ranking\">r</div><p>after</p>"),
            (&["#ranking"], &[], "<i title=\"<div id=ranking>\">t</i><div id=ranking>r</div><p>q</p>"),
            (&["#ranking"], &[], "<textarea><div id=ranking></textarea><div id=ranking>r</div><p>q</p>"),
            (&[".ad"], &[], "<p>read ad here</p><span class=\"ad\">AD</span><p>q</p><div class=\"x ad\">A<i>2</i></div><p>e</p>"),
            (&["[data-module=visitors]"], &[], "<p>visitors</p><div data-module=\"visitors\">V<p>v</p></div><p>q</p>"),
            (&[], &["ads"], "<p>x</p><!-- levee:module ads -->AD<b>x</b><!-- /levee:module ads --><p>y</p>"),
            (&[], &["ads"], "<p>x < y</p><!--levee:module ads-->AD<!--/levee:module ads--><script>a<b</script><p>y</p>"),
            (&["#ranking"], &["ads"], "<p>x</p><!-- levee:module ads -->AD<!-- /levee:module ads --><div id=ranking>r</div><p>y</p>"),
            (&["#ranking"], &[], "<ul><li>a<li id=ranking>r<li>b</ul><p>e</p>"),
        ];
        for (selectors, markers, page) in cases {
            let page = page.as_bytes();
            for carry in [CARRY, 24] {
                for first in 0..=page.len() {
                    for second in first..=page.len() {
                        let cuts = [first, second];
                        let steady = hide_in_pieces(selectors, markers, page, &cuts, carry, false);
                        let paused = hide_in_pieces(selectors, markers, page, &cuts, carry, true);
                        assert_eq!(
                            String::from_utf8_lossy(&paused),
                            String::from_utf8_lossy(&steady),
                            "{selectors:?} {markers:?}, carry {carry}, pauses at {first} and {second}: {}",
                            String::from_utf8_lossy(page)
                        );
                    }
                }
            }
        }
    }

    #[test]
    fn the_tokenizer_state_follows_comments_and_raw_text_across_chunks() {
        let page =
            b"<p>a</p><!-- x --><ScRiPt type=x>if (a<b) '</scr' + 'ipt>'</script ><plaintext><div>";
        let markup_at = |text: &[u8], chunk: usize| {
            let mut state = cut::TokenizerState::default();
            for piece in text.chunks(chunk) {
                state.feed(piece);
            }
            state.in_markup_after(b"")
        };
        for chunk in [1, 2, 5, 1 << 20] {
            for (upto, markup) in [
                (8, true),
                (12, false),
                (18, true),
                (40, false),
                (60, false),
                (68, true),
                (78, true),
                (page.len(), false),
            ] {
                assert_eq!(
                    markup_at(&page[..upto], chunk),
                    markup,
                    "after {:?}, chunk {chunk}",
                    String::from_utf8_lossy(&page[..upto])
                );
            }
        }
    }

    #[test]
    fn a_module_is_found_after_a_quoted_lt_and_late_in_a_long_start_tag() {
        let long = "x".repeat(3 * CARRY);
        let modules = [
            "<div data-tip=\"<b>tip</b>\" id=\"ranking\"><p>top</p></div>".to_string(),
            format!("<div data-long=\"{long}\" id=\"ranking\"><p>top</p></div>"),
            format!("<div data-long=\"<b>{long}</b>\" id=ranking><p>top</p></div>"),
        ];
        for module in &modules {
            let page = format!("<p>{}</p>{module}<p>after</p>", "text ".repeat(2000));
            let expected = page.replace(module.as_str(), "");
            for chunk in [1, 100, 4096, 1 << 20] {
                for selectors in [&["#ranking"][..], &["div#ranking", ".other"][..]] {
                    let out = hide_with(page.as_bytes(), selectors, chunk, true);
                    assert!(
                        out == expected.as_bytes(),
                        "chunk {chunk}, {selectors:?}, module {}",
                        &module[..40]
                    );
                }
            }
        }
        // A tag-like `<` in a comment or a script before the module does not swallow it.
        for before in [
            "<!-- <div title=\"old -->",
            "<script>var t = '<i title=\"';</script>",
        ] {
            let page = format!("{before}<div id=\"ranking\"><p>top</p></div><p>after</p>");
            let expected = format!("{before}<p>after</p>");
            for chunk in [1, 7, 1 << 20] {
                for selectors in [&["#ranking"][..], &["#ranking", ".other"][..]] {
                    let out = hide_with(page.as_bytes(), selectors, chunk, true);
                    assert_eq!(
                        String::from_utf8_lossy(&out),
                        expected,
                        "chunk {chunk}, {selectors:?}"
                    );
                }
            }
        }
        // A tag in another tag's quoted value is a value, not an element.
        let decoy = "<i title=\"<div id=ranking>\">decoy</i><p>x</p>";
        for chunk in [1, 5, 1 << 20] {
            let out = hide_with(decoy.as_bytes(), &["#ranking"], chunk, true);
            assert_eq!(String::from_utf8_lossy(&out), decoy, "chunk {chunk}");
        }
    }

    #[test]
    fn the_fast_path_removes_exactly_what_the_rewriter_removes() {
        let mut dice = Dice(0x9e37_79b9_7f4a_7c15);
        for round in 0..1000 {
            let html = page(&mut dice);
            let selectors: &[&str] = match round % 3 {
                0 => &["div#ranking"],
                // A second needle that never occurs, and one that occurs in text: the scan
                // keeps each needle's own place.
                1 => &["#ranking", "#nowhere", "#text"],
                _ => &["#ranking"],
            };
            let slow = hide_with(html.as_bytes(), selectors, 1 << 20, false);
            // A small `carry` makes chunks without a needle common, so the in-place scan and
            // the joined one take turns on these small pages as they do on real ones.
            // With pauses after each chunk, what the scan keeps back is passed on early.
            for (chunk, carry, pauses) in [
                (1, CARRY, Pauses::Never),
                (7, CARRY, Pauses::Never),
                (64, CARRY, Pauses::Never),
                (1 << 20, CARRY, Pauses::Never),
                (9, 8, Pauses::Never),
                (33, 8, Pauses::Never),
                (64, 16, Pauses::Never),
                (200, 24, Pauses::Never),
                (1, CARRY, Pauses::AfterEachChunk),
                (5, CARRY, Pauses::AfterEachChunk),
                (13, CARRY, Pauses::AfterEachChunk),
                (64, CARRY, Pauses::AfterEachChunk),
                (33, 8, Pauses::AfterEachChunk),
            ] {
                let fast = hide_keeping(html.as_bytes(), selectors, chunk, true, carry, pauses);
                assert_eq!(
                    String::from_utf8_lossy(&fast),
                    String::from_utf8_lossy(&slow),
                    "round {round}, chunk {chunk}, carry {carry}, {pauses:?}, \
                     selectors {selectors:?}, page:\n{html}"
                );
            }
        }
    }

    /// On a page of 16 KiB chunks, every chunk without a needle is passed on where it lies:
    /// the bytes handed on are the upstream's own, apart from the few kept back at each
    /// chunk's end and the chunk that holds the module.
    #[test]
    fn chunks_without_a_needle_are_passed_on_without_a_copy() {
        let module = "<div id=\"ranking\"><p>top</p></div>";
        let filler = "<p class=\"post\">text of a post, <a href=\"/x\">a link</a></p>\n";
        let page = format!("{}{module}{}", filler.repeat(300), filler.repeat(3000));
        let selectors = vec!["#ranking".to_string()];
        let mut hider = Hider::new(
            &selectors,
            Vec::new(),
            AsciiCompatibleEncoding::utf_8(),
            true,
        );
        let (mut out, mut shared) = (Vec::new(), 0);
        let chunks: Vec<Bytes> = page
            .as_bytes()
            .chunks(16 * 1024)
            .map(Bytes::copy_from_slice)
            .collect();
        for chunk in &chunks {
            hider.feed_shared(chunk.clone()).expect("feeds");
            while let Some(piece) = take(&hider.output) {
                let inside = chunks.iter().any(|c| {
                    let range = c.as_ptr_range();
                    range.contains(&piece.as_ptr()) && piece.len() <= c.len()
                });
                if inside {
                    shared += piece.len();
                }
                out.extend_from_slice(&piece);
            }
        }
        hider.end().expect("ends");
        while let Some(piece) = take(&hider.output) {
            out.extend_from_slice(&piece);
        }
        assert_eq!(out, page.replace(module, "").as_bytes());
        // All but the chunk that holds the module with the tail of the one before, and the
        // last chunk (shorter than `CARRY`) with the tail before it, each pair copied together
        // once; a `CARRY` to spare. The tails kept from the other chunks are not copied.
        let last = chunks.last().map_or(0, Bytes::len);
        let expected = page.len() - 16 * 1024 - 3 * CARRY - last;
        assert!(
            shared >= expected,
            "{shared} of {} bytes passed on uncopied, expected at least {expected}",
            page.len()
        );
    }
}
