//! A deterministic discrete-event simulator of a pipeline, to run policies on.
//!
//! The model follows the engine: an infinitely fast source; stages with active workers and an
//! item budget counting everything the stage holds (queued, in service, finished but blocked
//! on a full downstream); a sink buffer and a consumer that takes one result per step. CPU
//! stages share `cores` by processor sharing: with `B` busy CPU threads each progresses at
//! `min(1, cores / B)` (an item on `t` threads counts `t`), tracked with a virtual clock so an event costs `O(log n)`. I/O stages
//! wait without using a core. Busy time is wall time in service, as the engine measures it.
//!
//! Every [`Scenario::tick_ms`] the simulator builds an [`Observation`] exactly like the tuner
//! actor does on a real pipeline, asks the policy, and applies its decisions through
//! [`enforce`](crate::enforce) (the same guard the actor uses).

use std::cmp::Reverse;
use std::collections::BinaryHeap;
use std::time::Duration;

use serde::Serialize;

use crate::observation::{Action, Budgets, Decision, Observation, Policy, StageObservation};
use crate::rng::Rng;
use crate::scenario::{Scenario, SimKind};
use crate::StageKind;

/// Events this close together (seconds) are simultaneous.
const EPS: f64 = 1e-12;

/// An item's completion: virtual time (or time, for I/O), stage, and the threads it runs on.
#[derive(Clone, Copy, Debug, PartialEq, PartialOrd)]
struct Key(f64, usize, usize);
impl Eq for Key {}
#[allow(clippy::derive_ord_xor_partial_ord)]
impl Ord for Key {
    fn cmp(&self, o: &Self) -> std::cmp::Ordering {
        self.0
            .total_cmp(&o.0)
            .then(self.1.cmp(&o.1))
            .then(self.2.cmp(&o.2))
    }
}

#[derive(Clone, Debug, Default)]
struct Window {
    items: u64,
    items_out: u64,
    busy: f64,
    blocked_put: f64,
    blocked_get: f64,
}

#[derive(Clone, Debug)]
struct Stage {
    kind: SimKind,
    factor: f64,
    workers: usize,
    max_workers: usize,
    cap: usize,
    cap_bytes: u64,
    bytes: u64,
    queued: usize,
    in_service: usize,
    /// Threads the items in service run on (each CPU item uses `threads` cores).
    busy_threads: usize,
    /// Threads per item for items started from now on, their ceiling, and how much of a
    /// thread each one past the first adds (see [`SimThreads`](crate::scenario::SimThreads)).
    threads: usize,
    max_threads: usize,
    efficiency: f64,
    blocked: usize,
    w: Window,
    /// Lifetime count, sum and sum of squares of sampled costs (for the CV).
    cost_n: f64,
    cost_sum: f64,
    cost_sq: f64,
}

impl Stage {
    fn held(&self) -> usize {
        self.queued + self.in_service + self.blocked
    }

    fn has_room(&self) -> bool {
        let held = self.held();
        held < self.cap && (held == 0 || (held as u64 + 1) * self.bytes <= self.cap_bytes)
    }
}

/// A knob setting for a static run: workers and item budget of each stage, and the sink buffer.
#[derive(Clone, Debug, PartialEq, Eq, Serialize)]
pub struct StaticConfig {
    /// Workers per stage.
    pub workers: Vec<usize>,
    /// Item budget per stage.
    pub budgets: Vec<usize>,
    /// Sink buffer.
    pub sink: usize,
}

/// One tick of a run, for assertions and plots.
#[derive(Clone, Debug, Serialize)]
pub struct TickRecord {
    /// Simulated time, seconds.
    pub t: f64,
    /// Results per second in the tick.
    pub rate: f64,
    /// Fraction of the tick the consumer waited.
    pub wait: f64,
    /// Workers per stage.
    pub workers: Vec<usize>,
    /// Threads per item per stage.
    pub threads: Vec<usize>,
    /// Cores the CPU stages' items in service run on at the tick's end.
    pub busy_threads: usize,
    /// Item budget per stage, then the sink's.
    pub budgets: Vec<usize>,
    /// Bytes held in all buffers.
    pub buffered_bytes: u64,
    /// Bytes the budgets would allow if full.
    pub committed_bytes: u64,
}

/// The result of a run.
#[derive(Clone, Debug, Default, Serialize)]
pub struct Run {
    /// One record per tick.
    pub ticks: Vec<TickRecord>,
    /// Every decision applied, with its time.
    pub decisions: Vec<(f64, Decision)>,
}

