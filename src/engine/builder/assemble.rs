//! Turns a [`Plan`] into a running [`Pipeline`]: starts the runtime, the source, every stage
//! and the sink, the control plane, the tuner actor and the stats callback, in that order, and
//! hands the finished parts to [`Pipeline::from_parts`]. Nothing is assembled after that.

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;

use actix::Actor;
use flowgate_actors::actor::ControlPlane;
use flowgate_actors::attached::WithKnobs;
use flowgate_actors::channel::{Budget, Channel};
use flowgate_actors::error::PipelineError;
use flowgate_actors::failure::{FailureBudget, Failures};
use flowgate_actors::sink::SinkReader;
use flowgate_actors::stage::{StageControl, StageCore};
use flowgate_actors::tuner::{TraceLog, TunerActor, TunerSettings};
use flowgate_tuner::StageKind;

use super::plan::{Autotune, BuildCtx, Plan};
use crate::engine::config::Config;
use crate::engine::pipeline::Pipeline;
use crate::engine::running::{Engine, HasBudget};
use crate::engine::stats::PipelineStats;

/// Starts everything in `plan`; `tail` is the last channel (the sink's), whose items each
/// stand for `tail_scale` source items.
pub(crate) fn assemble<T: Send + 'static>(
    plan: Plan,
    tail: Arc<Channel<T>>,
    tail_scale: usize,
) -> Result<Pipeline<T>, PipelineError> {
    plan.validate()?;
    crate::engine::pipeline::return_large_frees();
    let Plan {
        mut cfg,
        mut autotune,
        source,
        stages,
        channels,
        needs_runtime,
        on_stats,
        on_failure,
    } = plan;
    // The node CPU budget: the builder's, or the tuner's settings'; joined before any stage
    // starts, and only this pipeline's pool stages hold its cores.
    if cfg.cpu_budget.is_none() {
        cfg.cpu_budget = autotune.as_ref().and_then(|a| a.settings.cpu_budget);
    }
    if let Some(budget) = cfg.cpu_budget {
        flowgate_actors::node::join(budget).map_err(|e| {
            PipelineError::config(format!("joining the node's CPU budget ({budget:?}): {e}"))
        })?;
        if let Some(a) = autotune.as_mut() {
            a.settings.cpu_budget = Some(budget);
        }
    }
    let ledger = Arc::new(Failures::new(cfg.failures));
    if let Some(f) = on_failure {
        ledger.on_failure(f);
    }
    let mut engine = Engine::new(channels, Arc::clone(&ledger));
    let runtime = if needs_runtime {
        let rt = tokio::runtime::Builder::new_multi_thread()
            .worker_threads(cfg.io_threads)
            .thread_name("fg-io")
            .thread_keep_alive(blocking_keep_alive())
            .enable_time()
            .build()
            .map_err(|e| PipelineError::runtime_from("starting the tokio runtime", e))?;
        let handle = rt.handle().clone();
        engine.set_runtime(rt);
        Some(handle)
    } else {
        None
    };
    let ctx = BuildCtx {
        cfg: cfg.clone(),
        runtime,
    };
    let core = |name: &str, kind, budget: Option<FailureBudget>, pinned| {
        StageCore::new(
            name,
            kind,
            budget.unwrap_or_default(),
            Arc::clone(&ledger),
            pinned,
        )
    };
    let source = source(&ctx, core("source", StageKind::Source, None, true))?;
    // Each stage's input budget, and whether its bytes were set by the user.
    let mut byte_budgets: Vec<(String, Arc<dyn HasBudget>, Option<u64>)> = Vec::new();
    // Bytes the attached caches may grow to, and the reserves (the uploader's staging ring):
    // the buffers share what they leave.
    let reserved: u64 = cfg
        .reserved
        .iter()
        .map(|r| r.1)
        .fold(0, u64::saturating_add);
    let mut caches = reserved;
    engine.add_stage(Arc::clone(&source).as_control());
    engine.set_source(source);
    let mut stages = stages;
    start_auto_stages(&mut stages, autotune.as_ref());
    for s in stages {
        let chunk = cfg.chunk_at(s.in_scale);
        let items = s
            .opts
            .budget_items
            .or(s.opts.start_items)
            .unwrap_or_else(|| Config::default_budget(chunk, s.workers.n));
        s.input
            .budget()
            .set_limits(items, s.opts.budget_bytes.unwrap_or(u64::MAX));
        byte_budgets.push((s.name.clone(), Arc::clone(&s.input), s.opts.budget_bytes));
        if let Some(cache) = &s.opts.cache {
            // Room for the cache to grow to its ceiling, which the tuner may do.
            caches += cache.0.cache_stats().max_bytes;
        }
        let c = core(&s.name, s.kind, s.opts.failures, s.workers.pinned)
            .with_budget_pinned(s.opts.budget_items.is_some() || s.opts.budget_bytes.is_some());
        let control = WithKnobs::wrap(
            (s.spawn)(&ctx, c, s.workers.n)?,
            s.opts.cache.map(|c| c.0),
            s.opts.read_ahead.map(|r| r.0),
            s.opts.item_threads,
        );
        engine.add_stage(control);
    }
    let sink_chunk = cfg.chunk_at(tail_scale);
    let sink_items = cfg.sink_items.or(cfg.sink_start).unwrap_or(2 * sink_chunk);
    tail.budget().set_limits(sink_items, cfg.sink_bytes);
    let budget = memory_budget(cfg.memory_bytes, autotune.as_ref().map(|a| &a.settings));
    let memory = budget.as_ref().map(|b| b.bytes);
    engine.set_memory(budget);
    if let Some(memory) = memory {
        share_memory(memory, caches, &byte_budgets, tail.budget()).map_err(|e| {
            if cfg.reserved.is_empty() {
                return e;
            }
            let named: Vec<String> = cfg
                .reserved
                .iter()
                .map(|(what, b)| format!("{b} bytes for {what}"))
                .collect();
            PipelineError::config(format!("{e}; reserved: {}", named.join(", ")))
        })?;
    }
    let reader = SinkReader::new(tail);
    engine.add_stage(reader.control(cfg.sink_items.is_some(), cfg.sink_bytes));

    let all_stages = engine.stages();
    let plane = ControlPlane::start(all_stages.clone())?;
    let trace = Arc::new(TraceLog::default());
    let epoch = Arc::new(AtomicU64::new(0));
    if let Some(mut a) = autotune {
        // One memory budget: the tuner's guard keeps the buffers' limits within what the
        // reserves leave of it (it counts the caches' capacities itself).
        a.settings.memory_bytes = memory.map(|m| m.saturating_sub(reserved).max(1));
        start_tuner(
            &plane,
            &all_stages,
            a,
            Arc::clone(&trace),
            Arc::clone(&epoch),
        )?;
    }
    // This pipeline's record on the node's board (`flowgate top`), once a second.
    if crate::board::enabled() {
        let (cores, node_budget) = match cfg.cpu_budget {
            Some(b) => (b.cores(), true),
            None => (flowgate_tuner::process_cores(), false),
        };
        let mut board = crate::board::Publisher::new(cores, node_budget);
        let (stages, ledger, epoch) = (all_stages.clone(), Arc::clone(&ledger), Arc::clone(&epoch));
        let budget = engine.memory().cloned();
        plane.every(crate::board::PUBLISH_EVERY, move || {
            board.publish(PipelineStats::assemble(
                stages.iter().map(|s| s.snapshot()).collect(),
                &ledger,
                epoch.load(Ordering::Relaxed),
                budget.as_ref(),
            ));
        });
    }
    if let Some((every, mut f)) = on_stats {
        let epoch = Arc::clone(&epoch);
        let budget = engine.memory().cloned();
        plane.every(every, move || {
            let snaps = all_stages.iter().map(|s| s.snapshot()).collect();
            f(&PipelineStats::assemble(
                snaps,
                &ledger,
                epoch.load(Ordering::Relaxed),
                budget.as_ref(),
            ));
        });
    }
    engine.set_plane(plane);
    Ok(Pipeline::from_parts(
        engine,
        reader,
        trace,
        epoch,
        cfg.fingerprint,
        cfg.sharding,
    ))
}

