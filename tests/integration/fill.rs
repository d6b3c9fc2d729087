//! `LoaderBuilder::fill_skipped`: ranks with skipped items still make `len()` batches (what a
//! training loop with a collective per step needs), by reading delivered items again, and
//! lose nothing. Counts that no rank count, worker count or batch size divides; bad files
//! placed so that, without filling, ranks end their epochs at different batch counts.

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::sync::OnceLock;

use flowgate::dataset::{Dataset, Source};
use flowgate::media::{image::ImageRecipe, Recipe};
use flowgate::{Loader, PipelineState};

use crate::common;

const GOOD: usize = 41;
const WORLD: usize = 3;
const BATCH: usize = 4;

/// 41 good JPEGs and 11 bad files, interleaved: the paths in listing order.
fn paths() -> &'static Vec<PathBuf> {
    static PATHS: OnceLock<Vec<PathBuf>> = OnceLock::new();
    PATHS.get_or_init(|| {
        let dir = Path::new(env!("CARGO_TARGET_TMPDIR")).join("fill");
        let _ = std::fs::remove_dir_all(&dir);
        std::fs::create_dir_all(&dir).unwrap();
        let mut out = Vec::new();
        let mut bad = 0;
        for i in 0..GOOD {
            let p = dir.join(format!("{i:03}.jpg"));
            std::fs::write(&p, common::tiny_jpeg(i)).unwrap();
            out.push(p);
            // Bad files in runs, so that some rank's share gets several.
            if i % 4 == 1 && bad < 11 {
                let b = dir.join(format!("{i:03}-bad.jpg"));
                std::fs::write(&b, b"not a jpeg").unwrap();
                out.push(b);
                bad += 1;
            }
        }
        out
    })
}

fn loader(rank: usize, drop_last: bool, fill: bool, seed: u64) -> Loader {
    let dataset = Dataset::builder(Source::files(paths().clone()))
        .shuffle(seed)
        .ranks(rank, WORLD)
        .build()
        .unwrap();
    build(dataset, BATCH, drop_last, fill)
}

/// A loader of `dataset`'s tiny JPEGs in batches of `batch`.
fn build(dataset: Dataset, batch: usize, drop_last: bool, fill: bool) -> Loader {
    let recipe = Recipe::image(ImageRecipe {
        resize: 12,
        crop: 8,
        ..ImageRecipe::default()
    })
    .unwrap();
    Loader::builder(dataset, recipe)
        .batch_size(batch)
        .drop_last(drop_last)
        .fill_skipped(fill)
        .build()
        .unwrap()
}

/// One epoch's batches: each batch's item paths.
fn epoch(l: &mut Loader) -> Vec<Vec<String>> {
    let batches: Vec<_> = l.epoch().unwrap().map(Result::unwrap).collect();
    batches
        .iter()
        .map(|b| {
            assert!(b.len() <= BATCH && !b.is_empty());
            b.items.iter().map(|m| l.path_of(m)).collect()
        })
        .collect()
}

fn counts(batches: &[Vec<String>]) -> BTreeMap<String, usize> {
    let mut c = BTreeMap::new();
    for p in batches.iter().flatten() {
        *c.entry(p.clone()).or_default() += 1;
    }
    c
}

