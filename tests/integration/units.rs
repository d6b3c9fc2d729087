//! An epoch cut into units that other loaders decode (`Loader::plan_units`, the remote mode's
//! contract): the units' batches, decoded by any loader built alike in any order and regrouped
//! by the batch size, are the local epoch's batches (a skipped item and `drop_last` too); the
//! planner's checkpoint from the positions received is the local loader's at that batch, and
//! resumes exactly; plans follow resumes (a rank's own state, a merged one at another world
//! size); the planner iterates such an epoch as its own (`Loader::start_units`). The split of
//! a rank's epoch among readers is `tests/integration/readers.rs`.

use std::path::PathBuf;

use flowgate::actors::origin::RangeSet;
use flowgate::dataset::{Dataset, Source};
use flowgate::loader::{EpochPlan, Regroup};
use flowgate::{Loader, Order, PipelineState};

use crate::common;
use common::jpegs41::{
    build, builder, loader, local_epoch, paths, plain_recipe, same, seen, Seen, BAD, IMAGES,
};

/// Unit `u` of `plan` decoded by `worker`: its batches, and the positions each delivered.
fn run_unit(worker: &mut Loader, plan: &EpochPlan, u: usize) -> Vec<(Seen, RangeSet)> {
    let unit = plan.unit(u).unwrap();
    let mut before = plan.unit_state(&unit);
    worker.resume(&before).unwrap();
    let mut e = worker.epoch().unwrap();
    let mut out = Vec::new();
    while let Some(b) = e.next() {
        let b = seen(b.unwrap());
        let after = e.state().unwrap();
        let rows = after.delivered_since(&before);
        assert_eq!(rows.len() as usize, b.len(), "one position per row");
        out.push((b, rows));
        before = after;
    }
    assert!(out.len() <= unit.batches, "unit {u}: {} batches", out.len());
    out
}

/// A batch's rows for the library's `Regroup`.
struct Rows(Seen);

impl flowgate::loader::Rows for Rows {
    fn rows(&self) -> usize {
        self.0.len()
    }
    fn slice(&self, start: usize, end: usize) -> Self {
        Rows(self.0[start..end].to_vec())
    }
    fn concat(parts: Vec<Self>) -> Self {
        Rows(parts.into_iter().flat_map(|p| p.0).collect())
    }
}

/// The units' batches (in plan order, with the positions each delivered) regrouped by the
/// library's `Regroup` (what the remote mode's consumer yields), checking that the rows keep
/// their positions.
fn regroup(plan: &EpochPlan, batches: Vec<(Seen, RangeSet)>) -> Vec<Seen> {
    let mut r = Regroup::new(plan, Order::Input);
    let mut out = Vec::new();
    for (b, rows) in batches {
        r.push(Rows(b), rows.ranges().flat_map(|(a, b)| a..b).collect());
        while let Some((b, _)) = r.pop(false) {
            out.push(b.0);
        }
    }
    while let Some((b, positions)) = r.pop(true) {
        assert_eq!(b.0.len(), positions.len());
        out.push(b.0);
    }
    out
}

#[test]
fn units_decoded_anywhere_in_any_order_are_the_local_epochs_batches() {
    let with_bad = |rank, world, drop_last, workers, units| {
        build(paths(true), rank, world, drop_last, workers, units)
    };
    for drop_last in [false, true] {
        for (rank, world) in [(0, 1), (1, 3), (2, 3)] {
            let mut local = with_bad(rank, world, drop_last, 2, false);
            let mut planner = with_bad(rank, world, drop_last, 1, false);
            for epoch in 0..2 {
                let want = local_epoch(&mut local);
                let plan = planner.plan_units(2).unwrap();
                assert_eq!(plan.epoch(), epoch);
                assert_eq!(plan.batches(), planner.len());
                // Two workers built alike, given the units back to front, alternately.
                let mut workers = [
                    with_bad(rank, world, drop_last, 1, true),
                    with_bad(rank, world, drop_last, 3, true),
                ];
                let mut got = vec![Vec::new(); plan.len()];
                for u in (0..plan.len()).rev() {
                    got[u] = run_unit(&mut workers[u % 2], &plan, u);
                }
                let got = regroup(&plan, got.into_iter().flatten().collect());
                let what = format!("rank {rank}/{world}, epoch {epoch}, drop_last {drop_last}");
                same(&got, &want, &what);
                if world == 1 {
                    // The bad file was read (and regrouping made up for it).
                    assert_eq!(local.watch().failures(Some(epoch)).len(), 1, "{what}");
                }
                // The planner's state after the epoch's units is the next epoch's start.
                let end = plan.next_state();
                assert_eq!(end.epoch, epoch + 1);
                assert_eq!(end.delivered_items, 0);
                planner.resume(&end).unwrap();
            }
        }
    }
}

