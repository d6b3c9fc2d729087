//! `flowgate run`.

use std::fmt::Write as _;
use std::io::{IsTerminal, Write as _};
use std::path::Path;
use std::process::ExitCode;
use std::sync::atomic::{AtomicI32, Ordering};
use std::time::{Duration, Instant};

use flowgate::spec::PipelineSpec;
use flowgate::{PipelineStats, Within};

use crate::text;
use crate::view;

type Error = Box<dyn std::error::Error>;

/// The signals that stop a run like Ctrl-C: SIGINT, SIGTERM (what schedulers send before
/// preemption) and SIGHUP (a closed terminal). The run stops after the batch in hand, prints
/// its summary and JSON line, writes the rest of its trace, and exits 128 + the signal's
/// number (130, 143, 129).
const STOP_SIGNALS: [libc::c_int; 3] = [libc::SIGINT, libc::SIGTERM, libc::SIGHUP];

/// The stop signal received, or 0.
static INTERRUPTED: AtomicI32 = AtomicI32::new(0);

extern "C" fn on_stop_signal(signal: libc::c_int) {
    INTERRUPTED.store(signal, Ordering::SeqCst);
    // A second one ends the process at once.
    // SAFETY: signal() is async-signal-safe.
    unsafe {
        libc::signal(signal, libc::SIG_DFL);
    }
}

/// Installs `handler` for every stop signal.
fn on_stop_signals(handler: libc::sighandler_t) {
    for s in STOP_SIGNALS {
        // SAFETY: the handler only stores an atomic and resets itself (or is SIG_DFL).
        unsafe {
            libc::signal(s, handler);
        }
    }
}

/// The name of a stop signal.
fn signal_name(signal: libc::c_int) -> &'static str {
    match signal {
        libc::SIGTERM => "SIGTERM",
        libc::SIGHUP => "SIGHUP",
        _ => "SIGINT",
    }
}

/// How a run ended.
enum Ended {
    /// Every epoch ran.
    Done,
    /// The pipeline stopped: a failure budget was exceeded, or an error.
    Failed(String),
    /// An epoch delivered nothing (every item failed, or there were none): the library's
    /// words for it.
    Empty(String),
    /// Ctrl-C, SIGTERM or SIGHUP (the signal).
    Interrupted(libc::c_int),
}

impl Ended {
    fn status(&self) -> &'static str {
        match self {
            Ended::Done => "ok",
            Ended::Failed(_) => "failed",
            Ended::Empty(_) => "empty",
            Ended::Interrupted(_) => "interrupted",
        }
    }
}

/// Runs a pipeline file: live view on stderr, summary and a JSON line on stdout. The exit
/// code is 0 when every epoch ran, 1 when the pipeline failed (`run.max_failures` exceeded)
/// or an epoch delivered nothing, 128 + the signal after Ctrl-C, SIGTERM or SIGHUP (130, 143,
/// 129; the summary and JSON still print).
/// A batch's fields besides the media, for `--dump`: a JSON object per item, in the batch's
/// order (text as strings, JSON as itself, bytes as hex, a missing optional field as null).
fn fields_jsonl(b: &flowgate::loader::Batch) -> String {
    use flowgate::dataset::FieldValue;
    let mut out = String::new();
    for m in &b.items {
        let item: serde_json::Map<String, serde_json::Value> = b
            .extra_names
            .iter()
            .zip(&m.extras)
            .map(|(name, v)| {
                let v = match v {
                    FieldValue::Text(t) => serde_json::Value::from(t.as_str()),
                    FieldValue::Json(j) => j.clone(),
                    FieldValue::Int(i) => serde_json::Value::from(*i),
                    FieldValue::Bytes(b) => serde_json::Value::from(
                        b.iter().map(|x| format!("{x:02x}")).collect::<String>(),
                    ),
                    FieldValue::Missing => serde_json::Value::Null,
                };
                (name.clone(), v)
            })
            .collect();
        out.push_str(&serde_json::Value::Object(item).to_string());
        out.push('\n');
    }
    out
}

