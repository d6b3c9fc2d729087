//! Synthetic media for sample datasets and tests.
//!
//! [`write_clip`] writes a short MP4 (H.264 video, optionally an AAC tone) with the `ffmpeg`
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
