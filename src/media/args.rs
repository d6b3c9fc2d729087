//! What a user writes to say how an item is decoded: the raw arguments every front end takes
//! (a Python loader's keywords, a pipeline file's `[decode]` table, a Rust struct), each with a
//! named default, and the one place their rules turn them into a validated [`Recipe`]: the
//! audio window under length-aware batches, the random crop of training images, the choice of
//! a video's frame sampling. A front end deserializes these (or fills them) and calls
//! [`MediaArgs::recipe`]; it writes no rule of its own, so every front end refuses the same
//! arguments with the same words.
//!
//! The types exist in every build, so a file naming a modality the build lacks still reads,
//! and the error names the missing feature.

use serde::{Deserialize, Serialize};

use super::{Recipe, RecipeError};
use crate::limits;

/// An image's shorter side after resizing, by default (torchvision's evaluation geometry).
pub const DEFAULT_RESIZE: u32 = 256;
/// An image's output square, by default (ImageNet's 224).
pub const DEFAULT_CROP: u32 = 224;
/// A random resized crop's area range by default (torchvision's `RandomResizedCrop`).
pub const DEFAULT_SCALE: (f64, f64) = (0.08, 1.0);
/// A random resized crop's aspect-ratio range by default (torchvision's).
pub const DEFAULT_RATIO: (f64, f64) = (3.0 / 4.0, 4.0 / 3.0);
/// ImageNet's channel means (of `x / 255`), what `normalize = true` uses.
pub const IMAGENET_MEAN: [f32; 3] = [0.485, 0.456, 0.406];
/// ImageNet's channel standard deviations.
pub const IMAGENET_STD: [f32; 3] = [0.229, 0.224, 0.225];
/// Audio's output sample rate by default: 16 kHz, what speech models take.
pub const DEFAULT_RATE: u32 = 16_000;
/// Seconds per audio clip by default.
pub const DEFAULT_SECONDS: f64 = 4.0;
/// Frames per video clip by default.
pub const DEFAULT_FRAMES: usize = 8;
/// A video frame's shorter side after scaling, by default.
pub const DEFAULT_VIDEO_RESIZE: u32 = 128;
/// A video frame's output square, by default.
pub const DEFAULT_VIDEO_CROP: u32 = 112;

const fn default_resize() -> u32 {
    DEFAULT_RESIZE
}
const fn default_crop() -> u32 {
    DEFAULT_CROP
}
const fn default_scale() -> (f64, f64) {
    DEFAULT_SCALE
}
const fn default_ratio() -> (f64, f64) {
    DEFAULT_RATIO
}
const fn default_rate() -> u32 {
    DEFAULT_RATE
}
const fn default_seconds() -> f64 {
    DEFAULT_SECONDS
}
const fn default_frames() -> usize {
    DEFAULT_FRAMES
}
const fn default_video_resize() -> u32 {
    DEFAULT_VIDEO_RESIZE
}
const fn default_video_crop() -> u32 {
    DEFAULT_VIDEO_CROP
}

/// Where an image's channel axis goes.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum ImageLayout {
    /// `3 × H × W` per image (PyTorch's convention).
    #[default]
    Nchw,
    /// `H × W × 3` per image.
    Nhwc,
}

/// Where a video clip's channel axis goes.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum VideoLayout {
    /// `[T, H, W, 3]` per clip.
    #[default]
    Nthwc,
    /// `[3, T, H, W]` per clip.
    Ncthw,
}

/// Normalisation of an image's pixels: none (`u8` out), ImageNet's (`true`), or the user's
/// per-channel `[mean, std]` (`f32` out).
#[derive(Clone, Copy, Debug, Default, PartialEq, Serialize)]
#[serde(untagged)]
pub enum NormalizeArg {
    /// `true`: ImageNet's statistics; `false` (the default): none.
    Flag(bool),
    /// `[mean, std]`, three floats each (one per channel, of `x / 255`).
    Stats([f32; 3], [f32; 3]),
    /// No normalisation (`None` in Python, `null` in JSON).
    #[default]
    Off,
}

