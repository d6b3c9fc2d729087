//! 16-bit integer and 32-bit float PCM WAV at the recipe's rate, read directly: the RIFF
//! chunks parsed, only the window's bytes read, the samples converted straight into the output
//! planes. symphonia renders every PCM sample through its generic audio buffer, which measured
//! half of a WAV clip's cost (`docs/performance.md`). The samples are the same bits as
//! symphonia's path gives (the same conversions, the same mixing order; tested): any other WAV
//! (8/24-bit, A-law, µ-law, ADPCM, another rate, a data chunk longer than the file) returns
//! `None` and goes to symphonia, whose checks and errors then apply.

use std::path::Path;

use super::{f32_slice_mut, AudioRecipe, Channels};
use crate::media::MediaError;
use crate::tensor::{DType, Tensor};

/// What the header declares, for the formats read here.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(super) struct Header {
    pub(super) rate: u32,
    pub(super) channels: usize,
    pub(super) float: bool,
    /// Where the samples start, in bytes from the start of the file.
    pub(super) data_at: usize,
    /// Frames in the data chunk.
    pub(super) frames: u64,
}

impl Header {
    fn frame_bytes(&self) -> usize {
        self.channels * if self.float { 4 } else { 2 }
    }
}

thread_local! {
    /// The window's bytes of the WAV file being read (see `AudioRecipe::load_wav`).
    static WINDOW: std::cell::RefCell<Vec<u8>> = const { std::cell::RefCell::new(Vec::new()) };
}

/// A window buffer larger than this (a very long crop) is freed after use, not kept.
const KEEP_WINDOW: usize = 16 << 20;

/// How much of a file is read to find the data chunk: the header chunks of real WAVs (`fmt`,
/// `LIST`, `fact`, `bext`) fit; a data chunk later than this goes to symphonia.
pub(super) const HEAD: usize = 64 << 10;

fn le16(b: &[u8]) -> u16 {
    u16::from_le_bytes([b[0], b[1]])
}

fn le32(b: &[u8]) -> u32 {
    u32::from_le_bytes([b[0], b[1], b[2], b[3]])
}

/// Parses the chunks in `head` (the start of a file of `file_len` bytes); `None` unless it is
/// a WAV of a format read here whose data chunk lies within the file.
pub(super) fn parse(head: &[u8], file_len: u64) -> Option<Header> {
    if head.len() < 12 || &head[..4] != b"RIFF" || &head[8..12] != b"WAVE" {
        return None;
    }
    let mut fmt: Option<(u32, usize, bool)> = None;
    let mut at = 12usize;
    while at + 8 <= head.len() {
        let len = le32(&head[at + 4..]) as usize;
        let body = at + 8;
        match &head[at..at + 4] {
            b"fmt " => {
                let f = head.get(body..body + len.min(40))?;
                if f.len() < 16 {
                    return None;
                }
                let (tag, channels, rate) = (le16(f), le16(&f[2..]), le32(&f[4..]));
                let (align, bits) = (le16(&f[12..]), le16(&f[14..]));
                // WAVE_FORMAT_EXTENSIBLE: the sub-format's tag, and every bit valid.
                let tag = if tag == 0xFFFE {
                    if f.len() < 26 || le16(&f[18..]) != bits {
                        return None;
                    }
                    le16(&f[24..])
                } else {
                    tag
                };
                let float = match (tag, bits) {
                    (1, 16) => false,
                    (3, 32) => true,
                    _ => return None,
                };
                let channels = usize::from(channels);
                let width = if float { 4 } else { 2 };
                if channels == 0 || rate == 0 || usize::from(align) != channels * width {
                    return None;
                }
                fmt = Some((rate, channels, float));
            }
            b"data" => {
                let (rate, channels, float) = fmt?;
                let frame = channels * if float { 4 } else { 2 };
                let len = len as u64;
                if len % frame as u64 != 0 || body as u64 + len > file_len {
                    return None;
                }
                return Some(Header {
                    rate,
                    channels,
                    float,
                    data_at: body,
                    frames: len / frame as u64,
                });
            }
            _ => {}
        }
        at = body.checked_add(len)?.checked_add(len & 1)?;
    }
    None
}

impl AudioRecipe {
    /// What to read of a WAV whose first bytes are `head` (of a file of `len` bytes, at
    /// `path`): its header, the window's first frame and its frame count (the draw symphonia's
    /// path makes), after the declared rate, channels and length are checked against the
    /// limits; `None` for a file left to symphonia.
    fn wav_plan(
        &self,
        head: &[u8],
        len: u64,
        path: &Path,
    ) -> Option<Result<(Header, u64, usize), MediaError>> {
        let header = parse(head, len)?;
        if header.rate != self.rate {
            return None;
        }
        Some(
            self.check_declared_counts(header.rate, header.channels, Some(header.frames), path)
                .map(|()| {
                    let skip = self.window_start(Some(header.frames), self.samples, path);
                    let wanted = (header.frames - skip).min(self.samples as u64) as usize;
                    (header, skip, wanted)
                }),
        )
    }