#[test]
fn ranks_with_skipped_items_make_their_len_in_batches_and_lose_nothing() {
    for drop_last in [false, true] {
        for seed in [1, 2, 3] {
            let mut short = Vec::new();
            let mut union = [std::collections::BTreeSet::new(), Default::default()];
            for rank in 0..WORLD {
                let mut plain = loader(rank, drop_last, false, seed);
                let mut filled = loader(rank, drop_last, true, seed);
                let len = filled.len();
                assert_eq!(len, plain.len());
                for (e, seen_in_epoch) in union.iter_mut().enumerate() {
                    let p = epoch(&mut plain);
                    let f = epoch(&mut filled);
                    let what =
                        format!("rank {rank}, drop_last {drop_last}, seed {seed}, epoch {e}");
                    short.push(p.len() < len);
                    assert_eq!(f.len(), len, "{what}: the rank makes its len() in batches");
                    // The plain epoch's batches come first, unchanged; the rest are repeats
                    // of items this rank delivered in the epoch.
                    let kept = p.len();
                    if !drop_last {
                        seen_in_epoch.extend(p.iter().flatten().cloned());
                        assert!(f.iter().flatten().all(|i| !i.contains("-bad")), "{what}");
                    }
                    assert_eq!(f[..kept.min(f.len())], p[..kept.min(f.len())], "{what}");
                    let extra: usize = f[kept..].iter().map(Vec::len).sum();
                    let seen = counts(&p);
                    for item in f[kept..].iter().flatten() {
                        assert!(seen.contains_key(item), "{what}: {item} is a repeat");
                    }
                    assert_eq!(filled.filled(), extra as u64, "{what}: counted");
                    assert_eq!(filled.stats().failures, plain.stats().failures, "{what}");
                }
            }
            if !drop_last {
                for u in &union {
                    assert_eq!(
                        u.len(),
                        GOOD,
                        "every good item in every epoch, once at least"
                    );
                }
            }
            assert!(
                short.iter().any(|&s| s),
                "drop_last {drop_last}, seed {seed}: without filling some rank ends short \
                 (else this case proves nothing)"
            );
        }
    }
}

#[test]
fn a_resumed_rank_makes_the_rest_of_its_len_and_fillers_that_fail_are_replaced() {
    for drop_last in [false, true] {
        // Resume: the rank's own state after two batches; the resumed loader owes the rest.
        for rank in 0..WORLD {
            let mut first = loader(rank, drop_last, true, 5);
            let len = first.len();
            let state: PipelineState = {
                let mut it = first.epoch().unwrap();
                it.next().unwrap().unwrap();
                it.next().unwrap().unwrap();
                it.state().unwrap()
            };
            let mut resumed = loader(rank, drop_last, true, 5);
            resumed.resume(&state).unwrap();
            let rest = epoch(&mut resumed);
            assert_eq!(rest.len(), len - 2, "rank {rank}, drop_last {drop_last}");
            assert_eq!(epoch(&mut resumed).len(), len, "and the next epoch whole");
        }
    }
    // The epoch's first items (what fillers are read from first) spoiled after they were
    // delivered: fillers fail too, and the next positions make up the count.
    let dir = Path::new(env!("CARGO_TARGET_TMPDIR")).join("fill-spoiled");
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(&dir).unwrap();
    let mut files = Vec::new();
    for (i, p) in paths().iter().enumerate() {
        let q = dir.join(format!(
            "{i:03}-{}",
            p.file_name().unwrap().to_string_lossy()
        ));
        std::fs::copy(p, &q).unwrap();
        files.push(q);
    }
    let dataset = Dataset::builder(Source::files(files))
        .shuffle(9)
        .ranks(1, WORLD)
        .build()
        .unwrap();
    let mut l = build(dataset, BATCH, false, true);
    let len = l.len();
    l.start_epoch().unwrap();
    let mut batches = 0;
    let mut spoiled = 0;
    while let Some(b) = l.next_batch() {
        let b = b.unwrap();
        if batches == 0 {
            for m in &b.items {
                std::fs::write(l.path_of(m), b"spoiled").unwrap();
                spoiled += 1;
            }
        }
        batches += 1;
    }
    assert_eq!(
        batches, len,
        "the count made up from the positions after the spoiled ones"
    );
    let failures = l.watch().failures(None);
    let refailed = failures.iter().filter(|f| !f.item.contains("-bad")).count();
    assert_eq!(
        refailed, spoiled,
        "each spoiled filler failed once, counted: {failures:?}"
    );
    assert!(l.filled() > 0);
}

/// Each batch's item paths, from the loader's next `n` batches.
fn take(l: &mut Loader, n: usize) -> Vec<Vec<String>> {
    (0..n)
        .map(|_| {
            let b = l.next_batch().expect("a batch").unwrap();
            b.items.iter().map(|m| l.path_of(m)).collect()
        })
        .collect()
}

