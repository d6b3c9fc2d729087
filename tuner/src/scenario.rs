//! Simulation scenarios, as data (TOML files next to the tests).
//!
//! ```toml
//! name = "A: CPU-bound, three stages of unequal cost"
//! cores = 4
//! consumer_step_ms = 0.0     # per item; 0: the consumer takes results as fast as they come
//! memory_mb = 256
//!
//! [[stage]]
//! name = "decode"
//! kind = "cpu"               # or "io": waits, uses no core
//! cost = { dist = "lognormal", mean_ms = 2.0, sigma = 0.3 }
//! bytes = 150000             # bytes of an item this stage holds
//! max_workers = 2            # optional ceiling
//! threads = { max = 8, efficiency = 0.8 }   # optional threads-per-item knob
//!
//! [[change]]                 # at 30 s, decode costs twice as much
//! at_s = 30.0
//! stage = "decode"
//! cost_factor = 2.0
//! ```

use serde::{Deserialize, Serialize};

use crate::rng::Rng;

/// A per-item cost (CPU time for CPU stages, latency for I/O stages).
#[derive(Clone, Copy, Debug, PartialEq, Serialize, Deserialize)]
#[serde(tag = "dist", rename_all = "snake_case", deny_unknown_fields)]
pub enum Cost {
    /// Always `ms`.
    Constant {
        /// Milliseconds.
        ms: f64,
    },
    /// Lognormal with the given mean and log-space standard deviation.
    Lognormal {
        /// Mean in milliseconds.
        mean_ms: f64,
        /// Standard deviation of the log.
        sigma: f64,
    },
    /// Pareto (heavy tail) with the given mean and shape `alpha` (> 1).
    Pareto {
        /// Mean in milliseconds.
        mean_ms: f64,
        /// Shape: smaller is heavier; 1.5 has an infinite variance.
        alpha: f64,
    },
}

impl Cost {
    /// The mean, in seconds.
    pub fn mean_s(&self) -> f64 {
        match *self {
            Cost::Constant { ms } => ms / 1e3,
            Cost::Lognormal { mean_ms, .. } | Cost::Pareto { mean_ms, .. } => mean_ms / 1e3,
        }
    }

    /// A sample, in seconds.
    pub fn sample(&self, rng: &mut Rng) -> f64 {
        match *self {
            Cost::Constant { ms } => ms / 1e3,
            Cost::Lognormal { mean_ms, sigma } => {
                // E[exp(mu + sigma Z)] = exp(mu + sigma^2 / 2) = mean.
                let mu = (mean_ms / 1e3).ln() - sigma * sigma / 2.0;
                (mu + sigma * rng.normal()).exp()
            }
            Cost::Pareto { mean_ms, alpha } => {
                let alpha = alpha.max(1.01);
                let xm = mean_ms / 1e3 * (alpha - 1.0) / alpha;
                xm / rng.uniform().powf(1.0 / alpha)
            }
        }
    }
}

/// Whether a stage uses a core while it works.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum SimKind {
    /// Uses a core (shared with every other busy CPU worker).
    Cpu,
    /// Waits (network, disk); uses no core.
    Io,
}

/// A simulated stage.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct SimStage {
    /// Name.
    pub name: String,
    /// CPU or I/O.
    pub kind: SimKind,
    /// Per-item cost.
    pub cost: Cost,
    /// Bytes of an item the stage holds.
    #[serde(default = "default_bytes")]
    pub bytes: u64,
    /// Most workers (concurrency for I/O).
    #[serde(default)]
    pub max_workers: Option<usize>,
    /// Threads per item a tuner may give this (CPU) stage's items, as a video decoder's frame
    /// threads (none: one each).
    #[serde(default)]
    pub threads: Option<SimThreads>,
}

/// The threads-per-item knob of a simulated stage: an item on `t` threads uses `t` cores and
/// finishes `1 + (t - 1) × efficiency` times as fast as on one.
#[derive(Clone, Copy, Debug, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct SimThreads {
    /// The most threads per item.
    pub max: usize,
    /// What each thread past the first adds, as a fraction of one (0..=1).
    pub efficiency: f64,
}

fn default_bytes() -> u64 {
    1024
}

/// A change at a given time.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Change {
    /// When, in simulated seconds.
    pub at_s: f64,
    /// The stage whose cost changes.
    #[serde(default)]
    pub stage: Option<String>,
    /// Multiplies that stage's cost.
    #[serde(default)]
    pub cost_factor: Option<f64>,
    /// Multiplies the consumer's step time.
    #[serde(default)]
    pub consumer_factor: Option<f64>,
}

/// A whole simulated pipeline and its workload.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Scenario {
    /// Name.
    pub name: String,
    /// Cores the CPU stages share (processor sharing).
    pub cores: usize,
    /// The consumer's time per item, ms (0: instant).
    #[serde(default)]
    pub consumer_step_ms: f64,
    /// Memory budget for buffers, MiB.
    #[serde(default = "default_memory_mb")]
    pub memory_mb: f64,
    /// Random seed.
    #[serde(default)]
    pub seed: u64,
    /// Tuner tick, ms.
    #[serde(default = "default_tick_ms")]
    pub tick_ms: f64,
    /// CPU workers the process may run beyond one per stage, as the engine's tokens allow
    /// (its cores less one): a stage grows only while the others leave tokens. None: no cap.
    #[serde(default)]
    pub extra_workers: Option<usize>,
    /// Stages, in order (the source is implicit and infinitely fast).
    #[serde(rename = "stage")]
    pub stages: Vec<SimStage>,
    /// Changes over time.
    #[serde(default, rename = "change")]
    pub changes: Vec<Change>,
}

fn default_memory_mb() -> f64 {
    1024.0
}

fn default_tick_ms() -> f64 {
    100.0
}

impl Scenario {
    /// The memory budget in bytes.
    pub fn memory_bytes(&self) -> u64 {
        (self.memory_mb * 1024.0 * 1024.0) as u64
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn samplers_have_the_stated_means() {
        let mut rng = Rng::new(7);
        for cost in [
            Cost::Constant { ms: 2.0 },
            Cost::Lognormal {
                mean_ms: 2.0,
                sigma: 0.5,
            },
            Cost::Pareto {
                mean_ms: 2.0,
                alpha: 2.5,
            },
        ] {
            let n = 200_000;
            let mean = (0..n).map(|_| cost.sample(&mut rng)).sum::<f64>() / n as f64;
            assert!(
                (mean / cost.mean_s() - 1.0).abs() < 0.03,
                "{cost:?}: {mean}"
            );
        }
    }
}
