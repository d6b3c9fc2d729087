//! Writes a seeded sample dataset: photo-like JPEGs and tonal WAV clips, plus list files.
//!
//! ```text
//! cargo run --release --example make_dataset -- --out DIR [--images N] [--audio N]
//!     [--audio-format flac|wav] [--video N] [--seed S]
//! ```
//!
//! Images are around 500×375 (both orientations, a few sizes), quality 90, with smooth
//! gradients, shapes, edges and sensor-like noise so they compress and decode like photos.
//! Audio clips are 3–10 s of 16 kHz mono 16-bit audio with a few drifting tones and noise, as
//! FLAC (default, encoded with `flacenc`) or WAV. The lists
//! `DIR/images.txt`, `DIR/audio.txt` and `DIR/video.txt` hold one absolute path per line.
//! Video clips are 3–6 s MP4s, 320×240 at 25 fps (H.264, a keyframe a second) with a moving
//! pattern and a 16 kHz AAC tone, written with the `ffmpeg` command (`scripts/setup.sh`
//! installs it; no `video` feature needed).

use std::io::Write;
use std::path::{Path, PathBuf};

use flowgate::media::synth::{write_clip, ClipSpec};
use flowgate::tuner::Rng;
use image::codecs::jpeg::JpegEncoder;
use image::{Rgb, RgbImage};

const SIZES: [(u32, u32); 4] = [(500, 375), (375, 500), (500, 333), (480, 360)];

fn photo(rng: &mut Rng) -> RgbImage {
    let (w, h) = SIZES[(rng.next_u64() % SIZES.len() as u64) as usize];
    let mut f = || rng.uniform();
    // Low-frequency colour fields.
    let waves: Vec<[f64; 4]> = (0..9)
        .map(|_| {
            [
                f() * 0.03,
                f() * 0.03,
                f() * std::f64::consts::TAU,
                40.0 + 60.0 * f(),
            ]
        })
        .collect();
    let base: [f64; 3] = [60.0 + 120.0 * f(), 60.0 + 120.0 * f(), 60.0 + 120.0 * f()];
    // A few solid shapes with hard edges.
    let shapes: Vec<(f64, f64, f64, [f64; 3])> = (0..6)
        .map(|_| {
            (
                f() * w as f64,
                f() * h as f64,
                20.0 + 80.0 * f(),
                [255.0 * f(), 255.0 * f(), 255.0 * f()],
            )
        })
        .collect();
    let mut img = RgbImage::new(w, h);
    for (x, y, px) in img.enumerate_pixels_mut() {
        let (xf, yf) = (x as f64, y as f64);
        let mut c = base;
        for (k, wv) in waves.iter().enumerate() {
            c[k % 3] += wv[3] * (wv[0] * xf + wv[1] * yf + wv[2]).sin();
        }
        for &(cx, cy, r, col) in &shapes {
            if (xf - cx).powi(2) + (yf - cy).powi(2) < r * r {
                c = col;
            }
        }
        *px = Rgb(c.map(|v| v.clamp(0.0, 255.0) as u8));
    }
    // Sensor noise.
    for px in img.pixels_mut() {
        for ch in px.0.iter_mut() {
            let n = (rng.normal() * 6.0) as i32;
            *ch = (*ch as i32 + n).clamp(0, 255) as u8;
        }
    }
    img
}

fn write_wav(path: &Path, rate: u32, samples: &[i16]) -> std::io::Result<()> {
    let mut f = std::io::BufWriter::new(std::fs::File::create(path)?);
    let data = (samples.len() * 2) as u32;
    f.write_all(b"RIFF")?;
    f.write_all(&(36 + data).to_le_bytes())?;
    f.write_all(b"WAVEfmt ")?;
    f.write_all(&16u32.to_le_bytes())?;
    f.write_all(&1u16.to_le_bytes())?; // PCM
    f.write_all(&1u16.to_le_bytes())?; // mono
    f.write_all(&rate.to_le_bytes())?;
    f.write_all(&(rate * 2).to_le_bytes())?;
    f.write_all(&2u16.to_le_bytes())?;
    f.write_all(&16u16.to_le_bytes())?;
    f.write_all(b"data")?;
    f.write_all(&data.to_le_bytes())?;
    for s in samples {
        f.write_all(&s.to_le_bytes())?;
    }
    f.flush()
}

