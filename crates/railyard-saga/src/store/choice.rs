//! Which durable store a node runs, as one value for configuration files
//! and command lines (`--saga-store embedded|postgres`).

use std::path::PathBuf;
use std::sync::Arc;

use super::{PostgresConfig, PostgresStore, SagaStore, SqliteConfig, SqliteStore, StoreError};

/// The durable store to open. Serialized with a `kind` tag:
/// `{ kind = "embedded", dir = "data/saga" }` or
/// `{ kind = "postgres", url = "postgres://..." }`.
#[derive(Debug, Clone, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
#[serde(tag = "kind", rename_all = "lowercase")]
pub enum StoreChoice {
    /// The embedded default: SQLite in a data directory.
    Embedded {
        /// The data directory (created if missing).
        dir: PathBuf,
        /// Tuning; defaults are fine.
        #[serde(flatten)]
        config: SqliteConfig,
    },
    /// A PostgreSQL database (shared by every coordinator node).
    Postgres(PostgresConfig),
}

impl StoreChoice {
    /// The embedded store in `dir` with default settings.
    pub fn embedded(dir: impl Into<PathBuf>) -> Self {
        StoreChoice::Embedded {
            dir: dir.into(),
            config: SqliteConfig::default(),
        }
    }

    /// PostgreSQL at `url` with default settings.
    pub fn postgres(url: impl Into<String>) -> Self {
        StoreChoice::Postgres(PostgresConfig::new(url))
    }

    /// Opens (or connects to) the store. Must run inside a tokio runtime.
    ///
    /// # Errors
    /// As [`SqliteStore::open`] and [`PostgresStore::connect`]: a clear
    /// [`StoreError`] saying what to fix.
    pub async fn open(self) -> Result<Arc<dyn SagaStore>, StoreError> {
        Ok(match self {
            StoreChoice::Embedded { dir, config } => {
                Arc::new(SqliteStore::open(dir, config).await?)
            }
            StoreChoice::Postgres(config) => Arc::new(PostgresStore::connect(config).await?),
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parses_both_kinds_with_defaults() {
        let e: StoreChoice =
            serde_json::from_str(r#"{"kind":"embedded","dir":"data/saga"}"#).unwrap();
        assert_eq!(e, StoreChoice::embedded("data/saga"));
        let p: StoreChoice =
            serde_json::from_str(r#"{"kind":"postgres","url":"postgres://u@127.0.0.1:5/d"}"#)
                .unwrap();
        assert_eq!(p, StoreChoice::postgres("postgres://u@127.0.0.1:5/d"));
        let tuned: StoreChoice = serde_json::from_str(
            r#"{"kind":"embedded","dir":"d","queue_capacity":8,"retention":{"max_summaries":3}}"#,
        )
        .unwrap();
        let StoreChoice::Embedded { config, .. } = tuned else {
            panic!("embedded expected");
        };
        assert_eq!(config.queue_capacity, 8);
        assert_eq!(config.retention.max_summaries, Some(3));
        // Unset retention fields keep their defaults.
        assert_eq!(config.retention.max_age_secs, Some(7 * 24 * 3600));
        assert!(serde_json::from_str::<StoreChoice>(r#"{"kind":"mysql"}"#).is_err());
    }
}
