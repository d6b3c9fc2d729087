//! The media loaders' constructors: the arguments every loader shares ([`Options`]) and one
//! function per modality, each building a validated [`Recipe`] that seeds augmentation by
//! flowgate's one rule (seed, epoch, file).

use std::path::PathBuf;
use std::sync::Arc;

use flowgate::media::audio::AudioRecipe;
use flowgate::media::image::{ImageRecipe, Layout, Normalize, RandomCrop};
use flowgate::media::{Files, Recipe, RecipeError};
use flowgate::Tensor;
use pyo3::exceptions::PyValueError;
use pyo3::prelude::*;

use crate::collated::Extras;
use crate::dataset::{deal, files_of, parquet_of, shards_of, Dataset, Decode, Input, Records};
use crate::device::Device;
use crate::loader::Loader;
use flowgate::sampler::{MixStop, Sampler};

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
    skip_errors: bool,
    labels: Option<Py<PyAny>>,
    return_paths: bool,
    memory_mb: Option<f64>,
    device: String,
    device_memory_mb: Option<f64>,
}

#[pymethods]
impl Options {
    #[new]
    #[pyo3(signature = (batch_size=32, shuffle=true, seed=0, rank=None, world_size=None,
        drop_last=false, workers=None, skip_errors=true, labels=None, return_paths=false,
        memory_mb=None, device="cpu".to_owned(), device_memory_mb=None))]
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
        memory_mb: Option<f64>,
        device: String,
        device_memory_mb: Option<f64>,
    ) -> PyResult<Self> {
        for (name, v) in [
            ("memory_mb", memory_mb),
            ("device_memory_mb", device_memory_mb),
        ] {
            if v.is_some_and(|m| !(m > 0.0 && m.is_finite())) {
                return Err(PyValueError::new_err(format!(
                    "{name} must be a positive number of MiB"
                )));
            }
        }
        Ok(Self {
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
            memory_mb,
            device,
            device_memory_mb,
        })
    }
}

impl Options {
    /// The samples of a `flowgate.Shards` or `flowgate.Parquet` (`None` for anything else),
    /// with `label` the field holding each sample's label. A `whole` one (a mixture's part) is
    /// neither shuffled nor dealt to ranks: the mixture does both.
    fn records(
        &self,
        paths: &Bound<'_, PyAny>,
        extensions: &[&str],
        label: Option<String>,
        whole: bool,
    ) -> PyResult<Option<Dataset>> {
        let (shuffle, rank, world_size) = if whole {
            (false, Some(0), Some(1))
        } else {
            (self.shuffle, self.rank, self.world_size)
        };
        if paths.hasattr("_flowgate_parquet")? {
            let files: Vec<PathBuf> = paths.getattr("paths")?.extract()?;
            let column: String = paths.getattr("column")?.extract()?;
            let buffer: usize = paths.getattr("buffer")?.extract()?;
            let mut columns = vec![column.as_str()];
            if let Some(l) = &label {
                columns.push(l.as_str());
            }
            let endpoint: Option<String> = paths.getattr("endpoint")?.extract()?;
            let rows = parquet_of(
                files,
                endpoint,
                &columns,
                buffer,
                shuffle,
                self.seed,
                rank,
                world_size,
                self.drop_last,
            )?;
            return Ok(Some(Dataset::Records {
                records: Records::Parquet(rows),
                media: [column.clone()].into(),
                label,
            }));
        }
        if paths.hasattr("_flowgate_shards")? {
            let pattern: String = paths.getattr("pattern")?.extract()?;
            let buffer: usize = paths.getattr("buffer")?.extract()?;
            let fields: Option<Vec<String>> = paths.getattr("fields")?.extract()?;
            let remote = crate::dataset::Remote {
                endpoint: paths.getattr("endpoint")?.extract()?,
                cache_dir: paths.getattr("cache_dir")?.extract()?,
                cache_mb: paths.getattr("cache_mb")?.extract()?,
                prefetch: paths.getattr("prefetch")?.extract()?,
            };
            if whole && pattern.starts_with("s3://") {
                return Err(PyValueError::new_err(
                    "Mix: shards on S3 cannot be mixed yet (a mixture reads a source's samples \
                     in random order, which would refetch shards); mix local shards",
                ));
            }
            let shards = shards_of(
                &pattern,
                &remote,
                buffer,
                shuffle,
                self.seed,
                rank,
                world_size,
                self.drop_last,
            )?;
            let media =
                fields.unwrap_or_else(|| extensions.iter().map(|e| e.to_string()).collect());
            return Ok(Some(Dataset::Records {
                records: Records::Tar(shards),
                media: media.into_iter().map(|e| e.to_ascii_lowercase()).collect(),
                label: label.map(|l| l.to_ascii_lowercase()),
            }));
        }
        Ok(None)
    }

