//! An async stage: per-item futures on tokio, with resizable bounded concurrency.
//!
//! A driver task takes items from the input channel and spawns one task per item, holding a
//! permit of a `tokio::sync::Semaphore` whose size is the stage's concurrency (grown with
//! `add_permits`, shrunk by acquiring and forgetting permits). Finished items go to a single
//! emitter task, which reorders them in [`Order::Input`] and sends them downstream in batches,
//! so the per-item tasks never contend on the output channel.

use std::future::Future;
use std::panic::AssertUnwindSafe;
use std::pin::Pin;
use std::sync::atomic::{AtomicBool, AtomicU64, AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::Instant;

use flowgate_tuner::StageStats;
use futures::FutureExt;
use parking_lot::Mutex;
use tokio::runtime::Handle;
use tokio::sync::{mpsc, Semaphore};
use tokio::task::{JoinHandle, JoinSet};

use crate::channel::{Channel, Envelope};
use crate::emit::{flush_async, Done, Order, OutputLedger, Reorder, Run};
use crate::error::{BoxError, Panicked, PipelineError};
use crate::metrics::{nanos, WorkerCounters};
use crate::op::{Describe, Sizer};
use crate::stage::{StageControl, StageCore};

/// A boxed future returned by an async stage function.
pub type BoxFuture<U> = Pin<Box<dyn Future<Output = Result<U, BoxError>> + Send + 'static>>;
/// The function of an async stage.
pub type AsyncFn<T, U> = Arc<dyn Fn(T) -> BoxFuture<U> + Send + Sync>;

/// Everything needed to start an async stage.
pub struct AsyncSpec<T, U> {
    /// Identity, metrics, failures.
    pub core: StageCore,
    /// The channel the stage consumes.
    pub input: Arc<Channel<T>>,
    /// The channel the stage produces into.
    pub output: Arc<Channel<U>>,
    /// The per-item function.
    pub f: AsyncFn<T, U>,
    /// Byte size of an output.
    pub sizer: Sizer<U>,
    /// Optional item description for errors.
    pub describe: Option<Describe<T>>,
    /// Output order.
    pub order: Order,
    /// Most items in flight the stage may ever have.
    pub max_concurrency: usize,
}

impl<T, U> std::fmt::Debug for AsyncSpec<T, U> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("AsyncSpec")
            .field("name", &self.core.name)
            .field("order", &self.order)
            .finish_non_exhaustive()
    }
}

struct Completed<U> {
    seq: u64,
    origin: crate::origin::Origin,
    in_bytes: u64,
    reserved: u64,
    started: Instant,
    desc: Option<String>,
    result: Result<U, BoxError>,
    /// Parts the item left out (see [`skip_part`](crate::failure::skip_part)).
    parts: crate::failure::SkippedParts,
}

struct Shared<T, U> {
    core: StageCore,
    input: Arc<Channel<T>>,
    output: Arc<Channel<U>>,
    f: AsyncFn<T, U>,
    sizer: Sizer<U>,
    describe: Option<Describe<T>>,
    order: Order,
    sem: Arc<Semaphore>,
    concurrency: AtomicUsize,
    stopping: AtomicBool,
    out_seq: AtomicU64,
}

/// A running async stage.
pub struct AsyncStage<T: Send + 'static, U: Send + 'static> {
    shared: Arc<Shared<T, U>>,
    runtime: Handle,
    tasks: Mutex<Vec<JoinHandle<()>>>,
    resize_lock: Mutex<()>,
    max: usize,
}

impl<T: Send + 'static, U: Send + 'static> std::fmt::Debug for AsyncStage<T, U> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("AsyncStage")
            .field("name", &self.shared.core.name)
            .field("concurrency", &self.shared.concurrency)
            .finish_non_exhaustive()
    }
}

