//! Response compression: `Accept-Encoding` negotiation, bodies compressed
//! once ([`FixedBody`]), and on-the-fly compression of dynamic bodies above a
//! size threshold.
//!
//! gzip and deflate (zlib) are offered, like Vert.x's default compressor.
//! Compression runs inline for bodies up to [`INLINE_MAX`] bytes (well under
//! 0.5 ms at the fast level) and on the blocking pool above.

use std::io::Write as _;

use bytes::Bytes;
use flate2::write::{GzEncoder, ZlibEncoder};
use http::header::{HeaderValue, CACHE_CONTROL, CONTENT_ENCODING, CONTENT_TYPE, VARY};
use http::{HeaderMap, Response};

use crate::body::Body;

/// Largest body compressed on the async thread; larger goes to the blocking pool.
pub const INLINE_MAX: usize = 16 * 1024;

/// A content coding Railyard produces.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Encoding {
    /// No compression.
    Identity,
    /// `gzip`.
    Gzip,
    /// `deflate` (zlib framing, RFC 1950).
    Deflate,
}

impl Encoding {
    /// The best coding the client accepts: gzip, then deflate, else identity.
    /// Codings with `q=0` are refused; `*` accepts gzip.
    pub fn negotiate(headers: &HeaderMap) -> Encoding {
        Self::negotiate_values(
            headers
                .get_all(http::header::ACCEPT_ENCODING)
                .iter()
                .map(HeaderValue::as_bytes),
        )
    }

    /// [`Encoding::negotiate`] over raw `Accept-Encoding` values (the fixed
    /// lane reads them straight from the request head). A value with bytes
    /// outside visible ASCII is skipped, as `HeaderValue::to_str` refuses it.
    pub(crate) fn negotiate_values<'a>(values: impl Iterator<Item = &'a [u8]>) -> Encoding {
        let mut gzip = false;
        let mut deflate = false;
        for value in values {
            let visible = value.iter().all(|&b| b == b'\t' || (32..127).contains(&b));
            let Some(s) = visible.then(|| std::str::from_utf8(value).ok()).flatten() else {
                continue;
            };
            for item in s.split(',') {
                let mut parts = item.split(';');
                let name = parts.next().unwrap_or("").trim();
                let refused = parts.any(|p| {
                    let p = p.trim();
                    // The parameter name is case-insensitive (RFC 9110, 12.4.2).
                    p.strip_prefix("q=")
                        .or_else(|| p.strip_prefix("Q="))
                        .and_then(|q| q.trim().parse::<f32>().ok())
                        .is_some_and(|q| q <= 0.0)
                });
                if refused {
                    continue;
                }
                if name.eq_ignore_ascii_case("gzip") || name == "*" {
                    gzip = true;
                } else if name.eq_ignore_ascii_case("deflate") {
                    deflate = true;
                }
            }
        }
        if gzip {
            Encoding::Gzip
        } else if deflate {
            Encoding::Deflate
        } else {
            Encoding::Identity
        }
    }

    /// The `Content-Encoding` value, `None` for identity.
    pub fn header_value(self) -> Option<HeaderValue> {
        match self {
            Encoding::Identity => None,
            Encoding::Gzip => Some(HeaderValue::from_static("gzip")),
            Encoding::Deflate => Some(HeaderValue::from_static("deflate")),
        }
    }
}

/// Compresses `data` with `enc` at the fast level.
pub fn compress(enc: Encoding, data: &[u8]) -> Bytes {
    let level = flate2::Compression::fast();
    // Writing into a Vec cannot fail, hence the expects.
    match enc {
        Encoding::Identity => Bytes::copy_from_slice(data),
        Encoding::Gzip => {
            let mut e = GzEncoder::new(Vec::with_capacity(data.len() / 2 + 64), level);
            e.write_all(data).expect("writing to a Vec");
            Bytes::from(e.finish().expect("writing to a Vec"))
        }
        Encoding::Deflate => {
            let mut e = ZlibEncoder::new(Vec::with_capacity(data.len() / 2 + 64), level);
            e.write_all(data).expect("writing to a Vec");
            Bytes::from(e.finish().expect("writing to a Vec"))
        }
    }
}

