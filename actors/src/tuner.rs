//! The tuner actor: every tick, observe the stages, ask the policy, apply its decisions.
//!
//! # The loop
//!
//! Each tick (100 ms by default) the actor snapshots every stage (source excluded, the sink
//! last), turns the difference from the previous snapshots into an
//! [`Observation`](flowgate_tuner::Observation) — the same type the simulator builds — runs
//! the [`Policy`], passes its decisions through [`enforce`] (pinned knobs untouched, workers
//! within limits, committed buffer bytes within the memory budget) and sends them to the stage
//! actors as [`Resize`] and [`SetBudget`] messages. It samples the process's RSS, and records
//! the tick (signals, decisions and their reasons) as one JSON line in the trace file, if one
//! is set, and in the in-memory [`TraceLog`].

use std::io::Write;
use std::path::PathBuf;
use std::sync::Arc;
use std::time::{Duration, Instant};

use actix::prelude::*;
use flowgate_tuner::policy::{HillClimb, ModelBased, ModelSettings, Park, Static};
use flowgate_tuner::{enforce, Action, Budgets, Decision, Observation, Policy, StageKind};
use flowgate_tuner::{CacheStats, StageObservation, StageStats};
use parking_lot::Mutex;
use serde::{Deserialize, Serialize};

use crate::actor::{Resize, SetBudget, SetCacheBytes, SetItemThreads, SetReadAhead, StageActor};
use crate::cap;
use crate::stage::StageControl;

/// How often the tuner looks, by default. Fast enough to converge within seconds; slow enough
/// that a tick sees hundreds of items of a typical loader and that the tuner costs nothing.
pub const DEFAULT_TICK: Duration = Duration::from_millis(100);
/// Ticks kept in the in-memory trace (about 28 minutes at the default tick).
pub const TRACE_CAPACITY: usize = 16_384;

/// The shipped policies, by name.
#[derive(Clone, Copy, Debug, Default, PartialEq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case", tag = "name", deny_unknown_fields)]
pub enum PolicyChoice {
    /// [`ModelBased`] (the default).
    #[default]
    Model,
    /// [`HillClimb`].
    HillClimb,
    /// [`Static`]: observe and trace, change nothing.
    Static,
}

/// Settings of the tuner. Every field has a default.
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct TunerSettings {
    /// Time between ticks; default [`DEFAULT_TICK`]. 10 ms..=10 s is sensible; 1 ms..=1 h
    /// is allowed ([`crate::limits::TICK_MS`], checked when the pipeline is built).
    #[serde(default, with = "opt_millis")]
    pub tick: Option<Duration>,
    /// The policy; default the model-based one.
    #[serde(default)]
    pub policy: PolicyChoice,
    /// Settings of the model-based policy.
    #[serde(default)]
    pub model: ModelSettings,
    /// Bytes all buffers together may hold; default half of the available memory.
    #[serde(default)]
    pub memory_bytes: Option<u64>,
    /// Cores the CPU stages may use; default the number of cores.
    #[serde(default)]
    pub cores: Option<usize>,
    /// A CPU budget shared by the ranks of the node (see [`crate::node`]); none by default
    /// (each process within its share of the node's cores).
    #[serde(default)]
    pub cpu_budget: Option<crate::node::CpuBudget>,
    /// Where to write the decision trace (JSON lines); none by default.
    #[serde(default)]
    pub trace: Option<PathBuf>,
}

impl TunerSettings {
    /// Checks the numbers against [`crate::limits`], in the words every front end uses
    /// (`tick_ms: must be in 1..=3600000, not 0`).
    pub fn check(&self) -> Result<(), crate::limits::OutOfRange> {
        if let Some(t) = self.tick {
            crate::limits::TICK_MS.check(t.as_millis() as i128)?;
        }
        Ok(())
    }
}

mod opt_millis {
    use std::time::Duration;

    use serde::{Deserialize, Deserializer, Serialize, Serializer};

    pub(super) fn serialize<S: Serializer>(d: &Option<Duration>, s: S) -> Result<S::Ok, S::Error> {
        d.map(|d| d.as_millis() as u64).serialize(s)
    }

    pub(super) fn deserialize<'de, D: Deserializer<'de>>(
        d: D,
    ) -> Result<Option<Duration>, D::Error> {
        Ok(Option::<u64>::deserialize(d)?.map(Duration::from_millis))
    }
}

