//! Caches attached to stages: their statistics join the stage's, and the tuner resizes them.

use std::sync::Arc;

use flowgate_tuner::{CacheStats, StageStats};

use crate::stage::StageControl;

/// A cache the tuner can see and resize.
pub trait CacheControl: Send + Sync + 'static {
    /// Counters and capacity now.
    fn cache_stats(&self) -> CacheStats;
    /// Sets the capacity in bytes (evicting what no longer fits).
    fn set_capacity(&self, bytes: u64);
}

/// A stage with a cache: everything goes to the stage, and the cache joins its snapshot.
pub struct WithCache {
    stage: Arc<dyn StageControl>,
    cache: Arc<dyn CacheControl>,
}

impl std::fmt::Debug for WithCache {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("WithCache")
            .field("stage", &self.stage.name())
            .field("cache", &self.cache.cache_stats())
            .finish()
    }
}

impl WithCache {
    /// `stage`, reporting and resizing `cache`.
    pub fn new(stage: Arc<dyn StageControl>, cache: Arc<dyn CacheControl>) -> Arc<Self> {
        Arc::new(Self { stage, cache })
    }
}

impl StageControl for WithCache {
    fn name(&self) -> &str {
        self.stage.name()
    }

    fn resize(&self, workers: usize) -> usize {
        self.stage.resize(workers)
    }

    fn set_budget(&self, items: usize, bytes: u64) {
        self.stage.set_budget(items, bytes);
    }

    fn set_cache_bytes(&self, bytes: u64) {
        self.cache.set_capacity(bytes);
    }

    fn snapshot(&self) -> StageStats {
        let mut s = self.stage.snapshot();
        s.cache = Some(self.cache.cache_stats());
        s
    }

    fn stop(&self) {
        self.stage.stop();
    }

    fn join(&self) {
        self.stage.join();
    }
}
