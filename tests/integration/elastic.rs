//! Elastic resume: the checkpoints of every rank of one world, merged, resume at another
//! world size; each new rank gets an equal share of the epoch's rest, and the items of the
//! epoch are delivered exactly once across all worlds (or, with `ShareLengths::Drop` /
//! `Pad`, at most once / at least once, by no more than the dropped / padded positions).

use std::collections::BTreeMap;
use std::time::Duration;

use flowgate::sampler::{Sampler, ShareLengths};
use flowgate::{FailureBudget, Order, Pipeline, PipelineState, Workers};
use proptest::prelude::*;

use crate::common;
use common::Injected;

/// Dataset indices of `sampler`'s share, through a stage with uneven latencies that fails
/// every 23rd index (failed items are not delivered: a resume attempts them again); with
/// `split`, each index becomes two parts (`disaggregate`), else one.
fn build(sampler: Sampler, order: Order, fail: bool, split: bool) -> Pipeline<(usize, u8)> {
    Pipeline::builder()
        .source_sampled(sampler, |_epoch, i| i)
        .pipe(
            "parts",
            move |i: usize| {
                Ok::<_, Injected>(if split {
                    vec![(i, 0), (i, 1)]
                } else {
                    vec![(i, 0)]
                })
            },
            1,
        )
        .disaggregate()
        .pipe(
            "work",
            move |(i, k): (usize, u8)| {
                if i % 5 == 1 {
                    std::thread::sleep(Duration::from_micros(200));
                }
                if fail && i % 23 == 4 {
                    Err(Injected(i as u64))
                } else {
                    Ok((i, k))
                }
            },
            Workers::fixed(2),
        )
        .budget(6, u64::MAX)
        .max_failures(FailureBudget::unlimited())
        .output_order(order)
        .autotune_off()
        .build()
        .expect("build")
}

