//! The guard every decision passes through before it is applied, in the simulator and in the
//! tuner actor alike: pinned knobs are never touched, workers stay within `1..=max_workers`,
//! and the buffers' committed bytes never exceed the memory budget.

use crate::observation::{Action, Decision, Observation};

/// Filters and clamps `decisions` against `obs` (see the module docs).
pub fn enforce(decisions: Vec<Decision>, obs: &Observation) -> Vec<Decision> {
    let budget = obs.budgets.map_or(u64::MAX, |b| b.memory_bytes);
    // Bytes the buffers may hold if every budget fills, per stage.
    let mut committed: Vec<u64> = obs
        .stages
        .iter()
        .map(|s| {
            (s.budget_items as u64)
                .saturating_mul(s.item_bytes)
                .min(s.budget_bytes)
        })
        .collect();
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
                let others: u64 = committed.iter().sum::<u64>() - committed[*stage];
                let room_items = budget.saturating_sub(others) / per_item;
                // Never below one item: a stage with no budget would stall the pipeline.
                *items = (*items).min(room_items as usize).max(1);
                *bytes = (*bytes).min(budget.saturating_sub(others).max(per_item));
                if *items == s.budget_items && *bytes == s.budget_bytes {
                    continue;
                }
                committed[*stage] = (*items as u64).saturating_mul(s.item_bytes).min(*bytes);
            }
            Action::SetCacheBytes { stage, bytes } => {
                let Some(s) = obs.stages.get(*stage) else {
                    continue;
                };
                if s.budget_pinned {
                    continue;
                }
                let others: u64 = committed.iter().sum();
                *bytes = (*bytes).min(budget.saturating_sub(others));
            }
        }
        out.push(d);
    }
    out
}
