//! Threads per item (a video decoder's own frame threads), shared by the shipped policies.
//!
//! Many items in parallel with one thread each cost the least CPU: a frame-threaded decoder
//! waits on its own threads and repeats work at their seams. More threads per item can pay
//! only where the stage's workers cannot grow (pinned by the user, or at their ceiling) while
//! the consumer waits and cores sit idle; whether they do depends on the codec, the clips and
//! the machine (on the 2-core VM, two frame threads per H.264 clip delivered no more clips and
//! cost 36% more CPU), so every raise is a trial: kept only if the stage then finishes items
//! at least 15% faster, and the gain stands out of the tick-to-tick noise (Welch's t-test of the
//! per-tick rates against the old ones raised by 15%, one-sided, p < 0.1), else undone and not
//! tried again for a while (30 s, doubling).
//! Threads never oversubscribe the cores.

use std::collections::VecDeque;

use crate::observation::{Action, Decision, Observation};
use crate::welch::p_greater;

/// Consumer wait fraction above which a capped stage's items get more threads.
const STARVED: f64 = 0.05;

/// Fraction of the window a capped stage's workers must be busy for more threads to help (a
/// stage waiting for its input would only wait faster).
const BUSY: f64 = 0.8;

/// The rate gain a raise must show to be kept.
const GAIN: f64 = 1.15;

/// How sure the verdict must be that the gain is real: the one-sided p-value of the per-tick
/// rates after the raise being above the rates before it times [`GAIN`].
const SIGNIFICANCE: f64 = 0.1;

/// What a rate measurement needs: this many items finished, over at least this long.
/// (Video clips vary in cost: 40 of them put the noise of a rate near 5%, well inside the
/// gain asked; at 16 a trial on the 2-core VM was kept on noise.)
const MEASURE_ITEMS: u64 = 40;
const MEASURE_SECS: f64 = 2.0;

/// Per-tick rates kept for the significance test: the last minute at the default tick (a
/// stage whose setting never changes would otherwise keep one per tick for ever).
const MAX_TICKS: usize = 600;

/// Seconds a rejected raise is barred first (doubling after each rejection).
const FIRST_BACKOFF: f64 = 30.0;

/// One stage's measurement and trial.
#[derive(Clone, Debug, Default)]
struct StageTrial {
    /// Items finished and seconds since the setting last changed (less the settling items),
    /// and the last [`MAX_TICKS`] ticks' rates.
    items: u64,
    secs: f64,
    ticks: VecDeque<f64>,
    /// Items still to finish before the measurement starts: those in flight when the setting
    /// changed were started with the old one.
    settle: u64,
    /// The workers the measurement is of (a new count starts a new one).
    workers: usize,
    /// A raise on trial: the threads before it, the rate they gave, and its per-tick rates.
    trial: Option<(usize, f64, VecDeque<f64>)>,
    /// No raise before this time (seconds), and the next bar's length.
    barred_until: f64,
    backoff: f64,
}

impl StageTrial {
    fn restart(&mut self, workers: usize) {
        self.items = 0;
        self.secs = 0.0;
        self.ticks.clear();
        self.settle = workers as u64;
        self.workers = workers;
    }

    /// The rate measured since the last change, once it is long enough.
    fn rate(&self) -> Option<f64> {
        (self.items >= MEASURE_ITEMS && self.secs >= MEASURE_SECS)
            .then(|| self.items as f64 / self.secs)
    }
}

/// The shipped policies' threads-per-item decisions (see the module docs): back to one when
/// the workers can grow; down to what fits the cores the other CPU stages leave when
/// `workers × threads` would oversubscribe them; a trial doubling when the workers are capped
/// and busy and the consumer starves with cores free, kept only if it pays.
#[derive(Clone, Debug, Default)]
pub struct ItemThreadTrials {
    stages: Vec<StageTrial>,
}

