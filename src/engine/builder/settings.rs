//! The pipeline-wide settings of a [`PipelineBuilder`]: failures, memory, the consumer's
//! buffer, order and chunks, the node's CPU budget, the tuner and the hooks. The stages and
//! their own options are in the parent module.

use std::time::Duration;

use flowgate_actors::emit::Order;
use flowgate_actors::error::ItemError;
use flowgate_actors::failure::FailureBudget;
use flowgate_actors::node::CpuBudget;
use flowgate_actors::tuner::{TraceRecord, TunerSettings};
use flowgate_tuner::Policy;

use super::plan::Autotune;
use super::PipelineBuilder;
use crate::engine::stats::PipelineStats;

impl<T: Send + 'static> PipelineBuilder<T> {
    /// Sets the pipeline-wide failure budget (default: unlimited, skip and count).
    pub fn max_failures(mut self, budget: FailureBudget) -> Self {
        self.c.cfg.failures = budget;
        self
    }

    /// The bytes everything the pipeline holds may take: items queued, in work, finished and
    /// waiting for room downstream, their outputs, and results waiting for the consumer.
    /// Every buffer gets a byte limit so that the limits add up to `bytes` (stages with a
    /// byte [`budget`](Self::budget) of their own keep it, and one of `u64::MAX` opts that
    /// stage out; the rest share what remains equally), and the tuner keeps the limits within
    /// it. Building fails if the stages' own byte budgets add up to more.
    ///
    /// Default: the tuner's [`memory_bytes`](TunerSettings::memory_bytes) (half of the
    /// available memory unless set) when the tuner is on; no limit when it is off. The one
    /// exception to the limit: a buffer admits an item larger than its whole byte limit when
    /// it holds nothing else, so one huge item cannot wedge the pipeline.
    pub fn memory_budget(mut self, bytes: u64) -> Self {
        self.c.cfg.memory_bytes = Some(bytes.max(1));
        self
    }

    /// Sets aside `bytes` of the [memory budget](Self::memory_budget) for memory the
    /// pipeline holds beside its buffers (`what` names it in errors): the buffers share what
    /// is left, and the tuner keeps them within it. [`upload`](Self::upload) reserves the
    /// uploader's staging ring this way. Building fails, naming it, if the reserves, the
    /// caches and the stages' own byte budgets exceed the memory budget.
    pub fn reserve_memory(mut self, what: &str, bytes: u64) -> Self {
        self.c.cfg.reserved.push((what.to_owned(), bytes));
        self
    }

    /// Names what this pipeline's checkpoints are valid for (the dataset, the seed, the
    /// sampler, the batch size…): [`Pipeline::state`](crate::Pipeline::state) records the fields and
    /// [`Pipeline::resume`](crate::Pipeline::resume) refuses a state whose fields differ, naming the field. Added to
    /// any set before; [`Files::fingerprint`](crate::dataset::Files::fingerprint) gives a file
    /// list's.
    pub fn checkpoint_fields<K: Into<String>, V: ToString>(
        mut self,
        fields: impl IntoIterator<Item = (K, V)>,
    ) -> Self {
        self.c
            .cfg
            .fingerprint
            .extend(fields.into_iter().map(|(k, v)| (k.into(), v.to_string())));
        self
    }

    /// How many finished results may wait for the consumer (default: two chunks).
    pub fn sink(mut self, buffer: usize) -> Self {
        self.c.cfg.sink_items = Some(buffer.max(1));
        self
    }

    /// Shares a CPU budget with the other ranks on this node (see
    /// [`node`](crate::actors::node)): this pipeline's pool stages hold one of the budget's
    /// cores for each item they run. Default: none (the tuner's settings may give one).
    pub fn cpu_budget(mut self, budget: CpuBudget) -> Self {
        self.c.cfg.cpu_budget = Some(budget);
        self
    }

    /// Starts the consumer's buffer at `buffer` results, which the tuner may change (where
    /// [`sink`](Self::sink) pins it).
    pub fn sink_start(mut self, buffer: usize) -> Self {
        self.c.cfg.sink_start = Some(buffer.max(1));
        self
    }

    /// The most bytes finished results waiting for the consumer may hold: a limit of their
    /// own, outside the shares of the [memory budget](Self::memory_budget) (the uploader sets
    /// it to its device budget, [`Uploader::max_device_bytes`](crate::device::Uploader::max_device_bytes)).
    /// The tuner may change the item count of that buffer, never this.
    pub fn sink_bytes(mut self, bytes: u64) -> Self {
        self.c.cfg.sink_bytes = bytes.max(1);
        self
    }

    /// The order of results: [`Order::Completion`] (default, fastest) or [`Order::Input`].
    pub fn output_order(mut self, order: Order) -> Self {
        self.c.cfg.order = order;
        self
    }

    /// Items per chunk between stages (default 64). 1 sends every item alone.
    pub fn chunk_size(mut self, n: usize) -> Self {
        self.c.cfg.chunk = n.max(1);
        self
    }

    /// How long the source waits to fill a chunk from a slow iterator (default 500 µs).
    pub fn linger(mut self, d: Duration) -> Self {
        self.c.cfg.linger = d;
        self
    }

    /// Threads of the tokio runtime that runs async stages and stream sources (default 1).
    pub fn io_threads(mut self, n: usize) -> Self {
        self.c.cfg.io_threads = n.max(1);
        self
    }

    /// Tunes the pipeline with these settings (the tuner is on by default, with the
    /// model-based policy). Stages whose workers are [`Workers::fixed`](crate::Workers::fixed), and budgets set with
    /// [`budget`](Self::budget) or [`sink`](Self::sink), are never changed.
    pub fn autotune(mut self, settings: TunerSettings) -> Self {
        self.c
            .autotune
            .get_or_insert_with(Autotune::default)
            .settings = settings;
        self
    }

    /// Tunes the pipeline with a policy of your own (see [`flowgate_tuner::Policy`]).
    pub fn autotune_with(mut self, policy: impl Policy + 'static) -> Self {
        self.c.autotune.get_or_insert_with(Autotune::default).policy = Some(Box::new(policy));
        self
    }

    /// Calls `f` on the control thread for every tuner tick that changed something.
    ///
    /// With the tuner off ([`autotune_off`](Self::autotune_off)) there are no decisions: this
    /// does not turn it back on.
    pub fn on_tuner_decision(mut self, f: impl FnMut(&TraceRecord) + Send + 'static) -> Self {
        if let Some(a) = self.c.autotune.as_mut() {
            a.on_decision = Some(Box::new(f));
        }
        self
    }

    /// Gives the tuner the accelerator's utilisation (0..=1, sampled every tick; e.g.
    /// [`GpuMonitor::utilization`](crate::device::GpuMonitor::utilization)). The policies then
    /// count the consumer as starved only while the accelerator idles; without it they use the
    /// consumer's wait alone.
    /// With the tuner off this does nothing.
    pub fn gpu_utilization(mut self, f: impl FnMut() -> Option<f64> + Send + 'static) -> Self {
        if let Some(a) = self.c.autotune.as_mut() {
            a.gpu = Some(Box::new(f));
        }
        self
    }

    /// Turns the tuner off: every knob stays where the builder put it.
    pub fn autotune_off(mut self) -> Self {
        self.c.autotune = None;
        self
    }

    /// Calls `f` with the pipeline's statistics every `interval`, on the control thread.
    pub fn on_stats(
        mut self,
        interval: Duration,
        f: impl FnMut(&PipelineStats) + Send + 'static,
    ) -> Self {
        self.c.on_stats = Some((interval, Box::new(f)));
        self
    }

    /// Calls `f` with every item failure (an error or a panic in any stage) as it happens, on the
    /// worker that saw it: the complete record, where [`PipelineStats::recent_failures`] keeps
    /// only the last few. Keep `f` short.
    pub fn on_failure(mut self, f: impl Fn(&ItemError) + Send + Sync + 'static) -> Self {
        self.c.on_failure = Some(Box::new(f));
        self
    }
}
