use super::*;
use proptest::prelude::*;

#[test]
fn misconfigured_launches_are_errors_not_duplicate_shards() {
    let env = |pairs: &'static [(&'static str, &'static str)]| {
        move |k: &str| {
            pairs
                .iter()
                .find(|(n, _)| *n == k)
                .map(|(_, v)| v.to_string())
        }
    };
    let s = || Sampler::new(100);
    let ok = s()
        .shard_from_vars(env(&[("RANK", "1"), ("WORLD_SIZE", "4")]))
        .unwrap();
    assert_eq!(ok.epoch(0), s().shard(1, 4).unwrap().epoch(0));
    assert_eq!(s().shard_from_vars(env(&[])).unwrap().len(), 100);
    for (vars, says) in [
        (
            &[("RANK", "4"), ("WORLD_SIZE", "4")][..],
            "RANK=4 with WORLD_SIZE=4",
        ),
        (&[("RANK", "0"), ("WORLD_SIZE", "0")][..], "WORLD_SIZE=0"),
        (&[("RANK", "1")][..], "WORLD_SIZE is not"),
        (&[("WORLD_SIZE", "2")][..], "RANK is not"),
        (&[("LOCAL_RANK", "0")][..], "LOCAL_RANK is set"),
        (&[("RANK", "one"), ("WORLD_SIZE", "2")][..], "RANK=\"one\""),
    ] {
        let e = s().shard_from_vars(env(vars)).unwrap_err();
        assert!(
            e.is_config() && e.to_string().contains(says),
            "{vars:?}: {e}"
        );
    }
    assert!(s().shard(2, 2).is_err() && s().shard(0, 0).is_err());
}

fn sorted(mut v: Vec<usize>) -> Vec<usize> {
    v.sort_unstable();
    v
}

proptest! {
    #[test]
    fn shards_are_disjoint_and_complete(
        len in 0usize..300, world in 1usize..9, seed in any::<u64>(), epoch in 0u64..5,
    ) {
        let base = Sampler::new(len).shuffle(seed);
        let shards: Vec<Vec<usize>> =
            (0..world).map(|r| base.clone().shard(r, world).unwrap().epoch(epoch)).collect();
        for (r, s) in shards.iter().enumerate() {
            prop_assert_eq!(s.len(), base.clone().shard(r, world).unwrap().len());
        }
        let union = sorted(shards.concat());
        prop_assert_eq!(union, (0..len).collect::<Vec<_>>(), "disjoint and complete");
    }

    #[test]
    fn padded_and_dropped_shards_are_equal(
        len in 1usize..300, world in 1usize..9, seed in any::<u64>(),
    ) {
        let base = Sampler::new(len).shuffle(seed);
        let pad: Vec<Vec<usize>> = (0..world)
            .map(|r| base.clone().shard(r, world).unwrap().shard_lengths(ShareLengths::Pad).epoch(2))
            .collect();
        let want = len.div_ceil(world);
        prop_assert!(pad.iter().all(|s| s.len() == want));
        let all = pad.concat();
        let distinct = sorted(all.clone()).into_iter().collect::<std::collections::BTreeSet<_>>();
        prop_assert_eq!(distinct.len(), len, "padding covers every item");
        prop_assert_eq!(all.len() - len, want * world - len, "only the padding repeats");

        let drop: Vec<Vec<usize>> = (0..world)
            .map(|r| base.clone().shard(r, world).unwrap().shard_lengths(ShareLengths::Drop).epoch(2))
            .collect();
        prop_assert!(drop.iter().all(|s| s.len() == len / world));
        let all = sorted(drop.concat());
        let mut dedup = all.clone();
        dedup.dedup();
        prop_assert_eq!(dedup.len(), all.len(), "dropped shards are disjoint");
    }
}

