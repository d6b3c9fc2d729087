//! Sending a stage's results downstream: budget handoff and input-order reordering.
//!
//! Results are sent in runs. A [`Mark`] says which input permits may be released once the
//! outputs before it are sent; [`flush`] acquires room downstream for a prefix of the outputs,
//! sends it, releases the inputs it completes, and repeats. An input's permits are therefore
//! released right after its last output enters the next channel, which keeps the budget of every
//! channel exact: an item is counted by exactly one budget at any time.
//!
//! In [`Order::Input`], every stage reorders its results with a [`Reorder`] window keyed by the
//! input's sequence number. A failed or filtered item leaves an empty slot, so one bad or slow
//! item never wedges the window; the window is bounded by the stage's item budget.

use std::collections::VecDeque;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Instant;

use crate::channel::{Budget, Channel, Closed, Envelope};
use crate::metrics::nanos;

/// The order in which results come out of a stage and of the pipeline.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum Order {
    /// As soon as each item is done (the fastest).
    #[default]
    Completion,
    /// In the order the source produced the items.
    Input,
}

/// After the outputs before `end` are sent, release `items` input items totalling `bytes`.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Mark {
    /// Index (exclusive) into the run's outputs.
    pub end: usize,
    /// Input items released at this mark.
    pub items: usize,
    /// Input bytes released at this mark.
    pub bytes: u64,
}

/// A run of outputs and the input releases they carry.
#[derive(Debug)]
pub struct Run<U> {
    /// The outputs, in order.
    pub out: Vec<Envelope<U>>,
    /// Releases, in order of `end`.
    pub marks: Vec<Mark>,
}

impl<U> Default for Run<U> {
    fn default() -> Self {
        Self {
            out: Vec::new(),
            marks: Vec::new(),
        }
    }
}

impl<U> Run<U> {
    /// Whether there is nothing to send or release.
    pub fn is_empty(&self) -> bool {
        self.out.is_empty() && self.marks.is_empty()
    }

    /// Records that one input (of `bytes`) is complete with the outputs pushed so far.
    #[inline]
    pub fn complete_input(&mut self, bytes: u64) {
        self.marks.push(Mark {
            end: self.out.len(),
            items: 1,
            bytes,
        });
    }

    /// Numbers the outputs consecutively from `counter`.
    fn number(&mut self, counter: &AtomicU64) {
        let base = counter.fetch_add(self.out.len() as u64, Ordering::Relaxed);
        for (i, e) in self.out.iter_mut().enumerate() {
            e.seq = base + i as u64;
        }
    }

    /// Releases the marks completed by `sent` outputs, starting at `*next`.
    fn release_done(&self, next: &mut usize, sent: usize, input: &Budget) {
        let (mut items, mut bytes) = (0, 0);
        while let Some(m) = self.marks.get(*next).filter(|m| m.end <= sent) {
            items += m.items;
            bytes += m.bytes;
            *next += 1;
        }
        input.release(items, bytes);
    }

    /// Splits off the first `n` outputs as a chunk (without copying when it is all of them).
    fn take_chunk(&mut self, n: usize) -> Vec<Envelope<U>> {
        if n == self.out.len() {
            std::mem::take(&mut self.out)
        } else {
            self.out.drain(..n).collect()
        }
    }
}

/// Sends `run` on `output`, blocking for room, and releases its inputs on `input`. Returns the
/// nanoseconds spent waiting for room. The run is empty afterwards.
pub fn flush<U>(
    run: &mut Run<U>,
    output: &Channel<U>,
    input: &Budget,
    seq: &AtomicU64,
) -> Result<u64, Closed> {
    run.number(seq);
    let (mut sent, mut next, mut waited) = (0, 0, 0);
    loop {
        run.release_done(&mut next, sent, input);
        if run.out.is_empty() {
            break;
        }
        let t0 = Instant::now();
        let n = output.acquire_for(&mut run.out)?;
        waited += nanos(t0, Instant::now());
        let chunk = run.take_chunk(n);
        output.send(chunk);
        sent += n;
    }
    run.marks.clear();
    Ok(waited)
}

/// The async form of [`flush`].
pub async fn flush_async<U>(
    run: &mut Run<U>,
    output: &Channel<U>,
    input: &Budget,
    seq: &AtomicU64,
) -> Result<u64, Closed> {
    run.number(seq);
    let (mut sent, mut next, mut waited) = (0, 0, 0);
    loop {
        run.release_done(&mut next, sent, input);
        if run.out.is_empty() {
            break;
        }
        let t0 = Instant::now();
        // Sizes are copied out so the future does not borrow the outputs across the await
        // (which would require them to be `Sync`).
        let sizes: Vec<u64> = run.out.iter().map(|e| e.bytes).collect();
        let a = output.budget().acquire_async(sizes.into_iter()).await?;
        let n = a.items;
        for e in &mut run.out[..n] {
            e.reserved = a.reserved;
        }
        waited += nanos(t0, Instant::now());
        let chunk = run.take_chunk(n);
        output.send(chunk);
        sent += n;
    }
    run.marks.clear();
    Ok(waited)
}

