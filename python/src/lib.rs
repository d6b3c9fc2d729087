//! `flowgate._native`: the Rust side of the Python package.
//!
//! - [`Loader`]: a native pipeline (image or audio files → batches) whose iteration releases
//!   the GIL while waiting; one epoch per Python iterator; `state_dict` / `load_state_dict`
//!   through flowgate's exact resume.
//! - [`PyPipeline`]: a general pipeline whose stages are Python callables (they take the GIL;
//!   the engine's threads, queues and tuner do not).
//! - [`Batch`]: a tensor exposing `__array_interface__` and `__dlpack__`, so
//!   `numpy.asarray(b)`, `numpy.from_dlpack(b)` and `torch.from_dlpack(b)` share its memory.

use std::ffi::c_void;
use std::path::PathBuf;
use std::sync::{Arc, Mutex};

use flowgate::media::audio::AudioRecipe;
use flowgate::media::image::{ImageRecipe, Layout, Normalize, RandomCrop};
use flowgate::media::Files;
use flowgate::sampler::ShardLengths;
use flowgate::{
    DType, Described, FailureBudget, Pipeline, PipelineError, PipelineState, Tensor, Workers,
};
use pyo3::exceptions::{PyRuntimeError, PyValueError};
use pyo3::prelude::*;
use pyo3::types::{PyDict, PyList, PyTuple};

pyo3::create_exception!(
    _native,
    LoaderError,
    PyRuntimeError,
    "A pipeline failed: `stage` and `item` name where (None when not about one item)."
);

fn to_py(e: PipelineError) -> PyErr {
    let err = LoaderError::new_err(e.to_string());
    Python::with_gil(|py| {
        let v = err.value(py);
        let _ = v.setattr("stage", e.stage());
        let _ = v.setattr("item", e.item());
    });
    err
}

// ---------------------------------------------------------------------------------------------
// Batches: zero-copy to NumPy and DLPack consumers.

/// A batch tensor. Its memory stays valid while any NumPy array or DLPack consumer made from
/// it is alive (they hold a reference to the batch).
#[pyclass(frozen, module = "flowgate._native")]
struct Batch {
    t: Tensor,
}

fn typestr(d: DType) -> &'static str {
    match d {
        DType::U8 => "|u1",
        DType::F32 => "<f4",
        DType::I64 => "<i8",
    }
}

