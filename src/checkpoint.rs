//! [`PipelineState`]: a checkpoint of a consumer's progress through an epoch.
//!
//! Taken by [`Pipeline::state`](crate::Pipeline::state) and handed back to
//! [`Pipeline::resume`](crate::Pipeline::resume). Items are identified by their position in the
//! epoch's source order; the consumer keeps the ranges it received (see
//! `flowgate_actors::origin`), so the state stays small.

use std::collections::BTreeMap;

use flowgate_actors::error::PipelineError;

/// The version of [`PipelineState`]'s layout; a state of another version is refused.
pub const STATE_VERSION: u32 = 1;

/// What a checkpoint is valid for: named settings of the pipeline that made it (the dataset,
/// the seed, the sampler, the batch size, the world…), set with
/// [`PipelineBuilder::checkpoint_fields`](crate::PipelineBuilder::checkpoint_fields) (the media
/// loaders set them from their [`Files`](crate::media::Files) and batching). A state is only
/// resumed by a pipeline whose fields are the same.
pub type Fingerprint = BTreeMap<String, String>;

/// A checkpoint of a consumer's progress through an epoch; see
/// [`Pipeline::state`](crate::Pipeline::state) and [`Pipeline::resume`](crate::Pipeline::resume).
/// Serialisable with serde (a few hundred bytes for a typical epoch: delivered items are kept
/// as index ranges).
#[derive(Clone, Debug, Default, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
pub struct PipelineState {
    /// The epoch in progress (or the next one, between epochs).
    pub epoch: u64,
    /// Positions (in the epoch's source order) of the source items the consumer received,
    /// as half-open `[start, end)` ranges.
    pub delivered: Vec<(u64, u64)>,
    /// How many source items that is.
    pub delivered_items: u64,
    /// Source items only partly received (split by `disaggregate`): position and share
    /// received (of 2^40).
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub partial: Vec<(u64, u64)>,
    /// The layout's version ([`STATE_VERSION`]; 0 in states from before it was recorded).
    #[serde(default)]
    pub version: u32,
    /// What the state is valid for (see [`Fingerprint`]); empty if the pipeline set nothing.
    #[serde(default, skip_serializing_if = "BTreeMap::is_empty")]
    pub fingerprint: Fingerprint,
}

impl PipelineState {
    /// Checks that this state fits a pipeline whose fingerprint is `mine`: the same version
    /// and, for every field either side names, the same value. The error names the first
    /// field that differs, with both values.
    pub fn check_fits(&self, mine: &Fingerprint) -> Result<(), PipelineError> {
        if self.version > STATE_VERSION {
            return Err(PipelineError::config(format!(
                "resume: the checkpoint's layout is version {}, this flowgate reads up to {STATE_VERSION}",
                self.version
            )));
        }
        if self.version == 0 && self.fingerprint.is_empty() {
            // A state from before fingerprints were recorded: nothing to check it against.
            tracing::warn!("resuming from a checkpoint that does not say what it is valid for");
            return Ok(());
        }
        let keys: std::collections::BTreeSet<&String> =
            self.fingerprint.keys().chain(mine.keys()).collect();
        for k in keys {
            let (theirs, ours) = (self.fingerprint.get(k), mine.get(k));
            if theirs != ours {
                let show = |v: Option<&String>| v.map_or("(not set)".to_owned(), Clone::clone);
                return Err(PipelineError::config(format!(
                    "resume: the checkpoint was taken with {k} = {}, this pipeline has {k} = {}",
                    show(theirs),
                    show(ours)
                )));
            }
        }
        Ok(())
    }
}
