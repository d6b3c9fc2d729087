//! The loader (`flowgate::Loader`, what every front end builds) over tar shards and over a
//! mixture of shards and Parquet, with counts that divide by no world, batch or shard size:
//! every sample once across ranks with equal batches, a mixture resumed at its rank and at
//! another world size, and which checkpoints a loader takes. (The engine's own tests of the
//! same promises, on hand-built pipelines, are in `tests/integration/shards.rs`, `tests/integration/mixture.rs` and
//! `tests/integration/resume.rs`.)

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::sync::OnceLock;

use flowgate::dataset::{Labels, Source};
use flowgate::loader::Batch;
use flowgate::sampler::MixStop;
use flowgate::{Loader, PipelineState};

use crate::common;
use common::small_loader as loader;

/// Samples in the shards (4 shards of 11, 11, 11, 8) and rows in the Parquet file.
const SAMPLES: usize = 41;
const ROWS: usize = 23;

struct Data {
    shards: String,
    parquet: PathBuf,
}

fn data() -> &'static Data {
    static DATA: OnceLock<Data> = OnceLock::new();
    DATA.get_or_init(|| {
        let dir = Path::new(env!("CARGO_TARGET_TMPDIR")).join("loader-sources");
        let _ = std::fs::remove_dir_all(&dir);
        std::fs::create_dir_all(&dir).unwrap();
        let paths: Vec<PathBuf> = (0..SAMPLES)
            .map(|i| {
                let p = dir.join(format!("{i:03}.jpg"));
                std::fs::write(&p, common::tiny_jpeg(i)).unwrap();
                p
            })
            .collect();
        let shards =
            flowgate::dataset::shards::write_shards(&paths, &dir.join("shards"), 11, |i, _| {
                i as i64
            })
            .unwrap();
        let parquet = dir.join("rows.parquet");
        flowgate::dataset::parquet::write_parquet(&paths[..ROWS], &parquet, 5, |i, _| {
            1000 + i as i64
        })
        .unwrap();
        Data { shards, parquet }
    })
}

/// Each delivered item's label (a shard sample's index, or 1000 + a row's), batch by batch.
fn labels(batches: impl IntoIterator<Item = Batch>) -> Vec<Vec<i64>> {
    batches
        .into_iter()
        .map(|b| b.items.iter().map(|m| m.label.unwrap()).collect())
        .collect()
}

fn epoch(l: &mut Loader) -> Vec<Vec<i64>> {
    labels(l.epoch().unwrap().map(Result::unwrap).collect::<Vec<_>>())
}

fn shards() -> Source {
    Source::shards(data().shards.clone()).labels(Labels::Field("CLS".into()))
}

fn mixture() -> Source {
    Source::mix(
        [
            shards(),
            Source::parquet([&data().parquet], "image").labels(Labels::Field("label".into())),
        ],
        [0.6, 0.4],
    )
    .stop(MixStop::Draws(97))
}

fn multiset(v: impl IntoIterator<Item = i64>) -> BTreeMap<i64, usize> {
    let mut m = BTreeMap::new();
    for x in v {
        *m.entry(x).or_insert(0) += 1;
    }
    m
}

/// Tar shards through the loader at 3 ranks (41 samples: 14 a rank, one padded), two epochs:
/// each rank its `len()` batches, equal; every sample in every epoch, only padding repeated;
/// a new order each epoch.
#[test]
fn shards_through_the_loader_give_every_sample_once_across_ranks_with_equal_batches() {
    let mut ranks: Vec<Loader> = (0..3).map(|r| loader(shards(), 7, r, 3, 4)).collect();
    let mut orders = Vec::new();
    for e in 0..2 {
        let mut all = Vec::new();
        for (r, l) in ranks.iter_mut().enumerate() {
            let batches = epoch(l);
            assert_eq!(batches.len(), l.len(), "rank {r}, epoch {e}: its len()");
            assert_eq!(batches.len(), 4, "rank {r}: 14 samples in batches of 4");
            let mine: Vec<i64> = batches.concat();
            assert_eq!(mine.len(), 14, "rank {r}: equal shares");
            all.extend(mine);
        }
        assert_eq!(all.len(), 42);
        let counts = multiset(all.iter().copied());
        assert_eq!(counts.len(), SAMPLES, "epoch {e}: every sample");
        assert_eq!(
            counts.values().filter(|&&n| n == 2).count(),
            1,
            "one padded"
        );
        orders.push(all);
    }
    assert_ne!(orders[0], orders[1], "a new order each epoch");
}

