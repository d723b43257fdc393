//! Sagas and their steps.

use std::future::Future;
use std::sync::Arc;
use std::time::Duration;

use bytes::Bytes;
use railyard_saga_proto::native::{EventType, SagaEvent};

use crate::client::{now_ms, SagaClient};
use crate::error::{SagaError, StepError};

/// A global transaction, started with [`SagaClient::start_saga`] or joined
/// with [`SagaClient::join_saga`] (a step run by another service); cheap to
/// clone, so steps of one saga may run concurrently.
#[derive(Debug, Clone)]
pub struct Saga {
    client: SagaClient,
    global_tx_id: Arc<str>,
}

/// One step of a saga: its compensation, its payload (handed back to the
/// compensation byte for byte) and its compensation policy.
#[derive(Debug, Clone)]
pub struct Step {
    compensation_method: String,
    local_tx_id: Option<String>,
    parent_tx_id: Option<String>,
    payloads: Bytes,
    reverse_retries: u32,
    reverse_timeout: Duration,
    retry_delay: Duration,
}

impl Step {
    /// A step compensated by the handler registered as `compensation_method`.
    pub fn new(compensation_method: impl Into<String>) -> Self {
        Self {
            compensation_method: compensation_method.into(),
            local_tx_id: None,
            parent_tx_id: None,
            payloads: Bytes::new(),
            reverse_retries: 0,
            reverse_timeout: Duration::ZERO,
            retry_delay: Duration::ZERO,
        }
    }

    /// The step's own id (default: a fresh unique one). Reusing an id
    /// reports the same step again, which the coordinator ignores.
    pub fn local_id(mut self, id: impl Into<String>) -> Self {
        self.local_tx_id = Some(id.into());
        self
    }

    /// The enclosing step, for nested steps (default: the saga itself).
    pub fn parent(mut self, id: impl Into<String>) -> Self {
        self.parent_tx_id = Some(id.into());
        self
    }

    /// The data the compensation needs (the step's arguments).
    pub fn payload(mut self, payloads: impl Into<Bytes>) -> Self {
        self.payloads = payloads.into();
        self
    }

    /// Compensation retries after the first attempt before the coordinator
    /// gives up, so attempts = retries + 1 (0: the coordinator's default).
    pub fn reverse_retries(mut self, n: u32) -> Self {
        self.reverse_retries = n;
        self
    }

    /// How long one compensation attempt may take (zero: the coordinator's default).
    pub fn reverse_timeout(mut self, d: Duration) -> Self {
        self.reverse_timeout = d;
        self
    }

    /// Delay between compensation attempts (zero: the coordinator's default).
    pub fn retry_delay(mut self, d: Duration) -> Self {
        self.retry_delay = d;
        self
    }
}

fn millis_u32(d: Duration) -> u32 {
    u32::try_from(d.as_millis()).unwrap_or(u32::MAX)
}

impl SagaClient {
    /// Starts a saga (reports `SAGA_STARTED` and waits until it is durable).
    /// With a `timeout`, the coordinator aborts and compensates the saga if
    /// it has not ended by then.
    ///
    /// # Errors
    /// [`SagaError::Rejected`], [`SagaError::Closed`], [`SagaError::Protocol`].
    pub async fn start_saga(&self, timeout: Option<Duration>) -> Result<Saga, SagaError> {
        let id = self.shared.new_id();
        let event = SagaEvent {
            r#type: EventType::SagaStarted as i32,
            global_tx_id: id.clone(),
            local_tx_id: id.clone(),
            timestamp_ms: now_ms(),
            timeout_ms: timeout.map_or(0, |t| millis_u32(t).max(1)),
            ..SagaEvent::default()
        };
        self.shared.reporter.report(event).await?;
        Ok(Saga {
            client: self.clone(),
            global_tx_id: id.into(),
        })
    }

    /// A handle on a saga started elsewhere (its id travels with the
    /// business request), to run this service's steps in it.
    pub fn join_saga(&self, global_tx_id: impl Into<String>) -> Saga {
        self.join_saga_shared(Arc::from(global_tx_id.into()))
    }

    /// As [`join_saga`](Self::join_saga), sharing the id instead of copying
    /// it: several services of one process joining the same saga hold one
    /// copy (see [`Saga::shared_id`]).
    pub fn join_saga_shared(&self, global_tx_id: Arc<str>) -> Saga {
        Saga {
            client: self.clone(),
            global_tx_id,
        }
    }
}

