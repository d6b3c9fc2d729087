//! [`Blob`]: the bytes of one file or object, named by its path or key.

use std::path::{Path, PathBuf};

use crate::media::MediaError;

/// The bytes of one file or object, with the path or key that names it in errors.
///
/// Local reads ([`Blob::read`]), S3 fetches (`flowgate::s3`, feature `s3`) and the
/// [`ByteCache`](crate::cache::ByteCache) all produce blobs; the decoders take their bytes.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Blob {
    /// The file's path, or the object's key.
    pub path: PathBuf,
    /// The contents.
    pub bytes: Vec<u8>,
}

impl Blob {
    /// Reads a local file. An empty file is an error ([`MediaError::Empty`]): nothing decodes
    /// from zero bytes, and saying so here names the real cause.
    pub fn read(path: impl AsRef<Path>) -> Result<Self, MediaError> {
        let path = path.as_ref();
        let bytes = std::fs::read(path).map_err(|source| MediaError::Read {
            path: path.to_path_buf(),
            source,
        })?;
        if bytes.is_empty() {
            return Err(MediaError::Empty {
                path: path.to_path_buf(),
            });
        }
        Ok(Self {
            path: path.to_path_buf(),
            bytes,
        })
    }

    /// The size of the contents in bytes (for byte budgets: `.measure(Blob::len)`).
    pub fn len(&self) -> usize {
        self.bytes.len()
    }

    /// Whether the contents are empty.
    pub fn is_empty(&self) -> bool {
        self.bytes.is_empty()
    }
}
