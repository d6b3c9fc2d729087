//! Units' batches regrouped into the planning loader's batches ([`Regroup`]).
//!
//! A unit's loader decodes its batches alone (see [`units`](super::units)), so an item it
//! skips as unreadable leaves that batch one short, where the planning loader would have
//! taken the next item into it. The consumer of the units pushes each batch it receives (in
//! plan order) with its rows' positions, and pops batches of the plan's batch size: whole
//! batches pass as they are; a short one is made up from the rows of the next ones, as the
//! aggregate stage fills a batch from the next items. What comes out is the local loader's
//! batches, the epoch's last partial batch dropped with `drop_last`. Only input order with
//! more than one position per batch regroups: in completion order the local loader's batches
//! are not a function of positions, and a length-aware batch (one position) is never split.
//!
//! The rows are anything [`Rows`] can slice and join: a [`Batch`](super::Batch)'s tensors, or
//! in the Python package the NumPy arrays that came back from remote workers.

use std::collections::VecDeque;

use flowgate_actors::emit::Order;

use super::EpochPlan;

/// A batch's rows, as [`Regroup`] needs them.
pub trait Rows: Sized {
    /// The number of rows.
    fn rows(&self) -> usize;
    /// Rows `start..end`.
    fn slice(&self, start: usize, end: usize) -> Self;
    /// The rows of `parts`, one after the other (at least one part).
    fn concat(parts: Vec<Self>) -> Self;
}

/// Regroups units' batches into the planning loader's; see the [module docs](self).
#[derive(Debug)]
pub struct Regroup<R> {
    per_batch: usize,
    drop_last: bool,
    /// Whether short batches are made up from the next rows.
    regroup: bool,
    /// Batches pushed and not all popped: the rows, their positions, the rows popped.
    queue: VecDeque<(R, Vec<u64>, usize)>,
}

impl<R: Rows> Regroup<R> {
    /// Regroups the units of `plan`, decoded in `order`.
    pub fn new(plan: &EpochPlan, order: Order) -> Self {
        Self {
            per_batch: plan.per_batch(),
            drop_last: plan.drop_last(),
            regroup: plan.per_batch() > 1 && order == Order::Input,
            queue: VecDeque::new(),
        }
    }

    /// A unit's next batch (in plan order) and its rows' positions, one per row.
    ///
    /// # Panics
    /// If the positions are not one per row.
    pub fn push(&mut self, rows: R, positions: Vec<u64>) {
        assert_eq!(
            rows.rows(),
            positions.len(),
            "Regroup::push: one position per row"
        );
        if !positions.is_empty() {
            self.queue.push_back((rows, positions, 0));
        }
    }

    /// Rows pushed and not popped yet.
    pub fn pending(&self) -> usize {
        self.queue.iter().map(|(_, p, at)| p.len() - at).sum()
    }

