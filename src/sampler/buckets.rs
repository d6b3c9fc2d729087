//! Length-aware batching: batches whose padded size (items × the longest item) stays under a
//! cap, made of items of similar length so that little of a batch is padding.
//!
//! Items are sorted into length buckets (boundaries at the lengths' quantiles, or given); each
//! bucket gets a batch size of `max_batch / its longest item`, so no batch of it can exceed the
//! cap. Every epoch each bucket's items are shuffled (seeded by the seed and the epoch) and cut
//! into batches of that size. The number of batches per epoch is therefore fixed (a bucket of
//! `n` items at batch size `b` always gives `⌈n/b⌉`), and a batch is named by its slot: a
//! [`Sampler`] over the slots orders and shards them like any dataset (shuffled per epoch, the
//! same number per rank with [`ShareLengths::Pad`](super::ShareLengths::Pad)), which is what
//! makes checkpoints exact and mergeable across ranks, as for files.
//!
//! Lengths come from what containers declare (see
//! [`media::audio::duration`](crate::media::audio::duration)), not from decoding.

use flowgate_actors::error::PipelineError;
use flowgate_tuner::Rng;

use super::Sampler;

/// Where bucket boundaries come from.
#[derive(Clone, Debug, PartialEq)]
pub enum Bucketing {
    /// `n` buckets with boundaries at the lengths' quantiles (about as many items in each).
    Quantiles(usize),
    /// These upper bounds, ascending (items above the last go into one more bucket).
    Bounds(Vec<f64>),
}

impl Default for Bucketing {
    /// 20 quantile buckets.
    fn default() -> Self {
        Bucketing::Quantiles(20)
    }
}

/// Batches by length: see the [module docs](self).
///
/// # Examples
///
/// ```
/// use flowgate::sampler::{Bucketing, LengthBatches};
///
/// // Clips of 1 to 30 s; at most 60 s of padded audio per batch.
/// let lengths: Vec<f64> = (0..300).map(|i| 1.0 + (i % 30) as f64).collect();
/// let plan = LengthBatches::new(lengths, 60.0, Bucketing::Quantiles(10))?.shuffle(7);
/// let slots = plan.sampler().shuffle(7).shard(0, 2)?; // rank 0's batches, in order
/// for slot in slots.epoch(0) {
///     let items = plan.batch(0, slot); // dataset indices of one batch
///     assert!(items.len() as f64 * plan.longest(&items) <= 60.0);
/// }
/// # Ok::<(), flowgate::PipelineError>(())
/// ```
#[derive(Clone, Debug)]
pub struct LengthBatches {
    /// Each item's length, cropped to `max_batch`.
    lengths: Vec<f64>,
    max_batch: f64,
    /// Item indices per bucket, in dataset order.
    buckets: Vec<Vec<usize>>,
    /// Batch size per bucket.
    sizes: Vec<usize>,
    /// Each slot's bucket and chunk within it.
    slots: Vec<(usize, usize)>,
    seed: Option<u64>,
}

impl LengthBatches {
    /// The most items a batch of the plan holds (its bucket of the shortest items').
    pub fn most_items(&self) -> usize {
        self.sizes.iter().copied().max().unwrap_or(0)
    }

