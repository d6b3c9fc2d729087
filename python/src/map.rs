//! `map=` and `map_batch=`: the user's per-item function on a loader's own stage after
//! decoding ([`LoaderBuilder::map_items`](flowgate::loader::LoaderBuilder::map_items)), and
//! its per-batch function after collation
//! ([`map_batches`](flowgate::loader::LoaderBuilder::map_batches)).
//!
//! Each item reaches `map=` as a dict — the media under their batch names (zero-copy
//! `Batch`es), `label` where the loader has labels, `index` and `epoch` (to seed what it
//! draws), and each field besides the media — and what it returns under those names becomes
//! the item: arrays are copied into tensors, other values into fields (see
//! [`field_from_py`]). Each batch reaches `map_batch=` as the dict the loop would receive (and
//! `index`, a list, and `epoch`); what it returns replaces or adds keys: arrays become
//! tensors, lists of a value per row fields. Media it leaves alone are not copied (taken back
//! once no Python object holds them). An exception is the item's (or batch's) failure in the
//! stage. Calls hold the GIL: `stats()["gil"]` says whether threads help (code that releases
//! it — NumPy, PIL, tokenizers — runs on several at once).

use std::sync::Arc;

use flowgate::dataset::FieldValue;
use flowgate::loader::{MapBatches, MapItems, Sample};
use pyo3::exceptions::{PyKeyError, PyTypeError, PyValueError};
use pyo3::prelude::*;
use pyo3::types::{PyDict, PyList, PyString, PyTuple};

use crate::batch::{Batch, Mem};
use crate::error::py_error;
use crate::fork::PyItem;
use crate::gil::GilClock;
use crate::values::{field_from_py, field_to_py, tensor_from_py};

/// The stage's name in `stats()` and failures.
pub(crate) const STAGE: &str = "map";

/// The per-batch function's stage's name.
pub(crate) const BATCH_STAGE: &str = "map_batch";

std::thread_local! {
    /// The loader whose function this thread is calling (0: none).
    static CALLING: std::cell::Cell<u64> = const { std::cell::Cell::new(0) };
}

/// A new loader's token, naming it while its function runs ([`calling`]).
pub(crate) fn token() -> u64 {
    static NEXT: std::sync::atomic::AtomicU64 = std::sync::atomic::AtomicU64::new(1);
    NEXT.fetch_add(1, std::sync::atomic::Ordering::Relaxed)
}

/// Whether this thread is in the function of the loader with `token`: that loader's
/// pipeline cannot be stopped or started from here (it would wait for this very thread).
pub(crate) fn calling(token: Option<u64>) -> bool {
    token.is_some_and(|t| CALLING.with(std::cell::Cell::get) == t)
}

/// What the function's dicts hold: the media's names, whether there is a label, the fields'.
pub(crate) struct Keys {
    pub(crate) media: Vec<String>,
    pub(crate) label: bool,
    pub(crate) fields: Vec<String>,
}

/// The function `f` as the per-item function of the loader named by `token`, its calls timed
/// by `clock`.
pub(crate) fn python_map(f: Py<PyAny>, keys: Keys, clock: Arc<GilClock>, token: u64) -> MapItems {
    // Freed by whichever thread drops the loader's last stage: inside the fork gate.
    let f = PyItem::new(f);
    Arc::new(move |s: Sample| as_calling(token, &clock, |py| call(py, f.get(), &keys, s)))
}

/// The function `f` as the per-batch function of the loader named by `token` (`labels`:
/// whether the dataset has labels; `paths`: whether batches get `path`, a key it cannot
/// take), its calls timed by `clock`.
pub(crate) fn python_map_batches(
    f: Py<PyAny>,
    labels: bool,
    paths: bool,
    clock: Arc<GilClock>,
    token: u64,
) -> MapBatches {
    let f = PyItem::new(f);
    Arc::new(move |b| {
        as_calling(token, &clock, |py| {
            call_batch(py, f.get(), labels, paths, b)
        })
    })
}

