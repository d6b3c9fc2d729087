//! Pipeline files over an S3 prefix (feature `s3`).

use std::path::PathBuf;

use super::build::Loader;
use super::schema::*;
use crate::media::{Files, Recipe};
use crate::s3::{S3Config, S3Error, S3};
use crate::{Blob, Pipeline, PipelineError, Workers};

/// A local S3 server and its folder, removed when dropped.
#[cfg(feature = "test-util")]
#[derive(Debug)]
struct LocalS3 {
    _server: crate::s3::LocalServer,
    dir: PathBuf,
}

#[cfg(feature = "test-util")]
impl Drop for LocalS3 {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.dir);
    }
}

/// The loader of an S3 source: lists the prefix (after uploading the local files first, when
/// the spec asks for a local server), fetches through the cache, decodes.
pub(super) fn build(
    spec: &PipelineSpec,
    decoder: Recipe,
    workers: Workers,
    hooks: super::Hooks,
) -> Result<Loader, crate::PipelineError> {
    let SourceSpec::S3 {
        bucket,
        prefix,
        endpoint,
        region,
        concurrency,
        shuffle,
        serve_locally_from,
    } = &spec.source
    else {
        unreachable!("local sources are built by the caller")
    };
    let s3_err = |e: crate::s3::S3Error| PipelineError::io("the S3 source", e);
    let (s3, server): (S3, Option<Box<dyn std::fmt::Debug + Send>>) = match serve_locally_from {
        Some(list) => serve_locally(bucket, prefix, list)?,
        None => {
            let mut cfg = S3Config::new(bucket.clone());
            if let Some(url) = endpoint {
                cfg = cfg.endpoint(url.clone());
            }
            if let Some(r) = region {
                cfg = cfg.region(r.clone());
            }
            (S3::connect(cfg).map_err(s3_err)?, None)
        }
    };
    let keys: Vec<String> = s3
        .list(prefix)
        .map_err(s3_err)?
        .into_iter()
        .map(|o| o.key)
        .collect();
    let items = keys.len();
    let mut files = Files::new(keys);
    if let Some(seed) = shuffle {
        files = files.shuffle(*seed);
    }
    let cache = spec.cache.as_ref().map(|c| {
        let mb = |m: f64| (m * 1048576.0) as u64;
        crate::cache::ByteCache::new(mb(c.mb)).max_bytes(mb(c.max_mb.unwrap_or(4.0 * c.mb)))
    });
    let fetch = s3.fetcher::<PathBuf>();
    let dataset = files.fingerprint();
    let keys: std::sync::Arc<[PathBuf]> = files.paths().into();
    let b = Pipeline::builder()
        .source_sampled(files.sampler().clone(), move |epoch, i| {
            (keys[i].clone(), epoch)
        })
        .checkpoint_fields(dataset)
        .describe(|(p, _)| p.display().to_string());
    // The epoch rides along the fetch, for the decoder's per-epoch augmentation.
    let with_epoch =
        |f: Box<dyn Fn(PathBuf) -> crate::cache::CacheFuture<S3Error> + Send + Sync>| {
            move |(key, epoch): (PathBuf, u64)| {
                let fetched = f(key);
                async move { fetched.await.map(|blob| (blob, epoch)) }
            }
        };
    let b = match &cache {
        Some(c) => b
            .pipe_async(
                "fetch",
                with_epoch(Box::new(c.through(fetch))),
                Workers::initial(*concurrency),
            )
            .cache(c),
        None => b.pipe_async(
            "fetch",
            with_epoch(Box::new(fetch)),
            Workers::initial(*concurrency),
        ),
    };
    let threads = decoder.item_threads();
    let pipeline = spec.finish(
        b.measure(|(blob, _): &(Blob, u64)| blob.len()),
        move |(blob, epoch): (Blob, u64)| {
            decoder
                .for_epoch(epoch)
                .decode(blob)
                .map_err(crate::BoxError::from)
        },
        (workers, None, threads),
        hooks,
    )?;
    Ok(Loader {
        pipeline,
        cache,
        items,
        _keep: server,
    })
}

/// An S3 client for a local server on 127.0.0.1 holding the files of `list` under `prefix`
/// (the demo path of `serve_locally_from`); the server lives as long as the returned value.
#[cfg(feature = "test-util")]
fn serve_locally(
    bucket: &str,
    prefix: &str,
    list: &std::path::Path,
) -> Result<(S3, Option<Box<dyn std::fmt::Debug + Send>>), PipelineError> {
    use crate::s3::LocalServer;
    let s3_err = |e: S3Error| PipelineError::io("the local S3 server", e);
    let dir = std::env::temp_dir().join(format!(
        "flowgate-local-s3-{}-{}",
        std::process::id(),
        std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map_or(0, |d| d.as_nanos())
    ));
    let server = LocalServer::start(&dir)
        .map_err(|e| PipelineError::io("starting the local S3 server", e))?;
    let s3 = S3::connect(server.config(bucket)).map_err(s3_err)?;
    futures::executor::block_on(s3.create_bucket()).map_err(s3_err)?;
    for path in Files::list(list)?.epoch(0) {
        let name = path
            .file_name()
            .map(|n| n.to_string_lossy().into_owned())
            .unwrap_or_default();
        let bytes = std::fs::read(&path)
            .map_err(|e| PipelineError::io(format!("reading {}", path.display()), e))?;
        futures::executor::block_on(s3.put(&format!("{prefix}{name}"), bytes)).map_err(s3_err)?;
    }
    let local = LocalS3 {
        _server: server,
        dir,
    };
    Ok((s3, Some(Box::new(local))))
}

#[cfg(not(feature = "test-util"))]
fn serve_locally(
    _bucket: &str,
    _prefix: &str,
    _list: &std::path::Path,
) -> Result<(S3, Option<Box<dyn std::fmt::Debug + Send>>), PipelineError> {
    Err(PipelineError::config(
        "source.serve_locally_from needs flowgate built with the `test-util` feature",
    ))
}
