//! Body wrappers on the request path: idle timeouts and completion accounting.
//! All of them stream frame by frame and keep the inner body's size hint, so framing
//! (`Content-Length` vs chunked) is preserved end to end.

use std::future::Future;
use std::pin::Pin;
use std::task::{Context, Poll};
use std::time::Duration;

use bytes::Bytes;
use http_body::{Body, Frame, SizeHint};
use http_body_util::combinators::UnsyncBoxBody;
use pin_project_lite::pin_project;
use tokio::time::{Instant, Sleep};

use crate::error::BoxError;

/// Body type of every response levee sends to clients.
pub type ResponseBody = UnsyncBoxBody<Bytes, BoxError>;

/// A body stalled for longer than its idle timeout.
#[derive(Debug, thiserror::Error)]
#[error("{side} body idle for more than {}", crate::config::units::Shown(*.after))]
pub struct BodyIdleTimeout {
    pub side: &'static str,
    pub after: Duration,
}

pin_project! {
    /// Fails the body when no frame arrives for `timeout` (slow or stalled peers).
    ///
    /// The clock starts when the body is first found without a frame ready, not when the
    /// last frame was taken: time the reader spent elsewhere (writing that frame to a slow
    /// client) is not the peer's idleness. And a body whose frames are ready whenever they
    /// are asked for, as most small responses are, never reads the clock or sets a timer.
    pub struct IdleTimeout<B> {
        #[pin]
        inner: B,
        sleep: Option<Pin<Box<Sleep>>>,
        armed: bool,
        timeout: Duration,
        side: &'static str,
    }
}

impl<B> IdleTimeout<B> {
    pub fn new(inner: B, timeout: Duration, side: &'static str) -> Self {
        IdleTimeout {
            inner,
            sleep: None,
            armed: false,
            timeout,
            side,
        }
    }
}

impl<B> Body for IdleTimeout<B>
where
    B: Body<Data = Bytes>,
    B::Error: Into<BoxError>,
{
    type Data = Bytes;
    type Error = BoxError;

    fn poll_frame(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
    ) -> Poll<Option<Result<Frame<Bytes>, BoxError>>> {
        let this = self.project();
        match this.inner.poll_frame(cx) {
            Poll::Ready(frame) => {
                *this.armed = false;
                Poll::Ready(frame.map(|result| result.map_err(Into::into)))
            }
            Poll::Pending => {
                let sleep = this.sleep.get_or_insert_with(|| {
                    Box::pin(tokio::time::sleep_until(Instant::now() + *this.timeout))
                });
                if !*this.armed {
                    sleep.as_mut().reset(Instant::now() + *this.timeout);
                    *this.armed = true;
                }
                match sleep.as_mut().poll(cx) {
                    Poll::Ready(()) => Poll::Ready(Some(Err(Box::new(BodyIdleTimeout {
                        side: this.side,
                        after: *this.timeout,
                    })))),
                    Poll::Pending => Poll::Pending,
                }
            }
        }
    }

    fn is_end_stream(&self) -> bool {
        self.inner.is_end_stream()
    }

    fn size_hint(&self) -> SizeHint {
        self.inner.size_hint()
    }
}

/// Called once when a response body is finished or dropped, with the bytes sent, whether
/// the body reached its end, and why it failed when it did (the upstream cut it short, went
/// silent, broke its framing), as against a client that went away (no failure).
pub trait OnBodyEnd: Send + 'static {
    fn on_body_end(self, bytes: u64, complete: bool, failure: Option<String>);
}

pin_project! {
    /// Counts response bytes and reports when the body is done, so the access log and the
    /// latency metric cover the whole transfer, not just the head.
    pub struct Observed<B, F: OnBodyEnd> {
        #[pin]
        inner: B,
        bytes: u64,
        complete: bool,
        failure: Option<String>,
        on_end: Option<F>,
    }

    impl<B, F: OnBodyEnd> PinnedDrop for Observed<B, F> {
        fn drop(this: Pin<&mut Self>) {
            let this = this.project();
            if let Some(on_end) = this.on_end.take() {
                on_end.on_body_end(*this.bytes, *this.complete, this.failure.take());
            }
        }
    }
}

