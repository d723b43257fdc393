//! Interceptors: code that sees every message leaving or reaching a consumer.

use crate::{Body, Headers, Message};

/// What kind of outbound message an interceptor is looking at.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum MessageKind {
    /// `send`: one consumer, no reply expected.
    Send,
    /// `request`: one consumer, reply expected.
    Request,
    /// `publish`: every consumer.
    Publish,
    /// A reply to a request.
    Reply,
}

/// An interceptor's decision.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Verdict {
    /// Let the message through (possibly with rewritten headers).
    Continue,
    /// Stop it. Outbound: the sender gets [`crate::BusError::Rejected`].
    /// Inbound: the message is discarded (counted) and a requester gets the same error.
    Reject(String),
}

/// An outbound message as interceptors see it: headers may be rewritten, the
/// body only read.
#[derive(Debug)]
pub struct Outbound<'a> {
    /// The destination address (the replied-to address for replies).
    pub address: &'a str,
    /// What kind of message this is.
    pub kind: MessageKind,
    /// Headers, mutable.
    pub headers: &'a mut Headers,
    /// The body.
    pub body: &'a Body,
}

/// Sees messages as they leave a sender (`outbound`, on the sender's thread,
/// before routing) and as they reach a consumer (`inbound`, on the consumer's
/// task, before the handler or stream gets them).
///
/// Interceptors run in the order they were added. They must be quick: they run
/// on the hot path of every message while at least one is installed (with
/// none, the hot path checks one flag).
pub trait Interceptor: Send + Sync + 'static {
    /// Called for every send, request, publish and reply.
    fn outbound(&self, msg: &mut Outbound<'_>) -> Verdict {
        let _ = msg;
        Verdict::Continue
    }

    /// Called for every message a consumer is about to handle.
    fn inbound(&self, msg: &mut Message) -> Verdict {
        let _ = msg;
        Verdict::Continue
    }
}

/// Identifies an installed interceptor, for removal.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct InterceptorId(pub(crate) u64);
