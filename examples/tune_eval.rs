//! How good is the tuner on a real pipeline? The tuner from a cold start against a grid of
//! static configurations, side by side in one run.
//!
//! ```text
//! cargo run --release --example tune_eval -- synthetic [--seconds S] [--config-seconds S]
//! ```
//!
//! `synthetic`: `fetch` waits 4 ms per item (async, like an object-store GET), `decode` spins
//! 120 µs of CPU per item, `aggregate(32)`, and an instant consumer: the pipeline must find the
//! right number of requests in flight and decode workers on this machine's cores. (The `images`
//! workload over a file list arrives with the image decoders.)
//!
//! Prints one JSON line: the tuner's steady throughput over the best static one (`ratio`),
//! seconds from cold to 90% and 95% of it, and the peak buffered bytes against the budget.

use std::time::{Duration, Instant};

use flowgate::{Pipeline, PipelineError, TunerSettings, Workers};

const FETCH: Duration = Duration::from_millis(4);
const DECODE: Duration = Duration::from_micros(120);

#[derive(Clone, Copy, Debug)]
struct Static {
    fetch: usize,
    decode: usize,
    prefetch: usize,
}

/// Runs the workload for `secs`; returns the time (since start) at which each batch arrived,
/// and the pipeline's tuner trace.
fn run(
    cfg: Option<Static>,
    secs: f64,
) -> Result<(Vec<f64>, Vec<flowgate::TraceRecord>), PipelineError> {
    let b = Pipeline::builder().source_epochs(|_| 0..u64::MAX);
    let (fetch, decode) = cfg.map_or((Workers::initial(1), Workers::initial(1)), |c| {
        (Workers::fixed(c.fetch), Workers::fixed(c.decode))
    });
    let b = b.pipe_async(
        "fetch",
        |x| async move {
            tokio::time::sleep(FETCH).await;
            Ok::<_, std::io::Error>(x)
        },
        fetch,
    );
    let b = match cfg {
        Some(c) => b.budget(c.fetch * c.prefetch, u64::MAX),
        None => b,
    };
    let b = b.pipe(
        "decode",
        |x| {
            let t0 = Instant::now();
            while t0.elapsed() < DECODE {
                std::hint::spin_loop();
            }
            Ok::<_, std::io::Error>(vec![x as u8; 4096])
        },
        decode,
    );
    let b = match cfg {
        Some(c) => b.budget(c.decode * c.prefetch + 2, u64::MAX),
        None => b,
    };
    let b = b.measure(Vec::len).aggregate(32, false);
    let mut p = match cfg {
        Some(_) => b.autotune_off().build()?,
        None => b.autotune(TunerSettings::default()).build()?,
    };
    let t0 = Instant::now();
    let mut arrivals = Vec::new();
    for batch in p.iter() {
        batch?;
        let t = t0.elapsed().as_secs_f64();
        arrivals.push(t);
        if t >= secs {
            break;
        }
    }
    let trace = p.tuner_trace();
    Ok((arrivals, trace))
}

/// Batches per second between `from` and `to` seconds.
fn rate(arrivals: &[f64], from: f64, to: f64) -> f64 {
    arrivals.iter().filter(|&&t| t >= from && t < to).count() as f64 / (to - from)
}

fn main() -> Result<(), PipelineError> {
    let mut args = std::env::args().skip(1);
    let workload = args.next().unwrap_or_else(|| "synthetic".into());
    let (mut seconds, mut config_seconds) = (15.0, 3.0);
    while let Some(a) = args.next() {
        let v: f64 = args.next().and_then(|v| v.parse().ok()).expect("a number");
        match a.as_str() {
            "--seconds" => seconds = v,
            "--config-seconds" => config_seconds = v,
            other => panic!("unknown argument {other}"),
        }
    }
    assert_eq!(
        workload, "synthetic",
        "only the synthetic workload exists until image decoding lands"
    );
    let cores = flowgate::actors::cap::cores();
    let mut best = (None, 0.0);
    for fetch in [8, 16, 32, 64, 128] {
        for decode in 1..=cores + 1 {
            for prefetch in [1, 4] {
                let cfg = Static {
                    fetch,
                    decode,
                    prefetch,
                };
                let (arrivals, _) = run(Some(cfg), config_seconds)?;
                let r = rate(&arrivals, 1.0, config_seconds);
                eprintln!("static {cfg:?}: {:.0} items/s", r * 32.0);
                if r > best.1 {
                    best = (Some(cfg), r);
                }
            }
        }
    }
    let (arrivals, trace) = run(None, seconds)?;
    let steady = rate(&arrivals, seconds - 5.0, seconds);
    let time_to = |frac: f64| {
        (10..=(seconds * 10.0) as usize)
            .map(|k| k as f64 / 10.0)
            .find(|&t| rate(&arrivals, t - 1.0, t) >= frac * best.1)
    };
    let peak = trace.iter().map(|r| r.buffered_bytes).max().unwrap_or(0);
    let budget = trace.first().map_or(0, |r| r.memory_budget);
    let final_workers = trace.last().map(|r| r.workers.clone()).unwrap_or_default();
    println!(
        "{{\"workload\":\"{workload}\",\"best_static\":\"{:?}\",\"best_static_items_per_s\":{:.0},\"tuned_items_per_s\":{:.0},\"ratio\":{:.3},\"t90_s\":{},\"t95_s\":{},\"tuned_workers\":{final_workers:?},\"peak_buffered_bytes\":{peak},\"memory_budget\":{budget}}}",
        best.0.expect("a grid"),
        best.1 * 32.0,
        steady * 32.0,
        steady / best.1,
        time_to(0.90).map_or("null".into(), |t| format!("{t:.1}")),
        time_to(0.95).map_or("null".into(), |t| format!("{t:.1}")),
    );
    Ok(())
}
