//! Which dataset indices an epoch visits, in what order, on which rank.
//!
//! A [`Sampler`] turns a dataset of `n` items into each epoch's index list: in order, or a
//! seeded shuffle reseeded every epoch, or a weighted draw (with or without replacement); then
//! the rank's shard of it. Every rank computes the same global order from the same seed and
//! keeps every `world`-th position starting at its rank, so the shards are disjoint and
//! together cover the epoch. With [`ShareLengths::Pad`] or [`ShareLengths::Drop`] every rank
//! gets the same number of items (collective training steps need it).
//!
//! Orders are a pure function of (seed, epoch, rank, world): the property that makes
//! [`Pipeline::resume`](crate::Pipeline::resume) exact.

use flowgate_actors::error::PipelineError;
use flowgate_actors::origin::RangeSet;
use flowgate_tuner::Rng;

mod buckets;
mod layout;
mod mixture;

pub use buckets::{Bucketing, LengthBatches};
pub use layout::Layout;
use mixture::Mixture;
pub use mixture::{check_weights, MixStop};

/// The most items one epoch's order may hold: 2^32 (an order is materialised, 8 bytes an
/// item: 32 GiB at this size). A number past it — a mixture's `draws`, a manifest's sample
/// counts — is a typo or a lie, refused with an error naming it, not an allocation that
/// aborts the process.
pub const MAX_EPOCH_ITEMS: usize = flowgate_actors::limits::DRAWS.max as usize;

/// Bytes an epoch's order takes per position at its peak, made at each epoch's start: the
/// global order, this rank's positions and a reader's part of them, 8 bytes each (a mixture of
/// 2^24 draws peaked at 439 MiB: 26 bytes a draw, the process's own included).
pub const ORDER_BYTES_PER_ITEM: u64 = 24;

/// Refuses an epoch of `positions` whose order ([`ORDER_BYTES_PER_ITEM`] each) would take
/// more than the `available` bytes this process has (`source` says where that figure comes
/// from): made at the first epoch's start, such an order aborts the process on its
/// allocation instead. What [`MAX_EPOCH_ITEMS`] allows is more than most machines hold.
pub fn check_order_fits(positions: usize, available: u64, source: &str) -> Result<(), String> {
    let need = (positions as u64).saturating_mul(ORDER_BYTES_PER_ITEM);
    if need <= available {
        return Ok(());
    }
    let gib = |b: u64| format!("{:.1} GiB", b as f64 / (1u64 << 30) as f64);
    Err(format!(
        "an epoch of {positions} items: its order takes about {} ({ORDER_BYTES_PER_ITEM} bytes \
         an item, made at each epoch's start), more than the {} this process has ({source}); \
         ask for fewer items (a mixture's draws) or run where there is more memory",
        gib(need),
        gib(available)
    ))
}

/// How shards of an epoch that does not divide evenly are made equal.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum ShareLengths {
    /// Leave them uneven (the first `len % world` ranks get one more): nothing dropped or
    /// repeated.
    #[default]
    #[serde(alias = "Uneven")]
    Uneven,
    /// Drop the last `len % world` positions of the epoch's order (different items every
    /// epoch when shuffled).
    #[serde(alias = "Drop")]
    Drop,
    /// Repeat positions from the start of the epoch's order until every shard has
    /// `ceil(len / world)` items (what PyTorch's `DistributedSampler` does).
    #[serde(alias = "Pad")]
    Pad,
}

/// How a sampler over groups (the samples of tar shards) deals an epoch to ranks: each rank
/// takes one contiguous block of the epoch's order (so it reads whole shards, not every
/// `world`-th sample of all of them), visited through a shuffle buffer of `window` samples
/// (webdataset's: a seeded random pick among the next `window`), seeded by `seed` (which mixes
/// the sampler's seed and the epoch) and the rank.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
pub struct Blocks {
    /// The shuffle buffer's size in samples (0 or 1: the block in order).
    pub window: u64,
    /// The buffer's seed for the epoch.
    pub seed: u64,
}

#[derive(Clone, Debug)]
struct Weighted {
    /// Cumulative weights (for draws with replacement).
    cumulative: Vec<f64>,
    weights: Vec<f64>,
    samples: usize,
    replacement: bool,
}

