//! One saga's state machine: pure, synchronous, no I/O.
//!
//! [`Saga::apply`] folds one recorded event into the state;
//! [`Saga::drive`] then moves compensation forward (choosing the next
//! sub-transaction, sending its command through a [`Route`]), and
//! [`Saga::on_timer`] handles the saga's single deadline. The engine calls
//! them under its shard lock; they never block and never await.
//!
//! The full table of transitions, including every out-of-order and
//! duplicate case, is in `docs/saga.md`; comments here name the rows.

use std::sync::Arc;
use std::time::Duration;

use bytes::Bytes;
use tokio::time::Instant;

use crate::event::{EventKind, EventRecord};
use crate::store::{SagaState, SagaSummary};

/// A sub-transaction's state.
#[derive(Debug, Clone, Copy, PartialEq, Eq, serde::Serialize)]
#[serde(rename_all = "SCREAMING_SNAKE_CASE")]
pub enum SubState {
    /// `TxStarted` seen, no outcome yet.
    Started,
    /// Completed (`TxEnded`): compensated if the saga aborts.
    Ended,
    /// Failed (`TxAborted`), or rejected because the saga had aborted: its
    /// work did not happen, nothing to compensate.
    Aborted,
    /// A compensation command is outstanding (or waiting to be resent).
    Compensating,
    /// The participant reported the compensation done.
    Compensated,
    /// Every compensation attempt failed (or it could not be attempted).
    CompensationFailed,
}

/// A compensation command, as sent to a participant.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Command {
    /// The saga.
    pub global_tx_id: String,
    /// The sub-transaction to undo.
    pub local_tx_id: String,
    /// Its parent, as reported in `TxStarted`.
    pub parent_tx_id: String,
    /// `TxStarted`'s compensation method, verbatim.
    pub compensation_method: String,
    /// `TxStarted`'s payloads, byte for byte.
    pub payloads: Bytes,
    /// Attempt number, from 1.
    pub attempt: u32,
}

/// Whether a command reached an instance's outbound queue.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum RouteResult {
    /// Queued on a live instance's stream: the link (connection) with this id.
    Sent(u64),
    /// No live instance of the service could take it now (none connected,
    /// or every one's queue is full).
    NoInstance,
}

/// Where commands go: the participant registry implements it.
pub(crate) trait Route {
    /// Queues `cmd` on `preferred` if it is live, else on another live
    /// instance of `service`. Never blocks.
    fn send(&self, service: &str, preferred: &str, cmd: Command) -> RouteResult;
}

/// Compensation defaults, from the coordinator's configuration.
#[derive(Debug, Clone)]
pub(crate) struct Policy {
    pub(crate) default_reverse_retries: u32,
    pub(crate) default_reverse_timeout: Duration,
    pub(crate) default_retry_delay: Duration,
    pub(crate) instance_wait: Duration,
    pub(crate) straggler_wait: Duration,
    pub(crate) orphan_wait: Duration,
}

/// One sub-transaction.
#[derive(Debug, Clone)]
pub(crate) struct Sub {
    pub(crate) local_tx_id: String,
    pub(crate) parent_tx_id: String,
    pub(crate) service_name: Arc<str>,
    pub(crate) instance_id: Arc<str>,
    pub(crate) compensation_method: Arc<str>,
    pub(crate) payloads: Bytes,
    /// Whether its `TxStarted` was seen (method and payloads known).
    pub(crate) has_start: bool,
    pub(crate) state: SubState,
    pub(crate) reverse_retries: i32,
    pub(crate) reverse_timeout_s: i32,
    pub(crate) retry_delay_ms: i32,
    /// Compensation attempts made so far.
    pub(crate) attempts: u32,
    /// Attempts allowed, resolved against the policy when compensation starts.
    max_attempts: u32,
    /// Delay between attempts, resolved likewise.
    retry_delay: Duration,
    /// A command of this step was already lost with its connection once
    /// (see [`Saga::on_links_gone`]).
    rerouted: bool,
}

/// What the saga's single deadline is for.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum DeadlineKind {
    /// `SagaStarted`'s timeout: the engine records `SagaTimeout` and aborts.
    SagaTimeout,
    /// A sent command's `reverseTimeout`.
    AckTimeout,
    /// `retryDelayInMilliseconds` before the next attempt.
    RetryDelay,
    /// No instance could take the command: poll again (until `instance_wait`).
    NoInstance,
    /// Compensation is done but some sub-transactions never ended.
    Stragglers,
    /// A saga created by a later event still has no `SagaStarted`.
    Orphan,
}

