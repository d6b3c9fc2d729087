//! [`Source`]: what a dataset reads, described before anything is opened — files, a
//! directory, a list file, tar shards, Parquet files (local or on S3), or a weighted mixture
//! of them — with where each item's label comes from ([`Labels`]).

use std::collections::HashMap;
use std::path::PathBuf;

use crate::sampler::MixStop;

/// Where items' labels come from.
#[derive(Clone, Debug, PartialEq)]
pub enum Labels {
    /// Classes from folders, numbered in sorted order. Of a directory, as torchvision's
    /// `ImageFolder`: every folder at its root is a class, a file's label is the top-level
    /// folder it lies under (at any depth), files at the root are left out, and a class folder
    /// without a file to read is an error. Of a list of paths: each file's parent folder.
    /// Files only.
    Folder,
    /// One label per file, in the source's order. Files only.
    Values(Vec<i64>),
    /// A label per path (as the source lists it). Files only.
    ByPath(HashMap<PathBuf, i64>),
    /// A field of each sample: a tar shard member's extension (`cls`: its text is the
    /// integer) or a Parquet column (integer or boolean). Shards and Parquet only.
    Field(String),
}

/// How tar shards on S3 are reached and cached (ignored for local shards).
#[derive(Clone, Debug, PartialEq)]
pub struct Remote {
    /// An S3-compatible endpoint (`http://host:port`); else `AWS_ENDPOINT_URL`, else AWS.
    pub endpoint: Option<String>,
    /// The region; else the AWS chain's, else `us-east-1`.
    pub region: Option<String>,
    /// The disk cache's folder (default: `$FLOWGATE_SHARD_CACHE`, else
    /// `$XDG_CACHE_HOME/flowgate/shards`, else `~/.cache/flowgate/shards`, else the temporary
    /// directory's `flowgate-shards`: `shards::default_dir`).
    pub cache_dir: Option<PathBuf>,
    /// Bytes of shards kept on disk beyond those being read (default 0: later epochs fetch
    /// again; set it to the corpus's size to read later epochs from disk).
    pub cache_bytes: u64,
    /// Shards fetched ahead of the readers (default 2; the tuner deepens it when readers
    /// wait for downloads).
    pub prefetch: usize,
}

impl Default for Remote {
    fn default() -> Self {
        Self {
            endpoint: None,
            region: None,
            cache_dir: None,
            cache_bytes: 0,
            prefetch: DEFAULT_PREFETCH,
        }
    }
}

/// What a [`Dataset`](super::Dataset) reads. Build one with a constructor, then set its
/// labels, fields or shuffle buffer.
///
/// # Examples
///
/// ```no_run
/// use flowgate::dataset::{Labels, Source};
///
/// let photos = Source::dir("data/train").labels(Labels::Folder);
/// let shards = Source::shards("data/shard-{000000..000015}.tar").labels(Labels::Field("cls".into()));
/// let rows = Source::parquet(["data/extra.parquet"], "image").labels(Labels::Field("label".into()));
/// let mixed = Source::mix([shards, rows], [0.8, 0.2]);
/// # let _ = (photos, mixed);
/// ```
#[derive(Clone, Debug)]
pub struct Source {
    pub(crate) kind: SourceKind,
    pub(crate) labels: Option<Labels>,
    /// Fields besides the media (shards and Parquet; a mixture's parts).
    pub(crate) extras: Vec<super::FieldSpec>,
    /// A shuffle buffer in samples (shards and Parquet: samples are read in stream order
    /// within a shard or row group and mixed through it), used when the dataset shuffles.
    pub(crate) buffer: usize,
}

#[derive(Clone, Debug)]
pub(crate) enum SourceKind {
    Paths(Vec<PathBuf>),
    Dir(PathBuf, Option<Vec<String>>),
    List(PathBuf),
    Shards {
        pattern: String,
        fields: Option<Vec<String>>,
        remote: Remote,
    },
    Parquet {
        paths: Vec<PathBuf>,
        column: String,
        endpoint: Option<String>,
        region: Option<String>,
    },
    Mix {
        parts: Vec<Source>,
        weights: Vec<f64>,
        stop: MixStop,
    },
    #[cfg(feature = "s3")]
    Objects {
        client: Option<crate::s3::S3>,
        bucket: String,
        prefix: String,
        remote: Remote,
        concurrency: usize,
    },
}

/// The Parquet column of the media by default (a Hugging Face image dataset's `image`:
/// `struct<bytes, path>`).
pub const DEFAULT_PARQUET_COLUMN: &str = "image";

/// Objects fetched at once from S3 by default, before the tuner changes it: S3 serves each
/// GET with tens of milliseconds of latency, so a few dozen in flight keep a decoder fed.
pub const DEFAULT_FETCH_CONCURRENCY: usize = 32;

