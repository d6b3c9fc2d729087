//! The guard every decision passes through before it is applied, in the simulator and in the
//! tuner actor alike: pinned knobs are never touched, workers stay within `1..=max_workers`,
//! and the buffers' committed bytes never exceed the memory budget.

use crate::observation::{Action, Decision, Observation};

/// Bytes a stage's buffer (and cache) may hold if it fills.
fn stage_commitment(s: &crate::StageObservation) -> u64 {
    (s.budget_items as u64)
        .saturating_mul(s.item_bytes)
        .min(s.budget_bytes)
        .saturating_add(s.cache.map_or(0, |c| c.capacity_bytes))
}

/// Bytes every buffer and cache may hold if they all fill.
pub(crate) fn committed_bytes(obs: &Observation) -> u64 {
    obs.stages
        .iter()
        .map(stage_commitment)
        .fold(0, u64::saturating_add)
}

/// Filters and clamps `decisions` against `obs` (see the module docs).
pub fn enforce(decisions: Vec<Decision>, obs: &Observation) -> Vec<Decision> {
    let budget = obs.budgets.map_or(u64::MAX, |b| b.memory_bytes);
    // Bytes the buffers (and caches) may hold if every budget fills, per stage.
    let mut committed: Vec<u64> = obs.stages.iter().map(stage_commitment).collect();
    let mut out = Vec::with_capacity(decisions.len());
    for mut d in decisions {
        match &mut d.action {
            Action::SetWorkers { stage, workers } => {
                let Some(s) = obs.stages.get(*stage) else {
                    continue;
                };
                if !s.resizable() {
                    continue;
                }
                *workers = (*workers).clamp(1, s.max_workers.max(1));
                if *workers == s.workers {
                    continue;
                }
            }
            Action::SetPrefetch {
                stage,
                items,
                bytes,
            } => {
                let Some(s) = obs.stages.get(*stage) else {
                    continue;
                };
                if s.budget_pinned {
                    continue;
                }
                let per_item = s.item_bytes.max(1);
                let others = committed
                    .iter()
                    .fold(0u64, |a, &b| a.saturating_add(b))
                    .saturating_sub(committed[*stage])
                    .saturating_add(s.cache.map_or(0, |c| c.capacity_bytes));
                let room_items = budget.saturating_sub(others) / per_item;
                // Never below one item: a stage with no budget would stall the pipeline.
                *items = (*items).min(room_items as usize).max(1);
                *bytes = (*bytes).min(budget.saturating_sub(others).max(per_item));
                if *items == s.budget_items && *bytes == s.budget_bytes {
                    continue;
                }
                committed[*stage] = (*items as u64)
                    .saturating_mul(s.item_bytes)
                    .min(*bytes)
                    .saturating_add(s.cache.map_or(0, |c| c.capacity_bytes));
            }
            Action::SetCacheBytes { stage, bytes } => {
                let Some(s) = obs.stages.get(*stage) else {
                    continue;
                };
                let Some(c) = s.cache.filter(|c| !c.pinned) else {
                    continue;
                };
                let others = committed
                    .iter()
                    .fold(0u64, |a, &b| a.saturating_add(b))
                    .saturating_sub(c.capacity_bytes);
                *bytes = (*bytes).min(c.max_bytes).min(budget.saturating_sub(others));
                if *bytes == c.capacity_bytes {
                    continue;
                }
                committed[*stage] = committed[*stage] - c.capacity_bytes + *bytes;
            }
        }
        out.push(d);
    }
    out
}
