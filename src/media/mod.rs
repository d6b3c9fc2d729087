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
//! - [`Recipe`]: a validated recipe of any modality, and the one seeding rule
//!   ([`item_seed`]) every path (Rust, pipeline files, Python) uses for augmentation.
//!
//! - `synth` (feature `synth`): the sample-dataset generator, for demos, benchmarks and tests.
//!
//! Errors are [`MediaError`]s, which always name the file.

#[cfg(feature = "audio")]
pub mod audio;
mod error;
mod files;
#[cfg(feature = "image")]
pub mod image;
mod recipe;
pub(crate) mod rules;
#[cfg(feature = "synth")]
pub mod synth;
#[cfg(feature = "video")]
pub mod video;

pub use error::MediaError;
pub use files::{Files, FolderLabels};
pub use recipe::Recipe;
pub use rules::{item_seed, Limits, RecipeError};
