//! The coordinator's settings: a plain `serde` struct with `Default`.

use std::time::Duration;

/// Settings of a [`Coordinator`](crate::Coordinator). Every field has a
/// default suited to `railyard node`.
#[derive(Debug, Clone, serde::Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct CoordinatorConfig {
    /// Shards of the in-memory saga table (each one lock); rounded up to 1.
    pub shards: usize,
    /// How often deadlines (saga timeouts, compensation timeouts, retry
    /// delays) are checked: their resolution.
    #[serde(with = "millis")]
    pub timer_tick: Duration,
    /// Compensation retries when `TxStarted` says `reverseRetries = 0`
    /// (attempts = retries + 1).
    pub default_reverse_retries: u32,
    /// How long a compensation may go unanswered before it is retried, when
    /// `TxStarted` says `reverseTimeout = 0`.
    #[serde(with = "millis")]
    pub default_reverse_timeout: Duration,
    /// Delay between compensation attempts when `TxStarted` says
    /// `retryDelayInMilliseconds = 0`.
    #[serde(with = "millis")]
    pub default_retry_delay: Duration,
    /// How long a compensation command waits for an instance of its service
    /// to connect (or to have room in its queue) before the attempt counts
    /// as failed.
    #[serde(with = "millis")]
    pub instance_wait: Duration,
    /// After the last compensation, how long to wait for sub-transactions
    /// that started but never ended (each is compensated if it ends).
    #[serde(with = "millis")]
    pub straggler_wait: Duration,
    /// How long a saga created by a later event (its `SagaStarted` not
    /// seen: out of order, or a late or repeated event whose saga was
    /// already forgotten) may stay running without its `SagaStarted`;
    /// then it ends `FAILED` for an operator, so that it is compacted
    /// instead of held forever.
    #[serde(with = "millis")]
    pub orphan_wait: Duration,
    /// Terminal sagas remembered per shard to answer late events
    /// (e.g. `TxStarted` after compensation answers `aborted = true`).
    pub finished_cache_per_shard: usize,
    /// Capacity of each Omega instance's command queue. When full, a command
    /// goes to another instance or waits (see `instance_wait`).
    pub omega_queue: usize,
    /// Capacity of each native session's outbound queue (acks and commands).
    /// When full, acks wait for room (the session stops reading new
    /// batches); commands go to another instance or wait.
    pub session_queue: usize,
    /// Event batches one native session may have outstanding (appending) at
    /// once; further frames are not read until one completes.
    pub session_in_flight: usize,
    /// Bytes of native batches (encoded size) being appended at once,
    /// across every session: a batch that finds no room waits, its session
    /// reading nothing meanwhile (HTTP/2 flow control then holds its client
    /// back). A batch larger than the whole budget waits for all of it.
    /// Bounds the coordinator's memory for batches in flight, which
    /// `session_in_flight` alone bounds only in count (x 64 MiB frames).
    /// Counted in KiB; less than 1 KiB counts as 1 KiB (one batch at a
    /// time). Default 256 MiB.
    pub native_batch_bytes: usize,
    /// Events per native batch; a larger batch closes the session with
    /// `INVALID_ARGUMENT`.
    pub max_batch_events: usize,
    /// Advertise `AkkaEnabled = true` to Omega (the default): Omega 0.7 then
    /// reports `TxCompensateAck*Event` and `SagaAbortedEvent`, and a
    /// compensation method that throws as `TxCompensateAckFailedEvent`, so
    /// it is retried. With `false` Omega logs the exception and reports
    /// `TxCompensatedEvent`: the undo is recorded done though it failed.
    /// Both flavours are accepted either way.
    pub advertise_akka: bool,
    /// If set, native sessions must present this token in `Hello`.
    pub token: Option<String>,
}

impl Default for CoordinatorConfig {
    fn default() -> Self {
        Self {
            shards: 64,
            timer_tick: Duration::from_millis(50),
            default_reverse_retries: 3,
            default_reverse_timeout: Duration::from_secs(30),
            default_retry_delay: Duration::from_secs(1),
            instance_wait: Duration::from_secs(60),
            straggler_wait: Duration::from_secs(30),
            orphan_wait: Duration::from_secs(60),
            finished_cache_per_shard: 1024,
            omega_queue: 1024,
            session_queue: 4096,
            session_in_flight: 256,
            native_batch_bytes: 256 << 20,
            max_batch_events: 16_384,
            advertise_akka: true,
            token: None,
        }
    }
}

mod millis {
    use std::time::Duration;

    use serde::Deserialize;

    pub(super) fn deserialize<'de, D: serde::Deserializer<'de>>(
        d: D,
    ) -> Result<Duration, D::Error> {
        u64::deserialize(d).map(Duration::from_millis)
    }
}
