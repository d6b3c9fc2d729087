//! [`S3`]: a client for one bucket — listing, whole and ranged fetches, uploads — running its
//! requests on a small tokio runtime of its own, each under the client's [`Retrier`].

use std::future::Future;
use std::ops::Range;
use std::path::{Path, PathBuf};
use std::pin::Pin;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;

use aws_config::retry::RetryConfig;
use aws_config::timeout::TimeoutConfig;
use aws_config::{BehaviorVersion, Region};
use aws_sdk_s3::config::Credentials;
use aws_sdk_s3::error::{DisplayErrorContext, ProvideErrorMetadata, SdkError};
use aws_sdk_s3::primitives::ByteStream;

use super::config::S3Config;
use super::error::{Failed, S3Error};
use super::retry::Retrier;
use crate::blob::Blob;

/// One object of a listing.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct S3Object {
    /// The key.
    pub key: String,
    /// The size in bytes.
    pub size: u64,
    /// The entity tag (changes when the object is rewritten), when the store sends one.
    pub etag: Option<String>,
}

/// The version of an object that reads are pinned to: its entity tag, given (from a
/// listing) or taken from the first response that carries one. Every later request for the
/// object carries `If-Match` with it, so a rewritten object is an error (HTTP 412), never
/// bytes of two versions read together. Clones share the pin.
#[derive(Clone, Debug, Default)]
pub struct Version(Arc<std::sync::Mutex<Option<String>>>);

impl Version {
    /// Pinned to `etag`, or to the first response's entity tag when `None`.
    pub fn new(etag: Option<String>) -> Self {
        Self(Arc::new(std::sync::Mutex::new(etag)))
    }

    /// The entity tag pinned, if any yet.
    pub fn etag(&self) -> Option<String> {
        self.0.lock().map_or(None, |t| t.clone())
    }

    /// Pins `etag` if nothing is pinned yet.
    fn pin(&self, etag: Option<&str>) {
        if let (Some(t), Ok(mut p)) = (etag, self.0.lock()) {
            p.get_or_insert_with(|| t.to_owned());
        }
    }
}

/// Counters of one client since it was built.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct S3Stats {
    /// Requests sent (every attempt counts).
    pub attempts: u64,
    /// Retries made.
    pub retries: u64,
    /// Requests that ended in an error.
    pub failures: u64,
    /// Body bytes received.
    pub bytes: u64,
    /// Tokens left in the retry budget.
    pub budget_left: u64,
    /// Downloads continued with a ranged GET after their body was cut off.
    pub resumed: u64,
}

/// A client for one bucket. Clones share the connection pool, the retry budget and the stats.
#[derive(Clone, Debug)]
pub struct S3 {
    inner: Arc<Inner>,
}

struct Inner {
    client: aws_sdk_s3::Client,
    cfg: S3Config,
    runtime: RuntimeHolder,
    retrier: Retrier,
    bytes: AtomicU64,
    resumed: AtomicU64,
}

impl std::fmt::Debug for Inner {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("S3")
            .field("bucket", &self.cfg.bucket)
            .field("endpoint", &self.cfg.endpoint)
            .finish_non_exhaustive()
    }
}

/// Owns the client's runtime; shuts it down without blocking, so the last clone may be dropped
/// anywhere, even on another runtime's worker.
struct RuntimeHolder(Option<tokio::runtime::Runtime>);

impl RuntimeHolder {
    fn handle(&self) -> &tokio::runtime::Handle {
        self.0.as_ref().expect("runtime lives until drop").handle()
    }
}

impl Drop for RuntimeHolder {
    fn drop(&mut self) {
        if let Some(rt) = self.0.take() {
            rt.shutdown_background();
        }
    }
}

/// Aborts the spawned request when the caller stops waiting (a pipeline that stops mid-fetch).
struct AbortOnDrop<T>(tokio::task::JoinHandle<T>);

impl<T> Drop for AbortOnDrop<T> {
    fn drop(&mut self) {
        self.0.abort();
    }
}

/// A future a stage can await.
pub type S3Future<T> = Pin<Box<dyn Future<Output = Result<T, S3Error>> + Send>>;