/// Compresses on the blocking pool when `data` is large.
pub async fn compress_async(enc: Encoding, data: Bytes) -> Bytes {
    if data.len() <= INLINE_MAX {
        return compress(enc, &data);
    }
    let fallback = data.clone();
    match tokio::task::spawn_blocking(move || compress(enc, &data)).await {
        Ok(b) => b,
        // The blocking pool is shutting down: compress here rather than fail.
        Err(_) => compress(enc, &fallback),
    }
}

/// Whether a content type is worth compressing.
fn compressible(ct: Option<&HeaderValue>) -> bool {
    let Some(ct) = ct.and_then(|v| v.to_str().ok()) else {
        return false;
    };
    let ct = ct.trim_start().to_ascii_lowercase();
    ct.starts_with("text/")
        || ct.starts_with("application/json")
        || ct.starts_with("application/javascript")
        || ct.starts_with("application/xml")
        || ct.starts_with("image/svg+xml")
}

/// A body fixed at start-up, kept in every encoding worth having.
#[derive(Debug, Clone)]
pub struct FixedBody {
    identity: Bytes,
    gzip: Option<Bytes>,
    deflate: Option<Bytes>,
    content_type: HeaderValue,
    /// The response head hyper would write for each encoding (identity,
    /// gzip, deflate), up to and without its `date` line, for the fixed
    /// lane (see `lane`).
    heads: [Bytes; 3],
}

impl FixedBody {
    /// Compresses `bytes` once per encoding when at least `min_compress`
    /// bytes long and the result is smaller.
    pub fn new(bytes: impl Into<Bytes>, content_type: &'static str, min_compress: usize) -> Self {
        let identity = bytes.into();
        let variant = |enc| {
            (identity.len() >= min_compress)
                .then(|| compress(enc, &identity))
                .filter(|c| c.len() < identity.len())
        };
        let mut body = Self {
            gzip: variant(Encoding::Gzip),
            deflate: variant(Encoding::Deflate),
            identity,
            content_type: HeaderValue::from_static(content_type),
            heads: Default::default(),
        };
        body.heads = ENCODINGS.map(|enc| head_without_date(&body.response(enc)));
        body
    }

    /// The head (without its `date` line and the blank line after it) and
    /// the body of the response for a client accepting `enc`: the bytes
    /// hyper would write for [`FixedBody::response`].
    pub(crate) fn encoded(&self, enc: Encoding) -> (&Bytes, &Bytes) {
        let (i, compressed) = match enc {
            Encoding::Identity => (0, None),
            Encoding::Gzip => (1, self.gzip.as_ref()),
            Encoding::Deflate => (2, self.deflate.as_ref()),
        };
        (&self.heads[i], compressed.unwrap_or(&self.identity))
    }

    /// The uncompressed bytes.
    pub fn bytes(&self) -> &Bytes {
        &self.identity
    }

    /// The response for a client accepting `enc`.
    pub fn response(&self, enc: Encoding) -> Response<Body> {
        let compressed = match enc {
            Encoding::Gzip => self.gzip.as_ref(),
            Encoding::Deflate => self.deflate.as_ref(),
            Encoding::Identity => None,
        };
        let has_variants = self.gzip.is_some() || self.deflate.is_some();
        let body = compressed.unwrap_or(&self.identity).clone();
        let mut resp = Response::new(Body::full(body));
        let h = resp.headers_mut();
        if !self.identity.is_empty() {
            h.insert(CONTENT_TYPE, self.content_type.clone());
        }
        if has_variants {
            h.insert(VARY, HeaderValue::from_static("accept-encoding"));
        }
        if let (Some(_), Some(v)) = (compressed, enc.header_value()) {
            h.insert(CONTENT_ENCODING, v);
        }
        resp
    }
}

const ENCODINGS: [Encoding; 3] = [Encoding::Identity, Encoding::Gzip, Encoding::Deflate];

