//! DTM (github.com/dtm-labs/dtm) as the saga scenario's peer: runs
//! `peers/dtm/run`, which builds DTM and its driver on first use, starts DTM
//! on a durable store (boltdb, or a PostgreSQL of its own), drives
//! `transactions` three-branch sagas at `concurrency` through it and prints
//! `RESULT {json}`; this module returns that object.
//!
//! The script does not take the bench lock: the caller runs both systems
//! under one `flock /tmp/railyard-bench.lock`.

use std::path::{Path, PathBuf};
use std::process::Stdio;

use tokio::io::{AsyncBufReadExt, AsyncRead, BufReader};
use tokio::process::Command;

/// DTM's durable store. PostgreSQL is DTM at its best here (its writes
/// share commits: about 800 sagas/s at 500 in flight, peers/dtm/README.md);
/// bbolt, its embedded store, fsyncs one write at a time and does not
/// sustain 500 sagas in flight (about 90/s, some not final within 60 s).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum DtmStore {
    /// DTM's embedded store (bbolt, fsync per write).
    Boltdb,
    /// PostgreSQL with Railyard's server settings.
    Postgres,
}

impl DtmStore {
    /// The name `peers/dtm/run --store` takes.
    pub fn as_str(self) -> &'static str {
        match self {
            Self::Boltdb => "boltdb",
            Self::Postgres => "postgres",
        }
    }
}

/// One DTM run.
#[derive(Debug, Clone)]
pub struct DtmOptions {
    /// The `peers/` directory (see [`crate::peer::default_peers_dir`]).
    pub peers_dir: PathBuf,
    /// The store.
    pub store: DtmStore,
    /// Global transactions to run.
    pub transactions: u64,
    /// Sagas in flight at once.
    pub concurrency: u32,
    /// Share of sagas that fail in their last branch and are compensated, 0..=1.
    pub abort_ratio: f64,
    /// Branches per saga (3 in the alpha-benchmark profile).
    pub branches: u32,
    /// Echo the script's progress lines (building, starting) to stderr.
    pub verbose: bool,
}

impl DtmOptions {
    /// The alpha-benchmark profile at DTM's scale: 5,000 sagas of three
    /// branches at concurrency 500, no aborts.
    pub fn new(peers_dir: &Path, store: DtmStore) -> Self {
        Self {
            peers_dir: peers_dir.to_path_buf(),
            store,
            transactions: 5_000,
            concurrency: 500,
            abort_ratio: 0.0,
            branches: 3,
            verbose: false,
        }
    }

    /// The arguments for `peers/dtm/run`.
    pub fn args(&self) -> Vec<String> {
        vec![
            "--store".into(),
            self.store.as_str().into(),
            "--transactions".into(),
            self.transactions.to_string(),
            "--concurrency".into(),
            self.concurrency.to_string(),
            "--abort-ratio".into(),
            self.abort_ratio.to_string(),
            "--branches".into(),
            self.branches.to_string(),
        ]
    }
}

