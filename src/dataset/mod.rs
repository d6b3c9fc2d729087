//! Datasets: what to read, and in which order each rank reads it.
//!
//! A [`Dataset`] is built from a [`Source`] (what is read) and an [`EpochOrder`] (shuffle seed,
//! rank and world size, equal counts per rank); every item has a stable position, so an
//! epoch's order, a checkpoint and a resume are the same whichever front end (the Rust API,
//! pipeline files, Python) built it. A [`Loader`](crate::loader::Loader) turns a dataset and
//! a media recipe into batches.
//!
//! Files, one format or idea each:
//! 1. `source` — [`Source`]: files, a directory, a list file, tar shards, Parquet (local or on
//!    S3), a weighted mixture; [`Labels`]; [`Remote`] (S3 endpoint and disk cache).
//! 2. `order` — [`EpochOrder`] and [`Ranks`]: shuffling, dealing to ranks, equal counts.
//! 3. `files` — [`Files`]: local paths (a directory walk, a list file), [`FolderLabels`].
//! 4. `shards/` — WebDataset tar shards, local or on S3 ([`shards::Shards`]).
//! 5. `parquet` (feature `parquet`) — Parquet rows ([`parquet::ParquetRows`]).
//! 6. `records` — samples whose fields are bytes: a tar shard's or a Parquet row's.
//! 7. `open` — opening a [`Source`] into a [`Dataset`] (labels, mixtures, S3 URLs).
//!
//! # Examples
//!
//! ```no_run
//! use flowgate::dataset::{Dataset, Labels, Source};
//!
//! let train = Dataset::builder(Source::dir("data/train").labels(Labels::Folder))
//!     .extensions(&["jpg", "jpeg"])
//!     .shuffle(42)          // a new order every epoch, the same for the same seed
//!     .build()?;            // RANK / WORLD_SIZE from the environment, if set
//! println!("{} items per epoch for this rank", train.len());
//! # Ok::<(), flowgate::PipelineError>(())
//! ```

mod extras;
mod files;
mod open;
mod order;
#[cfg(feature = "parquet")]
pub mod parquet;
mod records;
pub mod shards;
mod source;

use std::sync::Arc;

pub use extras::{fields_from_value, FieldKind, FieldSpec, FieldValue};
pub use files::{Files, FolderLabels};
pub use order::{EpochOrder, Ranks};
pub use source::{
    Labels, Remote, Source, DEFAULT_BUFFER, DEFAULT_FETCH_CONCURRENCY, DEFAULT_PARQUET_COLUMN,
    DEFAULT_PREFETCH,
};

use flowgate_actors::error::PipelineError;

use crate::blob::Blob;
use crate::sampler::Sampler;
use records::Records;
use shards::ShardError;

pub use crate::blob::Input;

/// One item as read: what to decode, and its label when the dataset has labels.
#[derive(Debug)]
pub struct Item {
    /// What to decode.
    pub input: Input,
    /// The item's label.
    pub label: Option<i64>,
    /// Its fields besides the media, in the order the source names them
    /// ([`Source::extra_fields`]).
    pub extras: Vec<FieldValue>,
}

/// A dataset: what to read and each epoch's order for this rank; cheap to clone. See the
/// [module docs](self).
#[derive(Clone, Debug)]
pub struct Dataset {
    kind: Kind,
    order: EpochOrder,
}

#[derive(Clone, Debug)]
enum Kind {
    /// Local files, with a label per file (in the files' order) if it has labels, and the
    /// fields read from the files beside each.
    Files {
        files: Files,
        labels: Option<Arc<[i64]>>,
        classes: Option<Arc<[String]>>,
        extras: Arc<[FieldSpec]>,
    },
    /// Tar shards or Parquet rows: each sample's first field among `media` is decoded; with
    /// `label`, that field is read as its label.
    Records {
        records: Records,
        media: Arc<[String]>,
        label: Option<String>,
        extras: Arc<[FieldSpec]>,
    },
    /// Several datasets drawn by weight: item `i` of the mixture is item `j` of part `s`
    /// (`sampler.locate(i)`).
    Mix {
        parts: Arc<[Dataset]>,
        sampler: Sampler,
    },
    /// Objects on S3, one item each (their keys as paths).
    #[cfg(feature = "s3")]
    Objects {
        s3: crate::s3::S3,
        keys: Files,
        concurrency: usize,
    },
}

