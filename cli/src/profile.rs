//! `flowgate profile`: the decode stage alone at several concurrencies, each measured long
//! enough to be stable and repeated (the spread shown), the predicted bottleneck, then the
//! tuner from a cold start over the same sample.

use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use flowgate::spec::{PipelineSpec, SourceSpec};
use flowgate::{Pipeline, Workers};

type Error = Box<dyn std::error::Error>;

/// How `profile` measures.
pub(crate) struct Settings {
    /// Items in the sample.
    pub(crate) sample: usize,
    /// Decode workers to try.
    pub(crate) levels: Vec<usize>,
    /// Measurements per level.
    pub(crate) repeats: usize,
    /// The least time one measurement takes (passes over the sample are repeated until then).
    pub(crate) min_seconds: f64,
}

/// The most workers a level may ask for.
const MAX_LEVEL: u64 = flowgate::limits::WORKERS.max;

/// One level's measurements.
struct Level {
    workers: usize,
    /// Items/s of each measurement, sorted.
    rates: Vec<f64>,
    failed: u64,
}

impl Level {
    fn median(&self) -> f64 {
        self.rates[self.rates.len() / 2]
    }
}

pub(crate) fn profile(file: &Path, s: &Settings) -> Result<(), Error> {
    if s.levels.is_empty() || s.levels.iter().any(|&l| l == 0 || l as u64 > MAX_LEVEL) {
        return Err(format!(
            "--levels: worker counts in 1..={MAX_LEVEL}, not {:?}",
            s.levels
        )
        .into());
    }
    if s.sample == 0 || s.repeats == 0 || !(s.min_seconds > 0.0 && s.min_seconds <= 600.0) {
        return Err(format!(
            "--sample {} and --repeats {} must be at least 1, --min-seconds {} in (0, 600]",
            s.sample, s.repeats, s.min_seconds
        )
        .into());
    }
    let spec = PipelineSpec::load(file)?;
    if let SourceSpec::S3 { .. } = spec.source {
        return Err("profile: S3 sources are not profiled yet (profile a local copy)".into());
    }
    let files = spec
        .local_files()?
        .ok_or("profile: only list and dir sources are profiled yet (not tar, parquet or s3)")?;
    let items: Vec<PathBuf> = files.epoch(0).into_iter().take(s.sample).collect();
    if items.is_empty() {
        return Err(format!("{}: the source has no items", file.display()).into());
    }
    for p in &items {
        let _ = std::fs::read(p); // warm the page cache: measure decoding, not the disk
    }
    println!(
        "profiling `decode` alone over {} items from {}: {} measurement(s) of at least {:.1} s per level",
        items.len(),
        file.display(),
        s.repeats,
        s.min_seconds
    );
    println!(
        "{:<8} {:>8} {:>10} {:>19} {:>11} {:>7}",
        "stage", "workers", "items/s", "spread (min-max)", "per worker", "failed"
    );
    let mut levels = Vec::new();
    for &c in &s.levels {
        let mut rates = Vec::new();
        let mut failed = 0;
        for _ in 0..s.repeats {
            let (rate, f) = measure(&spec, &items, c, s.min_seconds)?;
            rates.push(rate);
            // The same files fail in every measurement: count them once.
            failed = failed.max(f);
        }
        rates.sort_by(f64::total_cmp);
        let l = Level {
            workers: c,
            rates,
            failed,
        };
        println!(
            "{:<8} {:>8} {:>10.0} {:>19} {:>11.0} {:>7}",
            "decode",
            c,
            l.median(),
            format!("{:.0}-{:.0}", l.rates[0], l.rates[l.rates.len() - 1]),
            l.median() / c as f64,
            l.failed
        );
        levels.push(l);
    }
    let failed: u64 = levels.iter().map(|l| l.failed).max().unwrap_or(0);
    let best = levels.iter().map(Level::median).fold(0.0f64, f64::max);
    if best == 0.0 {
        return Err(format!(
            "every item failed to decode ({failed} failures): nothing to profile; `flowgate run` names the reasons"
        )
        .into());
    }
    // The fewest workers within 5% of the best median: more only burn cores.
    let enough = levels
        .iter()
        .find(|l| l.median() >= 0.95 * best)
        .map_or(1, |l| l.workers);
    let step_rate = if spec.run.step_ms > 0.0 {
        1000.0 / spec.run.step_ms * spec.batch_size() as f64
    } else {
        f64::INFINITY
    };
    let predicted = best.min(step_rate);
    println!(
        "predicted: {} (at most {:.0} items/s); decode needs {} for {:.0} items/s{}",
        if step_rate < best {
            "the consumer's step is the bottleneck"
        } else {
            "decode is the bottleneck"
        },
        predicted,
        if enough == 1 {
            "1 worker".to_owned()
        } else {
            format!("{enough} workers")
        },
        best,
        if step_rate.is_finite() {
            format!("; the step consumes {step_rate:.0} items/s")
        } else {
            String::new()
        }
    );
    if failed > 0 {
        println!("{failed} item(s) failed to decode and are not counted; `flowgate run` names the reasons");
    }
    // The tuner, from a cold start, over the same sample for comparison.
    let list = items.clone();
    let decode = spec.item_decoder()?;
    let step = Duration::from_secs_f64(spec.run.step_ms / 1000.0);
    let mut p = Pipeline::builder()
        .source_epochs(move |_| list.clone())
        .pipe(
            "decode",
            move |path: PathBuf| decode(&path),
            Workers::auto(),
        )
        .aggregate(spec.batch_size(), false)
        .autotune(spec.tuner_settings());
    // The file's budgets, as its loader has them.
    if let Some(m) = spec.tuner.memory_mb {
        p = p.memory_budget(flowgate::limits::mib_to_bytes(m));
    }
    if let Some(c) = spec.tuner.cpu_budget {
        p = p.cpu_budget(c);
    }
    let mut p = p.build()?;
    let t0 = Instant::now();
    let mut n = 0;
    let mut passes = 0;
    while passes < 3 || t0.elapsed().as_secs_f64() < s.min_seconds * 3.0 {
        for b in p.iter() {
            match b {
                Ok(b) => n += b.len(),
                Err(e) => return Err(e.into()),
            }
            if !step.is_zero() {
                std::thread::sleep(step);
            }
        }
        passes += 1;
    }
    let rate = n as f64 / t0.elapsed().as_secs_f64();
    let chosen = p.stats().stage("decode").map_or(0, |s| s.workers);
    println!(
        "tuner ({passes} passes from a cold start at its share of the cores): {chosen} decode worker(s), {rate:.0} items/s = {:.0}% of the prediction",
        100.0 * rate / predicted
    );
    Ok(())
}

/// Decode `items` with `workers` fixed, in passes until `min_seconds` have gone by: items/s
/// of the items decoded, and the items that failed (in one pass: every pass decodes the same
/// files).
fn measure(
    spec: &PipelineSpec,
    items: &[PathBuf],
    workers: usize,
    min_seconds: f64,
) -> Result<(f64, u64), Error> {
    let mut one = spec.clone();
    one.tuner.enabled = false;
    let list = items.to_vec();
    let decode = one.item_decoder()?;
    let mut p = Pipeline::builder()
        .source_epochs(move |_| list.clone())
        .pipe(
            "decode",
            move |path: PathBuf| decode(&path),
            Workers::fixed(workers),
        )
        .autotune_off()
        .build()?;
    let t0 = Instant::now();
    let mut ok = 0u64;
    let mut passes = 0u64;
    while ok == 0 || t0.elapsed().as_secs_f64() < min_seconds {
        let before = ok;
        ok += p.iter().filter(Result::is_ok).count() as u64;
        passes += 1;
        if ok == before {
            break; // every item failed: no pass will do better
        }
    }
    let secs = t0.elapsed().as_secs_f64();
    Ok((ok as f64 / secs, p.stats().failures / passes.max(1)))
}
