//! 41 small JPEGs (a prime: no rank count, batch size or unit size divides it), one of them
//! replaceable by a file that is not one, and the loaders over them that the tests of units
//! (`tests/integration/units.rs`) and of readers (`tests/integration/readers.rs`) hold against each other.

use std::path::{Path, PathBuf};
use std::sync::OnceLock;

use flowgate::dataset::{Dataset, Ranks, Source};
use flowgate::loader::Batch;
use flowgate::media::{image::ImageRecipe, Recipe};
use flowgate::Loader;

/// Images: a prime, so no rank count, batch size or unit size divides it.
pub(crate) const IMAGES: usize = 41;

/// Their plain recipe: 12-pixel resize, 8-pixel center crop (no augmentation).
pub(crate) fn plain_recipe() -> Recipe {
    Recipe::image(ImageRecipe {
        resize: 12,
        crop: 8,
        ..ImageRecipe::default()
    })
    .unwrap()
}

/// `IMAGES` JPEGs, and the same list with item `BAD` a file that is not one (skipped and
/// counted).
pub(crate) fn paths(with_bad: bool) -> Vec<PathBuf> {
    static PATHS: OnceLock<(Vec<PathBuf>, PathBuf)> = OnceLock::new();
    let (good, bad) = PATHS.get_or_init(|| {
        let dir = Path::new(env!("CARGO_TARGET_TMPDIR")).join("units");
        let _ = std::fs::remove_dir_all(&dir);
        std::fs::create_dir_all(&dir).unwrap();
        let good = (0..IMAGES)
            .map(|i| {
                let p = dir.join(format!("{i:03}.jpg"));
                std::fs::write(&p, super::tiny_jpeg(i)).unwrap();
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

pub(crate) const BAD: usize = 17;

/// Rank `rank` of `world`, shuffled, batches of 5, random crops (so augmentation must match
/// too), `workers` decode threads.
pub(crate) fn loader(rank: usize, world: usize, drop_last: bool, workers: usize) -> Loader {
    build(paths(false), rank, world, drop_last, workers, false)
}

/// A loader of `files`; with `units`, one that decodes units (see
/// `LoaderBuilder::decodes_units`).
pub(crate) fn build(
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
pub(crate) fn builder(
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
pub(crate) type Seen = Vec<(usize, Vec<u8>)>;

pub(crate) fn seen(b: Batch) -> Seen {
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
pub(crate) fn same(got: &[Seen], want: &[Seen], what: &str) {
    if got != want {
        let ids = |v: &[Seen]| -> Vec<Vec<usize>> {
            v.iter()
                .map(|b| b.iter().map(|(i, _)| *i).collect())
                .collect()
        };
        panic!("{what}:\n got {:?}\nwant {:?}", ids(got), ids(want));
    }
}

pub(crate) fn local_epoch(l: &mut Loader) -> Vec<Seen> {
    l.epoch().unwrap().map(|b| seen(b.unwrap())).collect()
}
