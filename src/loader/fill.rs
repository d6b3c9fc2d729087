//! Equal batch counts despite skipped items ([`LoaderBuilder::fill_skipped`]).
//!
//! A skipped item shifts the batches after it, so a rank whose items failed can end its
//! epoch a batch (or more) short of its peers: with a collective per training step (DDP)
//! the other ranks then wait forever at the last step. With `fill_skipped`, a loader counts
//! the batches its epoch owes from the epoch's start (or from a resumed position: what that
//! rank would make with no item skipped) and, when its own items run out first, makes up the
//! rest from items the epoch already delivered, read again — the first ones first, as the
//! sampler pads uneven shares — in one extra pipeline per round that resumes a checkpoint in
//! which everything but those positions is delivered (the mechanism units use). A round whose
//! items fail too is followed by another from the next positions; once every delivered
//! position has failed since the last batch made, the epoch ends short (nothing readable is
//! left to fill with).
//!
//! A checkpoint taken while batches are made up is the current round's progress: every
//! position delivered but the round's fillers not delivered yet, so a loader resuming it owes
//! exactly the batches still to make up and reads the same fillers for them.
//!
//! [`LoaderBuilder::fill_skipped`]: super::LoaderBuilder::fill_skipped

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::Duration;

use flowgate_actors::error::PipelineError;
use flowgate_actors::origin::RangeSet;

use super::assemble::Learned;
use super::{units, Batch, Loader};
use crate::engine::checkpoint::PipelineState;
use crate::engine::pipeline::{Pipeline, Within};

/// The batches an epoch owes, counted when it starts.
#[derive(Clone, Copy, Debug, Default)]
pub(super) struct Owed {
    /// Batches the epoch makes from its start (after a resume: from the resumed position)
    /// with nothing skipped.
    pub(super) batches: usize,
    /// Items in the last of them (a batch's size, or less for a short last batch).
    last: usize,
}

impl Owed {
    /// What an epoch starting at `start` owes in batches of `per_batch`: what a state taken
    /// by a filling loader says it owes, else what the positions not delivered make.
    pub(super) fn of(start: &PipelineState, per_batch: usize, drop_last: bool) -> Self {
        let len = start.shard.as_ref().map_or(0, |s| s.layout().len() as u64) as usize;
        let (items, batches) = match start.owed_batches {
            // Whole batches but the epoch's last, which has what the rank's share leaves.
            Some(n) => (len, n as usize),
            None => {
                let items = len.saturating_sub(start.delivered_items as usize);
                (items, super::units::batches_of(items, per_batch, drop_last))
            }
        };
        let last = match items % per_batch {
            0 => per_batch,
            _ if drop_last => per_batch,
            r => r,
        };
        Self { batches, last }
    }

    /// What reader `r` of `n` owes of these batches (see
    /// [`LoaderBuilder::reader`](super::LoaderBuilder::reader)): batches `r`, `r + n`, …,
    /// the last holding the epoch's last batch's items if it is the reader's.
    pub(super) fn reader(self, r: usize, n: usize) -> Self {
        let n = n.max(1);
        let batches = self.batches / n + usize::from(r < self.batches % n);
        let owns_last = self.batches > 0 && (self.batches - 1) % n == r;
        Self {
            batches,
            last: if owns_last { self.last } else { usize::MAX },
        }
    }

    /// The items of batches `from..` of the epoch.
    fn items_after(&self, from: usize, per_batch: usize) -> usize {
        (from..self.batches)
            .map(|k| {
                if k + 1 == self.batches {
                    self.last.min(per_batch)
                } else {
                    per_batch
                }
            })
            .sum()
    }
}

/// A loader's part in making up batches lost to skipped items.
#[derive(Default)]
pub(super) struct Fill {
    /// The batches the epoch being iterated owes.
    pub(super) owed: Owed,
    /// Making them up, after the epoch's own items ran out.
    pub(super) filling: Option<Filling>,
    /// The epoch's state after its last batch so far (at its end the pipeline's state
    /// already names the next epoch).
    pub(super) from: Option<PipelineState>,
    /// The batches the resumed state owes, if it says.
    pub(super) resumed_owed: Option<u64>,
    /// A reader's part: the positions its start marks delivered (the other readers'), which
    /// it fills from only when it delivered nothing itself (they may be unreadable).
    pub(super) marked: Option<Vec<(u64, u64)>>,
    /// Items read again in the epoch being iterated (or the last); shared with watches.
    pub(super) filled: Arc<AtomicU64>,
    /// The batches made up are an epoch of units' ([`Loader::finish_units`]): the loader's
    /// own pipeline never ran that epoch, so the next starts afresh after it.
    pub(super) after_units: bool,
}

