//! Tar shards on S3 against a real S3-compatible server (s3s-fs on 127.0.0.1, started and
//! stopped by each test), through a proxy that counts every GET or injects faults: ranks,
//! GETs per shard and epoch, exact resume, cut-off bodies continued by range, bad shards and
//! manifests named.
#![cfg(feature = "s3")]

use std::time::Duration;

use flowgate::s3::{RetryPolicy, S3};
use flowgate::Pipeline;

use crate::s3_common;
use s3_common::{fixture, jpeg, proxy_to, put, through, TempDir};

/// Tar shards on the local S3 server: `shards` shards of `per` samples (`jpg`, `cls`,
/// `json` holding the sample's number) under `train/`, and, with `manifest`, their
/// `shards.json`.
fn upload_shards(s3: &S3, shards: usize, per: usize, manifest: bool) {
    let mut list = Vec::new();
    for s in 0..shards {
        let mut members = Vec::new();
        for i in 0..per {
            let n = s * per + i;
            let key = format!("{n:06}");
            members.push((format!("{key}.jpg"), jpeg(8, 8, n as u8)));
            members.push((format!("{key}.cls"), (n % 10).to_string().into_bytes()));
            members.push((
                format!("{key}.json"),
                format!("{{\"n\": {n}}}").into_bytes(),
            ));
        }
        let mut tar = Vec::new();
        flowgate::dataset::shards::tar::write_archive(&mut tar, members).unwrap();
        put(s3, &format!("train/shard-{s:06}.tar"), tar);
        list.push(format!(
            "{{\"url\": \"shard-{s:06}.tar\", \"nsamples\": {per}}}"
        ));
    }
    if manifest {
        let json = format!("{{\"shardlist\": [{}]}}", list.join(", "));
        put(s3, "train/shards.json", json.into_bytes());
    }
}

/// The sample's number, from its `json` field.
fn sample_number(r: &flowgate::dataset::shards::SampleRef) -> u64 {
    let raw = r.read().unwrap_or_else(|e| panic!("{r}: {e}"));
    let (_, json) = raw
        .fields
        .iter()
        .find(|(e, _)| e == "json")
        .expect("a json field");
    let text = std::str::from_utf8(json).unwrap();
    text.trim_matches(|c: char| !c.is_ascii_digit())
        .parse()
        .unwrap()
}

/// A fixture holding `shards` shards of `per` samples (and with `manifest`, their manifest),
/// a counting proxy (no faults) in front of its server, a client through it, and a cache folder.
fn shards_behind_a_proxy(
    name: &str,
    shards: usize,
    per: usize,
    manifest: bool,
) -> (
    s3_common::Fixture,
    s3_common::fault_proxy::FaultProxy,
    S3,
    TempDir,
) {
    let f = fixture(name);
    upload_shards(&f.s3, shards, per, manifest);
    let proxy = proxy_to(&f, false);
    let s3 = through(&f, &proxy);
    let caches = TempDir(f._dir.0.with_extension("cache"));
    (f, proxy, s3, caches)
}

fn open_s3_shards(
    s3: &S3,
    pattern: &str,
    cache: &std::path::Path,
    cache_bytes: u64,
) -> flowgate::dataset::shards::Shards {
    let opts = flowgate::dataset::shards::remote::RemoteOptions {
        cache_dir: cache.to_owned(),
        cache_bytes,
        ..Default::default()
    };
    flowgate::dataset::shards::Shards::open_s3(s3, pattern, &opts).unwrap()
}

