//! The Omega load generator's client: Omega's `TxEventService` calls written
//! straight onto an HTTP/2 connection with the `h2` crate.
//!
//! What goes on the wire is what grpc-java, Omega's transport, sends: a
//! `POST` to `/<service>/<method>` with `content-type: application/grpc`,
//! `te: trailers`, its `user-agent` and `grpc-accept-encoding`, the protobuf message in one length-prefixed gRPC frame;
//! the answer is read the same way and its `grpc-status` checked. Only the
//! client's own machinery is left out. tonic's client encodes through a
//! streaming body, a decoder and a status parser per call, and hyper's
//! client hands every request to its connection task through a channel: in
//! a profile of `railyard bench saga --protocol omega` (`perf record
//! --call-graph dwarf`), tonic's client, codec and hyper's h2 client held
//! 26 % of the load generator's samples, and the load generator 35 % of all
//! samples. On this 2-core machine each cycle the load spends is one the
//! coordinator does not get, so the client is kept as lean as the protocol
//! allows.
//!
//! Hand-written because it is the load generator's hot path, not a general
//! gRPC client: unary calls and one server-streaming read, no compression,
//! no deadlines, no retries (a failed call is a failed transaction).

use std::sync::Arc;
use std::time::Duration;

use bytes::{Buf, Bytes, BytesMut};
use http::{HeaderMap, HeaderName, HeaderValue, Method, Request, Uri};
use prost::Message;
// Omega's service, as its paths name it (its proto file has no package).
use railyard_saga::grpc_frame::{self, PREFIX};
use railyard_saga_proto::omega::tx_event_service_server::SERVICE_NAME as SERVICE;
use railyard_saga_proto::omega::{GrpcAck, GrpcCompensateCommand, GrpcServiceConfig, GrpcTxEvent};

/// The user agent of grpc-java 1.44.1, the release Omega 0.7.1 pins.
const USER_AGENT: &str = "grpc-java-netty/1.44.1";
// Named once: a `&str` key would be parsed and validated at every lookup.
const GRPC_STATUS: HeaderName = HeaderName::from_static("grpc-status");
const GRPC_MESSAGE: HeaderName = HeaderName::from_static("grpc-message");
const GRPC_ACCEPT_ENCODING: HeaderName = HeaderName::from_static("grpc-accept-encoding");
/// The largest answer accepted (a compensation command carries payloads).
const MAX_MESSAGE: usize = 16 * 1024 * 1024;

/// Why a call failed.
#[derive(Debug, thiserror::Error)]
pub(crate) enum CallError {
    /// The connection or the stream broke.
    #[error("HTTP/2: {0}")]
    H2(#[from] h2::Error),
    /// The server answered with a non-zero `grpc-status`.
    #[error("gRPC status {code}: {message}")]
    Status {
        /// The status code.
        code: String,
        /// `grpc-message`, if any.
        message: String,
    },
    /// The answer is not a well-formed gRPC answer.
    #[error("malformed answer: {0}")]
    Malformed(String),
}

/// One HTTP/2 connection to the coordinator; cheap to clone (every clone
/// opens streams on the same connection).
#[derive(Clone)]
pub(crate) struct OmegaWire {
    send: h2::client::SendRequest<Bytes>,
    /// The endpoint as given, for errors.
    endpoint: Arc<str>,
    on_tx_event: Uri,
    on_connected: Uri,
}

impl OmegaWire {
    /// Connects to `endpoint` (`http://host:port`) and spawns the
    /// connection's driver on the current runtime.
    pub(crate) async fn connect(endpoint: &str) -> Result<Self, String> {
        let origin: Uri = endpoint.parse().map_err(|e| format!("{e}"))?;
        let authority = origin
            .authority()
            .ok_or_else(|| "the endpoint has no host:port".to_owned())?
            .clone();
        let tcp = tokio::time::timeout(
            Duration::from_secs(5),
            tokio::net::TcpStream::connect(authority.as_str()),
        )
        .await
        .map_err(|_| "connect timed out".to_owned())?
        .map_err(|e| e.to_string())?;
        let _ = tcp.set_nodelay(true);
        // Requests of concurrent calls share socket writes, as grpc-java's
        // (Omega's transport) do: it flushes its queue of pending writes
        // once per batch, not once per call.
        let tcp = railyard_saga::coalesce::Coalesced::new(tcp);
        // hyper's client windows (2 MiB per stream, 5 MiB per connection):
        // the same flow-control traffic as the hyper client this replaced.
        let (send, conn) = h2::client::Builder::new()
            .initial_window_size(2 * 1024 * 1024)
            .initial_connection_window_size(5 * 1024 * 1024)
            .handshake::<_, Bytes>(tcp)
            .await
            .map_err(|e| format!("HTTP/2 handshake: {e}"))?;
        tokio::spawn(async move {
            if let Err(e) = conn.await {
                tracing::debug!(error = %e, "bench HTTP/2 connection ended");
            }
        });
        let uri = |method: &str| -> Result<Uri, String> {
            Uri::builder()
                .scheme("http")
                .authority(authority.clone())
                .path_and_query(format!("/{SERVICE}/{method}"))
                .build()
                .map_err(|e| format!("{e}"))
        };
        Ok(Self {
            send,
            endpoint: Arc::from(endpoint),
            on_tx_event: uri("OnTxEvent")?,
            on_connected: uri("OnConnected")?,
        })
    }

