//! The media loaders' constructors: the arguments every loader shares ([`Options`]) and one
//! function per modality, each building a validated [`Recipe`] that seeds augmentation by
//! flowgate's one rule (seed, epoch, file).

use flowgate::dataset::{Dataset, Ranks};
use flowgate::limits::{BATCH_SIZE, DEVICE_MEMORY_MB, MEMORY_MB, WORKERS};
use flowgate::loader::LoaderBuilder;
use flowgate::media::audio::AudioRecipe;
use flowgate::media::image::{ImageRecipe, Layout, Normalize, RandomCrop};
use flowgate::media::{Recipe, RecipeError};
use flowgate::{FailureBudget, Order};
use pyo3::exceptions::PyValueError;
use pyo3::prelude::*;

use crate::dataset::{open_error, source_of};
use crate::device::open_device;
use crate::error::out_of_range;
use crate::loader::Loader;

/// What every native loader takes besides its decoder (built once by the Python wrappers, so
/// the loader functions below list only their own arguments).
#[pyclass(frozen, module = "flowgate._native")]
pub(crate) struct Options {
    batch_size: usize,
    shuffle: bool,
    seed: u64,
    rank: Option<usize>,
    world_size: Option<usize>,
    drop_last: bool,
    workers: Option<usize>,
    order: Order,
    skip_errors: bool,
    fill_skipped: Option<bool>,
    labels: Option<Py<PyAny>>,
    return_paths: bool,
    memory_bytes: Option<u64>,
    cpu_budget: Option<flowgate::CpuBudget>,
    device: String,
    device_bytes: Option<u64>,
    /// `(worker, workers)` in a DataLoader worker: this process is that reader of the rank's
    /// epochs (`LoaderBuilder::reader`).
    reader: Option<(usize, usize)>,
    /// Decodes units of another loader's plan (a remote worker): no batch dropped.
    units: bool,
}

#[pymethods]
impl Options {
    #[new]
    #[pyo3(signature = (batch_size=flowgate::loader::DEFAULT_BATCH_SIZE as i64, shuffle=true, seed=0, rank=None, world_size=None,
        drop_last=false, workers=None, order="input".to_owned(), skip_errors=true, fill_skipped=None, labels=None, return_paths=false,
        memory_mb=None, cpu_budget=None, device="cpu".to_owned(), device_memory_mb=None, reader=None, units=false))]
    #[allow(clippy::too_many_arguments)]
    fn new(
        batch_size: i64,
        shuffle: bool,
        seed: u64,
        rank: Option<usize>,
        world_size: Option<usize>,
        drop_last: bool,
        workers: Option<i64>,
        order: String,
        skip_errors: bool,
        fill_skipped: Option<bool>,
        labels: Option<Py<PyAny>>,
        return_paths: bool,
        memory_mb: Option<f64>,
        cpu_budget: Option<&Bound<'_, PyAny>>,
        device: String,
        device_memory_mb: Option<f64>,
        reader: Option<(usize, usize)>,
        units: bool,
    ) -> PyResult<Self> {
        let cpu_budget = cpu_budget.map(cpu_budget_of).transpose()?;
        // The library's limits, in its words (a pipeline file says the same).
        let memory_bytes = memory_mb
            .map(|m| MEMORY_MB.bytes(m))
            .transpose()
            .map_err(out_of_range)?;
        let device_bytes = device_memory_mb
            .map(|m| DEVICE_MEMORY_MB.bytes(m))
            .transpose()
            .map_err(out_of_range)?;
        let batch_size = BATCH_SIZE.check(batch_size.into()).map_err(out_of_range)? as usize;
        let workers = workers
            .map(|n| WORKERS.check(n.into()).map(|n| n as usize))
            .transpose()
            .map_err(out_of_range)?;
        let order = choice(
            "order",
            &order,
            &[("input", Order::Input), ("completion", Order::Completion)],
        )?;
        Ok(Self {
            batch_size,
            shuffle,
            seed,
            rank,
            world_size,
            drop_last,
            workers,
            order,
            skip_errors,
            fill_skipped,
            labels,
            return_paths,
            memory_bytes,
            cpu_budget,
            device,
            device_bytes,
            reader,
            units,
        })
    }
}

