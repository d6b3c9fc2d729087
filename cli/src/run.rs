//! `flowgate run` and `flowgate profile`.

use std::fmt::Write as _;
use std::io::{IsTerminal, Write as _};
use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use flowgate::spec::{PipelineSpec, SourceSpec};
use flowgate::{Pipeline, PipelineStats, StageKind, StageStats, Workers};

type Error = Box<dyn std::error::Error>;

/// Runs a pipeline file: live view on stderr, summary and a JSON line on stdout.
pub(crate) fn run(file: &Path, quiet: bool, dump: Option<&Path>) -> Result<(), Error> {
    let spec = PipelineSpec::load(file)?;
    if let Some(dir) = dump {
        std::fs::create_dir_all(dir).map_err(|e| format!("creating {}: {e}", dir.display()))?;
    }
    let view = Arc::new(Mutex::new(LiveView::new(
        !quiet,
        std::io::stderr().is_terminal(),
    )));
    let jsonl = match &spec.metrics.jsonl {
        Some(p) => {
            Some(std::fs::File::create(p).map_err(|e| format!("creating {}: {e}", p.display()))?)
        }
        None => None,
    };
    let metrics = metrics_exporter(&spec)?;
    let started = Instant::now();
    let hook = {
        let view = Arc::clone(&view);
        let mut jsonl = jsonl;
        Box::new(move |stats: &PipelineStats| {
            if let Some(f) = jsonl.as_mut() {
                let line = serde_json::json!({
                    "t": started.elapsed().as_secs_f64(),
                    "stats": stats,
                });
                let _ = writeln!(f, "{line}");
            }
            if let Some(m) = &metrics {
                m.update(stats);
            }
            view.lock().expect("view lock").update(stats);
        }) as flowgate::StatsCallback
    };
    let on_decision = {
        let view = Arc::clone(&view);
        Box::new(move |r: &flowgate::TraceRecord| {
            let mut v = view.lock().expect("view lock");
            for d in &r.decisions {
                let line = format!(
                    "tuner @{:>5.1}s {:>7.1} results/s  {}: {}",
                    r.t,
                    r.rate,
                    describe(&d.action, &r.stages),
                    d.reason
                );
                v.log(line);
            }
        }) as flowgate::spec::DecisionHook
    };
    let mut loader = spec.build(flowgate::spec::Hooks {
        on_stats: Some(hook),
        on_decision: Some(on_decision),
    })?;
    let started = Instant::now(); // after the build (and any upload to a local S3 server)
    let step = Duration::from_secs_f64(spec.run.step_ms / 1000.0);
    eprintln!(
        "{}: {} items per epoch, {} epoch(s), batches of {}{}",
        file.display(),
        loader.items,
        spec.run.epochs,
        spec.batch.size,
        if spec.tuner.enabled {
            ", self-tuning"
        } else {
            ", tuner off"
        }
    );
    let mut epochs = Vec::new();
    let mut shape = Vec::new();
    for epoch in 0..spec.run.epochs {
        view.lock().expect("view lock").epoch = (epoch + 1, spec.run.epochs);
        let t0 = Instant::now();
        let mut items = 0usize;
        for (index, batch) in loader.pipeline.iter().enumerate() {
            let batch = batch?;
            items += batch.shape()[0];
            if let Some(dir) = dump {
                let path = dir.join(format!("epoch{epoch}-batch{index:05}.npy"));
                std::fs::write(&path, batch.to_npy())
                    .map_err(|e| format!("writing {}: {e}", path.display()))?;
            }
            shape = batch.shape().to_vec();
            if !step.is_zero() {
                std::thread::sleep(step); // the simulated training step
            }
        }
        epochs.push((items, t0.elapsed().as_secs_f64()));
    }
    let total = started.elapsed().as_secs_f64();
    let stats = loader.pipeline.stats();
    view.lock().expect("view lock").finish();
    drop(loader.pipeline);
    print!("{}", summary(&stats, &epochs));
    if let Some(c) = loader.cache.as_ref().map(|c| c.stats()) {
        println!(
            "cache: {} hits, {} misses, {:.1} of {:.1} MiB, {:.1} MiB evicted",
            c.hits,
            c.misses,
            mib(c.bytes),
            mib(c.capacity_bytes),
            mib(c.evicted_bytes)
        );
    }
    let items: usize = epochs.iter().map(|e| e.0).sum();
    println!(
        "{}",
        serde_json::json!({
            "pipeline": file.display().to_string(),
            "items": items,
            "seconds": total,
            "items_per_s": items as f64 / total,
            "failures": stats.failures,
            "consumer_wait_fraction": stats.consumer_wait.as_secs_f64() / total.max(1e-9),
            "batch_shape": shape,
            "workers": stats.stages.iter().map(|s| (s.name.clone(), s.workers)).collect::<std::collections::BTreeMap<_, _>>(),
        })
    );
    Ok(())
}

