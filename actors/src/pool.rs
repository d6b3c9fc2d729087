//! A pool stage: synchronous per-item work on a resizable work-stealing thread pool.
//!
//! # Design
//!
//! Each worker thread owns a FIFO `crossbeam_deque::Worker`; the stage shares an `Injector` and
//! every worker's `Stealer`. A worker looks for its next item in this order: its own deque, the
//! injector, the input channel (a whole chunk moves into its deque, and an idle peer is woken to
//! steal from it), then the other workers' deques. Chunks keep channel traffic per batch; stealing
//! keeps a chunk of slow items from serialising on one thread.
//!
//! Results are sent downstream when a worker's deque runs dry or its run reaches the chunk
//! size (see [`crate::emit`]); in [`Order::Input`] they go through the stage's reorder window,
//! and whichever worker completes the window's head emits everything that is ready.
//!
//! # Resizing
//!
//! All threads up to the largest size ever requested exist; only the first `active` of them
//! work. A worker with an index at or above `active` hands its deque to the injector, flushes
//! its results and parks on the `park` event, costing nothing. Items are never dropped or
//! duplicated by a resize: every item sits in exactly one deque, the injector, the channel, or
//! a worker's hands. Workers beyond the first need a token from the process-wide
//! [`cap`](crate::cap). On a node CPU budget ([`node`](crate::node)) a worker also holds one
//! of the node's cores for each item it runs.
//!
//! # End of epoch and shutdown
//!
//! An idle worker finishes the epoch downstream when the input is finished and the stage holds
//! nothing (its input budget is empty: every item left). Shutdown sets `stopping`, wakes
//! everyone, and threads exit after their current item.

use std::sync::atomic::{AtomicBool, AtomicU64, AtomicUsize, Ordering};
use std::sync::Arc;
use std::thread::JoinHandle;
use std::time::Instant;

use crossbeam_deque::{Injector, Steal, Stealer, Worker};
use event_listener::{Event, Listener};
use flowgate_tuner::StageStats;
use parking_lot::Mutex;

use crate::cap;
use crate::channel::{Channel, Closed, Envelope};
use crate::emit::{flush, Done, Order, OutputLedger, Reorder, Run};
use crate::error::PipelineError;
use crate::failure::collect_skipped_parts;
use crate::metrics::{nanos, WorkerCounters};
use crate::node;
use crate::op::{call_caught, Describe, Op, Sizer};
use crate::origin::Origin;
use crate::stage::{StageControl, StageCore};

/// A worker thread's stack: a Python thread's (8 MiB, the platform's default), not Rust's
/// 2 MiB. Stage functions run users' code — a Python `map=`'s deep recursion in C (a `repr`
/// of deeply nested data) overflowed the smaller stack and killed the process. Only the
/// pages used are committed.
const WORKER_STACK: usize = 8 << 20;

/// Everything needed to start a pool stage.
pub struct PoolSpec<T, U> {
    /// Identity, metrics, failures.
    pub core: StageCore,
    /// The channel the stage consumes (its budget is the stage's budget).
    pub input: Arc<Channel<T>>,
    /// The channel the stage produces into.
    pub output: Arc<Channel<U>>,
    /// The per-item work.
    pub op: Box<dyn Op<T, U>>,
    /// Byte size of an output.
    pub sizer: Sizer<U>,
    /// Optional item description for errors.
    pub describe: Option<Describe<T>>,
    /// Output order.
    pub order: Order,
    /// Results per send.
    pub chunk: usize,
    /// Most workers the stage may ever run.
    pub max_workers: usize,
    /// Whether each item holds a core of the process's node CPU budget
    /// ([`node`](crate::node)).
    pub budgeted: bool,
}

impl<T, U> std::fmt::Debug for PoolSpec<T, U> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("PoolSpec")
            .field("name", &self.core.name)
            .field("order", &self.order)
            .field("chunk", &self.chunk)
            .finish_non_exhaustive()
    }
}

struct InOrder<U> {
    window: Reorder<U>,
    emitting: bool,
}

impl<U> Default for InOrder<U> {
    fn default() -> Self {
        Self {
            window: Reorder::default(),
            emitting: false,
        }
    }
}

