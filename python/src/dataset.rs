//! What a loader reads: local files, tar shards, Parquet rows, or a mixture of them, and how
//! each is opened from the Python arguments (shuffled, dealt to ranks, equalised).

use std::path::PathBuf;
use std::sync::Arc;

use flowgate::media::{Files, MediaError};
use flowgate::parquet::ParquetRows;
use flowgate::sampler::{LengthBatches, Sampler, ShardLengths};
use flowgate::shards::{RawSample, ShardError, Shards};
use flowgate::{PipelineError, Tensor};
use pyo3::exceptions::{PyFileNotFoundError, PyValueError};
use pyo3::prelude::*;

use crate::error::to_py;

/// One item's dataset index, epoch, and label when its sample carried one (tar shards). For
/// a length-aware batch (an item that is a whole batch), the files its rows hold.
#[derive(Clone)]
pub(crate) struct Meta {
    pub(crate) index: usize,
    pub(crate) epoch: u64,
    pub(crate) label: Option<i64>,
    pub(crate) rows: Option<Vec<usize>>,
}

/// What a decoder reads: a local file, or a shard sample's field (bytes, named
/// `SHARD/KEY.EXT`).
pub(crate) enum Input {
    Path(PathBuf),
    Bytes(flowgate::Blob),
}

/// Decodes one file or field, in an epoch (which seeds random augmentation), into one item:
/// a tensor per field.
pub(crate) type Decode = Arc<dyn Fn(Input, u64) -> Result<Vec<Tensor>, MediaError> + Send + Sync>;

/// Samples whose fields are bytes: tar shards' (fields by extension) or Parquet rows'
/// (fields by column).
#[derive(Clone)]
pub(crate) enum Records {
    Tar(Shards),
    Parquet(ParquetRows),
}

impl Records {
    pub(crate) fn sampler(&self) -> &Sampler {
        match self {
            Records::Tar(s) => s.sampler(),
            Records::Parquet(p) => p.sampler(),
        }
    }

    pub(crate) fn fingerprint(&self) -> Vec<(&'static str, String)> {
        match self {
            Records::Tar(s) => s.fingerprint(),
            Records::Parquet(p) => p.fingerprint(),
        }
    }

    pub(crate) fn name(&self, index: usize, epoch: u64) -> String {
        match self {
            Records::Tar(s) => s.get(epoch, index).to_string(),
            Records::Parquet(p) => p.name(index),
        }
    }

    fn read(&self, index: usize, epoch: u64) -> Result<RawSample, ShardError> {
        match self {
            Records::Tar(s) => s.get(epoch, index).read(),
            Records::Parquet(p) => p.read(epoch, index),
        }
    }

    fn len(&self) -> usize {
        match self {
            Records::Tar(s) => s.len(),
            Records::Parquet(p) => p.len(),
        }
    }
}

/// What a loader reads.
#[derive(Clone)]
pub(crate) enum Dataset {
    /// Local files.
    Files(Files),
    /// Tar shards or Parquet rows: each sample's first field among `media` is decoded; with
    /// `label`, that field is read as its label.
    Records {
        records: Records,
        media: Arc<[String]>,
        label: Option<String>,
    },
    /// Several record sources drawn by weight: item `i` of the mixture is item `j` of part
    /// `s` (`sampler.locate(i)`).
    Mix {
        parts: Arc<[Dataset]>,
        sampler: Sampler,
    },
    /// Local audio files in length-aware batches: item `i` is batch slot `i` of `plan` (a
    /// whole batch, its clips padded to the longest); `sampler` orders and deals the slots.
    Batches {
        files: Files,
        plan: Arc<LengthBatches>,
        sampler: Sampler,
    },
}

impl Dataset {
    pub(crate) fn sampler(&self) -> &Sampler {
        match self {
            Dataset::Files(f) => f.sampler(),
            Dataset::Records { records, .. } => records.sampler(),
            Dataset::Mix { sampler, .. } | Dataset::Batches { sampler, .. } => sampler,
        }
    }

    /// Items in the whole dataset (every rank's).
    pub(crate) fn items(&self) -> usize {
        match self {
            Dataset::Files(f) => f.len(),
            Dataset::Records { records, .. } => records.len(),
            Dataset::Mix { sampler, .. } => sampler.dataset_len(),
            Dataset::Batches { plan, .. } => plan.len(),
        }
    }

    /// The bytes of the (process-wide) Parquet row-group cache this dataset reads through;
    /// 0 without Parquet.
    /// The prefetch of tar shards on S3, for the tuner to deepen (see `Shards::read_ahead`).
    pub(crate) fn read_ahead(
        &self,
    ) -> Option<std::sync::Arc<dyn flowgate::actors::cache::ReadAheadControl>> {
        match self {
            #[cfg(feature = "s3")]
            Dataset::Records {
                records: Records::Tar(s),
                ..
            } => s.read_ahead(),
            _ => None,
        }
    }

