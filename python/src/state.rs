//! `state_dict`s: a [`PipelineState`] as plain Python ints, strings, lists and dicts
//! (picklable, JSON-able), in the library's own serde layout (one checkpoint format for every
//! front end), back, and merged across ranks.

use flowgate::PipelineState;
use pyo3::exceptions::PyValueError;
use pyo3::prelude::*;
use pyo3::types::PyDict;

/// A `state_dict` of `s`: the library's serde layout as Python values.
pub(crate) fn state_to_py<'py>(py: Python<'py>, s: &PipelineState) -> PyResult<Bound<'py, PyDict>> {
    let v = serde_json::to_value(s).map_err(|e| PyValueError::new_err(e.to_string()))?;
    Ok(crate::values::json_to_py(py, &v)?.downcast_into::<PyDict>()?)
}

/// The state a `state_dict` describes (see [`state_to_py`]; tuples or lists alike, as a
/// state through JSON has lists).
pub(crate) fn state_from_py(state: &Bound<'_, PyDict>) -> PyResult<PipelineState> {
    let v = crate::values::value_of(state.as_any())
        .map_err(|e| PyValueError::new_err(format!("state_dict: {e}")))?;
    serde_json::from_value(v).map_err(|e| PyValueError::new_err(format!("state_dict: {e}")))
}

/// Merges the `state_dict()`s every rank of one world took at the same step into one that a
/// loader of any world size resumes: the rest of the epoch is dealt out evenly to the new
/// ranks. Raises ValueError if they do not fit together (another configuration, a rank
/// missing or twice, different epochs).
#[pyfunction]
pub(crate) fn merge_state_dicts<'py>(
    py: Python<'py>,
    states: Vec<Bound<'py, PyDict>>,
) -> PyResult<Bound<'py, PyDict>> {
    let states = states
        .iter()
        .map(state_from_py)
        .collect::<PyResult<Vec<_>>>()?;
    let merged = PipelineState::merge(&states).map_err(|e| PyValueError::new_err(e.to_string()))?;
    state_to_py(py, &merged)
}