    /// `files` (in dataset order, the whole dataset) planned into length-aware batches of at
    /// most `plan.cap` padded units (seconds, frames), from the lengths their containers
    /// declare.
    fn length_batches(&self, files: Files, plan: &LengthPlan) -> PyResult<Dataset> {
        use flowgate::sampler::{Bucketing, LengthBatches};
        let bad = |m: String| PyValueError::new_err(m);
        let cap = plan.cap;
        if !(cap.is_finite() && cap > 0.0) {
            return Err(bad(format!("{} must be above 0, not {cap}", plan.arg)));
        }
        let mut lengths = Vec::with_capacity(files.len());
        for p in files.paths() {
            let d = (plan.length)(p).map_err(|e| bad(e.to_string()))?;
            lengths.push(d.ok_or_else(|| {
                bad(format!(
                    "{}: the file does not declare its length, which {} plans with",
                    p.display(),
                    plan.arg
                ))
            })?);
        }
        let mut batches =
            LengthBatches::new(lengths, cap, Bucketing::Quantiles(plan.buckets.max(1)))
                .map_err(|e| bad(e.to_string()))?;
        let mut sampler = batches.sampler();
        if self.shuffle {
            batches = batches.shuffle(self.seed);
            sampler = sampler.shuffle(self.seed);
        }
        Ok(Dataset::Batches {
            files,
            plan: Arc::new(batches),
            sampler: deal(sampler, self.rank, self.world_size, self.drop_last)?,
        })
    }

    /// A loader of the files `paths` names (a directory walked for `extensions`, a list file
    /// or a sequence), or of the samples of a `flowgate.Shards`, each decoded by `decode`.
    fn loader(
        &self,
        paths: &Bound<'_, PyAny>,
        extensions: &[&str],
        decode: Decode,
    ) -> PyResult<Loader> {
        self.loader_with(paths, extensions, decode, None, None)
    }