impl<T: Send + 'static, U: Send + 'static> AsyncStage<T, U> {
    /// Starts the stage on `runtime` with `concurrency` items in flight at most.
    pub fn start(
        spec: AsyncSpec<T, U>,
        concurrency: usize,
        runtime: Handle,
    ) -> Result<Arc<Self>, PipelineError> {
        let max = spec.max_concurrency.max(1);
        let concurrency = concurrency.clamp(1, max);
        let shared = Arc::new(Shared {
            core: spec.core,
            input: spec.input,
            output: spec.output,
            f: spec.f,
            sizer: spec.sizer,
            describe: spec.describe,
            order: spec.order,
            sem: Arc::new(Semaphore::new(concurrency)),
            concurrency: AtomicUsize::new(concurrency),
            stopping: AtomicBool::new(false),
            out_seq: AtomicU64::new(0),
        });
        // Admission reserves for this stage's outputs (see the channel module's docs).
        shared.input.budget().reserve_outputs();
        let (tx, rx) = mpsc::unbounded_channel();
        let driver = runtime.spawn(drive(Arc::clone(&shared), tx));
        let emitter = runtime.spawn(emit(Arc::clone(&shared), rx));
        Ok(Arc::new(Self {
            shared,
            runtime,
            tasks: Mutex::new(vec![driver, emitter]),
            resize_lock: Mutex::new(()),
            max,
        }))
    }
}

impl<T: Send + 'static, U: Send + 'static> StageControl for AsyncStage<T, U> {
    fn name(&self) -> &str {
        &self.shared.core.name
    }

    fn resize(&self, workers: usize) -> usize {
        let _g = self.resize_lock.lock();
        let want = workers.clamp(1, self.max);
        let cur = self.shared.concurrency.swap(want, Ordering::AcqRel);
        if want > cur {
            self.shared.sem.add_permits(want - cur);
        } else if want < cur {
            let sem = Arc::clone(&self.shared.sem);
            let n = u32::try_from(cur - want).unwrap_or(u32::MAX);
            self.runtime.spawn(async move {
                if let Ok(p) = sem.acquire_many_owned(n).await {
                    p.forget();
                }
            });
        }
        want
    }

    fn set_budget(&self, items: usize, bytes: u64) {
        self.shared.input.budget().set_limits(items, bytes);
    }

    fn snapshot(&self) -> StageStats {
        self.shared.core.snapshot(
            self.shared.input.budget(),
            self.shared.concurrency.load(Ordering::Acquire),
            self.max,
        )
    }

    fn stop(&self) {
        self.shared.stopping.store(true, Ordering::Release);
        self.shared.sem.close();
        self.shared.input.budget().notify_data(usize::MAX);
    }

    fn join(&self) {
        let tasks = std::mem::take(&mut *self.tasks.lock());
        for t in tasks {
            let _ = futures::executor::block_on(t);
        }
    }
}

async fn drive<T: Send + 'static, U: Send + 'static>(
    s: Arc<Shared<T, U>>,
    done: mpsc::UnboundedSender<Completed<U>>,
) {
    let mut local = std::collections::VecDeque::new();
    let mut inflight = JoinSet::new();
    loop {
        while inflight.try_join_next().is_some() {}
        let Ok(permit) = Arc::clone(&s.sem).acquire_owned().await else {
            break;
        };
        let Some(env) = next_item(&s, &mut local).await else {
            break;
        };
        let Envelope {
            seq,
            bytes,
            reserved,
            item,
            origin,
        } = env;
        let desc = s.describe.as_ref().map(|d| d(&item));
        let started = Instant::now();
        let fut = match std::panic::catch_unwind(AssertUnwindSafe(|| (s.f)(item))) {
            Ok(fut) => fut,
            Err(p) => Box::pin(futures::future::ready(Err(
                Box::new(Panicked::from_payload(&*p)) as BoxError,
            ))),
        };
        let tx = done.clone();
        inflight.spawn(async move {
            let (caught, parts) =
                crate::failure::collect_skipped_parts_async(AssertUnwindSafe(fut).catch_unwind())
                    .await;
            let result = match caught {
                Ok(r) => r,
                Err(p) => Err(Box::new(Panicked::from_payload(&*p)) as BoxError),
            };
            drop(permit);
            let _ = tx.send(Completed {
                seq,
                origin,
                in_bytes: bytes,
                reserved,
                started,
                desc,
                result,
                parts,
            });
        });
    }
    inflight.shutdown().await;
}

