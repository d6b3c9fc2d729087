//! Sizing a pool of remote decode workers (Ray actors, in the Python package's remote mode)
//! from what the training loop waits.
//!
//! The training process hands out units of batches to the pool and yields them in order; once
//! a window (about a second) it gives a [`PoolSizer`] a [`PoolObservation`]: how long the loop
//! waited for data, how many units wait decoded and how many are in the workers' hands, the
//! workers still starting, the CPUs the cluster has free. The rule:
//!
//! - **Grow** by one worker when the loop waited more than [`GROW_WAIT`] of the window while
//!   every worker had a unit in hand (the pool, not the hand-out, is short), within
//!   `max_workers` and the cluster's free CPUs.
//! - **Shrink** by one when the loop did not wait ([`SHRINK_WAIT`]), at least a unit per
//!   worker sat decoded, and one worker fewer would still decode what the loop took (with
//!   [`SHRINK_MARGIN`] to spare, at the workers' measured rate), for [`SHRINK_WINDOWS`]
//!   windows in a row: the pool outruns the loop by a worker or more.
//! - **Hold** while a worker starts (its first unit is not a measure of the pool), and for
//!   [`SETTLE_WINDOWS`] windows after a change.
//!
//! Every change and every hold that keeps the loop waiting (at the limit, no free CPUs) comes
//! with its reason, for the trace. Pure and deterministic: [`simulate`] runs the rule against
//! a loop and workers of given rates in microseconds, the test of the rule.
//!
//! [`dispatch`] keeps the hand-out's books (which worker holds which unit, units issued again
//! after a death, workers started and retired, the windows this rule sees), without I/O.

pub mod dispatch;

/// The loop waited more than this fraction of a window with every worker busy: grow.
pub const GROW_WAIT: f64 = 0.05;
/// The loop waited less than this fraction of a window: the pool is not short.
pub const SHRINK_WAIT: f64 = 0.01;
/// Windows in a row with decoded units piling up before the pool shrinks.
pub const SHRINK_WINDOWS: u32 = 3;
/// A pool one worker smaller must decode the loop's rate with this much to spare before it
/// shrinks (so it does not shrink into waiting and grow back).
pub const SHRINK_MARGIN: f64 = 0.15;
/// Windows after a change before the next.
pub const SETTLE_WINDOWS: u32 = 2;

/// What the pool's sizer sees over one window.
#[derive(Clone, Copy, Debug, Default, PartialEq)]
pub struct PoolObservation {
    /// Workers in the pool (started or starting).
    pub workers: usize,
    /// Workers not ready yet (started, no unit finished).
    pub starting: usize,
    /// The fraction of the window the training loop waited for a batch.
    pub wait: f64,
    /// Units decoded and not yet consumed.
    pub ready: usize,
    /// Units in the workers' hands (issued, not decoded yet), the training process's own
    /// included when it decodes.
    pub in_flight: usize,
    /// CPUs the cluster has free (for another worker).
    pub free_cpus: f64,
    /// Units a second the loop took in the window.
    pub rate: f64,
    /// Units a second one busy worker decodes (measured; 0: not known yet).
    pub worker_rate: f64,
    /// Units a second the training process decodes itself (measured; 0 when it does not).
    pub local_rate: f64,
}

/// The pool's bounds.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct PoolLimits {
    /// The fewest workers.
    pub min_workers: usize,
    /// The most workers.
    pub max_workers: usize,
    /// CPUs each worker reserves.
    pub cpus_per_worker: f64,
    /// Whether the training process decodes units too (a worker that is always there).
    pub local: bool,
}

/// A sizer's answer for one window: the pool's size, and why it changed (or why it could not
/// grow while the loop waits).
#[derive(Clone, Debug, PartialEq)]
pub struct PoolDecision {
    /// Workers the pool should have.
    pub workers: usize,
    /// The reason, when the size changed or a needed growth was held back.
    pub why: Option<String>,
}