/// Serializes a fixed response's status line and headers as hyper 1.x does
/// for a `GET`: headers in map order with lowercase names, then the
/// `content-length` it adds. Checked against hyper's own bytes by the
/// `fixed_lane` tests.
fn head_without_date(resp: &Response<Body>) -> Bytes {
    use http_body::Body as _;
    let mut head = Vec::with_capacity(160);
    let status = resp.status();
    head.extend_from_slice(b"HTTP/1.1 ");
    head.extend_from_slice(status.as_str().as_bytes());
    head.push(b' ');
    head.extend_from_slice(status.canonical_reason().unwrap_or("").as_bytes());
    head.extend_from_slice(b"\r\n");
    for (name, value) in resp.headers() {
        head.extend_from_slice(name.as_str().as_bytes());
        head.extend_from_slice(b": ");
        head.extend_from_slice(value.as_bytes());
        head.extend_from_slice(b"\r\n");
    }
    let len = resp.body().size_hint().exact().unwrap_or(0);
    head.extend_from_slice(format!("content-length: {len}\r\n").as_bytes());
    Bytes::from(head)
}

/// Compresses a dynamic response when the client accepts it, the body is in
/// memory, at least `min` bytes, of a compressible type and not already encoded.
pub async fn on_the_fly(resp: Response<Body>, enc: Encoding, min: usize) -> Response<Body> {
    if enc == Encoding::Identity {
        return resp;
    }
    let h = resp.headers();
    let eligible = !h.contains_key(CONTENT_ENCODING)
        && compressible(h.get(CONTENT_TYPE))
        && !h
            .get(CACHE_CONTROL)
            .and_then(|v| v.to_str().ok())
            .is_some_and(|v| v.contains("no-transform"))
        && resp.body().as_bytes().is_some_and(|b| b.len() >= min);
    if !eligible {
        return resp;
    }
    let (mut parts, body) = resp.into_parts();
    let data = Bytes::copy_from_slice(body.as_bytes().unwrap_or_default());
    let compressed = compress_async(enc, data).await;
    if let Some(v) = enc.header_value() {
        parts.headers.insert(CONTENT_ENCODING, v);
    }
    parts
        .headers
        .append(VARY, HeaderValue::from_static("accept-encoding"));
    parts.headers.remove(http::header::CONTENT_LENGTH);
    Response::from_parts(parts, Body::full(compressed))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn accept(v: &'static str) -> HeaderMap {
        let mut h = HeaderMap::new();
        h.insert(http::header::ACCEPT_ENCODING, HeaderValue::from_static(v));
        h
    }

    #[test]
    fn negotiation_prefers_gzip_and_honours_q0() {
        assert_eq!(Encoding::negotiate(&HeaderMap::new()), Encoding::Identity);
        assert_eq!(
            Encoding::negotiate(&accept("gzip, deflate")),
            Encoding::Gzip
        );
        assert_eq!(Encoding::negotiate(&accept("deflate")), Encoding::Deflate);
        assert_eq!(
            Encoding::negotiate(&accept("gzip;q=0, deflate;q=0.5")),
            Encoding::Deflate
        );
        assert_eq!(Encoding::negotiate(&accept("br")), Encoding::Identity);
        // The weight's name is case-insensitive.
        assert_eq!(Encoding::negotiate(&accept("gzip;Q=0")), Encoding::Identity);
    }

    #[test]
    fn fixed_body_round_trips_through_gzip() {
        use std::io::Read as _;
        let text = "hello railyard ".repeat(200);
        let fb = FixedBody::new(text.clone(), "text/plain", 1024);
        let resp = fb.response(Encoding::Gzip);
        assert_eq!(resp.headers()[CONTENT_ENCODING], "gzip");
        let gz = resp.body().as_bytes().unwrap().to_vec();
        let mut out = String::new();
        flate2::read::GzDecoder::new(&gz[..])
            .read_to_string(&mut out)
            .unwrap();
        assert_eq!(out, text);
        let plain = fb.response(Encoding::Identity);
        assert!(plain.headers().get(CONTENT_ENCODING).is_none());
        assert_eq!(plain.body().as_bytes().unwrap(), text.as_bytes());
    }
}
