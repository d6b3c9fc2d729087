//! The rules that turn [`MediaArgs`] into a validated [`Recipe`]: checked in any build
//! ([`MediaArgs::check`]), built where the modality's feature is on ([`MediaArgs::recipe`]):
//! the audio window under length-aware batches, the random crop of training images, the choice
//! of a video's frame sampling.

use super::{MediaArgs, VideoArgs, VideoLayout};
use crate::media::{Recipe, RecipeError};

/// How a video's frames are taken, as the rules choose it (feature-free, so a build without
/// `video` checks the arguments alike).
#[derive(Clone, Copy, Debug, PartialEq)]
enum Frames {
    /// `frames` spread over the clip.
    Uniform,
    /// A window of `frames` frames `stride` apart.
    Window(usize),
    /// At `fps`, at most the cap's frames.
    Rate(f64, usize),
}

impl MediaArgs {
    /// Checks the arguments by every rule [`recipe`](Self::recipe) applies, in any build:
    /// `length_cap` as there.
    pub fn check(&self, length_cap: Option<f64>) -> Result<(), RecipeError> {
        use crate::media::rules::check;
        match self {
            Self::Image(a) => {
                if length_cap.is_some() {
                    return Err(RecipeError::new(
                        "length-aware batches",
                        "are made of audio or video clips, not images",
                    ));
                }
                check::crop(a.crop, a.resize, a.train)?;
                if a.train {
                    check::random_crop(a.scale, a.ratio)?;
                }
                if let Some((mean, std)) = a.normalize.stats() {
                    check::normalize(&mean, &std)?;
                }
            }
            Self::Audio(a) => {
                // Under length-aware batches the cap is the window: a rule of the window then
                // names the cap, not a `seconds` that was not given.
                check::audio_samples(a.rate, length_cap.unwrap_or(a.seconds)).map_err(
                    |e| match (length_cap, e.field()) {
                        (Some(_), "seconds") => RecipeError::new("max_batch_seconds", e.message()),
                        _ => e,
                    },
                )?;
            }
            Self::Video(a) => {
                check::video(a.frames, a.threads)?;
                check::crop(a.crop, a.resize, false)?;
                if let Some(s) = a.stride {
                    check::stride(s)?;
                }
                if let Some(f) = a.fps {
                    check::fps(f)?;
                }
                if let Some(s) = a.audio_seconds {
                    // The audio track's rules, in the video's names for them.
                    check::audio_samples(a.audio_rate, s).map_err(|e| {
                        let field = match e.field() {
                            "rate" => "audio_rate",
                            _ => "audio_seconds",
                        };
                        RecipeError::new(field, e.message().to_owned())
                    })?;
                }
                frames(a, length_cap)?;
            }
        }
        Ok(())
    }

    /// The validated recipe these arguments ask for, seeded with their `seed` or else
    /// `seed`. `length_cap`: the cap of length-aware batches when the loader makes them
    /// (padded seconds of audio, padded frames of video), which decides an audio clip's
    /// window and a video's sampling. A build without the modality's feature says which
    /// feature it needs.
    #[cfg_attr(
        not(all(feature = "image", feature = "audio", feature = "video")),
        allow(unused_variables, unreachable_code)
    )]
    pub fn recipe(&self, length_cap: Option<f64>, seed: u64) -> Result<Recipe, RecipeError> {
        self.check(length_cap)?;
        let seed = self.seed().unwrap_or(seed);
        let recipe: Recipe = match self {
            #[cfg(feature = "image")]
            Self::Image(a) => image_recipe(a)?,
            #[cfg(feature = "audio")]
            Self::Audio(a) => audio_recipe(a, length_cap)?,
            #[cfg(feature = "video")]
            Self::Video(a) => video_recipe(a, frames(a, length_cap)?)?,
            #[allow(unreachable_patterns)]
            other => {
                return Err(RecipeError::new(
                    "kind",
                    format!(
                        "\"{k}\" needs flowgate built with the `{k}` feature",
                        k = other.kind()
                    ),
                ))
            }
        };
        Ok(recipe.with_seed(seed))
    }

    /// A video's audio track (`audio_seconds` at `audio_rate`), checked; `None` for other
    /// kinds and for video without it.
    #[cfg(feature = "audio")]
    pub fn audio_track(&self) -> Result<Option<crate::media::audio::AudioRecipe>, RecipeError> {
        match self {
            Self::Video(VideoArgs {
                audio_seconds: Some(s),
                audio_rate,
                ..
            }) => crate::media::audio::AudioRecipe::with_seconds(*audio_rate, *s).map(Some),
            _ => Ok(None),
        }
    }
}

