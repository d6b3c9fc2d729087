//! What a policy sees each tick, what it may do, and the budgets it must respect.

use std::time::Duration;

use serde::{Deserialize, Serialize};

use crate::{CacheStats, StageKind};

/// One stage over the last tick window.
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize)]
pub struct StageObservation {
    /// The stage's name.
    pub name: String,
    /// Its kind (a sink is the consumer's buffer).
    pub kind: Option<StageKind>,
    /// Active workers (pool), concurrency (async), 1 otherwise.
    pub workers: usize,
    /// Most workers the stage may run.
    pub max_workers: usize,
    /// The user fixed `workers`: never change it.
    pub workers_pinned: bool,
    /// The user fixed the budget: never change it.
    pub budget_pinned: bool,
    /// Items the stage finished in the window.
    pub items: u64,
    /// Items it sent on in the window.
    pub items_out: u64,
    /// Worker time in the user's function in the window (all workers together).
    pub busy: Duration,
    /// Worker time blocked waiting for room downstream in the window.
    pub blocked_put: Duration,
    /// Worker time blocked waiting for input in the window.
    pub blocked_get: Duration,
    /// Items held now.
    pub queue_items: usize,
    /// Bytes held now.
    pub queue_bytes: u64,
    /// Item budget now.
    pub budget_items: usize,
    /// Byte budget now.
    pub budget_bytes: u64,
    /// Typical bytes of one item the stage holds (0 if unknown).
    pub item_bytes: u64,
    /// Coefficient of variation (standard deviation / mean) of the time per item, over the
    /// stage's life: 0 for constant work, around 1 for exponential, more for heavy tails.
    pub cost_cv: f64,
    /// The stage's cache: capacity and size now, hits, misses and evictions in the window.
    pub cache: Option<CacheStats>,
    /// The stage's read-ahead: its depth now, reads and waits in the window.
    pub read_ahead: Option<crate::ReadAheadStats>,
    /// Threads per item, if the stage's work has that knob.
    pub item_threads: Option<crate::ItemThreadsStats>,
}

impl StageObservation {
    /// Whether the stage runs on CPU cores (pool, serial) rather than waiting on I/O.
    pub fn is_cpu(&self) -> bool {
        matches!(self.kind, Some(StageKind::Pool) | Some(StageKind::Serial))
    }

    /// Whether the tuner may resize the stage.
    pub fn resizable(&self) -> bool {
        !self.workers_pinned && matches!(self.kind, Some(StageKind::Pool) | Some(StageKind::Async))
    }
}

/// Hard limits no action may exceed.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct Budgets {
    /// Bytes the pipeline's buffers may hold in total.
    pub memory_bytes: u64,
    /// Cores the CPU stages may use.
    pub cores: usize,
}

impl Budgets {
    /// Half of the memory available now (from `/proc/meminfo`; 4 GiB if unknown) and the
    /// number of cores.
    ///
    /// On a node shared by `LOCAL_WORLD_SIZE` ranks (`torchrun`), each rank gets its share of
    /// the cores and of the memory budget, so ranks sizing themselves independently never
    /// oversubscribe the node together.
    pub fn detect() -> Self {
        let available = std::fs::read_to_string("/proc/meminfo")
            .ok()
            .and_then(|m| {
                m.lines()
                    .find_map(|l| l.strip_prefix("MemAvailable:"))
                    .and_then(|v| v.trim().trim_end_matches("kB").trim().parse::<u64>().ok())
            })
            .map_or(8 << 30, |kb| kb * 1024);
        let ranks = local_ranks(std::env::var("LOCAL_WORLD_SIZE").ok().as_deref());
        Self {
            memory_bytes: available / 2 / ranks as u64,
            cores: node_share(machine_cores(), ranks),
        }
    }
}

/// The cores this machine offers the process (its affinity mask or quota).
pub fn machine_cores() -> usize {
    std::thread::available_parallelism().map_or(1, |n| n.get())
}

/// How many processes share this node: `LOCAL_WORLD_SIZE` (what `torchrun` sets for the ranks
/// on one node), 1 when it is absent or not a positive number.
pub fn local_ranks(local_world_size: Option<&str>) -> usize {
    local_world_size
        .and_then(|v| v.trim().parse::<usize>().ok())
        .filter(|&n| n > 0)
        .unwrap_or(1)
}

/// One rank's share of `cores` when `ranks` processes share the node (at least one): so that
/// ranks sizing themselves independently never oversubscribe the node together.
pub fn node_share(cores: usize, ranks: usize) -> usize {
    (cores / ranks.max(1)).max(1)
}

/// The cores this process may use: its share of the node's (see [`Budgets::detect`]).
pub fn process_cores() -> usize {
    node_share(
        machine_cores(),
        local_ranks(std::env::var("LOCAL_WORLD_SIZE").ok().as_deref()),
    )
}

