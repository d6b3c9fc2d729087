//! The length a clip declares in its container's header, read without decoding any audio:
//! what length-aware batches plan with.

use std::io::Cursor;
use std::path::Path;

use symphonia::core::codecs::CODEC_TYPE_NULL;
use symphonia::core::formats::FormatOptions;
use symphonia::core::io::{MediaSource, MediaSourceStream};
use symphonia::core::meta::MetadataOptions;
use symphonia::core::probe::Hint;

use crate::media::MediaError;

/// The duration in seconds a file declares (its container's frame count over its rate: a FLAC
/// `STREAMINFO`, a WAV header, an MP4 track), read without decoding any audio; `None` when the
/// container does not say (a stream without a length). What length-aware batching
/// ([`LengthBatches`](crate::sampler::LengthBatches)) plans with.
pub fn duration(path: &Path) -> Result<Option<f64>, MediaError> {
    let file = std::fs::File::open(path).map_err(|source| MediaError::Read {
        path: path.to_path_buf(),
        source,
    })?;
    declared_duration(Box::new(file), path)
}

/// [`duration`] of a clip held in memory (a tar shard's member, a Parquet cell); `path`
/// names it in errors and gives the format hint by its extension.
pub fn duration_of_bytes(bytes: Vec<u8>, path: &Path) -> Result<Option<f64>, MediaError> {
    if bytes.is_empty() {
        return Err(MediaError::Empty {
            path: path.to_path_buf(),
        });
    }
    declared_duration(Box::new(Cursor::new(bytes)), path)
}

fn declared_duration(source: Box<dyn MediaSource>, path: &Path) -> Result<Option<f64>, MediaError> {
    let mss = MediaSourceStream::new(source, Default::default());
    let mut hint = Hint::new();
    if let Some(ext) = path.extension().and_then(|e| e.to_str()) {
        hint.with_extension(ext);
    }
    // A corrupt header may panic inside the probe (see `decode_source`): a typed error.
    let probed = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
        symphonia::default::get_probe().format(
            &hint,
            mss,
            &FormatOptions {
                enable_gapless: true,
                ..Default::default()
            },
            &MetadataOptions::default(),
        )
    }))
    .map_err(|_| MediaError::Decode {
        path: path.to_path_buf(),
        source: "the audio probe panicked on corrupt input".into(),
    })?
    .map_err(|e| MediaError::Decode {
        path: path.to_path_buf(),
        source: Box::new(e),
    })?;
    let track = probed
        .format
        .tracks()
        .iter()
        .find(|t| t.codec_params.codec != CODEC_TYPE_NULL)
        .ok_or_else(|| MediaError::Geometry {
            path: path.to_path_buf(),
            reason: "no audio track".into(),
        })?;
    let p = &track.codec_params;
    Ok(match (p.n_frames, p.sample_rate) {
        (Some(n), Some(rate)) if rate > 0 => Some(n as f64 / f64::from(rate)),
        _ => None,
    })
}