impl Fill {
    /// Starts an epoch at `start`: what it owes, and (after a resume) the positions the run
    /// it resumes delivered, to fill from until it delivers more itself.
    /// A reader reading its `part` of the epoch (see
    /// [`LoaderBuilder::reader`](super::LoaderBuilder::reader)) owes its part of what its
    /// rank's epoch owes from `start`, and fills from `from` (its reader state: the other
    /// readers' positions count as delivered, so a reader whose own items all failed makes up
    /// from its rank's other batches).
    pub(super) fn start_epoch(
        &mut self,
        start: &PipelineState,
        from: PipelineState,
        b: &units::Batching,
        part: bool,
    ) {
        self.filled.store(0, Ordering::Relaxed);
        self.from = None;
        self.marked = None;
        self.after_units = false;
        if b.fill {
            if part {
                self.marked = Some(from.delivered.clone());
            }
            let owed = Owed::of(start, b.per_batch, b.drop_last);
            self.owed = match b.reader {
                Some((r, n)) if part => owed.reader(r, n),
                _ => owed,
            };
            self.from = Some(from);
        }
    }
}

/// Making up an epoch's batches after its own items ran out.
pub(super) struct Filling {
    /// The epoch's state when its own items ran out.
    end: PipelineState,
    /// The positions it delivered (sorted ranges): what fillers are read from.
    delivered: Vec<(u64, u64)>,
    /// How many positions that is.
    count: usize,
    /// Fillers taken so far (the next is the `taken % count`-th delivered position).
    taken: usize,
    /// Batches the current round delivered.
    round_batches: usize,
    /// Fillers taken since a round last made a batch.
    barren: usize,
    /// The pipeline of the current round.
    pipeline: Pipeline<Batch>,
    /// Fillers read per filler needed: 1, or [`UNVERIFIED_WIDEN`] when the fillers were not
    /// delivered by this loader (they may fail) and a short batch is dropped.
    widen: usize,
}

/// How many more fillers a round reads when they may be unreadable and a short batch is
/// dropped (`drop_last`): a reader that delivered nothing fills from its rank's other
/// positions, some of which may fail, and a round of exactly a batch's worth would then be
/// dropped again and again. The batches past what is owed are not delivered.
const UNVERIFIED_WIDEN: usize = 4;

impl Filling {
    /// `n` delivered positions from the `from`-th on, wrapping around to the first (as
    /// one-position ranges; `n` at most their count). One walk of the ranges.
    fn positions(&self, from: usize, n: usize) -> Vec<(u64, u64)> {
        let all = || {
            self.delivered
                .iter()
                .flat_map(|&(a, b)| a..b)
                .map(|p| (p, p + 1))
        };
        all().skip(from).chain(all()).take(n).collect()
    }

    /// The epoch's progress while batches are made up: what the epoch delivered but the
    /// current round's fillers not delivered yet, so a loader that resumes it (with the
    /// batches still owed) reads those fillers first. Positions that failed stay undelivered
    /// (the round only skipped them): a resume tries them again, and never takes them as
    /// fillers.
    pub(super) fn progress(&self) -> PipelineState {
        let round = self.pipeline.state();
        // The round's delivered positions are every one but its fillers, plus the fillers
        // delivered; of them, those the epoch had delivered (the fillers are).
        let not_before = units::minus(&round.delivered, &self.end.delivered);
        let not_before: Vec<_> = not_before.ranges().collect();
        let delivered = units::minus(&round.delivered, &not_before);
        PipelineState {
            delivered: delivered.ranges().collect(),
            delivered_items: delivered.len(),
            ..round
        }
    }

    /// The state that makes a pipeline read exactly `n` fillers (the next, wrapping around
    /// the delivered positions): every other position delivered.
    fn next_round(&mut self, n: usize) -> PipelineState {
        let len = self
            .end
            .shard
            .as_ref()
            .map_or(0, |s| s.layout().len() as u64);
        let n = n.min(self.count);
        self.barren = if self.round_batches > 0 {
            n
        } else {
            self.barren + n
        };
        let picks = RangeSet::from_ranges(self.positions(self.taken % self.count.max(1), n));
        self.taken += n;
        let others = units::minus(&[(0, len)], &picks.ranges().collect::<Vec<_>>());
        PipelineState {
            delivered: others.ranges().collect(),
            delivered_items: others.len(),
            partial: Vec::new(),
            ..self.end.clone()
        }
    }
}

impl Loader {
    /// `s` (this loader's progress in the epoch being iterated) with the batches it still
    /// owes, for a loader that fills.
    pub(super) fn with_owed(&self, mut s: PipelineState) -> PipelineState {
        if self.batching.fill {
            let left = self.fill.owed.batches.saturating_sub(self.passes.taken());
            s.owed_batches = Some(left as u64);
        }
        s
    }

