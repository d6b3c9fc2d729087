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
//! across ranks, and with [`ShardLengths::Pad`] or `Drop` every rank gets the same number of
//! samples. A resume is exact to the sample: a checkpoint records the samples delivered, and a
//! resumed epoch reads only the others (each sample is a byte range: nothing skipped is read or
//! decoded).
//!
//! Shards on S3 (feature `s3`; [`Shards::open_s3`], or [`Shards::open`] with an
//! `s3://bucket/pattern` URL) are downloaded whole, one streamed GET each, into a local disk
//! cache ([`remote::ShardCache`]: a byte limit, least recently used evicted first, but never a
//! shard with samples of the epoch still to read) and read from there; the next shards of the
//! rank's order are fetched ahead of the readers ([`prefetch`](Shards::prefetch)), and a body
//! cut off mid-stream continues with a ranged GET. Sample counts come from a manifest
//! ([`MANIFEST`], WebDataset's `wids` format, which [`write_shards`] and
//! [`Shards::write_manifest`] write), so opening reads no shard; without one, every shard is
//! downloaded and indexed when opened.
//!
//! Reading a sample ([`SampleRef::read`]) reads its fields' bytes; [`FieldMap`] turns them
//! into a [`Sample`] (images, audio and video through their [`Recipe`]s, `cls` into a label,
//! `txt`/`json` into text). Bad shards never stop the pipeline by themselves: a shard that is
//! cut off, garbage, empty, or has a member larger than the limit keeps the samples before the
//! damage and contributes one failing item naming the shard and the key or byte where it
//! broke; a sample missing a field, or a field that does not decode, fails naming shard, key
//! and field. All count against the pipeline's failure budget like any bad file.
//!
//! ```no_run
//! # #[cfg(feature = "image")] {
//! use flowgate::media::{image::ImageRecipe, Recipe};
//! use flowgate::sampler::ShardLengths;
//! use flowgate::shards::{FieldMap, Shards};
//! use flowgate::{Pipeline, Workers};
//!
//! let shards = Shards::open("/data/train/shard-{000000..000063}.tar")?
//!     .shuffle(42)                 // shards reshuffled every epoch
//!     .buffer(1000)                // and samples through a 1000-sample shuffle buffer
//!     .shard_from_env()?           // RANK / WORLD_SIZE
//!     .shard_lengths(ShardLengths::Pad);
//! let fields = FieldMap::new()
//!     .decode("image", &["jpg", "png", "webp"], Recipe::image(ImageRecipe::train(224)).unwrap())
//!     .label("label", "cls");
//! let mut pipeline = Pipeline::builder()
//!     .source_sampled(shards.sampler().clone(), shards.refs())
//!     .checkpoint_fields(shards.fingerprint())
//!     .describe(|r| r.to_string())
//!     .pipe("decode", move |r| fields.read(&r), Workers::initial(1))
//!     .aggregate(32, false)
//!     .pipe("collate", flowgate::sample::Batch::collate, 1)
//!     .build()?;
//! # }
//! # Ok::<(), flowgate::PipelineError>(())
//! ```

mod index;
#[cfg(feature = "s3")]
pub mod remote;
pub mod tar;

use std::fs::File;
use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex, OnceLock};

pub use index::{split_name, Entry, FieldAt};
#[cfg(feature = "s3")]
pub use remote::{CacheStats, ShardCache};

use crate::media::{MediaError, Recipe};
use crate::sample::Sample;
use crate::sampler::{Sampler, ShardLengths};
use crate::PipelineError;

/// The largest member a shard may declare by default: 1 GiB (a long video clip is far less).
pub const DEFAULT_MAX_MEMBER: u64 = 1 << 30;

/// Why a sample could not become a [`Sample`]. Every variant names the shard and the key.
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
    /// The sample lacks a field the [`FieldMap`] needs.
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
    /// A media field did not decode; its path is `SHARD/KEY.EXT`.
    #[error(transparent)]
    Media(#[from] MediaError),
}

