//! Audio: WAV, FLAC, MP3, Ogg Vorbis, AAC and ALAC (in MP4/M4A) into `f32` tensors, decoded
//! with `symphonia`, mixed to mono (or kept as channels), cropped or zero-padded to a fixed
//! number of samples. Decoding stops as soon as the crop is full, so a 10 s clip cropped to 4 s
//! costs 4 s of decoding. Encoder delay and padding are trimmed where the container says so
//! (gapless mode).
//!
//! A file at another rate than the recipe's is resampled (band-limited, FFT-based, with
//! `rubato`), decoding only what the crop needs at the file's rate.

use std::io::Cursor;
use std::path::Path;

use symphonia::core::audio::{AudioBuffer, AudioBufferRef, Signal};
use symphonia::core::codecs::{DecoderOptions, CODEC_TYPE_NULL};
use symphonia::core::conv::FromSample;
use symphonia::core::errors::Error as SymError;
use symphonia::core::formats::FormatOptions;
use symphonia::core::io::{MediaSource, MediaSourceStream};
use symphonia::core::meta::MetadataOptions;
use symphonia::core::probe::Hint;
use symphonia::core::sample::Sample;

use crate::media::MediaError;
use crate::tensor::{DType, Tensor};

/// Mono clips (each an `f32` window and its real length in samples) as one batch padded with
/// zeros to the longest: `[B, T]` `f32` and the lengths as `[B]` `i64`.
pub fn pad_clips(clips: &[(Tensor, usize)]) -> (Tensor, Tensor) {
    crate::collate::pad_longest(clips)
}

/// Mono, or every channel.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum Channels {
    /// The mean of the channels: shape `[samples]`.
    #[default]
    Mono,
    /// Every channel: shape `[channels, samples]` (planar).
    Keep,
}

/// Decode, mix, crop or pad.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct AudioRecipe {
    /// The sample rate the files must have (Hz).
    pub rate: u32,
    /// Samples per clip after cropping or zero-padding.
    pub samples: usize,
    /// Mono or every channel.
    pub channels: Channels,
    /// Crop a window of `samples` at a random offset (uniform over the clip, drawn from
    /// `seed` and the file's path) instead of from the start: training's random crop. A clip
    /// no longer than the window, or whose container does not declare its length, is taken
    /// from the start. The frames before the window are decoded and dropped.
    pub random_crop: bool,
    /// The user's seed of the random crop (see [`item_seed`](super::item_seed)).
    pub seed: u64,
    /// The epoch whose window to draw (set by [`for_epoch`](Self::for_epoch)).
    pub epoch: u64,
    /// What a file may declare (sample rate, channels, duration), checked before decoding.
    pub limits: super::Limits,
}

impl Default for AudioRecipe {
    /// 16 kHz mono, 4 s (64,000 samples).
    fn default() -> Self {
        Self {
            rate: 16_000,
            samples: 64_000,
            channels: Channels::Mono,
            random_crop: false,
            seed: 0,
            epoch: 0,
            limits: super::Limits::default(),
        }
    }
}

impl AudioRecipe {
    /// The same recipe with the user's crop seed `seed`.
    pub fn with_seed(mut self, seed: u64) -> Self {
        self.seed = seed;
        self
    }

    /// The same recipe drawing `epoch`'s window.
    pub fn for_epoch(mut self, epoch: u64) -> Self {
        self.epoch = epoch;
        self
    }

    /// A recipe of `seconds` at `rate` Hz (mono, cropped from the start), checked.
    pub fn with_seconds(rate: u32, seconds: f64) -> Result<Self, super::RecipeError> {
        let samples = super::rules::check::audio_samples(rate, seconds)?;
        Ok(Self {
            rate,
            samples,
            ..Self::default()
        })
    }

    /// Checks the rate and window (see [`Recipe`](super::Recipe)).
    pub fn validate(&self) -> Result<(), super::RecipeError> {
        super::rules::check::audio_samples(
            self.rate,
            self.samples as f64 / f64::from(self.rate.max(1)),
        )
        .map(|_| ())
    }

