//! The `levee` command: `run` the proxy, `check` policy files, and talk to a running levee
//! (`status`, `level`, `module`, `breaker`, `reload`).

#![deny(unsafe_code)]

mod allocator;

/// See `allocator`: allocations on the request path are much cheaper than with glibc.
#[global_allocator]
static ALLOCATOR: allocator::Mimalloc = allocator::Mimalloc;

use std::path::PathBuf;
use std::process::ExitCode;

use clap::{Parser, Subcommand, ValueEnum};

/// What `levee --version` says: a profile-guided build (bench/pgo-build.sh) says so, as its
/// speed differs from a plain `cargo build --release`.
#[cfg(levee_pgo)]
const VERSION: &str = concat!(env!("CARGO_PKG_VERSION"), " (profile-guided build)");
#[cfg(not(levee_pgo))]
const VERSION: &str = env!("CARGO_PKG_VERSION");

#[derive(Parser)]
#[command(
    name = "levee",
    version = VERSION,
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
        /// The directory, given without `--policies` (`levee check /etc/levee/policies`).
        #[arg(conflicts_with = "policies", value_name = "DIR")]
        dir: Option<PathBuf>,
    },
    /// Show what a running levee is doing: policy generation, degrade level and modules,
    /// breakers, Redis.
    Status {
        #[command(flatten)]
        admin: AdminArgs,
        /// Print the raw JSON of GET /status.
        #[arg(long)]
        json: bool,
    },
    /// Set the degrade level fleet-wide: 0 normal, 1 tier 3 off, 2 tiers 2 and 3 off, or
    /// `policy` to hand it back to the policy files.
    Level {
        /// 0, 1, 2 or policy
        level: String,
        #[command(flatten)]
        admin: AdminArgs,
    },
    /// Switch a module on or off fleet-wide, or hand it back to the policy.
    Module {
        /// Module name, as in /status.
        name: String,
        /// on, off or policy
        state: String,
        #[command(flatten)]
        admin: AdminArgs,
    },
    /// Pin an upstream's circuit breaker open or closed fleet-wide, or give control back (auto).
    Breaker {
        /// Upstream name.
        name: String,
        /// open, closed or auto
        state: String,
        #[command(flatten)]
        admin: AdminArgs,
    },
    /// Reload the policy files now (like SIGHUP); prints the errors if they are refused.
    Reload {
        #[command(flatten)]
        admin: AdminArgs,
    },
}

/// `--admin`: an address, or a host name and port (`localhost:9901`), its first address.
fn admin_address(text: &str) -> Result<std::net::SocketAddr, String> {
    use std::net::ToSocketAddrs;
    if let Ok(address) = text.parse() {
        return Ok(address);
    }
    let addresses: Vec<std::net::SocketAddr> = text
        .to_socket_addrs()
        .map_err(|error| format!("`{text}` is no HOST:PORT levee can reach ({error})"))?
        .collect();
    // IPv4 first: `localhost` is often `::1` first too, and the admin listener's default
    // is 127.0.0.1.
    addresses
        .iter()
        .find(|address| address.is_ipv4())
        .or(addresses.first())
        .copied()
        .ok_or_else(|| format!("`{text}` names no address"))
}

/// How to reach a running levee's admin listener.
#[derive(clap::Args)]
struct AdminArgs {
    /// Admin listener address, `HOST:PORT` (default: `[admin] listen` from --policies, else
    /// 127.0.0.1:9901).
    #[arg(long, value_parser = admin_address)]
    admin: Option<std::net::SocketAddr>,
    /// Policy directory to read the admin address from.
    #[arg(long, default_value = "policies")]
    policies: PathBuf,
    /// Admin token, when the policy sets `[admin] tokens`.
    #[arg(long, env = "LEVEE_ADMIN_TOKEN", hide_env_values = true)]
    token: Option<String>,
}

#[derive(Clone, Copy, ValueEnum)]
enum LogFormat {
    Text,
    Json,
}

fn init_logging(format: LogFormat) {
    // The Redis client's own lines are held to errors by default: during a Cluster node's
    // failover it logs each reconnection attempt (about a hundred a second), where levee says
    // once what failed and what that means (`LEVEE_LOG=info,redis=info` shows them).
    let filter = tracing_subscriber::EnvFilter::try_from_env("LEVEE_LOG")
        .unwrap_or_else(|_| tracing_subscriber::EnvFilter::new("info,redis=error"));
    // Logs go to stderr; colours only when a person is watching a terminal, never into files.
    let builder = tracing_subscriber::fmt()
        .with_env_filter(filter)
        .with_writer(std::io::stderr)
        .with_ansi(std::io::IsTerminal::is_terminal(&std::io::stderr()));
    match format {
        LogFormat::Text => builder.init(),
        LogFormat::Json => builder.json().flatten_event(true).init(),
    }
}

use levee::admin::client::{changed_text, Changed};