#[test]
fn sixty_four_shards_on_s3_read_by_four_ranks_once_each_with_one_get_per_shard() {
    use std::collections::HashSet;
    use std::sync::atomic::Ordering;

    let (_f, proxy, s3, caches) = shards_behind_a_proxy("shards64", 64, 100, true);
    let pattern = "train/shard-{000000..000063}.tar";
    let rank = |r: usize, seed: u64| {
        // Each rank its own cache folder, as on its own machine; no disk cache beyond the
        // working set.
        open_s3_shards(&s3, pattern, &caches.0.join(format!("rank{r}")), 0)
            .shuffle(seed)
            .buffer(300)
            .shard(r, 4)
            .unwrap()
    };
    let ranks: Vec<_> = (0..4).map(|r| rank(r, 7)).collect();
    assert_eq!(
        proxy.counts.gets_of(".tar").len(),
        0,
        "with a manifest, opening reads no shard"
    );
    let mut orders = Vec::new();
    for epoch in 0..2u64 {
        let before = proxy.counts.gets_of(".tar");
        let mut all = Vec::new();
        let mut lens = Vec::new();
        let mut rank0 = Vec::new();
        for (r, shards) in ranks.iter().enumerate() {
            // At every sample read, the disk cache (no room beyond the working set here)
            // holds no more than its working set: what it may not evict now.
            let cache = shards.cache().unwrap();
            let got: Vec<u64> = shards
                .epoch(epoch)
                .iter()
                .map(|s| {
                    let n = sample_number(s);
                    let c = cache.stats();
                    assert!(c.bytes <= c.limit.max(c.pinned), "rank {r}: {c:?}");
                    n
                })
                .collect();
            lens.push(got.len());
            if r == 0 {
                rank0 = got.clone();
            }
            all.extend(got);
        }
        assert_eq!(lens, [1600; 4], "equal shares");
        let distinct: HashSet<u64> = all.iter().copied().collect();
        assert_eq!(
            (all.len(), distinct.len()),
            (6400, 6400),
            "each sample once"
        );
        let after = proxy.counts.gets_of(".tar");
        let mut per_shard: Vec<u64> = after
            .iter()
            .map(|(k, n)| n - before.get(k).copied().unwrap_or(0))
            .collect();
        per_shard.sort_unstable();
        assert!(
            per_shard.iter().all(|&n| n <= 1),
            "epoch {epoch}: at most one GET per shard, got {per_shard:?}"
        );
        if epoch == 0 {
            assert_eq!(
                per_shard.len(),
                64,
                "every shard fetched in the first epoch"
            );
        }
        orders.push(rank0);
    }
    assert_ne!(orders[0], orders[1], "the order changes between epochs");
    assert_eq!(proxy.counts.ranged.load(Ordering::Relaxed), 0);
    // The same seed repeats the order, from a fresh process's cache.
    let again = rank(0, 7);
    let first: Vec<u64> = again.epoch(1).iter().map(sample_number).collect();
    assert_eq!(first, orders[1], "the same seed, the same order");
    let c = ranks[0].cache().unwrap().stats();
    assert!(c.downloads >= 16 && c.evictions > 0, "{c:?}");
    assert!(c.pinned <= c.bytes, "{c:?}");
}

#[test]
fn a_mid_shard_checkpoint_on_s3_resumes_exactly() {
    use flowgate::{Order, Workers};

    let f = fixture("shards-resume");
    upload_shards(&f.s3, 12, 40, false);
    let caches = TempDir(f._dir.0.with_extension("cache"));
    let build = |cache: &str| {
        // Without a manifest: opening downloads and indexes every shard, into the cache.
        let shards = open_s3_shards(&f.s3, "train/", &caches.0.join(cache), 1 << 30)
            .shuffle(3)
            .buffer(50)
            .shard(1, 2)
            .unwrap();
        Pipeline::builder()
            .source_sampled(shards.sampler().clone(), shards.refs())
            .checkpoint_fields(shards.fingerprint())
            .describe(|r| r.to_string())
            .pipe(
                "read",
                |r| Ok::<_, String>(sample_number(&r)),
                Workers::fixed(2),
            )
            .output_order(Order::Input)
            .aggregate(16, false)
            .build()
            .unwrap()
    };
    let whole: Vec<u64> = build("whole")
        .iter()
        .map(Result::unwrap)
        .collect::<Vec<_>>()
        .concat();
    assert_eq!(whole.len(), 240);
    let mut got = Vec::new();
    let mut state = None;
    for (leg, stop_after) in [3usize, 5, usize::MAX].into_iter().enumerate() {
        // Each leg a fresh loader and cache, as after a restart on another machine.
        let mut p = build(&format!("leg{leg}"));
        if let Some(s) = &state {
            p.resume(s).unwrap();
        }
        for b in p.iter().take(stop_after) {
            got.extend(b.unwrap());
        }
        state = Some(p.state());
    }
    assert_eq!(got, whole, "chained resumes give the epoch in its order");
}

