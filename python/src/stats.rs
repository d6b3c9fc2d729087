//! Statistics as Python values: each stage's (`stats()["stages"]` of a loader and of a
//! `Pipeline`) and the tuner's trace (`tuner_trace()`).

use flowgate::TraceRecord;
use pyo3::prelude::*;
use pyo3::types::{PyDict, PyList};

/// The tuner's ticks, oldest first, as `tuner_trace()` gives them (see the loader's
/// `tuner_trace`).
pub(crate) fn trace_to_py(
    py: Python<'_>,
    records: Vec<TraceRecord>,
) -> PyResult<Bound<'_, PyList>> {
    let out = PyList::empty(py);
    for r in records {
        let d = PyDict::new(py);
        d.set_item("t", r.t)?;
        d.set_item("rate", r.rate)?;
        d.set_item("wait", r.wait)?;
        d.set_item("stages", &r.stages)?;
        d.set_item("workers", r.workers)?;
        d.set_item("budgets", r.budgets)?;
        d.set_item("bytes", r.buffered_bytes)?;
        d.set_item("memory_budget", r.memory_budget)?;
        d.set_item("rss_bytes", r.rss_bytes)?;
        // As the `flowgate` command says them: `decode → 2 workers: <why>`.
        let decisions: Vec<String> = r
            .decisions
            .iter()
            .map(|x| {
                let what = x.action.describe(&r.stages, r.memory_budget);
                format!("{what}: {}", x.reason)
            })
            .collect();
        d.set_item("decisions", decisions)?;
        if let Some(c) = r.cpu {
            let cpu = PyDict::new(py);
            cpu.set_item("budget", c.budget)?;
            cpu.set_item("node_busy", c.node_busy)?;
            cpu.set_item("held", c.held)?;
            cpu.set_item("share", c.share)?;
            cpu.set_item("waited", c.waited)?;
            cpu.set_item("why", c.why)?;
            d.set_item("cpu", cpu)?;
        }
        out.append(d)?;
    }
    Ok(out)
}

/// Each stage's statistics, by name, as `stats()["stages"]` gives them.
pub(crate) fn stages_to_py<'py>(
    py: Python<'py>,
    s: &flowgate::PipelineStats,
) -> PyResult<Bound<'py, PyDict>> {
    let stages = PyDict::new(py);
    for st in &s.stages {
        let x = PyDict::new(py);
        x.set_item("workers", st.workers)?;
        x.set_item("items_in", st.items_in)?;
        x.set_item("items_out", st.items_out)?;
        x.set_item("items_per_s", st.items_per_s)?;
        // What the stage holds now, as the memory budget counts it, and its limit.
        x.set_item("bytes", st.queue_bytes)?;
        x.set_item("budget_bytes", st.budget_bytes)?;
        if let Some(r) = st.read_ahead {
            // Shards on S3: how many are fetched ahead (the tuner deepens it).
            x.set_item("read_ahead", r.depth)?;
        }
        if let Some(t) = st.item_threads {
            // Video: decoder threads per clip (the tuner sets them).
            x.set_item("item_threads", t.threads)?;
        }
        stages.set_item(&st.name, x)?;
    }
    Ok(stages)
}
