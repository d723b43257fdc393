//! gRPC's length-prefixed messages: one flag byte (compressed or not) and
//! a big-endian `u32` length before each protobuf message.
//!
//! Shared by the coordinator's hand-written `OnTxEvent` path
//! (the crate's `unary` module) and the bench's Omega load client, which both write
//! and read the framing without tonic's codec. Neither negotiates
//! compression, so a set flag is an error.

use bytes::{BufMut, Bytes, BytesMut};
use prost::Message;

/// The prefix before every message.
pub const PREFIX: usize = 5;

/// Why a prefix is refused.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum FrameError {
    /// The compressed flag is set, but no compression was negotiated.
    #[error("the message has its compressed flag set, but no grpc-encoding was negotiated")]
    Compressed,
    /// The announced length is over the limit.
    #[error("the message is {len} bytes; the limit is {limit}")]
    TooLarge {
        /// The length the prefix announces.
        len: usize,
        /// The largest accepted.
        limit: usize,
    },
}

/// `message` with its prefix, uncompressed.
pub fn encode(message: &impl Message) -> Bytes {
    let len = message.encoded_len();
    let mut buf = BytesMut::with_capacity(PREFIX + len);
    put_prefix(&mut buf, false, len);
    // Cannot fail: the buffer has exactly the room `encoded_len` asked for.
    let _ = message.encode(&mut buf);
    buf.freeze()
}

/// Already-encoded `message` bytes with their prefix, its compressed flag
/// set as asked (the bytes are not compressed here: a set flag is for
/// feeding a peer what it must refuse).
pub fn frame_bytes(compressed: bool, message: &[u8]) -> Bytes {
    let mut buf = BytesMut::with_capacity(PREFIX + message.len());
    put_prefix(&mut buf, compressed, message.len());
    buf.extend_from_slice(message);
    buf.freeze()
}

fn put_prefix(buf: &mut BytesMut, compressed: bool, len: usize) {
    buf.put_u8(u8::from(compressed));
    // Messages over 4 GiB cannot be framed by gRPC at all; prost's own
    // limit is lower.
    buf.put_u32(u32::try_from(len).unwrap_or(u32::MAX));
}

/// The length of the first message in `buf`, once its prefix is all there
/// (`None` before).
///
/// # Errors
/// [`FrameError`] for a compressed message, or one over `limit`.
pub fn message_len(buf: &[u8], limit: usize) -> Result<Option<usize>, FrameError> {
    let Some(head) = buf.get(..PREFIX) else {
        return Ok(None);
    };
    if head[0] != 0 {
        return Err(FrameError::Compressed);
    }
    let len = u32::from_be_bytes([head[1], head[2], head[3], head[4]]) as usize;
    if len > limit {
        return Err(FrameError::TooLarge { len, limit });
    }
    Ok(Some(len))
}

#[cfg(test)]
mod tests {
    use super::*;
    use railyard_saga_proto::omega::GrpcAck;

    #[test]
    fn an_encoded_message_reads_back_and_bad_prefixes_are_refused() {
        let framed = encode(&GrpcAck { aborted: true });
        let len = message_len(&framed, 64).unwrap().unwrap();
        assert_eq!(framed.len(), PREFIX + len);
        assert!(GrpcAck::decode(&framed[PREFIX..]).unwrap().aborted);
        assert_eq!(frame_bytes(false, &framed[PREFIX..]), framed);
        assert_eq!(
            message_len(&frame_bytes(true, b"x"), 64),
            Err(FrameError::Compressed)
        );
        // An incomplete prefix is not an answer yet.
        assert_eq!(message_len(&framed[..PREFIX - 1], 64), Ok(None));
        assert_eq!(
            message_len(&[1, 0, 0, 0, 0], 64),
            Err(FrameError::Compressed)
        );
        assert_eq!(
            message_len(&[0, 0, 0, 0, 65], 64),
            Err(FrameError::TooLarge { len: 65, limit: 64 })
        );
    }
}
