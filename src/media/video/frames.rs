//! Decoded frames to samples: [`Picker`] chooses the frame shown at each sample time,
//! [`FrameWriter`] scales it and writes its center crop into the sample's slot.

use std::cell::RefCell;
use std::path::Path;
use std::sync::atomic::Ordering;

use ffmpeg::format::Pixel;
use ffmpeg::software::scaling::{context::Context as Scaler, flag::Flags};
use ffmpeg::util::frame::video::Video as Frame;
use ffmpeg_next as ffmpeg;

use super::{VideoLayout, VideoRecipe, DECODED, FRAME_EPS};
use crate::media::MediaError;

/// Chooses, for each sample time, the frame shown then: the last frame that starts at or
/// before it. Decoded frames alternate between two buffers (no copies): `prev` holds the
/// latest candidate while `cur` receives the next frame.
pub(super) struct Picker<'a> {
    pub(super) targets: &'a [f64],
    pub(super) next: usize,
    pub(super) cur: Frame,
    pub(super) prev: Frame,
    /// The time of the frame in `prev`, if it is a candidate.
    pub(super) prev_t: Option<f64>,
    /// The time of the last decoded frame.
    pub(super) last_t: f64,
    pub(super) start: i64,
    pub(super) tb: f64,
}

impl Picker<'_> {
    pub(super) fn done(&self) -> bool {
        self.next == self.targets.len()
    }

    /// Takes every frame the decoder has ready.
    pub(super) fn drain(
        &mut self,
        decoder: &mut ffmpeg::decoder::Video,
        writer: &mut FrameWriter<'_>,
        path: &Path,
    ) -> Result<(), MediaError> {
        while !self.done() && decoder.receive_frame(&mut self.cur).is_ok() {
            DECODED.fetch_add(1, Ordering::Relaxed);
            let ts = self.cur.timestamp().or(self.cur.pts()).unwrap_or(0);
            let t = (ts - self.start) as f64 * self.tb;
            self.last_t = t;
            while !self.done() {
                if t <= self.targets[self.next] + FRAME_EPS {
                    // A candidate for the next sample; a later frame may still be closer.
                    std::mem::swap(&mut self.cur, &mut self.prev);
                    self.prev_t = Some(t);
                    break;
                }
                // This frame starts after the sample: the sample is the frame before it (or
                // this one, if the stream starts after the sample time).
                let shown = if self.prev_t.is_some() {
                    &self.prev
                } else {
                    &self.cur
                };
                writer.write(shown, self.next, path)?;
                self.next += 1;
            }
        }
        Ok(())
    }
}

/// A scaler made for frames of one format and size scaled to one size.
type KeyedScaler = (Scaler, (Pixel, u32, u32, u32, u32));

/// A decoding thread's scaler and RGB frame, kept from clip to clip: clips of one dataset
/// mostly share their format and size, and a scaler costs filter tables and buffers to make.
#[derive(Default)]
struct Scratch {
    scaler: Option<KeyedScaler>,
    rgb: Option<Frame>,
}

thread_local! {
    static SCRATCH: RefCell<Scratch> = RefCell::new(Scratch::default());
}

/// Scales a decoded frame and writes its crop into one sample's slot.
pub(super) struct FrameWriter<'a> {
    recipe: &'a VideoRecipe,
    scaler: Option<KeyedScaler>,
    rgb: Frame,
    out: &'a mut [u8],
    frames: usize,
}

impl Drop for FrameWriter<'_> {
    fn drop(&mut self) {
        let rgb = std::mem::replace(&mut self.rgb, Frame::empty());
        let scaler = self.scaler.take();
        let _ = SCRATCH.try_with(|s| {
            *s.borrow_mut() = Scratch {
                scaler,
                rgb: Some(rgb),
            }
        });
    }
}

impl<'a> FrameWriter<'a> {
    /// A writer of `frames` samples into `out`, with this thread's scaler and frame buffer.
    pub(super) fn new(recipe: &'a VideoRecipe, out: &'a mut [u8], frames: usize) -> Self {
        let kept = SCRATCH
            .try_with(|s| std::mem::take(&mut *s.borrow_mut()))
            .unwrap_or_default();
        Self {
            recipe,
            scaler: kept.scaler,
            rgb: kept.rgb.unwrap_or_else(Frame::empty),
            out,
            frames,
        }
    }

    pub(super) fn write(
        &mut self,
        frame: &Frame,
        slot: usize,
        path: &Path,
    ) -> Result<(), MediaError> {
        let (w, h) = (frame.width(), frame.height());
        if w == 0 || h == 0 {
            return Err(MediaError::Geometry {
                path: path.to_path_buf(),
                reason: "a frame of size 0".into(),
            });
        }
        let r = self.recipe.resize;
        let (sw, sh) = if w <= h {
            (r, ((u64::from(r) * u64::from(h)) / u64::from(w)) as u32)
        } else {
            (((u64::from(r) * u64::from(w)) / u64::from(h)) as u32, r)
        };
        let key = (frame.format(), w, h, sw, sh);
        if self.scaler.as_ref().is_none_or(|(_, k)| *k != key) {
            let scaler = Scaler::get(frame.format(), w, h, Pixel::RGB24, sw, sh, Flags::BILINEAR)
                .map_err(|e| MediaError::Decode {
                path: path.to_path_buf(),
                source: Box::new(e),
            })?;
            self.scaler = Some((scaler, key));
        }
        let (scaler, _) = self.scaler.as_mut().expect("set above");
        scaler
            .run(frame, &mut self.rgb)
            .map_err(|e| MediaError::Decode {
                path: path.to_path_buf(),
                source: Box::new(e),
            })?;
        let c = self.recipe.crop as usize;
        // torchvision's center-crop offsets: round((size - crop) / 2), half to even.
        let offset =
            |size: u32| (f64::from(size - self.recipe.crop) / 2.0).round_ties_even() as usize;
        let (x0, y0) = (offset(sw), offset(sh));
        let stride = self.rgb.stride(0);
        let data = self.rgb.data(0);
        match self.recipe.layout {
            VideoLayout::Nthwc => {
                let slot_len = c * c * 3;
                let dst = &mut self.out[slot * slot_len..(slot + 1) * slot_len];
                for y in 0..c {
                    let src = &data[(y0 + y) * stride + x0 * 3..][..c * 3];
                    dst[y * c * 3..(y + 1) * c * 3].copy_from_slice(src);
                }
            }
            VideoLayout::Ncthw => {
                let plane = self.frames * c * c;
                for y in 0..c {
                    let src = &data[(y0 + y) * stride + x0 * 3..][..c * 3];
                    for ch in 0..3 {
                        let row = ch * plane + slot * c * c + y * c;
                        for (x, d) in self.out[row..row + c].iter_mut().enumerate() {
                            *d = src[x * 3 + ch];
                        }
                    }
                }
            }
        }
        Ok(())
    }
}
