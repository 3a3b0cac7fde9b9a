//! Handing the client connection over after a `101 Switching Protocols`.
//!
//! A request that asks for an upgrade carries a [`ClientUpgrade`] in its extensions. When the
//! handler answers 101, the connection task writes that head and sends the raw connection,
//! with any bytes it had already read past the request head, to whoever holds the upgrade.

use std::future::Future;
use std::pin::Pin;
use std::sync::{Arc, Mutex};
use std::task::{Context, Poll};

use bytes::{Buf, Bytes};
use tokio::io::{AsyncRead, AsyncWrite, ReadBuf};
use tokio::net::TcpStream;
use tokio::sync::oneshot;

use crate::proxy::server::ConnectionSlot;

/// The promise of the client connection once the response to this request is a 101.
///
/// Request extensions must be `Clone`; the receiving end is shared and can be taken once.
#[derive(Clone, Debug)]
pub struct ClientUpgrade {
    receiver: Arc<Mutex<Option<oneshot::Receiver<UpgradedClient>>>>,
}

impl ClientUpgrade {
    pub(super) fn new() -> (oneshot::Sender<UpgradedClient>, ClientUpgrade) {
        let (sender, receiver) = oneshot::channel();
        (
            sender,
            ClientUpgrade {
                receiver: Arc::new(Mutex::new(Some(receiver))),
            },
        )
    }

    /// The connection, once the 101 has been written; `None` if it was taken already.
    pub fn take(&self) -> Option<PendingUpgrade> {
        let receiver = self.receiver.lock().ok()?.take()?;
        Some(PendingUpgrade { receiver })
    }
}

/// The client connection was not handed over (the response was not a 101, or the connection
/// failed while writing it).
#[derive(Debug, thiserror::Error)]
#[error("the client connection was not upgraded")]
pub struct NotUpgraded;

/// Resolves to the client connection after the 101 has been sent.
#[derive(Debug)]
pub struct PendingUpgrade {
    receiver: oneshot::Receiver<UpgradedClient>,
}

impl Future for PendingUpgrade {
    type Output = Result<UpgradedClient, NotUpgraded>;

    fn poll(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Self::Output> {
        Pin::new(&mut self.receiver)
            .poll(cx)
            .map(|received| received.map_err(|_| NotUpgraded))
    }
}

/// The raw client connection after a 101, with the bytes already read from it first.
#[derive(Debug)]
pub struct UpgradedClient {
    stream: TcpStream,
    buffered: Bytes,
    /// The connection stays counted against `max_connections` while the tunnel lives.
    _slot: ConnectionSlot,
}

impl UpgradedClient {
    pub(super) fn new(stream: TcpStream, buffered: Bytes, slot: ConnectionSlot) -> UpgradedClient {
        UpgradedClient {
            stream,
            buffered,
            _slot: slot,
        }
    }
}

impl AsyncRead for UpgradedClient {
    fn poll_read(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &mut ReadBuf<'_>,
    ) -> Poll<std::io::Result<()>> {
        if !self.buffered.is_empty() {
            let take = self.buffered.len().min(buf.remaining());
            buf.put_slice(&self.buffered[..take]);
            self.buffered.advance(take);
            return Poll::Ready(Ok(()));
        }
        Pin::new(&mut self.stream).poll_read(cx, buf)
    }
}

impl AsyncWrite for UpgradedClient {
    fn poll_write(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &[u8],
    ) -> Poll<std::io::Result<usize>> {
        Pin::new(&mut self.stream).poll_write(cx, buf)
    }

    fn poll_flush(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<std::io::Result<()>> {
        Pin::new(&mut self.stream).poll_flush(cx)
    }

    fn poll_shutdown(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<std::io::Result<()>> {
        Pin::new(&mut self.stream).poll_shutdown(cx)
    }

    fn poll_write_vectored(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        bufs: &[std::io::IoSlice<'_>],
    ) -> Poll<std::io::Result<usize>> {
        Pin::new(&mut self.stream).poll_write_vectored(cx, bufs)
    }

    fn is_write_vectored(&self) -> bool {
        self.stream.is_write_vectored()
    }
}
