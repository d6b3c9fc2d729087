//! Video (feature `video`): K frames of a clip, decoded with FFmpeg (`ffmpeg-next` 9), scaled
//! (shorter side), center-cropped, into one `u8` tensor, `[T, H, W, 3]` (NTHWC per clip) or
//! `[3, T, H, W]` (NCTHW).
//!
//! Frames are sampled uniformly (the frame shown at the middle of each of K equal spans of the
//! clip) or at given timestamps. Only what the samples need is decoded: the clip is decoded
//! forward from the start while the next sample is near, and a sample more than
//! [`VideoRecipe::seek_gap`] ahead is reached by seeking to the keyframe before it, so a long
//! clip costs K short decodes rather than the whole stream.
//!
//! Every failure is a [`MediaError`] naming the file: an unreadable or empty file, no video
//! stream, a clip that ends before a sample (a truncated file), a corrupt stream.

use std::path::Path;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Once;

use ffmpeg::util::frame::video::Video as Frame;
use ffmpeg_next as ffmpeg;

use crate::media::MediaError;
use crate::tensor::{DType, Tensor};

mod frames;
use frames::{FrameWriter, Picker};

/// Where the channels go.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum VideoLayout {
    /// `[T, H, W, 3]`.
    #[default]
    Nthwc,
    /// `[3, T, H, W]`.
    Ncthw,
}

/// Which frames to take.
#[derive(Clone, Debug, PartialEq)]
pub enum Sampling {
    /// `K` frames, at the middle of K equal spans of the clip.
    Uniform(usize),
    /// The frames shown at these times (seconds from the start, ascending).
    At(Vec<f64>),
    /// The frames shown at `(k + 0.5) / fps` seconds, as many as the clip's declared length
    /// holds (`floor(seconds * fps)`, at least one: the middle frame of a clip shorter than
    /// `1 / fps`) and at most `max`: a clip's length in frames follows its duration, for
    /// length-aware batches ([`VideoRecipe::planned_frames`] says how many before decoding).
    Rate {
        /// Frames per second of the clip.
        fps: f64,
        /// The most frames of one clip (a longer clip is cut there).
        max: usize,
    },
    /// `frames` consecutive frames of the stream, `stride` frames apart (a window of
    /// `(frames - 1) × stride + 1` stream frames): at a random start drawn anew every epoch
    /// (reproducible from the recipe's seed, the epoch and the file, so a resume redraws the
    /// same window) when `random`, else centered in the clip. A clip shorter than the window
    /// repeats its last frame.
    Window {
        /// Frames taken.
        frames: usize,
        /// Stream frames from one taken frame to the next (1: consecutive).
        stride: usize,
        /// A random start, new every epoch (training), instead of the centered window.
        random: bool,
    },
}

/// Sample, scale, crop.
#[derive(Clone, Debug, PartialEq)]
pub struct VideoRecipe {
    /// Which frames.
    pub sampling: Sampling,
    /// The shorter side after scaling.
    pub resize: u32,
    /// The side of the square center crop (`<= resize`).
    pub crop: u32,
    /// The tensor's layout.
    pub layout: VideoLayout,
    /// Decoder threads per clip (FFmpeg's frame threads). 0, the default, leaves them to the
    /// tuner: one per clip, the pipeline's workers decoding clips in parallel (the least CPU
    /// per clip), more where the workers cannot grow and cores sit idle (see
    /// [`Recipe::item_threads`](super::Recipe::item_threads)); a recipe used on its own, outside
    /// a pipeline, decodes with one. A number pins them.
    pub threads: usize,
    /// Seek, rather than decode forward, to a sample more than this many seconds ahead.
    pub seek_gap: f64,
    /// Let the decoder drop the frames no other frame references (B-frames, usually) while it
    /// walks toward a sample more than two frames away: such a frame can be neither sampled
    /// nor needed to decode one, so the frames are the same (tested) for less work. Default
    /// on.
    pub skip_unreferenced: bool,
    /// Draft mode: skip the in-loop deblocking filter (H.264, HEVC and the other codecs that
    /// honour FFmpeg's `skip_loop_filter`) on every frame decoded, the samples included:
    /// ~12% less CPU per clip than the exact decode on the benchmark's H.264 clips, and the
    /// samples are no longer bit-identical to a full decode, which the downscale to the
    /// output size mostly hides (mean difference 0.24 of 255, 99th percentile 3, on the
    /// benchmark's first batch; bounded in the tests; see `docs/performance.md`). Off by
    /// default.
    pub draft: bool,
    /// The user's seed of random windows (see [`item_seed`](super::item_seed)).
    pub seed: u64,
    /// The epoch whose windows to draw (set by [`for_epoch`](Self::for_epoch)).
    pub epoch: u64,
    /// What a file may declare (frame pixels, duration), checked before decoding; FFmpeg's
    /// decoder is also told the pixel limit (doubled: it counts padded buffers), so no frame it
    /// allocates can be far past it.
    pub limits: super::Limits,
}

