//! An epoch cut into units that other loaders decode (`Loader::plan_units`, the remote mode's
//! contract): the units' batches, decoded by any loader built alike in any order and regrouped
//! by the batch size, are the local epoch's batches (a skipped item and `drop_last` too); the
//! planner's checkpoint from the positions received is the local loader's at that batch, and
//! resumes exactly; plans follow resumes (a rank's own state, a merged one at another world
//! size).

use std::path::{Path, PathBuf};
use std::sync::OnceLock;

use flowgate::actors::origin::RangeSet;
use flowgate::dataset::{Dataset, Ranks, Source};
use flowgate::loader::{Batch, EpochPlan, Regroup};
use flowgate::media::{image::ImageRecipe, Recipe};
use flowgate::{Loader, Order, PipelineState};

mod common;

/// Images: a prime, so no rank count, batch size or unit size divides it.
const IMAGES: usize = 41;

/// `IMAGES` JPEGs, and the same list with item `BAD` a file that is not one (skipped and
/// counted).
fn paths(with_bad: bool) -> Vec<PathBuf> {
    static PATHS: OnceLock<(Vec<PathBuf>, PathBuf)> = OnceLock::new();
    let (good, bad) = PATHS.get_or_init(|| {
        let dir = Path::new(env!("CARGO_TARGET_TMPDIR")).join("units");
        let _ = std::fs::remove_dir_all(&dir);
        std::fs::create_dir_all(&dir).unwrap();
        let good = (0..IMAGES)
            .map(|i| {
                let p = dir.join(format!("{i:03}.jpg"));
                std::fs::write(&p, common::tiny_jpeg(i)).unwrap();
                p
            })
            .collect();
        let bad = dir.join("bad.jpg");
        std::fs::write(&bad, b"not a jpeg").unwrap();
        (good, bad)
    });
    let mut out = good.clone();
    if with_bad {
        out[BAD] = bad.clone();
    }
    out
}

const BAD: usize = 17;

/// Rank `rank` of `world`, shuffled, batches of 5, random crops (so augmentation must match
/// too), `workers` decode threads.
fn loader(rank: usize, world: usize, drop_last: bool, workers: usize) -> Loader {
    build(paths(false), rank, world, drop_last, workers, false)
}

/// A loader of `files`; with `units`, one that decodes units (see
/// `LoaderBuilder::decodes_units`).
fn build(
    files: Vec<PathBuf>,
    rank: usize,
    world: usize,
    drop_last: bool,
    workers: usize,
    units: bool,
) -> Loader {
    // Units are not filled (their consumer regroups), so neither is the local loader they
    // are held against (a world of ranks would fill by default).
    let b = builder(&files, (rank, world), drop_last)
        .fill_skipped(false)
        .workers(workers);
    if units { b.decodes_units() } else { b }.build().unwrap()
}

/// Rank `rank` of `world` over `files`, shuffled, batches of 5, random crops (so
/// augmentation must match too).
fn builder(
    files: &[PathBuf],
    (rank, world): (usize, usize),
    drop_last: bool,
) -> flowgate::loader::LoaderBuilder {
    let dataset = Dataset::builder(Source::files(files.to_vec()))
        .shuffle(9)
        .ranks_from(Ranks::Fixed { rank, world })
        .drop_last(drop_last)
        .build()
        .unwrap();
    let recipe = Recipe::image(ImageRecipe {
        resize: 12,
        crop: 8,
        random_crop: Some(Default::default()),
        flip: true,
        seed: 4,
        ..ImageRecipe::default()
    })
    .unwrap();
    Loader::builder(dataset, recipe)
        .batch_size(5)
        .drop_last(drop_last)
}

/// A batch as what it holds: each item's dataset index and its pixels.
type Seen = Vec<(usize, Vec<u8>)>;