/// Builds a [`Dataset`]: [`Dataset::builder`].
#[derive(Clone, Debug)]
pub struct DatasetBuilder {
    source: Source,
    order: EpochOrder,
    extensions: Vec<String>,
}

pub use crate::extensions::media_extensions;

impl DatasetBuilder {
    /// Shuffles with `seed`: a new order every epoch, the same for the same seed and epoch
    /// (default: the source's order).
    pub fn shuffle(mut self, seed: u64) -> Self {
        self.order.seed = Some(seed);
        self
    }

    /// The shuffle seed, or `None` for the source's order.
    pub fn shuffle_seed(mut self, seed: Option<u64>) -> Self {
        self.order.seed = seed;
        self
    }

    /// This process is rank `rank` of `world` (default: `RANK` and `WORLD_SIZE` from the
    /// environment, or the whole dataset when they are not set).
    pub fn ranks(mut self, rank: usize, world: usize) -> Self {
        self.order.ranks = Ranks::Fixed { rank, world };
        self
    }

    /// How the dataset is dealt to ranks (see [`Ranks`]).
    pub fn ranks_from(mut self, ranks: Ranks) -> Self {
        self.order.ranks = ranks;
        self
    }

    /// Reads worker `worker`'s part of this rank's share split among `workers` processes
    /// (PyTorch `DataLoader` workers): uneven by at most one item, never padded, so a rank's
    /// workers together read its share exactly once (see [`EpochOrder::split`]).
    pub fn split(mut self, worker: usize, workers: usize) -> Self {
        self.order.split = Some((worker, workers));
        self
    }

    /// With several ranks, drop the items past the smallest share instead of padding every
    /// share to the largest (default: pad; see [`EpochOrder::drop_last`]).
    pub fn drop_last(mut self, drop: bool) -> Self {
        self.order.drop_last = drop;
        self
    }

    /// The extensions of media files (directory walks) and of shard fields to decode, case
    /// insensitive, with or without the dot (default: every media extension this build
    /// decodes, [`media_extensions`]; a recipe's own are
    /// `flowgate::media::Recipe::extensions`).
    pub fn extensions(mut self, extensions: &[&str]) -> Self {
        self.extensions = extensions
            .iter()
            .map(|e| e.trim_start_matches('.').to_ascii_lowercase())
            .collect();
        self
    }

    /// Opens the source: walks directories, reads list files, indexes shards (or reads their
    /// manifest), reads Parquet footers, checks labels; errors name the source and the path.
    pub fn build(self) -> Result<Dataset, PipelineError> {
        open::open(&self.source, self.order, &self.extensions)
    }
}

impl Dataset {
    /// A dataset of `source`; see [`DatasetBuilder`].
    pub fn builder(source: Source) -> DatasetBuilder {
        DatasetBuilder {
            source,
            order: EpochOrder::default(),
            extensions: media_extensions().iter().map(|e| e.to_string()).collect(),
        }
    }

    /// How each epoch is ordered and dealt.
    pub fn order(&self) -> EpochOrder {
        self.order
    }

    /// The sampler of each epoch's order (this rank's share).
    pub fn sampler(&self) -> &Sampler {
        match &self.kind {
            Kind::Files { files, .. } => files.sampler(),
            Kind::Records { records, .. } => records.sampler(),
            Kind::Mix { sampler, .. } => sampler,
            #[cfg(feature = "s3")]
            Kind::Objects { keys, .. } => keys.sampler(),
        }
    }

    /// Items this rank reads per epoch.
    pub fn len(&self) -> usize {
        self.sampler().len()
    }

    /// Whether this rank reads nothing.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// Items in the whole dataset (every rank's; a mixture's draws per epoch).
    pub fn dataset_len(&self) -> usize {
        match &self.kind {
            Kind::Files { files, .. } => files.len(),
            Kind::Records { records, .. } => records.len(),
            Kind::Mix { sampler, .. } => sampler.dataset_len(),
            #[cfg(feature = "s3")]
            Kind::Objects { keys, .. } => keys.len(),
        }
    }

