//! The test code shared by airlock's integration tests (`tests/integration`), the sandbox
//! smoke tests (`tests/sandbox_smoke.rs`) and the benchmark table (`bench/table.rs`): the
//! real `airlock` binary started on a temporary socket ([`harness::Daemon`]), its clients,
//! waits on observable events, and the `/proc` readers the soak and the bench share
//! ([`soak`]). It drives the daemon only over its socket and its command line, never through
//! the crate's internals.

pub mod harness;
pub mod soak;
