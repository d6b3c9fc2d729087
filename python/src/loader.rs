//! [`Loader`]: the native pipeline behind `ImageLoader`, `AudioLoader` and `VideoLoader`:
//! files or tar shards' samples → decode → batch → collate, one epoch per Python iterator,
//! labels and paths per batch, exact resume through `state_dict`.

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};

use flowgate::device::{SimLog, Uploader};
use flowgate::{
    FailureBudget, Monitor, Pipeline, PipelineError, PipelineState, ShardState, Tensor, Within,
    Workers,
};
use pyo3::exceptions::PyValueError;
use pyo3::prelude::*;
use pyo3::types::{PyDict, PyList, PyTuple};

use crate::batch::Batch;
use crate::collated::{collate, nbytes, Extras, Loaded};
use crate::dataset::{Dataset, Decode, Meta};
use crate::device::Device;
use crate::error::to_py;
use crate::state::{state_from_py, state_to_py};

/// Builds the loader's pipeline; given the decode workers the last pipeline ended with (what
/// its tuner learned), the new one starts there instead of at its share of the cores.
type Make = Box<dyn Fn(Option<usize>) -> Result<Pipeline<Loaded>, PipelineError> + Send + Sync>;

/// Keeps the last this many skipped failures.
const KEEP_FAILURES: usize = 1000;

/// One failure the loader skipped: (stage, item, message).
type Failure = (String, String, String);

/// The failures the loader skipped, with the epoch each happened in.
#[derive(Default)]
struct Failures {
    kept: std::collections::VecDeque<(u64, Failure)>,
    /// The epoch started last: failures from now on are counted in it.
    epoch: AtomicU64,
}

struct Core {
    make: Make,
    pipeline: Option<Pipeline<Loaded>>,
    /// Whether an epoch is being iterated (a new Python iterator then starts the next one).
    in_epoch: bool,
    /// The epoch a rebuilt pipeline starts at: the one after an epoch abandoned by an error,
    /// a `close()` or a `break`, so every epoch keeps its own shuffle and augmentation.
    resume_at: u64,
    /// The current pipeline's monitor, read by `stats()` and `epoch` without this lock
    /// (which `_next` holds while it waits for a batch).
    monitor: Arc<Mutex<Option<Monitor>>>,
    /// Counts started epochs: names the Python iterator of the current one, so that only it
    /// can abandon it.
    iterators: u64,
    failures: Arc<Mutex<Failures>>,
    /// The decode workers the last dropped pipeline had (its tuner's choice): a rebuilt one
    /// starts there, so an epoch cut short (`break`) does not cost the next a cold start.
    learned: Option<usize>,
}

impl Core {
    fn pipeline(&mut self) -> Result<&mut Pipeline<Loaded>, PipelineError> {
        if self.pipeline.is_none() {
            let mut p = (self.make)(self.learned)?;
            if self.resume_at > 0 {
                p.start_at_epoch(self.resume_at)?;
            }
            *self.monitor.lock().expect("monitor") = Some(p.monitor());
            self.pipeline = Some(p);
        }
        Ok(self.pipeline.as_mut().expect("built"))
    }

    /// Drops the pipeline (stopping its threads at once); the next one continues at the next
    /// epoch not yet begun (the current one is abandoned if it was being iterated).
    fn drop_pipeline(&mut self) {
        *self.monitor.lock().expect("monitor") = None;
        if let Some(p) = self.pipeline.take() {
            self.resume_at = p.epoch() + u64::from(self.in_epoch);
            self.learned = p.stats().stage("decode").map(|s| s.workers);
        }
        self.in_epoch = false;
    }

    /// Starts an epoch; if the last one was left mid-way, the pipeline is rebuilt to start
    /// the next one cleanly.
    fn start_epoch(&mut self) -> Result<u64, PipelineError> {
        if self.in_epoch {
            self.drop_pipeline();
        }
        let epoch = self.pipeline()?.epoch();
        self.failures
            .lock()
            .expect("failures")
            .epoch
            .store(epoch, Ordering::Relaxed);
        self.in_epoch = true;
        self.iterators += 1;
        Ok(self.iterators)
    }

