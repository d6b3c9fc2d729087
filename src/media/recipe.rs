//! [`Recipe`]: how items of one modality become tensors, checked once, seeded by one rule.
//!
//! Every path that decodes media — the Rust API, pipeline files (`flowgate::spec`) and the
//! Python loaders — builds a [`Recipe`] from a modality's recipe ([`ImageRecipe`],
//! [`AudioRecipe`], [`VideoRecipe`]). Building it validates the geometry, once, with the rules
//! below (the pipeline-file checker uses the same rules, to name the offending key and line);
//! the per-item path does not check again.
//!
//! # Seeding
//!
//! Random augmentation (image crops and flips, audio windows) of an item in an epoch draws
//! from one generator, seeded by [`item_seed`]`(seed, epoch, path)`:
//! `seed × 0x9E3779B97F4A7C15 ⊕ epoch ⊕ fnv1a(path)`. So the same seed, epoch and file give
//! the same augmentation whichever thread decodes it and in whatever order (an exact resume
//! redraws what the interrupted run would have), and every epoch draws anew. `seed` is the
//! user's (the Python loaders' `seed`, a pipeline file's `decode.seed`, a recipe's `seed`
//! field); the epoch is set by [`Recipe::for_epoch`].
//!
//! [`ImageRecipe`]: super::image::ImageRecipe
//! [`AudioRecipe`]: super::audio::AudioRecipe
//! [`VideoRecipe`]: super::video::VideoRecipe

use std::path::Path;

use crate::blob::Blob;
use crate::media::MediaError;
use crate::tensor::Tensor;

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

/// The rules, independent of which decoders this build has (the pipeline-file checker runs
/// them on any file, so a build without some decoders leaves some unused).
#[allow(dead_code)]
pub(crate) mod rules {
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

/// A validated decode recipe of any modality, and the seed of its augmentation.
///
/// ```
/// # #[cfg(feature = "image")] {
/// use flowgate::media::{image::ImageRecipe, Recipe};
///
/// let recipe = Recipe::image(ImageRecipe::train(224))?.with_seed(7);
/// let epoch_3 = recipe.for_epoch(3); // crops and flips of epoch 3
/// assert!(Recipe::image(ImageRecipe { crop: 300, ..ImageRecipe::default() }).is_err());
/// # }
/// # Ok::<(), flowgate::media::RecipeError>(())
/// ```
#[derive(Clone, Debug)]
pub struct Recipe {
    kind: Kind,
}

#[derive(Clone, Debug)]
enum Kind {
    #[cfg(feature = "image")]
    Image(crate::media::image::ImageRecipe),
    #[cfg(feature = "audio")]
    Audio(crate::media::audio::AudioRecipe),
    #[cfg(feature = "video")]
    Video(crate::media::video::VideoRecipe),
}

// A build with no decoder at all has no recipe kinds: every method is unreachable there.
#[cfg_attr(
    not(any(feature = "image", feature = "audio", feature = "video")),
    allow(unreachable_code, unused_variables)
)]
impl Recipe {
    /// An image recipe, validated.
    #[cfg(feature = "image")]
    pub fn image(r: crate::media::image::ImageRecipe) -> Result<Self, RecipeError> {
        r.validate()?;
        Ok(Self {
            kind: Kind::Image(r),
        })
    }

    /// An audio recipe, validated.
    #[cfg(feature = "audio")]
    pub fn audio(r: crate::media::audio::AudioRecipe) -> Result<Self, RecipeError> {
        r.validate()?;
        Ok(Self {
            kind: Kind::Audio(r),
        })
    }

    /// A video recipe, validated.
    #[cfg(feature = "video")]
    pub fn video(r: crate::media::video::VideoRecipe) -> Result<Self, RecipeError> {
        r.validate()?;
        Ok(Self {
            kind: Kind::Video(r),
        })
    }

    /// The same recipe with the user's augmentation seed `seed` (see the module docs).
    pub fn with_seed(self, seed: u64) -> Self {
        let kind = match self.kind {
            #[cfg(feature = "image")]
            Kind::Image(r) => Kind::Image(r.with_seed(seed)),
            #[cfg(feature = "audio")]
            Kind::Audio(r) => Kind::Audio(r.with_seed(seed)),
            #[cfg(feature = "video")]
            Kind::Video(r) => Kind::Video(r),
        };
        Self { kind }
    }

    /// The recipe of `epoch`: random crops, flips and windows are drawn anew every epoch (and
    /// the same for the same seed, epoch and file).
    pub fn for_epoch(&self, epoch: u64) -> Recipe {
        let kind = match &self.kind {
            #[cfg(feature = "image")]
            Kind::Image(r) => Kind::Image(r.for_epoch(epoch)),
            #[cfg(feature = "audio")]
            Kind::Audio(r) => Kind::Audio(r.for_epoch(epoch)),
            #[cfg(feature = "video")]
            Kind::Video(r) => Kind::Video(r.clone()),
            #[allow(unreachable_patterns)]
            _ => unreachable!("a build without decoders has no recipes"),
        };
        Self { kind }
    }

    /// Reads and decodes the file at `path`.
    pub fn load(&self, path: &Path) -> Result<Tensor, MediaError> {
        match &self.kind {
            #[cfg(feature = "image")]
            Kind::Image(r) => r.load_checked(path),
            #[cfg(feature = "audio")]
            Kind::Audio(r) => r.load(path),
            #[cfg(feature = "video")]
            Kind::Video(r) => r.load(path),
            #[allow(unreachable_patterns)]
            _ => unreachable!("a build without decoders has no recipes"),
        }
    }

    /// Decodes the bytes of `blob` (a fetched object).
    pub fn decode(&self, blob: Blob) -> Result<Tensor, MediaError> {
        match &self.kind {
            #[cfg(feature = "image")]
            Kind::Image(r) => r.decode_checked(&blob.bytes, &blob.path),
            #[cfg(feature = "audio")]
            Kind::Audio(r) => r.decode(blob.bytes, &blob.path),
            #[cfg(feature = "video")]
            Kind::Video(r) => r.decode(&blob.bytes, &blob.path),
            #[allow(unreachable_patterns)]
            _ => unreachable!("a build without decoders has no recipes"),
        }
    }
}
