//! The local disk cache of shards on S3 (feature `s3`): each shard downloaded whole, in one
//! streamed GET, then read like a local shard.
//!
//! [`ShardCache`] keeps a byte limit over the shards it holds and evicts the least recently
//! used beyond it, but never one of the `keep` most recently used (the working set: the shards
//! the readers and the shuffle buffer are in, and those prefetched ahead of them). Files are
//! named by key and entity tag, so a shard rewritten on the store is fetched anew, and a cache
//! directory is reused across processes and by several ranks of one machine (a download goes
//! to a temporary name and is renamed into place). An evicted file that a reader still has
//! open stays readable until it is closed.
//!
//! A shard whose download fails (after the client's retries; a body cut off mid-stream is
//! continued with a ranged GET) fails the samples read from it with the S3 error, each
//! counted by the pipeline's failure budget, until it is fetched again: on its next use once
//! a backoff has passed ([`RETRY_AFTER`], doubling per failure up to [`RETRY_AFTER_MAX`]), and
//! at once when the next epoch starts. A transient outage costs the samples read during it,
//! not the shard for the life of the process.

use std::fs::File;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Condvar, Mutex};
use std::time::{Duration, Instant};

use crate::s3::{S3Error, S3Object, Version, S3};

/// Counters of one [`ShardCache`].
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct CacheStats {
    /// Shards downloaded (one streamed GET each, plus retries and continuations).
    pub downloads: u64,
    /// Shard reads served by a file already on disk.
    pub hits: u64,
    /// Shard reads that waited for the shard's download (the prefetch was not far enough
    /// ahead, or there was none).
    pub waits: u64,
    /// Shards found on disk from an earlier process when the cache opened.
    pub reused: u64,
    /// Shards removed to stay under the byte limit.
    pub evictions: u64,
    /// Bytes of this corpus's shards on disk now.
    pub bytes: u64,
    /// Downloads that failed (after the client's retries); the shard is fetched again later.
    pub failures: u64,
    /// The byte limit (`cache_mb`): what the cache keeps beyond its working set.
    pub limit: u64,
    /// Bytes of the working set: shards on disk the cache may not evict now (with samples of
    /// the epoch still to read, or among the `keep` most recently used). After every change
    /// the cache holds at most `max(limit, pinned)` bytes.
    pub pinned: u64,
}

/// How long a failed shard's samples fail with its error before a read fetches it again.
pub const RETRY_AFTER: Duration = Duration::from_secs(1);
/// How often a reader waiting for a download checks whether its stage is shutting down.
const STOP_CHECK: Duration = Duration::from_millis(50);

/// The longest wait between fetches of a shard that keeps failing (the wait doubles from
/// [`RETRY_AFTER`] with each failure).
pub const RETRY_AFTER_MAX: Duration = Duration::from_secs(60);

enum Slot {
    Absent,
    Fetching,
    Ready {
        file: Arc<File>,
        used_at: u64,
    },
    /// The last download failed with `error`; fetched again from `retry_at` on.
    Failed {
        error: Arc<S3Error>,
        retry_at: Instant,
    },
}

impl Slot {
    /// Whether a read (or a prefetch) should start a download now.
    fn should_fetch(&self, now: Instant) -> bool {
        match self {
            Slot::Absent => true,
            Slot::Failed { retry_at, .. } => now >= *retry_at,
            Slot::Fetching | Slot::Ready { .. } => false,
        }
    }
}

struct State {
    slots: Vec<Slot>,
    clock: u64,
    bytes: u64,
    keep: usize,
    /// The epoch being read, and each shard's samples of it not read yet: a shard with
    /// unread samples is not evicted (the shuffle buffer may still reach back into it).
    epoch: Option<u64>,
    pending: Vec<u32>,
    /// Each shard's downloads that failed in a row (the backoff doubles with them).
    failed_in_a_row: Vec<u32>,
}

/// A local-disk cache of one corpus's shards on S3; see the [module docs](self).
pub struct ShardCache {
    s3: S3,
    objects: Vec<S3Object>,
    /// Each shard's version (listed, or pinned by its first download): later downloads of
    /// it (after an eviction) must be the same bytes its index and manifest describe.
    versions: Vec<Version>,
    dir: PathBuf,
    limit: u64,
    state: Mutex<State>,
    ready: Condvar,
    downloads: AtomicU64,
    hits: AtomicU64,
    waits: AtomicU64,
    reused: AtomicU64,
    evictions: AtomicU64,
    failures: AtomicU64,
}

impl std::fmt::Debug for ShardCache {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ShardCache")
            .field("bucket", &self.s3.bucket())
            .field("shards", &self.objects.len())
            .field("dir", &self.dir)
            .field("limit", &self.limit)
            .finish_non_exhaustive()
    }
}

