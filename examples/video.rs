//! Multimodal video input: from each MP4, 8 frames sampled uniformly (scaled, center-cropped,
//! `u8` NTHWC) and the clip's audio track (16 kHz mono `f32`), batched field by field.
//!
//! ```text
//! cargo run --release -p flowgate-tools --bin make_dataset -- --out target/sample-data --images 0 --video 40
//! cargo run --release --features video --example video -- [--list target/sample-data/video.txt]
//!     [--epochs 2] [--batch 8] [--frames 8]
//! ```

use std::path::PathBuf;
use std::time::Instant;

use flowgate::dataset::Files;
use flowgate::media::audio::AudioRecipe;
use flowgate::media::video::{Sampling, VideoRecipe};
use flowgate::media::MediaError;
use flowgate::sample::{FieldBatch, Sample};
use flowgate::{Pipeline, PipelineError};

fn main() -> Result<(), PipelineError> {
    let mut list = PathBuf::from("target/sample-data/video.txt");
    let (mut epochs, mut batch, mut frames) = (2u64, 8usize, 8usize);
    let mut args = std::env::args().skip(1);
    while let Some(flag) = args.next() {
        let v = args.next().unwrap_or_default();
        let bad = || PipelineError::config(format!("{flag}: {v}"));
        match flag.as_str() {
            "--list" => list = v.clone().into(),
            "--epochs" => epochs = v.parse().map_err(|_| bad())?,
            "--batch" => batch = v.parse().map_err(|_| bad())?,
            "--frames" => frames = v.parse().map_err(|_| bad())?,
            _ => return Err(PipelineError::config(format!("unknown flag {flag}"))),
        }
    }
    let files = Files::list(&list)
        .map_err(|e| {
            PipelineError::config(format!(
                "{e} (make one: cargo run --release -p flowgate-tools --bin make_dataset -- --out target/sample-data --images 0 --video 40)"
            ))
        })?
        .shuffle(0)
        .shard_from_env()?;
    let video = VideoRecipe {
        sampling: Sampling::Uniform(frames),
        ..VideoRecipe::default()
    };
    let audio = AudioRecipe {
        samples: 48_000, // 3 s at 16 kHz
        ..AudioRecipe::default()
    };
    let n = files.len();
    let mut pipeline = Pipeline::builder()
        .source_epochs(move |epoch| files.epoch(epoch))
        .describe(|p| p.display().to_string())
        .pipe(
            "decode",
            move |path: PathBuf| -> Result<Sample, MediaError> {
                Ok(Sample::new()
                    .with("frames", video.load(&path)?)
                    .with("audio", audio.load(&path)?))
            },
            1,
        )
        .measure(Sample::nbytes)
        .aggregate(batch, false)
        .pipe("collate", FieldBatch::collate, 1)
        .build()?;
    println!("{n} clips → {frames} frames + 3 s of audio each, batches of {batch}");
    for epoch in 0..epochs {
        let started = Instant::now();
        let mut clips = 0;
        let mut shapes = (Vec::new(), Vec::new());
        for b in pipeline.iter() {
            let b = b?;
            shapes = (
                b.tensor("frames").expect("frames").shape().to_vec(),
                b.tensor("audio").expect("audio").shape().to_vec(),
            );
            clips += b.len();
        }
        let secs = started.elapsed().as_secs_f64();
        let stats = pipeline.stats();
        println!(
            "epoch {epoch}: {clips} clips in {secs:.2} s = {:.1} clips/s; frames {:?} u8, audio {:?} f32; decode workers {}; {} failed",
            clips as f64 / secs,
            shapes.0,
            shapes.1,
            stats.stage("decode").map_or(0, |s| s.workers),
            stats.failures
        );
    }
    Ok(())
}
