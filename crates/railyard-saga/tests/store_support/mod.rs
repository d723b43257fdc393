//! Shared by the store tests: event builders and fresh stores of each kind
//! (a new temporary directory, or a new database on one PostgreSQL server
//! started for the test binary's test).

#![allow(dead_code, unreachable_pub)]

use std::sync::Arc;

use bytes::Bytes;
use railyard_saga::{
    EventKind, EventRecord, MemoryStore, PgServer, PostgresConfig, PostgresStore, Retention,
    SagaState, SagaStore, SagaSummary, SqliteConfig, SqliteStore,
};

/// An event with every field set from its ids, so round trips are checked.
pub fn ev(global: &str, local: &str, kind: EventKind, n: i32) -> EventRecord {
    EventRecord {
        global_tx_id: global.into(),
        local_tx_id: local.into(),
        parent_tx_id: if local == global {
            String::new()
        } else {
            global.into()
        },
        kind: Some(kind),
        service_name: format!("svc-{}", n % 3).into(),
        instance_id: format!("inst-{n}").into(),
        compensation_method: format!("public void Svc.cancel{n}(java.lang.String)").into(),
        payloads: Bytes::from(vec![0u8, 1, 2, 255, (n & 0xff) as u8]),
        timestamp_ms: 1_700_000_000_000 + i64::from(n),
        timeout_s: n,
        forward_timeout_s: n + 1,
        forward_retries: n + 2,
        reverse_retries: n + 3,
        reverse_timeout_s: n + 4,
        retry_delay_ms: n + 5,
        retry_method: format!("retry{n}"),
        // Live only: stores do not keep it.
        attempt: 0,
    }
}

/// The 8 events of one successful saga (the alpha-benchmark profile).
pub fn saga_events(global: &str) -> Vec<EventRecord> {
    let mut v = vec![ev(global, global, EventKind::SagaStarted, 0)];
    for i in 1..=3 {
        let local = format!("{global}-{i}");
        v.push(ev(global, &local, EventKind::TxStarted, i));
        v.push(ev(global, &local, EventKind::TxEnded, i));
    }
    v.push(ev(global, global, EventKind::SagaEnded, 9));
    v
}

pub fn summary(
    global: &str,
    service: &str,
    state: SagaState,
    started_ms: i64,
    finished_ms: i64,
) -> SagaSummary {
    SagaSummary {
        global_tx_id: global.into(),
        service_name: service.into(),
        state,
        started_ms,
        finished_ms,
        sub_transactions: 3,
        compensated: u32::from(state == SagaState::Compensated) * 3,
        events: 8,
    }
}

/// `global` committed by service `svc`, finished now.
pub fn committed(global: &str) -> SagaSummary {
    summary(global, "svc", SagaState::Committed, 1, now_ms())
}

pub fn now_ms() -> i64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map(|d| d.as_millis() as i64)
        .unwrap_or(0)
}

/// Where a store lives, so it can be reopened.
#[derive(Debug, Clone)]
pub enum Target {
    Memory,
    Sqlite(std::path::PathBuf),
    Postgres(String),
}

impl Target {
    pub fn durable(&self) -> bool {
        !matches!(self, Target::Memory)
    }

    pub async fn open(&self, retention: Retention) -> Arc<dyn SagaStore> {
        match self {
            Target::Memory => Arc::new(MemoryStore::new()),
            Target::Sqlite(dir) => Arc::new(
                SqliteStore::open(
                    dir,
                    SqliteConfig {
                        retention,
                        ..SqliteConfig::default()
                    },
                )
                .await
                .expect("open sqlite store"),
            ),
            Target::Postgres(url) => Arc::new(
                PostgresStore::connect(PostgresConfig {
                    retention,
                    ..PostgresConfig::new(url.clone())
                })
                .await
                .expect("connect postgres store"),
            ),
        }
    }
}

/// Makes fresh, empty targets of one kind.
pub enum Fresh {
    Memory,
    Sqlite(Vec<tempfile::TempDir>),
    Postgres { server: PgServer, made: u32 },
}

impl Fresh {
    pub fn sqlite() -> Self {
        Fresh::Sqlite(Vec::new())
    }

    pub async fn postgres() -> Self {
        let server = tokio::task::spawn_blocking(PgServer::start)
            .await
            .expect("join")
            .expect("start PostgreSQL (apt-get install -y postgresql)");
        Fresh::Postgres { server, made: 0 }
    }

    pub async fn next(&mut self) -> Target {
        match self {
            Fresh::Memory => Target::Memory,
            Fresh::Sqlite(dirs) => {
                let d = tempfile::Builder::new()
                    .prefix("railyard-sqlite-test-")
                    .tempdir()
                    .expect("tempdir");
                let t = Target::Sqlite(d.path().join("data"));
                dirs.push(d);
                t
            }
            Fresh::Postgres { server, made } => {
                *made += 1;
                let db = format!("case{made}");
                create_database(&server.url(), &db).await;
                Target::Postgres(server.url_for(&db))
            }
        }
    }
}

pub async fn create_database(admin_url: &str, db: &str) {
    let (client, conn) = tokio_postgres::connect(admin_url, tokio_postgres::NoTls)
        .await
        .expect("connect admin");
    let task = tokio::spawn(conn);
    client
        .batch_execute(&format!("CREATE DATABASE {db}"))
        .await
        .expect("create database");
    drop(client);
    let _ = task.await;
}