    /// The epoch the next iterator starts (or the one being iterated), without building a
    /// pipeline.
    fn next_epoch(&self) -> u64 {
        self.pipeline
            .as_ref()
            .map_or(self.resume_at, Pipeline::epoch)
    }

    /// Makes `epoch` the next one iterated; a no-op when it already is (so a loop calling
    /// `set_epoch` keeps a position loaded by `load_state_dict`). An epoch being iterated is
    /// abandoned.
    fn set_epoch(&mut self, epoch: u64) {
        if !self.in_epoch && self.next_epoch() == epoch {
            return;
        }
        self.drop_pipeline();
        self.resume_at = epoch;
    }

    /// The next batch of the epoch (`Ok(None)` at its end), waiting at most `SLICE`:
    /// `Err(None)` if nothing came in that time.
    fn next(&mut self) -> Result<Option<Loaded>, Option<PipelineError>> {
        if !self.in_epoch {
            return Ok(None);
        }
        match self.pipeline().map_err(Some)?.next_within(SLICE) {
            Within::Next(Ok(t)) => Ok(Some(t)),
            Within::Next(Err(e)) => {
                // A failed pipeline is rebuilt, at the next epoch.
                self.drop_pipeline();
                Err(Some(e))
            }
            Within::EpochEnd => {
                self.in_epoch = false;
                Ok(None)
            }
            Within::TimedOut => Err(None),
        }
    }
}

/// How long `_next` waits with the GIL released before it checks for a signal (Ctrl-C).
pub(crate) const SLICE: std::time::Duration = std::time::Duration::from_millis(50);

/// A native loader; see `flowgate.ImageLoader` and `flowgate.AudioLoader`.
#[pyclass(module = "flowgate._native")]
pub(crate) struct Loader {
    core: Mutex<Core>,
    /// The monitor of `core`'s pipeline (see `Core::monitor`).
    monitor: Arc<Mutex<Option<Monitor>>>,
    batches_per_epoch: usize,
    failures: Arc<Mutex<Failures>>,
    /// What the loader reads (names items for `return_paths`).
    dataset: Dataset,
    extras: Extras,
    /// The simulated device's record (`device="simulated"`).
    sim_log: Option<SimLog>,
}