/// A worker's pending corrections to its input budget: outputs made since the last emit,
/// against what was reserved for them at admission (see the channel module's docs).
#[derive(Debug, Default)]
pub struct OutputLedger {
    /// Bytes to charge (positive) or give back (negative).
    adjust: i64,
    /// The largest outputs one input made since the last emit.
    largest: Option<u64>,
}

impl OutputLedger {
    /// Records that an input admitted as `input_bytes` own bytes plus `reserved` made outputs
    /// of `out_bytes`; returns the bytes its mark releases (its own and its outputs').
    #[inline]
    pub fn record(&mut self, input_bytes: u64, reserved: u64, out_bytes: u64) -> u64 {
        self.adjust += out_bytes as i64 - reserved as i64;
        // A failed or filtered input teaches too (that outputs may be small): otherwise a
        // stage whose first inputs fail would stay cold, admitting one item at a time.
        self.largest = Some(self.largest.map_or(out_bytes, |l| l.max(out_bytes)));
        input_bytes + out_bytes
    }

    /// Applies the corrections to `input` (before any mark recorded since is released): one
    /// lock per run.
    pub fn apply(&mut self, input: &Budget) {
        let (delta, largest) = (std::mem::take(&mut self.adjust), self.largest.take());
        if delta != 0 || largest.is_some() {
            input.settle_outputs(delta, largest);
        }
    }
}

/// The result of one input item, waiting in a [`Reorder`] window.
#[derive(Debug)]
pub struct Done<U> {
    /// The bytes released when the item is emitted: its own and its outputs'.
    pub in_bytes: u64,
    /// The item's outputs (none if it failed or was filtered out).
    pub outputs: Vec<Envelope<U>>,
}

/// A reorder window keyed by input sequence number.
#[derive(Debug)]
pub struct Reorder<U> {
    next: u64,
    slots: VecDeque<Option<Done<U>>>,
}

impl<U> Default for Reorder<U> {
    fn default() -> Self {
        Self {
            next: 0,
            slots: VecDeque::new(),
        }
    }
}

impl<U> Reorder<U> {
    /// Puts the result of input `seq` into the window.
    pub fn insert(&mut self, seq: u64, done: Done<U>) {
        debug_assert!(seq >= self.next, "input {seq} completed twice");
        let i = (seq - self.next) as usize;
        if i >= self.slots.len() {
            self.slots.resize_with(i + 1, || None);
        }
        debug_assert!(self.slots[i].is_none(), "input {seq} completed twice");
        self.slots[i] = Some(done);
    }

    /// Moves every result that is next in order into `run`; returns how many inputs moved.
    pub fn drain_ready(&mut self, run: &mut Run<U>) -> usize {
        let mut n = 0;
        while let Some(Some(_)) = self.slots.front() {
            let Some(Some(done)) = self.slots.pop_front() else {
                unreachable!()
            };
            run.out.extend(done.outputs);
            run.complete_input(done.in_bytes);
            self.next += 1;
            n += 1;
        }
        n
    }

    /// Whether the window is empty.
    pub fn is_empty(&self) -> bool {
        self.slots.is_empty()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn out(v: u64) -> Envelope<u64> {
        Envelope {
            seq: 0,
            bytes: 1,
            reserved: 0,
            item: v,
            origin: Default::default(),
        }
    }

    #[test]
    fn reorder_emits_in_input_order_with_holes() {
        let mut r = Reorder::default();
        let mut run = Run::default();
        r.insert(
            2,
            Done {
                in_bytes: 1,
                outputs: vec![out(20)],
            },
        );
        r.insert(
            1,
            Done {
                in_bytes: 1,
                outputs: vec![],
            },
        );
        assert_eq!(r.drain_ready(&mut run), 0);
        r.insert(
            0,
            Done {
                in_bytes: 1,
                outputs: vec![out(0), out(1)],
            },
        );
        assert_eq!(r.drain_ready(&mut run), 3);
        let got: Vec<_> = run.out.iter().map(|e| e.item).collect();
        assert_eq!(got, [0, 1, 20]);
        let ends: Vec<_> = run.marks.iter().map(|m| m.end).collect();
        assert_eq!(ends, [2, 2, 3]);
        assert!(r.is_empty());
    }

    #[test]
    fn flush_releases_each_input_after_its_outputs_and_respects_the_budget() {
        let output = Channel::<u64>::new(2, u64::MAX);
        let input = Budget::new(10, u64::MAX);
        input.acquire([5u64, 5, 5].into_iter()).unwrap();
        let mut run = Run::default();
        run.out.push(out(1));
        run.complete_input(5);
        run.complete_input(5); // filtered out
        run.out.push(out(2));
        run.complete_input(5);
        let seq = AtomicU64::new(7);
        flush(&mut run, &output, &input, &seq).unwrap();
        assert!(run.is_empty());
        assert_eq!(input.status().used_items, 0);
        assert_eq!(output.budget().status().used_items, 2);
        let c = output.try_recv().unwrap();
        assert_eq!(
            c.iter().map(|e| (e.seq, e.item)).collect::<Vec<_>>(),
            [(7, 1), (8, 2)]
        );
    }
}