/// The pool's sizing rule; see the [module docs](self).
#[derive(Clone, Debug)]
pub struct PoolSizer {
    limits: PoolLimits,
    /// Windows since the last change.
    calm: u32,
    /// Windows in a row the pool outran the loop.
    ahead: u32,
    /// The last reason given for holding back (said once, not every window).
    held: Option<&'static str>,
}

impl PoolSizer {
    /// A sizer within `limits` (`min_workers` at least 1 unless the training process
    /// decodes too, `max_workers` at least that).
    pub fn new(limits: PoolLimits) -> Self {
        let min = limits.min_workers.max(usize::from(!limits.local));
        Self {
            limits: PoolLimits {
                min_workers: min,
                max_workers: limits.max_workers.max(min),
                cpus_per_worker: limits.cpus_per_worker.max(0.0),
                local: limits.local,
            },
            calm: SETTLE_WINDOWS,
            ahead: 0,
            held: None,
        }
    }

    /// The limits it keeps.
    pub fn limits(&self) -> PoolLimits {
        self.limits
    }

    /// The pool's size after the window `o`.
    pub fn decide(&mut self, o: &PoolObservation) -> PoolDecision {
        let PoolLimits {
            min_workers,
            max_workers,
            cpus_per_worker,
            local,
        } = self.limits;
        let n = o.workers;
        let keep = |why: Option<String>| PoolDecision { workers: n, why };
        if n < min_workers {
            return self.change(
                min_workers,
                format!("{n} workers alive, fewer than min_workers {min_workers}: start more"),
            );
        }
        if n > max_workers {
            return self.change(
                max_workers,
                format!("{n} workers, more than max_workers {max_workers}"),
            );
        }
        if o.starting > 0 {
            return keep(None);
        }
        self.calm = self.calm.saturating_add(1);
        let waits = o.wait > GROW_WAIT;
        let busy = o.in_flight >= n + usize::from(local);
        if waits && busy {
            self.ahead = 0;
            let who = match (local, n) {
                (true, 0) => "the training process's own decode".to_owned(),
                (true, n) => format!("its own decode and all {n} workers"),
                (false, n) => format!("all {n} workers"),
            };
            if self.calm <= SETTLE_WINDOWS {
                return keep(None);
            }
            // What holds the pool back (a key, so a hold is said once), and in words.
            let held = if n >= max_workers {
                Some((
                    "max_workers",
                    format!("the pool is at max_workers ({max_workers})"),
                ))
            } else if o.free_cpus + 1e-9 < cpus_per_worker {
                Some((
                    "cpus",
                    format!(
                        "another worker needs {cpus_per_worker} CPUs and the cluster has {:.1} \
                         free",
                        o.free_cpus.max(0.0)
                    ),
                ))
            } else {
                None
            };
            if let Some((key, why)) = held {
                let first = self.held != Some(key);
                self.held = Some(key);
                return keep(first.then(|| {
                    format!(
                        "the training loop waited {:.0}% of the window with {who} busy, but {why}",
                        o.wait * 100.0
                    )
                }));
            }
            return self.change(
                n + 1,
                format!(
                    "the training loop waited {:.0}% of the window with {who} busy: one more \
                     worker ({:.0} CPUs free)",
                    o.wait * 100.0,
                    o.free_cpus
                ),
            );
        }
        let fewer_keep_up =
            o.worker_rate > 0.0 && o.rate <= (n - 1) as f64 * o.worker_rate * (1.0 - SHRINK_MARGIN);
        if o.wait < SHRINK_WAIT && o.ready >= n && n > min_workers && fewer_keep_up {
            self.ahead += 1;
            if self.ahead >= SHRINK_WINDOWS && self.calm > SETTLE_WINDOWS {
                return self.change(
                    n - 1,
                    format!(
                        "{} units waited decoded and the loop did not wait for {} windows (it \
                         takes {:.1} units/s, {} workers decode {:.1}): one worker fewer",
                        o.ready,
                        self.ahead,
                        o.rate,
                        n - 1,
                        (n - 1) as f64 * o.worker_rate
                    ),
                );
            }
        } else {
            self.ahead = 0;
        }
        keep(None)
    }

