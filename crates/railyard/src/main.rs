//! `railyard`: run a node, run the bench lab.
//!
//! The binary is thin: argument parsing, logging set-up and wiring. The work
//! lives in the library crates (`railyard-bus`, `railyard-bench`).

use std::io::IsTerminal;
use std::process::ExitCode;

use clap::{Parser, Subcommand};
use mimalloc::MiMalloc;

mod bench_bridge;
mod bench_c10k;
mod bench_cmd;
mod bench_plot;
mod bench_redis;
mod bench_saga;
mod bridge_node;
mod cluster_node;
mod dev;
mod http_node;
mod node;
mod node_config;
mod redis_node;
mod saga_node;

// The bus allocates one small `Arc` per message; mimalloc's thread-local free
// lists make that, and the cross-thread frees it implies, cheap.
#[global_allocator]
static GLOBAL: MiMalloc = MiMalloc;

/// `mi_option_purge_delay` in mimalloc 3's `mi_option_e` (`mimalloc.h`);
/// `libmimalloc-sys` names only some options. The test below checks that
/// the index still reads this option's documented default.
const MI_OPTION_PURGE_DELAY: libmimalloc_sys::mi_option_t = 15;

/// How long memory that fell free stays mapped before mimalloc returns it
/// to the OS. Its default (1 s) made a busy gRPC server refault fresh pages
/// all the time: tonic and hyper allocate an 8 KiB buffer and a task per
/// call, pages of them empty out and are purged within a second, and each
/// purged 2 MiB region comes back as a transparent huge page that the
/// kernel zeroes (`clear_page_erms`: 5 % of an Omega saga run's CPU, page
/// faults 10.7k per 40k transactions, 1.5k with this delay). Ten seconds
/// keeps a busy node's memory and still gives an idle one's back.
const PURGE_DELAY_MS: std::ffi::c_long = 10_000;

fn tune_allocator() {
    // SAFETY: `mi_option_set` only stores the value in mimalloc's option
    // table; any value is valid for this option and it may be set at any time.
    unsafe { libmimalloc_sys::mi_option_set(MI_OPTION_PURGE_DELAY, PURGE_DELAY_MS) }
}

/// Railyard: a fast, dependable runtime for event-driven services.
#[derive(Debug, Parser)]
#[command(name = "railyard", version, about, long_about = None)]
struct Cli {
    /// Log format for stderr.
    #[arg(long, global = true, value_enum, default_value_t = LogFormat::Text, env = "RAILYARD_LOG_FORMAT")]
    log_format: LogFormat,
    #[command(subcommand)]
    command: Command,
}

#[derive(Debug, Clone, Copy, clap::ValueEnum)]
enum LogFormat {
    /// Human-readable lines.
    Text,
    /// One JSON object per line.
    Json,
}

#[derive(Debug, Subcommand)]
enum Command {
    /// Run a node on embedded defaults (the event bus, optionally clustered on etcd; its TCP
    /// bridge on 7000; the HTTP server on 8080 with metrics on 8081; the saga coordinator on
    /// 8090 with its durable log in ./railyard-data/saga), until SIGINT or SIGTERM.
    Node(Box<node::NodeArgs>),
    /// Run a benchmark scenario, optionally side by side with the original system.
    #[command(subcommand)]
    Bench(bench_cmd::BenchCommand),
    /// Developer helpers: a local etcd, local Redis clusters and test doubles.
    #[command(subcommand)]
    Dev(dev::DevCommand),
}

fn init_logging(format: LogFormat) {
    let filter = tracing_subscriber::EnvFilter::try_from_env("RAILYARD_LOG")
        .unwrap_or_else(|_| tracing_subscriber::EnvFilter::new("info"));
    let builder = tracing_subscriber::fmt()
        .with_env_filter(filter)
        .with_writer(std::io::stderr)
        .with_ansi(std::io::stderr().is_terminal());
    match format {
        LogFormat::Text => builder.init(),
        LogFormat::Json => builder.json().init(),
    }
}

fn main() -> ExitCode {
    tune_allocator();
    let cli = Cli::parse();
    init_logging(cli.log_format);
    let rt = match tokio::runtime::Builder::new_multi_thread()
        .enable_all()
        .build()
    {
        Ok(rt) => rt,
        Err(e) => {
            eprintln!("error: cannot start the async runtime: {e}");
            return ExitCode::FAILURE;
        }
    };
    let result = rt.block_on(async {
        match cli.command {
            Command::Node(args) => node::run(*args).await,
            Command::Bench(cmd) => bench_cmd::run(cmd).await,
            Command::Dev(cmd) => dev::run(cmd).await,
        }
    });
    match result {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("error: {e:#}");
            ExitCode::FAILURE
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn purge_delay_index_names_mimallocs_purge_delay() {
        // mimalloc 3 documents `purge_delay` with a default of 1000 ms, and
        // no neighbouring option defaults to that; a renumbered enum fails here.
        // SAFETY: reads mimalloc's option table.
        let default = unsafe { libmimalloc_sys::mi_option_get(MI_OPTION_PURGE_DELAY) };
        assert_eq!(
            default, 1000,
            "index {MI_OPTION_PURGE_DELAY} is not purge_delay"
        );
        tune_allocator();
        // SAFETY: as above.
        let set = unsafe { libmimalloc_sys::mi_option_get(MI_OPTION_PURGE_DELAY) };
        assert_eq!(set, PURGE_DELAY_MS);
    }
}