    /// Like [`load`](Self::load), with the number of real (not padded) samples: the lengths
    /// vector of a batch of clips shorter than the window.
    pub fn load_with_length(&self, path: &Path) -> Result<(Tensor, usize), MediaError> {
        self.load_as(path, true)
    }

    /// A clip of `input` as [`load_with_length`](Self::load_with_length) or
    /// [`decode_with_length`](Self::decode_with_length) give it, but not padded to the window:
    /// `[n]` (channels kept: `[C, n]`) and `n`, for batches padded to their longest clip (a
    /// short clip in a long window costs no zeros). A file at another rate than the recipe's
    /// comes resampled in the window's length, as padded.
    pub fn clip_with_length(
        &self,
        input: crate::blob::Input,
    ) -> Result<(Tensor, usize), MediaError> {
        match input {
            crate::blob::Input::Path(p) => self.load_as(&p, false),
            crate::blob::Input::Bytes(b) => self.decode_as(b.bytes, &b.path, false),
        }
    }

    fn load_as(&self, path: &Path, pad: bool) -> Result<(Tensor, usize), MediaError> {
        let r = match self.load_wav_as(path, pad) {
            Some(r) => r,
            None => self
                .open(path)
                .and_then(|source| self.decode_source_as(source, path, pad)),
        };
        not_silent(r, path)
    }

    /// Decodes the clips of one length-aware batch (see
    /// [`LengthBatches`](crate::sampler::LengthBatches)) into `[B, T]` `f32` padded with zeros
    /// to the longest clip (`T` at most the recipe's window, which crops longer ones), with
    /// their real lengths as a `[B]` `i64` tensor. A clip that fails is left out of the batch
    /// and returned with its error (the batch is `None` when every clip failed; in a stage,
    /// hand each error to [`skip_part`](crate::skip_part) so that it is counted). Mono only:
    /// with [`Channels::Keep`] each row would be a clip's planes, so that is refused.
    pub fn load_batch(
        &self,
        paths: &[std::path::PathBuf],
    ) -> (Option<(Tensor, Tensor)>, Vec<MediaError>) {
        let refuse = (self.channels != Channels::Mono).then_some("length-aware batches are mono");
        super::load_padded(paths, refuse, |p| self.load_as(p, false))
    }

    /// Reads and decodes `path`, reading only as much of the file as the crop needs.
    pub fn load(&self, path: &Path) -> Result<Tensor, MediaError> {
        self.load_with_length(path).map(|(t, _)| t)
    }

    fn open(&self, path: &Path) -> Result<Box<dyn MediaSource>, MediaError> {
        let read_err = |source| MediaError::Read {
            path: path.to_path_buf(),
            source,
        };
        let file = std::fs::File::open(path).map_err(read_err)?;
        if file.metadata().map_err(read_err)?.len() == 0 {
            return Err(MediaError::Empty {
                path: path.to_path_buf(),
            });
        }
        Ok(Box::new(file))
    }

    /// Decodes the contents of `path` (named in errors).
    pub fn decode(&self, bytes: Vec<u8>, path: &Path) -> Result<Tensor, MediaError> {
        self.decode_with_length(bytes, path).map(|(t, _)| t)
    }

    /// Like [`decode`](Self::decode), with the number of real (not padded) samples.
    pub fn decode_with_length(
        &self,
        bytes: Vec<u8>,
        path: &Path,
    ) -> Result<(Tensor, usize), MediaError> {
        self.decode_as(bytes, path, true)
    }

    fn decode_as(
        &self,
        bytes: Vec<u8>,
        path: &Path,
        pad: bool,
    ) -> Result<(Tensor, usize), MediaError> {
        if bytes.is_empty() {
            return Err(MediaError::Empty {
                path: path.to_path_buf(),
            });
        }
        let r = match self.decode_wav_as(&bytes, path, pad) {
            Some(r) => r,
            None => self.decode_source_as(Box::new(Cursor::new(bytes)), path, pad),
        };
        not_silent(r, path)
    }

    /// Decodes, turning a panic inside a codec into a typed error: symphonia's probes panic
    /// on some corrupt input (an ADTS length underflow, found by `fuzz/`), and a caller of
    /// this function is owed an error, not an unwinding thread.
    #[cfg(test)]
    fn decode_source(
        &self,
        source: Box<dyn MediaSource>,
        path: &Path,
    ) -> Result<(Tensor, usize), MediaError> {
        self.decode_source_as(source, path, true)
    }

