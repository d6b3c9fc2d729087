//! [`PipelineStats`]: what a pipeline reports about its stages and its consumer.

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::Duration;

use flowgate_actors::failure::Failures;
use flowgate_actors::stage::StageControl;
use flowgate_actors::tuner::{TraceLog, TraceRecord};
use flowgate_tuner::{StageKind, StageStats};

/// A callback that receives a pipeline's statistics (see
/// [`PipelineBuilder::on_stats`](crate::PipelineBuilder::on_stats)).
pub type StatsCallback = Box<dyn FnMut(&PipelineStats) + Send>;

/// Statistics of a pipeline: every stage (source first, sink last) and the consumer.
#[derive(Clone, Debug, Default, serde::Serialize)]
pub struct PipelineStats {
    /// Per-stage statistics, in pipeline order (`source`, the stages, `sink`).
    pub stages: Vec<StageStats>,
    /// Results delivered to the consumer.
    pub delivered: u64,
    /// Total time the consumer waited in `next()` for a result (a starved training loop).
    pub consumer_wait: Duration,
    /// Failed (skipped) items, all stages.
    pub failures: u64,
    /// The last few failures, as messages, oldest first.
    pub recent_failures: Vec<String>,
    /// The current epoch.
    pub epoch: u64,
    /// The memory budget everything the pipeline holds is kept within, and where it came
    /// from (set, or the default: the host's or the container's); none without one.
    pub memory_budget: Option<MemoryBudget>,
}

/// A pipeline's memory budget and where it came from.
#[derive(Clone, Debug, PartialEq, Eq, serde::Serialize)]
pub struct MemoryBudget {
    /// Bytes.
    pub bytes: u64,
    /// Where the figure came from, in words (`"set by the loader's memory budget
    /// (memory_mb)"`, `"the default: half of the cgroup's memory.max (400.0 MiB) less the
    /// 52.1 MiB this process holds"`).
    pub source: String,
}

impl PipelineStats {
    pub(crate) fn assemble(
        stages: Vec<StageStats>,
        ledger: &Failures,
        epoch: u64,
        memory: Option<&MemoryBudget>,
    ) -> Self {
        let sink = stages.iter().find(|s| s.kind == Some(StageKind::Sink));
        Self {
            memory_budget: memory.cloned(),
            delivered: sink.map_or(0, |s| s.items_out),
            consumer_wait: sink.map_or(Duration::ZERO, |s| s.blocked_get),
            failures: ledger.total(),
            recent_failures: ledger.recent().iter().map(ToString::to_string).collect(),
            epoch,
            stages,
        }
    }

    /// The stage called `name`.
    pub fn stage(&self, name: &str) -> Option<&StageStats> {
        self.stages.iter().find(|s| s.name == name)
    }

    /// Bytes every stage holds now, as the memory budget counts them.
    pub fn bytes_held(&self) -> u64 {
        self.stages.iter().map(|s| s.queue_bytes).sum()
    }
}

/// Reads a pipeline's statistics and epoch from any thread, without waiting for its consumer
/// (a monitoring thread, a progress bar); see [`Pipeline::monitor`](crate::Pipeline::monitor).
/// It keeps reporting the pipeline's last figures after the pipeline is dropped.
#[derive(Clone)]
pub struct Monitor {
    pub(crate) stages: Vec<Arc<dyn StageControl>>,
    pub(crate) ledger: Arc<Failures>,
    pub(crate) epoch: Arc<AtomicU64>,
    pub(crate) trace: Arc<TraceLog>,
    pub(crate) memory: Option<MemoryBudget>,
}

impl std::fmt::Debug for Monitor {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Monitor")
            .field("epoch", &self.epoch())
            .finish_non_exhaustive()
    }
}

impl Monitor {
    /// The statistics of every stage now (each stage's counters, read without stopping it).
    pub fn stats(&self) -> PipelineStats {
        PipelineStats::assemble(
            self.stages.iter().map(|s| s.snapshot()).collect(),
            &self.ledger,
            self.epoch(),
            self.memory.as_ref(),
        )
    }

    /// The epoch being iterated (or the next one to start).
    pub fn epoch(&self) -> u64 {
        self.epoch.load(Ordering::Relaxed)
    }

    /// The tuner's recent ticks, oldest first (see
    /// [`Pipeline::tuner_trace`](crate::Pipeline::tuner_trace)).
    pub fn tuner_trace(&self) -> Vec<TraceRecord> {
        self.trace.records()
    }
}