    /// The local files, if this is a dataset of files (all of them, in the source's order).
    pub fn files(&self) -> Option<&Files> {
        match &self.kind {
            Kind::Files { files, .. } => Some(files),
            _ => None,
        }
    }

    /// Whether every item is read by its position from this machine's disk, without a
    /// download (local files, tar shards or Parquet; not S3, not a mixture, whose draws
    /// change per epoch): what planning over every item before an epoch needs (length-aware
    /// batches read each clip's declared length first).
    pub fn reads_locally(&self) -> bool {
        match &self.kind {
            Kind::Files { .. } => true,
            Kind::Records { records, .. } => records.is_local(),
            _ => false,
        }
    }

    /// The fields besides the media each item carries ([`Item::extras`]), in order.
    pub fn extra_fields(&self) -> &[FieldSpec] {
        match &self.kind {
            Kind::Records { extras, .. } | Kind::Files { extras, .. } => extras,
            Kind::Mix { parts, .. } => parts.first().map_or(&[], |p| p.extra_fields()),
            #[cfg(feature = "s3")]
            Kind::Objects { .. } => &[],
        }
    }

    /// Whether every item has a label.
    pub fn has_labels(&self) -> bool {
        match &self.kind {
            Kind::Files { labels, .. } => labels.is_some(),
            Kind::Records { label, .. } => label.is_some(),
            Kind::Mix { parts, .. } => parts.iter().all(Dataset::has_labels),
            #[cfg(feature = "s3")]
            Kind::Objects { .. } => false,
        }
    }

    /// The class names (index = label) of [`Labels::Folder`].
    pub fn classes(&self) -> Option<&[String]> {
        match &self.kind {
            Kind::Files { classes, .. } => classes.as_deref(),
            _ => None,
        }
    }

    /// Memory the dataset holds outside the pipeline's stages (the Parquet row-group caches,
    /// one per Parquet source): what a loader reserves in its memory budget.
    pub fn reserved_bytes(&self) -> u64 {
        match &self.kind {
            Kind::Records { records, .. } => records.reserved_bytes(),
            Kind::Mix { parts, .. } => parts.iter().map(Dataset::reserved_bytes).sum(),
            _ => 0,
        }
    }

    /// The disk caches of tar shards on S3 (one per such source, a mixture's too): their
    /// [`stats`](shards::ShardCache::stats) say what each holds against its limit.
    #[cfg(feature = "s3")]
    pub fn shard_caches(&self) -> Vec<Arc<shards::ShardCache>> {
        match &self.kind {
            Kind::Records { records, .. } => records.shard_cache().into_iter().collect(),
            Kind::Mix { parts, .. } => parts.iter().flat_map(Dataset::shard_caches).collect(),
            _ => Vec::new(),
        }
    }

    /// The prefetch of tar shards on S3, for the tuner to deepen (see
    /// [`Shards::read_ahead`](shards::Shards::read_ahead)).
    pub fn read_ahead(&self) -> Option<Arc<dyn flowgate_actors::attached::ReadAheadControl>> {
        match &self.kind {
            Kind::Records { records, .. } => records.read_ahead(),
            _ => None,
        }
    }

    /// Tells the dataset which items (dataset indices, in order) this process reads in
    /// `epoch`: tar shards on S3 plan their downloads and their disk cache's evictions from
    /// it (a resumed epoch reads less than the sampler's share). A no-op for other sources.
    pub fn plan_reads(&self, epoch: u64, indices: &[usize]) {
        match &self.kind {
            Kind::Records { records, .. } => records.plan_reads(epoch, indices),
            Kind::Mix { parts, sampler } => {
                let mut each = vec![Vec::new(); parts.len()];
                for &i in indices {
                    let (s, j) = sampler.locate(i);
                    each[s].push(j);
                }
                for (part, reads) in parts.iter().zip(&each) {
                    part.plan_reads(epoch, reads);
                }
            }
            _ => {}
        }
    }

