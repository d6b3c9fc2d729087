//! [`Blob`]: the bytes of one file or object, named by its path or key; [`Input`]: what a
//! decoder reads for one item. What the datasets produce and the decoders take, known to
//! neither.

use std::path::{Path, PathBuf};

/// What a decoder reads for one item: a local file, or a sample's field (bytes, named
/// `SHARD/KEY.EXT`).
#[derive(Debug)]
pub enum Input {
    /// A local file.
    Path(PathBuf),
    /// A field of a tar shard's sample or a Parquet row.
    Bytes(Blob),
}

/// The bytes of one file or object, with the path or key that names it in errors.
///
/// Local reads ([`Blob::read`]), S3 fetches (`flowgate::s3`, feature `s3`) and the
/// [`ByteCache`](crate::byte_cache::ByteCache) all produce blobs; the decoders take their bytes.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Blob {
    /// The file's path, or the object's key.
    pub path: PathBuf,
    /// The contents.
    pub bytes: Vec<u8>,
}

impl Blob {
    /// Reads a local file. An empty file is an error (`InvalidData`, naming the file):
    /// nothing decodes from zero bytes, and saying so here names the real cause.
    pub fn read(path: impl AsRef<Path>) -> std::io::Result<Self> {
        let path = path.as_ref();
        let bytes = std::fs::read(path).map_err(|e| {
            std::io::Error::new(e.kind(), format!("reading {}: {e}", path.display()))
        })?;
        if bytes.is_empty() {
            return Err(std::io::Error::new(
                std::io::ErrorKind::InvalidData,
                format!(
                    "{} is empty: nothing decodes from zero bytes",
                    path.display()
                ),
            ));
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
