//! The process's open-file limit, which bounds how many connections levee can hold.
//!
//! Every client connection takes a file descriptor, and so does its connection to the app.
//! Past the soft limit `accept` fails, and so does every new connection to the app and to
//! Redis. systemd starts services with a soft limit of 1024 however high the hard limit is
//! (it keeps old `select()` programs safe; levee uses epoll), so levee raises its own soft
//! limit to the hard one at start, as Go programs and nginx's `worker_rlimit_nofile` do.

use rustix::process::{getrlimit, setrlimit, Resource, Rlimit};

/// Open files kept for all but client connections and theirs to the app (Redis, the log, the
/// policy files, the listeners: levee holds some 20 at rest): 256 where the limit is large, a
/// quarter of a small one (at least 32). A fixed 256 left a limit of 256 (a hosting panel's,
/// a small box's) one connection at a time: `/readyz` went unanswered and the load balancer
/// took levee out.
fn reserved(limit: u64) -> u64 {
    (limit / 4).clamp(32, 256)
}

/// Open files `max_connections` needs under `limit`: a client connection and one to the app
/// each, plus the reserve.
pub fn needed(max_connections: u32, limit: u64) -> u64 {
    2 * u64::from(max_connections) + reserved(limit)
}

/// The most connections `limit` open files hold (the inverse of [`needed`]), at least 1.
pub fn connections_allowed(limit: u64) -> u32 {
    u32::try_from(limit.saturating_sub(reserved(limit)) / 2)
        .unwrap_or(u32::MAX)
        .max(1)
}

/// Below this many connections, an open-file limit is said as a warning: a few slow clients
/// take them all.
pub const FEW_CONNECTIONS: u32 = 64;

/// What raising the soft limit did, for the start-up log.
#[derive(Debug, PartialEq, Eq)]
pub enum Raised {
    /// The soft limit already was the hard one (or unlimited).
    AlreadyAtHard,
    /// Raised from the first to the second.
    From(u64, u64),
    /// The kernel refused; the soft limit stays.
    Refused {
        soft: u64,
        wanted: u64,
        reason: String,
    },
}

/// Raises the soft open-file limit to the hard limit. An unlimited hard limit is capped at
/// the kernel's `fs.nr_open` (a soft limit above it is refused).
pub fn raise_to_hard() -> Raised {
    let limit = getrlimit(Resource::Nofile);
    let Some(soft) = limit.current else {
        return Raised::AlreadyAtHard;
    };
    let wanted = match limit.maximum {
        Some(hard) => hard,
        None => match kernel_nr_open() {
            Some(nr_open) => nr_open,
            None => return Raised::AlreadyAtHard,
        },
    };
    if wanted <= soft {
        return Raised::AlreadyAtHard;
    }
    match setrlimit(
        Resource::Nofile,
        Rlimit {
            current: Some(wanted),
            maximum: limit.maximum,
        },
    ) {
        Ok(()) => Raised::From(soft, wanted),
        Err(error) => Raised::Refused {
            soft,
            wanted,
            reason: error.to_string(),
        },
    }
}

/// Logs what [`raise_to_hard`] did: an operator who sees connections refused looks here.
pub fn raise_and_log() {
    match raise_to_hard() {
        Raised::AlreadyAtHard => {}
        Raised::From(from, to) => {
            tracing::info!(from, to, "raised the open-file limit to its hard limit")
        }
        Raised::Refused {
            soft,
            wanted,
            reason,
        } => tracing::warn!(
            open_file_limit = soft,
            wanted,
            reason,
            "could not raise the open-file limit"
        ),
    }
}

/// The soft open-file limit now in force; `None` when unlimited.
pub fn soft_limit() -> Option<u64> {
    getrlimit(Resource::Nofile).current
}

/// A warning when `max_connections` needs more open files than the soft limit allows.
pub fn shortfall(max_connections: u32, soft_limit: Option<u64>) -> Option<String> {
    let limit = soft_limit?;
    let needed = needed(max_connections, limit);
    (limit < needed).then(|| {
        format!(
            "[server] max_connections = {max_connections} needs about {needed} open files, but levee may open only {limit}: past that, new connections (and those to the app and Redis) fail"
        )
    })
}

fn kernel_nr_open() -> Option<u64> {
    std::fs::read_to_string("/proc/sys/fs/nr_open")
        .ok()?
        .trim()
        .parse()
        .ok()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_cap_needs_two_files_per_connection_and_some_to_spare() {
        assert_eq!(needed(10_000, 65_536), 20_256);
        assert_eq!(connections_allowed(20_256), 10_000);
        assert_eq!(connections_allowed(1024), 384);
        // A small limit keeps a quarter: a limit of 256 held one connection at a time.
        assert_eq!(connections_allowed(256), 96);
        assert_eq!(connections_allowed(100), 34);
        assert_eq!(connections_allowed(40), 4);
        assert_eq!(shortfall(96, Some(256)), None);
        assert_eq!(shortfall(connections_allowed(1024), Some(1024)), None);
        assert_eq!(shortfall(10_000, Some(1024)).map(|_| ()), Some(()));
        assert_eq!(shortfall(10_000, Some(20_256)), None);
        assert_eq!(shortfall(10_000, None), None);
        let message = shortfall(500, Some(1024)).unwrap_or_default();
        assert!(message.contains("needs about 1256"), "{message}");
    }

    #[test]
    fn raising_twice_leaves_the_soft_limit_at_the_hard_one() {
        raise_to_hard();
        let limit = getrlimit(Resource::Nofile);
        assert!(matches!(raise_to_hard(), Raised::AlreadyAtHard));
        assert_eq!(getrlimit(Resource::Nofile), limit);
    }
}
