//! Declarative pipelines (feature `cli`): a TOML file that says where the data is, how to
//! decode and batch it, what the training step costs, and how to tune, which
//! [`PipelineSpec::build`] turns into a running pipeline (what `flowgate run` does).
//!
//! ```toml
//! [source]
//! kind = "list"                  # list | dir | s3
//! path = "target/sample-data/images.txt"
//! shuffle = 0                    # a seed: reshuffled every epoch (omit for file order)
//!
//! [decode]
//! kind = "image"                 # image | audio | video
//! resize = 256
//! crop = 224
//!
//! [batch]
//! size = 32
//!
//! [run]
//! epochs = 2
//! step_ms = 1.0                  # a simulated training step per batch
//! ```
//!
//! Every table rejects unknown keys, and every error names the key and its line
//! ([`SpecError`]). Relative paths are relative to the working directory.

use std::path::{Path, PathBuf};
use std::time::Duration;

use serde::Deserialize;

use crate::media::Files;
use crate::{PolicyChoice, TunerSettings, Workers};

/// A pipeline described in a file.
#[derive(Clone, Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct PipelineSpec {
    /// Where the items come from.
    pub source: SourceSpec,
    /// How each item is decoded.
    pub decode: DecodeSpec,
    /// Batching.
    #[serde(default)]
    pub batch: BatchSpec,
    /// An in-memory byte cache in front of the fetch (S3 sources).
    #[serde(default)]
    pub cache: Option<CacheSpec>,
    /// Where batches go.
    #[serde(default)]
    pub device: DeviceSpec,
    /// Epochs and the simulated training step.
    #[serde(default)]
    pub run: RunSpec,
    /// The tuner.
    #[serde(default)]
    pub tuner: TunerSpec,
    /// Metrics export.
    #[serde(default)]
    pub metrics: MetricsSpec,
}

/// Where the items come from.
#[derive(Clone, Debug, Deserialize)]
#[serde(tag = "kind", rename_all = "lowercase", deny_unknown_fields)]
pub enum SourceSpec {
    /// A text file with one path per line.
    List {
        /// The list file.
        path: PathBuf,
        /// Shuffle with this seed, anew every epoch.
        #[serde(default)]
        shuffle: Option<u64>,
    },
    /// Every file under a directory with one of `extensions`.
    Dir {
        /// The directory.
        path: PathBuf,
        /// Extensions to keep (without the dot).
        extensions: Vec<String>,
        /// Shuffle with this seed, anew every epoch.
        #[serde(default)]
        shuffle: Option<u64>,
    },
    /// The objects under a prefix of a bucket.
    S3 {
        /// The bucket.
        bucket: String,
        /// The key prefix.
        #[serde(default)]
        prefix: String,
        /// An S3-compatible endpoint (`http://host:port`); AWS when absent.
        #[serde(default)]
        endpoint: Option<String>,
        /// The region (else the AWS chain's, else `us-east-1`).
        #[serde(default)]
        region: Option<String>,
        /// Objects fetched at once (the tuner starts here).
        #[serde(default = "default_concurrency")]
        concurrency: usize,
        /// Shuffle with this seed, anew every epoch.
        #[serde(default)]
        shuffle: Option<u64>,
        /// Start a local S3-compatible server and upload the files of this list into the
        /// bucket first (for trying S3 without a store; needs `scripts/setup.sh --test`).
        #[serde(default)]
        serve_locally_from: Option<PathBuf>,
    },
}

fn default_concurrency() -> usize {
    16
}

