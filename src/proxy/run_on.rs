//! An upstream call that holds a bulkhead slot runs on to its end when the client goes away.
//!
//! php-fpm does not stop a script because the connection it answers on closed: the worker
//! stays busy until the script is done (or tries to write, with `ignore_user_abort` off). A
//! slot freed when the client hangs up would let a client that asks and hangs up at once
//! put any number of scripts on a pool that `max_inflight` says holds a few: the pool fills
//! behind levee's back and legitimate requests queue inside php-fpm. So a call the upstream
//! has been sent whole goes on without the client, as nginx's `proxy_ignore_client_abort on`
//! does: its answer is read to the end (the connection then goes back to the pool), and the
//! slot is freed then. A call not sent whole yet is cut off as before: the app must never get
//! a request the client did not finish, nor one nobody waits for any more. The breaker is
//! told nothing more: the client's going is judged where it happens (see `Permit`), and a
//! call nobody waits for is no second verdict.
//!
//! Once the answer's head is in, though, the script writes as it runs (PHP sends the head at
//! its first flush): an export, a progress page, an event stream. Read on, such a call held
//! its php-fpm worker and its slot for up to `response_timeout` after its client left (20
//! abandoned event-stream pages shed a site whose pool they filled), where nginx in front of
//! php-fpm closes the connection and PHP stops the script at its next write
//! (`fastcgi_ignore_client_abort off`, `ignore_user_abort` off: both defaults). So the rest of
//! a streaming answer is read for [`RUN_ON_MID_BODY`] at most (a page already written whole
//! ends within it, and its connection is kept), then the connection is closed and the slot
//! freed: the app sees its client go as it did behind its own nginx.
//!
//! But for a half-open breaker's probe, which is the breaker's question to the app rather
//! than the client's: sent whole, it runs on to its answer (bulkhead or not), keeping its
//! probe slot, and that answer is the probe's verdict. Freed when its client left, the slot
//! let the next request probe at once, so visitors reloading a slow page during a recovery
//! put a script on the app per reload where the breaker means to allow `half_open_probes`,
//! and the round never ended while they kept leaving before `response_timeout`.

use std::future::Future;
use std::pin::Pin;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::task::{ready, Context, Poll};
use std::time::Duration;

use bytes::Bytes;
use http::Request;
use http_body::{Body, Frame, SizeHint};
use http_body_util::BodyExt;
use tokio::time::Instant;

use super::body::IdleTimeout;
use super::client::{Answered, ClientError, ResponseFields};
use super::header::FromClient;
use super::upstream::{Upstream, UpstreamBody};
use crate::breaker::{Outcome, Permit};
use crate::degrade::bulkhead::Slot;
use crate::error::BoxError;
use crate::metrics::Metrics;

type Call = Pin<Box<dyn Future<Output = Result<Answered, ClientError>> + Send>>;

/// How long the rest of an answer whose client left mid-body is read before its connection is
/// closed (see the module's text).
const RUN_ON_MID_BODY: Duration = Duration::from_secs(1);

/// The call itself: `request` sent to `upstream`, within `response_timeout` (the upstream's,
/// or what a request that waited for another's fetch has left of it); `sent_whole` is set
/// once the whole request is written.
pub(super) fn send<'a>(
    upstream: &'a Upstream,
    request: Request<UpstreamBody>,
    fields: ResponseFields,
    from_client: FromClient,
    sent_at: Instant,
    response_timeout: Duration,
    sent_whole: Option<&'a AtomicBool>,
) -> impl Future<Output = Result<Answered, ClientError>> + 'a {
    upstream.client.send_within(
        request,
        fields,
        from_client,
        Some(response_timeout),
        sent_at,
        sent_whole,
    )
}

/// Sends `request` to `upstream` as [`send`] does, holding `slot` (if any) and `permit` until
/// the answer's head is in, when the permit comes back with the answer; dropped before that,
/// once the request was sent whole, it leaves the call running on a task of its own with the
/// slot, and with the permit of a probe, which records the answer (see the module's text).
#[allow(clippy::too_many_arguments)]
pub(super) fn call_holding(
    upstream: Arc<Upstream>,
    request: Request<UpstreamBody>,
    fields: ResponseFields,
    from_client: FromClient,
    sent_at: Instant,
    response_timeout: Duration,
    slot: Option<Slot>,
    (permit, metrics): (Permit, Arc<Metrics>),
) -> HeldCall {
    let sent_whole = Arc::new(AtomicBool::new(false));
    let flag = sent_whole.clone();
    let bounds = RunOnBounds::of(&upstream);
    HeldCall {
        call: Some(Box::pin(async move {
            send(
                &upstream,
                request,
                fields,
                from_client,
                sent_at,
                response_timeout,
                Some(&flag),
            )
            .await
        })),
        slot,
        permit: Some(permit),
        metrics,
        sent_whole,
        bounds,
    }
}

/// How long a call nobody waits for may go on.
#[derive(Clone, Copy)]
struct RunOnBounds {
    /// For the answer's head, and then again for its whole body...
    response_timeout: Duration,
    /// ...with its frames at most this far apart.
    idle_body_timeout: Duration,
}

impl RunOnBounds {
    fn of(upstream: &Upstream) -> RunOnBounds {
        RunOnBounds {
            response_timeout: upstream.settings.response_timeout,
            idle_body_timeout: upstream.settings.idle_body_timeout,
        }
    }
}

pub(super) struct HeldCall {
    call: Option<Call>,
    slot: Option<Slot>,
    /// Comes back with the answer (`None` only once it has).
    permit: Option<Permit>,
    /// Where a probe running on counts its verdict.
    metrics: Arc<Metrics>,
    sent_whole: Arc<AtomicBool>,
    bounds: RunOnBounds,
}