#[test]
fn a_shard_cut_off_mid_stream_is_continued_with_a_ranged_get() {
    use std::collections::HashSet;
    use std::sync::atomic::Ordering;

    let f = fixture("shards-cut");
    upload_shards(&f.s3, 40, 60, true);
    let proxy = proxy_to(&f, true);
    let policy = RetryPolicy {
        max_attempts: 6,
        base_delay: Duration::from_millis(10),
        max_delay: Duration::from_millis(100),
        budget: 5_000,
        ..RetryPolicy::default()
    };
    let s3 = S3::connect(
        f.server
            .config("data")
            .endpoint(format!("http://{}", proxy.addr))
            .retry(policy)
            .attempt_timeout(Duration::from_millis(700)),
    )
    .unwrap();
    let caches = TempDir(f._dir.0.with_extension("cache"));
    let shards = open_s3_shards(&s3, "train/shards.json", &caches.0, 0).shuffle(1);
    let got: Vec<u64> = shards.epoch(0).iter().map(sample_number).collect();
    let distinct: HashSet<u64> = got.iter().copied().collect();
    assert_eq!(
        (got.len(), distinct.len()),
        (2400, 2400),
        "every sample, once"
    );
    let c = &proxy.counts;
    assert!(
        c.truncated.load(Ordering::Relaxed) > 0,
        "the proxy cut bodies off"
    );
    assert!(
        c.ranged.load(Ordering::Relaxed) > 0,
        "cut-off shards continued by range"
    );
    assert_eq!(
        c.ranged_if_match.load(Ordering::Relaxed),
        c.ranged.load(Ordering::Relaxed),
        "every continuation pinned to the version it continues (If-Match)"
    );
    assert!(s3.stats().resumed > 0);
}

#[test]
fn a_missing_shard_and_a_lying_manifest_fail_naming_the_shard() {
    let f = fixture("shards-bad");
    upload_shards(&f.s3, 3, 10, false);
    let caches = TempDir(f._dir.0.with_extension("cache"));
    let opts = flowgate::dataset::shards::remote::RemoteOptions {
        cache_dir: caches.0.clone(),
        ..Default::default()
    };
    let err = flowgate::dataset::shards::Shards::open_s3(
        &f.s3,
        "train/shard-{000000..000003}.tar",
        &opts,
    )
    .unwrap_err()
    .to_string();
    assert!(
        err.contains("s3://data/train/shard-000003.tar: no such shard"),
        "{err}"
    );
    // A manifest whose count no shard's bytes could hold: refused when opened, naming the
    // shard (not an index of 10^13 places).
    let json = r#"{"shardlist": [{"url": "shard-000000.tar", "nsamples": 10000000000000}]}"#;
    put(&f.s3, "train/huge.json", json.as_bytes().to_vec());
    let err = flowgate::dataset::shards::Shards::open_s3(&f.s3, "train/huge.json", &opts)
        .unwrap_err()
        .to_string();
    assert!(
        err.contains("shard-000000.tar: the manifest says 10000000000000 samples"),
        "{err}"
    );
    // A manifest that claims 12 samples for a 10-sample shard: the two places past the end
    // fail naming the shard and the mismatch; the rest read.
    let json = r#"{"shardlist": [{"url": "shard-000000.tar", "nsamples": 12}]}"#;
    put(&f.s3, "train/lying.json", json.as_bytes().to_vec());
    let shards =
        flowgate::dataset::shards::Shards::open_s3(&f.s3, "train/lying.json", &opts).unwrap();
    assert_eq!(shards.len(), 12);
    let (ok, bad): (Vec<_>, Vec<_>) = shards
        .epoch(0)
        .into_iter()
        .map(|r| r.read())
        .partition(Result::is_ok);
    assert_eq!((ok.len(), bad.len()), (10, 2));
    for e in bad {
        let e = e.unwrap_err().to_string();
        assert!(
            e.contains("s3://data/train/shard-000000.tar")
                && e.contains("the manifest says 12 samples, the shard holds 10"),
            "{e}"
        );
    }
}