    /// What the epoch's order depends on, for checkpoints (a state taken from another
    /// dataset is refused on resume).
    pub fn fingerprint(&self) -> Vec<(&'static str, String)> {
        match &self.kind {
            // Labels do not change the order: a state resumes with or without them.
            Kind::Files { files, .. } => files.fingerprint(),
            // Nor do the fields besides the media.
            Kind::Records {
                records,
                media,
                label,
                ..
            } => {
                let mut f = records.fingerprint();
                f.push(("fields", media.join(",")));
                f.push(("label_field", label.clone().unwrap_or_default()));
                f
            }
            Kind::Mix { parts, sampler } => {
                let mut f = sampler.fingerprint();
                for (k, p) in parts.iter().enumerate() {
                    let fields: Vec<String> = p
                        .fingerprint()
                        .iter()
                        .map(|(n, v)| format!("{n}={v}"))
                        .collect();
                    f.push(("mixed_source", format!("{k}: {}", fields.join("; "))));
                }
                f
            }
            #[cfg(feature = "s3")]
            Kind::Objects { keys, .. } => keys.fingerprint(),
        }
    }

    /// Item `index`'s name in failures and paths: its path, or `SHARD:KEY`.
    pub fn name(&self, index: usize, epoch: u64) -> String {
        match &self.kind {
            Kind::Files { files, .. } => files.paths()[index].display().to_string(),
            Kind::Records { records, .. } => records.name(index, epoch),
            Kind::Mix { parts, sampler } => {
                let (s, j) = sampler.locate(index);
                parts[s].name(j, epoch)
            }
            #[cfg(feature = "s3")]
            Kind::Objects { keys, .. } => keys.paths()[index].display().to_string(),
        }
    }

    /// Reads item `index` (a position in the whole dataset, as the sampler gives it) of
    /// `epoch`: its path or its media field's bytes, and its label. (An S3 object is fetched
    /// here with a blocking GET; a loader fetches them on its I/O stage instead.)
    pub fn read(&self, index: usize, epoch: u64) -> Result<Item, ShardError> {
        match &self.kind {
            Kind::Files {
                files,
                labels,
                extras,
                ..
            } => {
                let path = &files.paths()[index];
                Ok(Item {
                    extras: extras::read_sidecars(path, extras)?,
                    input: Input::Path(path.clone()),
                    label: labels.as_ref().map(|l| l[index]),
                })
            }
            Kind::Records {
                records,
                media,
                label,
                extras,
            } => {
                // Only the media fields, the label and the extra fields are read: a sample's
                // other fields take no I/O and no memory.
                let mut raw = records.read(index, epoch, |ext| {
                    media.iter().any(|m| m == ext)
                        || label.as_deref() == Some(ext)
                        || extras.iter().any(|f| f.from.iter().any(|e| e == ext))
                })?;
                let values = extras::read(&raw, extras)?;
                let label = label.as_deref().map(|f| raw.take_label(f)).transpose()?;
                let (ext, bytes) = raw.take_required(media)?;
                let path = raw.field_path(&ext);
                Ok(Item {
                    input: Input::Bytes(Blob { path, bytes }),
                    label,
                    extras: values,
                })
            }
            Kind::Mix { parts, sampler } => {
                let (s, j) = sampler.locate(index);
                parts[s].read(j, epoch)
            }
            #[cfg(feature = "s3")]
            Kind::Objects { s3, keys, .. } => {
                let key = keys.paths()[index].to_string_lossy();
                let blob = s3.get_blocking(&key).map_err(|e| ShardError::Read {
                    shard: keys.paths()[index].clone(),
                    key: key.to_string(),
                    source: std::io::Error::other(e),
                })?;
                Ok(Item {
                    input: Input::Bytes(blob),
                    label: None,
                    extras: Vec::new(),
                })
            }
        }
    }

    /// S3 objects: the client, the keys (one per item, as paths) and the GETs in flight at
    /// the start.
    #[cfg(feature = "s3")]
    pub(crate) fn objects(&self) -> Option<(&crate::s3::S3, &Files, usize)> {
        match &self.kind {
            Kind::Objects {
                s3,
                keys,
                concurrency,
            } => Some((s3, keys, *concurrency)),
            _ => None,
        }
    }
}
