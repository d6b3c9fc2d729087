//! A fork kept clear of pipelines' threads entering Python.
//!
//! A thread without a Python thread state (a pipeline's, calling a stage or `map=`) makes one
//! at each `Python::with_gil` before it waits for the GIL, under the interpreter's runtime
//! lock, without the GIL. CPython 3.11 forks holding the GIL but not that lock: a fork at that
//! instant copies the lock held into the child, whose `PyOS_AfterFork_Child` then waits for it
//! for ever (the child hangs in `os.fork()`; seen about twice in 5,000 forks with 24 threads
//! calling Python). So every pipeline thread passes a gate from before it asks for the GIL
//! until it holds it ([`Entering`]), and before a fork ([`_before_fork`], registered with
//! `os.register_at_fork`) the gate is closed and the forking thread waits, with the GIL
//! released, for the threads inside it to take the GIL; the fork then happens with none of
//! ours making a thread state. Calls already under way are not waited for (they hold the GIL
//! or release it between calls; freeing a thread state happens with the GIL held). Every other
//! `Python::with_gil` of the package that may run on an engine thread (a result, a batch or a
//! pipeline freed there; a unit's rows read) passes the same gate ([`with_gil`]), and so does
//! a reference freed without the GIL ([`PyItem`]).

use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::time::{Duration, Instant};

use pyo3::prelude::*;

/// Pipeline threads between asking for the GIL and holding it.
static ENTERING: AtomicUsize = AtomicUsize::new(0);
/// A fork is about to happen: the gate is closed.
static FORKING: AtomicBool = AtomicBool::new(false);

/// The longest a fork waits for threads inside the gate (they only wait for the GIL, which
/// the forking thread has released: far less than this, unless another thread holds it).
const FORK_WAIT: Duration = Duration::from_secs(5);

/// A thread inside the gate: made before `Python::with_gil`, dropped once the GIL is held.
pub(crate) struct Entering(());

impl Entering {
    /// Passes the gate, waiting while a fork is about to happen.
    pub(crate) fn new() -> Self {
        loop {
            // Counted before the flag is read, the flag set before the count is read by the
            // fork: either the fork waits for this thread, or this thread sees the flag.
            ENTERING.fetch_add(1, Ordering::SeqCst);
            if !FORKING.load(Ordering::SeqCst) {
                return Self(());
            }
            ENTERING.fetch_sub(1, Ordering::SeqCst);
            while FORKING.load(Ordering::SeqCst) {
                std::thread::sleep(Duration::from_micros(200));
            }
        }
    }
}

impl Drop for Entering {
    fn drop(&mut self) {
        ENTERING.fetch_sub(1, Ordering::SeqCst);
    }
}

/// `f` under the GIL, through the gate where this thread does not hold the GIL already (it may
/// have no Python thread state yet, and make one): every `Python::with_gil` of the package
/// that can run on a thread of the engine's (a result or a batch freed there, a unit's rows
/// read) passes it, as the pipeline's own calls do ([`with_gil_in_pipeline`](
/// crate::lifecycle::with_gil_in_pipeline)).
pub(crate) fn with_gil<R>(f: impl FnOnce(Python<'_>) -> R) -> R {
    // SAFETY: reads this thread's interpreter state only; callable without the GIL.
    if unsafe { PyGILState_Check() } == 1 {
        return Python::with_gil(f);
    }
    let entering = Entering::new();
    Python::with_gil(|py| {
        drop(entering);
        f(py)
    })
}

/// Before a fork: closes the gate and waits (GIL released) until no pipeline thread is
/// inside it.
#[pyfunction]
pub(crate) fn _before_fork(py: Python<'_>) {
    FORKING.store(true, Ordering::SeqCst);
    py.allow_threads(|| {
        let deadline = Instant::now() + FORK_WAIT;
        while ENTERING.load(Ordering::SeqCst) > 0 && Instant::now() < deadline {
            std::thread::sleep(Duration::from_micros(100));
        }
    });
}

/// After a fork, in the parent and the child: the gate opens (in the child no thread of the
/// parent's is inside it).
#[pyfunction]
pub(crate) fn _after_fork() {
    FORKING.store(false, Ordering::SeqCst);
}

/// Pipeline threads the gate held inside at the last fork, as this child found them.
static AT_FORK: AtomicUsize = AtomicUsize::new(0);

/// In a forked child: the parent's threads inside the gate are not this process's.
pub(crate) fn forget_after_fork() {
    AT_FORK.store(ENTERING.swap(0, Ordering::SeqCst), Ordering::SeqCst);
    FORKING.store(false, Ordering::SeqCst);
}

/// `(threads inside the gate now, threads inside it when this process was forked)`: for the
/// test that a fork waits until none is (`python/tests/test_process.py`).
#[pyfunction]
pub(crate) fn _fork_gate() -> (usize, usize) {
    (
        ENTERING.load(Ordering::SeqCst),
        AT_FORK.load(Ordering::SeqCst),
    )
}

/// A Python object a pipeline holds (an item, a result, a stage's function, its source).
/// Freed by a thread that does not
/// hold the GIL (a stopping pipeline's queues drained by its threads, a result dropped with
/// the GIL released), pyo3 queues the reference behind a lock of its own; a fork at that
/// instant copies the lock held into the child, which hangs at its next Python call (5
/// children in 3,205 forks while another thread started and stopped pipelines). So such a
/// thread frees it inside the gate, which a fork waits to be empty.
pub(crate) struct PyItem(Option<Py<PyAny>>);

impl PyItem {
    pub(crate) fn new(x: Py<PyAny>) -> Self {
        Self(Some(x))
    }

    pub(crate) fn get(&self) -> &Py<PyAny> {
        self.0.as_ref().expect("an item not taken")
    }

    pub(crate) fn into_inner(mut self) -> Py<PyAny> {
        self.0.take().expect("an item not taken")
    }
}

extern "C" {
    /// CPython's (since 3.4; not in pyo3's bindings): 1 when this thread holds the GIL.
    fn PyGILState_Check() -> std::os::raw::c_int;
}

impl Drop for PyItem {
    fn drop(&mut self) {
        let Some(x) = self.0.take() else { return };
        // SAFETY: reads this thread's interpreter state only; callable without the GIL.
        if unsafe { PyGILState_Check() } == 1 {
            // With the GIL the reference is released at once: no lock (and no wait at the
            // gate, which a fork in progress would hold closed while it needs the GIL back).
            drop(x);
        } else {
            let _inside = Entering::new();
            drop(x);
        }
    }
}