impl S3 {
    /// Builds a client (loads the AWS configuration chain; no request is sent). Blocks briefly;
    /// may be called from async code too.
    pub fn connect(cfg: S3Config) -> Result<Self, S3Error> {
        let runtime = tokio::runtime::Builder::new_multi_thread()
            .worker_threads(cfg.io_threads.max(1))
            .thread_name("flowgate-s3")
            .enable_all()
            .build()
            .map_err(|e| S3Error::Client(format!("starting the I/O runtime: {e}")))?;
        let loader_cfg = cfg.clone();
        let shared = futures::executor::block_on(runtime.spawn(async move {
            let mut loader = aws_config::defaults(BehaviorVersion::latest());
            if let Some(region) = &loader_cfg.region {
                loader = loader.region(Region::new(region.clone()));
            }
            if let Some((id, secret)) = &loader_cfg.credentials {
                loader = loader
                    .credentials_provider(Credentials::new(id, secret, None, None, "flowgate"));
            }
            if let Some(url) = &loader_cfg.endpoint {
                loader = loader.endpoint_url(url);
            }
            loader.load().await
        }))
        .map_err(|e| S3Error::Client(format!("loading the AWS configuration: {e}")))?;
        let mut conf = aws_sdk_s3::config::Builder::from(&shared)
            .force_path_style(cfg.path_style)
            // Retries and attempt timeouts are ours (a shared budget, typed errors).
            .retry_config(RetryConfig::disabled())
            .timeout_config(
                TimeoutConfig::builder()
                    .connect_timeout(cfg.connect_timeout)
                    .build(),
            );
        if shared.region().is_none() {
            conf = conf.region(Region::new("us-east-1"));
        }
        Ok(Self {
            inner: Arc::new(Inner {
                client: aws_sdk_s3::Client::from_conf(conf.build()),
                runtime: RuntimeHolder(Some(runtime)),
                retrier: Retrier::new(cfg.retry, cfg.attempt_timeout, cfg.bucket.clone()),
                bytes: AtomicU64::new(0),
                resumed: AtomicU64::new(0),
                cfg,
            }),
        })
    }

    /// The bucket.
    pub fn bucket(&self) -> &str {
        &self.inner.cfg.bucket
    }

    /// The client's counters.
    pub fn stats(&self) -> S3Stats {
        let i = &self.inner;
        S3Stats {
            attempts: i.retrier.attempts.load(Ordering::Relaxed),
            retries: i.retrier.retries.load(Ordering::Relaxed),
            failures: i.retrier.failures.load(Ordering::Relaxed),
            bytes: i.bytes.load(Ordering::Relaxed),
            budget_left: i.retrier.budget_left(),
            resumed: i.resumed.load(Ordering::Relaxed),
        }
    }

    /// Every object under `prefix` (all pages), in key order. Blocks; see
    /// [`list_async`](Self::list_async).
    pub fn list(&self, prefix: &str) -> Result<Vec<S3Object>, S3Error> {
        futures::executor::block_on(self.list_async(prefix))
    }

    /// Every object under `prefix` (all pages), in key order.
    pub async fn list_async(&self, prefix: &str) -> Result<Vec<S3Object>, S3Error> {
        let inner = self.inner.clone();
        let prefix = prefix.to_owned();
        self.spawn(async move {
            let mut objects = Vec::new();
            let mut token: Option<String> = None;
            loop {
                let page = inner
                    .retrier
                    .run(&prefix, || {
                        let inner = inner.clone();
                        let (prefix, token) = (prefix.clone(), token.clone());
                        async move {
                            inner
                                .client
                                .list_objects_v2()
                                .bucket(&inner.cfg.bucket)
                                .prefix(prefix.clone())
                                .set_continuation_token(token)
                                .set_max_keys(inner.cfg.list_page_size)
                                .send()
                                .await
                                .map_err(|e| inner.classify(&prefix, e))
                        }
                    })
                    .await?;
                objects.extend(page.contents().iter().filter_map(|o| {
                    Some(S3Object {
                        key: o.key()?.to_owned(),
                        size: o.size().unwrap_or(0).max(0) as u64,
                        etag: o.e_tag().map(str::to_owned),
                    })
                }));
                match page.next_continuation_token() {
                    Some(t) if page.is_truncated() == Some(true) => token = Some(t.to_owned()),
                    _ => break,
                }
            }
            Ok(objects)
        })
        .await
    }

