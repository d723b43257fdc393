//! How the durable stores pack a saga's events into one stored value.
//!
//! Both durable stores put the packed runs, each with its saga's id, into
//! one value per group commit ([`segment`](super::segment)).
//!
//! Format (version 1), integers little-endian, lengths LEB128:
//! `1u8`, event count, then per event: kind code (`u8`), the strings
//! `local_tx_id`, `parent_tx_id`, `service_name`, `instance_id`,
//! `compensation_method`, `retry_method` (length + UTF-8), `payloads`
//! (length + bytes), `timestamp_ms` (`i64`), then `timeout_s`,
//! `forward_timeout_s`, `forward_retries`, `reverse_retries`,
//! `reverse_timeout_s`, `retry_delay_ms` (`i32` each). The global id is not
//! repeated. No store writes this version any more: segments of the
//! embedded store's schema before version 4, and the rows of the PostgreSQL
//! store's schema version 1 (migrated into segments on connect), hold it,
//! and it is still read.
//!
//! Version 2, written by both stores into their segments, packs the
//! same fields in about a third of the bytes, because a group commit's
//! events repeat a few names over and over: `2u8`, event count, then per
//! event: kind code, `local_tx_id` and `parent_tx_id` each as a
//! *reference* (LEB128 `0`: the saga's global id; `1`: empty; `n >= 2`: the
//! `n - 2` bytes that follow), `service_name`, `instance_id`,
//! `compensation_method`, `retry_method` each as an index (LEB128) into
//! the segment's string table ([`Strings`]), `payloads` (length + bytes),
//! then `timestamp_ms` and the six `i32`s zigzag-encoded LEB128.
//!
//! Hand-written because it is tiny, fixed, and read only by Railyard; a
//! new version bumps the stores' schema version, so that an older
//! Railyard refuses a store it could not read.

use std::sync::Arc;

use bytes::Bytes;

use crate::event::{EventKind, EventRecord};

const VERSION: u8 = 1;
const VERSION_2: u8 = 2;

/// The hasher of the string table (short names).
type Hasher = foldhash::fast::RandomState;

/// The most shared copies a table remembers by address (a native session's
/// participants have a service, an instance and a few method names each,
/// and a segment spans many sessions).
const SHARED_NAMES: usize = 256;

/// A segment's string table being built: each distinct name once, in
/// first-use order, numbered from 0.
#[derive(Debug, Default)]
pub(crate) struct Strings {
    at: std::collections::HashMap<Box<str>, u32, Hasher>,
    /// Numbers of shared names (service, instance and, from a native
    /// session, compensation method: its events point at one copy of each)
    /// by the address of that copy, so that most look-ups neither hash nor
    /// compare the name's bytes, which sit cold in another thread's cache.
    /// Each entry holds its copy, so no address here can be reused by
    /// another name while the table lives.
    shared: std::collections::HashMap<usize, (u32, Arc<str>), Hasher>,
    /// The number of the empty name (most events' retry method), once
    /// used, so that it costs no hash look-up and no `memcmp` per event.
    empty: Option<u32>,
    /// The table as stored: each string as length + UTF-8.
    packed: Vec<u8>,
}

impl Strings {
    /// Names in the table.
    pub(crate) fn len(&self) -> usize {
        self.at.len()
    }

    /// Empties the table, keeping its memory.
    pub(crate) fn clear(&mut self) {
        self.at.clear();
        self.shared.clear();
        self.empty = None;
        self.packed.clear();
    }

    /// The number of a shared name, added if new.
    fn index_shared(&mut self, s: &Arc<str>) -> u32 {
        let addr = Arc::as_ptr(s).cast::<u8>() as usize;
        if let Some(&(i, _)) = self.shared.get(&addr) {
            return i;
        }
        let i = self.index(s);
        // A reporter that does not share its names (Omega's events each
        // bring their own copy) would only fill the map: stop at a bound.
        if self.shared.len() < SHARED_NAMES {
            self.shared.insert(addr, (i, s.clone()));
        }
        i
    }

    /// The number of `s`, added if new.
    fn index(&mut self, s: &str) -> u32 {
        if s.is_empty() {
            if let Some(i) = self.empty {
                return i;
            }
        } else if let Some(&i) = self.at.get(s) {
            return i;
        }
        let i = u32::try_from(self.at.len()).unwrap_or(u32::MAX);
        self.at.insert(s.into(), i);
        put_bytes(&mut self.packed, s.as_bytes());
        if s.is_empty() {
            self.empty = Some(i);
        }
        i
    }

    /// Appends the table (count, then its strings) to `out`.
    pub(crate) fn write(&self, out: &mut Vec<u8>) {
        put_len(out, self.at.len());
        out.extend_from_slice(&self.packed);
    }
}

