//! Budgeted channels: how items travel between stages.
//!
//! A [`Channel`] is a `flume` queue of [`Chunk`]s whose bound is a [`Budget`] in items *and*
//! bytes instead of a fixed capacity, so that a tuner can grow or shrink it while items flow.
//!
//! # Protocol
//!
//! - A producer calls [`Budget::acquire`] (or [`Budget::acquire_async`]) for a prefix of the
//!   items it wants to send, then sends exactly that prefix. Acquisition blocks until at least one
//!   item fits and returns how many did; it never takes more than fits, so a producer holding
//!   results never overdraws the budget.
//! - The permits of an item are released when the item **leaves the consuming stage** (its
//!   outputs were sent on, it failed, or it was filtered out), not when it is dequeued. The budget
//!   of a channel is therefore the number of items (and bytes) the consuming stage *holds*:
//!   queued, in a worker's hands, or finished and waiting for room downstream. Memory in flight is
//!   the sum of the budgets, and with a stalled consumer the number of items pulled from the
//!   source is exactly the sum of the item budgets.
//! - **Outputs are charged too.** A stage that makes outputs ([`Budget::reserve_outputs`]: pool
//!   and async stages) keeps a *reserve*: the bytes one input item's outputs take, learnt from
//!   the outputs it has made (the largest recent item's, decaying slowly). Admission charges
//!   every item its own bytes plus the reserve ([`Admission::reserved`], recorded in the item's
//!   [`Envelope::reserved`]), so the budget is checked before the outputs exist; when the outputs
//!   are made the stage trues the charge up to their real size ([`Budget::settle_outputs`],
//!   once per run of outputs), and when the
//!   item leaves, its own bytes and its outputs' are released together. Until the stage has made
//!   its first output it admits only `floor` items, so even the first chunk cannot overdraw.
//!   The invariant: **every byte an item or its outputs own is charged to exactly one budget
//!   from admission until it leaves the pipeline** (briefly to two, while outputs enter the next
//!   channel before their input is released: an over-count, never an under-count), up to the
//!   reserve's estimation error for one run of outputs per worker.
//! - An item that is larger than the whole byte budget is admitted when the stage holds fewer
//!   than `floor` items (1 by default), so the pipeline cannot wedge on one big item. An
//!   aggregating stage sets `floor` to its batch size for the same reason.
//! - End of epoch: the producer side calls [`Budget::finish`] with the epoch number once all of
//!   that epoch's items were sent; the consuming stage is done with the epoch when the channel is
//!   finished **and** it holds nothing (`used_items == 0`). The epoch number makes late or
//!   repeated `finish` calls harmless.
//! - [`Budget::close`] wakes everybody and makes every wait return [`Closed`]; it is how a
//!   pipeline shuts down.
//!
//! Waiting uses `event-listener` (listen, re-check, wait), the same lost-wakeup-free pattern as
//! `async-channel`; every state change that can unblock someone notifies the matching event.
//! The budget state sits behind one uncontended mutex taken once per *chunk*, never per item.

use event_listener::{Event, EventListener, Listener};
use parking_lot::Mutex;
use std::sync::atomic::{AtomicBool, Ordering};

/// An item on its way between stages.
#[derive(Debug)]
pub struct Envelope<T> {
    /// Position in the producing stage's output stream (consecutive in input order).
    pub seq: u64,
    /// The item's own bytes (what its sizer measured).
    pub bytes: u64,
    /// Bytes charged on top of `bytes` when it was admitted: the consuming stage's reserve
    /// for its outputs (see the module docs). Set by the sender from [`Admission::reserved`].
    pub reserved: u64,
    /// The item itself.
    pub item: T,
    /// The source items it carries (see [`crate::origin`]).
    pub origin: crate::origin::Origin,
}

/// A batch of items sent in one channel operation.
pub type Chunk<T> = Vec<Envelope<T>>;

