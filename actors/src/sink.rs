//! The consumer end of a pipeline: what `next()` reads from.
//!
//! The reader takes whole chunks from the last channel into a local queue and releases each
//! item's permits as it hands the item out, so the sink budget counts exactly the results that
//! are ready but not yet delivered. Time spent waiting for a result is the consumer's wait: the
//! direct measure of a starved training loop.

use std::collections::VecDeque;
use std::future::Future;
use std::pin::Pin;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::task::{Context, Poll};
use std::time::Instant;

use event_listener::{EventListener, Listener};
use flowgate_tuner::{Histogram, StageKind, StageStats};
use parking_lot::Mutex;

use crate::channel::{Channel, Envelope};
use crate::metrics::{nanos, StageMetrics};
use crate::origin::Delivered;
use crate::stage::StageControl;

/// What the reader found.
#[derive(Debug, PartialEq, Eq)]
pub enum Next<T> {
    /// A result.
    Item(T),
    /// The epoch with this number ended: every result of it was delivered.
    EpochEnd(u64),
    /// The pipeline is shutting down.
    Closed,
}

/// Consumer-side counters, shared with the sink's [`StageControl`].
#[derive(Debug)]
pub struct SinkStats {
    metrics: StageMetrics,
    delivered: AtomicU64,
    waits: Mutex<Waits>,
}

/// The consumer's waits: finished ones, and the one in progress (so a snapshot taken during a
/// long wait sees it, rather than nothing until it ends).
#[derive(Debug)]
struct Waits {
    hist: Histogram,
    total_ns: u64,
    since: Option<Instant>,
}

impl SinkStats {
    fn new() -> Self {
        Self {
            metrics: StageMetrics::new("sink", StageKind::Sink),
            delivered: AtomicU64::new(0),
            waits: Mutex::new(Waits {
                hist: Histogram::new(),
                total_ns: 0,
                since: None,
            }),
        }
    }

    fn start_wait(&self, t0: Instant) {
        self.waits.lock().since.get_or_insert(t0);
    }

    fn waited(&self, t0: Instant) {
        let ns = nanos(t0, Instant::now());
        let mut w = self.waits.lock();
        w.since = None;
        w.total_ns += ns;
        w.hist.record_ns(ns);
    }

    /// Total wait so far, the one in progress included, and the finished waits' summary.
    fn wait_total(&self) -> (std::time::Duration, flowgate_tuner::LatencySummary) {
        let w = self.waits.lock();
        let current = w.since.map_or(0, |t0| nanos(t0, Instant::now()));
        (
            std::time::Duration::from_nanos(w.total_ns + current),
            w.hist.summary(),
        )
    }
}

/// Reads results from the last channel of a pipeline.
#[derive(Debug)]
pub struct SinkReader<T> {
    ch: Arc<Channel<T>>,
    local: VecDeque<Envelope<T>>,
    stats: Arc<SinkStats>,
    listener: Option<EventListener>,
    wait_start: Option<Instant>,
    ledger: Delivered,
}

