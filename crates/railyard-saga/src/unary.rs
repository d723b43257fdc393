//! Omega's `OnTxEvent`, read and answered on hyper directly.
//!
//! `OnTxEvent` is the call every Omega participant makes for every event
//! (eight per global transaction in the alpha-benchmark profile), so its
//! per-call cost is the coordinator's cost. tonic's generated unary path
//! wraps each call in a decoding stream, a `tonic::Request` and
//! `tonic::Response` (each converting the header map into metadata and
//! back), an encoding stream for one message and a boxed response body: in
//! a profile of `railyard bench saga --protocol omega` (`perf record
//! --call-graph dwarf`) that machinery held about 9 % of the coordinator's
//! samples. Here the request's one gRPC message is cut out of the first
//! DATA frame that holds it (copied only if it spans frames), decoded with
//! prost, handled by [`OmegaService::tx_event`] (the same code the tonic
//! trait method runs), and answered by a body that yields one frame and the
//! `grpc-status` trailer.
//!
//! The wire is the same as tonic's: `200`, `content-type:
//! application/grpc`, one length-prefixed message, trailers `grpc-status:
//! 0`; a failure is a trailers-only answer with `grpc-status` and
//! `grpc-message` ([`tonic::Status::into_http`]). Requests this path does
//! not handle go to tonic's generated service instead (see
//! [`handles`]): compressed ones (`grpc-encoding`), and any method but
//! `OnTxEvent`.
//!
//! Malformed input gets a typed status and costs only its own call:
//! a message that is not protobuf, or a frame with the compressed flag set,
//! is `INTERNAL` (as tonic and grpc-java answer); a message over the limit
//! is `OUT_OF_RANGE`; a body that ends before its message (or has none) is
//! `INTERNAL`. Hand-written because it is Railyard's hot path: no crate
//! offers a unary gRPC handler cheaper than tonic's.

use std::pin::Pin;
use std::sync::LazyLock;
use std::task::{Context, Poll};

use bytes::{Bytes, BytesMut};
use http::header::CONTENT_TYPE;
use http::{HeaderMap, HeaderValue, Method, Request, Response};
use http_body::{Body as HttpBody, Frame, SizeHint};
use http_body_util::BodyExt;
use hyper::body::Incoming;
use prost::Message;
use railyard_saga_proto::omega::{GrpcAck, GrpcTxEvent};
use tonic::Status;

use crate::grpc_frame::{self, FrameError, PREFIX};
use crate::OmegaService;

/// The path of Omega's `OnTxEvent` (the proto has no package).
pub(crate) const ON_TX_EVENT: &str = "/TxEventService/OnTxEvent";

/// The largest `OnTxEvent` message accepted, as the tonic service's
/// `max_decoding_message_size`.
pub(crate) const MAX_MESSAGE: usize = railyard_saga_proto::MAX_EVENT_BYTES;

/// `application/grpc`, the content type of every answer.
const GRPC: HeaderValue = HeaderValue::from_static("application/grpc");
const GRPC_STATUS: http::HeaderName = http::HeaderName::from_static("grpc-status");
const GRPC_ENCODING: http::HeaderName = http::HeaderName::from_static("grpc-encoding");

/// The two possible answers, framed once: `GrpcAck { aborted }` is
/// `false` (an empty message) or `true`.
static ACKS: LazyLock<[Bytes; 2]> =
    LazyLock::new(|| [false, true].map(|aborted| grpc_frame::encode(&GrpcAck { aborted })));

/// Whether this path answers `req`: `POST` to `OnTxEvent`, uncompressed.
pub(crate) fn handles<B>(req: &Request<B>) -> bool {
    req.uri().path() == ON_TX_EVENT
        && req.method() == Method::POST
        && req
            .headers()
            .get(GRPC_ENCODING)
            .is_none_or(|v| v.as_bytes() == b"identity")
}

/// Answers one `OnTxEvent` call.
pub(crate) async fn on_tx_event(service: OmegaService, req: Request<Incoming>) -> Response<Body> {
    let answer = async {
        let message = read_message(req.into_body(), MAX_MESSAGE).await?;
        let event = GrpcTxEvent::decode(message).map_err(|e| {
            Status::internal(format!("failed to decode the OnTxEvent message: {e}"))
        })?;
        service.tx_event(event).await
    };
    match answer.await {
        Ok(ack) => {
            let mut res = Response::new(Body::Ack(AckBody {
                message: Some(ACKS[usize::from(ack.aborted)].clone()),
                trailers: true,
            }));
            res.headers_mut().insert(CONTENT_TYPE, GRPC);
            res
        }
        Err(status) => status.into_http(),
    }
}

