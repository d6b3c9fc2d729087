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
    crate::fork::with_gil(|py| {
        let v = err.value(py);
        let _ = v.setattr("stage", e.stage());
        let _ = v.setattr("item", e.item());
        // A Python stage's exception, as the cause (`raise LoaderError(...) from it`).
        let raised = e.item_error().and_then(|ie| {
            let cause: &(dyn std::error::Error + 'static) = ie.cause();
            cause.downcast_ref::<PyStageError>()
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

// The category of what a loader says of the items it skipped: a `UserWarning`, silenced the
// usual way (`warnings.filterwarnings("ignore", category=flowgate.SkippedItemsWarning)`).
pyo3::create_exception!(
    flowgate,
    SkippedItemsWarning,
    pyo3::exceptions::PyUserWarning,
    "A loader skipped unreadable items (skip_errors): said at the first one, once a loader, and at the end of each epoch that skipped any, with the count; `failures()` lists them."
);

/// Says what a loader has to say of its skipped items (the library's first-skip sentence, or
/// an epoch's report) as a [`SkippedItemsWarning`] from the consumer's line: `stacklevel`
/// counts the package's Python frames between the native call and the user's loop, plus one.
pub(crate) fn warn_skipped(py: Python<'_>, message: &str, stacklevel: i32) -> PyResult<()> {
    let category = py.get_type::<SkippedItemsWarning>();
    let message = std::ffi::CString::new(message.replace('\0', " ")).expect("no NUL");
    PyErr::warn(py, category.as_any(), &message, stacklevel)
}

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

/// A Python exception raised by a stage's callable: its type and message, and the exception
/// itself, which becomes the `__cause__` of the `LoaderError` it ends in (its traceback into
/// the user's code kept).
#[derive(Debug)]
pub(crate) struct PyStageError {
    text: String,
    pub(crate) exception: Option<Py<PyAny>>,
}

impl PyStageError {
    pub(crate) fn text(text: String) -> Self {
        Self {
            text,
            exception: None,
        }
    }
}

impl std::fmt::Display for PyStageError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(&self.text)
    }
}

impl std::error::Error for PyStageError {}

/// A Python exception as a stage's error.
pub(crate) fn py_error(py: Python<'_>, e: PyErr) -> PyStageError {
    let ty = e
        .get_type(py)
        .name()
        .map(|n| n.to_string())
        .unwrap_or_else(|_| "Exception".into());
    PyStageError {
        text: format!("{ty}: {}", e.value(py)),
        exception: Some(e.into_value(py).into_any()),
    }
}
