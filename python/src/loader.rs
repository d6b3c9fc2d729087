//! [`Loader`]: the Python face of [`flowgate::Loader`] behind `ImageLoader`, `AudioLoader`
//! and `VideoLoader`: one epoch per Python iterator, batches as zero-copy `Batch`es (with
//! labels and paths as asked), `state_dict`s as plain Python values, the GIL released
//! while waiting and Ctrl-C seen within a slice. The loader itself is the library's.

use std::mem::ManuallyDrop;
use std::sync::Mutex;

use flowgate::loader::LoaderWatch;
use flowgate::{Monitor, Within};
use pyo3::prelude::*;
use pyo3::types::{PyDict, PyList, PyTuple};

use crate::batch::Batch;
use crate::error::to_py;
use crate::state::{state_from_py, state_to_py};
use crate::values::field_to_py;

/// Whether the interpreter's exit has begun (see `lifecycle`): a pipeline is then left to the
/// process's end, not closed.
fn exiting() -> bool {
    crate::EXITING.load(std::sync::atomic::Ordering::SeqCst)
}

/// How long `_next` waits with the GIL released before it checks for a signal (Ctrl-C).
pub(crate) const SLICE: std::time::Duration = std::time::Duration::from_millis(50);

/// The library's loader, and which Python iterator iterates its epoch.
struct Core {
    loader: flowgate::Loader,
    /// Counts started epochs: names the Python iterator of the current one, so that only it
    /// can abandon it.
    iterators: u64,
    /// The iterator whose epoch `load_state_dict` ended mid-way: its next call raises (it
    /// ended quietly, as if its epoch were over).
    ended_by_load: Option<u64>,
}

/// The keys of a batch delivered as a dict (a loader with `fields=`): the media's fields,
/// then `label` and `path` where asked, then the named fields.
pub(crate) struct Names {
    pub(crate) media: Vec<String>,
    pub(crate) label: bool,
    path: bool,
}

impl Names {
    /// `media`: the tensors' names ([`flowgate::loader::LoaderBuilder::tensor_names`]).
    pub(crate) fn new(media: Vec<String>, labels: bool, paths: bool) -> Self {
        Self {
            media,
            label: labels,
            path: paths,
        }
    }

    /// Refuses a field named as a key the batch already has, by the library's rule
    /// ([`flowgate::loader::BatchKeys`]), with Python's own keys: `path` where asked, and a
    /// `map=` or `map_batch=` dict's `index` and `epoch`.
    pub(crate) fn check(&self, fields: &[String], map: bool) -> PyResult<()> {
        let own = [("path", self.path), ("index", map), ("epoch", map)];
        flowgate::loader::BatchKeys::new(&self.media, self.label)
            .reserve(own.into_iter().filter(|&(_, on)| on).map(|(k, _)| k))
            .check(fields)
            .map_err(|e| pyo3::exceptions::PyValueError::new_err(format!("fields: {e}")))
    }
}

/// What a loop `load_state_dict()` ended says at its next step.
fn ended_by_load() -> PyErr {
    pyo3::exceptions::PyRuntimeError::new_err(
        "load_state_dict() during this loop ended it: iter() again continues from the loaded \
         state",
    )
}

/// A native loader; see `flowgate.ImageLoader` and `flowgate.AudioLoader`.
#[pyclass(module = "flowgate._native")]
pub(crate) struct Loader {
    /// Dropped only in the process that built it (see `Drop`).
    core: ManuallyDrop<Mutex<Core>>,
    /// The process that built the loader: its threads exist only there.
    pid: u32,
    /// Statistics and failures, read without `core`'s lock (which `_next` holds while it
    /// waits for a batch).
    watch: LoaderWatch,
    batches_per_epoch: usize,
    classes: Option<Vec<String>>,
    return_paths: bool,
    /// With fields besides the media, the batch's keys (a dict); else tuples.
    names: Option<Names>,
    sim_log: Option<flowgate::device::SimLog>,
    /// The Prometheus endpoint (`metrics_port=`), while it serves.
    metrics: Mutex<Option<flowgate::prometheus::Endpoint>>,
    /// With `map=`: the token its function's calls run under ([`crate::map::calling`]).
    pub(crate) map_token: Option<u64>,
    /// With `map=`: its calls' clock (`stats()["gil"]`).
    pub(crate) gil: Option<std::sync::Arc<crate::gil::GilClock>>,
    /// The disk caches of tar shards on S3 it reads (`stats()["shard_caches"]`).
    #[cfg(feature = "s3")]
    shard_caches: Vec<std::sync::Arc<flowgate::dataset::shards::ShardCache>>,
}