impl Default for VideoRecipe {
    /// 8 uniform frames, shorter side 128, 112×112 crop, NTHWC, tuned threads, seek past 1 s
    /// gaps.
    fn default() -> Self {
        Self {
            sampling: Sampling::Uniform(8),
            resize: 128,
            crop: 112,
            layout: VideoLayout::Nthwc,
            threads: 0,
            seek_gap: 1.0,
            skip_unreferenced: true,
            draft: false,
            seed: 0,
            epoch: 0,
            limits: super::Limits::default(),
        }
    }
}

fn init() {
    static INIT: Once = Once::new();
    INIT.call_once(|| {
        let _ = ffmpeg::init();
        // Errors reach the caller as values; FFmpeg's own log would only repeat them.
        ffmpeg::util::log::set_level(ffmpeg::util::log::Level::Fatal);
    });
}

impl VideoRecipe {
    /// Checks the geometry, frames and threads (see [`Recipe`](super::Recipe)).
    pub fn validate(&self) -> Result<(), super::RecipeError> {
        use super::rules::check;
        check::video(self.frames(), self.threads)?;
        if let Sampling::Rate { fps, .. } = self.sampling {
            check::fps(fps)?;
        }
        if let Sampling::Window { stride, .. } = self.sampling {
            check::stride(stride)?;
        }
        check::crop(self.crop, self.resize, false)
    }

    /// The same recipe with the user's seed of random windows.
    pub fn with_seed(mut self, seed: u64) -> Self {
        self.seed = seed;
        self
    }

    /// The recipe of `epoch`: random windows are drawn anew every epoch.
    pub fn for_epoch(&self, epoch: u64) -> Self {
        Self {
            epoch,
            ..self.clone()
        }
    }

    /// Frames per clip (with [`Sampling::Rate`], the most: a clip has
    /// [`planned_frames`](Self::planned_frames)).
    pub fn frames(&self) -> usize {
        match &self.sampling {
            Sampling::Uniform(k) => *k,
            Sampling::At(ts) => ts.len(),
            Sampling::Rate { max, .. } => *max,
            Sampling::Window { frames, .. } => *frames,
        }
    }

    /// The frames a clip of `seconds` (its declared duration) yields.
    pub fn planned_frames(&self, seconds: f64) -> usize {
        match &self.sampling {
            Sampling::Rate { fps, max } => ((seconds * fps).floor() as usize).clamp(1, *max),
            _ => self.frames(),
        }
    }

    /// The sample times in the clip at `path` of `duration` seconds (0: unknown) whose
    /// stream runs at `rate` frames per second (0: unknown).
    fn targets(&self, duration: f64, rate: f64, path: &Path) -> Result<Vec<f64>, String> {
        Ok(match &self.sampling {
            Sampling::Uniform(k) => {
                if duration <= 0.0 {
                    return Err("the clip's duration is unknown".into());
                }
                (0..*k)
                    .map(|i| duration * (i as f64 + 0.5) / *k as f64)
                    .collect()
            }
            Sampling::At(ts) => ts.clone(),
            Sampling::Rate { fps, .. } => {
                if duration <= 0.0 {
                    return Err("the clip's duration is unknown".into());
                }
                let n = self.planned_frames(duration);
                if (duration * fps).floor() < 1.0 {
                    vec![duration / 2.0]
                } else {
                    (0..n).map(|k| (k as f64 + 0.5) / fps).collect()
                }
            }
            Sampling::Window {
                frames,
                stride,
                random,
            } => {
                if duration <= 0.0 || rate <= 0.0 {
                    return Err("the clip's duration or frame rate is unknown".into());
                }
                let total = ((duration * rate).round() as usize).max(1);
                let span = (frames - 1) * stride + 1;
                let room = total.saturating_sub(span);
                let start = if *random {
                    let mut rng =
                        flowgate_tuner::Rng::new(super::item_seed(self.seed, self.epoch, path));
                    ((rng.uniform() * (room + 1) as f64) as usize).min(room)
                } else {
                    room / 2
                };
                (0..*frames)
                    .map(|k| {
                        let f = (start + k * stride).min(total - 1);
                        (f as f64 + 0.5) / rate
                    })
                    .collect()
            }
        })
    }

