//! The log segments both durable stores write (SQLite and PostgreSQL): one
//! packed value per group commit, and the in-memory index that says when a
//! segment may be deleted.
//!
//! # Format (version 2)
//! `2u8`, then entries in queue order, then the segment's string table
//! ([`Strings`]: count, then each name as LEB128 length + UTF-8), then a
//! `u32` (little-endian): where the table starts. Entries:
//! - `1u8`, the global id (LEB128 length + UTF-8), a `u32` (little-endian)
//!   byte length, then that saga's consecutive events packed by
//!   [`codec`](super::codec) in its version 2, whose service, instance and
//!   method names are numbers into the table;
//! - `2u8`, the global id: the saga was finished here (a *mark*): its
//!   events in this segment before the mark and in earlier segments are
//!   dead.
//!
//! Version 1 (written by the SQLite store before its schema version 4, and
//! by the PostgreSQL store's migration of a version-1 database; still read)
//! has the same entries with events in codec version 1, no table and no
//! trailer.
//!
//! Reading the segments in order and applying entries and marks gives
//! exactly what the store holds: the events of unfinished sagas in append
//! order (an event appended after its saga's finish stays, as in
//! [`MemoryStore`](super::MemoryStore)). Entries can be skipped by length,
//! so indexing a segment does not decode its events.
//!
//! # When a segment goes
//! [`Index`] tracks, per segment, how many unfinished sagas have entries
//! in it (`live`) and how many of its marks still cover events in an
//! earlier segment that exists (`pins`). A segment is deleted when both
//! are zero: nothing in it is needed any more. Marks only point back, so
//! the oldest segment never has pins and deletions always make progress.
//! A saga that never finishes keeps its segments (with whatever dead
//! entries share them). A kept segment's marks pin the segment they are
//! in, whose own dead entries pin the marks after them, and so on: one
//! saga that never finishes would keep every later segment. So a segment
//! kept only by its pins, once it is [`STRIP_LAG`] commits old, is
//! *stripped*: rewritten with its marks alone ([`marks_only`]); its dead
//! entries then count as gone, which releases the pins that covered them.
//! Disk is then bounded by the unfinished sagas times the size of a group
//! commit, plus a mark per finished saga that shared a segment with one.

use std::collections::{BTreeMap, BTreeSet, HashMap};

use super::codec::{self, put_len, read_strings, Reader, Strings};
use super::queue::{WriteOp, WriteRequest};
use super::{SagaSummary, StoreError};
use crate::event::EventRecord;

/// How many commits old a segment kept only by its pins must be before it
/// is stripped. Pins usually go within a few commits (the sagas whose
/// marks they are end in milliseconds); stripping only old ones keeps the
/// rewrite off the common path.
pub(crate) const STRIP_LAG: i64 = 64;

const VERSION_1: u8 = 1;
const VERSION: u8 = 2;
const EVENTS: u8 = 1;
const MARK: u8 = 2;

/// The hasher of the index's tables (short random ids).
type Hasher = foldhash::fast::RandomState;

/// A segment being built by the writer, kept across commits (its buffer
/// and table keep their memory, so a commit does not fault in fresh pages).
#[derive(Debug, Default)]
pub(crate) struct SegmentBuf {
    data: Vec<u8>,
    strings: Strings,
    entries: usize,
}

impl SegmentBuf {
    /// Starts a new segment, with room for about `events` events.
    pub(crate) fn start(&mut self, events: usize) {
        self.data.clear();
        self.data.reserve(64 + events * 64);
        self.data.push(VERSION);
        self.strings.clear();
        self.entries = 0;
    }

    pub(crate) fn is_empty(&self) -> bool {
        self.entries == 0
    }

    /// Adds consecutive events of one saga.
    pub(crate) fn events(&mut self, global_tx_id: &str, events: &[EventRecord]) {
        self.entries += 1;
        self.data.push(EVENTS);
        codec::put_bytes(&mut self.data, global_tx_id.as_bytes());
        let at = self.data.len();
        self.data.extend_from_slice(&[0; 4]);
        codec::encode_v2_into(&mut self.data, global_tx_id, events, &mut self.strings);
        let n = u32::try_from(self.data.len() - at - 4).unwrap_or(u32::MAX);
        self.data[at..at + 4].copy_from_slice(&n.to_le_bytes());
    }

