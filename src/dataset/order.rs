//! How a dataset's epochs are ordered and dealt to ranks: a seeded shuffle (or none), this
//! process's rank and world size (given, from the environment, or the whole dataset), and
//! equal counts per rank.

use flowgate_actors::error::PipelineError;

use super::files::Files;
use super::shards::Shards;
use crate::sampler::{Sampler, ShareLengths};

/// Which ranks share the dataset, and which one this process is.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum Ranks {
    /// `RANK` and `WORLD_SIZE` from the environment (what `torchrun` sets), or the whole
    /// dataset when neither is set (see [`Sampler::shard_from_env`]). The default.
    #[default]
    FromEnv,
    /// Rank `rank` of `world` (`rank` in `0..world`).
    Fixed {
        /// This process's rank.
        rank: usize,
        /// How many ranks share the dataset.
        world: usize,
    },
    /// The whole dataset, whatever the environment says (a mixture's parts: the mixture deals
    /// its draws, not each part).
    Whole,
}

/// A dataset's order: shuffle seed, ranks, and what to do with the items left over when the
/// ranks' shares are not equal.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct EpochOrder {
    /// The shuffle seed, reshuffled every epoch; `None` keeps the dataset's order.
    pub seed: Option<u64>,
    /// Which ranks share the dataset.
    pub ranks: Ranks,
    /// With several ranks: `true` drops the items past the smallest share, `false` pads every
    /// share to the largest by repeating the start of the epoch's order (what PyTorch's
    /// `DistributedSampler` does). Every rank gets as many items either way.
    pub drop_last: bool,
    /// `(worker, workers)`: this process reads worker `worker`'s part of the rank's share
    /// split among `workers` processes (PyTorch `DataLoader` workers), uneven by at most one
    /// item and never padded: see [`Sampler::split`]. `None`: the rank's whole share.
    pub split: Option<(usize, usize)>,
}

/// What can be shuffled and dealt out to ranks: files, shards, Parquet rows, samplers.
pub(crate) trait Dealt: Sized {
    fn shuffled(self, seed: u64) -> Self;
    fn shard(self, rank: usize, world: usize) -> Result<Self, PipelineError>;
    fn shard_from_env(self) -> Result<Self, PipelineError>;
    fn shard_lengths(self, lengths: ShareLengths) -> Self;
    fn split(self, worker: usize, workers: usize) -> Result<Self, PipelineError>;
}

macro_rules! dealt {
    ($($t:ty),*) => {$(
        impl Dealt for $t {
            fn shuffled(self, seed: u64) -> Self {
                <$t>::shuffle(self, seed)
            }
            fn shard(self, rank: usize, world: usize) -> Result<Self, PipelineError> {
                <$t>::shard(self, rank, world)
            }
            fn shard_from_env(self) -> Result<Self, PipelineError> {
                <$t>::shard_from_env(self)
            }
            fn shard_lengths(self, lengths: ShareLengths) -> Self {
                <$t>::shard_lengths(self, lengths)
            }
            fn split(self, worker: usize, workers: usize) -> Result<Self, PipelineError> {
                <$t>::split(self, worker, workers)
            }
        }
    )*};
}
dealt!(Files, Shards, Sampler);
#[cfg(feature = "parquet")]
dealt!(super::parquet::ParquetRows);

impl EpochOrder {
    /// The whole dataset in its own order: what a mixture's parts are.
    pub(crate) const WHOLE: EpochOrder = EpochOrder {
        seed: None,
        ranks: Ranks::Whole,
        drop_last: false,
        split: None,
    };

    /// The positions `0..len` of a map-style dataset (anything indexed, such as a Python
    /// `Dataset`) in this order: shuffled anew every epoch with the seed, this rank's share,
    /// every share as long.
    /// At most [`MAX_EPOCH_ITEMS`](crate::sampler::MAX_EPOCH_ITEMS) positions: the order is
    /// held in memory, 8 bytes a position.
    pub fn sampler(&self, len: usize) -> Result<Sampler, PipelineError> {
        if len > crate::sampler::MAX_EPOCH_ITEMS {
            return Err(PipelineError::config(format!(
                "a dataset of {len} items; at most {} (sampler::MAX_EPOCH_ITEMS: its order \
                 is held in memory, 8 bytes an item)",
                crate::sampler::MAX_EPOCH_ITEMS
            )));
        }
        let mem = flowgate_tuner::available_memory();
        crate::sampler::check_order_fits(len, mem.bytes, &mem.source)
            .map_err(PipelineError::config)?;
        self.apply(Sampler::new(len))
    }

    /// `x` shuffled (with a seed) and dealt: this rank's share, every share as long (and
    /// with a split, this worker's part of it).
    pub(crate) fn apply<T: Dealt>(&self, x: T) -> Result<T, PipelineError> {
        let x = match self.seed {
            Some(seed) => x.shuffled(seed),
            None => x,
        };
        let lengths = if self.drop_last {
            ShareLengths::Drop
        } else {
            ShareLengths::Pad
        };
        let x = match self.ranks {
            Ranks::FromEnv => x.shard_from_env()?.shard_lengths(lengths),
            Ranks::Fixed { rank, world } => x.shard(rank, world)?.shard_lengths(lengths),
            Ranks::Whole => x,
        };
        match self.split {
            Some((worker, workers)) => x.split(worker, workers),
            None => Ok(x),
        }
    }
}
