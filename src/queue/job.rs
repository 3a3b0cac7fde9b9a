//! A queued request and its encoding as Redis stream fields.

use std::collections::HashMap;
use std::net::IpAddr;
use std::time::{SystemTime, UNIX_EPOCH};

use bytes::Bytes;
use http::header::HeaderMap;

use crate::proxy::header::upstream_spelling;

/// A request stored for later.
#[derive(Debug, Clone, PartialEq)]
pub struct Job {
    pub route: String,
    pub method: String,
    /// Path and query as the client sent them.
    pub target: String,
    /// The client's HTTP version, 1.0 or 1.1: the replay carries it as a forwarded request
    /// does (a FastCGI upstream is told it as `SERVER_PROTOCOL`; an HTTP upstream is sent
    /// HTTP/1.1 either way). Stored as the field `version`; a job without it (stored by an
    /// earlier version) is HTTP/1.1, the version its replay then had.
    pub version: http::Version,
    /// Header names and values, values byte for byte (a cookie set by a script may hold raw
    /// UTF-8 or Latin-1, and dropping it would replay the request without its session).
    pub headers: Vec<(String, Vec<u8>)>,
    pub body: Bytes,
    pub client_ip: String,
    /// When the job was first stored (unix ms, stored as the field `at`), by Redis's clock:
    /// the script that stores it sets it (`queue::ENQUEUE_BEFORE`), so a job not stored yet
    /// has 0. Not this instance's clock, which may be minutes off the other instances' and
    /// Redis's; a retry keeps the time its job was first stored.
    pub enqueued_at_ms: u64,
    pub attempts: u32,
    /// The `Idempotency-Key` the app sees, kept across retries: random, given when the job
    /// is made (jobs stored by earlier versions have none: theirs is their first entry id).
    pub key: Option<String>,
    pub last_error: Option<String>,
    /// Set on the dead letter of an entry that was not a whole job (see [`UnreadableJob`]):
    /// why. Such a letter is never queued again.
    pub unreadable: Option<String>,
}

/// A job's `Idempotency-Key`: 128 random bits in hex. Not the stream entry id: ids are unique
/// only within one route's stream, so two routes' jobs met under one key at the app, which
/// dropped the second as a duplicate; and ids are a clock reading, so a client could send a
/// coming job's id as its own key and have the app drop another client's job.
fn new_key() -> String {
    let mut bytes = [0u8; 16];
    if getrandom::getrandom(&mut bytes).is_err() {
        // No system randomness (never seen on Linux): the time and a counter are unique to
        // this process at least.
        static NEXT: std::sync::atomic::AtomicU64 = std::sync::atomic::AtomicU64::new(0);
        let next = NEXT.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
        bytes[..8].copy_from_slice(&now_ms().to_be_bytes());
        bytes[8..].copy_from_slice(&(u64::from(std::process::id()) << 40 ^ next).to_be_bytes());
    }
    crate::limit::key::hex(&bytes)
}

/// This machine's clock, for the key fallback only: never compared with a time stored in Redis.
fn now_ms() -> u64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map_or(0, |d| d.as_millis() as u64)
}

impl Job {
    /// The job of a request whose head came as `received_head` (field names are kept as the
    /// client spelled them, for the replay to send so).
    pub fn from_request(
        route: &str,
        parts: &http::request::Parts,
        received_head: &[u8],
        body: Bytes,
        client_ip: IpAddr,
    ) -> Job {
        Job {
            route: route.to_string(),
            method: parts.method.to_string(),
            target: parts
                .uri
                .path_and_query()
                .map_or("/", |pq| pq.as_str())
                .to_string(),
            version: parts.version,
            headers: parts
                .headers
                .iter()
                // levee's word alone (see `header::ForwardedWriter`): a client's would reach
                // the app with the replay. `Expect: 100-continue` was the client's question to
                // levee, answered when the body was read: the replay sends its body whole.
                .filter(|(name, _)| {
                    **name != crate::proxy::header::X_LEVEE_MODULES_OFF
                        && **name != http::header::EXPECT
                })
                .map(|(name, value)| {
                    let value = value.as_bytes();
                    let spelled = upstream_spelling(received_head, name, value);
                    (
                        String::from_utf8_lossy(spelled).into_owned(),
                        value.to_vec(),
                    )
                })
                .collect(),
            body,
            client_ip: client_ip.to_string(),
            enqueued_at_ms: 0,
            attempts: 0,
            key: Some(new_key()),
            last_error: None,
            unreadable: None,
        }
    }

