//! The failures a loader skipped ([`SkippedFailure`]), kept per epoch, the last
//! [`KEEP_FAILURES`] of them: what a user lists after an epoch to see which items were left
//! out and why.

use std::collections::VecDeque;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};

/// The most skipped failures a loader keeps (older ones are forgotten; the pipeline's
/// counters still count them).
pub const KEEP_FAILURES: usize = 1000;

/// One item a loader skipped.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct SkippedFailure {
    /// The epoch it happened in.
    pub epoch: u64,
    /// The stage it failed in (`decode`, `collate`).
    pub stage: String,
    /// The item: its path, or `SHARD:KEY`.
    pub item: String,
    /// Why, with the cause chain.
    pub message: String,
}

/// The failures a loader skipped, shared with the pipelines' failure hooks.
#[derive(Clone, Debug, Default)]
pub(crate) struct FailureLog(Arc<Inner>);

#[derive(Debug, Default)]
struct Inner {
    kept: Mutex<VecDeque<SkippedFailure>>,
    /// The epoch started last: failures from now on are counted in it.
    epoch: AtomicU64,
    /// Failures in that epoch, and the last one (stage, item, message).
    count: AtomicU64,
    last: Mutex<Option<crate::ItemError>>,
}

impl FailureLog {
    /// Failures from now on happened in `epoch`.
    pub(crate) fn set_epoch(&self, epoch: u64) {
        self.0.epoch.store(epoch, Ordering::Relaxed);
        self.0.count.store(0, Ordering::Relaxed);
        *self.0.last.lock().expect("failures") = None;
    }

    /// Failures since the epoch started, and the last one.
    pub(crate) fn in_epoch(&self) -> (u64, Option<crate::ItemError>) {
        let last = self.0.last.lock().expect("failures").clone();
        (self.0.count.load(Ordering::Relaxed), last)
    }

    /// The epoch failures are counted in now.
    pub(crate) fn epoch(&self) -> u64 {
        self.0.epoch.load(Ordering::Relaxed)
    }

    pub(crate) fn record(&self, e: &crate::ItemError) {
        self.0.count.fetch_add(1, Ordering::Relaxed);
        *self.0.last.lock().expect("failures") = Some(e.clone());
        let mut kept = self.0.kept.lock().expect("failures");
        if kept.len() == KEEP_FAILURES {
            kept.pop_front();
        }
        kept.push_back(SkippedFailure {
            epoch: self.epoch(),
            stage: e.stage().to_owned(),
            item: e.item().to_owned(),
            message: e.to_string(),
        });
    }

    /// A failure another loader skipped in this epoch (a unit decoded elsewhere), counted
    /// and kept as one of this epoch's.
    pub(crate) fn record_skipped(&self, f: SkippedFailure) {
        // Its message says the stage and the item before the cause.
        let prefix = format!("stage `{}` failed on {}: ", f.stage, f.item);
        let cause = f.message.strip_prefix(&prefix).unwrap_or(&f.message);
        self.record(&crate::ItemError::new(
            f.stage.as_str().into(),
            f.item.clone(),
            cause.to_owned().into(),
        ));
    }

    /// The failures kept of `epoch`.
    pub(crate) fn of(&self, epoch: u64) -> Vec<SkippedFailure> {
        let kept = self.0.kept.lock().expect("failures");
        kept.iter().filter(|f| f.epoch == epoch).cloned().collect()
    }
}
