//! Parquet files as a dataset of samples (feature `parquet`): the Hugging Face hub's layout
//! of image-text sets, an `image` struct of `{bytes, path}` beside label and caption columns.
//!
//! [`ParquetRows`] opens files and reads only their footers; every row group is a group of the
//! [group sampler](crate::sampler::Sampler::groups): an epoch shuffles the row groups (seeded,
//! anew every epoch), each rank takes one contiguous block of rows and visits it through a
//! shuffle buffer, so a rank decodes whole row groups. Reading a row
//! ([`ParquetRows::read`]) decodes its row group's requested columns once (only those), kept
//! in a small cache that workers share (a row group is decoded by one worker while the others
//! wait for it); the row's cells become a [`RawSample`] whose fields are named by column, so
//! a `flowgate::sample::FieldMap` makes them a `Sample`
//! exactly as it does a tar shard's sample:
//!
//! - a `struct<bytes, path>` column (the Hugging Face `Image`/`Audio` feature) or a binary
//!   column: its bytes, for `FieldMap::decode`;
//! - an integer or boolean column: its value as decimal text, for `FieldMap::label`;
//! - a string column: its text, for `FieldMap::text`.
//!
//! A null cell is a missing field. Checkpoints are exact to the row (a row's place is (file,
//! row group, row): nothing skipped is decoded), and merge across ranks like every sampled
//! source. Memory: the cache holds at most [`cache_row_groups`](ParquetRows::cache_row_groups)
//! decoded row groups; [`cache_bytes`](ParquetRows::cache_bytes) is what to reserve in the
//! pipeline's memory budget for it (see
//! [`PipelineBuilder::reserve_memory`](crate::PipelineBuilder::reserve_memory)).

#[cfg(feature = "s3")]
mod remote;
mod write;

pub use write::write_parquet;

use std::collections::VecDeque;
use std::fs::File;
use std::path::{Path, PathBuf};
use std::sync::{Arc, OnceLock};

use ::parquet::arrow::arrow_reader::{
    ArrowReaderMetadata, ArrowReaderOptions, ParquetRecordBatchReaderBuilder,
};
use ::parquet::arrow::ProjectionMask;
use arrow_array::cast::AsArray;
use arrow_array::types::{
    Int16Type, Int32Type, Int64Type, Int8Type, UInt16Type, UInt32Type, UInt64Type, UInt8Type,
};
use arrow_array::{Array, ArrayRef, RecordBatch};
use arrow_schema::DataType;
use flowgate_actors::error::PipelineError;
use parking_lot::Mutex;

use crate::dataset::shards::{RawSample, ShardError};
use crate::sampler::{Sampler, ShareLengths};

/// Where a file's bytes are.
enum Where {
    Local(PathBuf),
    /// An object on S3, read by ranged GETs.
    #[cfg(feature = "s3")]
    S3(remote::Object),
}

struct PqFile {
    /// Its path, or its `s3://bucket/key` URL.
    path: PathBuf,
    at: Where,
    meta: ArrowReaderMetadata,
    /// Root column indices of the requested columns.
    projection: Vec<usize>,
}

/// One decoded row group: the requested columns, in the order asked.
type Decoded = Result<Arc<Vec<ArrayRef>>, Arc<str>>;

struct Inner {
    files: Vec<PqFile>,
    columns: Vec<String>,
    /// (file, row group, first dataset index), in dataset order.
    groups: Vec<(u32, u32, usize)>,
    rows: usize,
    cache: Mutex<VecDeque<(usize, Arc<OnceLock<Decoded>>)>>,
    cache_groups: usize,
    largest_group_bytes: u64,
}

/// Parquet files as a dataset of rows; see the [module docs](self).
#[derive(Clone)]
pub struct ParquetRows {
    inner: Arc<Inner>,
    sampler: Sampler,
}

impl std::fmt::Debug for ParquetRows {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ParquetRows")
            .field("files", &self.inner.files.len())
            .field("row_groups", &self.inner.groups.len())
            .field("rows", &self.inner.rows)
            .field("columns", &self.inner.columns)
            .finish()
    }
}