proptest! {
    #[test]
    fn group_blocks_cover_the_epoch_and_keep_shards_whole(
        groups in proptest::collection::vec(0usize..40, 1..30),
        world in 1usize..6, seed in any::<u64>(), window in 0usize..50,
        lengths in prop_oneof![Just(ShareLengths::Uneven), Just(ShareLengths::Pad), Just(ShareLengths::Drop)],
    ) {
        let n: usize = groups.iter().sum();
        let group_of: Vec<usize> = groups.iter().enumerate().flat_map(|(g, &k)| std::iter::repeat_n(g, k)).collect();
        let base = Sampler::new(n).groups(&groups).unwrap().shuffle(seed).buffer(window).shard_lengths(lengths);
        let ranks: Vec<Vec<usize>> = (0..world).map(|r| base.clone().shard(r, world).unwrap().epoch(1)).collect();
        let lens: Vec<usize> = ranks.iter().map(Vec::len).collect();
        for (r, l) in lens.iter().enumerate() {
            prop_assert_eq!(*l, base.clone().shard(r, world).unwrap().len());
        }
        let all = sorted(ranks.concat());
        let mut distinct = all.clone();
        distinct.dedup();
        match lengths {
            ShareLengths::Uneven => {
                prop_assert_eq!(&all, &(0..n).collect::<Vec<_>>(), "each sample once");
                prop_assert!(lens.iter().max().unwrap() - lens.iter().min().unwrap() <= 1);
            }
            ShareLengths::Pad => {
                prop_assert_eq!(distinct.len(), n, "every sample");
                prop_assert!(lens.iter().all(|&l| l == n.div_ceil(world)));
            }
            ShareLengths::Drop => {
                prop_assert_eq!(distinct.len(), all.len(), "no sample twice");
                prop_assert!(lens.iter().all(|&l| l == n / world));
            }
        }
        // Whole shards: the ranks touching a group are few (a block splits at most the
        // two groups at its ends), and padding adds at most the first groups again.
        if lengths != ShareLengths::Pad {
            let touches: usize = ranks.iter().map(|r| {
                let mut g: Vec<usize> = r.iter().map(|&i| group_of[i]).collect();
                g.sort_unstable();
                g.dedup();
                g.len()
            }).sum();
            let nonempty = groups.iter().filter(|&&k| k > 0).count();
            prop_assert!(touches < nonempty + world, "{touches} group touches");
        }
        // The buffer moves no sample earlier than `window - 1` places before its place
        // in the stream.
        if lengths == ShareLengths::Uneven {
            let stream = Sampler::new(n).groups(&groups).unwrap().shuffle(seed).shard(0, world).unwrap().epoch(1);
            let buffered = &ranks[0];
            for (p, i) in buffered.iter().enumerate() {
                let q = stream.iter().position(|x| x == i).unwrap();
                prop_assert!(p + window.max(1) > q, "{i} at {p}, stream place {q}");
            }
        }
    }
}

#[test]
fn group_orders_are_reproducible_and_new_every_epoch() {
    let s = Sampler::new(300)
        .groups(&[100, 100, 100])
        .unwrap()
        .shuffle(9)
        .buffer(20);
    assert_eq!(s.epoch(0), s.epoch(0));
    assert_ne!(s.epoch(0), s.epoch(1));
    let first: Vec<usize> = (0..30).map(|e| s.epoch(e)[0] / 100).collect();
    assert!(
        first.iter().any(|&g| g != first[0]),
        "the shard order changes"
    );
    assert!(Sampler::new(10).groups(&[3, 3]).is_err());
    assert!(Sampler::new(2)
        .weighted(&[1.0, 1.0], 2, true)
        .unwrap()
        .groups(&[2])
        .is_err());
}

