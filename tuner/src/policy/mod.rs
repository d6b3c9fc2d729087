//! The shipped policies: [`Static`], [`HillClimb`] (AIMD) and [`ModelBased`] (the default);
//! [`Park`] gives a pipeline's workers back while its consumer is away.

mod cache_sizing;
mod hill_climb;
mod model;
mod park;
mod threads;

pub use cache_sizing::{cache_decisions, read_ahead_decisions};
pub use hill_climb::{HillClimb, HillClimbSettings};
pub use model::{ModelBased, ModelSettings};
pub use park::{Park, IDLE_SECS};
pub use threads::ItemThreadTrials;

use crate::observation::{Decision, Observation, Policy};

/// Changes nothing: the user's numbers stand.
#[derive(Clone, Copy, Debug, Default)]
pub struct Static;

impl Policy for Static {
    fn name(&self) -> &str {
        "static"
    }

    fn decide(&mut self, _obs: &Observation) -> Vec<Decision> {
        Vec::new()
    }
}

/// The item budget that keeps `workers` busy with one item of slack each.
pub(crate) fn base_budget(workers: usize) -> usize {
    (2 * workers).max(workers + 2)
}
