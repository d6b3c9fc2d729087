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
pub mod tar;

use std::fs::File;
use std::path::{Path, PathBuf};
use std::sync::{Arc, OnceLock};

pub use index::{split_name, Entry, FieldAt};

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
    path: PathBuf,
    entries: Vec<Entry>,
    file: OnceLock<Result<File, Arc<std::io::Error>>>,
}

struct Inner {
    shards: Vec<Shard>,
    /// For each dataset index, (shard, entry).
    at: Vec<(u32, u32)>,
}

/// A set of tar shards as a dataset of samples; see the [module docs](self).
#[derive(Clone)]
pub struct Shards {
    inner: Arc<Inner>,
    sampler: Sampler,
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

impl Shards {
    /// The shards named by `spec`: a path or brace pattern, or several separated by commas
    /// outside braces (`a.tar,b.tar`), or a directory (its `.tar` files, sorted); see
    /// [`open_paths`](Self::open_paths).
    pub fn open(spec: &str) -> Result<Self, PipelineError> {
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
        Self::open_paths(paths.into_iter().filter(|p| !p.is_empty()))
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
                    "{}: shards on S3 are not read yet; copy them locally (aws s3 sync) and \
                     open the local paths",
                    path.display()
                )));
            }
            let file = File::open(&path).map_err(|e| {
                PipelineError::io(format!("opening the shard {}", path.display()), e)
            })?;
            let input = tar::Seekable::new(std::io::BufReader::with_capacity(8 << 10, file))
                .map_err(|e| {
                    PipelineError::io(format!("opening the shard {}", path.display()), e)
                })?;
            let entries = index::index(input, max_member);
            shards.push(Shard {
                path,
                entries,
                file: OnceLock::new(),
            });
        }
        if shards.is_empty() {
            return Err(PipelineError::config("no shards given"));
        }
        let at: Vec<(u32, u32)> = shards
            .iter()
            .enumerate()
            .flat_map(|(s, sh)| (0..sh.entries.len()).map(move |e| (s as u32, e as u32)))
            .collect();
        let lengths: Vec<usize> = shards.iter().map(|s| s.entries.len()).collect();
        let sampler = Sampler::new(at.len()).groups(&lengths)?;
        Ok(Self {
            inner: Arc::new(Inner { shards, at }),
            sampler,
        })
    }

    fn map_sampler(mut self, f: impl FnOnce(Sampler) -> Sampler) -> Self {
        self.sampler = f(self.sampler);
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

    /// Keeps rank `rank`'s share of a world of `world` (one contiguous block of each epoch's
    /// order).
    pub fn shard(mut self, rank: usize, world: usize) -> Result<Self, PipelineError> {
        self.sampler = self.sampler.shard(rank, world)?;
        Ok(self)
    }

    /// Shards by `RANK` and `WORLD_SIZE` (see [`Sampler::shard_from_env`]).
    pub fn shard_from_env(mut self) -> Result<Self, PipelineError> {
        self.sampler = self.sampler.shard_from_env()?;
        Ok(self)
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

    /// The damaged places found when indexing: (shard, key, reason).
    pub fn damage(&self) -> Vec<(&Path, &str, &str)> {
        self.inner
            .shards
            .iter()
            .flat_map(|s| {
                s.entries.iter().filter_map(|e| {
                    e.problem
                        .as_deref()
                        .map(|p| (s.path.as_path(), e.key.as_str(), p))
                })
            })
            .collect()
    }

    /// What a checkpoint over these shards depends on (for
    /// [`PipelineBuilder::checkpoint_fields`](crate::PipelineBuilder::checkpoint_fields)):
    /// the dataset (every shard's path and sample keys, hashed) and the sampler's settings.
    pub fn fingerprint(&self) -> Vec<(&'static str, String)> {
        use crate::media::rules::{fnv1a, FNV_OFFSET};
        let hash = self.inner.shards.iter().fold(FNV_OFFSET, |h, s| {
            let h = fnv1a(fnv1a(h, s.path.as_os_str().as_encoded_bytes()), b"\0");
            s.entries
                .iter()
                .fold(h, |h, e| fnv1a(fnv1a(h, e.key.as_bytes()), b"\0"))
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

    /// The sample at dataset index `index` in `epoch`.
    pub fn get(&self, epoch: u64, index: usize) -> SampleRef {
        SampleRef {
            shards: Arc::clone(&self.inner),
            index,
            epoch,
        }
    }

    /// `(epoch, index) → SampleRef`, for
    /// [`source_sampled`](crate::PipelineBuilder::source_sampled).
    pub fn refs(&self) -> impl Fn(u64, usize) -> SampleRef + Send + Sync + 'static {
        let me = self.clone();
        move |epoch, index| me.get(epoch, index)
    }

    /// This rank's samples of `epoch`, in the order it visits them.
    pub fn epoch(&self, epoch: u64) -> Vec<SampleRef> {
        self.sampler
            .epoch(epoch)
            .into_iter()
            .map(|i| self.get(epoch, i))
            .collect()
    }
}

/// One sample's place: which shard, which entry; cheap to make and to skip. [`read`] reads its
/// bytes.
///
/// [`read`]: SampleRef::read
#[derive(Clone)]
pub struct SampleRef {
    shards: Arc<Inner>,
    index: usize,
    epoch: u64,
}

impl std::fmt::Debug for SampleRef {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "SampleRef({self})")
    }
}

impl std::fmt::Display for SampleRef {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let (shard, entry) = self.place();
        write!(f, "{}:{}", shard.path.display(), entry.key)
    }
}