    /// Reads a WAV file's window directly (see the module); `None`: not such a file.
    #[cfg(test)]
    pub(super) fn load_wav(&self, path: &Path) -> Option<Result<(Tensor, usize), MediaError>> {
        self.load_wav_as(path, true)
    }

    /// [`load_wav`](Self::load_wav); without `pad`, only the frames read (`[frames]`).
    pub(super) fn load_wav_as(
        &self,
        path: &Path,
        pad: bool,
    ) -> Option<Result<(Tensor, usize), MediaError>> {
        use std::io::Read;
        use std::os::unix::fs::FileExt;
        let mut file = std::fs::File::open(path).ok()?;
        let len = file.metadata().ok()?.len();
        let mut head = vec![0; HEAD.min(len as usize)];
        file.read_exact(&mut head).ok()?;
        let plan = self.wav_plan(&head, len, path)?;
        Some(plan.and_then(|(header, skip, wanted)| {
            let fb = header.frame_bytes();
            // The window's bytes, in a buffer each thread keeps (no allocation per clip).
            WINDOW.with(|cell| {
                let mut bytes = cell.borrow_mut();
                bytes.resize(wanted * fb, 0);
                file.read_exact_at(&mut bytes, header.data_at as u64 + skip * fb as u64)
                    .map_err(|source| MediaError::Read {
                        path: path.to_path_buf(),
                        source,
                    })?;
                let out = self.wav_samples(&header, &bytes, wanted, pad);
                if bytes.capacity() > KEEP_WINDOW {
                    *bytes = Vec::new();
                }
                Ok(out)
            })
        }))
    }

    /// [`load_wav`](Self::load_wav) for a file's contents in memory.
    #[cfg(test)]
    pub(super) fn decode_wav(
        &self,
        bytes: &[u8],
        path: &Path,
    ) -> Option<Result<(Tensor, usize), MediaError>> {
        self.decode_wav_as(bytes, path, true)
    }

    /// [`decode_wav`](Self::decode_wav); without `pad`, only the frames read.
    pub(super) fn decode_wav_as(
        &self,
        bytes: &[u8],
        path: &Path,
        pad: bool,
    ) -> Option<Result<(Tensor, usize), MediaError>> {
        let head = &bytes[..bytes.len().min(HEAD)];
        let plan = self.wav_plan(head, bytes.len() as u64, path)?;
        Some(plan.map(|(header, skip, wanted)| {
            let fb = header.frame_bytes();
            let from = header.data_at + skip as usize * fb;
            self.wav_samples(&header, &bytes[from..from + wanted * fb], wanted, pad)
        }))
    }

    /// `frames` frames of interleaved samples into the recipe's planes, zero past them (planes
    /// of the window; without `pad`, of `frames`).
    fn wav_samples(
        &self,
        header: &Header,
        data: &[u8],
        frames: usize,
        pad: bool,
    ) -> (Tensor, usize) {
        let ch = header.channels;
        let cap = if pad { self.samples } else { frames };
        let mut t = match self.channels {
            Channels::Mono => Tensor::for_overwrite(&[cap], DType::F32),
            Channels::Keep => Tensor::for_overwrite(&[ch, cap], DType::F32),
        };
        let out = f32_slice_mut(&mut t);
        // symphonia's conversions (`f32::from_sample`): i16 / 32768, f32 as is.
        let sample = |frame: &[u8], c: usize| -> f32 {
            if header.float {
                f32::from_le_bytes([
                    frame[4 * c],
                    frame[4 * c + 1],
                    frame[4 * c + 2],
                    frame[4 * c + 3],
                ])
            } else {
                f32::from(i16::from_le_bytes([frame[2 * c], frame[2 * c + 1]])) / 32_768.0
            }
        };
        let frames_in = data.chunks_exact(header.frame_bytes()).take(frames);
        match self.channels {
            Channels::Mono => {
                let n = ch as f32;
                for (d, f) in out[..frames].iter_mut().zip(frames_in) {
                    // The order of `Dest::put`: the first channel, plus each other, over n.
                    let mut s = sample(f, 0);
                    for c in 1..ch {
                        s += sample(f, c);
                    }
                    *d = if ch > 1 { s / n } else { s };
                }
                out[frames..].fill(0.0);
            }
            Channels::Keep => {
                for (i, f) in frames_in.enumerate() {
                    for c in 0..ch {
                        out[c * cap + i] = sample(f, c);
                    }
                }
                for plane in out.chunks_exact_mut(cap) {
                    plane[frames..].fill(0.0);
                }
            }
        }
        (t, frames)
    }
}
