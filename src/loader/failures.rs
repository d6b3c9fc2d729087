//! The failures a loader skipped ([`SkippedFailure`]), kept per epoch, the last
//! [`KEEP_FAILURES`] of them: what a user lists after an epoch to see which items were left
//! out and why.
//!
//! The log also keeps the first failure until it is said ([`FailureLog::take_first`]; what is
//! said, and when, is `report`).

use std::collections::VecDeque;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex};

use flowgate_actors::error::ItemError;

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

/// The failures a loader skipped, shared with the pipelines' failure hooks: counted per
/// epoch, the last [`KEEP_FAILURES`] kept, and the first said once (see the [module
/// docs](self)). Every route keeps one: the library's loader and the Python `DataLoader`.
#[derive(Clone, Debug, Default)]
pub struct FailureLog(Arc<Inner>);

#[derive(Debug, Default)]
struct Inner {
    kept: Mutex<VecDeque<SkippedFailure>>,
    /// The epoch started last: failures from now on are counted in it.
    epoch: AtomicU64,
    /// Failures in that epoch, and the last one (stage, item, message).
    count: AtomicU64,
    last: Mutex<Option<ItemError>>,
    /// Whether a failure was recorded: the first is kept in `first` until it is said.
    said: AtomicBool,
    /// Failures end the pipeline (fail-fast): none is skipped, none is said to be.
    fatal: AtomicBool,
    first: Mutex<Option<SkippedFailure>>,
    /// `first` holds a failure: read without the lock at every result (most have none).
    pending: AtomicBool,
}

impl FailureLog {
    /// A log of a pipeline whose first failure ends it (a fail-fast budget): its failures are
    /// counted and kept, never said to be skipped.
    pub fn fail_fast() -> Self {
        let log = Self::default();
        log.0.fatal.store(true, Ordering::Relaxed);
        log
    }

    /// Failures from now on happened in `epoch`.
    pub fn set_epoch(&self, epoch: u64) {
        self.0.epoch.store(epoch, Ordering::Relaxed);
        self.0.count.store(0, Ordering::Relaxed);
        *self.0.last.lock().expect("failures") = None;
    }

    /// Failures since the epoch started, and the last one.
    pub fn in_epoch(&self) -> (u64, Option<ItemError>) {
        let last = self.0.last.lock().expect("failures").clone();
        (self.0.count.load(Ordering::Relaxed), last)
    }

    /// The epoch failures are counted in now.
    pub fn epoch(&self) -> u64 {
        self.0.epoch.load(Ordering::Relaxed)
    }

    /// Counts and keeps `e`, a failed item; the log's first is kept for
    /// [`take_first`](Self::take_first).
    pub fn record(&self, e: &ItemError) {
        self.0.count.fetch_add(1, Ordering::Relaxed);
        *self.0.last.lock().expect("failures") = Some(e.clone());
        let failure = SkippedFailure {
            epoch: self.epoch(),
            stage: e.stage().to_owned(),
            item: e.item().to_owned(),
            message: e.to_string(),
        };
        if !self.0.fatal.load(Ordering::Relaxed) && !self.0.said.swap(true, Ordering::Relaxed) {
            *self.0.first.lock().expect("failures") = Some(failure.clone());
            self.0.pending.store(true, Ordering::Release);
        }
        let mut kept = self.0.kept.lock().expect("failures");
        if kept.len() == KEEP_FAILURES {
            kept.pop_front();
        }
        kept.push_back(failure);
    }

    /// The first failure this log recorded, once (then `None`), logged as a `tracing` warning
    /// and with the sentence a front end says of it
    /// ([`first_skip_message`]). Called where the
    /// pipeline went on past it (a batch delivered after it, an epoch's end): the item was
    /// skipped. A front end says it on the consumer's thread, where a Python warning can be
    /// filtered as usual.
    pub fn take_first(&self) -> Option<(SkippedFailure, String)> {
        // Called at every result: no lock unless a failure waits to be said.
        if !self.0.pending.swap(false, Ordering::AcqRel) {
            return None;
        }
        let f = self.0.first.lock().expect("failures").take()?;
        let message = first_skip_message(&f);
        tracing::warn!(epoch = f.epoch, stage = %f.stage, item = %f.item, "{message}");
        Some((f, message))
    }

    /// The failure kept to be said first ended the pipeline (fail-fast, a budget run out): it
    /// was not skipped, so it is not said; the next failure recorded is the first again.
    pub fn forget_first(&self) {
        self.0.pending.store(false, Ordering::Relaxed);
        *self.0.first.lock().expect("failures") = None;
        self.0.said.store(false, Ordering::Relaxed);
    }

    /// A failure another loader skipped in this epoch (a unit decoded elsewhere), counted
    /// and kept as one of this epoch's.
    pub(crate) fn record_skipped(&self, f: SkippedFailure) {
        // Its message says the stage and the item before the cause.
        let prefix = format!("stage `{}` failed on {}: ", f.stage, f.item);
        let cause = f.message.strip_prefix(&prefix).unwrap_or(&f.message);
        self.record(&ItemError::new(
            f.stage.as_str().into(),
            f.item.clone(),
            cause.to_owned().into(),
        ));
    }

    /// The failures kept of `epoch`.
    pub fn of(&self, epoch: u64) -> Vec<SkippedFailure> {
        let kept = self.0.kept.lock().expect("failures");
        kept.iter().filter(|f| f.epoch == epoch).cloned().collect()
    }
}

/// What is said of a loader's first skipped item: the item, why, and where to read the rest.
pub fn first_skip_message(f: &SkippedFailure) -> String {
    format!(
        "flowgate skipped an item it could not read (skip_errors): {}. This is said once a \
         loader; failures() lists every skipped item of an epoch, and each epoch's end says \
         how many",
        f.message
    )
}
