//! Synthetic media for sample datasets and tests.
//!
//! [`write_dataset`] writes the sample dataset that `flowgate gen-data` and
//! `tools/src/bin/make_dataset.rs` produce: photo-like JPEGs, tonal FLAC or WAV clips, MP4 clips, and
//! list files. [`write_clip`] writes a short MP4 (H.264 video, optionally an AAC tone) with the `ffmpeg`
//! command, which `scripts/setup.sh` installs: encoding is a dataset-generation chore, not a
//! loader's job, so the library does not link an encoder for it.

use std::io::Write;
use std::path::Path;
use std::process::{Command, Stdio};

/// What [`write_clip`] draws.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct ClipSpec {
    /// Frame width (even).
    pub width: u32,
    /// Frame height (even).
    pub height: u32,
    /// Frames per second.
    pub fps: u32,
    /// Frames.
    pub frames: u32,
    /// Keyframe interval in frames.
    pub gop: u32,
    /// A moving pattern over the background (`false`: flat frames, for exact content checks).
    pub pattern: bool,
    /// Varies the pattern and the tone.
    pub seed: u64,
    /// The sample rate of an AAC tone track (`None`: no audio).
    pub audio_rate: Option<u32>,
}

impl Default for ClipSpec {
    /// 320×240, 25 fps, 3 s, a keyframe every 25 frames, a moving pattern, 16 kHz audio.
    fn default() -> Self {
        Self {
            width: 320,
            height: 240,
            fps: 25,
            frames: 75,
            gop: 25,
            pattern: true,
            seed: 0,
            audio_rate: Some(16_000),
        }
    }
}

/// The grey level of frame `i` of `n`: a ramp from 0 to 250, so each frame is recognisable by
/// its mean.
pub fn clip_level(i: u32, n: u32) -> u8 {
    (u64::from(i) * 250 / u64::from(n.saturating_sub(1).max(1))) as u8
}

/// Writes `spec`'s clip to `path` (the container follows the extension, e.g. `.mp4`).
pub fn write_clip(path: &Path, spec: &ClipSpec) -> std::io::Result<()> {
    let (w, h) = (spec.width as usize, spec.height as usize);
    let seconds = f64::from(spec.frames) / f64::from(spec.fps.max(1));
    let mut cmd = Command::new("ffmpeg");
    cmd.args([
        "-y",
        "-loglevel",
        "error",
        "-f",
        "rawvideo",
        "-pix_fmt",
        "rgb24",
    ])
    .args([
        "-s",
        &format!("{w}x{h}"),
        "-r",
        &spec.fps.to_string(),
        "-i",
        "-",
    ]);
    if let Some(rate) = spec.audio_rate {
        let freq = 220 + spec.seed % 660;
        cmd.args(["-f", "lavfi", "-i"]).arg(format!(
            "sine=frequency={freq}:sample_rate={rate}:duration={seconds}"
        ));
    }
    cmd.args([
        "-c:v", "libx264", "-preset", "veryfast", "-pix_fmt", "yuv420p",
    ])
    .args([
        "-g",
        &spec.gop.to_string(),
        "-keyint_min",
        &spec.gop.to_string(),
    ]);
    if spec.audio_rate.is_some() {
        cmd.args(["-c:a", "aac", "-b:a", "64k"]);
    }
    cmd.arg(path)
        .stdin(Stdio::piped())
        .stdout(Stdio::null())
        .stderr(Stdio::piped());
    let mut child = cmd.spawn().map_err(|e| {
        std::io::Error::new(
            e.kind(),
            format!("running ffmpeg (scripts/setup.sh installs it): {e}"),
        )
    })?;
    let mut stdin = child.stdin.take().expect("piped");
    let mut frame = vec![0u8; w * h * 3];
    for i in 0..spec.frames {
        let level = clip_level(i, spec.frames);
        frame.fill(level);
        if spec.pattern {
            // A square moving across, its colour and speed set by the seed.
            let side = h / 4;
            let speed = 2 + (spec.seed % 5) as usize;
            let x0 = (i as usize * speed) % (w - side);
            let y0 = (h - side) / 2 + ((spec.seed as usize % 3) * side / 4);
            let colour = [(spec.seed * 37) as u8, 255 - level, (spec.seed * 91) as u8];
            for y in y0..(y0 + side).min(h) {
                for x in x0..x0 + side {
                    frame[(y * w + x) * 3..][..3].copy_from_slice(&colour);
                }
            }
        }
        if stdin.write_all(&frame).is_err() {
            break; // ffmpeg failed; its message comes below
        }
    }
    drop(stdin);
    let out = child.wait_with_output()?;
    if !out.status.success() {
        return Err(std::io::Error::other(format!(
            "ffmpeg failed writing {}: {}",
            path.display(),
            String::from_utf8_lossy(&out.stderr).trim()
        )));
    }
    Ok(())
}

/// What [`write_dataset`] writes.
#[derive(Clone, Debug, PartialEq)]
pub struct DatasetSpec {
    /// The folder (created if missing).
    pub out: std::path::PathBuf,
    /// Photo-like JPEGs (about 500×375, quality 90).
    pub images: usize,
    /// Tonal clips at 16 kHz, `audio_seconds` long.
    pub audio: usize,
    /// The clips' lengths: uniform between these seconds (3–10 by default; 1–30 makes the
    /// spread length-aware batching is for).
    pub audio_seconds: (f64, f64),
    /// FLAC (else WAV).
    pub flac: bool,
    /// 3–6 s MP4 clips (needs the `ffmpeg` command).
    pub video: usize,
    /// With images: also write them as WebDataset tar shards of this many samples
    /// (`shards/shard-NNNNNN.tar`: `KEY.jpg`, `KEY.cls` = the image's number modulo 1000,
    /// `KEY.json`), and their brace pattern to `shards.txt`; 0: no shards. With the `parquet`
    /// feature, also `images.parquet` (the Hugging Face layout: `image: struct<bytes, path>`,
    /// `label` as in the shards).
    pub shards: usize,
    /// Seeds everything.
    pub seed: u64,
}