    /// Gives back the memory one unusually large commit took (its buffer
    /// past 16 MiB, its table past 4,096 names), once that commit is done.
    pub(crate) fn give_back_if_large(&mut self) {
        if self.data.capacity() > 16 << 20 {
            self.data = Vec::new();
        }
        if self.strings.len() > 4096 {
            self.strings = Strings::default();
        }
    }

    /// Ends the segment (its table and trailer) and returns it whole.
    pub(crate) fn finish(&mut self) -> &[u8] {
        let table = u32::try_from(self.data.len()).unwrap_or(u32::MAX);
        self.strings.write(&mut self.data);
        self.data.extend_from_slice(&table.to_le_bytes());
        &self.data
    }

    /// A whole segment of one entry whose events are already packed by
    /// [`codec`] version 1 (migrating the one-row-per-saga layout).
    pub(crate) fn packed(global_tx_id: &str, packed: &[u8]) -> Vec<u8> {
        let mut data = Vec::with_capacity(packed.len() + global_tx_id.len() + 16);
        data.push(VERSION_1);
        data.push(EVENTS);
        codec::put_bytes(&mut data, global_tx_id.as_bytes());
        let n = u32::try_from(packed.len()).unwrap_or(u32::MAX);
        data.extend_from_slice(&n.to_le_bytes());
        data.extend_from_slice(packed);
        data
    }

    /// Adds a finish mark.
    pub(crate) fn mark(&mut self, global_tx_id: &str) {
        self.entries += 1;
        self.data.push(MARK);
        put_len(&mut self.data, global_tx_id.len());
        self.data.extend_from_slice(global_tx_id.as_bytes());
    }
}

/// What one group commit writes, from [`apply`].
pub(crate) struct Commit<'a> {
    /// Whether its segment is stored: it has entries, and something still
    /// needs them (a commit whose marks only covered segments freed in the
    /// same commit frees its own segment too: it is not written at all,
    /// rather than inserted and deleted in one transaction).
    pub(crate) store_segment: bool,
    /// Summaries to keep, in order.
    pub(crate) keep: Vec<&'a SagaSummary>,
    /// Stored segments nothing needs any more, to delete.
    pub(crate) gone: Vec<i64>,
}

/// Applies one group commit's requests, in queue order, to `index` and
/// to `seg`, started afresh as segment `seq`: each run of consecutive
/// events of one saga becomes an entry, each finish of a saga with events
/// stored a mark. Both durable stores write a commit this way.
pub(crate) fn apply<'a>(
    batch: &'a [WriteRequest],
    seq: i64,
    seg: &mut SegmentBuf,
    index: &mut Index,
) -> Commit<'a> {
    let events: usize = batch
        .iter()
        .map(|r| match &r.op {
            WriteOp::Append(e) => e.len(),
            WriteOp::Finish(_) => 0,
        })
        .sum();
    seg.start(events);
    let mut touched = vec![seq];
    let mut keep = Vec::new();
    for req in batch {
        match &req.op {
            WriteOp::Append(evs) => {
                for run in evs.chunk_by(|a, b| a.global_tx_id == b.global_tx_id) {
                    let g = run[0].global_tx_id.as_str();
                    seg.events(g, run);
                    index.events(seq, g, run.len() as u64);
                }
            }
            WriteOp::Finish(done) => {
                for s in done {
                    if index.finish(seq, &s.global_tx_id, &mut touched) {
                        seg.mark(&s.global_tx_id);
                    }
                    keep.push(s);
                }
            }
        }
    }
    let mut gone = index.collect(touched);
    let own = gone.iter().position(|g| *g == seq);
    if let Some(at) = own {
        gone.swap_remove(at);
    }
    Commit {
        store_segment: !seg.is_empty() && own.is_none(),
        keep,
        gone,
    }
}

/// Rebuilds the writer's [`Index`] from the stored segments, fed in `seq`
/// order (when a store opens, and after a commit whose outcome is unknown).
#[derive(Default)]
pub(crate) struct Rebuild {
    index: Index,
    touched: Vec<i64>,
    max_seq: i64,
}