fn dtype_name(d: DType) -> &'static str {
    match d {
        DType::U8 => "uint8",
        DType::F32 => "float32",
        DType::I64 => "int64",
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
    Python::with_gil(|_| drop(ctx));
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
        PyTuple::new(py, self.t.shape())
    }

    /// The element type's NumPy name (`uint8`, `float32`, `int64`).
    #[getter]
    fn dtype(&self) -> &'static str {
        dtype_name(self.t.dtype())
    }

    /// Size in bytes.
    #[getter]
    fn nbytes(&self) -> usize {
        self.t.nbytes()
    }

    /// Address of the first byte (equal to the NumPy array's `ctypes.data`: no copy).
    #[getter]
    fn data_ptr(&self) -> usize {
        self.t.bytes().as_ptr() as usize
    }

    fn __len__(&self) -> usize {
        self.t.shape().first().copied().unwrap_or(0)
    }

    fn __repr__(&self) -> String {
        format!(
            "Batch(shape={:?}, dtype={})",
            self.t.shape(),
            dtype_name(self.t.dtype())
        )
    }

    /// NumPy's array interface (version 3): `numpy.asarray(batch)` is a view.
    #[getter]
    fn __array_interface__<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyDict>> {
        let d = PyDict::new(py);
        d.set_item("shape", PyTuple::new(py, self.t.shape())?)?;
        d.set_item("typestr", typestr(self.t.dtype()))?;
        d.set_item("data", (self.data_ptr(), false))?;
        d.set_item("version", 3)?;
        Ok(d)
    }

    /// DLPack export (CPU): `torch.from_dlpack(batch)` / `numpy.from_dlpack(batch)` share the
    /// memory, which stays alive until the consumer's tensor is freed.
    #[pyo3(signature = (*, stream=None, max_version=None, dl_device=None, copy=None))]
    fn __dlpack__<'py>(
        slf: &Bound<'py, Self>,
        stream: Option<PyObject>,
        max_version: Option<PyObject>,
        dl_device: Option<PyObject>,
        copy: Option<bool>,
    ) -> PyResult<Bound<'py, PyAny>> {
        let _ = (stream, max_version, dl_device);
        if copy == Some(true) {
            return Err(PyValueError::new_err(
                "flowgate batches are exported without copying",
            ));
        }
        let py = slf.py();
        let b = slf.get();
        let mut shape: Vec<i64> = b.t.shape().iter().map(|&d| d as i64).collect();
        let (code, bits) = match b.t.dtype() {
            DType::U8 => (1, 8),
            DType::F32 => (2, 32),
            DType::I64 => (0, 64),
        };
        let tensor = DLTensor {
            data: b.t.bytes().as_ptr() as *mut c_void,
            device: DLDevice {
                device_type: 1, // kDLCPU
                device_id: 0,
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

    /// Where the memory is: `(kDLCPU, 0)`.
    fn __dlpack_device__(&self) -> (i32, i32) {
        (1, 0)
    }
}

// ---------------------------------------------------------------------------------------------
// Native loaders.

type Make = Box<dyn Fn() -> Result<Pipeline<Loaded>, PipelineError> + Send + Sync>;

/// A collated batch (one tensor per field: frames, or frames and audio) and the dataset
/// indices of its files (for labels and paths).
struct Loaded {
    fields: Vec<Tensor>,
    files: Vec<usize>,
}

/// Decodes one file, in an epoch (which seeds random augmentation), into one item: a tensor
/// per field.
type Decode = Arc<
    dyn Fn(&std::path::Path, u64) -> Result<Vec<Tensor>, flowgate::media::MediaError> + Send + Sync,
>;

/// One failure the loader skipped: (stage, item, message).
type Failure = (String, String, String);

struct Core {
    make: Make,
    pipeline: Option<Pipeline<Loaded>>,
    /// Whether an epoch is being iterated (a new Python iterator then starts the next one).
    in_epoch: bool,
    batches_per_epoch: usize,
}

impl Core {
    fn pipeline(&mut self) -> Result<&mut Pipeline<Loaded>, PipelineError> {
        if self.pipeline.is_none() {
            self.pipeline = Some((self.make)()?);
        }
        Ok(self.pipeline.as_mut().expect("built"))
    }

    /// Starts an epoch; if the last one was left mid-way, the pipeline is rebuilt to start
    /// the next one cleanly (dropping it stops its threads at once).
    fn start_epoch(&mut self) -> Result<(), PipelineError> {
        if self.in_epoch {
            let next = self.pipeline()?.epoch() + 1;
            self.pipeline = None;
            let p = self.pipeline()?;
            p.resume(&PipelineState {
                epoch: next,
                ..Default::default()
            })?;
        }
        self.in_epoch = true;
        Ok(())
    }

    fn next(&mut self) -> Result<Option<Loaded>, PipelineError> {
        if !self.in_epoch {
            return Ok(None);
        }
        let r = self.pipeline()?.iter().next();
        match r {
            Some(Ok(t)) => Ok(Some(t)),
            Some(Err(e)) => {
                self.in_epoch = false;
                self.pipeline = None; // a failed pipeline is rebuilt for the next epoch
                Err(e)
            }
            None => {
                self.in_epoch = false;
                Ok(None)
            }
        }
    }
}

/// A native loader; see `flowgate.ImageLoader` and `flowgate.AudioLoader`.
#[pyclass(module = "flowgate._native")]
struct Loader {
    core: Mutex<Core>,
    failures: Arc<Mutex<Vec<Failure>>>,
    /// The dataset's paths (every rank's), indexed by `Loaded::files`.
    paths: Arc<[PathBuf]>,
    extras: Extras,
}

/// What a loader's batches carry besides the tensor.
struct Extras {
    /// A label per dataset path, when batches carry labels.
    labels: Option<Vec<i64>>,
    /// The class names, when the labels come from folders.
    classes: Option<Vec<String>>,
    /// Whether batches carry their files' paths.
    return_paths: bool,
}

impl Extras {
    /// Reads the `labels` argument: `"folder"`, a sequence of ints (one per file, in dataset
    /// order) or a mapping from path to int.
    fn new(labels: Option<&Bound<'_, PyAny>>, files: &Files, return_paths: bool) -> PyResult<Self> {
        let mut e = Self {
            labels: None,
            classes: None,
            return_paths,
        };
        let Some(labels) = labels else {
            return Ok(e);
        };
        if let Ok(kind) = labels.extract::<String>() {
            if kind != "folder" {
                return Err(PyValueError::new_err(format!(
                    "labels must be \"folder\", a sequence of ints or a mapping from path to int, not {kind:?}"
                )));
            }
            let folders = files.folder_labels();
            e.labels = Some(
                files
                    .paths()
                    .iter()
                    .map(|p| {
                        folders
                            .label(p)
                            .expect("a dataset file's folder is a class")
                    })
                    .collect(),
            );
            e.classes = Some(folders.classes());
        } else if let Ok(map) = labels.downcast::<PyDict>() {
            let mut v = Vec::with_capacity(files.len());
            for p in files.paths() {
                let key = p.to_string_lossy();
                let label = map.get_item(key.as_ref())?.ok_or_else(|| {
                    PyValueError::new_err(format!("labels has no entry for {key:?}"))
                })?;
                v.push(label.extract::<i64>()?);
            }
            e.labels = Some(v);
        } else {
            let v: Vec<i64> = labels.extract()?;
            if v.len() != files.len() {
                return Err(PyValueError::new_err(format!(
                    "{} labels for {} files",
                    v.len(),
                    files.len()
                )));
            }
            e.labels = Some(v);
        }
        Ok(e)
    }
}

/// Keeps the last this many skipped failures.
const KEEP_FAILURES: usize = 1000;

#[allow(clippy::too_many_arguments)]
fn files_of(
    paths: &Bound<'_, PyAny>,
    extensions: &[&str],
    shuffle: bool,
    seed: u64,
    rank: Option<usize>,
    world_size: Option<usize>,
    drop_last: bool,
) -> PyResult<Files> {
    let files = if let Ok(s) = paths.extract::<PathBuf>() {
        if s.is_dir() {
            Files::dir(&s, extensions)
        } else {
            Files::list(&s)
        }
        .map_err(to_py)?
    } else {
        let v: Vec<PathBuf> = paths.extract()?;
        Files::new(v)
    };
    let mut files = if shuffle { files.shuffle(seed) } else { files };
    files = match (rank, world_size) {
        (Some(r), Some(w)) => files.shard(r, w),
        (None, None) => files.shard_from_env(),
        _ => {
            return Err(PyValueError::new_err(
                "give both rank and world_size, or neither",
            ))
        }
    };
    if drop_last {
        files = files.shard_lengths(ShardLengths::Drop);
    }
    Ok(files)
}

fn nbytes(fields: &[Tensor]) -> usize {
    fields.iter().map(Tensor::nbytes).sum()
}

/// Stacks each field of the items into one batch tensor.
fn collate(items: Vec<(Vec<Tensor>, usize)>) -> Result<Loaded, PipelineError> {
    let n_fields = items.first().map_or(0, |(f, _)| f.len());
    let fields = (0..n_fields)
        .map(|k| {
            let column: Vec<&Tensor> = items.iter().filter_map(|(f, _)| f.get(k)).collect();
            if column.len() != items.len() {
                return None;
            }
            Tensor::stack(&column)
        })
        .collect::<Option<Vec<Tensor>>>()
        .ok_or(PipelineError::config("items of different shapes"))?;
    Ok(Loaded {
        fields,
        files: items.into_iter().map(|(_, i)| i).collect(),
    })
}

impl Loader {
    fn new(
        files: Files,
        extras: Extras,
        decode: Decode,
        batch_size: usize,
        drop_last: bool,
        workers: Option<usize>,
        skip_errors: bool,
    ) -> PyResult<Self> {
        if batch_size == 0 {
            return Err(PyValueError::new_err("batch_size must be at least 1"));
        }
        let n = files.epoch(0).len();
        let batches_per_epoch = if drop_last {
            n / batch_size
        } else {
            n.div_ceil(batch_size)
        };
        let failures: Arc<Mutex<Vec<Failure>>> = Arc::default();
        let seen = Arc::clone(&failures);
        let paths: Arc<[PathBuf]> = files.paths().into();
        let all = Arc::clone(&paths);
        let make: Make = Box::new(move || {
            let files = files.clone();
            let decode = Arc::clone(&decode);
            let seen = Arc::clone(&seen);
            let (named, read) = (Arc::clone(&all), Arc::clone(&all));
            Pipeline::builder()
                .source_epochs(move |e| files.epoch_indices(e).into_iter().map(move |i| (i, e)))
                .describe(move |&(i, _): &(usize, u64)| named[i].display().to_string())
                .pipe(
                    "decode",
                    move |(i, epoch): (usize, u64)| decode(&read[i], epoch).map(|t| (t, i)),
                    workers.map_or(Workers::initial(1), Workers::fixed),
                )
                .measure(|(t, _): &(Vec<Tensor>, usize)| nbytes(t))
                .aggregate(batch_size, drop_last)
                .pipe("collate", collate, 1)
                .measure(|b: &Loaded| nbytes(&b.fields))
                .max_failures(if skip_errors {
                    FailureBudget::unlimited()
                } else {
                    FailureBudget::fail_fast()
                })
                .on_failure(move |e| {
                    let mut f = seen.lock().expect("failures");
                    if f.len() == KEEP_FAILURES {
                        f.remove(0);
                    }
                    f.push((e.stage().to_owned(), e.item().to_owned(), e.to_string()));
                })
                .build()
        });
        Ok(Self {
            core: Mutex::new(Core {
                make,
                pipeline: None,
                in_epoch: false,
                batches_per_epoch,
            }),
            failures,
            paths,
            extras,
        })
    }
}

#[pymethods]
impl Loader {
    /// Starts an epoch (the next one, or the resumed one after `load_state_dict`).
    fn _start_epoch(&self, py: Python<'_>) -> PyResult<()> {
        let core = &self.core;
        py.allow_threads(|| core.lock().expect("loader").start_epoch())
            .map_err(to_py)
    }

    /// The next batch of the epoch, or None at its end: a `Batch`, or a tuple of it, the
    /// labels (an int64 `Batch`) and the paths (a list of str), as configured. Releases the
    /// GIL while waiting.
    fn _next<'py>(&self, py: Python<'py>) -> PyResult<Option<Bound<'py, PyAny>>> {
        let core = &self.core;
        let loaded = py
            .allow_threads(|| core.lock().expect("loader").next())
            .map_err(to_py)?;
        let Some(Loaded { fields, files }) = loaded else {
            return Ok(None);
        };
        let mut out = fields
            .into_iter()
            .map(|t| Ok(Bound::new(py, Batch { t })?.into_any()))
            .collect::<PyResult<Vec<_>>>()?;
        if out.len() == 1 && self.extras.labels.is_none() && !self.extras.return_paths {
            return Ok(out.pop());
        }
        if let Some(labels) = &self.extras.labels {
            let v: Vec<i64> = files.iter().map(|&i| labels[i]).collect();
            out.push(
                Bound::new(
                    py,
                    Batch {
                        t: Tensor::from_i64(&v),
                    },
                )?
                .into_any(),
            );
        }
        if self.extras.return_paths {
            let paths = files.iter().map(|&i| self.paths[i].to_string_lossy());
            out.push(PyList::new(py, paths)?.into_any());
        }
        Ok(Some(PyTuple::new(py, out)?.into_any()))
    }

    /// The class names, index = label (`labels="folder"`), or None.
    #[getter]
    fn classes(&self) -> Option<Vec<String>> {
        self.extras.classes.clone()
    }

    /// Batches per epoch.
    fn __len__(&self) -> usize {
        self.core.lock().expect("loader").batches_per_epoch
    }

    /// The epoch being iterated, or the next one.
    #[getter]
    fn epoch(&self) -> PyResult<u64> {
        let mut c = self.core.lock().expect("loader");
        Ok(c.pipeline().map_err(to_py)?.epoch())
    }

    /// Statistics: delivered batches, failures, consumer wait, per-stage workers and rates.
    fn stats<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyDict>> {
        let mut c = self.core.lock().expect("loader");
        let s = c.pipeline().map_err(to_py)?.stats();
        let d = PyDict::new(py);
        d.set_item("delivered", s.delivered)?;
        d.set_item("failures", s.failures)?;
        d.set_item("consumer_wait_s", s.consumer_wait.as_secs_f64())?;
        let stages = PyDict::new(py);
        for st in &s.stages {
            let x = PyDict::new(py);
            x.set_item("workers", st.workers)?;
            x.set_item("items_in", st.items_in)?;
            x.set_item("items_out", st.items_out)?;
            x.set_item("items_per_s", st.items_per_s)?;
            stages.set_item(&st.name, x)?;
        }
        d.set_item("stages", stages)?;
        Ok(d)
    }

    /// The failures skipped so far (the last 1,000): (stage, item, message) tuples.
    fn failures(&self) -> Vec<Failure> {
        self.failures.lock().expect("failures").clone()
    }

    /// A checkpoint of the consumer's progress (plain ints and lists: picklable, JSON-able).
    fn state_dict<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyDict>> {
        let mut c = self.core.lock().expect("loader");
        let in_epoch = c.in_epoch;
        let mut s = c.pipeline().map_err(to_py)?.state();
        if !in_epoch && s.delivered_items > 0 {
            // An epoch left mid-way counts as done: the next iterator starts the next epoch.
            s = PipelineState {
                epoch: s.epoch + 1,
                ..Default::default()
            };
        }
        let d = PyDict::new(py);
        d.set_item("epoch", s.epoch)?;
        d.set_item(
            "delivered",
            PyList::new(py, s.delivered.iter().map(|&(a, b)| (a, b)))?,
        )?;
        d.set_item("delivered_items", s.delivered_items)?;
        d.set_item(
            "partial",
            PyList::new(py, s.partial.iter().map(|&(a, b)| (a, b)))?,
        )?;
        Ok(d)
    }

    /// Continues from `state_dict()`: the next iterator yields exactly what was not delivered
    /// yet in that epoch.
    fn load_state_dict(&self, py: Python<'_>, state: &Bound<'_, PyDict>) -> PyResult<()> {
        let get = |k: &str| {
            state
                .get_item(k)?
                .ok_or_else(|| PyValueError::new_err(format!("state_dict without `{k}`")))
        };
        let s = PipelineState {
            epoch: get("epoch")?.extract()?,
            delivered: get("delivered")?.extract()?,
            delivered_items: get("delivered_items")?.extract()?,
            partial: match state.get_item("partial")? {
                Some(p) => p.extract()?,
                None => Vec::new(),
            },
        };
        let core = &self.core;
        py.allow_threads(|| {
            let mut c = core.lock().expect("loader");
            c.pipeline = None;
            c.in_epoch = false;
            c.pipeline()?.resume(&s)
        })
        .map_err(to_py)
    }

    /// Stops the pipeline and joins its threads (also done when the loader is freed).
    fn close(&self, py: Python<'_>) {
        let core = &self.core;
        py.allow_threads(|| {
            let mut c = core.lock().expect("loader");
            c.pipeline = None;
            c.in_epoch = false;
        });
    }
}