struct Shared<T, U> {
    core: StageCore,
    input: Arc<Channel<T>>,
    output: Arc<Channel<U>>,
    op: Box<dyn Op<T, U>>,
    sizer: Sizer<U>,
    describe: Option<Describe<T>>,
    order: Order,
    chunk: usize,
    budgeted: bool,
    injector: Injector<Envelope<T>>,
    stealers: Vec<Stealer<Envelope<T>>>,
    active: AtomicUsize,
    park: Event,
    stopping: AtomicBool,
    out_seq: AtomicU64,
    in_order: Mutex<InOrder<U>>,
}

thread_local! {
    /// Whether the stage whose worker this thread is shuts down; `None` outside a worker.
    static STOPPING: std::cell::RefCell<Option<Box<dyn Fn() -> bool>>> =
        const { std::cell::RefCell::new(None) };
}

/// Whether the pool stage running the calling thread is shutting down (its pipeline is
/// dropped or stopped); `false` on any other thread. A stage's function that waits for
/// something slow (a download, a lock another process holds) checks it between short waits,
/// so shutdown does not wait for the slow thing to finish.
pub fn stopping() -> bool {
    STOPPING.with(|s| s.borrow().as_ref().is_some_and(|f| f()))
}

impl<T, U> Shared<T, U> {
    fn should_exit(&self) -> bool {
        self.stopping.load(Ordering::Acquire) || self.input.budget().is_closed()
    }
}

struct Threads<T> {
    /// Deques not yet handed to a thread, by worker index.
    deques: Vec<Option<Worker<Envelope<T>>>>,
    handles: Vec<JoinHandle<()>>,
    /// Tokens held from the process-wide cap (workers beyond the first).
    tokens: usize,
}

/// A running pool stage.
pub struct PoolStage<T: Send + 'static, U: Send + 'static> {
    shared: Arc<Shared<T, U>>,
    threads: Mutex<Threads<T>>,
    max_workers: usize,
}

impl<T: Send + 'static, U: Send + 'static> std::fmt::Debug for PoolStage<T, U> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("PoolStage")
            .field("name", &self.shared.core.name)
            .field("active", &self.shared.active)
            .finish_non_exhaustive()
    }
}

impl<T: Send + 'static, U: Send + 'static> PoolStage<T, U> {
    /// Starts the stage with `workers` active workers (subject to the cap).
    pub fn start(spec: PoolSpec<T, U>, workers: usize) -> Result<Arc<Self>, PipelineError> {
        let max_workers = spec.max_workers.max(1);
        let deques: Vec<_> = (0..max_workers).map(|_| Worker::new_fifo()).collect();
        let stealers = deques.iter().map(Worker::stealer).collect();
        let shared = Arc::new(Shared {
            core: spec.core,
            input: spec.input,
            output: spec.output,
            op: spec.op,
            sizer: spec.sizer,
            describe: spec.describe,
            order: spec.order,
            chunk: spec.chunk.max(1),
            budgeted: spec.budgeted,
            injector: Injector::new(),
            stealers,
            active: AtomicUsize::new(0),
            park: Event::new(),
            stopping: AtomicBool::new(false),
            out_seq: AtomicU64::new(0),
            in_order: Mutex::new(InOrder::default()),
        });
        // Admission reserves for this stage's outputs (see the channel module's docs).
        shared.input.budget().reserve_outputs();
        let stage = Arc::new(Self {
            shared,
            threads: Mutex::new(Threads {
                deques: deques.into_iter().map(Some).collect(),
                handles: Vec::new(),
                tokens: 0,
            }),
            max_workers,
        });
        if stage.resize_to(workers)? == 0 {
            return Err(PipelineError::runtime("could not start any worker thread"));
        }
        Ok(stage)
    }

