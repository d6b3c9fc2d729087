//! A soak test: a pipeline under faults, resizes, panics and checkpoints, for a fixed time.
//!
//! ```text
//! cargo run --release -p flowgate-tools --bin soak -- [--seconds 600] [--items 20000] [--fault-rate 0.01]
//!     [--panic-rate 0.001] [--warmup 60] [--tuner on|off] [--chaos on|off] [--resume on|off]
//! ```
//!
//! `read` (async) simulates an object store (0-2 ms latency, failures at `--fault-rate`, a rare
//! 50 ms stall); `decode` burns ~40 µs of CPU per item, fails at `--fault-rate` and *panics*
//! at `--panic-rate`; `aggregate(32)` + `collate` make batches. The tuner is on, and a chaos
//! thread resizes random stages to random sizes every 0.1-1 s. Every third epoch is
//! interrupted at a random point: the consumer takes a checkpoint, drops the pipeline (workers
//! mid-item, tuner mid-resize), builds a new one and resumes.
//!
//! For every epoch it checks that each item was either delivered or reported failed exactly
//! once: **lost** (neither) and **duplicated** (twice, or both) must be 0. After each epoch
//! past the warm-up it samples RSS and the heap in use (a counting global allocator); growth
//! is the peak of the last quarter of the samples over the peak of the first quarter. It also
//! compares the thread count before the first pipeline and after the last one is dropped.
//! Prints one JSON line; exits 1 if anything was lost or duplicated, threads leaked, or RSS
//! or heap grew 5% or more. `scripts/soak.sh` runs it.

use std::collections::{HashMap, HashSet};
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use flowgate::sampler::Sampler;
use flowgate::{Pipeline, PipelineError, PipelineState, TunerSettings};

#[derive(Clone, Copy, Debug)]
struct Args {
    seconds: u64,
    items: usize,
    fault_rate: f64,
    panic_rate: f64,
    warmup: u64,
    tuner: bool,
    chaos: bool,
    resume: bool,
}

fn parse() -> Args {
    let mut a = Args {
        seconds: 600,
        items: 20_000,
        fault_rate: 0.01,
        panic_rate: 0.001,
        warmup: 0,
        tuner: true,
        chaos: true,
        resume: true,
    };
    let argv: Vec<String> = std::env::args().skip(1).collect();
    let mut it = argv.iter();
    while let Some(flag) = it.next() {
        let v = it.next().unwrap_or_else(|| panic!("{flag} needs a value"));
        match flag.as_str() {
            "--seconds" => a.seconds = v.parse().expect("--seconds"),
            "--items" => a.items = v.parse().expect("--items"),
            "--fault-rate" => a.fault_rate = v.parse().expect("--fault-rate"),
            "--panic-rate" => a.panic_rate = v.parse().expect("--panic-rate"),
            "--warmup" => a.warmup = v.parse().expect("--warmup"),
            "--tuner" => a.tuner = v == "on",
            "--chaos" => a.chaos = v == "on",
            "--resume" => a.resume = v == "on",
            other => panic!("unknown flag {other}"),
        }
    }
    if a.warmup == 0 {
        a.warmup = (a.seconds / 10).clamp(1, 60);
    }
    a
}

/// A hash of (x, salt) mapped to [0, 1): which items fail, stall or panic, and how long they
/// take. Per epoch, so a resumed epoch injects the same faults into the same items.
fn unit(x: u64, salt: u64) -> f64 {
    let mut h = x ^ salt.wrapping_mul(0x9E37_79B9_7F4A_7C15);
    h = (h ^ (h >> 31)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
    h = (h ^ (h >> 29)).wrapping_mul(0x94D0_49BB_1331_11EB);
    (h >> 11) as f64 / (1u64 << 53) as f64
}

#[derive(Debug)]
struct Injected(&'static str, u64);
impl std::fmt::Display for Injected {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "injected {} fault on item {}", self.0, self.1)
    }
}
impl std::error::Error for Injected {}

