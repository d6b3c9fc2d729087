//! WebDataset tar shards: a corpus stored as tar files of samples, read as a dataset.
//!
//! A shard is a tar file whose members are grouped into samples by key (the member's path up
//! to the first dot of its file name); each extension is a field: `000123.jpg`, `000123.cls`
//! and `000123.json` are one sample with the fields `jpg`, `cls` and `json`. This is the layout
//! of LAION, DataComp and most audio-visual corpora, and what `webdataset`, DALI and Ray Data
//! read.
//!
//! [`Shards`] opens shards by path or brace pattern (`shard-{000000..000063}.tar`) and indexes
//! each one by walking its tar headers (seeking over the data: a few hundred bytes read per
//! sample), so every sample has a place. An epoch's order shuffles the *shards* (seeded, anew
//! every epoch) and keeps each shard's samples in stream order; each rank takes one contiguous
//! block of that order (so a rank reads whole shards and shares at most two with its
//! neighbours), and visits it through a shuffle buffer of [`buffer`](Shards::buffer) samples,
//! webdataset's `shuffle(n)` (see [`Sampler::groups`]). Every sample is read once per epoch
//! across ranks, and with [`ShareLengths::Pad`] or `Drop` every rank gets the same number of
//! samples. A resume is exact to the sample: a checkpoint records the samples delivered, and a
//! resumed epoch reads only the others (each sample is a byte range: nothing skipped is read or
//! decoded).
//!
//! Shards on S3 (feature `s3`; [`Shards::open_s3`], or [`Shards::open`] with an
//! `s3://bucket/pattern` URL) are downloaded whole, one streamed GET each, into a local disk
//! cache ([`disk_cache::ShardCache`]: a byte limit, least recently used evicted first, but never a
//! shard with samples of the epoch still to read) and read from there; the next shards of the
//! rank's order are fetched ahead of the readers ([`prefetch`](Shards::prefetch)), and a body
//! cut off mid-stream continues with a ranged GET. Sample counts come from a manifest
//! ([`MANIFEST`], WebDataset's `wids` format, which [`write_shards`] and
//! [`Shards::write_manifest`] write), so opening reads no shard; without one, every shard is
//! downloaded and indexed when opened.
//!
//! Reading a sample ([`SampleRef::read`]) reads its fields' bytes; `flowgate::sample::FieldMap`
//! turns them into a `Sample` (images, audio and video through their recipes, `cls` into a
//! label, `txt`/`json` into text): this module reads bytes and decodes nothing. Bad shards never stop the pipeline by themselves: a shard that is
//! cut off, garbage, empty, or has a member larger than the limit keeps the samples before the
//! damage and contributes one failing item naming the shard and the key or byte where it
//! broke; a sample missing a field, or a field that does not decode, fails naming shard, key
//! and field. All count against the pipeline's failure budget like any bad file.
//!
//! ```no_run
//! # #[cfg(feature = "image")] {
//! use flowgate::media::{image::ImageRecipe, Recipe};
//! use flowgate::sampler::ShareLengths;
//! use flowgate::dataset::shards::Shards;
//! use flowgate::sample::FieldMap;
//! use flowgate::{Pipeline, Workers};
//!
//! let shards = Shards::open("/data/train/shard-{000000..000063}.tar")?
//!     .shuffle(42)                 // shards reshuffled every epoch
//!     .buffer(1000)                // and samples through a 1000-sample shuffle buffer
//!     .shard_from_env()?           // RANK / WORLD_SIZE
//!     .shard_lengths(ShareLengths::Pad);
//! let fields = FieldMap::new()
//!     .decode("image", &["jpg", "png", "webp"], Recipe::image(ImageRecipe::train(224)).unwrap())
//!     .label("label", "cls");
//! let mut pipeline = Pipeline::builder()
//!     .source_sampled(shards.sampler().clone(), shards.refs())
//!     .checkpoint_fields(shards.fingerprint())
//!     .describe(|r| r.to_string())
//!     .pipe("decode", move |r| fields.read(&r), Workers::initial(1))
//!     .aggregate(32, false)
//!     .pipe("collate", flowgate::sample::FieldBatch::collate, 1)
//!     .build()?;
//! # }
//! # Ok::<(), flowgate::PipelineError>(())
//! ```