impl ItemThreadTrials {
    /// This tick's decisions.
    pub fn decide(&mut self, obs: &Observation) -> Vec<Decision> {
        let Some(budgets) = obs.budgets else {
            return Vec::new();
        };
        let now = obs.now.as_secs_f64();
        let win = obs.window.as_secs_f64().max(1e-9);
        self.stages
            .resize_with(obs.stages.len(), StageTrial::default);
        let mut out = Vec::new();
        for (i, s) in obs.stages.iter().enumerate() {
            let Some(t) = s.item_threads.filter(|t| !t.pinned) else {
                continue;
            };
            let st = &mut self.stages[i];
            if s.workers != st.workers {
                // The rate of other workers says nothing of these threads.
                st.restart(s.workers);
            }
            let settled = s.items.min(st.settle);
            st.settle -= settled;
            if st.settle == 0 {
                st.items += s.items - settled;
                st.secs += win;
                if st.ticks.len() == MAX_TICKS {
                    st.ticks.pop_front();
                }
                st.ticks.push_back((s.items - settled) as f64 / win);
            }
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
                st.trial = None;
                (
                    1,
                    format!("workers can grow past {workers}: one thread per item costs less CPU"),
                )
            } else if t.threads > fit {
                st.trial = None;
                (
                    fit,
                    format!(
                        "{workers} workers × {} threads oversubscribe the {free} cores free",
                        t.threads
                    ),
                )
            } else {
                // A trial's verdict, once measured: undone if it did not pay, else kept (and
                // the next raise measured against it).
                let mut kept = String::new();
                if let Some((from, before, ref before_ticks)) = st.trial {
                    let Some(after) = st.rate() else {
                        continue;
                    };
                    let raised: Vec<f64> = before_ticks.iter().map(|r| GAIN * r).collect();
                    let p = p_greater(&raised, st.ticks.make_contiguous());
                    st.trial = None;
                    if after < GAIN * before || p >= SIGNIFICANCE {
                        st.backoff = if st.backoff == 0.0 {
                            FIRST_BACKOFF
                        } else {
                            2.0 * st.backoff
                        };
                        st.barred_until = now + st.backoff;
                        st.restart(workers);
                        out.push(Decision {
                            action: Action::SetItemThreads {
                                stage: i,
                                threads: from,
                            },
                            reason: format!(
                                "{} threads per item did not pay ({after:.1} items/s against \
                                 {before:.1} with {from}, p = {p:.2}): back, not retried for \
                                 {:.0} s",
                                t.threads, st.backoff
                            ),
                        });
                        continue;
                    }
                    st.backoff = 0.0;
                    kept = format!(
                        "{} threads per item kept ({after:.1} items/s against {before:.1} with \
                         {from}); ",
                        t.threads
                    );
                }
                if !(capped
                    && t.threads < fit
                    && busy >= BUSY
                    && obs.starvation() > STARVED
                    && now >= st.barred_until)
                {
                    if !kept.is_empty() {
                        // No further raise: the verdict is the decision, so the trace has it.
                        out.push(Decision {
                            action: Action::SetItemThreads {
                                stage: i,
                                threads: t.threads,
                            },
                            reason: kept.trim_end_matches("; ").to_owned(),
                        });
                    }
                    continue;
                }
                let Some(before) = st.rate() else {
                    continue;
                };
                st.trial = Some((t.threads, before, std::mem::take(&mut st.ticks)));
                (
                    (t.threads * 2).min(fit),
                    format!(
                        "{kept}workers capped at {workers}, all busy, consumer waits {:.0}% with \
                         {free} cores free: trying more threads per item ({before:.1} items/s now)",
                        100.0 * obs.starvation()
                    ),
                )
            };
            if threads != t.threads {
                st.restart(workers);
                out.push(Decision {
                    action: Action::SetItemThreads { stage: i, threads },
                    reason,
                });
            }
        }
        out
    }
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

    /// Runs `p` on `o` tick after tick (100 ms each, `o.now` advancing) until it decides
    /// something or `ticks` pass; returns the decision (threads, reason) and the tick.
    fn run(
        p: &mut ItemThreadTrials,
        o: &mut Observation,
        ticks: usize,
    ) -> Option<(usize, String, usize)> {
        for k in 0..ticks {
            o.now += o.window;
            let d = enforce(p.decide(o), o);
            match d.as_slice() {
                [] => {}
                [Decision {
                    action: Action::SetItemThreads { threads, .. },
                    reason,
                }] => {
                    o.stages[0].item_threads.as_mut().unwrap().threads = *threads;
                    return Some((*threads, reason.clone(), k));
                }
                d => panic!("{d:?}"),
            }
        }
        None
    }

    #[test]
    fn a_raise_is_a_trial_kept_only_if_it_pays() {
        let mut p = ItemThreadTrials::default();
        let mut o = obs(2, 2, 1, 8, 0.5);
        o.stages[0].items = 2; // 20 items/s
                               // A second of measurement, then a trial at twice the threads.
        let (t, why, k) = run(&mut p, &mut o, 50).expect("a trial");
        assert_eq!(t, 2, "{why}");
        assert!(
            (19..=21).contains(&k),
            "after 2 s of measurement, not {k} ticks"
        );
        assert!(why.contains("trying more threads"), "{why}");
        // 50% faster: kept, and the next doubling tried.
        o.stages[0].items = 3;
        let (t, why, _) = run(&mut p, &mut o, 50).expect("the next trial");
        assert_eq!(t, 4, "{why}");
        assert!(why.contains("2 threads per item kept"), "{why}");
        // No faster: back to 2, and not retried for 30 s.
        let (t, why, _) = run(&mut p, &mut o, 50).expect("a verdict");
        assert_eq!(t, 2, "{why}");
        assert!(why.contains("did not pay"), "{why}");
        let (t, why, k) = run(&mut p, &mut o, 400).expect("a retry after the bar");
        assert_eq!(t, 4, "{why}");
        assert!((290..=320).contains(&k), "retried after {k} ticks");
    }

    #[test]
    fn a_raise_kept_at_the_last_fit_is_recorded() {
        // 2 workers on 4 cores: 2 threads each is all that fits.
        let mut p = ItemThreadTrials::default();
        let mut o = obs(2, 2, 1, 4, 0.5);
        o.stages[0].items = 2;
        let (t, _, _) = run(&mut p, &mut o, 50).expect("a trial");
        assert_eq!(t, 2);
        o.stages[0].items = 3;
        let (t, why, _) = run(&mut p, &mut o, 50).expect("the verdict, in the trace");
        assert_eq!(t, 2, "{why}");
        assert!(why.starts_with("2 threads per item kept"), "{why}");
        assert_eq!(run(&mut p, &mut o, 100), None, "recorded once");
    }

    #[test]
    fn a_gain_lost_in_the_noise_is_not_kept() {
        let mut p = ItemThreadTrials::default();
        let mut o = obs(2, 2, 1, 8, 0.5);
        o.stages[0].items = 2; // 20 items/s, steadily
        let (t, _, _) = run(&mut p, &mut o, 50).expect("a trial");
        assert_eq!(t, 2);
        // After the raise the ticks alternate between 0 and 5 items: 25 items/s on average,
        // 25% faster, but no steadier than a coin: the gain asked is not shown.
        let mut k = 0;
        let verdict = loop {
            k += 1;
            assert!(k < 100, "no verdict");
            o.stages[0].items = if k % 2 == 0 { 5 } else { 0 };
            o.now += o.window;
            let d = enforce(p.decide(&o), &o);
            if let [Decision {
                action: Action::SetItemThreads { threads, .. },
                reason,
            }] = d.as_slice()
            {
                break (*threads, reason.clone());
            }
        };
        assert_eq!(verdict.0, 1, "{}", verdict.1);
        assert!(
            verdict.1.contains("did not pay") && verdict.1.contains("p = "),
            "{}",
            verdict.1
        );
    }

    #[test]
    fn no_raise_where_the_consumer_is_fed_the_workers_can_grow_or_the_cores_are_full() {
        for (w, max, threads, wait) in [
            (2, 2, 1, 0.0),
            (2, 4, 1, 0.5),
            (2, 2, 4, 0.5),
            (3, 3, 2, 0.5),
        ] {
            let mut o = obs(w, max, threads, 8, wait);
            o.stages[0].items = 2;
            let d = run(&mut ItemThreadTrials::default(), &mut o, 50);
            assert_eq!(
                d, None,
                "{w} of {max} workers × {threads} threads, wait {wait}"
            );
        }
    }

    #[test]
    fn threads_fall_back_at_once_when_workers_can_grow_or_cores_are_oversubscribed() {
        let first = |o: &mut Observation| run(&mut ItemThreadTrials::default(), o, 1).map(|d| d.0);
        assert_eq!(first(&mut obs(2, 4, 4, 8, 0.5)), Some(1));
        assert_eq!(
            first(&mut obs(4, 4, 4, 8, 0.0)),
            Some(2),
            "16 threads on 8 cores"
        );
        let mut o = obs(2, 2, 2, 8, 0.5);
        o.stages[0].item_threads.as_mut().unwrap().pinned = true;
        assert_eq!(first(&mut o), None, "pinned");
    }
}
