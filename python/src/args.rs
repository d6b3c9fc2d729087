//! A loader from the Python wrappers' arguments: the loader's settings and the media's
//! arguments as dicts, read into the library's [`LoaderSettings`] and [`MediaArgs`] (their
//! defaults, rules and words, the same a pipeline file gets), and what only Python has: the
//! labels as Python objects, the paths returned, the device, a DataLoader worker's part.

use flowgate::loader::LoaderSettings;
use flowgate::media::MediaArgs;
use pyo3::exceptions::PyValueError;
use pyo3::prelude::*;
use pyo3::types::PyBool;
use serde_json::Value;

use crate::dataset::{open_error, source_of};
use crate::device::open_device;
use crate::error::out_of_range;
use crate::loader::Loader;
use crate::values::value_of;

/// `value_of` as a `ValueError`.
fn data(v: &Bound<'_, PyAny>) -> PyResult<Value> {
    value_of(v).map_err(PyValueError::new_err)
}

/// A loader of what `paths` names (a directory, a list file, a media file, a sequence of
/// paths, a `flowgate.Shards`, `flowgate.Parquet` or `flowgate.Mix`): `settings` as
/// [`LoaderSettings`] names them, each item decoded as `media` (a [`MediaArgs`] dict:
/// `{"kind": "image", "crop": 224, ...}`) says.
#[pyfunction]
#[pyo3(signature = (paths, settings, media, labels=None, return_paths=false, device="cpu",
    device_memory_mb=None, reader=None, units=false, plans_units=false, fields=None, map=None, map_fields=None,
    map_batch=None))]
#[allow(clippy::too_many_arguments)]
pub(crate) fn loader(
    paths: &Bound<'_, PyAny>,
    settings: &Bound<'_, PyAny>,
    media: &Bound<'_, PyAny>,
    labels: Option<&Bound<'_, PyAny>>,
    return_paths: bool,
    device: &str,
    device_memory_mb: Option<&Bound<'_, PyAny>>,
    reader: Option<(usize, usize)>,
    units: bool,
    plans_units: bool,
    fields: Option<&Bound<'_, PyAny>>,
    map: Option<Py<PyAny>>,
    map_fields: Option<Vec<String>>,
    map_batch: Option<Py<PyAny>>,
) -> PyResult<Loader> {
    let py = paths.py();
    let invalid = |e: flowgate::loader::SettingsError| PyValueError::new_err(e.to_string());
    let settings = LoaderSettings::from_value(data(settings)?).map_err(PyValueError::new_err)?;
    let media = MediaArgs::from_value(data(media)?).map_err(PyValueError::new_err)?;
    let recipe = settings.recipe(&media).map_err(invalid)?;
    let device_bytes = device_memory_mb
        .map(|m| number("device_memory_mb", m))
        .transpose()?
        .map(|m| flowgate::limits::DEVICE_MEMORY_MB.bytes(m))
        .transpose()
        .map_err(out_of_range)?;
    let (fields, media_fields) = match fields {
        None => (Vec::new(), Vec::new()),
        Some(f) => flowgate::loader::fields_and_media(data(f)?).map_err(PyValueError::new_err)?,
    };
    let source = source_of(paths, recipe.extensions(), labels)?.extra_fields(fields);
    let dataset = settings.dataset(source, &recipe).map_err(invalid)?;
    // Opening reads listings, manifests and footers (on S3: requests, retries): without
    // the GIL, so the process's other threads run meanwhile.
    let dataset = crate::lifecycle::released(py, move || dataset.build()).map_err(open_error)?;
    let map_fields = map_fields.unwrap_or_default();
    let has_labels = dataset.has_labels();
    let dataset_fields: Vec<String> = dataset
        .extra_fields()
        .iter()
        .map(|f| f.name.clone())
        .filter(|n| !media_fields.iter().any(|m| m.name == *n))
        .collect();
    let mut b = settings.builder(dataset, recipe, &media).map_err(invalid)?;
    for m in &media_fields {
        let recipe = settings.field_recipe(m).map_err(invalid)?;
        b = b.media_field(&m.name, recipe);
    }
    let names = crate::loader::Names::new(b.tensor_names(), labels.is_some(), return_paths);
    let keys = crate::map::Keys {
        media: names.media.clone(),
        label: has_labels,
        fields: dataset_fields
            .into_iter()
            .chain(map_fields.iter().cloned())
            .collect(),
    };
    // The keys a function's dict has: none of the fields may take `index` or `epoch`.
    let function_fields = keys.fields.clone();
    let mut gil = None;
    let mut token = None;
    match map {
        Some(f) => {
            if !f.bind(py).is_callable() {
                return Err(PyValueError::new_err(
                    "map= must be a function of an item's dict",
                ));
            }
            names.check(&keys.fields, true)?;
            let clock = std::sync::Arc::new(crate::gil::GilClock::default());
            gil = Some(std::sync::Arc::clone(&clock));
            let t = crate::map::token();
            token = Some(t);
            let f = crate::map::python_map(f, keys, clock, t);
            b = b
                .map_items_shared(crate::map::STAGE, Some(f))
                .map_fields(map_fields);
        }
        None if !map_fields.is_empty() => {
            return Err(PyValueError::new_err(
                "map_fields: fields added by map=, without one",
            ))
        }
        None => {}
    }
    // Batches are dicts where a function names their keys, or the media are several.
    let dict = map_batch.is_some() || !media_fields.is_empty();
    if let Some(f) = map_batch {
        if !f.bind(py).is_callable() {
            return Err(PyValueError::new_err(
                "map_batch= must be a function of a batch's dict",
            ));
        }
        names.check(&function_fields, true)?;
        let clock = gil.get_or_insert_with(Default::default);
        let t = *token.get_or_insert_with(crate::map::token);
        let f = crate::map::python_map_batches(
            f,
            has_labels,
            return_paths,
            std::sync::Arc::clone(clock),
            t,
        );
        b = b.map_batches_shared(crate::map::BATCH_STAGE, Some(f));
    }
    if plans_units {
        b = b.plans_units();
    }
    if units {
        b = b.decodes_units();
    }
    if let Some((reader, readers)) = reader {
        b = b.reader(reader, readers);
    }
    if let Some(d) = open_device(device, device_bytes)? {
        b = b.device(d);
    }
    let loader = crate::lifecycle::released(py, move || b.build())
        .map_err(|e| PyValueError::new_err(e.to_string()))?;
    let mut loader = Loader::new(loader, return_paths, names, dict)?;
    loader.gil = gil;
    loader.map_token = token;
    Ok(loader)
}