/// What every native loader takes besides its decoder (built once by the Python wrappers, so
/// the loader functions below list only their own arguments).
#[pyclass(frozen, module = "flowgate._native")]
struct Options {
    batch_size: usize,
    shuffle: bool,
    seed: u64,
    rank: Option<usize>,
    world_size: Option<usize>,
    drop_last: bool,
    workers: Option<usize>,
    skip_errors: bool,
    labels: Option<Py<PyAny>>,
    return_paths: bool,
}

#[pymethods]
impl Options {
    #[new]
    #[pyo3(signature = (batch_size=32, shuffle=true, seed=0, rank=None, world_size=None,
        drop_last=false, workers=None, skip_errors=true, labels=None, return_paths=false))]
    #[allow(clippy::too_many_arguments)]
    fn new(
        batch_size: usize,
        shuffle: bool,
        seed: u64,
        rank: Option<usize>,
        world_size: Option<usize>,
        drop_last: bool,
        workers: Option<usize>,
        skip_errors: bool,
        labels: Option<Py<PyAny>>,
        return_paths: bool,
    ) -> Self {
        Self {
            batch_size,
            shuffle,
            seed,
            rank,
            world_size,
            drop_last,
            workers,
            skip_errors,
            labels,
            return_paths,
        }
    }
}

