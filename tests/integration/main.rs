//! All integration tests, in one binary that drives the real `airlock` program over a real
//! socket (the layout of Codex's Linux sandbox tests).

mod daemon;
mod harness;
mod sandbox;
