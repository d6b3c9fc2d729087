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

/// Decode, resize the shorter side, center-crop, lay out.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct ImageRecipe {
    /// The shorter side after resizing.
    pub resize: u32,
    /// The side of the square center crop (at most `resize`).
    pub crop: u32,
    /// The output layout.
    pub layout: Layout,
}

impl Default for ImageRecipe {
    /// ImageNet evaluation: 256, then 224, NCHW.
    fn default() -> Self {
        Self {
            resize: 256,
            crop: 224,
            layout: Layout::Nchw,
        }
    }
}

thread_local! {
    /// Per-thread resizer and scratch (decoders run on pool threads; nothing is shared).
    static SCRATCH: RefCell<(Resizer, Vec<u8>)> = RefCell::new((Resizer::new(), Vec::new()));
}

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
        let bytes = std::fs::read(path).map_err(|source| MediaError::Read {
            path: path.to_path_buf(),
            source,
        })?;
        self.decode(&bytes, path)
    }

    /// Decodes `bytes` (the contents of `path`, named in errors) into a new tensor.
    pub fn decode(&self, bytes: &[u8], path: &Path) -> Result<Tensor, MediaError> {
        let mut t = Tensor::zeros(&self.shape(), DType::U8);
        self.decode_into(bytes, path, t.bytes_mut())?;
        Ok(t)
    }

    /// Decodes `bytes` (the contents of `path`, named in errors) into `out`, which must hold
    /// exactly one output image (for example a slot of a batch tensor).
    pub fn decode_into(&self, bytes: &[u8], path: &Path, out: &mut [u8]) -> Result<(), MediaError> {
        let err = |reason: String| MediaError::Geometry {
            path: path.to_path_buf(),
            reason,
        };
        if self.crop == 0 || self.crop > self.resize {
            return Err(err(format!(
                "crop {} must be in 1..={}",
                self.crop, self.resize
            )));
        }
        let c = self.crop as usize;
        if out.len() != 3 * c * c {
            return Err(err(format!(
                "output slot of {} bytes, need {}",
                out.len(),
                3 * c * c
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
        let (w, h, rgb) = decode_rgb(bytes, path)?;
        if w == 0 || h == 0 {
            return Err(err("the image has no pixels".into()));
        }
        let (nw, nh) = resized(w, h, self.resize);
        if nw < self.crop || nh < self.crop {
            return Err(err(format!(
                "{w}x{h} is too narrow to resize to {}",
                self.resize
            )));
        }
        let (left, top) = (crop_offset(nw, self.crop), crop_offset(nh, self.crop));
        let (sx, sy) = (w as f64 / nw as f64, h as f64 / nh as f64);
        let options = ResizeOptions::new()
            .resize_alg(ResizeAlg::Convolution(FilterType::Bilinear))
            .crop(
                left as f64 * sx,
                top as f64 * sy,
                self.crop as f64 * sx,
                self.crop as f64 * sy,
            );
        let src = Image::from_vec_u8(w, h, rgb, PixelType::U8x3)
            .map_err(|e| err(format!("source image: {e}")))?;
        SCRATCH.with(|cell| {
            let (resizer, scratch) = &mut *cell.borrow_mut();
            let resize = |resizer: &mut Resizer, dst: &mut [u8]| {
                let mut dst = Image::from_slice_u8(self.crop, self.crop, dst, PixelType::U8x3)
                    .map_err(|e| err(format!("destination: {e}")))?;
                resizer
                    .resize(&src, &mut dst, &options)
                    .map_err(|e| err(format!("resizing: {e}")))
            };
            match self.layout {
                Layout::Nhwc => resize(resizer, out),
                Layout::Nchw => {
                    scratch.resize(3 * c * c, 0);
                    resize(resizer, scratch)?;
                    hwc_to_chw(scratch, out, c * c);
                    Ok(())
                }
            }
        })
    }
}

/// The JPEG decoder in use: `"libjpeg-turbo"` (feature `turbojpeg`) or `"zune-jpeg"`.
pub fn jpeg_decoder() -> &'static str {
    if cfg!(feature = "turbojpeg") {
        "libjpeg-turbo"
    } else {
        "zune-jpeg"
    }
}

/// Decodes any supported image into interleaved RGB: JPEG with libjpeg-turbo when the
/// `turbojpeg` feature is on, everything else (and JPEG otherwise) with the `image` crate.
fn decode_rgb(bytes: &[u8], path: &Path) -> Result<(u32, u32, Vec<u8>), MediaError> {
    let decode_err = |source: Box<dyn std::error::Error + Send + Sync>| MediaError::Decode {
        path: path.to_path_buf(),
        source,
    };
    #[cfg(feature = "turbojpeg")]
    if bytes.starts_with(&[0xFF, 0xD8, 0xFF]) {
        thread_local! {
            static TURBO: RefCell<Option<turbojpeg::Decompressor>> = const { RefCell::new(None) };
        }
        return TURBO.with(|cell| {
            let mut cell = cell.borrow_mut();
            if cell.is_none() {
                *cell = Some(turbojpeg::Decompressor::new().map_err(|e| decode_err(Box::new(e)))?);
            }
            let dec = cell.as_mut().expect("set above");
            let header = dec
                .read_header(bytes)
                .map_err(|e| decode_err(Box::new(e)))?;
            let (w, h) = (header.width, header.height);
            let mut pixels = vec![0u8; w * h * 3];
            let image = turbojpeg::Image {
                pixels: pixels.as_mut_slice(),
                width: w,
                pitch: w * 3,
                height: h,
                format: turbojpeg::PixelFormat::RGB,
            };
            dec.decompress(bytes, image)
                .map_err(|e| decode_err(Box::new(e)))?;
            Ok((w as u32, h as u32, pixels))
        });
    }
    let img = ::image::load_from_memory(bytes).map_err(|e| decode_err(Box::new(e)))?;
    let (w, h) = (img.width(), img.height());
    Ok((w, h, img.into_rgb8().into_raw()))
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

/// Transposes interleaved RGB (`H × W × 3`) into planes (`3 × H × W`).
fn hwc_to_chw(src: &[u8], dst: &mut [u8], plane: usize) {
    let (r, rest) = dst.split_at_mut(plane);
    let (g, b) = rest.split_at_mut(plane);
    for (i, px) in src.chunks_exact(3).enumerate() {
        r[i] = px[0];
        g[i] = px[1];
        b[i] = px[2];
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
