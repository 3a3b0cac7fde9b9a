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

/// What `levee --version` says: the version and the commit built (see build.rs); a
/// profile-guided build (bench/pgo-build.sh) says so, as its speed differs from a plain
/// `cargo build --release`.
#[cfg(levee_pgo)]
const VERSION: &str = concat!(
    env!("CARGO_PKG_VERSION"),
    " (",
    env!("LEVEE_COMMIT"),
    ", profile-guided build)"
);
#[cfg(not(levee_pgo))]
const VERSION: &str = concat!(env!("CARGO_PKG_VERSION"), " (", env!("LEVEE_COMMIT"), ")");

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
    #[command(
        after_help = "Logs go to stderr, one line per event (and per request while [server] access_log is on).\n\
Environment:\n  \
LEVEE_LOG  what is logged: a level (trace, debug, info, warn, error, off) and target=level\n             \
pairs, comma-separated (default: info,redis=error; `info,levee::access=off` drops\n             \
the access log, `warn` keeps warnings and errors). A value levee cannot read is\n             \
warned of at start, and the default used."
    )]
    Run {
        /// Directory of *.toml policy files.
        #[arg(long, default_value = "policies", env = "LEVEE_POLICIES")]
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
    /// Validate a policy directory, like `nginx -t`. Exit status 0 when valid (warnings are
    /// printed), 1 on any error, 2 on a wrong command line.
    Check {
        /// Directory of *.toml policy files.
        #[arg(long, default_value = "policies", env = "LEVEE_POLICIES")]
        policies: PathBuf,
        /// The directory, given without `--policies` (`levee check /etc/levee/policies`); it
        /// wins over `--policies` and LEVEE_POLICIES.
        #[arg(value_name = "DIR")]
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
    #[arg(long, default_value = "policies", env = "LEVEE_POLICIES")]
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

/// What is logged without `LEVEE_LOG`. The Redis client's own lines are held to errors: during
/// a Cluster node's failover it logs each reconnection attempt (about a hundred a second),
/// where levee says once what failed and what that means (`LEVEE_LOG=info,redis=info` shows
/// them).
const DEFAULT_LOG: &str = "info,redis=error";

/// What follows `levee::` in a target levee logs under: its modules (`levee::proxy::…`), and
/// the access log's `levee::access`.
const LEVEE_TARGETS: [&str; 22] = [
    "access",
    "admin",
    "app",
    "breaker",
    "config",
    "cpu_quota",
    "degrade",
    "error",
    "fleet_clock",
    "limit",
    "log_throttle",
    "log_writer",
    "metrics",
    "open_files",
    "printable",
    "proxy",
    "queue",
    "redis_batch",
    "redis_cluster",
    "redis_sentinel",
    "redis_store",
    "redis_wait",
];

/// `eprintln!` and `println!` that never panic: stderr may be a full disk or a pipe whose
/// reader left, and a panic there turned a message into exit 101 with nothing said.
macro_rules! say {
    ($($arg:tt)*) => {{
        use std::io::Write as _;
        let _ = writeln!(std::io::stderr(), $($arg)*);
    }};
}
macro_rules! say_part {
    ($($arg:tt)*) => {{
        use std::io::Write as _;
        let _ = write!(std::io::stderr(), $($arg)*);
    }};
}
macro_rules! say_out {
    ($($arg:tt)*) => {{
        use std::io::Write as _;
        let _ = writeln!(std::io::stdout(), $($arg)*);
    }};
}
macro_rules! say_out_part {
    ($($arg:tt)*) => {{
        use std::io::Write as _;
        let _ = write!(std::io::stdout(), $($arg)*);
    }};
}

/// The log filter `LEVEE_LOG` asks for, or the default with the reason it was not taken: a
/// typo (`warnn`, read as a target to log everything of) or an empty value logged nothing at
/// all, and one bad word in a list dropped the whole list, without a word.
fn log_filter(asked: Option<&str>) -> (tracing_subscriber::EnvFilter, Option<String>) {
    let default = || tracing_subscriber::EnvFilter::new(DEFAULT_LOG);
    let Some(asked) = asked else {
        return (default(), None);
    };
    let not_taken = |why: String| {
        Some(format!(
            "LEVEE_LOG={asked:?} {why}; logging with the default `{DEFAULT_LOG}` (LEVEE_LOG takes a level, trace, debug, info, warn, error or off, and target=level pairs, comma-separated: `warn`, `info,levee::access=off`)"
        ))
    };
    if asked.trim().is_empty() {
        return (default(), not_taken("is empty".into()));
    }
    const LEVELS: [&str; 6] = ["trace", "debug", "info", "warn", "error", "off"];
    const TARGETS: [&str; 8] = [
        "levee",
        "redis",
        "hyper",
        "hyper_util",
        "tokio",
        "rustls",
        "h2",
        "lol_html",
    ];
    // A bare word that is no level reads as a target to log everything of (`warnn`), and
    // `levee::acess=off` as a target nothing logs under (the access log stayed on).
    let unread = asked.split(',').map(str::trim).find_map(|directive| {
        let target = directive.split(['=', '[']).next().unwrap_or_default();
        let bare_unknown = !directive.is_empty()
            && !directive.contains(['=', '[', ':'])
            && !LEVELS.contains(&directive.to_ascii_lowercase().as_str())
            && !TARGETS.contains(&directive);
        let misspelt = target
            .strip_prefix("levee::")
            .and_then(|path| path.split("::").next())
            .is_some_and(|part| !LEVEE_TARGETS.contains(&part));
        if bare_unknown {
            Some(format!("names `{directive}`, which is neither a level nor a part of levee"))
        } else if misspelt {
            Some(format!("names `{target}`, which is no part of levee (levee::access, levee::proxy, levee::breaker, levee::degrade, levee::queue, levee::redis_store, …)"))
        } else {
            None
        }
    });
    if let Some(why) = unread {
        return (default(), not_taken(why));
    }
    match tracing_subscriber::EnvFilter::builder().parse(asked) {
        Ok(filter) => (filter, None),
        Err(error) => (default(), not_taken(format!("is not understood ({error})"))),
    }
}

/// The log's writer thread, flushed before the process exits (see [`flush_logs`]).
static LOG_WRITER: std::sync::OnceLock<levee::log_writer::LogWriter> = std::sync::OnceLock::new();

/// Writes the lines logged so far before the process exits: at most 2 s, so a stderr that
/// takes nothing cannot hold the exit up.
fn flush_logs() {
    if let Some(writer) = LOG_WRITER.get() {
        writer.flush(std::time::Duration::from_secs(2));
    }
}

fn init_logging(format: LogFormat) {
    let asked = std::env::var("LEVEE_LOG").ok();
    let (filter, not_taken) = log_filter(asked.as_deref());
    // Logs go to stderr, through a thread of their own (a full disk or a stalled pipe never
    // holds up a request: see `log_writer`); colours only when a person is watching a
    // terminal, never into files.
    let writer = LOG_WRITER
        .get_or_init(|| {
            levee::log_writer::LogWriter::start(
                std::io::stderr(),
                matches!(format, LogFormat::Json),
            )
        })
        .clone();
    let builder = tracing_subscriber::fmt()
        .with_env_filter(filter)
        .with_writer(writer)
        .with_ansi(std::io::IsTerminal::is_terminal(&std::io::stderr()));
    match format {
        LogFormat::Text => builder.init(),
        LogFormat::Json => builder.json().flatten_event(true).init(),
    }
    if let Some(why) = not_taken {
        tracing::warn!("{why}");
    }
}

use levee::admin::client::{changed_text, Changed};

/// Whether a failure to start, logged already, is also written in plain words: when LEVEE_LOG
/// leaves errors out, and for a person starting levee by hand with JSON logs, which are for a
/// collector. Not into a journal or a file: a collector expecting one JSON object per line
/// met several lines of plain text.
fn told_in_words_too(log_format: LogFormat) -> bool {
    !tracing::enabled!(tracing::Level::ERROR)
        || (matches!(log_format, LogFormat::Json)
            && std::io::IsTerminal::is_terminal(&std::io::stderr()))
}

fn main() -> ExitCode {
    let code = match Cli::parse().command {
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
                    say!("levee: cannot start the async runtime: {error}");
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
                    if told_in_words_too(log_format) {
                        say!("levee: the policy has errors:\n{diagnostics}");
                    }
                    ExitCode::FAILURE
                }
                Err(error) => {
                    tracing::error!("{error}");
                    if told_in_words_too(log_format) {
                        say!("levee: {error}");
                    }
                    ExitCode::FAILURE
                }
            }
        }
    };
    flush_logs();
    code
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
            say!("levee: cannot start the async runtime: {error}");
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
            say_out_part!("{}", render(&text));
            ExitCode::SUCCESS
        }
        Ok((status, text)) => {
            // Admin reasons start with their status already ("404 no module named …").
            let reason = refusal_text(&text);
            if reason.starts_with(&status.to_string()) {
                say_part!("levee: {reason}");
            } else {
                say_part!("levee: {status}: {reason}");
            }
            ExitCode::FAILURE
        }
        Err(error) => {
            say!("levee: {error}");
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
        Ok(mut policy) => {
            // As `run` does: run as the user levee runs as (a unit's ExecStartPre), the check
            // says that switches could not be saved, before an incident does.
            levee::config::store::check_state_file_writable(&mut policy);
            for warning in &policy.warnings {
                say!("{warning}");
            }
            let warnings = match policy.warnings.len() {
                0 => String::new(),
                count => format!(" with {count} warning(s)"),
            };
            say_out!(
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
            say!("{diagnostics}");
            let errors = diagnostics
                .0
                .iter()
                .filter(|diagnostic| diagnostic.severity == levee::config::diag::Severity::Error)
                .count();
            say!(
                "levee: policy in {} has {errors} error(s)",
                policies.display(),
            );
            ExitCode::FAILURE
        }
    }
}