pub(crate) fn run(file: &Path, quiet: bool, dump: Option<&Path>) -> Result<ExitCode, Error> {
    let spec = PipelineSpec::load(file)?;
    if let Some(dir) = dump {
        std::fs::create_dir_all(dir).map_err(|e| format!("creating {}: {e}", dir.display()))?;
    }
    let jsonl = match &spec.metrics.jsonl {
        Some(p) => {
            Some(std::fs::File::create(p).map_err(|e| format!("creating {}: {e}", p.display()))?)
        }
        None => None,
    };
    let metrics = metrics_exporter(&spec)?;
    let started = Instant::now();
    let hook = {
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
            view::with(|v| v.update(stats));
        }) as flowgate::StatsCallback
    };
    let on_decision = Box::new(move |r: &flowgate::TraceRecord| {
        // The rate the view shows (over its window), not the one tick's the tuner saw.
        let mut rate = None;
        view::with(|v| rate = v.batches_per_s());
        let rate = match rate {
            Some((b, window)) => format!("{b:>6.1} batches/s (last {window:.0} s)"),
            None => format!("{:>6.1} batches/s", r.rate),
        };
        for d in &r.decisions {
            let what = d.action.describe(&r.stages, r.memory_budget);
            let line = format!(
                "tuner @{:>5.1}s {rate}  {what}: {}",
                r.t,
                d.reason.replace("results/s", "batches/s")
            );
            let mut logged = false;
            view::with(|v| {
                v.decision(r, line.clone(), what.clone());
                logged = true;
            });
            if !logged {
                eprintln!("{line}");
            }
        }
        if let Some(why) = r.cpu.as_ref().and_then(|c| c.why.as_deref()) {
            let line = format!("tuner @{:>5.1}s {rate}  node cpu share: {why}", r.t);
            let mut logged = false;
            view::with(|v| {
                v.decision(r, line.clone(), "node cpu share".to_owned());
                logged = true;
            });
            if !logged {
                eprintln!("{line}");
            }
        }
    }) as flowgate::spec::DecisionHook;
    let on_failure = Box::new(|e: &flowgate::ItemError| view::with(|v| v.failure(e)))
        as flowgate::spec::FailureHook;
    let mode = if quiet {
        view::Mode::Off
    } else if std::io::stderr().is_terminal() {
        view::Mode::Terminal
    } else {
        view::Mode::Lines(Duration::from_secs_f64(spec.run.progress_s))
    };
    let mut loader = spec.build(flowgate::spec::Hooks {
        on_stats: Some(hook),
        on_decision: Some(on_decision),
        on_failure: Some(on_failure),
    })?;
    let policy = spec
        .tuner
        .enabled
        .then(|| spec.tuner_settings().make_policy().name().to_owned());
    eprintln!(
        "{}: {} items per epoch, {} epoch(s), batches of {}{}",
        file.display(),
        loader.items,
        spec.run.epochs,
        spec.batch_size(),
        match &policy {
            Some(p) => format!(", self-tuning ({p} policy)"),
            None => ", tuner off".to_owned(),
        }
    );
    view::start(
        mode,
        spec.run.epochs,
        loader.items,
        policy,
        spec.run.seconds,
    );
    on_stop_signals(on_stop_signal as extern "C" fn(libc::c_int) as libc::sighandler_t);
    let started = Instant::now(); // after the build (and any upload to a local S3 server)
    let mut epochs = Vec::new();
    let mut shape: Option<Vec<usize>> = None;
    let mut ended = Ended::Done;
    'run: for epoch in 0..spec.run.epochs {
        view::with(|v| {
            v.epoch.0 = epoch + 1;
            v.done = 0;
            v.failed = 0;
        });
        let t0 = Instant::now();
        let mut items = 0usize;
        let mut index = 0usize;
        // The library's error when every item of the epoch failed.
        let mut nothing = None;
        if let Err(e) = loader.loader.start_epoch() {
            epochs.push((items, t0.elapsed().as_secs_f64()));
            ended = Ended::Failed(e.to_string());
            break 'run;
        }
        loop {
            if spec
                .run
                .seconds
                .is_some_and(|t| started.elapsed().as_secs_f64() >= t)
            {
                epochs.push((items, t0.elapsed().as_secs_f64()));
                break 'run;
            }
            let signal = INTERRUPTED.load(Ordering::SeqCst);
            if signal != 0 {
                epochs.push((items, t0.elapsed().as_secs_f64()));
                ended = Ended::Interrupted(signal);
                break 'run;
            }
            let (batch, labels, extras, others) =
                match loader.loader.next_within(Duration::from_millis(100)) {
                    // The media: the first tensor; for the dump, the others by name (lengths,
                    // a video's audio track, media fields) and the fields besides them.
                    Within::Next(Ok(b)) => {
                        let extras =
                            (dump.is_some() && !b.extra_names.is_empty()).then(|| fields_jsonl(&b));
                        let flowgate::loader::Batch {
                            fields,
                            names,
                            labels,
                            ..
                        } = b;
                        let mut tensors = fields.into_iter();
                        let media = tensors.next().expect("a batch holds its media");
                        let others: Vec<_> = if dump.is_some() {
                            names.iter().skip(1).cloned().zip(tensors).collect()
                        } else {
                            Vec::new()
                        };
                        (media, labels, extras, others)
                    }
                    Within::Next(Err(e)) if e.is_nothing_delivered() => {
                        nothing = Some(e.to_string());
                        break;
                    }
                    Within::Next(Err(e)) => {
                        epochs.push((items, t0.elapsed().as_secs_f64()));
                        ended = Ended::Failed(e.to_string());
                        break 'run;
                    }
                    Within::EpochEnd => break,
                    Within::TimedOut => continue,
                };
            let n = batch.shape()[0];
            items += n;
            view::with(|v| {
                v.done += n;
                v.done_total += n;
            });
            if let Some(dir) = dump {
                let path = dir.join(format!("epoch{epoch}-batch{index:05}.npy"));
                let npy = batch
                    .to_npy()
                    .map_err(|e| format!("{}: {e}", path.display()))?;
                std::fs::write(&path, npy)
                    .map_err(|e| format!("writing {}: {e}", path.display()))?;
                if let Some(lines) = &extras {
                    let path = dir.join(format!("epoch{epoch}-batch{index:05}-fields.jsonl"));
                    std::fs::write(&path, lines)
                        .map_err(|e| format!("writing {}: {e}", path.display()))?;
                }
                for (name, t) in &others {
                    let path = dir.join(format!("epoch{epoch}-batch{index:05}-{name}.npy"));
                    let npy = t.to_npy().map_err(|e| format!("{}: {e}", path.display()))?;
                    std::fs::write(&path, npy)
                        .map_err(|e| format!("writing {}: {e}", path.display()))?;
                }
                if let Some(labels) = &labels {
                    let path = dir.join(format!("epoch{epoch}-batch{index:05}-labels.npy"));
                    let npy = labels
                        .to_npy()
                        .map_err(|e| format!("{}: {e}", path.display()))?;
                    std::fs::write(&path, npy)
                        .map_err(|e| format!("writing {}: {e}", path.display()))?;
                }
            }
            index += 1;
            // The batch shape a full batch has (not the last, partial one).
            if shape.as_ref().is_none_or(|s| s[0] < n) {
                shape = Some(batch.shape().to_vec());
            }
            let step = spec.run.step_at(started.elapsed().as_secs_f64());
            if step > 0.0 {
                // The simulated training step.
                std::thread::sleep(Duration::from_secs_f64(step / 1000.0));
            }
        }
        epochs.push((items, t0.elapsed().as_secs_f64()));
        if items == 0 {
            ended =
                Ended::Empty(nothing.unwrap_or_else(|| format!("epoch {epoch} delivered nothing")));
            break;
        }
    }
    let total = started.elapsed().as_secs_f64();
    let stats = loader.loader.stats();
    let groups = view::finish(&stats);
    // Back to the default for the rest of the process.
    on_stop_signals(libc::SIG_DFL);
    drop(loader.loader);
    print!("{}", summary(&stats, &epochs, &groups));
    if let Some(c) = loader.cache.as_ref().map(|c| c.stats()) {
        println!(
            "cache: {} hits, {} misses, {} of {}, {} evicted",
            c.hits,
            c.misses,
            text::bytes(c.bytes),
            text::bytes(c.capacity_bytes),
            text::bytes(c.evicted_bytes)
        );
    }
    let items: usize = epochs.iter().map(|e| e.0).sum();
    let error = match &ended {
        Ended::Done => None,
        Ended::Failed(e) => Some(e.clone()),
        Ended::Empty(e) => Some(e.clone()),
        Ended::Interrupted(s) => Some(format!("interrupted ({})", signal_name(*s))),
    };
    println!(
        "{}",
        serde_json::json!({
            "pipeline": file.display().to_string(),
            "status": ended.status(),
            "error": error,
            "epochs": epochs.len(),
            "items": items,
            "seconds": total,
            "items_per_s": items as f64 / total,
            "failures": stats.failures,
            "consumer_wait_fraction": stats.consumer_wait.as_secs_f64() / total.max(1e-9),
            "batch_shape": shape.unwrap_or_default(),
            "workers": stats.stages.iter().map(|s| (s.name.clone(), s.workers)).collect::<std::collections::BTreeMap<_, _>>(),
        })
    );
    let _ = std::io::stdout().flush();
    Ok(match ended {
        Ended::Done => ExitCode::SUCCESS,
        Ended::Interrupted(s) => {
            eprintln!("flowgate: interrupted ({})", signal_name(s));
            ExitCode::from(128 + s as u8)
        }
        Ended::Failed(_) | Ended::Empty(_) => {
            eprintln!("flowgate: {}", error.unwrap_or_default());
            ExitCode::FAILURE
        }
    })
}

