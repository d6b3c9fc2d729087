//! End-to-end behaviour of the engine: exactly-once delivery, order, backpressure, resizing,
//! epochs, async stages. (Failures are in `failures.rs`, the tuner on real pipelines in
//! `tuning.rs`.)

use crate::common;

use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use common::{mix, quiet_injected_panics, within, Injected};
use flowgate::{Order, Pipeline, Workers};
use proptest::prelude::*;

#[derive(Clone, Debug)]
enum Kind {
    Map,
    Filter,
}

#[derive(Clone, Debug)]
struct StageCase {
    kind: Kind,
    workers: usize,
    fail_pct: u64,
    panic_instead: bool,
    budget: Option<usize>,
}

/// What a stage does to an item: `Ok(Some(y))`, filtered (`Ok(None)`), or a failure.
fn apply(i: usize, s: &StageCase, x: u64) -> Result<Option<u64>, ()> {
    if mix(x, i as u64 + 100) % 100 < s.fail_pct {
        return Err(());
    }
    match s.kind {
        Kind::Map => Ok(Some(x.wrapping_mul(3).wrapping_add(i as u64))),
        Kind::Filter => Ok((mix(x, i as u64) % 4 != 0).then_some(x)),
    }
}

fn stage_strategy() -> impl Strategy<Value = StageCase> {
    (
        prop_oneof![Just(Kind::Map), Just(Kind::Filter)],
        1usize..4,
        prop_oneof![3 => Just(0u64), 1 => 1u64..20],
        any::<bool>(),
        prop::option::of(1usize..40),
    )
        .prop_map(
            |(kind, workers, fail_pct, panic_instead, budget)| StageCase {
                kind,
                workers,
                fail_pct,
                panic_instead,
                budget,
            },
        )
}

fn run_case(
    n: u64,
    stages: &[StageCase],
    order: Order,
    chunk: usize,
) -> (Vec<u64>, Vec<u64>, u64, u64) {
    let mut expected = Vec::new();
    let mut failures = 0;
    'items: for x in 0..n {
        let mut v = x;
        for (i, s) in stages.iter().enumerate() {
            match apply(i, s, v) {
                Ok(Some(y)) => v = y,
                Ok(None) => continue 'items,
                Err(()) => {
                    failures += 1;
                    continue 'items;
                }
            }
        }
        expected.push(v);
    }
    let mut b = Pipeline::builder()
        .source(0..n)
        .output_order(order)
        .chunk_size(chunk)
        .pipe("first", Ok::<_, Injected>, 1);
    for (i, s) in stages.iter().enumerate() {
        let case = s.clone();
        b = b.filter_map(
            &format!("s{i}"),
            move |x| match apply(i, &case, x) {
                Ok(v) => Ok(v),
                Err(()) if case.panic_instead => panic!("injected panic on {x}"),
                Err(()) => Err(Injected(x)),
            },
            s.workers,
        );
        if let Some(items) = s.budget {
            b = b.budget(items, u64::MAX);
        }
    }
    let mut p = b.build().unwrap();
    let got: Vec<u64> = p.iter().map(Result::unwrap).collect();
    let stats = p.stats();
    (got, expected, stats.failures, failures)
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 40, ..ProptestConfig::default() })]

    /// Every item comes out exactly once or is counted as failed; input order is exact.
    #[test]
    fn every_item_exactly_once(
        stages in prop::collection::vec(stage_strategy(), 1..5),
        n in 0u64..3000,
        input_order in any::<bool>(),
        chunk in 1usize..80,
    ) {
        quiet_injected_panics();
        let order = if input_order { Order::Input } else { Order::Completion };
        let case = stages.clone();
        let (mut got, mut expected, failed, expected_failed) =
            within(20, move || run_case(n, &case, order, chunk));
        prop_assert_eq!(failed, expected_failed);
        if order == Order::Completion {
            got.sort_unstable();
            expected.sort_unstable();
        }
        prop_assert_eq!(got, expected);
    }
}

