//! Parking: a pipeline whose consumer has gone away gives its extra CPU workers back.
//!
//! The process's CPU workers are capped (one token per worker beyond a stage's first, as many
//! as the cores allow), and the tokens belong to whichever pipeline took them. A pipeline whose
//! consumer stopped taking results (a validation loader between evaluations, an iterator
//! abandoned without being dropped, the side of a `zip` that ran dry, a training loop saving a
//! checkpoint) does no work: its workers block on full buffers. But a policy sees a consumer
//! that neither takes nor waits as one it feeds well, and keeps them, so another pipeline of
//! the process that wants the cores cannot have their tokens: on 2 cores a training loader
//! then ran one decode worker, not two, for as long as a validation iterator stayed alive.
//!
//! [`Park`] wraps a policy. Once the consumer has neither taken a result nor waited for one for
//! [`IDLE_SECS`] (or four of its usual gaps between takes, if longer: a slow training step is
//! not a pause; the usual gap is the median of the last 15, so a pause now and then does not
//! make the next one slower to see), it shrinks every resizable CPU stage to one worker and
//! stops asking the policy. The first tick on which the consumer takes or waits again, it puts
//! the workers back as they were (as far as the tokens free then allow: the policy grows the
//! rest as usual) and tells the policy ([`Policy::resumed`]) that what it measured before the
//! pause is stale. The buffers are left as they were, so the consumer finds them full when it
//! comes back.
//!
//! The shipped adaptive policies run parked; [`Static`](super::Static) does not (it changes
//! nothing, by definition), and a policy of the user's is parked only if wrapped.

use crate::observation::{Action, Decision, Observation, Policy};

/// Seconds without a take or a wait after which a consumer counts as gone (at least).
pub const IDLE_SECS: f64 = 2.0;

/// A consumer's quiet spell counts as a pause only past this many of its usual gaps between
/// takes: a training step of 3 s leaves the loader idle 3 s at a time, and is no pause.
const GAPS: f64 = 4.0;

/// Gaps between takes kept: the usual gap is their median, which a pause now and then (one
/// gap in many) does not move.
const GAPS_KEPT: usize = 15;

/// A policy that parks its pipeline while the consumer is away; see the module docs.
#[derive(Clone, Debug, Default)]
pub struct Park<P> {
    inner: P,
    /// When (seconds, the observation's clock) the consumer last took or waited.
    last_active: Option<f64>,
    /// When it last took a result, and the last gaps between takes.
    last_take: Option<f64>,
    gaps: std::collections::VecDeque<f64>,
    /// While parked: each stage's workers before the pause (`None` for those not shrunk).
    parked: Option<Vec<Option<usize>>>,
}

impl<P: Policy> Park<P> {
    /// `inner`, parked while its consumer is away.
    pub fn new(inner: P) -> Self {
        Self {
            inner,
            last_active: None,
            last_take: None,
            gaps: std::collections::VecDeque::new(),
            parked: None,
        }
    }

    /// The wrapped policy.
    pub fn inner(&self) -> &P {
        &self.inner
    }

    /// Whether the pipeline is parked now.
    pub fn is_parked(&self) -> bool {
        self.parked.is_some()
    }

    /// Seconds of quiet after which the consumer counts as gone.
    fn patience(&self) -> f64 {
        let mut g: Vec<f64> = self.gaps.iter().copied().collect();
        g.sort_by(f64::total_cmp);
        g.get(g.len() / 2)
            .map_or(IDLE_SECS, |g| (GAPS * g).max(IDLE_SECS))
    }

    fn park(&mut self, obs: &Observation, quiet: f64) -> Vec<Decision> {
        let mut saved = vec![None; obs.stages.len()];
        let mut out = Vec::new();
        for (i, s) in obs.stages.iter().enumerate() {
            if s.is_cpu() && s.resizable() && s.workers > 1 {
                saved[i] = Some(s.workers);
                out.push(Decision {
                    action: Action::SetWorkers {
                        stage: i,
                        workers: 1,
                    },
                    reason: format!(
                        "park: the consumer took nothing for {quiet:.1} s; one worker until it \
                         takes again, its {} other workers' cores back to the process",
                        s.workers - 1
                    ),
                });
            }
        }
        self.parked = Some(saved);
        out
    }