/// The tuner sizes how many shards are fetched ahead: over a slow link (every shard GET takes
/// 40 ms) readers started with one shard ahead wait for downloads, and the tuner deepens the
/// read-ahead (decisions in the trace, the depth in the stage's statistics) up to its ceiling,
/// while each sample is still read once and each shard fetched once.
#[test]
fn the_tuner_deepens_the_shard_read_ahead_when_readers_wait() {
    use std::sync::atomic::Ordering;
    let f = fixture("readahead");
    upload_shards(&f.s3, 24, 20, true);
    let proxy = proxy_to(&f, false);
    proxy.counts.tar_latency_ms.store(40, Ordering::Relaxed);
    let s3 = through(&f, &proxy);
    let cache = TempDir(f._dir.0.with_extension("cache"));
    let shards = open_s3_shards(&s3, "train/shard-{000000..000023}.tar", &cache.0, 0).prefetch(1);
    let read_ahead = shards.read_ahead().expect("shards on S3 have a read-ahead");
    assert_eq!(read_ahead.read_ahead_stats().depth, 1);
    let source = shards.clone();
    let mut p = Pipeline::builder()
        .source_sampled(shards.sampler().clone(), move |e, i| source.get(e, i))
        .pipe(
            "read",
            |r: flowgate::dataset::shards::SampleRef| Ok::<_, String>(sample_number(&r)),
            flowgate::Workers::fixed(1),
        )
        .read_ahead(read_ahead.clone())
        .autotune(flowgate::TunerSettings {
            tick: Some(Duration::from_millis(20)),
            ..Default::default()
        })
        .build()
        .unwrap();
    let mut got: Vec<u64> = p.iter().map(|r| r.unwrap()).collect();
    got.sort_unstable();
    assert_eq!(got, (0..480).collect::<Vec<u64>>(), "each sample once");
    let deepened: Vec<String> = p
        .tuner_trace()
        .iter()
        .flat_map(|t| t.decisions.iter())
        .filter(|d| matches!(d.action, flowgate_tuner::Action::SetReadAhead { .. }))
        .map(|d| d.reason.clone())
        .collect();
    let s = read_ahead.read_ahead_stats();
    assert!(
        !deepened.is_empty() && s.depth > 1 && s.depth <= s.max_depth,
        "depth {} of at most {}, decisions {deepened:?}",
        s.depth,
        s.max_depth
    );
    assert!(
        deepened[0].contains("waited for their fetch"),
        "{deepened:?}"
    );
    let stage = p
        .stats()
        .stage("read")
        .unwrap()
        .read_ahead
        .expect("in the stage's stats");
    assert_eq!(stage.depth, s.depth);
    let gets = proxy.counts.gets_of(".tar");
    assert!(
        gets.values().all(|&n| n == 1) && gets.len() == 24,
        "{gets:?}"
    );
}

