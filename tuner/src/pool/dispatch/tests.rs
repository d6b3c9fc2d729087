//! The dispatcher against simulated workers: each decodes its units one after another at its
//! own speed, may take a while to start, may die (mid-epoch, or at its start), and answers
//! nothing once killed. A training loop takes units in plan order, one step after another.

use std::collections::{BTreeMap, VecDeque};

use super::*;

/// A simulated worker.
#[derive(Clone, Debug)]
struct Sim {
    /// When it answers (its start); `f64::INFINITY`: never.
    ready_at: f64,
    /// Seconds a unit takes.
    per_unit: f64,
    /// When it dies (all it holds is lost).
    dies_at: Option<f64>,
    /// A unit whose decoding kills it, half way through.
    dies_on: Option<usize>,
    /// Units issued and not taken or cancelled: (unit, when decoded).
    queue: VecDeque<(usize, f64)>,
    free_at: f64,
}

impl Sim {
    fn new(ready_at: f64, per_unit: f64, dies_at: Option<f64>) -> Self {
        Self {
            ready_at,
            per_unit,
            dies_at,
            dies_on: None,
            queue: VecDeque::new(),
            free_at: 0.0,
        }
    }

    fn dying_on(self, unit: usize) -> Self {
        Self {
            dies_on: Some(unit),
            ..self
        }
    }
}

/// A run: the dispatcher, its workers, and the loop's clock.
struct Run {
    d: Dispatcher,
    now: f64,
    workers: BTreeMap<WorkerId, Sim>,
    spawn: Box<dyn FnMut(WorkerId, f64) -> Sim>,
    /// Units the loop took, in order.
    taken: Vec<usize>,
    /// Most units issued ahead of the loop at once.
    most_ahead: usize,
    kills: Vec<WorkerId>,
}

const SLICE: f64 = 0.05;

impl Run {
    fn new(
        settings: DispatchSettings,
        local_per_unit: f64,
        spawn: impl FnMut(WorkerId, f64) -> Sim + 'static,
    ) -> Self {
        let (d, out) = Dispatcher::new(settings, 0.0);
        let mut run = Self {
            d,
            now: 0.0,
            workers: BTreeMap::new(),
            spawn: Box::new(spawn),
            taken: Vec::new(),
            most_ahead: 0,
            kills: Vec::new(),
        };
        if settings.local {
            run.workers
                .insert(LOCAL, Sim::new(0.0, local_per_unit, None));
        }
        run.apply(out);
        run
    }

    fn apply(&mut self, commands: Vec<Command>) {
        for c in commands {
            match c {
                Command::Start(id) => {
                    let sim = (self.spawn)(id, self.now);
                    assert!(self.workers.insert(id, sim).is_none(), "{id} started twice");
                }
                Command::Issue { worker, unit } => {
                    let w = self
                        .workers
                        .get_mut(&worker)
                        .expect("issued to a live worker");
                    assert!(
                        w.ready_at <= self.now,
                        "issued to {worker} before it answered"
                    );
                    let start = self.now.max(w.free_at);
                    w.free_at = start + w.per_unit;
                    if w.dies_on == Some(unit) {
                        let dies = start + w.per_unit / 2.0;
                        w.dies_at = Some(w.dies_at.map_or(dies, |t| t.min(dies)));
                    }
                    w.queue.push_back((unit, w.free_at));
                }
                Command::Cancel { worker, unit } => {
                    let w = self
                        .workers
                        .get_mut(&worker)
                        .expect("cancelled on a worker");
                    w.queue.retain(|&(u, _)| u != unit);
                }
                Command::Kill(id) => {
                    let w = self.workers.remove(&id).expect("killed a live worker");
                    assert!(w.queue.is_empty(), "{id} killed with {:?} in hand", w.queue);
                    self.kills.push(id);
                }
            }
        }
        if let Some(at) = self.d.next_unit() {
            let ahead = self.d.in_hand().iter().filter(|&&(_, u)| u >= at).count();
            self.most_ahead = self.most_ahead.max(ahead);
        }
    }

    /// Workers that answered or died by now, as the caller's poll finds them.
    fn poll(&mut self) -> Result<(), DispatchError> {
        let ids: Vec<WorkerId> = self
            .workers
            .keys()
            .copied()
            .filter(|&i| i != LOCAL)
            .collect();
        for id in ids {
            let w = &self.workers[&id];
            if w.dies_at.is_some_and(|t| t <= self.now) {
                self.workers.remove(&id);
                let out = self
                    .d
                    .died(id, "Traceback\nRayActorError: it died", self.now)?;
                self.apply(out);
            } else if w.ready_at <= self.now {
                self.d.ready(id);
            }
        }
        Ok(())
    }

