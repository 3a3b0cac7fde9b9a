//! Compiling policy files: read → parse into specs → validate and build a [`Policy`].
//!
//! Compilation never stops at the first problem: every error of every file is collected with
//! its `file:line:col`, so an operator fixes them all in one round, like `nginx -t`.

use std::borrow::Cow;
use std::collections::{BTreeMap, BTreeSet};
use std::net::SocketAddr;
use std::ops::Range;
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::Duration;

use http::uri::{Authority, Scheme};
use http::{HeaderValue, Method};
use ipnet::IpNet;
use sha2::{Digest, Sha256};
use toml::Spanned;

use super::diag::{Diagnostic, Diagnostics, SourceFile};
use super::policy::{AdminSettings, AnswerFormat, ListenWrittenAt, Policy, ServerSettings};
use super::spec::{
    AboveSpec, BreakerSpec, DegradeSpec, FileSpec, IdentitySpec, LimitSpec, MatchSpec, ModuleSpec,
    OneOrMany, QueueSpec, RedisSpec, RouteDegradeSpec, RouteSpec, SentinelSpec, ServerSpec,
    ShapeError, SizeSpec, StaticResponseSpec, TriggerSpec, UnreadTables, UpstreamSpec, SIZE_TAKES,
};
use super::units::{parse_duration, parse_size};
use crate::breaker::{Breaker, BreakerSettings, Force, MOST_FAILING_CLIENTS};
use crate::degrade::bulkhead::BulkheadSettings;
use crate::degrade::trigger::{Condition, Trigger};
use crate::degrade::{
    CopyQuery, DegradeAction, DegradeSettings, StaleSettings, DEFAULT_MAX_COPIES,
};
use crate::limit::key::{Identity, KeyPart, Source};
use crate::limit::{gcra::Rate, parse_rate, LimitRule, OnRedisError};
use crate::proxy::client::FastCgiSettings;
use crate::proxy::header::TrustedProxies;
use crate::proxy::path;
use crate::proxy::route::{HostMatch, PathMatch, Route, RouteName, RouteTable, StaticResponse};
use crate::proxy::upstream::{ca_certificates, read_ca_file, Upstream, UpstreamSettings};
use crate::queue::{QueueAction, QueueSettings, Unconfirmed, MAX_WAIT_TIMEOUT, MIN_CLAIM_AFTER};
use crate::redis_sentinel::SentinelTarget;
use crate::redis_store::{
    RedisSettings, RedisStore, RedisTarget, RedisTls, DEFAULT_ADMIT_AHEAD_ABOVE,
};

/// Name of the implicit route that catches requests no route matches.
pub const DEFAULT_ROUTE: &str = "default";

/// The policy files of `dir`: every `*.toml` not hidden (editors' `.name.toml.swp` and
/// the like), in file-name order.
pub fn policy_file_paths(dir: &Path) -> std::io::Result<Vec<std::path::PathBuf>> {
    let mut paths: Vec<_> = std::fs::read_dir(dir)?
        .filter_map(Result::ok)
        .map(|entry| entry.path())
        .filter(|path| {
            path.extension().is_some_and(|ext| ext == "toml")
                && path
                    .file_name()
                    .and_then(|name| name.to_str())
                    .is_some_and(|name| !name.starts_with('.'))
        })
        .collect();
    paths.sort();
    Ok(paths)
}

/// The policy files of a directory as read.
#[derive(Debug, Default)]
pub struct ReadFiles {
    /// Those that could be read, in file-name order.
    pub files: Vec<SourceFile>,
    /// Those that could not (permissions, not UTF-8, a directory named `*.toml`), each with
    /// its error: the others are still checked, and every error reported together.
    pub unreadable: Vec<Unreadable>,
}

/// A policy file that could not be read.
#[derive(Debug, Clone)]
pub struct Unreadable {
    pub error: Diagnostic,
    /// What it holds, as far as it is known: the text of a file that is not UTF-8 (its other
    /// bytes replaced), so that what it defines is not called undefined elsewhere; nothing
    /// for a directory, which levee never reads. `None` for a file that could not be read at
    /// all (its permissions): it may define anything.
    pub text: Option<String>,
}

/// Reads every `*.toml` file of `dir`, in file-name order. An error here is about the
/// directory as a whole (it does not exist, holds no policy file); a file that cannot be read
/// is among [`ReadFiles::unreadable`].
pub fn read_dir(dir: &Path) -> Result<ReadFiles, Diagnostics> {
    let paths = policy_file_paths(dir).map_err(|error| {
        let (message, hint) = match error.kind() {
            std::io::ErrorKind::NotFound => ("the policy directory does not exist".to_string(), None),
            std::io::ErrorKind::NotADirectory => ("this is not a directory".to_string(), None),
            std::io::ErrorKind::PermissionDenied => (
                format!("cannot read the policy directory: {error}"),
                Some("make the directory readable and searchable by the user levee runs as (e.g. chmod 755, or group-readable with the levee user in the group)"),
            ),
            _ => (format!("cannot read the policy directory: {error}"), None),
        };
        Diagnostics(vec![Diagnostic::whole(dir, message).hint(hint.unwrap_or(
            "pass the directory that holds the *.toml policy files with --policies DIR",
        ))])
    })?;
    let mut read = ReadFiles::default();
    for path in paths {
        match read_bounded(&path) {
            Ok(None) => {
                read.unreadable.push(Unreadable {
                    error: Diagnostic::whole(
                        &path,
                        format!(
                            "the file is over {} MiB, more than any policy needs",
                            MAX_POLICY_FILE_BYTES >> 20
                        ),
                    )
                    .hint("a policy of 500 routes is about 100 KiB: is this the file meant, or a log or dump saved with a .toml name?"),
                    text: None,
                });
                continue;
            }
            Ok(Some(bytes)) => match String::from_utf8(bytes) {
                Ok(text) => read.files.push(SourceFile { path, text }),
                Err(not_utf8) => read.unreadable.push(Unreadable {
                    text: Some(String::from_utf8_lossy(not_utf8.as_bytes()).into_owned()),
                    error: not_utf8_at(path, &not_utf8),
                }),
            },
            Err(error) => read.unreadable.push(Unreadable {
                error: cannot_read(&path, &error),
                text: path.is_dir().then(String::new),
            }),
        }
    }
    if read.files.is_empty() && read.unreadable.is_empty() {
        return Err(Diagnostics(vec![Diagnostic::whole(
            dir,
            "no *.toml policy files in this directory",
        )
        .hint("levee needs at least one policy file; see docs/policy.md")]));
    }
    Ok(read)
}

/// The largest policy file read: a 200 MB file saved by mistake with a `.toml` name took
/// levee's memory from 28 to 417 MB, for good.
const MAX_POLICY_FILE_BYTES: u64 = 16 << 20;

/// A file's bytes, or `None` when it holds more than [`MAX_POLICY_FILE_BYTES`] (read no
/// further than that: it may still be growing).
fn read_bounded(path: &Path) -> std::io::Result<Option<Vec<u8>>> {
    use std::io::Read as _;
    let file = std::fs::File::open(path)?;
    // Told by its size when it has one: reading 16 MiB to refuse a file held that much memory.
    if file.metadata()?.len() > MAX_POLICY_FILE_BYTES {
        return Ok(None);
    }
    let mut bytes = Vec::new();
    file.take(MAX_POLICY_FILE_BYTES + 1)
        .read_to_end(&mut bytes)?;
    Ok((bytes.len() as u64 <= MAX_POLICY_FILE_BYTES).then_some(bytes))
}

/// Why a policy file could not be read, said as what to do about it.
fn cannot_read(path: &Path, error: &std::io::Error) -> Diagnostic {
    // A link left pointing at nothing (the file it named moved): said so, with where it
    // points, rather than "no such file" for a file one can see.
    match std::fs::read_link(path) {
        Ok(target) if error.kind() == std::io::ErrorKind::NotFound => {
            return Diagnostic::whole(
                path,
                format!(
                    "cannot read: this is a symlink to {}, which does not exist",
                    target.display()
                ),
            )
            .hint("point the link at the file where it is now, or remove the link");
        }
        _ => {}
    }
    if path.is_dir() {
        return Diagnostic::whole(
            path,
            "cannot read: this is a directory, and levee reads only the *.toml files directly in the policy directory",
        )
        .hint("rename the directory so its name does not end in .toml, or move its files up into the policy directory");
    }
    let diagnostic = Diagnostic::whole(path, format!("cannot read: {error}"));
    if error.kind() == std::io::ErrorKind::PermissionDenied {
        diagnostic.hint("make the file readable by the user levee runs as (and by whoever runs levee check), e.g. chmod 644")
    } else {
        diagnostic
    }
}

/// Where a file stops being UTF-8 (often a `body_html` saved in a legacy encoding), as a
/// diagnostic at that line and column.
fn not_utf8_at(path: std::path::PathBuf, error: &std::string::FromUtf8Error) -> Diagnostic {
    let valid = error.utf8_error().valid_up_to();
    let bytes = error.as_bytes();
    let readable = SourceFile {
        path,
        text: String::from_utf8_lossy(bytes.get(..valid).unwrap_or_default()).into_owned(),
    };
    Diagnostic::at(
        &readable,
        valid..valid,
        format!(
            "byte 0x{:02X} is not UTF-8",
            bytes.get(valid).copied().unwrap_or_default()
        ),
    )
    .hint("policy files are read as UTF-8: save the file in UTF-8 (from GBK or Latin-1, e.g. with iconv)")
}

/// How long a policy file found empty is taken for one caught while it is written: as long
/// as the watcher waits for a writer to close a file (`watch::CLOSE_WAIT`).
pub(super) const EMPTIED_LATELY: std::time::Duration = super::watch::CLOSE_WAIT;
/// What a reload refused for such a file says (the watcher reads the directory again once
/// [`EMPTIED_LATELY`] has passed).
pub(super) const EMPTIED_MESSAGE: &str = "the file is empty now (caught while it is written?)";

/// Whether `path` was modified less than `within` ago (or its time cannot be read). A time
/// further ahead than `within` is not "just now": the clock was stepped back since the edit
/// (or the file came with another host's time, `rsync -a`), and such a file was refused for
/// as long as the step.
fn modified_within(path: &Path, within: std::time::Duration) -> bool {
    std::fs::metadata(path)
        .and_then(|meta| meta.modified())
        .map_or(true, |modified| {
            modified.elapsed().map_or_else(
                |ahead| ahead.duration() < within,
                |elapsed| elapsed < within,
            )
        })
}

/// Reads and compiles a policy directory. `previous` lets unchanged upstreams keep their
/// connection pools across a reload.
pub fn load_dir(dir: &Path, previous: Option<&Policy>) -> Result<Policy, Diagnostics> {
    let ReadFiles { files, unreadable } = read_dir(dir)?;
    // A file that held settings and is empty now was most often caught between a save's
    // truncation and its write: read as a policy that sets nothing, it would drop every
    // route and limit it held. (An empty placeholder, as an empty ConfigMap key makes, is a
    // file like any other.) Only while it was emptied lately: one left empty longer than a
    // writer may pause is meant so, and `levee check`, which passes it, is not contradicted
    // for good (every later edit of any file was refused for it).
    if let Some(previous) = previous {
        let emptied: Vec<Diagnostic> = files
            .iter()
            .filter(|file| {
                file.text.trim().is_empty()
                    && previous.files.contains(&file.path)
                    && !previous.empty_files.contains(&file.path)
                    && modified_within(&file.path, EMPTIED_LATELY)
            })
            .map(|file| {
                Diagnostic::whole(&file.path, EMPTIED_MESSAGE)
                    .hint("delete the file to drop its settings, or leave a comment in it")
            })
            .collect();
        if !emptied.is_empty() {
            let mut errors = emptied;
            errors.extend(unreadable.into_iter().map(|file| file.error));
            errors.sort_by(|a, b| a.file.cmp(&b.file));
            return Err(Diagnostics(errors));
        }
    }
    if files.is_empty() {
        // Nothing else to check: every file is among those that could not be read.
        return Err(Diagnostics(
            unreadable.into_iter().map(|file| file.error).collect(),
        ));
    }
    match compile_read(&files, &unreadable, previous) {
        Ok(mut policy) => {
            let not_read = files_not_read(dir);
            if !not_read.is_empty() {
                // Part of what the directory holds: a `limits.TOML` saved beside the policy
                // changes the hash, so the reload it sets off is one, and says it is not read.
                let mut hasher = Sha256::new();
                hasher.update(policy.hash.as_bytes());
                for warning in &not_read {
                    hasher.update(warning.file.as_os_str().as_encoded_bytes());
                    hasher.update([0]);
                }
                policy.hash = crate::limit::key::hex(&hasher.finalize()[..8]);
            }
            policy.warnings.extend(not_read);
            Ok(policy)
        }
        // Said with the errors too: `limits.TOML` not read is what explains "limit `login`
        // is not defined".
        Err(mut diagnostics) => {
            diagnostics.0.extend(files_not_read(dir));
            Err(diagnostics)
        }
    }
}

/// Files of `dir` that look like policy files but are not read (only `*.toml` directly in
/// it is): `limits.TOML`, `limits.toml.txt` (an editor's or a download's name), `conf.d/`. An
/// operator who saved one would otherwise lose every rule in it without a word.
fn files_not_read(dir: &Path) -> Vec<Diagnostic> {
    let Ok(entries) = std::fs::read_dir(dir) else {
        return Vec::new();
    };
    let mut names: Vec<(std::path::PathBuf, String)> = entries
        .filter_map(Result::ok)
        .filter_map(|entry| {
            let name = entry.file_name().to_str()?.to_string();
            let path = entry.path();
            let lower = name.to_ascii_lowercase();
            if name.starts_with('.') || path.extension().is_some_and(|ext| ext == "toml") {
                return None;
            }
            let looks_like_policy = if path.is_dir() {
                policy_file_paths(&path).is_ok_and(|inside| !inside.is_empty())
            } else {
                named_like_a_policy(&lower)
            };
            looks_like_policy.then_some((path, name))
        })
        .collect();
    names.sort();
    names
        .into_iter()
        .map(|(path, name)| {
            let mut warning = Diagnostic::whole(
                &path,
                format!("`{name}` is not read: levee reads only the *.toml files directly in the policy directory"),
            )
            .hint("rename it to end in .toml (lower case), or move it out of the directory");
            warning.severity = super::diag::Severity::Warning;
            warning
        })
        .collect()
}

/// A file name (in lower case) that looks meant as a policy file though it is not read:
/// `limits.TOML`, `x.tml`, `x.toml.txt`; not an editor's or a package's copy.
pub(crate) fn named_like_a_policy(lower: &str) -> bool {
    lower.ends_with(".toml")
        || lower.ends_with(".tml")
        || lower.contains(".toml.") && !lower.ends_with('~') && !is_backup(lower)
}

/// Names editors and tools give copies they keep (`levee.toml.bak`, `.orig`, `.dpkg-old`):
/// meant not to be read.
fn is_backup(lower: &str) -> bool {
    [
        ".bak",
        ".orig",
        ".old",
        ".dpkg-old",
        ".dpkg-dist",
        ".dpkg-new",
        ".rpmnew",
        ".rpmsave",
        ".swp",
        ".disabled",
        ".off",
        ".example",
        ".sample",
        ".dist",
    ]
    .iter()
    .any(|suffix| lower.ends_with(suffix))
}

/// Hash of file names and contents, shown by `/status` to tell which files are active.
pub fn policy_hash(files: &[SourceFile]) -> String {
    let mut hasher = Sha256::new();
    for file in files {
        let name = file
            .path
            .file_name()
            .map(|n| n.to_string_lossy())
            .unwrap_or_default();
        hasher.update(name.as_bytes());
        hasher.update([0]);
        hasher.update(file.text.as_bytes());
        hasher.update([0]);
    }
    crate::limit::key::hex(&hasher.finalize()[..8])
}

/// The policy's hash, with the contents of the CA files its upstreams trust and of the TLS
/// files of its Redis: rotating one in place and reloading is a change (without such files,
/// the files' hash alone).
fn policy_hash_with_cas(
    files: &[SourceFile],
    upstreams: &BTreeMap<String, Arc<Upstream>>,
    redis_tls: Option<&RedisTls>,
) -> String {
    let files_hash = policy_hash(files);
    let mut digests: Vec<&[u8]> = upstreams
        .values()
        .map(|upstream| upstream.settings.ca_digest.as_slice())
        .filter(|digest| !digest.is_empty())
        .collect();
    if let Some(tls) = redis_tls {
        digests.extend(tls.ca.as_deref());
        if let Some((cert, key)) = &tls.client {
            digests.extend([cert.as_slice(), key.as_slice()]);
        }
    }
    if digests.is_empty() {
        return files_hash;
    }
    let mut hasher = Sha256::new();
    hasher.update(files_hash.as_bytes());
    for digest in digests {
        hasher.update(digest);
    }
    crate::limit::key::hex(&hasher.finalize()[..8])
}

/// Would the two listeners take the same socket: one port, on the same address or where one
/// of them listens on every address (`0.0.0.0`, `[::]`, which also takes IPv4 by default)?
/// A port of 0 is any free port: never the same.
fn listeners_overlap(a: std::net::SocketAddr, b: std::net::SocketAddr) -> bool {
    // `[::ffff:127.0.0.1]` is 127.0.0.1; `0.0.0.0` takes every IPv4 address and `[::]`
    // every address (Linux binds it dual-stack by default), but `0.0.0.0` no IPv6 one.
    let (x, y) = (a.ip().to_canonical(), b.ip().to_canonical());
    let covers = |wide: std::net::IpAddr, other: std::net::IpAddr| {
        wide == other || (wide.is_unspecified() && (wide.is_ipv6() || other.is_ipv4()))
    };
    a.port() == b.port() && a.port() != 0 && (covers(x, y) || covers(y, x))
}

/// Whether two listeners on one port are the two addresses of `localhost` (127.0.0.1, which
/// `0.0.0.0` takes too, and ::1): a front told `localhost:P` reaches either, by turns, so
/// visitors reached the admin listener through the public front.
fn listeners_share_localhost(a: std::net::SocketAddr, b: std::net::SocketAddr) -> bool {
    let ipv4_loopback = |ip: std::net::IpAddr| {
        let ip = ip.to_canonical();
        ip.is_ipv4() && (ip.is_unspecified() || ip == std::net::Ipv4Addr::LOCALHOST)
    };
    let ipv6_loopback = |ip: std::net::IpAddr| ip == std::net::Ipv6Addr::LOCALHOST;
    a.port() == b.port()
        && a.port() != 0
        && ((ipv4_loopback(a.ip()) && ipv6_loopback(b.ip()))
            || (ipv6_loopback(a.ip()) && ipv4_loopback(b.ip())))
}

/// Collects diagnostics while compiling.
struct Compiler<'a> {
    files: &'a [SourceFile],
    errors: Vec<Diagnostic>,
    warnings: Vec<Diagnostic>,
    /// What files that did not read whole (a bad key or type in them, already reported)
    /// define, as far as their TOML shows: a reference to one is not called undefined, which
    /// contradicted the file the operator was looking at.
    unread: UnreadNames,
    /// Errors past [`MAX_ERRORS`], counted and not placed.
    errors_beyond: usize,
    /// Where one of those is written, and dropped.
    spare: Diagnostic,
}

/// The most errors a policy check reports one by one.
const MAX_ERRORS: usize = 1000;

/// Names defined in files or tables that could not be read (see `Compiler::unread`).
#[derive(Default)]
struct UnreadNames {
    /// A file, a `[server]` or an upstream did not read: a missing `default_upstream`, or the
    /// one upstream that would be the default, may be in it.
    any: bool,
    upstreams: std::collections::BTreeSet<String>,
    limits: std::collections::BTreeSet<String>,
    modules: std::collections::BTreeSet<String>,
    /// Kinds written there without their name (`[upstream]` with `url` under it, already
    /// reported): whichever name a route gives may be the one meant.
    nameless: std::collections::BTreeSet<&'static str>,
    /// Sections written once (`redis`, `identity`, `server`, `admin`) that did not read.
    sections: std::collections::BTreeSet<&'static str>,
    /// A file could not be read at all (its permissions, a directory): it may define anything.
    unknown: bool,
}

/// The sections a file may hold once, as [`UnreadNames::sections`] names them.
const SECTIONS: [&str; 6] = ["server", "admin", "redis", "identity", "degrade", "queue"];

impl UnreadNames {
    /// Reads the names a file defines from its TOML alone (it may not read as a policy).
    fn note(&mut self, text: &str) {
        self.any = true;
        let Ok(table) = text.parse::<toml::Table>() else {
            // Not even TOML: what it defines cannot be told, and a name another file uses
            // is not called undefined for it (the shop's typo listed first an error in the
            // file that names the shop's upstream).
            self.unknown = true;
            return;
        };
        self.sections.extend(
            SECTIONS
                .into_iter()
                .filter(|section| table.contains_key(*section)),
        );
        for kind in ["upstream", "limit", "module"] {
            let Some(entries) = table.get(kind).and_then(toml::Value::as_table) else {
                continue;
            };
            if entries.values().any(|entry| !entry.is_table()) {
                self.nameless.insert(kind);
            }
            let names = entries
                .iter()
                .filter(|(_, entry)| entry.is_table())
                .map(|(name, _)| name.clone());
            match kind {
                "upstream" => self.upstreams.extend(names),
                "limit" => self.limits.extend(names),
                _ => self.modules.extend(names),
            }
        }
    }

    /// Whether such a file may define `name` of `kind` (`upstream`, `limit`, `module`).
    fn may_define(&self, kind: &str, name: &str) -> bool {
        self.unknown
            || self.nameless.contains(kind)
            || match kind {
                "upstream" => self.upstreams.contains(name),
                "limit" => self.limits.contains(name),
                _ => self.modules.contains(name),
            }
    }

    /// The tables of a file read table by table that did not read.
    fn note_tables(&mut self, tables: UnreadTables) {
        self.any |= tables.sections.contains("server")
            || !tables.upstreams.is_empty()
            || tables.nameless.contains("upstream");
        self.upstreams.extend(tables.upstreams);
        self.limits.extend(tables.limits);
        self.modules.extend(tables.modules);
        self.nameless.extend(tables.nameless);
        self.sections.extend(tables.sections);
    }

    /// Whether such a file may hold a section (`[redis]`, which queues need; `[identity]`,
    /// which a limit keyed by user needs).
    fn may_hold(&self, section: &str) -> bool {
        self.unknown || self.sections.contains(section)
    }
}

impl<'a> Compiler<'a> {
    /// A path a policy file names: relative paths are relative to that file.
    fn path_from(&self, file: usize, name: &str) -> std::path::PathBuf {
        self.files[file]
            .path
            .parent()
            .map_or_else(|| std::path::PathBuf::from(name), |dir| dir.join(name))
    }

    fn error(
        &mut self,
        file: usize,
        span: Range<usize>,
        message: impl Into<String>,
    ) -> &mut Diagnostic {
        // Past the first MAX_ERRORS only counted: a file of 100,000 routes with one typo
        // each took minutes to place every error on its line, and no one reads them all.
        if self.errors.len() >= MAX_ERRORS {
            self.errors_beyond += 1;
            self.spare = Diagnostic::whole(&self.files[file].path, "");
            return &mut self.spare;
        }
        self.errors
            .push(Diagnostic::at(&self.files[file], span, message));
        let last = self.errors.len() - 1;
        &mut self.errors[last]
    }

    fn warning_hint(
        &mut self,
        file: usize,
        span: Range<usize>,
        message: impl Into<String>,
        hint: impl Into<String>,
    ) {
        let mut warning = Diagnostic::at(&self.files[file], span, message).hint(hint);
        warning.severity = super::diag::Severity::Warning;
        self.warnings.push(warning);
    }

    fn error_hint(
        &mut self,
        file: usize,
        span: Range<usize>,
        message: impl Into<String>,
        hint: impl Into<String>,
    ) {
        let diagnostic = self.error(file, span, message);
        diagnostic.hint = Some(hint.into());
    }

    /// An error no line of any file holds (a section that is missing): named by the
    /// directory, not by a line of a file that has nothing to do with it.
    fn error_hint_in_dir(&mut self, message: impl Into<String>, hint: impl Into<String>) {
        let dir = self
            .files
            .first()
            .and_then(|file| file.path.parent())
            .unwrap_or(std::path::Path::new("."));
        self.errors.push(Diagnostic::whole(dir, message).hint(hint));
    }

    /// Keeps the first occurrence of a section that may appear once across all files.
    fn take_once<T>(
        &mut self,
        what: &str,
        slot: &mut Option<(usize, Spanned<T>)>,
        file: usize,
        section: Option<Spanned<T>>,
    ) {
        let Some(section) = section else { return };
        if let Some((first, first_spec)) = slot {
            let other = self.location(*first, &first_spec.span());
            // `[[degrade.trigger]]` opens `[degrade]` too: an operator who wrote one beside a
            // site's routes wrote no second `[degrade]` that they know of.
            let hint = if what == "[degrade]" {
                format!("the first one is at {other}; keep one: [degrade] and its [[degrade.trigger]] entries live in one file")
            } else {
                format!("the first one is at {other}; keep one")
            };
            self.error_hint(
                file,
                section.span(),
                format!("{what} is defined twice"),
                hint,
            );
        } else {
            *slot = Some((file, section));
        }
    }

    /// Adds named sections (`[upstream.NAME]`, `[limit.NAME]`), reporting duplicates at both places.
    fn merge_named<T>(
        &mut self,
        what: &str,
        into: &mut BTreeMap<String, (usize, Spanned<T>)>,
        file: usize,
        sections: BTreeMap<String, Spanned<T>>,
    ) {
        for (name, section) in sections {
            self.check_name(what, &name, file, section.span());
            if let Some((first, first_spec)) = into.get(&name) {
                let other = self.location(*first, &first_spec.span());
                self.error_hint(
                    file,
                    section.span(),
                    format!("{what} `{name}` is defined twice"),
                    format!("the first one is at {other}; rename or remove one"),
                );
            } else {
                into.insert(name, (file, section));
            }
        }
    }

    /// Refuses a name of a route, upstream, limit or module that could not be told apart or
    /// used: an empty one, or one with spaces at an end or control characters (each would show
    /// in logs, metrics and admin paths as another name than the one written).
    fn check_name(&mut self, what: &str, name: &str, file: usize, span: Range<usize>) {
        let (problem, fix) = if name.is_empty() {
            ("is empty", "give it a name")
        } else if name.trim() != name {
            (
                "starts or ends with a space",
                "remove the spaces at its ends",
            )
        } else if name.chars().any(char::is_control) {
            (
                "has a control character",
                "remove the tab, line break or other control character",
            )
        } else if name == "." || name == ".." {
            // A URL reads these as path steps: `/modules/..` is `/` to a browser and to
            // curl, so the dashboard's and the admin API's paths could not name it.
            (
                "is a path step in a URL",
                "give it a name of words, which the admin paths can carry",
            )
        } else {
            return;
        };
        // Said as what is accepted: any other text is a name (`排行`, `my api` too).
        self.error_hint(
            file,
            span,
            format!("{what} name {name:?} {problem}"),
            format!("{fix}; a name is any text without control characters or spaces at its ends, other than `.` and `..`, like \"checkout\" or \"排行\""),
        );
    }

    fn location(&self, file: usize, span: &Range<usize>) -> String {
        Diagnostic::at(&self.files[file], span.clone(), "").location()
    }

    fn duration(
        &mut self,
        file: usize,
        value: &Option<Spanned<String>>,
        default: Duration,
    ) -> Duration {
        let Some(value) = value else { return default };
        match parse_duration(value.get_ref()) {
            Ok(duration) => duration,
            Err(message) => {
                self.error_hint(
                    file,
                    value.span(),
                    message,
                    "write a number with a unit: \"250ms\", \"10s\", \"5m\", \"1h\"",
                );
                default
            }
        }
    }

    /// A duration that must not be zero (a zero bound would cut every wait at once).
    fn nonzero_duration(
        &mut self,
        file: usize,
        value: &Option<Spanned<String>>,
        default: Duration,
        key: &str,
    ) -> Duration {
        self.positive_duration(
            file,
            value,
            default,
            key,
            "a bound of 0 would cut every connection at its first wait; leave the key out for the default",
        )
    }

    /// A count that must be at least 1 (`key must be at least 1`, with `hint`), or `default`.
    fn count_at_least_one(
        &mut self,
        file: usize,
        value: &Option<Spanned<u32>>,
        default: u32,
        key: &str,
        hint: &str,
    ) -> u32 {
        match value {
            Some(value) if *value.get_ref() == 0 => {
                self.error_hint(
                    file,
                    value.span(),
                    format!("{key} must be at least 1"),
                    hint,
                );
                default
            }
            Some(value) => *value.get_ref(),
            None => default,
        }
    }

    /// A duration that must not be zero, `why` saying what 0 would do.
    fn positive_duration(
        &mut self,
        file: usize,
        value: &Option<Spanned<String>>,
        default: Duration,
        key: &str,
        why: &str,
    ) -> Duration {
        let duration = self.duration(file, value, default);
        match value {
            Some(value) if duration.is_zero() => {
                self.error_hint(
                    file,
                    value.span(),
                    format!("`{key}` must be more than 0"),
                    why,
                );
                default
            }
            _ => duration,
        }
    }

    fn size(&mut self, file: usize, value: &Option<Spanned<SizeSpec>>, default: u64) -> u64 {
        let Some(value) = value else { return default };
        match parse_size(value.get_ref()) {
            Ok(size) => size,
            Err(message) => {
                self.error_hint(
                    file,
                    value.span(),
                    message,
                    "write whole bytes as a number, or a whole number with a unit: \"16KiB\", \"10MB\"",
                );
                default
            }
        }
    }

    fn socket_addr(
        &mut self,
        file: usize,
        value: &Option<Spanned<String>>,
        default: SocketAddr,
    ) -> SocketAddr {
        let Some(value) = value else { return default };
        match value.get_ref().parse() {
            Ok(addr) => addr,
            Err(_) => {
                // An IP address, not a name (`localhost:9901`): what it binds must not
                // depend on a name service. The example keeps the port written.
                let port = value
                    .get_ref()
                    .rsplit_once(':')
                    .and_then(|(_, port)| port.parse::<u16>().ok())
                    .unwrap_or(default.port());
                self.error_hint(
                    file,
                    value.span(),
                    format!("`{}` is not an IP address and port", value.get_ref()),
                    format!("write it as \"127.0.0.1:{port}\" or \"[::1]:{port}\" (an address, not a host name)"),
                );
                default
            }
        }
    }
}

/// A route that takes every request: no host, no method, and no path or only `/` as prefix.
fn matches_every_request(route: &Route) -> bool {
    route.hosts.is_empty()
        && route.methods.is_empty()
        // A route for some clients leaves the others to the routes after it.
        && route.clients.is_empty()
        && match &route.path {
            PathMatch::Any => true,
            PathMatch::Prefix(prefix) => prefix == "/",
            _ => false,
        }
}

/// A TOML or shape error as an operator can act on it: where it is, the parser's words put in
/// an operator's (never a Rust type name), and what to write. `key` is the key the parser
/// tracked to the error, when it did.
fn explain_parse_error(
    text: &str,
    span: &Range<usize>,
    message: &str,
    key: Option<&str>,
) -> (Range<usize>, String, String) {
    let message = message.trim();
    // `[route]` where `[[route]]` is meant: the parser says only that a map is no sequence.
    if message.contains("invalid type: map, expected a sequence") {
        let line = text
            .get(span.start..)
            .and_then(|rest| rest.lines().next())
            .unwrap_or_default()
            .trim();
        if let Some(name) = line
            .strip_prefix('[')
            .and_then(|rest| rest.strip_suffix(']'))
            .filter(|name| !name.starts_with('['))
        {
            let (message, hint) = written_as_list(name);
            return (span.clone(), message, hint);
        }
    }
    let line_start = text
        .get(..span.start)
        .and_then(|before| before.rfind('\n'))
        .map_or(0, |at| at + 1);
    let before_on_line = text.get(line_start..span.start).unwrap_or_default();
    // The parser names no key: read it where it points.
    if message == "duplicate key" {
        let in_header = before_on_line.trim_start().starts_with('[');
        return if in_header {
            // The whole header names the table (`[upstream.app.breaker]`, not `breaker`).
            let line = text
                .get(line_start..)
                .and_then(|line| line.lines().next())
                .unwrap_or_default();
            let table = line
                .split(']')
                .next()
                .unwrap_or_default()
                .trim()
                .trim_start_matches('[')
                .trim();
            // `[route]` once among `[[route]]` entries: written once, but as a table where
            // the file makes a list of it. Pointed at where the single brackets are.
            let single = header_offsets(text, table, false);
            if !single.is_empty() && !header_offsets(text, table, true).is_empty() {
                let (message, hint) = written_as_list(table);
                let at = single[0];
                return (at..at + 1, message, hint);
            }
            (
                span.clone(),
                format!("the table `[{table}]` is written twice in this file"),
                "write each [table] once and put all its keys under it (a list of tables is written [[name]])".to_string(),
            )
        } else {
            let rest = text.get(span.start..).unwrap_or_default();
            // A quoted key (`"ops team"`) up to its closing quote, else a bare one.
            let key: String = match rest.chars().next() {
                Some(quote @ ('"' | '\'')) => {
                    let inner: String = rest[1..].chars().take_while(|c| *c != quote).collect();
                    format!("{quote}{inner}{quote}")
                }
                _ => rest
                    .chars()
                    .take_while(|c| !matches!(c, '=' | '.' | '\n' | '\r') && !c.is_whitespace())
                    .collect(),
            };
            (
                span.clone(),
                format!("`{key}` is set twice in the same table"),
                "a key may appear once per table; remove one of the two".to_string(),
            )
        };
    }
    if message.contains("unknown field") {
        // `unknown field `max_inflght`, expected one of `url`, …`: the key it is closest to,
        // when one is close (a typo), said first.
        let named: Vec<&str> = message.split('`').skip(1).step_by(2).collect();
        let closest = named
            .split_first()
            .and_then(|(written, known)| closest_key(written, known));
        // Keys of nginx's own directives, written by an operator moving them over
        // (docs/from-nginx.md).
        let nginx = match named.first().copied() {
            Some("nodelay" | "delay") => Some("levee never delays a request: it is admitted at once (up to `burst`) or refused with Retry-After; nginx's `burst=N nodelay` is burst = N + 1 (docs/from-nginx.md)"),
            Some("max_fails" | "fail_timeout") => Some("levee's breaker takes this place: breaker = { consecutive_failures = 3, open_for = \"30s\" }; several servers, or a backup, stay in an nginx upstream that levee's url points at (docs/from-nginx.md)"),
            Some("backup") => Some("an upstream has one address; keep a backup server in an nginx upstream that levee's url points at (docs/from-nginx.md)"),
            _ => None,
        };
        let hint = match (nginx, closest) {
            (Some(nginx), _) => nginx.to_string(),
            (None, Some(key)) => format!("did you mean `{key}`? Unknown keys are refused so a typo never silently does nothing"),
            (None, None) => "check the spelling against docs/policy.md; unknown keys are refused so a typo never silently does nothing".to_string(),
        };
        return (span.clone(), message.to_string(), hint);
    }
    // A value of the wrong kind (`invalid type: string "50%", expected f64`): what the key
    // takes, said in an operator's words, and how to write it.
    let expected = (message.starts_with("invalid type: ")
        || message.starts_with("invalid value: "))
    .then(|| message.rsplit_once(", expected "))
    .flatten();
    let Some((invalid, expected)) = expected else {
        // `path_regex = "^/item/(\d+)$"`: in a TOML string in double quotes a backslash
        // begins an escape, and `\d` is none.
        let hint = if message.contains("escape") {
            "a backslash in a \"…\" string begins an escape such as \\n; write a regular expression in single quotes, where a backslash stays itself: path_regex = '^/item/(\\d+)$'"
        } else {
            "this is not valid TOML for a levee policy; see docs/policy.md"
        };
        return (span.clone(), message.to_string(), hint.to_string());
    };
    // What serde found, as it names it: `string "50%"`, `integer `-1``, `map`.
    let found = invalid
        .trim_start_matches("invalid type: ")
        .trim_start_matches("invalid value: ");
    let key_on_line = key_before_value(before_on_line);
    // A key the parser names but the line does not show before the value: the value is an
    // item of a list (`failure_statuses = ["5xx"]`).
    let in_list = key.is_some() && key_on_line.is_none();
    let key = key.or(key_on_line);
    let takes = key
        .and_then(|key| key_takes(key, expected))
        .map_or_else(|| type_takes(expected), Cow::Borrowed);
    let message = match key {
        Some(key) if in_list => format!("each item of `{key}` must be {takes}"),
        Some(key) => format!("`{key}` must be {takes}"),
        None => format!("this value must be {takes}"),
    };
    let written = text
        .get(span.clone())
        .map(str::trim)
        .filter(|written| !written.is_empty() && written.len() <= 60 && !written.contains('\n'));
    // The hint repeats what is written, which may be a secret: a password or user name is
    // never repeated, a URL only with its credentials hidden (the hint reaches the log and the
    // admin status of a refused reload, not only the operator's terminal).
    let secret = key.is_some_and(|key| matches!(key, "password" | "username"));
    let written: Option<Cow<'_, str>> = match written {
        _ if secret => None,
        // A password in the userinfo or in the query (`?password=`, `?pass=`).
        Some(written) if written.contains("://") => {
            Some(Cow::Owned(crate::redis_store::redact_url(written)))
        }
        written => written.map(Cow::Borrowed),
    };
    let written = written.as_deref();
    let value = written.map(|written| written.trim_matches(['"', '\'']));
    let quoted = found.starts_with("string ");
    let number = ["u8", "u16", "u32", "u64", "i64", "f64"].contains(&expected);
    let key_text = key.unwrap_or("key");
    let hint = if let Some(fix) = unquoted(key, value, expected).filter(|_| quoted && !in_list) {
        fix
    } else if let Some(share) = key.filter(|key| is_share(key)) {
        match value.and_then(|value| value.strip_suffix('%')?.trim().parse::<f64>().ok()) {
            Some(percent) => format!(
                "a share is a fraction of 1, written without quotes: {percent}% is {share} = {}",
                percent / 100.0
            ),
            None => {
                format!("a share is a fraction of 1, written without quotes: half is {share} = 0.5")
            }
        }
    } else if key == Some("failure_statuses") {
        "list each status as a number: failure_statuses = [500, 502, 504] (a range like \"5xx\" is not read)".to_string()
    } else if key == Some("on_status") {
        "list each status as a number: on_status = [500, 503] (a range like \"5xx\" is not read)"
            .to_string()
    } else if key == Some("fallback") && quoted {
        format!(
            "put the page in `body`: fallback = {{ body = {} }}",
            written.unwrap_or("\"…\"")
        )
    } else if key == Some("match") && quoted {
        format!(
            "for the paths under it: match = {{ path_prefix = {} }}",
            written.unwrap_or("\"/shop\"")
        )
    } else if expected == SIZE_TAKES {
        format!(
            "write whole bytes ({key_text} = 1048576) or a whole number with a unit ({key_text} = \"1MiB\"; 1.5 MiB is \"1536KiB\")"
        )
    } else if quoted && number {
        "write the number without quotes, like tier = 3".to_string()
    } else if quoted && expected == "a boolean" {
        "write true or false without quotes".to_string()
    } else if found.starts_with("integer") && expected == "a string" {
        match (key, written) {
            // `listen = 8080`: an address with its port.
            (Some("listen"), Some(port)) => {
                format!("write the address and port in quotes: listen = \"127.0.0.1:{port}\"")
            }
            // `host = 5`: a name or a path, whatever it was meant to be, is text.
            (Some(key), Some(written)) if !takes_a_unit(key) => {
                format!("write it in quotes: {key} = \"{written}\"")
            }
            // `response_timeout = 5`: seconds, most likely; the unit is always written.
            (Some("rate"), Some(written)) => {
                format!("a rate is written in quotes with its period: rate = \"{written}/s\" (or \"/min\", \"/h\")")
            }
            (Some(key), Some(written)) if key != "above" => format!(
                "a duration is written in quotes with its unit: {key} = \"{written}s\" (or \"ms\", \"m\", \"h\")"
            ),
            _ => "durations, sizes and rates are written in quotes with a unit, like \"30s\", \"1MiB\" or \"10/s\"".to_string(),
        }
    } else {
        match written {
            Some(written) => {
                format!("it is written {written} here; see `{key_text}` in docs/policy.md")
            }
            None => format!("see `{key_text}` in docs/policy.md"),
        }
    };
    (span.clone(), message, hint)
}