/// Each epoch's indices into a dataset of `len` items; see the [module docs](self).
///
/// # Examples
///
/// ```
/// use flowgate::sampler::{Sampler, ShareLengths};
///
/// // Rank 1 of 4, a new order every epoch, every rank the same length.
/// let s = Sampler::new(10).shuffle(7).shard(1, 4)?.shard_lengths(ShareLengths::Pad);
/// assert_eq!(s.epoch(0).len(), 3);
/// assert_ne!(s.epoch(0), s.epoch(1));
///
/// // Weighted, with replacement: index 2 is drawn about 8 times as often as index 0.
/// let w = Sampler::new(3).weighted(&[1.0, 1.0, 8.0], 1000, true)?;
/// let twos = w.epoch(0).iter().filter(|&&i| i == 2).count();
/// assert!(twos > 700);
/// # Ok::<(), flowgate::PipelineError>(())
/// ```
#[derive(Clone, Debug)]
pub struct Sampler {
    len: usize,
    seed: Option<u64>,
    rank: usize,
    world: usize,
    lengths: ShareLengths,
    weighted: Option<Weighted>,
    /// Group lengths (samples per shard), for group-shuffled, block-dealt epochs.
    groups: Option<std::sync::Arc<[usize]>>,
    /// The shuffle buffer of group sampling, in samples.
    window: usize,
    /// Several sources drawn by weight.
    mixture: Option<std::sync::Arc<Mixture>>,
    /// `(worker, workers)`: this process visits every `workers`-th of the rank's positions.
    split: Option<(usize, usize)>,
}

impl Sampler {
    /// Every index of a dataset of `len` items, in order, once per epoch.
    pub fn new(len: usize) -> Self {
        Self {
            len,
            seed: None,
            rank: 0,
            world: 1,
            lengths: ShareLengths::Uneven,
            weighted: None,
            groups: None,
            window: 0,
            mixture: None,
            split: None,
        }
    }

    /// Treats the dataset as consecutive groups of `lengths` items (the samples of each tar
    /// shard, in shard order): an epoch's order keeps each group's items together and in
    /// stream order, shuffling only the groups (with the [`shuffle`](Self::shuffle) seed), and
    /// each rank takes one contiguous block of it (see [`Blocks`]), so a rank streams through
    /// whole shards and splits at most two with its neighbours. The lengths must add up to
    /// the dataset's; weighted sampling cannot be combined with groups.
    pub fn groups(mut self, lengths: &[usize]) -> Result<Self, PipelineError> {
        let total: usize = lengths.iter().sum();
        if total != self.len {
            return Err(PipelineError::config(format!(
                "group sampling: the {} groups hold {total} items, the dataset {}",
                lengths.len(),
                self.len
            )));
        }
        if self.weighted.is_some() || self.mixture.is_some() {
            return Err(PipelineError::config(
                "group sampling cannot be combined with weighted sampling or a mixture",
            ));
        }
        self.groups = Some(lengths.into());
        Ok(self)
    }

    /// With [`groups`](Self::groups): each rank visits its block through a shuffle buffer of
    /// `window` samples (webdataset's `shuffle(window)`: a seeded random pick among the next
    /// `window` samples of the stream), so samples of a shard do not arrive in stream order.
    /// The buffer holds samples read and not yet consumed: a larger window mixes better and
    /// holds more. Reseeded every epoch, reproducible for a seed.
    pub fn buffer(mut self, window: usize) -> Self {
        self.window = window;
        self
    }

    /// A seeded shuffle, reseeded every epoch from `seed` and the epoch number (and the seed
    /// of weighted draws).
    pub fn shuffle(mut self, seed: u64) -> Self {
        self.seed = Some(seed);
        self
    }

    /// Keeps shard `rank` of `world` (every `world`-th position of the epoch's order). A rank
    /// outside `0..world` is an error: clamping it would give two ranks the same shard.
    pub fn shard(mut self, rank: usize, world: usize) -> Result<Self, PipelineError> {
        if world == 0 || rank >= world {
            return Err(PipelineError::config(format!(
                "rank {rank} of a world of {world}: the rank must be in 0..world"
            )));
        }
        self.world = world;
        self.rank = rank;
        Ok(self)
    }

