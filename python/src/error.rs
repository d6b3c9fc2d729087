//! `LoaderError`, and how a pipeline's errors reach Python.

use flowgate::PipelineError;
use pyo3::exceptions::PyRuntimeError;
use pyo3::prelude::*;

// Defined in the public module, so that pickle finds it as `flowgate.LoaderError` (an
// exception raised in a DataLoader worker or a subprocess travels pickled).
pyo3::create_exception!(
    flowgate,
    LoaderError,
    PyRuntimeError,
    "A pipeline failed: `stage` and `item` name where (None when not about one item)."
);

pub(crate) fn to_py(e: PipelineError) -> PyErr {
    let err = LoaderError::new_err(e.to_string());
    Python::with_gil(|py| {
        let v = err.value(py);
        let _ = v.setattr("stage", e.stage());
        let _ = v.setattr("item", e.item());
    });
    err
}
