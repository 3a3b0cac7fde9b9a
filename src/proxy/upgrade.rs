//! Protocol upgrades (WebSocket) pass through: after both sides agreed on 101, bytes are
//! copied both ways until either side closes. The client side is handed over by levee's
//! HTTP layer once the 101 is written (`h1::upgrade`), the upstream side by hyper's client.

use http::Response;
use hyper::body::Incoming;
use hyper_util::rt::TokioIo;

use super::body::ResponseBody;
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
    let upstream = hyper::upgrade::on(&mut *upstream_response);
    let route_name = route.name.clone();
    tokio::spawn(async move {
        match (client.await, upstream.await) {
            (Ok(mut client), Ok(upstream)) => {
                let mut upstream = TokioIo::new(upstream);
                match tokio::io::copy_bidirectional(&mut client, &mut upstream).await {
                    Ok((sent, received)) => {
                        tracing::debug!(route = %route_name, sent, received, "upgraded connection closed")
                    }
                    Err(error) => {
                        tracing::debug!(route = %route_name, "upgraded connection ended: {error}")
                    }
                }
            }
            (Err(error), _) => {
                tracing::info!(route = %route_name, "upgrade failed: {error}");
            }
            (_, Err(error)) => {
                tracing::info!(route = %route_name, "upgrade failed: {error}");
            }
        }
    });
    let mut response = Response::new(full_body(bytes::Bytes::new()));
    *response.status_mut() = upstream_response.status();
    *response.headers_mut() = upstream_response.headers().clone();
    header::strip_hop_by_hop(response.headers_mut(), true);
    response
}