/// `[name]` written where the file has a list of such tables.
fn written_as_list(name: &str) -> (String, String) {
    (
        format!("`[{name}]` is a list: each entry is written `[[{name}]]`"),
        format!("write `[[{name}]]` (double brackets) for every {name}"),
    )
}

/// Byte offsets of the lines that open a table `[name]` (or, with `list`, an entry `[[name]]`).
fn header_offsets(text: &str, name: &str, list: bool) -> Vec<usize> {
    let (open, close) = if list { ("[[", "]]") } else { ("[", "]") };
    let mut offsets = Vec::new();
    let mut line_start = 0;
    for line in text.split_inclusive('\n') {
        let indent = line.len() - line.trim_start().len();
        let header = line.trim_start();
        let is_list = header.starts_with("[[");
        if list == is_list {
            let written = header
                .strip_prefix(open)
                .and_then(|rest| rest.split_once(close))
                .map(|(inner, _)| inner.trim());
            if written == Some(name) {
                offsets.push(line_start + indent);
            }
        }
        line_start += line.len();
    }
    offsets
}

/// The key of `key = ` just before a value on its line (after a `{` or `,` in an inline
/// table); none when the value is an item of a list.
fn key_before_value(before_on_line: &str) -> Option<&str> {
    before_on_line
        .trim_end()
        .strip_suffix('=')?
        .trim_end()
        .rsplit([' ', '{', ','])
        .next()
        .filter(|key| !key.is_empty())
}

/// A quoted number or boolean as it should be written, under its own key (`burst = "5"` →
/// `burst = 5`): only a value the key would then take (digits for an integer, digits with one
/// point for a number, true or false; not `NaN`, `1e3` or `+5`).
fn unquoted(key: Option<&str>, value: Option<&str>, expected: &str) -> Option<String> {
    let (key, value) = (key?, value?);
    let digits = |text: &str| !text.is_empty() && text.bytes().all(|b| b.is_ascii_digit());
    let written_right = match expected {
        "a boolean" => value == "true" || value == "false",
        "f64" => {
            let (whole, fraction) = value.split_once('.').unwrap_or((value, "0"));
            digits(whole) && digits(fraction)
        }
        "i64" => digits(value.strip_prefix('-').unwrap_or(value)),
        "u8" | "u16" | "u32" | "u64" => digits(value),
        _ => false,
    };
    written_right.then(|| format!("write it without quotes: {key} = {value}"))
}

/// Keys that hold a share of 1 (`0.5` is half), the ones an operator may write as `"50%"`.
fn is_share(key: &str) -> bool {
    matches!(
        key,
        "failure_ratio" | "slow_ratio" | "shed_reserve" | "admit_ahead_above"
    )
}

/// What a key takes where its type alone would say too little (`u16` for a status).
/// Whether a key's text is a duration or a rate, which a bare number cannot be (`timeout = 5`).
fn takes_a_unit(key: &str) -> bool {
    key.ends_with("timeout")
        || key.ends_with("_interval")
        || matches!(
            key,
            "above"
                | "backoff_base"
                | "backoff_max"
                | "claim_after"
                | "cool_down"
                | "cooldown"
                | "drain"
                | "for"
                | "max_age"
                | "max_open_for"
                | "open_for"
                | "queue_wait"
                | "rate"
                | "slow_call"
                | "window"
        )
}

fn key_takes(key: &str, expected: &str) -> Option<&'static str> {
    Some(match (key, expected) {
        ("failure_ratio" | "slow_ratio", "f64") => {
            "a share of calls above 0 and at most 1, like 0.5"
        }
        ("shed_reserve", "f64") => "a share from 0 to below 0.5, like 0.2",
        ("admit_ahead_above", "f64") => "a share from 0 to 1, like 0.5",
        ("replay_rate", "f64") => "a number of replays per second, like 20",
        ("failure_statuses" | "on_status", "u16") => "an HTTP status, like 503",
        ("failure_statuses", _) => "a list of HTTP statuses, like [502, 504]",
        ("on_status", _) => "a list of HTTP statuses, like [500]",
        ("route", "a sequence") => {
            "a list of tables: each route is written under its own [[route]] line"
        }
        ("trigger", "a sequence") => {
            "a list of tables: each trigger is written under its own [[degrade.trigger]] line"
        }
        ("limits", "a sequence") => "a list of limit names, like [\"login_per_ip\"]",
        ("status", "u16") => "an HTTP status, like 503",
        ("tier", "u8") => "a tier: 1, 2 or 3 (a module's: 2 or 3)",
        ("level", "u8") => "a degrade level, like 1",
        _ => return None,
    })
}

/// A type as serde names it (`u16`, `a sequence`) in an operator's words; the policy's own
/// types already say it so (their `expecting`).
fn type_takes(expected: &str) -> Cow<'static, str> {
    Cow::Borrowed(match expected {
        "u8" => "a whole number from 0 to 255",
        "u16" => "a whole number from 0 to 65535",
        // The key's own bounds are checked once it reads (most take at least 1).
        "u32" => "a whole number",
        "u64" | "i64" => "a whole number",
        "f64" => "a number, like 0.5 or 20",
        "a boolean" => "true or false",
        "a string" => "a string in quotes",
        "a sequence" => "a list, like [\"a\", \"b\"]",
        "a map" => "a table, like { name = \"value\" }",
        other => return Cow::Owned(other.to_string()),
    })
}

/// Compiles parsed files into a policy, or returns every error found.
pub fn compile(files: &[SourceFile], previous: Option<&Policy>) -> Result<Policy, Diagnostics> {
    compile_read(files, &[], previous)
}

/// [`compile`], with the files of the directory that could not be read: their errors are
/// reported with the others', and what they may define is not called undefined.
fn compile_read(
    files: &[SourceFile],
    unreadable: &[Unreadable],
    previous: Option<&Policy>,
) -> Result<Policy, Diagnostics> {
    let mut compiler = Compiler {
        files,
        errors: Vec::new(),
        warnings: Vec::new(),
        unread: UnreadNames::default(),
        errors_beyond: 0,
        spare: Diagnostic::whole(std::path::Path::new(""), ""),
    };
    for file in unreadable {
        compiler.errors.push(file.error.clone());
        match &file.text {
            Some(text) => compiler.unread.note(text),
            None => compiler.unread.unknown = true,
        }
    }

    // Parse every file; a file that does not parse still lets the others be checked, and
    // one that parses as TOML but not whole as a policy is read table by table: its tables
    // that read are compiled with the rest, so a bad key in one hides no error in another.
    let mut specs: Vec<(usize, FileSpec)> = Vec::new();
    for (index, file) in files.iter().enumerate() {
        match toml::from_str::<FileSpec>(&file.text) {
            Ok(spec) => specs.push((index, spec)),
            Err(first) => {
                let mut errors = match FileSpec::read_by_table(&file.text) {
                    Some(read) => {
                        compiler.unread.note_tables(read.unread);
                        specs.push((index, read.spec));
                        read.errors
                    }
                    // Broken TOML: its first syntax error is the one to fix.
                    None => {
                        compiler.unread.note(&file.text);
                        Vec::new()
                    }
                };
                // A syntax error, or one shape_errors would not see: serde's own is kept.
                // One inside what a shape error stands for says the same less plainly.
                let covered = errors.iter().any(|error| {
                    error.span == first.span()
                        || first.span().is_some_and(|span| {
                            error
                                .covers
                                .iter()
                                .any(|covers| covers.start <= span.start && span.end <= covers.end)
                        })
                });
                if !covered {
                    errors.push(ShapeError {
                        span: first.span(),
                        message: first.message().to_string(),
                        key: None,
                        hint: None,
                        covers: Vec::new(),
                    });
                }
                errors.sort_by_key(|error| error.span.as_ref().map_or(0, |span| span.start));
                for error in errors {
                    let span = error.span.unwrap_or(0..0);
                    let (span, message, hint) = match error.hint {
                        // Said in levee's words already.
                        Some(hint) => (span, error.message, hint),
                        None => explain_parse_error(
                            &file.text,
                            &span,
                            &error.message,
                            error.key.as_deref(),
                        ),
                    };
                    compiler.error_hint(index, span, message, hint);
                }
            }
        }
    }

    // Merge files: sections that may appear once, names that must be unique.
    let mut server: Option<(usize, Spanned<ServerSpec>)> = None;
    let mut admin: Option<(usize, Spanned<super::spec::AdminSpec>)> = None;
    let mut redis: Option<(usize, Spanned<RedisSpec>)> = None;
    let mut identity: Option<(usize, Spanned<IdentitySpec>)> = None;
    let mut degrade: Option<(usize, Spanned<DegradeSpec>)> = None;
    let mut module_specs: BTreeMap<String, (usize, Spanned<ModuleSpec>)> = BTreeMap::new();
    let mut queue: Option<(usize, Spanned<QueueSpec>)> = None;
    let mut upstream_specs: BTreeMap<String, (usize, Spanned<UpstreamSpec>)> = BTreeMap::new();
    let mut limit_specs: BTreeMap<String, (usize, Spanned<LimitSpec>)> = BTreeMap::new();
    let mut route_specs: Vec<(usize, Spanned<RouteSpec>)> = Vec::new();
    for (index, spec) in specs {
        compiler.take_once("[server]", &mut server, index, spec.server);
        compiler.take_once("[admin]", &mut admin, index, spec.admin);
        compiler.take_once("[redis]", &mut redis, index, spec.redis);
        compiler.take_once("[identity]", &mut identity, index, spec.identity);
        compiler.take_once("[degrade]", &mut degrade, index, spec.degrade);
        compiler.merge_named("module", &mut module_specs, index, spec.module);
        compiler.take_once("[queue]", &mut queue, index, spec.queue);
        compiler.merge_named("upstream", &mut upstream_specs, index, spec.upstream);
        compiler.merge_named("limit", &mut limit_specs, index, spec.limit);
        route_specs.extend(spec.route.into_iter().map(|route| (index, route)));
    }

    let server_settings = match &server {
        Some((file, spec)) => compile_server(&mut compiler, *file, spec.get_ref()),
        None => ServerSettings::default(),
    };
    let admin_settings = match &admin {
        Some((file, spec)) => {
            let inner = spec.get_ref();
            let listen =
                compiler.socket_addr(*file, &inner.listen, AdminSettings::default().listen);
            let tokens: Vec<(String, String)> = inner
                .tokens
                .as_ref()
                .map(|tokens| {
                    tokens
                        .get_ref()
                        .iter()
                        .map(|(name, secret)| (name.clone(), secret.clone()))
                        .collect()
                })
                .unwrap_or_default();
            if let Some(spec_tokens) = &inner.tokens {
                if tokens
                    .iter()
                    .any(|(_, secret)| secret.trim() != secret.as_str())
                {
                    compiler.error_hint(
                        *file,
                        spec_tokens.span(),
                        "an admin token begins or ends with whitespace",
                        "clients cannot send it so; remove the spaces",
                    );
                }
                // `Authorization` is read as visible ASCII: a secret with anything else (a
                // letter beyond ASCII, a tab, a line break) could never be presented, and would
                // lock every operator out of the listener it protects.
                if tokens
                    .iter()
                    .any(|(_, secret)| !secret.bytes().all(|byte| (b' '..=b'~').contains(&byte)))
                {
                    compiler.error_hint(
                        *file,
                        spec_tokens.span(),
                        "an admin token holds a character that is not printable ASCII",
                        "clients send tokens in the Authorization header, which carries ASCII only; use e.g. `openssl rand -hex 24`",
                    );
                }
                if tokens.iter().any(|(_, secret)| secret.len() < 16) {
                    compiler.error_hint(
                        *file,
                        spec_tokens.span(),
                        "admin tokens must be at least 16 characters",
                        "use a long random string, e.g. from `openssl rand -hex 24`",
                    );
                }
            }
            let origins = admin_origins(&mut compiler, *file, inner.origins.as_ref());
            AdminSettings {
                listen,
                tokens,
                origins,
            }
        }
        None => AdminSettings::default(),
    };
    // A running levee keeps the admin address it bound at start (a change takes a restart),
    // so a reload is checked against that address too: removing the tokens (or the whole
    // [admin] file) must not leave a listener reachable beyond this machine open to anyone.
    let bound = previous.map(|policy| policy.admin.listen);
    let exposed = [Some(admin_settings.listen), bound]
        .into_iter()
        .flatten()
        .find(|address| !address.ip().to_canonical().is_loopback());
    // An `[admin]` that did not read (already reported) may have the tokens.
    let tokens_unread = admin.is_none() && compiler.unread.may_hold("admin");
    if let (Some(address), true, false) = (exposed, admin_settings.tokens.is_empty(), tokens_unread)
    {
        let message = if address == admin_settings.listen {
            format!(
                "the admin listener on {address} is reachable beyond this machine but has no token"
            )
        } else {
            format!("the admin listener is bound to {address}, reachable beyond this machine, until levee restarts; this policy has no token for it")
        };
        let hint = "keep it on 127.0.0.1, or add [admin] tokens = { ops = \"…\" }";
        match &admin {
            Some((file, spec)) => {
                let span = spec
                    .get_ref()
                    .listen
                    .as_ref()
                    .map_or(spec.span(), |listen| listen.span());
                compiler.error_hint(*file, span, message, hint);
            }
            // No [admin] section is left (its file deleted): no line of the others is it.
            None => compiler.error_hint_in_dir(message, hint),
        }
    }
    // A `listen` in a `[server]` or `[admin]` that did not read is not known.
    let listens_unread = (server.is_none() && compiler.unread.may_hold("server"))
        || (admin.is_none() && compiler.unread.may_hold("admin"));
    let overlap = listeners_overlap(admin_settings.listen, server_settings.listen);
    let localhost = listeners_share_localhost(admin_settings.listen, server_settings.listen);
    if (overlap || localhost) && !listens_unread {
        // Point at whichever `listen` was written (the other is its default).
        let (file, span) = match (&admin, &server) {
            (Some((file, spec)), _) => (
                *file,
                spec.get_ref()
                    .listen
                    .as_ref()
                    .map_or(spec.span(), |listen| listen.span()),
            ),
            (None, Some((file, spec))) => (
                *file,
                spec.get_ref()
                    .listen
                    .as_ref()
                    .map_or(spec.span(), |listen| listen.span()),
            ),
            (None, None) => (0, 0..0),
        };
        let message = if overlap {
            format!(
                "the admin listener ({}) and the public one ({}) use the same port of the same address",
                admin_settings.listen, server_settings.listen
            )
        } else {
            format!(
                "the admin listener ({}) and the public one ({}) share a port on the two addresses of localhost (127.0.0.1 and ::1): a front told localhost:{} reaches either, by turns",
                admin_settings.listen,
                server_settings.listen,
                server_settings.listen.port()
            )
        };
        compiler.error_hint(
            file,
            span,
            message,
            "give [admin] listen its own port; admin must never be on the public listener",
        );
    }

    let mut upstreams: BTreeMap<String, Arc<Upstream>> = BTreeMap::new();
    for (name, (file, spec)) in &upstream_specs {
        let fastcgi = spec
            .get_ref()
            .url
            .as_ref()
            .and_then(|url| url.get_ref().trim_start().get(..FASTCGI.len() + 3))
            .is_some_and(|start| start.eq_ignore_ascii_case(&format!("{FASTCGI}://")));
        let breaker_settings =
            compile_breaker(&mut compiler, *file, &spec.get_ref().breaker, fastcgi);
        if let Some(settings) = compile_upstream(&mut compiler, *file, name, spec) {
            let old = previous.and_then(|policy| policy.upstreams.get(name));
            // The breaker keeps its state (an open breaker stays open) when its settings and
            // the upstream's address (and socket) are unchanged; changed settings, or an
            // upstream pointed elsewhere (a dead app or php-fpm pool replaced by a standby),
            // start it fresh.
            let breaker = old
                .filter(|old| {
                    old.settings.scheme == settings.scheme
                        && old.settings.authority == settings.authority
                        && old.settings.socket == settings.socket
                })
                .map(|old| &old.breaker)
                .filter(|breaker| breaker.settings() == breaker_settings)
                .cloned()
                .unwrap_or_else(|| {
                    let fresh = Arc::new(Breaker::new(name, breaker_settings));
                    if let Some(old) = old {
                        fresh.keep_pin_of(&old.breaker);
                        fresh.keep_callers_of(&old.breaker);
                        // Said: an alert on the breaker's state cleared with no transition
                        // and no line, the app still down.
                        if old.breaker.state_value() != 0 && fresh.state_value() == 0 {
                            tracing::warn!(
                                upstream = %name,
                                "breaker starts afresh, closed, as the reload changed its settings or the upstream's address: it was {}; the next requests go to the app and open it again if it still fails",
                                if old.breaker.state_value() == 1 { "open" } else { "half-open" }
                            );
                        }
                    }
                    fresh
                });
            // Keep the running upstream (and its warm pool) when nothing about it changed.
            let upstream = old
                .filter(|old| old.settings == settings && Arc::ptr_eq(&old.breaker, &breaker))
                .cloned()
                .unwrap_or_else(|| {
                    Arc::new(Upstream::new(
                        name.clone(),
                        settings,
                        breaker,
                        old.map(|old| &**old),
                    ))
                });
            upstreams.insert(name.clone(), upstream);
        }
    }

    let default_upstream = match server.as_ref().and_then(|(file, spec)| {
        spec.get_ref()
            .default_upstream
            .as_ref()
            .map(|name| (*file, name))
    }) {
        Some((file, name)) => {
            if !upstream_specs.contains_key(name.get_ref())
                && !compiler.unread.may_define("upstream", name.get_ref())
            {
                let known = known_names("upstream", &upstream_specs);
                compiler.error_hint(
                    file,
                    name.span(),
                    format!("default_upstream `{}` is not defined", name.get_ref()),
                    format!("defined upstreams: {known}"),
                );
            }
            Some(name.get_ref().clone())
        }
        None if upstream_specs.len() == 1 => upstream_specs.keys().next().cloned(),
        None => None,
    };

    let redis_store = redis.as_ref().and_then(|(file, spec)| {
        let settings = compile_redis(&mut compiler, *file, spec)?;
        // Keep the running connection when nothing about Redis changed.
        let old = previous.and_then(|policy| policy.redis.as_ref());
        if let Some(reused) = old.filter(|old| old.settings == settings) {
            return Some(reused.clone());
        }
        let store = RedisStore::new(settings);
        if let Some(old) = old {
            store.start_from(old);
        }
        Some(Arc::new(store))
    });
    let identity_settings = match &identity {
        Some((file, spec)) => compile_identity(&mut compiler, *file, spec.get_ref()),
        None => Identity::default(),
    };
    let mut limits: BTreeMap<String, Arc<LimitRule>> = BTreeMap::new();
    for (name, (file, spec)) in &limit_specs {
        if let Some(rule) = compile_limit(&mut compiler, *file, name, spec, &identity_settings) {
            limits.insert(name.clone(), Arc::new(rule));
        }
    }

    // `[redis]` may be in a file that did not read (already reported): queues are not also
    // refused for want of it.
    let redis_given =
        redis_store.is_some() || (redis.is_none() && compiler.unread.may_hold("redis"));
    // Without Redis no call fails: an `on_redis_error` set is one that never acts.
    if !redis_given && redis.is_none() {
        for (name, (file, spec)) in &limit_specs {
            if let Some(set) = &spec.get_ref().on_redis_error {
                compiler.warning_hint(
                    *file,
                    set.span(),
                    format!("on_redis_error of limit `{name}` does nothing without [redis]: the rule is decided in-process, where no call to Redis can fail"),
                    "remove it, or add [redis] to share the limit between instances",
                );
            }
        }
    }
    let queue_settings = compile_queue(&mut compiler, queue.as_ref(), redis_given);
    // Every module a route names (`module`, `hide`), declared or not: a name a letter from
    // another is most often a typo, whichever of the two is declared.
    let mut named_modules: BTreeSet<String> = BTreeSet::new();
    for (_, spec) in &route_specs {
        let route = spec.get_ref();
        named_modules.extend(route.module.iter().map(|module| module.get_ref().clone()));
        if let Some(hide) = &route.hide {
            named_modules.extend(hide.get_ref().keys().cloned());
        }
    }
    let context = RouteContext {
        server: &server_settings,
        upstreams: &upstreams,
        upstream_specs: &upstream_specs,
        default_upstream: default_upstream.as_deref(),
        limits: &limits,
        limit_specs: &limit_specs,
        module_specs: &module_specs,
        named_modules: &named_modules,
        queues: queue_settings.is_some(),
        cluster: redis_store.as_ref().is_some_and(|store| {
            matches!(
                store.settings.target,
                crate::redis_store::RedisTarget::Cluster(_)
            )
        }),
        key_prefix: redis_store
            .as_ref()
            .map_or(super::policy::DEFAULT_KEY_PREFIX, |store| {
                store.settings.key_prefix.as_str()
            }),
    };
    let mut routes = Vec::with_capacity(route_specs.len());
    let mut route_names: BTreeMap<String, (usize, Range<usize>)> = BTreeMap::new();
    for (file, spec) in &route_specs {
        if let Some(route) = compile_route(&mut compiler, *file, spec, &context, &mut route_names) {
            routes.push(Arc::new(route));
        }
    }
    // Routes are tried in order and the first match wins: every route after one that matches
    // every request (a `[[route]]` with no `match`, or a file that sorts first) is dead.
    // (Only on routes that compiled cleanly: a duplicate name would be reported twice.)
    let catch_all_at = compiler
        .errors
        .is_empty()
        .then(|| routes.iter().position(|route| matches_every_request(route)));
    if let Some(first) = catch_all_at.flatten() {
        let catch_all_at = route_names
            .get(&*routes[first].name.0)
            .map_or_else(String::new, |(file, span)| compiler.location(*file, span));
        for later in &routes[first + 1..] {
            if let Some((file, span)) = route_names.get(&*later.name.0) {
                compiler.error_hint(
                    *file,
                    span.clone(),
                    format!(
                        "route `{}` is never reached: route `{}` before it ({}) matches every request",
                        later.name,
                        routes[first].name,
                        catch_all_at
                    ),
                    "routes are tried in order (files by name, then as written); move the catch-all last",
                );
            }
        }
    }
    // Before a catch-all (after one, every route is refused above).
    let tried = match catch_all_at.flatten() {
        Some(first) => &routes[..=first],
        None => &routes[..],
    };
    warn_of_shadowed_routes(&mut compiler, tried, &route_names);
    warn_of_routes_for_every_site(
        &mut compiler,
        tried,
        &route_names,
        default_upstream.as_deref(),
    );
    // A request no route matches goes to the default upstream; without one it gets a 404,
    // which for a site is every page nobody thought to route: an empty or truncated file, or
    // a second upstream added (with one, it is the default by itself).
    if default_upstream.is_none()
        && !routes.iter().any(|route| matches_every_request(route))
        && compiler.errors.is_empty()
        && !files.is_empty()
    {
        let (file, span) = server
            .as_ref()
            .map_or((0, 0..0), |(file, spec)| (*file, spec.span()));
        if upstream_specs.is_empty() {
            compiler.error_hint(
                0,
                0..0,
                "the policy defines no upstream: levee would answer every request 404",
                "add the PHP app: [upstream.app] with url = \"http://127.0.0.1:8081\"",
            );
        } else {
            compiler.error_hint(
                file,
                span,
                format!(
                    "{} upstreams and no default_upstream: requests no route matches would get 404",
                    upstream_specs.len()
                ),
                format!(
                    "set default_upstream = \"NAME\" in [server] (defined upstreams: {}), or end the routes with one that has no match",
                    known_names("upstream", &upstream_specs)
                ),
            );
        }
    }
    let upstream_names: Vec<String> = upstream_specs.keys().cloned().collect();
    let bounded_upstreams: Vec<String> = upstream_specs
        .iter()
        .filter(|(_, (_, spec))| spec.get_ref().max_inflight.is_some())
        .map(|(name, _)| name.clone())
        .collect();
    let degrade_settings = compile_degrade(
        &mut compiler,
        files,
        degrade.as_ref(),
        &module_specs,
        &routes,
        (&upstream_names, &bounded_upstreams),
    );
    let fallback = default_upstream
        .as_ref()
        .and_then(|name| upstreams.get(name))
        .map(|upstream| {
            Arc::new(Route {
                name: RouteName(Arc::from(DEFAULT_ROUTE)),
                hosts: Vec::new(),
                methods: Vec::new(),
                path: PathMatch::Any,
                clients: Vec::new(),
                upstream: upstream.clone(),
                max_body: server_settings.max_body,
                limits: Vec::new(),
                fixed_keys: Vec::new(),
                fallback: None,
                tier: 1,
                module: None,
                degrade: None,
                hide: Vec::new(),
                hide_plans: Default::default(),
                queue: None,
                always_queue: false,
                answer_format: server_settings.answer_format,
                series: Default::default(),
            })
        });

    warn_of_what_does_nothing(
        &mut compiler,
        &routes,
        default_upstream.as_deref(),
        &degrade_settings.triggers,
        (&upstream_specs, &limit_specs, &module_specs),
    );
    let in_file_order = |mut diagnostics: Vec<Diagnostic>| {
        diagnostics.sort_by(|a, b| (&a.file, a.line, a.col).cmp(&(&b.file, b.line, b.col)));
        diagnostics
    };
    if !compiler.errors.is_empty() {
        let beyond = compiler.errors_beyond;
        let mut errors = in_file_order(compiler.errors);
        let dir = files
            .first()
            .and_then(|file| file.path.parent())
            .unwrap_or(std::path::Path::new("."));
        if beyond > 0 {
            errors.push(
                Diagnostic::whole(dir, format!("and {beyond} more errors, not listed")).hint(
                    format!("the first {MAX_ERRORS} are above; fix those and check again"),
                ),
            );
        }
        // Not listed: a compile with errors leaves parts out, so some would be false ("limit
        // `login` is used by no route" of a route that did not compile). Counted, so fixing
        // the errors does not end in a surprise.
        // Said at the first one's place (a real place, as every diagnostic names).
        if let Some(first) = compiler.warnings.first() {
            let count = super::units::counted(compiler.warnings.len() as u64, "warning");
            let mut held_back = Diagnostic::whole(
                &first.file,
                format!("{count} held back (the first is here), listed once the errors are fixed"),
            )
            .hint("some may come from the errors themselves: a part that did not compile is missing from the checks of the rest");
            held_back.severity = super::diag::Severity::Warning;
            (held_back.line, held_back.col) = (first.line, first.col);
            errors.push(held_back);
        }
        return Err(Diagnostics(errors));
    }
    let written_at = |file: usize, listen: &Option<Spanned<String>>| {
        listen
            .as_ref()
            .map(|listen| compiler.location(file, &listen.span()))
    };
    let listen_written_at = ListenWrittenAt {
        server: server
            .as_ref()
            .and_then(|(file, spec)| written_at(*file, &spec.get_ref().listen)),
        admin: admin
            .as_ref()
            .and_then(|(file, spec)| written_at(*file, &spec.get_ref().listen)),
    };
    let warnings = in_file_order(compiler.warnings);
    Ok(Policy {
        generation: 0,
        hash: policy_hash_with_cas(
            files,
            &upstreams,
            redis_store
                .as_ref()
                .and_then(|store| store.settings.tls.as_ref()),
        ),
        files: files.iter().map(|file| file.path.clone()).collect(),
        empty_files: files
            .iter()
            .filter(|file| file.text.trim().is_empty())
            .map(|file| file.path.clone())
            .collect(),
        file_hashes: files
            .iter()
            .map(|file| (file.path.clone(), policy_hash(std::slice::from_ref(file))))
            .collect(),
        loaded_at_unix: 0,
        server: server_settings,
        admin: admin_settings,
        upstreams,
        default_upstream,
        // Routes that keep pages setting cookies learn them too: their carriers share no
        // fetch and keep no copy (see `proxy::Stale::for_request`).
        learns_app_cookies: routes.iter().any(|route| {
            matches!(&route.degrade, Some(DegradeAction::Stale(settings))
                if settings.learn_private_cookies)
        }),
        routes: RouteTable::new(routes, fallback),
        redis: redis_store,
        identity: identity_settings,
        limits,
        degrade: degrade_settings,
        queue: queue_settings,
        warnings,
        listen_written_at,
    })
}

type NamedSpecs<'a, T> = &'a BTreeMap<String, (usize, Spanned<T>)>;

/// Routes that never apply because a route before them matches every request they match
/// (`[[route]] path_prefix = "/shop"` before `path = "/shop/cart"` with no narrower
/// condition): a warning, at both places. The policy works as written, but an operator who
/// wrote the later route meant its limits and switches to hold. Only certain cases are said
/// (see [`Route::matches_every_request_of`]); `names` places each route's `name`.
fn warn_of_shadowed_routes(
    compiler: &mut Compiler<'_>,
    routes: &[Arc<Route>],
    names: &BTreeMap<String, (usize, Range<usize>)>,
) {
    // Earlier routes by the literal their paths begin with (an exact path, a prefix); those
    // with none (any path, a regex) in a list. A route is held only by earlier ones whose
    // literal begins its own, so each is compared with few, not with every route before it
    // (a policy of many thousand routes would take seconds to check).
    let mut by_literal: std::collections::HashMap<&str, Vec<usize>> =
        std::collections::HashMap::new();
    let mut without_literal: Vec<usize> = Vec::new();
    for (at, later) in routes.iter().enumerate() {
        let start = later.path.literal_start();
        let holds = |earlier: &usize| routes[*earlier].matches_every_request_of(later);
        let mut first = without_literal.iter().copied().find(holds);
        // Every start of the later route's literal (or `/`, which begins every path).
        let literal = start.as_deref().unwrap_or("/");
        let ends = literal
            .char_indices()
            .map(|(end, _)| end)
            .skip(1)
            .chain(std::iter::once(literal.len()));
        for end in ends {
            let Some(earlier) = literal.get(..end).and_then(|start| by_literal.get(start)) else {
                continue;
            };
            if let Some(found) = earlier.iter().copied().find(holds) {
                first = Some(first.map_or(found, |first| first.min(found)));
            }
        }
        if let Some(earlier) = first {
            let earlier = &routes[earlier];
            let placed = (names.get(&*later.name.0), names.get(&*earlier.name.0));
            if let (Some((file, span)), Some((earlier_file, earlier_span))) = placed {
                let earlier_at = compiler.location(*earlier_file, earlier_span);
                compiler.warning_hint(
                    *file,
                    span.clone(),
                    format!(
                        "route `{}` is never reached: route `{}` before it ({earlier_at}) matches every request it matches",
                        later.name, earlier.name
                    ),
                    format!(
                        "routes are tried in order (files by name, then as written) and the first that matches wins; move `{}` before `{}`, or remove it",
                        later.name, earlier.name
                    ),
                );
            }
        }
        match &later.path {
            PathMatch::Exact(literal) | PathMatch::Prefix(literal) => {
                by_literal.entry(literal.as_str()).or_default().push(at);
            }
            PathMatch::Any | PathMatch::Regex(_) => without_literal.push(at),
        }
    }
}

/// Sections that load but do nothing, most often an edit left half done: a limit no route
/// lists limits nobody, a module no route belongs to and no page hides is switched off to no
/// effect, an upstream no route names (and not the default) gets no request. They are
/// warnings, not errors: a rule kept for later, or an upstream being brought in, is a
/// policy an operator may mean.
fn warn_of_what_does_nothing(
    compiler: &mut Compiler<'_>,
    routes: &[Arc<Route>],
    default_upstream: Option<&str>,
    triggers: &[crate::degrade::trigger::Trigger],
    (upstream_specs, limit_specs, module_specs): (
        NamedSpecs<'_, UpstreamSpec>,
        NamedSpecs<'_, LimitSpec>,
        NamedSpecs<'_, ModuleSpec>,
    ),
) {
    for (name, (file, spec)) in limit_specs {
        let used = routes
            .iter()
            .any(|route| route.limits.iter().any(|rule| *rule.name == **name));
        if !used {
            compiler.warning_hint(
                *file,
                spec.span(),
                format!("limit `{name}` is used by no route: it limits nothing"),
                format!("list it in a route's limits = [\"{name}\"], or remove it"),
            );
        }
    }
    for (name, (file, spec)) in module_specs {
        let used = routes.iter().any(|route| {
            route.module.as_deref() == Some(name.as_str())
                || route.hide.iter().any(|(module, _)| module == name)
        });
        if !used {
            compiler.warning_hint(
                *file,
                spec.span(),
                format!("module `{name}` has no route and no page that hides it: switching it off does nothing"),
                format!("give its routes module = \"{name}\", or hide it in a page with hide = {{ {name} = \"#its-id\" }}"),
            );
        }
    }
    for (name, (file, spec)) in upstream_specs {
        // One that only a degrade trigger watches is a switch an operator may pin
        // (`levee breaker NAME open` raises the level): it is used.
        let used = default_upstream == Some(name.as_str())
            || routes.iter().any(|route| route.upstream.name == *name)
            || triggers.iter().any(|trigger| trigger.upstream == *name);
        if !used {
            compiler.warning_hint(
                *file,
                spec.span(),
                format!("upstream `{name}` gets no request: no route names it and it is not the default_upstream"),
                format!("name it in a route's upstream = \"{name}\", or remove it"),
            );
            continue;
        }
        warn_of_bulkhead_limits(compiler, routes, default_upstream, name, (*file, spec));
    }
}

/// The warnings about how an upstream's routes can use its `max_inflight` (see
/// [`warn_of_slots_no_route_may_take`], [`warn_of_slow_calls_that_cannot_trip`]).
fn warn_of_bulkhead_limits(
    compiler: &mut Compiler<'_>,
    routes: &[Arc<Route>],
    default_upstream: Option<&str>,
    name: &str,
    (file, spec): (usize, &Spanned<UpstreamSpec>),
) {
    let Some(max) = &spec.get_ref().max_inflight else {
        return;
    };
    let Some(upstream) = routes
        .iter()
        .find(|route| route.upstream.name == name)
        .map(|route| &route.upstream)
    else {
        return;
    };
    let Some(bulkhead) = &upstream.bulkhead else {
        return;
    };
    // The best tier that calls it: its routes', and the default route's (tier 1).
    let tier = routes
        .iter()
        .filter(|route| route.upstream.name == name)
        .map(|route| route.tier)
        .chain((default_upstream == Some(name)).then_some(1))
        .min()
        .unwrap_or(1);
    let usable = bulkhead.limit_for(tier);
    warn_of_slots_no_route_may_take(compiler, name, (file, max), tier, usable);
    warn_of_slow_calls_that_cannot_trip(compiler, upstream, (file, spec), usable);
}

/// A slow-call ratio judged on more calls than fit in the window while they are slow never
/// trips while the dependency is slow: with 1 slot, `slow_call = "1s"` and a 10 s window, 11
/// slow calls at most, under `min_requests = 20`. It tripped once the dependency was fast
/// again, when quick calls filled the window, and cut a healthy service off.
fn warn_of_slow_calls_that_cannot_trip(
    compiler: &mut Compiler<'_>,
    upstream: &Upstream,
    (file, spec): (usize, &Spanned<UpstreamSpec>),
    usable: u32,
) {
    let name = &upstream.name;
    let settings = upstream.breaker.settings();
    let Some(slow_call) = settings.slow_call else {
        return;
    };
    // Calls each at least `slow_call` long, one after the other in a slot, that end within
    // one window: one more than fit in it whole (one ends as the window opens).
    let per_slot = (settings.window.as_secs_f64() / slow_call.as_secs_f64()).floor() + 1.0;
    let fit = (f64::from(usable) * per_slot) as u64;
    if fit >= u64::from(settings.min_requests) {
        return;
    }
    let span = spec
        .get_ref()
        .breaker
        .as_ref()
        .map_or_else(|| spec.span(), |breaker| breaker.span());
    compiler.warning_hint(
        file,
        span,
        format!(
            "upstream `{name}`: while its calls are slow, at most {fit} of them end in the breaker's window ({usable} slot(s) of max_inflight, each ending one call per slow_call {} in a window of {}), fewer than min_requests = {}: the slow-call ratio cannot open the breaker while the dependency is slow, and may open it once it is fast again",
            super::units::Shown(slow_call),
            super::units::Shown(settings.window),
            settings.min_requests
        ),
        format!("set min_requests = {} or less in its breaker, or a longer window", fit.max(1)),
    );
}

