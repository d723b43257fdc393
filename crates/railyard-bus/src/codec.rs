//! Codecs: how a body becomes bytes when it leaves the process.
//!
//! Local delivery never uses them. The cluster transport and the bridge ask
//! the registry to encode a body with the codec named in the delivery options,
//! or with the default codec registered for the body's Rust type, and to
//! decode bytes by codec name on the other side.

use std::any::{Any, TypeId};
use std::collections::HashMap;
use std::marker::PhantomData;
use std::sync::Arc;

use bytes::{BufMut, Bytes, BytesMut};
use serde::de::DeserializeOwned;
use serde::Serialize;

use crate::{Body, CodecError};

/// Turns bodies of one kind into bytes and back.
pub trait MessageCodec: Send + Sync + 'static {
    /// The name the codec is registered and sent under.
    fn name(&self) -> &str;
    /// Encodes a body.
    ///
    /// # Errors
    /// [`CodecError::WrongType`] when the body is not of the codec's type.
    fn encode(&self, body: &Body) -> Result<Bytes, CodecError>;
    /// Encodes a body by appending its bytes to `out`: what a transport
    /// calls, writing the body straight into the frame it builds. The
    /// default goes through [`encode`](Self::encode); the built-in codecs
    /// write in place, without a buffer of their own per body (an
    /// allocation, a copy and a free per message that crosses nodes).
    /// It must only append: what `out` held before belongs to other frames.
    /// On error, what was appended is not specified: the caller truncates.
    ///
    /// # Errors
    /// As [`encode`](Self::encode).
    fn encode_into(&self, body: &Body, out: &mut BytesMut) -> Result<(), CodecError> {
        out.extend_from_slice(&self.encode(body)?);
        Ok(())
    }
    /// Decodes bytes produced by [`encode`](Self::encode).
    ///
    /// # Errors
    /// [`CodecError::Malformed`] when the bytes are not a valid encoding.
    fn decode(&self, bytes: Bytes) -> Result<Body, CodecError>;
}

fn wrong_type(codec: &str, body: &Body) -> CodecError {
    CodecError::WrongType {
        codec: codec.to_owned(),
        type_name: body.type_name(),
    }
}

/// The bytes of a [`BytesCodec`] body (`Bytes` or `Vec<u8>`).
fn bytes_of<'b>(codec: &BytesCodec, body: &'b Body) -> Result<&'b [u8], CodecError> {
    if let Some(b) = body.downcast_ref::<Bytes>() {
        Ok(b)
    } else if let Some(v) = body.downcast_ref::<Vec<u8>>() {
        Ok(v)
    } else {
        Err(wrong_type(codec.name(), body))
    }
}

/// The text of a [`StringCodec`] body (`String` or `&'static str`).
fn str_of<'b>(codec: &StringCodec, body: &'b Body) -> Result<&'b str, CodecError> {
    if let Some(s) = body.downcast_ref::<String>() {
        Ok(s)
    } else if let Some(s) = body.downcast_ref::<&'static str>() {
        Ok(s)
    } else {
        Err(wrong_type(codec.name(), body))
    }
}

/// `bytes`: a [`Bytes`] or `Vec<u8>` body, as is. Decodes to [`Bytes`].
#[derive(Debug, Default, Clone, Copy)]
pub struct BytesCodec;

impl MessageCodec for BytesCodec {
    fn name(&self) -> &str {
        "bytes"
    }
    fn encode(&self, body: &Body) -> Result<Bytes, CodecError> {
        match body.downcast_ref::<Bytes>() {
            // Shared, not copied.
            Some(b) => Ok(b.clone()),
            None => bytes_of(self, body).map(Bytes::copy_from_slice),
        }
    }
    fn encode_into(&self, body: &Body, out: &mut BytesMut) -> Result<(), CodecError> {
        out.extend_from_slice(bytes_of(self, body)?);
        Ok(())
    }
    fn decode(&self, bytes: Bytes) -> Result<Body, CodecError> {
        Ok(Body::new(bytes))
    }
}

/// `bytes` as `&str` if they are UTF-8, as [`std::str::from_utf8`], with
/// an ASCII fast path: a word-at-a-time ASCII check, and the full
/// validation only for bytes it refuses. Wire decoders check every address,
/// codec name, header and string body with it; on 4-40-byte ASCII strings
/// it took 5 ns where `from_utf8` took 14 (a loop over six such strings,
/// this machine), and `from_utf8` was about 4 % of a two-process echo's CPU.
///
/// # Errors
/// The [`std::str::Utf8Error`] of `from_utf8` when they are not UTF-8.
pub fn str_from_utf8(bytes: &[u8]) -> Result<&str, std::str::Utf8Error> {
    if bytes.is_ascii() {
        // Safety: ASCII bytes are valid UTF-8.
        Ok(unsafe { std::str::from_utf8_unchecked(bytes) })
    } else {
        std::str::from_utf8(bytes)
    }
}

