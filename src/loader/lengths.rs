//! Length-aware batches: a dataset's files planned into batches of similar lengths from the
//! lengths their containers declare (at most `cap` padded units each: seconds of audio,
//! frames of video), each batch read and padded to its longest clip as one item. A clip that
//! fails is left out of its batch and counted as a failed item of the decode stage
//! ([`skip_part`](crate::skip_part): fatal past the failure budget); a batch whose every clip
//! failed is one failed item. A file whose container cannot be read when the batches are
//! planned is planned as an empty clip, so it fails (and is counted) in its batch too.

use std::sync::Arc;

use super::batch::{Decoded, ItemMeta};
use super::decode::Decoder;
use crate::dataset::{Dataset, Files, Input};
use crate::media::{MediaError, Recipe};
use crate::sampler::{Bucketing, LengthBatches, Sampler};
use crate::{BoxError, PipelineError};

/// Length buckets of length-aware batches by default: quantiles of the declared lengths, fine
/// enough that a batch's clips are of similar length (padding a few percent), coarse enough
/// that each bucket holds batches to shuffle. At least 1; [`MAX_BUCKETS`] at most.
pub const DEFAULT_BUCKETS: usize = 20;

/// The most length buckets ([`limits::BUCKETS`](crate::limits::BUCKETS)): past it a bucket
/// holds too few clips to make full batches.
pub const MAX_BUCKETS: usize = crate::limits::BUCKETS.max as usize;

/// How a loader makes length-aware batches (see [`LoaderBuilder::length_batches`]).
///
/// [`LoaderBuilder::length_batches`]: super::LoaderBuilder::length_batches
#[derive(Clone, Copy, Debug, PartialEq)]
pub(crate) struct LengthCap {
    pub(crate) cap: f64,
    pub(crate) buckets: usize,
}

/// A dataset's files planned into batch slots: slot `i` of an epoch is a whole batch.
#[derive(Clone, Debug)]
pub(crate) struct LengthPlan {
    files: Files,
    /// The dataset planned (its files' labels and classes).
    dataset: Dataset,
    plan: Arc<LengthBatches>,
    sampler: Sampler,
}

impl LengthPlan {
    /// Plans the files of `dataset` (local files only) by the lengths `recipe` reads from
    /// their containers; shuffled and dealt to ranks as the dataset is.
    pub(crate) fn new(
        dataset: &Dataset,
        recipe: &Recipe,
        cap: LengthCap,
    ) -> Result<Self, PipelineError> {
        let files = dataset.files().ok_or_else(|| {
            PipelineError::config(
                "length-aware batches need local files (a directory, a list or paths), not \
                 shards, Parquet or a mixture",
            )
        })?;
        if !recipe.has_length() {
            return Err(PipelineError::config(
                "length-aware batches are for audio and video recipes",
            ));
        }
        // Clips are padded along their first axis: mono audio `[T]`, video `[T, H, W, C]`.
        #[cfg(feature = "audio")]
        if recipe
            .as_audio()
            .is_some_and(|a| a.channels != crate::media::audio::Channels::Mono)
        {
            return Err(PipelineError::config(
                "length-aware batches of audio are mono (channels kept are not padded by time)",
            ));
        }
        #[cfg(feature = "video")]
        if recipe
            .as_video()
            .is_some_and(|v| v.layout != crate::media::video::VideoLayout::Nthwc)
        {
            return Err(PipelineError::config(
                "length-aware batches of video are in layout NTHWC (frames first)",
            ));
        }
        if !(cap.cap.is_finite() && cap.cap > 0.0) {
            return Err(PipelineError::config(format!(
                "length-aware batches: the cap must be above 0, not {}",
                cap.cap
            )));
        }
        let mut lengths = Vec::with_capacity(files.len());
        for p in files.paths() {
            lengths.push(match recipe.declared_length(p) {
                Ok(Some(d)) => d,
                // A file that cannot be read (empty, corrupt, gone) is planned as an empty
                // clip: its decode fails in its batch and is counted like any bad item (fatal
                // past the failure budget), instead of ending the run before it starts.
                Err(_) => 0.0,
                Ok(None) => {
                    return Err(PipelineError::config(format!(
                        "{}: the file does not declare its length, which length-aware \
                         batches plan with",
                        p.display()
                    )))
                }
            });
        }
        let mut plan = LengthBatches::new(lengths, cap.cap, Bucketing::Quantiles(cap.buckets))?;
        let order = dataset.order();
        let mut sampler = plan.sampler();
        if let Some(seed) = order.seed {
            plan = plan.shuffle(seed);
        }
        // The slots are shuffled and dealt like the dataset's items.
        sampler = order.apply(sampler)?;
        Ok(Self {
            files: files.clone(),
            dataset: dataset.clone(),
            plan: Arc::new(plan),
            sampler,
        })
    }

    pub(crate) fn sampler(&self) -> &Sampler {
        &self.sampler
    }

    /// The files (a hash of their paths; their sampler is not used) and the plan.
    pub(crate) fn fingerprint(&self) -> Vec<(&'static str, String)> {
        let mut f: Vec<_> = self
            .files
            .fingerprint()
            .into_iter()
            .filter(|(k, _)| *k == "dataset")
            .collect();
        f.extend(self.plan.fingerprint());
        f
    }

    /// A slot's name in failures: `batch N (K clips: FIRST, ...)`.
    pub(crate) fn name(&self, slot: usize, epoch: u64) -> String {
        let rows = self.plan.batch(epoch, slot);
        let first = rows.first().map_or_else(String::new, |&i| {
            self.files.paths()[i].display().to_string()
        });
        format!("batch {slot} ({} clips: {first}, ...)", rows.len())
    }

    /// The dataset planned.
    pub(crate) fn dataset(&self) -> &Dataset {
        &self.dataset
    }

    /// The path of file `index` (a row of a batch).
    pub(crate) fn path(&self, index: usize) -> String {
        self.files.paths()[index].display().to_string()
    }

    /// Decodes slot `slot` of `epoch` into one batch padded to its longest clip: `[B, T, ...]`
    /// and the lengths `[B]`, stacked as one item (`[1, B, ...]` after collation, unstacked
    /// there), with the rows kept.
    pub(crate) fn load(
        &self,
        slot: usize,
        epoch: u64,
        decoder: &Decoder,
    ) -> Result<Decoded, BoxError> {
        let rows = self.plan.batch(epoch, slot);
        let mut clips = Vec::with_capacity(rows.len());
        let mut kept = Vec::with_capacity(rows.len());
        let mut failed: Vec<(String, MediaError)> = Vec::new();
        for &i in &rows {
            let path = self.files.paths()[i].clone();
            match decoder.clip(Input::Path(path.clone()), epoch) {
                Ok(clip) => {
                    clips.push(clip);
                    let label = match self.dataset.has_labels() {
                        true => self.dataset.read(i, epoch)?.label,
                        false => None,
                    };
                    kept.push((i, label));
                }
                Err(e) => failed.push((path.display().to_string(), e)),
            }
        }
        if clips.is_empty() {
            return Err(match failed.into_iter().next() {
                Some((_, e)) => Box::new(e),
                None => "a length-aware batch without clips".into(),
            });
        }
        for (path, e) in failed {
            crate::skip_part(path, e)?;
        }
        let (batch, lengths) = crate::collate::pad_longest(&clips);
        Ok(Decoded {
            fields: vec![batch, lengths],
            meta: ItemMeta {
                index: slot,
                epoch,
                label: None,
                extras: Vec::new(),
            },
            rows: Some(kept),
        })
    }
}
