//! Images from S3 through a byte cache: list a prefix, fetch objects concurrently (retries,
//! timeouts), decode, batch; the second epoch is served by the cache.
//!
//! ```text
//! cargo run --release --features s3 --example s3                       # a local server
//! cargo run --release --features s3 --example s3 -- --endpoint URL --bucket B --prefix P
//! ```
//!
//! Without `--endpoint` (or `--aws`) it starts a local S3-compatible server (s3s-fs, installed
//! by `scripts/setup.sh --test`) on a free port, uploads the first `--upload` images of
//! `--list` (default `target/sample-data/images.txt`) into bucket `flowgate`, and reads them
//! back. With `--endpoint URL` it reads an S3-compatible store (credentials from the AWS
//! environment); with `--aws` it reads AWS S3 with the standard credential chain.

use std::path::PathBuf;
use std::time::Instant;

use flowgate::byte_cache::ByteCache;
use flowgate::dataset::Files;
use flowgate::media::image::ImageRecipe;
use flowgate::s3::{LocalServer, S3Config, S3};
use flowgate::{Blob, Pipeline};

fn main() -> Result<(), Box<dyn std::error::Error>> {
    let (mut endpoint, mut aws, mut bucket, mut prefix) = (None, false, None, "images/".to_owned());
    let (mut list, mut upload, mut epochs) = (
        PathBuf::from("target/sample-data/images.txt"),
        200usize,
        2u64,
    );
    let mut args = std::env::args().skip(1);
    while let Some(flag) = args.next() {
        if flag == "--aws" {
            aws = true;
            continue;
        }
        let v = args.next().unwrap_or_default();
        match flag.as_str() {
            "--endpoint" => endpoint = Some(v),
            "--bucket" => bucket = Some(v),
            "--prefix" => prefix = v,
            "--list" => list = v.into(),
            "--upload" => upload = v.parse()?,
            "--epochs" => epochs = v.parse()?,
            _ => return Err(format!("unknown flag {flag}").into()),
        }
    }
    // A local server (kept alive until the end of main) unless a store was named.
    let mut _server = None;
    let s3 = if aws || endpoint.is_some() {
        let bucket = bucket.ok_or("--bucket B is needed with --endpoint or --aws")?;
        let mut cfg = S3Config::new(bucket);
        if let Some(url) = endpoint {
            cfg = cfg.endpoint(url);
        }
        S3::connect(cfg)?
    } else {
        let dir = std::env::temp_dir().join(format!("flowgate-s3-example-{}", std::process::id()));
        let server = LocalServer::start(&dir)?;
        println!(
            "local S3 server at {} serving {}",
            server.endpoint(),
            dir.display()
        );
        let s3 = S3::connect(server.config(bucket.as_deref().unwrap_or("flowgate")))?;
        futures::executor::block_on(s3.create_bucket())?;
        let files = Files::list(&list).map_err(|e| {
            format!("{e} (make one: cargo run --release -p flowgate-tools --bin make_dataset -- --out target/sample-data)")
        })?;
        let started = Instant::now();
        for path in files.epoch(0).iter().take(upload) {
            let name = path.file_name().ok_or("a file name")?.to_string_lossy();
            futures::executor::block_on(s3.put(&format!("{prefix}{name}"), std::fs::read(path)?))?;
        }
        println!(
            "uploaded {upload} images in {:.2} s",
            started.elapsed().as_secs_f64()
        );
        _server = Some((server, TempDir(dir)));
        s3
    };
    let keys: Vec<String> = s3.list(&prefix)?.into_iter().map(|o| o.key).collect();
    println!("s3://{}/{prefix}: {} objects", s3.bucket(), keys.len());
    let cache = ByteCache::new(64 << 20).max_bytes(1 << 30);
    let recipe = ImageRecipe::default();
    let mut pipeline = Pipeline::builder()
        .source_epochs(move |_| keys.clone())
        .pipe_async("fetch", cache.through(s3.fetcher()), 16)
        .cache(&cache)
        .measure(Blob::len)
        .pipe("decode", move |b: Blob| recipe.decode(&b.bytes, &b.path), 1)
        .batch(32, false)
        .build()?;
    for epoch in 0..epochs {
        let requests = s3.stats().attempts;
        let started = Instant::now();
        let mut images = 0;
        for batch in pipeline.iter() {
            images += batch?.shape()[0];
        }
        let secs = started.elapsed().as_secs_f64();
        let c = cache.stats();
        println!(
            "epoch {epoch}: {images} images in {secs:.2} s = {:.0}/s; S3 requests {}; cache {} hits, {} misses, {:.1} MiB held of {:.0} MiB",
            images as f64 / secs,
            s3.stats().attempts - requests,
            c.hits,
            c.misses,
            c.bytes as f64 / (1 << 20) as f64,
            c.capacity_bytes as f64 / (1 << 20) as f64,
        );
    }
    let stats = pipeline.stats();
    println!("failed items: {}; S3: {:?}", stats.failures, s3.stats());
    Ok(())
}

struct TempDir(PathBuf);

impl Drop for TempDir {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.0);
    }
}