    /// [`loader`](Self::loader), in length-aware batches when `length_batches` says how, and
    /// with the decoder threads per item the tuner sets when `item_threads` is the recipe's
    /// knob (see `Recipe::item_threads`).
    fn loader_with(
        &self,
        paths: &Bound<'_, PyAny>,
        extensions: &[&str],
        decode: Decode,
        length_batches: Option<LengthPlan>,
        item_threads: Option<Arc<flowgate::actors::cache::ItemThreads>>,
    ) -> PyResult<Loader> {
        let labels = self.labels.as_ref().map(|l| l.bind(paths.py()));
        let label_field = || -> PyResult<Option<String>> {
            labels
                .map(|l| {
                    l.extract::<String>().map_err(|_| {
                        PyValueError::new_err(
                            "with Shards, Parquet or Mix, labels names the field that holds \
                             each sample's label (an extension such as \"cls\", or a column)",
                        )
                    })
                })
                .transpose()
        };
        let dataset = if paths.hasattr("_flowgate_mix")? {
            let sources: Vec<Bound<'_, PyAny>> = paths.getattr("sources")?.extract()?;
            let weights: Vec<f64> = paths.getattr("weights")?.extract()?;
            let draws: Option<usize> = paths.getattr("draws")?.extract()?;
            let stop: String = paths.getattr("stop")?.extract()?;
            let per_source: Option<Vec<Option<String>>> = paths.getattr("labels")?.extract()?;
            let common = if per_source.is_none() {
                label_field()?
            } else {
                None
            };
            let mut parts = Vec::with_capacity(sources.len());
            for (k, src) in sources.iter().enumerate() {
                let label = match &per_source {
                    Some(l) => l[k].clone(),
                    None => common.clone(),
                };
                parts.push(self.records(src, extensions, label, true)?.ok_or_else(|| {
                    PyValueError::new_err(format!(
                        "Mix: sources[{k}] is not a flowgate.Shards or flowgate.Parquet"
                    ))
                })?);
            }
            let with_labels = parts.iter().filter(|p| p.has_label()).count();
            if with_labels != 0 && with_labels != parts.len() {
                return Err(PyValueError::new_err(
                    "Mix: every source needs a label field, or none (labels=[...] names one \
                     per source)",
                ));
            }
            let stop = match (draws, stop.as_str()) {
                (Some(n), _) => MixStop::Draws(n),
                (None, "first") => MixStop::FirstExhausted,
                (None, "all") => MixStop::AllExhausted,
                (None, other) => {
                    return Err(PyValueError::new_err(format!(
                        "Mix: stop must be \"first\" or \"all\", not {other:?}"
                    )))
                }
            };
            let lengths: Vec<usize> = parts.iter().map(Dataset::items).collect();
            let bad = |e: flowgate::PipelineError| PyValueError::new_err(e.to_string());
            let mut sampler = Sampler::mixture(&lengths, &weights, stop).map_err(bad)?;
            if self.shuffle {
                sampler = sampler.shuffle(self.seed);
            }
            let sampler = deal(sampler, self.rank, self.world_size, self.drop_last)?;
            Dataset::Mix {
                parts: parts.into(),
                sampler,
            }
        } else if paths.hasattr("_flowgate_shards")? || paths.hasattr("_flowgate_parquet")? {
            self.records(paths, extensions, label_field()?, false)?
                .expect("shards or Parquet are records")
        } else {
            Dataset::Files(files_of(
                paths,
                extensions,
                self.shuffle,
                self.seed,
                self.rank,
                self.world_size,
                self.drop_last,
            )?)
        };
        // Length-aware batches: the files' declared lengths planned into batch slots, each
        // loaded as a whole batch (so the pipeline's batches are of one slot each).
        let (dataset, batch_size) = match (length_batches, dataset) {
            (None, d) => (d, self.batch_size),
            (Some(plan), Dataset::Files(files)) => (self.length_batches(files, &plan)?, 1),
            (Some(plan), _) => {
                return Err(PyValueError::new_err(format!(
                    "{} needs local files (a directory, a list or a sequence of paths), not \
                     Shards, Parquet or Mix",
                    plan.arg
                )))
            }
        };
        let extras = Extras::new(labels, &dataset, self.return_paths)?;
        let device = Device::open(&self.device, self.device_memory_mb)?;
        Loader::new(
            dataset,
            extras,
            decode,
            item_threads,
            batch_size,
            self.drop_last,
            self.workers,
            self.skip_errors,
            self.memory_mb.map(|m| (m * 1048576.0) as u64),
            device,
        )
    }
}

/// How a loader plans length-aware batches: at most `cap` padded units per batch over
/// `buckets` length buckets, each file's length (in those units) from `length`; `arg` names
/// the cap's argument in errors.
pub(crate) struct LengthPlan {
    cap: f64,
    buckets: usize,
    length: LengthOf,
    arg: &'static str,
}

