//! Threads per item (a video decoder's own frame threads), shared by the shipped policies.
//!
//! Many items in parallel with one thread each cost the least CPU: a frame-threaded decoder
//! waits on its own threads and repeats work at their seams. More threads per item pay only
//! where the stage's workers cannot grow (pinned by the user, or at their ceiling) while the
//! consumer waits and cores sit idle; they must never oversubscribe the cores.

use crate::observation::{Action, Decision, Observation};

/// Consumer wait fraction above which a capped stage's items get more threads.
const STARVED: f64 = 0.05;

/// Fraction of the window a capped stage's workers must be busy for more threads to help (a
/// stage waiting for its input would only wait faster).
const BUSY: f64 = 0.8;

/// Sets each stage's threads per item (see the module docs): back to one when the workers can
/// grow; down to what fits the cores the other CPU stages leave when `workers × threads` would
/// oversubscribe them; up (doubling) when the workers are capped, busy, and the consumer
/// starves with cores free.
pub fn item_thread_decisions(obs: &Observation) -> Vec<Decision> {
    let Some(budgets) = obs.budgets else {
        return Vec::new();
    };
    let win = obs.window.as_secs_f64().max(1e-9);
    let mut out = Vec::new();
    for (i, s) in obs.stages.iter().enumerate() {
        let Some(t) = s.item_threads.filter(|t| !t.pinned) else {
            continue;
        };
        let workers = s.workers.max(1);
        // Cores the other CPU stages used in the window; what is left (rounded: a collate
        // stage busy 2% of the time does not take a core) is this stage's.
        let others: f64 = obs
            .stages
            .iter()
            .enumerate()
            .filter(|&(j, o)| j != i && o.is_cpu())
            .map(|(_, o)| o.busy.as_secs_f64() / win)
            .sum();
        let free = (budgets.cores as f64 - others).round().max(1.0) as usize;
        let fit = (free / workers).clamp(1, t.max_threads.max(1));
        let capped = s.workers_pinned || s.workers >= s.max_workers;
        let busy = s.busy.as_secs_f64() / win / workers as f64;
        let (threads, reason) = if !capped && t.threads > 1 {
            (
                1,
                format!("workers can grow past {workers}: one thread per item costs less CPU"),
            )
        } else if t.threads > fit {
            (
                fit,
                format!(
                    "{workers} workers × {} threads oversubscribe the {free} cores free",
                    t.threads
                ),
            )
        } else if capped && t.threads < fit && busy >= BUSY && obs.starvation() > STARVED {
            (
                (t.threads * 2).min(fit),
                format!(
                    "workers capped at {workers}, all busy, consumer waits {:.0}% with {free} cores \
                     free: more threads per item",
                    100.0 * obs.starvation()
                ),
            )
        } else {
            continue;
        };
        if threads != t.threads {
            out.push(Decision {
                action: Action::SetItemThreads { stage: i, threads },
                reason,
            });
        }
    }
    out
}

#[cfg(test)]
mod tests {
    use std::time::Duration;

    use super::*;
    use crate::{enforce, Budgets, ItemThreadsStats, StageKind, StageObservation};

    /// A decode stage with `workers` of `max` workers busy all window, `threads` per item,
    /// on `cores`, the consumer waiting `wait` of the window.
    fn obs(workers: usize, max: usize, threads: usize, cores: usize, wait: f64) -> Observation {
        let win = Duration::from_millis(100);
        Observation {
            window: win,
            consumer_wait: win.mul_f64(wait),
            budgets: Some(Budgets {
                memory_bytes: 1 << 30,
                cores,
            }),
            stages: vec![StageObservation {
                name: "decode".into(),
                kind: Some(StageKind::Pool),
                workers,
                max_workers: max,
                busy: win * workers as u32,
                item_threads: Some(ItemThreadsStats {
                    threads,
                    max_threads: 8,
                    pinned: false,
                }),
                ..StageObservation::default()
            }],
            ..Observation::default()
        }
    }

    fn decided(o: &Observation) -> Option<usize> {
        match enforce(item_thread_decisions(o), o).as_slice() {
            [] => None,
            [Decision {
                action: Action::SetItemThreads { threads, .. },
                ..
            }] => Some(*threads),
            d => panic!("{d:?}"),
        }
    }

    #[test]
    fn capped_starved_stages_get_threads_up_to_the_free_cores() {
        assert_eq!(decided(&obs(2, 2, 1, 8, 0.5)), Some(2));
        assert_eq!(decided(&obs(2, 2, 2, 8, 0.5)), Some(4));
        assert_eq!(decided(&obs(2, 2, 4, 8, 0.5)), None, "4 × 2 fill 8 cores");
        assert_eq!(
            decided(&obs(3, 3, 2, 8, 0.5)),
            None,
            "3 × 2 of 8: a third would not fit"
        );
        // Not when the consumer is fed, or the workers can grow instead.
        assert_eq!(decided(&obs(2, 2, 1, 8, 0.0)), None);
        assert_eq!(decided(&obs(2, 4, 1, 8, 0.5)), None);
    }

    #[test]
    fn threads_fall_back_when_workers_can_grow_or_cores_are_oversubscribed() {
        assert_eq!(decided(&obs(2, 4, 4, 8, 0.5)), Some(1));
        assert_eq!(
            decided(&obs(4, 4, 4, 8, 0.0)),
            Some(2),
            "16 threads on 8 cores"
        );
        let mut o = obs(2, 2, 2, 8, 0.5);
        o.stages[0].item_threads.as_mut().unwrap().pinned = true;
        assert_eq!(decided(&o), None, "pinned");
    }
}
