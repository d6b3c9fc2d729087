//! The model-based policy: measure each stage's cost per item, compute the allocation that
//! meets the target rate, jump to it, and keep it only if the gain is statistically real.
//!
//! # Each tick
//!
//! 1. **Estimate.** For every stage, cost per item = busy time / items finished (an EWMA over
//!    ticks). CPU stages measure wall time, which oversubscription inflates, so their costs are
//!    divided by `max(1, total CPU busy time / (cores × tick))`. For async stages the cost is
//!    the latency. The consumer's step is `(tick − wait) / delivered`.
//!    Rates are in results per second; each stage's *flow*, items it handles per result
//!    delivered (32 before an `aggregate(32)`), scales its cost into those units.
//! 2. **Target rate.** `R* = min(consumer rate, cores / Σ CPU costs)`: what the consumer can take
//!    or the cores can make, whichever is less. If neither bounds it (an I/O-only pipeline and an
//!    instant consumer), `R*` is twice the observed rate, and the statistical test below decides
//!    when more stops helping.
//! 3. **Allocate.** `workers = ceil(R* × (1 + headroom) × flow × cost)`, plus square-root
//!    staffing for variable work (`+ cv × sqrt(load)`), for each stage, in one jump (not
//!    one worker per tick); a CPU stage of steady cost (CV < 0.5) gets no more than the cores. A stage that waits on others gets fewer.
//!    When a CPU stage wants more workers than the process's worker tokens leave it, the
//!    other CPU stages keep only what their load needs (no staffing spares, no hysteresis),
//!    confirmed as any move, not as a reversal. Changes inside the
//!    deadband are ignored; a move waits for three ticks wishing the same way (twenty to
//!    reverse the last move; one for a stage's first scale-up while the consumer starves).
//! 4. **Test.** After a change the policy waits `settle_ticks`, then compares `trial_ticks` per-tick
//!    rates before and after with Welch's t-test. A scale-up stays only if the gain is
//!    significant (`p < p_value`); a scale-down stays unless the loss is. A rejected change is
//!    undone and its direction barred for that stage for `cooldown_ticks`, which is what keeps
//!    the policy from oscillating on noise.
//! 5. **Buffers.** A stage's budget is `2 × workers` (at least `workers + 2`). When a stage
//!    starved while the stage before it was blocked (jitter, not a lack of capacity), its budget
//!    doubles (at most 2× a round, within the memory budget); likewise the sink when the consumer
//!    waited while the last stage was blocked. A buffer that stayed full and never ran dry for
//!    `calm_ticks` shrinks by a quarter toward its base.

use std::collections::VecDeque;

/// Spare workers per unit of `cv × sqrt(load)` (square-root staffing, after Halfin and Whitt):
/// 1 keeps queueing delay small for moderately variable work without hoarding workers.
const STAFFING_BETA: f64 = 1.0;
/// The CV is capped here: beyond it (infinite-variance tails) the sample CV only measures how
/// long the stage has run, and more spare workers stop helping under processor sharing.
const MAX_CV: f64 = 1.0;
/// Cost CV below which a CPU stage's work counts as steady: its workers are then capped at
/// the cores (image decoding, with sizes varying ±30%, has a CV around 0.3; heavy tails 1).
const STEADY_CV: f64 = 0.5;
/// Ticks in a row the model must want a stage moved the same way before it moves: a single
/// noisy tick (a heavy-tailed item finishing) must not move workers; a real shift persists.
const CONFIRM_TICKS: i32 = 3;
/// Ticks in a row the model must want a stage moved against its last move: reversals are what
/// noise looks like, so they need ten times the evidence (2 s at the default tick).
const REVERSE_CONFIRM_TICKS: i32 = 20;
/// Consumer starvation above which a stage's first scale-up needs no confirming ticks (at
/// the start of a run the consumer waits for everything; three ticks of confirmation were
/// ~10% of a two-second epoch).
const COLD_START_STARVATION: f64 = 0.9;
/// Core utilisation above which the cores count as all busy (the rest is measurement slack).
const BUSY_CORES: f64 = 0.85;
/// Longest a rejected direction stays barred: `cooldown_ticks` doubles per rejection up to
/// this many doublings, so a policy that keeps being wrong tries less and less often.
const MAX_BACKOFF: u32 = 4;

use serde::{Deserialize, Serialize};

use super::base_budget;
use crate::observation::{Action, Decision, Observation, Policy};
use crate::welch::p_greater;
use crate::StageKind;