type LengthOf = Box<dyn Fn(&std::path::Path) -> Result<Option<f64>, flowgate::media::MediaError>>;

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
    options.loader(
        paths,
        &["jpg", "jpeg", "png", "webp"],
        Arc::new(move |input, epoch| {
            let r = recipe.for_epoch(epoch);
            match input {
                Input::Path(p) => r.load(&p),
                Input::Bytes(b) => r.decode(b),
            }
            .map(|t| vec![t])
        }),
    )
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
    max_batch_seconds=None, buckets=20))]
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
    let return_lengths = return_lengths || max_batch_seconds.is_some();
    options.loader_with(
        paths,
        &["flac", "wav", "mp3", "ogg", "m4a"],
        Arc::new(move |input, epoch| {
            // The concrete recipe, for the clip's real length; seeded by the same rule.
            let r = recipe.for_epoch(epoch);
            let (t, len) = match input {
                Input::Path(p) => r.load_with_length(&p)?,
                Input::Bytes(b) => r.decode_with_length(b.bytes, &b.path)?,
            };
            Ok(if return_lengths {
                let len = i64::try_from(len).unwrap_or(i64::MAX);
                vec![t, Tensor::from_i64(&[len]).reshaped(&[])]
            } else {
                vec![t]
            })
        }),
        max_batch_seconds.map(|cap| LengthPlan {
            cap,
            buckets,
            length: Box::new(flowgate::media::audio::duration),
            arg: "max_batch_seconds",
        }),
        None,
    )
}

/// A video loader (see `flowgate.VideoLoader`; feature `video`): `frames` frames per clip,
/// and with `audio_seconds` the clip's audio track too. With `max_batch_frames`, length-aware
/// batches: each clip's frames at `fps` as its length allows (at most `max_batch_frames`),
/// batches of similar lengths padded to their longest clip, at most `max_batch_frames` padded
/// frames each, with lengths.
#[cfg(feature = "video")]
#[pyfunction]
#[pyo3(signature = (paths, options, frames=8, resize=128, crop=112, layout="nthwc", threads=0,
    audio_seconds=None, audio_rate=16000, fps=None, max_batch_frames=None, buckets=20,
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
    let item_threads = video.item_threads();
    if max_batch_frames.is_some() {
        let plan = recipe.clone();
        // Each clip of a batch decodes with the threads the tuner set (or the pinned ones).
        let knob = item_threads.clone();
        let threads = move || knob.as_ref().map_or(recipe.threads, |k| k.get());
        return options.loader_with(
            paths,
            &["mp4", "mkv", "webm", "mov", "avi"],
            Arc::new(move |input, _| {
                let (t, n) = match input {
                    Input::Path(p) => recipe.load_threaded(&p, threads())?,
                    Input::Bytes(b) => recipe.decode_threaded(&b.bytes, &b.path, threads())?,
                };
                Ok(vec![t, Tensor::from_i64(&[n as i64]).reshaped(&[])])
            }),
            max_batch_frames.map(|cap| LengthPlan {
                cap: cap as f64,
                buckets,
                length: Box::new(move |p| {
                    Ok(flowgate::media::video::duration(p)?.map(|d| plan.planned_frames(d) as f64))
                }),
                arg: "max_batch_frames",
            }),
            item_threads,
        );
    }
    options.loader_with(
        paths,
        &["mp4", "mkv", "webm", "mov", "avi"],
        Arc::new(move |input, epoch| {
            // Random windows are drawn anew every epoch (seed, epoch, file).
            let video = video.for_epoch(epoch);
            Ok(match input {
                Input::Path(p) => {
                    let mut fields = vec![video.load(&p)?];
                    if let Some(a) = &audio {
                        fields.push(a.load(&p)?);
                    }
                    fields
                }
                Input::Bytes(b) => {
                    let path = b.path.clone();
                    let track = audio.as_ref().map(|a| (a, b.bytes.clone()));
                    let mut fields = vec![video.decode(b)?];
                    if let Some((a, bytes)) = track {
                        fields.push(a.decode(bytes, &path)?);
                    }
                    fields
                }
            })
        }),
        None,
        item_threads,
    )
}