#[test]
fn the_planners_state_mid_unit_is_the_local_loaders_and_resumes_the_rest() {
    let (rank, world) = (1, 2);
    let mut planner = loader(rank, world, false, 1);
    // 21 positions (41 items on 2 ranks, padded): units of 2 batches, 10 + 10 + 1.
    let plan = planner.plan_units(2).unwrap();
    assert_eq!((plan.len(), plan.batches()), (3, 5));
    let mut worker = build(paths(false), rank, world, false, 2, true);
    let want = local_epoch(&mut loader(rank, world, false, 2));
    // Unit 0 whole, then one batch of unit 1.
    let mut received = Vec::new();
    for (_, rows) in run_unit(&mut worker, &plan, 0) {
        received.extend(rows.ranges());
    }
    let part = run_unit(&mut worker, &plan, 1);
    received.extend(part[0].1.ranges());
    let state = plan.state_with(&RangeSet::from_ranges(received));
    assert_eq!(state.delivered_items, 15);
    // A local loader's state after the same three batches.
    let mut local = loader(rank, world, false, 2);
    let local_state = {
        let mut e = local.epoch().unwrap();
        for _ in 0..3 {
            e.next().unwrap().unwrap();
        }
        e.state().unwrap()
    };
    assert_eq!(state, local_state);
    // Resumed locally (through JSON, as a checkpoint travels): exactly the rest.
    let json = serde_json::to_string(&state).unwrap();
    let mut resumed = loader(rank, world, false, 2);
    resumed
        .resume(&serde_json::from_str(&json).unwrap())
        .unwrap();
    same(&local_epoch(&mut resumed), &want[3..], "resumed locally");
    // And planned again: the rest's units, the same batches.
    let mut planner = loader(rank, world, false, 1);
    planner.resume(&state).unwrap();
    let rest = planner.plan_units(2).unwrap();
    assert_eq!(rest.batches(), want.len() - 3);
    let got: Vec<Seen> = (0..rest.len())
        .flat_map(|u| run_unit(&mut worker, &rest, u).into_iter().map(|(b, _)| b))
        .collect();
    same(&got, &want[3..], "the rest, planned");
}

#[test]
fn a_plan_after_a_merged_resume_at_another_world_size_covers_the_rest_once() {
    // Three ranks take two batches each; two ranks resume the merged state, planned.
    let mut before = Vec::new();
    let mut states = Vec::new();
    for rank in 0..3 {
        let mut l = loader(rank, 3, false, 2);
        let (taken, state) = common::take_then_save(&mut l, 2);
        before.extend(taken);
        states.push(state);
    }
    let merged = PipelineState::merge(&states).unwrap();
    let mut after = Vec::new();
    for rank in 0..2 {
        let mut planner = loader(rank, 2, false, 1);
        planner.resume(&merged).unwrap();
        let plan = planner.plan_units(2).unwrap();
        let mut local = loader(rank, 2, false, 2);
        local.resume(&merged).unwrap();
        let want = local_epoch(&mut local);
        let mut worker = build(paths(false), rank, 2, false, 1, true);
        let got: Vec<Seen> = (0..plan.len())
            .flat_map(|u| run_unit(&mut worker, &plan, u).into_iter().map(|(b, _)| b))
            .collect();
        same(&got, &want, &format!("rank {rank} of 2"));
        after.extend(got.iter().flatten().map(|(i, _)| *i));
    }
    let mut all: Vec<usize> = before.into_iter().chain(after).collect();
    all.sort_unstable();
    all.dedup();
    // Every item, at least once (padding repeats some).
    assert_eq!(all.len(), IMAGES);
}

#[test]
fn planning_is_refused_mid_epoch_and_with_no_batches_per_unit() {
    let mut l = loader(0, 1, false, 1);
    assert!(l.plan_units(0).is_err());
    let mut e = l.epoch().unwrap();
    e.next().unwrap().unwrap();
    drop(e);
    // The epoch was abandoned: the next plan is that epoch again, whole.
    let plan = l.plan_units(4).unwrap();
    assert_eq!(plan.epoch(), 0);
    assert_eq!(plan.batches(), IMAGES.div_ceil(5));
    l.start_epoch().unwrap();
    assert!(l.plan_units(1).is_err());
}