impl Loader {
    // The loader's arguments, one each (Options holds them; passing it would tie this file to
    // the loaders' constructors).
    #[allow(clippy::too_many_arguments)]
    pub(crate) fn new(
        dataset: Dataset,
        extras: Extras,
        decode: Decode,
        item_threads: Option<Arc<flowgate::actors::cache::ItemThreads>>,
        batch_size: usize,
        drop_last: bool,
        workers: Option<usize>,
        skip_errors: bool,
        memory_bytes: Option<u64>,
        device: Option<Device>,
    ) -> PyResult<Self> {
        if batch_size == 0 {
            return Err(PyValueError::new_err("batch_size must be at least 1"));
        }
        let n = dataset.sampler().len();
        let batches_per_epoch = if drop_last {
            n / batch_size
        } else {
            n.div_ceil(batch_size)
        };
        let failures: Arc<Mutex<Failures>> = Arc::default();
        let seen = Arc::clone(&failures);
        let fingerprint = dataset.fingerprint();
        let data = dataset.clone();
        let labels = extras.batch_labels();
        let device = device.map(Arc::new);
        let sim_log = device.as_ref().and_then(|d| d.log.clone());
        let make: Make = Box::new(move |learned: Option<usize>| {
            let uploader = device.as_ref().map(|d| d.uploader());
            let alloc = uploader.as_ref().map(Uploader::host_alloc);
            let labels = labels.clone();
            let decode = Arc::clone(&decode);
            let seen = Arc::clone(&seen);
            let (named, read) = (data.clone(), data.clone());
            let b = Pipeline::builder()
                .source_sampled(data.sampler().clone(), |e, i| (i, e))
                .describe(move |&(i, e): &(usize, u64)| named.name(i, e))
                .pipe(
                    "decode",
                    move |(i, epoch): (usize, u64)| read.load(i, epoch, &decode),
                    match (workers, learned) {
                        (Some(n), _) => Workers::fixed(n),
                        (None, Some(n)) => Workers::initial(n),
                        (None, None) => Workers::auto(),
                    },
                )
                .measure(|(t, _): &(Vec<Tensor>, Meta)| nbytes(t));
            // The decode stage reads what the shards' prefetch fetches: the tuner deepens it.
            let b = match data.read_ahead() {
                Some(r) => b.read_ahead(r),
                None => b,
            };
            // And decodes with the recipe's threads per item, which the tuner sets there.
            let b = match item_threads.clone() {
                Some(t) => b.item_threads(t),
                None => b,
            };
            let b = b
                .aggregate(batch_size, drop_last)
                .pipe(
                    "collate",
                    move |items| collate(items, alloc.as_ref(), labels.as_ref()),
                    1,
                )
                .measure(Loaded::nbytes);
            let b = match uploader {
                Some(up) => b.upload_with(up, |up, l: Loaded| l.upload(up), Loaded::nbytes),
                None => b,
            };
            let b = match device.as_ref().and_then(|d| d.monitor.clone()) {
                Some(m) => b.gpu_utilization(move || m.utilization()),
                None => b,
            };
            let b = b
                .max_failures(if skip_errors {
                    FailureBudget::unlimited()
                } else {
                    FailureBudget::fail_fast()
                })
                .on_failure(move |e| {
                    let mut f = seen.lock().expect("failures");
                    if f.kept.len() == KEEP_FAILURES {
                        f.kept.pop_front();
                    }
                    let epoch = f.epoch.load(Ordering::Relaxed);
                    f.kept.push_back((
                        epoch,
                        (e.stage().to_owned(), e.item().to_owned(), e.to_string()),
                    ));
                });
            // The Parquet row-group cache is memory the stages do not count.
            let b = match data.parquet_cache() {
                0 => b,
                bytes => b.reserve_memory("the Parquet row-group cache", bytes),
            };
            // What a state_dict of this loader is valid for.
            let b = b
                .checkpoint_fields(fingerprint.iter().cloned())
                .checkpoint_fields([
                    ("batch_size", batch_size.to_string()),
                    ("drop_last", drop_last.to_string()),
                ]);
            match memory_bytes {
                Some(m) => b.memory_budget(m).build(),
                None => b.build(),
            }
        });
        let monitor = Arc::<Mutex<Option<Monitor>>>::default();
        Ok(Self {
            core: Mutex::new(Core {
                make,
                pipeline: None,
                in_epoch: false,
                resume_at: 0,
                monitor: Arc::clone(&monitor),
                iterators: 0,
                failures: Arc::clone(&failures),
                learned: None,
            }),
            monitor,
            batches_per_epoch,
            failures,
            dataset,
            extras,
            sim_log,
        })
    }
}

impl Loader {
    /// The current pipeline's monitor; builds the pipeline (waiting for the lock with the
    /// GIL released) if there is none yet.
    fn monitor(&self, py: Python<'_>) -> PyResult<Monitor> {
        if let Some(m) = &*self.monitor.lock().expect("monitor") {
            return Ok(m.clone());
        }
        let core = &self.core;
        py.allow_threads(|| core.lock().expect("loader").pipeline().map(|p| p.monitor()))
            .map_err(to_py)
    }
}

#[pymethods]
impl Loader {
    /// Starts an epoch (the next one, or the resumed one after `load_state_dict`).
    /// Returns the epoch's iterator number, for `_abandon`.
    fn _start_epoch(&self, py: Python<'_>) -> PyResult<u64> {
        let core = &self.core;
        py.allow_threads(|| core.lock().expect("loader").start_epoch())
            .map_err(to_py)
    }

