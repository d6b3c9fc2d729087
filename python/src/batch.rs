//! [`Batch`]: a batch tensor shared zero-copy with NumPy (`__array_interface__`) and DLPack
//! consumers (`__dlpack__`), in host memory or on the device the loader uploads to.

use std::ffi::c_void;

use flowgate::{DType, Tensor};
use pyo3::exceptions::{PyAttributeError, PyTypeError, PyValueError};
use pyo3::prelude::*;
use pyo3::types::{PyDict, PyTuple};

use crate::error::to_py_device;

/// A batch tensor. Its memory stays valid while any NumPy array or DLPack consumer made from
/// it is alive (they hold a reference to the batch).
#[pyclass(frozen, module = "flowgate._native")]
pub(crate) struct Batch {
    mem: std::sync::Arc<Mem>,
}

/// Where a batch's bytes are: in host memory, or uploaded (on a CUDA device, or on the
/// simulated device: host memory behind the device's rules).
pub(crate) use flowgate::device::Delivered as Mem;

impl From<Tensor> for Batch {
    fn from(t: Tensor) -> Self {
        Self::from(Mem::Host(t))
    }
}

impl From<Mem> for Batch {
    fn from(mem: Mem) -> Self {
        Self {
            mem: std::sync::Arc::new(mem),
        }
    }
}

impl Batch {
    /// A batch over memory Rust keeps a handle on too (a function's batch, taken back after
    /// its call when no Python object holds it any more: see `crate::map`).
    pub(crate) fn shared(mem: &std::sync::Arc<Mem>) -> Self {
        Self {
            mem: std::sync::Arc::clone(mem),
        }
    }
}

const KDLCPU: i32 = 1;
const KDLCUDA: i32 = 2;

impl Batch {
    /// DLPack's device of the memory.
    fn dl_device(&self) -> (i32, i32) {
        match self.mem.cuda_ordinal() {
            Some(n) => (KDLCUDA, n as i32),
            None => (KDLCPU, 0),
        }
    }
}

#[repr(C)]
struct DLDevice {
    device_type: i32,
    device_id: i32,
}

#[repr(C)]
struct DLDataType {
    code: u8,
    bits: u8,
    lanes: u16,
}

#[repr(C)]
struct DLTensor {
    data: *mut c_void,
    device: DLDevice,
    ndim: i32,
    dtype: DLDataType,
    shape: *mut i64,
    strides: *mut i64,
    byte_offset: u64,
}

#[repr(C)]
struct DLManagedTensor {
    dl_tensor: DLTensor,
    manager_ctx: *mut c_void,
    deleter: Option<unsafe extern "C" fn(*mut DLManagedTensor)>,
}

/// What a DLPack capsule keeps alive: the batch and the shape array.
struct DlContext {
    _owner: Py<Batch>,
    _shape: Vec<i64>,
}

unsafe extern "C" fn dl_deleter(m: *mut DLManagedTensor) {
    if m.is_null() {
        return;
    }
    // SAFETY: `m` and its context were made by `Box::into_raw` in `__dlpack__`, and DLPack
    // calls the deleter once.
    let m = unsafe { Box::from_raw(m) };
    let ctx = unsafe { Box::from_raw(m.manager_ctx as *mut DlContext) };
    // A consumer may free the tensor while the interpreter shuts down (a tensor kept in a
    // module global is freed by `Py_Finalize`'s module cleanup, when Python already says it is
    // not initialized): taking the GIL then would panic, and a panic cannot leave an `extern
    // "C"` function (the process aborts). The process is ending: the batch is left to it.
    // SAFETY: `Py_IsInitialized` may be called at any time.
    if unsafe { pyo3::ffi::Py_IsInitialized() } == 0 {
        std::mem::forget(ctx);
        return;
    }
    // Should taking the GIL panic anyway, the batch is leaked rather than the process aborted.
    let _ = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
        crate::fork::with_gil(|_| drop(ctx));
    }));
}

const DLTENSOR: &std::ffi::CStr = c"dltensor";

unsafe extern "C" fn capsule_destructor(capsule: *mut pyo3::ffi::PyObject) {
    // A consumer renames the capsule to "used_dltensor" and owns the tensor; otherwise the
    // tensor was never taken and is freed here.
    // SAFETY: called by Python with the GIL held on a capsule we made.
    unsafe {
        if pyo3::ffi::PyCapsule_IsValid(capsule, DLTENSOR.as_ptr()) == 1 {
            let m =
                pyo3::ffi::PyCapsule_GetPointer(capsule, DLTENSOR.as_ptr()) as *mut DLManagedTensor;
            if let Some(d) = (*m).deleter {
                d(m);
            }
        }
    }
}

