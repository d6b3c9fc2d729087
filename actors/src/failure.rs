//! Failure policy: how many failed items a stage, and the pipeline, may skip.
//!
//! A failed item (an error or a panic in the user's function) is skipped and counted. Each stage
//! has a [`FailureBudget`] and so does the pipeline as a whole; the first budget exceeded becomes
//! the pipeline's fatal error: the pipeline shuts down and the consumer's next call returns it.

use std::cell::RefCell;
use std::collections::VecDeque;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::OnceLock;

use parking_lot::Mutex;

use crate::error::{BoxError, ItemError, PipelineError};

/// Failures kept for [`Failures::recent`].
pub const RECENT_FAILURES: usize = 16;
/// Items a stage must have seen before a rate limit applies, so that one early failure does not
/// count as a 100% failure rate.
pub const DEFAULT_MIN_ITEMS_FOR_RATE: u64 = 100;

/// How many failures are tolerated: a count, a rate, both (whichever trips first) or none.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct FailureBudget {
    max_count: Option<u64>,
    max_rate: Option<f64>,
    min_items: u64,
}

impl Default for FailureBudget {
    /// Unlimited: failing items are skipped and counted, never fatal.
    fn default() -> Self {
        Self::unlimited()
    }
}

impl FailureBudget {
    /// What a loader's `skip_errors` setting means, in every front end: skip and count every
    /// failure ([`unlimited`](Self::unlimited)), or end the epoch at the first
    /// ([`fail_fast`](Self::fail_fast)).
    pub const fn skip_errors(skip: bool) -> Self {
        match skip {
            true => Self::unlimited(),
            false => Self::fail_fast(),
        }
    }

    /// Skip and count every failure; never stop.
    pub const fn unlimited() -> Self {
        Self {
            max_count: None,
            max_rate: None,
            min_items: DEFAULT_MIN_ITEMS_FOR_RATE,
        }
    }

    /// Tolerate at most `n` failures; the `n + 1`-th is fatal.
    pub const fn count(n: u64) -> Self {
        Self {
            max_count: Some(n),
            max_rate: None,
            min_items: DEFAULT_MIN_ITEMS_FOR_RATE,
        }
    }

    /// The first failure is fatal.
    pub const fn fail_fast() -> Self {
        Self::count(0)
    }

    /// Tolerate failures while they are at most a fraction `rate` (0..=1) of the items seen,
    /// once at least [`DEFAULT_MIN_ITEMS_FOR_RATE`] items were seen.
    ///
    /// # Panics
    ///
    /// When `rate` is outside 0..=1 (or NaN), with the words every front end refuses it in
    /// ([`crate::limits::failure_rate`]); [`try_rate`](Self::try_rate) returns the error.
    pub fn rate(rate: f64) -> Self {
        Self::try_rate(rate).unwrap_or_else(|e| panic!("FailureBudget::rate: {e}"))
    }

    /// [`rate`](Self::rate), or the error that names the number out of range.
    pub fn try_rate(rate: f64) -> Result<Self, crate::limits::OutOfRange> {
        Ok(Self {
            max_count: None,
            max_rate: Some(crate::limits::failure_rate(rate)?),
            min_items: DEFAULT_MIN_ITEMS_FOR_RATE,
        })
    }

    /// Adds a count limit to a rate limit (or the reverse).
    pub fn and_count(mut self, n: u64) -> Self {
        self.max_count = Some(n);
        self
    }

    /// Sets how many items must be seen before the rate limit applies.
    pub fn min_items(mut self, n: u64) -> Self {
        self.min_items = n;
        self
    }

    /// Whether `failures` out of `seen` items exceed the budget.
    pub fn exceeded(&self, failures: u64, seen: u64) -> bool {
        if self.max_count.is_some_and(|m| failures > m) {
            return true;
        }
        match self.max_rate {
            Some(r) => seen >= self.min_items && failures as f64 > r * seen as f64,
            None => false,
        }
    }
}

/// One stage's failure count and budget.
#[derive(Debug)]
pub struct StageFailures {
    budget: FailureBudget,
    count: AtomicU64,
}

impl StageFailures {
    /// Failures under `budget`.
    pub fn new(budget: FailureBudget) -> Self {
        Self {
            budget,
            count: AtomicU64::new(0),
        }
    }