    fn unpark(&mut self, obs: &Observation, saved: Vec<Option<usize>>) -> Vec<Decision> {
        self.inner.resumed();
        let mut out = Vec::new();
        for (i, (s, w)) in obs.stages.iter().zip(saved).enumerate() {
            let Some(w) = w.filter(|_| s.resizable()) else {
                continue;
            };
            let got = w.min(s.max_workers.max(1));
            if got != s.workers {
                out.push(Decision {
                    action: Action::SetWorkers {
                        stage: i,
                        workers: got,
                    },
                    reason: if got == w {
                        format!("unpark: the consumer is back; {w} workers, as before the pause")
                    } else {
                        format!(
                            "unpark: the consumer is back; {got} of the {w} workers it had \
                             (the process's other pipelines hold the rest of the cores)"
                        )
                    },
                });
            }
        }
        out
    }
}

impl<P: Policy> Policy for Park<P> {
    fn name(&self) -> &str {
        self.inner.name()
    }

    fn decide(&mut self, obs: &Observation) -> Vec<Decision> {
        let now = obs.now.as_secs_f64();
        let took = obs.delivered > 0;
        if took {
            if let Some(t) = self.last_take {
                if self.gaps.len() == GAPS_KEPT {
                    self.gaps.pop_front();
                }
                self.gaps.push_back(now - t);
            }
            self.last_take = Some(now);
        }
        if took || !obs.consumer_wait.is_zero() {
            self.last_active = Some(now);
            if let Some(saved) = self.parked.take() {
                return self.unpark(obs, saved);
            }
            return self.inner.decide(obs);
        }
        if self.parked.is_some() {
            return Vec::new();
        }
        // The clock starts at the first tick: a consumer that never came is away too.
        let since = *self
            .last_active
            .get_or_insert(now - obs.window.as_secs_f64());
        let quiet = now - since;
        if quiet >= self.patience() {
            return self.park(obs, quiet);
        }
        self.inner.decide(obs)
    }

    fn resumed(&mut self) {
        self.inner.resumed();
    }
}

#[cfg(test)]
mod tests {
    use std::time::Duration;

    use super::*;
    use crate::{StageKind, StageObservation};

    /// An inner policy that counts its calls and the pauses it was told of.
    #[derive(Default)]
    struct Counting {
        calls: usize,
        resumed: usize,
    }

    impl Policy for Counting {
        fn name(&self) -> &str {
            "counting"
        }
        fn decide(&mut self, _: &Observation) -> Vec<Decision> {
            self.calls += 1;
            Vec::new()
        }
        fn resumed(&mut self) {
            self.resumed += 1;
        }
    }

    const TICK: Duration = Duration::from_millis(100);

    fn stage(name: &str, kind: StageKind, workers: usize, pinned: bool) -> StageObservation {
        StageObservation {
            name: name.into(),
            kind: Some(kind),
            workers,
            max_workers: 8,
            workers_pinned: pinned,
            ..Default::default()
        }
    }

    /// Tick `k` (1-based) with `delivered` results taken and the consumer waiting `wait`.
    fn obs(k: u32, delivered: u64, wait: Duration, workers: [usize; 5]) -> Observation {
        Observation {
            now: TICK * k,
            window: TICK,
            delivered,
            consumer_wait: wait,
            stages: vec![
                stage("decode", StageKind::Pool, workers[0], false),
                stage("fixed", StageKind::Pool, workers[1], true),
                stage("fetch", StageKind::Async, workers[2], false),
                stage("one", StageKind::Pool, workers[3], false),
                stage("sink", StageKind::Sink, workers[4], false),
            ],
            ..Default::default()
        }
    }

    fn set_workers(d: &[Decision]) -> Vec<(usize, usize)> {
        d.iter()
            .filter_map(|d| match d.action {
                Action::SetWorkers { stage, workers } => Some((stage, workers)),
                _ => None,
            })
            .collect()
    }

    const W: [usize; 5] = [3, 2, 16, 1, 1];

    #[test]
    fn a_consumer_taking_every_tick_is_never_parked() {
        let mut p = Park::new(Counting::default());
        for k in 1..=600 {
            assert!(p.decide(&obs(k, 1, Duration::ZERO, W)).is_empty());
        }
        assert_eq!(p.inner().calls, 600);
        assert!(!p.is_parked());
    }

    #[test]
    fn a_waiting_consumer_is_starved_not_away() {
        let mut p = Park::new(Counting::default());
        for k in 1..=600 {
            assert!(p.decide(&obs(k, 0, TICK / 2, W)).is_empty());
        }
        assert!(!p.is_parked(), "a slow first item is no pause");
    }