#[test]
fn a_checkpoint_at_any_batch_resumes_to_the_uninterrupted_batches_and_count() {
    let mut cases = 0;
    for drop_last in [false, true] {
        for seed in [1, 2] {
            for rank in 0..WORLD {
                let mut whole = loader(rank, drop_last, true, seed);
                let len = whole.len();
                let all = epoch(&mut whole);
                let own = epoch(&mut loader(rank, drop_last, false, seed)).len();
                if own == len {
                    continue;
                }
                // At the last own batch (the skipped items not tried again yet), and after
                // each made-up batch; through a serialized checkpoint, as a job stores it.
                for k in own.saturating_sub(1)..len {
                    let what = format!("rank {rank}, drop_last {drop_last}, seed {seed}, k {k}");
                    cases += 1;
                    let mut l = loader(rank, drop_last, true, seed);
                    l.start_epoch().unwrap();
                    let got = take(&mut l, k);
                    let json = serde_json::to_string(&l.state().unwrap()).unwrap();
                    drop(l);
                    let state: PipelineState = serde_json::from_str(&json).unwrap();
                    let mut r = loader(rank, drop_last, true, seed);
                    r.resume(&state).unwrap();
                    let rest = epoch(&mut r);
                    assert_eq!(got.len() + rest.len(), len, "{what}: the epoch's count");
                    assert_eq!(got[..], all[..k], "{what}");
                    if k >= own {
                        assert_eq!(rest[..], all[k..], "{what}: the same made-up batches");
                    }
                    assert_eq!(epoch(&mut r).len(), len, "{what}: the next epoch whole");
                }
                // A `break` while batches are made up: the epoch starts again from its
                // beginning, the same batches (made-up ones included); then the next.
                let mut l = loader(rank, drop_last, true, seed);
                l.start_epoch().unwrap();
                take(&mut l, own + 1);
                l.close();
                assert_eq!(l.abandoned_epoch(), Some((0, own + 1)), "rank {rank}");
                assert_eq!(l.next_epoch(), 0, "rank {rank}");
                assert_eq!(epoch(&mut l), all, "rank {rank}: epoch 0 again, whole");
                assert_eq!(l.next_epoch(), 1, "rank {rank}");
                assert_eq!(epoch(&mut l).len(), len);
            }
        }
    }
    assert!(cases >= 4, "{cases} checkpoints while batches are made up");
}

/// A loader over `pattern` ('g' a good JPEG, 'b' an unreadable file) in listing order, as
/// one process.
fn patterned(dir: &Path, pattern: &str, batch: usize, drop_last: bool) -> Loader {
    let files: Vec<PathBuf> = pattern
        .chars()
        .enumerate()
        .map(|(i, c)| {
            let p = dir.join(format!("{i:04}.jpg"));
            if !p.exists() {
                let bytes = if c == 'g' {
                    common::tiny_jpeg(i)
                } else {
                    b"not a jpeg".to_vec()
                };
                std::fs::write(&p, bytes).unwrap();
            }
            p
        })
        .collect();
    let dataset = Dataset::builder(Source::files(files))
        .ranks(0, 1)
        .build()
        .unwrap();
    build(dataset, batch, drop_last, true)
}

#[test]
fn resumes_at_every_batch_when_few_files_are_readable_or_the_last_is_not() {
    // Fillers among unreadable positions (a resumed fill must not take those as fillers),
    // two readable files for many batches, a bad file left in the dropped tail (a state
    // after the last batch owes nothing and must not end in an error).
    let cases = [
        ("bbgbgbgbgg", 3, true),
        ("bbgbgbgbgg", 3, false),
        ("bggbbbbbbb", 2, false),
        ("bggbbbbbbb", 2, true),
        ("gggggggggb", 3, true),
        ("gggggggggb", 3, false),
        ("gbgbgbgbgbgbg", 4, false),
    ];
    for (n, &(pattern, batch, drop_last)) in cases.iter().enumerate() {
        let dir = Path::new(env!("CARGO_TARGET_TMPDIR")).join(format!("fill-pattern-{n}"));
        let _ = std::fs::remove_dir_all(&dir);
        std::fs::create_dir_all(&dir).unwrap();
        let mut whole = patterned(&dir, pattern, batch, drop_last);
        let len = whole.len();
        let all = epoch(&mut whole);
        assert_eq!(
            all.len(),
            len,
            "{pattern} / {batch} / drop_last {drop_last}"
        );
        for k in 0..=len {
            let what = format!("{pattern} / {batch} / drop_last {drop_last}, after {k}");
            let mut l = patterned(&dir, pattern, batch, drop_last);
            l.start_epoch().unwrap();
            let got = take(&mut l, k);
            let json = serde_json::to_string(&l.state().unwrap()).unwrap();
            drop(l);
            let mut r = patterned(&dir, pattern, batch, drop_last);
            r.resume(&serde_json::from_str(&json).unwrap()).unwrap();
            let rest: Vec<_> = r.epoch().unwrap().collect();
            let rest: Vec<Vec<String>> = rest
                .into_iter()
                .map(|b| {
                    let b = b.unwrap_or_else(|e| panic!("{what}: {e}"));
                    b.items.iter().map(|m| r.path_of(m)).collect()
                })
                .collect();
            assert_eq!(got[..], all[..k], "{what}");
            assert_eq!(rest[..], all[k..], "{what}: the rest, the same batches");
            assert_eq!(epoch(&mut r), all, "{what}: the next epoch as the first");
        }
    }
}

