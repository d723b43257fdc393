//! The `SagaStore` contract, run against the in-memory reference, the
//! embedded SQLite store and PostgreSQL (a real server started here).

mod store_support;

use std::collections::HashMap;
use std::sync::Arc;

use railyard_saga::{
    EventKind, PostgresConfig, PostgresStore, Retention, SagaQuery, SagaState, SagaStore,
    SqliteConfig, SqliteStore, StoreError,
};
use store_support::{committed, ev, now_ms, saga_events, summary, Fresh, Target};

async fn append_keeps_order_and_every_field(t: &Target) {
    let s = t.open(Retention::keep_all()).await;
    let mut want = Vec::new();
    for i in 0..5 {
        let g = format!("g{i}");
        let evs = saga_events(&g);
        // Interleave sagas: first half of each, then the rest later.
        s.append(evs[..4].to_vec()).await.unwrap();
        want.extend_from_slice(&evs[..4]);
    }
    for i in 0..5 {
        let evs = saga_events(&format!("g{i}"));
        s.append(evs[4..].to_vec()).await.unwrap();
        want.extend_from_slice(&evs[4..]);
    }
    s.append(Vec::new()).await.unwrap();
    assert_eq!(s.unfinished().await.unwrap(), want);
    let g3: Vec<_> = want
        .iter()
        .filter(|e| e.global_tx_id == "g3")
        .cloned()
        .collect();
    assert_eq!(s.timeline("g3".into()).await.unwrap(), g3);
    assert!(s.timeline("nope".into()).await.unwrap().is_empty());
}

async fn finish_compacts_and_keeps_summaries(t: &Target) {
    let s = t.open(Retention::keep_all()).await;
    for g in ["a", "b", "c"] {
        s.append(saga_events(g)).await.unwrap();
    }
    let done = vec![
        summary("a", "svc-0", SagaState::Committed, 10, 20),
        summary("c", "svc-1", SagaState::Compensated, 11, 21),
    ];
    s.finish(done.clone()).await.unwrap();
    let left = s.unfinished().await.unwrap();
    assert_eq!(left, saga_events("b"));
    assert!(s.timeline("a".into()).await.unwrap().is_empty());
    assert_eq!(s.timeline("b".into()).await.unwrap().len(), 8);
    let got = s.finished(SagaQuery::default()).await.unwrap();
    // Newest first.
    assert_eq!(got, vec![done[1].clone(), done[0].clone()]);
    let stats = s.stats().await.unwrap();
    assert_eq!(stats.events, 8);
    assert_eq!(
        stats.finished,
        vec![("COMMITTED".to_owned(), 1), ("COMPENSATED".to_owned(), 1)]
    );
    assert!(stats.commits >= 1, "{stats:?}");
    if t.durable() {
        assert!(stats.disk_bytes.unwrap_or(0) > 0, "{stats:?}");
    }
}

async fn queries_filter_by_state_service_and_time(t: &Target) {
    let s = t.open(Retention::keep_all()).await;
    let states = [
        SagaState::Committed,
        SagaState::Compensated,
        SagaState::Failed,
    ];
    let mut all = Vec::new();
    for i in 0..30i64 {
        let sum = summary(
            &format!("q{i}"),
            &format!("svc-{}", i % 2),
            states[(i % 3) as usize],
            1000 + i * 10,
            5000 + i,
        );
        all.push(sum.clone());
        // Several finish calls, so order spans commits.
        s.finish(vec![sum]).await.unwrap();
    }
    let newest_first: Vec<_> = all.iter().rev().cloned().collect();
    let q = |f: &dyn Fn(&mut SagaQuery)| {
        let mut q = SagaQuery::default();
        f(&mut q);
        q
    };
    assert_eq!(
        s.finished(SagaQuery::default()).await.unwrap(),
        newest_first
    );
    let failed = s
        .finished(q(&|q| q.state = Some(SagaState::Failed)))
        .await
        .unwrap();
    let want: Vec<_> = newest_first
        .iter()
        .filter(|x| x.state == SagaState::Failed)
        .cloned()
        .collect();
    assert_eq!(failed, want);
    assert_eq!(failed.len(), 10);
    let svc1_committed = s
        .finished(q(&|q| {
            q.state = Some(SagaState::Committed);
            q.service_name = Some("svc-1".into());
        }))
        .await
        .unwrap();
    let want: Vec<_> = newest_first
        .iter()
        .filter(|x| x.state == SagaState::Committed && x.service_name == "svc-1")
        .cloned()
        .collect();
    assert_eq!(svc1_committed, want);
    let window = s
        .finished(q(&|q| {
            q.since_ms = Some(1050);
            q.until_ms = Some(1100);
        }))
        .await
        .unwrap();
    let ids: Vec<_> = window.iter().map(|x| x.global_tx_id.as_str()).collect();
    assert_eq!(ids, ["q9", "q8", "q7", "q6", "q5"]);
    let limited = s.finished(q(&|q| q.limit = 4)).await.unwrap();
    assert_eq!(limited, newest_first[..4].to_vec());
    let none = s
        .finished(q(&|q| q.service_name = Some("nobody".into())))
        .await
        .unwrap();
    assert!(none.is_empty());
    // One saga by id (the REST API's lookup of a compacted saga).
    let one = s
        .finished(q(&|q| q.global_tx_id = Some("q17".into())))
        .await
        .unwrap();
    assert_eq!(one, vec![all[17].clone()]);
    let unknown = s
        .finished(q(&|q| q.global_tx_id = Some("q-none".into())))
        .await
        .unwrap();
    assert!(unknown.is_empty());
}

