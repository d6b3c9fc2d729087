//! A running pipeline: iteration over epochs, statistics, control, and shutdown.
//!
//! # Shutdown
//!
//! [`Pipeline::stop`] (also run on drop) closes every channel, which wakes every thread and task
//! waiting on one; tells each stage to stop; stops the control thread; joins every thread the
//! pipeline started; and shuts the tokio runtime down. It is idempotent. A [`StopHandle`] does
//! the first two steps from anywhere (another thread, a signal handler), and the consumer then
//! sees [`PipelineError::is_stopped`]. A user function or iterator that never returns cannot be
//! interrupted; everything else returns promptly.

use std::pin::Pin;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::task::{Context, Poll};
use std::time::Duration;

use actix::{Actor, Addr};
use flowgate_actors::actor::{ControlPlane, Resize, SetBudget, StageActor};
use flowgate_actors::channel::Channel;
use flowgate_actors::error::PipelineError;
use flowgate_actors::failure::Failures;
use flowgate_actors::origin::{Delivered, RangeSet};
use flowgate_actors::sink::{Next, SinkReader};
use flowgate_actors::stage::StageControl;
use flowgate_actors::tuner::{TraceLog, TraceRecord, TunerActor};
use flowgate_tuner::{StageKind, StageStats};
use futures::Stream;
use parking_lot::Mutex;

use crate::builder::{Autotune, HasBudget, SourceBuilder, SourceStageDyn};

/// A checkpoint of a consumer's progress through an epoch; see [`Pipeline::state`] and
/// [`Pipeline::resume`]. Serialisable with serde (a few hundred bytes for a typical epoch:
/// delivered items are kept as index ranges).
#[derive(Clone, Debug, Default, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
pub struct PipelineState {
    /// The epoch in progress (or the next one, between epochs).
    pub epoch: u64,
    /// Positions (in the epoch's source order) of the source items the consumer received,
    /// as half-open `[start, end)` ranges.
    pub delivered: Vec<(u64, u64)>,
    /// How many source items that is.
    pub delivered_items: u64,
    /// Source items only partly received (split by `disaggregate`): position and share
    /// received (of 2^40).
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub partial: Vec<(u64, u64)>,
}

/// Statistics of a pipeline: every stage (source first, sink last) and the consumer.
#[derive(Clone, Debug, Default, serde::Serialize)]
pub struct PipelineStats {
    /// Per-stage statistics, in pipeline order (`source`, the stages, `sink`).
    pub stages: Vec<StageStats>,
    /// Results delivered to the consumer.
    pub delivered: u64,
    /// Total time the consumer waited in `next()` for a result (a starved training loop).
    pub consumer_wait: Duration,
    /// Failed (skipped) items, all stages.
    pub failures: u64,
    /// The last few failures, as messages, oldest first.
    pub recent_failures: Vec<String>,
    /// The current epoch.
    pub epoch: u64,
}

impl PipelineStats {
    fn assemble(stages: Vec<StageStats>, ledger: &Failures, epoch: u64) -> Self {
        let sink = stages.iter().find(|s| s.kind == Some(StageKind::Sink));
        Self {
            delivered: sink.map_or(0, |s| s.items_out),
            consumer_wait: sink.map_or(Duration::ZERO, |s| s.blocked_get),
            failures: ledger.total(),
            recent_failures: ledger.recent().iter().map(ToString::to_string).collect(),
            epoch,
            stages,
        }
    }

    /// The stage called `name`.
    pub fn stage(&self, name: &str) -> Option<&StageStats> {
        self.stages.iter().find(|s| s.name == name)
    }
}

/// Closes every channel and stops every stage; shared by the pipeline and its stop handles.
struct Closer {
    channels: Vec<Arc<dyn HasBudget>>,
    stages: Mutex<Vec<Arc<dyn StageControl>>>,
}

impl Closer {
    fn close(&self) {
        for c in &self.channels {
            c.budget().close();
        }
        for s in self.stages.lock().iter() {
            s.stop();
        }
    }
}

/// Owns everything a pipeline started; [`Engine::shutdown`] stops and joins it all.
pub(crate) struct Engine {
    closer: Arc<Closer>,
    source: Option<Arc<SourceStageDyn>>,
    plane: Option<ControlPlane>,
    runtime: Option<tokio::runtime::Runtime>,
    ledger: Arc<Failures>,
    down: bool,
}

