//! Hill climbing with additive increase and multiplicative decrease, one step per tick.

use serde::{Deserialize, Serialize};

use super::base_budget;
use crate::observation::{Action, Decision, Observation, Policy};

/// Settings of [`HillClimb`].
#[derive(Clone, Copy, Debug, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct HillClimbSettings {
    /// Consumer wait (fraction of a tick) above which the pipeline is too slow. Default 0.05:
    /// a GPU idle 5% of the time is worth a worker.
    #[serde(default = "default_starved")]
    pub starved: f64,
    /// Utilisation below which a stage gives workers back. Default 0.5.
    #[serde(default = "default_idle")]
    pub idle: f64,
    /// Ticks without starvation before scaling down. Default 5.
    #[serde(default = "default_calm_ticks")]
    pub calm_ticks: u32,
}

fn default_starved() -> f64 {
    0.05
}
fn default_idle() -> f64 {
    0.5
}
fn default_calm_ticks() -> u32 {
    5
}

impl Default for HillClimbSettings {
    fn default() -> Self {
        Self {
            starved: default_starved(),
            idle: default_idle(),
            calm_ticks: default_calm_ticks(),
        }
    }
}

/// Adds one worker (a quarter more, for async stages) to the busiest stage while the consumer
/// starves; takes a quarter away from an under-used stage after a calm spell.
#[derive(Clone, Debug, Default)]
pub struct HillClimb {
    s: HillClimbSettings,
    calm: u32,
    threads: super::ItemThreadTrials,
}

impl HillClimb {
    /// A policy with `settings`.
    pub fn new(settings: HillClimbSettings) -> Self {
        Self {
            s: settings,
            calm: 0,
            threads: super::ItemThreadTrials::default(),
        }
    }
}

impl HillClimb {
    /// Workers and buffers.
    fn decide_stages(&mut self, obs: &Observation) -> Vec<Decision> {
        let win = obs.window.as_secs_f64().max(1e-9);
        let util = |i: usize| {
            let s = &obs.stages[i];
            s.busy.as_secs_f64() / (s.workers.max(1) as f64 * win)
        };
        let candidates: Vec<usize> = (0..obs.stages.len())
            .filter(|&i| obs.stages[i].resizable())
            .collect();
        let mut out = Vec::new();
        let set = |i: usize, w: usize, why: &str, out: &mut Vec<Decision>| {
            let s = &obs.stages[i];
            out.push(Decision {
                action: Action::SetWorkers {
                    stage: i,
                    workers: w,
                },
                reason: why.to_owned(),
            });
            let items = base_budget(w);
            out.push(Decision {
                action: Action::SetPrefetch {
                    stage: i,
                    items,
                    bytes: s.budget_bytes,
                },
                reason: "budget follows workers".to_owned(),
            });
        };
        if obs.starvation() > self.s.starved {
            self.calm = 0;
            if let Some(&i) = candidates
                .iter()
                .max_by(|&&a, &&b| util(a).total_cmp(&util(b)))
            {
                let s = &obs.stages[i];
                let w = if s.is_cpu() {
                    s.workers + 1
                } else {
                    s.workers + s.workers.div_ceil(4)
                };
                set(
                    i,
                    w,
                    "consumer starved: the busiest stage gets more",
                    &mut out,
                );
            }
        } else {
            self.calm += 1;
            if self.calm >= self.s.calm_ticks {
                if let Some(&i) = candidates
                    .iter()
                    .filter(|&&i| obs.stages[i].workers > 1 && util(i) < self.s.idle)
                    .min_by(|&&a, &&b| util(a).total_cmp(&util(b)))
                {
                    self.calm = 0;
                    let w = obs.stages[i].workers * 3 / 4;
                    set(
                        i,
                        w.max(1),
                        "calm and under-used: give workers back",
                        &mut out,
                    );
                }
            }
        }
        out
    }
}

impl Policy for HillClimb {
    fn name(&self) -> &str {
        "hill-climb"
    }

    fn decide(&mut self, obs: &Observation) -> Vec<Decision> {
        let mut decisions = self.decide_stages(obs);
        decisions.extend(super::cache_decisions(obs));
        decisions.extend(self.threads.decide(obs));
        decisions
    }
}

#[cfg(test)]
mod tests {
    use std::time::Duration;

    use super::*;
    use crate::{StageKind, StageObservation};

    /// A consumer that waited half the tick, behind one busy CPU stage.
    fn waiting(gpu_util: Option<f64>) -> Observation {
        Observation {
            window: Duration::from_secs(1),
            consumer_wait: Duration::from_millis(500),
            delivered: 100,
            gpu_util,
            stages: vec![
                StageObservation {
                    name: "decode".into(),
                    kind: Some(StageKind::Pool),
                    workers: 1,
                    max_workers: 8,
                    busy: Duration::from_millis(950),
                    budget_items: 4,
                    ..Default::default()
                },
                StageObservation {
                    name: "sink".into(),
                    kind: Some(StageKind::Sink),
                    ..Default::default()
                },
            ],
            ..Default::default()
        }
    }

    #[test]
    fn a_busy_gpu_means_the_consumer_is_not_starved() {
        let o = waiting(None);
        assert!((o.starvation() - 0.5).abs() < 1e-9);
        assert!((waiting(Some(0.99)).starvation() - 0.01).abs() < 1e-9);
        assert!((waiting(Some(0.2)).starvation() - 0.5).abs() < 1e-9);

        let scaled = |o: &Observation| {
            HillClimb::default()
                .decide_stages(o)
                .iter()
                .any(|d| matches!(d.action, Action::SetWorkers { workers: 2, .. }))
        };
        assert!(scaled(&waiting(None)), "no GPU signal: waits mean starving");
        assert!(scaled(&waiting(Some(0.3))), "an idle GPU: starving");
        assert!(
            !scaled(&waiting(Some(0.99))),
            "a busy GPU: the loader keeps up"
        );
    }
}
