//! A throwaway PostgreSQL server on loopback, for tests, benchmarks and
//! `railyard dev`: `initdb` into a temporary directory, `postgres` on a free
//! port, stopped and removed on drop. Uses Debian's `postgresql` package
//! (binaries in `/usr/lib/postgresql/<version>/bin`, the newest version is
//! used; `initdb` on the `PATH` otherwise). Debian's own cluster service is
//! not needed and may stay stopped.
//!
//! `initdb` and `postgres` refuse to run as root: when Railyard runs as
//! root, both run as the `postgres` system user (created by the package),
//! who owns the temporary directory.

use std::net::TcpListener;
use std::os::unix::process::CommandExt;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

/// Why PostgreSQL could not be started.
#[derive(Debug, thiserror::Error)]
pub enum PgServerError {
    /// No `initdb`/`postgres` binaries.
    #[error(
        "PostgreSQL binaries not found (looked in /usr/lib/postgresql/*/bin and PATH); \
         install them with `apt-get install -y postgresql`"
    )]
    Missing,
    /// Running as root but there is no unprivileged `postgres` user.
    #[error(
        "running as root and there is no `postgres` user for initdb/postgres to run as; \
         install Debian's `postgresql` package (it creates the user)"
    )]
    NoUser,
    /// Temp dir, port or process trouble.
    #[error("preparing PostgreSQL: {0}")]
    Io(#[from] std::io::Error),
    /// `initdb` failed.
    #[error("initdb failed ({0}); its output is in {1}")]
    Initdb(std::process::ExitStatus, PathBuf),
    /// It did not start accepting connections in time (or exited).
    #[error(
        "PostgreSQL did not accept connections on 127.0.0.1:{0} within 30 s; the end of its log:\n{1}"
    )]
    NotReady(u16, String),
}

/// A running PostgreSQL cluster of its own.
pub struct PgServer {
    child: Option<Child>,
    bin: PathBuf,
    /// Unprivileged user to run as, when we are root.
    user: Option<(u32, u32)>,
    port: u16,
    dir: tempfile::TempDir,
}

impl std::fmt::Debug for PgServer {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("PgServer")
            .field("port", &self.port)
            .field("dir", &self.dir.path())
            .finish_non_exhaustive()
    }
}

/// The superuser `initdb` creates (trust authentication on loopback).
const USER: &str = "railyard";

fn free_port() -> std::io::Result<u16> {
    Ok(TcpListener::bind("127.0.0.1:0")?.local_addr()?.port())
}

/// The newest `/usr/lib/postgresql/<version>/bin`, else the directory of
/// `initdb` on the `PATH`.
fn bin_dir() -> Option<PathBuf> {
    let mut best: Option<(u32, PathBuf)> = None;
    if let Ok(entries) = std::fs::read_dir("/usr/lib/postgresql") {
        for e in entries.flatten() {
            let name = e.file_name();
            let Some(v) = name.to_str().and_then(|n| n.parse::<u32>().ok()) else {
                continue;
            };
            let bin = e.path().join("bin");
            if bin.join("initdb").is_file()
                && bin.join("postgres").is_file()
                && best.as_ref().is_none_or(|(b, _)| v > *b)
            {
                best = Some((v, bin));
            }
        }
    }
    if let Some((_, b)) = best {
        return Some(b);
    }
    std::env::var_os("PATH").and_then(|paths| {
        std::env::split_paths(&paths)
            .find(|p| p.join("initdb").is_file() && p.join("postgres").is_file())
    })
}

/// `Some((uid, gid))` of the `postgres` user when running as root.
fn run_as() -> Result<Option<(u32, u32)>, PgServerError> {
    // Safety: `geteuid` has no preconditions.
    if unsafe { libc::geteuid() } != 0 {
        return Ok(None);
    }
    let name = c"postgres";
    // Safety: `getpwnam` reads a NUL-terminated string; the returned record
    // (static storage, may be null) is read at once, before any other
    // passwd call in this function.
    let pw = unsafe { libc::getpwnam(name.as_ptr()) };
    if pw.is_null() {
        return Err(PgServerError::NoUser);
    }
    // Safety: non-null pointer to a valid passwd record, read immediately.
    let (uid, gid) = unsafe { ((*pw).pw_uid, (*pw).pw_gid) };
    Ok(Some((uid, gid)))
}