struct Shard {
    /// The shard's path, or its `s3://bucket/key` URL.
    path: PathBuf,
    /// Its positions in the dataset: its entries, or a manifest's count of them.
    len: usize,
    body: Body,
}

enum Body {
    Local {
        entries: Vec<Entry>,
        file: OnceLock<Result<File, Arc<std::io::Error>>>,
    },
    /// A shard on S3, downloaded into the cache and indexed when first read (or when opened,
    /// without a manifest).
    #[cfg(feature = "s3")]
    Remote {
        cache: Arc<remote::ShardCache>,
        slot: usize,
        max_member: u64,
        entries: OnceLock<Vec<Entry>>,
    },
}

/// What reading a shard needs: its entries and an open file.
struct Opened<'a> {
    entries: &'a [Entry],
    file: FileRef<'a>,
}

enum FileRef<'a> {
    Borrowed(&'a File),
    #[cfg(feature = "s3")]
    Shared(Arc<File>),
}

impl std::ops::Deref for FileRef<'_> {
    type Target = File;
    fn deref(&self) -> &File {
        match self {
            FileRef::Borrowed(f) => f,
            #[cfg(feature = "s3")]
            FileRef::Shared(f) => f,
        }
    }
}

impl Shard {
    /// The entries known without reading anything (all of a local shard's; a remote shard's
    /// once it has been read).
    fn known_entries(&self) -> &[Entry] {
        match &self.body {
            Body::Local { entries, .. } => entries,
            #[cfg(feature = "s3")]
            Body::Remote { entries, .. } => entries.get().map_or(&[], Vec::as_slice),
        }
    }

    /// The entries and an open file, fetching a remote shard first.
    fn open(&self) -> Result<Opened<'_>, std::io::Error> {
        match &self.body {
            Body::Local { entries, file } => {
                match file.get_or_init(|| File::open(&self.path).map_err(Arc::new)) {
                    Ok(f) => Ok(Opened {
                        entries,
                        file: FileRef::Borrowed(f),
                    }),
                    Err(e) => Err(std::io::Error::new(e.kind(), e.to_string())),
                }
            }
            #[cfg(feature = "s3")]
            Body::Remote {
                cache,
                slot,
                max_member,
                entries,
            } => {
                let file = cache
                    .file(*slot)
                    .map_err(|e| std::io::Error::other(e.to_string()))?;
                let entries = entries.get_or_init(|| index_file(&file, *max_member));
                Ok(Opened {
                    entries,
                    file: FileRef::Shared(file),
                })
            }
        }
    }
}

/// Indexes an open shard file from its start.
fn index_file(file: &File, max_member: u64) -> Vec<Entry> {
    use std::io::{Seek, SeekFrom};
    let mut f = file;
    let input = f
        .seek(SeekFrom::Start(0))
        .and_then(|_| tar::Seekable::new(std::io::BufReader::with_capacity(8 << 10, f)));
    match input {
        Ok(input) => index::index(input, max_member),
        Err(e) => vec![Entry {
            key: "@byte 0".into(),
            fields: Vec::new(),
            problem: Some(format!("reading the shard: {e}").into()),
        }],
    }
}

struct Inner {
    shards: Vec<Shard>,
    /// For each dataset index, (shard, entry).
    at: Vec<(u32, u32)>,
}

impl Inner {
    fn new(shards: Vec<Shard>) -> Result<(Self, Sampler), PipelineError> {
        if shards.is_empty() {
            return Err(PipelineError::config("no shards given"));
        }
        let at: Vec<(u32, u32)> = shards
            .iter()
            .enumerate()
            .flat_map(|(s, sh)| (0..sh.len).map(move |e| (s as u32, e as u32)))
            .collect();
        let lengths: Vec<usize> = shards.iter().map(|s| s.len).collect();
        let sampler = Sampler::new(at.len()).groups(&lengths)?;
        Ok((Self { shards, at }, sampler))
    }
}

/// An epoch, its shards in the order a rank first visits them, and each one's place in it.
type EpochOrder = (
    u64,
    Arc<Vec<u32>>,
    Arc<std::collections::HashMap<u32, usize>>,
);

