//! [`Fetch`]: what one call on a tuned thread of a `flowgate.DataLoader` makes: the items of
//! a map-style dataset at a batch's positions (or at one position, unbatched), collated, as a
//! torch worker makes a batch. Through the dataset's `__getitems__` where it has one (where
//! it raises: fatal, or with `skip_errors` the batch read item by item), else item by item: an item whose `__getitem__` raises is a failed
//! item named by its position (`skip_part`), which ends the epoch with it (fail-fast) or,
//! with `skip_errors`, is counted and left out, the batch keeping its place. A batch whose
//! every item fails is, under a world size above 1, made up by the library's rule ([`MakeUp`]:
//! the readable items after it in the rank's own share of the epoch, counted in `filled`), so
//! every rank still makes `len()`
//! batches (with none readable, the batch fails with its first item's error); in one process
//! it is left out (the fetch returns [`crate::stages::left_out`], which the consumer passes
//! over), so no item comes twice in an epoch. A batch whose `collate_fn` raises keeps, with
//! `skip_errors`, the items halving finds collate together ([`largest_batch`]: a grayscale
//! image among RGB ones is left out), each left out a failed item; where none collates alone
//! it is made up or left out the same way.
//! What is kept depends on the items alone, so a resume makes the same batches.

use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};

use flowgate::loader::{largest_batch, FailureLog, MakeUp};
use flowgate::sampler::Sampler;
use pyo3::prelude::*;
use pyo3::types::{PyDict, PyList};

/// A `DataLoader`'s fetch; see the [module docs](self).
///
/// It holds its `DataLoader` by a weak reference, and reads the dataset, `collate_fn` and the
/// threads' copies from it: what the garbage collector cannot see (the engine's threads hold
/// this) then holds nothing that holds the loader, so a cycle through the dataset or
/// `collate_fn` (a data module's `collate_fn=self.collate`) is freed with its threads.
#[pyclass(frozen, module = "flowgate._native")]
pub(crate) struct Fetch {
    owner: Py<PyAny>,
    /// Batched, and the dataset has `__getitems__`.
    getitems: bool,
    skip_errors: bool,
    batched: bool,
    /// Held only between calls into Python: a make-up runs on a copy. `None` in one process
    /// (a world size of 1): a batch whose every item fails is left out instead.
    makeup: Option<Mutex<MakeUp>>,
    /// The rank's share of the epoch being read, in its order: what fillers come from.
    share: Option<Share>,
    /// Items read to make up batches (the pipeline's count, for `stats()["filled"]`).
    filled: Arc<AtomicU64>,
    /// Each thread calls a copy of the dataset of its own, made by this (`copy.copy`, the
    /// datasets it holds too, as each torch worker has its own), kept in the loader's
    /// `_copies` by [`THREAD`]: what a call sets on it (a file opened lazily, then `seek` and
    /// `read`) is that thread's. `None` where the dataset cannot be copied (the front end
    /// warned): the threads share it.
    copier: Option<Py<PyAny>>,
    /// `persistent_workers`: the copy of a thread that ended waits in the loader's `_spare`
    /// for the next thread without one (the pool's threads end after 10 s idle, and a pass
    /// left early rebuilds them), as torch's persistent workers keep theirs; else it is
    /// dropped. (Copies and spares so never add up past the most threads alive at once.)
    keep: bool,
    /// The threads in [`ENDED`] whose copies were dropped or kept: the first this many.
    pruned: AtomicUsize,
}

std::thread_local! {
    /// This thread's number, never reused (a thread's copy is found by it).
    static THREAD: Numbered = Numbered(THREADS.fetch_add(1, Ordering::Relaxed));
}

/// Threads numbered.
static THREADS: AtomicU64 = AtomicU64::new(0);

/// The numbers of the threads that ended, in the order they ended: their copies are dropped
/// (a blocking thread idle for 10 s ends and the pool starts another, which makes a copy of
/// its own; those of the threads gone were kept to the pass's end).
static ENDED: std::sync::Mutex<Vec<u64>> = std::sync::Mutex::new(Vec::new());

/// A thread's number; its end is noted in [`ENDED`].
struct Numbered(u64);

impl Drop for Numbered {
    fn drop(&mut self) {
        if let Some(mut ended) = ended() {
            ended.push(self.0);
        }
    }
}

