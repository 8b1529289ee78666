//! The audit lifecycle of one call: what its steps returned (how far it got, how its worker
//! ended, how it stopped) decides its terminal events, here and nowhere else. Pure: the
//! sequences are unit-tested without a daemon.
//!
//! The events a step records as it happens stay with that step: `allow`, `start`, the
//! durable `commit` (before the commit point), and the wait's `timeout` or `cancel` with
//! `worker_terminated`. What follows them is [`Ending::events`].

use serde_json::Value;

use super::CallError;
use crate::audit::event::{Cancel, Cause, Deny, Done, Event, Exit, Failure, Phase, Ran, Rollback};

/// What the wait learned of a worker whose group is gone.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) struct WorkerEnd {
    /// When the group was gone, in ms since the call began.
    pub worker_ms: u64,
    /// How it ended, if on its own (not killed at its timeout or a cancel).
    pub exit: Option<Exit>,
}

/// How far a call got.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) enum Reached {
    /// Still in its queue (locks, slot) or refused there: nothing ran.
    Queued,
    /// `start` was recorded: its work began; `worker` once its wait returned.
    Started { worker: Option<WorkerEnd> },
}

impl Reached {
    fn started(self) -> bool {
        matches!(self, Reached::Started { .. })
    }
}

/// Why a call ended without a result to publish; becomes a fault reply or no reply.
#[derive(Debug)]
pub(super) enum Stop {
    Fault(CallError),
    /// The worker outlived its timeout; the wait recorded `timeout` and `worker_terminated`.
    TimedOut(CallError),
    /// Refused where a queued call starts: the policy current then no longer serves or
    /// grants its tool. Recorded as `deny`; nothing ran.
    Denied(CallError),
    /// Cancelled; `recorded`: the wait recorded the `cancel` (and `worker_terminated`).
    Cancelled {
        recorded: bool,
    },
}

impl Stop {
    pub(super) const CANCELLED: Stop = Stop::Cancelled { recorded: false };
}

impl<E: Into<CallError>> From<E> for Stop {
    fn from(e: E) -> Stop {
        Stop::Fault(e.into())
    }
}

/// What a call's runner returns: how far it got, and its result.
#[derive(Debug)]
pub(super) struct Run<T> {
    pub reached: Reached,
    pub result: Result<T, Stop>,
}

impl<T> Run<T> {
    pub(super) fn queued(stop: Stop) -> Run<T> {
        Run {
            reached: Reached::Queued,
            result: Err(stop),
        }
    }

    pub(super) fn started(worker: Option<WorkerEnd>, result: Result<T, Stop>) -> Run<T> {
        Run {
            reached: Reached::Started { worker },
            result,
        }
    }
}

/// Who cancelled: what a `cancel` event names.
#[derive(Debug, Clone, PartialEq)]
pub(super) struct Canceller {
    pub cause: Cause,
    /// The client's request id (`null` if none), for a client's cancel.
    pub request_id: Option<Value>,
}

impl Canceller {
    pub(super) fn new(client: bool, shutdown: bool, request_id: Option<Value>) -> Canceller {
        if client {
            Canceller {
                cause: Cause::Client,
                request_id: Some(request_id.unwrap_or(Value::Null)),
            }
        } else {
            Canceller {
                cause: if shutdown {
                    Cause::Shutdown
                } else {
                    Cause::Disconnect
                },
                request_id: None,
            }
        }
    }

    pub(super) fn event(&self, phase: Phase, too_late: bool) -> Event {
        Event::Cancel(Cancel {
            cause: self.cause,
            request_id: self.request_id.clone(),
            phase,
            too_late,
        })
    }
}

/// How a call ended, as its terminal events see it.
#[derive(Debug, Clone, PartialEq)]
pub(super) enum Outcome {
    /// Its result is sent (a mutating call's `commit` is recorded).
    Done,
    /// It failed with `code`; `timed_out`: its worker outlived the timeout.
    Fault {
        code: &'static str,
        message: Option<String>,
        timed_out: bool,
        /// A `python` tool's exception class, for the `error` event.
        exception_type: Option<String>,
        /// Its commit point may or may not be durable: no `rollback` follows the `error`
        /// (recovery at the next start records how the job ended).
        undecided: bool,
    },
    /// Refused where it would have started.
    Denied {
        code: &'static str,
        message: Option<String>,
    },
    /// Cancelled; `recorded`: the wait recorded the `cancel`.
    Cancelled { recorded: bool },
}

