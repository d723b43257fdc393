//! Reading a node's log while it runs.

use std::io::{BufRead, BufReader};
use std::process::ChildStderr;
use std::sync::mpsc::{channel, Receiver};

/// Forwards each line of `stderr` to the returned channel from a thread, so
/// a test can wait for a line with a deadline (`recv_timeout`).
pub(crate) fn lines(stderr: ChildStderr) -> Receiver<String> {
    let (tx, rx) = channel();
    std::thread::spawn(move || {
        for line in BufReader::new(stderr).lines().map_while(Result::ok) {
            // Keeps reading after the receiver is gone: the node must
            // never block on a full pipe.
            let _ = tx.send(line);
        }
    });
    rx
}