#[cfg(feature = "s3")]
pub mod disk_cache;
mod index;
mod patterns;
mod read;
#[cfg(feature = "s3")]
pub mod remote;
mod shard;
pub mod tar;
mod write;

use std::fs::File;
use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex, OnceLock};

#[cfg(feature = "s3")]
pub use disk_cache::{CacheStats, ShardCache};
pub use index::{split_name, Entry, FieldAt};
use patterns::expand_spec;
pub use patterns::{expand_braces, MAX_NAMES};
pub use read::{RawSample, SampleRef};
use shard::{index_file, Body, Inner, Plan, Shard};
use write::manifest_json;
pub use write::write_shards;

use flowgate_actors::error::PipelineError;

use crate::sampler::{Sampler, ShareLengths};

/// The largest member a shard may declare by default: 1 GiB (a long video clip is far less).
pub const DEFAULT_MAX_MEMBER: u64 = 1 << 30;

/// Why a sample could not become a [`Sample`](crate::sample::Sample). Every variant names the shard and the key.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum ShardError {
    /// The shard is damaged here (cut off, garbage, empty, a member over the limit, a field
    /// twice): the samples before it were read.
    #[error("shard {shard}, sample {key}: {reason}")]
    Damaged {
        /// The shard.
        shard: PathBuf,
        /// The sample's key, or `@byte N` where no sample was open.
        key: String,
        /// What is wrong.
        reason: Arc<str>,
    },
    /// Reading the sample's bytes failed (the shard changed or vanished since it was opened).
    #[error("shard {shard}, sample {key}: reading: {source}")]
    Read {
        /// The shard.
        shard: PathBuf,
        /// The sample's key.
        key: String,
        /// The I/O error.
        source: std::io::Error,
    },
    /// The sample lacks a field a `FieldMap` needs.
    #[error("shard {shard}, sample {key}: no field {wanted} (it has: {has})")]
    Missing {
        /// The shard.
        shard: PathBuf,
        /// The sample's key.
        key: String,
        /// The extensions looked for.
        wanted: String,
        /// The extensions it has.
        has: String,
    },
    /// A field's bytes are not what its kind needs (a label that is not an integer, text that
    /// is not UTF-8).
    #[error("shard {shard}, sample {key}, field {ext}: {reason}")]
    Field {
        /// The shard.
        shard: PathBuf,
        /// The sample's key.
        key: String,
        /// The field's extension.
        ext: String,
        /// What is wrong.
        reason: String,
    },
    /// A field read from a file beside a loose media file (`a.txt` beside `a.jpg`) is
    /// missing or not what its kind needs.
    #[error("{media}: field {field:?}: {reason}")]
    Sidecar {
        /// The media file.
        media: PathBuf,
        /// The field's name.
        field: String,
        /// What is wrong (naming the file looked for).
        reason: String,
    },
    /// A media field did not decode (a `MediaError`, whose path is `SHARD/KEY.EXT`).
    #[error(transparent)]
    Media(Box<dyn std::error::Error + Send + Sync>),
}

/// The file name of a shard manifest (WebDataset's `wids` format) beside the shards.
pub const MANIFEST: &str = "shards.json";

/// A set of tar shards as a dataset of samples; see the [module docs](self).
#[derive(Clone)]
pub struct Shards {
    inner: Arc<Inner>,
    sampler: Sampler,
    /// Remote shards downloaded ahead of the one being read.
    prefetch: usize,
    /// Which shards come after which in this order (for prefetching), made when first needed.
    plan: Arc<OnceLock<Arc<Plan>>>,
}

impl std::fmt::Debug for Shards {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Shards")
            .field("shards", &self.inner.shards.len())
            .field("samples", &self.inner.at.len())
            .field("sampler", &self.sampler)
            .finish()
    }
}