/// [`ENDED`], locked; `None` after 10 ms: a thread that held it at a `fork` is not in the
/// child, where it then stays locked (its threads' copies are then kept, never a thread
/// stuck at its end).
fn ended() -> Option<std::sync::MutexGuard<'static, Vec<u64>>> {
    let deadline = std::time::Instant::now() + std::time::Duration::from_millis(10);
    loop {
        match ENDED.try_lock() {
            Ok(g) => return Some(g),
            Err(std::sync::TryLockError::Poisoned(p)) => return Some(p.into_inner()),
            Err(_) if std::time::Instant::now() > deadline => return None,
            Err(_) => std::thread::yield_now(),
        }
    }
}

/// In a forked child: the threads numbered are the parent's, none of them here but this one,
/// so their copies go (or to the spares) as those of threads that ended.
pub(crate) fn forget_after_fork() {
    let me = THREAD.with(|t| t.0);
    if let Some(mut ended) = ended() {
        ended.extend((0..THREADS.load(Ordering::Relaxed)).filter(|&n| n != me));
    }
}

/// Make-ups tried for a batch none of whose items `collate_fn` takes (each of as many readable
/// items, after the last): with one item in ten refused alone, batches of 1 miss 1 in 10^16.
const MAKE_UP_TRIES: usize = 16;

/// A call's dataset (this thread's copy) and `collate_fn`.
struct Here<'py> {
    dataset: Bound<'py, PyAny>,
    collate: Bound<'py, PyAny>,
}

impl<'py> Here<'py> {
    /// On `copy` of `dataset`: a `collate_fn` that is a method of the dataset
    /// (`collate_fn=dataset.collate`) is called on the copy, as in a torch worker.
    fn on(
        copy: Bound<'py, PyAny>,
        collate: Bound<'py, PyAny>,
        dataset: &Bound<'py, PyAny>,
    ) -> Self {
        let bound_to = collate.getattr_opt("__self__").ok().flatten();
        let collate = match bound_to.filter(|s| s.is(dataset)) {
            Some(_) => collate
                .getattr("__func__")
                .and_then(|f| f.call_method1("__get__", (&copy,)))
                .unwrap_or(collate),
            None => collate,
        };
        Self {
            dataset: copy,
            collate,
        }
    }
}

#[pymethods]
impl Fetch {
    /// For `owner` (a weak reference to the `DataLoader`, whose `dataset`, `collate_fn`,
    /// `_copies` and `_spare` a call reads).
    /// `pipeline`: the `DataLoader`'s, whose world size says whether failed batches are made
    /// up, and which counts the items read to make them up.
    #[new]
    fn new(
        owner: Bound<'_, PyAny>,
        skip_errors: bool,
        batched: bool,
        copier: Option<Py<PyAny>>,
        keep: bool,
        pipeline: PyRef<'_, crate::pipeline::PyPipeline>,
    ) -> PyResult<Self> {
        let dataset = owner.call0()?.getattr("dataset")?;
        crate::stages::left_out(owner.py())?;
        let (makeup, share) = match (pipeline.world() > 1, pipeline.share_order()) {
            (true, Some((sampler, epoch))) => {
                let share = Share {
                    sampler,
                    epoch,
                    made: Mutex::new(None),
                };
                (Some(Mutex::new(MakeUp::new())), Some(share))
            }
            _ => (None, None),
        };
        Ok(Self {
            makeup,
            share,
            filled: pipeline.filled(),
            getitems: batched && dataset.getattr_opt("__getitems__")?.is_some(),
            owner: owner.unbind(),
            skip_errors,
            batched,
            copier,
            keep,
            // The threads that ended before it have no copies of its dataset.
            pruned: AtomicUsize::new(ended().map_or(0, |e| e.len())),
        })
    }

    /// The collated items at `positions` (a list of ints; one int unbatched), or None when an
    /// item failed and failures are fatal (the failure just counted ends the epoch).
    fn __call__(&self, py: Python<'_>, positions: Bound<'_, PyAny>) -> PyResult<PyObject> {
        let positions: Vec<usize> = match self.batched {
            true => positions.extract()?,
            false => vec![positions.extract()?],
        };
        let here = self.here(py)?;
        let mut whole = None;
        if self.getitems {
            match (here.dataset).call_method1("__getitems__", (PyList::new(py, &positions)?,)) {
                Ok(items) => match here.collate.call1((items,)) {
                    Ok(batch) => return Ok(batch.unbind()),
                    Err(e) if !self.skip_errors => return Err(e),
                    // Item by item instead: the items that do not make a batch are found.
                    Err(_) => {}
                },
                Err(e) if !self.skip_errors => return Err(e),
                // Item by item instead, so the failing items are named, counted and made up.
                Err(e) => whole = Some(e),
            }
        }
        let Some(items) = self.items(py, &here.dataset, &positions)? else {
            return Ok(py.None());
        };
        if items.is_empty() {
            return crate::stages::left_out(py); // one process: every item failed
        }
        if let (Some(e), true) = (whole, items.iter().map(|(p, _)| p).eq(&positions)) {
            // Every item read alone: the batch's own call failed, counted as the batch's.
            let part = format!("__getitems__ of the batch from item {}", positions[0]);
            skip(py, part, e)?;
        }
        self.collated(py, &here, &positions, items)
    }
}

