//! [`Records`]: samples whose fields are bytes — a tar shard's (fields by extension) or a
//! Parquet row's (fields by column) — read by (epoch, index) as one [`RawSample`].

use super::shards::{RawSample, ShardError, Shards};
use crate::sampler::Sampler;

/// Tar shards' samples or Parquet rows.
#[derive(Clone, Debug)]
pub(crate) enum Records {
    Tar(Shards),
    #[cfg(feature = "parquet")]
    Parquet(super::parquet::ParquetRows),
}

impl Records {
    pub(crate) fn sampler(&self) -> &Sampler {
        match self {
            Records::Tar(s) => s.sampler(),
            #[cfg(feature = "parquet")]
            Records::Parquet(p) => p.sampler(),
        }
    }

    pub(crate) fn fingerprint(&self) -> Vec<(&'static str, String)> {
        match self {
            Records::Tar(s) => s.fingerprint(),
            #[cfg(feature = "parquet")]
            Records::Parquet(p) => p.fingerprint(),
        }
    }

    /// `SHARD:KEY`, or the row's file and place.
    pub(crate) fn name(&self, index: usize, epoch: u64) -> String {
        match self {
            Records::Tar(s) => s.get(epoch, index).to_string(),
            #[cfg(feature = "parquet")]
            Records::Parquet(p) => p.name(index),
        }
    }

    /// The sample's fields whose extension (a Parquet column's name) `wanted` accepts.
    pub(crate) fn read(
        &self,
        index: usize,
        epoch: u64,
        wanted: impl Fn(&str) -> bool,
    ) -> Result<RawSample, ShardError> {
        match self {
            Records::Tar(s) => s.get(epoch, index).read_fields(wanted),
            #[cfg(feature = "parquet")]
            Records::Parquet(p) => p.read(epoch, index),
        }
    }

    /// Whether every shard or Parquet file is local (none on S3).
    pub(crate) fn is_local(&self) -> bool {
        match self {
            Records::Tar(s) => s.is_local(),
            #[cfg(feature = "parquet")]
            Records::Parquet(p) => p.is_local(),
        }
    }

    /// Samples in the whole dataset (every rank's).
    pub(crate) fn len(&self) -> usize {
        match self {
            Records::Tar(s) => s.len(),
            #[cfg(feature = "parquet")]
            Records::Parquet(p) => p.len(),
        }
    }

    /// Memory the source holds outside the stages' budgets: a Parquet row-group cache.
    pub(crate) fn reserved_bytes(&self) -> u64 {
        match self {
            Records::Tar(_) => 0,
            #[cfg(feature = "parquet")]
            Records::Parquet(p) => p.cache_bytes(),
        }
    }

    /// The disk cache of tar shards on S3.
    #[cfg(feature = "s3")]
    pub(crate) fn shard_cache(&self) -> Option<std::sync::Arc<super::shards::ShardCache>> {
        match self {
            Records::Tar(s) => s.cache().cloned(),
            #[allow(unreachable_patterns)]
            _ => None,
        }
    }

    /// The prefetch of tar shards on S3, for the tuner to deepen.
    pub(crate) fn read_ahead(
        &self,
    ) -> Option<std::sync::Arc<dyn flowgate_actors::attached::ReadAheadControl>> {
        match self {
            #[cfg(feature = "s3")]
            Records::Tar(s) => s.read_ahead(),
            #[allow(unreachable_patterns)]
            _ => None,
        }
    }

    /// The samples this process reads in `epoch` (see
    /// [`Dataset::plan_reads`](super::Dataset::plan_reads)); Parquet plans nothing.
    pub(crate) fn plan_reads(&self, epoch: u64, indices: &[usize]) {
        #[allow(irrefutable_let_patterns)] // without the `parquet` feature
        if let Records::Tar(s) = self {
            s.plan_reads(epoch, indices);
        }
    }
}
