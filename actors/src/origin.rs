//! Which source items a result carries, so a consumer can checkpoint exactly what it received.
//!
//! Every item the source emits is tagged with its position in the epoch (its *index*) and the
//! whole of it ([`Span::WHOLE`], the interval `[0, UNIT)`). A stage that turns one input into
//! one output passes the tag on; a batch ([`aggregate`](crate::aggregate)) carries the tags of
//! all its items; a stage that turns one input into several outputs (`disaggregate`, a flat
//! map) cuts the input's span into consecutive pieces, one per output, so a source item is
//! *delivered* exactly when the spans the consumer received cover `[0, UNIT)`. Spans, not
//! amounts: a part received twice (produced again after a resume) covers nothing new, so it
//! can neither complete an item early nor be counted twice, and the consumer can recognise
//! it and drop it ([`Delivered::covers`]). Filtered and failed items never reach the consumer.
//!
//! [`Delivered`] is the consumer's ledger: ranges of fully delivered indices (compact when the
//! results arrive roughly in order, which the bounded budgets guarantee) and the spans
//! received of partly delivered ones.

use std::collections::{BTreeMap, HashMap};

/// The length of a whole source item's interval (2^32: an item splits into up to four
/// billion parts exactly).
pub const UNIT: u64 = 1 << 32;

/// A non-empty interval `[lo, hi)` of `[0, UNIT)`: which part of a source item a result
/// carries. Packed in a `u64` (`lo` high, `hi - 1` low), the size of the share it replaced.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct Span(u64);

impl Span {
    /// The whole item.
    pub const WHOLE: Span = Span(UNIT - 1);

    /// `[lo, hi)`, if non-empty and within `[0, UNIT)`.
    pub fn new(lo: u64, hi: u64) -> Option<Span> {
        (lo < hi && hi <= UNIT).then_some(Span((lo << 32) | (hi - 1)))
    }

    /// The start.
    pub fn lo(self) -> u64 {
        self.0 >> 32
    }

    /// The end (exclusive).
    pub fn hi(self) -> u64 {
        (self.0 & (UNIT - 1)) + 1
    }

    /// Piece `k` of `n` consecutive pieces (empty, `None`, when the span is shorter than `n`).
    pub fn part(self, k: usize, n: usize) -> Option<Span> {
        let (lo, len) = (self.lo() as u128, (self.hi() - self.lo()) as u128);
        let at = |k: usize| (lo + len * k as u128 / n as u128) as u64;
        Span::new(at(k), at(k + 1))
    }
}

/// The source items (index in the epoch, part) that a result carries.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub enum Origin {
    /// Nothing (a result built from no source item).
    #[default]
    None,
    /// One source item, or a part of one.
    One(u64, Span),
    /// Several (a batch).
    Many(Box<[(u64, Span)]>),
}

impl Origin {
    /// The whole source item at `index`.
    #[inline]
    pub fn source(index: u64) -> Self {
        Origin::One(index, Span::WHOLE)
    }

    /// Calls `f(index, part)` for each part.
    pub fn for_each(&self, mut f: impl FnMut(u64, Span)) {
        match self {
            Origin::None => {}
            Origin::One(i, s) => f(*i, *s),
            Origin::Many(v) => v.iter().for_each(|&(i, s)| f(i, s)),
        }
    }

    /// Origins of `n` outputs made from one input of this origin: one output keeps it whole;
    /// several cut each of its spans into `n` consecutive pieces, which together cover it.
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
        match self {
            Origin::None => Origin::None,
            Origin::One(i, s) => s.part(k, n).map_or(Origin::None, |s| Origin::One(*i, s)),
            Origin::Many(v) => {
                let mut g = Gather::default();
                for &(i, s) in v.iter() {
                    if let Some(s) = s.part(k, n) {
                        g.0.push((i, s));
                    }
                }
                g.take()
            }
        }
    }
}

/// Builds the origin of a batch from the origins of its items.
#[derive(Debug, Default)]
pub struct Gather(Vec<(u64, Span)>);

impl Gather {
    /// Adds an item's origin.
    #[inline]
    pub fn add(&mut self, o: &Origin) {
        o.for_each(|i, s| self.0.push((i, s)));
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

    /// Adds `[a, b)`.
    pub fn insert_range(&mut self, a: u64, b: u64) {
        if a + 1 == b {
            self.insert(a);
        } else if a < b {
            *self = Self::from_ranges(self.ranges().chain(std::iter::once((a, b))));
        }
    }

    /// Whether all of `[a, b)` is in the set.
    pub fn covers(&self, a: u64, b: u64) -> bool {
        a >= b
            || self
                .ranges
                .range(..=a)
                .next_back()
                .is_some_and(|(_, &e)| b <= e)
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
    /// Parts received (spans of `[0, UNIT)`) of partly delivered indices.
    pub partial: HashMap<u64, RangeSet>,
    /// Whether results may carry parts received before (a resume with partly delivered
    /// items, which the source produces again whole): [`covers`](Self::covers) is checked.
    pub reissued: bool,
}

impl Delivered {
    /// Records a result's origin.
    #[inline]
    pub fn record(&mut self, o: &Origin) {
        o.for_each(|i, s| {
            if s == Span::WHOLE {
                self.done.insert(i);
                if !self.partial.is_empty() {
                    self.partial.remove(&i);
                }
                return;
            }
            if self.done.contains(i) {
                return;
            }
            let got = self.partial.entry(i).or_default();
            got.insert_range(s.lo(), s.hi());
            if got.covers(0, UNIT) {
                self.partial.remove(&i);
                self.done.insert(i);
            }
        });
    }

    /// Whether every part `o` carries was received already (`false` for no parts).
    pub fn covers(&self, o: &Origin) -> bool {
        let mut any = false;
        let mut all = true;
        o.for_each(|i, s| {
            any = true;
            all &= self.done.contains(i)
                || self
                    .partial
                    .get(&i)
                    .is_some_and(|r| r.covers(s.lo(), s.hi()));
        });
        any && all
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
        // A part received again adds nothing (amounts would have made the item whole).
        d.record(&parts[2]);
        d.record(&parts[0]);
        assert!(!d.done.contains(7) && d.covers(&parts[2]) && !d.covers(&parts[1]));
        d.record(&parts[1]);
        assert!(d.done.contains(7) && d.partial.is_empty());
        // Nested splits cover exactly their parent.
        let halves = Origin::source(8).split(2);
        let mut d = Delivered::default();
        for q in halves[0]
            .clone()
            .split(3)
            .iter()
            .chain(&halves[1].clone().split(5))
        {
            assert!(!d.done.contains(8));
            d.record(q);
        }
        assert!(d.done.contains(8));
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