/// The batches a `DataLoader` makes ahead of its loop (the library's
/// [`batches_ahead`](flowgate::limits::batches_ahead)): refused, in its words, past the limit.
#[pyfunction]
pub(crate) fn _batches_ahead(
    prefetch_factor: Option<u64>,
    num_workers: u64,
    cores: u64,
) -> PyResult<u64> {
    flowgate::limits::batches_ahead(prefetch_factor, num_workers, cores).map_err(out_of_range)
}

/// Checks the argument `name` (of a loader or a source) against the library's limits, in its
/// words: what `flowgate.Shards(...)` and the loaders call before anything is built.
#[pyfunction]
pub(crate) fn _check_limit(name: &str, value: &Bound<'_, PyAny>) -> PyResult<()> {
    use flowgate::limits::*;
    let whole_limit = match name {
        "batch_size" => BATCH_SIZE,
        "workers" => WORKERS,
        "num_workers" => NUM_WORKERS,
        "prefetch" => PREFETCH,
        "buffer" => BUFFER,
        "buckets" => BUCKETS,
        "epoch" => EPOCH,
        "draws" => DRAWS,
        "prefetch_factor" => PREFETCH_FACTOR,
        _ => {
            let limit = match name {
                "cache_mb" => CACHE_MB,
                "memory_mb" => MEMORY_MB,
                "device_memory_mb" => DEVICE_MEMORY_MB,
                _ => return Err(PyValueError::new_err(format!("no limit named {name:?}"))),
            };
            return limit
                .bytes(number(name, value)?)
                .map(drop)
                .map_err(out_of_range);
        }
    };
    whole(whole_limit, value).map(drop)
}

/// `value` as a number, read as the settings read theirs (a bool or a string is not one),
/// the error naming `key`.
fn number(key: &str, value: &Bound<'_, PyAny>) -> PyResult<f64> {
    let v = value_of(value).map_err(|e| PyValueError::new_err(format!("{key}: {e}")))?;
    serde_json::from_value::<flowgate::limits::Float>(v)
        .map(|f| f.0)
        .map_err(|e| {
            let e = flowgate::limits::in_words(&e.to_string());
            PyValueError::new_err(format!("{key}: {e}"))
        })
}

/// `value` as a whole number in `limit`'s range, or a `ValueError` in the library's words
/// (`size: must be in 1..=65536, not -1`), whatever Python gave: a bool, a float, a string,
/// None, an int past 128 bits (shown as Python writes it).
pub(crate) fn whole(limit: flowgate::limits::Limit, value: &Bound<'_, PyAny>) -> PyResult<u64> {
    let refused = |message: String| {
        out_of_range(flowgate::limits::OutOfRange {
            key: limit.key,
            message,
        })
    };
    if value.is_instance_of::<pyo3::types::PyInt>() && !value.is_instance_of::<PyBool>() {
        return match value.extract::<i128>() {
            Ok(v) => limit.check(v).map_err(out_of_range),
            // Past 128 bits: out of every range, in the same words.
            Err(_) => Err(refused(format!(
                "must be in {}..={}, not {value}",
                limit.min, limit.max
            ))),
        };
    }
    // Anything else as a pipeline file's value would be read (NumPy ints are ints there);
    // what has no such value (a complex, bytes) shown as Python writes it.
    match value_of(value) {
        Ok(v) => flowgate::limits::whole::value(limit, v).map_err(refused),
        Err(_) => Err(refused(format!(
            "must be in {}..={}, not {}",
            limit.min,
            limit.max,
            value.repr()?
        ))),
    }
}

/// `cpu_budget=` as the library reads it (a number of cores, a fraction of the node or a
/// percentage; a bool or any other type refused, naming the argument).
pub(crate) fn cpu_budget_of(v: &Bound<'_, PyAny>) -> PyResult<flowgate::CpuBudget> {
    let budget = value_of(v).map_err(|e| PyValueError::new_err(format!("cpu_budget: {e}")))?;
    let settings = serde_json::json!({ "cpu_budget": budget });
    let s = LoaderSettings::from_value(settings).map_err(PyValueError::new_err)?;
    Ok(s.cpu_budget.expect("given"))
}