fn lengths() -> impl Strategy<Value = ShareLengths> {
    prop_oneof![
        Just(ShareLengths::Uneven),
        Just(ShareLengths::Drop),
        Just(ShareLengths::Pad)
    ]
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 24, .. ProptestConfig::default() })]

    #[test]
    fn merged_checkpoints_resume_at_any_world_size(
        len in 1usize..160,
        worlds in proptest::collection::vec(1usize..6, 2..4),
        cuts in proptest::collection::vec(0usize..40, 18),
        lengths in lengths(),
        seed in any::<u64>(),
        epoch in 0u64..2,
        input_order in any::<bool>(),
        fail in any::<bool>(),
        split in any::<bool>(),
    ) {
        let parts = if split { 2 } else { 1 };
        let order = if input_order { Order::Input } else { Order::Completion };
        let base = Sampler::new(len).shuffle(seed).shard_lengths(lengths);
        let mut count: BTreeMap<(usize, u8), usize> = BTreeMap::new();
        let mut state: Option<PipelineState> = None;
        let mut cut = cuts.iter().cycle();
        let last = worlds.len() - 1;
        let mut dealt = Vec::new();
        let mut next: BTreeMap<(usize, u8), usize> = BTreeMap::new();
        let mut next_ran = false;
        for (phase, &world) in worlds.iter().enumerate() {
            dealt.push(world);
            let mut states = Vec::new();
            let mut shares = Vec::new();
            for rank in 0..world {
                let mut p = build(base.clone().shard(rank, world).unwrap(), order, fail, split);
                match &state {
                    Some(s) => p.resume(s).expect("resume a merged state"),
                    None => p.start_at_epoch(epoch).unwrap(),
                }
                let before = p.stats();
                let take = if phase == last { usize::MAX } else { *cut.next().unwrap() };
                let got: Vec<(usize, u8)> = p.iter().take(take).map(|r| r.unwrap()).collect();
                for i in &got {
                    *count.entry(*i).or_default() += 1;
                }
                if phase == last || take == usize::MAX {
                    // Delivered + failed = the rank's share of what was left (a part of an
                    // item split before the checkpoint may have been delivered then).
                    let s = p.stats();
                    shares.push(got.len() as u64 + parts * (s.failures - before.failures));
                }
                if phase == last && state.is_some() {
                    // The epoch after a resumed one is whole again: the resume's base (what
                    // the merged state delivered) belongs to its epoch only.
                    for i in p.iter().map(|r| r.unwrap()) {
                        *next.entry(i).or_default() += 1;
                    }
                    next_ran = true;
                }
                states.push(p.state());
            }
            if phase == last {
                // (With split items, a part received before the checkpoint is not delivered
                // again, so deliveries do not show the shares; exactness is checked below.)
                let (lo, hi) = (shares.iter().min().unwrap(), shares.iter().max().unwrap());
                if !split {
                    let spread = if lengths == ShareLengths::Uneven { 1 } else { 0 };
                    prop_assert!(hi - lo <= spread, "shares at world {}: {:?}", world, shares);
                }
                break;
            }
            // The ranks' states are saved (JSON) and merged into one, in any order.
            states.reverse();
            let states: Vec<PipelineState> = states.iter()
                .map(|s| serde_json::from_str(&serde_json::to_string(s).unwrap()).unwrap())
                .collect();
            let merged = PipelineState::merge(&states).expect("merge");
            prop_assert!(merged.epoch == epoch || merged.epoch == epoch + 1);
            if merged.epoch > epoch {
                break; // every rank finished the epoch
            }
            state = Some(merged);
        }
        let deliverable: Vec<(usize, u8)> = (0..len)
            .filter(|i| !fail || i % 23 != 4)
            .flat_map(|i| (0..parts as u8).map(move |k| (i, k)))
            .collect();
        let final_world = *dealt.last().unwrap();
        if next_ran {
            let missing = deliverable.iter().filter(|i| !next.contains_key(i)).count();
            let repeats: usize = next.values().map(|c| c - 1).sum();
            match lengths {
                ShareLengths::Uneven => prop_assert!(missing == 0 && repeats == 0,
                    "the next epoch: {} missing, {} repeated", missing, repeats),
                ShareLengths::Drop => prop_assert!(repeats == 0 && missing < final_world * parts as usize,
                    "the next epoch: {} missing, {} repeated", missing, repeats),
                ShareLengths::Pad => prop_assert!(missing == 0 && repeats <= (final_world - 1) * parts as usize,
                    "the next epoch: {} missing, {} repeated", missing, repeats),
            }
        }
        let missing = deliverable.iter().filter(|i| !count.contains_key(i)).count();
        let repeats: usize = count.values().map(|c| c - 1).sum();
        prop_assert!(count.keys().all(|i| deliverable.contains(i)), "only the epoch's items");
        match lengths {
            ShareLengths::Uneven => {
                prop_assert_eq!(missing, 0, "every item");
                prop_assert_eq!(repeats, 0, "exactly once");
            }
            // Only the last dealing drops (earlier ones' dropped positions stay in the rest).
            ShareLengths::Drop => {
                prop_assert_eq!(repeats, 0, "at most once");
                prop_assert!(missing < final_world * parts as usize, "{} dropped at world {}", missing, final_world);
            }
            // Every dealing pads by fewer than its world.
            ShareLengths::Pad => {
                prop_assert_eq!(missing, 0, "every item");
                let bound: usize = dealt.iter().map(|w| (w - 1) * parts as usize).sum();
                prop_assert!(repeats <= bound, "{} repeats, padding allows {}", repeats, bound);
            }
        }
    }
}

/// A part of an item received before a world started (a merged state's `partial`) whose
/// position that world deals to no rank (`ShareLengths::Drop` leaves the remainder out) is
/// still in its merged states, so the next world does not deliver that part again (proptest
/// found it: the part was lost at the merge, and the item delivered again whole).
#[test]
fn a_part_received_of_an_item_a_world_leaves_out_is_kept_through_its_merge() {
    let base = Sampler::new(60)
        .shuffle(14624768855974804864)
        .shard_lengths(ShareLengths::Drop);
    let mut count: BTreeMap<(usize, u8), usize> = BTreeMap::new();
    let mut state: Option<PipelineState> = None;
    // World 4 takes some (rank 1 stops inside an item), world 4 again takes none, world 1
    // the rest.
    for (world, takes) in [
        (4, vec![0, 27, 20, 12]),
        (4, vec![0; 4]),
        (1, vec![usize::MAX]),
    ] {
        let mut states = Vec::new();
        for (rank, &take) in takes.iter().enumerate() {
            let mut p = build(
                base.clone().shard(rank, world).unwrap(),
                Order::Input,
                true,
                true,
            );
            match &state {
                Some(s) => p.resume(s).unwrap(),
                None => p.start_at_epoch(0).unwrap(),
            }
            for i in p.iter().take(take) {
                *count.entry(i.unwrap()).or_default() += 1;
            }
            states.push(p.state());
        }
        if world == 4 {
            let merged = PipelineState::merge(&states).unwrap();
            assert!(
                !merged.partial.is_empty(),
                "the part received is in the merged state: {merged:?}"
            );
            state = Some(merged);
        }
    }
    let again: Vec<_> = count.iter().filter(|(_, &n)| n > 1).collect();
    assert!(again.is_empty(), "delivered again: {again:?}");
}