#[test]
fn what_units_cannot_carry_is_refused_when_planned_and_when_built_to_plan() {
    // A unit carries its batches' media and labels, in host memory: a loader with a sample's
    // other fields, a per-item or per-batch function or a device cannot be cut into units.
    let recipe = plain_recipe;
    let files = paths(false);
    let plain = || {
        let d = Dataset::builder(Source::files(files.clone()))
            .build()
            .unwrap();
        Loader::builder(d, recipe())
    };
    type Make<'a> = Box<dyn Fn() -> flowgate::loader::LoaderBuilder + 'a>;
    let cases: [(&str, Make); 4] = [
        (
            "(fields)",
            Box::new(|| {
                let source = Source::files(files.clone())
                    .extra_fields([flowgate::dataset::FieldSpec::new("caption", "txt")]);
                Loader::builder(Dataset::builder(source).build().unwrap(), recipe())
            }),
        ),
        ("(map)", Box::new(|| plain().map_items("tokenize", Ok))),
        ("(map_batch)", Box::new(|| plain().map_batches("pad", Ok))),
        (
            "arrive in host memory",
            Box::new(|| {
                let device = flowgate::loader::DeviceName::Simulated.open().unwrap();
                plain().device(device.unwrap())
            }),
        ),
    ];
    for (says, make) in &cases {
        // Built to plan units (Python's remote=), or to decode them: refused at once.
        for b in [make().plans_units(), make().decodes_units()] {
            let Err(e) = b.build() else {
                panic!("{says}: built")
            };
            let e = e.to_string();
            assert!(
                e.contains("remote decoding") && e.contains(says),
                "{says}: {e}"
            );
        }
        // Built as a local loader, it runs; planning units is what is refused.
        let mut l = make().build().unwrap();
        let Err(e) = l.plan_units(2) else {
            panic!("{says}: planned")
        };
        let e = e.to_string();
        assert!(
            e.contains("plan_units: remote decoding") && e.contains(says),
            "{e}"
        );
        assert!(l.start_units(2).is_err());
    }
    // A loader units can carry plans them.
    let d = Dataset::builder(Source::files(files.clone()))
        .build()
        .unwrap();
    let mut l = Loader::builder(d, recipe())
        .batch_size(5)
        .plans_units()
        .build()
        .unwrap();
    assert_eq!(
        l.plan_units(2).unwrap().len(),
        IMAGES.div_ceil(5).div_ceil(2)
    );
}

#[test]
fn a_unit_whose_items_all_fail_is_no_error_and_the_regrouped_epoch_is_the_local_one() {
    // 14 files in order; the second batch of 5 all unreadable.
    let all = paths(true);
    let files: Vec<PathBuf> = (0..14)
        .map(|i| all[if (5..10).contains(&i) { BAD } else { i }].clone())
        .collect();
    let make = |units: bool| {
        let dataset = Dataset::builder(Source::files(files.clone()))
            .build()
            .unwrap();
        let recipe = plain_recipe();
        let b = Loader::builder(dataset, recipe).batch_size(5).workers(1);
        if units { b.decodes_units() } else { b }.build().unwrap()
    };
    let want = local_epoch(&mut make(false));
    assert_eq!(want.iter().map(Vec::len).collect::<Vec<_>>(), [5, 4]);
    let plan = make(false).plan_units(1).unwrap();
    assert_eq!(plan.len(), 3);
    let mut worker = make(true);
    let units: Vec<Vec<(Seen, RangeSet)>> = (0..plan.len())
        .map(|u| run_unit(&mut worker, &plan, u))
        .collect();
    assert!(
        units[1].is_empty(),
        "the unreadable unit: no batch, no error"
    );
    same(&regroup(&plan, units.concat()), &want, "regrouped");
}

/// Drives an epoch of units on `planner` as the remote mode's consumer does
/// (`Loader::start_units`): every unit decoded by `worker`, its failures reported, its batches
/// regrouped and reported as delivered, until `take` batches (all: `None`, then the epoch is
/// finished). Returns the batches and what `finish_units` said (whether batches are made up).
fn units_epoch(
    planner: &mut Loader,
    worker: &mut Loader,
    take: Option<usize>,
) -> (Vec<Seen>, Result<bool, flowgate::PipelineError>) {
    let plan = planner.start_units(2).unwrap();
    let mut r = Regroup::new(&plan, Order::Input);
    let mut out = Vec::new();
    for u in 0..plan.len() {
        let before = worker.watch().failures(Some(plan.epoch())).len();
        let batches = run_unit(worker, &plan, u);
        let failed = worker.watch().failures(Some(plan.epoch()))[before..].to_vec();
        planner.units_failed(failed);
        for (b, rows) in batches {
            r.push(Rows(b), rows.ranges().flat_map(|(a, b)| a..b).collect());
        }
        let last = u + 1 == plan.len();
        while let Some((b, positions)) = r.pop(last) {
            if take == Some(out.len()) {
                return (out, Ok(false));
            }
            planner.units_delivered(&RangeSet::from_ranges(
                positions.iter().map(|&p| (p, p + 1)),
            ));
            out.push(b.0);
        }
    }
    if take.is_some() {
        return (out, Ok(false));
    }
    (out, planner.finish_units())
}