/// The per-stage table after a run.
fn summary(stats: &PipelineStats, epochs: &[(usize, f64)], groups: &view::FailureGroups) -> String {
    let mut s = String::new();
    let rate = |&(items, secs): &(usize, f64)| items as f64 / secs.max(1e-9);
    // A long run's middle epochs in one line: the first three and the last two in full.
    let (head, tail) = if epochs.len() > 8 {
        (3, epochs.len() - 2)
    } else {
        (epochs.len(), epochs.len())
    };
    for (i, e) in epochs.iter().enumerate() {
        if i == head && head < tail {
            let middle = &epochs[head..tail];
            let (lo, hi) = middle
                .iter()
                .map(rate)
                .fold((f64::MAX, 0.0f64), |(a, b), r| (a.min(r), b.max(r)));
            let _ = writeln!(
                s,
                "epochs {}-{}: {} items, {lo:.0} to {hi:.0} items/s",
                head + 1,
                tail,
                middle.iter().map(|e| e.0).sum::<usize>()
            );
        }
        if i < head || i >= tail {
            let _ = writeln!(
                s,
                "epoch {}: {} items in {:.2} s = {:.0} items/s",
                i + 1,
                e.0,
                e.1,
                rate(e)
            );
        }
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
    if let Some(m) = &stats.memory_budget {
        let _ = writeln!(
            s,
            "memory budget {:.1} MiB: {}",
            flowgate::limits::bytes_to_mib(m.bytes),
            m.source
        );
    }
    // Failures by reason (the same reason on many files is one line), then the last one.
    for (reason, n, item) in groups.iter().take(5) {
        let _ = writeln!(s, "  {n} failed: {reason} (latest: {item})");
    }
    if groups.len() > 5 {
        let _ = writeln!(s, "  ... and {} more reasons", groups.len() - 5);
    }
    if let Some(f) = stats.recent_failures.last() {
        let _ = writeln!(s, "  last failure: {f}");
    }
    s
}

/// Prometheus metrics, when built with the feature and asked for.
#[cfg(feature = "prometheus")]
fn metrics_exporter(spec: &PipelineSpec) -> Result<Option<crate::metrics::Exporter>, Error> {
    match &spec.metrics.prometheus {
        Some(addr) => Ok(Some(crate::metrics::Exporter::start(
            flowgate::prometheus::address(addr).map_err(|e| format!("metrics.prometheus: {e}"))?,
        )?)),
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