impl Shards {
    /// The shards named by `spec`: a path or brace pattern, or several separated by commas
    /// outside braces (`a.tar,b.tar`), or a directory (its `.tar` files, sorted); see
    /// [`open_paths`](Self::open_paths).
    pub fn open(spec: &str) -> Result<Self, PipelineError> {
        if spec.starts_with("s3://") {
            #[cfg(feature = "s3")]
            return remote::open_url(spec);
            #[cfg(not(feature = "s3"))]
            return Err(PipelineError::config(format!(
                "{spec}: shards on S3 need flowgate built with the `s3` feature"
            )));
        }
        let dir = Path::new(spec);
        if !spec.contains(['{', ',']) && dir.is_dir() {
            let mut paths: Vec<PathBuf> = std::fs::read_dir(dir)
                .map_err(|e| PipelineError::io(format!("listing {}", dir.display()), e))?
                .filter_map(|e| e.ok().map(|e| e.path()))
                .filter(|p| p.extension().is_some_and(|x| x.eq_ignore_ascii_case("tar")))
                .collect();
            paths.sort();
            if paths.is_empty() {
                return Err(PipelineError::config(format!(
                    "{}: a directory with no .tar files",
                    dir.display()
                )));
            }
            return Self::open_paths(paths);
        }
        Self::open_paths(expand_spec(spec)?)
    }

    /// The shards at `paths`, in this order, indexed with the default member limit. A path
    /// that does not exist or cannot be opened is an error (a misspelt pattern should not
    /// train on nothing); a shard that opens but is damaged keeps what it has (see the
    /// [module docs](self)). `s3://` URLs are not read yet: stage the shards locally.
    pub fn open_paths(
        paths: impl IntoIterator<Item = impl Into<PathBuf>>,
    ) -> Result<Self, PipelineError> {
        Self::open_with_limit(paths, DEFAULT_MAX_MEMBER)
    }

    /// [`open_paths`](Self::open_paths), refusing members over `max_member` bytes.
    pub fn open_with_limit(
        paths: impl IntoIterator<Item = impl Into<PathBuf>>,
        max_member: u64,
    ) -> Result<Self, PipelineError> {
        let mut shards = Vec::new();
        for path in paths {
            let path: PathBuf = path.into();
            if path.to_string_lossy().starts_with("s3://") {
                return Err(PipelineError::config(format!(
                    "{}: an s3:// URL among local paths; open S3 shards with Shards::open \
                     (one s3:// pattern) or Shards::open_s3",
                    path.display()
                )));
            }
            let file = File::open(&path).map_err(|e| {
                PipelineError::io(format!("opening the shard {}", path.display()), e)
            })?;
            let entries = index_file(&file, max_member);
            shards.push(Shard {
                path,
                len: entries.len(),
                body: Body::Local {
                    entries,
                    file: OnceLock::new(),
                },
            });
        }
        Ok(Self::of(Inner::new(shards)?))
    }

    fn of((inner, sampler): (Inner, Sampler)) -> Self {
        Self {
            inner: Arc::new(inner),
            sampler,
            prefetch: 2,
            plan: Arc::default(),
        }
    }

    fn map_sampler(mut self, f: impl FnOnce(Sampler) -> Sampler) -> Self {
        self.sampler = f(self.sampler);
        self.plan = Arc::default();
        self
    }

    /// Shuffles the shards every epoch with a seed derived from `seed` and the epoch (and
    /// seeds the shuffle buffer).
    pub fn shuffle(self, seed: u64) -> Self {
        self.map_sampler(|s| s.shuffle(seed))
    }

    /// Visits each rank's samples through a shuffle buffer of `samples` (see
    /// [`Sampler::buffer`]). The buffer is a permutation of positions, not a store: samples
    /// are read when their turn comes, so it costs no memory beyond the pipeline's queues.
    pub fn buffer(self, samples: usize) -> Self {
        self.map_sampler(|s| s.buffer(samples))
    }

    /// Shards on S3: how many are downloaded ahead of the one being read, in this rank's
    /// order (default 2; 0 fetches each when first read).
    pub fn prefetch(mut self, shards: usize) -> Self {
        self.prefetch = shards;
        self.plan = Arc::default();
        self
    }

    /// Keeps rank `rank`'s share of a world of `world` (one contiguous block of each epoch's
    /// order).
    pub fn shard(self, rank: usize, world: usize) -> Result<Self, PipelineError> {
        let sampler = self.sampler.clone().shard(rank, world)?;
        Ok(self.map_sampler(|_| sampler))
    }

    /// Shards by `RANK` and `WORLD_SIZE` (see [`Sampler::shard_from_env`]).
    pub fn shard_from_env(self) -> Result<Self, PipelineError> {
        let sampler = self.sampler.clone().shard_from_env()?;
        Ok(self.map_sampler(|_| sampler))
    }

