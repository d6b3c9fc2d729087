//! Images: JPEG, PNG and WebP into `u8` tensors, the way torchvision's
//! `Resize(resize)` + `CenterCrop(crop)` does it.
//!
//! Decoding uses the `image` crate (zune-jpeg for JPEG); resizing uses `fast_image_resize`'s
//! SIMD convolution with the same antialiased bilinear filter as Pillow (which torchvision uses
//! on PIL images). Only the source window that survives the crop is resized: a crop box in
//! source coordinates gives exactly the pixels of resize-then-crop, for less work.
//!
//! Files: `geometry` (sizes, offsets, windows), `jpeg` (the decoders), `pixels` (flips,
//! normalisation, the CHW transpose), `tests`.
//!
//! Geometry, as torchvision: the shorter side becomes `resize` and the longer
//! `int(resize * long / short)`; the crop offsets are `round((size - crop) / 2)` with Python's
//! round-half-to-even.

use std::cell::RefCell;
use std::path::Path;

use fast_image_resize::images::Image;
use fast_image_resize::{FilterType, PixelType, ResizeAlg, ResizeOptions, Resizer};

use crate::media::MediaError;
use crate::tensor::{DType, Tensor};

mod geometry;
mod jpeg;
mod pixels;
#[cfg(test)]
mod tests;

use geometry::{crop_offset, draft_denom, needed, random_window, resized, Plan, Rect};
pub use jpeg::jpeg_decoder;
use jpeg::{decode_rgb, has_jpeg_end};
use pixels::{flip_row, hwc_to_chw, normalize_into};

/// Where the channel axis goes.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum Layout {
    /// Channels first: `3 × H × W` per image (PyTorch's convention).
    #[default]
    Nchw,
    /// Channels last: `H × W × 3` per image (what decoders produce; no transpose).
    Nhwc,
}

/// Decode, resize the shorter side, center-crop (or, for training, a random resized crop and
/// a random flip), lay out, optionally normalise.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct ImageRecipe {
    /// The shorter side after resizing (evaluation geometry; unused with `random_crop`).
    pub resize: u32,
    /// The side of the square output: the center crop, or the random crop's size.
    pub crop: u32,
    /// The output layout.
    pub layout: Layout,
    /// Training geometry: torchvision's `RandomResizedCrop(crop, scale, ratio)` instead of
    /// resize-and-center-crop.
    pub random_crop: Option<RandomCrop>,
    /// Flip horizontally with probability ½ (torchvision's `RandomHorizontalFlip`).
    pub flip: bool,
    /// `f32` output, `(x / 255 - mean[c]) / std[c]`, instead of `u8`.
    pub normalize: Option<Normalize>,
    /// The user's seed of the random crop and flip (see [`item_seed`](super::item_seed): the
    /// same seed, epoch and file give the same augmentation).
    pub seed: u64,
    /// The epoch whose augmentation to draw (set by [`for_epoch`](Self::for_epoch)).
    pub epoch: u64,
    /// What a file may declare (its pixels), checked before decoding.
    pub limits: super::Limits,
    /// Draft mode: decode a JPEG at 1/2, 1/4 or 1/8 scale in the DCT domain (libjpeg-turbo's
    /// reduced-size inverse DCTs, like Pillow's `Image.draft`) when the crop window would
    /// still span at least `crop` pixels each way, then resize as usual. Less inverse DCT,
    /// colour conversion and resizing for photos much larger than the output (the entropy
    /// decoding stays: 10% faster on the heavy-JPEG benchmark, `docs/performance.md`); the
    /// pixels are not bit-identical to torchvision's resize of the full decode (mean absolute
    /// difference 1.2–1.5 levels in 255 on the test photos). Off by default; no effect
    /// on PNG, WebP, or without libjpeg-turbo (feature `turbojpeg`).
    pub draft: bool,
}

