//! Exact resume: a checkpoint taken anywhere in an epoch, handed to a pipeline built the same
//! way, yields exactly the items not delivered yet (none lost, none repeated), in the same
//! order for `Order::Input`.

use std::collections::HashSet;
use std::time::Duration;

use flowgate::sampler::Sampler;
use flowgate::{FailureBudget, Order, Pipeline, PipelineError, PipelineState, Workers};
use proptest::prelude::*;

const ITEMS: usize = 240;

#[derive(Debug)]
struct Bad(u64);
impl std::fmt::Display for Bad {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "item {} is bad", self.0)
    }
}
impl std::error::Error for Bad {}

#[derive(Clone, Copy, Debug)]
struct Shape {
    order: Order,
    workers: usize,
    batch: Option<usize>,
    seed: u64,
}

/// Items 0..ITEMS in a seeded shuffle (per epoch), a stage with uneven latencies (so results
/// complete out of order) that fails every 37th item, then optional batching. Yields the
/// items each result carries.
fn build(shape: Shape) -> Pipeline<Vec<u64>> {
    let sampler = Sampler::new(ITEMS).shuffle(shape.seed);
    let b = Pipeline::builder()
        .source_epochs(move |e| {
            sampler
                .epoch(e)
                .into_iter()
                .map(|i| i as u64)
                .collect::<Vec<_>>()
        })
        .pipe(
            "work",
            |x: u64| {
                if x % 7 == 3 {
                    std::thread::sleep(Duration::from_micros(300));
                }
                if x % 37 == 5 {
                    Err(Bad(x))
                } else {
                    Ok(x)
                }
            },
            Workers::fixed(shape.workers),
        )
        .budget(8, u64::MAX)
        .max_failures(FailureBudget::unlimited())
        .output_order(shape.order)
        .autotune_off();
    match shape.batch {
        Some(n) => b.aggregate(n, false).sink(2).build(),
        None => b.pipe("one", |x: u64| Ok::<_, Bad>(vec![x]), 1).build(),
    }
    .expect("build")
}

fn deliverable(seed: u64, epoch: u64) -> Vec<u64> {
    Sampler::new(ITEMS)
        .shuffle(seed)
        .epoch(epoch)
        .into_iter()
        .map(|i| i as u64)
        .filter(|x| x % 37 != 5)
        .collect()
}

/// Takes up to `n` results of the current epoch.
fn take(p: &mut Pipeline<Vec<u64>>, n: usize) -> Vec<Vec<u64>> {
    p.iter().take(n).map(|r| r.expect("a result")).collect()
}

fn rest(p: &mut Pipeline<Vec<u64>>) -> Vec<Vec<u64>> {
    p.iter()
        .collect::<Result<Vec<_>, PipelineError>>()
        .expect("the rest")
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 24, .. ProptestConfig::default() })]

    #[test]
    fn resume_at_random_points_delivers_exactly_the_rest(
        input_order in any::<bool>(),
        workers in 1usize..4,
        batch in prop_oneof![Just(None), (2usize..9).prop_map(Some)],
        seed in any::<u64>(),
        epoch in 0u64..3,
        cuts in proptest::collection::vec(0usize..60, 1..4),
    ) {
        let shape = Shape {
            order: if input_order { Order::Input } else { Order::Completion },
            workers,
            batch,
            seed,
        };
        // The uninterrupted run of `epoch`, for order comparisons.
        let mut whole = build(shape);
        for _ in 0..epoch {
            rest(&mut whole);
        }
        let reference: Vec<u64> = rest(&mut whole).concat();
        drop(whole);

        // Get to `epoch`, then stop at each cut, checkpoint, rebuild, resume.
        let mut p = build(shape);
        for _ in 0..epoch {
            rest(&mut p);
        }
        let mut got: Vec<u64> = Vec::new();
        // Cuts stay inside the epoch: ~230 single results, or 240 / batch batches.
        let limit = batch.map_or(70, |n| ITEMS / n / 4);
        for &cut in &cuts {
            got.extend(take(&mut p, cut % limit).concat());
            let state = p.state();
            prop_assert_eq!(state.epoch, epoch);
            let json = serde_json::to_string(&state).unwrap();
            let state: PipelineState = serde_json::from_str(&json).unwrap();
            drop(p);
            p = build(shape);
            p.resume(&state).expect("resume");
        }
        got.extend(rest(&mut p).concat());

        let mut seen = HashSet::new();
        for x in &got {
            prop_assert!(seen.insert(*x), "item {} delivered twice", x);
        }
        let mut want = deliverable(seed, epoch);
        if shape.order == Order::Input {
            prop_assert_eq!(&got, &reference, "input order continues the sequence");
        }
        let mut sorted = got.clone();
        sorted.sort_unstable();
        want.sort_unstable();
        prop_assert_eq!(sorted, want, "every deliverable item exactly once");

        // Later epochs run in full.
        let next: Vec<u64> = rest(&mut p).concat();
        prop_assert_eq!(p.state().epoch, epoch + 2);
        let mut next_sorted = next;
        next_sorted.sort_unstable();
        let mut want_next = deliverable(seed, epoch + 1);
        want_next.sort_unstable();
        prop_assert_eq!(next_sorted, want_next);
    }
}

