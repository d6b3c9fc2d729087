//! Image classification training input: shuffled, sharded JPEGs → random resized crops, flips,
//! normalised `f32` NCHW batches with labels, for a few epochs, self-tuning.
//!
//! ```text
//! cargo run --release -p flowgate-tools --bin make_dataset -- --out target/sample-data --images 600
//! cargo run --release --example image_classification -- [--list target/sample-data/images.txt]
//!     [--epochs 2] [--batch 32] [--size 224] [--step-ms 0]
//! ```
//!
//! Labels follow the ImageFolder convention: the index of the file's parent folder among the
//! dataset's folders, sorted. `RANK`/`WORLD_SIZE` shard the list. Each epoch reshuffles and
//! re-seeds the augmentation, so epochs differ but a rerun repeats them exactly.

use std::path::PathBuf;
use std::time::{Duration, Instant};

use flowgate::media::image::ImageRecipe;
use flowgate::media::{Files, MediaError, Recipe};
use flowgate::sample::{Batch, Sample};
use flowgate::{Pipeline, PipelineError};

fn main() -> Result<(), PipelineError> {
    let mut list = PathBuf::from("target/sample-data/images.txt");
    let (mut epochs, mut batch, mut size, mut step_ms) = (2u64, 32usize, 224u32, 0u64);
    let mut args = std::env::args().skip(1);
    while let Some(flag) = args.next() {
        let v = args.next().unwrap_or_default();
        let n = || {
            v.parse::<u64>()
                .map_err(|_| PipelineError::config(format!("{flag}: {v}")))
        };
        match flag.as_str() {
            "--list" => list = v.clone().into(),
            "--epochs" => epochs = n()?,
            "--batch" => batch = n()? as usize,
            "--size" => size = n()? as u32,
            "--step-ms" => step_ms = n()?,
            _ => return Err(PipelineError::config(format!("unknown flag {flag}"))),
        }
    }
    let files = Files::list(&list)
        .map_err(|e| {
            PipelineError::config(format!(
                "{e} (make one: cargo run --release -p flowgate-tools --bin make_dataset -- --out target/sample-data)"
            ))
        })?
        .shuffle(0)
        .shard_from_env()?;
    // ImageFolder labels: the parent folder's index among the dataset's sorted folders
    // (the whole dataset's, so every rank numbers the classes alike).
    let classes = files.folder_labels();
    let n_classes = classes.len();
    // Augmentation seeded by (seed, epoch, file): new every epoch, the same on a rerun.
    let recipe = Recipe::image(ImageRecipe::train(size))
        .map_err(|e| PipelineError::config_from("--size", e))?
        .with_seed(0);
    let n = files.len();
    let mut pipeline = Pipeline::builder()
        .source_epochs(move |epoch| files.epoch(epoch).into_iter().map(move |p| (p, epoch)))
        .describe(|(p, _)| p.display().to_string())
        .pipe(
            "decode",
            move |(path, epoch): (PathBuf, u64)| -> Result<Sample, MediaError> {
                let image = recipe.for_epoch(epoch).load(&path)?;
                let label = classes
                    .label(&path)
                    .expect("every file's folder is a class");
                Ok(Sample::new().with("image", image).with("label", label))
            },
            1,
        )
        .measure(Sample::nbytes)
        .aggregate(batch, true)
        .pipe("collate", Batch::collate, 1)
        .measure(Batch::nbytes)
        .build()?;
    println!("{n} images, {n_classes} classes, batches of {batch}, {size}x{size} f32 NCHW");
    for epoch in 0..epochs {
        let started = Instant::now();
        let mut images = 0;
        for b in pipeline.iter() {
            let b = b?;
            let (x, y) = (
                b.tensor("image").expect("image"),
                b.tensor("label").expect("label"),
            );
            debug_assert_eq!(x.shape()[0], y.shape()[0]);
            images += b.len();
            std::thread::sleep(Duration::from_millis(step_ms)); // the training step
        }
        let secs = started.elapsed().as_secs_f64();
        let stats = pipeline.stats();
        let decode = stats.stage("decode").map_or(0, |s| s.workers);
        println!(
            "epoch {epoch}: {images} images in {secs:.2} s = {:.0} images/s; decode workers {decode}; {} failed",
            images as f64 / secs,
            stats.failures
        );
    }
    Ok(())
}
