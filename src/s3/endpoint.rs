//! [`Endpoint`]: where and how to reach S3 by URL (`s3://bucket/rest`), for shards and
//! Parquet files named by URL.

use flowgate_actors::error::PipelineError;

use super::{S3Config, S3};

/// Where and how to reach objects on S3 by URL.
#[derive(Clone, Debug, Default)]
pub struct Endpoint {
    /// An S3-compatible endpoint (`http://host:port`, path-style); else `AWS_ENDPOINT_URL`,
    /// else AWS.
    pub url: Option<String>,
    /// The region; else the AWS chain's, else `us-east-1`.
    pub region: Option<String>,
}

impl Endpoint {
    /// A client for `bucket` at this endpoint (else `AWS_ENDPOINT_URL`, else AWS) and region.
    pub fn client(&self, bucket: &str) -> Result<S3, PipelineError> {
        let mut cfg = S3Config::new(bucket);
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
        S3::connect(cfg).map_err(|e| PipelineError::io("connecting to S3", e))
    }

    /// A client for the bucket of `url` (`s3://bucket/rest`), and the rest.
    pub fn connect<'a>(&self, url: &'a str) -> Result<(S3, &'a str), PipelineError> {
        let rest = url
            .strip_prefix("s3://")
            .ok_or_else(|| PipelineError::config(format!("{url}: not an s3:// URL")))?;
        let (bucket, key) = rest.split_once('/').unwrap_or((rest, ""));
        if bucket.is_empty() {
            return Err(PipelineError::config(format!("{url}: no bucket")));
        }
        let s3 = self.client(bucket)?;
        Ok((s3, key))
    }
}