/// The outstanding compensation.
#[derive(Debug, Clone, Copy)]
enum Phase {
    /// To be sent on the next `drive`.
    Ready,
    /// Sent on the link with this id; waiting for the participant's answer.
    Awaiting(u64),
    /// Failed attempt; waiting out the retry delay.
    Backoff,
    /// No instance could take it since this instant.
    NoInstance(Instant),
}

#[derive(Debug, Clone, Copy)]
struct InFlight {
    sub: usize,
    phase: Phase,
}

/// Counters of what `drive`/`on_timer` did, for metrics.
#[derive(Debug, Default, Clone, Copy, PartialEq, Eq)]
pub(crate) struct DriveStats {
    /// Commands queued (first attempts).
    pub(crate) sent: u32,
    /// Commands queued again (later attempts).
    pub(crate) retried: u32,
    /// Sub-transactions whose compensation was given up.
    pub(crate) failed: u32,
    /// Commands sent again because the link that took them ended.
    pub(crate) rerouted: u32,
}

/// A saga in memory.
#[derive(Debug)]
pub(crate) struct Saga {
    pub(crate) global_tx_id: Arc<str>,
    pub(crate) service_name: Arc<str>,
    pub(crate) instance_id: Arc<str>,
    pub(crate) state: SagaState,
    /// `SagaStarted` seen (an implicit saga was created by a later event).
    pub(crate) saga_started: bool,
    pub(crate) started_ms: i64,
    pub(crate) timeout_s: i32,
    /// Sub-transactions in first-seen order (which is `TxStarted` order
    /// unless a `TxEnded` overtook its `TxStarted`).
    pub(crate) subs: Vec<Sub>,
    pub(crate) events: u32,
    pub(crate) compensated: u32,
    /// Indices of subs still to compensate; the next one is popped from the
    /// end, so reverse start order falls out of pushing in start order.
    plan: Vec<usize>,
    current: Option<InFlight>,
    /// The single pending deadline.
    pub(crate) deadline: Option<(Instant, DeadlineKind)>,
    /// When the straggler wait ends, once armed.
    straggler_until: Option<Instant>,
}

/// What applying one event answered.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct Applied {
    /// The saga is aborted (compensating, compensated or failed).
    pub(crate) aborted: bool,
}

fn is_compensation_report(kind: EventKind) -> bool {
    matches!(
        kind,
        EventKind::TxCompensated
            | EventKind::TxCompensateAckSucceed
            | EventKind::TxCompensateAckFailed
    )
}

/// Whether an event for a saga the coordinator does not know creates it
/// (out-of-order arrival) or is ignored (a report about nothing).
pub(crate) fn creates_saga(kind: EventKind) -> bool {
    matches!(
        kind,
        EventKind::SagaStarted
            | EventKind::TxStarted
            | EventKind::TxEnded
            | EventKind::TxAborted
            | EventKind::SagaEnded
            | EventKind::SagaAborted
    )
}

/// Whether the event is about a sub-transaction (needs a local id).
pub(crate) fn is_sub_event(kind: EventKind) -> bool {
    matches!(
        kind,
        EventKind::TxStarted | EventKind::TxEnded | EventKind::TxCompensate
    ) || is_compensation_report(kind)
}

fn secs(s: i32) -> Duration {
    Duration::from_secs(u64::try_from(s).unwrap_or(0))
}

impl Saga {
    /// A saga first seen through `ev` (any event that [`creates_saga`]).
    pub(crate) fn new(global_tx_id: Arc<str>, ev: &EventRecord) -> Self {
        Self {
            global_tx_id,
            service_name: ev.service_name.clone(),
            instance_id: ev.instance_id.clone(),
            state: SagaState::Running,
            saga_started: false,
            started_ms: ev.timestamp_ms,
            timeout_s: 0,
            subs: Vec::new(),
            events: 0,
            compensated: 0,
            plan: Vec::new(),
            current: None,
            deadline: None,
            straggler_until: None,
        }
    }

    /// Whether the saga is aborted (the `aborted` answer).
    pub(crate) fn is_aborted(&self) -> bool {
        matches!(
            self.state,
            SagaState::Compensating | SagaState::Compensated | SagaState::Failed
        )
    }

    fn sub_index(&self, local: &str) -> Option<usize> {
        self.subs.iter().position(|s| s.local_tx_id == local)
    }