    fn resize_to(&self, want: usize) -> Result<usize, PipelineError> {
        let want_extra = want.clamp(1, self.max_workers) - 1;
        let mut th = self.threads.lock();
        if self.shared.stopping.load(Ordering::Acquire) {
            return Ok(self.shared.active.load(Ordering::Acquire));
        }
        if want_extra > th.tokens {
            th.tokens += cap::acquire(want_extra - th.tokens);
        } else {
            cap::release(th.tokens - want_extra);
            th.tokens = want_extra;
        }
        let mut n = th.tokens + 1;
        while th.handles.len() < n {
            let idx = th.handles.len();
            let deque = th.deques[idx]
                .take()
                .expect("each deque is handed out once");
            let shared = Arc::clone(&self.shared);
            let name = format!("fg-{}-{idx}", shared.core.name);
            match std::thread::Builder::new()
                .name(name)
                .stack_size(WORKER_STACK)
                .spawn(move || WorkerLoop::new(idx, deque, shared).run())
            {
                Ok(h) => th.handles.push(h),
                Err(e) if idx == 0 => {
                    return Err(PipelineError::runtime_from("spawning a worker", e))
                }
                Err(e) => {
                    tracing::warn!(stage = %self.shared.core.name, error = %e, "could not spawn a worker");
                    cap::release(n - idx);
                    th.tokens = idx - 1;
                    n = idx;
                    break;
                }
            }
        }
        self.shared.active.store(n, Ordering::Release);
        self.shared.park.notify(usize::MAX);
        self.shared.input.budget().notify_data(usize::MAX);
        tracing::debug!(stage = %self.shared.core.name, workers = n, "resized");
        Ok(n)
    }
}

impl<T: Send + 'static, U: Send + 'static> StageControl for PoolStage<T, U> {
    fn name(&self) -> &str {
        &self.shared.core.name
    }

    fn resize(&self, workers: usize) -> usize {
        self.resize_to(workers)
            .unwrap_or_else(|_| self.shared.active.load(Ordering::Acquire))
    }

    fn set_budget(&self, items: usize, bytes: u64) {
        self.shared.input.budget().set_limits(items, bytes);
    }

    fn snapshot(&self) -> StageStats {
        self.shared.core.snapshot(
            self.shared.input.budget(),
            self.shared.active.load(Ordering::Acquire),
            self.max_workers,
        )
    }

    fn stop(&self) {
        self.shared.stopping.store(true, Ordering::Release);
        self.shared.park.notify(usize::MAX);
        self.shared.input.budget().notify_data(usize::MAX);
    }

    fn join(&self) {
        let (handles, tokens) = {
            let mut th = self.threads.lock();
            (
                std::mem::take(&mut th.handles),
                std::mem::take(&mut th.tokens),
            )
        };
        for h in handles {
            let _ = h.join();
        }
        cap::release(tokens);
    }
}

/// One worker thread's state.
struct WorkerLoop<T, U> {
    idx: usize,
    local: Worker<Envelope<T>>,
    s: Arc<Shared<T, U>>,
    counters: WorkerCounters,
    /// Results not yet sent (completion order) or being emitted (input order).
    run: Run<U>,
    /// Output bytes made since the last emit, against what their inputs reserved.
    ledger: OutputLedger,

    /// Results not yet deposited in the reorder window (input order).
    pending: Vec<(u64, Done<U>)>,
    /// Outputs of the current item.
    scratch: Vec<U>,
    /// When the item of the oldest result not yet sent started: results wait for a run to
    /// fill for at most [`HOLD`] (a run of slow items goes out item by item).
    held_since: Option<Instant>,
    /// End of the previous item (or of the last wait): the start of the next item.
    last: Instant,
}

/// The longest a result waits in its worker for the rest of its run: well under any training
/// step. Fast items (microseconds) still go out in runs of the chunk size; an item slower than
/// this (a batch made by a user's `__getitem__` calls) goes out as soon as it is made, not
/// when its worker's whole chunk is done (which held ready batches back for seconds).
const HOLD: std::time::Duration = std::time::Duration::from_micros(500);

impl<T: Send + 'static, U: Send + 'static> WorkerLoop<T, U> {
    fn new(idx: usize, local: Worker<Envelope<T>>, s: Arc<Shared<T, U>>) -> Self {
        Self {
            idx,
            local,
            s,
            counters: WorkerCounters::default(),
            run: Run::default(),
            pending: Vec::new(),
            ledger: OutputLedger::default(),
            scratch: Vec::new(),
            held_since: None,
            last: Instant::now(),
        }
    }