impl Rebuild {
    /// Indexes one stored segment.
    ///
    /// # Errors
    /// [`StoreError::Corrupt`] naming the segment, if its bytes are wrong.
    pub(crate) fn segment(&mut self, seq: i64, data: &[u8]) -> Result<(), StoreError> {
        self.index
            .index_segment(seq, data, &mut self.touched)
            .map_err(|e| StoreError::Corrupt(format!("log segment {seq}: {e}")))?;
        self.max_seq = seq;
        Ok(())
    }

    /// The index, the stored segments nothing needs (left by a crash
    /// between a commit and the next: to delete), and the highest `seq`
    /// stored (0 if none).
    pub(crate) fn finish(mut self) -> (Index, Vec<i64>, i64) {
        let gone = self.index.collect(self.touched);
        (self.index, gone, self.max_seq)
    }
}

/// One entry of a stored segment.
pub(crate) enum Entry<'a> {
    /// Events of one saga, still packed.
    Events {
        global_tx_id: &'a str,
        packed: &'a [u8],
    },
    /// The saga was finished.
    Mark { global_tx_id: &'a str },
}

/// Walks a stored segment's entries, calling `f` for each in order with
/// the segment's string table (empty in version 1).
///
/// # Errors
/// What is wrong with the bytes (truncated, unknown version or tag).
pub(crate) fn entries<'a>(
    data: &'a [u8],
    mut f: impl FnMut(Entry<'a>, &[&'a str]) -> Result<(), String>,
) -> Result<(), String> {
    let mut r = Reader { buf: data };
    let version = r.take(1)?[0];
    let strings = match version {
        VERSION_1 => Vec::new(),
        VERSION => {
            let Some((body, trailer)) = data.len().checked_sub(4).map(|n| data.split_at(n)) else {
                return Err("truncated: no table offset".into());
            };
            let mut at = [0u8; 4];
            at.copy_from_slice(trailer);
            let at = u32::from_le_bytes(at) as usize;
            if at < 1 || at > body.len() {
                return Err(format!(
                    "table offset {at} outside the segment's {} bytes",
                    body.len()
                ));
            }
            r.buf = &body[1..at];
            read_strings(&body[at..])?
        }
        v => return Err(format!("unknown segment version {v}")),
    };
    while !r.buf.is_empty() {
        let tag = r.take(1)?[0];
        let n = r.len()?;
        let id = std::str::from_utf8(r.take(n)?).map_err(|e| format!("bad UTF-8 id: {e}"))?;
        match tag {
            EVENTS => {
                let n = u32::from_le_bytes(r.array()?) as usize;
                f(
                    Entry::Events {
                        global_tx_id: id,
                        packed: r.take(n)?,
                    },
                    &strings,
                )?;
            }
            MARK => f(Entry::Mark { global_tx_id: id }, &strings)?,
            t => return Err(format!("unknown segment entry tag {t}")),
        }
    }
    Ok(())
}

/// Replays segments (in `seq` order) into the events of unfinished sagas,
/// in append order; `only` restricts it to one saga.
#[derive(Debug, Default)]
pub(crate) struct Replay {
    events: Vec<Option<EventRecord>>,
    by_saga: HashMap<String, Vec<usize>, Hasher>,
}

impl Replay {
    /// Applies one stored segment.
    ///
    /// # Errors
    /// What is wrong with its bytes.
    pub(crate) fn segment(&mut self, data: &[u8], only: Option<&str>) -> Result<(), String> {
        entries(data, |e, strings| {
            match e {
                Entry::Events {
                    global_tx_id,
                    packed,
                } => {
                    if only.is_some_and(|o| o != global_tx_id) {
                        return Ok(());
                    }
                    let mut evs = Vec::new();
                    codec::decode(global_tx_id, packed, strings, &mut evs)
                        .map_err(|e| format!("events of saga {global_tx_id}: {e}"))?;
                    let at = self.by_saga.entry(global_tx_id.to_owned()).or_default();
                    for ev in evs {
                        at.push(self.events.len());
                        self.events.push(Some(ev));
                    }
                }
                Entry::Mark { global_tx_id } => {
                    for i in self.by_saga.remove(global_tx_id).into_iter().flatten() {
                        self.events[i] = None;
                    }
                }
            }
            Ok(())
        })
    }

    /// The events left, in append order.
    pub(crate) fn into_events(self) -> Vec<EventRecord> {
        self.events.into_iter().flatten().collect()
    }
}