impl ParquetRows {
    /// The rows of the files at `paths`, reading only `columns` (each must be in every
    /// file). A file that cannot be opened, is not Parquet, or lacks a column is an error
    /// naming it.
    pub fn open(
        paths: impl IntoIterator<Item = impl Into<PathBuf>>,
        columns: &[&str],
    ) -> Result<Self, PipelineError> {
        Self::open_at(
            paths.into_iter().map(|p| {
                let p: PathBuf = p.into();
                (p.clone(), Where::Local(p))
            }),
            columns,
        )
    }

    fn open_at(
        sources: impl IntoIterator<Item = (PathBuf, Where)>,
        columns: &[&str],
    ) -> Result<Self, PipelineError> {
        let mut files = Vec::new();
        let mut groups = Vec::new();
        let mut rows = 0usize;
        let mut largest = 0u64;
        for (path, at) in sources {
            let bad = |m: String| PipelineError::config(format!("{}: {m}", path.display()));
            let opts = ArrowReaderOptions::new();
            let meta = match &at {
                Where::Local(p) => {
                    let file = File::open(p)
                        .map_err(|e| PipelineError::io(format!("opening {}", p.display()), e))?;
                    ArrowReaderMetadata::load(&file, opts)
                }
                #[cfg(feature = "s3")]
                Where::S3(o) => ArrowReaderMetadata::load(&o.footer()?, opts),
            }
            .map_err(|e| bad(format!("not a readable Parquet file ({e})")))?;
            let schema = meta.schema();
            let projection = columns
                .iter()
                .map(|c| {
                    schema.index_of(c).map_err(|_| {
                        let names: Vec<&str> =
                            schema.fields().iter().map(|f| f.name().as_str()).collect();
                        bad(format!("no column {c:?} (it has: {})", names.join(", ")))
                    })
                })
                .collect::<Result<Vec<_>, _>>()?;
            let f = files.len() as u32;
            for (g, rg) in meta.metadata().row_groups().iter().enumerate() {
                let n = row_count(rg.num_rows(), rows)
                    .map_err(|m| bad(format!("row group {g}: {m}")))?;
                if n == 0 {
                    continue;
                }
                groups.push((f, g as u32, rows));
                rows += n;
                largest = largest.max(rg.total_byte_size().max(0) as u64);
            }
            files.push(PqFile {
                path,
                at,
                meta,
                projection,
            });
        }
        if files.is_empty() {
            return Err(PipelineError::config("no Parquet files given"));
        }
        let lengths: Vec<usize> = groups
            .iter()
            .enumerate()
            .map(|(i, &(_, _, start))| groups.get(i + 1).map_or(rows, |g| g.2) - start)
            .collect();
        let sampler = Sampler::new(rows).groups(&lengths)?;
        Ok(Self {
            inner: Arc::new(Inner {
                files,
                columns: columns.iter().map(|c| c.to_string()).collect(),
                groups,
                rows,
                cache: Mutex::new(VecDeque::new()),
                cache_groups: 4,
                largest_group_bytes: largest,
            }),
            sampler,
        })
    }

    /// Parquet files on S3: `url` is `s3://bucket/KEY.parquet`, several such keys separated
    /// by commas, or a prefix (its `.parquet` objects, in key order); the client from
    /// `endpoint` and the AWS credential chain. Opening reads each file's footer (one ranged
    /// GET of its last 64 KiB, and one more for a larger footer); a row group is read as one
    /// ranged GET per run of adjacent requested column chunks, when a worker first needs it.
    #[cfg(feature = "s3")]
    pub fn open_url(
        url: &str,
        endpoint: &crate::s3::Endpoint,
        columns: &[&str],
    ) -> Result<Self, PipelineError> {
        let (s3, rest) = endpoint.connect(url)?;
        Self::open_s3(&s3, rest, columns)
    }

