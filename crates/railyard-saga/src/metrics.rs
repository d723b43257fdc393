//! Prometheus metrics of the coordinator (prometheus-client).
//!
//! | name | type | labels |
//! |---|---|---|
//! | `railyard_saga_events_total` | counter | `kind` (wire name), `protocol` (`omega`, `native`, `coordinator`) |
//! | `railyard_saga_acks_total` | counter | `protocol` |
//! | `railyard_saga_rejected_total` | counter | `reason` (`invalid`, `store`) |
//! | `railyard_saga_append_seconds` | histogram (50 us .. 10 s) | |
//! | `railyard_saga_append_events` | histogram | (events per `append` call) |
//! | `railyard_saga_sagas` | gauge | `state` (`RUNNING`, `COMPENSATING`: live sagas in memory) |
//! | `railyard_saga_finished_total` | counter | `state` (`COMMITTED`, `COMPENSATED`, `FAILED`) |
//! | `railyard_saga_compensations_sent_total` | counter | (first attempts) |
//! | `railyard_saga_compensations_retried_total` | counter | (later attempts) |
//! | `railyard_saga_compensations_failed_total` | counter | (sub-transactions given up) |
//! | `railyard_saga_compensations_rerouted_total` | counter | (commands sent again, attempt not counted, because the connection that took them ended unanswered) |
//! | `railyard_saga_instances` | gauge | (participant connections registered) |
//! | `railyard_saga_waiting_for_instance` | gauge | (live sagas with a compensation waiting for a live instance of its service) |
//!
//! Label values are fixed sets, so cardinality is bounded. The five state
//! series exist from the start, at zero.

use std::sync::{Arc, Mutex};

use prometheus_client::encoding::EncodeLabelSet;
use prometheus_client::metrics::counter::Counter;
use prometheus_client::metrics::family::Family;
use prometheus_client::metrics::gauge::Gauge;
use prometheus_client::metrics::histogram::Histogram;
use prometheus_client::registry::Registry;

use crate::store::SagaState;

/// A metric registry shared by a node's subsystems (the same type as
/// `railyard_http::MetricsRegistry`). Locked only to register and encode.
pub type MetricsRegistry = Arc<Mutex<Registry>>;

/// Latency buckets in seconds, 50 us .. 10 s.
const LATENCY_BUCKETS: [f64; 17] = [
    0.000_05, 0.000_1, 0.000_25, 0.000_5, 0.001, 0.002_5, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5,
    1.0, 2.5, 5.0, 10.0,
];

const BATCH_BUCKETS: [f64; 10] = [
    1.0, 2.0, 4.0, 8.0, 16.0, 64.0, 256.0, 1024.0, 4096.0, 16384.0,
];

#[derive(Debug, Clone, Hash, PartialEq, Eq, EncodeLabelSet)]
pub(crate) struct EventLabels {
    pub(crate) kind: &'static str,
    pub(crate) protocol: &'static str,
}

#[derive(Debug, Clone, Hash, PartialEq, Eq, EncodeLabelSet)]
pub(crate) struct ProtocolLabels {
    pub(crate) protocol: &'static str,
}

#[derive(Debug, Clone, Hash, PartialEq, Eq, EncodeLabelSet)]
pub(crate) struct ReasonLabels {
    pub(crate) reason: &'static str,
}

#[derive(Debug, Clone, Hash, PartialEq, Eq, EncodeLabelSet)]
pub(crate) struct StateLabels {
    pub(crate) state: &'static str,
}

/// The coordinator's metrics: cheap handles (atomics behind `Arc`s).
#[derive(Debug, Clone)]
pub(crate) struct SagaMetrics {
    pub(crate) events: Family<EventLabels, Counter>,
    pub(crate) acks: Family<ProtocolLabels, Counter>,
    pub(crate) rejected: Family<ReasonLabels, Counter>,
    pub(crate) append_seconds: Histogram,
    pub(crate) append_events: Histogram,
    pub(crate) sagas: Family<StateLabels, Gauge>,
    pub(crate) finished: Family<StateLabels, Counter>,
    pub(crate) compensations_sent: Counter,
    pub(crate) compensations_retried: Counter,
    pub(crate) compensations_failed: Counter,
    pub(crate) compensations_rerouted: Counter,
    pub(crate) instances: Gauge,
    pub(crate) waiting_for_instance: Gauge,
    /// Each state's series of `sagas` (live states) or `finished`
    /// (terminal ones), taken once: a transition (three a saga) then costs
    /// no label hashing and no lock of the family.
    running: Gauge,
    compensating: Gauge,
    committed: Counter,
    compensated: Counter,
    failed: Counter,
}

