//! Shards on S3 (feature `s3`): each shard downloaded whole, in one streamed GET, into a local
//! disk cache, then read like a local shard.
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
//! continued with a ranged GET) fails every sample read from it with the S3 error, each
//! counted by the pipeline's failure budget; it is not fetched again in this process.

use std::fs::File;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Condvar, Mutex};

use crate::s3::{S3Error, S3Object, S3};

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
    /// Downloads that failed for good.
    pub failures: u64,
}

enum Slot {
    Absent,
    Fetching,
    Ready { file: Arc<File>, used_at: u64 },
    Failed(Arc<S3Error>),
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
}

/// A local-disk cache of one corpus's shards on S3; see the [module docs](self).
pub struct ShardCache {
    s3: S3,
    objects: Vec<S3Object>,
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
            dir,
            limit,
            state: Mutex::new(State {
                slots: Vec::new(),
                clock: 0,
                bytes: 0,
                keep: 2,
                epoch: None,
                pending: Vec::new(),
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
        self.lock().keep = n.max(1);
    }

    /// Starts reading `epoch` (once; later calls for the same epoch do nothing): `pending`
    /// holds each shard's samples this reader will read in it. Shards keep their files until
    /// their samples are read.
    pub(super) fn begin_epoch(&self, epoch: u64, pending: impl FnOnce() -> Vec<u32>) {
        let mut st = self.lock();
        if st.epoch != Some(epoch) {
            st.epoch = Some(epoch);
            st.pending = pending();
            st.pending.resize(self.objects.len(), 0);
            self.evict(&mut st);
        }
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
        CacheStats {
            downloads: self.downloads.load(Ordering::Relaxed),
            hits: self.hits.load(Ordering::Relaxed),
            waits: self.waits.load(Ordering::Relaxed),
            reused: self.reused.load(Ordering::Relaxed),
            evictions: self.evictions.load(Ordering::Relaxed),
            bytes: self.lock().bytes,
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
        if wanted && matches!(st.slots[i], Slot::Absent) {
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
                    if waited {
                        self.waits.fetch_add(1, Ordering::Relaxed);
                    } else {
                        self.hits.fetch_add(1, Ordering::Relaxed);
                    }
                    return Ok(file);
                }
                Slot::Failed(e) => return Err(Arc::clone(e)),
                Slot::Fetching => {
                    waited = true;
                    st = self.ready.wait(st).unwrap_or_else(|p| p.into_inner());
                }
                Slot::Absent => {
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
            futures::executor::block_on(self.s3.download(&o.key, &tmp))?;
            std::fs::rename(&tmp, &path).map_err(|e| {
                S3Error::Client(format!("moving the download into {}: {e}", path.display()))
            })?;
            File::open(&path)
                .map_err(|e| S3Error::Client(format!("opening {}: {e}", path.display())))
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
                self.evict(&mut st);
            }
            Err(e) => {
                tracing::warn!(shard = %self.url(i).display(), error = %e, "shard download failed");
                self.failures.fetch_add(1, Ordering::Relaxed);
                st.slots[i] = Slot::Failed(Arc::new(e));
            }
        }
        drop(st);
        self.ready.notify_all();
    }

    /// Removes the least recently used shards beyond the limit, sparing those with samples
    /// of the epoch still to read and the `keep` most recently used.
    fn evict(&self, st: &mut State) {
        if st.bytes <= self.limit {
            return;
        }
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
        let evictable = ready.len().saturating_sub(st.keep);
        for &(_, i) in &ready[..evictable] {
            if st.pending[i] > 0 {
                continue;
            }
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

/// How [`Shards::open_s3`](super::Shards::open_s3) caches and indexes shards.
#[derive(Clone, Debug)]
pub struct RemoteOptions {
    /// The cache folder (default [`default_dir`]).
    pub cache_dir: PathBuf,
    /// Bytes of this corpus's shards kept on disk beyond the working set, least recently
    /// used evicted first (default 0: only the shards being read and prefetched stay; set it
    /// to the corpus's size, or what the disk can spare, to read later epochs from disk).
    pub cache_bytes: u64,
    /// The largest member a shard may declare.
    pub max_member: u64,
    /// Shards downloaded at once to index them, when no manifest gives their sample counts.
    pub index_concurrency: usize,
}

impl Default for RemoteOptions {
    fn default() -> Self {
        Self {
            cache_dir: default_dir(),
            cache_bytes: 0,
            max_member: super::DEFAULT_MAX_MEMBER,
            index_concurrency: 8,
        }
    }
}

use super::MANIFEST;

/// A manifest's shards: (key, sample count), keys resolved against the manifest's folder.
fn parse_manifest(
    bucket: &str,
    manifest_key: &str,
    bytes: &[u8],
) -> Result<Vec<(String, usize)>, PipelineError> {
    let bad = |why: String| {
        PipelineError::config(format!(
            "s3://{bucket}/{manifest_key}: not a shard manifest: {why}"
        ))
    };
    let v: serde_json::Value = serde_json::from_slice(bytes).map_err(|e| bad(e.to_string()))?;
    let list = v
        .get("shardlist")
        .and_then(|l| l.as_array())
        .ok_or_else(|| bad("no \"shardlist\" array".into()))?;
    let folder = manifest_key.rfind('/').map_or("", |i| &manifest_key[..=i]);
    list.iter()
        .map(|e| {
            let url = e
                .get("url")
                .and_then(|u| u.as_str())
                .ok_or_else(|| bad(format!("an entry without \"url\": {e}")))?;
            let n = e
                .get("nsamples")
                .and_then(|n| n.as_u64())
                .ok_or_else(|| bad(format!("{url}: no \"nsamples\"")))?;
            let key = match url.strip_prefix("s3://") {
                Some(rest) => match rest.split_once('/') {
                    Some((b, k)) if b == bucket => k.to_owned(),
                    _ => return Err(bad(format!("{url} is not in the bucket {bucket}"))),
                },
                None => format!("{folder}{}", url.trim_start_matches("./")),
            };
            Ok((key, n as usize))
        })
        .collect()
}

use super::{Body, Inner, Shard, Shards};
use crate::PipelineError;
use std::sync::OnceLock;

impl Shards {
    /// Tar shards on S3: `pattern` is a key pattern in the client's bucket (brace ranges and
    /// comma lists as in [`open`](Self::open): `train/shard-{000000..000063}.tar`), a prefix
    /// (its `.tar` objects), or the key of a manifest (`….json`, WebDataset's `wids` format:
    /// `{"shardlist": [{"url": "shard-000000.tar", "nsamples": 100}, …]}`).
    ///
    /// Sample counts come from the manifest (given, or `shards.json` beside the shards when
    /// there is one), so opening reads no shard; without one, every shard is downloaded once
    /// into the cache and indexed (the files stay, within the cache's limit, for the first
    /// epoch and later runs). Each shard is then read from the cache ([`ShardCache`]): one
    /// streamed GET per shard per epoch at most, the next shards of the rank's order fetched
    /// ahead ([`prefetch`](Self::prefetch)).
    pub fn open_s3(s3: &S3, pattern: &str, opts: &RemoteOptions) -> Result<Self, PipelineError> {
        let bucket = s3.bucket().to_owned();
        let s3_err = |e: S3Error| PipelineError::io("opening the shards", e);
        let (keys, counts): (Vec<String>, Option<Vec<usize>>) = if pattern.ends_with(".json") {
            let bytes = futures::executor::block_on(s3.get(pattern)).map_err(s3_err)?;
            let m = parse_manifest(&bucket, pattern, &bytes.bytes)?;
            let (k, c) = m.into_iter().unzip();
            (k, Some(c))
        } else {
            let mut keys = super::expand_spec(pattern)?;
            if keys.len() == 1 && !keys[0].ends_with(".tar") {
                let prefix = keys.pop().expect("one key");
                keys = s3
                    .list(&prefix)
                    .map_err(s3_err)?
                    .into_iter()
                    .map(|o| o.key)
                    .filter(|k| k.ends_with(".tar"))
                    .collect();
                if keys.is_empty() {
                    return Err(PipelineError::config(format!(
                        "s3://{bucket}/{prefix}: no .tar objects under this prefix"
                    )));
                }
            }
            let folder = keys[0].rfind('/').map_or("", |i| &keys[0][..=i]);
            let manifest = format!("{folder}{MANIFEST}");
            let counts = match futures::executor::block_on(s3.get(&manifest)) {
                Ok(b) => {
                    let m: std::collections::HashMap<String, usize> =
                        parse_manifest(&bucket, &manifest, &b.bytes)?
                            .into_iter()
                            .collect();
                    keys.iter()
                        .map(|k| m.get(k).copied())
                        .collect::<Option<Vec<_>>>()
                }
                Err(S3Error::NotFound { .. }) => None,
                Err(e) => return Err(s3_err(e)),
            };
            (keys, counts)
        };
        let objects = s3
            .objects(&keys)
            .map_err(s3_err)?
            .into_iter()
            .zip(&keys)
            .map(|(o, k)| {
                o.ok_or_else(|| PipelineError::config(format!("s3://{bucket}/{k}: no such shard")))
            })
            .collect::<Result<Vec<_>, _>>()?;
        let cache = ShardCache::new(
            s3.clone(),
            objects,
            opts.cache_dir.clone(),
            opts.cache_bytes,
        )
        .map_err(|e| {
            PipelineError::io(
                format!("the shard cache at {}", opts.cache_dir.display()),
                e,
            )
        })?;
        let cache = Arc::new(cache);
        let entries: Vec<OnceLock<Vec<super::Entry>>> =
            (0..cache.len()).map(|_| OnceLock::new()).collect();
        if counts.is_none() {
            index_all(&cache, &entries, opts);
        }
        let shards = entries
            .into_iter()
            .enumerate()
            .map(|(slot, entries)| Shard {
                path: cache.url(slot),
                len: match &counts {
                    Some(c) => c[slot],
                    None => entries.get().map_or(1, Vec::len),
                },
                body: Body::Remote {
                    cache: Arc::clone(&cache),
                    slot,
                    max_member: opts.max_member,
                    entries,
                },
            })
            .collect();
        Ok(Self::of(Inner::new(shards)?))
    }
}

/// Downloads and indexes every shard, `index_concurrency` at a time. A shard that cannot be
/// fetched stays unindexed (one place, which reports the error when read).
fn index_all(
    cache: &Arc<ShardCache>,
    entries: &[OnceLock<Vec<super::Entry>>],
    opts: &RemoteOptions,
) {
    let next = AtomicU64::new(0);
    let threads = opts.index_concurrency.clamp(1, entries.len().max(1));
    std::thread::scope(|scope| {
        for _ in 0..threads {
            scope.spawn(|| loop {
                let i = next.fetch_add(1, Ordering::Relaxed) as usize;
                if i >= entries.len() {
                    break;
                }
                if let Ok(file) = cache.file(i) {
                    let _ = entries[i].set(super::index_file(&file, opts.max_member));
                }
            });
        }
    });
}

/// Where and how to reach shards on S3 by URL.
#[derive(Clone, Debug, Default)]
pub struct Endpoint {
    /// An S3-compatible endpoint (`http://host:port`, path-style); else `AWS_ENDPOINT_URL`,
    /// else AWS.
    pub url: Option<String>,
    /// The region; else the AWS chain's, else `us-east-1`.
    pub region: Option<String>,
}

impl Shards {
    /// Tar shards at `url`, `s3://bucket/PATTERN` (see [`open_s3`](Self::open_s3) for the
    /// pattern), with a client for `endpoint` and the AWS credential chain.
    pub fn open_url(
        url: &str,
        endpoint: &Endpoint,
        opts: &RemoteOptions,
    ) -> Result<Self, PipelineError> {
        let (s3, pattern) = endpoint.connect(url)?;
        Shards::open_s3(&s3, pattern, opts)
    }
}

impl Endpoint {
    /// A client for the bucket of `url` (`s3://bucket/rest`), and the rest.
    pub fn connect<'a>(&self, url: &'a str) -> Result<(S3, &'a str), PipelineError> {
        let rest = url
            .strip_prefix("s3://")
            .ok_or_else(|| PipelineError::config(format!("{url}: not an s3:// URL")))?;
        let (bucket, key) = rest.split_once('/').unwrap_or((rest, ""));
        if bucket.is_empty() {
            return Err(PipelineError::config(format!("{url}: no bucket")));
        }
        let mut cfg = crate::s3::S3Config::new(bucket);
        if let Some(e) = self
            .url
            .clone()
            .or_else(|| std::env::var("AWS_ENDPOINT_URL").ok())
        {
            cfg = cfg.endpoint(e);
        }
        if let Some(r) = &self.region {
            cfg = cfg.region(r.clone());
        }
        let s3 = S3::connect(cfg).map_err(|e| PipelineError::io("connecting to S3", e))?;
        Ok((s3, key))
    }
}

/// `s3://bucket/pattern` with the client from the environment (`AWS_ENDPOINT_URL`, the AWS
/// chain) and the cache's byte limit from `FLOWGATE_SHARD_CACHE_BYTES`.
pub(super) fn open_url(url: &str) -> Result<Shards, PipelineError> {
    let mut opts = RemoteOptions::default();
    if let Ok(v) = std::env::var("FLOWGATE_SHARD_CACHE_BYTES") {
        opts.cache_bytes = v.parse().map_err(|_| {
            PipelineError::config(format!(
                "FLOWGATE_SHARD_CACHE_BYTES={v:?} is not a number of bytes"
            ))
        })?;
    }
    Shards::open_url(url, &Endpoint::default(), &opts)
}