impl Options {
    /// A loader of the files `paths` names (a directory walked for `extensions`, a list file
    /// or a sequence), each decoded by `decode`.
    fn loader(
        &self,
        paths: &Bound<'_, PyAny>,
        extensions: &[&str],
        decode: Decode,
    ) -> PyResult<Loader> {
        let files = files_of(
            paths,
            extensions,
            self.shuffle,
            self.seed,
            self.rank,
            self.world_size,
            self.drop_last,
        )?;
        let labels = self.labels.as_ref().map(|l| l.bind(paths.py()));
        let extras = Extras::new(labels, &files, self.return_paths)?;
        Loader::new(
            files,
            extras,
            decode,
            self.batch_size,
            self.drop_last,
            self.workers,
            self.skip_errors,
        )
    }
}

/// An image loader (see `flowgate.ImageLoader`).
#[pyfunction]
#[pyo3(signature = (paths, options, resize=256, crop=224, layout="nchw", train=false,
    scale=(0.08, 1.0), ratio=(0.75, 4.0 / 3.0), normalize=None))]
#[allow(clippy::too_many_arguments)]
fn image_loader(
    paths: &Bound<'_, PyAny>,
    options: &Options,
    resize: u32,
    crop: u32,
    layout: &str,
    train: bool,
    scale: (f64, f64),
    ratio: (f64, f64),
    normalize: Option<([f32; 3], [f32; 3])>,
) -> PyResult<Loader> {
    let layout = match layout {
        "nchw" => Layout::Nchw,
        "nhwc" => Layout::Nhwc,
        other => {
            return Err(PyValueError::new_err(format!(
                "layout must be \"nchw\" or \"nhwc\", not {other:?}"
            )))
        }
    };
    let bad = |what: &str| Err(PyValueError::new_err(what.to_owned()));
    if crop == 0 || (!train && crop > resize) {
        return bad("crop must be at least 1, and at most resize");
    }
    if train && !(0.0 < scale.0 && scale.0 <= scale.1 && scale.1 <= 1.0) {
        return bad("scale must be (lo, hi) with 0 < lo <= hi <= 1");
    }
    if train && !(0.0 < ratio.0 && ratio.0 <= ratio.1) {
        return bad("ratio must be (lo, hi) with 0 < lo <= hi");
    }
    if let Some((_, std)) = normalize {
        if std.iter().any(|&s| s.is_nan() || s <= 0.0) {
            return bad("normalize's std must be positive");
        }
    }
    let recipe = ImageRecipe {
        resize,
        crop,
        layout,
        random_crop: train.then_some(RandomCrop { scale, ratio }),
        flip: train,
        normalize: normalize.map(|(mean, std)| Normalize { mean, std }),
        ..ImageRecipe::default()
    };
    // A new augmentation every epoch, the same one for the same (seed, epoch, file): an
    // exact resume redraws what the interrupted run would have.
    let seed = options.seed;
    options.loader(
        paths,
        &["jpg", "jpeg", "png", "webp"],
        Arc::new(move |p, epoch| {
            let r = if train {
                recipe.reseeded(augmentation_seed(seed, epoch))
            } else {
                recipe
            };
            r.load(p).map(|t| vec![t])
        }),
    )
}

