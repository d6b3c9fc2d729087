//! The tuner on real pipelines: a cold async stage opened up while pinned knobs stay put,
//! an evicting cache grown until the data fits, and a tuner turned off staying off.

use crate::common;

use std::time::{Duration, Instant};

use common::{within, Injected};
use flowgate::Pipeline;

#[test]
fn the_tuner_scales_a_cold_pipeline_and_leaves_pinned_knobs_alone() {
    let trace = std::env::temp_dir().join(format!("flowgate-trace-{}.jsonl", std::process::id()));
    let mut p = Pipeline::builder()
        .source_epochs(|_| 0..6000u64)
        .pipe_async(
            "fetch",
            |x| async move {
                tokio::time::sleep(Duration::from_millis(20)).await;
                Ok::<_, Injected>(x)
            },
            1,
        )
        .pipe("pinned", Ok::<_, Injected>, flowgate::Workers::fixed(1))
        .budget(64, u64::MAX)
        .autotune(flowgate::TunerSettings {
            tick: Some(Duration::from_millis(50)),
            trace: Some(trace.clone()),
            ..Default::default()
        })
        .build()
        .unwrap();
    let t0 = Instant::now();
    assert_eq!(p.iter().count(), 6000);
    // One request in flight at 20 ms each would take 120 s; the tuner must open it up.
    assert!(t0.elapsed() < Duration::from_secs(30), "{:?}", t0.elapsed());
    let records = p.tuner_trace();
    let fetch_max = records.iter().map(|r| r.workers[0]).max().unwrap();
    assert!(fetch_max >= 16, "fetch concurrency peaked at {fetch_max}");
    assert!(
        records
            .iter()
            .all(|r| r.workers[1] == 1 && r.budgets[1] == 64),
        "pinned knobs moved"
    );
    assert!(records
        .iter()
        .flat_map(|r| &r.decisions)
        .all(|d| !d.reason.is_empty()));
    drop(p);
    let lines = std::fs::read_to_string(&trace).unwrap();
    let parsed: Vec<flowgate::TraceRecord> = lines
        .lines()
        .map(|l| serde_json::from_str(l).unwrap())
        .collect();
    assert!(parsed.iter().any(|r| !r.decisions.is_empty()));
    let _ = std::fs::remove_file(trace);
}

/// The tuner grows a cache that evicts (up to its ceiling) until the data fits, after which
/// epochs stop missing.
#[test]
fn the_tuner_grows_an_evicting_cache_until_the_data_fits() {
    within(120, || {
        let cache = flowgate::byte_cache::ByteCache::new(40_000).max_bytes(1 << 20);
        let fetch = cache.through_blocking(|k: String| -> Result<flowgate::Blob, std::io::Error> {
            std::thread::sleep(Duration::from_micros(300));
            Ok(flowgate::Blob {
                path: k.into(),
                bytes: vec![1; 10_000],
            })
        });
        let mut p = Pipeline::builder()
            .source_epochs(|_| (0..40).map(|i| format!("k{i}")))
            .pipe("fetch", fetch, 1)
            .cache(&cache)
            .build()
            .unwrap();
        let started = Instant::now();
        let mut misses_last_epoch = u64::MAX;
        while started.elapsed() < Duration::from_secs(60) && misses_last_epoch > 0 {
            let before = cache.stats().misses;
            assert_eq!(p.iter().map(Result::unwrap).count(), 40);
            misses_last_epoch = cache.stats().misses - before;
        }
        let s = cache.stats();
        assert_eq!(misses_last_epoch, 0, "{s:?}");
        assert!(s.capacity_bytes >= 400_000, "{s:?}");
        let trace = p.tuner_trace();
        assert!(
            trace.iter().any(|r| r
                .decisions
                .iter()
                .any(|d| matches!(d.action, flowgate::tuner::Action::SetCacheBytes { .. }))),
            "the trace records the cache decisions"
        );
    });
}

#[test]
fn a_decision_callback_does_not_turn_the_tuner_back_on() {
    let mut p = Pipeline::builder()
        .source_epochs(|_| 0..5_000u64)
        .pipe(
            "slow",
            |x| {
                std::thread::sleep(Duration::from_micros(60));
                Ok::<_, std::io::Error>(x)
            },
            1,
        )
        .autotune_off()
        .on_tuner_decision(|_| panic!("the tuner is off"))
        .gpu_utilization(|| Some(0.0))
        .build()
        .unwrap();
    assert_eq!(p.iter().count(), 5_000);
    assert!(p.tuner_trace().is_empty(), "no tuner ticks");
    assert_eq!(p.stats().stage("slow").unwrap().workers, 1);
}
