//! S3 integration tests against a real S3-compatible server (s3s-fs, installed by
//! `scripts/setup.sh --test`), started on a free 127.0.0.1 port for each test and stopped when
//! it ends. Nothing here is a mock.
#![cfg(feature = "s3")]

use std::path::PathBuf;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use flowgate::byte_cache::ByteCache;
use flowgate::media::image::ImageRecipe;
use flowgate::s3::{LocalServer, RetryPolicy, S3Error, S3};
use flowgate::{Blob, Pipeline, Tensor};

use crate::s3_common;
use s3_common::{fixture, jpeg, proxy_to, put};

#[test]
fn lists_every_page_and_reads_ranges() {
    let f = fixture("list");
    let mut want = Vec::new();
    for i in 0..23 {
        let key = format!("train/{i:03}.bin");
        let bytes: Vec<u8> = (0..(100 + i)).map(|b| (b * 7 + i) as u8).collect();
        put(&f.s3, &key, bytes.clone());
        want.push((key, bytes));
    }
    put(&f.s3, "other/x.bin", vec![1, 2, 3]);
    let listed = f.s3.list("train/").unwrap();
    assert_eq!(listed.len(), 23, "all pages of 7");
    for (o, (key, bytes)) in listed.iter().zip(&want) {
        assert_eq!(&o.key, key);
        assert_eq!(o.size, bytes.len() as u64);
    }
    let (key, bytes) = &want[5];
    let got = futures::executor::block_on(f.s3.get(key)).unwrap();
    assert_eq!(&got.bytes, bytes);
    assert_eq!(got.path, PathBuf::from(key));
    let part = futures::executor::block_on(f.s3.get_range(key, 10..30)).unwrap();
    assert_eq!(part.bytes, bytes[10..30]);
    let tail = futures::executor::block_on(f.s3.get_range(key, 90..10_000)).unwrap();
    assert_eq!(
        tail.bytes,
        bytes[90..],
        "a range past the end returns what exists"
    );
    assert!(f.s3.list("nothing/").unwrap().is_empty());
}

#[test]
fn a_pipeline_decodes_from_s3_and_names_bad_keys() {
    let f = fixture("pipeline");
    let mut keys = Vec::new();
    for i in 0..12u8 {
        let key = format!("img/{i:02}.jpg");
        put(&f.s3, &key, jpeg(300 + u32::from(i), 240, i));
        keys.push(key);
    }
    put(&f.s3, "img/zero.jpg", Vec::new());
    put(
        &f.s3,
        "img/random.jpg",
        (0..4000u32)
            .map(|i| i.wrapping_mul(2_654_435_761) as u8)
            .collect(),
    );
    let whole = jpeg(320, 240, 99);
    put(
        &f.s3,
        "img/truncated.jpg",
        whole[..whole.len() / 2].to_vec(),
    );
    let mut all: Vec<String> =
        f.s3.list("img/")
            .unwrap()
            .into_iter()
            .map(|o| o.key)
            .collect();
    all.push("img/missing.jpg".into());
    assert_eq!(all.len(), 16);

    let recipe = ImageRecipe::default();
    let failures = Arc::new(Mutex::new(Vec::new()));
    let seen = Arc::clone(&failures);
    let mut p = Pipeline::builder()
        .source(all)
        .pipe_async("fetch", f.s3.fetcher(), 4)
        .pipe("decode", move |b: Blob| recipe.decode(&b.bytes, &b.path), 2)
        .on_failure(move |e| {
            seen.lock()
                .unwrap()
                .push((e.stage().to_owned(), e.to_string()))
        })
        .build()
        .unwrap();
    let out: Vec<Tensor> = p.iter().map(Result::unwrap).collect();
    assert_eq!(out.len(), 12);
    assert!(out.iter().all(|t| t.shape() == [3, 224, 224]));
    let failures = failures.lock().unwrap().clone();
    assert_eq!(failures.len(), 4, "{failures:?}");
    let find = |name: &str| {
        failures
            .iter()
            .find(|(_, m)| m.contains(name))
            .unwrap_or_else(|| panic!("{name} not reported: {failures:?}"))
            .clone()
    };
    let (stage, msg) = find("img/missing.jpg");
    assert_eq!(stage, "fetch");
    assert!(msg.contains("no such key"), "{msg}");
    for name in ["img/zero.jpg", "img/random.jpg", "img/truncated.jpg"] {
        assert_eq!(find(name).0, "decode");
    }
    assert_eq!(p.stats().failures, 4);
}

#[test]
fn wrong_credentials_are_a_typed_403_naming_the_key() {
    let f = fixture("forbidden");
    put(&f.s3, "a.bin", vec![1; 10]);
    let bad = S3::connect(
        f.server
            .config("data")
            .credentials(LocalServer::ACCESS_KEY, "not-the-secret"),
    )
    .unwrap();
    let started = Instant::now();
    match futures::executor::block_on(bad.get("a.bin")) {
        Err(S3Error::Forbidden { key, .. }) => assert_eq!(key, "a.bin"),
        other => panic!("expected Forbidden, got {other:?}"),
    }
    assert_eq!(bad.stats().retries, 0, "a 403 is not retried");
    assert!(started.elapsed() < Duration::from_secs(5));
}

