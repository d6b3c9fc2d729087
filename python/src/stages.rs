//! How a `flowgate.Pipeline`'s Python source and stages become the engine's: a Python iterable (or
//! a map-style dataset's positions in the library's order) as its source, each `map` a stage
//! whose calls take the GIL (on a tuned pool, or `workers` at once on blocking threads for
//! calls that wait), each `batch` an aggregate stage, failures named by the item's `repr()`,
//! and `skip_part` for a call that leaves parts of its result out.

use std::sync::atomic::AtomicU64;
use std::sync::{Arc, Mutex, OnceLock};

use flowgate::actors::failure::collect_skipped_parts;
use flowgate::dataset::EpochOrder;
use flowgate::loader::FailureLog;
use flowgate::{Described, FailureBudget, Order, Pipeline, PipelineError, Workers};
use pyo3::prelude::*;
use pyo3::types::PyList;

use crate::error::{py_error, PyStageError};
use crate::fork::PyItem;
use crate::gil::GilClock;
use crate::lifecycle::with_gil_in_pipeline;

/// `repr(x)`, for naming an item that failed.
fn py_repr(py: Python<'_>, x: &Py<PyAny>) -> String {
    x.bind(py)
        .repr()
        .map(|r| r.to_string())
        .unwrap_or_else(|_| "<item>".into())
}

/// An exception raised by the source iterable: it ends the epoch and is raised to the
/// consumer when the epoch's results run out.
pub(crate) type SourceError = Arc<Mutex<Option<PyErr>>>;

/// Pulls items from a Python iterator (taking the GIL per item).
pub(crate) struct PyItems {
    it: Option<PyItem>,
    error: SourceError,
}

impl Iterator for PyItems {
    type Item = PyItem;
    fn next(&mut self) -> Option<PyItem> {
        let it = self.it.as_ref()?;
        with_gil_in_pipeline(|py| match it.get().bind(py).call_method0("__next__") {
            Ok(x) => Some(PyItem::new(x.unbind())),
            Err(e) if e.is_instance_of::<pyo3::exceptions::PyStopIteration>(py) => None,
            Err(e) => {
                *self.error.lock().expect("source error") = Some(e);
                None
            }
        })
    }
}

pub(crate) enum StageSpec {
    Map {
        name: String,
        f: Py<PyAny>,
        workers: usize,
        /// Calls that wait (I/O, sleeps): `workers` of them in flight on blocking threads,
        /// not held to the process's cores as a pool's CPU workers are.
        blocking: bool,
    },
    Batch {
        size: usize,
        drop_last: bool,
    },
}

/// Where a pipeline's items come from.
pub(crate) enum Items {
    /// A Python iterable, or a callable `source(epoch)` returning one.
    Iterable(Py<PyAny>),
    /// The positions `0..len` of a map-style dataset, in `order`: this rank's share,
    /// `share` positions an epoch.
    Indexed {
        len: usize,
        order: EpochOrder,
        share: usize,
        /// Ranks sharing the dataset.
        world: usize,
    },
}

/// What a pipeline of Python callables is built from: its source, its stages and settings,
/// and what its built pipelines share with it (the GIL's clock, the source's error, the
/// items that failed).
pub(crate) struct Spec {
    pub(crate) items: Items,
    pub(crate) stages: Mutex<Vec<StageSpec>>,
    pub(crate) skip_errors: bool,
    /// The order results come out in.
    pub(crate) order: Order,
    pub(crate) gil: Arc<GilClock>,
    /// The node CPU budget the pipeline's process joins (`cpu_budget=`).
    pub(crate) cpu_budget: Option<flowgate::CpuBudget>,
    pub(crate) source_error: SourceError,
    /// The items skipped: counted per epoch, kept, the first said once (the library's log,
    /// as a loader's).
    pub(crate) failed: FailureLog,
    /// Items read again to make up batches whose every item failed (a `DataLoader`'s fetch,
    /// under a world size above 1).
    pub(crate) filled: Arc<AtomicU64>,
    /// Results its last stage and the consumer's buffer may each hold ahead of the loop
    /// (`prefetch()`); default: the engine's (two chunks each, tuned).
    pub(crate) prefetch: Mutex<Option<usize>>,
}