    fn sub_from(ev: &EventRecord, state: SubState) -> Sub {
        let start = ev.kind == Some(EventKind::TxStarted);
        Sub {
            local_tx_id: ev.local_tx_id.clone(),
            parent_tx_id: ev.parent_tx_id.clone(),
            service_name: ev.service_name.clone(),
            instance_id: ev.instance_id.clone(),
            compensation_method: if start {
                ev.compensation_method.clone()
            } else {
                Arc::default()
            },
            payloads: if start {
                ev.payloads.clone()
            } else {
                Bytes::new()
            },
            has_start: start,
            state,
            reverse_retries: ev.reverse_retries,
            reverse_timeout_s: ev.reverse_timeout_s,
            retry_delay_ms: ev.retry_delay_ms,
            attempts: 0,
            max_attempts: 1,
            retry_delay: Duration::ZERO,
            rerouted: false,
        }
    }

    /// Folds one event in. `now` arms the saga timeout on `SagaStarted`.
    /// Call [`drive`](Self::drive) afterwards to act on it.
    ///
    /// `stats` counts what the event itself gives up (a failed attempt
    /// that exhausts the sub-transaction's retries).
    pub(crate) fn apply(
        &mut self,
        ev: &EventRecord,
        now: Instant,
        stats: &mut DriveStats,
    ) -> Applied {
        self.events = self.events.saturating_add(1);
        let Some(kind) = ev.kind else {
            return self.answer();
        };
        if self.state.is_terminal() {
            // Row "any event after a terminal state": no change.
            return self.answer();
        }
        match kind {
            EventKind::SagaStarted => {
                if !self.saga_started {
                    self.saga_started = true;
                    self.service_name = ev.service_name.clone();
                    self.instance_id = ev.instance_id.clone();
                    self.started_ms = ev.timestamp_ms;
                    self.timeout_s = ev.timeout_s;
                    if self.state == SagaState::Running && ev.timeout_s > 0 {
                        self.deadline = Some((now + secs(ev.timeout_s), DeadlineKind::SagaTimeout));
                    } else if matches!(self.deadline, Some((_, DeadlineKind::Orphan))) {
                        // Its start arrived after all: no longer an orphan.
                        self.deadline = None;
                    }
                }
            }
            EventKind::TxStarted => match self.sub_index(&ev.local_tx_id) {
                None => {
                    // Row "TxStarted for an aborted saga": recorded as aborted,
                    // answered aborted=true so Omega skips the method.
                    let state = if self.state == SagaState::Running {
                        SubState::Started
                    } else {
                        SubState::Aborted
                    };
                    self.subs.push(Self::sub_from(ev, state));
                }
                Some(i) => {
                    let sub = &mut self.subs[i];
                    if !sub.has_start {
                        // Row "TxEnded before TxStarted": keep the outcome,
                        // learn method, payloads and policy now.
                        sub.has_start = true;
                        sub.compensation_method.clone_from(&ev.compensation_method);
                        sub.payloads = ev.payloads.clone();
                        sub.parent_tx_id.clone_from(&ev.parent_tx_id);
                        sub.service_name = ev.service_name.clone();
                        sub.instance_id = ev.instance_id.clone();
                        sub.reverse_retries = ev.reverse_retries;
                        sub.reverse_timeout_s = ev.reverse_timeout_s;
                        sub.retry_delay_ms = ev.retry_delay_ms;
                    }
                    // Row "duplicate TxStarted": the first one's data is kept.
                }
            },
            EventKind::TxEnded => match self.sub_index(&ev.local_tx_id) {
                None => {
                    self.subs.push(Self::sub_from(ev, SubState::Ended));
                    if self.state == SagaState::Compensating {
                        self.plan.push(self.subs.len() - 1);
                    }
                }
                Some(i) => {
                    let st = self.subs[i].state;
                    if matches!(st, SubState::Started | SubState::Aborted) {
                        self.subs[i].state = SubState::Ended;
                        if self.state == SagaState::Compensating {
                            // Row "TxEnded while compensating": compensated next.
                            self.plan.push(i);
                        }
                    }
                }
            },
            EventKind::TxAborted => {
                if ev.local_tx_id != ev.global_tx_id && !ev.local_tx_id.is_empty() {
                    match self.sub_index(&ev.local_tx_id) {
                        None => self.subs.push(Self::sub_from(ev, SubState::Aborted)),
                        Some(i) => {
                            if self.subs[i].state == SubState::Started {
                                self.subs[i].state = SubState::Aborted;
                            }
                        }
                    }
                }
                self.abort();
            }
            EventKind::SagaAborted | EventKind::SagaTimeout => self.abort(),
            EventKind::SagaEnded => {
                if self.state == SagaState::Running {
                    self.state = SagaState::Committed;
                    self.deadline = None;
                }
                // Row "SagaEnded after abort": no change, answered aborted=true.
            }
            EventKind::TxCompensated | EventKind::TxCompensateAckSucceed => {
                if let Some(i) = self.sub_index(&ev.local_tx_id) {
                    if matches!(
                        self.subs[i].state,
                        SubState::Ended | SubState::Compensating | SubState::CompensationFailed
                    ) && self.state == SagaState::Compensating
                    {
                        self.subs[i].state = SubState::Compensated;
                        self.compensated += 1;
                        if self.current.is_some_and(|c| c.sub == i) {
                            self.current = None;
                            self.deadline = None;
                        }
                    }
                }
            }
            EventKind::TxCompensateAckFailed => {
                if let Some(i) = self.sub_index(&ev.local_tx_id) {
                    if let Some(c) = self.current {
                        // A failure of an earlier attempt, answered late
                        // (after its reverse timeout sent the next one), is
                        // not the awaited attempt's answer.
                        let stale = ev.attempt != 0 && ev.attempt != self.subs[i].attempts;
                        if c.sub == i && matches!(c.phase, Phase::Awaiting(_)) && !stale {
                            self.fail_attempt(now, stats);
                        }
                    }
                }
            }
            // The coordinator's own records: informative only.
            EventKind::TxCompensate | EventKind::CompensateAckTimeout => {}
        }
        self.answer()
    }