    /// The endpoint this connection was opened to.
    pub(crate) fn endpoint(&self) -> &str {
        &self.endpoint
    }

    /// Opens a stream for a call to `uri` and sends `message` on it; the
    /// stream's sending half ends with the message if `end`.
    async fn open(
        &self,
        uri: &Uri,
        message: &impl Message,
        end: bool,
    ) -> Result<(h2::client::ResponseFuture, h2::SendStream<Bytes>), CallError> {
        let mut send = self.send.clone().ready().await?;
        let mut req = Request::new(());
        *req.method_mut() = Method::POST;
        *req.uri_mut() = uri.clone();
        let headers = req.headers_mut();
        headers.insert(
            http::header::CONTENT_TYPE,
            HeaderValue::from_static("application/grpc"),
        );
        headers.insert(http::header::TE, HeaderValue::from_static("trailers"));
        // What grpc-java (Omega's transport) sends besides.
        headers.insert(
            http::header::USER_AGENT,
            HeaderValue::from_static(USER_AGENT),
        );
        headers.insert(GRPC_ACCEPT_ENCODING, HeaderValue::from_static("gzip"));
        let (response, mut stream) = send.send_request(req, false)?;
        stream.send_data(grpc_frame::encode(message), end)?;
        Ok((response, stream))
    }

    /// One unary `OnTxEvent` call.
    pub(crate) async fn on_tx_event(&self, event: &GrpcTxEvent) -> Result<GrpcAck, CallError> {
        let (response, _stream) = self.open(&self.on_tx_event, event, true).await?;
        let response = response.await?;
        let (parts, mut body) = response.into_parts();
        answer_status(parts.status, &parts.headers)?;
        let mut reader = FrameReader::default();
        let message = reader.next(&mut body).await?;
        check_trailers(body.trailers().await?.as_ref())?;
        match message {
            Some(m) => GrpcAck::decode(m).map_err(|e| CallError::Malformed(e.to_string())),
            None => Err(CallError::Malformed(
                "a unary answer without a message".into(),
            )),
        }
    }