/// What [`Budget::acquire`] admitted.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Admission {
    /// How many items (a prefix of those asked for).
    pub items: usize,
    /// Bytes charged per item on top of its own: the consuming stage's reserve for its
    /// outputs. The sender records it in each admitted [`Envelope::reserved`].
    pub reserved: u64,
}

/// The channel was closed: the pipeline is shutting down.
#[derive(Clone, Copy, Debug, PartialEq, Eq, thiserror::Error)]
#[error("the channel was closed")]
pub struct Closed;

/// A budget's limits and use.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct BudgetStatus {
    /// Items held by the consuming stage.
    pub used_items: usize,
    /// Bytes held by the consuming stage.
    pub used_bytes: u64,
    /// Item limit.
    pub cap_items: usize,
    /// Byte limit.
    pub cap_bytes: u64,
    /// The epoch the channel is in.
    pub epoch: u64,
    /// Whether the producer side finished `epoch`.
    pub finished: bool,
    /// Whether the channel is closed.
    pub closed: bool,
}

#[derive(Debug)]
struct State {
    used_items: usize,
    used_bytes: u64,
    cap_items: usize,
    cap_bytes: u64,
    floor_items: usize,
    epoch: u64,
    finished: bool,
    /// Whether the consumer reserves for its outputs, and whether it has learnt how much.
    reserving: bool,
    reserve_known: bool,
    /// Bytes charged per admitted item for its outputs.
    reserve: u64,
}

/// The reserve loses this fraction (one over it) per run when outputs shrink.
const RESERVE_DECAY: u64 = 8;

/// The bound, end-of-epoch and shutdown state of a channel (independent of the item type).
#[derive(Debug)]
pub struct Budget {
    state: Mutex<State>,
    closed: AtomicBool,
    /// Producers wait here for room.
    space: Event,
    /// Consumers wait here for data, end of epoch, or shutdown.
    data: Event,
}

impl Budget {
    /// A budget of `items` items and `bytes` bytes (both at least 1).
    pub fn new(items: usize, bytes: u64) -> Self {
        Self {
            state: Mutex::new(State {
                used_items: 0,
                used_bytes: 0,
                cap_items: items.max(1),
                cap_bytes: bytes.max(1),
                floor_items: 1,
                epoch: 0,
                finished: false,
                reserving: false,
                reserve_known: false,
                reserve: 0,
            }),
            closed: AtomicBool::new(false),
            space: Event::new(),
            data: Event::new(),
        }
    }

    /// Changes the limits. Items already admitted stay; shrinking takes effect as they leave.
    /// The item limit never goes below the floor.
    pub fn set_limits(&self, items: usize, bytes: u64) {
        {
            let mut s = self.state.lock();
            s.cap_items = items.max(s.floor_items).max(1);
            s.cap_bytes = bytes.max(1);
        }
        self.space.notify(usize::MAX);
    }

    /// Admits up to `floor` items regardless of bytes, and keeps the item limit at least `floor`.
    pub fn set_floor(&self, floor: usize) {
        {
            let mut s = self.state.lock();
            s.floor_items = floor.max(1);
            s.cap_items = s.cap_items.max(s.floor_items);
        }
        self.space.notify(usize::MAX);
    }

    /// The current limits and use.
    pub fn status(&self) -> BudgetStatus {
        let s = self.state.lock();
        BudgetStatus {
            used_items: s.used_items,
            used_bytes: s.used_bytes,
            cap_items: s.cap_items,
            cap_bytes: s.cap_bytes,
            epoch: s.epoch,
            finished: s.finished,
            closed: self.is_closed(),
        }
    }

    /// Whether [`close`](Self::close) was called.
    #[inline]
    pub fn is_closed(&self) -> bool {
        self.closed.load(Ordering::Acquire)
    }