impl<B: Body, F: OnBodyEnd> Observed<B, F> {
    /// `unsent`: the body goes to no client (the answer to a `HEAD`: a stale copy's or
    /// levee's own page keeps its body for the length the head gives, and is never polled),
    /// so the answer is whole once its head is.
    pub fn new(inner: B, on_end: F, unsent: bool) -> Self {
        Observed {
            // A body that is empty from the start (204, 304, HEAD) is never polled.
            complete: unsent || inner.is_end_stream(),
            inner,
            bytes: 0,
            failure: None,
            on_end: Some(on_end),
        }
    }
}

impl<B, F> Body for Observed<B, F>
where
    B: Body<Data = Bytes, Error = BoxError>,
    F: OnBodyEnd,
{
    type Data = Bytes;
    type Error = BoxError;

    fn poll_frame(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
    ) -> Poll<Option<Result<Frame<Bytes>, B::Error>>> {
        let mut this = self.project();
        let polled = this.inner.as_mut().poll_frame(cx);
        match &polled {
            Poll::Ready(Some(Ok(frame))) => {
                if let Some(data) = frame.data_ref() {
                    *this.bytes += data.len() as u64;
                }
                // hyper stops polling a sized body once it reports its end.
                *this.complete = this.inner.is_end_stream();
            }
            Poll::Ready(None) => *this.complete = true,
            Poll::Ready(Some(Err(error))) => {
                *this.failure = Some(crate::proxy::error_chain(&**error));
            }
            Poll::Pending => {}
        }
        polled
    }

    fn is_end_stream(&self) -> bool {
        self.inner.is_end_stream()
    }

    fn size_hint(&self) -> SizeHint {
        self.inner.size_hint()
    }
}

/// Walks an error's source chain looking for a `T` (hyper wraps body errors a few levels deep).
pub fn find_cause<'a, T: std::error::Error + 'static>(
    error: &'a (dyn std::error::Error + 'static),
) -> Option<&'a T> {
    let mut current: Option<&(dyn std::error::Error + 'static)> = Some(error);
    while let Some(error) = current {
        if let Some(found) = error.downcast_ref::<T>() {
            return Some(found);
        }
        current = error.source();
    }
    None
}

/// A request body's error, whatever wrappers it came through, as a type of its own: a body
/// that fails with a bare `BoxError` cannot be read in the request's future, because the
/// compiler then cannot prove that future `Send` for every lifetime. Its cause is the error
/// it carries, so [`find_cause`] finds what is inside.
#[derive(Debug)]
pub struct ReadBodyError(pub BoxError);

impl std::fmt::Display for ReadBodyError {
    fn fmt(&self, formatter: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        self.0.fmt(formatter)
    }
}

impl std::error::Error for ReadBodyError {
    fn source(&self) -> Option<&(dyn std::error::Error + 'static)> {
        Some(&*self.0)
    }
}

/// A request body on its way to a queue (see `queue::enqueue`).
pub type JobBody = UnsyncBoxBody<Bytes, ReadBodyError>;

/// Reads `body` until it ends or more than `limit` bytes have come, then gives it back: what
/// was read, followed by the rest still streaming. Its size hint stays the original one, so
/// the request goes upstream framed as the client framed it (a chunked body stays chunked).
/// With `keep`, a body read whole also comes back as a copy that can be sent again.
pub async fn read_ahead(
    mut body: UnsyncBoxBody<Bytes, BoxError>,
    limit: usize,
    keep: bool,
) -> Result<(UnsyncBoxBody<Bytes, BoxError>, Option<ResendableBody>), BoxError> {
    use http_body_util::BodyExt;
    let hint = body.size_hint();
    let mut read = BodyPieces::default();
    let mut ended = body.is_end_stream();
    while read.bytes_kept() <= limit && !ended {
        match body.frame().await {
            None => ended = true,
            Some(Err(error)) => return Err(error),
            // Trailers of a request are not forwarded (as before: levee frames the body).
            Some(Ok(frame)) => {
                if let Ok(data) = frame.into_data() {
                    read.push(data);
                }
            }
        }
    }
    let read: std::collections::VecDeque<Bytes> = read.into_pieces().into();
    let copy = (keep && ended).then(|| ResendableBody(read.iter().cloned().collect()));
    let body = Prefixed {
        read,
        failure: None,
        hint,
        ended,
        rest: body,
    }
    .boxed_unsync();
    Ok((body, copy))
}

