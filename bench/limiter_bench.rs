//! Drives levee's Redis rate limiter on its own, the way the proxy calls it, without HTTP:
//! the counterpart of `redis-benchmark` running the limiter's EVALSHA in bench/run.sh.
//!
//!     limiter-bench POLICY_DIR RULE CONCURRENCY SECONDS [KEYS]
//!
//! It compiles the policy in POLICY_DIR (it must have `[redis]` and `[limit.RULE]`), then keeps
//! CONCURRENCY decisions in flight on one thread (tokio's current-thread scheduler, like
//! `levee run --threads 1`) for SECONDS, each for another of KEYS client addresses (default
//! 100000, like `redis-benchmark -r 100000`), after a one-second warm-up that also loads the
//! script. It prints one line:
//!
//!     LIMITER decisions=N duration_us=D redis=R other=O p50_us=.. p99_us=.. p999_us=..
//!
//! where `redis` counts decisions Redis made and `other` those made without it (the fallback
//! when Redis was slower than its timeout). Exit status 1 on bad arguments or a policy error.

use std::net::{IpAddr, Ipv4Addr};
use std::process::ExitCode;
use std::sync::Arc;
use std::time::{Duration, Instant};

use http::{HeaderMap, Method};
use levee::limit::key::RequestFacts;
use levee::limit::Limiter;
use levee::metrics::Metrics;

struct Args {
    policies: std::path::PathBuf,
    rule: String,
    concurrency: usize,
    seconds: u64,
    keys: u32,
}

fn parse_args() -> Result<Args, String> {
    let args: Vec<String> = std::env::args().skip(1).collect();
    if args.len() < 4 || args.len() > 5 {
        return Err("usage: limiter-bench POLICY_DIR RULE CONCURRENCY SECONDS [KEYS]".into());
    }
    let number = |text: &str, what: &str| {
        text.parse::<u64>()
            .ok()
            .filter(|n| *n > 0)
            .ok_or_else(|| format!("{what} must be a positive integer, not `{text}`"))
    };
    Ok(Args {
        policies: args[0].clone().into(),
        rule: args[1].clone(),
        concurrency: number(&args[2], "CONCURRENCY")? as usize,
        seconds: number(&args[3], "SECONDS")?,
        keys: match args.get(4) {
            Some(text) => u32::try_from(number(text, "KEYS")?).map_err(|e| e.to_string())?,
            None => 100_000,
        },
    })
}

fn main() -> ExitCode {
    let args = match parse_args() {
        Ok(args) => args,
        Err(message) => {
            eprintln!("limiter-bench: {message}");
            return ExitCode::FAILURE;
        }
    };
    let runtime = match tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
    {
        Ok(runtime) => runtime,
        Err(error) => {
            eprintln!("limiter-bench: cannot start a runtime: {error}");
            return ExitCode::FAILURE;
        }
    };
    match runtime.block_on(run(args)) {
        Ok(line) => {
            println!("{line}");
            ExitCode::SUCCESS
        }
        Err(message) => {
            eprintln!("limiter-bench: {message}");
            ExitCode::FAILURE
        }
    }
}

/// Decisions made by Redis and by anything else so far, from levee's own counters.
fn decisions_by_source(metrics: &Metrics) -> (u64, u64) {
    let mut redis = 0;
    let mut other = 0;
    for line in metrics.encode().lines() {
        if !line.starts_with("levee_ratelimit_decisions_total{") {
            continue;
        }
        let count = line
            .rsplit(' ')
            .next()
            .and_then(|n| n.parse::<f64>().ok())
            .unwrap_or(0.0) as u64;
        if line.contains("source=\"redis\"") {
            redis += count;
        } else {
            other += count;
        }
    }
    (redis, other)
}

async fn run(args: Args) -> Result<String, String> {
    let policy = levee::config::load_dir(&args.policies, None).map_err(|e| e.to_string())?;
    let rule = policy
        .limits
        .get(&args.rule)
        .cloned()
        .ok_or_else(|| format!("the policy has no rule `{}`", args.rule))?;
    let redis = policy
        .redis
        .clone()
        .ok_or("the policy has no [redis] section")?;
    let metrics = Arc::new(Metrics::new());
    let limiter = Limiter::new(metrics.clone());
    let rules = [rule];
    let prefix = policy.key_prefix().to_string();
    let headers = HeaderMap::new();
    let method = Method::GET;

    // One worker: decides for client after client until `until`, recording each latency.
    let worker = |start: u32, until: Instant| {
        let (limiter, rules, redis, headers, method, policy, prefix) = (
            &limiter, &rules, &redis, &headers, &method, &policy, &prefix,
        );
        async move {
            let mut latencies_us: Vec<u32> = Vec::new();
            let mut n = start;
            while Instant::now() < until {
                n = n.wrapping_add(7919) % args.keys;
                let facts = RequestFacts {
                    client_ip: IpAddr::V4(Ipv4Addr::from(0x0a00_0000 | n)),
                    route: "bench",
                    method,
                    headers,
                    query: None,
                    identity: &policy.identity,
                };
                let started = Instant::now();
                let _ = limiter
                    .check(rules, &[], Some(redis), prefix, &facts, started.into())
                    .await;
                latencies_us.push(u32::try_from(started.elapsed().as_micros()).unwrap_or(u32::MAX));
            }
            latencies_us
        }
    };

    let warm_until = Instant::now() + Duration::from_secs(1);
    futures_util::future::join_all((0..args.concurrency as u32).map(|i| worker(i, warm_until)))
        .await;
    let (redis_before, other_before) = decisions_by_source(&metrics);

    let started = Instant::now();
    let until = started + Duration::from_secs(args.seconds);
    let per_worker = futures_util::future::join_all(
        (0..args.concurrency as u32).map(|i| worker(i * 13 + 1, until)),
    )
    .await;
    let elapsed = started.elapsed();
    let (redis_after, other_after) = decisions_by_source(&metrics);

    let mut latencies: Vec<u32> = per_worker.into_iter().flatten().collect();
    latencies.sort_unstable();
    let percentile = |p: f64| {
        let index = ((latencies.len() as f64 - 1.0) * p).round() as usize;
        latencies.get(index).copied().unwrap_or(0)
    };
    Ok(format!(
        "LIMITER decisions={} duration_us={} redis={} other={} p50_us={} p99_us={} p999_us={}",
        latencies.len(),
        elapsed.as_micros(),
        redis_after - redis_before,
        other_after - other_before,
        percentile(0.50),
        percentile(0.99),
        percentile(0.999),
    ))
}
