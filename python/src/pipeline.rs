//! [`PyPipeline`]: a pipeline whose source and stages are Python callables (they take the GIL;
//! the engine's threads, queues and tuner do not).

use std::sync::{Arc, Mutex};

use flowgate::{Described, FailureBudget, Pipeline, PipelineError, Within, Workers};
use pyo3::exceptions::PyValueError;
use pyo3::prelude::*;
use pyo3::types::PyList;

use crate::error::to_py;
use crate::loader::SLICE;

/// A Python exception raised by a stage's callable (its type and message).
#[derive(Debug)]
struct PyStageError(String);

impl std::fmt::Display for PyStageError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(&self.0)
    }
}

impl std::error::Error for PyStageError {}

/// `repr(x)`, for naming an item that failed.
fn py_repr(py: Python<'_>, x: &Py<PyAny>) -> String {
    x.bind(py)
        .repr()
        .map(|r| r.to_string())
        .unwrap_or_else(|_| "<item>".into())
}

fn py_error(py: Python<'_>, e: PyErr) -> PyStageError {
    let ty = e
        .get_type(py)
        .name()
        .map(|n| n.to_string())
        .unwrap_or_else(|_| "Exception".into());
    PyStageError(format!("{ty}: {}", e.value(py)))
}

/// An exception raised by the source iterable: it ends the epoch and is raised to the
/// consumer when the epoch's results run out.
type SourceError = Arc<Mutex<Option<PyErr>>>;

/// Pulls items from a Python iterator (taking the GIL per item).
struct PyItems {
    it: Option<Py<PyAny>>,
    error: SourceError,
}

impl Iterator for PyItems {
    type Item = Py<PyAny>;
    fn next(&mut self) -> Option<Py<PyAny>> {
        let it = self.it.as_ref()?;
        Python::with_gil(|py| match it.bind(py).call_method0("__next__") {
            Ok(x) => Some(x.unbind()),
            Err(e) if e.is_instance_of::<pyo3::exceptions::PyStopIteration>(py) => None,
            Err(e) => {
                *self.error.lock().expect("source error") = Some(e);
                None
            }
        })
    }
}

enum StageSpec {
    Map {
        name: String,
        f: Py<PyAny>,
        workers: usize,
    },
    Batch {
        size: usize,
        drop_last: bool,
    },
}

/// A pipeline of Python callables; see `flowgate.Pipeline`.
#[pyclass(module = "flowgate._native", name = "Pipeline")]
pub(crate) struct PyPipeline {
    source: Py<PyAny>,
    stages: Mutex<Vec<StageSpec>>,
    skip_errors: bool,
    /// The node CPU budget the pipeline's process joins (`cpu_budget=`).
    cpu_budget: Option<flowgate::CpuBudget>,
    /// The built pipeline, whether an epoch of it is being iterated, and the process whose
    /// threads run it (after a `fork` the child has none of them).
    running: Mutex<Option<Running>>,
    source_error: SourceError,
}

struct Running {
    pipeline: Pipeline<Py<PyAny>>,
    in_epoch: bool,
    pid: u32,
}

impl Running {
    /// Stops the pipeline and joins its threads, with the GIL released (its workers may be
    /// waiting for it); in a forked child, where the threads are the parent's, only forgets
    /// it (joining would wait forever).
    fn end(self, py: Python<'_>) {
        if self.pid == std::process::id() {
            py.allow_threads(move || drop(self));
        } else {
            std::mem::forget(self);
        }
    }
}

impl Drop for PyPipeline {
    fn drop(&mut self) {
        if let Some(r) = self.running.get_mut().ok().and_then(Option::take) {
            Python::with_gil(|py| r.end(py));
        }
    }
}

