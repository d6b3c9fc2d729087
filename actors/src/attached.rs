//! Caches, read-aheads and threads per item attached to stages: their statistics join the
//! stage's, and the tuner resizes them.

use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;

use flowgate_tuner::{CacheStats, ItemThreadsStats, ReadAheadStats, StageStats};

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

/// Threads each item of a stage may use (a video decoder's frame threads), read by the
/// stage's work when it starts an item and set by the tuner (see
/// [`ItemThreadTrials`](flowgate_tuner::policy::ItemThreadTrials)).
#[derive(Debug)]
pub struct ItemThreads {
    threads: AtomicUsize,
    max: usize,
}

impl ItemThreads {
    /// One thread per item until the tuner raises it, up to `max`.
    pub fn tuned(max: usize) -> Arc<Self> {
        Arc::new(Self {
            threads: AtomicUsize::new(1),
            max: max.max(1),
        })
    }

    /// Threads for the next item.
    pub fn get(&self) -> usize {
        self.threads.load(Ordering::Relaxed)
    }

    /// Sets the threads for items started from now on, within `1..=max`.
    pub fn set(&self, threads: usize) {
        self.threads
            .store(threads.clamp(1, self.max), Ordering::Relaxed);
    }

    /// The setting and its ceiling (a knob exists only when the threads are the tuner's: a
    /// user's number is the work's own, with no knob).
    pub fn stats(&self) -> ItemThreadsStats {
        ItemThreadsStats {
            threads: self.get(),
            max_threads: self.max,
            pinned: false,
        }
    }
}

/// A stage with a cache, a read-ahead and/or threads per item: everything goes to the stage,
/// and their statistics join its snapshot; the tuner's decisions on them go to them.
pub struct WithKnobs {
    stage: Arc<dyn StageControl>,
    cache: Option<Arc<dyn CacheControl>>,
    read_ahead: Option<Arc<dyn ReadAheadControl>>,
    item_threads: Option<Arc<ItemThreads>>,
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
            .field(
                "item_threads",
                &self.item_threads.as_ref().map(|t| t.stats()),
            )
            .finish()
    }
}

impl WithKnobs {
    /// `stage`, reporting and resizing `cache`, `read_ahead` and `item_threads` (`stage`
    /// itself when all are `None`).
    pub fn wrap(
        stage: Arc<dyn StageControl>,
        cache: Option<Arc<dyn CacheControl>>,
        read_ahead: Option<Arc<dyn ReadAheadControl>>,
        item_threads: Option<Arc<ItemThreads>>,
    ) -> Arc<dyn StageControl> {
        if cache.is_none() && read_ahead.is_none() && item_threads.is_none() {
            return stage;
        }
        Arc::new(Self {
            stage,
            cache,
            read_ahead,
            item_threads,
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

    fn set_item_threads(&self, threads: usize) {
        if let Some(t) = &self.item_threads {
            t.set(threads);
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
        s.item_threads = self.item_threads.as_ref().map(|t| t.stats());
        s
    }

    fn stop(&self) {
        self.stage.stop();
    }

    fn join(&self) {
        self.stage.join();
    }
}