/// The facts of a call at its end.
#[derive(Debug, Clone, PartialEq)]
pub(super) struct Ending {
    /// A write tool or a mutating built-in: what it did is committed or rolled back.
    pub mutating: bool,
    pub reached: Reached,
    /// The call's cancellation fired and the call did not act on it (it came past the
    /// point of no return, or the call never waits on one).
    pub too_late: bool,
    pub duration_ms: u64,
    pub canceller: Canceller,
}

impl Ending {
    /// What every terminal event reports of the run.
    pub(super) fn ran(&self) -> Ran {
        let worker = match self.reached {
            Reached::Started { worker } => worker,
            Reached::Queued => None,
        };
        Ran {
            duration_ms: self.duration_ms,
            worker_ms: worker.map(|w| w.worker_ms),
            exit: worker.and_then(|w| w.exit),
        }
    }

    /// The terminal events, in order. A mutating call is one of `commit` (recorded by the
    /// call) [+ `cancel` too late]; `timeout, worker_terminated, rollback`; `cancel,
    /// worker_terminated, rollback`; `error, rollback` once started; `error` or `cancel`
    /// (`phase: "queued"`) before; `deny`. A read call ends in `done` or `error`.
    pub(super) fn events(&self, outcome: Outcome) -> Vec<Event> {
        let started = self.reached.started();
        let rolls_back = self.mutating && started;
        let mut events = Vec::new();
        match outcome {
            Outcome::Done if self.mutating => {
                if self.too_late {
                    events.push(self.canceller.event(Phase::Committed, true));
                }
            }
            Outcome::Done => events.push(Event::Done(Done {
                ran: self.ran(),
                cancel_too_late: self.too_late,
            })),
            Outcome::Fault {
                code,
                message,
                timed_out,
                exception_type,
                undecided,
            } => {
                // A mutating call's timeout reads `timeout, worker_terminated, rollback`.
                if !(self.mutating && timed_out) {
                    events.push(Event::Error(Failure::Call {
                        ran: self.ran(),
                        code: code.into(),
                        message,
                        phase: if started {
                            Phase::Running
                        } else {
                            Phase::Queued
                        },
                        cancel_too_late: self.too_late,
                        exception_type,
                    }));
                }
                if rolls_back && !undecided {
                    events.push(Event::Rollback(Rollback::Failed {
                        ran: self.ran(),
                        code: code.into(),
                    }));
                }
            }
            // Refused where it would have started: nothing ran, nothing to roll back.
            Outcome::Denied { code, message } => events.push(Event::Deny(Deny::Call {
                code: code.into(),
                message,
                phase: Some(Phase::Queued),
            })),
            Outcome::Cancelled { recorded } => {
                if !recorded {
                    // Cancelled while queued (locks, a slot), or after its worker ended and
                    // before publication began.
                    let phase = if started {
                        Phase::BeforePublish
                    } else {
                        Phase::Queued
                    };
                    events.push(self.canceller.event(phase, false));
                }
                if rolls_back {
                    events.push(Event::Rollback(Rollback::Cancelled {
                        ran: self.ran(),
                        reason: "cancelled",
                    }));
                }
            }
        }
        events
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::audit::EventKind;

    const WORKER: WorkerEnd = WorkerEnd {
        worker_ms: 4,
        exit: Some(Exit::Status(0)),
    };

    fn ending(mutating: bool, reached: Reached, too_late: bool) -> Ending {
        Ending {
            mutating,
            reached,
            too_late,
            duration_ms: 9,
            canceller: Canceller::new(false, false, None),
        }
    }

    fn kinds(events: &[Event]) -> Vec<&'static str> {
        events.iter().map(|e| e.kind().as_str()).collect()
    }

