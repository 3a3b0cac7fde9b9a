//! The circuit breaker as a pure state machine: no clocks, no locks, time passed in.
//!
//! ```text
//! Closed ──trip──► Open ──open_for passed──► HalfOpen ──the probes pass──► Closed
//!                   ▲                            │
//!                   └──── the probes fail ───────┘   (open_for doubles, up to max_open_for)
//! ```
//! Trips (any of): `consecutive_failures` failures in a row, unless the slice under way and
//! the two before it hold `min_requests` calls and their failure share is under `failure_ratio` (a
//! dependency failing some calls at random, five of them in a row now and then under load),
//! and twice that many in a row whatever the slices hold;
//! a failure ratio of at least `failure_ratio` over `window` once `min_requests` calls are in
//! it; a slow-call ratio of at least `slow_ratio` over the same window (when `slow_call` is
//! set). A half-open round fails at a failed (or slow) probe before any probe passed, or once
//! the share of its probes that failed reaches `failure_ratio`, as a window's would (at 0.5
//! with 3 probes: after a success, one failure does not reopen it, and a second success
//! closes it).
//!
//! Each trip also needs failures (or slow calls) from `failing_clients` distinct clients, or
//! from every client the dependency has had when it has had fewer: one visitor who finds a page
//! that fails (a header too large for the app's nginx, a search that times out) cannot open it
//! for everyone, while an egress route, whose only client is the app, trips on the app's calls.

use std::time::Duration;

use tokio::time::Instant;

/// Breaker settings of one dependency. A reload with equal settings keeps the breaker's state.
#[derive(Debug, Clone, PartialEq)]
pub struct BreakerSettings {
    /// Failures in a row that open the breaker; 0 turns this trip off. Default 5.
    pub consecutive_failures: u32,
    /// Failure share over `window` that opens the breaker. Default 0.5.
    pub failure_ratio: f64,
    /// Sliding window for the ratios. Default 10s.
    pub window: Duration,
    /// Calls needed in the window before a ratio can trip. Default 20.
    pub min_requests: u32,
    /// Calls slower than this count as slow. Default: off.
    pub slow_call: Option<Duration>,
    /// Slow share over `window` that opens the breaker. Default 0.8.
    pub slow_ratio: f64,
    /// First open period. Default 10s.
    pub open_for: Duration,
    /// Longest open period after repeated re-opens. Default 2m.
    pub max_open_for: Duration,
    /// Probes let through at a time when half-open; the round closes the breaker when fewer
    /// than `failure_ratio` of them failed or were slow (see `probe_failures_allowed`).
    /// Default 3.
    pub half_open_probes: u32,
    /// Statuses that count as failures. Default 502 and 504: what a PHP app's own nginx
    /// answers when php-fpm is down or hung. A 503 is left out: PHP apps answer it on purpose
    /// (maintenance mode, a blocked visitor, "try later"), and one visitor could open the
    /// breaker for every page by asking for such a page five times.
    pub failure_statuses: Vec<u16>,
    /// Distinct clients whose calls must have failed (or been slow) for a trip; fewer when
    /// the dependency has had fewer clients. 1 to [`MOST_FAILING_CLIENTS`]; 1 turns it off.
    /// Default 3.
    pub failing_clients: u32,
    /// Pinned state from the policy. Default: automatic.
    pub force: Option<Force>,
}

/// The most `failing_clients` may be: the machine keeps that many clients in a small array,
/// read on every failure.
pub const MOST_FAILING_CLIENTS: u32 = 8;

/// A client as the breaker tells clients apart: the IPv4 /24 or IPv6 /48 it is in (see
/// `limit::client_network`).
pub type ClientId = u64;

impl Default for BreakerSettings {
    fn default() -> Self {
        BreakerSettings {
            consecutive_failures: 5,
            failure_ratio: 0.5,
            window: Duration::from_secs(10),
            min_requests: 20,
            slow_call: None,
            slow_ratio: 0.8,
            open_for: Duration::from_secs(10),
            max_open_for: Duration::from_secs(120),
            half_open_probes: 3,
            failure_statuses: vec![502, 504],
            failing_clients: 3,
            force: None,
        }
    }
}

/// A pinned breaker state (policy `force`, or the admin API). Saved with the runtime switches
/// as `"open"` or `"closed"`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum Force {
    Open,
    Closed,
}

impl Force {
    /// A pin in the words the CLI and the admin API take: `open`, `closed`, or `auto` for
    /// none.
    pub fn word(force: Option<Force>) -> &'static str {
        match force {
            Some(Force::Open) => "open",
            Some(Force::Closed) => "closed",
            None => "auto",
        }
    }
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum State {
    Closed,
    Open { until: Instant },
    HalfOpen,
}

impl State {
    pub fn name(&self) -> &'static str {
        match self {
            State::Closed => "closed",
            State::Open { .. } => "open",
            State::HalfOpen => "half_open",
        }
    }
}

/// May a request go to the dependency?
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Admission {
    Allowed,
    /// Allowed as one of the half-open probes; its outcome decides the breaker.
    Probe,
    /// Refused; the breaker may let requests through again after `retry_after`.
    Rejected {
        retry_after: Duration,
    },
}

/// How a call ended, as far as the breaker cares.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Outcome {
    Success {
        slow: bool,
    },
    Failure,
    /// The caller gave up before an answer (client went away): no verdict on the dependency.
    Abandoned,
    /// The caller gave up after waiting longer than `slow_call` for the answer (a front proxy
    /// with a shorter read timeout than `response_timeout` closed the connection): a slow
    /// call, and a failed probe, but not a failure in a row, since nothing failed yet.
    AbandonedSlow,
}