impl Drop for Loader {
    /// A loader freed mid-epoch joins its threads (each finishing the item in hand): with the
    /// GIL released, so the process's other Python threads run meanwhile. (Freed from Python,
    /// this runs in the object's deallocation, where this thread holds the GIL.)
    ///
    /// In a process forked from the one that built it (a DataLoader worker freeing the copy it
    /// inherited, a child rebinding the name) the loader's threads do not exist, and closing
    /// would wait for them forever (its lock may even be held by one of them): the copy is
    /// forgotten instead, its memory left as the fork made it.
    fn drop(&mut self) {
        if self.pid != std::process::id() {
            // The endpoint's thread is the parent's too; its socket is closed here.
            if let Some(e) = self.metrics.get_mut().ok().and_then(Option::take) {
                e.forget_in_fork();
            }
            return;
        }
        if crate::lifecycle::on_pipeline_thread() {
            // Freed by the garbage collector during a `map=` call on one of its own threads,
            // which cannot join itself: stopped from a thread of its own, which exit joins.
            // SAFETY: `core` is not used again: this is the loader's drop.
            let core = unsafe { ManuallyDrop::take(&mut self.core) };
            crate::lifecycle::drop_elsewhere(
                core.into_inner().unwrap_or_else(|p| p.into_inner()).loader,
            );
            return;
        }
        if !crate::EXITING.load(std::sync::atomic::Ordering::SeqCst) {
            let core = self.core.get_mut().unwrap_or_else(|p| p.into_inner());
            // SAFETY: a pyclass is dropped by its type's deallocation, with the GIL held.
            let py = unsafe { Python::assume_gil_acquired() };
            crate::lifecycle::released(py, || core.loader.close());
        }
        // SAFETY: `core` is not used again: this is the loader's drop.
        unsafe { ManuallyDrop::drop(&mut self.core) };
    }
}

impl Loader {
    /// `dict`: batches are dicts even without fields besides the media (a per-batch function
    /// names its keys).
    pub(crate) fn new(
        loader: flowgate::Loader,
        return_paths: bool,
        names: Names,
        dict: bool,
    ) -> PyResult<Self> {
        #[cfg(feature = "s3")]
        let shard_caches = loader.dataset().shard_caches();
        let fields = loader.field_names();
        // Labels a mixture's sources name themselves count too.
        let mut names = names;
        names.label |= loader.dataset().has_labels();
        names.check(fields, false)?;
        let names = (!fields.is_empty() || dict).then_some(names);
        Ok(Self {
            names,
            watch: loader.watch(),
            batches_per_epoch: loader.len(),
            classes: loader.classes().map(<[String]>::to_vec),
            sim_log: loader.sim_log().cloned(),
            return_paths,
            core: ManuallyDrop::new(Mutex::new(Core {
                loader,
                iterators: 0,
                ended_by_load: None,
            })),
            pid: std::process::id(),
            metrics: Mutex::new(None),
            gil: None,
            map_token: None,
            #[cfg(feature = "s3")]
            shard_caches,
        })
    }
}

impl Loader {
    /// The iterator `load_state_dict` ended mid-way, if any.
    fn ended_by_load(&self) -> Option<u64> {
        self.core.lock().expect("loader").ended_by_load
    }

    /// Refuses what would stop or start this loader's pipeline from inside its own `map=`
    /// function (the pipeline would wait for the very thread asking).
    fn not_from_own_map(&self, what: &str) -> PyResult<()> {
        if crate::map::calling(self.map_token) {
            return Err(pyo3::exceptions::PyRuntimeError::new_err(format!(
                "{what}: not from inside the loader's own map= or map_batch= function (it runs \
                 on the loader's threads, which this would stop or wait for)"
            )));
        }
        Ok(())
    }