    fn answer(&self) -> Applied {
        Applied {
            aborted: self.is_aborted(),
        }
    }

    /// Running -> Compensating: every ended sub-transaction goes on the plan
    /// in start order (so it is compensated in reverse).
    fn abort(&mut self) {
        if self.state != SagaState::Running {
            return; // Row "duplicate abort": no change.
        }
        self.state = SagaState::Compensating;
        self.deadline = None;
        self.plan = (0..self.subs.len())
            .filter(|&i| self.subs[i].state == SubState::Ended)
            .collect();
    }

    /// An attempt failed (negative answer, no answer in time, no instance
    /// for too long): back off and retry, or give up and fail the saga.
    fn fail_attempt(&mut self, now: Instant, stats: &mut DriveStats) {
        let Some(c) = self.current else { return };
        let sub = &self.subs[c.sub];
        if sub.attempts >= sub.max_attempts {
            // Row "retries exhausted": the saga fails (needs an operator);
            // the sub-transactions before it stay uncompensated on purpose,
            // since undoing them may depend on this one being undone.
            self.subs[c.sub].state = SubState::CompensationFailed;
            self.state = SagaState::Failed;
            self.current = None;
            self.deadline = None;
            stats.failed += 1;
            return;
        }
        let delay = sub.retry_delay;
        self.current = Some(InFlight {
            sub: c.sub,
            phase: Phase::Backoff,
        });
        self.deadline = Some((now + delay, DeadlineKind::RetryDelay));
    }

