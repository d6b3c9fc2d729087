//! Building a running pipeline from a spec: source → (fetch →) decode → batch → collate.

use std::path::{Path, PathBuf};
use std::time::Duration;

use super::schema::*;
use crate::device::{Cuda, Delivered, Simulated, Uploader};
use crate::media::{Files, Recipe};
use crate::{PolicyChoice, Tensor, TunerSettings, Workers};

/// A pipeline built from a spec, with what it needs alive (a local S3 server, the cache).
#[derive(Debug)]
pub struct Loader {
    /// Batches of decoded items, stacked along a new first axis: in host memory, or on the
    /// device `[device]` names.
    pub pipeline: crate::Pipeline<Delivered>,
    /// The cache, if the spec has one.
    pub cache: Option<crate::cache::ByteCache>,
    /// Items per epoch.
    pub items: usize,
    /// Whatever the source needs kept alive (a local S3 server).
    #[cfg_attr(not(feature = "s3"), allow(dead_code))]
    pub(super) _keep: Option<Box<dyn std::fmt::Debug + Send>>,
}

/// Decoded items of one local source by (epoch, index).
type ReadFn =
    std::sync::Arc<dyn Fn(u64, usize) -> Result<crate::Tensor, crate::BoxError> + Send + Sync>;

/// A local source, ready to read: its sampler, what its checkpoints depend on, memory it
/// reserves, and how to read and name an item.
pub(super) struct Reader {
    pub(super) sampler: crate::sampler::Sampler,
    pub(super) items: usize,
    pub(super) fingerprint: Vec<(&'static str, String)>,
    pub(super) reserve: Vec<(String, u64)>,
    pub(super) read: ReadFn,
    pub(super) name: std::sync::Arc<dyn Fn(usize) -> String + Send + Sync>,
    /// Shards on S3: the prefetch, for the tuner to deepen.
    pub(super) read_ahead: Option<ReadAheadRef>,
}

/// The decode stage's knobs: its workers, the read-ahead it reads from and the recipe's
/// threads per item ([`Recipe::item_threads`](crate::media::Recipe::item_threads)).
pub(super) type DecodeKnobs = (Workers, Option<ReadAheadRef>, ThreadsRef);

/// Threads per item the tuner sets (see `Recipe::item_threads`).
type ThreadsRef = Option<std::sync::Arc<crate::actors::cache::ItemThreads>>;

/// A read-ahead the tuner deepens (see `Shards::read_ahead`).
type ReadAheadRef = std::sync::Arc<dyn crate::actors::cache::ReadAheadControl>;

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
        let shuffle = match &self.source {
            SourceSpec::List { shuffle, .. }
            | SourceSpec::Dir { shuffle, .. }
            | SourceSpec::Tar { shuffle, .. }
            | SourceSpec::Parquet { shuffle, .. }
            | SourceSpec::Mix { shuffle, .. }
            | SourceSpec::S3 { shuffle, .. } => *shuffle,
        };
        decode.or(shuffle).unwrap_or(0)
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

    /// Builds the pipeline: source → (fetch →) decode → batch → collate (→ upload), tuned as
    /// the spec says, calling `hooks` while it runs.
    pub fn build(&self, hooks: Hooks) -> Result<Loader, crate::PipelineError> {
        use crate::Pipeline;
        let decoder = self.recipe()?;
        let workers = self.decode_workers();
        if let Some(r) = self.reader(&self.source, &decoder)? {
            let Reader {
                sampler,
                items,
                fingerprint,
                reserve,
                read,
                name,
                read_ahead,
            } = r;
            let mut b = Pipeline::builder()
                .source_sampled(sampler, |epoch, i| (epoch, i))
                .checkpoint_fields(fingerprint)
                .describe(move |&(_, i): &(u64, usize)| name(i));
            for (what, bytes) in reserve {
                b = b.reserve_memory(&what, bytes);
            }
            let pipeline = self.finish(
                b,
                move |(epoch, i): (u64, usize)| read(epoch, i),
                (workers, read_ahead, decoder.item_threads()),
                hooks,
            )?;
            return Ok(Loader {
                pipeline,
                cache: None,
                items,
                _keep: None,
            });
        }
        #[cfg(feature = "s3")]
        {
            super::s3::build(self, decoder, workers, hooks)
        }
        #[cfg(not(feature = "s3"))]
        {
            let _ = (decoder, hooks, workers);
            Err(crate::PipelineError::config(
                "source.kind = \"s3\" needs flowgate built with the `s3` feature".to_owned(),
            ))
        }
    }