    /// Splits this rank's share among `workers` processes (PyTorch `DataLoader` workers) and
    /// keeps worker `worker`'s part: every `workers`-th of the rank's positions, starting at
    /// the `worker`-th. The parts are uneven by at most one item and never padded, so the
    /// workers of a rank together visit exactly the rank's share (padding or dropping for
    /// equal counts happens at the rank level, see [`shard_lengths`](Self::shard_lengths)).
    /// `workers == 1` is the whole share; a worker outside `0..workers` is an error.
    pub fn split(mut self, worker: usize, workers: usize) -> Result<Self, PipelineError> {
        if workers == 0 || worker >= workers {
            return Err(PipelineError::config(format!(
                "worker {worker} of {workers}: the worker must be in 0..workers"
            )));
        }
        self.split = (workers > 1).then_some((worker, workers));
        Ok(self)
    }

    /// Shards by the `RANK` and `WORLD_SIZE` environment variables (what `torchrun` sets), or
    /// leaves the sampler whole when neither is set. A launch that sets only one of them, a
    /// value that is not a number, a rank outside `0..WORLD_SIZE`, or `LOCAL_RANK` without
    /// `RANK` is an error naming the variable: any of them would silently read a shard twice.
    pub fn shard_from_env(self) -> Result<Self, PipelineError> {
        self.shard_from_vars(|k| std::env::var(k).ok())
    }

    /// [`shard_from_env`](Self::shard_from_env) over variables from `get`.
    pub(crate) fn shard_from_vars(
        self,
        get: impl Fn(&str) -> Option<String>,
    ) -> Result<Self, PipelineError> {
        let num = |k: &str| -> Result<Option<usize>, PipelineError> {
            get(k)
                .map(|v| {
                    v.trim().parse::<usize>().map_err(|_| {
                        PipelineError::config(format!("{k}={v:?} is not a non-negative integer"))
                    })
                })
                .transpose()
        };
        match (num("RANK")?, num("WORLD_SIZE")?) {
            (Some(rank), Some(world)) => self.shard(rank, world).map_err(|_| {
                PipelineError::config(format!(
                    "RANK={rank} with WORLD_SIZE={world}: RANK must be in 0..WORLD_SIZE"
                ))
            }),
            (Some(_), None) => Err(PipelineError::config(
                "RANK is set but WORLD_SIZE is not: set both to shard, or neither",
            )),
            (None, Some(_)) => Err(PipelineError::config(
                "WORLD_SIZE is set but RANK is not: set both to shard, or neither",
            )),
            (None, None) if get("LOCAL_RANK").is_some() => Err(PipelineError::config(
                "LOCAL_RANK is set but RANK and WORLD_SIZE are not: set both to shard \
                 (LOCAL_RANK alone cannot say which shard is this process's)",
            )),
            (None, None) => Ok(self),
        }
    }

    /// The settings that decide each epoch's global order, as named fields (see
    /// [`Files::fingerprint`](crate::dataset::Files::fingerprint)). Rank and world size are not
    /// among them: a checkpoint records them in its [`ShareState`](crate::ShareState), and a
    /// merged one resumes at any world size.
    pub fn fingerprint(&self) -> Vec<(&'static str, String)> {
        let mut f = vec![
            (
                "shuffle_seed",
                self.seed.map_or("none".into(), |s| s.to_string()),
            ),
            ("shard_lengths", format!("{:?}", self.lengths)),
        ];
        if let Some(m) = &self.mixture {
            f.push((
                "mixture",
                format!(
                    "lengths {:?}, weights {:?}, stop {:?}",
                    m.lengths, m.weights, m.stop
                ),
            ));
        }
        if let Some(g) = &self.groups {
            let hash = g
                .iter()
                .fold(0u64, |h, &x| (h ^ x as u64).wrapping_mul(0x0100_0000_01b3));
            f.push(("groups", format!("{} groups, {hash:016x}", g.len())));
            f.push(("shuffle_buffer", self.window.to_string()));
        }
        if let Some(w) = &self.weighted {
            let hash = w.weights.iter().fold(0u64, |h, x| {
                (h ^ x.to_bits()).wrapping_mul(0x0100_0000_01b3)
            });
            f.push((
                "weights",
                format!(
                    "{} draws, replacement {}, {hash:016x}",
                    w.samples, w.replacement
                ),
            ));
        }
        f
    }

