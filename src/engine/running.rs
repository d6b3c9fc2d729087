//! [`Engine`]: everything a running pipeline owns — its stages, channels, control plane,
//! tokio runtime and failure ledger — and the shutdown protocol that stops it all.
//!
//! The builder assembles an engine part by part and hands it, finished, to the
//! [`Pipeline`](crate::Pipeline), which only drives it (epochs, checkpoints, statistics).
//!
//! # Shutdown
//!
//! [`Engine::shutdown`] (run by [`Pipeline::stop`](crate::Pipeline::stop) and on drop) closes
//! every channel, which wakes every thread and task waiting on one; tells each stage to stop;
//! stops the control thread; joins every thread the pipeline started; and shuts the tokio
//! runtime down. It is idempotent. A [`StopHandle`](crate::StopHandle) does the first two
//! steps from anywhere (another thread, a signal handler), and the consumer then sees
//! [`PipelineError::is_stopped`]. A user function or iterator that never returns cannot be
//! interrupted; everything else returns promptly.

use std::sync::Arc;
use std::time::Duration;

use flowgate_actors::actor::ControlPlane;
use flowgate_actors::channel::{Budget, Channel};
use flowgate_actors::failure::Failures;
use flowgate_actors::origin::RangeSet;
use flowgate_actors::source::SourceStage;
use flowgate_actors::stage::StageControl;
use flowgate_tuner::StageStats;
use parking_lot::Mutex;

/// How long shutdown waits for the tokio runtime's tasks to finish.
const RUNTIME_SHUTDOWN_TIMEOUT: Duration = Duration::from_secs(10);

/// Anything with a [`Budget`]: lets the engine close channels of any item type.
pub(crate) trait HasBudget: Send + Sync {
    fn budget(&self) -> &Budget;
}

impl<T: Send> HasBudget for Channel<T> {
    fn budget(&self) -> &Budget {
        Channel::budget(self)
    }
}

/// A source's control: a stage that can be told to run an epoch.
pub(crate) trait SourceControl: StageControl {
    fn run_epoch(&self, epoch: u64);
    fn skip_in_epoch(&self, epoch: u64, done: RangeSet);
    fn as_control(self: Arc<Self>) -> Arc<dyn StageControl>;
}

impl<T: Send + 'static> SourceControl for SourceStage<T> {
    fn run_epoch(&self, epoch: u64) {
        SourceStage::run_epoch(self, epoch);
    }
    fn skip_in_epoch(&self, epoch: u64, done: RangeSet) {
        SourceStage::skip_in_epoch(self, epoch, done);
    }
    fn as_control(self: Arc<Self>) -> Arc<dyn StageControl> {
        self
    }
}

/// Closes every channel and stops every stage; shared by the engine and its stop handles.
pub(crate) struct Closer {
    channels: Vec<Arc<dyn HasBudget>>,
    stages: Mutex<Vec<Arc<dyn StageControl>>>,
}

impl Closer {
    pub(crate) fn close(&self) {
        for c in &self.channels {
            c.budget().close();
        }
        for s in self.stages.lock().iter() {
            s.stop();
        }
    }
}

/// Owns everything a pipeline started; [`Engine::shutdown`] stops and joins it all.
pub(crate) struct Engine {
    closer: Arc<Closer>,
    source: Option<Arc<dyn SourceControl>>,
    plane: Option<ControlPlane>,
    runtime: Option<tokio::runtime::Runtime>,
    ledger: Arc<Failures>,
    down: bool,
    /// The memory budget the pipeline holds to, and where it came from.
    memory: Option<crate::engine::stats::MemoryBudget>,
}

impl Engine {
    /// An engine over `channels` (every channel of the pipeline, for closing) that reports
    /// failures to `ledger`; a fatal failure closes it.
    pub(crate) fn new(channels: Vec<Arc<dyn HasBudget>>, ledger: Arc<Failures>) -> Self {
        let closer = Arc::new(Closer {
            channels,
            stages: Mutex::new(Vec::new()),
        });
        // Weak: the stages hold the ledger, and the closer holds the stages.
        let c = Arc::downgrade(&closer);
        ledger.on_fatal(move || {
            if let Some(c) = c.upgrade() {
                c.close();
            }
        });
        Self {
            closer,
            source: None,
            plane: None,
            runtime: None,
            ledger,
            down: false,
            memory: None,
        }
    }

    pub(crate) fn set_runtime(&mut self, rt: tokio::runtime::Runtime) {
        self.runtime = Some(rt);
    }

    /// Adds a stage (in pipeline order: source first, sink last).
    pub(crate) fn add_stage(&mut self, s: Arc<dyn StageControl>) {
        self.closer.stages.lock().push(s);
    }

    pub(crate) fn set_source(&mut self, s: Arc<dyn SourceControl>) {
        self.source = Some(s);
    }

    pub(crate) fn set_plane(&mut self, plane: ControlPlane) {
        self.plane = Some(plane);
    }

    /// Every stage, in pipeline order (source first, sink last).
    pub(crate) fn stages(&self) -> Vec<Arc<dyn StageControl>> {
        self.closer.stages.lock().clone()
    }

    pub(crate) fn ledger(&self) -> &Arc<Failures> {
        &self.ledger
    }

    pub(crate) fn set_memory(&mut self, memory: Option<crate::engine::stats::MemoryBudget>) {
        self.memory = memory;
    }

    pub(crate) fn memory(&self) -> Option<&crate::engine::stats::MemoryBudget> {
        self.memory.as_ref()
    }

    pub(crate) fn plane(&self) -> Option<&ControlPlane> {
        self.plane.as_ref()
    }

    pub(crate) fn closer(&self) -> &Arc<Closer> {
        &self.closer
    }

    pub(crate) fn source(&self) -> Option<&Arc<dyn SourceControl>> {
        self.source.as_ref()
    }

    /// Opens every channel for `epoch` and starts the source on it.
    pub(crate) fn begin_epoch(&self, epoch: u64) {
        for c in &self.closer.channels {
            c.budget().begin(epoch);
        }
        if let Some(s) = &self.source {
            s.run_epoch(epoch);
        }
    }

    /// Every stage's statistics: through the stage actors while the control plane runs.
    pub(crate) fn snapshot_all(&self) -> Vec<StageStats> {
        match &self.plane {
            Some(p) => p.snapshot_all(),
            None => self.stages().iter().map(|s| s.snapshot()).collect(),
        }
    }

    /// Whether [`shutdown`](Self::shutdown) has run.
    pub(crate) fn is_down(&self) -> bool {
        self.down
    }

    /// Stops and joins everything; see the module docs.
    pub(crate) fn shutdown(&mut self) {
        if self.down {
            return;
        }
        self.down = true;
        self.closer.close();
        if let Some(mut plane) = self.plane.take() {
            plane.shutdown();
        }
        for s in self.stages() {
            s.join();
        }
        if let Some(rt) = self.runtime.take() {
            rt.shutdown_timeout(RUNTIME_SHUTDOWN_TIMEOUT);
        }
        tracing::debug!("pipeline stopped");
    }
}

impl Drop for Engine {
    fn drop(&mut self) {
        self.shutdown();
    }
}
