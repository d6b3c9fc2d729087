//! [`Pipeline`]: a running pipeline, driven by its consumer — iteration over epochs,
//! checkpoints, statistics, control and shutdown.
//!
//! A pipeline is made from finished parts (see
//! [`PipelineBuilder::build`](crate::PipelineBuilder::build)); the machinery it drives, and
//! how that shuts down, is in the crate's `engine` module.

use std::pin::Pin;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::task::{Context, Poll};

use flowgate_actors::error::PipelineError;
use flowgate_actors::origin::{Delivered, RangeSet};
use flowgate_actors::sink::{Next, SinkReader};
use flowgate_actors::tuner::{TraceLog, TraceRecord};
use futures::Stream;

use crate::engine::checkpoint::{Fingerprint, PipelineState, STATE_VERSION};
use crate::engine::control::{ControlHandle, StopHandle};
use crate::engine::running::Engine;
use crate::engine::sharding::Sharding;
use crate::engine::stats::{Monitor, PipelineStats};

/// A running pipeline producing items of type `T`.
///
/// Built by [`Pipeline::builder`]. Iterate an epoch with [`iter`](Self::iter) (blocking) or
/// [`stream`](Self::stream) (async); each call continues the current epoch or starts the next.
///
/// # Examples
///
/// ```
/// use flowgate::Pipeline;
///
/// let mut pipeline = Pipeline::builder()
///     .source_epochs(|_epoch| 0..1000u64)
///     .pipe("square", |x| Ok::<_, std::io::Error>(x * x), 2)
///     .build()?;
/// for epoch in 0..2 {
///     let sum: u64 = pipeline.iter().map(|r| r.unwrap()).sum();
///     assert_eq!(sum, (0..1000u64).map(|x| x * x).sum::<u64>(), "epoch {epoch}");
/// }
/// # Ok::<(), flowgate::PipelineError>(())
/// ```
pub struct Pipeline<T = ()> {
    engine: Engine,
    reader: SinkReader<T>,
    trace: Arc<TraceLog>,
    /// The epoch being iterated or the next to start (shared with the stats callback).
    epoch: Arc<AtomicU64>,
    /// What this pipeline's checkpoints are valid for.
    fingerprint: Fingerprint,
    /// The sampler of a sampled source: checkpoints in global positions.
    sharding: Option<Sharding>,
    running: bool,
    finished: bool,
    /// Declared last, so dropped last: hands the freed buffers back to the system.
    _trim: TrimOnDrop,
}

/// Returns free heap memory to the system when a pipeline is dropped (the tensor buffer pool
/// too). A pipeline's threads
/// end with it, and glibc keeps what they freed in per-thread arenas; without this a program
/// that rebuilds pipelines (resuming, changing datasets) sees its RSS creep up.
#[derive(Debug, Default)]
struct TrimOnDrop;

impl Drop for TrimOnDrop {
    fn drop(&mut self) {
        crate::tensor::pool::release();
        #[cfg(all(target_os = "linux", target_env = "gnu"))]
        {
            extern "C" {
                fn malloc_trim(pad: usize) -> i32;
            }
            // SAFETY: malloc_trim only releases free memory; it is thread-safe.
            unsafe { malloc_trim(0) };
        }
    }
}

/// Makes glibc serve allocations of 1 MiB and more (decoded images, batches) from their own
/// mappings, returned to the system when freed. By default glibc raises that threshold as
/// large blocks are freed, and then keeps up to twice the largest block free at the top of
/// every thread's arena, where `malloc_trim` does not reach: a stopped epoch (a `break`, a
/// rebuilt pipeline) would leave ~100 MB resident per arena. Set once per process, when the
/// first pipeline is built; `FLOWGATE_KEEP_MALLOC=1` leaves the allocator as it is.
pub(crate) fn return_large_frees() {
    static ONCE: std::sync::Once = std::sync::Once::new();
    ONCE.call_once(|| {
        if std::env::var_os("FLOWGATE_KEEP_MALLOC").is_some_and(|v| v == "1") {
            return;
        }
        #[cfg(all(target_os = "linux", target_env = "gnu"))]
        {
            extern "C" {
                fn mallopt(param: i32, value: i32) -> i32;
            }
            const M_MMAP_THRESHOLD: i32 = -3;
            // SAFETY: mallopt only changes allocator settings; it is thread-safe.
            unsafe { mallopt(M_MMAP_THRESHOLD, 1 << 20) };
        }
    });
}

