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

#[cfg(test)]
mod tests {
    //! The stage on its own: batches, the partial last one or its drop, every input permit
    //! released, the epoch's end passed on, the floor that lets a byte budget fill a batch,
    //! and a stop that ends a waiting stage.

    use super::*;
    use crate::failure::{FailureBudget, Failures};
    use flowgate_tuner::StageKind;
    use std::time::Duration;

    type Started = (
        Arc<AggregateStage<u64>>,
        Arc<Channel<u64>>,
        Arc<Channel<Vec<u64>>>,
    );

    fn core() -> StageCore {
        StageCore::new(
            "agg",
            StageKind::Serial,
            FailureBudget::default(),
            Arc::new(Failures::new(FailureBudget::default())),
            false,
        )
    }

    fn start(size: usize, drop_last: bool, input_bytes: u64) -> Started {
        let core = core();
        let input = Arc::new(Channel::new(64, input_bytes));
        let output = Arc::new(Channel::new(64, u64::MAX));
        let stage =
            AggregateStage::start(core, input.clone(), output.clone(), size, drop_last).unwrap();
        (stage, input, output)
    }

    /// Sends items `first..first + n` of `bytes` each (blocking for room).
    fn send(input: &Channel<u64>, first: u64, n: u64, bytes: u64) {
        let mut items: Vec<_> = (first..first + n)
            .map(|i| Envelope {
                seq: i,
                bytes,
                reserved: 0,
                item: i,
                origin: Default::default(),
            })
            .collect();
        while !items.is_empty() {
            let k = input.acquire_for(&mut items).unwrap();
            let rest = items.split_off(k);
            input.send(items);
            items = rest;
        }
    }

    /// The batches of `epoch` (with their bytes), releasing each, until the epoch is finished.
    fn batches(output: &Channel<Vec<u64>>, epoch: u64) -> Vec<(Vec<u64>, u64)> {
        let mut out = Vec::new();
        let deadline = Instant::now() + Duration::from_secs(10);
        loop {
            if let Some(chunk) = output.try_recv() {
                for env in chunk {
                    output.budget().release(1, env.bytes);
                    out.push((env.item, env.bytes));
                }
                continue;
            }
            let st = output.budget().status();
            if st.finished && st.epoch == epoch && output.is_empty() {
                return out;
            }
            assert!(Instant::now() < deadline, "epoch {epoch} did not end");
            std::thread::sleep(Duration::from_millis(1));
        }
    }

    fn used(ch: &Channel<u64>) -> (usize, u64) {
        let st = ch.budget().status();
        (st.used_items, st.used_bytes)
    }

    #[test]
    fn batches_of_the_size_then_the_partial_last_and_every_permit_released() {
        let (stage, input, output) = start(4, false, u64::MAX);
        send(&input, 0, 10, 7);
        input.budget().finish(0);
        let got = batches(&output, 0);
        assert_eq!(
            got,
            vec![
                (vec![0, 1, 2, 3], 28),
                (vec![4, 5, 6, 7], 28),
                (vec![8, 9], 14)
            ]
        );
        assert_eq!(used(&input), (0, 0), "every item's permit released");
        assert_eq!(stage.dropped(), 0);
        // The next epoch batches afresh: no item of the last carried over.
        input.budget().begin(1);
        output.budget().begin(1);
        send(&input, 10, 5, 1);
        input.budget().finish(1);
        let got: Vec<_> = batches(&output, 1).into_iter().map(|(b, _)| b).collect();
        assert_eq!(got, vec![vec![10, 11, 12, 13], vec![14]]);
        stage.stop();
        stage.join();
    }

    #[test]
    fn drop_last_drops_and_counts_the_partial_batch_and_releases_its_permits() {
        let (stage, input, output) = start(4, true, u64::MAX);
        send(&input, 0, 11, 5);
        input.budget().finish(0);
        let got: Vec<_> = batches(&output, 0).into_iter().map(|(b, _)| b).collect();
        assert_eq!(got, vec![vec![0, 1, 2, 3], vec![4, 5, 6, 7]]);
        assert_eq!(stage.dropped(), 3);
        assert_eq!(used(&input), (0, 0), "the dropped items' permits released");
        // An epoch that divides evenly drops nothing more.
        input.budget().begin(1);
        output.budget().begin(1);
        send(&input, 11, 8, 5);
        input.budget().finish(1);
        assert_eq!(batches(&output, 1).len(), 2);
        assert_eq!(stage.dropped(), 3);
        stage.stop();
        stage.join();
    }