/// A shard whose download failed is not lost for the life of the process: its samples fail
/// (counted) while the store lacks it, and the next epoch fetches it again.
#[test]
fn a_shard_whose_download_failed_is_fetched_again_in_the_next_epoch() {
    let f = fixture("shards-retry");
    upload_shards(&f.s3, 3, 10, true);
    let caches = TempDir(f._dir.0.with_extension("cache"));
    let opts = flowgate::dataset::shards::remote::RemoteOptions {
        cache_dir: caches.0.clone(),
        ..Default::default()
    };
    let shards = flowgate::dataset::shards::Shards::open_s3(
        &f.s3,
        "train/shard-{000000..000002}.tar",
        &opts,
    )
    .unwrap();
    // The store loses shard 1 after the shards were opened (an outage, a bad node).
    let stored = f._dir.0.join("data/train/shard-000001.tar");
    let aside = stored.with_extension("aside");
    std::fs::rename(&stored, &aside).unwrap();
    let read = |epoch: u64| -> (usize, Vec<String>) {
        let (ok, bad): (Vec<_>, Vec<_>) = shards
            .epoch(epoch)
            .into_iter()
            .map(|r| r.read())
            .partition(Result::is_ok);
        (
            ok.len(),
            bad.into_iter()
                .map(|e| e.unwrap_err().to_string())
                .collect(),
        )
    };
    let (ok, bad) = read(0);
    assert_eq!((ok, bad.len()), (20, 10));
    assert!(
        bad.iter().all(|e| e.contains("shard-000001.tar")),
        "{bad:?}"
    );
    // Back on the store: the next epoch reads every sample.
    std::fs::rename(&aside, &stored).unwrap();
    let (ok, bad) = read(1);
    assert_eq!((ok, bad.len()), (30, 0), "{bad:?}");
    assert!(shards.cache().unwrap().stats().failures >= 1);
}

/// Makes the download of `key` impossible to put in place: a folder holds its cache file's
/// name (the cache names a file by its key and entity tag, else its size). Returns the folder.
fn block_cache_file(f: &s3_common::Fixture, caches: &TempDir, key: &str) -> std::path::PathBuf {
    let o = f.s3.objects(&[key]).unwrap()[0].clone().unwrap();
    let tag = o
        .etag
        .map_or(o.size.to_string(), |t| t.trim_matches('"').to_owned());
    let (dir, name) = key.rsplit_once('/').unwrap();
    let blocked = caches
        .0
        .join("data")
        .join(dir)
        .join(format!("{name}@{tag}"));
    std::fs::create_dir_all(blocked.join("x")).unwrap();
    blocked
}

/// Without a manifest every shard is indexed when opened; one that cannot be (its download
/// fails) is an error naming it, not a shard of one made-up sample.
#[test]
fn a_shard_that_cannot_be_indexed_is_an_error_naming_it() {
    let f = fixture("shards-index");
    upload_shards(&f.s3, 3, 10, false);
    let caches = TempDir(f._dir.0.with_extension("cache"));
    block_cache_file(&f, &caches, "train/shard-000001.tar");
    let opts = flowgate::dataset::shards::remote::RemoteOptions {
        cache_dir: caches.0.clone(),
        ..Default::default()
    };
    let err = flowgate::dataset::shards::Shards::open_s3(
        &f.s3,
        "train/shard-{000000..000002}.tar",
        &opts,
    )
    .unwrap_err()
    .to_string();
    assert!(
        err.contains("s3://data/train/shard-000001.tar: the shard could not be indexed"),
        "{err}"
    );
}

/// A shard whose download fails while the shards are opened (indexed, without a manifest)
/// is fetched again after the cache's backoff: a failure that passes (here the cache file's
/// place blocked for half a second) does not fail the open.
#[test]
fn a_shard_whose_indexing_download_fails_once_is_fetched_again() {
    let f = fixture("shards-index-retry");
    upload_shards(&f.s3, 3, 10, false);
    let caches = TempDir(f._dir.0.with_extension("cache"));
    let blocked = block_cache_file(&f, &caches, "train/shard-000001.tar");
    let unblock = {
        let blocked = blocked.clone();
        std::thread::spawn(move || {
            std::thread::sleep(Duration::from_millis(500));
            std::fs::remove_dir_all(blocked).unwrap();
        })
    };
    let opts = flowgate::dataset::shards::remote::RemoteOptions {
        cache_dir: caches.0.clone(),
        ..Default::default()
    };
    let shards = flowgate::dataset::shards::Shards::open_s3(
        &f.s3,
        "train/shard-{000000..000002}.tar",
        &opts,
    )
    .expect("the second download of shard 1 succeeds");
    unblock.join().unwrap();
    assert_eq!(shards.len(), 30);
    assert!(shards.cache().unwrap().stats().failures >= 1);
}

