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
        // A Python stage's exception, as the cause (`raise LoaderError(...) from it`).
        let raised = e.item_error().and_then(|ie| {
            let cause: &(dyn std::error::Error + 'static) = ie.cause();
            cause.downcast_ref::<crate::pipeline::PyStageError>()
        });
        if let Some(exc) = raised.and_then(|p| p.exception.as_ref()) {
            err.set_cause(py, Some(PyErr::from_value(exc.bind(py).clone())));
        }
    });
    err
}

// Raised where a loader is built for a device it cannot use (no driver, no GPU, a wheel built
// without CUDA), and for a device error while a batch is handed over.
pyo3::create_exception!(
    flowgate,
    DeviceUnavailable,
    PyRuntimeError,
    "The device a loader was asked for cannot be used (no NVIDIA driver, no such GPU, or a flowgate build without CUDA)."
);

/// A number out of the library's range, as Python's `ValueError` (`batch_size: must be in
/// 1..=65536, not 0`).
pub(crate) fn out_of_range(e: flowgate::limits::OutOfRange) -> PyErr {
    pyo3::exceptions::PyValueError::new_err(e.to_string())
}

pub(crate) fn to_py_device(e: flowgate::device::DeviceError) -> PyErr {
    match e {
        flowgate::device::DeviceError::Unavailable(_) => DeviceUnavailable::new_err(e.to_string()),
        flowgate::device::DeviceError::Driver(_) => LoaderError::new_err(e.to_string()),
    }
}