/// An upstream whose routes are all of tier 2 or 3 can never fill the slots `shed_reserve`
/// keeps for better tiers: with `max_inflight = 2` near a small pool's `pm.max_children`,
/// tier 3 may take one slot, and half the pool idles while requests are refused.
fn warn_of_slots_no_route_may_take(
    compiler: &mut Compiler<'_>,
    name: &str,
    (file, max): (usize, &Spanned<u32>),
    tier: u8,
    usable: u32,
) {
    let (span, max) = (max.span(), *max.get_ref());
    if usable < max {
        compiler.warning_hint(
            file,
            span,
            format!(
                "upstream `{name}` has only routes of tier {tier} and worse, which may take {usable} of its max_inflight = {max} slots: shed_reserve keeps the other {} for better tiers, which no route of it has, so they are never used and requests are refused with slots free",
                max - usable
            ),
            "set shed_reserve = 0 on it, or raise max_inflight to what the pool behind it takes",
        );
    }
}

/// A `degrade` key the chosen action never reads is an error, not silence: an operator who
/// writes `body_json` on a `reject` expects it to be the answer.
fn refuse_keys_that_do_not_apply(
    compiler: &mut Compiler<'_>,
    file: usize,
    spec: &Spanned<RouteDegradeSpec>,
    always_queue: bool,
) {
    let inner = spec.get_ref();
    let action = degrade_action(inner, always_queue);
    let given: [(&str, bool); 16] = [
        ("max_age", inner.max_age.is_some()),
        ("keep_no_cache", inner.keep_no_cache.is_some()),
        (
            "learn_private_cookies",
            inner.learn_private_cookies.is_some(),
        ),
        ("private_cookies", inner.private_cookies.is_some()),
        (
            "private_cookies_builtin",
            inner.private_cookies_builtin.is_some(),
        ),
        ("vary", inner.vary.is_some()),
        ("allow_set_cookie", inner.allow_set_cookie.is_some()),
        ("on_status", inner.on_status.is_some()),
        ("max_body", inner.max_body.is_some()),
        ("query", inner.query.is_some()),
        ("max_copies", inner.max_copies.is_some()),
        ("status", inner.status.is_some()),
        ("content_type", inner.content_type.is_some()),
        ("body", inner.body.is_some()),
        ("body_html", inner.body_html.is_some()),
        ("body_json", inner.body_json.is_some()),
    ];
    // The keys only a `stale` action reads.
    const STALE_KEYS: [&str; 11] = [
        "max_age",
        "vary",
        "allow_set_cookie",
        "on_status",
        "max_body",
        "query",
        "max_copies",
        "private_cookies",
        "private_cookies_builtin",
        "keep_no_cache",
        "learn_private_cookies",
    ];
    let applies = |key: &str| match key {
        key if STALE_KEYS.contains(&key) => action == "stale",
        "status" | "content_type" | "body" => action == "reject",
        // The 202 answer of a queued request: the queue action, or a route that always queues.
        _ => action == "queue" || always_queue,
    };
    if !matches!(action, "reject" | "stale" | "queue") {
        return;
    }
    for (key, _) in given.iter().filter(|(key, given)| *given && !applies(key)) {
        let hint = match *key {
            key if STALE_KEYS.contains(&key) => "it belongs to action = \"stale\"",
            "status" | "content_type" | "body" => "it belongs to action = \"reject\"",
            _ => "it is the 202 answer of action = \"queue\" (or always_queue)",
        };
        compiler.error_hint(
            file,
            spec.span(),
            format!("`{key}` does not apply to degrade action `{action}`"),
            hint,
        );
    }
}

/// `on_status` of a `stale` action: the app's error statuses (400-599) a copy answers in
/// place of; a copy in place of a page the app served well would hide the page.
fn compile_stale_on_status(
    compiler: &mut Compiler<'_>,
    file: usize,
    spec: &Option<Spanned<Vec<u16>>>,
) -> Vec<u16> {
    let Some(list) = spec else {
        return Vec::new();
    };
    if list
        .get_ref()
        .iter()
        .any(|status| !(400..=599).contains(status))
    {
        compiler.error_hint(
            file,
            list.span(),
            "on_status must be error statuses (400-599)",
            "list the app's error statuses its copy answers in place of, like on_status = [500]",
        );
    }
    list.get_ref().clone()
}

/// A route's degrade action: as written, else `queue` on a route that always queues (its
/// `degrade` then holds the 202 answer's bodies), else `reject`.
fn degrade_action(spec: &RouteDegradeSpec, always_queue: bool) -> &str {
    match &spec.action {
        Some(action) => action.get_ref().as_str(),
        None if always_queue => "queue",
        None => "reject",
    }
}

fn compile_route_degrade(
    compiler: &mut Compiler<'_>,
    file: usize,
    spec: &Spanned<RouteDegradeSpec>,
    tier: u8,
    queues: bool,
    always_queue: bool,
) -> Option<DegradeAction> {
    let inner = spec.get_ref();
    let action = degrade_action(inner, always_queue);
    let action_span = inner
        .action
        .as_ref()
        .map_or(spec.span(), |action| action.span());
    match action {
        "reject" => {
            if tier == 1 {
                compiler.error_hint(
                    file,
                    action_span,
                    "a tier-1 route cannot be given an action that refuses service",
                    "tier-1 routes are never degraded; use tier = 2 or 3, or remove degrade",
                );
                return None;
            }
            let response =
                if inner.status.is_some() || inner.body.is_some() || inner.content_type.is_some() {
                    let synthetic = Spanned::new(
                        spec.span(),
                        StaticResponseSpec {
                            status: inner.status.clone(),
                            content_type: inner.content_type.clone(),
                            body: inner.body.clone(),
                        },
                    );
                    Some(Arc::new(compile_static_response(
                        compiler, file, &synthetic, 503,
                    )?))
                } else {
                    None
                };
            Some(DegradeAction::Reject(response))
        }
        "stale" => {
            let max_body = compiler.size(file, &inner.max_body, 1 << 20);
            Some(DegradeAction::Stale(Arc::new(StaleSettings {
                max_age: compiler.duration(file, &inner.max_age, Duration::from_secs(600)),
                vary: compile_copy_vary(compiler, file, &inner.vary),
                allow_set_cookie: inner.allow_set_cookie.unwrap_or(false),
                max_body: usize::try_from(max_body).unwrap_or(usize::MAX),
                query: compile_copy_query(compiler, file, &inner.query),
                max_copies: compile_max_copies(compiler, file, &inner.max_copies),
                private_cookies: compile_private_cookies(
                    compiler,
                    file,
                    &inner.private_cookies,
                    inner.private_cookies_builtin.unwrap_or(true),
                ),
                keep_no_cache: inner.keep_no_cache.unwrap_or(false),
                learn_private_cookies: inner.learn_private_cookies.unwrap_or(true),
                on_status: compile_stale_on_status(compiler, file, &inner.on_status),
            })))
        }
        "queue" => {
            if !queues {
                compiler.error_hint(file, action_span, "action `queue` needs [redis]", "queued work is stored durably in Redis Streams; add a [redis] section, or use \"reject\"");
                return None;
            }
            Some(DegradeAction::Queue)
        }
        other => {
            compiler.error_hint(
                file,
                action_span,
                format!("unknown degrade action `{other}`"),
                "use \"stale\" (serve the last good copy), \"reject\" (a page from the policy) or \"queue\" (accept now with 202, apply later; needs [redis])",
            );
            None
        }
    }
}

/// `query` of a `stale` route: `"all"`, `"none"`, or the names of the parameters that select
/// copies (named as PHP names them, as `query:NAME` sources are).
fn compile_copy_query(
    compiler: &mut Compiler<'_>,
    file: usize,
    value: &Option<Spanned<OneOrMany>>,
) -> CopyQuery {
    let Some(value) = value else {
        return CopyQuery::All;
    };
    match value.get_ref() {
        OneOrMany::One(all) if all == "all" => CopyQuery::All,
        OneOrMany::One(none) if none == "none" => CopyQuery::Ignored,
        OneOrMany::One(other) => {
            compiler.error_hint(
                file,
                value.span(),
                format!("unknown value `{other}` for `query`"),
                "use \"all\" (the whole query selects the copy), \"none\" (one copy per path) or a list of the parameters that select copies, e.g. [\"page\"]",
            );
            CopyQuery::All
        }
        OneOrMany::Many(names) => {
            let mut kept = Vec::with_capacity(names.len());
            for name in names {
                let name = crate::limit::key::query_name(name);
                if name.is_empty() {
                    compiler.error_hint(
                        file,
                        value.span(),
                        "`query` names an empty parameter",
                        "list the names of the parameters that select copies, e.g. [\"page\"], or write \"none\"",
                    );
                    continue;
                }
                kept.push(name);
            }
            kept.sort();
            kept.dedup();
            CopyQuery::Only(kept)
        }
    }
}

/// `max_copies` of a `stale` route: at least 1, default [`DEFAULT_MAX_COPIES`].
fn compile_max_copies(
    compiler: &mut Compiler<'_>,
    file: usize,
    value: &Option<Spanned<u32>>,
) -> usize {
    match value {
        None => DEFAULT_MAX_COPIES,
        Some(max) if *max.get_ref() == 0 => {
            compiler.error_hint(
                file,
                max.span(),
                "max_copies must be at least 1",
                "the most copies of this route kept at once (one per path, selecting query and vary values); leave it out for 1000",
            );
            1
        }
        Some(max) => usize::try_from(*max.get_ref()).unwrap_or(usize::MAX),
    }
}

fn compile_degrade(
    compiler: &mut Compiler<'_>,
    files: &[SourceFile],
    spec: Option<&(usize, Spanned<DegradeSpec>)>,
    module_specs: &BTreeMap<String, (usize, Spanned<ModuleSpec>)>,
    routes: &[Arc<Route>],
    upstreams: (&[String], &[String]),
) -> DegradeSettings {
    let dir = files
        .first()
        .and_then(|file| file.path.parent())
        .map(std::path::Path::to_path_buf)
        .unwrap_or_default();
    // Modules: declared ones with their tier, then those routes serve (the lowest tier of
    // their routes, also for a declared module that names no tier), then those pages hide
    // (tier 3).
    let mut modules: BTreeMap<String, u8> = BTreeMap::new();
    for (name, (file, module)) in module_specs {
        let tier = match &module.get_ref().tier {
            None => continue,
            Some(tier) if (2..=3).contains(tier.get_ref()) => *tier.get_ref(),
            Some(tier) => {
                compiler.error_hint(
                    *file,
                    tier.span(),
                    format!("module tier {} is not allowed", tier.get_ref()),
                    "modules are tier 2 (may be delayed) or 3 (may be switched off)",
                );
                3
            }
        };
        modules.insert(name.clone(), tier);
    }
    let tier_given = |module: &str| {
        module_specs
            .get(module)
            .is_some_and(|(_, spec)| spec.get_ref().tier.is_some())
    };
    for route in routes {
        if let Some(module) = &route.module {
            if !tier_given(module) {
                let entry = modules
                    .entry(module.to_string())
                    .or_insert(route.tier.max(2));
                *entry = (*entry).min(route.tier.max(2));
            }
        }
        for (module, _) in &route.hide {
            modules.entry(module.clone()).or_insert(3);
        }
    }
    for name in module_specs.keys() {
        modules.entry(name.clone()).or_insert(3);
    }
    let Some((file, spec)) = spec else {
        return DegradeSettings {
            level: 0,
            modules_off: Default::default(),
            modules,
            state_file: dir.join(".levee-state.json"),
            sync_interval: Duration::from_millis(500),
            triggers: Vec::new(),
            cool_down: Duration::from_secs(30),
            tell_app: false,
            stale_memory: crate::degrade::stale::L1_MAX_BYTES,
        };
    };
    let file = *file;
    let inner = spec.get_ref();
    let level = match &inner.level {
        None => 0,
        Some(level) if *level.get_ref() <= crate::degrade::MAX_LEVEL => *level.get_ref(),
        Some(level) => {
            compiler.error_hint(
                file,
                level.span(),
                format!("level {} does not exist", level.get_ref()),
                "0 normal, 1 tier 3 off, 2 tiers 2 and 3 off",
            );
            0
        }
    };
    let mut modules_off = std::collections::BTreeSet::new();
    if let Some(list) = &inner.modules_off {
        for name in list.get_ref() {
            if modules.contains_key(name) {
                modules_off.insert(name.clone());
            } else if !compiler.unread.may_define("module", name) {
                let known: Vec<&str> = modules.keys().map(String::as_str).collect();
                compiler.error_hint(file, list.span(), format!("module `{name}` is not defined"), format!("modules: {}; declare one with [module.NAME] or name it in a route's module or hide", known.join(", ")));
            }
        }
    }
    let state_file = inner.state_file.as_ref().map_or_else(
        || dir.join(".levee-state.json"),
        |path| dir.join(path.get_ref()),
    );
    // Found out at the first switch otherwise, in an incident, as a 503. A warning, not an
    // error: `levee check` also runs where levee does not (a deploy's checkout, CI), and
    // systemd makes a unit's `StateDirectory` only when it starts the unit.
    if let Some(path) = &inner.state_file {
        let parent = state_file
            .parent()
            .filter(|parent| !parent.as_os_str().is_empty());
        if parent.is_some_and(|parent| !parent.is_dir()) {
            compiler.warning_hint(
                file,
                path.span(),
                format!("the directory of state_file `{}` does not exist here: until it does, runtime switches cannot be saved (without Redis, a switch is refused with 503)", path.get_ref()),
                "create it where levee runs (levee writes the file, not its directory; a systemd unit's StateDirectory= makes /var/lib/NAME at start), or name a file in an existing directory levee can write",
            );
        }
    }
    DegradeSettings {
        level,
        modules_off,
        modules,
        state_file,
        sync_interval: compiler.nonzero_duration(
            file,
            &inner.sync_interval,
            Duration::from_millis(500),
            "sync_interval",
        ),
        triggers: inner
            .trigger
            .iter()
            .filter_map(|trigger| compile_trigger(compiler, file, trigger, upstreams))
            .collect(),
        cool_down: compiler.duration(file, &inner.cool_down, Duration::from_secs(30)),
        tell_app: inner.tell_app.as_ref().is_some_and(|tell| *tell.get_ref()),
        stale_memory: stale_memory(compiler, file, &inner.stale_memory),
    }
}

/// `[degrade] stale_memory`: at least 1 MiB (a page or two); no more than the machine's
/// address space.
fn stale_memory(
    compiler: &mut Compiler<'_>,
    file: usize,
    spec: &Option<Spanned<SizeSpec>>,
) -> usize {
    let default = crate::degrade::stale::L1_MAX_BYTES;
    let bytes = compiler.size(file, spec, default as u64);
    match spec {
        Some(given) if bytes < 1 << 20 => {
            compiler.error_hint(
                file,
                given.span(),
                format!("stale_memory must be at least 1MiB, not {bytes} bytes"),
                "the most memory levee gives its stale copies, every route's together: \"16MiB\" on a small box, 64MiB by default",
            );
            default
        }
        _ => usize::try_from(bytes).unwrap_or(usize::MAX),
    }
}

fn compile_trigger(
    compiler: &mut Compiler<'_>,
    file: usize,
    spec: &Spanned<TriggerSpec>,
    (upstreams, bounded_upstreams): (&[String], &[String]),
) -> Option<Trigger> {
    let inner = spec.get_ref();
    // Checked first: a trigger with a wrong upstream or condition still has these reported.
    let level = match &inner.level {
        None => 1,
        Some(level) if (1..=crate::degrade::MAX_LEVEL).contains(level.get_ref()) => {
            *level.get_ref()
        }
        Some(level) => {
            compiler.error_hint(
                file,
                level.span(),
                format!("a trigger cannot raise to level {}", level.get_ref()),
                "use level = 1 or 2",
            );
            1
        }
    };
    let hold = compiler.duration(file, &inner.hold, Duration::from_secs(5));
    let Some(upstream) = &inner.upstream else {
        compiler.error_hint(
            file,
            spec.span(),
            "trigger has no upstream",
            "name the upstream it watches: upstream = \"app\"",
        );
        return None;
    };
    if !upstreams.contains(upstream.get_ref()) {
        if !compiler.unread.may_define("upstream", upstream.get_ref()) {
            compiler.error_hint(
                file,
                upstream.span(),
                format!("upstream `{}` is not defined", upstream.get_ref()),
                if upstreams.is_empty() {
                    "defined upstreams: none (add a [upstream.NAME] section)".to_string()
                } else {
                    format!(
                        "defined upstreams: {}",
                        upstreams
                            .iter()
                            .map(|name| format!("`{name}`"))
                            .collect::<Vec<_>>()
                            .join(", ")
                    )
                },
            );
        }
        return None;
    }
    let Some(when) = &inner.when else {
        compiler.error_hint(
            file,
            spec.span(),
            "trigger has no `when`",
            "when = \"breaker_open\", \"latency_p95\", \"inflight\" or \"error_ratio\"",
        );
        return None;
    };
    let above = inner.above.as_ref();
    let share = |compiler: &mut Compiler<'_>| -> Option<f64> {
        match above.map(|a| (a.get_ref(), a.span())) {
            Some((AboveSpec::Share(share), _)) if (0.0..=1.0).contains(share) => Some(*share),
            Some((_, span)) => {
                compiler.error_hint(
                    file,
                    span,
                    "`above` must be a share between 0 and 1 here",
                    "e.g. above = 0.8",
                );
                None
            }
            None => {
                compiler.error_hint(
                    file,
                    spec.span(),
                    "this trigger needs `above`",
                    "e.g. above = 0.8",
                );
                None
            }
        }
    };
    let condition = match when.get_ref().as_str() {
        "breaker_open" => {
            if let Some(above) = above {
                compiler.error_hint(
                    file,
                    above.span(),
                    "breaker_open has no threshold, so `above` would be ignored",
                    "remove `above`; the trigger holds while the breaker is open or half-open",
                );
            }
            Condition::BreakerOpen
        }
        "inflight" if !bounded_upstreams.contains(upstream.get_ref()) => {
            compiler.error_hint(
                file,
                when.span(),
                format!(
                    "upstream `{}` has no max_inflight, so an inflight trigger could never fire",
                    upstream.get_ref()
                ),
                "set max_inflight on the upstream, or watch latency_p95 or error_ratio",
            );
            return None;
        }
        "latency_p95" => match above.map(|a| (a.get_ref(), a.span())) {
            Some((AboveSpec::Duration(text), span)) => match parse_duration(text) {
                Ok(limit) => Condition::LatencyP95(limit),
                Err(message) => {
                    compiler.error_hint(file, span, message, "e.g. above = \"800ms\"");
                    return None;
                }
            },
            _ => {
                compiler.error_hint(
                    file,
                    spec.span(),
                    "latency_p95 needs `above` as a duration",
                    "e.g. above = \"800ms\"",
                );
                return None;
            }
        },
        "inflight" => Condition::Inflight(share(compiler)?),
        "error_ratio" => Condition::ErrorRatio(share(compiler)?),
        other => {
            compiler.error_hint(
                file,
                when.span(),
                format!("unknown trigger `{other}`"),
                "use breaker_open, latency_p95, inflight or error_ratio",
            );
            return None;
        }
    };
    // A ratio or a percentile of a few calls says nothing: one slow or failed request on
    // an idle site would raise the level for everyone.
    let min_calls = match (&inner.min_calls, &condition) {
        (None, _) => crate::degrade::trigger::MIN_CALLS,
        // The latency window keeps its latest 2,048 calls: more could never be in it, and
        // the trigger would never fire.
        (Some(min), Condition::LatencyP95(_))
            if *min.get_ref() as usize > crate::degrade::trigger::MAX_SAMPLES =>
        {
            compiler.error_hint(
                file,
                min.span(),
                format!(
                    "`min_calls = {}` could never be reached: the latency window keeps the last {} calls",
                    min.get_ref(),
                    crate::degrade::trigger::MAX_SAMPLES
                ),
                format!("use at most {}", crate::degrade::trigger::MAX_SAMPLES),
            );
            crate::degrade::trigger::MIN_CALLS
        }
        (Some(min), Condition::LatencyP95(_) | Condition::ErrorRatio(_)) => (*min.get_ref()).max(1),
        (Some(min), _) => {
            compiler.error_hint(
                file,
                min.span(),
                format!(
                    "`min_calls` is for latency_p95 and error_ratio, not {}",
                    when.get_ref()
                ),
                "remove `min_calls`: this trigger counts no calls",
            );
            crate::degrade::trigger::MIN_CALLS
        }
    };
    Some(Trigger {
        upstream: upstream.get_ref().clone(),
        condition,
        hold,
        level,
        min_calls,
    })
}

fn compile_queue(
    compiler: &mut Compiler<'_>,
    spec: Option<&(usize, Spanned<QueueSpec>)>,
    redis: bool,
) -> Option<QueueSettings> {
    let defaults = QueueSettings::default();
    let Some((file, spec)) = spec else {
        return redis.then_some(defaults);
    };
    let file = *file;
    if !redis {
        compiler.error_hint(
            file,
            spec.span(),
            "[queue] needs [redis]",
            "queued work is stored durably in Redis Streams; add a [redis] section",
        );
        return None;
    }
    let inner = spec.get_ref();
    let max_attempts = match &inner.max_attempts {
        Some(value) if *value.get_ref() == 0 => {
            compiler.error(file, value.span(), "max_attempts must be at least 1");
            defaults.max_attempts
        }
        Some(value) => *value.get_ref(),
        None => defaults.max_attempts,
    };
    let replay_rate = match &inner.replay_rate {
        Some(value) if !value.get_ref().is_finite() || *value.get_ref() <= 0.0 => {
            compiler.error(
                file,
                value.span(),
                "replay_rate must be above 0 (replays per second)",
            );
            defaults.replay_rate
        }
        Some(value) => *value.get_ref(),
        None => defaults.replay_rate,
    };
    let max_body = compiler.size(file, &inner.max_body, defaults.max_body as u64);
    let claim_after = compiler.duration(file, &inner.claim_after, defaults.claim_after);
    if let Some(value) = inner
        .claim_after
        .as_ref()
        .filter(|_| claim_after < MIN_CLAIM_AFTER)
    {
        // A worker renews its hold on its jobs every third of claim_after; much less than
        // a second leaves too little room for a Redis call, and 0 would let every pass take
        // every job in flight.
        compiler.error_hint(
            file,
            value.span(),
            format!("claim_after must be at least {MIN_CLAIM_AFTER:?}"),
            "a live worker renews its hold on its jobs every third of claim_after; \"30s\" is the default",
        );
    }
    let backoff_base = compiler.duration(file, &inner.backoff_base, defaults.backoff_base);
    let backoff_max = compiler.duration(file, &inner.backoff_max, defaults.backoff_max);
    if backoff_base > backoff_max {
        let at = inner
            .backoff_base
            .as_ref()
            .or(inner.backoff_max.as_ref())
            .map_or(spec.span(), |value| value.span());
        compiler.error_hint(
            file,
            at,
            format!("backoff_base ({backoff_base:?}) is longer than backoff_max ({backoff_max:?})"),
            "the first retry waits backoff_base, then twice as long each time, up to backoff_max",
        );
    }
    if max_body == 0 {
        let at = inner
            .max_body
            .as_ref()
            .map_or(spec.span(), |value| value.span());
        compiler.error(
            file,
            at,
            "[queue] max_body must be above 0: no request could be queued",
        );
    }
    let max_dead_letters = compiler.count_at_least_one(
        file,
        &inner.max_dead_letters,
        defaults.max_dead_letters,
        "max_dead_letters",
        "the dead letters are the jobs the app refused, kept for an operator to retry or drop; 1000 is the default",
    );
    let wait_replicas = inner
        .wait_replicas
        .as_ref()
        .map_or(defaults.wait_replicas, |value| *value.get_ref());
    let wait_timeout = compiler.positive_duration(
        file,
        &inner.wait_timeout,
        defaults.wait_timeout,
        "wait_timeout",
        "Redis reads a WAIT of 0 as \"wait for ever\"; leave the key out for the default, \"100ms\"",
    );
    if let Some(value) = inner
        .wait_timeout
        .as_ref()
        .filter(|_| wait_timeout > MAX_WAIT_TIMEOUT)
    {
        compiler.error_hint(
            file,
            value.span(),
            format!("wait_timeout must be at most {MAX_WAIT_TIMEOUT:?}"),
            "the client waits for the replicas before it hears 202 or 503",
        );
    }
    let unconfirmed = match inner
        .when_unconfirmed
        .as_ref()
        .map(|value| (value.get_ref().as_str(), value.span()))
    {
        None | Some(("refuse", _)) => Unconfirmed::Refuse,
        Some(("accept", _)) => Unconfirmed::Accept,
        Some((other, span)) => {
            compiler.error_hint(
                file,
                span,
                format!("when_unconfirmed = `{other}` is not known"),
                "use \"refuse\" (withdraw the job, answer 503) or \"accept\" (answer 202 all the same)",
            );
            Unconfirmed::Refuse
        }
    };
    let group = inner
        .group
        .as_ref()
        .map_or(defaults.group, |group| group.get_ref().clone());
    if group.trim().is_empty() {
        compiler.error_hint(
            file,
            inner
                .group
                .as_ref()
                .map_or(spec.span(), |group| group.span()),
            "[queue] group is empty",
            "name the consumer group the fleet shares; \"levee\" is the default",
        );
    }
    Some(QueueSettings {
        group,
        claim_after,
        max_attempts,
        backoff_base,
        backoff_max,
        max_body: usize::try_from(max_body).unwrap_or(usize::MAX),
        replay_rate,
        poll_interval: compiler.nonzero_duration(
            file,
            &inner.poll_interval,
            defaults.poll_interval,
            "poll_interval",
        ),
        max_dead_letters,
        wait_replicas,
        wait_timeout,
        unconfirmed,
    })
}

/// `fastcgi`: the upstream is php-fpm itself. Its own failures reach levee as failed calls
/// (refused, reset, overloaded, no output, timed out), never as statuses: a 502 or 504 in
/// its answer is one a PHP script chose (`header('Status: 502')`), and counted by default
/// any visitor who found such a page could cut off the whole site with five requests.
fn compile_breaker(
    compiler: &mut Compiler<'_>,
    file: usize,
    spec: &Option<Spanned<BreakerSpec>>,
    fastcgi: bool,
) -> BreakerSettings {
    let mut defaults = BreakerSettings::default();
    if fastcgi {
        defaults.failure_statuses.clear();
    }
    let Some(spec) = spec else { return defaults };
    let inner = spec.get_ref();
    let mut ratio = |value: &Option<Spanned<f64>>, default: f64, what: &str| -> f64 {
        match value {
            Some(value) if !(0.0 < *value.get_ref() && *value.get_ref() <= 1.0) => {
                let written = *value.get_ref();
                // `50` is most often a percentage: say how it is written as a share.
                let hint = if 1.0 < written && written <= 100.0 {
                    format!(
                        "a share is a fraction of 1: {written}% is {what} = {}",
                        written / 100.0
                    )
                } else {
                    format!("a share of calls, e.g. {what} = 0.5 for half")
                };
                compiler.error_hint(
                    file,
                    value.span(),
                    format!("{what} must be above 0 and at most 1"),
                    hint,
                );
                default
            }
            Some(value) => *value.get_ref(),
            None => default,
        }
    };
    let failure_ratio = ratio(
        &inner.failure_ratio,
        defaults.failure_ratio,
        "failure_ratio",
    );
    let slow_ratio = ratio(&inner.slow_ratio, defaults.slow_ratio, "slow_ratio");
    let half_open_probes = match &inner.half_open_probes {
        Some(value) if *value.get_ref() == 0 => {
            compiler.error_hint(
                file,
                value.span(),
                "half_open_probes must be at least 1",
                "probes are how a half-open breaker learns that the dependency recovered",
            );
            defaults.half_open_probes
        }
        Some(value) => *value.get_ref(),
        None => defaults.half_open_probes,
    };
    let failing_clients = match &inner.failing_clients {
        Some(value) if !(1..=MOST_FAILING_CLIENTS).contains(value.get_ref()) => {
            compiler.error_hint(
                file,
                value.span(),
                format!(
                    "failing_clients must be from 1 to {MOST_FAILING_CLIENTS}, not {}",
                    value.get_ref()
                ),
                "the distinct clients whose calls must fail before the breaker opens; 1 lets any one client open it",
            );
            defaults.failing_clients
        }
        Some(value) => *value.get_ref(),
        None => defaults.failing_clients,
    };
    let failure_statuses = match &inner.failure_statuses {
        Some(list) => {
            if list
                .get_ref()
                .iter()
                .any(|status| !(100..=599).contains(status))
            {
                compiler.error(
                    file,
                    list.span(),
                    "failure_statuses must be HTTP statuses (100-599)",
                );
            }
            list.get_ref().clone()
        }
        None => defaults.failure_statuses.clone(),
    };
    let force = match inner
        .force
        .as_ref()
        .map(|force| (force.get_ref().as_str(), force.span()))
    {
        None | Some(("auto", _)) => None,
        Some(("open", _)) => Some(Force::Open),
        Some(("closed", _)) => Some(Force::Closed),
        Some((other, span)) => {
            compiler.error_hint(
                file,
                span,
                format!("force = `{other}` is not known"),
                "use \"open\", \"closed\" or \"auto\"",
            );
            None
        }
    };
    // Values that would quietly make the breaker do nothing (or trip on everything) are
    // refused rather than taken.
    let open_for = compiler.positive_duration(
        file,
        &inner.open_for,
        defaults.open_for,
        "open_for",
        "a breaker open for no time protects nothing; e.g. \"10s\"",
    );
    let window = compiler.positive_duration(
        file,
        &inner.window,
        defaults.window,
        "window",
        "the ratios count the calls of this much time; e.g. \"10s\"",
    );
    let slow_call = inner.slow_call.as_ref().map(|_| {
        compiler.positive_duration(
            file,
            &inner.slow_call,
            Duration::from_secs(2),
            "slow_call",
            "every call would count as slow; e.g. \"2s\"",
        )
    });
    let max_open_for = compiler.duration(file, &inner.max_open_for, defaults.max_open_for);
    if let Some(value) = &inner.max_open_for {
        if max_open_for < open_for {
            compiler.error_hint(
                file,
                value.span(),
                format!("max_open_for ({}) is shorter than open_for ({})", value.get_ref(), super::units::Shown(open_for)),
                "max_open_for bounds open_for as it doubles on each re-open; make it at least open_for",
            );
        }
    }
    if let (Some(value), None) = (&inner.slow_ratio, &inner.slow_call) {
        compiler.error_hint(
            file,
            value.span(),
            "slow_ratio has no effect without slow_call",
            "set slow_call = \"2s\" (calls slower than this count as slow), or remove slow_ratio",
        );
    }
    BreakerSettings {
        consecutive_failures: inner
            .consecutive_failures
            .unwrap_or(defaults.consecutive_failures),
        failure_ratio,
        window,
        min_requests: inner.min_requests.unwrap_or(defaults.min_requests),
        slow_call,
        slow_ratio,
        open_for,
        max_open_for: max_open_for.max(open_for),
        half_open_probes,
        failure_statuses,
        failing_clients,
        force,
    }
}

/// Statuses nginx writes in its log for what is no answer (444: the connection closed
/// without one; 499: the client went away), which an operator moving `limit_req_status 444`
/// over may write: sent, a client reads an unknown 4xx with levee's page.
const NGINX_ONLY_STATUSES: [u16; 2] = [444, 499];

/// Refuses a status of [`NGINX_ONLY_STATUSES`] with what to write instead; true when it is one.
fn refused_as_nginx_only(compiler: &mut Compiler<'_>, file: usize, status: &Spanned<u16>) -> bool {
    if !NGINX_ONLY_STATUSES.contains(status.get_ref()) {
        return false;
    }
    compiler.error_hint(
        file,
        status.span(),
        format!(
            "status {} is nginx's own, not one levee answers with",
            status.get_ref()
        ),
        "levee always answers: use 429 (too many requests), 403 (forbidden) or 503 (unavailable)",
    );
    true
}

/// A response written in the policy; `what` names the key in errors.
fn compile_static_response(
    compiler: &mut Compiler<'_>,
    file: usize,
    spec: &Spanned<StaticResponseSpec>,
    default_status: u16,
) -> Option<StaticResponse> {
    let inner = spec.get_ref();
    let status = match &inner.status {
        None => http::StatusCode::from_u16(default_status).ok()?,
        Some(status) if refused_as_nginx_only(compiler, file, status) => return None,
        Some(status) => match http::StatusCode::from_u16(*status.get_ref()) {
            // `http` takes 600–999 too, which no client reads as an answer.
            Ok(code) if (200..=599).contains(&code.as_u16()) => code,
            _ => {
                compiler.error_hint(
                    file,
                    status.span(),
                    format!("{} is not a status levee can answer with", status.get_ref()),
                    "use a status from 200 to 599",
                );
                return None;
            }
        },
    };
    let content_type = match &inner.content_type {
        None => HeaderValue::from_static("text/html; charset=utf-8"),
        Some(value) => match HeaderValue::from_str(value.get_ref()) {
            Ok(header) => header,
            Err(_) => {
                compiler.error(
                    file,
                    value.span(),
                    format!("`{}` is not a valid Content-Type", value.get_ref()),
                );
                return None;
            }
        },
    };
    Some(StaticResponse {
        status,
        content_type,
        body: bytes::Bytes::from(inner.body.clone().unwrap_or_default()),
    })
}

fn compile_redis(
    compiler: &mut Compiler<'_>,
    file: usize,
    spec: &Spanned<RedisSpec>,
) -> Option<RedisSettings> {
    let inner = spec.get_ref();
    // Without a usable target the settings are not built, but the other keys are still
    // checked, so every error of the section is reported at once.
    let targets = [
        inner.url.is_some(),
        inner.cluster.is_some(),
        inner.sentinel.is_some(),
    ];
    let target = match (&inner.url, &inner.cluster, &inner.sentinel) {
        _ if targets.iter().filter(|named| **named).count() > 1 => {
            compiler.error_hint(
                file,
                spec.span(),
                "[redis] names more than one of url, cluster and [redis.sentinel]",
                "use url for one Redis server, cluster for the nodes of a Redis Cluster, \
                 [redis.sentinel] for a master that Redis Sentinel watches",
            );
            None
        }
        (Some(url), _, _) => {
            if let Some(client) = check_redis_url(compiler, file, url.get_ref(), url.span()) {
                check_certificate_checked(compiler, file, url.get_ref(), &client, url.span());
            }
            Some(RedisTarget::Single(url.get_ref().clone()))
        }
        (_, Some(nodes), _) if !nodes.get_ref().is_empty() => {
            for node in nodes.get_ref() {
                if let Some(client) = check_redis_url(compiler, file, node, nodes.span()) {
                    check_certificate_checked(compiler, file, node, &client, nodes.span());
                    check_cluster_node(compiler, file, node, &client, nodes.span());
                }
            }
            Some(RedisTarget::Cluster(nodes.get_ref().clone()))
        }
        (_, _, Some(sentinel)) => {
            compile_sentinel(compiler, file, sentinel).map(RedisTarget::Sentinel)
        }
        _ => {
            compiler.error_hint(file, spec.span(), "[redis] needs url, cluster or [redis.sentinel]", "url = \"redis://127.0.0.1:6379/0\", or remove [redis] to run on the embedded default");
            None
        }
    };
    let positive = |compiler: &mut Compiler<'_>,
                    value: &Option<Spanned<u32>>,
                    default: u32,
                    what: &str|
     -> u32 {
        match value {
            Some(value) if *value.get_ref() == 0 => {
                compiler.error(file, value.span(), format!("{what} must be at least 1"));
                default
            }
            Some(value) => *value.get_ref(),
            None => default,
        }
    };
    if let Some(prefix) = &inner.key_prefix {
        // The bucket's hash tag `{…}` follows the prefix; a brace in the prefix would make Redis
        // Cluster read another (or no) hash tag, and one script's keys would span slots.
        if prefix.get_ref().contains(['{', '}']) {
            compiler.error_hint(
                file,
                prefix.span(),
                format!("key_prefix `{}` contains a brace", prefix.get_ref()),
                "braces mark Redis Cluster hash tags, which levee sets itself; use e.g. \"shop:\"",
            );
        }
    }
    let instances = positive(compiler, &inner.instances, 1, "instances");
    // One instance never admits ahead what Redis would refuse: its charges reach Redis in the
    // order it decided. With several, another instance's decisions that wait for Redis can
    // take the last tokens before this one's charges arrive, whatever the share (a flood of
    // one key through three instances took 1.6x the bucket at 1 - 1/3), so a fleet waits
    // for Redis unless told otherwise.
    let default_admit_ahead_above = if instances == 1 {
        DEFAULT_ADMIT_AHEAD_ABOVE
    } else {
        1.0
    };
    let admit_ahead_above = match &inner.admit_ahead_above {
        Some(value) if !(0.0..=1.0).contains(value.get_ref()) => {
            compiler.error_hint(
                file,
                value.span(),
                "admit_ahead_above must be from 0 to 1",
                "a share of each bucket's burst, e.g. 0.5 for half; 1 turns admitting ahead off",
            );
            default_admit_ahead_above
        }
        Some(value) => *value.get_ref(),
        None => default_admit_ahead_above,
    };
    let timeout =
        compiler.nonzero_duration(file, &inner.timeout, Duration::from_millis(25), "timeout");
    let failures_to_open = positive(compiler, &inner.failures_to_open, 3, "failures_to_open");
    let cooldown = compiler.duration(file, &inner.cooldown, Duration::from_secs(1));
    let over_tls = match &target {
        None => None,
        Some(RedisTarget::Single(url)) => Some(url.starts_with("rediss://")),
        Some(RedisTarget::Cluster(nodes)) => {
            let span = inner
                .cluster
                .as_ref()
                .map(Spanned::span)
                .unwrap_or_default();
            Some(all_over_tls(
                compiler,
                file,
                (nodes, span),
                "some cluster nodes are rediss:// (TLS) and some are not",
                "a cluster's nodes all speak TLS or none does: write every URL the same way",
            ))
        }
        Some(RedisTarget::Sentinel(sentinel)) => Some(sentinel.tls),
    };
    let tls = compile_redis_tls(compiler, file, inner, over_tls);
    Some(RedisSettings {
        tls,
        admit_ahead_above,
        target: target?,
        timeout,
        failures_to_open,
        cooldown,
        key_prefix: inner.key_prefix.as_ref().map_or_else(
            || super::policy::DEFAULT_KEY_PREFIX.to_string(),
            |prefix| prefix.get_ref().clone(),
        ),
        instances,
    })
}

/// Whether `urls` speak TLS (`rediss://`): all of them or none, a mix being an error (`mixed`,
/// with `hint`) at their span.
fn all_over_tls(
    compiler: &mut Compiler<'_>,
    file: usize,
    (urls, span): (&[String], Range<usize>),
    mixed: &str,
    hint: &str,
) -> bool {
    let over_tls = urls
        .iter()
        .filter(|url| url.starts_with("rediss://"))
        .count();
    if over_tls > 0 && over_tls < urls.len() {
        compiler.error_hint(file, span, mixed, hint);
    }
    over_tls > 0
}

