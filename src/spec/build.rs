//! A spec as the library's loader: the source as a [`Dataset`](crate::Dataset), the decode
//! table as a [`Recipe`], the batch, device, run and tuner tables as a
//! [`LoaderBuilder`](crate::loader::LoaderBuilder)'s settings. Nothing here reads data or
//! assembles a pipeline: [`crate::loader`] does, for pipeline files as for Rust and Python.

use std::path::Path;
use std::time::Duration;

use flowgate_actors::error::{ItemError, PipelineError};
use flowgate_actors::failure::FailureBudget;
use flowgate_actors::tuner::{PolicyChoice, TraceRecord, TunerSettings};

use super::schema::*;
use crate::dataset::{Dataset, Files};
use crate::engine::config::Workers;
use crate::engine::stats::{PipelineStats, StatsCallback};
use crate::loader::{Device, Loader};
use crate::media::Recipe;
use crate::tensor::Tensor;

/// A spec's loader, with what it needs alive (a local S3 server) and the byte cache.
#[derive(Debug)]
pub struct Job {
    /// The loader: an epoch per [`start_epoch`](crate::Loader::start_epoch), batches whose
    /// first field is the decoded media (`[B, ...]`; length-aware batches add the lengths),
    /// in host memory or on the device `[device]` names.
    pub loader: Loader,
    /// The cache of an S3 source, if the spec has one.
    pub cache: Option<crate::byte_cache::ByteCache>,
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
        impl Iterator<Item = Result<crate::device::Delivered, PipelineError>> + '_,
        PipelineError,
    > {
        Ok(self
            .loader
            .epoch()?
            .map(|b| b.map(|mut b| b.fields.swap_remove(0))))
    }

    /// The loader's statistics (see [`Loader::stats`](crate::Loader::stats)).
    pub fn stats(&self) -> PipelineStats {
        self.loader.stats()
    }
}

/// Called with every tuner tick that changed something.
pub type DecisionHook = Box<dyn FnMut(&TraceRecord) + Send>;
/// A callback with each item failure, as it happens (see
/// [`PipelineBuilder::on_failure`](crate::PipelineBuilder::on_failure)).
pub type FailureHook = Box<dyn Fn(&ItemError) + Send + Sync>;

/// What to call while a spec's pipeline runs.
#[derive(Default)]
pub struct Hooks {
    /// Statistics, every `metrics.interval_ms`.
    pub on_stats: Option<StatsCallback>,
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
    /// Items per batch: `loader.batch_size`, else the library's default for the media
    /// ([`default_batch_size`](crate::loader::default_batch_size)).
    pub fn batch_size(&self) -> usize {
        self.loader
            .batch_size
            .unwrap_or_else(|| crate::loader::default_batch_size(&self.decode.media))
    }

    /// The augmentation seed: `decode.seed`, else the loader's `seed` (as every front end's).
    pub fn augmentation_seed(&self) -> u64 {
        self.decode.media.seed().unwrap_or(self.loader.seed)
    }

    /// The decode recipe, validated, with the augmentation seed: the media's own rules
    /// ([`MediaArgs::recipe`](crate::media::MediaArgs::recipe)), errors named by their key.
    pub fn recipe(&self) -> Result<Recipe, PipelineError> {
        self.decode
            .media
            .recipe(self.length_cap(), self.augmentation_seed())
            .map_err(|e| PipelineError::config_from(format!("decode.{}", e.field()), e))
    }

    /// The decode step alone, for one local file (what `flowgate profile` measures).
    pub fn item_decoder(
        &self,
    ) -> Result<
        impl Fn(&Path) -> Result<Tensor, crate::media::MediaError> + Send + Sync + 'static,
        PipelineError,
    > {
        let d = self.recipe()?;
        Ok(move |p: &Path| d.load(p))
    }