/// How each item is decoded.
#[derive(Clone, Debug, Deserialize)]
#[serde(tag = "kind", rename_all = "lowercase", deny_unknown_fields)]
pub enum DecodeSpec {
    /// JPEG, PNG, WebP.
    Image {
        /// Shorter side after resizing (evaluation geometry).
        #[serde(default = "default_resize")]
        resize: u32,
        /// The output square's side.
        #[serde(default = "default_crop")]
        crop: u32,
        /// `nchw` or `nhwc`.
        #[serde(default)]
        layout: crate::media::image::Layout,
        /// Training geometry: random resized crops and flips, drawn anew every epoch.
        #[serde(default)]
        train: bool,
        /// `f32` normalised with ImageNet's statistics instead of `u8`.
        #[serde(default)]
        normalize: bool,
        /// Fixed decode workers; the tuner decides when absent.
        #[serde(default)]
        workers: Option<usize>,
    },
    /// WAV, FLAC, MP3, Vorbis, AAC, ALAC.
    Audio {
        /// Output sample rate (Hz); other rates are resampled.
        #[serde(default = "default_rate")]
        rate: u32,
        /// Seconds per clip (cropped or zero-padded).
        #[serde(default = "default_seconds")]
        seconds: f64,
        /// Keep every channel instead of mixing to mono.
        #[serde(default)]
        keep_channels: bool,
        /// A window at a random offset in each clip, drawn anew every epoch.
        #[serde(default)]
        train: bool,
        /// Fixed decode workers; the tuner decides when absent.
        #[serde(default)]
        workers: Option<usize>,
    },
    /// Video clips (needs the `video` feature).
    Video {
        /// Frames sampled uniformly per clip.
        #[serde(default = "default_frames")]
        frames: usize,
        /// Shorter side after scaling.
        #[serde(default = "default_video_resize")]
        resize: u32,
        /// The output square's side.
        #[serde(default = "default_video_crop")]
        crop: u32,
        /// Decoder threads per clip.
        #[serde(default = "one")]
        threads: usize,
        /// Fixed decode workers; the tuner decides when absent.
        #[serde(default)]
        workers: Option<usize>,
    },
}

fn default_resize() -> u32 {
    256
}
fn default_crop() -> u32 {
    224
}
fn default_rate() -> u32 {
    16_000
}
fn default_seconds() -> f64 {
    4.0
}
fn default_frames() -> usize {
    8
}
fn default_video_resize() -> u32 {
    128
}
fn default_video_crop() -> u32 {
    112
}
fn one() -> usize {
    1
}

/// Batching.
#[derive(Clone, Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct BatchSpec {
    /// Items per batch.
    #[serde(default = "default_batch")]
    pub size: usize,
    /// Drop a last, partial batch.
    #[serde(default)]
    pub drop_last: bool,
}

fn default_batch() -> usize {
    32
}

impl Default for BatchSpec {
    fn default() -> Self {
        Self {
            size: default_batch(),
            drop_last: false,
        }
    }
}

/// A byte cache in front of the fetch.
#[derive(Clone, Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct CacheSpec {
    /// Starting capacity in MiB.
    pub mb: f64,
    /// The most the tuner may grow it to, in MiB (default 4× `mb`).
    #[serde(default)]
    pub max_mb: Option<f64>,
}

/// Where batches go.
#[derive(Clone, Debug, Default, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct DeviceSpec {
    /// `cpu` (the batches stay in host memory). `cuda` needs the CUDA uploader (issue #5).
    #[serde(default)]
    pub kind: DeviceKind,
}

/// A device kind.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum DeviceKind {
    /// Host memory.
    #[default]
    Cpu,
    /// An NVIDIA GPU (not available in this build).
    Cuda,
}

/// Epochs and the simulated training step.
#[derive(Clone, Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct RunSpec {
    /// Epochs to run.
    #[serde(default = "one_u64")]
    pub epochs: u64,
    /// Milliseconds of simulated training per batch (the consumer's step).
    #[serde(default)]
    pub step_ms: f64,
}

fn one_u64() -> u64 {
    1
}

impl Default for RunSpec {
    fn default() -> Self {
        Self {
            epochs: 1,
            step_ms: 0.0,
        }
    }
}

/// The tuner.
#[derive(Clone, Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct TunerSpec {
    /// Tune at all.
    #[serde(default = "yes")]
    pub enabled: bool,
    /// `model` (default), `hill-climb` or `static`.
    #[serde(default)]
    pub policy: PolicyName,
    /// Milliseconds between tuner ticks.
    #[serde(default)]
    pub tick_ms: Option<u64>,
    /// The memory budget of all buffers, MiB (default: half the available memory).
    #[serde(default)]
    pub memory_mb: Option<f64>,
    /// Write the decision trace (JSON lines) here.
    #[serde(default)]
    pub trace: Option<PathBuf>,
}

/// A shipped policy, by name.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Deserialize)]
#[serde(rename_all = "kebab-case")]
pub enum PolicyName {
    /// The model-based policy.
    #[default]
    Model,
    /// AIMD hill climbing.
    HillClimb,
    /// Observe and trace only.
    Static,
}