/// Runs `call` with the GIL, timed by `clock`, as the function of the loader named `token`.
fn as_calling<R>(
    token: u64,
    clock: &GilClock,
    call: impl FnOnce(Python<'_>) -> PyResult<R>,
) -> Result<R, flowgate::BoxError> {
    let outer = CALLING.with(|c| c.replace(token));
    let r = clock.call(|py| call(py).map_err(|e| py_error(py, e).into()));
    CALLING.with(|c| c.set(outer));
    r
}

fn call(py: Python<'_>, f: &Py<PyAny>, keys: &Keys, mut s: Sample) -> PyResult<Sample> {
    let d = PyDict::new(py);
    let tensors = std::mem::take(&mut s.fields);
    if tensors.len() != keys.media.len() {
        return Err(pyo3::exceptions::PyRuntimeError::new_err(format!(
            "an item of {} tensors for the names {:?}",
            tensors.len(),
            keys.media
        )));
    }
    let mut given = Vec::with_capacity(tensors.len());
    // The objects given, to tell media returned as given from media the function set (the
    // dict it was given may be the one it changed and returned).
    let mut originals = Vec::with_capacity(tensors.len());
    for (name, t) in keys.media.iter().zip(tensors) {
        let m = Arc::new(Mem::Host(t));
        let obj = Bound::new(py, Batch::shared(&m))?.into_any();
        d.set_item(name, &obj)?;
        originals.push(obj.unbind());
        given.push(m);
    }
    if keys.label {
        d.set_item("label", s.meta.label)?;
    }
    d.set_item("index", s.meta.index)?;
    d.set_item("epoch", s.meta.epoch)?;
    for (name, v) in keys.fields.iter().zip(&s.meta.extras) {
        d.set_item(name, field_to_py(py, v)?)?;
    }
    let result = f.call1(py, (d.clone(),))?;
    let out = result.bind(py);
    let out = out.downcast::<PyDict>().map_err(|_| {
        pyo3::exceptions::PyTypeError::new_err(format!(
            "map= must return the item's dict (its keys: {}), not {}",
            names(&d),
            out.get_type()
                .name()
                .map_or_else(|_| "?".into(), |n| n.to_string())
        ))
    })?;
    for k in out.keys() {
        let k = match k.downcast::<PyString>() {
            Ok(s) => s.to_cow()?.into_owned(),
            Err(_) => {
                return Err(pyo3::exceptions::PyTypeError::new_err(format!(
                    "map= returned the key {k}, which is not a str"
                )))
            }
        };
        if !d.contains(&k)? {
            return Err(pyo3::exceptions::PyKeyError::new_err(format!(
                "map= returned {k:?}, which the batch has no place for (its keys: {}; name \
                 a field it adds in map_fields=)",
                names(&d)
            )));
        }
    }
    // What the function returned, else what it was given.
    let get = |k: &str| -> PyResult<Bound<'_, PyAny>> {
        match out.get_item(k)? {
            Some(v) => Ok(v),
            None => Ok(d.get_item(k)?.expect("given")),
        }
    };
    // The media it returned anew (the others are taken back below, once the dicts are gone).
    let mut media = Vec::with_capacity(given.len());
    for (name, original) in keys.media.iter().zip(&originals) {
        let v = get(name)?;
        let same = v.is(original.bind(py));
        media.push((!same).then(|| tensor_from_py(&v, name)).transpose()?);
    }
    if keys.label {
        let label = get("label")?;
        s.meta.label = Some(label.extract::<i64>().map_err(|_| {
            pyo3::exceptions::PyTypeError::new_err(format!(
                "map= returned the label {label}: the dataset has labels, each an int"
            ))
        })?);
    }
    for (k, name) in keys.fields.iter().enumerate() {
        if let Some(v) = out.get_item(name)? {
            s.meta.extras[k] = field_from_py(&v)
                .map_err(|e| PyValueError::new_err(format!("map= returned {name:?}: {e}")))?;
        }
    }
    drop(result);
    drop(d);
    drop(originals);
    for (new, m) in media.into_iter().zip(given) {
        s.fields.push(match new {
            Some(t) => t,
            None => match taken_back(m)? {
                Mem::Host(t) => t,
                _ => unreachable!("an item is in host memory"),
            },
        });
    }
    Ok(s)
}

/// Memory a function was given, back from Python: itself once no Python object holds it, else
/// (the function kept a view) a copy, the view staying valid.
fn taken_back(m: Arc<Mem>) -> PyResult<Mem> {
    Arc::try_unwrap(m).or_else(|shared| match &*shared {
        Mem::Host(t) => {
            let mut copy = flowgate::Tensor::for_overwrite(t.shape(), t.dtype());
            copy.bytes_mut().copy_from_slice(t.bytes());
            Ok(Mem::Host(copy))
        }
        _ => Err(PyValueError::new_err(
            "a function was given memory on a device (it runs before the upload)",
        )),
    })
}

fn names(d: &Bound<'_, PyDict>) -> String {
    d.keys()
        .iter()
        .map(|k| k.to_string())
        .collect::<Vec<_>>()
        .join(", ")
}

/// A value a per-batch function gave a key: a tensor, or a value per row.
enum Value {
    /// Left as given (taken back after the call).
    Kept(Arc<Mem>),
    Tensor(flowgate::Tensor),
    Rows(Vec<FieldValue>),
}