/// An unfinished saga: the segments holding its events (ascending, each
/// once) and how many events.
#[derive(Debug, Default, Clone, PartialEq, Eq)]
struct Live {
    segs: Vec<i64>,
    events: u64,
}

/// What the index knows of one stored segment.
#[derive(Debug, Default, Clone, PartialEq, Eq)]
struct Seg {
    /// Unfinished sagas with entries in it.
    live: u32,
    /// Its marks that still cover entries in earlier existing segments.
    pins: u32,
    /// Finished sagas (keys of `Index::dead`) with entries in it whose
    /// mark is in a later segment.
    dead: Vec<u64>,
}

/// A segment old enough to strip, read back as its marks only ([`marks_only`]);
/// `None`, logged, if it cannot be read back: it is then left as it is (a
/// restart would refuse it too, and say so), and commits go on.
pub(crate) fn strip(seq: i64, data: &[u8]) -> Option<Vec<u8>> {
    match marks_only(data) {
        Ok(marks) => Some(marks),
        Err(e) => {
            tracing::error!(segment = seq, error = %e, "a log segment cannot be read back; not stripped");
            None
        }
    }
}

/// A stored segment rewritten with its marks alone (see the module docs):
/// the same version-2 layout, with an empty string table.
///
/// # Errors
/// What is wrong with the stored bytes.
pub(crate) fn marks_only(data: &[u8]) -> Result<Vec<u8>, String> {
    let mut buf = SegmentBuf::default();
    buf.start(0);
    entries(data, |e, _| {
        if let Entry::Mark { global_tx_id } = e {
            buf.mark(global_tx_id);
        }
        Ok(())
    })?;
    Ok(buf.finish().to_vec())
}

/// A finished saga whose mark still matters.
#[derive(Debug, Clone, PartialEq, Eq)]
struct Dead {
    /// The segment holding its mark.
    mark: i64,
    /// Earlier segments with its entries that still exist.
    remaining: u32,
}

/// The writer's in-memory index of the log (see the module docs). Bounded
/// by the unfinished sagas and the segments they keep; rebuilt from the
/// segments on open ([`Index::index_segment`]).
#[derive(Debug, Default, Clone, PartialEq, Eq)]
pub(crate) struct Index {
    sagas: HashMap<Box<str>, Live, Hasher>,
    segs: BTreeMap<i64, Seg>,
    dead: HashMap<u64, Dead, Hasher>,
    next_dead: u64,
    /// Segments that were, when [`collect`](Self::collect) last looked at
    /// them, kept only by their pins with dead entries: the only ones
    /// [`take_strip_due`](Self::take_strip_due) may hand out. A segment becomes such only
    /// through a change `collect` is told of (its last unfinished saga
    /// finishing, a dead entry added), so the strip pass looks at these
    /// instead of walking every old segment on every commit.
    strip_candidates: BTreeSet<i64>,
    /// Events of unfinished sagas.
    pub(crate) live_events: u64,
}

impl Index {
    /// The next segment's `seq`.
    #[cfg(test)]
    pub(crate) fn next_seq(&self) -> i64 {
        self.segs.last_key_value().map_or(1, |(s, _)| s + 1)
    }

    /// Segments stored.
    #[cfg(test)]
    pub(crate) fn segments(&self) -> usize {
        self.segs.len()
    }

    /// Records `n` events of `global_tx_id` in segment `seq`.
    pub(crate) fn events(&mut self, seq: i64, global_tx_id: &str, n: u64) {
        let live = match self.sagas.get_mut(global_tx_id) {
            Some(l) => l,
            None => self.sagas.entry(global_tx_id.into()).or_default(),
        };
        if live.segs.last() != Some(&seq) {
            live.segs.push(seq);
            self.segs.entry(seq).or_default().live += 1;
        }
        live.events += n;
        self.live_events += n;
    }