#[test]
fn merging_refuses_states_that_do_not_fit_together() {
    let sampler = || Sampler::new(40).shuffle(1);
    let state_of = |s: Sampler, n: usize| {
        let mut p = build(s, Order::Completion, false, false);
        let _: Vec<_> = p.iter().take(n).collect();
        p.state()
    };
    let r0 = state_of(sampler().shard(0, 2).unwrap(), 3);
    let r1 = state_of(sampler().shard(1, 2).unwrap(), 5);
    let merged = PipelineState::merge(&[r0.clone(), r1.clone()]).unwrap();
    assert_eq!(merged.epoch, 0);
    // The shares are disjoint (40 positions on 2 ranks, nothing padded): the sum exactly.
    assert_eq!(
        merged.delivered_items,
        r0.delivered_items + r1.delivered_items,
        "{merged:?}"
    );
    // States taken at each rank's last item (still naming the epoch) merge into the next
    // epoch with nothing delivered.
    let whole = |rank| state_of(sampler().shard(rank, 2).unwrap(), 20);
    let (w0, w1) = (whole(0), whole(1));
    assert_eq!((w0.epoch, w0.delivered_items), (0, 20));
    let done = PipelineState::merge(&[w0, w1]).unwrap();
    assert_eq!((done.epoch, done.delivered_items), (1, 0), "{done:?}");
    // A rank already delivering the next epoch does not merge with one still in this one.
    let ahead = {
        let mut p = build(
            sampler().shard(1, 2).unwrap(),
            Order::Completion,
            false,
            false,
        );
        assert_eq!(p.iter().count(), 20);
        let _: Vec<_> = p.iter().take(2).collect();
        p.state()
    };
    assert_eq!((ahead.epoch, ahead.delivered_items), (1, 2));
    let e = PipelineState::merge(&[r0.clone(), ahead]).unwrap_err();
    assert!(e.to_string().contains("take them at the same step"), "{e}");
    for (states, says) in [
        (vec![r0.clone()], "no state of rank 1"),
        (vec![r0.clone(), r0.clone()], "two states of rank 0"),
        (
            vec![
                r0.clone(),
                state_of(Sampler::new(40).shuffle(2).shard(1, 2).unwrap(), 1),
            ],
            "shuffle_seed",
        ),
        (
            vec![r0.clone(), state_of(sampler().shard(1, 3).unwrap(), 1)],
            "world sizes 2 and 3",
        ),
        (vec![], "no states"),
    ] {
        let e = PipelineState::merge(&states).unwrap_err();
        assert!(e.is_config() && e.to_string().contains(says), "{says}: {e}");
    }
    // One rank's own state does not resume another world: it holds only its progress.
    let mut p = build(
        sampler().shard(0, 3).unwrap(),
        Order::Completion,
        false,
        false,
    );
    let e = p.resume(&r0).unwrap_err();
    assert!(
        e.to_string().contains("merge every rank's checkpoint"),
        "{e}"
    );
    // At its own place it does, and the merged state anywhere.
    build(
        sampler().shard(0, 2).unwrap(),
        Order::Completion,
        false,
        false,
    )
    .resume(&r0)
    .unwrap();
    build(
        sampler().shard(2, 3).unwrap(),
        Order::Completion,
        false,
        false,
    )
    .resume(&merged)
    .unwrap();
}