fn mib(b: u64) -> f64 {
    b as f64 / 1048576.0
}

/// The per-stage table after a run.
fn summary(stats: &PipelineStats, epochs: &[(usize, f64)]) -> String {
    let mut s = String::new();
    for (i, (items, secs)) in epochs.iter().enumerate() {
        let _ = writeln!(
            s,
            "epoch {}: {items} items in {secs:.2} s = {:.0} items/s",
            i + 1,
            *items as f64 / secs.max(1e-9)
        );
    }
    let _ = writeln!(
        s,
        "{:<12} {:>7} {:>9} {:>9} {:>6} {:>9} {:>9} {:>8} {:>8} {:>8}",
        "stage", "workers", "in", "out", "failed", "p50 ms", "p99 ms", "busy s", "put s", "get s"
    );
    for st in &stats.stages {
        let _ = writeln!(
            s,
            "{:<12} {:>7} {:>9} {:>9} {:>6} {:>9.3} {:>9.3} {:>8.2} {:>8.2} {:>8.2}",
            st.name,
            st.workers,
            st.items_in,
            st.items_out,
            st.failures,
            st.task_time.p50.as_secs_f64() * 1e3,
            st.task_time.p99.as_secs_f64() * 1e3,
            st.busy.as_secs_f64(),
            st.blocked_put.as_secs_f64(),
            st.blocked_get.as_secs_f64(),
        );
    }
    let _ = writeln!(
        s,
        "delivered {} batches; {} failed items; consumer waited {:.2} s",
        stats.delivered,
        stats.failures,
        stats.consumer_wait.as_secs_f64()
    );
    for f in &stats.recent_failures {
        let _ = writeln!(s, "  failed: {f}");
    }
    s
}

/// A tuner action in words.
fn describe(action: &flowgate::tuner::Action, stages: &[String]) -> String {
    use flowgate::tuner::Action;
    let name = |i: usize| stages.get(i).map_or("?", String::as_str).to_owned();
    match *action {
        Action::SetWorkers { stage, workers } => format!("{} → {workers} workers", name(stage)),
        Action::SetPrefetch {
            stage,
            items,
            bytes,
        } => {
            if bytes == u64::MAX {
                format!("{} budget → {items} items", name(stage))
            } else {
                format!(
                    "{} budget → {items} items, {:.1} MiB",
                    name(stage),
                    mib(bytes)
                )
            }
        }
        Action::SetCacheBytes { stage, bytes } => {
            format!("{} cache → {:.1} MiB", name(stage), mib(bytes))
        }
    }
}

/// The live view: tuner decisions as lines, and a block of per-stage lines below them, redrawn
/// in place on a terminal, appended otherwise.
struct LiveView {
    enabled: bool,
    tty: bool,
    drawn: usize,
    prev: Option<(Instant, PipelineStats)>,
    epoch: (u64, u64),
    pending: Vec<String>,
}

impl LiveView {
    fn new(enabled: bool, tty: bool) -> Self {
        Self {
            enabled,
            tty,
            drawn: 0,
            prev: None,
            epoch: (0, 0),
            pending: Vec::new(),
        }
    }

    /// A line to print above the block at the next update (every line when not live).
    fn log(&mut self, line: String) {
        if self.enabled {
            self.pending.push(line);
        } else {
            eprintln!("{line}");
        }
    }

