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

use http::Request;
use tokio::net::TcpListener;
use tokio::sync::{mpsc, watch};

pub use conn::Answer;
pub use request_body::{RequestBody, RequestBodyError};
pub use upgrade::{ClientUpgrade, UpgradedClient};

use super::server::{accept_loop, ConnectionCount};
use crate::config::PolicyStore;

/// The public listener: accepts connections until `stop` turns true, serving each with
/// `handler` on levee's own HTTP/1.1 layer, at most `max_connections` at a time (`count`).
///
/// Every connection task holds a clone of `alive`; the caller learns that all connections
/// have finished when the receiving side sees the channel close. On stop, idle keep-alive
/// connections are closed at once and busy ones finish their current request first.
pub async fn serve<H, F>(
    listener: TcpListener,
    store: Arc<PolicyStore>,
    handler: H,
    stop: watch::Receiver<bool>,
    alive: mpsc::Sender<()>,
    count: Arc<ConnectionCount>,
) where
    H: Fn(SocketAddr, Box<Request<RequestBody>>) -> F + Clone + Send + Sync + 'static,
    F: Future + Send + 'static,
    F::Output: Into<Answer> + Send,
{
    accept_loop(
        listener,
        store,
        stop,
        alive,
        Some(count),
        move |stream, peer, limits, slot, stop| {
            conn::serve_connection(stream, peer, handler.clone(), limits, slot, stop)
        },
    )
    .await;
}