impl<T> std::fmt::Debug for Pipeline<T> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Pipeline")
            .field("epoch", &self.epoch.load(Ordering::Relaxed))
            .field("running", &self.running)
            .field("finished", &self.finished)
            .finish_non_exhaustive()
    }
}

impl<T: Send + 'static> Pipeline<T> {
    /// A pipeline driving `engine`, finished by the builder: its consumer reads `reader`,
    /// its tuner (if any) records into `trace`, and `epoch` is shared with the stats callback.
    pub(crate) fn from_parts(
        engine: Engine,
        reader: SinkReader<T>,
        trace: Arc<TraceLog>,
        epoch: Arc<AtomicU64>,
        fingerprint: Fingerprint,
        sharding: Option<Sharding>,
    ) -> Self {
        Self {
            engine,
            reader,
            trace,
            epoch,
            fingerprint,
            sharding,
            running: false,
            finished: false,
            _trim: TrimOnDrop,
        }
    }

    fn ensure_running(&mut self) {
        if self.running || self.finished {
            return;
        }
        let epoch = self.epoch();
        self.engine.begin_epoch(epoch);
        self.running = true;
        tracing::debug!(epoch, "epoch started");
    }

    fn on_next(&mut self, next: Next<T>) -> Option<Result<T, PipelineError>> {
        match next {
            Next::Item(item) => Some(Ok(item)),
            Next::EpochEnd(e) => {
                tracing::debug!(epoch = e, "epoch ended");
                self.reader.set_ledger(Delivered::default());
                self.running = false;
                self.epoch.store(e + 1, Ordering::Relaxed);
                None
            }
            Next::Closed => {
                self.finished = true;
                self.running = false;
                Some(Err(self
                    .engine
                    .ledger()
                    .take_fatal()
                    .unwrap_or_else(PipelineError::stopped)))
            }
        }
    }

    /// Blocking iteration over the current epoch (starting the next one if the last ended).
    ///
    /// Yields `Ok(item)` for each result and ends at the end of the epoch. If the pipeline
    /// stops early (a failure budget was exceeded, or [`stop`](Self::stop)), it yields one
    /// `Err` and ends; later calls yield nothing.
    pub fn iter(&mut self) -> EpochIter<'_, T> {
        self.ensure_running();
        EpochIter { p: self }
    }

    /// Async iteration over the current epoch; see [`iter`](Self::iter).
    pub fn stream(&mut self) -> EpochStream<'_, T> {
        self.ensure_running();
        EpochStream { p: self }
    }

    /// The epoch being iterated (or the next one to start).
    pub fn epoch(&self) -> u64 {
        self.epoch.load(Ordering::Relaxed)
    }

    /// A checkpoint of the consumer's progress: the epoch, and which of its source items the
    /// consumer has received (as index ranges, so it stays small). Take it between `next()`
    /// calls, store it with the model's checkpoint, and hand it to [`resume`](Self::resume) of
    /// a pipeline built the same way to get exactly the items not delivered yet.
    ///
    /// Items in flight (read, decoding, batched but not handed out) are *not* in it: a resumed
    /// pipeline produces them again. Failed and filtered items were never delivered, so they
    /// are attempted again too. Between epochs, the state names the next epoch with nothing
    /// delivered.
    pub fn state(&self) -> PipelineState {
        let ledger = self.reader.ledger();
        let mut partial: Vec<(u64, u64, u64)> = ledger
            .partial
            .iter()
            .flat_map(|(&i, r)| r.ranges().map(move |(a, b)| (i, a, b)))
            .collect();
        partial.sort_unstable();
        let epoch = self.epoch();
        PipelineState {
            epoch,
            delivered: ledger.done.ranges().collect(),
            delivered_items: ledger.done.len(),
            partial,
            version: STATE_VERSION,
            fingerprint: self.fingerprint.clone(),
            shard: self.sharding.as_ref().map(|s| s.share_state(epoch)),
            owed_batches: None,
        }
    }

    /// Continues from a [`state`](Self::state) taken from a pipeline built with the same
    /// source and stages: the next [`iter`](Self::iter) runs the state's epoch without the
    /// items already delivered (in source order for [`Order::Input`](crate::Order::Input), so
    /// the results continue the interrupted sequence), and later epochs run in full.
    ///
    /// The source must make the same items in the same order for that epoch (a seeded
    /// shuffle, a sorted listing): items are identified by their position. A source item split
    /// by [`disaggregate`](crate::PipelineBuilder::disaggregate) and only partly delivered is
    /// produced again whole. Call it before iterating, or between epochs.
    pub fn resume(&mut self, state: &PipelineState) -> Result<(), PipelineError> {
        self.check_running()?;
        if self.running {
            return Err(PipelineError::config(
                "resume: the pipeline is in the middle of an epoch; resume before iterating",
            ));
        }
        state.check_fits(&self.fingerprint)?;
        let Some(source) = self.engine.source() else {
            return Err(PipelineError::config("resume: the pipeline has no source"));
        };
        let (done, partial) = match &self.sharding {
            Some(sharding) => sharding.resume(state)?,
            None => {
                if state
                    .shard
                    .as_ref()
                    .is_some_and(|s| s.world > 1 || !s.base.is_empty())
                {
                    return Err(PipelineError::config(
                        "resume: the checkpoint is of a sharded pipeline and this pipeline's \
                         source is not sampled (PipelineBuilder::source_sampled)",
                    ));
                }
                let done = RangeSet::from_ranges(state.delivered.iter().copied());
                (done, state.partial.clone())
            }
        };
        let mut ledger = Delivered {
            done: done.clone(),
            ..Default::default()
        };
        for (i, a, b) in partial {
            if !done.contains(i) {
                ledger.partial.entry(i).or_default().insert_range(a, b);
            }
        }
        // Those items are produced again whole: the parts received are recognised and dropped.
        ledger.reissued = !ledger.partial.is_empty();
        source.skip_in_epoch(state.epoch, done);
        self.reader.set_ledger(ledger);
        self.epoch.store(state.epoch, Ordering::Relaxed);
        tracing::debug!(
            epoch = state.epoch,
            delivered = state.delivered_items,
            "resuming"
        );
        Ok(())
    }

    /// Makes the next [`iter`](Self::iter) run `epoch` in full (skipping the epochs before it):
    /// a resume with nothing delivered at this rank's own place, for a pipeline
    /// rebuilt to continue at a given epoch.
    pub fn start_at_epoch(&mut self, epoch: u64) -> Result<(), PipelineError> {
        self.resume(&PipelineState {
            epoch,
            version: STATE_VERSION,
            fingerprint: self.fingerprint.clone(),
            shard: self.sharding.as_ref().map(|s| s.fresh(epoch)),
            ..Default::default()
        })
    }

    /// Statistics of every stage, collected through the stage actors.
    pub fn stats(&self) -> PipelineStats {
        PipelineStats::assemble(
            self.engine.snapshot_all(),
            self.engine.ledger(),
            self.epoch(),
            self.engine.memory(),
        )
    }

    /// A handle that reads this pipeline's statistics and epoch from any thread without
    /// waiting for the consumer (while `next()` blocks, for instance).
    pub fn monitor(&self) -> Monitor {
        Monitor {
            stages: self.engine.stages(),
            ledger: Arc::clone(self.engine.ledger()),
            epoch: Arc::clone(&self.epoch),
            trace: Arc::clone(&self.trace),
            memory: self.engine.memory().cloned(),
        }
    }

    /// The tuner's recent ticks (signals, decisions and reasons), oldest first; empty when the
    /// tuner is off.
    pub fn tuner_trace(&self) -> Vec<TraceRecord> {
        self.trace.records()
    }

    /// A handle that resizes stages and sets budgets from any thread (a tuner, a test).
    pub fn control(&self) -> ControlHandle {
        ControlHandle::new(
            self.engine
                .plane()
                .map(|p| p.stages().to_vec())
                .unwrap_or_default(),
        )
    }

    /// Sets the active workers of stage `name`; see [`ControlHandle::resize`].
    pub fn resize(&self, name: &str, workers: usize) -> Result<usize, PipelineError> {
        self.check_running()?;
        self.control().resize(name, workers)
    }

    /// Sets the budget of stage `name`; see [`ControlHandle::set_budget`].
    pub fn set_budget(&self, name: &str, items: usize, bytes: u64) -> Result<(), PipelineError> {
        self.check_running()?;
        self.control().set_budget(name, items, bytes)
    }

    fn check_running(&self) -> Result<(), PipelineError> {
        if self.engine.is_down() {
            Err(PipelineError::stopped())
        } else {
            Ok(())
        }
    }

    /// A handle that stops this pipeline from another thread.
    pub fn stop_handle(&self) -> StopHandle {
        StopHandle::new(Arc::clone(self.engine.closer()))
    }

    /// Stops the pipeline and joins every thread it started. Idempotent; also done on drop.
    pub fn stop(&mut self) {
        self.finished = true;
        self.running = false;
        self.engine.shutdown();
    }
}

