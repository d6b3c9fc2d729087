//! The rules every media path shares: the seeding rule of augmentation ([`item_seed`]), the
//! checks a recipe must pass ([`RecipeError`]; see [`Recipe`](super::Recipe)), and the
//! [`Limits`] no file may exceed, whatever its header says.

use std::path::Path;

use crate::hash::{fnv1a, FNV_OFFSET};

/// Mixes the user's seed with the epoch (a multiplicative hash keeps seeds 1, 2, … from
/// colliding with epochs 1, 2, …).
const SEED_MIX: u64 = 0x9E37_79B9_7F4A_7C15;

/// The seed of one item's augmentation: the rule every path uses (see the module docs).
pub fn item_seed(seed: u64, epoch: u64, path: &Path) -> u64 {
    seed.wrapping_mul(SEED_MIX) ^ epoch ^ path_hash(path)
}

/// A stable hash of a path (FNV-1a), so augmentation depends on the file, not on the thread or
/// the order items arrive in.
fn path_hash(path: &Path) -> u64 {
    fnv1a(FNV_OFFSET, path.as_os_str().as_encoded_bytes())
}

/// What no file may declare, checked from its header before anything sized by the header is
/// allocated: past a limit the item fails with [`MediaError::TooLarge`](super::MediaError),
/// counted by the failure budget like any bad file, and the pipeline goes on. A decoder never
/// trusts a header for an allocation these do not bound.
///
/// The defaults are far above real training data and far below what would take a process
/// down: a 2 KB JPEG claiming 65,500 × 65,500 pixels would otherwise ask for 12 GB.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct Limits {
    /// Pixels of one image or video frame. Default 2^27 (≈134 megapixels, 11,585² — larger
    /// than any camera's photos): an RGB decode buffer of at most 384 MiB per decoding thread.
    pub max_pixels: u64,
    /// An audio stream's sample rate, in Hz. Default 768,000 (the highest rate audio hardware
    /// records).
    pub max_sample_rate: u32,
    /// An audio stream's channels. Default 64 (beyond any surround or ambisonic format
    /// training data uses).
    pub max_channels: u32,
    /// A clip's declared duration, in seconds (audio and video). Default 14,400 (4 hours).
    pub max_seconds: f64,
}

impl Default for Limits {
    fn default() -> Self {
        Self {
            max_pixels: 1 << 27,
            max_sample_rate: 768_000,
            max_channels: 64,
            max_seconds: 4.0 * 3600.0,
        }
    }
}

/// The largest side of a recipe's output (a crop, a resize): 16,384 pixels.
pub(crate) const MAX_SIDE: u32 = 1 << 14;
/// The most frames sampled per clip.
pub(crate) const MAX_FRAMES: usize = 4096;
/// The most decoder threads per clip.
pub(crate) const MAX_THREADS: usize = 256;

/// A recipe no item can be decoded with: which field, and why.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
#[error("{field} {message}")]
pub struct RecipeError {
    field: &'static str,
    message: String,
}

impl RecipeError {
    pub(crate) fn new(field: &'static str, message: impl Into<String>) -> Self {
        Self {
            field,
            message: message.into(),
        }
    }

    /// The field at fault, as the pipeline files and the Python loaders name it (`crop`,
    /// `scale`, `rate`, …).
    pub fn field(&self) -> &'static str {
        self.field
    }

    /// What is wrong with it (`must be in 1..=256 (resize)`).
    pub fn message(&self) -> &str {
        &self.message
    }
}

/// The checks, independent of which decoders this build has (the pipeline-file checker runs
/// them on any file, so a build without some decoders leaves some unused).
#[allow(dead_code)]
pub(crate) mod check {
    use super::RecipeError;

    use super::{MAX_FRAMES, MAX_SIDE, MAX_THREADS};

    /// The square output side: at least 1, at most [`MAX_SIDE`], and (for the evaluation
    /// geometry, resize then center-crop) at most the resized shorter side.
    pub(crate) fn crop(crop: u32, resize: u32, random: bool) -> Result<(), RecipeError> {
        if crop > MAX_SIDE {
            return Err(RecipeError::new(
                "crop",
                format!("must be at most {MAX_SIDE}, not {crop}"),
            ));
        }
        if !random && (resize == 0 || resize > MAX_SIDE) {
            // A resize of 0 names itself, not the crop against an empty range.
            return Err(RecipeError::new(
                "resize",
                format!("must be in 1..={MAX_SIDE}, not {resize}"),
            ));
        }
        if crop == 0 || (!random && crop > resize) {
            let most = if random {
                String::new()
            } else {
                format!("={resize} (resize)")
            };
            return Err(RecipeError::new(
                "crop",
                format!("must be in 1..{most}, not {crop}"),
            ));
        }
        Ok(())
    }

