//! Work units: an epoch's batches cut into runs that another process decodes alone (a pool of
//! Ray actors, in the Python package), with the checkpoint the consumer's process keeps.
//!
//! An [`EpochPlan`] is made by the loader that *plans* (the training process's): the epoch
//! its next [`start_epoch`](super::Loader::start_epoch) would run, the positions of this
//! rank's share still to deliver (after a resume, the rest), and how they fall into batches.
//! Unit `u` is batches `[u·k, (u+1)·k)` of that list, all of it (with `drop_last` too: the
//! consumer drops the epoch's last partial batch, after items skipped as unreadable have been
//! made up from the next ones). [`EpochPlan::unit_state`] is a checkpoint in which everything
//! but the unit's positions is delivered: a loader built with the same arguments (and the same
//! rank and world size, and [`decodes_units`](super::LoaderBuilder::decodes_units)) that
//! resumes it decodes exactly the unit, with the same order, batches and augmentation as the
//! planning loader would, so a unit is a pure function of (dataset, seed, epoch, unit) and a
//! unit lost with its worker is simply decoded again. [`EpochPlan::state_with`] is the
//! planning loader's checkpoint once the consumer has received given positions (each batch's
//! positions: [`PipelineState::delivered_since`] of the worker's states before and after it):
//! the same [`PipelineState`] a local loader would record, so it resumes locally or remotely.
//!
//! A skipped item leaves its unit's batch one short; a consumer that regroups the rows of the
//! units' batches into batches of the batch size (in input order) gets the local loader's
//! batches exactly, as the Python package's remote mode does.

use flowgate_actors::error::PipelineError;
use flowgate_actors::origin::RangeSet;

use super::{Loader, SkippedFailure};
use crate::engine::checkpoint::PipelineState;

/// The epoch a planning loader runs next, cut into units; see the [module docs](self).
#[derive(Clone, Debug)]
pub struct EpochPlan {
    /// The state the epoch starts from (what was delivered before it, after a resume).
    start: PipelineState,
    /// The rank's local positions not yet delivered, in the order they are read.
    todo: Vec<u64>,
    /// Positions per batch (1 for length-aware batches: a position is a batch).
    per_batch: usize,
    /// Batches per unit.
    per_unit: usize,
    /// Whether a last partial batch is dropped.
    drop_last: bool,
}

/// One unit of an [`EpochPlan`]: its batches and the positions they read.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Unit {
    /// Its index in the epoch's units.
    pub index: usize,
    /// Its first batch in the epoch (as the planning loader counts them after a resume).
    pub first_batch: usize,
    /// Its batches (the last unit may have fewer than the plan's per-unit count).
    pub batches: usize,
    /// The rank's local positions it reads.
    pub positions: RangeSet,
}

/// How a loader's epoch falls into batches, and whether it decodes units of another's plan.
#[derive(Clone, Copy, Debug)]
pub(super) struct Batching {
    /// Positions per batch (1 for length-aware batches: a position is a batch).
    pub(super) per_batch: usize,
    /// Whether a last partial batch is dropped.
    pub(super) drop_last: bool,
    /// Whether it decodes units (see [`LoaderBuilder::decodes_units`](super::LoaderBuilder::decodes_units)):
    /// a unit whose items all fail is then no error (its consumer counts the failures).
    pub(super) decodes_units: bool,
    /// Why its epochs cannot be cut into units decoded elsewhere, if they cannot (what units
    /// do not carry: see [`LoaderBuilder::plans_units`](super::LoaderBuilder::plans_units)).
    pub(super) units_refusal: Option<&'static str>,
    /// Whether batches lost to skipped items are made up at the epoch's end
    /// ([`LoaderBuilder::fill_skipped`](super::LoaderBuilder::fill_skipped)).
    pub(super) fill: bool,
    /// `(r, n)`: this loader reads reader `r`'s part of its rank's epochs, split among `n`
    /// readers ([`LoaderBuilder::reader`](super::LoaderBuilder::reader)).
    pub(super) reader: Option<(usize, usize)>,
}

/// Batches `items` items make, `per_batch` to a batch: a last partial batch counts unless
/// `drop_last`. The one count of an epoch's batches (a rank's, a reader's, a unit plan's, a
/// map-style dataset's in Python).
///
/// ```
/// use flowgate::loader::batches_of;
/// assert_eq!(batches_of(41, 5, false), 9); // the last batch holds 1
/// assert_eq!(batches_of(41, 5, true), 8);
/// assert_eq!(batches_of(40, 5, false), batches_of(40, 5, true));
/// assert_eq!((batches_of(4, 5, false), batches_of(4, 5, true)), (1, 0));
/// assert_eq!(batches_of(0, 5, false), 0);
/// ```
pub const fn batches_of(items: usize, per_batch: usize, drop_last: bool) -> usize {
    if drop_last {
        items / per_batch
    } else {
        items.div_ceil(per_batch)
    }
}

