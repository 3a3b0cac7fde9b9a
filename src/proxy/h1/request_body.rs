//! The body of a request as the request path sees it: frames handed over by the connection
//! task, one at a time.

use std::pin::Pin;
use std::task::{Context, Poll};

use bytes::Bytes;
use http_body::{Body, Frame, SizeHint};
use tokio::sync::{mpsc, oneshot};

use super::chunked::ChunkedError;

/// Why a request body could not be read to its end.
#[derive(Debug, thiserror::Error)]
pub enum RequestBodyError {
    #[error("the client closed the connection before the request body was complete")]
    Incomplete,
    #[error("malformed chunked request body: {0}")]
    Chunked(#[from] ChunkedError),
    #[error("reading the request body failed: {0}")]
    Io(#[from] std::io::Error),
}

/// One piece of a request body, as sent from the connection task.
pub(super) type BodyPiece = Result<Bytes, RequestBodyError>;

/// A request body read from the client connection.
///
/// The connection task reads the socket only when this body has room for the next piece
/// (a channel of one), so a slow upstream slows the client down instead of filling memory.
/// Bodies without bytes (most GETs) need no channel at all.
#[derive(Debug)]
pub struct RequestBody {
    kind: Kind,
    /// The request's head as received (see `RequestHead::received`); empty when the request
    /// was not read from a client.
    received_head: Bytes,
}

#[derive(Debug)]
enum Kind {
    Empty,
    Streaming {
        pieces: mpsc::Receiver<BodyPiece>,
        /// Bytes still to come of a `Content-Length` body; `None` for chunked ones.
        remaining: Option<u64>,
        /// Fired on the first poll: the client sent `Expect: 100-continue` and is waiting
        /// to hear that the body is wanted.
        wanted: Option<oneshot::Sender<()>>,
        ended: bool,
    },
}

impl RequestBody {
    pub fn empty() -> RequestBody {
        RequestBody {
            kind: Kind::Empty,
            received_head: Bytes::new(),
        }
    }

    /// The body of a request that came with the head `received`.
    pub(super) fn with_received_head(self, received: Bytes) -> RequestBody {
        RequestBody {
            received_head: received,
            ..self
        }
    }

    /// The head its request came with, as received (empty when there was none).
    pub fn received_head(&self) -> &Bytes {
        &self.received_head
    }

    /// The same, taken out: the body itself does not need it.
    pub fn take_received_head(&mut self) -> Bytes {
        std::mem::take(&mut self.received_head)
    }

    pub(super) fn streaming(
        pieces: mpsc::Receiver<BodyPiece>,
        length: Option<u64>,
        wanted: Option<oneshot::Sender<()>>,
    ) -> RequestBody {
        RequestBody {
            kind: Kind::Streaming {
                pieces,
                remaining: length,
                wanted,
                ended: false,
            },
            received_head: Bytes::new(),
        }
    }
}

impl Default for RequestBody {
    fn default() -> Self {
        RequestBody::empty()
    }
}

impl Body for RequestBody {
    type Data = Bytes;
    type Error = RequestBodyError;

    fn poll_frame(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
    ) -> Poll<Option<Result<Frame<Bytes>, RequestBodyError>>> {
        let Kind::Streaming {
            pieces,
            remaining,
            wanted,
            ended,
        } = &mut self.get_mut().kind
        else {
            return Poll::Ready(None);
        };
        if *ended {
            return Poll::Ready(None);
        }
        if let Some(wanted) = wanted.take() {
            let _ = wanted.send(());
        }
        match pieces.poll_recv(cx) {
            Poll::Pending => Poll::Pending,
            // A chunked body's end, as the connection task marks it (no data piece is empty).
            Poll::Ready(Some(Ok(data))) if data.is_empty() && remaining.is_none() => {
                *ended = true;
                Poll::Ready(None)
            }
            Poll::Ready(Some(Ok(data))) => {
                if let Some(remaining) = remaining {
                    *remaining = remaining.saturating_sub(data.len() as u64);
                }
                Poll::Ready(Some(Ok(Frame::data(data))))
            }
            Poll::Ready(Some(Err(error))) => {
                *ended = true;
                Poll::Ready(Some(Err(error)))
            }
            Poll::Ready(None) => {
                *ended = true;
                // Closed before the end: the connection task is gone (the client went away,
                // levee stopped). A body it ended itself said why, or had all its bytes (a
                // length), or its end marker (chunked).
                match remaining {
                    Some(0) => Poll::Ready(None),
                    _ => Poll::Ready(Some(Err(RequestBodyError::Incomplete))),
                }
            }
        }
    }

    fn is_end_stream(&self) -> bool {
        match &self.kind {
            Kind::Empty => true,
            Kind::Streaming {
                remaining, ended, ..
            } => *ended || *remaining == Some(0),
        }
    }

    fn size_hint(&self) -> SizeHint {
        match &self.kind {
            Kind::Empty => SizeHint::with_exact(0),
            Kind::Streaming {
                remaining: Some(remaining),
                ..
            } => SizeHint::with_exact(*remaining),
            Kind::Streaming { .. } => SizeHint::default(),
        }
    }
}