#[test]
fn a_rank_state_resumed_in_worker_parts_owes_each_part_its_own() {
    // Every file readable: filling adds nothing, also when a rank's state (which owes the
    // rank's rest) is resumed in each of two DataLoader workers' parts.
    let good: Vec<PathBuf> = paths()
        .iter()
        .filter(|p| !p.to_string_lossy().contains("-bad"))
        .cloned()
        .collect();
    let part = |worker: Option<usize>, fill: bool| {
        let mut d = Dataset::builder(Source::files(good.clone()))
            .shuffle(4)
            .ranks(1, WORLD);
        if let Some(w) = worker {
            d = d.split(w, 2);
        }
        build(d.build().unwrap(), BATCH, false, fill)
    };
    let mut rank = part(None, true);
    rank.start_epoch().unwrap();
    take(&mut rank, 2);
    let state = rank.state().unwrap();
    assert!(state.owed_batches.is_some());
    for w in 0..2 {
        let count = |fill: bool| {
            let mut l = part(Some(w), fill);
            l.resume(&state).unwrap();
            epoch(&mut l).len()
        };
        assert_eq!(count(true), count(false), "worker {w}");
    }
}

#[test]
fn the_fill_is_on_by_default_under_ranks_and_off_for_one_process() {
    let recipe = || {
        Recipe::image(ImageRecipe {
            resize: 12,
            crop: 8,
            ..ImageRecipe::default()
        })
        .unwrap()
    };
    let defaulted = |rank: usize, world: usize| {
        let dataset = Dataset::builder(Source::files(paths().clone()))
            .shuffle(1)
            .ranks(rank, world)
            .build()
            .unwrap();
        Loader::builder(dataset, recipe())
            .batch_size(BATCH)
            .build()
            .unwrap()
    };
    // Under ranks: the filled loader's batches, every rank its len().
    let mut ended_short = false;
    for rank in 0..WORLD {
        let mut d = defaulted(rank, WORLD);
        let got = epoch(&mut d);
        assert_eq!(got.len(), d.len(), "rank {rank}: its len() by default");
        assert_eq!(got, epoch(&mut loader(rank, false, true, 1)), "rank {rank}");
        ended_short |= epoch(&mut loader(rank, false, false, 1)).len() < d.len();
    }
    assert!(
        ended_short,
        "without the fill some rank ends short (the test binds)"
    );
    // One process: a skipped file makes the epoch shorter, nothing is read again.
    let mut one = defaulted(0, 1);
    let got = epoch(&mut one);
    assert_eq!(one.filled(), 0);
    assert!(got.iter().flatten().all(|p| !p.contains("-bad")));
    assert_eq!(got.iter().map(Vec::len).sum::<usize>(), GOOD);
}

