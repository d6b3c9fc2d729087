//! What the builder collects before anything starts: the source and the stages to spawn, the
//! channels between them, the tuner and the callbacks. [`assemble`](super::assemble) turns a
//! [`Plan`] into a running pipeline.

use std::sync::Arc;
use std::time::Duration;

use flowgate_actors::error::PipelineError;
use flowgate_actors::failure::Observer;
use flowgate_actors::stage::{StageControl, StageCore};
use flowgate_actors::tuner::{GpuSampler, OnDecision, TunerSettings};
use flowgate_tuner::{Policy, StageKind};

use crate::engine::config::{Config, StageOpts, Workers};
use crate::engine::running::{HasBudget, SourceControl};
use crate::engine::stats::StatsCallback;

/// What a stage needs from the pipeline when it starts.
pub(crate) struct BuildCtx {
    pub(crate) cfg: Config,
    pub(crate) runtime: Option<tokio::runtime::Handle>,
}

/// Starts a stage: the context, its core, and its initial workers.
pub(crate) type Spawn =
    Box<dyn FnOnce(&BuildCtx, StageCore, usize) -> Result<Arc<dyn StageControl>, PipelineError>>;
/// Starts the source.
pub(crate) type SpawnSource =
    Box<dyn FnOnce(&BuildCtx, StageCore) -> Result<Arc<dyn SourceControl>, PipelineError>>;

/// A stage added to the builder, not started yet.
pub(crate) struct Pending {
    pub(crate) name: String,
    pub(crate) kind: StageKind,
    pub(crate) workers: Workers,
    /// Source items each input item stands for (after aggregation), for default budgets.
    pub(crate) in_scale: usize,
    /// The budget of the channel this stage consumes.
    pub(crate) input: Arc<dyn HasBudget>,
    pub(crate) opts: StageOpts,
    pub(crate) spawn: Spawn,
}

/// The tuner a pipeline will run, if any.
#[derive(Default)]
pub(crate) struct Autotune {
    pub(crate) settings: TunerSettings,
    pub(crate) policy: Option<Box<dyn Policy>>,
    pub(crate) on_decision: Option<OnDecision>,
    pub(crate) gpu: Option<GpuSampler>,
}

/// Everything the builder has collected, whatever the current item type.
pub(crate) struct Plan {
    pub(crate) cfg: Config,
    pub(crate) autotune: Option<Autotune>,
    pub(crate) source: SpawnSource,
    pub(crate) stages: Vec<Pending>,
    /// Every channel, source's output first.
    pub(crate) channels: Vec<Arc<dyn HasBudget>>,
    pub(crate) needs_runtime: bool,
    pub(crate) on_stats: Option<(Duration, StatsCallback)>,
    pub(crate) on_failure: Option<Observer>,
}

impl Plan {
    /// Checks what can be checked before anything starts.
    pub(crate) fn validate(&self) -> Result<(), PipelineError> {
        if let Some(a) = &self.autotune {
            a.settings
                .check()
                .map_err(|e| PipelineError::config(format!("tuner: {e}")))?;
        }
        let stages = &self.stages;
        for (i, s) in stages.iter().enumerate() {
            if s.name.is_empty() {
                return Err(PipelineError::config(format!(
                    "stage {} has an empty name",
                    i + 1
                )));
            }
            if s.name == "source" || s.name == "sink" {
                return Err(PipelineError::config(format!(
                    "stage name `{}` is reserved",
                    s.name
                )));
            }
            if stages[..i].iter().any(|o| o.name == s.name) {
                return Err(PipelineError::config(format!(
                    "two stages are named `{}`",
                    s.name
                )));
            }
            // Each worker of a pool stage is a thread, of an async stage an item in flight:
            // past the limit the stage would only take memory and time to start.
            let limit = match s.kind {
                flowgate_tuner::StageKind::Pool => flowgate_actors::limits::WORKERS,
                _ => flowgate_actors::limits::IN_FLIGHT,
            };
            if let Err(e) = limit.check_usize(s.workers.get()) {
                return Err(PipelineError::config(format!("stage `{}`: {e}", s.name)));
            }
            if s.opts.budget_items == Some(0) || s.opts.budget_bytes == Some(0) {
                return Err(PipelineError::config(format!(
                    "stage `{}` has a zero budget",
                    s.name
                )));
            }
        }
        Ok(())
    }
}