#[test]
fn an_epoch_of_units_is_the_planners_own_checkpoint_failures_break_and_end() {
    let files = paths(true);
    let make = |units: bool| build(files.clone(), 0, 1, false, 1, units);
    let mut local = make(false);
    let want: Vec<Vec<Seen>> = (0..2).map(|_| local_epoch(&mut local)).collect();
    let mut planner = make(false);
    let mut worker = make(true);
    // Three batches taken, then the loop breaks: the checkpoint is the local loader's there.
    let (got, _) = units_epoch(&mut planner, &mut worker, Some(3));
    same(&got, &want[0][..3], "the first three batches");
    assert!(
        planner.next_batch().unwrap().is_err(),
        "a units epoch is not the pipeline's"
    );
    let mid = planner.state().unwrap();
    let mut l = make(false);
    let (_, local_mid) = common::take_then_save(&mut l, 3);
    assert_eq!(mid, local_mid, "the planner's checkpoint mid-epoch");
    planner.close();
    assert_eq!(planner.abandoned_epoch(), Some((0, 3)));
    assert_eq!(
        planner.state().unwrap(),
        mid,
        "a break keeps what was delivered"
    );
    assert_eq!(planner.next_epoch(), 0);
    // The epoch starts again from where it started, whole; at its end, the next one.
    let (got, end) = units_epoch(&mut planner, &mut worker, None);
    assert!(!end.unwrap(), "one process: nothing made up");
    same(&got, &want[0], "epoch 0 again");
    let failed = planner.watch().failures(Some(0));
    assert!(
        !failed.is_empty() && failed.iter().all(|f| f.item.ends_with("bad.jpg")),
        "{failed:?}"
    );
    // Each message as the worker's loader wrote it, not prefixed again.
    let worker_said = worker.watch().failures(Some(0));
    assert_eq!(failed[0].message, worker_said[0].message);
    assert_eq!(planner.next_epoch(), 1);
    assert_eq!(planner.abandoned_epoch(), None);
    let next = planner.state().unwrap();
    assert_eq!((next.epoch, next.delivered_items), (1, 0));
    let (got, end) = units_epoch(&mut planner, &mut worker, None);
    end.unwrap();
    same(&got, &want[1], "epoch 1");
    // A resume mid-epoch: the planner plans the rest of it.
    let mut planner = make(false);
    planner.resume(&mid).unwrap();
    let (got, end) = units_epoch(&mut planner, &mut make(true), None);
    end.unwrap();
    same(&got, &want[0][3..], "the rest after a resume");
    // set_epoch mid-way abandons it, as locally; naming another epoch forgets it.
    let mut planner = make(false);
    let _ = units_epoch(&mut planner, &mut worker, Some(1));
    planner.set_epoch(1);
    assert_eq!((planner.abandoned_epoch(), planner.next_epoch()), (None, 1));
    assert_eq!(planner.start_units(2).unwrap().epoch(), 1);
    // An error ends it, as locally: the next start is the next epoch, nothing to resume.
    let _ = units_epoch(&mut planner, &mut worker, Some(2));
    planner.fail_units();
    assert_eq!((planner.abandoned_epoch(), planner.next_epoch()), (None, 2));
    assert_eq!(planner.state().unwrap().delivered_items, 0);
    assert_eq!(planner.start_units(2).unwrap().epoch(), 2);
    // Also when the epoch was started again after a break (no pipeline built for it).
    let _ = units_epoch(&mut planner, &mut worker, Some(1));
    planner.close();
    let _ = units_epoch(&mut planner, &mut worker, Some(1));
    planner.fail_units();
    assert_eq!(planner.next_epoch(), 3);
}

