//! Media: finding files, and decoding them into tensors.
//!
//! - [`Files`]: a directory walk, a file list or explicit paths; seeded per-epoch shuffling and
//!   rank/world-size sharding.
//! - [`image`](mod@image) (feature `image`): JPEG, PNG and WebP into `u8` tensors, with
//!   torchvision's resize-and-center-crop geometry.
//! - [`audio`](mod@audio) (feature `audio`): WAV, FLAC, MP3, Vorbis, AAC, ALAC into `f32`
//!   tensors, mono or planar channels, cropped or padded.
//!
//! - [`video`](mod@video) (feature `video`): K frames per clip with FFmpeg, scaled and
//!   center-cropped into `u8` tensors.
//!
//! - [`synth`]: synthetic clips for sample datasets and tests.
//!
//! Errors are [`MediaError`]s, which always name the file.

#[cfg(feature = "audio")]
pub mod audio;
mod error;
mod files;
#[cfg(feature = "image")]
pub mod image;
pub mod synth;
#[cfg(feature = "video")]
pub mod video;

pub use error::MediaError;
pub use files::{Files, FolderLabels};

/// A stable hash of a path (FNV-1a), so augmentation depends on the file, not on the thread or
/// the order items arrive in.
pub(crate) fn path_hash(path: &std::path::Path) -> u64 {
    path.as_os_str()
        .as_encoded_bytes()
        .iter()
        .fold(0xcbf2_9ce4_8422_2325, |h, &b| {
            (h ^ u64::from(b)).wrapping_mul(0x0100_0000_01b3)
        })
}