/// Reads the body up to the end of its first gRPC message and returns that
/// message (without its prefix). What follows it is not read, as tonic's
/// unary path does not read it either.
async fn read_message<B>(mut body: B, limit: usize) -> Result<Bytes, Status>
where
    B: HttpBody<Data = Bytes> + Unpin,
    B::Error: std::fmt::Display,
{
    let mut pending = BytesMut::new();
    loop {
        let Some(frame) = body.frame().await else {
            return Err(if pending.is_empty() {
                Status::internal("the OnTxEvent request has no message")
            } else {
                Status::internal("the OnTxEvent request ended inside its message")
            });
        };
        let frame = frame.map_err(|e| Status::cancelled(format!("reading the request: {e}")))?;
        let Ok(data) = frame.into_data() else {
            continue; // trailers: nothing to read
        };
        if pending.is_empty() {
            // The usual case: the whole message in one DATA frame, no copy.
            if let Some(len) = prefix(&data, limit)? {
                if data.len() >= PREFIX + len {
                    return Ok(data.slice(PREFIX..PREFIX + len));
                }
            }
        }
        // Spread over frames: gathered once, each byte copied once.
        pending.extend_from_slice(&data);
        if let Some(len) = prefix(&pending, limit)? {
            if pending.len() >= PREFIX + len {
                let mut whole = pending.split_to(PREFIX + len).freeze();
                return Ok(whole.split_off(PREFIX));
            }
        }
    }
}

/// The length of the first message in `buf`, once its prefix is all there.
///
/// # Errors
/// `INTERNAL` for a compressed message (no encoding was negotiated),
/// `OUT_OF_RANGE` for one over `limit`.
fn prefix(buf: &[u8], limit: usize) -> Result<Option<usize>, Status> {
    grpc_frame::message_len(buf, limit).map_err(|e| match e {
        FrameError::Compressed => Status::internal(format!("OnTxEvent: {e}")),
        FrameError::TooLarge { .. } => Status::out_of_range(format!("OnTxEvent: {e}")),
    })
}

/// The body of every answer on the port: tonic's, or this path's ack.
pub(crate) enum Body {
    /// From tonic's generated services, the REST router, or a status.
    Tonic(tonic::body::Body),
    /// An `OnTxEvent` ack.
    Ack(AckBody),
}

impl Default for Body {
    fn default() -> Self {
        Self::Tonic(tonic::body::Body::default())
    }
}

/// One framed message, then `grpc-status: 0`.
pub(crate) struct AckBody {
    message: Option<Bytes>,
    trailers: bool,
}

impl HttpBody for Body {
    type Data = Bytes;
    type Error = Status;

    fn poll_frame(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
    ) -> Poll<Option<Result<Frame<Bytes>, Status>>> {
        match self.get_mut() {
            Self::Tonic(b) => Pin::new(b).poll_frame(cx),
            Self::Ack(b) => Poll::Ready(if let Some(m) = b.message.take() {
                Some(Ok(Frame::data(m)))
            } else if std::mem::take(&mut b.trailers) {
                let mut t = HeaderMap::with_capacity(1);
                t.insert(GRPC_STATUS, HeaderValue::from_static("0"));
                Some(Ok(Frame::trailers(t)))
            } else {
                None
            }),
        }
    }

    fn is_end_stream(&self) -> bool {
        match self {
            Self::Tonic(b) => b.is_end_stream(),
            Self::Ack(b) => b.message.is_none() && !b.trailers,
        }
    }