/// [`str_from_utf8`] for an owned buffer, as [`String::from_utf8`].
///
/// # Errors
/// The [`std::string::FromUtf8Error`] (with the buffer) when it is not UTF-8.
pub fn string_from_utf8(bytes: Vec<u8>) -> Result<String, std::string::FromUtf8Error> {
    if bytes.is_ascii() {
        // Safety: ASCII bytes are valid UTF-8.
        Ok(unsafe { String::from_utf8_unchecked(bytes) })
    } else {
        String::from_utf8(bytes)
    }
}

/// `string`: a `String` or `&'static str` body as UTF-8. Decodes to `String`.
#[derive(Debug, Default, Clone, Copy)]
pub struct StringCodec;

impl MessageCodec for StringCodec {
    fn name(&self) -> &str {
        "string"
    }
    fn encode(&self, body: &Body) -> Result<Bytes, CodecError> {
        match body.downcast_ref::<&'static str>() {
            // Static: referenced, not copied.
            Some(s) => Ok(Bytes::from_static(s.as_bytes())),
            None => str_of(self, body).map(|s| Bytes::copy_from_slice(s.as_bytes())),
        }
    }
    fn encode_into(&self, body: &Body, out: &mut BytesMut) -> Result<(), CodecError> {
        out.extend_from_slice(str_of(self, body)?.as_bytes());
        Ok(())
    }
    fn decode(&self, bytes: Bytes) -> Result<Body, CodecError> {
        // Reuses the allocation of a body that owns its bytes alone (as
        // one cut from a small cluster frame does) instead of copying it;
        // a body cut from a larger buffer it alone holds would keep that
        // buffer's capacity, so that is given back.
        let mut v = Vec::from(bytes);
        if v.capacity() > 2 * v.len() + 64 {
            v.shrink_to_fit();
        }
        string_from_utf8(v)
            .map(Body::new)
            .map_err(|e| CodecError::Malformed {
                codec: self.name().to_owned(),
                reason: e.to_string(),
            })
    }
}

/// Integers as 8 big-endian bytes: `u64` under the name `u64`, `i64` under
/// `i64`. Registered and made the default for those types.
#[derive(Debug, Default, Clone, Copy)]
pub struct IntCodec {
    signed: bool,
}

impl IntCodec {
    fn bits(&self, body: &Body) -> Result<u64, CodecError> {
        let bits = if self.signed {
            body.downcast_ref::<i64>().map(|v| *v as u64)
        } else {
            body.downcast_ref::<u64>().copied()
        };
        bits.ok_or_else(|| wrong_type(self.name(), body))
    }
}

impl MessageCodec for IntCodec {
    fn name(&self) -> &str {
        if self.signed {
            "i64"
        } else {
            "u64"
        }
    }

    fn encode(&self, body: &Body) -> Result<Bytes, CodecError> {
        self.bits(body)
            .map(|b| Bytes::copy_from_slice(&b.to_be_bytes()))
    }

    fn encode_into(&self, body: &Body, out: &mut BytesMut) -> Result<(), CodecError> {
        out.put_u64(self.bits(body)?);
        Ok(())
    }

    fn decode(&self, bytes: Bytes) -> Result<Body, CodecError> {
        let arr: [u8; 8] = bytes
            .as_ref()
            .try_into()
            .map_err(|_| CodecError::Malformed {
                codec: self.name().to_owned(),
                reason: format!("expected 8 bytes, got {}", bytes.len()),
            })?;
        let bits = u64::from_be_bytes(arr);
        Ok(if self.signed {
            Body::new(bits as i64)
        } else {
            Body::new(bits)
        })
    }
}

/// A JSON codec for one serde type `T` (the built-in `json` codec is
/// `JsonCodec<serde_json::Value>`).
pub struct JsonCodec<T> {
    name: String,
    _type: PhantomData<fn() -> T>,
}

impl<T> JsonCodec<T> {
    /// A JSON codec registered under `name`.
    pub fn new(name: impl Into<String>) -> Self {
        Self {
            name: name.into(),
            _type: PhantomData,
        }
    }
}

impl<T> MessageCodec for JsonCodec<T>
where
    T: Serialize + DeserializeOwned + Any + Send + Sync,
{
    fn name(&self) -> &str {
        &self.name
    }
    fn encode(&self, body: &Body) -> Result<Bytes, CodecError> {
        // 128 bytes: where `serde_json::to_vec` starts too.
        let mut out = BytesMut::with_capacity(128);
        self.encode_into(body, &mut out)?;
        Ok(out.freeze())
    }
    fn encode_into(&self, body: &Body, out: &mut BytesMut) -> Result<(), CodecError> {
        let value = body
            .downcast_ref::<T>()
            .ok_or_else(|| wrong_type(&self.name, body))?;
        serde_json::to_writer(out.writer(), value).map_err(|e| CodecError::Malformed {
            codec: self.name.clone(),
            reason: e.to_string(),
        })
    }
    fn decode(&self, bytes: Bytes) -> Result<Body, CodecError> {
        serde_json::from_slice::<T>(&bytes)
            .map(Body::new)
            .map_err(|e| CodecError::Malformed {
                codec: self.name.clone(),
                reason: e.to_string(),
            })
    }
}

