//! The `airlock` binary. Spawner mode is dispatched first, before any runtime or thread
//! exists, so every worker is forked from, and set up by, a single-threaded process.

fn main() {
    if std::env::args_os()
        .nth(1)
        .is_some_and(|a| a == airlock::sandbox::SPAWNER_ARG)
    {
        airlock::sandbox::spawner_main();
    }
    std::process::exit(airlock::cli::main().code());
}