    /// Failures so far.
    pub fn count(&self) -> u64 {
        self.count.load(Ordering::Relaxed)
    }
}

type Abort = Box<dyn Fn() + Send + Sync>;

/// The pipeline-wide failure ledger: the global budget, recent failures, the fatal error.
pub struct Failures {
    budget: FailureBudget,
    total: AtomicU64,
    source_items: AtomicU64,
    recent: Mutex<VecDeque<ItemError>>,
    fatal: Mutex<Option<PipelineError>>,
    abort: OnceLock<Abort>,
    observer: OnceLock<Observer>,
}

/// Called with every failure as it is recorded.
pub type Observer = Box<dyn Fn(&ItemError) + Send + Sync>;

impl std::fmt::Debug for Failures {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Failures")
            .field("budget", &self.budget)
            .field("total", &self.total)
            .field("fatal", &self.fatal)
            .finish_non_exhaustive()
    }
}

impl Failures {
    /// A ledger with a pipeline-wide `budget`.
    pub fn new(budget: FailureBudget) -> Self {
        Self {
            budget,
            total: AtomicU64::new(0),
            source_items: AtomicU64::new(0),
            recent: Mutex::new(VecDeque::with_capacity(RECENT_FAILURES)),
            fatal: Mutex::new(None),
            abort: OnceLock::new(),
            observer: OnceLock::new(),
        }
    }

    /// Sets what to do when a budget is exceeded (shut the pipeline down). Set once.
    pub fn on_fatal(&self, abort: impl Fn() + Send + Sync + 'static) {
        let _ = self.abort.set(Box::new(abort));
    }

    /// Sets a function to call with every failure as it is recorded (set once). It runs on the
    /// worker that saw the failure: keep it short.
    pub fn on_failure(&self, f: Observer) {
        let _ = self.observer.set(f);
    }

    /// Counts `n` items emitted by the source (the denominator of the global rate).
    pub fn count_source_items(&self, n: u64) {
        self.source_items.fetch_add(n, Ordering::Relaxed);
    }

    /// Records a failure in `stage`, which has seen `stage_seen` items. Returns whether it was
    /// fatal (a budget is now exceeded).
    pub fn record(&self, stage: &StageFailures, stage_seen: u64, err: ItemError) -> bool {
        let n_stage = stage.count.fetch_add(1, Ordering::Relaxed) + 1;
        let n_total = self.total.fetch_add(1, Ordering::Relaxed) + 1;
        tracing::debug!(stage = err.stage(), item = err.item(), error = %err.cause(), "item failed");
        let fatal = if stage.budget.exceeded(n_stage, stage_seen.max(n_stage)) {
            Some(PipelineError::failure_budget(
                format!("stage `{}`", err.stage()),
                n_stage,
                err.clone(),
            ))
        } else {
            let seen = self.source_items.load(Ordering::Relaxed).max(n_total);
            self.budget
                .exceeded(n_total, seen)
                .then(|| PipelineError::failure_budget("the pipeline", n_total, err.clone()))
        };
        if let Some(observe) = self.observer.get() {
            observe(&err);
        }
        {
            let mut recent = self.recent.lock();
            if recent.len() == RECENT_FAILURES {
                recent.pop_front();
            }
            recent.push_back(err);
        }
        match fatal {
            Some(e) => {
                tracing::warn!(error = %e, "failure budget exceeded; stopping the pipeline");
                self.set_fatal(e);
                true
            }
            None => false,
        }
    }

    /// Makes `e` the fatal error (the first one wins) and aborts the pipeline.
    pub fn set_fatal(&self, e: PipelineError) {
        {
            let mut f = self.fatal.lock();
            if f.is_none() {
                *f = Some(e);
            }
        }
        if let Some(abort) = self.abort.get() {
            abort();
        }
    }

    /// Takes the fatal error, if there is one (it is reported once).
    pub fn take_fatal(&self) -> Option<PipelineError> {
        self.fatal.lock().take()
    }

    /// Total failures.
    pub fn total(&self) -> u64 {
        self.total.load(Ordering::Relaxed)
    }

    /// The last few failures, oldest first.
    pub fn recent(&self) -> Vec<ItemError> {
        self.recent.lock().iter().cloned().collect()
    }
}

/// Parts left out of one item: (the part, why).
pub type SkippedParts = Vec<(String, BoxError)>;

