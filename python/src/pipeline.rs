//! [`PyPipeline`]: a pipeline whose source and stages are Python callables (they take the GIL;
//! the engine's threads, queues and tuner do not). Its source is a Python iterable, or the
//! positions of a map-style dataset in the library's order (shuffle, ranks, equal counts),
//! which `flowgate.DataLoader` builds on: checkpoints of that one resume exactly.

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Mutex, MutexGuard};

use flowgate::loader::{LoaderSettings, PassRule, Passes, SetEpoch};
use flowgate::{Order, Pipeline, PipelineError, PipelineState, Within};
use pyo3::exceptions::PyValueError;
use pyo3::prelude::*;
use pyo3::types::{PyDict, PyList};

use crate::error::to_py;
use crate::fork::PyItem;
use crate::lifecycle::{drop_elsewhere, on_pipeline_thread};
use crate::loader::SLICE;
use crate::stages::{Items, Spec, StageSpec};
use crate::state::{state_from_py, state_to_py};

/// A pipeline of Python callables; see `flowgate.Pipeline`.
#[pyclass(module = "flowgate._native", name = "Pipeline")]
pub(crate) struct PyPipeline {
    /// What it is built from: its source, stages and settings.
    spec: Spec,
    /// Its passes over the epochs (the library's epoch machine, under torch's rule for its
    /// world size: [`PassRule::torch`]) and the pipeline that runs them.
    run: Mutex<Run>,
    /// Closed (`close()`) since the last epoch started: an iterator still running says so.
    closed: AtomicBool,
}

impl From<Spec> for PyPipeline {
    fn from(spec: Spec) -> Self {
        let world = match spec.items {
            Items::Indexed { world, .. } => world,
            Items::Iterable(_) => 1,
        };
        Self {
            spec,
            run: Mutex::new(Run {
                passes: Passes::new(PassRule::torch(world)),
                live: None,
            }),
            closed: AtomicBool::new(false),
        }
    }
}

/// The passes, and the pipeline built for them (none before the first, after a `close()`).
struct Run {
    passes: Passes,
    live: Option<Running>,
}

/// A built pipeline, and the process whose threads run it (after a `fork` the child has none
/// of them).
struct Running {
    pipeline: Pipeline<PyItem>,
    pid: u32,
}

impl Running {
    /// Stops the pipeline and joins its threads, with the GIL released (its workers may be
    /// waiting for it); in a forked child, where the threads are the parent's, only forgets
    /// it (joining would wait forever); on one of its own threads (the garbage collector
    /// freeing a loader during a stage's call), hands the joining to a thread of its own.
    fn end(self, py: Python<'_>) {
        if self.pid != std::process::id() || crate::EXITING.load(Ordering::SeqCst) {
            // After exit began, its threads may be parked for good (see `lifecycle`).
            std::mem::forget(self);
        } else if on_pipeline_thread() || crate::lifecycle::at_exit() {
            drop_elsewhere(self);
        } else {
            crate::lifecycle::released(py, move || drop(self));
        }
    }
}

impl Run {
    /// Takes the pipeline out, telling the passes where it stood (see [`Passes::stopped`]):
    /// the caller ends it. One a forked child has from its parent is forgotten, the child's
    /// next pass reading the epoch the parent was in (or the next, between epochs).
    fn stop(&mut self, over: bool) -> Option<Running> {
        let live = self.live.take();
        match &live {
            None => self.passes.stopped(None, None, over),
            Some(l) if l.pid != std::process::id() => self.passes.forked(l.pipeline.epoch()),
            Some(l) => {
                let keep = self.passes.in_epoch() || self.passes.resumed();
                let progress = keep.then(|| l.pipeline.state());
                self.passes
                    .stopped(progress, Some(l.pipeline.epoch()), over);
            }
        }
        live
    }

    /// The epoch this process's pipeline stands at (`None` without one).
    fn epoch_here(&self) -> Option<u64> {
        self.live
            .as_ref()
            .filter(|l| l.pid == std::process::id())
            .map(|l| l.pipeline.epoch())
    }
}

impl Drop for PyPipeline {
    fn drop(&mut self) {
        if let Some(r) = self.run.get_mut().ok().and_then(|r| r.live.take()) {
            crate::fork::with_gil(|py| r.end(py));
        }
    }
}

