//! [`Fetch`]: what one call on a tuned thread of a `flowgate.DataLoader` makes: the items of
//! a map-style dataset at a batch's positions (or at one position, unbatched), collated, as a
//! torch worker makes a batch. Through the dataset's `__getitems__` where it has one (its
//! error fails the batch), else item by item: an item whose `__getitem__` raises is a failed
//! item named by its position (`skip_part`), which ends the epoch with it (fail-fast) or,
//! with `skip_errors`, is counted and left out, the batch keeping its place. A batch whose
//! every item fails is made up by the library's rule ([`MakeUp`]: the readable items after
//! it), so every rank still makes `len()` batches; with none readable, the batch fails with
//! its first item's error.

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
        if let Some(getitems) = &self.getitems {
            return self.collate.call1(py, (getitems.call1(py, (positions,))?,));
        }
        let positions: Vec<usize> = match self.batched {
            true => positions.extract()?,
            false => vec![positions.extract()?],
        };
        let dataset = self.dataset.bind(py);
        let mut items = Vec::with_capacity(positions.len());
        let mut first: Option<PyErr> = None;
        for &i in &positions {
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
                        return Ok(py.None());
                    }
                    self.makeup.lock().expect("makeup").failed(i);
                }
            }
        }
        if items.is_empty() {
            // Made up on a copy: the dataset's calls may let another thread in, which must not
            // wait for this lock holding the GIL.
            let mut makeup = self.makeup.lock().expect("makeup").clone();
            let last = *positions.last().expect("a batch has positions");
            items = makeup.after(last, positions.len(), |p| dataset.get_item(p));
            self.makeup.lock().expect("makeup").merge(makeup);
        }
        let Some(item) = items.first() else {
            // Nothing readable to make it up with: the batch fails with its first item's error
            // (the epoch then raises "delivered nothing").
            return Err(first.expect("an item failed"));
        };
        match self.batched {
            true => self.collate.call1(py, (PyList::new(py, &items)?,)),
            false => self.collate.call1(py, (item,)),
        }
    }
}