impl Engine {
    pub(crate) fn new(channels: Vec<Arc<dyn HasBudget>>, ledger: Arc<Failures>) -> Self {
        let closer = Arc::new(Closer {
            channels,
            stages: Mutex::new(Vec::new()),
        });
        // Weak: the stages hold the ledger, and the closer holds the stages.
        let c = Arc::downgrade(&closer);
        ledger.on_fatal(move || {
            if let Some(c) = c.upgrade() {
                c.close();
            }
        });
        Self {
            closer,
            source: None,
            plane: None,
            runtime: None,
            ledger,
            down: false,
        }
    }

    pub(crate) fn set_runtime(&mut self, rt: tokio::runtime::Runtime) {
        self.runtime = Some(rt);
    }

    pub(crate) fn add_stage(&mut self, s: Arc<dyn StageControl>) {
        self.closer.stages.lock().push(s);
    }

    /// Every stage, in pipeline order (source first, sink last).
    fn stages(&self) -> Vec<Arc<dyn StageControl>> {
        self.closer.stages.lock().clone()
    }

    pub(crate) fn set_source(&mut self, s: Arc<SourceStageDyn>) {
        self.source = Some(s);
    }

    fn shutdown(&mut self) {
        if self.down {
            return;
        }
        self.down = true;
        self.closer.close();
        if let Some(mut plane) = self.plane.take() {
            plane.shutdown();
        }
        for s in self.stages() {
            s.join();
        }
        if let Some(rt) = self.runtime.take() {
            rt.shutdown_timeout(Duration::from_secs(10));
        }
        tracing::debug!("pipeline stopped");
    }
}

impl Drop for Engine {
    fn drop(&mut self) {
        self.shutdown();
    }
}

/// Stops a pipeline from anywhere; see [`Pipeline::stop_handle`].
#[derive(Clone)]
pub struct StopHandle {
    closer: Arc<Closer>,
}

impl std::fmt::Debug for StopHandle {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("StopHandle").finish_non_exhaustive()
    }
}

impl StopHandle {
    /// Stops the pipeline: the consumer's next call reports
    /// [`PipelineError::is_stopped`]. Threads are joined when the pipeline is stopped or dropped.
    pub fn stop(&self) {
        self.closer.close();
    }
}

/// Sends control messages to a pipeline's stage actors; see [`Pipeline::control`].
#[derive(Clone, Debug)]
pub struct ControlHandle {
    stages: Vec<(String, Addr<StageActor>)>,
}

impl ControlHandle {
    fn addr(&self, name: &str) -> Result<&Addr<StageActor>, PipelineError> {
        self.stages
            .iter()
            .find(|(n, _)| n == name)
            .map(|(_, a)| a)
            .ok_or_else(|| PipelineError::config(format!("no stage is named `{name}`")))
    }

    /// Names of the stages, in pipeline order (`source` first, `sink` last).
    pub fn stage_names(&self) -> Vec<&str> {
        self.stages.iter().map(|(n, _)| n.as_str()).collect()
    }

    /// Sets the active workers of stage `name` (concurrency for async stages; stages with one
    /// thread by nature answer 1). Returns the number granted: the process-wide CPU cap may
    /// grant fewer. Items are neither lost nor duplicated by a resize.
    pub fn resize(&self, name: &str, workers: usize) -> Result<usize, PipelineError> {
        futures::executor::block_on(self.addr(name)?.send(Resize { workers }))
            .map_err(|_| PipelineError::stopped())
    }

    /// Sets how many items and bytes stage `name` may hold (`"sink"`: results waiting for the
    /// consumer). Shrinking takes effect as items leave.
    pub fn set_budget(&self, name: &str, items: usize, bytes: u64) -> Result<(), PipelineError> {
        futures::executor::block_on(self.addr(name)?.send(SetBudget { items, bytes }))
            .map_err(|_| PipelineError::stopped())
    }
}

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

impl<T> std::fmt::Debug for Pipeline<T> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Pipeline")
            .field("epoch", &self.epoch.load(Ordering::Relaxed))
            .field("running", &self.running)
            .field("finished", &self.finished)
            .finish_non_exhaustive()
    }
}

impl Pipeline {
    /// Starts building a pipeline.
    pub fn builder() -> SourceBuilder {
        SourceBuilder::default()
    }
}