impl Run {
    /// Mean results per second over `[from, to)` simulated seconds.
    pub fn rate(&self, from: f64, to: f64) -> f64 {
        let r: Vec<f64> = self
            .ticks
            .iter()
            .filter(|t| t.t > from + EPS && t.t <= to + EPS)
            .map(|t| t.rate)
            .collect();
        r.iter().sum::<f64>() / r.len().max(1) as f64
    }

    /// Direction reversals of stage `i`'s workers within `[from, to)` seconds.
    pub fn reversals(&self, i: usize, from: f64, to: f64) -> usize {
        let mut last_dir = 0i64;
        let mut n = 0;
        for w in self.ticks.windows(2) {
            if w[1].t <= from || w[1].t > to {
                continue;
            }
            let d = (w[1].workers[i] as i64 - w[0].workers[i] as i64).signum();
            if d != 0 {
                if last_dir != 0 && d != last_dir {
                    n += 1;
                }
                last_dir = d;
            }
        }
        n
    }
}

/// The simulator. Build it from a [`Scenario`], then [`run`](Self::run) a policy.
#[derive(Clone, Debug)]
pub struct Simulator {
    sc: Scenario,
    rng: Rng,
    now: f64,
    vclock: f64,
    cpu: BinaryHeap<Reverse<Key>>,
    io: BinaryHeap<Reverse<Key>>,
    stages: Vec<Stage>,
    sink_cap: usize,
    sink_held: usize,
    consumer_step: f64,
    consumer_free_at: f64,
    delivered: u64,
    consumer_wait: f64,
    next_change: usize,
    /// Cores the CPU stages share now (the scenario's, or a node's allotment).
    cores: f64,
    /// The cores the policy is told it may plan with, when not the scenario's.
    planned_cores: Option<usize>,
    /// The consumer takes no result past this count (ranks in lockstep).
    consumer_cap: Option<u64>,
}

impl Simulator {
    /// A cold pipeline: one worker and an item budget of one per stage, a sink buffer of one.
    pub fn new(sc: &Scenario) -> Self {
        let stages = sc
            .stages
            .iter()
            .map(|s| Stage {
                kind: s.kind,
                factor: 1.0,
                workers: 1,
                max_workers: s.max_workers.unwrap_or(match s.kind {
                    SimKind::Cpu => 64,
                    SimKind::Io => 1024,
                }),
                cap: 1,
                cap_bytes: u64::MAX,
                bytes: s.bytes.max(1),
                queued: 0,
                in_service: 0,
                busy_threads: 0,
                threads: 1,
                max_threads: s.threads.map_or(1, |t| t.max.max(1)),
                efficiency: s.threads.map_or(1.0, |t| t.efficiency),
                blocked: 0,
                w: Window::default(),
                cost_n: 0.0,
                cost_sum: 0.0,
                cost_sq: 0.0,
            })
            .collect();
        Self {
            rng: Rng::new(sc.seed),
            now: 0.0,
            vclock: 0.0,
            cpu: BinaryHeap::new(),
            io: BinaryHeap::new(),
            stages,
            sink_cap: 1,
            sink_held: 0,
            consumer_step: sc.consumer_step_ms / 1e3,
            consumer_free_at: 0.0,
            delivered: 0,
            consumer_wait: 0.0,
            next_change: 0,
            cores: sc.cores as f64,
            planned_cores: None,
            consumer_cap: None,
            sc: sc.clone(),
        }
    }

    /// A pipeline with the knobs of `cfg` (for static runs and grid searches).
    pub fn with_config(sc: &Scenario, cfg: &StaticConfig) -> Self {
        let mut s = Self::new(sc);
        for (i, st) in s.stages.iter_mut().enumerate() {
            st.workers = cfg.workers[i].clamp(1, st.max_workers);
            st.cap = cfg.budgets[i].max(1);
        }
        s.sink_cap = cfg.sink.max(1);
        s
    }

    fn budgets(&self) -> Budgets {
        Budgets {
            memory_bytes: self.sc.memory_bytes(),
            cores: self.planned_cores.unwrap_or(self.sc.cores),
        }
    }

    /// CPU threads in service now (each item counts its threads).
    pub fn cpu_busy(&self) -> usize {
        self.stages
            .iter()
            .filter(|s| s.kind == SimKind::Cpu)
            .map(|s| s.busy_threads)
            .sum()
    }

    fn cpu_speed(&self) -> f64 {
        match self.cpu_busy() {
            0 => 1.0,
            b => (self.cores / b as f64).clamp(1e-9, 1.0),
        }
    }