/// A file-name-safe form of a key's component or an entity tag.
fn safe(s: &str) -> String {
    let t: String = s
        .chars()
        .map(|c| {
            if c.is_ascii_alphanumeric() || "-_.".contains(c) {
                c
            } else {
                '_'
            }
        })
        .collect();
    if t.is_empty() || t.chars().all(|c| c == '.') {
        "_".into()
    } else {
        t
    }
}

impl ShardCache {
    /// A cache of `objects` (shards of the client's bucket) under `dir`, holding at most
    /// `limit` bytes of them beyond the working set. Files an earlier process left (same key,
    /// entity tag and size) are used as they are.
    pub fn new(s3: S3, objects: Vec<S3Object>, dir: PathBuf, limit: u64) -> std::io::Result<Self> {
        let dir = dir.join(safe(s3.bucket()));
        std::fs::create_dir_all(&dir)?;
        let cache = Self {
            s3,
            versions: objects
                .iter()
                .map(|o| Version::new(o.etag.clone()))
                .collect(),
            dir,
            limit,
            state: Mutex::new(State {
                slots: Vec::new(),
                clock: 0,
                bytes: 0,
                keep: 2,
                epoch: None,
                pending: Vec::new(),
                failed_in_a_row: Vec::new(),
            }),
            ready: Condvar::new(),
            downloads: AtomicU64::new(0),
            hits: AtomicU64::new(0),
            waits: AtomicU64::new(0),
            reused: AtomicU64::new(0),
            evictions: AtomicU64::new(0),
            failures: AtomicU64::new(0),
            objects,
        };
        let mut slots = Vec::with_capacity(cache.objects.len());
        let mut bytes = 0;
        for (i, o) in cache.objects.iter().enumerate() {
            let path = cache.path_of(i);
            let slot = match std::fs::metadata(&path) {
                Ok(m) if m.len() == o.size => match File::open(&path) {
                    Ok(file) => {
                        bytes += o.size;
                        cache.reused.fetch_add(1, Ordering::Relaxed);
                        Slot::Ready {
                            file: Arc::new(file),
                            used_at: 0,
                        }
                    }
                    Err(_) => Slot::Absent,
                },
                _ => Slot::Absent,
            };
            slots.push(slot);
        }
        {
            let mut st = cache.state.lock().expect("fresh lock");
            st.pending = vec![0; slots.len()];
            st.failed_in_a_row = vec![0; slots.len()];
            st.slots = slots;
            st.bytes = bytes;
        }
        Ok(cache)
    }

    /// The number of shards.
    pub fn len(&self) -> usize {
        self.objects.len()
    }

    /// Whether there are none.
    pub fn is_empty(&self) -> bool {
        self.objects.is_empty()
    }

    /// The `i`th shard's object.
    pub fn object(&self, i: usize) -> &S3Object {
        &self.objects[i]
    }

    /// The `i`th shard's URL, `s3://bucket/key`.
    pub fn url(&self, i: usize) -> PathBuf {
        PathBuf::from(format!("s3://{}/{}", self.s3.bucket(), self.objects[i].key))
    }

    /// Never evicts one of the `n` most recently used shards (at least 1; default 2).
    pub fn keep(&self, n: usize) {
        let mut st = self.lock();
        st.keep = n.max(1);
        self.evict(&mut st);
    }

    /// Starts reading `epoch` (once; later calls for the same epoch do nothing): `pending`
    /// holds each shard's samples this reader will read in it. Shards keep their files until
    /// their samples are read.
    pub(super) fn begin_epoch(&self, epoch: u64, pending: impl FnOnce() -> Vec<u32>) {
        let mut st = self.lock();
        if st.epoch != Some(epoch) {
            self.plan_locked(&mut st, epoch, pending());
        }
    }

    /// Plans `epoch` anew (a resumed or rebuilt run of it): `pending` holds each shard's
    /// samples still to be read in it. Replaces an earlier plan of the same epoch, so shards
    /// a resume skips are released, not kept for reads that never come.
    pub(super) fn plan_epoch(&self, epoch: u64, pending: Vec<u32>) {
        let mut st = self.lock();
        self.plan_locked(&mut st, epoch, pending);
    }

    fn plan_locked(&self, st: &mut State, epoch: u64, pending: Vec<u32>) {
        if st.epoch != Some(epoch) {
            st.epoch = Some(epoch);
            // A new epoch tries every failed shard again at its first use.
            let now = Instant::now();
            for s in &mut st.slots {
                if let Slot::Failed { retry_at, .. } = s {
                    *retry_at = now;
                }
            }
        }
        st.pending = pending;
        st.pending.resize(self.objects.len(), 0);
        self.evict(st);
    }

