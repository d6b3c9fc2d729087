//! The tables and keys of a pipeline file, with their defaults.

use std::path::PathBuf;

use serde::Deserialize;

/// A pipeline described in a file.
#[derive(Clone, Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct PipelineSpec {
    /// Where the items come from.
    pub source: SourceSpec,
    /// Fields besides the media (tar and Parquet sources; see
    /// [`fields_from_value`](crate::dataset::fields_from_value)): `caption = "txt"`,
    /// `meta = { from = "json", optional = true }`; a table of kind image, audio or video is
    /// decoded as media (see [`fields_and_media`](crate::loader::fields_and_media)):
    /// `depth = { from = "depth.png", kind = "image", crop = 224 }`.
    #[serde(default)]
    pub fields: Option<serde_json::Value>,
    /// The loader's settings, by the names every front end uses
    /// ([`LoaderSettings`](crate::loader::LoaderSettings)): `batch_size`, `shuffle`, `seed`,
    /// `drop_last`, `order`, `workers`, `skip_errors`, `fill_skipped`, `memory_mb`,
    /// `cpu_budget`, `max_batch_seconds`, `max_batch_frames`, `buckets`, `return_lengths`,
    /// `rank`, `world_size`. An absent key takes the library's default (a shuffle seeded 0,
    /// unreadable items skipped and counted, the media's batch size), as in every front end;
    /// without `rank` and `world_size` a file reads the whole dataset. The older keys of other
    /// tables (`batch.size`, `source.shuffle = <seed>`, `decode.workers`, `tuner.memory_mb`,
    /// …) are read into it when the file is parsed, each said in a deprecation line
    /// ([`deprecated`](Self::deprecated)); a setting given both ways is refused.
    #[serde(default)]
    pub loader: crate::loader::LoaderSettings,
    /// The deprecation lines of the older keys the file used (also logged as `tracing`
    /// warnings when it is parsed).
    #[serde(skip)]
    pub deprecated: Vec<String>,
    /// The older keys the file used, `(table, key)`: where its errors name those settings.
    #[serde(skip)]
    pub old_keys: Vec<(&'static str, &'static str)>,
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

