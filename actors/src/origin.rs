//! Which source items a result carries, so a consumer can checkpoint exactly what it received.
//!
//! Every item the source emits is tagged with its position in the epoch (its *index*) and a
//! full *share* ([`WHOLE`]). A stage that turns one input into one output passes the tag on; a
//! batch ([`aggregate`](crate::aggregate)) carries the tags of all its items; a stage that turns
//! one input into several outputs (`disaggregate`, a flat map) splits the shares among them, so
//! a source item is *delivered* exactly when the shares the consumer received add up to
//! [`WHOLE`]. Filtered and failed items simply never reach the consumer.
//!
//! [`Delivered`] is the consumer's ledger: ranges of fully delivered indices (compact when the
//! results arrive roughly in order, which the bounded budgets guarantee) and the shares of
//! partly delivered ones.

use std::collections::{BTreeMap, HashMap};

/// The share of a whole source item (2^40, so splitting into up to a trillion parts is exact).
pub const WHOLE: u64 = 1 << 40;

/// The source items (index in the epoch, share) that a result carries.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub enum Origin {
    /// Nothing (a result built from no source item).
    #[default]
    None,
    /// One source item, or a share of one.
    One(u64, u64),
    /// Several (a batch).
    Many(Box<[(u64, u64)]>),
}

impl Origin {
    /// The whole source item at `index`.
    #[inline]
    pub fn source(index: u64) -> Self {
        Origin::One(index, WHOLE)
    }

    /// Calls `f(index, share)` for each part.
    pub fn for_each(&self, mut f: impl FnMut(u64, u64)) {
        match self {
            Origin::None => {}
            Origin::One(i, s) => f(*i, *s),
            Origin::Many(v) => v.iter().for_each(|&(i, s)| f(i, s)),
        }
    }

    /// Origins of `n` outputs made from one input of this origin: one output keeps it whole;
    /// several share it out (the remainder of the division goes to the last), so the shares
    /// of the outputs add up to the input's.
    pub fn split(self, n: usize) -> Vec<Origin> {
        match n {
            0 => Vec::new(),
            1 => vec![self],
            _ => (0..n).map(|k| self.part(k, n)).collect(),
        }
    }

    /// The origin of output `k` of `n` made from one input of this origin (see
    /// [`split`](Self::split)); allocates only for batches.
    pub fn part(&self, k: usize, n: usize) -> Origin {
        let n = n as u64;
        let share = |s: u64| s / n + if k as u64 == n - 1 { s % n } else { 0 };
        match self {
            Origin::None => Origin::None,
            Origin::One(i, s) => match share(*s) {
                0 => Origin::None,
                s => Origin::One(*i, s),
            },
            Origin::Many(v) => {
                let mut g = Gather::default();
                for &(i, s) in v.iter() {
                    g.add(&Origin::One(i, share(s)));
                }
                g.take()
            }
        }
    }
}

/// Builds the origin of a batch from the origins of its items.
#[derive(Debug, Default)]
pub struct Gather(Vec<(u64, u64)>);

impl Gather {
    /// Adds an item's origin.
    #[inline]
    pub fn add(&mut self, o: &Origin) {
        o.for_each(|i, s| {
            if s > 0 {
                self.0.push((i, s));
            }
        });
    }

    /// The batch's origin; the gatherer is empty again.
    pub fn take(&mut self) -> Origin {
        match self.0.len() {
            0 => Origin::None,
            1 => {
                let (i, s) = self.0.pop().expect("one part");
                Origin::One(i, s)
            }
            _ => Origin::Many(std::mem::take(&mut self.0).into_boxed_slice()),
        }
    }
}

/// A set of `u64` kept as disjoint half-open ranges.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct RangeSet {
    /// start -> end (exclusive); no two ranges touch.
    ranges: BTreeMap<u64, u64>,
    len: u64,
}

impl RangeSet {
    /// The set of these ranges (`[start, end)`; they may overlap or touch).
    pub fn from_ranges(ranges: impl IntoIterator<Item = (u64, u64)>) -> Self {
        let mut v: Vec<(u64, u64)> = ranges.into_iter().filter(|(a, b)| a < b).collect();
        v.sort_unstable();
        let mut s = Self::default();
        for (a, b) in v {
            if let Some((_, end)) = s.ranges.iter_mut().next_back() {
                if a <= *end {
                    if b > *end {
                        s.len += b - *end;
                        *end = b;
                    }
                    continue;
                }
            }
            s.ranges.insert(a, b);
            s.len += b - a;
        }
        s
    }

