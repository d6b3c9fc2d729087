//! `flowgate._native`: the Rust side of the Python package.
//!
//! Files:
//! - `batch`: [`Batch`](batch::Batch), zero-copy to NumPy and DLPack consumers.
//! - `loader`: [`Loader`](loader::Loader), the Python face of the library's [`flowgate::Loader`].
//! - `dataset`: the loaders' `paths` and `labels` as a library [`flowgate::dataset::Source`].
//! - `device`: the device a loader uploads to (`device="cuda"`), and the simulated device's record.
//! - `args`: a loader from the wrappers' arguments, read into the library's
//!   [`flowgate::loader::LoaderSettings`] and [`flowgate::media::MediaArgs`].
//! - `pipeline`: [`PyPipeline`](pipeline::PyPipeline), stages that are Python callables: its
//!   passes, epochs and checkpoints; `stages`: its source and stages as the engine's.
//! - `error`: `LoaderError` and how pipeline errors reach Python.
//! - `gil`: what a pipeline's Python calls took, and whether the GIL held its threads back.
//! - `lifecycle`: how a Python-calling pipeline's threads stop (closed, freed by the garbage
//!   collector on one of them, at exit).
//! - `units`, `pool`: the remote mode's native half: an epoch cut into units and their batches
//!   regrouped; the pool's books (the library's dispatcher), whose commands `_remote.py`
//!   carries out on Ray actors.
//!
//! - [`Loader`](loader::Loader): a native pipeline (image or audio files → batches) whose iteration releases
//!   the GIL while waiting; one epoch per Python iterator; `state_dict` / `load_state_dict`
//!   through flowgate's exact resume.
//! - [`PyPipeline`](pipeline::PyPipeline): a general pipeline whose stages are Python callables (they take the GIL;
//!   the engine's threads, queues and tuner do not).
//! - [`Batch`](batch::Batch): a tensor exposing `__array_interface__` and `__dlpack__`, so
//!   `numpy.asarray(b)`, `numpy.from_dlpack(b)` and `torch.from_dlpack(b)` share its memory.

use pyo3::prelude::*;

mod args;
mod batch;
mod dataset;
mod device;
mod error;
mod fetch;
mod fork;
mod gil;
mod lifecycle;
mod loader;
mod map;
mod pipeline;
mod pool;
mod stages;
mod state;
mod stats;
mod units;
mod values;

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

/// Makes a forked child ready to run loaders of its own (see
/// [`flowgate::after_fork_in_child`]); `flowgate` registers it with `os.register_at_fork`.
#[pyfunction]
fn _after_fork_in_child() {
    flowgate::after_fork_in_child();
    lifecycle::forget_after_fork();
    fork::forget_after_fork();
    fetch::forget_after_fork();
}

