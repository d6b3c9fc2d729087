//! How a [`PipelineState`]'s [`ShareState`] is written and read: flat, in the words of the
//! Python package's `state_dict` (one layout for every front end), the nested layout of
//! earlier versions still read, and keys that come in pairs refused alone.

use super::checkpoint::ShareState;
use crate::sampler::{Blocks, ShareLengths};

/// [`ShareState`] as it is written and read (see there).
#[derive(serde::Serialize, serde::Deserialize)]
pub(crate) struct ShareWire {
    rank: usize,
    #[serde(alias = "world")]
    world_size: usize,
    #[serde(alias = "lengths")]
    shard_lengths: ShareLengths,
    global_len: u64,
    #[serde(default)]
    base: Vec<(u64, u64)>,
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    base_partial: Vec<(u64, u64, u64)>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    block_window: Option<u64>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    block_seed: Option<u64>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    worker: Option<usize>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    workers: Option<usize>,
    /// The nested layout of earlier versions, read only.
    #[serde(default, skip_serializing)]
    blocks: Option<Blocks>,
    #[serde(default, skip_serializing)]
    split: Option<(usize, usize)>,
}

impl TryFrom<ShareWire> for ShareState {
    type Error = String;

    /// Keys that come in pairs come both or neither: a state that lost one would resume
    /// another share than its own.
    fn try_from(w: ShareWire) -> Result<Self, String> {
        let pair = |a: &str, b: &str, x: bool, y: bool| match x == y {
            true => Ok(()),
            false => Err(format!(
                "shard: `{a}` and `{b}` come together, one is missing"
            )),
        };
        pair(
            "block_window",
            "block_seed",
            w.block_window.is_some(),
            w.block_seed.is_some(),
        )?;
        pair("worker", "workers", w.worker.is_some(), w.workers.is_some())?;
        let blocks = match (w.block_window, w.block_seed) {
            (Some(window), Some(seed)) => Some(Blocks { window, seed }),
            _ => w.blocks,
        };
        let split = w.worker.zip(w.workers).or(w.split);
        if let Some((w, n)) = split {
            if w >= n {
                return Err(format!("shard: worker {w} of {n} workers"));
            }
        }
        Ok(Self {
            rank: w.rank,
            world: w.world_size,
            lengths: w.shard_lengths,
            global_len: w.global_len,
            base: w.base,
            base_partial: w.base_partial,
            blocks,
            split,
        })
    }
}

impl From<ShareState> for ShareWire {
    fn from(s: ShareState) -> Self {
        Self {
            rank: s.rank,
            world_size: s.world,
            shard_lengths: s.lengths,
            global_len: s.global_len,
            base: s.base,
            base_partial: s.base_partial,
            block_window: s.blocks.map(|b| b.window),
            block_seed: s.blocks.map(|b| b.seed),
            worker: s.split.map(|(w, _)| w),
            workers: s.split.map(|(_, n)| n),
            blocks: None,
            split: None,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::super::checkpoint::{PipelineState, STATE_VERSION};
    use super::*;

    fn state() -> PipelineState {
        PipelineState {
            epoch: 3,
            delivered: vec![(0, 5)],
            delivered_items: 5,
            partial: vec![(7, 0, 1 << 31)],
            version: STATE_VERSION,
            fingerprint: [("seed".to_owned(), "9".to_owned())].into(),
            shard: Some(ShareState {
                rank: 1,
                world: 3,
                lengths: ShareLengths::Pad,
                global_len: 41,
                base: vec![(0, 2)],
                base_partial: Vec::new(),
                blocks: Some(Blocks {
                    window: 8,
                    seed: 77,
                }),
                split: Some((0, 2)),
            }),
            owed_batches: Some(4),
        }
    }

    #[test]
    fn a_state_is_written_flat_in_the_python_packages_words_and_read_back() {
        let mut state = state();
        state.shard.as_mut().unwrap().base_partial = vec![(20, 0, 1 << 31)];
        let v = serde_json::to_value(&state).unwrap();
        let shard = &v["shard"];
        assert_eq!(
            shard["base_partial"],
            serde_json::json!([[20, 0, 1u64 << 31]])
        );
        assert_eq!(shard["world_size"], 3);
        assert_eq!(shard["shard_lengths"], "pad");
        assert_eq!(
            (shard["block_window"].clone(), shard["block_seed"].clone()),
            (8.into(), 77.into())
        );
        assert_eq!(
            (shard["worker"].clone(), shard["workers"].clone()),
            (0.into(), 2.into())
        );
        for old in ["world", "lengths", "blocks", "split"] {
            assert!(shard.get(old).is_none(), "{old} written: {shard}");
        }
        let back: PipelineState = serde_json::from_value(v).unwrap();
        assert_eq!(back, state);
    }

    #[test]
    fn a_state_that_lost_one_key_of_a_pair_is_refused() {
        let v = serde_json::to_value(state()).unwrap();
        for (key, what) in [("block_seed", "block_window"), ("workers", "worker")] {
            let mut bad = v.clone();
            bad["shard"].as_object_mut().unwrap().remove(key);
            let e = serde_json::from_value::<PipelineState>(bad).unwrap_err();
            assert!(e.to_string().contains(what), "{e}");
        }
        let mut bad = v;
        bad["shard"]["worker"] = 2.into();
        assert!(serde_json::from_value::<PipelineState>(bad).is_err());
    }

    #[test]
    fn a_state_in_the_earlier_nested_layout_is_still_read() {
        let old = serde_json::json!({
            "epoch": 3, "delivered": [[0, 5]], "delivered_items": 5,
            "partial": [[7, 0, 1u64 << 31]], "version": 2, "fingerprint": {"seed": "9"},
            "owed_batches": 4,
            "shard": {"rank": 1, "world": 3, "lengths": "Pad", "global_len": 41,
                      "base": [[0, 2]], "blocks": {"window": 8, "seed": 77}, "split": [0, 2]},
        });
        let back: PipelineState = serde_json::from_value(old).unwrap();
        assert_eq!(back, state());
    }
}