impl<'de> Deserialize<'de> for NormalizeArg {
    fn deserialize<D: serde::Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        #[derive(Deserialize)]
        #[serde(untagged)]
        enum Raw {
            Flag(bool),
            Stats([limits::Float; 3], [limits::Float; 3]),
        }
        let f = |v: [limits::Float; 3]| v.map(|x| x.0 as f32);
        match Option::<Raw>::deserialize(d) {
            Ok(Some(Raw::Flag(b))) => Ok(Self::Flag(b)),
            Ok(Some(Raw::Stats(mean, std))) => Ok(Self::Stats(f(mean), f(std))),
            Ok(None) => Ok(Self::Off),
            Err(_) => Err(serde::de::Error::custom(
                "must be true, false or [mean, std] with three numbers each",
            )),
        }
    }
}

impl NormalizeArg {
    /// `(mean, std)`, or `None` for `u8` output.
    pub fn stats(&self) -> Option<([f32; 3], [f32; 3])> {
        match *self {
            Self::Flag(true) => Some((IMAGENET_MEAN, IMAGENET_STD)),
            Self::Stats(mean, std) => Some((mean, std)),
            Self::Flag(false) | Self::Off => None,
        }
    }
}

/// An image's decoding (JPEG, PNG, WebP): see [`ImageRecipe`](super::image::ImageRecipe).
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct ImageArgs {
    /// The shorter side after resizing (evaluation geometry). Default [`DEFAULT_RESIZE`].
    #[serde(default = "default_resize")]
    pub resize: u32,
    /// The output square's side. Default [`DEFAULT_CROP`].
    #[serde(default = "default_crop")]
    pub crop: u32,
    /// `nchw` (default) or `nhwc`.
    #[serde(default)]
    pub layout: ImageLayout,
    /// Training geometry: a random resized crop (`scale`, `ratio`) and a random flip, drawn
    /// anew every epoch from the seed, the epoch and the file.
    #[serde(default)]
    pub train: bool,
    /// With `train`: the crop's area range, as a fraction of the image's.
    #[serde(default = "default_scale", deserialize_with = "limits::float_pair")]
    pub scale: (f64, f64),
    /// With `train`: the crop's aspect-ratio range (width / height).
    #[serde(default = "default_ratio", deserialize_with = "limits::float_pair")]
    pub ratio: (f64, f64),
    /// `f32` normalised pixels instead of `u8`.
    #[serde(default)]
    pub normalize: NormalizeArg,
    /// JPEG draft mode: decode at 1/2, 1/4 or 1/8 scale where the crop window allows.
    #[serde(default)]
    pub draft: bool,
    /// The augmentation's seed; default: the loader's seed.
    #[serde(default)]
    pub seed: Option<u64>,
}

impl Default for ImageArgs {
    fn default() -> Self {
        Self {
            resize: DEFAULT_RESIZE,
            crop: DEFAULT_CROP,
            layout: ImageLayout::default(),
            train: false,
            scale: DEFAULT_SCALE,
            ratio: DEFAULT_RATIO,
            normalize: NormalizeArg::default(),
            draft: false,
            seed: None,
        }
    }
}

/// An audio clip's decoding (WAV, FLAC, MP3, Vorbis, AAC, ALAC): see
/// [`AudioRecipe`](super::audio::AudioRecipe).
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct AudioArgs {
    /// The output sample rate (Hz); other rates are resampled. Default [`DEFAULT_RATE`].
    #[serde(default = "default_rate")]
    pub rate: u32,
    /// Seconds per clip, cropped or zero-padded. Default [`DEFAULT_SECONDS`]. Under
    /// length-aware batches the batch's cap is the window instead.
    #[serde(default = "default_seconds", deserialize_with = "limits::float")]
    pub seconds: f64,
    /// Every channel instead of a mono mix.
    #[serde(default)]
    pub keep_channels: bool,
    /// A window at a random offset in each clip, drawn anew every epoch (not under
    /// length-aware batches, which take clips whole up to the cap).
    #[serde(default)]
    pub train: bool,
    /// The augmentation's seed; default: the loader's seed.
    #[serde(default)]
    pub seed: Option<u64>,
}

impl Default for AudioArgs {
    fn default() -> Self {
        Self {
            rate: DEFAULT_RATE,
            seconds: DEFAULT_SECONDS,
            keep_channels: false,
            train: false,
            seed: None,
        }
    }
}

