//! S3 integration tests against a real S3-compatible server (s3s-fs, installed by
//! `scripts/setup.sh --test`), started on a free 127.0.0.1 port for each test and stopped when
//! it ends. Nothing here is a mock.
#![cfg(feature = "s3")]

use std::path::PathBuf;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use flowgate::cache::ByteCache;
use flowgate::media::image::ImageRecipe;
use flowgate::s3::{LocalServer, RetryPolicy, S3Error, S3};
use flowgate::{Blob, Pipeline, Tensor};

struct Fixture {
    server: LocalServer,
    s3: S3,
    _dir: TempDir,
}

struct TempDir(PathBuf);

impl Drop for TempDir {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.0);
    }
}

fn fixture(name: &str) -> Fixture {
    let dir = std::env::temp_dir().join(format!("flowgate-s3-{name}-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    let server = LocalServer::start(&dir).expect("start s3s-fs (run scripts/setup.sh --test)");
    let mut cfg = server.config("data");
    cfg.list_page_size = Some(7); // exercise pagination with a small bucket
    let s3 = S3::connect(cfg).unwrap();
    futures::executor::block_on(s3.create_bucket()).unwrap();
    Fixture {
        server,
        s3,
        _dir: TempDir(dir),
    }
}

fn jpeg(w: u32, h: u32, seed: u8) -> Vec<u8> {
    let img = image::RgbImage::from_fn(w, h, |x, y| {
        image::Rgb([x as u8 ^ seed, y as u8, seed.wrapping_mul(3)])
    });
    let mut out = std::io::Cursor::new(Vec::new());
    img.write_to(&mut out, image::ImageFormat::Jpeg).unwrap();
    out.into_inner()
}

fn put(s3: &S3, key: &str, bytes: Vec<u8>) {
    futures::executor::block_on(s3.put(key, bytes)).unwrap();
}

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

/// A fault-injecting HTTP/1.1 proxy on 127.0.0.1 in front of the real server. Each request
/// gets its own upstream connection and `Connection: close`; by the request's number it is
/// forwarded, answered with a 500 or a 503 SlowDown, reset (RST), stalled past the client's
/// attempt timeout, or forwarded with its body cut in half. Keys containing `poison` always
/// get a 500.
mod fault_proxy {
    use std::net::SocketAddr;
    use std::sync::atomic::{AtomicU64, Ordering};
    use std::sync::Arc;
    use std::time::Duration;

    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    use tokio::net::{TcpListener, TcpStream};

    #[derive(Debug, Default)]
    pub(crate) struct Counts {
        pub(crate) requests: AtomicU64,
        pub(crate) forwarded: AtomicU64,
        pub(crate) internal_error: AtomicU64,
        pub(crate) slow_down: AtomicU64,
        pub(crate) reset: AtomicU64,
        pub(crate) stalled: AtomicU64,
        pub(crate) truncated: AtomicU64,
        /// GET requests with a `Range` header.
        pub(crate) ranged: AtomicU64,
        /// GET requests per path (`/bucket/key`, no query).
        pub(crate) gets: std::sync::Mutex<std::collections::HashMap<String, u64>>,
    }

    impl Counts {
        /// GETs of paths ending in `suffix`, per path.
        pub(crate) fn gets_of(&self, suffix: &str) -> std::collections::HashMap<String, u64> {
            let g = self.gets.lock().unwrap();
            g.iter()
                .filter(|(k, _)| k.ends_with(suffix))
                .map(|(k, v)| (k.clone(), *v))
                .collect()
        }
    }

    #[derive(Clone, Copy, Debug)]
    enum Fault {
        None,
        Status(u16, &'static str),
        Reset,
        Stall,
        Truncate,
    }

    pub(crate) struct FaultProxy {
        pub(crate) addr: SocketAddr,
        pub(crate) counts: Arc<Counts>,
        rt: Option<tokio::runtime::Runtime>,
    }

    impl Drop for FaultProxy {
        fn drop(&mut self) {
            if let Some(rt) = self.rt.take() {
                rt.shutdown_background();
            }
        }
    }

    impl FaultProxy {
        pub(crate) fn start(upstream: SocketAddr, stall: Duration) -> Self {
            Self::start_with(upstream, Some(stall))
        }

        /// A proxy that forwards everything (and counts), without faults.
        pub(crate) fn clean(upstream: SocketAddr) -> Self {
            Self::start_with(upstream, None)
        }

        fn start_with(upstream: SocketAddr, faults: Option<Duration>) -> Self {
            let rt = tokio::runtime::Builder::new_multi_thread()
                .worker_threads(2)
                .enable_all()
                .build()
                .unwrap();
            let listener = rt
                .block_on(TcpListener::bind("127.0.0.1:0"))
                .expect("bind the proxy");
            let addr = listener.local_addr().unwrap();
            let counts = Arc::new(Counts::default());
            let c = Arc::clone(&counts);
            rt.spawn(async move {
                while let Ok((client, _)) = listener.accept().await {
                    let c = Arc::clone(&c);
                    tokio::spawn(async move {
                        let _ = handle(client, upstream, faults, &c).await;
                    });
                }
            });
            Self {
                addr,
                counts,
                rt: Some(rt),
            }
        }
    }

    /// 10% errors (500, SlowDown, reset, truncated body in turn) and 4% stalls.
    fn plan(n: u64, target: &str) -> Fault {
        if target.contains("poison") {
            return Fault::Status(500, "InternalError");
        }
        if n % 25 == 17 {
            return Fault::Stall;
        }
        if n % 10 == 3 {
            return match (n / 10) % 4 {
                0 => Fault::Status(500, "InternalError"),
                1 => Fault::Status(503, "SlowDown"),
                2 => Fault::Reset,
                _ => Fault::Truncate,
            };
        }
        Fault::None
    }

    fn find(hay: &[u8], needle: &[u8]) -> Option<usize> {
        hay.windows(needle.len()).position(|w| w == needle)
    }

    fn content_length(head: &str) -> usize {
        head.lines()
            .filter_map(|l| l.split_once(':'))
            .find(|(k, _)| k.trim().eq_ignore_ascii_case("content-length"))
            .and_then(|(_, v)| v.trim().parse().ok())
            .unwrap_or(0)
    }

    async fn handle(
        mut client: TcpStream,
        upstream: SocketAddr,
        faults: Option<Duration>,
        c: &Counts,
    ) -> std::io::Result<()> {
        let mut buf = Vec::new();
        let mut chunk = [0u8; 8192];
        let head_end = loop {
            if let Some(i) = find(&buf, b"\r\n\r\n") {
                break i + 4;
            }
            let n = client.read(&mut chunk).await?;
            if n == 0 {
                return Ok(());
            }
            buf.extend_from_slice(&chunk[..n]);
        };
        let head = String::from_utf8_lossy(&buf[..head_end]).into_owned();
        let body_len = content_length(&head);
        while buf.len() < head_end + body_len {
            let n = client.read(&mut chunk).await?;
            if n == 0 {
                return Ok(());
            }
            buf.extend_from_slice(&chunk[..n]);
        }
        let target = head.split_whitespace().nth(1).unwrap_or("").to_owned();
        let n = c.requests.fetch_add(1, Ordering::Relaxed);
        if head.starts_with("GET ") {
            let path = target.split('?').next().unwrap_or("").to_owned();
            *c.gets.lock().unwrap().entry(path).or_insert(0) += 1;
            if head.to_ascii_lowercase().contains("\r\nrange:") {
                c.ranged.fetch_add(1, Ordering::Relaxed);
            }
        }
        let stall = faults.unwrap_or_default();
        let fault = match faults {
            Some(_) => plan(n, &target),
            None => Fault::None,
        };
        match fault {
            Fault::Status(status, code) => {
                let counter = if status == 503 {
                    &c.slow_down
                } else {
                    &c.internal_error
                };
                counter.fetch_add(1, Ordering::Relaxed);
                let body = format!(
                    "<?xml version=\"1.0\" encoding=\"UTF-8\"?><Error><Code>{code}</Code>\
                     <Message>injected by the fault proxy</Message></Error>"
                );
                let reason = if status == 503 {
                    "Slow Down"
                } else {
                    "Internal Server Error"
                };
                let resp = format!(
                    "HTTP/1.1 {status} {reason}\r\nContent-Type: application/xml\r\n\
                     Content-Length: {}\r\nConnection: close\r\n\r\n{body}",
                    body.len()
                );
                client.write_all(resp.as_bytes()).await?;
                client.shutdown().await
            }
            Fault::Reset => {
                c.reset.fetch_add(1, Ordering::Relaxed);
                client.set_zero_linger()?;
                drop(client);
                Ok(())
            }
            Fault::Stall => {
                c.stalled.fetch_add(1, Ordering::Relaxed);
                tokio::time::sleep(stall).await;
                Ok(())
            }
            Fault::None | Fault::Truncate => {
                // One request per upstream connection, closed after the response.
                let mut req: Vec<u8> = Vec::new();
                for line in head[..head.len() - 2]
                    .split("\r\n")
                    .filter(|l| !l.is_empty())
                {
                    if !line.to_ascii_lowercase().starts_with("connection:") {
                        req.extend_from_slice(line.as_bytes());
                        req.extend_from_slice(b"\r\n");
                    }
                }
                req.extend_from_slice(b"Connection: close\r\n\r\n");
                req.extend_from_slice(&buf[head_end..head_end + body_len]);
                let mut up = TcpStream::connect(upstream).await?;
                up.write_all(&req).await?;
                let mut resp = Vec::new();
                up.read_to_end(&mut resp).await?;
                let cut = match (fault, find(&resp, b"\r\n\r\n")) {
                    (Fault::Truncate, Some(i)) if resp.len() > i + 4 + 1 => {
                        c.truncated.fetch_add(1, Ordering::Relaxed);
                        i + 4 + (resp.len() - i - 4) / 2
                    }
                    _ => {
                        c.forwarded.fetch_add(1, Ordering::Relaxed);
                        resp.len()
                    }
                };
                client.write_all(&resp[..cut]).await?;
                client.shutdown().await
            }
        }
    }
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
    let upstream: std::net::SocketAddr = f
        .server
        .endpoint()
        .trim_start_matches("http://")
        .parse()
        .unwrap();
    let proxy = fault_proxy::FaultProxy::start(upstream, Duration::from_secs(3));
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
        flowgate::shards::tar::write_archive(&mut tar, members).unwrap();
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
fn sample_number(r: &flowgate::shards::SampleRef) -> u64 {
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

fn proxy_to(f: &Fixture, faults: bool) -> fault_proxy::FaultProxy {
    let upstream: std::net::SocketAddr = f
        .server
        .endpoint()
        .trim_start_matches("http://")
        .parse()
        .unwrap();
    if faults {
        fault_proxy::FaultProxy::start(upstream, Duration::from_secs(3))
    } else {
        fault_proxy::FaultProxy::clean(upstream)
    }
}

fn open_s3_shards(
    s3: &S3,
    pattern: &str,
    cache: &std::path::Path,
    cache_bytes: u64,
) -> flowgate::shards::Shards {
    let opts = flowgate::shards::remote::RemoteOptions {
        cache_dir: cache.to_owned(),
        cache_bytes,
        ..Default::default()
    };
    flowgate::shards::Shards::open_s3(s3, pattern, &opts).unwrap()
}

#[test]
fn sixty_four_shards_on_s3_read_by_four_ranks_once_each_with_one_get_per_shard() {
    use std::collections::HashSet;
    use std::sync::atomic::Ordering;

    let f = fixture("shards64");
    upload_shards(&f.s3, 64, 100, true);
    let proxy = proxy_to(&f, false);
    let s3 = S3::connect(
        f.server
            .config("data")
            .endpoint(format!("http://{}", proxy.addr)),
    )
    .unwrap();
    let caches = TempDir(f._dir.0.with_extension("cache"));
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
            let got: Vec<u64> = shards.epoch(epoch).iter().map(sample_number).collect();
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
    assert!(s3.stats().resumed > 0);
}

#[test]
fn a_missing_shard_and_a_lying_manifest_fail_naming_the_shard() {
    let f = fixture("shards-bad");
    upload_shards(&f.s3, 3, 10, false);
    let caches = TempDir(f._dir.0.with_extension("cache"));
    let opts = flowgate::shards::remote::RemoteOptions {
        cache_dir: caches.0.clone(),
        ..Default::default()
    };
    let err = flowgate::shards::Shards::open_s3(&f.s3, "train/shard-{000000..000003}.tar", &opts)
        .unwrap_err()
        .to_string();
    assert!(
        err.contains("s3://data/train/shard-000003.tar: no such shard"),
        "{err}"
    );
    // A manifest that claims 12 samples for a 10-sample shard: the two places past the end
    // fail naming the shard and the mismatch; the rest read.
    let json = r#"{"shardlist": [{"url": "shard-000000.tar", "nsamples": 12}]}"#;
    put(&f.s3, "train/lying.json", json.as_bytes().to_vec());
    let shards = flowgate::shards::Shards::open_s3(&f.s3, "train/lying.json", &opts).unwrap();
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
