//! Speech-style training input: audio files of any supported format and rate → 16 kHz mono
//! `f32` crops of `--seconds` (from the start, or with `--train` at a random offset that changes
//! every epoch), batched with each clip's true length.
//!
//! ```text
//! cargo run --release -p flowgate-tools --bin make_dataset -- --out target/sample-data --images 0 --audio 200
//! cargo run --release --example audio -- [--list target/sample-data/audio.txt] [--epochs 2]
//!     [--batch 32] [--rate 16000] [--seconds 4] [--train]
//! ```
//!
//! Files at another rate are resampled; shorter clips are zero-padded, and the batch's `length`
//! field says how many samples of each row are real (for masking).

use std::path::PathBuf;
use std::time::Instant;

use flowgate::dataset::Files;
use flowgate::media::audio::AudioRecipe;
use flowgate::media::MediaError;
use flowgate::sample::{FieldBatch, Sample};
use flowgate::{Pipeline, PipelineError};

fn main() -> Result<(), PipelineError> {
    let mut list = PathBuf::from("target/sample-data/audio.txt");
    let (mut epochs, mut batch, mut rate, mut seconds) = (2u64, 32usize, 16_000u32, 4.0f64);
    let mut train = false;
    let mut args = std::env::args().skip(1);
    while let Some(flag) = args.next() {
        if flag == "--train" {
            train = true;
            continue;
        }
        let v = args.next().unwrap_or_default();
        let bad = || PipelineError::config(format!("{flag}: {v}"));
        match flag.as_str() {
            "--list" => list = v.clone().into(),
            "--epochs" => epochs = v.parse().map_err(|_| bad())?,
            "--batch" => batch = v.parse().map_err(|_| bad())?,
            "--rate" => rate = v.parse().map_err(|_| bad())?,
            "--seconds" => seconds = v.parse().map_err(|_| bad())?,
            _ => return Err(PipelineError::config(format!("unknown flag {flag}"))),
        }
    }
    let files = Files::list(&list)
        .map_err(|e| {
            PipelineError::config(format!(
                "{e} (make one: cargo run --release -p flowgate-tools --bin make_dataset -- --out target/sample-data --images 0 --audio 200)"
            ))
        })?
        .shuffle(0)
        .shard_from_env()?;
    let recipe = AudioRecipe {
        random_crop: train,
        ..AudioRecipe::with_seconds(rate, seconds)
            .map_err(|e| PipelineError::config_from("--rate/--seconds", e))?
    };
    let n = files.len();
    let mut pipeline = Pipeline::builder()
        .source_epochs(move |epoch| files.epoch(epoch).into_iter().map(move |p| (p, epoch)))
        .describe(|(p, _)| p.display().to_string())
        .pipe(
            "decode",
            move |(path, epoch): (PathBuf, u64)| -> Result<Sample, MediaError> {
                // A new random window every epoch (with --train); the real length of a clip
                // shorter than the window (the rest is zero padding).
                let (audio, length) = recipe.for_epoch(epoch).load_with_length(&path)?;
                Ok(Sample::new()
                    .with("audio", audio)
                    .with("length", length as i64))
            },
            1,
        )
        .measure(Sample::nbytes)
        .aggregate(batch, false)
        .pipe("collate", FieldBatch::collate, 1)
        .build()?;
    let crops = if train { "random" } else { "leading" };
    println!("{n} clips → {rate} Hz mono, {seconds} s {crops} crops, batches of {batch}");
    for epoch in 0..epochs {
        let started = Instant::now();
        let (mut clips, mut shape) = (0, Vec::new());
        for b in pipeline.iter() {
            let b = b?;
            shape = b.tensor("audio").expect("audio").shape().to_vec();
            clips += b.len();
        }
        let secs = started.elapsed().as_secs_f64();
        let stats = pipeline.stats();
        println!(
            "epoch {epoch}: {clips} clips in {secs:.2} s = {:.0} clips/s; batch {shape:?} f32; decode workers {}; {} failed",
            clips as f64 / secs,
            stats.stage("decode").map_or(0, |s| s.workers),
            stats.failures
        );
    }
    Ok(())
}
