//! How good is the tuner on a real pipeline? The tuner from a cold start against a grid of
//! static configurations, side by side in one run.
//!
//! ```text
//! cargo run --release -p flowgate-tools --bin tune_eval -- synthetic [--seconds S] [--config-seconds S]
//! cargo run --release -p flowgate-tools --bin tune_eval -- images --list FILE [--seconds S] [--config-seconds S]
//! ```
//!
//! `synthetic`: `fetch` waits 4 ms per item (async, like an object-store GET), `decode` spins
//! 120 µs of CPU per item, batches of 32, an instant consumer; the grid is fetch 8..=128 in
//! flight × decode 1..=cores+1 workers × prefetch 1 or 4.
//!
//! `images`: the `bench images` pipeline (decode, resize 256, crop 224, NCHW, batches of 32)
//! over the files of `--list`, cycled for as long as a run lasts; the grid is decode workers
//! 1..=cores+1 × prefetch 1 or 4.
//!
//! Prints one JSON line: the tuner's steady throughput over the best static one (`ratio`),
//! seconds from cold to 90% and 95% of it, and the peak buffered bytes against the budget.

use std::path::PathBuf;
use std::time::{Duration, Instant};

use flowgate::dataset::Files;
use flowgate::media::image::ImageRecipe;
use flowgate::{
    DType, Pipeline, PipelineBuilder, PipelineError, Tensor, TraceRecord, TunerSettings, Workers,
};

const FETCH: Duration = Duration::from_millis(4);
const DECODE: Duration = Duration::from_micros(120);

#[derive(Clone, Debug)]
enum Workload {
    Synthetic,
    Images(Vec<PathBuf>),
}

#[derive(Clone, Copy, Debug)]
struct Static {
    fetch: usize,
    decode: usize,
    prefetch: usize,
}

type Outcome = (Vec<f64>, Vec<TraceRecord>);

/// Runs the workload for `secs` (tuned when `cfg` is `None`); returns the arrival time of
/// each batch and the tuner's trace.
fn run(w: &Workload, cfg: Option<Static>, secs: f64) -> Result<Outcome, PipelineError> {
    let pinned = |n: usize| cfg.map_or(Workers::initial(1), |_| Workers::fixed(n));
    let b = match w {
        Workload::Synthetic => {
            let b = Pipeline::builder()
                .source_epochs(|_| 0..u64::MAX)
                .pipe_async(
                    "fetch",
                    |x| async move {
                        tokio::time::sleep(FETCH).await;
                        Ok::<_, std::io::Error>(x)
                    },
                    pinned(cfg.map_or(1, |c| c.fetch)),
                );
            let b = match cfg {
                Some(c) => b.budget(c.fetch * c.prefetch, u64::MAX),
                None => b,
            };
            b.pipe(
                "decode",
                |x| {
                    let t0 = Instant::now();
                    while t0.elapsed() < DECODE {
                        std::hint::spin_loop();
                    }
                    let mut t = Tensor::zeros(&[4096], DType::U8);
                    t.bytes_mut().fill(x as u8);
                    Ok::<_, std::io::Error>(t)
                },
                pinned(cfg.map_or(1, |c| c.decode)),
            )
        }
        Workload::Images(paths) => {
            let paths = paths.clone();
            let recipe = ImageRecipe::default();
            Pipeline::builder()
                .source_epochs(move |_| paths.clone().into_iter().cycle())
                .pipe(
                    "decode",
                    move |p: PathBuf| recipe.load(&p),
                    pinned(cfg.map_or(1, |c| c.decode)),
                )
        }
    };
    let b = match cfg {
        Some(c) => b.budget(c.decode * c.prefetch + 2, u64::MAX),
        None => b,
    };
    let b = b.batch(32, false);
    collect(b, cfg.is_some(), secs)
}

fn collect(b: PipelineBuilder<Tensor>, fixed: bool, secs: f64) -> Result<Outcome, PipelineError> {
    let mut p = if fixed {
        b.autotune_off().build()?
    } else {
        b.autotune(TunerSettings::default()).build()?
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
    Ok((arrivals, p.tuner_trace()))
}

/// Batches per second between `from` and `to` seconds.
fn rate(arrivals: &[f64], from: f64, to: f64) -> f64 {
    arrivals.iter().filter(|&&t| t >= from && t < to).count() as f64 / (to - from)
}

fn main() -> Result<(), PipelineError> {
    let mut args = std::env::args().skip(1);
    let workload = args.next().unwrap_or_else(|| "synthetic".into());
    let (mut seconds, mut config_seconds, mut list) = (15.0, 3.0, None);
    while let Some(a) = args.next() {
        let v = args.next().expect("a value");
        let num = || v.parse::<f64>().expect("a number");
        match a.as_str() {
            "--seconds" => seconds = num(),
            "--config-seconds" => config_seconds = num(),
            "--list" => list = Some(v),
            other => panic!("unknown argument {other}"),
        }
    }
    let w = match workload.as_str() {
        "synthetic" => Workload::Synthetic,
        "images" => {
            Workload::Images(Files::list(list.expect("images needs --list FILE"))?.epoch(0))
        }
        other => panic!("unknown workload {other}: synthetic or images"),
    };
    let cores = flowgate::actors::cap::cores();
    let fetches: &[usize] = match w {
        Workload::Synthetic => &[8, 16, 32, 64, 128],
        Workload::Images(_) => &[0],
    };
    let mut best = (None, 0.0);
    for &fetch in fetches {
        for decode in 1..=cores + 1 {
            for prefetch in [1, 4] {
                let cfg = Static {
                    fetch,
                    decode,
                    prefetch,
                };
                let (arrivals, _) = run(&w, Some(cfg), config_seconds)?;
                let r = rate(&arrivals, 1.0, config_seconds);
                eprintln!("static {cfg:?}: {:.0} items/s", r * 32.0);
                if r > best.1 {
                    best = (Some(cfg), r);
                }
            }
        }
    }
    let (arrivals, trace) = run(&w, None, seconds)?;
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
