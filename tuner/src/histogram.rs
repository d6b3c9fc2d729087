//! A log-linear latency histogram with a fixed number of buckets.
//!
//! Values are nanoseconds. Values below [`LINEAR`] get a bucket each; above that every power of
//! two is split into [`SUB_BUCKETS`] equal buckets, so the relative error of a reported quantile
//! is at most 1 / `SUB_BUCKETS` (25%) and usually much less (the midpoint is reported). The whole
//! range of `u64` fits in [`BUCKETS`] counters (2 KiB), cheap enough to keep one per worker
//! thread and merge on flush.

use std::time::Duration;

use serde::{Deserialize, Serialize};

/// Values below this many nanoseconds each get their own bucket.
const LINEAR: u64 = 8;
/// Buckets per power of two above [`LINEAR`].
const SUB_BUCKETS: u64 = 4;
/// log2 of [`SUB_BUCKETS`].
const SUB_BITS: u32 = 2;
/// Total buckets: 8 linear + 4 for each exponent 3..=63.
const BUCKETS: usize = LINEAR as usize + (64 - 3) * SUB_BUCKETS as usize;

/// Counts of durations in log-linear buckets; see the module docs.
#[derive(Clone)]
pub struct Histogram {
    counts: Box<[u64; BUCKETS]>,
    /// The range of buckets that may be non-zero (`lo > hi` when empty): merging and clearing
    /// touch only these, so flushing a worker's histogram costs a few adds, not 252.
    lo: usize,
    hi: usize,
    total: u64,
    sum_ns: u128,
    sum_sq: f64,
    max_ns: u64,
}

impl std::fmt::Debug for Histogram {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Histogram")
            .field("total", &self.total)
            .field("summary", &self.summary())
            .finish()
    }
}

impl Default for Histogram {
    fn default() -> Self {
        Self::new()
    }
}

/// Quantiles of a [`Histogram`], as durations.
#[derive(Clone, Copy, Debug, Default, PartialEq, Serialize, Deserialize)]
pub struct LatencySummary {
    /// Number of recorded values.
    pub count: u64,
    /// Exact mean of the recorded values.
    pub mean: Duration,
    /// Median (bucket midpoint).
    pub p50: Duration,
    /// 90th percentile (bucket midpoint).
    pub p90: Duration,
    /// 99th percentile (bucket midpoint).
    pub p99: Duration,
    /// Exact maximum.
    pub max: Duration,
    /// Standard deviation (exact, from the sum of squares).
    pub stddev: Duration,
}

fn bucket_of(v: u64) -> usize {
    if v < LINEAR {
        return v as usize;
    }
    let exp = 63 - v.leading_zeros(); // >= 3
    let sub = (v >> (exp - SUB_BITS)) & (SUB_BUCKETS - 1);
    LINEAR as usize + (exp as usize - 3) * SUB_BUCKETS as usize + sub as usize
}

/// The lower bound and width of bucket `i`.
fn bucket_range(i: usize) -> (u64, u64) {
    if i < LINEAR as usize {
        return (i as u64, 1);
    }
    let k = (i - LINEAR as usize) as u64;
    let exp = k / SUB_BUCKETS + 3;
    let sub = k % SUB_BUCKETS;
    let width = 1u64 << (exp - SUB_BITS as u64);
    ((SUB_BUCKETS + sub) * width, width)
}

impl Histogram {
    /// An empty histogram.
    pub fn new() -> Self {
        Self {
            counts: Box::new([0; BUCKETS]),
            lo: BUCKETS,
            hi: 0,
            total: 0,
            sum_ns: 0,
            sum_sq: 0.0,
            max_ns: 0,
        }
    }

    /// Records one value in nanoseconds.
    #[inline]
    pub fn record_ns(&mut self, ns: u64) {
        let b = bucket_of(ns);
        self.counts[b] += 1;
        self.lo = self.lo.min(b);
        self.hi = self.hi.max(b);
        self.total += 1;
        self.sum_ns += u128::from(ns);
        self.sum_sq += (ns as f64) * (ns as f64);
        self.max_ns = self.max_ns.max(ns);
    }

    /// Records one duration.
    #[inline]
    pub fn record(&mut self, d: Duration) {
        self.record_ns(u64::try_from(d.as_nanos()).unwrap_or(u64::MAX));
    }

    /// Number of recorded values.
    pub fn count(&self) -> u64 {
        self.total
    }