/// Item ids carry the epoch in their high bits, so faults differ per epoch.
fn id(epoch: u64, i: usize) -> u64 {
    (epoch << 32) | i as u64
}

fn build(a: Args, failures: Arc<Mutex<Vec<u64>>>) -> Result<Pipeline<Vec<u64>>, PipelineError> {
    let sampler = Sampler::new(a.items).shuffle(42);
    let tuner = a.tuner;
    let fault = a.fault_rate;
    let panic_rate = a.panic_rate;
    Pipeline::builder()
        .source_epochs(move |e| {
            sampler
                .epoch(e)
                .into_iter()
                .map(move |i| id(e, i))
                .collect::<Vec<_>>()
        })
        .describe(|x: &u64| x.to_string())
        .pipe_async(
            "read",
            move |x: u64| async move {
                let u = unit(x, 1);
                let wait = if u < 0.0005 {
                    Duration::from_millis(50)
                } else {
                    Duration::from_micros((unit(x, 2) * 2000.0) as u64)
                };
                tokio::time::sleep(wait).await;
                if unit(x, 3) < fault {
                    return Err(Injected("read", x));
                }
                Ok((x, vec![x as u8; 4096]))
            },
            2,
        )
        .describe(|(x, _): &(u64, Vec<u8>)| x.to_string())
        .pipe(
            "decode",
            move |(x, bytes): (u64, Vec<u8>)| {
                if unit(x, 4) < panic_rate {
                    panic!("injected panic on item {x}");
                }
                if unit(x, 5) < fault {
                    return Err(Injected("decode", x));
                }
                let t0 = Instant::now();
                let mut h = x;
                while t0.elapsed() < Duration::from_micros(40) {
                    for b in &bytes[..64] {
                        h = h.rotate_left(5) ^ u64::from(*b);
                    }
                }
                std::hint::black_box(h);
                Ok(x)
            },
            1,
        )
        .aggregate(32, false)
        .pipe("collate", Ok::<_, std::convert::Infallible>, 1)
        .autotune_if(tuner)
        .on_failure(move |e| {
            if let Ok(x) = e.item().parse() {
                failures.lock().expect("failures").push(x);
            }
        })
        .build()
}

/// The tuner on (its default settings), or every stage left where it was built.
trait AutotuneIf {
    fn autotune_if(self, on: bool) -> Self;
}

impl<T: Send + 'static> AutotuneIf for flowgate::PipelineBuilder<T> {
    fn autotune_if(self, on: bool) -> Self {
        if on {
            self.autotune(TunerSettings::default())
        } else {
            self.autotune_off()
        }
    }
}

/// The system allocator, counting the bytes in use: the leak signal, free of the allocator's
/// retention (glibc keeps freed memory in per-thread arenas, which RSS includes).
struct Counting;

static HEAP: AtomicU64 = AtomicU64::new(0);

// SAFETY: delegates to `System`, only counting sizes.
unsafe impl std::alloc::GlobalAlloc for Counting {
    unsafe fn alloc(&self, layout: std::alloc::Layout) -> *mut u8 {
        HEAP.fetch_add(layout.size() as u64, Ordering::Relaxed);
        // SAFETY: the caller's contract is System's.
        unsafe { std::alloc::System.alloc(layout) }
    }
    unsafe fn dealloc(&self, ptr: *mut u8, layout: std::alloc::Layout) {
        HEAP.fetch_sub(layout.size() as u64, Ordering::Relaxed);
        // SAFETY: as above.
        unsafe { std::alloc::System.dealloc(ptr, layout) }
    }
    unsafe fn realloc(&self, ptr: *mut u8, layout: std::alloc::Layout, new: usize) -> *mut u8 {
        HEAP.fetch_add(new as u64, Ordering::Relaxed);
        HEAP.fetch_sub(layout.size() as u64, Ordering::Relaxed);
        // SAFETY: as above.
        unsafe { std::alloc::System.realloc(ptr, layout, new) }
    }
}

#[global_allocator]
static ALLOC: Counting = Counting;