/// A checkpoint edited by hand or cut by a bad write: each damage refused with what is wrong,
/// at resume and at merge, never resumed as another set of items; the undamaged state
/// resumes.
#[test]
fn a_damaged_state_is_refused_saying_what_is_wrong() {
    // Rank 1 of 2 over 40 shuffled items in tar-shard groups (blocks, a shuffle buffer).
    let sampler = |rank| {
        Sampler::new(40)
            .groups(&[7, 9, 11, 13])
            .unwrap()
            .buffer(4)
            .shuffle(3)
            .shard(rank, 2)
            .unwrap()
    };
    let state = |rank| {
        let mut p = build(sampler(rank), Order::Input, false, true);
        let _: Vec<_> = p.iter().take(9).collect();
        p.state()
    };
    let (r0, r1) = (state(0), state(1));
    let v = serde_json::to_value(&r1).unwrap();
    assert!(
        v["partial"].as_array().is_some_and(|p| !p.is_empty()),
        "{v}"
    );
    let share = sampler(1).layout(0, Default::default()).len() as u64;
    let damaged = |edit: &dyn Fn(&mut serde_json::Value)| {
        let mut v = v.clone();
        edit(&mut v);
        serde_json::from_value::<PipelineState>(v).unwrap()
    };
    let cases: Vec<(&str, PipelineState, &str)> = vec![
        (
            "past the share",
            damaged(&|v| v["delivered"] = serde_json::json!([[0, share + 1]])),
            "past the",
        ),
        (
            "reversed",
            damaged(&|v| v["delivered"] = serde_json::json!([[5, 2]])),
            "empty or reversed",
        ),
        (
            "overlapping",
            damaged(&|v| {
                v["delivered"] = serde_json::json!([[0, 4], [2, 6]]);
                v["delivered_items"] = 8.into();
            }),
            "overlap or are out of order",
        ),
        (
            "a count that is not its ranges'",
            damaged(&|v| v["delivered_items"] = 3.into()),
            "`delivered_items` is 3",
        ),
        (
            "a part past its item",
            damaged(&|v| v["partial"] = serde_json::json!([[1, 0, (1u64 << 32) + 1]])),
            "`partial`",
        ),
        (
            "a part of a position past the share",
            damaged(&|v| v["partial"] = serde_json::json!([[share, 0, 5]])),
            "`partial`",
        ),
        (
            "a base past the epoch",
            damaged(&|v| v["shard"]["base"] = serde_json::json!([[38, 45]])),
            "`base` range [38, 45) is past the 40 positions of the epoch",
        ),
        (
            "another block seed",
            damaged(&|v| v["shard"]["block_seed"] = 12345.into()),
            "tar-shard blocks (shuffle window 4, seed 12345) are not this pipeline's",
        ),
    ];
    for (what, bad, says) in cases {
        let e = build(sampler(1), Order::Input, false, true)
            .resume(&bad)
            .unwrap_err();
        assert!(e.is_config() && e.to_string().contains(says), "{what}: {e}");
        // At merge, blocks seeded otherwise than rank 0's in one epoch are refused too (its
        // positions would be read in another order than it delivered them).
        let merge_says = if what.contains("block seed") {
            "states of ranks 0 and 1 come from different loaders: tar-shard blocks"
        } else {
            "rank 1's state: the checkpoint is damaged"
        };
        let e = PipelineState::merge(&[r0.clone(), bad]).unwrap_err();
        assert!(e.to_string().contains(merge_says), "{what}: {e}");
    }
    // A state that lost its `shard` names no rank: refused on a rank of two, rather than
    // taken as that rank's own (rank 1's progress skipping rank 0's items; with nothing
    // delivered, forgetting what the world delivered before: its base).
    let no_shard = damaged(&|v| {
        v.as_object_mut().unwrap().remove("shard");
    });
    let fresh_no_shard = damaged(&|v| {
        v.as_object_mut().unwrap().remove("shard");
        v["delivered"] = serde_json::json!([]);
        v["delivered_items"] = 0.into();
        v["partial"] = serde_json::json!([]);
    });
    for (rank, lost) in [(0, no_shard), (1, fresh_no_shard)] {
        let e = build(sampler(rank), Order::Input, false, true)
            .resume(&lost)
            .unwrap_err();
        assert!(e.to_string().contains("names no rank"), "rank {rank}: {e}");
    }
    // Starting an epoch afresh names this rank's place itself: rank 1 reads its share.
    let mut p = build(sampler(1), Order::Input, false, false);
    p.start_at_epoch(1).unwrap();
    let mut got: Vec<usize> = p.iter().map(|r| r.unwrap().0).collect();
    got.sort_unstable();
    let mut want = sampler(1).epoch(1);
    want.sort_unstable();
    assert_eq!(got, want);
    // Rank 1's state without its blocks at rank 1 of 2: the message says what differs, not
    // "rank 1 of 2 ... this pipeline is rank 1 of 2" (as before).
    let no_blocks = damaged(&|v| {
        let shard = v["shard"].as_object_mut().unwrap();
        shard.remove("block_window");
        shard.remove("block_seed");
    });
    let e = build(sampler(1), Order::Input, false, true)
        .resume(&no_blocks)
        .unwrap_err();
    assert!(
        e.to_string()
            .contains("rank 1's of 2 without tar-shard blocks"),
        "{e}"
    );
    // The undamaged states still resume and merge.
    build(sampler(1), Order::Input, false, true)
        .resume(&r1)
        .unwrap();
    PipelineState::merge(&[r0, r1]).unwrap();
}

