//! Work that must run exactly once, off the async workers when there are
//! any: a node's clean-up, and failing the requests a lost connection held
//! (both grow with the requests and subscriptions).

/// Runs `job` on the current runtime's blocking pool (the handle returned
/// finishes it) or, outside a runtime, here. Should tokio drop the job
/// unrun (its blocking pool shutting down), the job runs as it is dropped:
/// it runs once in every case.
pub(crate) fn run_blocking(
    job: impl FnOnce() + Send + 'static,
) -> Option<tokio::task::JoinHandle<()>> {
    let job = Once(Some(job));
    match tokio::runtime::Handle::try_current() {
        Ok(rt) => Some(rt.spawn_blocking(move || job.run())),
        Err(_) => {
            job.run();
            None
        }
    }
}

/// A job that runs when run, or else when dropped.
struct Once<F: FnOnce()>(Option<F>);

impl<F: FnOnce()> Once<F> {
    fn run(mut self) {
        if let Some(f) = self.0.take() {
            f();
        }
    }
}

impl<F: FnOnce()> Drop for Once<F> {
    fn drop(&mut self) {
        if let Some(f) = self.0.take() {
            f();
        }
    }
}
