//! The guard every decision passes through before it is applied, in the simulator and in the
//! tuner actor alike: pinned knobs are never touched, workers stay within `1..=max_workers`,
//! a stage's `workers × threads per item` never exceeds the cores, the buffers' committed
//! bytes never exceed the memory budget, and while the buffers hold more than the budget (a
//! batch of large items, a budget the tuner did not set) no buffer or cache grows.
//!
//! Two sums are kept within the budget. The *commitment* (what the buffers would hold if every
//! item budget filled with items of the size seen so far) bounds how far item budgets grow.
//! The *limits*: when every buffer has a byte limit (the engine gives every buffer one when the
//! pipeline has a memory budget, and charges every byte a stage holds against it), none is
//! raised past what the other buffers' limits leave, so the limits — a hard bound, whatever
//! the items' sizes turn out to be — add up to at most the budget.

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
    // The byte limits, per stage, when every buffer has one (a pipeline with a memory budget).
    let mut limits: Vec<u64> = obs.stages.iter().map(|s| s.budget_bytes).collect();
    let bounded = limits.iter().all(|&l| l < u64::MAX);
    // Over the budget now: buffers and caches may shrink, not grow.
    let over = obs.buffered_bytes > budget;
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
                if bounded {
                    // A bounded buffer stays bounded, within what the others' limits leave.
                    let other_limits = limits
                        .iter()
                        .enumerate()
                        .filter(|&(i, _)| i != *stage)
                        .fold(0u64, |a, (_, &l)| a.saturating_add(l));
                    *bytes = (*bytes).min(budget.saturating_sub(other_limits).max(1));
                    limits[*stage] = *bytes;
                }
                if over {
                    *items = (*items).min(s.budget_items);
                    *bytes = (*bytes).min(s.budget_bytes);
                }
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
                if bounded {
                    // Within what the buffers' limits and the other caches leave.
                    let held = limits.iter().fold(0u64, |a, &l| a.saturating_add(l));
                    let caches = obs
                        .stages
                        .iter()
                        .enumerate()
                        .filter(|&(i, _)| i != *stage)
                        .filter_map(|(_, o)| o.cache.map(|c| c.capacity_bytes))
                        .fold(0u64, u64::saturating_add);
                    let room = budget.saturating_sub(held).saturating_sub(caches);
                    *bytes = (*bytes).min(room);
                }
                if over {
                    *bytes = (*bytes).min(c.capacity_bytes);
                }
                if *bytes == c.capacity_bytes {
                    continue;
                }
                committed[*stage] = committed[*stage] - c.capacity_bytes + *bytes;
            }
            Action::SetReadAhead { stage, depth } => {
                // Fetched objects go to disk, not to the memory budget: only the pin and the
                // ceiling bind.
                let Some(r) = obs
                    .stages
                    .get(*stage)
                    .and_then(|s| s.read_ahead)
                    .filter(|r| !r.pinned)
                else {
                    continue;
                };
                *depth = (*depth).clamp(1, r.max_depth.max(1));
                if *depth == r.depth {
                    continue;
                }
            }
            Action::SetItemThreads { stage, threads } => {
                let Some(s) = obs.stages.get(*stage) else {
                    continue;
                };
                let Some(t) = s.item_threads.filter(|t| !t.pinned) else {
                    continue;
                };
                // Within the ceiling, and never more threads than the cores hold. A change
                // the bound undoes is dropped; asking for the current setting is a verdict
                // (a trial's raise kept) and goes into the trace as it is.
                let cores = obs.budgets.map_or(usize::MAX, |b| b.cores);
                let fit = (cores / s.workers.max(1)).max(1);
                let asked = *threads;
                *threads = (*threads).clamp(1, t.max_threads.max(1).min(fit));
                if *threads == t.threads && asked != t.threads {
                    continue;
                }
            }
        }
        out.push(d);
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::observation::{Budgets, StageObservation};

    fn stage(limit: u64) -> StageObservation {
        StageObservation {
            name: "s".into(),
            workers: 1,
            max_workers: 4,
            budget_items: 8,
            budget_bytes: limit,
            item_bytes: 1 << 20,
            ..StageObservation::default()
        }
    }

    fn grow(stage: usize) -> Decision {
        Decision {
            action: Action::SetPrefetch {
                stage,
                items: 64,
                bytes: u64::MAX,
            },
            reason: "grow".into(),
        }
    }

    #[test]
    fn bounded_buffers_keep_their_limits_within_the_budget() {
        let obs = Observation {
            stages: vec![stage(32 << 20), stage(32 << 20)],
            budgets: Some(Budgets {
                memory_bytes: 64 << 20,
                cores: 2,
            }),
            ..Observation::default()
        };
        let out = enforce(vec![grow(0), grow(1)], &obs);
        let limits: Vec<u64> = out
            .iter()
            .map(|d| match d.action {
                Action::SetPrefetch { bytes, .. } => bytes,
                _ => unreachable!(),
            })
            .collect();
        assert!(limits.iter().all(|&l| l <= 32 << 20), "{limits:?}");
        // Unbounded buffers (the simulator's) are bounded by the commitment alone.
        let obs = Observation {
            stages: vec![stage(u64::MAX), stage(u64::MAX)],
            ..obs
        };
        let out = enforce(vec![grow(0)], &obs);
        assert!(matches!(out[0].action, Action::SetPrefetch { items, .. } if items <= 64));
    }

    /// Buffers holding more than the budget (items larger than the buffers' byte limits
    /// foresaw): a doubling is dropped, a shrink goes through.
    #[test]
    fn nothing_grows_while_the_buffers_are_over_the_budget() {
        let mut obs = Observation {
            stages: vec![stage(32 << 20), stage(32 << 20)],
            budgets: Some(Budgets {
                memory_bytes: 128 << 20,
                cores: 2,
            }),
            buffered_bytes: 300 << 20,
            ..Observation::default()
        };
        let shrink = Decision {
            action: Action::SetPrefetch {
                stage: 1,
                items: 4,
                bytes: 16 << 20,
            },
            reason: "shrink".into(),
        };
        let out = enforce(vec![grow(0), shrink.clone()], &obs);
        assert_eq!(out.len(), 1, "{out:?}");
        assert!(matches!(
            out[0].action,
            Action::SetPrefetch {
                stage: 1,
                items: 4,
                ..
            }
        ));
        // Back under the budget, the same doubling goes through.
        obs.buffered_bytes = 20 << 20;
        let out = enforce(vec![grow(0)], &obs);
        assert!(
            matches!(out[0].action, Action::SetPrefetch { stage: 0, items, .. } if items > 8),
            "{out:?}"
        );
    }
}
