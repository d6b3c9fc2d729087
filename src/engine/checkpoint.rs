//! [`PipelineState`]: a checkpoint of a consumer's progress through an epoch.
//!
//! Taken by [`Pipeline::state`](crate::Pipeline::state) and handed back to
//! [`Pipeline::resume`](crate::Pipeline::resume). Items are identified by their position in the
//! epoch's source order; the consumer keeps the ranges it received (see
//! `flowgate_actors::origin`), so the state stays small.

use std::collections::BTreeMap;

use flowgate_actors::error::PipelineError;
use flowgate_actors::origin::{RangeSet, UNIT};

use crate::sampler::{Blocks, Layout, ShareLengths};

/// The version of [`PipelineState`]'s layout; a state of a later version is refused.
/// Version 2 added [`PipelineState::shard`] (version 1 kept rank and world size in the
/// fingerprint).
pub const STATE_VERSION: u32 = 2;

/// What a checkpoint is valid for: named settings of the pipeline that made it (the dataset,
/// the seed, the sampler, the batch size, the world…), set with
/// [`PipelineBuilder::checkpoint_fields`](crate::PipelineBuilder::checkpoint_fields) (the media
/// loaders set them from their [`Files`](crate::dataset::Files) and batching). A state is only
/// resumed by a pipeline whose fields are the same.
pub type Fingerprint = BTreeMap<String, String>;

/// A part received of a partly delivered item: `(position, start, end)`, the part
/// `[start, end)` of the item's `[0, 2^32)`.
pub type Part = (u64, u64, u64);

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
    /// Source items only partly received (split by `disaggregate`): `(position, start,
    /// end)`, a part `[start, end)` of the item's `[0, 2^32)` received (an item may have
    /// several). A resume produces such an item again whole and drops the parts received.
    #[serde(
        default,
        skip_serializing_if = "Vec::is_empty",
        deserialize_with = "parts_of_this_version"
    )]
    pub partial: Vec<Part>,
    /// The layout's version ([`STATE_VERSION`]; 0 in states from before it was recorded).
    #[serde(default)]
    pub version: u32,
    /// What the state is valid for (see [`Fingerprint`]); empty if the pipeline set nothing.
    #[serde(default, skip_serializing_if = "BTreeMap::is_empty")]
    pub fingerprint: Fingerprint,
    /// For a pipeline whose source is a [`Sampler`] (see
    /// [`PipelineBuilder::source_sampled`](crate::PipelineBuilder::source_sampled)): which
    /// rank of which world took it, so positions can be mapped to the epoch's global order.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub shard: Option<ShareState>,
    /// For a loader that makes up batches lost to skipped items
    /// ([`LoaderBuilder::fill_skipped`](crate::loader::LoaderBuilder::fill_skipped)): the batches
    /// this rank still owes in the epoch, so that a resume makes exactly the count the
    /// uninterrupted epoch would have. `None` elsewhere, and in merged states (a resume at
    /// another world size owes what its resumed share makes).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub owed_batches: Option<u64>,
}

/// Where a sharded pipeline's positions lie in the epoch's global order (a serialisable
/// [`Layout`]): `delivered` and `partial` of its [`PipelineState`] are positions in this
/// rank's share. Serialised flat, in the words of the Python package's `state_dict`
/// (`world_size`, `shard_lengths`, `block_window`/`block_seed`, `worker`/`workers`): one
/// layout for every front end; the nested layout of earlier versions (`world`, `lengths`,
/// `blocks`, `split`) is still read.
#[derive(Clone, Debug, Default, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
#[serde(
    try_from = "super::share_layout::ShareWire",
    into = "super::share_layout::ShareWire"
)]
pub struct ShareState {
    /// The rank that took the state.
    pub rank: usize,
    /// Ranks in its world.
    pub world: usize,
    /// How uneven shares were made equal.
    pub lengths: ShareLengths,
    /// Positions in the epoch's global order.
    pub global_len: u64,
    /// Global positions delivered before this world started the epoch (a resume from a
    /// merged state), as `[start, end)` ranges.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub base: Vec<(u64, u64)>,
    /// Parts of items received before this world started the epoch (a resume from a merged
    /// state), in global positions, as [`PipelineState::partial`]: every rank carries them,
    /// so a part received of an item this world deals to no rank (the positions
    /// [`ShareLengths::Drop`] leaves out) is still known when its states are merged (it was
    /// lost, and the item delivered again whole at the next world size).
    pub base_partial: Vec<Part>,
    /// Group sampling's contiguous blocks and shuffle buffer (tar shards); `None`: every
    /// `world`-th position (and in a merged state, whose positions are global).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub blocks: Option<Blocks>,
    /// `(w, n)`: the state of worker `w` of the `n` processes that split the rank's share
    /// (PyTorch `DataLoader` workers; see [`Sampler::split`]); `None`: the whole share.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub split: Option<(usize, usize)>,
}