fn yes() -> bool {
    true
}

impl Default for TunerSpec {
    fn default() -> Self {
        Self {
            enabled: true,
            policy: PolicyName::default(),
            tick_ms: None,
            memory_mb: None,
            trace: None,
        }
    }
}

/// Metrics export.
#[derive(Clone, Debug, Default, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct MetricsSpec {
    /// Append a JSON line of pipeline statistics here every `interval_ms`.
    #[serde(default)]
    pub jsonl: Option<PathBuf>,
    /// Milliseconds between statistics lines and live-view updates (default 500).
    #[serde(default)]
    pub interval_ms: Option<u64>,
    /// Serve Prometheus metrics on this loopback address (`127.0.0.1:9898`; feature
    /// `prometheus`).
    #[serde(default)]
    pub prometheus: Option<String>,
}

/// A bad pipeline file: where, which key, what is wrong.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("{file}:{line}: {key}: {message}")]
pub struct SpecError {
    /// The file.
    pub file: String,
    /// The line (1-based; 0 when the file itself is the problem).
    pub line: usize,
    /// The key, dotted (`batch.size`), or the table for a missing one.
    pub key: String,
    /// What is wrong.
    pub message: String,
}

impl PipelineSpec {
    /// Reads and checks a pipeline file.
    pub fn load(path: &Path) -> Result<Self, SpecError> {
        let text = std::fs::read_to_string(path).map_err(|e| SpecError {
            file: path.display().to_string(),
            line: 0,
            key: String::new(),
            message: format!("cannot read: {e}"),
        })?;
        Self::parse(&text, &path.display().to_string())
    }

    /// Parses and checks the text of a pipeline file (`file` names it in errors).
    pub fn parse(text: &str, file: &str) -> Result<Self, SpecError> {
        let spec: PipelineSpec = toml::from_str(text).map_err(|e| {
            let line = e.span().map_or(0, |s| {
                text[..s.start.min(text.len())].matches('\n').count() + 1
            });
            let message = e.message().to_owned();
            let key = key_at(text, line).unwrap_or_else(|| {
                // A missing table or key: serde names it in the message.
                message
                    .split('`')
                    .nth(1)
                    .map_or_else(String::new, str::to_owned)
            });
            SpecError {
                file: file.to_owned(),
                line,
                key,
                message,
            }
        })?;
        spec.check(text, file)?;
        Ok(spec)
    }