    /// Records that `global_tx_id` finished in segment `seq`. Returns
    /// whether a mark must be written (the saga had events stored); the
    /// segments it may have freed are pushed on `touched`.
    pub(crate) fn finish(&mut self, seq: i64, global_tx_id: &str, touched: &mut Vec<i64>) -> bool {
        let Some(live) = self.sagas.remove(global_tx_id) else {
            return false;
        };
        self.live_events -= live.events;
        let id = self.next_dead;
        let mut remaining = 0;
        for s in live.segs {
            if let Some(seg) = self.segs.get_mut(&s) {
                seg.live -= 1;
                if s < seq {
                    seg.dead.push(id);
                    remaining += 1;
                }
                touched.push(s);
            }
        }
        if remaining > 0 {
            self.next_dead += 1;
            self.dead.insert(
                id,
                Dead {
                    mark: seq,
                    remaining,
                },
            );
            self.segs.entry(seq).or_default().pins += 1;
        }
        true
    }

    /// The segments older than `before` to strip now: kept only by their
    /// pins, whose dead entries still hold up other segments' pins (see
    /// the module docs). They leave the candidates: the writer rewrites
    /// each with its marks alone and reports those it did to
    /// [`stripped`](Self::stripped) (one it leaves as it is keeps its
    /// entries). If the writer's transaction fails instead, its index is
    /// rebuilt.
    pub(crate) fn take_strip_due(&mut self, before: i64) -> Vec<i64> {
        let newer = self.strip_candidates.split_off(&before);
        let old = std::mem::replace(&mut self.strip_candidates, newer);
        old.into_iter()
            .filter(|seq| {
                self.segs
                    .get(seq)
                    .is_some_and(|g| g.live == 0 && g.pins > 0 && !g.dead.is_empty())
            })
            .collect()
    }

    /// The segments `done` (from [`take_strip_due`](Self::take_strip_due))
    /// were rewritten with their marks alone; returns the segments this
    /// frees, to delete.
    pub(crate) fn stripped(&mut self, done: &[i64]) -> Vec<i64> {
        let mut touched = Vec::new();
        for seq in done {
            self.strip_one(*seq, &mut touched);
        }
        self.collect(touched)
    }

    /// Segment `seq` was rewritten with its marks alone: its dead entries
    /// are gone, as if it had been deleted, so the marks that covered them
    /// may no longer pin theirs (pushed on `touched`, for [`collect`](Self::collect)).
    fn strip_one(&mut self, seq: i64, touched: &mut Vec<i64>) {
        let Some(seg) = self.segs.get_mut(&seq) else {
            return;
        };
        for id in std::mem::take(&mut seg.dead) {
            self.release(id, touched);
        }
    }

    /// One segment with entries of finished saga `id` is gone (deleted or
    /// stripped): when none is left, its mark no longer pins its segment.
    fn release(&mut self, id: u64, touched: &mut Vec<i64>) {
        let Some(d) = self.dead.get_mut(&id) else {
            return;
        };
        d.remaining -= 1;
        if d.remaining == 0 {
            let mark = d.mark;
            self.dead.remove(&id);
            if let Some(m) = self.segs.get_mut(&mark) {
                m.pins -= 1;
                touched.push(mark);
            }
        }
    }

    /// Removes every segment among `touched` (and those that frees in
    /// turn) that nothing needs any more; returns their `seq`s.
    pub(crate) fn collect(&mut self, mut touched: Vec<i64>) -> Vec<i64> {
        let mut gone = Vec::new();
        while let Some(s) = touched.pop() {
            let Some(g) = self.segs.get(&s) else {
                continue;
            };
            if g.live != 0 || g.pins != 0 {
                if g.live == 0 && !g.dead.is_empty() {
                    self.strip_candidates.insert(s);
                }
                continue;
            }
            let Some(seg) = self.segs.remove(&s) else {
                continue;
            };
            gone.push(s);
            for id in seg.dead {
                self.release(id, &mut touched);
            }
        }
        gone
    }

    /// Indexes a stored segment while opening the store (segments in
    /// `seq` order); segments it frees are pushed on `touched`.
    ///
    /// # Errors
    /// What is wrong with its bytes.
    pub(crate) fn index_segment(
        &mut self,
        seq: i64,
        data: &[u8],
        touched: &mut Vec<i64>,
    ) -> Result<(), String> {
        // A segment that holds only unneeded marks is still a segment.
        self.segs.entry(seq).or_default();
        touched.push(seq);
        entries(data, |e, _| {
            match e {
                Entry::Events {
                    global_tx_id,
                    packed,
                } => {
                    let n = codec::count(packed)
                        .map_err(|e| format!("events of saga {global_tx_id}: {e}"))?;
                    self.events(seq, global_tx_id, n as u64);
                }
                Entry::Mark { global_tx_id } => {
                    self.finish(seq, global_tx_id, touched);
                }
            }
            Ok(())
        })
    }
}