    /// The uploader `[device]` asks for (`None` for `cpu`).
    pub fn uploader(&self) -> Result<Option<Uploader>, crate::PipelineError> {
        let d = &self.device;
        let up = match d.kind {
            DeviceKind::Cpu => return Ok(None),
            DeviceKind::Cuda => Uploader::new(Cuda::new(d.ordinal).map_err(|e| {
                crate::PipelineError::config(format!("device.kind = \"cuda\": {e}"))
            })?),
            DeviceKind::Simulated => Uploader::new(Simulated::new(
                d.bandwidth_gbps * 1e9,
                Duration::from_secs_f64(d.latency_us * 1e-6),
            )),
        };
        let mb = |m: f64| (m * 1048576.0) as u64;
        Ok(Some(
            up.max_staging_bytes(mb(d.staging_mb) as usize)
                .max_device_bytes(mb(d.memory_mb)),
        ))
    }

    /// The stages after the source: decode with `decode` on `workers`, batch and collate
    /// (unless length-aware batches come whole from the decoder), upload to the device the
    /// spec names, and the run's settings (failure budget, tuner, hooks).
    pub(super) fn finish<X: Send + 'static>(
        &self,
        b: crate::PipelineBuilder<X>,
        decode: impl Fn(X) -> Result<Tensor, crate::BoxError> + Send + Sync + 'static,
        (workers, read_ahead, threads): DecodeKnobs,
        hooks: Hooks,
    ) -> Result<crate::Pipeline<Delivered>, crate::PipelineError> {
        // The decode stage reads what the read-ahead fetches: the tuner deepens it there. It
        // also decodes with the recipe's threads per item, which the tuner sets there.
        fn attach<T: Send + 'static>(
            b: crate::PipelineBuilder<T>,
            (r, t): (Option<ReadAheadRef>, ThreadsRef),
        ) -> crate::PipelineBuilder<T> {
            let b = match r {
                Some(r) => b.read_ahead(r),
                None => b,
            };
            match t {
                Some(t) => b.item_threads(t),
                None => b,
            }
        }
        let knobs = (read_ahead, threads);
        let size = self.batch.size;
        let drop_last = self.batch.drop_last;
        // Length-aware batches come whole from the decoder.
        let whole = self.length_cap().is_some();
        let uploader = self.uploader()?;
        // Batches are born where the uploader copies from directly (pinned memory on CUDA).
        let alloc = uploader.as_ref().map(Uploader::host_alloc);
        let collate = move |items: Vec<Tensor>| match &alloc {
            Some(a) => a.collate(&items),
            None => crate::collate::collate(&items),
        };
        let mut b = match uploader {
            None if whole => attach(
                b.pipe("decode", move |x| decode(x).map(Delivered::Host), workers),
                knobs,
            )
            .measure(Delivered::nbytes),
            None => attach(b.pipe("decode", decode, workers), knobs)
                .measure(Tensor::nbytes)
                .aggregate(size, drop_last)
                .pipe(
                    "collate",
                    move |items| collate(items).map(Delivered::Host),
                    1,
                )
                .measure(Delivered::nbytes),
            Some(up) => {
                let batches =
                    attach(b.pipe("decode", decode, workers), knobs).measure(Tensor::nbytes);
                let batches = if whole {
                    batches
                } else {
                    batches
                        .aggregate(size, drop_last)
                        .pipe("collate", collate, 1)
                        .measure(Tensor::nbytes)
                };
                batches.upload_with(
                    up,
                    |u, t| u.upload_owned(t).map(Delivered::Device),
                    Delivered::nbytes,
                )
            }
        };
        b = b.checkpoint_fields([
            ("batch_size", size.to_string()),
            ("drop_last", drop_last.to_string()),
            ("augmentation_seed", self.augmentation_seed().to_string()),
        ]);
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
        if self.device.kind == DeviceKind::Cuda {
            // The tuner counts the consumer as starved only while the GPU idles.
            if let Ok(m) = crate::device::GpuMonitor::new(self.device.ordinal as u32) {
                b = b.gpu_utilization(move || m.utilization());
            }
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
        b.build()
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

    /// The decode stage's workers: fixed, or tuned from a start at the cores (`Workers::auto`).
    pub fn decode_workers(&self) -> Workers {
        let w = match &self.decode {
            DecodeSpec::Image { workers, .. }
            | DecodeSpec::Audio { workers, .. }
            | DecodeSpec::Video { workers, .. } => *workers,
        };
        w.map_or(Workers::auto(), Workers::fixed)
    }

    /// A local source (files, shards, Parquet, or a mixture of them) as a reader of decoded
    /// items by (epoch, index); `None` for an S3 prefix (fetched through its own stage).
    fn reader(
        &self,
        source: &SourceSpec,
        decoder: &Recipe,
    ) -> Result<Option<Reader>, crate::PipelineError> {
        use std::sync::Arc;
        if let Some(cap) = self.length_cap() {
            let files = files_of(source)?.ok_or_else(|| {
                crate::PipelineError::config("length-aware batches need a list or dir source")
            })?;
            return self.length_batches(files, cap, decoder).map(Some);
        }
        if let Some(files) = files_of(source)? {
            let load = decoder.clone();
            let paths: Arc<[PathBuf]> = files.paths().into();
            let names = Arc::clone(&paths);
            return Ok(Some(Reader {
                items: files.len(),
                fingerprint: files.fingerprint(),
                sampler: files.sampler().clone(),
                reserve: Vec::new(),
                read: Arc::new(move |epoch, i| Ok(load.for_epoch(epoch).load(&paths[i])?)),
                name: Arc::new(move |i| names[i].display().to_string()),
                read_ahead: None,
            }));
        }
        if let Some((shards, exts)) = shards_of(source, &self.decode)? {
            #[cfg(feature = "s3")]
            let read_ahead = shards.read_ahead();
            #[cfg(not(feature = "s3"))]
            let read_ahead = None;
            let dec = decoder.clone();
            let refs = Arc::new(shards.refs());
            let names = Arc::clone(&refs);
            return Ok(Some(Reader {
                items: shards.len(),
                fingerprint: shards.fingerprint(),
                sampler: shards.sampler().clone(),
                reserve: Vec::new(),
                read: Arc::new(move |epoch, i| {
                    Ok(refs(epoch, i).read()?.decode_first(&exts, &dec)?)
                }),
                name: Arc::new(move |i| names(0, i).to_string()),
                read_ahead,
            }));
        }
        match source {
            SourceSpec::Parquet {
                path,
                column,
                shuffle,
                buffer,
                endpoint,
                region,
            } => {
                #[cfg(feature = "parquet")]
                {
                    use crate::parquet::ParquetRows;
                    let url = path.to_string_lossy();
                    let rows = if url.starts_with("s3://") {
                        #[cfg(feature = "s3")]
                        {
                            let endpoint = crate::shards::remote::Endpoint {
                                url: endpoint.clone(),
                                region: region.clone(),
                            };
                            ParquetRows::open_url(&url, &endpoint, &[column.as_str()])?
                        }
                        #[cfg(not(feature = "s3"))]
                        {
                            let _ = (endpoint, region);
                            return Err(crate::PipelineError::config(format!(
                                "source.path = {url:?} needs flowgate built with the `s3` feature"
                            )));
                        }
                    } else {
                        ParquetRows::open(ParquetRows::files_at(path)?, &[column.as_str()])?
                    };
                    let mut rows = rows.buffer(*buffer);
                    if let Some(seed) = shuffle {
                        rows = rows.shuffle(*seed);
                    }
                    let (dec, names) = (decoder.clone(), rows.clone());
                    let column = [column.clone()];
                    Ok(Some(Reader {
                        items: rows.len(),
                        fingerprint: rows.fingerprint(),
                        sampler: rows.sampler().clone(),
                        reserve: vec![("the Parquet row-group cache".into(), rows.cache_bytes())],
                        read: Arc::new(move |epoch, i| {
                            Ok(rows.read(epoch, i)?.decode_first(&column, &dec)?)
                        }),
                        name: Arc::new(move |i| names.name(i)),
                        read_ahead: None,
                    }))
                }
                #[cfg(not(feature = "parquet"))]
                {
                    let _ = (path, column, shuffle, buffer, endpoint, region);
                    Err(crate::PipelineError::config(
                        "source.kind = \"parquet\" needs flowgate built with the `parquet` feature",
                    ))
                }
            }
            SourceSpec::Mix {
                sources,
                weights,
                draws,
                stop,
                shuffle,
            } => {
                let mut parts = Vec::with_capacity(sources.len());
                for (k, sub) in sources.iter().enumerate() {
                    let local = match sub {
                        SourceSpec::Mix { .. } | SourceSpec::S3 { .. } => false,
                        SourceSpec::Tar { shards, .. } => !shards.starts_with("s3://"),
                        _ => true,
                    };
                    if !local {
                        return Err(crate::PipelineError::config(format!(
                            "source.sources[{k}]: a mixture mixes local sources (list, dir, \
                             tar, parquet); not S3 or another mixture"
                        )));
                    }
                    parts.push(self.reader(sub, decoder)?.expect("a local source reads"));
                }
                let lengths: Vec<usize> = parts.iter().map(|p| p.items).collect();
                let stop = match (draws, stop) {
                    (Some(n), _) => crate::sampler::MixStop::Draws(*n),
                    (None, MixStopName::First) => crate::sampler::MixStop::FirstExhausted,
                    (None, MixStopName::All) => crate::sampler::MixStop::AllExhausted,
                };
                let mut sampler = crate::sampler::Sampler::mixture(&lengths, weights, stop)?;
                if let Some(seed) = shuffle {
                    sampler = sampler.shuffle(*seed);
                }
                let mut fingerprint = sampler.fingerprint();
                let mut reserve = Vec::new();
                for (k, p) in parts.iter_mut().enumerate() {
                    let fields: Vec<String> = p
                        .fingerprint
                        .iter()
                        .map(|(f, v)| format!("{f}={v}"))
                        .collect();
                    fingerprint.push(("mixed_source", format!("{k}: {}", fields.join("; "))));
                    reserve.append(&mut p.reserve);
                }
                let parts: Arc<[Reader]> = parts.into();
                let (at, names) = (sampler.clone(), sampler.clone());
                let (read_parts, name_parts) = (Arc::clone(&parts), parts);
                Ok(Some(Reader {
                    items: sampler.global_len_of(0),
                    fingerprint,
                    sampler,
                    reserve,
                    read: Arc::new(move |epoch, i| {
                        let (s, j) = at.locate(i);
                        (read_parts[s].read)(epoch, j)
                    }),
                    name: Arc::new(move |i| {
                        let (s, j) = names.locate(i);
                        (name_parts[s].name)(j)
                    }),
                    read_ahead: None,
                }))
            }
            _ => Ok(None),
        }
    }

    /// The shards of a tar source (shuffled and buffered as asked) and the extensions of the
    /// field to decode.
    pub fn shards(
        &self,
    ) -> Result<Option<(crate::shards::Shards, Vec<String>)>, crate::PipelineError> {
        shards_of(&self.source, &self.decode)
    }

    /// The local files of a list or directory source (shuffled if asked).
    pub fn local_files(&self) -> Result<Option<Files>, crate::PipelineError> {
        files_of(&self.source)
    }
}

/// The shards of a tar source (shuffled and buffered as asked) and the extensions of the
/// field to decode (`decode`'s kind's, unless the source names them).
fn shards_of(
    source: &SourceSpec,
    decode: &DecodeSpec,
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
    } = source
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
        let d: &[&str] = match decode {
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
fn files_of(source: &SourceSpec) -> Result<Option<Files>, crate::PipelineError> {
    let (files, shuffle) = match source {
        SourceSpec::List { path, shuffle } => (Files::list(path)?, shuffle),
        SourceSpec::Dir {
            path,
            extensions,
            shuffle,
        } => {
            let ext: Vec<&str> = extensions.iter().map(String::as_str).collect();
            (Files::dir(path, &ext)?, shuffle)
        }
        SourceSpec::S3 { .. }
        | SourceSpec::Tar { .. }
        | SourceSpec::Parquet { .. }
        | SourceSpec::Mix { .. } => return Ok(None),
    };
    Ok(Some(match shuffle {
        Some(seed) => files.shuffle(*seed),
        None => files,
    }))
}