impl Default for ImageRecipe {
    /// ImageNet evaluation: 256, then 224, NCHW, `u8`.
    fn default() -> Self {
        Self {
            resize: 256,
            crop: 224,
            layout: Layout::Nchw,
            random_crop: None,
            flip: false,
            normalize: None,
            seed: 0,
            epoch: 0,
            limits: super::Limits::default(),
            draft: false,
        }
    }
}

/// The range of a random resized crop: its area as a fraction of the image's, and its aspect
/// ratio (width / height).
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct RandomCrop {
    /// Area fraction range (torchvision: 0.08–1).
    pub scale: (f64, f64),
    /// Aspect ratio range (torchvision: ¾–4⁄3).
    pub ratio: (f64, f64),
}

impl Default for RandomCrop {
    fn default() -> Self {
        Self {
            scale: (0.08, 1.0),
            ratio: (3.0 / 4.0, 4.0 / 3.0),
        }
    }
}

/// Per-channel normalisation.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct Normalize {
    /// Channel means (of `x / 255`).
    pub mean: [f32; 3],
    /// Channel standard deviations.
    pub std: [f32; 3],
}

impl Normalize {
    /// ImageNet's statistics.
    pub const IMAGENET: Normalize = Normalize {
        mean: [0.485, 0.456, 0.406],
        std: [0.229, 0.224, 0.225],
    };
}

/// Per-thread resizer and buffers (decoders run on pool threads; nothing is shared): reusing
/// them spares an allocation, its page faults and its zeroing per image.
#[derive(Default)]
struct Scratch {
    resizer: Resizer,
    /// The resized image before it is transposed, flipped or normalised.
    resized: Vec<u8>,
    /// Decoded pixels (interleaved RGB).
    pixels: Vec<u8>,
}

thread_local! {
    static SCRATCH: RefCell<Scratch> = RefCell::new(Scratch::default());
}

/// A decode buffer larger than this (a very large photo) is freed after use instead of kept
/// by its thread.
const KEEP_DECODE_BUFFER: usize = 16 << 20;

impl ImageRecipe {
    /// ImageNet training: a random resized crop to `size` (default scale and ratio), a random
    /// flip, NCHW, normalised with ImageNet's statistics.
    pub fn train(size: u32) -> Self {
        Self {
            crop: size,
            random_crop: Some(RandomCrop::default()),
            flip: true,
            normalize: Some(Normalize::IMAGENET),
            ..Self::default()
        }
    }

    /// The same recipe with the user's augmentation seed `seed`.
    pub fn with_seed(mut self, seed: u64) -> Self {
        self.seed = seed;
        self
    }

    /// The same recipe drawing `epoch`'s augmentation.
    pub fn for_epoch(mut self, epoch: u64) -> Self {
        self.epoch = epoch;
        self
    }

    /// Checks the geometry (see [`Recipe`](super::Recipe), which does it once for a pipeline).
    pub fn validate(&self) -> Result<(), super::RecipeError> {
        use super::rules::check;
        check::crop(self.crop, self.resize, self.random_crop.is_some())?;
        if let Some(rc) = self.random_crop {
            check::random_crop(rc.scale, rc.ratio)?;
        }
        if let Some(n) = &self.normalize {
            check::normalize(&n.mean, &n.std)?;
        }
        Ok(())
    }

    /// The element type of the output: `u8`, or `f32` when normalising.
    pub fn dtype(&self) -> DType {
        if self.normalize.is_some() {
            DType::F32
        } else {
            DType::U8
        }
    }

    /// The shape of one output image.
    pub fn shape(&self) -> [usize; 3] {
        let c = self.crop as usize;
        match self.layout {
            Layout::Nchw => [3, c, c],
            Layout::Nhwc => [c, c, 3],
        }
    }

    /// Reads and decodes `path` into a new tensor of [`shape`](Self::shape).
    pub fn load(&self, path: &Path) -> Result<Tensor, MediaError> {
        self.check(path)?;
        self.load_checked(path)
    }

