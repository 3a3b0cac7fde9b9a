//! Protocol upgrades (WebSocket) pass through: after both sides agreed on 101, bytes are
//! copied both ways until either side closes, or no byte has moved either way for
//! `tunnel_idle_timeout`. The client side is handed over by levee's
//! HTTP layer once the 101 is written (`h1::upgrade`), the upstream side by levee's client
//! (`client::UpstreamUpgrade`).

use std::io::IoSlice;
use std::pin::Pin;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::task::{Context, Poll};
use std::time::Duration;

use http::Response;
use tokio::io::{AsyncRead, AsyncWrite, AsyncWriteExt, ReadBuf};

use super::body::ResponseBody;
use super::client::{Incoming, UpstreamUpgrade};
use super::h1::upgrade::PendingUpgrade;
use super::header;
use super::route::Route;
use crate::error::full_body;

/// Answers the client's upgrade with the upstream's 101 and joins the two connections.
pub fn pass_through(
    client: PendingUpgrade,
    upstream_response: &mut Response<Incoming>,
    route: &Route,
    idle_timeout: Duration,
) -> Response<ResponseBody> {
    let upstream = upstream_response
        .extensions_mut()
        .remove::<UpstreamUpgrade>()
        .and_then(|upgrade| upgrade.take());
    let route_name = route.name.clone();
    tokio::spawn(async move {
        let Some((upstream, early)) = upstream else {
            tracing::info!(route = %route_name, "upgrade failed: the upstream connection is gone");
            return;
        };
        let client = match client.await {
            Ok(client) => client,
            Err(error) => {
                tracing::info!(route = %route_name, "upgrade failed: {error}");
                return;
            }
        };
        let moved = Arc::new(AtomicU64::new(0));
        let mut client = Counted::new(client, &moved);
        let mut upstream = Counted::new(upstream, &moved);
        let tunnel = async {
            // What the upstream sent right behind its 101 goes first (under the same idle
            // bound: a client that never reads it must not hold the tunnel).
            if !early.is_empty() {
                client.write_all(&early).await?;
            }
            tokio::io::copy_bidirectional(&mut client, &mut upstream).await
        };
        tokio::select! {
            copied = tunnel => match copied {
                Ok((sent, received)) => {
                    tracing::debug!(route = %route_name, sent, received, "upgraded connection closed")
                }
                Err(error) => {
                    tracing::debug!(route = %route_name, "upgraded connection ended: {error}")
                }
            },
            () = quiet_for(&moved, idle_timeout) => {
                tracing::info!(
                    route = %route_name,
                    "upgraded connection closed: no byte either way for {idle_timeout:?} (tunnel_idle_timeout)"
                );
            }
        }
    });
    let mut response = Response::new(full_body(bytes::Bytes::new()));
    *response.status_mut() = upstream_response.status();
    *response.headers_mut() = upstream_response.headers().clone();
    if let Some(received) = upstream_response.extensions().get::<header::ReceivedHead>() {
        response.extensions_mut().insert(received.clone());
    }
    header::strip_hop_by_hop(response.headers_mut(), true);
    response
}

/// Resolves once no byte has moved for `idle` (checked four times per `idle`, so it resolves
/// between `idle` and 1.25 × `idle` after the last byte).
async fn quiet_for(moved: &AtomicU64, idle: Duration) {
    let step = (idle / 4).max(Duration::from_millis(1));
    let mut seen = moved.load(Ordering::Relaxed);
    let mut quiet = Duration::ZERO;
    while quiet < idle {
        tokio::time::sleep(step).await;
        let now = moved.load(Ordering::Relaxed);
        if now == seen {
            quiet += step;
        } else {
            seen = now;
            quiet = Duration::ZERO;
        }
    }
}

/// A tunnel end that counts the bytes it moves, so idleness is told without a clock read per
/// read or write.
struct Counted<S> {
    inner: S,
    moved: Arc<AtomicU64>,
}

impl<S> Counted<S> {
    fn new(inner: S, moved: &Arc<AtomicU64>) -> Counted<S> {
        Counted {
            inner,
            moved: moved.clone(),
        }
    }

    fn count<T>(&self, result: Poll<std::io::Result<T>>, bytes: usize) -> Poll<std::io::Result<T>> {
        if bytes > 0 {
            self.moved.fetch_add(bytes as u64, Ordering::Relaxed);
        }
        result
    }
}

impl<S: AsyncRead + Unpin> AsyncRead for Counted<S> {
    fn poll_read(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &mut ReadBuf<'_>,
    ) -> Poll<std::io::Result<()>> {
        let before = buf.filled().len();
        let result = Pin::new(&mut self.inner).poll_read(cx, buf);
        let read = buf.filled().len() - before;
        self.count(result, read)
    }
}

impl<S: AsyncWrite + Unpin> AsyncWrite for Counted<S> {
    fn poll_write(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &[u8],
    ) -> Poll<std::io::Result<usize>> {
        let result = Pin::new(&mut self.inner).poll_write(cx, buf);
        let written = match &result {
            Poll::Ready(Ok(written)) => *written,
            _ => 0,
        };
        self.count(result, written)
    }

    fn poll_write_vectored(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        bufs: &[IoSlice<'_>],
    ) -> Poll<std::io::Result<usize>> {
        let result = Pin::new(&mut self.inner).poll_write_vectored(cx, bufs);
        let written = match &result {
            Poll::Ready(Ok(written)) => *written,
            _ => 0,
        };
        self.count(result, written)
    }

    fn is_write_vectored(&self) -> bool {
        self.inner.is_write_vectored()
    }

    fn poll_flush(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<std::io::Result<()>> {
        Pin::new(&mut self.inner).poll_flush(cx)
    }

    fn poll_shutdown(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<std::io::Result<()>> {
        Pin::new(&mut self.inner).poll_shutdown(cx)
    }
}