const fn default_buffer() -> usize {
    crate::dataset::DEFAULT_BUFFER
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
        /// `"folder"`: each file's label is its folder's index among the dataset's sorted
        /// folders (ImageFolder's).
        #[serde(default)]
        labels: Option<String>,
        /// A file of `PATH LABEL` lines (whitespace or a comma between): each file's label.
        #[serde(default)]
        label_file: Option<PathBuf>,
    },
    /// Every file under a directory with one of `extensions`.
    Dir {
        /// The directory.
        path: PathBuf,
        /// Extensions to keep, with or without the dot; default: the decode kind's.
        #[serde(default)]
        extensions: Vec<String>,
        /// Shuffle with this seed, anew every epoch.
        #[serde(default)]
        shuffle: Option<u64>,
        /// `"folder"`: each file's label is its folder's index (see `list`).
        #[serde(default)]
        labels: Option<String>,
        /// A file of `PATH LABEL` lines (see `list`).
        #[serde(default)]
        label_file: Option<PathBuf>,
    },
    /// WebDataset tar shards (see `flowgate::dataset::shards`): each sample's media field is decoded
    /// (the first of `fields` it has).
    Tar {
        /// The shards: a path or brace pattern (`shards/shard-{000000..000063}.tar`), or
        /// several separated by commas, or a directory; or on S3 (feature `s3`),
        /// `s3://bucket/PATTERN`, a prefix, or a manifest (`….json`).
        shards: String,
        /// Shards on S3: an S3-compatible endpoint (`http://host:port`); else
        /// `AWS_ENDPOINT_URL`, else AWS.
        #[serde(default)]
        endpoint: Option<String>,
        /// Shards on S3: the region.
        #[serde(default)]
        region: Option<String>,
        /// Shards on S3: MiB of shards kept in the disk cache beyond those being read
        /// (least recently used evicted first).
        #[serde(default)]
        cache_mb: f64,
        /// Shards on S3: the disk cache's folder (default `$FLOWGATE_SHARD_CACHE`, else
        /// `~/.cache/flowgate/shards`).
        #[serde(default)]
        cache_dir: Option<PathBuf>,
        /// Shards on S3: shards downloaded ahead of the readers.
        #[serde(
            default = "default_prefetch",
            deserialize_with = "flowgate_actors::limits::whole::prefetch"
        )]
        prefetch: usize,
        /// The extensions of the field to decode, first present wins; default: the decode
        /// kind's (`jpg`, `jpeg`, `png`, `webp` for images; `flac`, `wav`, `mp3`, `ogg`, `m4a`
        /// for audio; `mp4`, `mkv`, `webm`, `mov` for video).
        #[serde(default)]
        fields: Vec<String>,
        /// Shuffle the shards with this seed, anew every epoch.
        #[serde(default)]
        shuffle: Option<u64>,
        /// A shuffle buffer of this many samples over each epoch's stream when the loader
        /// shuffles (0: none; default 1000, the library's
        /// [`DEFAULT_BUFFER`](crate::dataset::DEFAULT_BUFFER)).
        #[serde(
            default = "default_buffer",
            deserialize_with = "flowgate_actors::limits::whole::buffer"
        )]
        buffer: usize,
        /// The field (extension) holding each sample's integer label, such as `"cls"`.
        #[serde(default)]
        labels: Option<String>,
    },
    /// Parquet files (feature `parquet`; see `flowgate::dataset::parquet`): each row's `column` cell
    /// is decoded (a `struct<bytes, path>` or binary column).
    Parquet {
        /// A file, or a directory (its `.parquet` files, sorted); or on S3 (feature `s3`),
        /// `s3://bucket/KEY.parquet` or a prefix (its `.parquet` objects).
        path: PathBuf,
        /// Files on S3: an S3-compatible endpoint (`http://host:port`); else
        /// `AWS_ENDPOINT_URL`, else AWS.
        #[serde(default)]
        endpoint: Option<String>,
        /// Files on S3: the region.
        #[serde(default)]
        region: Option<String>,
        /// The column to decode.
        #[serde(default = "default_column")]
        column: String,
        /// Shuffle the row groups with this seed, anew every epoch.
        #[serde(default)]
        shuffle: Option<u64>,
        /// A shuffle buffer of this many rows over each epoch's stream when the loader
        /// shuffles (0: none; default 1000, the library's
        /// [`DEFAULT_BUFFER`](crate::dataset::DEFAULT_BUFFER)).
        #[serde(
            default = "default_buffer",
            deserialize_with = "flowgate_actors::limits::whole::buffer"
        )]
        buffer: usize,
        /// The column holding each row's integer label, such as `"label"`.
        #[serde(default)]
        labels: Option<String>,
    },
    /// Several local sources drawn by weight (see `flowgate::sampler::Sampler::mixture`);
    /// the same decode for all. Each source's own `shuffle` and `buffer` are not used: the
    /// mixture orders each source's items (shuffled with its `shuffle` seed, anew every epoch
    /// and pass).
    Mix {
        /// The sources (`[[source.sources]]` tables: list, dir, tar or parquet).
        sources: Vec<SourceSpec>,
        /// One weight per source (relative; at least one positive).
        weights: Vec<f64>,
        /// Draws per epoch (sources drawn to their end start a new pass, so they cycle); when
        /// absent, `stop` says when the epoch ends.
        #[serde(
            default,
            deserialize_with = "flowgate_actors::limits::whole::draws_or_none"
        )]
        draws: Option<usize>,
        /// Without `draws`: `"first"` (the epoch ends at the first source drawn to its end:
        /// each item at most once) or `"all"` (once every source has been drawn to its end:
        /// each item at least once).
        #[serde(default)]
        stop: MixStopName,
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

/// When a mixture's epoch ends, without a number of draws.
#[derive(Clone, Copy, Debug, Default, Deserialize, PartialEq, Eq)]
#[serde(rename_all = "lowercase")]
pub enum MixStopName {
    /// At the first source drawn to its end.
    First,
    /// Once every source has been drawn to its end.
    #[default]
    All,
}

fn default_prefetch() -> usize {
    crate::dataset::DEFAULT_PREFETCH
}

/// `[metrics] prometheus`: a port (`9898`, as Python's `metrics_port=9898`) or an address
/// (`"0.0.0.0:9898"`), as text for [`prometheus::address`](crate::prometheus::address).
fn port_or_address<'de, D: serde::Deserializer<'de>>(d: D) -> Result<Option<String>, D::Error> {
    struct V;
    impl serde::de::Visitor<'_> for V {
        type Value = Option<String>;
        fn expecting(&self, f: &mut std::fmt::Formatter) -> std::fmt::Result {
            f.write_str("a port (9898) or an address (\"0.0.0.0:9898\")")
        }
        fn visit_i64<E>(self, n: i64) -> Result<Self::Value, E> {
            Ok(Some(n.to_string()))
        }
        fn visit_u64<E>(self, n: u64) -> Result<Self::Value, E> {
            Ok(Some(n.to_string()))
        }
        fn visit_str<E>(self, a: &str) -> Result<Self::Value, E> {
            Ok(Some(a.to_owned()))
        }
    }
    d.deserialize_any(V)
}