    fn decode_source_as(
        &self,
        source: Box<dyn MediaSource>,
        path: &Path,
        pad: bool,
    ) -> Result<(Tensor, usize), MediaError> {
        std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
            self.decode_unguarded(source, path, pad)
        }))
        .unwrap_or_else(|payload| {
            let msg = payload
                .downcast_ref::<&str>()
                .map(|s| (*s).to_owned())
                .or_else(|| payload.downcast_ref::<String>().cloned())
                .unwrap_or_else(|| "a panic".into());
            Err(MediaError::Decode {
                path: path.to_path_buf(),
                source: format!("the audio decoder panicked on corrupt input: {msg}").into(),
            })
        })
    }

    /// The header's rate, channels and length against [`Limits`](super::Limits): buffers are
    /// sized from them (the window at the file's rate, a plane per channel), so they are
    /// checked before anything is allocated.
    fn check_declared(
        &self,
        params: &symphonia::core::codecs::CodecParameters,
        rate: u32,
        path: &Path,
    ) -> Result<(), MediaError> {
        let channels = params.channels.map_or(1, |c| c.count());
        self.check_declared_counts(rate, channels, params.n_frames, path)
    }

    /// The first frame of the window of `span` frames taken from a clip of `n_frames`: 0, or
    /// with `random_crop` a uniform draw from the seed, the epoch and the path (a clip no
    /// longer than the window, or of unknown length, starts at 0).
    fn window_start(&self, n_frames: Option<u64>, span: usize, path: &Path) -> u64 {
        match (self.random_crop, n_frames) {
            (true, Some(n)) if n > span as u64 => {
                let mut rng =
                    flowgate_tuner::Rng::new(super::item_seed(self.seed, self.epoch, path));
                rng.next_u64() % (n - span as u64 + 1)
            }
            _ => 0,
        }
    }

    /// [`check_declared`](Self::check_declared) of a rate, a channel count and a length.
    fn check_declared_counts(
        &self,
        rate: u32,
        channels: usize,
        n_frames: Option<u64>,
        path: &Path,
    ) -> Result<(), MediaError> {
        let l = &self.limits;
        if rate > l.max_sample_rate {
            let (v, m) = (u64::from(rate), u64::from(l.max_sample_rate));
            return Err(MediaError::too_large(path, "sample rate", v, m));
        }
        if channels as u64 > u64::from(l.max_channels) {
            let m = u64::from(l.max_channels);
            return Err(MediaError::too_large(path, "channels", channels as u64, m));
        }
        if let Some(n) = n_frames {
            let seconds = n as f64 / f64::from(rate);
            if seconds > l.max_seconds {
                let m = l.max_seconds as u64;
                return Err(MediaError::too_large(path, "seconds", seconds as u64, m));
            }
        }
        Ok(())
    }

    /// Decodes the window; `pad`: planes of the window's length, zero past the frames
    /// decoded; else (at the recipe's rate) planes of the frames the stream declares.
    fn decode_unguarded(
        &self,
        source: Box<dyn MediaSource>,
        path: &Path,
        pad: bool,
    ) -> Result<(Tensor, usize), MediaError> {
        let decode_err = |e: SymError| MediaError::Decode {
            path: path.to_path_buf(),
            source: Box::new(e),
        };
        let geometry = |reason: String| MediaError::Geometry {
            path: path.to_path_buf(),
            reason,
        };
        let mss = MediaSourceStream::new(source, Default::default());
        let mut hint = Hint::new();
        if let Some(ext) = path.extension().and_then(|e| e.to_str()) {
            hint.with_extension(ext);
        }
        let fmt_opts = FormatOptions {
            enable_gapless: true,
            ..Default::default()
        };
        let probed = symphonia::default::get_probe()
            .format(&hint, mss, &fmt_opts, &MetadataOptions::default())
            .map_err(decode_err)?;
        let mut format = probed.format;
        let track = format
            .tracks()
            .iter()
            .find(|t| t.codec_params.codec != CODEC_TYPE_NULL)
            .ok_or_else(|| geometry("no audio track".into()))?;
        let (track_id, params) = (track.id, track.codec_params.clone());
        let rate = params.sample_rate.unwrap_or(self.rate);
        if rate == 0 {
            return Err(geometry("a sample rate of 0 Hz".into()));
        }
        self.check_declared(&params, rate, path)?;
        // At another rate, decode what the crop needs at the file's rate (plus the resampler's
        // look-ahead), then resample.
        let span = if rate == self.rate {
            self.samples
        } else {
            (self.samples as u64 * u64::from(rate)).div_ceil(u64::from(self.rate)) as usize
        };
        let cap = span + if rate == self.rate { 0 } else { RESAMPLE_CHUNK };
        // A random window: the frames before it are decoded and dropped.
        let skip = self.window_start(params.n_frames, span, path);
        let mut decoder = symphonia::default::get_codecs()
            .make(&params, &DecoderOptions::default())
            .map_err(decode_err)?;
        let n_ch = params.channels.map_or(1, |c| c.count()).max(1);
        let out_ch = match self.channels {
            Channels::Mono => 1,
            Channels::Keep => n_ch,
        };
        // Never more than the stream declares: a codec's last block may carry padding past it
        // (seen with FLAC), which must not become samples.
        let wanted = params
            .n_frames
            .map_or(cap, |n| (n.saturating_sub(skip).min(cap as u64)) as usize);
        // Unpadded (at the recipe's rate), the planes hold what the stream declares.
        let cap = if pad || rate != self.rate {
            cap
        } else {
            wanted
        };
        // Planar output, filled as frames arrive (mono: one plane, shape `[samples]`).
        let mut t = match self.channels {
            // Decoded frames overwrite the start of every plane; the rest is zeroed below.
            Channels::Mono => Tensor::for_overwrite(&[cap], DType::F32),
            Channels::Keep => Tensor::for_overwrite(&[out_ch, cap], DType::F32),
        };
        let mut filled = 0usize;
        let mut ended_early = false;
        let mut to_skip = skip;
        while filled < wanted {
            let packet = match format.next_packet() {
                Ok(p) => p,
                Err(SymError::IoError(e)) if e.kind() == std::io::ErrorKind::UnexpectedEof => {
                    ended_early = true;
                    break;
                }
                Err(e) => return Err(decode_err(e)),
            };
            if packet.track_id() != track_id {
                continue;
            }
            let decoded = decoder.decode(&packet).map_err(decode_err)?;
            let dropped = decoded
                .frames()
                .min(usize::try_from(to_skip).unwrap_or(usize::MAX));
            to_skip -= dropped as u64;
            let take = (decoded.frames() - dropped).min(wanted - filled);
            if take == 0 {
                continue;
            }
            let out = f32_slice_mut(&mut t);
            let to = Dest {
                out,
                from: dropped,
                at: filled,
                take,
                cap,
                channels: self.channels,
                out_ch,
            };
            match decoded {
                AudioBufferRef::U8(b) => to.put(&b),
                AudioBufferRef::U16(b) => to.put(&b),
                AudioBufferRef::U24(b) => to.put(&b),
                AudioBufferRef::U32(b) => to.put(&b),
                AudioBufferRef::S8(b) => to.put(&b),
                AudioBufferRef::S16(b) => to.put(&b),
                AudioBufferRef::S24(b) => to.put(&b),
                AudioBufferRef::S32(b) => to.put(&b),
                AudioBufferRef::F32(b) => to.put(&b),
                AudioBufferRef::F64(b) => to.put(&b),
            }
            filled += take;
        }
        // Zero padding past the decoded frames (and any plane the stream did not fill).
        let planes_filled = f32_slice_mut(&mut t);
        for plane in planes_filled.chunks_exact_mut(cap) {
            plane[filled..].fill(0.0);
        }
        if ended_early {
            if let Some(declared) = params.n_frames {
                if (filled as u64) < declared.saturating_sub(skip).min(cap as u64) {
                    return Err(geometry(format!(
                        "truncated: the stream ended after {filled} of {declared} frames"
                    )));
                }
            }
        }
        if rate == self.rate {
            return Ok((t, filled));
        }
        let real = ((filled as u64 * u64::from(self.rate)).div_ceil(u64::from(rate)) as usize)
            .min(self.samples);
        let planes: Vec<&[f32]> = f32_slice(&t).chunks_exact(cap).collect();
        resample(&planes, filled, rate, self.rate, self.samples)
            .map_err(|e| geometry(format!("resampling {rate} Hz to {} Hz: {e}", self.rate)))
            .map(|out| match self.channels {
                Channels::Mono => (out.reshaped(&[self.samples]), real),
                Channels::Keep => (out, real),
            })
    }
}