    /// The shape of a clip's tensor of `frames` frames.
    fn shape_of(&self, frames: usize) -> [usize; 4] {
        let c = self.crop as usize;
        match self.layout {
            VideoLayout::Nthwc => [frames, c, c, 3],
            VideoLayout::Ncthw => [3, frames, c, c],
        }
    }

    /// The shape of one clip's tensor (with [`Sampling::Rate`], the longest).
    pub fn shape(&self) -> [usize; 4] {
        self.shape_of(self.frames())
    }

    /// Decodes the clips of one length-aware batch (see
    /// [`LengthBatches`](crate::sampler::LengthBatches); [`Sampling::Rate`] makes a clip's
    /// frames follow its length) into `[B, T, crop, crop, 3]` `u8` padded with zeros to the
    /// longest clip, with each clip's frames as a `[B]` `i64` tensor. A clip that fails is left
    /// out and returned with its error (the batch is `None` when every clip failed; in a
    /// stage, hand each error to [`skip_part`](crate::skip_part) so that it is counted). NTHWC
    /// only (the frames are the leading axis).
    pub fn load_batch(
        &self,
        paths: &[std::path::PathBuf],
    ) -> (Option<(Tensor, Tensor)>, Vec<MediaError>) {
        let refuse =
            (self.layout != VideoLayout::Nthwc).then_some("length-aware video batches are NTHWC");
        super::load_padded(paths, refuse, |p| self.load_with_length(p))
    }

    /// Decodes the sampled frames of the file at `path`.
    pub fn load(&self, path: &Path) -> Result<Tensor, MediaError> {
        self.load_with_length(path).map(|(t, _)| t)
    }

    /// Like [`load`](Self::load), with the number of frames (with [`Sampling::Rate`] it
    /// follows the clip's length).
    pub fn load_with_length(&self, path: &Path) -> Result<(Tensor, usize), MediaError> {
        self.load_threaded(path, self.threads)
    }

    /// [`load_with_length`](Self::load_with_length) with `threads` decoder threads instead of
    /// the recipe's own: what the tuner set on the knob of
    /// [`Recipe::item_threads`](super::Recipe::item_threads), for code that decodes with the
    /// recipe itself (a length-aware batch's clips).
    pub fn load_threaded(
        &self,
        path: &Path,
        threads: usize,
    ) -> Result<(Tensor, usize), MediaError> {
        let meta = std::fs::metadata(path).map_err(|source| MediaError::Read {
            path: path.to_path_buf(),
            source,
        })?;
        if meta.len() == 0 {
            return Err(MediaError::Empty {
                path: path.to_path_buf(),
            });
        }
        self.decode_file(path, threads)
    }

    /// Decodes a clip held in memory (an S3 object): FFmpeg reads it from a temporary file,
    /// removed afterwards. `path` names it in errors and gives the container's extension.
    pub fn decode(&self, bytes: &[u8], path: &Path) -> Result<Tensor, MediaError> {
        self.decode_with_length(bytes, path).map(|(t, _)| t)
    }

    /// Like [`decode`](Self::decode), with the number of frames.
    pub fn decode_with_length(
        &self,
        bytes: &[u8],
        path: &Path,
    ) -> Result<(Tensor, usize), MediaError> {
        self.decode_threaded(bytes, path, self.threads)
    }

