//! Caches and read-aheads attached to stages: their statistics join the stage's, and the
//! tuner resizes them.

use std::sync::Arc;

use flowgate_tuner::{CacheStats, ReadAheadStats, StageStats};

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

    fn set_read_ahead(&self, depth: usize) {
        self.stage.set_read_ahead(depth);
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

/// A read-ahead the tuner can see and deepen (remote tar shards fetched ahead of the readers).
pub trait ReadAheadControl: Send + Sync + 'static {
    /// Depth, ceiling and counters now.
    fn read_ahead_stats(&self) -> ReadAheadStats;
    /// Sets how many objects are fetched ahead of the readers.
    fn set_depth(&self, depth: usize);
}

/// A stage with a read-ahead: everything goes to the stage, and the read-ahead joins its
/// snapshot.
pub struct WithReadAhead {
    stage: Arc<dyn StageControl>,
    read_ahead: Arc<dyn ReadAheadControl>,
}

impl std::fmt::Debug for WithReadAhead {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("WithReadAhead")
            .field("stage", &self.stage.name())
            .field("read_ahead", &self.read_ahead.read_ahead_stats())
            .finish()
    }
}

impl WithReadAhead {
    /// `stage`, reporting and deepening `read_ahead`.
    pub fn new(stage: Arc<dyn StageControl>, read_ahead: Arc<dyn ReadAheadControl>) -> Arc<Self> {
        Arc::new(Self { stage, read_ahead })
    }
}

impl StageControl for WithReadAhead {
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
        self.stage.set_cache_bytes(bytes);
    }

    fn set_read_ahead(&self, depth: usize) {
        self.read_ahead.set_depth(depth);
    }

    fn snapshot(&self) -> StageStats {
        let mut s = self.stage.snapshot();
        s.read_ahead = Some(self.read_ahead.read_ahead_stats());
        s
    }

    fn stop(&self) {
        self.stage.stop();
    }

    fn join(&self) {
        self.stage.join();
    }
}
