//! `flowgate-tuner`: the pure half of flowgate's self-tuning.
//!
//! No runtime (no actix, no tokio): everything here is deterministic and fast to test.
//!
//! - [`Observation`], [`Action`], [`Decision`] and the [`Policy`] trait: what a scheduling
//!   policy sees each tick and what it may change; [`Budgets`] it may not exceed, enforced by
//!   [`enforce`].
//! - [`policy`]: the shipped policies, [`Static`](policy::Static),
//!   [`HillClimb`](policy::HillClimb) and [`ModelBased`](policy::ModelBased) (the default).
//! - [`sim`]: a discrete-event simulator that runs any policy on a [`scenario`] in
//!   milliseconds, the same code the real pipeline's tuner actor runs.
//! - [`pool`]: sizing a pool of remote decode workers from what the training loop waits.
//! - [`Histogram`] and [`StageStats`]: the measurement vocabulary shared with the engine.

mod guard;
mod histogram;
pub mod node_sim;
mod observation;
pub mod policy;
pub mod pool;
mod rng;
pub mod scenario;
pub mod sim;
mod stats;
mod welch;

pub use guard::enforce;
pub use histogram::{Histogram, LatencySummary};
pub use observation::{
    available_memory, bytes_in_words, cgroup_limit, local_ranks, machine_cores, node_share,
    process_cores, Action, AvailableMemory, Budgets, Decision, Observation, Policy,
    StageObservation,
};
pub use rng::Rng;
pub use stats::{CacheStats, ItemThreadsStats, ReadAheadStats, StageKind, StageStats};
pub use welch::p_greater;
