//! [`S3Config`]: how to reach a bucket.

use std::time::Duration;

use super::retry::RetryPolicy;

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
