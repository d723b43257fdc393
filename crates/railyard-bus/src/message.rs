//! The message a consumer receives, and how it is answered.

use std::any::Any;
use std::sync::Arc;

use tokio::sync::oneshot;

use crate::interceptor::MessageKind;
use crate::queue::Envelope;
use crate::reply::{PendingReply, ReplySender};
use crate::{Body, BusError, DeliveryOptions, EventBus, Headers};

/// A message as a consumer (or a requester, for replies) sees it.
///
/// Requests are answered once, with [`reply`](Self::reply), [`fail`](Self::fail)
/// or [`reply_and_request`](Self::reply_and_request). Dropping a request
/// unanswered fails it at once with [`BusError::NoReply`] (the requester does
/// not wait for its timeout).
pub struct Message {
    /// `None` for replies, which have no address of their own.
    address: Option<Arc<str>>,
    headers: Headers,
    body: Body,
    reply: Option<ReplySender>,
    send: bool,
    /// Present only when the message can be answered: replies go through the
    /// bus's outbound interceptors and chains need it to create their request.
    bus: Option<EventBus>,
}

impl Message {
    pub(crate) fn delivered(env: Envelope, address: &Arc<str>, bus: &EventBus) -> Self {
        let bus = env.reply.as_ref().map(|_| bus.clone());
        Self {
            address: Some(address.clone()),
            headers: env.headers,
            body: env.body,
            reply: env.reply,
            send: env.send,
            bus,
        }
    }

    /// The address the message was sent to; empty for replies.
    pub fn address(&self) -> &str {
        self.address.as_deref().unwrap_or("")
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
        self.answer(options.headers.clone(), Body::new(body), Some(tx))?;
        // `answer` succeeded, so this was a request, and requests carry the bus.
        let bus = self.bus.as_ref().ok_or(BusError::NotReplyable)?;
        bus.inner.counters.requests.add(1);
        Ok(PendingReply::waiting(bus, rx, options.timeout, start))
    }

    /// Fails the request: the requester gets [`BusError::RecipientFailure`]
    /// with this code and message.
    ///
    /// # Errors
    /// [`BusError::NotReplyable`] if the message was not a request or was
    /// already answered.
    pub fn fail(&mut self, code: i32, message: impl Into<String>) -> Result<(), BusError> {
        let slot = self.reply.take().ok_or(BusError::NotReplyable)?;
        // A requester that already gave up simply does not read it.
        let _ = slot.send(Err(BusError::RecipientFailure {
            code,
            message: message.into(),
        }));
        Ok(())
    }

    /// Fails a request an inbound interceptor vetoed.
    pub(crate) fn fail_rejected(&mut self, reason: String) -> Result<(), BusError> {
        let slot = self.reply.take().ok_or(BusError::NotReplyable)?;
        let _ = slot.send(Err(BusError::Rejected { reason }));
        Ok(())
    }

    fn answer(
        &mut self,
        mut headers: Headers,
        body: Body,
        expect: Option<ReplySender>,
    ) -> Result<(), BusError> {
        let slot = self.reply.take().ok_or(BusError::NotReplyable)?;
        if let Some(bus) = &self.bus {
            if let Err(e) =
                bus.outbound_check(self.address(), MessageKind::Reply, &mut headers, &body)
            {
                let _ = slot.send(Err(e.clone()));
                return Err(e);
            }
        }
        let bus = expect.as_ref().and(self.bus.clone());
        let reply = Message {
            address: None,
            headers,
            body,
            reply: expect,
            send: true,
            bus,
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