    /// The numbers no pipeline can run with.
    fn check(&self, text: &str, file: &str) -> Result<(), SpecError> {
        let err = |table: &str, key: &str, message: String| SpecError {
            file: file.to_owned(),
            line: find_key(text, table, key),
            key: format!("{table}.{key}"),
            message,
        };
        if self.batch.size == 0 {
            return Err(err("batch", "size", "must be at least 1".into()));
        }
        if self.run.epochs == 0 {
            return Err(err("run", "epochs", "must be at least 1".into()));
        }
        if !(self.run.step_ms >= 0.0 && self.run.step_ms.is_finite()) {
            return Err(err("run", "step_ms", "must be a finite number ≥ 0".into()));
        }
        let workers = match &self.decode {
            DecodeSpec::Image {
                resize,
                crop,
                train,
                workers,
                ..
            } => {
                if *crop == 0 || (!train && crop > resize) {
                    return Err(err(
                        "decode",
                        "crop",
                        format!("must be in 1..={resize} (resize)"),
                    ));
                }
                workers
            }
            DecodeSpec::Audio {
                rate,
                seconds,
                workers,
                ..
            } => {
                if *rate == 0 {
                    return Err(err("decode", "rate", "must be at least 1 Hz".into()));
                }
                if !(*seconds > 0.0 && seconds.is_finite()) {
                    return Err(err("decode", "seconds", "must be more than 0".into()));
                }
                workers
            }
            DecodeSpec::Video {
                frames,
                resize,
                crop,
                threads,
                workers,
            } => {
                if *frames == 0 {
                    return Err(err("decode", "frames", "must be at least 1".into()));
                }
                if *crop == 0 || crop > resize {
                    return Err(err(
                        "decode",
                        "crop",
                        format!("must be in 1..={resize} (resize)"),
                    ));
                }
                if *threads == 0 {
                    return Err(err("decode", "threads", "must be at least 1".into()));
                }
                workers
            }
        };
        if *workers == Some(0) {
            return Err(err("decode", "workers", "must be at least 1".into()));
        }
        if let SourceSpec::S3 { concurrency, .. } = &self.source {
            if *concurrency == 0 {
                return Err(err("source", "concurrency", "must be at least 1".into()));
            }
        }
        if let Some(c) = &self.cache {
            if !(c.mb > 0.0 && c.mb.is_finite()) {
                return Err(err("cache", "mb", "must be more than 0".into()));
            }
            if c.max_mb.is_some_and(|m| !(m >= c.mb && m.is_finite())) {
                return Err(err("cache", "max_mb", "must be at least `mb`".into()));
            }
        }
        if let Some(m) = self.tuner.memory_mb {
            if !(m > 0.0 && m.is_finite()) {
                return Err(err("tuner", "memory_mb", "must be more than 0".into()));
            }
        }
        if self.tuner.tick_ms == Some(0) {
            return Err(err("tuner", "tick_ms", "must be at least 1".into()));
        }
        if self.metrics.interval_ms == Some(0) {
            return Err(err("metrics", "interval_ms", "must be at least 1".into()));
        }
        if let Some(addr) = &self.metrics.prometheus {
            match addr.parse::<std::net::SocketAddr>() {
                Ok(a) if a.ip().is_loopback() => {}
                Ok(_) => {
                    return Err(err(
                        "metrics",
                        "prometheus",
                        "must be a loopback address (127.0.0.1:PORT)".into(),
                    ))
                }
                Err(e) => return Err(err("metrics", "prometheus", format!("{e}"))),
            }
        }
        if self.device.kind == DeviceKind::Cuda {
            return Err(err(
                "device",
                "kind",
                "cuda needs the CUDA uploader, not in this build (use `cpu`)".into(),
            ));
        }
        Ok(())
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
            SourceSpec::S3 { .. } => return Ok(None),
        };
        Ok(Some(match shuffle {
            Some(seed) => files.shuffle(*seed),
            None => files,
        }))
    }
}

/// The dotted key on `line` (1-based): `table.key` from the nearest header above and the text
/// before `=`.
fn key_at(text: &str, line: usize) -> Option<String> {
    let lines: Vec<&str> = text.lines().collect();
    let here = lines.get(line.checked_sub(1)?)?.trim();
    let table = lines[..line - 1]
        .iter()
        .rev()
        .map(|l| l.trim())
        .find(|l| l.starts_with('['))
        .map(|l| l.trim_matches(|c| c == '[' || c == ']').trim().to_owned());
    if here.starts_with('[') {
        return Some(
            here.trim_matches(|c| c == '[' || c == ']')
                .trim()
                .to_owned(),
        );
    }
    let key = here.split('=').next()?.trim();
    if key.is_empty() {
        return None;
    }
    Some(match table {
        Some(t) => format!("{t}.{key}"),
        None => key.to_owned(),
    })
}

/// The line of `key` in `[table]` (1-based), or of the table's header, or 0.
fn find_key(text: &str, table: &str, key: &str) -> usize {
    let mut in_table = false;
    let mut header = 0;
    for (i, l) in text.lines().enumerate() {
        let t = l.trim();
        if t.starts_with('[') {
            in_table = t.trim_matches(|c| c == '[' || c == ']').trim() == table;
            if in_table {
                header = i + 1;
            }
            continue;
        }
        if in_table && t.split('=').next().map(str::trim) == Some(key) {
            return i + 1;
        }
    }
    header
}

#[cfg(test)]
mod tests {
    use super::*;

    const GOOD: &str = r#"
[source]
kind = "list"
path = "images.txt"

[decode]
kind = "image"
resize = 256
crop = 224

[batch]
size = 16
"#;

    #[test]
    fn a_good_file_parses_with_defaults() {
        let s = PipelineSpec::parse(GOOD, "p.toml").unwrap();
        assert_eq!(s.batch.size, 16);
        assert_eq!(s.run.epochs, 1);
        assert!(s.tuner.enabled);
    }

    fn error(text: &str) -> SpecError {
        PipelineSpec::parse(text, "p.toml").unwrap_err()
    }

