//! Ranks of one node sharing a CPU budget, simulated: one [`Simulator`] per rank, each with its
//! own policy, stepped tick by tick together.
//!
//! Each tick the node's cores are split among the ranks, by one of two rules:
//! - [`Split::Static`]: fixed shares (what each rank's own cap gives it without a ledger);
//! - [`Split::Shared`]: the budget goes where the work is, as the engine's ledger does item by
//!   item — each rank gets what its busy CPU threads can use, up to an equal share when all
//!   want more, and what a rank leaves goes to the others (max-min fair, work-conserving);
//!   each rank's policy plans with the cores the others leave it, as the tuner actor does.
//!
//! Data-parallel training steps in lockstep: a rank's step cannot run ahead of the slowest
//! rank's by more than `slack` results (`lockstep`), so a rank with light work waits for the
//! heavy one, which is where a static split strands cores. The figure of merit is the
//! slowest rank's rate: it sets the job's pace.

use crate::observation::Policy;
use crate::scenario::Scenario;
use crate::sim::{Run, Simulator};

/// How a node's cores are split among its ranks each tick.
#[derive(Clone, Debug, PartialEq)]
pub enum Split {
    /// Fixed cores per rank (fractions allowed).
    Static(Vec<f64>),
    /// One budget shared by demand (see the module docs).
    Shared,
}

/// A node run: per-rank runs and the split of each tick.
#[derive(Clone, Debug, Default)]
pub struct NodeRun {
    /// Each rank's ticks and decisions.
    pub ranks: Vec<Run>,
    /// Each tick: the cores given to each rank.
    pub cores: Vec<Vec<f64>>,
    /// Each rank's results per second over the measured window.
    pub rates: Vec<f64>,
}

impl NodeRun {
    /// The slowest rank's rate: the job's pace.
    pub fn slowest(&self) -> f64 {
        self.rates.iter().copied().fold(f64::INFINITY, f64::min)
    }
}

/// Max-min fair split of `budget` among `demand`s: each gets its demand if that is under an
/// equal share of what is left, and the rest is shared again among the others.
pub fn water_fill(budget: f64, demand: &[f64]) -> Vec<f64> {
    let mut out = vec![0.0; demand.len()];
    let mut order: Vec<usize> = (0..demand.len()).collect();
    order.sort_by(|&a, &b| demand[a].total_cmp(&demand[b]));
    let mut left = budget.max(0.0);
    for (k, &i) in order.iter().enumerate() {
        let share = left / (demand.len() - k) as f64;
        out[i] = demand[i].max(0.0).min(share);
        left -= out[i];
    }
    out
}

/// Runs `scenarios` (one per rank) on a node of `budget` cores split by `split`, each rank
/// tuned by its own policy from `policy()`, for `seconds`, in lockstep within `slack` results
/// (`None`: independent ranks); rates are measured over `[warmup, seconds)`.
pub fn run_node(
    scenarios: &[Scenario],
    budget: f64,
    split: &Split,
    policy: &dyn Fn() -> Box<dyn Policy>,
    seconds: f64,
    warmup: f64,
    slack: Option<u64>,
) -> NodeRun {
    let n = scenarios.len();
    let mut sims: Vec<Simulator> = scenarios.iter().map(Simulator::new).collect();
    let mut policies: Vec<Box<dyn Policy>> = (0..n).map(|_| policy()).collect();
    let mut node = NodeRun {
        ranks: vec![Run::default(); n],
        ..NodeRun::default()
    };
    let mut at_warmup = None;
    // What each rank used last tick, averaged as the tuner actor averages the others' holds.
    let mut used = vec![budget / n as f64; n];
    while sims[0].now() < seconds - 1e-9 {
        let alloc = match split {
            Split::Static(shares) => shares.clone(),
            Split::Shared => {
                // A rank may use as many cores as it has busy threads (a wanting rank gets
                // half a core more than it used: room to show it wants more).
                let demand: Vec<f64> = sims
                    .iter()
                    .map(|s| s.cpu_busy() as f64)
                    .zip(&used)
                    .map(|(b, u)| b.max(u + 0.5))
                    .collect();
                water_fill(budget, &demand)
            }
        };
        for (i, sim) in sims.iter_mut().enumerate() {
            let others: f64 = match split {
                Split::Static(_) => budget - alloc[i],
                Split::Shared => used.iter().sum::<f64>() - used[i],
            };
            let planned = match split {
                Split::Static(_) => alloc[i].ceil(),
                Split::Shared => (budget - others - 0.05).ceil(),
            };
            sim.set_cores(alloc[i], planned.max(1.0) as usize);
        }
        if let Some(slack) = slack {
            let least = sims.iter().map(Simulator::delivered).min().unwrap_or(0);
            for sim in &mut sims {
                sim.set_consumer_cap(Some(least + slack));
            }
        }
        for (i, sim) in sims.iter_mut().enumerate() {
            let busy_before = sim.cpu_busy() as f64;
            sim.tick(&mut *policies[i], seconds, &mut node.ranks[i]);
            let busy = (busy_before + sim.cpu_busy() as f64) / 2.0;
            used[i] += 0.2 * (busy.min(alloc[i]) - used[i]);
        }
        node.cores.push(alloc);
        if at_warmup.is_none() && sims[0].now() >= warmup - 1e-9 {
            at_warmup = Some(sims.iter().map(Simulator::delivered).collect::<Vec<_>>());
        }
    }
    let base = at_warmup.unwrap_or_else(|| vec![0; n]);
    let span = (seconds - warmup).max(1e-9);
    node.rates = sims
        .iter()
        .zip(&base)
        .map(|(s, &b)| (s.delivered() - b) as f64 / span)
        .collect();
    node
}

/// The static split (in steps of `step` cores, each rank at least one step) whose slowest rank
/// is fastest, with each rank tuned within its share: the best any fixed split can do.
pub fn best_static_split(
    scenarios: &[Scenario],
    budget: f64,
    step: f64,
    policy: &dyn Fn() -> Box<dyn Policy>,
    seconds: f64,
    warmup: f64,
    slack: Option<u64>,
) -> (Vec<f64>, NodeRun) {
    let units = (budget / step).round() as usize;
    let n = scenarios.len();
    let splits: Vec<Vec<f64>> = if units < n {
        vec![vec![budget / n as f64; n]]
    } else {
        compositions(units, n)
            .into_iter()
            .map(|parts| parts.iter().map(|&p| p as f64 * step).collect())
            .collect()
    };
    splits
        .into_iter()
        .map(|split| {
            let run = run_node(
                scenarios,
                budget,
                &Split::Static(split.clone()),
                policy,
                seconds,
                warmup,
                slack,
            );
            (split, run)
        })
        .max_by(|a, b| a.1.slowest().total_cmp(&b.1.slowest()))
        .expect("at least one split")
}

/// Every way to write `total` as `n` positive whole parts, in order.
fn compositions(total: usize, n: usize) -> Vec<Vec<usize>> {
    if n == 1 {
        return if total >= 1 {
            vec![vec![total]]
        } else {
            Vec::new()
        };
    }
    (1..=total.saturating_sub(n - 1))
        .flat_map(|first| {
            compositions(total - first, n - 1)
                .into_iter()
                .map(move |mut rest| {
                    rest.insert(0, first);
                    rest
                })
        })
        .collect()
}

#[cfg(test)]
mod tests;
