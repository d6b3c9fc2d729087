//! Rates over a window of the run's statistics (what the live view and the progress lines
//! show): batches and items per second, the consumer's wait, each stage's results per second
//! and busy share, and the bottleneck.

use std::time::Duration;

use flowgate::{PipelineStats, StageKind, StageStats};

/// Rates over a window: between two statistics `dt` apart.
pub(crate) struct Rates<'a> {
    prev: &'a PipelineStats,
    pub(crate) dt: f64,
    pub(crate) batches: f64,
    pub(crate) items: f64,
    pub(crate) wait: f64,
}

impl<'a> Rates<'a> {
    pub(crate) fn new(now: &PipelineStats, prev: &'a PipelineStats, dt: Duration) -> Self {
        let dt = dt.as_secs_f64().max(1e-9);
        let find = |kind| {
            let of = |s: &PipelineStats| {
                s.stages
                    .iter()
                    .find(|x| x.kind == Some(kind))
                    .map_or(0, |x| x.items_out)
            };
            of(now).saturating_sub(of(prev)) as f64 / dt
        };
        Self {
            prev,
            dt,
            batches: now.delivered.saturating_sub(prev.delivered) as f64 / dt,
            // Items: what the first stage after the source hands on.
            items: now.stages.iter().find(|s| Self::works(s)).map_or(
                find(StageKind::Source),
                |s| {
                    let p = prev
                        .stages
                        .iter()
                        .find(|p| p.name == s.name)
                        .map_or(0, |p| p.items_out);
                    s.items_out.saturating_sub(p) as f64 / dt
                },
            ),
            wait: now
                .consumer_wait
                .saturating_sub(prev.consumer_wait)
                .as_secs_f64()
                / dt,
        }
    }

    /// A stage that does work (not the source or the sink).
    pub(crate) fn works(s: &StageStats) -> bool {
        !matches!(s.kind, Some(StageKind::Source | StageKind::Sink))
    }

    fn before(&self, s: &StageStats) -> Option<&StageStats> {
        self.prev.stages.iter().find(|p| p.name == s.name)
    }

    /// Results a stage handed on per second.
    pub(crate) fn out(&self, s: &StageStats) -> f64 {
        let p = self.before(s).map_or(0, |p| p.items_out);
        s.items_out.saturating_sub(p) as f64 / self.dt
    }

    /// The fraction of its workers' time a stage was busy (of the most workers it had in
    /// the window, so a stage shrunk within it does not read over 100%).
    pub(crate) fn busy(&self, s: &StageStats) -> f64 {
        let (p, workers) = self.before(s).map_or((Duration::ZERO, s.workers), |p| {
            (p.busy, s.workers.max(p.workers))
        });
        s.busy.saturating_sub(p).as_secs_f64() / (self.dt * workers.max(1) as f64)
    }

    /// What limits the rate: the consumer when it hardly waits, else the busiest stage.
    pub(crate) fn bottleneck(&self, now: &PipelineStats) -> String {
        if self.wait < 0.05 {
            return "the consumer (the loader keeps up)".to_owned();
        }
        now.stages
            .iter()
            .filter(|s| Self::works(s))
            .max_by(|a, b| self.busy(a).total_cmp(&self.busy(b)))
            .map_or_else(
                || "-".to_owned(),
                |s| format!("{} ({:.0}% busy)", s.name, 100.0 * self.busy(s)),
            )
    }
}
