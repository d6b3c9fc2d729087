//! Opening tar shards on S3 (feature `s3`): a key pattern, a prefix or a manifest listed
//! into shards with their sample counts (from the manifest, else each shard downloaded and
//! indexed once), read through the disk cache ([`super::disk_cache`]).

use std::path::PathBuf;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, OnceLock};

use flowgate_actors::error::PipelineError;

use super::disk_cache::{default_dir, ShardCache};
use super::{Body, Inner, Shard, Shards, MANIFEST};
use crate::s3::{Endpoint, S3Error, S3};

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
        if let Some(counts) = &counts {
            // A sample is at least one 512-byte tar header: a manifest that claims more than
            // a shard's bytes can hold lies, and would size the index by its lie.
            for ((o, k), &n) in objects.iter().zip(&keys).zip(counts) {
                if n as u64 > o.size / 512 {
                    return Err(PipelineError::config(format!(
                        "s3://{bucket}/{k}: the manifest says {n} samples; its {} bytes hold \
                         at most {}",
                        o.size,
                        o.size / 512
                    )));
                }
            }
        }
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
            // A shard whose download failed (past the client's retries: a burst of errors) is
            // fetched again after the cache's backoff, a few times, before opening fails.
            for (slot, entry) in entries.iter().enumerate() {
                let mut wait = super::disk_cache::RETRY_AFTER;
                for attempt in 0..=INDEX_RETRIES {
                    if entry.get().is_some() {
                        break;
                    }
                    match cache.file(slot) {
                        Ok(file) => {
                            let _ = entry.set(super::index_file(&file, opts.max_member));
                        }
                        // A shard that could not be indexed has no sample count: guessing one
                        // would change the epoch's order and the checkpoints' fingerprint.
                        Err(e)
                            if attempt == INDEX_RETRIES
                                || matches!(
                                    *e,
                                    crate::s3::S3Error::NotFound { .. }
                                        | crate::s3::S3Error::Forbidden { .. }
                                ) =>
                        {
                            return Err(PipelineError::config(format!(
                                "{}: the shard could not be indexed (no manifest gives its \
                                 sample count; open again, or write one with \
                                 Shards::write_manifest): {e}",
                                cache.url(slot).display()
                            )));
                        }
                        Err(_) => {
                            std::thread::sleep(wait);
                            wait *= 2;
                        }
                    }
                }
            }
        }
        let shards = entries
            .into_iter()
            .enumerate()
            .map(|(slot, entries)| Shard {
                path: cache.url(slot),
                len: match &counts {
                    Some(c) => c[slot],
                    None => entries.get().map_or(0, Vec::len),
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
/// How many more times opening fetches a shard it must index whose download failed (after
/// 1, 2, 4 s: the cache's backoff).
const INDEX_RETRIES: u32 = 3;

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
