//! [`LoaderWatch`]: what another thread may read of a loader while it waits for a batch.

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};

use super::failures::{FailureLog, SkippedFailure};
#[cfg(doc)]
use super::{Loader, KEEP_FAILURES};
use crate::engine::stats::Monitor;

/// What another thread may read of a loader while it waits for a batch: the running
/// pipeline's monitor and the failures skipped. Cheap to clone.
#[derive(Clone, Debug)]
pub struct LoaderWatch {
    pub(super) monitor: Arc<Mutex<Option<Monitor>>>,
    pub(super) failures: FailureLog,
    pub(super) filled: Arc<AtomicU64>,
}

impl LoaderWatch {
    /// Items read again to make up batches lost to skipped items in the epoch being iterated
    /// (or the last one; see [`Loader::filled`]).
    pub fn filled(&self) -> u64 {
        self.filled.load(Ordering::Relaxed)
    }

    /// The running pipeline's monitor (statistics, tuner trace, epoch), if one runs.
    pub fn monitor(&self) -> Option<Monitor> {
        self.monitor.lock().expect("monitor").clone()
    }

    /// The failures skipped in `epoch` (default: the epoch started last), of the last
    /// [`KEEP_FAILURES`].
    pub fn failures(&self, epoch: Option<u64>) -> Vec<SkippedFailure> {
        self.failures
            .of(epoch.unwrap_or_else(|| self.failures.epoch()))
    }
}