    /// A random resized crop's ranges: area fraction in (0, 1], aspect ratio positive.
    pub(crate) fn random_crop(scale: (f64, f64), ratio: (f64, f64)) -> Result<(), RecipeError> {
        if !(0.0 < scale.0 && scale.0 <= scale.1 && scale.1 <= 1.0) {
            return Err(RecipeError::new(
                "scale",
                format!("must be (lo, hi) with 0 < lo <= hi <= 1, not {scale:?}"),
            ));
        }
        if !(0.0 < ratio.0 && ratio.0 <= ratio.1 && ratio.1.is_finite()) {
            return Err(RecipeError::new(
                "ratio",
                format!("must be (lo, hi) with 0 < lo <= hi, not {ratio:?}"),
            ));
        }
        Ok(())
    }

    /// Normalisation's statistics: finite means, finite positive standard deviations.
    pub(crate) fn normalize(mean: &[f32; 3], std: &[f32; 3]) -> Result<(), RecipeError> {
        if !mean.iter().all(|m| m.is_finite()) {
            return Err(RecipeError::new(
                "normalize",
                format!("must have finite means, not {mean:?}"),
            ));
        }
        if !std.iter().all(|&s| s.is_finite() && s > 0.0) {
            return Err(RecipeError::new(
                "normalize",
                format!("must have finite standard deviations above 0, not {std:?}"),
            ));
        }
        Ok(())
    }

    /// Samples per clip for a window of `seconds` at `rate` Hz: at least one, at a rate
    /// within the default [`Limits`](super::Limits), for at most its longest clip.
    pub(crate) fn audio_samples(rate: u32, seconds: f64) -> Result<usize, RecipeError> {
        let limits = super::Limits::default();
        if rate == 0 || rate > limits.max_sample_rate {
            return Err(RecipeError::new(
                "rate",
                format!("must be in 1..={} Hz, not {rate}", limits.max_sample_rate),
            ));
        }
        if seconds > limits.max_seconds {
            return Err(RecipeError::new(
                "seconds",
                format!("must be at most {}, not {seconds}", limits.max_seconds),
            ));
        }
        let samples = (seconds * f64::from(rate)).round();
        if !(seconds.is_finite() && samples >= 1.0) {
            return Err(RecipeError::new(
                "seconds",
                format!("must give at least one sample at {rate} Hz, not {seconds}"),
            ));
        }
        Ok(samples as usize)
    }

    /// Frames per clip (at least one, at most [`MAX_FRAMES`]) and decoder threads (at most
    /// [`MAX_THREADS`]; 0 leaves them to the tuner).
    pub(crate) fn video(frames: usize, threads: usize) -> Result<(), RecipeError> {
        if frames == 0 || frames > MAX_FRAMES {
            return Err(RecipeError::new(
                "frames",
                format!("must be in 1..={MAX_FRAMES}, not {frames}"),
            ));
        }
        if threads > MAX_THREADS {
            return Err(RecipeError::new(
                "threads",
                format!("must be in 0..={MAX_THREADS} (0: tuned), not {threads}"),
            ));
        }
        Ok(())
    }

    /// Stream frames between a window's frames: 1..=1,000.
    pub(crate) fn stride(stride: usize) -> Result<(), RecipeError> {
        if stride == 0 || stride > 1000 {
            return Err(RecipeError::new(
                "stride",
                format!("must be in 1..=1000, not {stride}"),
            ));
        }
        Ok(())
    }

    /// Frames per second of a clip's length-aware sampling: above 0, at most 1,000.
    pub(crate) fn fps(fps: f64) -> Result<(), RecipeError> {
        if !(fps.is_finite() && fps > 0.0 && fps <= 1000.0) {
            return Err(RecipeError::new(
                "fps",
                format!("must be above 0 and at most 1000, not {fps}"),
            ));
        }
        Ok(())
    }
}