#[cfg(test)]
mod tests {
    use super::super::sqlite::tests::{app, ev, req, summary};
    use super::*;

    /// The index rebuilt from the stored segments, as an open does; nothing
    /// in them may be left to delete.
    fn rebuilt(stored: &BTreeMap<i64, Vec<u8>>) -> Index {
        let mut index = Index::default();
        let mut touched = Vec::new();
        for (seq, data) in stored {
            index.index_segment(*seq, data, &mut touched).unwrap();
        }
        assert!(index.collect(touched).is_empty());
        index
    }

    /// What replaying the stored segments in order leaves.
    fn replay_all(stored: &BTreeMap<i64, Vec<u8>>) -> Vec<EventRecord> {
        let mut replay = Replay::default();
        for data in stored.values() {
            replay.segment(data, None).unwrap();
        }
        replay.into_events()
    }

    /// Writes segments through the index as the writer does, then checks
    /// that replaying what is left gives the unfinished events, and that
    /// rebuilding the index from the stored segments gives the same index.
    #[test]
    fn index_deletes_only_unneeded_segments_and_replay_matches() {
        type Op<'a> = (&'a str, Option<&'a str>); // (saga, Some(local) = event, None = finish)
        let commits: Vec<Vec<Op>> = vec![
            vec![("a", Some("a0")), ("b", Some("b0"))],
            vec![("a", Some("a1")), ("c", Some("c0"))],
            vec![("b", None)],
            vec![("a", None), ("d", Some("d0"))],
            // A late event after its saga finished stays.
            vec![("a", Some("a2")), ("c", Some("c1"))],
            vec![("x", None)],
            vec![("c", None)],
        ];
        let mut index = Index::default();
        let mut stored: BTreeMap<i64, Vec<u8>> = BTreeMap::new();
        for (seq, ops) in (1..).zip(&commits) {
            assert!(index.next_seq() <= seq);
            let mut buf = SegmentBuf::default();
            buf.start(4);
            let mut touched = vec![seq];
            for (g, op) in ops {
                match op {
                    Some(l) => {
                        buf.events(g, &[ev(g, l)]);
                        index.events(seq, g, 1);
                    }
                    None => {
                        if index.finish(seq, g, &mut touched) {
                            buf.mark(g);
                        }
                    }
                }
            }
            if !buf.is_empty() {
                stored.insert(seq, buf.finish().to_vec());
            }
            for gone in index.collect(touched) {
                stored.remove(&gone);
            }
        }
        let left: Vec<String> = replay_all(&stored)
            .into_iter()
            .map(|e| e.local_tx_id)
            .collect();
        assert_eq!(left, ["d0", "a2"]);
        assert_eq!(index.live_events, 2);
        // Segments 1-3 are gone; 4 holds d0 (and a's mark, which covers
        // nothing earlier any more), 5 holds a2 (and c1, dead), 7 the mark
        // that says c1 is dead; the empty commit 6 was never stored.
        assert_eq!(stored.keys().copied().collect::<Vec<_>>(), [4, 5, 7]);
        let rebuilt = rebuilt(&stored);
        assert_eq!(rebuilt.live_events, 2);
        assert_eq!(rebuilt.segments(), 3);
    }

    /// A mark keeps its segment while an earlier segment with the saga's
    /// events exists, so a restart never sees a finished saga again.
    #[test]
    fn marks_pin_their_segment_until_earlier_entries_are_gone() {
        let mut index = Index::default();
        index.events(1, "long", 1);
        index.events(1, "a", 1);
        let mut t = vec![];
        assert!(index.finish(2, "a", &mut t));
        // Segment 1 is kept by "long"; segment 2 (the mark) by the pin.
        assert!(index.collect(t).is_empty());
        let mut t = vec![];
        index.finish(3, "long", &mut t);
        let mut gone = index.collect(t);
        gone.sort_unstable();
        // Segment 3's mark covered only segment 1: all three go.
        assert_eq!(gone, [1, 2, 3]);
        assert_eq!(index.segments(), 0, "{index:?}");
        assert_eq!(index.live_events, 0);
    }