    fn size_hint(&self) -> SizeHint {
        match self {
            Self::Tonic(b) => b.size_hint(),
            Self::Ack(b) => {
                let mut hint = SizeHint::new();
                hint.set_upper(b.message.as_ref().map_or(0, |m| m.len() as u64));
                hint
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use http_body_util::{Full, StreamBody};

    fn framed(flag: u8, message: &[u8]) -> Vec<u8> {
        grpc_frame::frame_bytes(flag != 0, message).to_vec()
    }

    fn chunks(parts: Vec<Vec<u8>>) -> impl HttpBody<Data = Bytes, Error = std::io::Error> + Unpin {
        StreamBody::new(futures::stream::iter(
            parts
                .into_iter()
                .map(|p| Ok::<_, std::io::Error>(Frame::data(Bytes::from(p)))),
        ))
    }

    #[tokio::test]
    async fn a_message_in_one_frame_or_split_across_several_reads_whole() {
        let event = GrpcTxEvent {
            global_tx_id: "g".repeat(300),
            r#type: "SagaStartedEvent".into(),
            ..GrpcTxEvent::default()
        };
        let wire = framed(0, &event.encode_to_vec());
        let one = read_message(Full::new(Bytes::from(wire.clone())), MAX_MESSAGE)
            .await
            .unwrap();
        assert_eq!(GrpcTxEvent::decode(one).unwrap(), event);
        // Split inside the prefix and inside the message.
        for at in [1, 3, PREFIX, 40, wire.len() - 1] {
            let parts = vec![wire[..at].to_vec(), wire[at..].to_vec()];
            let got = read_message(chunks(parts), MAX_MESSAGE).await.unwrap();
            assert_eq!(GrpcTxEvent::decode(got).unwrap(), event, "split at {at}");
        }
        // Byte by byte.
        let parts = wire.iter().map(|b| vec![*b]).collect();
        let got = read_message(chunks(parts), MAX_MESSAGE).await.unwrap();
        assert_eq!(GrpcTxEvent::decode(got).unwrap(), event);
        // A 4 MiB message in HTTP/2's default 16 KiB frames.
        let big = GrpcTxEvent {
            payloads: vec![7; 4 << 20],
            ..event.clone()
        };
        let wire = framed(0, &big.encode_to_vec());
        let parts = wire.chunks(16 << 10).map(<[u8]>::to_vec).collect();
        let got = read_message(chunks(parts), MAX_MESSAGE).await.unwrap();
        assert_eq!(GrpcTxEvent::decode(got).unwrap(), big);
    }

    /// Reads `parts` as a body and checks the status it fails with.
    async fn fails_with(parts: Vec<Vec<u8>>, code: tonic::Code, text: &str) {
        let e = read_message(chunks(parts), MAX_MESSAGE).await.unwrap_err();
        assert_eq!(e.code(), code, "{}", e.message());
        assert!(e.message().contains(text), "{}", e.message());
    }

    #[tokio::test]
    async fn bad_bodies_get_typed_statuses() {
        fails_with(vec![], tonic::Code::Internal, "no message").await;
        let mut short = framed(0, b"0123456789");
        short.truncate(8);
        fails_with(vec![short], tonic::Code::Internal, "ended inside").await;
        fails_with(vec![framed(1, b"xx")], tonic::Code::Internal, "compressed").await;

        // Refused from the prefix alone, before the message is read.
        let mut big = vec![0];
        big.extend_from_slice(&(MAX_MESSAGE as u32 + 1).to_be_bytes());
        let big = read_message(chunks(vec![big]), MAX_MESSAGE)
            .await
            .unwrap_err();
        assert_eq!(big.code(), tonic::Code::OutOfRange);
    }

    #[tokio::test]
    async fn an_ack_body_is_one_message_then_grpc_status_0() {
        for aborted in [false, true] {
            let body = Body::Ack(AckBody {
                message: Some(ACKS[usize::from(aborted)].clone()),
                trailers: true,
            });
            let collected = body.collect().await.unwrap();
            assert_eq!(
                collected.trailers().and_then(|t| t.get("grpc-status")),
                Some(&HeaderValue::from_static("0"))
            );
            let bytes = collected.to_bytes();
            let len = grpc_frame::message_len(&bytes, MAX_MESSAGE)
                .unwrap()
                .unwrap();
            assert_eq!(bytes.len(), PREFIX + len);
            assert_eq!(GrpcAck::decode(&bytes[PREFIX..]).unwrap().aborted, aborted);
        }
    }

    #[test]
    fn only_uncompressed_posts_to_on_tx_event_take_this_path() {
        let req = |method: Method, path: &str, encoding: Option<&str>| {
            let mut b = Request::builder().method(method).uri(path);
            if let Some(e) = encoding {
                b = b.header("grpc-encoding", e);
            }
            b.body(()).unwrap()
        };
        assert!(handles(&req(Method::POST, ON_TX_EVENT, None)));
        assert!(handles(&req(Method::POST, ON_TX_EVENT, Some("identity"))));
        assert!(!handles(&req(Method::POST, ON_TX_EVENT, Some("gzip"))));
        assert!(!handles(&req(Method::GET, ON_TX_EVENT, None)));
        assert!(!handles(&req(
            Method::POST,
            "/TxEventService/OnConnected",
            None
        )));
    }
}