/// The shuffle buffer's default, in samples: webdataset's usual `shuffle(1000)`.
pub const DEFAULT_BUFFER: usize = 1000;

/// Tar shards on S3 fetched ahead of the readers at the start (the tuner deepens it when
/// readers wait for downloads): two keeps one downloading while one is read.
pub const DEFAULT_PREFETCH: usize = 2;

impl Source {
    fn of(kind: SourceKind) -> Self {
        Self {
            kind,
            labels: None,
            extras: Vec::new(),
            buffer: DEFAULT_BUFFER,
        }
    }

    /// Exactly these files, in this order; or, where every path is an `s3://bucket/key` URL
    /// of one bucket, those objects on S3 (feature `s3`: the endpoint from
    /// `AWS_ENDPOINT_URL`, else AWS), as a list file or a Python list of them is read too.
    pub fn files(paths: impl IntoIterator<Item = impl Into<PathBuf>>) -> Self {
        Self::of(SourceKind::Paths(
            paths.into_iter().map(Into::into).collect(),
        ))
    }

    /// The files under `path` (walked recursively, sorted) whose extension is one of the
    /// dataset's ([`DatasetBuilder::extensions`](super::DatasetBuilder::extensions)).
    pub fn dir(path: impl Into<PathBuf>) -> Self {
        Self::of(SourceKind::Dir(path.into(), None))
    }

    /// The files a list file names, one path per line.
    pub fn list(path: impl Into<PathBuf>) -> Self {
        Self::of(SourceKind::List(path.into()))
    }

    /// WebDataset tar shards: paths or a brace pattern (`shard-{000000..000063}.tar`), or an
    /// `s3://bucket/pattern` URL (feature `s3`; see [`remote`](Self::remote)). Each sample's
    /// first field among the dataset's extensions is decoded (or among
    /// [`fields`](Self::fields)).
    pub fn shards(pattern: impl Into<String>) -> Self {
        Self::of(SourceKind::Shards {
            pattern: pattern.into(),
            fields: None,
            remote: Remote::default(),
        })
    }

    /// Parquet files (feature `parquet`): files or directories of them, or `s3://` URLs of
    /// one bucket (feature `s3`); `column` holds the media (a binary column, or a Hugging Face
    /// `struct<bytes, path>`).
    pub fn parquet(
        paths: impl IntoIterator<Item = impl Into<PathBuf>>,
        column: impl Into<String>,
    ) -> Self {
        Self::of(SourceKind::Parquet {
            paths: paths.into_iter().map(Into::into).collect(),
            column: column.into(),
            endpoint: None,
            region: None,
        })
    }

    /// Several shard or Parquet sources (or local files) drawn by `weights` (one each,
    /// positive): item `i` of an epoch comes from a source drawn with probability
    /// proportional to its weight. An epoch ends when the first source runs out
    /// ([`MixStop::FirstExhausted`]; see [`stop`](Self::stop)). Each source keeps its own
    /// labels.
    pub fn mix(
        parts: impl IntoIterator<Item = Source>,
        weights: impl IntoIterator<Item = f64>,
    ) -> Self {
        Self::of(SourceKind::Mix {
            parts: parts.into_iter().collect(),
            weights: weights.into_iter().collect(),
            stop: MixStop::FirstExhausted,
        })
    }

    /// The objects under `prefix` in an S3 bucket (feature `s3`), each one item, fetched by
    /// an I/O stage of the loader (`fetch`: [`concurrency`](Self::concurrency) GETs in flight,
    /// tuned; through the loader's byte cache, if it has one). The endpoint and region come
    /// from [`remote`](Self::remote), else the environment and the AWS chain.
    #[cfg(feature = "s3")]
    pub fn s3(bucket: impl Into<String>, prefix: impl Into<String>) -> Self {
        Self::of(SourceKind::Objects {
            client: None,
            bucket: bucket.into(),
            prefix: prefix.into(),
            remote: Remote::default(),
            concurrency: DEFAULT_FETCH_CONCURRENCY,
        })
    }

    /// The objects under `prefix` of `client`'s bucket (see [`s3`](Self::s3)).
    #[cfg(feature = "s3")]
    pub fn s3_with(client: crate::s3::S3, prefix: impl Into<String>) -> Self {
        Self::of(SourceKind::Objects {
            bucket: client.bucket().to_owned(),
            client: Some(client),
            prefix: prefix.into(),
            remote: Remote::default(),
            concurrency: DEFAULT_FETCH_CONCURRENCY,
        })
    }

