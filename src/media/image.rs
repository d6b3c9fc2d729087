//! Images: JPEG, PNG and WebP into `u8` tensors, the way torchvision's
//! `Resize(resize)` + `CenterCrop(crop)` does it.
//!
//! Decoding uses the `image` crate (zune-jpeg for JPEG); resizing uses `fast_image_resize`'s
//! SIMD convolution with the same antialiased bilinear filter as Pillow (which torchvision uses
//! on PIL images). Only the source window that survives the crop is resized: a crop box in
//! source coordinates gives exactly the pixels of resize-then-crop, for less work.
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

/// torchvision's resized size for a `w × h` image and a shorter side of `size`.
fn resized(w: u32, h: u32, size: u32) -> (u32, u32) {
    let (short, long) = if w <= h { (w, h) } else { (h, w) };
    let new_long = (size as u64 * long as u64 / short as u64) as u32;
    if w <= h {
        (size, new_long)
    } else {
        (new_long, size)
    }
}

/// torchvision's center-crop offset: `int(round((size - crop) / 2.0))`, half to even.
fn crop_offset(size: u32, crop: u32) -> u32 {
    ((size as f64 - crop as f64) / 2.0).round_ties_even() as u32
}

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
        use super::recipe::rules;
        rules::crop(self.crop, self.resize, self.random_crop.is_some())?;
        if let Some(rc) = self.random_crop {
            rules::random_crop(rc.scale, rc.ratio)?;
        }
        if let Some(n) = &self.normalize {
            rules::normalize_std(&n.std)?;
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
            // The source window that becomes the output square, known once the header is read.
            let mut window = (0.0, 0.0, 0.0, 0.0);
            let geometry = |w: u32, h: u32| -> Result<Rect, MediaError> {
                if w == 0 || h == 0 {
                    return Err(err("the image has no pixels".into()));
                }
                window = match self.random_crop {
                    Some(rc) => random_window(w, h, rc, &mut rng),
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
                Ok(if whole {
                    Rect { x: 0, y: 0, w, h }
                } else {
                    needed(window, w, h, self.crop)
                })
            };
            let Scratch {
                resizer,
                resized,
                pixels,
            } = &mut *cell.borrow_mut();
            let got = decode_rgb(bytes, path, pixels, geometry);
            let got = got.and_then(|region| {
                self.finish(
                    region, window, &mut rng, resizer, pixels, resized, out, path,
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
            Some(n) => normalize_into(scratch, out, n, self.layout, c * c),
        }
        Ok(())
    }
}

/// A rectangle of whole pixels.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
struct Rect {
    x: u32,
    y: u32,
    w: u32,
    h: u32,
}

/// The pixels the resizer reads to turn `window` into a `crop`-sided square: the window and
/// the bilinear filter's reach around it (one output pixel's footprint, plus rounding), within
/// the `w × h` image. Decoding just these gives the same output as decoding everything.
fn needed(window: (f64, f64, f64, f64), w: u32, h: u32, crop: u32) -> Rect {
    let (x, y, cw, ch) = window;
    let reach = |extent: f64| (extent / f64::from(crop)).max(1.0).ceil() + 2.0;
    let (mx, my) = (reach(cw), reach(ch));
    let x0 = (x - mx).floor().max(0.0) as u32;
    let y0 = (y - my).floor().max(0.0) as u32;
    let x1 = ((x + cw + mx).ceil() as u32).min(w);
    let y1 = ((y + ch + my).ceil() as u32).min(h);
    Rect {
        x: x0,
        y: y0,
        w: x1.saturating_sub(x0),
        h: y1.saturating_sub(y0),
    }
}

/// torchvision's `RandomResizedCrop.get_params`: ten tries at a window of a random area and
/// aspect ratio inside the image, else the largest center window within the ratio range.
fn random_window(
    w: u32,
    h: u32,
    rc: RandomCrop,
    rng: &mut flowgate_tuner::Rng,
) -> (f64, f64, f64, f64) {
    let (wf, hf) = (f64::from(w), f64::from(h));
    let area = wf * hf;
    let (lo, hi) = (rc.ratio.0.ln(), rc.ratio.1.ln());
    for _ in 0..10 {
        let target = area * (rc.scale.0 + rng.uniform() * (rc.scale.1 - rc.scale.0));
        let aspect = (lo + rng.uniform() * (hi - lo)).exp();
        let cw = (target * aspect).sqrt().round();
        let ch = (target / aspect).sqrt().round();
        if cw > 0.0 && ch > 0.0 && cw <= wf && ch <= hf {
            let x = (rng.uniform() * (wf - cw + 1.0)).floor().min(wf - cw);
            let y = (rng.uniform() * (hf - ch + 1.0)).floor().min(hf - ch);
            return (x, y, cw, ch);
        }
    }
    let ratio = wf / hf;
    let (cw, ch) = if ratio < rc.ratio.0 {
        (wf, (wf / rc.ratio.0).round())
    } else if ratio > rc.ratio.1 {
        ((hf * rc.ratio.1).round(), hf)
    } else {
        (wf, hf)
    };
    (((wf - cw) / 2.0).floor(), ((hf - ch) / 2.0).floor(), cw, ch)
}

/// Mirrors one interleaved RGB row.
fn flip_row(row: &mut [u8]) {
    let n = row.len() / 3;
    for i in 0..n / 2 {
        for k in 0..3 {
            row.swap(3 * i + k, 3 * (n - 1 - i) + k);
        }
    }
}

/// Writes `(x / 255 - mean) / std` as native-endian `f32` in `layout`.
fn normalize_into(hwc: &[u8], out: &mut [u8], n: Normalize, layout: Layout, plane: usize) {
    let scale: [f32; 3] = std::array::from_fn(|c| 1.0 / (255.0 * n.std[c]));
    let shift: [f32; 3] = std::array::from_fn(|c| n.mean[c] / n.std[c]);
    let mut put = |i: usize, v: f32| out[4 * i..4 * i + 4].copy_from_slice(&v.to_ne_bytes());
    for (p, px) in hwc.chunks_exact(3).enumerate() {
        for c in 0..3 {
            let v = f32::from(px[c]) * scale[c] - shift[c];
            match layout {
                Layout::Nhwc => put(3 * p + c, v),
                Layout::Nchw => put(c * plane + p, v),
            }
        }
    }
}

/// The JPEG decoder in use: `"libjpeg-turbo"` (feature `turbojpeg`, where its headers were
/// found at build time) or `"zune-jpeg"`.
pub fn jpeg_decoder() -> &'static str {
    if cfg!(flowgate_libjpeg) {
        "libjpeg-turbo"
    } else {
        "zune-jpeg"
    }
}

/// Decodes the part of an image that `geometry` (given the image's width and height) asks
/// for, or more, into `pixels` as interleaved RGB rows, and says which part that is.
///
/// JPEG with libjpeg-turbo (feature `turbojpeg`) decodes only the rows and iMCU columns asked
/// for; JPEG with zune-jpeg, and PNG and WebP with the `image` crate, decode everything.
fn decode_rgb(
    bytes: &[u8],
    path: &Path,
    pixels: &mut Vec<u8>,
    geometry: impl FnOnce(u32, u32) -> Result<Rect, MediaError>,
) -> Result<Rect, MediaError> {
    let decode_err = |source: Box<dyn std::error::Error + Send + Sync>| MediaError::Decode {
        path: path.to_path_buf(),
        source,
    };
    let is_jpeg = bytes.starts_with(&[0xFF, 0xD8, 0xFF]);
    #[cfg(flowgate_libjpeg)]
    if is_jpeg {
        match libjpeg::decode(bytes, pixels, geometry) {
            libjpeg::Outcome::Done(r) => return r,
            libjpeg::Outcome::Failed(msg) => return Err(decode_err(msg.into())),
            // CMYK: the `image` crate below converts it.
            libjpeg::Outcome::Unsupported(g) => return decode_any(bytes, pixels, g, decode_err),
        }
    }
    if is_jpeg {
        use zune_core::colorspace::ColorSpace;
        let options = zune_core::options::DecoderOptions::default()
            .set_strict_mode(false)
            .set_max_width(usize::MAX)
            .set_max_height(usize::MAX)
            .jpeg_set_out_colorspace(ColorSpace::RGB);
        let mut dec = zune_jpeg::JpegDecoder::new_with_options(
            zune_core::bytestream::ZCursor::new(bytes),
            options,
        );
        dec.decode_headers()
            .map_err(|e| decode_err(format!("{e:?}").into()))?;
        // YCbCr and RGB (nearly every JPEG) straight into the buffer; the rest (grey, CMYK)
        // through the `image` crate's conversions.
        if matches!(
            dec.input_colorspace(),
            Some(ColorSpace::YCbCr | ColorSpace::RGB)
        ) {
            let (w, h) = dec.dimensions().expect("headers were decoded");
            let (w, h) = (w as u32, h as u32);
            geometry(w, h)?;
            let len = dec.output_buffer_size().expect("headers were decoded");
            // Stale pixels from the last image are fine: the decoder writes every byte.
            pixels.resize(len.max(pixels.len()), 0);
            dec.decode_into(pixels)
                .map_err(|e| decode_err(format!("{e:?}").into()))?;
            return Ok(Rect { x: 0, y: 0, w, h });
        }
    }
    decode_any(bytes, pixels, geometry, decode_err)
}

/// Any format the `image` crate reads, whole.
fn decode_any(
    bytes: &[u8],
    pixels: &mut Vec<u8>,
    geometry: impl FnOnce(u32, u32) -> Result<Rect, MediaError>,
    decode_err: impl Fn(Box<dyn std::error::Error + Send + Sync>) -> MediaError,
) -> Result<Rect, MediaError> {
    let img = ::image::load_from_memory(bytes).map_err(|e| decode_err(Box::new(e)))?;
    let (w, h) = (img.width(), img.height());
    geometry(w, h)?;
    *pixels = img.into_rgb8().into_raw();
    Ok(Rect { x: 0, y: 0, w, h })
}

/// libjpeg-turbo through `libjpeg.c` (built by build.rs).
#[cfg(flowgate_libjpeg)]
mod libjpeg {
    use super::{MediaError, Rect};
    use std::cell::RefCell;
    use std::ffi::{c_char, c_int, c_uchar, c_uint, c_ulong, CStr};

    #[repr(C)]
    struct FgJpeg {
        _private: [u8; 0],
    }

    extern "C" {
        fn fg_jpeg_new() -> *mut FgJpeg;
        fn fg_jpeg_free(d: *mut FgJpeg);
        fn fg_jpeg_abort(d: *mut FgJpeg);
        fn fg_jpeg_message(d: *const FgJpeg) -> *const c_char;
        fn fg_jpeg_header(
            d: *mut FgJpeg,
            data: *const c_uchar,
            len: c_ulong,
            width: *mut c_uint,
            height: *mut c_uint,
        ) -> c_int;
        #[allow(clippy::too_many_arguments)]
        fn fg_jpeg_decode(
            d: *mut FgJpeg,
            x0: c_uint,
            y0: c_uint,
            x1: c_uint,
            y1: c_uint,
            out: *mut c_uchar,
            cap: usize,
            out_x: *mut c_uint,
            out_w: *mut c_uint,
        ) -> c_int;
    }

    const OK: c_int = 0;
    const UNSUPPORTED: c_int = 2;

    /// One decompressor per thread, reused from image to image.
    struct Handle(*mut FgJpeg);

    impl Drop for Handle {
        fn drop(&mut self) {
            // SAFETY: made by fg_jpeg_new, freed once.
            unsafe { fg_jpeg_free(self.0) }
        }
    }

    thread_local! {
        static HANDLE: RefCell<Option<Handle>> = const { RefCell::new(None) };
    }

    pub(super) enum Outcome<G> {
        Done(Result<Rect, MediaError>),
        Failed(String),
        /// Not for this decoder (CMYK or YCCK); the geometry is handed back unused.
        Unsupported(G),
    }

    fn message(d: *const FgJpeg) -> String {
        // SAFETY: fg_jpeg_message returns the handle's NUL-terminated message buffer.
        let m = unsafe { CStr::from_ptr(fg_jpeg_message(d)) };
        format!("libjpeg: {}", m.to_string_lossy())
    }

    pub(super) fn decode<G>(bytes: &[u8], pixels: &mut Vec<u8>, geometry: G) -> Outcome<G>
    where
        G: FnOnce(u32, u32) -> Result<Rect, MediaError>,
    {
        HANDLE.with(|cell| {
            let mut cell = cell.borrow_mut();
            if cell.is_none() {
                // SAFETY: plain constructor; null on allocation failure.
                let d = unsafe { fg_jpeg_new() };
                if d.is_null() {
                    return Outcome::Failed("libjpeg: cannot create a decompressor".into());
                }
                *cell = Some(Handle(d));
            }
            let d = cell.as_ref().expect("set above").0;
            let (mut w, mut h) = (0, 0);
            // SAFETY: `bytes` outlives the decode below, which ends before this returns.
            let rc = unsafe {
                fg_jpeg_header(d, bytes.as_ptr(), bytes.len() as c_ulong, &mut w, &mut h)
            };
            match rc {
                OK => {}
                UNSUPPORTED => return Outcome::Unsupported(geometry),
                _ => return Outcome::Failed(message(d)),
            }
            let want = match geometry(w, h) {
                Ok(r) => r,
                Err(e) => {
                    // SAFETY: ends the decode whose header was read.
                    unsafe { fg_jpeg_abort(d) };
                    return Outcome::Done(Err(e));
                }
            };
            // Columns widen to iMCU boundaries (at most 32 pixels each side).
            let x0 = want.x.saturating_sub(32);
            let x1 = (want.x + want.w + 32).min(w);
            let cap = (x1 - x0) as usize * 3 * want.h as usize;
            // Stale pixels from the last image are fine: libjpeg writes every row it reports.
            pixels.resize(cap.max(pixels.len()), 0);
            let (mut out_x, mut out_w) = (0, 0);
            // SAFETY: `pixels` holds `cap` bytes; the C side checks every row against it.
            let rc = unsafe {
                fg_jpeg_decode(
                    d,
                    want.x,
                    want.y,
                    want.x + want.w,
                    want.y + want.h,
                    pixels.as_mut_ptr(),
                    cap,
                    &mut out_x,
                    &mut out_w,
                )
            };
            if rc != OK {
                return Outcome::Failed(message(d));
            }
            Outcome::Done(Ok(Rect {
                x: out_x,
                y: want.y,
                w: out_w,
                h: want.h,
            }))
        })
    }
}

/// Whether JPEG data ends with an end-of-image marker (FF D9), allowing for up to
/// [`JPEG_TAIL`] bytes of trailing padding. Entropy-coded data stuffs every FF byte, so FF D9
/// near the end can only be the marker.
fn has_jpeg_end(bytes: &[u8]) -> bool {
    let tail = &bytes[bytes.len().saturating_sub(JPEG_TAIL)..];
    tail.windows(2).any(|w| w == [0xFF, 0xD9])
}

/// Trailing bytes after a JPEG's end marker that are tolerated (padding some writers add).
const JPEG_TAIL: usize = 1024;

/// Transposes interleaved RGB (`H × W × 3`) into planes (`3 × H × W`): 16 pixels at a time
/// with SSSE3 byte shuffles where the CPU has them (about 8× the scalar loop).
fn hwc_to_chw(src: &[u8], dst: &mut [u8], plane: usize) {
    let (r, rest) = dst.split_at_mut(plane);
    let (g, b) = rest.split_at_mut(plane);
    let mut done = 0;
    #[cfg(target_arch = "x86_64")]
    if std::arch::is_x86_feature_detected!("ssse3") {
        // SAFETY: the CPU has SSSE3 (checked above).
        done = unsafe { chw_ssse3::transpose(src, r, g, b) };
    }
    for (i, px) in src.chunks_exact(3).enumerate().skip(done) {
        r[i] = px[0];
        g[i] = px[1];
        b[i] = px[2];
    }
}

#[cfg(target_arch = "x86_64")]
mod chw_ssse3 {
    use std::arch::x86_64::{
        __m128i, _mm_loadu_si128, _mm_or_si128, _mm_shuffle_epi8, _mm_storeu_si128,
    };

    /// Shuffle masks: for plane `k` and input vector `v`, output byte `j` takes byte
    /// `(3j + k) mod 16` of vector `v` when `(3j + k) / 16 == v`, else zero (0x80).
    const fn mask(k: usize, v: usize) -> [i8; 16] {
        let mut m = [-128i8; 16];
        let mut j = 0;
        while j < 16 {
            let s = 3 * j + k;
            if s / 16 == v {
                m[j] = (s % 16) as i8;
            }
            j += 1;
        }
        m
    }

    const MASKS: [[[i8; 16]; 3]; 3] = [
        [mask(0, 0), mask(0, 1), mask(0, 2)],
        [mask(1, 0), mask(1, 1), mask(1, 2)],
        [mask(2, 0), mask(2, 1), mask(2, 2)],
    ];

    /// Transposes whole groups of 16 pixels; returns how many pixels it did.
    #[target_feature(enable = "ssse3")]
    pub(super) unsafe fn transpose(src: &[u8], r: &mut [u8], g: &mut [u8], b: &mut [u8]) -> usize {
        let n = (src.len() / 3).min(r.len()).min(g.len()).min(b.len()) / 16 * 16;
        let masks: [[__m128i; 3]; 3] = std::array::from_fn(|k| {
            std::array::from_fn(|v| unsafe { _mm_loadu_si128(MASKS[k][v].as_ptr().cast()) })
        });
        let planes = [r.as_mut_ptr(), g.as_mut_ptr(), b.as_mut_ptr()];
        let mut i = 0;
        while i < n {
            // SAFETY: pixels i..i+16 are inside `src` and every plane (n is bounded by both).
            unsafe {
                let p = src.as_ptr().add(3 * i);
                let a = _mm_loadu_si128(p.cast());
                let bb = _mm_loadu_si128(p.add(16).cast());
                let c = _mm_loadu_si128(p.add(32).cast());
                for (k, plane) in planes.iter().enumerate() {
                    let m = &masks[k];
                    let v = _mm_or_si128(
                        _mm_or_si128(_mm_shuffle_epi8(a, m[0]), _mm_shuffle_epi8(bb, m[1])),
                        _mm_shuffle_epi8(c, m[2]),
                    );
                    _mm_storeu_si128(plane.add(i).cast(), v);
                }
            }
            i += 16;
        }
        n
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn geometry_matches_torchvision() {
        assert_eq!(resized(500, 375, 256), (341, 256)); // int(256 * 500 / 375) = 341
        assert_eq!(resized(375, 500, 256), (256, 341));
        assert_eq!(resized(300, 300, 256), (256, 256));
        assert_eq!(crop_offset(341, 224), 58); // round(58.5) = 58 (half to even)
        assert_eq!(crop_offset(343, 224), 60); // round(59.5) = 60
        assert_eq!(crop_offset(256, 224), 16);
    }

    fn encode(img: &::image::RgbImage, fmt: ::image::ImageFormat) -> Vec<u8> {
        let mut out = std::io::Cursor::new(Vec::new());
        img.write_to(&mut out, fmt).unwrap();
        out.into_inner()
    }

    #[test]
    fn a_flat_image_stays_flat_in_both_layouts() {
        let img = ::image::RgbImage::from_pixel(400, 300, ::image::Rgb([10, 120, 240]));
        let png = encode(&img, ::image::ImageFormat::Png);
        let recipe = ImageRecipe::default();
        let mut chw = vec![0; 3 * 224 * 224];
        recipe
            .decode_into(&png, Path::new("flat.png"), &mut chw)
            .unwrap();
        assert!(chw[..224 * 224].iter().all(|&v| v == 10));
        assert!(chw[224 * 224..2 * 224 * 224].iter().all(|&v| v == 120));
        assert!(chw[2 * 224 * 224..].iter().all(|&v| v == 240));
        let nhwc = ImageRecipe {
            layout: Layout::Nhwc,
            ..recipe
        };
        let mut hwc = vec![0; 3 * 224 * 224];
        nhwc.decode_into(&png, Path::new("flat.png"), &mut hwc)
            .unwrap();
        assert!(hwc.chunks(3).all(|p| p == [10, 120, 240]));
    }

    #[test]
    fn the_crop_window_equals_resize_then_crop() {
        // A gradient, so that any misplaced window shows.
        let img = ::image::RgbImage::from_fn(500, 375, |x, y| {
            ::image::Rgb([(x / 2) as u8, (y / 2) as u8, ((x + y) / 4) as u8])
        });
        let png = encode(&img, ::image::ImageFormat::Png);
        let recipe = ImageRecipe {
            layout: Layout::Nhwc,
            ..ImageRecipe::default()
        };
        let mut fast = vec![0; 3 * 224 * 224];
        recipe
            .decode_into(&png, Path::new("g.png"), &mut fast)
            .unwrap();
        // The slow way: resize the whole image to 341x256, then crop at (58, 16).
        let src = Image::from_vec_u8(500, 375, img.into_raw(), PixelType::U8x3).unwrap();
        let mut full = Image::new(341, 256, PixelType::U8x3);
        let opts = ResizeOptions::new().resize_alg(ResizeAlg::Convolution(FilterType::Bilinear));
        Resizer::new().resize(&src, &mut full, &opts).unwrap();
        let full = full.buffer();
        let mut worst = 0;
        for y in 0..224 {
            for x in 0..224 * 3 {
                let a = fast[y * 224 * 3 + x] as i32;
                let b = full[(y + 16) * 341 * 3 + 58 * 3 + x] as i32;
                worst = worst.max((a - b).abs());
            }
        }
        assert!(worst <= 1, "max difference {worst}");
    }

    #[test]
    fn random_windows_stay_inside_and_respect_scale_and_ratio() {
        let rc = RandomCrop::default();
        for seed in 0..2000 {
            let mut rng = flowgate_tuner::Rng::new(seed);
            let (w, h) = (300 + (seed % 7) as u32 * 50, 200 + (seed % 5) as u32 * 60);
            let (x, y, cw, ch) = random_window(w, h, rc, &mut rng);
            assert!(x >= 0.0 && y >= 0.0 && cw >= 1.0 && ch >= 1.0);
            assert!(x + cw <= f64::from(w) && y + ch <= f64::from(h), "{seed}");
            let frac = cw * ch / (f64::from(w) * f64::from(h));
            assert!((0.07..=1.0).contains(&frac), "{seed}: area {frac}");
        }
    }

    #[test]
    fn flips_and_normalisation_are_exact_and_seeded() {
        let img =
            ::image::RgbImage::from_fn(256, 256, |x, y| ::image::Rgb([x as u8, y as u8, 100]));
        let png = encode(&img, ::image::ImageFormat::Png);
        let p = Path::new("grad.png");
        let plain = ImageRecipe {
            resize: 224,
            crop: 224,
            layout: Layout::Nhwc,
            ..ImageRecipe::default()
        };
        let base = plain.decode(&png, p).unwrap();
        let flipping = ImageRecipe {
            flip: true,
            ..plain
        };
        let (mut flipped, mut kept) = (0, 0);
        for seed in 0..20 {
            let t = flipping.with_seed(seed).decode(&png, p).unwrap();
            assert_eq!(
                t.bytes(),
                flipping.with_seed(seed).decode(&png, p).unwrap().bytes(),
                "the same seed gives the same output"
            );
            if t.bytes() == base.bytes() {
                kept += 1;
                continue;
            }
            flipped += 1;
            for y in 0..224 {
                for x in 0..224 {
                    let a = &t.bytes()[(y * 224 + x) * 3..][..3];
                    let b = &base.bytes()[(y * 224 + 223 - x) * 3..][..3];
                    assert_eq!(a, b, "a mirror image");
                }
            }
        }
        assert!(flipped > 3 && kept > 3, "{flipped} flipped, {kept} kept");
        let norm = ImageRecipe {
            normalize: Some(Normalize::IMAGENET),
            layout: Layout::Nchw,
            ..plain
        };
        let t = norm.decode(&png, p).unwrap();
        assert_eq!(
            (t.shape(), t.dtype()),
            (&[3usize, 224, 224][..], DType::F32)
        );
        let f = |i: usize| f32::from_ne_bytes(t.bytes()[4 * i..4 * i + 4].try_into().unwrap());
        let blue = (100.0 / 255.0 - 0.406) / 0.225;
        assert!((f(2 * 224 * 224 + 5) - blue).abs() < 1e-5);
        let nhwc = base.bytes();
        for i in [0usize, 1000, 50_000] {
            let want = (f32::from(nhwc[3 * i]) / 255.0 - 0.485) / 0.229;
            assert!((f(i) - want).abs() < 1e-5, "red plane at {i}");
        }
        let train = ImageRecipe::train(112);
        let a = train.decode(&png, p).unwrap();
        assert_eq!(a.shape(), [3, 112, 112]);
        assert_ne!(
            a.bytes(),
            train.with_seed(1).decode(&png, p).unwrap().bytes()
        );
    }

    /// A photo-like picture: smooth gradients, edges and some noise.
    fn photo(w: u32, h: u32, seed: u64) -> Vec<u8> {
        let mut rng = flowgate_tuner::Rng::new(seed);
        let mut px = Vec::with_capacity((w * h * 3) as usize);
        for y in 0..h {
            for x in 0..w {
                let n = (rng.uniform() * 24.0) as u32;
                let edge = if (x / 37 + y / 29) % 2 == 0 { 60 } else { 0 };
                px.push(((x * 255 / w + n + edge) % 256) as u8);
                px.push(((y * 255 / h + n) % 256) as u8);
                px.push((((x + y) * 128 / (w + h) + n * 2 + edge) % 256) as u8);
            }
        }
        px
    }

    fn jpeg(
        px: &[u8],
        w: u32,
        h: u32,
        color: jpeg_encoder::ColorType,
        sampling: jpeg_encoder::SamplingFactor,
        progressive: bool,
    ) -> Vec<u8> {
        let mut out = Vec::new();
        let mut enc = jpeg_encoder::Encoder::new(&mut out, 90);
        enc.set_sampling_factor(sampling);
        enc.set_progressive(progressive);
        enc.encode(px, w as u16, h as u16, color).unwrap();
        out
    }

    #[test]
    fn decoding_only_the_needed_region_changes_no_pixel() {
        use jpeg_encoder::{ColorType, SamplingFactor as S};
        let recipes = [
            ImageRecipe::default(),
            ImageRecipe {
                layout: Layout::Nhwc,
                ..ImageRecipe::default()
            },
            ImageRecipe {
                resize: 160,
                crop: 128,
                ..ImageRecipe::default()
            },
            ImageRecipe {
                normalize: None,
                ..ImageRecipe::train(224)
            },
            ImageRecipe::train(96).with_seed(7),
        ];
        let sizes = [(500, 375), (375, 500), (333, 257), (1030, 771), (257, 256)];
        let mut n = 0;
        for (i, &(w, h)) in sizes.iter().enumerate() {
            let px = photo(w, h, i as u64);
            for (sampling, progressive) in [
                (S::F_2_2, false),
                (S::F_1_1, false),
                (S::F_2_1, true),
                (S::F_4_1, false),
                (S::F_2_2, true),
            ] {
                let bytes = jpeg(&px, w, h, ColorType::Rgb, sampling, progressive);
                for (k, recipe) in recipes.iter().enumerate() {
                    for seed in 0..2 {
                        let recipe = recipe.with_seed(seed);
                        let path = std::path::PathBuf::from(format!("p{i}-{k}-{seed}.jpg"));
                        let len = 3 * (recipe.crop as usize).pow(2) * recipe.dtype().size();
                        let (mut part, mut all) = (vec![0; len], vec![1; len]);
                        recipe
                            .decode_region_into(&bytes, &path, &mut part, false)
                            .unwrap();
                        recipe
                            .decode_region_into(&bytes, &path, &mut all, true)
                            .unwrap();
                        assert!(
                            part == all,
                            "{w}x{h} {sampling:?} progressive={progressive} recipe {k} seed {seed}"
                        );
                        n += 1;
                    }
                }
            }
        }
        assert_eq!(n, 5 * 5 * 5 * 2);
        // The region is a real saving: ~66% of a 500x375 photo for the evaluation recipe.
        let r = needed((85.3, 23.4, 328.1, 328.1), 500, 375, 224);
        assert!(r.w < 345 && r.h < 345 && r.x > 80 && r.y > 18, "{r:?}");
    }

    #[test]
    fn grey_and_cmyk_jpegs_decode_to_rgb() {
        use jpeg_encoder::{ColorType, SamplingFactor as S};
        let (w, h) = (300, 260);
        let grey: Vec<u8> = (0..w * h).map(|i| (i % 251) as u8).collect();
        let bytes = jpeg(&grey, w, h, ColorType::Luma, S::F_1_1, false);
        let recipe = ImageRecipe {
            layout: Layout::Nhwc,
            ..ImageRecipe::default()
        };
        let t = recipe.decode(&bytes, Path::new("grey.jpg")).unwrap();
        assert!(t.bytes().chunks(3).all(|p| p[0] == p[1] && p[1] == p[2]));
        // Flat CMYK: cyan-ish, no black.
        let cmyk: Vec<u8> = (0..w * h).flat_map(|_| [200u8, 40, 0, 0]).collect();
        let bytes = jpeg(&cmyk, w, h, ColorType::Cmyk, S::F_1_1, false);
        let t = recipe.decode(&bytes, Path::new("cmyk.jpg")).unwrap();
        let mid = &t.bytes()[3 * (112 * 224 + 112)..][..3];
        assert!(mid[0] < mid[1] && mid[1] <= mid[2], "{mid:?}");
    }

    #[test]
    fn bad_bytes_are_typed_errors_naming_the_file() {
        let r = ImageRecipe::default();
        let mut out = vec![0; 3 * 224 * 224];
        let p = Path::new("x/broken.jpg");
        assert!(matches!(
            r.decode_into(&[], p, &mut out),
            Err(MediaError::Empty { .. })
        ));
        let e = r
            .decode_into(b"definitely not an image", p, &mut out)
            .unwrap_err();
        assert!(
            matches!(e, MediaError::Decode { .. }) && e.to_string().contains("x/broken.jpg"),
            "{e}"
        );
        let img = ::image::RgbImage::from_pixel(64, 64, ::image::Rgb([1, 2, 3]));
        let jpg = encode(&img, ::image::ImageFormat::Jpeg);
        assert!(
            r.decode_into(&jpg[..jpg.len() / 2], p, &mut out).is_err(),
            "truncated"
        );
        assert!(
            r.decode_into(&jpg, p, &mut [0; 10]).is_err(),
            "wrong slot size"
        );
        let e = r.load(Path::new("/nonexistent/a.jpg")).unwrap_err();
        assert!(
            matches!(e, MediaError::Read { .. }) && e.path() == Path::new("/nonexistent/a.jpg")
        );
    }
}
