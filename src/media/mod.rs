//! Media: decoding what a [dataset](crate::dataset) reads into tensors.
//!
//! - [`image`](mod@image) (feature `image`): JPEG, PNG and WebP into `u8` tensors, with
//!   torchvision's resize-and-center-crop geometry.
//! - [`audio`](mod@audio) (feature `audio`): WAV, FLAC, MP3, Vorbis, AAC, ALAC into `f32`
//!   tensors, mono or planar channels, cropped or padded.
//!
//! - [`video`](mod@video) (feature `video`): K frames per clip with FFmpeg, scaled and
//!   center-cropped into `u8` tensors.
//!
//! - [`Recipe`]: a validated recipe of any modality, and the one seeding rule
//!   ([`item_seed`]) every path (Rust, pipeline files, Python) uses for augmentation.
//!
//! - `synth` (feature `synth`): the sample-dataset generator, for demos, benchmarks and tests.
//!
//! Errors are [`MediaError`]s, which always name the file.

#[cfg(feature = "audio")]
pub mod audio;
mod error;
#[cfg(feature = "image")]
pub mod image;
mod recipe;
pub(crate) mod rules;
#[cfg(feature = "synth")]
pub mod synth;
#[cfg(feature = "video")]
pub mod video;

pub use error::MediaError;

/// Image files' extensions (lower case, without the dot).
pub const IMAGE_EXTENSIONS: &[&str] = &["jpg", "jpeg", "png", "webp"];
/// Audio files' extensions.
pub const AUDIO_EXTENSIONS: &[&str] = &["flac", "wav", "mp3", "ogg", "m4a"];
/// Video files' extensions.
pub const VIDEO_EXTENSIONS: &[&str] = &["mp4", "mkv", "webm", "mov", "avi"];
pub use recipe::Recipe;
pub use rules::{item_seed, Limits, RecipeError};

/// A length-aware batch's clips loaded with `load` (each clip and its real length), padded
/// into one batch with their lengths ([`pad_longest`](crate::collate::pad_longest)); a clip
/// that fails is left out and returned with its error (no batch when every clip failed), or
/// with `refuse` every path fails with it.
#[cfg(any(feature = "audio", feature = "video"))]
pub(crate) fn load_padded(
    paths: &[std::path::PathBuf],
    refuse: Option<&str>,
    load: impl Fn(&std::path::Path) -> Result<(crate::Tensor, usize), MediaError>,
) -> (Option<(crate::Tensor, crate::Tensor)>, Vec<MediaError>) {
    if let Some(reason) = refuse {
        let e = paths.first().map(|p| MediaError::Geometry {
            path: p.clone(),
            reason: reason.into(),
        });
        return (None, e.into_iter().collect());
    }
    let mut clips = Vec::with_capacity(paths.len());
    let mut errors = Vec::new();
    for p in paths {
        match load(p) {
            Ok(c) => clips.push(c),
            Err(e) => errors.push(e),
        }
    }
    if clips.is_empty() {
        return (None, errors);
    }
    (Some(crate::collate::pad_longest(&clips)), errors)
}