fn default_column() -> String {
    crate::dataset::DEFAULT_PARQUET_COLUMN.into()
}

fn default_concurrency() -> usize {
    crate::dataset::DEFAULT_FETCH_CONCURRENCY
}

/// How each item is decoded: the media's arguments (`kind` and its keys, as
/// [`MediaArgs`](crate::media::MediaArgs) names them, with the same defaults and rules as every
/// other front end), and the decode stage's `workers`.
#[derive(Clone, Debug)]
pub struct DecodeSpec {
    /// What each item becomes.
    pub media: crate::media::MediaArgs,
    /// Fixed decode workers; the tuner decides when absent.
    pub workers: Option<usize>,
}

impl<'de> Deserialize<'de> for DecodeSpec {
    fn deserialize<D: serde::Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        use serde::de::Error;
        // `workers` is the stage's, every other key the media's (which refuses unknown ones).
        let mut table = toml::Table::deserialize(d)?;
        let workers = table
            .remove("workers")
            .map(flowgate_actors::limits::whole::workers_or_none)
            .transpose()
            .map_err(|e: toml::de::Error| D::Error::custom(e.message()))?
            .flatten();
        let media = toml::Value::Table(table)
            .try_into()
            .map_err(|e: toml::de::Error| D::Error::custom(e.message()))?;
        Ok(Self { media, workers })
    }
}

/// Batching.
#[derive(Clone, Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct BatchSpec {
    /// Items per batch (default: the library's for the media,
    /// [`default_batch_size`](crate::loader::default_batch_size): 32, 8 clips of video); see
    /// [`PipelineSpec::batch_size`](super::PipelineSpec::batch_size).
    #[serde(
        default,
        deserialize_with = "flowgate_actors::limits::whole::batch_size_or_none"
    )]
    pub size: Option<usize>,
    /// Drop a last, partial batch.
    #[serde(default)]
    pub drop_last: bool,
    /// Audio from list, dir, tar or parquet sources (local): length-aware batches instead of `size` clips (see
    /// `flowgate::sampler::LengthBatches`): clips of similar declared length, at most this
    /// many padded seconds per batch, padded only to the longest clip (a clip longer than it
    /// is cropped to it); `size` does not apply.
    #[serde(default)]
    pub max_seconds: Option<f64>,
    /// Video from list, dir, tar or parquet sources (local), with `decode.fps`: length-aware batches of at most
    /// this many padded frames (clips × the longest clip's frames); each clip yields its
    /// frames at `fps` as its declared length allows (at most this many).
    #[serde(default)]
    pub max_frames: Option<usize>,
    /// With `max_seconds` or `max_frames`: length buckets (boundaries at the lengths'
    /// quantiles).
    #[serde(
        default = "default_buckets",
        deserialize_with = "flowgate_actors::limits::whole::buckets"
    )]
    pub buckets: usize,
    /// The order items are batched in: `"input"` (default: the epoch's order, so a seed gives
    /// the same batches on every run) or `"completion"` (as they finish decoding).
    #[serde(default)]
    pub order: crate::loader::OrderName,
}

fn default_buckets() -> usize {
    crate::loader::DEFAULT_BUCKETS
}

