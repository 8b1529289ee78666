//! Event times: milliseconds since the epoch, shown as RFC 3339 (UTC), and the `since` filter
//! that takes either.

use std::time::{SystemTime, UNIX_EPOCH};

pub fn now_ms() -> u64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map_or(0, |d| d.as_millis() as u64)
}

/// Days since 1970-01-01 to (year, month, day), proleptic Gregorian (Howard Hinnant's
/// `civil_from_days`).
fn civil(days: i64) -> (i64, u32, u32) {
    let z = days + 719_468;
    let era = z.div_euclid(146_097);
    let doe = z.rem_euclid(146_097);
    let yoe = (doe - doe / 1460 + doe / 36_524 - doe / 146_096) / 365;
    let doy = doe - (365 * yoe + yoe / 4 - yoe / 100);
    let mp = (5 * doy + 2) / 153;
    let d = (doy - (153 * mp + 2) / 5 + 1) as u32;
    let m = if mp < 10 { mp + 3 } else { mp - 9 } as u32;
    (yoe + era * 400 + i64::from(m <= 2), m, d)
}

/// (year, month, day) to days since 1970-01-01 (`days_from_civil`).
fn days(y: i64, m: u32, d: u32) -> i64 {
    let y = if m <= 2 { y - 1 } else { y };
    let era = y.div_euclid(400);
    let yoe = y.rem_euclid(400);
    let m = i64::from(m);
    let doy = (153 * (if m > 2 { m - 3 } else { m + 9 }) + 2) / 5 + i64::from(d) - 1;
    let doe = yoe * 365 + yoe / 4 - yoe / 100 + doy;
    era * 146_097 + doe - 719_468
}

/// `2026-12-03T04:05:06.789Z`.
pub fn format_rfc3339(ms: u64) -> String {
    let secs = (ms / 1000) as i64;
    let (y, mo, d) = civil(secs.div_euclid(86_400));
    let s = secs.rem_euclid(86_400);
    format!(
        "{y:04}-{mo:02}-{d:02}T{:02}:{:02}:{:02}.{:03}Z",
        s / 3600,
        s / 60 % 60,
        s % 60,
        ms % 1000
    )
}

/// A `since` value that is neither a count of milliseconds nor an RFC 3339 UTC time.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("since {0:?}: give milliseconds since the epoch or an RFC 3339 UTC time such as 2026-12-03T04:05:06Z")]
pub struct SinceError(pub String);

/// A `since` value: milliseconds since the epoch, or an RFC 3339 UTC time
/// (`2026-12-03T04:05:06Z`, fractional seconds optional, `Z` or `+00:00`).
pub fn parse_since(s: &str) -> Result<u64, SinceError> {
    let s = s.trim();
    if let Ok(ms) = s.parse::<u64>() {
        return Ok(ms);
    }
    let bad = || SinceError(s.to_string());
    let rest = s
        .strip_suffix('Z')
        .or_else(|| s.strip_suffix("+00:00"))
        .ok_or_else(bad)?;
    let (date, time) = rest.split_once(['T', ' ']).ok_or_else(bad)?;
    let num = |x: &str| x.parse::<u32>().map_err(|_| bad());
    let mut dp = date.splitn(3, '-');
    let (y, mo, d) = (
        dp.next()
            .ok_or_else(bad)?
            .parse::<i64>()
            .map_err(|_| bad())?,
        num(dp.next().ok_or_else(bad)?)?,
        num(dp.next().ok_or_else(bad)?)?,
    );
    let (hms, frac) = time.split_once('.').unwrap_or((time, ""));
    let mut tp = hms.splitn(3, ':');
    let (h, mi, sec) = (
        num(tp.next().ok_or_else(bad)?)?,
        num(tp.next().ok_or_else(bad)?)?,
        num(tp.next().ok_or_else(bad)?)?,
    );
    if !(1..=12).contains(&mo) || !(1..=31).contains(&d) || h > 23 || mi > 59 || sec > 60 {
        return Err(bad());
    }
    let ms_frac = if frac.is_empty() {
        0
    } else {
        let digits: String = frac.chars().take(3).collect();
        if !frac.chars().all(|c| c.is_ascii_digit()) {
            return Err(bad());
        }
        num(&format!("{digits:0<3}"))?
    };
    let secs = days(y, mo, d) * 86_400 + i64::from(h) * 3600 + i64::from(mi) * 60 + i64::from(sec);
    u64::try_from(secs)
        .map(|s| s * 1000 + u64::from(ms_frac))
        .map_err(|_| bad())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn rfc3339_round_trips() {
        for ms in [0, 951_782_400_123, 1_796_270_706_789, 4_102_444_800_000] {
            let s = format_rfc3339(ms);
            assert_eq!(parse_since(&s).unwrap(), ms, "{s}");
        }
        assert_eq!(format_rfc3339(951_782_400_123), "2000-02-29T00:00:00.123Z");
        assert_eq!(
            parse_since("2000-02-29T00:00:00Z").unwrap(),
            951_782_400_000
        );
        assert_eq!(parse_since("12345").unwrap(), 12345);
        assert!(parse_since("yesterday").is_err());
        assert!(parse_since("2000-13-01T00:00:00Z").is_err());
    }
}
