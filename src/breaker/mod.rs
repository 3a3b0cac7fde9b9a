//! One circuit breaker per dependency (upstream). Routes that share an upstream share its
//! breaker; one dependency failing never changes another's state.

pub mod machine;

use std::sync::{Arc, Mutex};
use std::time::Duration;

use tokio::time::Instant;

use crate::log_throttle::LogThrottle;
use crate::metrics::{BreakerLabels, BreakerProbeLabels, BreakerTransitionLabels, Metrics};
use machine::Machine;
pub use machine::{
    Admission, BreakerSettings, ClientId, Force, Outcome, State, Transition, MOST_FAILING_CLIENTS,
};

pub struct Breaker {
    pub upstream: String,
    machine: Mutex<Machine>,
    /// The warning that failures from too few clients left the breaker closed: once every
    /// 10 s, as a visitor repeating a failing page would write it on each request.
    held_closed_log: LogThrottle,
    /// The last trip that failures from too few clients held back: when, and from how many
    /// clients of how many needed, for `/status` (an operator testing from one office saw
    /// the breaker stay closed and nothing say why).
    last_held: Mutex<Option<(Instant, u32, u32)>>,
}

impl std::fmt::Debug for Breaker {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Breaker")
            .field("upstream", &self.upstream)
            .finish()
    }
}

/// What `/status` shows of a breaker.
#[derive(Debug, Clone, serde::Serialize)]
pub struct BreakerStatus {
    pub state: &'static str,
    /// `open` / `closed` when pinned (admin API first, then policy), else `auto`.
    pub force: &'static str,
    pub forced_by: &'static str,
    pub open_for_remaining_ms: Option<u64>,
    /// How long it has been ready to probe with no request to probe it (its open time ran
    /// out), in ms; `None` otherwise.
    pub ready_to_probe_ms: Option<u64>,
    pub window_calls: u32,
    pub window_failures: u32,
    pub window_slow: u32,
    /// The last trip held back by `failing_clients`, if any since the start.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub held_closed: Option<HeldClosed>,
}

/// A trip `failing_clients` held back: how long ago, and the clients whose calls failed
/// against those it asks for.
#[derive(Debug, Clone, serde::Serialize)]
pub struct HeldClosed {
    pub ago_ms: u64,
    pub failing_clients: u32,
    pub needed: u32,
}

impl Breaker {
    pub fn new(upstream: &str, settings: BreakerSettings) -> Breaker {
        Breaker {
            upstream: upstream.to_string(),
            machine: Mutex::new(Machine::new(settings, Instant::now())),
            held_closed_log: LogThrottle::new(Duration::from_secs(10)),
            last_held: Mutex::new(None),
        }
    }