impl Batching {
    /// Of `batches` (the rank's, numbered from 0), how many fall to this loader: every one,
    /// or with a reader split `(r, n)` batches `r`, `r + n`, …
    pub(super) fn mine(&self, batches: usize) -> usize {
        match self.reader {
            Some((r, n)) => batches / n + usize::from(r < batches % n),
            None => batches,
        }
    }
}

impl Loader {
    /// The epoch the next [`start_epoch`](Self::start_epoch) would run (the resumed one
    /// after [`resume`](Self::resume), an abandoned one again), cut into units of `batches_per_unit` batches, for
    /// other processes to decode (see [`units`](self)). Refused while an epoch is iterated.
    pub fn plan_units(&mut self, batches_per_unit: usize) -> Result<EpochPlan, PipelineError> {
        if self.passes.in_epoch() {
            return Err(PipelineError::config(
                "plan_units: an epoch is being iterated; plan the next one between epochs",
            ));
        }
        flowgate_actors::limits::BATCHES_PER_UNIT
            .check_usize(batches_per_unit)
            .map_err(|e| PipelineError::config(format!("plan_units: {e}")))?;
        if let Some(why) = self.batching.units_refusal {
            return Err(PipelineError::config(format!("plan_units: {why}")));
        }
        let start = match self.passes.restart_from() {
            // An abandoned epoch, again from where it started.
            Some(s) => s.clone(),
            None => self.next_state()?,
        };
        EpochPlan::new(start, &self.batching, batches_per_unit)
    }
}

/// An epoch a loader iterates as units decoded elsewhere (see [`Loader::start_units`]): its
/// plan and the positions its consumer received.
#[derive(Debug)]
pub(super) struct UnitsEpoch {
    plan: EpochPlan,
    received: RangeSet,
}

impl UnitsEpoch {
    /// The checkpoint now: what the consumer received, besides what was before the epoch.
    pub(super) fn state(&self) -> PipelineState {
        self.plan.state_with(&self.received)
    }
}

impl Loader {
    /// Starts the epoch the next [`start_epoch`](Self::start_epoch) would run (an epoch being
    /// iterated is abandoned first), to be decoded elsewhere as the units of the plan it
    /// returns (see [`units`](self)), and iterated by the caller: it reports each batch it
    /// hands on ([`units_delivered`](Self::units_delivered)), the failures the units skipped
    /// ([`units_failed`](Self::units_failed)) and the epoch's end
    /// ([`finish_units`](Self::finish_units)). The loader keeps that epoch as one of its own:
    /// [`state`](Self::state) is the checkpoint of what was delivered, the failures are the
    /// epoch's, and a stop before the end ([`close`](Self::close),
    /// [`set_epoch`](Self::set_epoch), [`resume`](Self::resume), another start) abandons it
    /// as a local epoch is abandoned ([`abandoned_epoch`](Self::abandoned_epoch); the next
    /// start begins it again from where it started).
    pub fn start_units(&mut self, batches_per_unit: usize) -> Result<EpochPlan, PipelineError> {
        if self.passes.in_epoch() {
            self.close();
        }
        if let Some(epoch) = self.passes.take_named() {
            self.close();
            self.passes.set_next(epoch);
        }
        let plan = self.plan_units(batches_per_unit)?;
        // An abandoned epoch is started again from the plan's start (its units are not this
        // pipeline's).
        let _ = self.passes.take_restart();
        let due = self.due_from(&plan.start);
        self.started(plan.start.clone(), due, plan.epoch());
        // What the epoch owes, made up here once its units are delivered (`fill_skipped`).
        self.fill
            .start_epoch(&plan.start, plan.start.clone(), &self.batching, false);
        self.units = Some(UnitsEpoch {
            plan: plan.clone(),
            received: RangeSet::default(),
        });
        Ok(plan)
    }

    /// A batch of the epoch of units reached its consumer, its rows the positions
    /// `positions` (a no-op without such an epoch).
    pub fn units_delivered(&mut self, positions: &RangeSet) {
        if let Some(u) = &mut self.units {
            u.received = RangeSet::from_ranges(u.received.ranges().chain(positions.ranges()));
            self.passes.took();
        }
    }