    /// Plans batches of items with these `lengths` (seconds, frames: any unit, the cap's),
    /// each batch's item count × its longest item at most `max_batch`. An item longer than
    /// `max_batch` counts as `max_batch` long (the decoder crops it there) and is a batch of
    /// its own.
    pub fn new(
        lengths: Vec<f64>,
        max_batch: f64,
        bucketing: Bucketing,
    ) -> Result<Self, PipelineError> {
        let bad = |m: String| Err(PipelineError::config(format!("length batches: {m}")));
        if !(max_batch.is_finite() && max_batch > 0.0) {
            return bad(format!(
                "the cap must be a positive number, not {max_batch}"
            ));
        }
        if let Some(i) = lengths.iter().position(|l| !(l.is_finite() && *l >= 0.0)) {
            return bad(format!("item {i} has length {}", lengths[i]));
        }
        let lengths: Vec<f64> = lengths.into_iter().map(|l| l.min(max_batch)).collect();
        let bounds = match bucketing {
            Bucketing::Quantiles(0) => return bad("0 buckets".into()),
            Bucketing::Quantiles(n) => {
                let mut sorted = lengths.clone();
                sorted.sort_by(f64::total_cmp);
                let mut b: Vec<f64> = (1..n)
                    .filter_map(|k| sorted.get(k * sorted.len() / n).copied())
                    .collect();
                b.dedup();
                b
            }
            Bucketing::Bounds(b) => {
                if b.iter().any(|x| !x.is_finite()) || b.windows(2).any(|w| w[0] >= w[1]) {
                    return bad(format!("bounds must be finite and ascending, not {b:?}"));
                }
                b
            }
        };
        let mut buckets = vec![Vec::new(); bounds.len() + 1];
        for (i, &l) in lengths.iter().enumerate() {
            // The first bucket whose bound is not below the length.
            buckets[bounds.partition_point(|&b| b < l)].push(i);
        }
        buckets.retain(|b| !b.is_empty());
        let sizes: Vec<usize> = buckets
            .iter()
            .map(|b| {
                let longest = b.iter().map(|&i| lengths[i]).fold(0.0, f64::max);
                if longest > 0.0 {
                    ((max_batch / longest).floor() as usize).max(1)
                } else {
                    b.len()
                }
            })
            .collect();
        let slots = buckets
            .iter()
            .zip(&sizes)
            .enumerate()
            .flat_map(|(k, (b, &size))| (0..b.len().div_ceil(size)).map(move |j| (k, j)))
            .collect();
        Ok(Self {
            lengths,
            max_batch,
            buckets,
            sizes,
            slots,
            seed: None,
        })
    }

    /// Shuffles each bucket's items every epoch (seeded by `seed` and the epoch), so that
    /// batches are made of other items each epoch; without it they are cut in dataset order.
    pub fn shuffle(mut self, seed: u64) -> Self {
        self.seed = Some(seed);
        self
    }

    /// Batches per epoch (the whole dataset's; the same every epoch).
    pub fn len(&self) -> usize {
        self.slots.len()
    }

    /// Whether there are no batches.
    pub fn is_empty(&self) -> bool {
        self.slots.is_empty()
    }

    /// A sampler over the batch slots: add `shuffle` (the batches' order per epoch), `shard`
    /// and `shard_lengths(ShareLengths::Pad)` (each rank the same number of batches) as for
    /// files.
    pub fn sampler(&self) -> Sampler {
        Sampler::new(self.len())
    }

    /// The dataset indices of batch `slot` in `epoch`.
    pub fn batch(&self, epoch: u64, slot: usize) -> Vec<usize> {
        let Some(&(k, j)) = self.slots.get(slot) else {
            return Vec::new();
        };
        let items = &self.buckets[k];
        let size = self.sizes[k];
        let range = j * size..((j + 1) * size).min(items.len());
        match self.seed {
            None => items[range].to_vec(),
            Some(seed) => {
                // The bucket's order this epoch: a seeded Fisher–Yates shuffle.
                let mut order = items.clone();
                let mut rng = Rng::new(
                    seed ^ epoch.wrapping_mul(0x9E37_79B9_7F4A_7C15)
                        ^ (k as u64).wrapping_mul(0xC2B2_AE3D_27D4_EB4F),
                );
                for i in (1..order.len()).rev() {
                    order.swap(i, (rng.next_u64() % (i as u64 + 1)) as usize);
                }
                order[range].to_vec()
            }
        }
    }

    /// Each item's length as planned (cropped to the cap).
    pub fn lengths(&self) -> &[f64] {
        &self.lengths
    }

    /// The longest of `items` (dataset indices).
    pub fn longest(&self, items: &[usize]) -> f64 {
        items.iter().map(|&i| self.lengths[i]).fold(0.0, f64::max)
    }

    /// The cap on a batch's padded size.
    pub fn max_batch(&self) -> f64 {
        self.max_batch
    }

    /// What a checkpoint over these batches depends on (for
    /// [`PipelineBuilder::checkpoint_fields`](crate::PipelineBuilder::checkpoint_fields)): the
    /// cap, the buckets' sizes and batch sizes, the seed.
    pub fn fingerprint(&self) -> Vec<(&'static str, String)> {
        let shape: Vec<String> = self
            .buckets
            .iter()
            .zip(&self.sizes)
            .map(|(b, s)| format!("{}x{s}", b.len()))
            .collect();
        vec![
            (
                "length_batches",
                format!("cap {} buckets {}", self.max_batch, shape.join(",")),
            ),
            (
                "length_batches_seed",
                self.seed.map_or_else(|| "none".into(), |s| s.to_string()),
            ),
        ]
    }

