//! A rank's epoch split among readers by whole batches (`LoaderBuilder::reader`, what PyTorch
//! `DataLoader` workers read): readers taken in turn give the local loader's batches and
//! `len()`, also after a resume, with `fill_skipped` and `drop_last`.

use std::path::PathBuf;

use flowgate::dataset::{Dataset, Ranks, Source};
use flowgate::media::{image::ImageRecipe, Recipe};
use flowgate::{Loader, PipelineState};

use crate::common;
use common::jpegs41::{build, builder, local_epoch, paths, same, seen, Seen, BAD, IMAGES};

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
    // Two cases: rank 1 of 2 over 32 files in order with two unreadable (each reader's
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