#[test]
fn mixtures_follow_their_weights_and_stop_rules() {
    let lengths = [1000, 700, 300];
    let weights = [0.5, 0.3, 0.2];
    let m = Sampler::mixture(&lengths, &weights, MixStop::Draws(100_000))
        .unwrap()
        .shuffle(4);
    let order = m.epoch(0);
    assert_eq!(order.len(), 100_000);
    let mut counts = [0usize; 3];
    for &i in &order {
        counts[m.locate(i).0] += 1;
    }
    for (s, &w) in weights.iter().enumerate() {
        let share = counts[s] as f64 / 100_000.0;
        assert!(
            (share - w).abs() < 0.01,
            "source {s}: share {share}, weight {w}"
        );
    }
    // Cycling: every source's items come in whole passes (each item of source 2, drawn
    // ~20,000 times in passes of 300, appears 66 or 67 times).
    let mut per_item = vec![0usize; 1000 + 700 + 300];
    for &i in &order {
        per_item[i] += 1;
    }
    let third = &per_item[1700..];
    let (lo, hi) = (third.iter().min().unwrap(), third.iter().max().unwrap());
    assert!(hi - lo <= 1, "passes of source 2: {lo}..{hi}");
    assert_eq!(m.epoch(0), order, "deterministic");
    assert_ne!(m.epoch(1)[..100], order[..100], "a new order every epoch");
    // The same draws at any world size: the ranks' shares interleave into the order.
    let ranks: Vec<Vec<usize>> = (0..3)
        .map(|r| m.clone().shard(r, 3).unwrap().epoch(0))
        .collect();
    let dealt: Vec<usize> = (0..order.len()).map(|p| ranks[p % 3][p / 3]).collect();
    assert_eq!(dealt, order);

    let first = Sampler::mixture(&lengths, &weights, MixStop::FirstExhausted)
        .unwrap()
        .shuffle(1);
    let o = first.epoch(2);
    let mut seen = std::collections::HashSet::new();
    assert!(o.iter().all(|&i| seen.insert(i)), "at most once");
    assert_eq!(o.len(), first.global_len_of(2));
    let ends = (0..3)
        .filter(|&s| o.iter().filter(|&&i| first.locate(i).0 == s).count() == lengths[s])
        .count();
    assert_eq!(ends, 1, "exactly one source ran out");

    let all = Sampler::mixture(&lengths, &weights, MixStop::AllExhausted)
        .unwrap()
        .shuffle(1);
    let o = all.epoch(0);
    let distinct: std::collections::HashSet<usize> = o.iter().copied().collect();
    assert_eq!(distinct.len(), 2000, "every item at least once");
    assert_eq!(all.locate(1000), (1, 0));
    assert_eq!(all.locate(999), (0, 999));

    assert!(Sampler::mixture(&[3, 0], &[1.0, 1.0], MixStop::Draws(5)).is_err());
    assert!(Sampler::mixture(&[3, 4], &[1.0], MixStop::Draws(5)).is_err());
    assert!(Sampler::mixture(&[3, 4], &[0.0, 0.0], MixStop::Draws(5)).is_err());
    assert!(Sampler::mixture(&[3, 4], &[1.0, -1.0], MixStop::Draws(5)).is_err());
}

#[test]
fn reshuffles_per_epoch_deterministically() {
    let s = Sampler::new(50).shuffle(3);
    assert_eq!(s.epoch(0), s.epoch(0));
    assert_ne!(s.epoch(0), s.epoch(1));
    assert_eq!(sorted(s.epoch(1)), (0..50).collect::<Vec<_>>());
    assert_eq!(Sampler::new(5).epoch(9), vec![0, 1, 2, 3, 4]);
}

#[test]
fn weighted_with_replacement_follows_the_weights() {
    let weights = [0.0, 1.0, 2.0, 3.0, 4.0];
    let n = 200_000;
    let s = Sampler::new(5)
        .shuffle(11)
        .weighted(&weights, n, true)
        .unwrap();
    let mut counts = [0usize; 5];
    for i in s.epoch(0) {
        counts[i] += 1;
    }
    assert_eq!(counts[0], 0, "a zero weight is never drawn");
    for (i, &c) in counts.iter().enumerate().skip(1) {
        let p = weights[i] / 10.0;
        let sd = (n as f64 * p * (1.0 - p)).sqrt();
        let dev = (c as f64 - n as f64 * p).abs();
        assert!(
            dev < 5.0 * sd,
            "index {i}: {c} draws, expected {}",
            n as f64 * p
        );
    }
    assert_ne!(s.epoch(0), s.epoch(1));
}