/// A resumed epoch plans its downloads from what it still reads: shards whose samples were
/// all delivered before the checkpoint are not fetched again, each shard still needed is
/// fetched once, and every shard leaves the disk cache once its last sample is read (a plan
/// counted from the epoch's start keeps the partly read ones forever).
#[test]
fn a_resumed_epoch_fetches_only_the_shards_it_still_reads_and_releases_them() {
    use flowgate::{Order, Workers};
    use std::collections::HashSet;

    let (f, proxy, s3, caches) = shards_behind_a_proxy("shards-resume-plan", 12, 20, true);
    let pattern = "train/shard-{000000..000011}.tar";
    let build = |cache: &str| {
        let shards = open_s3_shards(&s3, pattern, &caches.0.join(cache), 0)
            .shuffle(5)
            .buffer(30)
            .prefetch(3);
        let planner = shards.clone();
        let p = Pipeline::builder()
            .source_sampled_planned(shards.sampler().clone(), shards.refs(), move |e, r| {
                planner.plan_reads(e, r)
            })
            .checkpoint_fields(shards.fingerprint())
            .describe(|r| r.to_string())
            .pipe(
                "read",
                |r| Ok::<_, String>(sample_number(&r)),
                Workers::fixed(2),
            )
            .output_order(Order::Input)
            .aggregate(10, false)
            .build()
            .unwrap();
        (p, shards)
    };
    // Two thirds of the epoch, then a checkpoint.
    let (mut first, _) = build("first");
    let before: Vec<u64> = first
        .iter()
        .take(16)
        .map(Result::unwrap)
        .collect::<Vec<_>>()
        .concat();
    let state = first.state();
    drop(first);
    let shard_of = |n: u64| format!("shard-{:06}.tar", n / 20);
    let gets_before = proxy.counts.gets_of(".tar");
    // A new process, an empty cache: the rest of the epoch.
    let (mut second, shards) = build("second");
    second.resume(&state).unwrap();
    let rest: Vec<u64> = second
        .iter()
        .map(Result::unwrap)
        .collect::<Vec<_>>()
        .concat();
    let all: HashSet<u64> = before.iter().chain(&rest).copied().collect();
    assert_eq!((before.len() + rest.len(), all.len()), (240, 240));
    let needed: HashSet<String> = rest.iter().map(|&n| shard_of(n)).collect();
    let after = proxy.counts.gets_of(".tar");
    let fetched: Vec<(String, u64)> = after
        .iter()
        .map(|(k, n)| (k.clone(), n - gets_before.get(k).copied().unwrap_or(0)))
        .filter(|(_, n)| *n > 0)
        .collect();
    for (key, n) in &fetched {
        let name = key.rsplit('/').next().unwrap();
        assert!(
            needed.contains(name),
            "{name} was fetched after the resume, but none of its samples is left: {fetched:?}"
        );
        assert_eq!(*n, 1, "{name} fetched {n} times after the resume");
    }
    assert_eq!(fetched.len(), needed.len(), "{fetched:?} for {needed:?}");
    // Every shard read to its last sample: the cache holds at most its working set.
    let c = shards.cache().unwrap().stats();
    let shard_bytes = std::fs::metadata(f._dir.0.join("data/train/shard-000000.tar"))
        .unwrap()
        .len();
    assert!(
        c.bytes <= 2 * shard_bytes,
        "{} bytes left in the cache after the epoch ({} per shard): {c:?}",
        c.bytes,
        shard_bytes
    );
}

