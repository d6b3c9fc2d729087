//! Building a running pipeline from a spec: source → (fetch →) decode → batch → collate.

use std::path::{Path, PathBuf};
use std::time::Duration;

use super::schema::*;
use crate::media::{Files, Recipe};
use crate::{PolicyChoice, TunerSettings, Workers};

/// A pipeline built from a spec, with what it needs alive (a local S3 server, the cache).
#[derive(Debug)]
pub struct Loader {
    /// Batches of decoded items, stacked along a new first axis.
    pub pipeline: crate::Pipeline<crate::Tensor>,
    /// The cache, if the spec has one.
    pub cache: Option<crate::cache::ByteCache>,
    /// Items per epoch.
    pub items: usize,
    /// Whatever the source needs kept alive (a local S3 server).
    #[cfg_attr(not(feature = "s3"), allow(dead_code))]
    pub(super) _keep: Option<Box<dyn std::fmt::Debug + Send>>,
}

/// Called with every tuner tick that changed something.
pub type DecisionHook = Box<dyn FnMut(&crate::TraceRecord) + Send>;

/// What to call while a spec's pipeline runs.
#[derive(Default)]
pub struct Hooks {
    /// Statistics, every `metrics.interval_ms`.
    pub on_stats: Option<crate::StatsCallback>,
    /// Tuner decisions.
    pub on_decision: Option<DecisionHook>,
}

