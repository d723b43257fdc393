//! Railyard's native `railyard.saga.v1.SagaCoordinator.Session` stream.
//!
//! A session starts with `Hello` (service, instance, optional token, and
//! any further participant instances sharing the session: a process that
//! hosts several services reports for all of them on one stream, so their
//! events share batches); the coordinator answers `Welcome` and registers
//! every participant for compensation commands. Each event says which
//! participant reports it (`SagaEvent.participant`, 0 for the `Hello`'s
//! own; a number the `Hello` did not name gets that event an error), and
//! each `Compensate` which participant must run it. Each `EventBatch` is appended with one `append`
//! call, applied, and answered with `Ack { seq, results }` (one result per
//! event, in order; a malformed event gets its `error` set and is not
//! recorded, the others are).
//!
//! Up to `session_in_flight` batches per session are processed at once, so
//! **acks may go out in a different order than their `seq`**; clients match
//! acks by `seq`. When that many are outstanding the session stops reading
//! frames until one completes (back-pressure through HTTP/2 flow control).
//!
//! The outbound queue (`session_queue` frames) carries acks and
//! `Compensate` commands. Acks wait for room (never dropped); a command
//! that finds the queue full goes to another instance of the service or
//! waits and is retried (see `dispatch`). `TX_COMPENSATED` and
//! `TX_COMPENSATE_FAILED` come back as ordinary events.
//!
//! A store failure ends the session with `UNAVAILABLE` (batches not acked
//! must be resent on a new session); a frame out of protocol (events before
//! `Hello`, a second `Hello`, an empty frame, an oversized batch) ends it
//! with `INVALID_ARGUMENT`. Only that session is affected.

use std::sync::Arc;

use bytes::Bytes;
use railyard_saga_proto::native::saga_coordinator_server::SagaCoordinator;
use railyard_saga_proto::native::{
    client_frame, server_frame, Ack, ClientFrame, EventResult, EventType, Hello, SagaEvent,
    ServerFrame, Welcome,
};
use railyard_saga_proto::{MAX_BATCH_EVENTS_META, MAX_SESSION_PARTICIPANTS, PARTICIPANTS_META};
use tokio::sync::{mpsc, Semaphore};
use tokio_stream::wrappers::ReceiverStream;
use tokio_stream::StreamExt;
use tonic::{Request, Response, Status, Streaming};

use crate::dispatch::Outbound;
use crate::engine::{Engine, InvalidEvent, Outcome};
use crate::event::{EventKind, EventRecord};
use crate::metrics::ProtocolLabels;

/// The `SagaCoordinator` implementation; build it with
/// [`Coordinator::native_service`](crate::Coordinator::native_service).
#[derive(Debug, Clone)]
pub struct NativeService {
    pub(crate) engine: Arc<Engine>,
}

fn kind_of(t: i32) -> Result<EventKind, InvalidEvent> {
    match EventType::try_from(t) {
        Ok(EventType::SagaStarted) => Ok(EventKind::SagaStarted),
        Ok(EventType::TxStarted) => Ok(EventKind::TxStarted),
        Ok(EventType::TxEnded) => Ok(EventKind::TxEnded),
        Ok(EventType::TxAborted) => Ok(EventKind::TxAborted),
        Ok(EventType::TxCompensated) => Ok(EventKind::TxCompensated),
        Ok(EventType::SagaEnded) => Ok(EventKind::SagaEnded),
        Ok(EventType::SagaAborted) => Ok(EventKind::SagaAborted),
        Ok(EventType::TxCompensateFailed) => Ok(EventKind::TxCompensateAckFailed),
        Ok(EventType::Unspecified) | Err(_) => {
            Err(InvalidEvent::UnknownType(format!("native event type {t}")))
        }
    }
}

fn ceil_secs(ms: u32) -> i32 {
    i32::try_from(ms.div_ceil(1000)).unwrap_or(i32::MAX)
}

/// Converts a native event reported by `service`/`instance`.
///
/// Timeouts are kept in whole seconds (rounded up), as Omega's are.
///
/// # Errors
/// [`InvalidEvent::UnknownType`] for an unspecified or unknown type.
pub fn from_native(
    e: SagaEvent,
    service: &Arc<str>,
    instance: &Arc<str>,
) -> Result<EventRecord, InvalidEvent> {
    convert(e, service, instance, Arc::from)
}

