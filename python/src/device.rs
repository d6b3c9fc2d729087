//! The device a loader uploads to (`device=`), and the simulated device's record for tests.

use flowgate::device::{SimLog, SimRecord};
use flowgate::loader::Device;
use pyo3::exceptions::PyValueError;
use pyo3::prelude::*;
use pyo3::types::PyList;

use crate::error::to_py_device;

/// The device `spec` names: `"cpu"` (`None`), `"cuda"`, `"cuda:N"`, or `"simulated"` (a copy
/// engine in host memory that records what a GPU would be asked to do: for tests), holding
/// at most `device_bytes` of uploaded batches (default 1 GiB). An unusable device raises
/// `DeviceUnavailable` here, at construction, rather than at the first batch.
pub(crate) fn open_device(spec: &str, device_bytes: Option<u64>) -> PyResult<Option<Device>> {
    let device = match spec {
        "cpu" => return Ok(None),
        "simulated" => Device::simulated(25e9, std::time::Duration::from_micros(10)),
        s if s == "cuda" || s.starts_with("cuda:") => {
            let ordinal = match s.strip_prefix("cuda:") {
                None => 0,
                Some(n) => n.parse::<usize>().map_err(|_| {
                    PyValueError::new_err(format!(
                        "device {s:?}: the GPU's number after `cuda:` (\"cuda:0\")"
                    ))
                })?,
            };
            Device::cuda(ordinal).map_err(to_py_device)?
        }
        other => {
            return Err(PyValueError::new_err(format!(
                "device must be \"cpu\", \"cuda\", \"cuda:N\" or \"simulated\", not {other:?}"
            )))
        }
    };
    Ok(Some(match device_bytes {
        Some(m) => device.max_device_bytes(m),
        None => device,
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
