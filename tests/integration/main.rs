//! All integration tests, in one binary that drives the real `airlock` program over a real
//! socket (the layout of Codex's Linux sandbox tests). The shared harness lives in the
//! `airlock-test-support` crate (`tests/support`), which the smoke tests and the bench use too.

use airlock_test_support::harness;

mod audit;
mod authz;
mod bounds;
mod cancel;
mod client_cli;
mod containment;
mod crash;
mod daemon;
mod dir_outputs;
mod eras;
mod features;
mod file_tools;
mod idempotency;
mod inout;
mod policy_dirs;
mod python_tools;
mod race;
mod reload;
mod robust_args;
mod robust_mcp;
mod robust_publish;
mod sandbox;
mod secrets;
mod soak;
mod spawner;
mod systemd;
mod uid_separation;
mod undo;
