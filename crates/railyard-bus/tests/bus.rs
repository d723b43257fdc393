//! Behaviour of the in-process bus: delivery, failures, back-pressure,
//! ordering, interceptors, codecs, metrics. No timing assertions: timeouts use
//! tokio's paused clock.

use std::sync::{Arc, Mutex};
use std::time::Duration;

use bytes::{Bytes, BytesMut};
use futures::StreamExt;
use railyard_bus::*;
use tokio::sync::mpsc;

mod common;

/// A consumer at `addr` that replies with the `u64` body plus one.
async fn adder(bus: &EventBus, addr: &str) -> Consumer {
    bus.consumer(addr)
        .handler(|mut m| async move {
            let v = *m.body::<u64>().expect("u64 body");
            m.reply(v + 1).expect("a request can be answered");
        })
        .await
        .unwrap()
}

#[tokio::test]
async fn request_gets_the_reply() {
    let bus = EventBus::new();
    let _c = adder(&bus, "add").await;
    let reply = bus.request("add", 41u64).await.unwrap();
    assert_eq!(reply.body::<u64>(), Some(&42));
    assert!(!reply.expects_reply());
}

#[tokio::test]
async fn no_handlers_for_send_and_request() {
    let bus = EventBus::new();
    let e = bus.send("nobody", String::from("lost?")).unwrap_err();
    assert_eq!(e.kind(), FailureKind::NoHandlers);
    // The body comes back: nothing is lost.
    assert_eq!(
        e.into_body().downcast_ref::<String>().map(String::as_str),
        Some("lost?")
    );
    let e = bus.request("nobody", 1u64).await.unwrap_err();
    assert_eq!(
        e,
        BusError::NoHandlers {
            address: "nobody".into()
        }
    );
    assert_eq!(bus.metrics().reply_failures(FailureKind::NoHandlers), 1);
}

#[tokio::test]
async fn recipient_failure_carries_code_and_message() {
    let bus = EventBus::new();
    let _c = bus
        .consumer("fails")
        .handler(|mut m| async move {
            m.fail(418, "teapot").unwrap();
        })
        .await
        .unwrap();
    let e = bus.request("fails", ()).await.unwrap_err();
    assert_eq!(e.kind(), FailureKind::RecipientFailure);
    assert_eq!(e.failure_code(), Some(418));
    assert_eq!(
        e,
        BusError::RecipientFailure {
            code: 418,
            message: "teapot".into()
        }
    );
    assert_eq!(
        bus.metrics().reply_failures(FailureKind::RecipientFailure),
        1
    );
}

/// A consumer that keeps every message (so requests stay unanswered).
async fn hoarder(bus: &EventBus, addr: &str) -> (Consumer, Arc<Mutex<Vec<Message>>>) {
    let kept = Arc::new(Mutex::new(Vec::new()));
    let k = kept.clone();
    let c = bus
        .consumer(addr)
        .handler(move |m| {
            let k = k.clone();
            async move { k.lock().unwrap().push(m) }
        })
        .await
        .unwrap();
    (c, kept)
}

#[tokio::test(start_paused = true)]
async fn request_times_out_after_its_timeout() {
    let bus = EventBus::new();
    let (_c, kept) = hoarder(&bus, "slow").await;
    let start = tokio::time::Instant::now();
    let opts = DeliveryOptions::new().timeout(Duration::from_secs(5));
    let e = bus.request_with("slow", 1u64, &opts).await.unwrap_err();
    assert_eq!(
        e,
        BusError::Timeout {
            after: Duration::from_secs(5)
        }
    );
    assert!(start.elapsed() >= Duration::from_secs(5));
    assert_eq!(kept.lock().unwrap().len(), 1);
    assert_eq!(bus.metrics().reply_failures(FailureKind::Timeout), 1);
    assert_eq!(bus.metrics().pending_replies, 0);
}

#[tokio::test(start_paused = true)]
async fn default_timeout_is_thirty_seconds() {
    let bus = EventBus::new();
    let (_c, _kept) = hoarder(&bus, "slow").await;
    // Not yet at 29 s...
    let early = tokio::time::timeout(Duration::from_secs(29), bus.request("slow", 1u64)).await;
    assert!(early.is_err(), "the request must still be waiting at 29 s");
    // ...and a fresh one fails at 30 s.
    let start = tokio::time::Instant::now();
    let e = bus.request("slow", 2u64).await.unwrap_err();
    assert_eq!(
        e,
        BusError::Timeout {
            after: DEFAULT_TIMEOUT
        }
    );
    assert_eq!(DEFAULT_TIMEOUT, Duration::from_secs(30));
    assert!(start.elapsed() >= Duration::from_secs(30));
}

#[tokio::test]
async fn dropping_a_request_fails_it_at_once_with_error_kind() {
    let bus = EventBus::new();
    let _c = bus.consumer("drop").handler(|_m| async {}).await.unwrap();
    let e = bus.request("drop", 1u64).await.unwrap_err();
    assert_eq!(e, BusError::NoReply);
    assert_eq!(e.kind(), FailureKind::Error);
    assert_eq!(bus.metrics().reply_failures(FailureKind::Error), 1);
}

#[tokio::test]
async fn panicking_handler_fails_that_request_and_keeps_consuming() {
    let bus = EventBus::new();
    let _c = bus
        .consumer("fragile")
        .handler(|mut m| async move {
            let v = *m.body::<u64>().unwrap();
            assert!(v != 13, "unlucky number");
            m.reply(v).unwrap();
        })
        .await
        .unwrap();
    assert_eq!(
        bus.request("fragile", 13u64).await.unwrap_err(),
        BusError::NoReply
    );
    assert_eq!(
        bus.request("fragile", 7u64).await.unwrap().body::<u64>(),
        Some(&7)
    );
}