    /// Called when the Python iterator number `iterator` is freed: if its epoch is still
    /// being iterated (a `break`), the pipeline stops now and frees its buffers; the next
    /// iterator starts the next epoch.
    fn _abandon(&self, py: Python<'_>, iterator: u64) {
        let core = &self.core;
        py.allow_threads(|| {
            let mut c = core.lock().expect("loader");
            if c.in_epoch && c.iterators == iterator {
                c.drop_pipeline();
            }
        });
    }

    /// The next batch of the epoch, or None at its end: a `Batch`, or a tuple of it, the
    /// labels (an int64 `Batch`) and the paths (a list of str), as configured. Releases the
    /// GIL while waiting.
    fn _next<'py>(&self, py: Python<'py>) -> PyResult<Option<Bound<'py, PyAny>>> {
        let core = &self.core;
        // Waits in slices, checking for signals between them: Ctrl-C raises
        // KeyboardInterrupt within a slice, not after the next batch.
        let loaded = loop {
            match py.allow_threads(|| core.lock().expect("loader").next()) {
                Ok(loaded) => break loaded,
                Err(Some(e)) => return Err(to_py(e)),
                Err(None) => py.check_signals()?,
            }
        };
        let Some(Loaded {
            fields,
            labels,
            items,
        }) = loaded
        else {
            return Ok(None);
        };
        let mut out = fields
            .into_iter()
            .chain(labels)
            .map(|m| Ok(Bound::new(py, Batch::from(m))?.into_any()))
            .collect::<PyResult<Vec<_>>>()?;
        if out.len() == 1 && !self.extras.return_paths {
            return Ok(out.pop());
        }
        if self.extras.return_paths {
            let paths = items.iter().map(|m| match &self.dataset {
                // Rows of a length-aware batch are files.
                Dataset::Batches { files, .. } => files.paths()[m.index].display().to_string(),
                d => d.name(m.index, m.epoch),
            });
            out.push(PyList::new(py, paths)?.into_any());
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
        self.extras.classes.clone()
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
        d.set_item("consumer_wait_s", s.consumer_wait.as_secs_f64())?;
        let stages = PyDict::new(py);
        for st in &s.stages {
            let x = PyDict::new(py);
            x.set_item("workers", st.workers)?;
            x.set_item("items_in", st.items_in)?;
            x.set_item("items_out", st.items_out)?;
            x.set_item("items_per_s", st.items_per_s)?;
            // What the stage holds now, as the memory budget counts it, and its limit.
            x.set_item("bytes", st.queue_bytes)?;
            x.set_item("budget_bytes", st.budget_bytes)?;
            if let Some(r) = st.read_ahead {
                // Shards on S3: how many are fetched ahead (the tuner deepens it).
                x.set_item("read_ahead", r.depth)?;
            }
            if let Some(t) = st.item_threads {
                // Video: decoder threads per clip (the tuner sets them).
                x.set_item("item_threads", t.threads)?;
            }
            stages.set_item(&st.name, x)?;
        }
        d.set_item("stages", stages)?;
        // Everything the loader holds now, as the memory budget counts it.
        d.set_item(
            "bytes",
            s.stages.iter().map(|st| st.queue_bytes).sum::<u64>(),
        )?;
        Ok(d)
    }

    /// The tuner's recent ticks, oldest first: dicts of `t` (seconds since the pipeline
    /// started), `rate` (batches/s), `wait` (fraction of the tick the consumer waited),
    /// `stages`, `workers` and `budgets` (per stage), `bytes` (buffered), `memory_budget`,
    /// `rss_bytes`, and `decisions` (what changed and why, as strings). Empty with the tuner
    /// off. Returns at once, from any thread.
    fn tuner_trace<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyList>> {
        let records = self.monitor(py)?.tuner_trace();
        let out = PyList::empty(py);
        for r in records {
            let d = PyDict::new(py);
            d.set_item("t", r.t)?;
            d.set_item("rate", r.rate)?;
            d.set_item("wait", r.wait)?;
            d.set_item("stages", r.stages)?;
            d.set_item("workers", r.workers)?;
            d.set_item("budgets", r.budgets)?;
            d.set_item("bytes", r.buffered_bytes)?;
            d.set_item("memory_budget", r.memory_budget)?;
            d.set_item("rss_bytes", r.rss_bytes)?;
            let decisions: Vec<String> = r
                .decisions
                .iter()
                .map(|x| format!("{:?}: {}", x.action, x.reason))
                .collect();
            d.set_item("decisions", decisions)?;
            out.append(d)?;
        }
        Ok(out)
    }

    /// The failures skipped in `epoch` (default: the epoch being iterated, or the last one
    /// started), of the last 1,000 kept: (stage, item, message) tuples.
    #[pyo3(signature = (epoch=None))]
    fn failures(&self, epoch: Option<u64>) -> Vec<Failure> {
        let f = self.failures.lock().expect("failures");
        let epoch = epoch.unwrap_or_else(|| f.epoch.load(Ordering::Relaxed));
        f.kept
            .iter()
            .filter(|(e, _)| *e == epoch)
            .map(|(_, x)| x.clone())
            .collect()
    }

    /// Makes `epoch` the next epoch iterated (as `DistributedSampler.set_epoch`): its order
    /// and augmentation follow from the seed and the epoch. A no-op when it is already the
    /// next (a position loaded by `load_state_dict` is kept); an epoch being iterated is
    /// abandoned.
    fn set_epoch(&self, py: Python<'_>, epoch: u64) {
        let core = &self.core;
        py.allow_threads(|| core.lock().expect("loader").set_epoch(epoch));
    }

    /// The epoch the next iterator starts, or the one being iterated; builds nothing (safe
    /// to ask just before a `fork`).
    fn _next_epoch(&self, py: Python<'_>) -> u64 {
        let core = &self.core;
        py.allow_threads(|| core.lock().expect("loader").next_epoch())
    }

    /// The decode workers a rebuilt pipeline starts with: what the last one ended with, or
    /// `None` (its share of the cores) before any rebuild; builds nothing.
    fn _learned_workers(&self, py: Python<'_>) -> Option<usize> {
        let core = &self.core;
        py.allow_threads(|| core.lock().expect("loader").learned)
    }

    /// A checkpoint of the consumer's progress (plain ints and lists: picklable, JSON-able).
    /// Waits for the loader's lock with the GIL released: between batches it is free at once.
    fn state_dict<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyDict>> {
        let core = &self.core;
        let s = py
            .allow_threads(|| -> Result<PipelineState, PipelineError> {
                let mut c = core.lock().expect("loader");
                let in_epoch = c.in_epoch;
                let s = c.pipeline()?.state();
                if !in_epoch && s.delivered_items > 0 {
                    // An epoch left mid-way counts as done: the next iterator starts the
                    // next epoch, from its start.
                    return Ok(PipelineState {
                        epoch: s.epoch + 1,
                        delivered: Vec::new(),
                        delivered_items: 0,
                        partial: Vec::new(),
                        shard: s.shard.map(|sh| ShardState {
                            base: Vec::new(),
                            ..sh
                        }),
                        ..s
                    });
                }
                Ok(s)
            })
            .map_err(to_py)?;
        state_to_py(py, &s)
    }

    /// Continues from `state_dict()`: the next iterator yields exactly what was not delivered
    /// yet in that epoch.
    fn load_state_dict(&self, py: Python<'_>, state: &Bound<'_, PyDict>) -> PyResult<()> {
        let s = state_from_py(state)?;
        let core = &self.core;
        py.allow_threads(|| {
            let mut c = core.lock().expect("loader");
            c.pipeline = None;
            c.in_epoch = false;
            c.resume_at = 0; // the state says where to start
            c.pipeline()?.resume(&s)
        })
        .map_err(to_py)
    }

    /// Stops the pipeline and joins its threads (also done when the loader is freed).
    fn close(&self, py: Python<'_>) {
        let core = &self.core;
        py.allow_threads(|| {
            core.lock().expect("loader").drop_pipeline();
        });
    }
}
