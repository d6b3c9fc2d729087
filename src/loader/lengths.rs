//! Length-aware batches: a dataset's clips planned into batches of similar lengths from the
//! lengths their containers declare (at most `cap` padded units each: seconds of audio,
//! frames of video), each batch read and padded to its longest clip as one item, with each
//! clip's label and fields besides the media. The clips are local files, or the samples of
//! local tar shards or Parquet files (each read once before the first epoch, for its
//! header). A clip that fails (its media, its label, a field) is left out of its batch and
//! counted as a failed item of the decode stage ([`skip_part`](crate::skip_part): fatal past
//! the failure budget); a batch whose every clip failed is one failed item. A clip whose
//! container cannot be read when the batches are planned is planned as an empty clip, so it
//! fails (and is counted) in its batch too, as does one whose container declares no length
//! (a stream written without it).

use std::sync::Arc;

use flowgate_actors::error::{BoxError, PipelineError};

use super::batch::{Decoded, ItemMeta};
use super::decode::Decoder;
use crate::dataset::Dataset;
use crate::media::Recipe;
use crate::sampler::{Bucketing, LengthBatches, Sampler};

/// Length buckets of length-aware batches by default: quantiles of the declared lengths, fine
/// enough that a batch's clips are of similar length (padding a few percent), coarse enough
/// that each bucket holds batches to shuffle. At least 1; [`MAX_BUCKETS`] at most.
pub const DEFAULT_BUCKETS: usize = 20;

/// The most length buckets ([`limits::BUCKETS`](flowgate_actors::limits::BUCKETS)): past it a bucket
/// holds too few clips to make full batches.
pub const MAX_BUCKETS: usize = flowgate_actors::limits::BUCKETS.max as usize;

/// How a loader makes length-aware batches (see [`LoaderBuilder::length_batches`]).
///
/// [`LoaderBuilder::length_batches`]: super::LoaderBuilder::length_batches
#[derive(Clone, Copy, Debug, PartialEq)]
pub(crate) struct LengthCap {
    pub(crate) cap: f64,
    pub(crate) buckets: usize,
}

/// A dataset's clips planned into batch slots: slot `i` of an epoch is a whole batch.
#[derive(Clone, Debug)]
pub(crate) struct LengthPlan {
    /// The dataset planned: its clips (by dataset index), labels, classes and fields.
    dataset: Dataset,
    plan: Arc<LengthBatches>,
    sampler: Sampler,
    /// The clips whose containers declare no length (sorted): planned as empty, each a
    /// failed item of its batch.
    undeclared: Arc<[usize]>,
}

impl LengthPlan {
    /// The most clips a batch of the plan holds.
    pub(crate) fn most_clips(&self) -> usize {
        self.plan.most_items()
    }

    /// Plans the files of `dataset` (local files only) by the lengths `recipe` reads from
    /// their containers; shuffled and dealt to ranks as the dataset is.
    pub(crate) fn new(
        dataset: &Dataset,
        recipe: &Recipe,
        cap: LengthCap,
    ) -> Result<Self, PipelineError> {
        if !dataset.reads_locally() {
            return Err(PipelineError::config(
                "length-aware batches read each clip's declared length before the first epoch: \
                 local files, tar shards or Parquet, not S3 nor a mixture",
            ));
        }
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
        let (lengths, undeclared) = declared_lengths(dataset, recipe);
        let mut plan = LengthBatches::new(lengths, cap.cap, Bucketing::Quantiles(cap.buckets))?;
        let order = dataset.order();
        let mut sampler = plan.sampler();
        if let Some(seed) = order.seed {
            plan = plan.shuffle(seed);
        }
        // The slots are shuffled and dealt like the dataset's items.
        sampler = order.apply(sampler)?;
        Ok(Self {
            dataset: dataset.clone(),
            plan: Arc::new(plan),
            sampler,
            undeclared: undeclared.into(),
        })
    }

    pub(crate) fn sampler(&self) -> &Sampler {
        &self.sampler
    }

    /// What identifies the dataset's clips (its sampler is not used) and the plan.
    pub(crate) fn fingerprint(&self) -> Vec<(&'static str, String)> {
        let mut f: Vec<_> = self
            .dataset
            .fingerprint()
            .into_iter()
            .filter(|(k, _)| matches!(*k, "dataset" | "columns" | "fields" | "label_field"))
            .collect();
        f.extend(self.plan.fingerprint());
        f
    }