/// An audio loader (see `flowgate.AudioLoader`).
#[pyfunction]
#[pyo3(signature = (paths, options, rate=16000, seconds=4.0, train=false, return_lengths=false))]
fn audio_loader(
    paths: &Bound<'_, PyAny>,
    options: &Options,
    rate: u32,
    seconds: f64,
    train: bool,
    return_lengths: bool,
) -> PyResult<Loader> {
    let samples = (seconds * f64::from(rate)).round();
    if rate == 0 || !samples.is_finite() || samples < 1.0 {
        return Err(PyValueError::new_err(
            "rate and seconds must give at least one sample",
        ));
    }
    let recipe = AudioRecipe {
        rate,
        samples: samples as usize,
        random_crop: train,
        ..AudioRecipe::default()
    };
    let seed = options.seed;
    options.loader(
        paths,
        &["flac", "wav", "mp3", "ogg", "m4a"],
        Arc::new(move |p, epoch| {
            let (t, len) = recipe
                .reseeded(augmentation_seed(seed, epoch))
                .load_with_length(p)?;
            Ok(if return_lengths {
                let len = i64::try_from(len).unwrap_or(i64::MAX);
                vec![t, Tensor::from_i64(&[len]).reshaped(&[])]
            } else {
                vec![t]
            })
        }),
    )
}

