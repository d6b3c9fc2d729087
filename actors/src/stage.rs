//! What every stage shares: its identity, metrics and failure accounting, and the control
//! interface the stage actor drives.

use std::sync::Arc;

use flowgate_tuner::{StageKind, StageStats};

use crate::channel::Budget;
use crate::error::{BoxError, ItemError};
use crate::failure::{FailureBudget, Failures, StageFailures};
use crate::metrics::{Counters, StageMetrics};

/// The control surface of a running stage. The stage actor forwards its messages here.
pub trait StageControl: Send + Sync + 'static {
    /// The stage's name.
    fn name(&self) -> &str;
    /// Sets the number of active workers (or concurrency); returns the number granted.
    fn resize(&self, workers: usize) -> usize;
    /// Sets the budget of items this stage may hold.
    fn set_budget(&self, items: usize, bytes: u64);
    /// Sets the byte capacity of the stage's cache (no-op for a stage without one).
    fn set_cache_bytes(&self, _bytes: u64) {}
    /// Sets how many objects the stage's read-ahead fetches ahead (no-op without one).
    fn set_read_ahead(&self, _depth: usize) {}
    /// Sets the threads each item started from now on may use (no-op without the knob).
    fn set_item_threads(&self, _threads: usize) {}
    /// The stage's statistics now.
    fn snapshot(&self) -> StageStats;
    /// Asks the stage's threads or tasks to exit (channels are closed separately).
    fn stop(&self);
    /// Waits for the stage's threads to exit.
    fn join(&self);
}

/// Identity, metrics and failure accounting of one stage.
#[derive(Debug)]
pub struct StageCore {
    /// The stage's name.
    pub name: Arc<str>,
    /// Shared counters.
    pub metrics: StageMetrics,
    /// This stage's failures.
    pub failures: StageFailures,
    /// The pipeline-wide ledger.
    pub ledger: Arc<Failures>,
    /// Whether the user pinned the stage's concurrency.
    pub pinned: bool,
    /// Whether the user pinned the stage's budget.
    pub budget_pinned: bool,
}

impl StageCore {
    /// A stage core.
    pub fn new(
        name: &str,
        kind: StageKind,
        budget: FailureBudget,
        ledger: Arc<Failures>,
        pinned: bool,
    ) -> Self {
        Self {
            name: Arc::from(name),
            metrics: StageMetrics::new(name, kind),
            failures: StageFailures::new(budget),
            ledger,
            pinned,
            budget_pinned: false,
        }
    }

    /// Marks the budget as set by the user (a tuner leaves it alone).
    pub fn with_budget_pinned(mut self, pinned: bool) -> Self {
        self.budget_pinned = pinned;
        self
    }

    /// The stage's statistics, with its knobs.
    pub fn snapshot(&self, input: &Budget, workers: usize, max_workers: usize) -> StageStats {
        let mut s = self.metrics.snapshot(Some(input));
        s.workers = workers;
        s.max_workers = max_workers;
        s.pinned = self.pinned;
        s.budget_pinned = self.budget_pinned;
        s
    }

    /// Records the parts an item left out (see [`skip_part`](crate::failure::skip_part)) as
    /// failed items; returns whether one was fatal (the item is then not delivered).
    pub fn fail_parts(&self, local: &mut Counters, parts: crate::failure::SkippedParts) -> bool {
        let mut fatal = false;
        for (part, cause) in parts {
            fatal |= self.fail(local, part, cause);
        }
        fatal
    }

    /// Records a failed item; `local` are the caller's unflushed counters. Returns whether the
    /// failure was fatal.
    pub fn fail(&self, local: &mut Counters, item: String, cause: BoxError) -> bool {
        // An error that names its item overrides the stage's description.
        let (item, cause) = match cause.downcast::<crate::error::Described>() {
            Ok(d) => d.into_parts(),
            Err(cause) => (item, cause),
        };
        local.failures += 1;
        let seen = self.metrics.items_in() + local.items_in;
        self.ledger.record(
            &self.failures,
            seen,
            ItemError::new(Arc::clone(&self.name), item, cause),
        )
    }
}
