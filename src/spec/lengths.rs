//! Length-aware batches from a pipeline file (`[batch] max_seconds` for audio, `max_frames`
//! for video): the files' declared lengths planned into batch slots, each slot read and padded
//! as one batch.

use std::path::PathBuf;

use super::build::Reader;
use super::schema::*;
use crate::media::{Files, Recipe};
use crate::Tensor;

impl PipelineSpec {
    /// The cap of length-aware batches, if the spec asks for them: `batch.max_seconds` for
    /// audio, `batch.max_frames` for video.
    pub(super) fn length_cap(&self) -> Option<f64> {
        match &self.decode {
            DecodeSpec::Audio { .. } => self.batch.max_seconds,
            DecodeSpec::Video { .. } => self.batch.max_frames.map(|f| f as f64),
            DecodeSpec::Image { .. } => None,
        }
    }

    /// Length-aware batches over `files` (audio by seconds, video by frames): each item of
    /// the reader is a whole batch, padded to its longest clip (see `LengthBatches`).
    #[cfg_attr(
        not(all(feature = "audio", feature = "video")),
        allow(unreachable_code, unused_variables)
    )]
    pub(super) fn length_batches(
        &self,
        files: Files,
        cap: f64,
        decoder: &Recipe,
    ) -> Result<Reader, crate::PipelineError> {
        use crate::sampler::{Bucketing, LengthBatches, Sampler};
        use std::sync::Arc;
        type LoadBatch = Arc<
            dyn Fn(&[PathBuf]) -> (Option<(Tensor, Tensor)>, Vec<crate::media::MediaError>)
                + Send
                + Sync,
        >;
        let config = |m: String| crate::PipelineError::config(m);
        // Each file's length in the cap's unit, and how a batch of them is loaded.
        type LengthOf =
            Box<dyn Fn(&std::path::Path) -> Result<Option<f64>, crate::media::MediaError>>;
        let (length, load, what): (LengthOf, LoadBatch, &str) =
            match &self.decode {
                #[cfg(feature = "audio")]
                DecodeSpec::Audio { rate, .. } => {
                    let recipe = crate::media::audio::AudioRecipe::with_seconds(*rate, cap)
                        .map_err(|e| config(e.to_string()))?;
                    (
                        Box::new(crate::media::audio::duration),
                        Arc::new(move |clips: &[PathBuf]| recipe.load_batch(clips)),
                        "batch.max_seconds",
                    )
                }
                #[cfg(feature = "video")]
                DecodeSpec::Video { .. } => {
                    let v = decoder
                        .as_video()
                        .ok_or_else(|| config("a video decode without its recipe".to_owned()))?;
                    let (plan, recipe) = (v.clone(), v.clone());
                    (
                        Box::new(move |p: &std::path::Path| {
                            Ok(crate::media::video::duration(p)?
                                .map(|d| plan.planned_frames(d) as f64))
                        }),
                        Arc::new(move |clips: &[PathBuf]| recipe.load_batch(clips)),
                        "batch.max_frames",
                    )
                }
                _ => {
                    return Err(config(
                        "length-aware batches need the audio or video feature of their decode kind"
                            .to_owned(),
                    ))
                }
            };
        let paths: Arc<[PathBuf]> = files.paths().into();
        let mut lengths = Vec::with_capacity(paths.len());
        for p in paths.iter() {
            let d = length(p).map_err(|e| config(e.to_string()))?;
            lengths.push(d.ok_or_else(|| {
                config(format!(
                    "{}: the file does not declare its length ({what} plans with it)",
                    p.display()
                ))
            })?);
        }
        let shuffle = match &self.source {
            SourceSpec::List { shuffle, .. } | SourceSpec::Dir { shuffle, .. } => *shuffle,
            _ => None,
        };
        let mut plan = LengthBatches::new(lengths, cap, Bucketing::Quantiles(self.batch.buckets))?;
        let mut sampler = Sampler::new(plan.len());
        if let Some(seed) = shuffle {
            plan = plan.shuffle(seed);
            sampler = sampler.shuffle(seed);
        }
        let mut fingerprint: Vec<_> = files
            .fingerprint()
            .into_iter()
            .filter(|(k, _)| *k == "dataset")
            .collect();
        fingerprint.extend(plan.fingerprint());
        let plan = Arc::new(plan);
        let (read_plan, read_paths) = (Arc::clone(&plan), Arc::clone(&paths));
        Ok(Reader {
            items: files.len(),
            fingerprint,
            sampler,
            reserve: Vec::new(),
            read: Arc::new(move |epoch, slot| {
                let clips: Vec<PathBuf> = read_plan
                    .batch(epoch, slot)
                    .into_iter()
                    .map(|i| read_paths[i].clone())
                    .collect();
                let (batch, mut errors) = load(&clips);
                match batch {
                    Some((batch, _lengths)) => {
                        // Clips left out of a batch that still has others are failed items
                        // of the stage: counted, and fatal past `run.max_failures`.
                        for e in errors {
                            crate::skip_part(e.path().display().to_string(), e)?;
                        }
                        Ok(batch)
                    }
                    None => Err(Box::new(errors.remove(0))),
                }
            }),
            name: Arc::new(move |slot| {
                let rows = plan.batch(0, slot);
                let first = rows
                    .first()
                    .map_or_else(String::new, |&i| paths[i].display().to_string());
                format!("batch {slot} ({} clips: {first}, ...)", rows.len())
            }),
            read_ahead: None,
        })
    }
}
