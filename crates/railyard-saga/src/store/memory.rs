//! A store in memory: **not durable**. It exists to test the state machine
//! without disk and as the reference the durable stores are compared with in
//! their tests; `railyard node` never uses it.

use std::collections::HashMap;

use futures::future::BoxFuture;
use parking_lot::Mutex;

use super::{SagaQuery, SagaStore, SagaSummary, StoreError, StoreStats};
use crate::event::EventRecord;

/// Events and summaries in memory; lost when dropped.
#[derive(Debug, Default)]
pub struct MemoryStore {
    inner: Mutex<Inner>,
}

#[derive(Debug, Default)]
struct Inner {
    /// Each unfinished saga's events with their append numbers, so that
    /// finishing a saga costs its own events, not every event held.
    sagas: HashMap<String, Vec<(u64, EventRecord)>, foldhash::fast::RandomState>,
    /// The next append number; also the count of events ever appended.
    next: u64,
    finished: Vec<SagaSummary>,
    appends: u64,
}

impl MemoryStore {
    /// An empty store.
    pub fn new() -> Self {
        Self::default()
    }
}

impl SagaStore for MemoryStore {
    fn name(&self) -> &'static str {
        "memory"
    }

    fn append(&self, events: Vec<EventRecord>) -> BoxFuture<'_, Result<(), StoreError>> {
        let mut g = self.inner.lock();
        let g = &mut *g;
        for e in events {
            let n = g.next;
            g.next += 1;
            match g.sagas.get_mut(e.global_tx_id.as_str()) {
                Some(list) => list.push((n, e)),
                None => {
                    g.sagas.insert(e.global_tx_id.clone(), vec![(n, e)]);
                }
            }
        }
        g.appends += 1;
        Box::pin(async { Ok(()) })
    }

    fn finish(&self, done: Vec<SagaSummary>) -> BoxFuture<'_, Result<(), StoreError>> {
        let mut g = self.inner.lock();
        for s in &done {
            g.sagas.remove(s.global_tx_id.as_str());
        }
        g.finished.extend(done);
        Box::pin(async { Ok(()) })
    }

    fn unfinished(&self) -> BoxFuture<'_, Result<Vec<EventRecord>, StoreError>> {
        let mut numbered: Vec<(u64, EventRecord)> = self
            .inner
            .lock()
            .sagas
            .values()
            .flatten()
            .cloned()
            .collect();
        numbered.sort_unstable_by_key(|(n, _)| *n);
        let events = numbered.into_iter().map(|(_, e)| e).collect();
        Box::pin(async move { Ok(events) })
    }

    fn finished(&self, query: SagaQuery) -> BoxFuture<'_, Result<Vec<SagaSummary>, StoreError>> {
        let g = self.inner.lock();
        let limit = if query.limit == 0 { 100 } else { query.limit };
        let mut out: Vec<&SagaSummary> = g
            .finished
            .iter()
            .rev()
            .filter(|s| query.state.is_none_or(|st| s.state == st))
            .filter(|s| {
                query
                    .service_name
                    .as_deref()
                    .is_none_or(|n| s.service_name == n)
            })
            .filter(|s| query.since_ms.is_none_or(|t| s.started_ms >= t))
            .filter(|s| query.until_ms.is_none_or(|t| s.started_ms < t))
            .filter(|s| {
                query
                    .global_tx_id
                    .as_deref()
                    .is_none_or(|g| s.global_tx_id == g)
            })
            .collect();
        // Newest started first; among equal starts, the later finished
        // (the stable sort keeps the reversed finish order).
        out.sort_by_key(|s| std::cmp::Reverse(s.started_ms));
        let out: Vec<SagaSummary> = out.into_iter().take(limit).cloned().collect();
        Box::pin(async move { Ok(out) })
    }

    fn timeline(
        &self,
        global_tx_id: String,
    ) -> BoxFuture<'_, Result<Vec<EventRecord>, StoreError>> {
        let out: Vec<EventRecord> = self
            .inner
            .lock()
            .sagas
            .get(global_tx_id.as_str())
            .map(|list| list.iter().map(|(_, e)| e.clone()).collect())
            .unwrap_or_default();
        Box::pin(async move { Ok(out) })
    }

    fn stats(&self) -> BoxFuture<'_, Result<StoreStats, StoreError>> {
        let g = self.inner.lock();
        let mut by_state: HashMap<&'static str, u64> = HashMap::new();
        for s in &g.finished {
            *by_state.entry(s.state.as_str()).or_default() += 1;
        }
        let mut finished: Vec<(String, u64)> = by_state
            .into_iter()
            .map(|(k, v)| (k.to_owned(), v))
            .collect();
        finished.sort();
        let stats = StoreStats {
            events: g.sagas.values().map(Vec::len).sum::<usize>() as u64,
            finished,
            commits: g.appends,
            disk_bytes: None,
        };
        Box::pin(async move { Ok(stats) })
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::event::EventKind;
    use crate::store::SagaState;

    fn ev(g: &str, kind: EventKind) -> EventRecord {
        EventRecord {
            global_tx_id: g.into(),
            local_tx_id: g.into(),
            kind: Some(kind),
            ..EventRecord::default()
        }
    }

    fn committed(g: &str) -> SagaSummary {
        SagaSummary {
            global_tx_id: g.into(),
            service_name: "svc".into(),
            state: SagaState::Committed,
            started_ms: 1,
            finished_ms: 2,
            sub_transactions: 0,
            compensated: 0,
            events: 1,
        }
    }

    #[tokio::test]
    async fn finishing_compacts_and_keeps_a_summary() {
        let s = MemoryStore::new();
        s.append(vec![
            ev("g1", EventKind::SagaStarted),
            ev("g2", EventKind::SagaStarted),
        ])
        .await
        .unwrap();
        s.finish(vec![committed("g1")]).await.unwrap();
        let left = s.unfinished().await.unwrap();
        assert_eq!(left.len(), 1);
        assert_eq!(left[0].global_tx_id, "g2");
        let q = SagaQuery {
            state: Some(SagaState::Committed),
            ..SagaQuery::default()
        };
        assert_eq!(s.finished(q).await.unwrap().len(), 1);
        assert!(s.timeline("g1".into()).await.unwrap().is_empty());
    }

    #[tokio::test]
    async fn unfinished_keeps_append_order_across_sagas_and_later_appends() {
        let s = MemoryStore::new();
        s.append(vec![
            ev("a", EventKind::SagaStarted),
            ev("b", EventKind::SagaStarted),
            ev("a", EventKind::TxStarted),
        ])
        .await
        .unwrap();
        s.append(vec![
            ev("c", EventKind::SagaStarted),
            ev("b", EventKind::TxStarted),
        ])
        .await
        .unwrap();
        s.finish(vec![committed("a")]).await.unwrap();
        // An event appended after its saga finished stays, like any other.
        s.append(vec![ev("a", EventKind::SagaEnded)]).await.unwrap();
        let left: Vec<(String, Option<EventKind>)> = s
            .unfinished()
            .await
            .unwrap()
            .into_iter()
            .map(|e| (e.global_tx_id, e.kind))
            .collect();
        let want = [
            ("b", EventKind::SagaStarted),
            ("c", EventKind::SagaStarted),
            ("b", EventKind::TxStarted),
            ("a", EventKind::SagaEnded),
        ];
        let want: Vec<(String, Option<EventKind>)> =
            want.iter().map(|(g, k)| ((*g).into(), Some(*k))).collect();
        assert_eq!(left, want);
        assert_eq!(s.timeline("b".into()).await.unwrap().len(), 2);
        assert_eq!(s.stats().await.unwrap().events, 4);
    }

    #[test]
    fn kinds_round_trip_by_name_and_code() {
        for k in EventKind::ALL {
            assert_eq!(EventKind::parse(k.as_str()), Some(k));
            assert_eq!(EventKind::from_code(k.code()), Some(k));
        }
        assert_eq!(EventKind::parse("NoSuchEvent"), None);
    }
}