thread_local! {
    /// The parts the item being processed on this thread left out (see [`skip_part`]);
    /// `None` outside a pool stage's call of its function.
    static PARTS: RefCell<Option<SkippedParts>> = const { RefCell::new(None) };
}

tokio::task_local! {
    /// The parts an async stage's item left out, while its future runs.
    static TASK_PARTS: std::sync::Arc<Mutex<SkippedParts>>;
}

/// Records, from inside a stage's function, that a part of the item it is making failed and
/// was left out: one clip of a length-aware batch, one record of a shard read whole. The part
/// is counted as a failed item of the stage, exactly as if an item had failed (the stage's
/// and the pipeline's failure counts and budgets, `on_failure`, the recent failures), with
/// `part` as its description. If that exceeds a budget (say a fail-fast pipeline), the
/// pipeline stops with it as its error and the item being made is not delivered.
///
/// It works from a pool stage's function and from an async stage's future (not from the
/// closure that makes the future). A function that then fails as a whole should not report its
/// parts: the item's failure is recorded and its parts' are not. Returns `cause` back, for the
/// caller to fail the item with, where there is no stage to count it (outside any stage):
/// nothing is ever dropped unreported.
///
/// Rate budgets compare the failures with the stage's items: each failed part of an item
/// counts as one failure.
pub fn skip_part(part: impl Into<String>, cause: impl Into<BoxError>) -> Result<(), BoxError> {
    let mut skipped = Some((part.into(), cause.into()));
    PARTS.with(|p| {
        if let Some(parts) = &mut *p.borrow_mut() {
            parts.push(skipped.take().expect("not taken yet"));
        }
    });
    if skipped.is_some() {
        let _ = TASK_PARTS.try_with(|parts| parts.lock().push(skipped.take().expect("not taken")));
    }
    match skipped {
        None => Ok(()),
        Some((_, cause)) => Err(cause),
    }
}

/// Runs the future `f` (an async stage's item), collecting the parts it left out with
/// [`skip_part`].
pub async fn collect_skipped_parts_async<R>(
    f: impl std::future::Future<Output = R>,
) -> (R, SkippedParts) {
    let parts = std::sync::Arc::new(Mutex::new(Vec::new()));
    let r = TASK_PARTS.scope(std::sync::Arc::clone(&parts), f).await;
    let parts = std::mem::take(&mut *parts.lock());
    (r, parts)
}

/// Runs `f` (a stage's call of its function), collecting the parts it left out with
/// [`skip_part`].
pub fn collect_skipped_parts<R>(f: impl FnOnce() -> R) -> (R, SkippedParts) {
    let outer = PARTS.with(|p| p.borrow_mut().replace(Vec::new()));
    let r = f();
    let parts = PARTS.with(|p| std::mem::replace(&mut *p.borrow_mut(), outer));
    (r, parts.unwrap_or_default())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn budgets() {
        assert!(!FailureBudget::unlimited().exceeded(1_000_000, 1_000_000));
        assert!(FailureBudget::fail_fast().exceeded(1, 1));
        assert!(!FailureBudget::count(2).exceeded(2, 10));
        assert!(FailureBudget::count(2).exceeded(3, 10));
        let r = FailureBudget::rate(0.1);
        assert!(!r.exceeded(50, 99), "too few items seen for a rate");
        assert!(!r.exceeded(10, 100));
        assert!(r.exceeded(11, 100));
        assert!(r.and_count(3).exceeded(4, 1000));
    }

    #[test]
    fn parts_are_collected_only_inside_a_stage_call() {
        let outside = skip_part("clip a", "bad header").unwrap_err();
        assert_eq!(
            outside.to_string(),
            "bad header",
            "handed back to the caller"
        );
        let ((), parts) = collect_skipped_parts(|| {
            skip_part("clip a", "bad header").unwrap();
            // A call nested in the stage's function collects its own.
            let ((), inner) = collect_skipped_parts(|| skip_part("clip b", "short").unwrap());
            assert_eq!(inner.len(), 1);
            skip_part("clip c", "truncated").unwrap();
        });
        let names: Vec<_> = parts.iter().map(|(p, e)| format!("{p}: {e}")).collect();
        assert_eq!(names, ["clip a: bad header", "clip c: truncated"]);
        assert!(skip_part("clip d", "x").is_err(), "the call is over");
    }
}