impl TunerSettings {
    /// The policy these settings name.
    pub fn make_policy(&self) -> Box<dyn Policy> {
        match self.policy {
            PolicyChoice::Model => Box::new(Park::new(ModelBased::new(self.model))),
            PolicyChoice::HillClimb => Box::new(Park::new(HillClimb::default())),
            PolicyChoice::Static => Box::new(Static),
        }
    }

    /// The budgets: the settings' or the machine's.
    pub fn budgets(&self) -> Budgets {
        let detected = Budgets::detect();
        Budgets {
            memory_bytes: self.memory_bytes.unwrap_or(detected.memory_bytes),
            cores: self.cores.unwrap_or(detected.cores),
        }
    }
}

/// One tick of the tuner, as traced.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct TraceRecord {
    /// Seconds since the tuner started.
    pub t: f64,
    /// Results per second delivered in the tick.
    pub rate: f64,
    /// Fraction of the tick the consumer waited.
    pub wait: f64,
    /// Stage names (source excluded, sink last).
    pub stages: Vec<String>,
    /// Workers per stage.
    pub workers: Vec<usize>,
    /// Item budget per stage.
    pub budgets: Vec<usize>,
    /// Items held per stage.
    pub queued: Vec<usize>,
    /// Bytes held in all buffers.
    pub buffered_bytes: u64,
    /// The memory budget.
    pub memory_budget: u64,
    /// Resident memory of the process.
    pub rss_bytes: Option<u64>,
    /// Accelerator utilisation (0..=1), when a sampler was given.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub gpu_util: Option<f64>,
    /// The pipeline's epoch at the tick, when the tuner was told it (a pipeline's tuner is).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub epoch: Option<u64>,
    /// This rank's use of the node's CPU budget, on one (see [`crate::node`]).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub cpu: Option<CpuShare>,
    /// What the policy decided, and why.
    pub decisions: Vec<Decision>,
}

/// A rank's use of the node's shared CPU budget at one tick.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct CpuShare {
    /// The node's budget, cores.
    pub budget: usize,
    /// Cores held by every rank on the node at the tick.
    pub node_busy: usize,
    /// Cores this rank's workers held at the tick.
    pub held: usize,
    /// Cores this rank used on average over the tick (core-seconds per second).
    pub share: f64,
    /// Worker-seconds per second this rank's workers waited for a core.
    pub waited: f64,
    /// Why the share moved, when it moved by half a core or more (1-s averages).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub why: Option<String>,
}

/// Follows a rank's share of the node's CPU budget from tick to tick.
#[derive(Debug, Default)]
struct ShareWatch {
    /// Whether the pipeline is on the budget (its pool stages hold its cores).
    budgeted: bool,
    /// The counters at the last tick, and when they were read: a share is over the time
    /// between two reads (over the stats' window, a read the tuner's thread made late counted
    /// more time held than the window had: 1.35 cores of a 1-core budget on a loaded machine).
    prev: Option<(crate::node::ProcessCores, Instant)>,
    /// The last second of shares and of the consumer's wait fractions.
    recent: std::collections::VecDeque<(f64, f64)>,
    /// The share last explained (`None` until a first second is averaged).
    noted: Option<f64>,
    /// Cores the other ranks hold, a moving average of the ticks' counts.
    others: Option<f64>,
}

impl ShareWatch {
    /// The cores the other ranks on the node leave this one (their holds, averaged over the
    /// last second or so), rounded up: the pool workers worth running here. `None` off a
    /// node budget.
    fn room(&mut self) -> Option<usize> {
        let node = crate::node::current().filter(|_| self.budgeted)?;
        let others = node
            .in_use()
            .saturating_sub(crate::node::process_cores().held) as f64;
        self.others = match self.others {
            Some(avg) => Some(avg + 0.2 * (others - avg)),
            None => Some(others),
        };
        let free = node.cores() as f64 - self.others.unwrap_or(0.0);
        Some((free - 0.05).ceil().max(1.0) as usize)
    }