impl PgServer {
    /// Creates a cluster in a temporary directory and starts it on a free
    /// loopback port; returns once it accepts connections. Blocks for a few
    /// seconds: call it from `spawn_blocking` in async code.
    ///
    /// # Errors
    /// [`PgServerError`]: binaries or user missing, `initdb` failing, or the
    /// server not coming up.
    pub fn start() -> Result<Self, PgServerError> {
        Self::start_on_port(free_port()?)
    }

    /// As [`start`](Self::start), on a given loopback port.
    ///
    /// # Errors
    /// As [`start`](Self::start).
    pub fn start_on_port(port: u16) -> Result<Self, PgServerError> {
        let bin = bin_dir().ok_or(PgServerError::Missing)?;
        let user = run_as()?;
        let dir = tempfile::Builder::new().prefix("railyard-pg-").tempdir()?;
        if let Some((uid, gid)) = user {
            std::os::unix::fs::chown(dir.path(), Some(uid), Some(gid))?;
        }
        let mut s = Self {
            child: None,
            bin,
            user,
            port,
            dir,
        };
        s.initdb()?;
        s.spawn()?;
        Ok(s)
    }

    /// The port it listens on (127.0.0.1).
    pub fn port(&self) -> u16 {
        self.port
    }

    /// Connection URL of the default `postgres` database.
    pub fn url(&self) -> String {
        self.url_for("postgres")
    }

    /// Connection URL of database `db` (create it first).
    pub fn url_for(&self, db: &str) -> String {
        format!("postgres://{USER}@127.0.0.1:{}/{db}", self.port)
    }

    /// Where the cluster keeps its data (`data/`) and log (`postgres.log`).
    pub fn dir(&self) -> &Path {
        self.dir.path()
    }

    fn command(&self, program: &str) -> Command {
        let mut c = Command::new(self.bin.join(program));
        c.current_dir(self.dir.path())
            .env("LC_ALL", "C")
            .stdin(Stdio::null());
        if let Some((uid, gid)) = self.user {
            // std drops supplementary groups when it changes the uid.
            c.uid(uid).gid(gid);
        }
        c
    }

    fn initdb(&self) -> Result<(), PgServerError> {
        let log_path = self.dir.path().join("initdb.log");
        let log = std::fs::File::create(&log_path)?;
        let status = self
            .command("initdb")
            .arg("-D")
            .arg(self.dir.path().join("data"))
            .args(["-U", USER, "-A", "trust", "-E", "UTF8", "--locale=C"])
            // The cluster is throwaway: skip initdb's own fsyncs; the
            // server itself runs with fsync on.
            .arg("--no-sync")
            .stdout(log.try_clone()?)
            .stderr(log)
            .status()
            .map_err(|_| PgServerError::Missing)?;
        if !status.success() {
            return Err(PgServerError::Initdb(status, log_path));
        }
        Ok(())
    }

    fn spawn(&mut self) -> Result<(), PgServerError> {
        let log_path = self.dir.path().join("postgres.log");
        // Each start appends to the log: count the ready lines.
        let ready_before = ready_lines(&log_path);
        let log = std::fs::OpenOptions::new()
            .create(true)
            .append(true)
            .open(&log_path)?;
        let child = self
            .command("postgres")
            .arg("-D")
            .arg(self.dir.path().join("data"))
            .arg("-p")
            .arg(self.port.to_string())
            .arg("-k")
            .arg(self.dir.path())
            .args([
                "-c",
                "listen_addresses=127.0.0.1",
                "-c",
                "fsync=on",
                "-c",
                "synchronous_commit=on",
                "-c",
                "max_connections=200",
                "-c",
                "shared_buffers=128MB",
            ])
            .stdout(log.try_clone()?)
            .stderr(log)
            .spawn()
            .map_err(|_| PgServerError::Missing)?;
        self.child = Some(child);
        let deadline = Instant::now() + Duration::from_secs(30);
        while Instant::now() < deadline {
            if ready_lines(&log_path) > ready_before
                && std::net::TcpStream::connect(("127.0.0.1", self.port)).is_ok()
            {
                return Ok(());
            }
            if let Some(c) = self.child.as_mut() {
                if let Ok(Some(_)) = c.try_wait() {
                    break;
                }
            }
            std::thread::sleep(Duration::from_millis(50));
        }
        self.stop();
        Err(PgServerError::NotReady(self.port, log_tail(&log_path)))
    }