    fn held_closed(&self, now: Instant) -> Option<HeldClosed> {
        let held = *self
            .last_held
            .lock()
            .unwrap_or_else(|poisoned| poisoned.into_inner());
        held.map(|(at, failing_clients, needed)| HeldClosed {
            ago_ms: now.saturating_duration_since(at).as_millis() as u64,
            failing_clients,
            needed,
        })
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, Machine> {
        self.machine
            .lock()
            .unwrap_or_else(|poisoned| poisoned.into_inner())
    }

    pub fn settings(&self) -> BreakerSettings {
        self.lock().settings.clone()
    }

    /// Is the breaker closed (requests go through without being probes)?
    pub fn is_closed(&self) -> bool {
        let machine = self.lock();
        match machine.force() {
            Some(force) => force == Force::Closed,
            None => machine.state == State::Closed,
        }
    }

    /// Whether a request asking now would be let through: a look that takes no probe slot and
    /// counts no refusal (for the queue's worker, which holds its batch back otherwise).
    pub fn would_admit(&self, now: Instant) -> bool {
        self.lock().would_admit(now)
    }

    /// Asks to send one request of `client` at `now` (the caller's reading of the clock: a
    /// request reads it once for the breaker, the upstream pool and its response timer).
    /// `Err(retry_after)` while open (or half-open and full).
    pub fn admit(
        self: &Arc<Self>,
        now: Instant,
        client: ClientId,
        metrics: &Metrics,
    ) -> Result<Permit, Duration> {
        let (admission, transition, round, slow_call) = {
            let mut machine = self.lock();
            let (admission, transition) = machine.admit(now, client);
            (
                admission,
                transition,
                machine.probe_round(),
                machine.settings.slow_call,
            )
        };
        if let Some(transition) = transition {
            self.report(transition, metrics);
        }
        match admission {
            Admission::Rejected { retry_after } => {
                metrics.breaker_rejected.get_or_create(&self.labels()).inc();
                Err(retry_after)
            }
            admission => Ok(Permit {
                breaker: self.clone(),
                admission,
                round,
                client,
                started: now,
                recorded: false,
                slow_call,
                watched: None,
            }),
        }
    }

    /// Pins the breaker at runtime (`Some`) or hands it back to the policy (`None`, "auto").
    /// The fleet's saved pins are followed on every switch sync, so a pin it already has
    /// changes nothing.
    pub fn set_runtime_force(&self, force: Option<Force>, metrics: &Metrics) {
        let mut machine = self.lock();
        if machine.runtime_force == force {
            return;
        }
        let was_pinned = machine.runtime_force.is_some();
        machine.runtime_force = force;
        // Handed back after a pin, it starts afresh: what it counted while pinned says
        // nothing of the dependency now. Asked for `auto` when it already was, it keeps its
        // state: an operator's "auto" must not close a breaker that opened by itself.
        if force.is_none() && was_pinned {
            machine.reset(Instant::now());
        }
        let state = match machine.force() {
            Some(Force::Open) => 1,
            Some(Force::Closed) => 0,
            None => state_value(machine.state),
        };
        drop(machine);
        metrics
            .breaker_state
            .get_or_create(&self.labels())
            .set(state);
        // Info: the change itself is warned of where it is made, with who made it; this line
        // is each instance putting it in effect (the fleet follows a pin through Redis).
        tracing::info!(upstream = %self.upstream, force = Force::word(force), "breaker pin in effect");
    }

    /// The pin set at runtime, if any.
    pub fn runtime_force(&self) -> Option<Force> {
        self.lock().runtime_force
    }

    /// A breaker a reload starts afresh knows the clients the one it replaces had: else, for
    /// a while after any such reload, one visitor was all its clients and could open it.
    pub fn keep_callers_of(&self, replaced: &Breaker) {
        let known = replaced.lock().callers();
        let mut machine = self.lock();
        for client in known {
            machine.note_caller(client);
        }
    }

    /// A breaker a reload starts afresh keeps the runtime pin of the one it replaces: the
    /// operator's "cut it off" outlives an edit of the breaker's settings.
    pub fn keep_pin_of(&self, replaced: &Breaker) {
        let pin = replaced.runtime_force();
        self.lock().runtime_force = pin;
    }

    /// Pinned open or closed, by the policy's `force` or at runtime.
    pub fn is_pinned(&self) -> bool {
        self.lock().force().is_some()
    }

    /// The state as `levee_breaker_state` has it (0 closed, 1 open, 2 half-open), read as
    /// [`Self::status`] reads it: pinned by `force`, and half-open once the open time ran out.
    pub fn state_value(&self) -> i64 {
        let machine = self.lock();
        match machine.force() {
            Some(Force::Open) => 1,
            Some(Force::Closed) => 0,
            None => match machine.state {
                State::Open { until } if until <= Instant::now() => 2,
                state => state_value(state),
            },
        }
    }

    pub fn status(&self) -> BreakerStatus {
        let now = Instant::now();
        let machine = self.lock();
        let (force, forced_by) = match (machine.runtime_force, machine.settings.force) {
            (Some(force), _) => (force, "runtime"),
            (None, Some(force)) => (force, "policy"),
            (None, None) => {
                let (calls, failures, slow) = machine.window_counts(now);
                // An open breaker whose time has run out becomes half-open on the next
                // request; said so already, or something that waits for it to stop being
                // open (a trigger, the queue's replay) would wait for a request that, with
                // the upstream's routes switched off, may never come.
                let ready_since = match machine.state {
                    State::Open { until } if until <= now => Some(until),
                    State::HalfOpen => machine.idle_since,
                    _ => None,
                };
                let state = match machine.state {
                    State::Open { until } if until <= now => "half_open",
                    state => state.name(),
                };
                let ready_to_probe_ms = ready_since
                    .map(|since| now.saturating_duration_since(since).as_millis() as u64);
                return BreakerStatus {
                    state,
                    ready_to_probe_ms,
                    force: "auto",
                    forced_by: "-",
                    open_for_remaining_ms: match machine.state {
                        State::Open { until } => {
                            Some(until.saturating_duration_since(now).as_millis() as u64)
                        }
                        _ => None,
                    },
                    window_calls: calls,
                    window_failures: failures,
                    window_slow: slow,
                    held_closed: self.held_closed(now),
                };
            }
        };
        let (calls, failures, slow) = machine.window_counts(now);
        BreakerStatus {
            state: if force == Force::Open {
                "open"
            } else {
                "closed"
            },
            force: if force == Force::Open {
                "open"
            } else {
                "closed"
            },
            forced_by,
            open_for_remaining_ms: None,
            ready_to_probe_ms: None,
            window_calls: calls,
            window_failures: failures,
            window_slow: slow,
            held_closed: None,
        }
    }

    fn labels(&self) -> BreakerLabels {
        BreakerLabels {
            upstream: self.upstream.clone().into(),
        }
    }

    fn report(&self, transition: Transition, metrics: &Metrics) {
        let (to, state) = match transition {
            Transition::HeldClosed {
                reason,
                clients,
                needed,
            } => {
                metrics
                    .breaker_held_closed
                    .get_or_create(&self.labels())
                    .inc();
                *self
                    .last_held
                    .lock()
                    .unwrap_or_else(|poisoned| poisoned.into_inner()) =
                    Some((Instant::now(), clients, needed));
                if let Some(held_back) = self.held_closed_log.allow(std::time::Instant::now()) {
                    tracing::warn!(
                        upstream = %self.upstream,
                        reason,
                        failing_clients = clients,
                        needed,
                        held_back,
                        "breaker kept closed: its failures came from {}, and failing_clients asks for {needed} (pages that fail for a few visitors are not taken for the dependency down; the access log names them)",
                        crate::config::units::counted(u64::from(clients), "client network"),
                    );
                }
                return;
            }
            Transition::Opened { reason, open_for } => {
                tracing::warn!(upstream = %self.upstream, reason, ?open_for, "breaker opened: the dependency gets no traffic; its routes answer with their stale copy, a queued write or their fallback");
                ("open", 1)
            }
            Transition::HalfOpened => {
                tracing::info!(upstream = %self.upstream, "breaker half-open: sending probes");
                ("half_open", 2)
            }
            Transition::Closed => {
                tracing::info!(upstream = %self.upstream, "breaker closed: the dependency recovered");
                ("closed", 0)
            }
        };
        metrics
            .breaker_state
            .get_or_create(&self.labels())
            .set(state);
        metrics
            .breaker_transitions
            .get_or_create(&BreakerTransitionLabels {
                upstream: self.upstream.clone().into(),
                to,
            })
            .inc();
    }
}

fn state_value(state: State) -> i64 {
    match state {
        State::Closed => 0,
        State::Open { .. } => 1,
        State::HalfOpen => 2,
    }
}

/// What [`Permit::record_head`] did.
pub enum AtHead {
    /// The status is one of `failure_statuses`: recorded as a failure.
    Failed,
    /// Any other status: the call ends with its body, and this permit records it then.
    BodyToCome(Permit),
}

/// Permission to send one request. Record its outcome; dropping it unrecorded (the client
/// went away) frees a probe slot without a verdict.
pub struct Permit {
    breaker: Arc<Breaker>,
    admission: Admission,
    /// The half-open round a probe belongs to.
    round: u32,
    /// Whose call it is: a trip needs failures from `failing_clients` of them.
    client: ClientId,
    started: Instant,
    recorded: bool,
    /// The breaker's `slow_call` when the call was admitted.
    slow_call: Option<Duration>,
    /// Set by [`Permit::count_if_abandoned_slow`]: where a drop reports what it counted.
    watched: Option<Arc<Metrics>>,
}

impl Permit {
    /// One of a half-open breaker's probes: its answer decides whether the breaker closes.
    pub fn is_probe(&self) -> bool {
        self.admission == Admission::Probe
    }

