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

use std::collections::HashSet;

/// Readable items to make up a failed batch with; see the [module docs](self).
#[derive(Clone, Debug, Default)]
pub struct MakeUp {
    len: usize,
    /// Positions seen failing.
    bad: HashSet<usize>,
    /// Every position failed: nothing to make up with.
    none_readable: bool,
}

impl MakeUp {
    /// For a dataset of `len` items.
    pub fn new(len: usize) -> Self {
        Self {
            len,
            ..Self::default()
        }
    }

    /// `position` failed (in a batch, or while making one up): not read again for a make-up.
    pub fn failed(&mut self, position: usize) {
        self.bad.insert(position);
    }

    /// Takes in what `other` (a copy of this one that made a batch up) learned: the positions
    /// it saw failing.
    pub fn merge(&mut self, other: MakeUp) {
        self.bad.extend(other.bad);
        self.none_readable |= other.none_readable;
    }

    /// Up to `want` items read by `read` from the positions after `last` (see the [module
    /// docs](self)): the items, in the order read. A position whose read fails is marked
    /// failed; none read and every position failed: none is read again.
    pub fn after<T, E>(
        &mut self,
        last: usize,
        want: usize,
        mut read: impl FnMut(usize) -> Result<T, E>,
    ) -> Vec<T> {
        let mut out = Vec::with_capacity(want);
        if self.none_readable || self.len == 0 {
            return out;
        }
        for k in 1..=self.len {
            if out.len() == want {
                break;
            }
            let p = (last + k) % self.len;
            if self.bad.contains(&p) {
                continue;
            }
            match read(p) {
                Ok(x) => out.push(x),
                Err(_) => {
                    self.bad.insert(p);
                }
            }
        }
        if out.is_empty() && self.bad.len() >= self.len {
            self.none_readable = true;
        }
        out
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
        let mut m = MakeUp::new(10);
        for p in 6..9 {
            m.failed(p);
        }
        let mut reads = Vec::new();
        let got = m.after(8, 3, reader(&[6, 7, 8, 9, 0], &mut reads));
        assert_eq!(got, [1, 2, 3]);
        assert_eq!(
            reads,
            [9, 0, 1, 2, 3],
            "each tried once, in order, the known bad passed over"
        );
        // The next make-up passes over 9 and 0 without reading them.
        let mut reads = Vec::new();
        assert_eq!(m.after(8, 2, reader(&[6, 7, 8, 9, 0], &mut reads)), [1, 2]);
        assert_eq!(reads, [1, 2]);
    }

    #[test]
    fn fewer_readable_than_wanted_gives_what_there_is_and_an_unreadable_dataset_is_read_once() {
        let mut m = MakeUp::new(7);
        let mut reads = Vec::new();
        assert_eq!(m.after(2, 4, reader(&[0, 1, 2, 4, 5, 6], &mut reads)), [3]);
        assert_eq!(
            reads,
            [3, 4, 5, 6, 0, 1, 2],
            "every position tried once, wrapping"
        );
        let mut all_bad = MakeUp::new(5);
        let mut reads = Vec::new();
        assert!(all_bad
            .after(0, 2, reader(&[0, 1, 2, 3, 4], &mut reads))
            .is_empty());
        assert_eq!(reads.len(), 5);
        let mut again = Vec::new();
        assert!(all_bad.after(3, 2, reader(&[], &mut again)).is_empty());
        assert!(again.is_empty(), "known unreadable: not read again");
        assert!(MakeUp::new(0)
            .after(0, 1, reader(&[], &mut Vec::new()))
            .is_empty());
    }
}
