//! The message a consumer receives, and how it is answered.

use std::any::Any;
use std::sync::Arc;

use tokio::sync::oneshot;

use crate::bus::Shared;
use crate::interceptor::MessageKind;
use crate::queue::ConsumerQueue;
use crate::queue::Envelope;
use crate::reply::{PendingReply, ReplySender};
use crate::{Body, BusError, DeliveryOptions, Headers};

/// A message as a consumer (or a requester, for replies) sees it.
///
/// Requests are answered once, with [`reply`](Self::reply), [`fail`](Self::fail)
/// or [`reply_and_request`](Self::reply_and_request). Dropping a request
/// unanswered fails it at once with [`BusError::NoReply`] (the requester does
/// not wait for its timeout).
pub struct Message {
    /// Where it was delivered: the consumer's queue, which knows the address
    /// and the bus's interceptors (`Delivered`), or the bus a reply belongs to
    /// (`Reply`, which has no address of its own).
    origin: Origin,
    headers: Headers,
    body: Body,
    reply: Option<ReplySender>,
    send: bool,
}

enum Origin {
    Delivered(Arc<ConsumerQueue>),
    /// A reply; carries the bus only when it can itself be answered (a chain).
    Reply(Option<Arc<Shared>>),
}

impl Message {
    pub(crate) fn delivered(env: Envelope, queue: &Arc<ConsumerQueue>) -> Self {
        Self {
            origin: Origin::Delivered(queue.clone()),
            headers: env.headers,
            body: env.body,
            reply: env.reply,
            send: env.send,
        }
    }

    /// A reply that came from another node.
    pub(crate) fn remote_reply(headers: Headers, body: Body) -> Self {
        Self {
            origin: Origin::Reply(None),
            headers,
            body,
            reply: None,
            send: true,
        }
    }

    fn shared(&self) -> Option<&Arc<Shared>> {
        match &self.origin {
            Origin::Delivered(q) => Some(&q.shared),
            Origin::Reply(s) => s.as_ref(),
        }
    }

    /// The address the message was sent to; empty for replies.
    pub fn address(&self) -> &str {
        match &self.origin {
            Origin::Delivered(q) => &q.address,
            Origin::Reply(_) => "",
        }
    }

    /// The message's headers.
    pub fn headers(&self) -> &Headers {
        &self.headers
    }

    /// Mutable headers (inbound interceptors may rewrite them).
    pub fn headers_mut(&mut self) -> &mut Headers {
        &mut self.headers
    }

    /// The body, if it is a `T`.
    pub fn body<T: Any>(&self) -> Option<&T> {
        self.body.downcast_ref()
    }

    /// The type-erased body.
    pub fn raw_body(&self) -> &Body {
        &self.body
    }

    /// Takes the body out, leaving an empty one.
    pub fn take_body(&mut self) -> Body {
        std::mem::take(&mut self.body)
    }

    /// `true` for point-to-point messages, `false` for published ones.
    pub fn is_send(&self) -> bool {
        self.send
    }

    /// Whether the sender waits for an answer that has not been given yet.
    pub fn expects_reply(&self) -> bool {
        self.reply.is_some()
    }

    /// Whether a request's requester on this node has given up waiting (its
    /// timeout passed, or it was dropped): an answer would go nowhere. Always
    /// `false` for a requester on another node, which this node cannot see.
    pub fn requester_gone(&self) -> bool {
        self.reply.as_ref().is_some_and(ReplySender::is_closed)
    }

    /// Answers the request with `body`.
    ///
    /// # Errors
    /// [`BusError::NotReplyable`] if the message was not a request or was
    /// already answered; [`BusError::Rejected`] if an interceptor vetoed the
    /// reply (the requester then gets that error too).
    pub fn reply<T: Any + Send + Sync>(&mut self, body: T) -> Result<(), BusError> {
        self.answer(Headers::new(), Body::new(body), None)
    }

    /// Answers with `body` and the headers of `options`.
    pub fn reply_with<T: Any + Send + Sync>(
        &mut self,
        body: T,
        options: &DeliveryOptions,
    ) -> Result<(), BusError> {
        self.answer(options.headers.clone(), Body::new(body), None)
    }

    /// Answers with `body` and waits for the requester to answer the reply:
    /// a request chain. The requester sees a reply that
    /// [`expects_reply`](Self::expects_reply).
    ///
    /// # Errors
    /// As [`reply`](Self::reply).
    pub fn reply_and_request<T: Any + Send + Sync>(
        &mut self,
        body: T,
        options: &DeliveryOptions,
    ) -> Result<PendingReply<'_>, BusError> {
        let start = tokio::time::Instant::now();
        let (tx, rx) = oneshot::channel();
        self.answer(
            options.headers.clone(),
            Body::new(body),
            Some(ReplySender::Local(tx)),
        )?;
        // `answer` succeeded, so this was a request, and requests know their bus.
        let shared = self.shared().ok_or(BusError::NotReplyable)?;
        shared.counters.requests.add(1);
        Ok(PendingReply::waiting(
            shared,
            None,
            rx,
            options.timeout,
            start,
        ))
    }

    /// Fails the request: the requester gets [`BusError::RecipientFailure`]
    /// with this code and message.
    ///
    /// # Errors
    /// [`BusError::NotReplyable`] if the message was not a request or was
    /// already answered.
    pub fn fail(&mut self, code: i32, message: impl Into<String>) -> Result<(), BusError> {
        self.fail_with(BusError::RecipientFailure {
            code,
            message: message.into(),
        })
    }

    /// Answers the request with `error`.
    pub(crate) fn fail_with(&mut self, error: BusError) -> Result<(), BusError> {
        let slot = self.reply.take().ok_or(BusError::NotReplyable)?;
        // A requester that already gave up simply does not read it.
        let _ = slot.send(Err(error));
        Ok(())
    }

    fn answer(
        &mut self,
        mut headers: Headers,
        body: Body,
        expect: Option<ReplySender>,
    ) -> Result<(), BusError> {
        let slot = self.reply.take().ok_or(BusError::NotReplyable)?;
        if let Some(shared) = self.shared() {
            if let Err(e) =
                shared.outbound_check(self.address(), MessageKind::Reply, &mut headers, &body)
            {
                let _ = slot.send(Err(e.clone()));
                return Err(e);
            }
        }
        let chain = expect.as_ref().and_then(|_| self.shared().cloned());
        let reply = Message {
            origin: Origin::Reply(chain),
            headers,
            body,
            reply: expect,
            send: true,
        };
        // The requester may have timed out and gone; its loss, nothing to undo.
        let _ = slot.send(Ok(reply));
        Ok(())
    }
}

impl std::fmt::Debug for Message {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Message")
            .field("address", &self.address())
            .field("headers", &self.headers)
            .field("body", &self.body)
            .field("send", &self.send)
            .field("expects_reply", &self.expects_reply())
            .finish()
    }
}