    /// Adds every count of `other` into `self`.
    pub fn merge(&mut self, other: &Histogram) {
        if other.total == 0 {
            return;
        }
        for i in other.lo..=other.hi {
            self.counts[i] += other.counts[i];
        }
        self.lo = self.lo.min(other.lo);
        self.hi = self.hi.max(other.hi);
        self.total += other.total;
        self.sum_ns += other.sum_ns;
        self.sum_sq += other.sum_sq;
        self.max_ns = self.max_ns.max(other.max_ns);
    }

    /// Forgets every value.
    pub fn clear(&mut self) {
        if self.lo <= self.hi {
            self.counts[self.lo..=self.hi].fill(0);
        }
        self.lo = BUCKETS;
        self.hi = 0;
        self.total = 0;
        self.sum_ns = 0;
        self.sum_sq = 0.0;
        self.max_ns = 0;
    }

    /// The value below which a fraction `q` (0..=1) of the values lie, as a bucket midpoint
    /// (never above the exact maximum). Zero when empty.
    pub fn quantile_ns(&self, q: f64) -> u64 {
        if self.total == 0 {
            return 0;
        }
        let rank = ((q.clamp(0.0, 1.0) * self.total as f64).ceil() as u64).max(1);
        let mut seen = 0;
        for (i, &c) in self.counts.iter().enumerate() {
            seen += c;
            if seen >= rank {
                let (lo, width) = bucket_range(i);
                return (lo + width / 2).min(self.max_ns);
            }
        }
        self.max_ns
    }

    /// Mean, p50, p90, p99 and max.
    pub fn summary(&self) -> LatencySummary {
        let mean = if self.total == 0 {
            0
        } else {
            (self.sum_ns / u128::from(self.total)) as u64
        };
        let stddev = if self.total < 2 {
            0.0
        } else {
            let n = self.total as f64;
            let m = self.sum_ns as f64 / n;
            (self.sum_sq / n - m * m).max(0.0).sqrt()
        };
        LatencySummary {
            count: self.total,
            mean: Duration::from_nanos(mean),
            p50: Duration::from_nanos(self.quantile_ns(0.50)),
            p90: Duration::from_nanos(self.quantile_ns(0.90)),
            p99: Duration::from_nanos(self.quantile_ns(0.99)),
            max: Duration::from_nanos(self.max_ns),
            stddev: Duration::from_nanos(stddev as u64),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn buckets_cover_u64_and_are_contiguous() {
        let mut next = 0u64;
        for i in 0..BUCKETS {
            let (lo, width) = bucket_range(i);
            assert_eq!(
                lo,
                next,
                "bucket {i} starts where {} ended",
                i.saturating_sub(1)
            );
            assert_eq!(bucket_of(lo), i);
            assert_eq!(bucket_of(lo + (width - 1)), i);
            next = lo.wrapping_add(width);
        }
        assert_eq!(next, 0, "the last bucket ends at u64::MAX");
        assert_eq!(bucket_of(u64::MAX), BUCKETS - 1);
    }

    #[test]
    fn quantiles_are_within_a_bucket() {
        let mut h = Histogram::new();
        for v in 1..=10_000u64 {
            h.record_ns(v * 1000);
        }
        for (q, exact) in [(0.5, 5_000_000.0), (0.9, 9_000_000.0), (0.99, 9_900_000.0)] {
            let got = h.quantile_ns(q) as f64;
            assert!((got - exact).abs() / exact < 0.13, "q{q}: {got} vs {exact}");
        }
        let s = h.summary();
        assert_eq!(s.count, 10_000);
        assert_eq!(s.mean, Duration::from_nanos(5_000_500));
        assert_eq!(s.max, Duration::from_millis(10));
        // The standard deviation of 1..=10000 µs is 2886.75 µs.
        assert!(
            (s.stddev.as_secs_f64() * 1e6 - 2886.75).abs() < 1.0,
            "{:?}",
            s.stddev
        );
    }

    #[test]
    fn merge_equals_recording_everything_once() {
        let (mut a, mut b, mut all) = (Histogram::new(), Histogram::new(), Histogram::new());
        for v in 0..500u64 {
            let x = v * v * 37 % 100_003;
            if v % 3 == 0 {
                a.record_ns(x)
            } else {
                b.record_ns(x)
            }
            all.record_ns(x);
        }
        a.merge(&b);
        assert_eq!(a.summary(), all.summary());
        a.clear();
        assert_eq!(a.summary(), LatencySummary::default());
    }
}