/// Checks the argument `name` (of a loader or a source) against the library's limits, in its
/// words: what `flowgate.Shards(...)` and the loaders call before anything is built.
#[pyfunction]
pub(crate) fn _check_limit(name: &str, value: &Bound<'_, PyAny>) -> PyResult<()> {
    use flowgate::limits::{CACHE_MB, PREFETCH};
    let whole = match name {
        "batch_size" => BATCH_SIZE,
        "workers" => WORKERS,
        "prefetch" => PREFETCH,
        "buffer" => flowgate::limits::BUFFER,
        _ => {
            let limit = match name {
                "cache_mb" => CACHE_MB,
                "memory_mb" => MEMORY_MB,
                "device_memory_mb" => DEVICE_MEMORY_MB,
                _ => return Err(PyValueError::new_err(format!("no limit named {name:?}"))),
            };
            return limit
                .bytes(value.extract()?)
                .map(drop)
                .map_err(out_of_range);
        }
    };
    // An integer too large for i64 is out of every range.
    let v: i128 = value.extract::<i64>().map_or(i128::MAX, i128::from);
    whole.check(v).map(drop).map_err(out_of_range)
}

/// `cpu_budget=`: a number of cores (an int, or anything with `__index__`), a fraction of the
/// node (a float below 1) or a percentage (`"40%"`); a bool (Python's or NumPy's) or any
/// other type is refused, naming the argument.
pub(crate) fn cpu_budget_of(v: &Bound<'_, PyAny>) -> PyResult<flowgate::CpuBudget> {
    let type_name = v.get_type().name()?.to_string();
    let parsed = if type_name.contains("bool") {
        Err(format!(
            "cpu_budget: a number of cores, a fraction or a percentage, not {type_name}"
        ))
    } else if let Ok(s) = v.downcast::<pyo3::types::PyString>() {
        s.extract::<String>()?.parse()
    } else if v.is_instance_of::<pyo3::types::PyFloat>() {
        flowgate::CpuBudget::from_number(v.extract::<f64>()?)
    } else if let Ok(n) = v.extract::<i64>() {
        flowgate::CpuBudget::from_number(n as f64)
    } else {
        Err(format!(
            "cpu_budget: a number of cores (2), a fraction (0.4) or a percentage (\"40%\"), not {type_name}"
        ))
    };
    parsed.map_err(PyValueError::new_err)
}

impl Options {
    /// A loader of what `paths` names (a directory, a list file, a media file, a sequence of
    /// paths, a `flowgate.Shards`, `flowgate.Parquet` or `flowgate.Mix`), each item decoded
    /// by `recipe`; `more` sets what only one modality has (lengths, length-aware batches, an
    /// audio track).
    fn loader(
        &self,
        paths: &Bound<'_, PyAny>,
        recipe: Recipe,
        more: impl FnOnce(LoaderBuilder) -> LoaderBuilder,
    ) -> PyResult<Loader> {
        let py = paths.py();
        let labels = self.labels.as_ref().map(|l| l.bind(py));
        let source = source_of(paths, recipe.extensions(), labels)?;
        let ranks = match (self.rank, self.world_size) {
            (Some(rank), Some(world)) => Ranks::Fixed { rank, world },
            (None, None) => Ranks::FromEnv,
            _ => {
                return Err(PyValueError::new_err(
                    "give both rank and world_size, or neither",
                ))
            }
        };
        let dataset = Dataset::builder(source)
            .extensions(recipe.extensions())
            .shuffle_seed(self.shuffle.then_some(self.seed))
            .ranks_from(ranks)
            .drop_last(self.drop_last);
        // Opening reads listings, manifests and footers (on S3: requests, retries): without
        // the GIL, so the process's other threads run meanwhile.
        let dataset = py
            .allow_threads(move || dataset.build())
            .map_err(open_error)?;
        let mut b = flowgate::Loader::builder(dataset, recipe)
            .batch_size(self.batch_size)
            .drop_last(self.drop_last)
            .order(self.order)
            .max_failures(if self.skip_errors {
                FailureBudget::unlimited()
            } else {
                FailureBudget::fail_fast()
            });
        if let Some(n) = self.workers {
            b = b.workers(n);
        }
        // Not given: the library's default (on under a world size above 1).
        if let Some(f) = self.fill_skipped {
            b = b.fill_skipped(f);
        }
        if self.units {
            b = b.decodes_units();
        }
        if let Some((reader, readers)) = self.reader {
            b = b.reader(reader, readers);
        }
        if let Some(m) = self.memory_bytes {
            b = b.memory_budget(m);
        }
        if let Some(c) = self.cpu_budget {
            b = b.cpu_budget(c);
        }
        if let Some(d) = open_device(&self.device, self.device_bytes)? {
            b = b.device(d);
        }
        let b = more(b);
        let loader = py
            .allow_threads(move || b.build())
            .map_err(|e| PyValueError::new_err(e.to_string()))?;
        Ok(Loader::new(loader, self.return_paths))
    }
}