impl PyPipeline {
    /// Ranks sharing a map-style dataset's epochs (1 for an iterable's).
    pub(crate) fn world(&self) -> usize {
        match self.spec.items {
            Items::Indexed { world, .. } => world,
            Items::Iterable(_) => 1,
        }
    }

    /// The count of items read to make up failed batches, shared with the fetch that reads
    /// them.
    pub(crate) fn filled(&self) -> std::sync::Arc<std::sync::atomic::AtomicU64> {
        std::sync::Arc::clone(&self.spec.filled)
    }

    /// A map-style dataset's sampler (its rank's share of each epoch, in order) and the log
    /// whose epoch is the one being read: what a make-up reads fillers from (`None` for an
    /// iterable's).
    pub(crate) fn share_order(
        &self,
    ) -> Option<(flowgate::sampler::Sampler, flowgate::loader::FailureLog)> {
        match &self.spec.items {
            Items::Indexed { len, order, .. } => {
                let sampler = order.sampler(*len).ok()?;
                Some((sampler, self.spec.failed.clone()))
            }
            Items::Iterable(_) => None,
        }
    }

    /// The passes and their pipeline, locked; one a forked child has from its parent is
    /// given up first (see [`Run::stop`]).
    fn lock(&self, py: Python<'_>) -> MutexGuard<'_, Run> {
        let mut run = self.run.lock().expect("run");
        if run
            .live
            .as_ref()
            .is_some_and(|l| l.pid != std::process::id())
        {
            if let Some(old) = run.stop(false) {
                old.end(py);
            }
        }
        run
    }

    /// What an epoch that ended has to say of its skipped items and its result count (the
    /// library's [`EpochReport`](flowgate::loader::EpochReport)): against the results due (a
    /// map-style dataset's `len()`, or the rest of a resumed epoch).
    fn report(&self, passes: &Passes) -> Option<flowgate::loader::EpochReport> {
        let (skipped, _) = self.spec.failed.in_epoch();
        let delivered = passes.taken();
        let (due, len) = match &self.spec.items {
            Items::Indexed { share, .. } => (passes.due(), self.spec.results_of(*share)),
            Items::Iterable(_) => (delivered, delivered),
        };
        let filled = self.spec.filled.load(Ordering::Relaxed);
        let epoch = self.spec.failed.epoch();
        flowgate::loader::EpochReport::of(epoch, skipped, delivered, due, len, filled)
    }

    /// This process's pipeline, built if there is none, at the epoch the passes name.
    fn pipeline<'a>(&self, py: Python<'_>, run: &'a mut Run) -> PyResult<&'a mut Pipeline<PyItem>> {
        if run.live.is_none() {
            let mut p = self.spec.build(py).map_err(to_py)?;
            if run.passes.resume_at() > 0 {
                p.start_at_epoch(run.passes.resume_at()).map_err(to_py)?;
            }
            run.live = Some(Running {
                pipeline: p,
                pid: std::process::id(),
            });
        }
        Ok(&mut run.live.as_mut().expect("built").pipeline)
    }

    /// Positions a new pipeline at `state` (a checkpoint loaded, an abandoned epoch's start):
    /// refused for a state of another pipeline.
    fn resume(&self, py: Python<'_>, run: &mut Run, state: &PipelineState) -> PyResult<()> {
        if let Some(old) = run.live.take() {
            old.end(py);
        }
        run.passes.resumed_at();
        let resumed = self.pipeline(py, run)?.resume(state).map_err(to_py);
        if resumed.is_err() {
            // Nothing resumed: the next pass builds a pipeline afresh.
            if let Some(old) = run.live.take() {
                old.end(py);
            }
            run.passes.set_next(0);
        }
        resumed
    }

    /// The state the next pass starts from: the resumed one, or after an epoch's end the
    /// next from its start.
    fn next_state(&self, py: Python<'_>, run: &mut Run) -> PyResult<PipelineState> {
        let resumed = run.passes.resumed();
        let s = self.pipeline(py, run)?.state();
        Ok(match !resumed && s.delivered_items > 0 {
            true => s.next_epoch(),
            false => s,
        })
    }
}

#[pymethods]
impl PyPipeline {
    #[new]
    #[pyo3(signature = (source, skip_errors=false, cpu_budget=None))]
    fn new(
        source: Py<PyAny>,
        skip_errors: bool,
        cpu_budget: Option<&Bound<'_, PyAny>>,
    ) -> PyResult<Self> {
        let cpu_budget = cpu_budget.map(crate::args::cpu_budget_of).transpose()?;
        let spec = Spec::new(
            Items::Iterable(source),
            Order::Completion,
            skip_errors,
            cpu_budget,
        );
        Ok(spec.into())
    }