    /// [`decode_with_length`](Self::decode_with_length) with `threads` decoder threads (see
    /// [`load_threaded`](Self::load_threaded)).
    pub fn decode_threaded(
        &self,
        bytes: &[u8],
        path: &Path,
        threads: usize,
    ) -> Result<(Tensor, usize), MediaError> {
        if bytes.is_empty() {
            return Err(MediaError::Empty {
                path: path.to_path_buf(),
            });
        }
        through_file(bytes, path, |tmp| self.decode_file(tmp, threads))
    }

    fn decode_file(&self, path: &Path, threads: usize) -> Result<(Tensor, usize), MediaError> {
        init();
        let decode_err = |e: ffmpeg::Error| MediaError::Decode {
            path: path.to_path_buf(),
            source: Box::new(e),
        };
        let geometry = |reason: String| MediaError::Geometry {
            path: path.to_path_buf(),
            reason,
        };
        // The recipe's own rules (cheap; a `Recipe` checked them already, a direct caller may not).
        self.validate().map_err(|e| geometry(e.to_string()))?;
        let max_pixels = self
            .limits
            .max_pixels
            .saturating_mul(2)
            .min(i64::MAX as u64)
            .to_string();
        let mut input = open_input(path, &max_pixels).map_err(decode_err)?;
        let stream = input
            .streams()
            .best(ffmpeg::media::Type::Video)
            .ok_or_else(|| geometry("no video stream".into()))?;
        let index = stream.index();
        let tb = f64::from(stream.time_base());
        let start = match stream.start_time() {
            ffmpeg::ffi::AV_NOPTS_VALUE => 0,
            t => t,
        };
        let duration = declared_duration(&input, &stream);
        if duration > self.limits.max_seconds {
            let m = self.limits.max_seconds as u64;
            return Err(MediaError::too_large(path, "seconds", duration as u64, m));
        }
        let rate = f64::from(stream.avg_frame_rate());
        let targets = self.targets(duration, rate, path).map_err(geometry)?;
        let mut out = Tensor::zeros(&self.shape_of(targets.len()), DType::U8);
        let mut ctx = ffmpeg::codec::context::Context::from_parameters(stream.parameters())
            .map_err(decode_err)?;
        if threads > 1 {
            ctx.set_threading(ffmpeg::codec::threading::Config {
                kind: ffmpeg::codec::threading::Type::Frame,
                count: threads,
                ..Default::default()
            });
        }
        // SAFETY: reads two plain fields of the context made from the stream's parameters.
        let (w, h) = unsafe { ((*ctx.as_ptr()).width, (*ctx.as_ptr()).height) };
        let pixels = u64::from(w.max(0).unsigned_abs()) * u64::from(h.max(0).unsigned_abs());
        if pixels > self.limits.max_pixels {
            let m = self.limits.max_pixels;
            return Err(MediaError::too_large(path, "pixels", pixels, m));
        }
        let codec = ffmpeg::codec::decoder::find(ctx.id())
            .ok_or_else(|| decode_err(ffmpeg::Error::DecoderNotFound))?;
        // FFmpeg's own check, for frames that disagree with the container's header. It counts
        // padded, aligned buffer sizes, so it gets twice the limit (still far below a bomb).
        let mut options = ffmpeg::Dictionary::new();
        options.set("max_pixels", &max_pixels);
        if self.draft {
            // No in-loop deblocking on any frame (see `draft`).
            options.set("skip_loop_filter", "all");
        }
        let mut decoder = ctx
            .decoder()
            .open_as_with(codec, options)
            .and_then(|o| o.video())
            .map_err(decode_err)?;
        let frame_time = if rate > 0.0 { 1.0 / rate } else { 0.1 };
        let mut writer = FrameWriter::new(self, out.bytes_mut(), targets.len());
        let mut pick = Picker {
            targets: &targets,
            next: 0,
            cur: Frame::empty(),
            prev: Frame::empty(),
            prev_t: None,
            last_t: f64::NEG_INFINITY,
            start,
            tb,
        };
        let mut sought = None; // the sample the last seek was for
        let mut skipping = false; // whether the decoder drops unreferenced frames now
        'scan: loop {
            let mut seek_to = None;
            for (s, packet) in input.packets() {
                if s.index() != index {
                    continue;
                }
                // A frame nothing references (a B-frame, usually) that is shown well before
                // the next sample can be neither sampled nor needed to decode one: the
                // decoder drops it unseen. Near the sample every frame is decoded again.
                if self.skip_unreferenced {
                    let shown = packet.pts().map(|p| (p - start) as f64 * tb);
                    let far = shown.is_some_and(|t| {
                        t + UNREFERENCED_MARGIN * frame_time < targets[pick.next] - FRAME_EPS
                    });
                    if far != skipping {
                        decoder.skip_frame(if far {
                            ffmpeg::codec::discard::Discard::NonReference
                        } else {
                            ffmpeg::codec::discard::Discard::Default
                        });
                        skipping = far;
                    }
                }
                decoder.send_packet(&packet).map_err(decode_err)?;
                pick.drain(&mut decoder, &mut writer, path)?;
                if pick.done() {
                    break 'scan;
                }
                // Seek at most once per sample: after a seek the decoder restarts at the
                // keyframe before it, which may still be far behind.
                let target = targets[pick.next];
                if target - pick.last_t > self.seek_gap && sought != Some(pick.next) {
                    sought = Some(pick.next);
                    seek_to = Some(target);
                    break;
                }
            }
            match seek_to {
                Some(t) => {
                    let us =
                        ((start as f64 * tb + t) * f64::from(ffmpeg::ffi::AV_TIME_BASE)) as i64;
                    input.seek(us, ..us).map_err(decode_err)?;
                    decoder.flush();
                    pick.prev_t = None; // what was decoded before the seek is not contiguous
                }
                None => break,
            }
        }
        if !pick.done() {
            decoder.send_eof().map_err(decode_err)?;
            pick.drain(&mut decoder, &mut writer, path)?;
            // The last frame is shown for one frame time past its start.
            while let Some(t) = pick.prev_t.filter(|_| !pick.done()) {
                if targets[pick.next] > t + 1.5 * frame_time {
                    break;
                }
                writer.write(&pick.prev, pick.next, path)?;
                pick.next += 1;
            }
        }
        if !pick.done() {
            return Err(MediaError::Decode {
                path: path.to_path_buf(),
                source: format!(
                    "the clip ends at {:.3} s, before the sample at {:.3} s \
                     (truncated, or shorter than its header says)",
                    pick.last_t.max(0.0),
                    targets[pick.next]
                )
                .into(),
            });
        }
        drop(writer); // its scaler and frame go back to this thread's scratch
        let n = targets.len();
        Ok((out, n))
    }
}