#[test]
fn state_is_small_and_names_the_next_epoch_between_epochs() {
    let shape = Shape {
        order: Order::Completion,
        workers: 3,
        batch: Some(4),
        seed: 9,
    };
    let mut p = build(shape);
    assert_eq!(
        p.state(),
        PipelineState {
            version: flowgate::STATE_VERSION,
            ..PipelineState::default()
        }
    );
    take(&mut p, 20);
    let s = p.state();
    assert_eq!(s.epoch, 0);
    assert!(s.delivered_items >= 70, "20 batches of 4 hold 80 items");
    assert!(
        s.delivered.len() <= 40,
        "ranges, not one entry per item: {:?}",
        s.delivered
    );
    rest(&mut p);
    let s = p.state();
    assert_eq!((s.epoch, s.delivered_items), (1, 0));
    assert!(serde_json::to_string(&s).unwrap().len() < 64);

    // Resuming between epochs skips nothing, and resuming mid-epoch is refused.
    let mut q = build(shape);
    q.resume(&s).unwrap();
    let all: Vec<u64> = rest(&mut q).concat();
    assert_eq!(all.len(), deliverable(9, 1).len());
    take(&mut q, 1);
    assert!(q.resume(&s).is_err(), "in the middle of an epoch");
}

#[test]
fn a_fully_delivered_epoch_resumes_to_an_empty_epoch() {
    let shape = Shape {
        order: Order::Input,
        workers: 2,
        batch: None,
        seed: 1,
    };
    let mut p = build(shape);
    let first = rest(&mut p);
    // A checkpoint of epoch 0 taken just before its end (every item delivered).
    let state = PipelineState {
        epoch: 0,
        delivered: vec![(0, ITEMS as u64)],
        delivered_items: ITEMS as u64,
        partial: vec![],
        ..Default::default()
    };
    let mut q = build(shape);
    q.resume(&state).unwrap();
    assert!(rest(&mut q).is_empty());
    assert_eq!(q.epoch(), 1);
    assert_eq!(first.len(), deliverable(1, 0).len());
}

/// A source item split by `disaggregate` counts as delivered only when all its parts were;
/// one cut between its parts produces it again whole, and nothing else repeats.
#[test]
fn split_items_are_delivered_when_every_part_is() {
    let build = || {
        Pipeline::builder()
            .source_epochs(|_| 0..50u64)
            .pipe(
                "parts",
                |x: u64| Ok::<_, Bad>(vec![x * 10, x * 10 + 1, x * 10 + 2]),
                1,
            )
            .disaggregate()
            .output_order(Order::Input)
            .autotune_off()
            .build()
            .unwrap()
    };
    let mut p = build();
    let first: Vec<u64> = p.iter().take(31).map(Result::unwrap).collect();
    let state = p.state();
    assert_eq!(state.delivered, vec![(0, 10)]);
    assert_eq!(
        state.partial.len(),
        1,
        "item 10 has one of its parts delivered"
    );
    drop(p);
    let mut q = build();
    q.resume(&state).unwrap();
    let second: Vec<u64> = q.iter().map(Result::unwrap).collect();
    assert_eq!(first.last(), Some(&100));
    assert_eq!(
        second[..2],
        [101, 102],
        "item 10 is produced again whole; the part received is dropped"
    );
    assert_eq!(second.len(), 3 * 40 - 1);
}

