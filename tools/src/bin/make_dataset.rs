//! Writes a seeded sample dataset: photo-like JPEGs, tonal FLAC or WAV clips, MP4 clips, plus
//! list files. The same generator as `flowgate gen-data` ([`flowgate::synth`]).
//!
//! ```text
//! cargo run --release -p flowgate-tools --bin make_dataset -- --out DIR [--images N] [--audio N]
//!     [--audio-format flac|wav] [--video N] [--seed S]
//! ```
//!
//! Images are around 500×375 (both orientations, a few sizes), quality 90, with smooth
//! gradients, shapes, edges and sensor-like noise so they compress and decode like photos.
//! Audio clips are 3–10 s of 16 kHz mono 16-bit audio with a few drifting tones and noise, as
//! FLAC (default, encoded with `flacenc`) or WAV. Video clips are 3–6 s MP4s, 320×240 at 25 fps
//! (H.264, a keyframe a second) with a moving pattern and a 16 kHz AAC tone, written with the
//! `ffmpeg` command (`scripts/setup.sh` installs it; no `video` feature needed).
//! `DIR/images.txt`, `DIR/audio.txt` and `DIR/video.txt` hold one absolute path per line; a list
//! is written only for a kind asked for.

use std::path::PathBuf;

use flowgate::synth::{write_dataset, DatasetSpec};

fn main() -> std::io::Result<()> {
    let mut spec = DatasetSpec::default();
    let mut out = None;
    let mut args = std::env::args().skip(1);
    while let Some(a) = args.next() {
        let mut value = || args.next().expect("a value");
        match a.as_str() {
            "--out" => out = Some(PathBuf::from(value())),
            "--images" => spec.images = value().parse().expect("a number"),
            "--audio" => spec.audio = value().parse().expect("a number"),
            "--video" => spec.video = value().parse().expect("a number"),
            "--seed" => spec.seed = value().parse().expect("a number"),
            "--audio-format" => {
                spec.flac = match value().as_str() {
                    "flac" => true,
                    "wav" => false,
                    other => panic!("--audio-format: flac or wav, not {other}"),
                }
            }
            other => panic!("unknown argument {other}; usage: make_dataset --out DIR [--images N] [--audio N] [--audio-format flac|wav] [--video N] [--seed S]"),
        }
    }
    spec.out = out.expect("--out DIR");
    let out = write_dataset(&spec)?;
    println!(
        "{{\"out\":\"{}\",\"images\":{},\"audio\":{},\"video\":{}}}",
        out.display(),
        spec.images,
        spec.audio,
        spec.video
    );
    Ok(())
}