    fn window(&mut self, free_cpus: f64) {
        if self.d.window_due(self.now) {
            let decoded = self
                .d
                .in_hand()
                .iter()
                .filter(|(w, u)| {
                    self.workers[w]
                        .queue
                        .iter()
                        .any(|&(q, t)| q == *u && t <= self.now)
                })
                .count();
            let out = self.d.resize(self.now, decoded, free_cpus);
            self.apply(out);
        }
    }

    /// One epoch of `units`, the loop taking a unit every `step(i)` seconds after the last.
    fn epoch(
        &mut self,
        units: usize,
        step: impl Fn(usize) -> f64,
        free_cpus: f64,
    ) -> Result<(), DispatchError> {
        let (_, out) = self.d.begin(units);
        self.apply(out);
        while let Some(unit) = self.d.next_unit() {
            self.poll()?;
            let out = self.d.fill();
            self.apply(out);
            self.d.waiting(self.now);
            let arrived = self.d.holder(unit).and_then(|w| {
                let (_, t) = *self.workers[&w].queue.iter().find(|q| q.0 == unit)?;
                (t <= self.now).then_some(w)
            });
            match arrived {
                Some(w) => {
                    let per_unit = self.workers[&w].per_unit;
                    self.workers
                        .get_mut(&w)
                        .unwrap()
                        .queue
                        .retain(|q| q.0 != unit);
                    let out = self.d.done(unit, per_unit, self.now)?;
                    self.apply(out);
                    self.taken.push(unit);
                    self.now += step(self.taken.len());
                }
                None => self.now += SLICE,
            }
            self.window(free_cpus);
            if self.now > 10_000.0 {
                panic!("the epoch never ended: {:#?}", self.d);
            }
        }
        Ok(())
    }
}

fn pinned(n: usize, local: bool) -> DispatchSettings {
    DispatchSettings::new(PoolSize::Pinned(n), local)
}

#[test]
fn units_go_in_plan_order_to_the_least_busy_within_the_window() {
    let (mut d, out) = Dispatcher::new(pinned(2, true), 0.0);
    assert_eq!(out, vec![Command::Start(1), Command::Start(2)]);
    // Nothing before the epoch, and only the local decoder before the actors answer.
    assert!(d.fill().is_empty());
    d.begin(100);
    let first = d.fill();
    assert_eq!(
        first,
        vec![
            Command::Issue {
                worker: LOCAL,
                unit: 0
            },
            Command::Issue {
                worker: LOCAL,
                unit: 1
            }
        ]
    );
    d.ready(1);
    d.ready(2);
    let out = d.fill();
    // Two per hand ahead of the loop: 6 in all, 1 and 2 filled first (they hold fewest).
    let issued: Vec<_> = out
        .iter()
        .map(|c| match c {
            Command::Issue { worker, unit } => (*worker, *unit),
            other => panic!("{other:?}"),
        })
        .collect();
    assert_eq!(issued, vec![(1, 2), (2, 3), (1, 4), (2, 5)]);
    assert!(d.fill().is_empty(), "the window is full");
    assert_eq!(d.holder(0), Some(LOCAL));
    d.done(0, 0.1, 1.0).unwrap();
    // The loop took one: one more may go out.
    assert_eq!(
        d.fill(),
        vec![Command::Issue {
            worker: LOCAL,
            unit: 6
        }]
    );
    // Only the next unit may arrive.
    assert_eq!(d.done(3, 0.1, 1.0), Err(DispatchError::NotInHand(3)));
}

#[test]
fn every_unit_arrives_once_in_order_when_workers_die_mid_epoch() {
    for local in [false, true] {
        // Worker 2 dies at 1.3 s with units in hand; worker 3 at 4 s; replacements live.
        let mut run = Run::new(pinned(3, local), 0.15, |id, now| {
            let dies = match id {
                2 => Some(1.3),
                3 => Some(2.5),
                _ => None,
            };
            Sim::new(now + 0.5, 0.2, dies)
        });
        run.epoch(57, |_| 0.01, 64.0).unwrap();
        assert_eq!(run.taken, (0..57).collect::<Vec<_>>(), "local={local}");
        assert!(run.d.reissued() >= 2, "{}", run.d.reissued());
        // Two replacements: the pool kept its size.
        assert_eq!(run.d.started(), 5);
        assert_eq!(run.d.workers(), 3);
        let deaths: Vec<_> = run
            .d
            .trace()
            .iter()
            .flat_map(|r| r.decisions.iter())
            .filter(|d| d.contains("died with"))
            .collect();
        assert_eq!(deaths.len(), 2, "{deaths:?}");
        assert!(deaths[0].starts_with("worker 2 died with "), "{deaths:?}");
        // Never more ahead of the loop than the window of the hands, plus units reissued.
        let hands = 3 + usize::from(local);
        assert!(
            run.most_ahead <= WINDOW_PER_WORKER * hands + run.d.reissued() as usize,
            "{} ahead",
            run.most_ahead
        );
        assert_eq!(
            run.d.units_by_workers() + run.d.units_local(),
            57,
            "each unit counted once"
        );
        // The next epoch runs on the survivors and replacements.
        run.epoch(10, |_| 0.01, 64.0).unwrap();
        assert_eq!(run.taken.len(), 67);
    }
}

