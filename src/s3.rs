//! Objects from S3 or an S3-compatible store (feature `s3`).
//!
//! [`S3`] is a cheap-to-clone client for one bucket. It lists a prefix (all pages), and fetches
//! whole objects or byte ranges as [`Blob`]s, retrying what can succeed on a second try (5xx,
//! `SlowDown`, throttling, timeouts, dropped connections, truncated bodies) with exponential
//! backoff and full jitter, under a retry *budget* shared by every request of the client (so a
//! store that is down costs a bounded number of extra requests, not `attempts ×` the dataset).
//! What cannot succeed (a missing key, a 403) fails at once with a typed [`S3Error`] naming the
//! key. Every attempt has a timeout, so a stalled connection cannot hang a pipeline.
//!
//! Credentials and region come from the standard AWS chain (environment, profile, web identity,
//! container and instance metadata) unless [`S3Config`] sets them; an explicit endpoint with
//! path-style addressing reaches S3-compatible stores (MinIO, s3s-fs, Ceph).
//!
//! The client runs its requests on a small tokio runtime of its own, so it can be called from
//! any pipeline stage (or any runtime) and its connection pool outlives none of them.
//!
//! ```no_run
//! use flowgate::s3::{S3Config, S3};
//! use flowgate::{media::image::ImageRecipe, Pipeline};
//!
//! let s3 = S3::connect(S3Config::new("my-bucket"))?;
//! let keys: Vec<String> = s3.list("train/")?.into_iter().map(|o| o.key).collect();
//! let recipe = ImageRecipe::default();
//! let mut pipeline = Pipeline::builder()
//!     .source(keys)
//!     .pipe_async("fetch", s3.fetcher(), 16)
//!     .pipe("decode", move |b: flowgate::Blob| recipe.decode(&b.bytes, &b.path), 2)
//!     .build()?;
//! for image in pipeline.iter() { /* ... */ }
//! # Ok::<(), Box<dyn std::error::Error>>(())
//! ```

use std::future::Future;
use std::ops::Range;
use std::path::{Path, PathBuf};
use std::pin::Pin;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::Duration;

use aws_config::retry::RetryConfig;
use aws_config::timeout::TimeoutConfig;
use aws_config::{BehaviorVersion, Region};
use aws_sdk_s3::config::Credentials;
use aws_sdk_s3::error::{DisplayErrorContext, ProvideErrorMetadata, SdkError};
use aws_sdk_s3::primitives::ByteStream;
use parking_lot::Mutex;

use crate::blob::Blob;

/// How to reach a bucket.
#[derive(Clone, Debug)]
pub struct S3Config {
    /// The bucket.
    pub bucket: String,
    /// An endpoint URL for S3-compatible stores (`http://127.0.0.1:9000`); `None` for AWS.
    pub endpoint: Option<String>,
    /// The region; `None` takes it from the AWS chain, else `us-east-1`.
    pub region: Option<String>,
    /// Path-style addressing (`endpoint/bucket/key`), which most S3-compatible stores need.
    pub path_style: bool,
    /// Static credentials (access key id, secret); `None` uses the AWS credential chain.
    pub credentials: Option<(String, String)>,
    /// The limit on one attempt (request and body); a slower attempt is retried.
    pub attempt_timeout: Duration,
    /// The limit on opening a connection.
    pub connect_timeout: Duration,
    /// Retries and backoff.
    pub retry: RetryPolicy,
    /// Threads of the client's own runtime.
    pub io_threads: usize,
    /// Keys per listing page (`None`: the store's default, 1,000 on AWS).
    pub list_page_size: Option<i32>,
}

impl S3Config {
    /// AWS defaults for `bucket`: virtual-hosted addressing, the credential chain, 30 s per
    /// attempt, 5 s to connect, [`RetryPolicy::default`], 2 I/O threads.
    pub fn new(bucket: impl Into<String>) -> Self {
        Self {
            bucket: bucket.into(),
            endpoint: None,
            region: None,
            path_style: false,
            credentials: None,
            attempt_timeout: Duration::from_secs(30),
            connect_timeout: Duration::from_secs(5),
            retry: RetryPolicy::default(),
            io_threads: 2,
            list_page_size: None,
        }
    }

    /// An S3-compatible endpoint, addressed path-style.
    pub fn endpoint(mut self, url: impl Into<String>) -> Self {
        self.endpoint = Some(url.into());
        self.path_style = true;
        self
    }

    /// The region.
    pub fn region(mut self, region: impl Into<String>) -> Self {
        self.region = Some(region.into());
        self
    }

