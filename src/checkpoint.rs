//! [`PipelineState`]: a checkpoint of a consumer's progress through an epoch.
//!
//! Taken by [`Pipeline::state`](crate::Pipeline::state) and handed back to
//! [`Pipeline::resume`](crate::Pipeline::resume). Items are identified by their position in the
//! epoch's source order; the consumer keeps the ranges it received (see
//! `flowgate_actors::origin`), so the state stays small.

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
}
