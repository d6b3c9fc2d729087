//! Mixtures: several sources drawn by weight into one epoch order.

use flowgate_actors::error::PipelineError;
use flowgate_tuner::Rng;

use super::{shuffle, Sampler};

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

impl MixStop {
    /// When an epoch ends as a front end names it: after `draws` draws (1 to
    /// [`MAX_EPOCH_ITEMS`](super::MAX_EPOCH_ITEMS)), else `stop`: `"first"` or `"all"` (a
    /// `stop` of another name is refused with `draws` too, as a pipeline file's). An error
    /// names the key.
    pub fn named(draws: Option<i128>, stop: &str) -> Result<Self, String> {
        let most = super::MAX_EPOCH_ITEMS;
        let stop = match stop {
            "first" => Self::FirstExhausted,
            "all" => Self::AllExhausted,
            other => return Err(format!("stop: must be \"first\" or \"all\", not {other:?}")),
        };
        match draws {
            Some(n) => match usize::try_from(n) {
                Ok(n) if (1..=most).contains(&n) => Ok(Self::Draws(n)),
                _ => Err(format!("draws: must be in 1..={most}, not {n}")),
            },
            None => Ok(stop),
        }
    }
}

/// A mixture's weights against its `sources`, checked before any source is opened (every
/// front end's words): one weight per source, at least one source, each finite and at
/// least 0, one above 0. An error names the key.
pub fn check_weights(sources: usize, weights: &[f64]) -> Result<(), String> {
    if sources == 0 || sources != weights.len() {
        return Err(format!(
            "weights: one weight per source, at least one source: {sources} sources, {} \
             weights",
            weights.len()
        ));
    }
    if let Some((i, w)) = weights
        .iter()
        .enumerate()
        .find(|(_, w)| !(w.is_finite() && **w >= 0.0))
    {
        return Err(format!(
            "weights: each must be finite and at least 0; weights[{i}] is {w}"
        ));
    }
    if !weights.iter().any(|&w| w > 0.0) {
        return Err("weights: every weight is 0; one must be above 0".into());
    }
    Ok(())
}

#[derive(Clone, Debug)]
pub(super) struct Mixture {
    pub(super) lengths: Vec<usize>,
    pub(super) offsets: Vec<usize>,
    pub(super) weights: Vec<f64>,
    pub(super) cumulative: Vec<f64>,
    pub(super) stop: MixStop,
}

impl Sampler {
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
        if let Err(m) = check_weights(lengths.len(), weights) {
            return bad(m);
        }
        for (i, (&n, &w)) in lengths.iter().zip(weights).enumerate() {
            if w > 0.0 && n == 0 {
                return bad(format!("source {i} is empty but has weight {w}"));
            }
        }
        if let MixStop::Draws(n) = stop {
            if n > super::MAX_EPOCH_ITEMS {
                return bad(format!(
                    "{n} draws an epoch; at most {} (sampler::MAX_EPOCH_ITEMS)",
                    super::MAX_EPOCH_ITEMS
                ));
            }
        }
        // Weights near f64::MAX would sum to infinity, and every draw fall on the last
        // source: those are scaled so the largest is 1 (others are kept as given, so an
        // order is the same as before this rule).
        let scaled: Vec<f64> = if weights.iter().sum::<f64>().is_finite() {
            weights.to_vec()
        } else {
            let top = weights.iter().copied().fold(0.0, f64::max);
            weights.iter().map(|w| w / top).collect()
        };
        if stop == MixStop::AllExhausted {
            // A source is drawn through in about `n / p` draws: an epoch that ends once every
            // source is must fit an epoch's limit (a weight of 1e-10 would take 10^10 draws
            // a sample, and hold them all in memory).
            let sum: f64 = scaled.iter().sum();
            let through = lengths
                .iter()
                .zip(&scaled)
                .enumerate()
                .filter(|(_, (_, &w))| w > 0.0)
                .map(|(i, (&n, &w))| (i, n as f64 * sum / w))
                .max_by(|a, b| a.1.total_cmp(&b.1));
            if let Some((i, draws)) = through.filter(|t| t.1 > super::MAX_EPOCH_ITEMS as f64) {
                return bad(format!(
                    "weights: with stop \"all\" an epoch ends once every source is drawn \
                     through, and source {i} ({} items at weight {}) takes about {draws:.3e} \
                     draws, more than an epoch holds ({}); raise its weight, or give draws or \
                     stop \"first\"",
                    lengths[i],
                    weights[i],
                    super::MAX_EPOCH_ITEMS
                ));
            }
        }
        let mut offsets = Vec::with_capacity(lengths.len());
        let mut at = 0;
        for &n in lengths {
            offsets.push(at);
            at += n;
        }
        let cumulative = scaled
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

    /// A mixture's global order of `epoch`.
    pub(super) fn mixed(&self, m: &Mixture, epoch: u64) -> Vec<usize> {
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
            // Bounded whatever the draws' luck (`mixture` refused weights that need more).
            if out.len() == super::MAX_EPOCH_ITEMS {
                break;
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
}