#[test]
fn input_order_survives_a_slow_head_item() {
    let mut p = Pipeline::builder()
        .source(0..500u64)
        .output_order(Order::Input)
        .pipe(
            "slow-first",
            |x| {
                if x % 100 == 0 {
                    std::thread::sleep(Duration::from_millis(30));
                }
                Ok::<_, Injected>(x)
            },
            3,
        )
        .budget(8, u64::MAX)
        .build()
        .unwrap();
    let got: Vec<u64> = p.iter().map(Result::unwrap).collect();
    assert_eq!(got, (0..500).collect::<Vec<_>>());
}

#[test]
fn a_slow_items_result_goes_out_when_made_not_with_its_workers_chunk() {
    // A pool stage sent a worker's results when its chunk of inputs (up to 64) was done: a
    // user's batch made in 0.5 s waited 9 s for the rest of the chunk. Each
    // result of slow items now leaves when made: the loop's first item arrives while its
    // stage has made only a few more, in both orders.
    for order in [Order::Completion, Order::Input] {
        within(60, move || {
            let made = Arc::new(AtomicU64::new(0));
            let m = Arc::clone(&made);
            let mut p = Pipeline::builder()
                .source(0..48u64)
                .output_order(order)
                .aggregate(2, false)
                .pipe(
                    "slow",
                    move |x: Vec<u64>| {
                        std::thread::sleep(Duration::from_millis(40));
                        m.fetch_add(1, Ordering::SeqCst);
                        Ok::<_, Injected>(x)
                    },
                    Workers::fixed(2),
                )
                .build()
                .unwrap();
            let mut it = p.iter();
            // Each of the first few arrives about when made: two workers have made about
            // two more by then. The first went out alone before too (its worker had nothing
            // else yet); the next waited for their workers' whole runs (12 batches each).
            for k in 1..=4 {
                it.next().unwrap().unwrap();
                let at = made.load(Ordering::SeqCst);
                assert!(at <= k + 4, "{order:?}: {at} made when batch {k} arrived");
            }
            assert_eq!(it.count(), 20);
        });
    }
}

/// Waits until `f` has kept the same value for `quiet`, and returns it.
fn settle(f: impl Fn() -> u64, quiet: Duration) -> u64 {
    let deadline = Instant::now() + Duration::from_secs(20);
    let mut last = f();
    let mut since = Instant::now();
    while Instant::now() < deadline {
        std::thread::sleep(Duration::from_millis(10));
        let now = f();
        if now != last {
            last = now;
            since = Instant::now();
        } else if since.elapsed() >= quiet {
            break;
        }
    }
    last
}

#[test]
fn a_stalled_consumer_pulls_exactly_what_the_budgets_allow() {
    let pulled = Arc::new(AtomicU64::new(0));
    let counter = Arc::clone(&pulled);
    let mut p = Pipeline::builder()
        .source((0..100_000u64).inspect(move |_| {
            counter.fetch_add(1, Ordering::SeqCst);
        }))
        .pipe("a", |x| Ok::<_, Injected>(x + 1), 2)
        .budget(10, u64::MAX)
        .pipe("b", |x| Ok::<_, Injected>(x * 2), 3)
        .budget(7, u64::MAX)
        .sink(5)
        .build()
        .unwrap();
    let control = p.control();
    let mut it = p.iter();
    let read = || pulled.load(Ordering::SeqCst);
    assert_eq!(settle(read, Duration::from_millis(300)), 10 + 7 + 5);
    for _ in 0..9 {
        it.next().unwrap().unwrap();
    }
    assert_eq!(settle(read, Duration::from_millis(300)), 10 + 7 + 5 + 9);
    // Growing a budget lets exactly that many more items in.
    control.set_budget("b", 20, u64::MAX).unwrap();
    assert_eq!(settle(read, Duration::from_millis(300)), 10 + 20 + 5 + 9);
    let stats = p.stats();
    let b = stats.stage("b").unwrap();
    assert_eq!((b.queue_items, b.budget_items), (20, 20));
    assert_eq!(stats.stage("sink").unwrap().queue_items, 5);
}