    /// Moves items wherever they can go at the current time.
    fn settle(&mut self) {
        loop {
            let mut moved = false;
            // The consumer takes a result when it is free.
            while self.sink_held > 0
                && self.consumer_free_at <= self.now + EPS
                && self.consumer_cap.is_none_or(|c| self.delivered < c)
            {
                self.sink_held -= 1;
                self.delivered += 1;
                self.consumer_free_at = self.now + self.consumer_step;
                moved = true;
            }
            // Blocked results move downstream, last stage first.
            for i in (0..self.stages.len()).rev() {
                while self.stages[i].blocked > 0 && self.room_after(i) {
                    self.stages[i].blocked -= 1;
                    self.push_after(i);
                    moved = true;
                }
            }
            // The source fills the first stage.
            if let Some(first) = self.stages.first_mut() {
                while first.has_room() {
                    first.queued += 1;
                    moved = true;
                }
            }
            // Idle workers start on queued items.
            for i in 0..self.stages.len() {
                while self.stages[i].queued > 0
                    && self.stages[i].in_service + self.stages[i].blocked < self.stages[i].workers
                {
                    self.start(i);
                    moved = true;
                }
            }
            if !moved {
                break;
            }
        }
    }

    fn room_after(&self, i: usize) -> bool {
        match self.stages.get(i + 1) {
            Some(next) => next.has_room(),
            None => self.sink_held < self.sink_cap,
        }
    }

    fn push_after(&mut self, i: usize) {
        self.stages[i].w.items_out += 1;
        match self.stages.get_mut(i + 1) {
            Some(next) => next.queued += 1,
            None => self.sink_held += 1,
        }
    }

    fn start(&mut self, i: usize) {
        let cost = self.sc.stages[i].cost.sample(&mut self.rng) * self.stages[i].factor;
        let st = &mut self.stages[i];
        st.cost_n += 1.0;
        st.cost_sum += cost;
        st.cost_sq += cost * cost;
        st.queued -= 1;
        st.in_service += 1;
        // `t` threads each progress at the cores' speed; together they do `1 + (t - 1) × e`
        // threads' worth of the item's work.
        let t = st.threads;
        st.busy_threads += t;
        let speedup = 1.0 + (t - 1) as f64 * st.efficiency;
        match st.kind {
            SimKind::Cpu => self
                .cpu
                .push(Reverse(Key(self.vclock + cost / speedup, i, t))),
            SimKind::Io => self.io.push(Reverse(Key(self.now + cost, i, t))),
        }
    }

    fn complete(&mut self, i: usize, threads: usize) {
        self.stages[i].in_service -= 1;
        self.stages[i].busy_threads -= threads;
        self.stages[i].w.items += 1;
        if self.room_after(i) {
            self.push_after(i);
        } else {
            self.stages[i].blocked += 1;
        }
    }

    /// Advances time to `t`, integrating the window counters.
    fn advance(&mut self, t: f64) {
        let dt = t - self.now;
        if dt <= 0.0 {
            return;
        }
        let speed = self.cpu_speed();
        for st in &mut self.stages {
            st.w.busy += st.in_service as f64 * dt;
            st.w.blocked_put += st.blocked as f64 * dt;
            if st.queued == 0 {
                let idle = st.workers.saturating_sub(st.in_service + st.blocked);
                st.w.blocked_get += idle as f64 * dt;
            }
        }
        if self.sink_held == 0 && self.consumer_free_at <= self.now + EPS {
            self.consumer_wait += dt;
        } else if self.sink_held == 0 && self.consumer_free_at < t {
            self.consumer_wait += t - self.consumer_free_at;
        }
        self.vclock += speed * dt;
        self.now = t;
    }

    /// Runs events until simulated time `t_end`.
    fn run_until(&mut self, t_end: f64) {
        loop {
            self.settle();
            let speed = self.cpu_speed();
            let mut next = t_end;
            if let Some(Reverse(Key(v, ..))) = self.cpu.peek() {
                next = next.min(self.now + (v - self.vclock).max(0.0) / speed);
            }
            if let Some(Reverse(Key(t, ..))) = self.io.peek() {
                next = next.min(*t);
            }
            if self.sink_held > 0 && self.consumer_free_at > self.now {
                next = next.min(self.consumer_free_at);
            }
            if let Some(c) = self.sc.changes.get(self.next_change) {
                next = next.min(c.at_s.max(self.now));
            }
            self.advance(next);
            while let Some(c) = self.sc.changes.get(self.next_change) {
                if c.at_s > self.now + EPS {
                    break;
                }
                self.apply_change(self.next_change);
                self.next_change += 1;
            }
            while let Some(&Reverse(Key(v, i, n))) = self.cpu.peek() {
                if v > self.vclock + 1e-9 {
                    break;
                }
                self.cpu.pop();
                self.complete(i, n);
            }
            while let Some(&Reverse(Key(t, i, n))) = self.io.peek() {
                if t > self.now + EPS {
                    break;
                }
                self.io.pop();
                self.complete(i, n);
            }
            if self.now >= t_end - EPS {
                self.settle();
                return;
            }
        }
    }

