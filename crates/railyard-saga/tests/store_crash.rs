//! SIGKILL under load: a child process (this test binary, re-executed with
//! an environment variable) appends sagas from many concurrent tasks and
//! prints the id of each acknowledged one; the test kills it mid-load,
//! reopens the store and checks every acknowledged saga is there, whole.
//! Run against the embedded SQLite store and PostgreSQL (a real server).

mod store_support;

use std::collections::{HashMap, HashSet};
use std::io::{BufRead, Write};
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use railyard_saga::{PgServer, Retention};
use store_support::{saga_events, Fresh, Target};

/// Set in the child: `sqlite:<dir>` or `postgres:<url>`.
const CHILD_ENV: &str = "RAILYARD_STORE_CRASH_CHILD";
/// Concurrent appending tasks in the child.
const TASKS: usize = 32;
/// Acknowledged sagas to wait for before the kill.
const KILL_AFTER: usize = 400;

fn parse_target(spec: &str) -> Target {
    if let Some(dir) = spec.strip_prefix("sqlite:") {
        Target::Sqlite(dir.into())
    } else if let Some(url) = spec.strip_prefix("postgres:") {
        Target::Postgres(url.into())
    } else {
        panic!("bad {CHILD_ENV}: {spec}");
    }
}

fn spec(t: &Target) -> String {
    match t {
        Target::Sqlite(dir) => format!("sqlite:{}", dir.display()),
        Target::Postgres(url) => format!("postgres:{url}"),
        Target::Memory => unreachable!("memory is not durable"),
    }
}

/// The child's body; does nothing unless started by a crash test.
#[test]
#[ignore = "the child process of the crash tests, which run it themselves"]
fn crash_child_appends_until_killed() {
    let Ok(spec) = std::env::var(CHILD_ENV) else {
        return;
    };
    let rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .unwrap();
    rt.block_on(async move {
        let store = parse_target(&spec).open(Retention::keep_all()).await;
        let deadline = Instant::now() + Duration::from_secs(60);
        let mut tasks = Vec::new();
        for task in 0..TASKS {
            let store = store.clone();
            tasks.push(tokio::spawn(async move {
                // Bounded in count and time; the parent kills us long before.
                for n in 0..5_000 {
                    if Instant::now() > deadline {
                        break;
                    }
                    let g = format!("crash-{task}-{n}");
                    if let Err(e) = store.append(saga_events(&g)).await {
                        // The database died (server-crash test): no ack;
                        // wait for the parent's kill (bounded by the deadline).
                        eprintln!("append failed: {e}");
                        tokio::time::sleep_until(deadline.into()).await;
                        break;
                    }
                    // Straight to the file descriptor (not libtest's capture),
                    // one line per acknowledged saga.
                    let mut out = std::io::stdout().lock();
                    writeln!(out, "ACK {g}").unwrap();
                    out.flush().unwrap();
                }
            }));
        }
        for t in tasks {
            t.await.unwrap();
        }
    });
}

/// What is killed mid-load besides the appending child.
#[derive(Clone, Copy, PartialEq)]
enum Crash {
    /// Only the child (a coordinator crash).
    Child,
    /// The PostgreSQL server first (all its processes), then the child.
    DatabaseToo,
}

async fn kill_under_load_loses_nothing(target: Target, crash: Crash, mut server: Option<PgServer>) {
    let mut child = Command::new(std::env::current_exe().unwrap())
        .args([
            "--ignored",
            "--exact",
            "crash_child_appends_until_killed",
            "--nocapture",
            "--test-threads=1",
        ])
        .env(CHILD_ENV, spec(&target))
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(Stdio::inherit())
        .spawn()
        .unwrap();
    let stdout = child.stdout.take().unwrap();
    let (tx, rx) = std::sync::mpsc::channel::<String>();
    let reader = std::thread::spawn(move || {
        for line in std::io::BufReader::new(stdout).lines() {
            let Ok(line) = line else { break };
            if let Some(id) = line.strip_prefix("ACK ") {
                if tx.send(id.to_owned()).is_err() {
                    break;
                }
            }
        }
    });
    let mut acked: HashSet<String> = HashSet::new();
    let deadline = Instant::now() + Duration::from_secs(90);
    while acked.len() < KILL_AFTER && Instant::now() < deadline {
        match rx.recv_timeout(Duration::from_millis(100)) {
            Ok(id) => {
                acked.insert(id);
            }
            Err(std::sync::mpsc::RecvTimeoutError::Timeout) => {
                assert!(
                    child.try_wait().unwrap().is_none(),
                    "the child exited before the kill"
                );
            }
            Err(std::sync::mpsc::RecvTimeoutError::Disconnected) => break,
        }
    }
    assert!(
        acked.len() >= KILL_AFTER,
        "only {} acknowledgements within 90 s",
        acked.len()
    );
    // SIGKILL mid-load: appends are in flight right now.
    if crash == Crash::DatabaseToo {
        let mut pg = server.take().expect("a server to kill");
        server = Some(
            tokio::task::spawn_blocking(move || {
                pg.kill();
                pg
            })
            .await
            .unwrap(),
        );
    }
    child.kill().unwrap();
    let status = child.wait().unwrap();
    assert!(!status.success(), "the child was killed, not finished");
    // Whatever it printed before dying was acknowledged too.
    reader.join().unwrap();
    acked.extend(rx.try_iter());

    if let (Crash::DatabaseToo, Some(mut pg)) = (crash, server.take()) {
        // Crash recovery replays PostgreSQL's WAL.
        server = Some(
            tokio::task::spawn_blocking(move || {
                pg.restart().expect("restart PostgreSQL after the kill");
                pg
            })
            .await
            .unwrap(),
        );
    }
    let store = target.open(Retention::keep_all()).await;
    let mut stored: HashMap<String, Vec<_>> = HashMap::new();
    for e in store.unfinished().await.unwrap() {
        stored.entry(e.global_tx_id.clone()).or_default().push(e);
    }
    for id in &acked {
        let evs = stored
            .get(id)
            .unwrap_or_else(|| panic!("acknowledged saga {id} lost"));
        assert_eq!(evs, &saga_events(id), "acknowledged saga {id} damaged");
    }
    // Unacknowledged appends may have landed, but only whole (one
    // transaction per group commit).
    for (id, evs) in &stored {
        assert_eq!(evs, &saga_events(id), "saga {id} stored partially");
    }
    assert!(stored.len() >= acked.len());
    eprintln!(
        "{}: {} sagas acknowledged before the kill, {} stored",
        store.name(),
        acked.len(),
        stored.len()
    );
    drop(store);
    drop(server);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sqlite_kill_under_load_loses_nothing_acknowledged() {
    let mut fresh = Fresh::sqlite();
    kill_under_load_loses_nothing(fresh.next().await, Crash::Child, None).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn postgres_kill_under_load_loses_nothing_acknowledged() {
    let mut fresh = Fresh::postgres().await;
    let target = fresh.next().await;
    kill_under_load_loses_nothing(target, Crash::Child, None).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn postgres_server_kill_under_load_loses_nothing_acknowledged() {
    let mut fresh = Fresh::postgres().await;
    let target = fresh.next().await;
    let Fresh::Postgres { server, .. } = fresh else {
        unreachable!("postgres() makes a Postgres");
    };
    kill_under_load_loses_nothing(target, Crash::DatabaseToo, Some(server)).await;
}
