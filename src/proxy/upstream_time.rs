//! The upstream's own time over a call, its answer's body included.
//!
//! A PHP page often sends its head at once and takes its time in the body: php-fpm's
//! `output_buffering` (4 KiB in Debian's php.ini) sends the head with the first 4 KiB, before
//! the slow query that follows. Timed to the head, a page of 1.6 s counted as 2 ms: the
//! `latency_p95` trigger, the breaker's `slow_call` and the p95 that `/status` shows all missed
//! the slowness they are there for. Timed to the end of the body as the client reads it, a
//! visitor on a slow line would make the app look slow instead. So the body's time counts
//! only while levee waits for the upstream's next bytes, not while the client reads.

use std::pin::Pin;
use std::sync::{Arc, Mutex};
use std::task::{Context, Poll, Wake, Waker};
use std::time::Duration;

use bytes::Bytes;
use http_body::{Body, Frame, SizeHint};
use pin_project_lite::pin_project;
use tokio::time::Instant;

use crate::breaker::Permit;
use crate::degrade::trigger::LatencyWindow;
use crate::metrics::Metrics;
use crate::redis_batch::lock;

use crate::error::BoxError;

type FrameResult = Result<Frame<Bytes>, BoxError>;

/// What a call's end is recorded into, and what it took until its answer's head.
pub struct CallEnd {
    pub permit: Permit,
    pub latency: Arc<LatencyWindow>,
    pub metrics: Arc<Metrics>,
    /// From the request sent whole to the answer's head.
    pub until_head: Duration,
    /// When the head came: the end of a body that never made levee wait came with it, and
    /// the clock is not read again (every small answer).
    pub answered_at: Instant,
}

impl CallEnd {
    /// Records a call that took `took` of the upstream's time: ended at `at` (`cut`: failed
    /// midway), or left unread (`left`: the client went away first).
    fn record(self, took: Duration, at: Instant, cut: bool, left: bool) {
        self.latency.record(at, took);
        if left {
            self.permit.record_body_left(took, at, &self.metrics);
        } else {
            self.permit.record_body_end(cut, took, at, &self.metrics);
        }
    }
}

pin_project! {
    /// An upstream's answer body, timed while levee waits for its next bytes; the call is
    /// recorded when the body ends, fails or is dropped. A body whose bytes are there
    /// whenever they are asked for (most small answers) reads the clock once, at its end.
    pub struct Timed<B> {
        #[pin]
        inner: B,
        end: Option<CallEnd>,
        // Time spent waiting for the upstream's bytes so far, the head's wait included.
        took: Duration,
        // Since when levee waits for the next bytes, while it does.
        waiting_since: Option<Instant>,
        // Made at the first wait.
        clock: Option<Arc<WakeClock>>,
    }

    impl<B> PinnedDrop for Timed<B> {
        fn drop(this: Pin<&mut Self>) {
            let this = this.project();
            if let Some(end) = this.end.take() {
                let now = Instant::now();
                let waited = waited(*this.waiting_since, this.clock.as_ref(), now);
                end.record(*this.took + waited, now, false, true);
            }
        }
    }
}

/// Notes when the upstream woke levee for its next bytes. levee may ask the body for them
/// only much later: while its client's socket is full, hyper writes nothing and asks the
/// body for nothing, and a client reading a large download slowly made the upstream look
/// slow. The wait ends at the wake, not at the next poll.
#[derive(Default)]
struct WakeClock {
    state: Mutex<WakeState>,
}

#[derive(Default)]
struct WakeState {
    woke_at: Option<Instant>,
    /// The waker of the task that polls the body, woken in turn.
    waker: Option<Waker>,
}

impl Wake for WakeClock {
    fn wake(self: Arc<Self>) {
        self.wake_by_ref();
    }

    fn wake_by_ref(self: &Arc<Self>) {
        let waker = {
            let mut state = lock(&self.state);
            state.woke_at.get_or_insert_with(Instant::now);
            state.waker.take()
        };
        if let Some(waker) = waker {
            waker.wake();
        }
    }
}

/// How long the wait that began `since` (if one did) has lasted at `now`: until the wake.
fn waited(since: Option<Instant>, clock: Option<&Arc<WakeClock>>, now: Instant) -> Duration {
    let Some(since) = since else {
        return Duration::ZERO;
    };
    let woke = clock.and_then(|clock| lock(&clock.state).woke_at.take());
    woke.unwrap_or(now).saturating_duration_since(since)
}

/// Polls `inner` with a waker that notes the wake on `clock` and passes it on to `cx`'s.
fn poll_noting_wake<B: Body<Data = Bytes, Error = BoxError>>(
    inner: Pin<&mut B>,
    clock: &Arc<WakeClock>,
    cx: &Context<'_>,
) -> Poll<Option<FrameResult>> {
    {
        let mut state = lock(&clock.state);
        if !state
            .waker
            .as_ref()
            .is_some_and(|waker| waker.will_wake(cx.waker()))
        {
            state.waker = Some(cx.waker().clone());
        }
    }
    let waker = Waker::from(clock.clone());
    inner.poll_frame(&mut Context::from_waker(&waker))
}

impl<B> Timed<B> {
    pub fn new(inner: B, end: CallEnd) -> Timed<B> {
        Timed {
            inner,
            took: end.until_head,
            end: Some(end),
            waiting_since: None,
            clock: None,
        }
    }
}

impl<B> Body for Timed<B>
where
    B: Body<Data = Bytes, Error = BoxError>,
{
    type Data = Bytes;
    type Error = BoxError;

    fn poll_frame(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Option<FrameResult>> {
        let mut this = self.project();
        let polled = match (this.waiting_since.is_some(), this.clock.as_ref()) {
            (true, Some(clock)) => poll_noting_wake(this.inner.as_mut(), clock, cx),
            _ => this.inner.as_mut().poll_frame(cx),
        };
        let polled = match polled {
            Poll::Pending if this.end.is_some() && this.waiting_since.is_none() => {
                // A wait begins. Asked once more, the body takes the waker that notes when
                // it wakes (the first ask left the plain one, which a body that never waits
                // is spared).
                *this.waiting_since = Some(Instant::now());
                let clock = this.clock.get_or_insert_with(Arc::default);
                lock(&clock.state).woke_at = None;
                poll_noting_wake(this.inner.as_mut(), clock, cx)
            }
            polled => polled,
        };
        let Poll::Ready(frame) = polled else {
            return Poll::Pending;
        };
        if this.end.is_none() {
            return Poll::Ready(frame);
        }
        let cut = matches!(frame, Some(Err(_)));
        // hyper stops asking once the body says it has ended after a frame.
        let ended = cut || frame.is_none() || this.inner.is_end_stream();
        let mut now = None;
        if this.waiting_since.is_some() {
            let at = Instant::now();
            *this.took += waited(this.waiting_since.take(), this.clock.as_ref(), at);
            now = Some(at);
        }
        if ended {
            if let Some(end) = this.end.take() {
                let at = match (now, &this.clock) {
                    (Some(at), _) => at,
                    (None, Some(_)) => Instant::now(),
                    (None, None) => end.answered_at,
                };
                end.record(*this.took, at, cut, false);
            }
        }
        Poll::Ready(frame)
    }

    fn is_end_stream(&self) -> bool {
        self.inner.is_end_stream()
    }

    fn size_hint(&self) -> SizeHint {
        self.inner.size_hint()
    }
}