mod buffers;

use buffers::Lean;

/// Settings of [`ModelBased`]. Every field has a default; see each for its range and reason.
#[derive(Clone, Copy, Debug, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct ModelSettings {
    /// Capacity provisioned above the target rate, 0..=1. Default 0.15: enough to absorb the
    /// estimation error of a 100 ms tick, small enough not to hoard cores.
    #[serde(default = "d_headroom")]
    pub headroom: f64,
    /// Weight of the newest tick in the cost estimates, 0..=1 (the older ticks decay by
    /// `1 - smoothing` each). Default 0.3: an effective window of about three ticks, quick to
    /// follow a shift, yet steady under heavy-tailed costs.
    #[serde(default = "d_smoothing")]
    pub smoothing: f64,
    /// Relative worker changes smaller than this are ignored, 0..=1. Default 0.1.
    #[serde(default = "d_deadband")]
    pub deadband: f64,
    /// Ticks to let a change settle before measuring it. Default 2 (200 ms at the default
    /// tick): long enough for queues to refill.
    #[serde(default = "d_settle")]
    pub settle_ticks: u64,
    /// Per-tick rates compared before and after a change. Default 5: with Welch's test, enough
    /// to see a 10% change at typical tick noise, short enough to converge in seconds.
    #[serde(default = "d_trial")]
    pub trial_ticks: usize,
    /// Significance level of the test. Default 0.05.
    #[serde(default = "d_p")]
    pub p_value: f64,
    /// Ticks a rejected direction stays barred. Default 50 (5 s).
    #[serde(default = "d_cooldown")]
    pub cooldown_ticks: u64,
    /// Fraction of a tick of waiting that counts as running dry. Default 0.02.
    #[serde(default = "d_dry")]
    pub dry: f64,
    /// Ticks a buffer must stay full and never run dry before it shrinks. Default 20.
    #[serde(default = "d_calm")]
    pub calm_ticks: u32,
}

fn d_headroom() -> f64 {
    0.15
}
fn d_smoothing() -> f64 {
    0.3
}
fn d_deadband() -> f64 {
    0.1
}
fn d_settle() -> u64 {
    2
}
fn d_trial() -> usize {
    5
}
fn d_p() -> f64 {
    0.05
}
fn d_cooldown() -> u64 {
    50
}
fn d_dry() -> f64 {
    0.02
}
fn d_calm() -> u32 {
    20
}

impl Default for ModelSettings {
    fn default() -> Self {
        Self {
            headroom: d_headroom(),
            smoothing: d_smoothing(),
            deadband: d_deadband(),
            settle_ticks: d_settle(),
            trial_ticks: d_trial(),
            p_value: d_p(),
            cooldown_ticks: d_cooldown(),
            dry: d_dry(),
            calm_ticks: d_calm(),
        }
    }
}

/// The buffers' commitment at which memory, not the cores, is taken to limit a pipeline.
const MEMORY_BOUND: f64 = 0.9;

/// Whether the buffers would fill nearly all of the memory budget.
fn memory_bound(obs: &Observation) -> bool {
    obs.budgets.is_some_and(|b| {
        crate::guard::committed_bytes(obs) as f64 >= MEMORY_BOUND * b.memory_bytes as f64
    })
}

/// Busy time of the CPU stages over the core time of the window: above 1 the cores are
/// oversubscribed (and wall-clock costs inflated by that factor), below 1 some sit idle.
fn cpu_load(obs: &Observation, n: usize) -> f64 {
    let win = obs.window.as_secs_f64().max(1e-9);
    let cores = obs.budgets.map_or(1, |b| b.cores).max(1) as f64;
    let busy: f64 = obs.stages[..n]
        .iter()
        .filter(|s| s.is_cpu())
        .map(|s| s.busy.as_secs_f64())
        .sum();
    busy / (cores * win)
}

#[derive(Clone, Debug, Default)]
struct StageModel {
    /// Seconds per item (CPU time for CPU stages, latency for async ones).
    cost: Option<f64>,
    /// Decayed sums of busy seconds and items: their ratio is `cost`.
    busy_sum: f64,
    item_sum: f64,
    /// No more workers than this until the tick given.
    ceiling: Option<(usize, u64)>,
    /// No fewer workers than this until the tick given.
    floor: Option<(usize, u64)>,
    /// Consecutive ticks the buffer was full and never ran dry.
    calm: u32,
    /// Whether the lean rule has shrunk this buffer, and the least it may shrink to (what
    /// the last wait after a shrink showed the jitter needs).
    lean: Lean,
    /// Trials of this stage rejected in a row (for the cooldown's backoff).
    rejections: u32,
    /// Consecutive ticks the model has wanted this stage moved in one direction (sign).
    urge: i32,
    /// Direction of the last change applied to this stage (-1, 0, 1).
    last_dir: i32,
}