fn call_batch(
    py: Python<'_>,
    f: &Py<PyAny>,
    labels: bool,
    paths: bool,
    b: flowgate::loader::Batch,
) -> PyResult<flowgate::loader::Batch> {
    let flowgate::loader::Batch {
        fields,
        names,
        labels: label_tensor,
        mut items,
        extra_names,
    } = b;
    let n = items.len();
    let d = PyDict::new(py);
    // Each key in the batch's order with its value; a tensor is shared with its Python view.
    let mut keys: Vec<(String, Value)> = Vec::with_capacity(names.len() + extra_names.len());
    // The tensors' objects as given, by key: one returned as given is left (the dict given
    // may be the one the function changed and returned, so the test is the object's
    // identity, not the dict's value).
    let mut originals: Vec<(String, Py<PyAny>)> = Vec::with_capacity(names.len() + 1);
    for (name, m) in names.iter().zip(fields) {
        let m = Arc::new(m);
        let obj = Bound::new(py, Batch::shared(&m))?.into_any();
        d.set_item(name, &obj)?;
        originals.push((name.clone(), obj.unbind()));
        keys.push((name.clone(), Value::Kept(m)));
    }
    let mut label = label_tensor.map(Arc::new);
    if let Some(m) = &label {
        let obj = Bound::new(py, Batch::shared(m))?.into_any();
        d.set_item("label", &obj)?;
        originals.push(("label".to_owned(), obj.unbind()));
    }
    let mut columns: Vec<Vec<FieldValue>> = vec![Vec::with_capacity(n); extra_names.len()];
    for m in &mut items {
        for (k, v) in std::mem::take(&mut m.extras).into_iter().enumerate() {
            columns[k].push(v);
        }
    }
    for (name, values) in extra_names.iter().zip(columns) {
        let list = PyList::empty(py);
        for v in &values {
            list.append(field_to_py(py, v)?)?;
        }
        d.set_item(name, list)?;
        keys.push((name.clone(), Value::Rows(values)));
    }
    d.set_item("index", items.iter().map(|m| m.index).collect::<Vec<_>>())?;
    d.set_item("epoch", items.first().map_or(0, |m| m.epoch))?;
    let result = f.call1(py, (d.clone(),))?;
    let out = result.bind(py).downcast::<PyDict>().map_err(|_| {
        PyTypeError::new_err(format!(
            "map_batch= must return the batch's dict (its keys: {}), not {}",
            self::names(&d),
            type_name(result.bind(py))
        ))
    })?;
    for (k, v) in out.iter() {
        let k = k
            .downcast::<PyString>()
            .map_err(|_| {
                PyTypeError::new_err(format!("map_batch= returned the key {k}, not a str"))
            })?
            .to_cow()?
            .into_owned();
        // The rows' own keys: a function seeds with them, it cannot move rows.
        if k == "index" || k == "epoch" {
            continue;
        }
        if paths && k == "path" {
            return Err(PyKeyError::new_err(
                "map_batch= returned \"path\", the key the loader gives each batch's paths",
            ));
        }
        // A tensor returned as given: left. (A field's list is read again: it may have been
        // changed in place.)
        if originals
            .iter()
            .any(|(name, o)| *name == k && o.bind(py).is(&v))
        {
            continue;
        }
        if k == "label" && labels {
            let t = tensor_from_py(&v, "label")?;
            label = Some(Arc::new(Mem::Host(t)));
            continue;
        }
        let value = if v.is_instance_of::<PyList>() || v.is_instance_of::<PyTuple>() {
            let values = v
                .try_iter()?
                .map(|x| field_from_py(&x?))
                .collect::<PyResult<Vec<_>>>()
                .map_err(|e| PyValueError::new_err(format!("map_batch= returned {k:?}: {e}")))?;
            if values.len() != n {
                return Err(PyValueError::new_err(format!(
                    "map_batch= returned {k:?} with {} values for a batch of {n} rows (a \
                     list is a value per row)",
                    values.len()
                )));
            }
            Value::Rows(values)
        } else {
            Value::Tensor(tensor_from_py(&v, &k)?)
        };
        match keys.iter_mut().find(|(name, _)| *name == k) {
            Some((_, old)) => *old = value,
            None => keys.push((k, value)),
        }
    }
    // The views given are freed here unless the function kept one: then what it left is
    // copied, and its view stays valid.
    drop(result);
    drop(d);
    drop(originals);
    let (mut names, mut fields, mut extra_names) = (Vec::new(), Vec::new(), Vec::new());
    let mut columns = Vec::new();
    for (name, value) in keys {
        match value {
            Value::Kept(m) => {
                names.push(name);
                fields.push(taken_back(m)?);
            }
            Value::Tensor(t) => {
                names.push(name);
                fields.push(Mem::Host(t));
            }
            Value::Rows(v) => {
                extra_names.push(name);
                columns.push(v.into_iter());
            }
        }
    }
    for m in &mut items {
        m.extras = columns
            .iter_mut()
            .map(|c| c.next().expect("n values"))
            .collect();
    }
    Ok(flowgate::loader::Batch {
        fields,
        names: names.into(),
        labels: label.map(taken_back).transpose()?,
        items,
        extra_names: extra_names.into(),
    })
}

fn type_name(v: &Bound<'_, PyAny>) -> String {
    v.get_type()
        .name()
        .map_or_else(|_| "?".into(), |n| n.to_string())
}