/// Codecs by name, and the default codec for each body type.
///
/// Starts with `bytes`, `string` and `json`, defaults for `Bytes`,
/// `Vec<u8>`, `String`, `&'static str` and `serde_json::Value`.
#[derive(Clone)]
pub struct CodecRegistry {
    // foldhash, not SipHash: every message that crosses nodes looks up its
    // codec here (by type, then by name), and the keys are not attacker-chosen
    // in a way that could hurt (codecs are registered by the application).
    by_name: HashMap<Arc<str>, Arc<dyn MessageCodec>, foldhash::fast::RandomState>,
    defaults: HashMap<TypeId, Arc<str>, foldhash::fast::RandomState>,
}

impl Default for CodecRegistry {
    fn default() -> Self {
        let mut r = Self {
            by_name: HashMap::default(),
            defaults: HashMap::default(),
        };
        // The names are distinct, so registration cannot fail.
        let _ = r.register(Arc::new(BytesCodec));
        let _ = r.register(Arc::new(StringCodec));
        let _ = r.register(Arc::new(JsonCodec::<serde_json::Value>::new("json")));
        let _ = r.register(Arc::new(IntCodec { signed: false }));
        let _ = r.register(Arc::new(IntCodec { signed: true }));
        for (t, name) in [
            (TypeId::of::<Bytes>(), "bytes"),
            (TypeId::of::<Vec<u8>>(), "bytes"),
            (TypeId::of::<String>(), "string"),
            (TypeId::of::<&'static str>(), "string"),
            (TypeId::of::<serde_json::Value>(), "json"),
            (TypeId::of::<u64>(), "u64"),
            (TypeId::of::<i64>(), "i64"),
        ] {
            r.defaults.insert(t, name.into());
        }
        r
    }
}

impl CodecRegistry {
    /// A registry with the built-in codecs.
    pub fn new() -> Self {
        Self::default()
    }

    /// Adds a codec.
    ///
    /// # Errors
    /// [`CodecError::Duplicate`] if the name is taken.
    pub fn register(&mut self, codec: Arc<dyn MessageCodec>) -> Result<(), CodecError> {
        let name: Arc<str> = codec.name().into();
        if self.by_name.contains_key(&name) {
            return Err(CodecError::Duplicate(name.to_string()));
        }
        self.by_name.insert(name, codec);
        Ok(())
    }

    /// Makes the codec named `name` the default for bodies of type `T`.
    ///
    /// # Errors
    /// [`CodecError::Unknown`] if no codec has that name.
    pub fn set_default<T: Any>(&mut self, name: &str) -> Result<(), CodecError> {
        let (name, _) = self
            .by_name
            .get_key_value(name)
            .ok_or_else(|| CodecError::Unknown(name.to_owned()))?;
        self.defaults.insert(TypeId::of::<T>(), name.clone());
        Ok(())
    }

    /// Whether a codec has this name.
    pub fn contains(&self, name: &str) -> bool {
        self.by_name.contains_key(name)
    }

    /// The codec named `name`.
    pub fn get(&self, name: &str) -> Option<&Arc<dyn MessageCodec>> {
        self.by_name.get(name)
    }

    /// The codec named `name`, with its registered name.
    ///
    /// # Errors
    /// [`CodecError::Unknown`].
    pub(crate) fn named(
        &self,
        name: &str,
    ) -> Result<(&Arc<str>, &Arc<dyn MessageCodec>), CodecError> {
        self.by_name
            .get_key_value(name)
            .ok_or_else(|| CodecError::Unknown(name.to_owned()))
    }

    /// The default codec for `body`'s type, with its name.
    ///
    /// # Errors
    /// [`CodecError::NoDefault`].
    pub(crate) fn default_of(
        &self,
        body: &Body,
    ) -> Result<(&Arc<str>, &Arc<dyn MessageCodec>), CodecError> {
        self.defaults
            .get(&body.value_type_id())
            .and_then(|name| self.by_name.get_key_value(name))
            .ok_or(CodecError::NoDefault(body.type_name()))
    }

    /// Encodes `body` with the named codec, or the default for its type.
    /// Returns the codec name used (to send along) and the bytes.
    ///
    /// # Errors
    /// [`CodecError::Unknown`], [`CodecError::NoDefault`], or the codec's own error.
    pub fn encode(
        &self,
        body: &Body,
        codec: Option<&str>,
    ) -> Result<(Arc<str>, Bytes), CodecError> {
        let (name, c) = match codec {
            Some(n) => self.named(n)?,
            None => self.default_of(body)?,
        };
        Ok((name.clone(), c.encode(body)?))
    }

    /// Decodes bytes sent under codec `name`.
    ///
    /// # Errors
    /// [`CodecError::Unknown`] or the codec's own error.
    pub fn decode(&self, name: &str, bytes: Bytes) -> Result<Body, CodecError> {
        self.named(name)?.1.decode(bytes)
    }
}

impl std::fmt::Debug for CodecRegistry {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let mut names: Vec<&str> = self.by_name.keys().map(|k| &**k).collect();
        names.sort_unstable();
        f.debug_struct("CodecRegistry")
            .field("codecs", &names)
            .finish()
    }
}
