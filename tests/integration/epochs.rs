//! A loader's epochs as a training loop lives them: a state taken after a `break` resumes the
//! rest of that epoch; a peek (`next(iter(loader))`) before the loop keeps every rank on the
//! same epoch; an abandoned epoch starts again where it started until `set_epoch` moves on; a
//! state taken right after a resume is the resumed state; a rebuilt pipeline starts with the
//! buffers and workers the last one ended with. (`tests/integration/loader.rs` holds what an epoch
//! delivers.)

use std::path::PathBuf;
use std::sync::OnceLock;

use flowgate::dataset::{Dataset, Source};
use flowgate::loader::Batch;
use flowgate::Loader;

use crate::common;
use common::{epoch_items as epoch, small_recipe as recipe};

/// Images in the set: a prime, so no rank count or batch size divides it.
const IMAGES: usize = 37;

struct Data {
    paths: Vec<PathBuf>,
}

fn data() -> &'static Data {
    static DATA: OnceLock<Data> = OnceLock::new();
    DATA.get_or_init(|| {
        let dir = std::path::Path::new(env!("CARGO_TARGET_TMPDIR")).join("epochs");
        let _ = std::fs::remove_dir_all(&dir);
        std::fs::create_dir_all(&dir).unwrap();
        let paths = (0..IMAGES)
            .map(|i| {
                let p = dir.join(format!("{i:03}.jpg"));
                std::fs::write(&p, common::tiny_jpeg(i)).unwrap();
                p
            })
            .collect();
        Data { paths }
    })
}

/// The test files shuffled with `seed`, in batches of `batch` (one process).
fn shuffled_files(seed: u64, batch: usize) -> Loader {
    let dataset = Dataset::builder(Source::files(data().paths.clone()))
        .shuffle(seed)
        .build()
        .unwrap();
    Loader::builder(dataset, recipe())
        .batch_size(batch)
        .build()
        .unwrap()
}

/// A checkpoint taken after a `break` records what the abandoned epoch delivered, so a
/// resume (or a merge of every rank's) delivers the rest of it, not the next epoch; the loader
/// itself starts the abandoned epoch again from its beginning (as `DistributedSampler` until
/// `set_epoch`), then goes on with the next.
#[test]
fn a_state_taken_after_a_break_resumes_the_rest_of_that_epoch() {
    let build = || shuffled_files(2, 5);
    let mut first = build();
    let mut taken = Vec::new();
    for b in first.epoch().unwrap().take(3) {
        taken.extend(b.unwrap().items.iter().map(|m| m.index));
    }
    // The loop is left: the epoch is abandoned, then the checkpoint is taken.
    let state = first.state().unwrap();
    assert_eq!((state.epoch, state.delivered_items), (0, 15));
    let taken_in_order = taken.clone();
    let rest = common::rest_after(&mut build(), &state);
    let mut all = [taken, rest].concat();
    all.sort_unstable();
    assert_eq!(
        all,
        (0..IMAGES).collect::<Vec<_>>(),
        "the rest of epoch 0, once"
    );
    // The first loader starts epoch 0 again: whole, in the same order; then epoch 1.
    assert_eq!(first.abandoned_epoch(), Some((0, 3)));
    let indices = |l: &mut Loader| -> Vec<usize> {
        let batches: Vec<Batch> = l.epoch().unwrap().map(Result::unwrap).collect();
        batches
            .iter()
            .flat_map(|b| b.items.iter().map(|m| m.index))
            .collect()
    };
    let again = indices(&mut first);
    assert_eq!(again[..15], taken_in_order[..], "the same order");
    assert_eq!(again.len(), IMAGES, "epoch 0 whole");
    assert_eq!(first.state().unwrap().epoch, 1);
    let next = indices(&mut first);
    assert_eq!(next.len(), IMAGES);
    assert_ne!(next, again, "epoch 1's own order");
    assert_eq!(first.state().unwrap().epoch, 2);
}

/// The dataset positions of a loader's next epoch, in delivery order.
fn positions(l: &mut Loader) -> Vec<usize> {
    let batches: Vec<Batch> = l.epoch().unwrap().map(Result::unwrap).collect();
    batches
        .iter()
        .flat_map(|b| b.items.iter().map(|m| m.index))
        .collect()
}

/// A rank of 37 shuffled files split among 2 ranks, in batches of 4 (not dividing a rank's
/// 19 or 18).
fn rank_of_two(rank: usize) -> Loader {
    let dataset = Dataset::builder(Source::files(data().paths.clone()))
        .shuffle(5)
        .ranks(rank, 2)
        .build()
        .unwrap();
    Loader::builder(dataset, recipe())
        .batch_size(4)
        .build()
        .unwrap()
}