    /// Static credentials instead of the AWS chain.
    pub fn credentials(mut self, access_key: impl Into<String>, secret: impl Into<String>) -> Self {
        self.credentials = Some((access_key.into(), secret.into()));
        self
    }

    /// The limit on one attempt.
    pub fn attempt_timeout(mut self, d: Duration) -> Self {
        self.attempt_timeout = d;
        self
    }

    /// Retries and backoff.
    pub fn retry(mut self, retry: RetryPolicy) -> Self {
        self.retry = retry;
        self
    }
}

/// Retries with exponential backoff and full jitter, under a shared budget.
///
/// Attempt `n` (from 1) that fails transiently waits a uniform random time in
/// `[0, min(max_delay, base_delay · 2ⁿ⁻¹)]` before the next. Each retry spends
/// `retry_cost` tokens of the client's budget (`timeout_cost` after a timeout) and each success
/// returns one, up to `budget`: while the store is healthy retries are free, and when it fails
/// everywhere the budget runs out and requests fail fast instead of multiplying the load
/// (the AWS SDKs' "standard" retry mode works the same way).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct RetryPolicy {
    /// Attempts per request, the first included (1 = no retries).
    pub max_attempts: u32,
    /// The first backoff's upper bound.
    pub base_delay: Duration,
    /// The largest backoff.
    pub max_delay: Duration,
    /// Tokens in the client's retry budget.
    pub budget: u64,
    /// Tokens a retry costs.
    pub retry_cost: u64,
    /// Tokens a retry after a timeout costs.
    pub timeout_cost: u64,
}

impl Default for RetryPolicy {
    /// 5 attempts, 50 ms → 5 s backoff, a budget of 500 tokens, 5 per retry, 10 after a timeout.
    fn default() -> Self {
        Self {
            max_attempts: 5,
            base_delay: Duration::from_millis(50),
            max_delay: Duration::from_secs(5),
            budget: 500,
            retry_cost: 5,
            timeout_cost: 10,
        }
    }
}

/// One object of a listing.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct S3Object {
    /// The key.
    pub key: String,
    /// The size in bytes.
    pub size: u64,
}

/// Why a request failed. Every variant about an object names its key.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum S3Error {
    /// The key does not exist (404); not retried.
    #[error("s3://{bucket}/{key}: no such key")]
    NotFound {
        /// The bucket.
        bucket: String,
        /// The key.
        key: String,
    },
    /// Access denied (403); not retried.
    #[error("s3://{bucket}/{key}: access denied: {message}")]
    Forbidden {
        /// The bucket.
        bucket: String,
        /// The key.
        key: String,
        /// What the store said.
        message: String,
    },
    /// Every attempt timed out, or the last one did and no retries were left.
    #[error("s3://{bucket}/{key}: timed out after {attempts} attempt(s) of {timeout:?}")]
    Timeout {
        /// The bucket.
        bucket: String,
        /// The key.
        key: String,
        /// Attempts made.
        attempts: u32,
        /// The limit per attempt.
        timeout: Duration,
    },
    /// The request failed: a non-retryable answer, or a transient failure on the last attempt
    /// (or with the retry budget spent).
    #[error("s3://{bucket}/{key}: {cause} (after {attempts} attempt(s))")]
    Request {
        /// The bucket.
        bucket: String,
        /// The key (the prefix, for a listing).
        key: String,
        /// Attempts made.
        attempts: u32,
        /// What went wrong the last time.
        cause: String,
    },
    /// The client could not be built (bad configuration, no runtime threads).
    #[error("s3 client: {0}")]
    Client(String),
}