/// Which shards come next in an epoch, for prefetching remote shards ahead of the readers.
struct Plan {
    sampler: Sampler,
    depth: usize,
    /// The epoch, and its shards in the order this rank first visits them, with each one's
    /// place in that order.
    order: Mutex<Option<EpochOrder>>,
}

impl Plan {
    /// This rank's samples of each shard in `epoch`.
    #[cfg(feature = "s3")]
    fn counts(&self, inner: &Inner, epoch: u64) -> Vec<u32> {
        let mut counts = vec![0u32; inner.shards.len()];
        for i in self.sampler.epoch(epoch) {
            counts[inner.at[i].0 as usize] += 1;
        }
        counts
    }

    /// The `depth` shards this rank visits after `shard` in `epoch`.
    #[cfg_attr(not(feature = "s3"), allow(dead_code))]
    fn ahead(&self, inner: &Inner, epoch: u64, shard: u32) -> Vec<u32> {
        if self.depth == 0 {
            return Vec::new();
        }
        let (order, place) = {
            let mut o = self.order.lock().unwrap_or_else(|p| p.into_inner());
            match &*o {
                Some((e, order, place)) if *e == epoch => (Arc::clone(order), Arc::clone(place)),
                _ => {
                    let mut seen = std::collections::HashMap::new();
                    let mut order = Vec::new();
                    for i in self.sampler.epoch(epoch) {
                        let s = inner.at[i].0;
                        seen.entry(s).or_insert_with(|| {
                            order.push(s);
                            order.len() - 1
                        });
                    }
                    let (order, place) = (Arc::new(order), Arc::new(seen));
                    *o = Some((epoch, Arc::clone(&order), Arc::clone(&place)));
                    (order, place)
                }
            }
        };
        match place.get(&shard) {
            Some(&k) => order.iter().skip(k + 1).take(self.depth).copied().collect(),
            None => Vec::new(),
        }
    }
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

/// Expands shell-style brace ranges and lists: `shard-{000..002}.tar` → `shard-000.tar`,
/// `shard-001.tar`, `shard-002.tar` (numbers keep the first bound's zero padding);
/// `{a,b}.tar` → `a.tar`, `b.tar`. Several braces multiply. A pattern without braces is
/// itself. An unclosed brace or a range whose end is below its start is an error.
pub fn expand_braces(pattern: &str) -> Result<Vec<String>, PipelineError> {
    let Some(open) = pattern.find('{') else {
        return Ok(vec![pattern.to_owned()]);
    };
    let close = pattern[open..]
        .find('}')
        .map(|c| c + open)
        .ok_or_else(|| PipelineError::config(format!("{pattern:?}: a '{{' without '}}'")))?;
    let (head, body, tail) = (
        &pattern[..open],
        &pattern[open + 1..close],
        &pattern[close + 1..],
    );
    let choices: Vec<String> = if let Some((a, b)) = body.split_once("..") {
        let (lo, hi) = (a.parse::<u64>(), b.parse::<u64>());
        let (Ok(lo), Ok(hi)) = (lo, hi) else {
            return Err(PipelineError::config(format!(
                "{pattern:?}: {{{body}}} is not a range of numbers"
            )));
        };
        if hi < lo {
            return Err(PipelineError::config(format!(
                "{pattern:?}: the range {{{body}}} ends below its start"
            )));
        }
        let width = a.len();
        (lo..=hi).map(|i| format!("{i:0width$}")).collect()
    } else {
        body.split(',').map(str::to_owned).collect()
    };
    let rest = expand_braces(tail)?;
    Ok(choices
        .iter()
        .flat_map(|c| rest.iter().map(move |r| format!("{head}{c}{r}")))
        .collect())
}

/// The paths a spec names: brace patterns, several separated by commas outside braces.
fn expand_spec(spec: &str) -> Result<Vec<String>, PipelineError> {
    let mut paths = Vec::new();
    let (mut depth, mut start) = (0i32, 0);
    for (i, c) in spec.char_indices() {
        match c {
            '{' => depth += 1,
            '}' => depth -= 1,
            ',' if depth == 0 => {
                paths.extend(expand_braces(&spec[start..i])?);
                start = i + 1;
            }
            _ => {}
        }
    }
    paths.extend(expand_braces(&spec[start..])?);
    paths.retain(|p| !p.is_empty());
    Ok(paths)
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

    /// Makes every rank's share the same length (see [`ShardLengths`]).
    pub fn shard_lengths(self, lengths: ShardLengths) -> Self {
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
        use crate::media::rules::{fnv1a, FNV_OFFSET};
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
                depth: self.prefetch,
                order: Mutex::new(None),
            })
        }))
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

    /// The download cache of shards on S3 (`None` for local shards).
    #[cfg(feature = "s3")]
    pub fn cache(&self) -> Option<&Arc<ShardCache>> {
        self.inner.shards.iter().find_map(|s| match &s.body {
            Body::Remote { cache, .. } => Some(cache),
            Body::Local { .. } => None,
        })
    }
}