fn main() -> ExitCode {
    match Cli::parse().command {
        Command::Check { policies, dir } => check(dir.as_deref().unwrap_or(&policies)),
        Command::Status { admin, json } => admin_command(
            admin,
            http::Method::GET,
            "/status".into(),
            String::new(),
            move |body| match serde_json::from_str::<serde_json::Value>(body) {
                Ok(value) if !json => levee::admin::client::summarize(&value),
                _ => body.to_string(),
            },
        ),
        Command::Level { level, admin } => admin_command(
            admin,
            http::Method::POST,
            "/level".into(),
            level,
            |answer| changed_text(answer, Changed::Level),
        ),
        Command::Module { name, state, admin } => admin_command(
            admin,
            http::Method::POST,
            format!("/modules/{}", levee::admin::client::path_segment(&name)),
            state,
            |answer| changed_text(answer, Changed::Module(&name)),
        ),
        Command::Breaker { name, state, admin } => admin_command(
            admin,
            http::Method::POST,
            format!("/breakers/{}", levee::admin::client::path_segment(&name)),
            state,
            |answer| changed_text(answer, Changed::Breaker(&name)),
        ),
        Command::Reload { admin } => admin_command(
            admin,
            http::Method::POST,
            "/reload".into(),
            String::new(),
            reload_text,
        ),
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
                Err(levee::StartError::Policy(diagnostics)) => {
                    // One line per error, each whole, as a refused reload logs them: under
                    // journald or a line-based collector only a first line of "the policy
                    // has errors:" carried ERROR, and none of the detail.
                    for diagnostic in &diagnostics.0 {
                        match diagnostic.severity {
                            levee::config::diag::Severity::Error => tracing::error!(
                                "levee cannot start, the policy has errors: {}",
                                diagnostic.one_line()
                            ),
                            levee::config::diag::Severity::Warning => {
                                tracing::warn!("{}", diagnostic.one_line())
                            }
                        }
                    }
                    if matches!(log_format, LogFormat::Json)
                        || !tracing::enabled!(tracing::Level::ERROR)
                    {
                        eprintln!("levee: the policy has errors:\n{diagnostics}");
                    }
                    ExitCode::FAILURE
                }
                Err(error) => {
                    tracing::error!("{error}");
                    // A text log line is on the terminal already; a JSON one is for a
                    // collector, so a person starting levee by hand is told in words too, as
                    // when LEVEE_LOG leaves errors out.
                    if matches!(log_format, LogFormat::Json)
                        || !tracing::enabled!(tracing::Level::ERROR)
                    {
                        eprintln!("levee: {error}");
                    }
                    ExitCode::FAILURE
                }
            }
        }
    }
}

/// Runs one admin request and prints `render(body)` on success, the server's reason otherwise.
fn admin_command(
    args: AdminArgs,
    method: http::Method,
    path: String,
    body: String,
    render: impl Fn(&str) -> String,
) -> ExitCode {
    let runtime = match tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
    {
        Ok(runtime) => runtime,
        Err(error) => {
            eprintln!("levee: cannot start the async runtime: {error}");
            return ExitCode::FAILURE;
        }
    };
    let address = levee::admin::client::admin_address(args.admin, &args.policies);
    let result = runtime.block_on(levee::admin::client::call(
        address,
        method,
        &path,
        &body,
        args.token.as_deref(),
    ));
    match result {
        Ok((status, text)) if (200..300).contains(&status) => {
            print!("{}", render(&text));
            ExitCode::SUCCESS
        }
        Ok((status, text)) => {
            // Admin reasons start with their status already ("404 no module named …").
            let reason = refusal_text(&text);
            if reason.starts_with(&status.to_string()) {
                eprint!("levee: {reason}");
            } else {
                eprint!("levee: {status}: {reason}");
            }
            ExitCode::FAILURE
        }
        Err(error) => {
            eprintln!("levee: {error}");
            ExitCode::FAILURE
        }
    }
}

/// `POST /reload`'s answer as a line to read, then the policy's warnings as `levee check`
/// prints them.
fn reload_text(text: &str) -> String {
    let Ok(answer) = serde_json::from_str::<serde_json::Value>(text) else {
        return text.to_string();
    };
    let mut out = if answer["changed"] == true {
        format!(
            "levee: policy reloaded: generation {}, hash {}\n",
            answer["generation"],
            answer["hash"].as_str().unwrap_or("?")
        )
    } else {
        format!(
            "levee: policy unchanged: the files are those of generation {}, which keeps running\n",
            answer["generation"]
        )
    };
    for warning in answer["warnings"].as_array().into_iter().flatten() {
        out.push_str(warning.as_str().unwrap_or_default());
        out.push('\n');
    }
    out
}

/// A refused reload's answer as `levee check` prints errors (`file:line:col: error: …` and
/// the hint under it); any other answer as it came.
fn refusal_text(text: &str) -> String {
    let Ok(answer) = serde_json::from_str::<serde_json::Value>(text) else {
        return text.to_string();
    };
    let Some(errors) = answer["errors"].as_array() else {
        return text.to_string();
    };
    let mut out = format!(
        "the policy was refused; generation {} keeps running\n",
        answer["active_generation"]
    );
    for error in errors {
        let field = |name: &str| error[name].as_str().unwrap_or_default().to_string();
        // A file not read is a warning beside the errors it explains; a levee from before
        // `severity` was sent listed errors only.
        let severity = error["severity"].as_str().unwrap_or("error");
        out.push_str(&format!(
            "{}: {severity}: {}\n",
            field("location"),
            field("message")
        ));
        if let Some(hint) = error["hint"].as_str() {
            out.push_str(&format!("  hint: {hint}\n"));
        }
    }
    out
}

fn check(policies: &std::path::Path) -> ExitCode {
    match levee::config::load_dir(policies, None) {
        Ok(policy) => {
            for warning in &policy.warnings {
                eprintln!("{warning}");
            }
            let warnings = match policy.warnings.len() {
                0 => String::new(),
                count => format!(" with {count} warning(s)"),
            };
            println!(
                "levee: policy in {} is valid{warnings}: {} file(s), {} route(s), {} upstream(s), hash {}",
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
            let errors = diagnostics
                .0
                .iter()
                .filter(|diagnostic| diagnostic.severity == levee::config::diag::Severity::Error)
                .count();
            eprintln!(
                "levee: policy in {} has {errors} error(s)",
                policies.display(),
            );
            ExitCode::FAILURE
        }
    }
}
