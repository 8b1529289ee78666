//! Audit evidence: one event per step of each call, kept in an in-memory ring and served as
//! the `airlock://audit/events` resource.

use std::collections::VecDeque;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Mutex;
use std::time::{SystemTime, UNIX_EPOCH};

use serde::Serialize;
use serde_json::Value;

/// Who made a call: the socket peer's credentials (SO_PEERCRED) and its MCP clientInfo.
#[derive(Debug, Clone, Serialize, PartialEq, Eq)]
pub struct Principal {
    pub uid: u32,
    pub gid: u32,
    pub pid: Option<i32>,
    pub client: Option<String>,
}

/// One step of one call.
#[derive(Debug, Clone, Serialize)]
pub struct Event {
    pub seq: u64,
    /// Milliseconds since the Unix epoch.
    pub time_ms: u64,
    /// The call's id (also its job id for mutating calls).
    pub call: String,
    pub tool: String,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub session: Option<String>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub principal: Option<Principal>,
    /// `allow`, `deny`, `locked`, `spawned`, `sandbox`, `published`, `commit`, `rollback`,
    /// `timeout`, `cancelled`, `failed`, `done`.
    pub kind: &'static str,
    #[serde(skip_serializing_if = "Value::is_null")]
    pub detail: Value,
}

/// What every event of one call shares.
#[derive(Debug, Clone)]
pub struct CallRef {
    pub call: String,
    pub tool: String,
    pub session: Option<String>,
    pub principal: Option<Principal>,
}

pub struct Audit {
    ring: Mutex<VecDeque<Event>>,
    capacity: usize,
    seq: AtomicU64,
}

impl Audit {
    pub fn new(capacity: usize) -> Audit {
        Audit {
            ring: Mutex::new(VecDeque::with_capacity(capacity.min(1024))),
            capacity: capacity.max(1),
            seq: AtomicU64::new(0),
        }
    }

    pub fn record(&self, call: &CallRef, kind: &'static str, detail: Value) {
        let event = Event {
            seq: self.seq.fetch_add(1, Ordering::SeqCst),
            time_ms: SystemTime::now()
                .duration_since(UNIX_EPOCH)
                .map_or(0, |d| d.as_millis() as u64),
            call: call.call.clone(),
            tool: call.tool.clone(),
            session: call.session.clone(),
            principal: call.principal.clone(),
            kind,
            detail,
        };
        tracing::debug!(call = %event.call, tool = %event.tool, kind, "audit");
        let mut ring = self.ring.lock().unwrap_or_else(|p| p.into_inner());
        if ring.len() == self.capacity {
            ring.pop_front();
        }
        ring.push_back(event);
    }

    /// Every event still in the ring, oldest first.
    pub fn events(&self) -> Vec<Event> {
        self.ring
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .iter()
            .cloned()
            .collect()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn ring_keeps_the_newest() {
        let a = Audit::new(2);
        let c = CallRef {
            call: "c".into(),
            tool: "t".into(),
            session: None,
            principal: None,
        };
        for _ in 0..3 {
            a.record(&c, "allow", Value::Null);
        }
        let seqs: Vec<u64> = a.events().iter().map(|e| e.seq).collect();
        assert_eq!(seqs, vec![1, 2]);
    }
}