    /// [`load`](Self::load) for a recipe already validated (by [`Recipe`](super::Recipe)).
    pub(crate) fn load_checked(&self, path: &Path) -> Result<Tensor, MediaError> {
        let bytes = std::fs::read(path).map_err(|source| MediaError::Read {
            path: path.to_path_buf(),
            source,
        })?;
        self.decode_checked(&bytes, path)
    }

    /// Decodes `bytes` (the contents of `path`, named in errors) into a new tensor.
    pub fn decode(&self, bytes: &[u8], path: &Path) -> Result<Tensor, MediaError> {
        self.check(path)?;
        self.decode_checked(bytes, path)
    }

    /// [`decode`](Self::decode) for a recipe already validated.
    pub(crate) fn decode_checked(&self, bytes: &[u8], path: &Path) -> Result<Tensor, MediaError> {
        // Every byte is written (or the tensor is dropped with the error).
        let mut t = Tensor::for_overwrite(&self.shape(), self.dtype());
        self.decode_region_into(bytes, path, t.bytes_mut(), false)?;
        Ok(t)
    }

    /// Decodes `bytes` (the contents of `path`, named in errors) into `out`, which must hold
    /// exactly one output image (for example a slot of a batch tensor).
    pub fn decode_into(&self, bytes: &[u8], path: &Path, out: &mut [u8]) -> Result<(), MediaError> {
        self.check(path)?;
        self.decode_region_into(bytes, path, out, false)
    }

    /// [`validate`](Self::validate), as the error of the item at `path`: for callers that
    /// decode with a recipe they never validated.
    fn check(&self, path: &Path) -> Result<(), MediaError> {
        self.validate().map_err(|e| MediaError::Geometry {
            path: path.to_path_buf(),
            reason: e.to_string(),
        })
    }

    /// [`decode_into`](Self::decode_into), decoding the whole image when `whole` (which must
    /// give the same output: the tests compare).
    fn decode_region_into(
        &self,
        bytes: &[u8],
        path: &Path,
        out: &mut [u8],
        whole: bool,
    ) -> Result<(), MediaError> {
        let err = |reason: String| MediaError::Geometry {
            path: path.to_path_buf(),
            reason,
        };
        let c = self.crop as usize;
        let need = 3 * c * c * self.dtype().size();
        if out.len() != need {
            return Err(err(format!(
                "output slot of {} bytes, need {need}",
                out.len()
            )));
        }
        if bytes.is_empty() {
            return Err(MediaError::Empty {
                path: path.to_path_buf(),
            });
        }
        if bytes.starts_with(&[0xFF, 0xD8, 0xFF]) && !has_jpeg_end(bytes) {
            // zune-jpeg decodes a truncated file leniently (grey where data is missing);
            // a loader must not hand that to training as if it were the image.
            return Err(MediaError::Decode {
                path: path.to_path_buf(),
                source: "truncated JPEG: no end-of-image marker".into(),
            });
        }
        SCRATCH.with(|cell| {
            let mut rng = flowgate_tuner::Rng::new(super::item_seed(self.seed, self.epoch, path));
            // The source window that becomes the output square, known once the header is read,
            // in the coordinates of the image as decoded (scaled in draft mode).
            let mut window = (0.0, 0.0, 0.0, 0.0);
            let geometry = |w: u32, h: u32, max_denom: u32| -> Result<Plan, MediaError> {
                let pixels = u64::from(w) * u64::from(h);
                if pixels > self.limits.max_pixels {
                    return Err(MediaError::too_large(
                        path,
                        "pixels",
                        pixels,
                        self.limits.max_pixels,
                    ));
                }
                if w == 0 || h == 0 {
                    return Err(err("the image has no pixels".into()));
                }
                window = match self.random_crop {
                    Some(rc) => random_window(w, h, rc.scale, rc.ratio, &mut rng),
                    None => {
                        let (nw, nh) = resized(w, h, self.resize);
                        if nw < self.crop || nh < self.crop {
                            return Err(err(format!(
                                "{w}x{h} is too narrow to resize to {}",
                                self.resize
                            )));
                        }
                        let (left, top) = (crop_offset(nw, self.crop), crop_offset(nh, self.crop));
                        let (sx, sy) = (w as f64 / nw as f64, h as f64 / nh as f64);
                        (
                            left as f64 * sx,
                            top as f64 * sy,
                            self.crop as f64 * sx,
                            self.crop as f64 * sy,
                        )
                    }
                };
                let denom = if self.draft {
                    draft_denom((window.2, window.3), self.crop, max_denom)
                } else {
                    1
                };
                let d = f64::from(denom);
                window = (window.0 / d, window.1 / d, window.2 / d, window.3 / d);
                let (w, h) = (w.div_ceil(denom), h.div_ceil(denom));
                let rect = if whole {
                    Rect { x: 0, y: 0, w, h }
                } else {
                    needed(window, w, h, self.crop)
                };
                Ok(Plan { rect, denom })
            };
            let Scratch {
                resizer,
                resized,
                pixels,
            } = &mut *cell.borrow_mut();
            let got = decode_rgb(bytes, path, pixels, geometry);
            let got = got.and_then(|plan| {
                self.finish(
                    plan.rect, window, &mut rng, resizer, pixels, resized, out, path,
                )
            });
            if pixels.capacity() > KEEP_DECODE_BUFFER {
                *pixels = Vec::new();
            }
            got
        })
    }