/// A change of state, for logs and metrics.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Transition {
    Opened {
        reason: &'static str,
        open_for: Duration,
    },
    HalfOpened,
    Closed,
    /// Not a change: a trip whose failures came from fewer distinct clients than
    /// `failing_clients` (`clients` of `needed`) left it closed.
    HeldClosed {
        reason: &'static str,
        clients: u32,
        needed: u32,
    },
}

/// What the calls counted so far say about a closed breaker.
enum Trip {
    Open(&'static str),
    /// Enough failures for `reason`, from too few clients.
    Held {
        reason: &'static str,
        clients: u32,
        needed: u32,
    },
}

impl Trip {
    /// A trip for `reason`, whose failures came from `clients` distinct clients of `needed`.
    fn judged(reason: &'static str, clients: u32, needed: u32) -> Trip {
        if clients >= needed {
            Trip::Open(reason)
        } else {
            Trip::Held {
                reason,
                clients,
                needed,
            }
        }
    }
}

const BUCKETS: u32 = 10;

/// The clients behind a dependency's failures, for `failing_clients`.
#[derive(Debug, Clone, Default)]
struct FailingClients {
    /// Distinct clients the dependency has had, up to `failing_clients`. Never forgotten: all
    /// it says is whether the dependency has more clients than one visitor could be.
    callers: [ClientId; MOST_FAILING_CLIENTS as usize],
    callers_seen: u32,
    /// Clients whose calls failed or were slow lately, up to `failing_clients` of them.
    failed: [FailedClient; MOST_FAILING_CLIENTS as usize],
    failed_len: u32,
}

#[derive(Debug, Clone, Copy, Default)]
struct FailedClient {
    client: ClientId,
    /// The slice of its latest failure or slow call.
    slice: u64,
    /// The run of failures in a row its latest failure was part of (`Machine::run`).
    run: Option<u32>,
}

impl FailingClients {
    /// Counts a client asking for a call; once `wanted` distinct ones were seen, a compare.
    fn note_caller(&mut self, client: ClientId, wanted: u32) {
        if self.callers_seen >= wanted {
            return;
        }
        let seen = &self.callers[..self.callers_seen as usize];
        if !seen.contains(&client) {
            self.callers[self.callers_seen as usize] = client;
            self.callers_seen += 1;
        }
    }

    /// Notes a failure (`run` is its run of failures in a row) or a slow call (`None`).
    fn note_bad(&mut self, client: ClientId, slice: u64, run: Option<u32>, wanted: u32) {
        let len = self.failed_len as usize;
        let index = match self.failed[..len].iter().position(|f| f.client == client) {
            Some(index) => index,
            None if len < wanted as usize => {
                self.failed_len += 1;
                len
            }
            // Full: the client whose latest failure is oldest makes room.
            None => self.failed[..len]
                .iter()
                .enumerate()
                .min_by_key(|(_, failed)| failed.slice)
                .map_or(0, |(index, _)| index),
        };
        let entry = &mut self.failed[index];
        let run = run.or(if entry.client == client {
            entry.run
        } else {
            None
        });
        *entry = FailedClient { client, slice, run };
    }

    /// Distinct clients needed: `wanted`, or every caller when there were fewer.
    fn needed(&self, wanted: u32) -> u32 {
        wanted.min(self.callers_seen).max(1)
    }

    /// Distinct clients that failed in the run of failures in a row under way.
    fn in_run(&self, run: u32) -> u32 {
        self.failed[..self.failed_len as usize]
            .iter()
            .filter(|failed| failed.run == Some(run))
            .count() as u32
    }

    /// Distinct clients that failed or were slow in the window (slices from `first` on).
    fn since(&self, first: u64) -> u32 {
        self.failed[..self.failed_len as usize]
            .iter()
            .filter(|failed| failed.slice >= first)
            .count() as u32
    }
}

#[derive(Debug, Clone, Copy, Default)]
struct Bucket {
    /// Which `window / BUCKETS` slice of time this bucket counts.
    slice: u64,
    calls: u32,
    failures: u32,
    slow: u32,
}

#[derive(Debug)]
pub struct Machine {
    pub settings: BreakerSettings,
    pub state: State,
    /// Pinned at runtime through the admin API; wins over the policy's `force`.
    pub runtime_force: Option<Force>,
    epoch: Instant,
    buckets: [Bucket; BUCKETS as usize],
    /// The latest slice with a failure or a slow call in its bucket: once it has left the
    /// window, no ratio can be reached, and a success is recorded without summing the
    /// buckets (what a healthy upstream's every call does).
    last_bad_slice: Option<u64>,
    consecutive_failures: u32,
    /// Counts runs of failures in a row: a success ends one.
    run: u32,
    failing_clients: FailingClients,
    /// Re-opens since the breaker last closed; each doubles `open_for`.
    reopens: u32,
    probes_in_flight: u32,
    probe_successes: u32,
    /// Probes of this round that failed or were slow.
    probe_failures: u32,
    /// Counts half-open rounds: a probe's answer counts only in the round that admitted it.
    probe_round: u32,
    /// Distinct clients whose probes failed (or were slow) in this round, up to
    /// `failing_clients`: a probe's failure is a verdict only once that many failed (or as
    /// many as the dependency has clients), so one client whose page fails cannot hold the
    /// breaker open round after round.
    round_failed: Vec<ClientId>,
    /// Half-open with no probe out since this instant: it waits for a request to probe.
    pub idle_since: Option<Instant>,
}

impl Machine {
    pub fn new(settings: BreakerSettings, now: Instant) -> Machine {
        Machine {
            settings,
            state: State::Closed,
            runtime_force: None,
            epoch: now,
            buckets: [Bucket::default(); BUCKETS as usize],
            last_bad_slice: None,
            consecutive_failures: 0,
            run: 0,
            failing_clients: FailingClients::default(),
            reopens: 0,
            probes_in_flight: 0,
            probe_successes: 0,
            probe_failures: 0,
            probe_round: 0,
            round_failed: Vec::new(),
            idle_since: None,
        }
    }