/// Everything a policy sees at one tick.
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize)]
pub struct Observation {
    /// Time since the pipeline (or simulation) started.
    pub now: Duration,
    /// Length of the window the counters cover.
    pub window: Duration,
    /// Every stage but the source, in pipeline order; the last is the sink (the consumer's
    /// buffer), whose `blocked_get` is the consumer's wait.
    pub stages: Vec<StageObservation>,
    /// Results the consumer took in the window.
    pub delivered: u64,
    /// Time the consumer waited for results in the window: the direct measure of starvation.
    pub consumer_wait: Duration,
    /// Accelerator utilisation (0..=1) when known.
    pub gpu_util: Option<f64>,
    /// Bytes held in all buffers now.
    pub buffered_bytes: u64,
    /// Resident memory of the process, when known.
    pub rss_bytes: Option<u64>,
    /// The limits.
    pub budgets: Option<Budgets>,
    /// The epoch the pipeline runs, when known: a consumer waits at an epoch's start whatever
    /// the buffers hold (nothing of it could be made earlier), which a policy may discount.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub epoch: Option<u64>,
}

impl Observation {
    /// Results per second in the window.
    pub fn rate(&self) -> f64 {
        self.delivered as f64 / self.window.as_secs_f64().max(1e-9)
    }

    /// Fraction of the window the consumer waited.
    pub fn wait_fraction(&self) -> f64 {
        (self.consumer_wait.as_secs_f64() / self.window.as_secs_f64().max(1e-9)).min(1.0)
    }

    /// How starved the accelerator is, 0..=1: the consumer's wait fraction, capped by the
    /// accelerator's idle fraction when its utilisation is known (a training loop that waits
    /// for data while the GPU still runs queued work is not starving it).
    pub fn starvation(&self) -> f64 {
        let wait = self.wait_fraction();
        match self.gpu_util {
            Some(u) => wait.min(1.0 - u.clamp(0.0, 1.0)),
            None => wait,
        }
    }
}

/// A change to one knob of one stage (indexes into [`Observation::stages`]).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(tag = "action", rename_all = "snake_case")]
pub enum Action {
    /// Set the active workers (concurrency for async stages).
    SetWorkers {
        /// Stage index.
        stage: usize,
        /// Workers wanted.
        workers: usize,
    },
    /// Set how many items and bytes the stage may hold (its prefetch buffer).
    SetPrefetch {
        /// Stage index.
        stage: usize,
        /// Item budget.
        items: usize,
        /// Byte budget.
        bytes: u64,
    },
    /// Set the byte budget of a cache stage.
    SetCacheBytes {
        /// Stage index.
        stage: usize,
        /// Byte budget.
        bytes: u64,
    },
    /// Set how many objects a stage's read-ahead fetches ahead of the readers.
    SetReadAhead {
        /// Stage index.
        stage: usize,
        /// Objects in flight ahead.
        depth: usize,
    },
    /// Set how many threads each item a stage starts from now on may use (a video decoder's
    /// frame threads).
    SetItemThreads {
        /// Stage index.
        stage: usize,
        /// Threads per item.
        threads: usize,
    },
}

/// An action and why it was taken (recorded in the decision trace).
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct Decision {
    /// What to change.
    pub action: Action,
    /// Why, in a short sentence.
    pub reason: String,
}

/// A scheduling policy: looks at each tick's observation and decides what to change.
///
/// Policies are pure and deterministic given their inputs, so the same code runs in the
/// [`Simulator`](crate::sim::Simulator) (thousands of simulated seconds per real second) and on
/// a real pipeline (driven by the tuner actor). Rules a policy must follow, which the tuner
/// also enforces: never change a pinned knob, keep at least one worker per stage, and keep the
/// sum of buffer budgets within [`Budgets::memory_bytes`].
pub trait Policy: Send {
    /// A short name for traces.
    fn name(&self) -> &str;
    /// Decides the changes for this tick (often none).
    fn decide(&mut self, obs: &Observation) -> Vec<Decision>;
}

impl<P: Policy + ?Sized> Policy for Box<P> {
    fn name(&self) -> &str {
        (**self).name()
    }
    fn decide(&mut self, obs: &Observation) -> Vec<Decision> {
        (**self).decide(obs)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn ranks_on_one_node_share_its_cores() {
        assert_eq!(local_ranks(None), 1);
        assert_eq!(local_ranks(Some("8")), 8);
        assert_eq!(local_ranks(Some("0")), 1);
        assert_eq!(local_ranks(Some("x")), 1);
        assert_eq!(node_share(32, 8), 4);
        assert_eq!(node_share(2, 2), 1);
        assert_eq!(node_share(2, 4), 1, "at least one each");
        // Eight ranks sizing for their share never ask for more than the node has.
        assert!(8 * node_share(32, 8) <= 32);
    }
}
