//! Message bodies: typed values that travel by reference on a local hop.

use std::any::{Any, TypeId};
use std::fmt;
use std::sync::Arc;

/// The body of a message: any `Send + Sync` value, shared by reference.
///
/// A local hop never serializes a body: `send` moves the `Arc`, `publish` clones
/// it (one reference per consumer). Codecs (see [`crate::CodecRegistry`]) turn a
/// body into bytes only when it leaves the process (cluster, bridge).
///
/// The empty body (`()`) needs no allocation.
#[derive(Clone, Default)]
pub struct Body {
    /// `None` is the empty body; everything else is a shared, type-erased value.
    value: Option<Arc<dyn Any + Send + Sync>>,
    /// Kept for diagnostics (`Debug`, codec errors); a `&'static str` costs nothing.
    type_name: &'static str,
}

impl Body {
    /// The empty body.
    pub const fn empty() -> Self {
        Self {
            value: None,
            type_name: "()",
        }
    }

    /// Wraps any value. A `Body` passed here is returned as is, not nested, and
    /// `()` becomes the empty body.
    pub fn new<T: Any + Send + Sync>(value: T) -> Self {
        // Both checks compare constant `TypeId`s, so they fold away after
        // monomorphization: no cost on the hot path.
        let mut slot = Some(value);
        if TypeId::of::<T>() == TypeId::of::<Body>() {
            let any: &mut dyn Any = &mut slot;
            if let Some(body) = any.downcast_mut::<Option<Body>>() {
                // The slot was filled above.
                return body.take().unwrap_or_default();
            }
        }
        if TypeId::of::<T>() == TypeId::of::<()>() {
            return Self::empty();
        }
        // Filled above and only emptied on the `Body` path, which returned.
        let value = slot.take().expect("slot is filled");
        Self {
            value: Some(Arc::new(value)),
            type_name: std::any::type_name::<T>(),
        }
    }

    /// Builds a body from an already shared value, without copying it.
    pub fn from_arc<T: Any + Send + Sync>(value: Arc<T>) -> Self {
        Self {
            value: Some(value),
            type_name: std::any::type_name::<T>(),
        }
    }

    /// Whether this is the empty body.
    pub fn is_empty(&self) -> bool {
        self.value.is_none()
    }

    /// Whether the body holds a `T`.
    pub fn is<T: Any>(&self) -> bool {
        match &self.value {
            Some(v) => v.is::<T>(),
            None => TypeId::of::<T>() == TypeId::of::<()>(),
        }
    }

    /// A reference to the value if it is a `T`.
    pub fn downcast_ref<T: Any>(&self) -> Option<&T> {
        self.value.as_ref()?.downcast_ref::<T>()
    }

    /// Takes the value out if it is a `T` and this is the only reference to it
    /// (always the case after `send` or `request`); otherwise returns the body.
    pub fn try_take<T: Any + Send + Sync>(self) -> Result<T, Body> {
        let type_name = self.type_name;
        match self.value {
            Some(v) => match v.downcast::<T>() {
                Ok(arc) => Arc::try_unwrap(arc).map_err(|arc| Body {
                    value: Some(arc),
                    type_name,
                }),
                Err(v) => Err(Body {
                    value: Some(v),
                    type_name,
                }),
            },
            None => Err(Body::empty()),
        }
    }

    /// The Rust type name of the value, for diagnostics.
    pub fn type_name(&self) -> &'static str {
        self.type_name
    }

    /// The `TypeId` of the value (`()` for the empty body).
    pub fn value_type_id(&self) -> TypeId {
        match &self.value {
            Some(v) => (**v).type_id(),
            None => TypeId::of::<()>(),
        }
    }
}

impl fmt::Debug for Body {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Body")
            .field("type", &self.type_name)
            .finish()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn body_of_body_is_not_nested() {
        let inner = Body::new(7u32);
        let outer = Body::new(inner);
        assert_eq!(outer.downcast_ref::<u32>(), Some(&7));
    }

    #[test]
    fn unit_is_empty_and_take_unwraps_unique_values() {
        assert!(Body::new(()).is_empty());
        assert!(Body::new(()).is::<()>());
        let b = Body::new(String::from("x"));
        let shared = b.clone();
        let b = b.try_take::<String>().expect_err("two references exist");
        drop(shared);
        assert_eq!(b.try_take::<String>().unwrap(), "x");
        assert!(Body::new(1u8).try_take::<u16>().is_err());
    }
}
