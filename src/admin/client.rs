//! The CLI's side of the admin listener: `levee status`, `level`, `module`, `breaker`, `reload`.

use std::io::Write as _;
use std::net::SocketAddr;
use std::path::Path;
use std::time::Duration;

use bytes::Bytes;
use http::{header, HeaderValue, Method, Request};
use http_body_util::{BodyExt, Full};

use crate::config::units::Shown;
use crate::proxy::client::{Client, ClientSettings};

/// Where the admin listener is: `--admin`, else the policy directory's `[admin] listen`, else
/// the default `127.0.0.1:9901`.
/// When the policy does not compile (often exactly when `levee reload` is run, to see its
/// errors), `[admin] listen` is still read from whichever file parses and sets it; only
/// without one is the default used, with a warning on stderr, since it may be another
/// instance's listener.
pub fn admin_address(explicit: Option<SocketAddr>, policies: &Path) -> SocketAddr {
    let default = SocketAddr::from(([127, 0, 0, 1], 9901));
    if let Some(address) = explicit {
        return address;
    }
    match crate::config::load_dir(policies, None) {
        Ok(policy) => policy.admin.listen,
        Err(diagnostics) => match written_admin_listen(policies) {
            Some(address) => address,
            None => {
                // Not `eprintln!`, which panics on a stderr that takes nothing.
                let _ = writeln!(
                    std::io::stderr(),
                    "warning: {}; using {default} (pass --admin ADDRESS to choose)",
                    why_no_admin_listen(policies, &diagnostics)
                );
                default
            }
        },
    }
}

/// Why the policy directory names no admin listener: the directory itself when that is the
/// problem (it does not exist, holds no policy file), else that the policy does not compile.
fn why_no_admin_listen(policies: &Path, diagnostics: &crate::config::Diagnostics) -> String {
    match diagnostics.0.as_slice() {
        [only] if only.line == 0 && only.file == policies => {
            format!("{}: {}", policies.display(), only.message)
        }
        // A file this user may not read (tokens kept from other users): said as such, not
        // as a policy that does not compile.
        [first, ..] if first.line == 0 => format!(
            "{}: {} (the admin address may be written there)",
            first.file.display(),
            first.message
        ),
        _ => format!(
            "the policy in {} does not compile ({} error(s), see `levee check`) and no file of it that parses sets [admin] listen",
            policies.display(),
            diagnostics.0.len()
        ),
    }
}

/// Where a diagnostic of `/status` is: `file:line:col`, or the file alone for one about a
/// whole file or directory (line 0), as `levee check` prints it.
fn json_location(diagnostic: &serde_json::Value) -> String {
    let file = diagnostic["file"].as_str().unwrap_or("?");
    match diagnostic["line"].as_u64() {
        Some(line) if line > 0 => format!("{file}:{line}:{}", diagnostic["col"]),
        _ => file.to_string(),
    }
}

/// `[admin] listen` as written in a policy directory, read file by file without compiling.
/// A file that is not valid TOML (a save with a typo, often the one `levee reload` is run
/// to explain) is read line by line.
fn written_admin_listen(policies: &Path) -> Option<SocketAddr> {
    let paths = crate::config::compile::policy_file_paths(policies).ok()?;
    paths.iter().find_map(|path| {
        let text = std::fs::read_to_string(path).ok()?;
        match toml::from_str::<toml::Table>(&text) {
            Ok(table) => table.get("admin")?.get("listen")?.as_str()?.parse().ok(),
            Err(_) => listen_line_in_admin_table(&text),
        }
    })
}

/// `listen = "ADDRESS"` on a line of its own within an `[admin]` table, in text that may
/// not parse as TOML.
fn listen_line_in_admin_table(text: &str) -> Option<SocketAddr> {
    let mut in_admin = false;
    for line in text.lines() {
        let line = line.trim();
        if line.starts_with('[') {
            let header = line.split('#').next().unwrap_or_default().trim();
            in_admin = header.trim_start_matches('[').trim_end_matches(']').trim() == "admin"
                && !header.starts_with("[[");
            continue;
        }
        if !in_admin {
            continue;
        }
        let Some((key, value)) = line.split_once('=') else {
            continue;
        };
        if key.trim() != "listen" {
            continue;
        }
        let value = value.trim();
        let quoted = value.strip_prefix('"')?;
        let address = &quoted[..quoted.find('"')?];
        return address.parse().ok();
    }
    None
}

/// `name` as one segment of an admin path: bytes other than letters, digits and `-._~`
/// percent-encoded, so names like `通知` or `my api` reach the admin listener whole.
pub fn path_segment(name: &str) -> String {
    let mut out = String::with_capacity(name.len());
    for byte in name.bytes() {
        if byte.is_ascii_alphanumeric() || matches!(byte, b'-' | b'.' | b'_' | b'~') {
            out.push(char::from(byte));
        } else {
            out.push_str(&format!("%{byte:02X}"));
        }
    }
    out
}

