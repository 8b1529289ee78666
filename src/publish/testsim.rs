//! A per-thread failpoint simulator for unit tests (tests run in parallel threads, so it
//! cannot use the process-global environment of `crate::failpoint`).
//!
//! * `Crash(n)`: point n and every later point fail, as if the process died at point n
//!   (no mutation after it happens, the in-process rollback included).
//! * `Error(n)`: only point n fails, with EIO; the code's own error handling runs.

use std::cell::RefCell;

#[derive(Clone, Copy, Debug)]
pub enum Mode {
    Off,
    Crash(usize),
    Error(usize),
}

struct State {
    mode: Mode,
    names: Vec<&'static str>,
}

thread_local! {
    static STATE: RefCell<State> = const { RefCell::new(State { mode: Mode::Off, names: Vec::new() }) };
}

pub fn arm(mode: Mode) {
    STATE.with(|s| {
        let mut s = s.borrow_mut();
        s.mode = mode;
        s.names.clear();
    });
}

/// Disarms and returns the names of the points reached since `arm`.
pub fn disarm() -> Vec<&'static str> {
    STATE.with(|s| {
        let mut s = s.borrow_mut();
        s.mode = Mode::Off;
        std::mem::take(&mut s.names)
    })
}

pub fn hit(name: &'static str) -> std::io::Result<()> {
    STATE.with(|s| {
        let mut s = s.borrow_mut();
        let n = s.names.len();
        s.names.push(name);
        let fail = match s.mode {
            Mode::Off => false,
            Mode::Crash(k) => n >= k,
            Mode::Error(k) => n == k,
        };
        if fail {
            Err(std::io::Error::from_raw_os_error(libc::EIO))
        } else {
            Ok(())
        }
    })
}