#[tokio::test]
async fn replying_twice_or_to_a_send_is_refused() {
    let bus = EventBus::new();
    let (tx, mut rx) = mpsc::unbounded_channel();
    let _c = bus
        .consumer("twice")
        .handler(move |mut m| {
            let tx = tx.clone();
            async move {
                let first = m.reply(1u8);
                let second = m.reply(2u8);
                tx.send((m.is_send(), first, second)).unwrap();
            }
        })
        .await
        .unwrap();
    bus.send("twice", ()).unwrap();
    let (is_send, first, _) = rx.recv().await.unwrap();
    assert!(is_send);
    assert_eq!(first, Err(BusError::NotReplyable));
    let reply = bus.request("twice", ()).await.unwrap();
    assert_eq!(reply.body::<u8>(), Some(&1));
    let (_, first, second) = rx.recv().await.unwrap();
    assert_eq!(first, Ok(()));
    assert_eq!(second, Err(BusError::NotReplyable));
}

#[tokio::test]
async fn request_chains_reply_to_a_reply() {
    let bus = EventBus::new();
    let (tx, mut rx) = mpsc::unbounded_channel();
    let _c = bus
        .consumer("chain")
        .handler(move |mut m| {
            let tx = tx.clone();
            async move {
                let v = *m.body::<u64>().unwrap();
                let next = m
                    .reply_and_request(v * 10, &DeliveryOptions::new())
                    .unwrap()
                    .await
                    .unwrap();
                tx.send(*next.body::<u64>().unwrap()).unwrap();
            }
        })
        .await
        .unwrap();
    let mut reply = bus.request("chain", 4u64).await.unwrap();
    assert_eq!(reply.body::<u64>(), Some(&40));
    assert!(reply.expects_reply());
    reply.reply(41u64).unwrap();
    assert_eq!(rx.recv().await, Some(41));
}

#[tokio::test]
async fn send_round_robins_fairly() {
    common::send_round_robins_fairly(&EventBus::new()).await;
}