/// `[redis.sentinel]`: every problem of the table is reported, and `None` comes back when
/// there was one.
fn compile_sentinel(
    compiler: &mut Compiler<'_>,
    file: usize,
    spec: &Spanned<SentinelSpec>,
) -> Option<SentinelTarget> {
    let inner = spec.get_ref();
    let errors_before = compiler.errors.len();
    let mut tls = false;
    let nodes = match &inner.nodes {
        Some(nodes) if !nodes.get_ref().is_empty() => {
            tls = all_over_tls(
                compiler,
                file,
                (nodes.get_ref(), nodes.span()),
                "some sentinels are rediss:// (TLS) and some are not",
                "the sentinels and their master all speak TLS or none does: write every URL the same way",
            );
            for node in nodes.get_ref() {
                if !node.starts_with("redis://") && !node.starts_with("rediss://") {
                    compiler.error_hint(
                        file,
                        nodes.span(),
                        format!(
                            "sentinel `{}` is not a redis:// or rediss:// URL",
                            crate::redis_store::redact_url(node)
                        ),
                        "write each sentinel as \"redis://host:26379\" (or rediss:// for TLS; unix sockets are not supported for sentinels)",
                    );
                } else if node.contains("#insecure") {
                    compiler.error_hint(
                        file,
                        nodes.span(),
                        format!(
                            "sentinel `{}` asks for TLS without checking certificates",
                            crate::redis_store::redact_url(node)
                        ),
                        "remove #insecure: the sentinels name the master, so they are checked like it; give their CA with ca_file",
                    );
                } else if redis::Client::open(node.as_str())
                    .is_ok_and(|client| client.get_connection_info().redis_settings().db() != 0)
                {
                    compiler.error_hint(
                        file,
                        nodes.span(),
                        format!(
                            "sentinel `{}` names a database",
                            crate::redis_store::redact_url(node)
                        ),
                        "a sentinel has no databases: write \"redis://host:26379\", and the master's database as db = N",
                    );
                } else {
                    let _ = check_redis_url(compiler, file, node, nodes.span());
                }
            }
            nodes.get_ref().clone()
        }
        _ => {
            let span = inner.nodes.as_ref().map_or(spec.span(), Spanned::span);
            compiler.error_hint(
                file,
                span,
                "[redis.sentinel] needs nodes",
                "nodes = [\"redis://10.0.0.5:26379\", \"redis://10.0.0.6:26379\", \"redis://10.0.0.7:26379\"]",
            );
            Vec::new()
        }
    };
    let master = match &inner.master {
        Some(master) if !master.get_ref().trim().is_empty() => master.get_ref().clone(),
        _ => {
            let span = inner.master.as_ref().map_or(spec.span(), Spanned::span);
            compiler.error_hint(
                file,
                span,
                "[redis.sentinel] needs master",
                "the name the sentinels monitor it under (`sentinel monitor <name> …`), e.g. master = \"mymaster\"",
            );
            String::new()
        }
    };
    let db = match &inner.db {
        Some(db) if *db.get_ref() < 0 => {
            compiler.error(file, db.span(), "db must be 0 or more");
            0
        }
        Some(db) => *db.get_ref(),
        None => 0,
    };
    if let (Some(username), None) = (&inner.username, &inner.password) {
        compiler.error_hint(
            file,
            username.span(),
            "username without password",
            "an ACL user logs in with both: add password = \"…\"",
        );
    }
    (compiler.errors.len() == errors_before).then(|| SentinelTarget {
        nodes,
        master,
        username: inner.username.as_ref().map(|name| name.get_ref().clone()),
        password: inner.password.as_ref().map(|word| word.get_ref().clone()),
        db,
        tls,
    })
}

/// `[redis] ca_file`, `cert_file` and `key_file`, read and checked now: a reload that names a
/// missing or broken file is refused with its line, and a changed file reconnects. `over_tls`:
/// whether the target is `rediss://` (`None` when the target itself is wrong).
fn compile_redis_tls(
    compiler: &mut Compiler<'_>,
    file: usize,
    inner: &RedisSpec,
    over_tls: Option<bool>,
) -> Option<RedisTls> {
    use rustls_pki_types::pem::PemObject;
    use rustls_pki_types::{CertificateDer, PrivateKeyDer};
    let named = [&inner.ca_file, &inner.cert_file, &inner.key_file];
    if over_tls == Some(false) {
        if let Some(first) = named.into_iter().flatten().next() {
            compiler.error_hint(
                file,
                first.span(),
                "ca_file, cert_file and key_file are for Redis over TLS",
                "write the Redis URL as rediss://host:port (TLS), or remove these keys",
            );
        }
        return None;
    }
    let read = |compiler: &mut Compiler<'_>,
                value: &Option<Spanned<String>>,
                what: &str,
                check: &dyn Fn(&[u8]) -> Result<(), String>|
     -> Option<Vec<u8>> {
        let value = value.as_ref()?;
        let path = compiler.path_from(file, value.get_ref());
        let checked = std::fs::read(&path)
            .map_err(|error| format!("cannot read {what} {}: {error}", path.display()))
            .and_then(|pem| {
                check(&pem)
                    .map(|()| pem)
                    .map_err(|error| format!("{what} {}: {error}", path.display()))
            });
        match checked {
            Ok(pem) => Some(pem),
            Err(message) => {
                compiler.error_hint(file, value.span(), message, "a PEM file");
                None
            }
        }
    };
    let certificates = |pem: &[u8]| ca_certificates(pem).map(|_| ());
    let key = |pem: &[u8]| -> Result<(), String> {
        PrivateKeyDer::from_pem_slice(pem)
            .map(|_| ())
            .map_err(|error| format!("holds no private key: {error}"))
    };
    // A client certificate must be X.509 version 3: TLS refuses version 1 (no extensions),
    // which `openssl x509 -req` makes unless given extensions.
    let client_certificates = |pem: &[u8]| -> Result<(), String> {
        certificates(pem)?;
        match CertificateDer::pem_slice_iter(pem).next() {
            Some(Ok(first)) if !has_x509_version(&first) => Err(
                "is an X.509 version 1 certificate, which TLS refuses; sign it with extensions \
                 (version 3), e.g. openssl x509 -req … -extfile with extendedKeyUsage=clientAuth"
                    .into(),
            ),
            _ => Ok(()),
        }
    };
    let ca = read(compiler, &inner.ca_file, "CA file", &certificates);
    let client_cert = read(
        compiler,
        &inner.cert_file,
        "certificate file",
        &client_certificates,
    );
    let client_key = read(compiler, &inner.key_file, "key file", &key);
    let client = match (&inner.cert_file, &inner.key_file) {
        (Some(_), None) | (None, Some(_)) => {
            let span = inner
                .cert_file
                .as_ref()
                .or(inner.key_file.as_ref())
                .map(Spanned::span)
                .unwrap_or_default();
            compiler.error_hint(
                file,
                span,
                "cert_file and key_file go together",
                "a client certificate needs its key, for a Redis that checks its clients (tls-auth-clients)",
            );
            None
        }
        _ => client_cert.zip(client_key),
    };
    let tls = (ca.is_some() || client.is_some()).then_some(RedisTls { ca, client })?;
    // Made as the connections will make it: a certificate and a key that do not belong
    // together read well apart, and failed only when levee connected.
    if let (Err(error), Some(cert_file)) = (
        crate::redis_store::rustls_config(Some(&tls)),
        &inner.cert_file,
    ) {
        if tls.client.is_some() && error.starts_with("cert_file and key_file") {
            compiler.error_hint(
                file,
                cert_file.span(),
                error,
                "key_file must hold the key of cert_file's certificate",
            );
            return None;
        }
    }
    Some(tls)
}

/// True when a DER certificate carries a version field (v2 or v3; only v1 leaves it out): the
/// first element of its TBSCertificate is then the context tag `[0]`.
fn has_x509_version(der: &[u8]) -> bool {
    // Where the content of the DER element at `at` starts, if it is a SEQUENCE.
    fn sequence_content(der: &[u8], at: usize) -> Option<usize> {
        if *der.get(at)? != 0x30 {
            return None;
        }
        let first = *der.get(at + 1)?;
        let length_bytes = if first & 0x80 == 0 {
            0
        } else {
            usize::from(first & 0x7f)
        };
        Some(at + 2 + length_bytes)
    }
    sequence_content(der, 0)
        .and_then(|tbs| sequence_content(der, tbs))
        .and_then(|fields| der.get(fields))
        == Some(&0xa0)
}

/// The Redis client `url` makes, for the checks that follow; `None` (said as an error) when it
/// makes none.
fn check_redis_url(
    compiler: &mut Compiler<'_>,
    file: usize,
    url: &str,
    span: Range<usize>,
) -> Option<redis::Client> {
    match redis::Client::open(url) {
        Ok(client) => Some(client),
        Err(error) => {
            compiler.error_hint(
                file,
                span,
                format!(
                    "`{}` is not a Redis URL: {error}",
                    crate::redis_store::redact_url(url)
                ),
                address_hint(url, "redis://127.0.0.1:6379/0"),
            );
            None
        }
    }
}

/// `rediss://…#insecure` (no check of Redis's certificate): levee is built without the Redis
/// client's insecure TLS, so such a URL passed `levee check` and then every call failed.
/// Refused, as for sentinels: a certificate levee cannot check is given with `ca_file`.
fn check_certificate_checked(
    compiler: &mut Compiler<'_>,
    file: usize,
    url: &str,
    client: &redis::Client,
    span: Range<usize>,
) {
    if let redis::ConnectionAddr::TcpTls { insecure: true, .. } =
        client.get_connection_info().addr()
    {
        compiler.error_hint(
            file,
            span,
            format!(
                "`{}` asks for TLS without checking Redis's certificate, which levee does not do",
                crate::redis_store::redact_url(url)
            ),
            "remove #insecure; for a certificate your own CA signed, give that CA with ca_file",
        );
    }
}

/// A Redis Cluster is reached over TCP, and has database 0 alone: a node URL naming another
/// database would make every connection to that node fail on its `SELECT`, and a unix socket
/// every call (the cluster names its nodes by IP and port), long after `levee check` passed.
fn check_cluster_node(
    compiler: &mut Compiler<'_>,
    file: usize,
    url: &str,
    client: &redis::Client,
    span: Range<usize>,
) {
    if let redis::ConnectionAddr::Unix(_) = client.get_connection_info().addr() {
        compiler.error_hint(
            file,
            span,
            format!(
                "cluster node `{}` is a unix socket",
                crate::redis_store::redact_url(url)
            ),
            "a Redis Cluster names its nodes by address and port: list them as \"redis://host:port\"",
        );
        return;
    }
    let database = client.get_connection_info().redis_settings().db();
    if database != 0 {
        compiler.error_hint(
            file,
            span,
            format!(
                "cluster node `{}` names database {database}",
                crate::redis_store::redact_url(url)
            ),
            "a Redis Cluster has database 0 only: end the URL with /0 or with the port",
        );
    }
}

fn compile_sources(
    compiler: &mut Compiler<'_>,
    file: usize,
    value: &Option<Spanned<OneOrMany>>,
) -> Vec<Source> {
    let Some(value) = value else {
        return Vec::new();
    };
    let mut sources = Vec::new();
    for text in value.get_ref().clone().into_vec() {
        match Source::parse(&text) {
            Ok(source) => sources.push(source),
            Err(message) => compiler.error_hint(
                file,
                value.span(),
                message,
                "write \"header:X-User-Id\", \"cookie:uid\" or \"query:api_key\"",
            ),
        }
    }
    sources
}

/// A `stale` route's `vary`. A cookie named with a `*` is read by that very name, which no
/// application gives a cookie: an operator who writes `cookie:wordpress_logged_in_*` means
/// every such cookie, and without a word would keep a logged-in page for everyone.
fn compile_copy_vary(
    compiler: &mut Compiler<'_>,
    file: usize,
    value: &Option<Spanned<OneOrMany>>,
) -> Vec<Source> {
    let sources = compile_sources(compiler, file, value);
    for source in &sources {
        if let (Source::Cookie(name), Some(value)) = (source, value) {
            if !name.contains('*') && (name.ends_with('_') || name.ends_with('-')) {
                compiler.warning_hint(
                    file,
                    value.span(),
                    format!("vary reads the cookie named `{name}` exactly, which looks like the start of a name"),
                    format!("to keep requests with any cookie whose name starts so out of copies, list it in private_cookies: private_cookies = [\"{name}*\"]"),
                );
            }
            if name.contains('*') {
                compiler.warning_hint(
                    file,
                    value.span(),
                    format!("vary reads the cookie named `{name}` exactly, `*` included"),
                    format!("to keep requests with any cookie of that prefix out of copies, list it in private_cookies: private_cookies = [\"{name}\"]"),
                );
            }
        }
    }
    sources
}

/// A `stale` route's `private_cookies`: names, or prefixes ending in `*`, added to the
/// built-in ones unless `builtin` is false. Added, not in their place: a list that named one
/// login cookie dropped WordPress's commenter cookies, and a commenter's email was every
/// visitor's page again.
fn compile_private_cookies(
    compiler: &mut Compiler<'_>,
    file: usize,
    value: &Option<Spanned<OneOrMany>>,
    builtin: bool,
) -> Vec<crate::limit::key::CookieName> {
    let mut names: Vec<crate::limit::key::CookieName> = if builtin {
        crate::degrade::DEFAULT_PRIVATE_COOKIES
            .iter()
            .filter_map(|name| crate::limit::key::CookieName::parse(name).ok())
            .collect()
    } else {
        Vec::new()
    };
    let Some(value) = value else {
        return names;
    };
    for text in value.get_ref().clone().into_vec() {
        if !text.ends_with('*') && (text.ends_with('_') || text.ends_with('-')) {
            compiler.warning_hint(
                file,
                value.span(),
                format!("private_cookies names the cookie `{text}` exactly, which looks like the start of a name"),
                format!("for every cookie whose name starts so, end it with *: \"{text}*\""),
            );
        }
        match crate::limit::key::CookieName::parse(&text) {
            Ok(name) => names.push(name),
            Err(message) => compiler.error_hint(
                file,
                value.span(),
                message,
                "write a cookie's name (\"PHPSESSID\") or a prefix ending in * (\"wordpress_logged_in_*\"); [] for none",
            ),
        }
    }
    names
}

fn compile_identity(compiler: &mut Compiler<'_>, file: usize, spec: &IdentitySpec) -> Identity {
    Identity {
        user: compile_sources(compiler, file, &spec.user),
        api_key: compile_sources(compiler, file, &spec.api_key),
    }
}

fn compile_limit(
    compiler: &mut Compiler<'_>,
    file: usize,
    name: &str,
    spec: &Spanned<LimitSpec>,
    identity: &Identity,
) -> Option<LimitRule> {
    let inner = spec.get_ref();
    let mut parts = Vec::new();
    match &inner.key {
        None => compiler.error_hint(file, spec.span(), format!("limit `{name}` has no key"), "add key = [\"ip\"] (or user, api_key, route, method, header:NAME, cookie:NAME, query:NAME)"),
        Some(key) => {
            for text in key.get_ref().clone().into_vec() {
                match KeyPart::parse(&text) {
                    // An `[identity]` that did not read (already reported) may have it.
                    Ok(KeyPart::User | KeyPart::ApiKey) if compiler.unread.may_hold("identity") => {}
                    Ok(KeyPart::User) if identity.user.is_empty() => compiler.error_hint(file, key.span(), "key part `user` needs [identity] user", "add [identity] user = [\"header:X-User-Id\"] (a header your front nginx or app sets), or a cookie"),
                    Ok(KeyPart::ApiKey) if identity.api_key.is_empty() => compiler.error_hint(file, key.span(), "key part `api_key` needs [identity] api_key", "add [identity] api_key = [\"header:X-Api-Key\", \"query:api_key\"]"),
                    Ok(part) => parts.push(part),
                    Err(message) => compiler.error(file, key.span(), message).hint = None,
                }
            }
        }
    }
    // Without a usable rate the rule is not built, but its other keys are still checked, so
    // every error of the rule is reported at once.
    let rate = match &inner.rate {
        None => {
            compiler.error_hint(
                file,
                spec.span(),
                format!("limit `{name}` has no rate"),
                "add rate = \"3/min\" (or N/s, N/h; fractions like \"0.05/s\" work)",
            );
            None
        }
        Some(rate) => match parse_rate(rate.get_ref()) {
            Ok(parsed) => Some(parsed),
            Err(message) => {
                compiler.error_hint(
                    file,
                    rate.span(),
                    message,
                    "write requests per s, min, h or day, like \"10/s\", \"3/min\" or \"2/day\"; from 0.0087/day up to 1000000/s",
                );
                None
            }
        },
    };
    let (per_second, interval_us) = rate.unwrap_or((1.0, 1_000_000));
    let burst = match &inner.burst {
        Some(burst) if *burst.get_ref() == 0 => {
            compiler.error_hint(
                file,
                burst.span(),
                "burst must be at least 1",
                "burst is how many requests may come at once before the rate applies",
            );
            1
        }
        Some(burst) => *burst.get_ref(),
        // One second's worth of requests, at least one.
        None => per_second.round().max(1.0) as u32,
    };
    let missing_uses_ip = match inner
        .missing
        .as_ref()
        .map(|m| (m.get_ref().as_str(), m.span()))
    {
        None | Some(("skip", _)) => false,
        Some(("ip", _)) => true,
        Some((other, span)) => {
            compiler.error_hint(
                file,
                span,
                format!("missing = `{other}` is not known"),
                "use \"skip\" (the rule does not apply) or \"ip\" (key by client IP instead)",
            );
            false
        }
    };
    let on_redis_error = match inner
        .on_redis_error
        .as_ref()
        .map(|m| (m.get_ref().as_str(), m.span()))
    {
        None | Some(("local", _)) => OnRedisError::Local,
        Some(("allow", _)) => OnRedisError::Allow,
        Some(("deny", _)) => OnRedisError::Deny,
        Some((other, span)) => {
            compiler.error_hint(
                file,
                span,
                format!("on_redis_error = `{other}` is not known"),
                "use \"local\", \"allow\" or \"deny\"",
            );
            OnRedisError::Local
        }
    };
    let status = match &inner.status {
        None => http::StatusCode::TOO_MANY_REQUESTS,
        Some(status) if refused_as_nginx_only(compiler, file, status) => {
            http::StatusCode::TOO_MANY_REQUESTS
        }
        Some(status) => match http::StatusCode::from_u16(*status.get_ref()) {
            Ok(code) if code.is_client_error() || code.is_server_error() => code,
            _ => {
                compiler.error_hint(
                    file,
                    status.span(),
                    format!("status {} is not an error status", status.get_ref()),
                    "use 429 (or another 4xx/5xx)",
                );
                http::StatusCode::TOO_MANY_REQUESTS
            }
        },
    };
    let ipv6_prefix = match &inner.ipv6_prefix {
        Some(bits) if !(32..=128).contains(bits.get_ref()) => {
            compiler.error_hint(
                file,
                bits.span(),
                format!("ipv6_prefix must be from 32 to 128, not {}", bits.get_ref()),
                "the IPv6 network one client is: 64 (a device's own), 56 or 48 (a home line's)",
            );
            crate::limit::key::DEFAULT_IPV6_PREFIX
        }
        Some(bits) => {
            if !parts.contains(&KeyPart::Ip) && !missing_uses_ip {
                compiler.warning_hint(
                    file,
                    bits.span(),
                    format!("ipv6_prefix of limit `{name}` does nothing: its key has no `ip`, and missing is not \"ip\""),
                    "remove it, or add \"ip\" to the key",
                );
            }
            u8::try_from(*bits.get_ref()).unwrap_or(crate::limit::key::DEFAULT_IPV6_PREFIX)
        }
        None => crate::limit::key::DEFAULT_IPV6_PREFIX,
    };
    rate?;
    Some(LimitRule {
        name: Arc::from(name),
        parts,
        rate: Rate { interval_us, burst },
        rate_text: inner
            .rate
            .as_ref()
            .map(|r| r.get_ref().clone())
            .unwrap_or_default(),
        missing_uses_ip,
        ipv6_prefix,
        dry_run: inner.dry_run.unwrap_or(false),
        on_redis_error,
        headers: inner.headers.unwrap_or(true),
        headers_on_allow: inner.headers_on_allow.unwrap_or(false),
        status,
        body_html: inner.body_html.as_deref().map(Arc::from),
        body_json: inner.body_json.as_deref().map(Arc::from),
        series: Default::default(),
        redis: crate::redis_batch::RedisRule::new(
            interval_us,
            burst,
            inner.dry_run.unwrap_or(false),
        ),
    })
}

/// A module comes to be by being named, so a typo (`rankng`) would silently make a second
/// module that the dashboard lists and nobody switches off. A name that is not declared but is
/// a letter or two from a declared one is warned of as a likely typo; declaring it
/// (`[module.NAME]`) says it is meant. A warning, not an error: names a letter apart can be
/// meant, and a policy that loaded before must still load.
fn check_module_name(
    compiler: &mut Compiler<'_>,
    file: usize,
    name: &str,
    span: Range<usize>,
    context: &RouteContext<'_>,
) {
    compiler.check_name("module", name, file, span.clone());
    if context.module_specs.contains_key(name) {
        return;
    }
    // Short names are often one letter apart by design (`ads`/`abs`, `cart`/`card`): one
    // letter counts from 6 letters on, two from 10.
    let shortest = |declared: &str| name.chars().count().min(declared.chars().count());
    let is_near = |other: &&String| {
        let distance = edit_distance(name, other);
        let allowed = match shortest(other) {
            0..=5 => 0,
            6..=9 => 1,
            _ => 2,
        };
        (1..=allowed).contains(&distance)
    };
    let near = context.module_specs.keys().find(is_near);
    if let Some(declared) = near {
        let header = if name
            .chars()
            .all(|c| c.is_ascii_alphanumeric() || c == '-' || c == '_')
        {
            format!("[module.{name}]")
        } else {
            format!("[module.{name:?}]")
        };
        compiler.warning_hint(
            file,
            span,
            format!("module `{name}` is not declared, and `{declared}` is: a typo makes a module of its own"),
            format!("write `{declared}`; if `{name}` is meant as a module of its own, declare it with {header}"),
        );
    } else if let Some(other) = context
        .named_modules
        .iter()
        .filter(|other| !context.module_specs.contains_key(other.as_str()))
        .find(is_near)
    {
        // Neither is declared: both are named by routes only.
        compiler.warning_hint(
            file,
            span,
            format!("module `{name}` is a letter or two from module `{other}`, named by another route: a typo makes a module of its own, which switching `{other}` off does not touch"),
            "write the same name in both places; declare each with [module.NAME] if both are meant",
        );
    }
}

/// The known key a misspelt one most likely means: one within two edits, else the one that
/// alone shares its first six letters or more (`max_inflite` is three edits from
/// `max_inflight`, whose first nine letters it has, and no other key's).
fn closest_key<'a>(written: &str, known: &[&'a str]) -> Option<&'a str> {
    let near = known
        .iter()
        .map(|candidate| (edit_distance(written, candidate), *candidate))
        .filter(|(distance, _)| *distance <= 2)
        .min_by_key(|(distance, _)| *distance);
    if let Some((_, candidate)) = near {
        return Some(candidate);
    }
    let shared = |candidate: &str| {
        written
            .bytes()
            .zip(candidate.bytes())
            .take_while(|(a, b)| a == b)
            .count()
    };
    let mut by_prefix: Vec<(usize, &str)> = known
        .iter()
        .map(|candidate| (shared(candidate), *candidate))
        .filter(|(prefix, candidate)| *prefix >= 6 && edit_distance(written, candidate) <= 4)
        .collect();
    by_prefix.sort_by_key(|(prefix, _)| std::cmp::Reverse(*prefix));
    match by_prefix.as_slice() {
        [(_, candidate)] => Some(candidate),
        [(best, candidate), (next, _), ..] if best > next => Some(candidate),
        _ => None,
    }
}

/// Levenshtein distance in characters: the fewest insertions, deletions and substitutions
/// that turn one name into the other.
pub(super) fn edit_distance(a: &str, b: &str) -> usize {
    let b: Vec<char> = b.chars().collect();
    let mut previous: Vec<usize> = (0..=b.len()).collect();
    for (i, a_char) in a.chars().enumerate() {
        let mut current = Vec::with_capacity(b.len() + 1);
        current.push(i + 1);
        for (j, b_char) in b.iter().enumerate() {
            let substitution = previous[j] + usize::from(a_char != *b_char);
            current.push(substitution.min(previous[j + 1] + 1).min(current[j] + 1));
        }
        previous = current;
    }
    previous[b.len()]
}

fn known_names<T>(what: &str, map: &BTreeMap<String, T>) -> String {
    if map.is_empty() {
        format!("none (add a [{what}.NAME] section)")
    } else {
        map.keys()
            .map(|name| format!("`{name}`"))
            .collect::<Vec<_>>()
            .join(", ")
    }
}

/// A route without `host` whose upstream's other routes all name hosts belongs, as a rule,
/// to that one site, and was written without its `host` by mistake: with one file per site,
/// `path_prefix = "/feed"` in the blog's file took `/feed` on every site (and past their
/// limits) before their own routes. Warned of when a route of another site comes after it,
/// or another upstream takes the hosts no route names (a host-less route after it, or the
/// default upstream): the site that catches every other host loses those paths too.
fn warn_of_routes_for_every_site(
    compiler: &mut Compiler<'_>,
    routes: &[Arc<Route>],
    route_names: &BTreeMap<String, (usize, Range<usize>)>,
    default_upstream: Option<&str>,
) {
    let ends_in_catch_all = routes
        .last()
        .is_some_and(|last| matches_every_request(last));
    for (at, route) in routes.iter().enumerate() {
        if !route.hosts.is_empty() || matches_every_request(route) {
            continue;
        }
        let upstream = &route.upstream.name;
        let others: Vec<&Arc<Route>> = routes
            .iter()
            .filter(|other| other.upstream.name == *upstream && other.name != route.name)
            .collect();
        if others.is_empty() || others.iter().any(|other| other.hosts.is_empty()) {
            continue;
        }
        let sites: std::collections::BTreeSet<String> = others
            .iter()
            .flat_map(|other| other.hosts.iter().map(HostMatch::pattern))
            .collect();
        let taken_from: std::collections::BTreeSet<String> = routes[at + 1..]
            .iter()
            .filter(|later| later.upstream.name != *upstream)
            .flat_map(|later| later.hosts.iter().map(HostMatch::pattern))
            .filter(|host| !sites.contains(host))
            .collect();
        let catch_all = routes[at + 1..]
            .iter()
            .find(|later| later.upstream.name != *upstream && later.hosts.is_empty())
            .map(|later| format!("those route `{}` serves", later.name))
            .or_else(|| {
                default_upstream
                    .filter(|default| !ends_in_catch_all && *default != &**upstream)
                    .map(|default| format!("those default upstream `{default}` serves"))
            });
        let included = match (taken_from.is_empty(), catch_all) {
            (false, _) => list_of(&taken_from),
            (true, Some(catch_all)) => catch_all,
            (true, None) => continue,
        };
        let Some((file, span)) = route_names.get(&*route.name.0) else {
            continue;
        };
        compiler.warning_hint(
            *file,
            span.clone(),
            format!(
                "route `{}` has no host, while every other route to upstream `{upstream}` names one ({}): it takes its paths on every site, {included} included",
                route.name,
                list_of(&sites),
            ),
            format!("give it the host of its site: host = [\"{}\"]", sites.iter().next().map_or("", String::as_str)),
        );
    }
}

/// The `xn--` form of a host written with international characters (`*.` kept), as clients
/// send it; `None` for a host that is ASCII already or is no valid name.
fn international_host(host: &str) -> Option<String> {
    if host.is_ascii() {
        return None;
    }
    let (wildcard, name) = match host.strip_prefix("*.") {
        Some(name) => ("*.", name),
        None => ("", host),
    };
    let ascii = idna::domain_to_ascii(name).ok()?;
    (!ascii.is_empty()).then(|| format!("{wildcard}{ascii}"))
}

/// Names joined by commas, in order.
fn list_of(names: &std::collections::BTreeSet<String>) -> String {
    names
        .iter()
        .map(String::as_str)
        .collect::<Vec<_>>()
        .join(", ")
}

/// An IP address or a CIDR range, as `trusted_proxies` and a route's `client` take them.
fn parse_network(text: &str) -> Option<IpNet> {
    text.parse::<IpNet>()
        .or_else(|_| text.parse::<std::net::IpAddr>().map(IpNet::from))
        .ok()
}

/// `[admin] origins`: the other sites whose pages may change state (see [`origin_list`]).
fn admin_origins(
    compiler: &mut Compiler<'_>,
    file: usize,
    spec: Option<&Spanned<Vec<String>>>,
) -> Vec<String> {
    origin_list(
        compiler,
        file,
        spec,
        None,
        "write it as the browser's address bar shows the site, scheme and host only: \"https://ops.example\" or \"http://10.0.0.5:8443\"",
    )
}

/// `[server] cors_origins`: the sites whose pages may read levee's own answers (see
/// [`origin_list`]), or `*` for any.
fn cors_origins(
    compiler: &mut Compiler<'_>,
    file: usize,
    spec: Option<&Spanned<Vec<String>>>,
) -> Vec<String> {
    origin_list(
        compiler,
        file,
        spec,
        Some(crate::proxy::cors::ANY_ORIGIN),
        "write it as the browser's address bar shows the site that calls the API, scheme and host only: \"https://app.example\" or \"http://10.0.0.5:8443\", or \"*\" for any site",
    )
}

/// A list of origins, each `scheme://host[:port]` as browsers send it in `Origin` (an
/// `http` or `https` scheme, a host, no path; one trailing `/` is forgiven), kept in lower
/// case; `any`, when given, is taken as it is written too. Anything else could never equal a
/// browser's `Origin`, and would leave the site it names without what it was listed for, with
/// no reason given: an error, with `hint`.
fn origin_list(
    compiler: &mut Compiler<'_>,
    file: usize,
    spec: Option<&Spanned<Vec<String>>>,
    any: Option<&str>,
    hint: &str,
) -> Vec<String> {
    let Some(spec) = spec else {
        return Vec::new();
    };
    let mut origins = Vec::new();
    for written in spec.get_ref() {
        if any == Some(written.as_str()) {
            origins.push(written.clone());
            continue;
        }
        let origin = written
            .strip_suffix('/')
            .unwrap_or(written)
            .to_ascii_lowercase();
        let host = origin
            .strip_prefix("https://")
            .or_else(|| origin.strip_prefix("http://"));
        let valid = host.is_some_and(|host| {
            !host.is_empty()
                && host.bytes().all(|byte| {
                    byte.is_ascii_alphanumeric() || matches!(byte, b'.' | b'-' | b':' | b'[' | b']')
                })
        });
        if valid {
            origins.push(origin);
        } else {
            compiler.error_hint(
                file,
                spec.span(),
                format!("{written:?} is not an origin"),
                hint,
            );
        }
    }
    origins
}

/// `answer_format` of `[server]` or of a route; `default` when it is not set (or not known,
/// which is an error).
fn answer_format(
    compiler: &mut Compiler<'_>,
    file: usize,
    value: Option<&Spanned<String>>,
    default: AnswerFormat,
) -> AnswerFormat {
    match value.map(|value| (value.get_ref().as_str(), value.span())) {
        None => default,
        Some(("by_accept", _)) => AnswerFormat::ByAccept,
        Some(("json", _)) => AnswerFormat::Json,
        Some(("html", _)) => AnswerFormat::Html,
        Some((other, span)) => {
            compiler.error_hint(
                file,
                span,
                format!("answer_format = `{other}` is not known"),
                "use \"by_accept\" (JSON when the client's Accept asks for it, else HTML), \"json\" or \"html\"",
            );
            default
        }
    }
}

fn compile_server(compiler: &mut Compiler<'_>, file: usize, spec: &ServerSpec) -> ServerSettings {
    let defaults = ServerSettings::default();
    let trusted_proxies = match &spec.trusted_proxies {
        None => defaults.trusted_proxies.clone(),
        Some(list) => {
            let mut nets = Vec::with_capacity(list.len());
            for entry in list {
                let text = entry.get_ref().trim();
                match parse_network(text) {
                    // Every address is trusted: any visitor chooses its own, for limits,
                    // `client` matches and the app's REMOTE_ADDR (`::/0` copied for IPv6's
                    // "any" is an easy slip).
                    Some(net) if net.prefix_len() == 0 => {
                        compiler.warning_hint(
                            file,
                            entry.span(),
                            format!("trusted_proxies `{text}` trusts every address: any client can set its own with X-Forwarded-For, for rate limits, routes' `client` and the app's REMOTE_ADDR"),
                            "list the front's own addresses only: \"127.0.0.1/32\", \"::1/128\"",
                        );
                        nets.push(net);
                    }
                    // An address copied with its interface's prefix (`ip addr` shows the
                    // front's `2001:db8::1/64`): every host of that network passes for it.
                    Some(net) if net.addr() != net.network() => {
                        compiler.warning_hint(
                            file,
                            entry.span(),
                            format!("trusted_proxies `{text}` trusts the whole network {}, not the one address", net.trunc()),
                            format!("for the front alone write \"{}\"", net.addr()),
                        );
                        nets.push(net);
                    }
                    Some(net) => nets.push(net),
                    None => compiler.error_hint(
                        file,
                        entry.span(),
                        format!("`{text}` is not an IP address or CIDR range"),
                        "write \"127.0.0.1/32\", \"10.0.0.0/8\" or \"::1/128\"",
                    ),
                }
            }
            TrustedProxies(nets)
        }
    };
    let max_header_bytes = compiler.size(
        file,
        &spec.max_header_bytes,
        defaults.max_header_bytes as u64,
    );
    let max_header_bytes = usize::try_from(max_header_bytes).unwrap_or(usize::MAX);
    if let Some(value) = &spec.max_header_bytes {
        if !(1024..=1024 * 1024).contains(&max_header_bytes) {
            compiler.error_hint(
                file,
                value.span(),
                "max_header_bytes must be between 1KiB and 1MiB",
                "the default, 32KiB (what nginx reads by default), suits almost every site",
            );
        }
    }
    let mut path_setting = |value: &Option<Spanned<String>>, default: &str| -> String {
        match value {
            None => default.to_string(),
            // Answered by levee itself, never proxied: `/` would take the site's home page.
            Some(path) if path.get_ref() == "/" => {
                compiler.error_hint(
                    file,
                    path.span(),
                    "a health path of `/` would answer the site's home page itself",
                    "use a path no page has, like \"/livez\"",
                );
                default.to_string()
            }
            Some(path) if path.get_ref().starts_with('/') => path.get_ref().clone(),
            Some(path) => {
                compiler.error_hint(
                    file,
                    path.span(),
                    format!("`{}` is not a path", path.get_ref()),
                    "health paths start with '/', like \"/livez\"",
                );
                default.to_string()
            }
        }
    };
    let livez_path = path_setting(&spec.livez_path, &defaults.livez_path);
    let readyz_path = path_setting(&spec.readyz_path, &defaults.readyz_path);
    if livez_path == readyz_path {
        let span = spec
            .readyz_path
            .as_ref()
            .or(spec.livez_path.as_ref())
            .map_or(0..0, Spanned::span);
        compiler.error_hint(
            file,
            span,
            format!("livez_path and readyz_path are both `{livez_path}`"),
            "liveness (the process runs) and readiness (take traffic) need a path each",
        );
    }
    let max_connections = compiler.count_at_least_one(
        file,
        &spec.max_connections,
        defaults.max_connections,
        "max_connections",
        "the default, 10000, suits a site behind one front nginx; keep it under half of levee's open-file limit",
    );
    ServerSettings {
        listen: compiler.socket_addr(file, &spec.listen, defaults.listen),
        trusted_proxies,
        header_read_timeout: compiler.nonzero_duration(
            file,
            &spec.header_read_timeout,
            defaults.header_read_timeout,
            "header_read_timeout",
        ),
        max_header_bytes,
        max_body: compiler.size(file, &spec.max_body, defaults.max_body),
        client_body_timeout: compiler.nonzero_duration(
            file,
            &spec.client_body_timeout,
            defaults.client_body_timeout,
            "client_body_timeout",
        ),
        send_timeout: compiler.nonzero_duration(
            file,
            &spec.send_timeout,
            defaults.send_timeout,
            "send_timeout",
        ),
        tunnel_idle_timeout: compiler.nonzero_duration(
            file,
            &spec.tunnel_idle_timeout,
            defaults.tunnel_idle_timeout,
            "tunnel_idle_timeout",
        ),
        max_connections,
        max_connections_given: spec.max_connections.is_some(),
        drain: compiler.duration(file, &spec.drain, defaults.drain),
        shutdown_timeout: compiler.duration(
            file,
            &spec.shutdown_timeout,
            defaults.shutdown_timeout,
        ),
        livez_path,
        readyz_path,
        access_log: spec.access_log.unwrap_or(defaults.access_log),
        cors_origins: cors_origins(compiler, file, spec.cors_origins.as_ref()),
        answer_format: answer_format(
            compiler,
            file,
            spec.answer_format.as_ref(),
            defaults.answer_format,
        ),
    }
}

/// The scheme and authority of an upstream's `url`, checked.
fn upstream_address(
    compiler: &mut Compiler<'_>,
    file: usize,
    name: &str,
    spec: &Spanned<UpstreamSpec>,
) -> Option<(Scheme, Authority)> {
    let inner = spec.get_ref();
    let Some(url) = &inner.url else {
        compiler.error_hint(
            file,
            spec.span(),
            format!("upstream `{name}` has no url"),
            "add url = \"http://127.0.0.1:8081\"",
        );
        return None;
    };
    let uri: http::Uri = match url.get_ref().parse() {
        Ok(uri) => uri,
        Err(error) => {
            let example = if url.get_ref().starts_with("fastcgi:") {
                "fastcgi://127.0.0.1:9000"
            } else {
                "http://127.0.0.1:8081"
            };
            compiler.error_hint(
                file,
                url.span(),
                format!("`{}` is not a URL: {error}", url.get_ref()),
                address_hint(url.get_ref(), example),
            );
            return None;
        }
    };
    let (Some(scheme), Some(authority)) = (uri.scheme().cloned(), uri.authority().cloned()) else {
        compiler.error_hint(
            file,
            url.span(),
            format!("`{}` needs a scheme and a host", url.get_ref()),
            "write it as \"http://127.0.0.1:8081\"",
        );
        return None;
    };
    if scheme != Scheme::HTTP && scheme != Scheme::HTTPS && scheme.as_str() != FASTCGI {
        compiler.error_hint(
            file,
            url.span(),
            format!("upstream scheme `{scheme}` is not supported"),
            "use an http:// or https:// URL, or fastcgi:// for php-fpm",
        );
        return None;
    }
    // `http::Uri` takes any text after the host's `:` as a port and then reports none, which
    // would send a mistyped port (`:80810`, `:8O81`) to the scheme's default: often the front
    // nginx itself, a loop.
    if let Some(port) = written_port(authority.as_str()) {
        if port.parse::<u16>().map_or(true, |port| port == 0) {
            compiler.error_hint(
                file,
                url.span(),
                format!("`{port}` in `{}` is not a port", url.get_ref()),
                "a port is a number from 1 to 65535, e.g. \"http://127.0.0.1:8081\"",
            );
            return None;
        }
    }
    if uri.path_and_query().is_some_and(|pq| pq.as_str() != "/") {
        compiler.error_hint(
            file,
            url.span(),
            "an upstream URL cannot have a path or query",
            "levee forwards the client's own path; write only scheme, host and port",
        );
        return None;
    }
    Some((scheme, authority))
}