/// Gives the pool stages built with [`Workers::auto`] their start: an equal share of the
/// cores the tuner may use (the tuner's `cores` setting, else the process's share of the
/// node's CPU budget or of the node), at least one each.
fn start_auto_stages(
    stages: &mut [crate::engine::builder::plan::Pending],
    autotune: Option<&Autotune>,
) {
    let auto =
        |s: &crate::engine::builder::plan::Pending| s.workers.auto && s.kind == StageKind::Pool;
    let n = stages.iter().filter(|s| auto(s)).count();
    if n == 0 {
        return;
    }
    let cores = autotune
        .and_then(|a| a.settings.cores)
        .or_else(|| {
            let budget = autotune?.settings.cpu_budget?;
            let ranks = std::env::var("LOCAL_WORLD_SIZE").ok();
            let ranks = flowgate_tuner::local_ranks(ranks.as_deref());
            Some(flowgate_tuner::node_share(budget.cores(), ranks))
        })
        .unwrap_or_else(flowgate_tuner::process_cores)
        .max(1);
    let share = (cores / n).max(1);
    for s in stages.iter_mut().filter(|s| auto(s)) {
        s.workers.n = share;
        tracing::debug!(stage = %s.name, workers = share, "starts at its share of the cores");
    }
}

/// Gives every buffer a byte limit so that the limits add up to `memory`: stages with their
/// own byte budget keep it (`u64::MAX`: no limit, by choice), the other buffers (and the
/// sink's, unless set) share what they and the attached caches (`caches` bytes) leave,
/// equally. Fails, naming them, if the stages' own budgets and the caches exceed `memory`.
fn share_memory(
    memory: u64,
    caches: u64,
    stages: &[(String, Arc<dyn HasBudget>, Option<u64>)],
    sink: &Budget,
) -> Result<(), PipelineError> {
    // A byte budget of `u64::MAX` is a choice of no byte limit: that stage opts out.
    let own = |s: &(String, Arc<dyn HasBudget>, Option<u64>)| s.2.filter(|&b| b < u64::MAX);
    let pinned: u64 = stages
        .iter()
        .filter_map(own)
        .fold(caches, u64::saturating_add);
    if pinned > memory {
        let names: Vec<String> = stages
            .iter()
            .filter(|s| own(s).is_some())
            .map(|s| format!("`{}`", s.0))
            .collect();
        return Err(PipelineError::config(format!(
            "the byte budgets of {} (and {caches} bytes of caches and reserves) add up to {pinned} bytes, more than the memory budget of {memory}",
            names.join(", ")
        )));
    }
    let sink_free = sink.status().cap_bytes == u64::MAX;
    let free: Vec<&Budget> = stages
        .iter()
        .filter(|s| s.2.is_none())
        .map(|s| s.1.budget())
        .chain(sink_free.then_some(sink))
        .collect();
    if free.is_empty() {
        return Ok(());
    }
    let share = ((memory - pinned) / free.len() as u64).max(1);
    for b in free {
        let st = b.status();
        b.set_limits(st.cap_items, share);
    }
    Ok(())
}

