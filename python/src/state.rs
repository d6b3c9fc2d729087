//! `state_dict`s: a [`PipelineState`] as plain Python ints, strings and lists (picklable,
//! JSON-able), back, and merged across ranks.

use flowgate::sampler::{Blocks, ShareLengths};
use flowgate::{PipelineState, ShareState};
use pyo3::exceptions::PyValueError;
use pyo3::prelude::*;
use pyo3::types::{PyDict, PyList};

/// A `state_dict` of `s`: plain ints, strings and lists (picklable, JSON-able).
pub(crate) fn state_to_py<'py>(py: Python<'py>, s: &PipelineState) -> PyResult<Bound<'py, PyDict>> {
    let d = PyDict::new(py);
    d.set_item("epoch", s.epoch)?;
    d.set_item("delivered", PyList::new(py, s.delivered.iter().copied())?)?;
    d.set_item("delivered_items", s.delivered_items)?;
    d.set_item("version", s.version)?;
    d.set_item("fingerprint", s.fingerprint.clone())?;
    d.set_item("partial", PyList::new(py, s.partial.iter().copied())?)?;
    if let Some(n) = s.owed_batches {
        // fill_skipped: the batches this rank still owes in the epoch.
        d.set_item("owed_batches", n)?;
    }
    if let Some(sh) = &s.shard {
        let x = PyDict::new(py);
        x.set_item("rank", sh.rank)?;
        x.set_item("world_size", sh.world)?;
        x.set_item("shard_lengths", format!("{:?}", sh.lengths).to_lowercase())?;
        x.set_item("global_len", sh.global_len)?;
        x.set_item("base", PyList::new(py, sh.base.iter().copied())?)?;
        if let Some(b) = &sh.blocks {
            // Tar shards: each rank's contiguous block and its shuffle buffer.
            x.set_item("block_window", b.window)?;
            x.set_item("block_seed", b.seed)?;
        }
        if let Some((w, n)) = sh.split {
            x.set_item("worker", w)?;
            x.set_item("workers", n)?;
        }
        d.set_item("shard", x)?;
    }
    Ok(d)
}

/// Tuples of `N` ints from tuples or lists (a state_dict through JSON has lists).
fn tuples<const N: usize>(v: Option<Bound<'_, PyAny>>) -> PyResult<Vec<[u64; N]>> {
    let Some(v) = v else { return Ok(Vec::new()) };
    v.try_iter()?
        .map(|p| {
            let x: Vec<u64> = p?.extract()?;
            x.as_slice().try_into().map_err(|_| {
                PyValueError::new_err(format!("state_dict: {x:?} is not {N} integers"))
            })
        })
        .collect()
}

/// `[start, end)` pairs (see [`tuples`]).
fn pairs(v: Option<Bound<'_, PyAny>>) -> PyResult<Vec<(u64, u64)>> {
    Ok(tuples::<2>(v)?.into_iter().map(|[a, b]| (a, b)).collect())
}

/// The state a `state_dict` describes (see [`state_to_py`]).
pub(crate) fn state_from_py(state: &Bound<'_, PyDict>) -> PyResult<PipelineState> {
    fn get<'py>(d: &Bound<'py, PyDict>, k: &str) -> PyResult<Bound<'py, PyAny>> {
        d.get_item(k)?
            .ok_or_else(|| PyValueError::new_err(format!("state_dict without `{k}`")))
    }
    let shard = match state.get_item("shard")? {
        None => None,
        Some(x) => {
            let x = x.downcast::<PyDict>()?;
            let lengths: String = get(x, "shard_lengths")?.extract()?;
            Some(ShareState {
                rank: get(x, "rank")?.extract()?,
                world: get(x, "world_size")?.extract()?,
                lengths: match lengths.as_str() {
                    "uneven" => ShareLengths::Uneven,
                    "drop" => ShareLengths::Drop,
                    "pad" => ShareLengths::Pad,
                    other => {
                        return Err(PyValueError::new_err(format!(
                            "state_dict: shard_lengths {other:?} (uneven, drop or pad)"
                        )))
                    }
                },
                global_len: get(x, "global_len")?.extract()?,
                base: pairs(x.get_item("base")?)?,
                blocks: match (x.get_item("block_window")?, x.get_item("block_seed")?) {
                    (Some(w), Some(s)) => Some(Blocks {
                        window: w.extract()?,
                        seed: s.extract()?,
                    }),
                    _ => None,
                },
                split: match (x.get_item("worker")?, x.get_item("workers")?) {
                    (Some(w), Some(n)) => Some((w.extract()?, n.extract()?)),
                    _ => None,
                },
            })
        }
    };
    Ok(PipelineState {
        epoch: get(state, "epoch")?.extract()?,
        delivered: pairs(Some(get(state, "delivered")?))?,
        delivered_items: get(state, "delivered_items")?.extract()?,
        // (position, start, end) parts; version 1's (position, share) pairs say which parts
        // arrived no more, and are left out (the item is delivered again whole).
        partial: match state
            .get_item("version")?
            .map(|v| v.extract::<u32>())
            .transpose()?
        {
            Some(v) if v >= 2 => tuples::<3>(state.get_item("partial")?)?
                .into_iter()
                .map(|[i, a, b]| (i, a, b))
                .collect(),
            _ => Vec::new(),
        },
        version: match state.get_item("version")? {
            Some(v) => v.extract()?,
            None => 0,
        },
        fingerprint: match state.get_item("fingerprint")? {
            Some(f) => f.extract()?,
            None => Default::default(),
        },
        shard,
        owed_batches: state
            .get_item("owed_batches")?
            .map(|v| v.extract())
            .transpose()?,
    })
}

/// Merges the `state_dict()`s every rank of one world took at the same step into one that a
/// loader of any world size resumes: the rest of the epoch is dealt out evenly to the new
/// ranks. Raises ValueError if they do not fit together (another configuration, a rank
/// missing or twice, different epochs).
#[pyfunction]
pub(crate) fn merge_state_dicts<'py>(
    py: Python<'py>,
    states: Vec<Bound<'py, PyDict>>,
) -> PyResult<Bound<'py, PyDict>> {
    let states = states
        .iter()
        .map(state_from_py)
        .collect::<PyResult<Vec<_>>>()?;
    let merged = PipelineState::merge(&states).map_err(|e| PyValueError::new_err(e.to_string()))?;
    state_to_py(py, &merged)
}