impl SampleRef {
    fn place(&self) -> (&Shard, &Entry) {
        let (s, e) = self.shards.at[self.index];
        let shard = &self.shards.shards[s as usize];
        (shard, &shard.entries[e as usize])
    }

    /// The shard's path.
    pub fn shard(&self) -> &Path {
        &self.place().0.path
    }

    /// The sample's key.
    pub fn key(&self) -> &str {
        &self.place().1.key
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
    /// any number of threads read at once).
    pub fn read(&self) -> Result<RawSample, ShardError> {
        let (shard, entry) = self.place();
        if let Some(reason) = &entry.problem {
            return Err(ShardError::Damaged {
                shard: shard.path.clone(),
                key: entry.key.clone(),
                reason: Arc::clone(reason),
            });
        }
        let read_err = |source| ShardError::Read {
            shard: shard.path.clone(),
            key: entry.key.clone(),
            source,
        };
        let file = match shard
            .file
            .get_or_init(|| File::open(&shard.path).map_err(Arc::new))
        {
            Ok(f) => f,
            Err(e) => return Err(read_err(std::io::Error::new(e.kind(), e.to_string()))),
        };
        let mut fields = Vec::with_capacity(entry.fields.len());
        for f in &entry.fields {
            let mut bytes = vec![0u8; f.size as usize];
            read_at(file, &mut bytes, f.offset).map_err(read_err)?;
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
/// `label(i, path)`, as text) and `{i:08}.json` (`{"path": ...}`). Returns the shards' brace
/// pattern.
pub fn write_shards(
    paths: &[PathBuf],
    out: &Path,
    per_shard: usize,
    label: impl Fn(usize, &Path) -> i64,
) -> std::io::Result<String> {
    let per_shard = per_shard.max(1);
    std::fs::create_dir_all(out)?;
    let n = paths.len().div_ceil(per_shard);
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
        let file = std::fs::File::create(out.join(format!("shard-{s:06}.tar")))?;
        tar::write_archive(std::io::BufWriter::new(file), members)?;
    }
    Ok(format!(
        "{}/shard-{{000000..{:06}}}.tar",
        out.display(),
        n.saturating_sub(1)
    ))
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