#[derive(Clone, Debug)]
struct Trial {
    start: u64,
    before: Vec<f64>,
    prev: Vec<usize>,
    up: bool,
    /// Whether the consumer was starving: only then can a scale-up show a gain.
    starving: bool,
}

/// The model-based policy; see the module docs.
#[derive(Clone, Debug, Default)]
pub struct ModelBased {
    s: ModelSettings,
    /// Whether, at the last `targets`, a CPU stage wanted more workers than the process's
    /// tokens let it have ([`give_back_tokens`](Self::give_back_tokens)).
    short_of_tokens: std::cell::Cell<bool>,
    stages: Vec<StageModel>,
    consumer_step: Option<f64>,
    /// Decayed sum of results delivered (the denominator of each stage's flow ratio).
    delivered_sum: f64,
    /// Results delivered since the policy started (the reasons say whether any were).
    delivered_total: u64,
    sink_calm: u32,
    sink_lean: Lean,
    /// Consecutive ticks the consumer did not wait (the lean rule's clock).
    lean_calm: u32,
    /// The epoch last seen, and the tick it was first seen at.
    epoch: Option<(u64, u64)>,
    rates: VecDeque<f64>,
    trial: Option<Trial>,
    tick: u64,
    threads: super::ItemThreadTrials,
}

impl ModelBased {
    /// A policy with `settings`.
    pub fn new(settings: ModelSettings) -> Self {
        Self {
            s: settings,
            ..Self::default()
        }
    }

    fn ewma(&self, old: Option<f64>, new: f64) -> f64 {
        match old {
            Some(o) => o + self.s.smoothing * (new - o),
            None => new,
        }
    }

    fn estimate(&mut self, obs: &Observation, n: usize) {
        let win = obs.window.as_secs_f64().max(1e-9);
        let inflation = cpu_load(obs, n).max(1.0);
        // A ratio of decayed sums, not an average of per-tick ratios: ticks with more items
        // weigh more, and one heavy-tailed item moves the estimate by its share of the work.
        let decay = 1.0 - self.s.smoothing;
        for (i, s) in obs.stages[..n].iter().enumerate() {
            let mut busy = s.busy.as_secs_f64();
            if s.is_cpu() {
                busy /= inflation;
            }
            let m = &mut self.stages[i];
            m.busy_sum = decay * m.busy_sum + busy;
            m.item_sum = decay * m.item_sum + s.items as f64;
            if m.item_sum >= 1.0 {
                m.cost = Some(m.busy_sum / m.item_sum);
            }
        }
        self.delivered_sum = decay * self.delivered_sum + obs.delivered as f64;
        self.delivered_total += obs.delivered;
        if obs.delivered > 0 {
            let step = (win - obs.consumer_wait.as_secs_f64()).max(0.0) / obs.delivered as f64;
            self.consumer_step = Some(self.ewma(self.consumer_step, step));
        }
    }

    /// The tick's throughput in results per second, measured where the counts are largest:
    /// all stages' items over their flows. With batches of 32, a tick sees a few results but
    /// hundreds of items, so this is what gives the trials' t-tests their power.
    fn fine_rate(&self, obs: &Observation, n: usize) -> f64 {
        let (items, flows) = (0..n)
            .filter(|&i| obs.stages[i].items > 0)
            .fold((0.0, 0.0), |(a, b), i| {
                (a + obs.stages[i].items as f64, b + self.flow(i))
            });
        if flows > 0.0 {
            items / flows / obs.window.as_secs_f64().max(1e-9)
        } else {
            obs.rate()
        }
    }

    /// Items stage `i` handles per result delivered (32 before an `aggregate(32)`, 1 after).
    /// Rates are in results per second; a stage's load is rate × flow × cost.
    fn flow(&self, i: usize) -> f64 {
        let m = &self.stages[i];
        if self.delivered_sum >= 1.0 && m.item_sum >= 1.0 {
            m.item_sum / self.delivered_sum
        } else {
            1.0
        }
    }