#[pymethods]
impl Batch {
    /// The dimensions.
    #[getter]
    fn shape<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyTuple>> {
        PyTuple::new(py, self.mem.shape())
    }

    /// The element type's NumPy name (`uint8`, `float32`, `int64`).
    #[getter]
    fn dtype(&self) -> &'static str {
        self.mem.dtype().numpy()
    }

    /// Size in bytes.
    #[getter]
    fn nbytes(&self) -> usize {
        self.mem.nbytes()
    }

    /// Where the batch is: `"cpu"`, `"cuda:N"`, or `"simulated"` (the test device).
    #[getter]
    fn device(&self) -> String {
        match &*self.mem {
            Mem::Host(_) => "cpu".into(),
            Mem::Device(b) => match b.cuda_ordinal() {
                Some(n) => format!("cuda:{n}"),
                None => "simulated".into(),
            },
        }
    }

    /// Address of the first byte (equal to the NumPy array's `ctypes.data`: no copy; a
    /// device address for a CUDA batch).
    #[getter]
    fn data_ptr(&self) -> usize {
        match &*self.mem {
            Mem::Host(t) => t.bytes().as_ptr() as usize,
            Mem::Device(b) => b.data_ptr(),
        }
    }

    fn __len__(&self) -> usize {
        self.mem.shape().first().copied().unwrap_or(0)
    }

    /// `batch[i]`, slices and NumPy indices: through the NumPy view (host memory), so a label
    /// batch indexes as its labels do (`labels[0]` is an integer).
    fn __getitem__<'py>(
        slf: &Bound<'py, Self>,
        index: &Bound<'py, PyAny>,
    ) -> PyResult<Bound<'py, PyAny>> {
        as_numpy(slf)?.get_item(index)
    }

    /// Iterates the first axis (a label batch: its labels), through the NumPy view.
    fn __iter__<'py>(slf: &Bound<'py, Self>) -> PyResult<Bound<'py, PyAny>> {
        Ok(as_numpy(slf)?.try_iter()?.into_any())
    }

    /// The values as nested Python lists (`numpy.ndarray.tolist`): a label batch's labels as
    /// ints.
    fn tolist<'py>(slf: &Bound<'py, Self>) -> PyResult<Bound<'py, PyAny>> {
        as_numpy(slf)?.call_method0("tolist")
    }

    /// A copy in host memory (after the upload completes, for a device batch).
    fn cpu(&self, py: Python<'_>) -> PyResult<Batch> {
        let t = crate::lifecycle::released(py, || self.mem.to_host()).map_err(to_py_device)?;
        Ok(t.into())
    }

    /// Pickling copies the bytes (a batch sent to another process, e.g. from a DataLoader
    /// worker; torch tensors travel through shared memory instead, see `output="torch"`). A
    /// device batch arrives as a host one.
    fn __reduce__<'py>(slf: &Bound<'py, Self>) -> PyResult<Bound<'py, PyTuple>> {
        let py = slf.py();
        let b = slf.get();
        let host = b.cpu(py)?;
        let rebuild = py
            .import("flowgate._native")?
            .getattr("_batch_from_bytes")?;
        let args = (
            pyo3::types::PyBytes::new(py, host.mem.host_bytes().expect("host memory")),
            b.mem.dtype().numpy(),
            b.mem.shape().to_vec(),
        );
        PyTuple::new(py, [rebuild, args.into_pyobject(py)?.into_any()])
    }

    fn __repr__(&self) -> String {
        let device = match &*self.mem {
            Mem::Host(_) => String::new(),
            Mem::Device(_) => format!(", device={}", self.device()),
        };
        format!(
            "Batch(shape={:?}, dtype={}{device})",
            self.mem.shape(),
            self.mem.dtype().numpy()
        )
    }

    /// NumPy's array interface (version 3): `numpy.asarray(batch)` is a view. A CUDA batch
    /// has none (NumPy then calls `__array__`, which says what to do).
    #[getter]
    fn __array_interface__<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyDict>> {
        let Some(bytes) = self.mem.host_bytes() else {
            return Err(PyAttributeError::new_err(
                "a CUDA batch has no array interface",
            ));
        };
        let d = PyDict::new(py);
        d.set_item("shape", PyTuple::new(py, self.mem.shape())?)?;
        d.set_item("typestr", self.mem.dtype().typestr())?;
        d.set_item("data", (bytes.as_ptr() as usize, false))?;
        d.set_item("version", 3)?;
        Ok(d)
    }

    /// Reached only for a CUDA batch (host batches have `__array_interface__`).
    #[pyo3(signature = (dtype=None, copy=None))]
    fn __array__(&self, dtype: Option<PyObject>, copy: Option<bool>) -> PyResult<PyObject> {
        let _ = (dtype, copy);
        Err(PyTypeError::new_err(format!(
            "this batch is on {}: use torch.from_dlpack(batch), or batch.cpu() for a host copy",
            self.device()
        )))
    }

    /// DLPack export: `torch.from_dlpack(batch)` / `numpy.from_dlpack(batch)` share the
    /// memory, which stays alive until the consumer's tensor is freed. For a device batch,
    /// `stream` is the consumer's (DLPack's convention: `None` or `1` the legacy default
    /// stream, `2` the per-thread one, else a `CUstream` handle; `-1` no synchronisation):
    /// that stream waits for the batch's copy on the device (the host does not block), and
    /// the memory is freed only after the work queued on it.
    #[pyo3(signature = (*, stream=None, max_version=None, dl_device=None, copy=None))]
    fn __dlpack__<'py>(
        slf: &Bound<'py, Self>,
        stream: Option<i64>,
        max_version: Option<PyObject>,
        dl_device: Option<PyObject>,
        copy: Option<bool>,
    ) -> PyResult<Bound<'py, PyAny>> {
        let _ = (max_version, dl_device);
        if copy == Some(true) {
            return Err(PyValueError::new_err(
                "flowgate batches are exported without copying",
            ));
        }
        let py = slf.py();
        let b = slf.get();
        if let Mem::Device(d) = &*b.mem {
            match stream {
                Some(-1) => {}
                Some(s) if s == 0 || s < -1 => {
                    return Err(PyValueError::new_err(format!(
                        "stream {s}: DLPack names CUDA streams 1 (legacy default), 2 (per-thread default), a handle, or -1 (no synchronisation)"
                    )))
                }
                s => d
                    .ready_on_stream(s.map(|s| s as usize))
                    .map_err(to_py_device)?,
            }
        }
        let data = b.data_ptr() as *mut c_void;
        let (device_type, device_id) = b.dl_device();
        let mut shape: Vec<i64> = b.mem.shape().iter().map(|&d| d as i64).collect();
        let (code, bits) = match b.mem.dtype() {
            DType::U8 => (1, 8),
            DType::F32 => (2, 32),
            DType::I64 => (0, 64),
        };
        let tensor = DLTensor {
            data,
            device: DLDevice {
                device_type,
                device_id,
            },
            ndim: shape.len() as i32,
            dtype: DLDataType {
                code,
                bits,
                lanes: 1,
            },
            shape: shape.as_mut_ptr(),
            strides: std::ptr::null_mut(), // compact row-major
            byte_offset: 0,
        };
        let ctx = Box::new(DlContext {
            _owner: slf.clone().unbind(),
            _shape: shape,
        });
        let managed = Box::into_raw(Box::new(DLManagedTensor {
            dl_tensor: tensor,
            manager_ctx: Box::into_raw(ctx) as *mut c_void,
            deleter: Some(dl_deleter),
        }));
        // SAFETY: a new capsule over our pointer, with a destructor for unconsumed tensors.
        unsafe {
            let cap = pyo3::ffi::PyCapsule_New(
                managed as *mut c_void,
                DLTENSOR.as_ptr(),
                Some(capsule_destructor),
            );
            if cap.is_null() {
                dl_deleter(managed);
                return Err(PyErr::fetch(py));
            }
            Ok(Bound::from_owned_ptr(py, cap))
        }
    }

    /// Where the memory is: `(kDLCPU, 0)`, or `(kDLCUDA, N)` for a batch on GPU `N`.
    fn __dlpack_device__(&self) -> (i32, i32) {
        self.dl_device()
    }
}

/// A host batch's NumPy view (a device batch raises, saying to call `cpu()` first).
fn as_numpy<'py>(slf: &Bound<'py, Batch>) -> PyResult<Bound<'py, PyAny>> {
    slf.py()
        .import("numpy")?
        .call_method1("asarray", (slf.clone(),))
}

/// A batch from pickled bytes (see `Batch.__reduce__`); `None`: zeros, for a caller that
/// fills its writable NumPy view (a remote worker's array: copied once).
#[pyfunction]
pub(crate) fn _batch_from_bytes(
    bytes: Option<&[u8]>,
    dtype: &str,
    shape: Vec<usize>,
) -> PyResult<Batch> {
    let d = DType::from_numpy(dtype)
        .ok_or_else(|| PyValueError::new_err(format!("no batch of dtype {dtype:?}")))?;
    let mut t = Tensor::zeros(&shape, d);
    let Some(bytes) = bytes else {
        return Ok(t.into());
    };
    if t.nbytes() != bytes.len() {
        return Err(PyValueError::new_err(format!(
            "{} bytes for a {dtype} batch of shape {shape:?}",
            bytes.len()
        )));
    }
    t.bytes_mut().copy_from_slice(bytes);
    Ok(t.into())
}