    /// The objects named by `keys` (size, entity tag), in that order, from one listing of
    /// their common prefix; `None` for a key that does not exist. Blocks.
    pub fn objects<K: AsRef<str>>(&self, keys: &[K]) -> Result<Vec<Option<S3Object>>, S3Error> {
        let Some(first) = keys.first() else {
            return Ok(Vec::new());
        };
        let common = keys.iter().fold(first.as_ref(), |p, k| {
            let n = p
                .bytes()
                .zip(k.as_ref().bytes())
                .take_while(|(a, b)| a == b)
                .count();
            &p[..n]
        });
        let mut listed: std::collections::HashMap<String, S3Object> = self
            .list(common)?
            .into_iter()
            .map(|o| (o.key.clone(), o))
            .collect();
        Ok(keys.iter().map(|k| listed.remove(k.as_ref())).collect())
    }

    /// Fetches a whole object.
    pub async fn get(&self, key: &str) -> Result<Blob, S3Error> {
        self.get_impl(key.to_owned(), None, None).await
    }

    /// Fetches the bytes `range` of an object (an HTTP range request); a range that runs past
    /// the end returns what exists.
    pub async fn get_range(&self, key: &str, range: Range<u64>) -> Result<Blob, S3Error> {
        self.get_impl(key.to_owned(), Some(range), None).await
    }

    /// [`get_range`](Self::get_range) of the object's `version` (see [`Version`]): another
    /// version on the store is an error (HTTP 412), never bytes of one version read at the
    /// offsets of another.
    pub async fn get_range_version(
        &self,
        key: &str,
        range: Range<u64>,
        version: &Version,
    ) -> Result<Blob, S3Error> {
        self.get_impl(key.to_owned(), Some(range), Some(version.clone()))
            .await
    }

    /// Fetches a whole object, blocking the calling thread (for a synchronous stage).
    pub fn get_blocking(&self, key: &str) -> Result<Blob, S3Error> {
        futures::executor::block_on(self.get(key))
    }

    /// A function for [`pipe_async`](crate::PipelineBuilder::pipe_async) that fetches the
    /// object named by each item (a `String` key, or a path whose components are the key's).
    pub fn fetcher<K>(&self) -> impl Fn(K) -> S3Future<Blob> + Send + Sync + Clone + 'static
    where
        K: AsRef<Path> + Send + 'static,
    {
        let s3 = self.clone();
        move |key: K| {
            let s3 = s3.clone();
            let key = key_of(key.as_ref());
            Box::pin(async move { s3.get_impl(key, None, None).await })
        }
    }

    /// Downloads an object into the file `dest` (created or truncated), streamed: never whole
    /// in memory. A body cut off mid-stream is continued by a ranged GET from the first byte
    /// not yet written (a retry under the client's policy and budget), so a broken connection
    /// costs the rest of the object, not all of it again. No attempt is cut off while bytes
    /// keep arriving; one that receives nothing for the attempt timeout is retried. Returns
    /// the bytes written.
    ///
    /// Every continuation carries `If-Match` with the entity tag of the first response, so an
    /// object rewritten during a download is an error (HTTP 412), never two versions spliced.
    pub async fn download(&self, key: &str, dest: &Path) -> Result<u64, S3Error> {
        self.download_version(key, dest, &Version::default()).await
    }

    /// [`download`](Self::download) of the object's `version` (every request carries
    /// `If-Match` once it is pinned; see [`Version`]): the version a shard was listed and
    /// indexed at, kept across its downloads. Another version on the store is an error, not
    /// different bytes under the same name.
    pub async fn download_version(
        &self,
        key: &str,
        dest: &Path,
        version: &Version,
    ) -> Result<u64, S3Error> {
        let inner = self.inner.clone();
        let key = key.to_owned();
        let dest = dest.to_owned();
        let pinned = version.clone();
        self.spawn(async move {
            let file = std::fs::File::create(&dest).map_err(|e| {
                S3Error::Client(format!(
                    "creating {} for s3://{}/{key}: {e}",
                    dest.display(),
                    inner.cfg.bucket
                ))
            })?;
            let file = Arc::new(std::sync::Mutex::new(file));
            let written = Arc::new(AtomicU64::new(0));
            inner
                .retrier
                .run_with(&key, false, || {
                    inner.clone().download_once(
                        key.clone(),
                        Arc::clone(&file),
                        Arc::clone(&written),
                        pinned.clone(),
                    )
                })
                .await?;
            Ok(written.load(Ordering::Relaxed))
        })
        .await
    }