    fn fault(code: &'static str, timed_out: bool) -> Outcome {
        Outcome::Fault {
            code,
            message: Some("m".into()),
            timed_out,
            undecided: false,
            exception_type: None,
        }
    }

    const STARTED: Reached = Reached::Started {
        worker: Some(WORKER),
    };

    /// allow, start, commit: nothing after the commit the call recorded.
    #[test]
    fn a_committed_write_adds_nothing() {
        assert!(ending(true, STARTED, false)
            .events(Outcome::Done)
            .is_empty());
    }

    /// A cancel past the point of no return: the result is sent, `cancel` says too late.
    #[test]
    fn a_cancel_after_the_point_of_no_return_is_too_late() {
        let e = ending(true, STARTED, true).events(Outcome::Done);
        assert_eq!(kinds(&e), ["cancel"]);
        assert_eq!(
            e[0].detail(),
            serde_json::json!({"cause": "disconnect", "phase": "committed", "too_late": true})
        );
    }

    /// A read's `done` carries the run and, if the cancel came too late, says so.
    #[test]
    fn a_read_ends_in_done() {
        let e = ending(false, STARTED, false).events(Outcome::Done);
        assert_eq!(kinds(&e), ["done"]);
        assert_eq!(
            e[0].detail(),
            serde_json::json!({"duration_ms": 9, "worker_ms": 4, "exit": {"status": 0}})
        );
        let e = ending(false, STARTED, true).events(Outcome::Done);
        assert_eq!(e[0].detail()["cancel_too_late"], true);
    }

    /// allow, start, timeout, worker_terminated (recorded by the wait), rollback.
    #[test]
    fn a_timed_out_write_rolls_back_without_an_error() {
        let worker = Some(WorkerEnd {
            worker_ms: 4,
            exit: None,
        });
        let e = ending(true, Reached::Started { worker }, false).events(fault("TIMEOUT", true));
        assert_eq!(kinds(&e), ["rollback"]);
        assert_eq!(
            e[0].detail(),
            serde_json::json!({"duration_ms": 9, "worker_ms": 4, "code": "TIMEOUT"})
        );
    }

    /// A read that times out reports the error (it has nothing to roll back).
    #[test]
    fn a_timed_out_read_is_an_error() {
        let e = ending(false, STARTED, false).events(fault("TIMEOUT", true));
        assert_eq!(kinds(&e), ["error"]);
    }

    /// allow, start, error, rollback: a failed worker (its exit in both).
    #[test]
    fn a_failed_write_is_an_error_then_a_rollback() {
        let worker = Some(WorkerEnd {
            worker_ms: 4,
            exit: Some(Exit::Status(3)),
        });
        let e =
            ending(true, Reached::Started { worker }, false).events(fault("TOOL_FAILED", false));
        assert_eq!(kinds(&e), ["error", "rollback"]);
        assert_eq!(
            e[0].detail(),
            serde_json::json!({"duration_ms": 9, "worker_ms": 4, "exit": {"status": 3},
                               "code": "TOOL_FAILED", "message": "m", "phase": "running"})
        );
        assert_eq!(e[1].detail()["code"], "TOOL_FAILED");
    }

    /// A change that may or may not be durable (a write's commit, a session create or
    /// destroy) is an error and no rollback: the next start decides it.
    #[test]
    fn an_undecided_change_is_an_error_without_a_rollback() {
        for code in ["COMMIT_UNDECIDED", "STATE_ERROR"] {
            let undecided = Outcome::Fault {
                code,
                message: Some("m".into()),
                timed_out: false,
                undecided: true,
                exception_type: None,
            };
            let e = ending(true, STARTED, false).events(undecided);
            assert_eq!(kinds(&e), ["error"], "{code}");
        }
    }

    /// The commit event could not be made durable: error and rollback, AUDIT_FAILED.
    #[test]
    fn an_audit_failure_rolls_back() {
        let e = ending(true, STARTED, false).events(fault("AUDIT_FAILED", false));
        assert_eq!(kinds(&e), ["error", "rollback"]);
        assert_eq!(e[1].detail()["code"], "AUDIT_FAILED");
    }