/// Newest started first, whatever order they finished in: the `limit`
/// newest, not the `limit` last finished (re-sorted by the REST API, those
/// left out sagas that started later but finished earlier).
async fn newest_started_come_first_whatever_the_finish_order(t: &Target) {
    let s = t.open(Retention::keep_all()).await;
    for (id, started) in [("a", 100), ("b", 10), ("c", 5)] {
        s.finish(vec![summary(
            id,
            "svc",
            SagaState::Committed,
            started,
            9000,
        )])
        .await
        .unwrap();
    }
    let ids = |v: Vec<railyard_saga::SagaSummary>| {
        v.into_iter().map(|x| x.global_tx_id).collect::<Vec<_>>()
    };
    let two = s
        .finished(SagaQuery {
            limit: 2,
            ..SagaQuery::default()
        })
        .await
        .unwrap();
    assert_eq!(ids(two), ["a", "b"]);
    let all = s.finished(SagaQuery::default()).await.unwrap();
    assert_eq!(ids(all), ["a", "b", "c"]);
}

async fn concurrent_appends_all_land(t: &Target) {
    let s = t.open(Retention::keep_all()).await;
    // An event no engine can store (PostgreSQL text cannot hold NUL) is
    // refused alone; appends running at the same time still land.
    let mut bad = saga_events("bad");
    bad[0].instance_id = "inst\0".into();
    let bad_append = {
        let s = s.clone();
        tokio::spawn(async move { s.append(bad).await })
    };
    const TASKS: usize = 48;
    const SAGAS_PER_TASK: usize = 10;
    let mut handles = Vec::new();
    for task in 0..TASKS {
        let s = s.clone();
        handles.push(tokio::spawn(async move {
            for n in 0..SAGAS_PER_TASK {
                let g = format!("t{task}-{n}");
                let evs = saga_events(&g);
                // Two appends per saga, as a coordinator would.
                s.append(evs[..3].to_vec()).await.unwrap();
                s.append(evs[3..].to_vec()).await.unwrap();
            }
        }));
    }
    for h in handles {
        h.await.unwrap();
    }
    let bad_stored = bad_append.await.unwrap().is_ok();
    if !bad_stored {
        assert!(s.timeline("bad".into()).await.unwrap().is_empty());
    }
    let all: Vec<_> = s
        .unfinished()
        .await
        .unwrap()
        .into_iter()
        .filter(|e| e.global_tx_id != "bad")
        .collect();
    assert_eq!(all.len(), TASKS * SAGAS_PER_TASK * 8);
    let mut per_saga: HashMap<String, Vec<_>> = HashMap::new();
    for e in all {
        per_saga.entry(e.global_tx_id.clone()).or_default().push(e);
    }
    assert_eq!(per_saga.len(), TASKS * SAGAS_PER_TASK);
    for (g, evs) in per_saga {
        assert_eq!(evs, saga_events(&g), "saga {g} out of order");
    }
    if t.durable() {
        let stats = s.stats().await.unwrap();
        assert!(stats.commits >= 1);
        let bad = if bad_stored { 8 } else { 0 };
        assert_eq!(stats.events, (TASKS * SAGAS_PER_TASK * 8 + bad) as u64);
    }
}

async fn retention_prunes_oldest_and_aged_summaries(t: &Target) {
    let s = t
        .open(Retention {
            max_summaries: Some(5),
            max_age_secs: Some(3600),
        })
        .await;
    let now = now_ms();
    for i in 0..12 {
        s.finish(vec![summary(
            &format!("r{i}"),
            "svc",
            SagaState::Committed,
            i,
            now,
        )])
        .await
        .unwrap();
    }
    // One batch larger than the limit, too.
    let batch: Vec<_> = (12..20)
        .map(|i| summary(&format!("r{i}"), "svc", SagaState::Committed, i, now))
        .collect();
    s.finish(batch).await.unwrap();
    let ids: Vec<_> = s
        .finished(SagaQuery::default())
        .await
        .unwrap()
        .into_iter()
        .map(|x| x.global_tx_id)
        .collect();
    assert_eq!(ids, ["r19", "r18", "r17", "r16", "r15"]);
    // A summary that finished two hours ago is aged out at once.
    s.finish(vec![summary(
        "old",
        "svc",
        SagaState::Failed,
        1,
        now - 2 * 3600 * 1000,
    )])
    .await
    .unwrap();
    let got = s.finished(SagaQuery::default()).await.unwrap();
    assert!(got.iter().all(|x| x.global_tx_id != "old"), "{got:?}");
    assert_eq!(got.len(), 5);
    drop(s);
    // A smaller retention applies on reopen.
    let s = t
        .open(Retention {
            max_summaries: Some(2),
            max_age_secs: None,
        })
        .await;
    let ids: Vec<_> = s
        .finished(SagaQuery::default())
        .await
        .unwrap()
        .into_iter()
        .map(|x| x.global_tx_id)
        .collect();
    assert_eq!(ids, ["r19", "r18"]);
    drop(s);
    // An age limit alone prunes too while the store runs (every 1,024
    // finishes; it used to wait for the next open).
    let s = t
        .open(Retention {
            max_summaries: None,
            max_age_secs: Some(3600),
        })
        .await;
    let aged = summary("aged", "svc", SagaState::Failed, 1, now - 2 * 3600 * 1000);
    s.finish(vec![aged]).await.unwrap();
    for b in 0..11 {
        let batch = (0..100)
            .map(|i| summary(&format!("f{b}-{i}"), "svc", SagaState::Committed, 1, now))
            .collect();
        s.finish(batch).await.unwrap();
    }
    let failed = SagaQuery {
        state: Some(SagaState::Failed),
        ..SagaQuery::default()
    };
    let got = s.finished(failed).await.unwrap();
    assert!(got.is_empty(), "aged out while running: {got:?}");
    let kept: u64 = s
        .stats()
        .await
        .unwrap()
        .finished
        .iter()
        .map(|(_, n)| n)
        .sum();
    assert_eq!(kept, 2 + 1_100);
}