/// [`from_native`], the compensation method's copy made by `method`.
fn convert(
    mut e: SagaEvent,
    service: &Arc<str>,
    instance: &Arc<str>,
    method: impl FnOnce(String) -> Arc<str>,
) -> Result<EventRecord, InvalidEvent> {
    let kind = kind_of(e.r#type)?;
    let compensation_method = method(std::mem::take(&mut e.compensation_method));
    Ok(EventRecord {
        global_tx_id: e.global_tx_id,
        local_tx_id: e.local_tx_id,
        parent_tx_id: e.parent_tx_id,
        kind: Some(kind),
        service_name: service.clone(),
        instance_id: instance.clone(),
        compensation_method,
        payloads: Bytes::from(e.payloads),
        timestamp_ms: e.timestamp_ms,
        timeout_s: ceil_secs(e.timeout_ms),
        forward_timeout_s: 0,
        forward_retries: 0,
        reverse_retries: i32::try_from(e.reverse_retries).unwrap_or(i32::MAX),
        reverse_timeout_s: ceil_secs(e.reverse_timeout_ms),
        retry_delay_ms: i32::try_from(e.retry_delay_ms).unwrap_or(i32::MAX),
        retry_method: String::new(),
        attempt: e.attempt,
    })
}

type Tx = mpsc::Sender<Result<ServerFrame, Status>>;

/// A session's participants, by number: `(service, instance)`.
type Participants = Arc<[(Arc<str>, Arc<str>)]>;

/// The participants a `Hello` names, checked: at most
/// [`MAX_SESSION_PARTICIPANTS`], each with a service name, none twice.
///
/// # Errors
/// What is wrong, for an `INVALID_ARGUMENT` that ends the session.
fn participants_of(hello: &Hello) -> Result<Participants, String> {
    let count = 1 + hello.others.len();
    if count > MAX_SESSION_PARTICIPANTS {
        return Err(format!(
            "Hello names {count} participants; a session carries at most {MAX_SESSION_PARTICIPANTS}: open another session for the rest"
        ));
    }
    let all = std::iter::once((&hello.service_name, &hello.instance_id)).chain(
        hello
            .others
            .iter()
            .map(|p| (&p.service_name, &p.instance_id)),
    );
    let mut out: Vec<(Arc<str>, Arc<str>)> = Vec::with_capacity(count);
    for (k, (service, instance)) in all.enumerate() {
        if service.is_empty() {
            return Err(if k == 0 {
                "Hello.service_name is empty; name the participant's service".to_owned()
            } else {
                format!(
                    "Hello.others[{}].service_name is empty; name the participant's service",
                    k - 1
                )
            });
        }
        if out
            .iter()
            .any(|(s, i)| **s == **service && **i == **instance)
        {
            return Err(format!(
                "Hello names service `{service}` instance `{instance}` twice; each participant once per session"
            ));
        }
        out.push((Arc::from(service.as_str()), Arc::from(instance.as_str())));
    }
    Ok(out.into())
}

/// Converts a native event of a session, for the participant it names.
fn participant_event(
    e: SagaEvent,
    participants: &Participants,
    names: &mut Names,
) -> Result<EventRecord, InvalidEvent> {
    let Some((service, instance)) = participants.get(e.participant as usize) else {
        return Err(InvalidEvent::UnknownParticipant {
            index: e.participant,
            count: participants.len(),
        });
    };
    convert(e, service, instance, |m| names.intern(m))
}

/// The most compensation method names a session keeps one copy of, and
/// the longest name it keeps (so a session holds at most 256 KiB of them);
/// other names get a copy per event, freed with their events and sagas.
const SESSION_NAMES: usize = 1024;
const SESSION_NAME_BYTES: usize = 256;

/// A session's compensation method names, one shared copy each: events
/// and sub-transactions point at it instead of a copy per event, and the
/// store's writer numbers it by address, without reading its bytes (which
/// sit in this thread's cache, not the writer's). The empty name (most
/// events') is the session's own copy too, so that its reference count is
/// not one cache line every session and the writer update in turn.
#[derive(Debug)]
struct Names {
    known: std::collections::HashSet<Arc<str>, foldhash::fast::RandomState>,
    empty: Arc<str>,
}

impl Default for Names {
    fn default() -> Self {
        Self {
            known: std::collections::HashSet::default(),
            empty: Arc::from(""),
        }
    }
}

impl Names {
    fn intern(&mut self, name: String) -> Arc<str> {
        if name.is_empty() {
            return self.empty.clone();
        }
        if let Some(known) = self.known.get(name.as_str()) {
            return known.clone();
        }
        let copy: Arc<str> = Arc::from(name);
        if self.known.len() < SESSION_NAMES && copy.len() <= SESSION_NAME_BYTES {
            self.known.insert(copy.clone());
        }
        copy
    }
}

#[tonic::async_trait]
impl SagaCoordinator for NativeService {
    type SessionStream = ReceiverStream<Result<ServerFrame, Status>>;

    async fn session(
        &self,
        request: Request<Streaming<ClientFrame>>,
    ) -> Result<Response<Self::SessionStream>, Status> {
        let inbound = request.into_inner();
        let (tx, rx) = mpsc::channel(self.engine.config.session_queue.max(2));
        tokio::spawn(run_session(self.engine.clone(), inbound, tx));
        Ok(Response::new(ReceiverStream::new(rx)))
    }
}

async fn run_session(engine: Arc<Engine>, mut inbound: Streaming<ClientFrame>, tx: Tx) {
    // The first frame must be Hello.
    let hello = match inbound.next().await {
        Some(Ok(ClientFrame {
            kind: Some(client_frame::Kind::Hello(h)),
        })) => h,
        Some(Ok(_)) => {
            let _ = tx
                .send(Err(Status::invalid_argument(
                    "the first frame of a session must be Hello",
                )))
                .await;
            return;
        }
        Some(Err(status)) => {
            let _ = tx.send(Err(status)).await;
            return;
        }
        None => return,
    };
    let participants = match participants_of(&hello) {
        Ok(p) => p,
        Err(why) => {
            let _ = tx.send(Err(Status::invalid_argument(why))).await;
            return;
        }
    };
    if let Some(token) = engine.config.token.as_deref() {
        if hello.token != token {
            let _ = tx
                .send(Err(Status::unauthenticated(
                    "Hello.token does not match the coordinator's token",
                )))
                .await;
            return;
        }
    }
    let mut meta = crate::omega::server_meta(engine.config.advertise_akka);
    meta.insert(
        PARTICIPANTS_META.to_owned(),
        MAX_SESSION_PARTICIPANTS.to_string(),
    );
    meta.insert(
        MAX_BATCH_EVENTS_META.to_owned(),
        engine.config.max_batch_events.to_string(),
    );
    let welcome = ServerFrame {
        kind: Some(server_frame::Kind::Welcome(Welcome { meta })),
    };
    if tx.send(Ok(welcome)).await.is_err() {
        return;
    }
    // One link per participant, all on this stream; its commands carry the
    // participant's number.
    let links: Vec<crate::dispatch::Registered> = (0u32..)
        .zip(participants.iter())
        .map(|(k, (service, instance))| {
            engine
                .registry
                .register(service, instance, None, Outbound::Native(tx.clone(), k))
        })
        .collect();
    engine.metrics.instances.set(engine.registry.len() as i64);
    let mut services: Vec<&Arc<str>> = participants.iter().map(|(s, _)| s).collect();
    services.sort_unstable();
    services.dedup();
    for service in services {
        engine.instance_arrived(service);
    }
    let in_flight = engine.config.session_in_flight.max(1);
    let slots = Arc::new(Semaphore::new(in_flight));
    // The most a batch takes of the shared byte budget: all of it.
    let room_kib = crate::engine::native_room_kib(&engine.config);
    // Taken once per batch, by that batch's task, to convert its events;
    // never held across an await.
    let names = Arc::new(parking_lot::Mutex::new(Names::default()));
    let closed = engine.closed();
    tokio::pin!(closed);
    loop {
        let frame = tokio::select! {
            f = inbound.next() => f,
            () = tx.closed() => break,
            () = &mut closed => break,
        };
        let batch = match frame {
            Some(Ok(ClientFrame {
                kind: Some(client_frame::Kind::Events(b)),
            })) => b,
            Some(Ok(ClientFrame {
                kind: Some(client_frame::Kind::Hello(_)),
            })) => {
                let _ = tx
                    .send(Err(Status::invalid_argument(
                        "a second Hello on one session; open a new session instead",
                    )))
                    .await;
                break;
            }
            Some(Ok(ClientFrame { kind: None })) => {
                let _ = tx
                    .send(Err(Status::invalid_argument("an empty ClientFrame")))
                    .await;
                break;
            }
            // A frame the decoder refused (too large: `OUT_OF_RANGE`; not
            // protobuf: `INTERNAL`): the client hears why. (After a broken
            // transport nobody reads it.)
            Some(Err(status)) => {
                let _ = tx.send(Err(status)).await;
                break;
            }
            None => break,
        };
        if batch.events.len() > engine.config.max_batch_events {
            let _ = tx
                .send(Err(Status::invalid_argument(format!(
                    "EventBatch of {} events; at most {} per batch",
                    batch.events.len(),
                    engine.config.max_batch_events
                ))))
                .await;
            break;
        }
        // Waits while `session_in_flight` batches are outstanding.
        let Ok(permit) = slots.clone().acquire_owned().await else {
            break;
        };
        // And while the batches of every session hold `native_batch_bytes`.
        let kib = u32::try_from(prost::Message::encoded_len(&batch) / 1024 + 1)
            .unwrap_or(u32::MAX)
            .min(room_kib);
        // Not past the session's end or the server's stop.
        let room = tokio::select! {
            r = engine.native_room.clone().acquire_many_owned(kib) => r,
            () = tx.closed() => break,
            () = &mut closed => break,
        };
        let Ok(room) = room else { break };
        let engine = engine.clone();
        let tx = tx.clone();
        let participants = participants.clone();
        let names = names.clone();
        tokio::spawn(async move {
            let _permit = permit;
            // Ends the session if this task ends without an answer (a bug
            // panicked in it): the client resends its unacknowledged
            // batches on a new session instead of waiting for ever.
            let mut unanswered = Unanswered(Some(tx.clone()));
            let seq = batch.seq;
            // Valid events go to the engine (moved, not copied); the
            // invalid ones keep their error for their slot in the ack.
            let mut valid: Vec<EventRecord> = Vec::with_capacity(batch.events.len());
            let invalid: Vec<Option<InvalidEvent>> = {
                let mut names = names.lock();
                batch
                    .events
                    .into_iter()
                    .map(|e| match participant_event(e, &participants, &mut names) {
                        Ok(ev) => {
                            valid.push(ev);
                            None
                        }
                        Err(e) => Some(e),
                    })
                    .collect()
            };
            let handled = engine.handle(valid, "native").await;
            // The batch's events are in the engine now: its share of the
            // budget goes back before the ack waits for room in this
            // session's queue (a client that does not read its acks holds
            // up only its own session).
            drop(room);
            let outcomes = match handled {
                Ok(o) => o,
                Err(e) => {
                    unanswered.0 = None;
                    let _ = tx.send(Err(Status::unavailable(e.to_string()))).await;
                    return;
                }
            };
            let mut outcomes = outcomes.into_iter();
            let results = invalid
                .into_iter()
                .map(|r| {
                    let o = match r {
                        None => outcomes.next().unwrap_or(Outcome::Done { aborted: false }),
                        Some(e) => Outcome::Invalid(e),
                    };
                    match o {
                        Outcome::Done { aborted } => EventResult {
                            aborted,
                            error: String::new(),
                        },
                        Outcome::Invalid(e) => EventResult {
                            aborted: false,
                            error: e.to_string(),
                        },
                    }
                })
                .collect();
            engine
                .metrics
                .acks
                .get_or_create(&ProtocolLabels { protocol: "native" })
                .inc();
            unanswered.0 = None;
            let _ = tx
                .send(Ok(ServerFrame {
                    kind: Some(server_frame::Kind::Ack(Ack { seq, results })),
                }))
                .await;
        });
    }
    // The batches this session sent are applied before its links go, so a
    // compensation result it carried is not taken for a command left
    // unanswered (which would send that command to another instance).
    // Bounded: a store that does not answer does not keep the links.
    let _ = tokio::time::timeout(
        SESSION_END_WAIT,
        slots.acquire_many(u32::try_from(in_flight).unwrap_or(u32::MAX)),
    )
    .await;
    let ids: Vec<u64> = links.iter().map(|(id, _)| *id).collect();
    engine.registry.unregister_all(&ids);
    engine.links_ended(&links);
}

/// A batch task's guard: dropped while still holding the session's sender
/// (the task panicked before answering), it ends the session with
/// `INTERNAL`, so the client reconnects and resends.
struct Unanswered(Option<Tx>);

impl Drop for Unanswered {
    fn drop(&mut self) {
        if let Some(tx) = self.0.take() {
            tracing::error!("a native batch ended without an answer (a bug); ending its session so the client resends");
            let status = Status::internal(
                "the coordinator failed while handling a batch; reconnect and send it again",
            );
            if let Err(tokio::sync::mpsc::error::TrySendError::Full(frame)) =
                tx.try_send(Err(status))
            {
                if let Ok(rt) = tokio::runtime::Handle::try_current() {
                    rt.spawn(async move {
                        let _ = tx.send(frame).await;
                    });
                }
            }
        }
    }
}

/// How long a session's end waits for its batches in flight to be applied
/// before its links go.
const SESSION_END_WAIT: std::time::Duration = std::time::Duration::from_secs(5);

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_session_keeps_one_copy_of_each_method_name() {
        let mut names = Names::default();
        let a = names.intern("undo-order".to_owned());
        let b = names.intern("undo-order".to_owned());
        assert!(Arc::ptr_eq(&a, &b), "the same name, the same copy");
        let c = names.intern("undo-payment".to_owned());
        assert_eq!(&*c, "undo-payment");
        assert!(!Arc::ptr_eq(&a, &c));
        // The empty name is the session's one copy.
        let e = names.intern(String::new());
        assert!(Arc::ptr_eq(&e, &names.intern(String::new())));
        assert!(e.is_empty());
        // A long name is not kept: a copy each.
        let long = "x".repeat(SESSION_NAME_BYTES + 1);
        assert!(!Arc::ptr_eq(
            &names.intern(long.clone()),
            &names.intern(long.clone())
        ));
        assert!(!names.known.contains(long.as_str()));
        // Past the bound, names still come back right, a copy each.
        for i in 0..SESSION_NAMES * 2 {
            let name = format!("m{i}");
            assert_eq!(&*names.intern(name.clone()), name);
        }
        assert_eq!(names.known.len(), SESSION_NAMES);
        let late = format!("m{}", SESSION_NAMES * 2 - 1);
        assert!(!Arc::ptr_eq(
            &names.intern(late.clone()),
            &names.intern(late)
        ));
    }

    #[test]
    fn converted_events_share_the_session_copy() {
        let participants: Participants = Arc::from(vec![(Arc::from("svc"), Arc::from("i1"))]);
        let mut names = Names::default();
        let event = |m: &str| SagaEvent {
            r#type: EventType::TxStarted as i32,
            global_tx_id: "g".into(),
            local_tx_id: "l".into(),
            compensation_method: m.into(),
            ..SagaEvent::default()
        };
        let one = participant_event(event("undo"), &participants, &mut names).unwrap();
        let two = participant_event(event("undo"), &participants, &mut names).unwrap();
        assert_eq!(&*one.compensation_method, "undo");
        assert!(Arc::ptr_eq(
            &one.compensation_method,
            &two.compensation_method
        ));
        assert!(Arc::ptr_eq(&one.service_name, &two.service_name));
        let unknown = SagaEvent {
            participant: 3,
            ..event("undo")
        };
        assert!(participant_event(unknown, &participants, &mut names).is_err());
    }
}