impl std::fmt::Debug for Hooks {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Hooks")
            .field("on_stats", &self.on_stats.is_some())
            .field("on_decision", &self.on_decision.is_some())
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
        let shuffle = match &self.source {
            SourceSpec::List { shuffle, .. }
            | SourceSpec::Dir { shuffle, .. }
            | SourceSpec::Tar { shuffle, .. }
            | SourceSpec::Parquet { shuffle, .. }
            | SourceSpec::S3 { shuffle, .. } => *shuffle,
        };
        decode.or(shuffle).unwrap_or(0)
    }

    /// The decode recipe, validated, with the augmentation seed.
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
        let recipe = match &self.decode {
            #[cfg(feature = "image")]
            DecodeSpec::Image {
                resize,
                crop,
                layout,
                train,
                normalize,
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
                let base = AudioRecipe::with_seconds(*rate, *seconds).map_err(invalid)?;
                Recipe::audio(AudioRecipe {
                    channels: if *keep_channels {
                        Channels::Keep
                    } else {
                        Channels::Mono
                    },
                    random_crop: *train,
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
                ..
            } => Recipe::video(crate::media::video::VideoRecipe {
                sampling: crate::media::video::Sampling::Uniform(*frames),
                resize: *resize,
                crop: *crop,
                threads: *threads,
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

    /// Builds the pipeline: source → (fetch →) decode → batch → collate, tuned as the spec
    /// says, calling `hooks` while it runs.
    pub fn build(&self, hooks: Hooks) -> Result<Loader, crate::PipelineError> {
        use crate::{Pipeline, Tensor};
        let decoder = self.recipe()?;
        let interval = Duration::from_millis(self.metrics.interval_ms.unwrap_or(500));
        let batch = self.batch.size;
        let workers = self.decode_workers();
        let fields = [
            ("batch_size", batch.to_string()),
            ("drop_last", self.batch.drop_last.to_string()),
            ("augmentation_seed", self.augmentation_seed().to_string()),
        ];
        let finish = |b: crate::PipelineBuilder<Tensor>| {
            let mut b = b
                .batch(batch, self.batch.drop_last)
                .checkpoint_fields(fields);
            b = if self.tuner.enabled {
                b.autotune(self.tuner_settings())
            } else {
                b.autotune_off()
            };
            if let Some(f) = hooks.on_stats {
                b = b.on_stats(interval, f);
            }
            if let Some(f) = hooks.on_decision {
                b = b.on_tuner_decision(f);
            }
            b.build()
        };
        if let Some(files) = self.local_files()? {
            let items = files.len();
            let dataset = files.fingerprint();
            let load = decoder;
            let paths: std::sync::Arc<[PathBuf]> = files.paths().into();
            let pipeline = finish(
                Pipeline::builder()
                    .source_sampled(files.sampler().clone(), move |epoch, i| {
                        (paths[i].clone(), epoch)
                    })
                    .checkpoint_fields(dataset)
                    .describe(|(p, _)| p.display().to_string())
                    .pipe(
                        "decode",
                        move |(p, epoch): (PathBuf, u64)| load.for_epoch(epoch).load(&p),
                        workers,
                    ),
            )?;
            return Ok(Loader {
                pipeline,
                cache: None,
                items,
                _keep: None,
            });
        }
        if let Some((shards, exts)) = self.shards()? {
            let items = shards.len();
            let dataset = shards.fingerprint();
            let pipeline = finish(
                Pipeline::builder()
                    .source_sampled(shards.sampler().clone(), shards.refs())
                    .checkpoint_fields(dataset)
                    .describe(|r| r.to_string())
                    .pipe(
                        "decode",
                        move |r: crate::shards::SampleRef| r.read()?.decode_first(&exts, &decoder),
                        workers,
                    ),
            )?;
            return Ok(Loader {
                pipeline,
                cache: None,
                items,
                _keep: None,
            });
        }
        if let SourceSpec::Parquet {
            path,
            column,
            shuffle,
            buffer,
        } = &self.source
        {
            #[cfg(feature = "parquet")]
            {
                let files = crate::parquet::ParquetRows::files_at(path)?;
                let mut rows =
                    crate::parquet::ParquetRows::open(files, &[column.as_str()])?.buffer(*buffer);
                if let Some(seed) = shuffle {
                    rows = rows.shuffle(*seed);
                }
                let items = rows.len();
                let (read, names) = (rows.clone(), rows.clone());
                let column = [column.clone()];
                let pipeline = finish(
                    Pipeline::builder()
                        .source_sampled(rows.sampler().clone(), rows.refs())
                        .checkpoint_fields(rows.fingerprint())
                        .reserve_memory("the Parquet row-group cache", rows.cache_bytes())
                        .describe(move |&(_, i): &(u64, usize)| names.name(i))
                        .pipe(
                            "decode",
                            move |(epoch, i): (u64, usize)| {
                                read.read(epoch, i)?.decode_first(&column, &decoder)
                            },
                            workers,
                        ),
                )?;
                return Ok(Loader {
                    pipeline,
                    cache: None,
                    items,
                    _keep: None,
                });
            }
            #[cfg(not(feature = "parquet"))]
            {
                let _ = (path, column, shuffle, buffer, decoder, finish);
                return Err(crate::PipelineError::config(
                    "source.kind = \"parquet\" needs flowgate built with the `parquet` feature"
                        .to_owned(),
                ));
            }
        }
        #[cfg(feature = "s3")]
        {
            super::s3::build(self, decoder, workers, finish)
        }
        #[cfg(not(feature = "s3"))]
        {
            let _ = (decoder, finish);
            Err(crate::PipelineError::config(
                "source.kind = \"s3\" needs flowgate built with the `s3` feature".to_owned(),
            ))
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
            memory_bytes: self.tuner.memory_mb.map(|m| (m * 1048576.0) as u64),
            trace: self.tuner.trace.clone(),
            ..TunerSettings::default()
        }
    }

    /// The decode stage's workers: fixed, or tuned from one.
    pub fn decode_workers(&self) -> Workers {
        let w = match &self.decode {
            DecodeSpec::Image { workers, .. }
            | DecodeSpec::Audio { workers, .. }
            | DecodeSpec::Video { workers, .. } => *workers,
        };
        w.map_or(Workers::initial(1), Workers::fixed)
    }

    /// The shards of a tar source (shuffled and buffered as asked) and the extensions of the
    /// field to decode.
    pub fn shards(
        &self,
    ) -> Result<Option<(crate::shards::Shards, Vec<String>)>, crate::PipelineError> {
        let SourceSpec::Tar {
            shards,
            fields,
            shuffle,
            buffer,
            endpoint,
            region,
            cache_mb,
            cache_dir,
            prefetch,
        } = &self.source
        else {
            return Ok(None);
        };
        let s = if shards.starts_with("s3://") {
            #[cfg(feature = "s3")]
            {
                use crate::shards::remote::{Endpoint, RemoteOptions};
                let mut opts = RemoteOptions {
                    cache_bytes: (cache_mb.max(0.0) * 1048576.0) as u64,
                    ..RemoteOptions::default()
                };
                if let Some(d) = cache_dir {
                    opts.cache_dir = d.clone();
                }
                let endpoint = Endpoint {
                    url: endpoint.clone(),
                    region: region.clone(),
                };
                crate::shards::Shards::open_url(shards, &endpoint, &opts)?
            }
            #[cfg(not(feature = "s3"))]
            {
                let _ = (endpoint, region, cache_mb, cache_dir);
                return Err(crate::PipelineError::config(format!(
                    "source.shards = {shards:?} needs flowgate built with the `s3` feature"
                )));
            }
        } else {
            crate::shards::Shards::open(shards)?
        };
        let mut s = s.prefetch(*prefetch).buffer(*buffer);
        if let Some(seed) = shuffle {
            s = s.shuffle(*seed);
        }
        let exts: Vec<String> = if fields.is_empty() {
            let d: &[&str] = match &self.decode {
                DecodeSpec::Image { .. } => &["jpg", "jpeg", "png", "webp"],
                DecodeSpec::Audio { .. } => &["flac", "wav", "mp3", "ogg", "m4a"],
                DecodeSpec::Video { .. } => &["mp4", "mkv", "webm", "mov"],
            };
            d.iter().map(|e| e.to_string()).collect()
        } else {
            fields.iter().map(|e| e.to_ascii_lowercase()).collect()
        };
        Ok(Some((s, exts)))
    }

    /// The local files of a list or directory source (shuffled if asked).
    pub fn local_files(&self) -> Result<Option<Files>, crate::PipelineError> {
        let (files, shuffle) = match &self.source {
            SourceSpec::List { path, shuffle } => (Files::list(path)?, shuffle),
            SourceSpec::Dir {
                path,
                extensions,
                shuffle,
            } => {
                let ext: Vec<&str> = extensions.iter().map(String::as_str).collect();
                (Files::dir(path, &ext)?, shuffle)
            }
            SourceSpec::S3 { .. } | SourceSpec::Tar { .. } | SourceSpec::Parquet { .. } => {
                return Ok(None)
            }
        };
        Ok(Some(match shuffle {
            Some(seed) => files.shuffle(*seed),
            None => files,
        }))
    }
}