    /// Times the call from `at` rather than from admission: the request's upload is the
    /// client's time, and a slow client does not make a slow call.
    pub fn measure_from(&mut self, at: Instant) {
        self.started = at;
    }

    /// Counts the call as slow if it is dropped unanswered more than `slow_call` after
    /// `sent_at`: a client (or a front proxy whose read timeout is shorter than
    /// `response_timeout`) that gave up on a hung dependency otherwise leaves no trace, and the
    /// breaker would never open. Only for requests without a body: for the others the drop
    /// cannot tell the client's own slow upload from the dependency's wait. Costs nothing
    /// without `slow_call`.
    pub fn count_if_abandoned_slow(&mut self, sent_at: Instant, metrics: &Arc<Metrics>) {
        if self.slow_call.is_some() {
            self.started = sent_at;
            self.watched = Some(metrics.clone());
        }
    }

    /// Records the outcome of a call answered at `at` (a failure status, or a success that
    /// may be slow) and says whether the status counted as a failure.
    pub fn record_status(mut self, status: u16, at: Instant, metrics: &Metrics) -> bool {
        self.recorded = true;
        // One lock for the settings and the record: this is every proxied request's path.
        let mut machine = self.breaker.lock();
        let failed = machine.settings.failure_statuses.contains(&status);
        let outcome = if failed {
            Outcome::Failure
        } else {
            let slow = machine
                .settings
                .slow_call
                .is_some_and(|limit| at.saturating_duration_since(self.started) > limit);
            Outcome::Success { slow }
        };
        let transition =
            machine.record_in_round(at, self.admission, self.round, outcome, self.client);
        drop(machine);
        self.report(outcome, transition, Some(metrics));
        failed
    }