/// `flowgate.build_info()`: the version, the JPEG decoder compiled in and the optional
/// features of this build ([`flowgate::build_info`]), as a dict.
#[pyfunction]
fn build_info(py: Python<'_>) -> PyResult<Bound<'_, pyo3::types::PyDict>> {
    let info = flowgate::build_info();
    let dict = pyo3::types::PyDict::new(py);
    dict.set_item("version", info.version)?;
    dict.set_item("jpeg", info.jpeg)?;
    dict.set_item("features", &info.features)?;
    dict.set_item("text", info.to_string())?;
    Ok(dict)
}

/// Set when the interpreter starts to exit (`flowgate` registers [`_exiting`] with `atexit`):
/// from then on a loader freed joins its threads without releasing the GIL (the interpreter
/// is being torn down; another thread may not take it back).
pub(crate) static EXITING: std::sync::atomic::AtomicBool =
    std::sync::atomic::AtomicBool::new(false);

/// The cores this process may use: its share of the node (quota or affinity, over
/// `LOCAL_WORLD_SIZE` ranks), as the tuner sizes stages to.
#[pyfunction]
fn _process_cores() -> usize {
    flowgate::tuner::process_cores()
}

/// See [`EXITING`].
#[pyfunction]
fn _exiting() {
    lifecycle::set_exiting();
}

#[pymodule]
fn _native(m: &Bound<'_, PyModule>) -> PyResult<()> {
    m.add("__version__", env!("CARGO_PKG_VERSION"))?;
    // The library's defaults, which the Python signatures show.
    m.add("DEFAULT_BATCH_SIZE", flowgate::loader::DEFAULT_BATCH_SIZE)?;
    m.add(
        "DEFAULT_VIDEO_BATCH_SIZE",
        flowgate::loader::DEFAULT_VIDEO_BATCH_SIZE,
    )?;
    m.add(
        "DEFAULT_PARQUET_COLUMN",
        flowgate::dataset::DEFAULT_PARQUET_COLUMN,
    )?;
    m.add("DEFAULT_BUCKETS", flowgate::loader::DEFAULT_BUCKETS)?;
    m.add("DEFAULT_BUFFER", flowgate::dataset::DEFAULT_BUFFER)?;
    m.add("DEFAULT_PREFETCH", flowgate::dataset::DEFAULT_PREFETCH)?;
    m.add("DEFAULT_MAX_WORKERS", flowgate::loader::DEFAULT_MAX_WORKERS)?;
    m.add("MAX_STAGE_PREFETCH", flowgate::limits::STAGE_PREFETCH.max)?;
    m.add(
        "DEFAULT_BATCHES_PER_UNIT",
        flowgate::loader::DEFAULT_BATCHES_PER_UNIT,
    )?;
    m.add(
        "DEFAULT_START_TIMEOUT",
        flowgate::loader::DEFAULT_START_TIMEOUT,
    )?;
    {
        use flowgate::media::args::*;
        m.add("DEFAULT_RESIZE", DEFAULT_RESIZE)?;
        m.add("DEFAULT_CROP", DEFAULT_CROP)?;
        m.add("DEFAULT_SCALE", DEFAULT_SCALE)?;
        m.add("DEFAULT_RATIO", DEFAULT_RATIO)?;
        m.add("DEFAULT_RATE", DEFAULT_RATE)?;
        m.add("DEFAULT_SECONDS", DEFAULT_SECONDS)?;
        m.add("DEFAULT_FRAMES", DEFAULT_FRAMES)?;
        m.add("DEFAULT_VIDEO_RESIZE", DEFAULT_VIDEO_RESIZE)?;
        m.add("DEFAULT_VIDEO_CROP", DEFAULT_VIDEO_CROP)?;
    }
    // As tuples, rounded to the six digits they are written with (not f32's tail).
    let stats = |v: [f32; 3]| {
        let [a, b, c] = v.map(|x| (f64::from(x) * 1e6).round() / 1e6);
        (a, b, c)
    };
    m.add("IMAGENET_MEAN", stats(flowgate::media::args::IMAGENET_MEAN))?;
    m.add("IMAGENET_STD", stats(flowgate::media::args::IMAGENET_STD))?;
    m.add_class::<batch::Batch>()?;
    m.add_class::<fetch::Fetch>()?;
    m.add_class::<loader::Loader>()?;
    m.add_class::<units::EpochPlan>()?;
    m.add_class::<pool::Dispatch>()?;
    m.add_class::<pool::PoolSettings>()?;
    m.add_class::<units::Regroup>()?;
    m.add_function(wrap_pyfunction!(units::_delivered_since, m)?)?;
    m.add_function(wrap_pyfunction!(units::_batches_of, m)?)?;
    m.add_function(wrap_pyfunction!(dataset::_check_mix, m)?)?;
    m.add_function(wrap_pyfunction!(args::_check_limit, m)?)?;
    m.add_function(wrap_pyfunction!(args::_batches_ahead, m)?)?;
    m.add_class::<pipeline::PyPipeline>()?;
    m.add_function(wrap_pyfunction!(args::loader, m)?)?;
    m.add_function(wrap_pyfunction!(state::merge_state_dicts, m)?)?;
    m.add_function(wrap_pyfunction!(_thread_count, m)?)?;
    m.add_function(wrap_pyfunction!(batch::_batch_from_bytes, m)?)?;
    m.add_function(wrap_pyfunction!(_after_fork_in_child, m)?)?;
    m.add_function(wrap_pyfunction!(fork::_before_fork, m)?)?;
    m.add_function(wrap_pyfunction!(fork::_after_fork, m)?)?;
    m.add_function(wrap_pyfunction!(fork::_fork_gate, m)?)?;
    m.add_function(wrap_pyfunction!(_exiting, m)?)?;
    m.add_function(wrap_pyfunction!(_process_cores, m)?)?;
    m.add_function(wrap_pyfunction!(build_info, m)?)?;
    m.add_function(wrap_pyfunction!(stages::skip_part, m)?)?;
    m.add_function(wrap_pyfunction!(lifecycle::_join_closing, m)?)?;
    m.add_function(wrap_pyfunction!(lifecycle::_closing_at_exit, m)?)?;
    m.add("LoaderError", m.py().get_type::<error::LoaderError>())?;
    m.add(
        "SkippedItemsWarning",
        m.py().get_type::<error::SkippedItemsWarning>(),
    )?;
    m.add(
        "DeviceUnavailable",
        m.py().get_type::<error::DeviceUnavailable>(),
    )?;
    Ok(())
}
