//! A spec as the library's loader: the source as a [`Dataset`](crate::Dataset), the decode
//! table as a [`Recipe`], the batch, device, run and tuner tables as a
//! [`LoaderBuilder`](crate::loader::LoaderBuilder)'s settings. Nothing here reads data or
//! assembles a pipeline: [`crate::loader`] does, for pipeline files as for Rust and Python.

use std::path::Path;
use std::time::Duration;

use super::schema::*;
use crate::dataset::{Dataset, Files};
use crate::loader::Device;
use crate::media::Recipe;
use crate::{PolicyChoice, TunerSettings, Workers};

/// A spec's loader, with what it needs alive (a local S3 server) and the byte cache.
#[derive(Debug)]
pub struct Job {
    /// The loader: an epoch per [`start_epoch`](crate::Loader::start_epoch), batches whose
    /// first field is the decoded media (`[B, ...]`; length-aware batches add the lengths),
    /// in host memory or on the device `[device]` names.
    pub loader: crate::Loader,
    /// The cache of an S3 source, if the spec has one.
    pub cache: Option<crate::cache::ByteCache>,
    /// Items per epoch (this rank's; the clips of length-aware batches).
    pub items: usize,
    /// Whatever the source needs kept alive (a local S3 server).
    #[cfg_attr(not(feature = "s3"), allow(dead_code))]
    pub(super) _keep: Option<Box<dyn std::fmt::Debug + Send>>,
}

impl Job {
    /// Starts the next epoch and iterates the media of its batches (each batch's first
    /// field): what `flowgate run` consumes. Dropped before the end, the epoch is abandoned.
    pub fn epoch(
        &mut self,
    ) -> Result<
        impl Iterator<Item = Result<crate::device::Delivered, crate::PipelineError>> + '_,
        crate::PipelineError,
    > {
        Ok(self
            .loader
            .epoch()?
            .map(|b| b.map(|mut b| b.fields.swap_remove(0))))
    }

    /// The loader's statistics (see [`Loader::stats`](crate::Loader::stats)).
    pub fn stats(&self) -> crate::PipelineStats {
        self.loader.stats()
    }
}

/// Called with every tuner tick that changed something.
pub type DecisionHook = Box<dyn FnMut(&crate::TraceRecord) + Send>;
/// A callback with each item failure, as it happens (see
/// [`PipelineBuilder::on_failure`](crate::PipelineBuilder::on_failure)).
pub type FailureHook = Box<dyn Fn(&crate::ItemError) + Send + Sync>;

/// What to call while a spec's pipeline runs.
#[derive(Default)]
pub struct Hooks {
    /// Statistics, every `metrics.interval_ms`.
    pub on_stats: Option<crate::StatsCallback>,
    /// Tuner decisions.
    pub on_decision: Option<DecisionHook>,
    /// Item failures (skipped or not).
    pub on_failure: Option<FailureHook>,
}

impl std::fmt::Debug for Hooks {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Hooks")
            .field("on_stats", &self.on_stats.is_some())
            .field("on_decision", &self.on_decision.is_some())
            .field("on_failure", &self.on_failure.is_some())
            .finish()
    }
}

impl PipelineSpec {
    /// The augmentation seed: `decode.seed`, else the source's shuffle seed, else 0.
    pub fn augmentation_seed(&self) -> u64 {
        let decode = match &self.decode {
            DecodeSpec::Image { seed, .. } | DecodeSpec::Audio { seed, .. } => *seed,
            DecodeSpec::Video { .. } => None,
        };
        decode.or(self.shuffle_seed()).unwrap_or(0)
    }

