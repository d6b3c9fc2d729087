//! What a user writes to say how an item is decoded: the raw arguments every front end takes
//! (a Python loader's keywords, a pipeline file's `[decode]` table, a Rust struct), each with a
//! named default, and the one place their rules turn them into a validated [`Recipe`](super::Recipe) (`recipe.rs`): the
//! audio window under length-aware batches, the random crop of training images, the choice of
//! a video's frame sampling. A front end deserializes these (or fills them) and calls
//! [`MediaArgs::recipe`]; it writes no rule of its own, so every front end refuses the same
//! arguments with the same words.
//!
//! The types exist in every build, so a file naming a modality the build lacks still reads,
//! and the error names the missing feature.

use serde::{Deserialize, Serialize};

use flowgate_actors::limits;

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
        let inner = flowgate_actors::limits::in_words(&e.into_inner().to_string());
        if path == "." {
            inner
        } else {
            format!("{path}: {inner}")
        }
    })
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
}

mod recipe;
#[cfg(test)]
mod tests;
