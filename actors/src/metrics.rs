//! Per-stage counters, kept per worker and flushed in batches.
//!
//! A worker owns a [`WorkerCounters`] and bumps plain integers; every [`FLUSH_ITEMS`] items or
//! [`FLUSH_INTERVAL`], and whenever it is about to wait, it adds them into the stage's shared
//! [`StageMetrics`] under one lock. Nothing is shared or locked per item.

use std::time::{Duration, Instant};

use flowgate_tuner::{Histogram, StageKind, StageStats};
use parking_lot::Mutex;

use crate::channel::Budget;

/// Flush after this many items, so a snapshot lags a busy stage by at most this much work.
pub const FLUSH_ITEMS: u64 = 4096;
/// Flush at least this often while busy, so slow stages still show up in snapshots promptly
/// (the tuner ticks every 100 ms by default; 20 ms keeps its view within a fifth of a tick).
pub const FLUSH_INTERVAL: Duration = Duration::from_millis(20);

/// Totals of a stage (or the part of them one worker has not flushed yet).
#[derive(Clone, Debug, Default)]
pub struct Counters {
    /// Items taken in.
    pub items_in: u64,
    /// Items sent on.
    pub items_out: u64,
    /// Items failed.
    pub failures: u64,
    /// Time in the user's function, nanoseconds.
    pub busy_ns: u64,
    /// Time waiting for room downstream, nanoseconds.
    pub put_wait_ns: u64,
    /// Time waiting for input, nanoseconds.
    pub get_wait_ns: u64,
    /// Time per item.
    pub task_time: Histogram,
}

impl Counters {
    fn add(&mut self, o: &Counters) {
        self.items_in += o.items_in;
        self.items_out += o.items_out;
        self.failures += o.failures;
        self.busy_ns += o.busy_ns;
        self.put_wait_ns += o.put_wait_ns;
        self.get_wait_ns += o.get_wait_ns;
        self.task_time.merge(&o.task_time);
    }

    fn reset(&mut self) {
        self.items_in = 0;
        self.items_out = 0;
        self.failures = 0;
        self.busy_ns = 0;
        self.put_wait_ns = 0;
        self.get_wait_ns = 0;
        self.task_time.clear();
    }
}

/// The shared totals of one stage.
#[derive(Debug)]
pub struct StageMetrics {
    name: String,
    kind: StageKind,
    started: Instant,
    totals: Mutex<Counters>,
}

impl StageMetrics {
    /// Metrics for a stage called `name`.
    pub fn new(name: impl Into<String>, kind: StageKind) -> Self {
        Self {
            name: name.into(),
            kind,
            started: Instant::now(),
            totals: Mutex::new(Counters::default()),
        }
    }

    /// The stage's name.
    pub fn name(&self) -> &str {
        &self.name
    }

    /// Adds a worker's unflushed counters.
    pub fn flush(&self, local: &mut Counters) {
        self.totals.lock().add(local);
        local.reset();
    }

    /// A snapshot, with the queue state read from `input` (the budget the stage consumes).
    /// The caller fills in the knobs (workers, limits, pins).
    pub fn snapshot(&self, input: Option<&Budget>) -> StageStats {
        let t = self.totals.lock().clone();
        let elapsed = self.started.elapsed();
        let (queue_items, queue_bytes, budget_items, budget_bytes) = match input {
            Some(b) => {
                let s = b.status();
                (s.used_items, s.used_bytes, s.cap_items, s.cap_bytes)
            }
            None => (0, 0, 0, 0),
        };
        StageStats {
            name: self.name.clone(),
            kind: Some(self.kind),
            workers: 1,
            max_workers: 1,
            pinned: true,
            budget_pinned: input.is_none(),
            items_in: t.items_in,
            items_out: t.items_out,
            failures: t.failures,
            task_time: t.task_time.summary(),
            busy: Duration::from_nanos(t.busy_ns),
            blocked_put: Duration::from_nanos(t.put_wait_ns),
            blocked_get: Duration::from_nanos(t.get_wait_ns),
            queue_items,
            queue_bytes,
            budget_items,
            budget_bytes,
            elapsed,
            items_per_s: t.items_out as f64 / elapsed.as_secs_f64().max(1e-9),
            cache: None,
            read_ahead: None,
            item_threads: None,
        }
    }
}

/// A worker's local counters plus its flush clock.
#[derive(Debug)]
pub struct WorkerCounters {
    /// The unflushed counts.
    pub c: Counters,
    last_flush: Instant,
}

impl Default for WorkerCounters {
    fn default() -> Self {
        Self {
            c: Counters::default(),
            last_flush: Instant::now(),
        }
    }
}

impl WorkerCounters {
    /// Flushes if enough items or time went by since the last flush; `now` is a clock reading
    /// the caller already has.
    #[inline]
    pub fn maybe_flush(&mut self, m: &StageMetrics, now: Instant) {
        if self.c.items_in >= FLUSH_ITEMS || now.duration_since(self.last_flush) >= FLUSH_INTERVAL {
            self.flush(m, now);
        }
    }

    /// Flushes now.
    pub fn flush(&mut self, m: &StageMetrics, now: Instant) {
        m.flush(&mut self.c);
        self.last_flush = now;
    }
}

/// Nanoseconds between two instants, saturating.
#[inline]
pub fn nanos(from: Instant, to: Instant) -> u64 {
    u64::try_from(to.saturating_duration_since(from).as_nanos()).unwrap_or(u64::MAX)
}

impl StageMetrics {
    /// Items taken in, as flushed so far.
    pub fn items_in(&self) -> u64 {
        self.totals.lock().items_in
    }
}
