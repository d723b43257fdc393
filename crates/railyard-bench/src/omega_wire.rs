//! The Omega load generator's client: Omega's `TxEventService` calls on a
//! lean HTTP/2 connection ([`grpc_h2`](crate::grpc_h2)).
//!
//! What goes on the wire is what grpc-java, Omega's transport, sends: a
//! `POST` to `/<service>/<method>` with `content-type: application/grpc`,
//! `te: trailers`, its `user-agent` and `grpc-accept-encoding`, the protobuf
//! message in one length-prefixed gRPC frame; the answer is read the same
//! way and its `grpc-status` checked. Only a general client's machinery is
//! left out (see `grpc_h2` for why): on this 2-core machine each cycle the
//! load spends is one the coordinator does not get.
//!
//! Unary calls and one server-streaming read; no compression, no
//! deadlines, no retries (a failed call is a failed transaction).

use std::sync::Arc;

use bytes::Bytes;
use http::Uri;
use prost::Message;
use railyard_saga::grpc_frame;
// Omega's service, as its paths name it (its proto file has no package).
use railyard_saga_proto::omega::tx_event_service_server::SERVICE_NAME as SERVICE;
use railyard_saga_proto::omega::{GrpcAck, GrpcCompensateCommand, GrpcServiceConfig, GrpcTxEvent};

pub(crate) use crate::grpc_h2::CallError;
use crate::grpc_h2::{request_block, Conn, ServerStream};

/// The user agent of grpc-java 1.44.1, the release Omega 0.7.1 pins.
const USER_AGENT: &str = "grpc-java-netty/1.44.1";

/// One HTTP/2 connection to the coordinator; cheap to clone (every clone
/// opens streams on the same connection).
#[derive(Clone)]
pub(crate) struct OmegaWire {
    conn: Conn,
    /// The endpoint as given, for errors.
    endpoint: Arc<str>,
    on_tx_event: Bytes,
    on_connected: Bytes,
}

impl OmegaWire {
    /// Connects to `endpoint` (`http://host:port`) and starts the
    /// connection's tasks on the current runtime.
    pub(crate) async fn connect(endpoint: &str) -> Result<Self, String> {
        let origin: Uri = endpoint.parse().map_err(|e| format!("{e}"))?;
        let authority = origin
            .authority()
            .ok_or_else(|| "the endpoint has no host:port".to_owned())?
            .clone();
        let conn = Conn::connect(authority.as_str()).await?;
        let block = |method: &str| {
            request_block(
                authority.as_str(),
                &format!("/{SERVICE}/{method}"),
                // What grpc-java (Omega's transport) sends besides.
                &[("user-agent", USER_AGENT), ("grpc-accept-encoding", "gzip")],
            )
        };
        Ok(Self {
            conn,
            endpoint: Arc::from(endpoint),
            on_tx_event: block("OnTxEvent"),
            on_connected: block("OnConnected"),
        })
    }

    /// The endpoint this connection was opened to.
    pub(crate) fn endpoint(&self) -> &str {
        &self.endpoint
    }

    /// One unary `OnTxEvent` call.
    pub(crate) async fn on_tx_event(&self, event: &GrpcTxEvent) -> Result<GrpcAck, CallError> {
        let answer = self
            .conn
            .unary(&self.on_tx_event, grpc_frame::encode(event))
            .await?;
        GrpcAck::decode(answer).map_err(|e| CallError::Malformed(e.to_string()))
    }

    /// Opens `OnConnected` with `config` and keeps the request stream open
    /// (as Omega does) until the returned [`Commands`] is dropped.
    pub(crate) async fn on_connected(
        &self,
        config: &GrpcServiceConfig,
    ) -> Result<Commands, CallError> {
        let stream = self
            .conn
            .server_stream(&self.on_connected, grpc_frame::encode(config))
            .await?;
        Ok(Commands { stream })
    }
}

/// The compensation commands of one `OnConnected` stream; dropping it
/// resets the stream, which ends the registration.
pub(crate) struct Commands {
    stream: ServerStream,
}

impl Commands {
    /// The next command; `Ok(None)` when the server ended the stream.
    pub(crate) async fn next(&mut self) -> Result<Option<GrpcCompensateCommand>, CallError> {
        match self.stream.next().await? {
            Some(m) => GrpcCompensateCommand::decode(m)
                .map(Some)
                .map_err(|e| CallError::Malformed(e.to_string())),
            None => Ok(None),
        }
    }
}
