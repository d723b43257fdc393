//! Event loops for the bench: one single-threaded tokio runtime per thread,
//! like Vert.x's event loops, so a consumer and the code that registered it
//! stay on one core.

use std::future::Future;
use std::thread::JoinHandle;
use std::time::Duration;

use tokio::runtime::Handle;
use tokio::sync::oneshot;

/// How long a loop keeps polling for events after it last handled messages
/// before it sleeps (see `railyard_bus::spin_before_park`), unless
/// `RAILYARD_IDLE_SPIN_US` says otherwise (in microseconds; 0 turns it
/// off). Measured on 2026-11-27 with `bench echo --cluster etcd --nodes 2`,
/// interleaved runs (docs/benchmarks.md): against no spinning, 20 µs gave
/// send-send +9 % and send-reply -3 % (medians of 12 and 7 runs), 50 µs
/// +11 % and +16 % (9 and 7 runs); the one-process rows did not move
/// outside the noise. Multi-thread runtimes (`--runtime multi`, pingpong's
/// default in the driving process; its `--nodes 2` peer runs loops) do not
/// spin.
pub const IDLE_SPIN: Duration = Duration::from_micros(50);

fn idle_spin() -> Duration {
    std::env::var("RAILYARD_IDLE_SPIN_US")
        .ok()
        .and_then(|v| v.parse().ok())
        .map_or(IDLE_SPIN, Duration::from_micros)
}

/// How scenario tasks are scheduled.
#[derive(Debug, Clone, Copy, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
#[serde(rename_all = "kebab-case")]
pub enum RuntimeKind {
    /// One single-threaded runtime per thread, tasks pinned to the loop that
    /// spawned them (Vert.x's event-loop model).
    Loops,
    /// One work-stealing tokio runtime with that many workers (tokio's
    /// default model): a woken task runs next on the waking thread.
    Multi,
}

impl RuntimeKind {
    /// The CLI / JSON spelling.
    pub fn as_str(self) -> &'static str {
        match self {
            RuntimeKind::Loops => "loops",
            RuntimeKind::Multi => "multi",
        }
    }
}

/// Either a fixed set of single-threaded runtimes, each driven by its own
/// thread, or one multi-thread runtime. Dropping it stops them (tasks still
/// running are dropped).
pub struct EventLoops {
    handles: Vec<Handle>,
    stops: Vec<oneshot::Sender<()>>,
    threads: Vec<JoinHandle<()>>,
}

impl EventLoops {
    /// Starts `n` loops (at least one), with timers only.
    ///
    /// # Panics
    /// If a runtime or thread cannot be created (out of resources).
    pub fn new(n: usize, kind: RuntimeKind) -> Self {
        Self::build(n, kind, false)
    }

    /// Starts `n` loops that can also do I/O (sockets), for clustered runs:
    /// the cluster node joined on a loop keeps its links there, beside the
    /// consumers, so a message between a link and a consumer on the same
    /// loop crosses no thread.
    ///
    /// # Panics
    /// As [`new`](Self::new).
    pub fn with_io(n: usize, kind: RuntimeKind) -> Self {
        Self::build(n, kind, true)
    }

