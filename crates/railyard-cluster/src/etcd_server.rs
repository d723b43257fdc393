//! A throwaway etcd server on loopback, for tests, the bench and
//! `railyard dev etcd`: free ports, a temporary data directory, stopped and
//! removed on drop. Uses the `etcd` binary from Debian's `etcd-server`.

use std::net::TcpListener;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

/// Why etcd could not be started.
#[derive(Debug, thiserror::Error)]
pub enum EtcdServerError {
    /// The binary is missing.
    #[error("cannot run `etcd` ({0}); install it with `apt-get install -y etcd-server`")]
    Missing(std::io::Error),
    /// Temp dir or port trouble.
    #[error("preparing etcd: {0}")]
    Io(#[from] std::io::Error),
    /// It did not start answering in time.
    #[error("etcd did not accept connections on {0} within 20 s (its log: {1})")]
    NotReady(String, PathBuf),
}

/// A running etcd.
pub struct EtcdServer {
    child: Option<Child>,
    dir: tempfile::TempDir,
    client_port: u16,
    peer_port: u16,
}

/// Two distinct free loopback ports: both are held until both are picked,
/// so the second bind cannot hand back the first.
fn free_ports() -> std::io::Result<(u16, u16)> {
    let a = TcpListener::bind("127.0.0.1:0")?;
    let b = TcpListener::bind("127.0.0.1:0")?;
    Ok((a.local_addr()?.port(), b.local_addr()?.port()))
}

impl EtcdServer {
    /// Starts etcd on free loopback ports and waits until it answers.
    ///
    /// # Errors
    /// [`EtcdServerError`] if the binary is missing or etcd does not come up.
    pub fn start() -> Result<Self, EtcdServerError> {
        let dir = tempfile::Builder::new()
            .prefix("railyard-etcd-")
            .tempdir()?;
        let (client_port, peer_port) = free_ports()?;
        let mut s = Self {
            child: None,
            dir,
            client_port,
            peer_port,
        };
        s.spawn()?;
        Ok(s)
    }

    /// Client endpoint, e.g. `http://127.0.0.1:41234`.
    pub fn endpoint(&self) -> String {
        format!("http://127.0.0.1:{}", self.client_port)
    }

    /// Where etcd keeps its data and log.
    pub fn dir(&self) -> &Path {
        self.dir.path()
    }

    /// Stops the process (data kept), as a crash would.
    pub fn stop(&mut self) {
        if let Some(mut c) = self.child.take() {
            let _ = c.kill();
            let _ = c.wait();
        }
    }

    /// Starts it again on the same ports and data.
    ///
    /// # Errors
    /// As [`start`](Self::start).
    pub fn restart(&mut self) -> Result<(), EtcdServerError> {
        self.stop();
        self.spawn()
    }

    fn spawn(&mut self) -> Result<(), EtcdServerError> {
        let client = format!("http://127.0.0.1:{}", self.client_port);
        let peer = format!("http://127.0.0.1:{}", self.peer_port);
        let log_path = self.dir.path().join("etcd.log");
        // Accepting connections is not enough: etcd serves requests once it
        // has elected itself leader, which it logs. Each start appends to the
        // log, so count the lines.
        let ready_before = ready_lines(&log_path);
        let log = std::fs::OpenOptions::new()
            .create(true)
            .append(true)
            .open(&log_path)?;
        let child = Command::new("etcd")
            .arg("--name")
            .arg("railyard-test")
            .arg("--data-dir")
            .arg(self.dir.path().join("data"))
            .arg("--listen-client-urls")
            .arg(&client)
            .arg("--advertise-client-urls")
            .arg(&client)
            .arg("--listen-peer-urls")
            .arg(&peer)
            .arg("--initial-advertise-peer-urls")
            .arg(&peer)
            .arg("--initial-cluster")
            .arg(format!("railyard-test={peer}"))
            .stdin(Stdio::null())
            .stdout(log.try_clone()?)
            .stderr(log)
            .spawn()
            .map_err(EtcdServerError::Missing)?;
        self.child = Some(child);
        let deadline = Instant::now() + Duration::from_secs(20);
        while Instant::now() < deadline {
            if ready_lines(&log_path) > ready_before
                && std::net::TcpStream::connect(("127.0.0.1", self.client_port)).is_ok()
            {
                return Ok(());
            }
            std::thread::sleep(Duration::from_millis(50));
        }
        self.stop();
        Err(EtcdServerError::NotReady(client, log_path))
    }
}

fn ready_lines(log: &Path) -> usize {
    std::fs::read_to_string(log)
        .map(|s| s.matches("ready to serve client requests").count())
        .unwrap_or(0)
}

impl Drop for EtcdServer {
    fn drop(&mut self) {
        self.stop();
    }
}
