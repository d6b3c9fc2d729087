//! The main job: a loader that tunes itself from a cold start.
//!
//! ```text
//! cargo run --release --example demo -- --images LIST [--epochs N --step-ms MS --trace FILE]
//! cargo run --release --example demo [-- --items N --step-ms MS --trace FILE]
//! ```
//!
//! With `--images LIST` (what `scripts/run.sh` runs, on a generated dataset): `read` loads each
//! file asynchronously, `decode` decodes, resizes to 256 and center-crops 224 (NCHW) on a
//! work-stealing pool, `aggregate` + `collate` make `32×3×224×224` batches, and the consumer
//! simulates a training step per batch. Without it, a synthetic loader:
//! `read` simulates object-store latency (2 ms per item, async), `decode` burns ~150 µs of CPU
//! per item on a work-stealing pool, `aggregate` makes batches of 32, and the consumer simulates
//! a training step per batch. Every stage starts cold (one worker, one request in flight); the
//! tuner finds the concurrency and buffers. The job prints each tuner decision with its reason,
//! live throughput every half second, a per-stage summary, and one JSON line at the end.

use std::time::{Duration, Instant};

use std::path::PathBuf;

use flowgate::dataset::Files;
use flowgate::media::image::ImageRecipe;
use flowgate::{Pipeline, PipelineError, PipelineStats, TraceRecord, TunerSettings};

fn decode(id: u64) -> Result<Vec<u8>, std::io::Error> {
    let t0 = Instant::now();
    let mut h = id;
    while t0.elapsed() < Duration::from_micros(150) {
        for _ in 0..64 {
            h = h.rotate_left(5) ^ 0x9E37_79B9_7F4A_7C15;
        }
    }
    Ok(vec![h as u8; 3 * 32 * 32])
}

fn live(s: &PipelineStats) {
    let line: Vec<String> = s
        .stages
        .iter()
        .filter(|st| st.name != "source")
        .map(|st| {
            format!(
                "{}[w{} q{}/{}]",
                st.name, st.workers, st.queue_items, st.budget_items
            )
        })
        .collect();
    println!("  live: {} delivered  {}", s.delivered, line.join(" "));
}

fn decision(r: &TraceRecord) {
    for d in &r.decisions {
        println!(
            "  tuner @{:>5.1}s  {:>7.0} items/s  {:?}: {}",
            r.t, r.rate, d.action, d.reason
        );
    }
}

/// The image loader over a file list, tuned from one worker per stage.
fn images_job(
    list: &str,
    epochs: u64,
    step_ms: u64,
    trace: Option<PathBuf>,
) -> Result<(), PipelineError> {
    let files = Files::list(list)?.shuffle(0).shard_from_env()?;
    let recipe = ImageRecipe::default();
    let n_files = files.len();
    let mut p = Pipeline::builder()
        .source_epochs(move |epoch| files.epoch(epoch))
        .pipe_async(
            "read",
            |path: PathBuf| async move {
                let bytes = tokio::fs::read(&path).await.map_err(|e| {
                    std::io::Error::new(e.kind(), format!("{}: {e}", path.display()))
                })?;
                Ok::<_, std::io::Error>((path, bytes))
            },
            1,
        )
        .pipe(
            "decode",
            move |(path, bytes): (PathBuf, Vec<u8>)| recipe.decode(&bytes, &path),
            1,
        )
        .batch(32, false)
        .autotune(TunerSettings {
            trace,
            ..Default::default()
        })
        .on_tuner_decision(decision)
        .on_stats(Duration::from_millis(1000), live)
        .build()?;
    println!("flowgate demo: {n_files} images x {epochs} epochs, batches of 32x3x224x224 u8, a {step_ms} ms step per batch, cold start");
    let t0 = Instant::now();
    let mut n = 0;
    for epoch in 0..epochs {
        let te = Instant::now();
        let mut m = 0;
        for batch in p.iter() {
            m += batch?.shape()[0];
            std::thread::sleep(Duration::from_millis(step_ms));
        }
        n += m;
        println!(
            "  epoch {epoch}: {m} images, {:.0} images/s",
            m as f64 / te.elapsed().as_secs_f64()
        );
    }
    summary(&p, "demo-images", n, t0.elapsed().as_secs_f64());
    Ok(())
}

fn summary<T: Send + 'static>(p: &Pipeline<T>, job: &str, n: usize, secs: f64) {
    let stats = p.stats();
    println!(
        "\n{:>10} {:>8} {:>8} {:>8} {:>10} {:>10} {:>10} {:>10}",
        "stage", "workers", "in", "out", "p50", "p99", "put-wait", "get-wait"
    );
    for s in &stats.stages {
        println!(
            "{:>10} {:>8} {:>8} {:>8} {:>10.2?} {:>10.2?} {:>10.2?} {:>10.2?}",
            s.name,
            s.workers,
            s.items_in,
            s.items_out,
            s.task_time.p50,
            s.task_time.p99,
            s.blocked_put,
            s.blocked_get
        );
    }
    let decisions: usize = p.tuner_trace().iter().map(|r| r.decisions.len()).sum();
    println!(
        "{{\"job\":\"{job}\",\"items\":{n},\"seconds\":{secs:.3},\"items_per_s\":{:.0},\"consumer_wait_pct\":{:.1},\"tuner_decisions\":{decisions},\"failures\":{}}}",
        n as f64 / secs,
        100.0 * stats.consumer_wait.as_secs_f64() / secs,
        stats.failures
    );
}

fn main() -> Result<(), PipelineError> {
    let (mut items, mut step_ms, mut trace, mut images, mut epochs) =
        (40_000u64, 1u64, None, None, 3u64);
    let mut args = std::env::args().skip(1);
    while let Some(a) = args.next() {
        let mut value = || args.next().expect("a value");
        match a.as_str() {
            "--items" => items = value().parse().expect("a number"),
            "--step-ms" => step_ms = value().parse().expect("a number"),
            "--trace" => trace = Some(value().into()),
            "--images" => images = Some(value()),
            "--epochs" => epochs = value().parse().expect("a number"),
            other => panic!(
                "unknown argument {other}; usage: demo [--images LIST [--epochs N]] [--items N] [--step-ms MS] [--trace FILE]"
            ),
        }
    }
    if let Some(list) = images {
        return images_job(&list, epochs, step_ms, trace);
    }
    let mut p = Pipeline::builder()
        .source_epochs(move |_| 0..items)
        .pipe_async(
            "read",
            |id| async move {
                tokio::time::sleep(Duration::from_millis(2)).await;
                Ok::<_, std::io::Error>(id)
            },
            1,
        )
        .pipe("decode", decode, 1)
        .measure(Vec::len)
        .aggregate(32, false)
        .autotune(TunerSettings {
            trace,
            ..Default::default()
        })
        .on_tuner_decision(decision)
        .on_stats(Duration::from_millis(500), live)
        .build()?;
    println!("flowgate demo: {items} items, batches of 32, a {step_ms} ms training step per batch, cold start");
    let t0 = Instant::now();
    let mut n = 0;
    for batch in p.iter() {
        n += batch?.len();
        std::thread::sleep(Duration::from_millis(step_ms));
    }
    summary(&p, "demo", n, t0.elapsed().as_secs_f64());
    Ok(())
}