    fn target_rate(&self, obs: &Observation, n: usize) -> f64 {
        let cores = obs.budgets.map_or(1, |b| b.cores).max(1) as f64;
        let cpu_cost: f64 = (0..n)
            .filter(|&i| obs.stages[i].is_cpu())
            .filter_map(|i| self.stages[i].cost.map(|c| c * self.flow(i)))
            .sum();
        let cpu_rate = if cpu_cost > 0.0 {
            cores / cpu_cost
        } else {
            f64::INFINITY
        };
        let consumer_rate = match self.consumer_step {
            Some(s) if s > 1e-6 => 1.0 / s,
            _ => f64::INFINITY,
        };
        let r = cpu_rate.min(consumer_rate);
        if r.is_finite() {
            r
        } else {
            2.0 * self.rates.back().copied().unwrap_or(1.0).max(1.0)
        }
    }

    /// Workers per stage: the model's allocation, held inside a hysteresis band, plus a boost
    /// for the bottleneck when cores sit idle while the consumer starves.
    fn targets(&self, obs: &Observation, n: usize) -> Vec<usize> {
        let rate = self.target_rate(obs, n);
        let h = self.s.headroom;
        let cores = obs.budgets.map_or(1, |b| b.cores).max(1);
        let memory_bound = memory_bound(obs);
        let mut out: Vec<usize> = (0..n)
            .map(|i| {
                let s = &obs.stages[i];
                let m = &self.stages[i];
                let Some(cost) = m.cost.filter(|_| s.resizable()) else {
                    return s.workers;
                };
                // Square-root staffing: variable work needs spare workers in proportion to the
                // square root of the load and to the variability (none for constant work).
                let load = rate * self.flow(i) * cost;
                let cv = s.cost_cv.min(MAX_CV);
                let need = load + STAFFING_BETA * cv * load.sqrt();
                let cur = s.workers;
                // Inside [need, need × (1 + 2h)] the allocation holds: noise in the estimates
                // moves `need` by a few percent, and must not move workers.
                let w = if cur as f64 >= need && (cur as f64) <= (need * (1.0 + 2.0 * h)).ceil() {
                    cur
                } else {
                    (need * (1.0 + h)).ceil() as usize
                };
                // A CPU stage of steady cost cannot run more items at once than there are
                // cores: headroom and staffing beyond them only oversubscribe. (Heavy-tailed
                // work keeps them: spare workers let short items pass a long one. The boost
                // below still adds workers when cores sit idle because workers block.)
                let w = if s.is_cpu() && cv < STEADY_CV {
                    w.min(cores.max(cur))
                } else {
                    w
                };
                // A worker needs an item in hand: when the memory budget holds the stage's
                // buffer down, workers beyond the items it may hold would only idle.
                if memory_bound {
                    w.min(s.budget_items.max(cur))
                } else {
                    w
                }
            })
            .collect();
        if let Some((i, w)) = self.boost(obs, n) {
            out[i] = out[i].max(w);
        }
        self.give_back_tokens(obs, n, rate, &mut out);
        for (i, w) in out.iter_mut().enumerate() {
            let s = &obs.stages[i];
            let m = &self.stages[i];
            *w = (*w).clamp(1, s.max_workers.max(1));
            if let Some((c, until)) = m.ceiling {
                if self.tick < until {
                    *w = (*w).min(c.max(s.workers.min(*w)));
                }
            }
            if let Some((f, until)) = m.floor {
                if self.tick < until {
                    *w = (*w).max(f);
                }
            }
        }
        out
    }

    /// The process's CPU workers are capped (a token per worker, as many as the cores): a CPU
    /// stage that wants more workers than it may have — the tokens are held by the other
    /// stages — gets them only when the others give some back. Then the other CPU stages keep
    /// only what their load needs (`ceil(load × (1 + headroom))`, at least one), not the
    /// spare workers staffing for variable work or the hysteresis band would hold: a
    /// per-item function heavier than the decoding it follows otherwise waited on one worker
    /// while decoding held the cores' tokens for items it had no room to pass on.
    fn give_back_tokens(&self, obs: &Observation, n: usize, rate: f64, out: &mut [usize]) {
        let cpu = |i: &usize| obs.stages[*i].is_cpu() && obs.stages[*i].resizable();
        let short = (0..n)
            .filter(cpu)
            .any(|i| out[i] > obs.stages[i].max_workers.max(1));
        self.short_of_tokens.set(short);
        if !short {
            return;
        }
        for i in (0..n).filter(cpu) {
            let s = &obs.stages[i];
            if out[i] > s.max_workers.max(1) {
                continue;
            }
            if let Some(cost) = self.stages[i].cost {
                let load = rate * self.flow(i) * cost;
                let need = ((load * (1.0 + self.s.headroom)).ceil() as usize).max(1);
                out[i] = out[i].min(need);
            }
        }
    }

