//! The `levee` command: `run` the proxy, `check` policy files.

#![forbid(unsafe_code)]

use std::path::PathBuf;
use std::process::ExitCode;

use clap::{Parser, Subcommand, ValueEnum};

#[derive(Parser)]
#[command(
    name = "levee",
    version,
    about = "Resilience sidecar for legacy PHP sites"
)]
struct Cli {
    #[command(subcommand)]
    command: Command,
}

#[derive(Subcommand)]
enum Command {
    /// Run the proxy until SIGTERM/SIGINT (SIGHUP reloads the policy).
    Run {
        /// Directory of *.toml policy files.
        #[arg(long, default_value = "policies")]
        policies: PathBuf,
        /// Do not reload when policy files change (SIGHUP and POST /reload still work).
        #[arg(long)]
        no_watch: bool,
        /// Log format.
        #[arg(long, value_enum, default_value_t = LogFormat::Text)]
        log_format: LogFormat,
        /// Worker threads (default: one per CPU core).
        #[arg(long)]
        threads: Option<usize>,
    },
    /// Validate a policy directory, like `nginx -t`. Exit status 1 on any error.
    Check {
        /// Directory of *.toml policy files.
        #[arg(long, default_value = "policies")]
        policies: PathBuf,
    },
}

#[derive(Clone, Copy, ValueEnum)]
enum LogFormat {
    Text,
    Json,
}

fn init_logging(format: LogFormat) {
    let filter = tracing_subscriber::EnvFilter::try_from_env("LEVEE_LOG")
        .unwrap_or_else(|_| tracing_subscriber::EnvFilter::new("info"));
    let builder = tracing_subscriber::fmt().with_env_filter(filter);
    match format {
        LogFormat::Text => builder.init(),
        LogFormat::Json => builder.json().flatten_event(true).init(),
    }
}

fn main() -> ExitCode {
    match Cli::parse().command {
        Command::Check { policies } => check(&policies),
        Command::Run {
            policies,
            no_watch,
            log_format,
            threads,
        } => {
            init_logging(log_format);
            // One thread: a single-threaded scheduler, with no work-stealing to pay for.
            let mut runtime = if threads == Some(1) {
                tokio::runtime::Builder::new_current_thread()
            } else {
                tokio::runtime::Builder::new_multi_thread()
            };
            runtime.enable_all();
            if let Some(threads) = threads.filter(|threads| *threads > 1) {
                runtime.worker_threads(threads);
            }
            let runtime = match runtime.build() {
                Ok(runtime) => runtime,
                Err(error) => {
                    eprintln!("levee: cannot start the async runtime: {error}");
                    return ExitCode::FAILURE;
                }
            };
            let mut options = levee::Options::new(policies);
            options.watch = !no_watch;
            match runtime.block_on(levee::run(options)) {
                Ok(()) => ExitCode::SUCCESS,
                Err(error) => {
                    tracing::error!("{error}");
                    eprintln!("levee: {error}");
                    ExitCode::FAILURE
                }
            }
        }
    }
}

fn check(policies: &std::path::Path) -> ExitCode {
    match levee::config::load_dir(policies, None) {
        Ok(policy) => {
            println!(
                "levee: policy in {} is valid: {} file(s), {} route(s), {} upstream(s), hash {}",
                policies.display(),
                policy.files.len(),
                policy.routes.routes.len(),
                policy.upstreams.len(),
                policy.hash
            );
            ExitCode::SUCCESS
        }
        Err(diagnostics) => {
            eprintln!("{diagnostics}");
            eprintln!(
                "levee: policy in {} has {} error(s)",
                policies.display(),
                diagnostics.0.len()
            );
            ExitCode::FAILURE
        }
    }
}
