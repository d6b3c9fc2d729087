//! The source stage: pulls items from the user's iterator (on its own thread) or stream (on
//! tokio), one epoch per command.
//!
//! The source acquires item permits for a chunk *before* pulling, so with a stalled pipeline it
//! never holds an item it cannot place: the items pulled are exactly what the budgets allow.
//! Byte sizes are only known after pulling, so a chunk's permits are acquired at an estimate
//! (the largest recent item's size) and trued up to the real sizes once pulled: a byte budget
//! can be exceeded only by what one chunk's items exceed the estimate by. A chunk is sent when it is full or
//! when [`SourceSpec::linger`] passed since its first item, so a slow iterator still feeds the
//! pipeline item by item. A panicking iterator is fatal (its state is unknown afterwards).

use std::panic::AssertUnwindSafe;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use flowgate_tuner::StageStats;
use futures::{FutureExt, Stream, StreamExt};
use parking_lot::Mutex;
use tokio::runtime::Handle;

use crate::channel::{Admission, Channel, Envelope};
use crate::error::{ItemError, Panicked, PipelineError};
use crate::metrics::{nanos, WorkerCounters};
use crate::op::Sizer;
use crate::origin::{Origin, RangeSet};
use crate::stage::{StageControl, StageCore};

/// Makes the iterator of an epoch.
pub type IterFactory<T> = Box<dyn FnMut(u64) -> Box<dyn Iterator<Item = T> + Send> + Send>;
/// Makes the stream of an epoch.
pub type StreamFactory<T> =
    Box<dyn FnMut(u64) -> std::pin::Pin<Box<dyn Stream<Item = T> + Send>> + Send>;

/// Everything needed to start a source.
pub struct SourceSpec<T> {
    /// Identity, metrics, failures.
    pub core: StageCore,
    /// Where items go.
    pub output: Arc<Channel<T>>,
    /// Byte size of an item.
    pub sizer: Sizer<T>,
    /// Most items per chunk.
    pub chunk: usize,
    /// Longest a partial chunk waits for more items from a slow iterator.
    pub linger: Duration,
}

impl<T> std::fmt::Debug for SourceSpec<T> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("SourceSpec")
            .field("name", &self.core.name)
            .field("chunk", &self.chunk)
            .field("linger", &self.linger)
            .finish_non_exhaustive()
    }
}

struct Shared<T> {
    spec: SourceSpec<T>,
    seq: AtomicU64,
    /// The bytes a not-yet-pulled item is admitted at: the largest recent item's, decaying
    /// by an eighth per chunk (sizes are only known after pulling; each chunk is trued up).
    item_bytes: AtomicU64,
    /// Items of an epoch already delivered before a checkpoint: skipped when resuming.
    skip: Mutex<Option<(u64, RangeSet)>>,
}

/// Numbers an epoch's items and leaves out those a resumed consumer already has.
struct Indexer {
    next: u64,
    skip: Option<RangeSet>,
}

impl Indexer {
    /// The index of the next item, or `None` if it is to be skipped.
    #[inline]
    fn next(&mut self) -> Option<u64> {
        let i = self.next;
        self.next += 1;
        match &self.skip {
            Some(s) if s.contains(i) => None,
            _ => Some(i),
        }
    }
}

/// A running source. Start an epoch with [`SourceStage::run_epoch`].
pub struct SourceStage<T: Send + 'static> {
    shared: Arc<Shared<T>>,
    commands: Mutex<Option<flume::Sender<u64>>>,
    thread: Mutex<Option<JoinHandle<()>>>,
    task: Mutex<Option<tokio::task::JoinHandle<()>>>,
}

impl<T: Send + 'static> std::fmt::Debug for SourceStage<T> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("SourceStage")
            .field("name", &self.shared.spec.core.name)
            .finish_non_exhaustive()
    }
}

