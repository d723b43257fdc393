//! How the durable stores pack a saga's events into one stored value.
//!
//! The PostgreSQL store writes one row per saga per group commit: its global
//! id in a column (for lookups) and every event of that saga in the commit
//! packed here, in order. The embedded store puts the same packed runs,
//! each with its saga's id, into one value per group commit
//! ([`segment`](super::segment)).
//!
//! Format (version 1), integers little-endian, lengths LEB128:
//! `1u8`, event count, then per event: kind code (`u8`), the strings
//! `local_tx_id`, `parent_tx_id`, `service_name`, `instance_id`,
//! `compensation_method`, `retry_method` (length + UTF-8), `payloads`
//! (length + bytes), `timestamp_ms` (`i64`), then `timeout_s`,
//! `forward_timeout_s`, `forward_retries`, `reverse_retries`,
//! `reverse_timeout_s`, `retry_delay_ms` (`i32` each). The global id is not
//! repeated. Hand-written because it is tiny, fixed, and read only by
//! Railyard; a change of it bumps the stores' schema version.

use bytes::Bytes;

use crate::event::{EventKind, EventRecord};

const VERSION: u8 = 1;

pub(crate) fn put_len(out: &mut Vec<u8>, mut n: usize) {
    loop {
        let byte = (n & 0x7f) as u8;
        n >>= 7;
        if n == 0 {
            out.push(byte);
            return;
        }
        out.push(byte | 0x80);
    }
}

pub(crate) fn put_bytes(out: &mut Vec<u8>, b: &[u8]) {
    put_len(out, b.len());
    out.extend_from_slice(b);
}

/// Packs `events` (all of one saga, in order).
pub fn encode<'a>(events: impl ExactSizeIterator<Item = &'a EventRecord>) -> Vec<u8> {
    let mut out = Vec::with_capacity(16 + events.len() * 160);
    encode_into(&mut out, events);
    out
}

/// Packs `events` (all of one saga, in order) at the end of `out`, as
/// [`encode`] does, without a buffer of its own.
pub(crate) fn encode_into<'a>(
    out: &mut Vec<u8>,
    events: impl ExactSizeIterator<Item = &'a EventRecord>,
) {
    out.push(VERSION);
    put_len(out, events.len());
    for e in events {
        out.push(e.kind.map_or(u8::MAX, EventKind::code));
        for s in [
            e.local_tx_id.as_str(),
            &e.parent_tx_id,
            &e.service_name,
            &e.instance_id,
            &e.compensation_method,
            &e.retry_method,
        ] {
            put_bytes(out, s.as_bytes());
        }
        put_bytes(out, &e.payloads);
        out.extend_from_slice(&e.timestamp_ms.to_le_bytes());
        for n in [
            e.timeout_s,
            e.forward_timeout_s,
            e.forward_retries,
            e.reverse_retries,
            e.reverse_timeout_s,
            e.retry_delay_ms,
        ] {
            out.extend_from_slice(&n.to_le_bytes());
        }
    }
}

/// A cursor over packed bytes; every read checks the length left.
pub(crate) struct Reader<'a> {
    pub(crate) buf: &'a [u8],
}

impl<'a> Reader<'a> {
    pub(crate) fn take(&mut self, n: usize) -> Result<&'a [u8], String> {
        if self.buf.len() < n {
            return Err(format!(
                "truncated: wanted {n} bytes, {} left",
                self.buf.len()
            ));
        }
        let (head, rest) = self.buf.split_at(n);
        self.buf = rest;
        Ok(head)
    }

    pub(crate) fn len(&mut self) -> Result<usize, String> {
        let mut n: usize = 0;
        for shift in (0..64).step_by(7) {
            let b = self.take(1)?[0];
            n |= usize::from(b & 0x7f) << shift;
            if b & 0x80 == 0 {
                return Ok(n);
            }
        }
        Err("length too long".into())
    }

    fn string(&mut self) -> Result<String, String> {
        let n = self.len()?;
        String::from_utf8(self.take(n)?.to_vec()).map_err(|e| format!("bad UTF-8: {e}"))
    }

    pub(crate) fn array<const N: usize>(&mut self) -> Result<[u8; N], String> {
        let mut a = [0u8; N];
        a.copy_from_slice(self.take(N)?);
        Ok(a)
    }

    fn i32(&mut self) -> Result<i32, String> {
        Ok(i32::from_le_bytes(self.array()?))
    }
}