#[test]
fn workers_that_die_before_a_unit_three_times_in_a_row_are_an_error() {
    let mut run = Run::new(pinned(1, false), 0.0, |_, now| {
        Sim::new(now + 0.2, 0.1, Some(now + 0.1))
    });
    let e = run.epoch(5, |_| 0.0, 64.0).unwrap_err();
    assert_eq!(
        e,
        DispatchError::StartupDeaths {
            deaths: STARTUP_DEATHS,
            last: "RayActorError: it died".into()
        }
    );
    assert!(e
        .to_string()
        .contains("3 workers in a row died before they answered"));
    // A worker that answers in between resets the count, though it dies too.
    let mut run = Run::new(pinned(1, false), 0.0, |id, now| match id {
        1 | 2 | 4 | 5 => Sim::new(now + 0.2, 0.1, Some(now + 0.1)),
        3 => Sim::new(now + 0.05, 0.1, Some(now + 1.0)),
        _ => Sim::new(now + 0.05, 0.1, None),
    });
    run.epoch(40, |_| 0.01, 64.0).unwrap();
    assert_eq!(run.taken, (0..40).collect::<Vec<_>>());
    assert_eq!(run.d.started(), 6);
}

#[test]
fn working_workers_killed_together_before_finishing_a_unit_are_replaced_not_an_error() {
    // Four slow workers answer, take units, and are all killed at 0.5 s (an operator, the
    // cluster reclaiming nodes) before any finishes one; so are the next four. Neither is a
    // broken configuration: the units are issued again and the epoch ends in order.
    let mut run = Run::new(pinned(4, false), 0.0, |id, now| {
        let dies = (id <= 8).then_some(now + 0.5);
        Sim::new(now + 0.05, 1.0, dies)
    });
    run.epoch(24, |_| 0.01, 64.0).unwrap();
    assert_eq!(run.taken, (0..24).collect::<Vec<_>>());
    assert_eq!(run.d.started(), 12);
}

#[test]
fn deaths_reported_one_by_one_blame_only_the_unit_each_worker_was_decoding() {
    // Three workers killed together, each holding one unit; their caller learns of the
    // deaths one at a time, and in between the dispatcher issues the lost units again to
    // the workers it still takes for alive. Those deaths are not the units' doing.
    let (mut d, _) = Dispatcher::new(pinned(3, false), 0.0);
    for w in 1..=3 {
        d.ready(w);
    }
    d.begin(30);
    d.fill();
    for unit in 0..3 {
        d.done(unit, 0.1, 1.0).unwrap();
    }
    assert_eq!(d.in_hand(), vec![(1, 3), (2, 4), (3, 5)]);
    for w in 1..=3 {
        d.died(w, "RayActorError: killed", 2.0).unwrap();
        d.fill();
    }
    // The new workers take every lost unit, the loop's next first.
    for w in 4..=6 {
        d.ready(w);
    }
    d.fill();
    let mut held: Vec<usize> = d.in_hand().iter().map(|&(_, u)| u).collect();
    held.sort_unstable();
    assert_eq!(&held[..3], &[3, 4, 5]);
    assert_eq!(d.holder(3).map(|w| w >= 4), Some(true));
}

#[test]
fn a_unit_that_kills_each_worker_decoding_it_is_an_error_naming_it() {
    let mut run = Run::new(pinned(2, false), 0.0, |_, now| {
        Sim::new(now + 0.05, 0.1, None).dying_on(7)
    });
    let e = run.epoch(30, |_| 0.01, 64.0).unwrap_err();
    let DispatchError::UnitDeaths { unit, deaths, last } = &e else {
        panic!("{e:?}");
    };
    assert_eq!((*unit, *deaths), (7, UNIT_DEATHS));
    assert_eq!(last, "RayActorError: it died");
    assert!(e.to_string().contains("3 workers died decoding unit 7"));
    assert_eq!(
        run.taken,
        (0..7).collect::<Vec<_>>(),
        "the units before it arrived"
    );
    // The error left the pool a worker short; the next epoch starts with its size again.
    assert_eq!(run.d.workers(), 1);
    run.taken.clear();
    run.epoch(5, |_| 0.01, 64.0).unwrap();
    assert_eq!(run.taken, (0..5).collect::<Vec<_>>());
    assert_eq!(run.d.workers(), 2);
}

