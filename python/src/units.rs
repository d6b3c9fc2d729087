//! The remote mode's native half: an epoch cut into units ([`EpochPlan`]) by the training
//! process's loader, each unit's `state_dict` for the worker that decodes it, and the
//! training process's checkpoint once units arrive (see `flowgate.loader::units`).

use pyo3::exceptions::PyIndexError;
use pyo3::prelude::*;
use pyo3::types::{PyDict, PyList, PySlice, PyTuple};

use crate::state::{state_from_py, state_to_py};

/// An epoch's units: made by `Loader._start_units`.
#[pyclass(frozen, module = "flowgate._native")]
pub(crate) struct EpochPlan {
    pub(crate) plan: flowgate::loader::EpochPlan,
}

#[pymethods]
impl EpochPlan {
    /// The epoch planned.
    #[getter]
    fn epoch(&self) -> u64 {
        self.plan.epoch()
    }

    /// Units in the epoch.
    fn __len__(&self) -> usize {
        self.plan.len()
    }

    /// The `state_dict` that makes a loader built alike decode exactly unit `index`.
    fn unit_state<'py>(&self, py: Python<'py>, index: usize) -> PyResult<Bound<'py, PyDict>> {
        let unit = self.unit(index)?;
        state_to_py(py, &self.plan.unit_state(&unit))
    }

    /// Regrouping of this plan's units' batches into the training loader's (`order`:
    /// `"input"` or `"completion"`, the loader's).
    fn regroup(&self, order: &str) -> Regroup {
        let order = if order == "completion" {
            flowgate::Order::Completion
        } else {
            flowgate::Order::Input
        };
        Regroup {
            inner: flowgate::loader::Regroup::new(&self.plan, order),
        }
    }
}

/// A batch of NumPy arrays (or a tuple of arrays and lists) from a unit, as the library's
/// regrouping takes rows.
struct PyRows(Py<PyAny>);

impl flowgate::loader::Rows for PyRows {
    fn rows(&self) -> usize {
        crate::fork::with_gil(|py| {
            let item = self.0.bind(py);
            let first = match item.downcast::<PyTuple>() {
                Ok(t) => t.get_item(0).expect("a field"),
                Err(_) => item.clone(),
            };
            first.len().expect("a batch's rows")
        })
    }

    fn slice(&self, start: usize, end: usize) -> Self {
        crate::fork::with_gil(|py| {
            let rows = |x: &Bound<'_, PyAny>| {
                x.get_item(PySlice::new(py, start as isize, end as isize, 1))
                    .expect("rows of a batch")
                    .unbind()
            };
            let item = self.0.bind(py);
            PyRows(match item.downcast::<PyTuple>() {
                Ok(t) => {
                    let fields: Vec<_> = t.iter().map(|x| rows(&x)).collect();
                    PyTuple::new(py, fields)
                        .expect("a tuple")
                        .into_any()
                        .unbind()
                }
                Err(_) => rows(item),
            })
        })
    }

    fn concat(parts: Vec<Self>) -> Self {
        crate::fork::with_gil(|py| {
            let parts: Vec<Bound<'_, PyAny>> =
                parts.into_iter().map(|p| p.0.into_bound(py)).collect();
            PyRows(join(py, &parts).expect("joined rows").unbind())
        })
    }
}

/// `parts` (alike: arrays, lists, or tuples of them) one after the other.
fn join<'py>(py: Python<'py>, parts: &[Bound<'py, PyAny>]) -> PyResult<Bound<'py, PyAny>> {
    let first = &parts[0];
    if let Ok(t) = first.downcast::<PyTuple>() {
        let fields = (0..t.len())
            .map(|k| {
                let column: Vec<_> = parts
                    .iter()
                    .map(|p| p.get_item(k))
                    .collect::<PyResult<_>>()?;
                join(py, &column)
            })
            .collect::<PyResult<Vec<_>>>()?;
        return Ok(PyTuple::new(py, fields)?.into_any());
    }
    if first.is_instance_of::<PyList>() {
        let out = PyList::empty(py);
        for p in parts {
            for x in p.try_iter()? {
                out.append(x?)?;
            }
        }
        return Ok(out.into_any());
    }
    py.import("numpy")?
        .call_method1("concatenate", (PyList::new(py, parts)?,))
}

/// The library's [`Regroup`](flowgate::loader::Regroup) over a plan's units' batches: made by
/// `EpochPlan.regroup`.
#[pyclass(module = "flowgate._native")]
pub(crate) struct Regroup {
    inner: flowgate::loader::Regroup<PyRows>,
}

#[pymethods]
impl Regroup {
    /// A unit's next batch (in plan order) and its rows' positions (`[start, end)` pairs).
    fn push(&mut self, item: Py<PyAny>, rows: Vec<(u64, u64)>) {
        let positions = rows.into_iter().flat_map(|(a, b)| a..b).collect();
        self.inner.push(PyRows(item), positions);
    }

    /// The next batch and its rows' positions, or None: more units needed, or (`finished`:
    /// every unit pushed) the epoch's end.
    fn pop(&mut self, finished: bool) -> Option<(Py<PyAny>, Vec<u64>)> {
        self.inner.pop(finished).map(|(r, p)| (r.0, p))
    }
}

impl EpochPlan {
    fn unit(&self, index: usize) -> PyResult<flowgate::loader::Unit> {
        self.plan.unit(index).ok_or_else(|| {
            PyIndexError::new_err(format!("unit {index} of {} units", self.plan.len()))
        })
    }
}

/// The positions delivered in `later` and not in `earlier` (a batch's rows: the states of the
/// loader decoding a unit after and before it), as `[start, end)` pairs.
#[pyfunction]
pub(crate) fn _delivered_since(
    later: &Bound<'_, PyDict>,
    earlier: &Bound<'_, PyDict>,
) -> PyResult<Vec<(u64, u64)>> {
    let (later, earlier) = (state_from_py(later)?, state_from_py(earlier)?);
    Ok(later.delivered_since(&earlier).ranges().collect())
}

/// Batches `items` items make, `per_batch` to a batch (`flowgate::loader::batches_of`: a
/// last partial batch counts unless `drop_last`).
#[pyfunction]
pub(crate) fn _batches_of(items: usize, per_batch: usize, drop_last: bool) -> PyResult<usize> {
    if per_batch == 0 {
        return Err(pyo3::exceptions::PyValueError::new_err(
            "per_batch must be at least 1",
        ));
    }
    Ok(flowgate::loader::batches_of(items, per_batch, drop_last))
}