    fn change(&mut self, workers: usize, why: String) -> PoolDecision {
        self.calm = 0;
        self.ahead = 0;
        self.held = None;
        PoolDecision {
            workers,
            why: Some(why),
        }
    }
}

/// A loop and a pool, for [`simulate`]: the loop consumes `consume` units a second, the
/// training process decodes `local` units a second itself, each worker decodes `decode` units
/// a second and needs `startup` windows before its first, the hand-out keeps at most
/// `window_per_worker` units per worker issued or waiting.
#[derive(Clone, Copy, Debug)]
pub struct PoolScenario {
    /// Units a second the training loop would take if it never waited.
    pub consume: f64,
    /// Units a second one worker decodes.
    pub decode: f64,
    /// Units a second the training process decodes itself (0: all remote).
    pub local: f64,
    /// Windows a new worker takes to start.
    pub startup: u32,
    /// Units issued or waiting per worker, at most.
    pub window_per_worker: usize,
    /// CPUs the cluster has free at the start.
    pub free_cpus: f64,
}

/// One window of a [`simulate`] run.
#[derive(Clone, Debug, PartialEq)]
pub struct PoolTick {
    /// Workers in the pool during the window.
    pub workers: usize,
    /// Units consumed in the window.
    pub consumed: f64,
    /// The fraction of the window the loop waited.
    pub wait: f64,
    /// The sizer's reason, if it gave one.
    pub why: Option<String>,
}