    /// Moves compensation forward as far as it can go now.
    pub(crate) fn drive(
        &mut self,
        now: Instant,
        route: &dyn Route,
        policy: &Policy,
        stats: &mut DriveStats,
    ) {
        if self.state == SagaState::Running && !self.saga_started && self.deadline.is_none() {
            // Created by a later event: it waits for its start, not forever.
            self.deadline = Some((now + policy.orphan_wait, DeadlineKind::Orphan));
        }
        // Bounded: each turn either returns or consumes one plan entry.
        loop {
            if self.state != SagaState::Compensating {
                return;
            }
            let Some(c) = self.current else {
                let Some(i) = self.plan.pop() else {
                    self.finish_compensation(now, policy);
                    return;
                };
                if self.subs[i].state != SubState::Ended {
                    continue; // compensated already (early report) or not ended
                }
                if !self.subs[i].has_start {
                    // Row "TxEnded whose TxStarted never came": no method or
                    // payloads to send, so it cannot be compensated.
                    self.subs[i].state = SubState::CompensationFailed;
                    self.state = SagaState::Failed;
                    self.deadline = None;
                    stats.failed += 1;
                    return;
                }
                let sub = &mut self.subs[i];
                let retries = u32::try_from(sub.reverse_retries)
                    .ok()
                    .filter(|r| *r > 0)
                    .unwrap_or(policy.default_reverse_retries);
                sub.max_attempts = retries.saturating_add(1);
                sub.retry_delay = u64::try_from(sub.retry_delay_ms)
                    .ok()
                    .filter(|d| *d > 0)
                    .map_or(policy.default_retry_delay, Duration::from_millis);
                sub.state = SubState::Compensating;
                self.current = Some(InFlight {
                    sub: i,
                    phase: Phase::Ready,
                });
                continue;
            };
            match c.phase {
                Phase::Ready | Phase::NoInstance(_) => {
                    let since = match c.phase {
                        Phase::NoInstance(t) => Some(t),
                        _ => None,
                    };
                    let sub = &self.subs[c.sub];
                    let cmd = Command {
                        global_tx_id: self.global_tx_id.to_string(),
                        local_tx_id: sub.local_tx_id.clone(),
                        parent_tx_id: sub.parent_tx_id.clone(),
                        compensation_method: sub.compensation_method.to_string(),
                        payloads: sub.payloads.clone(),
                        attempt: sub.attempts + 1,
                    };
                    match route.send(&sub.service_name, &sub.instance_id, cmd) {
                        RouteResult::Sent(link) => {
                            let sub = &mut self.subs[c.sub];
                            sub.attempts += 1;
                            if sub.attempts == 1 {
                                stats.sent += 1;
                            } else {
                                stats.retried += 1;
                            }
                            let t = if sub.reverse_timeout_s > 0 {
                                secs(sub.reverse_timeout_s)
                            } else {
                                policy.default_reverse_timeout
                            };
                            self.current = Some(InFlight {
                                sub: c.sub,
                                phase: Phase::Awaiting(link),
                            });
                            self.deadline = Some((now + t, DeadlineKind::AckTimeout));
                        }
                        RouteResult::NoInstance => {
                            let since = since.unwrap_or(now);
                            if now >= since + policy.instance_wait {
                                // Waited long enough: this attempt failed.
                                self.subs[c.sub].attempts += 1;
                                self.fail_attempt(now, stats);
                                continue;
                            }
                            self.current = Some(InFlight {
                                sub: c.sub,
                                phase: Phase::NoInstance(since),
                            });
                            let poll = policy.default_retry_delay.max(Duration::from_millis(10));
                            let next = (now + poll).min(since + policy.instance_wait);
                            self.deadline = Some((next, DeadlineKind::NoInstance));
                        }
                    }
                    return;
                }
                Phase::Awaiting(_) | Phase::Backoff => return,
            }
        }
    }

    fn finish_compensation(&mut self, now: Instant, policy: &Policy) {
        let stragglers = self.subs.iter().any(|s| s.state == SubState::Started);
        if stragglers {
            // Row "compensation done, a sub-transaction still running": wait
            // (bounded) for its TxEnded (then compensate it) or TxAborted.
            let until = *self
                .straggler_until
                .get_or_insert(now + policy.straggler_wait);
            if now < until {
                self.deadline = Some((until, DeadlineKind::Stragglers));
                return;
            }
        }
        self.state = SagaState::Compensated;
        self.deadline = None;
    }

    /// The deadline passed. `SagaTimeout` is not handled here (the engine
    /// records a `SagaTimeout` event and applies it).
    pub(crate) fn on_timer(
        &mut self,
        now: Instant,
        route: &dyn Route,
        policy: &Policy,
        stats: &mut DriveStats,
    ) {
        let Some((at, kind)) = self.deadline else {
            return;
        };
        if now < at {
            return;
        }
        self.deadline = None;
        match kind {
            DeadlineKind::SagaTimeout => {}
            DeadlineKind::AckTimeout => {
                if self
                    .current
                    .is_some_and(|c| matches!(c.phase, Phase::Awaiting(_)))
                {
                    self.fail_attempt(now, stats);
                }
            }
            DeadlineKind::RetryDelay => {
                if let Some(c) = self.current.as_mut() {
                    if matches!(c.phase, Phase::Backoff) {
                        c.phase = Phase::Ready;
                    }
                }
            }
            DeadlineKind::Orphan => {
                if self.state == SagaState::Running && !self.saga_started {
                    // Row "orphan wait expires": nothing says whether its
                    // steps should stand or be undone (a late event of a
                    // committed saga looks the same as one of an aborted
                    // saga), so it is left to an operator.
                    tracing::warn!(
                        global_tx_id = %self.global_tx_id,
                        sub_transactions = self.subs.len(),
                        "saga without SagaStarted after the orphan wait: FAILED, needs an operator"
                    );
                    self.state = SagaState::Failed;
                }
            }
            DeadlineKind::NoInstance | DeadlineKind::Stragglers => {}
        }
        self.drive(now, route, policy, stats);
    }