/// A peek at one batch before the loop (`next(iter(loader))`, a shape check) does not cost
/// an epoch: the loop runs epoch 0 whole, in the order it has without the peek, its `len`
/// batches. So one rank that peeks keeps the epoch (the shuffle) every other rank runs: the
/// ranks stay disjoint (one item padded) and cover the dataset each epoch.
#[test]
fn a_peek_before_the_loop_keeps_the_epoch_on_every_rank() {
    let plain: Vec<Vec<Vec<usize>>> = (0..2)
        .map(|r| {
            let mut l = rank_of_two(r);
            (0..2).map(|_| positions(&mut l)).collect()
        })
        .collect();
    // Rank 0 peeks: one batch of an iterator dropped at once.
    let mut peeker = rank_of_two(0);
    let peeked = peeker.epoch().unwrap().next().unwrap().unwrap();
    assert_eq!(peeked.len(), 4);
    assert_eq!(peeker.abandoned_epoch(), Some((0, 1)));
    assert_eq!(peeker.next_epoch(), 0, "the peek did not use up epoch 0");
    let batches = peeker.len();
    for (e, want) in plain[0].iter().enumerate() {
        let got = positions(&mut peeker);
        assert_eq!(&got, want, "epoch {e}: the order it has without the peek");
        assert_eq!(got.len().div_ceil(4), batches);
        let mut both = [got, plain[1][e].clone()].concat();
        both.sort_unstable();
        assert_eq!(
            both.len(),
            38,
            "19 each: one item padded, as DistributedSampler"
        );
        both.dedup();
        assert_eq!(
            both,
            (0..IMAGES).collect::<Vec<_>>(),
            "epoch {e}: the ranks cover it"
        );
    }
    assert_eq!(peeker.abandoned_epoch(), None);
}

/// An abandoned epoch starts again from where it started: a resumed one at the resumed
/// position (a peek after a resume loses nothing of the checkpoint); `set_epoch` to another
/// epoch moves on instead; an error ends the epoch (the next follows: see
/// `a_bad_file_is_skipped_counted_and_named_or_fatal_when_asked`).
#[test]
fn an_abandoned_epoch_starts_again_where_it_started_until_set_epoch_moves_on() {
    let build = || shuffled_files(8, 4);
    let (taken, state) = common::take_then_save(&mut build(), 3);
    let rest = common::rest_after(&mut build(), &state);
    let mut l = build();
    l.resume(&state).unwrap();
    // A loop over the resumed epoch left after two batches, then another after one.
    for n in [2, 1] {
        let got: Vec<Batch> = l.epoch().unwrap().take(n).map(Result::unwrap).collect();
        let got: Vec<usize> = got
            .iter()
            .flat_map(|b| b.items.iter().map(|m| m.index))
            .collect();
        assert_eq!(got[..], rest[..4 * n], "from the resumed position");
        assert_eq!(l.abandoned_epoch(), Some((0, n)));
    }
    assert_eq!(positions(&mut l), rest, "the checkpoint's rest, once");
    let mut all = [taken, rest].concat();
    all.sort_unstable();
    assert_eq!(all, (0..IMAGES).collect::<Vec<_>>());
    // Epoch 1 left mid-way, then set_epoch(2): epoch 2 whole, not epoch 1 again.
    let whole2 = {
        let mut w = build();
        w.set_epoch(2);
        positions(&mut w)
    };
    assert_eq!(l.epoch().unwrap().take(2).count(), 2);
    assert_eq!(l.abandoned_epoch(), Some((1, 2)));
    l.set_epoch(1);
    assert_eq!(
        l.abandoned_epoch(),
        Some((1, 0)),
        "the same epoch: kept, started again by choice (nothing to warn of)"
    );
    l.set_epoch(2);
    assert_eq!(l.abandoned_epoch(), None);
    assert_eq!(positions(&mut l), whole2);
}

/// A checkpoint taken right after a resume, before the resumed epoch is iterated (a training
/// loop that saves at the top of every epoch), is the resumed state itself: it named the next
/// epoch before, so a crash then lost the rest of the resumed one.
#[test]
fn a_state_taken_right_after_a_resume_is_the_resumed_state() {
    let build = || shuffled_files(6, 4);
    let (taken, state) = common::take_then_save(&mut build(), 2);
    let mut resumed = build();
    resumed.resume(&state).unwrap();
    let again = resumed.state().unwrap();
    assert_eq!(again, state);
    let rest = common::rest_after(&mut build(), &again);
    let mut all = [taken, rest].concat();
    all.sort_unstable();
    assert_eq!(all, (0..IMAGES).collect::<Vec<_>>());
}