fn write_flac(path: &Path, rate: u32, samples: &[i16]) -> std::io::Result<()> {
    use flacenc::component::BitRepr;
    use flacenc::error::Verify;
    let config = flacenc::config::Encoder::default()
        .into_verified()
        .map_err(|e| std::io::Error::other(format!("{e:?}")))?;
    let wide: Vec<i32> = samples.iter().map(|&s| i32::from(s)).collect();
    let source = flacenc::source::MemSource::from_samples(&wide, 1, 16, rate as usize);
    let stream = flacenc::encode_with_fixed_block_size(&config, source, config.block_size)
        .map_err(|e| std::io::Error::other(format!("{e:?}")))?;
    let mut sink = flacenc::bitsink::ByteSink::new();
    stream
        .write(&mut sink)
        .map_err(|e| std::io::Error::other(format!("{e:?}")))?;
    std::fs::write(path, sink.as_slice())
}

fn clip(rng: &mut Rng, rate: u32) -> Vec<i16> {
    let secs = 3.0 + 7.0 * rng.uniform();
    let n = (secs * rate as f64) as usize;
    let tones: Vec<(f64, f64, f64)> = (0..3)
        .map(|_| {
            (
                120.0 + 900.0 * rng.uniform(),
                0.2 * rng.uniform(),
                0.1 + 0.2 * rng.uniform(),
            )
        })
        .collect();
    (0..n)
        .map(|i| {
            let t = i as f64 / rate as f64;
            let mut v = 0.02 * rng.normal();
            for &(f0, drift, amp) in &tones {
                v += amp * (std::f64::consts::TAU * f0 * t * (1.0 + drift * t / secs)).sin();
            }
            (v.clamp(-1.0, 1.0) * 30_000.0) as i16
        })
        .collect()
}

fn main() -> std::io::Result<()> {
    let (mut out, mut images, mut audio, mut seed) = (None, 1000usize, 0usize, 0u64);
    let mut video = 0usize;
    let mut flac = true;
    let mut args = std::env::args().skip(1);
    while let Some(a) = args.next() {
        let mut value = || args.next().expect("a value");
        match a.as_str() {
            "--out" => out = Some(PathBuf::from(value())),
            "--images" => images = value().parse().expect("a number"),
            "--audio" => audio = value().parse().expect("a number"),
            "--seed" => seed = value().parse().expect("a number"),
            "--audio-format" => {
                flac = match value().as_str() {
                    "flac" => true,
                    "wav" => false,
                    other => panic!("--audio-format: flac or wav, not {other}"),
                }
            }
            "--video" => video = value().parse().expect("a number"),
            other => panic!("unknown argument {other}; usage: make_dataset --out DIR [--images N] [--audio N] [--audio-format flac|wav] [--video N] [--seed S]"),
        }
    }
    let out = out.expect("--out DIR");
    std::fs::create_dir_all(out.join("images"))?;
    std::fs::create_dir_all(out.join("audio"))?;
    let out = std::fs::canonicalize(&out)?;
    let mut list = String::new();
    for i in 0..images {
        let mut rng = Rng::new(seed.wrapping_mul(1_000_003) ^ i as u64);
        let img = photo(&mut rng);
        let path = out.join("images").join(format!("{i:06}.jpg"));
        let mut f = std::io::BufWriter::new(std::fs::File::create(&path)?);
        JpegEncoder::new_with_quality(&mut f, 90)
            .encode_image(&img)
            .map_err(std::io::Error::other)?;
        list.push_str(&format!("{}\n", path.display()));
    }
    // A list is written only for what was asked for: generating audio later keeps the images'.
    if images > 0 {
        std::fs::write(out.join("images.txt"), list)?;
    }
    let mut list = String::new();
    for i in 0..audio {
        let mut rng = Rng::new(seed.wrapping_mul(2_000_003) ^ i as u64 ^ 0xA0D10);
        let samples = clip(&mut rng, 16_000);
        let path = out
            .join("audio")
            .join(format!("{i:06}.{}", if flac { "flac" } else { "wav" }));
        if flac {
            write_flac(&path, 16_000, &samples)?;
        } else {
            write_wav(&path, 16_000, &samples)?;
        }
        list.push_str(&format!("{}\n", path.display()));
    }
    if audio > 0 {
        std::fs::write(out.join("audio.txt"), list)?;
    }
    let mut list = String::new();
    if video > 0 {
        std::fs::create_dir_all(out.join("video"))?;
    }
    for i in 0..video {
        let mut rng = Rng::new(seed.wrapping_mul(3_000_017) ^ i as u64 ^ 0x71DE0);
        let path = out.join("video").join(format!("{i:06}.mp4"));
        let spec = ClipSpec {
            frames: 75 + (rng.next_u64() % 76) as u32,
            seed: rng.next_u64() % 1000,
            ..ClipSpec::default()
        };
        write_clip(&path, &spec)?;
        list.push_str(&format!("{}\n", path.display()));
    }
    if video > 0 {
        std::fs::write(out.join("video.txt"), list)?;
    }
    println!(
        "{{\"out\":\"{}\",\"images\":{images},\"audio\":{audio},\"video\":{video}}}",
        out.display()
    );
    Ok(())
}