#[test]
fn weighted_without_replacement_draws_distinct_heavy_items_first() {
    let mut weights = vec![1.0; 100];
    weights[..10].fill(50.0);
    weights[99] = 0.0;
    let s = Sampler::new(100)
        .shuffle(5)
        .weighted(&weights, 99, false)
        .unwrap();
    let mut firsts = 0;
    for e in 0..50 {
        let order = s.epoch(e);
        assert_eq!(order.len(), 99);
        assert_eq!(
            sorted(order.clone()),
            (0..99).collect::<Vec<_>>(),
            "distinct"
        );
        firsts += order[..10].iter().filter(|&&i| i < 10).count();
    }
    // Drawn in proportion to the remaining weight, about 7.5 of the first 10 draws are
    // heavy (the first with probability 500/590, the tenth 50/139); uniformly it would
    // be about 1.
    assert!(
        firsts > 50 * 6,
        "{firsts} heavy items among 50 x 10 first draws"
    );
    assert!(Sampler::new(3)
        .weighted(&[1.0, 0.0, 1.0], 3, false)
        .is_err());
    assert!(Sampler::new(2).weighted(&[1.0, f64::NAN], 1, true).is_err());
    assert!(Sampler::new(2).weighted(&[1.0], 1, true).is_err());
}

#[test]
fn weighted_draws_are_sharded_too() {
    let s = Sampler::new(20)
        .shuffle(1)
        .weighted(&[1.0; 20], 45, true)
        .unwrap();
    let shards: Vec<Vec<usize>> = (0..4)
        .map(|r| {
            s.clone()
                .shard(r, 4)
                .unwrap()
                .shard_lengths(ShareLengths::Drop)
                .epoch(0)
        })
        .collect();
    assert!(shards.iter().all(|x| x.len() == 11));
    let global = s.epoch(0);
    let interleaved: Vec<usize> = (0..44).map(|p| shards[p % 4][p / 4]).collect();
    assert_eq!(
        interleaved,
        global[..44].to_vec(),
        "rank r holds positions r, r+4, ..."
    );
}

#[test]
fn a_shuffle_buffer_far_larger_than_the_dataset_allocates_only_the_dataset() {
    // 10^13 samples is a setting a user may write (a "buffer everything" bound); it used to
    // reserve that many slots and abort the process.
    let s = Sampler::new(10)
        .groups(&[4, 6])
        .unwrap()
        .shuffle(3)
        .buffer(10_000_000_000_000);
    assert_eq!(sorted(s.epoch(0)), (0..10).collect::<Vec<_>>());
}

#[test]
fn a_mixture_of_more_draws_than_an_epoch_may_hold_is_refused_by_name() {
    let e =
        Sampler::mixture(&[10, 10], &[1.0, 1.0], MixStop::Draws(MAX_EPOCH_ITEMS + 1)).unwrap_err();
    assert!(e.to_string().contains("draws an epoch; at most"), "{e}");
    assert!(Sampler::mixture(&[10, 10], &[1.0, 1.0], MixStop::Draws(1000)).is_ok());
}

proptest! {
    /// DataLoader workers split a rank's share: together they visit exactly the rank's
    /// positions (the padded copies included, once each), uneven by at most one (or, with
    /// tar shards' blocks, contiguous runs), whatever the counts' divisibility.
    #[test]
    fn workers_split_a_rank_share_exactly(
        n in 0usize..200, world in 1usize..5, workers in 1usize..6, seed in any::<u64>(),
        grouped in any::<bool>(),
        lengths in prop_oneof![Just(ShareLengths::Pad), Just(ShareLengths::Drop)],
    ) {
        let mut base = Sampler::new(n).shuffle(seed).shard_lengths(lengths);
        if grouped && n > 0 {
            let groups: Vec<usize> = (0..n).collect::<Vec<_>>().chunks(7).map(<[usize]>::len).collect();
            base = Sampler::new(n).groups(&groups).unwrap().shuffle(seed).buffer(5).shard_lengths(lengths);
        }
        for r in 0..world {
            let rank = base.clone().shard(r, world).unwrap();
            let share = rank.epoch(3);
            let parts: Vec<Vec<usize>> = (0..workers)
                .map(|w| rank.clone().split(w, workers).unwrap().epoch(3))
                .collect();
            for (w, p) in parts.iter().enumerate() {
                prop_assert_eq!(p.len(), rank.clone().split(w, workers).unwrap().len());
            }
            let lens: Vec<usize> = parts.iter().map(Vec::len).collect();
            prop_assert!(lens.iter().max().unwrap() - lens.iter().min().unwrap() <= 1, "{:?}", lens);
            prop_assert_eq!(sorted(parts.concat()), sorted(share.clone()), "rank {}", r);
            // Each worker's part keeps the rank's order.
            for p in &parts {
                let places: Vec<usize> = p.iter().map(|i| share.iter().position(|x| x == i).unwrap()).collect();
                prop_assert!(places.windows(2).all(|w| w[0] < w[1]) || lengths == ShareLengths::Pad);
            }
        }
    }
}

