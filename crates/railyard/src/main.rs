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
