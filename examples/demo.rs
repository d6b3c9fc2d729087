//! The main job: a loader-shaped pipeline that tunes itself from a cold start.
//!
//! ```text
//! cargo run --release --example demo [-- --items N --step-ms MS --trace FILE]
//! ```
//!
//! `read` simulates object-store latency (2 ms per item, async), `decode` burns ~150 µs of CPU
//! per item on a work-stealing pool, `aggregate` makes batches of 32, and the consumer simulates
//! a training step per batch. Every stage starts cold (one worker, one request in flight); the
//! tuner finds the concurrency and buffers. The job prints each tuner decision with its reason,
//! live throughput every half second, a per-stage summary, and one JSON line at the end.

use std::time::{Duration, Instant};

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

fn main() -> Result<(), PipelineError> {
    let (mut items, mut step_ms, mut trace) = (40_000u64, 1u64, None);
    let mut args = std::env::args().skip(1);
    while let Some(a) = args.next() {
        let mut value = || args.next().expect("a value");
        match a.as_str() {
            "--items" => items = value().parse().expect("a number"),
            "--step-ms" => step_ms = value().parse().expect("a number"),
            "--trace" => trace = Some(value().into()),
            other => panic!(
                "unknown argument {other}; usage: demo [--items N] [--step-ms MS] [--trace FILE]"
            ),
        }
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
    let secs = t0.elapsed().as_secs_f64();
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
        "{{\"job\":\"demo\",\"items\":{n},\"seconds\":{secs:.3},\"items_per_s\":{:.0},\"consumer_wait_pct\":{:.1},\"tuner_decisions\":{decisions},\"failures\":{}}}",
        n as f64 / secs,
        100.0 * stats.consumer_wait.as_secs_f64() / secs,
        stats.failures
    );
    Ok(())
}