/// Sends one admin request; returns the status and body text.
pub async fn call(
    admin: SocketAddr,
    method: Method,
    path: &str,
    body: &str,
    token: Option<&str>,
) -> Result<(u16, String), String> {
    let client = Client::new(ClientSettings {
        host: admin.ip().to_string(),
        port: admin.port(),
        authority: HeaderValue::from_str(&admin.to_string())
            .unwrap_or_else(|_| HeaderValue::from_static("localhost")),
        tls: None,
        connect_timeout: Duration::from_secs(10),
        pool_idle_timeout: Duration::ZERO,
        pool_max_idle: 0,
        socket: None,
        fastcgi: None,
    });
    let mut request = Request::builder().method(method).uri(path).header(
        "x-levee-operator",
        std::env::var("USER").unwrap_or_else(|_| "cli".into()),
    );
    if let Some(token) = token {
        request = request.header(header::AUTHORIZATION, format!("Bearer {token}"));
    }
    let request = request
        .body(
            Full::new(Bytes::from(body.to_string()))
                .map_err(|never| match never {})
                .boxed_unsync(),
        )
        .map_err(|error| error.to_string())?;
    // A reload waits for a policy file being written to be closed (for as long as it is
    // written, at most `RELOAD_WAITS_FOR_WRITERS`): given up on first, the CLI said the
    // listener did not answer while the reload went on.
    let patience = if path == "/reload" {
        crate::config::store::RELOAD_WAITS_FOR_WRITERS + Duration::from_secs(10)
    } else {
        Duration::from_secs(10)
    };
    let response = tokio::time::timeout(patience, client.send(request))
        .await
        .map_err(|_| {
            format!(
                "the admin listener at {admin} did not answer within {}",
                Shown(patience)
            )
        })?
        .map_err(|error| format!("cannot reach the admin listener at {admin}: {error} (is levee running? is --admin right? A changed [admin] listen takes effect only when levee restarts: until then pass --admin with the address it started with)"))?;
    let status = response.status().as_u16();
    let from_levee = response.headers().contains_key(&crate::admin::ADMIN_MARK);
    let body = response
        .into_body()
        .collect()
        .await
        .map_err(|error| error.to_string())?
        .to_bytes();
    let text = String::from_utf8_lossy(&body).into_owned();
    // Not levee's body shape: a site's own JSON would pass for it.
    if !from_levee {
        return Err(format!(
            "the answer from {admin} (HTTP {status}) did not come from levee's admin listener, so nothing was changed in levee; is --admin (or [admin] listen) the admin address, not the public one?"
        ));
    }
    Ok((status, text))
}