#[tokio::test]
async fn publish_reaches_every_consumer_with_the_same_body() {
    let bus = EventBus::new();
    let mut streams = vec![];
    for _ in 0..3 {
        streams.push(bus.consumer("news").stream().await.unwrap());
    }
    let body = Arc::new(String::from("shared"));
    let report = bus.publish("news", Body::from_arc(body.clone())).unwrap();
    assert_eq!(
        report,
        PublishReport {
            delivered: 3,
            skipped_full: 0
        }
    );
    for s in &mut streams {
        let m = s.next().await.unwrap();
        assert!(!m.is_send());
        // By reference: the very same allocation, not a copy.
        assert!(std::ptr::eq(m.body::<String>().unwrap(), &*body));
    }
    assert_eq!(bus.publish("nobody", 1u8).unwrap().delivered, 0);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn one_senders_messages_arrive_in_order() {
    let bus = EventBus::new();
    let mut a = bus
        .consumer("ordered")
        .capacity(100_000)
        .stream()
        .await
        .unwrap();
    let mut b = bus
        .local_consumer("ordered")
        .capacity(100_000)
        .stream()
        .await
        .unwrap();
    let sender = {
        let bus = bus.clone();
        tokio::spawn(async move {
            for i in 0..20_000u64 {
                bus.send("ordered", i).unwrap();
            }
        })
    };
    sender.await.unwrap();
    for s in [&mut a, &mut b] {
        let mut last = None;
        for _ in 0..10_000 {
            let v = *s.next().await.unwrap().body::<u64>().unwrap();
            assert!(last.is_none_or(|l| v > l), "{v} after {last:?}");
            last = Some(v);
        }
    }
}

#[tokio::test]
async fn full_buffer_refuses_send_and_hands_the_body_back() {
    let bus = EventBus::new();
    let c = bus
        .consumer("tiny")
        .capacity(4)
        .paused()
        .handler(|_m| async {})
        .await
        .unwrap();
    for i in 0..4u64 {
        bus.send("tiny", i).unwrap();
    }
    let e = bus.send("tiny", 99u64).unwrap_err();
    assert_eq!(
        e.error,
        BusError::Full {
            address: "tiny".into()
        }
    );
    assert_eq!(e.into_body().downcast_ref::<u64>(), Some(&99));
    let stats = c.stats();
    assert_eq!(
        (stats.received, stats.buffered, stats.refused_full),
        (4, 4, 1)
    );
    // Publish skips the full consumer and says so.
    assert_eq!(
        bus.publish("tiny", 0u64).unwrap(),
        PublishReport {
            delivered: 0,
            skipped_full: 1
        }
    );
    assert_eq!(bus.metrics().discarded(), 2);
}

#[tokio::test]
async fn pause_fetch_resume_control_delivery() {
    common::pause_fetch_resume_control_delivery(&EventBus::new()).await;
}

#[tokio::test]
async fn send_wait_and_request_wait_for_room() {
    let bus = EventBus::new();
    let c = bus
        .consumer("narrow")
        .capacity(1)
        .paused()
        .handler(|mut m| async move {
            if m.expects_reply() {
                let _ = m.reply(());
            }
        })
        .await
        .unwrap();
    bus.send("narrow", 0u8).unwrap();
    let mut req = bus.request("narrow", 1u8);
    assert!(!req.is_enqueued(), "the buffer is full");
    let waiting_send = {
        let bus = bus.clone();
        tokio::spawn(async move { bus.send_wait("narrow", 2u8, &DeliveryOptions::new()).await })
    };
    c.resume();
    req.enqueued().await;
    assert!(req.is_enqueued());
    req.await.unwrap();
    waiting_send.await.unwrap().unwrap();
    while c.stats().delivered < 3 {
        tokio::task::yield_now().await;
    }
}

/// `send_moving_headers` delivers the options' headers (leaving the options
/// without them), gives them back untouched when the send is refused, and
/// with an interceptor registered clones them as `send_with` does.
#[tokio::test]
async fn sending_with_moved_headers_gives_them_back_on_refusal() {
    struct Stamp;
    impl Interceptor for Stamp {
        fn outbound(&self, msg: &mut Outbound<'_>) -> Verdict {
            msg.headers.add("stamped", "yes");
            Verdict::Continue
        }
    }
    let bus = EventBus::new();
    let (tx, mut rx) = mpsc::unbounded_channel();
    let c = bus
        .consumer("seen")
        .capacity(1)
        .paused()
        .handler(move |m| {
            let h: Vec<(String, String)> = m
                .headers()
                .iter()
                .map(|(k, v)| (k.to_owned(), v.to_owned()))
                .collect();
            tx.send(h).unwrap();
            async {}
        })
        .await
        .unwrap();
    let headers = |o: &DeliveryOptions| {
        o.headers
            .iter()
            .map(|(k, v)| (k.to_owned(), v.to_owned()))
            .collect::<Vec<_>>()
    };
    let pair = |k: &str, v: &str| (k.to_owned(), v.to_owned());

    let mut opts = DeliveryOptions::new().header("a", "1");
    bus.send_moving_headers("seen", Body::new(1u64), &mut opts)
        .unwrap();
    assert!(opts.headers.is_empty(), "moved into the message");
    // Refused: no consumer, then a full buffer (capacity 1, paused).
    let mut opts = DeliveryOptions::new().header("b", "2");
    let e = bus
        .send_moving_headers("nobody", Body::new(2u64), &mut opts)
        .unwrap_err();
    assert!(matches!(e.error, BusError::NoHandlers { .. }));
    assert_eq!(headers(&opts), [pair("b", "2")]);
    let e = bus
        .send_moving_headers("seen", Body::new(3u64), &mut opts)
        .unwrap_err();
    assert!(matches!(e.error, BusError::Full { .. }));
    assert_eq!(headers(&opts), [pair("b", "2")]);

    // With an interceptor: the headers are cloned, so the options come back
    // unstamped.
    bus.add_interceptor(Arc::new(Stamp));
    let e = bus
        .send_moving_headers("seen", Body::new(4u64), &mut opts)
        .unwrap_err();
    assert!(matches!(e.error, BusError::Full { .. }));
    assert_eq!(headers(&opts), [pair("b", "2")]);

    c.resume();
    let got = tokio::time::timeout(Duration::from_secs(5), rx.recv())
        .await
        .unwrap()
        .unwrap();
    assert_eq!(got, [pair("a", "1")]);
    // Delivered with an interceptor: it ran on the message's own copy, and
    // the options keep theirs (a move would have skipped the interceptor).
    bus.send_moving_headers("seen", Body::new(5u64), &mut opts)
        .unwrap();
    assert_eq!(headers(&opts), [pair("b", "2")], "cloned, not moved");
    let got = tokio::time::timeout(Duration::from_secs(5), rx.recv())
        .await
        .unwrap()
        .unwrap();
    assert_eq!(got, [pair("b", "2"), pair("stamped", "yes")]);
}

/// An inbound interceptor that panics vetoes that message; the consumer
/// goes on with the next ones (the panic no longer ends its task), and a
/// request with an unbounded timeout (`Duration::MAX`, "no timeout") works.
#[tokio::test]
async fn a_panicking_inbound_interceptor_vetoes_one_message_and_the_consumer_goes_on() {
    struct Fragile;
    impl Interceptor for Fragile {
        fn inbound(&self, msg: &mut Message) -> Verdict {
            assert!(msg.body::<u64>() != Some(&13), "cannot stand 13");
            Verdict::Continue
        }
    }
    let bus = EventBus::new();
    let _c = bus
        .consumer("fragile")
        .handler(|mut m| async move {
            let n = *m.body::<u64>().unwrap();
            m.reply(n + 1).unwrap();
        })
        .await
        .unwrap();
    bus.add_interceptor(Arc::new(Fragile));
    let e = bus.request("fragile", 13u64).await.unwrap_err();
    assert!(
        matches!(&e, BusError::Rejected { reason } if reason.contains("panicked")),
        "{e:?}"
    );
    let no_timeout = DeliveryOptions::new().timeout(Duration::MAX);
    let reply = bus
        .request_with("fragile", 1u64, &no_timeout)
        .await
        .expect("the consumer is still there");
    assert_eq!(reply.body::<u64>(), Some(&2));
}

#[tokio::test]
async fn interceptors_see_rewrite_and_veto() {
    struct Stamp;
    impl Interceptor for Stamp {
        fn outbound(&self, msg: &mut Outbound<'_>) -> Verdict {
            if msg.address == "forbidden" {
                return Verdict::Reject("forbidden address".into());
            }
            msg.headers.add("stamped", format!("{:?}", msg.kind));
            Verdict::Continue
        }
        fn inbound(&self, msg: &mut Message) -> Verdict {
            if msg.body::<u64>() == Some(&13) {
                Verdict::Reject("unlucky".into())
            } else {
                Verdict::Continue
            }
        }
    }
    let bus = EventBus::new();
    let c = bus
        .consumer("seen")
        .handler(|mut m| async move {
            let stamps = m.headers().get_all("STAMPED").collect::<Vec<_>>().join(",");
            m.reply(stamps).unwrap();
        })
        .await
        .unwrap();
    let _f = bus
        .consumer("forbidden")
        .handler(|_m| async {})
        .await
        .unwrap();
    let id = bus.add_interceptor(Arc::new(Stamp));

    let reply = bus.request("seen", 1u64).await.unwrap();
    assert_eq!(reply.body::<String>().map(String::as_str), Some("Request"));
    assert_eq!(reply.headers().get("stamped"), Some("Reply"));

    let e = bus.send("forbidden", 1u64).unwrap_err();
    assert_eq!(
        e.error,
        BusError::Rejected {
            reason: "forbidden address".into()
        }
    );

    let e = bus.request("seen", 13u64).await.unwrap_err();
    assert_eq!(
        e,
        BusError::Rejected {
            reason: "unlucky".into()
        }
    );
    assert_eq!(c.stats().discarded, 1);

    assert!(bus.remove_interceptor(id));
    assert!(!bus.remove_interceptor(id));
    let reply = bus.request("seen", 13u64).await.unwrap();
    assert_eq!(reply.body::<String>().map(String::as_str), Some(""));
}

#[tokio::test]
async fn headers_travel_multi_valued_and_case_insensitive() {
    let bus = EventBus::new();
    let mut s = bus.consumer("h").stream().await.unwrap();
    let opts = DeliveryOptions::new()
        .header("Trace", "a")
        .header("trace", "b");
    bus.send_with("h", (), &opts).unwrap();
    let m = s.next().await.unwrap();
    assert_eq!(m.headers().get_all("TRACE").collect::<Vec<_>>(), ["a", "b"]);
}

#[tokio::test]
async fn unknown_codec_and_empty_address_are_typed_errors() {
    let bus = EventBus::new();
    let _c = adder(&bus, "a").await;
    let e = bus
        .send_with("a", 1u64, &DeliveryOptions::new().codec("nope"))
        .unwrap_err();
    assert_eq!(
        e.error,
        BusError::UnknownCodec {
            name: "nope".into()
        }
    );
    assert_eq!(
        bus.send("", 1u64).unwrap_err().error,
        BusError::InvalidAddress {
            address: String::new()
        }
    );
    assert!(matches!(
        bus.consumer("").handler(|_m| async {}).await,
        Err(BusError::InvalidAddress { .. })
    ));
    // A known codec is accepted (and unused on a local hop).
    let reply = bus
        .request_with("a", 1u64, &DeliveryOptions::new().codec("json"))
        .await
        .unwrap();
    assert_eq!(reply.body::<u64>(), Some(&2));
}

#[tokio::test]
async fn stream_drop_unregisters_and_fails_buffered_requests() {
    let bus = EventBus::new();
    // An unpolled stream keeps its messages buffered.
    let s = bus.consumer("s").stream().await.unwrap();
    let pending = bus.request("s", 1u64);
    drop(s);
    assert_eq!(
        pending.await.unwrap_err(),
        BusError::NoHandlers {
            address: "s".into()
        }
    );
    assert_eq!(bus.consumer_count("s"), 0);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn unregister_under_load_answers_every_request() {
    let bus = EventBus::new();
    let keep = adder(&bus, "busy").await;
    let goes = adder(&bus, "busy").await;
    let mut tasks = vec![];
    for t in 0..4u64 {
        let bus = bus.clone();
        tasks.push(tokio::spawn(async move {
            let mut ok = 0;
            for i in 0..5_000u64 {
                match bus.request("busy", t * 10_000 + i).await {
                    Ok(m) => {
                        assert_eq!(m.body::<u64>(), Some(&(t * 10_000 + i + 1)));
                        ok += 1;
                    }
                    Err(e) => assert_eq!(e.kind(), FailureKind::NoHandlers, "{e}"),
                }
            }
            ok
        }));
    }
    tokio::task::yield_now().await;
    goes.unregister().await;
    let mut ok = 0;
    for t in tasks {
        ok += tokio::time::timeout(Duration::from_secs(60), t)
            .await
            .expect("no request hangs")
            .unwrap();
    }
    assert!(ok > 0);
    assert_eq!(bus.consumer_count("busy"), 1);
    assert_eq!(bus.metrics().pending_replies, 0);
    keep.unregister().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn many_concurrent_requesters_all_get_their_own_reply() {
    let bus = EventBus::new();
    let mut consumers = vec![];
    for _ in 0..3 {
        consumers.push(adder(&bus, "sum").await);
    }
    let mut tasks = vec![];
    for t in 0..16u64 {
        let bus = bus.clone();
        tasks.push(tokio::spawn(async move {
            for i in 0..2_000u64 {
                let v = t * 1_000_000 + i;
                let r = bus.request("sum", v).await.unwrap();
                assert_eq!(r.body::<u64>(), Some(&(v + 1)));
            }
        }));
    }
    for t in tasks {
        t.await.unwrap();
    }
    let m = bus.metrics();
    assert_eq!(m.requests, 32_000);
    assert_eq!(m.sent, 32_000);
    assert_eq!(m.received(), 32_000);
    assert_eq!(m.delivered(), 32_000);
    assert_eq!(m.pending_replies, 0);
    assert_eq!(m.pending(), 0);
    assert_eq!(m.registered_consumers, 3);
    assert_eq!(m.reply_failures, [0; 4]);
}

/// A user codec: sends strings upper-cased, decodes them as they came. Only
/// `encode`, so its `encode_into` is the trait's default.
struct Upper;
impl MessageCodec for Upper {
    fn name(&self) -> &str {
        "upper"
    }
    fn encode(&self, body: &Body) -> Result<Bytes, CodecError> {
        let s = body
            .downcast_ref::<String>()
            .ok_or(CodecError::NoDefault("?"))?;
        Ok(Bytes::from(s.to_uppercase()))
    }
    fn decode(&self, bytes: Bytes) -> Result<Body, CodecError> {
        Ok(Body::new(String::from_utf8_lossy(&bytes).into_owned()))
    }
}

/// A transport's codec cache answers as the registry does, and sees codecs
/// registered and defaults changed after it was made.
#[test]
fn codec_cache_follows_the_registry() {
    let bus = EventBus::new();
    let mut cache = bus.codec_cache();
    let hello = Body::new(String::from("hello"));

    let (name, bytes) = cache.encode(&hello, None).unwrap();
    assert_eq!((name, &bytes[..]), ("string", &b"hello"[..]));
    // Twice: the second answer comes from the cache.
    let (name, bytes) = cache.encode(&hello, None).unwrap();
    assert_eq!((name, &bytes[..]), ("string", &b"hello"[..]));
    assert!(matches!(
        cache.decode("upper", Bytes::from_static(b"X")),
        Err(CodecError::Unknown(n)) if n == "upper"
    ));
    assert!(matches!(
        cache.encode(&hello, Some("upper")),
        Err(CodecError::Unknown(n)) if n == "upper"
    ));

    bus.register_codec(Arc::new(Upper)).unwrap();
    let (name, bytes) = cache.encode(&hello, Some("upper")).unwrap();
    assert_eq!((name, &bytes[..]), ("upper", &b"HELLO"[..]));
    let back = cache.decode("upper", bytes).unwrap();
    assert_eq!(back.downcast_ref::<String>().unwrap(), "HELLO");
    // Still the old default until it changes...
    assert_eq!(cache.encode(&hello, None).unwrap().0, "string");
    bus.set_default_codec::<String>("upper").unwrap();
    // ...and the new one right after.
    let (name, bytes) = cache.encode(&hello, None).unwrap();
    assert_eq!((name, &bytes[..]), ("upper", &b"HELLO"[..]));

    // A body of another type, and the empty body, as the registry answers.
    assert_eq!(cache.encode(&Body::new(7u64), None).unwrap().0, "u64");
    assert!(matches!(
        cache.encode(&Body::new(1u32), None),
        Err(CodecError::NoDefault(_))
    ));
    let (name, bytes) = cache.encode(&Body::default(), None).unwrap();
    assert!(name.is_empty() && bytes.is_empty());
    assert!(cache.decode("", Bytes::new()).unwrap().is_empty());
    // The same answers from a new cache.
    let mut fresh = bus.codec_cache();
    assert_eq!(fresh.encode(&hello, None).unwrap().0, "upper");
}

/// `encode_into` writes the head, then the very bytes `encode` gives, with
/// the same codec, for every built-in codec, a codec that only has
/// `encode`, and the empty body; a failure is the same error.
#[test]
fn encoding_into_a_buffer_gives_what_encode_gives() {
    // `Upper` has only `encode`: its `encode_into` is the trait's default.
    let bus = EventBus::new();
    bus.register_codec(Arc::new(Upper)).unwrap();
    let mut cache = bus.codec_cache();
    let cases: Vec<(Body, Option<&str>)> = vec![
        (Body::new(String::from("héllo")), None),
        (Body::new("static"), None),
        (Body::new(Bytes::from_static(b"\x00\x01")), None),
        (Body::new(vec![9u8, 8, 7]), None),
        (Body::new(u64::MAX - 3), None),
        (Body::new(-5i64), None),
        (Body::new(serde_json::json!({"a": [1, 2]})), None),
        (Body::new(String::from("abc")), Some("upper")),
        (Body::new(serde_json::json!("as json")), Some("json")),
        (Body::default(), None),
    ];
    for (body, codec) in &cases {
        let (name, bytes) = cache
            .encode(body, *codec)
            .map(|(n, b)| (n.to_owned(), b))
            .unwrap_or_else(|e| panic!("{body:?}: {e}"));
        let mut out = BytesMut::from(&b"head:"[..]);
        let mut head = None;
        cache
            .encode_into(body, *codec, &mut out, |out, n| {
                head = Some(n.to_owned());
                out.extend_from_slice(b"|");
            })
            .unwrap();
        assert_eq!(head.as_deref(), Some(name.as_str()), "{body:?}");
        assert_eq!(&out[..6], b"head:|");
        assert_eq!(&out[6..], &bytes[..], "{body:?} with {name}");
    }
    // Failures: a type without a default, an unknown codec, the codec's own.
    for (body, codec) in [
        (Body::new(1u32), None),
        (Body::new(String::from("x")), Some("nope")),
        (Body::new(7u64), Some("string")),
    ] {
        let want = cache.encode(&body, codec).unwrap_err().to_string();
        let got = cache
            .encode_into(&body, codec, &mut BytesMut::new(), |_, _| {})
            .unwrap_err()
            .to_string();
        assert_eq!(got, want);
    }
}

#[test]
fn utf8_checks_answer_as_the_standard_ones_on_ascii_multibyte_and_invalid_bytes() {
    let cases: [&[u8]; 8] = [
        b"",
        b"echo",
        b"__railyard.reply.0123456789abcdef",
        "héllo wörld, plus forty more ascii bytes after it".as_bytes(),
        b"\xff",
        b"twenty ascii bytes..\xc3",
        b"an address\x80with a stray continuation byte",
        b"\xed\xa0\x80 (a surrogate)",
    ];
    for bytes in cases {
        assert_eq!(
            str_from_utf8(bytes),
            std::str::from_utf8(bytes),
            "{bytes:?}"
        );
        assert_eq!(
            string_from_utf8(bytes.to_vec()).map_err(|e| e.utf8_error()),
            String::from_utf8(bytes.to_vec()).map_err(|e| e.utf8_error()),
            "{bytes:?}"
        );
    }
    let err = StringCodec
        .decode(Bytes::from_static(b"abc\xff"))
        .unwrap_err();
    assert!(matches!(err, CodecError::Malformed { .. }), "{err:?}");
}

#[test]
fn codecs_round_trip_builtin_and_user_types() {
    #[derive(Debug, PartialEq, serde::Serialize, serde::Deserialize)]
    struct Order {
        id: u32,
        item: String,
    }
    let bus = EventBus::new();
    bus.register_codec(Arc::new(JsonCodec::<Order>::new("order")))
        .unwrap();
    assert_eq!(
        bus.register_codec(Arc::new(StringCodec)),
        Err(CodecError::Duplicate("string".into()))
    );
    bus.set_default_codec::<Order>("order").unwrap();
    let codecs = bus.codecs();

    let (name, bytes) = codecs
        .encode(&Body::new(String::from("héllo")), None)
        .unwrap();
    assert_eq!((&*name, &bytes[..]), ("string", "héllo".as_bytes()));
    assert_eq!(
        codecs
            .decode("string", bytes)
            .unwrap()
            .downcast_ref::<String>()
            .unwrap(),
        "héllo"
    );

    let (name, bytes) = codecs
        .encode(&Body::new(Bytes::from_static(b"\x00\x01")), None)
        .unwrap();
    assert_eq!(&*name, "bytes");
    assert_eq!(
        codecs
            .decode("bytes", bytes)
            .unwrap()
            .downcast_ref::<Bytes>()
            .unwrap(),
        &b"\x00\x01"[..]
    );

    let json = serde_json::json!({"a": [1, 2]});
    let (name, bytes) = codecs.encode(&Body::new(json.clone()), None).unwrap();
    assert_eq!(&*name, "json");
    assert_eq!(
        codecs
            .decode("json", bytes)
            .unwrap()
            .downcast_ref::<serde_json::Value>(),
        Some(&json)
    );

    let order = Order {
        id: 7,
        item: "tea".into(),
    };
    let (name, bytes) = codecs
        .encode(
            &Body::new(Order {
                id: 7,
                item: "tea".into(),
            }),
            None,
        )
        .unwrap();
    assert_eq!(&*name, "order");
    assert_eq!(
        codecs
            .decode("order", bytes)
            .unwrap()
            .downcast_ref::<Order>(),
        Some(&order)
    );

    assert!(matches!(
        codecs.encode(&Body::new(1u32), None),
        Err(CodecError::NoDefault(_))
    ));
    for (v, name) in [(Body::new(7u64), "u64"), (Body::new(-7i64), "i64")] {
        let (codec, bytes) = codecs.encode(&v, None).unwrap();
        assert_eq!(&*codec, name);
        let back = codecs.decode(name, bytes).unwrap();
        assert_eq!(back.type_name(), v.type_name());
    }
    assert_eq!(
        *codecs
            .decode("i64", Bytes::from_static(&[0xff; 8]))
            .unwrap()
            .downcast_ref::<i64>()
            .unwrap(),
        -1
    );
    assert!(codecs.decode("u64", Bytes::from_static(b"short")).is_err());
    assert!(matches!(
        codecs.encode(&Body::new(1u64), Some("string")),
        Err(CodecError::WrongType { .. })
    ));
    assert!(matches!(
        codecs.decode("string", Bytes::from_static(b"\xff")),
        Err(CodecError::Malformed { .. })
    ));
    assert!(matches!(
        codecs.decode("order", Bytes::from_static(b"{")),
        Err(CodecError::Malformed { .. })
    ));
    assert_eq!(
        codecs.decode("zip", Bytes::new()).unwrap_err(),
        CodecError::Unknown("zip".into())
    );
}

#[test]
fn public_types_are_send_and_sync() {
    fn send_sync<T: Send + Sync>() {}
    fn send<T: Send>() {}
    send_sync::<EventBus>();
    send_sync::<Message>();
    send_sync::<Body>();
    send_sync::<Headers>();
    send_sync::<DeliveryOptions>();
    send_sync::<BusError>();
    send_sync::<SendError>();
    send_sync::<Consumer>();
    send_sync::<MessageStream>();
    send_sync::<CodecRegistry>();
    send_sync::<MetricsSnapshot>();
    send::<PendingReply<'static>>();
}

#[tokio::test(start_paused = true)]
async fn request_blocked_on_a_full_buffer_times_out() {
    let bus = EventBus::new();
    let c = bus
        .consumer("stuck")
        .capacity(1)
        .paused()
        .handler(|_m| async {})
        .await
        .unwrap();
    bus.send("stuck", 0u8).unwrap();
    let opts = DeliveryOptions::new().timeout(Duration::from_secs(2));
    let mut req = bus.request_with("stuck", 1u8, &opts);
    assert!(!req.is_enqueued());
    req.enqueued().await;
    assert!(
        req.is_enqueued(),
        "a timed-out request is no longer blocked"
    );
    assert_eq!(
        req.await.unwrap_err(),
        BusError::Timeout {
            after: Duration::from_secs(2)
        }
    );
    assert_eq!(
        c.stats().received,
        1,
        "the blocked request never entered the buffer"
    );
    assert_eq!(bus.metrics().reply_failures(FailureKind::Timeout), 1);
    assert_eq!(bus.metrics().pending_replies, 0);
}

// ---- the cluster's side door -------------------------------------------------

mod remote {
    use std::sync::{Arc, Mutex};

    use railyard_bus::{
        BusError, ClusterHook, DeliveryOptions, EventBus, RemoteKind, RemoteMessage, RemoteNode,
        Undelivered,
    };

    /// A node link that records what it was given and answers requests.
    #[derive(Debug, Default)]
    struct Recorder {
        got: Mutex<Vec<(String, RemoteKind)>>,
        refuse: bool,
        /// Calls of `deliver`, taken or refused.
        asked: std::sync::atomic::AtomicUsize,
    }

    impl RemoteNode for Recorder {
        fn id(&self) -> &str {
            "recorder"
        }
        fn deliver(&self, mut msg: RemoteMessage) -> Result<(), Box<Undelivered>> {
            self.asked
                .fetch_add(1, std::sync::atomic::Ordering::Relaxed);
            if self.refuse {
                return Err(Box::new(Undelivered {
                    error: BusError::Full {
                        address: msg.address.to_string(),
                    },
                    message: msg,
                }));
            }
            self.got
                .lock()
                .unwrap()
                .push((msg.address.to_string(), msg.kind));
            if let Some(reply) = msg.reply.take() {
                reply.reply(msg.headers.clone(), msg.body);
            }
            Ok(())
        }
    }

    /// A link that fails a request's handle (its peer was lost) and then
    /// hands the message back without it.
    #[derive(Debug)]
    struct LostPeer;

    impl RemoteNode for LostPeer {
        fn id(&self) -> &str {
            "lost"
        }
        fn deliver(&self, mut msg: RemoteMessage) -> Result<(), Box<Undelivered>> {
            if let Some(reply) = msg.reply.take() {
                reply.fail(BusError::Cluster {
                    reason: "peer lost".into(),
                });
            }
            Err(Box::new(Undelivered {
                error: BusError::NoHandlers {
                    address: msg.address.to_string(),
                },
                message: msg,
            }))
        }
    }

    /// A request the link already failed is not routed on to another
    /// consumer as a send nobody can answer (it would run twice if the
    /// requester retried).
    #[tokio::test]
    async fn a_request_the_link_already_failed_is_not_delivered_again() {
        let bus = EventBus::new();
        let mut local = bus.consumer("r").stream().await.unwrap();
        bus.set_remote_nodes("r", vec![Arc::new(LostPeer) as Arc<dyn RemoteNode>]);
        // Round-robin over the local consumer (which never answers) and the
        // lost peer: each request either meets the peer first and fails
        // there, or reaches the local consumer and times out.
        let quick = DeliveryOptions::new().timeout(std::time::Duration::from_millis(100));
        let mut failed_at_peer = 0;
        for i in 0..4u8 {
            match bus.request_with("r", i, &quick).await {
                Err(BusError::Cluster { .. }) => failed_at_peer += 1,
                Err(BusError::Timeout { .. }) => {}
                other => panic!("unexpected {other:?}"),
            }
        }
        assert!(failed_at_peer >= 1, "the peer took some");
        use futures::StreamExt;
        let mut got = 0;
        while let Ok(Some(m)) =
            tokio::time::timeout(std::time::Duration::from_millis(50), local.next()).await
        {
            assert!(
                m.expects_reply(),
                "a request the peer failed reached the local consumer as a bare send"
            );
            got += 1;
        }
        assert_eq!(got + failed_at_peer, 4, "each request went one way only");
    }

    #[derive(Default)]
    struct Hook {
        events: Mutex<Vec<String>>,
    }

    impl ClusterHook for Hook {
        fn advertise(&self, address: &str, consumers: usize) -> railyard_bus::Advertisement {
            self.events
                .lock()
                .unwrap()
                .push(format!("+{address}={consumers}"));
            Box::pin(async { Ok(()) })
        }
        fn withdraw(&self, address: &str, consumers: usize) {
            self.events
                .lock()
                .unwrap()
                .push(format!("-{address}={consumers}"));
        }
    }

    #[tokio::test]
    async fn sends_alternate_between_local_and_remote_and_local_only_stays_home() {
        let bus = EventBus::new();
        let mut local = bus.consumer("a").stream().await.unwrap();
        let node = Arc::new(Recorder::default());
        bus.set_remote_nodes("a", vec![node.clone() as Arc<dyn RemoteNode>]);
        for i in 0..10u32 {
            bus.send("a", i).unwrap();
        }
        assert_eq!(
            node.got.lock().unwrap().len(),
            5,
            "round-robin over 2 targets"
        );
        assert_eq!(local.stats().received, 5);
        let only_here = DeliveryOptions::new().local_only(true);
        for i in 0..4u32 {
            bus.send_with("a", i, &only_here).unwrap();
        }
        assert_eq!(node.got.lock().unwrap().len(), 5, "local_only never leaves");
        assert_eq!(local.stats().received, 9);
        let report = bus.publish("a", 1u32).unwrap();
        assert_eq!(report.delivered, 2);
        assert_eq!(
            node.got.lock().unwrap().last().unwrap().1,
            RemoteKind::Publish
        );
        // A remote-only address answers requests through the link.
        bus.set_remote_nodes("b", vec![node.clone() as Arc<dyn RemoteNode>]);
        let reply = bus.request("b", String::from("hi")).await.unwrap();
        assert_eq!(reply.body::<String>().unwrap(), "hi");
        use futures::StreamExt;
        drop(local.next().await);
        // Removing the remote leaves the local consumer only; then nothing at b.
        bus.set_remote_nodes("b", Vec::new());
        assert_eq!(
            bus.request("b", 1u8).await.unwrap_err().kind().as_str(),
            "NO_HANDLERS"
        );
    }

    /// A request that waited for room keeps its options when it is routed
    /// again (it used to take the defaults): local-only stays on this node.
    #[tokio::test]
    async fn a_request_waiting_for_room_keeps_its_options() {
        let bus = EventBus::new();
        let local = bus.consumer("q").capacity(1).stream().await.unwrap();
        let node = Arc::new(Recorder::default());
        bus.set_remote_nodes("q", vec![node.clone() as Arc<dyn RemoteNode>]);
        let only_here = DeliveryOptions::new().local_only(true);
        bus.send_with("q", 0u8, &only_here).unwrap();
        let mut pending = bus.request_with("q", 1u8, &only_here);
        // The local buffer is full: the request waits for room.
        assert!(futures::poll!(&mut pending).is_pending());
        // Its only local consumer goes: routed again, local-only finds none.
        drop(local);
        let err = tokio::time::timeout(std::time::Duration::from_secs(5), pending)
            .await
            .expect("answered at once")
            .unwrap_err();
        assert_eq!(err.kind().as_str(), "NO_HANDLERS");
        assert!(node.got.lock().unwrap().is_empty(), "it left the node");
    }

    #[tokio::test]
    async fn a_full_remote_link_is_skipped_like_a_full_buffer() {
        let bus = EventBus::new();
        let full = Arc::new(Recorder {
            refuse: true,
            ..Recorder::default()
        });
        bus.set_remote_nodes("c", vec![full as Arc<dyn RemoteNode>]);
        let err = bus.send("c", 1u8).unwrap_err();
        assert!(matches!(err.error, BusError::Full { .. }));
        assert!(err.into_body().is::<u8>(), "the body comes back");
    }

    /// Routes `address` to `nodes`, each with its weight.
    fn route_weighted(bus: &EventBus, address: &str, nodes: &[(&Arc<Recorder>, u32)]) {
        let nodes = nodes
            .iter()
            .map(|(n, w)| ((*n).clone() as Arc<dyn RemoteNode>, *w))
            .collect();
        bus.set_weighted_remote_nodes_many([(address, nodes)]);
    }

    /// A full link holding several shares of the round-robin (its node has
    /// several consumers) is asked once per send, not once per share.
    #[tokio::test]
    async fn a_full_weighted_link_is_asked_once_per_send() {
        let bus = EventBus::new();
        let refusing = || {
            Arc::new(Recorder {
                refuse: true,
                ..Recorder::default()
            })
        };
        let (full, other) = (refusing(), refusing());
        route_weighted(&bus, "c", &[(&full, 3), (&other, 1)]);
        assert_eq!(bus.send_target_count("c"), 4);
        for _ in 0..4 {
            let err = bus.send("c", 1u8).unwrap_err();
            assert!(matches!(err.error, BusError::Full { .. }));
        }
        use std::sync::atomic::Ordering::Relaxed;
        assert_eq!(full.asked.load(Relaxed), 4, "once per send");
        assert_eq!(other.asked.load(Relaxed), 4, "once per send");
    }

    /// A node's weight stays while local consumers come and go, and when
    /// other nodes are removed from the address.
    #[tokio::test]
    async fn weights_survive_local_registrations_and_removals() {
        let bus = EventBus::new();
        let heavy = Arc::new(Recorder::default());
        let light = Arc::new(Recorder::default());
        route_weighted(&bus, "w", &[(&heavy, 3), (&light, 1)]);
        assert_eq!(bus.send_target_count("w"), 4);
        let local = bus.consumer("w").stream().await.unwrap();
        assert_eq!(bus.send_target_count("w"), 5, "1 local + 3 + 1");
        drop(local);
        assert_eq!(bus.send_target_count("w"), 4, "3 + 1");
        let light_id: *const Recorder = &*light;
        bus.retain_remote_nodes_many(["w"], |n| {
            !std::ptr::eq(Arc::as_ptr(n).cast::<Recorder>(), light_id)
        });
        assert_eq!(bus.send_target_count("w"), 3, "heavy alone, still 3");
        for i in 0..6u8 {
            bus.send("w", i).unwrap();
        }
        assert_eq!(heavy.got.lock().unwrap().len(), 6);
    }

    #[tokio::test]
    async fn the_hook_hears_of_every_public_consumer_coming_and_going_with_the_count() {
        let bus = EventBus::new();
        let hook = Arc::new(Hook::default());
        let _early = bus.consumer("early").stream().await.unwrap();
        let _early2 = bus.consumer("early").stream().await.unwrap();
        let _early_local = bus.local_consumer("early").stream().await.unwrap();
        let existing = bus.set_cluster_hook(Some(hook.clone()));
        let names: Vec<&str> = existing.iter().map(|(a, _)| a.as_str()).collect();
        assert_eq!(names, ["early"]);
        for (_, advertisement) in existing {
            advertisement.await.unwrap();
        }
        let a1 = bus.consumer("x").stream().await.unwrap();
        let a2 = bus.consumer("x").stream().await.unwrap();
        let l = bus.local_consumer("y").stream().await.unwrap();
        drop(a1);
        drop(l);
        // Each public registration waits for the address's advertisement,
        // which carries the public consumers there (other nodes weight this
        // node by it); each one leaving says how many are left; local
        // consumers say nothing.
        assert_eq!(
            *hook.events.lock().unwrap(),
            vec!["+early=2", "+x=1", "+x=2", "-x=1"]
        );
        drop(a2);
        assert_eq!(
            *hook.events.lock().unwrap(),
            vec!["+early=2", "+x=1", "+x=2", "-x=1", "-x=0"]
        );
    }
}

/// Each thread caches the registry snapshot it last sent with: a change in
/// registrations, or another bus on the same thread, must never be routed
/// with a stale one.
#[tokio::test]
async fn registry_changes_and_other_buses_are_seen_by_the_next_send() {
    let (one, two) = (EventBus::new(), EventBus::new());
    let mut s1 = one.consumer("a").stream().await.unwrap();
    let mut s2 = two.consumer("a").stream().await.unwrap();
    for i in 0..10u32 {
        one.send("a", i).unwrap();
        two.send("a", 100 + i).unwrap();
    }
    // A send enqueues before it returns: each bus's consumer holds its own
    // ten (a snapshot of the other bus would have put all twenty in one).
    assert_eq!((s1.stats().buffered, s2.stats().buffered), (10, 10));
    for i in 0..10u32 {
        assert_eq!(s1.next().await.unwrap().body::<u32>(), Some(&i));
        assert_eq!(s2.next().await.unwrap().body::<u32>(), Some(&(100 + i)));
    }
    // A new address right after a send on this thread: found at once.
    let mut b = one.consumer("b").stream().await.unwrap();
    one.send("b", 7u32).unwrap();
    assert_eq!(b.next().await.unwrap().body::<u32>(), Some(&7));
    // Gone: the next send says so instead of using the cached entry.
    drop(s1);
    let e = one.send("a", 1u32).unwrap_err();
    assert_eq!(e.kind(), FailureKind::NoHandlers);
    // And a new consumer there is found by the very next send (a stale
    // snapshot would list only the closed one).
    let s1b = one.consumer("a").stream().await.unwrap();
    one.send("a", 2u32).unwrap();
    assert_eq!(s1b.stats().buffered, 1);
    // The other bus is untouched.
    two.send("a", 5u32).unwrap();
    assert_eq!(s2.next().await.unwrap().body::<u32>(), Some(&5));
}

#[test]
fn a_decoded_string_does_not_keep_a_larger_buffer_it_was_cut_from() {
    let mut v = Vec::with_capacity(100_000);
    v.extend_from_slice(b"hello");
    let body = EventBus::new()
        .codecs()
        .decode("string", Bytes::from(v))
        .unwrap();
    let s = body.downcast_ref::<String>().unwrap();
    assert_eq!(s, "hello");
    assert!(s.capacity() < 1_000, "kept {} bytes", s.capacity());
}

/// A handler consumer whose runtime shut down (its handle detached) no
/// longer takes messages it will never handle: sends skip it (here: no
/// other consumer, so `NoHandlers`) and a request fails at once instead of
/// waiting its whole timeout.
#[tokio::test]
async fn a_consumer_whose_runtime_is_gone_takes_no_more_messages() {
    orphan_takes_no_more_messages(false).await;
}

/// The same for a consumer run by an event loop's dispatcher
/// (`enable_loop_dispatch`): when the loop's runtime ends, its consumers
/// leave the registry. Until 2026-11-28 they stayed, and took messages
/// nobody would ever run.
#[tokio::test]
async fn a_dispatched_consumer_whose_loop_is_gone_takes_no_more_messages() {
    orphan_takes_no_more_messages(true).await;
}

async fn orphan_takes_no_more_messages(dispatched: bool) {
    let bus = EventBus::new();
    let b = bus.clone();
    std::thread::spawn(move || {
        let rt = tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .build()
            .unwrap();
        rt.block_on(async move {
            if dispatched {
                assert!(enable_loop_dispatch());
            }
            // Detached: the handle is dropped, the consumer keeps running.
            drop(b.consumer("orphan").handler(|_m| async {}).await.unwrap());
            b.send("orphan", 0u8).unwrap();
            tokio::task::yield_now().await;
        });
        // The runtime ends here, and its tasks with it.
    })
    .join()
    .unwrap();
    assert_eq!(bus.consumer_count("orphan"), 0, "it left the registry");
    let e = bus.send("orphan", 1u8).unwrap_err();
    assert_eq!(e.error.kind().as_str(), "NO_HANDLERS", "{:?}", e.error);
    let opts = DeliveryOptions::new().timeout(Duration::from_secs(5));
    let t0 = std::time::Instant::now();
    let e = bus.request_with("orphan", 2u8, &opts).await.unwrap_err();
    assert_eq!(e.kind().as_str(), "NO_HANDLERS", "{e:?}");
    assert!(t0.elapsed() < Duration::from_secs(1), "failed at once");
}