    /// The decode recipe, validated, with the augmentation seed.
    #[cfg_attr(
        not(any(feature = "image", feature = "audio", feature = "video")),
        allow(unused_variables, unreachable_code)
    )]
    pub fn recipe(&self) -> Result<Recipe, crate::PipelineError> {
        #[cfg_attr(
            all(feature = "image", feature = "audio", feature = "video"),
            allow(unused_variables)
        )]
        let missing = |kind: &str, feature: &str| {
            crate::PipelineError::config(format!(
                "decode.kind = \"{kind}\" needs flowgate built with the `{feature}` feature"
            ))
        };
        let invalid = |e: crate::media::RecipeError| {
            crate::PipelineError::config_from(format!("decode.{}", e.field()), e)
        };
        let recipe: Result<Recipe, crate::media::RecipeError> = match &self.decode {
            #[cfg(feature = "image")]
            DecodeSpec::Image {
                resize,
                crop,
                layout,
                train,
                normalize,
                draft,
                ..
            } => {
                use crate::media::image::{ImageRecipe, Normalize};
                let base = if *train {
                    ImageRecipe::train(*crop)
                } else {
                    ImageRecipe::default()
                };
                Recipe::image(ImageRecipe {
                    resize: *resize,
                    crop: *crop,
                    layout: *layout,
                    normalize: normalize.then_some(Normalize::IMAGENET),
                    draft: *draft,
                    ..base
                })
            }
            #[cfg(not(feature = "image"))]
            DecodeSpec::Image { .. } => return Err(missing("image", "image")),
            #[cfg(feature = "audio")]
            DecodeSpec::Audio {
                rate,
                seconds,
                keep_channels,
                train,
                ..
            } => {
                use crate::media::audio::{AudioRecipe, Channels};
                // Length-aware batches crop a clip only past the batch cap.
                let window = self.batch.max_seconds.unwrap_or(*seconds);
                let base = AudioRecipe::with_seconds(*rate, window).map_err(invalid)?;
                Recipe::audio(AudioRecipe {
                    channels: if *keep_channels {
                        Channels::Keep
                    } else {
                        Channels::Mono
                    },
                    random_crop: *train && self.batch.max_seconds.is_none(),
                    ..base
                })
            }
            #[cfg(not(feature = "audio"))]
            DecodeSpec::Audio { .. } => return Err(missing("audio", "audio")),
            #[cfg(feature = "video")]
            DecodeSpec::Video {
                frames,
                resize,
                crop,
                threads,
                fps,
                stride,
                train,
                draft,
                ..
            } => Recipe::video(crate::media::video::VideoRecipe {
                sampling: match (fps, self.batch.max_frames, stride) {
                    (Some(fps), Some(max), _) => {
                        crate::media::video::Sampling::Rate { fps: *fps, max }
                    }
                    (_, _, Some(stride)) => crate::media::video::Sampling::Window {
                        frames: *frames,
                        stride: *stride,
                        random: *train,
                    },
                    _ => crate::media::video::Sampling::Uniform(*frames),
                },
                resize: *resize,
                crop: *crop,
                threads: *threads,
                draft: *draft,
                ..Default::default()
            }),
            #[cfg(not(feature = "video"))]
            DecodeSpec::Video { .. } => return Err(missing("video", "video")),
        };
        Ok(recipe.map_err(invalid)?.with_seed(self.augmentation_seed()))
    }

    /// The decode step alone, for one local file (what `flowgate profile` measures).
    pub fn item_decoder(
        &self,
    ) -> Result<
        impl Fn(&Path) -> Result<crate::Tensor, crate::media::MediaError> + Send + Sync + 'static,
        crate::PipelineError,
    > {
        let d = self.recipe()?;
        Ok(move |p: &Path| d.load(p))
    }

    /// Builds the loader: the source opened as a dataset, decoded by the recipe, batched,
    /// uploaded to the device the spec names, tuned as the spec says, calling `hooks` while it
    /// runs.
    pub fn build(&self, hooks: Hooks) -> Result<Job, crate::PipelineError> {
        let recipe = self.recipe()?;
        let (source, keep) = self.source(&self.source)?;
        // A pipeline file reads the whole dataset (`flowgate run` is one process), whatever
        // RANK and WORLD_SIZE say.
        let dataset = Dataset::builder(source)
            .extensions(&self.extensions(&recipe))
            .shuffle_seed(self.shuffle_seed())
            .ranks_from(crate::dataset::Ranks::Whole)
            .build()?;
        let items = dataset.len();
        let mut b = crate::Loader::builder(dataset, recipe)
            .batch_size(self.batch.size)
            .drop_last(self.batch.drop_last)
            .order(match self.batch.order {
                OrderName::Input => crate::Order::Input,
                OrderName::Completion => crate::Order::Completion,
            })
            .checkpoint_fields([("augmentation_seed", self.augmentation_seed())]);
        if let Some(cap) = self.length_cap() {
            b = b.length_batches(cap, self.batch.buckets);
        }
        if let Some(n) = self.fixed_workers() {
            b = b.workers(n);
        }
        if let Some(m) = self.run.max_failures {
            b = b.max_failures(match m {
                super::MaxFailures::Count(n) => crate::FailureBudget::count(n),
                super::MaxFailures::Rate(r) => crate::FailureBudget::rate(r),
            });
        }
        b = if self.tuner.enabled {
            b.autotune(self.tuner_settings())
        } else {
            b.autotune_off()
        };
        // The budgets are the loader's, tuner or not (`[tuner] enabled = false` keeps them).
        if let Some(m) = self.tuner.memory_mb {
            b = b.memory_budget(crate::limits::mib_to_bytes(m));
        }
        if let Some(c) = self.tuner.cpu_budget {
            b = b.cpu_budget(c);
        }
        if let Some(d) = self.device()? {
            b = b.device(d);
        }
        // The byte cache sits in front of an S3 prefix's fetches; other sources have none.
        let fetched = matches!(self.source, SourceSpec::S3 { .. });
        let cache = self.cache.as_ref().filter(|_| fetched).map(|c| {
            let mb = crate::limits::mib_to_bytes;
            crate::cache::ByteCache::new(mb(c.mb)).max_bytes(mb(c.max_mb.unwrap_or(4.0 * c.mb)))
        });
        if let Some(c) = &cache {
            b = b.cache(c.clone());
        }
        let interval = Duration::from_millis(self.metrics.interval_ms.unwrap_or(500));
        if let Some(f) = hooks.on_stats {
            b = b.on_stats(interval, f);
        }
        if let Some(f) = hooks.on_decision {
            b = b.on_tuner_decision(f);
        }
        if let Some(f) = hooks.on_failure {
            b = b.on_failure(f);
        }
        Ok(Job {
            loader: b.build()?,
            cache,
            items,
            _keep: keep,
        })
    }

    /// The device `[device]` asks for (`None` for `cpu`).
    pub fn device(&self) -> Result<Option<Device>, crate::PipelineError> {
        let d = &self.device;
        let device = match d.kind {
            DeviceKind::Cpu => return Ok(None),
            DeviceKind::Cuda => Device::cuda(d.ordinal).map_err(|e| {
                crate::PipelineError::config(format!("device.kind = \"cuda\": {e}"))
            })?,
            DeviceKind::Simulated => Device::simulated(
                d.bandwidth_gbps * 1e9,
                Duration::from_secs_f64(d.latency_us * 1e-6),
            ),
        };
        let mb = crate::limits::mib_to_bytes;
        Ok(Some(
            device
                .max_staging_bytes(mb(d.staging_mb) as usize)
                .max_device_bytes(mb(d.memory_mb)),
        ))
    }

    /// The tuner's settings.
    pub fn tuner_settings(&self) -> TunerSettings {
        TunerSettings {
            tick: self.tuner.tick_ms.map(Duration::from_millis),
            policy: match self.tuner.policy {
                PolicyName::Model => PolicyChoice::Model,
                PolicyName::HillClimb => PolicyChoice::HillClimb,
                PolicyName::Static => PolicyChoice::Static,
            },
            // The budgets enter as the loader's (see `build`), so they hold with the tuner
            // off too.
            trace: self.tuner.trace.clone(),
            ..TunerSettings::default()
        }
    }

    /// The decode stage's workers: fixed, or tuned from a start at the cores (`Workers::auto`).
    pub fn decode_workers(&self) -> Workers {
        self.fixed_workers().map_or(Workers::auto(), Workers::fixed)
    }

    /// `decode.workers`, when the spec fixes them.
    fn fixed_workers(&self) -> Option<usize> {
        match &self.decode {
            DecodeSpec::Image { workers, .. }
            | DecodeSpec::Audio { workers, .. }
            | DecodeSpec::Video { workers, .. } => *workers,
        }
    }

    /// The local files of a list or directory source (shuffled if asked).
    pub fn local_files(&self) -> Result<Option<Files>, crate::PipelineError> {
        if !matches!(
            self.source,
            SourceSpec::List { .. } | SourceSpec::Dir { .. }
        ) {
            return Ok(None);
        }
        let recipe = self.recipe()?;
        let (source, _) = self.source(&self.source)?;
        let dataset = Dataset::builder(source)
            .extensions(&self.extensions(&recipe))
            .shuffle_seed(self.shuffle_seed())
            .ranks_from(crate::dataset::Ranks::Whole)
            .build()?;
        Ok(dataset.files().cloned())
    }
}
