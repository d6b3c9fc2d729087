//! [`MakeUp`]: readable items to make up a batch whose every item failed, for a loader over a
//! user's map-style dataset (the Python package's `flowgate.DataLoader`), where a rank that
//! ends an epoch a batch short leaves the others waiting at their next collective (DDP).
//!
//! The rule: the positions after the failed batch's last one, in dataset order, wrapping
//! around; each tried at most once per make-up; positions seen failing are passed over without
//! a read (a dataset whose items all fail is read through once, not once a batch); once every
//! position is known to fail, nothing is read again. The made-up batch is deterministic (it
//! depends on the positions and on which items failed before, which a resume reads again), and
//! as long as the batch it replaces wherever the dataset has that many readable items.
//!
//! A batch whose items read but do not make a batch together (a user's collation fails:
//! a grayscale image among RGB ones) keeps as many of its items as halving finds do
//! ([`largest_batch`]: halved until the halves make batches, joined where they still do, then
//! each left out tried again; among three kinds a smaller group may be kept); the items left
//! out are its failures. The kept ones depend on the items alone (not on earlier batches), so
//! a resume makes the same batch.

//! [`MakeUp`]: readable items to make up, at once, a batch whose every item failed, for a
//! loader over a user's map-style dataset read by several ranks (the Python package's
//! `flowgate.DataLoader` under a world size above 1), where a rank that ends an epoch a batch
//! short leaves the others waiting at their next collective (DDP). The library's own loaders
//! make such batches up at the epoch's end instead ([`fill`](super::fill)); both read again
//! items of the rank's own share of the epoch, never another rank's, so no two ranks deliver
//! one item in one step.
//!
//! The rule: the positions after the failed batch's last one in the rank's order of the epoch
//! (its share, as its sampler gives it), wrapping around to the share's first; each tried at
//! most once per make-up; positions seen failing are passed over without a read (a share whose
//! items all fail is read through once, not once a batch). The made-up batch is deterministic
//! (it depends on the positions, the epoch's order and on which items failed before, which a
//! resume reads again), and as long as the batch it replaces wherever the share has that many
//! readable items. A loader in one process makes nothing up: it leaves such a batch out.
//!
//! A batch whose items read but do not make a batch together (a user's collation fails:
//! a grayscale image among RGB ones) keeps as many of its items as halving finds do
//! ([`largest_batch`]: halved until the halves make batches, joined where they still do, then
//! each left out tried again; among three kinds a smaller group may be kept); the items left
//! out are its failures. The kept ones depend on the items alone (not on earlier batches), so
//! a resume makes the same batch.

use std::collections::HashSet;

/// Readable items to make up a failed batch with; see the [module docs](self).
#[derive(Clone, Debug, Default)]
pub struct MakeUp {
    /// Positions seen failing.
    bad: HashSet<usize>,
}

impl MakeUp {
    /// Nothing known to fail yet.
    pub fn new() -> Self {
        Self::default()
    }

    /// `position` failed (in a batch, or while making one up): not read again for a make-up.
    pub fn failed(&mut self, position: usize) {
        self.bad.insert(position);
    }

    /// Takes in what `other` (a copy of this one that made a batch up) learned: the positions
    /// it saw failing.
    pub fn merge(&mut self, other: MakeUp) {
        self.bad.extend(other.bad);
    }

    /// Up to `want` items read by `read` from the positions after `last` in `order` (the
    /// rank's order of the epoch; see the [module docs](self)), wrapping around: each with its
    /// position, in the order read. A position whose read fails is marked failed. Where `last`
    /// is not in `order`, from its first position.
    pub fn after<T, E>(
        &mut self,
        order: &[usize],
        last: usize,
        want: usize,
        mut read: impl FnMut(usize) -> Result<T, E>,
    ) -> Vec<(usize, T)> {
        let mut out = Vec::with_capacity(want);
        let n = order.len();
        let from = order.iter().position(|&p| p == last).map_or(0, |k| k + 1);
        let mut tried = HashSet::new();
        for k in 0..n {
            if out.len() == want {
                break;
            }
            let p = order[(from + k) % n];
            if self.bad.contains(&p) || !tried.insert(p) {
                continue;
            }
            match read(p) {
                Ok(x) => out.push((p, x)),
                Err(_) => {
                    self.bad.insert(p);
                }
            }
        }
        out
    }
}

