//! Media: decoding bytes (or a local file) into tensors. Media knows no sources: what to read
//! is the dataset's, and the loader hands each item's bytes here.
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
//! Errors are [`MediaError`]s, which always name the file.

pub mod args;
#[cfg(feature = "audio")]
pub mod audio;
mod error;
#[cfg(feature = "image")]
pub mod image;
mod recipe;
pub(crate) mod rules;
#[cfg(feature = "video")]
pub mod video;

pub use error::MediaError;

pub use crate::extensions::{AUDIO_EXTENSIONS, IMAGE_EXTENSIONS, VIDEO_EXTENSIONS};
pub use args::MediaArgs;
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
    load: impl Fn(&std::path::Path) -> Result<(crate::tensor::Tensor, usize), MediaError>,
) -> (
    Option<(crate::tensor::Tensor, crate::tensor::Tensor)>,
    Vec<MediaError>,
) {
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