    fn apply_change(&mut self, k: usize) {
        let c = self.sc.changes[k].clone();
        if let (Some(name), Some(f)) = (&c.stage, c.cost_factor) {
            if let Some(i) = self.sc.stages.iter().position(|s| &s.name == name) {
                self.stages[i].factor *= f;
            }
        }
        if let Some(f) = c.consumer_factor {
            self.consumer_step *= f;
        }
    }

    /// The worker tokens the CPU stages' extra workers (beyond one each) leave, if the
    /// scenario caps them; `except`: a stage whose own extras count as free.
    fn spare_tokens(&self, except: Option<usize>) -> Option<usize> {
        self.sc.extra_workers.map(|cap| {
            let used: usize = self
                .stages
                .iter()
                .enumerate()
                .filter(|(i, s)| Some(*i) != except && s.kind == SimKind::Cpu)
                .map(|(_, s)| s.workers.saturating_sub(1))
                .sum();
            cap.saturating_sub(used)
        })
    }

    /// The observation of the window that just ended, and resets the window.
    fn observe(&mut self, window: f64, delivered: u64) -> Observation {
        let spare = self.spare_tokens(None);
        let mut stages: Vec<StageObservation> = self
            .stages
            .iter_mut()
            .zip(&self.sc.stages)
            .map(|(st, spec)| {
                let w = std::mem::take(&mut st.w);
                StageObservation {
                    name: spec.name.clone(),
                    kind: Some(match st.kind {
                        SimKind::Cpu => StageKind::Pool,
                        SimKind::Io => StageKind::Async,
                    }),
                    workers: st.workers,
                    max_workers: match (st.kind, spare) {
                        (SimKind::Cpu, Some(spare)) => st.max_workers.min(st.workers + spare),
                        _ => st.max_workers,
                    },
                    workers_pinned: false,
                    budget_pinned: false,
                    items: w.items,
                    items_out: w.items_out,
                    busy: secs(w.busy),
                    blocked_put: secs(w.blocked_put),
                    blocked_get: secs(w.blocked_get),
                    queue_items: st.held(),
                    queue_bytes: st.held() as u64 * st.bytes,
                    budget_items: st.cap,
                    budget_bytes: st.cap_bytes,
                    item_bytes: st.bytes,
                    cost_cv: cv(st.cost_n, st.cost_sum, st.cost_sq),
                    cache: None,
                    read_ahead: None,
                    item_threads: (st.max_threads > 1).then_some(crate::ItemThreadsStats {
                        threads: st.threads,
                        max_threads: st.max_threads,
                        pinned: false,
                    }),
                }
            })
            .collect();
        let last_bytes = self.stages.last().map_or(1, |s| s.bytes);
        let wait = std::mem::take(&mut self.consumer_wait);
        stages.push(StageObservation {
            name: "sink".into(),
            kind: Some(StageKind::Sink),
            workers: 1,
            max_workers: 1,
            workers_pinned: true,
            items: delivered,
            items_out: delivered,
            blocked_get: secs(wait),
            queue_items: self.sink_held,
            queue_bytes: self.sink_held as u64 * last_bytes,
            budget_items: self.sink_cap,
            budget_bytes: u64::MAX,
            item_bytes: last_bytes,
            ..StageObservation::default()
        });
        Observation {
            now: secs(self.now),
            window: secs(window),
            buffered_bytes: stages.iter().map(|s| s.queue_bytes).sum(),
            stages,
            delivered,
            consumer_wait: secs(wait),
            gpu_util: None,
            rss_bytes: None,
            epoch: None,
            budgets: Some(self.budgets()),
        }
    }