/// The next input item, or `None` when the stage is shutting down. Ends epochs downstream.
async fn next_item<T, U>(
    s: &Shared<T, U>,
    local: &mut std::collections::VecDeque<Envelope<T>>,
) -> Option<Envelope<T>> {
    loop {
        if s.stopping.load(Ordering::Acquire) {
            return None;
        }
        if let Some(e) = local.pop_front() {
            return Some(e);
        }
        if let Some(chunk) = s.input.try_recv() {
            local.extend(chunk);
            continue;
        }
        let budget = s.input.budget();
        let listener = budget.listen_data();
        if let Some(chunk) = s.input.try_recv() {
            local.extend(chunk);
            continue;
        }
        let st = budget.status();
        if st.closed || s.stopping.load(Ordering::Acquire) {
            return None;
        }
        if st.finished && st.used_items == 0 {
            s.output.budget().finish(st.epoch);
        }
        listener.await;
    }
}

async fn emit<T: Send + 'static, U: Send + 'static>(
    s: Arc<Shared<T, U>>,
    mut rx: mpsc::UnboundedReceiver<Completed<U>>,
) {
    let mut counters = WorkerCounters::default();
    let mut window = Reorder::default();
    let mut run = Run::default();
    let mut ledger = OutputLedger::default();
    while let Some(first) = rx.recv().await {
        let mut next = Some(first);
        while let Some(c) = next {
            accept(&s, c, &mut counters, &mut window, &mut run, &mut ledger);
            next = rx.try_recv().ok();
        }
        // Outputs are charged before the marks that release them.
        ledger.apply(s.input.budget());
        if s.order == Order::Input {
            window.drain_ready(&mut run);
        }
        // Counters before results (see the pool stage); otherwise in batches.
        if rx.is_empty() {
            counters.flush(&s.core.metrics, Instant::now());
        } else {
            counters.maybe_flush(&s.core.metrics, Instant::now());
        }
        match flush_async(&mut run, &s.output, s.input.budget(), &s.out_seq).await {
            Ok(waited) => counters.c.put_wait_ns += waited,
            Err(_) => break,
        }
    }
    counters.flush(&s.core.metrics, Instant::now());
}

fn accept<T, U>(
    s: &Shared<T, U>,
    c: Completed<U>,
    counters: &mut WorkerCounters,
    window: &mut Reorder<U>,
    run: &mut Run<U>,
    ledger: &mut OutputLedger,
) {
    let now = Instant::now();
    let dt = nanos(c.started, now);
    let k = &mut counters.c;
    k.items_in += 1;
    k.busy_ns += dt;
    k.task_time.record_ns(dt);
    let outputs: Vec<Envelope<U>> = match c.result {
        Ok(u) => {
            // A part left out past a budget: the item is not delivered.
            if s.core.fail_parts(k, c.parts) {
                Vec::new()
            } else {
                k.items_out += 1;
                vec![Envelope {
                    seq: 0,
                    bytes: (s.sizer)(&u),
                    reserved: 0,
                    item: u,
                    origin: c.origin,
                }]
            }
        }
        Err(cause) => {
            let item = c.desc.unwrap_or_else(|| format!("input #{}", c.seq));
            s.core.fail(k, item, cause);
            Vec::new()
        }
    };
    let out_bytes = outputs.iter().map(|e| e.bytes).sum();
    let in_bytes = ledger.record(c.in_bytes, c.reserved, out_bytes);
    match s.order {
        Order::Completion => {
            run.out.extend(outputs);
            run.complete_input(in_bytes);
        }
        Order::Input => window.insert(c.seq, Done { in_bytes, outputs }),
    }
}
