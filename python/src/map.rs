//! `map=`: the user's per-item function on a loader's own stage, after decoding
//! ([`LoaderBuilder::map_items`](flowgate::loader::LoaderBuilder::map_items)). Each item
//! reaches it as a dict — the media under their batch names (zero-copy `Batch`es), `label`
//! where the loader has labels, `index` and `epoch` (to seed what it draws), and each field
//! besides the media — and what it returns under those names becomes the item: arrays are
//! copied into tensors, other values into fields (see [`field_from_py`]). An exception is the
//! item's failure in the stage. Calls hold the GIL: `stats()["gil"]` says whether threads
//! help (code that releases it — NumPy, PIL, tokenizers — runs on several at once).

use std::sync::Arc;

use flowgate::loader::{MapItems, Sample};
use pyo3::prelude::*;
use pyo3::types::{PyDict, PyString};

use crate::batch::Batch;
use crate::error::py_error;
use crate::gil::GilClock;
use crate::values::{field_from_py, field_to_py, tensor_from_py};

/// The stage's name in `stats()` and failures.
pub(crate) const STAGE: &str = "map";

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
    pub(crate) media: Vec<&'static str>,
    pub(crate) label: bool,
    pub(crate) fields: Vec<String>,
}

/// The function `f` as the per-item function of the loader named by `token`, its calls timed
/// by `clock`.
pub(crate) fn python_map(f: Py<PyAny>, keys: Keys, clock: Arc<GilClock>, token: u64) -> MapItems {
    Arc::new(move |s: Sample| {
        let outer = CALLING.with(|c| c.replace(token));
        let r = clock.call(|py| call(py, &f, &keys, s).map_err(|e| py_error(py, e).into()));
        CALLING.with(|c| c.set(outer));
        r
    })
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
    for (name, t) in keys.media.iter().zip(tensors) {
        d.set_item(name, Bound::new(py, Batch::from(t))?)?;
    }
    if keys.label {
        d.set_item("label", s.meta.label)?;
    }
    d.set_item("index", s.meta.index)?;
    d.set_item("epoch", s.meta.epoch)?;
    for (name, v) in keys.fields.iter().zip(&s.meta.extras) {
        d.set_item(name, field_to_py(py, v)?)?;
    }
    let out = f.call1(py, (d.clone(),))?;
    let out = out.bind(py);
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
    for name in &keys.media {
        s.fields.push(tensor_from_py(&get(name)?, name)?);
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
            s.meta.extras[k] = field_from_py(&v)?;
        }
    }
    Ok(s)
}

fn names(d: &Bound<'_, PyDict>) -> String {
    d.keys()
        .iter()
        .map(|k| k.to_string())
        .collect::<Vec<_>>()
        .join(", ")
}