/// An image loader (see `flowgate.ImageLoader`).
#[pyfunction]
#[pyo3(signature = (paths, options, resize=256, crop=224, layout="nchw", train=false,
    scale=(0.08, 1.0), ratio=(0.75, 4.0 / 3.0), normalize=None, draft=false))]
#[allow(clippy::too_many_arguments)]
pub(crate) fn image_loader(
    paths: &Bound<'_, PyAny>,
    options: &Options,
    resize: u32,
    crop: u32,
    layout: &str,
    train: bool,
    scale: (f64, f64),
    ratio: (f64, f64),
    normalize: Option<([f32; 3], [f32; 3])>,
    draft: bool,
) -> PyResult<Loader> {
    let layout = choice(
        "layout",
        layout,
        &[("nchw", Layout::Nchw), ("nhwc", Layout::Nhwc)],
    )?;
    let recipe = Recipe::image(ImageRecipe {
        resize,
        crop,
        layout,
        random_crop: train.then_some(RandomCrop { scale, ratio }),
        flip: train,
        normalize: normalize.map(|(mean, std)| Normalize { mean, std }),
        draft,
        ..ImageRecipe::default()
    })
    .map_err(invalid)?
    .with_seed(options.seed);
    options.loader(paths, recipe, |b| b)
}

/// The option of argument `arg` named `value`, or a `ValueError` listing the options.
fn choice<T: Copy>(arg: &str, value: &str, options: &[(&str, T)]) -> PyResult<T> {
    options
        .iter()
        .find(|(name, _)| *name == value)
        .map(|&(_, v)| v)
        .ok_or_else(|| {
            let names: Vec<String> = options.iter().map(|(n, _)| format!("{n:?}")).collect();
            PyValueError::new_err(format!(
                "{arg} must be {}, not {value:?}",
                names.join(" or ")
            ))
        })
}

/// A recipe no item can be decoded with, as Python's `ValueError` naming the argument.
fn invalid(e: RecipeError) -> PyErr {
    PyValueError::new_err(e.to_string())
}

/// An audio loader (see `flowgate.AudioLoader`). With `max_batch_seconds`, length-aware
/// batches: each clip up to that many seconds (the window), batches of similar lengths padded
/// to their longest clip, at most `max_batch_seconds` padded seconds each, with lengths.
#[pyfunction]
#[pyo3(signature = (paths, options, rate=16000, seconds=4.0, train=false, return_lengths=false,
    max_batch_seconds=None, buckets=flowgate::loader::DEFAULT_BUCKETS))]