/// What an admin change was about, to say what is in effect after it.
pub enum Changed<'a> {
    Level,
    Module(&'a str),
    Breaker(&'a str),
}

/// What is in effect after a change, read from the admin API's answer to it: `level 1 in
/// effect (runtime)`, `module ranking OFF (runtime, by alice)`, `breaker app open (pinned
/// open at runtime)`. An answer without those figures (an older levee) gets a plain "done".
pub fn changed_text(answer: &str, changed: Changed<'_>) -> String {
    let answer = printable(&serde_json::from_str(answer).unwrap_or_default());
    let degrade = &answer["degrade"];
    let text = match changed {
        Changed::Level => degrade["level"].as_u64().map(|level| {
            format!(
                "level {level} in effect ({})",
                degrade["level_origin"].as_str().unwrap_or("?")
            )
        }),
        Changed::Module(name) => {
            let module = &degrade["modules"][name];
            module["off"].as_bool().map(|off| {
                let by = module["changed_by"]
                    .as_str()
                    .map(|by| format!(", by {by}"))
                    .unwrap_or_default();
                format!(
                    "module {name} {} ({}{by})",
                    if off { "OFF" } else { "on" },
                    module["origin"].as_str().unwrap_or("?")
                )
            })
        }
        Changed::Breaker(name) => {
            let breaker = &answer["breaker"];
            breaker["state"].as_str().map(|state| {
                let control = match breaker["force"].as_str() {
                    Some("auto") | None => "automatic".to_string(),
                    Some(force) => match breaker["forced_by"].as_str() {
                        Some("runtime") => format!("pinned {force} at runtime"),
                        Some("policy") => format!("pinned {force} by the policy"),
                        other => format!("pinned {force} by {}", other.unwrap_or("?")),
                    },
                };
                format!("breaker {name} {state} ({control})")
            })
        }
    };
    format!("{}\n", text.unwrap_or_else(|| "done".into()))
}

/// `value` with the control characters of its texts (and keys) escaped (`\n`, `\u{1b}`).
/// What `/status` shows partly comes from Redis (who switched a module, the module names a
/// switch names), which anyone who can write there controls: printed as it is, a newline
/// would forge a line of the summary and an escape sequence would act on the operator's
/// terminal.
pub fn printable(value: &serde_json::Value) -> serde_json::Value {
    use serde_json::Value;
    let text = |text: &str| -> String {
        if text.chars().any(char::is_control) {
            text.chars()
                .map(|c| {
                    if c.is_control() {
                        c.escape_debug().to_string()
                    } else {
                        c.to_string()
                    }
                })
                .collect()
        } else {
            text.to_string()
        }
    };
    match value {
        Value::String(string) => Value::String(text(string)),
        Value::Array(items) => Value::Array(items.iter().map(printable).collect()),
        Value::Object(map) => Value::Object(
            map.iter()
                .map(|(key, item)| (text(key), printable(item)))
                .collect(),
        ),
        other => other.clone(),
    }
}

/// `millis` as a duration to the second, rounded up (0 stays 0; under a second reads `1s`).
fn whole_seconds(millis: u64) -> Duration {
    Duration::from_secs(millis.div_ceil(1000))
}

/// The strings of a JSON list (none when it is not one).
fn texts(list: &serde_json::Value) -> Vec<&str> {
    list.as_array()
        .into_iter()
        .flatten()
        .filter_map(serde_json::Value::as_str)
        .collect()
}

/// `items` joined by `separator`, or `none` when there are none.
fn listed<T: AsRef<str>>(items: &[T], separator: &str, none: &str) -> String {
    if items.is_empty() {
        return none.to_string();
    }
    items
        .iter()
        .map(AsRef::as_ref)
        .collect::<Vec<&str>>()
        .join(separator)
}

/// `12s ago` for a unix time in `/status`, by this machine's clock (the CLI runs beside the
/// levee it asks); `None` when there is none.
fn ago(unix: &serde_json::Value) -> Option<String> {
    let at = unix.as_u64().filter(|at| *at > 0)?;
    let now = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .ok()?
        .as_secs();
    Some(format!(
        "{} ago",
        Shown(Duration::from_secs(now.saturating_sub(at)))
    ))
}

/// What the triggers say of the automatic level, under the `degrade` line: why it is up,
/// what holds now, and when it comes down. Nothing while it is 0 and no trigger holds.
fn automatic_level_lines(out: &mut String, degrade: &serde_json::Value) {
    use std::fmt::Write as _;
    let report = &degrade["automatic"];
    let level = degrade["automatic_level"].as_u64().unwrap_or(0);
    let holding: Vec<String> = report["holding"]
        .as_array()
        .into_iter()
        .flatten()
        .map(|held| {
            // To the second: `5.599s of its 2s` read as noise.
            let millis = |key: &str| whole_seconds(held[key].as_u64().unwrap_or(0));
            format!(
                "{} (level {}, {} of its {})",
                held["trigger"].as_str().unwrap_or("?"),
                held["level"],
                Shown(millis("for_ms")),
                Shown(millis("needs_ms"))
            )
        })
        .collect();
    if level == 0 && holding.is_empty() {
        return;
    }
    if level > 0 {
        let since = ago(&report["changed_at_unix"])
            .map(|ago| format!(" {ago}"))
            .unwrap_or_default();
        let raised_by = texts(&report["raised_by"]);
        let _ = writeln!(
            out,
            "         automatic level {level}, changed{since}, raised by {}",
            listed(&raised_by, ", ", "?")
        );
    }
    let _ = writeln!(
        out,
        "         triggers holding: {}",
        listed(&holding, "; ", "none")
    );
    if let Some(left) = report["lowers_in_ms"].as_u64() {
        let _ = writeln!(
            out,
            "         comes down in {} (cool_down) unless a trigger holds again",
            Shown(whole_seconds(left))
        );
    }
}

/// A readable summary of `GET /status`.
pub fn summarize(status: &serde_json::Value) -> String {
    use std::fmt::Write as _;
    let status = &printable(status);
    let mut out = String::new();
    let policy = &status["policy"];
    let _ = writeln!(
        out,
        "levee {}{}{}",
        status["version"].as_str().unwrap_or("?"),
        // An older levee sends no commit.
        status["commit"]
            .as_str()
            .map(|commit| format!(" ({commit})"))
            .unwrap_or_default(),
        if status["draining"] == true {
            "  (DRAINING)"
        } else {
            ""
        }
    );
    let _ = writeln!(
        out,
        "policy   generation {} · hash {} · {}{}",
        policy["generation"],
        policy["hash"].as_str().unwrap_or("?"),
        policy["dir"].as_str().unwrap_or("?"),
        ago(&policy["loaded_at_unix"])
            .map(|ago| format!(" · loaded {ago}"))
            .unwrap_or_default()
    );
    if let Some(problem) = policy["watch_error"].as_str() {
        let _ = writeln!(
            out,
            "         NOT WATCHED: {problem}: edits are not read until it is back"
        );
    }
    let written = texts(&policy["being_written"]);
    if !written.is_empty() {
        let _ = writeln!(
            out,
            "         being written: {} (a reload waits until it is closed)",
            written.join(", ")
        );
    }
    if let Some(error) = policy["last_reload_error"].as_object() {
        let items = error["errors"].as_array().map_or(&[][..], Vec::as_slice);
        // As `levee check` prints them: each with its severity (a file not read is a warning
        // beside the errors it explains) and its hint on the line under it. A levee from
        // before `severity` was sent listed errors only.
        let severity =
            |item: &serde_json::Value| item["severity"].as_str().unwrap_or("error").to_string();
        let _ = writeln!(
            out,
            "         LAST RELOAD REFUSED ({} error(s)):",
            items
                .iter()
                .filter(|item| severity(item) == "error")
                .count()
        );
        for item in items {
            let _ = writeln!(
                out,
                "           {}: {}: {}",
                json_location(item),
                severity(item),
                item["message"].as_str().unwrap_or("")
            );
            if let Some(hint) = item["hint"].as_str() {
                let _ = writeln!(out, "             hint: {hint}");
            }
        }
    }
    for warning in policy["warnings"].as_array().into_iter().flatten() {
        // A warning's hint is on its second line; the summary keeps to one line each. (The
        // status was made printable: its line break is the two characters `\n` here.)
        let first_line = warning
            .as_str()
            .unwrap_or("")
            .split("\\n")
            .next()
            .unwrap_or("");
        let _ = writeln!(out, "         {first_line}");
    }
    // A levee from before `connections` was sent has none to show.
    let connections = &status["connections"];
    if let (Some(open), Some(max)) = (connections["open"].as_i64(), connections["max"].as_i64()) {
        let _ = writeln!(
            out,
            "clients  {open} connection(s) open of at most {max}{}",
            if open >= max {
                " · AT THE CAP: new ones wait"
            } else {
                ""
            }
        );
    }
    let degrade = &status["degrade"];
    let _ = writeln!(
        out,
        "degrade  level {} ({})",
        degrade["level"],
        degrade["level_origin"].as_str().unwrap_or("?")
    );
    automatic_level_lines(&mut out, degrade);
    if let Some(modules) = degrade["modules"].as_object() {
        for (name, module) in modules {
            let state = if module["off"] == true { "OFF" } else { "on" };
            // The origin is the on/off state's, not the tier's: said so, with who switched it
            // (only when a runtime switch is what holds: off by the level, the last operator
            // switched it on, and is not who turned it off).
            let by = module["changed_by"]
                .as_str()
                .filter(|_| module["origin"] == "runtime")
                .map(|by| format!(", by {by}"))
                .unwrap_or_default();
            let _ = writeln!(
                out,
                "         module {name:<16} {state:<4} tier {} · {} from {}{by}",
                module["tier"],
                if module["off"] == true { "off" } else { "on" },
                module["origin"].as_str().unwrap_or("?")
            );
        }
    }
    // Saved for a name the policy does not have: not in effect now, in effect again if a
    // reload brings the name back.
    let saved = &degrade["saved_not_in_policy"];
    for (name, module) in saved["modules"].as_object().into_iter().flatten() {
        let state = if module["off"] == true { "off" } else { "on" };
        let _ = writeln!(
            out,
            "         saved: module {name} {state}, not in the policy (in effect again if it comes back; `levee module {name} policy` clears it)"
        );
    }
    for (name, pin) in saved["breakers"].as_object().into_iter().flatten() {
        let _ = writeln!(
            out,
            "         saved: breaker {name} pinned {}, not in the policy (in effect again if it comes back; `levee breaker {name} auto` clears it)",
            pin["force"].as_str().unwrap_or("?")
        );
    }
    // Indexing a JSON value (not a map) gives null for a key an older levee does not send.
    let redis = &status["redis"];
    if redis.is_object() {
        let _ = writeln!(
            out,
            "redis    {} · {}",
            describe_redis_target(&redis["target"]),
            if redis["up"] == true {
                "up"
            } else if redis["nodes"]
                .as_array()
                .is_some_and(|nodes| nodes.iter().any(|node| node["up"] == true))
            {
                "PARTLY DOWN"
            } else {
                "DOWN"
            }
        );
        if let Some(error) = redis["last_error"].as_str() {
            let _ = writeln!(out, "         last call: {error}");
        }
        if let Some(error) = redis["full"]["error"].as_str() {
            let _ = writeln!(
                out,
                "         FULL: refused a write {}s ago ({error}); reads still answer",
                redis["full"]["seconds_ago"].as_u64().unwrap_or(0)
            );
        }
        // An older levee sends no `rate_limits`: its `up` said the same.
        if redis["rate_limits"] == "fallback" && redis["up"] == true {
            // A background call found Redis back; the breaker closes on the next decision.
            let _ = writeln!(
                out,
                "         rate limits still on their on_redis_error fallbacks: the next rate-limited request goes back to Redis"
            );
        } else if redis["rate_limits"] == "fallback" {
            let _ = writeln!(
                out,
                "         rate limits on their on_redis_error fallbacks (the health breaker is open)"
            );
        } else if redis["rate_limits"] == "fallback (redis is full)" {
            let _ = writeln!(
                out,
                "         rate limits decided in-process, each at its on_redis_error fallback: redis refuses them for want of memory"
            );
        } else if redis["rate_limits"] == "partly fallback" {
            let _ = writeln!(
                out,
                "         rate limits of the keys on the nodes down on their on_redis_error fallbacks"
            );
        }
        if let Some(master) = redis["master"].as_str() {
            let _ = writeln!(out, "         master now {master} (named by the sentinels)");
        }
        // A cluster's masters each have a health breaker: name those out.
        for node in redis["nodes"].as_array().into_iter().flatten() {
            if node["up"] == false {
                let _ = writeln!(
                    out,
                    "         node {} DOWN (rules with buckets there use their fallback)",
                    node["node"].as_str().unwrap_or("?")
                );
            }
        }
    } else {
        let _ = writeln!(out, "redis    none (embedded default)");
    }
    for upstream in status["upstreams"].as_array().into_iter().flatten() {
        let breaker = &upstream["breaker"];
        let url = upstream["url"].as_str().unwrap_or("?");
        let address = match upstream["socket"].as_str() {
            Some(socket) => format!("{url} via unix:{socket}"),
            None => url.to_string(),
        };
        // Slots taken of `max_inflight`, and requests shed there since the start.
        let slots = match (
            upstream["inflight"].as_u64(),
            upstream["max_inflight"].as_u64(),
        ) {
            (Some(taken), Some(max)) => {
                let shed: Vec<String> = upstream["shed"]
                    .as_object()
                    .into_iter()
                    .flatten()
                    .filter_map(|(tier, count)| {
                        let count = count.as_u64().filter(|count| *count > 0)?;
                        Some(format!("{count} of tier {tier}"))
                    })
                    .collect();
                format!(
                    " · inflight {taken}/{max}{}{}",
                    if taken >= max { " FULL" } else { "" },
                    if shed.is_empty() {
                        String::new()
                    } else {
                        format!(" · shed {}", shed.join(", "))
                    }
                )
            }
            _ => String::new(),
        };
        let _ = writeln!(
            out,
            "upstream {:<16} {:<32} breaker {}{}{slots}",
            upstream["name"].as_str().unwrap_or("?"),
            address,
            breaker["state"].as_str().unwrap_or("?"),
            if breaker["force"] != "auto" {
                format!(
                    " (forced by {})",
                    breaker["forced_by"].as_str().unwrap_or("?")
                )
            } else {
                String::new()
            }
        );
        // Failures that did not open it, for want of failing clients: said, or a breaker
        // tried from one office looks as if it did not work.
        let held = &breaker["held_closed"];
        if let (true, Some(ago_ms), Some(clients), Some(needed)) = (
            breaker["state"] == "closed",
            held["ago_ms"].as_u64(),
            held["failing_clients"].as_u64(),
            held["needed"].as_u64(),
        ) {
            let _ = writeln!(
                out,
                "         kept closed {}s ago: its failures came from {} client network(s), and failing_clients asks for {needed}",
                ago_ms / 1000,
                clients
            );
        }
    }
    describe_routes_off(&mut out, status);
    // Counted as the start's log line and `levee check` count them: the policy's own routes,
    // and the default route (of requests none matches) apart.
    let listed = status["routes"]
        .as_array()
        .map(Vec::as_slice)
        .unwrap_or_default();
    let routes = listed
        .iter()
        .filter(|route| route["name"] != "default")
        .count();
    let default = if routes < listed.len() {
        " (and the default route)"
    } else {
        ""
    };
    let limits = status["limits"].as_array().map_or(0, Vec::len);
    let _ = writeln!(out, "routes   {routes}{default} · limit rules {limits}");
    describe_fleet(&mut out, &status["fleet"]);
    out
}

/// The routes switched off now, by the level (their tier) or their module (`/status`
/// `routes[].off`): what visitors of those pages get instead is the route's `degrade` answer.
fn describe_routes_off(out: &mut String, status: &serde_json::Value) {
    use std::fmt::Write as _;
    let off: Vec<String> = status["routes"]
        .as_array()
        .into_iter()
        .flatten()
        .filter_map(|route| {
            let name = route["name"].as_str()?;
            Some(match route["off"].as_str()? {
                "tier" => format!("{name} (tier {})", route["tier"]),
                _ => format!(
                    "{name} (module {})",
                    route["module"].as_str().unwrap_or("?")
                ),
            })
        })
        .collect();
    if !off.is_empty() {
        let _ = writeln!(out, "routes   OFF: {}", off.join(", "));
    }
}

/// The fleet view's lines: every instance's level, and its breakers that are not closed. Not
/// shown without Redis (or from a levee too old to send it).
fn describe_fleet(out: &mut String, fleet: &serde_json::Value) {
    use std::fmt::Write as _;
    if let Some(error) = fleet["error"].as_str() {
        let _ = writeln!(out, "fleet    unknown: {error}");
        return;
    }
    let Some(instances) = fleet["instances"].as_array() else {
        return;
    };
    let highest = match fleet["highest_level"].as_u64() {
        Some(level) => level.to_string(),
        None => "unknown (none reported lately)".to_string(),
    };
    let _ = writeln!(
        out,
        "fleet    {} instance(s) · highest level {highest}",
        instances.len(),
    );
    for instance in instances {
        let breakers: Vec<String> = instance["breakers"]
            .as_object()
            .into_iter()
            .flatten()
            .map(|(name, state)| format!("{name} {}", state.as_str().unwrap_or("?")))
            .collect();
        let _ = writeln!(
            out,
            "         {}{:<40} level {} (automatic {}){}{}{}",
            if instance["this"] == true { "* " } else { "  " },
            instance["instance"].as_str().unwrap_or("?"),
            instance["level"],
            instance["automatic_level"],
            if breakers.is_empty() {
                String::new()
            } else {
                format!(" · breakers: {}", breakers.join(", "))
            },
            if instance["draining"] == true {
                " · DRAINING"
            } else {
                ""
            },
            if instance["silent"] == true {
                format!(
                    " · SILENT for {} s",
                    instance["seen_ms_ago"].as_u64().unwrap_or(0) / 1000
                )
            } else {
                String::new()
            },
        );
    }
}

/// `/status`'s `redis.target`: one URL, a cluster's nodes, or Sentinel's master name and
/// sentinels.
fn describe_redis_target(target: &serde_json::Value) -> String {
    let list = |value: &serde_json::Value| {
        value
            .as_array()
            .into_iter()
            .flatten()
            .map(|item| item.as_str().unwrap_or("?").to_string())
            .collect::<Vec<_>>()
            .join(", ")
    };
    match target {
        serde_json::Value::String(url) => url.clone(),
        serde_json::Value::Array(_) => format!("cluster {}", list(target)),
        serde_json::Value::Object(sentinel) => format!(
            "master \"{}\" via sentinels {}",
            sentinel
                .get("master")
                .and_then(serde_json::Value::as_str)
                .unwrap_or("?"),
            list(&target["sentinels"])
        ),
        other => other.to_string(),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn text_from_redis_cannot_forge_lines_or_reach_the_terminal() {
        let status = serde_json::json!({
            "degrade": {"level": 0, "level_origin": "policy", "modules": {
                "evil\u{1b}[31m\nFAKE": {"off": true, "tier": 3, "origin": "runtime",
                    "changed_by": "\u{1b}[2J\u{1b}]0;pwned\u{7}\nfake line"}
            }}
        });
        let text = summarize(&status);
        assert!(
            !text.contains('\u{1b}') && !text.contains('\u{7}'),
            "{text:?}"
        );
        assert!(
            !text.contains("\nFAKE") && !text.contains("\nfake line"),
            "{text:?}"
        );
        assert!(text.contains("by \\u{1b}[2J"), "{text}");
    }

    #[test]
    fn routes_switched_off_and_slots_shed_are_shown() {
        let status = printable(&serde_json::json!({
            "degrade": {"level": 1, "level_origin": "runtime", "modules": {
                "ranking": {"off": true, "tier": 3, "origin": "level"},
                "comments": {"off": true, "tier": 2, "origin": "runtime"},
            }},
            "routes": [
                {"name": "home", "tier": 1, "module": null, "off": null},
                {"name": "notify", "tier": 2, "module": null, "off": null},
                {"name": "comment", "tier": 2, "module": "comments", "off": "module"},
                {"name": "ranking", "tier": 3, "module": "ranking", "off": "tier"},
                {"name": "default", "tier": 1, "module": null, "off": null},
            ],
            "upstreams": [{"name": "app", "url": "http://127.0.0.1:8081",
                "breaker": {"state": "closed"}, "inflight": 20, "max_inflight": 20,
                "shed": {"1": 0, "2": 12, "3": 1099}}],
        }));
        let text = summarize(&status);
        assert!(
            text.contains("routes   OFF: comment (module comments), ranking (tier 3)\n"),
            "{text}"
        );
        assert!(
            text.contains("routes   4 (and the default route) · limit rules 0\n"),
            "{text}"
        );
        assert!(
            text.contains("· inflight 20/20 FULL · shed 12 of tier 2, 1099 of tier 3\n"),
            "{text}"
        );
    }

    #[test]
    fn switches_saved_for_names_the_policy_lacks_are_shown_and_warnings_keep_to_a_line() {
        let status = printable(&serde_json::json!({
            "policy": {"warnings": ["levee.toml: warning: listens elsewhere\n  hint: restart levee"]},
            "degrade": {"level": 0, "level_origin": "policy", "modules": {},
                "saved_not_in_policy": {
                    "modules": {"widgets": {"off": true}},
                    "breakers": {"api": {"force": "open"}},
                }},
        }));
        let text = summarize(&status);
        assert!(
            text.contains("saved: module widgets off, not in the policy"),
            "{text}"
        );
        assert!(
            text.contains("saved: breaker api pinned open, not in the policy"),
            "{text}"
        );
        assert!(text.contains("warning: listens elsewhere\n"), "{text}");
        assert!(!text.contains("hint: restart"), "{text}");
    }

    #[test]
    fn a_cluster_node_out_is_named() {
        let status = serde_json::json!({
            "redis": {
                "target": ["redis://10.0.0.1:7000"],
                "up": false,
                "nodes": [
                    {"node": "10.0.0.1:7000", "up": true},
                    {"node": "10.0.0.2:7001", "up": false},
                ],
            },
        });
        let text = summarize(&status);
        assert!(text.contains("PARTLY DOWN"), "{text}");
        assert!(
            text.contains("node 10.0.0.2:7001 DOWN (rules with buckets there"),
            "{text}"
        );
        assert!(!text.contains("node 10.0.0.1:7000"), "{text}");
    }

    #[test]
    fn the_fleet_view_names_each_instance_and_what_it_sheds() {
        let status = serde_json::json!({
            "fleet": {
                "highest_level": 2,
                "instances": [
                    {"instance": "web1-41-a", "this": true, "level": 0, "automatic_level": 0,
                     "breakers": {}, "draining": false, "silent": false, "seen_ms_ago": 40},
                    {"instance": "web2-77-b", "this": false, "level": 2, "automatic_level": 2,
                     "breakers": {"ai": "open"}, "draining": false, "silent": true,
                     "seen_ms_ago": 12000},
                ],
            },
        });
        let text = summarize(&status);
        assert!(
            text.contains("fleet    2 instance(s) · highest level 2"),
            "{text}"
        );
        assert!(text.contains("* web1-41-a"), "{text}");
        assert!(
            text.contains("level 2 (automatic 2) · breakers: ai open · SILENT for 12 s"),
            "{text}"
        );
        let unknown = serde_json::json!({"fleet": {"error": "redis is down"}});
        assert!(summarize(&unknown).contains("fleet    unknown: redis is down"));
        assert!(!summarize(&serde_json::json!({"fleet": null})).contains("fleet"));
    }

    #[test]
    fn the_master_a_sentinel_names_is_shown_and_an_older_status_does_not_break_the_summary() {
        let status = serde_json::json!({
            "redis": {
                "target": {"sentinels": ["redis://10.0.0.5:26379"], "master": "mymaster"},
                "up": true,
                "nodes": [],
                "master": "10.0.0.9:6379",
            },
        });
        let text = summarize(&status);
        assert!(
            text.contains("master now 10.0.0.9:6379 (named by the sentinels)"),
            "{text}"
        );
        assert!(
            text.contains("redis    master \"mymaster\" via sentinels redis://10.0.0.5:26379 · up"),
            "{text}"
        );
        assert!(!text.contains("clients"), "{text}");
        // A levee from before `nodes` and `master` were sent.
        let older = serde_json::json!({"redis": {"target": "redis://10.0.0.1:6379", "up": false}});
        let text = summarize(&older);
        assert!(text.contains("redis://10.0.0.1:6379 · DOWN"), "{text}");
        assert!(!text.contains("rate limits on their"), "{text}");
        assert!(!text.contains("master now"), "{text}");
    }

    #[test]
    fn connections_are_shown_with_their_cap() {
        let text = summarize(&serde_json::json!({"connections": {"open": 12, "max": 10000}}));
        assert!(
            text.contains("clients  12 connection(s) open of at most 10000\n"),
            "{text}"
        );
        let text = summarize(&serde_json::json!({"connections": {"open": 2, "max": 2}}));
        assert!(
            text.contains("of at most 2 · AT THE CAP: new ones wait\n"),
            "{text}"
        );
    }

    #[test]
    fn a_refused_reload_about_the_whole_directory_is_shown_without_line_and_column() {
        let status = serde_json::json!({
            "policy": {
                "generation": 1,
                "last_reload_error": {"errors": [
                    {"file": "policies", "line": 0, "col": 0, "message": "no *.toml policy files in this directory"},
                    {"file": "policies/a.toml", "line": 3, "col": 7, "message": "unknown field `x`"},
                ]},
            },
        });
        let text = summarize(&status);
        assert!(
            text.contains("           policies: error: no *.toml policy files in this directory\n"),
            "{text}"
        );
        assert!(
            text.contains("           policies/a.toml:3:7: error: unknown field `x`\n"),
            "{text}"
        );
        assert!(!text.contains(":0:0"), "{text}");
    }

    #[test]
    fn a_refused_reload_is_shown_with_its_hints_as_check_prints_them() {
        // `/status` as the admin listener makes it, from the store's record of the failure.
        let dir = tempfile::tempdir().expect("temp dir");
        std::fs::write(
            dir.path().join("levee.toml"),
            "[upstream.app]\nurl = \"http://127.0.0.1:9\"\nretries = 3\n",
        )
        .expect("write");
        std::fs::write(dir.path().join("limits.TOML"), "").expect("write");
        let diagnostics = match crate::config::load_dir(dir.path(), None) {
            Ok(_) => panic!("an unknown key is refused"),
            Err(diagnostics) => diagnostics,
        };
        let failure = crate::config::store::ReloadFailure {
            at_unix: 0,
            trigger: crate::config::ReloadTrigger::Watch,
            errors: diagnostics.0.clone(),
        };
        let status = serde_json::json!({"policy": {"last_reload_error": failure}});
        let text = summarize(&status);
        // Each line of `levee check`'s, in the same order, under the summary's indent.
        let indented: String = diagnostics
            .to_string()
            .lines()
            .map(|line| format!("           {line}\n"))
            .collect();
        assert!(
            text.contains(&format!("LAST RELOAD REFUSED (1 error(s)):\n{indented}")),
            "{text}\nnot as check prints:\n{diagnostics}"
        );
        assert!(text.contains("\n             hint: "), "{text}");
        assert!(
            text.contains(": warning: `limits.TOML` is not read"),
            "{text}"
        );
    }

    #[test]
    fn a_policy_directory_that_does_not_exist_is_named_so_not_as_a_policy_that_does_not_compile() {
        let dir = tempfile::tempdir().expect("temp dir");
        let missing = dir.path().join("policies");
        let diagnostics = match crate::config::load_dir(&missing, None) {
            Ok(_) => panic!("a missing directory cannot load"),
            Err(diagnostics) => diagnostics,
        };
        let why = why_no_admin_listen(&missing, &diagnostics);
        assert_eq!(
            why,
            format!("{}: the policy directory does not exist", missing.display())
        );
        std::fs::create_dir(&missing).expect("mkdir");
        let diagnostics = match crate::config::load_dir(&missing, None) {
            Ok(_) => panic!("an empty directory cannot load"),
            Err(diagnostics) => diagnostics,
        };
        assert_eq!(
            why_no_admin_listen(&missing, &diagnostics),
            format!(
                "{}: no *.toml policy files in this directory",
                missing.display()
            )
        );
    }

    #[test]
    fn a_broken_policy_still_tells_where_its_admin_listener_is() {
        let dir = tempfile::tempdir().expect("temp dir");
        std::fs::write(
            dir.path().join("10-admin.toml"),
            "[admin]\nlisten = \"127.0.0.1:19901\"\n",
        )
        .expect("write");
        std::fs::write(
            dir.path().join("20-routes.toml"),
            "[upstream.app]\nurl = \"http://127.0.0.1:8081\"\n[[route]]\nname = \"x\"\nupstream = \"nope\"\n",
        )
        .expect("write");
        assert!(crate::config::load_dir(dir.path(), None).is_err());
        assert_eq!(
            admin_address(None, dir.path()),
            SocketAddr::from(([127, 0, 0, 1], 19901))
        );
        // The file that sets it does not parse (a typo elsewhere in it): still read.
        std::fs::write(
            dir.path().join("10-admin.toml"),
            "[server]\nlisten = \"127.0.0.1:8080\"\n[admin] # the admin listener\nlisten = \"127.0.0.1:19902\" # loopback\n[redis]\nburst = 3,\n",
        )
        .expect("write");
        assert_eq!(
            admin_address(None, dir.path()),
            SocketAddr::from(([127, 0, 0, 1], 19902))
        );
        // Without any file that sets it: the default.
        std::fs::remove_file(dir.path().join("10-admin.toml")).expect("remove");
        assert_eq!(
            admin_address(None, dir.path()),
            SocketAddr::from(([127, 0, 0, 1], 9901))
        );
    }
}