    #[test]
    fn bad_files_name_the_key_and_line() {
        let e = error(&GOOD.replace("size = 16", "size = 16\nsise = 3"));
        assert_eq!((e.line, e.key.as_str()), (13, "batch.sise"), "{e}");
        assert!(e.message.contains("unknown field"), "{e}");
        let e = error(&GOOD.replace("size = 16", "size = \"many\""));
        assert_eq!((e.line, e.key.as_str()), (12, "batch.size"), "{e}");
        let e = error(&GOOD.replace("size = 16", "size = 0"));
        assert_eq!((e.line, e.key.as_str()), (12, "batch.size"), "{e}");
        let e = error(&GOOD.replace("crop = 224", "crop = 300"));
        assert_eq!((e.line, e.key.as_str()), (9, "decode.crop"), "{e}");
        let e = error(&GOOD.replace("kind = \"list\"\npath = \"images.txt\"\n", ""));
        assert!(e.to_string().contains("kind"), "{e}");
        let e = error("[decode]\nkind = \"image\"\n");
        assert!(e.message.contains("missing field `source`"), "{e}");
        let e = error(&format!(
            "{GOOD}\n[metrics]\nprometheus = \"0.0.0.0:9000\"\n"
        ));
        assert_eq!(e.key, "metrics.prometheus", "{e}");
        let e = error(&GOOD.replace("kind = \"image\"", "kind = \"hologram\""));
        assert_eq!(e.line, 7, "{e}");
    }
}

/// What a spec decodes each item with.
#[derive(Clone, Debug)]
enum Decoder {
    #[cfg(feature = "image")]
    Image(crate::media::image::ImageRecipe),
    #[cfg(feature = "audio")]
    Audio(crate::media::audio::AudioRecipe),
    #[cfg(feature = "video")]
    Video(crate::media::video::VideoRecipe),
}

impl Decoder {
    /// The decoder of `epoch`: random crops and flips are drawn anew every epoch (and the same
    /// for the same epoch and file, so an exact resume redraws them).
    fn for_epoch(&self, epoch: u64) -> Decoder {
        match self {
            #[cfg(feature = "image")]
            Decoder::Image(r) => Decoder::Image(r.reseeded(epoch)),
            #[cfg(feature = "audio")]
            Decoder::Audio(r) => Decoder::Audio(r.reseeded(epoch)),
            #[cfg(feature = "video")]
            Decoder::Video(r) => Decoder::Video(r.clone()),
        }
    }

    fn load(&self, path: &Path) -> Result<crate::Tensor, crate::media::MediaError> {
        match self {
            #[cfg(feature = "image")]
            Decoder::Image(r) => r.load(path),
            #[cfg(feature = "audio")]
            Decoder::Audio(r) => r.load(path),
            #[cfg(feature = "video")]
            Decoder::Video(r) => r.load(path),
        }
    }

    #[cfg_attr(not(feature = "s3"), allow(dead_code))]
    fn decode(&self, blob: crate::Blob) -> Result<crate::Tensor, crate::media::MediaError> {
        match self {
            #[cfg(feature = "image")]
            Decoder::Image(r) => r.decode(&blob.bytes, &blob.path),
            #[cfg(feature = "audio")]
            Decoder::Audio(r) => r.decode(blob.bytes, &blob.path),
            #[cfg(feature = "video")]
            Decoder::Video(r) => r.decode(&blob.bytes, &blob.path),
        }
    }
}

/// A pipeline built from a spec, with what it needs alive (a local S3 server, the cache).
#[derive(Debug)]
pub struct Loader {
    /// Batches of decoded items, stacked along a new first axis.
    pub pipeline: crate::Pipeline<crate::Tensor>,
    /// The cache, if the spec has one.
    pub cache: Option<crate::cache::ByteCache>,
    /// Items per epoch.
    pub items: usize,
    #[cfg(feature = "s3")]
    _server: Option<LocalS3>,
}

/// A local S3 server and its folder, removed when dropped.
#[cfg(feature = "s3")]
#[derive(Debug)]
struct LocalS3 {
    _server: crate::s3::LocalServer,
    dir: PathBuf,
}

#[cfg(feature = "s3")]
impl Drop for LocalS3 {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.dir);
    }
}

/// Called with the pipeline's statistics at an interval.
pub type StatsHook = Box<dyn FnMut(&crate::PipelineStats) + Send>;

