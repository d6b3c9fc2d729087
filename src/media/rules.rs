//! The rules every media path shares: the seeding rule of augmentation ([`item_seed`]) and
//! the checks a recipe must pass ([`RecipeError`]); see [`Recipe`](super::Recipe).

use std::path::Path;

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
    path.as_os_str()
        .as_encoded_bytes()
        .iter()
        .fold(0xcbf2_9ce4_8422_2325, |h, &b| {
            (h ^ u64::from(b)).wrapping_mul(0x0100_0000_01b3)
        })
}

/// A recipe no item can be decoded with: which field, and why.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
#[error("{field} {message}")]
pub struct RecipeError {
    field: &'static str,
    message: String,
}

impl RecipeError {
    fn new(field: &'static str, message: impl Into<String>) -> Self {
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

    /// The square output side: at least 1, and (for the evaluation geometry, resize then
    /// center-crop) at most the resized shorter side.
    pub(crate) fn crop(crop: u32, resize: u32, random: bool) -> Result<(), RecipeError> {
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

    /// Normalisation's standard deviations: positive.
    pub(crate) fn normalize_std(std: &[f32; 3]) -> Result<(), RecipeError> {
        if std.iter().any(|&s| s.is_nan() || s <= 0.0) {
            return Err(RecipeError::new(
                "std",
                format!("must be positive, not {std:?}"),
            ));
        }
        Ok(())
    }

    /// Samples per clip for a window of `seconds` at `rate` Hz: at least one.
    pub(crate) fn audio_samples(rate: u32, seconds: f64) -> Result<usize, RecipeError> {
        if rate == 0 {
            return Err(RecipeError::new("rate", "must be at least 1 Hz"));
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

    /// Frames per clip and decoder threads: at least one each.
    pub(crate) fn video(frames: usize, threads: usize) -> Result<(), RecipeError> {
        if frames == 0 {
            return Err(RecipeError::new("frames", "must be at least 1"));
        }
        if threads == 0 {
            return Err(RecipeError::new("threads", "must be at least 1"));
        }
        Ok(())
    }
}