    /// Uploads an object (used to stage datasets and in tests).
    pub async fn put(&self, key: &str, bytes: Vec<u8>) -> Result<(), S3Error> {
        let inner = self.inner.clone();
        let key = key.to_owned();
        self.spawn(async move {
            inner
                .retrier
                .run(&key, || {
                    let inner = inner.clone();
                    let (key, bytes) = (key.clone(), bytes.clone());
                    async move {
                        inner
                            .client
                            .put_object()
                            .bucket(&inner.cfg.bucket)
                            .key(&key)
                            .body(ByteStream::from(bytes))
                            .send()
                            .await
                            .map(|_| ())
                            .map_err(|e| inner.classify(&key, e))
                    }
                })
                .await
        })
        .await
    }

    /// Creates the bucket (used to stage datasets and in tests); an existing bucket owned by
    /// the caller is not an error.
    pub async fn create_bucket(&self) -> Result<(), S3Error> {
        let inner = self.inner.clone();
        self.spawn(async move {
            let bucket = inner.cfg.bucket.clone();
            match inner.client.create_bucket().bucket(&bucket).send().await {
                Ok(_) => Ok(()),
                Err(e) if e.code() == Some("BucketAlreadyOwnedByYou") => Ok(()),
                Err(e) => Err(S3Error::Request {
                    bucket: bucket.clone(),
                    key: String::new(),
                    attempts: 1,
                    cause: format!("creating the bucket: {}", DisplayErrorContext(&e)),
                }),
            }
        })
        .await
    }

    async fn get_impl(
        &self,
        key: String,
        range: Option<Range<u64>>,
        version: Option<Version>,
    ) -> Result<Blob, S3Error> {
        let inner = self.inner.clone();
        self.spawn(async move {
            let bytes = inner
                .retrier
                .run(&key, || {
                    inner
                        .clone()
                        .get_once(key.clone(), range.clone(), version.clone())
                })
                .await?;
            Ok(Blob {
                path: PathBuf::from(&key),
                bytes,
            })
        })
        .await
    }

    /// Runs `fut` on the client's runtime; dropping the returned future aborts it.
    async fn spawn<T: Send + 'static>(
        &self,
        fut: impl Future<Output = Result<T, S3Error>> + Send + 'static,
    ) -> Result<T, S3Error> {
        let mut task = AbortOnDrop(self.inner.runtime.handle().spawn(fut));
        match (&mut task.0).await {
            Ok(result) => result,
            Err(e) => Err(S3Error::Client(format!("request task: {e}"))),
        }
    }
}

/// The object key an item names: a path's components joined with `/`.
fn key_of(path: &Path) -> String {
    path.to_string_lossy().into_owned()
}

impl Inner {
    async fn get_once(
        self: Arc<Self>,
        key: String,
        range: Option<Range<u64>>,
        version: Option<Version>,
    ) -> Result<Vec<u8>, Failed> {
        let mut req = self.client.get_object().bucket(&self.cfg.bucket).key(&key);
        if let Some(t) = version.as_ref().and_then(Version::etag) {
            req = req.if_match(t);
        }
        if let Some(r) = &range {
            if r.is_empty() {
                return Ok(Vec::new());
            }
            req = req.range(format!("bytes={}-{}", r.start, r.end - 1));
        }
        let out = req.send().await.map_err(|e| self.classify(&key, e))?;
        if let Some(v) = &version {
            v.pin(out.e_tag());
        }
        let expected = out.content_length();
        let body = out.body.collect().await.map_err(|e| Failed::Transient {
            cause: format!("reading the body: {}", DisplayErrorContext(&e)),
            timeout: false,
        })?;
        let bytes = Vec::from(body.into_bytes());
        if let Some(n) = expected.filter(|&n| n >= 0) {
            if bytes.len() as u64 != n as u64 {
                return Err(Failed::Transient {
                    cause: format!("truncated body: {} of {n} bytes", bytes.len()),
                    timeout: false,
                });
            }
        }
        self.bytes.fetch_add(bytes.len() as u64, Ordering::Relaxed);
        Ok(bytes)
    }

