//! Which dataset indices an epoch visits, in what order, on which rank.
//!
//! A [`Sampler`] turns a dataset of `n` items into each epoch's index list: in order, or a
//! seeded shuffle reseeded every epoch, or a weighted draw (with or without replacement); then
//! the rank's shard of it. Every rank computes the same global order from the same seed and
//! keeps every `world`-th position starting at its rank, so the shards are disjoint and
//! together cover the epoch. With [`ShardLengths::Pad`] or [`ShardLengths::Drop`] every rank
//! gets the same number of items (collective training steps need it).
//!
//! Orders are a pure function of (seed, epoch, rank, world): the property that makes
//! [`Pipeline::resume`](crate::Pipeline::resume) exact.

use flowgate_actors::origin::RangeSet;
use flowgate_tuner::Rng;

use crate::PipelineError;

/// How shards of an epoch that does not divide evenly are made equal.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
pub enum ShardLengths {
    /// Leave them uneven (the first `len % world` ranks get one more): nothing dropped or
    /// repeated.
    #[default]
    Uneven,
    /// Drop the last `len % world` positions of the epoch's order (different items every
    /// epoch when shuffled).
    Drop,
    /// Repeat positions from the start of the epoch's order until every shard has
    /// `ceil(len / world)` items (what PyTorch's `DistributedSampler` does).
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

/// When an epoch of a [mixture](Sampler::mixture) ends.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum MixStop {
    /// After this many draws; a source drawn to its end starts a new pass (reshuffled), so
    /// sources cycle.
    Draws(usize),
    /// At the first draw from a source that has been drawn to its end (that draw is not
    /// made): every item at most once per epoch.
    FirstExhausted,
    /// Once every source with a positive weight has been drawn to its end at least once
    /// (sources that ran out earlier start new passes): every item at least once per epoch.
    AllExhausted,
}

#[derive(Clone, Debug)]
struct Mixture {
    lengths: Vec<usize>,
    offsets: Vec<usize>,
    weights: Vec<f64>,
    cumulative: Vec<f64>,
    stop: MixStop,
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
/// use flowgate::sampler::{Sampler, ShardLengths};
///
/// // Rank 1 of 4, a new order every epoch, every rank the same length.
/// let s = Sampler::new(10).shuffle(7).shard(1, 4)?.shard_lengths(ShardLengths::Pad);
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
    lengths: ShardLengths,
    weighted: Option<Weighted>,
    /// Group lengths (samples per shard), for group-shuffled, block-dealt epochs.
    groups: Option<std::sync::Arc<[usize]>>,
    /// The shuffle buffer of group sampling, in samples.
    window: usize,
    /// Several sources drawn by weight.
    mixture: Option<std::sync::Arc<Mixture>>,
}

impl Sampler {
    /// Every index of a dataset of `len` items, in order, once per epoch.
    pub fn new(len: usize) -> Self {
        Self {
            len,
            seed: None,
            rank: 0,
            world: 1,
            lengths: ShardLengths::Uneven,
            weighted: None,
            groups: None,
            window: 0,
            mixture: None,
        }
    }

    /// A mixture of several sources of `lengths` items (the dataset is their concatenation:
    /// source `s`'s item `i` is index `offset(s) + i`, see [`Sampler::locate`]): each draw
    /// picks a source with probability proportional to `weights`, then that source's next
    /// item in its own order (shuffled per epoch and pass with the [`shuffle`](Self::shuffle)
    /// seed, else in order); `stop` says when the epoch ends. The epoch's order depends only
    /// on the seed and the epoch, so it is the same at any world size, is dealt out to ranks
    /// like any order (every `world`-th draw), and resumes exactly.
    pub fn mixture(
        lengths: &[usize],
        weights: &[f64],
        stop: MixStop,
    ) -> Result<Self, PipelineError> {
        let bad = |m: String| Err(PipelineError::config(format!("mixture: {m}")));
        if lengths.is_empty() || lengths.len() != weights.len() {
            return bad(format!(
                "{} sources and {} weights (one weight per source, at least one source)",
                lengths.len(),
                weights.len()
            ));
        }
        for (i, (&n, &w)) in lengths.iter().zip(weights).enumerate() {
            if !w.is_finite() || w < 0.0 {
                return bad(format!(
                    "weight {i} is {w}; weights must be finite and >= 0"
                ));
            }
            if w > 0.0 && n == 0 {
                return bad(format!("source {i} is empty but has weight {w}"));
            }
        }
        if weights.iter().all(|&w| w == 0.0) {
            return bad("every weight is 0".into());
        }
        let mut offsets = Vec::with_capacity(lengths.len());
        let mut at = 0;
        for &n in lengths {
            offsets.push(at);
            at += n;
        }
        let cumulative = weights
            .iter()
            .scan(0.0, |acc, w| {
                *acc += w;
                Some(*acc)
            })
            .collect();
        let mut s = Sampler::new(at);
        s.mixture = Some(std::sync::Arc::new(Mixture {
            lengths: lengths.to_vec(),
            offsets,
            weights: weights.to_vec(),
            cumulative,
            stop,
        }));
        Ok(s)
    }

