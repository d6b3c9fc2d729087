//! [`Sharding`]: a sampled pipeline's place in each epoch (its rank's share, the base a
//! resume of a merged state sets) and where a resume from a [`PipelineState`] starts in it.

use std::sync::Arc;

use flowgate_actors::error::PipelineError;
use flowgate_actors::origin::RangeSet;
use parking_lot::Mutex;

use super::checkpoint::{show_blocks, Part, PipelineState, ShareState, STATE_VERSION};
use crate::sampler::{Layout, Sampler};

/// The source of a pipeline built with
/// [`source_sampled`](crate::PipelineBuilder::source_sampled): its sampler (this rank's place
/// in the world) and the base a resume sets for an epoch, shared with the source's epochs.
#[derive(Clone, Debug)]
pub(crate) struct Sharding {
    pub(crate) sampler: Sampler,
    /// What this world found delivered in an epoch when it started it (a resume).
    pub(crate) base: Arc<Mutex<Option<Base>>>,
    /// (epoch, this rank's local positions a resume skips in it): what the source leaves
    /// out of its next run of that epoch.
    skip: Arc<Mutex<Option<(u64, RangeSet)>>>,
}

/// What a world found delivered in an epoch when it started it.
#[derive(Clone, Debug)]
pub(crate) struct Base {
    epoch: u64,
    /// Global positions delivered ([`ShareState::base`]).
    done: RangeSet,
    /// Parts received of other items ([`ShareState::base_partial`]).
    partial: Vec<Part>,
}

impl Sharding {
    pub(crate) fn new(sampler: Sampler) -> Self {
        Self {
            sampler,
            base: Arc::default(),
            skip: Arc::default(),
        }
    }

