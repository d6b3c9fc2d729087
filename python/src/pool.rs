//! The remote pool's books (`flowgate::tuner::pool::dispatch::Dispatcher`): which actor holds
//! which unit, units issued again after a death, actors started and retired, the sizer's
//! windows. `_remote.py` carries out its commands on Ray and reports back.

use pyo3::exceptions::PyRuntimeError;
use pyo3::prelude::*;
use pyo3::types::PyDict;

use crate::values::json_to_py;

use flowgate::tuner::pool::dispatch::{
    Command, DispatchError, DispatchSettings, Dispatcher, PoolSize,
};
use flowgate::tuner::pool::PoolLimits;

/// A pool's dispatcher; every call's commands wait in `commands()`.
#[pyclass(module = "flowgate._native")]
pub(crate) struct Dispatch {
    inner: Dispatcher,
    pending: Vec<Command>,
}

/// A command as Python takes it: `(kind, worker, unit or None)`.
type PyCommand = (&'static str, u64, Option<usize>);

fn runtime(e: DispatchError) -> PyErr {
    PyRuntimeError::new_err(e.to_string())
}

#[pymethods]
impl Dispatch {
    /// `workers`: a pinned pool's size, or None for one sized within `min_workers` and
    /// `max_workers`; `now`: `time.monotonic()`.
    #[new]
    #[allow(clippy::too_many_arguments)]
    fn new(
        workers: Option<usize>,
        min_workers: usize,
        max_workers: usize,
        cpus_per_worker: f64,
        local: bool,
        start_timeout: f64,
        now: f64,
    ) -> Self {
        let size = match workers {
            Some(n) => PoolSize::Pinned(n),
            None => PoolSize::Auto(PoolLimits {
                min_workers,
                max_workers,
                cpus_per_worker,
                local,
            }),
        };
        let mut settings = DispatchSettings::new(size, local);
        settings.start_timeout = start_timeout;
        let (inner, pending) = Dispatcher::new(settings, now);
        Self { inner, pending }
    }

    /// The commands to carry out, in order: `("start", worker, None)`, `("issue", worker,
    /// unit)`, `("cancel", worker, unit)`, `("kill", worker, None)`.
    fn commands(&mut self) -> Vec<PyCommand> {
        self.pending
            .drain(..)
            .map(|c| match c {
                Command::Start(w) => ("start", w, None),
                Command::Issue { worker, unit } => ("issue", worker, Some(unit)),
                Command::Cancel { worker, unit } => ("cancel", worker, Some(unit)),
                Command::Kill(w) => ("kill", w, None),
            })
            .collect()
    }

    /// A new epoch of `units` units; its token.
    fn begin(&mut self, units: usize) -> u64 {
        let (token, out) = self.inner.begin(units);
        self.pending.extend(out);
        token
    }

    /// The epoch owning the pool (0: none).
    #[getter]
    fn token(&self) -> u64 {
        self.inner.token()
    }

    fn abandon(&mut self) {
        let out = self.inner.abandon();
        self.pending.extend(out);
    }

    fn close(&mut self) {
        let out = self.inner.close();
        self.pending.extend(out);
    }

    fn ready(&mut self, worker: u64) {
        self.inner.ready(worker);
    }

    /// Actors that have not answered yet.
    fn starting(&self) -> Vec<u64> {
        self.inner.starting()
    }

    fn fill(&mut self) {
        let out = self.inner.fill();
        self.pending.extend(out);
    }

    fn next_unit(&self) -> Option<usize> {
        self.inner.next_unit()
    }

    fn holder(&self, unit: usize) -> Option<u64> {
        self.inner.holder(unit)
    }

    fn in_hand(&self) -> Vec<(u64, usize)> {
        self.inner.in_hand()
    }

    fn waiting(&mut self, now: f64) {
        self.inner.waiting(now);
    }

    fn stalled(&mut self, now: f64) -> Option<f64> {
        self.inner.stalled(now)
    }

    fn done(&mut self, unit: usize, seconds: f64, now: f64) -> PyResult<()> {
        let out = self.inner.done(unit, seconds, now).map_err(runtime)?;
        self.pending.extend(out);
        Ok(())
    }

    /// Raises `RuntimeError` once workers die before a unit too many times in a row.
    fn died(&mut self, worker: u64, error: &str, now: f64) -> PyResult<()> {
        let out = self.inner.died(worker, error, now).map_err(runtime)?;
        self.pending.extend(out);
        Ok(())
    }

    fn window_due(&self, now: f64) -> bool {
        self.inner.window_due(now)
    }

    #[getter]
    fn sized(&self) -> bool {
        self.inner.sized()
    }

    fn resize(&mut self, now: f64, decoded: usize, free_cpus: f64) {
        let out = self.inner.resize(now, decoded, free_cpus);
        self.pending.extend(out);
    }

    #[getter]
    fn workers(&self) -> usize {
        self.inner.workers()
    }

    /// `{"workers", "started", "reissued_units", "units_by_actors", "units_local"}`.
    fn stats<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyDict>> {
        let d = PyDict::new(py);
        d.set_item("workers", self.inner.workers())?;
        d.set_item("started", self.inner.started())?;
        d.set_item("reissued_units", self.inner.reissued())?;
        d.set_item("units_by_actors", self.inner.units_by_workers())?;
        d.set_item("units_local", self.inner.units_local())?;
        Ok(d)
    }

    /// The windows and deaths, oldest first, as `tuner_trace()` gives them.
    fn trace<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyAny>> {
        let trace = serde_json::to_value(self.inner.trace()).expect("a trace is JSON");
        json_to_py(py, &trace)
    }
}
