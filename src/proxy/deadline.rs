//! Timeouts on timers that a connection keeps for many requests.
//!
//! Arming a tokio timer for each request (`tokio::time::timeout`) costs a timer-wheel insert
//! and a removal per request, each under the timer driver's lock. A connection keeps one
//! timer instead and leaves it armed: when it fires for an earlier request's deadline (the
//! connection served requests since), it is moved to the current one, so a busy keep-alive
//! connection re-arms it once per timeout period rather than once per request (nginx's
//! timers are lazy the same way).

use std::future::Future;
use std::pin::Pin;
use std::task::Poll;

use tokio::time::{Instant, Sleep};

/// Runs `work` until `deadline` on `timer`, which the caller keeps armed between calls:
/// `None` when the deadline passes first. (`work` is pinned by the caller: a future moved in
/// here would be copied on every call.)
pub(crate) async fn within<F: Future>(
    deadline: Instant,
    mut timer: Pin<&mut Sleep>,
    mut work: Pin<&mut F>,
) -> Option<F::Output> {
    // A deadline earlier than the armed one (a reload shortened the timeout): moved now, or
    // the timer would fire late.
    if timer.deadline() > deadline {
        timer.as_mut().reset(deadline);
    }
    std::future::poll_fn(move |cx| {
        if let Poll::Ready(output) = work.as_mut().poll(cx) {
            return Poll::Ready(Some(output));
        }
        while timer.as_mut().poll(cx).is_ready() {
            if timer.deadline() >= deadline {
                return Poll::Ready(None);
            }
            timer.as_mut().reset(deadline);
        }
        Poll::Pending
    })
    .await
}

#[cfg(test)]
mod tests {
    use std::time::Duration;

    use super::*;

    #[tokio::test(start_paused = true)]
    async fn a_timer_kept_for_many_deadlines_fires_at_each_ones_own() {
        let limit = Duration::from_secs(10);
        let timer = tokio::time::sleep(limit);
        tokio::pin!(timer);
        let first = Instant::now() + limit;
        assert_eq!(
            within(first, timer.as_mut(), std::pin::pin!(async { 1 })).await,
            Some(1)
        );
        tokio::time::advance(Duration::from_secs(6)).await;
        // The timer is still armed for the first deadline; the second has its own.
        let second = Instant::now() + limit;
        let waited = within(
            second,
            timer.as_mut(),
            std::pin::pin!(std::future::pending::<()>()),
        )
        .await;
        assert_eq!(waited, None);
        assert_eq!(
            Instant::now(),
            second,
            "timed out at the second deadline, not the first"
        );
        // A shorter deadline than the one armed is kept too.
        tokio::time::advance(Duration::from_secs(1)).await;
        let armed_later = Instant::now() + Duration::from_secs(30);
        timer.as_mut().reset(armed_later);
        let sooner = Instant::now() + Duration::from_secs(2);
        let waited = within(
            sooner,
            timer.as_mut(),
            std::pin::pin!(std::future::pending::<()>()),
        )
        .await;
        assert_eq!(waited, None);
        assert_eq!(Instant::now(), sooner);
    }
}