    /// How uneven shards are made equal (default: left uneven).
    pub fn shard_lengths(mut self, lengths: ShareLengths) -> Self {
        self.lengths = lengths;
        self
    }

    /// Draws `samples` indices per epoch with probability proportional to `weights` (one per
    /// item; non-negative and finite), with or without replacement. Without replacement the
    /// order is a weighted random permutation of `samples` distinct indices (Efraimidis and
    /// Spirakis' keys), so `samples` may not exceed the number of positive weights. Uses the
    /// [`shuffle`](Self::shuffle) seed (0 if none).
    pub fn weighted(
        mut self,
        weights: &[f64],
        samples: usize,
        replacement: bool,
    ) -> Result<Self, PipelineError> {
        if self.groups.is_some() || self.mixture.is_some() {
            return Err(PipelineError::config(
                "weighted sampling cannot be combined with group sampling or a mixture",
            ));
        }
        if weights.len() != self.len {
            return Err(PipelineError::config(format!(
                "weighted sampling: {} weights for {} items",
                weights.len(),
                self.len
            )));
        }
        if let Some((i, w)) = weights
            .iter()
            .enumerate()
            .find(|(_, w)| !w.is_finite() || **w < 0.0)
        {
            return Err(PipelineError::config(format!(
                "weighted sampling: weight {i} is {w}; weights must be finite and >= 0"
            )));
        }
        let positive = weights.iter().filter(|&&w| w > 0.0).count();
        if positive == 0 && samples > 0 {
            return Err(PipelineError::config(
                "weighted sampling: every weight is 0",
            ));
        }
        if !replacement && samples > positive {
            return Err(PipelineError::config(format!(
                "weighted sampling without replacement: {samples} samples asked, only \
                 {positive} items have a positive weight"
            )));
        }
        let cumulative = weights
            .iter()
            .scan(0.0, |acc, w| {
                *acc += w;
                Some(*acc)
            })
            .collect();
        self.weighted = Some(Weighted {
            cumulative,
            weights: weights.to_vec(),
            samples,
            replacement,
        });
        Ok(self)
    }

    /// Number of items in the dataset.
    pub fn dataset_len(&self) -> usize {
        self.len
    }

    /// Number of indices this rank visits per epoch.
    pub fn len(&self) -> usize {
        self.layout(0, RangeSet::default()).len()
    }

    /// Ranks in the world this sampler deals to (1: the whole dataset).
    pub fn world(&self) -> usize {
        self.world
    }

    /// This rank's place in `epoch` when the positions in `base` were delivered already (by
    /// the ranks of an earlier world; empty for an epoch from its start).
    pub fn layout(&self, epoch: u64, base: RangeSet) -> Layout {
        Layout {
            rank: self.rank,
            world: self.world,
            lengths: self.lengths,
            global_len: self.global_len_of(epoch) as u64,
            base,
            blocks: self.groups.as_ref().map(|_| Blocks {
                window: self.window as u64,
                seed: self.rng(epoch).next_u64(),
            }),
            split: self.split,
        }
    }

    /// This rank's indices for `epoch` once the positions of `base` (in the epoch's global
    /// order) are left out: the rest of the epoch dealt out afresh to this world's ranks.
    pub fn epoch_after(&self, epoch: u64, base: RangeSet) -> Vec<usize> {
        let order = self.global(epoch);
        self.layout(epoch, base)
            .positions()
            .into_iter()
            .map(|g| order[g as usize])
            .collect()
    }

    /// Whether this rank visits nothing.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// Number of positions in an epoch's global order (before sharding); for a mixture that
    /// stops when sources run out, epoch 0's (see [`global_len_of`](Self::global_len_of)).
    pub fn global_len(&self) -> usize {
        self.global_len_of(0)
    }