    /// Adds `x`; false if it was already there.
    pub fn insert(&mut self, x: u64) -> bool {
        // Fast paths: at or past the end of the last range (results mostly arrive in order).
        if let Some(mut last) = self.ranges.last_entry() {
            let end = *last.get();
            if x == end {
                *last.get_mut() = x + 1;
                self.len += 1;
                return true;
            }
            if x > end {
                self.ranges.insert(x, x + 1);
                self.len += 1;
                return true;
            }
        }
        if self.contains(x) {
            return false;
        }
        let before = self
            .ranges
            .range(..=x)
            .next_back()
            .filter(|(_, &e)| e == x)
            .map(|(&s, _)| s);
        let after = self.ranges.get(&(x + 1)).copied();
        match (before, after) {
            (Some(s), Some(e)) => {
                self.ranges.remove(&(x + 1));
                self.ranges.insert(s, e);
            }
            (Some(s), None) => {
                self.ranges.insert(s, x + 1);
            }
            (None, Some(e)) => {
                self.ranges.remove(&(x + 1));
                self.ranges.insert(x, e);
            }
            (None, None) => {
                self.ranges.insert(x, x + 1);
            }
        }
        self.len += 1;
        true
    }

    /// Whether `x` is in the set.
    pub fn contains(&self, x: u64) -> bool {
        self.ranges
            .range(..=x)
            .next_back()
            .is_some_and(|(_, &e)| x < e)
    }

    /// Number of elements.
    pub fn len(&self) -> u64 {
        self.len
    }

    /// Whether the set is empty.
    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    /// The ranges, in order.
    pub fn ranges(&self) -> impl Iterator<Item = (u64, u64)> + '_ {
        self.ranges.iter().map(|(&s, &e)| (s, e))
    }
}

/// The consumer's ledger of one epoch: which source items it received.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Delivered {
    /// Fully delivered indices.
    pub done: RangeSet,
    /// Shares received of partly delivered indices.
    pub partial: HashMap<u64, u64>,
}

impl Delivered {
    /// Records a result's origin.
    #[inline]
    pub fn record(&mut self, o: &Origin) {
        o.for_each(|i, s| {
            if s >= WHOLE {
                self.done.insert(i);
                return;
            }
            let got = self.partial.entry(i).or_insert(0);
            *got += s;
            if *got >= WHOLE {
                self.partial.remove(&i);
                self.done.insert(i);
            }
        });
    }

    /// Forgets everything (a new epoch).
    pub fn clear(&mut self) {
        *self = Self::default();
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    #[test]
    fn split_shares_add_up() {
        let parts = Origin::source(7).split(3);
        let mut d = Delivered::default();
        d.record(&parts[0]);
        d.record(&parts[2]);
        assert!(!d.done.contains(7));
        d.record(&parts[1]);
        assert!(d.done.contains(7) && d.partial.is_empty());
    }

    #[test]
    fn batches_split_again() {
        let mut g = Gather::default();
        for i in 0..4 {
            g.add(&Origin::source(i));
        }
        let batch = g.take();
        let items = batch.split(4);
        let mut d = Delivered::default();
        for o in &items[..3] {
            d.record(o);
        }
        assert_eq!(
            d.done.len(),
            0,
            "no item is whole before every part arrived"
        );
        d.record(&items[3]);
        assert_eq!(d.done.ranges().collect::<Vec<_>>(), vec![(0, 4)]);
    }

    proptest! {
        #[test]
        fn range_set_matches_a_plain_set(xs in proptest::collection::vec(0u64..200, 0..300)) {
            let mut r = RangeSet::default();
            let mut s = std::collections::BTreeSet::new();
            for &x in &xs {
                prop_assert_eq!(r.insert(x), s.insert(x));
            }
            prop_assert_eq!(r.len(), s.len() as u64);
            for x in 0..201 {
                prop_assert_eq!(r.contains(x), s.contains(&x));
            }
            let ranges: Vec<_> = r.ranges().collect();
            for w in ranges.windows(2) {
                prop_assert!(w[0].1 < w[1].0, "ranges are disjoint and do not touch");
            }
            prop_assert_eq!(RangeSet::from_ranges(ranges), r);
        }
    }
}