    fn build(n: usize, kind: RuntimeKind, io: bool) -> Self {
        if kind == RuntimeKind::Multi {
            let mut b = tokio::runtime::Builder::new_multi_thread();
            b.worker_threads(n.max(1)).thread_name("bench-worker");
            if io {
                b.enable_all();
            } else {
                // Timers only, as for the loops below.
                b.enable_time();
            }
            let rt = b.build().expect("create a multi-thread runtime");
            let (stop_tx, stop_rx) = oneshot::channel::<()>();
            let handles = vec![rt.handle().clone()];
            let t = std::thread::Builder::new()
                .name("bench-runtime".into())
                .spawn(move || {
                    let _ = rt.block_on(stop_rx);
                    rt.shutdown_background();
                })
                .expect("spawn the runtime thread");
            return Self {
                handles,
                stops: vec![stop_tx],
                threads: vec![t],
            };
        }
        let mut handles = Vec::new();
        let mut stops = Vec::new();
        let mut threads = Vec::new();
        let cpus = allowed_cpus();
        let pin = std::env::var_os("RAILYARD_PIN_LOOPS").is_some_and(|v| v == "1");
        let dispatch = std::env::var_os("RAILYARD_LOOP_DISPATCH").is_none_or(|v| v != "0");
        for i in 0..n.max(1) {
            // Timers only unless asked, no I/O driver: a wake from another
            // thread then costs an atomic store unless this loop is actually
            // asleep, instead of an eventfd write every time. Only clustered
            // scenarios do I/O on these loops.
            let mut b = tokio::runtime::Builder::new_current_thread();
            if io {
                b.enable_all();
            } else {
                b.enable_time();
            }
            railyard_bus::spin_before_park(&mut b, idle_spin());
            let rt = b.build().expect("create a current-thread runtime");
            handles.push(rt.handle().clone());
            let (stop_tx, stop_rx) = oneshot::channel::<()>();
            stops.push(stop_tx);
            // Thread per core, opt-in (`RAILYARD_PIN_LOOPS=1`): when the loops
            // are as many as the allowed CPUs, loop i stays on the i-th. Left to the scheduler, two loops that
            // wake each other through futexes get pulled onto one core (wake
            // affinity) and then take turns on it (measured: 0.98 CPUs used,
            // 48k context switches/s, half the round trips). Fewer loops than
            // CPUs are left unpinned: with `--nodes 2` each process runs half
            // the loops, and two processes pinning "their first loop" would
            // share one core.
            // Off by default: on a machine shared with other work a pinned
            // loop cannot leave a core another process holds, and the other
            // loop then waits for it (docs/benchmarks.md, "Noise").
            let cpu = (pin && n == cpus.len()).then(|| cpus[i]);
            threads.push(
                std::thread::Builder::new()
                    .name(format!("bench-loop-{i}"))
                    .spawn(move || {
                        if let Some(cpu) = cpu {
                            pin_to(cpu);
                        }
                        let _ = rt.block_on(async move {
                            // Handler consumers registered on this loop run on
                            // its dispatcher (railyard_bus::enable_loop_dispatch);
                            // `RAILYARD_LOOP_DISPATCH=0` keeps a task per consumer,
                            // for comparing the two.
                            // A loop with an I/O driver also relays other
                            // threads' wake-ups of its requesters through
                            // the dispatcher (see
                            // railyard_bus::enable_loop_dispatch_relaying_wakes).
                            if dispatch && io {
                                railyard_bus::enable_loop_dispatch_relaying_wakes();
                            } else if dispatch {
                                railyard_bus::enable_loop_dispatch();
                            }
                            stop_rx.await
                        });
                        rt.shutdown_background();
                    })
                    .expect("spawn an event loop thread"),
            );
        }
        Self {
            handles,
            stops,
            threads,
        }
    }

    /// Number of runtimes: the loops, or 1 for a multi-thread runtime.
    pub fn len(&self) -> usize {
        self.handles.len()
    }

    /// Whether there are no loops (never: `new` makes at least one).
    pub fn is_empty(&self) -> bool {
        self.handles.is_empty()
    }

    /// Runs `fut` on loop `i % len` and returns its output.
    pub async fn run_on<F>(&self, i: usize, fut: F) -> F::Output
    where
        F: Future + Send + 'static,
        F::Output: Send + 'static,
    {
        let h = &self.handles[i % self.handles.len()];
        h.spawn(fut).await.expect("bench task panicked")
    }

    /// Spawns `fut` on loop `i % len` without waiting for it.
    pub fn spawn_on<F>(&self, i: usize, fut: F)
    where
        F: Future<Output = ()> + Send + 'static,
    {
        let h = &self.handles[i % self.handles.len()];
        drop(h.spawn(fut));
    }
}

impl Drop for EventLoops {
    fn drop(&mut self) {
        for s in self.stops.drain(..) {
            let _ = s.send(());
        }
        for t in self.threads.drain(..) {
            let _ = t.join();
        }
    }
}

/// The CPUs this process may run on.
fn allowed_cpus() -> Vec<usize> {
    // Safety: `sched_getaffinity` fills the zeroed set it is given, of the
    // size passed; the CPU_* helpers only read or write within that set.
    unsafe {
        let mut set: libc::cpu_set_t = std::mem::zeroed();
        if libc::sched_getaffinity(0, std::mem::size_of::<libc::cpu_set_t>(), &mut set) != 0 {
            return Vec::new();
        }
        (0..libc::CPU_SETSIZE as usize)
            .filter(|&c| libc::CPU_ISSET(c, &set))
            .collect()
    }
}

/// Pins the calling thread to `cpu`; on failure it stays unpinned (and says so).
fn pin_to(cpu: usize) {
    // Safety: as in `allowed_cpus`; `sched_setaffinity(0, ..)` applies to the
    // calling thread only.
    let ok = unsafe {
        let mut set: libc::cpu_set_t = std::mem::zeroed();
        libc::CPU_SET(cpu, &mut set);
        libc::sched_setaffinity(0, std::mem::size_of::<libc::cpu_set_t>(), &set) == 0
    };
    if !ok {
        tracing::debug!(cpu, "could not pin an event loop; it runs unpinned");
    }
}
