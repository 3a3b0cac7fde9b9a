//! Human units in policy files: durations (`"250ms"`, `"10s"`, `"5m"`, `"1h"`) and byte sizes
//! (`16384`, `"16KiB"`, `"10MB"`).

use std::time::Duration;

use super::spec::SizeSpec;

/// Parses `"500ms"`, `"10s"`, `"1.5s"`, `"5m"`/`"5min"`, `"1h"`. A bare number is refused:
/// a unit must always be written so that nobody wonders whether `30` means seconds.
pub fn parse_duration(text: &str) -> Result<Duration, String> {
    let text = text.trim();
    let split = text
        .find(|c: char| !(c.is_ascii_digit() || c == '.'))
        .ok_or_else(|| format!("duration `{text}` has no unit"))?;
    let (number, unit) = text.split_at(split);
    let value: f64 = number
        .parse()
        .map_err(|_| format!("duration `{text}` does not start with a number"))?;
    let seconds = match unit.trim() {
        "ms" => value / 1000.0,
        "s" => value,
        "m" | "min" => value * 60.0,
        "h" => value * 3600.0,
        other => return Err(format!("unknown duration unit `{other}` in `{text}`")),
    };
    if !seconds.is_finite() || !(0.0..=86_400.0 * 365.0).contains(&seconds) {
        return Err(format!("duration `{text}` is out of range"));
    }
    // Rounded to whole microseconds: a float of seconds cannot hold every nanosecond of a long
    // duration, so `"19328244617ms"` used to come out as `…616.999999s`. Microseconds of up to
    // a year fit a float exactly, and no timer levee runs is finer than that.
    Ok(Duration::from_micros((seconds * 1e6).round() as u64))
}

/// Parses a byte size. `KB`/`MB`/`GB` are decimal, `KiB`/`MiB`/`GiB` binary, `B` or no unit bytes.
pub fn parse_size(spec: &SizeSpec) -> Result<u64, String> {
    let text = match spec {
        SizeSpec::Bytes(bytes) => return Ok(*bytes),
        SizeSpec::Text(text) => text.trim(),
    };
    let split = text
        .find(|c: char| !c.is_ascii_digit())
        .unwrap_or(text.len());
    let (number, unit) = text.split_at(split);
    let value: u64 = number
        .parse()
        .map_err(|_| format!("size `{text}` does not start with a whole number"))?;
    let multiplier: u64 = match unit.trim() {
        "" | "B" => 1,
        "KB" | "kB" => 1_000,
        "MB" => 1_000_000,
        "GB" => 1_000_000_000,
        "KiB" => 1 << 10,
        "MiB" => 1 << 20,
        "GiB" => 1 << 30,
        other => return Err(format!("unknown size unit `{other}` in `{text}`")),
    };
    value
        .checked_mul(multiplier)
        .ok_or_else(|| format!("size `{text}` is too large"))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn durations() {
        assert_eq!(parse_duration("250ms"), Ok(Duration::from_millis(250)));
        assert_eq!(parse_duration("10s"), Ok(Duration::from_secs(10)));
        assert_eq!(parse_duration("1.5s"), Ok(Duration::from_millis(1500)));
        assert_eq!(parse_duration("5min"), Ok(Duration::from_secs(300)));
        assert_eq!(parse_duration("1h"), Ok(Duration::from_secs(3600)));
        assert!(parse_duration("30").is_err());
        assert!(parse_duration("3 days").is_err());
        assert!(parse_duration("s").is_err());
    }

    #[test]
    fn sizes() {
        assert_eq!(parse_size(&SizeSpec::Bytes(42)), Ok(42));
        assert_eq!(parse_size(&SizeSpec::Text("16KiB".into())), Ok(16384));
        assert_eq!(parse_size(&SizeSpec::Text("10MB".into())), Ok(10_000_000));
        assert_eq!(parse_size(&SizeSpec::Text("1 GiB".into())), Ok(1 << 30));
        assert!(parse_size(&SizeSpec::Text("10 apples".into())).is_err());
        assert!(parse_size(&SizeSpec::Text("99999999999999GiB".into())).is_err());
    }
}
