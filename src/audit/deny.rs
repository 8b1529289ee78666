//! The bound on `deny` events: refusals cost a client nothing, so without a bound a principal
//! with no grant could fill the log with them and rotate every earlier commit out of
//! retention. Each uid has a token bucket: its first [`BURST`] denials are recorded one by
//! one, then one more every [`REFILL_MS`]; the denials over that are counted, not written,
//! and one aggregated `deny` (how many, the first and last time, the tools and codes seen)
//! is written for them when the uid's next denial is recorded once more (a token came
//! back), at most once per [`AGGREGATE_MS`] otherwise, before the next event of any other
//! kind, and when the audit is dropped. So a uid's denials add at most `BURST + t/REFILL_MS +
//! t/AGGREGATE_MS` lines over `t` ms however many it makes, and every denial is counted.

use std::collections::{BTreeMap, HashMap};

use serde::Serialize;

use super::{format_rfc3339, Principal};

/// Denials of one uid recorded one by one before the limit applies.
pub const BURST: u32 = 32;
/// Then one more every this many milliseconds.
pub const REFILL_MS: u64 = 10_000;
/// Counted denials are written as one aggregate at most this often per uid (unless the
/// uid's next denial is recorded one by one again, or another event comes first).
pub const AGGREGATE_MS: u64 = 60_000;
/// The tool names and codes an aggregate names one by one; the rest are counted together.
const NAMES: usize = 16;
/// The uids tracked; past that, new uids share one bucket (the key [`u32::MAX`]).
const UIDS: usize = 4096;

/// Denials counted and not yet written.
#[derive(Debug, Clone)]
pub struct Pending {
    pub principal: Option<Principal>,
    pub count: u64,
    pub first_ms: u64,
    pub last_ms: u64,
    tools: BTreeMap<String, u64>,
    codes: BTreeMap<String, u64>,
    other_tools: u64,
    other_codes: u64,
}

impl Pending {
    /// The aggregated `deny` event.
    pub fn event(&self) -> super::Event {
        super::Event::Deny(super::event::Deny::Aggregated {
            aggregated: Aggregate {
                count: self.count,
                first_time: format_rfc3339(self.first_ms),
                last_time: format_rfc3339(self.last_ms),
                tools: self.tools.clone(),
                other_tools: self.other_tools,
                codes: self.codes.clone(),
                other_codes: self.other_codes,
                why: format!("denials of this uid over {BURST} and one per {} s are counted, not written one by one", REFILL_MS / 1000),
            },
        })
    }
}

/// What an aggregated `deny` says of the denials it counts.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct Aggregate {
    pub count: u64,
    pub first_time: String,
    pub last_time: String,
    pub tools: BTreeMap<String, u64>,
    pub other_tools: u64,
    pub codes: BTreeMap<String, u64>,
    pub other_codes: u64,
    pub why: String,
}

fn bump(m: &mut BTreeMap<String, u64>, other: &mut u64, key: &str) {
    if let Some(n) = m.get_mut(key) {
        *n += 1;
    } else if m.len() < NAMES {
        m.insert(super::truncate(key, 128).into_owned(), 1);
    } else {
        *other += 1;
    }
}

struct Bucket {
    tokens: u32,
    refilled_ms: u64,
    aggregated_ms: u64,
    pending: Option<Pending>,
}

/// What to write for one denial.
pub struct Decision {
    /// An aggregate of earlier denials, to write first.
    pub aggregate: Option<Pending>,
    /// Whether this denial is written one by one.
    pub write: bool,
}

#[derive(Default)]
pub struct Limiter {
    buckets: HashMap<u32, Bucket>,
    /// How many buckets hold pending denials (none: nothing to flush).
    pending: usize,
}