    /// Opens `OnConnected` with `config` and keeps the request stream open
    /// (as Omega does) until the returned [`Commands`] is dropped.
    pub(crate) async fn on_connected(
        &self,
        config: &GrpcServiceConfig,
    ) -> Result<Commands, CallError> {
        let (response, stream) = self.open(&self.on_connected, config, false).await?;
        let response = response.await?;
        let (parts, body) = response.into_parts();
        answer_status(parts.status, &parts.headers)?;
        Ok(Commands {
            body,
            reader: FrameReader::default(),
            _request: stream,
        })
    }
}

/// The compensation commands of one `OnConnected` stream.
pub(crate) struct Commands {
    body: h2::RecvStream,
    reader: FrameReader,
    /// Dropping it resets the stream, which ends the registration.
    _request: h2::SendStream<Bytes>,
}

impl Commands {
    /// The next command; `Ok(None)` when the server ended the stream.
    pub(crate) async fn next(&mut self) -> Result<Option<GrpcCompensateCommand>, CallError> {
        match self.reader.next(&mut self.body).await? {
            Some(m) => GrpcCompensateCommand::decode(m)
                .map(Some)
                .map_err(|e| CallError::Malformed(e.to_string())),
            None => {
                check_trailers(self.body.trailers().await?.as_ref())?;
                Ok(None)
            }
        }
    }
}

/// Checks an answer's head: HTTP 200, and no error status in a
/// trailers-only answer.
fn answer_status(status: http::StatusCode, headers: &HeaderMap) -> Result<(), CallError> {
    if status != http::StatusCode::OK {
        return Err(CallError::Malformed(format!("HTTP status {status}")));
    }
    // A trailers-only answer carries grpc-status in its headers.
    check_trailers(Some(headers))
}

fn check_trailers(trailers: Option<&HeaderMap>) -> Result<(), CallError> {
    let Some(code) = trailers.and_then(|t| t.get(GRPC_STATUS)) else {
        return Ok(());
    };
    if code == "0" {
        return Ok(());
    }
    let text = |v: Option<&HeaderValue>| {
        v.map(|v| String::from_utf8_lossy(v.as_bytes()).into_owned())
            .unwrap_or_default()
    };
    Err(CallError::Status {
        code: text(Some(code)),
        message: text(trailers.and_then(|t| t.get(GRPC_MESSAGE))),
    })
}

/// Splits a stream's DATA frames into gRPC messages (a message may span
/// frames, a frame may hold several messages), returning flow-control
/// capacity as it reads.
#[derive(Default)]
struct FrameReader {
    buf: BytesMut,
}

impl FrameReader {
    async fn next(&mut self, body: &mut h2::RecvStream) -> Result<Option<Bytes>, CallError> {
        loop {
            if let Some(m) = self.take()? {
                return Ok(Some(m));
            }
            match body.data().await {
                Some(chunk) => {
                    let chunk = chunk?;
                    let _ = body.flow_control().release_capacity(chunk.len());
                    self.buf.extend_from_slice(&chunk);
                }
                None if self.buf.is_empty() => return Ok(None),
                None => {
                    return Err(CallError::Malformed(
                        "the stream ended inside a message".into(),
                    ))
                }
            }
        }
    }

    /// The first whole message in the buffer, if there is one.
    fn take(&mut self) -> Result<Option<Bytes>, CallError> {
        let Some(len) = grpc_frame::message_len(&self.buf, MAX_MESSAGE)
            .map_err(|e| CallError::Malformed(e.to_string()))?
        else {
            return Ok(None);
        };
        if self.buf.len() < PREFIX + len {
            return Ok(None);
        }
        self.buf.advance(PREFIX);
        Ok(Some(self.buf.split_to(len).freeze()))
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use bytes::BufMut;

    #[test]
    fn frames_split_into_messages_across_and_within_chunks() {
        let a = GrpcAck { aborted: true };
        let b = GrpcServiceConfig {
            service_name: "orders".into(),
            instance_id: "orders-1".into(),
        };
        let mut wire = BytesMut::new();
        wire.extend_from_slice(&grpc_frame::encode(&a));
        wire.extend_from_slice(&grpc_frame::encode(&b));
        // Byte by byte: a message is returned only once whole.
        let mut r = FrameReader::default();
        let mut got = Vec::new();
        for byte in wire.iter() {
            r.buf.put_u8(*byte);
            if let Some(m) = r.take().unwrap() {
                got.push(m);
            }
        }
        assert_eq!(got.len(), 2);
        assert_eq!(GrpcAck::decode(got[0].clone()).unwrap(), a);
        assert_eq!(GrpcServiceConfig::decode(got[1].clone()).unwrap(), b);
        assert!(r.buf.is_empty());
    }

    #[test]
    fn compressed_or_oversized_messages_are_errors() {
        let mut r = FrameReader::default();
        r.buf.extend_from_slice(&[1, 0, 0, 0, 1, 0]);
        assert!(matches!(r.take(), Err(CallError::Malformed(_))));
        let mut r = FrameReader::default();
        r.buf.put_u8(0);
        r.buf.put_u32(u32::try_from(MAX_MESSAGE + 1).unwrap());
        assert!(matches!(r.take(), Err(CallError::Malformed(_))));
    }

    #[test]
    fn a_non_zero_grpc_status_is_an_error_with_its_message() {
        let mut t = HeaderMap::new();
        t.insert("grpc-status", HeaderValue::from_static("14"));
        t.insert(
            "grpc-message",
            HeaderValue::from_static("store unavailable"),
        );
        match check_trailers(Some(&t)) {
            Err(CallError::Status { code, message }) => {
                assert_eq!(code, "14");
                assert_eq!(message, "store unavailable");
            }
            other => panic!("{other:?}"),
        }
        t.insert("grpc-status", HeaderValue::from_static("0"));
        assert!(check_trailers(Some(&t)).is_ok());
        assert!(check_trailers(None).is_ok());
    }
}