    /// Appends the job's fields to an `XADD` (or any field/value command).
    pub fn write_fields(&self, command: &mut redis::Cmd) {
        command
            .arg("route")
            .arg(&self.route)
            .arg("method")
            .arg(&self.method)
            .arg("target")
            .arg(&self.target)
            .arg("version")
            .arg(version_name(self.version))
            .arg("header_lines")
            .arg(self.header_lines())
            .arg("headers")
            .arg(self.headers_json())
            .arg("body")
            .arg(self.body.as_ref())
            .arg("client")
            .arg(&self.client_ip)
            .arg("at")
            .arg(self.enqueued_at_ms)
            .arg("attempts")
            .arg(self.attempts);
        if let Some(key) = &self.key {
            command.arg("key").arg(key);
        }
        if let Some(error) = &self.last_error {
            command.arg("error").arg(error);
        }
        if let Some(reason) = &self.unreadable {
            command.arg("unreadable").arg(reason);
        }
    }

    /// The fields to replay, and the lines they are slices of: the upstream request spells
    /// each name as stored (see `proxy::header::upstream_spelling`). A field that is no longer
    /// valid is left out.
    pub fn replayed_fields(&self) -> (HeaderMap, Bytes) {
        crate::proxy::header::field_lines(
            self.headers
                .iter()
                .map(|(name, value)| (name.as_str(), value.as_slice())),
        )
    }

    /// The headers as HTTP/1.1 field lines, `name: value\r\n` each: lossless, because a
    /// header value never holds CR or LF and a name never holds `:`.
    fn header_lines(&self) -> Vec<u8> {
        let mut lines = Vec::new();
        for (name, value) in &self.headers {
            lines.extend_from_slice(name.as_bytes());
            lines.extend_from_slice(b": ");
            lines.extend_from_slice(value);
            lines.extend_from_slice(b"\r\n");
        }
        lines
    }

    /// The headers in the format levee wrote before `header_lines` (a JSON list of name and
    /// value strings), still written so that an older levee in the same consumer group, as
    /// during a rolling upgrade, can replay the job. Values that are not UTF-8 cannot be
    /// written there and are left out, as that version did.
    fn headers_json(&self) -> String {
        let readable: Vec<(&str, &str)> = self
            .headers
            .iter()
            .filter_map(|(name, value)| Some((name.as_str(), std::str::from_utf8(value).ok()?)))
            .collect();
        serde_json::to_string(&readable).unwrap_or_else(|_| "[]".into())
    }

    /// Reads a job from stream fields; `id` is the entry id (the key of a first attempt).
    /// Jobs stored by older versions carry only the JSON `headers`. A job that lacks what a
    /// replay needs is [`UnreadableJob`]: what could be read of it, and what could not.
    pub fn from_fields(
        id: &str,
        fields: &HashMap<String, Vec<u8>>,
    ) -> Result<Job, Box<UnreadableJob>> {
        let text = |name: &str| {
            fields
                .get(name)
                .map(|value| String::from_utf8_lossy(value).into_owned())
        };
        let mut missing: Vec<&str> = Vec::new();
        let mut required = |name: &'static str| {
            text(name).unwrap_or_else(|| {
                missing.push(name);
                String::new()
            })
        };
        let (route, method, target) = (required("route"), required("method"), required("target"));
        let headers = match fields.get("header_lines") {
            Some(lines) => parse_header_lines(lines),
            None => text("headers").and_then(|json| {
                serde_json::from_str::<Vec<(String, String)>>(&json)
                    .ok()
                    .map(|pairs| {
                        pairs
                            .into_iter()
                            .map(|(name, value)| (name, value.into_bytes()))
                            .collect()
                    })
            }),
        };
        let headers_readable = headers.is_some();
        let job = Job {
            route,
            method,
            target,
            version: fields
                .get("version")
                .map_or(http::Version::HTTP_11, |name| version_named(name)),
            headers: headers.unwrap_or_default(),
            body: Bytes::from(fields.get("body").cloned().unwrap_or_default()),
            client_ip: text("client").unwrap_or_default(),
            enqueued_at_ms: text("at").and_then(|v| v.parse().ok()).unwrap_or(0),
            attempts: text("attempts").and_then(|v| v.parse().ok()).unwrap_or(0),
            key: Some(text("key").unwrap_or_else(|| id.to_string())),
            last_error: text("error"),
            unreadable: None,
        };
        let mut reasons: Vec<String> = missing
            .iter()
            .map(|name| format!("no `{name}` field"))
            .collect();
        if !headers_readable {
            reasons.push("its headers cannot be read".into());
        }
        // The dead letter of an unreadable entry: whole again to look at, but not a job.
        if let Some(reason) = text("unreadable") {
            reasons.push(reason);
        }
        if reasons.is_empty() {
            return Ok(job);
        }
        Err(Box::new(UnreadableJob {
            reason: reasons.join(", "),
            salvaged: job,
        }))
    }

    /// The job's own key (its id in `202` answers, `{job}`, and the delayed set): the app
    /// sees it in `Idempotency-Key` unless the client's request carried a key of its own.
    pub fn idempotency_key(&self) -> &str {
        self.key.as_deref().unwrap_or("")
    }

    /// The `Idempotency-Key` the app sees with this job: the client's own when its request
    /// carried one that is not blank, else the job's (see `worker::replay`).
    pub fn key_the_app_sees(&self) -> String {
        self.headers
            .iter()
            .find(|(name, value)| {
                name.eq_ignore_ascii_case("idempotency-key") && !value.trim_ascii().is_empty()
            })
            .map_or_else(
                || self.idempotency_key().to_string(),
                |(_, value)| String::from_utf8_lossy(value).into_owned(),
            )
    }
}

