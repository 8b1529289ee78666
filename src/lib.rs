//! airlock: an executor daemon for MCP tool calls whose every terminal response is a state
//! boundary. See ARCHITECTURE.md for the map.

#![deny(clippy::undocumented_unsafe_blocks)]

pub mod audit;
pub mod cli;
pub mod exec;
pub mod failpoint;
pub mod fsutil;
pub mod jobs;
pub mod mcp;
pub mod policy;
pub mod publish;
pub mod report;
pub mod sandbox;
pub mod session;
pub mod startup;
pub mod sync_pool;
pub mod syscalls;
pub mod systemd;
pub mod text;
