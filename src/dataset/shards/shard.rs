//! One shard's samples and bytes: a local file or a shard on S3 read through the cache, and
//! the prefetch plan (which shards a rank reads next).

use std::fs::File;
use std::path::PathBuf;
use std::sync::{Arc, Mutex, OnceLock};

use flowgate_actors::error::PipelineError;

#[cfg(feature = "s3")]
use super::disk_cache;
use super::index::{self, Entry};
use super::tar;
use crate::sampler::Sampler;

pub(super) struct Shard {
    /// The shard's path, or its `s3://bucket/key` URL.
    pub(super) path: PathBuf,
    /// Its positions in the dataset: its entries, or a manifest's count of them.
    pub(super) len: usize,
    pub(super) body: Body,
}

pub(super) enum Body {
    Local {
        entries: Vec<Entry>,
        file: OnceLock<Result<File, Arc<std::io::Error>>>,
    },
    /// A shard on S3, downloaded into the cache and indexed when first read (or when opened,
    /// without a manifest).
    #[cfg(feature = "s3")]
    Remote {
        cache: Arc<disk_cache::ShardCache>,
        slot: usize,
        max_member: u64,
        entries: OnceLock<Vec<Entry>>,
    },
}

/// What reading a shard needs: its entries and an open file.
pub(super) struct Opened<'a> {
    pub(super) entries: &'a [Entry],
    pub(super) file: FileRef<'a>,
}

pub(super) enum FileRef<'a> {
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
    pub(super) fn known_entries(&self) -> &[Entry] {
        match &self.body {
            Body::Local { entries, .. } => entries,
            #[cfg(feature = "s3")]
            Body::Remote { entries, .. } => entries.get().map_or(&[], Vec::as_slice),
        }
    }

    /// The entries and an open file, fetching a remote shard first.
    pub(super) fn open(&self) -> Result<Opened<'_>, std::io::Error> {
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
pub(super) fn index_file(file: &File, max_member: u64) -> Vec<Entry> {
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

pub(super) struct Inner {
    pub(super) shards: Vec<Shard>,
    /// For each dataset index, (shard, entry).
    pub(super) at: Vec<(u32, u32)>,
}

impl Inner {
    pub(super) fn new(shards: Vec<Shard>) -> Result<(Self, Sampler), PipelineError> {
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
pub(super) type EpochOrder = (
    u64,
    Arc<Vec<u32>>,
    Arc<std::collections::HashMap<u32, usize>>,
);

/// Which shards come next in an epoch, for prefetching remote shards ahead of the readers.
pub(super) struct Plan {
    pub(super) sampler: Sampler,
    /// Shards fetched ahead (the tuner may deepen it: see `Shards::read_ahead`).
    pub(super) depth: std::sync::atomic::AtomicUsize,
    /// The epoch, and its shards in the order this rank first visits them, with each one's
    /// place in that order.
    pub(super) order: Mutex<Option<EpochOrder>>,
    /// The epoch, and the samples this process reads in it (see `Shards::plan_reads`);
    /// for another epoch, the sampler's share.
    pub(super) reads: Mutex<Option<(u64, Arc<Vec<usize>>)>>,
}

impl Plan {
    /// Makes `indices` the samples read in `epoch`, in order.
    pub(super) fn set_reads(&self, epoch: u64, indices: Vec<usize>) {
        *self.reads.lock().unwrap_or_else(|p| p.into_inner()) = Some((epoch, Arc::new(indices)));
        // The shard order is made again from them.
        *self.order.lock().unwrap_or_else(|p| p.into_inner()) = None;
    }

    /// The samples read in `epoch`, in order.
    fn reads(&self, epoch: u64) -> Arc<Vec<usize>> {
        match &*self.reads.lock().unwrap_or_else(|p| p.into_inner()) {
            Some((e, r)) if *e == epoch => Arc::clone(r),
            _ => Arc::new(self.sampler.epoch(epoch)),
        }
    }

    /// This rank's samples of each shard in `epoch`.
    #[cfg(feature = "s3")]
    pub(super) fn counts(&self, inner: &Inner, epoch: u64) -> Vec<u32> {
        let mut counts = vec![0u32; inner.shards.len()];
        for &i in self.reads(epoch).iter() {
            counts[inner.at[i].0 as usize] += 1;
        }
        counts
    }

    /// The `depth` shards this rank visits after `shard` in `epoch`.
    #[cfg_attr(not(feature = "s3"), allow(dead_code))]
    pub(super) fn ahead(&self, inner: &Inner, epoch: u64, shard: u32) -> Vec<u32> {
        let depth = self.depth.load(std::sync::atomic::Ordering::Relaxed);
        if depth == 0 {
            return Vec::new();
        }
        let (order, place) = {
            let mut o = self.order.lock().unwrap_or_else(|p| p.into_inner());
            match &*o {
                Some((e, order, place)) if *e == epoch => (Arc::clone(order), Arc::clone(place)),
                _ => {
                    let mut seen = std::collections::HashMap::new();
                    let mut order = Vec::new();
                    for &i in self.reads(epoch).iter() {
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
            Some(&k) => order.iter().skip(k + 1).take(depth).copied().collect(),
            None => Vec::new(),
        }
    }
}