#[test]
fn a_server_that_is_gone_fails_fast_within_the_retry_policy() {
    let f = fixture("gone");
    put(&f.s3, "a.bin", vec![1; 10]);
    let policy = RetryPolicy {
        max_attempts: 4,
        base_delay: Duration::from_millis(5),
        max_delay: Duration::from_millis(20),
        ..RetryPolicy::default()
    };
    let s3 = S3::connect(
        f.server
            .config("data")
            .retry(policy)
            .attempt_timeout(Duration::from_secs(2)),
    )
    .unwrap();
    assert_eq!(
        futures::executor::block_on(s3.get("a.bin")).unwrap().bytes,
        vec![1; 10]
    );
    drop(f.server); // the server stops; the port refuses connections
    let started = Instant::now();
    let err = futures::executor::block_on(s3.get("a.bin")).unwrap_err();
    match &err {
        S3Error::Request { key, attempts, .. } => {
            assert_eq!(key, "a.bin");
            assert_eq!(*attempts, 4);
        }
        other => panic!("expected a request error after retries, got {other:?}"),
    }
    let stats = s3.stats();
    assert_eq!(stats.retries, 3);
    assert_eq!(stats.budget_left, RetryPolicy::default().budget - 3 * 5);
    assert!(
        started.elapsed() < Duration::from_secs(10),
        "{:?}",
        started.elapsed()
    );
}

#[test]
fn a_second_epoch_through_the_cache_makes_no_request() {
    let f = fixture("cache");
    let keys: Vec<String> = (0..20).map(|i| format!("blob/{i:02}")).collect();
    for (i, k) in keys.iter().enumerate() {
        put(&f.s3, k, vec![i as u8; 10_000]);
    }
    let cache = ByteCache::new(1 << 20);
    let fetch = cache.through(f.s3.fetcher());
    let list = keys.clone();
    let mut p = Pipeline::builder()
        .source_epochs(move |_| list.clone())
        .pipe_async("fetch", fetch, 4)
        .cache(&cache)
        .build()
        .unwrap();
    let before = f.s3.stats().attempts;
    let first: usize = p.iter().map(|b| b.unwrap().bytes.len()).sum();
    let after_first = f.s3.stats().attempts;
    assert_eq!(after_first - before, 20);
    let second: usize = p.iter().map(|b| b.unwrap().bytes.len()).sum();
    assert_eq!(first, 200_000);
    assert_eq!(second, 200_000);
    assert_eq!(
        f.s3.stats().attempts,
        after_first,
        "the second epoch hit the cache"
    );
    let stats = p.stats();
    let c = stats
        .stage("fetch")
        .unwrap()
        .cache
        .expect("cache stats on the stage");
    assert_eq!((c.hits, c.misses, c.bytes), (20, 20, 200_000));
}

/// The body of object `i`: its bytes say which object it is and how long it is.
fn object_body(i: usize) -> Vec<u8> {
    (0..3000 + 37 * i)
        .map(|b| (b as u32).wrapping_mul(31).wrapping_add(i as u32) as u8)
        .collect()
}