fn seen(b: Batch) -> Seen {
    let items = b.items;
    let tensor = b.fields.into_iter().next().unwrap().into_host().unwrap();
    let pixels = tensor.bytes();
    let per = pixels.len() / items.len();
    items
        .iter()
        .enumerate()
        .map(|(k, m)| (m.index, pixels[k * per..(k + 1) * per].to_vec()))
        .collect()
}

/// Asserts `got == want`, showing the items' indices (not their pixels) when they differ.
#[track_caller]
fn same(got: &[Seen], want: &[Seen], what: &str) {
    if got != want {
        let ids = |v: &[Seen]| -> Vec<Vec<usize>> {
            v.iter()
                .map(|b| b.iter().map(|(i, _)| *i).collect())
                .collect()
        };
        panic!("{what}:\n got {:?}\nwant {:?}", ids(got), ids(want));
    }
}

fn local_epoch(l: &mut Loader) -> Vec<Seen> {
    l.epoch().unwrap().map(|b| seen(b.unwrap())).collect()
}

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
        let recipe = Recipe::image(ImageRecipe {
            resize: 12,
            crop: 8,
            ..ImageRecipe::default()
        })
        .unwrap();
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
/// finished). Returns the batches and what `finish_units` said.
fn units_epoch(
    planner: &mut Loader,
    worker: &mut Loader,
    take: Option<usize>,
) -> (Vec<Seen>, Result<(), flowgate::PipelineError>) {
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
                return (out, Ok(()));
            }
            planner.units_delivered(&RangeSet::from_ranges(
                positions.iter().map(|&p| (p, p + 1)),
            ));
            out.push(b.0);
        }
    }
    if take.is_some() {
        return (out, Ok(()));
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
    end.unwrap();
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

/// Reader `reader` of `readers` (`LoaderBuilder::reader`) of rank `rank` of `world` over
/// `files`, as `build` makes loaders, with `fill_skipped` as `fill` says.
fn reader(
    files: &[PathBuf],
    ranks: (usize, usize),
    drop_last: bool,
    (r, n): (usize, usize),
    fill: bool,
) -> Loader {
    builder(files, ranks, drop_last)
        .fill_skipped(fill)
        .workers(1 + r % 2)
        .reader(r, n)
        .build()
        .unwrap()
}

/// The readers' epochs taken in turn, as `DataLoader` takes its workers' batches: one from
/// each reader that has one left, round after round.
fn in_turn(mut parts: Vec<std::vec::IntoIter<Seen>>) -> Vec<Seen> {
    let mut out = Vec::new();
    loop {
        let before = out.len();
        for p in &mut parts {
            out.extend(p.next());
        }
        if out.len() == before {
            return out;
        }
    }
}

#[test]
fn readers_taken_in_turn_are_the_local_loaders_batches_and_len() {
    // 41 items: on rank 1 of 3, 14 (3 batches of 5, the last of 4); readers from 1 to more
    // than the rank has batches.
    for drop_last in [false, true] {
        for (rank, world) in [(0, 1), (1, 3)] {
            let files = paths(false);
            for n in [1, 2, 3, 4, 7] {
                let mut local = build(files.clone(), rank, world, drop_last, 2, false);
                let mut readers: Vec<Loader> = (0..n)
                    .map(|r| reader(&files, (rank, world), drop_last, (r, n), false))
                    .collect();
                let lens: usize = readers.iter().map(Loader::len).sum();
                let what = format!("rank {rank}/{world}, {n} readers, drop_last {drop_last}");
                assert_eq!(lens, local.len(), "{what}: the readers' lens add up");
                for epoch in 0..2 {
                    let want = local_epoch(&mut local);
                    let parts: Vec<_> = readers
                        .iter_mut()
                        .map(|l| {
                            let got = local_epoch(l);
                            assert_eq!(got.len(), l.len(), "{what}: a reader makes its len()");
                            got.into_iter()
                        })
                        .collect();
                    same(&in_turn(parts), &want, &format!("{what}, epoch {epoch}"));
                }
            }
        }
    }
}

#[test]
fn readers_of_a_resumed_state_read_the_rest_of_the_rank() {
    for drop_last in [false, true] {
        let files = paths(false);
        let (rank, world) = (0, 1);
        let mut local = build(files.clone(), rank, world, drop_last, 2, false);
        let mut e = local.epoch().unwrap();
        let first: Vec<Seen> = (0..3).map(|_| seen(e.next().unwrap().unwrap())).collect();
        let state = e.state().unwrap();
        let rest: Vec<Seen> = e.map(|b| seen(b.unwrap())).collect();
        assert_eq!(first.len() + rest.len(), local.len());
        // Through JSON, as a checkpoint travels.
        let state: PipelineState =
            serde_json::from_str(&serde_json::to_string(&state).unwrap()).unwrap();
        for n in [2, 3, 5] {
            let parts: Vec<_> = (0..n)
                .map(|r| {
                    let mut l = reader(&files, (rank, world), drop_last, (r, n), false);
                    l.resume(&state).unwrap();
                    local_epoch(&mut l).into_iter()
                })
                .collect();
            same(
                &in_turn(parts),
                &rest,
                &format!("{n} readers, drop_last {drop_last}"),
            );
        }
    }
}

#[test]
fn readers_with_fill_skipped_each_make_their_len_even_when_their_whole_part_fails() {
    // 14 files in order, batches of 5: batch 1 (items 5..10) all unreadable, item 12 too. With
    // 3 readers, reader 1's whole part fails; it makes its batch up from the rank's others.
    let all = paths(true);
    let files: Vec<PathBuf> = (0..14)
        .map(|i| {
            all[if (5..10).contains(&i) || i == 12 {
                BAD
            } else {
                i
            }]
            .clone()
        })
        .collect();
    let make = |r: usize, n: usize, fill: bool| {
        let dataset = Dataset::builder(Source::files(files.clone()))
            .build()
            .unwrap();
        let recipe = Recipe::image(ImageRecipe {
            resize: 12,
            crop: 8,
            ..ImageRecipe::default()
        })
        .unwrap();
        Loader::builder(dataset, recipe)
            .batch_size(5)
            .fill_skipped(fill)
            .reader(r, n)
            .build()
            .unwrap()
    };
    for n in [2, 3] {
        let mut total = 0;
        for r in 0..n {
            let mut plain = make(r, n, false);
            let mut filled = make(r, n, true);
            // Without the fill, reader 1 of 3 ends with nothing (and says so: its part
            // failed), checked below.
            let p: Vec<Seen> = plain
                .epoch()
                .unwrap()
                .map_while(|b| b.ok().map(seen))
                .collect();
            let f = local_epoch(&mut filled);
            let what = format!("reader {r} of {n}");
            assert_eq!(f.len(), filled.len(), "{what}: makes its len()");
            assert_eq!(f[..p.len()], p[..], "{what}: its own batches first");
            for b in &f {
                assert!(
                    b.iter().all(|(i, _)| *i != BAD),
                    "{what}: no unreadable item"
                );
            }
            total += f.len();
        }
        assert_eq!(total, 3, "{n} readers: the rank's 3 batches");
    }
    let mut plain = make(1, 3, false);
    let err = plain.epoch().unwrap().find_map(Result::err).unwrap();
    assert!(err.is_nothing_delivered(), "{err}");
}

#[test]
fn a_reader_outside_its_readers_is_refused() {
    let dataset = Dataset::builder(Source::files(paths(false)))
        .build()
        .unwrap();
    let recipe = Recipe::image(ImageRecipe::default()).unwrap();
    let err = Loader::builder(dataset, recipe)
        .reader(2, 2)
        .build()
        .unwrap_err();
    assert!(err.to_string().contains("reader 2 of 2"), "{err}");
}

#[test]
fn readers_of_a_ranks_fill_skipped_state_give_its_rest_exactly() {
    // Bad files retried on resume: what the rank owes is known only to a loader that runs its
    // rest, so each reader runs it and keeps its own batches.
    let all = paths(true);
    let files: Vec<PathBuf> = (0..IMAGES)
        .map(|i| all[if i % 6 == 1 { BAD } else { i }].clone())
        .collect();
    for drop_last in [false, true] {
        for rank in 0..2 {
            let make = || reader(&files, (rank, 2), drop_last, (0, 1), true);
            let mut whole = make();
            let n = whole.len();
            let all_batches = local_epoch(&mut whole);
            assert_eq!(all_batches.len(), n);
            for k in 1..=n {
                let mut local = make();
                let mut e = local.epoch().unwrap();
                for _ in 0..k {
                    e.next().unwrap().unwrap();
                }
                let state = e.state().unwrap();
                drop(e);
                assert!(state.owed_batches.is_some());
                let parts: Vec<_> = (0..3)
                    .map(|r| {
                        let mut l = reader(&files, (rank, 2), drop_last, (r, 3), true);
                        l.resume(&state).unwrap();
                        local_epoch(&mut l).into_iter()
                    })
                    .collect();
                let what = format!("rank {rank}, drop_last {drop_last}, k {k}");
                let got = in_turn(parts);
                if drop_last {
                    // The rank drops a short batch and makes a whole one up; a reader keeps
                    // the short one: the same count, the same batches up to it.
                    assert_eq!(got.len(), all_batches.len() - k, "{what}");
                    let whole = got.iter().take_while(|b| b.len() == 5).count();
                    same(&got[..whole], &all_batches[k..k + whole], &what);
                } else {
                    same(&got, &all_batches[k..], &what);
                }
            }
        }
    }
}

#[test]
fn readers_with_drop_last_keep_their_count_when_their_part_is_short_of_readable_items() {
    // A helper's cases: rank 1 of 2 over 32 files in order with two unreadable (each reader's
    // part of 8 holds 7 readable items: dropping its short batch left the rank with none,
    // silently); and 25 files, 10 unreadable, shuffled, batches of 3. With the fill every rank
    // makes its len() through any number of readers; without it none makes more.
    let all = paths(true);
    let cases: [(usize, &[usize], usize, Option<u64>); 2] = [
        (32, &[1, 17], 8, None),
        (25, &[1, 4, 5, 9, 14, 18, 19, 22, 23, 24], 3, Some(1)),
    ];
    for (n, bad, batch, seed) in cases {
        let files: Vec<PathBuf> = (0..n)
            .map(|i| all[if bad.contains(&i) { BAD } else { i }].clone())
            .collect();
        for rank in 0..2 {
            for fill in [false, true] {
                let make = |r: usize, readers: usize| {
                    let mut d = Dataset::builder(Source::files(files.clone()))
                        .ranks_from(Ranks::Fixed { rank, world: 2 })
                        .drop_last(true);
                    if let Some(s) = seed {
                        d = d.shuffle(s);
                    }
                    let recipe = Recipe::image(ImageRecipe {
                        resize: 12,
                        crop: 8,
                        ..ImageRecipe::default()
                    })
                    .unwrap();
                    Loader::builder(d.build().unwrap(), recipe)
                        .batch_size(batch)
                        .drop_last(true)
                        .fill_skipped(fill)
                        .reader(r, readers)
                        .build()
                        .unwrap()
                };
                let len = make(0, 1).len();
                for readers in [2, 3] {
                    let got: usize = (0..readers)
                        .map(|r| {
                            let mut l = make(r, readers);
                            let b: Vec<Seen> =
                                l.epoch().unwrap().map_while(|b| b.ok().map(seen)).collect();
                            assert!(b.iter().all(|b| !b.is_empty()));
                            b.len()
                        })
                        .sum();
                    let what = format!("{n} files, rank {rank}, fill {fill}, {readers} readers");
                    if fill {
                        assert_eq!(got, len, "{what}: the rank's len()");
                    } else {
                        assert!(got <= len, "{what}: {got} of {len}");
                    }
                }
            }
        }
    }
}