fn heap_mb() -> f64 {
    HEAP.load(Ordering::Relaxed) as f64 / (1024.0 * 1024.0)
}

/// Growth of the peak in the last quarter of the samples over the peak in the first quarter,
/// in percent: buffers come and go with the tuner's and the chaos thread's resizes, so single
/// readings say little, while a leak raises every later peak.
fn peak_growth(samples: &[f64]) -> f64 {
    let q = (samples.len() / 4).max(1);
    let peak = |s: &[f64]| s.iter().copied().fold(0.0, f64::max);
    let (first, last) = (
        peak(&samples[..q.min(samples.len())]),
        peak(&samples[samples.len().saturating_sub(q)..]),
    );
    (last - first) / first.max(1e-9) * 100.0
}

fn proc_status(key: &str) -> u64 {
    std::fs::read_to_string("/proc/self/status")
        .ok()
        .and_then(|s| {
            s.lines()
                .find(|l| l.starts_with(key))
                .and_then(|l| l.split_whitespace().nth(1))
                .and_then(|v| v.parse().ok())
        })
        .unwrap_or(0)
}

fn rss_mb() -> f64 {
    proc_status("VmRSS:") as f64 / 1024.0
}

fn threads() -> u64 {
    proc_status("Threads:")
}

/// Resizes random stages of whatever pipeline is current, until told to stop.
fn chaos(
    control: Arc<Mutex<Option<flowgate::ControlHandle>>>,
    stop: Arc<AtomicBool>,
    resizes: Arc<AtomicU64>,
    enabled: bool,
) -> std::thread::JoinHandle<()> {
    std::thread::spawn(move || {
        let mut n = 0u64;
        while !stop.load(Ordering::Relaxed) {
            n += 1;
            std::thread::sleep(Duration::from_millis(100 + (unit(n, 6) * 900.0) as u64));
            let c = control.lock().expect("control").clone();
            if let Some(c) = c.filter(|_| enabled) {
                let stage = ["read", "decode", "collate"][(unit(n, 7) * 3.0) as usize];
                let workers = 1 + (unit(n, 8) * 6.0) as usize;
                if c.resize(stage, workers).is_ok() {
                    resizes.fetch_add(1, Ordering::Relaxed);
                }
            }
        }
    })
}

