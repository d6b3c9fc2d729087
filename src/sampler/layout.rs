//! [`Layout`]: a rank's place in an epoch's global order.

use flowgate_actors::origin::RangeSet;
use flowgate_tuner::Rng;

use super::{buffered, Blocks, ShareLengths};

/// Where one rank's items lie in an epoch's global order.
///
/// The positions not in `base` (those delivered before, by an earlier world's ranks) are
/// dealt out in order: rank `r` of `w` takes the `r`-th, `r + w`-th, … of them, after the
/// remaining list is made a multiple of `w` as `lengths` says (cut short, or padded by
/// repeating its start). With [`blocks`](Self::blocks) (group sampling) rank `r` takes
/// instead the `r`-th of `w` contiguous blocks of that list, through its shuffle buffer.
/// With an empty `base` this is plain sharding; a pipeline resumed from a merged checkpoint
/// at a new world size uses the merged delivered set as `base`.
///
/// With a [`split`](Self::split) `(w, n)` (the `n` DataLoader worker processes of one rank)
/// this process visits every `n`-th of the rank's positions starting at the `w`-th: the
/// rank's share is split without padding, so the rank's workers together visit exactly its
/// share (padding, where ranks need equal counts, happens once, at the rank level).
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Layout {
    /// This rank.
    pub rank: usize,
    /// Ranks in the world.
    pub world: usize,
    /// How uneven shares are made equal.
    pub lengths: ShareLengths,
    /// Positions in the epoch's global order.
    pub global_len: u64,
    /// Positions delivered before this world started the epoch.
    pub base: RangeSet,
    /// Contiguous blocks per rank, through a shuffle buffer (group sampling); `None`: every
    /// `world`-th position.
    pub blocks: Option<Blocks>,
    /// `(w, n)`: worker `w` of the `n` that split this rank's share; `None`: the whole share.
    pub split: Option<(usize, usize)>,
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
            ShareLengths::Uneven => m,
            ShareLengths::Drop => m / w * w,
            ShareLengths::Pad if m == 0 => 0,
            ShareLengths::Pad => m.div_ceil(w) * w,
        }
    }

    /// Number of positions this rank (or its worker, with a split) visits.
    pub fn len(&self) -> usize {
        let (a, b) = self.split_range(self.rank_len() as u64);
        match self.split {
            Some((w, n)) if self.blocks.is_none() => {
                let (share, n) = (self.rank_len(), n.max(1));
                share / n + usize::from(w < share % n)
            }
            _ => (b - a) as usize,
        }
    }

    /// Number of positions in this rank's share (before a split).
    fn rank_len(&self) -> usize {
        let (d, w, r) = (self.dealt(), self.world.max(1) as u64, self.rank as u64);
        if self.blocks.is_some() {
            let (a, b) = self.block();
            return (b - a) as usize;
        }
        (d / w + u64::from(r < d % w)) as usize
    }

    /// With blocks (tar shards), a worker's part of the rank's `len` positions is one
    /// contiguous run `[start, end)` of them (so it reads whole shards); `(0, len)` without
    /// a split.
    fn split_range(&self, len: u64) -> (u64, u64) {
        match self.split {
            Some((w, n)) => {
                let n = n.max(1) as u64;
                ((w as u64).min(n) * len / n, (w as u64 + 1).min(n) * len / n)
            }
            None => (0, len),
        }
    }

    /// The rank's share of `positions` kept by this worker (all of it without a split):
    /// every `n`-th starting at the `w`-th, or with blocks one contiguous run.
    fn split_of(&self, positions: Vec<u64>) -> Vec<u64> {
        match self.split {
            Some((w, n)) if self.blocks.is_none() => {
                positions.into_iter().skip(w).step_by(n.max(1)).collect()
            }
            Some(_) => {
                let (a, b) = self.split_range(positions.len() as u64);
                positions[a as usize..b as usize].to_vec()
            }
            None => positions,
        }
    }

    /// The local position in this worker's list of the rank's local position `j` (before
    /// the split), if this worker visits it.
    pub(crate) fn split_local(&self, j: u64) -> Option<u64> {
        match self.split {
            Some((w, n)) if self.blocks.is_none() => {
                let n = n.max(1) as u64;
                (j % n == w as u64).then_some(j / n)
            }
            Some(_) => {
                let (a, b) = self.split_range(self.rank_len() as u64);
                (a..b).contains(&j).then(|| j - a)
            }
            None => Some(j),
        }
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

    /// This rank's (or worker's) positions in the epoch's global order, in the order it
    /// visits them (its local position `p` is the `p`-th).
    pub fn positions(&self) -> Vec<u64> {
        let share = self.rank_positions();
        self.split_of(share)
    }

    /// The rank's positions, before a split.
    fn rank_positions(&self) -> Vec<u64> {
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
                if let Some(p) = self.split_local(j / w) {
                    return Some(p);
                }
            }
            j += m;
        }
        None
    }
}