    /// [`open_url`](Self::open_url) with a client: `keys` is a key, several separated by
    /// commas, or a prefix.
    #[cfg(feature = "s3")]
    pub fn open_s3(
        s3: &crate::s3::S3,
        keys: &str,
        columns: &[&str],
    ) -> Result<Self, PipelineError> {
        let rest = keys;
        let bucket = s3.bucket().to_owned();
        let s3_err = |e: crate::s3::S3Error| PipelineError::io("opening the Parquet files", e);
        let keys: Vec<&str> = rest.split(',').filter(|k| !k.is_empty()).collect();
        let objects = if keys.len() == 1 && !keys[0].ends_with(".parquet") {
            let listed: Vec<_> = s3
                .list(keys[0])
                .map_err(s3_err)?
                .into_iter()
                .filter(|o| o.key.ends_with(".parquet"))
                .collect();
            if listed.is_empty() {
                return Err(PipelineError::config(format!(
                    "s3://{bucket}/{}: no .parquet objects under this prefix",
                    keys[0]
                )));
            }
            listed
        } else {
            s3.objects(&keys)
                .map_err(s3_err)?
                .into_iter()
                .zip(&keys)
                .map(|(o, k)| {
                    o.ok_or_else(|| {
                        PipelineError::config(format!("s3://{bucket}/{k}: no such object"))
                    })
                })
                .collect::<Result<Vec<_>, _>>()?
        };
        Self::open_at(
            objects.into_iter().map(|o| {
                let url = PathBuf::from(format!("s3://{bucket}/{}", o.key));
                (
                    url,
                    Where::S3(remote::Object::new(s3.clone(), o.key, o.size, o.etag)),
                )
            }),
            columns,
        )
    }

    /// The Parquet files at `path`: the file itself, or a directory's `.parquet` files,
    /// sorted. A path that does not exist is an error naming it.
    pub fn files_at(path: &Path) -> Result<Vec<PathBuf>, PipelineError> {
        if !path.is_dir() {
            if !path.exists() {
                return Err(PipelineError::io(
                    format!("opening {}", path.display()),
                    std::io::Error::from(std::io::ErrorKind::NotFound),
                ));
            }
            return Ok(vec![path.to_path_buf()]);
        }
        let mut v: Vec<PathBuf> = std::fs::read_dir(path)
            .map_err(|e| PipelineError::io(format!("listing {}", path.display()), e))?
            .filter_map(|e| e.ok().map(|e| e.path()))
            .filter(|p| p.extension().is_some_and(|x| x == "parquet"))
            .collect();
        v.sort();
        Ok(v)
    }

    fn map_sampler(mut self, f: impl FnOnce(Sampler) -> Sampler) -> Self {
        self.sampler = f(self.sampler);
        self
    }

    /// Shuffles the row groups every epoch with a seed derived from `seed` and the epoch (and
    /// seeds the shuffle buffer).
    pub fn shuffle(self, seed: u64) -> Self {
        self.map_sampler(|s| s.shuffle(seed))
    }

    /// Visits each rank's rows through a shuffle buffer of `rows` (see [`Sampler::buffer`]).
    /// A window wider than a row group makes workers hold more decoded row groups at once:
    /// keep [`cache_row_groups`](Self::cache_row_groups) above `rows / rows per group + 1`.
    pub fn buffer(self, rows: usize) -> Self {
        self.map_sampler(|s| s.buffer(rows))
    }

    /// Keeps rank `rank`'s share of a world of `world`.
    pub fn shard(mut self, rank: usize, world: usize) -> Result<Self, PipelineError> {
        self.sampler = self.sampler.shard(rank, world)?;
        Ok(self)
    }

    /// Shards by `RANK` and `WORLD_SIZE` (see [`Sampler::shard_from_env`]).
    pub fn shard_from_env(mut self) -> Result<Self, PipelineError> {
        self.sampler = self.sampler.shard_from_env()?;
        Ok(self)
    }