/// Where a decoded packet's frames go: its frames `from..from + take` at frame `at` of `out`
/// (planes of `cap`).
struct Dest<'a> {
    out: &'a mut [f32],
    from: usize,
    at: usize,
    take: usize,
    cap: usize,
    channels: Channels,
    out_ch: usize,
}

impl Dest<'_> {
    /// Converts (as symphonia's `SampleBuffer` does) straight from the decoder's planes,
    /// mixing to mono or keeping channels: one pass, no interleaved copy.
    fn put<S: Sample>(self, b: &AudioBuffer<S>)
    where
        f32: FromSample<S>,
    {
        let ch = b.spec().channels.count().max(1);
        let (from, at, take) = (self.from, self.at, self.take);
        match self.channels {
            Channels::Mono => {
                let dst = &mut self.out[at..at + take];
                for (d, &s) in dst.iter_mut().zip(&b.chan(0)[from..from + take]) {
                    *d = f32::from_sample(s);
                }
                if ch > 1 {
                    for c in 1..ch {
                        for (d, &s) in dst.iter_mut().zip(&b.chan(c)[from..from + take]) {
                            *d += f32::from_sample(s);
                        }
                    }
                    let n = ch as f32;
                    for d in dst.iter_mut() {
                        *d /= n;
                    }
                }
            }
            Channels::Keep => {
                for c in 0..self.out_ch {
                    let dst = &mut self.out[c * self.cap + at..c * self.cap + at + take];
                    if c < ch {
                        for (d, &s) in dst.iter_mut().zip(&b.chan(c)[from..from + take]) {
                            *d = f32::from_sample(s);
                        }
                    } else {
                        // A packet with fewer channels than the stream declared: silence.
                        dst.fill(0.0);
                    }
                }
            }
        }
    }
}