/// Starts the tuner actor on the control thread, over every stage but the source (which has
/// no knob to turn).
fn start_tuner(
    plane: &ControlPlane,
    all_stages: &[Arc<dyn StageControl>],
    a: Autotune,
    trace: Arc<TraceLog>,
    epoch: Arc<AtomicU64>,
) -> Result<(), PipelineError> {
    let stages = all_stages[1..]
        .iter()
        .cloned()
        .zip(plane.stages()[1..].iter().map(|(_, addr)| addr.clone()))
        .collect();
    let policy = a.policy.unwrap_or_else(|| a.settings.make_policy());
    let actor = TunerActor::new(stages, &a.settings, policy, trace, a.on_decision)
        .map_err(|e| {
            let path = a
                .settings
                .trace
                .as_deref()
                .unwrap_or(std::path::Path::new(""));
            PipelineError::config_from(format!("opening the tuner trace {}", path.display()), e)
        })?
        .with_gpu_sampler(a.gpu)
        .with_epoch(epoch);
    plane.on_control_thread(Box::new(move || {
        actor.start();
    }));
    Ok(())
}

/// The memory budget: the one set (the builder's, or the tuner's settings', the smaller), or
/// with the tuner on the default (half of what the host or the process's cgroup leaves), and
/// where it came from; none with the tuner off and none set.
pub(crate) fn memory_budget(
    set: Option<u64>,
    tuner: Option<&TunerSettings>,
) -> Option<crate::engine::stats::MemoryBudget> {
    use crate::engine::stats::MemoryBudget;
    let by_tuner = tuner.and_then(|t| t.memory_bytes);
    match (set, by_tuner) {
        (Some(m), t) => Some(MemoryBudget {
            bytes: t.map_or(m, |t| t.min(m)),
            source: "set by the loader's memory budget (memory_mb)".into(),
        }),
        (None, Some(t)) => Some(MemoryBudget {
            bytes: t,
            source: "set by the tuner's memory_bytes".into(),
        }),
        (None, None) => tuner.map(|_| {
            let (b, source) = flowgate_tuner::Budgets::detect_with_source();
            MemoryBudget {
                bytes: b.memory_bytes,
                source,
            }
        }),
    }
}

/// How long an idle blocking thread (a call that waits, `spawn_blocking`) is kept before it
/// ends: tokio's 10 s, or `FLOWGATE_BLOCKING_KEEP_ALIVE_MS` (1..=600,000 ms) where set, so a
/// test of what happens when such threads end need not wait 10 s. Another value is said (a
/// `tracing` warning) and the 10 s kept.
fn blocking_keep_alive() -> std::time::Duration {
    const DEFAULT: std::time::Duration = std::time::Duration::from_secs(10);
    let Ok(v) = std::env::var("FLOWGATE_BLOCKING_KEEP_ALIVE_MS") else {
        return DEFAULT;
    };
    match v.trim().parse::<u64>() {
        Ok(ms) if (1..=600_000).contains(&ms) => std::time::Duration::from_millis(ms),
        _ => {
            tracing::warn!(
                value = %v,
                "FLOWGATE_BLOCKING_KEEP_ALIVE_MS must be in 1..=600000 (ms): the default 10 s is kept"
            );
            DEFAULT
        }
    }
}