    /// Resizes the decoded `region` (interleaved RGB in `pixels`) so that `window` (in image
    /// coordinates) becomes the output square, then flips, lays out and normalises into `out`.
    #[allow(clippy::too_many_arguments)]
    fn finish(
        &self,
        region: Rect,
        window: (f64, f64, f64, f64),
        rng: &mut flowgate_tuner::Rng,
        resizer: &mut Resizer,
        pixels: &mut [u8],
        scratch: &mut Vec<u8>,
        out: &mut [u8],
        path: &Path,
    ) -> Result<(), MediaError> {
        let err = |reason: String| MediaError::Geometry {
            path: path.to_path_buf(),
            reason,
        };
        let c = self.crop as usize;
        let (x, y, cw, ch) = window;
        let flip = self.flip && rng.uniform() < 0.5;
        let options = ResizeOptions::new()
            .resize_alg(ResizeAlg::Convolution(FilterType::Bilinear))
            .crop(x - f64::from(region.x), y - f64::from(region.y), cw, ch);
        let len = region.w as usize * region.h as usize * 3;
        let src = Image::from_slice_u8(region.w, region.h, &mut pixels[..len], PixelType::U8x3)
            .map_err(|e| err(format!("source image: {e}")))?;
        let resize = |resizer: &mut Resizer, dst: &mut [u8]| {
            let mut dst = Image::from_slice_u8(self.crop, self.crop, dst, PixelType::U8x3)
                .map_err(|e| err(format!("destination: {e}")))?;
            resizer
                .resize(&src, &mut dst, &options)
                .map_err(|e| err(format!("resizing: {e}")))
        };
        if !flip && self.normalize.is_none() {
            // The common case: the resizer writes the output (or the CHW scratch) directly.
            return match self.layout {
                Layout::Nhwc => resize(resizer, out),
                Layout::Nchw => {
                    scratch.resize(3 * c * c, 0);
                    resize(resizer, scratch)?;
                    hwc_to_chw(scratch, out, c * c);
                    Ok(())
                }
            };
        }
        scratch.resize(3 * c * c, 0);
        resize(resizer, scratch)?;
        if flip {
            for row in scratch.chunks_exact_mut(3 * c) {
                flip_row(row);
            }
        }
        match self.normalize {
            None => match self.layout {
                Layout::Nhwc => out.copy_from_slice(scratch),
                Layout::Nchw => hwc_to_chw(scratch, out, c * c),
            },
            Some(n) => normalize_into(
                scratch,
                out,
                (n.mean, n.std),
                self.layout == Layout::Nchw,
                c * c,
            ),
        }
        Ok(())
    }
}
