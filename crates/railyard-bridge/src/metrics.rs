//! Bridge counters: shared atomics that connection tasks add to in batches,
//! and the plain snapshot exporters read.

use std::sync::atomic::{AtomicU64, Ordering};

macro_rules! counters {
    ($( $(#[doc = $doc:literal])* $name:ident ),* $(,)?) => {
        /// A point-in-time reading of the bridge's counters, for exporters
        /// (e.g. Prometheus). Counters only grow, except the `*_open` gauges.
        #[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
        pub struct BridgeMetricsSnapshot {
            $( $(#[doc = $doc])* pub $name: u64, )*
        }

        impl BridgeMetricsSnapshot {
            /// Every counter as `(name, help, value)`, for exporters.
            pub fn all(&self) -> Vec<(&'static str, &'static str, u64)> {
                vec![ $( (stringify!($name), concat!($($doc),*), self.$name), )* ]
            }
        }

        /// The live counters behind [`BridgeMetricsSnapshot`].
        #[derive(Debug, Default)]
        pub(crate) struct BridgeCounters {
            $( pub(crate) $name: AtomicU64, )*
        }

        impl BridgeCounters {
            pub(crate) fn snapshot(&self) -> BridgeMetricsSnapshot {
                BridgeMetricsSnapshot {
                    $( $name: self.$name.load(Ordering::Relaxed), )*
                }
            }
        }

        impl LocalCounters {
            /// Adds what this connection counted since the last flush to the
            /// shared counters and zeroes it.
            pub(crate) fn flush(&mut self, to: &BridgeCounters) {
                $(
                    if self.0.$name != 0 {
                        to.$name.fetch_add(self.0.$name, Ordering::Relaxed);
                        self.0.$name = 0;
                    }
                )*
            }
        }
    };
}

counters! {
    /// Connections accepted (including those refused for `max_connections`).
    connections_accepted,
    /// Connections refused because `max_connections` were open.
    connections_refused,
    /// Connections closed.
    connections_closed,
    /// Frames read from clients.
    frames_in,
    /// Frames written to clients.
    frames_out,
    /// Bytes read from clients.
    bytes_in,
    /// Bytes written to clients.
    bytes_out,
    /// `send` frames without `replyAddress` that reached the bus.
    sends,
    /// `publish` frames that reached the bus.
    publishes,
    /// Requests (`send` with `replyAddress`) that reached the bus.
    requests,
    /// Requests that got a reply (delivered as a `message` frame).
    request_replies,
    /// Requests that failed (delivered as an `err` frame with `failureType`).
    request_failures,
    /// Answers (replies and failures) clients gave to bus requests.
    client_answers,
    /// Bus messages delivered to clients' registrations.
    deliveries,
    /// `register` frames accepted.
    registrations,
    /// `ping` frames answered.
    pings,
    /// `err` frames sent, every reason included.
    err_frames,
    /// Frames refused by the permission lists (`access_denied`).
    access_denied,
    /// Frames that were not valid JSON objects (connection closed).
    malformed_frames,
    /// Length prefixes above `max_frame_size` (connection closed).
    oversized_frames,
    /// Frames not received whole within `frame_timeout` (connection closed).
    frame_timeouts,
    /// Connections closed for sending no complete frame within `idle_timeout`.
    idle_timeouts,
    /// Frames refused by a limit (registrations, pending requests or replies
    /// per connection, headers per frame).
    limit_rejections,
    /// Connections closed for a missing or wrong `authToken`.
    auth_failures,
    /// Times a connection's outbound queue reached `outbound_queue_bytes` and
    /// the connection paused (see Back-pressure in the crate docs).
    outbound_pauses,
    /// Sends and publishes the bus refused (no handlers, full buffers, ...), answered with `err`.
    bus_refusals,
    /// Bus requests to clients failed at once because `max_pending_replies` were waiting.
    replies_refused,
    /// Bus requests a client held unanswered past `reply_timeout` (or whose
    /// requester had gone), let go to make room for a new one: the client's
    /// late answer finds no request.
    replies_expired,
}

/// A connection's own counters, flushed into the shared ones in batches so
/// the hot path never touches a cache line other connections write.
#[derive(Debug, Default)]
pub(crate) struct LocalCounters(pub(crate) BridgeMetricsSnapshot);

impl BridgeMetricsSnapshot {
    /// Connections open at the time of the snapshot, derived (accepted -
    /// refused - closed) so that no gauge needs a decrement on the hot path.
    pub fn connections_open(&self) -> u64 {
        self.connections_accepted
            .saturating_sub(self.connections_refused)
            .saturating_sub(self.connections_closed)
    }
}
