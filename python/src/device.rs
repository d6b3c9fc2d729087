//! The device a loader uploads to (`device=`), and the simulated device's record for tests.

use flowgate::device::{SimLog, SimRecord};
use flowgate::loader::{Device, DeviceName};
use pyo3::exceptions::PyValueError;
use pyo3::prelude::*;
use pyo3::types::PyList;

use crate::error::to_py_device;

/// The device `spec` names (the library's reading: `"cpu"` is `None`, `"cuda"`, `"cuda:N"`,
/// `"simulated"`), holding at most `device_bytes` of uploaded batches (default: the
/// library's). An unusable device raises `DeviceUnavailable` here, at construction, rather
/// than at the first batch.
pub(crate) fn open_device(spec: &str, device_bytes: Option<u64>) -> PyResult<Option<Device>> {
    let name: DeviceName = spec.parse().map_err(PyValueError::new_err)?;
    let device = name.open().map_err(to_py_device)?;
    Ok(device.map(|d| match device_bytes {
        Some(m) => d.max_device_bytes(m),
        None => d,
    }))
}

/// The simulated device's record as Python tuples (see `Loader._device_log`).
pub(crate) fn log_to_py<'py>(py: Python<'py>, log: &SimLog) -> PyResult<Bound<'py, PyList>> {
    let out = PyList::empty(py);
    for r in log.records() {
        let t = match r {
            SimRecord::Copy { id, bytes } => ("copy", id, bytes).into_pyobject(py)?,
            SimRecord::StreamWait {
                id,
                stream,
                complete,
            } => ("stream_wait", id, stream, complete).into_pyobject(py)?,
            SimRecord::HostWait { id, thread } => ("host_wait", id, thread).into_pyobject(py)?,
            SimRecord::Free { id, bytes, streams } => {
                ("free", id, bytes, streams).into_pyobject(py)?
            }
        };
        out.append(t)?;
    }
    Ok(out)
}