/// The port text of an authority as written (after the host, `[…]` for IPv6), if it has a `:`.
fn written_port(authority: &str) -> Option<&str> {
    let host_and_port = authority
        .rsplit_once('@')
        .map_or(authority, |(_, rest)| rest);
    let after_host = if host_and_port.starts_with('[') {
        &host_and_port[host_and_port
            .find(']')
            .map_or(host_and_port.len(), |end| end + 1)..]
    } else {
        host_and_port
            .rfind(':')
            .map_or("", |colon| &host_and_port[colon..])
    };
    after_host.strip_prefix(':')
}

/// The scheme of upstreams spoken to in FastCGI (php-fpm).
const FASTCGI: &str = "fastcgi";

/// `fastcgi = { … }` of an upstream, checked against its scheme: required for `fastcgi://`,
/// meaningless for HTTP. `Err(())` when an error was reported.
fn compile_fastcgi(
    compiler: &mut Compiler<'_>,
    file: usize,
    name: &str,
    spec: &Spanned<UpstreamSpec>,
    scheme: Option<&Scheme>,
) -> Result<Option<Arc<FastCgiSettings>>, ()> {
    let inner = spec.get_ref();
    let speaks_fastcgi = scheme.map(|scheme| scheme.as_str() == FASTCGI);
    let table = match (&inner.fastcgi, speaks_fastcgi) {
        (None, Some(true)) => {
            let span = inner.url.as_ref().map_or(spec.span(), |url| url.span());
            compiler.error_hint(
                file,
                span,
                format!("upstream `{name}` speaks FastCGI but has no fastcgi = {{ root = … }}"),
                "add fastcgi = { root = \"/var/www/site\" }: the site's document root on php-fpm's machine",
            );
            return Err(());
        }
        (None, _) => return Ok(None),
        (Some(table), Some(false)) => {
            compiler.error_hint(
                file,
                table.span(),
                format!("`fastcgi` settings on upstream `{name}`, whose url is not fastcgi://"),
                "write url = \"fastcgi://127.0.0.1:9000\" to speak FastCGI to php-fpm, or remove them",
            );
            return Err(());
        }
        (Some(table), _) => table,
    };
    let settings = table.get_ref();
    let before = compiler.errors.len();
    let root = match &settings.root {
        None => {
            compiler.error_hint(
                file,
                table.span(),
                "fastcgi settings need a root",
                "root = \"/var/www/site\": the document root, as php-fpm's machine sees it",
            );
            String::new()
        }
        Some(root) if root.get_ref().contains('\0') => {
            compiler.error(file, root.span(), "root holds a NUL byte");
            String::new()
        }
        Some(root) if !root.get_ref().starts_with('/') => {
            compiler.error_hint(
                file,
                root.span(),
                format!("root `{}` is not an absolute path", root.get_ref()),
                "write the document root from /, as php-fpm's machine sees it (it may not be levee's)",
            );
            String::new()
        }
        // Far past any real path: every request would be refused as too long.
        Some(root) if root.get_ref().len() > 4096 => {
            compiler.error(file, root.span(), "root is over 4096 bytes");
            String::new()
        }
        Some(root) => {
            // A directory's own index (with a front controller) is run when levee sees the
            // file: say so when it cannot see the root at all.
            if settings.front_controller.is_some() && !Path::new(root.get_ref()).is_dir() {
                compiler.warning_hint(
                    file,
                    root.span(),
                    format!("levee cannot see root `{}` on this machine", root.get_ref()),
                    "every path ending in / then runs the front controller, never a directory's own index (a WordPress /wp-admin/); mount the site where levee runs too, or ignore this if no directory has its own index",
                );
            }
            root.get_ref().trim_end_matches('/').to_string()
        }
    };
    let index = match &settings.index {
        None => "index.php".to_string(),
        Some(index)
            if matches!(index.get_ref().as_str(), "" | "." | "..")
                || index.get_ref().contains(['/', '\0']) =>
        {
            compiler.error_hint(
                file,
                index.span(),
                format!("index `{}` is not a file name", index.get_ref()),
                "the script run for a path that ends in /, like \"index.php\"",
            );
            String::new()
        }
        Some(index) => index.get_ref().clone(),
    };
    let front_controller = match &settings.front_controller {
        None => None,
        Some(front)
            if front.get_ref().trim_matches('/').is_empty()
                || front.get_ref().contains('\0')
                || front.get_ref().split('/').any(|segment| segment == "..") =>
        {
            compiler.error_hint(
                file,
                front.span(),
                format!(
                    "front_controller `{}` does not name a script",
                    front.get_ref()
                ),
                "the script under root that runs every other path, like \"/index.php\"",
            );
            None
        }
        Some(front) => Some(format!("/{}", front.get_ref().trim_start_matches('/'))),
    };
    let mut params = Vec::new();
    if let Some(table) = &settings.params {
        for (param, value) in table.get_ref() {
            let well_formed = !param.is_empty()
                && param
                    .bytes()
                    .all(|byte| byte.is_ascii_graphic() && byte != b'=')
                && !value.contains('\0')
                // A pair must fit one FastCGI record, with room for levee's own.
                && param.len() + value.len() <= 16 * 1024;
            if well_formed {
                params.push((param.clone(), value.clone()));
            } else {
                compiler.error_hint(
                    file,
                    table.span(),
                    format!("`{param}` cannot be a FastCGI parameter with that value"),
                    "a name is printable ASCII without spaces or = (like APP_ENV); a value holds no NUL byte; both together at most 16 KiB",
                );
            }
        }
    }
    // nginx gave PHP its `server_name` here; levee has none of its own but the upstream's
    // `host`, so without it or a parameter the name is whatever `Host` each client sends.
    if inner.host.is_none() && !params.iter().any(|(param, _)| param == "SERVER_NAME") {
        compiler.warning_hint(
            file,
            table.span(),
            format!("upstream `{name}` gives PHP the Host each client sends as SERVER_NAME (nginx gave it its server_name)"),
            "an app that builds links from SERVER_NAME (a password-reset mail) would write a visitor's host into them: add params = { SERVER_NAME = \"www.example.com\" }, or ignore this if the app never reads it",
        );
    }
    // Levee's own machine, unlike root: request bodies over 1 MiB wait there while they are
    // read whole before php-fpm is asked.
    let temp_dir = match &settings.temp_dir {
        None => std::env::temp_dir(),
        Some(dir) if !Path::new(dir.get_ref()).is_absolute() => {
            compiler.error_hint(
                file,
                dir.span(),
                format!("temp_dir `{}` is not an absolute path", dir.get_ref()),
                "a directory on levee's machine, like \"/var/tmp/levee\"",
            );
            PathBuf::new()
        }
        Some(dir) if !Path::new(dir.get_ref()).is_dir() => {
            compiler.error_hint(
                file,
                dir.span(),
                format!("temp_dir `{}` is not a directory", dir.get_ref()),
                "make it (writable by levee's user), or leave temp_dir out for the system's temporary directory",
            );
            PathBuf::new()
        }
        Some(dir) => PathBuf::from(dir.get_ref()),
    };
    if compiler.errors.len() > before {
        return Err(());
    }
    Ok(Some(Arc::new(FastCgiSettings {
        root,
        index,
        front_controller,
        params,
        temp_dir,
    })))
}

/// The hint for a URL that did not parse: an IPv6 address written without its brackets
/// (`http://::1:8081`) is said so, with the URL as it should read; else `example`.
fn address_hint(url: &str, example: &str) -> String {
    let (scheme, rest) = url.split_once("://").unwrap_or(("http", url));
    let authority_end = rest.find(['/', '?']).unwrap_or(rest.len());
    let (authority, path) = rest.split_at(authority_end);
    // A password is not written back into the hint (the log keeps it): `***` in its place.
    let (userinfo, host_and_port) = match authority.rsplit_once('@') {
        Some((userinfo, host)) => match userinfo.split_once(':') {
            Some((user, _)) => (format!("{user}:***@"), host),
            None => (format!("{userinfo}@"), host),
        },
        None => (String::new(), authority),
    };
    if host_and_port.matches(':').count() < 2 || host_and_port.contains('[') {
        return format!("write it as \"{example}\"");
    }
    // The last group is the port when what is before it is an address without it.
    let host = match host_and_port.rsplit_once(':') {
        Some((address, port))
            if address.parse::<std::net::Ipv6Addr>().is_ok() && port.parse::<u16>().is_ok() =>
        {
            format!("[{address}]:{port}")
        }
        _ if host_and_port.parse::<std::net::Ipv6Addr>().is_ok() => format!("[{host_and_port}]"),
        _ => return format!("write it as \"{example}\""),
    };
    format!("an IPv6 address goes in brackets: \"{scheme}://{userinfo}{host}{path}\"")
}

fn compile_upstream(
    compiler: &mut Compiler<'_>,
    file: usize,
    name: &str,
    spec: &Spanned<UpstreamSpec>,
) -> Option<UpstreamSettings> {
    let inner = spec.get_ref();
    // A bad url still leaves the other keys checked, so every error is reported at once.
    let address = upstream_address(compiler, file, name, spec);
    let bulkhead = match &inner.max_inflight {
        None => {
            let without_bound = [
                (
                    "queue_wait",
                    inner.queue_wait.as_ref().map(|value| value.span()),
                ),
                (
                    "shed_reserve",
                    inner.shed_reserve.as_ref().map(|value| value.span()),
                ),
            ];
            for (key, span) in without_bound {
                if let Some(span) = span {
                    compiler.error_hint(
                        file,
                        span,
                        format!("`{key}` means nothing without max_inflight"),
                        "set max_inflight (near php-fpm's pm.max_children), or remove it",
                    );
                }
            }
            None
        }
        Some(max) if *max.get_ref() == 0 => {
            compiler.error_hint(
                file,
                max.span(),
                "max_inflight must be at least 1",
                "set it near php-fpm's pm.max_children, or leave it out for no bound",
            );
            None
        }
        Some(max) => {
            let reserve = match &inner.shed_reserve {
                None => 0.2,
                Some(value) if (0.0..0.5).contains(value.get_ref()) => *value.get_ref(),
                Some(value) => {
                    compiler.error_hint(file, value.span(), "shed_reserve must be at least 0 and below 0.5", "the share of max_inflight kept for tier 1 (and again for tier 2 over tier 3)");
                    0.2
                }
            };
            Some(BulkheadSettings {
                max_inflight: *max.get_ref(),
                reserve,
                max_wait: compiler.duration(file, &inner.queue_wait, Duration::from_millis(100)),
            })
        }
    };
    let mut ca_files = Vec::new();
    let mut ca_hasher = Sha256::new();
    if let Some(list) = &inner.ca_files {
        for name in list.get_ref() {
            let path = compiler.path_from(file, name.get_ref());
            match read_ca_file(&path) {
                Ok(certs) => {
                    for cert in &certs {
                        ca_hasher.update(cert.as_ref());
                    }
                    ca_files.push(path);
                }
                Err(message) => compiler.error_hint(
                    file,
                    name.span(),
                    message,
                    "a PEM file with one or more CA certificates",
                ),
            }
        }
    }
    let written_host = match &inner.host {
        None => None,
        Some(host) => match HeaderValue::from_str(host.get_ref()) {
            Ok(value) if !host.get_ref().is_empty() => Some(value),
            _ => {
                compiler.error(
                    file,
                    host.span(),
                    format!("`{}` is not a valid Host header value", host.get_ref()),
                );
                None
            }
        },
    };
    // A php-fpm child serves one connection until it closes: an idle pooled connection holds
    // a child that another levee instance (or any other client of the pool) then waits for.
    // So FastCGI connections are kept only when the operator says how many.
    let speaks_fastcgi = address
        .as_ref()
        .is_some_and(|(scheme, _)| scheme.as_str() == FASTCGI);
    let pool_max_idle = inner
        .pool_max_idle
        .as_ref()
        .map_or(if speaks_fastcgi { 0 } else { 256 }, |value| {
            *value.get_ref() as usize
        });
    let connect_timeout = compiler.nonzero_duration(
        file,
        &inner.connect_timeout,
        Duration::from_secs(2),
        "connect_timeout",
    );
    let response_timeout = compiler.nonzero_duration(
        file,
        &inner.response_timeout,
        Duration::from_secs(30),
        "response_timeout",
    );
    let idle_body_timeout = compiler.nonzero_duration(
        file,
        &inner.idle_body_timeout,
        Duration::from_secs(30),
        "idle_body_timeout",
    );
    let pool_idle_timeout =
        compiler.duration(file, &inner.pool_idle_timeout, Duration::from_secs(90));
    let fastcgi = compile_fastcgi(
        compiler,
        file,
        name,
        spec,
        address.as_ref().map(|(scheme, _)| scheme),
    );
    let socket = match &inner.socket {
        None => None,
        Some(path) if !path.get_ref().starts_with('/') => {
            compiler.error_hint(
                file,
                path.span(),
                format!("socket `{}` is not an absolute path", path.get_ref()),
                "the unix socket to connect to, like \"/run/php/php8.2-fpm.sock\"",
            );
            None
        }
        // The kernel's limit (sun_path): a longer path could never be connected to.
        Some(path) if path.get_ref().len() > 107 => {
            compiler.error_hint(
                file,
                path.span(),
                format!(
                    "socket path is {} bytes, over the 107 a unix socket's can be",
                    path.get_ref().len()
                ),
                "use a shorter path (a link to the socket's directory will do)",
            );
            None
        }
        Some(path)
            if address
                .as_ref()
                .is_some_and(|(scheme, _)| *scheme == Scheme::HTTPS) =>
        {
            compiler.error_hint(
                file,
                path.span(),
                "levee speaks no TLS over a unix socket",
                "use url = \"http://…\" with the socket (the traffic never leaves the machine), or an https:// url without one",
            );
            None
        }
        Some(path) => Some(std::path::PathBuf::from(path.get_ref())),
    };
    let (scheme, authority) = address?;
    if let (Some(list), false) = (&inner.ca_files, scheme == Scheme::HTTPS) {
        compiler.warning_hint(
            file,
            list.span(),
            "ca_files does nothing here: this upstream is not reached over TLS",
            "CA files are for an https:// upstream; remove them, or write the url with https://",
        );
    }
    let fastcgi = fastcgi.ok()?;
    let host = match written_host {
        // External APIs (https) are called by their own name; the app's Host means nothing
        // there. The name with its port when that is not 443 (RFC 9110 7.2): a vhost on
        // another port, or a request signature over the Host, would not know the bare name.
        None if scheme == Scheme::HTTPS => match authority.port_u16() {
            Some(port) if port != 443 => {
                HeaderValue::from_str(&format!("{}:{port}", authority.host())).ok()
            }
            _ => HeaderValue::from_str(authority.host()).ok(),
        },
        written => written,
    };
    Some(UpstreamSettings {
        scheme,
        authority,
        host,
        connect_timeout,
        response_timeout,
        idle_body_timeout,
        pool_idle_timeout,
        pool_max_idle,
        ca_digest: if ca_files.is_empty() {
            Vec::new()
        } else {
            ca_hasher.finalize().to_vec()
        },
        ca_files,
        bulkhead,
        socket,
        fastcgi,
    })
}

/// What routes may refer to.
struct RouteContext<'a> {
    server: &'a ServerSettings,
    upstreams: &'a BTreeMap<String, Arc<Upstream>>,
    upstream_specs: &'a BTreeMap<String, (usize, Spanned<UpstreamSpec>)>,
    default_upstream: Option<&'a str>,
    limits: &'a BTreeMap<String, Arc<LimitRule>>,
    limit_specs: &'a BTreeMap<String, (usize, Spanned<LimitSpec>)>,
    module_specs: &'a BTreeMap<String, (usize, Spanned<ModuleSpec>)>,
    /// Every module a route names, declared or not.
    named_modules: &'a BTreeSet<String>,
    /// Queues can be used (there is `[redis]`).
    queues: bool,
    /// `[redis]` is a Redis Cluster.
    cluster: bool,
    /// What bucket keys start with (`Policy::key_prefix`).
    key_prefix: &'a str,
}

fn compile_route(
    compiler: &mut Compiler<'_>,
    file: usize,
    spec: &Spanned<RouteSpec>,
    context: &RouteContext<'_>,
    names: &mut BTreeMap<String, (usize, Range<usize>)>,
) -> Option<Route> {
    let inner = spec.get_ref();
    let name = match &inner.name {
        None => {
            compiler.error_hint(
                file,
                spec.span(),
                "route has no name",
                "add name = \"...\"; names appear in logs, metrics and /status",
            );
            return None;
        }
        Some(name) => name,
    };
    if name.get_ref() == DEFAULT_ROUTE {
        compiler.error_hint(
            file,
            name.span(),
            "route name `default` is reserved",
            "it names the route of requests no route matches; pick another name",
        );
    } else {
        compiler.check_name("route", name.get_ref(), file, name.span());
    }
    if let Some((first_file, first_span)) = names.get(name.get_ref()) {
        let other = compiler.location(*first_file, first_span);
        compiler.error_hint(
            file,
            name.span(),
            format!("route `{}` is defined twice", name.get_ref()),
            format!("the first one is at {other}; route names must be unique"),
        );
    } else {
        names.insert(name.get_ref().clone(), (file, name.span()));
    }

    let matched = match &inner.matcher {
        None => Some((Vec::new(), Vec::new(), PathMatch::Any)),
        Some(matcher) => compile_match(compiler, file, matcher),
    };
    let clients = inner
        .matcher
        .as_ref()
        .and_then(|matcher| matcher.get_ref().client.as_ref())
        .map(|list| compile_clients(compiler, file, list))
        .unwrap_or_default();

    let upstream_name = match &inner.upstream {
        Some(upstream) => {
            if !context.upstream_specs.contains_key(upstream.get_ref()) {
                if !compiler.unread.may_define("upstream", upstream.get_ref()) {
                    let known = known_names("upstream", context.upstream_specs);
                    compiler.error_hint(
                        file,
                        upstream.span(),
                        format!("upstream `{}` is not defined", upstream.get_ref()),
                        format!("defined upstreams: {known}"),
                    );
                }
                None
            } else {
                Some(upstream.get_ref().as_str())
            }
        }
        None => match context.default_upstream {
            Some(name) => Some(name),
            // The default may be in a file that did not read whole.
            None if compiler.unread.any => None,
            None => {
                compiler.error_hint(
                    file,
                    spec.span(),
                    format!(
                        "route `{}` has no upstream and there is no default",
                        name.get_ref()
                    ),
                    "add upstream = \"NAME\", or set [server] default_upstream",
                );
                None
            }
        },
    };
    // The rest of the route is checked whatever became of its upstream, so every error of
    // the route is reported at once. A defined upstream that failed to compile has already
    // been reported.
    let mut limits = Vec::new();
    for name in inner.limits.iter().flatten() {
        match context.limits.get(name.get_ref()) {
            Some(rule) => limits.push(rule.clone()),
            // Defined but broken: already reported where it is defined (also in a file
            // that did not read whole).
            None if context.limit_specs.contains_key(name.get_ref())
                || compiler.unread.may_define("limit", name.get_ref()) => {}
            None => compiler.error_hint(
                file,
                name.span(),
                format!("limit `{}` is not defined", name.get_ref()),
                format!(
                    "defined limits: {}",
                    known_names("limit", context.limit_specs)
                ),
            ),
        }
    }
    let fallback = inner
        .fallback
        .as_ref()
        .and_then(|spec| compile_static_response(compiler, file, spec, 503))
        .map(Arc::new);
    let tier = match &inner.tier {
        None => 1,
        Some(tier) if (1..=3).contains(tier.get_ref()) => *tier.get_ref(),
        Some(tier) => {
            compiler.error_hint(
                file,
                tier.span(),
                format!("tier {} does not exist", tier.get_ref()),
                "1 = never degraded, 2 = may be delayed, 3 = may be switched off",
            );
            // Checked on as the tier that allows the most, so that a tier-1 rule (no module,
            // no `reject`) does not add an error the route does not have.
            3
        }
    };
    if let Some(module) = &inner.module {
        check_module_name(compiler, file, module.get_ref(), module.span(), context);
    }
    if let Some(hide_spec) = &inner.hide {
        for module in hide_spec.get_ref().keys() {
            check_module_name(compiler, file, module, hide_spec.span(), context);
        }
    }
    if tier == 1 {
        if let Some(module) = &inner.module {
            compiler.error_hint(file, module.span(), "a tier-1 route cannot belong to a module", "tier-1 routes (view, post, login) are never switched off; give the route tier = 2 or 3");
        }
    }
    let always_queue = inner
        .always_queue
        .as_ref()
        .is_some_and(|value| *value.get_ref());
    let degrade = inner.degrade.as_ref().and_then(|spec| {
        compile_route_degrade(compiler, file, spec, tier, context.queues, always_queue)
    });
    if let Some(spec) = &inner.degrade {
        refuse_keys_that_do_not_apply(compiler, file, spec, always_queue);
    }
    if let Some(value) = inner.always_queue.as_ref().filter(|value| *value.get_ref()) {
        if !context.queues {
            compiler.error_hint(
                file,
                value.span(),
                "always_queue needs [redis]",
                "queued work is stored in Redis Streams; add a [redis] section",
            );
        }
    }
    let queues = matches!(degrade, Some(DegradeAction::Queue)) || always_queue;
    // A queue's keys carry its route's name as their Cluster hash tag (`queue:{NAME}:jobs`);
    // a brace in it would end the tag early or empty it, and the stream and its dead letters
    // would land in different slots, where the scripts that move jobs between them fail.
    if queues && context.cluster && name.get_ref().contains(['{', '}']) {
        compiler.error_hint(
            file,
            name.span(),
            format!("queue route name {:?} has a brace", name.get_ref()),
            "in a Redis Cluster a queue's keys take the route's name as their hash tag; rename the route without `{` or `}`",
        );
    }
    let queue = if queues {
        let spec = inner.degrade.as_ref().map(|spec| spec.get_ref());
        Some(Arc::new(QueueAction {
            body_html: spec
                .and_then(|spec| spec.body_html.as_deref())
                .map(Arc::from),
            body_json: spec
                .and_then(|spec| spec.body_json.as_deref())
                .map(Arc::from),
        }))
    } else {
        None
    };
    let hide = inner
        .hide
        .as_ref()
        .map(|hide| {
            hide.get_ref()
                .iter()
                .map(|(module, selector)| (module.clone(), selector.clone()))
                .collect()
        })
        .unwrap_or_default();
    if let Some(hide_spec) = &inner.hide {
        // Pages of a route whose modules are all chosen by plain id are cut by the scanner.
        let scanned = hide_spec.get_ref().values().all(|selector| {
            selector != crate::degrade::hide::MARKER
                && crate::degrade::cut::IdSelector::parse(selector).is_some()
        });
        for (module, selector) in hide_spec.get_ref() {
            if selector != crate::degrade::hide::MARKER
                && (selector.trim().is_empty() || selector.parse::<lol_html::Selector>().is_err())
            {
                compiler.error_hint(file, hide_spec.span(), format!("`{selector}` (module `{module}`) is not a CSS selector levee can match"), "use an id, class, element or attribute selector: \"#ranking\", \".visitors\", \"[data-module=visitors]\"");
            } else if let Some(element) =
                crate::degrade::hide::element_left_in_place(selector, scanned)
            {
                compiler.warning_hint(file, hide_spec.span(), format!("`{selector}` (module `{module}`) selects <{element}> elements, which hide leaves in place: their end tag may be left out of a page, and removing one could remove the rest of it"), "select the element around it (a div or section), or use \"marker\"");
            }
        }
    }
    let upstream = context.upstreams.get(upstream_name?)?.clone();
    let (hosts, methods, path) = matched?;
    // An `https://` upstream behind a host route is how an egress route looks: reachable
    // through the front by anyone who sends its Host, unless it is the app's alone.
    if upstream.settings.scheme == http::uri::Scheme::HTTPS
        && !hosts.is_empty()
        && clients.is_empty()
    {
        compiler.warning_hint(
            file,
            name.span(),
            format!("route `{}` sends requests to an https:// upstream for any client that names its host: through the front nginx, visitors can too", name.get_ref()),
            "if it is an egress route for the PHP app, add client = [\"127.0.0.1/32\", \"::1/128\"] to its match",
        );
    }
    // What a queue route takes is stored in Redis until the app has it: without a limit one
    // client can fill Redis (a review queued 1.3 GB in five seconds), and a full Redis takes
    // no more jobs from anyone.
    if queue.is_some() && limits.is_empty() {
        compiler.warning_hint(
            file,
            name.span(),
            format!("route `{}` queues writes in Redis with no limit: one client can fill Redis with jobs, and a full Redis refuses everyone's", name.get_ref()),
            "give it a limit per client, like limits = [\"per_ip\"] with [limit.per_ip] key = \"ip\" rate = \"10/m\"",
        );
    }
    Some(Route {
        name: RouteName(Arc::from(name.get_ref().as_str())),
        hosts,
        methods,
        path,
        clients,
        upstream,
        max_body: compiler.size(file, &inner.max_body, context.server.max_body),
        fixed_keys: limits
            .iter()
            .map(|rule| {
                crate::limit::key::fixed_bucket_key(
                    context.key_prefix,
                    &rule.name,
                    &rule.parts,
                    name.get_ref(),
                )
            })
            .collect(),
        limits,
        fallback,
        tier,
        module: inner
            .module
            .as_ref()
            .map(|module| Arc::from(module.get_ref().as_str())),
        degrade,
        hide,
        hide_plans: Default::default(),
        queue,
        always_queue,
        answer_format: answer_format(
            compiler,
            file,
            inner.answer_format.as_ref(),
            context.server.answer_format,
        ),
        series: Default::default(),
    })
}

/// A route's `client` list: the addresses or CIDR ranges its requests must come from.
fn compile_clients(
    compiler: &mut Compiler<'_>,
    file: usize,
    list: &Spanned<OneOrMany>,
) -> Vec<IpNet> {
    let mut nets = Vec::new();
    for text in list.get_ref().clone().into_vec() {
        match parse_network(text.trim()) {
            Some(net) => nets.push(net),
            None => compiler.error_hint(
                file,
                list.span(),
                format!("client `{text}` is not an IP address or CIDR range"),
                "write \"127.0.0.1/32\", \"10.0.0.0/8\" or \"::1/128\"",
            ),
        }
    }
    nets
}

fn compile_match(
    compiler: &mut Compiler<'_>,
    file: usize,
    matcher: &Spanned<MatchSpec>,
) -> Option<(Vec<HostMatch>, Vec<Method>, PathMatch)> {
    let spec = matcher.get_ref();
    let mut hosts = Vec::new();
    if let Some(list) = &spec.host {
        for host in list.get_ref().clone().into_vec() {
            // Requests' hosts are matched without their port, and `*` stands for whole
            // labels: a pattern that could never match, or would match a stranger's domain
            // (`*example.com` and `evilexample.com`), is refused.
            let problem = if host.is_empty() || host == "." || host == "*." {
                Some("is empty")
            } else if host.starts_with('.') || host.contains("..") {
                Some("has an empty label (`..`, or a leading dot), which no request's host has")
            } else if !host.is_ascii() {
                Some("is not ASCII, and clients send an international name in its `xn--` form")
            } else if host
                .strip_prefix('[')
                .map_or(host.contains(':'), |v6| v6.contains("]:"))
            {
                Some("has a port, and hosts are matched without theirs")
            } else if host.starts_with('*') && !host.starts_with("*.") {
                Some("has a `*` that is not a whole label")
            } else if host.chars().skip(1).any(|c| c == '*') {
                Some("has a `*` after its start")
            } else {
                None
            };
            match problem {
                Some(problem) => compiler.error_hint(
                    file,
                    list.span(),
                    format!("host `{host}` {problem}"),
                    match international_host(&host) {
                        Some(ascii) => format!("write \"{ascii}\""),
                        None => "write \"example.com\", or \"*.example.com\" for its subdomains"
                            .to_string(),
                    },
                ),
                None => hosts.push(HostMatch::parse(&host)),
            }
        }
    }
    let mut methods = Vec::new();
    if let Some(list) = &spec.method {
        for method in list.get_ref().clone().into_vec() {
            match Method::from_bytes(method.to_ascii_uppercase().as_bytes()) {
                Ok(parsed) => {
                    // Any token is a method, so `GETT` is one no client sends: the route
                    // would match nothing by it. Warned of; WebDAV's and others' pass.
                    const KNOWN: [&str; 20] = [
                        "GET",
                        "HEAD",
                        "POST",
                        "PUT",
                        "DELETE",
                        "PATCH",
                        "OPTIONS",
                        "TRACE",
                        "CONNECT",
                        "PROPFIND",
                        "PROPPATCH",
                        "MKCOL",
                        "COPY",
                        "MOVE",
                        "LOCK",
                        "UNLOCK",
                        "REPORT",
                        "SEARCH",
                        "PURGE",
                        "QUERY",
                    ];
                    if !KNOWN.contains(&parsed.as_str()) {
                        compiler.warning_hint(
                            file,
                            list.span(),
                            format!("`{method}` is no method clients send"),
                            "write GET, POST, PUT, DELETE, PATCH… (a method of your own is kept as written)",
                        );
                    }
                    methods.push(parsed);
                }
                Err(_) => {
                    compiler.error(
                        file,
                        list.span(),
                        format!("`{method}` is not an HTTP method"),
                    );
                }
            }
        }
    }
    let given = [
        spec.path.is_some(),
        spec.path_prefix.is_some(),
        spec.path_regex.is_some(),
    ]
    .iter()
    .filter(|given| **given)
    .count();
    if given > 1 {
        compiler.error_hint(
            file,
            matcher.span(),
            "a route matches on at most one of path, path_prefix, path_regex",
            "split it into two routes, or use path_regex",
        );
        return None;
    }
    let path = if let Some(exact) = &spec.path {
        PathMatch::Exact(compile_literal_path(compiler, file, exact)?)
    } else if let Some(prefix) = &spec.path_prefix {
        PathMatch::Prefix(compile_literal_path(compiler, file, prefix)?)
    } else if let Some(pattern) = &spec.path_regex {
        match regex::Regex::new(pattern.get_ref()) {
            Ok(regex) => PathMatch::Regex(regex),
            Err(error) => {
                let first_line = error
                    .to_string()
                    .lines()
                    .last()
                    .unwrap_or("invalid")
                    .trim()
                    // The regex crate's own label: the diagnostic says `error:` once.
                    .trim_start_matches("error: ")
                    .to_string();
                compiler.error_hint(
                    file,
                    pattern.span(),
                    format!("invalid path_regex: {first_line}"),
                    "the regex is matched against the normalised path, e.g. \"^/user/[0-9]+$\"",
                );
                return None;
            }
        }
    } else {
        PathMatch::Any
    };
    Some((hosts, methods, path))
}

/// Route paths are normalised like request paths, so they match what the backend sees.
/// Characters a request can only send percent-encoded (beyond ASCII, spaces, controls) are
/// encoded first: `/论坛` matches the `/%E8%AE%BA%E5%9D%9B` browsers send.
fn compile_literal_path(
    compiler: &mut Compiler<'_>,
    file: usize,
    value: &Spanned<String>,
) -> Option<String> {
    if let Some(at) = value.get_ref().find(['?', '#']) {
        compiler.error_hint(
            file,
            value.span(),
            format!(
                "`{}`: a route matches the path only, and `{}` begins a query or fragment",
                value.get_ref(),
                &value.get_ref()[at..=at]
            ),
            "write the path alone, e.g. \"/post.php\"; to tell requests apart by a query parameter, key a limit by `query:NAME`",
        );
        return None;
    }
    if !value.get_ref().starts_with('/') {
        // What a request's path would be told (it names no path) says nothing to an
        // operator who left out the slash.
        compiler.error_hint(
            file,
            value.span(),
            format!("`{}` does not start with `/`", value.get_ref()),
            format!(
                "a route's path is written as the request's path is, from its first slash: \"/{}\"",
                value.get_ref().trim_start_matches(['.', '*'])
            ),
        );
        return None;
    }
    let encoded = encode_for_request_path(value.get_ref());
    match path::normalise(&encoded) {
        Ok(normal) => Some(normal.into_owned()),
        Err(error) => {
            compiler.error_hint(
                file,
                value.span(),
                format!("`{}`: {error}", value.get_ref()),
                "route paths start with '/', like \"/post.php\"",
            );
            None
        }
    }
}