/// One sample's place: which shard, which entry; cheap to make and to skip. [`read`] reads its
/// bytes.
///
/// [`read`]: SampleRef::read
#[derive(Clone)]
pub struct SampleRef {
    shards: Arc<Inner>,
    #[cfg_attr(not(feature = "s3"), allow(dead_code))]
    plan: Arc<Plan>,
    index: usize,
    epoch: u64,
}

impl std::fmt::Debug for SampleRef {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "SampleRef({self})")
    }
}

impl std::fmt::Display for SampleRef {
    /// `SHARD:KEY`; `SHARD:#N` (the sample's place) for a shard on S3 not read yet.
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let (shard, e) = self.place();
        match shard.known_entries().get(e) {
            Some(entry) => write!(f, "{}:{}", shard.path.display(), entry.key),
            None => write!(f, "{}:#{e}", shard.path.display()),
        }
    }
}

impl SampleRef {
    fn place(&self) -> (&Shard, usize) {
        let (s, e) = self.shards.at[self.index];
        (&self.shards.shards[s as usize], e as usize)
    }

    /// The shard's path (or `s3://` URL).
    pub fn shard(&self) -> &Path {
        &self.place().0.path
    }

    /// The sample's key, when known without reading (always for local shards; for a shard
    /// on S3 once it has been read).
    pub fn key(&self) -> Option<&str> {
        let (shard, e) = self.place();
        shard.known_entries().get(e).map(|x| x.key.as_str())
    }

    /// The dataset index.
    pub fn index(&self) -> usize {
        self.index
    }

    /// The epoch it is read in (augmentation seeds use it).
    pub fn epoch(&self) -> u64 {
        self.epoch
    }

    /// Reads the sample's fields (one positioned read per field; no shared file position, so
    /// any number of threads read at once). A shard on S3 is downloaded first (or waited
    /// for), and the next shards of this rank's order are started.
    pub fn read(&self) -> Result<RawSample, ShardError> {
        let (shard, e) = self.place();
        #[cfg(feature = "s3")]
        let _done = match &shard.body {
            Body::Remote { cache, slot, .. } => {
                let s = self.shards.at[self.index].0;
                cache.begin_epoch(self.epoch, || self.plan.counts(&self.shards, self.epoch));
                for next in self.plan.ahead(&self.shards, self.epoch, s) {
                    if let Body::Remote { slot, .. } = &self.shards.shards[next as usize].body {
                        cache.prefetch(*slot);
                    }
                }
                Some(remote::Done(cache, *slot, self.epoch))
            }
            Body::Local { .. } => None,
        };
        let opened = shard.open().map_err(|source| ShardError::Read {
            shard: shard.path.clone(),
            key: format!("#{e}"),
            source,
        })?;
        let damaged = |key: &str, reason: Arc<str>| ShardError::Damaged {
            shard: shard.path.clone(),
            key: key.to_owned(),
            reason,
        };
        let found = opened.entries.len();
        if found != shard.len && (e + 1 >= shard.len || e >= found) {
            // A manifest that disagrees with the shard: its last place (or every place past
            // the shard's end) reports it, so no sample goes missing silently.
            let key = opened
                .entries
                .get(e)
                .map_or(format!("#{e}"), |x| x.key.clone());
            return Err(damaged(
                &key,
                format!(
                    "the manifest says {} samples, the shard holds {found}",
                    shard.len
                )
                .into(),
            ));
        }
        let entry = &opened.entries[e];
        if let Some(reason) = &entry.problem {
            return Err(damaged(&entry.key, Arc::clone(reason)));
        }
        let read_err = |source| ShardError::Read {
            shard: shard.path.clone(),
            key: entry.key.clone(),
            source,
        };
        let mut fields = Vec::with_capacity(entry.fields.len());
        for f in &entry.fields {
            let mut bytes = vec![0u8; f.size as usize];
            read_at(&opened.file, &mut bytes, f.offset).map_err(read_err)?;
            fields.push((f.ext.clone(), bytes));
        }
        Ok(RawSample {
            shard: shard.path.clone(),
            key: entry.key.clone(),
            epoch: self.epoch,
            fields,
        })
    }
}

