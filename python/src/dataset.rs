//! What a loader reads, from its Python arguments: a path (a directory, a list file or one
//! media file), a sequence of paths, a `flowgate.Shards`, `flowgate.Parquet` or
//! `flowgate.Mix`, and `labels` → a [`Source`] of the library, with Python's exceptions for
//! bad arguments. Opening, shuffling, dealing and labelling are the library's
//! ([`flowgate::dataset`]).

use std::collections::HashMap;
use std::path::PathBuf;

use flowgate::dataset::{Labels, Remote, Source};
use flowgate::sampler::MixStop;
use flowgate::PipelineError;
use pyo3::exceptions::{PyFileNotFoundError, PyValueError};
use pyo3::prelude::*;
use pyo3::types::PyDict;

/// A missing path as Python's `FileNotFoundError(errno, message, path)`.
fn not_found(path: &std::path::Path) -> PyErr {
    PyFileNotFoundError::new_err((
        2,
        "No such file or directory".to_owned(),
        path.display().to_string(),
    ))
}

/// A dataset that cannot be opened: `FileNotFoundError` for a missing file, else
/// `ValueError`.
pub(crate) fn open_error(e: PipelineError) -> PyErr {
    let text = e.to_string();
    // Not found, as Python says it; and ImageFolder's own missing-class errors (raised as
    // torchvision raises them: FileNotFoundError).
    if text.contains("No such file")
        || text.contains("entity not found")
        || text.contains("Couldn't find any class folder")
        || text.contains("Found no valid file for the classes")
    {
        PyFileNotFoundError::new_err(text)
    } else {
        PyValueError::new_err(text)
    }
}

/// The source `paths` names, with `labels` (as the loaders take them) and `extensions` (the
/// loader's media, to tell a media file from a list file).
pub(crate) fn source_of(
    paths: &Bound<'_, PyAny>,
    extensions: &[&str],
    labels: Option<&Bound<'_, PyAny>>,
) -> PyResult<Source> {
    if paths.hasattr("_flowgate_mix")? {
        return mix(paths, labels);
    }
    if paths.hasattr("_flowgate_shards")? || paths.hasattr("_flowgate_parquet")? {
        return Ok(records(paths, label_field(labels)?)?.expect("shards or Parquet"));
    }
    let source = if let Ok(p) = paths.extract::<PathBuf>() {
        let media = p
            .extension()
            .and_then(|e| e.to_str())
            .is_some_and(|e| extensions.iter().any(|x| x.eq_ignore_ascii_case(e)));
        if !p.exists() {
            return Err(not_found(&p));
        } else if p.is_dir() {
            Source::dir(p)
        } else if media {
            // One media file, not a list of them.
            Source::files([p])
        } else {
            Source::list(p)
        }
    } else {
        Source::files(paths.extract::<Vec<PathBuf>>()?)
    };
    Ok(match labels {
        None => source,
        Some(l) => source.labels(file_labels(l)?),
    })
}

/// `labels` of files: `"folder"`, a sequence of ints (one per file, in dataset order) or a
/// mapping from path to int.
fn file_labels(labels: &Bound<'_, PyAny>) -> PyResult<Labels> {
    if let Ok(kind) = labels.extract::<String>() {
        if kind != "folder" {
            return Err(PyValueError::new_err(format!(
                "labels must be \"folder\", a sequence of ints or a mapping from path to int, not {kind:?}"
            )));
        }
        return Ok(Labels::Folder);
    }
    if let Ok(map) = labels.downcast::<PyDict>() {
        let mut by_path = HashMap::with_capacity(map.len());
        for (k, v) in map.iter() {
            by_path.insert(k.extract::<PathBuf>()?, v.extract::<i64>()?);
        }
        return Ok(Labels::ByPath(by_path));
    }
    Ok(Labels::Values(labels.extract()?))
}

/// `labels` of shards, Parquet or a mixture: the name of the field holding each label.
fn label_field(labels: Option<&Bound<'_, PyAny>>) -> PyResult<Option<String>> {
    labels
        .map(|l| {
            l.extract::<String>().map_err(|_| {
                PyValueError::new_err(
                    "with Shards, Parquet or Mix, labels names the field that holds each \
                     sample's label (an extension such as \"cls\", or a column)",
                )
            })
        })
        .transpose()
}