impl Spec {
    pub(crate) fn new(
        items: Items,
        order: Order,
        skip_errors: bool,
        cpu_budget: Option<flowgate::CpuBudget>,
    ) -> Self {
        Self {
            items,
            stages: Mutex::new(Vec::new()),
            skip_errors,
            order,
            gil: Arc::default(),
            cpu_budget,
            source_error: Arc::default(),
            failed: match skip_errors {
                true => FailureLog::default(),
                false => FailureLog::fail_fast(),
            },
            filled: Arc::default(),
            prefetch: Mutex::new(None),
        }
    }

    /// Its engine pipeline.
    pub(crate) fn build(&self, py: Python<'_>) -> Result<Pipeline<PyItem>, PipelineError> {
        let source = match &self.items {
            Items::Iterable(source) => PyItem::new(source.clone_ref(py)),
            Items::Indexed { len, order, .. } => {
                let b = Pipeline::builder().source_sampled(order.sampler(*len)?, |_, i| {
                    with_gil_in_pipeline(|py| {
                        PyItem::new(
                            i.into_pyobject(py)
                                .map(|i| i.into_any().unbind())
                                .expect("an int"),
                        )
                    })
                });
                return self.stages(py, b);
            }
        };
        let error = Arc::clone(&self.source_error);
        let b = Pipeline::builder().source_epochs(move |epoch| {
            with_gil_in_pipeline(|py| {
                let src = source.get().bind(py);
                let iterable = if src.is_callable() {
                    src.call1((epoch,))
                } else {
                    Ok(src.clone())
                };
                let it = iterable.and_then(|x| x.try_iter().map(|i| i.into_any().unbind()));
                let error = Arc::clone(&error);
                match it {
                    Ok(it) => PyItems {
                        it: Some(PyItem::new(it)),
                        error,
                    },
                    Err(e) => {
                        *error.lock().expect("source error") = Some(e);
                        PyItems { it: None, error }
                    }
                }
            })
        });
        self.stages(py, b)
    }

    /// The pipeline's stages after its source, and its settings.
    fn stages(
        &self,
        py: Python<'_>,
        b: flowgate::PipelineBuilder<PyItem>,
    ) -> Result<Pipeline<PyItem>, PipelineError> {
        // Items are described (`repr()`, under the GIL) only when they fail: see `Described`.
        let mut b = b;
        let budget = FailureBudget::skip_errors(self.skip_errors);
        for s in self.stages.lock().expect("stages").iter() {
            b = match s {
                StageSpec::Map {
                    name,
                    f,
                    workers,
                    blocking: true,
                } => {
                    let f = Arc::new(PyItem::new(f.clone_ref(py)));
                    let gil = Arc::clone(&self.gil);
                    b.pipe_async(
                        name,
                        move |x: PyItem| {
                            let (f, gil) = (Arc::clone(&f), Arc::clone(&gil));
                            async move {
                                // The parts the call leaves out (`skip_part`) are collected on
                                // its thread and counted by this item's task.
                                // The item is freed under the GIL, as below.
                                let call = move || {
                                    collect_skipped_parts(move || {
                                        gil.call(move |py| {
                                            f.get()
                                                .call1(py, (x.get().bind(py),))
                                                .map(PyItem::new)
                                                .map_err(|e| {
                                                    Described::new(
                                                        py_repr(py, x.get()),
                                                        py_error(py, e),
                                                    )
                                                })
                                        })
                                    })
                                };
                                match tokio::task::spawn_blocking(call).await {
                                    Ok((r, parts)) => {
                                        if r.is_ok() {
                                            for (part, cause) in parts {
                                                flowgate::skip_part(part.clone(), cause)
                                                    .map_err(|c| Described::new(part, c))?;
                                            }
                                        }
                                        r
                                    }
                                    Err(e) => Err(Described::new(
                                        "an item",
                                        PyStageError::text(format!("the call did not finish: {e}")),
                                    )),
                                }
                            }
                        },
                        // As many as asked, as torch's workers: the tuner's rule for async
                        // stages (raise the calls in flight while they wait) would start a
                        // thread for each.
                        Workers::fixed((*workers).max(1)),
                    )
                }
                StageSpec::Map {
                    name, f, workers, ..
                } => {
                    let f = PyItem::new(f.clone_ref(py));
                    let gil = Arc::clone(&self.gil);
                    b.pipe(
                        name,
                        move |x: PyItem| {
                            // The item is freed under the GIL (see `PyItem`).
                            let f = &f;
                            gil.call(move |py| {
                                f.get()
                                    .call1(py, (x.get().bind(py),))
                                    .map(PyItem::new)
                                    .map_err(|e| {
                                        Described::new(py_repr(py, x.get()), py_error(py, e))
                                    })
                            })
                        },
                        match workers {
                            0 => Workers::auto(),
                            n => Workers::initial(*n),
                        },
                    )
                }
                // What a state is valid for, as a loader's (a state of batches of 4 loaded
                // into batches of 5 was taken: len() then said 8 where 6 came).
                StageSpec::Batch { size, drop_last } => b
                    .checkpoint_fields(flowgate::loader::batching_fingerprint(*size, *drop_last))
                    .aggregate(*size, *drop_last)
                    .pipe(
                        // The name the user's call wrote (`batch(size)`).
                        "batch",
                        |v: Vec<PyItem>| {
                            with_gil_in_pipeline(|py| {
                                PyList::new(py, v.into_iter().map(PyItem::into_inner))
                                    .map(|l| PyItem::new(l.into_any().unbind()))
                                    .map_err(|e| py_error(py, e))
                            })
                        },
                        1,
                    ),
            };
        }
        if let Some(c) = self.cpu_budget {
            b = b.cpu_budget(c);
        }
        if let Some(n) = *self.prefetch.lock().expect("prefetch") {
            b = b.budget(n, u64::MAX).sink(n);
        }
        let failed = self.failed.clone();
        b.max_failures(budget)
            .output_order(self.order)
            .on_failure(move |e| failed.record(e))
            .build()
    }