/// Items with their positions.
type Items<'py> = Vec<(usize, Bound<'py, PyAny>)>;

impl Fetch {
    /// This call's dataset (this thread's copy: see `copies`) and `collate_fn`, from the
    /// loader.
    fn here<'py>(&self, py: Python<'py>) -> PyResult<Here<'py>> {
        let owner = self.owner.bind(py).call0()?;
        if owner.is_none() {
            return Err(pyo3::exceptions::PyRuntimeError::new_err(
                "the DataLoader was freed while its threads ran",
            ));
        }
        let collate = owner.getattr("collate_fn")?;
        let dataset = owner.getattr("dataset")?;
        let Some(copier) = &self.copier else {
            return Ok(Here { dataset, collate });
        };
        let copies = owner.getattr("_copies")?;
        let copies = copies.downcast::<PyDict>()?;
        let spare = owner.getattr("_spare")?;
        let spare = spare.downcast::<PyList>()?;
        self.prune(copies, spare)?;
        let me = THREAD.with(|t| t.0);
        let copy = match (copies.get_item(me)?, spare.len()) {
            (Some(copy), _) => return Ok(Here::on(copy, collate, &dataset)),
            (None, 0) => copy_of(copier.bind(py), &dataset)?,
            (None, n) => {
                let copy = spare.get_item(n - 1)?;
                spare.del_item(n - 1)?;
                copy
            }
        };
        copies.set_item(me, &copy)?;
        Ok(Here::on(copy, collate, &dataset))
    }

    /// Drops the copies of the threads that ended since the last call, or with `keep` moves
    /// them to `spare`.
    fn prune(&self, copies: &Bound<'_, PyDict>, spare: &Bound<'_, PyList>) -> PyResult<()> {
        let gone: Vec<u64> = match ended() {
            Some(ended) => {
                let from = self.pruned.swap(ended.len(), Ordering::Relaxed);
                ended.get(from..).unwrap_or_default().to_vec()
            }
            None => return Ok(()),
        };
        // Outside the lock: a copy's `__del__` runs here.
        for n in gone {
            let Some(copy) = copies.get_item(n)? else {
                continue;
            };
            copies.del_item(n)?;
            if self.keep {
                spare.append(copy)?;
            }
        }
        Ok(())
    }

    /// The readable items at `positions` (made up where every one failed, or none in one
    /// process), None when one failed and failures are fatal.
    fn items<'py>(
        &self,
        py: Python<'py>,
        dataset: &Bound<'py, PyAny>,
        positions: &[usize],
    ) -> PyResult<Option<Items<'py>>> {
        let mut items = Vec::with_capacity(positions.len());
        let mut first: Option<PyErr> = None;
        for &i in positions {
            match dataset.get_item(i) {
                Ok(x) => items.push((i, x)),
                // Any exception an item raises is its failure (KeyboardInterrupt too: on this
                // thread it is the dataset's, not the user's Ctrl-C).
                Err(e) => {
                    first.get_or_insert(e.clone_ref(py));
                    skip(py, format!("item {i}"), e)?;
                    if !self.skip_errors {
                        return Ok(None);
                    }
                    if let Some(m) = &self.makeup {
                        m.lock().expect("makeup").failed(i);
                    }
                }
            }
        }
        if items.is_empty() && self.makeup.is_none() {
            return Ok(Some(items)); // left out by the caller
        }
        if items.is_empty() {
            let last = *positions.last().expect("a batch has positions");
            items = self.made_up(dataset, last, positions.len());
        }
        match items.is_empty() {
            // Nothing readable to make it up with: the batch fails with its first item's error
            // (the epoch then raises "delivered nothing").
            true => Err(first.expect("an item failed")),
            false => Ok(Some(items)),
        }
    }

    /// Up to `want` readable items after position `last` in the rank's share of the epoch
    /// (the library's rule, [`MakeUp`]).
    fn made_up<'py>(&self, dataset: &Bound<'py, PyAny>, last: usize, want: usize) -> Items<'py> {
        let (Some(lock), Some(share)) = (&self.makeup, &self.share) else {
            return Vec::new(); // one process: nothing is made up
        };
        let order = share.now();
        // Made up on a copy: the dataset's calls may let another thread in, which must not
        // wait for this lock holding the GIL.
        let mut makeup = lock.lock().expect("makeup").clone();
        let items = makeup.after(&order, last, want, |p| dataset.get_item(p));
        lock.lock().expect("makeup").merge(makeup);
        self.filled.fetch_add(items.len() as u64, Ordering::Relaxed);
        items
    }

    /// `items` collated; where `collate_fn` raises and failures are skipped, as many of them
    /// as halving finds it collates ([`largest_batch`]), each left out a failed item with its
    /// error; where none collates alone, every one failed and the batch made up (of readable
    /// items after it, collated so; [`MAKE_UP_TRIES`] times), so every rank still makes
    /// `len()` batches. Past those tries the batch fails.
    fn collated<'py>(
        &self,
        py: Python<'py>,
        here: &Here<'py>,
        positions: &[usize],
        items: Items<'py>,
    ) -> PyResult<PyObject> {
        let dataset = &here.dataset;
        let all: Vec<usize> = (0..items.len()).collect();
        let error = match self.collate_some(py, here, &items, &all) {
            Err(e) if self.skip_errors => e,
            done => return done,
        };
        let fitted = largest_batch(items.len(), |set| self.collate_some(py, here, &items, set));
        let kept = fitted.as_ref().map_or(&[][..], |(kept, _)| kept.as_slice());
        for (k, (p, _)) in items.iter().enumerate() {
            if kept.binary_search(&k).is_err() {
                skip(py, format!("item {p}"), error.clone_ref(py))?;
            }
        }
        if let Ok((_, batch)) = fitted {
            return Ok(batch);
        }
        if self.makeup.is_none() {
            return crate::stages::left_out(py); // one process: no item collates, the batch is left out
        }
        // Made up of the readable items after it; where none of those collates alone either
        // (a collate_fn that takes no item of a kind in a batch of 1), of those after them,
        // a bounded number of times (a collate_fn that takes no batch this short would
        // otherwise read the dataset through for each).
        let mut last = *positions.last().expect("a batch has positions");
        for _ in 0..MAKE_UP_TRIES {
            let filler = self.made_up(dataset, last, positions.len());
            let Some(&(end, _)) = filler.last() else {
                break;
            };
            if let Ok((_, batch)) = largest_batch(filler.len(), |set| {
                self.collate_some(py, here, &filler, set)
            }) {
                return Ok(batch);
            }
            last = end;
        }
        Err(error)
    }

    /// `collate_fn` on the items at `which` (on the one item, unbatched).
    fn collate_some(
        &self,
        py: Python<'_>,
        here: &Here<'_>,
        items: &Items<'_>,
        which: &[usize],
    ) -> PyResult<PyObject> {
        match self.batched {
            true => {
                let list = PyList::new(py, which.iter().map(|&k| &items[k].1))?;
                here.collate.call1((list,)).map(Bound::unbind)
            }
            false => here.collate.call1((&items[which[0]].1,)).map(Bound::unbind),
        }
    }
}