/// Reads the first pieces of an answer's body until `enough`, shown each piece in turn, says
/// they are enough (or the body ends, or fails), then gives the body back whole: what was
/// read, followed by the rest still streaming. A failure met while reading comes after what
/// was read, as it came (a body given back as ended there would be sent as whole).
pub async fn read_answer_ahead(
    mut body: ResponseBody,
    mut enough: impl FnMut(&Bytes) -> bool,
) -> ResponseBody {
    use http_body_util::BodyExt;
    let hint = body.size_hint();
    let mut read = std::collections::VecDeque::new();
    let mut failure = None;
    let mut ended = body.is_end_stream();
    while !ended {
        match body.frame().await {
            None => ended = true,
            Some(Err(error)) => {
                failure = Some(error);
                ended = true;
            }
            // levee forwards no trailers (see `h1::chunked`).
            Some(Ok(frame)) => {
                if let Ok(data) = frame.into_data() {
                    let done = enough(&data);
                    read.push_back(data);
                    if done {
                        break;
                    }
                }
            }
        }
    }
    Prefixed {
        read,
        failure,
        hint,
        ended,
        rest: body,
    }
    .boxed_unsync()
}

/// A request body read whole before it was sent (see [`read_ahead`]): an idempotent request
/// (a PUT) that met a pooled connection the upstream had just closed is sent again with it,
/// as a bodiless one is.
#[derive(Clone)]
pub struct ResendableBody(Vec<Bytes>);

/// A body with nothing in it.
pub fn empty() -> UnsyncBoxBody<Bytes, BoxError> {
    use http_body_util::BodyExt as _;
    http_body_util::Empty::new()
        .map_err(|never| match never {})
        .boxed_unsync()
}

impl ResendableBody {
    /// A body that was empty.
    pub fn empty() -> ResendableBody {
        ResendableBody(Vec::new())
    }

    /// A body read whole into one piece.
    pub fn from_bytes(bytes: Bytes) -> ResendableBody {
        ResendableBody(vec![bytes])
    }

    /// A body read whole, in the pieces it came in.
    pub fn from_pieces(pieces: Vec<Bytes>) -> ResendableBody {
        ResendableBody(pieces)
    }

    /// The body again, as one piece.
    pub fn body(&self) -> UnsyncBoxBody<Bytes, BoxError> {
        use http_body_util::BodyExt as _;
        let whole = match self.0.as_slice() {
            [one] => one.clone(),
            pieces => joined(pieces),
        };
        http_body_util::Full::new(whole)
            .map_err(|never| match never {})
            .boxed_unsync()
    }
}

/// A body's bytes kept as pieces, with small ones copied together. A piece as it came costs
/// its holder a `Bytes` (32 bytes, twice that as its list grows) and keeps alive the whole
/// read buffer it is a slice of: a client sending its body a byte per chunk had levee hold
/// some 48 bytes per byte of it (a 1 MiB body, 45 MB) though every bound counts its bytes.
/// Pieces of at least [`JOINED_PIECE`] are kept as they are (no copy on a normal upload).
#[derive(Default)]
pub(crate) struct BodyPieces {
    pieces: Vec<Bytes>,
    /// A small piece kept as it came: copied only once another small one follows it (a
    /// small body in one piece, most POSTs, is never copied).
    first_small: Option<Bytes>,
    small: bytes::BytesMut,
    len: usize,
}

/// The size below which pieces are copied together (see [`BodyPieces`]).
pub(crate) const JOINED_PIECE: usize = 4096;