#[test]
fn a_stalled_consumer_with_batches_and_a_byte_budget() {
    let pulled = Arc::new(AtomicU64::new(0));
    let counter = Arc::clone(&pulled);
    let mut p = Pipeline::builder()
        .source((0..100_000u64).inspect(move |_| {
            counter.fetch_add(1, Ordering::SeqCst);
        }))
        .pipe("payload", |x| Ok::<_, Injected>(vec![x as u8; 100]), 2)
        .budget(10, u64::MAX)
        .measure(|v: &Vec<u8>| v.len())
        .aggregate(4, false)
        .budget(100, 600)
        .sink(2)
        .build()
        .unwrap();
    let _ = p.iter(); // starts the epoch; the consumer then stalls
    let read = || pulled.load(Ordering::SeqCst);
    // The sink holds 2 batches of 4; the aggregator 600 bytes of 100-byte items (a sealed batch
    // of 4 waiting for room, and 2 more); `payload` its 10 items (outputs waiting for room count
    // there until they move on).
    assert_eq!(settle(read, Duration::from_millis(300)), 2 * 4 + 6 + 10);
    let stats = p.stats();
    let agg = stats.stage("aggregate").unwrap();
    assert_eq!((agg.queue_items, agg.queue_bytes), (6, 600));
    assert_eq!(stats.stage("sink").unwrap().queue_bytes, 800);
    assert_eq!(p.iter().count(), 25_000, "and then every batch arrives");
}

#[test]
fn resizing_under_load_loses_and_duplicates_nothing() {
    within(120, resize_under_load);
}

fn resize_under_load() {
    const N: u64 = 100_000;
    let mut p = Pipeline::builder()
        .source(0..N)
        .chunk_size(16)
        .pipe("a", Ok::<_, Injected>, 2)
        .pipe(
            "b",
            |x| {
                if x % 1000 == 0 {
                    std::thread::sleep(Duration::from_micros(200));
                }
                Ok::<_, Injected>(x)
            },
            2,
        )
        .pipe("c", Ok::<_, Injected>, 1)
        .build()
        .unwrap();
    let control = p.control();
    let done = Arc::new(AtomicBool::new(false));
    let d = Arc::clone(&done);
    let churn = std::thread::spawn(move || {
        let mut k = 0u64;
        while !d.load(Ordering::Relaxed) {
            let stage = ["a", "b", "c"][(k % 3) as usize];
            let workers = 1 + (mix(k, 1) % 4) as usize;
            control.resize(stage, workers).unwrap();
            let items = 1 + (mix(k, 2) % 50) as usize;
            control.set_budget(stage, items, u64::MAX).unwrap();
            control
                .set_budget("sink", 1 + (mix(k, 3) % 8) as usize, u64::MAX)
                .unwrap();
            k += 1;
            std::thread::sleep(Duration::from_millis(2));
        }
        k
    });
    let mut seen = vec![false; N as usize];
    let (mut count, mut sum) = (0u64, 0u64);
    for r in p.iter() {
        let x = r.unwrap();
        assert!(
            !std::mem::replace(&mut seen[x as usize], true),
            "{x} delivered twice"
        );
        count += 1;
        sum = sum.wrapping_add(mix(x, 9));
    }
    done.store(true, Ordering::Relaxed);
    let changes = churn.join().unwrap();
    assert!(changes > 10, "the test resized only {changes} times");
    assert_eq!(count, N);
    assert_eq!(sum, (0..N).fold(0u64, |s, x| s.wrapping_add(mix(x, 9))));
}