/// A shard rewritten on the store after it was indexed (opened without a manifest) and
/// evicted from the disk cache: its next download is pinned to the indexed version
/// (`If-Match`, checked by the proxy as S3 does), so its samples fail saying the shard
/// changed, never read at the old index's offsets from the new bytes; the other shards read
/// as before.
#[test]
fn a_shard_rewritten_after_it_was_indexed_fails_naming_the_change() {
    use std::sync::atomic::Ordering;
    let (f, proxy, s3, caches) = shards_behind_a_proxy("shards-rewrite", 4, 10, false);
    // Indexed when opened, one after another; with no room beyond the working set, the
    // first two leave the cache again.
    let opts = flowgate::dataset::shards::remote::RemoteOptions {
        cache_dir: caches.0.clone(),
        cache_bytes: 0,
        index_concurrency: 1,
        ..Default::default()
    };
    let shards = flowgate::dataset::shards::Shards::open_s3(&s3, "train/", &opts).unwrap();
    assert_eq!(shards.cache().unwrap().stats().evictions, 2);
    // Shard 0 written again: the same members in another order (other offsets).
    let mut members = Vec::new();
    for i in (0..10).rev() {
        let key = format!("{i:06}");
        members.push((format!("{key}.jpg"), jpeg(8, 8, i as u8)));
        members.push((format!("{key}.cls"), (i % 10).to_string().into_bytes()));
        members.push((
            format!("{key}.json"),
            format!("{{\"n\": {i}}}").into_bytes(),
        ));
    }
    let mut tar = Vec::new();
    flowgate::dataset::shards::tar::write_archive(&mut tar, members).unwrap();
    put(&f.s3, "train/shard-000000.tar", tar);
    let mut ok = Vec::new();
    let mut bad = Vec::new();
    for r in shards.epoch(0) {
        match r.read() {
            Ok(_) => ok.push(sample_number(&r)),
            Err(e) => bad.push(e.to_string()),
        }
    }
    assert_eq!((ok.len(), bad.len()), (30, 10), "{bad:?}");
    assert!(ok.iter().all(|&n| n >= 10), "{ok:?}");
    assert!(
        bad.iter()
            .all(|e| e.contains("shard-000000.tar") && e.contains("changed on the store")),
        "{bad:?}"
    );
    assert!(proxy.counts.precondition_failed.load(Ordering::Relaxed) >= 1);
}

/// A pipeline stopped while its readers wait for shard downloads stops at once: the readers
/// check their stage between short waits instead of waiting out a slow download (here 20 s
/// a shard), which goes on for whoever reads the shard next.
#[test]
fn stopping_does_not_wait_for_shard_downloads() {
    use flowgate::Workers;
    use std::sync::atomic::Ordering;
    use std::time::Instant;
    let f = fixture("shards-stop");
    upload_shards(&f.s3, 4, 10, true);
    let proxy = proxy_to(&f, false);
    proxy.counts.tar_latency_ms.store(20_000, Ordering::Relaxed);
    let s3 = through(&f, &proxy);
    let caches = TempDir(f._dir.0.with_extension("cache"));
    let shards = open_s3_shards(&s3, "train/shard-{000000..000003}.tar", &caches.0, 0);
    let mut p = Pipeline::builder()
        .source_sampled(shards.sampler().clone(), shards.refs())
        .pipe(
            "read",
            |r| r.read().map(|s| s.fields.len()),
            Workers::fixed(3),
        )
        .build()
        .unwrap();
    let stop = p.stop_handle();
    let stopped_at = std::sync::Arc::new(std::sync::Mutex::new(None));
    let at = std::sync::Arc::clone(&stopped_at);
    let stopper = std::thread::spawn(move || {
        std::thread::sleep(Duration::from_millis(500));
        *at.lock().unwrap() = Some(Instant::now());
        stop.stop();
    });
    let last = p.iter().last().expect("the stop ends the epoch");
    assert!(last.unwrap_err().is_stopped());
    drop(p);
    let took = stopped_at.lock().unwrap().expect("stopped").elapsed();
    stopper.join().unwrap();
    assert!(took < Duration::from_secs(5), "stopping took {took:?}");
}