/// The duration a clip's video stream (else its container) declares, in seconds; 0 when
/// neither does.
fn declared_duration(input: &ffmpeg::format::context::Input, stream: &ffmpeg::Stream<'_>) -> f64 {
    if stream.duration() > 0 {
        stream.duration() as f64 * f64::from(stream.time_base())
    } else if input.duration() > 0 {
        input.duration() as f64 / f64::from(ffmpeg::ffi::AV_TIME_BASE)
    } else {
        0.0
    }
}

/// The duration the clip at `path` declares, in seconds, read from its container's header
/// (no frame is decoded); `None` when it declares none. Length-aware batches plan with it.
pub fn duration(path: &Path) -> Result<Option<f64>, MediaError> {
    init();
    let max_pixels = super::Limits::default()
        .max_pixels
        .saturating_mul(2)
        .to_string();
    let input = open_input(path, &max_pixels).map_err(|e| MediaError::Decode {
        path: path.to_path_buf(),
        source: Box::new(e),
    })?;
    let stream = input
        .streams()
        .best(ffmpeg::media::Type::Video)
        .ok_or_else(|| MediaError::Geometry {
            path: path.to_path_buf(),
            reason: "no video stream".into(),
        })?;
    let d = declared_duration(&input, &stream);
    Ok((d > 0.0).then_some(d))
}

