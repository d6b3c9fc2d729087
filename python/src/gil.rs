//! [`GilClock`]: what a pipeline's Python calls took, and whether the GIL held its threads
//! back (`stats()["gil"]`).

use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Instant;

use pyo3::prelude::*;
use pyo3::types::PyDict;

use crate::lifecycle::with_gil_in_pipeline;

/// What the stages' Python calls took: wall time (from asking for the GIL to the call's end),
/// the calling threads' CPU time, and the span from the first call to the last. Threads busy
/// in calls (wall / span) against cores they used (CPU / span) say whether threads help: many
/// threads busy on about one core are taking turns at the GIL.
#[derive(Default)]
pub(crate) struct GilClock {
    first: std::sync::OnceLock<Instant>,
    wall_ns: AtomicU64,
    cpu_ns: AtomicU64,
    span_ns: AtomicU64,
}

/// This thread's CPU time, in nanoseconds.
fn thread_cpu_ns() -> u64 {
    let mut ts = libc::timespec {
        tv_sec: 0,
        tv_nsec: 0,
    };
    // SAFETY: `ts` is a valid timespec to write to; the clock exists on Linux.
    unsafe { libc::clock_gettime(libc::CLOCK_THREAD_CPUTIME_ID, &mut ts) };
    ts.tv_sec as u64 * 1_000_000_000 + ts.tv_nsec as u64
}

impl GilClock {
    /// `f` under the GIL, timed.
    pub(crate) fn call<R>(&self, f: impl FnOnce(Python<'_>) -> R) -> R {
        let asked = Instant::now();
        let cpu = thread_cpu_ns();
        let first = *self.first.get_or_init(|| asked);
        let r = with_gil_in_pipeline(f);
        let end = Instant::now();
        let nanos = |d: std::time::Duration| d.as_nanos() as u64;
        self.wall_ns
            .fetch_add(nanos(end - asked), Ordering::Relaxed);
        self.cpu_ns
            .fetch_add(thread_cpu_ns().saturating_sub(cpu), Ordering::Relaxed);
        self.span_ns
            .fetch_max(nanos(end - first), Ordering::Relaxed);
        r
    }

    /// `stats()["gil"]`.
    pub(crate) fn to_py<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyDict>> {
        let seconds = |n: &AtomicU64| n.load(Ordering::Relaxed) as f64 / 1e9;
        let (wall, cpu, span) = (
            seconds(&self.wall_ns),
            seconds(&self.cpu_ns),
            seconds(&self.span_ns),
        );
        let per_span = |x: f64| if span > 0.0 { x / span } else { 0.0 };
        let (busy, cores) = (per_span(wall), per_span(cpu));
        let g = PyDict::new(py);
        g.set_item("call_s", wall)?;
        g.set_item("cpu_s", cpu)?;
        g.set_item("threads_busy", busy)?;
        g.set_item("cores_used", cores)?;
        // Off a CPU during calls: waiting for the GIL (or for I/O).
        g.set_item(
            "wait_fraction",
            if wall > 0.0 {
                1.0 - (cpu / wall).min(1.0)
            } else {
                0.0
            },
        )?;
        g.set_item("bound", busy >= 1.5 && cores < 1.25)?;
        Ok(g)
    }
}
