//! `flowgate-tuner`: the pure half of flowgate's self-tuning.
//!
//! This crate has no runtime (no actix, no tokio) so that everything in it is fast to test and
//! can run inside a simulator. Today it holds the measurement vocabulary shared by the engine
//! and by policies: a fixed-size latency [`Histogram`] that workers fill locally and merge in
//! batches, and the plain [`StageStats`] record every stage reports.

mod histogram;
mod stats;

pub use histogram::{Histogram, LatencySummary};
pub use stats::{StageKind, StageStats};
