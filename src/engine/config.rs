//! Pipeline-wide settings and per-stage options, folded from the builder.

use std::time::Duration;

use flowgate_actors::emit::Order;
use flowgate_actors::failure::FailureBudget;
use flowgate_actors::node::CpuBudget;

/// Items per chunk sent between stages. Large enough that per-chunk costs (a lock, a channel
/// operation, a wake-up) are noise next to 64 items of even trivial work; small enough that a
/// chunk of slow items is spread over a pool by work stealing within a few items.
pub(crate) const DEFAULT_CHUNK: usize = 64;
/// How long a source waits to fill a chunk from a slow iterator before sending what it has:
/// well under a training step, long enough to batch a fast iterator.
pub(crate) const DEFAULT_LINGER: Duration = Duration::from_micros(500);
/// Default most workers of one stage (the process-wide cap limits what is active).
pub(crate) const DEFAULT_MAX_WORKERS: usize = 64;
/// Default most items in flight of one async stage.
pub(crate) const DEFAULT_MAX_CONCURRENCY: usize = 1024;
/// Chunks a stage may hold by default: one being worked on, one queued behind it.
pub(crate) const DEFAULT_CHUNKS_PER_STAGE: usize = 2;

/// How many workers (or, for async stages, items in flight) a stage runs.
///
/// A plain number is where the stage starts; a tuner may change it. [`Workers::fixed`] pins it.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Workers {
    pub(crate) n: usize,
    pub(crate) pinned: bool,
    pub(crate) auto: bool,
}

impl Workers {
    /// Start with `n`; a tuner may change it.
    pub fn initial(n: usize) -> Self {
        Self {
            n: n.max(1),
            pinned: false,
            auto: false,
        }
    }

    /// Exactly `n`; no tuner changes it.
    pub fn fixed(n: usize) -> Self {
        Self {
            n: n.max(1),
            pinned: true,
            auto: false,
        }
    }

    /// Start where the cores suggest, before anything is measured; a tuner may change it. A
    /// synchronous (pool) stage starts with its share of the cores the tuner may use (of the
    /// process's share of the node: `LOCAL_WORLD_SIZE`), shared equally among the stages
    /// built with `auto()`; the process-wide worker cap still applies. This is what the media
    /// loaders, pipeline files and the benches give their decode stage: a CPU-bound stage then
    /// runs at full speed from its first item instead of waiting for the tuner's first
    /// measurements (at least one tick of 100 ms, a tenth of a one-second epoch), and a stage
    /// that needs fewer is scaled down by the tuner, which costs no throughput. Elsewhere
    /// (an async stage) it is `initial(1)`.
    pub fn auto() -> Self {
        Self {
            n: 1,
            pinned: false,
            auto: true,
        }
    }

    /// Whether the stage starts at the cores' suggestion ([`auto`](Self::auto)).
    pub fn is_auto(self) -> bool {
        self.auto
    }

    /// The number of workers.
    pub fn get(self) -> usize {
        self.n
    }

    /// Whether the number is pinned.
    pub fn is_pinned(self) -> bool {
        self.pinned
    }
}

impl From<usize> for Workers {
    fn from(n: usize) -> Self {
        Self::initial(n)
    }
}

/// Pipeline-wide settings.
#[derive(Clone, Debug)]
pub(crate) struct Config {
    pub(crate) order: Order,
    pub(crate) chunk: usize,
    pub(crate) linger: Duration,
    pub(crate) failures: FailureBudget,
    pub(crate) max_workers: usize,
    pub(crate) max_concurrency: usize,
    pub(crate) io_threads: usize,
    pub(crate) sink_items: Option<usize>,
    /// The sink's item budget to start at, which the tuner may change.
    pub(crate) sink_start: Option<usize>,
    /// The node CPU budget this pipeline's pool stages hold cores of, if any.
    pub(crate) cpu_budget: Option<CpuBudget>,
    pub(crate) sink_bytes: u64,
    /// The bytes everything the pipeline holds may take (see
    /// [`PipelineBuilder::memory_budget`](crate::PipelineBuilder::memory_budget)).
    pub(crate) memory_bytes: Option<u64>,
    /// What checkpoints of this pipeline are valid for.
    pub(crate) fingerprint: crate::engine::checkpoint::Fingerprint,
    /// The sampler of a sampled source (see `source_sampled`), for checkpoints that merge
    /// across ranks.
    pub(crate) sharding: Option<crate::engine::sharding::Sharding>,
    /// Parts of the memory budget set aside for memory held beside the buffers (the
    /// uploader's staging ring): (what, bytes).
    pub(crate) reserved: Vec<(String, u64)>,
}

impl Default for Config {
    fn default() -> Self {
        Self {
            order: Order::Completion,
            chunk: DEFAULT_CHUNK,
            linger: DEFAULT_LINGER,
            failures: FailureBudget::unlimited(),
            max_workers: DEFAULT_MAX_WORKERS,
            max_concurrency: DEFAULT_MAX_CONCURRENCY,
            io_threads: 1,
            sink_items: None,
            sink_start: None,
            cpu_budget: None,
            sink_bytes: u64::MAX,
            memory_bytes: None,
            fingerprint: Default::default(),
            sharding: None,
            reserved: Vec::new(),
        }
    }
}

/// Options of one stage, settable right after the stage is added.
#[derive(Clone, Debug, Default)]
pub(crate) struct StageOpts {
    pub(crate) budget_items: Option<usize>,
    /// An item budget to start at that the tuner may change (`budget_items` pins one).
    pub(crate) start_items: Option<usize>,
    pub(crate) budget_bytes: Option<u64>,
    pub(crate) failures: Option<FailureBudget>,
    pub(crate) cache: Option<AttachedCache>,
    pub(crate) read_ahead: Option<AttachedReadAhead>,
    pub(crate) item_threads: Option<std::sync::Arc<flowgate_actors::attached::ItemThreads>>,
}

/// A read-ahead attached to a stage.
#[derive(Clone)]
pub(crate) struct AttachedReadAhead(
    pub(crate) std::sync::Arc<dyn flowgate_actors::attached::ReadAheadControl>,
);

impl std::fmt::Debug for AttachedReadAhead {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_tuple("AttachedReadAhead")
            .field(&self.0.read_ahead_stats())
            .finish()
    }
}

/// A cache attached to a stage.
#[derive(Clone)]
pub(crate) struct AttachedCache(
    pub(crate) std::sync::Arc<dyn flowgate_actors::attached::CacheControl>,
);

impl std::fmt::Debug for AttachedCache {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_tuple("AttachedCache")
            .field(&self.0.cache_stats())
            .finish()
    }
}

impl Config {
    /// The chunk size on a channel whose items each stand for `scale` source items.
    pub(crate) fn chunk_at(&self, scale: usize) -> usize {
        (self.chunk / scale.max(1)).max(1)
    }

    /// The default item budget of a stage with `workers` workers fed in chunks of `chunk`.
    pub(crate) fn default_budget(chunk: usize, workers: usize) -> usize {
        (DEFAULT_CHUNKS_PER_STAGE * chunk).max(2 * workers + 2)
    }
}