/// A mixture of shards and Parquet (97 draws) through the loader: stopped and resumed twice
/// at its rank (through JSON, as a job stores it), the draws in order; two ranks stopped at
/// different batches, merged and finished by three, every draw once.
#[test]
fn a_mixture_through_the_loader_resumes_at_its_rank_and_at_another_world_size() {
    let whole: Vec<i64> = epoch(&mut loader(mixture(), 11, 0, 1, 5)).concat();
    assert_eq!(whole.len(), 97);
    assert!(whole.iter().any(|&l| l >= 1000) && whole.iter().any(|&l| l < 1000));

    let mut got = Vec::new();
    let mut state: Option<PipelineState> = None;
    for stop in [3, 7, usize::MAX] {
        let mut l = loader(mixture(), 11, 0, 1, 5);
        if let Some(s) = &state {
            let json = serde_json::to_string(s).unwrap();
            l.resume(&serde_json::from_str(&json).unwrap()).unwrap();
        }
        l.start_epoch().unwrap();
        let mut taken = Vec::new();
        while taken.len() < stop {
            match l.next_batch() {
                Some(b) => taken.push(b.unwrap()),
                None => break,
            }
        }
        got.extend(labels(taken).concat());
        state = Some(l.state().unwrap());
    }
    assert_eq!(
        got, whole,
        "chained resumes give the epoch's draws in order"
    );

    let mut before = Vec::new();
    let mut states = Vec::new();
    for (rank, k) in [(0, 2), (1, 6)] {
        let mut l = loader(mixture(), 11, rank, 2, 5);
        let taken: Vec<Batch> = l.epoch().unwrap().take(k).map(Result::unwrap).collect();
        before.extend(labels(taken).concat());
        states.push(l.state().unwrap());
    }
    let merged = PipelineState::merge(&states).unwrap();
    for rank in 0..3 {
        let mut l = loader(mixture(), 11, rank, 3, 5);
        l.resume(&merged).unwrap();
        before.extend(epoch(&mut l).concat());
    }
    // Ranks pad their shares to equal counts (at most one draw each time a world deals).
    let (got, want) = (
        multiset(before.iter().copied()),
        multiset(whole.iter().copied()),
    );
    let missing: Vec<_> = want
        .iter()
        .filter(|(k, &n)| got.get(k).copied().unwrap_or(0) < n)
        .collect();
    assert!(missing.is_empty(), "lost: {missing:?}");
    let extra: usize = got
        .iter()
        .map(|(k, &n)| n.saturating_sub(want.get(k).copied().unwrap_or(0)))
        .sum();
    assert!(extra <= 1 + 2, "{extra} repeated beyond the ranks' padding");
}

/// A loader takes only a checkpoint of the same dataset and batching: another seed, batch
/// size, file list or source kind is refused, naming what differs; one rank's state does not
/// resume another world (its progress is only its own), the whole world's merged state does.
#[test]
fn a_loader_takes_only_a_state_that_fits_it() {
    let mut l = loader(shards(), 3, 0, 1, 4);
    let _: Vec<Batch> = l.epoch().unwrap().take(2).map(Result::unwrap).collect();
    let state = l.state().unwrap();
    loader(shards(), 3, 0, 1, 4).resume(&state).unwrap();
    let fewer = Source::shards(data().shards.replace("000003", "000002"))
        .labels(Labels::Field("CLS".into()));
    for (mut other, differs) in [
        (loader(shards(), 4, 0, 1, 4), "shuffle_seed"),
        (loader(shards(), 3, 0, 1, 8), "batch_size"),
        (loader(fewer, 3, 0, 1, 4), "dataset"),
        (loader(mixture(), 3, 0, 1, 4), "dataset"),
    ] {
        let e = other.resume(&state).unwrap_err();
        assert!(
            e.is_config() && e.to_string().contains(differs),
            "{differs}: {e}"
        );
    }
    let mut rank0 = loader(shards(), 3, 0, 2, 4);
    let _: Vec<Batch> = rank0.epoch().unwrap().take(1).map(Result::unwrap).collect();
    let e = loader(shards(), 3, 0, 1, 4)
        .resume(&rank0.state().unwrap())
        .unwrap_err();
    assert!(e.to_string().contains("world_size of 2"), "{e}");
    loader(shards(), 3, 1, 2, 4).resume(&state).unwrap();
}