    /// Positions per result and whether a short last one is dropped: the batch stage's, else
    /// one a position.
    pub(crate) fn per_result(&self) -> (usize, bool) {
        let stages = self.stages.lock().expect("stages");
        stages
            .iter()
            .find_map(|s| match s {
                StageSpec::Batch { size, drop_last } => Some((*size, *drop_last)),
                StageSpec::Map { .. } => None,
            })
            .unwrap_or((1, false))
    }

    /// Results an epoch makes from `share` positions: the batches of the batch stage, if it
    /// has one, else one a position.
    pub(crate) fn results_of(&self, share: usize) -> usize {
        let stages = self.stages.lock().expect("stages");
        stages.iter().fold(share, |n, s| match s {
            StageSpec::Batch { size, drop_last } => {
                flowgate::loader::batches_of(n, *size, *drop_last)
            }
            StageSpec::Map { .. } => n,
        })
    }
}

/// What a fetch returns for a batch it leaves out (in one process, a batch whose every item
/// failed): one `object()`, which the pipeline's consumer passes over (`is_left_out`).
static LEFT_OUT: OnceLock<Py<PyAny>> = OnceLock::new();

/// [`LEFT_OUT`], made the first time (under the GIL).
pub(crate) fn left_out(py: Python<'_>) -> PyResult<PyObject> {
    if let Some(x) = LEFT_OUT.get() {
        return Ok(x.clone_ref(py));
    }
    let x = py.import("builtins")?.getattr("object")?.call0()?.unbind();
    Ok(LEFT_OUT.get_or_init(|| x).clone_ref(py))
}

/// Whether `x` is a batch a fetch left out (needs no GIL: it compares addresses).
pub(crate) fn is_left_out(x: &Py<PyAny>) -> bool {
    LEFT_OUT.get().is_some_and(|l| l.as_ptr() == x.as_ptr())
}

/// `flowgate.skip_part(part, error)`: from a `Pipeline` stage's function that makes one result
/// of several parts, records that the part named `part` failed with `error` (an exception) and
/// was left out: it counts as a failed item of the stage (fatal past the failure budget,
/// i.e. at once unless `skip_errors=True`, naming the part). Outside a stage's call, `error`
/// is raised instead.
#[pyfunction]
pub(crate) fn skip_part(py: Python<'_>, part: String, error: Bound<'_, PyAny>) -> PyResult<()> {
    let err = match error.downcast::<pyo3::exceptions::PyBaseException>() {
        Ok(e) => PyErr::from_value(e.clone().into_any()),
        Err(_) => {
            return Err(pyo3::exceptions::PyTypeError::new_err(
                "skip_part(part, error): error must be an exception",
            ))
        }
    };
    let cause = py_error(py, err.clone_ref(py));
    match flowgate::skip_part(part, cause) {
        Ok(()) => Ok(()),
        Err(_) => Err(err),
    }
}
