//! [`PyPipeline`]: a pipeline whose source and stages are Python callables (they take the GIL;
//! the engine's threads, queues and tuner do not). Its source is a Python iterable, or the
//! positions of a map-style dataset in the library's order (shuffle, ranks, equal counts),
//! which `flowgate.DataLoader` builds on: checkpoints of that one resume exactly.

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Mutex;

use flowgate::loader::LoaderSettings;
use flowgate::{Order, Pipeline, PipelineError, PipelineState, Within};
use pyo3::exceptions::PyValueError;
use pyo3::prelude::*;
use pyo3::types::{PyDict, PyList};

use crate::error::to_py;
use crate::fork::PyItem;
use crate::lifecycle::{drop_elsewhere, on_pipeline_thread};
use crate::loader::SLICE;
use crate::stages::{batching, Items, Spec, StageSpec};
use crate::state::{state_from_py, state_to_py};

/// Where the next epoch starts, once `set_epoch` or `load_state_dict` said so.
enum Start {
    Epoch(u64),
    State(Box<PipelineState>),
    /// Closed mid-epoch: `state_dict()` is where it stopped; the next pass starts epoch
    /// `next` (as after a loop left mid-way).
    Closed {
        state: Box<PipelineState>,
        next: u64,
    },
}

/// A pipeline of Python callables; see `flowgate.Pipeline`.
#[pyclass(module = "flowgate._native", name = "Pipeline")]
pub(crate) struct PyPipeline {
    /// What it is built from: its source, stages and settings.
    spec: Spec,
    /// Where the next epoch starts, when set.
    start: Mutex<Option<Start>>,
    /// The built pipeline, whether an epoch of it is being iterated, and the process whose
    /// threads run it (after a `fork` the child has none of them).
    running: Mutex<Option<Running>>,
    /// Closed (`close()`) since the last epoch started: an iterator still running says so.
    closed: AtomicBool,
}

impl From<Spec> for PyPipeline {
    fn from(spec: Spec) -> Self {
        Self {
            spec,
            start: Mutex::default(),
            running: Mutex::new(None),
            closed: AtomicBool::new(false),
        }
    }
}

