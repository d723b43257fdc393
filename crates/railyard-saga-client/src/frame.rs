//! The session's outgoing frames, encoded straight from the events the
//! session keeps for resending.
//!
//! The generated `SagaCoordinatorClient::session` takes owned
//! `ClientFrame`s, so every batch would be a deep copy of events the session
//! must keep anyway until they are acknowledged. [`OutFrame::Batch`] shares
//! them instead ([`Arc`]), and [`OutCodec`] writes the same bytes prost
//! writes for `ClientFrame { kind: Events(EventBatch { seq, events }) }`
//! (the tests compare the two), so the wire is unchanged.

use std::sync::Arc;

use prost::encoding::{encode_key, encode_varint, encoded_len_varint, key_len, WireType};
use prost::Message;
use railyard_saga_proto::native::{ClientFrame, SagaEvent, ServerFrame};
use tonic::codec::{Codec, EncodeBuf, Encoder};
use tonic::Status;

/// `ClientFrame.events` (the `EventBatch` of the `kind` oneof).
const FRAME_EVENTS: u32 = 2;
/// `EventBatch.seq`.
const BATCH_SEQ: u32 = 1;
/// `EventBatch.events`.
const BATCH_EVENTS: u32 = 2;

/// A frame the session sends.
#[derive(Debug, Clone)]
pub(crate) enum OutFrame {
    /// Any frame built whole (the `Hello`).
    Whole(ClientFrame),
    /// `EventBatch { seq, events }`, the events shared with the batch kept
    /// for its ack (and for resending), with each event's encoded length
    /// (`sizes[i]` is `events[i].encoded_len()`, measured when the event
    /// was reported), so encoding does not measure them again.
    Batch {
        seq: u64,
        events: Arc<Vec<SagaEvent>>,
        sizes: Vec<usize>,
    },
}

/// Length of the `EventBatch` message body.
fn batch_body_len(seq: u64, sizes: &[usize]) -> usize {
    let seq_len = if seq == 0 {
        0 // proto3: a default scalar is not written
    } else {
        key_len(BATCH_SEQ) + encoded_len_varint(seq)
    };
    let events: usize = sizes
        .iter()
        .map(|&n| key_len(BATCH_EVENTS) + encoded_len_varint(n as u64) + n)
        .sum();
    seq_len + events
}

/// Appends the frame's protobuf encoding to `buf`.
fn encode_batch(seq: u64, events: &[SagaEvent], sizes: &[usize], buf: &mut impl bytes::BufMut) {
    encode_key(FRAME_EVENTS, WireType::LengthDelimited, buf);
    encode_varint(batch_body_len(seq, sizes) as u64, buf);
    if seq != 0 {
        encode_key(BATCH_SEQ, WireType::Varint, buf);
        encode_varint(seq, buf);
    }
    // What `message::encode` writes, with the length already known.
    for (e, &n) in events.iter().zip(sizes) {
        encode_key(BATCH_EVENTS, WireType::LengthDelimited, buf);
        encode_varint(n as u64, buf);
        e.encode_raw(buf);
    }
}

/// Encodes [`OutFrame`]s; decodes `ServerFrame`s with prost's decoder.
#[derive(Debug, Default)]
pub(crate) struct OutCodec;

/// The encoding half of [`OutCodec`].
#[derive(Debug, Default)]
pub(crate) struct OutEncoder;

impl Encoder for OutEncoder {
    type Item = OutFrame;
    type Error = Status;

    fn encode(&mut self, item: OutFrame, buf: &mut EncodeBuf<'_>) -> Result<(), Status> {
        match item {
            // An `EncodeBuf` grows as needed, so this does not fail; an
            // error would still end the call rather than panic.
            OutFrame::Whole(frame) => frame
                .encode(buf)
                .map_err(|e| Status::internal(e.to_string())),
            OutFrame::Batch { seq, events, sizes } => {
                encode_batch(seq, &events, &sizes, buf);
                Ok(())
            }
        }
    }
}

impl Codec for OutCodec {
    type Encode = OutFrame;
    type Decode = ServerFrame;
    type Encoder = OutEncoder;
    type Decoder = tonic_prost::ProstDecoder<ServerFrame>;

    fn encoder(&mut self) -> OutEncoder {
        OutEncoder
    }

    fn decoder(&mut self) -> Self::Decoder {
        tonic_prost::ProstDecoder::default()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use railyard_saga_proto::native::{client_frame, EventBatch, EventType};

    fn event(i: u32) -> SagaEvent {
        SagaEvent {
            r#type: EventType::TxStarted as i32,
            global_tx_id: format!("g-{i}"),
            local_tx_id: format!("g-{i}-1"),
            parent_tx_id: format!("g-{i}"),
            compensation_method: "undo é".into(),
            payloads: vec![0, 1, 2, 255],
            timestamp_ms: 1_700_000_000_000 + i64::from(i),
            timeout_ms: i,
            reverse_retries: 3,
            reverse_timeout_ms: 0,
            retry_delay_ms: 250,
            participant: i % 3,
            attempt: i % 2,
        }
    }

    #[test]
    fn batches_encode_exactly_as_prost_encodes_the_owned_frame() {
        for (seq, n) in [(0, 0), (1, 0), (0, 1), (7, 1), (300, 9), (u64::MAX, 200)] {
            let events: Vec<SagaEvent> = (0..n).map(event).collect();
            let owned = ClientFrame {
                kind: Some(client_frame::Kind::Events(EventBatch {
                    seq,
                    events: events.clone(),
                })),
            }
            .encode_to_vec();
            let sizes: Vec<usize> = events.iter().map(Message::encoded_len).collect();
            let mut shared = Vec::new();
            encode_batch(seq, &events, &sizes, &mut shared);
            assert_eq!(shared, owned, "seq {seq}, {n} events");
            let back = ClientFrame::decode(shared.as_slice()).expect("decodes");
            assert_eq!(
                back.kind,
                Some(client_frame::Kind::Events(EventBatch { seq, events }))
            );
        }
    }
}