impl Limiter {
    /// Decides a denial of `principal` (of `tool`, with error `code`) at `now` ms.
    pub fn deny(
        &mut self,
        principal: Option<&Principal>,
        tool: &str,
        code: &str,
        now: u64,
    ) -> Decision {
        let mut uid = principal.map_or(u32::MAX, |p| p.uid);
        if !self.buckets.contains_key(&uid) && self.buckets.len() >= UIDS {
            // Forget the uids whose bucket is full again and holds nothing.
            self.buckets.retain(|_, b| {
                b.pending.is_some() || refilled(b.tokens, b.refilled_ms, now) < BURST
            });
            if self.buckets.len() >= UIDS {
                uid = u32::MAX;
            }
        }
        let b = self.buckets.entry(uid).or_insert(Bucket {
            tokens: BURST,
            refilled_ms: now,
            aggregated_ms: now,
            pending: None,
        });
        let tokens = refilled(b.tokens, b.refilled_ms, now);
        if tokens > b.tokens {
            b.refilled_ms += u64::from(tokens - b.tokens) * REFILL_MS;
        }
        if tokens >= BURST {
            b.refilled_ms = now;
        }
        b.tokens = tokens;
        if b.tokens > 0 {
            b.tokens -= 1;
            let aggregate = b.pending.take();
            if aggregate.is_some() {
                b.aggregated_ms = now;
                self.pending -= 1;
            }
            return Decision {
                aggregate,
                write: true,
            };
        }
        let p = b.pending.get_or_insert_with(|| {
            self.pending += 1;
            Pending {
                principal: principal.cloned(),
                count: 0,
                first_ms: now,
                last_ms: now,
                tools: BTreeMap::new(),
                codes: BTreeMap::new(),
                other_tools: 0,
                other_codes: 0,
            }
        });
        p.count += 1;
        p.last_ms = now;
        bump(&mut p.tools, &mut p.other_tools, tool);
        bump(&mut p.codes, &mut p.other_codes, code);
        if now.saturating_sub(b.aggregated_ms) >= AGGREGATE_MS {
            b.aggregated_ms = now;
            self.pending -= 1;
            return Decision {
                aggregate: b.pending.take(),
                write: false,
            };
        }
        Decision {
            aggregate: None,
            write: false,
        }
    }

    /// Every pending aggregate, taken (before an event of another kind, and at the end).
    pub fn flush(&mut self, now: u64) -> Vec<Pending> {
        if self.pending == 0 {
            return vec![];
        }
        self.pending = 0;
        let mut out: Vec<Pending> = self
            .buckets
            .values_mut()
            .filter_map(|b| {
                let p = b.pending.take()?;
                b.aggregated_ms = now;
                Some(p)
            })
            .collect();
        out.sort_by_key(|p| p.first_ms);
        out
    }
}

/// The tokens of a bucket that had `tokens` at `since`, at `now`.
fn refilled(tokens: u32, since: u64, now: u64) -> u32 {
    let more = now.saturating_sub(since) / REFILL_MS;
    tokens
        .saturating_add(u32::try_from(more).unwrap_or(u32::MAX))
        .min(BURST)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn who(uid: u32) -> Principal {
        Principal {
            uid,
            gid: uid,
            pid: None,
            client: None,
            groups: vec![],
        }
    }

    #[test]
    fn a_burst_then_one_per_refill_and_every_denial_counted() {
        let mut l = Limiter::default();
        let p = who(7);
        let mut written = 0u64;
        let mut aggregated = 0u64;
        let mut aggregates = 0u64;
        // 100,000 denials over 10 minutes (one every 6 ms).
        for i in 0..100_000u64 {
            let d = l.deny(
                Some(&p),
                &format!("tool{}", i % 40),
                "TOOL_FORBIDDEN",
                i * 6,
            );
            if let Some(a) = d.aggregate {
                aggregated += a.count;
                aggregates += 1;
                assert!(
                    a.event().detail()["aggregated"]["tools"]
                        .as_object()
                        .unwrap()
                        .len()
                        <= NAMES
                );
            }
            written += u64::from(d.write);
        }
        for a in l.flush(600_000) {
            aggregated += a.count;
            aggregates += 1;
        }
        assert_eq!(written + aggregated, 100_000);
        // 32 at once, then one per 10 s over 600 s; aggregates at most one per token and
        // one per minute.
        assert!(
            written <= u64::from(BURST) + 60,
            "{written} written one by one"
        );
        assert!(aggregates <= 60 + 10 + 1, "{aggregates} aggregates");
        // Another uid has its own bucket.
        assert!(l.deny(Some(&who(8)), "t", "c", 600_000).write);
    }
}