    /// Keeps worker `worker`'s part of this rank's share split among `workers` processes
    /// (PyTorch `DataLoader` workers); see [`Sampler::split`].
    pub fn split(self, worker: usize, workers: usize) -> Result<Self, PipelineError> {
        let mut this = self;
        this.sampler = this.sampler.split(worker, workers)?;
        Ok(this)
    }

    /// Makes every rank's share the same length (see [`ShareLengths`]).
    pub fn shard_lengths(self, lengths: ShareLengths) -> Self {
        self.map_sampler(|s| s.shard_lengths(lengths))
    }

    /// Keeps at most `n` decoded row groups (default 4; at least 1). Set it before reading.
    pub fn cache_row_groups(mut self, n: usize) -> Self {
        if let Some(inner) = Arc::get_mut(&mut self.inner) {
            inner.cache_groups = n.max(1);
        }
        self
    }

    /// An upper bound of the cache's bytes: the cached row groups at the largest row group's
    /// uncompressed size (all columns: more than the requested columns hold).
    pub fn cache_bytes(&self) -> u64 {
        self.inner.cache_groups as u64 * self.inner.largest_group_bytes
    }

    /// How each epoch orders and deals the rows.
    pub fn sampler(&self) -> &Sampler {
        &self.sampler
    }

    /// Number of rows in all files.
    pub fn len(&self) -> usize {
        self.inner.rows
    }

    /// Whether there are no rows.
    pub fn is_empty(&self) -> bool {
        self.inner.rows == 0
    }

    /// What a checkpoint over these files depends on: every file's path and row groups'
    /// sizes, the columns, and the sampler's settings.
    pub fn fingerprint(&self) -> Vec<(&'static str, String)> {
        use crate::hash::{fnv1a, FNV_OFFSET};
        let mut h = FNV_OFFSET;
        for f in &self.inner.files {
            h = fnv1a(fnv1a(h, f.path.as_os_str().as_encoded_bytes()), b"\0");
        }
        for &(f, g, start) in &self.inner.groups {
            h = fnv1a(h, format!("{f}/{g}/{start};").as_bytes());
        }
        let mut out = vec![
            (
                "dataset",
                format!(
                    "{} Parquet files, {} rows, {h:016x}",
                    self.inner.files.len(),
                    self.inner.rows
                ),
            ),
            ("columns", self.inner.columns.join(",")),
        ];
        out.extend(self.sampler.fingerprint());
        out
    }

    /// Whether every file is local (none on S3).
    pub fn is_local(&self) -> bool {
        self.inner
            .files
            .iter()
            .all(|f| matches!(f.at, Where::Local(_)))
    }

    /// `(file, row group, row in it)` of dataset index `index`.
    pub fn place(&self, index: usize) -> (&Path, usize, usize) {
        let (_, f, rg, row) = self.locate(index);
        (&self.inner.files[f].path, rg, row)
    }

    fn locate(&self, index: usize) -> (usize, usize, usize, usize) {
        let groups = &self.inner.groups;
        let g = groups.partition_point(|&(_, _, start)| start <= index) - 1;
        let (f, rg, start) = groups[g];
        (g, f as usize, rg as usize, index - start)
    }

    /// `FILE:rgG/rowR`, how errors name a row.
    pub fn name(&self, index: usize) -> String {
        let (path, rg, row) = self.place(index);
        format!("{}:rg{rg}/row{row}", path.display())
    }

    /// Row group `g`'s decoded columns, from the cache or decoded now (once, whichever
    /// worker asks first; the others wait for it).
    fn decoded(&self, g: usize) -> Decoded {
        let cell = {
            let mut cache = self.inner.cache.lock();
            if let Some((_, c)) = cache.iter().find(|(k, _)| *k == g) {
                Arc::clone(c)
            } else {
                let c = Arc::new(OnceLock::new());
                cache.push_back((g, Arc::clone(&c)));
                while cache.len() > self.inner.cache_groups {
                    cache.pop_front();
                }
                c
            }
        };
        cell.get_or_init(|| self.decode_group(g)).clone()
    }

