//! The library's integration tests, one module per area, in one binary: each test binary links
//! the whole library (video, S3, CUDA), so a few binaries build and link much faster than one
//! per file. Tests that need a process of their own (a process-wide setting, a measured peak
//! RSS, a fork) are in `tests/isolated`. A module's features are those its tests need.

#[path = "../common/mod.rs"]
mod common;
#[cfg(all(feature = "s3", feature = "test-util"))]
#[path = "../s3_common/mod.rs"]
mod s3_common;

#[cfg(all(feature = "spec", feature = "synth"))]
mod configs;
mod device;
mod elastic;
#[cfg(feature = "image")]
mod epochs;
mod failures;
#[cfg(all(feature = "parquet", feature = "image"))]
mod fields;
#[cfg(feature = "image")]
mod fill;
#[cfg(all(feature = "audio", feature = "synth", feature = "spec"))]
mod length_batches;
#[cfg(all(feature = "parquet", feature = "image"))]
mod loader;
mod loader_sources;
mod map_batches;
mod map_items;
mod media_fields;
mod mixture;
#[cfg(all(feature = "parquet", feature = "image"))]
mod parquet;
mod pipeline;
mod readers;
#[cfg(feature = "spec")]
mod refusals;
mod resume;
#[cfg(all(feature = "s3", feature = "test-util"))]
mod s3;
#[cfg(all(feature = "s3", feature = "test-util"))]
mod s3_shards;
mod shards;
mod tuning;
#[cfg(feature = "image")]
mod units;
#[cfg(all(feature = "video", feature = "synth"))]
mod video;