    /// Items the units of the epoch skipped as unreadable (their loaders'
    /// [`failures`](super::LoaderWatch::failures)): counted and kept as the epoch's own.
    pub fn units_failed(&mut self, failures: impl IntoIterator<Item = SkippedFailure>) {
        if self.units.is_some() {
            for f in failures {
                self.failures.record_skipped(f);
            }
        }
    }

    /// The epoch of units ended by an error (a unit that failed with failures fatal): over,
    /// as a local epoch an error ends; the next start is the next epoch. A no-op without an
    /// epoch of units.
    pub fn fail_units(&mut self) {
        if let Some(epoch) = self.units.as_ref().map(|u| u.plan.epoch()) {
            self.end_after_error();
            self.passes.set_next(epoch + 1);
        }
    }

    /// Every unit's batches of the epoch were delivered. With
    /// [`fill_skipped`](super::LoaderBuilder::fill_skipped), an epoch whose skipped items
    /// cost batches makes them up here, as a local one does: `Ok(true)`, and the consumer
    /// takes them with [`next_within`](Self::next_within) (decoded by this loader). Otherwise
    /// the epoch ended (`Ok(false)`) and the next start is the next epoch; an epoch in which
    /// every item failed ends with an error, as a local one does
    /// ([`PipelineError::is_nothing_delivered`]). A no-op when no epoch of units is iterated
    /// (it was abandoned).
    pub fn finish_units(&mut self) -> Result<bool, PipelineError> {
        let Some(u) = self.units.take() else {
            return Ok(false);
        };
        let epoch = u.plan.epoch();
        if self.owes_batches() {
            self.fill.from = Some(u.state());
            if let Err(e) = self.start_filling() {
                self.end_after_error();
                return Err(e);
            }
            if self.fill.filling.is_some() {
                self.fill.after_units = true;
                return Ok(true);
            }
        }
        self.passes.ended();
        self.stop(false);
        self.passes.set_next(epoch + 1);
        let (failures, last) = self.failures.in_epoch();
        let whole = self.passes.whole();
        let any = self.passes.taken() > 0;
        match PipelineError::if_nothing_delivered(epoch, whole, any, failures, last) {
            Some(e) => Err(e),
            None => Ok(false),
        }
    }
}

impl EpochPlan {
    /// The epoch that starts at `start` (a loader's next state), batched as `batching` says,
    /// in units of `per_unit` batches.
    pub(super) fn new(
        start: PipelineState,
        batching: &Batching,
        per_unit: usize,
    ) -> Result<Self, PipelineError> {
        let Some(shard) = &start.shard else {
            return Err(PipelineError::config(
                "this loader's source is not sampled, so its positions have no layout to plan",
            ));
        };
        let len = shard.layout().len() as u64;
        let done = RangeSet::from_ranges(start.delivered.iter().copied());
        let todo = (0..len).filter(|&p| !done.contains(p)).collect();
        Ok(EpochPlan {
            start,
            todo,
            per_batch: batching.per_batch,
            per_unit,
            drop_last: batching.drop_last,
        })
    }
}

impl EpochPlan {
    /// The epoch planned.
    pub fn epoch(&self) -> u64 {
        self.start.epoch
    }

    /// Batches left in the epoch, as the local loader counts them (a last partial batch
    /// dropped with `drop_last`), when no item is skipped.
    pub fn batches(&self) -> usize {
        batches_of(self.todo.len(), self.per_batch, self.drop_last)
    }

    /// Positions per batch (1 for length-aware batches, whose positions are batches).
    pub fn per_batch(&self) -> usize {
        self.per_batch
    }

    /// Whether the epoch's last partial batch is dropped.
    pub fn drop_last(&self) -> bool {
        self.drop_last
    }

    /// The units' batches: every position left, a last partial batch included.
    fn unit_batches(&self) -> usize {
        self.todo.len().div_ceil(self.per_batch)
    }

    /// Units in the epoch.
    pub fn len(&self) -> usize {
        self.unit_batches().div_ceil(self.per_unit)
    }

    /// Whether nothing is left of the epoch.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// Unit `index` (`None` past the last).
    pub fn unit(&self, index: usize) -> Option<Unit> {
        if index >= self.len() {
            return None;
        }
        let first_batch = index * self.per_unit;
        let batches = self.per_unit.min(self.unit_batches() - first_batch);
        let a = first_batch * self.per_batch;
        let b = ((first_batch + batches) * self.per_batch).min(self.todo.len());
        Some(Unit {
            index,
            first_batch,
            batches,
            positions: RangeSet::from_ranges(self.todo[a..b].iter().map(|&p| (p, p + 1))),
        })
    }