    /// S3 objects: GETs in flight at the start (default [`DEFAULT_FETCH_CONCURRENCY`]; the
    /// tuner changes it).
    #[cfg_attr(not(feature = "s3"), allow(unused_mut))]
    pub fn concurrency(mut self, n: usize) -> Self {
        #[cfg(feature = "s3")]
        if let SourceKind::Objects { concurrency, .. } = &mut self.kind {
            *concurrency = n.max(1);
        }
        let _ = n;
        self
    }

    /// Where labels come from (default: none).
    pub fn labels(mut self, labels: Labels) -> Self {
        self.labels = Some(labels);
        self
    }

    /// Fields besides the media, delivered beside each batch
    /// ([`Batch::field`](crate::loader::Batch::field)): a caption, a transcript, a JSON
    /// record, read from a tar sample's other members or a Parquet row's other columns; for
    /// a mixture, from each part. Not for loose files or S3 objects (refused when opened).
    pub fn extra_fields(mut self, fields: impl IntoIterator<Item = super::FieldSpec>) -> Self {
        self.extras = fields.into_iter().collect();
        self
    }

    /// Shards: the extensions of the field to decode, first found wins (default: the
    /// dataset's extensions).
    pub fn fields(mut self, fields: impl IntoIterator<Item = impl Into<String>>) -> Self {
        if let SourceKind::Shards { fields: f, .. } = &mut self.kind {
            *f = Some(fields.into_iter().map(Into::into).collect());
        }
        self
    }

    /// A directory: the extensions of the files to walk for, with or without the dot
    /// (default: the dataset's).
    pub fn extensions(mut self, extensions: impl IntoIterator<Item = impl Into<String>>) -> Self {
        if let SourceKind::Dir(_, e) = &mut self.kind {
            *e = Some(
                extensions
                    .into_iter()
                    .map(|x| x.into().trim_start_matches('.').to_ascii_lowercase())
                    .collect(),
            );
        }
        self
    }

    /// Shards and Parquet: the shuffle buffer, in samples (default [`DEFAULT_BUFFER`]).
    pub fn buffer(mut self, samples: usize) -> Self {
        self.buffer = samples;
        self
    }

    /// Shards on S3: the endpoint, region and disk cache.
    pub fn remote(mut self, settings: Remote) -> Self {
        match &mut self.kind {
            SourceKind::Shards { remote, .. } => *remote = settings,
            SourceKind::Parquet {
                endpoint, region, ..
            } => {
                *endpoint = settings.endpoint;
                *region = settings.region;
            }
            #[cfg(feature = "s3")]
            SourceKind::Objects { remote, .. } => *remote = settings,
            _ => {}
        }
        self
    }

    /// A mixture: when its epoch ends (default: when the first source runs out).
    pub fn stop(mut self, when: MixStop) -> Self {
        if let SourceKind::Mix { stop, .. } = &mut self.kind {
            *stop = when;
        }
        self
    }

    /// Whether a mixture cannot draw from this in random order: tar shards on S3 (each is
    /// fetched whole into the disk cache: random draws would fetch them again and again) and
    /// S3 objects (fetched by the loader's I/O stage). Parquet on S3 reads a row group by
    /// ranged GETs, cached: it mixes.
    pub(crate) fn is_remote(&self) -> bool {
        match &self.kind {
            SourceKind::Shards { pattern, .. } => pattern.starts_with("s3://"),
            SourceKind::Mix { parts, .. } => parts.iter().any(Source::is_remote),
            #[cfg(feature = "s3")]
            SourceKind::Objects { .. } => true,
            // `s3://` URLs are read as S3 objects.
            SourceKind::Paths(paths) => paths
                .iter()
                .any(|p| p.to_string_lossy().starts_with("s3://")),
            _ => false,
        }
    }

    /// Whether it reads anything from S3 (shards, Parquet files or objects, or a mixture's
    /// part): what cannot be planned item by item before an epoch without downloading it.
    pub fn reads_from_s3(&self) -> bool {
        match &self.kind {
            SourceKind::Parquet { paths, .. } => paths
                .iter()
                .any(|p| p.to_string_lossy().starts_with("s3://")),
            SourceKind::Mix { parts, .. } => parts.iter().any(Source::reads_from_s3),
            _ => self.is_remote(),
        }
    }

    /// What kind of source this is, in errors.
    pub(crate) fn kind_name(&self) -> &'static str {
        match &self.kind {
            SourceKind::Paths(_) => "files",
            SourceKind::Dir(..) => "a directory",
            SourceKind::List(_) => "a list file",
            SourceKind::Shards { .. } => "tar shards",
            SourceKind::Parquet { .. } => "Parquet",
            SourceKind::Mix { .. } => "a mixture",
            #[cfg(feature = "s3")]
            SourceKind::Objects { .. } => "S3 objects",
        }
    }
}
