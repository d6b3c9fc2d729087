//! Shutdown: dropping mid-epoch, `stop()` twice, a fatal error, a stop from another thread.
//! Each returns promptly and the process's thread count returns to its baseline.
//!
//! These scenarios count the process's threads, so they run one after another in a single test
//! (the test harness's own threads would otherwise come and go), in their own test binary.

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use flowgate::{FailureBudget, Pipeline};

#[test]
fn shutdown_is_prompt_and_leaks_no_thread() {
    isolate!();
    dropping_mid_epoch_is_prompt_and_leaks_no_thread();
    stop_twice_and_then_iterate();
    an_error_past_the_budget_stops_everything();
    a_stop_handle_unblocks_a_waiting_consumer();
    the_cpu_cap_limits_extra_workers();
    dropping_mid_epoch_frees_every_item();
    let names = flowgate_threads();
    assert!(names.is_empty(), "pipeline threads still alive: {names:?}");
}

/// Names of this process's threads that a pipeline started (all are named `fg-…`).
fn flowgate_threads() -> Vec<String> {
    std::fs::read_dir("/proc/self/task")
        .expect("procfs")
        .filter_map(|t| std::fs::read_to_string(t.ok()?.path().join("comm")).ok())
        .map(|n| n.trim().to_owned())
        .filter(|n| n.starts_with("fg-"))
        .collect()
}

fn threads() -> usize {
    let status = std::fs::read_to_string("/proc/self/status").expect("procfs");
    status
        .lines()
        .find_map(|l| l.strip_prefix("Threads:"))
        .and_then(|n| n.trim().parse().ok())
        .expect("a Threads: line")
}

/// Asserts the thread count comes back to `baseline` (threads may take a moment to be reaped
/// after `join` returns).
fn assert_back_to(baseline: usize) {
    let deadline = Instant::now() + Duration::from_secs(5);
    while threads() != baseline && Instant::now() < deadline {
        std::thread::sleep(Duration::from_millis(5));
    }
    assert_eq!(threads(), baseline, "threads leaked");
}

fn slow(x: u64) -> Result<u64, std::io::Error> {
    std::thread::sleep(Duration::from_micros(300));
    Ok(x)
}

fn busy_pipeline(with_async: bool) -> Pipeline<Vec<u64>> {
    let b = Pipeline::builder()
        .source_epochs(|_| 0..1_000_000u64)
        .pipe("a", slow, 3)
        .pipe("b", |x| Ok::<_, std::io::Error>(x + 1), 2);
    let b = if with_async {
        b.pipe_async(
            "io",
            |x| async move {
                tokio::time::sleep(Duration::from_millis(1)).await;
                Ok::<_, std::io::Error>(x)
            },
            8,
        )
    } else {
        b.pipe("io", Ok::<_, std::io::Error>, 1)
    };
    b.aggregate(16, false).build().unwrap()
}

fn dropping_mid_epoch_is_prompt_and_leaks_no_thread() {
    let baseline = threads();
    for with_async in [false, true] {
        let mut p = busy_pipeline(with_async);
        assert!(threads() > baseline);
        let first: Vec<_> = p.iter().take(3).map(Result::unwrap).collect();
        assert_eq!(first.len(), 3);
        let t0 = Instant::now();
        drop(p);
        assert!(
            t0.elapsed() < Duration::from_secs(2),
            "drop took {:?}",
            t0.elapsed()
        );
        assert_back_to(baseline);
    }
}

fn stop_twice_and_then_iterate() {
    let baseline = threads();
    let mut p = busy_pipeline(true);
    p.iter().next().unwrap().unwrap();
    let t0 = Instant::now();
    p.stop();
    p.stop();
    assert!(t0.elapsed() < Duration::from_secs(2));
    assert_back_to(baseline);
    assert!(p.iter().next().is_none());
    assert!(p.resize("a", 2).unwrap_err().is_stopped());
    drop(p);
    assert_back_to(baseline);
}

fn an_error_past_the_budget_stops_everything() {
    let baseline = threads();
    let mut p = Pipeline::builder()
        .source_epochs(|_| 0..1_000_000u64)
        .pipe("a", slow, 2)
        .pipe(
            "fails",
            |x| {
                if x == 500 {
                    Err(std::io::Error::other("bad item"))
                } else {
                    Ok(x)
                }
            },
            2,
        )
        .max_failures(FailureBudget::fail_fast())
        .build()
        .unwrap();
    let t0 = Instant::now();
    let err = p.iter().find_map(Result::err).unwrap();
    assert_eq!(err.stage(), Some("fails"));
    assert!(t0.elapsed() < Duration::from_secs(10));
    drop(p);
    assert_back_to(baseline);
}