struct Running {
    pipeline: Pipeline<PyItem>,
    in_epoch: bool,
    pid: u32,
    /// Built to resume a state that had delivered results: its next epoch may deliver
    /// nothing (its rest may all fail).
    resumed_after_results: bool,
    /// Results the epoch delivered; `None` for the rest of a resumed epoch.
    delivered: Option<u64>,
    /// The epoch being iterated.
    epoch: u64,
    /// Built to resume this state: where its first epoch starts.
    resumed_from: Option<Box<PipelineState>>,
    /// Where the epoch being iterated started (its beginning, or a resumed state), and the
    /// results this pass took: a map-style dataset's pass left after one (a peek) starts there
    /// again.
    began: Option<Start>,
    taken: u64,
    /// Results the pass is to make with nothing skipped (a map-style dataset's: `len()`, or
    /// the rest of a resumed epoch), for its report.
    due: Option<usize>,
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

impl Drop for PyPipeline {
    fn drop(&mut self) {
        if let Some(r) = self.running.get_mut().ok().and_then(Option::take) {
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

    /// What an epoch that ended has to say of its skipped items and its result count (the
    /// library's [`EpochReport`](flowgate::loader::EpochReport)): against the results due (a
    /// map-style dataset's `len()`, or the rest of a resumed epoch).
    fn report(&self, run: &Running) -> Option<flowgate::loader::EpochReport> {
        let (skipped, _) = self.spec.failed.in_epoch();
        let delivered = run.taken as usize;
        let (due, len) = match (&self.spec.items, run.due) {
            (Items::Indexed { share, .. }, Some(due)) => (due, self.spec.results_of(*share)),
            _ => (delivered, delivered),
        };
        let filled = self.spec.filled.load(Ordering::Relaxed);
        flowgate::loader::EpochReport::of(run.epoch, skipped, delivered, due, len, filled)
    }

    /// Whether the pass of `run` was left before its epoch's end at no cost of an epoch: a
    /// map-style dataset's epoch read by several ranks (as `DistributedSampler`'s, every pass
    /// of an epoch reads it until one reads it through, so a rank that peeks, or breaks after
    /// a few batches to log them, keeps the others' epoch; otherwise the ranks read 46 of 61
    /// items an epoch once one broke after two batches), or one result or none taken of an
    /// epoch resumed from a state (its rest is not skipped). One process's other passes are
    /// one more epoch each, as torch's `RandomSampler` draws anew: `next(iter(loader))` each
    /// step is not one batch for ever.
    fn peeked(&self, run: &Running) -> bool {
        let shared = matches!(self.spec.items, Items::Indexed { world, .. } if world > 1);
        let resumed = matches!(run.began, Some(Start::State(_)));
        run.in_epoch
            && matches!(self.spec.items, Items::Indexed { .. })
            && (shared || (resumed && run.taken <= 1))
    }

    /// A pipeline to read from, built if there is none (or the one there was made before a
    /// fork), at the epoch or state `set_epoch` or `load_state_dict` named.
    fn running<'a>(&self, py: Python<'_>, r: &'a mut Option<Running>) -> PyResult<&'a mut Running> {
        let start = self.start.lock().expect("start").take();
        let here = std::process::id();
        if start.is_some() || r.as_ref().is_none_or(|run| run.pid != here) {
            if let Some(old) = r.take() {
                old.end(py);
            }
            let mut p = self.spec.build(py).map_err(to_py)?;
            let mut resumed_after_results = false;
            let mut resumed_from = None;
            match start {
                Some(Start::Epoch(e) | Start::Closed { next: e, .. }) => {
                    p.start_at_epoch(e).map_err(to_py)?
                }
                Some(Start::State(s)) => {
                    p.resume(&s).map_err(to_py)?;
                    resumed_after_results = s.delivered_items > 0;
                    resumed_from = Some(s);
                }
                None => {}
            }
            *r = Some(Running {
                pipeline: p,
                in_epoch: false,
                pid: here,
                resumed_after_results,
                delivered: None,
                epoch: 0,
                resumed_from,
                began: None,
                taken: 0,
                due: None,
            });
        }
        Ok(r.as_mut().expect("built"))
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

    /// Starts an epoch (building the pipeline the first time, and again in a forked child:
    /// at the epoch the parent was in, or the next if it was between epochs).
    fn _start_epoch(&self, py: Python<'_>) -> PyResult<()> {
        let mut r = self.running.lock().expect("running");
        if let Some(run) = r.as_mut() {
            let mut start = self.start.lock().expect("start");
            let here = run.pid == std::process::id();
            if start.is_none() && here && self.peeked(run) {
                // A pass left early of an epoch shared by ranks (rank 0 logs a batch or two),
                // or after one result of a resumed one, costs no epoch: it starts again where
                // it started, so every rank reads the same epoch's share. (It read the next
                // epoch: shares overlapped, items went unread.)
                *start = run.began.take();
            } else if start.is_none() && (run.in_epoch || !here) {
                // A loop left mid-way goes on with the next epoch; a forked child starts the
                // epoch its parent was in (or the next, between epochs).
                let e = run.pipeline.epoch();
                *start = Some(Start::Epoch(e + u64::from(run.in_epoch && here)));
            }
        }
        let run = self.running(py, &mut r)?;
        run.in_epoch = true;
        run.epoch = run.pipeline.epoch();
        run.taken = 0;
        run.due = match self.spec.items {
            Items::Indexed { .. } => {
                let (per, drop_last) = self.spec.per_result();
                let start = run.pipeline.state();
                Some(flowgate::loader::batches_due(&start, per, drop_last))
            }
            Items::Iterable(_) => None,
        };
        run.began = Some(match run.resumed_from.take() {
            Some(s) => Start::State(s),
            None => Start::Epoch(run.epoch),
        });
        run.delivered = (!std::mem::take(&mut run.resumed_after_results)).then_some(0);
        self.spec.failed.set_epoch(run.epoch);
        self.spec
            .filled
            .store(0, std::sync::atomic::Ordering::Relaxed);
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
        if let Some(Start::State(s) | Start::Closed { state: s, .. }) =
            &*self.start.lock().expect("start")
        {
            return state_to_py(py, s);
        }
        let mut r = self.running.lock().expect("running");
        // The epoch being iterated, though `set_epoch` named the next: not rebuilt for it.
        if let Some(run) = r.as_ref() {
            if run.in_epoch && run.pid == std::process::id() {
                return state_to_py(py, &run.pipeline.state());
            }
        }
        let s = self.running(py, &mut r)?.pipeline.state();
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
                    let f = batching(*size, *drop_last).map(|(k, v)| (k.to_owned(), v));
                    state.fingerprint.extend(f);
                }
            }
        }
        *self.start.lock().expect("start") = Some(Start::State(Box::new(state)));
        // Built now, so that a state of another pipeline is refused here.
        let mut r = self.running.lock().expect("running");
        self.running(py, &mut r).map(drop)
    }