#[cfg(unix)]
fn read_at(file: &File, buf: &mut [u8], offset: u64) -> std::io::Result<()> {
    std::os::unix::fs::FileExt::read_exact_at(file, buf, offset)
}

#[cfg(not(unix))]
fn read_at(file: &File, buf: &mut [u8], offset: u64) -> std::io::Result<()> {
    use std::io::{Read, Seek};
    let mut f = file;
    f.seek(std::io::SeekFrom::Start(offset))?;
    f.read_exact(buf)
}

/// A sample's fields as bytes, as read from its shard.
#[derive(Debug)]
pub struct RawSample {
    /// The shard.
    pub shard: PathBuf,
    /// The key.
    pub key: String,
    /// The epoch it was read in.
    pub epoch: u64,
    /// `(extension, bytes)`, in archive order.
    pub fields: Vec<(String, Vec<u8>)>,
}

impl RawSample {
    /// The bytes of the first field whose extension is one of `exts`.
    pub fn take(&mut self, exts: &[String]) -> Option<(String, Vec<u8>)> {
        let i = self
            .fields
            .iter()
            .position(|(e, _)| exts.iter().any(|x| x == e))?;
        Some(self.fields.swap_remove(i))
    }

    /// Takes the first field whose extension is one of `exts`, or fails naming what the
    /// sample has.
    pub fn take_required(&mut self, exts: &[String]) -> Result<(String, Vec<u8>), ShardError> {
        self.take(exts).ok_or_else(|| ShardError::Missing {
            shard: self.shard.clone(),
            key: self.key.clone(),
            wanted: exts.join(" or "),
            has: match self.extensions() {
                e if e.is_empty() => "nothing".into(),
                e => e.join(", "),
            },
        })
    }

    /// Takes the first field among `exts` and decodes it with `recipe` (the sample's epoch's
    /// augmentation, seeded by `SHARD/KEY.EXT`).
    pub fn decode_first(
        &mut self,
        exts: &[String],
        recipe: &Recipe,
    ) -> Result<crate::Tensor, ShardError> {
        let (ext, bytes) = self.take_required(exts)?;
        let path = self.field_path(&ext);
        Ok(recipe
            .for_epoch(self.epoch)
            .decode(crate::Blob { path, bytes })?)
    }

    /// Takes the field `ext` and reads it as an integer label (WebDataset's `cls`: decimal
    /// text), failing naming the field if it is missing or not an integer.
    pub fn take_label(&mut self, ext: &str) -> Result<i64, ShardError> {
        let (ext, bytes) = self.take_required(&[ext.to_owned()])?;
        self.parse_label(ext, &bytes)
    }

    fn parse_label(&self, ext: String, bytes: &[u8]) -> Result<i64, ShardError> {
        let err = |reason: String| ShardError::Field {
            shard: self.shard.clone(),
            key: self.key.clone(),
            ext: ext.clone(),
            reason,
        };
        let text =
            std::str::from_utf8(bytes).map_err(|_| err("a label that is not text".into()))?;
        text.trim().parse().map_err(|_| {
            err(format!(
                "{:?} is not an integer label",
                text.chars().take(40).collect::<String>()
            ))
        })
    }