    /// A batch as a dict: its media under their names, `label` and `path` where asked, and
    /// each named field's values as a list in the batch's order.
    fn as_dict<'py>(
        &self,
        py: Python<'py>,
        batch: flowgate::loader::Batch,
        paths: Option<Vec<String>>,
    ) -> PyResult<Bound<'py, PyAny>> {
        let d = PyDict::new(py);
        for (name, v) in batch.extra_names.iter().enumerate().map(|(k, n)| {
            let values = batch.items.iter().map(move |m| m.extras.get(k));
            (n, values)
        }) {
            let list = PyList::empty(py);
            for x in v {
                match x {
                    Some(x) => list.append(field_to_py(py, x)?)?,
                    None => list.append(py.None())?,
                }
            }
            d.set_item(name, list)?;
        }
        let flowgate::loader::Batch {
            fields,
            labels,
            names: tensors,
            ..
        } = batch;
        let first = PyDict::new(py);
        for (name, m) in tensors.iter().zip(fields) {
            first.set_item(name, Bound::new(py, Batch::from(m))?)?;
        }
        if let Some(l) = labels {
            first.set_item("label", Bound::new(py, Batch::from(l))?)?;
        }
        if let Some(p) = paths {
            first.set_item("path", PyList::new(py, p)?)?;
        }
        first.update(d.as_mapping())?;
        Ok(first.into_any())
    }

    /// The current pipeline's monitor; builds the pipeline (waiting for the lock with the
    /// GIL released) if there is none yet.
    fn monitor(&self, py: Python<'_>) -> PyResult<Monitor> {
        if let Some(m) = self.watch.monitor() {
            return Ok(m);
        }
        // No pipeline runs: it is being stopped (by the loop, which holds the loader while it
        // joins the very thread asking) or not started. From the loader's own function,
        // waiting for it would never end, and starting one is not the function's to do.
        if crate::map::calling(self.map_token) {
            return Err(pyo3::exceptions::PyRuntimeError::new_err(
                "the loader's pipeline is stopping: its statistics are not to be had from \
                 inside its own map= or map_batch= function now",
            ));
        }
        let core = &self.core;
        crate::lifecycle::released(py, || core.lock().expect("loader").loader.monitor())
            .map_err(to_py)
    }
}

#[pymethods]
impl Loader {
    /// Starts an epoch (the next one, the resumed one after `load_state_dict`, or an abandoned
    /// one again). Returns the epoch's iterator number, for `_abandon`, and — when it starts
    /// an abandoned epoch again (one being iterated is abandoned first) — that epoch and the
    /// batches it had delivered.
    fn _start_epoch(&self, py: Python<'_>) -> PyResult<(u64, Option<(u64, usize)>)> {
        self.not_from_own_map("iterating")?;
        let core = &self.core;
        crate::lifecycle::released(py, || {
            let mut c = core.lock().expect("loader");
            if c.loader.in_epoch() {
                c.loader.close();
            }
            let again = c.loader.abandoned_epoch();
            c.loader.start_epoch()?;
            c.iterators += 1;
            Ok((c.iterators, again))
        })
        .map_err(to_py)
    }

    /// Called when the Python iterator number `iterator` is freed: if its epoch is still
    /// being iterated (a `break`), the pipeline stops now and frees its buffers; the next
    /// iterator starts that epoch again from where it started.
    fn _abandon(&self, py: Python<'_>, iterator: u64) {
        if crate::map::calling(self.map_token) || exiting() {
            // An iterator freed inside the function: its epoch is abandoned by the next.
            return;
        }
        let core = &self.core;
        crate::lifecycle::released(py, || {
            let mut c = core.lock().expect("loader");
            if c.loader.in_epoch() && c.iterators == iterator {
                c.loader.close();
            }
        });
    }