impl BodyPieces {
    pub(crate) fn push(&mut self, data: Bytes) {
        if data.is_empty() {
            return;
        }
        self.len += data.len();
        if data.len() >= JOINED_PIECE {
            self.flush_small();
            self.pieces.push(data);
            return;
        }
        if self.small.is_empty() {
            let Some(first) = self.first_small.take() else {
                self.first_small = Some(data);
                return;
            };
            self.small.reserve(JOINED_PIECE);
            self.small.extend_from_slice(&first);
        }
        self.small.extend_from_slice(&data);
        if self.small.len() >= JOINED_PIECE {
            self.flush_small();
        }
    }

    fn flush_small(&mut self) {
        if let Some(first) = self.first_small.take() {
            self.pieces.push(first);
        }
        if !self.small.is_empty() {
            let joined = std::mem::take(&mut self.small).freeze();
            self.pieces.push(joined);
        }
    }

    /// The bytes kept, in all.
    pub(crate) fn bytes_kept(&self) -> usize {
        self.len
    }

    pub(crate) fn into_pieces(mut self) -> Vec<Bytes> {
        self.flush_small();
        self.pieces
    }
}

/// `pieces` put together in one buffer of exactly their size (one grown piece by piece
/// doubles its room).
pub(crate) fn joined(pieces: &[Bytes]) -> Bytes {
    let mut whole = bytes::BytesMut::with_capacity(pieces.iter().map(Bytes::len).sum());
    for piece in pieces {
        whole.extend_from_slice(piece);
    }
    whole.freeze()
}

pin_project! {
    /// What was read ahead of a body, then the rest of it.
    struct Prefixed<B, E> {
        read: std::collections::VecDeque<Bytes>,
        // The body failed while it was read ahead: the failure comes after what was read.
        failure: Option<E>,
        // The whole body's size hint, as it was before any of it was read.
        hint: SizeHint,
        // The rest has ended already: it is not polled again.
        ended: bool,
        #[pin]
        rest: B,
    }
}

impl<B, E> Body for Prefixed<B, E>
where
    B: Body<Data = Bytes, Error = E>,
{
    type Data = Bytes;
    type Error = E;

    fn poll_frame(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
    ) -> Poll<Option<Result<Frame<Bytes>, Self::Error>>> {
        let this = self.project();
        if let Some(piece) = this.read.pop_front() {
            return Poll::Ready(Some(Ok(Frame::data(piece))));
        }
        if let Some(failure) = this.failure.take() {
            return Poll::Ready(Some(Err(failure)));
        }
        if *this.ended {
            return Poll::Ready(None);
        }
        this.rest.poll_frame(cx)
    }

    // Not said early, even when the rest is known to have ended: the request's framing was
    // chosen from the original hint (chunked when unknown), and a body said to be over before
    // it is polled would go upstream without its last chunk.
    fn is_end_stream(&self) -> bool {
        false
    }

    fn size_hint(&self) -> SizeHint {
        self.hint
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn small_pieces_are_copied_together_and_large_ones_kept_as_they_came() {
        let mut pieces = BodyPieces::default();
        let mut whole = Vec::new();
        // A body sent a byte per chunk: a hundred thousand pieces as it came.
        for i in 0..100_000u32 {
            let byte = [b'a' + (i % 26) as u8];
            whole.extend_from_slice(&byte);
            pieces.push(Bytes::copy_from_slice(&byte));
        }
        let large = Bytes::from(vec![b'z'; 10_000]);
        whole.extend_from_slice(&large);
        pieces.push(large.clone());
        pieces.push(Bytes::new());
        pieces.push(Bytes::from_static(b"end"));
        whole.extend_from_slice(b"end");
        assert_eq!(pieces.bytes_kept(), whole.len());
        let kept = pieces.into_pieces();
        assert!(
            kept.len() <= 100_000 / JOINED_PIECE + 3,
            "{} pieces",
            kept.len()
        );
        assert_eq!(joined(&kept), whole);
        assert!(
            kept.iter().any(|piece| piece.as_ptr() == large.as_ptr()),
            "a large piece is not copied"
        );
        // A small body in one piece (most POSTs) is not copied either.
        let form = Bytes::from_static(b"title=hello&text=world");
        let mut one = BodyPieces::default();
        one.push(form.clone());
        let kept = one.into_pieces();
        assert_eq!(kept.len(), 1);
        assert_eq!(kept[0].as_ptr(), form.as_ptr());
    }
}