    pub(crate) fn parquet_cache(&self) -> u64 {
        match self {
            Dataset::Records {
                records: Records::Parquet(p),
                ..
            } => p.cache_bytes(),
            Dataset::Mix { parts, .. } => {
                parts.iter().map(Dataset::parquet_cache).max().unwrap_or(0)
            }
            _ => 0,
        }
    }

    /// Whether samples carry a label field.
    pub(crate) fn has_label(&self) -> bool {
        match self {
            Dataset::Files(_) | Dataset::Batches { .. } => false,
            Dataset::Records { label, .. } => label.is_some(),
            Dataset::Mix { parts, .. } => parts.iter().all(Dataset::has_label),
        }
    }

    pub(crate) fn fingerprint(&self) -> Vec<(&'static str, String)> {
        match self {
            Dataset::Files(f) => f.fingerprint(),
            Dataset::Records {
                records,
                media,
                label,
            } => {
                let mut f = records.fingerprint();
                f.push(("fields", media.join(",")));
                f.push(("label_field", label.clone().unwrap_or_default()));
                f
            }
            Dataset::Mix { parts, sampler } => {
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
            Dataset::Batches { files, plan, .. } => {
                // The files (a hash of the paths; their sampler is not used) and the plan.
                let mut f: Vec<_> = files
                    .fingerprint()
                    .into_iter()
                    .filter(|(k, _)| *k == "dataset")
                    .collect();
                f.extend(plan.fingerprint());
                f
            }
        }
    }

    /// The item's name in failures and `return_paths`: its path, or `SHARD:KEY`.
    pub(crate) fn name(&self, index: usize, epoch: u64) -> String {
        match self {
            Dataset::Files(f) => f.paths()[index].display().to_string(),
            Dataset::Records { records, .. } => records.name(index, epoch),
            Dataset::Mix { parts, sampler } => {
                let (s, j) = sampler.locate(index);
                parts[s].name(j, epoch)
            }
            Dataset::Batches { files, plan, .. } => {
                let rows = plan.batch(epoch, index);
                let first = rows
                    .first()
                    .map_or_else(String::new, |&i| files.paths()[i].display().to_string());
                format!("batch {index} ({} clips: {first}, ...)", rows.len())
            }
        }
    }

    /// Reads and decodes item `index` of `epoch`.
    pub(crate) fn load(
        &self,
        index: usize,
        epoch: u64,
        decode: &Decode,
    ) -> Result<(Vec<Tensor>, Meta), ShardError> {
        let mut meta = Meta {
            index,
            epoch,
            label: None,
            rows: None,
        };
        let fields = match self {
            Dataset::Files(f) => decode(Input::Path(f.paths()[index].clone()), epoch)?,
            Dataset::Records {
                records,
                media,
                label,
            } => {
                let mut raw = records.read(index, epoch)?;
                if let Some(ext) = label {
                    meta.label = Some(raw.take_label(ext)?);
                }
                let (ext, bytes) = raw.take_required(media)?;
                let path = raw.field_path(&ext);
                decode(Input::Bytes(flowgate::Blob { path, bytes }), epoch)?
            }
            Dataset::Mix { parts, sampler } => {
                let (s, j) = sampler.locate(index);
                let (fields, part) = parts[s].load(j, epoch, decode)?;
                meta.label = part.label;
                fields
            }
            Dataset::Batches { files, plan, .. } => {
                let (fields, rows) = load_batch(files, &plan.batch(epoch, index), epoch, decode)?;
                meta.rows = Some(rows);
                fields
            }
        };
        Ok((fields, meta))
    }
}

/// Decodes the clips `rows` (indices into `files`) with `decode` (which gives each clip's
/// window and its real length) into one batch padded to the longest clip: `[B, T]` and the
/// lengths `[B]`, with the rows kept. Clips that fail are left out and reported to the
/// decode stage as failed items (`flowgate::skip_part`: counted, fatal past the failure
/// budget); the batch fails only when every clip failed.
fn load_batch(
    files: &Files,
    rows: &[usize],
    epoch: u64,
    decode: &Decode,
) -> Result<(Vec<Tensor>, Vec<usize>), ShardError> {
    let mut clips = Vec::with_capacity(rows.len());
    let mut kept = Vec::with_capacity(rows.len());
    let mut failed = Vec::new();
    for &i in rows {
        let path = &files.paths()[i];
        match decode(Input::Path(path.clone()), epoch) {
            Ok(fields) => {
                let len = fields
                    .get(1)
                    .and_then(|t| t.bytes().get(..8))
                    .map_or(0, |b| i64::from_le_bytes(b.try_into().expect("8 bytes")));
                clips.push((
                    fields.into_iter().next().expect("the clip"),
                    len.max(0) as usize,
                ));
                kept.push(i);
            }
            Err(e) => failed.push((path, e)),
        }
    }
    if clips.is_empty() {
        return Err(failed.remove(0).1.into());
    }
    for (path, e) in failed {
        if let Err(e) = flowgate::skip_part(path.display().to_string(), e) {
            let e = e.downcast::<MediaError>().expect("the error it was given");
            return Err((*e).into());
        }
    }
    let (batch, lengths) = flowgate::collate::pad_longest(&clips);
    Ok((vec![batch, lengths], kept))
}

#[allow(clippy::too_many_arguments)]
pub(crate) fn files_of(
    paths: &Bound<'_, PyAny>,
    extensions: &[&str],
    shuffle: bool,
    seed: u64,
    rank: Option<usize>,
    world_size: Option<usize>,
    drop_last: bool,
) -> PyResult<Files> {
    let files = if let Ok(s) = paths.extract::<PathBuf>() {
        let media = s
            .extension()
            .and_then(|e| e.to_str())
            .is_some_and(|e| extensions.iter().any(|x| x.eq_ignore_ascii_case(e)));
        if !s.exists() {
            return Err(PyFileNotFoundError::new_err((
                2,
                "No such file or directory".to_owned(),
                s.display().to_string(),
            )));
        } else if s.is_dir() {
            Files::dir(&s, extensions).map_err(to_py)?
        } else if media {
            // One media file, not a list of them.
            Files::new([s])
        } else {
            Files::list(&s).map_err(to_py)?
        }
    } else {
        let v: Vec<PathBuf> = paths.extract()?;
        Files::new(v)
    };
    if files.is_empty() {
        return Err(PyValueError::new_err(format!(
            "no files to load in {} (extensions {})",
            paths.repr()?,
            extensions.join(", ")
        )));
    }
    let files = if shuffle { files.shuffle(seed) } else { files };
    deal(files, rank, world_size, drop_last)
}

/// How a `flowgate.Shards` on S3 is reached and cached.
#[cfg_attr(not(feature = "s3"), allow(dead_code))]
pub(crate) struct Remote {
    pub(crate) endpoint: Option<String>,
    pub(crate) cache_dir: Option<std::path::PathBuf>,
    pub(crate) cache_mb: f64,
    pub(crate) prefetch: usize,
}

/// Opens the shards `pattern` names: local paths, or `s3://` (feature `s3`).
fn open_shards(pattern: &str, remote: &Remote) -> Result<Shards, PipelineError> {
    if !pattern.starts_with("s3://") {
        return Shards::open(pattern);
    }
    #[cfg(feature = "s3")]
    {
        use flowgate::shards::remote::{Endpoint, RemoteOptions};
        let mut opts = RemoteOptions {
            cache_bytes: (remote.cache_mb.max(0.0) * 1048576.0) as u64,
            ..RemoteOptions::default()
        };
        if let Some(d) = &remote.cache_dir {
            opts.cache_dir = d.clone();
        }
        let endpoint = Endpoint {
            url: remote.endpoint.clone(),
            region: None,
        };
        Ok(Shards::open_url(pattern, &endpoint, &opts)?.prefetch(remote.prefetch))
    }
    #[cfg(not(feature = "s3"))]
    {
        let _ = remote;
        Err(PipelineError::config(format!(
            "{pattern}: shards on S3 need the package built with the `s3` feature \
             (MATURIN_PEP517_ARGS=\"--features s3\" pip install ./python)"
        )))
    }
}

/// The tar shards a `flowgate.Shards` names, shuffled, sharded and equalised like files
/// (the shuffle buffer only with `shuffle`).
#[allow(clippy::too_many_arguments)]
pub(crate) fn shards_of(
    pattern: &str,
    remote: &Remote,
    buffer: usize,
    shuffle: bool,
    seed: u64,
    rank: Option<usize>,
    world_size: Option<usize>,
    drop_last: bool,
) -> PyResult<Shards> {
    let bad = |e: PipelineError| PyValueError::new_err(e.to_string());
    let mut shards = open_shards(pattern, remote).map_err(|e| {
        if e.to_string().contains("No such file") {
            PyFileNotFoundError::new_err(e.to_string())
        } else {
            bad(e)
        }
    })?;
    if shuffle {
        shards = shards.shuffle(seed).buffer(buffer);
    }
    deal(shards, rank, world_size, drop_last)
}

/// What can be dealt out to ranks: files, shards, Parquet rows.
pub(crate) trait Dealt: Sized {
    fn shard(self, rank: usize, world: usize) -> Result<Self, PipelineError>;
    fn shard_from_env(self) -> Result<Self, PipelineError>;
    fn shard_lengths(self, lengths: ShardLengths) -> Self;
}

macro_rules! dealt {
    ($($t:ty),*) => {$(
        impl Dealt for $t {
            fn shard(self, rank: usize, world: usize) -> Result<Self, PipelineError> {
                <$t>::shard(self, rank, world)
            }
            fn shard_from_env(self) -> Result<Self, PipelineError> {
                <$t>::shard_from_env(self)
            }
            fn shard_lengths(self, lengths: ShardLengths) -> Self {
                <$t>::shard_lengths(self, lengths)
            }
        }
    )*};
}
dealt!(Files, Shards, ParquetRows, Sampler);

/// `x`'s share for `rank` of `world_size` (or the environment's), every rank as many items:
/// `drop_last` drops the remainder, otherwise it is padded by repeating the start of the
/// epoch's order (what PyTorch's DistributedSampler does). One process: nothing to pad.
pub(crate) fn deal<T: Dealt>(
    x: T,
    rank: Option<usize>,
    world_size: Option<usize>,
    drop_last: bool,
) -> PyResult<T> {
    let bad = |e: PipelineError| PyValueError::new_err(e.to_string());
    let x = match (rank, world_size) {
        (Some(r), Some(w)) => x.shard(r, w).map_err(bad)?,
        (None, None) => x.shard_from_env().map_err(bad)?,
        _ => {
            return Err(PyValueError::new_err(
                "give both rank and world_size, or neither",
            ))
        }
    };
    Ok(x.shard_lengths(if drop_last {
        ShardLengths::Drop
    } else {
        ShardLengths::Pad
    }))
}

/// Parquet files on S3: URLs of one bucket (`s3://bucket/key.parquet`, or one prefix).
fn parquet_on_s3(
    paths: &[PathBuf],
    endpoint: Option<String>,
    columns: &[&str],
) -> Result<ParquetRows, PipelineError> {
    #[cfg(feature = "s3")]
    {
        let urls: Vec<String> = paths
            .iter()
            .map(|p| p.to_string_lossy().into_owned())
            .collect();
        let bucket = |u: &str| {
            u.trim_start_matches("s3://")
                .split('/')
                .next()
                .map(str::to_owned)
        };
        let first = bucket(&urls[0]);
        if urls
            .iter()
            .any(|u| !u.starts_with("s3://") || bucket(u) != first)
        {
            return Err(PipelineError::config(
                "Parquet: the paths are all local, or all s3:// URLs of one bucket",
            ));
        }
        let keys: Vec<&str> = urls
            .iter()
            .map(|u| {
                u.trim_start_matches("s3://")
                    .split_once('/')
                    .map_or("", |(_, k)| k)
            })
            .collect();
        let url = format!("s3://{}/{}", first.unwrap_or_default(), keys.join(","));
        let endpoint = flowgate::shards::remote::Endpoint {
            url: endpoint,
            region: None,
        };
        ParquetRows::open_url(&url, &endpoint, columns)
    }
    #[cfg(not(feature = "s3"))]
    {
        let _ = (endpoint, columns);
        Err(PipelineError::config(format!(
            "{}: Parquet on S3 needs the package built with the `s3` feature \
             (MATURIN_PEP517_ARGS=\"--features s3\" pip install ./python)",
            paths[0].display()
        )))
    }
}

/// The rows of a `flowgate.Parquet`'s files (reading `columns`), shuffled by row group,
/// sharded and equalised like files.
#[allow(clippy::too_many_arguments)]
pub(crate) fn parquet_of(
    paths: Vec<PathBuf>,
    endpoint: Option<String>,
    columns: &[&str],
    buffer: usize,
    shuffle: bool,
    seed: u64,
    rank: Option<usize>,
    world_size: Option<usize>,
    drop_last: bool,
) -> PyResult<ParquetRows> {
    let bad = |e: PipelineError| PyValueError::new_err(e.to_string());
    let remote = paths
        .iter()
        .filter(|p| p.to_string_lossy().starts_with("s3://"))
        .count();
    if remote > 0 {
        let mut rows = parquet_on_s3(&paths, endpoint, columns).map_err(bad)?;
        if shuffle {
            rows = rows.shuffle(seed).buffer(buffer);
        }
        return deal(rows, rank, world_size, drop_last);
    }
    let mut files = Vec::new();
    for p in paths {
        if !p.exists() {
            return Err(PyFileNotFoundError::new_err((
                2,
                "No such file or directory".to_owned(),
                p.display().to_string(),
            )));
        }
        files.extend(ParquetRows::files_at(&p).map_err(bad)?);
    }
    let mut rows = ParquetRows::open(files, columns).map_err(bad)?;
    if shuffle {
        rows = rows.shuffle(seed).buffer(buffer);
    }
    deal(rows, rank, world_size, drop_last)
}