    /// The extensions of the fields left, sorted.
    pub fn extensions(&self) -> Vec<&str> {
        let mut e: Vec<&str> = self.fields.iter().map(|(e, _)| e.as_str()).collect();
        e.sort_unstable();
        e
    }

    /// `SHARD/KEY.EXT`: how errors and augmentation seeds name a field.
    pub fn field_path(&self, ext: &str) -> PathBuf {
        self.shard.join(format!("{}.{ext}", self.key))
    }

    /// Bytes of all fields.
    pub fn nbytes(&self) -> usize {
        self.fields.iter().map(|(_, b)| b.len()).sum()
    }
}

#[derive(Clone, Debug)]
enum Kind {
    Decode(Recipe),
    Label,
    Text,
}

#[derive(Clone, Debug)]
struct Rule {
    name: String,
    exts: Vec<String>,
    kind: Kind,
    optional: bool,
}

/// Which extensions of a sample become which fields of a [`Sample`], and how.
///
/// Each rule names the sample field, the extensions it is read from (the first present wins:
/// `["jpg", "png", "webp"]`), and what it becomes. Rules are required by default: a sample
/// without any of a rule's extensions fails with [`ShardError::Missing`]; extensions no rule
/// names are ignored.
#[derive(Clone, Debug, Default)]
pub struct FieldMap {
    rules: Vec<Rule>,
}

impl FieldMap {
    /// No fields.
    pub fn new() -> Self {
        Self::default()
    }

    fn rule(mut self, name: &str, exts: &[&str], kind: Kind) -> Self {
        self.rules.push(Rule {
            name: name.to_owned(),
            exts: exts.iter().map(|e| e.to_ascii_lowercase()).collect(),
            kind,
            optional: false,
        });
        self
    }

    /// `name` decoded from the first of `exts` by `recipe` (an image, audio or video recipe;
    /// its augmentation seeded per epoch and by `SHARD/KEY.EXT`).
    pub fn decode(self, name: &str, exts: &[&str], recipe: Recipe) -> Self {
        self.rule(name, exts, Kind::Decode(recipe))
    }

    /// `name` as an integer label read from `ext`'s text (WebDataset's `cls`).
    pub fn label(self, name: &str, ext: &str) -> Self {
        self.rule(name, &[ext], Kind::Label)
    }

    /// `name` as the UTF-8 text of `ext` (`txt`, `json`: kept as text).
    pub fn text(self, name: &str, ext: &str) -> Self {
        self.rule(name, &[ext], Kind::Text)
    }

    /// Makes the rule added last optional: a sample without it has no such field.
    pub fn optional(mut self) -> Self {
        if let Some(r) = self.rules.last_mut() {
            r.optional = true;
        }
        self
    }

    /// Reads the sample at `r` and makes it a [`Sample`].
    pub fn read(&self, r: &SampleRef) -> Result<Sample, ShardError> {
        self.apply(r.read()?)
    }

    /// Makes the fields of `raw` a [`Sample`].
    pub fn apply(&self, mut raw: RawSample) -> Result<Sample, ShardError> {
        let has = raw.extensions().join(", ");
        let mut sample = Sample::new();
        for rule in &self.rules {
            let (ext, bytes) = match raw.take_required(&rule.exts) {
                Ok(f) => f,
                Err(_) if rule.optional => continue,
                Err(ShardError::Missing {
                    shard, key, wanted, ..
                }) => {
                    // Name every field the sample came with, not only those left.
                    return Err(ShardError::Missing {
                        shard,
                        key,
                        wanted,
                        has: if has.is_empty() {
                            "nothing".into()
                        } else {
                            has
                        },
                    });
                }
                Err(e) => return Err(e),
            };
            sample = match &rule.kind {
                Kind::Decode(recipe) => {
                    let path = raw.field_path(&ext);
                    let t = recipe
                        .for_epoch(raw.epoch)
                        .decode(crate::Blob { path, bytes })?;
                    sample.with(&rule.name, t)
                }
                Kind::Label => {
                    let v = raw.parse_label(ext, &bytes)?;
                    sample.with(&rule.name, v)
                }
                Kind::Text => {
                    let text = String::from_utf8(bytes).map_err(|e| ShardError::Field {
                        shard: raw.shard.clone(),
                        key: raw.key.clone(),
                        ext: ext.clone(),
                        reason: format!("not UTF-8 text ({e})"),
                    })?;
                    sample.with(&rule.name, text)
                }
            };
        }
        Ok(sample)
    }
}