impl PyPipeline {
    fn build(&self, py: Python<'_>) -> Result<Pipeline<Py<PyAny>>, PipelineError> {
        let source = self.source.clone_ref(py);
        let error = Arc::clone(&self.source_error);
        let b = Pipeline::builder().source_epochs(move |epoch| {
            Python::with_gil(|py| {
                let src = source.bind(py);
                let iterable = if src.is_callable() {
                    src.call1((epoch,))
                } else {
                    Ok(src.clone())
                };
                let it = iterable.and_then(|x| x.try_iter().map(|i| i.into_any().unbind()));
                let error = Arc::clone(&error);
                match it {
                    Ok(it) => PyItems {
                        it: Some(it),
                        error,
                    },
                    Err(e) => {
                        *error.lock().expect("source error") = Some(e);
                        PyItems { it: None, error }
                    }
                }
            })
        });
        // Items are described (`repr()`, under the GIL) only when they fail: see `Described`.
        let mut b = b;
        let budget = if self.skip_errors {
            FailureBudget::unlimited()
        } else {
            FailureBudget::fail_fast()
        };
        for s in self.stages.lock().expect("stages").iter() {
            b = match s {
                StageSpec::Map { name, f, workers } => {
                    let f = f.clone_ref(py);
                    b.pipe(
                        name,
                        move |x: Py<PyAny>| {
                            Python::with_gil(|py| {
                                f.call1(py, (x.clone_ref(py),))
                                    .map_err(|e| Described::new(py_repr(py, &x), py_error(py, e)))
                            })
                        },
                        Workers::initial(*workers),
                    )
                }
                StageSpec::Batch { size, drop_last } => b.aggregate(*size, *drop_last).pipe(
                    &format!("batch{size}"),
                    |v: Vec<Py<PyAny>>| {
                        Python::with_gil(|py| {
                            PyList::new(py, v)
                                .map(|l| l.into_any().unbind())
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
        b.max_failures(budget).build()
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
        Ok(Self {
            source,
            stages: Mutex::new(Vec::new()),
            skip_errors,
            cpu_budget: cpu_budget.map(crate::args::cpu_budget_of).transpose()?,
            running: Mutex::new(None),
            source_error: Arc::default(),
        })
    }

    /// Adds a stage calling `f(item)` on `workers` threads (a starting point: the tuner may
    /// change it). Python callables hold the GIL while they run.
    #[pyo3(signature = (f, workers=1, name=None))]
    fn map<'py>(
        slf: Bound<'py, Self>,
        f: Py<PyAny>,
        workers: usize,
        name: Option<String>,
    ) -> Bound<'py, Self> {
        {
            let me = slf.borrow();
            let mut st = me.stages.lock().expect("stages");
            let name = name.unwrap_or_else(|| format!("map{}", st.len() + 1));
            st.push(StageSpec::Map {
                name,
                f,
                workers: workers.max(1),
            });
        }
        slf
    }

    /// Groups items into lists of `size`.
    #[pyo3(signature = (size, drop_last=false))]
    fn batch<'py>(
        slf: Bound<'py, Self>,
        size: usize,
        drop_last: bool,
    ) -> PyResult<Bound<'py, Self>> {
        if size == 0 {
            return Err(PyValueError::new_err("size must be at least 1"));
        }
        slf.borrow()
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
        let here = std::process::id();
        match r.as_mut() {
            Some(run) if !run.in_epoch && run.pid == here => run.in_epoch = true,
            _ => {
                let next = r.as_ref().map(|run| {
                    let e = run.pipeline.epoch();
                    if run.pid != here && run.in_epoch {
                        e
                    } else {
                        e + 1
                    }
                });
                if let Some(old) = r.take() {
                    old.end(py);
                }
                let mut p = self.build(py).map_err(to_py)?;
                if let Some(epoch) = next {
                    p.start_at_epoch(epoch).map_err(to_py)?;
                }
                *r = Some(Running {
                    pipeline: p,
                    in_epoch: true,
                    pid: here,
                });
            }
        }
        Ok(())
    }

    fn _next(&self, py: Python<'_>) -> PyResult<Option<Py<PyAny>>> {
        let running = &self.running;
        // Waits in slices with the GIL released, checking for signals between them: Ctrl-C
        // raises KeyboardInterrupt within a slice, not after the next item.
        let r = loop {
            let r = py.allow_threads(|| {
                let mut g = running.lock().expect("running");
                let Some(run) = g.as_mut() else {
                    return Some(Ok(None));
                };
                // An epoch the parent started before a fork is not this process's to read.
                if !run.in_epoch || run.pid != std::process::id() {
                    return Some(Ok(None));
                }
                match run.pipeline.next_within(SLICE) {
                    Within::Next(Ok(x)) => Some(Ok(Some(x))),
                    Within::Next(Err(e)) => {
                        drop(g.take());
                        Some(Err(e))
                    }
                    Within::EpochEnd => {
                        run.in_epoch = false;
                        Some(Ok(None))
                    }
                    Within::TimedOut => None,
                }
            });
            match r {
                Some(r) => break r,
                None => py.check_signals()?,
            }
        };
        let r = r.map_err(to_py)?;
        if r.is_none() {
            if let Some(e) = self.source_error.lock().expect("source error").take() {
                return Err(e);
            }
        }
        Ok(r)
    }

    /// Stops the pipeline and joins its threads.
    fn close(&self, py: Python<'_>) {
        let r = self.running.lock().expect("running").take();
        if let Some(r) = r {
            r.end(py);
        }
    }
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
