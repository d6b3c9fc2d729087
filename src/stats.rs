//! [`PipelineStats`]: what a pipeline reports about its stages and its consumer.

use std::time::Duration;

use flowgate_actors::failure::Failures;
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
}

impl PipelineStats {
    pub(crate) fn assemble(stages: Vec<StageStats>, ledger: &Failures, epoch: u64) -> Self {
        let sink = stages.iter().find(|s| s.kind == Some(StageKind::Sink));
        Self {
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
}