/// Blocking iterator over one epoch; see [`Pipeline::iter`].
#[derive(Debug)]
pub struct EpochIter<'a, T> {
    p: &'a mut Pipeline<T>,
}

impl<T: Send + 'static> Iterator for EpochIter<'_, T> {
    type Item = Result<T, PipelineError>;

    fn next(&mut self) -> Option<Self::Item> {
        if !self.p.running {
            return None;
        }
        let next = self.p.reader.next_blocking();
        self.p.on_next(next)
    }
}

/// What [`Pipeline::next_within`] found.
#[derive(Debug)]
pub enum Within<T> {
    /// The next result of the epoch (or its error).
    Next(Result<T, PipelineError>),
    /// The epoch ended (the next call starts the next epoch).
    EpochEnd,
    /// Nothing arrived in time; the epoch goes on.
    TimedOut,
}

impl<T: Send + 'static> Pipeline<T> {
    /// The next result of the current epoch (starting the next epoch if the last ended),
    /// waiting at most `timeout`: for a consumer that must stay responsive while it waits
    /// (the Python loaders wait in slices and check for Ctrl-C between them).
    pub fn next_within(&mut self, timeout: std::time::Duration) -> Within<T> {
        self.ensure_running();
        if !self.running {
            return Within::EpochEnd;
        }
        match self
            .reader
            .next_until(Some(std::time::Instant::now() + timeout))
        {
            None => Within::TimedOut,
            Some(next) => match self.on_next(next) {
                Some(r) => Within::Next(r),
                None => Within::EpochEnd,
            },
        }
    }
}

/// Async stream over one epoch; see [`Pipeline::stream`].
#[derive(Debug)]
pub struct EpochStream<'a, T> {
    p: &'a mut Pipeline<T>,
}

impl<T: Send + 'static> Stream for EpochStream<'_, T> {
    type Item = Result<T, PipelineError>;

    fn poll_next(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Option<Self::Item>> {
        let this = self.get_mut();
        if !this.p.running {
            return Poll::Ready(None);
        }
        match this.p.reader.poll_next(cx) {
            Poll::Pending => Poll::Pending,
            Poll::Ready(next) => Poll::Ready(this.p.on_next(next)),
        }
    }
}
