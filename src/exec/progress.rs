//! What a call reports while it runs, for a client that asked (`progressToken`): the
//! daemon's own phases, in order, and the latest report of the worker. `exec` only feeds
//! these channels; `mcp` turns them into `notifications/progress`, at its own pace.

use tokio::sync::{mpsc, watch};

use crate::sandbox::{ProgressSender, WorkerProgress};

/// The daemon's phases of one call.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Phase {
    /// Accepted; waiting for the session, the targets and a worker slot.
    Queued,
    /// The worker runs.
    Running,
    /// Past the point of no return: the outputs are being published and the state committed.
    Publishing,
}

impl Phase {
    pub fn as_str(self) -> &'static str {
        match self {
            Phase::Queued => "queued",
            Phase::Running => "running",
            Phase::Publishing => "publishing",
        }
    }
}

/// The executor's end: phases (at most one of each per call, so unbounded is bounded) and
/// the worker's latest report.
#[derive(Clone)]
pub struct Progress {
    phases: mpsc::UnboundedSender<Phase>,
    worker: ProgressSender,
}

/// The forwarder's end. Both channels close when the call is over.
pub struct ProgressFeed {
    pub phases: mpsc::UnboundedReceiver<Phase>,
    pub worker: watch::Receiver<Option<WorkerProgress>>,
}

pub fn channel() -> (Progress, ProgressFeed) {
    let (ptx, prx) = mpsc::unbounded_channel();
    let (wtx, wrx) = watch::channel(None);
    (
        Progress {
            phases: ptx,
            worker: wtx,
        },
        ProgressFeed {
            phases: prx,
            worker: wrx,
        },
    )
}

impl Progress {
    pub fn phase(&self, p: Phase) {
        let _ = self.phases.send(p);
    }

    /// Where a worker's reports go.
    pub fn worker(&self) -> ProgressSender {
        self.worker.clone()
    }
}
