//! # flowgate
//!
//! A thread-based data-loading pipeline for keeping accelerators fed: stages with their own
//! concurrency, bounded (item *and* byte) budgets between them, and results in completion or
//! input order. See the [`Pipeline`] builder, and `ARCHITECTURE.md` for a map of the crate.

mod blob;
mod builder;
pub mod cache;
mod checkpoint;
pub mod collate;
mod config;
mod control;
pub mod device;
mod engine;
pub mod measure;
pub mod media;
#[cfg(feature = "parquet")]
pub mod parquet;
mod pipeline;
#[cfg(feature = "s3")]
pub mod s3;
pub mod sample;
pub mod sampler;
pub mod shards;
#[cfg(feature = "spec")]
pub mod spec;
mod stats;
pub mod tensor;

pub use blob::Blob;
pub use builder::{PipelineBuilder, SourceBuilder};
pub use checkpoint::{Fingerprint, Part, PipelineState, ShardState, STATE_VERSION};
pub use config::Workers;
pub use control::{ControlHandle, StopHandle};
pub use pipeline::{EpochIter, EpochStream, Pipeline, Within};
pub use stats::{Monitor, PipelineStats, StatsCallback};
pub use tensor::{DType, Tensor};

pub use flowgate_actors as actors;
pub use flowgate_actors::cap::{cpu_worker_cap, set_cpu_worker_cap};
pub use flowgate_actors::emit::Order;
pub use flowgate_actors::error::{BoxError, Described, ItemError, Panicked, PipelineError};
pub use flowgate_actors::failure::{skip_part, FailureBudget};
pub use flowgate_actors::tuner::{PolicyChoice, TraceRecord, TunerSettings};
pub use flowgate_tuner as tuner;
pub use flowgate_tuner::{LatencySummary, StageKind, StageStats};

/// Makes a process forked from one that ran pipelines ready to run its own: forgets the
/// worker tokens the parent's pipelines held and the parent's pooled tensor buffers (their
/// threads and locks do not exist in the child). Call it in the child right after `fork`,
/// before anything else of flowgate; the parent's pipelines must not be used or dropped in
/// the child (leak them: dropping one would wait for threads the child does not have).
/// The Python package does this itself (`os.register_at_fork`).
pub fn after_fork_in_child() {
    flowgate_actors::cap::reset_after_fork();
    tensor::pool::forget_after_fork();
}

#[cfg(doctest)]
#[doc = include_str!("../README.md")]
struct ReadmeDoctests;

#[cfg(doctest)]
#[doc = include_str!("../docs/guide.md")]
struct GuideDoctests;

#[cfg(doctest)]
#[doc = include_str!("../docs/tuner.md")]
struct TunerDoctests;

#[cfg(doctest)]
#[doc = include_str!("../docs/reliability.md")]
struct ReliabilityDoctests;
