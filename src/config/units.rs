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
        // `1h30m`: one number and one unit only.
        other if other.contains(|c: char| c.is_ascii_digit()) => {
            return Err(format!(
                "duration `{text}` has more than one unit: write it in one unit, like \"90m\" for 1h30m"
            ))
        }
        other => return Err(format!(
            "unknown duration unit `{other}` in `{text}`: use ms, s, m (or min) or h"
        )),
    };
    if !seconds.is_finite() || !(0.0..=86_400.0 * 365.0).contains(&seconds) {
        return Err(format!("duration `{text}` is out of range"));
    }
    // Rounded to whole microseconds: a float of seconds cannot hold every nanosecond of a long
    // duration, so `"19328244617ms"` used to come out as `…616.999999s`. Microseconds of up to
    // a year fit a float exactly, and no timer levee runs is finer than that.
    Ok(Duration::from_micros((seconds * 1e6).round() as u64))
}

/// `count` of `noun` for people to read: `1 job`, `3 jobs`.
pub fn counted(count: u64, noun: &str) -> String {
    if count == 1 {
        format!("1 {noun}")
    } else {
        format!("{count} {noun}s")
    }
}

/// A duration for people to read, in the policy's own units: `30s`, `250ms`, `1.5s`, `1.1ms`,
/// `800µs`. Log lines and messages use it where Rust's `Debug` would print `1.097686ms`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Shown(pub Duration);

impl std::fmt::Display for Shown {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let duration = self.0;
        let micros = duration.as_micros();
        // From 999.95ms on, the millisecond branch would round to `1000ms`.
        if micros >= 999_950 {
            // Whole seconds stay whole; otherwise to the millisecond, trailing zeros dropped.
            let millis = (micros + 500) / 1000;
            let (seconds, fraction) = (millis / 1000, millis % 1000);
            if fraction == 0 {
                write!(f, "{seconds}s")
            } else {
                let digits = format!("{fraction:03}");
                write!(f, "{seconds}.{}s", digits.trim_end_matches('0'))
            }
        } else if micros >= 1000 {
            // A tenth of a millisecond is as fine as anyone reads a wait.
            let tenths = (micros + 50) / 100;
            let (millis, tenth) = (tenths / 10, tenths % 10);
            if tenth == 0 {
                write!(f, "{millis}ms")
            } else {
                write!(f, "{millis}.{tenth}ms")
            }
        } else if duration.is_zero() {
            f.write_str("0s")
        } else if micros > 0 {
            write!(f, "{micros}µs")
        } else {
            // Under a microsecond but not zero: say so rather than `0µs`.
            f.write_str("under 1µs")
        }
    }
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
    // A fraction (`"1.5MiB"`) is refused rather than rounded: a limit is a count of bytes, and
    // the operator is told the whole number that says the same.
    if let Some(fraction) = unit.strip_prefix('.') {
        let digits = fraction
            .find(|c: char| !c.is_ascii_digit())
            .unwrap_or(fraction.len());
        let (decimals, unit) = fraction.split_at(digits);
        let written = format!("{number}.{decimals}").parse::<f64>().ok();
        let same = written
            .zip(size_unit(unit.trim()))
            .and_then(|(written, multiplier)| whole_size(written * multiplier as f64))
            .map_or(String::new(), |whole| format!(" (`{text}` is \"{whole}\")"));
        return Err(format!(
            "size `{text}` is not a whole number: sizes take whole numbers{same}"
        ));
    }
    let multiplier = size_unit(unit.trim())
        .ok_or_else(|| format!("unknown size unit `{}` in `{text}`", unit.trim()))?;
    value
        .checked_mul(multiplier)
        .ok_or_else(|| format!("size `{text}` is too large"))
}

/// Bytes per unit of a size: `KB`/`MB`/`GB` decimal, `KiB`/`MiB`/`GiB` binary, `B` or none bytes.
fn size_unit(unit: &str) -> Option<u64> {
    Some(match unit {
        "" | "B" => 1,
        "KB" | "kB" => 1_000,
        "MB" => 1_000_000,
        "GB" => 1_000_000_000,
        "KiB" => 1 << 10,
        "MiB" => 1 << 20,
        "GiB" => 1 << 30,
        _ => return None,
    })
}

/// A whole number of bytes written in the largest unit it fills exactly (`1572864` →
/// `1536KiB`); none when the bytes are not whole.
fn whole_size(bytes: f64) -> Option<String> {
    if !(bytes.is_finite() && bytes >= 1.0 && bytes.fract() == 0.0 && bytes < 1e18) {
        return None;
    }
    let bytes = bytes as u64;
    let units = [
        ("GiB", 1u64 << 30),
        ("GB", 1_000_000_000),
        ("MiB", 1 << 20),
        ("MB", 1_000_000),
        ("KiB", 1 << 10),
        ("KB", 1_000),
    ];
    Some(
        units
            .iter()
            .find(|(_, size)| bytes.is_multiple_of(*size))
            .map_or_else(
                || bytes.to_string(),
                |(unit, size)| format!("{}{unit}", bytes / size),
            ),
    )
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn durations_read_as_people_write_them() {
        let shown = |micros: u64| Shown(Duration::from_micros(micros)).to_string();
        assert_eq!(shown(30_000_000), "30s");
        assert_eq!(shown(1_500_000), "1.5s");
        assert_eq!(shown(1_097_686), "1.098s");
        assert_eq!(shown(250_000), "250ms");
        assert_eq!(shown(1_097), "1.1ms");
        assert_eq!(shown(999_960), "1s");
        assert_eq!(shown(800), "800µs");
        assert_eq!(shown(0), "0s");
        assert_eq!(Shown(Duration::from_nanos(10)).to_string(), "under 1µs");
        assert_eq!(Shown(Duration::from_nanos(1_097_686)).to_string(), "1.1ms");
    }

    #[test]
    fn durations() {
        assert_eq!(parse_duration("250ms"), Ok(Duration::from_millis(250)));
        assert_eq!(parse_duration("10s"), Ok(Duration::from_secs(10)));
        assert!(parse_duration("1h30m")
            .unwrap_err()
            .contains("write it in one unit, like \"90m\""));
        assert!(parse_duration("10sec")
            .unwrap_err()
            .contains("use ms, s, m (or min) or h"));
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

    #[test]
    fn a_fractional_size_is_refused_with_the_whole_number_that_says_it() {
        let size = |text: &str| parse_size(&SizeSpec::Text(text.into()));
        assert_eq!(
            size("1.5MiB"),
            Err("size `1.5MiB` is not a whole number: sizes take whole numbers (`1.5MiB` is \"1536KiB\")".into())
        );
        assert_eq!(
            size("2.5 MB"),
            Err("size `2.5 MB` is not a whole number: sizes take whole numbers (`2.5 MB` is \"2500KB\")".into())
        );
        // Not whole in bytes either: no number to offer.
        assert_eq!(
            size("1.0001KiB"),
            Err("size `1.0001KiB` is not a whole number: sizes take whole numbers".into())
        );
        assert_eq!(
            size("10 apples"),
            Err("unknown size unit `apples` in `10 apples`".into())
        );
    }
}