    /// Admits the longest prefix of `sizes` that fits, each charged its size plus the reserve.
    fn try_admit(&self, sizes: impl Iterator<Item = u64>) -> Admission {
        let mut s = self.state.lock();
        let reserved = s.reserve;
        // Until the consumer knows what its outputs take, only the floor is admitted.
        let cold = s.reserving && !s.reserve_known;
        let mut n = 0;
        let mut bytes = 0u64;
        for size in sizes {
            let items = s.used_items + n;
            if items >= s.cap_items || (cold && items >= s.floor_items) {
                break;
            }
            let charge = size.saturating_add(reserved);
            let fits = s.used_bytes + bytes + charge <= s.cap_bytes || items < s.floor_items;
            if !fits {
                break;
            }
            n += 1;
            bytes += charge;
        }
        s.used_items += n;
        s.used_bytes += bytes;
        Admission { items: n, reserved }
    }

    /// Blocks until at least one of the items whose sizes are `sizes` (a non-empty, restartable
    /// iterator) fits, admits the longest prefix that fits, and says how many and what was
    /// reserved for each.
    pub fn acquire<I>(&self, sizes: I) -> Result<Admission, Closed>
    where
        I: Iterator<Item = u64> + Clone,
    {
        loop {
            if self.is_closed() {
                return Err(Closed);
            }
            let a = self.try_admit(sizes.clone());
            if a.items > 0 {
                return Ok(a);
            }
            let listener = self.space.listen();
            if self.is_closed() {
                return Err(Closed);
            }
            let a = self.try_admit(sizes.clone());
            if a.items > 0 {
                return Ok(a);
            }
            listener.wait();
        }
    }

    /// The async form of [`acquire`](Self::acquire).
    pub async fn acquire_async<I>(&self, sizes: I) -> Result<Admission, Closed>
    where
        I: Iterator<Item = u64> + Clone,
    {
        loop {
            if self.is_closed() {
                return Err(Closed);
            }
            let a = self.try_admit(sizes.clone());
            if a.items > 0 {
                return Ok(a);
            }
            let listener = self.space.listen();
            if self.is_closed() {
                return Err(Closed);
            }
            let a = self.try_admit(sizes.clone());
            if a.items > 0 {
                return Ok(a);
            }
            listener.await;
        }
    }

    /// Makes admission reserve bytes for the consumer's outputs (see the module docs); the
    /// consumer then reports what its outputs take with [`settle_outputs`](Self::settle_outputs).
    pub fn reserve_outputs(&self) {
        self.state.lock().reserving = true;
    }

    /// Settles a run of outputs in one step: trues up the items it came from by `delta` bytes
    /// (outputs larger or smaller than reserved; see [`adjust`](Self::adjust)) and, when the
    /// consumer reserves, learns from `largest`, the most one input's outputs took: the reserve
    /// becomes the larger of that and the old reserve decayed by an eighth (so a lasting drop
    /// in output sizes lowers it within a few runs, and a spike raises it at once).
    pub fn settle_outputs(&self, delta: i64, largest: Option<u64>) {
        let wake = {
            let mut s = self.state.lock();
            if delta >= 0 {
                s.used_bytes += delta as u64;
            } else {
                debug_assert!(s.used_bytes >= delta.unsigned_abs(), "over-release");
                s.used_bytes -= delta.unsigned_abs();
            }
            let mut was_cold = false;
            if let Some(bytes) = largest.filter(|_| s.reserving) {
                was_cold = !s.reserve_known;
                s.reserve = bytes.max(s.reserve - s.reserve / RESERVE_DECAY);
                s.reserve_known = true;
            }
            delta < 0 || was_cold
        };
        if wake {
            self.space.notify(usize::MAX);
        }
    }

    /// Trues up items already admitted: charges `delta` more bytes (outputs larger than
    /// reserved, a source's items larger than estimated), or releases `-delta`.
    pub fn adjust(&self, delta: i64) {
        match delta {
            d if d > 0 => self.charge(d as u64),
            d if d < 0 => self.release(0, d.unsigned_abs()),
            _ => {}
        }
    }