impl ShareState {
    /// The layout these positions are in.
    pub fn layout(&self) -> Layout {
        Layout {
            rank: self.rank,
            world: self.world,
            lengths: self.lengths,
            global_len: self.global_len,
            base: RangeSet::from_ranges(self.base.iter().copied()),
            blocks: self.blocks,
            split: self.split,
        }
    }

    pub(crate) fn of(layout: &Layout) -> Self {
        Self {
            rank: layout.rank,
            world: layout.world,
            lengths: layout.lengths,
            global_len: layout.global_len,
            base: layout.base.ranges().collect(),
            base_partial: Vec::new(),
            blocks: layout.blocks,
            split: layout.split,
        }
    }
}

/// A state's progress in global positions: fully delivered ones, and the parts received of
/// partly delivered ones.
pub(super) struct Global {
    pub(super) done: RangeSet,
    pub(super) partial: Vec<Part>,
}

/// `partial` as this version writes it; the `(position, share)` pairs of version 1 say how
/// much of an item arrived, not which parts, so they are left out (the item is produced again
/// whole and all its parts delivered again: nothing lost).
fn parts_of_this_version<'de, D: serde::Deserializer<'de>>(d: D) -> Result<Vec<Part>, D::Error> {
    let v: Vec<Vec<u64>> = serde::Deserialize::deserialize(d)?;
    Ok(v.into_iter()
        .filter_map(|p| match p[..] {
            [i, a, b] => Some((i, a, b)),
            _ => None,
        })
        .collect())
}

impl PipelineState {
    /// The state of the epoch after this one's, from its start: this rank's own place in it
    /// (no base, nothing owed). What a loader's checkpoint names once an epoch has ended.
    pub fn next_epoch(&self) -> PipelineState {
        PipelineState {
            epoch: self.epoch + 1,
            delivered: Vec::new(),
            delivered_items: 0,
            partial: Vec::new(),
            shard: self.shard.clone().map(|sh| ShareState {
                base: Vec::new(),
                base_partial: Vec::new(),
                ..sh
            }),
            owed_batches: None,
            ..self.clone()
        }
    }

