//! What a loader says of the items it skipped, without being asked, in every route: the first
//! item it skips is said once, with its reason, at the batch after it (or the epoch's end),
//! once the pipeline has gone on past it (a failure that ends the epoch, fail-fast, was not
//! skipped and is not said so); an epoch that skipped items, or delivered another number of
//! batches than were due (`len()`, or the rest of a resumed epoch), ends with an
//! [`EpochReport`]. Both are `tracing` warnings, kept for the front end to say in its own words
//! (Python: a `SkippedItemsWarning` at the user's loop).

use std::sync::atomic::Ordering;

use super::failures::SkippedFailure;
use super::{Batch, Loader};
use crate::engine::checkpoint::PipelineState;
use crate::engine::pipeline::Within;

impl Loader {
    /// What the last epoch that ended said of its skipped items and its batch count (see
    /// [`EpochReport`]; logged as a `tracing` warning when it ended), once: a front end says
    /// it in its own words.
    pub fn take_epoch_report(&mut self) -> Option<EpochReport> {
        self.report.take()
    }

    /// The loader's first skipped item and what is said of it, once, after the batch (or
    /// the epoch's end) that followed it (logged then as a `tracing` warning): a front end
    /// says it there.
    pub fn take_first_skip(&mut self) -> Option<(SkippedFailure, String)> {
        self.first_skip.take()
    }

    /// An epoch ended at its end: what it has to say is logged and kept for the front end.
    pub(super) fn report_epoch(&mut self) {
        if self.batching.decodes_units {
            return; // a unit's consumer counts its failures
        }
        let (skipped, _) = self.failures.in_epoch();
        let filled = self.fill.filled.load(Ordering::Relaxed);
        let epoch = self.failures.epoch();
        let (due, len) = (self.passes.due(), self.len());
        let delivered = self.passes.taken();
        self.report = EpochReport::of(epoch, skipped, delivered, due, len, filled);
        if let Some(r) = &self.report {
            tracing::warn!(epoch, skipped, delivered = r.delivered, "{r}");
        }
    }

    /// After a pass's step: past the first failure (a batch or an epoch's end came), it was
    /// skipped, and is said now; a failure that ended the epoch was not skipped.
    pub(super) fn note_first_skip(&mut self, got: &Within<Batch>) {
        match got {
            Within::Next(Ok(_)) | Within::EpochEnd => {
                if let Some(first) = self.failures.take_first() {
                    self.first_skip = Some(first);
                }
            }
            Within::Next(Err(_)) => self.failures.forget_first(),
            Within::TimedOut => {}
        }
    }
}

/// What an epoch delivered, said at its end when it skipped items or delivered another
/// number of batches than were due (see the [module docs](self)).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct EpochReport {
    /// The epoch.
    pub epoch: u64,
    /// Items skipped as unreadable in it.
    pub skipped: u64,
    /// Batches the pass delivered.
    pub delivered: usize,
    /// Batches the pass was to deliver with nothing skipped: `len()` for an epoch read from
    /// its start, the rest's for a resumed one.
    pub due: usize,
    /// Batches a whole epoch makes (`len()`).
    pub len: usize,
    /// Items read again to make up batches that skipped items cost (`fill_skipped`).
    pub filled: u64,
}

impl EpochReport {
    /// The report of a pass, if it has something to say: a skipped item, or a batch count
    /// other than the one due.
    pub fn of(
        epoch: u64,
        skipped: u64,
        delivered: usize,
        due: usize,
        len: usize,
        filled: u64,
    ) -> Option<Self> {
        (skipped > 0 || delivered != due).then_some(Self {
            epoch,
            skipped,
            delivered,
            due,
            len,
            filled,
        })
    }
}

/// The batches a pass that starts at `start` makes with nothing skipped, `per_batch`
/// positions to a batch: the rank's epoch from its beginning, or the rest of a resumed one.
pub fn batches_due(start: &PipelineState, per_batch: usize, drop_last: bool) -> usize {
    super::fill::Owed::of(start, per_batch.max(1), drop_last).batches
}

impl std::fmt::Display for EpochReport {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let s = |n: u64| if n == 1 { "" } else { "s" };
        write!(
            f,
            "flowgate: epoch {} skipped {} unreadable item{}",
            self.epoch,
            self.skipped,
            s(self.skipped)
        )?;
        if self.delivered == self.due {
            write!(f, "; it delivered {} batches", self.delivered)?;
        } else {
            let due = match self.due == self.len {
                true => format!("len() counts {}", self.len),
                false => format!(
                    "{} were due (the rest of a resumed epoch; len() counts {})",
                    self.due, self.len
                ),
            };
            write!(
                f,
                " and delivered {} batches where {due}: a batch is left out where skipped \
                 items leave it nothing, and batches made after a skip are fewer \
                 (fill_skipped makes them up; it is on under a world size above 1)",
                self.delivered
            )?;
        }
        if self.filled > 0 {
            write!(
                f,
                ", {} item{} read again to make them up",
                self.filled,
                s(self.filled)
            )?;
        }
        write!(f, ". failures() lists the skipped items and why")
    }
}