/// The augmentation seed of an epoch: new every epoch, the same for the same (seed, epoch).
fn augmentation_seed(seed: u64, epoch: u64) -> u64 {
    seed.wrapping_mul(0x9E37_79B9_7F4A_7C15) ^ epoch
}

/// A video loader (see `flowgate.VideoLoader`; feature `video`): `frames` frames per clip,
/// and with `audio_seconds` the clip's audio track too.
#[cfg(feature = "video")]
#[pyfunction]
#[pyo3(signature = (paths, options, frames=8, resize=128, crop=112, layout="nthwc", threads=1,
    audio_seconds=None, audio_rate=16000))]
#[allow(clippy::too_many_arguments)]
fn video_loader(
    paths: &Bound<'_, PyAny>,
    options: &Options,
    frames: usize,
    resize: u32,
    crop: u32,
    layout: &str,
    threads: usize,
    audio_seconds: Option<f64>,
    audio_rate: u32,
) -> PyResult<Loader> {
    use flowgate::media::video::{Sampling, VideoLayout, VideoRecipe};
    let layout = match layout {
        "nthwc" => VideoLayout::Nthwc,
        "ncthw" => VideoLayout::Ncthw,
        other => {
            return Err(PyValueError::new_err(format!(
                "layout must be \"nthwc\" or \"ncthw\", not {other:?}"
            )))
        }
    };
    if frames == 0 || crop == 0 || crop > resize {
        return Err(PyValueError::new_err(
            "frames and crop must be at least 1, and crop at most resize",
        ));
    }
    let video = VideoRecipe {
        sampling: Sampling::Uniform(frames),
        resize,
        crop,
        layout,
        threads: threads.max(1),
        ..VideoRecipe::default()
    };
    let audio = audio_seconds.map(|seconds| AudioRecipe {
        rate: audio_rate,
        samples: (seconds * f64::from(audio_rate)).round() as usize,
        ..AudioRecipe::default()
    });
    options.loader(
        paths,
        &["mp4", "mkv", "webm", "mov", "avi"],
        Arc::new(move |p, _| {
            let mut fields = vec![video.load(p)?];
            if let Some(a) = &audio {
                fields.push(a.load(p)?);
            }
            Ok(fields)
        }),
    )
}