    /// Charges `bytes` more to items already admitted (a source learns sizes after pulling).
    pub fn charge(&self, bytes: u64) {
        if bytes > 0 {
            self.state.lock().used_bytes += bytes;
        }
    }

    /// Gives back the permits of `items` items totalling `bytes` bytes.
    pub fn release(&self, items: usize, bytes: u64) {
        if items == 0 && bytes == 0 {
            return;
        }
        let wake_consumers = {
            let mut s = self.state.lock();
            debug_assert!(
                s.used_items >= items && s.used_bytes >= bytes,
                "over-release"
            );
            s.used_items -= items;
            s.used_bytes -= bytes;
            s.finished && s.used_items == 0
        };
        self.space.notify(usize::MAX);
        if wake_consumers {
            self.data.notify(usize::MAX);
        }
    }

    /// Marks `epoch` as fully sent. Ignored if the channel has moved on to another epoch.
    pub fn finish(&self, epoch: u64) {
        {
            let mut s = self.state.lock();
            if s.epoch != epoch || s.finished {
                return;
            }
            s.finished = true;
        }
        self.data.notify(usize::MAX);
    }

    /// Starts `epoch`: clears the finished mark. Only called when the channel is idle.
    pub fn begin(&self, epoch: u64) {
        let mut s = self.state.lock();
        s.epoch = epoch;
        s.finished = false;
    }

    /// Closes the channel: every current and future wait returns [`Closed`].
    pub fn close(&self) {
        self.closed.store(true, Ordering::Release);
        self.space.notify(usize::MAX);
        self.data.notify(usize::MAX);
    }

    /// Starts listening for data, end of epoch or shutdown. Check, then wait on the listener.
    pub fn listen_data(&self) -> EventListener {
        self.data.listen()
    }

    /// Wakes up to `n` consumers (work became available somewhere they look).
    pub fn notify_data(&self, n: usize) {
        self.data.notify(n);
    }
}

/// A budgeted, resizable MPMC channel of chunks. See the module docs for the protocol.
#[derive(Debug)]
pub struct Channel<T> {
    budget: Budget,
    tx: flume::Sender<Chunk<T>>,
    rx: flume::Receiver<Chunk<T>>,
}

impl<T> Channel<T> {
    /// A channel bounded by `items` items and `bytes` bytes.
    pub fn new(items: usize, bytes: u64) -> Self {
        let (tx, rx) = flume::unbounded();
        Self {
            budget: Budget::new(items, bytes),
            tx,
            rx,
        }
    }

    /// The channel's budget.
    #[inline]
    pub fn budget(&self) -> &Budget {
        &self.budget
    }

    /// Sends a chunk whose items were admitted by [`Budget::acquire`], and wakes one consumer.
    pub fn send(&self, chunk: Chunk<T>) {
        if chunk.is_empty() {
            return;
        }
        // The receiver lives in `self`, so the send cannot fail.
        let _ = self.tx.send(chunk);
        self.budget.data.notify(1);
    }

    /// Takes a chunk if one is queued.
    #[inline]
    pub fn try_recv(&self) -> Option<Chunk<T>> {
        self.rx.try_recv().ok()
    }

    /// Whether no chunk is queued.
    #[inline]
    pub fn is_empty(&self) -> bool {
        self.rx.is_empty()
    }

    /// Acquires room for a prefix of `items`, records what was reserved in each admitted
    /// envelope, and returns the prefix's length; see [`Budget::acquire`].
    pub fn acquire_for(&self, items: &mut [Envelope<T>]) -> Result<usize, Closed> {
        let a = self.budget.acquire(items.iter().map(|e| e.bytes))?;
        for e in &mut items[..a.items] {
            e.reserved = a.reserved;
        }
        Ok(a.items)
    }
}

#[cfg(test)]
mod tests;
