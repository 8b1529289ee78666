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
    pub(super) fn bytes(
        &self,
        _text: &str,
        _span: std::ops::Range<usize>,
    ) -> Result<u64, SizeError> {
        match self {
            Size::Int(n) => Ok(*n),
            Size::Text(s) => parse_size(s),
        }
    }
}

/// Why a size as written is refused; `text` is what was written.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum SizeError {
    #[error("{text:?} is not a size such as \"4MiB\"")]
    NotANumber { text: String },
    #[error("{text:?} has an unknown unit (use B, KiB, MiB, GiB)")]
    UnknownUnit { text: String },
    #[error("{text:?} is too large")]
    TooLarge { text: String },
}

/// Why a duration as written is refused; `text` is what was written.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum DurationError {
    #[error("{text:?} is not a duration such as \"20s\" or \"500ms\"")]
    NotANumber { text: String },
    #[error("{text:?} has an unknown unit (use ms, s, m or h)")]
    UnknownUnit { text: String },
}

pub fn parse_size(s: &str) -> Result<u64, SizeError> {
    let text = || s.to_string();
    let t = s.trim();
    let split = t.find(|c: char| !c.is_ascii_digit()).unwrap_or(t.len());
    let (num, unit) = t.split_at(split);
    let n: u64 = num
        .parse()
        .map_err(|_| SizeError::NotANumber { text: text() })?;
    let mult: u64 = match unit.trim().to_ascii_lowercase().as_str() {
        "" | "b" => 1,
        "k" | "kb" | "kib" => 1 << 10,
        "m" | "mb" | "mib" => 1 << 20,
        "g" | "gb" | "gib" => 1 << 30,
        "t" | "tb" | "tib" => 1 << 40,
        _ => return Err(SizeError::UnknownUnit { text: text() }),
    };
    n.checked_mul(mult)
        .ok_or_else(|| SizeError::TooLarge { text: text() })
}

/// A duration such as "20s", "500ms", "2m", "1h".
pub fn parse_duration(s: &str) -> Result<Duration, DurationError> {
    let text = || s.to_string();
    let t = s.trim();
    let split = t.find(|c: char| !c.is_ascii_digit()).unwrap_or(t.len());
    let (num, unit) = t.split_at(split);
    let n: u64 = num
        .parse()
        .map_err(|_| DurationError::NotANumber { text: text() })?;
    let d = match unit.trim() {
        "ms" => Duration::from_millis(n),
        "s" | "" => Duration::from_secs(n),
        "m" | "min" => Duration::from_secs(n.saturating_mul(60)),
        "h" => Duration::from_secs(n.saturating_mul(3600)),
        _ => return Err(DurationError::UnknownUnit { text: text() }),
    };
    Ok(d)
}