    fn decode_group(&self, g: usize) -> Decoded {
        let (f, rg, _) = self.inner.groups[g];
        let file = &self.inner.files[f as usize];
        let run = || -> Result<Vec<ArrayRef>, String> {
            match &file.at {
                Where::Local(p) => {
                    self.decode_from(File::open(p).map_err(|e| e.to_string())?, file, rg)
                }
                #[cfg(feature = "s3")]
                Where::S3(o) => {
                    // The requested columns' chunks of this row group, fetched first: one
                    // ranged GET for each run of adjacent chunks.
                    let meta = file.meta.metadata();
                    let descr = meta.file_metadata().schema_descr();
                    let ranges = meta
                        .row_group(rg as usize)
                        .columns()
                        .iter()
                        .enumerate()
                        .filter(|(leaf, _)| {
                            file.projection.contains(&descr.get_column_root_idx(*leaf))
                        })
                        .map(|(_, c)| {
                            let (start, len) = c.byte_range();
                            start..start + len
                        })
                        .collect();
                    self.decode_from(o.ranges(ranges)?, file, rg)
                }
            }
        };
        run().map(Arc::new).map_err(|e| e.into())
    }

    /// Decodes row group `rg` of `file` from `input`: the requested columns, in the order
    /// asked.
    fn decode_from<T: ::parquet::file::reader::ChunkReader + 'static>(
        &self,
        input: T,
        file: &PqFile,
        rg: u32,
    ) -> Result<Vec<ArrayRef>, String> {
        let descr = file.meta.metadata().file_metadata().schema_descr();
        let mask = ProjectionMask::roots(descr, file.projection.iter().copied());
        let rows = file.meta.metadata().row_group(rg as usize).num_rows() as usize;
        let reader = ParquetRecordBatchReaderBuilder::new_with_metadata(input, file.meta.clone())
            .with_row_groups(vec![rg as usize])
            .with_projection(mask)
            // Decoded in batches of at most 64 Ki rows (a footer's count sizes nothing).
            .with_batch_size(rows.clamp(1, 1 << 16))
            .build()
            .map_err(|e| e.to_string())?;
        let batches: Vec<RecordBatch> = reader
            .collect::<Result<_, _>>()
            .map_err(|e| e.to_string())?;
        let schema = batches
            .first()
            .map(|b| b.schema())
            .ok_or_else(|| "the row group decoded to nothing".to_owned())?;
        let batch =
            arrow_select::concat::concat_batches(&schema, &batches).map_err(|e| e.to_string())?;
        self.inner
            .columns
            .iter()
            .map(|c| {
                batch
                    .column_by_name(c)
                    .cloned()
                    .ok_or_else(|| format!("column {c:?} missing after decoding"))
            })
            .collect()
    }

    /// Reads row `index` (decoding its row group's columns if no worker has yet) in `epoch`:
    /// each requested column's cell is a field named by the column (see the module docs).
    pub fn read(&self, epoch: u64, index: usize) -> Result<RawSample, ShardError> {
        let (g, f, rg, row) = self.locate(index);
        let path = self.inner.files[f].path.clone();
        let key = format!("rg{rg}/row{row}");
        let columns = self.decoded(g).map_err(|reason| ShardError::Damaged {
            shard: path.clone(),
            key: key.clone(),
            reason,
        })?;
        let mut fields = Vec::with_capacity(columns.len());
        for (name, col) in self.inner.columns.iter().zip(columns.iter()) {
            match cell(col, row) {
                Ok(Some(bytes)) => fields.push((name.clone(), bytes)),
                Ok(None) => {}
                Err(reason) => {
                    return Err(ShardError::Field {
                        shard: path,
                        key,
                        ext: name.clone(),
                        reason,
                    })
                }
            }
        }
        Ok(RawSample {
            shard: path,
            key,
            epoch,
            fields,
        })
    }

    /// `(epoch, index) → (epoch, index)`: the items for
    /// [`source_sampled`](crate::PipelineBuilder::source_sampled); a stage then calls
    /// [`read`](Self::read).
    pub fn refs(&self) -> impl Fn(u64, usize) -> (u64, usize) + Send + Sync + 'static {
        |epoch, index| (epoch, index)
    }
}