impl S3Error {
    /// The key (or listing prefix) the error is about; `None` for [`S3Error::Client`].
    pub fn key(&self) -> Option<&str> {
        match self {
            S3Error::NotFound { key, .. }
            | S3Error::Forbidden { key, .. }
            | S3Error::Timeout { key, .. }
            | S3Error::Request { key, .. } => Some(key),
            S3Error::Client(_) => None,
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
    budget: Mutex<u64>,
    attempts: AtomicU64,
    retries: AtomicU64,
    failures: AtomicU64,
    bytes: AtomicU64,
    jitter: AtomicU64,
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

/// The outcome of one failed attempt.
enum Failed {
    /// Cannot succeed on retry.
    Fatal(S3Error),
    /// May succeed on retry.
    Transient { cause: String, timeout: bool },
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
        let budget = cfg.retry.budget;
        Ok(Self {
            inner: Arc::new(Inner {
                client: aws_sdk_s3::Client::from_conf(conf.build()),
                runtime: RuntimeHolder(Some(runtime)),
                budget: Mutex::new(budget),
                attempts: AtomicU64::new(0),
                retries: AtomicU64::new(0),
                failures: AtomicU64::new(0),
                bytes: AtomicU64::new(0),
                jitter: AtomicU64::new(0x2545_F491_4F6C_DD1D),
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
            attempts: i.attempts.load(Ordering::Relaxed),
            retries: i.retries.load(Ordering::Relaxed),
            failures: i.failures.load(Ordering::Relaxed),
            bytes: i.bytes.load(Ordering::Relaxed),
            budget_left: *i.budget.lock(),
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
                    .with_retries(&prefix, || {
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

    /// Fetches a whole object.
    pub async fn get(&self, key: &str) -> Result<Blob, S3Error> {
        self.get_impl(key.to_owned(), None).await
    }

    /// Fetches the bytes `range` of an object (an HTTP range request); a range that runs past
    /// the end returns what exists.
    pub async fn get_range(&self, key: &str, range: Range<u64>) -> Result<Blob, S3Error> {
        self.get_impl(key.to_owned(), Some(range)).await
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
            Box::pin(async move { s3.get_impl(key, None).await })
        }
    }

    /// Uploads an object (used to stage datasets and in tests).
    pub async fn put(&self, key: &str, bytes: Vec<u8>) -> Result<(), S3Error> {
        let inner = self.inner.clone();
        let key = key.to_owned();
        self.spawn(async move {
            inner
                .with_retries(&key, || {
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

    async fn get_impl(&self, key: String, range: Option<Range<u64>>) -> Result<Blob, S3Error> {
        let inner = self.inner.clone();
        self.spawn(async move {
            let bytes = inner
                .with_retries(&key, || inner.clone().get_once(key.clone(), range.clone()))
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
    ) -> Result<Vec<u8>, Failed> {
        let mut req = self.client.get_object().bucket(&self.cfg.bucket).key(&key);
        if let Some(r) = &range {
            if r.is_empty() {
                return Ok(Vec::new());
            }
            req = req.range(format!("bytes={}-{}", r.start, r.end - 1));
        }
        let out = req.send().await.map_err(|e| self.classify(&key, e))?;
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

    /// Runs `attempt` until it succeeds, fails fatally, or the attempts or budget run out.
    async fn with_retries<T, F, Fut>(&self, key: &str, mut attempt: F) -> Result<T, S3Error>
    where
        F: FnMut() -> Fut,
        Fut: Future<Output = Result<T, Failed>>,
    {
        let policy = self.cfg.retry;
        let timeout = self.cfg.attempt_timeout;
        let mut n = 0u32;
        loop {
            n += 1;
            self.attempts.fetch_add(1, Ordering::Relaxed);
            let outcome = match tokio::time::timeout(timeout, attempt()).await {
                Ok(r) => r,
                Err(_) => Err(Failed::Transient {
                    cause: format!("attempt timed out after {timeout:?}"),
                    timeout: true,
                }),
            };
            let (cause, timed_out) = match outcome {
                Ok(v) => {
                    let mut budget = self.budget.lock();
                    *budget = (*budget + 1).min(policy.budget);
                    return Ok(v);
                }
                Err(Failed::Fatal(mut e)) => {
                    if let S3Error::Request { attempts, .. } = &mut e {
                        *attempts = n;
                    }
                    self.failures.fetch_add(1, Ordering::Relaxed);
                    return Err(e);
                }
                Err(Failed::Transient { cause, timeout }) => (cause, timeout),
            };
            let cost = if timed_out {
                policy.timeout_cost
            } else {
                policy.retry_cost
            };
            let may_retry = n < policy.max_attempts && {
                let mut budget = self.budget.lock();
                let ok = *budget >= cost;
                if ok {
                    *budget -= cost;
                }
                ok
            };
            if !may_retry {
                self.failures.fetch_add(1, Ordering::Relaxed);
                let bucket = self.cfg.bucket.clone();
                let key = key.to_owned();
                return Err(if timed_out {
                    S3Error::Timeout {
                        bucket,
                        key,
                        attempts: n,
                        timeout,
                    }
                } else {
                    let spent = if n < policy.max_attempts {
                        " (retry budget spent)"
                    } else {
                        ""
                    };
                    S3Error::Request {
                        bucket,
                        key,
                        attempts: n,
                        cause: format!("{cause}{spent}"),
                    }
                });
            }
            self.retries.fetch_add(1, Ordering::Relaxed);
            tracing::debug!(key, attempt = n, cause = %cause, "s3 retry");
            tokio::time::sleep(self.backoff(n)).await;
        }
    }

    /// Full jitter: uniform in `[0, min(max, base · 2ⁿ⁻¹)]`.
    fn backoff(&self, n: u32) -> Duration {
        let p = self.cfg.retry;
        let cap = p
            .base_delay
            .saturating_mul(1u32 << (n - 1).min(20))
            .min(p.max_delay);
        let seed = self
            .jitter
            .fetch_add(0x9E37_79B9_7F4A_7C15, Ordering::Relaxed);
        let u = flowgate_tuner::Rng::new(seed).uniform();
        cap.mul_f64(u)
    }
}

/// A local S3-compatible server (`s3s-fs`) serving a directory on 127.0.0.1 at a free port, for
/// tests, examples and trying a pipeline without a cloud account. Each top-level folder of the
/// root is a bucket. The server stops when this value drops.
///
/// `scripts/setup.sh` installs the binary into `target/tools/bin/s3s-fs`;
/// [`LocalServer::binary`] finds it there (or at `$FLOWGATE_S3S_FS`).
#[derive(Debug)]
pub struct LocalServer {
    child: std::process::Child,
    endpoint: String,
    root: PathBuf,
}

impl LocalServer {
    /// The access key the server accepts.
    pub const ACCESS_KEY: &'static str = "flowgate";
    /// The secret the server accepts.
    pub const SECRET_KEY: &'static str = "flowgate-secret";

    /// The `s3s-fs` binary: `$FLOWGATE_S3S_FS`, else the one `scripts/setup.sh` installs.
    pub fn binary() -> PathBuf {
        std::env::var_os("FLOWGATE_S3S_FS")
            .map(PathBuf::from)
            .unwrap_or_else(|| {
                Path::new(env!("CARGO_MANIFEST_DIR")).join("target/tools/bin/s3s-fs")
            })
    }

    /// Starts the server over `root` (created if missing) and waits until it accepts
    /// connections (10 s at most).
    pub fn start(root: impl AsRef<Path>) -> std::io::Result<Self> {
        let root = root.as_ref().to_path_buf();
        std::fs::create_dir_all(&root)?;
        let binary = Self::binary();
        if !binary.exists() {
            return Err(std::io::Error::new(
                std::io::ErrorKind::NotFound,
                format!(
                    "{} is missing: run scripts/setup.sh (it installs s3s-fs), or set FLOWGATE_S3S_FS",
                    binary.display()
                ),
            ));
        }
        let mut last = None;
        // A free port can be taken between probing and binding: try a few.
        for _ in 0..5 {
            let port = std::net::TcpListener::bind("127.0.0.1:0")?
                .local_addr()?
                .port();
            let mut child = std::process::Command::new(&binary)
                .args(["--host", "127.0.0.1", "--port", &port.to_string()])
                .args(["--access-key", Self::ACCESS_KEY])
                .args(["--secret-key", Self::SECRET_KEY])
                .arg(&root)
                .stdout(std::process::Stdio::null())
                .stderr(std::process::Stdio::null())
                .spawn()?;
            let deadline = std::time::Instant::now() + Duration::from_secs(10);
            let addr = std::net::SocketAddr::from(([127, 0, 0, 1], port));
            loop {
                if std::net::TcpStream::connect_timeout(&addr, Duration::from_millis(200)).is_ok() {
                    return Ok(Self {
                        child,
                        endpoint: format!("http://127.0.0.1:{port}"),
                        root,
                    });
                }
                if let Some(status) = child.try_wait()? {
                    last = Some(format!("s3s-fs exited with {status}"));
                    break;
                }
                if std::time::Instant::now() > deadline {
                    let _ = child.kill();
                    let _ = child.wait();
                    last = Some("s3s-fs did not accept connections within 10 s".into());
                    break;
                }
                std::thread::sleep(Duration::from_millis(20));
            }
        }
        Err(std::io::Error::other(last.unwrap_or_default()))
    }

    /// The server's URL (`http://127.0.0.1:PORT`).
    pub fn endpoint(&self) -> &str {
        &self.endpoint
    }

    /// The directory it serves.
    pub fn root(&self) -> &Path {
        &self.root
    }

    /// A configuration for `bucket` on this server, with its credentials.
    pub fn config(&self, bucket: &str) -> S3Config {
        S3Config::new(bucket)
            .endpoint(&self.endpoint)
            .region("us-east-1")
            .credentials(Self::ACCESS_KEY, Self::SECRET_KEY)
    }
}

impl Drop for LocalServer {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}
