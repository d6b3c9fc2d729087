//! The model-based policy's buffer rules: double a buffer the consumer waits for, shrink one
//! that is always full, and the lean rule — once the training step is the bottleneck, keep
//! ahead of it only what keeps each stage's workers busy, and never less than a wait after a
//! shrink showed the jitter needs.

use super::ModelBased;
use crate::observation::{Action, Decision, Observation};
use crate::policy::base_budget;
use crate::StageKind;

/// What the lean rule learned of one buffer.
#[derive(Clone, Copy, Debug, Default)]
pub(super) struct Lean {
    shrunk: bool,
    floor: usize,
}

/// Ticks after an epoch starts in which the consumer's waits say nothing about the buffers
/// (500 ms at the default tick: the first batch of an epoch is decoded while it waits).
const EPOCH_START_TICKS: u64 = 5;

/// Ticks the consumer must not wait before the buffers ahead of it shrink (1 s at the default
/// tick), and between two halvings.
const LEAN_TICKS: u32 = 10;

impl ModelBased {
    /// The buffers' decisions of a tick in which no worker count changed.
    pub(super) fn buffers(&mut self, obs: &Observation, n: usize) -> Vec<Decision> {
        let win = obs.window.as_secs_f64().max(1e-9);
        let frac = |d: std::time::Duration, workers: usize| {
            d.as_secs_f64() / (workers.max(1) as f64 * win)
        };
        let mut out = Vec::new();
        // The lean rule: a consumer that has not waited for a while is the bottleneck, and
        // what is buffered ahead of it only needs to cover the jitter of decode and step.
        if obs.starvation() <= self.s.dry && obs.delivered > 0 {
            self.lean_calm += 1;
        } else {
            self.lean_calm = 0;
        }
        let lean_now = self.lean_calm >= LEAN_TICKS && self.lean_calm % LEAN_TICKS == 0;
        // Right after an epoch starts the consumer waits for its first batch whatever the
        // buffers hold: no lesson about their sizes.
        if let Some(e) = obs.epoch {
            if self.epoch.is_none_or(|(seen, _)| seen != e) {
                self.epoch = Some((e, self.tick));
            }
        }
        let epoch_start = self
            .epoch
            .is_some_and(|(_, since)| self.tick < since + EPOCH_START_TICKS);
        for i in 0..=n {
            let s = &obs.stages[i];
            let is_sink = s.kind == Some(StageKind::Sink);
            let starved = if is_sink {
                obs.wait_fraction() > self.s.dry
            } else {
                frac(s.blocked_get, s.workers) > self.s.dry
            };
            let upstream_blocked = if i == 0 {
                // The source is not observed; the first stage's buffer can only have run dry
                // for want of room if the lean rule shrank it.
                self.stages.first().is_some_and(|m| m.lean.shrunk)
            } else {
                let u = &obs.stages[i - 1];
                frac(u.blocked_put, u.workers) > self.s.dry
            };
            let base = if is_sink { 2 } else { base_budget(s.workers) };
            let (calm, lean) = if is_sink {
                (&mut self.sink_calm, &mut self.sink_lean)
            } else {
                let m = &mut self.stages[i];
                (&mut m.calm, &mut m.lean)
            };
            let floor = base.max(lean.floor);
            // A buffer inside the pipeline that runs dry matters only when the consumer
            // waits too: a step-bound pipeline's stages take turns waiting on each other.
            let consumer_waits = obs.starvation() > self.s.dry;
            if starved && upstream_blocked && (epoch_start || !consumer_waits) {
                *calm = 0;
            } else if starved && upstream_blocked {
                *calm = 0;
                let items = (2 * s.budget_items).max(base);
                let reason = if lean.shrunk {
                    // Shrunk too far: the jitter needs this much; never shrink below it.
                    lean.floor = items;
                    format!(
                        "ran dry after the buffer shrank: the jitter needs {items} items, keep them"
                    )
                } else {
                    "ran dry while upstream was blocked: jitter, double the buffer".to_owned()
                };
                out.push(Decision {
                    action: Action::SetPrefetch {
                        stage: i,
                        items,
                        bytes: s.budget_bytes,
                    },
                    reason,
                });
            } else if lean_now && !s.budget_pinned && s.budget_items > floor {
                *calm = 0;
                lean.shrunk = true;
                let items = (s.budget_items / 2).max(floor);
                out.push(Decision {
                    action: Action::SetPrefetch {
                        stage: i,
                        items,
                        bytes: s.budget_bytes,
                    },
                    reason: format!(
                        "the consumer is the bottleneck (no wait for {:.1} s): {} items ahead \
                         here are enough for the jitter (least {floor})",
                        self.lean_calm as f64 * obs.window.as_secs_f64(),
                        items
                    ),
                });
            } else if !starved && s.queue_items >= s.budget_items && s.budget_items > base {
                *calm += 1;
                if *calm >= self.s.calm_ticks {
                    *calm = 0;
                    out.push(Decision {
                        action: Action::SetPrefetch {
                            stage: i,
                            items: (s.budget_items * 3 / 4).max(base),
                            bytes: s.budget_bytes,
                        },
                        reason: "always full, never dry: shrink the buffer".into(),
                    });
                }
            } else {
                *calm = 0;
            }
        }
        out
    }
}