/// Writes the files at `paths` into tar shards of `per_shard` samples in `out` (created if
/// missing), `shard-000000.tar`, …, as `webdataset` and the peers' scripts lay them out: sample
/// `i` is `{i:08}.EXT` (the file's bytes, its extension lower-cased), `{i:08}.cls` (the label
/// `label(i, path)`, as text) and `{i:08}.json` (`{"path": ...}`); and their manifest,
/// [`MANIFEST`]. Returns the shards' brace pattern.
pub fn write_shards(
    paths: &[PathBuf],
    out: &Path,
    per_shard: usize,
    label: impl Fn(usize, &Path) -> i64,
) -> std::io::Result<String> {
    let per_shard = per_shard.max(1);
    std::fs::create_dir_all(out)?;
    let n = paths.len().div_ceil(per_shard);
    let mut written = Vec::with_capacity(n);
    for s in 0..n {
        let mut members = Vec::new();
        for (i, path) in paths.iter().enumerate().skip(s * per_shard).take(per_shard) {
            let ext = path
                .extension()
                .map_or("bin".into(), |e| e.to_string_lossy().to_ascii_lowercase());
            let key = format!("{i:08}");
            members.push((format!("{key}.{ext}"), std::fs::read(path)?));
            members.push((
                format!("{key}.cls"),
                label(i, path).to_string().into_bytes(),
            ));
            let json = format!("{{\"path\": {:?}}}", path.display().to_string());
            members.push((format!("{key}.json"), json.into_bytes()));
        }
        let path = out.join(format!("shard-{s:06}.tar"));
        let file = std::fs::File::create(&path)?;
        let samples = members.len() / 3;
        tar::write_archive(std::io::BufWriter::new(file), members)?;
        written.push((path, samples));
    }
    std::fs::write(out.join(MANIFEST), manifest_json(&written, out))?;
    Ok(format!(
        "{}/shard-{{000000..{:06}}}.tar",
        out.display(),
        n.saturating_sub(1)
    ))
}

/// The manifest of local shards in WebDataset's `wids` format (`{"shardlist": [{"url",
/// "nsamples"}]}`), URLs relative to `folder` where they are under it.
fn manifest_json(shards: &[(PathBuf, usize)], folder: &Path) -> String {
    let list: Vec<serde_json::Value> = shards
        .iter()
        .map(|(p, n)| {
            let url = p.strip_prefix(folder).unwrap_or(p);
            serde_json::json!({"url": url.to_string_lossy(), "nsamples": n})
        })
        .collect();
    serde_json::to_string_pretty(&serde_json::json!({
        "__kind__": "wids-shard-index-v1",
        "wids_version": 1,
        "shardlist": list,
    }))
    .expect("a manifest serialises")
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn braces_expand_like_the_shell() {
        assert_eq!(
            expand_braces("s-{008..011}.tar").unwrap(),
            ["s-008.tar", "s-009.tar", "s-010.tar", "s-011.tar"]
        );
        assert_eq!(
            expand_braces("{a,b}/{0..1}").unwrap(),
            ["a/0", "a/1", "b/0", "b/1"]
        );
        assert_eq!(expand_braces("plain.tar").unwrap(), ["plain.tar"]);
        assert!(expand_braces("x-{3..1}").is_err());
        assert!(expand_braces("x-{1..").is_err());
        assert!(expand_braces("x-{a..b}").is_err());
    }
}