    /// A slot's name in failures: `batch N (K clips: FIRST, ...)`.
    pub(crate) fn name(&self, slot: usize, epoch: u64) -> String {
        let rows = self.plan.batch(epoch, slot);
        let first = rows
            .first()
            .map_or_else(String::new, |&i| self.dataset.name(i, epoch));
        format!("batch {slot} ({} clips: {first}, ...)", rows.len())
    }

    /// The dataset planned.
    pub(crate) fn dataset(&self) -> &Dataset {
        &self.dataset
    }

    /// Decodes slot `slot` of `epoch` into one batch padded to its longest clip: `[B, T, ...]`
    /// and the lengths `[B]`, stacked as one item (`[1, B, ...]` after collation, unstacked
    /// there), with the rows kept (each clip's index, label and fields).
    pub(crate) fn load(
        &self,
        slot: usize,
        epoch: u64,
        decoder: &Decoder,
    ) -> Result<Decoded, BoxError> {
        let rows = self.plan.batch(epoch, slot);
        let mut clips = Vec::with_capacity(rows.len());
        let mut kept = Vec::with_capacity(rows.len());
        let mut failed: Vec<(String, BoxError)> = Vec::new();
        for &i in &rows {
            if self.undeclared.binary_search(&i).is_ok() {
                failed.push((
                    self.dataset.name(i, epoch),
                    "the clip does not declare its length, which length-aware batches plan \
                     with (a stream written without its length)"
                        .into(),
                ));
                continue;
            }
            let clip = self
                .dataset
                .read(i, epoch)
                .map_err(BoxError::from)
                .and_then(|item| {
                    let clip = decoder.clip(item.input, epoch)?;
                    Ok((clip, item.label, item.extras))
                });
            match clip {
                Ok((clip, label, extras)) => {
                    clips.push(clip);
                    kept.push(ItemMeta {
                        index: i,
                        epoch,
                        label,
                        extras,
                    });
                }
                Err(e) => failed.push((self.dataset.name(i, epoch), e)),
            }
        }
        if clips.is_empty() {
            return Err(match failed.into_iter().next() {
                Some((_, e)) => e,
                None => "a length-aware batch without clips".into(),
            });
        }
        for (name, e) in failed {
            flowgate_actors::failure::skip_part(name, e)?;
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

/// Each clip's declared length (the recipe's unit), in dataset order, read from the files'
/// headers or from each sample's media bytes (tar shards, Parquet: one read of each sample,
/// on this process's share of the cores); and the clips whose containers declare none. A clip that cannot be read,
/// or declares no length, counts as 0 long (it fails in its batch, named).
fn declared_lengths(dataset: &Dataset, recipe: &Recipe) -> (Vec<f64>, Vec<usize>) {
    let n = dataset.dataset_len();
    // `None`: no declared length.
    let length = |i: usize| -> Option<f64> {
        match dataset.read(i, 0) {
            Ok(item) => match recipe.declared_length_of(item.input) {
                Ok(Some(d)) => Some(d),
                Ok(None) => None,
                // Read again (and counted) in its batch.
                Err(_) => Some(0.0),
            },
            Err(_) => Some(0.0),
        }
    };
    // This process's share of the cores (and of a node budget's), not the machine's: eight
    // ranks planning at once on a node must not start eight machines' worth of threads.
    let threads = flowgate_actors::cap::cores().clamp(1, 16).min(n.max(1));
    let chunk = n.div_ceil(threads).max(1);
    let declared: Vec<Option<f64>> = std::thread::scope(|s| {
        let parts: Vec<_> = (0..n)
            .step_by(chunk)
            .map(|start| {
                let length = &length;
                s.spawn(move || {
                    (start..(start + chunk).min(n))
                        .map(length)
                        .collect::<Vec<_>>()
                })
            })
            .collect();
        parts
            .into_iter()
            .flat_map(|p| p.join().expect("a length reader panicked"))
            .collect()
    });
    let undeclared = (0..n).filter(|&i| declared[i].is_none()).collect();
    (
        declared.into_iter().map(|d| d.unwrap_or(0.0)).collect(),
        undeclared,
    )
}