#[test]
fn a_worker_outside_its_range_is_refused() {
    assert!(Sampler::new(10).split(2, 2).is_err());
    assert!(Sampler::new(10).split(0, 0).is_err());
    assert_eq!(Sampler::new(10).split(0, 1).unwrap().len(), 10);
}

#[test]
fn a_split_of_one_worker_is_the_whole_share() {
    let s = Sampler::new(10).shuffle(3).shard(1, 2).unwrap();
    let one = s.clone().split(0, 1).unwrap();
    // Not recorded as a worker's split: its checkpoints are the rank's, and merge.
    assert_eq!(one.layout(0, Default::default()).split, None);
    assert_eq!(one.epoch(0), s.epoch(0));
}

#[test]
fn fingerprints_are_stable_and_tell_configurations_apart() {
    // Pinned: checkpoints store them, and a resume compares them field by field; a change in
    // how they are written would refuse every checkpoint saved before it.
    let grouped = |sizes: &[usize]| {
        Sampler::new(sizes.iter().sum())
            .groups(sizes)
            .unwrap()
            .shuffle(5)
            .buffer(4)
    };
    let f = grouped(&[3, 7]).fingerprint();
    let field = |v: Vec<(&'static str, String)>, k: &str| {
        v.into_iter().find(|(n, _)| *n == k).map(|(_, v)| v)
    };
    assert_eq!(
        f,
        vec![
            ("shuffle_seed", "5".to_string()),
            ("shard_lengths", "Uneven".to_string()),
            ("groups", "2 groups, 000a37000008b1fa".to_string()),
            ("shuffle_buffer", "4".to_string()),
        ]
    );
    let weighted = Sampler::new(4)
        .shuffle(1)
        .weighted(&[1.0, 2.0, 0.5, 4.0], 8, true)
        .unwrap()
        .fingerprint();
    assert_eq!(
        field(weighted, "weights").as_deref(),
        Some("8 draws, replacement true, 2de0000000000000")
    );
    assert_ne!(
        f,
        grouped(&[7, 3]).fingerprint(),
        "the groups' sizes, in order"
    );
    assert_ne!(f, grouped(&[5, 5]).fingerprint());
    assert_ne!(f, grouped(&[3, 7]).shuffle(6).fingerprint());
}