/// `text` with the bytes a request target cannot carry raw percent-encoded.
fn encode_for_request_path(text: &str) -> Cow<'_, str> {
    if text.bytes().all(|byte| byte.is_ascii_graphic()) {
        return Cow::Borrowed(text);
    }
    let mut out = Vec::with_capacity(text.len() * 3);
    for byte in text.bytes() {
        if byte.is_ascii_graphic() {
            out.push(byte);
        } else {
            crate::proxy::path::push_percent_encoded(&mut out, byte);
        }
    }
    // Graphic ASCII and escapes only: always UTF-8.
    Cow::Owned(String::from_utf8_lossy(&out).into_owned())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn files(sources: &[(&str, &str)]) -> Vec<SourceFile> {
        sources
            .iter()
            .map(|(name, text)| SourceFile {
                path: (*name).into(),
                text: (*text).into(),
            })
            .collect()
    }

    /// Asserts that each of `expected` begins one of `errors`.
    fn assert_reported(errors: &[String], expected: &[&str]) {
        for expected in expected {
            assert!(
                errors.iter().any(|e| e.starts_with(expected)),
                "{expected}\n{errors:?}"
            );
        }
    }

    #[test]
    fn a_mistake_is_said_once_and_as_itself() {
        // An unknown tier is not also a tier-1 route with a module.
        let refused = errors(&[(
            "a.toml",
            &format!("{APP}[[route]]\nname = \"x\"\ntier = 4\nmodule = \"ranking\"\n"),
        )]);
        assert_eq!(refused.len(), 1, "{refused:?}");
        assert!(refused[0].contains("tier 4 does not exist"), "{refused:?}");
        // A path without its slash is said to lack it (not that it "names no path").
        let refused = errors(&[(
            "a.toml",
            &format!("{APP}[[route]]\nname = \"api\"\nmatch = {{ path_prefix = \"api/\" }}\n"),
        )]);
        assert_eq!(refused.len(), 1, "{refused:?}");
        assert!(
            refused[0].contains("`api/` does not start with `/`")
                && refused[0].contains("\"/api/\""),
            "{refused:?}"
        );
        // An on_redis_error without [redis] loads, with a warning that it never acts.
        let limit = "[limit.x]\nkey = \"ip\"\nrate = \"1/s\"\non_redis_error = \"deny\"\n\
                     [[route]]\nname = \"home\"\nlimits = [\"x\"]\n";
        let policy =
            compile(&files(&[("a.toml", &format!("{APP}{limit}"))]), None).expect("compiles");
        let warnings: Vec<String> = policy.warnings.iter().map(ToString::to_string).collect();
        assert!(
            warnings.len() == 1 && warnings[0].contains("does nothing without [redis]"),
            "{warnings:?}"
        );
        let with_redis = format!("{APP}[redis]\nurl = \"redis://127.0.0.1:1\"\n{limit}");
        let policy = compile(&files(&[("a.toml", &with_redis)]), None).expect("compiles");
        assert!(policy.warnings.is_empty(), "{:?}", policy.warnings);
    }

    #[test]
    fn slots_no_route_may_take_and_slow_calls_that_cannot_trip_are_warned_of() {
        let warnings = |tier: u8, extra: &str| -> Vec<String> {
            let text = format!(
                "[server]\ndefault_upstream = \"app\"\n{APP}[upstream.search]\nurl = \"http://127.0.0.1:8083\"\nmax_inflight = 2\n{extra}\n\
                 [[route]]\nname = \"search\"\nmatch = {{ path_prefix = \"/search\" }}\nupstream = \"search\"\ntier = {tier}\n"
            );
            let policy = compile(&files(&[("a.toml", &text)]), None).expect("compiles");
            policy.warnings.iter().map(ToString::to_string).collect()
        };
        let said = warnings(3, "");
        assert!(
            said.len() == 1
                && said[0].starts_with("a.toml:7:16: warning: upstream `search` has only routes of tier 3 and worse, which may take 1 of its max_inflight = 2 slots"),
            "{said:?}"
        );
        let said = warnings(2, "");
        assert!(
            said.len() == 1 && said[0].contains("routes of tier 2 and worse, which may take 1 of"),
            "{said:?}"
        );
        assert!(warnings(3, "shed_reserve = 0.0").is_empty());
        assert!(warnings(1, "").is_empty());

        // A slow-call ratio that cannot reach min_requests while the calls are slow.
        let said = warnings(1, "breaker = { slow_call = \"1s\", min_requests = 30 }");
        assert!(
            said.len() == 1
                && said[0].starts_with("a.toml:8:11: warning: upstream `search`: while its calls are slow, at most 22 of them end in the breaker's window (2 slot(s) of max_inflight, each ending one call per slow_call 1s in a window of 10s), fewer than min_requests = 30"),
            "{said:?}"
        );
        assert!(warnings(1, "breaker = { slow_call = \"1s\", min_requests = 22 }").is_empty());
        // Slower than the window: one call a slot still ends in it.
        assert!(warnings(1, "breaker = { slow_call = \"30s\", min_requests = 2 }").is_empty());
        let said = warnings(1, "breaker = { slow_call = \"30s\", min_requests = 3 }");
        assert!(
            said.len() == 1 && said[0].contains("at most 2 of them"),
            "{said:?}"
        );
    }

    #[test]
    fn private_cookies_take_names_and_prefixes_and_a_starred_vary_cookie_is_warned_of() {
        let with = |degrade: &str| {
            format!("{APP}[[route]]\nname = \"n\"\nmatch = {{ path_prefix = \"/n\" }}\ntier = 3\n{degrade}\n")
        };
        assert_reported(
            &errors(&[(
                "a.toml",
                &with("degrade = { action = \"stale\", private_cookies = [\"a*b\", \"\"] }"),
            )]),
            &[
                "a.toml:7:49: error: `a*b`: `*` may only end a cookie name",
                "a.toml:7:49: error: an empty cookie name",
            ],
        );
        let private_of = |degrade: &str| {
            let policy = compile(&files(&[("a.toml", &with(degrade))]), None).expect("compiles");
            let warnings: Vec<String> = policy.warnings.iter().map(ToString::to_string).collect();
            let route = policy
                .routes
                .find(None, &http::Method::GET, "/n")
                .expect("route");
            match &route.degrade {
                Some(DegradeAction::Stale(settings)) => (
                    settings
                        .private_cookies
                        .iter()
                        .map(ToString::to_string)
                        .collect::<Vec<_>>(),
                    warnings,
                ),
                other => panic!("a stale route: {other:?}"),
            }
        };
        let (defaults, _) = private_of("degrade = { action = \"stale\" }");
        assert_eq!(defaults, crate::degrade::DEFAULT_PRIVATE_COOKIES);
        let (same, _) = private_of("degrade = { action = \"stale\", private_cookies = [] }");
        assert_eq!(same, crate::degrade::DEFAULT_PRIVATE_COOKIES);
        let (none, _) =
            private_of("degrade = { action = \"stale\", private_cookies_builtin = false }");
        assert!(none.is_empty());
        // Added to the built-in names, not in their place.
        let (given, said) = private_of(
            "degrade = { action = \"stale\", private_cookies = [\"sid\", \"auth_*\"], vary = [\"cookie:comment_author_email_*\"] }",
        );
        assert_eq!(
            given.len(),
            crate::degrade::DEFAULT_PRIVATE_COOKIES.len() + 2
        );
        assert!(given.ends_with(&["sid".to_string(), "auth_*".to_string()]));
        assert!(
            said.iter().any(|warning| warning.contains(
                "vary reads the cookie named `comment_author_email_*` exactly, `*` included"
            ) && warning
                .contains("private_cookies = [\"comment_author_email_*\"]")),
            "{said:?}"
        );
        let (_, said) = private_of(
            "degrade = { action = \"stale\", vary = [\"cookie:wordpress_logged_in_\"] }",
        );
        assert!(
            said.iter().any(|warning| warning.contains(
                "vary reads the cookie named `wordpress_logged_in_` exactly, which looks like the start of a name"
            ) && warning.contains("private_cookies = [\"wordpress_logged_in_*\"]")),
            "{said:?}"
        );
        let (only, said) = private_of(
            "degrade = { action = \"stale\", private_cookies = [\"remember_\"], private_cookies_builtin = false }",
        );
        assert_eq!(only, ["remember_"]);
        assert!(
            said.iter()
                .any(|warning| warning.contains("looks like the start of a name")),
            "{said:?}"
        );
    }

    #[test]
    fn a_route_without_host_among_one_sites_routes_is_warned_of() {
        let sites = "[server]\ndefault_upstream = \"shop\"\n[upstream.shop]\nurl = \"http://127.0.0.1:8081\"\n[upstream.blog]\nurl = \"http://127.0.0.1:8082\"\n";
        let shop = "[[route]]\nname = \"shop\"\nmatch = { host = \"shop.example\" }\nupstream = \"shop\"\n";
        let blog = |feed: &str| {
            format!("[[route]]\nname = \"blog\"\nmatch = {{ host = [\"blog.example\", \"www.blog.example\"], path_prefix = \"/\" }}\nupstream = \"blog\"\n[[route]]\nname = \"blog_feed\"\nmatch = {{ {feed}path_prefix = \"/feed\" }}\nupstream = \"blog\"\n")
        };
        let warned_with = |blog: &str, shop: &str| {
            let policy = compile(
                &files(&[
                    ("00-sites.toml", sites),
                    ("10-blog.toml", blog),
                    ("20-shop.toml", shop),
                ]),
                None,
            )
            .expect("compiles");
            policy
                .warnings
                .iter()
                .map(ToString::to_string)
                .filter(|warning| warning.contains("has no host"))
                .collect::<Vec<_>>()
        };
        let warned = |blog: &str| warned_with(blog, shop);
        let said = warned(&blog(""));
        assert_eq!(said.len(), 1, "{said:?}");
        assert!(
            said[0].starts_with("10-blog.toml:6:8: warning: route `blog_feed` has no host, while every other route to upstream `blog` names one (blog.example, www.blog.example): it takes its paths on every site, shop.example included"),
            "{said:?}"
        );
        assert!(warned(&blog("host = \"blog.example\", ")).is_empty());

        // The default site catches every host no route names: a route after the blog's
        // without host, or the default upstream itself.
        let catch_all =
            "[[route]]\nname = \"shop\"\nmatch = { path_prefix = \"/\" }\nupstream = \"shop\"\n";
        let said = warned_with(&blog(""), catch_all);
        assert_eq!(said.len(), 1, "{said:?}");
        assert!(
            said[0]
                .contains("it takes its paths on every site, those route `shop` serves included"),
            "{said:?}"
        );
        let said = warned_with(&blog(""), "");
        assert_eq!(said.len(), 1, "{said:?}");
        assert!(
            said[0].contains(
                "it takes its paths on every site, those default upstream `shop` serves included"
            ),
            "{said:?}"
        );
        assert!(warned_with(&blog("host = \"blog.example\", "), "").is_empty());
    }

    fn errors(sources: &[(&str, &str)]) -> Vec<String> {
        match compile(&files(sources), None) {
            Ok(_) => Vec::new(),
            Err(diagnostics) => diagnostics
                .0
                .iter()
                .filter(|d| d.severity == super::super::diag::Severity::Error)
                .map(|d| d.to_string())
                .collect(),
        }
    }

    const APP: &str = "[upstream.app]\nurl = \"http://127.0.0.1:8081\"\n";

    #[test]
    fn a_routes_client_list_holds_addresses_and_ranges() {
        let route = |client: &str| {
            format!("{APP}[[route]]\nname = \"ai\"\nmatch = {{ host = \"ai.egress\", client = {client} }}\n")
        };
        let policy = compile(
            &files(&[(
                "a.toml",
                &route("[\"127.0.0.1\", \"::1/128\", \"10.0.0.0/8\"]"),
            )]),
            None,
        )
        .expect("compiles");
        assert_eq!(policy.routes.routes[0].clients.len(), 3);
        assert!(policy.warnings.is_empty(), "{:?}", policy.warnings);
        // Without one, a host route to an https:// upstream (an egress route) is warned of.
        let egress = format!("[server]\ndefault_upstream = \"app\"\n{APP}[upstream.ai]\nurl = \"https://api.example\"\n[[route]]\nname = \"ai\"\nmatch = {{ host = \"ai.egress\" }}\nupstream = \"ai\"\n");
        let open = compile(&files(&[("a.toml", &egress)]), None).expect("compiles");
        let warnings: Vec<String> = open.warnings.iter().map(ToString::to_string).collect();
        assert!(
            warnings
                .iter()
                .any(|warning| warning.contains("visitors can too")),
            "{warnings:?}"
        );
        let closed = egress.replace(
            "host = \"ai.egress\"",
            "host = \"ai.egress\", client = \"127.0.0.1\"",
        );
        let closed = compile(&files(&[("a.toml", &closed)]), None).expect("compiles");
        assert!(closed.warnings.is_empty(), "{:?}", closed.warnings);
        let refused = errors(&[("a.toml", &route("\"the app\""))]);
        assert!(
            refused.iter().any(|error| error.starts_with("a.toml:5:40:")
                && error.contains("client `the app` is not an IP address or CIDR range")),
            "{refused:?}"
        );
    }

    #[test]
    fn queue_settings_that_cannot_work_are_refused() {
        let queue = |settings: &str| {
            let text =
                format!("[redis]\nurl = \"redis://127.0.0.1:1\"\n[queue]\n{settings}\n{APP}");
            errors(&[("a.toml", &text)])
        };
        let said = |settings: &str, words: &str| {
            let errors = queue(settings);
            assert!(
                errors.iter().any(|error| error.contains(words)),
                "{settings}: {errors:?}"
            );
        };
        said(
            "backoff_base = \"10m\"\nbackoff_max = \"1s\"",
            "backoff_base (600s) is longer than backoff_max (1s)",
        );
        said("max_body = \"0\"", "max_body must be above 0");
        said("group = \" \"", "group is empty");
        // On the key's own line, not the table's.
        said("\ngroup = \" \"", "a.toml:5:");
        assert_eq!(
            queue("backoff_base = \"1s\"\nbackoff_max = \"1s\"\ngroup = \"site\""),
            Vec::<String>::new()
        );
    }

    #[test]
    fn minimal_policy_compiles_with_defaults() {
        let policy = compile(&files(&[("a.toml", APP)]), None).expect("compiles");
        assert_eq!(policy.default_upstream.as_deref(), Some("app"));
        assert_eq!(policy.server.max_header_bytes, 32 * 1024);
        assert!(policy.routes.fallback.is_some());
        assert_eq!(policy.hash.len(), 16);
    }

    #[test]
    fn a_fleet_waits_for_redis_unless_told_to_admit_ahead() {
        let admit_ahead_above = |redis: &str| {
            let text = format!("[redis]\nurl = \"redis://127.0.0.1:1\"\n{redis}{APP}");
            let policy = compile(&files(&[("a.toml", &text)]), None).expect("compiles");
            policy
                .redis
                .as_ref()
                .expect("redis")
                .settings
                .admit_ahead_above
        };
        assert_eq!(admit_ahead_above(""), 0.5);
        assert_eq!(admit_ahead_above("instances = 3\n"), 1.0);
        assert_eq!(
            admit_ahead_above("instances = 3\nadmit_ahead_above = 0.8\n"),
            0.8
        );
    }

    #[test]
    fn admin_origins_are_origins_as_browsers_send_them() {
        let with_origins = |list: &str| format!("[admin]\norigins = {list}\n{APP}");
        let policy = compile(
            &files(&[(
                "a.toml",
                &with_origins(
                    r#"["https://Ops.Example/", "http://10.0.0.5:8443", "http://[::1]:9901"]"#,
                ),
            )]),
            None,
        )
        .expect("compiles");
        assert_eq!(
            policy.admin.origins,
            [
                "https://ops.example",
                "http://10.0.0.5:8443",
                "http://[::1]:9901"
            ]
        );
        for bad in [
            "ops.example",
            "https://ops.example/admin",
            "ftp://ops.example",
            "https://",
        ] {
            let errors = match compile(
                &files(&[("a.toml", &with_origins(&format!("[\"{bad}\"]")))]),
                None,
            ) {
                Ok(_) => panic!("{bad} compiled"),
                Err(diagnostics) => diagnostics.to_string(),
            };
            assert!(
                errors.contains(&format!("a.toml:2:11: error: \"{bad}\" is not an origin")),
                "{errors}"
            );
        }
    }

    #[test]
    fn answer_format_is_the_servers_unless_a_route_sets_its_own() {
        let routes = "[[route]]\nname = \"api\"\nmatch = { path_prefix = \"/api\" }\nanswer_format = \"json\"\n[[route]]\nname = \"pages\"\nmatch = { path_prefix = \"/\" }\n";
        let compiled = |server: &str| {
            let policy = compile(
                &files(&[("a.toml", &format!("[server]\n{server}\n{APP}{routes}"))]),
                None,
            )
            .expect("compiles");
            let formats: Vec<_> = policy
                .routes
                .routes
                .iter()
                .map(|route| route.answer_format)
                .collect();
            (policy.server.answer_format, formats)
        };
        assert_eq!(
            compiled(""),
            (
                AnswerFormat::ByAccept,
                vec![AnswerFormat::Json, AnswerFormat::ByAccept]
            )
        );
        assert_eq!(
            compiled("answer_format = \"html\""),
            (
                AnswerFormat::Html,
                vec![AnswerFormat::Json, AnswerFormat::Html]
            )
        );
    }

    #[test]
    fn an_unknown_answer_format_is_refused_with_the_values_it_takes() {
        let hint = "  hint: use \"by_accept\" (JSON when the client's Accept asks for it, else HTML), \"json\" or \"html\"";
        let errors = errors(&[(
            "a.toml",
            &format!("[server]\nanswer_format = \"xml\"\n{APP}[[route]]\nname = \"api\"\nmatch = {{ path_prefix = \"/api\" }}\nanswer_format = \"JSON\"\n"),
        )]);
        assert_eq!(
            errors,
            [
                format!("a.toml:2:17: error: answer_format = `xml` is not known\n{hint}"),
                format!("a.toml:8:17: error: answer_format = `JSON` is not known\n{hint}"),
            ]
        );
    }

    #[test]
    fn cors_origins_are_origins_as_browsers_send_them_or_any() {
        let with_origins = |list: &str| format!("[server]\ncors_origins = {list}\n{APP}");
        let policy = compile(
            &files(&[(
                "a.toml",
                &with_origins(r#"["https://App.Example/", "http://10.0.0.5:8443", "*"]"#),
            )]),
            None,
        )
        .expect("compiles");
        assert_eq!(
            policy.server.cors_origins,
            ["https://app.example", "http://10.0.0.5:8443", "*"]
        );
        assert!(
            compile(&files(&[("a.toml", APP)]), None)
                .expect("compiles")
                .server
                .cors_origins
                .is_empty(),
            "off unless set"
        );
        for bad in [
            "app.example",
            "https://app.example/api",
            "*.example",
            "https://",
        ] {
            let errors = match compile(
                &files(&[("a.toml", &with_origins(&format!("[\"{bad}\"]")))]),
                None,
            ) {
                Ok(_) => panic!("{bad} compiled"),
                Err(diagnostics) => diagnostics.to_string(),
            };
            assert!(
                errors.contains(&format!("a.toml:2:16: error: \"{bad}\" is not an origin")),
                "{errors}"
            );
            assert!(errors.contains("\"https://app.example\""), "{errors}");
        }
    }

    #[test]
    fn admin_tokens_are_printable_ascii_as_the_authorization_header_carries_them() {
        let with_token = |secret: &str| {
            format!("[admin]\nlisten = \"0.0.0.0:9901\"\ntokens = {{ ops = \"{secret}\" }}\n{APP}")
        };
        for unsendable in [
            "密码密码密码密码密码密码",
            "0123456789\\tabcdef",
            "0123456789\\nabcdef",
        ] {
            let errors = match compile(&files(&[("a.toml", &with_token(unsendable))]), None) {
                Ok(_) => panic!("a token no client can send compiled: {unsendable}"),
                Err(diagnostics) => diagnostics.to_string(),
            };
            assert!(
                errors.contains("an admin token holds a character that is not printable ASCII"),
                "{errors}"
            );
        }
        // A space inside is sent as it is.
        assert!(compile(
            &files(&[("a.toml", &with_token("0123456 789abcdef"))]),
            None
        )
        .is_ok());
    }

    #[test]
    fn a_reload_cannot_drop_the_token_of_a_listener_bound_beyond_loopback() {
        let exposed = format!(
            "[admin]\nlisten = \"0.0.0.0:9901\"\ntokens = {{ ops = \"0123456789abcdef\" }}\n{APP}"
        );
        let running = compile(&files(&[("a.toml", &exposed)]), None).expect("compiles");
        for without_token in [
            format!("[admin]\nlisten = \"127.0.0.1:9901\"\n{APP}"),
            APP.to_string(),
        ] {
            let errors = match compile(&files(&[("a.toml", &without_token)]), Some(&running)) {
                Ok(_) => panic!("a reload dropped the token:\n{without_token}"),
                Err(diagnostics) => diagnostics.to_string(),
            };
            assert!(
                errors.contains("the admin listener is bound to 0.0.0.0:9901, reachable beyond this machine, until levee restarts"),
                "{errors}"
            );
            // At start (or in `levee check`) the same policy is fine.
            assert!(compile(&files(&[("a.toml", &without_token)]), None).is_ok());
        }
        // With its [admin] file deleted, the error names the directory, not a line of a file
        // that has nothing to do with it.
        let in_dir = |named: &[(&str, &str)]| {
            let mut sources = files(named);
            for source in &mut sources {
                source.path = std::path::Path::new("policies").join(&source.path);
            }
            sources
        };
        let admin = "[admin]\nlisten = \"0.0.0.0:9901\"\ntokens = { ops = \"0123456789abcdef\" }\n";
        let running = compile(
            &in_dir(&[("00-admin.toml", admin), ("10-app.toml", APP)]),
            None,
        )
        .expect("compiles");
        let refused = compile(&in_dir(&[("10-app.toml", APP)]), Some(&running))
            .expect_err("the token is gone");
        let exposed = refused
            .0
            .iter()
            .find(|diagnostic| diagnostic.message.contains("reachable beyond this machine"))
            .expect("the exposed listener");
        assert_eq!(exposed.location(), "policies", "{refused}");
    }

    #[test]
    fn a_declared_module_without_a_tier_takes_the_lowest_tier_of_its_routes() {
        let policy = compile(
            &files(&[(
                "a.toml",
                &format!("{APP}[module.notifications]\ndescription = \"bell\"\n[module.ads]\n[[route]]\nname = \"n\"\nmatch = {{ path_prefix = \"/n\" }}\ntier = 2\nmodule = \"notifications\"\n"),
            )]),
            None,
        )
        .expect("compiles");
        assert_eq!(policy.degrade.modules.get("notifications"), Some(&2));
        assert_eq!(policy.degrade.modules.get("ads"), Some(&3));
    }

    #[tokio::test]
    async fn a_reload_that_rebuilds_an_upstream_keeps_its_requests_in_flight_counted() {
        let policy = |open_for: &str| {
            format!("[upstream.app]\nurl = \"http://127.0.0.1:8081\"\nmax_inflight = 4\nbreaker = {{ open_for = \"{open_for}\" }}\n")
        };
        let running = compile(&files(&[("a.toml", &policy("5s"))]), None).expect("compiles");
        let old = running.upstreams["app"].bulkhead.clone().expect("bulkhead");
        let _in_flight = old.acquire(1).await.expect("a slot");
        // A breaker setting changes: the upstream is rebuilt, its bulkhead kept.
        let reloaded =
            compile(&files(&[("a.toml", &policy("10s"))]), Some(&running)).expect("compiles");
        assert!(!Arc::ptr_eq(
            &running.upstreams["app"],
            &reloaded.upstreams["app"]
        ));
        let new = reloaded.upstreams["app"]
            .bulkhead
            .clone()
            .expect("bulkhead");
        assert!(Arc::ptr_eq(&old, &new));
        assert_eq!(new.inflight(), 1);
    }

    #[test]
    fn a_policy_that_would_answer_404_to_what_no_route_matches_is_refused() {
        // An empty (or truncated) file: nothing to forward to at all.
        assert_eq!(
            errors(&[("a.toml", "")]),
            ["a.toml:1:1: error: the policy defines no upstream: levee would answer every request 404\n  hint: add the PHP app: [upstream.app] with url = \"http://127.0.0.1:8081\""],
        );
        // A second upstream takes away the first one's being the default by itself.
        let two = format!("[server]\nlisten = \"127.0.0.1:0\"\n{APP}[upstream.ai]\nurl = \"http://127.0.0.1:9\"\n[[route]]\nname = \"ai\"\nmatch = {{ path_prefix = \"/ai/\" }}\nupstream = \"ai\"\n");
        let refused = errors(&[("a.toml", &two)]);
        assert!(
            refused.len() == 1
                && refused[0].starts_with("a.toml:1:1: error: 2 upstreams and no default_upstream"),
            "{refused:?}"
        );
        for fixed in [
            two.replace("[server]\n", "[server]\ndefault_upstream = \"app\"\n"),
            format!("{two}[[route]]\nname = \"rest\"\nupstream = \"app\"\n"),
            format!("{two}[[route]]\nname = \"rest\"\nmatch = {{ path_prefix = \"/\" }}\nupstream = \"app\"\n"),
        ] {
            assert!(compile(&files(&[("a.toml", &fixed)]), None).is_ok(), "{fixed}");
        }
    }

    #[test]
    fn a_route_an_earlier_one_holds_whole_is_warned_of_at_both_places() {
        let shadowed = |routes: &str| -> Vec<String> {
            let policy = compile(
                &files(&[
                    ("05-routes.toml", routes),
                    (
                        "10-app.toml",
                        &format!("{APP}[[route]]\nname = \"fallback\"\n"),
                    ),
                ]),
                None,
            )
            .unwrap_or_else(|errors| panic!("{routes}\n{errors}"));
            policy
                .warnings
                .iter()
                .map(ToString::to_string)
                .filter(|warning| warning.contains("is never reached"))
                .collect()
        };
        let route = |name: &str, matcher: &str| {
            format!("[[route]]\nname = \"{name}\"\nmatch = {{ {matcher} }}\n")
        };
        // A prefix before an exact path under it: the warning is at the later route's name
        // and names the earlier one's place.
        let warned = shadowed(&format!(
            "{}{}",
            route("shop", "path_prefix = \"/shop\""),
            route("cart", "path = \"/shop/cart\", method = \"POST\"")
        ));
        assert_eq!(
            warned,
            ["05-routes.toml:5:8: warning: route `cart` is never reached: route `shop` before it (05-routes.toml:2:8) matches every request it matches\n  hint: routes are tried in order (files by name, then as written) and the first that matches wins; move `cart` before `shop`, or remove it"]
        );
        // Certainly held: the same or fewer methods (GET holds HEAD), a host or a client
        // range inside the earlier one's, a longer prefix, a regex under the prefix, the
        // same regex, PATH_INFO of an exact script.
        for (earlier, later) in [
            ("path_prefix = \"/api\"", "path_prefix = \"/api/v2\""),
            (
                "method = [\"GET\", \"POST\"], path_prefix = \"/api\"",
                "method = \"head\", path = \"/api/x\"",
            ),
            (
                "host = \"*.example.com\", path_prefix = \"/\"",
                "host = [\"shop.example.com\", \"*.eu.example.com\"], path = \"/cart\"",
            ),
            (
                "client = \"10.0.0.0/8\", path_prefix = \"/admin\"",
                "client = [\"10.1.0.0/16\", \"10.2.3.4\"], path = \"/admin/users\"",
            ),
            ("path_prefix = \"/user\"", "path_regex = \"^/user/[0-9]+$\""),
            (
                "path_regex = \"^/u/[0-9]+$\"",
                "path_regex = \"^/u/[0-9]+$\"",
            ),
            ("path = \"/wp-login.php\"", "path = \"/wp-login.php/x\""),
            (
                "method = \"POST\"",
                "method = \"POST\", path = \"/post.php\"",
            ),
        ] {
            let routes = format!("{}{}", route("a", earlier), route("b", later));
            let warned = shadowed(&routes);
            assert_eq!(warned.len(), 1, "{earlier} | {later}: {warned:?}");
            assert!(warned[0].contains("route `b` is never reached: route `a` before it"));
            // And so it is: no request that `b` matches finds it.
            let policy =
                compile(&files(&[("a.toml", &format!("{APP}{routes}"))]), None).expect("compiles");
            let later_matches = |host, method: &Method, path: &str, client| {
                policy
                    .routes
                    .find_from(host, method, path, client)
                    .map(|found| found.map(|route| route.name.to_string()))
            };
            for host in [
                None,
                Some("shop.example.com"),
                Some("x.eu.example.com"),
                Some("example.com"),
            ] {
                for method in [Method::GET, Method::HEAD, Method::POST, Method::PUT] {
                    for path in [
                        "/",
                        "/api/v2/x",
                        "/api/x",
                        "/cart",
                        "/admin/users",
                        "/user/12",
                        "/u/3",
                        "/wp-login.php/x",
                        "/wp-login.php/x/y",
                        "/post.php",
                    ] {
                        for client in [
                            None,
                            Some([10, 1, 2, 3].into()),
                            Some([10, 2, 3, 4].into()),
                            Some([192, 0, 2, 1].into()),
                        ] {
                            let found = later_matches(host, &method, path, client);
                            assert!(
                                !matches!(&found, Ok(Some(name)) if name == "b"),
                                "{earlier} | {later}: {host:?} {method} {path} {client:?}"
                            );
                        }
                    }
                }
            }
        }
        // Not certain, or not so: nothing said.
        for (earlier, later) in [
            // The later route is first.
            ("path = \"/shop/cart\"", "path_prefix = \"/shop\""),
            (
                "method = \"POST\", path_prefix = \"/api\"",
                "path = \"/api/x\"",
            ),
            (
                "method = \"GET\", path_prefix = \"/api\"",
                "method = [\"GET\", \"PUT\"], path = \"/api/x\"",
            ),
            // HEAD does not hold GET.
            (
                "method = \"HEAD\", path_prefix = \"/api\"",
                "method = \"GET\", path = \"/api/x\"",
            ),
            (
                "host = \"shop.example.com\", path_prefix = \"/\"",
                "path = \"/cart\"",
            ),
            (
                "host = \"shop.example.com\", path_prefix = \"/\"",
                "host = \"*.example.com\", path = \"/cart\"",
            ),
            (
                "client = \"10.0.0.0/8\", path_prefix = \"/admin\"",
                "path = \"/admin/users\"",
            ),
            ("path_prefix = \"/shop/\"", "path = \"/shop\""),
            ("path = \"/shop\"", "path = \"/shop/cart\""),
            ("path = \"/index.php\"", "path_prefix = \"/index.php/\""),
            // A regex is not read for what else it matches.
            ("path_regex = \"^/user\"", "path = \"/user/1\""),
            ("path_prefix = \"/user\"", "path_regex = \"/user/[0-9]+\""),
            (
                "path_prefix = \"/user\"",
                "path_regex = \"(?i)^/user/[0-9]+\"",
            ),
        ] {
            let warned = shadowed(&format!("{}{}", route("a", earlier), route("b", later)));
            assert!(warned.is_empty(), "{earlier} | {later}: {warned:?}");
        }
        // A route held by a catch-all is refused, once, not also warned of.
        let refused = errors(&[(
            "a.toml",
            &format!(
                "{APP}{}{}",
                route("all", "path_prefix = \"/\""),
                route("b", "path = \"/x\"")
            ),
        )]);
        assert_eq!(refused.len(), 1, "{refused:?}");
    }

    #[test]
    fn routes_after_one_that_matches_everything_are_refused() {
        let refused = errors(&[
            (
                "10-all.toml",
                &format!("{APP}[[route]]\nname = \"all\"\nmatch = {{ path_prefix = \"/\" }}\n"),
            ),
            (
                "20-ranking.toml",
                "[[route]]\nname = \"ranking\"\nmatch = { path_prefix = \"/ranking\" }\n",
            ),
        ]);
        assert_eq!(
            refused,
            ["20-ranking.toml:2:8: error: route `ranking` is never reached: route `all` before it (10-all.toml:4:8) matches every request\n  hint: routes are tried in order (files by name, then as written); move the catch-all last"]
        );
        // Last, it is the site's fallback.
        assert!(errors(&[(
            "a.toml",
            &format!("{APP}[[route]]\nname = \"ranking\"\nmatch = {{ path_prefix = \"/ranking\" }}\n[[route]]\nname = \"all\"\n")
        )])
        .is_empty());
        // A route for some clients leaves every other client to the routes after it, and is
        // no site fallback for them either.
        let for_the_office = "[[route]]\nname = \"office\"\nmatch = { client = [\"10.0.0.0/8\"], path_prefix = \"/\" }\n[[route]]\nname = \"ranking\"\nmatch = { path_prefix = \"/ranking\" }\n";
        assert!(errors(&[("a.toml", &format!("{APP}{for_the_office}"))]).is_empty());
        let two = format!(
            "{APP}[upstream.ai]\nurl = \"http://127.0.0.1:9\"\n{}",
            for_the_office.replace("\nmatch", "\nupstream = \"app\"\nmatch")
        );
        let refused = errors(&[("a.toml", &two)]);
        assert!(
            refused.len() == 1 && refused[0].contains("2 upstreams and no default_upstream"),
            "{refused:?}"
        );
    }

    #[test]
    fn shape_errors_in_several_sections_of_one_file_are_reported_at_once() {
        let refused = errors(&[(
            "a.toml",
            "bogus = 1\n[server]\nacces_log = true\n[upstream.app]\nurl = \"http://127.0.0.1:9\"\nresponse_timeout = 30\n[upstream.api]\nurll = \"x\"\n[[route]]\nname = \"a\"\ntier = \"3\"\n[[route]]\nname = \"b\"\nmatch = { path_prefx = \"/b\" }\n",
        )]);
        let places: Vec<&str> = refused
            .iter()
            .map(|error| error.split(": error").next().unwrap_or_default())
            .collect();
        assert_eq!(
            places,
            [
                "a.toml:1:1",
                "a.toml:3:1",
                "a.toml:6:20",
                "a.toml:8:1",
                "a.toml:11:8",
                "a.toml:14:11"
            ],
            "{refused:#?}"
        );
        // An unknown section is reported with the errors of the others.
        let refused = errors(&[(
            "a.toml",
            "[server]\naccess_log = \"x\"\n[upstreams]\n[upstream.app]\nurl = \"http://127.0.0.1:9\"\n",
        )]);
        assert_eq!(refused.len(), 2, "{refused:#?}");
        assert!(
            refused[1].starts_with(
                "a.toml:3:2: error: unknown field `upstreams`, expected one of `server`"
            ),
            "{refused:#?}"
        );
        // A file with broken TOML gets its first syntax error only: what follows it is
        // read wrongly anyway.
        assert_eq!(
            errors(&[("a.toml", "[server\nx = \"\n[[route]]\ntier = \"3\"\n")]).len(),
            1
        );
    }

    #[test]
    fn what_a_file_that_did_not_read_may_hold_is_not_called_missing() {
        // Its `[redis]` (the file has a typo): the queue route is not also refused.
        let refused = errors(&[
            (
                "10-redis.toml",
                "[redis]\nurl = \"redis://127.0.0.1:6379\"\ntimout = \"1s\"\n",
            ),
            (
                "20-app.toml",
                &format!("{APP}[[route]]\nname = \"jobs\"\nmatch = {{ path = \"/jobs\" }}\nalways_queue = true\n"),
            ),
        ]);
        assert_eq!(refused.len(), 1, "{refused:#?}");
        assert!(refused[0].starts_with("10-redis.toml:3:1: error: unknown field `timout`"));
        // A file not read at all may define anything; one read in part (not UTF-8) what it
        // shows.
        let unreadable = |text: Option<&str>| Unreadable {
            error: Diagnostic::whole(Path::new("30-more.toml"), "cannot read: Permission denied"),
            text: text.map(str::to_string),
        };
        let routes = format!("{APP}[[route]]\nname = \"home\"\nmatch = {{ path = \"/\" }}\nupstream = \"php\"\nlimits = [\"per_ip\"]\n");
        let refused = |text: Option<&str>| -> Vec<String> {
            match compile_read(
                &files(&[("20-app.toml", &routes)]),
                &[unreadable(text)],
                None,
            ) {
                Ok(_) => panic!("an unreadable file is an error"),
                Err(errors) => errors.0.iter().map(ToString::to_string).collect(),
            }
        };
        assert_eq!(
            refused(None),
            ["30-more.toml: error: cannot read: Permission denied"]
        );
        let partly = refused(Some("[upstream.php]\nurl = \"http://127.0.0.1:9\"\n"));
        assert_eq!(partly.len(), 2, "{partly:#?}");
        assert!(
            partly[0].starts_with("20-app.toml:7:11: error: limit `per_ip` is not defined"),
            "{partly:#?}"
        );
    }

    /// Each error's `file:line:col`, in the order reported.
    fn places(refused: &[String]) -> Vec<&str> {
        refused
            .iter()
            .map(|error| error.split(": error").next().unwrap_or_default())
            .collect()
    }

    #[test]
    fn a_table_that_does_not_read_hides_no_value_error_of_the_others() {
        // The review's case: a typo in one limit, a trigger's wrong threshold elsewhere.
        let text = format!(
            "{APP}\
             [limit.post_per_user]\nkey = \"ip\"\nrate = \"5/min\"\nburts = 5\n\
             [limit.login]\nkey = \"ip\"\nrate = \"5/fortnight\"\n\
             [[route]]\nname = \"post\"\nmatch = {{ path_prefix = \"/post\" }}\nlimits = [\"post_per_user\", \"login\"]\ntier = 9\n\
             [degrade]\n[[degrade.trigger]]\nupstream = \"app\"\nwhen = \"latency_p95\"\nabove = 1.5\n"
        );
        let refused = errors(&[("a.toml", &text)]);
        assert_eq!(
            places(&refused),
            ["a.toml:6:1", "a.toml:9:8", "a.toml:14:8", "a.toml:16:1"],
            "{refused:#?}"
        );
        assert!(
            refused[0].starts_with("a.toml:6:1: error: unknown field `burts`")
                && refused[0].contains("hint: did you mean `burst`?"),
            "{refused:#?}"
        );
        assert!(refused[1].contains("unknown rate unit `fortnight`"));
        assert!(refused[2].contains("tier 9 does not exist"));
        assert!(refused[3].contains("latency_p95 needs `above` as a duration"));

        // Type errors in several tables of one file and value errors in the others, in two
        // files: every shape error and every value error, nothing said twice.
        let refused = errors(&[
            (
                "10-a.toml",
                "[upstream.app]\nurl = \"http://127.0.0.1:8081\"\nresponse_timeout = 30\n\
                 [upstream.api]\nurl = \"http://127.0.0.1:8082\"\nconnect_timeout = \"3 fortnights\"\n\
                 [degrade]\nlevel = 7\n\
                 [[degrade.trigger]]\nupstream = \"api\"\nwhen = \"error_ratio\"\nabove = \"half\"\nlevle = 2\n\
                 [[degrade.trigger]]\nupstream = \"api\"\nwhen = \"error_ratio\"\nabove = 1.5\n\
                 [[degrade.trigger]]\nupstream = \"api\"\nwhen = \"breaker_open\"\nlevel = \"2\"\n",
            ),
            (
                "20-b.toml",
                "[[route]]\nname = \"home\"\nupstream = \"app\"\nmatch = { path = \"/\" }\n\
                 [[route]]\nname = \"api\"\nupstream = \"api\"\nmatch = { path_prefix = \"api\" }\n\
                 [[route]]\nname = \"shop\"\nupstream = \"app\"\nmatch = { path_prefx = \"/shop\" }\n",
            ),
        ]);
        assert_eq!(
            places(&refused),
            [
                "10-a.toml:3:20",
                "10-a.toml:6:19",
                "10-a.toml:8:9",
                "10-a.toml:13:1",
                "10-a.toml:17:9",
                "10-a.toml:21:9",
                "20-b.toml:8:25",
                "20-b.toml:12:11",
            ],
            "{refused:#?}"
        );
        assert!(refused[3].contains("unknown field `levle`"), "{refused:#?}");
        assert!(
            refused[4].contains("`above` must be a share"),
            "{refused:#?}"
        );
        // Not `upstream `app` is not defined` for the routes that name the upstream whose
        // table had the type error.
        assert!(
            !refused.iter().any(|error| error.contains("not defined")),
            "{refused:#?}"
        );
    }

    #[test]
    fn what_a_table_that_did_not_read_defines_is_not_called_missing() {
        // Read with the table that did not: its value error is reported too.
        let spare = "[limit.spare]\nkey = \"ip\"\nrate = \"1/fortnight\"\n";
        let route = |extra: &str| {
            format!("[[route]]\nname = \"home\"\nmatch = {{ path = \"/\" }}\n{extra}")
        };
        for (text, expected) in [
            // Its `[identity]`: a limit keyed by user is not told to add one.
            (
                format!("{APP}[identity]\nusr = \"header:X-User\"\n[limit.per_user]\nkey = \"user\"\nrate = \"1/s\"\n{}", route("limits = [\"per_user\"]\n")),
                "a.toml:4:1: error: unknown field `usr`",
            ),
            // Its `[server]`: a route without upstream may have had its default there.
            (
                format!("{APP}[upstream.api]\nurl = \"http://127.0.0.1:9\"\n[server]\ndefault_upstream = \"app\"\nlisten = 8080\n{}", route("")),
                "a.toml:7:10: error: `listen` must be a string in quotes",
            ),
            // The only upstream, which would have been the default.
            (
                format!("[upstream.app]\nurl = \"http://127.0.0.1:9\"\nmax_inflight = \"20\"\n{}", route("")),
                "a.toml:3:16: error: `max_inflight` must be a whole number",
            ),
            // A section spelt a letter off: what it defines is named as if spelt right.
            (
                format!("[upstreams.app]\nurl = \"http://127.0.0.1:9\"\n{}", route("upstream = \"app\"\n")),
                "a.toml:1:2: error: unknown field `upstreams`",
            ),
            // A route that did not read: the module it belongs to exists.
            (
                format!("{APP}[degrade]\nmodules_off = [\"ranking\"]\n{}", route("tier = 3\nmodule = \"ranking\"\nlimit = [\"x\"]\n")),
                "a.toml:10:1: error: unknown field `limit`",
            ),
            // Its `[admin]`: its listen, not the default one, is the one to compare.
            (
                format!("{APP}[server]\nlisten = \"127.0.0.1:9901\"\n[admin]\nlisten = \"127.0.0.1:9902\"\ntokens = \"0123456789abcdef0\"\n{}", route("")),
                "a.toml:7:10: error: `tokens` must be a table",
            ),
        ] {
            let refused = errors(&[("a.toml", &format!("{text}{spare}"))]);
            assert_eq!(refused.len(), 2, "{text}\n{refused:#?}");
            assert!(refused[0].starts_with(expected), "{text}\n{refused:#?}");
            assert!(
                refused[1].contains("unknown rate unit `fortnight`"),
                "{text}\n{refused:#?}"
            );
        }
    }

    #[test]
    fn a_named_table_written_without_its_name_is_told_to_take_one() {
        let app = "[upstream.app]\nurl = \"http://127.0.0.1:9\"\n";
        let route = "[[route]]\nname = \"home\"\nupstream = \"app\"\n";
        for (text, expected) in [
            (
                "[upstream]\nurl = \"http://127.0.0.1:8081\"\nmax_inflight = 20\n".to_string(),
                "a.toml:1:1: error: `[upstream]` needs a name: write `[upstream.NAME]` (e.g. `[upstream.php]`)\n  hint: the keys under it belong to one upstream, whose name goes in the header: `[upstream.php]` on a line of its own, its keys under it; a route names it with upstream = \"php\"",
            ),
            // Only tables under it, which the parser took for upstreams named `fastcgi`.
            (
                "[upstream]\nfastcgi = { root = \"/var/www\" }\n".to_string(),
                "a.toml:1:1: error: `[upstream]` needs a name: write `[upstream.NAME]`",
            ),
            (
                "upstream.url = \"http://127.0.0.1:8081\"\n".to_string(),
                "a.toml:1:1: error: `[upstream]` needs a name",
            ),
            (
                format!("{app}{route}\n[limit]\nkey = \"ip\"\nrate = \"10/s\"\n"),
                "a.toml:7:1: error: `[limit]` needs a name: write `[limit.NAME]` (e.g. `[limit.login_per_ip]`)\n  hint: the keys under it belong to one limit, whose name goes in the header: `[limit.login_per_ip]` on a line of its own, its keys under it; a route lists it with limits = [\"login_per_ip\"]",
            ),
            (
                format!("{app}{route}[module]\ntier = 3\n"),
                "a.toml:6:1: error: `[module]` needs a name: write `[module.NAME]` (e.g. `[module.ranking]`)",
            ),
            (
                "[[upstream]]\nname = \"php\"\nurl = \"http://127.0.0.1:8081\"\n".to_string(),
                "a.toml:1:1: error: `[[upstream]]` is not a list: each upstream is a table with its name in its header, `[upstream.NAME]` (e.g. `[upstream.php]`)\n  hint: write `[upstream.php]` where `[[upstream]]` is, and remove its `name = \"php\"` line",
            ),
            (
                "[[upstream.php]]\nurl = \"http://127.0.0.1:8081\"\n".to_string(),
                "a.toml:1:1: error: `[[upstream.php]]` is written with single brackets: `[upstream.php]`",
            ),
            (
                format!("{app}[route.home]\nmatch = {{ path = \"/\" }}\n"),
                "a.toml:3:1: error: `[route.home]`: routes are a list, each entry written `[[route]]` with its name under it\n  hint: write `[[route]]` and, on the line under it, name = \"home\"",
            ),
        ] {
            let refused = errors(&[("a.toml", &text)]);
            // One error, in levee's words: not one per key (`url` must be a table), nor the
            // parser's own beside it.
            assert_eq!(refused.len(), 1, "{text}\n{refused:#?}");
            assert!(refused[0].starts_with(expected), "{text}\n{refused:#?}");
        }
        // A named upstream beside the nameless one is still checked, and a route naming the
        // upstream the operator meant is not told it is undefined.
        let refused = errors(&[
            (
                "10-app.toml",
                "[upstream]\nurl = \"http://127.0.0.1:8081\"\n[upstream.api]\nurl = \"http://127.0.0.1:9\"\nretries = 1\n",
            ),
            ("20-routes.toml", "[[route]]\nname = \"home\"\nupstream = \"php\"\n"),
        ]);
        assert_eq!(refused.len(), 2, "{refused:#?}");
        assert!(refused[0].starts_with("10-app.toml:1:1: error: `[upstream]` needs a name"));
        assert!(refused[1].starts_with("10-app.toml:5:1: error: unknown field `retries`"));
        // Upstreams written inline under `[upstream]`, and one named like a key, are fine.
        for text in [
            "[upstream]\nphp = { url = \"http://127.0.0.1:8081\" }\n",
            "[upstream.fastcgi]\nurl = \"http://127.0.0.1:8081\"\n",
        ] {
            assert!(errors(&[("a.toml", text)]).is_empty(), "{text}");
        }
    }

    #[test]
    fn common_shape_mistakes_are_explained() {
        let app = "[upstream.app]\nurl = \"http://127.0.0.1:9\"\n";
        for (text, expected) in [
            (
                format!("{app}[route]\nname = \"x\"\n"),
                "a.toml:3:1: error: `[route]` is a list: each entry is written `[[route]]`\n  hint: write `[[route]]` (double brackets) for every route",
            ),
            (
                format!("{app}[degrade]\n[degrade.trigger]\nwhen = \"x\"\n"),
                "error: `[degrade.trigger]` is a list: each entry is written `[[degrade.trigger]]`",
            ),
            (
                format!("{app}[[route]]\nname = \"x\"\ntier = \"3\"\n"),
                "hint: write it without quotes: tier = 3",
            ),
            (
                format!("{app}[server]\naccess_log = \"false\"\n"),
                "hint: write it without quotes: access_log = false",
            ),
            (
                format!("{app}[upstream.api]\nurl = \"http://127.0.0.1:9\"\nbreaker = {{ consecutive_failures = \"5\" }}\n"),
                "hint: write it without quotes: consecutive_failures = 5",
            ),
            (
                format!("{app}[server]\naccess_log = \"no\"\n"),
                "hint: write true or false without quotes",
            ),
            (
                format!("{app}[admin]\ntokens = {{ \"ops team\" = \"0123456789abcdef0\", \"ops team\" = \"0123456789abcdef1\" }}\n"),
                "error: `\"ops team\"` is set twice in the same table",
            ),
            (
                format!("{app}[upstream.app.breaker]\nwindow = \"10s\"\n[upstream.app.breaker]\nopen_for = \"5s\"\n"),
                "error: the table `[upstream.app.breaker]` is written twice in this file",
            ),
            (
                format!("{app}[[route]]\nname = \"x\"\ntier = \"3.5\"\n"),
                "hint: write the number without quotes, like tier = 3",
            ),
            (
                format!("{app}[limit.x]\nkey = [\"ip\"]\nrate = \"1/s\"\nburst = \"NaN\"\n"),
                "hint: write the number without quotes, like tier = 3",
            ),
            (
                format!("{app}response_timeout = 30\n"),
                "hint: a duration is written in quotes with its unit: response_timeout = \"30s\"",
            ),
            (
                format!("{app}[[route]]\nname = \"s\"\nmatch = {{ path_regex = \"^/s/(\\d+)\" }}\n"),
                "write a regular expression in single quotes",
            ),
            (
                format!("{app}max_inflite = 10\n"),
                "hint: did you mean `max_inflight`?",
            ),
            (
                format!("{app}host = 5\n"),
                "hint: write it in quotes: host = \"5\"",
            ),
            (
                "[server]\nlisten = 8080\n".to_string(),
                "hint: write the address and port in quotes: listen = \"127.0.0.1:8080\"",
            ),
            (
                format!("{app}url = \"http://127.0.0.1:10\"\n"),
                "a.toml:3:1: error: `url` is set twice in the same table",
            ),
            (
                format!("{app}[upstream.app]\nurl = \"http://127.0.0.1:10\"\n"),
                "a.toml:3:11: error: the table `[upstream.app]` is written twice in this file",
            ),
        ] {
            let refused = errors(&[("a.toml", &text)]);
            assert!(
                refused.len() == 1 && refused[0].contains(expected),
                "{text}: {refused:?}"
            );
        }
    }

    /// The first error of a one-file policy, with its hint.
    fn first_error(text: &str) -> String {
        errors(&[("a.toml", text)])
            .into_iter()
            .next()
            .unwrap_or_default()
    }

    /// A hint repeats what is written, and reaches the log and the admin status of a refused
    /// reload: never a password.
    #[test]
    fn a_hint_never_repeats_a_redis_secret() {
        for (text, shown) in [
            (
                format!("{APP}[redis]\ncluster = \"redis://:Sekr1t@127.0.0.1:7000\"\n"),
                Some("redis://***@127.0.0.1:7000"),
            ),
            (
                format!("{APP}[redis]\nurl = [\"redis://:Sekr1t@127.0.0.1:6379\"]\n"),
                Some("redis://***@127.0.0.1:6379"),
            ),
            (
                format!("{APP}[redis]\nurl = [\"redis+unix:///run/r.sock?pass=Sekr1t\"]\n"),
                None,
            ),
            (
                format!("{APP}[redis]\ncluster = \"redis://127.0.0.1:7000/?password=Sekr1t\"\n"),
                None,
            ),
            (
                format!("{APP}[redis.sentinel]\nmaster = \"m\"\nnodes = [\"127.0.0.1:26379\"]\npassword = [\"Sekr1t\"]\n"),
                None,
            ),
            (
                format!("{APP}[redis.sentinel]\nmaster = \"m\"\nnodes = [\"127.0.0.1:26379\"]\nusername = {{ v = \"Sekr1t\" }}\n"),
                None,
            ),
        ] {
            let error = first_error(&text);
            assert!(error.contains("error: "), "{text}: {error}");
            assert!(!error.contains("Sekr1t"), "{error}");
            if let Some(shown) = shown {
                assert!(error.contains(shown), "{error}");
            }
        }
    }

    #[test]
    fn a_value_of_the_wrong_kind_is_explained_in_operator_words_not_rust_types() {
        let route = |line: &str| format!("{APP}[[route]]\nname = \"r\"\n{line}\n");
        for (text, expected) in [
            (
                route("max_body = -1"),
                "a.toml:5:12: error: `max_body` must be a size: a whole number of bytes or a string like \"10MiB\"\n  hint: write whole bytes (max_body = 1048576) or a whole number with a unit (max_body = \"1MiB\"; 1.5 MiB is \"1536KiB\")",
            ),
            (route("max_body = true"), "error: `max_body` must be a size: a whole number of bytes"),
            (route("max_body = 1.5"), "error: `max_body` must be a size: a whole number of bytes"),
            (
                format!("{APP}[server]\nmax_header_bytes = [16]\n"),
                "error: `max_header_bytes` must be a size: a whole number of bytes",
            ),
            (
                route("match = \"/\""),
                "error: `match` must be a table, like match = { path_prefix = \"/shop\" }\n  hint: for the paths under it: match = { path_prefix = \"/\" }",
            ),
            (
                route("fallback = \"<p>Later</p>\""),
                "error: `fallback` must be a table, like fallback = { status = 503, body = \"<p>Back soon.</p>\" }\n  hint: put the page in `body`: fallback = { body = \"<p>Later</p>\" }",
            ),
            (route("degrade = \"stale\""), "error: `degrade` must be a table, like degrade = { action = \"stale\""),
            (
                route("fallback = { status = 999 }"),
                "a.toml:5:23: error: 999 is not a status levee can answer with\n  hint: use a status from 200 to 599",
            ),
            (route("fallback = { status = 101 }"), "error: 101 is not a status levee can answer with"),
            (route("match = { method = 5 }"), "error: `method` must be a string or a list of strings"),
            (
                route("match = { method = [\"GET\", 1] }"),
                "a.toml:5:28: error: each item of `method` must be a string in quotes",
            ),
            (route("limits = \"login\""), "error: `limits` must be a list of limit names"),
            (route("hide = \"#ads\""), "error: `hide` must be a table"),
            (route("tier = \"high\""), "error: `tier` must be a tier: 1, 2 or 3 (a module's: 2 or 3)"),
            (
                format!("{APP}breaker = 5\n"),
                "error: `breaker` must be a table, like breaker = { consecutive_failures = 5",
            ),
            (format!("server = 5\n{APP}"), "error: `server` must be a table: [server] on a line of its own"),
            (format!("route = 5\n{APP}"), "error: `route` must be a list of tables: each route is written under its own [[route]] line"),
            (format!("{APP}[redis]\nsentinel = 5\n"), "error: `sentinel` must be a table: [redis.sentinel]"),
            (format!("{APP}[identity]\nuser = 5\n"), "error: `user` must be a string or a list of strings"),
            (format!("{APP}[degrade]\ntrigger = 5\n"), "error: `trigger` must be a list of tables: each trigger is written under its own [[degrade.trigger]] line"),
            (
                format!("{APP}[[degrade.trigger]]\nupstream = \"app\"\nwhen = \"inflight\"\nabove = true\n"),
                "error: `above` must be a duration in quotes, like \"800ms\", or a share, like 0.8",
            ),
            (format!("{APP}[admin]\ntokens = 5\n"), "error: `tokens` must be a table"),
            (format!("{APP}[queue]\nmax_attempts = -1\n"), "error: `max_attempts` must be a whole number"),
        ] {
            let error = first_error(&text);
            assert!(error.contains(expected), "{text}\n{error}");
        }
    }

    #[test]
    fn every_policy_type_says_what_it_takes_without_its_rust_name() {
        fn refused<T: serde::de::DeserializeOwned>(value: toml::Value) -> String {
            match value.try_into::<T>() {
                Ok(_) => String::new(),
                Err(error) => error.message().to_string(),
            }
        }
        let wrong = || toml::Value::Boolean(true);
        let messages = [
            refused::<ServerSpec>(wrong()),
            refused::<super::super::spec::AdminSpec>(wrong()),
            refused::<RedisSpec>(wrong()),
            refused::<SentinelSpec>(wrong()),
            refused::<IdentitySpec>(wrong()),
            refused::<UpstreamSpec>(wrong()),
            refused::<BreakerSpec>(wrong()),
            refused::<LimitSpec>(wrong()),
            refused::<DegradeSpec>(wrong()),
            refused::<TriggerSpec>(wrong()),
            refused::<ModuleSpec>(wrong()),
            refused::<QueueSpec>(wrong()),
            refused::<RouteSpec>(wrong()),
            refused::<MatchSpec>(wrong()),
            refused::<StaticResponseSpec>(wrong()),
            refused::<RouteDegradeSpec>(wrong()),
            refused::<SizeSpec>(wrong()),
            refused::<OneOrMany>(wrong()),
            refused::<AboveSpec>(wrong()),
        ];
        for message in messages {
            assert!(
                message.starts_with("invalid type: boolean `true`, expected a"),
                "{message}"
            );
            for rust in ["struct", "enum", "Spec", "variant"] {
                assert!(!message.contains(rust), "{message}");
            }
        }
    }

    #[test]
    fn a_single_table_among_list_entries_is_called_a_list_not_written_twice() {
        let expected = "error: `[route]` is a list: each entry is written `[[route]]`\n  hint: write `[[route]]` (double brackets) for every route";
        // After the list, and before it: pointed at the single brackets either way.
        for (text, place) in [
            (format!("{APP}[[route]]\nname = \"a\"\n[route]\nname = \"b\"\n[[route]]\nname = \"c\"\n"), "a.toml:5:1: "),
            (format!("{APP}[route]\nname = \"b\"\n[[route]]\nname = \"c\"\n"), "a.toml:3:1: "),
        ] {
            let error = first_error(&text);
            assert!(error.starts_with(place) && error.contains(expected), "{text}\n{error}");
        }
        let error = first_error(&format!(
            "{APP}[degrade]\n[[degrade.trigger]]\nupstream = \"app\"\nwhen = \"breaker_open\"\n[degrade.trigger]\nupstream = \"app\"\n"
        ));
        assert!(
            error.contains(
                "error: `[degrade.trigger]` is a list: each entry is written `[[degrade.trigger]]`"
            ),
            "{error}"
        );
    }

    #[test]
    fn an_unknown_degrade_action_is_told_every_action() {
        let error = first_error(&format!(
            "{APP}[[route]]\nname = \"r\"\ntier = 2\ndegrade = {{ action = \"cache\" }}\n"
        ));
        assert!(error.contains("unknown degrade action `cache`"), "{error}");
        for action in ["\"stale\"", "\"reject\"", "\"queue\""] {
            assert!(error.contains(action), "{error}");
        }
    }

    #[test]
    fn a_share_written_as_a_percentage_is_told_its_fraction() {
        let breaker = |settings: &str| first_error(&format!("{APP}breaker = {{ {settings} }}\n"));
        for (settings, expected) in [
            (
                "failure_ratio = \"50%\"",
                "error: `failure_ratio` must be a share of calls above 0 and at most 1, like 0.5\n  hint: a share is a fraction of 1, written without quotes: 50% is failure_ratio = 0.5",
            ),
            ("slow_call = \"1s\", slow_ratio = \"80 %\"", "hint: a share is a fraction of 1, written without quotes: 80% is slow_ratio = 0.8"),
            ("failure_ratio = \"0.5\"", "hint: write it without quotes: failure_ratio = 0.5"),
            (
                "failure_ratio = 50",
                "error: failure_ratio must be above 0 and at most 1\n  hint: a share is a fraction of 1: 50% is failure_ratio = 0.5",
            ),
            (
                "failure_statuses = [\"5xx\"]",
                "error: each item of `failure_statuses` must be an HTTP status, like 503\n  hint: list each status as a number: failure_statuses = [500, 502, 504]",
            ),
            ("failure_statuses = 503", "error: `failure_statuses` must be a list of HTTP statuses, like [502, 504]"),
        ] {
            let error = breaker(settings);
            assert!(error.contains(expected), "{settings}\n{error}");
        }
    }

    #[test]
    fn a_policy_file_too_large_for_any_policy_is_refused_unread() {
        let dir = tempfile::tempdir().expect("dir");
        let mut text = String::from("[upstream.app]\nurl = \"http://127.0.0.1:8081\"\n");
        while text.len() as u64 <= MAX_POLICY_FILE_BYTES {
            text.push_str("# a line of padding, as a log saved with a .toml name would be\n");
        }
        std::fs::write(dir.path().join("levee.toml"), text).expect("write");
        let refused = load_dir(dir.path(), None).expect_err("refused").to_string();
        assert!(
            refused.contains("the file is over 16 MiB, more than any policy needs"),
            "{refused}"
        );
    }

    #[test]
    fn a_file_modified_in_the_clocks_future_is_not_just_written() {
        let dir = tempfile::tempdir().expect("dir");
        let path = dir.path().join("levee.toml");
        let file = std::fs::File::create(&path).expect("file");
        let within = std::time::Duration::from_secs(10);
        assert!(modified_within(&path, within));
        // The clock stepped back an hour since the edit: an emptied file was refused for
        // the hour.
        let ahead = std::time::SystemTime::now() + std::time::Duration::from_secs(3600);
        file.set_modified(ahead).expect("set time");
        assert!(!modified_within(&path, within));
        // A few seconds ahead (clocks of a network filesystem) is still just now.
        let near = std::time::SystemTime::now() + std::time::Duration::from_secs(3);
        file.set_modified(near).expect("set time");
        assert!(modified_within(&path, within));
    }

    #[test]
    fn nginx_spellings_are_told_what_levee_takes() {
        let limit = |extra: &str| {
            first_error(&format!("{APP}[limit.l]\nkey = \"ip\"\nrate = \"5/s\"\n{extra}\n[[route]]\nname = \"r\"\nlimits = [\"l\"]\n"))
        };
        for (extra, expected) in [
            ("nodelay = true", "hint: levee never delays a request"),
            ("delay = 3", "hint: levee never delays a request"),
            ("status = 444", "error: status 444 is nginx's own, not one levee answers with\n  hint: levee always answers: use 429"),
        ] {
            let error = limit(extra);
            assert!(error.contains(expected), "{extra}\n{error}");
        }
        let error = first_error(&format!(
            "{APP}[[route]]\nname = \"r\"\nfallback = {{ status = 444 }}\n"
        ));
        assert!(
            error.contains("error: status 444 is nginx's own, not one levee answers with"),
            "{error}"
        );
        let error = first_error(&format!("{APP}max_fails = 3\n"));
        assert!(
            error.contains("hint: levee's breaker takes this place"),
            "{error}"
        );
        let stale = |on_status: &str| {
            first_error(&format!("{APP}[[route]]\nname = \"r\"\ntier = 2\ndegrade = {{ action = \"stale\", on_status = {on_status} }}\n"))
        };
        for (on_status, expected) in [
            ("[200]", "error: on_status must be error statuses (400-599)"),
            (
                "[\"5xx\"]",
                "hint: list each status as a number: on_status = [500, 503]",
            ),
        ] {
            let error = stale(on_status);
            assert!(error.contains(expected), "{on_status}\n{error}");
        }
        let error = first_error(&format!("{APP}[[route]]\nname = \"r\"\ntier = 2\ndegrade = {{ action = \"reject\", on_status = [500] }}\n"));
        assert!(
            error.contains("`on_status` does not apply to degrade action `reject`"),
            "{error}"
        );
    }

    #[test]
    fn rate_and_size_errors_give_the_forms_and_range_levee_takes() {
        let limit = |rate: &str| {
            first_error(&format!("{APP}[limit.l]\nkey = [\"ip\"]\nrate = \"{rate}\"\n[[route]]\nname = \"r\"\nlimits = [\"l\"]\n"))
        };
        for (rate, expected) in [
            ("inf/s", "error: rate `inf/s` does not start with a number"),
            ("300 per minute", "error: rate `300 per minute` is not written as N/s, N/min, N/h or N/day"),
            ("5r/m", "error: rate `5r/m` is written as nginx writes it: levee's is \"5/min\""),
            ("10 r/s", "error: rate `10 r/s` is written as nginx writes it: levee's is \"10/s\""),
            ("1000000000/s", "error: rate `1000000000/s` is above the fastest rate levee counts, 1000000/s"),
            ("0.001/day", "error: rate `0.001/day` is below the slowest rate levee counts, one request per 10000000 s (0.0087/day)"),
        ] {
            let error = limit(rate);
            assert!(error.contains(expected), "{rate}\n{error}");
            assert!(error.contains("from 0.0087/day up to 1000000/s"), "{error}");
        }
        let error = first_error(&format!("{APP}[server]\nmax_body = \"1.5MiB\"\n"));
        assert!(
            error.contains("error: size `1.5MiB` is not a whole number: sizes take whole numbers (`1.5MiB` is \"1536KiB\")"),
            "{error}"
        );
    }

    #[test]
    fn the_name_hint_says_what_names_are_accepted() {
        let error = first_error(&format!("{APP}[[route]]\nname = \"\"\n"));
        assert!(
            error.contains("error: route name \"\" is empty\n  hint: give it a name; a name is any text without control characters or spaces at its ends, other than `.` and `..`, like \"checkout\" or \"排行\""),
            "{error}"
        );
        // As the hint says: a name beyond ASCII is a name.
        assert!(errors(&[(
            "a.toml",
            &format!("{APP}[[route]]\nname = \"排行\"\nmatch = {{ path_prefix = \"/排行\" }}\n")
        )])
        .is_empty());
    }

    #[test]
    fn a_module_name_a_letter_from_a_declared_one_is_warned_of_as_a_typo() {
        let route = |module: &str| {
            format!("[[route]]\nname = \"r-{module}\"\nmatch = {{ path_prefix = \"/{module}\" }}\ntier = 3\nmodule = \"{module}\"\n")
        };
        let warnings = |policy: &str| -> Vec<String> {
            compile(&files(&[("a.toml", policy)]), None)
                .expect("a likely typo still loads")
                .warnings
                .iter()
                .map(ToString::to_string)
                .filter(|warning| warning.contains("is not declared"))
                .collect()
        };
        let declared = "[module.ranking]\ndescription = \"top sellers\"\n";
        let typo = warnings(&format!("{APP}{declared}{}", route("rankng")));
        assert_eq!(
            typo,
            ["a.toml:9:10: warning: module `rankng` is not declared, and `ranking` is: a typo makes a module of its own\n  hint: write `ranking`; if `rankng` is meant as a module of its own, declare it with [module.rankng]"]
        );
        // In a page's hide list too.
        let typo = warnings(&format!(
            "{APP}{declared}[[route]]\nname = \"home\"\nhide = {{ rankin = \"#ranking\" }}\n"
        ));
        assert!(
            typo.iter()
                .any(|w| w.contains("module `rankin` is not declared")),
            "{typo:?}"
        );
        // Declared, far from every declared name, or short names a letter apart by design.
        for policy in [
            format!("{APP}{declared}[module.rankng]\n{}", route("rankng")),
            format!("{APP}{declared}{}", route("ads")),
            format!("{APP}[module.cart]\n{}{}", route("cart"), route("card")),
            format!("{APP}[module.ads]\n{}{}", route("ads"), route("abs")),
        ] {
            assert!(warnings(&policy).is_empty(), "{policy}");
        }
        // Neither declared: a page hiding `rankng` while the route's module is `ranking`.
        let both_named = format!(
            "{APP}{}[[route]]\nname = \"home\"\nhide = {{ rankng = \"#ranking\" }}\n",
            route("ranking")
        );
        let near: Vec<String> = compile(&files(&[("a.toml", &both_named)]), None)
            .expect("loads")
            .warnings
            .iter()
            .map(ToString::to_string)
            .filter(|warning| warning.contains("a letter or two from module"))
            .collect();
        assert!(
            near.iter().any(|w| w.contains(
                "module `rankng` is a letter or two from module `ranking`, named by another route"
            )),
            "{near:?}"
        );
        assert_eq!(edit_distance("ranking", "rankng"), 1);
        assert_eq!(edit_distance("ads", "ranking"), 6);
        assert_eq!(edit_distance("排行榜", "排行"), 1);
    }

    #[test]
    fn listeners_overlap_as_the_kernel_binds_them() {
        let at = |text: &str| text.parse::<std::net::SocketAddr>().expect("address");
        for (a, b, overlap) in [
            ("127.0.0.1:80", "127.0.0.1:80", true),
            ("127.0.0.1:80", "127.0.0.1:81", false),
            ("0.0.0.0:80", "127.0.0.1:80", true),
            ("[::]:80", "127.0.0.1:80", true),
            ("[::]:80", "0.0.0.0:80", true),
            ("[::]:80", "[::1]:80", true),
            // An IPv4 wildcard takes no IPv6 address.
            ("0.0.0.0:80", "[::1]:80", false),
            // An IPv4-mapped address is the IPv4 one.
            ("127.0.0.1:80", "[::ffff:127.0.0.1]:80", true),
            ("0.0.0.0:0", "0.0.0.0:0", false),
        ] {
            assert_eq!(listeners_overlap(at(a), at(b)), overlap, "{a} {b}");
            assert_eq!(listeners_overlap(at(b), at(a)), overlap, "{b} {a}");
        }
        // Apart to the kernel, but both `localhost` to a front that names it.
        for (a, b, shared) in [
            ("0.0.0.0:80", "[::1]:80", true),
            ("127.0.0.1:80", "[::1]:80", true),
            ("127.0.0.2:80", "[::1]:80", false),
            ("10.0.0.5:80", "[::1]:80", false),
            ("127.0.0.1:80", "[::1]:81", false),
        ] {
            assert_eq!(listeners_share_localhost(at(a), at(b)), shared, "{a} {b}");
            assert_eq!(listeners_share_localhost(at(b), at(a)), shared, "{b} {a}");
        }
    }

    #[test]
    fn a_method_no_client_sends_is_warned_of() {
        let warnings = |methods: &str| -> Vec<String> {
            let policy =
                format!("{APP}[[route]]\nname = \"r\"\nmatch = {{ method = {methods} }}\n");
            compile(&files(&[("a.toml", &policy)]), None)
                .expect("loads")
                .warnings
                .iter()
                .map(ToString::to_string)
                .collect()
        };
        let typo = warnings("[\"GET\", \"GETT\"]");
        assert!(
            typo.iter()
                .any(|w| w.contains("warning: `GETT` is no method clients send")),
            "{typo:?}"
        );
        assert!(warnings("[\"get\", \"PROPFIND\", \"PURGE\"]").is_empty());
    }

    #[test]
    fn ipv6_prefix_is_checked_and_said_idle_without_an_ip_key() {
        let limit = |key: &str, bits: u32| {
            format!("{APP}[limit.login]\nkey = [\"{key}\"]\nrate = \"5/m\"\nipv6_prefix = {bits}\n[[route]]\nname = \"r\"\nmatch = {{ path = \"/\" }}\nlimits = [\"login\"]\n")
        };
        let policy = compile(&files(&[("a.toml", &limit("ip", 56))]), None).expect("loads");
        assert_eq!(policy.limits["login"].ipv6_prefix, 56);
        assert!(policy.warnings.is_empty(), "{:?}", policy.warnings);
        let error = compile(&files(&[("a.toml", &limit("ip", 16))]), None)
            .expect_err("refused")
            .to_string();
        assert!(
            error.contains("error: ipv6_prefix must be from 32 to 128, not 16"),
            "{error}"
        );
        let idle = compile(&files(&[("a.toml", &limit("route", 48))]), None).expect("loads");
        assert!(
            idle.warnings[0]
                .to_string()
                .contains("warning: ipv6_prefix of limit `login` does nothing"),
            "{:?}",
            idle.warnings
        );
    }

    #[test]
    fn an_ipv6_address_without_brackets_is_said_so() {
        assert_eq!(
            address_hint("http://::1:8081", "http://127.0.0.1:8081"),
            "an IPv6 address goes in brackets: \"http://[::1]:8081\""
        );
        // The database kept, the password not said.
        assert_eq!(
            address_hint(
                "redis://:secret@2001:db8::5:6379/3",
                "redis://127.0.0.1:6379/0"
            ),
            "an IPv6 address goes in brackets: \"redis://:***@[2001:db8::5]:6379/3\""
        );
        assert_eq!(
            address_hint("http://127.0.0.1:80:81", "http://127.0.0.1:8081"),
            "write it as \"http://127.0.0.1:8081\""
        );
        assert_eq!(
            address_hint("http://exa mple:8081", "http://127.0.0.1:8081"),
            "write it as \"http://127.0.0.1:8081\""
        );
    }

    #[test]
    fn stale_memory_is_a_size_of_a_mebibyte_and_more() {
        let with = |size: &str| format!("{APP}[degrade]\nstale_memory = {size}\n");
        let policy = compile(&files(&[("a.toml", &with("\"16MiB\""))]), None).expect("loads");
        assert_eq!(policy.degrade.stale_memory, 16 << 20);
        let plain = compile(&files(&[("a.toml", APP)]), None).expect("loads");
        assert_eq!(plain.degrade.stale_memory, 64 << 20);
        let error = compile(&files(&[("a.toml", &with("\"100KiB\""))]), None)
            .expect_err("refused")
            .to_string();
        assert!(
            error.contains("error: stale_memory must be at least 1MiB, not 102400 bytes"),
            "{error}"
        );
    }

    #[test]
    fn a_trusted_address_with_its_network_s_prefix_is_a_warning() {
        let policy =
            format!("[server]\ntrusted_proxies = [\"2001:db8:1:2::1/64\", \"10.0.0.0/8\"]\n{APP}");
        let warnings: Vec<String> = compile(&files(&[("a.toml", &policy)]), None)
            .expect("loads")
            .warnings
            .iter()
            .map(ToString::to_string)
            .collect();
        assert!(
            warnings.len() == 1
                && warnings[0].contains("warning: trusted_proxies `2001:db8:1:2::1/64` trusts the whole network 2001:db8:1:2::/64")
                && warnings[0].contains("write \"2001:db8:1:2::1\""),
            "{warnings:?}"
        );
    }

    #[test]
    fn trusting_every_address_is_a_warning() {
        for every in ["::/0", "0.0.0.0/0"] {
            let policy = format!("[server]\ntrusted_proxies = [\"127.0.0.1\", \"{every}\"]\n{APP}");
            let warnings: Vec<String> = compile(&files(&[("a.toml", &policy)]), None)
                .expect("loads")
                .warnings
                .iter()
                .map(ToString::to_string)
                .collect();
            assert!(
                warnings.len() == 1
                    && warnings[0].starts_with(&format!(
                        "a.toml:2:33: warning: trusted_proxies `{every}` trusts every address"
                    )),
                "{warnings:?}"
            );
        }
    }

    #[test]
    fn what_is_defined_and_used_by_nothing_is_a_warning_not_an_error() {
        let policy = compile(
            &files(&[(
                "a.toml",
                &format!("{APP}[upstream.old]\nurl = \"http://127.0.0.1:9\"\n[server]\ndefault_upstream = \"app\"\n[limit.login]\nkey = [\"ip\"]\nrate = \"1/s\"\n[limit.used]\nkey = [\"ip\"]\nrate = \"1/s\"\n[module.ads]\n[module.hidden]\n[[route]]\nname = \"home\"\nmatch = {{ path = \"/\" }}\nlimits = [\"used\"]\nhide = {{ hidden = \"#h\" }}\n"),
            )]),
            None,
        )
        .expect("warnings do not refuse a policy");
        let warnings: Vec<String> = policy.warnings.iter().map(ToString::to_string).collect();
        assert_eq!(warnings.len(), 3, "{warnings:#?}");
        assert!(warnings[0].starts_with("a.toml:3:1: warning: upstream `old` gets no request"));
        assert!(warnings[1].starts_with("a.toml:7:1: warning: limit `login` is used by no route"));
        assert!(warnings[2].starts_with("a.toml:13:1: warning: module `ads` has no route"));
        // The embedded default and a plain policy have none.
        let plain = compile(&files(&[("a.toml", APP)]), None).expect("compiles");
        assert!(plain.warnings.is_empty());
    }

    #[test]
    fn a_file_that_does_not_read_whole_leaves_no_false_undefined_errors_in_the_others() {
        // A typo in a.toml's upstream made b.toml's route say "upstream `app` is not
        // defined; defined upstreams: none", contradicting the file the operator looked at.
        let refused = errors(&[
            (
                "a.toml",
                "[upstream.app]\nurl = \"http://127.0.0.1:8081\"\nmax_inflght = 20\n[limit.login]\nkey = [\"ip\"]\nrate = \"1/s\"\nbrust = 5\n[module.ads]\n[server]\ndefault_upstream = \"app\"\nmodules_off = [\"ads\"]\n",
            ),
            (
                "b.toml",
                "[[route]]\nname = \"login\"\nmatch = { path = \"/login.php\" }\nupstream = \"app\"\nlimits = [\"login\"]\n[[route]]\nname = \"home\"\nmatch = { path = \"/\" }\n",
            ),
        ]);
        assert!(
            refused.iter().all(|error| error.starts_with("a.toml:")),
            "only a.toml's own errors: {refused:#?}"
        );
        assert!(
            refused.iter().any(|error| error.contains("max_inflght")),
            "{refused:#?}"
        );
        // A name no file defines is still an error.
        let refused = errors(&[
            ("a.toml", "[upstream.app]\nurl = \"http://127.0.0.1:8081\"\nmax_inflght = 20\n"),
            (
                "b.toml",
                "[[route]]\nname = \"login\"\nmatch = { path = \"/login.php\" }\nupstream = \"api\"\n",
            ),
        ]);
        assert!(
            refused
                .iter()
                .any(|error| error.starts_with("b.toml:4:12: error: upstream `api` is not defined")),
            "{refused:#?}"
        );
        // A file that is not even TOML (a quote left open) may define anything: the file
        // that names its upstream is not blamed too.
        let refused = errors(&[
            (
                "00-global.toml",
                "[[degrade.trigger]]\nupstream = \"shop\"\nwhen = \"breaker_open\"\nlevel = 1\n",
            ),
            (
                "10-shop.toml",
                "[upstream.shop]\nurl = \"http://127.0.0.1:8081\nmax_inflight = 4\n[[route]]\nname = \"shop\"\nupstream = \"shop\"\n",
            ),
        ]);
        assert!(
            refused.len() == 1 && refused[0].starts_with("10-shop.toml:2:"),
            "only the broken file's error: {refused:#?}"
        );
    }

    #[test]
    fn names_that_could_not_be_told_apart_or_used_are_refused() {
        let refused = errors(&[(
            "a.toml",
            "[upstream.\"\"]\nurl = \"http://127.0.0.1:9\"\n[upstream.\"app \"]\nurl = \"http://127.0.0.1:9\"\n[limit.\"a\\tb\"]\nkey = [\"ip\"]\nrate = \"1/s\"\n[[route]]\nname = \"}jobs\"\nupstream = \"\"\n[[route]]\nname = \"\"\nupstream = \"\"\n[upstream.\".\"]\nurl = \"http://127.0.0.1:9\"\n[module.\"..\"]\n",
        )]);
        assert_reported(
            &refused,
            &[
                "a.toml:1:1: error: upstream name \"\" is empty",
                "a.toml:3:1: error: upstream name \"app \" starts or ends with a space",
                "a.toml:5:1: error: limit name \"a\\tb\" has a control character",
                "a.toml:12:8: error: route name \"\" is empty",
                "a.toml:14:1: error: upstream name \".\" is a path step in a URL",
                "a.toml:16:1: error: module name \"..\" is a path step in a URL",
            ],
        );
    }

    #[test]
    fn a_queue_route_with_a_brace_in_its_name_is_refused_only_in_a_redis_cluster() {
        let policy = |redis: &str| {
            format!("{APP}{redis}[[route]]\nname = \"jobs}}\"\nmatch = {{ path = \"/notify.php\" }}\nalways_queue = true\n")
        };
        let refused = errors(&[(
            "a.toml",
            &policy("[redis]\ncluster = [\"redis://127.0.0.1:7000\"]\n"),
        )]);
        assert!(
            refused.len() == 1 && refused[0].contains("queue route name \"jobs}\" has a brace"),
            "{refused:?}"
        );
        assert!(errors(&[(
            "a.toml",
            &policy("[redis]\nurl = \"redis://127.0.0.1:6379\"\n")
        )])
        .is_empty());
    }

    /// Each passed `levee check`, then every call failed: the Redis client is built without
    /// its insecure TLS, and a cluster names its nodes by address.
    #[test]
    fn redis_urls_levee_cannot_use_are_refused() {
        for (redis, expected) in [
            (
                "url = \"rediss://:pw@127.0.0.1:6380/0#insecure\"",
                "`rediss://***@127.0.0.1:6380/0#insecure` asks for TLS without checking",
            ),
            (
                "cluster = [\"rediss://127.0.0.1:7000#insecure\"]",
                "asks for TLS without checking Redis's certificate",
            ),
            (
                "cluster = [\"redis+unix:///run/redis.sock\"]",
                "cluster node `redis+unix:///run/redis.sock` is a unix socket",
            ),
        ] {
            let refused = errors(&[("a.toml", &format!("{APP}[redis]\n{redis}\n"))]);
            assert!(
                refused.len() == 1 && refused[0].contains(expected),
                "{redis}: {refused:?}"
            );
        }
    }

    #[test]
    fn a_cluster_node_naming_a_database_other_than_0_is_refused() {
        let policy = |nodes: &str| format!("{APP}[redis]\ncluster = [{nodes}]\n");
        let refused = errors(&[(
            "a.toml",
            &policy("\"redis://127.0.0.1:7000/0\", \"redis://:secret@127.0.0.1:7001/2\""),
        )]);
        assert!(
            refused.len() == 1
                && refused[0]
                    .contains("cluster node `redis://***@127.0.0.1:7001/2` names database 2")
                && refused[0].contains("a.toml:"),
            "{refused:?}"
        );
        assert!(errors(&[(
            "a.toml",
            &policy("\"redis://127.0.0.1:7000\", \"redis://127.0.0.1:7001/0\"")
        )])
        .is_empty());
    }

    #[test]
    fn a_state_file_in_a_directory_that_does_not_exist_is_warned_of() {
        // A warning, not an error: a deploy's check runs where the directory need not exist.
        let text = format!("{APP}[degrade]\nstate_file = \"/nonexistent-levee-dir/state.json\"\n");
        let policy = compile(&files(&[("a.toml", &text)]), None).expect("compiles");
        let warned: Vec<String> = policy.warnings.iter().map(ToString::to_string).collect();
        assert!(
            warned.len() == 1 && warned[0].contains("warning: the directory of state_file `/nonexistent-levee-dir/state.json` does not exist here"),
            "{warned:?}"
        );
        let dir = tempfile::tempdir().expect("dir");
        let fine = format!(
            "{APP}[degrade]\nstate_file = \"{}\"\n",
            dir.path().join("state.json").display()
        );
        assert!(errors(&[("a.toml", &fine)]).is_empty());
    }

    #[test]
    fn health_paths_may_not_take_the_home_page_or_each_other() {
        let server = |keys: &str| {
            errors(&[(
                "a.toml",
                &format!("[server]\n{keys}\n[upstream.app]\nurl = \"http://127.0.0.1:9\"\n"),
            )])
        };
        let refused = server("livez_path = \"/\"");
        assert!(
            refused.len() == 1 && refused[0].contains("home page"),
            "{refused:?}"
        );
        let refused = server("readyz_path = \"/livez\"");
        assert!(
            refused.len() == 1
                && refused[0].contains("livez_path and readyz_path are both `/livez`"),
            "{refused:?}"
        );
        assert!(server("livez_path = \"/alive\"\nreadyz_path = \"/ready\"").is_empty());
    }

    #[test]
    fn breaker_values_that_would_do_nothing_are_refused() {
        let breaker = |settings: &str| {
            errors(&[(
                "a.toml",
                &format!(
                    "[upstream.app]\nurl = \"http://127.0.0.1:9\"\nbreaker = {{ {settings} }}\n"
                ),
            )])
        };
        for (settings, expected) in [
            ("open_for = \"0s\"", "`open_for` must be more than 0"),
            ("window = \"0s\"", "`window` must be more than 0"),
            ("slow_call = \"0ms\"", "`slow_call` must be more than 0"),
            (
                "open_for = \"1m\", max_open_for = \"30s\"",
                "max_open_for (30s) is shorter than open_for (60s)",
            ),
            (
                "slow_ratio = 0.5",
                "slow_ratio has no effect without slow_call",
            ),
            (
                "failing_clients = 0",
                "failing_clients must be from 1 to 8, not 0",
            ),
            (
                "failing_clients = 9",
                "failing_clients must be from 1 to 8, not 9",
            ),
        ] {
            let refused = breaker(settings);
            assert!(
                refused.len() == 1 && refused[0].contains(expected),
                "{settings}: {refused:?}"
            );
        }
        assert!(breaker("slow_call = \"2s\", slow_ratio = 0.5, open_for = \"5m\"").is_empty());
        assert!(breaker("failing_clients = 1").is_empty());
    }

    #[test]
    fn degrade_keys_the_action_never_reads_are_refused() {
        let errors = errors(&[(
            "a.toml",
            &format!("{APP}[[route]]\nname = \"n\"\nmatch = {{ path_prefix = \"/n\" }}\ntier = 2\ndegrade = {{ action = \"reject\", body_json = '{{\"later\":true}}', max_age = \"1m\" }}\n"),
        )]);
        assert!(
            errors
                .iter()
                .any(|e| e.contains("`body_json` does not apply to degrade action `reject`")),
            "{errors:?}"
        );
        assert!(
            errors
                .iter()
                .any(|e| e.contains("`max_age` does not apply to degrade action `reject`")),
            "{errors:?}"
        );
    }

    #[test]
    fn stale_query_and_max_copies_are_checked_where_they_are_written() {
        let with = |degrade: &str| {
            format!("{APP}[[route]]\nname = \"n\"\nmatch = {{ path_prefix = \"/n\" }}\ntier = 3\n{degrade}\n")
        };
        let errors = errors(&[
            (
                "a.toml",
                &with("degrade = { action = \"stale\", query = \"some\" }"),
            ),
            (
                "b.toml",
                &with("degrade = { action = \"stale\", max_copies = 0 }")
                    .replace("name = \"n\"", "name = \"m\"")
                    .replace("/n", "/m")
                    .replace("[upstream.app]\nurl = \"http://127.0.0.1:8081\"\n", ""),
            ),
            (
                "c.toml",
                &with("degrade = { action = \"reject\", query = \"none\", max_copies = 5 }")
                    .replace("name = \"n\"", "name = \"o\"")
                    .replace("/n", "/o")
                    .replace("[upstream.app]\nurl = \"http://127.0.0.1:8081\"\n", ""),
            ),
        ]);
        assert_reported(
            &errors,
            &[
                "a.toml:7:39: error: unknown value `some` for `query`",
                "b.toml:5:44: error: max_copies must be at least 1",
                "c.toml:5:11: error: `query` does not apply to degrade action `reject`",
                "c.toml:5:11: error: `max_copies` does not apply to degrade action `reject`",
            ],
        );
        // The stale settings route `n` compiles to, with `degrade` as its degrade table.
        let settings_of = |degrade: &str| {
            let policy = compile(&files(&[("a.toml", &with(degrade))]), None).expect("compiles");
            let route = policy
                .routes
                .find(None, &http::Method::GET, "/n")
                .expect("route");
            match &route.degrade {
                Some(DegradeAction::Stale(settings)) => {
                    (settings.query.clone(), settings.max_copies)
                }
                other => panic!("a stale route: {other:?}"),
            }
        };
        assert_eq!(
            settings_of("degrade = { action = \"stale\", query = [\"week\", \"page\", \"api.key\", \"tag[]\"], max_copies = 20 }"),
            (
                CopyQuery::Only(vec![
                    "api_key".into(),
                    "page".into(),
                    "tag".into(),
                    "week".into()
                ]),
                20
            )
        );
        assert_eq!(
            settings_of("degrade = { action = \"stale\" }"),
            (CopyQuery::All, DEFAULT_MAX_COPIES)
        );
    }

    #[test]
    fn zero_timeouts_and_intervals_are_refused() {
        let errors = errors(&[(
            "a.toml",
            "[server]\nheader_read_timeout = \"0s\"\n[upstream.app]\nurl = \"http://127.0.0.1:8081\"\nresponse_timeout = \"0ms\"\n[degrade]\nsync_interval = \"0s\"\n",
        )]);
        assert_reported(
            &errors,
            &[
                "a.toml:2:23: error: `header_read_timeout` must be more than 0",
                "a.toml:5:20: error: `response_timeout` must be more than 0",
                "a.toml:7:17: error: `sync_interval` must be more than 0",
            ],
        );
    }

    #[test]
    fn max_connections_is_at_least_one_and_a_whole_number() {
        let zero = errors(&[(
            "a.toml",
            "[server]\nmax_connections = 0\n[upstream.app]\nurl = \"http://127.0.0.1:8081\"\n",
        )]);
        assert_reported(
            &zero,
            &["a.toml:2:19: error: max_connections must be at least 1"],
        );
        let negative = errors(&[(
            "a.toml",
            "[server]\nmax_connections = -5\n[upstream.app]\nurl = \"http://127.0.0.1:8081\"\n",
        )]);
        assert!(
            negative.iter().any(|error| error.starts_with("a.toml:2:")),
            "{negative:?}"
        );
    }

    #[test]
    fn a_mistyped_upstream_port_is_refused_not_taken_for_the_default() {
        for url in [
            "http://127.0.0.1:80810",
            "http://127.0.0.1:8O81",
            "http://127.0.0.1:",
            "http://127.0.0.1:0",
            "https://[::1]:99999",
        ] {
            let errors = errors(&[("a.toml", &format!("[upstream.app]\nurl = \"{url}\"\n"))]);
            assert!(
                errors
                    .iter()
                    .any(|e| e.starts_with("a.toml:2:7: error: `") && e.contains("is not a port")),
                "{url}: {errors:?}"
            );
        }
        for url in [
            "http://127.0.0.1",
            "http://127.0.0.1:8081",
            "https://[::1]:8443",
            "http://[::1]",
            "http://app.internal:65535",
        ] {
            let errors = errors(&[("a.toml", &format!("[upstream.app]\nurl = \"{url}\"\n"))]);
            assert!(errors.is_empty(), "{url}: {errors:?}");
        }
    }

    #[test]
    fn settings_that_could_never_take_effect_are_refused() {
        let errors = errors(&[(
            "a.toml",
            "[upstream.app]\nurl = \"http://127.0.0.1:8081\"\nqueue_wait = \"1s\"\nshed_reserve = 0.3\n[[degrade.trigger]]\nupstream = \"app\"\nwhen = \"inflight\"\nabove = 0.8\n[[degrade.trigger]]\nupstream = \"app\"\nwhen = \"breaker_open\"\nabove = 0.5\nmin_calls = 10\n[[degrade.trigger]]\nupstream = \"app\"\nwhen = \"latency_p95\"\nabove = \"1s\"\nmin_calls = 5000\n",
        )]);
        assert_reported(
            &errors,
            &[
                "a.toml:3:14: error: `queue_wait` means nothing without max_inflight",
                "a.toml:4:16: error: `shed_reserve` means nothing without max_inflight",
                "a.toml:7:8: error: upstream `app` has no max_inflight, so an inflight trigger could never fire",
                "a.toml:12:9: error: breaker_open has no threshold",
                "a.toml:13:13: error: `min_calls` is for latency_p95 and error_ratio, not breaker_open",
                "a.toml:18:13: error: `min_calls = 5000` could never be reached: the latency window keeps the last 2048 calls",
            ],
        );
    }

    #[test]
    fn a_bad_rate_or_url_leaves_the_other_keys_checked() {
        let errors = errors(&[(
            "a.toml",
            "[upstream.app]\nurl = \"ftp://127.0.0.1:21\"\nresponse_timeout = \"0s\"\nhost = \"\"\n[limit.l]\nkey = [\"ip\"]\nrate = \"lots\"\nburst = 0\nmissing = \"maybe\"\n",
        )]);
        assert_reported(
            &errors,
            &[
                "a.toml:2:7: error: upstream scheme `ftp` is not supported",
                "a.toml:3:20: error: `response_timeout` must be more than 0",
                "a.toml:4:8: error: `` is not a valid Host header value",
                "a.toml:7:8: error:",
                "a.toml:8:9: error: burst must be at least 1",
                "a.toml:9:11: error: missing = `maybe` is not known",
            ],
        );
    }

    #[test]
    fn host_patterns_no_request_could_match_are_refused() {
        for (pattern, problem) in [
            ("example.com:8080", "has a port"),
            ("*example.com", "has a `*` that is not a whole label"),
            ("www.*.example.com", "has a `*` after its start"),
            ("example.com..", "has an empty label"),
            (".example.com", "has an empty label"),
            ("bücher.de", "is not ASCII"),
            (".", "is empty"),
        ] {
            let source = format!("[upstream.app]\nurl = \"http://127.0.0.1:8081\"\n[[route]]\nname = \"r\"\nmatch = {{ host = \"{pattern}\" }}\n");
            let errors = errors(&[("a.toml", &source)]);
            assert!(
                errors
                    .iter()
                    .any(|error| error.contains(&format!("host `{pattern}` {problem}"))),
                "{pattern}: {errors:?}"
            );
        }
        // One trailing dot is the same host, as requests' hosts are read.
        let source = "[upstream.app]\nurl = \"http://127.0.0.1:8081\"\n[[route]]\nname = \"r\"\nmatch = { host = \"admin.example.com.\" }\n";
        assert_eq!(errors(&[("a.toml", source)]), Vec::<String>::new());
    }

    #[test]
    fn fastcgi_settings_are_checked_against_the_scheme() {
        let errors = errors(&[(
            "a.toml",
            "[upstream.app]\nurl = \"fastcgi://127.0.0.1:9000\"\n[upstream.php]\nurl = \"fastcgi://127.0.0.1:9001\"\nfastcgi = { root = \"www\", index = \"a/b.php\", front_controller = \"/..\", params = { \"A B\" = \"1\" } }\n[upstream.web]\nurl = \"http://127.0.0.1:8081\"\nfastcgi = { root = \"/srv\" }\n",
        )]);
        assert_reported(
            &errors,
            &[
                "a.toml:2:7: error: upstream `app` speaks FastCGI but has no fastcgi = { root = … }",
                "a.toml:5:20: error: root `www` is not an absolute path",
                "a.toml:5:35: error: index `a/b.php` is not a file name",
                "a.toml:5:65: error: front_controller `/..` does not name a script",
                "a.toml:5:81: error: `A B` cannot be a FastCGI parameter",
                "a.toml:8:11: error: `fastcgi` settings on upstream `web`, whose url is not fastcgi://",
            ],
        );
        let source = "[upstream.app]\nurl = \"fastcgi://127.0.0.1\"\nfastcgi = { root = \"/srv/www/\", front_controller = \"index.php\", params = { APP_ENV = \"prod\" } }\n";
        let policy = compile(&files(&[("a.toml", source)]), None).expect("compiles");
        let app = &policy.upstreams["app"];
        let fastcgi = app.settings.fastcgi.as_deref().expect("fastcgi settings");
        assert_eq!(fastcgi.root, "/srv/www");
        assert_eq!(fastcgi.index, "index.php");
        assert_eq!(fastcgi.front_controller.as_deref(), Some("/index.php"));
        assert_eq!(
            fastcgi.params,
            [("APP_ENV".to_string(), "prod".to_string())]
        );
        assert_eq!(fastcgi.temp_dir, std::env::temp_dir());
        // Without a SERVER_NAME of its own, PHP is given each client's Host: said.
        let warned: Vec<String> = policy.warnings.iter().map(ToString::to_string).collect();
        assert!(
            warned.iter().any(|warning| warning
                .contains("upstream `app` gives PHP the Host each client sends as SERVER_NAME")),
            "{warned:?}"
        );
        for named in [
            "params = { SERVER_NAME = \"www.example.com\" }",
            "host = \"www.example.com\"",
        ] {
            let source = format!("[upstream.app]\nurl = \"fastcgi://127.0.0.1\"\n{}fastcgi = {{ root = \"/srv/www/\", front_controller = \"index.php\"{} }}\n",
                if named.starts_with("host") { format!("{named}\n") } else { String::new() },
                if named.starts_with("params") { format!(", {named}") } else { String::new() });
            let policy = compile(&files(&[("a.toml", &source)]), None).expect("compiles");
            assert!(
                !policy
                    .warnings
                    .iter()
                    .any(|warning| warning.message.contains("SERVER_NAME")),
                "{named}: {:?}",
                policy.warnings
            );
        }
        // php-fpm's own failures are failed calls: a 502 or 504 in its answer is a script's
        // choice, not counted unless the policy says so.
        assert!(app.breaker.settings().failure_statuses.is_empty());
        let named = compile(
            &files(&[(
                "a.toml",
                &format!("{source}breaker = {{ failure_statuses = [502] }}\n[upstream.web]\nurl = \"http://127.0.0.1:8081\"\n[server]\ndefault_upstream = \"app\"\n"),
            )]),
            None,
        )
        .expect("compiles");
        assert_eq!(
            named.upstreams["app"].breaker.settings().failure_statuses,
            [502]
        );
        assert_eq!(
            named.upstreams["web"].breaker.settings().failure_statuses,
            [502, 504]
        );
        let temp_dir_errors = super::tests::errors(&[(
            "a.toml",
            "[upstream.a]\nurl = \"fastcgi://127.0.0.1\"\nfastcgi = { root = \"/srv\", temp_dir = \"tmp\" }\n[upstream.b]\nurl = \"fastcgi://127.0.0.1\"\nfastcgi = { root = \"/srv\", temp_dir = \"/nonexistent/levee\" }\n",
        )]);
        assert_reported(
            &temp_dir_errors,
            &[
                "a.toml:3:39: error: temp_dir `tmp` is not an absolute path",
                "a.toml:6:39: error: temp_dir `/nonexistent/levee` is not a directory",
            ],
        );
    }

    #[test]
    fn a_bad_redis_target_or_trigger_upstream_leaves_the_other_keys_checked() {
        let errors = errors(&[(
            "a.toml",
            "[upstream.app]\nurl = \"http://127.0.0.1:8081\"\n[redis]\ninstances = 0\n[[degrade.trigger]]\nupstream = \"nope\"\nwhen = \"breaker_open\"\nlevel = 7\n",
        )]);
        assert_reported(
            &errors,
            &[
                "a.toml:3:1: error: [redis] needs url, cluster or [redis.sentinel]",
                "a.toml:4:13: error: instances must be at least 1",
                "a.toml:6:12: error: upstream `nope` is not defined",
                "a.toml:8:9: error: a trigger cannot raise to level 7",
            ],
        );
    }

    #[test]
    fn warnings_of_a_policy_with_errors_are_counted_not_listed() {
        // A typo in the upstream, a limit no route uses and an `on_redis_error` without
        // [redis]: the warnings were dropped without a word, to surprise once the typo was
        // fixed. They are counted (not listed: some come from the errors).
        let text = format!("{APP}max_inflite = 5\n[limit.login]\nkey = \"ip\"\nrate = \"5/s\"\non_redis_error = \"deny\"\n[limit.unused]\nkey = \"ip\"\nrate = \"5/s\"\n[[route]]\nname = \"login\"\nmatch = {{ path_prefix = \"/login\" }}\nlimits = [\"login\"]\n");
        let Err(diagnostics) = compile(&files(&[("a.toml", &text)]), None) else {
            panic!("the typo is an error");
        };
        let said: Vec<String> = diagnostics.0.iter().map(ToString::to_string).collect();
        assert_eq!(said.len(), 2, "{said:?}");
        assert!(
            said[0].contains("error: unknown field `max_inflite`"),
            "{said:?}"
        );
        assert!(
            said[1].contains("warning: ")
                && said[1].contains(
                    " warnings held back (the first is here), listed once the errors are fixed"
                ),
            "{said:?}"
        );
        let fixed = text.replace("max_inflite", "max_inflight");
        let policy = compile(&files(&[("a.toml", &fixed)]), None).expect("compiles");
        assert_eq!(policy.warnings.len(), 2, "{:?}", policy.warnings);
        // None said of a policy whose only faults are errors.
        let errors_only = format!("{APP}max_inflite = 5\n");
        let Err(diagnostics) = compile(&files(&[("a.toml", &errors_only)]), None) else {
            panic!("the typo is an error");
        };
        assert_eq!(diagnostics.0.len(), 1, "{:?}", diagnostics.0);
    }

    #[test]
    fn errors_past_the_first_thousand_are_counted_not_listed() {
        // 100,000 routes with one typo each took minutes to place every error.
        let mut text = String::from("[upstream.app]\nurl = \"http://127.0.0.1:8081\"\n");
        for i in 0..1500 {
            text.push_str(&format!(
                "[[route]]\nname = \"r{i}\"\nmatch = {{ path = \"/{i}\" }}\nupstream = \"ap\"\n"
            ));
        }
        let errors = errors(&[("a.toml", &text)]);
        assert_eq!(errors.len(), 1001, "{:?}", errors.last());
        assert!(
            errors[0].contains("upstream `ap` is not defined")
                && errors[1000].contains("and 500 more errors, not listed"),
            "{}",
            errors[1000]
        );
    }

    #[test]
    fn unknown_keys_point_at_their_line() {
        let errors = errors(&[("a.toml", "[server]\nlisten = \"127.0.0.1:1\"\nlistn = 3\n")]);
        assert_eq!(errors.len(), 1, "{errors:?}");
        assert!(
            errors[0].starts_with("a.toml:3:1: error: unknown field `listn`")
                && errors[0].contains("hint: did you mean `listen`?"),
            "{}",
            errors[0]
        );
        // Nothing close: no guess.
        let errors = super::tests::errors(&[("a.toml", "[server]\ncolour = 3\n")]);
        assert!(
            errors[0].contains("check the spelling against docs/policy.md"),
            "{}",
            errors[0]
        );
    }

    #[test]
    fn all_errors_are_collected_across_files() {
        let errors = errors(&[
            (
                "a.toml",
                "[[route]]\nname = \"x\"\nupstream = \"nope\"\nlimits = [\"nope\"]\ntier = 7\n",
            ),
            ("b.toml", "[server]\nheader_read_timeout = \"10 parsecs\"\n"),
            ("c.toml", "[queue]\npoll_interval = 5\n"),
        ]);
        // A route with an undefined upstream still has its other keys checked.
        assert_eq!(errors.len(), 5, "{errors:?}");
        assert_reported(
            &errors,
            &[
                "a.toml:4:11: error: limit `nope` is not defined",
                "a.toml:5:8: error: tier 7 does not exist",
            ],
        );
        assert!(
            errors
                .iter()
                .any(|e| e.starts_with("a.toml:3:12: error: upstream `nope` is not defined")),
            "{errors:?}"
        );
        assert!(
            errors
                .iter()
                .any(|e| e.starts_with("b.toml:2:23: error: unknown duration unit")),
            "{errors:?}"
        );
        assert!(
            errors.iter().any(|e| e.starts_with("c.toml:2:")),
            "{errors:?}"
        );
        // A file that is not TOML at all may define anything: its own error alone is told,
        // and names that it might define are not called undefined elsewhere.
        let errors = super::tests::errors(&[
            (
                "a.toml",
                "[[route]]\nname = \"x\"\nupstream = \"nope\"\ntier = 7\n",
            ),
            ("c.toml", "this is not toml"),
        ]);
        assert_eq!(errors.len(), 2, "{errors:?}");
        assert!(
            errors[0].starts_with("a.toml:4:8: error: tier 7"),
            "{errors:?}"
        );
        assert!(errors[1].starts_with("c.toml:1:"), "{errors:?}");
    }

    #[test]
    fn duplicate_names_name_both_places() {
        let route = "[[route]]\nname = \"home\"\nmatch = { path = \"/\" }\n";
        let errors = errors(&[
            ("a.toml", &format!("{APP}{route}")),
            ("b.toml", route),
            ("c.toml", APP),
        ]);
        assert!(
            errors.iter().any(
                |e| e.contains("b.toml:2:8: error: route `home` is defined twice")
                    && e.contains("a.toml:4:8")
            ),
            "{errors:?}"
        );
        assert!(
            errors.iter().any(
                |e| e.contains("c.toml:1:1: error: upstream `app` is defined twice")
                    && e.contains("a.toml")
            ),
            "{errors:?}"
        );
    }

    #[test]
    fn route_matching_uses_order_and_normalised_paths() {
        let policy = compile(
            &files(&[(
                "a.toml",
                &format!("{APP}[[route]]\nname = \"rank\"\nmatch = {{ path_prefix = \"/ranking\" }}\n[[route]]\nname = \"post\"\nmatch = {{ method = [\"post\"], path = \"/post.php\" }}\n"),
            )]),
            None,
        )
        .expect("compiles");
        let find = |method: Method, path: &str| {
            policy
                .routes
                .find(None, &method, path)
                .map(|r| r.name.to_string())
        };
        assert_eq!(find(Method::GET, "/ranking/week").as_deref(), Some("rank"));
        assert_eq!(find(Method::POST, "/post.php").as_deref(), Some("post"));
        assert_eq!(
            find(Method::GET, "/post.php").as_deref(),
            Some(DEFAULT_ROUTE)
        );
    }

    #[test]
    fn the_route_index_finds_what_walking_the_table_finds() {
        let routes = [
            r#"match = { path_prefix = "/ranking" }"#,
            r#"match = { path_prefix = "/module-1/" }"#,
            r#"match = { path = "/legacy/page-2.php" }"#,
            r#"match = { path_regex = '^/archive/3/[0-9]+\.php$' }"#,
            r#"match = { path_regex = "^/archive/?x" }"#,
            r#"match = { path_regex = "(?i)^/Admin/" }"#,
            r#"match = { path_regex = "^/a/|^/b/" }"#,
            r#"match = { path_regex = "/shop/" }"#,
            r#"match = { method = ["POST"], path_prefix = "/api/v1/" }"#,
            r#"match = { host = "static.example.test", path_prefix = "/" }"#,
            r#"match = { host = "*.cdn.example.test" }"#,
            r#"match = { path = "/" }"#,
            r#"match = { path_prefix = "/module-1/special/" }"#,
            r#"match = { path_regex = "^/module-1/x$" }"#,
            r#"match = { method = ["PUT"], path_prefix = "/" }"#,
            r#"match = { path_prefix = "/module-10/" }"#,
            r#"match = { host = ["a.example.test", "B.Example.Test"] }"#,
            r#"match = { host = ["c.example.test", "*.c.example.test"], method = ["GET"] }"#,
            r#"match = { host = "a.example.test", path_prefix = "/ranking/" }"#,
            r#"match = { host = "static.example.test", method = ["POST"] }"#,
        ];
        let mut text = APP.to_string();
        for (at, matching) in routes.iter().enumerate() {
            text.push_str(&format!(
                "[[route]]\nname = \"r{at}\"\n{matching}\nupstream = \"app\"\n"
            ));
        }
        let policy = compile(&files(&[("a.toml", &text)]), None).expect("compiles");
        assert!(policy.routes.is_indexed());
        let paths = [
            "/",
            "/ranking",
            "/rankings/x",
            "/module-1/",
            "/module-1",
            "/module-10/",
            "/module-10",
            "/legacy/page-2.php",
            "/legacy/page-2.phpx",
            "/archive/3/12.php",
            "/archive/x",
            "/archivex",
            "/ADMIN/x",
            "/admin/",
            "/a/1",
            "/b/2",
            "/x/shop/y",
            "/api/v1/z",
            "/static/",
            "/index.php",
            "/index.php/module-1/x",
            "/module-1/index.php",
            "/module-1/special/index.php/y",
            "/ranking/index.php/x",
            "//x",
            "/module-1/x",
            "/module-1/special/y",
            "/unknown/page",
        ];
        for path in paths {
            for method in [Method::GET, Method::POST, Method::PUT] {
                for host in [
                    None,
                    Some("static.example.test"),
                    Some("STATIC.example.test"),
                    Some("img.cdn.example.test"),
                    Some("a.example.test"),
                    Some("b.example.test"),
                    Some("c.example.test"),
                    Some("x.c.example.test"),
                    Some("other.example.test"),
                ] {
                    let name = |found: Option<&Arc<Route>>| found.map(|r| r.name.to_string());
                    assert_eq!(
                        name(policy.routes.find(host, &method, path)),
                        name(policy.routes.find_by_walking(host, &method, path)),
                        "{method} {path} on {host:?}"
                    );
                }
            }
        }
    }

    #[test]
    fn a_path_finds_its_route_as_the_php_app_reads_it() {
        let table = |routes: &[(&str, &str)]| {
            let mut text = format!(
                "{APP}[upstream.admin]\nurl = \"http://127.0.0.1:8082\"\n[server]\ndefault_upstream = \"app\"\n"
            );
            for (name, rest) in routes {
                text.push_str(&format!("[[route]]\nname = \"{name}\"\nmatch = {rest}\n"));
            }
            compile(&files(&[("a.toml", &text)]), None).expect("compiles")
        };
        let route = |policy: &Policy, method: Method, path: &str| {
            policy
                .routes
                .find(None, &method, path)
                .map(|route| route.name.to_string())
                .unwrap_or_default()
        };
        // A front controller reads `/index.php/admin/users` as `/admin/users`: the admin
        // route holds for it, ahead of the catch-all the path as written falls on.
        let site = table(&[
            ("login", r#"{ method = ["POST"], path = "/login" }"#),
            ("ajax", r#"{ path = "/admin/ajax.php" }"#),
            ("admin", r#"{ path_prefix = "/admin/" }"#),
            ("home", r#"{ path = "/" }"#),
            ("forum", r#"{ path = "/forum/index.php" }"#),
            ("shop", r#"{ path_prefix = "/shop/" }"#),
            ("site", r#"{ path_prefix = "/" }"#),
        ]);
        for (method, path, name) in [
            (Method::POST, "/login", "login"),
            (Method::POST, "/index.php/login", "login"),
            (Method::GET, "/index.php/login", "site"),
            (Method::GET, "/index.php/admin/users", "admin"),
            (Method::GET, "/index.php/admin/", "admin"),
            (Method::GET, "/index.php/", "home"),
            (Method::GET, "/forum/index.php/topic/7", "forum"),
            (Method::GET, "/shop/index.php/cart", "shop"),
            (Method::GET, "/shop/x/index.php/cart", "shop"),
            // Only PATH_INFO after an index is read so: a directory, the index itself and
            // other scripts are what they say.
            (Method::GET, "/index.php", "site"),
            (Method::GET, "/forum/", "site"),
            (Method::GET, "/app.php/admin/users", "site"),
            (Method::GET, "/index.phpx/admin/users", "site"),
            (Method::GET, "/x/index.php.bak/admin/", "site"),
            (Method::GET, "/about", "site"),
            // The script run is the first `.php` segment: `/x.php/index.php/admin` runs
            // `/x.php`.
            (Method::GET, "/x.php/index.php/admin/y", "site"),
            // A reading that names a script, on the same route as written or on none
            // earlier.
            (Method::GET, "/shop/index.php/x/cart.php", "shop"),
            (Method::GET, "/index.php/x.php", "site"),
        ] {
            assert_eq!(route(&site, method.clone(), path), name, "{method} {path}");
        }
        // A route whose exact path names the script keeps its requests: a legacy site whose
        // `/index.php?q=` is its search.
        let legacy = table(&[
            ("home", r#"{ path = "/" }"#),
            ("search", r#"{ path = "/index.php" }"#),
            ("admin", r#"{ path_prefix = "/admin" }"#),
        ]);
        assert_eq!(route(&legacy, Method::GET, "/index.php"), "search");
        assert_eq!(route(&legacy, Method::GET, "/index.php/admin"), "search");
        assert_eq!(route(&legacy, Method::GET, "/"), "home");
        // With no route for the path as written, its reading's route holds; with none for
        // either, the default upstream's.
        let admin_only = table(&[("admin", r#"{ path_prefix = "/admin/" }"#)]);
        assert_eq!(
            route(&admin_only, Method::GET, "/index.php/admin/x"),
            "admin"
        );
        assert_eq!(route(&admin_only, Method::GET, "/index.php/x"), "default");
        // Spellings on routes of different upstreams: neither is sure to be where the app
        // runs the request.
        let pools = table(&[
            (
                "admin",
                "{ path_prefix = \"/admin/\" }\nupstream = \"admin\"",
            ),
            ("site", r#"{ path_prefix = "/" }"#),
        ]);
        let disagree = pools
            .routes
            .find_from(None, &Method::GET, "/index.php/admin/x", None)
            .expect_err("spellings disagree");
        assert_eq!(
            disagree.to_string(),
            "the path falls on route `site`, and as a front controller reads it (/admin/x) on route `admin` of another upstream"
        );
        assert_eq!(route(&pools, Method::GET, "/admin/x"), "admin");
        // A FastCGI upstream's own front controller and index route what follows them too.
        let symfony = {
            let text = "[upstream.app]\nurl = \"fastcgi://127.0.0.1:9000\"\nfastcgi = { root = \"/srv/app/web\", index = \"default.php\", front_controller = \"/app.php\" }\n[server]\ndefault_upstream = \"app\"\n[[route]]\nname = \"admin\"\nmatch = { path_prefix = \"/admin/\" }\n";
            compile(&files(&[("a.toml", text)]), None).expect("compiles")
        };
        for (path, name) in [
            ("/app.php/admin/users", "admin"),
            ("/index.php/admin/users", "admin"),
            ("/default.php/admin/y", "admin"),
            ("/x/default.php/admin/y", "default"),
        ] {
            assert_eq!(route(&symfony, Method::GET, path), name, "{path}");
        }
        assert_eq!(
            route(&symfony, Method::GET, "/other.php/admin/y"),
            "default"
        );
        // A reading that names a script on another route: `/admin/index.php/ajax.php` runs
        // the admin's index, which the ajax route is not written for; and a front controller
        // that routes `/admin/users/1.php` as an admin page is not the `site` route's.
        for path in ["/admin/index.php/ajax.php", "/index.php/admin/users/1.php"] {
            let disagree = site
                .routes
                .find_from(None, &Method::GET, path, None)
                .expect_err("spellings disagree");
            assert!(
                disagree.to_string().ends_with("which names another script"),
                "{path}: {disagree}"
            );
        }
        assert_eq!(route(&pools, Method::GET, "/index.php/x"), "site");
    }

    #[test]
    fn the_route_index_lists_each_route_once_however_many_segments_there_are() {
        // Half the routes name no segment (a prefix that stops inside one), half name one
        // each: listing the unnamed ones under every segment took memory squared (gigabytes
        // for a generated table of 20,000 routes).
        let mut text = APP.to_string();
        for at in 0..1000 {
            text.push_str(&format!(
                "[[route]]\nname = \"p{at}\"\nmatch = {{ path_prefix = \"/p{at}\" }}\n[[route]]\nname = \"e{at}\"\nmatch = {{ path = \"/e{at}/x\" }}\n"
            ));
        }
        let policy = compile(&files(&[("a.toml", &text)]), None).expect("compiles");
        assert_eq!(policy.routes.index_entries(), 2000);
        let name = |path: &str| {
            policy
                .routes
                .find(None, &Method::GET, path)
                .map(|route| route.name.to_string())
        };
        assert_eq!(name("/e999/x").as_deref(), Some("e999"));
        // First match wins: `/p9` comes before `/p999`.
        assert_eq!(name("/p999/x").as_deref(), Some("p9"));
        assert_eq!(name("/p1/x").as_deref(), Some("p1"));
        assert_eq!(
            name("/e5/y").as_deref(),
            Some("default"),
            "the fallback route"
        );
    }

    #[test]
    fn route_paths_match_as_browsers_send_them_and_queries_are_refused() {
        let policy = compile(
            &files(&[(
                "a.toml",
                &format!("{APP}[[route]]\nname = \"forum\"\nmatch = {{ path_prefix = \"/论坛\" }}\n[[route]]\nname = \"page\"\nmatch = {{ path = \"/my page.php\" }}\n"),
            )]),
            None,
        )
        .expect("compiles");
        let find = |path: &str| {
            policy
                .routes
                .find(None, &Method::GET, path)
                .map(|r| r.name.to_string())
        };
        assert_eq!(find("/%E8%AE%BA%E5%9D%9B/x").as_deref(), Some("forum"));
        assert_eq!(find("/my%20page.php").as_deref(), Some("page"));
        for host in [
            "example.com:8080",
            "*example.com",
            "www.*.com",
            "[::1]:80",
            "",
            "論壇.example",
        ] {
            let errors = errors(&[(
                "a.toml",
                &format!("{APP}[[route]]\nname = \"h\"\nmatch = {{ host = \"{host}\" }}\n"),
            )]);
            assert!(
                errors
                    .iter()
                    .any(|e| e.starts_with("a.toml:5:") && e.contains(&format!("host `{host}`"))),
                "{host}: {errors:?}"
            );
        }
        // An international name's hint is its `xn--` form, as clients send it.
        for (host, ascii) in [
            ("論壇.example", "xn--ypsv87i.example"),
            ("*.論壇.example", "*.xn--ypsv87i.example"),
        ] {
            let errors = errors(&[(
                "a.toml",
                &format!("{APP}[[route]]\nname = \"h\"\nmatch = {{ host = \"{host}\" }}\n"),
            )]);
            assert!(
                errors
                    .iter()
                    .any(|e| e.contains(&format!("write \"{ascii}\""))),
                "{host}: {errors:?}"
            );
        }
        for host in [
            "example.com",
            "*.example.com",
            "[::1]",
            "xn--3ds443g.example",
        ] {
            let errors = errors(&[(
                "a.toml",
                &format!("{APP}[[route]]\nname = \"h\"\nmatch = {{ host = \"{host}\" }}\n"),
            )]);
            assert!(errors.is_empty(), "{host}: {errors:?}");
        }
        for path in ["/post.php?x=1", "/page#top"] {
            let errors = errors(&[(
                "a.toml",
                &format!("{APP}[[route]]\nname = \"q\"\nmatch = {{ path = \"{path}\" }}\n"),
            )]);
            assert!(
                errors
                    .iter()
                    .any(|e| e.starts_with("a.toml:5:")
                        && e.contains("a route matches the path only")),
                "{path}: {errors:?}"
            );
        }
    }

    #[test]
    fn unchanged_upstreams_are_reused_across_reloads() {
        let first = compile(&files(&[("a.toml", APP)]), None).expect("compiles");
        let second = compile(&files(&[("a.toml", APP)]), Some(&first)).expect("compiles");
        assert!(Arc::ptr_eq(
            &first.upstreams["app"],
            &second.upstreams["app"]
        ));
        let changed = format!("{APP}connect_timeout = \"1s\"\n");
        let third = compile(&files(&[("a.toml", &changed)]), Some(&second)).expect("compiles");
        assert!(!Arc::ptr_eq(
            &second.upstreams["app"],
            &third.upstreams["app"]
        ));
        // The breaker (and an open one's state) goes on across that change…
        assert!(Arc::ptr_eq(
            &second.upstreams["app"].breaker,
            &third.upstreams["app"].breaker
        ));
        // …but not to another address: a standby is not the app that failed.
        let standby = "[upstream.app]\nurl = \"http://127.0.0.1:8082\"\nconnect_timeout = \"1s\"\n";
        let fourth = compile(&files(&[("a.toml", standby)]), Some(&third)).expect("compiles");
        assert!(!Arc::ptr_eq(
            &third.upstreams["app"].breaker,
            &fourth.upstreams["app"].breaker
        ));
        // Nor to another socket of the same URL: a standby php-fpm pool.
        let pool = |socket: &str| {
            format!("[upstream.app]\nurl = \"fastcgi://localhost\"\nsocket = \"{socket}\"\nfastcgi = {{ root = \"/srv/app\" }}\n")
        };
        let first_pool = pool("/run/php/php8.2-fpm.sock");
        let fifth = compile(&files(&[("a.toml", &first_pool)]), Some(&fourth)).expect("compiles");
        let again = compile(&files(&[("a.toml", &first_pool)]), Some(&fifth)).expect("compiles");
        assert!(Arc::ptr_eq(
            &fifth.upstreams["app"].breaker,
            &again.upstreams["app"].breaker
        ));
        let other_pool = pool("/run/php/php8.3-fpm.sock");
        let sixth = compile(&files(&[("a.toml", &other_pool)]), Some(&again)).expect("compiles");
        assert!(!Arc::ptr_eq(
            &again.upstreams["app"].breaker,
            &sixth.upstreams["app"].breaker
        ));
    }
}