    /// The half-open round a probe admitted now belongs to.
    pub fn probe_round(&self) -> u32 {
        self.probe_round
    }

    pub fn force(&self) -> Option<Force> {
        self.runtime_force.or(self.settings.force)
    }

    /// Whether [`Self::admit`] would let a request through at `now`, without taking a probe
    /// slot or changing state.
    pub fn would_admit(&self, now: Instant) -> bool {
        match self.force() {
            Some(Force::Open) => false,
            Some(Force::Closed) => true,
            None => match self.state {
                State::Closed => true,
                // Its time out, the next request half-opens it as the first probe.
                State::Open { until } => now >= until,
                State::HalfOpen => self.probes_in_flight < self.settings.half_open_probes,
            },
        }
    }

    /// The distinct clients it has had (up to `failing_clients` of them).
    pub fn callers(&self) -> Vec<ClientId> {
        self.failing_clients.callers[..self.failing_clients.callers_seen as usize].to_vec()
    }

    /// Counts `client` among the clients it has had.
    pub fn note_caller(&mut self, client: ClientId) {
        self.failing_clients
            .note_caller(client, self.settings.failing_clients);
    }

    /// Decides whether a request of `client` may go through. May move Open → HalfOpen.
    pub fn admit(&mut self, now: Instant, client: ClientId) -> (Admission, Option<Transition>) {
        self.failing_clients
            .note_caller(client, self.settings.failing_clients);
        match self.force() {
            Some(Force::Open) => {
                // Pinned: it opens again only when an operator says so, not after open_for.
                return (
                    Admission::Rejected {
                        retry_after: crate::error::OPERATORS_CALL,
                    },
                    None,
                );
            }
            Some(Force::Closed) => return (Admission::Allowed, None),
            None => {}
        }
        let mut transition = None;
        if let State::Open { until } = self.state {
            if now < until {
                return (
                    Admission::Rejected {
                        retry_after: until - now,
                    },
                    None,
                );
            }
            self.state = State::HalfOpen;
            self.probes_in_flight = 0;
            self.probe_successes = 0;
            self.probe_failures = 0;
            self.probe_round = self.probe_round.wrapping_add(1);
            self.round_failed.clear();
            transition = Some(Transition::HalfOpened);
        }
        match self.state {
            State::Closed => (Admission::Allowed, transition),
            State::HalfOpen if self.probes_in_flight < self.settings.half_open_probes => {
                self.probes_in_flight += 1;
                self.idle_since = None;
                (Admission::Probe, transition)
            }
            // Half-open with every probe slot taken: no stampede on a recovering dependency.
            _ => (
                Admission::Rejected {
                    retry_after: Duration::from_secs(1),
                },
                transition,
            ),
        }
    }

    /// Records how an admitted call ended (a probe of the current half-open round).
    #[cfg(test)]
    fn record(
        &mut self,
        now: Instant,
        admission: Admission,
        outcome: Outcome,
        client: ClientId,
    ) -> Option<Transition> {
        self.record_in_round(now, admission, self.probe_round, outcome, client)
    }

    /// Records how an admitted call ended; `round` is what `probe_round` said when it was
    /// admitted. A probe of an earlier round (still running when its round's breaker
    /// reopened) neither frees a slot of the current round nor decides it: the current round
    /// admits exactly `half_open_probes`, and closes on their answers alone.
    pub fn record_in_round(
        &mut self,
        now: Instant,
        admission: Admission,
        round: u32,
        outcome: Outcome,
        client: ClientId,
    ) -> Option<Transition> {
        let admission = match admission {
            Admission::Probe if round != self.probe_round => Admission::Allowed,
            admission => admission,
        };
        if admission == Admission::Probe {
            self.probes_in_flight = self.probes_in_flight.saturating_sub(1);
            if self.probes_in_flight == 0 && self.state == State::HalfOpen {
                self.idle_since = Some(now);
            }
        }
        if outcome == Outcome::Abandoned {
            return None;
        }
        let slice = self.count(now, outcome);
        let failed = outcome == Outcome::Failure;
        self.consecutive_failures = match outcome {
            Outcome::Failure => self.consecutive_failures + 1,
            Outcome::Success { .. } => {
                if self.consecutive_failures > 0 {
                    self.run = self.run.wrapping_add(1);
                }
                0
            }
            Outcome::Abandoned | Outcome::AbandonedSlow => self.consecutive_failures,
        };
        let wanted = self.settings.failing_clients;
        match outcome {
            Outcome::Failure => {
                self.failing_clients
                    .note_bad(client, slice, Some(self.run), wanted)
            }
            Outcome::Success { slow: true } | Outcome::AbandonedSlow => {
                self.failing_clients.note_bad(client, slice, None, wanted)
            }
            _ => {}
        }

        if self.force().is_some() {
            return None;
        }
        match (self.state, admission) {
            (State::HalfOpen, Admission::Probe) => {
                // A slow answer is a failed probe too: a breaker opened on slow calls closed
                // on slow successes, and opened again at once, every cycle, without its
                // open time ever doubling.
                let bad = failed
                    || matches!(
                        outcome,
                        Outcome::AbandonedSlow | Outcome::Success { slow: true }
                    );
                let allowed = self.probe_failures_allowed();
                if bad {
                    if !self.round_failed.contains(&client)
                        && self.round_failed.len() < MOST_FAILING_CLIENTS as usize
                    {
                        self.round_failed.push(client);
                    }
                    let needed = self.failing_clients.needed(self.settings.failing_clients);
                    if (self.round_failed.len() as u32) < needed {
                        // No verdict yet: its slot is free for the next request to probe.
                        return None;
                    }
                    self.probe_failures += 1;
                    // Before any probe passed, a failure is taken as the dependency still
                    // down (reopened at once, as a dead one needs); after one passed, only
                    // a share reaching the ratio fails the round.
                    if self.probe_successes == 0 || self.probe_failures > allowed {
                        self.reopens += 1;
                        return Some(self.open(now, "probe failed"));
                    }
                } else {
                    self.probe_successes += 1;
                }
                // Decided as soon as the rest cannot change it: at most `allowed` bad ones.
                if self.probe_successes >= self.settings.half_open_probes.saturating_sub(allowed) {
                    self.close(now);
                    return Some(Transition::Closed);
                }
                None
            }
            (State::Closed, _) => match self.trip(now)? {
                Trip::Open(reason) => Some(self.open(now, reason)),
                Trip::Held {
                    reason,
                    clients,
                    needed,
                } => Some(Transition::HeldClosed {
                    reason,
                    clients,
                    needed,
                }),
            },
            // Late answers to calls admitted before the breaker opened do not move it.
            _ => None,
        }
    }

