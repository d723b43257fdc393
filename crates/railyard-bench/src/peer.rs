//! Running an original system from `peers/` (a Java program) in the same run.
//!
//! A peer is a Maven project that builds a runnable jar and prints, as its
//! last stdout line, `RESULT {json}`. The JVM flags live next to it in
//! `jvm.options`, so whoever reruns the peer by hand uses the same ones.

use std::path::{Path, PathBuf};
use std::process::Stdio;

use tokio::io::{AsyncBufReadExt, BufReader};
use tokio::process::Command;

/// Why a peer run failed.
#[derive(Debug, thiserror::Error)]
pub enum PeerError {
    /// The peer's directory is missing.
    #[error("peer directory {0} not found: run from the repository root or pass --peers-dir")]
    Missing(PathBuf),
    /// A tool could not be started.
    #[error("could not start `{tool}`: {source}; install it (the README lists how)")]
    Spawn {
        /// The program.
        tool: String,
        /// The OS error.
        source: std::io::Error,
    },
    /// The build failed.
    #[error("building the peer failed (`mvn -q -B package -DskipTests` in {0}); run it there to see why")]
    Build(PathBuf),
    /// The peer exited without a result line.
    #[error("the peer exited ({status}) without a RESULT line")]
    NoResult {
        /// Exit status.
        status: String,
    },
    /// The result line was not valid JSON.
    #[error("the peer's RESULT line is not valid JSON: {0}")]
    BadResult(#[from] serde_json::Error),
    /// I/O while reading its output.
    #[error("reading the peer's output: {0}")]
    Io(#[from] std::io::Error),
}

/// A Java peer program under `peers/`.
#[derive(Debug, Clone)]
pub struct JavaPeer {
    dir: PathBuf,
    jar: String,
    /// Prefix for the peer's echoed output lines.
    label: String,
}

impl JavaPeer {
    /// The peer in `peers_dir/name`, whose jar is `target/<jar>`.
    pub fn new(peers_dir: &Path, name: &str, jar: &str) -> Self {
        let dir = peers_dir.join(name);
        // The peer runs with its own directory as working directory, so every
        // path handed to it must be absolute.
        let dir = std::fs::canonicalize(&dir).unwrap_or(dir);
        Self {
            dir,
            jar: jar.to_owned(),
            label: name.to_owned(),
        }
    }

    fn jar_path(&self) -> PathBuf {
        self.dir.join("target").join(&self.jar)
    }

    /// Builds the jar unless it exists and is newer than every file of
    /// `pom.xml` and `src/` (a jar older than a source change would run the
    /// old peer).
    ///
    /// # Errors
    /// [`PeerError::Missing`], [`PeerError::Spawn`], [`PeerError::Build`].
    pub async fn ensure_built(&self) -> Result<(), PeerError> {
        if !self.dir.is_dir() {
            return Err(PeerError::Missing(self.dir.clone()));
        }
        let built = std::fs::metadata(self.jar_path()).and_then(|m| m.modified());
        let sources =
            newest_modified(&self.dir.join("src")).max(newest_modified(&self.dir.join("pom.xml")));
        match (built, sources) {
            (Ok(jar), Some(src)) if jar >= src => return Ok(()),
            (Ok(_), None) => return Ok(()),
            (Ok(_), Some(_)) => eprintln!("rebuilding {}: its sources changed...", self.label),
            (Err(_), _) => eprintln!("building {} with Maven (first run only)...", self.label),
        }
        let status = Command::new("mvn")
            .args(["-q", "-B", "package", "-DskipTests"])
            .current_dir(&self.dir)
            .status()
            .await
            .map_err(|source| PeerError::Spawn {
                tool: "mvn".into(),
                source,
            })?;
        if !status.success() || !self.jar_path().is_file() {
            return Err(PeerError::Build(self.dir.clone()));
        }
        Ok(())
    }

    fn jvm_flags(&self) -> Vec<String> {
        std::fs::read_to_string(self.dir.join("jvm.options"))
            .unwrap_or_default()
            .lines()
            .map(str::trim)
            .filter(|l| !l.is_empty() && !l.starts_with('#'))
            .map(str::to_owned)
            .collect()
    }

    /// `java <jvm.options> -jar <jar>`, in the peer's directory, for callers
    /// that run the peer as a long-lived server rather than to a `RESULT`.
    pub fn java_command(&self) -> Command {
        let mut cmd = Command::new("java");
        cmd.args(self.jvm_flags())
            .arg("-jar")
            .arg(self.jar_path())
            .current_dir(&self.dir);
        cmd
    }

    /// The `java` arguments that run this peer's jar with `args` (the JVM
    /// flags from `jvm.options` first), and the directory to run them in; for
    /// peers that are long-running servers rather than one-shot benches.
    pub fn java_args(&self, args: &[String]) -> (Vec<String>, PathBuf) {
        let mut v = self.jvm_flags();
        v.push("-jar".to_owned());
        v.push(self.jar_path().display().to_string());
        v.extend(args.iter().cloned());
        (v, self.dir.clone())
    }

    /// Runs the peer with `args`, echoing its output when `verbose`, and
    /// returns the parsed `RESULT` object.
    ///
    /// # Errors
    /// Any [`PeerError`].
    pub async fn run(
        &self,
        args: &[String],
        verbose: bool,
    ) -> Result<serde_json::Value, PeerError> {
        self.ensure_built().await?;
        let mut child = Command::new("java")
            .args(self.jvm_flags())
            .arg("-jar")
            .arg(self.jar_path())
            .args(args)
            .current_dir(&self.dir)
            .stdout(Stdio::piped())
            .stderr(Stdio::inherit())
            .kill_on_drop(true)
            .spawn()
            .map_err(|source| PeerError::Spawn {
                tool: "java".into(),
                source,
            })?;
        let stdout = child.stdout.take().expect("stdout is piped");
        let mut lines = BufReader::new(stdout).lines();
        let mut result = None;
        while let Some(line) = lines.next_line().await? {
            if let Some(json) = line.strip_prefix("RESULT ") {
                result = Some(serde_json::from_str(json)?);
            } else if verbose {
                println!("[{}] {line}", self.label);
            }
        }
        let status = child.wait().await?;
        result.ok_or(PeerError::NoResult {
            status: status.to_string(),
        })
    }
}

/// Where `peers/` is: `--peers-dir`, else `./peers`, else next to the source tree.
pub fn default_peers_dir() -> PathBuf {
    let here = PathBuf::from("peers");
    if here.is_dir() {
        return here;
    }
    Path::new(env!("CARGO_MANIFEST_DIR")).join("../../peers")
}

/// The latest modification time of `path` or, for a directory, of any file
/// under it; `None` if nothing there can be read.
fn newest_modified(path: &Path) -> Option<std::time::SystemTime> {
    let meta = std::fs::metadata(path).ok()?;
    if !meta.is_dir() {
        return meta.modified().ok();
    }
    std::fs::read_dir(path)
        .ok()?
        .filter_map(Result::ok)
        .filter_map(|e| newest_modified(&e.path()))
        .max()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_newest_file_under_a_directory_dates_it() {
        let dir = std::env::temp_dir().join(format!("railyard-peer-mtime-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&dir);
        std::fs::create_dir_all(dir.join("a/b")).unwrap();
        let old = dir.join("a/old.java");
        let new = dir.join("a/b/new.java");
        std::fs::write(&old, "old").unwrap();
        std::fs::write(&new, "new").unwrap();
        let t0 = std::time::SystemTime::UNIX_EPOCH + std::time::Duration::from_secs(1_000_000);
        let t1 = t0 + std::time::Duration::from_secs(60);
        std::fs::File::options()
            .write(true)
            .open(&old)
            .unwrap()
            .set_modified(t0)
            .unwrap();
        std::fs::File::options()
            .write(true)
            .open(&new)
            .unwrap()
            .set_modified(t1)
            .unwrap();
        assert_eq!(newest_modified(&old), Some(t0));
        // A directory is dated by its newest file, however deep.
        assert_eq!(newest_modified(&dir), Some(t1));
        assert_eq!(newest_modified(&dir.join("missing")), None);
        let _ = std::fs::remove_dir_all(&dir);
    }
}
