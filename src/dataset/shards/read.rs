//! Reading one sample: [`SampleRef`] (its place) and [`RawSample`] (its fields' bytes).

use std::fs::File;
use std::path::{Path, PathBuf};
use std::sync::Arc;

#[cfg(feature = "s3")]
use super::disk_cache;
#[cfg(feature = "s3")]
use super::shard::Body;
use super::shard::{Inner, Plan, Shard};
use super::ShardError;

/// One sample's place: which shard, which entry; cheap to make and to skip. [`read`] reads its
/// bytes.
///
/// [`read`]: SampleRef::read
#[derive(Clone)]
pub struct SampleRef {
    pub(super) shards: Arc<Inner>,
    #[cfg_attr(not(feature = "s3"), allow(dead_code))]
    pub(super) plan: Arc<Plan>,
    pub(super) index: usize,
    pub(super) epoch: u64,
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
        self.read_fields(|_| true)
    }

    /// [`read`](Self::read) of the fields whose extension `wanted` accepts: the others are
    /// not read at all (a sample's unused fields — another modality, a large side file — take
    /// no memory and no I/O).
    pub fn read_fields(&self, wanted: impl Fn(&str) -> bool) -> Result<RawSample, ShardError> {
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
                Some(disk_cache::Done(cache, *slot, self.epoch))
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
        for f in entry.fields.iter().filter(|f| wanted(&f.ext)) {
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

    /// Takes the field `ext` and reads it as an integer label (WebDataset's `cls`: decimal
    /// text), failing naming the field if it is missing or not an integer.
    pub fn take_label(&mut self, ext: &str) -> Result<i64, ShardError> {
        let (ext, bytes) = self.take_required(&[ext.to_owned()])?;
        self.parse_label(ext, &bytes)
    }

    pub(crate) fn parse_label(&self, ext: String, bytes: &[u8]) -> Result<i64, ShardError> {
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