/// [`duration`] of a clip held in memory (a tar shard's member, a Parquet cell); `path` names
/// it in errors (FFmpeg reads it from a temporary file, as decoding does).
pub fn duration_of_bytes(bytes: &[u8], path: &Path) -> Result<Option<f64>, MediaError> {
    if bytes.is_empty() {
        return Err(MediaError::Empty {
            path: path.to_path_buf(),
        });
    }
    through_file(bytes, path, duration)
}

/// Runs `f` on `bytes` written to a temporary file (FFmpeg opens files; `path`'s extension
/// keeps the format hint), removed afterwards; errors name `path`.
fn through_file<T>(
    bytes: &[u8],
    path: &Path,
    f: impl FnOnce(&Path) -> Result<T, MediaError>,
) -> Result<T, MediaError> {
    static N: AtomicU64 = AtomicU64::new(0);
    let ext = path.extension().and_then(|e| e.to_str()).unwrap_or("bin");
    let tmp = std::env::temp_dir().join(format!(
        "flowgate-clip-{}-{}.{ext}",
        std::process::id(),
        N.fetch_add(1, Ordering::Relaxed)
    ));
    let read_err = |source| MediaError::Read {
        path: path.to_path_buf(),
        source,
    };
    std::fs::write(&tmp, bytes).map_err(read_err)?;
    let result = f(&tmp);
    let _ = std::fs::remove_file(&tmp);
    result.map_err(|e| e.with_path(path))
}

/// Frames the decoders returned, process-wide (see [`frames_decoded`]).
static DECODED: AtomicU64 = AtomicU64::new(0);

/// Frames the video decoders of this process have decoded so far (all clips, all threads):
/// with the frames sampled, what decoding only what the samples need saves (`bench video`
/// prints both per clip).
pub fn frames_decoded() -> u64 {
    DECODED.load(Ordering::Relaxed)
}

/// A frame shown more than this many frame times before the next sample is not a candidate
/// for it: unreferenced ones are dropped undecoded (see `VideoRecipe::skip_unreferenced`).
const UNREFERENCED_MARGIN: f64 = 2.0;

/// Slack for frame times rounded by the container's time base.
const FRAME_EPS: f64 = 1e-3;

/// Opens `path` as `ffmpeg::format::input` does, but with the decoders of FFmpeg's stream probe
/// (`avformat_find_stream_info` decodes a few frames of each stream to learn its parameters)
/// told `max_pixels`: a frame larger than the header claims, or than the limit, then fails in
/// the probe instead of being allocated there (96 MB for one 8000x8000 frame), before the
/// limits are checked on the stream's parameters.
fn open_input(
    path: &Path,
    max_pixels: &str,
) -> Result<ffmpeg::format::context::Input, ffmpeg::Error> {
    use ffmpeg::ffi;
    use std::ffi::CString;
    use std::os::unix::ffi::OsStrExt;
    use std::ptr;
    let c_path =
        CString::new(path.as_os_str().as_bytes()).map_err(|_| ffmpeg::Error::InvalidData)?;
    let key = CString::new("max_pixels").expect("no NUL");
    let value = CString::new(max_pixels).expect("a number");
    // SAFETY: the FFmpeg calls are made as `ffmpeg::format::input` makes them, with one
    // options dictionary per stream, freed here after the probe (FFmpeg leaves in them the
    // options it did not use). On success the context is owned by the returned `Input`; on a
    // failed probe it is closed here.
    unsafe {
        let mut ctx = ptr::null_mut();
        match ffi::avformat_open_input(&mut ctx, c_path.as_ptr(), ptr::null_mut(), ptr::null_mut())
        {
            0 => {}
            e => return Err(ffmpeg::Error::from(e)),
        }
        let mut options: Vec<*mut ffi::AVDictionary> =
            vec![ptr::null_mut(); (*ctx).nb_streams as usize];
        for o in &mut options {
            ffi::av_dict_set(o, key.as_ptr(), value.as_ptr(), 0);
        }
        let r = ffi::avformat_find_stream_info(ctx, options.as_mut_ptr());
        for o in &mut options {
            ffi::av_dict_free(o);
        }
        if r >= 0 {
            Ok(ffmpeg::format::context::Input::wrap(ctx))
        } else {
            ffi::avformat_close_input(&mut ctx);
            Err(ffmpeg::Error::from(r))
        }
    }
}
