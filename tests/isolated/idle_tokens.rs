//! A pipeline whose consumer went away gives its extra workers' tokens back to the process's
//! other pipelines, and takes workers again when its consumer is back (the tuner's park;
//! `flowgate_tuner::policy::Park`). One test in its own process: it sets the process-wide
//! worker cap.
//!
//! Before parking, a validation iterator kept alive but idle held the process's one spare
//! token on 2 cores, and the training pipeline beside it ran one decode worker instead of two
//! for as long as the iterator lived.

use std::time::{Duration, Instant};

use flowgate::{EpochIter, Monitor, Pipeline, TunerSettings, Workers};

/// A pipeline whose one stage burns about 2 ms of CPU per item (the tuner wants two workers
/// of it on the two cores it is told of) and whose consumer is as fast as it gets.
fn busy_pipeline() -> Pipeline<u64> {
    Pipeline::builder()
        .source_epochs(|_| 0..u64::MAX)
        .pipe(
            "decode",
            |x: u64| {
                let t = Instant::now();
                let mut acc = x;
                while t.elapsed() < Duration::from_millis(2) {
                    acc =
                        std::hint::black_box(acc.wrapping_mul(6364136223846793005).wrapping_add(1));
                }
                Ok::<_, std::io::Error>(acc)
            },
            Workers::auto(),
        )
        .autotune(TunerSettings {
            cores: Some(2),
            ..TunerSettings::default()
        })
        .build()
        .unwrap()
}

fn workers(m: &Monitor) -> usize {
    m.stats().stage("decode").unwrap().workers
}

/// Takes items from `it` until `done` holds (checked every 10 items) or `secs` pass; whether
/// it held.
fn take_until(it: &mut EpochIter<'_, u64>, secs: u64, done: impl Fn() -> bool) -> bool {
    let end = Instant::now() + Duration::from_secs(secs);
    while Instant::now() < end {
        for _ in 0..10 {
            it.next().expect("an endless source").unwrap();
        }
        if done() {
            return true;
        }
    }
    false
}

fn parks(m: &Monitor) -> usize {
    m.tuner_trace()
        .iter()
        .flat_map(|r| &r.decisions)
        .filter(|d| d.reason.starts_with("park"))
        .count()
}

#[test]
fn an_idle_pipeline_gives_its_workers_to_a_busy_one_and_gets_them_back() {
    isolate!();
    flowgate::set_cpu_worker_cap(Some(1)); // one spare token: as on 2 cores
    let mut val = busy_pipeline();
    let vm = val.monitor();
    // An iterator made and not read yet (a validation loader built before training, the
    // shorter side of a `zip`): its pipeline prefetches, then waits with full buffers.
    let mut val_it = val.iter();
    assert_eq!(
        workers(&vm),
        2,
        "it starts at its share of the 2 cores: the spare token"
    );
    let mut train = busy_pipeline();
    let tm = train.monitor();
    let mut train_it = train.iter();
    assert!(
        take_until(&mut train_it, 20, || workers(&tm) == 2),
        "the busy pipeline never got the idle one's token: idle {}, busy {} workers",
        workers(&vm),
        workers(&tm)
    );
    assert_eq!(workers(&vm), 1, "the idle pipeline is parked");
    assert_eq!(parks(&vm), 1);
    // And it stays so while training runs: it does not take the token back (what training
    // does with it is its tuner's business: on a loaded machine a trial may give it back).
    let until = Instant::now() + Duration::from_secs(4);
    take_until(&mut train_it, 5, || {
        assert_eq!(workers(&vm), 1, "the parked pipeline took a worker back");
        Instant::now() > until
    });

    // The validation consumer is back while training runs: it delivers, and the two together
    // stay within the one spare token.
    for _ in 0..50 {
        val_it.next().unwrap().unwrap();
    }
    assert!(workers(&vm) + workers(&tm) <= 3);
    // Training ends: the token is free again, and the validation pipeline grows back.
    drop(train);
    assert!(
        take_until(&mut val_it, 20, || workers(&vm) == 2),
        "the pipeline back from its pause grows again once a token is free"
    );
    drop(val);
    assert_eq!(flowgate::actors::cap::cpu_workers_in_use(), 0);
    flowgate::set_cpu_worker_cap(None);
}
