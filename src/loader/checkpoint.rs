//! A loader's checkpoints: what [`Loader::state`] records at each point of an epoch (running,
//! abandoned mid-way, batches being made up, decoded as units elsewhere, ended), and
//! [`Loader::resume`], which continues from one.

use flowgate_actors::error::PipelineError;

use super::{units, Loader};
use crate::engine::checkpoint::PipelineState;

impl Loader {
    /// A checkpoint of the consumer's progress: what it has received of the epoch being
    /// iterated; after an epoch was abandoned mid-way (a `break`), what it received of that
    /// epoch until another starts (a resume delivers the rest of it); after an epoch's end,
    /// the next epoch from its start.
    pub fn state(&mut self) -> Result<PipelineState, PipelineError> {
        if let Some(s) = self.passes.checkpoint() {
            return Ok(s.clone());
        }
        if let Some(u) = &self.units {
            return Ok(self.with_owed(u.state()));
        }
        if let Some(f) = &self.fill.filling {
            return Ok(self.with_owed(f.progress()));
        }
        if self.passes.in_epoch() {
            let s = self.pipeline()?.state();
            return Ok(self.with_owed(s));
        }
        self.next_state()
    }

    /// The state the next [`start_epoch`](Self::start_epoch) starts from: the resumed one,
    /// or after a finished epoch the next from its start.
    pub(super) fn next_state(&mut self) -> Result<PipelineState, PipelineError> {
        let resumed = self.passes.resumed();
        let mut s = self.pipeline()?.state();
        if !resumed && s.delivered_items > 0 {
            return Ok(units::next_epoch(&s));
        }
        if resumed {
            // What the resumed state owes (the pipeline keeps only positions).
            s.owed_batches = self.fill.resumed_owed;
        }
        Ok(s)
    }

    /// Continues from `state`: the next epoch started yields exactly what was not delivered
    /// yet in that epoch. A state of another dataset or batching is refused.
    pub fn resume(&mut self, state: &PipelineState) -> Result<(), PipelineError> {
        // What a state owes is at most an epoch of the rank (a damaged count would make up
        // batches for ever).
        if let Some(n) = state
            .owed_batches
            .filter(|&n| n > self.batches_per_epoch as u64)
        {
            return Err(PipelineError::config(format!(
                "resume: the checkpoint owes {n} batches, more than an epoch of this rank has \
                 ({})",
                self.batches_per_epoch
            )));
        }
        self.fill.filling = None;
        self.pipeline = None;
        self.units = None;
        *self.monitor.lock().expect("monitor") = None;
        self.passes.resumed_at();
        self.pipeline()?.resume(state)?;
        // What a state owes is its own split's (a rank's, or one DataLoader worker's): a rank's
        // state resumed in each of its workers owes what each worker's part makes.
        let split = |s: &PipelineState| s.shard.as_ref().and_then(|sh| sh.split);
        let own = split(&self.pipeline()?.state());
        self.fill.resumed_owed = state.owed_batches.filter(|_| split(state) == own);
        Ok(())
    }
}