    /// When the consumer starves and the cores are not all busy, the model under-estimates what
    /// the pipeline needs (heavy tails: workers stuck on long items hold no core but no item
    /// moves either). The busiest CPU stage then gets up to twice its workers, in proportion
    /// to the idle cores; the trial keeps the boost only if it pays.
    ///
    /// Not when the buffers' commitment fills the memory budget: memory, not the cores, then
    /// limits the pipeline (the fetches in flight are what the budget allows), and more
    /// workers only start trials that fail.
    fn boost(&self, obs: &Observation, n: usize) -> Option<(usize, usize)> {
        if obs.wait_fraction() <= self.s.dry || memory_bound(obs) {
            return None;
        }
        let util = cpu_load(obs, n).min(1.0);
        if util >= BUSY_CORES {
            return None;
        }
        let (i, s) = obs.stages[..n]
            .iter()
            .enumerate()
            .filter(|(_, s)| s.is_cpu() && s.resizable())
            .max_by(|a, b| {
                // Busy, and not because something downstream holds it back.
                let f = |s: &crate::StageObservation| {
                    (s.busy.as_secs_f64() - s.blocked_put.as_secs_f64()) / s.workers.max(1) as f64
                };
                f(a.1).total_cmp(&f(b.1))
            })?;
        let factor = (BUSY_CORES / util.max(0.05)).min(2.0);
        Some((i, ((s.workers as f64) * factor).ceil() as usize))
    }

    fn worker_decisions(obs: &Observation, workers: &[usize], why: &str) -> Vec<Decision> {
        let mut out = Vec::new();
        for (i, &w) in workers.iter().enumerate() {
            let s = &obs.stages[i];
            if w == s.workers {
                continue;
            }
            out.push(Decision {
                action: Action::SetWorkers {
                    stage: i,
                    workers: w,
                },
                reason: why.to_owned(),
            });
            // More workers need at least their base budget; fewer keep what jitter grew (the
            // shrink rule trims it once it stays unused).
            let items = base_budget(w).max(s.budget_items);
            if items != s.budget_items {
                out.push(Decision {
                    action: Action::SetPrefetch {
                        stage: i,
                        items,
                        bytes: s.budget_bytes,
                    },
                    reason: format!("budget follows {w} workers"),
                });
            }
        }
        out
    }

    /// Ends a finished trial: keeps the change or undoes it.
    fn judge(&mut self, obs: &Observation, t: Trial) -> Vec<Decision> {
        let k = self.s.trial_ticks;
        let after: Vec<f64> = self.rates.iter().rev().take(k).copied().collect();
        let keep = if t.up && t.starving {
            p_greater(&t.before, &after) < self.s.p_value
        } else {
            // Insurance (the consumer was fed) or a scale-down: keep unless it cost throughput.
            p_greater(&after, &t.before) >= self.s.p_value
        };
        let n = t.prev.len();
        // Without a full baseline (a cold start) there is nothing to compare against: the
        // model's first jump stands on its measurements alone.
        if keep || t.before.len() < self.s.trial_ticks {
            for i in 0..n {
                if obs.stages[i].workers != t.prev[i] {
                    self.stages[i].rejections = 0;
                }
            }
            return Vec::new();
        }
        for i in 0..n {
            let now = obs.stages[i].workers;
            let m = &mut self.stages[i];
            if now == t.prev[i] {
                continue;
            }
            m.last_dir = (t.prev[i] as i64 - now as i64).signum() as i32;
            let until = self.tick + (self.s.cooldown_ticks << m.rejections.min(MAX_BACKOFF));
            m.rejections += 1;
            if now > t.prev[i] {
                m.ceiling = Some((t.prev[i], until));
            } else {
                m.floor = Some((t.prev[i], until));
            }
        }
        let why = if t.up {
            "no significant gain: undo the scale-up"
        } else {
            "significant loss: undo the scale-down"
        };
        Self::worker_decisions(obs, &t.prev, why)
    }
}