    #[test]
    fn a_byte_budget_under_one_batch_still_fills_the_batch() {
        // 10 bytes admit one 7-byte item by bytes alone; the floor of one batch admits four.
        let (stage, input, output) = start(4, false, 10);
        send(&input, 0, 8, 7);
        input.budget().finish(0);
        let got: Vec<_> = batches(&output, 0).into_iter().map(|(b, _)| b).collect();
        assert_eq!(got, vec![vec![0, 1, 2, 3], vec![4, 5, 6, 7]]);
        stage.stop();
        stage.join();
    }

    #[test]
    fn stop_ends_a_stage_waiting_for_items() {
        let (stage, input, _output) = start(4, false, u64::MAX);
        send(&input, 0, 2, 1);
        std::thread::sleep(Duration::from_millis(20));
        let (tx, rx) = std::sync::mpsc::channel();
        let s = stage.clone();
        std::thread::spawn(move || {
            s.stop();
            s.join();
            tx.send(()).unwrap();
        });
        rx.recv_timeout(Duration::from_secs(10))
            .expect("the stage ended after stop");
        assert!(stage.handle.lock().is_none(), "join took the thread");
        assert_eq!(stage.name(), "agg");
        assert_eq!(stage.resize(8), 1, "one thread, whatever is asked");
    }

    #[test]
    fn the_stage_counts_items_batches_and_its_waits() {
        // An output of one batch: the second batch waits for the first to be taken.
        let core = core();
        let input = Arc::new(Channel::new(64, u64::MAX));
        let output = Arc::new(Channel::new(1, u64::MAX));
        let stage = AggregateStage::start(core, input.clone(), output.clone(), 3, false).unwrap();
        std::thread::sleep(Duration::from_millis(30)); // waiting for input
        send(&input, 0, 7, 1);
        std::thread::sleep(Duration::from_millis(30)); // waiting for room
        input.budget().finish(0);
        assert_eq!(batches(&output, 0).len(), 3);
        let deadline = Instant::now() + Duration::from_secs(10);
        let snap = loop {
            let snap = stage.snapshot();
            if snap.items_out == 3 || Instant::now() > deadline {
                break snap;
            }
            std::thread::sleep(Duration::from_millis(5));
        };
        assert_eq!((snap.items_in, snap.items_out), (7, 3));
        assert!(snap.blocked_get >= Duration::from_millis(20), "{snap:?}");
        assert!(snap.blocked_put >= Duration::from_millis(20), "{snap:?}");
        stage.stop();
        stage.join();
    }

    #[test]
    fn a_closed_input_ends_the_stage() {
        let (stage, input, _output) = start(4, false, u64::MAX);
        send(&input, 0, 1, 1);
        input.budget().close();
        let (tx, rx) = std::sync::mpsc::channel();
        let s = stage.clone();
        std::thread::spawn(move || {
            s.join();
            tx.send(()).unwrap();
        });
        rx.recv_timeout(Duration::from_secs(10))
            .expect("the stage ended when its input closed");
    }

    #[test]
    fn the_tuners_budget_reaches_the_input_but_not_under_the_floor() {
        let (stage, input, _output) = start(4, false, u64::MAX);
        stage.set_budget(2, 100);
        let st = input.budget().status();
        assert_eq!(
            (st.cap_items, st.cap_bytes),
            (4, 100),
            "the item limit kept at the floor of one batch"
        );
        // Four 50-byte items (200 bytes, over both limits) are still admitted: the floor.
        let mut items: Vec<_> = (0..5)
            .map(|i| Envelope {
                seq: i,
                bytes: 50,
                reserved: 0,
                item: i,
                origin: Default::default(),
            })
            .collect();
        assert_eq!(input.acquire_for(&mut items).unwrap(), 4);
        let snap = stage.snapshot();
        assert_eq!(snap.workers, 1);
        stage.stop();
        stage.join();
    }
}