/// A video clip's decoding (feature `video`): see [`VideoRecipe`](super::video::VideoRecipe).
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct VideoArgs {
    /// Frames per clip. Default [`DEFAULT_FRAMES`].
    #[serde(default = "default_frames")]
    pub frames: usize,
    /// The shorter side after scaling. Default [`DEFAULT_VIDEO_RESIZE`].
    #[serde(default = "default_video_resize")]
    pub resize: u32,
    /// The output square's side. Default [`DEFAULT_VIDEO_CROP`].
    #[serde(default = "default_video_crop")]
    pub crop: u32,
    /// `nthwc` (default) or `ncthw`.
    #[serde(default)]
    pub layout: VideoLayout,
    /// Decoder threads per clip; 0 (the default) leaves them to the tuner.
    #[serde(default)]
    pub threads: usize,
    /// Under length-aware batches: the frames taken per second of each clip (its frames
    /// follow its length, up to the batch's cap) instead of `frames` per clip.
    #[serde(default, deserialize_with = "limits::float_or_name")]
    pub fps: Option<f64>,
    /// A window of `frames` frames this many stream frames apart instead of frames spread
    /// over the clip: centered, or with `train` at a random start drawn anew every epoch.
    #[serde(default)]
    pub stride: Option<usize>,
    /// With `stride`: a random window every epoch.
    #[serde(default)]
    pub train: bool,
    /// Draft mode: no in-loop deblocking filter.
    #[serde(default)]
    pub draft: bool,
    /// The clip's audio track too, this many seconds of it, as a second field.
    #[serde(default, deserialize_with = "limits::float_or_name")]
    pub audio_seconds: Option<f64>,
    /// The audio track's sample rate. Default [`DEFAULT_RATE`].
    #[serde(default = "default_rate")]
    pub audio_rate: u32,
    /// The augmentation's seed; default: the loader's seed.
    #[serde(default)]
    pub seed: Option<u64>,
}

impl Default for VideoArgs {
    fn default() -> Self {
        Self {
            frames: DEFAULT_FRAMES,
            resize: DEFAULT_VIDEO_RESIZE,
            crop: DEFAULT_VIDEO_CROP,
            layout: VideoLayout::default(),
            threads: 0,
            fps: None,
            stride: None,
            train: false,
            draft: false,
            audio_seconds: None,
            audio_rate: DEFAULT_RATE,
            seed: None,
        }
    }
}

/// How an item is decoded, tagged by its `kind` (`"image"`, `"audio"`, `"video"`).
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(tag = "kind", rename_all = "lowercase")]
pub enum MediaArgs {
    /// JPEG, PNG, WebP.
    Image(ImageArgs),
    /// WAV, FLAC, MP3, Vorbis, AAC, ALAC.
    Audio(AudioArgs),
    /// Video clips (feature `video`).
    Video(VideoArgs),
}

/// `T` from JSON-like data, an error naming the key at fault (`a.b: ...`).
pub(crate) fn keyed<T: serde::de::DeserializeOwned>(v: serde_json::Value) -> Result<T, String> {
    serde_path_to_error::deserialize(v).map_err(|e| {
        let path = e.path().to_string();
        let inner = crate::limits::in_words(&e.into_inner().to_string());
        if path == "." {
            inner
        } else {
            format!("{path}: {inner}")
        }
    })
}

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
    /// The modality's name, as `kind` says it.
    pub fn kind(&self) -> &'static str {
        match self {
            Self::Image(_) => "image",
            Self::Audio(_) => "audio",
            Self::Video(_) => "video",
        }
    }

    /// The arguments from JSON-like data (a Python dict, a JSON object): `kind` and its
    /// modality's keys; an error names the key at fault (`layout: unknown variant ...`).
    pub fn from_value(v: serde_json::Value) -> Result<Self, String> {
        let serde_json::Value::Object(mut keys) = v else {
            return Err(format!(
                "the media's arguments are a mapping with `kind`, not {v}"
            ));
        };
        let kind = keys.remove("kind");
        let args = serde_json::Value::Object(keys);
        match kind.as_ref().and_then(|k| k.as_str()) {
            Some("image") => keyed(args).map(Self::Image),
            Some("audio") => keyed(args).map(Self::Audio),
            Some("video") => keyed(args).map(Self::Video),
            _ => Err(format!(
                "kind: \"image\", \"audio\" or \"video\", not {}",
                kind.map_or("nothing".to_owned(), |k| k.to_string())
            )),
        }
    }

    /// The seed the arguments name for their augmentation, if any.
    pub fn seed(&self) -> Option<u64> {
        match self {
            Self::Image(a) => a.seed,
            Self::Audio(a) => a.seed,
            Self::Video(a) => a.seed,
        }
    }

    /// Checks the arguments by every rule [`recipe`](Self::recipe) applies, in any build:
    /// `length_cap` as there.
    pub fn check(&self, length_cap: Option<f64>) -> Result<(), RecipeError> {
        use super::rules::check;
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
                check::audio_samples(a.rate, length_cap.unwrap_or(a.seconds))?;
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
    pub fn audio_track(&self) -> Result<Option<super::audio::AudioRecipe>, RecipeError> {
        match self {
            Self::Video(VideoArgs {
                audio_seconds: Some(s),
                audio_rate,
                ..
            }) => super::audio::AudioRecipe::with_seconds(*audio_rate, *s).map(Some),
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
            if !(cap >= 1.0 && cap.fract() == 0.0 && cap <= super::rules::MAX_FRAMES as f64) {
                return Err(RecipeError::new(
                    "max_batch_frames",
                    format!(
                        "must be a whole number of frames in 1..={}, not {cap}",
                        super::rules::MAX_FRAMES
                    ),
                ));
            }
            Frames::Rate(fps, cap as usize)
        }
    })
}

