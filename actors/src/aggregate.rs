//! The aggregate stage: groups consecutive items into batches of a fixed size.
//!
//! One thread, no user code. A batch counts for the bytes of its items, and the permits of its
//! items are released when the batch enters the next channel. The stage's input budget has a
//! floor of one batch so that a byte budget can never keep a batch from filling. At the end of
//! an epoch the last, partial batch is sent, or dropped (and counted) with `drop_last`.

use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::Arc;
use std::thread::JoinHandle;
use std::time::Instant;

use event_listener::Listener;
use flowgate_tuner::StageStats;
use parking_lot::Mutex;

use crate::channel::{Channel, Closed, Envelope};
use crate::emit::{flush, Mark, Run};
use crate::error::PipelineError;
use crate::metrics::{nanos, WorkerCounters};
use crate::stage::{StageControl, StageCore};

/// A running aggregate stage.
pub struct AggregateStage<T: Send + 'static> {
    shared: Arc<Shared<T>>,
    handle: Mutex<Option<JoinHandle<()>>>,
}

impl<T: Send + 'static> std::fmt::Debug for AggregateStage<T> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("AggregateStage")
            .field("name", &self.shared.core.name)
            .field("size", &self.shared.size)
            .finish_non_exhaustive()
    }
}

struct Shared<T> {
    core: StageCore,
    input: Arc<Channel<T>>,
    output: Arc<Channel<Vec<T>>>,
    size: usize,
    drop_last: bool,
    stopping: AtomicBool,
    dropped: AtomicU64,
    out_seq: AtomicU64,
}

impl<T: Send + 'static> AggregateStage<T> {
    /// Starts a stage that batches `size` items, dropping a partial last batch if `drop_last`.
    pub fn start(
        core: StageCore,
        input: Arc<Channel<T>>,
        output: Arc<Channel<Vec<T>>>,
        size: usize,
        drop_last: bool,
    ) -> Result<Arc<Self>, PipelineError> {
        let size = size.max(1);
        input.budget().set_floor(size);
        let shared = Arc::new(Shared {
            core,
            input,
            output,
            size,
            drop_last,
            stopping: AtomicBool::new(false),
            dropped: AtomicU64::new(0),
            out_seq: AtomicU64::new(0),
        });
        let s = Arc::clone(&shared);
        let handle = std::thread::Builder::new()
            .name(format!("fg-{}", shared.core.name))
            .spawn(move || Batcher::new(s).run())
            .map_err(|e| PipelineError::runtime_from("spawning the aggregate thread", e))?;
        Ok(Arc::new(Self {
            shared,
            handle: Mutex::new(Some(handle)),
        }))
    }

    /// Items dropped in partial last batches (`drop_last`).
    pub fn dropped(&self) -> u64 {
        self.shared.dropped.load(Ordering::Relaxed)
    }
}

impl<T: Send + 'static> StageControl for AggregateStage<T> {
    fn name(&self) -> &str {
        &self.shared.core.name
    }

    fn resize(&self, _workers: usize) -> usize {
        1
    }

    fn set_budget(&self, items: usize, bytes: u64) {
        self.shared.input.budget().set_limits(items, bytes);
    }

    fn snapshot(&self) -> StageStats {
        self.shared.core.snapshot(self.shared.input.budget(), 1, 1)
    }

    fn stop(&self) {
        self.shared.stopping.store(true, Ordering::Release);
        self.shared.input.budget().notify_data(usize::MAX);
    }

    fn join(&self) {
        if let Some(h) = self.handle.lock().take() {
            let _ = h.join();
        }
    }
}

struct Batcher<T> {
    s: Arc<Shared<T>>,
    buf: Vec<T>,
    /// The buffered items' own bytes (the batch's size).
    buf_bytes: u64,
    /// What the buffered items were charged on admission (their own bytes and any reserve).
    buf_charged: u64,
    buf_origin: crate::origin::Gather,
    run: Run<Vec<T>>,
    counters: WorkerCounters,
    finished_epoch: Option<u64>,
}