#[cfg(test)]
mod tests {
    use super::log_filter;

    #[test]
    fn a_log_filter_levee_cannot_read_is_said_and_the_default_used() {
        let said = |asked: Option<&str>| log_filter(asked).1;
        for fine in [
            None,
            Some("warn"),
            Some("INFO"),
            Some("info,levee::access=off"),
            Some("levee=debug,redis=info"),
            Some("levee"),
            Some("info,levee::proxy::upstream=debug,levee::access=off"),
        ] {
            assert_eq!(said(fine), None, "{fine:?}");
        }
        for (asked, why) in [
            ("warnn", "names `warnn`"),
            ("", "is empty"),
            ("  ", "is empty"),
            ("levee=warn,levee::access=of", "is not understood"),
            ("info,levee::acess=off", "names `levee::acess`"),
        ] {
            let told = said(Some(asked)).unwrap_or_default();
            assert!(
                told.contains(why) && told.contains("the default `info,redis=error`"),
                "{asked:?}: {told}"
            );
        }
    }

    #[test]
    fn every_module_of_levee_is_a_target_levee_log_takes() {
        let mut modules: Vec<&str> = include_str!("lib.rs")
            .lines()
            .filter_map(|line| line.strip_prefix("pub mod "))
            .map(|name| name.trim_end_matches(';'))
            .collect();
        let mut known: Vec<&str> = super::LEVEE_TARGETS
            .iter()
            .copied()
            .filter(|target| *target != "access")
            .collect();
        known.sort_unstable();
        modules.sort_unstable();
        assert_eq!(known, modules);
    }
}