/// A rank's share of each epoch, in its order, made once an epoch when a batch is made up.
struct Share {
    sampler: Sampler,
    /// Its epoch is the one being read.
    epoch: FailureLog,
    made: Mutex<Option<(u64, Arc<Vec<usize>>)>>,
}

impl Share {
    /// The share of the epoch being read.
    fn now(&self) -> Arc<Vec<usize>> {
        let epoch = self.epoch.epoch();
        let mut made = self.made.lock().expect("share");
        match &*made {
            Some((e, order)) if *e == epoch => Arc::clone(order),
            _ => {
                let order = Arc::new(self.sampler.epoch(epoch));
                *made = Some((epoch, Arc::clone(&order)));
                order
            }
        }
    }
}

/// Counts `error` as the failure of `part` (fatal unless failures are skipped).
fn skip(py: Python<'_>, part: String, error: PyErr) -> PyResult<()> {
    crate::stages::skip_part(py, part, error.into_value(py).into_bound(py).into_any())
}

/// A thread's copy of `dataset` (by `copier`), or an error that says why it is needed.
fn copy_of<'py>(
    copier: &Bound<'py, PyAny>,
    dataset: &Bound<'py, PyAny>,
) -> PyResult<Bound<'py, PyAny>> {
    let py = dataset.py();
    copier.call1((dataset,)).map_err(|e| {
        let err = pyo3::exceptions::PyTypeError::new_err(format!(
            "flowgate.DataLoader gives each of its threads a copy of the dataset \
             (copy.copy), as torch gives each worker one, and copying this one raised: {e}"
        ));
        err.set_cause(py, Some(e));
        err
    })
}