    /// The next batch of the epoch, or None at its end: a `Batch`, or a tuple of it, the
    /// labels (an int64 `Batch`) and the paths (a list of str), as configured. Releases the
    /// GIL while waiting.
    #[pyo3(signature = (iterator=None))]
    fn _next<'py>(
        &self,
        py: Python<'py>,
        iterator: Option<u64>,
    ) -> PyResult<Option<Bound<'py, PyAny>>> {
        self.not_from_own_map("iterating")?;
        if iterator.is_some() && iterator == self.ended_by_load() {
            return Err(ended_by_load());
        }
        let core = &self.core;
        // Waits in slices, checking for signals between them: Ctrl-C raises
        // KeyboardInterrupt within a slice, not after the next batch.
        let batch = loop {
            match crate::lifecycle::released(py, || {
                let mut c = core.lock().expect("loader");
                if iterator.is_some_and(|i| i != c.iterators) {
                    // A newer iterator took the epoch over: this one has ended (it must
                    // not take that one's batches).
                    return Within::EpochEnd;
                }
                c.loader.next_within(SLICE)
            }) {
                Within::Next(Ok(b)) => break b,
                Within::Next(Err(e)) => return Err(to_py(e)),
                // Ended while it waited, by a load_state_dict() from another thread.
                Within::EpochEnd if iterator.is_some() && iterator == self.ended_by_load() => {
                    return Err(ended_by_load())
                }
                Within::EpochEnd => {
                    // What the epoch skipped, said at its end (the library logged it too):
                    // the first skipped item first, where no batch came after it.
                    let (first, report) = {
                        let mut c = core.lock().expect("loader");
                        (c.loader.take_first_skip(), c.loader.take_epoch_report())
                    };
                    if let Some((_, message)) = first {
                        crate::error::warn_skipped(py, &message, 2)?;
                    }
                    if let Some(r) = report {
                        crate::error::warn_skipped(py, &r.to_string(), 2)?;
                    }
                    return Ok(None);
                }
                Within::TimedOut => py.check_signals()?,
            }
        };
        // The loader's first skipped item, said once, at the batch after it.
        let first = core.lock().expect("loader").loader.take_first_skip();
        if let Some((_, message)) = first {
            crate::error::warn_skipped(py, &message, 2)?;
        }
        let paths = self.return_paths.then(|| {
            let c = core.lock().expect("loader");
            batch
                .items
                .iter()
                .map(|m| c.loader.path_of(m))
                .collect::<Vec<_>>()
        });
        if self.names.is_some() {
            return self.as_dict(py, batch, paths).map(Some);
        }
        let flowgate::loader::Batch { fields, labels, .. } = batch;
        let mut out = fields
            .into_iter()
            .chain(labels)
            .map(|m| Ok(Bound::new(py, Batch::from(m))?.into_any()))
            .collect::<PyResult<Vec<_>>>()?;
        match paths {
            None if out.len() == 1 => return Ok(out.pop()),
            None => {}
            Some(paths) => out.push(PyList::new(py, paths)?.into_any()),
        }
        Ok(Some(PyTuple::new(py, out)?.into_any()))
    }

    /// The simulated device's record (`device="simulated"`, for tests), oldest first:
    /// `("copy", id, bytes)`, `("stream_wait", id, stream, complete)`, `("host_wait", id,
    /// thread)`, `("free", id, bytes, streams)`; None for another device.
    fn _device_log<'py>(&self, py: Python<'py>) -> PyResult<Option<Bound<'py, PyList>>> {
        self.sim_log
            .as_ref()
            .map(|log| crate::device::log_to_py(py, log))
            .transpose()
    }

    /// Device bytes of the simulated device's batches not freed yet, and the most at once.
    fn _device_bytes(&self) -> Option<(u64, u64)> {
        self.sim_log
            .as_ref()
            .map(|l| (l.live_bytes(), l.peak_live_bytes()))
    }

    /// The class names, index = label (`labels="folder"`), or None.
    #[getter]
    fn classes(&self) -> Option<Vec<String>> {
        self.classes.clone()
    }

    /// Batches per epoch.
    fn __len__(&self) -> usize {
        self.batches_per_epoch
    }

    /// The epoch being iterated, or the next one.
    #[getter]
    fn epoch(&self, py: Python<'_>) -> PyResult<u64> {
        Ok(self.monitor(py)?.epoch())
    }

    /// Statistics: delivered batches, failures, consumer wait, per-stage workers and rates.
    /// Returns at once, also from another thread while `_next` waits for a batch.
    fn stats<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyDict>> {
        let s = self.monitor(py)?.stats();
        let d = PyDict::new(py);
        d.set_item("delivered", s.delivered)?;
        d.set_item("failures", s.failures)?;
        // Items read again to make up batches lost to skipped ones (`fill_skipped`).
        d.set_item("filled", self.watch.filled())?;
        d.set_item("consumer_wait_s", s.consumer_wait.as_secs_f64())?;
        // With map=: what its Python calls took, and whether the GIL held its threads back.
        if let Some(g) = &self.gil {
            d.set_item("gil", g.to_py(py)?)?;
        }
        // The budget everything the loader holds stays within, and where it came from (set,
        // or the default from the host's or the container's memory).
        if let Some(m) = &s.memory_budget {
            let b = PyDict::new(py);
            b.set_item("bytes", m.bytes)?;
            b.set_item("source", &m.source)?;
            d.set_item("memory_budget", b)?;
        }
        // What each disk cache of shards on S3 holds against its limit and working set.
        #[cfg(feature = "s3")]
        if !self.shard_caches.is_empty() {
            let caches = PyList::empty(py);
            for c in &self.shard_caches {
                let cs = c.stats();
                let x = PyDict::new(py);
                x.set_item("bytes", cs.bytes)?;
                x.set_item("limit", cs.limit)?;
                x.set_item("pinned", cs.pinned)?;
                x.set_item("downloads", cs.downloads)?;
                x.set_item("evictions", cs.evictions)?;
                caches.append(x)?;
            }
            d.set_item("shard_caches", caches)?;
        }
        d.set_item("stages", crate::stats::stages_to_py(py, &s)?)?;
        // Everything the loader holds now, as the memory budget counts it.
        d.set_item("bytes", s.bytes_held())?;
        Ok(d)
    }

    /// The pipeline's pace since it started (`flowgate::board::summary`): `items_per_s`,
    /// `wait` (the share of the time the loop waited), `bottleneck` (a stage, or "step") and
    /// `held_back_by` (it in words).
    fn _pace<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyDict>> {
        let p = flowgate::board::summary(&self.monitor(py)?.stats(), None);
        let d = PyDict::new(py);
        d.set_item("items_per_s", p.items_per_s)?;
        d.set_item("wait", p.wait)?;
        d.set_item("held_back_by", p.held_back_by())?;
        d.set_item("bottleneck", p.bottleneck)?;
        Ok(d)
    }

    /// The tuner's recent ticks, oldest first: dicts of `t` (seconds since the pipeline
    /// started), `rate` (batches/s), `wait` (fraction of the tick the consumer waited),
    /// `stages`, `workers` and `budgets` (per stage), `bytes` (buffered), `memory_budget`,
    /// `rss_bytes`, `decisions` (what changed and why, as strings), and on a node CPU
    /// budget `cpu`: a dict of `budget` (the node's cores), `node_busy` (cores the node's ranks
    /// held at the tick), `held` (this rank's), `share` (cores this rank used over the tick),
    /// `waited` (its workers' seconds waiting for a core, per second) and `why` (a sentence
    /// when the share moved by half a core, else None). Empty with the tuner off. Returns at
    /// once, from any thread.
    fn tuner_trace<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyList>> {
        crate::stats::trace_to_py(py, self.monitor(py)?.tuner_trace())
    }

    /// The failures skipped in `epoch` (default: the epoch being iterated, or the last one
    /// started), of the last 1,000 kept: (stage, item, message) tuples.
    #[pyo3(signature = (epoch=None))]
    fn failures(&self, epoch: Option<u64>) -> Vec<(String, String, String)> {
        self.watch
            .failures(epoch)
            .into_iter()
            .map(|f| (f.stage, f.item, f.message))
            .collect()
    }

    /// Makes `epoch` the next epoch iterated (as `DistributedSampler.set_epoch`): its order
    /// and augmentation follow from the seed and the epoch. A no-op when it is already the
    /// next (a position loaded by `load_state_dict` is kept); an epoch being iterated is
    /// abandoned.
    fn set_epoch(&self, py: Python<'_>, epoch: u64) -> PyResult<()> {
        self.not_from_own_map("set_epoch")?;
        let core = &self.core;
        crate::lifecycle::released(py, || core.lock().expect("loader").loader.set_epoch(epoch));
        Ok(())
    }

    /// The epoch the next iterator starts, or the one being iterated; builds nothing (safe
    /// to ask just before a `fork`).
    fn _next_epoch(&self, py: Python<'_>) -> u64 {
        let core = &self.core;
        crate::lifecycle::released(py, || core.lock().expect("loader").loader.next_epoch())
    }

    /// The epoch a process forked now starts at (`_next_epoch`), asked by the `fork` hook
    /// without waiting: a fork from the loader's own `map=` function can happen while the
    /// loop holds the loader, waiting for that very function (a `break` joining its thread).
    /// Then the epoch the running pipeline iterates, or None (unknown: the last one noted
    /// stands).
    fn _epoch_for_fork(&self) -> Option<u64> {
        match self.core.try_lock() {
            Ok(c) => Some(c.loader.next_epoch()),
            Err(_) => self.watch.monitor().map(|m| m.epoch()),
        }
    }

    /// The decode workers a rebuilt pipeline starts with: what the last one ended with, or
    /// `None` (its share of the cores) before any rebuild; builds nothing.
    fn _learned_workers(&self, py: Python<'_>) -> Option<usize> {
        let core = &self.core;
        crate::lifecycle::released(py, || core.lock().expect("loader").loader.learned_workers())
    }

    /// A checkpoint of the consumer's progress (plain ints and lists: picklable, JSON-able).
    /// Waits for the loader's lock with the GIL released: between batches it is free at once.
    fn state_dict<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyDict>> {
        // A checkpoint is the training loop's position, which the loop holds the loader for
        // while it waits: from the loader's own function it would wait for the loop (and
        // for ever once the loop stops the epoch, joining this thread).
        self.not_from_own_map("state_dict")?;
        let core = &self.core;
        let s = crate::lifecycle::released(py, || core.lock().expect("loader").loader.state())
            .map_err(to_py)?;
        state_to_py(py, &s)
    }

    /// Continues from `state_dict()`: the next iterator yields exactly what was not delivered
    /// yet in that epoch.
    fn load_state_dict(&self, py: Python<'_>, state: &Bound<'_, PyDict>) -> PyResult<()> {
        self.not_from_own_map("load_state_dict")?;
        let s = state_from_py(state)?;
        let core = &self.core;
        crate::lifecycle::released(py, || {
            let mut c = core.lock().expect("loader");
            let live = c.loader.in_epoch().then_some(c.iterators);
            c.loader.resume(&s)?;
            if live.is_some() {
                c.ended_by_load = live;
            }
            Ok(())
        })
        .map_err(to_py)
    }

    /// Starts the epoch the next iterator would run as units for other processes to decode
    /// (`Loader::start_units`): its plan, cut into units of `batches_per_unit` batches, the
    /// iterator's number (for `_abandon`) and, as `_start_epoch`, an abandoned epoch started
    /// again. The loader keeps the epoch as its own (its checkpoint, failures, a break).
    #[allow(clippy::type_complexity)]
    fn _start_units(
        &self,
        py: Python<'_>,
        batches_per_unit: usize,
    ) -> PyResult<(crate::units::EpochPlan, u64, Option<(u64, usize)>)> {
        let core = &self.core;
        crate::lifecycle::released(py, || {
            let mut c = core.lock().expect("loader");
            if c.loader.in_epoch() {
                c.loader.close();
            }
            let again = c.loader.abandoned_epoch();
            let plan = c.loader.start_units(batches_per_unit)?;
            c.iterators += 1;
            Ok((crate::units::EpochPlan { plan }, c.iterators, again))
        })
        .map_err(to_py)
    }

    /// A batch of the epoch of units was handed to the loop: its rows' positions
    /// (`[start, end)` pairs).
    fn _units_delivered(&self, positions: Vec<(u64, u64)>) {
        let positions = flowgate::actors::origin::RangeSet::from_ranges(positions);
        self.core
            .lock()
            .expect("loader")
            .loader
            .units_delivered(&positions);
    }

    /// Failures a unit's loader skipped: `(stage, item, message)` tuples, as `failures()`
    /// gives them.
    fn _units_failed(&self, failures: Vec<(String, String, String)>) {
        let failures =
            failures
                .into_iter()
                .map(|(stage, item, message)| flowgate::loader::SkippedFailure {
                    epoch: 0,
                    stage,
                    item,
                    message,
                });
        self.core
            .lock()
            .expect("loader")
            .loader
            .units_failed(failures);
    }

    /// The epoch of units ended by a unit's error: over, as a local epoch an error ends.
    fn _fail_units(&self) {
        self.core.lock().expect("loader").loader.fail_units();
    }

    /// Every unit of the epoch was delivered: True where batches lost to skipped items are
    /// made up now (`fill_skipped`; take them with `_next`), else the epoch ended; raises
    /// `LoaderError` if every item failed.
    fn _finish_units(&self) -> PyResult<bool> {
        self.core
            .lock()
            .expect("loader")
            .loader
            .finish_units()
            .map_err(to_py)
    }

    /// Serves Prometheus metrics on `GET http://address/metrics` (the library's renderer and
    /// its reading of an address, as `flowgate run`'s endpoint): the running pipeline's
    /// statistics at each scrape, every series labelled with the rank (`RANK`, `LOCAL_RANK`).
    /// Port 0 picks a free one. Returns the address served.
    fn _serve_metrics(&self, address: &str) -> PyResult<(String, u16)> {
        let addr = flowgate::prometheus::address(address)
            .map_err(|e| pyo3::exceptions::PyValueError::new_err(format!("metrics_port: {e}")))?;
        let watch = self.watch.clone();
        let labels = flowgate::prometheus::rank_labels();
        let endpoint = flowgate::prometheus::Endpoint::serve(addr, move || {
            let stats = watch.monitor().map(|m| m.stats()).unwrap_or_default();
            flowgate::prometheus::render(&stats, &labels)
        })
        .map_err(|e| pyo3::exceptions::PyOSError::new_err(e.to_string()))?;
        let served = endpoint.addr();
        *self.metrics.lock().expect("metrics") = Some(endpoint);
        Ok((served.ip().to_string(), served.port()))
    }

    /// In a forked child (a DataLoader worker): closes this process's copy of the endpoint's
    /// socket, so the port stays the parent's alone.
    fn _forget_metrics_in_fork(&self) {
        if self.pid != std::process::id() {
            // A lock a parent's thread held at the fork stays held here: then leave it.
            if let Ok(mut m) = self.metrics.try_lock() {
                if let Some(e) = m.take() {
                    e.forget_in_fork();
                }
            }
        }
    }

    /// Stops the Prometheus endpoint, if one serves.
    fn _stop_metrics(&self, py: Python<'_>) {
        let endpoint = self.metrics.lock().expect("metrics").take();
        crate::lifecycle::released(py, || drop(endpoint));
    }

    /// Stops the pipeline and joins its threads (also done when the loader is freed).
    fn close(&self, py: Python<'_>) -> PyResult<()> {
        self.not_from_own_map("close")?;
        if exiting() {
            // The interpreter is stopping: the pipeline's threads that were about to call
            // Python are parked for good, and joining them would wait forever (an iterator
            // freed at exit, after an exception escaped the loop, hung the process).
            return Ok(());
        }
        let core = &self.core;
        crate::lifecycle::released(py, || {
            core.lock().expect("loader").loader.close();
        });
        Ok(())
    }
}