    /// Merges the states that every rank of one world took at the same step into one state
    /// of the whole world's progress, which a pipeline of any world size resumes (each rank
    /// gets an equal share of what is left; see [`Layout`]). The states must come from the
    /// same configuration (fingerprints equal), one per rank `0..world`, all in the same
    /// epoch, except that a rank which finished the epoch may already name the next one with
    /// nothing delivered. For a partly delivered item, the parts any rank received are kept.
    pub fn merge(states: &[PipelineState]) -> Result<PipelineState, PipelineError> {
        let bad = |m: String| PipelineError::config(format!("merging checkpoints: {m}"));
        let states: Vec<PipelineState> = states.iter().map(PipelineState::current).collect();
        let first = states
            .first()
            .ok_or_else(|| bad("no states given".into()))?;
        let epoch = states.iter().map(|s| s.epoch).min().unwrap_or(0);
        let mut shards = Vec::with_capacity(states.len());
        for s in &states {
            s.check_fits(&first.fingerprint)
                .map_err(|e| bad(format!("the states differ: {e}")))?;
            let sh = s.shard.as_ref().ok_or_else(|| {
                bad("a state without a shard layout (its pipeline's source is not sampled)".into())
            })?;
            if sh.global_len == u64::MAX {
                return Err(bad(
                    "a version-1 state cannot be merged (resume it at its own rank)".into(),
                ));
            }
            if let Some((w, n)) = sh.split {
                return Err(bad(format!(
                    "a state of DataLoader worker {w} of {n} (part of rank {}'s share): take the \
                     states in the training processes, where the workers' batches arrive",
                    sh.rank
                )));
            }
            shards.push(sh);
        }
        let world = shards[0].world;
        let mut seen = vec![false; world];
        for sh in &shards {
            if sh.world != world
                || sh.global_len != shards[0].global_len
                || sh.lengths != shards[0].lengths
                || sh.blocks.is_some() != shards[0].blocks.is_some()
            {
                let (a, b) = (shards[0], sh);
                let what = if a.world != b.world {
                    format!("world sizes {} and {}", a.world, b.world)
                } else if a.global_len != b.global_len {
                    format!("epochs of {} and {} positions", a.global_len, b.global_len)
                } else if a.lengths != b.lengths {
                    format!("share lengths {:?} and {:?}", a.lengths, b.lengths)
                } else {
                    "one reading tar shards in blocks, one every world-th position".to_owned()
                };
                return Err(bad(format!(
                    "states of ranks {} and {} come from different loaders: {what}",
                    a.rank, b.rank
                )));
            }
            match seen.get_mut(sh.rank) {
                Some(s) if !*s => *s = true,
                Some(_) => return Err(bad(format!("two states of rank {}", sh.rank))),
                None => return Err(bad(format!("rank {} of a world of {world}", sh.rank))),
            }
        }
        if let Some(r) = seen.iter().position(|s| !s) {
            return Err(bad(format!(
                "no state of rank {r}: every rank's state is needed (its progress is in no other)"
            )));
        }
        for (s, sh) in states.iter().zip(&shards) {
            s.check_positions(sh.layout().len() as u64)
                .map_err(|m| bad(format!("rank {}'s state: {m}", sh.rank)))?;
        }
        // The base of the epoch and its tar-shard blocks, from a state still in it.
        let (base, blocks, blocks_rank) = states
            .iter()
            .zip(&shards)
            .find(|(s, _)| s.epoch == epoch)
            .map(|(_, sh)| (sh.base.clone(), sh.blocks, sh.rank))
            .unwrap_or_default();
        let mut done = RangeSet::default();
        let mut partial: BTreeMap<u64, RangeSet> = BTreeMap::new();
        for (s, sh) in states.iter().zip(&shards) {
            let g = if s.epoch == epoch {
                if sh.blocks != blocks {
                    // Blocks follow from the seed, the shuffle buffer and the epoch: ranks in
                    // one epoch share them, and each rank's order depends on them.
                    return Err(bad(format!(
                        "states of ranks {blocks_rank} and {} come from different loaders: \
                         tar-shard blocks ({}) and ({}) in epoch {epoch}",
                        sh.rank,
                        show_blocks(blocks),
                        show_blocks(sh.blocks)
                    )));
                }
                if sh.base != base {
                    return Err(bad(
                        "states of ranks that resumed from different checkpoints".into(),
                    ));
                }
                s.global()?
            } else if s.epoch == epoch + 1 && s.delivered_items == 0 && s.partial.is_empty() {
                // Finished `epoch`: it delivered its whole share of it.
                let layout = ShareState {
                    base: base.clone(),
                    ..(*sh).clone()
                }
                .layout();
                let share = layout.positions().into_iter().map(|g| (g, g + 1));
                Global {
                    done: RangeSet::from_ranges(base.iter().copied().chain(share)),
                    partial: Vec::new(),
                }
            } else {
                return Err(bad(format!(
                    "states of epochs {epoch} and {}: take them at the same step",
                    s.epoch
                )));
            };
            done = RangeSet::from_ranges(done.ranges().chain(g.done.ranges()));
            for (i, a, b) in g.partial {
                partial.entry(i).or_default().insert_range(a, b);
            }
        }
        // Parts of one item from several ranks (padding repeats items) may complete it.
        for (i, r) in &partial {
            if r.covers(0, UNIT) {
                done.insert(*i);
            }
        }
        partial.retain(|i, _| !done.contains(*i));
        let global_len = shards[0].global_len;
        let (epoch, delivered, partial) = if done.len() >= global_len && partial.is_empty() {
            (epoch + 1, Vec::new(), Vec::new())
        } else {
            (
                epoch,
                done.ranges().collect(),
                partial
                    .iter()
                    .flat_map(|(&i, r)| r.ranges().map(move |(a, b)| (i, a, b)))
                    .collect(),
            )
        };
        Ok(PipelineState {
            epoch,
            delivered_items: delivered.iter().map(|(a, b)| b - a).sum(),
            delivered,
            partial,
            version: STATE_VERSION,
            fingerprint: first.fingerprint.clone(),
            shard: Some(ShareState {
                rank: 0,
                world: 1,
                lengths: shards[0].lengths,
                global_len,
                base: Vec::new(),
                base_partial: Vec::new(),
                // Global positions, in order.
                blocks: None,
                split: None,
            }),
            // At another world size each rank owes what its resumed share makes.
            owed_batches: None,
        })
    }

