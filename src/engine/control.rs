//! Handles that act on a running pipeline from other threads: [`StopHandle`] and
//! [`ControlHandle`].

use std::sync::Arc;

use actix::Addr;
use flowgate_actors::actor::{Resize, SetBudget, StageActor};
use flowgate_actors::error::PipelineError;

use crate::engine::running::Closer;

/// Stops a pipeline from anywhere; see [`Pipeline::stop_handle`](crate::Pipeline::stop_handle).
#[derive(Clone)]
pub struct StopHandle {
    closer: Arc<Closer>,
}

impl std::fmt::Debug for StopHandle {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("StopHandle").finish_non_exhaustive()
    }
}

impl StopHandle {
    pub(crate) fn new(closer: Arc<Closer>) -> Self {
        Self { closer }
    }

    /// Stops the pipeline: the consumer's next call reports
    /// [`PipelineError::is_stopped`]. Threads are joined when the pipeline is stopped or dropped.
    pub fn stop(&self) {
        self.closer.close();
    }
}

/// Sends control messages to a pipeline's stage actors; see
/// [`Pipeline::control`](crate::Pipeline::control).
#[derive(Clone, Debug)]
pub struct ControlHandle {
    stages: Vec<(String, Addr<StageActor>)>,
}

impl ControlHandle {
    pub(crate) fn new(stages: Vec<(String, Addr<StageActor>)>) -> Self {
        Self { stages }
    }

    fn addr(&self, name: &str) -> Result<&Addr<StageActor>, PipelineError> {
        self.stages
            .iter()
            .find(|(n, _)| n == name)
            .map(|(_, a)| a)
            .ok_or_else(|| PipelineError::config(format!("no stage is named `{name}`")))
    }

    /// Names of the stages, in pipeline order (`source` first, `sink` last).
    pub fn stage_names(&self) -> Vec<&str> {
        self.stages.iter().map(|(n, _)| n.as_str()).collect()
    }

    /// Sets the active workers of stage `name` (concurrency for async stages; stages with one
    /// thread by nature answer 1). Returns the number granted: the process-wide CPU cap may
    /// grant fewer. Items are neither lost nor duplicated by a resize.
    pub fn resize(&self, name: &str, workers: usize) -> Result<usize, PipelineError> {
        futures::executor::block_on(self.addr(name)?.send(Resize { workers }))
            .map_err(|_| PipelineError::stopped())
    }

    /// Sets how many items and bytes stage `name` may hold (`"sink"`: results waiting for the
    /// consumer). Shrinking takes effect as items leave.
    pub fn set_budget(&self, name: &str, items: usize, bytes: u64) -> Result<(), PipelineError> {
        futures::executor::block_on(self.addr(name)?.send(SetBudget { items, bytes }))
            .map_err(|_| PipelineError::stopped())
    }
}