/// A `flowgate.Shards` or `flowgate.Parquet` as a source (`None` for anything else), its
/// labels in `label`.
fn records(paths: &Bound<'_, PyAny>, label: Option<String>) -> PyResult<Option<Source>> {
    let source = if paths.hasattr("_flowgate_parquet")? {
        let files: Vec<PathBuf> = paths.getattr("paths")?.extract()?;
        for p in &files {
            if !p.to_string_lossy().starts_with("s3://") && !p.exists() {
                return Err(not_found(p));
            }
        }
        let column: String = paths.getattr("column")?.extract()?;
        Source::parquet(files, column).remote(Remote {
            endpoint: paths.getattr("endpoint")?.extract()?,
            ..Remote::default()
        })
    } else if paths.hasattr("_flowgate_shards")? {
        let pattern: String = paths.getattr("pattern")?.extract()?;
        let fields: Option<Vec<String>> = paths.getattr("fields")?.extract()?;
        let cache_bytes = flowgate::limits::CACHE_MB
            .bytes(paths.getattr("cache_mb")?.extract()?)
            .map_err(crate::error::out_of_range)?;
        let s = Source::shards(pattern).remote(Remote {
            endpoint: paths.getattr("endpoint")?.extract()?,
            region: None,
            cache_dir: paths.getattr("cache_dir")?.extract()?,
            cache_bytes,
            prefetch: paths.getattr("prefetch")?.extract()?,
        });
        match fields {
            Some(f) => s.fields(f),
            None => s,
        }
    } else {
        return Ok(None);
    };
    let source = source.buffer(paths.getattr("buffer")?.extract()?);
    Ok(Some(match label {
        Some(l) => source.labels(Labels::Field(l)),
        None => source,
    }))
}

/// A `flowgate.Mix`: its sources (shards or Parquet), weights, stop rule and labels (one
/// field for all, or one per source).
fn mix(paths: &Bound<'_, PyAny>, labels: Option<&Bound<'_, PyAny>>) -> PyResult<Source> {
    let sources: Vec<Bound<'_, PyAny>> = paths.getattr("sources")?.extract()?;
    let weights: Vec<f64> = paths.getattr("weights")?.extract()?;
    let draws: Option<i128> = paths.getattr("draws")?.extract()?;
    let stop: String = paths.getattr("stop")?.extract()?;
    let per_source: Option<Vec<Option<String>>> = paths.getattr("labels")?.extract()?;
    let common = match per_source {
        None => label_field(labels)?,
        Some(_) => None,
    };
    let mut parts = Vec::with_capacity(sources.len());
    for (k, src) in sources.iter().enumerate() {
        let label = match &per_source {
            Some(l) => l.get(k).cloned().flatten(),
            None => common.clone(),
        };
        parts.push(records(src, label)?.ok_or_else(|| {
            PyValueError::new_err(format!(
                "Mix: sources[{k}] is not a flowgate.Shards or flowgate.Parquet"
            ))
        })?);
    }
    let stop = mix_stop(sources.len(), &weights, draws, &stop)?;
    Ok(Source::mix(parts, weights).stop(stop))
}

/// A mixture's weights and stop rule checked by the library (`Mix: weights: ...`), before any
/// source is opened: when `flowgate.Mix` is made, and again when a loader reads one.
fn mix_stop(sources: usize, weights: &[f64], draws: Option<i128>, stop: &str) -> PyResult<MixStop> {
    let mix = |m: String| PyValueError::new_err(format!("Mix: {m}"));
    flowgate::sampler::check_weights(sources, weights).map_err(mix)?;
    MixStop::named(draws, stop).map_err(mix)
}

/// `flowgate.Mix`'s check at construction: see [`mix_stop`].
#[pyfunction]
pub(crate) fn _check_mix(
    sources: usize,
    weights: &Bound<'_, PyAny>,
    draws: Option<i128>,
    stop: &str,
) -> PyResult<()> {
    // Numbers as a pipeline file's are: a string or a bool is not a weight.
    let value = crate::values::value_of(weights).map_err(PyValueError::new_err)?;
    let weights: Vec<flowgate::limits::Float> = serde_json::from_value(value).map_err(|e| {
        PyValueError::new_err(format!(
            "Mix: weights: {}",
            flowgate::limits::in_words(&e.to_string())
        ))
    })?;
    let weights: Vec<f64> = weights.into_iter().map(|w| w.0).collect();
    mix_stop(sources, &weights, draws, stop).map(drop)
}