    fn tick(&mut self, window: Duration, consumer_wait: f64) -> Option<CpuShare> {
        let node = crate::node::current().filter(|_| self.budgeted)?;
        let (now, at) = (crate::node::process_cores(), Instant::now());
        // The first tick is its own baseline: the process's earlier pipelines held cores too.
        let (prev, then) = self.prev.replace((now, at)).unwrap_or((now, at));
        let secs = match at.duration_since(then) {
            d if d.is_zero() => window,
            d => d,
        }
        .as_secs_f64()
        .max(1e-9);
        let share = now.held_ns.saturating_sub(prev.held_ns) as f64 / 1e9 / secs;
        let waited = now.wait_ns.saturating_sub(prev.wait_ns) as f64 / 1e9 / secs;
        let ticks = (Duration::from_secs(1).as_secs_f64() / secs)
            .ceil()
            .max(1.0) as usize;
        self.recent.push_back((share, consumer_wait));
        while self.recent.len() > ticks {
            self.recent.pop_front();
        }
        let n = self.recent.len() as f64;
        let avg = self.recent.iter().map(|r| r.0).sum::<f64>() / n;
        let consumer_wait = self.recent.iter().map(|r| r.1).sum::<f64>() / n;
        let (budget, node_busy) = (node.cores(), node.in_use());
        let noted = match self.noted {
            Some(n) => n,
            None => {
                if self.recent.len() == ticks {
                    self.noted = Some(avg); // the start: nothing moved yet
                }
                avg
            }
        };
        let why = if avg >= noted + 0.5 {
            Some(format!(
                "took {avg:.1} of the node's {budget} cores (from {:.1}): the consumer waited {:.0}% and other ranks left cores idle",
                noted,
                consumer_wait * 100.0
            ))
        } else if avg + 0.5 <= noted {
            Some(if node_busy >= budget || node.someone_waits() {
                format!(
                    "gave back to {avg:.1} of {budget} cores (from {:.1}): other ranks wanted them ({node_busy}/{budget} busy)",
                    noted
                )
            } else {
                format!(
                    "gave back to {avg:.1} of {budget} cores (from {:.1}): the training step is the bottleneck (the consumer waited {:.0}%)",
                    noted,
                    consumer_wait * 100.0
                )
            })
        } else {
            None
        };
        if why.is_some() {
            self.noted = Some(avg);
        }
        Some(CpuShare {
            budget,
            node_busy,
            held: now.held,
            share,
            waited,
            why,
        })
    }
}

/// The tuner's recent ticks, shared with the pipeline.
#[derive(Debug, Default)]
pub struct TraceLog {
    records: Mutex<std::collections::VecDeque<TraceRecord>>,
}

impl TraceLog {
    fn push(&self, r: TraceRecord) {
        let mut q = self.records.lock();
        if q.len() == TRACE_CAPACITY {
            q.pop_front();
        }
        q.push_back(r);
    }

    /// The recorded ticks, oldest first.
    pub fn records(&self) -> Vec<TraceRecord> {
        self.records.lock().iter().cloned().collect()
    }

    /// Only the ticks with decisions.
    pub fn decisions(&self) -> Vec<TraceRecord> {
        self.records
            .lock()
            .iter()
            .filter(|r| !r.decisions.is_empty())
            .cloned()
            .collect()
    }
}

/// A callback for every tick with decisions.
pub type OnDecision = Box<dyn FnMut(&TraceRecord) + Send>;

/// The tuner actor; see the module docs.
pub struct TunerActor {
    stages: Vec<(Arc<dyn StageControl>, Addr<StageActor>)>,
    policy: Box<dyn Policy>,
    budgets: Budgets,
    tick: Duration,
    prev: Option<(Instant, Vec<StageStats>)>,
    item_bytes: Vec<u64>,
    started: Instant,
    trace_file: Option<std::io::BufWriter<std::fs::File>>,
    log: Arc<TraceLog>,
    on_decision: Option<OnDecision>,
    gpu: Option<GpuSampler>,
    epoch: Option<Arc<std::sync::atomic::AtomicU64>>,
    cpu: ShareWatch,
}

/// Samples accelerator utilisation (0..=1) once per tuner tick; `None` when unknown.
pub type GpuSampler = Box<dyn FnMut() -> Option<f64> + Send>;

impl std::fmt::Debug for TunerActor {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("TunerActor")
            .field("policy", &self.policy.name())
            .field("budgets", &self.budgets)
            .finish_non_exhaustive()
    }
}