    /// Records a call whose answer's head came at `at` with `status`, when a body is still to
    /// come: a failure status is recorded now; any other is the body's to settle, since a
    /// page whose head goes out at once (PHP flushes its first 4 KiB, then runs its slow
    /// query) is slow or cut short only in its body ([`Self::record_body_end`]).
    pub fn record_head(self, status: u16, at: Instant, metrics: &Metrics) -> AtHead {
        let failed = self
            .breaker
            .lock()
            .settings
            .failure_statuses
            .contains(&status);
        if failed {
            self.record(Outcome::Failure, at, metrics);
            AtHead::Failed
        } else {
            // Answered: from here a drop is a body left unread, which the body's timing
            // judges (`record_body_left`), not the wait for an answer.
            let mut permit = self;
            permit.watched = None;
            AtHead::BodyToCome(permit)
        }
    }

    /// Records a call whose answer's body ended at `at` (`cut`: it failed midway, the upstream
    /// went silent or broke the connection). Slow when `took`, the upstream's own time (not
    /// the client's, reading the body), is over `slow_call`.
    pub fn record_body_end(mut self, cut: bool, took: Duration, at: Instant, metrics: &Metrics) {
        let outcome = if cut {
            Outcome::Failure
        } else {
            Outcome::Success {
                slow: self.slow_call.is_some_and(|limit| took > limit),
            }
        };
        self.recorded = true;
        self.finish(outcome, at, Some(metrics));
    }

    /// Records a call whose body was left unread at `at` (the client went away): slow when
    /// the upstream had `took` more than `slow_call` already, no verdict otherwise.
    pub fn record_body_left(mut self, took: Duration, at: Instant, metrics: &Metrics) {
        if self.slow_call.is_some_and(|limit| took > limit) {
            self.recorded = true;
            self.finish(Outcome::AbandonedSlow, at, Some(metrics));
        }
    }

    /// Records the outcome of a call that ended at `at`.
    pub fn record(mut self, outcome: Outcome, at: Instant, metrics: &Metrics) {
        self.recorded = true;
        self.finish(outcome, at, Some(metrics));
    }