#[test]
fn epochs_reiterate_the_source_and_a_one_shot_source_runs_once() {
    let mut p = Pipeline::builder()
        .source_epochs(|epoch| (0..100u64).map(move |x| x + 1000 * epoch))
        .pipe("id", Ok::<_, Injected>, 2)
        .aggregate(7, false)
        .build()
        .unwrap();
    for epoch in 0..3u64 {
        let mut items: Vec<u64> = p.iter().flat_map(Result::unwrap).collect();
        items.sort_unstable();
        assert_eq!(
            items,
            (0..100).map(|x| x + 1000 * epoch).collect::<Vec<_>>()
        );
        assert_eq!(p.epoch(), epoch + 1);
    }
    let mut once = Pipeline::builder().source(0..10u64).build().unwrap();
    assert_eq!(once.iter().count(), 10);
    assert_eq!(once.iter().count(), 0);
}

#[test]
fn an_interrupted_epoch_continues_where_it_stopped() {
    let mut p = Pipeline::builder()
        .source_epochs(|_| 0..1000u64)
        .output_order(Order::Input)
        .pipe("id", Ok::<_, Injected>, 2)
        .build()
        .unwrap();
    let first: Vec<u64> = p.iter().take(300).map(Result::unwrap).collect();
    let rest: Vec<u64> = p.iter().map(Result::unwrap).collect();
    assert_eq!([first, rest].concat(), (0..1000).collect::<Vec<_>>());
    assert_eq!(p.iter().count(), 1000, "then a whole new epoch");
}

#[test]
fn aggregate_and_disaggregate_round_trip_with_drop_last() {
    let mut p = Pipeline::builder()
        .source(0..103u64)
        .output_order(Order::Input)
        .aggregate(10, true)
        .disaggregate()
        .build()
        .unwrap();
    let got: Vec<u64> = p.iter().map(Result::unwrap).collect();
    assert_eq!(got, (0..100).collect::<Vec<_>>());
}

#[test]
fn async_stages_and_stream_sources() {
    let mut p = Pipeline::builder()
        .source_stream(futures::stream::iter(0..2000u64))
        .output_order(Order::Input)
        .pipe_async(
            "fetch",
            |x| async move {
                if x % 50 == 0 {
                    tokio::time::sleep(Duration::from_millis(5)).await;
                }
                if x == 77 {
                    return Err(Injected(x));
                }
                Ok(x * 10)
            },
            16,
        )
        .pipe("cpu", |x| Ok::<_, Injected>(x + 1), 2)
        .build()
        .unwrap();
    let got: Vec<u64> = futures::executor::block_on(async {
        use futures::StreamExt;
        p.stream().map(Result::unwrap).collect().await
    });
    let expected: Vec<u64> = (0..2000).filter(|&x| x != 77).map(|x| x * 10 + 1).collect();
    assert_eq!(got, expected);
    let stats = p.stats();
    assert_eq!(stats.stage("fetch").unwrap().failures, 1);
    assert_eq!(p.resize("fetch", 64).unwrap(), 64);
}

#[test]
fn stats_report_every_stage() {
    let mut p = Pipeline::builder()
        .source(0..5000u64)
        .pipe(
            "work",
            |x| {
                std::hint::black_box((0..200).fold(x, |a, b| a ^ b));
                Ok::<_, Injected>(x)
            },
            2,
        )
        .sink(4)
        .build()
        .unwrap();
    assert_eq!(p.iter().count(), 5000);
    let stats = p.stats();
    let names: Vec<_> = stats.stages.iter().map(|s| s.name.as_str()).collect();
    assert_eq!(names, ["source", "work", "sink"]);
    let work = stats.stage("work").unwrap();
    assert_eq!((work.items_in, work.items_out), (5000, 5000));
    assert_eq!(work.task_time.count, 5000);
    assert!(work.task_time.p99 >= work.task_time.p50);
    assert!(work.busy > Duration::ZERO);
    assert_eq!(stats.delivered, 5000);
    assert_eq!(stats.stage("sink").unwrap().budget_items, 4);
    let json = serde_json::to_string(&stats).unwrap();
    assert!(json.contains("\"blocked_put\""));
}