    fn update(&mut self, stats: &PipelineStats) {
        let now = Instant::now();
        let Some((then, prev)) = self.prev.replace((now, stats.clone())) else {
            return;
        };
        if !self.enabled {
            return;
        }
        let text = render(stats, &prev, now.duration_since(then), self.epoch);
        let mut err = std::io::stderr().lock();
        if self.tty && self.drawn > 0 {
            // Up over the last block, clear to the end of the screen.
            let _ = write!(err, "\x1b[{}A\x1b[J", self.drawn);
        }
        for line in self.pending.drain(..) {
            let _ = writeln!(err, "{line}");
        }
        let _ = err.write_all(text.as_bytes());
        self.drawn = text.lines().count();
    }

    fn finish(&mut self) {
        let mut err = std::io::stderr().lock();
        for line in self.pending.drain(..) {
            let _ = writeln!(err, "{line}");
        }
        self.enabled = false;
    }
}

/// One frame of the live view, from the statistics now and a window ago.
fn render(now: &PipelineStats, prev: &PipelineStats, dt: Duration, epoch: (u64, u64)) -> String {
    let dt = dt.as_secs_f64().max(1e-9);
    let find = |name: &str| prev.stages.iter().find(|s| s.name == name);
    let rate = |s: &StageStats| {
        let p = find(&s.name).map_or(0, |p| p.items_out);
        s.items_out.saturating_sub(p) as f64 / dt
    };
    let busy = |s: &StageStats| {
        let p = find(&s.name).map_or(Duration::ZERO, |p| p.busy);
        s.busy.saturating_sub(p).as_secs_f64() / (dt * s.workers.max(1) as f64)
    };
    let wait = now
        .consumer_wait
        .saturating_sub(prev.consumer_wait)
        .as_secs_f64()
        / dt;
    let work = |s: &&StageStats| !matches!(s.kind, Some(StageKind::Source | StageKind::Sink));
    let bottleneck = if wait < 0.05 {
        "the consumer (the loader keeps up)".to_owned()
    } else {
        now.stages
            .iter()
            .filter(work)
            .max_by(|a, b| busy(a).total_cmp(&busy(b)))
            .map_or_else(
                || "-".to_owned(),
                |s| format!("{} ({:.0}% busy)", s.name, 100.0 * busy(s)),
            )
    };
    let delivered = now.delivered.saturating_sub(prev.delivered) as f64 / dt;
    let mut out = String::new();
    let _ = writeln!(
        out,
        "epoch {}/{}  {:>8.1} batches/s  consumer wait {:>3.0}%  bottleneck: {}  failed {}",
        epoch.0,
        epoch.1,
        delivered,
        100.0 * wait.min(1.0),
        bottleneck,
        now.failures
    );
    let _ = writeln!(
        out,
        "  {:<12} {:>7} {:>13} {:>10} {:>6}",
        "stage", "workers", "queue", "items/s", "busy"
    );
    for s in &now.stages {
        let queue = if s.budget_items == 0 || s.budget_items == usize::MAX {
            format!("{}", s.queue_items)
        } else {
            format!("{}/{}", s.queue_items, s.budget_items)
        };
        let b = if work(&s) {
            format!("{:.0}%", 100.0 * busy(s).min(1.0))
        } else {
            "-".to_owned()
        };
        let _ = writeln!(
            out,
            "  {:<12} {:>7} {:>13} {:>10.0} {:>6}",
            s.name,
            s.workers,
            queue,
            rate(s),
            b
        );
    }
    out
}

/// Prometheus metrics, when built with the feature and asked for.
#[cfg(feature = "prometheus")]
fn metrics_exporter(spec: &PipelineSpec) -> Result<Option<crate::metrics::Exporter>, Error> {
    match &spec.metrics.prometheus {
        Some(addr) => Ok(Some(crate::metrics::Exporter::start(addr.parse()?)?)),
        None => Ok(None),
    }
}

/// Without the feature, asking for Prometheus is an error, not silence.
#[cfg(not(feature = "prometheus"))]
fn metrics_exporter(spec: &PipelineSpec) -> Result<Option<NoMetrics>, Error> {
    match &spec.metrics.prometheus {
        Some(_) => {
            Err("metrics.prometheus needs flowgate built with the `prometheus` feature".into())
        }
        None => Ok(None),
    }
}

