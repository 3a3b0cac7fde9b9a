//! levee's own HTTP/1.1 server side for the public listener.
//!
//! hyper's server keeps an 8 KiB read buffer and an 8 KiB write buffer for the whole life of
//! every connection; with thousands of idle keep-alive clients that was most of levee's
//! memory. This layer holds no buffer while a connection idles (see [`conn`]) and otherwise
//! keeps hyper's behaviour that the request path and the tests rely on: the same limits,
//! timeouts, keep-alive rules, framing and graceful shutdown. hyper still serves the admin
//! listener and is the client towards upstreams.
//!
//! - [`parse`]: request heads (httparse), framing and smuggling rules;
//! - [`chunked`]: the chunked request-body decoder;
//! - [`encode`]: response heads, framing and the `Date` field;
//! - [`conn`]: one connection's loop: heads, bodies with backpressure, responses, upgrades;
//! - [`request_body`]: [`RequestBody`], the body type the request path reads;
//! - [`upgrade`]: handing the raw connection over after a 101.

pub mod chunked;
mod conn;
pub mod encode;
pub mod parse;
pub mod request_body;
pub mod upgrade;

use std::future::Future;
use std::net::SocketAddr;
use std::sync::Arc;
use std::time::Duration;

use http::{Request, Response};
use tokio::net::TcpListener;
use tokio::sync::{mpsc, watch};

pub use request_body::{RequestBody, RequestBodyError};
pub use upgrade::{ClientUpgrade, UpgradedClient};

use super::body::ResponseBody;
use super::server::ConnectionLimits;
use crate::config::PolicyStore;

/// Accepts connections until `stop` turns true, serving each with `handler`.
///
/// Every connection task holds a clone of `alive`; the caller learns that all connections
/// have finished when the receiving side sees the channel close. On stop, idle keep-alive
/// connections are closed at once and busy ones finish their current request first.
pub async fn serve<H, F>(
    listener: TcpListener,
    store: Arc<PolicyStore>,
    handler: H,
    mut stop: watch::Receiver<bool>,
    alive: mpsc::Sender<()>,
) where
    H: Fn(SocketAddr, Request<RequestBody>) -> F + Clone + Send + Sync + 'static,
    F: Future<Output = Response<ResponseBody>> + Send + 'static,
{
    loop {
        let accepted = tokio::select! {
            accepted = listener.accept() => accepted,
            _ = stop.wait_for(|stopped| *stopped) => break,
        };
        let (stream, peer) = match accepted {
            Ok(accepted) => accepted,
            Err(error) => {
                // Usually out of file descriptors: back off instead of spinning.
                tracing::warn!("accept failed: {error}");
                tokio::time::sleep(Duration::from_millis(50)).await;
                continue;
            }
        };
        let _ = stream.set_nodelay(true);
        let limits = ConnectionLimits::from_store(&store);
        let handler = handler.clone();
        let stop = stop.clone();
        let alive = alive.clone();
        tokio::spawn(async move {
            let _alive = alive;
            conn::serve_connection(stream, peer, handler, limits, stop).await;
        });
    }
}
