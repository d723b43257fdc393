//! Compensation handlers, registered by compensation method name.

use std::collections::HashMap;
use std::fmt;
use std::future::Future;
use std::sync::Arc;

use bytes::Bytes;
use futures::future::BoxFuture;

use crate::error::CompensationError;

/// One compensation command from the coordinator: undo the step
/// `local_tx_id` of saga `global_tx_id`, with the payload the step was
/// started with (byte for byte).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Compensation {
    /// The saga.
    pub global_tx_id: String,
    /// The step to undo.
    pub local_tx_id: String,
    /// The step's parent (the saga's id for top-level steps).
    pub parent_tx_id: String,
    /// The name the step was registered with.
    pub compensation_method: String,
    /// The step's payload, as reported at its start.
    pub payloads: Bytes,
    /// Attempt number, from 1 (a later attempt follows a failure or a
    /// timeout of an earlier one: handlers must be idempotent).
    pub attempt: u32,
}

type Handler =
    dyn Fn(Compensation) -> BoxFuture<'static, Result<(), CompensationError>> + Send + Sync;

/// Handlers by compensation method name; cheap to clone.
#[derive(Clone, Default)]
pub(crate) struct Registry {
    by_name: HashMap<String, Arc<Handler>>,
}

impl fmt::Debug for Registry {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_set().entries(self.by_name.keys()).finish()
    }
}

impl Registry {
    pub(crate) fn insert<F, Fut, E>(&mut self, name: String, handler: F)
    where
        F: Fn(Compensation) -> Fut + Send + Sync + 'static,
        Fut: Future<Output = Result<(), E>> + Send + 'static,
        E: fmt::Display,
    {
        let handler = Arc::new(handler);
        self.by_name.insert(
            name,
            Arc::new(move |c: Compensation| {
                let fut = handler(c);
                Box::pin(async move { fut.await.map_err(CompensationError::new) })
                    as BoxFuture<'static, _>
            }),
        );
    }

    pub(crate) fn get(&self, name: &str) -> Option<Arc<Handler>> {
        self.by_name.get(name).cloned()
    }
}