    /// Instances of the services for which `arrived` holds connected: a
    /// command waiting for one of them is tried again now.
    pub(crate) fn on_instance(
        &mut self,
        arrived: &dyn Fn(&str) -> bool,
        now: Instant,
        route: &dyn Route,
        policy: &Policy,
        stats: &mut DriveStats,
    ) {
        if let Some(c) = self.current {
            if matches!(c.phase, Phase::NoInstance(_)) && arrived(&self.subs[c.sub].service_name) {
                self.drive(now, route, policy, stats);
            }
        }
    }

    /// Links (participant connections) ended: a command one of them took and
    /// did not answer is sent again at once, to another instance or waiting
    /// for one (a handler must be idempotent anyway, since an answer can be
    /// lost too). The first such loss of a step is free: the step gets one
    /// more attempt, and the resend carries a new attempt number, so a late
    /// answer to the lost one is stale. A later loss counts as a failed
    /// attempt (retry delay, then the next, within the budget), so a
    /// compensation that brings its participant down every time still ends
    /// the saga `FAILED`. Before, a lost command waited out the reverse
    /// timeout (30 s by default) and cost an attempt.
    pub(crate) fn on_links_gone(
        &mut self,
        gone: &dyn Fn(u64) -> bool,
        now: Instant,
        route: &dyn Route,
        policy: &Policy,
        stats: &mut DriveStats,
    ) -> bool {
        let Some(c) = self.current else { return false };
        let Phase::Awaiting(link) = c.phase else {
            return false;
        };
        if !gone(link) {
            return false;
        }
        let sub = &mut self.subs[c.sub];
        if sub.rerouted {
            self.fail_attempt(now, stats);
            return true;
        }
        sub.rerouted = true;
        sub.max_attempts = sub.max_attempts.saturating_add(1);
        self.current = Some(InFlight {
            sub: c.sub,
            phase: Phase::Ready,
        });
        self.deadline = None;
        stats.rerouted += 1;
        self.drive(now, route, policy, stats);
        true
    }

    /// Whether a command is waiting for an instance of some service.
    pub(crate) fn waiting_for_instance(&self) -> bool {
        self.current
            .is_some_and(|c| matches!(c.phase, Phase::NoInstance(_)))
    }

    /// After recovery: whatever was in flight is sent again from attempt 1.
    pub(crate) fn reset_after_recovery(&mut self) {
        if let Some(c) = self.current.take() {
            self.plan.push(c.sub);
        }
        for s in &mut self.subs {
            s.attempts = 0;
            if s.state == SubState::Compensating {
                s.state = SubState::Ended;
            }
        }
    }

    /// The summary kept for queries and by the store once finished.
    pub(crate) fn summary(&self, finished_ms: i64) -> SagaSummary {
        SagaSummary {
            global_tx_id: String::from(&*self.global_tx_id),
            service_name: String::from(&*self.service_name),
            state: self.state,
            started_ms: self.started_ms,
            finished_ms: if self.state.is_terminal() {
                finished_ms
            } else {
                0
            },
            sub_transactions: u32::try_from(self.subs.len()).unwrap_or(u32::MAX),
            compensated: self.compensated,
            events: self.events,
        }
    }
}

/// The state machine alone, on a recording route and a hand-moved clock
/// (the engine tests cover it through the engine, its store and its timer).
#[cfg(test)]
mod tests {
    use super::*;
    use std::cell::{Cell, RefCell};

    /// Records every command; takes them only while `live`.
    #[derive(Default)]
    struct Recorder {
        live: Cell<bool>,
        sent: RefCell<Vec<(String, String, Command)>>,
    }

    impl Route for Recorder {
        fn send(&self, service: &str, preferred: &str, cmd: Command) -> RouteResult {
            if !self.live.get() {
                return RouteResult::NoInstance;
            }
            self.sent
                .borrow_mut()
                .push((service.to_owned(), preferred.to_owned(), cmd));
            RouteResult::Sent(1)
        }
    }

