//! The `airlock` binary. Launcher mode is dispatched first, before any runtime or thread
//! exists, so a worker's sandbox is set up by a single-threaded process.

fn main() {
    if std::env::args_os()
        .nth(1)
        .is_some_and(|a| a == airlock::sandbox::LAUNCHER_ARG)
    {
        airlock::sandbox::launcher_main();
    }
    std::process::exit(airlock::cli::main().code());
}