impl<T: Send + 'static> Batcher<T> {
    fn new(s: Arc<Shared<T>>) -> Self {
        let buf = Vec::with_capacity(s.size);
        Self {
            s,
            buf,
            buf_bytes: 0,
            buf_charged: 0,
            buf_origin: Default::default(),
            run: Run::default(),
            counters: WorkerCounters::default(),
            finished_epoch: None,
        }
    }

    fn run(mut self) {
        let span = tracing::debug_span!("stage", name = %self.s.core.name);
        let _entered = span.enter();
        while self.step().is_ok() {}
        self.counters.flush(&self.s.core.metrics, Instant::now());
    }

    fn step(&mut self) -> Result<(), Closed> {
        if self.s.stopping.load(Ordering::Acquire) || self.s.input.budget().is_closed() {
            return Err(Closed);
        }
        if let Some(chunk) = self.s.input.try_recv() {
            return self.take(chunk);
        }
        self.counters.flush(&self.s.core.metrics, Instant::now());
        let budget = self.s.input.budget();
        let listener = budget.listen_data();
        // Status before emptiness: `finish` follows the last send, so a finished epoch seen
        // here with an empty queue really has no items left.
        let st = budget.status();
        if !self.s.input.is_empty() {
            return Ok(());
        }
        if st.closed || self.s.stopping.load(Ordering::Acquire) {
            return Err(Closed);
        }
        if st.finished && self.finished_epoch != Some(st.epoch) {
            self.end_epoch(st.epoch)?;
            return Ok(());
        }
        let t0 = Instant::now();
        listener.wait();
        self.counters.c.get_wait_ns += nanos(t0, Instant::now());
        Ok(())
    }

    fn take(&mut self, chunk: Vec<Envelope<T>>) -> Result<(), Closed> {
        self.counters.c.items_in += chunk.len() as u64;
        for env in chunk {
            self.buf.push(env.item);
            self.buf_bytes += env.bytes;
            self.buf_charged += env.bytes + env.reserved;
            self.buf_origin.add(&env.origin);
            if self.buf.len() == self.s.size {
                self.seal();
            }
        }
        self.send()
    }

    /// Moves the current buffer into the run as one batch.
    fn seal(&mut self) {
        let n = self.buf.len();
        let batch = std::mem::replace(&mut self.buf, Vec::with_capacity(self.s.size));
        let bytes = std::mem::take(&mut self.buf_bytes);
        let charged = std::mem::take(&mut self.buf_charged);
        self.run.out.push(Envelope {
            seq: 0,
            bytes,
            reserved: 0,
            item: batch,
            origin: self.buf_origin.take(),
        });
        self.run.marks.push(Mark {
            end: self.run.out.len(),
            items: n,
            bytes: charged,
        });
        self.counters.c.items_out += 1;
    }

    fn send(&mut self) -> Result<(), Closed> {
        if !self.run.is_empty() {
            // Counters before results: see the pool stage.
            self.counters.flush(&self.s.core.metrics, Instant::now());
            let s = &*self.s;
            let waited = flush(&mut self.run, &s.output, s.input.budget(), &s.out_seq)?;
            self.counters.c.put_wait_ns += waited;
        }
        Ok(())
    }

    fn end_epoch(&mut self, epoch: u64) -> Result<(), Closed> {
        if !self.buf.is_empty() {
            if self.s.drop_last {
                let n = self.buf.len();
                self.s.dropped.fetch_add(n as u64, Ordering::Relaxed);
                self.buf.clear();
                self.buf_origin.take();
                self.s
                    .input
                    .budget()
                    .release(n, std::mem::take(&mut self.buf_charged));
                self.buf_bytes = 0;
            } else {
                self.seal();
                self.send()?;
            }
        }
        self.s.output.budget().finish(epoch);
        self.finished_epoch = Some(epoch);
        Ok(())
    }
}