    impl Recorder {
        fn live() -> Self {
            let r = Self::default();
            r.live.set(true);
            r
        }

        /// The local ids and attempts of the commands sent so far, emptied.
        fn take(&self) -> Vec<(String, u32)> {
            self.sent
                .borrow_mut()
                .drain(..)
                .map(|(_, _, c)| (c.local_tx_id, c.attempt))
                .collect()
        }
    }

    fn policy() -> Policy {
        Policy {
            default_reverse_retries: 3,
            default_reverse_timeout: Duration::from_secs(5),
            default_retry_delay: Duration::from_millis(100),
            instance_wait: Duration::from_secs(60),
            straggler_wait: Duration::from_secs(10),
            orphan_wait: Duration::from_secs(60),
        }
    }

    fn ev(kind: EventKind, lid: &str, service: &str) -> EventRecord {
        EventRecord {
            global_tx_id: "g".into(),
            local_tx_id: lid.into(),
            kind: Some(kind),
            service_name: service.into(),
            instance_id: format!("{service}-1").into(),
            ..EventRecord::default()
        }
    }

    fn started(lid: &str, service: &str) -> EventRecord {
        EventRecord {
            compensation_method: format!("undo-{lid}").into(),
            payloads: Bytes::copy_from_slice(lid.as_bytes()),
            parent_tx_id: "g".into(),
            ..ev(EventKind::TxStarted, lid, service)
        }
    }

    /// A started saga with `steps` ended sub-transactions of service `svc`.
    fn saga_with(steps: &[&str], now: Instant) -> Saga {
        let first = ev(EventKind::SagaStarted, "g", "booking");
        let mut s = Saga::new("g".into(), &first);
        let mut stats = DriveStats::default();
        s.apply(&first, now, &mut stats);
        for lid in steps {
            s.apply(&started(lid, "svc"), now, &mut stats);
            s.apply(&ev(EventKind::TxEnded, lid, "svc"), now, &mut stats);
        }
        s
    }

    /// Adds an ended step `lid` of `svc` compensated with `retries` and a
    /// retry delay of 10 ms (`reverse_timeout_s` 0: the policy's).
    fn ended_step(s: &mut Saga, lid: &str, retries: i32, reverse_timeout_s: i32, now: Instant) {
        let e = EventRecord {
            reverse_retries: retries,
            reverse_timeout_s,
            retry_delay_ms: 10,
            ..started(lid, "svc")
        };
        let mut stats = DriveStats::default();
        s.apply(&e, now, &mut stats);
        s.apply(&ev(EventKind::TxEnded, lid, "svc"), now, &mut stats);
    }

    fn apply_drive(s: &mut Saga, e: &EventRecord, now: Instant, r: &Recorder) -> DriveStats {
        let mut stats = DriveStats::default();
        s.apply(e, now, &mut stats);
        s.drive(now, r, &policy(), &mut stats);
        stats
    }

    #[test]
    fn an_abort_compensates_ended_steps_one_at_a_time_in_reverse_order() {
        let now = Instant::now();
        let r = Recorder::live();
        let mut s = saga_with(&["a", "b", "c"], now);
        assert_eq!(s.state, SagaState::Running);
        let stats = apply_drive(&mut s, &ev(EventKind::TxAborted, "g", "booking"), now, &r);
        assert_eq!(s.state, SagaState::Compensating);
        assert_eq!(stats.sent, 1);
        {
            let sent = r.sent.borrow();
            let (service, preferred, cmd) = &sent[0];
            assert_eq!((service.as_str(), preferred.as_str()), ("svc", "svc-1"));
            assert_eq!(cmd.compensation_method, "undo-c");
            assert_eq!(&cmd.payloads[..], b"c");
            assert_eq!(cmd.parent_tx_id, "g");
        }
        assert_eq!(r.take(), vec![("c".to_owned(), 1)]);
        apply_drive(&mut s, &ev(EventKind::TxCompensated, "c", "svc"), now, &r);
        assert_eq!(r.take(), vec![("b".to_owned(), 1)]);
        apply_drive(&mut s, &ev(EventKind::TxCompensated, "b", "svc"), now, &r);
        assert_eq!(r.take(), vec![("a".to_owned(), 1)]);
        assert_eq!(s.state, SagaState::Compensating);
        apply_drive(&mut s, &ev(EventKind::TxCompensated, "a", "svc"), now, &r);
        assert!(r.take().is_empty());
        assert_eq!(s.state, SagaState::Compensated);
        assert_eq!(s.compensated, 3);
        // A duplicate report after the end changes nothing.
        apply_drive(&mut s, &ev(EventKind::TxCompensated, "a", "svc"), now, &r);
        assert_eq!(s.state, SagaState::Compensated);
        assert!(r.take().is_empty());
    }

