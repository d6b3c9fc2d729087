//! Geometry, as torchvision: the resized size, center-crop offsets, the random resized crop's
//! window, and the pixels a resize actually reads (so decoding can skip the rest).

/// torchvision's resized size for a `w × h` image and a shorter side of `size`.
pub(super) fn resized(w: u32, h: u32, size: u32) -> (u32, u32) {
    let (short, long) = if w <= h { (w, h) } else { (h, w) };
    let new_long = (size as u64 * long as u64 / short as u64) as u32;
    if w <= h {
        (size, new_long)
    } else {
        (new_long, size)
    }
}

/// torchvision's center-crop offset: `int(round((size - crop) / 2.0))`, half to even.
pub(super) fn crop_offset(size: u32, crop: u32) -> u32 {
    ((size as f64 - crop as f64) / 2.0).round_ties_even() as u32
}

/// A rectangle of whole pixels.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(super) struct Rect {
    pub(super) x: u32,
    pub(super) y: u32,
    pub(super) w: u32,
    pub(super) h: u32,
}

/// What a decoder is asked for: `rect`, in the coordinates of the image scaled by
/// `1 / denom` in the DCT domain (1: full size), and, from a decoder, what it produced.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(super) struct Plan {
    pub(super) rect: Rect,
    pub(super) denom: u32,
}

impl Plan {
    /// The whole `w × h` image at full size.
    pub(super) fn whole(w: u32, h: u32) -> Self {
        Plan {
            rect: Rect { x: 0, y: 0, w, h },
            denom: 1,
        }
    }
}

/// Draft mode's scale: the largest of 1/2, 1/4 and 1/8 (no larger denominator than
/// `max_denom`) at which `window` (width, height) still spans at least `crop` pixels each way,
/// so the resizer still only shrinks; 1 when none does. Pillow's `Image.draft` picks its scale
/// the same way.
pub(super) fn draft_denom(window: (f64, f64), crop: u32, max_denom: u32) -> u32 {
    let short = window.0.min(window.1);
    [8, 4, 2]
        .into_iter()
        .find(|&d| d <= max_denom && short / f64::from(d) >= f64::from(crop))
        .unwrap_or(1)
}

/// The pixels the resizer reads to turn `window` into a `crop`-sided square: the window and
/// the bilinear filter's reach around it (one output pixel's footprint, plus rounding), within
/// the `w × h` image. Decoding just these gives the same output as decoding everything.
pub(super) fn needed(window: (f64, f64, f64, f64), w: u32, h: u32, crop: u32) -> Rect {
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
pub(super) fn random_window(
    w: u32,
    h: u32,
    scale: (f64, f64),
    ratio: (f64, f64),
    rng: &mut flowgate_tuner::Rng,
) -> (f64, f64, f64, f64) {
    let (wf, hf) = (f64::from(w), f64::from(h));
    let area = wf * hf;
    let (lo, hi) = (ratio.0.ln(), ratio.1.ln());
    for _ in 0..10 {
        let target = area * (scale.0 + rng.uniform() * (scale.1 - scale.0));
        let aspect = (lo + rng.uniform() * (hi - lo)).exp();
        let cw = (target * aspect).sqrt().round();
        let ch = (target / aspect).sqrt().round();
        if cw > 0.0 && ch > 0.0 && cw <= wf && ch <= hf {
            let x = (rng.uniform() * (wf - cw + 1.0)).floor().min(wf - cw);
            let y = (rng.uniform() * (hf - ch + 1.0)).floor().min(hf - ch);
            return (x, y, cw, ch);
        }
    }
    let image_ratio = wf / hf;
    let (cw, ch) = if image_ratio < ratio.0 {
        (wf, (wf / ratio.0).round())
    } else if image_ratio > ratio.1 {
        ((hf * ratio.1).round(), hf)
    } else {
        (wf, hf)
    };
    (((wf - cw) / 2.0).floor(), ((hf - ch) / 2.0).floor(), cw, ch)
}