fn f32_slice(t: &Tensor) -> &[f32] {
    let bytes = t.bytes();
    if bytes.is_empty() {
        return &[];
    }
    // SAFETY: as in `f32_slice_mut`.
    unsafe { std::slice::from_raw_parts(bytes.as_ptr().cast::<f32>(), bytes.len() / 4) }
}

fn f32_slice_mut(t: &mut Tensor) -> &mut [f32] {
    let bytes = t.bytes_mut();
    // An empty tensor's pointer is dangling, not aligned for `f32`.
    if bytes.is_empty() {
        return &mut [];
    }
    // SAFETY: tensor buffers are 64-byte aligned, and an F32 tensor's length is a multiple of
    // 4; every bit pattern is a valid f32.
    unsafe { std::slice::from_raw_parts_mut(bytes.as_mut_ptr().cast::<f32>(), bytes.len() / 4) }
}

/// One rule for a clip that holds no samples (a valid header, an empty data chunk): a failed
/// item naming it, in fixed windows and length-aware batches alike (skipped and counted, or
/// fatal, as the failure budget says), never a window of zeros in one mode and a batch of
/// length 0 in the other.
fn not_silent(
    r: Result<(Tensor, usize), MediaError>,
    path: &Path,
) -> Result<(Tensor, usize), MediaError> {
    match r {
        Ok((_, 0)) => Err(MediaError::Decode {
            path: path.to_path_buf(),
            source: "the clip holds no audio samples".into(),
        }),
        r => r,
    }
}

mod duration;
mod resample;
#[cfg(test)]
mod tests;
mod wav;

pub use duration::{duration, duration_of_bytes};
use resample::{resample, RESAMPLE_CHUNK};