/// Reads a table written by [`Strings::write`] (all of `data`).
///
/// # Errors
/// What is wrong (truncated, bad UTF-8, trailing bytes).
pub(crate) fn read_strings(data: &[u8]) -> Result<Vec<&str>, String> {
    let mut r = Reader { buf: data };
    let n = r.len()?;
    // Each string takes at least a byte: a corrupt count cannot make us
    // reserve much.
    let mut out = Vec::with_capacity(n.min(data.len()));
    for _ in 0..n {
        let len = r.len()?;
        out.push(
            std::str::from_utf8(r.take(len)?)
                .map_err(|e| format!("bad UTF-8 in the table: {e}"))?,
        );
    }
    if !r.buf.is_empty() {
        return Err(format!("{} trailing bytes after the table", r.buf.len()));
    }
    Ok(out)
}

fn zigzag(n: i64) -> u64 {
    ((n << 1) ^ (n >> 63)) as u64
}

fn unzigzag(n: u64) -> i64 {
    ((n >> 1) as i64) ^ -((n & 1) as i64)
}

fn put_ref(out: &mut Vec<u8>, global_tx_id: &str, s: &str) {
    if s == global_tx_id {
        out.push(0);
    } else if s.is_empty() {
        out.push(1);
    } else {
        put_len(out, s.len() + 2);
        out.extend_from_slice(s.as_bytes());
    }
}

/// Packs `events` (all of `global_tx_id`, in order) at the end of `out` in
/// version 2, their names numbered in `strings`.
pub(crate) fn encode_v2_into(
    out: &mut Vec<u8>,
    global_tx_id: &str,
    events: &[EventRecord],
    strings: &mut Strings,
) {
    out.push(VERSION_2);
    put_len(out, events.len());
    for e in events {
        out.push(e.kind.map_or(u8::MAX, EventKind::code));
        put_ref(out, global_tx_id, &e.local_tx_id);
        put_ref(out, global_tx_id, &e.parent_tx_id);
        for s in [&e.service_name, &e.instance_id, &e.compensation_method] {
            put_len(out, strings.index_shared(s) as usize);
        }
        put_len(out, strings.index(&e.retry_method) as usize);
        put_bytes(out, &e.payloads);
        put_u64(out, zigzag(e.timestamp_ms));
        for n in numbers(e) {
            put_u64(out, zigzag(i64::from(n)));
        }
    }
}

/// An event's six integer fields, in the order both versions write them.
fn numbers(e: &EventRecord) -> [i32; 6] {
    [
        e.timeout_s,
        e.forward_timeout_s,
        e.forward_retries,
        e.reverse_retries,
        e.reverse_timeout_s,
        e.retry_delay_ms,
    ]
}