#[test]
fn a_version_1_state_resumes_at_its_own_rank_only() {
    // Version 1 kept the rank and world size in the fingerprint, positions the rank's own.
    let sampler = || Sampler::new(40).shuffle(1).shard(1, 2).unwrap();
    let share = sampler().epoch(0);
    let mut p = build(sampler(), Order::Input, false, false);
    let first: Vec<usize> = p.iter().take(5).map(|r| r.unwrap().0).collect();
    let mut v = serde_json::to_value(p.state()).unwrap();
    v["version"] = 1.into();
    v["fingerprint"]["rank"] = "1".into();
    v["fingerprint"]["world_size"] = "2".into();
    v.as_object_mut().unwrap().remove("shard");
    let v1: PipelineState = serde_json::from_value(v).unwrap();
    let mut q = build(sampler(), Order::Input, false, false);
    q.resume(&v1).expect("its own rank resumes it");
    let mut all = first;
    all.extend(q.iter().map(|r| r.unwrap().0));
    all.sort_unstable();
    let mut want = share;
    want.sort_unstable();
    assert_eq!(all, want, "the rest of the share, exactly");
    for (rank, world) in [(0, 2), (1, 3)] {
        let s = Sampler::new(40).shuffle(1).shard(rank, world).unwrap();
        let e = build(s, Order::Input, false, false)
            .resume(&v1)
            .unwrap_err();
        assert!(
            e.to_string().contains("merge every rank's checkpoint"),
            "rank {rank} of {world}: {e}"
        );
    }
    let e = PipelineState::merge(&[v1]).unwrap_err();
    assert!(e.to_string().contains("version-1"), "{e}");
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 24, .. ProptestConfig::default() })]

    /// A rank's own checkpoint resumed by DataLoader workers that split its share (a
    /// training job that checkpointed with one process per rank and resumes with workers):
    /// the workers together deliver exactly the rank's undelivered items; a worker's own
    /// state is refused where only the training process's is whole.
    #[test]
    fn a_rank_state_resumes_split_among_workers(
        len in 1usize..120, world in 1usize..4, workers in 2usize..5, cut in 0usize..40,
        seed in any::<u64>(), grouped in any::<bool>(),
    ) {
        let mut base = Sampler::new(len).shuffle(seed).shard_lengths(ShareLengths::Pad);
        if grouped {
            let groups: Vec<usize> = (0..len).collect::<Vec<_>>().chunks(9).map(<[usize]>::len).collect();
            base = Sampler::new(len).groups(&groups).unwrap().shuffle(seed).buffer(4).shard_lengths(ShareLengths::Pad);
        }
        for rank in 0..world {
            let sampler = base.clone().shard(rank, world).unwrap();
            let share = sampler.epoch(0);
            let mut p = build(sampler.clone(), Order::Input, false, false);
            // Mid-epoch (a state after the epoch's end names the next one).
            let cut = cut.min(share.len().saturating_sub(1));
            let first: Vec<usize> = p.iter().take(cut).map(|r| r.unwrap().0).collect();
            let state: PipelineState =
                serde_json::from_str(&serde_json::to_string(&p.state()).unwrap()).unwrap();
            let mut rest = Vec::new();
            for w in 0..workers {
                let mut q = build(sampler.clone().split(w, workers).unwrap(), Order::Input, false, false);
                q.resume(&state).expect("a rank's state resumes in its workers");
                rest.extend(q.iter().map(|r| r.unwrap().0));
                if w == 0 && workers > 1 {
                    let e = PipelineState::merge(&[q.state()]).unwrap_err();
                    prop_assert!(e.to_string().contains("DataLoader worker"), "{}", e);
                    // Its own split resumes it; another split refuses it.
                    let own = build(sampler.clone().split(0, workers).unwrap(), Order::Input, false, false)
                        .resume(&q.state());
                    prop_assert!(own.is_ok(), "{:?}", own);
                    let e = build(sampler.clone().split(1, workers).unwrap(), Order::Input, false, false)
                        .resume(&q.state()).unwrap_err();
                    prop_assert!(e.to_string().contains("DataLoader worker"), "{}", e);
                }
            }
            let mut all = first.clone();
            all.extend(&rest);
            all.sort_unstable();
            let mut want = share.clone();
            want.sort_unstable();
            prop_assert_eq!(all, want, "rank {}: {} before the checkpoint", rank, first.len());
        }
    }
}
