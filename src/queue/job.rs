//! A queued request and its encoding as Redis stream fields.

use std::collections::HashMap;
use std::net::IpAddr;
use std::time::{SystemTime, UNIX_EPOCH};

use bytes::Bytes;

/// A request stored for later.
#[derive(Debug, Clone, PartialEq)]
pub struct Job {
    pub route: String,
    pub method: String,
    /// Path and query as the client sent them.
    pub target: String,
    pub headers: Vec<(String, String)>,
    pub body: Bytes,
    pub client_ip: String,
    pub enqueued_at_ms: u64,
    pub attempts: u32,
    /// The id the job got when first stored: the `Idempotency-Key`, kept across retries.
    pub key: Option<String>,
    pub last_error: Option<String>,
}

fn now_ms() -> u64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map_or(0, |d| d.as_millis() as u64)
}

impl Job {
    pub fn from_request(
        route: &str,
        parts: &http::request::Parts,
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
            headers: parts
                .headers
                .iter()
                .filter_map(|(name, value)| {
                    value
                        .to_str()
                        .ok()
                        .map(|value| (name.to_string(), value.to_string()))
                })
                .collect(),
            body,
            client_ip: client_ip.to_string(),
            enqueued_at_ms: now_ms(),
            attempts: 0,
            key: None,
            last_error: None,
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
            .arg("headers")
            .arg(serde_json::to_string(&self.headers).unwrap_or_else(|_| "[]".into()))
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
    }

    /// Reads a job from stream fields; `id` is the entry id (the key of a first attempt).
    pub fn from_fields(id: &str, fields: &HashMap<String, Vec<u8>>) -> Option<Job> {
        let text = |name: &str| {
            fields
                .get(name)
                .map(|value| String::from_utf8_lossy(value).into_owned())
        };
        Some(Job {
            route: text("route")?,
            method: text("method")?,
            target: text("target")?,
            headers: serde_json::from_str(&text("headers")?).ok()?,
            body: Bytes::from(fields.get("body").cloned().unwrap_or_default()),
            client_ip: text("client").unwrap_or_default(),
            enqueued_at_ms: text("at").and_then(|v| v.parse().ok()).unwrap_or(0),
            attempts: text("attempts").and_then(|v| v.parse().ok()).unwrap_or(0),
            key: Some(text("key").unwrap_or_else(|| id.to_string())),
            last_error: text("error"),
        })
    }

    /// The key the app sees in `Idempotency-Key`.
    pub fn idempotency_key(&self) -> &str {
        self.key.as_deref().unwrap_or("")
    }
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

    #[test]
    fn fields_round_trip() {
        let job = Job {
            route: "notify".into(),
            method: "POST".into(),
            target: "/notify.php?x=1".into(),
            headers: vec![(
                "content-type".into(),
                "application/x-www-form-urlencoded".into(),
            )],
            body: Bytes::from_static(b"a=1&b=\xff"),
            client_ip: "203.0.113.9".into(),
            enqueued_at_ms: 7,
            attempts: 2,
            key: Some("1-0".into()),
            last_error: None,
        };
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
        let fields: HashMap<String, Vec<u8>> = args
            .chunks(2)
            .map(|pair| {
                (
                    String::from_utf8_lossy(&pair[0]).into_owned(),
                    pair[1].clone(),
                )
            })
            .collect();
        assert_eq!(Job::from_fields("9-9", &fields), Some(job));
    }
}
