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

/// A read-ahead the tuner can see and deepen (remote tar shards fetched ahead of the readers).
pub trait ReadAheadControl: Send + Sync + 'static {
    /// Depth, ceiling and counters now.
    fn read_ahead_stats(&self) -> ReadAheadStats;
    /// Sets how many objects are fetched ahead of the readers.
    fn set_depth(&self, depth: usize);
}

/// A stage with a cache and/or a read-ahead: everything goes to the stage, and their
/// statistics join its snapshot; the tuner's cache and read-ahead decisions go to them.
pub struct WithKnobs {
    stage: Arc<dyn StageControl>,
    cache: Option<Arc<dyn CacheControl>>,
    read_ahead: Option<Arc<dyn ReadAheadControl>>,
}

impl std::fmt::Debug for WithKnobs {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("WithKnobs")
            .field("stage", &self.stage.name())
            .field("cache", &self.cache.as_ref().map(|c| c.cache_stats()))
            .field(
                "read_ahead",
                &self.read_ahead.as_ref().map(|r| r.read_ahead_stats()),
            )
            .finish()
    }
}

impl WithKnobs {
    /// `stage`, reporting and resizing `cache` and `read_ahead` (`stage` itself when both
    /// are `None`).
    pub fn wrap(
        stage: Arc<dyn StageControl>,
        cache: Option<Arc<dyn CacheControl>>,
        read_ahead: Option<Arc<dyn ReadAheadControl>>,
    ) -> Arc<dyn StageControl> {
        if cache.is_none() && read_ahead.is_none() {
            return stage;
        }
        Arc::new(Self {
            stage,
            cache,
            read_ahead,
        })
    }
}

impl StageControl for WithKnobs {
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
        if let Some(c) = &self.cache {
            c.set_capacity(bytes);
        }
    }

    fn set_read_ahead(&self, depth: usize) {
        if let Some(r) = &self.read_ahead {
            r.set_depth(depth);
        }
    }

    fn snapshot(&self) -> StageStats {
        let mut s = self.stage.snapshot();
        if let Some(c) = &self.cache {
            s.cache = Some(c.cache_stats());
        }
        if let Some(r) = &self.read_ahead {
            s.read_ahead = Some(r.read_ahead_stats());
        }
        s
    }

    fn stop(&self) {
        self.stage.stop();
    }

    fn join(&self) {
        self.stage.join();
    }
}
