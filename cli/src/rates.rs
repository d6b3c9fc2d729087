//! Rates over a window of the run's statistics (what the live view and the progress lines
//! show): batches and items per second, the consumer's wait, each stage's results per second
//! and busy share, and the bottleneck. The pace, the busy share and the bottleneck are the
//! library's (`flowgate::board`), so `flowgate run`, `flowgate top` and a Python loader's
//! `report_ranks` name the same stage.

use std::time::Duration;

use flowgate::board::{self, Summary};
use flowgate::{PipelineStats, StageKind, StageStats};

/// Rates over a window: between two statistics `dt` apart.
pub(crate) struct Rates<'a> {
    prev: &'a PipelineStats,
    pub(crate) dt: f64,
    pub(crate) batches: f64,
    pub(crate) items: f64,
    pub(crate) wait: f64,
    pace: Summary,
}

impl<'a> Rates<'a> {
    pub(crate) fn new(now: &PipelineStats, prev: &'a PipelineStats, dt: Duration) -> Self {
        let dt = dt.as_secs_f64().max(1e-9);
        let pace = board::summary(now, Some(prev));
        Self {
            prev,
            dt,
            batches: now.delivered.saturating_sub(prev.delivered) as f64 / dt,
            items: pace.items_per_s,
            wait: pace.wait,
            pace,
        }
    }

    /// A stage that does work (not the source or the sink).
    pub(crate) fn works(s: &StageStats) -> bool {
        !matches!(s.kind, Some(StageKind::Source | StageKind::Sink))
    }

    fn before(&self, s: &StageStats) -> Option<&StageStats> {
        self.prev.stage(&s.name)
    }

    /// Results a stage handed on per second.
    pub(crate) fn out(&self, s: &StageStats) -> f64 {
        let p = self.before(s).map_or(0, |p| p.items_out);
        s.items_out.saturating_sub(p) as f64 / self.dt
    }

    /// The fraction of its workers' time a stage was busy (`flowgate::board::busy_share`).
    pub(crate) fn busy(&self, s: &StageStats) -> f64 {
        board::busy_share(s, self.before(s), self.dt)
    }

    /// What limits the rate (the library's bottleneck): the training step when the consumer
    /// hardly waits, else the busiest stage, with its busy share.
    pub(crate) fn bottleneck(&self, now: &PipelineStats) -> String {
        match now.stage(&self.pace.bottleneck) {
            Some(s) if self.pace.bottleneck != "step" => {
                format!("{} ({:.0}% busy)", s.name, 100.0 * self.busy(s))
            }
            _ => self.pace.held_back_by(),
        }
    }
}