    fn finish(&self, outcome: Outcome, at: Instant, metrics: Option<&Metrics>) {
        let transition = self.breaker.lock().record_in_round(
            at,
            self.admission,
            self.round,
            outcome,
            self.client,
        );
        self.report(outcome, transition, metrics);
    }

    /// Counts a probe's result and a transition in the metrics.
    fn report(&self, outcome: Outcome, transition: Option<Transition>, metrics: Option<&Metrics>) {
        let Some(metrics) = metrics else { return };
        if self.admission == Admission::Probe && outcome != Outcome::Abandoned {
            let result = match outcome {
                Outcome::Failure | Outcome::AbandonedSlow => "failure",
                _ => "success",
            };
            metrics
                .breaker_probes
                .get_or_create(&BreakerProbeLabels {
                    upstream: self.breaker.upstream.clone().into(),
                    result,
                })
                .inc();
        }
        if let Some(transition) = transition {
            self.breaker.report(transition, metrics);
        }
    }
}

impl Drop for Permit {
    fn drop(&mut self) {
        if self.recorded {
            return;
        }
        let now = Instant::now();
        let slow = self
            .slow_call
            .is_some_and(|limit| now.saturating_duration_since(self.started) > limit);
        match self.watched.take() {
            Some(metrics) if slow => {
                tracing::debug!(upstream = %self.breaker.upstream, "a call given up on after slow_call counts as slow");
                self.finish(Outcome::AbandonedSlow, now, Some(&metrics));
            }
            _ => self.finish(Outcome::Abandoned, now, None),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[tokio::test(start_paused = true)]
    async fn auto_hands_a_pinned_breaker_back_but_leaves_one_that_opened_by_itself_open() {
        let metrics = Metrics::new();
        let breaker = Arc::new(Breaker::new(
            "app",
            BreakerSettings {
                consecutive_failures: 1,
                ..BreakerSettings::default()
            },
        ));
        let permit = breaker.admit(Instant::now(), 0, &metrics).expect("closed");
        permit.record(Outcome::Failure, Instant::now(), &metrics);
        breaker.set_runtime_force(None, &metrics);
        assert_eq!(
            breaker.status().state,
            "open",
            "auto on auto changes nothing"
        );

        breaker.set_runtime_force(Some(Force::Closed), &metrics);
        assert_eq!(breaker.status().state, "closed");
        breaker.set_runtime_force(None, &metrics);
        assert_eq!(
            breaker.status().state,
            "closed",
            "unpinned, it starts afresh"
        );
        assert!(breaker.admit(Instant::now(), 0, &metrics).is_ok());
    }

    #[tokio::test(start_paused = true)]
    async fn an_open_breaker_whose_time_ran_out_says_so_without_waiting_for_a_request() {
        let metrics = Metrics::new();
        let breaker = Arc::new(Breaker::new(
            "app",
            BreakerSettings {
                consecutive_failures: 1,
                open_for: Duration::from_secs(5),
                ..BreakerSettings::default()
            },
        ));
        let permit = breaker.admit(Instant::now(), 0, &metrics).expect("closed");
        permit.record(Outcome::Failure, Instant::now(), &metrics);
        assert_eq!(breaker.status().state, "open");
        tokio::time::advance(Duration::from_secs(6)).await;
        // No request came (its routes may be switched off): it may probe all the same.
        let status = breaker.status();
        assert_eq!(
            (status.state, status.ready_to_probe_ms),
            ("half_open", Some(1000))
        );
        assert_eq!(
            breaker.state_value(),
            2,
            "the metric says what /status says"
        );
        let probe = breaker
            .admit(Instant::now(), 0, &metrics)
            .expect("the next request probes");
        assert_eq!(breaker.status().ready_to_probe_ms, None, "probing now");
        // The probe succeeds, but one is not enough to close (3 by default): half-open and
        // idle again, waiting for the next request, and said so.
        probe.record(Outcome::Success { slow: false }, Instant::now(), &metrics);
        tokio::time::advance(Duration::from_secs(2)).await;
        let status = breaker.status();
        assert_eq!(
            (status.state, status.ready_to_probe_ms),
            ("half_open", Some(2000))
        );
    }
}