/// How many events `data` (packed by [`encode`]) holds, without decoding
/// them.
///
/// # Errors
/// A description of what is wrong (truncated, unknown version).
pub(crate) fn count(data: &[u8]) -> Result<usize, String> {
    let mut r = Reader { buf: data };
    let version = r.take(1)?[0];
    if version != VERSION {
        return Err(format!("unknown event encoding version {version}"));
    }
    r.len()
}

/// Unpacks what [`encode`] packed, appending to `out`.
///
/// # Errors
/// A description of what is wrong (truncated, unknown version or kind).
pub(crate) fn decode(
    global_tx_id: &str,
    data: &[u8],
    out: &mut Vec<EventRecord>,
) -> Result<(), String> {
    let mut r = Reader { buf: data };
    let version = r.take(1)?[0];
    if version != VERSION {
        return Err(format!("unknown event encoding version {version}"));
    }
    let count = r.len()?;
    // Each event takes at least 45 bytes: a corrupt count cannot make us
    // reserve much.
    out.reserve(count.min(data.len() / 45 + 1));
    for _ in 0..count {
        let code = r.take(1)?[0];
        let kind =
            EventKind::from_code(code).ok_or_else(|| format!("unknown event kind code {code}"))?;
        let local_tx_id = r.string()?;
        let parent_tx_id = r.string()?;
        let service_name = r.string()?;
        let instance_id = r.string()?;
        let compensation_method = r.string()?;
        let retry_method = r.string()?;
        let n = r.len()?;
        let payloads = Bytes::copy_from_slice(r.take(n)?);
        let timestamp_ms = i64::from_le_bytes(r.array()?);
        out.push(EventRecord {
            global_tx_id: global_tx_id.to_owned(),
            local_tx_id,
            parent_tx_id,
            kind: Some(kind),
            service_name: service_name.into(),
            instance_id: instance_id.into(),
            compensation_method,
            payloads,
            timestamp_ms,
            timeout_s: r.i32()?,
            forward_timeout_s: r.i32()?,
            forward_retries: r.i32()?,
            reverse_retries: r.i32()?,
            reverse_timeout_s: r.i32()?,
            retry_delay_ms: r.i32()?,
            retry_method,
        });
    }
    if !r.buf.is_empty() {
        return Err(format!("{} trailing bytes", r.buf.len()));
    }
    Ok(())
}

/// Splits a group commit's appends into one run per saga, in order of each
/// saga's first event; each saga's events keep their order. Concurrent
/// appends have no order between them, so this reordering across sagas is
/// invisible to callers; appends of one caller are in separate commits
/// unless they were concurrent.
pub(crate) fn group_by_saga<'a>(
    events: impl Iterator<Item = &'a EventRecord>,
) -> Vec<(&'a str, Vec<&'a EventRecord>)> {
    let mut at: std::collections::HashMap<&'a str, usize> = std::collections::HashMap::new();
    let mut out: Vec<(&'a str, Vec<&'a EventRecord>)> = Vec::new();
    for e in events {
        let g = e.global_tx_id.as_str();
        match at.get(g) {
            Some(&i) => out[i].1.push(e),
            None => {
                at.insert(g, out.len());
                out.push((g, vec![e]));
            }
        }
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn round_trips_every_field_and_rejects_damage() {
        let events: Vec<EventRecord> = (0..3)
            .map(|i| EventRecord {
                global_tx_id: "g".into(),
                local_tx_id: format!("l{i}"),
                parent_tx_id: "p".into(),
                kind: Some(EventKind::ALL[i]),
                service_name: "svc é".into(),
                instance_id: "i".repeat(200).into(),
                compensation_method: "m".into(),
                payloads: Bytes::from(vec![0, 255, i as u8]),
                timestamp_ms: -5,
                timeout_s: 1,
                forward_timeout_s: -2,
                forward_retries: 3,
                reverse_retries: i32::MAX,
                reverse_timeout_s: i32::MIN,
                retry_delay_ms: 6,
                retry_method: "r".into(),
            })
            .collect();
        let data = encode(events.iter());
        let mut back = Vec::new();
        decode("g", &data, &mut back).unwrap();
        assert_eq!(back, events);
        for cut in [0, 1, 5, data.len() - 1] {
            assert!(decode("g", &data[..cut], &mut Vec::new()).is_err());
        }
        let mut extra = data.clone();
        extra.push(0);
        assert!(decode("g", &extra, &mut Vec::new()).is_err());
        let mut version = data;
        version[0] = 9;
        assert!(decode("g", &version, &mut Vec::new()).is_err());
    }
}