impl<T: Send + 'static> SourceStage<T> {
    /// Starts a source thread over the iterators `factory` makes.
    pub fn start_iter(
        spec: SourceSpec<T>,
        mut factory: IterFactory<T>,
    ) -> Result<Arc<Self>, PipelineError> {
        let (tx, rx) = flume::unbounded::<u64>();
        let shared = Arc::new(Shared {
            spec,
            seq: AtomicU64::new(0),
            item_bytes: AtomicU64::new(0),
            skip: Mutex::new(None),
        });
        let s = Arc::clone(&shared);
        let thread = std::thread::Builder::new()
            .name(format!("fg-{}", shared.spec.core.name))
            .spawn(move || {
                let span = tracing::debug_span!("stage", name = %s.spec.core.name);
                let _entered = span.enter();
                while let Ok(epoch) = rx.recv() {
                    let iter =
                        std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| factory(epoch)));
                    match iter {
                        Ok(iter) => {
                            if !s.pump_iter(epoch, iter) {
                                break;
                            }
                        }
                        Err(p) => {
                            s.fatal(&Panicked::from_payload(&*p));
                            break;
                        }
                    }
                }
            })
            .map_err(|e| PipelineError::runtime_from("spawning the source thread", e))?;
        Ok(Arc::new(Self {
            shared,
            commands: Mutex::new(Some(tx)),
            thread: Mutex::new(Some(thread)),
            task: Mutex::new(None),
        }))
    }

    /// Starts a source task on `runtime` over the streams `factory` makes.
    pub fn start_stream(
        spec: SourceSpec<T>,
        mut factory: StreamFactory<T>,
        runtime: &Handle,
    ) -> Result<Arc<Self>, PipelineError> {
        let (tx, rx) = flume::unbounded::<u64>();
        let shared = Arc::new(Shared {
            spec,
            seq: AtomicU64::new(0),
            item_bytes: AtomicU64::new(0),
            skip: Mutex::new(None),
        });
        let s = Arc::clone(&shared);
        let task = runtime.spawn(async move {
            while let Ok(epoch) = rx.recv_async().await {
                let pumped = AssertUnwindSafe(async {
                    let stream = factory(epoch);
                    s.pump_stream(epoch, stream).await
                })
                .catch_unwind()
                .await;
                match pumped {
                    Ok(true) => {}
                    Ok(false) => break,
                    Err(p) => {
                        s.fatal(&Panicked::from_payload(&*p));
                        break;
                    }
                }
            }
        });
        Ok(Arc::new(Self {
            shared,
            commands: Mutex::new(Some(tx)),
            thread: Mutex::new(None),
            task: Mutex::new(Some(task)),
        }))
    }

    /// In epoch `epoch`, leaves out the items whose index (position in the epoch) is in
    /// `done`: they were delivered before a checkpoint. Set it before the epoch starts.
    pub fn skip_in_epoch(&self, epoch: u64, done: RangeSet) {
        *self.shared.skip.lock() = Some((epoch, done));
    }

    /// Makes the source produce epoch `epoch` (after the ones already requested).
    pub fn run_epoch(&self, epoch: u64) {
        if let Some(tx) = &*self.commands.lock() {
            let _ = tx.send(epoch);
        }
    }
}