    /// Adds a stage calling `f(item)` on `workers` threads (a starting point: the tuner may
    /// change it; 0 leaves the start to it too). Python callables hold the GIL while they run.
    /// `blocking`: calls that mostly wait (I/O): exactly `workers` in flight whatever the
    /// cores, on blocking threads.
    #[pyo3(signature = (f, workers=None, name=None, blocking=false))]
    fn map<'py>(
        slf: Bound<'py, Self>,
        f: Py<PyAny>,
        workers: Option<&Bound<'py, PyAny>>,
        name: Option<String>,
        blocking: bool,
    ) -> PyResult<Bound<'py, Self>> {
        let workers = match workers {
            Some(w) => crate::args::whole(flowgate::limits::STAGE_WORKERS, w)? as usize,
            None => 1,
        };
        {
            let me = slf.borrow();
            let mut st = me.spec.stages.lock().expect("stages");
            let name = name.unwrap_or_else(|| format!("map{}", st.len() + 1));
            st.push(StageSpec::Map {
                name,
                f,
                workers,
                blocking,
            });
        }
        Ok(slf)
    }

    /// Bounds what is made ahead of the loop: at most `n` results waiting in the last stage
    /// and `n` for the consumer, besides one in each of its threads' hands (a `DataLoader`'s
    /// batches, whose bytes are not measured: torch's `prefetch_factor` per worker).
    fn prefetch<'py>(slf: Bound<'py, Self>, n: &Bound<'py, PyAny>) -> PyResult<Bound<'py, Self>> {
        let n = crate::args::whole(flowgate::limits::STAGE_PREFETCH, n)? as usize;
        *slf.borrow().spec.prefetch.lock().expect("prefetch") = Some(n);
        Ok(slf)
    }

    /// Groups items into lists of `size`.
    #[pyo3(signature = (size, drop_last=false))]
    fn batch<'py>(
        slf: Bound<'py, Self>,
        size: &Bound<'py, PyAny>,
        drop_last: bool,
    ) -> PyResult<Bound<'py, Self>> {
        let limit = flowgate::limits::Limit {
            key: "size",
            ..flowgate::limits::BATCH_SIZE
        };
        let size = crate::args::whole(limit, size)? as usize;
        slf.borrow()
            .spec
            .stages
            .lock()
            .expect("stages")
            .push(StageSpec::Batch { size, drop_last });
        Ok(slf)
    }

    /// Starts a pass (see [`Passes`]): the next epoch, an abandoned one again, or the resumed
    /// state; building the pipeline the first time, and again in a forked child (at the
    /// epoch the parent was in, or the next if it was between epochs).
    fn _start_epoch(&self, py: Python<'_>) -> PyResult<()> {
        let mut run = self.lock(py);
        if run.passes.in_epoch() {
            if let Some(old) = run.stop(false) {
                old.end(py);
            }
        }
        if let Some(epoch) = run.passes.take_named() {
            if let Some(old) = run.stop(false) {
                old.end(py);
            }
            run.passes.set_next(epoch);
        }
        if let Some(again) = run.passes.take_restart() {
            self.resume(py, &mut run, &again)?;
        }
        let start = self.next_state(py, &mut run)?;
        let due = match self.spec.items {
            Items::Indexed { .. } => {
                let (per, drop_last) = self.spec.per_result();
                flowgate::loader::batches_due(&start, per, drop_last)
            }
            Items::Iterable(_) => 0,
        };
        let epoch = self.pipeline(py, &mut run)?.epoch();
        run.passes.started(start, due);
        self.spec.failed.set_epoch(epoch);
        self.spec.filled.store(0, Ordering::Relaxed);
        self.closed.store(false, Ordering::Relaxed);
        Ok(())
    }

    /// A map-style dataset's pipeline: its source the positions `0..len` in the order
    /// `settings` (a `LoaderSettings` dict: shuffle, seed, ranks, drop_last, order,
    /// skip_errors, cpu_budget) give; the stages added after.
    #[staticmethod]
    fn indexed(len: usize, settings: &Bound<'_, PyAny>) -> PyResult<Self> {
        let invalid = |e: String| PyValueError::new_err(e);
        let settings = crate::values::value_of(settings).map_err(invalid)?;
        let settings = LoaderSettings::from_value(settings).map_err(invalid)?;
        let order = settings.epoch_order().map_err(|e| invalid(e.to_string()))?;
        // Refused as a loader's settings are (a rank out of range, an epoch past the limit).
        let sampler = order.sampler(len).map_err(|e| invalid(e.to_string()))?;
        let (share, world) = (sampler.len(), sampler.world());
        let items = Items::Indexed {
            len,
            order,
            share,
            world,
        };
        let (order, skip) = (settings.order.into(), settings.skip_errors);
        Ok(Spec::new(items, order, skip, settings.cpu_budget).into())
    }

    /// Positions this rank reads an epoch (a map-style dataset's pipeline; `None` for an
    /// iterable's).

    #[getter]
    fn share(&self) -> Option<usize> {
        match self.spec.items {
            Items::Indexed { share, .. } => Some(share),
            Items::Iterable(_) => None,
        }
    }

    /// A checkpoint of what the consumer received: of the epoch being iterated, of an epoch
    /// left mid-way, or (between epochs) the next epoch from its start.
    fn state_dict<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyDict>> {
        let mut run = self.lock(py);
        if let Some(s) = run.passes.checkpoint() {
            return state_to_py(py, s);
        }
        let s = match (run.passes.in_epoch(), run.live.as_ref()) {
            (true, Some(l)) => l.pipeline.state(),
            _ => self.next_state(py, &mut run)?,
        };
        state_to_py(py, &s)
    }

    /// Continues from `state` (of a pipeline built alike, refused otherwise): the next epoch
    /// started yields exactly what it had not delivered.
    fn load_state_dict(&self, py: Python<'_>, state: &Bound<'_, PyDict>) -> PyResult<()> {
        let mut state = state_from_py(state)?;
        // A state without batching (from before it was recorded, or of a pipeline without a
        // batch stage): nothing to check it against.
        if !state.fingerprint.contains_key("batch_size") {
            for s in self.spec.stages.lock().expect("stages").iter() {
                if let StageSpec::Batch { size, drop_last } = s {
                    let f = flowgate::loader::batching_fingerprint(*size, *drop_last)
                        .map(|(k, v)| (k.to_owned(), v));
                    state.fingerprint.extend(f);
                }
            }
        }
        // Resumed now, so that a state of another pipeline is refused here.
        let mut run = self.lock(py);
        self.resume(py, &mut run, &state)
    }

    /// Makes `epoch` the next one started (as `DistributedSampler.set_epoch`): a no-op when
    /// it already is (a resumed position is kept); during a pass, the next pass's.
    fn set_epoch(&self, py: Python<'_>, epoch: u64) {
        let mut run = self.lock(py);
        let here = run.epoch_here();
        if run.passes.set_epoch(epoch, here) == SetEpoch::Restart {
            if let Some(old) = run.stop(false) {
                old.end(py);
            }
            run.passes.set_next(epoch);
        }
    }

    /// The stages' statistics and their Python calls': `gil.threads_busy` threads in calls on
    /// `gil.cores_used` cores on average; `gil.bound` when several threads were busy on about
    /// one core (taking turns at the GIL: more threads cannot help).
    fn stats<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyDict>> {
        let d = PyDict::new(py);
        // The lock is taken with the GIL released: `_next` holds it while it waits for a
        // result that a stage's Python call (which may be this one) has to make.
        let run = &self.run;
        let stats = crate::lifecycle::released(py, || {
            let run = run.lock().expect("run");
            run.live.as_ref().map(|l| l.pipeline.stats())
        });
        if let Some(s) = stats {
            d.set_item("delivered", s.delivered)?;
            d.set_item("failures", s.failures)?;
            // Items read again to make up batches whose every item failed, this epoch.
            d.set_item("filled", self.spec.filled.load(Ordering::Relaxed))?;
            d.set_item("stages", crate::stats::stages_to_py(py, &s)?)?;
        }
        d.set_item("gil", self.spec.gil.to_py(py)?)?;
        Ok(d)
    }

    /// The tuner's recent ticks of the pipeline running now (the loaders' `tuner_trace()`
    /// layout), oldest first; empty before the first `iter()` and with the tuner off.
    fn tuner_trace<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyList>> {
        let run = &self.run;
        let trace = crate::lifecycle::released(py, || {
            let run = run.lock().expect("run");
            run.live
                .as_ref()
                .map(|l| l.pipeline.tuner_trace())
                .unwrap_or_default()
        });
        crate::stats::trace_to_py(py, trace)
    }

    /// The epoch's next result; `StopIteration` at its end (a result may be `None`).
    fn _next(&self, py: Python<'_>) -> PyResult<Py<PyAny>> {
        let (run, failed, closed) = (&self.run, &self.spec.failed, &self.closed);
        let mut ended = false;
        let ended = &mut ended;
        // Waits in slices with the GIL released, checking for signals between them: Ctrl-C
        // raises KeyboardInterrupt within a slice, not after the next item.
        let r = loop {
            let r = crate::lifecycle::released(py, || {
                if closed.load(Ordering::Relaxed) {
                    // close() ended the epoch being iterated.
                    return Some(Err(PipelineError::stopped()));
                }
                let mut g = run.lock().expect("run");
                let Run { passes, live } = &mut *g;
                // An epoch the parent started before a fork is not this process's to read.
                let Some(l) = live.as_mut().filter(|l| l.pid == std::process::id()) else {
                    return Some(Ok(None));
                };
                if !passes.in_epoch() {
                    return Some(Ok(None));
                }
                match l.pipeline.next_within(SLICE) {
                    // A batch the fetch left out (every item failed, in one process): passed
                    // over, and said in the epoch's report.
                    Within::Next(Ok(x)) if crate::stages::is_left_out(x.get()) => None,
                    Within::Next(Ok(x)) => {
                        passes.took();
                        Some(Ok(Some(x)))
                    }
                    Within::Next(Err(e)) => {
                        // Over: the next pass reads the next epoch.
                        drop(g.stop(true));
                        Some(Err(e))
                    }
                    Within::EpochEnd => {
                        passes.ended();
                        // Every item failed: an error, not an empty epoch (as a Loader's).
                        let (failures, last) = failed.in_epoch();
                        match PipelineError::if_nothing_delivered(
                            failed.epoch(),
                            passes.whole(),
                            passes.taken() > 0,
                            failures,
                            last,
                        ) {
                            Some(e) => Some(Err(e)),
                            None => {
                                *ended = true;
                                Some(Ok(None))
                            }
                        }
                    }
                    Within::TimedOut => None,
                }
            });
            match r {
                Some(r) => break r,
                None => py.check_signals()?,
            }
        };
        // The first skipped item, once, at the result after it or the epoch's end (where the
        // pipeline went on past it, with `skip_errors`: a failure that ended the epoch was not
        // skipped); the epoch's report at its end (`_Pass` and `_Epoch` stand between this and
        // the loop).
        // (Without `skip_errors` the log keeps no first: nothing to say or forget.)
        match (&r, self.spec.skip_errors) {
            (Ok(_), true) => {
                if let Some((_, message)) = failed.take_first() {
                    crate::error::warn_skipped(py, &message, 3)?;
                }
            }
            (Err(_), true) => failed.forget_first(),
            (_, false) => {}
        }
        match r.map_err(to_py)? {
            Some(x) => Ok(x.into_inner()),
            None => {
                let report = match *ended {
                    true => self.report(&self.run.lock().expect("run").passes),
                    false => None,
                };
                if let Some(r) = report {
                    crate::error::warn_skipped(py, &r.to_string(), 3)?;
                }
                match self.spec.source_error.lock().expect("source error").take() {
                    Some(e) => Err(e),
                    None => Err(pyo3::exceptions::PyStopIteration::new_err(())),
                }
            }
        }
    }

    /// The items skipped in `epoch` (default: the epoch being iterated, or the last one
    /// started), of the last 1,000 kept: `(stage, item, message)` tuples.
    #[pyo3(signature = (epoch=None))]
    fn failures(&self, epoch: Option<u64>) -> Vec<(String, String, String)> {
        let log = &self.spec.failed;
        log.of(epoch.unwrap_or_else(|| log.epoch()))
            .into_iter()
            .map(|f| (f.stage, f.item, f.message))
            .collect()
    }

    /// Stops the pipeline and joins its threads: an iterator running at the time raises
    /// `LoaderError`; a later `iter()` starts the threads again. Where it stopped stays the
    /// checkpoint; the next pass starts where the passes' rule says (see [`Passes`]).
    fn close(&self, py: Python<'_>) {
        self.closed.store(true, Ordering::Relaxed);
        let old = self.lock(py).stop(false);
        // Joined with the lock free: a stage's call may be waiting for it (`stats()`).
        if let Some(old) = old {
            old.end(py);
        }
    }
}