#[cfg(feature = "image")]
fn image_recipe(a: &ImageArgs) -> Result<Recipe, RecipeError> {
    use super::image::{ImageRecipe, Layout, Normalize, RandomCrop};
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
fn audio_recipe(a: &AudioArgs, length_cap: Option<f64>) -> Result<Recipe, RecipeError> {
    use super::audio::{AudioRecipe, Channels};
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
    use super::video::{Sampling, VideoRecipe};
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
            VideoLayout::Nthwc => super::video::VideoLayout::Nthwc,
            VideoLayout::Ncthw => super::video::VideoLayout::Ncthw,
        },
        threads: a.threads,
        draft: a.draft,
        ..VideoRecipe::default()
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    fn parse(json: &str) -> Result<MediaArgs, String> {
        serde_json::from_str(json).map_err(|e| e.to_string())
    }

    #[test]
    fn every_default_is_its_named_constant() {
        let MediaArgs::Image(i) = parse(r#"{"kind":"image"}"#).unwrap() else {
            panic!()
        };
        assert_eq!(i, ImageArgs::default());
        let MediaArgs::Audio(a) = parse(r#"{"kind":"audio"}"#).unwrap() else {
            panic!()
        };
        assert_eq!(a, AudioArgs::default());
        let MediaArgs::Video(v) = parse(r#"{"kind":"video"}"#).unwrap() else {
            panic!()
        };
        assert_eq!(v, VideoArgs::default());
    }

    #[test]
    fn unknown_arguments_and_kinds_are_refused() {
        let e = parse(r#"{"kind":"image","crpo":3}"#).unwrap_err();
        assert!(e.contains("unknown field `crpo`"), "{e}");
        let e = parse(r#"{"kind":"text"}"#).unwrap_err();
        assert!(e.contains("unknown variant `text`"), "{e}");
        let v = serde_json::json!({"kind": "image", "normalize": [[1, 2], [3, 4, 5]]});
        let e = MediaArgs::from_value(v).unwrap_err();
        assert_eq!(
            e,
            "normalize: must be true, false or [mean, std] with three numbers each"
        );
        // A number JSON cannot hold, by its name, reaches the rule that refuses it.
        let v = serde_json::json!({"kind": "image", "normalize": [[0, 0, 0], ["nan", 1, 1]]});
        let a = MediaArgs::from_value(v).unwrap();
        let e = a.check(None).unwrap_err().to_string();
        assert!(
            e.starts_with("normalize must have finite standard deviations"),
            "{e}"
        );
    }

    #[test]
    fn errors_from_data_name_the_key() {
        use serde_json::json;
        let e = MediaArgs::from_value(json!({"kind": "video", "layout": "nchw"})).unwrap_err();
        assert!(e.starts_with("layout: unknown variant `nchw`"), "{e}");
        let e = MediaArgs::from_value(json!({"kind": "image", "scale": [1, 2, 3]})).unwrap_err();
        assert!(e.starts_with("scale: "), "{e}");
        let e = MediaArgs::from_value(json!({"kind": "text"})).unwrap_err();
        assert!(e.starts_with("kind: "), "{e}");
        let ok = MediaArgs::from_value(json!({"kind": "audio", "rate": 8000})).unwrap();
        assert_eq!(
            ok,
            MediaArgs::Audio(AudioArgs {
                rate: 8000,
                ..AudioArgs::default()
            })
        );
    }

    #[test]
    fn normalize_takes_a_flag_or_the_statistics() {
        let n = |j: &str| serde_json::from_str::<NormalizeArg>(j).unwrap().stats();
        assert_eq!(n("false"), None);
        assert_eq!(n("true"), Some((IMAGENET_MEAN, IMAGENET_STD)));
        assert_eq!(
            n("[[0.5,0.5,0.5],[0.25,0.25,0.25]]"),
            Some(([0.5; 3], [0.25; 3]))
        );
    }

    #[cfg(feature = "image")]
    #[test]
    fn image_rules() {
        let args = |j: &str| parse(j).unwrap();
        let r = args(r#"{"kind":"image","train":true,"seed":9}"#)
            .recipe(None, 1)
            .unwrap();
        let img = r.as_image().unwrap();
        assert!(img.flip && img.random_crop.is_some() && img.seed == 9);
        let r = args(r#"{"kind":"image"}"#).recipe(None, 4).unwrap();
        assert_eq!(r.as_image().unwrap().seed, 4);
        let e = args(r#"{"kind":"image","crop":0}"#)
            .recipe(None, 0)
            .unwrap_err();
        assert_eq!(e.field(), "crop");
        let e = args(r#"{"kind":"image","train":true,"scale":[0.5,0.1]}"#)
            .recipe(None, 0)
            .unwrap_err();
        assert_eq!(e.field(), "scale");
        let e = args(r#"{"kind":"image"}"#)
            .recipe(Some(3.0), 0)
            .unwrap_err();
        assert_eq!(e.field(), "length-aware batches");
    }

    #[cfg(feature = "audio")]
    #[test]
    fn audio_window_follows_the_length_cap() {
        let a = parse(r#"{"kind":"audio","seconds":2.0,"train":true,"rate":8000}"#).unwrap();
        let plain = a.recipe(None, 0).unwrap();
        let plain = plain.as_audio().unwrap();
        assert_eq!((plain.samples, plain.random_crop), (16_000, true));
        let capped = a.recipe(Some(5.0), 0).unwrap();
        let capped = capped.as_audio().unwrap();
        assert_eq!((capped.samples, capped.random_crop), (40_000, false));
        let e = parse(r#"{"kind":"audio","seconds":-1}"#)
            .unwrap()
            .recipe(None, 0)
            .unwrap_err();
        assert_eq!(e.field(), "seconds");
    }

    #[cfg(feature = "video")]
    #[test]
    fn video_sampling_is_chosen_once() {
        use crate::media::video::Sampling;
        let v = |j: &str| parse(j).unwrap();
        let sampling = |a: MediaArgs, cap| {
            a.recipe(cap, 0)
                .map(|r| r.as_video().unwrap().sampling.clone())
        };
        assert_eq!(
            sampling(v(r#"{"kind":"video"}"#), None),
            Ok(Sampling::Uniform(8))
        );
        assert_eq!(
            sampling(v(r#"{"kind":"video","stride":2,"train":true}"#), None),
            Ok(Sampling::Window {
                frames: 8,
                stride: 2,
                random: true
            })
        );
        assert_eq!(
            sampling(v(r#"{"kind":"video","fps":4}"#), Some(32.0)),
            Ok(Sampling::Rate { fps: 4.0, max: 32 })
        );
        for (json, cap, field, words) in [
            (
                r#"{"kind":"video","train":true}"#,
                None,
                "stride",
                "set stride",
            ),
            (r#"{"kind":"video","fps":4}"#, None, "fps", "set both"),
            (r#"{"kind":"video"}"#, Some(32.0), "fps", "must be set"),
            (
                r#"{"kind":"video","fps":4,"stride":2}"#,
                Some(32.0),
                "stride",
                "choose one",
            ),
            (
                r#"{"kind":"video","fps":4,"audio_seconds":1}"#,
                Some(32.0),
                "max_batch_frames",
                "frames only",
            ),
            (
                r#"{"kind":"video","fps":4}"#,
                Some(2.5),
                "max_batch_frames",
                "whole number",
            ),
        ] {
            let e = sampling(v(json), cap).unwrap_err();
            assert_eq!(e.field(), field, "{json}");
            assert!(e.to_string().contains(words), "{json}: {e}");
        }
    }
}