    /// Whether the epoch whose own items just ran out owes batches to make up.
    pub(super) fn owes_batches(&self) -> bool {
        self.batching.fill && self.passes.taken() < self.fill.owed.batches
    }

    /// Items the batches still owed hold.
    fn owed_items(&self) -> usize {
        self.fill
            .owed
            .items_after(self.passes.taken(), self.batching.per_batch)
    }

    /// Notes what the epoch has delivered after each of its own batches (with
    /// `fill_skipped`): at its end the pipeline's state already names the next epoch.
    pub(super) fn note_delivered(&mut self) {
        if self.batching.fill {
            self.fill.from = self.pipeline.as_ref().map(Pipeline::state);
        }
    }

    /// Starts making up the owed batches (the epoch's own pipeline has ended it).
    pub(super) fn start_filling(&mut self) -> Result<(), PipelineError> {
        let Some(end) = self.fill.from.take().filter(|s| s.delivered_items > 0) else {
            return Ok(()); // nothing delivered to fill with
        };
        let learned = match &self.pipeline {
            Some(main) => Learned::of(&main.stats()),
            None => self.learned.clone(),
        };
        let mut delivered = RangeSet::from_ranges(end.delivered.iter().copied());
        let mut widen = 1;
        if let Some(marked) = &self.fill.marked {
            // A reader fills from what it delivered itself (readable), or, having delivered
            // nothing, from its rank's other positions (which may fail).
            let own = units::minus(&end.delivered, marked);
            if !own.is_empty() {
                delivered = own;
            } else if self.batching.drop_last {
                widen = UNVERIFIED_WIDEN;
            }
        }
        let mut f = Filling {
            end,
            count: delivered.len() as usize,
            delivered: delivered.ranges().collect(),
            taken: 0,
            round_batches: 0,
            barren: 0,
            pipeline: (self.make)(learned.as_ref())?,
            widen,
        };
        let state = f.next_round(self.owed_items() * widen);
        f.pipeline.resume(&state)?;
        self.fill.filling = Some(f);
        Ok(())
    }

    /// The next made-up batch, like [`next_within`](Self::next_within).
    pub(super) fn next_filler(&mut self, timeout: Duration) -> Within<Batch> {
        loop {
            if self.passes.taken() >= self.fill.owed.batches {
                // All owed: a widened round's further batches are not delivered.
                return self.end_filled_epoch();
            }
            let f = self.fill.filling.as_mut().expect("filling");
            match f.pipeline.next_within(timeout) {
                Within::Next(Ok(b)) => {
                    f.round_batches += 1;
                    self.passes.took();
                    self.fill
                        .filled
                        .fetch_add(b.len() as u64, Ordering::Relaxed);
                    return Within::Next(Ok(b));
                }
                Within::Next(Err(e)) => {
                    self.fill.filling = None;
                    self.end_after_error();
                    return Within::Next(Err(e));
                }
                Within::EpochEnd => {
                    // Another round unless every delivered position failed since the last
                    // batch made (nothing readable is left to fill with).
                    let more = f.round_batches > 0 || f.barren < f.count;
                    if more && self.passes.taken() < self.fill.owed.batches {
                        if let Err(e) = self.fill_again() {
                            self.fill.filling = None;
                            self.end_after_error();
                            return Within::Next(Err(e));
                        }
                        continue;
                    }
                    return self.end_filled_epoch();
                }
                other => return other,
            }
        }
    }

    /// The epoch whose batches were made up ended.
    fn end_filled_epoch(&mut self) -> Within<Batch> {
        let epoch = self.fill.filling.take().map(|f| f.end.epoch);
        self.passes.ended();
        self.report_epoch();
        if std::mem::take(&mut self.fill.after_units) {
            // The pipeline never ran that epoch (its units were decoded elsewhere): the next
            // one starts afresh.
            self.stop(false);
            if let Some(e) = epoch {
                self.passes.set_next(e + 1);
            }
        }
        Within::EpochEnd
    }

    /// Another round: the fillers after the last round's, for the batches still owed.
    fn fill_again(&mut self) -> Result<(), PipelineError> {
        let n = self.owed_items();
        let learned = self.learned.clone();
        let f = self.fill.filling.as_mut().expect("filling");
        let state = f.next_round(n * f.widen);
        let mut p = (self.make)(learned.as_ref())?;
        p.resume(&state)?;
        f.pipeline = p;
        f.round_batches = 0;
        Ok(())
    }

    /// Items this loader read again to make up batches lost to skipped items, in the epoch
    /// being iterated or the last one ([`LoaderBuilder::fill_skipped`](super::LoaderBuilder::fill_skipped)).
    pub fn filled(&self) -> u64 {
        self.fill.filled.load(Ordering::Relaxed)
    }
}