impl TunerActor {
    /// A tuner of `stages` (control and actor of each; source excluded, sink last).
    pub fn new(
        stages: Vec<(Arc<dyn StageControl>, Addr<StageActor>)>,
        settings: &TunerSettings,
        policy: Box<dyn Policy>,
        log: Arc<TraceLog>,
        on_decision: Option<OnDecision>,
    ) -> std::io::Result<Self> {
        let trace_file = match &settings.trace {
            Some(p) => Some(std::io::BufWriter::new(std::fs::File::create(p)?)),
            None => None,
        };
        let n = stages.len();
        Ok(Self {
            stages,
            policy,
            budgets: settings.budgets(),
            tick: settings.tick.unwrap_or(DEFAULT_TICK),
            prev: None,
            item_bytes: vec![0; n],
            started: Instant::now(),
            trace_file,
            log,
            on_decision,
            gpu: None,
            epoch: None,
            cpu: ShareWatch {
                budgeted: settings.cpu_budget.is_some(),
                ..ShareWatch::default()
            },
        })
    }

    /// Reads the pipeline's epoch every tick, for the trace (epoch boundaries in a plot).
    pub fn with_epoch(mut self, epoch: Arc<std::sync::atomic::AtomicU64>) -> Self {
        self.epoch = Some(epoch);
        self
    }

    /// Samples accelerator utilisation every tick (NVML, say): the policies then count the
    /// consumer as starved only while the accelerator is idle.
    pub fn with_gpu_sampler(mut self, f: Option<GpuSampler>) -> Self {
        self.gpu = f;
        self
    }

    fn observe(&mut self, now: Instant, snaps: &[StageStats]) -> Option<Observation> {
        let (then, prev) = self.prev.replace((now, snaps.to_vec()))?;
        let window = now.duration_since(then);
        let mut spare_tokens = cap::cpu_worker_cap().saturating_sub(cap::cpu_workers_in_use());
        let mut budgets = self.budgets;
        if let Some(room) = self.cpu.room() {
            // On a node budget, workers beyond the cores the other ranks leave would only
            // wait for a core; and those cores, not a fixed share, are what the policy plans
            // with.
            spare_tokens = spare_tokens.min(room.saturating_sub(1 + cap::cpu_workers_in_use()));
            budgets.cores = room;
        }
        let stages: Vec<StageObservation> = snaps
            .iter()
            .zip(&prev)
            .enumerate()
            .map(|(i, (s, p))| {
                if s.queue_items > 0 {
                    self.item_bytes[i] = s.queue_bytes / s.queue_items as u64;
                }
                let mean = s.task_time.mean.as_secs_f64();
                // A pool stage can grow only as far as the process-wide CPU cap has tokens.
                let max_workers = if s.kind == Some(StageKind::Pool) {
                    s.max_workers.min(s.workers + spare_tokens)
                } else {
                    s.max_workers
                };
                StageObservation {
                    name: s.name.clone(),
                    kind: s.kind,
                    workers: s.workers,
                    max_workers,
                    workers_pinned: s.pinned,
                    budget_pinned: s.budget_pinned,
                    items: s.items_in.saturating_sub(p.items_in),
                    items_out: s.items_out.saturating_sub(p.items_out),
                    busy: s.busy.saturating_sub(p.busy),
                    blocked_put: s.blocked_put.saturating_sub(p.blocked_put),
                    blocked_get: s.blocked_get.saturating_sub(p.blocked_get),
                    queue_items: s.queue_items,
                    queue_bytes: s.queue_bytes,
                    budget_items: s.budget_items,
                    budget_bytes: s.budget_bytes,
                    item_bytes: self.item_bytes[i],
                    cost_cv: if mean > 0.0 {
                        s.task_time.stddev.as_secs_f64() / mean
                    } else {
                        0.0
                    },
                    cache: s.cache.map(|c| window_of(c, p.cache.unwrap_or_default())),
                    read_ahead: s.read_ahead.map(|r| {
                        let prev = p.read_ahead.unwrap_or_default();
                        flowgate_tuner::ReadAheadStats {
                            reads: r.reads.saturating_sub(prev.reads),
                            waits: r.waits.saturating_sub(prev.waits),
                            ..r
                        }
                    }),
                    item_threads: s.item_threads,
                }
            })
            .collect();
        let sink = stages.last()?;
        Some(Observation {
            now: now.duration_since(self.started),
            window,
            delivered: sink.items_out,
            consumer_wait: sink.blocked_get,
            gpu_util: self
                .gpu
                .as_mut()
                .and_then(|f| f())
                .map(|u| u.clamp(0.0, 1.0)),
            buffered_bytes: stages.iter().map(|s| s.queue_bytes).sum(),
            rss_bytes: rss_bytes(),
            budgets: Some(budgets),
            epoch: self
                .epoch
                .as_ref()
                .map(|e| e.load(std::sync::atomic::Ordering::Relaxed)),
            stages,
        })
    }