    /// The checkpoint that makes a loader built like the planning one (same arguments, rank
    /// and world size) decode exactly `unit`: everything else in the epoch delivered.
    pub fn unit_state(&self, unit: &Unit) -> PipelineState {
        let len = self
            .start
            .shard
            .as_ref()
            .map_or(0, |s| s.layout().len() as u64);
        let unit_ranges: Vec<_> = unit.positions.ranges().collect();
        let others = minus(&[(0, len)], &unit_ranges);
        PipelineState {
            delivered: others.ranges().collect(),
            delivered_items: others.len(),
            partial: self
                .start
                .partial
                .iter()
                .copied()
                .filter(|&(p, _, _)| unit.positions.contains(p))
                .collect(),
            owed_batches: None,
            ..self.start.clone()
        }
    }

    /// The checkpoint that makes a loader built like the planning one (same arguments, rank
    /// and world size) read reader `reader`'s part of the epoch split among `readers`: batches
    /// `reader`, `reader + readers`, … of the plan (the epoch's last partial batch left out
    /// with `drop_last`), everything else delivered. Decoded in input order, its batches are
    /// the planning loader's batches of those numbers (an item skipped as unreadable leaves
    /// the reader's last batch short, and a reader keeps it: with `drop_last` the plan has cut
    /// the epoch's partial last batch already), so readers that take their batches in turn
    /// (PyTorch's `DataLoader` workers) give the planning loader's batches in its order.
    pub fn reader_state(&self, reader: usize, readers: usize) -> PipelineState {
        let whole = self.batches();
        let mine = (reader..whole).step_by(readers.max(1)).flat_map(|k| {
            let a = k * self.per_batch;
            let b = ((k + 1) * self.per_batch).min(self.todo.len());
            self.todo[a..b].iter().map(|&p| (p, p + 1))
        });
        let unit = Unit {
            index: reader,
            first_batch: reader,
            batches: whole.saturating_sub(reader).div_ceil(readers.max(1)),
            positions: RangeSet::from_ranges(mine),
        };
        self.unit_state(&unit)
    }

    /// The planning loader's checkpoint once the consumer has received the positions in
    /// `received` (of this epoch, besides what was delivered before it): what a local loader
    /// records when it has delivered them.
    pub fn state_with(&self, received: &RangeSet) -> PipelineState {
        let mut ranges = self.start.delivered.clone();
        ranges.extend(received.ranges());
        let done = RangeSet::from_ranges(ranges);
        PipelineState {
            delivered: done.ranges().collect(),
            delivered_items: done.len(),
            partial: self
                .start
                .partial
                .iter()
                .copied()
                .filter(|&(p, _, _)| !done.contains(p))
                .collect(),
            owed_batches: None,
            ..self.start.clone()
        }
    }

    /// The planning loader's checkpoint after the epoch's end: the next epoch, from its start.
    pub fn next_state(&self) -> PipelineState {
        next_epoch(&self.start)
    }
}

impl PipelineState {
    /// The positions delivered in `self` and not in `earlier` (a unit's progress: the state
    /// of the loader decoding it, against its [`unit_state`](EpochPlan::unit_state)).
    pub fn delivered_since(&self, earlier: &PipelineState) -> RangeSet {
        minus(&self.delivered, &earlier.delivered)
    }
}

/// The positions in the sorted ranges `a` and not in the sorted ranges `b`, in one walk of
/// both.
pub(super) fn minus(a: &[(u64, u64)], b: &[(u64, u64)]) -> RangeSet {
    let mut out = Vec::new();
    let mut j = 0;
    for &(lo, hi) in a {
        let mut at = lo;
        while j < b.len() && b[j].1 <= at {
            j += 1;
        }
        let mut k = j;
        while at < hi {
            match b.get(k) {
                Some(&(c, d)) if c < hi => {
                    if c > at {
                        out.push((at, c));
                    }
                    at = at.max(d);
                    k += 1;
                }
                _ => {
                    out.push((at, hi));
                    at = hi;
                }
            }
        }
    }
    RangeSet::from_ranges(out)
}

/// The state of the epoch after `s`'s, from its start (the rank's own place, no base).
pub(super) fn next_epoch(s: &PipelineState) -> PipelineState {
    s.next_epoch()
}