    fn open(&mut self, now: Instant, reason: &'static str) -> Transition {
        let factor = 1u32.checked_shl(self.reopens.min(16)).unwrap_or(u32::MAX);
        let open_for = self
            .settings
            .open_for
            .saturating_mul(factor)
            .min(self.settings.max_open_for);
        self.state = State::Open {
            until: now + open_for,
        };
        self.probes_in_flight = 0;
        self.probe_successes = 0;
        self.probe_failures = 0;
        self.idle_since = None;
        Transition::Opened { reason, open_for }
    }

    fn close(&mut self, now: Instant) {
        self.state = State::Closed;
        self.idle_since = None;
        self.reopens = 0;
        self.consecutive_failures = 0;
        self.run = self.run.wrapping_add(1);
        self.failing_clients.failed_len = 0;
        self.buckets = [Bucket::default(); BUCKETS as usize];
        self.last_bad_slice = None;
        self.epoch = now;
    }

    /// Clears the state when an operator hands control back (`auto`).
    pub fn reset(&mut self, now: Instant) {
        self.close(now);
    }

    fn slice_of(&self, now: Instant) -> u64 {
        let width = (self.settings.window / BUCKETS).max(Duration::from_millis(1));
        (now.saturating_duration_since(self.epoch).as_nanos() / width.as_nanos()) as u64
    }

    /// Counts a call in its slice's bucket, and says which slice that is.
    fn count(&mut self, now: Instant, outcome: Outcome) -> u64 {
        let slice = self.slice_of(now);
        let bucket = &mut self.buckets[(slice % u64::from(BUCKETS)) as usize];
        if bucket.slice != slice {
            *bucket = Bucket {
                slice,
                ..Bucket::default()
            };
        }
        bucket.calls += 1;
        match outcome {
            Outcome::Failure => bucket.failures += 1,
            Outcome::Success { slow: true } | Outcome::AbandonedSlow => bucket.slow += 1,
            _ => return slice,
        }
        // (Calls finish out of order across threads: the latest slice stays.)
        self.last_bad_slice = Some(self.last_bad_slice.map_or(slice, |bad| bad.max(slice)));
        slice
    }

    /// Calls, failures and slow calls inside the window ending at `now`.
    fn totals(&self, now: Instant) -> (u32, u32, u32) {
        self.totals_of_last(now, BUCKETS)
    }

    /// Calls, failures and slow calls in the last `slices` slices of the window.
    fn totals_of_last(&self, now: Instant, slices: u32) -> (u32, u32, u32) {
        let current = self.slice_of(now);
        self.buckets
            .iter()
            .filter(|bucket| {
                bucket.calls > 0 && current.saturating_sub(bucket.slice) < u64::from(slices)
            })
            .fold((0, 0, 0), |(calls, failures, slow), bucket| {
                (
                    calls + bucket.calls,
                    failures + bucket.failures,
                    slow + bucket.slow,
                )
            })
    }

    /// Failed or slow probes a half-open round may have and still close the breaker: fewer
    /// than `failure_ratio` of them, the share that trips a closed breaker (a dependency that
    /// fails a third of its calls at random passed a round of three only a third of the time
    /// when all had to succeed, and each failed round doubled the open time: most of its
    /// traffic was refused though it never reached the ratio).
    fn probe_failures_allowed(&self) -> u32 {
        let probes = self.settings.half_open_probes;
        let reaching = (f64::from(probes) * self.settings.failure_ratio).ceil() as u32;
        // One must pass, whatever the ratio.
        reaching.saturating_sub(1).min(probes.saturating_sub(1))
    }

    fn trip(&self, now: Instant) -> Option<Trip> {
        let settings = &self.settings;
        let needed = self.failing_clients.needed(settings.failing_clients);
        // Twice the run in a row is no chance any more (at 30% failures, ten in a row come
        // once in some 170,000 calls): a dependency gone under load trips at once, not after
        // its failures have outweighed the last slices' successes.
        if settings.consecutive_failures > 0
            && self.consecutive_failures >= settings.consecutive_failures
            && (self.consecutive_failures >= settings.consecutive_failures.saturating_mul(2)
                || !self.recently_mostly_fine(now))
        {
            let clients = self.failing_clients.in_run(self.run);
            let trip = Trip::judged("consecutive failures", clients, needed);
            // Held by its clients, it may still be tripped by a ratio.
            if matches!(trip, Trip::Held { .. }) {
                return self.ratio_trip(now, needed).or(Some(trip));
            }
            return Some(trip);
        }
        self.ratio_trip(now, needed)
    }