/// A stream entry that is not a whole job (written by hand, cut short, or by a levee that
/// stored other fields): it cannot be replayed, and goes to the dead letters as it is.
#[derive(Debug, Clone, PartialEq)]
pub struct UnreadableJob {
    /// What is missing or broken, in words.
    pub reason: String,
    /// Every field that could be read; empty strings for the ones that could not.
    pub salvaged: Job,
}

impl UnreadableJob {
    /// The job as it is kept among the dead letters: what could be read, and why it was
    /// not replayed.
    pub fn into_dead_letter(self) -> Job {
        let mut job = self.salvaged;
        job.last_error = Some(format!("unreadable job: {}", self.reason));
        job.unreadable = Some(self.reason);
        job
    }
}

/// How a job's `version` field spells `version`: as the request line does.
pub(crate) fn version_name(version: http::Version) -> &'static str {
    if version == http::Version::HTTP_10 {
        "HTTP/1.0"
    } else {
        "HTTP/1.1"
    }
}

/// The version a job's `version` field names: HTTP/1.0, or else HTTP/1.1, the version levee
/// tells an upstream for any request not HTTP/1.0 (see `client::fastcgi::encode_begin`).
fn version_named(name: &[u8]) -> http::Version {
    if name == b"HTTP/1.0" {
        http::Version::HTTP_10
    } else {
        http::Version::HTTP_11
    }
}

/// Reads `name: value\r\n` lines written by [`Job::header_lines`]; `None` if one is broken.
fn parse_header_lines(lines: &[u8]) -> Option<Vec<(String, Vec<u8>)>> {
    let mut headers = Vec::new();
    let mut rest = lines;
    while !rest.is_empty() {
        let end = rest.windows(2).position(|pair| pair == b"\r\n")?;
        let (line, after) = (&rest[..end], &rest[end + 2..]);
        let colon = line.iter().position(|&byte| byte == b':')?;
        let name = std::str::from_utf8(&line[..colon]).ok()?;
        let value = line[colon + 1..].strip_prefix(b" ")?;
        headers.push((name.to_string(), value.to_vec()));
        rest = after;
    }
    Some(headers)
}

/// Stream entries from a Redis reply: `[[id, [field, value, …]], …]`.
pub fn entries(value: &redis::Value) -> Vec<(String, HashMap<String, Vec<u8>>)> {
    let redis::Value::Array(items) = value else {
        return Vec::new();
    };
    items
        .iter()
        .filter_map(|item| {
            let redis::Value::Array(pair) = item else {
                return None;
            };
            let id = bytes_of(pair.first()?)?;
            let redis::Value::Array(raw) = pair.get(1)? else {
                return None;
            };
            let mut fields = HashMap::new();
            for chunk in raw.chunks(2) {
                if let [name, value] = chunk {
                    fields.insert(
                        String::from_utf8_lossy(&bytes_of(name)?).into_owned(),
                        bytes_of(value)?,
                    );
                }
            }
            Some((String::from_utf8_lossy(&id).into_owned(), fields))
        })
        .collect()
}