    /// One sample of shard `i` read in `epoch`.
    pub(super) fn done(&self, i: usize, epoch: u64) {
        let mut st = self.lock();
        if st.epoch == Some(epoch) && st.pending[i] > 0 {
            st.pending[i] -= 1;
            if st.pending[i] == 0 {
                self.evict(&mut st);
            }
        }
    }

    /// The counters.
    pub fn stats(&self) -> CacheStats {
        let st = self.lock();
        let evictable: u64 = Self::evictable(&st).map(|i| self.objects[i].size).sum();
        let (bytes, pinned) = (st.bytes, st.bytes.saturating_sub(evictable));
        drop(st);
        CacheStats {
            limit: self.limit,
            pinned,
            downloads: self.downloads.load(Ordering::Relaxed),
            hits: self.hits.load(Ordering::Relaxed),
            waits: self.waits.load(Ordering::Relaxed),
            reused: self.reused.load(Ordering::Relaxed),
            evictions: self.evictions.load(Ordering::Relaxed),
            bytes,
            failures: self.failures.load(Ordering::Relaxed),
        }
    }

    /// The client.
    pub fn client(&self) -> &S3 {
        &self.s3
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, State> {
        self.state.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// Where shard `i` lives on disk: its key's components under the bucket's folder, with
    /// the entity tag in the file name.
    fn path_of(&self, i: usize) -> PathBuf {
        let o = &self.objects[i];
        let mut path = self.dir.clone();
        let parts: Vec<&str> = o.key.split('/').collect();
        for part in &parts[..parts.len() - 1] {
            path.push(safe(part));
        }
        let tag = o.etag.as_deref().map(|t| safe(t.trim_matches('"')));
        let name = parts[parts.len() - 1];
        path.push(match tag {
            Some(t) => format!("{}@{t}", safe(name)),
            None => format!("{}@{}", safe(name), o.size),
        });
        path
    }

    /// Starts downloading shard `i` in the background unless it is on disk or on its way,
    /// or the epoch being read has nothing left to read in it.
    pub fn prefetch(self: &Arc<Self>, i: usize) {
        let mut st = self.lock();
        let wanted = st.epoch.is_none() || st.pending[i] > 0;
        if wanted && st.slots[i].should_fetch(Instant::now()) {
            st.slots[i] = Slot::Fetching;
            drop(st);
            self.spawn_download(i);
        }
    }

    /// Shard `i`'s file, downloading it first (or waiting for the download in flight).
    pub fn file(self: &Arc<Self>, i: usize) -> Result<Arc<File>, Arc<S3Error>> {
        let mut st = self.lock();
        let mut waited = false;
        loop {
            match &st.slots[i] {
                Slot::Ready { file, .. } => {
                    let file = Arc::clone(file);
                    st.clock += 1;
                    let now = st.clock;
                    if let Slot::Ready { used_at, .. } = &mut st.slots[i] {
                        *used_at = now;
                    }
                    // Another shard may have left the most recently used: evictable now.
                    self.evict(&mut st);
                    if waited {
                        self.waits.fetch_add(1, Ordering::Relaxed);
                    } else {
                        self.hits.fetch_add(1, Ordering::Relaxed);
                    }
                    return Ok(file);
                }
                Slot::Failed {
                    error, retry_at, ..
                } if Instant::now() < *retry_at => {
                    return Err(Arc::clone(error));
                }
                Slot::Fetching => {
                    // A stage shutting down does not wait for the download (it goes on, for
                    // whoever reads the shard next).
                    if flowgate_actors::pool::stopping() {
                        return Err(Arc::new(S3Error::Client(format!(
                            "{}: not waited for, the pipeline is stopping",
                            self.url(i).display()
                        ))));
                    }
                    waited = true;
                    st = self
                        .ready
                        .wait_timeout(st, STOP_CHECK)
                        .map_or_else(|p| p.into_inner().0, |(g, _)| g);
                }
                Slot::Absent | Slot::Failed { .. } => {
                    st.slots[i] = Slot::Fetching;
                    drop(st);
                    self.spawn_download(i);
                    st = self.lock();
                }
            }
        }
    }

    fn spawn_download(self: &Arc<Self>, i: usize) {
        let me = Arc::clone(self);
        let spawned = std::thread::Builder::new()
            .name("flowgate-shard-fetch".into())
            .spawn(move || me.download(i));
        if let Err(e) = spawned {
            self.finish(
                i,
                Err(S3Error::Client(format!("starting a download thread: {e}"))),
            );
        }
    }

    fn download(&self, i: usize) {
        let o = &self.objects[i];
        let path = self.path_of(i);
        let tmp = path.with_file_name(format!(
            ".{}.part-{}-{i}",
            path.file_name()
                .map_or(String::new(), |n| n.to_string_lossy().into_owned()),
            std::process::id()
        ));
        self.downloads.fetch_add(1, Ordering::Relaxed);
        let outcome = (|| {
            if let Some(parent) = path.parent() {
                std::fs::create_dir_all(parent)
                    .map_err(|e| S3Error::Client(format!("creating {}: {e}", parent.display())))?;
            }
            // The version listed (and indexed, or counted by the manifest): a rewritten shard
            // is an error here, not samples read at the old offsets from new bytes.
            futures::executor::block_on(self.s3.download_version(&o.key, &tmp, &self.versions[i]))?;
            // Opened before it is moved into place: another process sharing the directory may
            // evict the file the moment it is there, and an open file stays readable (opened
            // after the move, the shard failed its samples until the next retry).
            let file = File::open(&tmp)
                .map_err(|e| S3Error::Client(format!("opening {}: {e}", tmp.display())))?;
            std::fs::rename(&tmp, &path).map_err(|e| {
                S3Error::Client(format!("moving the download into {}: {e}", path.display()))
            })?;
            Ok(file)
        })();
        if outcome.is_err() {
            let _ = std::fs::remove_file(&tmp);
        }
        self.finish(i, outcome);
    }

    fn finish(&self, i: usize, outcome: Result<File, S3Error>) {
        let mut st = self.lock();
        match outcome {
            Ok(file) => {
                st.clock += 1;
                st.slots[i] = Slot::Ready {
                    file: Arc::new(file),
                    used_at: st.clock,
                };
                st.bytes += self.objects[i].size;
                st.failed_in_a_row[i] = 0;
                self.evict(&mut st);
            }
            Err(e) => {
                tracing::warn!(shard = %self.url(i).display(), error = %e, "shard download failed");
                self.failures.fetch_add(1, Ordering::Relaxed);
                let failures = st.failed_in_a_row[i].saturating_add(1);
                st.failed_in_a_row[i] = failures;
                let wait = RETRY_AFTER
                    .saturating_mul(1 << (failures - 1).min(16))
                    .min(RETRY_AFTER_MAX);
                st.slots[i] = Slot::Failed {
                    error: Arc::new(e),
                    retry_at: Instant::now() + wait,
                };
            }
        }
        drop(st);
        self.ready.notify_all();
    }

    /// The shards on disk the cache may evict now, least recently used first: every one
    /// but the `keep` most recently used and those with samples of the epoch still to read.
    fn evictable(st: &State) -> impl Iterator<Item = usize> + '_ {
        let mut ready: Vec<(u64, usize)> = st
            .slots
            .iter()
            .enumerate()
            .filter_map(|(i, s)| match s {
                Slot::Ready { used_at, .. } => Some((*used_at, i)),
                _ => None,
            })
            .collect();
        ready.sort_unstable();
        let n = ready.len().saturating_sub(st.keep);
        ready.truncate(n);
        ready
            .into_iter()
            .map(|(_, i)| i)
            .filter(|&i| st.pending.get(i).copied().unwrap_or(0) == 0)
    }

    /// Removes the least recently used shards beyond the limit, sparing those with samples
    /// of the epoch still to read and the `keep` most recently used.
    fn evict(&self, st: &mut State) {
        if st.bytes <= self.limit {
            return;
        }
        let evictable: Vec<usize> = Self::evictable(st).collect();
        for i in evictable {
            if st.bytes <= self.limit {
                break;
            }
            let _ = std::fs::remove_file(self.path_of(i));
            st.slots[i] = Slot::Absent;
            st.bytes -= self.objects[i].size;
            self.evictions.fetch_add(1, Ordering::Relaxed);
        }
    }
}

/// Marks a sample read when dropped (after its bytes are copied out, or its read failed).
pub(super) struct Done<'a>(
    pub(super) &'a Arc<ShardCache>,
    pub(super) usize,
    pub(super) u64,
);

impl Drop for Done<'_> {
    fn drop(&mut self) {
        self.0.done(self.1, self.2);
    }
}

/// The default cache folder: `$FLOWGATE_SHARD_CACHE`, else `$XDG_CACHE_HOME/flowgate/shards`,
/// else `~/.cache/flowgate/shards`, else the temporary folder's `flowgate-shards`.
pub fn default_dir() -> PathBuf {
    if let Some(d) = std::env::var_os("FLOWGATE_SHARD_CACHE") {
        return d.into();
    }
    if let Some(d) = std::env::var_os("XDG_CACHE_HOME") {
        return Path::new(&d).join("flowgate/shards");
    }
    if let Some(h) = std::env::var_os("HOME") {
        return Path::new(&h).join(".cache/flowgate/shards");
    }
    std::env::temp_dir().join("flowgate-shards")
}