/// One cell as bytes: binary as is, a `struct<bytes, ...>`'s bytes, text as UTF-8, integers
/// and booleans as decimal text; `None` for a null.
fn cell(col: &ArrayRef, row: usize) -> Result<Option<Vec<u8>>, String> {
    if col.is_null(row) {
        return Ok(None);
    }
    let int = |v: i128| Ok(Some(v.to_string().into_bytes()));
    match col.data_type() {
        DataType::Binary => Ok(Some(col.as_binary::<i32>().value(row).to_vec())),
        DataType::LargeBinary => Ok(Some(col.as_binary::<i64>().value(row).to_vec())),
        DataType::BinaryView => Ok(Some(col.as_binary_view().value(row).to_vec())),
        DataType::Utf8 => Ok(Some(col.as_string::<i32>().value(row).as_bytes().to_vec())),
        DataType::LargeUtf8 => Ok(Some(col.as_string::<i64>().value(row).as_bytes().to_vec())),
        DataType::Utf8View => Ok(Some(col.as_string_view().value(row).as_bytes().to_vec())),
        DataType::Boolean => int(i128::from(col.as_boolean().value(row))),
        DataType::Int8 => int(col.as_primitive::<Int8Type>().value(row).into()),
        DataType::Int16 => int(col.as_primitive::<Int16Type>().value(row).into()),
        DataType::Int32 => int(col.as_primitive::<Int32Type>().value(row).into()),
        DataType::Int64 => int(col.as_primitive::<Int64Type>().value(row).into()),
        DataType::UInt8 => int(col.as_primitive::<UInt8Type>().value(row).into()),
        DataType::UInt16 => int(col.as_primitive::<UInt16Type>().value(row).into()),
        DataType::UInt32 => int(col.as_primitive::<UInt32Type>().value(row).into()),
        DataType::UInt64 => int(col.as_primitive::<UInt64Type>().value(row).into()),
        DataType::Struct(_) => {
            let s = col.as_struct();
            let bytes = s
                .column_by_name("bytes")
                .ok_or("a struct column without a `bytes` field (the Hugging Face image layout is struct<bytes, path>)")?;
            cell(bytes, row)
        }
        other => Err(format!("a {other} column cannot be a field (binary, string, integer, boolean or struct<bytes, path>)")),
    }
}
/// A row group's row count from a footer, checked: negative counts and datasets past
/// [`MAX_EPOCH_ITEMS`](crate::sampler::MAX_EPOCH_ITEMS) rows (`before` counted already) are
/// errors naming the number, not an order that aborts the process when it is allocated.
fn row_count(num_rows: i64, before: usize) -> Result<usize, String> {
    let n = usize::try_from(num_rows).map_err(|_| format!("the footer says {num_rows} rows"))?;
    if n > crate::sampler::MAX_EPOCH_ITEMS.saturating_sub(before) {
        return Err(format!(
            "the footer says {num_rows} rows, {} with the row groups before it: more than an \
             epoch may hold ({})",
            before as u128 + n as u128,
            crate::sampler::MAX_EPOCH_ITEMS
        ));
    }
    Ok(n)
}

#[cfg(test)]
mod tests {
    use super::row_count;

    #[test]
    fn a_footers_row_counts_are_checked_before_they_size_an_order() {
        assert_eq!(row_count(0, 0), Ok(0));
        assert_eq!(row_count(1000, 5), Ok(1000));
        let max = crate::sampler::MAX_EPOCH_ITEMS;
        assert_eq!(row_count(max as i64, 0), Ok(max));
        let e = row_count(-3, 0).unwrap_err();
        assert!(e.contains("-3 rows"), "{e}");
        let e = row_count(max as i64, 1).unwrap_err();
        assert!(e.contains("more than an epoch may hold"), "{e}");
        let e = row_count(i64::MAX, 0).unwrap_err();
        assert!(e.contains(&i64::MAX.to_string()), "{e}");
    }
}