impl<T: Send + 'static> Shared<T> {
    fn fatal(&self, p: &Panicked) {
        let core = &self.spec.core;
        let err = ItemError::new(
            Arc::clone(&core.name),
            "the source iterator".to_owned(),
            Box::new(p.clone()),
        );
        core.ledger.set_fatal(PipelineError::failure_budget(
            format!("stage `{}`", core.name),
            1,
            err,
        ));
    }

    fn envelope(&self, item: T, index: u64) -> Envelope<T> {
        Envelope {
            seq: 0,
            bytes: (self.spec.sizer)(&item),
            reserved: 0,
            item,
            origin: Origin::source(index),
        }
    }

    fn indexer(&self, epoch: u64) -> Indexer {
        let mut skip = self.skip.lock();
        Indexer {
            next: 0,
            skip: match skip.take() {
                Some((e, s)) if e == epoch => Some(s),
                other => {
                    *skip = other;
                    None
                }
            },
        }
    }

    /// The bytes to admit a not-yet-pulled item at: the largest recent item's size.
    fn estimate(&self) -> u64 {
        self.item_bytes.load(Ordering::Relaxed)
    }

    /// Numbers, trues up and sends a pulled chunk, returning unused permits. `admitted` is
    /// what the permits were acquired as (each at [`estimate`](Self::estimate) bytes).
    fn ship(
        &self,
        mut chunk: Vec<Envelope<T>>,
        admitted: Admission,
        estimate: u64,
        c: &mut WorkerCounters,
    ) {
        let n = chunk.len();
        let permits = admitted.items;
        let budget = self.spec.output.budget();
        let per_permit = estimate + admitted.reserved;
        budget.release(permits - n, (permits - n) as u64 * per_permit);
        if n == 0 {
            return;
        }
        let base = self.seq.fetch_add(n as u64, Ordering::Relaxed);
        let (mut bytes, mut largest) = (0u64, 0u64);
        for (i, e) in chunk.iter_mut().enumerate() {
            e.seq = base + i as u64;
            e.reserved = admitted.reserved;
            bytes += e.bytes;
            largest = largest.max(e.bytes);
        }
        // Each was admitted at the estimate; charge what they really are.
        budget.adjust(bytes as i64 - (n as u64 * estimate) as i64);
        let est = self.item_bytes.load(Ordering::Relaxed);
        self.item_bytes
            .store(largest.max(est - est / 8), Ordering::Relaxed);
        self.spec.core.ledger.count_source_items(n as u64);
        c.c.items_out += n as u64;
        c.c.items_in += n as u64;
        self.spec.output.send(chunk);
    }

    /// Sends one epoch of `iter`; returns false when the pipeline is shutting down.
    fn pump_iter(&self, epoch: u64, mut iter: Box<dyn Iterator<Item = T> + Send>) -> bool {
        let mut c = WorkerCounters::default();
        let budget = self.spec.output.budget();
        let chunk_max = self.spec.chunk.max(1);
        let mut index = self.indexer(epoch);
        let mut exhausted = false;
        while !exhausted {
            let t0 = Instant::now();
            let estimate = self.estimate();
            let Ok(admitted) = budget.acquire(std::iter::repeat_n(estimate, chunk_max)) else {
                return false;
            };
            let permits = admitted.items;
            let start = Instant::now();
            c.c.put_wait_ns += nanos(t0, start);
            let mut chunk = Vec::with_capacity(permits);
            while chunk.len() < permits {
                match std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| iter.next())) {
                    Ok(Some(item)) => {
                        if let Some(i) = index.next() {
                            chunk.push(self.envelope(item, i));
                        }
                    }
                    Ok(None) => {
                        exhausted = true;
                        break;
                    }
                    Err(p) => {
                        budget.release(permits, permits as u64 * (estimate + admitted.reserved));
                        self.fatal(&Panicked::from_payload(&*p));
                        return false;
                    }
                }
                if chunk.len() % 4 == 0 && start.elapsed() >= self.spec.linger {
                    break;
                }
            }
            let now = Instant::now();
            c.c.busy_ns += nanos(start, now);
            self.ship(chunk, admitted, estimate, &mut c);
            c.maybe_flush(&self.spec.core.metrics, now);
        }
        c.flush(&self.spec.core.metrics, Instant::now());
        budget.finish(epoch);
        true
    }

    /// Sends one epoch of `stream`; returns false when the pipeline is shutting down.
    async fn pump_stream(
        &self,
        epoch: u64,
        mut stream: std::pin::Pin<Box<dyn Stream<Item = T> + Send>>,
    ) -> bool {
        let mut c = WorkerCounters::default();
        let budget = self.spec.output.budget();
        let chunk_max = self.spec.chunk.max(1);
        let mut index = self.indexer(epoch);
        loop {
            let t0 = Instant::now();
            let estimate = self.estimate();
            let Ok(admitted) = budget
                .acquire_async(std::iter::repeat_n(estimate, chunk_max))
                .await
            else {
                return false;
            };
            let permits = admitted.items;
            c.c.put_wait_ns += nanos(t0, Instant::now());
            let mut chunk = Vec::with_capacity(permits);
            // Wait for one item, then take only what is ready: no added latency.
            let mut exhausted = false;
            while chunk.is_empty() && !exhausted {
                match stream.next().await {
                    Some(item) => {
                        if let Some(i) = index.next() {
                            chunk.push(self.envelope(item, i));
                        }
                    }
                    None => exhausted = true,
                }
            }
            while !exhausted && chunk.len() < permits {
                match stream.next().now_or_never() {
                    Some(Some(item)) => {
                        if let Some(i) = index.next() {
                            chunk.push(self.envelope(item, i));
                        }
                    }
                    Some(None) => exhausted = true,
                    None => break,
                }
            }
            self.ship(chunk, admitted, estimate, &mut c);
            c.maybe_flush(&self.spec.core.metrics, Instant::now());
            if exhausted {
                break;
            }
        }
        c.flush(&self.spec.core.metrics, Instant::now());
        budget.finish(epoch);
        true
    }
}

impl<T: Send + 'static> StageControl for SourceStage<T> {
    fn name(&self) -> &str {
        &self.shared.spec.core.name
    }

    fn resize(&self, _workers: usize) -> usize {
        1
    }

    fn set_budget(&self, _items: usize, _bytes: u64) {}

    fn snapshot(&self) -> StageStats {
        self.shared.spec.core.metrics.snapshot(None)
    }

    fn stop(&self) {
        // Dropping the command sender ends the source loop after the current epoch's send
        // (which fails as soon as the channels are closed).
        self.commands.lock().take();
    }

    fn join(&self) {
        if let Some(t) = self.thread.lock().take() {
            let _ = t.join();
        }
        if let Some(t) = self.task.lock().take() {
            t.abort();
            let _ = futures::executor::block_on(t);
        }
    }
}