impl<T: Send + 'static> SinkReader<T> {
    /// A reader of `ch`.
    pub fn new(ch: Arc<Channel<T>>) -> Self {
        Self {
            ch,
            local: VecDeque::new(),
            stats: Arc::new(SinkStats::new()),
            listener: None,
            wait_start: None,
            ledger: Delivered::default(),
        }
    }

    /// The source items of the current epoch handed to the consumer so far.
    pub fn ledger(&self) -> &Delivered {
        &self.ledger
    }

    /// Replaces the ledger (a new epoch: empty; a resumed one: the checkpoint's).
    pub fn set_ledger(&mut self, ledger: Delivered) {
        self.ledger = ledger;
    }

    /// The sink's control (budget, snapshot) for the control plane; `pinned` if the user set
    /// the sink's buffer (a tuner leaves it alone); `max_bytes`: a byte limit no budget the
    /// tuner sets may pass (a device budget; `u64::MAX` for none).
    pub fn control(&self, pinned: bool, max_bytes: u64) -> Arc<SinkControl<T>> {
        Arc::new(SinkControl {
            ch: Arc::clone(&self.ch),
            stats: Arc::clone(&self.stats),
            pinned,
            max_bytes,
        })
    }

    /// Hands `e` to the consumer, or drops it (`None`) if everything it carries was
    /// delivered before a resume (a part of an item the source produced again whole).
    fn deliver(&mut self, e: Envelope<T>) -> Option<Next<T>> {
        self.ch.budget().release(1, e.bytes + e.reserved);
        if self.ledger.reissued && self.ledger.covers(&e.origin) {
            return None;
        }
        self.stats.delivered.fetch_add(1, Ordering::Relaxed);
        self.ledger.record(&e.origin);
        Some(Next::Item(e.item))
    }

    /// Whatever is available without waiting; `None` means wait.
    fn poll_ready(&mut self) -> Option<Next<T>> {
        loop {
            let e = match self.local.pop_front() {
                Some(e) => e,
                None => {
                    let chunk = self.ch.try_recv()?;
                    self.local.extend(chunk);
                    continue;
                }
            };
            if let Some(n) = self.deliver(e) {
                return Some(n);
            }
        }
    }

    /// What to report when nothing is queued: end of epoch, closed, or `None` (wait).
    fn poll_end(&mut self) -> Option<Next<T>> {
        // Status before emptiness: `finish` follows the last send.
        let st = self.ch.budget().status();
        if !self.ch.is_empty() {
            if let Some(n) = self.poll_ready() {
                return Some(n);
            }
            // All of it was dropped as delivered before: what the status says holds.
        }
        if st.closed {
            return Some(Next::Closed);
        }
        st.finished.then_some(Next::EpochEnd(st.epoch))
    }

    /// Blocks for the next result.
    pub fn next_blocking(&mut self) -> Next<T> {
        self.next_until(None).expect("no deadline")
    }

    /// Blocks for the next result until `deadline` (`None`: for ever); `None` if it passed
    /// first (a caller that must stay responsive, to a signal say, waits in slices).
    pub fn next_until(&mut self, deadline: Option<Instant>) -> Option<Next<T>> {
        let mut waited_since = None;
        let r = loop {
            if let Some(n) = self.poll_ready() {
                break Some(n);
            }
            let listener = self.ch.budget().listen_data();
            if let Some(n) = self.poll_end() {
                break Some(n);
            }
            if waited_since.is_none() {
                let t0 = Instant::now();
                waited_since = Some(t0);
                self.stats.start_wait(t0);
            }
            // A consumer inside a budgeted stage's function gives its core back meanwhile.
            match deadline {
                None => crate::node::released_while(|| listener.wait()),
                Some(d) => {
                    if crate::node::released_while(|| listener.wait_deadline(d)).is_none() {
                        break None;
                    }
                }
            }
        };
        if let Some(t0) = waited_since {
            self.stats.waited(t0);
        }
        r
    }

    /// Polls for the next result (for `Stream`).
    pub fn poll_next(&mut self, cx: &mut Context<'_>) -> Poll<Next<T>> {
        loop {
            if let Some(n) = self.poll_ready() {
                return self.ready(n);
            }
            if let Some(listener) = &mut self.listener {
                if Pin::new(listener).poll(cx).is_pending() {
                    return Poll::Pending;
                }
                // Notified: re-check under a fresh listener.
                self.listener = None;
            }
            let listener = self.ch.budget().listen_data();
            if let Some(n) = self.poll_end() {
                return self.ready(n);
            }
            if self.wait_start.is_none() {
                let t0 = Instant::now();
                self.wait_start = Some(t0);
                self.stats.start_wait(t0);
            }
            self.listener = Some(listener);
        }
    }

    fn ready(&mut self, n: Next<T>) -> Poll<Next<T>> {
        self.listener = None;
        if let Some(t0) = self.wait_start.take() {
            self.stats.waited(t0);
        }
        Poll::Ready(n)
    }

    /// Results delivered so far.
    pub fn delivered(&self) -> u64 {
        self.stats.delivered.load(Ordering::Relaxed)
    }
}

/// The sink's side of the control plane: its budget and the consumer's statistics.
#[derive(Debug)]
pub struct SinkControl<T> {
    ch: Arc<Channel<T>>,
    stats: Arc<SinkStats>,
    pinned: bool,
    max_bytes: u64,
}

impl<T: Send + 'static> StageControl for SinkControl<T> {
    fn name(&self) -> &str {
        "sink"
    }

    fn resize(&self, _workers: usize) -> usize {
        1
    }

    fn set_budget(&self, items: usize, bytes: u64) {
        self.ch
            .budget()
            .set_limits(items, bytes.min(self.max_bytes));
    }

    fn snapshot(&self) -> StageStats {
        let mut s = self.stats.metrics.snapshot(Some(self.ch.budget()));
        s.budget_pinned = self.pinned;
        let delivered = self.stats.delivered.load(Ordering::Relaxed);
        s.items_in = delivered;
        s.items_out = delivered;
        (s.blocked_get, s.task_time) = self.stats.wait_total();
        s.items_per_s = delivered as f64 / s.elapsed.as_secs_f64().max(1e-9);
        s
    }

    fn stop(&self) {}

    fn join(&self) {}
}
