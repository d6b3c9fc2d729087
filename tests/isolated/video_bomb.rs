//! A video whose frames are larger than the pixel limit is refused before FFmpeg decodes one:
//! not only by flowgate's own check, but in FFmpeg's stream probe (`avformat_find_stream_info`
//! decodes frames to learn the stream's parameters), which is told the limit too. Measured on
//! the process's peak RSS (this file holds one test, so nothing else runs meanwhile).

use std::path::Path;
use std::process::Command;

use flowgate::media::video::{Sampling, VideoRecipe};
use flowgate::media::MediaError;

use crate::common;
use common::{peak_rss, reset_peak_rss};

/// Two black `side`² H.264 frames (8000: a ~100 KB file, each decoded frame 96 MB of YUV).
fn black_clip(path: &Path, side: u32) {
    let ok = Command::new("ffmpeg")
        .args(["-loglevel", "error", "-y", "-f", "lavfi", "-i"])
        .arg(format!("color=black:s={side}x{side}:d=0.08:r=25"))
        .args([
            "-c:v",
            "libx264",
            "-preset",
            "ultrafast",
            "-pix_fmt",
            "yuv420p",
        ])
        .arg(path)
        .status()
        .expect("ffmpeg (scripts/setup.sh installs it)")
        .success();
    assert!(ok, "ffmpeg failed to make the clip");
}

#[test]
fn frames_past_the_pixel_limit_are_refused_before_ffmpeg_decodes_one() {
    isolate!();
    let dir = std::env::temp_dir().join(format!("flowgate-video-bomb-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let clip = dir.join("huge.mp4");
    black_clip(&clip, 8000);
    let recipe = VideoRecipe {
        sampling: Sampling::Uniform(2),
        resize: 64,
        crop: 64,
        limits: flowgate::media::Limits {
            max_pixels: 1 << 24,
            ..Default::default()
        },
        ..Default::default()
    };
    // Warm up FFmpeg's and the allocator's one-time state on a small clip of the same kind.
    let small = dir.join("small.mp4");
    black_clip(&small, 64);
    recipe.load(&small).expect("a small clip decodes");
    reset_peak_rss();
    let before = peak_rss();
    match recipe.load(&clip) {
        Err(MediaError::TooLarge {
            what,
            value,
            limit,
            path,
        }) => {
            assert_eq!((what, value, limit), ("pixels", 64_000_000, 1 << 24));
            assert!(path.ends_with("huge.mp4"));
        }
        other => panic!("{other:?}"),
    }
    let grew = peak_rss().saturating_sub(before);
    let _ = std::fs::remove_dir_all(&dir);
    assert!(
        grew < 40 << 20,
        "peak RSS grew {} MB refusing an 8000x8000 clip (a decoded frame is 96 MB)",
        grew >> 20
    );
}