// ---------------------------------------------------------------------------------------------
// Pipelines of Python callables.

/// A Python exception raised by a stage's callable (its type and message).
#[derive(Debug)]
struct PyStageError(String);

impl std::fmt::Display for PyStageError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(&self.0)
    }
}

impl std::error::Error for PyStageError {}

/// `repr(x)`, for naming an item that failed.
fn py_repr(py: Python<'_>, x: &Py<PyAny>) -> String {
    x.bind(py)
        .repr()
        .map(|r| r.to_string())
        .unwrap_or_else(|_| "<item>".into())
}

fn py_error(py: Python<'_>, e: PyErr) -> PyStageError {
    let ty = e
        .get_type(py)
        .name()
        .map(|n| n.to_string())
        .unwrap_or_else(|_| "Exception".into());
    PyStageError(format!("{ty}: {}", e.value(py)))
}

/// An exception raised by the source iterable: it ends the epoch and is raised to the
/// consumer when the epoch's results run out.
type SourceError = Arc<Mutex<Option<PyErr>>>;

/// Pulls items from a Python iterator (taking the GIL per item).
struct PyItems {
    it: Option<Py<PyAny>>,
    error: SourceError,
}

impl Iterator for PyItems {
    type Item = Py<PyAny>;
    fn next(&mut self) -> Option<Py<PyAny>> {
        let it = self.it.as_ref()?;
        Python::with_gil(|py| match it.bind(py).call_method0("__next__") {
            Ok(x) => Some(x.unbind()),
            Err(e) if e.is_instance_of::<pyo3::exceptions::PyStopIteration>(py) => None,
            Err(e) => {
                *self.error.lock().expect("source error") = Some(e);
                None
            }
        })
    }
}

enum StageSpec {
    Map {
        name: String,
        f: Py<PyAny>,
        workers: usize,
    },
    Batch {
        size: usize,
        drop_last: bool,
    },
}

/// A pipeline of Python callables; see `flowgate.Pipeline`.
#[pyclass(module = "flowgate._native", name = "Pipeline")]
struct PyPipeline {
    source: Py<PyAny>,
    stages: Mutex<Vec<StageSpec>>,
    skip_errors: bool,
    running: Mutex<Option<(Pipeline<Py<PyAny>>, bool)>>,
    source_error: SourceError,
}

impl Drop for PyPipeline {
    fn drop(&mut self) {
        // Worker threads may be waiting for the GIL: release it while they are joined.
        if let Some(r) = self.running.get_mut().ok().and_then(Option::take) {
            Python::with_gil(|py| py.allow_threads(move || drop(r)));
        }
    }
}

impl PyPipeline {
    fn build(&self, py: Python<'_>) -> Result<Pipeline<Py<PyAny>>, PipelineError> {
        let source = self.source.clone_ref(py);
        let error = Arc::clone(&self.source_error);
        let b = Pipeline::builder().source_epochs(move |epoch| {
            Python::with_gil(|py| {
                let src = source.bind(py);
                let iterable = if src.is_callable() {
                    src.call1((epoch,))
                } else {
                    Ok(src.clone())
                };
                let it = iterable.and_then(|x| x.try_iter().map(|i| i.into_any().unbind()));
                let error = Arc::clone(&error);
                match it {
                    Ok(it) => PyItems {
                        it: Some(it),
                        error,
                    },
                    Err(e) => {
                        *error.lock().expect("source error") = Some(e);
                        PyItems { it: None, error }
                    }
                }
            })
        });
        // Items are described (`repr()`, under the GIL) only when they fail: see `Described`.
        let mut b = b;
        let budget = if self.skip_errors {
            FailureBudget::unlimited()
        } else {
            FailureBudget::fail_fast()
        };
        for s in self.stages.lock().expect("stages").iter() {
            b = match s {
                StageSpec::Map { name, f, workers } => {
                    let f = f.clone_ref(py);
                    b.pipe(
                        name,
                        move |x: Py<PyAny>| {
                            Python::with_gil(|py| {
                                f.call1(py, (x.clone_ref(py),))
                                    .map_err(|e| Described::new(py_repr(py, &x), py_error(py, e)))
                            })
                        },
                        Workers::initial(*workers),
                    )
                }
                StageSpec::Batch { size, drop_last } => b.aggregate(*size, *drop_last).pipe(
                    &format!("batch{size}"),
                    |v: Vec<Py<PyAny>>| {
                        Python::with_gil(|py| {
                            PyList::new(py, v)
                                .map(|l| l.into_any().unbind())
                                .map_err(|e| py_error(py, e))
                        })
                    },
                    1,
                ),
            };
        }
        b.max_failures(budget).build()
    }
}

