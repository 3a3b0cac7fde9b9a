//! levee: a resilience sidecar for legacy PHP sites.
//!
//! It sits between the front nginx and the PHP application and keeps the site answering
//! when traffic grows: shared rate limits, per-dependency circuit breakers, tiered
//! degradation and safely reloaded policy files. See `README.md` and `docs/`.

#![forbid(unsafe_code)]

pub mod admin;
pub mod app;
pub mod breaker;
pub mod config;
pub mod cpu_quota;
pub mod degrade;
pub mod error;
pub mod fleet_clock;
pub mod limit;
pub mod log_throttle;
pub mod log_writer;
pub mod metrics;
pub mod open_files;
pub mod printable;
pub mod proxy;
pub mod queue;
pub mod redis_batch;
pub mod redis_cluster;
pub mod redis_sentinel;
pub mod redis_store;
pub mod redis_wait;

pub use app::{run, start, Options, Running, StartError};