fn put_u64(out: &mut Vec<u8>, mut n: u64) {
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

pub(crate) fn put_len(out: &mut Vec<u8>, n: usize) {
    put_u64(out, n as u64);
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
        for n in numbers(e) {
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
        usize::try_from(self.u64()?).map_err(|_| "length too long".to_owned())
    }

    fn u64(&mut self) -> Result<u64, String> {
        let mut n: u64 = 0;
        for shift in (0..64).step_by(7) {
            let b = self.take(1)?[0];
            n |= u64::from(b & 0x7f) << shift;
            if b & 0x80 == 0 {
                return Ok(n);
            }
        }
        Err("integer too long".into())
    }

    fn zigzag_i32(&mut self) -> Result<i32, String> {
        i32::try_from(unzigzag(self.u64()?)).map_err(|_| "an i32 field out of range".to_owned())
    }

    /// A version-2 string reference (see the module docs).
    fn reference(&mut self, global_tx_id: &str) -> Result<String, String> {
        match self.len()? {
            0 => Ok(global_tx_id.to_owned()),
            1 => Ok(String::new()),
            n => {
                let b = self.take(n - 2)?;
                String::from_utf8(b.to_vec()).map_err(|e| format!("bad UTF-8: {e}"))
            }
        }
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
    if version != VERSION && version != VERSION_2 {
        return Err(format!("unknown event encoding version {version}"));
    }
    r.len()
}

/// Unpacks what [`encode`] (version 1) or [`encode_v2_into`] (version 2,
/// whose names are numbers into `strings`, its segment's table) packed,
/// appending to `out`.
///
/// # Errors
/// A description of what is wrong (truncated, unknown version or kind, a
/// name's number outside `strings`).
pub(crate) fn decode(
    global_tx_id: &str,
    data: &[u8],
    strings: &[&str],
    out: &mut Vec<EventRecord>,
) -> Result<(), String> {
    let mut r = Reader { buf: data };
    let version = r.take(1)?[0];
    if version != VERSION && version != VERSION_2 {
        return Err(format!("unknown event encoding version {version}"));
    }
    let count = r.len()?;
    // Each event takes at least 13 bytes: a corrupt count cannot make us
    // reserve much.
    out.reserve(count.min(data.len() / 13 + 1));
    for _ in 0..count {
        out.push(decode_event(version, global_tx_id, &mut r, strings)?);
    }
    if !r.buf.is_empty() {
        return Err(format!("{} trailing bytes", r.buf.len()));
    }
    Ok(())
}

fn kind_of(r: &mut Reader<'_>) -> Result<EventKind, String> {
    let code = r.take(1)?[0];
    EventKind::from_code(code).ok_or_else(|| format!("unknown event kind code {code}"))
}

/// One event of either version: both write the same fields in the same
/// order and differ only in how ids, names and integers are written.
fn decode_event(
    version: u8,
    global_tx_id: &str,
    r: &mut Reader<'_>,
    strings: &[&str],
) -> Result<EventRecord, String> {
    let v1 = version == VERSION;
    let id = |r: &mut Reader<'_>| {
        if v1 {
            r.string()
        } else {
            r.reference(global_tx_id)
        }
    };
    let name = |r: &mut Reader<'_>| -> Result<String, String> {
        if v1 {
            return r.string();
        }
        let i = r.len()?;
        strings.get(i).map(|s| (*s).to_owned()).ok_or_else(|| {
            format!(
                "name number {i} outside the segment's table of {}",
                strings.len()
            )
        })
    };
    let int = |r: &mut Reader<'_>| if v1 { r.i32() } else { r.zigzag_i32() };
    let kind = kind_of(r)?;
    let local_tx_id = id(r)?;
    let parent_tx_id = id(r)?;
    let service_name = name(r)?;
    let instance_id = name(r)?;
    let compensation_method = name(r)?;
    let retry_method = name(r)?;
    let n = r.len()?;
    let payloads = Bytes::copy_from_slice(r.take(n)?);
    let timestamp_ms = if v1 {
        i64::from_le_bytes(r.array()?)
    } else {
        unzigzag(r.u64()?)
    };
    Ok(EventRecord {
        global_tx_id: global_tx_id.to_owned(),
        local_tx_id,
        parent_tx_id,
        kind: Some(kind),
        service_name: service_name.into(),
        instance_id: instance_id.into(),
        compensation_method: compensation_method.into(),
        payloads,
        timestamp_ms,
        timeout_s: int(r)?,
        forward_timeout_s: int(r)?,
        forward_retries: int(r)?,
        reverse_retries: int(r)?,
        reverse_timeout_s: int(r)?,
        retry_delay_ms: int(r)?,
        retry_method,
        // Not stored (live only): see `EventRecord::attempt`.
        attempt: 0,
    })
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
                // Live only, not stored: round-trips as 0.
                attempt: 0,
            })
            .collect();
        let data = encode(events.iter());
        let mut back = Vec::new();
        decode("g", &data, &[], &mut back).unwrap();
        assert_eq!(back, events);
        for cut in [0, 1, 5, data.len() - 1] {
            assert!(decode("g", &data[..cut], &[], &mut Vec::new()).is_err());
        }
        let mut extra = data.clone();
        extra.push(0);
        assert!(decode("g", &extra, &[], &mut Vec::new()).is_err());
        let mut version = data;
        version[0] = 9;
        assert!(decode("g", &version, &[], &mut Vec::new()).is_err());
    }

    fn sample(i: usize) -> EventRecord {
        EventRecord {
            global_tx_id: "g".into(),
            // The global id, empty, and a literal, in turn.
            local_tx_id: ["g", "", "l"][i % 3].into(),
            parent_tx_id: ["", "l", "g"][i % 3].into(),
            kind: Some(EventKind::ALL[i % EventKind::ALL.len()]),
            service_name: ["svc é", "other"][i % 2].into(),
            instance_id: "i".repeat(200).into(),
            compensation_method: "m".into(),
            payloads: Bytes::from(vec![0, 255, i as u8]),
            timestamp_ms: [i64::MIN, -5, 0, 1_700_000_000_000, i64::MAX][i % 5],
            timeout_s: i32::MIN,
            forward_timeout_s: -2,
            forward_retries: 0,
            reverse_retries: i32::MAX,
            reverse_timeout_s: 1,
            retry_delay_ms: -1,
            retry_method: String::new(),
            attempt: 0,
        }
    }

    #[test]
    fn shared_names_are_numbered_by_content_whoever_holds_them() {
        let mut strings = Strings::default();
        let a: Arc<str> = "orders".into();
        let same_text: Arc<str> = "orders".into();
        let other: Arc<str> = "payments".into();
        let first = strings.index_shared(&a);
        assert_eq!(strings.shared.len(), 1, "its address is remembered");
        assert_eq!(strings.index_shared(&a), first, "by address");
        assert_eq!(strings.shared.len(), 1);
        assert_eq!(strings.index_shared(&same_text), first, "another copy");
        assert_eq!(strings.index("orders"), first, "by content");
        let second = strings.index_shared(&other);
        assert_ne!(second, first);
        // Past the bound, copies are still numbered by their content.
        let copies: Vec<Arc<str>> = (0..SHARED_NAMES * 2)
            .map(|i| Arc::from(format!("n{}", i % 3)))
            .collect();
        let numbers: Vec<u32> = copies.iter().map(|c| strings.index_shared(c)).collect();
        for (c, n) in copies.iter().zip(&numbers) {
            assert_eq!(strings.index(c), *n);
        }
        assert_eq!(strings.shared.len(), SHARED_NAMES);
        assert_eq!(strings.len(), 5);
        // A cleared table forgets the addresses and lets the copies go.
        strings.clear();
        assert!(strings.shared.is_empty());
        assert_eq!(Arc::strong_count(&a), 1);
        assert_eq!(strings.index_shared(&other), 0);
        // The empty name is numbered once, kept across other names, and
        // forgotten with the table.
        let empty = strings.index("");
        assert_eq!(empty, 1);
        assert_eq!(strings.index("x"), 2);
        assert_eq!(strings.index(""), empty);
        assert_eq!(strings.len(), 3);
        strings.clear();
        assert_eq!(strings.index("y"), 0);
        assert_eq!(strings.index(""), 1, "added again after a clear");
        let mut table = Vec::new();
        strings.write(&mut table);
        assert_eq!(read_strings(&table).unwrap(), ["y", ""]);
    }

    #[test]
    fn shared_and_separate_copies_of_names_encode_to_the_same_bytes() {
        // One copy of each name for every event, as a native session has.
        let services: [Arc<str>; 2] = ["svc é".into(), "other".into()];
        let instance: Arc<str> = "i".repeat(200).into();
        let method: Arc<str> = "m".into();
        let mut shared: Vec<EventRecord> = (0..10).map(sample).collect();
        for (i, e) in shared.iter_mut().enumerate() {
            assert_eq!(e.service_name, services[i % 2]);
            e.service_name = services[i % 2].clone();
            e.instance_id = instance.clone();
            e.compensation_method = method.clone();
        }
        let mut separate = shared.clone();
        for e in &mut separate {
            e.service_name = Arc::from(&*e.service_name);
            e.instance_id = Arc::from(&*e.instance_id);
            e.compensation_method = Arc::from(&*e.compensation_method);
        }
        let encoded = |events: &[EventRecord]| {
            let mut strings = Strings::default();
            let mut data = Vec::new();
            encode_v2_into(&mut data, "g", events, &mut strings);
            strings.write(&mut data);
            data
        };
        assert_eq!(encoded(&shared), encoded(&separate));
    }

    #[test]
    fn version_2_round_trips_every_field_through_its_table() {
        let events: Vec<EventRecord> = (0..10).map(sample).collect();
        let mut strings = Strings::default();
        let mut data = Vec::new();
        encode_v2_into(&mut data, "g", &events, &mut strings);
        // A second run of the same names adds nothing to the table.
        let first = strings.at.len();
        encode_v2_into(&mut Vec::new(), "g", &events, &mut strings);
        assert_eq!(strings.at.len(), first);
        assert_eq!(
            first, 5,
            "two services, an instance, a method, the empty name"
        );
        let mut table = Vec::new();
        strings.write(&mut table);
        let names = read_strings(&table).unwrap();
        assert_eq!(count(&data).unwrap(), 10);
        let mut back = Vec::new();
        decode("g", &data, &names, &mut back).unwrap();
        assert_eq!(back, events);
        // Smaller than version 1 by far, with these repeated names.
        assert!(
            data.len() * 3 < encode(events.iter()).len(),
            "{}",
            data.len()
        );
        // Damage: a cut, a trailing byte, a name outside the table.
        for cut in [0, 1, 5, data.len() - 1] {
            assert!(decode("g", &data[..cut], &names, &mut Vec::new()).is_err());
        }
        let mut extra = data.clone();
        extra.push(0);
        assert!(decode("g", &extra, &names, &mut Vec::new()).is_err());
        let err = decode("g", &data, &names[..2], &mut Vec::new()).unwrap_err();
        assert!(err.contains("outside the segment's table"), "{err}");
        assert!(read_strings(&table[..table.len() - 1]).is_err());
    }

    #[test]
    fn zigzag_round_trips_the_extremes() {
        for n in [i64::MIN, -1, 0, 1, i64::MAX, i64::from(i32::MIN)] {
            assert_eq!(unzigzag(zigzag(n)), n);
        }
        assert_eq!(zigzag(-1), 1);
        assert_eq!(zigzag(1), 2);
    }
}