/// One process over 41 files, one corrupt and the last missing, batches of 8: `len()` counts
/// 6, 5 come (nothing is made up in one process, so no file comes twice), and the loader says
/// so at the epoch's end ([`flowgate::loader::EpochReport`]) and names its first skip once.
#[test]
fn one_process_says_at_the_epochs_end_what_it_skipped_against_len() {
    let good = paths()
        .iter()
        .filter(|p| !p.to_string_lossy().contains("bad"))
        .take(39)
        .cloned()
        .collect::<Vec<_>>();
    let bad = paths()
        .iter()
        .find(|p| p.to_string_lossy().contains("bad"))
        .unwrap();
    let mut files = good.clone();
    files.insert(10, bad.clone());
    files.push(bad.with_file_name("missing.jpg"));
    let dataset = Dataset::builder(Source::files(files.clone()))
        .build()
        .unwrap();
    let mut l = build(dataset, 8, false, false);
    assert_eq!(l.len(), 6);
    for epoch in 0..2u64 {
        let mut seen = Vec::new();
        let mut batches = 0;
        for b in l.epoch().unwrap() {
            let b = b.unwrap();
            batches += 1;
            seen.extend(b.items.iter().map(|m| m.index));
        }
        seen.sort_unstable();
        seen.dedup();
        assert_eq!(
            (batches, seen.len()),
            (5, 39),
            "epoch {epoch}: each readable file once"
        );
        let report = l.take_epoch_report().expect("a report at the epoch's end");
        assert_eq!(
            report,
            flowgate::loader::EpochReport {
                epoch,
                skipped: 2,
                delivered: 5,
                due: 6,
                len: 6,
                filled: 0,
            }
        );
        let said = report.to_string();
        assert!(
            said.contains(
                "skipped 2 unreadable items and delivered 5 batches where len() counts 6"
            ),
            "{said}"
        );
        assert!(l.take_epoch_report().is_none(), "said once");
        let first = l.take_first_skip();
        assert_eq!(first.is_some(), epoch == 0, "the first skip, once a loader");
        if let Some((f, message)) = first {
            assert!(f.item.ends_with("bad.jpg"), "{f:?}");
            assert!(message.contains("said once a loader"), "{message}");
        }
    }
    // Resumed after two batches: the rest was due 4 batches and made 3, said against those.
    let mut it = l.epoch().unwrap();
    it.next().unwrap().unwrap();
    it.next().unwrap().unwrap();
    let state = it.state().unwrap();
    drop(it);
    let dataset = Dataset::builder(Source::files(files.clone()))
        .build()
        .unwrap();
    let mut again = build(dataset, 8, false, false);
    again.resume(&state).unwrap();
    assert_eq!(again.epoch().unwrap().count(), 3);
    let r = again.take_epoch_report().expect("said");
    assert_eq!((r.delivered, r.due, r.len), (3, 4, 6), "{r:?}");
    assert!(
        r.to_string()
            .contains("delivered 3 batches where 4 were due (the rest of a resumed epoch"),
        "{r}"
    );
    // Nothing skipped, every batch len() counts: nothing to say.
    let dataset = Dataset::builder(Source::files(good)).build().unwrap();
    let mut l = build(dataset, 8, false, false);
    assert_eq!(l.epoch().unwrap().count(), 5);
    assert!(l.take_epoch_report().is_none() && l.take_first_skip().is_none());
}

/// A failure that ends the epoch (fail-fast) was not skipped: nothing says it was, and a
/// later skip of the same loader is still said as its first.
#[test]
fn a_fatal_failure_is_not_said_to_be_skipped() {
    let bad = paths()
        .iter()
        .find(|p| p.to_string_lossy().contains("bad"))
        .unwrap()
        .clone();
    let good: Vec<PathBuf> = paths()
        .iter()
        .filter(|p| !p.to_string_lossy().contains("bad"))
        .take(6)
        .cloned()
        .collect();
    let mut files = good.clone();
    files.insert(3, bad);
    let dataset = Dataset::builder(Source::files(files)).build().unwrap();
    let recipe = Recipe::image(ImageRecipe {
        resize: 12,
        crop: 8,
        ..ImageRecipe::default()
    })
    .unwrap();
    let mut l = Loader::builder(dataset, recipe)
        .batch_size(2)
        .max_failures(flowgate::FailureBudget::fail_fast())
        .build()
        .unwrap();
    let ended = l.epoch().unwrap().find_map(Result::err);
    assert!(ended.is_some(), "fail-fast ends the epoch");
    assert!(l.take_first_skip().is_none(), "not said to be skipped");
    assert!(l.take_epoch_report().is_none());
}
