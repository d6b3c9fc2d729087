//! Image classification input from tar shards mixed with a Parquet set: random resized
//! crops and flips, labels from each sample, a state saved mid-epoch and resumed exactly by a
//! new loader (what a training job does when it is preempted).
//!
//! ```text
//! cargo run --release -p flowgate-cli --features parquet -- gen-data --out target/sample-data --images 600 --shards 100
//! cargo run --release --features parquet --example image_classification
//! ```
//!
//! `gen-data` writes the same 600 photo-like JPEGs as tar shards (`KEY.jpg`, `KEY.cls`) and
//! as a Parquet file in the Hugging Face layout (`image: struct<bytes, path>`, `label`).
//! `RANK` / `WORLD_SIZE` deal the epoch to ranks when set (`torchrun`).

use flowgate::dataset::{Dataset, Labels, Source};
use flowgate::loader::Batch;
use flowgate::media::{image::ImageRecipe, Recipe};
use flowgate::{Loader, PipelineState};

fn main() -> Result<(), Box<dyn std::error::Error>> {
    let data = std::path::Path::new("target/sample-data");
    let shards = std::fs::read_to_string(data.join("shards.txt"))
        .map_err(|e| format!("{e}: make the sample data first (see the top of this file)"))?;
    // Augmentation seeded by (seed, epoch, item): new every epoch, the same on a rerun.
    let recipe = Recipe::image(ImageRecipe::train(224))?.with_seed(0);
    let source = Source::mix(
        [
            Source::shards(shards.trim()).labels(Labels::Field("cls".into())),
            Source::parquet([data.join("images.parquet")], "image")
                .labels(Labels::Field("label".into())),
        ],
        [0.7, 0.3],
    );
    let dataset = Dataset::builder(source)
        .extensions(recipe.extensions())
        .shuffle(0)
        .build()?;
    let loader = || {
        Loader::builder(dataset.clone(), recipe.clone())
            .batch_size(32)
            // Under torchrun, a rank whose files were skipped as unreadable still makes its
            // `len()` batches, so the ranks' collectives stay in step.
            .fill_skipped(true)
            .build()
    };

    // Train until step 5 of the first epoch, then save a checkpoint (plain JSON).
    let mut first = loader()?;
    let mut epoch = first.epoch()?;
    let mut seen = 0;
    for step in 0.. {
        let Some(batch) = epoch.next() else { break };
        seen += train_step(&batch?);
        if step == 4 {
            let state = epoch.state()?;
            std::fs::write("target/loader-state.json", serde_json::to_vec(&state)?)?;
            break;
        }
    }
    drop(epoch);
    drop(first); // the job is preempted

    // A new process: a new loader resumes the epoch where the checkpoint left it.
    let state: PipelineState = serde_json::from_slice(&std::fs::read("target/loader-state.json")?)?;
    let mut resumed = loader()?;
    resumed.resume(&state)?;
    for batch in resumed.epoch()? {
        seen += train_step(&batch?);
    }
    println!(
        "epoch 0: {seen} images, each once ({} per epoch)",
        dataset.len()
    );
    Ok(())
}

/// The training step: here, the labels it would train on.
fn train_step(batch: &Batch) -> usize {
    let labels = batch.label_values().unwrap_or_default();
    assert_eq!(labels.len(), batch.len());
    batch.len()
}