    /// One attempt of [`S3::download`]: a GET from `written` on, appended to `file`, of the
    /// version `pinned` names (the first response's, if none was given).
    async fn download_once(
        self: Arc<Self>,
        key: String,
        file: Arc<std::sync::Mutex<std::fs::File>>,
        written: Arc<AtomicU64>,
        pinned: Version,
    ) -> Result<(), Failed> {
        use std::io::Write;
        let stall = self.cfg.attempt_timeout;
        let stalled = |what: &str| Failed::Transient {
            cause: format!("{what}: nothing received for {stall:?}"),
            timeout: true,
        };
        let from = written.load(Ordering::Relaxed);
        let mut req = self.client.get_object().bucket(&self.cfg.bucket).key(&key);
        if from > 0 {
            req = req.range(format!("bytes={from}-"));
            self.resumed.fetch_add(1, Ordering::Relaxed);
        }
        if let Some(t) = pinned.etag() {
            req = req.if_match(t);
        }
        let out = tokio::time::timeout(stall, req.send())
            .await
            .map_err(|_| stalled("the request"))?
            .map_err(|e| self.classify(&key, e))?;
        pinned.pin(out.e_tag());
        let expected = out.content_length().filter(|&n| n >= 0).map(|n| n as u64);
        let mut body = out.body;
        let mut got = 0u64;
        loop {
            let chunk = tokio::time::timeout(stall, body.next())
                .await
                .map_err(|_| stalled("the body"))?;
            match chunk {
                None => break,
                Some(Ok(bytes)) => {
                    file.lock()
                        .map_err(|_| {
                            Failed::Fatal(S3Error::Client(
                                "a download's file lock was poisoned".into(),
                            ))
                        })?
                        .write_all(&bytes)
                        .map_err(|e| {
                            Failed::Fatal(S3Error::Client(format!(
                                "writing s3://{}/{key} to disk: {e}",
                                self.cfg.bucket
                            )))
                        })?;
                    got += bytes.len() as u64;
                    written.fetch_add(bytes.len() as u64, Ordering::Relaxed);
                    self.bytes.fetch_add(bytes.len() as u64, Ordering::Relaxed);
                }
                Some(Err(e)) => {
                    return Err(Failed::Transient {
                        cause: format!(
                            "the body broke off after byte {}: {}",
                            from + got,
                            DisplayErrorContext(&e)
                        ),
                        timeout: false,
                    })
                }
            }
        }
        match expected {
            Some(n) if got != n => Err(Failed::Transient {
                cause: format!("the body ended at byte {} of {}", from + got, from + n),
                timeout: false,
            }),
            _ => Ok(()),
        }
    }

    /// Sorts an SDK error into fatal and transient.
    fn classify<E>(
        &self,
        key: &str,
        err: SdkError<E, aws_sdk_s3::config::http::HttpResponse>,
    ) -> Failed
    where
        E: ProvideErrorMetadata + std::error::Error + Send + Sync + 'static,
    {
        let bucket = self.cfg.bucket.clone();
        let transient = |cause: String| Failed::Transient {
            cause,
            timeout: false,
        };
        match &err {
            SdkError::ServiceError(se) => {
                let status = se.raw().status().as_u16();
                let code = se.err().code().unwrap_or("");
                let message = se.err().message().unwrap_or(code).to_owned();
                match (status, code) {
                    (404, _) | (_, "NoSuchKey") => Failed::Fatal(S3Error::NotFound {
                        bucket,
                        key: key.to_owned(),
                    }),
                    (403, _) => Failed::Fatal(S3Error::Forbidden {
                        bucket,
                        key: key.to_owned(),
                        message,
                    }),
                    (412, _) => Failed::Fatal(S3Error::Request {
                        bucket,
                        key: key.to_owned(),
                        attempts: 0,
                        cause: format!(
                            "the object changed on the store since it was listed (its entity \
                             tag no longer matches; HTTP 412 {code})"
                        ),
                    }),
                    (408 | 429 | 500..=599, _)
                    | (_, "SlowDown" | "RequestTimeout" | "InternalError" | "Throttling") => {
                        transient(format!("HTTP {status} {code}: {message}"))
                    }
                    _ => Failed::Fatal(S3Error::Request {
                        bucket,
                        key: key.to_owned(),
                        attempts: 0,
                        cause: format!("HTTP {status} {code}: {message}"),
                    }),
                }
            }
            SdkError::TimeoutError(_) => Failed::Transient {
                cause: "connect timeout".into(),
                timeout: true,
            },
            SdkError::DispatchFailure(_) | SdkError::ResponseError(_) => {
                transient(DisplayErrorContext(&err).to_string())
            }
            _ => Failed::Fatal(S3Error::Request {
                bucket,
                key: key.to_owned(),
                attempts: 0,
                cause: DisplayErrorContext(&err).to_string(),
            }),
        }
    }
}