#[allow(clippy::too_many_arguments)]
pub(crate) fn audio_loader(
    paths: &Bound<'_, PyAny>,
    options: &Options,
    rate: u32,
    seconds: f64,
    train: bool,
    return_lengths: bool,
    max_batch_seconds: Option<f64>,
    buckets: usize,
) -> PyResult<Loader> {
    // In length-aware batches a clip is cropped only past the batch cap.
    let window = max_batch_seconds.unwrap_or(seconds);
    let recipe = AudioRecipe {
        random_crop: train && max_batch_seconds.is_none(),
        ..AudioRecipe::with_seconds(rate, window).map_err(invalid)?
    }
    .with_seed(options.seed);
    recipe.validate().map_err(invalid)?;
    let recipe = Recipe::audio(recipe).map_err(invalid)?;
    options.loader(paths, recipe, |b| match max_batch_seconds {
        Some(cap) => b.length_batches(cap, buckets),
        None => b.lengths(return_lengths),
    })
}

/// A video loader (see `flowgate.VideoLoader`; feature `video`): `frames` frames per clip,
/// and with `audio_seconds` the clip's audio track too. With `max_batch_frames`, length-aware
/// batches: each clip's frames at `fps` as its length allows (at most `max_batch_frames`),
/// batches of similar lengths padded to their longest clip, at most `max_batch_frames` padded
/// frames each, with lengths.
#[cfg(feature = "video")]
#[pyfunction]
#[pyo3(signature = (paths, options, frames=8, resize=128, crop=112, layout="nthwc", threads=0,
    audio_seconds=None, audio_rate=16000, fps=None, max_batch_frames=None, buckets=flowgate::loader::DEFAULT_BUCKETS,
    stride=None, train=false, draft=false))]
#[allow(clippy::too_many_arguments)]
pub(crate) fn video_loader(
    paths: &Bound<'_, PyAny>,
    options: &Options,
    frames: usize,
    resize: u32,
    crop: u32,
    layout: &str,
    threads: usize,
    audio_seconds: Option<f64>,
    audio_rate: u32,
    fps: Option<f64>,
    max_batch_frames: Option<usize>,
    buckets: usize,
    stride: Option<usize>,
    train: bool,
    draft: bool,
) -> PyResult<Loader> {
    use flowgate::media::video::{Sampling, VideoLayout, VideoRecipe};
    let layout = choice(
        "layout",
        layout,
        &[("nthwc", VideoLayout::Nthwc), ("ncthw", VideoLayout::Ncthw)],
    )?;
    let sampling = match (max_batch_frames, fps) {
        (None, None) => match stride {
            Some(stride) => Sampling::Window {
                frames,
                stride,
                random: train,
            },
            None if train => {
                return Err(PyValueError::new_err(
                    "train draws a random window of `frames` frames `stride` apart: set stride",
                ))
            }
            None => Sampling::Uniform(frames),
        },
        (Some(_), Some(_)) if stride.is_some() => {
            return Err(PyValueError::new_err(
                "stride samples a window of `frames` frames; max_batch_frames samples at fps: \
                 choose one",
            ))
        }
        (None, Some(_)) => {
            return Err(PyValueError::new_err(
                "fps samples clips by their length for max_batch_frames; set both",
            ))
        }
        (Some(_), None) => {
            return Err(PyValueError::new_err(
                "max_batch_frames needs fps (the frames per second taken from each clip)",
            ))
        }
        (Some(_), Some(_)) if audio_seconds.is_some() || layout != VideoLayout::Nthwc => {
            return Err(PyValueError::new_err(
                "length-aware video batches (max_batch_frames) are frames only, in layout \
                 \"nthwc\" (no audio_seconds)",
            ))
        }
        (Some(max), Some(fps)) => Sampling::Rate { fps, max },
    };
    let recipe = VideoRecipe {
        sampling,
        resize,
        crop,
        layout,
        threads,
        draft,
        ..VideoRecipe::default()
    };
    let video = Recipe::video(recipe.clone())
        .map_err(invalid)?
        .with_seed(options.seed);
    let audio = audio_seconds
        .map(|seconds| AudioRecipe::with_seconds(audio_rate, seconds))
        .transpose()
        .map_err(invalid)?;
    options.loader(paths, video, |b| {
        let b = match max_batch_frames {
            Some(cap) => b.length_batches(cap as f64, buckets),
            None => b,
        };
        match audio {
            Some(a) => b.audio_track(a),
            None => b,
        }
    })
}