    fn run(mut self) {
        let span = tracing::debug_span!("stage", name = %self.s.core.name, worker = self.idx);
        let _entered = span.enter();
        let shared = Arc::downgrade(&self.s);
        STOPPING.with(|s| {
            *s.borrow_mut() = Some(Box::new(move || {
                shared
                    .upgrade()
                    .is_none_or(|sh| sh.stopping.load(Ordering::Acquire))
            }))
        });
        while !self.s.should_exit() {
            if self.idx >= self.s.active.load(Ordering::Acquire) {
                if self.park().is_err() {
                    break;
                }
                continue;
            }
            let item = match self.find_work() {
                Some(item) => Some(item),
                None => match self.idle() {
                    Ok(item) => item,
                    Err(Closed) => break,
                },
            };
            let Some(item) = item else { continue };
            // The item's start and end as its timing has them (no clock read of its own).
            let started = self.last;
            self.process(item);
            let pending = self.run.out.len() + self.pending.len();
            // Since the run's first item started (this one's, for a run of one).
            let held = pending > 0 && {
                let since = *self.held_since.get_or_insert(started);
                self.last.saturating_duration_since(since) >= HOLD
            };
            if pending >= self.s.chunk || self.local.is_empty() || held {
                self.held_since = None;
                if self.emit().is_err() {
                    break;
                }
            }
        }
        self.counters.flush(&self.s.core.metrics, Instant::now());
    }

    fn find_work(&self) -> Option<Envelope<T>> {
        if let Some(e) = self.local.pop() {
            return Some(e);
        }
        if let Some(e) = steal(|| self.s.injector.steal_batch_and_pop(&self.local)) {
            return Some(e);
        }
        if let Some(chunk) = self.s.input.try_recv() {
            let mut it = chunk.into_iter();
            let first = it.next();
            for e in it {
                self.local.push(e);
            }
            if !self.local.is_empty() || !self.s.input.is_empty() {
                // Let an idle peer steal from this chunk or take the next one.
                self.s.input.budget().notify_data(1);
            }
            return first;
        }
        let n = self.s.stealers.len();
        (1..n)
            .map(|k| &self.s.stealers[(self.idx + k) % n])
            .find_map(|st| steal(|| st.steal_batch_and_pop(&self.local)))
    }

    fn process(&mut self, env: Envelope<T>) {
        let Envelope {
            seq,
            bytes: own_bytes,
            reserved,
            item,
            origin,
        } = env;
        self.counters.c.items_in += 1;
        // On a node CPU budget, the item runs on one of the node's cores (see `node`).
        let core = if self.s.budgeted {
            node::hold_for_item(&|| self.s.stopping.load(Ordering::Acquire))
        } else {
            Ok(None)
        };
        if matches!(core, Ok(Some(_))) {
            // Waiting for a core is neither work nor a wait for input.
            self.last = Instant::now();
        }
        let desc = self.s.describe.as_ref().map(|d| d(&item));
        let (result, parts) = match core {
            Ok(core) => {
                let r = collect_skipped_parts(|| call_caught(&*self.s.op, item, &mut self.scratch));
                drop(core);
                r
            }
            Err(node::NoCore::Stopped) => return, // shutting down: the item is not run
            // The item fails (counted or fatal, as configured), never silently dropped.
            Err(node::NoCore::Failed(e)) => (Err(e.into()), Default::default()),
        };
        let now = Instant::now();
        let dt = nanos(self.last, now);
        self.last = now;
        let c = &mut self.counters.c;
        c.busy_ns += dt;
        c.task_time.record_ns(dt);
        if let Err(cause) = result {
            self.scratch.clear();
            let item = desc.unwrap_or_else(|| format!("input #{seq}"));
            self.s.core.fail(c, item, cause);
        } else if self.s.core.fail_parts(c, parts) {
            // A part past a budget: the item it was left out of is not delivered.
            self.scratch.clear();
        }
        c.items_out += self.scratch.len() as u64;
        let sizer = &self.s.sizer;
        let n = self.scratch.len();
        let mut whole = Some(origin);
        // The input's mark releases its outputs' bytes too: sum them as they are made.
        let mut out_bytes = 0u64;
        let outputs = self.scratch.drain(..).enumerate().map(|(k, o)| {
            let bytes = sizer(&o);
            out_bytes += bytes;
            Envelope {
                seq: 0,
                bytes,
                reserved: 0,
                item: o,
                origin: match n {
                    1 => whole.take().unwrap_or_default(),
                    _ => whole.as_ref().map_or(Origin::None, |w| w.part(k, n)),
                },
            }
        });
        match self.s.order {
            Order::Completion => {
                self.run.out.extend(outputs);
                let in_bytes = self.ledger.record(own_bytes, reserved, out_bytes);
                self.run.complete_input(in_bytes);
            }
            Order::Input => {
                let outputs = outputs.collect();
                let in_bytes = self.ledger.record(own_bytes, reserved, out_bytes);
                self.pending.push((seq, Done { in_bytes, outputs }));
            }
        }
        self.counters.maybe_flush(&self.s.core.metrics, now);
    }