#[test]
fn a_new_epoch_cancels_the_last_ones_units() {
    let mut run = Run::new(pinned(2, true), 0.1, |_, now| Sim::new(now, 0.3, None));
    run.poll().unwrap();
    let (first, _) = run.d.begin(20);
    let out = run.d.fill();
    run.apply(out);
    let held = run.d.in_hand();
    assert_eq!(held.len(), 6);
    let (second, out) = run.d.begin(8);
    assert_ne!(first, second);
    assert_eq!(run.d.token(), second);
    let cancels: Vec<_> = out
        .iter()
        .filter_map(|c| match c {
            Command::Cancel { worker, unit } => Some((*worker, *unit)),
            _ => None,
        })
        .collect();
    let mut want = held.clone();
    want.sort();
    let mut got = cancels.clone();
    got.sort();
    assert_eq!(got, want, "every unit in hand cancelled, none else");
    run.apply(out);
    assert!(run.workers.values().all(|w| w.queue.is_empty()));
    assert!(run.d.in_hand().is_empty());
    // The new epoch starts at its unit 0; an abandoned one issues nothing.
    assert_eq!(run.d.next_unit(), Some(0));
    run.d.abandon();
    assert_eq!(run.d.token(), 0);
    assert!(run.d.fill().is_empty());
    assert_eq!(run.d.next_unit(), None);
}

#[test]
fn a_sized_pool_grows_while_the_loop_waits_and_gives_workers_back_when_it_slows() {
    let limits = PoolLimits {
        min_workers: 1,
        max_workers: 8,
        cpus_per_worker: 2.0,
        local: false,
    };
    // A worker decodes 5 units/s; the loop wants 20, then (after unit 400) 2.
    let mut run = Run::new(
        DispatchSettings::new(PoolSize::Auto(limits), false),
        0.0,
        |_, now| Sim::new(now + 0.3, 0.2, None),
    );
    run.epoch(900, |i| if i < 400 { 0.05 } else { 0.5 }, 64.0)
        .unwrap();
    assert_eq!(run.taken, (0..900).collect::<Vec<_>>());
    let sizes: Vec<usize> = run.d.trace().iter().map(|r| r.workers).collect();
    let most = *sizes.iter().max().unwrap();
    assert!((4..=6).contains(&most), "{sizes:?}");
    let decisions: Vec<&String> = run
        .d
        .trace()
        .iter()
        .flat_map(|r| r.decisions.iter())
        .collect();
    assert!(
        decisions[0].starts_with("RemoteWorkers(1 -> 2): "),
        "{decisions:?}"
    );
    // Given back: fewer at the end, each retired worker stopped once its units were taken
    // (the simulation checks it held none when killed).
    assert!(*sizes.last().unwrap() <= 2, "{sizes:?}");
    assert!(!run.kills.is_empty());
    // Windows saw the wait as a fraction.
    assert!(run
        .d
        .trace()
        .iter()
        .filter_map(|r| r.window)
        .all(|w| (0.0..=1.0).contains(&w.wait)));
}

#[test]
fn a_sized_pool_within_no_free_cpus_never_grows_and_a_dead_worker_keeps_the_floor() {
    let limits = PoolLimits {
        min_workers: 1,
        max_workers: 8,
        cpus_per_worker: 4.0,
        local: false,
    };
    let mut run = Run::new(
        DispatchSettings::new(PoolSize::Auto(limits), false),
        0.0,
        |id, now| Sim::new(now + 0.2, 0.2, (id == 1).then_some(3.0)),
    );
    run.epoch(60, |_| 0.01, 0.0).unwrap();
    assert_eq!(run.taken, (0..60).collect::<Vec<_>>());
    assert!(run.d.trace().iter().all(|r| r.workers <= 1));
    assert_eq!(
        run.d.started(),
        2,
        "the dead one replaced to keep the floor"
    );
}

#[test]
fn with_no_worker_the_loop_is_told_after_the_start_timeout() {
    let mut settings = pinned(2, false);
    settings.start_timeout = 5.0;
    let (mut d, _) = Dispatcher::new(settings, 100.0);
    d.begin(4);
    d.waiting(100.0);
    assert_eq!(d.stalled(104.0), None);
    assert_eq!(d.stalled(105.5), Some(5.5));
    // One answers: the wait is over, and a later lack of hands counts from then.
    d.ready(1);
    assert_eq!(d.stalled(106.0), None);
    assert_eq!(d.fill().len(), 2);
    let out = d.died(1, "gone", 107.0).unwrap();
    assert_eq!(out, vec![Command::Start(3)]);
    assert_eq!(d.stalled(108.0), None);
    assert_eq!(d.stalled(112.5), Some(5.5));
    // The local decoder is always a hand.
    let (mut d, _) = Dispatcher::new(pinned(0, true), 0.0);
    d.begin(1);
    assert_eq!(d.stalled(1000.0), None);
}