    /// This state's progress in global positions (for a state without a shard layout, its
    /// own positions).
    pub(super) fn global(&self) -> Result<Global, PipelineError> {
        let Some(sh) = &self.shard else {
            return Ok(Global {
                done: RangeSet::from_ranges(self.delivered.iter().copied()),
                partial: self.partial.clone(),
            });
        };
        let layout = sh.layout();
        let positions = layout.positions();
        let at = |p: u64| {
            positions.get(p as usize).copied().ok_or_else(|| {
                PipelineError::config(format!(
                    "checkpoint: position {p} is past rank {}'s {} positions of the epoch",
                    sh.rank,
                    positions.len()
                ))
            })
        };
        let mut done = layout.base.clone();
        for &(a, b) in &self.delivered {
            for p in a..b {
                done.insert(at(p)?);
            }
        }
        let partial = self
            .partial
            .iter()
            .map(|&(p, a, b)| Ok((at(p)?, a, b)))
            .chain(sh.base_partial.iter().map(|&p| Ok(p)))
            .collect::<Result<_, PipelineError>>()?;
        Ok(Global { done, partial })
    }

    /// Checks that this state's positions are ones a pipeline writes, for a share of `len`
    /// positions: `delivered` ranges in order, none empty, reversed or overlapping, all within
    /// the share and holding `delivered_items`; each `partial` a part of `[0, 2^32)` of a
    /// position of the share; the share's `base` within its epoch. A damaged (or hand-edited)
    /// checkpoint is refused, never resumed as another set of items.
    pub(crate) fn check_positions(&self, len: u64) -> Result<(), String> {
        let bad = |m: String| Err(format!("the checkpoint is damaged: {m}"));
        let ranges = |key: &str, ranges: &[(u64, u64)], len: u64, what: &str| {
            let mut end = 0;
            for (i, &(a, b)) in ranges.iter().enumerate() {
                if a >= b {
                    return bad(format!("`{key}` range [{a}, {b}) is empty or reversed"));
                }
                if i > 0 && a < end {
                    return bad(format!(
                        "`{key}` ranges overlap or are out of order at [{a}, {b})"
                    ));
                }
                if b > len {
                    return bad(format!(
                        "`{key}` range [{a}, {b}) is past the {len} positions of {what}"
                    ));
                }
                end = b;
            }
            Ok(())
        };
        if let Some(sh) = &self.shard {
            // First: the share's length follows from it.
            ranges("base", &sh.base, sh.global_len, "the epoch")?;
            if let Some(&(p, a, b)) = sh
                .base_partial
                .iter()
                .find(|&&(p, a, b)| p >= sh.global_len || a >= b || b > UNIT)
            {
                return bad(format!(
                    "`base_partial` ({p}, {a}, {b}) is not a part of [0, {UNIT}) of one of the \
                     epoch's {} positions",
                    sh.global_len
                ));
            }
        }
        ranges("delivered", &self.delivered, len, "the share")?;
        let items: u64 = self.delivered.iter().map(|(a, b)| b - a).sum();
        if items != self.delivered_items {
            return bad(format!(
                "`delivered_items` is {} and its `delivered` ranges hold {items}",
                self.delivered_items
            ));
        }
        if let Some(&(p, a, b)) = self
            .partial
            .iter()
            .find(|&&(p, a, b)| p >= len || a >= b || b > UNIT)
        {
            return bad(format!(
                "`partial` ({p}, {a}, {b}) is not a part of [0, {UNIT}) of one of the share's \
                 {len} positions"
            ));
        }
        Ok(())
    }

    /// Checks that this state fits a pipeline whose fingerprint is `mine`: the same version
    /// and, for every field either side names, the same value. The error names the first
    /// field that differs, with both values.
    pub fn check_fits(&self, mine: &Fingerprint) -> Result<(), PipelineError> {
        self.current().check_fields(mine)
    }

    /// This state in the current layout: a version-1 state's rank and world size move from
    /// the fingerprint to [`shard`](Self::shard) (the epoch's length, unknown to it, is
    /// `u64::MAX` until a resume fills it in).
    pub(crate) fn current(&self) -> PipelineState {
        let mut s = self.clone();
        if s.version != 1 {
            return s;
        }
        let num = |k: &str| s.fingerprint.get(k).and_then(|v| v.parse::<usize>().ok());
        if let (Some(rank), Some(world)) = (num("rank"), num("world_size")) {
            s.shard = Some(ShareState {
                rank,
                world,
                global_len: u64::MAX,
                ..Default::default()
            });
        }
        s.fingerprint.remove("rank");
        s.fingerprint.remove("world_size");
        s.version = STATE_VERSION;
        s
    }

    fn check_fields(&self, mine: &Fingerprint) -> Result<(), PipelineError> {
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

/// Tar-shard blocks as a message names them.
pub(super) fn show_blocks(b: Option<Blocks>) -> String {
    b.map_or("none (every world-th position)".to_owned(), |b| {
        format!("shuffle window {}, seed {}", b.window, b.seed)
    })
}