/// Why a DTM run failed.
#[derive(Debug, thiserror::Error)]
pub enum DtmError {
    /// `peers/dtm/run` is not there.
    #[error("{0} not found: run from the repository root or pass --peers-dir")]
    Missing(PathBuf),
    /// The script could not be started.
    #[error("could not start {path}: {source}")]
    Spawn {
        /// The script.
        path: PathBuf,
        /// The OS error.
        source: std::io::Error,
    },
    /// The script failed (building DTM, starting its store, or the driver).
    #[error("peers/dtm/run failed ({status}); its last output:\n{tail}")]
    Failed {
        /// Exit status.
        status: String,
        /// The last lines of its stderr.
        tail: String,
    },
    /// The result line was not valid JSON.
    #[error("peers/dtm/run printed a RESULT line that is not valid JSON: {0}")]
    BadResult(#[from] serde_json::Error),
    /// I/O while reading its output.
    #[error("reading peers/dtm/run's output: {0}")]
    Io(#[from] std::io::Error),
}

/// The last `RESULT {json}` line of `stdout`, parsed.
///
/// # Errors
/// [`DtmError::BadResult`] when the line is not JSON.
pub fn parse_result(stdout: &str) -> Result<Option<serde_json::Value>, DtmError> {
    match stdout.lines().rev().find_map(|l| l.strip_prefix("RESULT ")) {
        Some(json) => Ok(Some(serde_json::from_str(json)?)),
        None => Ok(None),
    }
}

async fn collect_lines(
    r: impl AsyncRead + Unpin,
    echo: bool,
    keep: usize,
) -> std::io::Result<Vec<String>> {
    let mut lines = BufReader::new(r).lines();
    let mut out = Vec::new();
    while let Some(line) = lines.next_line().await? {
        if echo {
            eprintln!("[dtm] {line}");
        }
        out.push(line);
        if out.len() > keep {
            out.remove(0);
        }
    }
    Ok(out)
}

/// Runs DTM once with `opts` and returns its `RESULT` object (fields
/// `scenario`, `system`, `protocol`, `store`, `transactions`, `concurrency`,
/// `tx_per_s`, `latency_ms` {`p50`,`p99`,`p999`,`max`,`mean`},
/// `compensated`, `lost`, ...; see `peers/dtm/README.md`). The first run
/// builds DTM (minutes).
///
/// # Errors
/// Any [`DtmError`].
pub async fn run_dtm(opts: &DtmOptions) -> Result<serde_json::Value, DtmError> {
    let script = opts.peers_dir.join("dtm").join("run");
    let script = std::fs::canonicalize(&script).unwrap_or(script);
    if !script.is_file() {
        return Err(DtmError::Missing(script));
    }
    let mut child = Command::new(&script)
        .args(opts.args())
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .kill_on_drop(true)
        .spawn()
        .map_err(|source| DtmError::Spawn {
            path: script.clone(),
            source,
        })?;
    let stdout = child.stdout.take().expect("stdout is piped");
    let stderr = child.stderr.take().expect("stderr is piped");
    let (out, err) = tokio::join!(
        collect_lines(stdout, false, 64),
        collect_lines(stderr, opts.verbose, 40)
    );
    let (out, err) = (out?, err?);
    let status = child.wait().await?;
    let result = parse_result(&out.join("\n"))?;
    match result {
        Some(v) if status.success() => Ok(v),
        _ => Err(DtmError::Failed {
            status: status.to_string(),
            tail: err.join("\n"),
        }),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn args_carry_every_option() {
        let mut o = DtmOptions::new(Path::new("peers"), DtmStore::Postgres);
        o.transactions = 1234;
        o.concurrency = 50;
        o.abort_ratio = 0.25;
        assert_eq!(
            o.args().join(" "),
            "--store postgres --transactions 1234 --concurrency 50 --abort-ratio 0.25 --branches 3"
        );
    }

    #[test]
    fn the_last_result_line_wins() {
        let out = "noise\nRESULT {\"tx_per_s\": 1}\nmore\nRESULT {\"tx_per_s\": 2}\n";
        let v = parse_result(out).unwrap().unwrap();
        assert_eq!(v["tx_per_s"], 2);
        assert!(parse_result("no result here").unwrap().is_none());
        assert!(matches!(
            parse_result("RESULT {not json"),
            Err(DtmError::BadResult(_))
        ));
    }

    /// The whole path, for whoever changes the script: builds DTM on first
    /// use, runs 200 sagas (a tenth aborted) on its embedded store.
    #[tokio::test]
    #[ignore = "builds and runs DTM (needs Go; minutes on first use): cargo test -p railyard-bench -- --ignored dtm"]
    async fn runs_dtm_end_to_end() {
        let mut o = DtmOptions::new(&crate::peer::default_peers_dir(), DtmStore::Boltdb);
        o.transactions = 200;
        o.concurrency = 20;
        o.abort_ratio = 0.1;
        let v = run_dtm(&o).await.unwrap();
        assert_eq!(v["system"], "dtm");
        assert_eq!(v["committed"], 180);
        assert_eq!(v["compensated"], 20);
        assert_eq!(v["lost"], 0);
        assert_eq!(v["branch_compensations"], 60);
    }
}