/// A loop that takes every batch of an epoch and stops without asking for its end
/// (`zip(range(len(loader)), loader)`, `take(len)`) read the epoch through: the next epoch
/// follows, nothing is said abandoned, and the checkpoint taken after it names the next epoch
/// (the epoch was read again, every item twice, while a checkpoint said it was done).
#[test]
fn a_pass_that_took_every_batch_ended_its_epoch() {
    let build = || shuffled_files(3, 5);
    let whole = |e: u64| {
        let mut w = build();
        w.set_epoch(e);
        positions(&mut w)
    };
    let mut l = build();
    let n = l.len();
    let mut epoch = l.epoch().unwrap();
    let got: Vec<Batch> = epoch.by_ref().take(n).map(Result::unwrap).collect();
    assert_eq!(got.len(), n);
    // Taken while the loop has not asked for the end: the epoch, every item delivered (a
    // loop that calls set_epoch(0) again on a restart resumes its empty rest, not all of it).
    let during = epoch.state().unwrap();
    drop(epoch);
    assert_eq!((during.epoch, during.delivered_items), (0, IMAGES as u64));
    assert!(common::rest_after(&mut build(), &during).is_empty());
    assert_eq!(l.abandoned_epoch(), None, "read through, not abandoned");
    assert_eq!(l.next_epoch(), 1);
    let state = l.state().unwrap();
    assert_eq!(
        (state.epoch, state.delivered_items),
        (1, 0),
        "the next epoch's start"
    );
    assert_eq!(
        positions(&mut l),
        whole(1),
        "the next epoch, not epoch 0 again"
    );
    assert_eq!(common::rest_after(&mut build(), &state), whole(1));
    // One batch short of the end: abandoned, read again from its start.
    let mut l = build();
    assert_eq!(l.epoch().unwrap().take(n - 1).count(), n - 1);
    assert_eq!(l.abandoned_epoch(), Some((0, n - 1)));
    assert_eq!(positions(&mut l), whole(0));
}

/// A resumed state closed before its epoch is iterated (a checkpoint loaded, then the loader
/// closed to free its threads until training starts) is kept: the checkpoint is still that
/// state, and the next epoch delivers exactly its rest. (Closing dropped the resumed
/// pipeline, and the next epoch started the resumed one from its beginning.)
#[test]
fn a_resumed_state_closed_before_its_epoch_is_kept() {
    let build = || shuffled_files(5, 4);
    let (taken, state) = common::take_then_save(&mut build(), 3);
    let rest = common::rest_after(&mut build(), &state);
    let mut l = build();
    l.resume(&state).unwrap();
    l.close();
    assert_eq!(
        l.state().unwrap(),
        state,
        "the checkpoint is the resumed state"
    );
    assert_eq!(
        positions(&mut l),
        rest,
        "the rest of the resumed epoch, once"
    );
    let mut all = [taken, rest].concat();
    all.sort_unstable();
    assert_eq!(all, (0..IMAGES).collect::<Vec<_>>());
    // Closed twice, and set_epoch of that epoch between: still kept.
    let mut l = build();
    l.resume(&state).unwrap();
    l.close();
    l.set_epoch(state.epoch);
    l.close();
    assert_eq!(positions(&mut l), common::rest_after(&mut build(), &state));
}

/// A loader's buffers start small — decoded items waiting for their batch at one batch, the
/// decode stage at one batch or what keeps its workers busy, the collate stage at one batch
/// list — and a pipeline rebuilt after an
/// abandoned epoch starts with the buffers (and decode workers) the last one ended with,
/// instead of refilling to the defaults (the refill set the process's peak RSS).
#[test]
fn buffers_start_at_a_batch_and_carry_over_to_the_next_pipeline() {
    let dataset = Dataset::builder(Source::files(data().paths.clone()))
        .shuffle(1)
        .build()
        .unwrap();
    let mut loader = Loader::builder(dataset, recipe())
        .batch_size(4)
        .workers(3)
        .autotune_off()
        .build()
        .unwrap();
    let budget = |l: &mut Loader, stage: &str| {
        l.monitor().unwrap();
        l.stats().stage(stage).unwrap().budget_items
    };
    assert_eq!(budget(&mut loader, "aggregate"), 4);
    assert_eq!(budget(&mut loader, "decode"), 2 * 3 + 2);
    assert_eq!(budget(&mut loader, "collate"), 1);
    // Set by hand (as a tuner would), then the epoch is abandoned: the next pipeline keeps them.
    let control = loader.control().unwrap();
    control.set_budget("aggregate", 9, u64::MAX).unwrap();
    control.set_budget("collate", 3, u64::MAX).unwrap();
    let decoding = loader.stats().stage("decode").unwrap().workers;
    let taken = loader.epoch().unwrap().take(2).count();
    assert_eq!(taken, 2);
    assert!(!loader.in_epoch(), "the epoch was abandoned");
    assert_eq!(loader.learned_workers(), Some(decoding));
    assert_eq!(budget(&mut loader, "aggregate"), 9);
    assert_eq!(budget(&mut loader, "collate"), 3);
    let (rest, _) = epoch(&mut loader);
    assert_eq!(rest.len(), IMAGES, "the next epoch, whole");
}