    /// A commit whose marks cover only segments it frees frees its own
    /// segment too: it is not stored at all (rather than inserted and
    /// deleted in one transaction).
    #[test]
    fn a_commit_that_frees_its_own_segment_does_not_store_it() {
        let mut index = Index::default();
        let mut seg = SegmentBuf::default();
        let first = [app(vec![ev("a", "a-0")])];
        let c = apply(&first, 1, &mut seg, &mut index);
        assert!(c.store_segment && c.gone.is_empty());
        let second = [req(WriteOp::Finish(vec![summary("a")]))];
        let c = apply(&second, 2, &mut seg, &mut index);
        assert!(
            !c.store_segment,
            "a's mark only covers segment 1, which goes"
        );
        assert_eq!(c.gone, [1]);
        assert_eq!(c.keep.len(), 1);
        assert_eq!(index.segments(), 0);
    }

    /// One saga that never finishes, sharing its first segment: the marks
    /// of the sagas after it pin each other's segments in a chain (each
    /// pinned segment's dead entries hold the next mark's pin), so without
    /// stripping every later segment stays. With it (as the writer does,
    /// `STRIP_LAG` commits behind), the segments stay few, and replaying
    /// what is stored still gives exactly the unfinished events.
    #[test]
    fn a_saga_that_never_finishes_does_not_keep_every_later_segment() {
        let mut index = Index::default();
        let mut stored: BTreeMap<i64, Vec<u8>> = BTreeMap::new();
        let name = |k: i64| format!("s{k}");
        let mut commit =
            |index: &mut Index, seq: i64, events: &[String], finish: Option<String>| {
                let mut buf = SegmentBuf::default();
                buf.start(2);
                let mut touched = vec![seq];
                for g in events {
                    buf.events(g, &[ev(g, &format!("{g}-0"))]);
                    index.events(seq, g, 1);
                }
                if let Some(g) = finish {
                    if index.finish(seq, &g, &mut touched) {
                        buf.mark(&g);
                    }
                }
                if !buf.is_empty() {
                    stored.insert(seq, buf.finish().to_vec());
                }
                let mut gone = index.collect(touched);
                let due = index.take_strip_due(seq - STRIP_LAG);
                for s in &due {
                    let data = stored.get(s).expect("a stored segment");
                    let marks = marks_only(data).expect("readable");
                    stored.insert(*s, marks);
                }
                gone.extend(index.stripped(&due));
                for g in gone {
                    stored.remove(&g);
                }
            };
        commit(&mut index, 1, &["L".to_owned(), name(1)], None);
        for k in 2..1000 {
            commit(&mut index, k, &[name(k)], Some(name(k - 1)));
        }
        assert!(
            index.segments() <= STRIP_LAG as usize + 4,
            "{} segments kept",
            index.segments()
        );
        assert_eq!(index.segments(), stored.len());
        let left: Vec<String> = replay_all(&stored)
            .into_iter()
            .map(|e| e.global_tx_id)
            .collect();
        assert_eq!(
            left,
            ["L", "s999"],
            "the unfinished sagas, nothing finished"
        );
        // Rebuilt from what is stored, the index agrees.
        let rebuilt = rebuilt(&stored);
        assert_eq!(rebuilt.live_events, 2);
    }

    #[test]
    fn damaged_segments_are_refused() {
        let mut buf = SegmentBuf::default();
        buf.start(1);
        buf.events("g", &[ev("g", "l")]);
        buf.mark("g");
        let data = buf.finish().to_vec();
        // Any cut loses the trailer that says where the table starts.
        for cut in [0, 3, data.len() / 2, data.len() - 1] {
            assert!(Replay::default().segment(&data[..cut], None).is_err());
        }
        let mut offset = data.clone();
        let n = offset.len();
        offset[n - 4..].copy_from_slice(&u32::MAX.to_le_bytes());
        assert!(Replay::default().segment(&offset, None).is_err());
        let mut bad = data.clone();
        bad[0] = 9;
        assert!(Replay::default().segment(&bad, None).is_err());
        assert!(Replay::default().segment(&data, None).is_ok());
    }
}