/// Items split into 0-4 parts (some fail), optionally batched before the split and reordered
/// after it: each part is identified by (item, k).
fn build_split(order: Order, workers: usize, batch: Option<usize>) -> Pipeline<(u64, u64)> {
    let parts = |x: u64| -> Result<Vec<(u64, u64)>, Bad> {
        if x % 31 == 7 {
            return Err(Bad(x));
        }
        Ok((0..(x * 7 + 3) % 5).map(|k| (x, k)).collect())
    };
    let b = Pipeline::builder().source_epochs(|_| 0..ITEMS as u64);
    let split = match batch {
        Some(n) => b
            .aggregate(n, false)
            .pipe(
                "parts",
                move |xs: Vec<u64>| {
                    xs.into_iter()
                        .map(parts)
                        .collect::<Result<Vec<_>, Bad>>()
                        .map(|v| v.concat())
                },
                1,
            )
            .disaggregate(),
        None => b.pipe("parts", parts, 1).disaggregate(),
    };
    split
        .pipe(
            "work",
            |p: (u64, u64)| {
                if p.0 % 3 == 1 {
                    std::thread::sleep(Duration::from_micros(150));
                }
                Ok::<_, Bad>(p)
            },
            Workers::fixed(workers),
        )
        .budget(6, u64::MAX)
        .max_failures(FailureBudget::unlimited())
        .output_order(order)
        .autotune_off()
        .build()
        .expect("build")
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 24, .. ProptestConfig::default() })]

    /// Chained resumes of an epoch whose items are split: every part of every item arrives
    /// exactly once (the parts received before a checkpoint are not delivered again, and an
    /// item is not counted delivered before all its parts arrived, whatever the order).
    #[test]
    fn split_items_survive_chained_resumes_exactly(
        input_order in any::<bool>(),
        workers in 1usize..4,
        batch in prop_oneof![Just(None), (2usize..6).prop_map(Some)],
        cuts in proptest::collection::vec(0usize..80, 1..4),
    ) {
        let order = if input_order { Order::Input } else { Order::Completion };
        let mut p = build_split(order, workers, batch);
        let mut got = Vec::new();
        for &cut in &cuts {
            got.extend(p.iter().take(cut).map(|r| r.unwrap()));
            let state: PipelineState =
                serde_json::from_str(&serde_json::to_string(&p.state()).unwrap()).unwrap();
            drop(p);
            p = build_split(order, workers, batch);
            p.resume(&state).expect("resume");
        }
        got.extend(p.iter().map(|r| r.unwrap()));
        let mut seen = HashSet::new();
        for x in &got {
            prop_assert!(seen.insert(*x), "part {:?} delivered twice", x);
        }
        // A failing item fails its whole batch when batched before the split.
        let fails = |x: u64| match batch {
            None => x % 31 == 7,
            Some(n) => {
                let b = x / n as u64 * n as u64;
                (b..(b + n as u64).min(ITEMS as u64)).any(|y| y % 31 == 7)
            }
        };
        let want: HashSet<(u64, u64)> = (0..ITEMS as u64)
            .filter(|&x| !fails(x))
            .flat_map(|x| (0..(x * 7 + 3) % 5).map(move |k| (x, k)))
            .collect();
        prop_assert_eq!(seen, want, "every part exactly once");
    }
}

#[test]
fn a_checkpoint_loads_only_into_the_pipeline_it_fits() {
    use flowgate::dataset::Files;
    let paths: Vec<std::path::PathBuf> = (0..50).map(|i| format!("f{i}.jpg").into()).collect();
    let build = |files: Files, batch: usize| {
        let paths: Vec<std::path::PathBuf> = files.paths().to_vec();
        Pipeline::builder()
            .source_sampled(files.sampler().clone(), move |_, i| paths[i].clone())
            .checkpoint_fields(files.fingerprint())
            .checkpoint_fields([("batch_size", batch)])
            .pipe("id", Ok::<_, std::io::Error>, 1)
            .build()
            .unwrap()
    };
    let files = || Files::new(paths.clone()).shuffle(3);
    let mut p = build(files(), 8);
    let _: Vec<_> = p.iter().take(10).collect();
    let state: PipelineState = serde_json::from_str(&serde_json::to_string(&p.state()).unwrap())
        .expect("a JSON round trip keeps the fingerprint");
    assert_eq!(state.version, flowgate::STATE_VERSION);
    assert_eq!(state.fingerprint["shuffle_seed"], "3");
    drop(p);
    // The same pipeline resumes.
    build(files(), 8).resume(&state).unwrap();
    // Another seed, batch size, file list or world: refused, naming the field.
    for (mut q, field) in [
        (
            build(Files::new(paths.clone()).shuffle(4), 8),
            "shuffle_seed",
        ),
        (build(files(), 16), "batch_size"),
        (
            build(Files::new(paths[1..].to_vec()).shuffle(3), 8),
            "dataset",
        ),
    ] {
        let e = q.resume(&state).unwrap_err();
        assert!(
            e.is_config() && e.to_string().contains(field),
            "{field}: {e}"
        );
    }
    // One rank's state does not resume another world (its progress is only its own); the
    // whole world's state does.
    let mut rank0 = build(files().shard(0, 2).unwrap(), 8);
    let _: Vec<_> = rank0.iter().take(4).collect();
    let e = build(files(), 8).resume(&rank0.state()).unwrap_err();
    assert!(e.to_string().contains("world_size of 2"), "{e}");
    build(files().shard(1, 2).unwrap(), 8)
        .resume(&state)
        .unwrap();
    // A state from before fingerprints were recorded still loads.
    let legacy = PipelineState {
        epoch: 0,
        delivered: vec![(0, 5)],
        delivered_items: 5,
        ..Default::default()
    };
    build(files(), 8).resume(&legacy).unwrap();
}