#[test]
fn a_checkpoint_owing_more_batches_than_an_epoch_has_is_refused() {
    let mut l = loader(0, 1, false, 1);
    let (_, mut state) = common::take_then_save(&mut l, 2);
    let whole = l.len() as u64;
    state.owed_batches = Some(whole);
    l.resume(&state).unwrap();
    state.owed_batches = Some(1 << 63);
    let e = l.resume(&state).unwrap_err();
    assert!(
        e.to_string().contains("owes 9223372036854775808 batches"),
        "{e}"
    );
}

#[test]
fn an_epoch_of_units_whose_every_item_fails_ends_with_the_local_error() {
    let bad = paths(true)[BAD].clone();
    let files = vec![bad; 7];
    let make = |units: bool| build(files.clone(), 0, 1, false, 1, units);
    let local = make(false).epoch().unwrap().next().unwrap().unwrap_err();
    let (got, end) = units_epoch(&mut make(false), &mut make(true), None);
    assert!(got.is_empty());
    let e = end.unwrap_err();
    assert!(e.is_nothing_delivered(), "{e}");
    assert_eq!(e.to_string(), local.to_string());
}

#[test]
fn an_epoch_of_units_that_skipped_an_item_makes_up_the_batch_as_the_local_loader_does() {
    // Filling (the default for a world of ranks): the rank whose share holds the unreadable
    // file makes up the batch it cost from its first items, read again here after the units;
    // its batches, their count and its checkpoints are the local loader's. Batches of 5:
    // two ranks of 21 (41 padded), four of 11 (44), and with `drop_last` two ranks of 20
    // (41 cut) whose 19 readable items make three whole batches, not four.
    for (world, drop_last) in [(2, false), (4, false), (2, true)] {
        units_fill_as_local(world, drop_last);
    }
}

fn units_fill_as_local(world: usize, drop_last: bool) {
    let files = paths(true);
    let make = |rank: usize, units: bool| {
        let b = builder(&files, (rank, world), drop_last).workers(1);
        if units { b.decodes_units() } else { b }.build().unwrap()
    };
    let mut made_up = 0;
    for rank in 0..world {
        let mut local = make(rank, false);
        let want = local_epoch(&mut local);
        assert_eq!(
            want.len(),
            local.len(),
            "rank {rank}: the local loader fills"
        );
        let mut planner = make(rank, false);
        let mut worker = make(rank, true);
        let (mut got, end) = units_epoch(&mut planner, &mut worker, None);
        let units_made = got.len();
        if end.unwrap() {
            made_up += 1;
            // After the units' last batch the checkpoint is the local loader's there, owing
            // the batch to make up.
            let mut before = make(rank, false);
            let _ = units_epoch(&mut before, &mut make(rank, true), Some(units_made));
            let (_, local_mid) = common::take_then_save(&mut make(rank, false), units_made);
            assert_eq!(before.state().unwrap(), local_mid, "rank {rank}");
            assert_eq!(local_mid.owed_batches, Some(1));
            while let Some(b) = planner.next_batch() {
                got.push(seen(b.unwrap()));
            }
            assert!(planner.filled() > 0);
        }
        same(&got, &want, &format!("rank {rank}"));
        assert_eq!(planner.next_epoch(), 1, "rank {rank}");
        let next = planner.state().unwrap();
        assert_eq!((next.epoch, next.delivered_items), (1, 0), "rank {rank}");
        // The next epoch runs as units again.
        assert_eq!(planner.start_units(2).unwrap().epoch(), 1);
    }
    assert_eq!(made_up, 1, "one rank's share holds the unreadable file");
    // A break while batches are made up: the checkpoint resumes the rest, made up too.
    let rank = (0..world)
        .find(|&r| {
            let mut l = make(r, false);
            let _ = local_epoch(&mut l);
            l.filled() > 0
        })
        .unwrap();
    let want = local_epoch(&mut make(rank, false));
    let mut planner = make(rank, false);
    let (got, end) = units_epoch(&mut planner, &mut make(rank, true), None);
    assert!(end.unwrap());
    planner.close();
    let state = planner.state().unwrap();
    let mut resumed = make(rank, false);
    resumed.resume(&state).unwrap();
    let (rest, end) = units_epoch(&mut resumed, &mut make(rank, true), None);
    let mut rest = rest;
    if end.unwrap() {
        while let Some(b) = resumed.next_batch() {
            rest.push(seen(b.unwrap()));
        }
    }
    assert_eq!(
        got.len() + rest.len(),
        want.len(),
        "exactly the batches owed"
    );
    same(
        &rest,
        &want[got.len()..],
        "the made-up batch after a resume",
    );
}
