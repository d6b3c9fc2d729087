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
//! Files, one idea each:
//! 1. `config` — [`S3Config`]: how to reach a bucket.
//! 2. `retry` — [`RetryPolicy`] and the retry loop: backoff with full jitter under a budget
//!    shared by every request of a client.
//! 3. `error` — [`S3Error`]: typed, naming the key.
//! 4. `client` — [`S3`]: listing, fetching, uploading, on the client's own runtime.
//! 5. `local` — [`LocalServer`] (feature `test-util`): a real S3-compatible server on
//!    127.0.0.1 for tests and demos.
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

mod client;
mod config;
mod endpoint;
mod error;
#[cfg(feature = "test-util")]
mod local;
mod retry;

pub use client::{S3Future, S3Object, S3Stats, Version, S3};
pub use config::S3Config;
pub use endpoint::Endpoint;
pub use error::S3Error;
#[cfg(feature = "test-util")]
pub use local::LocalServer;
pub use retry::RetryPolicy;