#[test]
fn bad_configurations_are_rejected() {
    let e = Pipeline::builder()
        .source(0..1u64)
        .pipe("x", Ok::<_, Injected>, 1)
        .pipe("x", Ok::<_, Injected>, 1)
        .build()
        .unwrap_err();
    assert!(
        e.is_config() && e.to_string().contains("two stages are named `x`"),
        "{e}"
    );
    let e = Pipeline::builder()
        .source(0..1u64)
        .pipe("a", Ok::<_, Injected>, 1)
        .budget(0, 10)
        .build()
        .unwrap_err();
    assert!(e.is_config(), "{e}");
    let p = Pipeline::builder().source(0..1u64).build().unwrap();
    assert!(p.resize("nope", 2).unwrap_err().is_config());
    // Workers past the limits: a thread each (a pool stage), an item in flight each (an async
    // stage). 2^63 of them panicked in the runtime, 2^40 aborted on an allocation.
    for n in [1025, 1 << 40, usize::MAX >> 1] {
        let e = Pipeline::builder()
            .source(0..1u64)
            .pipe("many", Ok::<_, Injected>, Workers::fixed(n))
            .build()
            .unwrap_err();
        let said = format!("stage `many`: workers: must be in 1..=1024, not {n}");
        assert!(e.is_config() && e.to_string().contains(&said), "{e}");
    }
    Pipeline::builder()
        .source(0..1u64)
        .pipe("many", Ok::<_, Injected>, 1024)
        .build()
        .unwrap();
    let e = Pipeline::builder()
        .source(0..1u64)
        .pipe_async("io", |x| async move { Ok::<_, Injected>(x) }, 1 << 17)
        .build()
        .unwrap_err();
    assert!(
        e.to_string()
            .contains("stage `io`: concurrency: must be in 1..=65536"),
        "{e}"
    );
}

#[test]
fn pipelines_and_handles_can_move_between_threads() {
    fn send<T: Send>() {}
    send::<Pipeline<u64>>();
    send::<flowgate::ControlHandle>();
    send::<flowgate::StopHandle>();
}

/// A worker deactivated while it waited for input could swallow the wake-up meant for an active
/// worker and park, stranding a chunk in the channel (found by the property test under load).
#[test]
fn deactivating_idle_workers_strands_no_work() {
    within(120, || {
        // Busy threads make the race likely: it needs a wake-up to land while a worker is
        // between waiting and parking.
        let stop = Arc::new(AtomicBool::new(false));
        let hogs: Vec<_> = (0..2)
            .map(|_| {
                let stop = Arc::clone(&stop);
                std::thread::spawn(move || {
                    while !stop.load(Ordering::Relaxed) {
                        std::hint::spin_loop();
                    }
                })
            })
            .collect();
        for _ in 0..20 {
            let mut p = Pipeline::builder()
                .source(0..2000u64)
                .output_order(Order::Input)
                .autotune_off()
                .pipe("first", Ok::<_, Injected>, 1)
                .filter_map(
                    "s0",
                    |x: u64| Ok::<_, Injected>((x % 4 != 0).then_some(x)),
                    2,
                )
                .budget(1, u64::MAX)
                .build()
                .unwrap();
            let control = p.control();
            let done = Arc::new(AtomicBool::new(false));
            let d = Arc::clone(&done);
            let churn = std::thread::spawn(move || {
                let mut k = 0;
                while !d.load(Ordering::Relaxed) {
                    control.resize("s0", 1 + k % 3).unwrap();
                    k += 1;
                    std::thread::sleep(Duration::from_micros(300));
                }
            });
            assert_eq!(p.iter().count(), 1500);
            done.store(true, Ordering::Relaxed);
            churn.join().unwrap();
        }
        stop.store(true, Ordering::Relaxed);
        for h in hogs {
            h.join().unwrap();
        }
    });
}
