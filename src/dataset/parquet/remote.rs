//! Ranged reads of a Parquet object on S3: the footer first, then each row group's column
//! chunks, every request pinned to the version whose footer was read.

use std::ops::Range;
use std::sync::Arc;

use ::parquet::errors::ParquetError;
use ::parquet::file::reader::{ChunkReader, Length};
use bytes::{Buf, Bytes};
use flowgate_actors::error::PipelineError;
use parking_lot::Mutex;

use crate::s3::{Version, S3};

/// How much of a file's end is fetched to read its footer at once.
const TAIL: u64 = 64 << 10;
/// How much a read at an offset no fetched range covers fetches.
const READAHEAD: u64 = 1 << 20;

/// One Parquet object, at the version it was listed at (or whose footer was read, when
/// the listing names none): every read carries `If-Match` with its entity tag, so an object rewritten on the store while it is read is an
/// error (HTTP 412) naming it, never row groups of one version read at the offsets of
/// the other's footer.
pub(super) struct Object {
    s3: S3,
    key: String,
    size: u64,
    version: Version,
}

impl Object {
    pub(super) fn new(s3: S3, key: String, size: u64, etag: Option<String>) -> Self {
        Self {
            s3,
            key,
            size,
            version: Version::new(etag),
        }
    }

    /// A reader holding the object's last 64 KiB (its footer, mostly).
    pub(super) fn footer(&self) -> Result<Ranged, PipelineError> {
        let tail = self.size.saturating_sub(TAIL)..self.size;
        self.ranges(vec![tail]).map_err(PipelineError::config)
    }

    /// A reader holding `ranges` (fetched now; adjacent ones in one GET), fetching
    /// whatever else is asked for when asked.
    pub(super) fn ranges(&self, mut ranges: Vec<Range<u64>>) -> Result<Ranged, String> {
        ranges.sort_by_key(|r| r.start);
        let mut merged: Vec<Range<u64>> = Vec::new();
        for r in ranges {
            match merged.last_mut() {
                Some(last) if r.start <= last.end => last.end = last.end.max(r.end),
                _ => merged.push(r),
            }
        }
        let reader = Ranged {
            s3: self.s3.clone(),
            key: self.key.clone(),
            size: self.size,
            version: self.version.clone(),
            held: Arc::new(Mutex::new(Vec::new())),
        };
        for r in merged {
            reader.fetch(r).map_err(|e| e.to_string())?;
        }
        Ok(reader)
    }
}

/// Byte ranges of one object, fetched by ranged GETs and held in memory.
#[derive(Clone)]
pub(super) struct Ranged {
    s3: S3,
    key: String,
    size: u64,
    version: Version,
    held: Arc<Mutex<Vec<(u64, Bytes)>>>,
}

impl Ranged {
    fn fetch(&self, r: Range<u64>) -> Result<Bytes, ParquetError> {
        let r = r.start..r.end.min(self.size);
        let blob = futures::executor::block_on(self.s3.get_range_version(
            &self.key,
            r.clone(),
            &self.version,
        ))
        .map_err(|e| ParquetError::External(Box::new(e)))?;
        if blob.bytes.len() as u64 != r.end - r.start {
            return Err(ParquetError::General(format!(
                "s3://{}/{}: asked for bytes {}..{}, got {}",
                self.s3.bucket(),
                self.key,
                r.start,
                r.end,
                blob.bytes.len()
            )));
        }
        let bytes = Bytes::from(blob.bytes);
        self.held.lock().push((r.start, bytes.clone()));
        Ok(bytes)
    }

    /// The held bytes from `start` on, if a fetched range covers `start..start + len`.
    fn held(&self, start: u64, len: u64) -> Option<Bytes> {
        self.held.lock().iter().find_map(|(at, b)| {
            let end = at + b.len() as u64;
            (start >= *at && start + len <= end).then(|| b.slice((start - at) as usize..))
        })
    }
}

impl Length for Ranged {
    fn len(&self) -> u64 {
        self.size
    }
}

impl ChunkReader for Ranged {
    type T = bytes::buf::Reader<Bytes>;

    fn get_read(&self, start: u64) -> Result<Self::T, ParquetError> {
        let bytes = match self.held(start, 1) {
            Some(b) => b,
            None => self.fetch(start..start.saturating_add(READAHEAD))?,
        };
        Ok(bytes.reader())
    }

    fn get_bytes(&self, start: u64, length: usize) -> Result<Bytes, ParquetError> {
        match self.held(start, length as u64) {
            Some(b) => Ok(b.slice(..length)),
            None => self.fetch(start..start + length as u64),
        }
    }
}