    /// For a [mixture](Self::mixture): which source a dataset index is in, and its index
    /// there. Otherwise `(0, index)`.
    pub fn locate(&self, index: usize) -> (usize, usize) {
        match &self.mixture {
            Some(m) => {
                let s = m.offsets.partition_point(|&o| o <= index) - 1;
                (s, index - m.offsets[s])
            }
            None => (0, index),
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
    /// [`Files::fingerprint`](crate::media::Files::fingerprint)). Rank and world size are not
    /// among them: a checkpoint records them in its [`ShardState`](crate::ShardState), and a
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
    pub fn shard_lengths(mut self, lengths: ShardLengths) -> Self {
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

    /// A mixture's global order of `epoch`.
    fn mixed(&self, m: &Mixture, epoch: u64) -> Vec<usize> {
        let mut rng = self.rng(epoch);
        // Each source's order for pass `p`, reseeded per source and pass.
        let order = |s: usize, pass: u64| -> Vec<usize> {
            let mut o: Vec<usize> = (0..m.lengths[s]).collect();
            if self.seed.is_some() {
                let mut r = Rng::new(
                    self.rng(epoch).next_u64()
                        ^ (s as u64 + 1).wrapping_mul(0xA24B_AED4_963E_E407)
                        ^ pass.wrapping_mul(0x9FB2_1C65_1E98_DF25),
                );
                shuffle(&mut o, &mut r);
            }
            o
        };
        let k = m.lengths.len();
        let mut orders: Vec<Vec<usize>> = (0..k).map(|s| order(s, 0)).collect();
        let (mut next, mut pass) = (vec![0usize; k], vec![0u64; k]);
        let mut exhausted = vec![false; k];
        let live = |e: &[bool]| (0..k).all(|s| m.weights[s] == 0.0 || e[s]);
        let total = *m.cumulative.last().unwrap_or(&0.0);
        let mut out = Vec::new();
        loop {
            if let MixStop::Draws(n) = m.stop {
                if out.len() == n {
                    break;
                }
            }
            let x = rng.uniform() * total;
            let s = m.cumulative.partition_point(|&c| c <= x).min(k - 1);
            if next[s] == m.lengths[s] {
                if m.stop == MixStop::FirstExhausted {
                    break;
                }
                pass[s] += 1;
                orders[s] = order(s, pass[s]);
                next[s] = 0;
            }
            out.push(m.offsets[s] + orders[s][next[s]]);
            next[s] += 1;
            if next[s] == m.lengths[s] {
                exhausted[s] = true;
                if m.stop == MixStop::AllExhausted && live(&exhausted) {
                    break;
                }
            }
        }
        out
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
    let mut buf: Vec<T> = Vec::with_capacity(window);
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

/// Where one rank's items lie in an epoch's global order.
///
/// The positions not in `base` (those delivered before, by an earlier world's ranks) are
/// dealt out in order: rank `r` of `w` takes the `r`-th, `r + w`-th, … of them, after the
/// remaining list is made a multiple of `w` as `lengths` says (cut short, or padded by
/// repeating its start). With [`blocks`](Self::blocks) (group sampling) rank `r` takes
/// instead the `r`-th of `w` contiguous blocks of that list, through its shuffle buffer.
/// With an empty `base` this is plain sharding; a pipeline resumed from a merged checkpoint
/// at a new world size uses the merged delivered set as `base`.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Layout {
    /// This rank.
    pub rank: usize,
    /// Ranks in the world.
    pub world: usize,
    /// How uneven shares are made equal.
    pub lengths: ShardLengths,
    /// Positions in the epoch's global order.
    pub global_len: u64,
    /// Positions delivered before this world started the epoch.
    pub base: RangeSet,
    /// Contiguous blocks per rank, through a shuffle buffer (group sampling); `None`: every
    /// `world`-th position.
    pub blocks: Option<Blocks>,
}

impl Layout {
    /// Number of positions left for the world (not in `base`).
    fn remaining(&self) -> u64 {
        let before = self
            .base
            .ranges()
            .map(|(a, b)| {
                b.min(self.global_len)
                    .saturating_sub(a.min(self.global_len))
            })
            .sum::<u64>();
        self.global_len - before
    }

    /// Number of dealt positions (the remaining ones, cut or padded to a multiple of the
    /// world).
    fn dealt(&self) -> u64 {
        let (m, w) = (self.remaining(), self.world.max(1) as u64);
        match self.lengths {
            ShardLengths::Uneven => m,
            ShardLengths::Drop => m / w * w,
            ShardLengths::Pad if m == 0 => 0,
            ShardLengths::Pad => m.div_ceil(w) * w,
        }
    }

    /// Number of positions this rank visits.
    pub fn len(&self) -> usize {
        let (d, w, r) = (self.dealt(), self.world.max(1) as u64, self.rank as u64);
        if self.blocks.is_some() {
            let (a, b) = self.block();
            return (b - a) as usize;
        }
        (d / w + u64::from(r < d % w)) as usize
    }

    /// This rank's block `[start, end)` of the dealt positions (group sampling).
    fn block(&self) -> (u64, u64) {
        let (d, w, r) = (self.dealt(), self.world.max(1) as u64, self.rank as u64);
        (r * d / w, (r + 1) * d / w)
    }

    /// Whether this rank visits nothing.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// The remaining positions, in order.
    fn remaining_positions(&self) -> Vec<u64> {
        let mut out = Vec::with_capacity(self.remaining() as usize);
        let mut at = 0;
        for (a, b) in self.base.ranges() {
            out.extend(at..a.min(self.global_len));
            at = at.max(b);
        }
        out.extend(at..self.global_len);
        out
    }

    /// This rank's positions in the epoch's global order, in the order it visits them (its
    /// local position `p` is the `p`-th).
    pub fn positions(&self) -> Vec<u64> {
        let rest = self.remaining_positions();
        if let Some(b) = self.blocks {
            let (start, end) = self.block();
            let mine: Vec<u64> = (start..end)
                .map(|k| rest[k as usize % rest.len()])
                .collect();
            let mut rng = Rng::new(b.seed ^ (self.rank as u64).wrapping_mul(0xD6E8_FEB8_6659_FD93));
            return buffered(&mine, b.window as usize, &mut rng);
        }
        let (w, d) = (self.world.max(1), self.dealt() as usize);
        (self.rank..d)
            .step_by(w)
            .map(|k| rest[k % rest.len()])
            .collect()
    }

    /// The local position at which this rank visits global position `g` first, if it does.
    pub fn local_of(&self, g: u64) -> Option<u64> {
        if g >= self.global_len || self.base.contains(g) {
            return None;
        }
        if self.blocks.is_some() {
            return self
                .positions()
                .iter()
                .position(|&p| p == g)
                .map(|p| p as u64);
        }
        // g's index among the remaining positions: g minus the base positions before it.
        let before: u64 = self
            .base
            .ranges()
            .take_while(|&(a, _)| a < g)
            .map(|(a, b)| b.min(g) - a)
            .sum();
        let k = g - before;
        let (w, d) = (self.world.max(1) as u64, self.dealt());
        // Padding repeats the start of the list, so later copies sit at k + m, k + 2m, …
        let m = self.remaining();
        let mut j = k;
        while j < d {
            if j % w == self.rank as u64 {
                return Some(j / w);
            }
            j += m;
        }
        None
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    #[test]
    fn misconfigured_launches_are_errors_not_duplicate_shards() {
        let env = |pairs: &'static [(&'static str, &'static str)]| {
            move |k: &str| {
                pairs
                    .iter()
                    .find(|(n, _)| *n == k)
                    .map(|(_, v)| v.to_string())
            }
        };
        let s = || Sampler::new(100);
        let ok = s()
            .shard_from_vars(env(&[("RANK", "1"), ("WORLD_SIZE", "4")]))
            .unwrap();
        assert_eq!(ok.epoch(0), s().shard(1, 4).unwrap().epoch(0));
        assert_eq!(s().shard_from_vars(env(&[])).unwrap().len(), 100);
        for (vars, says) in [
            (
                &[("RANK", "4"), ("WORLD_SIZE", "4")][..],
                "RANK=4 with WORLD_SIZE=4",
            ),
            (&[("RANK", "0"), ("WORLD_SIZE", "0")][..], "WORLD_SIZE=0"),
            (&[("RANK", "1")][..], "WORLD_SIZE is not"),
            (&[("WORLD_SIZE", "2")][..], "RANK is not"),
            (&[("LOCAL_RANK", "0")][..], "LOCAL_RANK is set"),
            (&[("RANK", "one"), ("WORLD_SIZE", "2")][..], "RANK=\"one\""),
        ] {
            let e = s().shard_from_vars(env(vars)).unwrap_err();
            assert!(
                e.is_config() && e.to_string().contains(says),
                "{vars:?}: {e}"
            );
        }
        assert!(s().shard(2, 2).is_err() && s().shard(0, 0).is_err());
    }

    fn sorted(mut v: Vec<usize>) -> Vec<usize> {
        v.sort_unstable();
        v
    }

    proptest! {
        #[test]
        fn shards_are_disjoint_and_complete(
            len in 0usize..300, world in 1usize..9, seed in any::<u64>(), epoch in 0u64..5,
        ) {
            let base = Sampler::new(len).shuffle(seed);
            let shards: Vec<Vec<usize>> =
                (0..world).map(|r| base.clone().shard(r, world).unwrap().epoch(epoch)).collect();
            for (r, s) in shards.iter().enumerate() {
                prop_assert_eq!(s.len(), base.clone().shard(r, world).unwrap().len());
            }
            let union = sorted(shards.concat());
            prop_assert_eq!(union, (0..len).collect::<Vec<_>>(), "disjoint and complete");
        }

        #[test]
        fn padded_and_dropped_shards_are_equal(
            len in 1usize..300, world in 1usize..9, seed in any::<u64>(),
        ) {
            let base = Sampler::new(len).shuffle(seed);
            let pad: Vec<Vec<usize>> = (0..world)
                .map(|r| base.clone().shard(r, world).unwrap().shard_lengths(ShardLengths::Pad).epoch(2))
                .collect();
            let want = len.div_ceil(world);
            prop_assert!(pad.iter().all(|s| s.len() == want));
            let all = pad.concat();
            let distinct = sorted(all.clone()).into_iter().collect::<std::collections::BTreeSet<_>>();
            prop_assert_eq!(distinct.len(), len, "padding covers every item");
            prop_assert_eq!(all.len() - len, want * world - len, "only the padding repeats");

            let drop: Vec<Vec<usize>> = (0..world)
                .map(|r| base.clone().shard(r, world).unwrap().shard_lengths(ShardLengths::Drop).epoch(2))
                .collect();
            prop_assert!(drop.iter().all(|s| s.len() == len / world));
            let all = sorted(drop.concat());
            let mut dedup = all.clone();
            dedup.dedup();
            prop_assert_eq!(dedup.len(), all.len(), "dropped shards are disjoint");
        }
    }

    proptest! {
        #[test]
        fn group_blocks_cover_the_epoch_and_keep_shards_whole(
            groups in proptest::collection::vec(0usize..40, 1..30),
            world in 1usize..6, seed in any::<u64>(), window in 0usize..50,
            lengths in prop_oneof![Just(ShardLengths::Uneven), Just(ShardLengths::Pad), Just(ShardLengths::Drop)],
        ) {
            let n: usize = groups.iter().sum();
            let group_of: Vec<usize> = groups.iter().enumerate().flat_map(|(g, &k)| std::iter::repeat_n(g, k)).collect();
            let base = Sampler::new(n).groups(&groups).unwrap().shuffle(seed).buffer(window).shard_lengths(lengths);
            let ranks: Vec<Vec<usize>> = (0..world).map(|r| base.clone().shard(r, world).unwrap().epoch(1)).collect();
            let lens: Vec<usize> = ranks.iter().map(Vec::len).collect();
            for (r, l) in lens.iter().enumerate() {
                prop_assert_eq!(*l, base.clone().shard(r, world).unwrap().len());
            }
            let all = sorted(ranks.concat());
            let mut distinct = all.clone();
            distinct.dedup();
            match lengths {
                ShardLengths::Uneven => {
                    prop_assert_eq!(&all, &(0..n).collect::<Vec<_>>(), "each sample once");
                    prop_assert!(lens.iter().max().unwrap() - lens.iter().min().unwrap() <= 1);
                }
                ShardLengths::Pad => {
                    prop_assert_eq!(distinct.len(), n, "every sample");
                    prop_assert!(lens.iter().all(|&l| l == n.div_ceil(world)));
                }
                ShardLengths::Drop => {
                    prop_assert_eq!(distinct.len(), all.len(), "no sample twice");
                    prop_assert!(lens.iter().all(|&l| l == n / world));
                }
            }
            // Whole shards: the ranks touching a group are few (a block splits at most the
            // two groups at its ends), and padding adds at most the first groups again.
            if lengths != ShardLengths::Pad {
                let touches: usize = ranks.iter().map(|r| {
                    let mut g: Vec<usize> = r.iter().map(|&i| group_of[i]).collect();
                    g.sort_unstable();
                    g.dedup();
                    g.len()
                }).sum();
                let nonempty = groups.iter().filter(|&&k| k > 0).count();
                prop_assert!(touches < nonempty + world, "{touches} group touches");
            }
            // The buffer moves no sample earlier than `window - 1` places before its place
            // in the stream.
            if lengths == ShardLengths::Uneven {
                let stream = Sampler::new(n).groups(&groups).unwrap().shuffle(seed).shard(0, world).unwrap().epoch(1);
                let buffered = &ranks[0];
                for (p, i) in buffered.iter().enumerate() {
                    let q = stream.iter().position(|x| x == i).unwrap();
                    prop_assert!(p + window.max(1) > q, "{i} at {p}, stream place {q}");
                }
            }
        }
    }

    #[test]
    fn group_orders_are_reproducible_and_new_every_epoch() {
        let s = Sampler::new(300)
            .groups(&[100, 100, 100])
            .unwrap()
            .shuffle(9)
            .buffer(20);
        assert_eq!(s.epoch(0), s.epoch(0));
        assert_ne!(s.epoch(0), s.epoch(1));
        let first: Vec<usize> = (0..30).map(|e| s.epoch(e)[0] / 100).collect();
        assert!(
            first.iter().any(|&g| g != first[0]),
            "the shard order changes"
        );
        assert!(Sampler::new(10).groups(&[3, 3]).is_err());
        assert!(Sampler::new(2)
            .weighted(&[1.0, 1.0], 2, true)
            .unwrap()
            .groups(&[2])
            .is_err());
    }

    #[test]
    fn mixtures_follow_their_weights_and_stop_rules() {
        let lengths = [1000, 700, 300];
        let weights = [0.5, 0.3, 0.2];
        let m = Sampler::mixture(&lengths, &weights, MixStop::Draws(100_000))
            .unwrap()
            .shuffle(4);
        let order = m.epoch(0);
        assert_eq!(order.len(), 100_000);
        let mut counts = [0usize; 3];
        for &i in &order {
            counts[m.locate(i).0] += 1;
        }
        for (s, &w) in weights.iter().enumerate() {
            let share = counts[s] as f64 / 100_000.0;
            assert!(
                (share - w).abs() < 0.01,
                "source {s}: share {share}, weight {w}"
            );
        }
        // Cycling: every source's items come in whole passes (each item of source 2, drawn
        // ~20,000 times in passes of 300, appears 66 or 67 times).
        let mut per_item = vec![0usize; 1000 + 700 + 300];
        for &i in &order {
            per_item[i] += 1;
        }
        let third = &per_item[1700..];
        let (lo, hi) = (third.iter().min().unwrap(), third.iter().max().unwrap());
        assert!(hi - lo <= 1, "passes of source 2: {lo}..{hi}");
        assert_eq!(m.epoch(0), order, "deterministic");
        assert_ne!(m.epoch(1)[..100], order[..100], "a new order every epoch");
        // The same draws at any world size: the ranks' shares interleave into the order.
        let ranks: Vec<Vec<usize>> = (0..3)
            .map(|r| m.clone().shard(r, 3).unwrap().epoch(0))
            .collect();
        let dealt: Vec<usize> = (0..order.len()).map(|p| ranks[p % 3][p / 3]).collect();
        assert_eq!(dealt, order);

        let first = Sampler::mixture(&lengths, &weights, MixStop::FirstExhausted)
            .unwrap()
            .shuffle(1);
        let o = first.epoch(2);
        let mut seen = std::collections::HashSet::new();
        assert!(o.iter().all(|&i| seen.insert(i)), "at most once");
        assert_eq!(o.len(), first.global_len_of(2));
        let ends = (0..3)
            .filter(|&s| o.iter().filter(|&&i| first.locate(i).0 == s).count() == lengths[s])
            .count();
        assert_eq!(ends, 1, "exactly one source ran out");

        let all = Sampler::mixture(&lengths, &weights, MixStop::AllExhausted)
            .unwrap()
            .shuffle(1);
        let o = all.epoch(0);
        let distinct: std::collections::HashSet<usize> = o.iter().copied().collect();
        assert_eq!(distinct.len(), 2000, "every item at least once");
        assert_eq!(all.locate(1000), (1, 0));
        assert_eq!(all.locate(999), (0, 999));

        assert!(Sampler::mixture(&[3, 0], &[1.0, 1.0], MixStop::Draws(5)).is_err());
        assert!(Sampler::mixture(&[3, 4], &[1.0], MixStop::Draws(5)).is_err());
        assert!(Sampler::mixture(&[3, 4], &[0.0, 0.0], MixStop::Draws(5)).is_err());
        assert!(Sampler::mixture(&[3, 4], &[1.0, -1.0], MixStop::Draws(5)).is_err());
    }

    #[test]
    fn reshuffles_per_epoch_deterministically() {
        let s = Sampler::new(50).shuffle(3);
        assert_eq!(s.epoch(0), s.epoch(0));
        assert_ne!(s.epoch(0), s.epoch(1));
        assert_eq!(sorted(s.epoch(1)), (0..50).collect::<Vec<_>>());
        assert_eq!(Sampler::new(5).epoch(9), vec![0, 1, 2, 3, 4]);
    }

    #[test]
    fn weighted_with_replacement_follows_the_weights() {
        let weights = [0.0, 1.0, 2.0, 3.0, 4.0];
        let n = 200_000;
        let s = Sampler::new(5)
            .shuffle(11)
            .weighted(&weights, n, true)
            .unwrap();
        let mut counts = [0usize; 5];
        for i in s.epoch(0) {
            counts[i] += 1;
        }
        assert_eq!(counts[0], 0, "a zero weight is never drawn");
        for (i, &c) in counts.iter().enumerate().skip(1) {
            let p = weights[i] / 10.0;
            let sd = (n as f64 * p * (1.0 - p)).sqrt();
            let dev = (c as f64 - n as f64 * p).abs();
            assert!(
                dev < 5.0 * sd,
                "index {i}: {c} draws, expected {}",
                n as f64 * p
            );
        }
        assert_ne!(s.epoch(0), s.epoch(1));
    }

    #[test]
    fn weighted_without_replacement_draws_distinct_heavy_items_first() {
        let mut weights = vec![1.0; 100];
        weights[..10].fill(50.0);
        weights[99] = 0.0;
        let s = Sampler::new(100)
            .shuffle(5)
            .weighted(&weights, 99, false)
            .unwrap();
        let mut firsts = 0;
        for e in 0..50 {
            let order = s.epoch(e);
            assert_eq!(order.len(), 99);
            assert_eq!(
                sorted(order.clone()),
                (0..99).collect::<Vec<_>>(),
                "distinct"
            );
            firsts += order[..10].iter().filter(|&&i| i < 10).count();
        }
        // Drawn in proportion to the remaining weight, about 7.5 of the first 10 draws are
        // heavy (the first with probability 500/590, the tenth 50/139); uniformly it would
        // be about 1.
        assert!(
            firsts > 50 * 6,
            "{firsts} heavy items among 50 x 10 first draws"
        );
        assert!(Sampler::new(3)
            .weighted(&[1.0, 0.0, 1.0], 3, false)
            .is_err());
        assert!(Sampler::new(2).weighted(&[1.0, f64::NAN], 1, true).is_err());
        assert!(Sampler::new(2).weighted(&[1.0], 1, true).is_err());
    }

    #[test]
    fn weighted_draws_are_sharded_too() {
        let s = Sampler::new(20)
            .shuffle(1)
            .weighted(&[1.0; 20], 45, true)
            .unwrap();
        let shards: Vec<Vec<usize>> = (0..4)
            .map(|r| {
                s.clone()
                    .shard(r, 4)
                    .unwrap()
                    .shard_lengths(ShardLengths::Drop)
                    .epoch(0)
            })
            .collect();
        assert!(shards.iter().all(|x| x.len() == 11));
        let global = s.epoch(0);
        let interleaved: Vec<usize> = (0..44).map(|p| shards[p % 4][p / 4]).collect();
        assert_eq!(
            interleaved,
            global[..44].to_vec(),
            "rank r holds positions r, r+4, ..."
        );
    }
}
