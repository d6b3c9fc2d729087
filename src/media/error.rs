//! The error of a failed media item.

use std::path::PathBuf;

/// Why one file could not become a tensor. Every variant names the file.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum MediaError {
    /// The file could not be read.
    #[error("reading {path}: {source}")]
    Read {
        /// The file.
        path: PathBuf,
        /// The I/O error.
        source: std::io::Error,
    },
    /// The file is empty.
    #[error("{path}: the file is empty")]
    Empty {
        /// The file.
        path: PathBuf,
    },
    /// The bytes are not a supported, valid image (truncated, corrupt, another format).
    #[error("decoding {path}: {source}")]
    Decode {
        /// The file.
        path: PathBuf,
        /// What the decoder said.
        source: Box<dyn std::error::Error + Send + Sync>,
    },
    /// The file declares more than a [`Limits`](super::Limits) allows (a decompression bomb,
    /// or a file too large to decode safely); nothing sized by the declaration was allocated.
    #[error("{path}: {what} {value} is over the limit of {limit}")]
    TooLarge {
        /// The file.
        path: PathBuf,
        /// What was declared (`pixels`, `sample rate`, `channels`, `seconds`).
        what: &'static str,
        /// The declared value.
        value: u64,
        /// The limit.
        limit: u64,
    },
    /// The image decoded but cannot be resized as asked.
    #[error("{path}: {reason}")]
    Geometry {
        /// The file.
        path: PathBuf,
        /// What is wrong.
        reason: String,
    },
}

impl MediaError {
    /// A `what` of `value` past its `limit`, in the file at `path`.
    #[cfg_attr(
        not(any(feature = "image", feature = "audio", feature = "video")),
        allow(dead_code)
    )]
    pub(crate) fn too_large(
        path: &std::path::Path,
        what: &'static str,
        value: u64,
        limit: u64,
    ) -> Self {
        MediaError::TooLarge {
            path: path.to_path_buf(),
            what,
            value,
            limit,
        }
    }

    /// The file the error is about.
    pub fn path(&self) -> &std::path::Path {
        match self {
            MediaError::Read { path, .. }
            | MediaError::Empty { path }
            | MediaError::Decode { path, .. }
            | MediaError::TooLarge { path, .. }
            | MediaError::Geometry { path, .. } => path,
        }
    }

    /// The same error, naming `path` instead (a temporary copy's error, named after the
    /// original).
    pub fn with_path(mut self, path: &std::path::Path) -> Self {
        match &mut self {
            MediaError::Read { path: p, .. }
            | MediaError::Empty { path: p }
            | MediaError::Decode { path: p, .. }
            | MediaError::TooLarge { path: p, .. }
            | MediaError::Geometry { path: p, .. } => *p = path.to_path_buf(),
        }
        self
    }
}