    /// A fault before the start (bad path, busy, spawn failed): error in phase queued, no
    /// rollback (nothing was created that stays).
    #[test]
    fn a_fault_while_queued_is_an_error_only() {
        let e = ending(true, Reached::Queued, false).events(fault("BUSY", false));
        assert_eq!(kinds(&e), ["error"]);
        assert_eq!(
            e[0].detail(),
            serde_json::json!({"duration_ms": 9, "code": "BUSY", "message": "m",
                               "phase": "queued"})
        );
        // A cancel that fired meanwhile is noted.
        let e = ending(true, Reached::Queued, true).events(fault("BUSY", false));
        assert_eq!(e[0].detail()["cancel_too_late"], true);
    }

    /// Refused where it would start: one deny in phase queued.
    #[test]
    fn a_recheck_refusal_is_a_deny() {
        let e = ending(true, Reached::Queued, false).events(Outcome::Denied {
            code: "TOOL_FORBIDDEN",
            message: None,
        });
        assert_eq!(kinds(&e), ["deny"]);
        assert_eq!(
            e[0].detail(),
            serde_json::json!({"code": "TOOL_FORBIDDEN", "message": null, "phase": "queued"})
        );
    }

    /// Cancelled while queued: one cancel, phase queued, nothing to roll back.
    #[test]
    fn a_cancel_while_queued() {
        let mut end = ending(true, Reached::Queued, true);
        end.canceller = Canceller::new(true, false, Some(serde_json::json!(7)));
        let e = end.events(Outcome::Cancelled { recorded: false });
        assert_eq!(kinds(&e), ["cancel"]);
        assert_eq!(
            e[0].detail(),
            serde_json::json!({"cause": "client", "request_id": 7, "phase": "queued"})
        );
    }

    /// Cancelled in flight: the wait recorded cancel and worker_terminated; then rollback.
    #[test]
    fn a_cancel_in_flight_rolls_back() {
        let worker = Some(WorkerEnd {
            worker_ms: 4,
            exit: None,
        });
        let e = ending(true, Reached::Started { worker }, true)
            .events(Outcome::Cancelled { recorded: true });
        assert_eq!(kinds(&e), ["rollback"]);
        assert_eq!(
            e[0].detail(),
            serde_json::json!({"duration_ms": 9, "worker_ms": 4, "reason": "cancelled"})
        );
    }

    /// Cancelled after the worker ended, before publication: cancel before_publish, then
    /// rollback.
    #[test]
    fn a_cancel_before_publication_rolls_back() {
        let mut end = ending(true, STARTED, true);
        end.canceller = Canceller::new(false, true, Some(serde_json::json!(7)));
        let e = end.events(Outcome::Cancelled { recorded: false });
        assert_eq!(kinds(&e), ["cancel", "rollback"]);
        assert_eq!(
            e[0].detail(),
            serde_json::json!({"cause": "shutdown", "phase": "before_publish"})
        );
    }

    /// A read cancelled in flight ends with what the wait recorded.
    #[test]
    fn a_read_cancelled_in_flight_adds_nothing() {
        let e = ending(false, STARTED, true).events(Outcome::Cancelled { recorded: true });
        assert!(e.is_empty());
    }

    /// Every terminal event the lifecycle emits is of a kind the enum and README name.
    #[test]
    fn terminal_kinds_are_event_kinds() {
        let all = [
            Outcome::Done,
            fault("X", false),
            fault("X", true),
            Outcome::Denied {
                code: "X",
                message: None,
            },
            Outcome::Cancelled { recorded: false },
            Outcome::Cancelled { recorded: true },
        ];
        for mutating in [false, true] {
            for reached in [Reached::Queued, STARTED] {
                for too_late in [false, true] {
                    for o in all.clone() {
                        for e in ending(mutating, reached, too_late).events(o) {
                            assert!(EventKind::ALL.contains(&e.kind()));
                        }
                    }
                }
            }
        }
    }
}