    /// Sends (or deposits, in input order) the results gathered so far.
    fn emit(&mut self) -> Result<(), Closed> {
        let s = &*self.s;
        // Outputs are charged before any mark that releases them (both orders).
        self.ledger.apply(s.input.budget());
        if self.local.is_empty() {
            // End of a run: publish the counters before the results, so that statistics taken
            // once the consumer has every result are exact (a lock and a few adds per run).
            self.counters.flush(&s.core.metrics, self.last);
        }
        match s.order {
            Order::Completion => {
                if !self.run.is_empty() {
                    let waited = flush(&mut self.run, &s.output, s.input.budget(), &s.out_seq)?;
                    self.counters.c.put_wait_ns += waited;
                }
            }
            Order::Input => {
                if self.pending.is_empty() {
                    return Ok(());
                }
                let mut g = s.in_order.lock();
                for (seq, done) in self.pending.drain(..) {
                    g.window.insert(seq, done);
                }
                if g.emitting {
                    return Ok(()); // the current emitter will send these
                }
                g.emitting = true;
                loop {
                    g.window.drain_ready(&mut self.run);
                    if self.run.is_empty() {
                        g.emitting = false;
                        return Ok(());
                    }
                    drop(g);
                    let r = flush(&mut self.run, &s.output, s.input.budget(), &s.out_seq);
                    g = s.in_order.lock();
                    match r {
                        Ok(waited) => self.counters.c.put_wait_ns += waited,
                        Err(e) => {
                            g.emitting = false;
                            return Err(e);
                        }
                    }
                }
            }
        }
        self.last = Instant::now();
        Ok(())
    }

    /// Nothing to do: send what we have, end the epoch downstream if it is over, and wait.
    fn idle(&mut self) -> Result<Option<Envelope<T>>, Closed> {
        self.emit()?;
        let now = Instant::now();
        self.counters.flush(&self.s.core.metrics, now);
        let budget = self.s.input.budget();
        let listener = budget.listen_data();
        if let Some(e) = self.find_work() {
            self.last = Instant::now();
            return Ok(Some(e));
        }
        if self.s.should_exit() {
            return Err(Closed);
        }
        if self.idx >= self.s.active.load(Ordering::Acquire) {
            return Ok(None);
        }
        let st = budget.status();
        if st.finished && st.used_items == 0 {
            self.s.output.budget().finish(st.epoch);
        }
        let t0 = Instant::now();
        listener.wait();
        self.last = Instant::now();
        self.counters.c.get_wait_ns += nanos(t0, self.last);
        Ok(None)
    }

    /// Deactivated: hand the deque to the injector, send results, and sleep until reactivated.
    fn park(&mut self) -> Result<(), Closed> {
        while let Some(e) = self.local.pop() {
            self.s.injector.push(e);
        }
        // Pass the baton, always: besides the items just handed over, this worker may have
        // consumed a "work available" notification meant for an active worker (a chunk sent
        // while it was still waiting as an active one), and it will not take that work now.
        self.s.input.budget().notify_data(1);
        self.emit()?;
        self.counters.flush(&self.s.core.metrics, Instant::now());
        let listener = self.s.park.listen();
        if self.idx < self.s.active.load(Ordering::Acquire) || self.s.should_exit() {
            return Ok(());
        }
        listener.wait();
        self.last = Instant::now();
        Ok(())
    }
}

/// Retries a steal until it succeeds or finds nothing.
#[inline]
fn steal<E>(mut f: impl FnMut() -> Steal<E>) -> Option<E> {
    loop {
        match f() {
            Steal::Success(e) => return Some(e),
            Steal::Empty => return None,
            Steal::Retry => std::hint::spin_loop(),
        }
    }
}