    #[test]
    fn a_quiet_consumer_parks_the_cpu_stages_it_may_resize_and_gets_them_back() {
        let mut p = Park::new(Counting::default());
        assert!(p.decide(&obs(1, 4, Duration::ZERO, W)).is_empty());
        let ticks = (IDLE_SECS / TICK.as_secs_f64()).round() as u32;
        for k in 2..=ticks {
            assert!(
                p.decide(&obs(k, 0, Duration::ZERO, W)).is_empty(),
                "tick {k}"
            );
        }
        let park = p.decide(&obs(ticks + 1, 0, Duration::ZERO, W));
        // Only the unpinned pool stage with extra workers: the pinned one is the user's, the
        // async one holds no core, the one-worker one has no token to give.
        assert_eq!(set_workers(&park), [(0, 1)]);
        assert!(
            park[0].reason.contains("2 other workers"),
            "{}",
            park[0].reason
        );
        let calls = p.inner().calls;
        let parked = [1, 2, 16, 1, 1];
        for k in ticks + 2..ticks + 100 {
            assert!(p.decide(&obs(k, 0, Duration::ZERO, parked)).is_empty());
        }
        assert_eq!(
            p.inner().calls,
            calls,
            "the policy is not asked while parked"
        );
        let back = p.decide(&obs(ticks + 100, 1, Duration::ZERO, parked));
        assert_eq!(set_workers(&back), [(0, 3)]);
        assert_eq!(p.inner().resumed, 1);
        assert!(!p.is_parked());
        assert!(p.decide(&obs(ticks + 101, 1, Duration::ZERO, W)).is_empty());
        assert_eq!(p.inner().calls, calls + 1, "asked again once back");
    }

    #[test]
    fn a_consumer_back_by_waiting_gets_what_the_free_tokens_allow() {
        let mut p = Park::new(Counting::default());
        let mut k = 1;
        while !p.is_parked() {
            p.decide(&obs(k, 0, Duration::ZERO, W));
            k += 1;
        }
        let mut back = obs(k, 0, TICK, [1, 2, 16, 1, 1]);
        back.stages[0].max_workers = 2; // another pipeline took the rest of the tokens
        let d = p.decide(&back);
        assert_eq!(set_workers(&d), [(0, 2)]);
        assert!(d[0].reason.contains("2 of the 3"), "{}", d[0].reason);
    }

    /// The patience is in seconds, not ticks: at the tick lengths a user may set (10 ms to
    /// 10 s), a consumer that stops is parked after 2 s, or at the first tick past them.
    #[test]
    fn the_patience_is_the_same_at_any_tick() {
        for tick in [10, 100, 1_000, 10_000].map(Duration::from_millis) {
            let mut p = Park::new(Counting::default());
            let at = |k: u32| Observation {
                now: tick * k,
                window: tick,
                ..obs(k, 0, Duration::ZERO, W)
            };
            let took = Observation {
                delivered: 1,
                ..at(1)
            };
            p.decide(&took);
            let mut k = 2;
            while !p.is_parked() {
                p.decide(&at(k));
                k += 1;
            }
            let quiet = (tick * (k - 2)).as_secs_f64();
            // (One tick of slack: the clock's float sums may land just short of 2 s.)
            let want = IDLE_SECS.max(tick.as_secs_f64()) + tick.as_secs_f64();
            assert!(
                quiet >= IDLE_SECS - 1e-9 && quiet <= want + 1e-9,
                "tick {tick:?}: parked after {quiet} s"
            );
        }
    }

    #[test]
    fn a_slow_training_step_is_not_a_pause() {
        // A result every 3 s: 30 quiet ticks at a time, longer than the least patience.
        let mut p = Park::new(Counting::default());
        for k in 1..=600 {
            let took = u64::from(k % 30 == 0);
            p.decide(&obs(k, took, Duration::ZERO, W));
            if k > 60 {
                assert!(!p.is_parked(), "parked at tick {k} between steps of 3 s");
            }
        }
        // Four steps' worth of quiet is a pause.
        let mut k = 601;
        while !p.is_parked() {
            p.decide(&obs(k, 0, Duration::ZERO, W));
            k += 1;
        }
        let quiet = f64::from(k - 600) * TICK.as_secs_f64();
        assert!((11.0..=13.0).contains(&quiet), "parked after {quiet:.1} s");
    }
}
