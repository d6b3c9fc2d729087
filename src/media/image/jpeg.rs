//! JPEG, PNG and WebP into interleaved RGB rows: libjpeg-turbo decoding only the region a
//! crop needs (feature `turbojpeg`, `libjpeg.c`), else zune-jpeg, else the `image` crate.

use std::path::Path;

use super::geometry::Plan;
use crate::media::MediaError;

/// The JPEG decoder in use: `"libjpeg-turbo"` (feature `turbojpeg`, where its headers were
/// found at build time, unless `FLOWGATE_JPEG_DECODER=zune-jpeg` asks otherwise) or
/// `"zune-jpeg"`.
pub fn jpeg_decoder() -> &'static str {
    if cfg!(flowgate_libjpeg) && !zune_asked() {
        "libjpeg-turbo"
    } else {
        "zune-jpeg"
    }
}

/// Whether `FLOWGATE_JPEG_DECODER=zune-jpeg` asks a build with libjpeg-turbo to decode JPEG
/// with zune-jpeg: the pure-Rust path a build without libjpeg-turbo runs, so its tests run in
/// the same build (`scripts/test.sh`), and a suspected decoder bug can be told from the other.
/// Read once; another value is said on stderr and ignored.
fn zune_asked() -> bool {
    static ASKED: std::sync::OnceLock<bool> = std::sync::OnceLock::new();
    *ASKED.get_or_init(|| match std::env::var("FLOWGATE_JPEG_DECODER") {
        Err(_) => false,
        Ok(v) if v == "zune-jpeg" => true,
        Ok(v) if v == "libjpeg-turbo" && cfg!(flowgate_libjpeg) => false,
        Ok(v) => {
            let have = match cfg!(flowgate_libjpeg) {
                true => "\"libjpeg-turbo\" or \"zune-jpeg\"",
                false => "\"zune-jpeg\" (built without libjpeg-turbo)",
            };
            eprintln!("flowgate: FLOWGATE_JPEG_DECODER={v:?} ignored: this build decodes JPEG with {have}");
            false
        }
    })
}

/// Decodes the part of an image that `geometry` asks for, or more, into `pixels` as
/// interleaved RGB rows, and says which part that is, at which scale. `geometry` is given the
/// image's width and height and the largest DCT-scaling denominator the decoder offers (1:
/// none), and answers with a [`Plan`]: the rectangle in the coordinates of the image scaled by
/// the plan's denominator.
///
/// JPEG with libjpeg-turbo (feature `turbojpeg`) decodes only the rows and iMCU columns asked
/// for, at 1/1, 1/2, 1/4 or 1/8 scale; JPEG with zune-jpeg, and PNG and WebP with the `image`
/// crate, decode everything at full size.
pub(super) fn decode_rgb(
    bytes: &[u8],
    path: &Path,
    pixels: &mut Vec<u8>,
    geometry: impl FnOnce(u32, u32, u32) -> Result<Plan, MediaError>,
) -> Result<Plan, MediaError> {
    let decode_err = |source: Box<dyn std::error::Error + Send + Sync>| MediaError::Decode {
        path: path.to_path_buf(),
        source,
    };
    let is_jpeg = bytes.starts_with(&[0xFF, 0xD8, 0xFF]);
    #[cfg(flowgate_libjpeg)]
    if is_jpeg && !zune_asked() {
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
            // JPEG's own ceiling; the pixel limit is checked (by `geometry`) before anything
            // the size of the image is allocated.
            .set_max_width(usize::from(u16::MAX))
            .set_max_height(usize::from(u16::MAX))
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
            geometry(w, h, 1)?;
            let len = dec.output_buffer_size().expect("headers were decoded");
            // Stale pixels from the last image are fine: the decoder writes every byte.
            pixels.resize(len.max(pixels.len()), 0);
            dec.decode_into(pixels)
                .map_err(|e| decode_err(format!("{e:?}").into()))?;
            return Ok(Plan::whole(w, h));
        }
    }
    decode_any(bytes, pixels, geometry, decode_err)
}

/// Any format the `image` crate reads, whole. The header's dimensions go through `geometry`
/// (which enforces the pixel limit) before anything is decoded, and the decoder may allocate
/// no more than an RGBA image of those dimensions, so a file whose data disagrees with its
/// header cannot allocate more either.
fn decode_any(
    bytes: &[u8],
    pixels: &mut Vec<u8>,
    geometry: impl FnOnce(u32, u32, u32) -> Result<Plan, MediaError>,
    decode_err: impl Fn(Box<dyn std::error::Error + Send + Sync>) -> MediaError,
) -> Result<Plan, MediaError> {
    let reader = || {
        ::image::ImageReader::new(std::io::Cursor::new(bytes))
            .with_guessed_format()
            .map_err(|e| decode_err(Box::new(e)))
    };
    let (w, h) = reader()?
        .into_dimensions()
        .map_err(|e| decode_err(Box::new(e)))?;
    geometry(w, h, 1)?;
    let mut limits = ::image::Limits::default();
    limits.max_image_width = Some(w);
    limits.max_image_height = Some(h);
    // 16-bit RGBA is the widest buffer a decoder makes for these formats.
    limits.max_alloc = Some(u64::from(w) * u64::from(h) * 8 + DECODER_SLACK);
    let mut r = reader()?;
    r.limits(limits);
    let img = r.decode().map_err(|e| decode_err(Box::new(e)))?;
    if (img.width(), img.height()) != (w, h) {
        return Err(decode_err(
            format!(
                "the header says {w}x{h}, the data {}x{}",
                img.width(),
                img.height()
            )
            .into(),
        ));
    }
    *pixels = img.into_rgb8().into_raw();
    Ok(Plan::whole(w, h))
}

/// What a decoder of the `image` crate may allocate besides the image itself (palettes,
/// row buffers, compressed-stream windows).
const DECODER_SLACK: u64 = 16 << 20;

/// libjpeg-turbo through `libjpeg.c` (built by build.rs).
#[cfg(flowgate_libjpeg)]
mod libjpeg {
    use super::super::geometry::Rect;
    use super::{MediaError, Plan};
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
            denom: c_uint,
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
        Done(Result<Plan, MediaError>),
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
        G: FnOnce(u32, u32, u32) -> Result<Plan, MediaError>,
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
            let Plan { rect: want, denom } = match geometry(w, h, 8) {
                Ok(p) => p,
                Err(e) => {
                    // SAFETY: ends the decode whose header was read.
                    unsafe { fg_jpeg_abort(d) };
                    return Outcome::Done(Err(e));
                }
            };
            // Columns widen to iMCU boundaries (at most 32 pixels each side) of the image
            // scaled by 1/denom.
            let w = w.div_ceil(denom);
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
                    denom,
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
            Outcome::Done(Ok(Plan {
                rect: Rect {
                    x: out_x,
                    y: want.y,
                    w: out_w,
                    h: want.h,
                },
                denom,
            }))
        })
    }
}

/// Whether JPEG data ends with an end-of-image marker (FF D9), allowing for up to
/// [`JPEG_TAIL`] bytes of trailing padding. Entropy-coded data stuffs every FF byte, so FF D9
/// near the end can only be the marker.
pub(super) fn has_jpeg_end(bytes: &[u8]) -> bool {
    let tail = &bytes[bytes.len().saturating_sub(JPEG_TAIL)..];
    tail.windows(2).any(|w| w == [0xFF, 0xD9])
}

/// Trailing bytes after a JPEG's end marker that are tolerated (padding some writers add).
const JPEG_TAIL: usize = 1024;
