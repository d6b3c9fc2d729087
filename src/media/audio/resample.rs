//! Resampling a decoded window to the recipe's rate (band-limited, FFT-based, with `rubato`).

use super::f32_slice_mut;
use crate::tensor::{DType, Tensor};

/// Frames per resampler chunk.
pub(super) const RESAMPLE_CHUNK: usize = 1024;

/// Resamples the first `filled` frames of each plane from `from` Hz to `to` Hz (FFT-based,
/// band-limited: `rubato::FftFixedIn`) into a `[planes, samples]` tensor, zero past the
/// resampled end.
pub(super) fn resample(
    planes: &[&[f32]],
    filled: usize,
    from: u32,
    to: u32,
    samples: usize,
) -> Result<Tensor, String> {
    use rubato::Resampler;
    let n = planes.len();
    let mut r = rubato::FftFixedIn::<f32>::new(from as usize, to as usize, RESAMPLE_CHUNK, 2, n)
        .map_err(|e| e.to_string())?;
    let delay = r.output_delay();
    // The output's real length; past it, the resampler's tail of silence.
    let real = ((filled as u64 * u64::from(to)).div_ceil(u64::from(from)) as usize).min(samples);
    let want = delay + real;
    let mut outs: Vec<Vec<f32>> = vec![Vec::with_capacity(want + 2 * RESAMPLE_CHUNK); n];
    let mut pos = 0;
    while outs[0].len() < want {
        let need = r.input_frames_next();
        let chunk = if pos + need <= filled {
            let input: Vec<&[f32]> = planes.iter().map(|p| &p[pos..pos + need]).collect();
            pos += need;
            r.process(&input, None).map_err(|e| e.to_string())?
        } else if pos < filled {
            let input: Vec<&[f32]> = planes.iter().map(|p| &p[pos..filled]).collect();
            pos = filled;
            r.process_partial(Some(&input), None)
                .map_err(|e| e.to_string())?
        } else {
            r.process_partial::<&[f32]>(None, None)
                .map_err(|e| e.to_string())?
        };
        for (o, c) in outs.iter_mut().zip(chunk) {
            o.extend_from_slice(&c);
        }
    }
    let mut t = Tensor::zeros(&[n, samples], DType::F32);
    let out = f32_slice_mut(&mut t);
    for (c, o) in outs.iter().enumerate() {
        out[c * samples..c * samples + real].copy_from_slice(&o[delay..delay + real]);
    }
    Ok(t)
}
