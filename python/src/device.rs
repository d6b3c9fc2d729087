//! The device a loader uploads to (`device=`), and the simulated device's record for tests.

use std::sync::Arc;

use flowgate::device::{Backend, Cuda, GpuMonitor, SimLog, SimRecord, Simulated, Uploader};
use pyo3::exceptions::PyValueError;
use pyo3::prelude::*;
use pyo3::types::PyList;

use crate::error::to_py_device;

/// The device a loader uploads its batches to: `device="cuda"`, `"cuda:N"`, or `"simulated"`
/// (a copy engine in host memory that records what a GPU would be asked to do: for tests).
pub(crate) struct Device {
    backend: Arc<dyn Backend>,
    pub(crate) log: Option<SimLog>,
    /// The GPU's utilisation (NVML), for the tuner: the consumer counts as starved only
    /// while the GPU idles.
    pub(crate) monitor: Option<Arc<GpuMonitor>>,
    /// The most bytes of uploaded batches waiting for the consumer.
    memory: u64,
}

/// Pinned staging the uploader may hold (reserved in the loader's memory budget); batches are
/// collated into pinned memory and copied from there, so staging is rarely used.
const STAGING_BYTES: usize = 64 << 20;

impl Device {
    /// Opens `spec` (`"cpu"`: `None`); an unusable device raises `DeviceUnavailable` here, at
    /// construction, rather than at the first batch.
    pub(crate) fn open(spec: &str, memory_mb: Option<f64>) -> PyResult<Option<Self>> {
        let memory = memory_mb.map_or(1 << 30, |m| (m * 1048576.0) as u64);
        let mut monitor = None;
        let (backend, log): (Arc<dyn Backend>, _) = match spec {
            "cpu" => return Ok(None),
            "simulated" => {
                let s = Simulated::new(25e9, std::time::Duration::from_micros(10));
                let log = s.log();
                (Arc::new(s), Some(log))
            }
            s if s == "cuda" || s.starts_with("cuda:") => {
                let ordinal = match s.strip_prefix("cuda:") {
                    None => 0,
                    Some(n) => n.parse::<usize>().map_err(|_| {
                        PyValueError::new_err(format!(
                            "device {s:?}: the GPU's number after `cuda:` (\"cuda:0\")"
                        ))
                    })?,
                };
                let cuda = Cuda::new(ordinal).map_err(to_py_device)?;
                monitor = GpuMonitor::new(ordinal as u32).ok().map(Arc::new);
                (Arc::new(cuda), None)
            }
            other => {
                return Err(PyValueError::new_err(format!(
                    "device must be \"cpu\", \"cuda\", \"cuda:N\" or \"simulated\", not {other:?}"
                )))
            }
        };
        Ok(Some(Self {
            backend,
            log,
            monitor,
            memory,
        }))
    }

    pub(crate) fn uploader(&self) -> Uploader {
        Uploader::with_backend(Arc::clone(&self.backend))
            .max_staging_bytes(STAGING_BYTES)
            .max_device_bytes(self.memory)
    }
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