fn a_stop_handle_unblocks_a_waiting_consumer() {
    let baseline = threads();
    let delivered = Arc::new(AtomicU64::new(0));
    // A source that produces one item and then blocks forever would keep join from returning;
    // use a slow stage instead, so the consumer is blocked in `next()`.
    let mut p = Pipeline::builder()
        .source_epochs(|_| 0..1_000u64)
        .pipe(
            "glacial",
            |x| {
                std::thread::sleep(Duration::from_millis(50));
                Ok::<_, std::io::Error>(x)
            },
            1,
        )
        .chunk_size(1)
        .build()
        .unwrap();
    let stop = p.stop_handle();
    let stopper = std::thread::spawn(move || {
        std::thread::sleep(Duration::from_millis(120));
        stop.stop();
    });
    let d = Arc::clone(&delivered);
    let last = p
        .iter()
        .inspect(|r| {
            if r.is_ok() {
                d.fetch_add(1, Ordering::Relaxed);
            }
        })
        .last()
        .unwrap();
    assert!(last.unwrap_err().is_stopped());
    assert!(delivered.load(Ordering::Relaxed) < 10);
    stopper.join().unwrap();
    drop(p);
    assert_back_to(baseline);
}

/// Lives here because the cap is process-wide: no other test may hold tokens meanwhile.
fn the_cpu_cap_limits_extra_workers() {
    let baseline = threads();
    flowgate::set_cpu_worker_cap(Some(3));
    let p = Pipeline::builder()
        .source_epochs(|_| 0..10u64)
        .autotune_off()
        .pipe("a", Ok::<_, std::io::Error>, 1)
        .pipe("b", Ok::<_, std::io::Error>, 1)
        .build()
        .unwrap();
    assert_eq!(
        p.resize("a", 3).unwrap(),
        3,
        "two extra workers: two tokens"
    );
    assert_eq!(p.resize("b", 4).unwrap(), 2, "one token left for b");
    assert_eq!(flowgate::actors::cap::cpu_workers_in_use(), 3);
    assert_eq!(p.resize("a", 1).unwrap(), 1, "shrinking returns tokens");
    assert_eq!(p.resize("b", 4).unwrap(), 4);
    drop(p);
    assert_eq!(
        flowgate::actors::cap::cpu_workers_in_use(),
        0,
        "a stopped pipeline returns all"
    );
    flowgate::set_cpu_worker_cap(None);
    assert_back_to(baseline);
}

/// Items alive anywhere (queues, workers, batches): created by the source, dropped by whoever
/// holds them last.
static LIVE: AtomicU64 = AtomicU64::new(0);

#[derive(Debug)]
struct Tracked(#[allow(dead_code)] u64);

impl Tracked {
    fn new(x: u64) -> Self {
        LIVE.fetch_add(1, Ordering::SeqCst);
        Self(x)
    }
}

impl Drop for Tracked {
    fn drop(&mut self) {
        LIVE.fetch_sub(1, Ordering::SeqCst);
    }
}

/// Dropping a pipeline mid-epoch, with the tuner on and items in every queue, frees every item
/// it holds: nothing is kept alive by a reference cycle between its parts.
fn dropping_mid_epoch_frees_every_item() {
    for with_tuner in [false, true] {
        let b = Pipeline::builder()
            .source_epochs(|_| (0..1_000_000u64).map(Tracked::new))
            .pipe(
                "a",
                |t: Tracked| {
                    std::thread::sleep(Duration::from_micros(100));
                    Ok::<_, std::io::Error>(t)
                },
                2,
            )
            .pipe_async(
                "io",
                |t: Tracked| async move {
                    tokio::time::sleep(Duration::from_micros(200)).await;
                    Ok::<_, std::io::Error>(t)
                },
                4,
            )
            .aggregate(8, false);
        let b = if with_tuner { b } else { b.autotune_off() };
        let mut p = b.build().unwrap();
        let got: Vec<Vec<Tracked>> = p.iter().take(20).map(Result::unwrap).collect();
        assert_eq!(got.iter().map(Vec::len).sum::<usize>(), 160);
        std::thread::sleep(Duration::from_millis(50)); // let the queues fill
        assert!(LIVE.load(Ordering::SeqCst) > 160);
        drop(p);
        drop(got);
        let t0 = Instant::now();
        while LIVE.load(Ordering::SeqCst) != 0 && t0.elapsed() < Duration::from_secs(3) {
            std::thread::sleep(Duration::from_millis(10));
        }
        assert_eq!(
            LIVE.load(Ordering::SeqCst),
            0,
            "items still alive after the pipeline was dropped (tuner {with_tuner})"
        );
    }
}