    /// The next batch and its rows' positions, or `None` when it needs more rows: pushed
    /// later, or (`finished`: every unit is pushed) none — the epoch's end.
    pub fn pop(&mut self, finished: bool) -> Option<(R, Vec<u64>)> {
        let (rows, positions, at) = self.queue.front()?;
        if !self.regroup || (*at == 0 && positions.len() == self.per_batch) {
            let (rows, positions, at) = self.queue.pop_front().expect("a front");
            if at == 0 {
                return Some((rows, positions));
            }
            let n = rows.rows();
            return Some((rows.slice(at, n), positions[at..].to_vec()));
        }
        let _ = rows;
        let available = self.pending();
        if available < self.per_batch && !finished {
            return None;
        }
        if available < self.per_batch && self.drop_last {
            self.queue.clear();
            return None;
        }
        let mut parts = Vec::new();
        let mut taken = Vec::with_capacity(self.per_batch);
        while taken.len() < self.per_batch {
            let Some((rows, positions, at)) = self.queue.front_mut() else {
                break;
            };
            let n = (positions.len() - *at).min(self.per_batch - taken.len());
            parts.push(rows.slice(*at, *at + n));
            taken.extend_from_slice(&positions[*at..*at + n]);
            *at += n;
            if *at == positions.len() {
                self.queue.pop_front();
            }
        }
        Some((R::concat(parts), taken))
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::engine::checkpoint::{PipelineState, ShareState};
    use crate::loader::units::Batching;

    /// Rows that are their own positions.
    impl Rows for Vec<u64> {
        fn rows(&self) -> usize {
            self.len()
        }
        fn slice(&self, start: usize, end: usize) -> Self {
            self[start..end].to_vec()
        }
        fn concat(parts: Vec<Self>) -> Self {
            parts.concat()
        }
    }

    fn plan(len: usize, per_batch: usize, drop_last: bool) -> EpochPlan {
        let start = PipelineState {
            shard: Some(ShareState {
                world: 1,
                global_len: len as u64,
                ..ShareState::default()
            }),
            ..PipelineState::default()
        };
        let batching = Batching {
            per_batch,
            drop_last,
            decodes_units: false,
            units_refusal: None,
            fill: false,
            reader: None,
        };
        EpochPlan::new(start, &batching, 1).expect("a plan")
    }

    /// Units of one batch each, `skipped` positions left out of theirs; the batches popped.
    fn run(
        len: usize,
        per_batch: usize,
        drop_last: bool,
        order: Order,
        skipped: &[u64],
    ) -> Vec<Vec<u64>> {
        let p = plan(len, per_batch, drop_last);
        let mut r = Regroup::new(&p, order);
        let mut out = Vec::new();
        for u in 0..p.len() {
            let unit = p.unit(u).expect("a unit");
            let rows: Vec<u64> = unit
                .positions
                .ranges()
                .flat_map(|(a, b)| a..b)
                .filter(|q| !skipped.contains(q))
                .collect();
            r.push(rows.clone(), rows);
            while let Some((rows, positions)) = r.pop(false) {
                assert_eq!(rows, positions);
                out.push(rows);
            }
        }
        while let Some((rows, _)) = r.pop(true) {
            out.push(rows);
        }
        assert_eq!(r.pending(), 0);
        out
    }

    #[test]
    fn whole_batches_pass_as_they_are() {
        let out = run(10, 4, false, Order::Input, &[]);
        assert_eq!(out, vec![vec![0, 1, 2, 3], vec![4, 5, 6, 7], vec![8, 9]]);
        let out = run(10, 4, true, Order::Input, &[]);
        assert_eq!(out, vec![vec![0, 1, 2, 3], vec![4, 5, 6, 7]]);
    }

    #[test]
    fn a_short_batch_is_made_up_from_the_next_rows_as_the_local_loader_would() {
        // The local loader over 0..11 without 1 and 6, in batches of 4.
        let kept: Vec<u64> = (0..11).filter(|p| ![1, 6].contains(p)).collect();
        let local: Vec<Vec<u64>> = kept.chunks(4).map(<[u64]>::to_vec).collect();
        assert_eq!(run(11, 4, false, Order::Input, &[1, 6]), local);
        // With drop_last the last partial batch (of the local loader's) is dropped.
        let local: Vec<Vec<u64>> = kept.chunks_exact(4).map(<[u64]>::to_vec).collect();
        assert_eq!(run(11, 4, true, Order::Input, &[1, 6]), local);
    }

    #[test]
    fn every_row_once_for_any_sizes_and_skips() {
        for len in 1..23 {
            for per_batch in 1..7 {
                for drop_last in [false, true] {
                    let skipped: Vec<u64> = (0..len as u64).filter(|p| p % 5 == 2).collect();
                    let kept: Vec<u64> = (0..len as u64).filter(|p| !skipped.contains(p)).collect();
                    let out = run(len, per_batch, drop_last, Order::Input, &skipped);
                    // The local loader's batches of what is readable.
                    let chunks: Vec<Vec<u64>> = if drop_last {
                        kept.chunks_exact(per_batch).map(<[u64]>::to_vec).collect()
                    } else {
                        kept.chunks(per_batch).map(<[u64]>::to_vec).collect()
                    };
                    assert_eq!(out, chunks, "len {len}, batch {per_batch}, {drop_last}");
                }
            }
        }
    }

    #[test]
    fn completion_order_passes_short_batches_as_they_are() {
        let out = run(9, 4, false, Order::Completion, &[1]);
        assert_eq!(out, vec![vec![0, 2, 3], vec![4, 5, 6, 7], vec![8]]);
    }
}
