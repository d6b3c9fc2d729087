//! [`ByteCache`]: an in-memory LRU cache of fetched bytes, with a byte capacity the tuner can
//! resize while the pipeline runs.
//!
//! Put it in front of a fetch (S3, network file systems, slow disks): a hit returns the bytes
//! without fetching, a miss fetches and keeps them. Attach it to the fetching stage with
//! [`PipelineBuilder::cache`](crate::PipelineBuilder::cache) and its hits, misses and evictions
//! join that stage's statistics, and the tuner grows it (up to its ceiling and the memory
//! budget) while it evicts, and shrinks it when the buffers need the memory. A second epoch
//! over a dataset that fits fetches nothing.
//!
//! ```
//! use flowgate::byte_cache::ByteCache;
//! use flowgate::{Blob, Pipeline};
//!
//! let cache = ByteCache::new(64 << 20); // starts at 64 MiB; the tuner may grow it
//! let read = cache.through_blocking(|path: std::path::PathBuf| Blob::read(path));
//! let mut pipeline = Pipeline::builder()
//!     .source(vec![std::path::PathBuf::from("Cargo.toml")])
//!     .pipe("read", read, 2)
//!     .cache(&cache)
//!     .build()?;
//! let blobs: Vec<_> = pipeline.iter().collect::<Result<_, _>>()?;
//! assert_eq!(cache.stats().misses, 1);
//! # Ok::<(), flowgate::PipelineError>(())
//! ```

use std::collections::{BTreeMap, HashMap};
use std::future::Future;
use std::path::{Path, PathBuf};
use std::pin::Pin;
use std::sync::Arc;

use flowgate_actors::attached::CacheControl;
use flowgate_tuner::CacheStats;
use parking_lot::Mutex;

use crate::blob::Blob;

/// An LRU cache of [`Blob`]s keyed by path (or object key), bounded in bytes. Clones share the
/// cache.
#[derive(Clone)]
pub struct ByteCache {
    inner: Arc<Mutex<Lru>>,
}

impl std::fmt::Debug for ByteCache {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ByteCache")
            .field("stats", &self.stats())
            .finish()
    }
}

struct Entry {
    bytes: Arc<[u8]>,
    stamp: u64,
}

struct Lru {
    map: HashMap<PathBuf, Entry>,
    /// Recency: stamp → key, oldest first.
    order: BTreeMap<u64, PathBuf>,
    next_stamp: u64,
    stats: CacheStats,
}

impl Lru {
    fn evict_to(&mut self, capacity: u64) {
        while self.stats.bytes > capacity {
            let Some((_, key)) = self.order.pop_first() else {
                break;
            };
            if let Some(e) = self.map.remove(&key) {
                self.stats.bytes -= e.bytes.len() as u64;
                self.stats.evicted_bytes += e.bytes.len() as u64;
            }
        }
        self.stats.entries = self.map.len() as u64;
    }
}

/// A future a stage can await.
pub type CacheFuture<E> = Pin<Box<dyn Future<Output = Result<Blob, E>> + Send>>;

impl ByteCache {
    /// A cache holding at most `capacity` bytes, which a tuner may grow up to 4× (see
    /// [`max_bytes`](Self::max_bytes)) within the memory budget.
    pub fn new(capacity: u64) -> Self {
        Self::with_limits(capacity, capacity.saturating_mul(4), false)
    }

    /// A cache of exactly `capacity` bytes: the tuner never resizes it.
    pub fn fixed(capacity: u64) -> Self {
        Self::with_limits(capacity, capacity, true)
    }

    fn with_limits(capacity: u64, max_bytes: u64, pinned: bool) -> Self {
        Self {
            inner: Arc::new(Mutex::new(Lru {
                map: HashMap::new(),
                order: BTreeMap::new(),
                next_stamp: 0,
                stats: CacheStats {
                    capacity_bytes: capacity,
                    max_bytes: max_bytes.max(capacity),
                    pinned,
                    ..CacheStats::default()
                },
            })),
        }
    }

    /// Sets the most a tuner may grow the capacity to.
    pub fn max_bytes(self, bytes: u64) -> Self {
        {
            let mut lru = self.inner.lock();
            lru.stats.max_bytes = bytes.max(lru.stats.capacity_bytes);
        }
        self
    }

    /// The bytes cached under `key`, counting a hit or a miss.
    pub fn get(&self, key: &Path) -> Option<Blob> {
        let mut lru = self.inner.lock();
        let stamp = lru.next_stamp;
        let found = lru.map.get_mut(key).map(|e| {
            let old = std::mem::replace(&mut e.stamp, stamp);
            (old, Arc::clone(&e.bytes))
        });
        match found {
            Some((old, bytes)) => {
                lru.next_stamp += 1;
                if let Some(k) = lru.order.remove(&old) {
                    lru.order.insert(stamp, k);
                }
                lru.stats.hits += 1;
                lru.stats.hit_bytes += bytes.len() as u64;
                drop(lru);
                Some(Blob {
                    path: key.to_path_buf(),
                    bytes: bytes.to_vec(),
                })
            }
            None => {
                lru.stats.misses += 1;
                None
            }
        }
    }

