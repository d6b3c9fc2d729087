//! How the threads of a pipeline that calls Python stop: joined with the GIL released where
//! it is closed; from another thread when the garbage collector frees it during one of its
//! own calls (a thread cannot join itself); and at exit, none of ours left in Python when the
//! interpreter stops: a thread of ours waiting for the GIL then is unwound by the interpreter
//! (`pthread_exit`) through Rust frames, and the process aborts.
//!
//! At exit (`_join_closing`, after the open pipelines were closed): the threads stopping
//! pipelines freed on their own threads are joined; then [`EXITING`](crate::EXITING) is set,
//! from which on no thread of ours enters Python (a pipeline's thread about to call it, or a
//! Python thread about to wait for a batch, parks until the process ends); and exit waits for
//! the calls and waits already under way to end (at most [`EXIT_WAIT`]; a Ctrl-C meanwhile
//! ends the process at once).

use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Mutex;
use std::time::Instant;

use pyo3::prelude::*;

std::thread_local! {
    /// Whether this thread is in one of a pipeline's calls into Python (a stage, its source).
    static IN_PIPELINE: std::cell::Cell<bool> = const { std::cell::Cell::new(false) };
}

/// Calls into Python by pipelines' threads, and Python threads' waits for a result with the
/// GIL released, under way.
static IN_FLIGHT: AtomicUsize = AtomicUsize::new(0);

/// The thread that runs the exit (it finalizes the interpreter): it goes on, never parks.
static FINALIZER: std::sync::OnceLock<std::thread::ThreadId> = std::sync::OnceLock::new();

/// Exit has begun, for every thread but the one running it.
fn exiting() -> bool {
    crate::EXITING.load(Ordering::SeqCst) && FINALIZER.get() != Some(&std::thread::current().id())
}

/// From now on no other thread of ours enters Python (see the [module docs](self)).
pub(crate) fn set_exiting() {
    let _ = FINALIZER.set(std::thread::current().id());
    crate::EXITING.store(true, Ordering::SeqCst);
}

/// Counts a call or a wait under way ([`IN_FLIGHT`]); past exit, parks the thread for good
/// instead (it must not enter or return to Python: the process is ending).
pub(crate) struct InFlight(());

impl InFlight {
    pub(crate) fn enter() -> Self {
        // Counted before the flag is read, the flag set before the count is read at exit:
        // either exit waits for this one, or this one sees the flag.
        IN_FLIGHT.fetch_add(1, Ordering::SeqCst);
        if exiting() {
            IN_FLIGHT.fetch_sub(1, Ordering::SeqCst);
            loop {
                std::thread::park();
            }
        }
        Self(())
    }
}

impl Drop for InFlight {
    fn drop(&mut self) {
        IN_FLIGHT.fetch_sub(1, Ordering::SeqCst);
    }
}