/// The rule choosing how a video's frames are taken: a window with `stride`, at `fps` under
/// length-aware batches, else spread over the clip; every other combination is refused,
/// naming what to change.
fn frames(a: &VideoArgs, length_cap: Option<f64>) -> Result<Frames, RecipeError> {
    Ok(match (length_cap, a.fps, a.stride) {
        (None, None, Some(stride)) => Frames::Window(stride),
        (None, None, None) if a.train => {
            return Err(RecipeError::new(
                "stride",
                "must be set with train: train draws a random window of `frames` frames \
                 `stride` apart (set stride)",
            ))
        }
        (None, None, None) => Frames::Uniform,
        (Some(_), _, Some(_)) => {
            return Err(RecipeError::new(
                "stride",
                "samples a window of `frames` frames; length-aware batches sample at fps: \
                 choose one",
            ))
        }
        (None, Some(_), _) => {
            return Err(RecipeError::new(
                "fps",
                "samples clips by their length for length-aware batches: set both fps and \
                 the batch's frame cap",
            ))
        }
        (Some(_), None, _) => {
            return Err(RecipeError::new(
                "fps",
                "must be set for length-aware video batches (max_batch_frames): the frames \
                 per second taken from each clip",
            ))
        }
        (Some(_), Some(_), None) if a.audio_seconds.is_some() || a.layout != VideoLayout::Nthwc => {
            return Err(RecipeError::new(
                "max_batch_frames",
                "makes length-aware video batches, which are frames only, in layout \"nthwc\" \
                 (no audio_seconds)",
            ))
        }
        (Some(cap), Some(fps), None) => {
            if !(cap >= 1.0 && cap.fract() == 0.0 && cap <= crate::media::rules::MAX_FRAMES as f64)
            {
                return Err(RecipeError::new(
                    "max_batch_frames",
                    format!(
                        "must be a whole number of frames in 1..={}, not {cap}",
                        crate::media::rules::MAX_FRAMES
                    ),
                ));
            }
            Frames::Rate(fps, cap as usize)
        }
    })
}

#[cfg(feature = "image")]
fn image_recipe(a: &super::ImageArgs) -> Result<Recipe, RecipeError> {
    use super::ImageLayout;
    use crate::media::image::{ImageRecipe, Layout, Normalize, RandomCrop};
    Recipe::image(ImageRecipe {
        resize: a.resize,
        crop: a.crop,
        layout: match a.layout {
            ImageLayout::Nchw => Layout::Nchw,
            ImageLayout::Nhwc => Layout::Nhwc,
        },
        random_crop: a.train.then_some(RandomCrop {
            scale: a.scale,
            ratio: a.ratio,
        }),
        flip: a.train,
        normalize: a
            .normalize
            .stats()
            .map(|(mean, std)| Normalize { mean, std }),
        draft: a.draft,
        ..ImageRecipe::default()
    })
}

#[cfg(feature = "audio")]
fn audio_recipe(a: &super::AudioArgs, length_cap: Option<f64>) -> Result<Recipe, RecipeError> {
    use crate::media::audio::{AudioRecipe, Channels};
    // Length-aware batches take a clip whole up to the batch's cap: the cap is the window,
    // and nothing is cropped at random.
    let window = length_cap.unwrap_or(a.seconds);
    Recipe::audio(AudioRecipe {
        channels: if a.keep_channels {
            Channels::Keep
        } else {
            Channels::Mono
        },
        random_crop: a.train && length_cap.is_none(),
        ..AudioRecipe::with_seconds(a.rate, window)?
    })
}

#[cfg(feature = "video")]
fn video_recipe(a: &VideoArgs, frames: Frames) -> Result<Recipe, RecipeError> {
    use crate::media::video::{Sampling, VideoRecipe};
    Recipe::video(VideoRecipe {
        sampling: match frames {
            Frames::Uniform => Sampling::Uniform(a.frames),
            Frames::Window(stride) => Sampling::Window {
                frames: a.frames,
                stride,
                random: a.train,
            },
            Frames::Rate(fps, max) => Sampling::Rate { fps, max },
        },
        resize: a.resize,
        crop: a.crop,
        layout: match a.layout {
            VideoLayout::Nthwc => crate::media::video::VideoLayout::Nthwc,
            VideoLayout::Ncthw => crate::media::video::VideoLayout::Ncthw,
        },
        threads: a.threads,
        draft: a.draft,
        ..VideoRecipe::default()
    })
}