    /// A trip by the failure or slow-call ratio over the window.
    fn ratio_trip(&self, now: Instant, needed: u32) -> Option<Trip> {
        let settings = &self.settings;
        // No failure and no slow call left in the window: both ratios are 0, below any
        // threshold (the policy only accepts thresholds above 0).
        let current = self.slice_of(now);
        if settings.failure_ratio > 0.0
            && settings.slow_ratio > 0.0
            && self
                .last_bad_slice
                .is_none_or(|bad| current.saturating_sub(bad) >= u64::from(BUCKETS))
        {
            return None;
        }
        let (calls, failures, slow) = self.totals(now);
        if calls == 0 || calls < settings.min_requests {
            return None;
        }
        let reason = if f64::from(failures) / f64::from(calls) >= settings.failure_ratio {
            "failure ratio"
        } else if settings.slow_call.is_some()
            && f64::from(slow) / f64::from(calls) >= settings.slow_ratio
        {
            "slow-call ratio"
        } else {
            return None;
        };
        let clients = self
            .failing_clients
            .since(current.saturating_sub(u64::from(BUCKETS) - 1));
        Some(Trip::judged(reason, clients, needed))
    }

    /// Whether the slice under way and the two before it hold `min_requests` calls, under
    /// `failure_ratio` of them failed: failures in a row there are chance (five in a row come
    /// every few hundred calls of a dependency that fails 30% of them), not a dependency
    /// gone, whose share of failures is soon past the ratio. Three slices, not two: the one
    /// under way may have just begun, and at some twenty calls a second the two held few
    /// enough calls for a chance share of failures past the ratio (seen once in a review,
    /// with 30% failing at random).
    fn recently_mostly_fine(&self, now: Instant) -> bool {
        let (calls, failures, _) = self.totals_of_last(now, 3);
        calls >= self.settings.min_requests.max(1)
            && f64::from(failures) / f64::from(calls) < self.settings.failure_ratio
    }