/// One state's series.
enum Series<'a> {
    Live(&'a Gauge),
    Done(&'a Counter),
}

impl SagaMetrics {
    pub(crate) fn new() -> Self {
        let sagas = Family::<StateLabels, Gauge>::default();
        let finished = Family::<StateLabels, Counter>::default();
        let live = |s: SagaState| {
            sagas
                .get_or_create(&StateLabels { state: s.as_str() })
                .clone()
        };
        let done = |s: SagaState| {
            finished
                .get_or_create(&StateLabels { state: s.as_str() })
                .clone()
        };
        let (running, compensating) = (live(SagaState::Running), live(SagaState::Compensating));
        let (committed, compensated, failed) = (
            done(SagaState::Committed),
            done(SagaState::Compensated),
            done(SagaState::Failed),
        );
        Self {
            events: Family::default(),
            acks: Family::default(),
            rejected: Family::default(),
            append_seconds: Histogram::new(LATENCY_BUCKETS),
            append_events: Histogram::new(BATCH_BUCKETS),
            sagas,
            finished,
            running,
            compensating,
            committed,
            compensated,
            failed,
            compensations_sent: Counter::default(),
            compensations_retried: Counter::default(),
            compensations_failed: Counter::default(),
            compensations_rerouted: Counter::default(),
            instances: Gauge::default(),
            waiting_for_instance: Gauge::default(),
        }
    }

    /// Registers these handles in `registry` under `railyard_saga_`.
    pub(crate) fn register(&self, registry: &MetricsRegistry) {
        // A poisoned lock only means another thread panicked while
        // registering; the registry is still usable.
        let mut reg = registry.lock().unwrap_or_else(|p| p.into_inner());
        let r = reg.sub_registry_with_prefix("railyard_saga");
        r.register(
            "events",
            "Saga events recorded, by kind and protocol",
            self.events.clone(),
        );
        r.register(
            "acks",
            "Acknowledgements sent after a durable append",
            self.acks.clone(),
        );
        r.register(
            "rejected",
            "Events answered with an error instead of an acknowledgement",
            self.rejected.clone(),
        );
        r.register(
            "append_seconds",
            "Time for the store to make one append durable",
            self.append_seconds.clone(),
        );
        r.register(
            "append_events",
            "Events per append call",
            self.append_events.clone(),
        );
        r.register("sagas", "Live sagas by state", self.sagas.clone());
        r.register(
            "finished",
            "Sagas that reached a terminal state",
            self.finished.clone(),
        );
        r.register(
            "compensations_sent",
            "Compensation commands sent (first attempts)",
            self.compensations_sent.clone(),
        );
        r.register(
            "compensations_retried",
            "Compensation commands sent again",
            self.compensations_retried.clone(),
        );
        r.register(
            "compensations_failed",
            "Sub-transactions whose compensation attempts were exhausted",
            self.compensations_failed.clone(),
        );
        r.register(
            "compensations_rerouted",
            "Compensation commands sent again because the connection that took them ended unanswered",
            self.compensations_rerouted.clone(),
        );
        r.register(
            "instances",
            "Participant connections registered",
            self.instances.clone(),
        );
        r.register(
            "waiting_for_instance",
            "Live sagas with a compensation waiting for a live instance of its service",
            self.waiting_for_instance.clone(),
        );
    }

    /// A saga moved from `from` (None: new) to `to`.
    pub(crate) fn transition(&self, from: Option<SagaState>, to: SagaState) {
        if from == Some(to) {
            return;
        }
        if let Some(Series::Live(g)) = from.map(|f| self.series(f)) {
            g.dec();
        }
        match self.series(to) {
            Series::Live(g) => {
                g.inc();
            }
            Series::Done(c) => {
                c.inc();
            }
        }
    }

    fn series(&self, s: SagaState) -> Series<'_> {
        match s {
            SagaState::Running => Series::Live(&self.running),
            SagaState::Compensating => Series::Live(&self.compensating),
            SagaState::Committed => Series::Done(&self.committed),
            SagaState::Compensated => Series::Done(&self.compensated),
            SagaState::Failed => Series::Done(&self.failed),
        }
    }
}

/// Encodes `registry` as Prometheus (OpenMetrics) text.
pub fn encode(registry: &MetricsRegistry) -> String {
    let mut out = String::with_capacity(8 * 1024);
    let reg = registry.lock().unwrap_or_else(|p| p.into_inner());
    // Writing into a String cannot fail.
    prometheus_client::encoding::text::encode(&mut out, &reg).expect("writing to a String");
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    fn text(m: &SagaMetrics) -> String {
        let registry: MetricsRegistry = Arc::new(Mutex::new(Registry::default()));
        m.register(&registry);
        encode(&registry)
    }

    #[test]
    fn transitions_move_sagas_between_the_state_series() {
        let m = SagaMetrics::new();
        // Every state's series is there from the start, at zero.
        let start = text(&m);
        for line in [
            "railyard_saga_sagas{state=\"RUNNING\"} 0",
            "railyard_saga_sagas{state=\"COMPENSATING\"} 0",
            "railyard_saga_finished_total{state=\"COMMITTED\"} 0",
            "railyard_saga_finished_total{state=\"COMPENSATED\"} 0",
            "railyard_saga_finished_total{state=\"FAILED\"} 0",
        ] {
            assert!(start.contains(line), "{line} missing from:\n{start}");
        }
        for _ in 0..3 {
            m.transition(None, SagaState::Running);
        }
        m.transition(Some(SagaState::Running), SagaState::Committed);
        m.transition(Some(SagaState::Running), SagaState::Compensating);
        m.transition(Some(SagaState::Compensating), SagaState::Compensated);
        m.transition(Some(SagaState::Running), SagaState::Compensating);
        m.transition(Some(SagaState::Compensating), SagaState::Compensating);
        m.transition(Some(SagaState::Compensating), SagaState::Failed);
        let end = text(&m);
        for line in [
            "railyard_saga_sagas{state=\"RUNNING\"} 0",
            "railyard_saga_sagas{state=\"COMPENSATING\"} 0",
            "railyard_saga_finished_total{state=\"COMMITTED\"} 1",
            "railyard_saga_finished_total{state=\"COMPENSATED\"} 1",
            "railyard_saga_finished_total{state=\"FAILED\"} 1",
        ] {
            assert!(end.contains(line), "{line} missing from:\n{end}");
        }
        m.transition(None, SagaState::Running);
        assert!(text(&m).contains("railyard_saga_sagas{state=\"RUNNING\"} 1"));
    }
}