#[pymethods]
impl PyPipeline {
    #[new]
    #[pyo3(signature = (source, skip_errors=false))]
    fn new(source: Py<PyAny>, skip_errors: bool) -> Self {
        Self {
            source,
            stages: Mutex::new(Vec::new()),
            skip_errors,
            running: Mutex::new(None),
            source_error: Arc::default(),
        }
    }

    /// Adds a stage calling `f(item)` on `workers` threads (a starting point: the tuner may
    /// change it). Python callables hold the GIL while they run.
    #[pyo3(signature = (f, workers=1, name=None))]
    fn map<'py>(
        slf: Bound<'py, Self>,
        f: Py<PyAny>,
        workers: usize,
        name: Option<String>,
    ) -> Bound<'py, Self> {
        {
            let me = slf.borrow();
            let mut st = me.stages.lock().expect("stages");
            let name = name.unwrap_or_else(|| format!("map{}", st.len() + 1));
            st.push(StageSpec::Map {
                name,
                f,
                workers: workers.max(1),
            });
        }
        slf
    }

    /// Groups items into lists of `size`.
    #[pyo3(signature = (size, drop_last=false))]
    fn batch<'py>(
        slf: Bound<'py, Self>,
        size: usize,
        drop_last: bool,
    ) -> PyResult<Bound<'py, Self>> {
        if size == 0 {
            return Err(PyValueError::new_err("size must be at least 1"));
        }
        slf.borrow()
            .stages
            .lock()
            .expect("stages")
            .push(StageSpec::Batch { size, drop_last });
        Ok(slf)
    }

    /// Starts an epoch (building the pipeline the first time).
    fn _start_epoch(&self, py: Python<'_>) -> PyResult<()> {
        let mut r = self.running.lock().expect("running");
        match r.as_mut() {
            Some((_, in_epoch)) if !*in_epoch => *in_epoch = true,
            _ => {
                let next = r.as_ref().map(|(p, _)| p.epoch() + 1);
                let cleared = r.take();
                py.allow_threads(move || drop(cleared));
                let mut p = self.build(py).map_err(to_py)?;
                if let Some(epoch) = next {
                    p.resume(&PipelineState {
                        epoch,
                        ..Default::default()
                    })
                    .map_err(to_py)?;
                }
                *r = Some((p, true));
            }
        }
        Ok(())
    }

    fn _next(&self, py: Python<'_>) -> PyResult<Option<Py<PyAny>>> {
        let running = &self.running;
        let r = py.allow_threads(|| {
            let mut g = running.lock().expect("running");
            let Some((p, in_epoch)) = g.as_mut() else {
                return Ok(None);
            };
            if !*in_epoch {
                return Ok(None);
            }
            match p.iter().next() {
                Some(Ok(x)) => Ok(Some(x)),
                Some(Err(e)) => {
                    *g = None;
                    Err(e)
                }
                None => {
                    *in_epoch = false;
                    Ok(None)
                }
            }
        });
        let r = r.map_err(to_py)?;
        if r.is_none() {
            if let Some(e) = self.source_error.lock().expect("source error").take() {
                return Err(e);
            }
        }
        Ok(r)
    }

    /// Stops the pipeline and joins its threads.
    fn close(&self, py: Python<'_>) {
        let r = self.running.lock().expect("running").take();
        py.allow_threads(move || drop(r));
    }
}

/// Native threads of this process (for tests: nothing leaks).
#[pyfunction]
fn _thread_count() -> usize {
    std::fs::read_to_string("/proc/self/status")
        .ok()
        .and_then(|s| {
            s.lines()
                .find_map(|l| l.strip_prefix("Threads:"))
                .and_then(|v| v.trim().parse().ok())
        })
        .unwrap_or(0)
}

#[pymodule]
fn _native(m: &Bound<'_, PyModule>) -> PyResult<()> {
    m.add_class::<Batch>()?;
    m.add_class::<Loader>()?;
    m.add_class::<Options>()?;
    m.add_class::<PyPipeline>()?;
    m.add_function(wrap_pyfunction!(image_loader, m)?)?;
    m.add_function(wrap_pyfunction!(audio_loader, m)?)?;
    #[cfg(feature = "video")]
    m.add_function(wrap_pyfunction!(video_loader, m)?)?;
    m.add_function(wrap_pyfunction!(_thread_count, m)?)?;
    m.add("LoaderError", m.py().get_type::<LoaderError>())?;
    Ok(())
}