impl Default for BatchSpec {
    fn default() -> Self {
        Self {
            size: None,
            drop_last: false,
            max_seconds: None,
            max_frames: None,
            buckets: default_buckets(),
            order: crate::loader::OrderName::default(),
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
#[derive(Clone, Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct DeviceSpec {
    /// `cpu` (the batches stay in host memory), `cuda` (the uploader: pinned staging, copies
    /// on their own stream; needs flowgate built with the `cuda` feature and a GPU) or
    /// `simulated` (a copy engine of `bandwidth_gbps` and `latency_us`, for tests and tuner
    /// experiments without a GPU).
    #[serde(default)]
    pub kind: DeviceKind,
    /// The CUDA device (default 0).
    #[serde(default)]
    pub ordinal: usize,
    /// The most MiB of uploaded batches waiting for the consumer on the device (default
    /// 1024); the tuner sizes that buffer within it.
    #[serde(default = "default_device_mb")]
    pub memory_mb: f64,
    /// The most MiB of pinned staging memory (default 64: the library's
    /// [`DEFAULT_STAGING_BYTES`](crate::loader::DEFAULT_STAGING_BYTES)), reserved in the
    /// memory budget.
    #[serde(default = "default_staging_mb")]
    pub staging_mb: f64,
    /// `simulated`: the link's bandwidth in GB/s (default 25).
    #[serde(default = "default_bandwidth")]
    pub bandwidth_gbps: f64,
    /// `simulated`: the fixed cost of one copy in microseconds (default 10).
    #[serde(default = "default_latency")]
    pub latency_us: f64,
}

fn default_device_mb() -> f64 {
    flowgate_actors::limits::bytes_to_mib(crate::loader::DEFAULT_DEVICE_BYTES)
}
fn default_staging_mb() -> f64 {
    flowgate_actors::limits::bytes_to_mib(crate::loader::DEFAULT_STAGING_BYTES as u64)
}
fn default_bandwidth() -> f64 {
    crate::loader::DEFAULT_SIM_BANDWIDTH / 1e9
}
fn default_latency() -> f64 {
    crate::loader::DEFAULT_SIM_LATENCY.as_secs_f64() * 1e6
}

impl Default for DeviceSpec {
    fn default() -> Self {
        Self {
            kind: DeviceKind::Cpu,
            ordinal: 0,
            memory_mb: default_device_mb(),
            staging_mb: default_staging_mb(),
            bandwidth_gbps: default_bandwidth(),
            latency_us: default_latency(),
        }
    }
}

/// A device kind.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum DeviceKind {
    /// Host memory.
    #[default]
    Cpu,
    /// An NVIDIA GPU (the `cuda` feature).
    Cuda,
    /// A simulated copy engine (host memory, with a bandwidth and a latency).
    Simulated,
}

/// Epochs, the simulated training step and how many failures a run tolerates.
#[derive(Clone, Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct RunSpec {
    /// Epochs to run.
    #[serde(default = "one_u64")]
    pub epochs: u64,
    /// Milliseconds of simulated training per batch (the consumer's step).
    #[serde(default)]
    pub step_ms: f64,
    /// The step changing while the run goes on (a model whose steps get slower, a
    /// demonstration of the tuner following the loop): from `at_s` seconds into the run on,
    /// the step is `ms` (until the next change). In the order of `at_s`.
    #[serde(default)]
    pub step_changes: Vec<StepChange>,
    /// Stop after this many seconds (within the epoch then running; the summary counts what
    /// was delivered), if the epochs have not ended before.
    #[serde(default)]
    pub seconds: Option<f64>,
    /// The failure budget: an integer is a count (`0`: the first failure stops the run), a
    /// number with a fraction a rate of the items seen (`0.01`: 1%, applied once 100 items
    /// were seen). Absent: failing items are skipped and counted, never fatal.
    #[serde(default)]
    pub max_failures: Option<MaxFailures>,
    /// `flowgate run` when stderr is not a terminal: seconds between progress lines.
    #[serde(default = "ten")]
    pub progress_s: f64,
}

fn ten() -> f64 {
    10.0
}

/// One of `run.step_changes`.
#[derive(Clone, Copy, Debug, Deserialize, PartialEq)]
#[serde(deny_unknown_fields)]
pub struct StepChange {
    /// Seconds into the run.
    pub at_s: f64,
    /// The step from then on, in milliseconds.
    pub ms: f64,
}

impl RunSpec {
    /// The simulated step `elapsed` seconds into the run.
    pub fn step_at(&self, elapsed: f64) -> f64 {
        self.step_changes
            .iter()
            .take_while(|c| c.at_s <= elapsed)
            .last()
            .map_or(self.step_ms, |c| c.ms)
    }
}

/// `run.max_failures`: a count or a rate.
#[derive(Clone, Copy, Debug, Deserialize, PartialEq)]
#[serde(untagged)]
pub enum MaxFailures {
    /// At most this many failed items.
    Count(u64),
    /// At most this fraction of the items seen.
    Rate(f64),
}

fn one_u64() -> u64 {
    1
}

impl Default for RunSpec {
    fn default() -> Self {
        Self {
            epochs: 1,
            step_ms: 0.0,
            step_changes: Vec::new(),
            seconds: None,
            max_failures: None,
            progress_s: 10.0,
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
    /// Cores the ranks of this node may keep busy decoding, together: a count (`2`), a
    /// fraction (`0.4`) or a percentage (`"40%"`) of the node; shared through a ledger in
    /// `/dev/shm` (default: none, each rank within its share of the node's cores).
    #[serde(default)]
    pub cpu_budget: Option<flowgate_actors::node::CpuBudget>,
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
            cpu_budget: None,
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
    /// Serve Prometheus metrics here: a port on the loopback address (`"9898"`) or
    /// `HOST:PORT` (`"0.0.0.0:9898"` for a scraper on another machine), as
    /// [`prometheus::address`](crate::prometheus::address) reads it (feature `prometheus`).
    #[serde(default, deserialize_with = "port_or_address")]
    pub prometheus: Option<String>,
}