pub fn bytes_of(value: &redis::Value) -> Option<Vec<u8>> {
    match value {
        redis::Value::BulkString(bytes) => Some(bytes.clone()),
        redis::Value::SimpleString(text) => Some(text.as_bytes().to_vec()),
        redis::Value::Int(number) => Some(number.to_string().into_bytes()),
        _ => None,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The fields `job` is stored with, as a stream entry gives them back.
    fn stored_fields(job: &Job) -> HashMap<String, Vec<u8>> {
        let mut command = redis::cmd("XADD");
        job.write_fields(&mut command);
        let args: Vec<Vec<u8>> = command
            .args_iter()
            .skip(1)
            .filter_map(|arg| match arg {
                redis::Arg::Simple(bytes) => Some(bytes.to_vec()),
                _ => None,
            })
            .collect();
        args.chunks(2)
            .map(|pair| {
                (
                    String::from_utf8_lossy(&pair[0]).into_owned(),
                    pair[1].clone(),
                )
            })
            .collect()
    }

    #[test]
    fn fields_round_trip() {
        let job = Job {
            route: "notify".into(),
            method: "POST".into(),
            target: "/notify.php?x=1".into(),
            // Not the default: a field left unread would come back as HTTP/1.1.
            version: http::Version::HTTP_10,
            headers: vec![
                (
                    "content-type".into(),
                    b"application/x-www-form-urlencoded".to_vec(),
                ),
                // Raw UTF-8 in a cookie, and a byte that is not UTF-8 at all.
                (
                    "cookie".into(),
                    b"PHPSESSID=s1; name=\xe8\xae\xba; x=\xff".to_vec(),
                ),
                ("x-empty".into(), Vec::new()),
                ("x-spaced".into(), b" a:b ".to_vec()),
            ],
            body: Bytes::from_static(b"a=1&b=\xff"),
            client_ip: "203.0.113.9".into(),
            enqueued_at_ms: 7,
            attempts: 2,
            key: Some("1-0".into()),
            last_error: None,
            unreadable: None,
        };
        assert_eq!(Job::from_fields("9-9", &stored_fields(&job)), Ok(job));
    }

    /// A job as the versions before `header_lines` stored it: the headers only as JSON.
    #[test]
    fn jobs_stored_by_older_versions_still_decode() {
        let fields: HashMap<String, Vec<u8>> = [
            ("route", &b"notify"[..]),
            ("method", b"POST"),
            ("target", b"/notify.php?kind=like"),
            (
                "headers",
                br#"[["content-type","application/x-www-form-urlencoded"],["cookie","PHPSESSID=s1"]]"#,
            ),
            ("body", b"like=1"),
            ("client", b"203.0.113.9"),
            ("at", b"1700000000000"),
            ("attempts", b"1"),
            ("key", b"1700000000000-0"),
            ("error", b"the app answered 500"),
        ]
        .into_iter()
        .map(|(name, value)| (name.to_string(), value.to_vec()))
        .collect();
        let job = Job::from_fields("1700000000001-0", &fields).expect("an old job decodes");
        assert_eq!(
            job.headers,
            vec![
                (
                    "content-type".to_string(),
                    b"application/x-www-form-urlencoded".to_vec()
                ),
                ("cookie".to_string(), b"PHPSESSID=s1".to_vec()),
            ]
        );
        assert_eq!(
            (job.method.as_str(), job.target.as_str(), &job.body[..]),
            ("POST", "/notify.php?kind=like", &b"like=1"[..])
        );
        assert_eq!(job.idempotency_key(), "1700000000000-0");
        assert_eq!(job.key_the_app_sees(), "1700000000000-0");
        // A client's own key is the one the app sees (a blank one is none).
        let mut own = job.clone();
        own.headers
            .push(("Idempotency-Key".into(), b"order-7".to_vec()));
        assert_eq!(
            (own.idempotency_key(), own.key_the_app_sees().as_str()),
            ("1700000000000-0", "order-7")
        );
        let mut blank = job.clone();
        blank
            .headers
            .push(("idempotency-key".into(), b" ".to_vec()));
        assert_eq!(blank.key_the_app_sees(), "1700000000000-0");
        assert_eq!(job.attempts, 1);
        assert_eq!(job.last_error.as_deref(), Some("the app answered 500"));
        // Stored before the client's version was kept: replayed as HTTP/1.1, as it was then.
        assert_eq!(job.version, http::Version::HTTP_11);
    }

    /// The client's version is stored as the request line spells it, and only HTTP/1.0 is
    /// read back as anything but HTTP/1.1.
    /// A job of the `notify` route from `parts`, as a client at 192.0.2.1 sent it.
    fn notify_job(parts: &http::request::Parts, body: Bytes) -> Job {
        Job::from_request("notify", parts, b"", body, IpAddr::from([192, 0, 2, 1]))
    }

    #[test]
    fn the_clients_version_is_stored_and_read_back() {
        let (parts, ()) = http::Request::post("/notify.php")
            .version(http::Version::HTTP_10)
            .body(())
            .expect("request")
            .into_parts();
        let job = notify_job(&parts, Bytes::new());
        let fields = stored_fields(&job);
        assert_eq!(
            fields.get("version").map(Vec::as_slice),
            Some(&b"HTTP/1.0"[..])
        );
        assert_eq!(
            Job::from_fields("1-0", &fields).map(|job| job.version),
            Ok(http::Version::HTTP_10)
        );
        for (stored, read) in [
            (&b"HTTP/1.1"[..], http::Version::HTTP_11),
            (b"HTTP/2.0", http::Version::HTTP_11),
            (b"", http::Version::HTTP_11),
        ] {
            let mut fields = fields.clone();
            fields.insert("version".into(), stored.to_vec());
            assert_eq!(
                Job::from_fields("1-0", &fields).map(|job| job.version),
                Ok(read)
            );
        }
    }

    #[test]
    fn a_clients_expect_is_not_replayed() {
        let (parts, ()) = http::Request::post("/notify.php")
            .header("expect", "100-continue")
            .header("x-levee-modules-off", "ranking")
            .header("cookie", "a=1")
            .body(())
            .expect("request")
            .into_parts();
        let job = notify_job(&parts, Bytes::from_static(b"like=1"));
        let names: Vec<&str> = job.headers.iter().map(|(name, _)| name.as_str()).collect();
        assert_eq!(names, ["cookie"]);
    }

    /// An entry that is not a whole job keeps what could be read, says what could not, and
    /// its dead letter stays unreadable when read back (never queued again as a job).
    #[test]
    fn an_unreadable_entry_keeps_what_could_be_read_and_stays_unreadable() {
        let fields: HashMap<String, Vec<u8>> = [
            ("method", &b"POST"[..]),
            ("target", b"/notify.php"),
            ("header_lines", b"broken"),
            ("body", b"like=1"),
        ]
        .into_iter()
        .map(|(name, value)| (name.to_string(), value.to_vec()))
        .collect();
        let unreadable = Job::from_fields("5-0", &fields).expect_err("not a whole job");
        assert_eq!(
            unreadable.reason,
            "no `route` field, its headers cannot be read"
        );
        assert_eq!(
            (
                unreadable.salvaged.method.as_str(),
                &unreadable.salvaged.body[..]
            ),
            ("POST", &b"like=1"[..])
        );

        let letter = unreadable.into_dead_letter();
        let again = Job::from_fields("6-0", &stored_fields(&letter)).expect_err("still unreadable");
        assert!(
            again.reason.contains("its headers cannot be read"),
            "{}",
            again.reason
        );
    }

    /// An older levee replaying next to this one (a rolling upgrade) reads the JSON headers.
    #[test]
    fn the_json_headers_older_versions_read_are_still_written() {
        let job = Job {
            route: "notify".into(),
            method: "POST".into(),
            target: "/".into(),
            version: http::Version::HTTP_11,
            headers: vec![
                ("cookie".into(), b"PHPSESSID=s1".to_vec()),
                ("x-latin1".into(), b"caf\xe9".to_vec()),
            ],
            body: Bytes::new(),
            client_ip: String::new(),
            enqueued_at_ms: 0,
            attempts: 0,
            key: None,
            last_error: None,
            unreadable: None,
        };
        let old: Vec<(String, String)> =
            serde_json::from_str(&job.headers_json()).expect("json headers");
        assert_eq!(
            old,
            vec![("cookie".to_string(), "PHPSESSID=s1".to_string())]
        );
    }
}