    /// Makes `epoch` the next one started (as `DistributedSampler.set_epoch`): a no-op when
    /// it already is (a resumed position is kept).
    fn set_epoch(&self, epoch: u64) {
        let mut start = self.start.lock().expect("start");
        let next = match &*start {
            Some(Start::Epoch(e) | Start::Closed { next: e, .. }) => *e,
            Some(Start::State(s)) => s.epoch,
            None => match self.running.lock().expect("running").as_ref() {
                // After a peek that costs no epoch the next pass starts this one again (its
                // resumed position kept: setting it then restarted it from its beginning).
                Some(run) if self.peeked(run) => run.epoch,
                Some(run) => run.pipeline.epoch() + u64::from(run.in_epoch),
                None => 0,
            },
        };
        if next != epoch {
            *start = Some(Start::Epoch(epoch));
        }
    }

    /// The stages' statistics and their Python calls': `gil.threads_busy` threads in calls on
    /// `gil.cores_used` cores on average; `gil.bound` when several threads were busy on about
    /// one core (taking turns at the GIL: more threads cannot help).
    fn stats<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyDict>> {
        let d = PyDict::new(py);
        // The lock is taken with the GIL released: `_next` holds it while it waits for a
        // result that a stage's Python call (which may be this one) has to make.
        let running = &self.running;
        let stats = crate::lifecycle::released(py, || {
            running
                .lock()
                .expect("running")
                .as_ref()
                .map(|run| run.pipeline.stats())
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
        let running = &self.running;
        let trace = crate::lifecycle::released(py, || {
            running
                .lock()
                .expect("running")
                .as_ref()
                .map(|run| run.pipeline.tuner_trace())
                .unwrap_or_default()
        });
        crate::stats::trace_to_py(py, trace)
    }

    /// The epoch's next result; `StopIteration` at its end (a result may be `None`).
    fn _next(&self, py: Python<'_>) -> PyResult<Py<PyAny>> {
        let (running, failed, closed) = (&self.running, &self.spec.failed, &self.closed);
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
                let mut g = running.lock().expect("running");
                let Some(run) = g.as_mut() else {
                    return Some(Ok(None));
                };
                // An epoch the parent started before a fork is not this process's to read.
                if !run.in_epoch || run.pid != std::process::id() {
                    return Some(Ok(None));
                }
                match run.pipeline.next_within(SLICE) {
                    // A batch the fetch left out (every item failed, in one process): passed
                    // over, and said in the epoch's report.
                    Within::Next(Ok(x)) if crate::stages::is_left_out(x.get()) => None,
                    Within::Next(Ok(x)) => {
                        run.taken += 1;
                        if let Some(d) = &mut run.delivered {
                            *d += 1;
                        }
                        Some(Ok(Some(x)))
                    }
                    Within::Next(Err(e)) => {
                        drop(g.take());
                        Some(Err(e))
                    }
                    Within::EpochEnd => {
                        run.in_epoch = false;
                        // Every item failed: an error, not an empty epoch (as a Loader's).
                        let (failures, last) = failed.in_epoch();
                        match PipelineError::if_nothing_delivered(
                            run.epoch,
                            run.delivered.is_some(),
                            run.delivered.is_some_and(|n| n > 0),
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
                    true => self
                        .running
                        .lock()
                        .expect("running")
                        .as_ref()
                        .and_then(|run| self.report(run)),
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
    /// `LoaderError`; a later `iter()` starts the threads again.
    fn close(&self, py: Python<'_>) {
        self.closed.store(true, Ordering::Relaxed);
        let r = self.running.lock().expect("running").take();
        if let Some(mut r) = r {
            // Where it stopped stays the checkpoint, and where the next pass starts: the
            // next epoch after one left mid-way, else the state (a loaded one not iterated
            // yet is kept).
            if r.pid == std::process::id() {
                let state = Box::new(r.pipeline.state());
                let peeked = self.peeked(&r);
                let mut start = self.start.lock().expect("start");
                if start.is_none() {
                    *start = Some(match (r.in_epoch, peeked, r.began.take()) {
                        // A peek that costs no epoch: the next pass starts it again where it
                        // started (and the checkpoint says so).
                        (true, true, Some(began)) => began,
                        (true, ..) => Start::Closed {
                            next: r.pipeline.epoch() + 1,
                            state,
                        },
                        (false, ..) => Start::State(state),
                    });
                }
            }
            r.end(py);
        }
    }
}