type StatsCallback = Box<dyn FnMut(&PipelineStats) + Send>;

impl<T: Send + 'static> Pipeline<T> {
    pub(crate) fn start(
        mut engine: Engine,
        sink: Arc<Channel<T>>,
        sink_pinned: bool,
        on_stats: Option<(Duration, StatsCallback)>,
        autotune: Option<Autotune>,
    ) -> Result<Self, PipelineError> {
        let reader = SinkReader::new(sink);
        engine.add_stage(reader.control(sink_pinned));
        let all_stages = engine.stages();
        let plane = ControlPlane::start(all_stages.clone())?;
        let trace = Arc::new(TraceLog::default());
        if let Some(a) = autotune {
            // Everything but the source (index 0), which has no knob to turn.
            let stages = all_stages[1..]
                .iter()
                .cloned()
                .zip(plane.stages()[1..].iter().map(|(_, addr)| addr.clone()))
                .collect();
            let policy = a.policy.unwrap_or_else(|| a.settings.make_policy());
            let actor = TunerActor::new(
                stages,
                &a.settings,
                policy,
                Arc::clone(&trace),
                a.on_decision,
            )
            .map_err(|e| PipelineError::config(format!("opening the tuner trace: {e}")))?
            .with_gpu_sampler(a.gpu);
            plane.on_control_thread(Box::new(move || {
                actor.start();
            }));
        }
        let epoch = Arc::new(AtomicU64::new(0));
        if let Some((every, mut f)) = on_stats {
            let stages = all_stages;
            let ledger = Arc::clone(&engine.ledger);
            let epoch = Arc::clone(&epoch);
            plane.every(every, move || {
                let snaps = stages.iter().map(|s| s.snapshot()).collect();
                f(&PipelineStats::assemble(
                    snaps,
                    &ledger,
                    epoch.load(Ordering::Relaxed),
                ));
            });
        }
        engine.plane = Some(plane);
        Ok(Self {
            engine,
            reader,
            trace,
            epoch,
            running: false,
            finished: false,
            _trim: TrimOnDrop,
        })
    }

    fn ensure_running(&mut self) {
        if self.running || self.finished {
            return;
        }
        let epoch = self.epoch();
        for c in &self.engine.closer.channels {
            c.budget().begin(epoch);
        }
        if let Some(s) = &self.engine.source {
            s.run_epoch(epoch);
        }
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
                    .ledger
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
        let mut partial: Vec<(u64, u64)> = ledger.partial.iter().map(|(&i, &s)| (i, s)).collect();
        partial.sort_unstable();
        PipelineState {
            epoch: self.epoch(),
            delivered: ledger.done.ranges().collect(),
            delivered_items: ledger.done.len(),
            partial,
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
        let Some(source) = &self.engine.source else {
            return Err(PipelineError::config("resume: the pipeline has no source"));
        };
        let done = RangeSet::from_ranges(state.delivered.iter().copied());
        let mut ledger = Delivered {
            done: done.clone(),
            ..Default::default()
        };
        for &(i, s) in &state.partial {
            if !done.contains(i) {
                ledger.partial.insert(i, s);
            }
        }
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

    /// Statistics of every stage, collected through the stage actors.
    pub fn stats(&self) -> PipelineStats {
        let snaps = match &self.engine.plane {
            Some(p) => p.snapshot_all(),
            None => self.engine.stages().iter().map(|s| s.snapshot()).collect(),
        };
        PipelineStats::assemble(snaps, &self.engine.ledger, self.epoch())
    }

    /// The tuner's recent ticks (signals, decisions and reasons), oldest first; empty when the
    /// tuner is off.
    pub fn tuner_trace(&self) -> Vec<TraceRecord> {
        self.trace.records()
    }

    /// A handle that resizes stages and sets budgets from any thread (a tuner, a test).
    pub fn control(&self) -> ControlHandle {
        ControlHandle {
            stages: self
                .engine
                .plane
                .as_ref()
                .map(|p| p.stages().to_vec())
                .unwrap_or_default(),
        }
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
        if self.engine.down {
            Err(PipelineError::stopped())
        } else {
            Ok(())
        }
    }

    /// A handle that stops this pipeline from another thread.
    pub fn stop_handle(&self) -> StopHandle {
        StopHandle {
            closer: Arc::clone(&self.engine.closer),
        }
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