#[test]
fn under_injected_faults_every_item_is_delivered_or_reported_once() {
    use std::collections::{HashMap, HashSet};
    use std::sync::atomic::Ordering;

    let f = fixture("faults");
    let keys: Vec<String> = (0..200).map(|i| format!("obj/{i:03}.bin")).collect();
    for (i, k) in keys.iter().enumerate() {
        put(&f.s3, k, object_body(i));
    }
    for k in ["obj/poison-1.bin", "obj/poison-2.bin"] {
        put(&f.s3, k, vec![7; 100]);
    }
    let proxy = proxy_to(&f, true);
    let policy = RetryPolicy {
        max_attempts: 5,
        base_delay: Duration::from_millis(10),
        max_delay: Duration::from_millis(200),
        budget: 5_000,
        ..RetryPolicy::default()
    };
    let mut cfg = f
        .server
        .config("data")
        .endpoint(format!("http://{}", proxy.addr))
        .retry(policy)
        .attempt_timeout(Duration::from_millis(700));
    cfg.list_page_size = Some(25);
    let s3 = S3::connect(cfg).unwrap();

    let (tx, rx) = std::sync::mpsc::channel();
    let client = s3.clone();
    std::thread::spawn(move || {
        let mut all: Vec<String> = client
            .list("obj/")
            .expect("listing through the proxy")
            .into_iter()
            .map(|o| o.key)
            .collect();
        all.push("obj/missing.bin".into());
        let failures = Arc::new(Mutex::new(Vec::new()));
        let seen = Arc::clone(&failures);
        let mut p = Pipeline::builder()
            .source(all.clone())
            .describe(String::clone)
            .pipe_async("fetch", client.fetcher(), 8)
            .on_failure(move |e| {
                seen.lock().unwrap().push((
                    e.stage().to_owned(),
                    e.item().to_owned(),
                    e.to_string(),
                ))
            })
            .build()
            .unwrap();
        let delivered: Vec<Blob> = p.iter().map(Result::unwrap).collect();
        let failures = failures.lock().unwrap().clone();
        let _ = tx.send((all, delivered, failures));
    });
    let started = Instant::now();
    let (all, delivered, failures) = rx
        .recv_timeout(Duration::from_secs(120))
        .expect("the epoch finishes within a bounded time");
    let took = started.elapsed();

    let counts = &proxy.counts;
    let count = |c: &std::sync::atomic::AtomicU64| c.load(Ordering::Relaxed);
    eprintln!("{took:?}; proxy: {counts:?}; failures: {failures:?}");
    assert_eq!(all.len(), 203, "the listing survived the faults");
    for (name, c) in [
        ("500", &counts.internal_error),
        ("SlowDown", &counts.slow_down),
        ("reset", &counts.reset),
        ("stall", &counts.stalled),
        ("truncated", &counts.truncated),
    ] {
        assert!(count(c) > 0, "no {name} was injected");
    }

    let index: HashMap<&str, usize> = keys
        .iter()
        .enumerate()
        .map(|(i, k)| (k.as_str(), i))
        .collect();
    let mut got = HashSet::new();
    for b in &delivered {
        let key = b.path.to_str().unwrap().to_owned();
        assert!(got.insert(key.clone()), "{key} delivered twice");
        match index.get(key.as_str()) {
            Some(&i) => assert!(b.bytes == object_body(i), "{key}: corrupt body delivered"),
            None => panic!("{key} delivered, but it always fails"),
        }
    }
    let mut failed = HashSet::new();
    for (stage, item, msg) in &failures {
        assert_eq!(stage, "fetch");
        assert!(
            msg.contains(item.as_str()),
            "the error names the key: {msg}"
        );
        assert!(failed.insert(item.clone()), "{item} reported twice");
        assert!(!got.contains(item), "{item} both delivered and failed");
    }
    let union: HashSet<String> = got.union(&failed).cloned().collect();
    assert_eq!(union, all.iter().cloned().collect(), "none lost");
    for k in ["obj/missing.bin", "obj/poison-1.bin", "obj/poison-2.bin"] {
        assert!(failed.contains(k), "{k} must fail");
    }
    let missing = failures.iter().find(|f| f.1 == "obj/missing.bin").unwrap();
    assert!(missing.2.contains("no such key"), "{}", missing.2);
    let poison = failures.iter().find(|f| f.1 == "obj/poison-1.bin").unwrap();
    assert!(
        poison.2.contains("after 5 attempt(s)"),
        "retried to the limit: {}",
        poison.2
    );
    assert!(
        got.len() >= 195,
        "transient faults are retried: {} of 200 delivered",
        got.len()
    );
}

/// An S3 fetch stage under a memory budget: objects of 2 MiB, 16 requests allowed in flight,
/// a slow consumer, a 16 MiB budget. Fetched bodies are charged from admission (the stage's
/// reserve), so the accounted bytes never pass the budget (plus two objects in transit), while
/// every object still arrives.
#[test]
fn an_s3_fetch_stage_stays_within_the_memory_budget() {
    const OBJECT: usize = 2 << 20;
    const BUDGET: u64 = 16 << 20;
    let f = fixture("memory");
    let keys: Vec<String> = (0..24).map(|i| format!("big/{i:03}")).collect();
    for (i, k) in keys.iter().enumerate() {
        put(&f.s3, k, vec![i as u8; OBJECT]);
    }
    let mut p = Pipeline::builder()
        .source(keys)
        .pipe_async("fetch", f.s3.fetcher(), 16)
        .measure(Blob::len)
        .memory_budget(BUDGET)
        .build()
        .unwrap();
    let (mut n, mut peak) = (0, 0u64);
    while let Some(blob) = p.iter().next() {
        let blob = blob.unwrap();
        assert_eq!(blob.len(), OBJECT);
        n += 1;
        std::thread::sleep(Duration::from_millis(20)); // a slow consumer
        let held: u64 = p.stats().stages.iter().map(|s| s.queue_bytes).sum();
        peak = peak.max(held);
    }
    assert_eq!(n, 24);
    assert!(
        peak <= BUDGET + 2 * OBJECT as u64,
        "{} MiB held under a {} MiB budget",
        peak >> 20,
        BUDGET >> 20
    );
    assert!(peak >= BUDGET / 4, "the budget binds: {} MiB", peak >> 20);
}
