//! The per-stage statistics record.

use std::time::Duration;

use serde::{Deserialize, Serialize};

use crate::LatencySummary;

/// What kind of stage a [`StageStats`] describes.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum StageKind {
    /// Pulls items from the user's iterator or stream.
    Source,
    /// Synchronous work on a work-stealing thread pool.
    Pool,
    /// A single-threaded, stateful stage (aggregation).
    Serial,
    /// Asynchronous work on tokio with bounded concurrency.
    Async,
    /// The consumer end: the training loop calling `next()`.
    Sink,
}

/// A snapshot of one stage's counters since the pipeline was built.
///
/// The *queue* of a stage is everything it holds: items waiting for it, items in a worker's hands
/// and results waiting for room downstream. `queue_items` never exceeds `budget_items`, and
/// `queue_bytes` exceeds `budget_bytes` by at most one item (an item larger than the whole byte
/// budget is admitted alone so the pipeline cannot wedge).
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize)]
pub struct StageStats {
    /// The stage's name.
    pub name: String,
    /// The stage's kind.
    pub kind: Option<StageKind>,
    /// Active workers (pool), concurrency (async), 1 otherwise.
    pub workers: usize,
    /// Whether the user pinned `workers` (a tuner never changes it).
    pub pinned: bool,
    /// Most workers the stage may run.
    pub max_workers: usize,
    /// Whether the user pinned the budget (a tuner never changes it).
    pub budget_pinned: bool,
    /// Items taken in.
    pub items_in: u64,
    /// Items put downstream (or delivered, for the sink).
    pub items_out: u64,
    /// Items that failed (an error or a panic) and were skipped.
    pub failures: u64,
    /// Time per item in the user's function (or per wait, for the sink: see `blocked_get`).
    pub task_time: LatencySummary,
    /// Total time workers spent in the user's function.
    pub busy: Duration,
    /// Total time workers spent waiting for room downstream.
    pub blocked_put: Duration,
    /// Total time active workers spent waiting for input.
    pub blocked_get: Duration,
    /// Items the stage holds now.
    pub queue_items: usize,
    /// Bytes the stage holds now.
    pub queue_bytes: u64,
    /// The stage's item budget.
    pub budget_items: usize,
    /// The stage's byte budget.
    pub budget_bytes: u64,
    /// Time since the pipeline started.
    pub elapsed: Duration,
    /// `items_out` per second of `elapsed`.
    pub items_per_s: f64,
    /// The stage's cache, if it has one.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub cache: Option<CacheStats>,
    /// The stage's read-ahead (remote tar shards fetched before the readers need them), if it
    /// has one.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub read_ahead: Option<ReadAheadStats>,
    /// Threads each of the stage's items may use (a video decoder's own frame threads), if the
    /// stage's work has such a knob.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub item_threads: Option<ItemThreadsStats>,
}

/// The threads one item of a stage may use (FFmpeg's frame threads for one clip): the stage's
/// cores are then `workers × threads`. One thread per item, many items in parallel, costs the
/// least CPU; more threads per item pay only where the workers cannot grow.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct ItemThreadsStats {
    /// Threads per item now (items started from now on use them).
    pub threads: usize,
    /// The most a tuner may raise `threads` to.
    pub max_threads: usize,
    /// Whether the user pinned the threads (a tuner never changes them).
    pub pinned: bool,
}

/// Counters of a read-ahead attached to a stage: remote objects (tar shards on S3) fetched
/// ahead of the readers, `depth` of them at once.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct ReadAheadStats {
    /// Objects fetched ahead of the one being read now.
    pub depth: usize,
    /// The most a tuner may raise `depth` to.
    pub max_depth: usize,
    /// Whether the user pinned the depth (a tuner never changes it).
    pub pinned: bool,
    /// Reads of a fetched object.
    pub reads: u64,
    /// Reads that had to wait for their object's fetch (the read-ahead was not far enough
    /// ahead).
    pub waits: u64,
}

/// Counters of a byte cache attached to a stage (hits skip the stage's fetch).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct CacheStats {
    /// Bytes the cache may hold now.
    pub capacity_bytes: u64,
    /// The most a tuner may grow the capacity to.
    pub max_bytes: u64,
    /// Whether the user pinned the capacity (a tuner never changes it).
    pub pinned: bool,
    /// Bytes held now.
    pub bytes: u64,
    /// Entries held now.
    pub entries: u64,
    /// Lookups that found their entry.
    pub hits: u64,
    /// Lookups that did not.
    pub misses: u64,
    /// Bytes served from the cache.
    pub hit_bytes: u64,
    /// Bytes fetched on misses.
    pub miss_bytes: u64,
    /// Bytes evicted to make room (or by a smaller capacity).
    pub evicted_bytes: u64,
}