    fn tick(&mut self) {
        let now = Instant::now();
        let snaps: Vec<StageStats> = self.stages.iter().map(|(c, _)| c.snapshot()).collect();
        let Some(obs) = self.observe(now, &snaps) else {
            return;
        };
        let decisions = enforce(self.policy.decide(&obs), &obs);
        for d in &decisions {
            let (_, addr) = match d.action {
                Action::SetWorkers { stage, .. }
                | Action::SetPrefetch { stage, .. }
                | Action::SetCacheBytes { stage, .. }
                | Action::SetReadAhead { stage, .. }
                | Action::SetItemThreads { stage, .. } => &self.stages[stage],
            };
            match d.action {
                Action::SetWorkers { workers, .. } => addr.do_send(Resize { workers }),
                Action::SetPrefetch { items, bytes, .. } => {
                    addr.do_send(SetBudget { items, bytes })
                }
                Action::SetCacheBytes { bytes, .. } => addr.do_send(SetCacheBytes { bytes }),
                Action::SetReadAhead { depth, .. } => addr.do_send(SetReadAhead { depth }),
                Action::SetItemThreads { threads, .. } => addr.do_send(SetItemThreads { threads }),
            }
            tracing::debug!(policy = self.policy.name(), action = ?d.action, reason = %d.reason, "tuner decision");
        }
        let record = TraceRecord {
            t: obs.now.as_secs_f64(),
            rate: obs.rate(),
            wait: obs.wait_fraction(),
            stages: obs.stages.iter().map(|s| s.name.clone()).collect(),
            workers: obs.stages.iter().map(|s| s.workers).collect(),
            budgets: obs.stages.iter().map(|s| s.budget_items).collect(),
            queued: obs.stages.iter().map(|s| s.queue_items).collect(),
            buffered_bytes: obs.buffered_bytes,
            memory_budget: self.budgets.memory_bytes,
            rss_bytes: obs.rss_bytes,
            gpu_util: obs.gpu_util,
            epoch: obs.epoch,
            cpu: self.cpu.tick(obs.window, obs.wait_fraction()),
            decisions,
        };
        if let Some(f) = &mut self.trace_file {
            if let Ok(line) = serde_json::to_string(&record) {
                let _ = writeln!(f, "{line}");
            }
        }
        if !record.decisions.is_empty() || record.cpu.as_ref().is_some_and(|c| c.why.is_some()) {
            if let Some(cb) = &mut self.on_decision {
                cb(&record);
            }
        }
        self.log.push(record);
    }
}

impl Actor for TunerActor {
    type Context = Context<Self>;

    fn started(&mut self, ctx: &mut Context<Self>) {
        tracing::debug!(policy = self.policy.name(), tick = ?self.tick, "tuner started");
        // The baseline of the first window: the first tick then observes (and may act)
        // instead of only taking a snapshot, a tick sooner on a cold start.
        let snaps = self.stages.iter().map(|(c, _)| c.snapshot()).collect();
        self.prev = Some((Instant::now(), snaps));
        ctx.run_interval(self.tick, |this, _| this.tick());
    }

    fn stopped(&mut self, _: &mut Context<Self>) {
        if let Some(f) = &mut self.trace_file {
            let _ = f.flush();
        }
    }
}

/// Resident memory of this process (Linux; `None` elsewhere).
pub fn rss_bytes() -> Option<u64> {
    let statm = std::fs::read_to_string("/proc/self/statm").ok()?;
    let pages: u64 = statm.split_whitespace().nth(1)?.parse().ok()?;
    Some(pages * 4096)
}

/// A cache's counters in the window (`now` less `prev`), with capacity and size now.
fn window_of(now: CacheStats, prev: CacheStats) -> CacheStats {
    CacheStats {
        hits: now.hits.saturating_sub(prev.hits),
        misses: now.misses.saturating_sub(prev.misses),
        hit_bytes: now.hit_bytes.saturating_sub(prev.hit_bytes),
        miss_bytes: now.miss_bytes.saturating_sub(prev.miss_bytes),
        evicted_bytes: now.evicted_bytes.saturating_sub(prev.evicted_bytes),
        ..now
    }
}