impl Saga {
    /// The global transaction id.
    pub fn id(&self) -> &str {
        &self.global_tx_id
    }

    /// The global transaction id, shared: hand it to
    /// [`SagaClient::join_saga_shared`] of other clients without copying it.
    pub fn shared_id(&self) -> Arc<str> {
        self.global_tx_id.clone()
    }

    fn event(&self, kind: EventType, local: String, parent: String) -> SagaEvent {
        // `String::from(&*id)` copies the id; `to_string()` on an `Arc<str>`
        // would go through `Display` and the formatter (measured: ~1% of the
        // bench's CPU for these copies).
        SagaEvent {
            r#type: kind as i32,
            global_tx_id: String::from(&*self.global_tx_id),
            local_tx_id: local,
            parent_tx_id: parent,
            timestamp_ms: now_ms(),
            ..SagaEvent::default()
        }
    }

    /// Runs one step: reports `TX_STARTED` (durably, with the step's payload
    /// and compensation), runs `work`, then reports `TX_ENDED` if it
    /// succeeded or `TX_ABORTED` if it failed (which makes the coordinator
    /// compensate the saga's completed steps in reverse order).
    ///
    /// # Errors
    /// [`StepError::SagaAborted`] if the saga was already aborted (`work`
    /// did not run); [`StepError::Failed`] with `work`'s error;
    /// [`StepError::Saga`] if reporting failed.
    ///
    /// # Cancel safety
    /// Not cancel safe: dropping the future after `TX_STARTED` leaves the
    /// step open until the saga ends, aborts or times out.
    pub async fn step<T, E, F>(&self, step: Step, work: F) -> Result<T, StepError<E>>
    where
        F: Future<Output = Result<T, E>>,
    {
        let local = step
            .local_tx_id
            .unwrap_or_else(|| self.client.shared.new_id());
        let parent = step
            .parent_tx_id
            .unwrap_or_else(|| String::from(&*self.global_tx_id));
        let started = SagaEvent {
            compensation_method: step.compensation_method.clone(),
            // The step's own buffer when nothing else shares it (no copy).
            payloads: Vec::from(step.payloads),
            reverse_retries: step.reverse_retries,
            reverse_timeout_ms: millis_u32(step.reverse_timeout),
            retry_delay_ms: millis_u32(step.retry_delay),
            ..self.event(EventType::TxStarted, local.clone(), parent.clone())
        };
        let reporter = &self.client.shared.reporter;
        if reporter.report(started).await?.aborted {
            return Err(StepError::SagaAborted(self.global_tx_id.to_string()));
        }
        match work.await {
            Ok(v) => {
                let ended = SagaEvent {
                    compensation_method: step.compensation_method,
                    ..self.event(EventType::TxEnded, local, parent)
                };
                reporter.report(ended).await?;
                Ok(v)
            }
            Err(e) => {
                let aborted = SagaEvent {
                    compensation_method: step.compensation_method,
                    ..self.event(EventType::TxAborted, local, parent)
                };
                reporter.report(aborted).await?;
                Err(StepError::Failed(e))
            }
        }
    }

    /// Ends the saga (reports `SAGA_ENDED`): committed once acknowledged.
    ///
    /// # Errors
    /// [`SagaError::Aborted`] if the coordinator had already aborted it (a
    /// failed step, its timeout); its completed steps are compensated.
    /// Otherwise as [`SagaClient::report`].
    pub async fn end(&self) -> Result<(), SagaError> {
        let id = String::from(&*self.global_tx_id);
        let ended = self.event(EventType::SagaEnded, id.clone(), String::new());
        if self.client.shared.reporter.report(ended).await?.aborted {
            return Err(SagaError::Aborted(id));
        }
        Ok(())
    }

    /// Aborts the saga (reports `SAGA_ABORTED`): the coordinator compensates
    /// every completed step in reverse order.
    ///
    /// # Errors
    /// As [`SagaClient::report`].
    pub async fn abort(&self) -> Result<(), SagaError> {
        let id = String::from(&*self.global_tx_id);
        let aborted = self.event(EventType::SagaAborted, id, String::new());
        self.client.shared.reporter.report(aborted).await?;
        Ok(())
    }
}
