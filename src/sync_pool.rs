//! Long-lived threads for the durability work of the write path that runs at the same moment
//! as other work: fsyncs that no order ties together are issued together (so the filesystem
//! serves them with one flush) and each waits on a thread of its own.
//!
//! Starting a thread per fsync cost a write call a dozen thread creations and exits (stack
//! mappings, and the TLB shootdowns of unmapping them in a multi-threaded process). Here a
//! thread is started only when every existing one is busy, and then parks on a condvar for
//! good: no timer, so an idle daemon is never woken by them, and their number is the most
//! fsyncs ever in flight at once. Work never waits on other queued work (each task is an
//! fsync or a group-committed dir sync whose leader is already running), so a queued task
//! always finds a thread; if no thread can be started and none is idle, the task runs on the
//! caller's thread instead: slower, never lost.

use std::collections::VecDeque;
use std::panic::AssertUnwindSafe;
use std::sync::mpsc;
use std::sync::{Condvar, Mutex, OnceLock};

/// A task's work, which returns how to hand its result to its caller: the two are split so
/// that the thread counts itself idle again before the caller hears of the result.
type Task = Box<dyn FnOnce() -> Deliver + Send>;
type Deliver = Box<dyn FnOnce() + Send>;

struct Pool {
    state: Mutex<State>,
    ready: Condvar,
}

#[derive(Default)]
struct State {
    tasks: VecDeque<Task>,
    /// Threads free to take a task: parked on `ready`, or done with one (its result about
    /// to be handed over) and about to look for the next.
    idle: usize,
}

/// A pool thread's stack: an fsync or a dir sync needs little.
const STACK: usize = 256 << 10;

fn pool() -> &'static Pool {
    static POOL: OnceLock<Pool> = OnceLock::new();
    POOL.get_or_init(Pool::new)
}

impl Pool {
    fn new() -> Pool {
        Pool {
            state: Mutex::new(State::default()),
            ready: Condvar::new(),
        }
    }
}

/// What [`run`] returns: the task's result, once it has run.
pub struct Pending<T> {
    rx: mpsc::Receiver<T>,
}

impl<T> Pending<T> {
    /// Waits for the task. `None` if it panicked (its result was never sent).
    pub fn wait(self) -> Option<T> {
        self.rx.recv().ok()
    }
}

impl<T> Pending<std::io::Result<T>> {
    /// Waits for an I/O task; one that panicked (in fsync, say) failed: EIO, never success.
    pub fn wait_io(self) -> std::io::Result<T> {
        self.wait()
            .unwrap_or_else(|| Err(std::io::Error::from_raw_os_error(libc::EIO)))
    }
}

/// Runs `sync` (`File::sync_data` or `File::sync_all`) of `file` on a pool thread, through
/// a duplicate of its descriptor.
pub fn sync_file(
    file: &std::fs::File,
    sync: fn(&std::fs::File) -> std::io::Result<()>,
) -> std::io::Result<Pending<std::io::Result<()>>> {
    let file = file.try_clone()?;
    Ok(run(move || sync(&file)))
}

/// Runs `f` on a pool thread, at once: an idle thread takes it, or a new one is started.
pub fn run<T: Send + 'static>(f: impl FnOnce() -> T + Send + 'static) -> Pending<T> {
    run_on(pool(), f)
}

/// [`run`] on `pool`.
fn run_on<T: Send + 'static>(
    pool: &'static Pool,
    f: impl FnOnce() -> T + Send + 'static,
) -> Pending<T> {
    let (tx, rx) = mpsc::sync_channel(1);
    let task: Task = Box::new(move || {
        let result = f();
        Box::new(move || {
            // The receiver is gone only if its caller panicked: nothing to tell then.
            let _ = tx.send(result);
        })
    });
    let mut state = lock(&pool.state);
    state.tasks.push_back(task);
    if state.idle >= state.tasks.len() {
        drop(state);
        pool.ready.notify_one();
        return Pending { rx };
    }
    drop(state);
    // Every thread is busy (or already has a task to take): one more.
    let started = std::thread::Builder::new()
        .name("airlock-sync".into())
        .stack_size(STACK)
        .spawn(move || worker(pool));
    if let Err(e) = started {
        tracing::warn!(error = %e, "cannot start a sync thread; the caller's thread runs the fsync");
        // The caller's thread runs one queued task: this one, or one queued before it whose
        // own caller got here too; each queued task is taken by a thread or by its caller.
        let task = lock(&pool.state).tasks.pop_front();
        if let Some(deliver) = task.and_then(run_task) {
            deliver();
        }
    }
    Pending { rx }
}

fn worker(pool: &'static Pool) {
    let mut state = lock(&pool.state);
    state.idle += 1;
    loop {
        let Some(task) = state.tasks.pop_front() else {
            state = pool
                .ready
                .wait(state)
                .unwrap_or_else(std::sync::PoisonError::into_inner);
            continue;
        };
        state.idle -= 1;
        drop(state);
        let deliver = run_task(task);
        // Free again before the caller hears of the result: a caller that issues its next
        // task as soon as it has this one's finds this thread rather than starting another.
        lock(&pool.state).idle += 1;
        if let Some(deliver) = deliver {
            deliver();
        }
        state = lock(&pool.state);
    }
}

/// A task that panics loses its result (its caller's [`Pending::wait`] says so), not the
/// thread.
fn run_task(task: Task) -> Option<Deliver> {
    std::panic::catch_unwind(AssertUnwindSafe(task)).ok()
}

fn lock(m: &Mutex<State>) -> std::sync::MutexGuard<'_, State> {
    m.lock().unwrap_or_else(std::sync::PoisonError::into_inner)
}

#[cfg(test)]
mod tests {
    use std::collections::HashSet;
    use std::sync::atomic::{AtomicUsize, Ordering};
    use std::sync::Arc;
    use std::time::{Duration, Instant};

    use super::{run, run_on, Pool};

    /// Tasks issued together run at the same moment: each waits until all have started,
    /// which a pool that ran them one after another would never see.
    #[test]
    fn tasks_issued_together_run_at_once() {
        let started = Arc::new(AtomicUsize::new(0));
        let pending: Vec<_> = (0..4)
            .map(|_| {
                let started = Arc::clone(&started);
                run(move || {
                    started.fetch_add(1, Ordering::SeqCst);
                    let deadline = Instant::now() + Duration::from_secs(10);
                    while started.load(Ordering::SeqCst) < 4 && Instant::now() < deadline {
                        std::thread::yield_now();
                    }
                    started.load(Ordering::SeqCst)
                })
            })
            .collect();
        for p in pending {
            assert_eq!(
                p.wait(),
                Some(4),
                "a task ran while the others had not started"
            );
        }
    }

    /// A thread is reused once idle: tasks one after another do not each start one.
    #[test]
    fn idle_threads_take_the_next_task() {
        // A pool of its own: the process's is shared with the tests running beside this one.
        let pool: &'static Pool = Box::leak(Box::new(Pool::new()));
        let threads: HashSet<_> = (0..20)
            .map(|_| {
                run_on(pool, || std::thread::current().id())
                    .wait()
                    .expect("the task ran")
            })
            .collect();
        assert!(
            threads.len() < 20,
            "20 tasks one after another ran on 20 threads"
        );
    }

    /// A task that panics reports no result, and the pool goes on serving.
    #[test]
    fn a_panicking_task_reports_nothing_and_the_pool_serves_on() {
        let p = run(|| -> u32 { panic!("injected") });
        assert_eq!(p.wait(), None);
        assert_eq!(run(|| 7).wait(), Some(7));
    }
}
