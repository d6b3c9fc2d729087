//! [`S3Error`]: why a request failed, naming the key.

use std::time::Duration;

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

/// The outcome of one failed attempt.
pub(super) enum Failed {
    /// Cannot succeed on retry.
    Fatal(S3Error),
    /// May succeed on retry.
    Transient { cause: String, timeout: bool },
}