    /// Stops the server (fast shutdown: SIGINT, then SIGKILL after 10 s);
    /// the data stays until drop.
    pub fn stop(&mut self) {
        let Some(mut c) = self.child.take() else {
            return;
        };
        if let Ok(pid) = i32::try_from(c.id()) {
            // Safety: signalling our own child process by its pid.
            unsafe { libc::kill(pid, libc::SIGINT) };
        }
        let deadline = Instant::now() + Duration::from_secs(10);
        while Instant::now() < deadline {
            if let Ok(Some(_)) = c.try_wait() {
                return;
            }
            std::thread::sleep(Duration::from_millis(20));
        }
        let _ = c.kill();
        let _ = c.wait();
    }

    /// Kills the server and all its processes at once with SIGKILL, as a
    /// machine crash would; the data stays, and [`restart`](Self::restart)
    /// runs PostgreSQL's crash recovery.
    ///
    /// Backends leave the postmaster's process group (they call `setsid`),
    /// so they are found by parent pid: the postmaster is stopped first
    /// (no new children), its children are killed, then it is.
    pub fn kill(&mut self) {
        let Some(mut c) = self.child.take() else {
            return;
        };
        let Ok(pid) = i32::try_from(c.id()) else {
            let _ = c.kill();
            let _ = c.wait();
            return;
        };
        // Safety (all three calls): signals to our own child and to its
        // children, by pid; no memory is passed.
        unsafe { libc::kill(pid, libc::SIGSTOP) };
        let children = children_of(pid);
        for &k in &children {
            unsafe { libc::kill(k, libc::SIGKILL) };
        }
        unsafe { libc::kill(pid, libc::SIGKILL) };
        let _ = c.wait();
        // The killed backends are reaped by init; wait until they are gone
        // so a restart finds the shared memory free.
        let deadline = Instant::now() + Duration::from_secs(10);
        while Instant::now() < deadline
            && children
                .iter()
                .any(|k| Path::new(&format!("/proc/{k}")).exists())
        {
            std::thread::sleep(Duration::from_millis(10));
        }
    }

    /// Starts it again on the same port and data.
    ///
    /// # Errors
    /// As [`start`](Self::start).
    pub fn restart(&mut self) -> Result<(), PgServerError> {
        self.stop();
        self.spawn()
    }
}

/// Pids whose parent is `parent` (from `/proc/<pid>/stat`).
fn children_of(parent: i32) -> Vec<i32> {
    let Ok(entries) = std::fs::read_dir("/proc") else {
        return Vec::new();
    };
    entries
        .flatten()
        .filter_map(|e| e.file_name().to_str()?.parse::<i32>().ok())
        .filter(|pid| {
            std::fs::read_to_string(format!("/proc/{pid}/stat"))
                .ok()
                // `pid (comm) state ppid ...`; comm may hold spaces.
                .and_then(|st| {
                    let rest = &st[st.rfind(')')? + 1..];
                    rest.split_whitespace().nth(1)?.parse::<i32>().ok()
                })
                == Some(parent)
        })
        .collect()
}

/// The last lines of a log, for error messages (the directory goes away
/// with the server).
fn log_tail(log: &Path) -> String {
    let text = std::fs::read_to_string(log).unwrap_or_default();
    let lines: Vec<&str> = text.lines().collect();
    lines[lines.len().saturating_sub(15)..].join("\n")
}

fn ready_lines(log: &Path) -> usize {
    std::fs::read_to_string(log)
        .map(|s| {
            s.matches("database system is ready to accept connections")
                .count()
        })
        .unwrap_or(0)
}

impl Drop for PgServer {
    fn drop(&mut self) {
        self.stop();
    }
}
