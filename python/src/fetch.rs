//! [`Fetch`]: what one call on a tuned thread of a `flowgate.DataLoader` makes: the items of
//! a map-style dataset at a batch's positions (or at one position, unbatched), collated, as a
//! torch worker makes a batch. Through the dataset's `__getitems__` where it has one (where
//! it raises: fatal, or with `skip_errors` the batch read item by item), else item by item: an item whose `__getitem__` raises is a failed
//! item named by its position (`skip_part`), which ends the epoch with it (fail-fast) or,
//! with `skip_errors`, is counted and left out, the batch keeping its place. A batch whose
//! every item fails is made up by the library's rule ([`MakeUp`]: the readable items after
//! it), so every rank still makes `len()` batches; with none readable, the batch fails with
//! its first item's error. A batch whose `collate_fn` raises is, with `skip_errors`, one
//! failure, made up the same way.

use std::sync::Mutex;

use flowgate::sampler::MakeUp;
use pyo3::prelude::*;
use pyo3::types::PyList;

/// A `DataLoader`'s fetch; see the [module docs](self).
#[pyclass(frozen, module = "flowgate._native")]
pub(crate) struct Fetch {
    dataset: Py<PyAny>,
    collate: Py<PyAny>,
    getitems: Option<Py<PyAny>>,
    skip_errors: bool,
    batched: bool,
    /// Held only between calls into Python: a make-up runs on a copy.
    makeup: Mutex<MakeUp>,
}

#[pymethods]
impl Fetch {
    #[new]
    fn new(
        dataset: Bound<'_, PyAny>,
        collate: Py<PyAny>,
        skip_errors: bool,
        batched: bool,
    ) -> PyResult<Self> {
        let getitems = match batched {
            true => dataset.getattr_opt("__getitems__")?.map(Bound::unbind),
            false => None,
        };
        Ok(Self {
            makeup: Mutex::new(MakeUp::new(dataset.len()?)),
            dataset: dataset.unbind(),
            collate,
            getitems,
            skip_errors,
            batched,
        })
    }

    /// The collated items at `positions` (a list of ints; one int unbatched), or None when an
    /// item failed and failures are fatal (the failure just counted ends the epoch).
    fn __call__(&self, py: Python<'_>, positions: Bound<'_, PyAny>) -> PyResult<PyObject> {
        let positions: Vec<usize> = match self.batched {
            true => positions.extract()?,
            false => vec![positions.extract()?],
        };
        let mut whole = None;
        if let Some(getitems) = &self.getitems {
            match getitems.call1(py, (PyList::new(py, &positions)?,)) {
                Ok(items) => {
                    let collated = self.collate.call1(py, (items,));
                    return self.or_made_up(py, &positions, collated);
                }
                Err(e) if !self.skip_errors => return Err(e),
                // Item by item instead, so the failing items are named, counted and made up.
                Err(e) => whole = Some(e),
            }
        }
        let Some(items) = self.items(py, &positions)? else {
            return Ok(py.None());
        };
        if let (Some(e), true) = (whole, items.len() == positions.len()) {
            // Every item read alone: the batch's own call failed, counted as the batch's.
            self.skip(py, &positions, "__getitems__", e)?;
        }
        let collated = self.collate_items(py, &items);
        self.or_made_up(py, &positions, collated)
    }
}

impl Fetch {
    /// The readable items at `positions` (made up where every one failed), None when one
    /// failed and failures are fatal.
    fn items<'py>(
        &self,
        py: Python<'py>,
        positions: &[usize],
    ) -> PyResult<Option<Vec<Bound<'py, PyAny>>>> {
        let dataset = self.dataset.bind(py);
        let mut items = Vec::with_capacity(positions.len());
        let mut first: Option<PyErr> = None;
        for &i in positions {
            match dataset.get_item(i) {
                Ok(x) => items.push(x),
                // Any exception an item raises is its failure (KeyboardInterrupt too: on this
                // thread it is the dataset's, not the user's Ctrl-C).
                Err(e) => {
                    let shown = e.clone_ref(py);
                    crate::pipeline::skip_part(
                        py,
                        format!("item {i}"),
                        e.into_value(py).into_bound(py).into_any(),
                    )?;
                    first.get_or_insert(shown);
                    if !self.skip_errors {
                        return Ok(None);
                    }
                    self.makeup.lock().expect("makeup").failed(i);
                }
            }
        }
        if items.is_empty() {
            items = self.made_up(py, positions);
        }
        match items.is_empty() {
            // Nothing readable to make it up with: the batch fails with its first item's error
            // (the epoch then raises "delivered nothing").
            true => Err(first.expect("an item failed")),
            false => Ok(Some(items)),
        }
    }

    /// Readable items after `positions` as many (the library's rule, [`MakeUp`]).
    fn made_up<'py>(&self, py: Python<'py>, positions: &[usize]) -> Vec<Bound<'py, PyAny>> {
        // Made up on a copy: the dataset's calls may let another thread in, which must not
        // wait for this lock holding the GIL.
        let mut makeup = self.makeup.lock().expect("makeup").clone();
        let last = *positions.last().expect("a batch has positions");
        let dataset = self.dataset.bind(py);
        let items = makeup.after(last, positions.len(), |p| dataset.get_item(p));
        self.makeup.lock().expect("makeup").merge(makeup);
        items
    }

    fn collate_items(&self, py: Python<'_>, items: &[Bound<'_, PyAny>]) -> PyResult<PyObject> {
        match self.batched {
            true => self.collate.call1(py, (PyList::new(py, items)?,)),
            false => self.collate.call1(py, (&items[0],)),
        }
    }

    /// `collated`, or where `collate_fn` raised and failures are skipped: that failure counted
    /// (its items not read for a make-up again), the batch made up of readable items after it
    /// and collated (an error then fails the batch), so every rank still makes `len()` batches.
    fn or_made_up(
        &self,
        py: Python<'_>,
        positions: &[usize],
        collated: PyResult<PyObject>,
    ) -> PyResult<PyObject> {
        let e = match collated {
            Err(e) if self.skip_errors => e,
            done => return done,
        };
        let shown = e.clone_ref(py);
        self.skip(py, positions, "collate_fn", e)?;
        let mut makeup = self.makeup.lock().expect("makeup");
        positions.iter().for_each(|&p| makeup.failed(p));
        drop(makeup);
        let items = self.made_up(py, positions);
        match items.is_empty() {
            true => Err(shown),
            false => self.collate_items(py, &items),
        }
    }

    /// Counts `error` of the call `what` on the batch at `positions` as one failure, named by
    /// the batch's first item.
    fn skip(&self, py: Python<'_>, positions: &[usize], what: &str, error: PyErr) -> PyResult<()> {
        let part = format!("{what} of the batch from item {}", positions[0]);
        crate::pipeline::skip_part(py, part, error.into_value(py).into_bound(py).into_any())
    }
}