    /// The fraction of `epoch`'s padded batches that is padding: `1 - real / padded`, where a
    /// batch's padded size is its items × its longest.
    pub fn padding_fraction(&self, epoch: u64) -> f64 {
        let (mut real, mut padded) = (0.0, 0.0);
        for slot in 0..self.len() {
            let items = self.batch(epoch, slot);
            real += items.iter().map(|&i| self.lengths[i]).sum::<f64>();
            padded += items.len() as f64 * self.longest(&items);
        }
        if padded > 0.0 {
            1.0 - real / padded
        } else {
            0.0
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::sampler::ShareLengths;

    fn lengths(n: usize, seed: u64) -> Vec<f64> {
        let mut rng = Rng::new(seed);
        (0..n).map(|_| 1.0 + 29.0 * rng.uniform()).collect()
    }

    #[test]
    fn batches_stay_under_the_cap_and_cover_each_item_once() {
        let l = lengths(1000, 1);
        let plan = LengthBatches::new(l, 120.0, Bucketing::default())
            .unwrap()
            .shuffle(3);
        for epoch in 0..3 {
            let mut seen = vec![0u32; 1000];
            for slot in 0..plan.len() {
                let b = plan.batch(epoch, slot);
                assert!(!b.is_empty());
                assert!(b.len() as f64 * plan.longest(&b) <= 120.0 + 1e-9, "{b:?}");
                for i in b {
                    seen[i] += 1;
                }
            }
            assert!(
                seen.iter().all(|&n| n == 1),
                "each item once in epoch {epoch}"
            );
        }
        // New batches every epoch, the same ones for the same seed.
        assert_ne!(plan.batch(0, 0), plan.batch(1, 0));
        let again = LengthBatches::new(lengths(1000, 1), 120.0, Bucketing::default())
            .unwrap()
            .shuffle(3);
        assert_eq!(plan.batch(2, 5), again.batch(2, 5));
    }

    #[test]
    fn buckets_keep_padding_low_where_a_random_mix_pads_much() {
        let l = lengths(3000, 2);
        let plan = LengthBatches::new(l.clone(), 300.0, Bucketing::default())
            .unwrap()
            .shuffle(1);
        let bucketed = plan.padding_fraction(0);
        // One bucket: the same cap, batches of random lengths.
        let one = LengthBatches::new(l, 300.0, Bucketing::Bounds(vec![]))
            .unwrap()
            .shuffle(1);
        let mixed = one.padding_fraction(0);
        assert!(bucketed < 0.10, "{bucketed}");
        assert!(mixed > 0.40, "{mixed}");
    }

    #[test]
    fn ranks_get_equal_batch_counts_and_long_items_are_their_own_batch() {
        let mut l = lengths(101, 3);
        l[7] = 500.0; // above the cap: cropped to it, alone in its batch
        let plan = LengthBatches::new(l, 60.0, Bucketing::Quantiles(8)).unwrap();
        assert_eq!(plan.lengths()[7], 60.0);
        let alone = (0..plan.len())
            .map(|s| plan.batch(0, s))
            .find(|b| b.contains(&7))
            .unwrap();
        assert_eq!(alone.len(), 1);
        for world in [2, 3, 4] {
            let counts: Vec<usize> = (0..world)
                .map(|r| {
                    plan.sampler()
                        .shuffle(1)
                        .shard(r, world)
                        .unwrap()
                        .shard_lengths(ShareLengths::Pad)
                        .epoch(0)
                        .len()
                })
                .collect();
            assert!(counts.iter().all(|&c| c == counts[0]), "{counts:?}");
        }
    }

    #[test]
    fn bad_plans_are_named() {
        for (l, cap, b) in [
            (vec![1.0], 0.0, Bucketing::default()),
            (vec![f64::NAN], 10.0, Bucketing::default()),
            (vec![1.0], 10.0, Bucketing::Quantiles(0)),
            (vec![1.0], 10.0, Bucketing::Bounds(vec![3.0, 2.0])),
        ] {
            let e = LengthBatches::new(l, cap, b).unwrap_err();
            assert!(e.to_string().contains("length batches"), "{e}");
        }
    }
}
