//! Values any policy file may write: byte sizes and durations.

use std::time::Duration;

use serde::Deserialize;

/// A byte size: an integer, or a string such as "4MiB", "512k", "1G".
#[derive(Deserialize, Clone)]
#[serde(untagged)]
pub(super) enum Size {
    Int(u64),
    Text(String),
}

impl Size {
    pub(super) fn bytes(&self, _text: &str, _span: std::ops::Range<usize>) -> Result<u64, String> {
        match self {
            Size::Int(n) => Ok(*n),
            Size::Text(s) => parse_size(s),
        }
    }
}

pub fn parse_size(s: &str) -> Result<u64, String> {
    let t = s.trim();
    let split = t.find(|c: char| !c.is_ascii_digit()).unwrap_or(t.len());
    let (num, unit) = t.split_at(split);
    let n: u64 = num
        .parse()
        .map_err(|_| format!("{s:?} is not a size such as \"4MiB\""))?;
    let mult: u64 = match unit.trim().to_ascii_lowercase().as_str() {
        "" | "b" => 1,
        "k" | "kb" | "kib" => 1 << 10,
        "m" | "mb" | "mib" => 1 << 20,
        "g" | "gb" | "gib" => 1 << 30,
        "t" | "tb" | "tib" => 1 << 40,
        _ => return Err(format!("{s:?} has an unknown unit (use B, KiB, MiB, GiB)")),
    };
    n.checked_mul(mult)
        .ok_or_else(|| format!("{s:?} is too large"))
}

/// A duration such as "20s", "500ms", "2m", "1h".
pub fn parse_duration(s: &str) -> Result<Duration, String> {
    let t = s.trim();
    let split = t.find(|c: char| !c.is_ascii_digit()).unwrap_or(t.len());
    let (num, unit) = t.split_at(split);
    let n: u64 = num
        .parse()
        .map_err(|_| format!("{s:?} is not a duration such as \"20s\" or \"500ms\""))?;
    let d = match unit.trim() {
        "ms" => Duration::from_millis(n),
        "s" | "" => Duration::from_secs(n),
        "m" | "min" => Duration::from_secs(n.saturating_mul(60)),
        "h" => Duration::from_secs(n.saturating_mul(3600)),
        _ => return Err(format!("{s:?} has an unknown unit (use ms, s, m or h)")),
    };
    Ok(d)
}