/// `py.allow_threads(f)`, counted ([`IN_FLIGHT`]) until the GIL is taken back: exit waits
/// for it, so the interpreter does not stop while this thread is about to take the GIL again
/// with our frames on its stack. Past exit, parks the thread for good instead of running `f`.
pub(crate) fn released<T, F>(py: Python<'_>, f: F) -> T
where
    F: FnOnce() -> T + Send,
    T: Send,
{
    struct Decrement;
    impl Drop for Decrement {
        fn drop(&mut self) {
            IN_FLIGHT.fetch_sub(1, Ordering::SeqCst);
        }
    }
    IN_FLIGHT.fetch_add(1, Ordering::SeqCst);
    let _counted = Decrement;
    py.allow_threads(|| {
        if exiting() {
            IN_FLIGHT.fetch_sub(1, Ordering::SeqCst);
            loop {
                std::thread::park();
            }
        }
        f()
    })
}

/// `f` under the GIL, on a pipeline's thread: counted at exit ([`InFlight`]), and marked so
/// that a pipeline dropped there (the garbage collector may free a loader during any call
/// into Python) is not joined from a thread of its own.
pub(crate) fn with_gil_in_pipeline<R>(f: impl FnOnce(Python<'_>) -> R) -> R {
    let _call = InFlight::enter();
    let outer = IN_PIPELINE.with(|m| m.replace(true));
    // Out of a fork's way until the GIL is held (see `crate::fork`).
    let entering = crate::fork::Entering::new();
    let r = Python::with_gil(|py| {
        drop(entering);
        f(py)
    });
    IN_PIPELINE.with(|m| m.set(outer));
    r
}

/// In a forked child: the parent's calls and waits are not this process's.
pub(crate) fn forget_after_fork() {
    IN_FLIGHT.store(0, Ordering::SeqCst);
    if let Ok(mut c) = CLOSING.lock() {
        // The parent's closing threads do not exist here.
        std::mem::forget(std::mem::take(&mut *c));
    }
}

/// Threads stopping pipelines freed on one of their own threads.
static CLOSING: Mutex<Vec<std::thread::JoinHandle<()>>> = Mutex::new(Vec::new());

/// The longest exit waits for calls into Python under way, unless `FLOWGATE_EXIT_WAIT`
/// (seconds, 0 to 3600) says otherwise.
const EXIT_WAIT: std::time::Duration = std::time::Duration::from_secs(60);

/// [`EXIT_WAIT`], or `FLOWGATE_EXIT_WAIT` seconds where set to a number in 0..=3600 (a job
/// that would rather not wait a minute for a call that hangs; the tests of that wait).
fn exit_wait() -> std::time::Duration {
    let Ok(v) = std::env::var("FLOWGATE_EXIT_WAIT") else {
        return EXIT_WAIT;
    };
    match v.trim().parse::<f64>() {
        Ok(s) if (0.0..=3600.0).contains(&s) => std::time::Duration::from_secs_f64(s),
        _ => {
            eprintln!(
                "flowgate: FLOWGATE_EXIT_WAIT={v:?} is not a number of seconds in 0..=3600; \
                 exit waits {} s",
                EXIT_WAIT.as_secs()
            );
            EXIT_WAIT
        }
    }
}

/// Ends the process now with `status`, Python's own streams flushed first (`_exit` runs
/// nothing more of the process).
fn end_now(py: Python<'_>, status: i32) -> ! {
    for stream in ["stdout", "stderr"] {
        if let Ok(s) = py.import("sys").and_then(|sys| sys.getattr(stream)) {
            let _ = s.call_method0("flush");
        }
    }
    // SAFETY: ends the process without running anything more of it.
    unsafe { libc::_exit(status) }
}

/// Exit's closing of the open pipelines has begun (`_closing_at_exit`): a pipeline closed
/// from now on is stopped on a thread of its own, which exit waits for within [`exit_wait`]
/// (joining it here would wait forever for a call into the user's code that never returns).
static AT_EXIT: std::sync::atomic::AtomicBool = std::sync::atomic::AtomicBool::new(false);

/// At exit, before the open pipelines are closed; see [`AT_EXIT`].
#[pyfunction]
pub(crate) fn _closing_at_exit() {
    AT_EXIT.store(true, Ordering::SeqCst);
}

/// Whether exit's closing has begun ([`AT_EXIT`]).
pub(crate) fn at_exit() -> bool {
    AT_EXIT.load(Ordering::SeqCst)
}

/// At exit, after the open pipelines were closed; see the [module docs](self). Both waits
/// (the threads stopping pipelines, then the calls under way) share one [`exit_wait`].
#[pyfunction]
pub(crate) fn _join_closing(py: Python<'_>) {
    let wait = exit_wait();
    let deadline = Instant::now() + wait;
    let mut said = false;
    // One slice of a wait: false once the deadline has passed.
    let mut slice = |py: Python<'_>| -> bool {
        py.allow_threads(|| std::thread::sleep(std::time::Duration::from_millis(10)));
        if py.check_signals().is_err() {
            // Ctrl-C while calls into the user's code run on: end now, as asked.
            eprintln!("flowgate: interrupted at exit with calls into Python under way");
            end_now(py, 130);
        }
        let now = Instant::now();
        if !said && deadline.saturating_duration_since(now) < wait.saturating_sub(SAY_AFTER) {
            said = true;
            eprintln!(
                "flowgate: waiting at exit for calls into Python under way to end (Ctrl-C \
                 ends the process now)"
            );
        }
        now < deadline
    };
    let mut pending: Vec<std::thread::JoinHandle<()>> = Vec::new();
    loop {
        pending.extend(std::mem::take(&mut *CLOSING.lock().expect("closing")));
        let (done, rest): (Vec<_>, Vec<_>) = pending.into_iter().partition(|h| h.is_finished());
        done.into_iter().for_each(|h| drop(h.join()));
        pending = rest;
        if pending.is_empty() {
            break;
        }
        if !slice(py) {
            // Still stopping past the wait: left to the process's end.
            pending.into_iter().for_each(std::mem::forget);
            break;
        }
    }
    set_exiting();
    while IN_FLIGHT.load(Ordering::SeqCst) > 0 && slice(py) {}
    if IN_FLIGHT.load(Ordering::SeqCst) > 0 {
        // A call still running Python would take the GIL back while the interpreter stops,
        // which unwinds its thread through our frames and aborts the process (SIGABRT):
        // ended here instead, as a run that did not end cleanly.
        eprintln!(
            "flowgate: calls into Python still under way {} s into exit: ending the process \
             (status 1)",
            wait.as_secs_f64()
        );
        end_now(py, 1);
    }
}

/// How long exit waits before it says what it waits for.
const SAY_AFTER: std::time::Duration = std::time::Duration::from_secs(5);

/// Whether this thread is in one of a pipeline's calls into Python.
pub(crate) fn on_pipeline_thread() -> bool {
    IN_PIPELINE.with(std::cell::Cell::get)
}

/// Drops `x` (a pipeline, joining its threads) on a thread of its own, which exit waits for
/// (`_join_closing`): from one of the pipeline's own threads, where joining would wait for
/// itself.
pub(crate) fn drop_elsewhere<T: Send + 'static>(x: T) {
    let slot = std::sync::Arc::new(Mutex::new(Some(x)));
    let theirs = std::sync::Arc::clone(&slot);
    let spawned = std::thread::Builder::new()
        .name("flowgate-close".into())
        .spawn(move || drop(theirs.lock().expect("slot").take()));
    match spawned {
        Ok(h) => CLOSING.lock().expect("closing").push(h),
        Err(e) => {
            // No thread to join from: the pipeline's threads are left running.
            std::mem::forget(slot.lock().expect("slot").take());
            eprintln!("flowgate: a pipeline freed on its own thread is left running: {e}");
        }
    }
}
