//! How the threads of a pipeline that calls Python stop: joined with the GIL released where
//! it is closed; from another thread when the garbage collector frees it during one of its
//! own calls (a thread cannot join itself); and all of them before the interpreter stops at
//! exit (a thread of ours waiting for the GIL then would be unwound by the interpreter, and
//! the process would abort).

use std::sync::Mutex;
use std::time::Instant;

use pyo3::prelude::*;

std::thread_local! {
    /// Whether this thread is in one of a pipeline's calls into Python (a stage, its source).
    static IN_PIPELINE: std::cell::Cell<bool> = const { std::cell::Cell::new(false) };
}

/// `f` under the GIL, on a pipeline's thread: marked so that a pipeline dropped there (the
/// garbage collector may free a loader during any call into Python) is not joined from a
/// thread of its own.
pub(crate) fn with_gil_in_pipeline<R>(f: impl FnOnce(Python<'_>) -> R) -> R {
    let outer = IN_PIPELINE.with(|m| m.replace(true));
    let r = Python::with_gil(f);
    IN_PIPELINE.with(|m| m.set(outer));
    r
}

/// Threads stopping pipelines freed on one of their own threads.
static CLOSING: Mutex<Vec<std::thread::JoinHandle<()>>> = Mutex::new(Vec::new());

/// Pipelines of this process whose threads may call into Python: running, or stopping.
static LIVE: (Mutex<usize>, std::sync::Condvar) = (Mutex::new(0), std::sync::Condvar::new());

/// Counts a pipeline in [`LIVE`] from its start until its threads are joined.
pub(crate) struct LiveGuard;

impl LiveGuard {
    pub(crate) fn new() -> Self {
        *LIVE.0.lock().expect("live") += 1;
        Self
    }
}

impl Drop for LiveGuard {
    fn drop(&mut self) {
        let mut n = LIVE.0.lock().expect("live");
        *n = n.saturating_sub(1);
        LIVE.1.notify_all();
    }
}

/// In a forked child: the parent's pipelines are not this process's (their threads do not
/// exist here, and their records are forgotten, never dropped).
pub(crate) fn forget_live_after_fork() {
    *LIVE.0.lock().unwrap_or_else(|p| p.into_inner()) = 0;
}

/// The longest exit waits for pipelines to stop.
const EXIT_WAIT: std::time::Duration = std::time::Duration::from_secs(60);

/// At exit, after the open pipelines were closed: waits (the GIL released, so that their
/// threads finish the calls in hand) until every pipeline's threads are joined, also those the
/// garbage collector freed on one of their own threads (stopped from another), which may
/// still be being freed at this moment. The interpreter then stops with no thread of ours in
/// Python (one waiting for the GIL then would be unwound by the interpreter and abort the
/// process).
#[pyfunction]
pub(crate) fn _join_closing(py: Python<'_>) {
    py.allow_threads(|| {
        let deadline = Instant::now() + EXIT_WAIT;
        loop {
            let pending = std::mem::take(&mut *CLOSING.lock().expect("closing"));
            pending.into_iter().for_each(|h| drop(h.join()));
            let n = LIVE.0.lock().expect("live");
            if *n == 0 || Instant::now() >= deadline {
                return;
            }
            // Woken when one stops; a freeing still under way pushes its closer meanwhile.
            let _ = LIVE
                .1
                .wait_timeout(n, std::time::Duration::from_millis(20))
                .expect("live");
        }
    });
}

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
