//! Pixel layout: flipping rows, normalising to `f32`, and the HWC → CHW transpose (SSSE3
//! where the CPU has it).

/// Mirrors one interleaved RGB row.
pub(super) fn flip_row(row: &mut [u8]) {
    let n = row.len() / 3;
    for i in 0..n / 2 {
        for k in 0..3 {
            row.swap(3 * i + k, 3 * (n - 1 - i) + k);
        }
    }
}

/// Writes `(x / 255 - mean) / std` as native-endian `f32`, channels first (CHW, planes of
/// `plane` pixels) or last (HWC).
pub(super) fn normalize_into(
    hwc: &[u8],
    out: &mut [u8],
    (mean, std): ([f32; 3], [f32; 3]),
    channels_first: bool,
    plane: usize,
) {
    let scale: [f32; 3] = std::array::from_fn(|c| 1.0 / (255.0 * std[c]));
    let shift: [f32; 3] = std::array::from_fn(|c| mean[c] / std[c]);
    let mut put = |i: usize, v: f32| out[4 * i..4 * i + 4].copy_from_slice(&v.to_ne_bytes());
    for (p, px) in hwc.chunks_exact(3).enumerate() {
        for c in 0..3 {
            let v = f32::from(px[c]) * scale[c] - shift[c];
            if channels_first {
                put(c * plane + p, v)
            } else {
                put(3 * p + c, v)
            }
        }
    }
}

/// Transposes interleaved RGB (`H × W × 3`) into planes (`3 × H × W`): 16 pixels at a time
/// with SSSE3 byte shuffles where the CPU has them (about 8× the scalar loop).
pub(super) fn hwc_to_chw(src: &[u8], dst: &mut [u8], plane: usize) {
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
