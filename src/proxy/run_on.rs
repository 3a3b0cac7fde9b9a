//! An upstream call that holds a bulkhead slot runs on to its end when the client goes away.
//!
//! php-fpm does not stop a script because the connection it answers on closed: the worker
//! stays busy until the script is done (or tries to write, with `ignore_user_abort` off). A
//! slot freed when the client hangs up would let a client that asks and hangs up at once
//! put any number of scripts on a pool that `max_inflight` says holds a few: the pool fills
//! behind levee's back and legitimate requests queue inside php-fpm. So the call goes on
//! without the client, as nginx's `proxy_ignore_client_abort on` does, and the slot is freed
//! when the upstream has answered and its body has been read (the connection then goes back
//! to the pool). The breaker is not told anything more: the client's going is judged where
//! it happens (see `Permit`), and a call nobody waits for is no second verdict.

use std::future::Future;
use std::pin::Pin;
use std::sync::Arc;
use std::task::{ready, Context, Poll};
use std::time::Duration;

use http::Request;
use http_body_util::BodyExt;
use tokio::time::Instant;

use super::body::IdleTimeout;
use super::client::{Answered, ClientError, ResponseFields};
use super::header::ForwardedFrom;
use super::upstream::{Upstream, UpstreamBody};
use crate::degrade::bulkhead::Slot;

type Call = Pin<Box<dyn Future<Output = Result<Answered, ClientError>> + Send>>;

/// Sends `request` to `upstream` as [`super::client::Client::send_within`] does, holding
/// `slot` until the answer's head is in; dropped before that, it leaves the call running on
/// a task of its own with the slot (see the module's text).
pub(super) fn call_holding(
    upstream: Arc<Upstream>,
    request: Request<UpstreamBody>,
    fields: ResponseFields,
    forwarded: ForwardedFrom,
    sent_at: Instant,
    slot: Slot,
) -> HeldCall {
    let response_timeout = upstream.settings.response_timeout;
    let idle_body_timeout = upstream.settings.idle_body_timeout;
    HeldCall {
        call: Some(Box::pin(async move {
            send(&upstream, request, fields, forwarded, sent_at).await
        })),
        slot: Some(slot),
        response_timeout,
        idle_body_timeout,
    }
}

/// The call itself: `request` sent to `upstream`, within its response timeout.
pub(super) fn send<'a>(
    upstream: &'a Upstream,
    request: Request<UpstreamBody>,
    fields: ResponseFields,
    forwarded: ForwardedFrom,
    sent_at: Instant,
) -> impl Future<Output = Result<Answered, ClientError>> + 'a {
    upstream.client.send_within(
        request,
        fields,
        Some(forwarded),
        Some(upstream.settings.response_timeout),
        sent_at,
    )
}

pub(super) struct HeldCall {
    call: Option<Call>,
    slot: Option<Slot>,
    /// Bounds on a call nobody waits for: its body is read for at most this long...
    response_timeout: Duration,
    /// ...and while its frames come at most this far apart.
    idle_body_timeout: Duration,
}

impl Future for HeldCall {
    /// The answer, and the slot, which the caller holds on until the body is sent.
    type Output = (Result<Answered, ClientError>, Option<Slot>);

    fn poll(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Self::Output> {
        let this = &mut *self;
        let Some(call) = this.call.as_mut() else {
            // Polled again after it was ready: nothing more will come.
            return Poll::Pending;
        };
        let answered = ready!(call.as_mut().poll(cx));
        this.call = None;
        Poll::Ready((answered, this.slot.take()))
    }
}

impl Drop for HeldCall {
    fn drop(&mut self) {
        let (Some(call), Some(slot)) = (self.call.take(), self.slot.take()) else {
            return;
        };
        // Outside a runtime (it is shutting down), the call ends here with the process.
        let Ok(runtime) = tokio::runtime::Handle::try_current() else {
            return;
        };
        let (response_timeout, idle_body_timeout) = (self.response_timeout, self.idle_body_timeout);
        runtime.spawn(async move {
            if let Ok(answered) = call.await {
                let body =
                    IdleTimeout::new(answered.response.into_body(), idle_body_timeout, "upstream");
                // Read, not kept: the body ends, and the connection is reused.
                let _ = tokio::time::timeout(response_timeout, read_to_end(body)).await;
            }
            drop(slot);
        });
    }
}

/// Reads a body to its end (or its first error), keeping nothing.
async fn read_to_end<B: http_body::Body + Unpin>(mut body: B) {
    while let Some(Ok(_)) = body.frame().await {}
}