    /// Keeps worker `worker`'s part of this rank's share split among `workers` processes
    /// (PyTorch `DataLoader` workers); see [`Sampler::split`].
    pub fn split(self, worker: usize, workers: usize) -> Result<Self, PipelineError> {
        let sampler = self.sampler.clone().split(worker, workers)?;
        Ok(self.map_sampler(|_| sampler))
    }

    /// Makes every rank's share the same length (see [`ShareLengths`]).
    pub fn shard_lengths(self, lengths: ShareLengths) -> Self {
        self.map_sampler(|s| s.shard_lengths(lengths))
    }

    /// How each epoch orders and deals the samples.
    pub fn sampler(&self) -> &Sampler {
        &self.sampler
    }

    /// Number of shards.
    pub fn shard_count(&self) -> usize {
        self.inner.shards.len()
    }

    /// Number of samples in all shards (damaged places count one each).
    pub fn len(&self) -> usize {
        self.inner.at.len()
    }

    /// Whether there are no samples.
    pub fn is_empty(&self) -> bool {
        self.inner.at.is_empty()
    }

    /// The damaged places found when indexing: (shard, key, reason). Shards on S3 are
    /// indexed when first read; those not read yet show nothing here.
    pub fn damage(&self) -> Vec<(&Path, &str, &str)> {
        self.inner
            .shards
            .iter()
            .flat_map(|s| {
                s.known_entries().iter().filter_map(|e| {
                    e.problem
                        .as_deref()
                        .map(|p| (s.path.as_path(), e.key.as_str(), p))
                })
            })
            .collect()
    }

    /// What a checkpoint over these shards depends on (for
    /// [`PipelineBuilder::checkpoint_fields`](crate::PipelineBuilder::checkpoint_fields)):
    /// the dataset (every shard's path and sample keys, hashed; for a shard on S3 its URL,
    /// entity tag, size and sample count) and the sampler's settings.
    pub fn fingerprint(&self) -> Vec<(&'static str, String)> {
        use crate::hash::{fnv1a, FNV_OFFSET};
        let hash = self.inner.shards.iter().fold(FNV_OFFSET, |h, s| {
            let h = fnv1a(fnv1a(h, s.path.as_os_str().as_encoded_bytes()), b"\0");
            match &s.body {
                Body::Local { entries, .. } => entries
                    .iter()
                    .fold(h, |h, e| fnv1a(fnv1a(h, e.key.as_bytes()), b"\0")),
                #[cfg(feature = "s3")]
                Body::Remote { cache, slot, .. } => {
                    let o = cache.object(*slot);
                    let tag = format!("{}/{}/{}", o.etag.as_deref().unwrap_or(""), o.size, s.len);
                    fnv1a(h, tag.as_bytes())
                }
            }
        });
        let mut f = vec![(
            "dataset",
            format!(
                "{} shards, {} samples, {hash:016x}",
                self.inner.shards.len(),
                self.inner.at.len()
            ),
        )];
        f.extend(self.sampler.fingerprint());
        f
    }

    /// The prefetch plan of this sampler, made once and shared by clones (every builder
    /// method that changes the order starts a new one).
    fn plan(&self) -> Arc<Plan> {
        Arc::clone(self.plan.get_or_init(|| {
            Arc::new(Plan {
                sampler: self.sampler.clone(),
                depth: self.prefetch.into(),
                order: Mutex::new(None),
                reads: Mutex::new(None),
            })
        }))
    }

    /// Plans `epoch` from the samples this process will read in it, in order (what the
    /// source reads: its share less what a resume skips, or a mixture's draws from these
    /// shards): shards on S3 are fetched ahead in that order, and each stays in the disk
    /// cache until those samples are read. Without it the plan is the sampler's whole share.
    pub fn plan_reads(&self, epoch: u64, indices: &[usize]) {
        let plan = self.plan();
        plan.set_reads(epoch, indices.to_vec());
        #[cfg(feature = "s3")]
        if let Some(cache) = self.inner.shards.iter().find_map(|s| match &s.body {
            shard::Body::Remote { cache, .. } => Some(cache),
            _ => None,
        }) {
            cache.plan_epoch(epoch, plan.counts(&self.inner, epoch));
        }
    }