async fn reopen_keeps_everything(t: &Target) {
    let s = t.open(Retention::keep_all()).await;
    for i in 0..6 {
        s.append(saga_events(&format!("p{i}"))).await.unwrap();
    }
    let done = vec![
        summary("p1", "svc-0", SagaState::Committed, 1, 2),
        summary("p4", "svc-1", SagaState::Failed, 3, 4),
    ];
    s.finish(done.clone()).await.unwrap();
    let before = s.unfinished().await.unwrap();
    assert_eq!(before.len(), 4 * 8);
    drop(s);
    let s = t.open(Retention::keep_all()).await;
    assert_eq!(s.unfinished().await.unwrap(), before);
    assert_eq!(
        s.finished(SagaQuery::default()).await.unwrap(),
        vec![done[1].clone(), done[0].clone()]
    );
    // And appends go on after the old ones.
    let extra = ev("p9", "p9", EventKind::SagaStarted, 1);
    s.append(vec![extra.clone()]).await.unwrap();
    let after = s.unfinished().await.unwrap();
    assert_eq!(after.last(), Some(&extra));
    assert_eq!(after.len(), before.len() + 1);
}

/// Every case on fresh, empty stores from `fresh`.
async fn run_contract(mut fresh: Fresh) {
    append_keeps_order_and_every_field(&fresh.next().await).await;
    finish_compacts_and_keeps_summaries(&fresh.next().await).await;
    queries_filter_by_state_service_and_time(&fresh.next().await).await;
    newest_started_come_first_whatever_the_finish_order(&fresh.next().await).await;
    concurrent_appends_all_land(&fresh.next().await).await;
    let t = fresh.next().await;
    if t.durable() {
        retention_prunes_oldest_and_aged_summaries(&t).await;
        reopen_keeps_everything(&fresh.next().await).await;
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn memory_store_keeps_the_contract() {
    run_contract(Fresh::Memory).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sqlite_store_keeps_the_contract() {
    run_contract(Fresh::sqlite()).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn postgres_store_keeps_the_contract() {
    run_contract(Fresh::postgres().await).await;
}

/// Sagas that come and go (appended, then finished) leave the file at the
/// size of what is in flight plus the retention: freed pages are reused.
/// (The WAL, bounded by the checkpoint interval, is checkpointed every
/// 1,000 pages here, so that it cycles within the test.)
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sqlite_disk_stays_bounded_under_churn() {
    let dir = tempfile::tempdir().unwrap();
    let s: Arc<dyn SagaStore> = Arc::new(
        SqliteStore::open(
            dir.path(),
            SqliteConfig {
                retention: Retention {
                    max_summaries: Some(100),
                    max_age_secs: None,
                },
                wal_checkpoint_pages: 1000,
                ..SqliteConfig::default()
            },
        )
        .await
        .unwrap(),
    );
    let mut sizes = Vec::new();
    for round in 0..4 {
        let mut tasks = Vec::new();
        for task in 0..16 {
            let s = s.clone();
            tasks.push(tokio::spawn(async move {
                for n in 0..60 {
                    let g = format!("churn-{round}-{task}-{n}");
                    s.append(saga_events(&g)).await.unwrap();
                    s.finish(vec![committed(&g)]).await.unwrap();
                }
            }));
        }
        for h in tasks {
            h.await.unwrap();
        }
        let stats = s.stats().await.unwrap();
        assert_eq!(stats.events, 0);
        let kept: u64 = stats.finished.iter().map(|(_, n)| n).sum();
        assert!(kept <= 100 + 2, "{kept} summaries kept");
        sizes.push(stats.disk_bytes.unwrap());
    }
    // 3,840 sagas went through; the last rounds did not grow the files
    // beyond the first round's size (plus a WAL's worth of slack).
    eprintln!("store files after each round of 960 sagas: {sizes:?} bytes");
    let first = sizes[0];
    for &later in &sizes[1..] {
        assert!(later <= first + 4 * 1024 * 1024, "{sizes:?}");
    }
}

/// One saga that never finishes (a starter that died, no timeout) does not
/// make a durable store keep every segment written after it: the segments
/// kept only by pins are stripped to their marks, so the log stays small.
///
/// "stuck" shares its segment with the first saga of each of 16 chains.
/// Then each chain appends its saga n and finishes its saga n - 1 at once:
/// commits mix one chain's events with others' marks, whose events sit in
/// earlier segments, back to the one "stuck" keeps. Without stripping,
/// those chains of pins keep most segments.
async fn run_beside_a_saga_that_never_finishes(s: Arc<dyn SagaStore>) {
    let name = |t: usize, n: usize| format!("chain-{t}-{n}");
    const TASKS: usize = 16;
    let mut first = saga_events("stuck");
    for t in 0..TASKS {
        first.extend(saga_events(&name(t, 0)));
    }
    s.append(first).await.unwrap();
    let mut tasks = Vec::new();
    for t in 0..TASKS {
        let s = s.clone();
        tasks.push(tokio::spawn(async move {
            for n in 1..100 {
                let (a, f) = tokio::join!(
                    s.append(saga_events(&name(t, n))),
                    s.finish(vec![committed(&name(t, n - 1))])
                );
                a.unwrap();
                f.unwrap();
            }
            s.finish(vec![committed(&name(t, 99))]).await.unwrap();
        }));
    }
    for t in tasks {
        t.await.unwrap();
    }
    // More commits than STRIP_LAG, for the writer to strip the last ones.
    for n in 0..80 {
        let g = format!("tail-{n}");
        s.append(saga_events(&g)).await.unwrap();
        s.finish(vec![committed(&g)]).await.unwrap();
    }
}

/// What a reopened store must find after
/// [`run_beside_a_saga_that_never_finishes`]: exactly the unfinished saga.
async fn only_the_stuck_saga_is_left(s: &dyn SagaStore) {
    let left = s.unfinished().await.unwrap();
    assert!(left.iter().all(|e| e.global_tx_id == "stuck"), "{left:?}");
    assert_eq!(left.len(), saga_events("stuck").len());
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sqlite_a_saga_that_never_finishes_keeps_the_log_small() {
    let dir = tempfile::tempdir().unwrap();
    let open = || SqliteStore::open(dir.path(), SqliteConfig::default());
    let s: Arc<dyn SagaStore> = Arc::new(open().await.unwrap());
    run_beside_a_saga_that_never_finishes(s.clone()).await;
    let segments = || -> i64 {
        let c = rusqlite::Connection::open(dir.path().join("saga.db")).unwrap();
        c.query_row("SELECT count(*) FROM segments", [], |r| r.get(0))
            .unwrap()
    };
    let kept = segments();
    eprintln!("segments kept: {kept}");
    assert!(kept <= 100, "{kept} segments kept for one unfinished saga");
    drop(s);
    only_the_stuck_saga_is_left(&open().await.unwrap()).await;
}

/// An admin connection to the database at `url`.
async fn pg_admin(url: &str) -> tokio_postgres::Client {
    let (client, conn) = tokio_postgres::connect(url, tokio_postgres::NoTls)
        .await
        .expect("an admin connection");
    tokio::spawn(conn);
    client
}

/// A count from `sql` on the database at `url`.
async fn pg_count(url: &str, sql: &str) -> i64 {
    pg_admin(url)
        .await
        .query_one(sql, &[])
        .await
        .unwrap()
        .get(0)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn postgres_a_saga_that_never_finishes_keeps_the_log_small() {
    let server = railyard_saga::PgServer::start().expect("PostgreSQL starts");
    let open = || PostgresStore::connect(PostgresConfig::new(server.url()));
    let s: Arc<dyn SagaStore> = Arc::new(open().await.unwrap());
    run_beside_a_saga_that_never_finishes(s.clone()).await;
    let kept = pg_count(&server.url(), "SELECT count(*) FROM railyard_saga_segments").await;
    eprintln!("segments kept: {kept}");
    assert!(kept <= 100, "{kept} segments kept for one unfinished saga");
    drop(s);
    only_the_stuck_saga_is_left(&open().await.unwrap()).await;
}

/// A commit that fails after the writer's index counted it (here its
/// summary is refused) leaves the index unsure: it is read back from the
/// database before the next commit. The saga is still unfinished, so
/// finishing it again writes its mark and compacts its events; with the
/// index as the failed commit left it, the saga would be unknown, no mark
/// would be written, and its events would come back on every restart.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn postgres_reads_its_index_back_after_a_failed_commit() {
    let server = railyard_saga::PgServer::start().expect("PostgreSQL starts");
    let s = PostgresStore::connect(PostgresConfig::new(server.url()))
        .await
        .expect("opens");
    s.append(saga_events("a")).await.unwrap();
    let admin = pg_admin(&server.url()).await;
    admin
        .batch_execute(
            "CREATE FUNCTION refuse() RETURNS trigger LANGUAGE plpgsql AS
                $$ BEGIN RAISE EXCEPTION 'refused'; END $$;
             CREATE TRIGGER refuse BEFORE INSERT ON railyard_saga_summaries
                FOR EACH ROW EXECUTE FUNCTION refuse();",
        )
        .await
        .unwrap();
    let err = s.finish(vec![committed("a")]).await.expect_err("refused");
    assert!(err.to_string().contains("refused"), "{err}");
    assert_eq!(s.unfinished().await.unwrap(), saga_events("a"));
    admin
        .batch_execute("DROP TRIGGER refuse ON railyard_saga_summaries")
        .await
        .unwrap();
    s.finish(vec![committed("a")]).await.expect("finishes");
    assert_eq!(s.unfinished().await.unwrap(), Vec::new());
    assert_eq!(
        pg_count(&server.url(), "SELECT count(*) FROM railyard_saga_segments").await,
        0,
        "a's segment is compacted"
    );
}

/// A database written by schema version 1 (one row per saga per commit,
/// indexed by saga id; one summary per saga) is migrated on connect: the
/// unfinished events come back in append order, the summaries stay, and a
/// saga may then be finished twice (two summaries, as the other stores).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn postgres_migrates_a_version_1_database() {
    let server = railyard_saga::PgServer::start().expect("PostgreSQL starts");
    let admin = pg_admin(&server.url()).await;
    // Version 1's schema, as that Railyard created it.
    admin
        .batch_execute(
            "CREATE TABLE railyard_saga_meta (version INT NOT NULL);
             INSERT INTO railyard_saga_meta (version) VALUES (1);
             CREATE TABLE railyard_saga_events (
                seq BIGSERIAL PRIMARY KEY, global_tx_id TEXT NOT NULL,
                n INT NOT NULL, data BYTEA NOT NULL);
             CREATE INDEX railyard_saga_events_by_saga
                ON railyard_saga_events (global_tx_id, seq);
             CREATE TABLE railyard_saga_summaries (
                ord BIGSERIAL PRIMARY KEY, global_tx_id TEXT NOT NULL UNIQUE,
                service_name TEXT NOT NULL, state TEXT NOT NULL,
                started_ms BIGINT NOT NULL, finished_ms BIGINT NOT NULL,
                sub_transactions BIGINT NOT NULL, compensated BIGINT NOT NULL,
                events BIGINT NOT NULL);
             CREATE INDEX railyard_saga_summaries_by_finish
                ON railyard_saga_summaries (finished_ms);
             INSERT INTO railyard_saga_summaries (global_tx_id, service_name, state,
                started_ms, finished_ms, sub_transactions, compensated, events)
                VALUES ('old', 'svc', 'COMMITTED', 1,
                    (extract(epoch FROM now()) * 1000)::int8, 3, 0, 8);",
        )
        .await
        .unwrap();
    // Two sagas, their events interleaved over three commits' rows.
    let (x, y) = (saga_events("x"), saga_events("y"));
    let rows: [(&str, &[railyard_saga::EventRecord]); 3] =
        [("x", &x[..2]), ("y", &y[..]), ("x", &x[2..])];
    for (g, evs) in rows {
        admin
            .execute(
                "INSERT INTO railyard_saga_events (global_tx_id, n, data) VALUES ($1, $2, $3)",
                &[
                    &g,
                    &i32::try_from(evs.len()).unwrap(),
                    &railyard_saga::store::encode_events(evs.iter()),
                ],
            )
            .await
            .unwrap();
    }
    let s = PostgresStore::connect(PostgresConfig::new(server.url()))
        .await
        .expect("migrates and opens");
    let mut expected = x[..2].to_vec();
    expected.extend(y.iter().cloned());
    expected.extend(x[2..].iter().cloned());
    assert_eq!(s.unfinished().await.unwrap(), expected);
    let summaries_of = |id: &str| {
        s.finished(SagaQuery {
            global_tx_id: Some(id.into()),
            ..SagaQuery::default()
        })
    };
    let old = summaries_of("old").await.unwrap();
    assert_eq!(old.len(), 1, "{old:?}");
    assert_eq!((old[0].sub_transactions, old[0].events), (3, 8));
    s.finish(vec![committed("x")]).await.unwrap();
    s.finish(vec![committed("x")]).await.unwrap();
    assert_eq!(s.unfinished().await.unwrap(), y);
    let x_kept = summaries_of("x").await.unwrap();
    assert_eq!(x_kept.len(), 2, "{x_kept:?}");
    assert_eq!(
        pg_count(
            &server.url(),
            "SELECT count(*) FROM pg_tables WHERE tablename = 'railyard_saga_events'"
        )
        .await,
        0,
        "the version-1 table is gone"
    );
    assert_eq!(
        pg_count(
            &server.url(),
            "SELECT max(version)::int8 FROM railyard_saga_meta"
        )
        .await,
        2
    );
}

/// A commit that fails, followed by a log that cannot be re-read, leaves
/// the writer's index possibly wrong: the store refuses every later write
/// (until the log reads back) instead of writing on with it.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sqlite_refuses_writes_once_its_index_cannot_be_rebuilt() {
    let dir = tempfile::tempdir().unwrap();
    let s = SqliteStore::open(dir.path(), SqliteConfig::default())
        .await
        .unwrap();
    s.append(saga_events("a")).await.unwrap();
    // From outside: the next commit fails, and the stored segment is damaged.
    let c = rusqlite::Connection::open(dir.path().join("saga.db")).unwrap();
    c.execute_batch(
        "CREATE TRIGGER refuse BEFORE INSERT ON segments BEGIN SELECT RAISE(ABORT, 'refused'); END;
         UPDATE segments SET data = x'09';",
    )
    .unwrap();
    assert!(
        s.append(saga_events("b")).await.is_err(),
        "the commit fails"
    );
    c.execute_batch("DROP TRIGGER refuse;").unwrap();
    let err = s.append(saga_events("c")).await.expect_err("refused");
    assert!(err.to_string().contains("restart the coordinator"), "{err}");
    // Once the log reads back again (the damaged segment mended here), the
    // next batch rebuilds the index and is written.
    c.execute("DELETE FROM segments", []).unwrap();
    s.append(saga_events("d")).await.expect("writes again");
    let left = s.unfinished().await.unwrap();
    assert!(left.iter().all(|e| e.global_tx_id == "d"), "{left:?}");
}

/// A burst of unfinished sagas grows the file; once they finish and are
/// pruned, their pages are free. With `reclaim_free_pages` the file gives
/// them back (beyond 4 MiB kept for later commits); by default it keeps
/// them for reuse. The mode is the one the file was created with, whatever
/// a later open asks for.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sqlite_gives_free_pages_back_only_if_created_to() {
    /// Free pages and `auto_vacuum` of the closed store's file.
    fn file_pages(dir: &std::path::Path) -> (i64, i64) {
        let c = rusqlite::Connection::open(dir.join("saga.db")).unwrap();
        let free = c
            .query_row("PRAGMA freelist_count", [], |r| r.get(0))
            .unwrap();
        let mode = c.query_row("PRAGMA auto_vacuum", [], |r| r.get(0)).unwrap();
        (free, mode)
    }
    async fn open(dir: &std::path::Path, reclaim: bool) -> Arc<dyn SagaStore> {
        let retention = Retention {
            max_summaries: Some(64),
            max_age_secs: None,
        };
        open_with(dir, reclaim, retention).await
    }
    async fn open_with(
        dir: &std::path::Path,
        reclaim: bool,
        retention: Retention,
    ) -> Arc<dyn SagaStore> {
        let config = SqliteConfig {
            retention,
            reclaim_free_pages: reclaim,
            ..SqliteConfig::default()
        };
        Arc::new(SqliteStore::open(dir, config).await.unwrap())
    }
    /// 2,000 sagas with 2 KiB payloads (about 32 MiB of segments) stay
    /// unfinished together, then all finish.
    async fn burst(s: &Arc<dyn SagaStore>, tag: &str) {
        let ids: Vec<String> = (0..2000).map(|n| format!("{tag}-{n}")).collect();
        let mut tasks = Vec::new();
        for chunk in ids.chunks(125) {
            let (s, chunk) = (s.clone(), chunk.to_vec());
            tasks.push(tokio::spawn(async move {
                for g in &chunk {
                    let mut events = saga_events(g);
                    for e in &mut events {
                        e.payloads = vec![7u8; 2048].into();
                    }
                    s.append(events).await.unwrap();
                }
            }));
        }
        for t in tasks {
            t.await.unwrap();
        }
        assert_eq!(s.stats().await.unwrap().events, 16_000);
        for chunk in ids.chunks(100) {
            let done = chunk
                .iter()
                .map(|g| summary(g, "svc", SagaState::Committed, 1, now_ms()))
                .collect();
            s.finish(done).await.unwrap();
        }
        assert_eq!(s.stats().await.unwrap().events, 0);
    }

    for reclaim in [false, true] {
        let dir = tempfile::tempdir().unwrap();
        let s = open(dir.path(), reclaim).await;
        burst(&s, "a").await;
        drop(s);
        let (free, mode) = file_pages(dir.path());
        if reclaim {
            assert_eq!(mode, 2, "incremental vacuum");
            assert!(free <= 1024, "{free} free pages left, 1,024 kept");
        } else {
            assert_eq!(mode, 0, "no auto-vacuum");
            assert!(
                free > 4096,
                "only {free} free pages: the burst's were given back"
            );
        }
        // Opened again with the other setting: the file keeps its mode, and
        // a second burst reuses the free pages or gives them back as before.
        let s = open(dir.path(), !reclaim).await;
        burst(&s, "b").await;
        drop(s);
        let (free_again, mode_again) = file_pages(dir.path());
        assert_eq!(mode_again, mode);
        if reclaim {
            assert!(free_again <= 1024, "{free_again} free pages left");
        } else {
            assert!(free_again > 4096, "{free_again} free pages left");
        }
    }

    // Most free pages come from deleted segments: with a retention that
    // never prunes, they still go back, within 1,024 commits.
    let dir = tempfile::tempdir().unwrap();
    let s = open_with(dir.path(), true, Retention::keep_all()).await;
    burst(&s, "c").await;
    for n in 0..1100 {
        s.append(vec![ev(
            &format!("tiny-{n}"),
            "x",
            EventKind::SagaStarted,
            1,
        )])
        .await
        .unwrap();
    }
    drop(s);
    let (free, _) = file_pages(dir.path());
    assert!(free <= 1024, "{free} free pages left with no pruning");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sqlite_refuses_a_directory_in_use() {
    let dir = tempfile::tempdir().unwrap();
    let first = SqliteStore::open(dir.path(), SqliteConfig::default())
        .await
        .unwrap();
    let err = SqliteStore::open(dir.path(), SqliteConfig::default())
        .await
        .unwrap_err();
    assert!(
        matches!(&err, StoreError::Unavailable(m) if m.contains("in use")),
        "{err}"
    );
    drop(first);
    // Released with the first store.
    let again = SqliteStore::open(dir.path(), SqliteConfig::default()).await;
    assert!(again.is_ok());
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn postgres_down_is_unavailable_with_the_address() {
    let port = std::net::TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap()
        .port();
    let url = format!("postgres://railyard@127.0.0.1:{port}/postgres");
    let err = PostgresStore::connect(PostgresConfig::new(url))
        .await
        .unwrap_err();
    let msg = err.to_string();
    assert!(matches!(err, StoreError::Unavailable(_)), "{msg}");
    assert!(msg.contains(&format!("127.0.0.1:{port}")), "{msg}");

    let bad = PostgresStore::connect(PostgresConfig::new("postgres://a b c:notaport"))
        .await
        .unwrap_err();
    assert!(matches!(bad, StoreError::Unavailable(_)), "{bad}");
}

/// A server that stops answering without closing the connection (its
/// backends stopped, as a host cut off would look): a commit fails as
/// `Unavailable` after `commit_timeout_secs` (nothing acknowledged) instead
/// of hanging, and once the server answers again the store reconnects.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn postgres_silent_server_fails_the_commit_in_time() {
    let server = railyard_saga::PgServer::start().expect("PostgreSQL starts");
    let store = PostgresStore::connect(PostgresConfig {
        commit_timeout_secs: 2,
        ..PostgresConfig::new(server.url())
    })
    .await
    .expect("opens");
    store.append(saga_events("before")).await.expect("answered");
    // Stop the store's backends (the kernel still takes the bytes).
    let (admin, conn) = tokio_postgres::connect(&server.url(), tokio_postgres::NoTls)
        .await
        .expect("an admin connection");
    tokio::spawn(conn);
    let pids: Vec<String> = admin
        .query(
            "SELECT pid FROM pg_stat_activity WHERE application_name = 'railyard-saga'",
            &[],
        )
        .await
        .expect("the store's backends")
        .iter()
        .map(|r| r.get::<_, i32>(0).to_string())
        .collect();
    assert!(!pids.is_empty(), "the store's backends run");
    let signal = |sig: &str| {
        for pid in &pids {
            let _ = std::process::Command::new("kill").args([sig, pid]).status();
        }
    };
    signal("-STOP");
    let t0 = std::time::Instant::now();
    let err = tokio::time::timeout(
        std::time::Duration::from_secs(20),
        store.append(saga_events("during")),
    )
    .await;
    signal("-CONT");
    let err = err
        .expect("the commit fails in time instead of hanging")
        .unwrap_err();
    assert!(matches!(err, StoreError::Unavailable(_)), "{err}");
    assert!(t0.elapsed() < std::time::Duration::from_secs(10));
    // Answering again: the next commit connects anew.
    let mut ok = false;
    for _ in 0..50 {
        if store.append(saga_events("after")).await.is_ok() {
            ok = true;
            break;
        }
        tokio::time::sleep(std::time::Duration::from_millis(100)).await;
    }
    assert!(ok, "the store recovers once the server answers");
}

/// A loopback proxy to `target` that can cut off the connections it has
/// (`cut` sets their flags): a cut connection forwards nothing and closes
/// nothing, for good, as a network partition looks to both ends; new
/// connections go through.
async fn partitioning_proxy(
    target: u16,
) -> (
    u16,
    std::sync::Arc<std::sync::Mutex<Vec<std::sync::Arc<std::sync::atomic::AtomicBool>>>>,
) {
    use std::sync::atomic::{AtomicBool, Ordering};
    use std::sync::{Arc, Mutex};
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let port = listener.local_addr().unwrap().port();
    let flags: Arc<Mutex<Vec<Arc<AtomicBool>>>> = Arc::default();
    let all = flags.clone();
    tokio::spawn(async move {
        while let Ok((client, _)) = listener.accept().await {
            let Ok(server) = tokio::net::TcpStream::connect(("127.0.0.1", target)).await else {
                continue;
            };
            let cut = Arc::new(AtomicBool::new(false));
            all.lock().unwrap().push(cut.clone());
            let (cr, cw) = client.into_split();
            let (sr, sw) = server.into_split();
            for (mut r, mut w) in [(cr, sw), (sr, cw)] {
                let cut = cut.clone();
                tokio::spawn(async move {
                    use tokio::io::{AsyncReadExt, AsyncWriteExt};
                    let mut buf = vec![0u8; 16 * 1024];
                    loop {
                        let n = match r.read(&mut buf).await {
                            Ok(0) | Err(_) => break,
                            Ok(n) => n,
                        };
                        if cut.load(Ordering::SeqCst) {
                            break;
                        }
                        if w.write_all(&buf[..n]).await.is_err() {
                            break;
                        }
                    }
                    // A cut connection is never closed: the other end must
                    // not learn (bounded: the test ends first).
                    while cut.load(Ordering::SeqCst) {
                        tokio::time::sleep(std::time::Duration::from_millis(50)).await;
                    }
                    drop((r, w));
                });
            }
        }
    });
    (port, flags)
}

/// A partition during a commit: the commit times out and the writer
/// reconnects, but the server still has the old session, which holds the
/// coordinator's lock. The reconnect ends that session (its own) instead of
/// taking itself for another coordinator, and writes go on.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn postgres_a_partition_does_not_lock_the_coordinator_out() {
    use std::sync::atomic::Ordering;
    let server = railyard_saga::PgServer::start().expect("PostgreSQL starts");
    let pg_port: u16 = server
        .url()
        .rsplit(':')
        .next()
        .and_then(|rest| rest.split('/').next())
        .and_then(|p| p.parse().ok())
        .expect("the server's port");
    let (port, connections) = partitioning_proxy(pg_port).await;
    let store = PostgresStore::connect(PostgresConfig {
        commit_timeout_secs: 1,
        ..PostgresConfig::new(format!("postgres://railyard@127.0.0.1:{port}/postgres"))
    })
    .await
    .expect("opens through the proxy");
    store.append(saga_events("before")).await.expect("answered");
    for c in connections.lock().unwrap().iter() {
        c.store(true, Ordering::SeqCst);
    }
    let err = store.append(saga_events("during")).await.unwrap_err();
    assert!(matches!(err, StoreError::Unavailable(_)), "{err}");
    // New connections go through; the old session still waits on the
    // server with its lock (the proxy holds its socket open).
    let mut last = None;
    for _ in 0..50 {
        match store.append(saga_events("after")).await {
            Ok(()) => {
                last = None;
                break;
            }
            Err(e) => last = Some(e),
        }
        tokio::time::sleep(std::time::Duration::from_millis(100)).await;
    }
    assert!(last.is_none(), "locked out: {last:?}");
}

/// Two coordinators on one database would each recover and drive the
/// other's sagas (rows carry no owner): the second store is refused, with
/// what to do, while the first holds the database; once it is gone, a new
/// one opens.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn postgres_refuses_a_second_coordinator_on_one_database() {
    let server = railyard_saga::PgServer::start().expect("PostgreSQL starts");
    let first = PostgresStore::connect(PostgresConfig::new(server.url()))
        .await
        .expect("the first coordinator opens");
    let err = PostgresStore::connect(PostgresConfig::new(server.url()))
        .await
        .expect_err("a second one is refused");
    let msg = err.to_string();
    assert!(msg.contains("another Railyard saga coordinator"), "{msg}");
    assert!(msg.contains("database of its own"), "{msg}");
    drop(first);
    // The first one's writer lets go of its session as it ends.
    let mut reopened = None;
    for _ in 0..100 {
        if let Ok(s) = PostgresStore::connect(PostgresConfig::new(server.url())).await {
            reopened = Some(s);
            break;
        }
        tokio::time::sleep(std::time::Duration::from_millis(50)).await;
    }
    assert!(
        reopened.is_some(),
        "a new coordinator opens once the first is gone"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn postgres_outage_fails_appends_then_recovers() {
    let Fresh::Postgres { mut server, .. } = Fresh::postgres().await else {
        unreachable!("postgres() makes a Postgres");
    };
    let store = Arc::new(
        PostgresStore::connect(PostgresConfig::new(server.url()))
            .await
            .unwrap(),
    );
    store.append(saga_events("before")).await.unwrap();
    let server = tokio::task::spawn_blocking(move || {
        server.stop();
        server
    })
    .await
    .unwrap();
    let err = store.append(saga_events("during")).await.unwrap_err();
    assert!(matches!(err, StoreError::Unavailable(_)), "{err}");
    let err = store.unfinished().await.unwrap_err();
    assert!(matches!(err, StoreError::Unavailable(_)), "{err}");
    let server = tokio::task::spawn_blocking(move || {
        let mut server = server;
        server.restart().expect("restart PostgreSQL");
        server
    })
    .await
    .unwrap();
    store.append(saga_events("after")).await.unwrap();
    let ids: Vec<_> = store
        .unfinished()
        .await
        .unwrap()
        .into_iter()
        .map(|e| e.global_tx_id)
        .collect();
    // Nothing of the failed append was stored; both acknowledged ones were.
    assert_eq!(ids.len(), 16);
    assert!(ids[..8].iter().all(|g| g == "before"));
    assert!(ids[8..].iter().all(|g| g == "after"));
    drop(store);
    drop(server);
}
