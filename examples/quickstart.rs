//! The smallest useful pipeline: a source, two stages, batches, and stats.
use flowgate::{Pipeline, PipelineError};

fn main() -> Result<(), PipelineError> {
    let mut pipeline = Pipeline::builder()
        .source_epochs(|_epoch| 0..100_000u64)
        .pipe("double", |x| Ok::<_, std::io::Error>(x * 2), 2)
        .filter_map(
            "evens-of-four",
            |x| Ok::<_, std::io::Error>((x % 4 == 0).then_some(x)),
            1,
        )
        .aggregate(32, false)
        .build()?;
    for epoch in 0..2 {
        let t0 = std::time::Instant::now();
        let mut items = 0;
        for batch in pipeline.iter() {
            items += batch?.len();
        }
        println!("epoch {epoch}: {items} items in {:?}", t0.elapsed());
    }
    let stats = pipeline.stats();
    for s in &stats.stages {
        println!(
            "{:>14}: in {:>7} out {:>7} workers {} p99 {:?}",
            s.name, s.items_in, s.items_out, s.workers, s.task_time.p99
        );
    }
    Ok(())
}