impl HeldCall {
    /// The slot, once the call answered: the caller holds on to it until the body is read.
    /// (Not part of the answer, which is large, and moved less the fewer things travel with
    /// it.)
    pub(super) fn take_slot(&mut self) -> Option<Slot> {
        if self.call.is_some() {
            return None;
        }
        self.slot.take()
    }
}

impl Future for HeldCall {
    type Output = (Result<Answered, ClientError>, Permit);

    fn poll(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Self::Output> {
        let this = &mut *self;
        let Some(call) = this.call.as_mut() else {
            // Polled again after it was ready: nothing more will come.
            return Poll::Pending;
        };
        let answered = ready!(call.as_mut().poll(cx));
        this.call = None;
        match this.permit.take() {
            Some(permit) => Poll::Ready((answered, permit)),
            None => Poll::Pending,
        }
    }
}

impl Drop for HeldCall {
    fn drop(&mut self) {
        let Some(call) = self.call.take() else {
            return;
        };
        // Not sent whole: cut off here, as the client was (its body, if any, ends in an error
        // and the upstream sees a request that never completed); the permit, dropped with it,
        // frees its probe slot without a verdict.
        if !self.sent_whole.load(Ordering::Acquire) {
            return;
        }
        // Any other call's permit is judged here, as the client's going (see `Permit`).
        let probe = self.permit.take().filter(Permit::is_probe);
        let slot = self.slot.take();
        if probe.is_none() && slot.is_none() {
            return;
        }
        let (bounds, metrics) = (self.bounds, self.metrics.clone());
        spawn_or_drop(async move {
            match call.await {
                Ok(answered) => {
                    if let Some(mut probe) = probe {
                        probe.measure_from(answered.request_sent_at);
                        let status = answered.response.status().as_u16();
                        probe.record_status(status, Instant::now(), &metrics);
                    }
                    let body = IdleTimeout::new(
                        answered.response.into_body(),
                        bounds.idle_body_timeout,
                        "upstream",
                    );
                    read_rest(body, slot, bounds.response_timeout).await;
                }
                Err(error) => {
                    if let Some(probe) = probe {
                        let outcome = if error.is_upstream_failure() {
                            Outcome::Failure
                        } else {
                            Outcome::Abandoned
                        };
                        probe.record(outcome, Instant::now(), &metrics);
                    }
                }
            }
        });
    }
}

/// Runs `task` on the runtime; outside one (it is shutting down) the work ends here with the
/// process.
fn spawn_or_drop(task: impl Future<Output = ()> + Send + 'static) {
    if let Ok(runtime) = tokio::runtime::Handle::try_current() {
        runtime.spawn(task);
    }
}

/// Reads the rest of an answer nobody waits for (to its end, its first error, or for at most
/// `within`), keeping nothing: the body ends and its connection is reused. Then the slot it
/// held (if any) is freed.
async fn read_rest<B: Body + Unpin>(mut body: B, slot: Option<Slot>, within: Duration) {
    let reading = async { while let Some(Ok(_)) = body.frame().await {} };
    let _ = tokio::time::timeout(within, reading).await;
    drop(slot);
}

pin_project_lite::pin_project! {
    /// An upstream answer's body that holds the call's bulkhead slot until it ends: the
    /// script may still be running while its page streams (PHP sends the head at its first
    /// flush). Dropped before its end (the client hung up), it is read on by a task of its
    /// own for [`RUN_ON_MID_BODY`] at most, which then closes the connection and frees the
    /// slot.
    pub(super) struct SlotHeld<B>
    where
        B: Body,
        B: Unpin,
        B: Send,
        B: 'static,
    {
        inner: Option<B>,
        slot: Option<Slot>,
        within: Duration,
    }

    impl<B> PinnedDrop for SlotHeld<B>
    where
        B: Body,
        B: Unpin,
        B: Send,
        B: 'static,
    {
        fn drop(this: Pin<&mut Self>) {
            let this = this.project();
            let (Some(inner), Some(slot)) = (this.inner.take(), this.slot.take()) else {
                return;
            };
            if inner.is_end_stream() {
                return;
            }
            spawn_or_drop(read_rest(inner, Some(slot), *this.within));
        }
    }
}

impl<B> SlotHeld<B>
where
    B: Body + Unpin + Send + 'static,
{
    /// Once nobody waits for it, the rest is read for at most [`RUN_ON_MID_BODY`] (or
    /// `upstream`'s response timeout, if shorter), then the connection closed.
    pub(super) fn new(inner: B, slot: Slot, upstream: &Upstream) -> SlotHeld<B> {
        SlotHeld {
            inner: Some(inner),
            slot: Some(slot),
            within: upstream.settings.response_timeout.min(RUN_ON_MID_BODY),
        }
    }
}

impl<B> Body for SlotHeld<B>
where
    B: Body<Data = Bytes, Error = BoxError> + Unpin + Send + 'static,
{
    type Data = Bytes;
    type Error = BoxError;

    fn poll_frame(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
    ) -> Poll<Option<Result<Frame<Bytes>, BoxError>>> {
        let this = self.project();
        let Some(inner) = this.inner.as_mut() else {
            return Poll::Ready(None);
        };
        let polled = ready!(Pin::new(inner).poll_frame(cx));
        if !matches!(polled, Some(Ok(_))) {
            // Ended, or failed (the connection is gone): the upstream is done with it.
            *this.inner = None;
            *this.slot = None;
        }
        Poll::Ready(polled)
    }

    fn is_end_stream(&self) -> bool {
        self.inner.as_ref().is_none_or(Body::is_end_stream)
    }

    fn size_hint(&self) -> SizeHint {
        self.inner
            .as_ref()
            .map_or_else(|| SizeHint::with_exact(0), Body::size_hint)
    }
}