    /// The sample at dataset index `index` in `epoch`.
    pub fn get(&self, epoch: u64, index: usize) -> SampleRef {
        self.get_with(&self.plan(), epoch, index)
    }

    fn get_with(&self, plan: &Arc<Plan>, epoch: u64, index: usize) -> SampleRef {
        SampleRef {
            shards: Arc::clone(&self.inner),
            plan: Arc::clone(plan),
            index,
            epoch,
        }
    }

    /// `(epoch, index) → SampleRef`, for
    /// [`source_sampled`](crate::PipelineBuilder::source_sampled).
    pub fn refs(&self) -> impl Fn(u64, usize) -> SampleRef + Send + Sync + 'static {
        let me = self.clone();
        let plan = self.plan();
        move |epoch, index| me.get_with(&plan, epoch, index)
    }

    /// This rank's samples of `epoch`, in the order it visits them.
    pub fn epoch(&self, epoch: u64) -> Vec<SampleRef> {
        let plan = self.plan();
        self.sampler
            .epoch(epoch)
            .into_iter()
            .map(|i| self.get_with(&plan, epoch, i))
            .collect()
    }

    /// Writes these shards' manifest to `path` (WebDataset's `wids` format: each shard's URL,
    /// relative to the manifest's folder where it is under it, and its sample count). Beside
    /// shards on S3 as `shards.json`, it lets [`open_s3`](Self::open_s3) start without
    /// reading a shard. [`write_shards`] writes one.
    pub fn write_manifest(&self, path: &Path) -> std::io::Result<()> {
        let list: Vec<(PathBuf, usize)> = self
            .inner
            .shards
            .iter()
            .map(|s| (s.path.clone(), s.len))
            .collect();
        let folder = path.parent().unwrap_or(Path::new(""));
        std::fs::write(path, manifest_json(&list, folder))
    }

    /// Whether every shard is local (none on S3).
    pub fn is_local(&self) -> bool {
        self.inner
            .shards
            .iter()
            .all(|s| matches!(s.body, Body::Local { .. }))
    }

    /// The download cache of shards on S3 (`None` for local shards).
    #[cfg(feature = "s3")]
    pub fn cache(&self) -> Option<&Arc<ShardCache>> {
        self.inner.shards.iter().find_map(|s| match &s.body {
            Body::Remote { cache, .. } => Some(cache),
            Body::Local { .. } => None,
        })
    }

    /// The prefetch of shards on S3 as a read-ahead the tuner deepens (attach it to the
    /// stage that reads the samples with
    /// [`PipelineBuilder::read_ahead`](crate::PipelineBuilder::read_ahead)): when readers
    /// wait for a shard's download, it doubles how many shards are fetched ahead, up to
    /// `max(16, prefetch)`; the shards fetched ahead wait on disk (in the cache) until read,
    /// so the ceiling bounds the disk they take. A prefetch of 0 is a choice: pinned. `None`
    /// for local shards (nothing to fetch).
    #[cfg(feature = "s3")]
    pub fn read_ahead(&self) -> Option<Arc<dyn flowgate_actors::attached::ReadAheadControl>> {
        let cache = Arc::clone(self.cache()?);
        Some(Arc::new(ReadAhead {
            plan: self.plan(),
            cache,
            max: self.prefetch.max(16).min(self.inner.shards.len().max(1)),
            pinned: self.prefetch == 0,
        }))
    }
}

/// [`Shards::read_ahead`]: the plan's depth, the cache's reads and waits.
#[cfg(feature = "s3")]
struct ReadAhead {
    plan: Arc<Plan>,
    cache: Arc<ShardCache>,
    max: usize,
    pinned: bool,
}

#[cfg(feature = "s3")]
impl flowgate_actors::attached::ReadAheadControl for ReadAhead {
    fn read_ahead_stats(&self) -> flowgate_tuner::ReadAheadStats {
        let c = self.cache.stats();
        flowgate_tuner::ReadAheadStats {
            depth: self.plan.depth.load(std::sync::atomic::Ordering::Relaxed),
            max_depth: self.max,
            pinned: self.pinned,
            reads: c.hits + c.waits,
            waits: c.waits,
        }
    }

    fn set_depth(&self, depth: usize) {
        if !self.pinned {
            self.plan.depth.store(
                depth.clamp(1, self.max),
                std::sync::atomic::Ordering::Relaxed,
            );
        }
    }
}