    /// Number of positions in `epoch`'s global order. The same for every epoch except for a
    /// mixture that stops when sources run out, whose epochs end after different numbers of
    /// draws.
    pub fn global_len_of(&self, epoch: u64) -> usize {
        match &self.mixture {
            Some(m) => match m.stop {
                MixStop::Draws(n) => n,
                _ => self.global(epoch).len(),
            },
            None => self.weighted.as_ref().map_or(self.len, |w| w.samples),
        }
    }

    fn rng(&self, epoch: u64) -> Rng {
        Rng::new(self.seed.unwrap_or(0) ^ epoch.wrapping_mul(0x9E37_79B9_7F4A_7C15))
    }

    /// The global order of `epoch`, before sharding.
    fn global(&self, epoch: u64) -> Vec<usize> {
        if let Some(m) = &self.mixture {
            return self.mixed(m, epoch);
        }
        let mut rng = self.rng(epoch);
        match &self.weighted {
            Some(w) if w.replacement => {
                let total = *w.cumulative.last().unwrap_or(&0.0);
                (0..w.samples)
                    .map(|_| {
                        let x = rng.uniform() * total;
                        // First index whose cumulative weight exceeds x (never a zero weight).
                        w.cumulative.partition_point(|&c| c <= x).min(self.len - 1)
                    })
                    .collect()
            }
            Some(w) => {
                // Key u^(1/w) per item, largest first; compared as ln(u)/w.
                let mut keyed: Vec<(f64, usize)> = w
                    .weights
                    .iter()
                    .enumerate()
                    .filter(|(_, &wt)| wt > 0.0)
                    .map(|(i, &wt)| (rng.uniform().ln() / wt, i))
                    .collect();
                keyed.sort_unstable_by(|a, b| b.0.total_cmp(&a.0).then(a.1.cmp(&b.1)));
                keyed.truncate(w.samples);
                keyed.into_iter().map(|(_, i)| i).collect()
            }
            None if self.groups.is_some() => {
                let groups = self.groups.as_deref().unwrap_or_default();
                let mut starts = Vec::with_capacity(groups.len());
                let mut at = 0;
                for &g in groups {
                    starts.push(at);
                    at += g;
                }
                let mut which: Vec<usize> = (0..groups.len()).collect();
                if self.seed.is_some() {
                    shuffle(&mut which, &mut rng);
                }
                which
                    .into_iter()
                    .flat_map(|g| starts[g]..starts[g] + groups[g])
                    .collect()
            }
            None => {
                let mut order: Vec<usize> = (0..self.len).collect();
                if self.seed.is_some() {
                    shuffle(&mut order, &mut rng);
                }
                order
            }
        }
    }

    /// This rank's indices for `epoch`, in order.
    pub fn epoch(&self, epoch: u64) -> Vec<usize> {
        self.epoch_after(epoch, RangeSet::default())
    }
}

/// A seeded Fisher-Yates shuffle.
fn shuffle<T>(v: &mut [T], rng: &mut Rng) {
    for i in (1..v.len()).rev() {
        let j = (rng.next_u64() % (i as u64 + 1)) as usize;
        v.swap(i, j);
    }
}

/// `items` in the order a shuffle buffer of `window` (seeded by `rng`) lets them out: the
/// buffer fills with the first `window`, then each step lets out a random one and takes in
/// the next; at the end it empties in random order. No item moves earlier by more than
/// `window - 1` places.
fn buffered<T: Copy>(items: &[T], window: usize, rng: &mut Rng) -> Vec<T> {
    if window <= 1 {
        return items.to_vec();
    }
    let mut out = Vec::with_capacity(items.len());
    // A window larger than the items never fills: hold no more than the items (a window of
    // 10^13 is a valid setting, not an allocation).
    let mut buf: Vec<T> = Vec::with_capacity(window.min(items.len()));
    for &x in items {
        buf.push(x);
        if buf.len() == window {
            let j = (rng.next_u64() % window as u64) as usize;
            out.push(buf.swap_remove(j));
        }
    }
    while !buf.is_empty() {
        let j = (rng.next_u64() % buf.len() as u64) as usize;
        out.push(buf.swap_remove(j));
    }
    out
}

#[cfg(test)]
mod tests;