impl Default for DatasetSpec {
    fn default() -> Self {
        Self {
            out: "target/sample-data".into(),
            images: 1000,
            audio: 0,
            audio_seconds: (3.0, 10.0),
            flac: true,
            video: 0,
            shards: 0,
            seed: 0,
        }
    }
}

/// Writes `spec`'s dataset: `images/`, `audio/`, `video/` and the lists `images.txt`,
/// `audio.txt`, `video.txt` of absolute paths (and, if asked, `shards/` and `shards.txt`) (a list is written only for a kind asked for, so
/// generating audio later keeps the images' list). Returns the absolute output folder.
pub fn write_dataset(spec: &DatasetSpec) -> std::io::Result<std::path::PathBuf> {
    write_dataset_with_progress(spec, |_, _, _| {})
}

/// [`write_dataset`], calling `progress(kind, done, total)` after each file (`kind`:
/// `"images"`, `"shards"`, `"audio"` or `"video"`). An error names the path it is about.
pub fn write_dataset_with_progress(
    spec: &DatasetSpec,
    mut progress: impl FnMut(&str, usize, usize),
) -> std::io::Result<std::path::PathBuf> {
    let at = |path: &std::path::Path| {
        let path = path.to_path_buf();
        move |e: std::io::Error| std::io::Error::new(e.kind(), format!("{}: {e}", path.display()))
    };
    use image::codecs::jpeg::JpegEncoder;
    let DatasetSpec {
        out,
        images,
        audio,
        audio_seconds,
        flac,
        video,
        shards,
        seed,
    } = spec.clone();
    std::fs::create_dir_all(&out).map_err(at(&out))?;
    let out = std::fs::canonicalize(&out).map_err(at(&out))?;
    if images > 0 {
        std::fs::create_dir_all(out.join("images")).map_err(at(&out.join("images")))?;
        let mut list = String::new();
        let mut paths = Vec::with_capacity(images);
        for i in 0..images {
            let mut rng = Rng::new(seed.wrapping_mul(1_000_003) ^ i as u64);
            let img = photo(&mut rng);
            let path = out.join("images").join(format!("{i:06}.jpg"));
            let mut f = std::io::BufWriter::new(std::fs::File::create(&path).map_err(at(&path))?);
            JpegEncoder::new_with_quality(&mut f, 90)
                .encode_image(&img)
                .map_err(std::io::Error::other)
                .map_err(at(&path))?;
            list.push_str(&format!("{}\n", path.display()));
            paths.push(path);
            progress("images", i + 1, images);
        }
        std::fs::write(out.join("images.txt"), list).map_err(at(&out.join("images.txt")))?;
        if shards > 0 {
            let dir = out.join("shards");
            let _ = std::fs::remove_dir_all(&dir);
            let pattern = crate::dataset::shards::write_shards(&paths, &dir, shards, |i, _| {
                (i % 1000) as i64
            })
            .map_err(at(&dir))?;
            progress("shards", paths.len(), paths.len());
            std::fs::write(out.join("shards.txt"), format!("{pattern}\n"))
                .map_err(at(&out.join("shards.txt")))?;
        }
        // The same images as Parquet rows (the Hugging Face layout), labelled alike.
        #[cfg(feature = "parquet")]
        if shards > 0 {
            let path = out.join("images.parquet");
            crate::dataset::parquet::write_parquet(&paths, &path, 100, |i, _| (i % 1000) as i64)
                .map_err(at(&path))?;
            progress("parquet", paths.len(), paths.len());
        }
    }
    if audio > 0 {
        std::fs::create_dir_all(out.join("audio")).map_err(at(&out.join("audio")))?;
        let mut list = String::new();
        for i in 0..audio {
            let mut rng = Rng::new(seed.wrapping_mul(2_000_003) ^ i as u64 ^ 0xA0D10);
            let samples = clip(&mut rng, 16_000, audio_seconds);
            let path = out
                .join("audio")
                .join(format!("{i:06}.{}", if flac { "flac" } else { "wav" }));
            if flac {
                write_flac(&path, 16_000, &samples).map_err(at(&path))?;
            } else {
                write_wav(&path, 16_000, &samples).map_err(at(&path))?;
            }
            list.push_str(&format!("{}\n", path.display()));
            progress("audio", i + 1, audio);
        }
        std::fs::write(out.join("audio.txt"), list).map_err(at(&out.join("audio.txt")))?;
    }
    if video > 0 {
        std::fs::create_dir_all(out.join("video")).map_err(at(&out.join("video")))?;
        let mut list = String::new();
        for i in 0..video {
            let mut rng = Rng::new(seed.wrapping_mul(3_000_017) ^ i as u64 ^ 0x71DE0);
            let path = out.join("video").join(format!("{i:06}.mp4"));
            let clip = ClipSpec {
                frames: 75 + (rng.next_u64() % 76) as u32,
                seed: rng.next_u64() % 1000,
                ..ClipSpec::default()
            };
            write_clip(&path, &clip).map_err(at(&path))?;
            list.push_str(&format!("{}\n", path.display()));
            progress("video", i + 1, video);
        }
        std::fs::write(out.join("video.txt"), list).map_err(at(&out.join("video.txt")))?;
    }
    Ok(out)
}

use flowgate_tuner::Rng;
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

fn clip(rng: &mut Rng, rate: u32, (lo, hi): (f64, f64)) -> Vec<i16> {
    let secs = lo + (hi - lo).max(0.0) * rng.uniform();
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