impl ModelBased {
    /// Workers and buffers.
    fn decide_stages(&mut self, obs: &Observation) -> Vec<Decision> {
        self.tick += 1;
        let n = obs
            .stages
            .iter()
            .position(|s| s.kind == Some(StageKind::Sink))
            .unwrap_or(obs.stages.len());
        if n == 0 || n == obs.stages.len() {
            return Vec::new(); // nothing to tune, or no sink to measure the consumer by
        }
        if self.stages.len() != n {
            self.stages = vec![StageModel::default(); n];
        }
        self.estimate(obs, n);
        self.rates.push_back(self.fine_rate(obs, n));
        while self.rates.len() > 4 * self.s.trial_ticks.max(1) {
            self.rates.pop_front();
        }
        if let Some(t) = self.trial.take() {
            if self.tick < t.start + self.s.settle_ticks + self.s.trial_ticks as u64 {
                self.trial = Some(t);
                return Vec::new();
            }
            let undo = self.judge(obs, t);
            if !undo.is_empty() {
                return undo;
            }
        }
        let current: Vec<usize> = obs.stages[..n].iter().map(|s| s.workers).collect();
        let mut targets = self.targets(obs, n);
        for (i, (t, &c)) in targets.iter_mut().zip(&current).enumerate() {
            // A one-worker change is always allowed: for small pools it is a large step.
            let rel = (*t as f64 - c as f64).abs() / c.max(1) as f64;
            if rel < self.s.deadband && t.abs_diff(c) > 1 {
                *t = c;
            }
            let dir = (*t as i64 - c as i64).signum() as i32;
            let m = &mut self.stages[i];
            m.urge = if dir == 0 || dir != m.urge.signum() {
                dir
            } else {
                m.urge + dir
            };
            let needed = if dir < 0 && self.short_of_tokens.get() {
                // Giving tokens back to a stage that waits for them is not noise reversing a
                // move: it needs the usual confirmation, not a reversal's.
                CONFIRM_TICKS
            } else if m.last_dir != 0 && dir != m.last_dir {
                REVERSE_CONFIRM_TICKS
            } else if m.last_dir == 0 && dir > 0 && obs.starvation() > COLD_START_STARVATION {
                // Cold start: a stage never moved yet, a consumer that does nothing but wait.
                // Waiting for confirmation here only costs throughput; the trial still judges
                // the move and undoes it if it does not pay.
                1
            } else {
                CONFIRM_TICKS
            };
            if m.urge.abs() < needed {
                *t = c;
            }
        }
        if targets != current {
            // The baseline is steady state, so up to twice as many ticks as the trial: more
            // power for the same wait.
            let before: Vec<f64> = self
                .rates
                .iter()
                .rev()
                .take(2 * self.s.trial_ticks)
                .copied()
                .collect();
            let up = targets.iter().sum::<usize>() > current.iter().sum::<usize>();
            self.trial = Some(Trial {
                start: self.tick,
                before,
                prev: current.clone(),
                up,
                starving: obs.starvation() > self.s.dry,
            });
            for (m, (&t, &c)) in self.stages.iter_mut().zip(targets.iter().zip(&current)) {
                m.urge = 0;
                if t != c {
                    m.last_dir = (t as i64 - c as i64).signum() as i32;
                }
            }
            // Before the first result the flows are unknown (every stage counts as one item
            // per result), so the target is not yet in results/s.
            let why = if self.delivered_sum >= 1.0 {
                format!("model: target {:.0} results/s", self.target_rate(obs, n))
            } else if self.delivered_total == 0 {
                "model: first allocation, from per-item costs (no result delivered yet)".to_owned()
            } else {
                "model: from per-item costs (too few results lately to weigh items per result)"
                    .to_owned()
            };
            return Self::worker_decisions(obs, &targets, &why);
        }
        self.buffers(obs, n)
    }
}

impl Policy for ModelBased {
    fn name(&self) -> &str {
        "model"
    }

    fn decide(&mut self, obs: &Observation) -> Vec<Decision> {
        let mut decisions = self.decide_stages(obs);
        decisions.extend(super::cache_decisions(obs));
        decisions.extend(self.threads.decide(obs));
        decisions
    }

    fn resumed(&mut self) {
        // A trial spanning the pause would compare rates of a consumer away with its return,
        // and the urges counted ticks of nothing moving.
        self.trial = None;
        self.rates.clear();
        for m in &mut self.stages {
            m.urge = 0;
        }
    }
}