    /// The dataset indices the source reads of `order` (this rank's share of `epoch`, after
    /// its base): all of them, less what a resume skips (taken: the skip applies to one run
    /// of the epoch, as the source's does).
    pub(crate) fn reads<'a>(
        &self,
        epoch: u64,
        order: &'a [usize],
    ) -> std::borrow::Cow<'a, [usize]> {
        match self.skip.lock().take() {
            Some((e, skip)) if e == epoch && !skip.is_empty() => order
                .iter()
                .enumerate()
                .filter(|&(p, _)| !skip.contains(p as u64))
                .map(|(_, &i)| i)
                .collect(),
            _ => order.into(),
        }
    }

    /// This rank's place in `epoch` with nothing delivered before: what a state starting
    /// the epoch afresh names.
    pub(crate) fn fresh(&self, epoch: u64) -> ShareState {
        ShareState::of(&self.sampler.layout(epoch, RangeSet::default()))
    }

    /// The base of `epoch` (empty unless a resume set one for it).
    pub(crate) fn base(&self, epoch: u64) -> RangeSet {
        match &*self.base.lock() {
            Some(b) if b.epoch == epoch => b.done.clone(),
            _ => RangeSet::default(),
        }
    }

    /// This rank's place in `epoch`, as its states name it: the layout, and the parts
    /// received before this world started it.
    pub(crate) fn share_state(&self, epoch: u64) -> ShareState {
        let base_partial = match &*self.base.lock() {
            Some(b) if b.epoch == epoch => b.partial.clone(),
            _ => Vec::new(),
        };
        ShareState {
            base_partial,
            ..ShareState::of(&self.layout(epoch))
        }
    }

    /// This rank's layout in `epoch`.
    pub(crate) fn layout(&self, epoch: u64) -> Layout {
        self.sampler.layout(epoch, self.base(epoch))
    }

    /// Where a resume from `state` starts in its epoch: sets the epoch's base, and returns
    /// the local positions to skip and the partial shares, in this rank's positions.
    pub(crate) fn resume(
        &self,
        state: &PipelineState,
    ) -> Result<(RangeSet, Vec<Part>), PipelineError> {
        // Versions before 2 recorded no place; `current` names it where it can.
        let names_its_place = state.version >= STATE_VERSION;
        let mut state = state.current();
        let mine = self.sampler.layout(state.epoch, RangeSet::default());
        if state.shard.is_none() && names_its_place && mine.world > 1 {
            // Written by a sampled pipeline, a state names its rank: one without has lost it,
            // and taken as this rank's own it would skip another rank's items here, or, with
            // nothing delivered, forget what the world had delivered before (its base).
            return Err(PipelineError::config(format!(
                "resume: the checkpoint names no rank (its `shard` is missing) and this pipeline \
                 is rank {} of {}: resume each rank from its own state, or merge them \
                 (PipelineState::merge, flowgate.merge_state_dicts)",
                mine.rank, mine.world
            )));
        }
        // A state that names no place (from a source that was not sampled, or from before
        // places were recorded) is taken to be this rank's own, as it was then.
        let theirs = state.shard.get_or_insert(ShareState::of(&mine));
        if theirs.global_len == u64::MAX {
            theirs.global_len = mine.global_len;
        }
        let theirs = theirs.clone();
        if theirs.global_len != mine.global_len {
            return Err(PipelineError::config(format!(
                "resume: the checkpoint's epoch has {} positions, this pipeline's {}",
                theirs.global_len, mine.global_len
            )));
        }
        if theirs.blocks.is_some() && theirs.blocks != mine.blocks {
            // Blocks follow from the seed, the shuffle buffer and the epoch, never the rank.
            return Err(PipelineError::config(format!(
                "resume: the checkpoint's tar-shard blocks ({}) are not this pipeline's in epoch \
                 {} ({}): it was taken with another seed or shuffle buffer, or it is damaged",
                show_blocks(theirs.blocks),
                state.epoch,
                show_blocks(mine.blocks)
            )));
        }
        if theirs.world > 1 && theirs.blocks.is_none() && mine.blocks.is_some() {
            return Err(PipelineError::config(format!(
                "resume: the checkpoint is rank {}'s of {} without tar-shard blocks \
                 (`block_window`/`block_seed`), this pipeline reads tar shards in blocks: it was \
                 taken with other loader arguments, or it is damaged",
                theirs.rank, theirs.world
            )));
        }
        state
            .check_positions(theirs.layout().len() as u64)
            .map_err(|m| PipelineError::config(format!("resume: {m}")))?;
        if let Some((w, n)) = theirs.split {
            if theirs.split != mine.split {
                return Err(PipelineError::config(format!(
                    "resume: the checkpoint is DataLoader worker {w}'s of {n} (a part of rank {}'s \
                     share): take the state in the training process, where every worker's \
                     batches arrive",
                    theirs.rank
                )));
            }
        }
        let same_rank =
            theirs.world == mine.world && theirs.rank == mine.rank && theirs.blocks == mine.blocks;
        // Parts received before the state's world started the epoch (carried by every rank's
        // state; in a merged state, its `partial`).
        let mut base_partial = theirs.base_partial.clone();
        let (base, skip, partial) = if same_rank && theirs.split == mine.split {
            // The same place in the same world: positions are this rank's own.
            (
                RangeSet::from_ranges(theirs.base.iter().copied()),
                RangeSet::from_ranges(state.delivered.iter().copied()),
                state.partial.clone(),
            )
        } else if same_rank {
            // This rank's own progress, now split among workers: each keeps its part of the
            // rank's positions (see `Layout::split`).
            let mine = self.sampler.layout(
                state.epoch,
                RangeSet::from_ranges(theirs.base.iter().copied()),
            );
            let local = |j: u64| mine.split_local(j);
            let skip = state
                .delivered
                .iter()
                .flat_map(|&(a, b)| a..b)
                .filter_map(|j| local(j).map(|p| (p, p + 1)));
            let partial = state
                .partial
                .iter()
                .filter_map(|&(j, a, b)| local(j).map(|p| (p, a, b)))
                .collect();
            (
                RangeSet::from_ranges(theirs.base.iter().copied()),
                RangeSet::from_ranges(skip),
                partial,
            )
        } else if theirs.world == 1 {
            // A whole world's progress (one process, or merged): deal out the rest afresh.
            let g = state.global()?;
            let layout = self.sampler.layout(state.epoch, g.done.clone());
            let partial = g
                .partial
                .iter()
                .filter_map(|&(i, a, b)| layout.local_of(i).map(|p| (p, a, b)))
                .collect();
            // All of them: those of items no rank of this world is dealt too.
            base_partial = g.partial;
            (g.done, RangeSet::default(), partial)
        } else {
            return Err(PipelineError::config(format!(
                "resume: the checkpoint is rank {}'s of a world_size of {}, this pipeline is rank {} of {}: \
                 merge every rank's checkpoint (PipelineState::merge, flowgate.merge_state_dicts) \
                 to resume at another world size or rank",
                theirs.rank, theirs.world, mine.rank, mine.world
            )));
        };
        *self.base.lock() = Some(Base {
            epoch: state.epoch,
            done: base,
            partial: base_partial,
        });
        *self.skip.lock() = Some((state.epoch, skip.clone()));
        Ok((skip, partial))
    }
}