/// Called with every tuner tick that changed something.
pub type DecisionHook = Box<dyn FnMut(&crate::TraceRecord) + Send>;

/// What to call while a spec's pipeline runs.
#[derive(Default)]
pub struct Hooks {
    /// Statistics, every `metrics.interval_ms`.
    pub on_stats: Option<StatsHook>,
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
    fn decoder(&self) -> Result<Decoder, crate::PipelineError> {
        #[cfg_attr(
            all(feature = "image", feature = "audio", feature = "video"),
            allow(unused_variables)
        )]
        let missing = |kind: &str, feature: &str| {
            crate::PipelineError::config(format!(
                "decode.kind = \"{kind}\" needs flowgate built with the `{feature}` feature"
            ))
        };
        match &self.decode {
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
                Ok(Decoder::Image(ImageRecipe {
                    resize: *resize,
                    crop: *crop,
                    layout: *layout,
                    normalize: normalize.then_some(Normalize::IMAGENET),
                    ..base
                }))
            }
            #[cfg(not(feature = "image"))]
            DecodeSpec::Image { .. } => Err(missing("image", "image")),
            #[cfg(feature = "audio")]
            DecodeSpec::Audio {
                rate,
                seconds,
                keep_channels,
                train,
                ..
            } => Ok(Decoder::Audio(crate::media::audio::AudioRecipe {
                rate: *rate,
                samples: (seconds * f64::from(*rate)).round() as usize,
                channels: if *keep_channels {
                    crate::media::audio::Channels::Keep
                } else {
                    crate::media::audio::Channels::Mono
                },
                random_crop: *train,
                ..Default::default()
            })),
            #[cfg(not(feature = "audio"))]
            DecodeSpec::Audio { .. } => Err(missing("audio", "audio")),
            #[cfg(feature = "video")]
            DecodeSpec::Video {
                frames,
                resize,
                crop,
                threads,
                ..
            } => Ok(Decoder::Video(crate::media::video::VideoRecipe {
                sampling: crate::media::video::Sampling::Uniform(*frames),
                resize: *resize,
                crop: *crop,
                threads: *threads,
                ..Default::default()
            })),
            #[cfg(not(feature = "video"))]
            DecodeSpec::Video { .. } => Err(missing("video", "video")),
        }
    }

    /// The decode step alone, for one local file (what `flowgate profile` measures).
    pub fn item_decoder(
        &self,
    ) -> Result<
        impl Fn(&Path) -> Result<crate::Tensor, crate::media::MediaError> + Send + Sync + 'static,
        crate::PipelineError,
    > {
        let d = self.decoder()?;
        Ok(move |p: &Path| d.load(p))
    }

    /// Builds the pipeline: source → (fetch →) decode → batch → collate, tuned as the spec
    /// says, calling `hooks` while it runs.
    pub fn build(&self, hooks: Hooks) -> Result<Loader, crate::PipelineError> {
        use crate::{Pipeline, PipelineError, Tensor};
        let decoder = self.decoder()?;
        let interval = Duration::from_millis(self.metrics.interval_ms.unwrap_or(500));
        let batch = self.batch.size;
        let workers = self.decode_workers();
        let collate = |items: Vec<Tensor>| {
            Tensor::stack(&items).ok_or_else(|| {
                PipelineError::config("items of different shapes in one batch".to_owned())
            })
        };
        let finish = |b: crate::PipelineBuilder<Tensor>| {
            let mut b = b
                .measure(Tensor::nbytes)
                .aggregate(batch, self.batch.drop_last)
                .pipe("collate", collate, 1)
                .measure(Tensor::nbytes);
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
            let load = decoder;
            let pipeline = finish(
                Pipeline::builder()
                    .source_epochs(move |epoch| {
                        files.epoch(epoch).into_iter().map(move |p| (p, epoch))
                    })
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
                #[cfg(feature = "s3")]
                _server: None,
            });
        }
        #[cfg(feature = "s3")]
        {
            self.build_s3(decoder, workers, finish)
        }
        #[cfg(not(feature = "s3"))]
        {
            let _ = (decoder, finish);
            Err(PipelineError::config(
                "source.kind = \"s3\" needs flowgate built with the `s3` feature".to_owned(),
            ))
        }
    }

    #[cfg(feature = "s3")]
    fn build_s3(
        &self,
        decoder: Decoder,
        workers: Workers,
        finish: impl FnOnce(
            crate::PipelineBuilder<crate::Tensor>,
        ) -> Result<crate::Pipeline<crate::Tensor>, crate::PipelineError>,
    ) -> Result<Loader, crate::PipelineError> {
        use crate::s3::{LocalServer, S3Config, S3Error, S3};
        use crate::{Blob, Pipeline, PipelineError};
        let SourceSpec::S3 {
            bucket,
            prefix,
            endpoint,
            region,
            concurrency,
            shuffle,
            serve_locally_from,
        } = &self.source
        else {
            unreachable!("local sources are built by the caller")
        };
        let s3_err = |e: crate::s3::S3Error| PipelineError::config(e.to_string());
        let (s3, server) = match serve_locally_from {
            Some(list) => {
                let dir = std::env::temp_dir().join(format!(
                    "flowgate-local-s3-{}-{}",
                    std::process::id(),
                    std::time::SystemTime::now()
                        .duration_since(std::time::UNIX_EPOCH)
                        .map_or(0, |d| d.as_nanos())
                ));
                let server = LocalServer::start(&dir)
                    .map_err(|e| PipelineError::config(format!("local S3 server: {e}")))?;
                let s3 = S3::connect(server.config(bucket)).map_err(s3_err)?;
                futures::executor::block_on(s3.create_bucket()).map_err(s3_err)?;
                for path in Files::list(list)?.epoch(0) {
                    let name = path
                        .file_name()
                        .map(|n| n.to_string_lossy().into_owned())
                        .unwrap_or_default();
                    let bytes = std::fs::read(&path).map_err(|e| {
                        PipelineError::config(format!("reading {}: {e}", path.display()))
                    })?;
                    futures::executor::block_on(s3.put(&format!("{prefix}{name}"), bytes))
                        .map_err(s3_err)?;
                }
                let local = LocalS3 {
                    _server: server,
                    dir,
                };
                (s3, Some(local))
            }
            None => {
                let mut cfg = S3Config::new(bucket.clone());
                if let Some(url) = endpoint {
                    cfg = cfg.endpoint(url.clone());
                }
                if let Some(r) = region {
                    cfg = cfg.region(r.clone());
                }
                (S3::connect(cfg).map_err(s3_err)?, None)
            }
        };
        let keys: Vec<String> = s3
            .list(prefix)
            .map_err(s3_err)?
            .into_iter()
            .map(|o| o.key)
            .collect();
        let items = keys.len();
        let mut files = Files::new(keys);
        if let Some(seed) = shuffle {
            files = files.shuffle(*seed);
        }
        let cache = self.cache.as_ref().map(|c| {
            let mb = |m: f64| (m * 1048576.0) as u64;
            crate::cache::ByteCache::new(mb(c.mb)).max_bytes(mb(c.max_mb.unwrap_or(4.0 * c.mb)))
        });
        let fetch = s3.fetcher::<PathBuf>();
        let b = Pipeline::builder()
            .source_epochs(move |epoch| files.epoch(epoch).into_iter().map(move |p| (p, epoch)))
            .describe(|(p, _)| p.display().to_string());
        // The epoch rides along the fetch, for the decoder's per-epoch augmentation.
        let with_epoch =
            |f: Box<dyn Fn(PathBuf) -> crate::cache::CacheFuture<S3Error> + Send + Sync>| {
                move |(key, epoch): (PathBuf, u64)| {
                    let fetched = f(key);
                    async move { fetched.await.map(|blob| (blob, epoch)) }
                }
            };
        let b = match &cache {
            Some(c) => b
                .pipe_async(
                    "fetch",
                    with_epoch(Box::new(c.through(fetch))),
                    Workers::initial(*concurrency),
                )
                .cache(c),
            None => b.pipe_async(
                "fetch",
                with_epoch(Box::new(fetch)),
                Workers::initial(*concurrency),
            ),
        };
        let pipeline = finish(b.measure(|(blob, _): &(Blob, u64)| blob.len()).pipe(
            "decode",
            move |(blob, epoch): (Blob, u64)| decoder.for_epoch(epoch).decode(blob),
            workers,
        ))?;
        Ok(Loader {
            pipeline,
            cache,
            items,
            _server: server,
        })
    }
}