    /// Calls and failures in the current window, for `/status`.
    pub fn window_counts(&self, now: Instant) -> (u32, u32, u32) {
        self.totals(now)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const MS: Duration = Duration::from_millis(1);

    fn settings() -> BreakerSettings {
        BreakerSettings {
            consecutive_failures: 3,
            min_requests: 10,
            open_for: Duration::from_secs(10),
            max_open_for: Duration::from_secs(25),
            half_open_probes: 2,
            slow_call: Some(Duration::from_secs(1)),
            ..BreakerSettings::default()
        }
    }

    fn call(machine: &mut Machine, now: Instant, outcome: Outcome) -> Option<Transition> {
        let (admission, _) = machine.admit(now, 0);
        assert_ne!(
            admission,
            Admission::Rejected {
                retry_after: Duration::ZERO
            }
        );
        machine.record(now, admission, outcome, 0)
    }

    #[test]
    fn a_success_can_complete_a_failure_ratio_but_failures_gone_from_the_window_cannot() {
        const OK: Outcome = Outcome::Success { slow: false };
        let ratio_only = BreakerSettings {
            consecutive_failures: 0,
            min_requests: 4,
            failure_ratio: 0.5,
            ..settings()
        };
        let t0 = Instant::now();
        let mut machine = Machine::new(ratio_only.clone(), t0);
        for outcome in [Outcome::Failure, Outcome::Failure, OK] {
            assert_eq!(call(&mut machine, t0, outcome), None, "under min_requests");
        }
        // The fourth call succeeds and brings the window to min_requests, half of them failed.
        assert!(matches!(
            call(&mut machine, t0, OK),
            Some(Transition::Opened {
                reason: "failure ratio",
                ..
            })
        ));

        let mut machine = Machine::new(ratio_only.clone(), t0);
        assert_eq!(call(&mut machine, t0, Outcome::Failure), None);
        assert_eq!(call(&mut machine, t0, Outcome::Failure), None);
        // A window later both failures are out of it: successes alone never open it.
        let later = t0 + ratio_only.window + MS;
        for _ in 0..10 {
            assert_eq!(call(&mut machine, later, OK), None);
        }
        assert_eq!(machine.state, State::Closed);
        // A failure in the window counts again, with the successes beside it.
        for _ in 0..9 {
            assert_eq!(call(&mut machine, later, Outcome::Failure), None);
        }
        assert!(
            call(&mut machine, later, Outcome::Failure).is_some(),
            "10 of 20 failed"
        );
    }

    #[test]
    fn consecutive_failures_open_and_successes_reset_the_count() {
        let t0 = Instant::now();
        let mut machine = Machine::new(settings(), t0);
        assert_eq!(call(&mut machine, t0, Outcome::Failure), None);
        assert_eq!(call(&mut machine, t0, Outcome::Failure), None);
        assert_eq!(
            call(&mut machine, t0, Outcome::Success { slow: false }),
            None
        );
        assert_eq!(call(&mut machine, t0, Outcome::Failure), None);
        assert_eq!(call(&mut machine, t0, Outcome::Failure), None);
        assert_eq!(
            call(&mut machine, t0, Outcome::Failure),
            Some(Transition::Opened {
                reason: "consecutive failures",
                open_for: Duration::from_secs(10)
            })
        );
        assert_eq!(
            machine.admit(t0 + 4 * Duration::from_secs(1), 0).0,
            Admission::Rejected {
                retry_after: Duration::from_secs(6)
            }
        );
    }

    #[test]
    fn failure_ratio_needs_min_requests_and_forgets_old_slices() {
        let t0 = Instant::now();
        let mut machine = Machine::new(
            BreakerSettings {
                consecutive_failures: 0,
                ..settings()
            },
            t0,
        );
        // 4 failures, 5 successes: 9 calls < min_requests.
        for i in 0..9 {
            let outcome = if i % 2 == 0 {
                Outcome::Failure
            } else {
                Outcome::Success { slow: false }
            };
            assert_eq!(call(&mut machine, t0, outcome), None);
        }
        // Eleven seconds later the window is empty again: one failure trips nothing.
        let later = t0 + Duration::from_secs(11);
        assert_eq!(call(&mut machine, later, Outcome::Failure), None);
        assert_eq!(machine.window_counts(later), (1, 1, 0));
        for _ in 0..4 {
            call(&mut machine, later, Outcome::Success { slow: false });
        }
        for _ in 0..4 {
            assert_eq!(call(&mut machine, later, Outcome::Failure), None);
        }
        // 10 calls, 5 failures: ratio 0.5 trips.
        assert!(matches!(
            call(&mut machine, later, Outcome::Failure),
            Some(Transition::Opened {
                reason: "failure ratio",
                ..
            })
        ));
    }

    #[test]
    fn failures_in_a_row_among_many_successes_are_chance_not_a_trip() {
        // A dependency failing some calls at random under load: three in a row (the test
        // settings' threshold) among 20 successes of the last second do not open it.
        let t0 = Instant::now();
        let mut machine = Machine::new(settings(), t0);
        for _ in 0..20 {
            call(&mut machine, t0, Outcome::Success { slow: false });
        }
        for _ in 0..3 {
            assert_eq!(call(&mut machine, t0, Outcome::Failure), None);
        }
        // Gone for good: twice the run in a row trips it, before the failures outweigh the
        // last slices' successes (the ratio would wait for 20).
        for _ in 0..2 {
            assert_eq!(call(&mut machine, t0 + MS, Outcome::Failure), None);
        }
        assert!(matches!(
            call(&mut machine, t0 + MS, Outcome::Failure),
            Some(Transition::Opened {
                reason: "consecutive failures",
                ..
            })
        ));
    }

    #[test]
    fn a_round_of_probes_closes_below_the_failure_ratio_and_slow_probes_count_against_it() {
        let t0 = Instant::now();
        let three = BreakerSettings {
            half_open_probes: 3,
            ..settings()
        };
        let mut machine = Machine::new(three.clone(), t0);
        for _ in 0..3 {
            call(&mut machine, t0, Outcome::Failure);
        }
        let t1 = t0 + Duration::from_secs(10);
        // One failure of three (under 0.5), after a success: the round still closes.
        for outcome in [
            Outcome::Success { slow: false },
            Outcome::Failure,
            Outcome::Success { slow: false },
        ] {
            let (admission, _) = machine.admit(t1, 0);
            assert_eq!(admission, Admission::Probe);
            machine.record(t1, admission, outcome, 0);
        }
        assert_eq!(machine.state, State::Closed);
        // Reopened; two slow answers of three reach the ratio: the round fails, and the
        // open time doubles (slow successes closed a breaker opened on slow calls).
        let mut machine = Machine::new(three, t0);
        for _ in 0..3 {
            call(&mut machine, t0, Outcome::Failure);
        }
        let mut last = None;
        for outcome in [
            Outcome::Success { slow: false },
            Outcome::Success { slow: true },
            Outcome::Success { slow: true },
        ] {
            let (admission, _) = machine.admit(t1, 0);
            last = machine.record(t1, admission, outcome, 0);
        }
        assert_eq!(
            last,
            Some(Transition::Opened {
                reason: "probe failed",
                open_for: Duration::from_secs(20)
            })
        );
    }

    #[test]
    fn slow_calls_trip_by_ratio() {
        let t0 = Instant::now();
        let mut machine = Machine::new(
            BreakerSettings {
                consecutive_failures: 0,
                ..settings()
            },
            t0,
        );
        for _ in 0..2 {
            call(&mut machine, t0, Outcome::Success { slow: false });
        }
        for _ in 0..7 {
            assert_eq!(
                call(&mut machine, t0, Outcome::Success { slow: true }),
                None
            );
        }
        assert!(matches!(
            call(&mut machine, t0, Outcome::Success { slow: true }),
            Some(Transition::Opened {
                reason: "slow-call ratio",
                ..
            })
        ));
    }

    fn open_machine(t0: Instant) -> Machine {
        let mut machine = Machine::new(settings(), t0);
        for _ in 0..3 {
            call(&mut machine, t0, Outcome::Failure);
        }
        assert!(matches!(machine.state, State::Open { .. }));
        machine
    }

    #[test]
    fn half_open_admits_exactly_the_probes_and_closes_when_all_succeed() {
        let t0 = Instant::now();
        let mut machine = open_machine(t0);
        let t1 = t0 + Duration::from_secs(10);
        assert_eq!(
            machine.admit(t1, 0),
            (Admission::Probe, Some(Transition::HalfOpened))
        );
        assert_eq!(machine.admit(t1, 0).0, Admission::Probe);
        assert!(
            matches!(machine.admit(t1, 0).0, Admission::Rejected { .. }),
            "a third request waits"
        );
        assert_eq!(
            machine.record(t1, Admission::Probe, Outcome::Success { slow: false }, 0),
            None
        );
        // One slot freed: one more probe may go.
        assert_eq!(machine.admit(t1, 0).0, Admission::Probe);
        assert_eq!(
            machine.record(t1, Admission::Probe, Outcome::Success { slow: false }, 0),
            Some(Transition::Closed)
        );
        assert_eq!(machine.state, State::Closed);
        // The late third probe does not reopen anything.
        assert_eq!(
            machine.record(t1, Admission::Probe, Outcome::Failure, 0),
            None
        );
        assert_eq!(machine.state, State::Closed);
    }

    #[test]
    fn a_probe_of_an_earlier_round_neither_frees_a_slot_nor_decides_this_round() {
        let t0 = Instant::now();
        let mut machine = open_machine(t0);
        let State::Open { until } = machine.state else {
            panic!("not open")
        };
        // Round 1: probes A and B; A fails while B is still out, and the breaker reopens.
        let round_1 = |machine: &mut Machine| {
            let (admission, _) = machine.admit(until, 0);
            assert_eq!(admission, Admission::Probe);
            (admission, machine.probe_round())
        };
        let (a, a_round) = round_1(&mut machine);
        let (b, b_round) = round_1(&mut machine);
        assert!(machine
            .record_in_round(until, a, a_round, Outcome::Failure, 0)
            .is_some());
        let State::Open { until } = machine.state else {
            panic!("not open")
        };
        // Round 2: probes C and D fill it.
        assert_eq!(machine.admit(until, 0).0, Admission::Probe);
        assert_eq!(machine.admit(until, 0).0, Admission::Probe);
        // B's late success frees no slot of round 2 and does not count towards closing it.
        assert_eq!(
            machine.record_in_round(until, b, b_round, Outcome::Success { slow: false }, 0),
            None
        );
        assert!(matches!(
            machine.admit(until, 0).0,
            Admission::Rejected { .. }
        ));
        assert_eq!(
            machine.record(until, Admission::Probe, Outcome::Success { slow: false }, 0),
            None,
            "one success of round 2 is not enough"
        );
        assert_eq!(
            machine.record(until, Admission::Probe, Outcome::Success { slow: false }, 0),
            Some(Transition::Closed)
        );
    }

    #[test]
    fn failed_probes_reopen_with_doubling_capped_back_off() {
        let t0 = Instant::now();
        let mut machine = open_machine(t0);
        for expected in [20, 25, 25] {
            let State::Open { until } = machine.state else {
                panic!("not open")
            };
            let now = until;
            let (admission, _) = machine.admit(now, 0);
            assert_eq!(admission, Admission::Probe);
            assert_eq!(
                machine.record(now, admission, Outcome::Failure, 0),
                Some(Transition::Opened {
                    reason: "probe failed",
                    open_for: Duration::from_secs(expected)
                })
            );
        }
        // Recovery resets the back-off.
        let State::Open { until } = machine.state else {
            panic!("not open")
        };
        for _ in 0..2 {
            let (admission, _) = machine.admit(until, 0);
            machine.record(until + MS, admission, Outcome::Success { slow: false }, 0);
        }
        assert_eq!(machine.state, State::Closed);
        for _ in 0..3 {
            call(&mut machine, until + MS, Outcome::Failure);
        }
        assert_eq!(
            machine.state,
            State::Open {
                until: until + MS + Duration::from_secs(10)
            }
        );
    }

    #[test]
    fn abandoned_probes_free_their_slot_without_a_verdict() {
        let t0 = Instant::now();
        let mut machine = open_machine(t0);
        let t1 = t0 + Duration::from_secs(10);
        machine.admit(t1, 0);
        machine.admit(t1, 0);
        machine.record(t1, Admission::Probe, Outcome::Abandoned, 0);
        assert_eq!(machine.state, State::HalfOpen);
        assert_eq!(machine.admit(t1, 0).0, Admission::Probe);
    }

    #[test]
    fn calls_given_up_on_after_slow_call_are_slow_calls_and_failed_probes() {
        let t0 = Instant::now();
        let mut machine = open_machine(t0);
        let t1 = t0 + Duration::from_secs(10);
        assert_eq!(machine.admit(t1, 0).0, Admission::Probe);
        assert!(matches!(
            machine.record(t1, Admission::Probe, Outcome::AbandonedSlow, 0),
            Some(Transition::Opened {
                reason: "probe failed",
                ..
            })
        ));

        // Closed: counted as slow, and neither a failure in a row nor the end of a run of them.
        let mut machine = Machine::new(
            BreakerSettings {
                consecutive_failures: 2,
                min_requests: 100,
                ..settings()
            },
            t0,
        );
        assert_eq!(call(&mut machine, t0, Outcome::Failure), None);
        assert_eq!(call(&mut machine, t0, Outcome::AbandonedSlow), None);
        assert_eq!(machine.window_counts(t0), (2, 1, 1));
        assert!(matches!(
            call(&mut machine, t0, Outcome::Failure),
            Some(Transition::Opened {
                reason: "consecutive failures",
                ..
            })
        ));
    }

    #[test]
    fn forcing_pins_the_state() {
        let t0 = Instant::now();
        let mut machine = Machine::new(
            BreakerSettings {
                force: Some(Force::Open),
                ..settings()
            },
            t0,
        );
        // A pin has no end that open_for would tell: clients are asked back as for a switch.
        assert_eq!(
            machine.admit(t0, 0).0,
            Admission::Rejected {
                retry_after: crate::error::OPERATORS_CALL
            }
        );
        machine.runtime_force = Some(Force::Closed);
        for _ in 0..10 {
            assert_eq!(call(&mut machine, t0, Outcome::Failure), None);
        }
        assert_eq!(machine.admit(t0, 0).0, Admission::Allowed);
        machine.runtime_force = None;
        assert!(
            matches!(machine.admit(t0, 0).0, Admission::Rejected { .. }),
            "back to the policy's force"
        );
    }

    fn call_from(
        machine: &mut Machine,
        now: Instant,
        client: ClientId,
        outcome: Outcome,
    ) -> Option<Transition> {
        let (admission, _) = machine.admit(now, client);
        assert_eq!(admission, Admission::Allowed);
        machine.record(now, admission, outcome, client)
    }

    fn opened(transition: Option<Transition>) -> bool {
        matches!(transition, Some(Transition::Opened { .. }))
    }

    #[test]
    fn one_client_of_many_cannot_open_it_however_often_its_calls_fail() {
        const OK: Outcome = Outcome::Success { slow: false };
        let t0 = Instant::now();
        let mut machine = Machine::new(BreakerSettings::default(), t0);
        for visitor in [1, 2, 3] {
            assert_eq!(call_from(&mut machine, t0, visitor, OK), None);
        }
        // Visitor 9 finds a page that fails: twenty failures in a row, a ratio of 20/23.
        for _ in 0..20 {
            assert!(!opened(call_from(&mut machine, t0, 9, Outcome::Failure)));
        }
        assert_eq!(machine.state, State::Closed);
        assert!(matches!(
            call_from(&mut machine, t0, 9, Outcome::Failure),
            Some(Transition::HeldClosed {
                reason: "failure ratio",
                clients: 1,
                needed: 3
            })
        ));
        // A second client failing is not enough; a third is.
        assert!(!opened(call_from(&mut machine, t0, 2, Outcome::Failure)));
        assert!(matches!(
            call_from(&mut machine, t0, 3, Outcome::Failure),
            Some(Transition::Opened { .. })
        ));
    }

    #[test]
    fn a_dependency_with_one_client_opens_on_its_failures() {
        // An egress route: the app is the only client.
        let t0 = Instant::now();
        let mut machine = Machine::new(BreakerSettings::default(), t0);
        for call in 1..=5 {
            let transition = call_from(&mut machine, t0, 7, Outcome::Failure);
            assert_eq!(opened(transition), call == 5, "call {call}");
        }
        // Two clients: both must have failed.
        let mut machine = Machine::new(BreakerSettings::default(), t0);
        assert_eq!(
            call_from(&mut machine, t0, 1, Outcome::Success { slow: false }),
            None
        );
        for _ in 0..10 {
            assert!(!opened(call_from(&mut machine, t0, 2, Outcome::Failure)));
        }
        assert!(opened(call_from(&mut machine, t0, 1, Outcome::Failure)));
    }

    #[test]
    fn the_clients_must_fail_in_the_same_run_or_window() {
        const OK: Outcome = Outcome::Success { slow: false };
        let settings = BreakerSettings {
            failure_ratio: 0.9,
            ..BreakerSettings::default()
        };
        let t0 = Instant::now();
        let mut machine = Machine::new(settings.clone(), t0);
        // Clients 1 and 2 failed in a run a success ended, more than a window ago.
        call_from(&mut machine, t0, 1, Outcome::Failure);
        call_from(&mut machine, t0, 2, Outcome::Failure);
        call_from(&mut machine, t0, 4, OK);
        let later = t0 + settings.window + MS;
        for _ in 0..20 {
            assert!(!opened(call_from(&mut machine, later, 3, Outcome::Failure)));
        }
        assert_eq!(machine.state, State::Closed);
        // In the window, by ratio, clients 1 and 2 failing again (not in a row with 3's
        // failures: a success came between) open it.
        call_from(&mut machine, later, 4, OK);
        assert!(!opened(call_from(&mut machine, later, 1, Outcome::Failure)));
        assert!(matches!(
            call_from(&mut machine, later, 2, Outcome::Failure),
            Some(Transition::Opened {
                reason: "failure ratio",
                ..
            })
        ));
    }

    #[test]
    fn one_client_cannot_hold_it_open_through_its_probes() {
        const OK: Outcome = Outcome::Success { slow: false };
        let t0 = Instant::now();
        let settings = BreakerSettings::default();
        let mut machine = Machine::new(settings.clone(), t0);
        for visitor in [1, 2, 3] {
            call_from(&mut machine, t0, visitor, OK);
        }
        for visitor in [1, 2, 3, 1, 2] {
            call_from(&mut machine, t0, visitor, Outcome::Failure);
        }
        assert!(matches!(machine.state, State::Open { .. }));
        let probe = |machine: &mut Machine, at, client, outcome| {
            let (admission, _) = machine.admit(at, client);
            assert_eq!(admission, Admission::Probe);
            machine.record(at, admission, outcome, client)
        };
        // Client 9's page fails: no verdict, round after round it does not reopen it.
        let half_open = t0 + settings.open_for;
        for _ in 0..5 {
            assert_eq!(probe(&mut machine, half_open, 9, Outcome::Failure), None);
        }
        assert_eq!(machine.state, State::HalfOpen);
        // The others' probes pass: closed.
        assert_eq!(probe(&mut machine, half_open, 1, OK), None);
        assert_eq!(
            probe(&mut machine, half_open, 2, OK),
            Some(Transition::Closed)
        );

        // Down for everyone: three clients' probes fail, and the third reopens it.
        let mut machine = Machine::new(settings.clone(), t0);
        for visitor in [1, 2, 3] {
            call_from(&mut machine, t0, visitor, Outcome::Failure);
        }
        for _ in 0..2 {
            call_from(&mut machine, t0, 1, Outcome::Failure);
        }
        assert!(matches!(machine.state, State::Open { .. }));
        assert_eq!(probe(&mut machine, half_open, 1, Outcome::Failure), None);
        assert_eq!(probe(&mut machine, half_open, 2, Outcome::Failure), None);
        assert!(matches!(
            probe(&mut machine, half_open, 3, Outcome::Failure),
            Some(Transition::Opened {
                reason: "probe failed",
                ..
            })
        ));
    }

    #[test]
    fn failing_clients_1_lets_any_client_open_it() {
        let settings = BreakerSettings {
            failing_clients: 1,
            ..BreakerSettings::default()
        };
        let t0 = Instant::now();
        let mut machine = Machine::new(settings, t0);
        for visitor in [1, 2, 3] {
            call_from(&mut machine, t0, visitor, Outcome::Success { slow: false });
        }
        for call in 1..=5 {
            let transition = call_from(&mut machine, t0, 9, Outcome::Failure);
            assert_eq!(opened(transition), call == 5, "call {call}");
        }
    }
}
