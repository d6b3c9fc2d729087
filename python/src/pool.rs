//! The remote pool: its settings and placement rules (`flowgate::loader::PoolSettings`) and
//! its books (`flowgate::tuner::pool::dispatch::Dispatcher`): which actor holds which unit,
//! units issued again after a death, actors started and retired, the sizer's windows.
//! `_remote.py` carries out the commands on Ray and reports back.

use pyo3::exceptions::{PyRuntimeError, PyValueError};
use pyo3::prelude::*;
use pyo3::types::{PyDict, PyTuple};

use crate::values::{json_to_py, value_of};

use flowgate::loader::{self, Cluster};
use flowgate::tuner::pool::dispatch::{Command, DispatchError, Dispatcher};

/// A remote pool's settings, checked by the library (`flowgate.Ray` holds one).
#[pyclass(module = "flowgate._native", frozen)]
pub(crate) struct PoolSettings {
    inner: loader::PoolSettings,
}

/// The cluster's CPUs, `(free, total, largest node)`, or None where they could not be read.
fn cluster(cpus: Option<(f64, f64, f64)>) -> Cluster {
    cpus.map_or(Cluster::UNKNOWN, |(free, total, largest)| Cluster {
        free,
        total,
        largest,
    })
}

#[pymethods]
impl PoolSettings {
    /// `settings`: the user's arguments as a dict (`{"workers": "auto", "max_workers": 16}`);
    /// `ValueError` names the key the library refuses.
    #[new]
    fn new(settings: &Bound<'_, PyAny>) -> PyResult<Self> {
        let v = value_of(settings).map_err(PyValueError::new_err)?;
        let inner = loader::PoolSettings::from_value(v)
            .map_err(|e| PyValueError::new_err(e.to_string()))?;
        Ok(Self { inner })
    }

    /// The settings as the library resolved them (`min_workers` filled in), as a dict.
    #[getter]
    fn resolved<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyAny>> {
        let mut s = self.inner;
        s.min_workers = Some(s.min_workers());
        json_to_py(py, &serde_json::to_value(s).expect("settings are JSON"))
    }

    fn __reduce__<'py>(
        slf: &Bound<'py, Self>,
    ) -> PyResult<(Bound<'py, PyAny>, Bound<'py, PyTuple>)> {
        let args = PyTuple::new(slf.py(), [slf.get().resolved(slf.py())?])?;
        Ok((slf.get_type().into_any(), args))
    }

    /// The CPUs each actor reserves on a cluster of `(free, total, largest)` CPUs;
    /// `RuntimeError` where an actor fits no node and the pool needs one.
    fn cpus(&self, cpus: Option<(f64, f64, f64)>) -> PyResult<f64> {
        self.inner
            .cpus(&cluster(cpus))
            .map_err(|e| PyRuntimeError::new_err(e.to_string()))
    }

    /// Why a pinned pool of actors of `each` CPUs cannot be placed now, or None.
    fn short_of_cpus(&self, each: f64, cpus: Option<(f64, f64, f64)>) -> Option<String> {
        self.inner.short_of_cpus(each, &cluster(cpus))
    }

    /// A sized pool's first line on the log, `(warning, line)`, or None for a pinned pool.
    fn start_line(
        &self,
        each: f64,
        initial: usize,
        cpus: Option<(f64, f64, f64)>,
    ) -> Option<(bool, String)> {
        self.inner.start_line(each, initial, &cluster(cpus))
    }
}

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
    /// A pool of `settings`' size, of actors of `cpus` CPUs; `now`: `time.monotonic()`.
    #[new]
    fn new(settings: &PoolSettings, cpus: f64, now: f64) -> Self {
        let (inner, pending) = Dispatcher::new(settings.inner.dispatch(cpus), now);
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