    #[test]
    fn an_unanswered_command_is_resent_after_its_reverse_timeout_then_given_up() {
        let now = Instant::now();
        let r = Recorder::live();
        let mut s = saga_with(&["a"], now);
        // Two attempts in all, 2 s each, 10 ms apart.
        ended_step(&mut s, "b", 1, 2, now);
        apply_drive(&mut s, &ev(EventKind::TxAborted, "g", "booking"), now, &r);
        assert_eq!(r.take(), vec![("b".to_owned(), 1)]);
        let (at, kind) = s.deadline.expect("the reverse timeout is armed");
        assert_eq!(kind, DeadlineKind::AckTimeout);
        assert_eq!(at, now + Duration::from_secs(2));
        // Before the deadline nothing moves.
        let mut stats = DriveStats::default();
        s.on_timer(at - Duration::from_millis(1), &r, &policy(), &mut stats);
        assert!(r.take().is_empty());
        // At it, the attempt fails; after the retry delay the second goes.
        s.on_timer(at, &r, &policy(), &mut stats);
        let (retry_at, kind) = s.deadline.expect("the retry delay is armed");
        assert_eq!(kind, DeadlineKind::RetryDelay);
        s.on_timer(retry_at, &r, &policy(), &mut stats);
        assert_eq!(r.take(), vec![("b".to_owned(), 2)]);
        assert_eq!(stats.retried, 1);
        // The second fails too: b is given up, and the saga ends FAILED
        // without compensating a (the issue: no compensation past a failed one).
        let stats = apply_drive(
            &mut s,
            &ev(EventKind::TxCompensateAckFailed, "b", "svc"),
            retry_at,
            &r,
        );
        assert_eq!(stats.failed, 1);
        assert_eq!(s.state, SagaState::Failed);
        assert!(r.take().is_empty(), "nothing is sent once one failed");
    }

    #[test]
    fn a_command_with_no_instance_waits_until_one_of_its_service_arrives() {
        let now = Instant::now();
        let r = Recorder::default(); // nobody connected
        let mut s = saga_with(&["a"], now);
        apply_drive(&mut s, &ev(EventKind::TxAborted, "g", "booking"), now, &r);
        assert!(s.waiting_for_instance());
        assert_eq!(s.deadline.map(|d| d.1), Some(DeadlineKind::NoInstance));
        r.live.set(true);
        let mut stats = DriveStats::default();
        // Another service's instance: still waiting.
        s.on_instance(&|svc| svc == "other", now, &r, &policy(), &mut stats);
        assert!(s.waiting_for_instance());
        assert!(r.take().is_empty());
        s.on_instance(&|svc| svc == "svc", now, &r, &policy(), &mut stats);
        assert!(!s.waiting_for_instance());
        assert_eq!(r.take(), vec![("a".to_owned(), 1)]);
        assert_eq!(stats.sent, 1);
    }

    #[test]
    fn a_command_still_without_an_instance_after_the_wait_counts_as_a_failed_attempt() {
        let now = Instant::now();
        let r = Recorder::default();
        let mut s = saga_with(&["a"], now);
        ended_step(&mut s, "b", 1, 0, now); // two attempts
        let mut stats = DriveStats::default();
        apply_drive(&mut s, &ev(EventKind::TxAborted, "g", "booking"), now, &r);
        assert!(s.waiting_for_instance());
        // Each attempt is polled until `instance_wait` has passed, then
        // counts as failed; after the second, b is given up.
        let mut t = now;
        for _ in 0..100_000 {
            let Some((at, _)) = s.deadline else { break };
            if s.state.is_terminal() {
                break;
            }
            t = at;
            s.on_timer(t, &r, &policy(), &mut stats);
        }
        let wait = policy().instance_wait;
        assert!(
            t >= now + wait * 2,
            "gave up after two waits: {:?}",
            t - now
        );
        assert!(t < now + wait * 2 + Duration::from_secs(1), "{:?}", t - now);
        assert_eq!(stats.failed, 1);
        assert_eq!(s.state, SagaState::Failed);
        assert!(r.take().is_empty());
    }
}