/// Runs `sizer` for `windows` one-second windows against `s` (fluid model: units are
/// fractional), starting from `workers`. The loop's rate may change mid-run: `consume_at`
/// gives it per window (`None`: `s.consume`).
pub fn simulate(
    sizer: &mut PoolSizer,
    s: &PoolScenario,
    workers: usize,
    windows: u32,
    consume_at: impl Fn(u32) -> Option<f64>,
) -> Vec<PoolTick> {
    // Each worker: windows left before it decodes.
    let mut pool: Vec<u32> = vec![0; workers];
    let mut ready = 0.0f64;
    let mut out = Vec::new();
    for w in 0..windows {
        let consume = consume_at(w).unwrap_or(s.consume);
        let n = pool.len();
        let cap = (s.window_per_worker * (n + 1)) as f64;
        let decoding = pool.iter().filter(|&&d| d == 0).count();
        // Workers decode all window; what the hand-out has no room for is not decoded (the
        // workers idled for want of units).
        let available = ready + s.local + s.decode * decoding as f64;
        let consumed = consume.min(available);
        let left = available - consumed;
        ready = left.min(cap);
        let wait = if consume > 0.0 {
            1.0 - consumed / consume
        } else {
            0.0
        };
        let starting = pool.iter().filter(|&&d| d > 0).count();
        // With the hand-out full, only its free room is in the workers' hands.
        let in_flight = if left > cap {
            (cap - ready).floor() as usize
        } else {
            n + usize::from(s.local > 0.0)
        };
        let used = n as f64 * sizer.limits().cpus_per_worker;
        let d = sizer.decide(&PoolObservation {
            workers: n,
            starting,
            wait,
            ready: ready.floor() as usize,
            in_flight,
            free_cpus: (s.free_cpus - used).max(0.0),
            rate: consumed,
            worker_rate: s.decode,
            local_rate: s.local,
        });
        out.push(PoolTick {
            workers: n,
            consumed,
            wait,
            why: d.why,
        });
        for d in pool.iter_mut() {
            *d = d.saturating_sub(1);
        }
        pool.resize(d.workers, s.startup);
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    fn sizer(max: usize) -> PoolSizer {
        PoolSizer::new(PoolLimits {
            min_workers: 1,
            max_workers: max,
            cpus_per_worker: 4.0,
            local: false,
        })
    }

    const SCENARIO: PoolScenario = PoolScenario {
        consume: 100.0,
        decode: 30.0,
        local: 0.0,
        startup: 2,
        window_per_worker: 2,
        free_cpus: 64.0,
    };

    #[test]
    fn the_pool_grows_until_the_loop_stops_waiting_and_no_further() {
        let mut s = sizer(16);
        let ticks = simulate(&mut s, &SCENARIO, 1, 60, |_| None);
        let last = ticks.last().unwrap();
        // 100 units/s at 30 per worker: 4 workers.
        assert_eq!(last.workers, 4, "{ticks:#?}");
        assert!(ticks[40..]
            .iter()
            .all(|t| t.wait < GROW_WAIT && t.workers == 4));
        // Every change said why.
        let changes = ticks
            .windows(2)
            .filter(|w| w[0].workers != w[1].workers)
            .count();
        let reasons = ticks.iter().filter(|t| t.why.is_some()).count();
        assert_eq!(changes, reasons);
    }

    #[test]
    fn a_loop_that_slows_down_gives_workers_back() {
        let mut s = sizer(16);
        // Step-bound from window 40 on: 25 units/s, one worker's worth.
        let ticks = simulate(&mut s, &SCENARIO, 1, 120, |w| (w >= 40).then_some(25.0));
        assert_eq!(ticks[39].workers, 4);
        assert_eq!(
            ticks.last().unwrap().workers,
            1,
            "{:?}",
            ticks.iter().map(|t| t.workers).collect::<Vec<_>>()
        );
        assert!(ticks[60..].iter().all(|t| t.wait < GROW_WAIT));
    }

    #[test]
    fn the_pool_stays_within_max_workers_and_the_free_cpus_and_says_so_once() {
        let mut s = sizer(3);
        let ticks = simulate(&mut s, &SCENARIO, 1, 40, |_| None);
        assert!(ticks.iter().all(|t| t.workers <= 3));
        let held: Vec<_> = ticks
            .iter()
            .filter_map(|t| t.why.as_deref())
            .filter(|w| w.contains("max_workers"))
            .collect();
        assert_eq!(held.len(), 1, "{held:?}");
        // 9 free CPUs at 4 per worker: two workers at most.
        let mut s = sizer(16);
        let small = PoolScenario {
            free_cpus: 9.0,
            ..SCENARIO
        };
        let ticks = simulate(&mut s, &small, 1, 40, |_| None);
        assert!(ticks.iter().all(|t| t.workers <= 2), "{ticks:#?}");
        assert!(ticks.iter().any(|t| t
            .why
            .as_deref()
            .is_some_and(|w| w.contains("CPUs and the cluster has"))));
    }

    #[test]
    fn a_node_whose_loop_wants_twice_what_its_cores_decode_gets_one_workers_worth() {
        // The training process decodes 30 units/s, its loop wants 60, a worker adds 30.
        let node = PoolScenario {
            consume: 60.0,
            local: 30.0,
            ..SCENARIO
        };
        let mut s = PoolSizer::new(PoolLimits {
            min_workers: 0,
            max_workers: 16,
            cpus_per_worker: 4.0,
            local: true,
        });
        let ticks = simulate(&mut s, &node, 0, 60, |_| None);
        assert_eq!(ticks.last().unwrap().workers, 1, "{ticks:#?}");
        assert!(ticks[0].wait > 0.4, "alone, the node waits half the time");
        assert!(ticks[20..]
            .iter()
            .all(|t| t.wait < GROW_WAIT && t.consumed >= 59.0));
    }

    #[test]
    fn a_dead_worker_is_replaced_and_limits_are_kept() {
        let mut s = sizer(4);
        let d = s.decide(&PoolObservation {
            workers: 0,
            ..Default::default()
        });
        assert_eq!(d.workers, 1);
        let d = s.decide(&PoolObservation {
            workers: 6,
            ..Default::default()
        });
        assert_eq!(d.workers, 4);
    }

    #[test]
    fn a_starting_worker_holds_the_size() {
        let mut s = sizer(16);
        for _ in 0..5 {
            let d = s.decide(&PoolObservation {
                workers: 2,
                starting: 1,
                wait: 0.9,
                in_flight: 4,
                free_cpus: 64.0,
                ..Default::default()
            });
            assert_eq!(d.workers, 2);
        }
    }
}