/// The most of `n` items (by their indices, in order) that make a batch, and the batch:
/// `make` on them all, else on each half (at least one item), the halves' batches joined
/// where they still make one, else the larger (the first of two as large); then each item
/// left out is tried with the kept ones (a halving may pair a good item with the odd one and
/// keep the odd one). At most about `4n` calls, a few per `log n` for one odd item; the
/// first error where no single item makes a batch.
pub fn largest_batch<B, E>(
    n: usize,
    mut make: impl FnMut(&[usize]) -> Result<B, E>,
) -> Result<(Vec<usize>, B), E> {
    let all: Vec<usize> = (0..n).collect();
    let (mut kept, mut batch) = fit(&all, &mut make)?;
    for i in 0..n {
        if kept.len() == n {
            break;
        }
        let at = match kept.binary_search(&i) {
            Ok(_) => continue,
            Err(at) => at,
        };
        let mut with = kept.clone();
        with.insert(at, i);
        if let Ok(b) = make(&with) {
            (kept, batch) = (with, b);
        }
    }
    Ok((kept, batch))
}

fn fit<B, E>(
    set: &[usize],
    make: &mut impl FnMut(&[usize]) -> Result<B, E>,
) -> Result<(Vec<usize>, B), E> {
    let error = match make(set) {
        Ok(b) => return Ok((set.to_vec(), b)),
        Err(e) => e,
    };
    if set.len() <= 1 {
        return Err(error);
    }
    let (left, right) = set.split_at(set.len() / 2);
    match (fit(left, make), fit(right, make)) {
        (Err(_), Err(_)) => Err(error),
        (Ok(x), Err(_)) | (Err(_), Ok(x)) => Ok(x),
        (Ok(x), Ok(y)) => {
            let joined: Vec<usize> = x.0.iter().chain(&y.0).copied().collect();
            // Both halves whole: joined they are the set, which failed.
            if joined.len() < set.len() {
                if let Ok(b) = make(&joined) {
                    return Ok((joined, b));
                }
            }
            Ok(if x.0.len() >= y.0.len() { x } else { y })
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A dataset of `n` items, those in `bad` unreadable; counts the reads.
    fn reader<'a>(
        bad: &[usize],
        reads: &'a mut Vec<usize>,
    ) -> impl FnMut(usize) -> Result<usize, ()> + 'a {
        let bad = bad.to_vec();
        move |p| {
            reads.push(p);
            if bad.contains(&p) {
                Err(())
            } else {
                Ok(p)
            }
        }
    }

    #[test]
    fn a_batch_is_made_up_of_the_readable_items_after_it_wrapping() {
        // 10 items; the batch 6..9 failed; 9 and 0 are unreadable too.
        let order: Vec<usize> = (0..10).collect();
        let mut m = MakeUp::new();
        for p in 6..9 {
            m.failed(p);
        }
        let mut reads = Vec::new();
        let got = m.after(&order, 8, 3, reader(&[6, 7, 8, 9, 0], &mut reads));
        assert_eq!(got, [(1, 1), (2, 2), (3, 3)]);
        assert_eq!(
            reads,
            [9, 0, 1, 2, 3],
            "each tried once, in order, the known bad passed over"
        );
        // The next make-up passes over 9 and 0 without reading them.
        let mut reads = Vec::new();
        assert_eq!(
            m.after(&order, 8, 2, reader(&[6, 7, 8, 9, 0], &mut reads)),
            [(1, 1), (2, 2)]
        );
        assert_eq!(reads, [1, 2]);
    }

    #[test]
    fn fewer_readable_than_wanted_gives_what_there_is_and_an_unreadable_dataset_is_read_once() {
        let order: Vec<usize> = (0..7).collect();
        let mut m = MakeUp::new();
        let mut reads = Vec::new();
        assert_eq!(
            m.after(&order, 2, 4, reader(&[0, 1, 2, 4, 5, 6], &mut reads)),
            [(3, 3)]
        );
        assert_eq!(
            reads,
            [3, 4, 5, 6, 0, 1, 2],
            "every position tried once, wrapping"
        );
        let five: Vec<usize> = (0..5).collect();
        let mut all_bad = MakeUp::new();
        let mut reads = Vec::new();
        assert!(all_bad
            .after(&five, 0, 2, reader(&[0, 1, 2, 3, 4], &mut reads))
            .is_empty());
        assert_eq!(reads.len(), 5);
        let mut again = Vec::new();
        assert!(all_bad
            .after(&five, 3, 2, reader(&[], &mut again))
            .is_empty());
        assert!(again.is_empty(), "known unreadable: not read again");
        assert!(MakeUp::new()
            .after(&[], 0, 1, reader(&[], &mut Vec::new()))
            .is_empty());
    }

    #[test]
    fn fillers_come_from_the_ranks_own_share_after_the_batch_in_its_order() {
        // Rank 1 of 2 over 12 items, shuffled: its share is every other position of the
        // epoch's order. Its batch [7, 1] failed: the fillers are its own next items, never
        // rank 0's (the items after 1 in dataset order, 2 and 3, are rank 0's here).
        let share = [9, 5, 7, 1, 11, 3];
        let mut m = MakeUp::new();
        m.failed(7);
        m.failed(1);
        let mut reads = Vec::new();
        let got = m.after(&share, 1, 2, reader(&[7, 1, 11], &mut reads));
        assert_eq!(got, [(3, 3), (9, 9)]);
        assert_eq!(
            reads,
            [11, 3, 9],
            "in the share's order after the batch, wrapping"
        );
        assert!(reads.iter().all(|p| share.contains(p)));
        // A share that repeats a position (padding) tries it once.
        let mut reads = Vec::new();
        let padded = [4, 2, 4];
        let mut m = MakeUp::new();
        m.failed(2);
        assert_eq!(m.after(&padded, 2, 3, reader(&[2], &mut reads)), [(4, 4)]);
        assert_eq!(reads, [4]);
    }

    /// A collation of `items` (each a shape): one batch where all share a shape, counting
    /// the calls.
    fn stack<'a>(
        items: &'a [u8],
        calls: &'a mut usize,
    ) -> impl FnMut(&[usize]) -> Result<Vec<usize>, String> + 'a {
        move |set| {
            *calls += 1;
            let shape = items[set[0]];
            match set.iter().all(|&i| items[i] == shape) {
                true => Ok(set.to_vec()),
                false => Err(format!("{set:?} do not stack")),
            }
        }
    }

    #[test]
    fn a_batch_that_does_not_collate_keeps_the_most_items_that_do() {
        // One odd item among 16, at each place: the other 15 kept, in order, few calls.
        for odd in 0..16 {
            let mut items = [3u8; 16];
            items[odd] = 1;
            let mut calls = 0;
            let (kept, batch) = largest_batch(16, stack(&items, &mut calls)).unwrap();
            let want: Vec<usize> = (0..16).filter(|&i| i != odd).collect();
            assert_eq!(
                (kept.clone(), batch),
                (want.clone(), want),
                "odd item {odd}"
            );
            assert!(calls <= 16, "odd item {odd}: {calls} calls");
        }
        // Two shapes: the larger group wins wherever the halving keeps it whole.
        let items = [3, 1, 3, 3, 3, 1, 3, 3, 3, 3, 3];
        let (kept, _) = largest_batch(items.len(), stack(&items, &mut 0)).unwrap();
        assert_eq!(kept, [0, 2, 3, 4, 6, 7, 8, 9, 10]);
        // Every item alone fails: the first error; a batch of none or one that makes one.
        let mut calls = 0;
        let err = largest_batch(5, |set: &[usize]| -> Result<(), String> {
            calls += 1;
            Err(format!("{set:?}"))
        });
        assert_eq!(err.unwrap_err(), "[0, 1, 2, 3, 4]");
        assert_eq!(calls, 9, "each subset of the halving once");
        let ok = largest_batch(1, |set: &[usize]| Ok::<_, ()>(set.len())).unwrap();
        assert_eq!(ok, (vec![0], 1));
        // Many odd items: at most about 3n calls.
        let items: Vec<u8> = (0..64).map(|i| (i * 7 % 5) as u8).collect();
        let mut calls = 0;
        let (kept, _) = largest_batch(64, stack(&items, &mut calls)).unwrap();
        assert!(kept.iter().all(|&i| items[i] == items[kept[0]]) && kept.len() >= 6);
        assert!(calls <= 4 * 64, "{calls} calls");
    }
}