    /// Builds the loader: the source opened as a dataset, decoded by the recipe, batched,
    /// uploaded to the device the spec names, tuned as the spec says, calling `hooks` while it
    /// runs.
    pub fn build(&self, hooks: Hooks) -> Result<Job, PipelineError> {
        let settings = self.loader_settings();
        let recipe = self.recipe()?;
        let (source, keep) = self.source(&self.source)?;
        let (source, media_fields) = match &self.fields {
            Some(f) => {
                let (fields, media) =
                    crate::loader::fields_and_media(f.clone()).map_err(PipelineError::config)?;
                (source.extra_fields(fields), media)
            }
            None => (source, Vec::new()),
        };
        let conflict = |e: crate::loader::SettingsError| PipelineError::config(e.to_string());
        // A pipeline file reads the whole dataset (`flowgate run` is one process), whatever
        // RANK and WORLD_SIZE say, unless `loader.rank` and `loader.world_size` name a share.
        let ranks = match settings.rank {
            Some(_) => settings.ranks().map_err(conflict)?,
            None => crate::dataset::Ranks::Whole,
        };
        let dataset = settings
            .dataset(source, &recipe)
            .map_err(conflict)?
            .ranks_from(ranks)
            .build()?;
        let items = dataset.len();
        let mut b = settings
            .builder(dataset, recipe, &self.decode.media)
            .map_err(conflict)?
            .checkpoint_fields([("augmentation_seed", self.augmentation_seed())]);
        for m in &media_fields {
            let recipe = settings.field_recipe(m).map_err(conflict)?;
            b = b.media_field(&m.name, recipe);
        }
        if let Some(m) = self.run.max_failures {
            b = b.max_failures(match m {
                super::MaxFailures::Count(n) => FailureBudget::count(n),
                super::MaxFailures::Rate(r) => FailureBudget::rate(r),
            });
        }
        b = if self.tuner.enabled {
            b.autotune(self.tuner_settings())
        } else {
            b.autotune_off()
        };
        if let Some(d) = self.device()? {
            b = b.device(d);
        }
        // The byte cache sits in front of an S3 prefix's fetches; other sources have none.
        let fetched = matches!(self.source, SourceSpec::S3 { .. });
        let cache = self.cache.as_ref().filter(|_| fetched).map(|c| {
            let mb = flowgate_actors::limits::mib_to_bytes;
            crate::byte_cache::ByteCache::new(mb(c.mb))
                .max_bytes(mb(c.max_mb.unwrap_or(4.0 * c.mb)))
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
    pub fn device(&self) -> Result<Option<Device>, PipelineError> {
        let d = &self.device;
        let device = match d.kind {
            DeviceKind::Cpu => return Ok(None),
            DeviceKind::Cuda => Device::cuda(d.ordinal)
                .map_err(|e| PipelineError::config(format!("device.kind = \"cuda\": {e}")))?,
            DeviceKind::Simulated => Device::simulated(
                d.bandwidth_gbps * 1e9,
                Duration::from_secs_f64(d.latency_us * 1e-6),
            ),
        };
        let mb = flowgate_actors::limits::mib_to_bytes;
        Ok(Some(
            device
                .max_staging_bytes(mb(d.staging_mb) as usize)
                .max_device_bytes(mb(d.memory_mb)),
        ))
    }

    /// The loader's settings this file names (`[loader]`, the older keys read into it), its
    /// batch size the media's default where not given (the budgets are the loader's, so they
    /// hold with the tuner off too).
    pub fn loader_settings(&self) -> crate::loader::LoaderSettings {
        crate::loader::LoaderSettings {
            batch_size: Some(self.batch_size()),
            ..self.loader.clone()
        }
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

    /// `loader.workers`, when the spec fixes them.
    fn fixed_workers(&self) -> Option<usize> {
        self.loader.workers
    }

    /// The local files of a list or directory source (shuffled if asked).
    pub fn local_files(&self) -> Result<Option<Files>, PipelineError> {
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