    fn apply(&mut self, a: &Action) {
        match *a {
            Action::SetWorkers { stage, workers } => {
                // Extra CPU workers take tokens in the order asked, as the engine grants
                // them: what the stages before took is not there for the next.
                let spare = self.spare_tokens(Some(stage));
                if let Some(st) = self.stages.get_mut(stage) {
                    let most = match (st.kind, spare) {
                        (SimKind::Cpu, Some(spare)) => st.max_workers.min(1 + spare),
                        _ => st.max_workers,
                    };
                    st.workers = workers.clamp(1, most.max(1));
                }
            }
            Action::SetPrefetch {
                stage,
                items,
                bytes,
            } => {
                if let Some(st) = self.stages.get_mut(stage) {
                    st.cap = items.max(1);
                    st.cap_bytes = bytes.max(1);
                } else if stage == self.stages.len() {
                    self.sink_cap = items.max(1);
                }
            }
            Action::SetItemThreads { stage, threads } => {
                if let Some(st) = self.stages.get_mut(stage) {
                    st.threads = threads.clamp(1, st.max_threads);
                }
            }
            Action::SetCacheBytes { .. } | Action::SetReadAhead { .. } => {}
        }
    }

    fn committed_bytes(&self) -> u64 {
        let last = self.stages.last().map_or(1, |s| s.bytes);
        self.stages
            .iter()
            .map(|s| s.cap as u64 * s.bytes)
            .sum::<u64>()
            + self.sink_cap as u64 * last
    }

    /// Gives the CPU stages `cores` from now on (a share of a node: fractions allowed) and
    /// tells the policy it may plan with `planned` cores.
    pub fn set_cores(&mut self, cores: f64, planned: usize) {
        self.cores = cores.max(0.0);
        self.planned_cores = Some(planned.max(1));
    }

    /// Lets the consumer take results only up to `cap` in all (`None`: no limit).
    pub fn set_consumer_cap(&mut self, cap: Option<u64>) {
        self.consumer_cap = cap;
    }

    /// Results the consumer took so far.
    pub fn delivered(&self) -> u64 {
        self.delivered
    }

    /// Simulated seconds so far.
    pub fn now(&self) -> f64 {
        self.now
    }

    /// Runs `policy` for `seconds` simulated seconds.
    pub fn run(&mut self, policy: &mut dyn Policy, seconds: f64) -> Run {
        let mut run = Run::default();
        let end = self.now + seconds;
        while self.now < end - EPS {
            self.tick(policy, end, &mut run);
        }
        run
    }

    /// Runs one tick of `policy` (or up to `end`, if sooner), recording it in `run`.
    pub fn tick(&mut self, policy: &mut dyn Policy, end: f64, run: &mut Run) {
        let tick = self.sc.tick_ms / 1e3;
        {
            let delivered_before = self.delivered;
            let t = (self.now + tick).min(end);
            self.run_until(t);
            let obs = self.observe(tick, self.delivered - delivered_before);
            run.ticks.push(TickRecord {
                t,
                rate: obs.rate(),
                wait: obs.wait_fraction(),
                workers: self.stages.iter().map(|s| s.workers).collect(),
                threads: self.stages.iter().map(|s| s.threads).collect(),
                busy_threads: self.cpu_busy(),
                budgets: self
                    .stages
                    .iter()
                    .map(|s| s.cap)
                    .chain([self.sink_cap])
                    .collect(),
                buffered_bytes: obs.buffered_bytes,
                committed_bytes: self.committed_bytes(),
            });
            let decisions = crate::enforce(policy.decide(&obs), &obs);
            for d in decisions {
                self.apply(&d.action);
                run.decisions.push((t, d));
            }
        }
    }
}

fn cv(n: f64, sum: f64, sq: f64) -> f64 {
    if n < 2.0 || sum <= 0.0 {
        return 0.0;
    }
    let mean = sum / n;
    let var = (sq / n - mean * mean).max(0.0);
    var.sqrt() / mean
}

fn secs(s: f64) -> Duration {
    Duration::from_secs_f64(s.max(0.0))
}

/// Grid-searches static configurations and returns the best one and its steady throughput
/// (measured over `[warmup, warmup + measure)` seconds of a run).
pub fn best_static(
    sc: &Scenario,
    grid: &[StaticConfig],
    warmup: f64,
    measure: f64,
) -> (StaticConfig, f64) {
    grid.iter()
        .map(|cfg| {
            let mut sim = Simulator::with_config(sc, cfg);
            let run = sim.run(&mut crate::policy::Static, warmup + measure);
            (cfg.clone(), run.rate(warmup, warmup + measure))
        })
        .max_by(|a, b| a.1.total_cmp(&b.1))
        .expect("a non-empty grid")
}