fn main() -> Result<(), PipelineError> {
    let a = parse();
    std::panic::set_hook(Box::new(|info| {
        let msg = info
            .payload()
            .downcast_ref::<String>()
            .map(String::as_str)
            .unwrap_or("");
        if !msg.starts_with("injected") {
            eprintln!("{info}");
        }
    }));
    let threads_start = threads();
    let failures = Arc::new(Mutex::new(Vec::new()));
    let control = Arc::new(Mutex::new(None));
    let stop = Arc::new(AtomicBool::new(false));
    let resizes = Arc::new(AtomicU64::new(0));
    let chaos_thread = chaos(
        Arc::clone(&control),
        Arc::clone(&stop),
        Arc::clone(&resizes),
        a.chaos,
    );
    eprintln!(
        "soak: {} s, {} items per epoch, fault rate {}, panic rate {}, warm-up {} s",
        a.seconds, a.items, a.fault_rate, a.panic_rate, a.warmup
    );

    let t0 = Instant::now();
    let mut p = build(a, Arc::clone(&failures))?;
    *control.lock().expect("control") = Some(p.control());
    let (mut delivered, mut failed, mut lost, mut duplicated) = (0u64, 0u64, 0u64, 0u64);
    let (mut resumes, mut decisions, mut epochs) = (0u64, 0u64, 0u64);
    // (RSS, heap) after each epoch once warmed up.
    let mut samples: Vec<(f64, f64)> = Vec::new();
    let mut epoch = 0u64;
    while t0.elapsed() < Duration::from_secs(a.seconds) {
        // Every item of this epoch: how many times it was delivered; which were reported
        // failed (a failure reported before a checkpoint is attempted, and reported, again
        // after the resume: reports are a set).
        let mut seen: HashMap<u64, u32> = HashMap::with_capacity(a.items);
        let mut interrupt =
            (a.resume && epoch % 3 == 2).then(|| (unit(epoch, 9) * a.items as f64) as usize);
        let mut got = 0usize;
        loop {
            let mut cut = false;
            for batch in p.iter() {
                for x in batch? {
                    *seen.entry(x).or_default() += 1;
                    got += 1;
                }
                if interrupt.is_some_and(|at| got >= at) {
                    cut = true;
                    break;
                }
            }
            if !cut {
                break;
            }
            // Checkpoint, drop under load, rebuild, resume.
            interrupt = None;
            let state: PipelineState = p.state();
            decisions += p
                .tuner_trace()
                .iter()
                .map(|r| r.decisions.len() as u64)
                .sum::<u64>();
            *control.lock().expect("control") = None;
            drop(p);
            p = build(a, Arc::clone(&failures))?;
            p.resume(&state)?;
            *control.lock().expect("control") = Some(p.control());
            resumes += 1;
        }
        let reported: HashSet<u64> = failures
            .lock()
            .expect("failures")
            .drain(..)
            .filter(|x| x >> 32 == epoch)
            .collect();
        failed += reported.len() as u64;
        delivered += got as u64;
        for i in 0..a.items {
            let x = id(epoch, i);
            let times = seen.get(&x).copied().unwrap_or(0);
            let failed = reported.contains(&x);
            match (times, failed) {
                (0, false) => lost += 1,
                (0, true) | (1, false) => {}
                (k, f) => duplicated += u64::from(k) - 1 + u64::from(f),
            }
        }
        epoch += 1;
        epochs += 1;
        if t0.elapsed() >= Duration::from_secs(a.warmup) {
            samples.push((rss_mb(), heap_mb()));
        }
        eprintln!(
            "  epoch {epoch}: {got} delivered, {:.0} s, RSS {:.1} MB, heap {:.1} MB, {} threads, \
             lost {lost}, duplicated {duplicated}",
            t0.elapsed().as_secs_f64(),
            rss_mb(),
            heap_mb(),
            threads()
        );
    }
    decisions += p
        .tuner_trace()
        .iter()
        .map(|r| r.decisions.len() as u64)
        .sum::<u64>();
    let stats = p.stats();
    *control.lock().expect("control") = None;
    drop(p);
    stop.store(true, Ordering::Relaxed);
    let _ = chaos_thread.join();
    let threads_end = threads();
    let secs = t0.elapsed().as_secs_f64();
    let rss: Vec<f64> = samples.iter().map(|s| s.0).collect();
    let heap: Vec<f64> = samples.iter().map(|s| s.1).collect();
    let (rss_growth, heap_growth) = (peak_growth(&rss), peak_growth(&heap));
    let peak = |v: &[f64]| v.iter().copied().fold(0.0, f64::max);
    println!(
        "{{\"seconds\":{secs:.0},\"epochs\":{epochs},\"items_per_epoch\":{},\"delivered\":{delivered},\
\"failed\":{failed},\"lost\":{lost},\"duplicated\":{duplicated},\"resumes\":{resumes},\
\"chaos_resizes\":{},\"tuner_decisions_last_pipelines\":{decisions},\"items_per_s\":{:.0},\
\"rss_peak_mb\":{:.1},\"rss_growth_pct\":{rss_growth:.2},\"heap_peak_mb\":{:.1},\
\"heap_growth_pct\":{heap_growth:.2},\
\"threads_start\":{threads_start},\"threads_end\":{threads_end},\"last_pipeline_failures\":{}}}",
        a.items,
        resizes.load(Ordering::Relaxed),
        delivered as f64 / secs,
        peak(&rss),
        peak(&heap),
        stats.failures,
    );
    let ok = lost == 0
        && duplicated == 0
        && threads_end == threads_start
        && rss_growth < 5.0
        && heap_growth < 5.0;
    if !ok {
        eprintln!("soak: FAILED");
        std::process::exit(1);
    }
    Ok(())
}