#[cfg(not(feature = "prometheus"))]
struct NoMetrics;

#[cfg(not(feature = "prometheus"))]
impl NoMetrics {
    fn update(&self, _: &PipelineStats) {}
}

/// `flowgate profile`: the decode stage alone (and the fetch stage, for S3) at each level, the
/// predicted bottleneck, and the tuned pipeline for comparison.
pub(crate) fn profile(file: &Path, sample: usize, levels: &[usize]) -> Result<(), Error> {
    let spec = PipelineSpec::load(file)?;
    if let SourceSpec::S3 { .. } = spec.source {
        return Err("profile: S3 sources are not profiled yet (profile a local copy)".into());
    }
    let files = spec
        .local_files()?
        .ok_or("profile: only list and dir sources are profiled yet (not tar or s3)")?;
    let items: Vec<PathBuf> = files.epoch(0).into_iter().take(sample.max(1)).collect();
    for p in &items {
        let _ = std::fs::read(p); // warm the page cache: measure decoding, not the disk
    }
    println!(
        "profiling `decode` alone over {} items from {}",
        items.len(),
        file.display()
    );
    println!(
        "{:<8} {:>8} {:>10} {:>14}",
        "stage", "workers", "items/s", "per worker"
    );
    let mut best = (0usize, 0.0f64);
    let mut rates = Vec::new();
    for &c in levels.iter().filter(|&&c| c > 0) {
        let mut one = spec.clone();
        one.tuner.enabled = false;
        let list = items.clone();
        let decode = one.item_decoder()?;
        let mut p = Pipeline::builder()
            .source(list)
            .pipe(
                "decode",
                move |path: PathBuf| decode(&path),
                Workers::fixed(c),
            )
            .autotune_off()
            .build()?;
        let t0 = Instant::now();
        let n = p.iter().filter(Result::is_ok).count();
        let rate = n as f64 / t0.elapsed().as_secs_f64();
        println!(
            "{:<8} {:>8} {:>10.0} {:>14.0}",
            "decode",
            c,
            rate,
            rate / c as f64
        );
        rates.push((c, rate));
        if rate > best.1 {
            best = (c, rate);
        }
    }
    // The fewest workers within 5% of the best rate: more only burn cores.
    let enough = rates
        .iter()
        .filter(|(_, r)| *r >= 0.95 * best.1)
        .map(|(c, _)| *c)
        .min()
        .unwrap_or(best.0);
    let step_rate = if spec.run.step_ms > 0.0 {
        1000.0 / spec.run.step_ms * spec.batch.size as f64
    } else {
        f64::INFINITY
    };
    let predicted = best.1.min(step_rate);
    println!(
        "predicted: {} (at most {:.0} items/s); decode needs {} worker(s) for {:.0} items/s{}",
        if step_rate < best.1 {
            "the consumer's step is the bottleneck"
        } else {
            "decode is the bottleneck"
        },
        predicted,
        enough,
        best.1,
        if step_rate.is_finite() {
            format!("; the step consumes {step_rate:.0} items/s")
        } else {
            String::new()
        }
    );
    // The tuner, from a cold start, over the same sample for comparison.
    let list = items.clone();
    let decode = spec.item_decoder()?;
    let step = Duration::from_secs_f64(spec.run.step_ms / 1000.0);
    let mut p = Pipeline::builder()
        .source_epochs(move |_| list.clone())
        .pipe(
            "decode",
            move |path: PathBuf| decode(&path),
            Workers::initial(1),
        )
        .aggregate(spec.batch.size, false)
        .autotune(spec.tuner_settings())
        .build()?;
    let t0 = Instant::now();
    let mut n = 0;
    for _ in 0..3 {
        for b in p.iter() {
            n += b?.len();
            if !step.is_zero() {
                std::thread::sleep(step);
            }
        }
    }
    let rate = n as f64 / t0.elapsed().as_secs_f64();
    let chosen = p.stats().stage("decode").map_or(0, |s| s.workers);
    println!(
        "tuner (3 passes from 1 worker): {chosen} decode worker(s), {rate:.0} items/s = {:.0}% of the prediction",
        100.0 * rate / predicted.max(1e-9)
    );
    Ok(())
}