#[test]
fn a_mixtures_words_are_checked_before_its_sources_open() {
    use super::check_weights;
    assert!(check_weights(2, &[0.7, 0.3]).is_ok());
    assert!(check_weights(2, &[0.0, 1.0]).is_ok(), "a source left out");
    for (n, w, says) in [
        (2, &[1.0][..], "2 sources, 1 weights"),
        (0, &[][..], "at least one source: 0 sources"),
        (2, &[f64::NAN, 1.0][..], "weights[0] is NaN"),
        (2, &[1.0, f64::INFINITY][..], "weights[1] is inf"),
        (2, &[1.0, -0.5][..], "weights[1] is -0.5"),
        (2, &[0.0, 0.0][..], "every weight is 0"),
    ] {
        let e = check_weights(n, w).unwrap_err();
        assert!(e.starts_with("weights: ") && e.contains(says), "{e}");
    }
    assert_eq!(MixStop::named(Some(5), "all"), Ok(MixStop::Draws(5)));
    assert_eq!(MixStop::named(None, "first"), Ok(MixStop::FirstExhausted));
    assert_eq!(MixStop::named(None, "all"), Ok(MixStop::AllExhausted));
    assert!(MixStop::named(Some(0), "all")
        .unwrap_err()
        .starts_with("draws: must be in 1..="));
    let too_many = super::MAX_EPOCH_ITEMS as i128 + 1;
    assert!(MixStop::named(Some(too_many), "all").is_err());
    assert!(MixStop::named(Some(-1), "all")
        .unwrap_err()
        .ends_with("not -1"));
    assert_eq!(
        MixStop::named(None, "never").unwrap_err(),
        "stop: must be \"first\" or \"all\", not \"never\""
    );
    // With draws too, as a pipeline file's `stop` is read whether or not it has `draws`.
    assert_eq!(
        MixStop::named(Some(4), "never"),
        MixStop::named(None, "never")
    );
    // The sampler says the same of its weights.
    let e = Sampler::mixture(&[3, 3], &[1.0, f64::NAN], MixStop::AllExhausted).unwrap_err();
    assert!(
        e.to_string()
            .contains("mixture: weights: each must be finite"),
        "{e}"
    );
}

#[test]
fn mixtures_of_extreme_weights_are_drawn_or_refused_never_run_away() {
    // Weights near f64::MAX summed to infinity: every draw fell on the last source, and an
    // epoch ending once every source ran out never ended (23 GB, then the OOM killer).
    let huge = Sampler::mixture(&[20, 20], &[1e308, 1e308], MixStop::AllExhausted).unwrap();
    let order = huge.global_len();
    assert!((40..400).contains(&order), "{order}");
    let scaled = Sampler::mixture(&[20, 20], &[1.0, 1.0], MixStop::AllExhausted).unwrap();
    assert_eq!(
        order,
        scaled.global_len(),
        "the same draws as weights of the same ratio"
    );
    // A weight so small that drawing its source through would take more draws than an epoch
    // holds is refused, naming the source; with draws, or stop "first", it is fine.
    for tiny in [1e-10, 1e-300, f64::MIN_POSITIVE / 4.0] {
        let e = Sampler::mixture(&[20, 20], &[1.0, tiny], MixStop::AllExhausted).unwrap_err();
        assert!(
            e.to_string().contains("source 1 (20 items at weight"),
            "{e}"
        );
        assert!(Sampler::mixture(&[20, 20], &[1.0, tiny], MixStop::Draws(30)).is_ok());
        let first = Sampler::mixture(&[20, 20], &[1.0, tiny], MixStop::FirstExhausted).unwrap();
        assert!(first.global_len() <= 40);
    }
}

#[test]
fn an_order_past_the_memory_this_process_has_is_refused_naming_both() {
    let gib = 1u64 << 30;
    assert!(check_order_fits(1 << 20, gib, "the host's").is_ok());
    // 2^32 draws (the most a mixture may ask for): 96 GiB, refused on a 24 GiB machine.
    let e =
        check_order_fits(super::MAX_EPOCH_ITEMS, 24 * gib, "the host's MemAvailable").unwrap_err();
    assert_eq!(
        e,
        "an epoch of 4294967296 items: its order takes about 96.0 GiB (24 bytes an item, made \
         at each epoch's start), more than the 24.0 GiB this process has (the host's \
         MemAvailable); ask for fewer items (a mixture's draws) or run where there is more memory"
    );
    // At the edge: exactly what is available fits, a position more does not.
    let n = (gib / ORDER_BYTES_PER_ITEM) as usize;
    assert!(check_order_fits(n, n as u64 * ORDER_BYTES_PER_ITEM, "x").is_ok());
    assert!(check_order_fits(n + 1, n as u64 * ORDER_BYTES_PER_ITEM, "x").is_err());
}