    /// Keeps a copy of `blob` (counting its bytes as fetched on a miss), evicting the least
    /// recently used entries to make room. A blob larger than the capacity is not kept.
    pub fn insert(&self, blob: &Blob) {
        let len = blob.bytes.len() as u64;
        let bytes: Arc<[u8]> = Arc::from(blob.bytes.as_slice());
        let mut lru = self.inner.lock();
        lru.stats.miss_bytes += len;
        let capacity = lru.stats.capacity_bytes;
        if len > capacity {
            return;
        }
        let stamp = lru.next_stamp;
        lru.next_stamp += 1;
        if let Some(old) = lru.map.insert(blob.path.clone(), Entry { bytes, stamp }) {
            lru.order.remove(&old.stamp);
            lru.stats.bytes -= old.bytes.len() as u64;
        }
        lru.order.insert(stamp, blob.path.clone());
        lru.stats.bytes += len;
        lru.evict_to(capacity);
    }

    /// Counters and capacity now.
    pub fn stats(&self) -> CacheStats {
        self.inner.lock().stats
    }

    /// Sets the capacity, evicting the least recently used entries that no longer fit.
    pub fn set_capacity(&self, bytes: u64) {
        let mut lru = self.inner.lock();
        lru.stats.capacity_bytes = bytes;
        lru.evict_to(bytes);
    }

    /// Wraps an async fetch (for [`pipe_async`](crate::PipelineBuilder::pipe_async)): a hit
    /// returns the cached bytes, a miss awaits `fetch` and keeps what it returns.
    pub fn through<K, E, F, Fut>(&self, fetch: F) -> impl Fn(K) -> CacheFuture<E> + Send + Sync
    where
        K: AsRef<Path> + Send + 'static,
        F: Fn(K) -> Fut + Send + Sync + 'static,
        Fut: Future<Output = Result<Blob, E>> + Send + 'static,
        E: Send + 'static,
    {
        let cache = self.clone();
        move |key: K| -> CacheFuture<E> {
            if let Some(hit) = cache.get(key.as_ref()) {
                return Box::pin(std::future::ready(Ok(hit)));
            }
            let cache = cache.clone();
            let fut = fetch(key);
            Box::pin(async move {
                let blob = fut.await?;
                cache.insert(&blob);
                Ok(blob)
            })
        }
    }

    /// Wraps a synchronous fetch (for [`pipe`](crate::PipelineBuilder::pipe)).
    pub fn through_blocking<K, E, F>(&self, fetch: F) -> impl Fn(K) -> Result<Blob, E> + Send + Sync
    where
        K: AsRef<Path>,
        F: Fn(K) -> Result<Blob, E> + Send + Sync + 'static,
    {
        let cache = self.clone();
        move |key: K| {
            if let Some(hit) = cache.get(key.as_ref()) {
                return Ok(hit);
            }
            let blob = fetch(key)?;
            cache.insert(&blob);
            Ok(blob)
        }
    }
}

impl CacheControl for ByteCache {
    fn cache_stats(&self) -> CacheStats {
        self.stats()
    }

    fn set_capacity(&self, bytes: u64) {
        ByteCache::set_capacity(self, bytes);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn blob(name: &str, n: usize) -> Blob {
        Blob {
            path: PathBuf::from(name),
            bytes: vec![name.len() as u8; n],
        }
    }

    #[test]
    fn evicts_least_recently_used_within_capacity() {
        let c = ByteCache::new(300);
        c.insert(&blob("a", 100));
        c.insert(&blob("b", 100));
        c.insert(&blob("c", 100));
        assert!(c.get(Path::new("a")).is_some()); // a is now the most recent
        c.insert(&blob("d", 100)); // evicts b
        assert!(c.get(Path::new("b")).is_none());
        assert!(c.get(Path::new("c")).is_some());
        assert!(c.get(Path::new("a")).is_some());
        let s = c.stats();
        assert_eq!((s.bytes, s.entries, s.evicted_bytes), (300, 3, 100));
        assert_eq!((s.hits, s.misses), (3, 1));
        c.set_capacity(150);
        let s = c.stats();
        assert_eq!((s.bytes, s.entries, s.evicted_bytes), (100, 1, 300));
        assert!(c.get(Path::new("a")).is_some(), "the most recent survives");
        c.insert(&blob("huge", 1000));
        assert!(
            c.get(Path::new("huge")).is_none(),
            "larger than the capacity"
        );
        c.insert(&blob("a", 50)); // replacing an entry frees its old bytes
        assert_eq!(c.stats().bytes, 50);
    }

    #[test]
    fn through_fetches_only_on_a_miss() {
        let c = ByteCache::new(1 << 20);
        let fetches = Arc::new(std::sync::atomic::AtomicUsize::new(0));
        let f = {
            let fetches = Arc::clone(&fetches);
            c.through_blocking(move |p: PathBuf| -> Result<Blob, std::io::Error> {
                fetches.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
                Ok(Blob {
                    path: p,
                    bytes: vec![7; 10],
                })
            })
        };
        for _ in 0..3 {
            assert_eq!(f(PathBuf::from("k")).unwrap().bytes, vec![7; 10]);
        }
        assert_eq!(fetches.load(std::sync::atomic::Ordering::Relaxed), 1);
        let s = c.stats();
        assert_eq!(
            (s.hits, s.misses, s.hit_bytes, s.miss_bytes),
            (2, 1, 20, 10)
        );
    }
}
