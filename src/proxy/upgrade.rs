//! Protocol upgrades (WebSocket) pass through: after both sides agreed on 101, bytes are
//! copied both ways until either side closes. The client side is handed over by levee's
//! HTTP layer once the 101 is written (`h1::upgrade`), the upstream side by levee's client
//! (`client::UpstreamUpgrade`).

use http::Response;
use tokio::io::AsyncWriteExt;

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
) -> Response<ResponseBody> {
    let upstream = upstream_response
        .extensions_mut()
        .remove::<UpstreamUpgrade>()
        .and_then(|upgrade| upgrade.take());
    let route_name = route.name.clone();
    tokio::spawn(async move {
        let Some((mut upstream, early)) = upstream else {
            tracing::info!(route = %route_name, "upgrade failed: the upstream connection is gone");
            return;
        };
        let mut client = match client.await {
            Ok(client) => client,
            Err(error) => {
                tracing::info!(route = %route_name, "upgrade failed: {error}");
                return;
            }
        };
        // What the upstream sent right behind its 101 goes first.
        if !early.is_empty() {
            if let Err(error) = client.write_all(&early).await {
                tracing::debug!(route = %route_name, "upgraded connection ended: {error}");
                return;
            }
        }
        match tokio::io::copy_bidirectional(&mut client, &mut upstream).await {
            Ok((sent, received)) => {
                tracing::debug!(route = %route_name, sent, received, "upgraded connection closed")
            }
            Err(error) => {
                tracing::debug!(route = %route_name, "upgraded connection ended: {error}")
            }
        }
    });
    let mut response = Response::new(full_body(bytes::Bytes::new()));
    *response.status_mut() = upstream_response.status();
    *response.headers_mut() = upstream_response.headers().clone();
    header::strip_hop_by_hop(response.headers_mut(), true);
    response
}
